//! One step of a subject's lifecycle, as stored and as sent.

use serde::{Deserialize, Serialize};

use super::{ExecutionRecord, SessionRecord};
use crate::catalog::Readiness;
use crate::evidence::TeardownResult;
use crate::policy::{Action, PolicyDecision};
use crate::sandbox::{Consumer, EnforcementReceipt, SandboxSpec, SandboxType};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub subject_id: String,
    pub sequence: u64,
    pub time_ms: i64,
    pub kind: EventKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    Accepted {
        execution_id: String,
        session_id: String,
        request_id: String,
        consumer: Consumer,
    },
    Resolved {
        profile_ref: String,
        profile_digest: String,
        readiness: Readiness,
    },
    Gated {
        phase: String,
        action: Action,
        decisions: Vec<PolicyDecision>,
        effective_sandbox: SandboxSpec,
    },
    SandboxReady {
        sandbox_id: String,
        backend: SandboxType,
        workspace_path: String,
        receipt: EnforcementReceipt,
    },
    Dispatched {
        tool: String,
    },
    /// The harness's own message is not stored: it is raw output and only
    /// reaches the direct caller (see [`RawPart`]).
    Progress {
        progress_kind: String,
        tool: String,
        tokens_so_far: u64,
    },
    OutputTruncated {
        stream: String,
        bytes_dropped: u64,
    },
    /// A dead harness was started again, after the agent_start gate.
    HarnessRestarted {
        attempt: u64,
        reason: String,
    },
    /// A session's turn ended; its raw output rides as a [`RawPart`].
    TurnFinished {
        turn: u64,
        tool: String,
        ok: bool,
        error: String,
        tokens_spent: u64,
    },
    /// An idle session was ended by the reaper.
    Reaped {
        idle_seconds: u64,
    },
    /// A restarted daemon finished what its predecessor left running.
    Recovered {
        note: String,
    },
    /// One egress attempt through the sandbox's proxy.
    Egress {
        host: String,
        port: u16,
        allowed: bool,
        rule_or_reason: String,
        method: String,
    },
    /// A limit of the run was reached (memory, pids, workspace, events).
    LimitHit {
        limit: String,
        value: u64,
        detail: String,
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
            EventKind::Teardown { .. } => "teardown",
            EventKind::Finished { .. } | EventKind::SessionFinished { .. } => "finished",
        }
    }

    pub fn is_finished(&self) -> bool {
        matches!(self, EventKind::Finished { .. } | EventKind::SessionFinished { .. })
    }
}
