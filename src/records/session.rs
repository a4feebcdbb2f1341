//! The session record and its states.

use serde::{Deserialize, Serialize};

use crate::types::evidence::Evidence;
use crate::types::{Consumer, SandboxSpec};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    #[default]
    Starting,
    Active,
    Ended,
    Failed,
    Refused,
    Reaped,
}

impl SessionState {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Starting => "starting",
            SessionState::Active => "active",
            SessionState::Ended => "ended",
            SessionState::Failed => "failed",
            SessionState::Refused => "refused",
            SessionState::Reaped => "reaped",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionRecord {
    pub session_id: String,
    pub profile_ref: String,
    pub consumer: Consumer,
    pub repo: String,
    pub effective_sandbox: Option<SandboxSpec>,
    pub state: SessionState,
    pub evidence: Evidence,
    pub turns: u64,
    pub restarts: u64,
    pub created_at_ms: i64,
    pub ended_at_ms: Option<i64>,
}
