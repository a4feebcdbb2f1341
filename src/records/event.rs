//! One step of a subject's lifecycle, as stored and as sent.

use serde::{Deserialize, Serialize};

use super::{ExecutionRecord, SessionRecord};
use crate::types::evidence::TeardownResult;
use crate::types::Readiness;
use crate::types::{Action, PolicyDecision};
use crate::types::{Consumer, EnforcementReceipt, SandboxSpec, SandboxType};

/// One step of an execution's or a session's lifecycle. Sequences start at 1
/// and have no gaps per subject; an event is stored before it is sent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The execution id or session id the event belongs to.
    pub subject_id: String,
    /// The event's place in its subject's history, from 1, without gaps.
    pub sequence: u64,
    /// When the event was recorded, in Unix milliseconds.
    pub time_ms: i64,
    /// What happened, with the facts of that step.
    pub kind: EventKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
/// Stored without its default-valued fields (see `store::stored`), so
/// every field that can hold a default reads a missing one as it.
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    /// The request was taken; the first event of every subject.
    Accepted {
        /// The execution's id; empty on a session's event.
        #[serde(default)]
        execution_id: String,
        /// The session's id; empty on an execution's event.
        #[serde(default)]
        session_id: String,
        /// The caller's idempotency key; empty for a session, which has none.
        #[serde(default)]
        request_id: String,
        /// Who the run is for.
        #[serde(default)]
        consumer: Consumer,
    },
    /// The harness profile was resolved to one pinned version.
    Resolved {
        /// The pinned `id@version`.
        #[serde(default)]
        profile_ref: String,
        /// The digest of the resolved profile.
        #[serde(default)]
        profile_digest: String,
        /// How far the profile is known to work.
        #[serde(default)]
        readiness: Readiness,
    },
    /// The policy gate decided, before a harness starts or before a tool call.
    Gated {
        /// When the gate ran: `agent_start` or `tool_call`.
        #[serde(default)]
        phase: String,
        /// At `tool_call`: the tool the decision is about.
        #[serde(default)]
        tool: String,
        /// What the gate decided as a whole.
        action: Action,
        /// Each evaluated policy's verdict, in evaluation order.
        #[serde(default)]
        decisions: Vec<PolicyDecision>,
        /// The sandbox after the gate's overrides, as it will be enforced.
        effective_sandbox: SandboxSpec,
    },
    /// The sandbox was created and its workspace is in place.
    SandboxReady {
        /// The sandbox's id.
        #[serde(default)]
        sandbox_id: String,
        /// The sandbox backend that enforces it.
        backend: SandboxType,
        /// The workspace's path as the harness sees it.
        #[serde(default)]
        workspace_path: String,
        /// What the sandbox proved it enforces.
        #[serde(default)]
        receipt: EnforcementReceipt,
    },
    /// The task was handed to the harness.
    Dispatched {
        /// The tool the task was dispatched as (`run_task` for an execution).
        #[serde(default)]
        tool: String,
    },
    /// The harness's own message is not stored: it is raw output and only
    /// reaches the direct caller (see [`RawPart`]).
    Progress {
        /// What the harness line was: `progress`, `tool_use` or `output`.
        #[serde(default)]
        progress_kind: String,
        /// The tool named by a `tool_use` line; empty otherwise.
        #[serde(default)]
        tool: String,
        /// Tokens the harness reported spending so far; 0 when it reported
        /// none.
        #[serde(default)]
        tokens_so_far: u64,
    },
    /// Output was cut because it went past a limit.
    OutputTruncated {
        /// Which output was cut: `stdout`, `stderr`, `tool_output` or
        /// `tool_error`.
        #[serde(default)]
        stream: String,
        /// How many bytes were dropped.
        #[serde(default)]
        bytes_dropped: u64,
    },
    /// A dead harness was started again, after the agent_start gate.
    HarnessRestarted {
        /// The number of this restart, from 1.
        #[serde(default)]
        attempt: u64,
        /// Why the harness had to be started again.
        #[serde(default)]
        reason: String,
    },
    /// A session's turn ended; its raw output rides as a [`RawPart`].
    TurnFinished {
        /// The turn's number in its session, from 1.
        #[serde(default)]
        turn: u64,
        /// The tool the turn called.
        #[serde(default)]
        tool: String,
        /// Whether the turn succeeded.
        #[serde(default)]
        ok: bool,
        /// A fixed sentence, or the deciding policy and its reason; empty when
        /// the turn succeeded.
        #[serde(default)]
        error: String,
        /// Tokens the turn spent.
        #[serde(default)]
        tokens_spent: u64,
    },
    /// An idle session was ended by the reaper.
    Reaped {
        /// How long the session had been idle, in seconds.
        #[serde(default)]
        idle_seconds: u64,
    },
    /// A restarted daemon finished what its predecessor left running.
    Recovered {
        /// What the recovering daemon did, in its own words.
        #[serde(default)]
        note: String,
    },
    /// One egress attempt through the sandbox's proxy.
    Egress {
        /// The host the sandbox tried to reach.
        #[serde(default)]
        host: String,
        /// The port it tried to reach.
        #[serde(default)]
        port: u16,
        /// Whether the proxy let the attempt through.
        #[serde(default)]
        allowed: bool,
        /// The allowlist rule that allowed it, or the reason it was denied.
        #[serde(default)]
        rule_or_reason: String,
        /// How the request reached the proxy: `connect`, `http` or `gateway`.
        #[serde(default)]
        method: String,
    },
    /// A limit of the run was reached (memory, pids, workspace, events).
    LimitHit {
        /// Which limit was reached: `memory`, `pids`, `workspace`, `events` or
        /// `event_bytes`.
        #[serde(default)]
        limit: String,
        /// The limit that was reached, as configured, in its own unit (bytes,
        /// processes, files or events).
        #[serde(default)]
        value: u64,
        /// What was reached and what follows from it, in the daemon's words.
        #[serde(default)]
        detail: String,
    },
    /// A tool call waits for a person's decision (`DecideToolCall`).
    ApprovalRequested {
        /// The id `DecideToolCall` names to decide this call.
        #[serde(default)]
        call_id: String,
        /// The tool the call is for.
        #[serde(default)]
        tool: String,
        /// The call's arguments, scrubbed and cut.
        #[serde(default)]
        summary: String,
        /// When the call is denied if nobody decided, in Unix milliseconds.
        #[serde(default)]
        expires_at_ms: i64,
    },
    /// How a waiting call was decided: by a principal, or by corral when
    /// nobody decided in time.
    ApprovalDecided {
        /// The id of the call that was decided.
        #[serde(default)]
        call_id: String,
        /// Whether the call may go ahead.
        #[serde(default)]
        allow: bool,
        /// The deciding principal, or `corral` when nobody decided in time or
        /// the run ended first.
        #[serde(default)]
        decided_by: String,
        /// The reason given with the decision; may be empty.
        #[serde(default)]
        reason: String,
    },
    /// The sandbox was torn down; how each step of the teardown went.
    Teardown {
        /// How cleaning up the harness's session went.
        session_cleanup: TeardownResult,
        /// How destroying the sandbox went.
        sandbox_destroy: TeardownResult,
    },
    /// An execution ended; the last event of an execution.
    Finished {
        /// The execution's final record.
        execution: Box<ExecutionRecord>,
    },
    /// A session ended; the last event of a session.
    SessionFinished {
        /// The session's final record.
        session: Box<SessionRecord>,
    },
}

impl EventKind {
    /// The kind's snake_case name, as the store keeps it in the event's kind
    /// column; both finished kinds are `finished`.
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

    /// Whether this is the last event of its subject.
    pub fn is_finished(&self) -> bool {
        matches!(self, EventKind::Finished { .. } | EventKind::SessionFinished { .. })
    }
}
