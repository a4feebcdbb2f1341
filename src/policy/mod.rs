//! The policy gate: the one place that decides whether a harness may start
//! (`agent_start`) or a tool call may run (`tool_call`), and which sandbox
//! it gets.
//!
//! This is the hook the execution path calls. It enforces what the host
//! can and cannot isolate and fails closed on any policy it cannot
//! evaluate; the built-in policy kinds land with the gate issue.

use serde::{Deserialize, Serialize};

use crate::sandbox::{SandboxSpec, SandboxType};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    AgentStart,
    ToolCall,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::AgentStart => "agent_start",
            Phase::ToolCall => "tool_call",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    #[default]
    Allow,
    Deny,
}

/// A policy as written in a profile, a session or the daemon config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    pub name: String,
    pub kind: String,
    #[serde(default = "empty_object")]
    pub arguments: serde_json::Value,
    #[serde(default)]
    pub on: Vec<String>,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// One policy's verdict. `source` is session, profile, admin or builtin.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyDecision {
    pub policy: String,
    pub source: String,
    pub action: Action,
    pub reason: String,
}

/// What the gate looks at.
#[derive(Clone, Debug)]
pub struct GateInput<'a> {
    pub phase: Phase,
    pub profile_ref: &'a str,
    pub profile_policies: &'a [PolicySpec],
    pub actor: &'a str,
    pub project: &'a str,
    pub repo: &'a str,
    pub sandbox: &'a SandboxSpec,
}

/// The gate's decision: allow or deny, every policy's verdict, and the
/// sandbox as the policies left it.
#[derive(Clone, Debug, PartialEq)]
pub struct GateOutcome {
    pub phase: Phase,
    pub action: Action,
    pub decisions: Vec<PolicyDecision>,
    pub effective_sandbox: SandboxSpec,
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
}

pub struct Gate {
    admin_policies: Vec<PolicySpec>,
    host: HostCapabilities,
}

impl Gate {
    pub fn new(admin_policies: Vec<PolicySpec>, host: HostCapabilities) -> Self {
        Gate { admin_policies, host }
    }

    pub fn evaluate(&self, input: &GateInput<'_>) -> GateOutcome {
        let mut decisions = Vec::new();
        let effective = input.sandbox.clone();
        let sources = [("profile", input.profile_policies), ("admin", self.admin_policies.as_slice())];
        for (source, policies) in sources {
            for policy in policies.iter().filter(|p| applies(p, input.phase)) {
                // Fail closed: a policy this daemon cannot evaluate denies.
                decisions.push(PolicyDecision {
                    policy: policy.name.clone(),
                    source: source.into(),
                    action: Action::Deny,
                    reason: format!("policy kind {:?} is not supported by this daemon", policy.kind),
                });
                return GateOutcome {
                    phase: input.phase,
                    action: Action::Deny,
                    decisions,
                    effective_sandbox: effective,
                };
            }
        }
        let host = self.enforceable(&effective);
        let action = host.action;
        decisions.push(host);
        GateOutcome { phase: input.phase, action, decisions, effective_sandbox: effective }
    }

    /// The last word: the host must be able to enforce the effective
    /// sandbox, or the run is refused with the reason.
    fn enforceable(&self, sandbox: &SandboxSpec) -> PolicyDecision {
        let deny = |reason: String| PolicyDecision {
            policy: "host_enforceability".into(),
            source: "builtin".into(),
            action: Action::Deny,
            reason,
        };
        match sandbox.sandbox_type {
            SandboxType::LinuxBwrap => {
                if let Err(reason) = &self.host.bwrap {
                    return deny(format!("linux_bwrap cannot be enforced on this host: {reason}"));
                }
            }
            SandboxType::None => {
                if !sandbox.allow_network {
                    return deny(
                        "sandbox type none cannot isolate the network; use linux_bwrap or allow_network".into(),
                    );
                }
                if !sandbox.read_paths.is_empty() {
                    return deny("sandbox type none cannot restrict reads to read_paths; use linux_bwrap".into());
                }
            }
        }
        PolicyDecision {
            policy: "host_enforceability".into(),
            source: "builtin".into(),
            action: Action::Allow,
            reason: format!("{} can be enforced", sandbox.sandbox_type.as_str()),
        }
    }
}

fn applies(policy: &PolicySpec, phase: Phase) -> bool {
    policy.on.is_empty() || policy.on.iter().any(|on| on.split(':').next() == Some(phase.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(sandbox: &'a SandboxSpec, policies: &'a [PolicySpec]) -> GateInput<'a> {
        GateInput {
            phase: Phase::AgentStart,
            profile_ref: "p@1.0.0",
            profile_policies: policies,
            actor: "agt",
            project: "",
            repo: "",
            sandbox,
        }
    }

    #[test]
    fn none_without_network_is_not_enforceable() {
        let gate = Gate::new(vec![], HostCapabilities { bwrap: Ok(()) });
        let spec = SandboxSpec { sandbox_type: SandboxType::None, ..SandboxSpec::default() };
        let outcome = gate.evaluate(&input(&spec, &[]));
        assert_eq!(outcome.action, Action::Deny);
        assert!(outcome.denial().unwrap().reason.contains("cannot isolate the network"));
    }

    #[test]
    fn missing_bwrap_refuses_with_the_reason() {
        let gate = Gate::new(vec![], HostCapabilities { bwrap: Err("bwrap not found on PATH".into()) });
        let outcome = gate.evaluate(&input(&SandboxSpec::default(), &[]));
        assert_eq!(outcome.action, Action::Deny);
        assert!(outcome.denial().unwrap().reason.contains("bwrap not found"));
    }

    #[test]
    fn unknown_policy_kind_denies() {
        let gate = Gate::new(vec![], HostCapabilities { bwrap: Ok(()) });
        let policy = PolicySpec { name: "p".into(), kind: "mystery".into(), arguments: empty_object(), on: vec![] };
        let outcome = gate.evaluate(&input(&SandboxSpec::default(), std::slice::from_ref(&policy)));
        assert_eq!(outcome.action, Action::Deny);
        assert_eq!(outcome.denial().unwrap().policy, "p");
    }
}
