//! The execution record and its states.

use serde::{Deserialize, Serialize};

use crate::types::evidence::{Evidence, Outcome};
use crate::types::{Consumer, SandboxSpec};

/// Where an execution is in its life. Every state past `Running` is terminal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionState {
    /// Not running yet. The default; the daemon itself stores a new execution
    /// as `Running`.
    #[default]
    Pending,
    /// Accepted and under way, from the moment it is stored.
    Running,
    /// It ended and did what was asked.
    Succeeded,
    /// It ended in a failure at some stage (see the evidence).
    Failed,
    /// It was refused before it ran: by resolution or by the gate.
    Refused,
    /// It was cancelled before it ended.
    Cancelled,
}

impl ExecutionState {
    /// The state's snake_case word, as stored.
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

    /// The state a word names; `None` for a word that names none.
    pub fn parse(s: &str) -> Option<ExecutionState> {
        [Self::Pending, Self::Running, Self::Succeeded, Self::Failed, Self::Refused, Self::Cancelled]
            .into_iter()
            .find(|state| state.as_str() == s)
    }

    /// Whether the execution has ended, so the state will not change again.
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
    /// The profile as the request named it: `id@version`, or a bare `id`.
    pub harness_profile_ref: String,
    /// A local git repository the workspace starts from; empty means it starts
    /// empty.
    pub repo: String,
    /// A short title, kept in the record.
    pub title: String,
    /// The task itself, handed to the harness; never stored.
    pub description: String,
    /// The caller's idempotency key: the same key and command return the same
    /// execution.
    pub request_id: String,
    /// The caller's own reference, carried into the evidence and the hub
    /// report.
    pub correlation_id: String,
    /// The caller's reference to the assignment the task belongs to, carried
    /// into the evidence and the hub report.
    pub assignment_ref: String,
    /// Whether to report the finished execution to the configured hub.
    pub report_to_hub: bool,
    /// The governed consumer type: `adm`, `agt` or `atm`.
    pub actor: String,
    /// The project the execution runs in.
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
    /// The caller follows the run's events on a stream (`Execute`, not
    /// `StartExecution`); not part of the request's digest.
    #[serde(skip)]
    pub follows: bool,
    /// The caller asked for the run to be cancelled when it goes away
    /// (`Execute`'s `cancel_on_disconnect`); not part of the digest.
    #[serde(skip)]
    pub cancel_on_disconnect: bool,
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
    /// The execution's id, chosen by the daemon.
    pub execution_id: String,
    /// The caller's idempotency key.
    pub request_id: String,
    /// Where the execution is in its life.
    pub state: ExecutionState,
    /// The profile as the request named it; the pinned `id@version` is
    /// `evidence.profile_ref`.
    pub harness_profile_ref: String,
    /// The request's title.
    pub title: String,
    /// The repository the workspace started from; empty when it started empty.
    pub repo: String,
    /// Who the execution is for.
    pub consumer: Consumer,
    /// The caller's own reference, as it was given.
    pub correlation_id: String,
    /// The caller's assignment reference, as it was given.
    pub assignment_ref: String,
    /// Whether the caller asked for a hub report.
    pub report_to_hub: bool,
    /// The sandbox after the gate's overrides; `None` until the gate has
    /// decided.
    pub effective_sandbox: Option<SandboxSpec>,
    /// The redacted record of what happened.
    pub evidence: Evidence,
    /// Unix milliseconds.
    pub created_at_ms: i64,
    /// When it ended, in Unix milliseconds; `None` while it has not.
    pub finished_at_ms: Option<i64>,
}

/// What only the direct caller sees.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawResult {
    /// The harness's raw output.
    pub tool_output: String,
    /// The raw error; empty when there was none.
    pub tool_error: String,
}

impl RawResult {
    /// Each NUL character replaced by U+FFFD: a harness may print any byte,
    /// and PostgreSQL's text columns refuse NUL (the whole final write of
    /// the run would fail with it). Done before the result goes anywhere,
    /// so the caller, the store and a later read agree.
    pub fn without_nul(&mut self) {
        for text in [&mut self.tool_output, &mut self.tool_error] {
            if text.contains('\0') {
                *text = text.replace('\0', "\u{FFFD}");
            }
        }
    }
}

/// The current time in Unix milliseconds (0 if the clock is before 1970).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
