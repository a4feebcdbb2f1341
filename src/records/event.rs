//! One step of a subject's lifecycle, as stored and as sent.

use serde::{Deserialize, Serialize};

use super::{ExecutionRecord, SessionRecord};
use crate::types::evidence::TeardownResult;
use crate::types::Readiness;
use crate::types::{Action, PolicyDecision};
use crate::types::{Consumer, EnforcementReceipt, SandboxSpec, SandboxType};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub subject_id: String,
    pub sequence: u64,
    pub time_ms: i64,
    pub kind: EventKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// Stored without its default-valued fields (see `store::stored`), so
/// every field that can hold a default reads a missing one as it.
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    Accepted {
        #[serde(default)]
        execution_id: String,
        #[serde(default)]
        session_id: String,
        #[serde(default)]
        request_id: String,
        #[serde(default)]
        consumer: Consumer,
    },
    Resolved {
        #[serde(default)]
        profile_ref: String,
        #[serde(default)]
        profile_digest: String,
        #[serde(default)]
        readiness: Readiness,
    },
    Gated {
        #[serde(default)]
        phase: String,
        /// At `tool_call`: the tool the decision is about.
        #[serde(default)]
        tool: String,
        action: Action,
        #[serde(default)]
        decisions: Vec<PolicyDecision>,
        effective_sandbox: SandboxSpec,
    },
    SandboxReady {
        #[serde(default)]
        sandbox_id: String,
        backend: SandboxType,
        #[serde(default)]
        workspace_path: String,
        #[serde(default)]
        receipt: EnforcementReceipt,
    },
    Dispatched {
        #[serde(default)]
        tool: String,
    },
    /// The harness's own message is not stored: it is raw output and only
    /// reaches the direct caller (see [`RawPart`]).
    Progress {
        #[serde(default)]
        progress_kind: String,
        #[serde(default)]
        tool: String,
        #[serde(default)]
        tokens_so_far: u64,
    },
    OutputTruncated {
        #[serde(default)]
        stream: String,
        #[serde(default)]
        bytes_dropped: u64,
    },
    /// A dead harness was started again, after the agent_start gate.
    HarnessRestarted {
        #[serde(default)]
        attempt: u64,
        #[serde(default)]
        reason: String,
    },
    /// A session's turn ended; its raw output rides as a [`RawPart`].
    TurnFinished {
        #[serde(default)]
        turn: u64,
        #[serde(default)]
        tool: String,
        #[serde(default)]
        ok: bool,
        #[serde(default)]
        error: String,
        #[serde(default)]
        tokens_spent: u64,
    },
    /// An idle session was ended by the reaper.
    Reaped {
        #[serde(default)]
        idle_seconds: u64,
    },
    /// A restarted daemon finished what its predecessor left running.
    Recovered {
        #[serde(default)]
        note: String,
    },
    /// One egress attempt through the sandbox's proxy.
    Egress {
        #[serde(default)]
        host: String,
        #[serde(default)]
        port: u16,
        #[serde(default)]
        allowed: bool,
        #[serde(default)]
        rule_or_reason: String,
        #[serde(default)]
        method: String,
    },
    /// A limit of the run was reached (memory, pids, workspace, events).
    LimitHit {
        #[serde(default)]
        limit: String,
        #[serde(default)]
        value: u64,
        #[serde(default)]
        detail: String,
    },
    /// A tool call waits for a person's decision (`DecideToolCall`).
    ApprovalRequested {
        #[serde(default)]
        call_id: String,
        #[serde(default)]
        tool: String,
        /// The call's arguments, scrubbed and cut.
        #[serde(default)]
        summary: String,
        #[serde(default)]
        expires_at_ms: i64,
    },
    /// How a waiting call was decided: by a principal, or by corral when
    /// nobody decided in time.
    ApprovalDecided {
        #[serde(default)]
        call_id: String,
        #[serde(default)]
        allow: bool,
        #[serde(default)]
        decided_by: String,
        #[serde(default)]
        reason: String,
    },
    Teardown {
        session_cleanup: TeardownResult,
        sandbox_destroy: TeardownResult,
    },
    Finished {
        execution: Box<ExecutionRecord>,
    },
    SessionFinished {
        session: Box<SessionRecord>,
    },
}

impl EventKind {
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Accepted { .. } => "accepted",
            EventKind::Resolved { .. } => "resolved",
            EventKind::Gated { .. } => "gated",
            EventKind::SandboxReady { .. } => "sandbox_ready",
            EventKind::Dispatched { .. } => "dispatched",
            EventKind::Progress { .. } => "progress",
            EventKind::OutputTruncated { .. } => "output_truncated",
            EventKind::HarnessRestarted { .. } => "harness_restarted",
            EventKind::TurnFinished { .. } => "turn_finished",
            EventKind::Reaped { .. } => "reaped",
            EventKind::Recovered { .. } => "recovered",
            EventKind::LimitHit { .. } => "limit",
            EventKind::Egress { .. } => "egress",
            EventKind::ApprovalRequested { .. } => "approval_requested",
            EventKind::ApprovalDecided { .. } => "approval_decided",
            EventKind::Teardown { .. } => "teardown",
            EventKind::Finished { .. } | EventKind::SessionFinished { .. } => "finished",
        }
    }

    pub fn is_finished(&self) -> bool {
        matches!(self, EventKind::Finished { .. } | EventKind::SessionFinished { .. })
    }
}
