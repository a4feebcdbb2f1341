//! Sandboxes: the isolated places where a rein's processes run.
//!
//! The daemon owns a sandbox's whole life: it records the intent, asks a
//! [`SandboxBackend`] to create it, spawns processes in it, and destroys it
//! exactly once. Backends are behind a trait so tests can inject every
//! failure the evidence rules name.

mod bwrap;
mod none;
pub mod process;
pub mod spec;
pub mod workspace;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use bwrap::find_on_path;
pub use bwrap::{bwrap_args, hex as hex_digest, BwrapBackend, HostLayout, WORKSPACE_MOUNT};
pub use none::NoneBackend;
pub use process::SandboxProcess;
pub use spec::{Consumer, SandboxSpec, SandboxType};

/// Where a sandbox is in its life. Persisted with the sandbox row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Ready,
    Failed,
    Destroying,
    Destroyed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Ready => "ready",
            SandboxState::Failed => "failed",
            SandboxState::Destroying => "destroying",
            SandboxState::Destroyed => "destroyed",
        }
    }
}

/// What the daemon asks a backend to create.
#[derive(Clone, Debug)]
pub struct CreateSandbox {
    pub sandbox_id: String,
    pub consumer: Consumer,
    pub spec: SandboxSpec,
    /// A directory the daemon reserved for this sandbox; the backend puts
    /// the workspace inside it and removes it on destroy.
    pub root: PathBuf,
}

/// Proof of what a sandbox enforces.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnforcementReceipt {
    /// sha256 (hex) of the sandbox command line up to and including `--`,
    /// NUL-separated; empty for `none`.
    pub command_digest: String,
    pub network_isolated: bool,
    pub write_roots: Vec<String>,
}

/// A sandbox a backend created.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub id: String,
    pub backend: SandboxType,
    pub state: SandboxState,
    pub consumer: Consumer,
    pub spec: SandboxSpec,
    pub root: PathBuf,
    /// The workspace as the host sees it.
    pub workspace: PathBuf,
    pub receipt: EnforcementReceipt,
}

/// One command to run inside a sandbox. Every command carries the consumer
/// identity, the profile's credential route refs and its timeout.
#[derive(Clone)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    /// Extra environment for the process (never passed as arguments).
    pub env: Vec<(String, String)>,
    pub consumer: Consumer,
    pub credential_route_refs: Vec<String>,
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

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The backend cannot work on this host (e.g. bwrap missing).
    #[error("sandbox backend unavailable: {0}")]
    Unavailable(String),
    #[error("sandbox creation failed: {0}")]
    Create(String),
    #[error("spawn in sandbox failed: {0}")]
    Spawn(String),
    #[error("sandbox destroy failed: {0}")]
    Destroy(String),
}

#[async_trait]
pub trait SandboxBackend: Send + Sync {
    fn kind(&self) -> SandboxType;
    /// Whether this host can enforce the backend; `Err` carries the reason.
    async fn probe(&self) -> Result<(), SandboxError>;
    /// Creates the sandbox. A returned sandbox whose state is not `Ready`
    /// is a failed creation that still has to be destroyed.
    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError>;
    /// Starts a process inside the sandbox, in its own process group.
    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError>;
    /// Kills whatever still runs in the sandbox and removes its files.
    async fn destroy(&self, sandbox: &Sandbox) -> Result<(), SandboxError>;
}

/// The backends a daemon can use, by type.
#[derive(Clone)]
pub struct Backends {
    pub linux_bwrap: Arc<dyn SandboxBackend>,
    pub none: Arc<dyn SandboxBackend>,
}

impl Backends {
    pub fn host_default() -> Self {
        Backends { linux_bwrap: Arc::new(BwrapBackend::detect()), none: Arc::new(NoneBackend::default()) }
    }

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
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin".into()),
        ("HOME".into(), home.to_string()),
        ("LANG".into(), "C.UTF-8".into()),
        ("TMPDIR".into(), "/tmp".into()),
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
