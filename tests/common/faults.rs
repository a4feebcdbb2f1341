//! Fault injection around the real backend and rein: every failure the
//! evidence rules name can be provoked, and every call is recorded.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use corral::rein::{CommandRein, Dispatch, HarnessSession, Rein, ReinError, StartContext, ToolCall, ToolResult};
use corral::sandbox::{
    Backends, CreateSandbox, ExecSpec, Sandbox, SandboxBackend, SandboxError, SandboxProcess, SandboxState, SandboxType,
};

#[derive(Clone, Copy, Debug, Default)]
pub struct BackendFaults {
    /// `create` errors before any sandbox exists.
    pub fail_init: bool,
    /// `create` returns a sandbox that is not READY.
    pub not_ready: bool,
    /// `stop` fails (what a run reports as `sandbox_destroy`).
    pub fail_destroy: bool,
    /// `reclaim` fails, after the run has finished.
    pub fail_reclaim: bool,
    /// `reclaim` waits a second first, so what `stop` alone left can be seen.
    pub slow_reclaim: bool,
    /// `create` waits 300 ms first, so creates that overlap can be seen.
    pub slow_create: bool,
    /// `create` holds its thread for 300 ms first, as a backend's
    /// synchronous work (directories, cgroups, the spawn) does.
    pub busy_create: bool,
    /// `spawn` waits 300 ms first, so what happens while a harness starts
    /// can be seen.
    pub slow_spawn: bool,
    /// `spawn` returns 300 ms after the process started: a harness that
    /// ends at once has ended before its turn.
    pub spawn_then_wait: bool,
}

#[derive(Default)]
pub struct BackendLog {
    pub creates: usize,
    /// Creates in flight now, and the most that ever were at once.
    pub creating: usize,
    /// Creates that returned.
    pub created: usize,
    pub most_creating: usize,
    /// Sandboxes stopped (a run's destroy), in order.
    pub destroys: Vec<String>,
    /// Sandboxes reclaimed, in order.
    pub reclaims: Vec<String>,
    pub spawns: Vec<ExecSpec>,
    /// `creates` when each spawn returned.
    pub creates_at_spawn: Vec<usize>,
}

pub struct FaultyBackend {
    inner: Arc<dyn SandboxBackend>,
    faults: BackendFaults,
    pub log: Arc<Mutex<BackendLog>>,
}

impl FaultyBackend {
    async fn create_faulty(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        if self.faults.slow_create {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        if self.faults.busy_create {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        if self.faults.fail_init {
            return Err(SandboxError::Unavailable("injected: backend cannot initialise".into()));
        }
        let mut sandbox = self.inner.create(req).await?;
        if self.faults.not_ready {
            sandbox.state = SandboxState::Failed;
        }
        Ok(sandbox)
    }

    pub fn wrap(inner: Arc<dyn SandboxBackend>, faults: BackendFaults) -> (Arc<Self>, Arc<Mutex<BackendLog>>) {
        let log = Arc::new(Mutex::new(BackendLog::default()));
        (Arc::new(FaultyBackend { inner, faults, log: log.clone() }), log)
    }
}

/// Real backends, both wrapped in `faults`, with one log.
pub fn all_with(faults: BackendFaults) -> (Backends, Arc<Mutex<BackendLog>>) {
    let host = Backends::host_default();
    let (linux_bwrap, log) = FaultyBackend::wrap(host.linux_bwrap, faults);
    let none = Arc::new(FaultyBackend { inner: host.none, faults, log: log.clone() });
    (Backends { linux_bwrap, none }, log)
}

/// Real backends with the bwrap one wrapped in `faults`.
pub fn bwrap_with(faults: BackendFaults) -> (Backends, Arc<Mutex<BackendLog>>) {
    let host = Backends::host_default();
    let (backend, log) = FaultyBackend::wrap(host.linux_bwrap, faults);
    (Backends { linux_bwrap: backend, none: host.none }, log)
}

#[async_trait]
impl SandboxBackend for FaultyBackend {
    fn kind(&self) -> SandboxType {
        self.inner.kind()
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        self.inner.probe().await
    }

    fn capabilities(&self) -> corral::sandbox::Capabilities {
        self.inner.capabilities()
    }

    async fn destroy_leftover(
        &self,
        sandbox_id: &str,
        root: &std::path::Path,
        user: Option<corral::sandbox::HostUser>,
    ) -> Result<(), SandboxError> {
        self.inner.destroy_leftover(sandbox_id, root, user).await
    }

    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        {
            let mut log = self.log.lock().unwrap();
            log.creates += 1;
            log.creating += 1;
            log.most_creating = log.most_creating.max(log.creating);
        }
        let created = self.create_faulty(req).await;
        let mut log = self.log.lock().unwrap();
        log.creating -= 1;
        log.created += 1;
        created
    }

    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError> {
        self.log.lock().unwrap().spawns.push(spec.clone());
        if self.faults.slow_spawn {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        let spawned = self.inner.spawn(sandbox, spec).await;
        if self.faults.spawn_then_wait {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        let mut log = self.log.lock().unwrap();
        let creates = log.creates;
        log.creates_at_spawn.push(creates);
        spawned
    }

    async fn prestart(&self, sandbox: &Sandbox, program: &std::path::Path) -> Result<(), SandboxError> {
        self.inner.prestart(sandbox, program).await
    }

    fn waiter_exited(&self, sandbox: &Sandbox) -> bool {
        self.inner.waiter_exited(sandbox)
    }

    fn waiter_exit(&self, sandbox: &Sandbox) -> Option<corral::sandbox::WaiterExit> {
        self.inner.waiter_exit(sandbox)
    }

    async fn stop(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.log.lock().unwrap().destroys.push(sandbox.id.clone());
        let result = self.inner.stop(sandbox).await;
        if self.faults.fail_destroy {
            return Err(SandboxError::Destroy("injected: destroy failed".into()));
        }
        result
    }

    async fn reclaim(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        if self.faults.slow_reclaim {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        self.log.lock().unwrap().reclaims.push(sandbox.id.clone());
        let result = self.inner.reclaim(sandbox).await;
        if self.faults.fail_reclaim {
            return Err(SandboxError::Destroy("injected: reclaim failed".into()));
        }
        result
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct ReinFaults {
    pub fail_start: bool,
    /// `start_session` panics (a bug in the daemon) in the sandbox the run
    /// holds, before the harness exists.
    pub panic_start: bool,
    /// `dispatch_tool` raises (rather than the harness reporting failure).
    pub fail_dispatch: bool,
    /// `dispatch_tool` panics (a bug in the daemon) while the harness
    /// runs in its sandbox.
    pub panic_dispatch: bool,
    pub fail_end: bool,
    pub fail_cleanup: bool,
    /// The lifecycle takes each of the harness's events this long after
    /// the last (a host too busy to store and publish them as they come).
    pub slow_events: Option<std::time::Duration>,
}

/// The real command rein, with its calls recorded and faults injected.
pub struct RecordingRein {
    faults: ReinFaults,
    pub calls: Arc<Mutex<Vec<&'static str>>>,
}

impl RecordingRein {
    pub fn new(faults: ReinFaults) -> (Arc<Self>, Arc<Mutex<Vec<&'static str>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        (Arc::new(RecordingRein { faults, calls: calls.clone() }), calls)
    }
}

pub fn reins_with(rein: Arc<RecordingRein>) -> std::collections::HashMap<String, Arc<dyn Rein>> {
    let mut reins: std::collections::HashMap<String, Arc<dyn Rein>> = Default::default();
    reins.insert("command".into(), rein);
    reins
}

#[async_trait]
impl Rein for RecordingRein {
    fn name(&self) -> &str {
        "command"
    }

    async fn start_session(&self, ctx: StartContext) -> Result<Box<dyn HarnessSession>, ReinError> {
        self.calls.lock().unwrap().push("start_session");
        if self.faults.fail_start {
            return Err(ReinError::Start("injected: harness would not start SECRET-START".into()));
        }
        if self.faults.panic_start {
            panic!("injected: start panicked");
        }
        let inner = CommandRein.start_session(ctx).await?;
        Ok(Box::new(RecordingSession { inner, faults: self.faults, calls: self.calls.clone() }))
    }
}

struct RecordingSession {
    inner: Box<dyn HarnessSession>,
    faults: ReinFaults,
    calls: Arc<Mutex<Vec<&'static str>>>,
}

#[async_trait]
impl HarnessSession for RecordingSession {
    async fn dispatch_tool(&mut self, call: ToolCall, dispatch: Dispatch) -> Result<ToolResult, ReinError> {
        self.calls.lock().unwrap().push("dispatch_tool");
        if self.faults.fail_dispatch {
            return Err(ReinError::Dispatch("injected: dispatch raised SECRET-DISPATCH".into()));
        }
        if self.faults.panic_dispatch {
            panic!("injected: dispatch panicked");
        }
        let Some(pause) = self.faults.slow_events else {
            return self.inner.dispatch_tool(call, dispatch).await;
        };
        // One event at a time between the rein and the lifecycle, each
        // handed on `pause` after the last; all of them before the result.
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let lifecycle = dispatch.events.clone();
        let forward = tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                tokio::time::sleep(pause).await;
                let _ = lifecycle.send(event).await;
            }
        });
        let result = self.inner.dispatch_tool(call, Dispatch { events: tx, ..dispatch }).await;
        forward.await.unwrap();
        result
    }

    fn is_alive(&mut self) -> bool {
        self.inner.is_alive()
    }

    async fn end_session(&mut self) -> Result<(), ReinError> {
        self.calls.lock().unwrap().push("end_session");
        let result = self.inner.end_session().await;
        if self.faults.fail_end {
            return Err(ReinError::End("injected: end failed".into()));
        }
        result
    }

    async fn cleanup_session(&mut self) -> Result<(), ReinError> {
        self.calls.lock().unwrap().push("cleanup_session");
        let result = self.inner.cleanup_session().await;
        if self.faults.fail_cleanup {
            return Err(ReinError::Cleanup("injected: cleanup failed".into()));
        }
        result
    }
}
