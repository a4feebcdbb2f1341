//! The `command` rein: runs the profile's argv inside the sandbox, writes
//! each task to stdin (never argv), and reads the JSON-lines protocol (or a
//! preset's format) from stdout.
//!
//! With `input = "task_json"` the harness is a session: one task line per
//! turn, answered by one `result` line, stdin kept open for the next turn
//! and for `policy_verdict` answers. The other input modes are one-shot:
//! the input is written, stdin closed, and the harness runs to its exit.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sandbox::process::{ProcessStdin, ProcessStdout};
use async_trait::async_trait;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::cli_setup::{self, SandboxTrust};
use super::home;
use super::lines::{line_bytes, pipe_max_size, CappedBuffer, Counted, ExitDrain, LineReader, ReadCount, Wait};
use super::protocol::{parse_line, Line, ParserState};
use super::{Dispatch, HarnessEvent, HarnessSession, Rein, ReinError, StartContext, ToolCall, ToolResult};
use crate::catalog::{Preset, TaskInput};
use crate::gate::HookRequest;
use crate::sandbox::{ExecSpec, SandboxProcess};

/// How long a harness gets between SIGTERM and SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How long a harness gets to exit once its session is ended.
const END_GRACE: Duration = Duration::from_secs(5);
/// Once the harness has exited and what it wrote has been read, how long
/// its stdout may stay quiet before the rest is no longer waited for. A
/// process it left in the background may hold the pipe open forever; the
/// run does not wait for it (teardown kills it). See [`ExitDrain`].
const EXIT_DRAIN: Duration = Duration::from_millis(500);
/// And how long those reads may wait for a line in all (something it left
/// behind may write now and then, forever).
const EXIT_DRAIN_MAX: Duration = Duration::from_secs(10);
/// How often what is owed is looked at again while an owed line is
/// awaited (the reader may find that the last one was left unfinished).
const OWED_LOOK: Duration = Duration::from_millis(50);
/// Lines read ahead of the turn loop.
const STDOUT_AHEAD: usize = 64;
/// And their bytes together: two whole lines of [`MAX_LINE`]. A harness
/// that writes while nothing reads (between turns, while a call waits for
/// a person) holds at most this of the daemon's memory, not 64 lines of
/// 1 MiB each for as long as its session lives.
const STDOUT_AHEAD_BYTES: usize = 2 * super::lines::MAX_LINE;

/// A line read ahead, with its share of [`STDOUT_AHEAD_BYTES`], given
/// back once the turn loop takes it.
type AheadLine = (std::io::Result<(Vec<u8>, u64)>, Option<tokio::sync::OwnedSemaphorePermit>);

/// The harness's stdout, read line by line on a task of its own, so the
/// turn can wait for a line and for the harness's exit at once (reading a
/// line is not cancel-safe; receiving one is).
struct StdoutLines {
    lines: tokio::sync::mpsc::Receiver<AheadLine>,
    /// What the reader has taken from the pipe.
    count: Arc<ReadCount>,
    /// The pipe's read end, duplicated: what is still in it.
    pipe: Option<OwnedFd>,
    /// Where the lines received end (see [`line_bytes`]).
    received: u64,
}

impl StdoutLines {
    fn read(pipe: ProcessStdout) -> StdoutLines {
        let (tx, lines) = tokio::sync::mpsc::channel(STDOUT_AHEAD);
        let count = Arc::new(ReadCount::default());
        let dup = pipe.as_fd().try_clone_to_owned().ok();
        let counted = Counted::new(pipe, count.clone());
        let room = Arc::new(tokio::sync::Semaphore::new(STDOUT_AHEAD_BYTES));
        tokio::spawn(async move {
            let mut reader = LineReader::new(counted);
            loop {
                match reader.next_line().await {
                    Ok(None) => break,
                    Ok(Some(line)) => {
                        // A line is at most MAX_LINE: it always fits.
                        let bytes = line.0.len().clamp(1, STDOUT_AHEAD_BYTES) as u32;
                        let Ok(share) = room.clone().acquire_many_owned(bytes).await else { break };
                        if tx.send((Ok(line), Some(share))).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send((Err(e), None)).await;
                        break;
                    }
                }
            }
        });
        StdoutLines { lines, count, pipe: dup, received: 0 }
    }

    /// The next line (cancel-safe).
    async fn recv(&mut self) -> Option<std::io::Result<(Vec<u8>, u64)>> {
        // The line's share of the read-ahead is given back as it is taken.
        let next = self.lines.recv().await.map(|(line, _share)| line);
        if let Some(Ok((line, dropped))) = &next {
            self.received += line_bytes(line, *dropped);
        }
        next
    }

    /// At the harness's exit: where what it wrote ends (what the reader
    /// took, and what the pipe holds), and lines ending past it are no
    /// longer owed. Never past the end: a byte the reader takes while this
    /// looks is counted in neither, and is then read under the leftovers'
    /// bounds (looking again, up to three times, makes that unlikely).
    fn mark_exit(&self) -> u64 {
        let mut written = self.count.taken.load(Ordering::SeqCst);
        if let Some(pipe) = &self.pipe {
            for _ in 0..3 {
                let taken = self.count.taken.load(Ordering::SeqCst);
                let mut in_pipe: libc::c_int = 0;
                // SAFETY: FIONREAD writes one int, the bytes the pipe holds.
                if unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut in_pipe) } != 0 {
                    break;
                }
                written = taken + in_pipe.max(0) as u64;
                if self.count.taken.load(Ordering::SeqCst) == taken {
                    break;
                }
            }
        }
        self.count.mark.store(written, Ordering::SeqCst);
        written
    }

    /// Where the owed lines end, for a harness whose output ended at
    /// `written`: all of it while the reader has not taken it all, then
    /// the end of its last whole line (a line it left unfinished is not
    /// waited for).
    fn owed(&self, written: u64) -> u64 {
        match self.count.taken.load(Ordering::SeqCst) >= written {
            true => self.count.lines_end.load(Ordering::SeqCst),
            false => written,
        }
    }
}

/// The `command` rein (see the module doc): the profile's argv in the sandbox,
/// each task on stdin, the JSON-lines protocol or a preset's format read back
/// from stdout.
#[derive(Default)]
pub struct CommandRein;

#[async_trait]
impl Rein for CommandRein {
    fn name(&self) -> &str {
        "command"
    }

    async fn start_session(&self, ctx: StartContext) -> Result<Box<dyn HarnessSession>, ReinError> {
        let profile = &ctx.profile.file;
        let trust = SandboxTrust::of(&ctx.sandbox);
        let vars: Vec<&str> = ctx.credentials.iter().map(|(name, _)| name.as_str()).collect();
        let gated = !ctx.sandbox.gate.is_empty();
        let model_gateway = model_gateway(&ctx);
        let mut prepared = cli_setup::prepare(&profile.rein, &trust, &vars, gated, model_gateway.as_deref())
            .map_err(ReinError::Start)?;
        // Any gatewayed route, not only the model's: with network the
        // harness has HTTP(S)_PROXY, and the proxy refuses a request to
        // the gateway (loopback, carrying a placeholder).
        if !ctx.gateway.is_empty() {
            cli_setup::bypass_gateway(&mut prepared, gated);
        }
        for (path, text) in &prepared.home_files {
            home::write_file(&ctx.sandbox.home, path, text.as_bytes(), ctx.sandbox.user)
                .map_err(|e| ReinError::Start(format!("cannot write ~/{path} for the harness: {e}")))?;
        }
        let env = profile.git.author_env().into_iter().chain(prepared.env).chain(ctx.credentials.iter().cloned());
        let env: Vec<(String, String)> = env.collect();
        let mut files: Vec<(String, String)> =
            prepared.home_files.iter().map(|(path, text)| (format!("~/{path}"), sha256_hex(text.as_bytes()))).collect();
        // The files the daemon wrote (not the helper binary it binds).
        for (inside, bytes) in ctx.sandbox.gate.contents() {
            files.push((inside.to_string(), sha256_hex(bytes)));
        }
        let invocation = crate::types::evidence::HarnessInvocation {
            argv: prepared.argv.clone(),
            env_names: env.iter().map(|(name, _)| name.clone()).collect(),
            base_url: model_gateway.clone().unwrap_or_else(|| profile.rein.base_url.clone()),
            model: prepared.model.clone(),
            files,
        };
        let max_output = profile.limits.max_output_bytes as usize;
        let stderr = Arc::new(Mutex::new(CappedBuffer::new(max_output)));
        // A harness that reads no input starts its work when it starts: it
        // is launched at its turn, after the gate allowed corral's dispatch
        // (`tool_call:run_task`), so nothing runs before that decision.
        let run = match profile.rein.input {
            TaskInput::Nothing => None,
            _ => Some(Run::launch(&ctx, prepared.argv.clone(), env.clone(), &stderr).await?),
        };
        Ok(Box::new(CommandSession {
            run,
            stderr,
            timeout: ctx.timeout,
            input: profile.rein.input,
            preset: profile.rein.preset,
            resumes: profile.rein.resumes(),
            max_output,
            stdout_dropped: 0,
            parser: ParserState::new(prepared.model.clone()),
            model: prepared.model,
            turns: 0,
            argv: prepared.argv,
            env,
            ctx,
            invocation,
        }))
    }
}

/// One run of the harness's process in the sandbox: its pipes, and the
/// gate endpoint its hook asks (in the sandbox's network namespace, for
/// this process's life).
struct Run {
    process: SandboxProcess,
    stdin: Option<ProcessStdin>,
    stdout: Option<StdoutLines>,
    _endpoint: Option<crate::gate::endpoint::Endpoint>,
    hooks: Option<tokio::sync::mpsc::Receiver<HookRequest>>,
    _gateway: Option<crate::credentials::gateway::Gateway>,
}

/// The gateway URL of the route a Claude Code or Codex harness reads its
/// model key from (Claude: its key variable; Codex: its first route), when
/// that route goes through the gateway.
fn model_gateway(ctx: &StartContext) -> Option<String> {
    let preset = ctx.profile.file.rein.preset;
    let model_key = |(i, (var, _)): &(usize, &(String, String))| match preset {
        Preset::ClaudeStreamJson => var == "ANTHROPIC_API_KEY" || var == "ANTHROPIC_AUTH_TOKEN",
        Preset::CodexExecJson => *i == 0,
        Preset::Protocol => false,
    };
    let (_, (_, value)) = ctx.credentials.iter().enumerate().find(model_key)?;
    let route = ctx.gateway.iter().find(|r| &r.placeholder == value)?;
    Some(crate::credentials::Plan::gateway_url(&route.name))
}

impl Run {
    async fn launch(
        ctx: &StartContext,
        argv: Vec<String>,
        env: Vec<(String, String)>,
        stderr: &Arc<Mutex<CappedBuffer>>,
    ) -> Result<Run, ReinError> {
        let spec = ExecSpec {
            argv,
            env,
            consumer: ctx.consumer.clone(),
            credential_route_refs: ctx.profile.file.credential_route_refs.clone(),
            timeout: ctx.timeout,
        };
        let mut process = ctx.backend.spawn(&ctx.sandbox, &spec).await.map_err(|e| ReinError::Start(e.to_string()))?;
        // The agent's hook asks here before each tool call; a sandbox with
        // hook files and no endpoint would block every call, so it is an
        // error now rather than a run that cannot work.
        let hooks = match (process.gate_listener.take(), !ctx.sandbox.gate.is_empty()) {
            (Some(listener), _) => {
                let (tx, rx) = tokio::sync::mpsc::channel(HOOKS_AHEAD);
                Some((crate::gate::serve(listener, tx), rx))
            }
            (None, true) => {
                let _ = process.kill().await;
                return Err(ReinError::Start("the sandbox has the agent's hook but no gate endpoint".into()));
            }
            (None, false) => None,
        };
        let (endpoint, hooks) = hooks.unzip();
        let gateway = match (process.gateway_listener.take(), ctx.gateway.is_empty()) {
            (Some(listener), _) => {
                // Every request it forwards or refuses is an `egress` event:
                // without the sandbox's log to record them in, it does not run.
                let Some(log) = ctx.sandbox.egress.clone() else {
                    let _ = process.kill().await;
                    return Err(ReinError::Start("the sandbox has a credential gateway but no egress log".into()));
                };
                Some(crate::credentials::gateway::serve(listener, ctx.gateway.clone(), log))
            }
            (None, false) => {
                let _ = process.kill().await;
                return Err(ReinError::Start("the sandbox has gatewayed credentials but no gateway".into()));
            }
            (None, true) => None,
        };
        if let Some(pipe) = process.stderr.take() {
            // Drained for the harness's whole life, so it never blocks on a
            // full stderr pipe between turns.
            let sink = stderr.clone();
            tokio::spawn(async move {
                let mut reader = LineReader::new(pipe);
                while let Ok(Some((line, dropped))) = reader.next_line().await {
                    sink.lock().unwrap_or_else(|e| e.into_inner()).push_line(&line, dropped);
                }
            });
        }
        Ok(Run {
            stdin: process.stdin.take(),
            stdout: process.stdout.take().map(StdoutLines::read),
            process,
            _endpoint: endpoint,
            hooks,
            _gateway: gateway,
        })
    }
}

/// What a Claude Code or Codex run is asked: a turn's `prompt` argument,
/// else the task's title and description.
fn prompt_of(task: &super::Task) -> String {
    match task.arguments.get("prompt").and_then(serde_json::Value::as_str) {
        Some(prompt) => prompt.to_string(),
        None if task.title.is_empty() => task.description.clone(),
        None => format!("{}\n\n{}", task.title, task.description),
    }
}

/// The argv of a later turn of a session of Claude Code or Codex: the
/// first turn's, resuming `conversation`. Only an argv that runs the CLI
/// itself can be told so; a wrapper cannot, and a turn that would silently
/// start a new conversation is an error instead.
pub fn resume_argv(preset: Preset, argv: &[String], conversation: &str) -> Result<Vec<String>, String> {
    // The parser keeps only such ids; a flag here would be the harness's.
    if !conversation.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric()) {
        return Err("the conversation id the agent reported is not a plain id".into());
    }
    let runs = |name: &str| argv.first().is_some_and(|p| p == name || p.ends_with(&format!("/{name}")));
    let mut resumed = argv.to_vec();
    match preset {
        Preset::ClaudeStreamJson if runs("claude") => {
            resumed.splice(1..1, ["--resume".to_string(), conversation.to_string()]);
        }
        Preset::CodexExecJson if runs("codex") => {
            let exec = argv.iter().position(|a| a == "exec").ok_or("its argv runs codex without exec")?;
            resumed.splice(exec + 1..exec + 1, ["resume".to_string(), conversation.to_string()]);
        }
        _ => return Err("its argv does not run claude or codex itself, so it cannot be told to resume".into()),
    }
    Ok(resumed)
}

struct CommandSession {
    /// The harness's current run; none yet for a harness that reads no
    /// input before its turn (see `start_session`).
    run: Option<Run>,
    stderr: Arc<Mutex<CappedBuffer>>,
    timeout: Duration,
    input: TaskInput,
    preset: Preset,
    /// Each turn is a run of its own that resumes the conversation.
    resumes: bool,
    max_output: usize,
    /// Bytes of stdout the current turn dropped past `max_output` so far:
    /// reported even when the turn is cut (timeout, cancel).
    stdout_dropped: u64,
    parser: ParserState,
    /// The model the parser starts each run from.
    model: String,
    turns: u64,
    /// How a later turn's run is started.
    argv: Vec<String>,
    env: Vec<(String, String)>,
    ctx: StartContext,
    /// How the current run was started, for the evidence.
    invocation: crate::types::evidence::HarnessInvocation,
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Hook calls queued for the turn loop.
const HOOKS_AHEAD: usize = 16;
/// Refused call ids kept per harness (past it, a refusal fails the run as
/// the CLI reports it).
const MAX_GATE_DENIED: usize = 10_000;

/// The next hook call, or never when the harness has no hook.
async fn next_hook(hooks: &mut Option<tokio::sync::mpsc::Receiver<HookRequest>>) -> Option<HookRequest> {
    match hooks {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// One of the agent's own tool calls, from its hook: the same tool_call
/// gate a protocol harness asks. Its `gated` event is handed to the run's
/// recorder before the answer goes back, and stored in order with the
/// run's other events (not waited for: a store that refuses it past its
/// retries loses it, as any event; see the README's durability).
async fn answer_hook(request: HookRequest, dispatch: &Dispatch, parser: &mut ParserState) {
    let HookRequest { call, mut reply } = request;
    // A hook that hangs up (its CLI timed out, or died) closes the reply:
    // a call still waiting for a person is then withdrawn and denied.
    let verdict =
        super::decide_call(dispatch.gate.as_ref(), &dispatch.events, &call.tool, &call.arguments, reply.closed()).await;
    if !verdict.allow && !call.call_id.is_empty() && parser.gate_denied.len() < MAX_GATE_DENIED {
        parser.gate_denied.push(call.call_id.clone());
    }
    // The hook may have given up: nothing to answer.
    let _ = reply.send(verdict);
}

impl CommandSession {
    /// Whether each turn is a run of its own that reads its input and
    /// exits (every input but a protocol harness's task lines).
    fn one_shot(&self) -> bool {
        self.input != TaskInput::TaskJson
    }

    fn input_bytes(&self, call: &ToolCall) -> Vec<u8> {
        match self.input {
            TaskInput::TaskJson => {
                let mut bytes = serde_json::to_vec(&call.task).unwrap_or_default();
                bytes.push(b'\n');
                bytes
            }
            TaskInput::Description => call.task.description.clone().into_bytes(),
            TaskInput::Prompt => prompt_of(&call.task).into_bytes(),
            TaskInput::Nothing => Vec::new(),
        }
    }

    /// The argv of the run that continues the conversation the last run
    /// reported, or why there is none.
    fn resumed_argv(&self) -> Result<Vec<String>, ReinError> {
        let conversation = &self.parser.conversation;
        if conversation.is_empty() {
            return Err(ReinError::Dispatch(
                "the agent never said which conversation it had, so the next turn cannot continue it".into(),
            ));
        }
        resume_argv(self.preset, &self.argv, conversation)
            .map_err(|why| ReinError::Dispatch(format!("this session cannot continue its conversation: {why}")))
    }

    /// Whether `input` is a prompt turn's input with no prompt in it: such
    /// a turn is refused before it runs anything.
    fn lacks_prompt(&self, input: &[u8]) -> bool {
        self.input == TaskInput::Prompt && input.trim_ascii().is_empty()
    }

    /// A later turn of a Claude Code or Codex session: a new run of the
    /// CLI in the same sandbox (its HOME keeps the conversation), resuming
    /// the conversation the last run reported.
    async fn resume(&mut self) -> Result<(), ReinError> {
        let argv = self.resumed_argv();
        let conversation = std::mem::take(&mut self.parser.conversation);
        let argv = argv?;
        if let Some(run) = self.run.as_mut() {
            if !run.process.has_exited() {
                let _ = run.process.terminate(KILL_GRACE).await;
            }
        }
        self.invocation.argv = argv.clone();
        self.run = Some(Run::launch(&self.ctx, argv, self.env.clone(), &self.stderr).await?);
        self.parser = ParserState::new(self.model.clone());
        self.parser.conversation = conversation;
        Ok(())
    }

    fn take_stderr(&self) -> CappedBuffer {
        let mut buf = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *buf, CappedBuffer::new(self.max_output))
    }

    async fn write_stdin(&mut self, bytes: &[u8]) -> Result<(), String> {
        let stdin = self.run.as_mut().and_then(|run| run.stdin.as_mut()).ok_or("stdin is closed")?;
        stdin.write_all(bytes).await.map_err(|e| e.to_string())?;
        stdin.flush().await.map_err(|e| e.to_string())
    }

    /// One turn: write the input, read until a `result` line (or the end of
    /// stdout), answering policy requests on the way.
    async fn turn(&mut self, call: ToolCall, dispatch: &Dispatch) -> Result<ToolResult, ReinError> {
        // Checked before the turn counts: a turn refused here ran nothing,
        // so the next one is still the first run, not a resume of a
        // conversation that never began.
        let input = self.input_bytes(&call);
        if self.lacks_prompt(&input) {
            return Err(ReinError::Dispatch(
                "the turn has no prompt: give it arguments_json {\"prompt\": \"...\"} (or a description)".into(),
            ));
        }
        self.turns += 1;
        let one_shot = self.one_shot();
        if one_shot && self.turns > 1 {
            if !self.resumes {
                return Err(ReinError::Dispatch(format!("input mode {:?} takes a single turn", self.input)));
            }
            self.resume().await?;
        }
        let run = match self.run.take() {
            Some(run) => run,
            None => Run::launch(&self.ctx, self.argv.clone(), self.env.clone(), &self.stderr).await?,
        };
        let run = self.run.insert(run);
        if one_shot {
            // Written concurrently with reading: a harness that prints
            // before it has read all its input must not deadlock.
            if let Some(mut stdin) = run.stdin.take() {
                tokio::spawn(async move {
                    // A harness that exits without reading is judged by its
                    // exit status, not by this write.
                    let _ = stdin.write_all(&input).await;
                    let _ = stdin.shutdown().await;
                });
            }
        } else if let Err(e) = self.write_stdin(&input).await {
            return Err(ReinError::Exited(format!("cannot write the task: {e}")));
        }

        let mut plain = CappedBuffer::new(self.max_output);
        self.stdout_dropped = 0;
        let mut result = None;
        // Set when the harness has exited (with where its output ended):
        // what it wrote is read to the end.
        let mut drain: Option<(ExitDrain, u64)> = None;
        while let Some(Run { stdout, hooks, process, .. }) = self.run.as_mut() {
            let Some(lines) = stdout.as_mut() else { break };
            let next = match drain.as_mut() {
                None => tokio::select! {
                    biased;
                    Some(request) = next_hook(hooks) => {
                        answer_hook(request, dispatch, &mut self.parser).await;
                        continue;
                    }
                    next = lines.recv() => next,
                    exited = process.wait() => {
                        exited.map_err(|e| ReinError::Dispatch(format!("wait: {e}")))?;
                        let written = lines.mark_exit();
                        drain = Some((ExitDrain::new(pipe_max_size(), EXIT_DRAIN, EXIT_DRAIN_MAX), written));
                        continue;
                    }
                },
                // The harness's own lines are read to the end, however
                // slowly; past the drain's bounds what is left of stdout is
                // a process it started.
                Some((drain, written)) => match drain.next_wait(lines.received, lines.owed(*written)) {
                    Wait::Stop => None,
                    Wait::Owed => match tokio::time::timeout(OWED_LOOK, lines.recv()).await {
                        Ok(next) => next,
                        Err(_) => continue,
                    },
                    Wait::AtMost(wait) => {
                        let asked = tokio::time::Instant::now();
                        let next = tokio::time::timeout(wait, lines.recv()).await.unwrap_or_default();
                        drain.waited(asked.elapsed());
                        next
                    }
                },
            };
            let Some(next) = next else {
                *stdout = None;
                break;
            };
            let (line, dropped) = next.map_err(|e| ReinError::Dispatch(format!("reading stdout: {e}")))?;
            match parse_line(self.preset, &line, &mut self.parser) {
                Line::Plain => {
                    // Live for the direct caller, while it runs; kept for the
                    // result as well. A line past the output cap is dropped
                    // from both.
                    if plain.dropped == 0 && dropped == 0 && plain.text.len() + line.len() < self.max_output {
                        let text = String::from_utf8_lossy(&line).into_owned();
                        let _ = dispatch.events.send(HarnessEvent::Output { line: text }).await;
                    }
                    plain.push_line(&line, dropped);
                    self.stdout_dropped = plain.dropped;
                }
                Line::Events(events) => {
                    for event in events {
                        // The lifecycle is gone only if it is shutting down.
                        let _ = dispatch.events.send(event).await;
                    }
                }
                Line::PolicyRequest { id, tool, arguments } => {
                    let pending = std::future::pending();
                    let verdict =
                        super::decide_call(dispatch.gate.as_ref(), &dispatch.events, &tool, &arguments, pending).await;
                    let (action, reason) = match verdict.allow {
                        true => ("allow", "allowed".to_string()),
                        false => ("deny", verdict.reason),
                    };
                    let verdict = json!({"type": "policy_verdict", "id": id, "action": action, "reason": reason});
                    let mut bytes = verdict.to_string().into_bytes();
                    bytes.push(b'\n');
                    if let Err(e) = self.write_stdin(&bytes).await {
                        tracing::debug!(error = %e, "policy verdict not delivered");
                    }
                }
                Line::Result(r) => {
                    result = Some(r);
                    if !one_shot {
                        break;
                    }
                }
                Line::Ignored => {}
            }
        }
        let stderr = self.take_stderr();
        self.stdout_dropped = 0;
        // A `result` line's own output is held to the same cap as plain
        // output (a line may be far longer than `max_output_bytes`), cut
        // the same way: between its lines, never within one, so that no
        // prefix of a credential is left where the scrubber cannot see it.
        let mut stdout_dropped = plain.dropped;
        if let Some(r) = result.as_mut().filter(|r| r.output.len() > self.max_output) {
            // Bytes, not a str slice: the cap may fall inside a character.
            let head = &r.output.as_bytes()[..self.max_output];
            let at = head.iter().rposition(|&b| b == b'\n').map_or(0, |newline| newline + 1);
            stdout_dropped = stdout_dropped.saturating_add((r.output.len() - at) as u64);
            r.output.truncate(at);
        }
        report_truncated(dispatch, stdout_dropped, stderr.dropped).await;
        let exit = match self.run.as_mut() {
            Some(run) if run.stdout.is_none() => {
                Some(run.process.wait().await.map_err(|e| ReinError::Dispatch(format!("wait: {e}")))?)
            }
            _ => None,
        };
        let mut result = match (result, exit) {
            (Some(mut r), _) => {
                if r.output.is_empty() {
                    r.output = plain.text;
                }
                r
            }
            // A session harness that stops before answering has died.
            (None, Some(status)) if !one_shot && self.turns > 0 && !status.success() => {
                return Err(ReinError::Exited(describe_exit(status, &stderr.text)));
            }
            (None, status) => ToolResult {
                ok: status.is_some_and(|s| s.success()),
                output: plain.text,
                tokens_spent: self.parser.tokens,
                resolved_model: self.parser.model.clone(),
                ..ToolResult::default()
            },
        };
        if !result.ok && result.error.is_empty() {
            result.error = match exit {
                Some(status) => describe_exit(status, &stderr.text),
                None => "harness reported failure".into(),
            };
            // What the harness last said went wrong names the cause better
            // than its exit status.
            if !self.parser.last_error.is_empty() {
                result.error = format!("{} ({})", self.parser.last_error, result.error);
            }
        }
        Ok(result)
    }
}

/// One `output_truncated` event for each stream that lost bytes past the cap.
async fn report_truncated(dispatch: &Dispatch, stdout: u64, stderr: u64) {
    for (stream, dropped) in [("stdout", stdout), ("stderr", stderr)] {
        if dropped > 0 {
            let _ = dispatch.events.send(HarnessEvent::OutputTruncated { stream, bytes_dropped: dropped }).await;
        }
    }
}

fn describe_exit(status: std::process::ExitStatus, stderr: &str) -> String {
    let mut text = match status.code() {
        Some(code) => format!("harness exited with status {code}"),
        None => "harness was killed by a signal".to_string(),
    };
    if !stderr.trim().is_empty() {
        text.push_str(": ");
        text.push_str(stderr.trim_end());
    }
    text
}

#[async_trait]
impl HarnessSession for CommandSession {
    async fn dispatch_tool(&mut self, call: ToolCall, dispatch: Dispatch) -> Result<ToolResult, ReinError> {
        enum Stop {
            Done(Result<ToolResult, ReinError>),
            TimedOut,
            Cancelled,
        }
        let cancel = dispatch.cancel.clone();
        let timeout = self.timeout;
        let stop = tokio::select! {
            result = self.turn(call, &dispatch) => Stop::Done(result),
            _ = tokio::time::sleep(timeout) => Stop::TimedOut,
            _ = cancel.cancelled() => Stop::Cancelled,
        };
        let error = match stop {
            Stop::Done(result) => return result,
            Stop::TimedOut => ReinError::TimedOut(timeout),
            Stop::Cancelled => ReinError::Cancelled,
        };
        if let Some(run) = self.run.as_mut() {
            let _ = run.process.terminate(KILL_GRACE).await;
        }
        // The cut turn never reached its own report of what it dropped.
        let stderr = self.take_stderr();
        report_truncated(&dispatch, std::mem::take(&mut self.stdout_dropped), stderr.dropped).await;
        Err(error)
    }

    fn invocation(&self) -> crate::types::evidence::HarnessInvocation {
        self.invocation.clone()
    }

    fn starts_anew(&self, call: &ToolCall) -> bool {
        self.resumes
            && self.one_shot()
            && self.turns > 0
            && !self.lacks_prompt(&self.input_bytes(call))
            && self.resumed_argv().is_ok()
    }

    /// A harness that runs once per turn and resumes is alive between
    /// turns too: the next turn starts its next run. A one-shot run that
    /// has not had its turn yet is too, ended or not: a command that reads
    /// no input (`/usr/bin/true`) may be done before its turn comes, and
    /// its exit and output are that turn's result, not a death to restart.
    fn is_alive(&mut self) -> bool {
        let pending = self.one_shot() && self.turns == 0;
        self.resumes || pending || self.run.as_mut().is_some_and(|run| !run.process.has_exited())
    }

    /// Closes stdin (a harness waiting for its next task sees EOF) and gives
    /// it a short grace to exit.
    async fn end_session(&mut self) -> Result<(), ReinError> {
        let Some(run) = self.run.as_mut() else { return Ok(()) };
        drop(run.stdin.take());
        match tokio::time::timeout(END_GRACE, run.process.wait()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(ReinError::End(format!("wait: {e}"))),
            Err(_) => Err(ReinError::End(format!("harness did not exit within {END_GRACE:?} of its end"))),
        }
    }

    async fn cleanup_session(&mut self) -> Result<(), ReinError> {
        let Some(run) = self.run.as_mut() else { return Ok(()) };
        if run.process.has_exited() {
            return Ok(());
        }
        run.process.kill().await.map(|_| ()).map_err(|e| ReinError::Cleanup(format!("kill: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    /// What a harness wrote is owed wherever it is: in the reader's hands
    /// (its buffer, the lines read ahead) or still in the pipe. 2,100 lines
    /// of 48 bytes: the reader takes 64 KiB and stops with 64 lines read
    /// ahead; the rest waits in the pipe.
    #[tokio::test]
    async fn what_was_written_is_owed_wherever_it_is() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::net::unix::pipe::pipe().unwrap();
        let line = b"{\"type\":\"progress\",\"message\":\"step\",\"tokens\":1}\n";
        assert_eq!(line.len(), 48);
        let mut lines = StdoutLines::read(rx);
        tx.write_all(&line.repeat(2_100)).await.unwrap();
        // The reader is blocked once it has read ahead all it may: at least
        // its buffer.
        while lines.count.taken.load(Ordering::SeqCst) < crate::rein::lines::READ_BUFFER as u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let taken = lines.count.taken.load(Ordering::SeqCst);
        assert!(taken < 100_800, "some is still in the pipe: {taken} taken");
        let written = lines.mark_exit();
        assert_eq!(written, 100_800);
        for _ in 0..100 {
            lines.recv().await.unwrap().unwrap();
        }
        assert_eq!((lines.received, lines.owed(written)), (4_800, 100_800));
        drop(tx);
        let mut received = 100;
        while let Some(next) = lines.recv().await {
            next.unwrap();
            received += 1;
        }
        assert_eq!((received, lines.received, lines.owed(written)), (2_100, 100_800, 100_800));
    }

    /// A harness that writes while nothing reads holds at most two lines
    /// of 1 MiB read ahead (and the one being read), not 64: 64 lines of
    /// 1 MiB stay mostly in the pipe, and all of them come through whole.
    #[tokio::test]
    async fn the_lines_read_ahead_are_bounded_in_bytes() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::net::unix::pipe::pipe().unwrap();
        let mut lines = StdoutLines::read(rx);
        let line = [vec![b'x'; crate::rein::lines::MAX_LINE], vec![b'\n']].concat();
        let writer = tokio::spawn(async move {
            for _ in 0..64 {
                tx.write_all(&line).await.unwrap();
            }
        });
        // Until the reader stops taking from the pipe.
        let mut taken = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = lines.count.taken.load(Ordering::SeqCst);
            if now == taken {
                break;
            }
            taken = now;
        }
        assert!(taken < 4 << 20, "{taken} bytes taken from the pipe while nothing read");
        for _ in 0..64 {
            let (line, dropped) = lines.recv().await.unwrap().unwrap();
            assert_eq!((line.len(), dropped), (crate::rein::lines::MAX_LINE, 0));
        }
        writer.await.unwrap();
    }

    /// A last line left unfinished, with the pipe still open (a process
    /// the harness left behind holds it), is not owed: only the whole
    /// lines before it are.
    #[tokio::test]
    async fn an_unfinished_last_line_is_not_owed() {
        use tokio::io::AsyncWriteExt;
        let (mut tx, rx) = tokio::net::unix::pipe::pipe().unwrap();
        let mut lines = StdoutLines::read(rx);
        tx.write_all(b"one\ntw").await.unwrap();
        while lines.count.taken.load(Ordering::SeqCst) < 6 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let written = lines.mark_exit();
        assert_eq!((written, lines.owed(written)), (6, 4));
        assert_eq!(lines.recv().await.unwrap().unwrap(), (b"one".to_vec(), 0));
        let drain = ExitDrain::new(100, EXIT_DRAIN, EXIT_DRAIN_MAX);
        assert_eq!(drain.next_wait(lines.received, lines.owed(written)), Wait::AtMost(EXIT_DRAIN));
        // What a leftover writes after the exit is not owed either.
        tx.write_all(b"o\nthree\n").await.unwrap();
        assert_eq!(lines.recv().await.unwrap().unwrap(), (b"two".to_vec(), 0));
        assert_eq!(lines.owed(written), 4);
        drop(tx);
    }

    #[test]
    fn a_later_turn_resumes_the_conversation_or_refuses() {
        let claude = argv(&["claude", "-p", "--output-format", "stream-json", "--allowedTools", "Bash"]);
        assert_eq!(
            resume_argv(Preset::ClaudeStreamJson, &claude, "c9f5").unwrap(),
            argv(&["claude", "--resume", "c9f5", "-p", "--output-format", "stream-json", "--allowedTools", "Bash"])
        );
        let codex = argv(&["codex", "exec", "--dangerously-bypass-approvals-and-sandbox", "--json", "-"]);
        assert_eq!(
            resume_argv(Preset::CodexExecJson, &codex, "01a2").unwrap(),
            argv(&["codex", "exec", "resume", "01a2", "--dangerously-bypass-approvals-and-sandbox", "--json", "-"])
        );
        assert_eq!(
            resume_argv(Preset::CodexExecJson, &argv(&["/usr/bin/codex", "exec", "-"]), "x").unwrap()[2],
            "resume"
        );
        for (preset, wrapper) in [
            (Preset::ClaudeStreamJson, argv(&["/bin/sh", "-c", "claude -p | tee t"])),
            (Preset::CodexExecJson, argv(&["/bin/sh", "-c", "codex exec -"])),
            (Preset::CodexExecJson, argv(&["codex", "--version"])),
            (Preset::Protocol, argv(&["claude"])),
        ] {
            assert!(resume_argv(preset, &wrapper, "x").is_err(), "{wrapper:?}");
        }
    }

    #[test]
    fn a_turns_prompt_is_its_argument_else_the_task() {
        let mut task = crate::rein::Task { title: "T".into(), description: "D".into(), ..Default::default() };
        assert_eq!(prompt_of(&task), "T\n\nD");
        task.arguments = serde_json::json!({"prompt": "remember PINEAPPLE"});
        assert_eq!(prompt_of(&task), "remember PINEAPPLE");
        let turn = crate::rein::Task { description: "only".into(), ..Default::default() };
        assert_eq!(prompt_of(&turn), "only");
    }
}
