//! The `command` rein: runs the profile's argv inside the sandbox, writes
//! the task to stdin (never argv), and reads the JSON-lines protocol (or a
//! preset's format) from stdout.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::lines::{CappedBuffer, LineReader};
use super::protocol::{parse_line, Line, ParserState};
use super::{HarnessEvent, HarnessSession, Rein, ReinError, StartContext, ToolCall, ToolResult};
use crate::catalog::{Preset, TaskInput};
use crate::sandbox::{ExecSpec, SandboxProcess};

/// How long a harness gets between SIGTERM and SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How long a harness gets to exit once its session is ended.
const END_GRACE: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct CommandRein;

#[async_trait]
impl Rein for CommandRein {
    fn name(&self) -> &str {
        "command"
    }

    async fn start_session(&self, ctx: StartContext) -> Result<Box<dyn HarnessSession>, ReinError> {
        let profile = &ctx.profile.file;
        let timeout = Duration::from_secs(profile.limits.timeout_seconds);
        let spec = ExecSpec {
            argv: profile.rein.argv.clone(),
            env: Vec::new(),
            consumer: ctx.consumer.clone(),
            credential_route_refs: profile.credential_route_refs.clone(),
            timeout,
        };
        let process = ctx.backend.spawn(&ctx.sandbox, &spec).await.map_err(|e| ReinError::Start(e.to_string()))?;
        Ok(Box::new(CommandSession {
            process,
            deadline: Instant::now() + timeout,
            timeout,
            input: profile.rein.input,
            preset: profile.rein.preset,
            max_output: profile.limits.max_output_bytes as usize,
        }))
    }
}

struct CommandSession {
    process: SandboxProcess,
    deadline: Instant,
    timeout: Duration,
    input: TaskInput,
    preset: Preset,
    max_output: usize,
}

impl CommandSession {
    fn stdin_bytes(&self, call: &ToolCall) -> Vec<u8> {
        match self.input {
            TaskInput::TaskJson => {
                let mut bytes = serde_json::to_vec(&call.task).unwrap_or_default();
                bytes.push(b'\n');
                bytes
            }
            TaskInput::Description => call.task.description.clone().into_bytes(),
            TaskInput::Prompt => format!("{}\n\n{}", call.task.title, call.task.description).into_bytes(),
            TaskInput::Nothing => Vec::new(),
        }
    }

    /// Reads stdout and stderr to their ends and waits for the exit.
    async fn run(&mut self, call: ToolCall, events: &mpsc::Sender<HarnessEvent>) -> Result<ToolResult, ReinError> {
        let input = self.stdin_bytes(&call);
        let stdin = self.process.stdin.take();
        // Written concurrently with reading: a harness that prints before
        // it reads must not deadlock against a full pipe.
        let writer = tokio::spawn(async move {
            if let Some(mut stdin) = stdin {
                // A harness that exits without reading is not an error here;
                // its exit status tells.
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            }
        });
        let stdout = self.process.stdout.take().ok_or_else(|| ReinError::Dispatch("stdout already taken".into()))?;
        let stderr = self.process.stderr.take();
        let max_output = self.max_output;
        let stderr_task = tokio::spawn(async move {
            let mut buf = CappedBuffer::new(max_output);
            if let Some(stderr) = stderr {
                let mut reader = LineReader::new(stderr);
                while let Ok(Some((line, dropped))) = reader.next_line().await {
                    buf.push_line(&line, dropped);
                }
            }
            buf
        });

        let mut reader = LineReader::new(stdout);
        let mut plain = CappedBuffer::new(self.max_output);
        let mut state = ParserState::default();
        let mut result: Option<ToolResult> = None;
        while let Some((line, dropped)) =
            reader.next_line().await.map_err(|e| ReinError::Dispatch(format!("reading stdout: {e}")))?
        {
            match parse_line(self.preset, &line, &mut state) {
                Line::Plain => plain.push_line(&line, dropped),
                Line::Event(event) => {
                    // The lifecycle is gone only if it is shutting down.
                    let _ = events.send(event).await;
                }
                Line::Result(r) => result = Some(r),
                Line::Ignored => {}
            }
        }
        let stderr = stderr_task.await.unwrap_or_default();
        let _ = writer.await;
        let status = self.process.wait().await.map_err(|e| ReinError::Dispatch(format!("wait: {e}")))?;
        for (stream, dropped) in [("stdout", plain.dropped), ("stderr", stderr.dropped)] {
            if dropped > 0 {
                let _ = events.send(HarnessEvent::OutputTruncated { stream, bytes_dropped: dropped }).await;
            }
        }
        let mut result = match result {
            Some(mut r) => {
                if r.output.is_empty() {
                    r.output = plain.text;
                }
                r
            }
            None => ToolResult {
                ok: status.success(),
                output: plain.text,
                tokens_spent: state.tokens,
                resolved_model: state.model,
                ..ToolResult::default()
            },
        };
        if !result.ok && result.error.is_empty() {
            result.error = match status.code() {
                Some(code) => format!("harness exited with status {code}"),
                None => "harness was killed by a signal".to_string(),
            };
            if !stderr.text.is_empty() {
                result.error.push_str(": ");
                result.error.push_str(stderr.text.trim_end());
            }
        }
        Ok(result)
    }
}

#[async_trait]
impl HarnessSession for CommandSession {
    async fn dispatch_tool(
        &mut self,
        call: ToolCall,
        events: mpsc::Sender<HarnessEvent>,
        cancel: CancellationToken,
    ) -> Result<ToolResult, ReinError> {
        enum Stop {
            Done(Result<ToolResult, ReinError>),
            TimedOut,
            Cancelled,
        }
        let deadline = tokio::time::Instant::from_std(self.deadline);
        let stop = tokio::select! {
            result = self.run(call, &events) => Stop::Done(result),
            _ = tokio::time::sleep_until(deadline) => Stop::TimedOut,
            _ = cancel.cancelled() => Stop::Cancelled,
        };
        match stop {
            Stop::Done(result) => result,
            Stop::TimedOut => {
                let _ = self.process.terminate(KILL_GRACE).await;
                Err(ReinError::TimedOut(self.timeout))
            }
            Stop::Cancelled => {
                let _ = self.process.terminate(KILL_GRACE).await;
                Err(ReinError::Cancelled)
            }
        }
    }

    /// A one-shot harness has ended when its process has: close its stdin
    /// (a harness still waiting for input sees EOF) and give it a short
    /// grace, within what is left of its timeout.
    async fn end_session(&mut self) -> Result<(), ReinError> {
        drop(self.process.stdin.take());
        let deadline = tokio::time::Instant::from_std(self.deadline.min(Instant::now() + END_GRACE));
        match tokio::time::timeout_at(deadline, self.process.wait()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(ReinError::End(format!("wait: {e}"))),
            Err(_) => Err(ReinError::End(format!("harness did not exit within {END_GRACE:?} of its end"))),
        }
    }

    async fn cleanup_session(&mut self) -> Result<(), ReinError> {
        if self.process.has_exited() {
            return Ok(());
        }
        self.process.kill().await.map(|_| ()).map_err(|e| ReinError::Cleanup(format!("kill: {e}")))
    }
}
