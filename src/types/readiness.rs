//! A profile's operational readiness: whether it may run, and who says so.

use serde::{Deserialize, Serialize};

/// Whether a profile may run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadinessState {
    #[default]
    Ready,
    Unverified,
    Blocked,
}

/// Operational readiness: whether a profile may run, and who says so.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Readiness {
    pub state: ReadinessState,
    pub reason: String,
    pub owner: String,
    pub evidence_ref: String,
}
