//! Who is calling: principals configured in the daemon, how a call is tied
//! to one (a bearer token's digest, or the peer uid of the unix socket),
//! and the authorization rules every RPC applies — in one place, pure and
//! tested with exact vectors. The API layer authenticates (an interceptor
//! puts the [`Principal`] in the request's extensions) and the domain takes
//! the principal as an argument.

mod config;
mod identify;
mod reload;

use std::collections::BTreeSet;

pub use config::{is_principal_name, load_principals, PrincipalConfig};

/// The names a client certificate (DER) is known by: its subject's common
/// names and its DNS subject alternative names. Empty if it does not parse.
pub fn certificate_names(der: &[u8]) -> Vec<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else { return Vec::new() };
    let mut names: Vec<String> =
        cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok().map(String::from)).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(dns) = name {
                names.push(dns.to_string());
            }
        }
    }
    names
}
pub use identify::{local_admin_token, Authenticator, Credential, LOCAL_ADMIN};
pub use reload::Principals;

/// A governed consumer type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConsumerType {
    /// The administrator (`adm`): the only type that may pass session policies.
    Adm,
    /// The `agt` consumer type.
    Agt,
    /// The `atm` consumer type.
    Atm,
}

impl ConsumerType {
    /// The type written as `adm`, `agt` or `atm`; `None` for anything else.
    pub fn parse(text: &str) -> Option<ConsumerType> {
        match text {
            "adm" => Some(ConsumerType::Adm),
            "agt" => Some(ConsumerType::Agt),
            "atm" => Some(ConsumerType::Atm),
            _ => None,
        }
    }

    /// The type as written (`adm`, `agt`, `atm`).
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumerType::Adm => "adm",
            ConsumerType::Agt => "agt",
            ConsumerType::Atm => "atm",
        }
    }
}

/// The projects a principal may act in and see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Projects {
    /// Every project (`adm` only).
    All,
    /// Only these projects.
    Only(BTreeSet<String>),
}

/// A caller the daemon knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Its configured name (`local-admin` for the implicit administrator).
    pub name: String,
    /// Its consumer type.
    pub kind: ConsumerType,
    /// The projects it may act in and see.
    pub projects: Projects,
    /// Executions and sessions it may have running at once.
    pub max_running: Option<usize>,
    /// Where its repositories may be (absolute prefixes), within the
    /// daemon's `repo_roots`; empty: anywhere within them.
    pub repos: Vec<std::path::PathBuf>,
    /// Beneath which a profile's absolute write paths may lie for its runs
    /// (see `PrincipalConfig::write_roots`); `adm`: anywhere.
    pub write_roots: Vec<std::path::PathBuf>,
    /// May decide others' waiting tool calls in its projects.
    pub approve: bool,
}

/// Where a run may write on the host (see [`crate::policy::HostWrites`]):
/// as its principal `name`, `known` as this node configures it now (a
/// reload may have changed its type or roots). One this node does not
/// know writes nowhere, unless the node knows no principal at all
/// (`knows_others` false: a fleet's worker, which takes no calls) and the
/// accepting node admitted the run as `adm`; a principal a reload removed
/// is not so trusted.
pub fn host_writes_of<'a>(
    known: Option<&'a Principal>,
    name: &'a str,
    actor: &str,
    knows_others: bool,
) -> crate::policy::HostWrites<'a> {
    match (known, actor) {
        (Some(principal), _) => principal.host_writes(),
        (None, "adm") if !knows_others => crate::policy::HostWrites::Anywhere,
        (None, _) => crate::policy::HostWrites::Beneath { principal: name, roots: &[] },
    }
}

/// Why a call is refused: a stable machine reason and a sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denied {
    /// A stable machine-readable reason, e.g. `PROJECT_NOT_ALLOWED`.
    pub reason: &'static str,
    /// A sentence for the caller.
    pub message: String,
}

/// The project new work goes to when a caller names none.
pub const DEFAULT_PROJECT: &str = "default";

impl Principal {
    /// Where its runs may write on the host (see [`crate::policy::HostWrites`]).
    pub fn host_writes(&self) -> crate::policy::HostWrites<'_> {
        if self.is_admin() {
            return crate::policy::HostWrites::Anywhere;
        }
        crate::policy::HostWrites::Beneath { principal: &self.name, roots: &self.write_roots }
    }

    /// Whether its type is `adm`.
    pub fn is_admin(&self) -> bool {
        self.kind == ConsumerType::Adm
    }

    /// Whether records of `project` exist for this principal (NOT_FOUND
    /// otherwise, so that existence does not leak).
    pub fn can_see(&self, project: &str) -> bool {
        match &self.projects {
            Projects::All => true,
            Projects::Only(set) => set.contains(project),
        }
    }

    /// The actor and project new work runs as. `actor` must be empty (it is
    /// then the principal's type) or equal to it; a string that is no
    /// governed type at all is passed on for resolution to refuse with the
    /// contract's sentence. `project` must be empty (the principal's only
    /// project, or `default` for one that sees all) or one of its projects.
    pub fn admit(&self, actor: &str, project: &str) -> Result<(String, String), Denied> {
        let actor = match ConsumerType::parse(actor) {
            _ if actor.is_empty() => self.kind.as_str().to_string(),
            Some(kind) if kind == self.kind => actor.to_string(),
            Some(kind) => {
                return Err(Denied {
                    reason: "ACTOR_NOT_PRINCIPAL_TYPE",
                    message: format!(
                        "actor {} is not the type of principal {} ({})",
                        kind.as_str(),
                        self.name,
                        self.kind.as_str()
                    ),
                })
            }
            None => actor.to_string(),
        };
        let project = if project.is_empty() {
            match &self.projects {
                Projects::All => DEFAULT_PROJECT.to_string(),
                Projects::Only(set) if set.len() == 1 => set.iter().next().cloned().unwrap_or_default(),
                Projects::Only(_) => {
                    return Err(Denied {
                        reason: "PROJECT_REQUIRED",
                        message: format!("principal {} has several projects: name one", self.name),
                    })
                }
            }
        } else {
            project.to_string()
        };
        if !self.can_see(&project) {
            return Err(Denied {
                reason: "PROJECT_NOT_ALLOWED",
                message: format!("principal {} may not act in project {project}", self.name),
            });
        }
        Ok((actor, project))
    }

    /// Session policies (and a dry run of the gate with them) are for `adm`.
    pub fn may_set_policies(&self) -> Result<(), Denied> {
        self.adm_only("POLICIES_NEED_ADM", "pass policies")
    }

    /// The fleet's nodes (listing and draining them) are for `adm`.
    pub fn may_manage_nodes(&self) -> Result<(), Denied> {
        self.adm_only("NODES_NEED_ADM", "list or drain nodes")
    }

    /// `adm` may `act`; anyone else is refused with `reason`.
    fn adm_only(&self, reason: &'static str, act: &str) -> Result<(), Denied> {
        match self.is_admin() {
            true => Ok(()),
            false => Err(Denied {
                reason,
                message: format!("principal {} is {}: only adm may {act}", self.name, self.kind.as_str()),
            }),
        }
    }

    /// The raw output of a finished execution: its owner and `adm`.
    pub fn may_read_raw(&self, owner: &str) -> bool {
        self.is_admin() || self.name == owner
    }

    /// The projects a listing is narrowed to (`None`: all).
    pub fn visible_projects(&self) -> Option<Vec<String>> {
        match &self.projects {
            Projects::All => None,
            Projects::Only(set) => Some(set.iter().cloned().collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agt(projects: &[&str]) -> Principal {
        Principal {
            name: "ci".into(),
            kind: ConsumerType::Agt,
            projects: Projects::Only(projects.iter().map(|p| p.to_string()).collect()),
            max_running: None,
            repos: Vec::new(),
            write_roots: Vec::new(),
            approve: false,
        }
    }

    fn adm() -> Principal {
        Principal {
            name: "root".into(),
            kind: ConsumerType::Adm,
            projects: Projects::All,
            max_running: None,
            repos: Vec::new(),
            write_roots: Vec::new(),
            approve: false,
        }
    }

    /// A run's host writes: its principal as configured now; an unknown
    /// one only on a node that knows no principal, and only as `adm`.
    #[test]
    fn host_writes_follow_the_principal_as_configured_now() {
        use crate::policy::HostWrites;
        let roots = |w: HostWrites<'_>| match w {
            HostWrites::Anywhere => None,
            HostWrites::Beneath { principal, roots } => Some((principal.to_string(), roots.to_vec())),
        };
        let mut tenant = agt(&["a"]);
        tenant.write_roots = vec!["/srv/ci".into()];
        let demoted = agt(&["a"]);
        for (known, actor, knows_others, expected) in [
            (Some(&tenant), "agt", true, Some(("ci", vec!["/srv/ci".into()]))),
            (Some(&adm()), "adm", true, None),
            // Admitted as adm, now an agt: its roots, none.
            (Some(&demoted), "adm", true, Some(("ci", vec![]))),
            (None, "adm", false, None),
            (None, "adm", true, Some(("gone", vec![]))),
            (None, "agt", false, Some(("gone", vec![]))),
        ] {
            let expected = expected.map(|(n, r): (&str, Vec<std::path::PathBuf>)| (n.to_string(), r));
            let name = known.map_or("gone", |p| p.name.as_str());
            assert_eq!(roots(host_writes_of(known, name, actor, knows_others)), expected, "{actor} {knows_others}");
        }
    }

    #[test]
    fn the_actor_is_the_principals_type_or_nothing_else_governed() {
        let p = agt(&["a"]);
        assert_eq!(p.admit("", "a"), Ok(("agt".into(), "a".into())));
        assert_eq!(p.admit("agt", ""), Ok(("agt".into(), "a".into())));
        assert_eq!(p.admit("adm", "a").unwrap_err().reason, "ACTOR_NOT_PRINCIPAL_TYPE");
        assert_eq!(p.admit("atm", "a").unwrap_err().reason, "ACTOR_NOT_PRINCIPAL_TYPE");
        // Not a governed type at all: resolution refuses it with the contract's words.
        assert_eq!(p.admit("rein-aharness@railiance01", "a"), Ok(("rein-aharness@railiance01".into(), "a".into())));
    }

    #[test]
    fn projects_are_the_principals_own() {
        let p = agt(&["a", "b"]);
        assert_eq!(p.admit("", "b"), Ok(("agt".into(), "b".into())));
        assert_eq!(p.admit("", "c").unwrap_err().reason, "PROJECT_NOT_ALLOWED");
        assert_eq!(p.admit("", "").unwrap_err().reason, "PROJECT_REQUIRED");
        assert!(p.can_see("a") && !p.can_see("c"));
        assert_eq!(p.visible_projects(), Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(adm().admit("", ""), Ok(("adm".into(), "default".into())));
        assert!(adm().can_see("anything"));
        assert_eq!(adm().visible_projects(), None);
    }

    #[test]
    fn policies_and_raw_output() {
        assert_eq!(agt(&["a"]).may_set_policies().unwrap_err().reason, "POLICIES_NEED_ADM");
        assert_eq!(agt(&["a"]).may_manage_nodes().unwrap_err().reason, "NODES_NEED_ADM");
        assert!(adm().may_set_policies().is_ok());
        assert!(adm().may_manage_nodes().is_ok());
        assert!(agt(&["a"]).may_read_raw("ci"));
        assert!(!agt(&["a"]).may_read_raw("someone-else"));
        assert!(adm().may_read_raw("someone-else"));
    }
}
