//! What a sandbox is asked to enforce, for whom, where it is in its life,
//! and the receipt of what it enforced.

use serde::{Deserialize, Serialize};

/// The isolation technology behind a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxType {
    /// bubblewrap: fresh namespaces, read-only system, writable workspace.
    LinuxBwrap,
    /// A plain child process in a private workspace: no isolation at all.
    None,
}

impl SandboxType {
    /// The type's snake_case word, as profiles and records spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxType::LinuxBwrap => "linux_bwrap",
            SandboxType::None => "none",
        }
    }
}

/// A sandbox as a profile asks for it, or as the gate left it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// The isolation technology; `linux_bwrap` when left out.
    #[serde(rename = "type", default = "linux_bwrap")]
    pub sandbox_type: SandboxType,
    /// Egress through the daemon's proxy, to `allow_hosts` only. The host
    /// network is never shared with a `linux_bwrap` sandbox.
    #[serde(default)]
    pub allow_network: bool,
    /// Where egress may go: `api.anthropic.com`, `*.github.com`, optional
    /// `:port` (default 443 and 80), `*` (any public host), or an exact
    /// `address:port` for a loopback or private address.
    #[serde(default)]
    pub allow_hosts: Vec<String>,
    /// Relative paths are inside the workspace ("." is the workspace);
    /// absolute paths are host paths bound writable at the same place.
    /// (A profile's `[sandbox]` that leaves it out gets `["."]`: see the
    /// catalog; a stored spec leaves out an empty list.)
    #[serde(default)]
    pub write_paths: Vec<String>,
    /// Absolute host paths bound read-only at the same place.
    #[serde(default)]
    pub read_paths: Vec<String>,
    /// Daemon environment variables the harness may see.
    #[serde(default)]
    pub env_passthrough: Vec<String>,
}

/// A `[sandbox]` that names no type gets the isolating one.
fn linux_bwrap() -> SandboxType {
    SandboxType::LinuxBwrap
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec {
            sandbox_type: SandboxType::LinuxBwrap,
            allow_network: false,
            allow_hosts: Vec::new(),
            write_paths: vec![".".to_string()],
            read_paths: Vec::new(),
            env_passthrough: Vec::new(),
        }
    }
}

/// Who a sandbox is for. Carried by the sandbox and by every command run in it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Consumer {
    /// The governed consumer type: `adm`, `agt` or `atm`.
    pub actor: String,
    /// The project the run belongs to.
    pub project: String,
    /// The id of the execution or session the sandbox serves.
    pub run_id: String,
    /// The session's id; empty for an execution.
    pub session_id: String,
    /// The principal it runs for.
    pub principal: String,
}

impl Consumer {
    /// The identity as environment variables for in-sandbox commands.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("CORRAL_ACTOR".into(), self.actor.clone()),
            ("CORRAL_PROJECT".into(), self.project.clone()),
            ("CORRAL_RUN_ID".into(), self.run_id.clone()),
            ("CORRAL_SESSION_ID".into(), self.session_id.clone()),
            ("CORRAL_PRINCIPAL".into(), self.principal.clone()),
        ]
    }
}

/// Where a sandbox is in its life. Persisted with the sandbox row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being set up; not usable yet.
    Creating,
    /// Set up and usable.
    Ready,
    /// Setting it up failed.
    Failed,
    /// Being torn down.
    Destroying,
    /// Torn down; the last state.
    Destroyed,
}

impl SandboxState {
    /// The state's snake_case word, as stored.
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

/// One enforced limit and what enforces it. Stored as `["name", value,
/// "mechanism"]` (a receipt has one per limit; keeping `sandbox_ready`'s
/// body within the ~1,000 bytes an events row holds in its page, see
/// BENCHMARKS.md); the `{"name": …, "value": …, "mechanism": …}` form of
/// older rows still reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "(String, u64, String)", from = "StoredLimit")]
pub struct LimitReceipt {
    /// The limit's name, as in the profile's limits (`memory_bytes`, ...).
    pub name: String,
    /// The enforced value, in the limit's own unit; only limits above 0 get a
    /// receipt.
    pub value: u64,
    /// e.g. `cgroup v1`, `cgroup v2`, `rlimit NPROC`, `rlimit NOFILE`.
    pub mechanism: String,
}

impl From<LimitReceipt> for (String, u64, String) {
    fn from(l: LimitReceipt) -> Self {
        (l.name, l.value, l.mechanism)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StoredLimit {
    Triple(String, u64, String),
    Object {
        #[serde(default)]
        name: String,
        #[serde(default)]
        value: u64,
        #[serde(default)]
        mechanism: String,
    },
}

impl From<StoredLimit> for LimitReceipt {
    fn from(l: StoredLimit) -> Self {
        match l {
            StoredLimit::Triple(name, value, mechanism) | StoredLimit::Object { name, value, mechanism } => {
                LimitReceipt { name, value, mechanism }
            }
        }
    }
}

/// Proof of what a sandbox enforces.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EnforcementReceipt {
    /// sha256 (hex) of the sandbox command line up to and including `--`,
    /// NUL-separated; empty for `none`.
    pub command_digest: String,
    /// The sandbox has a network namespace of its own (the host network is
    /// never shared); false only for `none`.
    pub network_isolated: bool,
    /// `none` (no egress) or `proxy` (through the daemon, to `allow_hosts`).
    pub egress: String,
    /// The egress allowlist the proxy enforces; empty when the sandbox has no
    /// network.
    pub allow_hosts: Vec<String>,
    /// The paths the sandbox's processes may write, as they see them.
    pub write_roots: Vec<String>,
    /// The host uid the sandbox's processes run as.
    pub host_uid: u32,
    /// Whether that uid belongs to this sandbox alone.
    pub own_uid: bool,
    /// The uid the harness sees inside.
    pub inside_uid: u32,
    /// `sha256:<hex>` of the seccomp program; empty when there is none.
    pub seccomp_digest: String,
    /// Whether nested user namespaces are refused.
    pub userns_disabled: bool,
    /// Each enforced limit and what enforces it.
    pub limits: Vec<LimitReceipt>,
    /// Credential routes presented by the daemon's gateway (the harness
    /// holds placeholders).
    pub gateway_routes: Vec<String>,
    /// Credential routes whose real value the harness's environment holds
    /// (`expose = true`, or a built-in's model key in a `none` sandbox).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exposed_routes: Vec<String>,
}
