//! Reins: how the daemon starts a harness inside a sandbox, hands it a
//! task, reads its progress and its result, and cleans up after it.
//!
//! `start_session` → `dispatch_tool`... → `end_session` → `cleanup_session`;
//! the lifecycle calls `cleanup_session` whenever `start_session` succeeded.

mod command;
mod lines;
pub mod protocol;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use command::CommandRein;

use crate::catalog::Profile;
use crate::sandbox::{Consumer, Sandbox, SandboxBackend};

/// Everything a rein needs to start a harness.
#[derive(Clone)]
pub struct StartContext {
    pub backend: Arc<dyn SandboxBackend>,
    pub sandbox: Sandbox,
    pub profile: Arc<Profile>,
    pub consumer: Consumer,
}

/// The task as the harness receives it (one JSON object on stdin).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Task {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub execution_id: String,
    pub title: String,
    pub description: String,
    /// Where the workspace is, as the harness sees it.
    pub workspace: String,
}

#[derive(Clone, Debug)]
pub struct ToolCall {
    /// `run_task` for executions.
    pub tool: String,
    pub task: Task,
}

/// What the harness reported while it worked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HarnessEvent {
    Progress { message: String, tokens_so_far: u64 },
    ToolUse { tool: String, tokens_so_far: u64 },
    OutputTruncated { stream: &'static str, bytes_dropped: u64 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolResult {
    pub ok: bool,
    /// Raw: only for the direct caller.
    pub output: String,
    /// Raw: only for the direct caller.
    pub error: String,
    pub tokens_spent: u64,
    pub resolved_model: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ReinError {
    #[error("harness start failed: {0}")]
    Start(String),
    #[error("harness dispatch failed: {0}")]
    Dispatch(String),
    #[error("harness timed out after {0:?}")]
    TimedOut(Duration),
    #[error("cancelled")]
    Cancelled,
    #[error("harness end failed: {0}")]
    End(String),
    #[error("harness cleanup failed: {0}")]
    Cleanup(String),
}

#[async_trait]
pub trait Rein: Send + Sync {
    fn name(&self) -> &str;
    async fn start_session(&self, ctx: StartContext) -> Result<Box<dyn HarnessSession>, ReinError>;
}

#[async_trait]
pub trait HarnessSession: Send {
    /// Hands one tool call to the harness and waits for its result,
    /// reporting progress on `events`. Stops early on `cancel`.
    async fn dispatch_tool(
        &mut self,
        call: ToolCall,
        events: mpsc::Sender<HarnessEvent>,
        cancel: CancellationToken,
    ) -> Result<ToolResult, ReinError>;
    async fn end_session(&mut self) -> Result<(), ReinError>;
    /// Kills whatever the harness left running. Safe to call twice.
    async fn cleanup_session(&mut self) -> Result<(), ReinError>;
}
