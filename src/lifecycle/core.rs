//! The one lifecycle every harness run goes through, whether it is a
//! one-turn execution or a session of many turns:
//! `open` (resolve → agent_start gate → sandbox → workspace → start),
//! `turn` (tool_call gate → dispatch, restarting a dead harness through the
//! gate first), `close` (end → cleanup → collect the commit → destroy).
//!
//! The rules it keeps: resolution refusals never touch a backend; no path
//! starts a harness without the gate; once a sandbox exists it is destroyed
//! exactly once; `cleanup_session` runs whenever `start_session`
//! succeeded; the first failure decides the stage; raw errors and output
//! reach only the direct caller.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::capture::CaptureJob;
use super::limits::{
    cgroup_hits, small_tree_usage, tree_usage, workspace_hit, EgressEvents, EventBudget, TreeBudget, TreeUsage,
    WorkspaceWatch, SMALL_TREE,
};
use super::phase::{Harness, PhaseKind, Ready, RunPhase};
use super::{Engine, RawResult};
use crate::catalog::{Profile, ReadinessState, RunFacts};
use crate::credentials::Scrubber;
use crate::events::{EventKind, RawPart, Recorder};
use crate::policy::{Action, GateInput, GateOutcome, Phase, Policy, PolicyDecision};
use crate::rein::{Dispatch, HarnessEvent, ReinError, StartContext, ToolCall, ToolGate, ToolResult};
use crate::sandbox::{workspace, Consumer, SandboxSpec, SandboxState};
use crate::types::evidence::{Evidence, FailureStage, TeardownResult};

/// Why `open` stopped; the evidence already says so.
#[derive(Clone, Debug)]
pub enum OpenFailure {
    Refused { reason: String },
    Denied { policy: String, reason: String },
    Failed { stage: FailureStage },
    Cancelled,
}

/// What one turn came to.
#[derive(Debug)]
pub enum TurnOutcome {
    Done(ToolResult),
    /// The tool_call gate said no; the session stays usable.
    Denied {
        policy: String,
        reason: String,
    },
    Failed(ReinError),
    Cancelled,
}

pub struct Core {
    pub engine: Arc<Engine>,
    pub recorder: Recorder,
    pub evidence: Evidence,
    pub raw: RawResult,
    pub consumer: Consumer,
    pub repo: String,
    pub session_policies: Arc<Vec<Policy>>,
    /// Where the run is, with the profile, sandbox and harness it holds.
    phase: RunPhase,
    timeout: Duration,
    tool_calls: Arc<AtomicU64>,
    /// Replaces credential values in everything the harness says.
    scrubber: Scrubber,
    pub restarts: u64,
    /// The calls whose `approval_requested` was recorded and whose
    /// `approval_decided` was not yet: a turn or run that ends first
    /// decides them (see [`Core::close_open_approvals`]).
    open_approvals: Vec<String>,
    pub session_cleanup: TeardownResult,
    pub sandbox_destroy: TeardownResult,
    /// How many events (and bytes of harness text) the run may still record.
    budget: EventBudget,
    /// Set once the budget has cut an event: from then on the tool_call
    /// gate denies at once a call that would wait for a person (see
    /// `CoreGate::decide`).
    budget_spent: Arc<AtomicBool>,
    /// What the evidence's lists had cut, so that a record fits one
    /// message however long the run.
    omitted: crate::records::bounded::Omitted,
    /// What the sandbox's cgroup had cut when last read.
    hits_seen: crate::sandbox::cgroup::LimitHits,
    /// The workspace broke `max_workspace_bytes`: no fetch-back.
    workspace_over: bool,
    /// A session's watch over its workspace while no turn runs.
    idle_watch: Option<WorkspaceWatch>,
    /// `egress` events recorded so far, against their cap.
    egress_events: EgressEvents,
    /// The run's routes through the credential gateway (placeholders made
    /// once, when its sandbox is).
    gateway: Arc<Vec<crate::credentials::GatewayRoute>>,
    /// The stopped sandbox, given back once `finished` is sent.
    reclaim: Option<super::warm::PendingReclaim>,
    /// The refill of the warm pool this run's sandbox came from, begun
    /// once `finished` is sent, or a while after the harness has its task
    /// (see [`super::warm::Refill`]).
    refill: Option<super::warm::Refill>,
}

impl Drop for Core {
    /// A run's task that panics (a bug) drops its `Core` unwinding: the
    /// sandbox it held is left where [`Engine::recover_panicked`] finds it
    /// (a warm one's row names the run only from its next write).
    fn drop(&mut self) {
        if std::thread::panicking() && !self.evidence.sandbox_id.is_empty() {
            let subject = self.recorder.subject().to_string();
            let mut panicked = self.engine.panicked.lock().unwrap_or_else(|e| e.into_inner());
            panicked.insert(subject, self.evidence.sandbox_id.clone());
        }
    }
}

impl Core {
    pub fn new(
        engine: Arc<Engine>,
        recorder: Recorder,
        consumer: Consumer,
        repo: String,
        policies: Vec<Policy>,
    ) -> Core {
        Core {
            engine,
            recorder,
            evidence: Evidence::default(),
            raw: RawResult::default(),
            consumer,
            repo,
            session_policies: Arc::new(policies),
            phase: RunPhase::New,
            timeout: Duration::from_secs(600),
            tool_calls: Arc::new(AtomicU64::new(0)),
            scrubber: Scrubber::default(),
            restarts: 0,
            open_approvals: Vec::new(),
            session_cleanup: TeardownResult::NotAttempted,
            sandbox_destroy: TeardownResult::NotAttempted,
            budget: EventBudget::new(u64::MAX, u64::MAX),
            budget_spent: Arc::default(),
            omitted: Default::default(),
            hits_seen: Default::default(),
            workspace_over: false,
            idle_watch: None,
            egress_events: EgressEvents::default(),
            gateway: Arc::default(),
            reclaim: None,
            refill: None,
        }
    }

    /// Gives the stopped sandbox's uid, cgroup and files back, in the
    /// background: called once the run's `finished` is sent (dropping the
    /// core does the same).
    pub fn reclaim_sandbox(&mut self) {
        drop(self.reclaim.take());
        self.begin_refill();
    }

    /// Begins the refill of the warm pool this run's sandbox came from, if
    /// it came from one: called once a session's harness is started, and
    /// when the sandbox is given back.
    pub fn begin_refill(&mut self) {
        drop(self.refill.take());
    }

    /// `text` with every credential value of this run replaced.
    pub fn scrub(&self, text: &str) -> String {
        self.scrubber.scrub(text)
    }

    /// The resolved profile, once there is one.
    pub fn profile(&self) -> Option<&Arc<Profile>> {
        self.phase.profile()
    }

    /// The sandbox the gate allowed, once it did.
    pub fn effective(&self) -> Option<SandboxSpec> {
        self.phase.effective().cloned()
    }

    /// A failure: the evidence gets the stage's fixed sentence (if it is the
    /// first), the direct caller gets the raw error.
    pub fn failed(&mut self, stage: FailureStage, raw_error: &str) {
        let raw_error = self.scrubber.scrub(raw_error);
        self.evidence.fail(stage);
        self.evidence.classify(stage, &raw_error);
        if !self.raw.tool_error.is_empty() {
            self.raw.tool_error.push('\n');
        }
        self.raw.tool_error.push_str(&format!("{}: {raw_error}", stage.as_str()));
    }

    fn refused(&mut self, stage: FailureStage, reason: &str) {
        self.evidence.refuse(stage, reason);
        self.evidence.classify(stage, reason);
        self.raw.tool_error = reason.to_string();
    }

    /// resolve → agent_start gate → sandbox → workspace → harness. On any
    /// failure, whatever was created is torn down before it returns.
    pub async fn open(&mut self, profile_ref: &str, cancel: &CancellationToken) -> Result<(), OpenFailure> {
        // A span per stage: in a trace, each is a child of the run's span.
        let profile = self.resolve(profile_ref).instrument(tracing::info_span!("resolve")).await?;
        let outcome = self.gate_agent_start(&profile, true).instrument(tracing::info_span!("gate")).await;
        if let Some(denial) = outcome.denial() {
            let (policy, reason) = (denial.policy.clone(), denial.reason.clone());
            self.refused(FailureStage::Gate, &format!("denied by policy {policy}: {reason}"));
            return Err(OpenFailure::Denied { policy, reason });
        }
        if cancel.is_cancelled() {
            return Err(OpenFailure::Cancelled);
        }
        self.create_sandbox(&outcome.effective_sandbox).instrument(tracing::info_span!("sandbox_create")).await?;
        // Cancelled (an EndSession, a CancelExecution) while its sandbox
        // was made and its repository cloned: no harness is started in it.
        if cancel.is_cancelled() {
            self.destroy().await;
            return Err(OpenFailure::Cancelled);
        }
        if let Err(error) = self.start_harness().instrument(tracing::info_span!("session_start")).await {
            self.failed(FailureStage::SessionStart, &error.to_string());
            self.destroy().await;
            return Err(OpenFailure::Failed { stage: FailureStage::SessionStart });
        }
        Ok(())
    }

    /// Rule 1: the actor, then the profile; nothing is created before this.
    async fn resolve(&mut self, profile_ref: &str) -> Result<Arc<Profile>, OpenFailure> {
        let t = Instant::now();
        // The actor, the catalog, every credential the profile needs there
        // now (before any sandbox exists: a missing key found at session
        // start is found too late), and this node's labels (a fleet places
        // work by labels; a node never runs what [placement] keeps off it).
        let resolved = self.engine.resolve_checked(Some(&self.consumer.actor), profile_ref, true);
        // The repository, as this node allows it (see `Engine::repo_here`).
        let resolved =
            resolved.and_then(|profile| self.engine.repo_here(&self.consumer.principal, &self.repo).map(|()| profile));
        self.evidence.time("resolve", t);
        // A session's harness takes one task line per turn: a harness that
        // reads its whole task at once would take the first turn and no other.
        let resolved = resolved.and_then(|profile| match profile.file.rein.takes_turns() {
            true => Ok(profile),
            false if self.consumer.session_id.is_empty() => Ok(profile),
            false => Err(crate::catalog::Refusal(format!(
                "profile {} cannot take turns: a session needs a harness with input = \"task_json\", or Claude \
                 Code or Codex with input = \"prompt\"",
                profile.reference()
            ))),
        });
        let profile = resolved.map_err(|refusal| {
            self.refused(FailureStage::Resolution, &refusal.0);
            OpenFailure::Refused { reason: refusal.0 }
        })?;
        let readiness = profile.file.readiness.clone();
        self.evidence.profile_ref = profile.reference();
        self.evidence.profile_digest = profile.digest.clone();
        self.evidence.readiness = Some(readiness.clone());
        self.evidence.rein = profile.file.rein.kind.clone();
        self.budget = EventBudget::new(profile.file.limits.max_events, profile.file.limits.max_event_bytes);
        if readiness.state == ReadinessState::Unverified {
            self.evidence.notes.push(format!("profile readiness is unverified: {}", readiness.reason));
        }
        let event =
            EventKind::Resolved { profile_ref: profile.reference(), profile_digest: profile.digest.clone(), readiness };
        // Stored with the gate's decision, which follows at once (see
        // `Core::gate_agent_start`).
        self.recorder.hold(event);
        if let Err(bug) = self.phase.resolve(profile.clone()) {
            self.failed(FailureStage::Resolution, &bug.to_string());
            return Err(OpenFailure::Failed { stage: FailureStage::Resolution });
        }
        Ok(profile)
    }

    /// The agent_start gate, from the profile's sandbox. Run before the
    /// first start and before every restart. Before the first, its `gated`
    /// event is held with `accepted` and `resolved`: stored with the intent
    /// row of the sandbox made next, or alone once a warm one is taken.
    /// Before a restart it is stored at once.
    async fn gate_agent_start(&mut self, profile: &Profile, first: bool) -> GateOutcome {
        let t = Instant::now();
        // The principal as configured now (a reload may have changed its
        // type or its write_roots). One this node does not know writes
        // nowhere, unless this node knows no principal at all (a fleet's
        // worker: it takes no calls) and the accepting node admitted it as
        // adm; a principal a reload removed is not so trusted.
        let principals = self.engine.repos.principals.current();
        let known = principals.named(&self.consumer.principal);
        // Counted only when the principal is not known here.
        let knows_others = known.is_none() && {
            let admin = usize::from(principals.named(crate::auth::LOCAL_ADMIN).is_some());
            principals.principal_count() > admin
        };
        let host_writes =
            crate::auth::host_writes_of(known.as_deref(), &self.consumer.principal, &self.consumer.actor, knows_others);
        let facts = RunFacts {
            actor: &self.consumer.actor,
            project: &self.consumer.project,
            repo: &self.repo,
            tool_calls: self.tool_calls.load(Ordering::SeqCst),
            session_policies: &self.session_policies,
            host_writes,
        };
        let outcome = profile.gate_agent_start(&self.engine.gate, facts);
        self.evidence.time("gate", t);
        if first {
            let event = self.gate_event(&outcome);
            self.recorder.hold(event);
        } else {
            self.record_gate(&outcome).await;
        }
        if outcome.action == Action::Allow {
            if let Err(bug) = self.phase.allow(outcome.effective_sandbox.clone()) {
                tracing::error!(error = %bug, "lifecycle phase");
            }
            self.timeout = Duration::from_secs(outcome.effective_timeout_seconds);
        }
        outcome
    }

    async fn record_gate(&mut self, outcome: &GateOutcome) {
        let event = self.gate_event(outcome);
        self.recorder.emit(event, None).await;
    }

    /// The `gated` event of a decision, counted and kept in the evidence.
    fn gate_event(&mut self, outcome: &GateOutcome) -> EventKind {
        self.count_gate(outcome);
        EventKind::Gated {
            phase: outcome.phase.as_str().into(),
            tool: crate::records::bounded::tool_name(&self.scrubber.scrub(&outcome.tool)),
            action: outcome.action,
            decisions: outcome.decisions.clone(),
            effective_sandbox: outcome.effective_sandbox.clone(),
        }
    }

    /// A decision, counted and kept in the evidence (its first and last
    /// verdicts), whether or not its event is recorded.
    fn count_gate(&mut self, outcome: &GateOutcome) {
        for decision in &outcome.decisions {
            crate::telemetry::gate_decision(&decision.source, decision.action);
        }
        self.evidence.gate_decisions.extend(outcome.decisions.iter().cloned());
        if outcome.phase == Phase::ToolCall {
            self.evidence.tool_calls.count(outcome.action);
        }
        self.bound_evidence();
    }

    /// Holds the evidence's lists to what one record keeps (see
    /// [`crate::records::bounded::bound_evidence`]).
    fn bound_evidence(&mut self) {
        crate::records::bounded::bound_evidence(&mut self.evidence, &mut self.omitted);
    }

    async fn create_sandbox(&mut self, spec: &SandboxSpec) -> Result<(), OpenFailure> {
        let fail = |stage| OpenFailure::Failed { stage };
        let Some(profile) = self.profile().cloned() else {
            self.failed(FailureStage::SandboxCreate, "no profile to make a sandbox for");
            return Err(fail(FailureStage::SandboxCreate));
        };
        let t = Instant::now();
        // A warm sandbox made for exactly this profile version, sandbox and
        // timeout, if its pool has one; else one made now.
        let timeout = self.timeout.as_secs();
        let (made, warm) = match self.engine.take_warm(&profile, spec, timeout) {
            Some((made, refill)) => {
                self.refill = Some(refill);
                // No intent row to carry the held events (`accepted`,
                // `resolved`, `gated`): stored now, in a write of their own.
                self.recorder.flush().await;
                (made, true)
            }
            None => {
                // The held events go in the intent row's commit.
                let recorder = Some(&mut self.recorder);
                match super::warm::make_sandbox(&self.engine, spec, &profile, timeout, recorder).await {
                    Ok(made) => (made, false),
                    Err(error) => {
                        self.failed(FailureStage::SandboxCreate, &error);
                        return Err(fail(FailureStage::SandboxCreate));
                    }
                }
            }
        };
        let super::warm::Made { backend, mut sandbox, gateway } = made;
        sandbox.consumer = self.consumer.clone();
        self.gateway = Arc::new(gateway);
        self.evidence.sandbox_id = sandbox.id.clone();
        if let Some(egress) = &sandbox.egress {
            // Before anything runs in it: its proxy refuses every connection without.
            egress.attach_budget(self.engine.proxy_budget.clone(), &self.consumer.principal);
            // Only the gateway may carry them.
            egress.forbid(self.gateway.iter().map(|r| r.placeholder.clone()).collect());
        }
        let ready = sandbox.state == SandboxState::Ready;
        if let Err(bug) = self.phase.sandbox_made(backend.clone(), sandbox.clone()) {
            // Not held by the phase, so destroyed here.
            self.failed(FailureStage::SandboxCreate, &bug.to_string());
            let _ = self.engine.destroy_sandbox(backend.as_ref(), &sandbox).await;
            return Err(fail(FailureStage::SandboxCreate));
        }
        // A warm sandbox's row names this run from now on: recovery
        // finishes the run with it. With nothing to clone, the write that
        // stores `sandbox_ready` (the dispatch's, a millisecond later, or
        // whatever comes first) names it; before a clone (seconds), a
        // write of its own does. That write marks a sandbox made for this
        // run ready, too.
        if warm {
            if !self.repo.is_empty() {
                if let Err(e) = self.engine.store.adopt_sandbox(&sandbox.id, self.recorder.subject()).await {
                    self.failed(FailureStage::SandboxCreate, &e.to_string());
                    self.destroy().await;
                    return Err(fail(FailureStage::SandboxCreate));
                }
            }
            self.evidence
                .notes
                .push(format!("the sandbox was made ahead, in the warm pool of {}", profile.reference()));
        }
        self.evidence.time("sandbox_create", t);
        if !ready {
            let error = format!("sandbox is {}, not ready", sandbox.state.as_str());
            self.failed(FailureStage::SandboxCreate, &error);
            self.destroy().await;
            return Err(fail(FailureStage::SandboxCreate));
        }

        let t = Instant::now();
        if !self.repo.is_empty() {
            let cloned = match workspace::clone_into(std::path::Path::new(&self.repo), &sandbox.workspace).await {
                Ok(commit) => workspace::hand_over(&sandbox.workspace, sandbox.user).map(|()| commit),
                Err(e) => Err(e),
            };
            match cloned {
                Ok(commit) => {
                    if let Some(ready) = self.phase.ready_mut() {
                        ready.base_commit = Some(commit);
                    }
                }
                Err(e) => {
                    self.failed(FailureStage::SandboxCreate, &e.to_string());
                    self.destroy().await;
                    return Err(fail(FailureStage::SandboxCreate));
                }
            }
        }
        self.evidence.time("workspace", t);
        let ready = EventKind::SandboxReady {
            sandbox_id: sandbox.id.clone(),
            backend: sandbox.backend,
            workspace_path: sandbox.workspace.to_string_lossy().into_owned(),
            receipt: sandbox.receipt.clone(),
        };
        // Stored with the run's next write: its dispatch (an execution's
        // turn follows at once), the end of a session's open, or a failure.
        self.recorder.hold_adopting(ready, &sandbox.id);
        Ok(())
    }

    async fn start_harness(&mut self) -> Result<(), ReinError> {
        let Some(ready) = self.phase.ready() else {
            return Err(ReinError::Start("no sandbox to start in".into()));
        };
        let (profile, backend, sandbox) = (ready.profile.clone(), ready.backend.clone(), ready.sandbox.clone());
        let rein = self
            .engine
            .reins
            .get(&profile.file.rein.kind)
            .cloned()
            .ok_or_else(|| ReinError::Start(format!("no rein named {}", profile.file.rein.kind)))?;
        let t = Instant::now();
        // Read at every start, so a rotated secret is picked up.
        let (credentials, scrubber) = self
            .engine
            .credentials
            .plan(&profile.file.credential_route_refs, &self.gateway)
            .map_err(ReinError::Start)?;
        self.scrubber = scrubber;
        let ctx = StartContext {
            backend,
            sandbox,
            profile,
            consumer: self.consumer.clone(),
            timeout: self.timeout,
            credentials,
            gateway: self.gateway.clone(),
        };
        // A start that lasts stores what is held meanwhile (the first
        // start's `sandbox_ready`, see `create_sandbox`), so that a crash
        // during it is recorded as during session_start; a quick one leaves
        // it to the dispatch's write.
        let mut starting = rein.start_session(ctx);
        let harness = tokio::select! {
            started = &mut starting => started?,
            () = tokio::time::sleep(Self::STAGE_STORED_AFTER) => {
                let (started, ()) = tokio::join!(&mut starting, self.recorder.flush());
                started?
            }
        };
        self.evidence.harness = Some(harness.invocation());
        self.evidence.time("session_start", t);
        match self.phase.ready_mut() {
            Some(ready) => ready.harness = Harness::Here(harness),
            None => return Err(ReinError::Start("the sandbox went away while the harness started".into())),
        }
        Ok(())
    }

    /// The agent_start gate again, before a harness starts anew in the
    /// sandbox it has (a restart, a resumed turn): `Err` when it denies,
    /// or asks for another sandbox than this one.
    async fn gate_again(&mut self, profile: &Profile) -> Result<(), TurnOutcome> {
        let outcome = self.gate_agent_start(profile, false).await;
        if let Some(denial) = outcome.denial() {
            return Err(TurnOutcome::Denied { policy: denial.policy.clone(), reason: denial.reason.clone() });
        }
        if Some(&outcome.effective_sandbox) != self.phase.ready().map(|r| &r.sandbox.spec) {
            // The sandbox was made for another decision; starting in it
            // would not be what the gate just allowed.
            let error = ReinError::Start("the gate now asks for a different sandbox; end the session".into());
            return Err(TurnOutcome::Failed(error));
        }
        Ok(())
    }

    /// A harness that died is restarted only through the gate again.
    async fn restart_harness(&mut self, why: &str) -> Result<(), TurnOutcome> {
        let profile = self.profile().cloned().ok_or(TurnOutcome::Failed(ReinError::Start("no profile".into())))?;
        if let Some(mut dead) = self.phase.ready_mut().and_then(|r| r.harness.take_here()) {
            if let Err(e) = dead.cleanup_session().await {
                tracing::warn!(error = %e, "cleanup of a dead harness failed");
            }
        }
        self.gate_again(&profile).await?;
        self.restarts += 1;
        self.recorder.emit(EventKind::HarnessRestarted { attempt: self.restarts, reason: why.to_string() }, None).await;
        self.start_harness().await.map_err(TurnOutcome::Failed)
    }

    /// The turn's own call, which the gate answered with *ask*: it waits
    /// for a person's decision exactly as a harness's policy request does
    /// (`approval_requested`, `DecideToolCall`, none in time denies), each
    /// step recorded as it comes. `Err` is the turn's end: denied, or
    /// cancelled while it waited (the call is withdrawn). An allowed call
    /// is counted when `counted`.
    async fn ask_person(
        &mut self,
        call: &ToolCall,
        outcome: &GateOutcome,
        gate: &dyn ToolGate,
        counted: bool,
        cancel: &CancellationToken,
    ) -> Result<(), TurnOutcome> {
        // What a person decides on: the call's arguments, or for an
        // execution's `run_task` (which has none) the task itself.
        let summary = match &call.task.arguments {
            Value::Null => serde_json::json!({"title": call.task.title, "description": call.task.description}),
            arguments => arguments.clone(),
        };
        let wait = Duration::from_secs(outcome.approval_timeout_seconds);
        let (tx, mut rx) = mpsc::channel::<HarnessEvent>(8);
        let verdict = {
            let pending = std::future::pending();
            let asking = crate::rein::ask_person(gate, &tx, &call.tool, summary.to_string(), wait, pending);
            tokio::pin!(asking);
            loop {
                tokio::select! {
                    biased;
                    Some(event) = rx.recv() => self.harness_events(event, &mut rx).await,
                    verdict = &mut asking => break Some(verdict),
                    _ = cancel.cancelled() => break None,
                }
            }
        };
        while let Ok(event) = rx.try_recv() {
            self.harness_events(event, &mut rx).await;
        }
        let Some(verdict) = verdict else { return Err(TurnOutcome::Cancelled) };
        if !verdict.allow {
            let asking = outcome.decisions.iter().find(|d| d.action == Action::Ask);
            let policy = asking.map(|d| d.policy.clone()).unwrap_or_else(|| "require_approval".into());
            return Err(TurnOutcome::Denied { policy, reason: verdict.reason });
        }
        if counted {
            gate.count_approved();
        }
        Ok(())
    }

    /// tool_call gate (a person's decision when it asks) → dispatch.
    /// Progress is recorded as it comes; the evidence's lists stay within
    /// what one record keeps, however many turns there are.
    pub async fn turn(&mut self, call: ToolCall, cancel: CancellationToken) -> TurnOutcome {
        self.workspace_between_turns().await;
        if self.workspace_over {
            let why = "the sandbox's workspace is over its budget (see its limit event): end the session";
            return TurnOutcome::Failed(ReinError::Dispatch(why.into()));
        }
        let outcome = self.gate_and_dispatch(call, cancel).await;
        self.close_open_approvals("the turn ended before a decision").await;
        self.bound_evidence();
        outcome
    }

    /// Decides every call still waiting for a person when its turn or run
    /// ends first (cancelled, timed out, the harness gone): denied by
    /// `corral`, so that no `approval_requested` stays open for watchers
    /// and the evidence counts the call.
    async fn close_open_approvals(&mut self, why: &str) {
        let open = std::mem::take(&mut self.open_approvals);
        let decided: Vec<_> = open
            .into_iter()
            .map(|call_id| {
                self.evidence.tool_calls.count(Action::Deny);
                let event = EventKind::ApprovalDecided {
                    call_id,
                    allow: false,
                    decided_by: "corral".into(),
                    reason: why.into(),
                };
                (event, None)
            })
            .collect();
        if !decided.is_empty() {
            self.recorder.emit_batch(decided).await;
        }
    }

    async fn gate_and_dispatch(&mut self, call: ToolCall, cancel: CancellationToken) -> TurnOutcome {
        let alive = match self.phase.ready_mut().map(|r| &mut r.harness) {
            Some(Harness::Here(harness)) => harness.is_alive(),
            _ => false,
        };
        if !alive {
            if let Err(outcome) = self.restart_harness("the harness exited").await {
                return outcome;
            }
        }
        // Claude Code and Codex start a new run of their CLI for every turn
        // after the first: no harness starts without the gate.
        let anew = match self.phase.ready().map(|r| &r.harness) {
            Some(Harness::Here(harness)) => alive && harness.starts_anew(&call),
            _ => false,
        };
        if anew {
            let Some(profile) = self.profile().cloned() else {
                return TurnOutcome::Failed(ReinError::Start("no profile".into()));
            };
            if let Err(outcome) = self.gate_again(&profile).await {
                return outcome;
            }
        }
        // An agent whose own tool calls come through its hook: the turn is
        // gated, but it is not one of those calls and does not count.
        let hooked = self.phase.ready().is_some_and(|r| !r.sandbox.gate.is_empty());
        let gate = self.core_gate();
        let outcome = gate.decide(&call.tool, &call.task.arguments, !hooked);
        let gate: Arc<dyn ToolGate> = Arc::new(gate);
        let gated = self.gate_event(&outcome);
        if let Some(denial) = outcome.denial() {
            self.recorder.emit(gated, None).await;
            return TurnOutcome::Denied { policy: denial.policy.clone(), reason: denial.reason.clone() };
        }
        let dispatched = EventKind::Dispatched { tool: call.tool.clone() };
        if outcome.action == Action::Ask {
            self.recorder.emit(gated, None).await;
            if let Err(refused) = self.ask_person(&call, &outcome, gate.as_ref(), !hooked, &cancel).await {
                return refused;
            }
            self.recorder.emit(dispatched, None).await;
        } else {
            // The decision and the dispatch it allows: one write.
            self.recorder.emit_batch(vec![(gated, None), (dispatched, None)]).await;
        }
        if let Some(refill) = &self.refill {
            refill.begin_after(super::warm::REFILL_AFTER_DISPATCH);
        }
        let Some(mut harness) = self.phase.ready_mut().and_then(|r| r.harness.take_here()) else {
            return TurnOutcome::Failed(ReinError::Dispatch("no harness".into()));
        };
        // The turn's own token: the workspace watch stops the turn with it,
        // without cancelling the whole execution or session.
        let caller_cancel = cancel;
        let cancel = caller_cancel.child_token();
        let budget = self.workspace_budget();
        let watch = match self.phase.ready() {
            Some(ready) if budget.is_limited() => Some(WorkspaceWatch::start(
                ready.sandbox.root.clone(),
                budget,
                ready.sandbox.cgroup.clone(),
                cancel.clone(),
            )),
            _ => None,
        };
        let t = Instant::now();
        let (tx, mut rx) = mpsc::channel::<HarnessEvent>(1024);
        let result = {
            let dispatch = harness.dispatch_tool(call, Dispatch { events: tx, cancel, gate });
            tokio::pin!(dispatch);
            let egress = self.phase.ready().and_then(|r| r.sandbox.egress.clone());
            // The harness's result, when it came while a burst was stored.
            let mut ended = None;
            let result = loop {
                if let Some(result) = ended.take() {
                    break result;
                }
                let egress_news = async {
                    match &egress {
                        Some(log) => log.notify().notified().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    Some(event) = rx.recv() => {
                        // The harness is read on (into `rx`) while its last
                        // burst is stored: parsing and storing overlap.
                        let recording = self.harness_events(event, &mut rx);
                        tokio::pin!(recording);
                        loop {
                            tokio::select! {
                                _ = &mut recording => break,
                                result = &mut dispatch, if ended.is_none() => ended = Some(result),
                            }
                        }
                    }
                    _ = egress_news => self.record_egress().await,
                    result = &mut dispatch => break result,
                }
            };
            self.record_egress().await;
            while let Ok(event) = rx.try_recv() {
                self.harness_events(event, &mut rx).await;
            }
            result
        };
        // A resumed run's argv is the one that ran last.
        self.evidence.harness = Some(harness.invocation());
        match self.phase.ready_mut() {
            Some(ready) => ready.harness = Harness::Here(harness),
            None => tracing::error!("lifecycle phase: the sandbox went away during a turn"),
        }
        self.evidence.time("harness", t);
        let limit_notes = self.record_cgroup_hits().await;
        if let Some(usage) = watch.and_then(WorkspaceWatch::stop) {
            let raw = self.record_workspace_hit(usage, budget, "").await;
            if !caller_cancel.is_cancelled() {
                return TurnOutcome::Failed(ReinError::Dispatch(raw));
            }
        }
        let result = result.map(|mut r| {
            if !r.ok && !limit_notes.is_empty() {
                r.error = format!("{} ({})", r.error, limit_notes.join("; "));
            }
            r
        });
        match result {
            Ok(mut result) => {
                result.output = self.scrubber.scrub(&result.output);
                result.error = self.scrubber.scrub(&result.error);
                // Summed over a session's turns, and still within the bound
                // every count a harness reports is held to.
                let spent = self.evidence.tokens_spent.saturating_add(result.tokens_spent);
                self.evidence.tokens_spent = crate::rein::bounded_tokens(spent);
                if let Some(usage) = &result.usage {
                    self.evidence.notes.push(usage.describe());
                }
                // Untrusted: scrubbed, then kept only if it is a model name.
                if !result.resolved_model.is_empty() {
                    let scrubbed = self.scrubber.scrub(&result.resolved_model);
                    match crate::records::bounded::model_name(&scrubbed) {
                        Some(model) => self.evidence.resolved_model = model,
                        None => self
                            .evidence
                            .notes
                            .push("the harness reported a model that is not a model name (withheld)".into()),
                    }
                    result.resolved_model = self.evidence.resolved_model.clone();
                }
                TurnOutcome::Done(result)
            }
            Err(ReinError::Cancelled) => TurnOutcome::Cancelled,
            Err(e) => TurnOutcome::Failed(e),
        }
    }

    /// Records what the egress proxy and the credential gateway decided
    /// since the last look: one `egress` event per attempt, up to
    /// [`super::limits::MAX_EGRESS_EVENTS`] per run (and within the event budget); the
    /// evidence counts every attempt. The hosts and reasons are what the
    /// harness asked for: scrubbed of the run's credentials, then bounded.
    async fn record_egress(&mut self) {
        let Some(log) = self.phase.ready().and_then(|r| r.sandbox.egress.clone()) else { return };
        // Bounds of a host and a reason, in characters, once scrubbed.
        const MAX_HOST: usize = 256;
        const MAX_REASON: usize = 1024;
        let scrubber = self.scrubber.clone();
        let scrub = |text: &str, max: usize| scrubber.scrub_within(text, max);
        let mut batch = Vec::new();
        for d in log.drain() {
            crate::telemetry::egress(d.allowed);
            if !self.egress_events.admit() {
                continue;
            }
            let (host, rule_or_reason) = (scrub(&d.host, MAX_HOST), scrub(&d.rule_or_reason, MAX_REASON));
            match self.budget.admit(host.len() + rule_or_reason.len()) {
                Ok(()) => batch.push((
                    EventKind::Egress {
                        host,
                        port: d.port,
                        allowed: d.allowed,
                        rule_or_reason,
                        method: d.method.to_string(),
                    },
                    None,
                )),
                Err(cut) => {
                    self.budget_spent.store(true, Ordering::SeqCst);
                    batch.extend(cut.map(|limit| (limit, None)));
                }
            }
        }
        self.recorder.emit_batch(batch).await;
        let (allowed, denied) = log.counts();
        self.evidence.egress = crate::types::evidence::EgressSummary {
            allowed,
            denied,
            denied_hosts: log.denied_hosts(10).iter().map(|h| scrub(h, MAX_HOST)).collect(),
            bytes: log
                .bytes()
                .into_iter()
                .map(|(host, up, down)| crate::types::evidence::HostBytes { host: scrub(&host, MAX_HOST), up, down })
                .collect(),
        };
    }

    /// Reads what the sandbox's cgroup cut since the last look and records
    /// each new cut as a `limit` event; returns the raw sentences.
    async fn record_cgroup_hits(&mut self) -> Vec<String> {
        let Some(cgroup) = self.phase.ready().and_then(|r| r.sandbox.cgroup.clone()) else { return Vec::new() };
        let now = cgroup.limit_hits();
        let limits = self.profile().map(|p| p.file.limits.clone()).unwrap_or_default();
        let hits = cgroup_hits(self.hits_seen, now, limits.memory_bytes, limits.max_processes);
        self.hits_seen = now;
        let mut notes = Vec::new();
        for (event, raw) in hits {
            self.evidence.notes.push(raw.clone());
            self.recorder.emit(event, None).await;
            notes.push(raw);
        }
        notes
    }

    /// Watches a session's workspace while no turn runs (from its open,
    /// and after each turn): its harness, or what it left running, works
    /// on between turns. Past the budget the sandbox's processes are
    /// killed, and the next turn or the end says so.
    pub fn watch_between_turns(&mut self) {
        let budget = self.workspace_budget();
        self.idle_watch = match self.phase.ready() {
            Some(ready) if budget.is_limited() && !self.workspace_over => {
                Some(WorkspaceWatch::between_turns(ready.sandbox.root.clone(), budget, ready.sandbox.cgroup.clone()))
            }
            _ => None,
        };
    }

    /// Stops the watch between turns; past the budget, its limit event.
    async fn workspace_between_turns(&mut self) {
        let Some(usage) = self.idle_watch.take().and_then(WorkspaceWatch::stop) else { return };
        let budget = self.workspace_budget();
        let raw = self.record_workspace_hit(usage, budget, " (between turns: its processes were killed)").await;
        self.failed(FailureStage::Execution, &raw);
    }

    /// The workspace's budget, from the profile's `[limits]`.
    fn workspace_budget(&self) -> TreeBudget {
        self.profile().map(|p| TreeBudget::from_limits(&p.file.limits)).unwrap_or_default()
    }

    /// Records that the workspace went over `budget` (`usage`): the run
    /// brings nothing back, its evidence notes it (with `how`, said after
    /// the reason) and its `limit` event goes out. Returns the reason.
    async fn record_workspace_hit(&mut self, usage: TreeUsage, budget: TreeBudget, how: &str) -> String {
        let (event, raw) = workspace_hit(usage, budget);
        self.workspace_over = true;
        self.evidence.notes.push(format!("{raw}{how}"));
        self.recorder.emit(event, None).await;
        raw
    }

    /// The sandbox's tree (workspace, HOME) against `max_workspace_bytes`
    /// and `max_workspace_inodes` at the end of the run: over either, the
    /// run fails and nothing is fetched back.
    async fn check_workspace_at_end(&mut self) {
        self.workspace_between_turns().await;
        let budget = self.workspace_budget();
        let Some(ready) = self.phase.ready() else { return };
        if !budget.is_limited() || self.workspace_over {
            return;
        }
        let (root, cgroup) = (ready.sandbox.root.clone(), ready.sandbox.cgroup.clone());
        let small = cgroup.as_deref().and_then(|c| small_tree_usage(&root, budget, c, SMALL_TREE));
        let usage = match small {
            Some(usage) => usage,
            None => tokio::task::spawn_blocking(move || tree_usage(&root, budget, cgroup.as_deref()))
                .await
                .unwrap_or_default(),
        };
        if budget.exceeded_by(usage) {
            let raw = self.record_workspace_hit(usage, budget, "").await;
            self.failed(FailureStage::Execution, &raw);
        }
    }

    /// The tool_call gate as one closure, for the turn itself and for the
    /// harness's own policy requests.
    fn core_gate(&self) -> CoreGate {
        CoreGate {
            engine: self.engine.clone(),
            profile: self.profile().cloned(),
            session_policies: self.session_policies.clone(),
            consumer: self.consumer.clone(),
            repo: self.repo.clone(),
            sandbox: self.effective().unwrap_or_default(),
            timeout_seconds: self.timeout.as_secs(),
            tool_calls: self.tool_calls.clone(),
            subject: self.recorder.subject().to_string(),
            budget_spent: self.budget_spent.clone(),
        }
    }

    /// Records `first` and whatever else the harness has already said, as
    /// one batch: one store transaction for many events, not one each.
    async fn harness_events(&mut self, first: HarnessEvent, rx: &mut mpsc::Receiver<HarnessEvent>) {
        // A burst must fit in the watchers' buffers with room to spare, or
        // every watcher would be ended as lagging.
        let max_batch = (self.engine.bus.capacity() / 4).clamp(1, 512);
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(event) = next.take() {
            let event = match event {
                HarnessEvent::ApprovalRequested { call_id, tool, summary, expires_at_ms } => {
                    let summary = self.scrubber.scrub_within(&summary, crate::rein::SUMMARY_CHARS);
                    HarnessEvent::ApprovalRequested { call_id, tool, summary, expires_at_ms }
                }
                other => other,
            };
            let bytes = match &event {
                HarnessEvent::Progress { message, .. } => message.len(),
                HarnessEvent::Output { line } => line.len(),
                HarnessEvent::ToolUse { tool, .. } => tool.len(),
                HarnessEvent::ApprovalRequested { summary, .. } => summary.len(),
                HarnessEvent::OutputTruncated { .. }
                | HarnessEvent::Gated(_)
                | HarnessEvent::ApprovalDecided { .. } => 0,
            };
            // Past the budget nothing more is recorded (policy verdicts
            // still reach the harness, and are counted): one `limit` event
            // says so. A call's approval is never cut: a person waits to
            // see it. Once the budget is spent no call waits (the gate
            // denies it at once, see `CoreGate::decide`): only calls that
            // began waiting before it ran out get here past it.
            let approval =
                matches!(event, HarnessEvent::ApprovalRequested { .. } | HarnessEvent::ApprovalDecided { .. });
            let admitted = if approval { Ok(()) } else { self.budget.admit(bytes) };
            if let Err(cut) = admitted {
                self.budget_spent.store(true, Ordering::SeqCst);
                if let HarnessEvent::Gated(outcome) = &event {
                    self.count_gate(outcome);
                }
                batch.extend(cut.map(|limit| (limit, None)));
                if batch.len() < max_batch {
                    next = rx.try_recv().ok();
                }
                continue;
            }
            match event {
                HarnessEvent::Progress { message, tokens_so_far } => batch.push((
                    EventKind::Progress { progress_kind: "progress".into(), tool: String::new(), tokens_so_far },
                    Some(RawPart::ProgressMessage(self.scrubber.scrub(&message))),
                )),
                HarnessEvent::ToolUse { tool, tokens_so_far } => {
                    let tool = crate::records::bounded::tool_name(&self.scrubber.scrub(&tool));
                    batch.push((EventKind::Progress { progress_kind: "tool_use".into(), tool, tokens_so_far }, None));
                }
                HarnessEvent::Output { line } => batch.push((
                    EventKind::Progress { progress_kind: "output".into(), tool: String::new(), tokens_so_far: 0 },
                    Some(RawPart::ProgressMessage(self.scrubber.scrub(&line))),
                )),
                HarnessEvent::OutputTruncated { stream, bytes_dropped } => {
                    batch.push((EventKind::OutputTruncated { stream: stream.into(), bytes_dropped }, None));
                }
                HarnessEvent::Gated(outcome) => {
                    // Keep the order: what came before the decision first.
                    self.recorder.emit_batch(std::mem::take(&mut batch)).await;
                    self.record_gate(&outcome).await;
                }
                HarnessEvent::ApprovalRequested { call_id, tool, summary, expires_at_ms } => {
                    self.open_approvals.push(call_id.clone());
                    let tool = crate::records::bounded::tool_name(&self.scrubber.scrub(&tool));
                    let event = EventKind::ApprovalRequested { call_id, tool, summary, expires_at_ms };
                    // At once: a person is waiting to see it.
                    self.recorder.emit_batch(std::mem::take(&mut batch)).await;
                    self.recorder.emit(event, None).await;
                }
                HarnessEvent::ApprovalDecided { call_id, allow, by, reason } => {
                    self.open_approvals.retain(|open| *open != call_id);
                    self.evidence.tool_calls.count(if allow { Action::Allow } else { Action::Deny });
                    let reason = self.scrubber.scrub_within(&reason, 1024);
                    batch.push((EventKind::ApprovalDecided { call_id, allow, decided_by: by, reason }, None));
                }
            }
            if batch.len() < max_batch {
                next = rx.try_recv().ok();
            }
        }
        self.recorder.emit_batch(batch).await;
    }

    /// end → cleanup → collect the commit → destroy → `teardown` event.
    /// Idempotent: a second call does nothing.
    pub async fn close(&mut self, cancelled: bool) {
        if self.phase.kind() == PhaseKind::Closed {
            return;
        }
        self.close_open_approvals("the run ended before a decision").await;
        let t = Instant::now();
        let started = self.phase.harness_started();
        let marking = self.mark_teardown();
        if let Some(mut harness) = self.phase.ready_mut().and_then(|r| r.harness.take_here()) {
            if !cancelled {
                if let Err(e) = harness.end_session().await {
                    self.failed(FailureStage::Execution, &e.to_string());
                }
            }
            self.session_cleanup = match harness.cleanup_session().await {
                Ok(()) => TeardownResult::Succeeded,
                Err(e) => {
                    self.failed(FailureStage::Teardown, &e.to_string());
                    TeardownResult::Failed
                }
            };
        } else if started {
            self.session_cleanup = TeardownResult::Succeeded;
        }
        self.check_workspace_at_end().await;
        self.record_egress().await;
        if !self.workspace_over {
            self.collect_commit().await;
        }
        self.destroy().await;
        if let Some((done, marker)) = marking {
            done.cancel();
            let _ = marker.await;
        }
        if started {
            self.evidence.time("teardown", t);
        }
        self.bound_evidence();
        self.phase.close();
        self.emit_teardown().await;
    }

    /// A stage shorter than this is not worth a commit of its own: a run
    /// stores that it reached harness start or teardown (whose events are
    /// held for a later write) only once the stage has lasted this long.
    /// A crash within it is recorded as during the stage before.
    const STAGE_STORED_AFTER: Duration = Duration::from_millis(250);

    /// Stores, once teardown has lasted [`Self::STAGE_STORED_AFTER`] (a
    /// capture, up to `[git] timeout_seconds`; a harness slow to end), that
    /// the run reached it: its sandbox's row becomes `destroying`, which
    /// recovery reads as "during teardown" (the `teardown` event is stored
    /// only at the end, with `finished`). A quick teardown writes nothing.
    /// Cancel the token and await the task when teardown is over: a write
    /// under way then ends before the run's last ones.
    fn mark_teardown(&self) -> Option<(CancellationToken, tokio::task::JoinHandle<()>)> {
        let id = self.phase.ready()?.sandbox.id.clone();
        let (engine, done) = (self.engine.clone(), CancellationToken::new());
        let over = done.clone();
        let marker = tokio::spawn(async move {
            tokio::select! {
                () = over.cancelled() => {}
                () = tokio::time::sleep(Self::STAGE_STORED_AFTER) => {
                    engine.store_sandbox_state(&id, SandboxState::Destroying).await;
                }
            }
        });
        Some((done, marker))
    }

    pub async fn emit_teardown(&mut self) {
        self.evidence.session_cleanup = self.session_cleanup;
        self.evidence.sandbox_destroy = self.sandbox_destroy;
        let event =
            EventKind::Teardown { session_cleanup: self.session_cleanup, sandbox_destroy: self.sandbox_destroy };
        // Stored with the next event: the run's `finished`, in its record's
        // transaction (or anything emitted before that).
        self.recorder.hold(event);
    }

    /// Brings the workspace's final state back: the capture runs inside the
    /// sandbox (snapshotting uncommitted work), and the bundle it wrote is
    /// fetched into the origin as `refs/corral/<subject-id>`. A failure is
    /// a teardown failure; the direct caller gets the reason.
    async fn collect_commit(&mut self) {
        let Some(ready) = self.phase.ready() else { return };
        let Some(base) = ready.base_commit.clone() else { return };
        let (backend, sandbox) = (ready.backend.clone(), ready.sandbox.clone());
        let git = ready.profile.file.git.clone();
        let name = self.recorder.subject().to_string();
        let private = self.engine.sandboxes_dir.join(format!("{}.bundle", sandbox.id));
        let job = CaptureJob {
            backend,
            sandbox: &sandbox,
            consumer: &self.consumer,
            git: &git,
            base: &base,
            origin: std::path::Path::new(&self.repo),
            name: &name,
            private: &private,
            locks: &self.engine.origin_locks,
            timeout: Duration::from_secs(self.engine.git.timeout_seconds),
            max_bundle_bytes: self.engine.git.max_bundle_bytes,
            room: crate::sandbox::workspace::OriginRoom {
                max_refs: self.engine.git.max_capture_refs,
                max_bytes: self.engine.git.max_origin_bytes,
            },
            stop: self.engine.grace_over(),
            // The operator is not a tenant: its runs are bounded by the
            // repository's budget alone.
            share: (self.consumer.principal != crate::auth::LOCAL_ADMIN).then(|| super::capture::PrincipalShare {
                store: &self.engine.store,
                principal: &self.consumer.principal,
                refs: self.engine.git.capture_refs_per_principal(),
            }),
        };
        let t = Instant::now();
        match job.run().await {
            Ok(captured) => {
                self.evidence.workspace_snapshot = captured.capture.snapshot;
                self.evidence.agent_commits = captured.capture.agent_commits;
                // Only what came back as refs/corral/<id>: a run that
                // changed nothing has no commit (not its base).
                self.evidence.commit_sha = captured.fetched;
            }
            Err(e) => {
                self.evidence
                    .notes
                    .push("the workspace could not be brought back; see the direct caller's error".into());
                self.failed(FailureStage::Teardown, &format!("workspace capture: {e}"));
            }
        }
        self.evidence.time("capture", t);
    }

    /// Destroys the sandbox; it is taken out first, so this runs at most
    /// once per sandbox.
    async fn destroy(&mut self) {
        // Not Ready: no sandbox to destroy (never made, or destroyed already).
        let Ok(ready) = self.phase.take_sandbox() else { return };
        let Ready { backend, sandbox, .. } = *ready;
        // Nothing of it can run once stopped: that is what the run reports.
        // Its uid, cgroup and files are given back after `finished`.
        let stopped = self.engine.stop_sandbox(backend.as_ref(), &sandbox).await;
        self.sandbox_destroy = match &stopped {
            Ok(()) => TeardownResult::Succeeded,
            Err(e) => {
                self.failed(FailureStage::Teardown, &e.to_string());
                TeardownResult::Failed
            }
        };
        self.reclaim = Some(self.engine.reclaim_later(backend, sandbox, stopped.is_ok()));
    }
}

/// The tool_call gate bound to one session's facts.
struct CoreGate {
    engine: Arc<Engine>,
    profile: Option<Arc<Profile>>,
    session_policies: Arc<Vec<Policy>>,
    consumer: Consumer,
    repo: String,
    sandbox: SandboxSpec,
    timeout_seconds: u64,
    tool_calls: Arc<AtomicU64>,
    /// The execution or session its approvals are filed under.
    subject: String,
    /// The run's event budget has cut an event (see `Core::budget_spent`).
    budget_spent: Arc<AtomicBool>,
}

impl ToolGate for CoreGate {
    fn check(&self, tool: &str, arguments: &Value) -> GateOutcome {
        self.decide(tool, arguments, true)
    }

    fn open_approval(&self) -> Option<crate::gate::approvals::Waiter> {
        Some(self.engine.approvals.open(&self.subject))
    }

    fn count_approved(&self) {
        self.tool_calls.fetch_add(1, Ordering::SeqCst);
    }
}

impl CoreGate {
    /// One decision; an allowed call is counted (`max_tool_calls`) when
    /// `counted`.
    fn decide(&self, tool: &str, arguments: &Value, counted: bool) -> GateOutcome {
        let profile_ref = self.profile.as_ref().map(|p| p.reference()).unwrap_or_default();
        let no_policies: &[Policy] = &[];
        let mut outcome = self.engine.gate.evaluate(&GateInput {
            phase: Phase::ToolCall,
            profile_ref: &profile_ref,
            actor: &self.consumer.actor,
            project: &self.consumer.project,
            repo: &self.repo,
            sandbox: &self.sandbox,
            limits: &self.profile.as_ref().map(|p| p.file.limits.sandbox()).unwrap_or_default(),
            timeout_seconds: self.timeout_seconds,
            tool,
            arguments,
            tool_calls: self.tool_calls.load(Ordering::SeqCst),
            session_policies: &self.session_policies,
            profile_policies: self.profile.as_ref().map(|p| p.policies.as_slice()).unwrap_or(no_policies),
            ungated_tool_calls: Default::default(),
            // Judged at agent_start, on the sandbox this call runs in.
            host_writes: crate::policy::HostWrites::Anywhere,
        });
        // Past the run's event budget its `approval_requested` would not be
        // recorded: nobody could see the call, let alone decide it. It is
        // denied now, saying why, rather than wait for nobody (fail closed).
        if outcome.action == Action::Ask && self.budget_spent.load(Ordering::SeqCst) {
            outcome.action = Action::Deny;
            outcome.decisions.push(PolicyDecision {
                policy: "event_budget".into(),
                source: "builtin".into(),
                action: Action::Deny,
                reason: "a person must approve this call, but the run's event budget (limits.max_events, \
                         limits.max_event_bytes) is spent: nobody would see the request"
                    .into(),
            });
        }
        if counted && outcome.action == Action::Allow {
            self.tool_calls.fetch_add(1, Ordering::SeqCst);
        }
        outcome
    }
}
