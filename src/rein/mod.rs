//! Reins: how the daemon starts a harness inside a sandbox, hands it a
//! task, reads its progress and its result, and cleans up after it.
//!
//! `start_session` → `dispatch_tool`... → `end_session` → `cleanup_session`;
//! the lifecycle calls `cleanup_session` whenever `start_session` succeeded.

mod cli_setup;
mod command;
mod home;
mod lines;
pub mod protocol;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use command::CommandRein;

use crate::catalog::Profile;
use crate::policy::GateOutcome;
use crate::sandbox::{Consumer, Sandbox, SandboxBackend};

/// Everything a rein needs to start a harness.
#[derive(Clone)]
pub struct StartContext {
    /// The backend that created the sandbox, to run the harness in it.
    pub backend: Arc<dyn SandboxBackend>,
    /// The sandbox the harness runs in.
    pub sandbox: Sandbox,
    /// The resolved profile: the harness's command, its limits, its settings.
    pub profile: Arc<Profile>,
    /// Who the run is for.
    pub consumer: Consumer,
    /// Per dispatch: the profile's timeout as the gate left it.
    pub timeout: Duration,
    /// `(variable, value)` of the profile's credential routes: for the
    /// harness's environment only (a gatewayed route's value is its
    /// placeholder).
    pub credentials: Vec<(String, String)>,
    /// The routes the credential gateway serves in the sandbox.
    pub gateway: Arc<Vec<crate::credentials::GatewayRoute>>,
}

/// The task as the harness receives it: one JSON line on stdin.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Task {
    /// The line's type: `task` for every task the lifecycle sends.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `run_task` for executions; the turn's tool in a session.
    pub tool: String,
    /// The call's arguments; `null` for an execution's `run_task`.
    pub arguments: serde_json::Value,
    /// The execution's id; empty in a session.
    pub execution_id: String,
    /// The session's id; empty for an execution.
    pub session_id: String,
    /// The execution's title; empty in a session.
    pub title: String,
    /// The execution's task, in the caller's words; empty in a session.
    pub description: String,
    /// Where the workspace is, as the harness sees it.
    pub workspace: String,
}

/// One tool call the lifecycle hands to a harness.
#[derive(Clone, Debug)]
pub struct ToolCall {
    /// The tool, as the gate decides it and the `dispatched` event names it.
    pub tool: String,
    /// What the harness receives for it.
    pub task: Task,
}

/// What the harness reported while it worked.
#[derive(Clone, Debug, PartialEq)]
pub enum HarnessEvent {
    /// A progress line: the harness's own words.
    Progress {
        /// What the harness said; raw, so only the direct caller sees it.
        message: String,
        /// Tokens the harness reported spending so far.
        tokens_so_far: u64,
    },
    /// A tool_use line: the harness is calling a tool.
    ToolUse {
        /// The tool it named.
        tool: String,
        /// Tokens the harness reported spending so far.
        tokens_so_far: u64,
    },
    /// Output went past the profile's `max_output_bytes` and was cut.
    OutputTruncated {
        /// Which stream was cut: `stdout` or `stderr`.
        stream: &'static str,
        /// How many bytes were dropped.
        bytes_dropped: u64,
    },
    /// A plain (non-protocol) line of the harness's stdout, as it comes:
    /// raw output, so only the direct caller sees its text.
    Output {
        /// The line, without its line ending.
        line: String,
    },
    /// The harness asked the gate about a tool call (`policy_request`, or
    /// the agent's hook).
    Gated(GateOutcome),
    /// A call waits for a person's decision. Raw: the summary is scrubbed
    /// and bounded before it is recorded.
    ApprovalRequested {
        /// The id a person decides the call by.
        call_id: String,
        /// The tool the call is for.
        tool: String,
        /// The call's arguments as JSON, whole (bounded by what the harness
        /// could send: one protocol line, one hook body). Not scrubbed yet:
        /// the recorder scrubs it, then cuts it to [`SUMMARY_CHARS`], so no
        /// credential is cut in two before the scrub could see it.
        summary: String,
        /// When the call is denied if nobody decided, in Unix milliseconds.
        expires_at_ms: i64,
    },
    /// How a waiting call was decided.
    ApprovalDecided {
        /// The id of the call.
        call_id: String,
        /// Whether the call may go ahead.
        allow: bool,
        /// The deciding principal, or `corral` when no decision came in time.
        by: String,
        /// The reason given with the decision; may be empty.
        reason: String,
    },
}

/// The `tool_call` gate, as a harness can reach it from inside the sandbox.
pub trait ToolGate: Send + Sync {
    /// The gate's decision on one tool call with these arguments.
    fn check(&self, tool: &str, arguments: &serde_json::Value) -> GateOutcome;
    /// Registers a call the gate asked about, to wait for a person's
    /// decision; `None` when nobody could decide it (it is denied).
    fn open_approval(&self) -> Option<crate::gate::approvals::Waiter>;
    /// Counts a call a person allowed (`max_tool_calls`).
    fn count_approved(&self);
}

/// The longest argument summary an approval request records, in characters.
pub const SUMMARY_CHARS: usize = 512;

/// One tool call through the gate, every step reported on `events`: the
/// decision, and for an *ask* the request and a person's decision within
/// the outcome's time (none in time, the run ending, or `gone`: deny).
/// Returns what the harness is told.
pub async fn decide_call(
    gate: &dyn ToolGate,
    events: &mpsc::Sender<HarnessEvent>,
    tool: &str,
    arguments: &serde_json::Value,
    gone: impl std::future::Future<Output = ()>,
) -> crate::gate::Verdict {
    use crate::gate::Verdict;
    use crate::policy::Action;
    let outcome = gate.check(tool, arguments);
    let (action, denial) = (outcome.action, outcome.denial().cloned());
    let wait = Duration::from_secs(outcome.approval_timeout_seconds);
    let _ = events.send(HarnessEvent::Gated(outcome)).await;
    match (action, denial) {
        (Action::Allow, _) => return Verdict::allow(),
        (_, Some(denial)) => return Verdict::deny(format!("denied by policy {}: {}", denial.policy, denial.reason)),
        (Action::Deny, None) => return Verdict::deny("denied"),
        (Action::Ask, None) => {}
    }
    let verdict = ask_person(gate, events, tool, arguments.to_string(), wait, gone).await;
    if verdict.allow {
        gate.count_approved();
    }
    verdict
}

/// A call the gate answered with *ask*: registers it, reports
/// `ApprovalRequested` (with `summary`, the whole call as JSON: the
/// recorder scrubs it, then cuts it to [`SUMMARY_CHARS`]) and waits up to
/// `wait` for a person's decision, then reports `ApprovalDecided`. None in
/// time denies, and so does `gone` (the agent's hook stopped waiting for
/// the answer: nothing would run on an allow): the call is withdrawn, and
/// a decision after that is refused as for a call no longer waiting.
/// Dropping the future withdraws the call. The caller counts an allowed
/// call.
pub async fn ask_person(
    gate: &dyn ToolGate,
    events: &mpsc::Sender<HarnessEvent>,
    tool: &str,
    summary: String,
    wait: Duration,
    gone: impl std::future::Future<Output = ()>,
) -> crate::gate::Verdict {
    use crate::gate::Verdict;
    let Some(mut waiter) = gate.open_approval() else {
        return Verdict::deny("a person must approve this call, and nobody can here");
    };
    let call_id = waiter.call_id.clone();
    let expires_at_ms = crate::records::now_ms() + wait.as_millis() as i64;
    let requested =
        HarnessEvent::ApprovalRequested { call_id: call_id.clone(), tool: tool.to_string(), summary, expires_at_ms };
    let _ = events.send(requested).await;
    let decision = tokio::select! {
        decided = tokio::time::timeout(wait, waiter.decision()) => Some(decided.ok().flatten()),
        () = gone => None,
    };
    drop(waiter);
    let (allow, by, reason) = match decision {
        Some(Some(d)) => (d.allow, d.by, d.reason),
        Some(None) => (false, "corral".to_string(), format!("no decision within {} s", wait.as_secs())),
        None => (false, "corral".to_string(), "the agent's hook stopped waiting for a decision".to_string()),
    };
    let decided = HarnessEvent::ApprovalDecided { call_id, allow, by: by.clone(), reason: reason.clone() };
    let _ = events.send(decided).await;
    match allow {
        true => Verdict::allow(),
        false if reason.is_empty() => Verdict::deny(format!("denied by {by}")),
        false => Verdict::deny(format!("denied by {by}: {reason}")),
    }
}

/// What a dispatch reports to and is told by the lifecycle.
pub struct Dispatch {
    /// Where the harness's events go, in order.
    pub events: mpsc::Sender<HarnessEvent>,
    /// Cancelled when the run must stop; the harness stops early.
    pub cancel: CancellationToken,
    /// The tool_call gate the harness's policy requests are answered by.
    pub gate: Arc<dyn ToolGate>,
}

/// What a harness returned for one tool call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolResult {
    /// Whether the call succeeded.
    pub ok: bool,
    /// Raw: only for the direct caller.
    pub output: String,
    /// Raw: only for the direct caller.
    pub error: String,
    /// Every token the model processed: `usage.total()` when the harness
    /// reported its usage.
    pub tokens_spent: u64,
    /// The model the harness reported using; empty when it reported none.
    pub resolved_model: String,
    /// The harness's usage, kind by kind, when it reports one.
    pub usage: Option<TokenUsage>,
}

/// The most tokens one count a harness reports may hold: 2^53, the
/// largest integer a JSON reader that holds numbers as doubles (a
/// JavaScript client, a Prometheus sample) still reads exactly, and far
/// beyond any model's spend. A reported count above it is taken as this.
pub const MAX_TOKENS: u64 = 1 << 53;

/// A token count as a harness reported it, bounded by [`MAX_TOKENS`].
pub fn bounded_tokens(reported: u64) -> u64 {
    reported.min(MAX_TOKENS)
}

/// Tokens by kind. The four counts are disjoint: `input` is what was read
/// from no cache, so the total is their sum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenUsage {
    /// Tokens read from no cache.
    pub input: u64,
    /// Tokens the model wrote.
    pub output: u64,
    /// Tokens read from the prompt cache.
    pub cache_read: u64,
    /// Tokens written to the prompt cache.
    pub cache_creation: u64,
    /// What the harness says the run cost, when it says.
    pub cost_usd: Option<f64>,
}

impl TokenUsage {
    /// Every token of the four kinds, summed, at most [`MAX_TOKENS`]: the
    /// counts are the harness's, so the sum must not overflow whatever
    /// they are.
    pub fn total(&self) -> u64 {
        let sum = [self.output, self.cache_read, self.cache_creation].into_iter().fold(self.input, u64::saturating_add);
        bounded_tokens(sum)
    }

    /// One line for the evidence's notes.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "tokens {} = input {} + output {} + cache read {} + cache creation {}",
            self.total(),
            self.input,
            self.output,
            self.cache_read,
            self.cache_creation
        );
        if let Some(cost) = self.cost_usd {
            text.push_str(&format!("; cost ${cost:.6}"));
        }
        text
    }
}

/// Why a harness step failed. The text is raw (it may carry the harness's
/// words), so it goes only to the direct caller; the evidence keeps a fixed
/// sentence.
#[derive(Debug, thiserror::Error)]
pub enum ReinError {
    /// The harness could not be started in the sandbox.
    #[error("harness start failed: {0}")]
    Start(String),
    /// The tool call could not be handed to the harness, or its answer could
    /// not be read.
    #[error("harness dispatch failed: {0}")]
    Dispatch(String),
    /// The harness process is gone; a session restarts it through the gate.
    #[error("harness exited: {0}")]
    Exited(String),
    /// The call outlasted the profile's timeout, the duration given.
    #[error("harness timed out after {0:?}")]
    TimedOut(Duration),
    /// The run was cancelled while the call was in flight.
    #[error("cancelled")]
    Cancelled,
    /// The harness did not end cleanly when its session was ended.
    #[error("harness end failed: {0}")]
    End(String),
    /// What the harness left running could not be killed.
    #[error("harness cleanup failed: {0}")]
    Cleanup(String),
}

/// An adapter that runs harnesses: one per `rein.kind` a profile may name.
#[async_trait]
pub trait Rein: Send + Sync {
    /// The kind this rein serves, as profiles name it in `rein.kind`.
    fn name(&self) -> &str;
    /// Starts the profile's harness in the sandbox, ready for its first tool
    /// call.
    async fn start_session(&self, ctx: StartContext) -> Result<Box<dyn HarnessSession>, ReinError>;
}

/// One started harness, from `start_session` until `cleanup_session`.
#[async_trait]
pub trait HarnessSession: Send + Sync {
    /// Hands one tool call to the harness and waits for its result,
    /// reporting progress and answering its policy requests through
    /// `dispatch`. Stops early on `dispatch.cancel`.
    async fn dispatch_tool(&mut self, call: ToolCall, dispatch: Dispatch) -> Result<ToolResult, ReinError>;
    /// Whether the harness process still runs.
    fn is_alive(&mut self) -> bool;
    /// Whether the turn `call` would start a new run of the harness's
    /// program in its sandbox: Claude Code and Codex resume their
    /// conversation in a new run of the CLI for every turn after the first
    /// (a turn they refuse before running, e.g. one without a prompt,
    /// starts none). Such a start passes the agent_start gate again, as a
    /// restart does.
    fn starts_anew(&self, call: &ToolCall) -> bool {
        let _ = call;
        false
    }
    /// How it was started (argv as run, variable names, endpoint, files).
    fn invocation(&self) -> crate::types::evidence::HarnessInvocation {
        crate::types::evidence::HarnessInvocation::default()
    }
    /// Ends the harness gracefully, waiting a bounded time for it to exit;
    /// `cleanup_session` kills whatever is left.
    async fn end_session(&mut self) -> Result<(), ReinError>;
    /// Kills whatever the harness left running. Safe to call twice.
    async fn cleanup_session(&mut self) -> Result<(), ReinError>;
}

#[cfg(test)]
mod ask_tests {
    use super::*;
    use crate::gate::approvals::{Approvals, Decision, Undecidable};
    use crate::policy::{Action, GateOutcome, Phase};

    /// A gate that asks about every call, its approvals in `approvals`.
    struct Asking {
        approvals: Arc<Approvals>,
    }

    impl ToolGate for Asking {
        fn check(&self, tool: &str, _: &serde_json::Value) -> GateOutcome {
            GateOutcome {
                phase: Phase::ToolCall,
                tool: tool.into(),
                action: Action::Ask,
                decisions: Vec::new(),
                effective_sandbox: Default::default(),
                effective_timeout_seconds: 60,
                approval_timeout_seconds: 60,
            }
        }

        fn open_approval(&self) -> Option<crate::gate::approvals::Waiter> {
            Some(self.approvals.open("run-1"))
        }

        fn count_approved(&self) {}
    }

    /// A call whose hook stopped waiting is denied and withdrawn at once:
    /// a person's allow after it is refused as for a call no longer
    /// waiting, and the record says why it was denied.
    #[tokio::test]
    async fn a_call_whose_hook_stopped_waiting_is_withdrawn_and_denied() {
        let gate = Asking { approvals: Arc::default() };
        let (tx, mut rx) = mpsc::channel(8);
        let (hang_up, gone) = tokio::sync::oneshot::channel::<()>();
        let gone = async move {
            let _ = gone.await;
        };
        let arguments = serde_json::json!({});
        let deciding = decide_call(&gate, &tx, "Write", &arguments, gone);
        tokio::pin!(deciding);
        // Until the call is asked about.
        let call_id = loop {
            tokio::select! {
                event = rx.recv() => if let Some(HarnessEvent::ApprovalRequested { call_id, .. }) = event {
                    break call_id;
                },
                _ = &mut deciding => panic!("decided before anybody asked"),
            }
        };
        drop(hang_up);
        let verdict = tokio::time::timeout(Duration::from_secs(5), deciding).await.expect("denied once the hook went");
        assert_eq!(
            (verdict.allow, verdict.reason.as_str()),
            (false, "denied by corral: the agent's hook stopped waiting for a decision")
        );
        let allow = Decision { allow: true, by: "adm".into(), reason: String::new() };
        assert_eq!(gate.approvals.decide("run-1", &call_id, allow), Err(Undecidable::Settled));
        let mut decided = None;
        while let Ok(event) = rx.try_recv() {
            if let HarnessEvent::ApprovalDecided { allow, by, reason, .. } = event {
                decided = Some((allow, by, reason));
            }
        }
        let expected = (false, "corral".to_string(), "the agent's hook stopped waiting for a decision".to_string());
        assert_eq!(decided, Some(expected));
    }
}
