//! How the tool calls of the real agent CLIs reach the daemon's tool_call
//! gate before they run.
//!
//! Claude Code and Codex both have a pre-tool hook in their *managed*
//! (administrator) settings layer, which nothing in the agent's HOME or
//! workspace can switch off. corral writes that layer itself and binds it
//! read-only at the CLI's fixed system path inside the sandbox
//! ([`hook::managed_files`]); the hook reaches a gate endpoint that the
//! daemon opens inside the sandbox's own network namespace at every spawn
//! ([`endpoint`]), so only that sandbox can reach it. Claude Code POSTs to
//! it directly (an `http` hook, `onFailure: "block"`); Codex runs a
//! command, which is the corral binary bound read-only ([`helper`]) and
//! forwards the call. Whatever goes wrong on the way (endpoint down, a
//! malformed call, the run ending) the answer is a deny: a tool call runs
//! only when the gate said so.

pub mod approvals;
pub mod endpoint;
pub mod helper;
pub mod hook;

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use endpoint::{serve, HookRequest};
pub use hook::{HookCall, Verdict};

pub use crate::sandbox::GATE_PORT;
/// The path both hooks call.
pub const HOOK_PATH: &str = "/v1/pre-tool-use";
pub use crate::catalog::HELPER_PATH;
/// The file name that makes the corral binary the hook helper.
pub const HELPER_NAME: &str = "corral-gate-hook";

/// `[gate]`: how the real agents' tool calls reach the gate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateConfig {
    /// The hook helper Codex runs before each tool call: the corral binary
    /// (default: the daemon's own executable). Bound read-only into the
    /// sandbox; it must be readable by the sandboxes' uids.
    pub hook_program: Option<PathBuf>,
}

impl GateConfig {
    /// The helper to bind: the configured one, else the running daemon's
    /// executable when it is the corral binary (a test harness embedding
    /// the daemon is not, and must name one).
    pub fn hook_program(&self) -> Option<PathBuf> {
        if let Some(path) = &self.hook_program {
            return Some(path.clone());
        }
        let exe = std::env::current_exe().ok()?;
        let is_corral = exe.file_name().is_some_and(|n| n == "corral");
        is_corral.then_some(exe)
    }

    /// Checks the configured helper is an absolute path to a file.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let Some(path) = &self.hook_program else { return Ok(()) };
        let key = "gate.hook_program".to_string();
        if !path.is_absolute() {
            return Err((key, format!("{} must be an absolute path", path.display())));
        }
        if !Path::new(path).is_file() {
            return Err((key, format!("{} is not a file", path.display())));
        }
        Ok(())
    }
}
