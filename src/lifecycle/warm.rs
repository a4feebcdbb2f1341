//! Making sandboxes, cold for a run or warm ahead of one.
//!
//! [`make_sandbox`] is the one way a sandbox comes to exist: its intent row,
//! its own host uid, its hook files, the backend's create, its state. A run
//! with no warm sandbox for it calls it on its critical path; the warm
//! pools (`[sandbox] warm` in the daemon config) call it ahead of any
//! request and start the sandbox's waiting first process (see
//! `sandbox::waiter`). A request takes a warm sandbox only when it was made
//! for exactly the request's profile version, effective sandbox and
//! timeout (`sandbox::pool`); it serves that one run (an execution or a
//! session) and is destroyed like any other; one whose waiting first
//! process dies (killed, out of memory) is destroyed as soon as it does,
//! and replaced. The pools refill in the
//! background, as many sandboxes at once as the host has cores (at least
//! two, at most the pools' total size), and only while the executions
//! running and the warm sandboxes (waiting or being made) are fewer than
//! the executions this node admits at once. Once the daemon drains (a
//! SIGTERM or a fleet drain) they make nothing more and their waiting
//! sandboxes are destroyed; what a crash leaves of them, recovery sweeps
//! (their rows are like any sandbox's, with no subject until a run takes
//! them).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::admission::Work;
use super::Engine;
use crate::catalog::Profile;
use crate::credentials::GatewayRoute;
use crate::events::Recorder;
use crate::sandbox::pool::{Fill, PoolKey, Pools, Take};
use crate::sandbox::{CreateSandbox, GateFile, Sandbox, SandboxBackend, SandboxSpec, SandboxState, SandboxType};

/// A sandbox the backend made, with its credential gateway routes.
pub(super) struct Made {
    pub backend: Arc<dyn SandboxBackend>,
    pub sandbox: Sandbox,
    pub gateway: Vec<GatewayRoute>,
}

/// A warm sandbox waiting in a pool.
pub(super) type WarmSandbox = Made;

/// The daemon's warm pools and what wakes their fillers.
pub(super) struct Warm {
    pools: Mutex<Pools<WarmSandbox>>,
    wake: Notify,
    /// Cancelled once nothing more is to be made: the daemon drains, or the
    /// pools closed. A filler waiting out a retry stops waiting.
    stop: CancellationToken,
    /// A filler waits for admission's room ([`Fill::NoRoom`]): the next run
    /// to end wakes the fillers.
    held_back: AtomicBool,
}

/// A warm sandbox whose first process dies sooner than this after it was
/// made counts as a failure to make it (see `Pools::died_young`).
const DIED_YOUNG: Duration = Duration::from_secs(10);

impl Warm {
    pub fn new(sizes: &std::collections::BTreeMap<String, usize>) -> Warm {
        Warm {
            pools: Mutex::new(Pools::new(sizes)),
            wake: Notify::new(),
            stop: CancellationToken::new(),
            held_back: AtomicBool::new(false),
        }
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, Pools<WarmSandbox>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a sandbox for `profile` with `spec` and `timeout_seconds` is made for.
pub(super) fn pool_key(profile: &Profile, spec: &SandboxSpec, timeout_seconds: u64) -> PoolKey {
    PoolKey { profile_digest: profile.digest.clone(), spec: spec.clone(), timeout_seconds }
}

/// Makes a sandbox for the run whose `recorder` it is (none for a warm
/// one, made for no run yet): intent row, own uid,
/// hook files, the backend's create, its state stored: a warm sandbox's
/// now, a run's `ready` with the write that stores its `sandbox_ready`
/// (`Core::create_sandbox`), a failed one's now. An error is the sentence
/// the run fails with; nothing of the sandbox is left then. A returned
/// sandbox whose state is not `Ready` is a failed creation that the caller
/// still destroys. The run's held events (`accepted`, `resolved`,
/// `gated`) are stored in the intent row's commit and published as soon
/// as it is in, before the sandbox is made.
pub(super) async fn make_sandbox(
    engine: &Engine,
    spec: &SandboxSpec,
    profile: &Profile,
    timeout_seconds: u64,
    recorder: Option<&mut Recorder>,
) -> Result<Made, String> {
    let backend = engine.backends.get(spec.sandbox_type).clone();
    let sandbox_id = uuid::Uuid::now_v7().to_string();
    let root = engine.sandboxes_dir.join(&sandbox_id);
    // Intent before action: a crashed daemon's successor finds this row.
    // With it, in the same commit, its own host uid, reserved in the store
    // before anything runs as it.
    let store = &engine.store;
    let backend_name = spec.sandbox_type.as_str();
    let gone = |error: String| async {
        engine.store_sandbox_state(&sandbox_id, SandboxState::Destroyed).await;
        Err(error)
    };
    let subject = recorder.as_ref().map_or(String::new(), |r| r.subject().to_string());
    let carried = recorder.as_ref().map(|r| r.held_events()).unwrap_or_default();
    let writing = Instant::now();
    let new = crate::store::NewSandbox {
        sandbox_id: &sandbox_id,
        subject_id: &subject,
        backend: backend_name,
        root: &root,
        epoch: &engine.epoch,
    };
    let user = match engine.uid_range {
        None => {
            store.insert_sandbox_carrying(new, &carried).await.map_err(|e| e.to_string())?;
            published(recorder, carried, writing).await;
            None
        }
        Some(range) => {
            let reserved = match super::uids::insert_with_own_uid(store, range, new, &carried).await {
                Err(super::uids::Stored::Nothing(e)) => return Err(e.to_string()),
                Err(super::uids::Stored::Intent(e)) => Err(e),
                Ok(uid) => Ok(uid),
            };
            // The row is in, and the events with it.
            published(recorder, carried, writing).await;
            match reserved {
                Ok(Some(uid)) => Some(crate::sandbox::host::own_user(uid)),
                Ok(None) => return gone(format!("no free sandbox uid in {}-{}", range.first, range.last)).await,
                Err(e) => return gone(e.to_string()).await,
            }
        }
    };
    let planned = gate_files(engine, profile, spec, timeout_seconds)
        .and_then(|files| Ok((files, gateway_routes(engine, profile, spec)?)));
    let (gate, gateway) = match planned {
        Ok(planned) => planned,
        Err(error) => return gone(error).await,
    };
    let request = CreateSandbox {
        sandbox_id: sandbox_id.clone(),
        consumer: Default::default(),
        spec: spec.clone(),
        root,
        user,
        limits: profile.file.limits.sandbox(),
        gate,
        gateway: !gateway.is_empty(),
    };
    let mut sandbox = match backend.create(&request).await {
        Ok(sandbox) => sandbox,
        Err(e) => {
            // The backend made nothing we can name; clear what we reserved.
            let _ = tokio::fs::remove_dir_all(&request.root).await;
            return gone(e.to_string()).await;
        }
    };
    sandbox.receipt.gateway_routes = gateway.iter().map(|r| r.name.clone()).collect();
    let gatewayed = |route: &String| gateway.iter().any(|g| &g.name == route);
    sandbox.receipt.exposed_routes =
        profile.file.credential_route_refs.iter().filter(|r| !gatewayed(r)).cloned().collect();
    engine.sandbox_alive(&sandbox.id, true);
    crate::telemetry::sandbox_alive(1.0);
    match sandbox.state {
        SandboxState::Ready if !subject.is_empty() => {}
        SandboxState::Ready => engine.store_sandbox_state(&sandbox.id, SandboxState::Ready).await,
        _ => engine.store_sandbox_state(&sandbox.id, SandboxState::Failed).await,
    }
    Ok(Made { backend, sandbox, gateway })
}

/// Publishes the events a run's recorder held, once the intent row that
/// carried them is stored, and lets their streams send them: the stream a
/// publish wakes waits in this thread's next-task slot, which no other
/// thread takes, and making the sandbox holds the thread for milliseconds.
async fn published(recorder: Option<&mut Recorder>, carried: Vec<crate::records::Event>, writing: Instant) {
    if let Some(recorder) = recorder {
        recorder.publish_held(carried, writing.elapsed().as_secs_f64());
        tokio::task::yield_now().await;
    }
}

/// The files that install the agent's managed pre-tool hook, for a
/// `linux_bwrap` sandbox (a `none` one cannot carry them: its agent's
/// tool calls are ungated, and a tool_call policy refused it at
/// agent_start). An error is why the sandbox must not be made.
fn gate_files(
    engine: &Engine,
    profile: &Profile,
    spec: &SandboxSpec,
    timeout_seconds: u64,
) -> Result<Vec<GateFile>, String> {
    if spec.sandbox_type != SandboxType::LinuxBwrap {
        return Ok(Vec::new());
    }
    let helper = engine.hook_program.as_deref();
    let files = crate::gate::hook::managed_files(profile.file.rein.preset, timeout_seconds, helper)?;
    Ok(files.unwrap_or_default())
}

/// The profile's routes that go through the credential gateway: in a
/// `linux_bwrap` sandbox, every route with an `upstream` and the model
/// key of Claude Code and Codex, with or without `allow_network` (the
/// gateway is how an agent reaches its model without the key; what it
/// forwards is recorded as `egress`, and the receipt says so). A `none`
/// sandbox has no namespace for the gateway: a route that names an
/// upstream refuses it, the built-ins' keys are handed over as before.
fn gateway_routes(engine: &Engine, profile: &Profile, spec: &SandboxSpec) -> Result<Vec<GatewayRoute>, String> {
    let refs = &profile.file.credential_route_refs;
    let credentials = &engine.credentials;
    if spec.sandbox_type == SandboxType::LinuxBwrap {
        return credentials.gateway_routes(refs, &profile.file.rein);
    }
    match refs.iter().find(|r| credentials.routes.get(*r).is_some_and(|c| c.upstream.is_some())) {
        Some(route) => Err(format!(
            "credential route {route} goes through the credential gateway, which a none sandbox cannot carry"
        )),
        None => Ok(Vec::new()),
    }
}

/// Why a profile cannot have a warm pool, if it cannot: its sandbox must
/// be one whose whole command line is known before the request.
pub fn unpoolable(profile: &Profile) -> Option<String> {
    let spec = &profile.file.sandbox;
    if spec.sandbox_type != SandboxType::LinuxBwrap {
        return Some(format!("its sandbox is {}: only linux_bwrap sandboxes start ahead", spec.sandbox_type.as_str()));
    }
    let workspace_writable = spec.write_paths.iter().any(|p| p == ".");
    if !workspace_writable {
        if let Some(path) = spec.write_paths.iter().find(|p| !std::path::Path::new(p).is_absolute()) {
            return Some(format!(
                "its write path {path:?} is inside a read-only workspace, and is bound from the cloned \
                 repository, which is there only once a request is"
            ));
        }
    }
    None
}

/// The refill of the pool a run took its sandbox from, begun when this is
/// dropped (a run: once its `finished` is sent; a session: once its harness
/// started), or [`Refill::begin_after`] a while, whichever comes first.
/// Making a sandbox keeps a core busy for a few milliseconds: begun at the
/// take, or at the dispatch, it competed with the harness's start, the very
/// part of the run the warm sandbox was there to speed up.
pub(super) struct Refill(Arc<RefillSignal>);

struct RefillSignal {
    engine: Weak<Engine>,
    sent: AtomicBool,
}

impl RefillSignal {
    /// Wakes a filler, once.
    fn send(&self) {
        if !self.sent.swap(true, Ordering::AcqRel) {
            if let Some(engine) = self.engine.upgrade() {
                engine.warm.wake.notify_one();
            }
        }
    }
}

/// How long a run's harness has had its task before its pool refills
/// anyway: a short run has finished by then, and refills after; a long one
/// leaves its pool short by no more than this.
pub(super) const REFILL_AFTER_DISPATCH: Duration = Duration::from_millis(100);

impl Refill {
    /// Begins the refill `delay` from now unless it has begun before.
    pub(super) fn begin_after(&self, delay: Duration) {
        let signal = self.0.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            signal.send();
        });
    }
}

impl Drop for Refill {
    fn drop(&mut self) {
        self.0.send();
    }
}

/// How many fillers make warm sandboxes at once: one per core, at least two
/// (a make waits on bwrap and the store as much as it computes), never more
/// than the pools hold.
fn fillers(pool_size: usize, cores: usize) -> usize {
    pool_size.min(cores.max(2))
}

impl Engine {
    /// A warm sandbox made for exactly `profile`, `spec` and
    /// `timeout_seconds`, taken out of its pool, with its pool's refill,
    /// begun when the [`Refill`] is dropped. One whose waiter has exited
    /// (and whose watch, [`Engine::watch_waiter`], has not taken it out
    /// yet) is passed over, destroyed in the background, and its pool
    /// refills at once.
    pub(super) fn take_warm(
        self: &Arc<Self>,
        profile: &Profile,
        spec: &SandboxSpec,
        timeout_seconds: u64,
    ) -> Option<(WarmSandbox, Refill)> {
        let mut pools = self.warm.pools();
        if pools.is_empty() {
            return None;
        }
        // One non-blocking wait per sandbox looked at. A waiter that dies after this,
        // before the run's spawn hands it the harness, still fails that run.
        let live = |w: &WarmSandbox| !w.backend.waiter_exited(&w.sandbox);
        let (taken, dead) = pools.take_live(&pool_key(profile, spec, timeout_seconds), profile.id(), live);
        drop(pools);
        let (pool, found, taken) = match taken {
            Take::Warm(pool, taken) => (pool, "warm", Some(taken)),
            Take::Empty(pool) => (pool, "empty", None),
            Take::Dead(pool) => (pool, "dead", None),
            Take::Mismatch(pool) => (pool, "mismatch", None),
            Take::NoPool => return None,
        };
        crate::telemetry::warm_request(&pool, found);
        if taken.is_some() || !dead.is_empty() {
            self.report_warm_levels();
        }
        if !dead.is_empty() {
            self.warm.wake.notify_one();
        }
        for made in dead {
            self.destroy_dead_warm(&pool, made);
        }
        let taken = taken?;
        let signal = RefillSignal { engine: Arc::downgrade(self), sent: AtomicBool::new(false) };
        Some((taken, Refill(Arc::new(signal))))
    }

    /// Lists every pool's metrics: its requests at 0, its level as it is
    /// (for a recorder installed after the pools began to fill).
    pub fn list_warm_metrics(&self) {
        for (pool, waiting, _) in self.warm_levels() {
            crate::telemetry::warm_pool_listed(&pool);
            crate::telemetry::warm_sandboxes(&pool, waiting);
        }
    }

    /// The program a warm sandbox's first process runs: the waiter beside
    /// the corral binary (`gate.hook_program`), if there is one.
    pub fn waiter_program(&self) -> Option<PathBuf> {
        self.hook_program.as_deref().map(crate::sandbox::waiter::beside)
    }

    /// Sets `corral_warm_sandboxes` of every pool to how many wait in it.
    fn report_warm_levels(&self) {
        for (profile_ref, waiting, _) in self.warm_levels() {
            crate::telemetry::warm_sandboxes(&profile_ref, waiting);
        }
    }

    /// `(profile reference, waiting, size)` of each warm pool.
    pub fn warm_levels(&self) -> Vec<(String, usize, usize)> {
        self.warm.pools().levels()
    }

    /// The root directory of each waiting warm sandbox.
    pub fn warm_roots(&self) -> Vec<PathBuf> {
        self.warm.pools().waiting().map(|w| w.sandbox.root.clone()).collect()
    }

    /// The host pids in each waiting warm sandbox's cgroup (an empty list
    /// for one without a cgroup). A waiting sandbox is put in its pool once
    /// bwrap is spawned, and is still setting up its namespaces and
    /// starting its waiter for a while after.
    pub fn warm_processes(&self) -> Vec<Vec<i32>> {
        // The cgroups' files are read after the lock is let go: a run taking
        // a warm sandbox waits on that lock.
        let cgroups: Vec<_> = self.warm.pools().waiting().map(|w| w.sandbox.cgroup.clone()).collect();
        cgroups.iter().map(|c| c.as_ref().map(|c| c.pids()).unwrap_or_default()).collect()
    }

    /// Starts the fillers of the warm pools, if any is configured: they
    /// keep each full, [`fillers`] sandboxes at a time, within admission's
    /// room, until the daemon drains.
    pub fn start_warm_pools(self: &Arc<Self>) {
        let size = self.warm_levels().iter().map(|(_, _, size)| size).sum::<usize>();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for _ in 0..fillers(size, cores) {
            let engine = self.clone();
            // Tracked: the shutdown waits for the sandbox being made to be destroyed.
            self.tasks.spawn(async move { engine.fill_pools().await });
        }
    }

    async fn fill_pools(self: Arc<Self>) {
        loop {
            // Armed before the pools are read: a take, a close or a run's end
            // between the read and the wait wakes this filler all the same.
            let wake = self.warm.wake.notified();
            let mut wake = std::pin::pin!(wake);
            wake.as_mut().enable();
            if self.is_draining() {
                // No run will take them now. A fence abandons the pools
                // itself: their processes are killed, not destroyed.
                if !self.fenced.load(Ordering::SeqCst) {
                    self.close_warm_pools().await;
                }
                return;
            }
            // Room for executions is room for sandboxes: a warm one becomes
            // the sandbox of the run that takes it.
            let room = self.admission.room(Work::Execution);
            let next = self.warm.pools().next_fill(room, Instant::now());
            let (index, profile_ref) = match next {
                Fill::Make(index, profile_ref) => (index, profile_ref),
                Fill::Closed => return,
                Fill::Full => {
                    wake.await;
                    continue;
                }
                // Only pools that failed are short: a take, a close or the
                // end of the wait, whichever comes first.
                Fill::Wait(until) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(until.into()) => {}
                        _ = wake => {}
                        _ = self.warm.stop.cancelled() => {}
                    }
                    continue;
                }
                Fill::NoRoom => {
                    self.warm.held_back.store(true, Ordering::SeqCst);
                    // A run that ended before the flag was up woke no one:
                    // look again if room was made meanwhile.
                    if self.admission.room(Work::Execution) <= room {
                        wake.await;
                    }
                    continue;
                }
            };
            let t = Instant::now();
            match self.make_warm(&profile_ref).await {
                Ok((key, made)) => {
                    tracing::debug!(profile = %profile_ref, ms = t.elapsed().as_millis() as u64, "warm sandbox ready");
                    let exit = made.backend.waiter_exit(&made.sandbox);
                    let sandbox_id = made.sandbox.id.clone();
                    let stale = self.warm.pools().filled(index, key, made);
                    if let Some(exit) = exit {
                        self.watch_waiter(sandbox_id, exit);
                    }
                    self.report_warm_levels();
                    for made in stale {
                        self.destroy_warm(made).await;
                    }
                }
                // The pool waits before it is made for again; the others
                // go on (see `Pools::next_fill`).
                Err(error) => {
                    self.warm.pools().failed(index, Instant::now());
                    tracing::warn!(profile = %profile_ref, %error, "warm sandbox not made");
                }
            }
        }
    }

    /// Watches a waiting sandbox's waiter: once it exits (killed, out of
    /// memory) while the sandbox still waits, the sandbox is taken out of
    /// its pool and destroyed, and the pool refills, with no request to
    /// find it dead first. The watch holds no engine: it ends when the
    /// waiter does, which a take (whose run ends it), a destroy or the
    /// daemon's exit brings about.
    fn watch_waiter(self: &Arc<Self>, sandbox_id: String, exit: crate::sandbox::WaiterExit) {
        let engine = Arc::downgrade(self);
        let made = Instant::now();
        tokio::spawn(async move {
            exit.await;
            if let Some(engine) = engine.upgrade() {
                engine.waiter_died(&sandbox_id, made.elapsed() < DIED_YOUNG);
            }
        });
    }

    /// The waiter of `sandbox_id` exited (`young`: soon after the sandbox
    /// was made): if the sandbox still waits in a pool, it is taken out and
    /// destroyed, and its pool refills, after a wait if it died young.
    fn waiter_died(self: &Arc<Self>, sandbox_id: &str, young: bool) {
        if self.fenced.load(Ordering::SeqCst) {
            // Whatever waits is the fence's, destroyed without the store.
            return;
        }
        let dead = self.warm.pools().remove_dead(|w| w.sandbox.id == sandbox_id && w.backend.waiter_exited(&w.sandbox));
        if dead.is_empty() {
            return;
        }
        if young {
            let now = Instant::now();
            let mut pools = self.warm.pools();
            for (pool, _) in &dead {
                pools.died_young(pool, now);
            }
        }
        self.report_warm_levels();
        self.warm.wake.notify_one();
        for (pool, made) in dead {
            self.destroy_dead_warm(&pool, made);
        }
    }

    /// Destroys, in the background, a sandbox of the pool `pool` whose
    /// waiter exited while it waited, and says so (log, metric).
    fn destroy_dead_warm(self: &Arc<Self>, pool: &str, made: WarmSandbox) {
        let sandbox_id = &made.sandbox.id;
        tracing::warn!(profile = %pool, %sandbox_id, "warm sandbox's waiter exited while it waited; destroyed");
        crate::telemetry::warm_sandbox_died(pool);
        let engine = self.clone();
        self.tasks.spawn(async move { engine.destroy_warm(made).await });
    }

    /// Wakes the fillers held back by admission ([`Fill::NoRoom`]): a run
    /// ended, and its room may be theirs.
    pub(super) fn wake_held_back_fillers(&self) {
        if self.warm.held_back.swap(false, Ordering::SeqCst) {
            self.warm.wake.notify_waiters();
        }
    }

    /// Stops the fillers: none starts another sandbox, and those waiting
    /// (for a take, for room, or out a retry) wake, to close the pools or
    /// end.
    pub(super) fn stop_filling(&self) {
        self.warm.stop.cancel();
        self.warm.wake.notify_waiters();
    }

    /// A sandbox for the pool of `profile_ref`, its waiter started.
    async fn make_warm(&self, profile_ref: &str) -> Result<(PoolKey, WarmSandbox), String> {
        let profile = self.catalog.resolve(profile_ref).map_err(|refusal| refusal.0)?;
        if let Some(why) = unpoolable(&profile) {
            return Err(format!("profile {} cannot have a warm pool: {why}", profile.reference()));
        }
        let (spec, timeout) = (profile.file.sandbox.clone(), profile.file.limits.timeout_seconds);
        let made = make_sandbox(self, &spec, &profile, timeout, None).await?;
        let started = match made.sandbox.state {
            SandboxState::Ready => match self.waiter_program() {
                Some(waiter) => made.backend.prestart(&made.sandbox, &waiter).await.map_err(|e| e.to_string()),
                None => Err("no corral binary beside which to find the sandbox's waiter (gate.hook_program)".into()),
            },
            state => Err(format!("sandbox is {}, not ready", state.as_str())),
        };
        match started {
            Ok(()) => Ok((pool_key(&profile, &spec, timeout), made)),
            Err(error) => {
                self.destroy_warm(made).await;
                Err(error)
            }
        }
    }

    /// Destroys a sandbox and stores what came of it: `Destroyed`, or
    /// `Failed` (recovery tries again) when something of it may be left.
    pub(super) async fn destroy_sandbox(
        &self,
        backend: &dyn SandboxBackend,
        sandbox: &Sandbox,
    ) -> Result<(), crate::sandbox::SandboxError> {
        let stopped = self.stop_sandbox(backend, sandbox).await;
        let reclaimed = self.reclaim_sandbox(backend, sandbox, stopped.is_ok()).await;
        crate::sandbox::both(stopped, reclaimed)
    }

    /// Kills everything of a sandbox and waits until nothing of it can run
    /// again; it is then no longer alive. What a run's `sandbox_destroy`
    /// reports: the rest is [`Engine::reclaim_sandbox`]'s. Its row stays
    /// until then, so a crash in between leaves it to recovery.
    pub(super) async fn stop_sandbox(
        &self,
        backend: &dyn SandboxBackend,
        sandbox: &Sandbox,
    ) -> Result<(), crate::sandbox::SandboxError> {
        let stopped = backend.stop(sandbox).await;
        self.sandbox_alive(&sandbox.id, false);
        crate::telemetry::sandbox_alive(-1.0);
        stopped
    }

    /// Gives back what a stopped sandbox held (uid, cgroup, files) and
    /// stores what came of it: `Destroyed` (its row goes, its uid is free),
    /// or `Failed` when it was not stopped or something of it is left
    /// (recovery tries again; `corral_sandbox_reclaim_failures_total`).
    pub(super) async fn reclaim_sandbox(
        &self,
        backend: &dyn SandboxBackend,
        sandbox: &Sandbox,
        stopped: bool,
    ) -> Result<(), crate::sandbox::SandboxError> {
        let reclaimed = backend.reclaim(sandbox).await;
        if let Err(error) = &reclaimed {
            tracing::error!(sandbox_id = %sandbox.id, %error, "sandbox not reclaimed; recovery tries again");
            crate::telemetry::sandbox_reclaim_failed();
        }
        let state = if stopped && reclaimed.is_ok() { SandboxState::Destroyed } else { SandboxState::Failed };
        self.store_sandbox_state(&sandbox.id, state).await;
        reclaimed
    }

    /// A stopped sandbox to give back once the run that held it has sent
    /// `finished` (when the guard drops): counted in
    /// [`Engine::reclaimed`] from now on.
    pub(super) fn reclaim_later(
        self: &Arc<Self>,
        backend: Arc<dyn SandboxBackend>,
        sandbox: Sandbox,
        stopped: bool,
    ) -> PendingReclaim {
        self.reclaiming.send_modify(|n| *n += 1);
        PendingReclaim { engine: self.clone(), backend, sandbox: Some(sandbox), stopped }
    }

    /// Destroys a warm sandbox no run took.
    async fn destroy_warm(&self, made: WarmSandbox) {
        if let Err(e) = self.destroy_sandbox(made.backend.as_ref(), &made.sandbox).await {
            tracing::error!(sandbox_id = %made.sandbox.id, error = %e, "warm sandbox not destroyed");
        }
    }

    /// Closes the pools and destroys every waiting sandbox (a drain, a
    /// shutdown).
    pub(super) async fn close_warm_pools(&self) {
        let waiting = self.warm.pools().close();
        self.stop_filling();
        for made in waiting {
            self.destroy_warm(made).await;
        }
    }

    /// Closes the pools and stops their waiting sandboxes (a fence), without
    /// the store: every process of each is killed, and its row and files
    /// are left to recovery. Returns how many processes their cgroups held.
    pub(super) async fn abandon_warm_pools(&self) -> usize {
        let waiting = self.warm.pools().close();
        self.stop_filling();
        let mut killed = 0;
        for made in waiting {
            killed += made.sandbox.cgroup.as_ref().map_or(0, |c| c.pids().len());
            if let Err(error) = self.stop_sandbox(made.backend.as_ref(), &made.sandbox).await {
                tracing::error!(sandbox_id = %made.sandbox.id, %error, "warm sandbox not stopped at the fence");
            }
        }
        killed
    }

    /// Stores a sandbox's state; a store error is logged.
    pub(super) async fn store_sandbox_state(&self, sandbox_id: &str, state: SandboxState) {
        if let Err(error) = self.store.set_sandbox_state(sandbox_id, state).await {
            tracing::error!(%sandbox_id, state = state.as_str(), %error, "sandbox state not stored");
        }
    }
}

/// A stopped sandbox not given back yet. Dropped, it hands the work to the
/// engine's background tasks (a shutdown waits for them): a run drops it
/// after its `finished` is sent, so the caller does not wait for the files
/// to go, nor does that work compete with the run's last writes.
pub(super) struct PendingReclaim {
    engine: Arc<Engine>,
    backend: Arc<dyn SandboxBackend>,
    sandbox: Option<Sandbox>,
    stopped: bool,
}

impl Drop for PendingReclaim {
    fn drop(&mut self) {
        let Some(sandbox) = self.sandbox.take() else { return };
        let (engine, backend, stopped) = (self.engine.clone(), self.backend.clone(), self.stopped);
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime left to run it on: its row stays for recovery.
            tracing::error!(sandbox_id = %sandbox.id, "sandbox not reclaimed: the runtime is gone; recovery will");
            engine.reclaiming.send_modify(|n| *n -= 1);
            return;
        }
        self.engine.tasks.spawn(async move {
            let _ = engine.reclaim_sandbox(backend.as_ref(), &sandbox, stopped).await;
            engine.reclaiming.send_modify(|n| *n -= 1);
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fillers_are_one_per_core_at_least_two_at_most_the_pools() {
        let cases = [((0, 8), 0), ((1, 8), 1), ((16, 1), 2), ((16, 2), 2), ((16, 8), 8), ((3, 8), 3)];
        for ((size, cores), want) in cases {
            assert_eq!(super::fillers(size, cores), want, "pool size {size}, {cores} cores");
        }
    }
}
