//! One execution, end to end: resolve → gate → sandbox → session →
//! dispatch → end → cleanup → destroy, with evidence.
//!
//! The rules this file keeps (DESIGN.md, "Execution semantics"):
//! resolution refusals never touch a backend; once a sandbox exists it is
//! destroyed exactly once; `cleanup_session` runs whenever `start_session`
//! succeeded; the first failure decides the stage; raw errors and output
//! reach only the direct caller.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{now_ms, Engine, ExecuteCommand, ExecutionRecord, ExecutionState, RawResult};
use crate::catalog::{check_actor, Profile};
use crate::events::{EventKind, RawPart, Recorder};
use crate::evidence::{FailureStage, Outcome, TeardownResult};
use crate::policy::{Action, GateInput, Phase};
use crate::rein::{HarnessEvent, HarnessSession, ReinError, StartContext, Task, ToolCall};
use crate::sandbox::{workspace, CreateSandbox, Sandbox, SandboxBackend, SandboxState, WORKSPACE_MOUNT};

struct Run<'a> {
    engine: &'a Engine,
    record: ExecutionRecord,
    recorder: Recorder,
    raw: RawResult,
    cancel: CancellationToken,
    started: Instant,
}

pub(super) async fn run(engine: &Arc<Engine>, record: ExecutionRecord, cmd: ExecuteCommand, cancel: CancellationToken) {
    let recorder = Recorder::new(record.execution_id.clone(), 0, engine.store.clone(), engine.bus.clone());
    let mut run = Run { engine, record, recorder, raw: RawResult::default(), cancel, started: Instant::now() };
    run.go(&cmd).await;
}

impl Run<'_> {
    async fn go(&mut self, cmd: &ExecuteCommand) {
        let accepted = EventKind::Accepted {
            execution_id: self.record.execution_id.clone(),
            session_id: String::new(),
            request_id: self.record.request_id.clone(),
            consumer: self.record.consumer.clone(),
        };
        self.recorder.emit(accepted, None).await;

        let Some(profile) = self.resolve(cmd).await else {
            return self.finish_refused().await;
        };
        if !self.gate(&profile, cmd).await {
            return self.finish_refused().await;
        }
        if self.cancel.is_cancelled() {
            return self.finish_without_sandbox(Outcome::Cancelled).await;
        }
        self.in_sandbox(&profile, cmd).await;
    }

    /// Rule 1: the actor, then the profile; nothing is created before this.
    async fn resolve(&mut self, cmd: &ExecuteCommand) -> Option<Arc<Profile>> {
        let t = Instant::now();
        let resolved = check_actor(&cmd.actor).and_then(|()| self.engine.catalog.resolve(&cmd.harness_profile_ref));
        self.record.evidence.time("resolve", t);
        let profile = match resolved {
            Ok(profile) => profile,
            Err(refusal) => {
                self.record.evidence.refuse(FailureStage::Resolution, &refusal.0);
                self.raw.tool_error = refusal.0;
                return None;
            }
        };
        let evidence = &mut self.record.evidence;
        evidence.profile_ref = profile.reference();
        evidence.profile_digest = profile.digest.clone();
        evidence.readiness = Some(profile.file.readiness.clone());
        evidence.rein = profile.file.rein.kind.clone();
        if profile.file.readiness.state == crate::catalog::ReadinessState::Unverified {
            evidence.notes.push(format!("profile readiness is unverified: {}", profile.file.readiness.reason));
        }
        let resolved = EventKind::Resolved {
            profile_ref: profile.reference(),
            profile_digest: profile.digest.clone(),
            readiness: profile.file.readiness.clone(),
        };
        self.recorder.emit(resolved, None).await;
        Some(profile)
    }

    async fn gate(&mut self, profile: &Profile, cmd: &ExecuteCommand) -> bool {
        let t = Instant::now();
        let outcome = self.engine.gate.evaluate(&GateInput {
            phase: Phase::AgentStart,
            profile_ref: &profile.reference(),
            profile_policies: &profile.file.guardrails.policies,
            actor: &cmd.actor,
            project: &cmd.project,
            repo: &cmd.repo,
            sandbox: &profile.file.sandbox,
        });
        self.record.evidence.time("gate", t);
        self.record.evidence.gate_decisions.extend(outcome.decisions.iter().cloned());
        self.record.effective_sandbox = Some(outcome.effective_sandbox.clone());
        let gated = EventKind::Gated {
            phase: outcome.phase.as_str().into(),
            action: outcome.action,
            decisions: outcome.decisions.clone(),
            effective_sandbox: outcome.effective_sandbox.clone(),
        };
        self.recorder.emit(gated, None).await;
        if let Some(denial) = outcome.denial() {
            let reason = format!("denied by policy {}: {}", denial.policy, denial.reason);
            self.record.evidence.refuse(FailureStage::Gate, &reason);
            self.raw.tool_error = reason;
        }
        outcome.action == Action::Allow
    }

    async fn in_sandbox(&mut self, profile: &Arc<Profile>, cmd: &ExecuteCommand) {
        let spec = self.record.effective_sandbox.clone().unwrap_or_default();
        let backend = self.engine.backends.get(spec.sandbox_type).clone();
        let sandbox_id = uuid::Uuid::now_v7().to_string();
        let root = self.engine.sandboxes_dir.join(&sandbox_id);
        let t = Instant::now();
        // Intent before action: a crashed daemon's successor finds this row.
        if let Err(e) = self
            .engine
            .store
            .insert_sandbox(
                &sandbox_id,
                &self.record.execution_id,
                spec.sandbox_type.as_str(),
                &root,
                &self.engine.epoch,
            )
            .await
        {
            self.failed(FailureStage::SandboxCreate, &e.to_string());
            return self.finish_without_sandbox(Outcome::Failed).await;
        }
        let request =
            CreateSandbox { sandbox_id: sandbox_id.clone(), consumer: self.record.consumer.clone(), spec, root };
        let sandbox = match backend.create(&request).await {
            Ok(sandbox) => sandbox,
            Err(e) => {
                // The backend made nothing we can name; clear what we reserved.
                self.failed(FailureStage::SandboxCreate, &e.to_string());
                let _ = tokio::fs::remove_dir_all(&request.root).await;
                self.set_sandbox_state(&sandbox_id, SandboxState::Destroyed).await;
                return self.finish_without_sandbox(Outcome::Failed).await;
            }
        };
        self.record.evidence.sandbox_id = sandbox.id.clone();
        self.record.evidence.time("sandbox_create", t);
        if sandbox.state != SandboxState::Ready {
            self.set_sandbox_state(&sandbox.id, SandboxState::Failed).await;
            self.failed(FailureStage::SandboxCreate, &format!("sandbox is {}, not ready", sandbox.state.as_str()));
            let destroyed = self.destroy(&*backend, &sandbox).await;
            return self.finish(TeardownResult::NotAttempted, destroyed, false).await;
        }
        self.set_sandbox_state(&sandbox.id, SandboxState::Ready).await;

        let t = Instant::now();
        let base_commit = if cmd.repo.is_empty() {
            None
        } else {
            match workspace::clone_into(std::path::Path::new(&cmd.repo), &sandbox.workspace).await {
                Ok(commit) => Some(commit),
                Err(e) => {
                    self.failed(FailureStage::SandboxCreate, &e.to_string());
                    let destroyed = self.destroy(&*backend, &sandbox).await;
                    return self.finish(TeardownResult::NotAttempted, destroyed, false).await;
                }
            }
        };
        self.record.evidence.time("workspace", t);
        let ready = EventKind::SandboxReady {
            sandbox_id: sandbox.id.clone(),
            backend: sandbox.backend,
            workspace_path: sandbox.workspace.to_string_lossy().into_owned(),
            receipt: sandbox.receipt.clone(),
        };
        self.recorder.emit(ready, None).await;

        let Some(rein) = self.engine.reins.get(&profile.file.rein.kind).cloned() else {
            self.failed(FailureStage::SessionStart, &format!("no rein named {}", profile.file.rein.kind));
            let destroyed = self.destroy(&*backend, &sandbox).await;
            return self.finish(TeardownResult::NotAttempted, destroyed, false).await;
        };
        let t = Instant::now();
        let ctx = StartContext {
            backend: backend.clone(),
            sandbox: sandbox.clone(),
            profile: profile.clone(),
            consumer: self.record.consumer.clone(),
        };
        let mut session = match rein.start_session(ctx).await {
            Ok(session) => session,
            Err(e) => {
                self.failed(FailureStage::SessionStart, &e.to_string());
                let destroyed = self.destroy(&*backend, &sandbox).await;
                return self.finish(TeardownResult::NotAttempted, destroyed, false).await;
            }
        };
        self.record.evidence.time("session_start", t);

        let t = Instant::now();
        let cancelled = self.dispatch(&mut *session, cmd).await;
        self.record.evidence.time("harness", t);

        let t = Instant::now();
        if !cancelled {
            if let Err(e) = session.end_session().await {
                self.failed(FailureStage::Execution, &e.to_string());
            }
        }
        let cleanup = match session.cleanup_session().await {
            Ok(()) => TeardownResult::Succeeded,
            Err(e) => {
                self.failed(FailureStage::Teardown, &e.to_string());
                TeardownResult::Failed
            }
        };
        if let Some(base) = base_commit {
            self.collect_commit(cmd, &sandbox, &base).await;
        }
        let destroyed = self.destroy(&*backend, &sandbox).await;
        self.record.evidence.time("teardown", t);
        self.finish(cleanup, destroyed, cancelled).await;
    }

    /// Hands the task to the harness and records its progress. Returns
    /// whether the execution was cancelled.
    async fn dispatch(&mut self, session: &mut dyn HarnessSession, cmd: &ExecuteCommand) -> bool {
        let call = ToolCall {
            tool: "run_task".into(),
            task: Task {
                kind: "task",
                execution_id: self.record.execution_id.clone(),
                title: cmd.title.clone(),
                description: cmd.description.clone(),
                workspace: WORKSPACE_MOUNT.into(),
            },
        };
        self.recorder.emit(EventKind::Dispatched { tool: call.tool.clone() }, None).await;
        let (tx, mut rx) = mpsc::channel::<HarnessEvent>(256);
        let dispatch = session.dispatch_tool(call, tx, self.cancel.clone());
        tokio::pin!(dispatch);
        let result = loop {
            tokio::select! {
                biased;
                Some(event) = rx.recv() => self.harness_event(event).await,
                result = &mut dispatch => break result,
            }
        };
        while let Ok(event) = rx.try_recv() {
            self.harness_event(event).await;
        }
        match result {
            Ok(result) => {
                let evidence = &mut self.record.evidence;
                evidence.tokens_spent = result.tokens_spent;
                evidence.resolved_model = result.resolved_model;
                self.raw.tool_output = result.output;
                if !result.ok {
                    self.failed(FailureStage::Execution, &result.error);
                }
                false
            }
            Err(ReinError::Cancelled) => {
                self.raw.tool_error = "cancelled".into();
                true
            }
            Err(e) => {
                self.failed(FailureStage::Execution, &e.to_string());
                false
            }
        }
    }

    async fn harness_event(&mut self, event: HarnessEvent) {
        let (kind, raw) = match event {
            HarnessEvent::Progress { message, tokens_so_far } => (
                EventKind::Progress { progress_kind: "progress".into(), tool: String::new(), tokens_so_far },
                Some(RawPart::ProgressMessage(message)),
            ),
            HarnessEvent::ToolUse { tool, tokens_so_far } => {
                (EventKind::Progress { progress_kind: "tool_use".into(), tool, tokens_so_far }, None)
            }
            HarnessEvent::OutputTruncated { stream, bytes_dropped } => {
                (EventKind::OutputTruncated { stream: stream.into(), bytes_dropped }, None)
            }
        };
        self.recorder.emit(kind, raw).await;
    }

    /// Records the commit the daemon sees in the workspace and, when it is
    /// new, fetches it into the origin as `refs/corral/<execution-id>`.
    async fn collect_commit(&mut self, cmd: &ExecuteCommand, sandbox: &Sandbox, base: &str) {
        let Ok(head) = workspace::head(&sandbox.workspace).await else {
            return;
        };
        self.record.evidence.commit_sha = head.clone();
        if head == base {
            return;
        }
        let origin = std::path::Path::new(&cmd.repo);
        if let Err(e) = workspace::fetch_back(origin, &sandbox.workspace, &self.record.execution_id).await {
            self.failed(FailureStage::Execution, &e.to_string());
        }
    }

    /// Destroys a sandbox; called exactly once per sandbox.
    async fn destroy(&mut self, backend: &dyn SandboxBackend, sandbox: &Sandbox) -> TeardownResult {
        self.set_sandbox_state(&sandbox.id, SandboxState::Destroying).await;
        match backend.destroy(sandbox).await {
            Ok(()) => {
                self.set_sandbox_state(&sandbox.id, SandboxState::Destroyed).await;
                TeardownResult::Succeeded
            }
            Err(e) => {
                self.set_sandbox_state(&sandbox.id, SandboxState::Failed).await;
                self.failed(FailureStage::Teardown, &e.to_string());
                TeardownResult::Failed
            }
        }
    }

    async fn set_sandbox_state(&self, sandbox_id: &str, state: SandboxState) {
        if let Err(error) = self.engine.store.set_sandbox_state(sandbox_id, state).await {
            tracing::error!(%sandbox_id, state = state.as_str(), %error, "sandbox state not stored");
        }
    }

    /// A failure: the evidence gets the stage's fixed sentence (if it is the
    /// first), the direct caller gets the raw error.
    fn failed(&mut self, stage: FailureStage, raw_error: &str) {
        self.record.evidence.fail(stage);
        if !self.raw.tool_error.is_empty() {
            self.raw.tool_error.push('\n');
        }
        self.raw.tool_error.push_str(&format!("{}: {raw_error}", stage.as_str()));
    }

    async fn finish_refused(&mut self) {
        self.finish_without_sandbox(Outcome::Refused).await;
    }

    /// Finishes an execution that never got a sandbox: both teardown
    /// results are `not_attempted`.
    async fn finish_without_sandbox(&mut self, outcome: Outcome) {
        let cancelled = outcome == Outcome::Cancelled;
        self.finish(TeardownResult::NotAttempted, TeardownResult::NotAttempted, cancelled).await;
    }

    async fn finish(&mut self, cleanup: TeardownResult, destroy: TeardownResult, cancelled: bool) {
        self.recorder.emit(EventKind::Teardown { session_cleanup: cleanup, sandbox_destroy: destroy }, None).await;
        let evidence = &mut self.record.evidence;
        evidence.session_cleanup = cleanup;
        evidence.sandbox_destroy = destroy;
        evidence.outcome = match evidence.failure_stage {
            _ if cancelled => Outcome::Cancelled,
            Some(FailureStage::Resolution | FailureStage::Gate) => Outcome::Refused,
            Some(_) => Outcome::Failed,
            None => Outcome::Succeeded,
        };
        if cancelled && evidence.error.is_empty() {
            evidence.error = "execution cancelled".into();
        }
        evidence.time("total", self.started);
        self.record.state = ExecutionState::from_outcome(evidence.outcome);
        self.record.finished_at_ms = Some(now_ms());
        self.save().await;
        let finished = EventKind::Finished { execution: Box::new(self.record.clone()) };
        let raw = RawPart::Finished(std::mem::take(&mut self.raw));
        self.recorder.emit(finished, Some(raw)).await;
        tracing::info!(
            execution_id = %self.record.execution_id,
            outcome = ?self.record.evidence.outcome,
            stage = ?self.record.evidence.failure_stage,
            "execution finished"
        );
    }

    async fn save(&self) {
        if let Err(error) = self.engine.store.update_execution(&self.record).await {
            tracing::error!(execution_id = %self.record.execution_id, %error, "execution record not stored");
        }
    }
}
