//! Sandboxes: the isolated places where a rein's processes run.
//!
//! The daemon owns a sandbox's whole life: it records the intent, asks a
//! [`SandboxBackend`] to create it, spawns processes in it, and destroys it
//! exactly once. Backends are behind a trait so tests can inject every
//! failure the evidence rules name.

mod boundary;
mod bwrap;
pub mod cgroup;
pub mod host;
pub mod netns;
mod none;
pub mod pool;
pub mod process;
pub mod repo;
pub mod seccomp;
mod socket_family;
pub mod uid_lock;
pub mod uid_state;
mod vfork;
pub mod waiter;
pub mod workspace;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use boundary::{open_to_owner, Boundary, SandboxPaths};
pub use bwrap::find_on_path;

/// Where the gate endpoint listens inside every sandbox whose agent has a
/// managed hook (its loopback: nothing else exists in that namespace).
pub const GATE_PORT: u16 = 3129;
/// Where the credential gateway listens inside every sandbox with a
/// gatewayed route.
pub const GATEWAY_PORT: u16 = 3130;
pub use crate::types::{Consumer, EnforcementReceipt, LimitReceipt, SandboxSpec, SandboxState, SandboxType};
pub use bwrap::{bwrap_args, command_digest, BwrapBackend, HostLayout, HOME_MOUNT, WORKSPACE_MOUNT};
pub use host::{SandboxConfig, UidMode, UidRange};
pub use none::NoneBackend;
pub use process::{HostUser, SandboxProcess};

/// The limits a backend enforces for a sandbox (the profile's `[limits]`
/// that the sandbox itself carries out). 0 = not limited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxLimits {
    /// Memory of the whole sandbox, in bytes: its cgroup's memory limit.
    pub memory_bytes: u64,
    /// Tasks (processes and threads) alive at once: the cgroup's pids limit,
    /// or RLIMIT_NPROC when there is no cgroup and the sandbox has a uid of its own.
    pub max_processes: u64,
    /// CPU in millicores (1000 = one CPU): the cgroup's CPU quota.
    pub cpu_millis: u64,
    /// Open file descriptors per process (RLIMIT_NOFILE).
    pub max_open_files: u64,
    /// Virtual address space per process, in bytes (RLIMIT_AS).
    pub address_space_bytes: u64,
    /// The largest file a process may write, in bytes (RLIMIT_FSIZE).
    pub max_file_bytes: u64,
    /// Bytes under the sandbox's own directory, watched by the daemon while
    /// the harness runs.
    pub max_workspace_bytes: u64,
    /// Files, directories and links under the sandbox's own directory,
    /// watched like `max_workspace_bytes`.
    pub max_workspace_inodes: u64,
    /// Size of a `linux_bwrap` sandbox's private `/tmp` tmpfs, in bytes.
    pub tmp_bytes: u64,
    /// Size of a `linux_bwrap` sandbox's private `/dev/shm` tmpfs, in bytes.
    pub shm_bytes: u64,
}

impl SandboxLimits {
    /// The sizes of the sandbox's private tmpfs mounts.
    pub fn tmpfs(&self) -> Tmpfs {
        Tmpfs { tmp_bytes: self.tmp_bytes, shm_bytes: self.shm_bytes }
    }

    /// Whether only a cgroup can enforce these.
    pub fn needs_cgroup(&self) -> bool {
        self.memory_bytes > 0 || self.cpu_millis > 0 || self.max_processes > 0
    }
}

/// The sizes of a `linux_bwrap` sandbox's private tmpfs mounts: `/tmp` and
/// `/dev/shm` (bwrap's `--dev` would otherwise give an unsized one, half the
/// host's RAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tmpfs {
    /// Size of `/tmp`, in bytes.
    pub tmp_bytes: u64,
    /// Size of `/dev/shm`, in bytes.
    pub shm_bytes: u64,
}

/// What the daemon asks a backend to create.
#[derive(Clone, Debug)]
pub struct CreateSandbox {
    /// The id the daemon gave the sandbox; it also names its cgroup.
    pub sandbox_id: String,
    /// Who the sandbox is for.
    pub consumer: Consumer,
    /// What the profile asks of the sandbox: its type, network and paths.
    pub spec: SandboxSpec,
    /// A directory the daemon reserved for this sandbox; the backend puts
    /// the workspace inside it and removes it on destroy.
    pub root: PathBuf,
    /// The host user the sandbox runs as (its own uid, allocated by the
    /// daemon); `None` when the daemon is not root and keeps its own.
    pub user: Option<HostUser>,
    /// The limits the backend enforces (0 = not limited).
    pub limits: SandboxLimits,
    /// What the agent's managed pre-tool hook needs inside (see
    /// [`GateFile`]); empty for a harness without one.
    pub gate: Vec<GateFile>,
    /// Open the credential gateway's listener in the sandbox's network
    /// namespace at every spawn ([`SandboxProcess::gateway_listener`]).
    pub gateway: bool,
}

/// A file the daemon puts at a fixed system path inside a sandbox,
/// read-only and outside HOME and the workspace, for an agent CLI's
/// managed pre-tool hook: its managed settings, or the hook helper. A
/// sandbox with any of them also gets the gate's listener in its network
/// namespace at every spawn ([`SandboxProcess::gate_listener`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateFile {
    /// Absolute, under `/etc`.
    pub inside: String,
    /// Where the file's contents come from.
    pub source: GateSource,
}

/// Where a [`GateFile`]'s contents come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateSource {
    /// Handed to bwrap by descriptor at each spawn, which copies them into
    /// its own tmpfs and binds them read-only: nothing on the host's disk.
    Contents(Vec<u8>),
    /// A host file bound as it is (the hook helper program).
    Host(PathBuf),
}

/// How a created sandbox mounts its [`GateFile`]s, in order, each checked
/// to be a plain path under `/etc`. Non-empty: the gate's listener is
/// opened too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GateMounts {
    /// The hook's files.
    pub files: Vec<GateFile>,
    /// The credential gateway listens in the namespace too.
    pub gateway: bool,
}

impl GateMounts {
    /// Whether no hook file is mounted (and so no gate listener is opened).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The files whose contents bwrap reads from descriptors, in order.
    pub fn contents(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.files.iter().filter_map(|file| match &file.source {
            GateSource::Contents(bytes) => Some((file.inside.as_str(), bytes.as_slice())),
            GateSource::Host(_) => None,
        })
    }
}

/// A sandbox a backend created.
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// The sandbox's id, as given in [`CreateSandbox::sandbox_id`].
    pub id: String,
    /// The backend that created it.
    pub backend: SandboxType,
    /// Where it is in its life; anything but `Ready` after create is a failure.
    pub state: SandboxState,
    /// Who the sandbox is for.
    pub consumer: Consumer,
    /// What the profile asked of the sandbox.
    pub spec: SandboxSpec,
    /// The directory reserved for it on the host; removed on destroy.
    pub root: PathBuf,
    /// The workspace as the host sees it.
    pub workspace: PathBuf,
    /// The harness's HOME as the host sees it.
    pub home: PathBuf,
    /// The host user its processes run as; `None` when they run as the daemon's uid.
    pub user: Option<HostUser>,
    /// The limits it was created with (0 = not limited).
    pub limits: SandboxLimits,
    /// The sandbox's cgroup: its limits, and how teardown finds everything.
    pub cgroup: Option<Arc<cgroup::SandboxCgroup>>,
    /// What its egress proxy decided, when it has network.
    pub egress: Option<Arc<crate::net::EgressLog>>,
    /// Its agent's hook files, as bound (empty: no gate listener).
    pub gate: GateMounts,
    /// What the sandbox enforces and by which mechanism.
    pub receipt: EnforcementReceipt,
}

/// One command to run inside a sandbox. Every command carries the consumer
/// identity, the profile's credential route refs and its timeout.
#[derive(Clone)]
pub struct ExecSpec {
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// Extra environment for the process (never passed as arguments).
    pub env: Vec<(String, String)>,
    /// Who the command runs for, put in its environment (see [`base_env`]).
    pub consumer: Consumer,
    /// The profile's credential route refs, put in `CORRAL_CREDENTIAL_ROUTES`.
    pub credential_route_refs: Vec<String>,
    /// The run's timeout, told to the process as `CORRAL_TIMEOUT_SECONDS`; the
    /// caller enforces it, not the backend.
    pub timeout: Duration,
}

/// Environment values can be credentials: Debug shows names only.
impl std::fmt::Debug for ExecSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let env: Vec<&str> = self.env.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ExecSpec")
            .field("argv", &self.argv)
            .field("env", &env)
            .field("consumer", &self.consumer)
            .field("credential_route_refs", &self.credential_route_refs)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Why a backend could not create, run in or destroy a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The backend cannot work on this host (e.g. bwrap missing).
    #[error("sandbox backend unavailable: {0}")]
    Unavailable(String),
    /// Creating the sandbox failed (its directory, its cgroup, or the
    /// backend's own setup).
    #[error("sandbox creation failed: {0}")]
    Create(String),
    /// Starting a process inside the sandbox failed.
    #[error("spawn in sandbox failed: {0}")]
    Spawn(String),
    /// Destroy could not kill everything of the sandbox or remove its files;
    /// the sandbox may still hold processes or disk space.
    #[error("sandbox destroy failed: {0}")]
    Destroy(String),
}

/// Resolves once a warm sandbox's waiter has exited
/// ([`SandboxBackend::waiter_exit`]).
pub type WaiterExit = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A way of creating sandboxes, running processes in them and destroying
/// them (`linux_bwrap`, `none`, or a test double).
#[async_trait]
pub trait SandboxBackend: Send + Sync {
    /// Which [`SandboxType`] this backend implements.
    fn kind(&self) -> SandboxType;
    /// Whether this host can enforce the backend; `Err` carries the reason.
    async fn probe(&self) -> Result<(), SandboxError>;
    /// Creates the sandbox. A returned sandbox whose state is not `Ready`
    /// is a failed creation that still has to be destroyed.
    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError>;
    /// Starts a process inside the sandbox, in its own process group.
    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError>;
    /// Starts the sandbox's first process ahead of any request: a waiter
    /// (see [`waiter`]) blocked on its stdin, under the whole boundary a
    /// spawn would give it. The sandbox's next [`spawn`](Self::spawn) hands
    /// it its argv and environment instead of starting bwrap; every later
    /// spawn starts its own. `program` is the waiter's
    /// ([`waiter::PROGRAM`]). `Unavailable` for a backend without.
    async fn prestart(&self, sandbox: &Sandbox, program: &Path) -> Result<(), SandboxError> {
        let _ = (sandbox, program);
        Err(SandboxError::Unavailable(format!("{} sandboxes cannot be started ahead", self.kind().as_str())))
    }
    /// Whether the waiter [`prestart`](Self::prestart) started has exited
    /// while it waited (killed, out of memory), without reaping it: the
    /// sandbox's next spawn could not hand it anything. False for a
    /// sandbox without one.
    fn waiter_exited(&self, sandbox: &Sandbox) -> bool {
        let _ = sandbox;
        false
    }
    /// Resolves once the waiter [`prestart`](Self::prestart) started has
    /// exited, without reaping it, so a pool sees a sandbox die while it
    /// waits; `None` for a sandbox without one.
    fn waiter_exit(&self, sandbox: &Sandbox) -> Option<WaiterExit> {
        let _ = sandbox;
        None
    }
    /// Kills whatever still runs in the sandbox and waits until nothing of
    /// it can run again (its cgroup empty; without one, its uid swept).
    async fn stop(&self, sandbox: &Sandbox) -> Result<(), SandboxError>;
    /// Gives back what a stopped sandbox held: its uid once no task of it
    /// is left at all, its cgroup, its files. Runs after [`stop`](Self::stop)
    /// whatever came of it, off a run's critical path.
    async fn reclaim(&self, sandbox: &Sandbox) -> Result<(), SandboxError>;
    /// [`stop`](Self::stop), then [`reclaim`](Self::reclaim); succeeds
    /// only if both did.
    async fn destroy(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        let stopped = self.stop(sandbox).await;
        both(stopped, self.reclaim(sandbox).await)
    }
    /// What this backend can enforce on this host.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    /// Destroys what a crashed daemon left of sandbox `sandbox_id` (found
    /// by its cgroup and its uid, never by a recorded pid).
    async fn destroy_leftover(
        &self,
        sandbox_id: &str,
        root: &Path,
        user: Option<HostUser>,
    ) -> Result<(), SandboxError> {
        let _ = (sandbox_id, user);
        boundary::remove_root(root).await
    }
}

/// Both results: the first's error, with the second's joined to it.
pub fn both(first: Result<(), SandboxError>, second: Result<(), SandboxError>) -> Result<(), SandboxError> {
    match (first, second) {
        (Ok(()), second) => second,
        (Err(e), Ok(())) => Err(e),
        (Err(a), Err(b)) => Err(SandboxError::Destroy(format!("{}; {}", destroy_reason(a), destroy_reason(b)))),
    }
}

/// The text of a destroy error, without its prefix.
fn destroy_reason(e: SandboxError) -> String {
    match e {
        SandboxError::Destroy(reason) => reason,
        other => other.to_string(),
    }
}

/// What a backend can enforce here: `Ok(mechanism)` or `Err(reason)` for
/// each kind of limit, for the gate (which refuses what cannot be
/// enforced) and for `corral doctor`.
#[derive(Clone, Debug)]
pub struct Capabilities {
    /// How a memory limit is enforced (`Ok`), or why it cannot be (`Err`).
    pub memory: Result<String, String>,
    /// How a process limit is enforced, or why it cannot be.
    pub pids: Result<String, String>,
    /// How a CPU limit is enforced, or why it cannot be.
    pub cpu: Result<String, String>,
    /// How teardown finds every process of a sandbox.
    pub kill: Result<String, String>,
    /// How egress of a sandbox with network is enforced.
    pub egress: Result<String, String>,
}

impl Default for Capabilities {
    fn default() -> Self {
        let none = || Err("no cgroup for this backend".to_string());
        Capabilities { memory: none(), pids: none(), cpu: none(), kill: none(), egress: none() }
    }
}

impl Capabilities {
    /// What a backend with these cgroups (`None`: no usable hierarchy) can
    /// enforce; egress needs a root daemon.
    pub fn from_cgroups(host: Option<&cgroup::CgroupHost>) -> Capabilities {
        let egress = if host::effective_uid() == 0 {
            Ok("a proxy in the sandbox's own network namespace".to_string())
        } else {
            Err("an unprivileged daemon cannot enter a sandbox's network namespace to serve its egress proxy"
                .to_string())
        };
        let Some(host) = host else {
            let none = || Err("no usable cgroup hierarchy on this host".to_string());
            return Capabilities { memory: none(), pids: none(), cpu: none(), kill: none(), egress };
        };
        let text = |r: Result<cgroup::Mechanism, String>| r.map(|m| m.to_string());
        Capabilities {
            memory: text(host.memory()),
            pids: text(host.pids()),
            cpu: text(host.cpu()),
            kill: text(host.kill()),
            egress,
        }
    }

    /// Why `limits` cannot be enforced here, if they cannot.
    pub fn refuse(&self, limits: &SandboxLimits) -> Option<String> {
        for (name, value, support) in [
            ("memory_bytes", limits.memory_bytes, &self.memory),
            ("max_processes", limits.max_processes, &self.pids),
            ("cpu_millis", limits.cpu_millis, &self.cpu),
        ] {
            if value > 0 {
                if let Err(reason) = support {
                    // Defaults included: a host without cgroups refuses every
                    // profile that keeps the default memory, pids and CPU
                    // limits, until the operator writes them off on purpose.
                    return Some(format!(
                        "limits.{name} cannot be enforced on this host: {reason} (to run without it, set \
                         {name} = 0 in the profile's [limits] or the daemon's [default_limits])"
                    ));
                }
            }
        }
        None
    }
}

/// The backends a daemon can use, by type.
#[derive(Clone)]
pub struct Backends {
    /// The bubblewrap backend.
    pub linux_bwrap: Arc<dyn SandboxBackend>,
    /// The unisolated backend: the sandbox's own directory, uid and cgroup,
    /// but no namespaces.
    pub none: Arc<dyn SandboxBackend>,
}

impl Backends {
    /// The backends for this host with the default `[sandbox]` config.
    pub fn host_default() -> Self {
        Self::for_host(&SandboxConfig::default())
    }

    /// This host's cgroups, if any can hold (and kill) a sandbox.
    pub fn cgroups_for(config: &SandboxConfig) -> Option<Arc<cgroup::CgroupHost>> {
        let cgroups = cgroup::CgroupHost::detect(&config.cgroup_mount, &config.cgroup_parent);
        cgroups.kill().is_ok().then(|| Arc::new(cgroups))
    }

    /// Both backends share one view of the host's cgroups.
    pub fn for_host(config: &SandboxConfig) -> Self {
        let cgroups = Self::cgroups_for(config);
        Backends {
            linux_bwrap: Arc::new(BwrapBackend::detect(cgroups.clone())),
            none: Arc::new(NoneBackend::new(cgroups)),
        }
    }

    /// The backend for `kind`.
    pub fn get(&self, kind: SandboxType) -> &Arc<dyn SandboxBackend> {
        match kind {
            SandboxType::LinuxBwrap => &self.linux_bwrap,
            SandboxType::None => &self.none,
        }
    }
}

/// The environment every in-sandbox command starts from: an allowlist, the
/// consumer identity, the credential route refs, then the spec's extras.
pub fn base_env(sandbox: &Sandbox, spec: &ExecSpec, home: &str) -> Vec<(String, String)> {
    let user = "agent".to_string();
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin".into()),
        ("HOME".into(), home.to_string()),
        ("LANG".into(), "C.UTF-8".into()),
        ("TMPDIR".into(), "/tmp".into()),
        ("USER".into(), user.clone()),
        ("LOGNAME".into(), user),
    ];
    env.extend(spec.consumer.env());
    env.push(("CORRAL_SANDBOX_ID".into(), sandbox.id.clone()));
    env.push(("CORRAL_CREDENTIAL_ROUTES".into(), spec.credential_route_refs.join(",")));
    env.push(("CORRAL_TIMEOUT_SECONDS".into(), spec.timeout.as_secs().to_string()));
    for name in &sandbox.spec.env_passthrough {
        if let Ok(value) = std::env::var(name) {
            env.push((name.clone(), value));
        }
    }
    env.extend(spec.env.iter().cloned());
    env
}
