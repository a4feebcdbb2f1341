//! Recovery on start: whatever a previous daemon instance left behind is
//! destroyed, and its unfinished executions and sessions are finished as
//! `failed` with a note saying where they were. Running it twice changes
//! nothing more. What a row says is checked first (`leftover`): recovery
//! removes only paths derived from a sandbox id under its own `sandboxes/`,
//! signals only its own sandbox uids, and reads only its own node's rows
//! (on SQLite, a fleet of one, every row is its own: see
//! `Store::take_over_other_names`).

use std::sync::Arc;

use super::leftover::{self, SignalScope};
use super::{now_ms, Engine, EngineError, ExecutionRecord, ExecutionState, SessionRecord, SessionState};
use crate::events::{Event, EventKind, Recorder};
use crate::sandbox::SandboxState;
use crate::types::evidence::{Evidence, FailureStage, Outcome, TeardownResult};

/// What [`Engine::recover`] did at start; logged when it did anything.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Leftover sandbox rows it tried to destroy (a destroy that failed counts
    /// too).
    pub sandboxes_destroyed: usize,
    /// Rows recovery would not act on (logged with the reason).
    pub sandboxes_refused: usize,
    /// Leftover sandbox processes it killed.
    pub processes_killed: usize,
    /// Unfinished executions it finished as `failed`.
    pub executions_failed: usize,
    /// Unfinished sessions it finished as `failed`.
    pub sessions_failed: usize,
    /// Capture bundles a crashed run left in `sandboxes/` that it removed.
    pub bundles_removed: usize,
}

/// Where a subject was, judging by its last stored event. A session that
/// had `started` (stored `active`) was past its start whatever its last
/// event: idle after `sandbox_ready`, or restarting its harness in a turn.
fn stage_of(last: Option<&Event>, started: bool) -> FailureStage {
    let stage = match last.map(|e| &e.kind) {
        None | Some(EventKind::Accepted { .. }) => FailureStage::Resolution,
        Some(EventKind::Resolved { .. }) => FailureStage::Gate,
        Some(EventKind::Gated { phase, .. }) if phase == "agent_start" => FailureStage::SandboxCreate,
        Some(EventKind::SandboxReady { .. }) => FailureStage::SessionStart,
        Some(EventKind::Teardown { .. } | EventKind::Reaped { .. }) => FailureStage::Teardown,
        Some(_) => FailureStage::Execution,
    };
    match stage {
        FailureStage::Resolution | FailureStage::Gate | FailureStage::SandboxCreate | FailureStage::SessionStart
            if started =>
        {
            FailureStage::Execution
        }
        stage => stage,
    }
}

impl Engine {
    /// Cleans up after a previous instance of this daemon (see the module doc):
    /// destroys its leftover sandboxes, then finishes its unfinished executions
    /// and sessions as `failed`. Fails only when the store does.
    pub async fn recover(self: &Arc<Self>) -> Result<RecoveryReport, EngineError> {
        let mut report = RecoveryReport::default();
        let mut destroyed_for: std::collections::HashMap<String, TeardownResult> = Default::default();
        // Runs whose sandbox was being torn down: they reached teardown.
        let mut tearing_down = std::collections::HashSet::new();
        let scope = SignalScope::new(self.uid_range);
        let taken = self.store.take_over_other_names().await?;
        if taken != Default::default() {
            tracing::warn!(
                names = ?taken.names, executions = taken.executions, sessions = taken.sessions,
                sandboxes = taken.sandboxes,
                "recovery takes over what other node names left in this data directory's SQLite store: a fleet of \
                 one, they are this daemon under an earlier name (host name, data directory spelling, [fleet] node)"
            );
        }
        let foreign = self.store.foreign_leftover_sandboxes(&self.epoch).await?;
        if foreign > 0 {
            // A shared store: they may be a live node's. A node whose name
            // changed gets its own back by starting once under its old one.
            tracing::warn!(
                rows = foreign,
                "recovery ignores leftover sandbox rows of other nodes or of no node (this daemon's own from before \
                 a change of node name are recovered by starting it once with [fleet] node set to that name)"
            );
        }
        for row in self.store.leftover_sandboxes(&self.epoch).await? {
            let Some((result, killed)) = self.destroy_leftover_row(&row, scope).await? else {
                report.sandboxes_refused += 1;
                continue;
            };
            report.processes_killed += killed;
            destroyed_for.insert(row.subject_id.clone(), result);
            if row.destroying {
                tearing_down.insert(row.subject_id.clone());
            }
            report.sandboxes_destroyed += 1;
        }
        // Nothing runs yet, so every capture bundle here is a crashed run's.
        report.bundles_removed = leftover::remove_bundles(&self.sandboxes_dir);
        for mut record in self.store.unfinished_executions().await? {
            let destroy = destroyed_for.get(&record.execution_id).copied().unwrap_or(TeardownResult::NotAttempted);
            let reached = Reached { started: false, teardown: tearing_down.contains(&record.execution_id) };
            let finished = self.recover_subject(&record.execution_id, &mut record.evidence, destroy, reached).await?;
            record.state = ExecutionState::Failed;
            record.finished_at_ms = Some(now_ms());
            finished.execution(self, record).await?;
            report.executions_failed += 1;
        }
        for mut record in self.store.unfinished_sessions().await? {
            let destroy = destroyed_for.get(&record.session_id).copied().unwrap_or(TeardownResult::NotAttempted);
            let started = record.state == SessionState::Active;
            let reached = Reached { started, teardown: tearing_down.contains(&record.session_id) };
            let finished = self.recover_subject(&record.session_id, &mut record.evidence, destroy, reached).await?;
            session_cause_is_the_note(&mut record);
            record.state = SessionState::Failed;
            record.ended_at_ms = Some(now_ms());
            finished.session(self, record).await?;
            report.sessions_failed += 1;
        }
        if report != RecoveryReport::default() {
            tracing::warn!(?report, "recovered what a previous instance left behind");
        }
        Ok(report)
    }

    /// Destroys the sandbox of a stored row no run holds any more (a
    /// previous instance's, or a run's whose task panicked): its processes
    /// killed, then its cgroup, files and uid given back, and its row
    /// marked. `None` when the row is refused (nothing deleted, nothing
    /// signalled); else how it went and how many processes were killed.
    async fn destroy_leftover_row(
        &self,
        row: &crate::store::SandboxRow,
        scope: SignalScope,
    ) -> Result<Option<(TeardownResult, usize)>, EngineError> {
        if let Some(reason) = leftover::refuse_reason(row, &self.sandboxes_dir, scope) {
            tracing::error!(
                sandbox_id = %row.sandbox_id.escape_debug(), %reason,
                "recovery refuses a sandbox row: nothing deleted, nothing signalled"
            );
            return Ok(None);
        }
        let killed = leftover::kill_sandbox_processes(&row.sandbox_id, scope).await;
        let backend = match row.backend.as_str() {
            "none" => &self.backends.none,
            _ => &self.backends.linux_bwrap,
        };
        let user = row.uid.map(crate::sandbox::host::own_user);
        let root = leftover::derived_root(&self.sandboxes_dir, &row.sandbox_id);
        let result = match backend.destroy_leftover(&row.sandbox_id, &root, user).await {
            Ok(()) => TeardownResult::Succeeded,
            Err(e) => {
                tracing::error!(sandbox_id = %row.sandbox_id, error = %e, "leftover sandbox not destroyed");
                TeardownResult::Failed
            }
        };
        let state = if result == TeardownResult::Succeeded { SandboxState::Destroyed } else { SandboxState::Failed };
        self.store.set_sandbox_state(&row.sandbox_id, state).await?;
        Ok(Some((result, killed)))
    }

    /// After the task running execution or session `subject` here panicked
    /// (a bug; nothing it held was given back): what recovery does after a
    /// crash, for that run alone. Its sandboxes are destroyed and, unless
    /// it had finished, it is finished `failed` with `recovered` ("the
    /// daemon's task for it failed during …"), `teardown` and `finished`,
    /// so its caller and watchers hear the end and its slot can go.
    pub(super) async fn recover_panicked(&self, subject: &str) -> Result<(), EngineError> {
        let scope = SignalScope::new(self.uid_range);
        let (mut destroy, mut teardown) = (TeardownResult::NotAttempted, false);
        let mut rows = self.store.undestroyed_sandboxes_of(subject).await?;
        let held = self.panicked.lock().unwrap_or_else(|e| e.into_inner()).remove(subject);
        if let Some(held) = held.filter(|held| !rows.iter().any(|row| &row.sandbox_id == held)) {
            rows.extend(self.store.undestroyed_sandbox(&held).await?);
        }
        for row in rows {
            teardown |= row.destroying;
            destroy = match self.destroy_leftover_row(&row, scope).await? {
                Some((result, _)) => result,
                None => TeardownResult::Failed,
            };
        }
        let why = "the daemon's task for it failed";
        if let Some(mut record) = self.store.get_execution(subject).await? {
            if record.state.is_terminal() {
                return Ok(());
            }
            let reached = Reached { started: false, teardown };
            let finished = self.finish_subject(subject, &mut record.evidence, destroy, why, reached).await?;
            record.state = ExecutionState::Failed;
            record.finished_at_ms = Some(now_ms());
            // Out of admission's count before anyone hears it finished, as
            // a run that ends is (its sandboxes are destroyed above).
            self.release(subject);
            return finished.execution(self, record).await;
        }
        let Some(mut record) = self.store.get_session(subject).await? else { return Ok(()) };
        if !matches!(record.state, SessionState::Starting | SessionState::Active) {
            return Ok(());
        }
        let reached = Reached { started: record.state == SessionState::Active, teardown };
        let finished = self.finish_subject(subject, &mut record.evidence, destroy, why, reached).await?;
        session_cause_is_the_note(&mut record);
        record.state = SessionState::Failed;
        record.ended_at_ms = Some(now_ms());
        self.release(subject);
        finished.session(self, record).await
    }

    /// Fails what node `node` left unfinished when it was declared lost
    /// (this node holds the lost node's claim, `Store::claim_lost_node`,
    /// so one survivor at a time runs it; one that did not finish is
    /// followed by another at a later sweep, which finds only what is
    /// still unfinished): each run
    /// gets `recovered` ("node … lost during …"), `teardown` and
    /// `finished`, as a run recovered after a restart does. Its sandboxes
    /// are the lost node's to destroy when it starts again. Returns the
    /// executions and sessions failed.
    pub async fn fail_lost_node(&self, node: &str) -> Result<(usize, usize), EngineError> {
        let lost = format!("node {node} lost");
        let mut failed = (0, 0);
        for mut record in self.store.unfinished_executions_of(node).await? {
            let unknown = TeardownResult::Unknown;
            let reached = Reached { started: false, teardown: false };
            let finished =
                self.finish_subject(&record.execution_id, &mut record.evidence, unknown, &lost, reached).await?;
            record.state = ExecutionState::Failed;
            record.finished_at_ms = Some(now_ms());
            finished.execution(self, record).await?;
            failed.0 += 1;
        }
        for mut record in self.store.unfinished_sessions_of(node).await? {
            let unknown = TeardownResult::Unknown;
            let reached = Reached { started: record.state == SessionState::Active, teardown: false };
            let finished =
                self.finish_subject(&record.session_id, &mut record.evidence, unknown, &lost, reached).await?;
            record.state = SessionState::Failed;
            record.ended_at_ms = Some(now_ms());
            finished.session(self, record).await?;
            failed.1 += 1;
        }
        Ok(failed)
    }

    /// Notes the restart in the evidence and records `recovered` and
    /// `teardown`; returns the recorder for the `finished` event.
    async fn recover_subject(
        &self,
        subject: &str,
        evidence: &mut Evidence,
        destroy: TeardownResult,
        reached: Reached,
    ) -> Result<Finisher, EngineError> {
        self.finish_subject(subject, evidence, destroy, "daemon restarted", reached).await
    }

    /// `recovered` with "`why` during <stage>", `teardown`, the evidence
    /// failed at that stage (see [`Reached`]); returns the recorder for
    /// `finished`.
    async fn finish_subject(
        &self,
        subject: &str,
        evidence: &mut Evidence,
        destroy: TeardownResult,
        why: &str,
        reached: Reached,
    ) -> Result<Finisher, EngineError> {
        let events = self.store.events_after(subject, 0).await?;
        // The `teardown` event is stored only at the end, with `finished`:
        // a teardown under way is told by its sandbox's row.
        let stage = match reached.teardown {
            true => FailureStage::Teardown,
            false => stage_of(events.last(), reached.started),
        };
        let note = format!("{why} during {}", stage.as_str());
        let last = events.last().map(|e| e.sequence).unwrap_or(0);
        let mut recorder = Recorder::new(subject.to_string(), last, self.store.clone(), self.bus.clone());
        recorder.emit(EventKind::Recovered { note: note.clone() }, None).await;
        // Cleanup could not run: the harness died with the daemon.
        let cleanup = if destroy == TeardownResult::NotAttempted {
            TeardownResult::NotAttempted
        } else {
            TeardownResult::Unknown
        };
        recorder.emit(EventKind::Teardown { session_cleanup: cleanup, sandbox_destroy: destroy }, None).await;
        evidence.fail(stage);
        evidence.notes.push(note);
        evidence.outcome = Outcome::Failed;
        evidence.session_cleanup = cleanup;
        evidence.sandbox_destroy = destroy;
        Ok(Finisher(recorder))
    }
}

/// What is known of how far a run got besides its events.
#[derive(Clone, Copy)]
struct Reached {
    /// A session that had started (stored `active`; see `stage_of`).
    started: bool,
    /// Its sandbox's row says its teardown had begun.
    teardown: bool,
}

struct Finisher(Recorder);

impl Finisher {
    /// The failed execution's final record, its hub report (when it asked
    /// for one) and its `finished` event, in one transaction: nobody sees
    /// it ended without its `finished` event. Counted in the metrics as
    /// any finished execution is, once stored.
    async fn execution(mut self, engine: &Engine, record: ExecutionRecord) -> Result<(), EngineError> {
        match super::execution::store_finished(engine, &mut self.0, &record, None).await {
            true => {
                crate::telemetry::execution_finished(&record.evidence);
                Ok(())
            }
            false => {
                Err(EngineError::Unavailable(format!("execution {} not finished in the store", record.execution_id)))
            }
        }
    }

    /// The failed session's final record and its `finished` event, in one
    /// transaction; counted in the metrics once stored.
    async fn session(mut self, engine: &Engine, record: SessionRecord) -> Result<(), EngineError> {
        let finished = self.0.prepare(EventKind::SessionFinished { session: Box::new(record.clone()) }).await;
        let store = &engine.store;
        if !self.0.persist_with(finished.len(), || store.finish_session(&record, &finished)).await {
            return Err(EngineError::Unavailable(format!("session {} not finished in the store", record.session_id)));
        }
        crate::telemetry::session_finished(record.state.as_str());
        self.0.publish(finished, None);
        Ok(())
    }
}

/// No call was told a recovered session's cause (`corral get --full`, which
/// the fixed sentence names, reads executions): the daemon's own note is it.
fn session_cause_is_the_note(record: &mut SessionRecord) {
    if let (Some(stage), Some(note)) = (record.evidence.failure_stage, record.evidence.notes.last()) {
        if record.evidence.error == stage.fixed_error() {
            record.evidence.error = note.clone();
        }
    }
}
