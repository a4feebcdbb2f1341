//! The lifecycle engine: accepts executions, runs each one on its own
//! supervised task (a client that disconnects does not stop it), and tears
//! down whatever it created, whatever failed.

mod admission;
mod capture;
mod core;
mod execution;
mod fit;
mod leftover;
mod limits;
mod phase;
mod place;
mod queue;
mod recovery;
mod resolve;
mod session;
mod uids;
mod warm;
mod watch;

pub use queue::missing_labels;
pub use resolve::Resolution;
pub use warm::unpoolable;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::records::{
    now_ms, ExecuteCommand, ExecutionRecord, ExecutionState, RawResult, SessionRecord, SessionState,
};
pub use recovery::RecoveryReport;
pub use session::{CreateSessionCommand, EndReason};
pub use watch::{Cut, Lagged, Subscription, WatchBounds, WatchPermit};

use crate::catalog::Catalog;
use crate::credentials::CredentialsConfig;
use crate::events::EventBus;
use crate::hub::Hub;
use crate::policy::Gate;
use crate::rein::Rein;
use crate::sandbox::{Backends, Consumer};
use crate::store::{ExecutionFilter, Inserted, Store, StoreError};
use crate::types::evidence::HubReportStatus;

/// Why the engine did not do what was asked. Each variant maps to one gRPC
/// status (see `api::status`); the message is safe to show the caller.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No execution or session has this id (the text names what was looked
    /// for).
    #[error("{0} not found")]
    NotFound(String),
    /// The request id is already taken by a different request (inside the
    /// engine, a session id too; `create_session` answers that as
    /// [`EngineError::SessionExists`]).
    #[error("request_id {0} is already used by a different request")]
    AlreadyExists(String),
    /// The session id is taken: a session with it is starting, running or
    /// has ended (the stored id).
    #[error("session_id {0} is already taken by another session")]
    SessionExists(String),
    /// The daemon is shutting down and accepts no new work, or the work could
    /// not be started.
    #[error("{0}")]
    Unavailable(String),
    /// A watch asked to start before the oldest event compaction kept.
    #[error("sequence {requested} is older than retention; oldest available is {oldest}")]
    OutOfRange {
        /// The sequence the watch asked to start after.
        requested: u64,
        /// The oldest sequence still stored.
        oldest: u64,
    },
    /// A watch asked to start after an event not yet stored.
    #[error("after_sequence {requested} is past the last event stored, {last}")]
    PastEnd {
        /// The sequence the watch asked to start after.
        requested: u64,
        /// The last sequence stored.
        last: u64,
    },
    /// Resolution refused a session (rule 1); the reason is the daemon's.
    #[error("{0}")]
    Refused(String),
    /// A session's agent_start gate denied it: the deciding policy and its
    /// reason.
    #[error("agent_start denied by policy {policy}: {reason}")]
    AgentStartDenied {
        /// The policy that denied it.
        policy: String,
        /// Why, in the policy's words.
        reason: String,
    },
    /// A session could not be opened; `raw` is for the direct caller.
    #[error("{}", stage.session_error())]
    StageFailed {
        /// The stage that failed.
        stage: crate::types::evidence::FailureStage,
        /// The raw error, for the direct caller only.
        raw: String,
    },
    /// The subject is not in a state that allows the request (a session that
    /// ended, a turn already in flight).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The caller may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// Admission control: too much running already; retry later.
    #[error("{0}")]
    Overloaded(String),
    /// No active node of the fleet with capacity has the labels the work
    /// needs: it is refused, not queued for nobody.
    #[error("{0}")]
    NoNodeCanRun(String),
    /// Another node of the fleet runs it and did not answer a forwarded
    /// request in time (it may be lost; a survivor will fail its runs).
    #[error("node {node:?} did not answer within {seconds} s; {outcome}")]
    NodeUnreachable {
        /// The node that runs it.
        node: String,
        /// How long it was waited for.
        seconds: u64,
        /// What became of the request ([`WITHDRAWN`] or [`TAKEN`]).
        outcome: &'static str,
    },
    /// The store failed; the details are logged, not sent.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What `submit` gives back.
pub struct Submitted {
    /// The execution as stored: the new one, or the one that already held the
    /// request id.
    pub record: ExecutionRecord,
    /// The live stream for the direct caller; for an existing execution
    /// (same request id), a replay of its stored events instead.
    pub subscription: Subscription,
    /// Whether the request id was already used by the same request, so no new
    /// execution was started.
    pub existing: bool,
    /// With `cancel_on_disconnect`: cancels the execution if this answer is
    /// dropped before the caller's stream takes over (see [`CancelUnlessKept`]).
    pub unless_kept: Option<CancelUnlessKept>,
}

/// Cancels an execution whose caller asked for `cancel_on_disconnect` when
/// dropped unkept: the caller went away while its submit was under way on
/// the engine's task, so the answer was never read (or was dropped before
/// the stream that cancels on a disconnect was built).
pub struct CancelUnlessKept {
    engine: Option<Arc<Engine>>,
    execution_id: String,
}

impl CancelUnlessKept {
    /// The caller's stream has taken over: nothing is cancelled on drop.
    pub fn keep(mut self) {
        self.engine = None;
    }
}

impl Drop for CancelUnlessKept {
    fn drop(&mut self) {
        let Some(engine) = self.engine.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let id = std::mem::take(&mut self.execution_id);
        tracing::info!(execution_id = %id, "caller went away while its execution was submitted; cancelling as asked");
        runtime.spawn(async move {
            let _ = engine.cancel(&id).await;
        });
    }
}

/// The lifecycle engine: what every execution and session runs through, from
/// admission to teardown. One per daemon, shared behind an `Arc`.
pub struct Engine {
    /// The harness profiles executions and sessions resolve.
    pub catalog: Arc<Catalog>,
    /// The policy gate.
    pub gate: Arc<Gate>,
    /// The sandbox backends, by type.
    pub backends: Backends,
    /// The rein adapters, by kind (the `rein.kind` a profile names).
    pub reins: HashMap<String, Arc<dyn Rein>>,
    /// The record of executions, sessions and their events.
    pub store: Store,
    /// Live events of running subjects, for watchers.
    pub bus: Arc<EventBus>,
    sandboxes_dir: PathBuf,
    /// One fetch back into a repository at a time.
    origin_locks: crate::sandbox::workspace::OriginLocks,
    /// Identifies this daemon instance in the sandbox rows it writes.
    epoch: String,
    /// Where finished executions are reported; `None` when no hub is
    /// configured.
    pub hub: Option<Arc<Hub>>,
    /// The credential routes the daemon's gateway presents to sandboxes.
    pub credentials: Arc<CredentialsConfig>,
    /// Host uids for sandboxes, when the daemon is root and gives each its own.
    pub uid_range: Option<crate::sandbox::UidRange>,
    /// The workspace capture at the end of a run.
    pub git: crate::config::GitConfig,
    /// What all sandboxes' egress proxies may hold open together.
    pub proxy_budget: Arc<crate::net::ProxyBudget>,
    /// The hook helper bound into Codex's sandboxes (see `gate`).
    pub hook_program: Option<PathBuf>,
    /// Tool calls waiting for a person's decision.
    pub approvals: Arc<crate::gate::approvals::Approvals>,
    /// This node's `repo_roots` and the principals in force: a run's
    /// repository is checked against them where it runs (see
    /// [`Engine::repo_here`]).
    repos: RepoRules,
    admission: admission::Admission,
    /// Bounds on open watch streams.
    watchers: Arc<watch::Watchers>,
    /// Stored events read back in pages shared by every subscriber.
    pub(crate) event_pages: Arc<watch::EventPages>,
    /// The largest message the server sends: `finished` events fit in it.
    max_message_bytes: usize,
    sessions: Mutex<HashMap<String, Arc<session::LiveSession>>>,
    /// The sandbox a run's task held when it panicked, by run: a warm one
    /// taken is named in its row only by the run's next write, so
    /// [`Engine::recover_panicked`] finds it here.
    pub(super) panicked: Mutex<HashMap<String, String>>,
    tasks: TaskTracker,
    /// Cancelled by [`Engine::start_draining`]: whoever reports this node's
    /// health learns that it takes no new work, whatever drained it.
    drain_started: CancellationToken,
    /// Cancelled when this node stops (a shutdown, a fence): a drain alone
    /// still finishes what it runs, its sessions' turns and reaping too.
    stopping: CancellationToken,
    draining: CancellationToken,
    /// The sandboxes that exist now, so a fenced node can kill what runs in
    /// them without the store (see [`Engine::fence`]).
    live_sandboxes: Mutex<std::collections::HashSet<String>>,
    /// Set by [`Engine::fence`]: a fenced start does not leave the fleet as
    /// `stopped` at shutdown; its lease runs out.
    fenced: std::sync::atomic::AtomicBool,
    /// Watchers of runs on other nodes, woken by the store's NOTIFY.
    wakeups: watch::Wakeups,
    /// This node's part in the fleet's queue (shared stores).
    fleet: queue::FleetRoom,
    /// Sandboxes made ahead of requests (`[sandbox] warm`).
    warm: warm::Warm,
    /// How many stopped sandboxes are being given back now.
    reclaiming: tokio::sync::watch::Sender<usize>,
}

/// How long a node waits for another node's answer to a forwarded request.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// A forwarded request its node had not taken in time: withdrawn, so that
/// no later start of the work surprises a caller told it failed.
pub const WITHDRAWN: &str = "the request is withdrawn: nothing was done there";

/// A forwarded request its node took but did not answer in time.
pub const TAKEN: &str = "it took the request and may still act on it: watch the subject for what it did";

/// What [`Engine::new`] is built from: the daemon's parts and its bounds.
pub struct EngineParts {
    /// The harness profiles.
    pub catalog: Arc<Catalog>,
    /// The policy gate.
    pub gate: Arc<Gate>,
    /// The sandbox backends.
    pub backends: Backends,
    /// The rein adapters, by kind.
    pub reins: HashMap<String, Arc<dyn Rein>>,
    /// The store.
    pub store: Store,
    /// The daemon's data directory; sandboxes live in its `sandboxes`
    /// subdirectory.
    pub data_dir: PathBuf,
    /// How many events a watcher may fall behind before it is ended (at least
    /// 16).
    pub bus_capacity: usize,
    /// The hub reports go to, if one is configured.
    pub hub: Option<Arc<Hub>>,
    /// The credential routes.
    pub credentials: Arc<CredentialsConfig>,
    /// How many executions may run at once (at least 1).
    pub max_running: usize,
    /// How many sessions may be open at once (at least 1).
    pub max_sessions: usize,
    /// How many watchers one execution or session, one principal, and all
    /// together may have.
    pub watch_bounds: WatchBounds,
    /// The largest message the server sends, in bytes: the raw output of a
    /// `finished` event is cut to fit it.
    pub max_message_bytes: usize,
    /// Host uids for sandboxes, when the daemon is root and gives each its own.
    pub uid_range: Option<crate::sandbox::UidRange>,
    /// The workspace capture at the end of a run.
    pub git: crate::config::GitConfig,
    /// What all sandboxes' egress proxies may hold open together.
    pub proxy_budget: Arc<crate::net::ProxyBudget>,
    /// The hook helper bound into Codex's sandboxes; `None` when there is none.
    pub hook_program: Option<PathBuf>,
    /// Executions this node runs at once on a shared store (at most
    /// `max_running`; 0: it only accepts and queues).
    pub capacity: usize,
    /// What this node can run (`fleet::labels`).
    pub labels: Vec<String>,
    /// The most executions the fleet's queue holds, and one principal may
    /// have in it.
    pub max_queued: (u64, u64),
    /// How many warm sandboxes to keep, by profile reference.
    pub warm: std::collections::BTreeMap<String, usize>,
    /// The daemon's `repo_roots`.
    pub repo_roots: Vec<PathBuf>,
    /// The principals in force (replaced on SIGHUP).
    pub principals: Arc<crate::auth::Principals>,
}

/// What a repository is checked against on the node that runs the work.
struct RepoRules {
    roots: Vec<PathBuf>,
    principals: Arc<crate::auth::Principals>,
}

impl Engine {
    /// The engine, with no work yet; a fresh epoch names this instance in the
    /// sandbox rows it writes.
    pub fn new(parts: EngineParts) -> Arc<Engine> {
        let event_pages = watch::EventPages::new(parts.store.clone());
        let epoch = parts.store.epoch().to_string();
        Arc::new(Engine {
            catalog: parts.catalog,
            gate: parts.gate,
            backends: parts.backends,
            reins: parts.reins,
            store: parts.store,
            bus: Arc::new(EventBus::new(parts.bus_capacity)),
            sandboxes_dir: parts.data_dir.join("sandboxes"),
            origin_locks: Default::default(),
            epoch,
            hub: parts.hub,
            credentials: parts.credentials,
            uid_range: parts.uid_range,
            git: parts.git,
            proxy_budget: parts.proxy_budget,
            hook_program: parts.hook_program,
            approvals: Arc::default(),
            repos: RepoRules { roots: parts.repo_roots, principals: parts.principals },
            // `fleet.capacity` bounds what runs here (at most max_running).
            admission: admission::Admission::new(parts.capacity.min(parts.max_running), parts.max_sessions),
            watchers: watch::Watchers::new(parts.watch_bounds),
            event_pages,
            max_message_bytes: parts.max_message_bytes,
            sessions: Mutex::new(HashMap::new()),
            panicked: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            drain_started: CancellationToken::new(),
            stopping: CancellationToken::new(),
            draining: CancellationToken::new(),
            live_sandboxes: Mutex::default(),
            fenced: Default::default(),
            wakeups: watch::Wakeups::default(),
            fleet: queue::FleetRoom::new(parts.capacity.min(parts.max_running), parts.labels, parts.max_queued),
            warm: warm::Warm::new(&parts.warm),
            reclaiming: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Another node stored events of `subject`: its watchers here read them.
    pub fn wake_watchers(&self, subject: &str) {
        self.wakeups.wake(subject);
    }

    /// Returns once no stopped sandbox is still being given back (its uid,
    /// cgroup and files): a run's `finished` does not wait for that.
    pub async fn reclaimed(&self) {
        let _ = self.reclaiming.subscribe().wait_for(|n| *n == 0).await;
    }

    /// Executions and sessions running now.
    pub fn running(&self) -> usize {
        self.admission.running(admission::Work::Execution) + self.admission.running(admission::Work::Session)
    }

    /// Notes that sandbox `id` exists (`true`) or is gone (`false`).
    pub(crate) fn sandbox_alive(&self, id: &str, alive: bool) {
        let mut live = self.live_sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        match alive {
            true => live.insert(id.to_string()),
            false => live.remove(id),
        };
    }

    /// This node lost its lease: refuse new work and kill every process of
    /// every sandbox at once, without the store (which may be the thing
    /// out of reach). Returns how many processes were killed. What is left
    /// on disk and in the store, its next start recovers.
    pub async fn fence(&self) -> usize {
        self.fenced.store(true, std::sync::atomic::Ordering::SeqCst);
        self.stopping.cancel();
        self.start_draining();
        self.draining.cancel();
        // The warm pools first, so that no run takes one of their sandboxes
        // and no death is taken for a waiter's own (which destroys through
        // the store); their waiters carry no sandbox id in their
        // environment, so they are stopped through the handles the pools held.
        let mut killed = self.abandon_warm_pools().await;
        let ids: Vec<String> = self.live_sandboxes.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
        let scope = leftover::SignalScope::new(self.uid_range);
        for id in ids {
            killed += leftover::kill_sandbox_processes(&id, scope).await;
        }
        killed
    }

    /// Gives an execution's or a session's admission slot back.
    pub(crate) fn release(&self, id: &str) {
        self.admission.release(id);
        // Room here: queued work may be claimed, a warm pool refilled.
        self.fleet.wake.notify_one();
        self.wake_held_back_fillers();
    }

    /// Accepts an execution and starts it on its own task. The same
    /// request id with the same request returns the existing execution.
    ///
    /// Everything after the admission slot is reserved runs on the engine's
    /// own task: a caller that goes away (a disconnect, its deadline) drops
    /// this future, never a half-stored execution or a slot still held.
    pub async fn submit(self: &Arc<Self>, cmd: ExecuteCommand) -> Result<Submitted, EngineError> {
        if self.is_draining() {
            // A retry gets its execution, draining or not (a caller whose
            // answer was lost would otherwise never learn it).
            return self.refused_unless_retry(&cmd, EngineError::Unavailable(DRAINING.into())).await;
        }
        if self.store.is_shared() {
            return self.submit_to_fleet(cmd).await;
        }
        let execution_id = uuid::Uuid::now_v7().to_string();
        // Reserved before anything is stored; every path below that does not
        // start the execution gives the slot back.
        let cancel = match self.admission.reserve(&execution_id, admission::Work::Execution, &cmd.principal, cmd.quota)
        {
            Ok(cancel) => cancel,
            // The slot a retry's execution holds (or the quota it fills) is
            // no reason to refuse it.
            Err(refused) => return self.refused_unless_retry(&cmd, EngineError::Overloaded(refused.0)).await,
        };
        let (answer, submitted) = tokio::sync::oneshot::channel();
        let engine = self.clone();
        let span = execution_span(&execution_id, cmd.traceparent.as_deref());
        self.tasks.spawn(tracing::Instrument::instrument(
            async move { engine.accept(execution_id, cmd, cancel, answer).await },
            span,
        ));
        submitted.await.unwrap_or_else(|_| Err(EngineError::Unavailable("the execution was not accepted".into())))
    }

    /// A new execution's record, as accepted (stored `running` when it
    /// starts at once, `pending` when it is queued).
    fn new_record(&self, execution_id: &str, cmd: &ExecuteCommand, state: ExecutionState) -> ExecutionRecord {
        let mut record = ExecutionRecord {
            execution_id: execution_id.to_string(),
            request_id: cmd.request_id.clone(),
            state,
            harness_profile_ref: cmd.harness_profile_ref.clone(),
            title: cmd.title.clone(),
            repo: cmd.repo.clone(),
            consumer: Consumer {
                actor: cmd.actor.clone(),
                project: cmd.project.clone(),
                run_id: execution_id.to_string(),
                session_id: String::new(),
                principal: cmd.principal.clone(),
            },
            correlation_id: cmd.correlation_id.clone(),
            assignment_ref: cmd.assignment_ref.clone(),
            report_to_hub: cmd.report_to_hub,
            created_at_ms: now_ms(),
            ..ExecutionRecord::default()
        };
        // Listed under its pinned reference from the start (the row's
        // `profile_ref` column, see `store::stored::profile_column`), not
        // only once it has ended: resolved here from the catalog in memory,
        // with no store write of its own. Resolution proper (rule 1) is the
        // run's: `run_here` clears this, and the run sets it again.
        if !cmd.harness_profile_ref.contains('@') && crate::catalog::check_actor(&cmd.actor).is_ok() {
            if let Ok(profile) = self.catalog.resolve(&cmd.harness_profile_ref) {
                record.evidence.profile_ref = profile.reference();
            }
        }
        record.evidence.request_id = cmd.request_id.clone();
        record.evidence.correlation_id = cmd.correlation_id.clone();
        record.evidence.assignment_ref = cmd.assignment_ref.clone();
        record.evidence.hub_report_status = match (cmd.report_to_hub, self.hub.is_some()) {
            (false, _) => HubReportStatus::NotRequested,
            (true, true) => HubReportStatus::Pending,
            (true, false) => {
                record.evidence.notes.push("report_to_hub was asked but no hub is configured".into());
                HubReportStatus::Failed
            }
        };
        record
    }

    /// Stores an admitted execution, answers the caller, and runs it.
    async fn accept(
        self: Arc<Self>,
        execution_id: String,
        cmd: ExecuteCommand,
        cancel: CancellationToken,
        answer: tokio::sync::oneshot::Sender<Result<Submitted, EngineError>>,
    ) {
        let record = self.new_record(&execution_id, &cmd, ExecutionState::Running);
        // Subscribe before the execution runs, so the caller sees event 1.
        let live = self.bus.open(&execution_id);
        match self.store.insert_execution(&record, &cmd.digest()).await {
            Ok(Inserted::Created) => {}
            Ok(Inserted::Existing { record, digest }) => {
                self.bus.close(&execution_id);
                self.release(&execution_id);
                let _ = answer.send(self.existing(*record, &digest, &cmd).await);
                return;
            }
            Err(e) => {
                self.bus.close(&execution_id);
                self.release(&execution_id);
                let _ = answer.send(Err(e.into()));
                return;
            }
        }
        let subscription = Subscription::live(live, true).catching_up(
            self.event_pages.clone(),
            record.execution_id.clone(),
            self.bus.capacity(),
        );
        // The caller may be gone already; the execution runs regardless.
        let unless_kept = self.unless_kept(&cmd, &execution_id);
        let _ = answer.send(Ok(Submitted { record: record.clone(), subscription, existing: false, unless_kept }));
        self.run_here(record, cmd, cancel).await;
    }

    /// The guard that cancels `execution_id` if its caller, which asked for
    /// `cancel_on_disconnect`, never takes the answer.
    pub(super) fn unless_kept(self: &Arc<Self>, cmd: &ExecuteCommand, execution_id: &str) -> Option<CancelUnlessKept> {
        cmd.cancel_on_disconnect
            .then(|| CancelUnlessKept { engine: Some(self.clone()), execution_id: execution_id.to_string() })
    }

    /// What a request whose id is already taken gets, when it is the same
    /// request: the execution that holds it, with its stream for an
    /// `Execute` retry. The stream replays the stored events from the
    /// oldest one kept (compaction keeps at least `finished`), then follows
    /// live ones; its `finished` carries the raw result while the store
    /// keeps it, as the first caller's did (request ids are per principal:
    /// the one retrying is the owner). It counts against no watch bound
    /// here: a `StartExecution` retry drops it unread, and `Execute` counts
    /// it (see [`Engine::counted`]).
    async fn existing(
        self: &Arc<Self>,
        record: ExecutionRecord,
        digest: &str,
        cmd: &ExecuteCommand,
    ) -> Result<Submitted, EngineError> {
        if digest != cmd.digest() {
            return Err(EngineError::AlreadyExists(cmd.request_id.clone()));
        }
        let id = record.execution_id.clone();
        let live = self.bus.subscribe(&id);
        let bounds = self.store.sequence_bounds(&id).await?;
        let after = bounds.map_or(0, |(oldest, _)| oldest.saturating_sub(1));
        let subscription = self.follow(&id, after, live).await?.for_direct_caller(self.store.clone(), id);
        let unless_kept = self.unless_kept(cmd, &record.execution_id);
        Ok(Submitted { record, subscription, existing: true, unless_kept })
    }

    /// `subscription` of `subject`, counted against the watch bounds (and
    /// `principal`'s) while it lives: for a stream the caller keeps open
    /// that is not the direct caller's of a new run (an `Execute` retry's).
    pub fn counted(
        &self,
        subscription: Subscription,
        subject: &str,
        principal: &str,
    ) -> Result<Subscription, EngineError> {
        Ok(subscription.holding(self.watch_place(subject, principal)?))
    }

    /// Runs a stored execution that holds an admission slot here (its bus
    /// open), then closes its bus and gives the slot back.
    async fn run_here(self: &Arc<Self>, mut record: ExecutionRecord, cmd: ExecuteCommand, cancel: CancellationToken) {
        let execution_id = record.execution_id.clone();
        // What `new_record` looked up to list it by; the evidence says
        // what the run's own resolution decides (nothing, when it refuses).
        record.evidence.profile_ref.clear();
        // A shutdown past its grace cancels it too. The link ends with the
        // run: one left per finished run would pile up until the shutdown.
        let draining = self.draining.clone();
        let slot = cancel.clone();
        let past_grace = tokio::spawn(async move {
            tokio::select! { _ = draining.cancelled() => slot.cancel(), _ = slot.cancelled() => {} }
        });
        // In a task of its own, so that a panic (a bug) ends the run as a
        // crash would, not with it held `running` and its sandbox alive;
        // in the run's span, as a task does not inherit its spawner's.
        let run = execution::run(self.clone(), record, cmd, cancel);
        let run = tokio::spawn(tracing::Instrument::instrument(run, tracing::Span::current()));
        if let Err(e) = run.await {
            tracing::error!(execution_id = %execution_id, error = %e, "an execution's task failed; recovering it");
            if let Err(e) = self.recover_panicked(&execution_id).await {
                tracing::error!(execution_id = %execution_id, error = %e, "a failed execution task not recovered");
            }
        }
        past_grace.abort();
        self.bus.close(&execution_id);
        self.release(&execution_id);
    }

    /// The stored execution with this id.
    pub async fn get(&self, execution_id: &str) -> Result<ExecutionRecord, EngineError> {
        self.store
            .get_execution(execution_id)
            .await?
            .ok_or_else(|| EngineError::NotFound(format!("execution {execution_id}")))
    }

    /// The stored raw result of a finished execution (scrubbed), if kept.
    pub async fn raw(&self, execution_id: &str) -> Result<Option<RawResult>, EngineError> {
        let raw = self.store.get_raw(execution_id).await?;
        Ok(raw.map(|(tool_output, tool_error)| RawResult { tool_output, tool_error }))
    }

    /// The stored executions that match `filter`, newest first.
    pub async fn list(&self, filter: &ExecutionFilter) -> Result<Vec<ExecutionRecord>, EngineError> {
        Ok(self.store.list_executions(filter).await?)
    }

    /// Asks a running execution to stop; idempotent. Returns the record as
    /// it is now (the execution reports `cancelled` when its teardown is
    /// done).
    pub async fn cancel(self: &Arc<Self>, execution_id: &str) -> Result<ExecutionRecord, EngineError> {
        let record = self.get(execution_id).await?;
        let unfinished = matches!(record.state, ExecutionState::Pending | ExecutionState::Running);
        if self.cancel_here(execution_id).await || !unfinished || !self.store.is_shared() {
            return Ok(record);
        }
        // Still in the fleet's queue: out of it, and finished here.
        if record.state == ExecutionState::Pending && self.store.cancel_queued(execution_id).await? {
            return self.cancel_unclaimed(record).await;
        }
        // Another node of the fleet runs it: the request goes to that node
        // through the store, and its answer comes back.
        let node = self.store.node_of_execution(execution_id).await?.unwrap_or_default();
        if node == self.store.node() {
            self.cancel_here(execution_id).await;
        } else if !node.is_empty() {
            match self.forward(&node, "cancel", execution_id).await {
                Ok(answer) => return Ok(serde_json::from_str(&answer).map_err(StoreError::from)?),
                // It finished there before the request was read: the
                // finished record, as the owner itself would answer.
                Err(EngineError::FailedPrecondition(why)) => {
                    let now = self.get(execution_id).await?;
                    return if now.state.is_terminal() { Ok(now) } else { Err(EngineError::FailedPrecondition(why)) };
                }
                Err(e) => return Err(e),
            }
        }
        self.get(execution_id).await
    }

    /// Asks node `node` to do `kind` (`cancel`, `end_session`,
    /// `cancel_turn`) to
    /// `subject` and waits for its answer (the record as the owner returns
    /// it, as JSON), at most [`FORWARD_TIMEOUT`].
    pub(crate) async fn forward(&self, node: &str, kind: &str, subject: &str) -> Result<String, EngineError> {
        Ok(self.forward_with(node, kind, subject, "").await?.1)
    }

    /// [`Engine::forward`] with a payload (JSON); returns the request's id
    /// with the answer.
    pub(crate) async fn forward_with(
        &self,
        node: &str,
        kind: &str,
        subject: &str,
        payload: &str,
    ) -> Result<(String, String), EngineError> {
        self.forward_for(node, kind, subject, payload, FORWARD_TIMEOUT).await
    }

    /// [`Engine::forward_with`] waiting up to `timeout` for the answer.
    pub(crate) async fn forward_for(
        &self,
        node: &str,
        kind: &str,
        subject: &str,
        payload: &str,
        timeout: Duration,
    ) -> Result<(String, String), EngineError> {
        let request = self.store.ask_node(node, kind, subject, payload).await?;
        let started = std::time::Instant::now();
        let mut deadline = started + timeout;
        let mut taken = false;
        loop {
            match self.store.request_answer(&request).await? {
                Some(Ok(json)) => return Ok((request, json)),
                Some(Err(why)) => return Err(EngineError::FailedPrecondition(why)),
                None if std::time::Instant::now() < deadline => tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                    // Past a shutdown's grace, which waits for this task,
                    // nothing waits on another node any more.
                    () = self.draining.cancelled() => deadline = std::time::Instant::now(),
                },
                // Not taken yet: withdrawn, so the owner never acts on it
                // (it takes a request before acting, see `answer_requests`).
                None if !taken && self.store.withdraw_request(&request).await? => {
                    let seconds = started.elapsed().as_secs();
                    return Err(EngineError::NodeUnreachable { node: node.to_string(), seconds, outcome: WITHDRAWN });
                }
                // Taken (or answered just now): it is being done; its
                // answer is waited for as long again.
                None if !taken => {
                    taken = true;
                    let again = if self.draining.is_cancelled() { Duration::ZERO } else { timeout };
                    deadline = std::time::Instant::now() + again;
                }
                None => {
                    let seconds = started.elapsed().as_secs();
                    return Err(EngineError::NodeUnreachable { node: node.to_string(), seconds, outcome: TAKEN });
                }
            }
        }
    }

    /// Decides a tool call waiting for a person: here, or (on a fleet) on
    /// the node that runs (or ran) the execution or session, through the
    /// store.
    pub async fn decide_tool_call(
        &self,
        subject: &str,
        call_id: &str,
        decision: crate::gate::approvals::Decision,
    ) -> Result<Result<(), crate::gate::approvals::Undecidable>, EngineError> {
        use crate::gate::approvals::Undecidable;
        match self.approvals.decide(subject, call_id, decision.clone()) {
            Err(Undecidable::Unknown) if self.store.is_shared() => {}
            decided => return Ok(decided),
        }
        let node = match self.store.node_of_execution(subject).await? {
            Some(node) => node,
            None => self.store.node_of_session(subject).await?.unwrap_or_default(),
        };
        if node.is_empty() || node == self.store.node() {
            return Ok(Err(Undecidable::Unknown));
        }
        // A finished run's owner still tells a call decided already (or no
        // longer waiting) from one it never had: it is asked, as for a
        // running one, so every node answers as it does. An owner stopped or
        // lost since has forgotten its calls (they live in its memory), as
        // it would say itself once restarted: unknown, without waiting for a
        // node that will not answer.
        if self.is_terminal(subject).await? && !self.in_fleet(&node).await? {
            return Ok(Err(Undecidable::Unknown));
        }
        let payload = serde_json::json!({
            "call_id": call_id, "allow": decision.allow, "by": decision.by, "reason": decision.reason,
        });
        let (_, answer) = self.forward_with(&node, "decide_tool_call", subject, &payload.to_string()).await?;
        Ok(match answer.as_str() {
            "\"decided\"" => Ok(()),
            "\"settled\"" => Err(Undecidable::Settled),
            _ => Err(Undecidable::Unknown),
        })
    }

    /// Whether node `node` is in the fleet now: active or draining, neither
    /// stopped nor lost, and its lease not run out (one that crashed is
    /// marked lost only by the next sweep).
    async fn in_fleet(&self, node: &str) -> Result<bool, EngineError> {
        let nodes = self.store.list_nodes().await?;
        let now = crate::records::now_ms();
        Ok(nodes.iter().any(|n| n.name == node && queue::answers(n, now)))
    }

    /// A decision another node was sent for a tool call waiting here.
    fn answer_decision(&self, subject: &str, payload: &str) -> Result<String, String> {
        #[derive(serde::Deserialize)]
        struct Decided {
            call_id: String,
            allow: bool,
            by: String,
            reason: String,
        }
        let d: Decided = serde_json::from_str(payload).map_err(|e| format!("a decide_tool_call request: {e}"))?;
        let decision = crate::gate::approvals::Decision { allow: d.allow, by: d.by, reason: d.reason };
        Ok(match self.approvals.decide(subject, &d.call_id, decision) {
            Ok(()) => "\"decided\"",
            Err(crate::gate::approvals::Undecidable::Settled) => "\"settled\"",
            Err(crate::gate::approvals::Undecidable::Unknown) => "\"unknown\"",
        }
        .to_string())
    }

    /// Answers what other nodes asked of this one (see [`Engine::forward`]):
    /// a cancel of an execution, or the end of a session, that runs here is
    /// done as if it had been sent here.
    pub async fn answer_requests(self: &Arc<Self>) {
        let pending = match self.store.pending_requests().await {
            Ok(pending) => pending,
            Err(e) => return tracing::warn!(error = %e, "fleet: cannot read requests for this node"),
        };
        for crate::store::NodeRequest { id, kind, subject, payload } in pending {
            // Taken before anything is done: a request its sender withdrew
            // (it gave up waiting) is never acted on, and none twice.
            match self.store.take_request(&id).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, request = %id, "fleet: a request not taken");
                    continue;
                }
            }
            let answer = match kind.as_str() {
                "create_session" => {
                    self.answer_create(id, subject, payload);
                    continue;
                }
                "send_turn" if self.live_session(&subject).is_some() => self.answer_turn(&id, &subject, &payload).await,
                "send_turn" => Err(format!("session {subject} is not running on node {}", self.store.node())),
                "decide_tool_call" => self.answer_decision(&subject, &payload),
                "cancel" if self.cancel_here(&subject).await => match self.get(&subject).await {
                    Ok(record) => serde_json::to_string(&record).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                "cancel" => Err(format!("execution {subject} is not running on node {}", self.store.node())),
                // Ended in a task of its own: an end that lasts (its
                // harness's grace, its capture) holds up no other request,
                // and a shutdown waits for it.
                "end_session" if self.live_session(&subject).is_some() || self.starting_here(&subject) => {
                    let engine = self.clone();
                    self.spawn_tracked(async move {
                        let ended = engine.end_session_with_cause(&subject, session::EndReason::Requested);
                        let answer = match ended.await {
                            Ok((record, cause)) => Self::ended_answer(&record, cause.as_deref()),
                            Err(e) => Err(e.to_string()),
                        };
                        if let Err(e) = engine.store.answer_request(&id, answer).await {
                            tracing::warn!(error = %e, request = %id, "fleet: a request not answered");
                        }
                    });
                    continue;
                }
                "end_session" => Err(format!("session {subject} is not running on node {}", self.store.node())),
                "cancel_turn" if self.live_session(&subject).is_some() => match self.cancel_turn(&subject).await {
                    Ok(record) => serde_json::to_string(&record).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                "cancel_turn" => Err(format!("session {subject} is not running on node {}", self.store.node())),
                other => Err(format!("node {} does not know requests of kind {other:?}", self.store.node())),
            };
            if let Err(e) = self.store.answer_request(&id, answer).await {
                tracing::warn!(error = %e, request = %id, "fleet: a request not answered");
            }
        }
    }

    /// Replays stored events of an execution or a session after `after`,
    /// then follows live ones. Counted against the watch bounds, and
    /// against `principal`'s (see [`Engine::watch_place`]).
    pub async fn watch(&self, execution_id: &str, after: u64, principal: &str) -> Result<Subscription, EngineError> {
        let place = self.watch_place(execution_id, principal)?;
        self.watch_holding(execution_id, after, place).await
    }

    /// [`Engine::watch`] in a place already taken.
    pub(super) async fn watch_holding(
        &self,
        execution_id: &str,
        after: u64,
        permit: WatchPermit,
    ) -> Result<Subscription, EngineError> {
        // Subscribe before reading the store: an event is stored before it
        // is published, so every event is in one or the other.
        let live = self.bus.subscribe(execution_id);
        let bounds = self.store.sequence_bounds(execution_id).await?;
        if let Some((oldest, last)) = bounds {
            if after.saturating_add(1) < oldest {
                return Err(EngineError::OutOfRange { requested: after, oldest });
            }
            // An event is stored before anyone sees it: a caller cannot
            // have seen one past the last stored, and would wait for
            // events it says it has (a `finished` among them) forever.
            if after > last {
                return Err(EngineError::PastEnd { requested: after, last });
            }
        }
        let subscription = self.follow(execution_id, after, live).await?;
        // Nothing stored yet (a run still queued, or one whose first
        // events are held for its sandbox's row): none was seen either.
        // After `follow`, so an unknown subject is NOT_FOUND.
        if bounds.is_none() && after > 0 {
            return Err(EngineError::PastEnd { requested: after, last: 0 });
        }
        Ok(subscription.holding(permit))
    }

    /// The stored events of `execution_id` after `after`, then the live
    /// ones of `live` (subscribed before this reads the store), or of the
    /// store when it runs on another node.
    async fn follow(
        &self,
        execution_id: &str,
        after: u64,
        live: Option<tokio::sync::broadcast::Receiver<crate::events::BusItem>>,
    ) -> Result<Subscription, EngineError> {
        // The first page; the subscription reads the rest as it goes.
        let replay = self.event_pages.between(execution_id, after, u64::MAX).await?;
        if replay.is_empty()
            && live.is_none()
            && self.store.get_execution(execution_id).await?.is_none()
            && self.store.get_session(execution_id).await?.is_none()
        {
            return Err(EngineError::NotFound(execution_id.to_string()));
        }
        // Not live here and not finished: it runs on another daemon sharing
        // the store (or its owner is gone and will recover it on restart),
        // or here, its events not open yet (a session stored a moment
        // before its start opens them): followed through the store, never
        // ended with no `finished`.
        let remote = live.is_none()
            && !replay.last().is_some_and(|e| e.kind.is_finished())
            && !self.is_terminal(execution_id).await?;
        let subscription = Subscription::replay_then_live(replay, live, after).catching_up(
            self.event_pages.clone(),
            execution_id.to_string(),
            self.bus.capacity(),
        );
        Ok(match remote {
            true => {
                subscription.polling(self.store.clone(), execution_id.to_string(), self.wakeups.waiter(execution_id))
            }
            false => subscription,
        })
    }

    /// A watch place for `subject`, counted for `principal` (unless it is
    /// the local administrator: the operator, not a tenant). Taken before
    /// work is queued or forwarded, so a caller refused for want of one
    /// leaves nothing behind it.
    pub(super) fn watch_place(&self, subject: &str, principal: &str) -> Result<WatchPermit, EngineError> {
        let tenant = (principal != crate::auth::LOCAL_ADMIN).then_some(principal);
        self.watchers.admit(subject, tenant).map_err(EngineError::Overloaded)
    }

    /// The direct caller's stream of an execution this node has just
    /// queued, holding the place taken for it (none for a caller with no
    /// stream): it follows the store from the first event, with none of
    /// the lookups a watch of an unknown subject needs.
    pub(super) fn watch_queued(&self, execution_id: &str, place: Option<WatchPermit>) -> Subscription {
        let subscription = Subscription::replay_then_live(watch::Run::default(), None, 0).catching_up(
            self.event_pages.clone(),
            execution_id.to_string(),
            self.bus.capacity(),
        );
        let subscription = match place {
            Some(place) => subscription.holding(place),
            None => subscription,
        };
        subscription.polling(self.store.clone(), execution_id.to_string(), self.wakeups.waiter(execution_id))
    }

    /// Whether a subject's record says it has ended (its `finished` event
    /// is then stored, and nothing more will come).
    async fn is_terminal(&self, subject: &str) -> Result<bool, EngineError> {
        if let Some(record) = self.store.get_execution(subject).await? {
            return Ok(record.state.is_terminal());
        }
        if let Some(record) = self.store.get_session(subject).await? {
            return Ok(!matches!(record.state, SessionState::Starting | SessionState::Active));
        }
        Ok(true)
    }

    /// Stops accepting work, gives in-flight executions and session turns
    /// `grace` to finish, then cancels them and waits for their teardown;
    /// then ends every session; then, unless it
    /// fenced, the node leaves the fleet as `stopped` (see
    /// [`Store::leave_fleet`]), and the store closes.
    pub async fn shutdown(&self, grace: Duration) {
        self.stopping.cancel();
        self.tasks.close();
        // The grace ends at its deadline, whatever is going on then: the
        // sessions' ends below (their workspace captures) have what is left
        // of it, not nothing.
        let grace_over = {
            let (draining, deadline) = (self.draining.clone(), tokio::time::Instant::now() + grace);
            tokio::spawn(async move {
                tokio::time::sleep_until(deadline).await;
                draining.cancel();
            })
        };
        // No run will take them now.
        self.close_warm_pools().await;
        tokio::select! {
            () = self.tasks.wait() => {}
            () = self.draining.cancelled() => {
                let running = self.admission.running(admission::Work::Execution);
                tracing::warn!(running, "grace period over; cancelling in-flight executions and turns");
                self.tasks.wait().await;
            }
        }
        self.end_all_sessions().await;
        grace_over.abort();
        self.draining.cancel();
        // What the last runs and sessions stopped is given back before the
        // store closes.
        self.tasks.wait().await;
        if !self.fenced.load(std::sync::atomic::Ordering::SeqCst) {
            self.leave_fleet().await;
        }
        self.store.close().await;
    }

    /// Marks this node `stopped`, rather than have a survivor declare it
    /// lost once its lease runs out; on a shared store, says how it went.
    async fn leave_fleet(&self) {
        let node = self.store.node();
        match self.store.leave_fleet().await {
            // One store: no survivor to tell, and its next start recovers
            // whatever is left.
            _ if !self.store.is_shared() => {}
            Ok(true) => tracing::info!(node, "fleet: stopped; this node left the fleet"),
            Ok(false) => tracing::warn!(
                node,
                "fleet: a run of this node is unfinished in the store; its lease will run out and a survivor fail it"
            ),
            Err(e) => tracing::warn!(node, error = %e, "fleet: not marked stopped; its lease will run out"),
        }
    }

    /// Compacts the events of executions finished more than `retention`
    /// ago, now and then every `every`.
    pub fn spawn_compactor(self: &Arc<Self>, retention: Duration, every: Duration) {
        let engine = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(engine) = engine.upgrade() else { return };
                if engine.is_draining() {
                    return;
                }
                let cutoff = now_ms() - retention.as_millis() as i64;
                match engine.store.compact_events(cutoff).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(events = n, "compacted finished executions' events"),
                    Err(e) => tracing::warn!(error = %e, "event compaction failed"),
                }
                drop(engine);
                tokio::time::sleep(every).await;
            }
        });
    }

    /// Refuses new work from now on: the warm pools make no more
    /// sandboxes, and their fillers destroy those waiting (no run will
    /// take them).
    pub fn start_draining(&self) -> bool {
        let was = self.tasks.is_closed();
        self.tasks.close();
        self.stop_filling();
        self.drain_started.cancel();
        !was
    }

    /// Runs `work` in a task the shutdown waits for before the store
    /// closes: work that must not be cut off halfway (a session's end).
    pub fn spawn_tracked<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(work)
    }

    /// `refused`, unless `cmd` is a retry (its request id names an
    /// execution): a retry starts nothing, and gets its execution whatever
    /// draining, admission, the queue or the fleet would say of new work
    /// (what its first copy holds is no reason to refuse it). Looked up
    /// only on a refusal, so a submit pays no read for it.
    pub(super) async fn refused_unless_retry(
        self: &Arc<Self>,
        cmd: &ExecuteCommand,
        refused: EngineError,
    ) -> Result<Submitted, EngineError> {
        if !cmd.request_id.is_empty() {
            if let Some((record, digest)) = self.store.execution_of_request(&cmd.principal, &cmd.request_id).await? {
                return self.existing(*record, &digest, cmd).await;
            }
        }
        Err(refused)
    }

    /// Cancelled once this node drains: a shutdown, a DrainNode of it, or
    /// its fleet row marked draining.
    pub fn drain_started(&self) -> CancellationToken {
        self.drain_started.clone()
    }

    /// Whether the engine refuses new work: draining started, or the shutdown
    /// grace is over.
    pub fn is_draining(&self) -> bool {
        self.tasks.is_closed() || self.draining.is_cancelled()
    }

    /// Whether this node is stopping (a shutdown or a fence), not only
    /// draining: a session then takes no new turn and is not reaped (the
    /// shutdown ends it).
    pub fn is_stopping(&self) -> bool {
        self.stopping.is_cancelled()
    }

    /// Cancelled when a shutdown's grace period is over: work that would
    /// outlast it (a workspace capture) stops then.
    pub fn grace_over(&self) -> CancellationToken {
        self.draining.clone()
    }
}

/// Why a draining node refuses new work.
pub(crate) const DRAINING: &str =
    "this node is draining (shutting down, or drained by DrainNode): it accepts no new work";

/// The span of one execution, joined to the caller's trace: every log line
/// of the run carries its id. The outcome fields are recorded when it
/// finishes (see `execution`).
fn execution_span(execution_id: &str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        "execution",
        execution_id = %execution_id,
        outcome = tracing::field::Empty,
        "corral.failure_class" = tracing::field::Empty,
        "corral.profile" = tracing::field::Empty,
        "gen_ai.response.model" = tracing::field::Empty,
        "gen_ai.usage.total_tokens" = tracing::field::Empty,
    );
    crate::telemetry::set_parent(&span, traceparent);
    span
}
