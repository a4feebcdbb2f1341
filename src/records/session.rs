//! The session record and its states.

use serde::{Deserialize, Serialize};

use crate::types::evidence::Evidence;
use crate::types::{Consumer, SandboxSpec};

/// Where a session is in its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Created: its profile is being resolved and its harness started.
    #[default]
    Starting,
    /// Its harness is up and takes turns.
    Active,
    /// It was ended by its caller or by the daemon shutting down.
    Ended,
    /// Its start failed, or it ended with a failed outcome.
    Failed,
    /// It was refused at resolution or by the gate.
    Refused,
    /// It was ended by the reaper after being idle too long.
    Reaped,
}

impl SessionState {
    /// The state's snake_case word, as stored.
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

/// A session as stored: a harness in one sandbox, taking turns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionRecord {
    /// The session's id, chosen by the daemon.
    pub session_id: String,
    /// The profile as the request named it.
    pub profile_ref: String,
    /// Who the session is for.
    pub consumer: Consumer,
    /// The repository the workspace started from; empty when it started empty.
    pub repo: String,
    /// The sandbox after the agent_start gate's overrides; `None` until the
    /// gate has decided.
    pub effective_sandbox: Option<SandboxSpec>,
    /// Where the session is in its life.
    pub state: SessionState,
    /// The redacted record of what happened.
    pub evidence: Evidence,
    /// How many turns it has taken.
    pub turns: u64,
    /// How many times its harness was started again.
    pub restarts: u64,
    /// When it was created, in Unix milliseconds.
    pub created_at_ms: i64,
    /// When it ended, in Unix milliseconds; `None` while it has not.
    pub ended_at_ms: Option<i64>,
}
