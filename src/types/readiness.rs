//! A profile's operational readiness: whether it may run, and who says so.

use serde::{Deserialize, Serialize};

/// Whether a profile may run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadinessState {
    /// Known to work; the default.
    #[default]
    Ready,
    /// Not shown to work; it runs, with a note in the evidence.
    Unverified,
    /// Known not to work; resolution refuses it.
    Blocked,
}

/// Operational readiness: whether a profile may run, and who says so.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Readiness {
    /// Whether the profile may run.
    pub state: ReadinessState,
    /// Why it is in that state; part of the refusal for a blocked profile.
    pub reason: String,
    /// Who answers for the state, as the profile names it; may be empty.
    pub owner: String,
    /// A reference to what backs the state, as the profile gives it; may be
    /// empty.
    pub evidence_ref: String,
}
