//! Principals as configured: `[[principals]]` in the daemon config, and
//! one per `*.toml` file in `principals_dir` for operators who manage them
//! with other tools. A token is never kept in clear: the config names its
//! sha256 (`token_sha256`) or where to read it at start (`token_file`,
//! `token_env`), and only the digest is kept.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{ConsumerType, Principal, Projects};

/// One principal as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrincipalConfig {
    /// Its name, 1-64 letters, digits, '.', '_' or '-' that make a git ref
    /// component (see [`is_principal_name`]), never `local-admin`: what
    /// records and quotas know it by.
    pub name: String,
    /// `adm`, `agt` or `atm`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The projects it may act in; `["*"]` (adm only) for all.
    pub projects: Vec<String>,
    /// sha256 (hex) of its bearer token.
    pub token_sha256: Option<String>,
    /// A file holding its bearer token (read and hashed at start).
    pub token_file: Option<PathBuf>,
    /// An environment variable holding its bearer token.
    pub token_env: Option<String>,
    /// Peer uids of the unix socket that are this principal (refused when
    /// there is no socket: `unix_socket = ""`).
    pub unix_uids: Vec<u32>,
    /// Client certificates (mTLS) that are this principal: a name matching
    /// the certificate's subject common name or one of its DNS names
    /// (refused without `client_ca`: no certificate would be asked for).
    pub tls_names: Vec<String>,
    /// Executions and sessions it may have running at once.
    pub max_running: Option<usize>,
    /// Absolute prefixes its `repo` must be under (within the daemon's
    /// `repo_roots`); empty: any repository under the roots.
    pub repos: Vec<PathBuf>,
    /// Host directories (absolute) beneath which a profile's absolute
    /// `sandbox.write_paths` may lie for its runs; empty: none (an `adm`
    /// principal's runs may write any). Such a path is shared by every run
    /// of the profile, whoever runs it: tenants stay apart only if each
    /// writes its own.
    pub write_roots: Vec<PathBuf>,
    /// It may decide other principals' tool calls waiting for approval in
    /// its projects (`DecideToolCall`). Its own runs' calls it may always
    /// decide, and `adm` any.
    pub approve: bool,
}

/// A principal with the digests of its credentials.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub principal: Principal,
    pub token_digests: Vec<[u8; 32]>,
    pub unix_uids: Vec<u32>,
    pub tls_names: Vec<String>,
}

/// The digest a bearer token is known by.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.trim().as_bytes()).into()
}

fn hex32(text: &str) -> Option<[u8; 32]> {
    hex::FromHex::from_hex(text.trim()).ok()
}

/// A principal's name: 1-64 letters, digits, `.`, `_` or `-` (so never a
/// `/`: scoped session ids rely on it), and a valid git ref component, as
/// session refs are `refs/corral/<principal>/<id>`: no `..`, not starting
/// with `.` or `-`, not ending with `.` or `.lock`.
pub fn is_principal_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        && crate::types::ref_component_problem(name).is_none()
}

impl PrincipalConfig {
    /// Validates and loads; errors name `key` (e.g. `principals[2]` or a file).
    pub fn load(&self, key: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Loaded, String> {
        let name = &self.name;
        if !is_principal_name(name) {
            return Err(format!(
                "{key}.name: {name:?} must be 1-64 letters, digits, '.', '_' or '-' that make a git ref component \
                 (no \"..\", not starting with '.' or '-', not ending with '.' or \".lock\")"
            ));
        }
        if name == super::LOCAL_ADMIN {
            return Err(format!(
                "{key}.name: {name:?} is the built-in administrator (root and the daemon's uid on the unix socket, \
                 the admin token); a principal of that name would share its raw output, sessions and approvals"
            ));
        }
        let kind = ConsumerType::parse(&self.kind)
            .ok_or_else(|| format!("{key}.type: {:?} is not adm, agt or atm", self.kind))?;
        let projects = if self.projects.iter().any(|p| p == "*") {
            if kind != ConsumerType::Adm || self.projects.len() != 1 {
                return Err(format!("{key}.projects: \"*\" (all projects) is for adm only, and alone"));
            }
            Projects::All
        } else if self.projects.is_empty() {
            if kind == ConsumerType::Adm {
                Projects::All
            } else {
                return Err(format!("{key}.projects: a non-adm principal needs at least one project"));
            }
        } else {
            // What a request may name (`project` is a token): a project no
            // request could name would be one this principal never works in.
            for p in &self.projects {
                if p.is_empty() || p.len() > 128 || !p.chars().all(|c| c.is_ascii_graphic()) {
                    return Err(format!(
                        "{key}.projects: {p:?} is not a project name a request can name \
                         (1 to 128 bytes of printable ASCII without spaces)"
                    ));
                }
            }
            Projects::Only(self.projects.iter().cloned().collect::<BTreeSet<_>>())
        };
        let mut token_digests = Vec::new();
        if let Some(hex) = &self.token_sha256 {
            token_digests.push(hex32(hex).ok_or_else(|| format!("{key}.token_sha256: must be 64 hex digits"))?);
        }
        if let Some(path) = &self.token_file {
            let token =
                std::fs::read_to_string(path).map_err(|e| format!("{key}.token_file: {}: {e}", path.display()))?;
            token_digests.push(strong(&token, &format!("{key}.token_file"))?);
        }
        if let Some(var) = &self.token_env {
            let token = env(var).ok_or_else(|| format!("{key}.token_env: {var} is not set"))?;
            token_digests.push(strong(&token, &format!("{key}.token_env"))?);
        }
        for n in &self.tls_names {
            if n.is_empty() || n.len() > 255 || n.chars().any(|c| c.is_control()) {
                return Err(format!("{key}.tls_names: {n:?} is not a certificate name"));
            }
        }
        if token_digests.is_empty() && self.unix_uids.is_empty() && self.tls_names.is_empty() {
            return Err(format!("{key}: no credential (token_sha256, token_file, token_env, unix_uids or tls_names)"));
        }
        for repo in &self.repos {
            if !repo.is_absolute() {
                return Err(format!("{key}.repos: {} must be an absolute path", repo.display()));
            }
        }
        for root in &self.write_roots {
            if !crate::policy::plain_absolute(root) {
                return Err(format!(
                    "{key}.write_roots: {} must be an absolute path without . or .. components",
                    root.display()
                ));
            }
        }
        if self.max_running == Some(0) {
            return Err(format!("{key}.max_running: must be greater than 0"));
        }
        Ok(Loaded {
            principal: Principal {
                name: name.clone(),
                kind,
                projects,
                max_running: self.max_running,
                repos: self.repos.clone(),
                write_roots: self.write_roots.clone(),
                approve: self.approve,
            },
            token_digests,
            unix_uids: self.unix_uids.clone(),
            tls_names: self.tls_names.clone(),
        })
    }
}

impl PrincipalConfig {
    /// Refuses, among `principals` (the config's `[[principals]]`) and the
    /// files of `principals_dir`, a credential none of the daemon's
    /// listeners presents: `unix_uids` without a unix socket (`unix_socket`
    /// false), `tls_names` without `client_ca` (the TLS listener asks for
    /// no certificate). It would load and never identify anyone. A file
    /// that cannot be read or parsed is left to [`load_principals`], which
    /// refuses it naming it. The error is `(key, why)`.
    pub fn check_listeners(
        principals: &[PrincipalConfig],
        principals_dir: Option<&Path>,
        unix_socket: bool,
        client_ca: bool,
    ) -> Result<(), (String, String)> {
        let files = principals_dir.map(principal_files).and_then(Result::ok).unwrap_or_default();
        let configured = principals.iter().enumerate().map(|(i, p)| (format!("principals[{i}]"), p.clone()));
        let in_files = files.iter().filter_map(|file| Some((file.display().to_string(), read_file(file).ok()?)));
        for (key, p) in configured.chain(in_files) {
            if !p.unix_uids.is_empty() && !unix_socket {
                return Err((
                    format!("{key}.unix_uids"),
                    "no unix socket is served (unix_socket = \"\"): no peer uid can be this principal".into(),
                ));
            }
            if !p.tls_names.is_empty() && !client_ca {
                return Err((
                    format!("{key}.tls_names"),
                    "client certificates are not asked for without client_ca: no TLS name can be this principal".into(),
                ));
            }
        }
        Ok(())
    }
}

/// The `*.toml` files of `dir`, sorted.
fn principal_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("principals_dir: {}: {e}", dir.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    Ok(files)
}

/// One principal file, parsed; errors name the file.
fn read_file(file: &Path) -> Result<PrincipalConfig, String> {
    let key = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|e| format!("{key}: {e}"))?;
    toml::from_str(&text).map_err(|e| format!("{key}: {e}"))
}

/// A token read from a file or the environment must be high-entropy.
fn strong(token: &str, key: &str) -> Result<[u8; 32], String> {
    let token = token.trim();
    if token.len() < 32 {
        return Err(format!("{key}: the token must be at least 32 characters (a random one)"));
    }
    Ok(token_digest(token))
}

/// The principals of the config plus those of `dir` (one per `*.toml`),
/// names unique.
pub fn load_principals(
    configured: &[PrincipalConfig],
    dir: Option<&Path>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<Loaded>, String> {
    let mut loaded = Vec::new();
    for (i, p) in configured.iter().enumerate() {
        loaded.push(p.load(&format!("principals[{i}]"), env)?);
    }
    if let Some(dir) = dir {
        for file in principal_files(dir)? {
            loaded.push(read_file(&file)?.load(&file.display().to_string(), env)?);
        }
    }
    let mut names = BTreeSet::new();
    for l in &loaded {
        if !names.insert(l.principal.name.clone()) {
            return Err(format!("principals: the name {:?} is used twice", l.principal.name));
        }
    }
    unique_credentials(&loaded)?;
    Ok(loaded)
}

/// A credential ties a call to one principal: in two, which one a call is
/// would depend on the order they were read in.
fn unique_credentials(loaded: &[Loaded]) -> Result<(), String> {
    let mut claimed: BTreeMap<String, &str> = BTreeMap::new();
    for l in loaded {
        let name = l.principal.name.as_str();
        let credentials = l
            .token_digests
            .iter()
            .map(|d| (format!("token {}", hex::encode(d)), "the same bearer token".to_string()))
            .chain(l.unix_uids.iter().map(|u| (format!("uid {u}"), format!("unix uid {u}"))))
            .chain(l.tls_names.iter().map(|n| (format!("tls {n}"), format!("the TLS name {n:?}"))));
        for (credential, shown) in credentials {
            if let Some(other) = claimed.insert(credential, name).filter(|other| *other != name) {
                return Err(format!(
                    "principals: {shown} is claimed by both {other:?} and {name:?}; a credential names one principal"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::LOCAL_ADMIN;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn digests_are_64_hex_digits_either_case() {
        let digest: [u8; 32] = std::array::from_fn(|i| {
            if i == 0 {
                0x00
            } else if i == 1 {
                0xab
            } else {
                0xff
            }
        });
        let lower = format!("00ab{}", "ff".repeat(30));
        assert_eq!(hex::encode(digest), lower);
        assert_eq!(hex32(&lower), Some(digest));
        assert_eq!(hex32(&format!(" {}\n", lower.to_ascii_uppercase())), Some(digest));
        assert_eq!(hex32(&lower[1..]), None);
        assert_eq!(hex32(&format!("{lower}0")), None);
        assert_eq!(hex32(&format!("+a{}", &lower[2..])), None, "no sign, as u8::from_str_radix allowed");
    }

    #[test]
    fn a_principal_loads_with_digests_only() {
        let token = "t".repeat(40);
        let digest = hex::encode(token_digest(&token));
        let p = PrincipalConfig {
            name: "ci".into(),
            kind: "agt".into(),
            projects: vec!["a".into()],
            token_sha256: Some(digest),
            ..Default::default()
        };
        let loaded = p.load("principals[0]", &no_env).unwrap();
        assert_eq!(loaded.token_digests, vec![token_digest(&token)]);
        assert_eq!(loaded.principal.kind, ConsumerType::Agt);
    }

    #[test]
    fn bad_principals_name_the_key() {
        let base = PrincipalConfig {
            name: "x".into(),
            kind: "agt".into(),
            projects: vec!["a".into()],
            unix_uids: vec![5],
            ..Default::default()
        };
        let cases = [
            (PrincipalConfig { name: "bad name".into(), ..base.clone() }, "principals[0].name"),
            (PrincipalConfig { kind: "root".into(), ..base.clone() }, "principals[0].type"),
            (PrincipalConfig { projects: vec!["*".into()], ..base.clone() }, "principals[0].projects"),
            (PrincipalConfig { write_roots: vec!["cache".into()], ..base.clone() }, "principals[0].write_roots"),
            (PrincipalConfig { write_roots: vec!["/srv/a/../b".into()], ..base.clone() }, "principals[0].write_roots"),
            (PrincipalConfig { projects: vec![], ..base.clone() }, "principals[0].projects"),
            (PrincipalConfig { unix_uids: vec![], ..base.clone() }, "principals[0]: no credential"),
            (PrincipalConfig { token_sha256: Some("abc".into()), ..base.clone() }, "principals[0].token_sha256"),
            (PrincipalConfig { token_env: Some("NOPE".into()), ..base.clone() }, "principals[0].token_env"),
            (PrincipalConfig { max_running: Some(0), ..base.clone() }, "principals[0].max_running"),
            (PrincipalConfig { projects: vec!["équipe".into()], ..base.clone() }, "principals[0].projects"),
            (PrincipalConfig { projects: vec!["a b".into()], ..base.clone() }, "principals[0].projects"),
            (PrincipalConfig { projects: vec!["p".repeat(129)], ..base.clone() }, "principals[0].projects"),
        ];
        for (config, key) in cases {
            let err = config.load("principals[0]", &no_env).unwrap_err();
            assert!(err.starts_with(key), "{err}");
        }
        let weak = |v: &str| if v == "T" { Some("short".to_string()) } else { None };
        let err = PrincipalConfig { token_env: Some("T".into()), ..base.clone() }.load("p", &weak).unwrap_err();
        assert!(err.contains("at least 32"), "{err}");
        let dup = load_principals(&[base.clone(), base], None, &no_env).unwrap_err();
        assert!(dup.contains("used twice"), "{dup}");
    }

    #[test]
    fn names_are_git_ref_components_and_never_the_local_admin() {
        for good in ["ci", "tenant-a", "a.b", "a_b", "A9", "x-", "lock", "a.locks", &"n".repeat(64)] {
            assert!(is_principal_name(good), "{good}");
        }
        for bad in [
            "",
            "a..b",
            ".a",
            "-a",
            "a.",
            "a.lock",
            "a/b",
            "a b",
            "a:b",
            "a?b",
            "a*b",
            "a[b",
            "a\\b",
            "a~b",
            "a^b",
            "a@{b",
            "@",
            "é",
            &"n".repeat(65),
        ] {
            assert!(!is_principal_name(bad), "{bad}");
        }
        let admin =
            PrincipalConfig { name: LOCAL_ADMIN.into(), kind: "adm".into(), unix_uids: vec![5], ..Default::default() };
        let err = admin.load("principals[0]", &no_env).unwrap_err();
        assert!(err.starts_with("principals[0].name: \"local-admin\" is the built-in administrator"), "{err}");
    }

    #[test]
    fn a_credential_in_two_principals_is_refused_naming_both() {
        let token = "t".repeat(40);
        let p = |name: &str| PrincipalConfig {
            name: name.into(),
            kind: "agt".into(),
            projects: vec!["a".into()],
            ..Default::default()
        };
        let digest = Some(hex::encode(token_digest(&token)));
        let env = |v: &str| (v == "TOKEN").then(|| format!("{}\n", "t".repeat(40)));
        for (first, second, shown) in [
            (
                PrincipalConfig { token_sha256: digest.clone(), ..p("one") },
                PrincipalConfig { token_env: Some("TOKEN".into()), ..p("two") },
                "the same bearer token",
            ),
            (
                PrincipalConfig { unix_uids: vec![7, 1000], ..p("one") },
                PrincipalConfig { unix_uids: vec![1000], ..p("two") },
                "unix uid 1000",
            ),
            (
                PrincipalConfig { tls_names: vec!["ci.example".into()], ..p("one") },
                PrincipalConfig { tls_names: vec!["ci.example".into()], unix_uids: vec![9], ..p("two") },
                "the TLS name \"ci.example\"",
            ),
        ] {
            let err = load_principals(&[first, second], None, &env).unwrap_err();
            assert_eq!(
                err,
                format!("principals: {shown} is claimed by both \"one\" and \"two\"; a credential names one principal")
            );
        }
        // One principal naming a credential twice is no ambiguity.
        let twice = PrincipalConfig {
            unix_uids: vec![3, 3],
            token_sha256: digest,
            token_env: Some("TOKEN".into()),
            ..p("one")
        };
        assert!(load_principals(&[twice], None, &env).is_ok());
    }
}
