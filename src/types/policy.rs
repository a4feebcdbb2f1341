//! A policy's verdict, as the gate gives it and the records keep it.

use serde::{Deserialize, Serialize};

/// What a policy (or the gate) says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The policy lets it go ahead.
    #[default]
    Allow,
    /// The policy refuses it.
    Deny,
    /// At `tool_call`: the call waits for a person's decision.
    Ask,
}

/// One policy's verdict. `source` is session, profile, admin or builtin.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyDecision {
    /// The policy's name.
    pub policy: String,
    /// Where the policy came from: `session`, `profile`, `admin` or `builtin`.
    pub source: String,
    /// What the policy says.
    pub action: Action,
    /// Why, in the policy's own words.
    pub reason: String,
}
