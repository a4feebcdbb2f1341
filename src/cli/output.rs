//! Where a command's results go: human text or `--json` lines on stdout.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

use super::json::{JsonEncoder, WireMessage};
use super::{record, render, table};
use crate::pb;

pub(super) enum Printer {
    /// Whether output lines were shown live (then the final block of
    /// output is not repeated).
    Human(std::cell::Cell<bool>),
    Json(JsonEncoder),
}

impl Printer {
    pub(super) fn new(json: bool) -> anyhow::Result<Self> {
        Ok(if json { Self::Json(JsonEncoder::new()?) } else { Self::Human(std::cell::Cell::new(false)) })
    }

    /// One event as it arrives; `finished` also prints the raw output in
    /// human mode (in JSON it is part of the message).
    pub(super) fn event(&self, event: &pb::LifecycleEvent) -> anyhow::Result<()> {
        match self {
            Self::Json(encoder) => write_line(&encoder.line(event)?),
            Self::Human(streamed) => {
                // The harness's own output lines, as they come: as printed.
                if let Some(pb::lifecycle_event::Kind::Progress(p)) = &event.kind {
                    if p.kind == pb::ProgressKind::Output as i32 && !p.message.is_empty() {
                        streamed.set(true);
                        return write_text(&format!("{}\n", p.message));
                    }
                }
                let mut text = render::event_line(event);
                text.push('\n');
                if let Some(pb::lifecycle_event::Kind::Finished(f)) = &event.kind {
                    text.push_str(&render::raw_outputs(f, streamed.get()));
                }
                write_text(&text)
            }
        }
    }

    pub(super) fn execution(&self, execution: &pb::Execution) -> anyhow::Result<()> {
        self.either(execution, || record::execution(execution))
    }

    pub(super) fn session(&self, session: &pb::Session) -> anyhow::Result<()> {
        self.either(session, || render::session_line(session))
    }

    /// An ended session: its line, then the raw cause of a failed end,
    /// which the answer to EndSession alone carries.
    pub(super) fn ended_session(&self, session: &pb::Session) -> anyhow::Result<()> {
        self.either(session, || render::session_line(session) + &render::raw_block("", &session.tool_error))
    }

    pub(super) fn decided(&self, decided: &pb::DecideToolCallResponse) -> anyhow::Result<()> {
        self.either(decided, || {
            let action = if decided.allow { "allowed" } else { "denied" };
            format!("{} {action} by {}\n", decided.call_id, decided.decided_by)
        })
    }

    pub(super) fn executions(&self, response: &pb::ListExecutionsResponse) -> anyhow::Result<()> {
        self.either(response, || table::executions(response))
    }

    pub(super) fn profiles(&self, response: &pb::ListProfilesResponse) -> anyhow::Result<()> {
        self.either(response, || table::profiles(response))
    }

    pub(super) fn nodes(&self, response: &pb::ListNodesResponse) -> anyhow::Result<()> {
        self.either(response, || table::nodes(response, crate::records::now_ms()))
    }

    pub(super) fn daemon_info(&self, info: &pb::DaemonInfo) -> anyhow::Result<()> {
        self.either(info, || {
            let mut text = format!("corral {} (client)\ncorral {} (daemon)\n", env!("CARGO_PKG_VERSION"), info.version);
            for c in &info.capabilities {
                let mark = if c.available { "ok" } else { "NO" };
                text.push_str(&format!("  {:<14} {mark:<3} {}\n", c.name, c.detail));
            }
            text
        })
    }

    fn either<M: WireMessage>(&self, message: &M, human: impl FnOnce() -> String) -> anyhow::Result<()> {
        match self {
            Self::Json(encoder) => write_line(&encoder.line(message)?),
            Self::Human(_) => write_text(&human()),
        }
    }
}

/// Set once stdout's reader has gone away (`| head -1`): from then on
/// nothing is printed, and a command goes on quietly, so that `exec` and
/// `watch` still exit with the run's outcome.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

fn write_line(line: &str) -> anyhow::Result<()> {
    // Streams are followed live and often piped (`| jq`): flushed per
    // message so a reader sees each event when it happens.
    write_text(&format!("{line}\n"))
}

fn write_text(text: &str) -> anyhow::Result<()> {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        written => written.map_err(Into::into),
    }
}
