//! The policy gate: the one place that decides whether a harness may start
//! (`agent_start`) or a tool call may run (`tool_call`), and which sandbox
//! it gets.
//!
//! Policies come from the session (set by an `adm` caller), the profile's
//! `guardrails.policies` and the daemon's admin config, evaluated in that
//! order. A deny stops evaluation. Sandbox overrides chain: each policy sees
//! the sandbox as the previous one left it, and they can only tighten it.
//! Last, the host must be able to enforce the result. Anything that cannot
//! be evaluated denies.

mod expr;
mod kinds;
mod tighten;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use kinds::{compile_all, EnforceSandbox, Kind, Policy, KNOWN_KINDS};
pub use tighten::tighten;

use crate::sandbox::{Capabilities, SandboxLimits, SandboxSpec, SandboxType};
pub use crate::types::{Action, PolicyDecision};

/// Which decision the gate is asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Whether a harness may start, and in which sandbox.
    #[default]
    AgentStart,
    /// Whether one tool call may run.
    ToolCall,
}

impl Phase {
    /// The phase as written in selectors and records (`agent_start`, `tool_call`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::AgentStart => "agent_start",
            Phase::ToolCall => "tool_call",
        }
    }
}

/// A policy as written in a profile, a session or the daemon config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// Shown in every decision the policy makes.
    pub name: String,
    /// One of [`KNOWN_KINDS`].
    pub kind: String,
    /// The kind's arguments, a JSON object; checked at load.
    #[serde(default = "empty_object")]
    pub arguments: Value,
    /// `agent_start`, `tool_call` or `tool_call:<tool>`; empty = every phase
    /// the kind applies to.
    #[serde(default)]
    pub on: Vec<String>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Where a policy applies: a phase, optionally narrowed to one tool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    /// The phase it applies at.
    pub phase: Phase,
    /// The one tool it is narrowed to; `None` for every tool.
    pub tool: Option<String>,
}

impl Selector {
    /// Parses `agent_start`, `tool_call` or `tool_call:<tool>`.
    pub fn parse(text: &str) -> Result<Selector, String> {
        match text.split_once(':') {
            None if text == "agent_start" => Ok(Selector { phase: Phase::AgentStart, tool: None }),
            None if text == "tool_call" => Ok(Selector { phase: Phase::ToolCall, tool: None }),
            Some(("tool_call", tool)) if !tool.is_empty() => {
                Ok(Selector { phase: Phase::ToolCall, tool: Some(tool.to_string()) })
            }
            _ => Err(format!("on: {text:?} is not agent_start, tool_call or tool_call:<tool>")),
        }
    }
}

/// What the gate looks at.
#[derive(Clone, Debug)]
pub struct GateInput<'a> {
    /// Which decision is asked for.
    pub phase: Phase,
    /// The profile's pinned reference, `id@version`.
    pub profile_ref: &'a str,
    /// The caller's consumer type (`adm`, `agt` or `atm`).
    pub actor: &'a str,
    /// The project the run is for.
    pub project: &'a str,
    /// The repository path; empty when the run has none.
    pub repo: &'a str,
    /// The sandbox so far: the profile's at agent_start, the effective one
    /// at tool_call.
    pub sandbox: &'a SandboxSpec,
    /// The limits the sandbox must enforce (the profile's).
    pub limits: &'a SandboxLimits,
    /// The run's timeout in seconds, before any policy shortens it.
    pub timeout_seconds: u64,
    /// The tool call at `tool_call`.
    pub tool: &'a str,
    /// The tool call's arguments at `tool_call`; `Null` at agent_start.
    pub arguments: &'a Value,
    /// Tool calls already allowed in this session.
    pub tool_calls: u64,
    /// The session's policies, evaluated first.
    pub session_policies: &'a [Policy],
    /// The profile's policies, evaluated after the session's.
    pub profile_policies: &'a [Policy],
    /// At agent_start: why the harness's own tool calls cannot be gated,
    /// in each type of sandbox (see `ReinSpec::tool_calls_ungated`); judged
    /// on the sandbox the policies leave (one may upgrade `none`).
    pub ungated_tool_calls: Ungated<'a>,
    /// At agent_start: where the run's principal may have the sandbox
    /// write on the host (a profile's absolute `write_paths`).
    pub host_writes: HostWrites<'a>,
}

/// Where a run may write host directories through a profile's absolute
/// `sandbox.write_paths`, which every run of the profile shares whoever
/// runs it: an `adm` principal's anywhere, another's only beneath its
/// `write_roots` (none by default), so one tenant's agent cannot leave
/// files where the next tenant's reads them.
#[derive(Clone, Copy, Debug)]
pub enum HostWrites<'a> {
    /// Anywhere (an `adm` principal; the `tool_call` phase, not judged).
    Anywhere,
    /// Only beneath `roots`.
    Beneath {
        /// The run's principal, named in the refusal.
        principal: &'a str,
        /// Its `write_roots`.
        roots: &'a [std::path::PathBuf],
    },
}

impl HostWrites<'_> {
    /// The first of `write_paths` (absolute ones) not allowed, with why.
    pub fn refusal(&self, write_paths: &[String]) -> Option<String> {
        let HostWrites::Beneath { principal, roots } = self else { return None };
        let mut absolute = write_paths.iter().map(std::path::Path::new).filter(|p| p.is_absolute());
        let outside = absolute.find(|p| !plain_absolute(p) || !roots.iter().any(|root| p.starts_with(root)))?;
        let roots: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
        Some(format!(
            "sandbox.write_paths: {} is a host directory every run of the profile writes, whoever runs it; \
             principal {principal} may write host directories only beneath its write_roots ({}): tenants stay apart",
            outside.display(),
            if roots.is_empty() { "none".to_string() } else { roots.join(", ") }
        ))
    }
}

/// An absolute path whose components are all names: no `.` or `..` that
/// could take a path lexically beneath a root out of it.
pub fn plain_absolute(path: &std::path::Path) -> bool {
    use std::path::Component;
    path.is_absolute() && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// Why a harness's own tool calls cannot pass the gate, by the type of
/// sandbox it would run in; `None` where they can.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ungated<'a> {
    /// In a `linux_bwrap` sandbox.
    pub in_bwrap: Option<&'a str>,
    /// In a `none` sandbox.
    pub in_none: Option<&'a str>,
}

impl<'a> Ungated<'a> {
    /// Ungated in any sandbox, for `why`.
    pub fn anywhere(why: &'a str) -> Ungated<'a> {
        Ungated { in_bwrap: Some(why), in_none: Some(why) }
    }

    /// Why, in a sandbox of type `sandbox`.
    pub fn in_sandbox(&self, sandbox: SandboxType) -> Option<&'a str> {
        match sandbox {
            SandboxType::LinuxBwrap => self.in_bwrap,
            SandboxType::None => self.in_none,
        }
    }
}

/// The gate's decision: allow or deny, every evaluated policy's verdict, and
/// the sandbox and timeout as the policies left them.
#[derive(Clone, Debug, PartialEq)]
pub struct GateOutcome {
    /// The phase decided.
    pub phase: Phase,
    /// At `tool_call`: the tool asked about (raw: scrub and bound it before
    /// it is recorded).
    pub tool: String,
    /// Allow, deny or ask.
    pub action: Action,
    /// Each evaluated policy's verdict, in order; the last is the deciding
    /// one when denied.
    pub decisions: Vec<PolicyDecision>,
    /// The sandbox after every `enforce_sandbox`, `deny_network` and
    /// `egress_allowlist` tightened it.
    pub effective_sandbox: SandboxSpec,
    /// The run's timeout after every `max_timeout`, in seconds.
    pub effective_timeout_seconds: u64,
    /// With [`Action::Ask`]: how long the call waits for a decision (the
    /// shortest of the asking policies', bounded by the run's timeout).
    pub approval_timeout_seconds: u64,
}

impl GateOutcome {
    /// The deciding denial, if any.
    pub fn denial(&self) -> Option<&PolicyDecision> {
        self.decisions.iter().find(|d| d.action == Action::Deny)
    }
}

/// What the host can enforce, probed once at start.
#[derive(Clone, Debug)]
pub struct HostCapabilities {
    /// `Err(reason)` when bubblewrap cannot run here.
    pub bwrap: Result<(), String>,
    /// What each backend can enforce of a profile's limits.
    pub linux_bwrap: Capabilities,
    /// What the `none` backend can enforce of a profile's limits.
    pub none: Capabilities,
    /// The sandboxes' seccomp program (`sha256:` digest), or why there is none.
    pub seccomp: Result<String, String>,
    /// Whether each sandbox gets a host uid of its own, or why not.
    pub sandbox_uids: Result<String, String>,
}

impl HostCapabilities {
    /// A host where everything can be enforced (unit tests).
    pub fn everything() -> HostCapabilities {
        let ok = || Ok("test".to_string());
        let all = Capabilities { memory: ok(), pids: ok(), cpu: ok(), kill: ok(), egress: ok() };
        HostCapabilities { bwrap: Ok(()), linux_bwrap: all.clone(), none: all, seccomp: ok(), sandbox_uids: ok() }
    }
}

/// The policy gate: the daemon's admin policies and what this host can
/// enforce, applied to every decision.
pub struct Gate {
    admin_policies: Vec<Policy>,
    host: HostCapabilities,
}

/// The tool corral itself dispatches for an execution: gated by corral
/// whatever the harness is.
pub const DISPATCHED_TOOL: &str = "run_task";

impl Policy {
    /// Whether this policy governs the tool calls a harness makes itself
    /// (not only corral's own `run_task` dispatch): a `max_tool_calls`, a
    /// selector on `tool_call` or a tool other than `run_task`, or an
    /// `expr` for every phase that looks at the tool call.
    fn governs_tool_calls(&self) -> bool {
        let selected = self.on.iter().any(|s| s.phase == Phase::ToolCall && s.tool.as_deref() != Some(DISPATCHED_TOOL));
        match &self.kind {
            Kind::MaxToolCalls { .. } | Kind::RequireApproval { .. } => self.on.is_empty() || selected,
            Kind::Expr(expr) if self.on.is_empty() => expr.reads_tool_call(),
            _ => selected,
        }
    }

    /// Whether this policy has anything to say at `phase` for `tool`.
    fn applies(&self, phase: Phase, tool: &str) -> bool {
        if !self.kind.phases().contains(&phase) {
            return false;
        }
        self.on.is_empty() || self.on.iter().any(|s| s.phase == phase && s.tool.as_deref().is_none_or(|t| t == tool))
    }
}

impl Gate {
    /// A gate with the daemon config's policies (evaluated last) and the
    /// host's probed capabilities.
    pub fn new(admin_policies: Vec<Policy>, host: HostCapabilities) -> Self {
        Gate { admin_policies, host }
    }

    /// What the host can enforce, as probed at start.
    pub fn host(&self) -> &HostCapabilities {
        &self.host
    }

    /// Evaluates the session's, the profile's, then the admin policies that
    /// apply at `input.phase`; the first deny stops. At agent_start the host
    /// must also be able to enforce the resulting sandbox, or the run is denied.
    pub fn evaluate(&self, input: &GateInput<'_>) -> GateOutcome {
        let mut outcome = GateOutcome {
            phase: input.phase,
            tool: input.tool.to_string(),
            action: Action::Allow,
            decisions: Vec::new(),
            effective_sandbox: input.sandbox.clone(),
            effective_timeout_seconds: input.timeout_seconds,
            approval_timeout_seconds: 0,
        };
        // What a policy narrowed that a `none` sandbox could not enforce,
        // should the sandbox still be `none` at the end.
        let mut narrowed: Vec<String> = Vec::new();
        let policies = input.session_policies.iter().chain(input.profile_policies).chain(&self.admin_policies);
        for policy in policies.filter(|p| p.applies(input.phase, input.tool)) {
            let before = outcome.effective_sandbox.clone();
            let (action, reason) = decide(policy, input, &mut outcome);
            narrowed.extend(narrowing(policy, &before, &outcome.effective_sandbox));
            outcome.decisions.push(PolicyDecision {
                policy: policy.name.clone(),
                source: policy.source.into(),
                action,
                reason,
            });
            if action == Action::Deny {
                outcome.action = Action::Deny;
                return outcome;
            }
            if let (Action::Ask, Kind::RequireApproval { timeout_seconds }) = (action, &policy.kind) {
                // An ask waits for later policies: any deny still wins.
                let bounded = (*timeout_seconds).min(input.timeout_seconds.max(1));
                outcome.approval_timeout_seconds = match outcome.action {
                    Action::Ask => outcome.approval_timeout_seconds.min(bounded),
                    _ => bounded,
                };
                outcome.action = Action::Ask;
            }
        }
        let ungated = input.ungated_tool_calls.in_sandbox(outcome.effective_sandbox.sandbox_type);
        if let (Phase::AgentStart, Some(why)) = (input.phase, ungated) {
            let policies = input.session_policies.iter().chain(input.profile_policies).chain(&self.admin_policies);
            if let Some(policy) = policies.into_iter().find(|p| p.governs_tool_calls()) {
                outcome.action = Action::Deny;
                outcome.decisions.push(PolicyDecision {
                    policy: "tool_call_gating".into(),
                    source: "builtin".into(),
                    action: Action::Deny,
                    reason: format!(
                        "policy {} governs tool calls, but {why}: it would be ignored, so the run is refused",
                        policy.name
                    ),
                });
                return outcome;
            }
        }
        if let (Phase::AgentStart, Some(reason)) =
            (input.phase, input.host_writes.refusal(&outcome.effective_sandbox.write_paths))
        {
            outcome.action = Action::Deny;
            outcome.decisions.push(PolicyDecision {
                policy: "host_write_paths".into(),
                source: "builtin".into(),
                action: Action::Deny,
                reason,
            });
            return outcome;
        }
        if input.phase == Phase::AgentStart {
            let host = self.enforceable(&outcome.effective_sandbox, input.limits, &narrowed);
            outcome.action = host.action;
            outcome.decisions.push(host);
        }
        outcome
    }

    /// The last word at agent_start: the host must be able to enforce the
    /// effective sandbox, or the run is refused with the reason.
    /// `narrowed` says what policies narrowed (see [`narrowing`]): a `none`
    /// sandbox shares the host's network and file system, so none of it
    /// could be enforced there.
    fn enforceable(&self, sandbox: &SandboxSpec, limits: &SandboxLimits, narrowed: &[String]) -> PolicyDecision {
        let verdict = |action, reason: String| PolicyDecision {
            policy: "host_enforceability".into(),
            source: "builtin".into(),
            action,
            reason,
        };
        let capabilities = match sandbox.sandbox_type {
            SandboxType::LinuxBwrap => &self.host.linux_bwrap,
            SandboxType::None => &self.host.none,
        };
        if let Some(reason) = capabilities.refuse(limits) {
            return verdict(Action::Deny, reason);
        }
        if let (SandboxType::LinuxBwrap, true, Err(reason)) =
            (sandbox.sandbox_type, sandbox.allow_network, &capabilities.egress)
        {
            return verdict(Action::Deny, format!("allow_network cannot be enforced on this host: {reason}"));
        }
        match sandbox.sandbox_type {
            SandboxType::LinuxBwrap => {
                if let Err(reason) = &self.host.bwrap {
                    return verdict(Action::Deny, format!("linux_bwrap cannot be enforced on this host: {reason}"));
                }
            }
            SandboxType::None => {
                // Without namespaces, a process of the daemon's own uid is
                // the daemon: it reads the daemon's data (its admin token)
                // and its unix socket takes it for the local admin.
                if let Err(reason) = &self.host.sandbox_uids {
                    return verdict(
                        Action::Deny,
                        format!(
                            "sandbox type none would run the harness as the daemon itself ({reason}), with the \
                             daemon's files and its admin socket; use linux_bwrap, or run the daemon as root"
                        ),
                    );
                }
                // Teardown must find what the run started (setsid, double
                // forks): without a cgroup and a uid of its own, nothing can.
                if let Err(reason) = &capabilities.kill {
                    return verdict(
                        Action::Deny,
                        format!("sandbox type none cannot be torn down on this host: {reason}"),
                    );
                }
                if !sandbox.allow_network {
                    return verdict(
                        Action::Deny,
                        "sandbox type none cannot isolate the network; use linux_bwrap or allow_network".into(),
                    );
                }
                if !sandbox.allow_hosts.is_empty() {
                    return verdict(
                        Action::Deny,
                        "sandbox type none shares the host network and cannot enforce allow_hosts; use linux_bwrap"
                            .into(),
                    );
                }
                if !sandbox.read_paths.is_empty() {
                    return verdict(Action::Deny, "sandbox type none cannot restrict reads; use linux_bwrap".into());
                }
                if let Some(path) = sandbox.write_paths.iter().find(|p| p.starts_with('/')) {
                    return verdict(
                        Action::Deny,
                        format!("sandbox type none binds no host path ({path}); use linux_bwrap"),
                    );
                }
                if !narrowed.is_empty() {
                    return verdict(
                        Action::Deny,
                        format!(
                            "{}: sandbox type none shares the host network and file system and cannot enforce it; \
                             use linux_bwrap",
                            narrowed.join("; ")
                        ),
                    );
                }
            }
        }
        verdict(Action::Allow, format!("{} can be enforced", sandbox.sandbox_type.as_str()))
    }
}

/// What `policy` narrowed between `before` and `after` that only an
/// isolating sandbox can enforce: egress hosts (on `none` an empty
/// `allow_hosts` is the whole host network, so narrowing it to nothing
/// changes nothing there), write paths (`none` leaves the whole workspace
/// writable) and read paths (`none` cannot restrict reads at all).
fn narrowing(policy: &Policy, before: &SandboxSpec, after: &SandboxSpec) -> Vec<String> {
    let name = &policy.name;
    let mut out = Vec::new();
    let hosts = match &policy.kind {
        Kind::EgressAllowlist { .. } => true,
        Kind::EnforceSandbox(enforce) => enforce.allow_hosts.is_some(),
        _ => false,
    };
    if hosts && after.allow_network {
        out.push(format!("policy {name} narrows allow_hosts to [{}]", after.allow_hosts.join(", ")));
    }
    if before.write_paths != after.write_paths {
        out.push(format!("policy {name} narrows write_paths to [{}]", after.write_paths.join(", ")));
    }
    if let Kind::EnforceSandbox(EnforceSandbox { read_paths: Some(paths), .. }) = &policy.kind {
        out.push(format!("policy {name} restricts read_paths to [{}]", paths.join(", ")));
    }
    out
}

/// The gate input as CEL sees it.
fn expr_input(input: &GateInput<'_>, sandbox: &SandboxSpec) -> Value {
    json!({
        "phase": input.phase.as_str(),
        "profile": input.profile_ref,
        "actor": input.actor,
        "project": input.project,
        "repo": input.repo,
        "sandbox": {
            "type": sandbox.sandbox_type.as_str(),
            "allow_network": sandbox.allow_network,
            "allow_hosts": sandbox.allow_hosts,
            "write_paths": sandbox.write_paths,
            "read_paths": sandbox.read_paths,
            "env_passthrough": sandbox.env_passthrough,
        },
        "tool": input.tool,
        "arguments": input.arguments,
        "tool_calls": input.tool_calls,
    })
}

fn decide(policy: &Policy, input: &GateInput<'_>, outcome: &mut GateOutcome) -> (Action, String) {
    match &policy.kind {
        Kind::EnforceSandbox(enforce) => (Action::Allow, tighten(&mut outcome.effective_sandbox, enforce)),
        Kind::DenyNetwork => {
            outcome.effective_sandbox.allow_network = false;
            outcome.effective_sandbox.allow_hosts.clear();
            (Action::Allow, "network off".into())
        }
        Kind::EgressAllowlist { hosts } => {
            let sandbox = &mut outcome.effective_sandbox;
            sandbox.allow_hosts = crate::net::intersect(&sandbox.allow_hosts, hosts);
            (Action::Allow, format!("egress to [{}]", sandbox.allow_hosts.join(", ")))
        }
        Kind::MaxTimeout { seconds } => {
            outcome.effective_timeout_seconds = outcome.effective_timeout_seconds.min(*seconds);
            (Action::Allow, format!("timeout at most {seconds}s"))
        }
        Kind::AllowedActors { types } => {
            if types.iter().any(|t| t == input.actor) {
                (Action::Allow, format!("actor {} is allowed", input.actor))
            } else {
                (Action::Deny, format!("actor {:?} is not one of {}", input.actor, types.join(", ")))
            }
        }
        Kind::AllowedRepos { prefixes } => {
            let path = std::path::Path::new(input.repo);
            if input.repo.is_empty() {
                (Action::Allow, "no repository".into())
            } else if prefixes.iter().any(|p| path.starts_with(p)) {
                (Action::Allow, "repository is under an allowed prefix".into())
            } else {
                (Action::Deny, "repository is outside the allowed prefixes".into())
            }
        }
        Kind::MaxToolCalls { limit } => {
            if input.tool_calls < *limit {
                (Action::Allow, format!("tool call {} of at most {limit}", input.tool_calls + 1))
            } else {
                (Action::Deny, format!("tool call limit {limit} reached"))
            }
        }
        Kind::RequireApproval { timeout_seconds } => {
            (Action::Ask, format!("a person must approve this call (waits at most {timeout_seconds} s)"))
        }
        // The arguments alone first: the input is a copy of them, made
        // only once they are known to fit (a hook's body is up to 16 MiB).
        Kind::Expr(expr) => match expr::input_within_bounds(input.arguments)
            .and_then(|()| expr.evaluate(&expr_input(input, &outcome.effective_sandbox)))
        {
            Ok(true) => (Action::Allow, "expression holds".into()),
            Ok(false) => (Action::Deny, expr.reason.clone()),
            Err(why) => (Action::Deny, format!("{why} (fail closed)")),
        },
    }
}

#[cfg(test)]
mod tests;
