//! What a sandbox is asked to enforce, and for whom.

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
    #[serde(rename = "type")]
    pub sandbox_type: SandboxType,
    #[serde(default)]
    pub allow_network: bool,
    /// Relative paths are inside the workspace ("." is the workspace);
    /// absolute paths are host paths bound writable at the same place.
    #[serde(default)]
    pub write_paths: Vec<String>,
    /// Absolute host paths bound read-only at the same place.
    #[serde(default)]
    pub read_paths: Vec<String>,
    /// Daemon environment variables the harness may see.
    #[serde(default)]
    pub env_passthrough: Vec<String>,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        SandboxSpec {
            sandbox_type: SandboxType::LinuxBwrap,
            allow_network: false,
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
    pub actor: String,
    pub project: String,
    pub run_id: String,
    pub session_id: String,
}

impl Consumer {
    /// The identity as environment variables for in-sandbox commands.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("CORRAL_ACTOR".into(), self.actor.clone()),
            ("CORRAL_PROJECT".into(), self.project.clone()),
            ("CORRAL_RUN_ID".into(), self.run_id.clone()),
            ("CORRAL_SESSION_ID".into(), self.session_id.clone()),
        ]
    }
}
