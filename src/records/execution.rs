//! The execution record and its states.

use serde::{Deserialize, Serialize};

use crate::types::evidence::{Evidence, Outcome};
use crate::types::{Consumer, SandboxSpec};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionState {
    #[default]
    Pending,
    Running,
    Succeeded,
    Failed,
    Refused,
    Cancelled,
}

impl ExecutionState {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionState::Pending => "pending",
            ExecutionState::Running => "running",
            ExecutionState::Succeeded => "succeeded",
            ExecutionState::Failed => "failed",
            ExecutionState::Refused => "refused",
            ExecutionState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<ExecutionState> {
        [Self::Pending, Self::Running, Self::Succeeded, Self::Failed, Self::Refused, Self::Cancelled]
            .into_iter()
            .find(|state| state.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        !matches!(self, ExecutionState::Pending | ExecutionState::Running)
    }

    /// The terminal state an outcome leads to.
    pub fn from_outcome(outcome: Outcome) -> ExecutionState {
        match outcome {
            Outcome::Succeeded => ExecutionState::Succeeded,
            Outcome::Refused => ExecutionState::Refused,
            Outcome::Cancelled => ExecutionState::Cancelled,
            Outcome::Failed | Outcome::Unknown => ExecutionState::Failed,
        }
    }
}

/// What a caller asked for. The description is the task itself: it goes to
/// the harness and into the request digest, never into the stored record.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecuteCommand {
    pub harness_profile_ref: String,
    pub repo: String,
    pub title: String,
    pub description: String,
    pub request_id: String,
    pub correlation_id: String,
    pub assignment_ref: String,
    pub report_to_hub: bool,
    pub actor: String,
    pub project: String,
    /// The principal that asked for it (its owner).
    pub principal: String,
    /// The principal's `max_running`, if it has one.
    #[serde(skip)]
    pub quota: Option<usize>,
    /// The caller's W3C `traceparent`, to join its trace (not part of the
    /// request's digest).
    #[serde(skip)]
    pub traceparent: Option<String>,
}

impl ExecuteCommand {
    /// A digest of everything but the request id: the same id with a
    /// different digest is a different request (rule 10).
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut copy = self.clone();
        copy.request_id.clear();
        let bytes = serde_json::to_vec(&copy).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }
}

/// An execution as stored. Raw output and raw errors are not part of it:
/// they only travel on the direct caller's stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecutionRecord {
    pub execution_id: String,
    pub request_id: String,
    pub state: ExecutionState,
    pub harness_profile_ref: String,
    pub title: String,
    pub repo: String,
    pub consumer: Consumer,
    pub correlation_id: String,
    pub assignment_ref: String,
    pub report_to_hub: bool,
    pub effective_sandbox: Option<SandboxSpec>,
    pub evidence: Evidence,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

/// What only the direct caller sees.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawResult {
    pub tool_output: String,
    pub tool_error: String,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
