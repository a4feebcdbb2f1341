//! The built-in policy kinds: their argument schemas, checked when a policy
//! is loaded, and their verdicts.

use serde::Deserialize;
use serde_json::Value;

use super::expr::Expr;
use super::{Phase, PolicySpec, Selector};
use crate::sandbox::workspace::{check_env_name, check_sandbox_path};
use crate::sandbox::SandboxType;

/// `enforce_sandbox`: fields it does not name are kept; unknown fields are
/// rejected at load.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnforceSandbox {
    /// Upgrades `none` to `linux_bwrap`; never downgrades.
    pub sandbox_type: Option<SandboxType>,
    /// `false` turns the network off; `true` never turns it on.
    pub allow_network: Option<bool>,
    /// Narrows the egress allowlist: the intersection, never a union.
    pub allow_hosts: Option<Vec<String>>,
    /// Keeps only the write paths covered by these; never adds one.
    pub write_paths: Option<Vec<String>>,
    /// Keeps only the read paths covered by these; never adds one.
    pub read_paths: Option<Vec<String>>,
    /// Keeps only these of the passed-through variables; never adds one.
    pub env_passthrough: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Seconds {
    seconds: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Types {
    types: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Prefixes {
    prefixes: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limit {
    limit: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExprArgs {
    expression: String,
    reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hosts {
    hosts: Vec<String>,
}

/// A policy kind with its validated arguments.
#[derive(Clone, Debug)]
pub enum Kind {
    /// Tightens the sandbox (`enforce_sandbox`).
    EnforceSandbox(EnforceSandbox),
    /// Turns the network off and clears `allow_hosts` (`deny_network`).
    DenyNetwork,
    /// Narrows `allow_hosts` to these (intersection).
    EgressAllowlist {
        /// The hosts egress may still reach.
        hosts: Vec<String>,
    },
    /// Shortens the run's timeout to at most `seconds` (`max_timeout`).
    MaxTimeout {
        /// The longest timeout, in seconds.
        seconds: u64,
    },
    /// Denies a caller whose consumer type is not listed (`allowed_actors`).
    AllowedActors {
        /// The consumer types allowed, such as `adm` or `agt`.
        types: Vec<String>,
    },
    /// Denies a repository outside every prefix (`allowed_repos`); a run
    /// without a repository is allowed.
    AllowedRepos {
        /// Host path prefixes, compared by path component: absolute, with no
        /// `..` (checked at load).
        prefixes: Vec<String>,
    },
    /// Denies a tool call once `limit` calls were allowed (`max_tool_calls`).
    MaxToolCalls {
        /// The most tool calls allowed.
        limit: u64,
    },
    /// The call waits for a person's decision (`DecideToolCall`) for at
    /// most this long, then is denied.
    RequireApproval {
        /// How long the call waits, in seconds (1 to ten years).
        timeout_seconds: u64,
    },
    /// An operator's CEL expression: `true` allows, anything else denies (`expr`).
    Expr(Expr),
}

impl Kind {
    /// The phases this kind has anything to say at; a selector may only
    /// name these.
    pub fn phases(&self) -> &'static [Phase] {
        match self {
            Kind::EnforceSandbox(_) | Kind::DenyNetwork | Kind::EgressAllowlist { .. } | Kind::MaxTimeout { .. } => {
                &[Phase::AgentStart]
            }
            Kind::MaxToolCalls { .. } | Kind::RequireApproval { .. } => &[Phase::ToolCall],
            Kind::AllowedActors { .. } | Kind::AllowedRepos { .. } | Kind::Expr(_) => {
                &[Phase::AgentStart, Phase::ToolCall]
            }
        }
    }
}

/// How long an approval waits when a `require_approval` names no timeout.
pub const DEFAULT_APPROVAL_SECONDS: u64 = 300;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalArgs {
    #[serde(default = "default_approval_seconds")]
    timeout_seconds: u64,
}

fn default_approval_seconds() -> u64 {
    DEFAULT_APPROVAL_SECONDS
}

/// A policy whose arguments were validated.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Shown in every decision it makes.
    pub name: String,
    /// What it does, with its arguments.
    pub kind: Kind,
    /// Where it applies; empty for every phase its kind applies to.
    pub on: Vec<Selector>,
    /// Where it came from: session, profile or admin.
    pub source: &'static str,
}

/// The policy kinds a [`PolicySpec`] may name, for error messages.
pub const KNOWN_KINDS: &str =
    "enforce_sandbox, deny_network, egress_allowlist, max_timeout, allowed_actors, allowed_repos, max_tool_calls, \
     expr, require_approval";

fn args<T: for<'de> Deserialize<'de>>(arguments: &Value) -> Result<T, String> {
    let value = if arguments.is_null() { Value::Object(Default::default()) } else { arguments.clone() };
    serde_json::from_value(value).map_err(|e| format!("arguments: {e}"))
}

impl Policy {
    /// Validates a policy; the error names what is wrong (the caller adds
    /// the file or key).
    pub fn compile(spec: &PolicySpec, source: &'static str) -> Result<Policy, String> {
        if spec.name.is_empty() {
            return Err("name: must not be empty".into());
        }
        let on = spec.on.iter().map(|s| Selector::parse(s)).collect::<Result<Vec<_>, _>>()?;
        let kind = match spec.kind.as_str() {
            "enforce_sandbox" => {
                let e: EnforceSandbox = args(&spec.arguments)?;
                for (key, paths) in [("write_paths", &e.write_paths), ("read_paths", &e.read_paths)] {
                    for (i, path) in paths.iter().flatten().enumerate() {
                        check_sandbox_path(path).map_err(|e| format!("arguments.{key}[{i}]: {e}"))?;
                    }
                }
                for (i, name) in e.env_passthrough.iter().flatten().enumerate() {
                    check_env_name(name).map_err(|e| format!("arguments.env_passthrough[{i}]: {e}"))?;
                }
                if let Some(hosts) = &e.allow_hosts {
                    crate::net::parse_hosts(hosts).map_err(|e| format!("arguments.allow_hosts: {e}"))?;
                }
                Kind::EnforceSandbox(e)
            }
            "deny_network" => {
                args::<NoArgs>(&spec.arguments)?;
                Kind::DenyNetwork
            }
            "egress_allowlist" => {
                let Hosts { hosts } = args(&spec.arguments)?;
                crate::net::parse_hosts(&hosts).map_err(|e| format!("arguments.hosts: {e}"))?;
                Kind::EgressAllowlist { hosts }
            }
            "max_timeout" => {
                let Seconds { seconds } = args(&spec.arguments)?;
                // 0 would time every run out before it starts.
                if seconds == 0 {
                    return Err("arguments.seconds: must be at least 1".into());
                }
                Kind::MaxTimeout { seconds }
            }
            "allowed_actors" => {
                let Types { types } = args(&spec.arguments)?;
                if let Some(bad) = types.iter().find(|t| !matches!(t.as_str(), "adm" | "agt" | "atm")) {
                    return Err(format!("arguments.types: {bad:?} is not a consumer type (adm, agt, atm)"));
                }
                Kind::AllowedActors { types }
            }
            "allowed_repos" => {
                let Prefixes { prefixes } = args(&spec.arguments)?;
                // A repository is compared as its resolved, absolute path:
                // a relative prefix or one through `..` would match none.
                for (i, prefix) in prefixes.iter().enumerate() {
                    let path = std::path::Path::new(prefix);
                    if !path.is_absolute() {
                        return Err(format!("arguments.prefixes[{i}]: {prefix:?} must be an absolute path"));
                    }
                    if path.components().any(|c| c == std::path::Component::ParentDir) {
                        return Err(format!("arguments.prefixes[{i}]: {prefix:?} must not contain \"..\""));
                    }
                }
                Kind::AllowedRepos { prefixes }
            }
            "max_tool_calls" => Kind::MaxToolCalls { limit: args::<Limit>(&spec.arguments)?.limit },
            "require_approval" => {
                let ApprovalArgs { timeout_seconds } = args(&spec.arguments)?;
                if timeout_seconds == 0 {
                    return Err("arguments.timeout_seconds: must be at least 1".into());
                }
                // In milliseconds it is added to the Unix time the wait ends at.
                crate::types::at_most_ten_years(timeout_seconds)
                    .map_err(|e| format!("arguments.timeout_seconds: {e}"))?;
                Kind::RequireApproval { timeout_seconds }
            }
            "expr" => {
                let ExprArgs { expression, reason } = args(&spec.arguments)?;
                Kind::Expr(Expr::compile(&expression, reason)?)
            }
            other => return Err(format!("kind: unknown policy kind {other:?} (known: {KNOWN_KINDS})")),
        };
        // A selector for a phase the kind never applies at would be
        // accepted and then never applied: refused instead.
        if let Some((i, selector)) = on.iter().enumerate().find(|(_, s)| !kind.phases().contains(&s.phase)) {
            let at = kind.phases().iter().map(|p| p.as_str()).collect::<Vec<_>>().join(", ");
            return Err(format!(
                "on[{i}]: {:?} names {}, but {} applies only at {at}: it would never apply",
                spec.on[i],
                selector.phase.as_str(),
                spec.kind
            ));
        }
        Ok(Policy { name: spec.name.clone(), kind, on, source })
    }
}

/// Compiles a list of policies; errors name `key[index] (name)`.
pub fn compile_all(specs: &[PolicySpec], source: &'static str, key: &str) -> Result<Vec<Policy>, String> {
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| Policy::compile(spec, source).map_err(|e| format!("{key}[{i}] ({}): {e}", spec.name)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(kind: &str, arguments: Value) -> Result<Policy, String> {
        let spec = PolicySpec { name: "p".into(), kind: kind.into(), arguments, on: Vec::new() };
        Policy::compile(&spec, "admin")
    }

    /// A repository is compared as its resolved absolute path: a relative
    /// prefix or one through `..` would deny every repository, silently.
    #[test]
    fn allowed_repos_prefixes_are_absolute_without_parent_components() {
        let err = |prefixes: Value| compile("allowed_repos", serde_json::json!({ "prefixes": prefixes })).unwrap_err();
        assert_eq!(
            err(serde_json::json!(["payments"])),
            "arguments.prefixes[0]: \"payments\" must be an absolute path"
        );
        assert_eq!(err(serde_json::json!(["/srv/a", ""])), "arguments.prefixes[1]: \"\" must be an absolute path");
        assert_eq!(
            err(serde_json::json!(["/srv/repos/../etc"])),
            "arguments.prefixes[0]: \"/srv/repos/../etc\" must not contain \"..\""
        );
        assert!(compile("allowed_repos", serde_json::json!({"prefixes": ["/srv/repos/a", "/srv/b/"]})).is_ok());
    }

    /// In milliseconds the wait is added to a Unix time (i64).
    #[test]
    fn an_approval_waits_at_most_ten_years() {
        let wait = |seconds: u64| compile("require_approval", serde_json::json!({ "timeout_seconds": seconds }));
        assert_eq!(
            wait(u64::MAX).unwrap_err(),
            format!("arguments.timeout_seconds: {} is more than 315360000 (ten years)", u64::MAX)
        );
        assert!(wait(crate::hub::MAX_WAIT_SECONDS).is_ok());
    }
}
