//! Sessions: a harness that takes turns in one sandbox until it is ended or
//! reaped. Built on the same [`Core`] as executions.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::admission;
use super::core::{Core, OpenFailure, TurnOutcome};
use super::fit::{fit_raw, json_len};
use super::{now_ms, Engine, EngineError, RawResult, SessionRecord, SessionState, Subscription};
use crate::events::{EventKind, RawPart, Recorder};
use crate::policy::{Policy, PolicySpec};
use crate::rein::{Task, ToolCall};
use crate::sandbox::{Consumer, WORKSPACE_MOUNT};
use crate::store::SessionInsert;
use crate::types::evidence::{FailureStage, Outcome};

/// What a caller asked for when it created a session. Serialised as it is
/// when a node hands the create to another (see `place`): the compiled
/// policies stay behind, and the taker compiles `policy_specs` again.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct CreateSessionCommand {
    /// The id to give the session (the API scopes it to its principal); empty:
    /// the daemon picks one.
    pub session_id: String,
    /// The profile as the request named it: `id@version`, or a bare `id`.
    pub profile_ref: String,
    /// The governed consumer type: `adm`, `agt` or `atm`.
    pub actor: String,
    /// The project the session runs in.
    pub project: String,
    /// A local git repository the workspace starts from; empty means it starts
    /// empty.
    pub repo: String,
    /// The caller's own policies, which the gate evaluates first.
    #[serde(skip)]
    pub policies: Vec<Policy>,
    /// The same policies as written, for a node this one hands the session
    /// to (see `place`).
    pub policy_specs: Vec<PolicySpec>,
    /// The principal that asked for it, and its `max_running`.
    pub principal: String,
    /// The principal's `max_running`, if it has one.
    pub quota: Option<usize>,
    /// The caller's W3C trace context: the session's start joins it.
    pub traceparent: Option<String>,
}

/// A session whose harness is alive.
pub(super) struct LiveSession {
    core: tokio::sync::Mutex<Core>,
    record: Mutex<SessionRecord>,
    turn_cancel: Mutex<Option<CancellationToken>>,
    last_active: Mutex<Instant>,
    busy: AtomicBool,
    turns: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the owner of a session answers a forwarded turn with.
#[derive(serde::Serialize, serde::Deserialize)]
struct StartedTurn {
    /// The turn's number in the session.
    turn: u64,
    /// The session's last sequence before the turn's first event.
    after: u64,
}

/// See [`Engine::ended_answer`].
#[derive(serde::Serialize)]
struct EndedRef<'a> {
    record: &'a SessionRecord,
    cause: Option<&'a str>,
}

#[derive(serde::Deserialize)]
struct Ended {
    record: SessionRecord,
    cause: Option<String>,
}

/// Why a session ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// Its caller ended it.
    Requested,
    /// The reaper ended it after it was idle this long.
    Idle(Duration),
    /// The daemon is shutting down.
    Shutdown,
    /// The task running one of its turns panicked (a bug): what it held is
    /// torn down and the session ends `failed`.
    TurnPanicked,
    /// The store refused a turn's `turn_finished` (past its retries): the
    /// session ends `failed`, as for a panic.
    TurnNotStored,
}

impl Engine {
    pub(super) fn live_session(&self, id: &str) -> Option<Arc<LiveSession>> {
        lock(&self.sessions).get(id).cloned()
    }

    /// Creates a session and starts its harness: resolution, the agent_start
    /// gate, the sandbox and the harness, on the engine's own task. Returns the
    /// record once the session is active, or why it could not be.
    pub async fn create_session(self: &Arc<Self>, cmd: CreateSessionCommand) -> Result<SessionRecord, EngineError> {
        if self.is_draining() {
            return Err(EngineError::Unavailable(super::DRAINING.into()));
        }
        let id = if cmd.session_id.is_empty() { uuid::Uuid::now_v7().to_string() } else { cmd.session_id.clone() };
        // Here, on another node or in the store: taken is taken, said with
        // the session's id.
        self.create_session_as(cmd, id.clone()).await.map_err(|e| match e {
            EngineError::AlreadyExists(_) => EngineError::SessionExists(id),
            e => e,
        })
    }

    async fn create_session_as(
        self: &Arc<Self>,
        cmd: CreateSessionCommand,
        id: String,
    ) -> Result<SessionRecord, EngineError> {
        // The caller's own id (ids are scoped to their principal): taken is
        // taken, whether the session is starting, runs or has ended.
        let taken = || self.live_session(&id).is_some() || self.admission.holds(&id, admission::Work::Session);
        if taken() {
            return Err(EngineError::AlreadyExists(format!("session {id}")));
        }
        if !self.takes_sessions_of(&cmd.profile_ref) {
            return self.create_elsewhere(cmd, id, None).await;
        }
        if !self.lease_holds() {
            let why = format!("node {} cannot confirm its lease with the store now; retry", self.store.node());
            return self.create_elsewhere(cmd, id, Some(why)).await;
        }
        match self.reserve_session(&id, &cmd) {
            Ok(()) => self.start_session(cmd, id).await,
            // A start of this id got here first.
            Err(_) if taken() => Err(EngineError::AlreadyExists(format!("session {id}"))),
            Err(full) if self.store.is_shared() => self.create_elsewhere(cmd, id, Some(full)).await,
            Err(full) => Err(EngineError::Overloaded(full)),
        }
    }

    /// Takes a session slot under this node's admission limits (and, on a
    /// single node, the principal's quota; a fleet counts that in the
    /// store); the refusal says why not.
    pub(super) fn reserve_session(&self, id: &str, cmd: &CreateSessionCommand) -> Result<(), String> {
        let local_quota = if self.store.is_shared() { None } else { cmd.quota };
        // The slot's token cancels the start: an EndSession while it starts,
        // or a shutdown past its grace.
        self.admission
            .reserve_under(id, admission::Work::Session, &cmd.principal, local_quota, &self.draining)
            .map(|_| ())
            .map_err(|refused| refused.0)
    }

    /// Whether session `id` is starting here: it holds a slot, and is not
    /// live yet.
    pub(super) fn starting_here(&self, id: &str) -> bool {
        self.live_session(id).is_none() && self.admission.holds(id, admission::Work::Session)
    }

    /// Starts a session that holds its slot here.
    pub(super) async fn start_session(
        self: &Arc<Self>,
        cmd: CreateSessionCommand,
        id: String,
    ) -> Result<SessionRecord, EngineError> {
        // On the engine's own task: a caller that goes away mid-start (a
        // disconnect, its deadline) leaves a session that is whole, or none,
        // and its slot is given back exactly when it should be.
        let engine = self.clone();
        let cancel = self.admission.token(&id, admission::Work::Session).unwrap_or_else(|| self.draining.child_token());
        // One trace for the start (resolve, gate, sandbox, harness start),
        // joined to the caller's; every log line carries the session's id.
        let span = tracing::info_span!("session", session_id = %id);
        crate::telemetry::set_parent(&span, cmd.traceparent.as_deref());
        let create = tokio::spawn({
            let (engine, id) = (engine.clone(), id.clone());
            async move {
                let created = engine.create_admitted(cmd, id.clone(), cancel).await;
                if created.is_err() {
                    engine.release(&id);
                }
                created
            }
            .instrument(span.clone())
        });
        // The start in a task of its own, awaited by one of the engine's:
        // a panic (a bug) is recovered whether or not its caller still
        // waits, and before the daemon's shutdown closes the store.
        let start = self.tasks.spawn(
            async move {
                match create.await {
                    Ok(created) => created,
                    Err(e) if e.is_panic() => {
                        // What it held is torn down and it is recorded failed,
                        // as recovery would after a crash; its slot goes back.
                        tracing::error!(session_id = %id, error = %e, "a session start's task failed; recovering it");
                        let recovered = engine.recover_panicked(&id).await;
                        if let Err(e) = &recovered {
                            tracing::error!(session_id = %id, error = %e, "a failed session start not recovered");
                        }
                        engine.bus.close(&id);
                        engine.release(&id);
                        Err(EngineError::Unavailable(match recovered {
                            Ok(()) => format!("the daemon's task starting session {id} failed; it is recorded failed"),
                            Err(_) => format!("the daemon's task starting session {id} failed"),
                        }))
                    }
                    // Cancelled with the runtime: the daemon is going away.
                    Err(_) => Err(EngineError::Unavailable("the session start did not finish".into())),
                }
            }
            .instrument(span),
        );
        start.await.unwrap_or_else(|_| Err(EngineError::Unavailable("the session start did not finish".into())))
    }

    async fn create_admitted(
        self: &Arc<Self>,
        cmd: CreateSessionCommand,
        id: String,
        cancel: CancellationToken,
    ) -> Result<SessionRecord, EngineError> {
        let consumer = Consumer {
            actor: cmd.actor.clone(),
            project: cmd.project.clone(),
            run_id: id.clone(),
            session_id: id.clone(),
            principal: cmd.principal.clone(),
        };
        let mut record = SessionRecord {
            session_id: id.clone(),
            profile_ref: cmd.profile_ref.clone(),
            consumer: consumer.clone(),
            repo: cmd.repo.clone(),
            created_at_ms: now_ms(),
            ..SessionRecord::default()
        };
        match self.store.insert_session_admitted(&record, cmd.quota).await? {
            SessionInsert::Created => {}
            SessionInsert::Taken => return Err(EngineError::AlreadyExists(format!("session {id}"))),
            SessionInsert::AtQuota(running) => {
                crate::telemetry::admission_refused("quota");
                return Err(EngineError::Overloaded(format!(
                    "principal {} has {running} executions and sessions running across the fleet: its \
                     max_running quota of {} is reached",
                    cmd.principal,
                    cmd.quota.unwrap_or_default()
                )));
            }
        }
        let _live = self.bus.open(&id);
        let recorder = Recorder::new(id.clone(), 0, self.store.clone(), self.bus.clone());
        let mut core = Core::new(self.clone(), recorder, consumer.clone(), cmd.repo, cmd.policies);
        let accepted = EventKind::Accepted {
            execution_id: String::new(),
            session_id: id.clone(),
            request_id: String::new(),
            consumer,
        };
        core.recorder.emit(accepted, None).await;
        let opened = core.open(&cmd.profile_ref, &cancel).await;
        // A session's harness is started now; its first task may be far off.
        core.begin_refill();
        record.effective_sandbox = core.effective();
        record.evidence = core.evidence.clone();
        if let Err(failure) = opened {
            core.close(false).await;
            record.state = match failure {
                OpenFailure::Refused { .. } | OpenFailure::Denied { .. } => SessionState::Refused,
                OpenFailure::Cancelled if !self.draining.is_cancelled() => {
                    return Err(self.end_starting(&mut core, &mut record).await);
                }
                OpenFailure::Failed { .. } | OpenFailure::Cancelled => SessionState::Failed,
            };
            self.finish_session(&mut core, &mut record).await;
            return Err(match failure {
                OpenFailure::Refused { reason } => EngineError::Refused(reason),
                OpenFailure::Denied { policy, reason } => EngineError::AgentStartDenied { policy, reason },
                OpenFailure::Failed { stage, .. } => {
                    EngineError::StageFailed { stage, raw: core.raw.tool_error.clone() }
                }
                OpenFailure::Cancelled => EngineError::Unavailable("the daemon is shutting down".into()),
            });
        }
        // Its `sandbox_ready`, held for a write to go with: a first turn
        // may be far off.
        core.recorder.flush().await;
        core.watch_between_turns();
        record.state = SessionState::Active;
        if let Err(e) = self.store.update_session(&record).await {
            tracing::error!(session_id = %id, error = %e, "session record not stored");
        }
        // Checked and made live under the lock `end_session` cancels under:
        // an EndSession either finds it live, or its cancel is seen here.
        let ended = {
            let mut sessions = lock(&self.sessions);
            match cancel.is_cancelled() {
                true => Some(core),
                false => {
                    let live = Arc::new(LiveSession {
                        core: tokio::sync::Mutex::new(core),
                        record: Mutex::new(record.clone()),
                        turn_cancel: Mutex::new(None),
                        last_active: Mutex::new(Instant::now()),
                        busy: AtomicBool::new(false),
                        turns: AtomicU64::new(0),
                    });
                    sessions.insert(id, live);
                    None
                }
            }
        };
        let Some(mut core) = ended else { return Ok(record) };
        // Ended (or the daemon's grace ran out) while it started: torn
        // down here, by the start, which gives its own slot back.
        core.close(false).instrument(tracing::info_span!("teardown")).await;
        Err(self.end_starting(&mut core, &mut record).await)
    }

    /// Finishes a session whose start was cancelled (its sandbox, if any,
    /// already closed): `ended`, with a cancelled outcome, by EndSession or
    /// by a shutdown. Returns what its creator is told.
    async fn end_starting(&self, core: &mut Core, record: &mut SessionRecord) -> EngineError {
        let shutdown = self.draining.is_cancelled();
        record.state = SessionState::Ended;
        core.evidence.outcome = Outcome::Cancelled;
        self.finish_session(core, record).await;
        match shutdown {
            true => EngineError::Unavailable("the daemon is shutting down".into()),
            false => EngineError::FailedPrecondition(format!(
                "session {} was ended while it was starting",
                record.session_id
            )),
        }
    }

    /// Starts one turn; the subscription ends with its `turn_finished`.
    /// The turn is a trace of its own, joined to `traceparent` when the
    /// caller sent one.
    pub async fn send_turn(
        self: &Arc<Self>,
        session_id: &str,
        tool: String,
        arguments: serde_json::Value,
        traceparent: Option<String>,
        principal: &str,
    ) -> Result<Subscription, EngineError> {
        if self.live_session(session_id).is_none() {
            if let Some(node) = self.runs_elsewhere(session_id).await? {
                // The caller's stream follows the turn there: a watcher,
                // its place taken before the turn is sent.
                let place = self.watch_place(session_id, principal)?;
                return self.send_turn_elsewhere(&node, session_id, tool, arguments, traceparent, place).await;
            }
        }
        Ok(self.start_turn(session_id, tool, arguments, traceparent).await?.0)
    }

    /// Sends a turn to node `node`, which runs the session, through the
    /// store; the stream follows the turn's events there, as on the owner,
    /// and its `turn_finished` gets the raw result the owner hands back.
    async fn send_turn_elsewhere(
        &self,
        node: &str,
        session_id: &str,
        tool: String,
        arguments: serde_json::Value,
        traceparent: Option<String>,
        place: super::WatchPermit,
    ) -> Result<Subscription, EngineError> {
        let payload = serde_json::json!({ "tool": tool, "arguments": arguments, "traceparent": traceparent });
        let (request, answer) = self.forward_with(node, "send_turn", session_id, &payload.to_string()).await?;
        let started: StartedTurn = serde_json::from_str(&answer).map_err(crate::store::StoreError::from)?;
        let subscription = self.watch_holding(session_id, started.after, place).await?;
        Ok(subscription.until_turn(started.turn).for_forwarded_turn(self.store.clone(), request))
    }

    /// Starts a turn another node was sent (request `request`): answers with
    /// the turn and the sequence it follows, and hands the turn's raw
    /// result to the request once the turn is over.
    pub(super) async fn answer_turn(
        self: &Arc<Self>,
        request: &str,
        session_id: &str,
        payload: &str,
    ) -> Result<String, String> {
        #[derive(serde::Deserialize)]
        struct Call {
            tool: String,
            arguments: serde_json::Value,
            traceparent: Option<String>,
        }
        let call: Call = serde_json::from_str(payload).map_err(|e| format!("a send_turn request: {e}"))?;
        let (mut subscription, turn) = self
            .start_turn(session_id, call.tool, call.arguments, call.traceparent)
            .await
            .map_err(|e| e.to_string())?;
        let started = StartedTurn { turn, after: subscription.last_sequence() };
        let store = self.store.clone();
        let request = request.to_string();
        tokio::spawn(async move {
            while let Some(Ok(item)) = subscription.next().await {
                if let (EventKind::TurnFinished { .. }, Some(raw)) = (&item.event().kind, &item.raw) {
                    if let RawPart::Finished(raw) = raw.as_ref() {
                        let raw = serde_json::to_string(raw).unwrap_or_default();
                        if let Err(e) = store.set_request_raw(&request, &raw).await {
                            tracing::warn!(error = %e, "fleet: a forwarded turn's raw result not handed back");
                        }
                    }
                }
            }
        });
        serde_json::to_string(&started).map_err(|e| e.to_string())
    }

    /// Starts one turn of a session that runs here; returns its stream and
    /// its number.
    async fn start_turn(
        self: &Arc<Self>,
        session_id: &str,
        tool: String,
        arguments: serde_json::Value,
        traceparent: Option<String>,
    ) -> Result<(Subscription, u64), EngineError> {
        let live = self.live_or_ended(session_id).await?;
        // A shutdown's grace is for the turns in flight, not for new ones.
        // A drain alone takes no new work, but finishes what it runs: a
        // session it runs goes on taking turns until it ends.
        if self.is_stopping() {
            return Err(EngineError::Unavailable("the daemon is shutting down; no new turn is accepted".into()));
        }
        if live.busy.swap(true, Ordering::SeqCst) {
            return Err(EngineError::FailedPrecondition("a turn is already in flight in this session".into()));
        }
        let turn = live.turns.fetch_add(1, Ordering::SeqCst) + 1;
        // A shutdown gives a turn the grace an execution gets, then cancels
        // it with the rest: the sessions end after that.
        let cancel = self.draining.child_token();
        *lock(&live.turn_cancel) = Some(cancel.clone());
        let engine = self.clone();
        let id = session_id.to_string();
        let (subscribed, subscription) = tokio::sync::oneshot::channel();
        let span = tracing::info_span!("turn", session_id = %id, turn);
        crate::telemetry::set_parent(&span, traceparent.as_deref());
        let task = async move {
            let mut core = live.core.lock().await;
            // Subscribed under the lock: the stream holds this turn's events
            // and none of the previous turn's.
            let rx = engine.bus.subscribe(&id).map(|rx| (rx, core.recorder.last_sequence()));
            let ended = rx.is_none();
            let _ = subscribed.send(rx);
            if ended {
                live.busy.store(false, Ordering::SeqCst);
                return;
            }
            let call = ToolCall {
                tool: tool.clone(),
                task: Task {
                    kind: "task",
                    tool: tool.clone(),
                    arguments,
                    session_id: id.clone(),
                    workspace: WORKSPACE_MOUNT.into(),
                    ..Task::default()
                },
            };
            let outcome = core.turn(call, cancel).instrument(tracing::info_span!("harness")).await;
            core.watch_between_turns();
            // The turn's own count (the session's sum is bounded, so the
            // difference of two sums can read 0).
            let turn_tokens = match &outcome {
                TurnOutcome::Done(r) => crate::rein::bounded_tokens(r.tokens_spent),
                _ => 0,
            };
            let (ok, error, raw) = match outcome {
                TurnOutcome::Done(r) if r.ok => {
                    (true, String::new(), RawResult { tool_output: r.output, tool_error: String::new() })
                }
                TurnOutcome::Done(r) => (
                    false,
                    "turn failed; the raw error is on the caller's stream".into(),
                    RawResult { tool_output: r.output, tool_error: r.error },
                ),
                TurnOutcome::Denied { policy, reason } => {
                    let text = format!("denied by policy {policy}: {reason}");
                    (false, text.clone(), RawResult { tool_output: String::new(), tool_error: text })
                }
                TurnOutcome::Failed(e) => (
                    false,
                    "turn failed; the raw error is on the caller's stream".into(),
                    RawResult { tool_output: String::new(), tool_error: core.scrub(&e.to_string()) },
                ),
                TurnOutcome::Cancelled => (
                    false,
                    "turn cancelled".into(),
                    RawResult { tool_output: String::new(), tool_error: "cancelled".into() },
                ),
            };
            if !ok {
                use tracing_opentelemetry::OpenTelemetrySpanExt;
                let class = crate::types::evidence::failure_class(
                    crate::types::evidence::FailureStage::Execution,
                    &raw.tool_error,
                );
                tracing::Span::current().set_status(opentelemetry::trace::Status::error(class));
            }
            let snapshot = {
                let mut record = lock(&live.record);
                record.turns = turn;
                record.restarts = core.restarts;
                record.evidence = core.evidence.clone();
                record.clone()
            };
            if let Err(e) = engine.store.update_session(&snapshot).await {
                tracing::error!(session_id = %id, error = %e, "session record not stored");
            }
            // The session is free again before the caller hears the turn is
            // over, so it may send the next one at once (it then waits for
            // this lock, which goes right after the event).
            *lock(&live.turn_cancel) = None;
            *lock(&live.last_active) = Instant::now();
            live.busy.store(false, Ordering::SeqCst);
            let event = EventKind::TurnFinished { turn, tool, ok, error, tokens_spent: turn_tokens };
            let mut raw = raw;
            let cut = fit_raw(&mut raw, json_len(&event), engine.max_message_bytes);
            core.recorder.emit_batch(cut.into_iter().map(|e| (e, None)).collect()).await;
            if core.recorder.emit(event, Some(RawPart::Finished(raw))).await.is_none() {
                // Not stored, so never sent: this turn's stream would wait
                // for it, and take the next turn's raw output (maybe another
                // caller's) for its own. The session's live events end here
                // (a next turn, waiting for this lock, finds it ended), and
                // the session with them, once this lock is let go.
                tracing::error!(session_id = %id, turn, "a turn's end not stored; ending the session");
                engine.bus.close(&id);
                let (ending, session_id) = (engine.clone(), id.clone());
                engine.spawn_tracked(async move {
                    if let Err(e) = ending.end_session(&session_id, EndReason::TurnNotStored).await {
                        tracing::error!(%session_id, error = %e, "a session whose turn was not stored not ended");
                    }
                });
            }
        };
        // In a task of its own, so that a panic (a bug) ends the session
        // as failed rather than leave it busy for good.
        let turn_task = tokio::spawn(task.instrument(span));
        let (engine, id) = (self.clone(), session_id.to_string());
        self.tasks.spawn(async move {
            match turn_task.await {
                Err(e) if e.is_panic() => {
                    tracing::error!(session_id = %id, error = %e, "a session turn's task failed; ending the session");
                    if let Err(e) = engine.end_session(&id, EndReason::TurnPanicked).await {
                        tracing::error!(session_id = %id, error = %e, "a session whose turn failed not ended");
                    }
                }
                // Done, or cancelled with the runtime.
                _ => {}
            }
        });
        match subscription.await {
            Ok(Some((rx, after))) => Ok((
                Subscription::live(rx, true).after(after).until_turn(turn).catching_up(
                    self.event_pages.clone(),
                    session_id.to_string(),
                    self.bus.capacity(),
                ),
                turn,
            )),
            _ => Err(EngineError::FailedPrecondition(format!("session {session_id} has ended"))),
        }
    }

    /// The node that runs session `session_id`, when it is another node
    /// of the fleet (not live here, not finished, on a shared store).
    async fn runs_elsewhere(&self, session_id: &str) -> Result<Option<String>, EngineError> {
        if !self.store.is_shared() || self.live_session(session_id).is_some() {
            return Ok(None);
        }
        let unfinished = self
            .store
            .get_session(session_id)
            .await?
            .is_some_and(|r| matches!(r.state, SessionState::Starting | SessionState::Active));
        let node = self.store.node_of_session(session_id).await?.unwrap_or_default();
        Ok((unfinished && !node.is_empty() && node != self.store.node()).then_some(node))
    }

    async fn live_or_ended(&self, session_id: &str) -> Result<Arc<LiveSession>, EngineError> {
        if let Some(live) = self.live_session(session_id) {
            return Ok(live);
        }
        if let Some(node) = self.runs_elsewhere(session_id).await? {
            return Err(EngineError::FailedPrecondition(format!(
                "session {session_id} runs on node {node:?}, not here"
            )));
        }
        match self.store.get_session(session_id).await? {
            Some(record) => Err(EngineError::FailedPrecondition(format!(
                "session {session_id} is {}, not active",
                record.state.as_str()
            ))),
            None => Err(EngineError::NotFound(format!("session {session_id}"))),
        }
    }

    /// Cancels the turn in flight; with no turn in flight it does nothing
    /// and says so.
    pub async fn cancel_turn(&self, session_id: &str) -> Result<SessionRecord, EngineError> {
        if let Some(node) = self.runs_elsewhere(session_id).await? {
            let answer = self.forward(&node, "cancel_turn", session_id).await?;
            return Ok(serde_json::from_str(&answer).map_err(crate::store::StoreError::from)?);
        }
        let live = self.live_or_ended(session_id).await?;
        let token = lock(&live.turn_cancel).clone();
        match token {
            Some(token) if live.busy.load(Ordering::SeqCst) => {
                token.cancel();
                Ok(lock(&live.record).clone())
            }
            _ => Err(EngineError::FailedPrecondition("no turn is in flight in this session".into())),
        }
    }

    /// The stored session with this id.
    pub async fn get_session(&self, session_id: &str) -> Result<SessionRecord, EngineError> {
        if let Some(live) = self.live_session(session_id) {
            return Ok(lock(&live.record).clone());
        }
        self.store.get_session(session_id).await?.ok_or_else(|| EngineError::NotFound(format!("session {session_id}")))
    }

    /// A page of sessions after `after_id`, in `projects` only (`None`: all).
    pub async fn list_sessions(
        &self,
        after_id: &str,
        limit: u32,
        projects: Option<&[String]>,
    ) -> Result<Vec<SessionRecord>, EngineError> {
        let mut records = self.store.list_sessions(after_id, limit, projects).await?;
        for record in &mut records {
            if let Some(live) = self.live_session(&record.session_id) {
                *record = lock(&live.record).clone();
            }
        }
        Ok(records)
    }

    /// end → cleanup → destroy. An in-flight turn is cancelled first.
    pub async fn end_session(&self, session_id: &str, reason: EndReason) -> Result<SessionRecord, EngineError> {
        self.end_session_with_cause(session_id, reason).await.map(|(record, _)| record)
    }

    /// [`Engine::end_session`], with the raw cause of its failure when the
    /// end failed here (scrubbed, and cut with the record to one message),
    /// for the caller that ended it to hand to the session's principal and
    /// adm only: it is kept nowhere else.
    pub async fn end_session_with_cause(
        &self,
        session_id: &str,
        reason: EndReason,
    ) -> Result<(SessionRecord, Option<String>), EngineError> {
        if let Some(node) = self.runs_elsewhere(session_id).await? {
            return match self.forward(&node, "end_session", session_id).await {
                Ok(answer) => {
                    let ended: Ended = serde_json::from_str(&answer).map_err(crate::store::StoreError::from)?;
                    Ok((ended.record, ended.cause))
                }
                // It ended there before the request was read: ended, as
                // the owner itself would answer.
                Err(EngineError::FailedPrecondition(why)) => match self.store.get_session(session_id).await? {
                    Some(record) if !matches!(record.state, SessionState::Starting | SessionState::Active) => {
                        Ok((record, None))
                    }
                    _ => Err(EngineError::FailedPrecondition(why)),
                },
                Err(e) => Err(e),
            };
        }
        // Cancelled under the lock its start goes live under: a start that
        // sees no cancel is live, and is found here.
        let (live, starting) = {
            let mut sessions = lock(&self.sessions);
            let live = sessions.remove(session_id);
            let starting = live.is_none()
                && self.admission.token(session_id, admission::Work::Session).inspect(|t| t.cancel()).is_some();
            (live, starting)
        };
        let Some(live) = live else {
            // Still starting here: its start tears down what it made and
            // gives back its own slot (never this call: the slot is the
            // start's); the record is the ended one once it has.
            if starting {
                while self.admission.holds(session_id, admission::Work::Session) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            return match self.store.get_session(session_id).await? {
                Some(record) => Ok((record, None)),
                None => Err(EngineError::NotFound(format!("session {session_id}"))),
            };
        };
        if let Some(token) = lock(&live.turn_cancel).clone() {
            token.cancel();
        }
        let mut core = live.core.lock().await;
        let mut record = lock(&live.record).clone();
        if let EndReason::Idle(idle) = reason {
            core.recorder.emit(EventKind::Reaped { idle_seconds: idle.as_secs() }, None).await;
        }
        match reason {
            EndReason::TurnPanicked => core.failed(FailureStage::Execution, "the daemon's task for a turn failed"),
            EndReason::TurnNotStored => core.failed(FailureStage::Execution, "a turn's end could not be stored"),
            _ => {}
        }
        core.close(false).instrument(tracing::info_span!("teardown")).await;
        record.state = match reason {
            EndReason::Idle(_) => SessionState::Reaped,
            EndReason::Requested | EndReason::Shutdown | EndReason::TurnPanicked | EndReason::TurnNotStored => {
                SessionState::Ended
            }
        };
        let cause = self.finish_session(&mut core, &mut record).await;
        self.release(session_id);
        Ok((record, Some(cause).filter(|c| !c.is_empty())))
    }

    /// The owner's answer to a forwarded `end_session`: the record, and the
    /// raw cause of a failed end for the forwarding node to hand on as
    /// [`Engine::end_session_with_cause`] does.
    pub(super) fn ended_answer(record: &SessionRecord, cause: Option<&str>) -> Result<String, String> {
        serde_json::to_string(&EndedRef { record, cause }).map_err(|e| e.to_string())
    }

    /// Stores the final record with the `finished` event; returns the raw
    /// error that goes with it (empty when nothing failed).
    async fn finish_session(&self, core: &mut Core, record: &mut SessionRecord) -> String {
        let mut evidence = core.evidence.clone();
        evidence.of_session();
        evidence.outcome = match (record.state, evidence.failure_stage) {
            // Ended while it was starting (see `end_starting`).
            (SessionState::Ended, None) if evidence.outcome == Outcome::Cancelled => Outcome::Cancelled,
            (SessionState::Refused, _) => Outcome::Refused,
            (_, Some(FailureStage::Resolution | FailureStage::Gate)) => Outcome::Refused,
            (_, Some(_)) => Outcome::Failed,
            (SessionState::Failed, None) => Outcome::Failed,
            _ => Outcome::Succeeded,
        };
        if evidence.outcome == Outcome::Failed && record.state != SessionState::Reaped {
            record.state = SessionState::Failed;
        }
        crate::telemetry::session_finished(record.state.as_str());
        record.evidence = evidence;
        record.restarts = core.restarts;
        record.ended_at_ms = Some(now_ms());
        let cut = fit_raw(&mut core.raw, json_len(record), self.max_message_bytes);
        core.recorder.emit_batch(cut.into_iter().map(|e| (e, None)).collect()).await;
        let cause = core.raw.tool_error.clone();
        // The final record and the `finished` event in one transaction.
        let finished = core.recorder.prepare(EventKind::SessionFinished { session: Box::new(record.clone()) }).await;
        let store = &self.store;
        let give_up = self.grace_over();
        let stored =
            core.recorder.persist_final_with(finished.len(), &give_up, || store.finish_session(record, &finished));
        if stored.await {
            core.recorder.publish(finished, Some(RawPart::Finished(std::mem::take(&mut core.raw))));
        } else {
            tracing::error!(session_id = %record.session_id, "session record not stored");
        }
        self.bus.close(&record.session_id);
        core.reclaim_sandbox();
        tracing::info!(session_id = %record.session_id, state = record.state.as_str(), "session finished");
        cause
    }

    /// Ends sessions idle for `idle`, never one with a turn in flight.
    pub fn spawn_reaper(self: &Arc<Self>, idle: Duration) {
        let engine = Arc::downgrade(self);
        let tick = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(engine) = engine.upgrade() else { return };
                // A drain alone goes on reaping: an idle session would
                // keep its sandbox and its slot, and the node never drained.
                if engine.is_stopping() {
                    return;
                }
                let idle_ones: Vec<String> = lock(&engine.sessions)
                    .iter()
                    .filter(|(_, s)| lock(&s.last_active).elapsed() >= idle)
                    // Claiming `busy` keeps a new turn from starting while
                    // the session is being reaped.
                    .filter(|(_, s)| s.busy.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok())
                    .map(|(id, _)| id.clone())
                    .collect();
                // Each in a task the shutdown waits for: an end cut off
                // halfway would leave the session active and its sandbox up.
                for id in idle_ones {
                    let reaping = engine.clone();
                    engine.spawn_tracked(async move {
                        if let Err(e) = reaping.end_session(&id, EndReason::Idle(idle)).await {
                            tracing::warn!(session_id = %id, error = %e, "reaping failed");
                        }
                    });
                }
            }
        });
    }

    /// Ends every live session (daemon shutdown).
    /// Side by side, each within what is left of the grace: one after
    /// another, a harness slow to end (up to its 5 s end grace) spent the
    /// grace of the sessions behind it, which ended `failed`.
    pub async fn end_all_sessions(&self) {
        let ids: Vec<String> = lock(&self.sessions).keys().cloned().collect();
        let ends = ids.iter().map(|id| async move {
            if let Err(e) = self.end_session(id, EndReason::Shutdown).await {
                tracing::warn!(session_id = %id, error = %e, "ending session at shutdown failed");
            }
        });
        futures_util::future::join_all(ends).await;
    }
}
