//! A policy's verdict, as the gate gives it and the records keep it.

use serde::{Deserialize, Serialize};

/// What a policy (or the gate) says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    #[default]
    Allow,
    Deny,
    /// At `tool_call`: the call waits for a person's decision.
    Ask,
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
