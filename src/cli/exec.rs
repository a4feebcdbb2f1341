//! `corral exec` and `corral watch`: both follow a stream of lifecycle
//! events until `finished`, and derive the exit code from the final state.

use anyhow::Context as _;

use super::output::Printer;
use super::{ExecArgs, Remote, WatchArgs};
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;

/// Exit code when the user interrupts a stream (128 + SIGINT, as shells do).
const INTERRUPTED: i32 = 130;

pub(super) async fn exec(server: &Remote, args: ExecArgs, printer: &Printer) -> anyhow::Result<i32> {
    // Build the request before connecting: a missing description file is
    // the user's mistake and should not cost a round trip to find out.
    let request = execute_request(args).await?;
    let cancels = request.cancel_on_disconnect;
    let mut client = ExecutionServiceClient::new(server.open().await?);
    let stream = client.execute(request).await?.into_inner();
    follow(stream, printer, cancels).await
}

pub(super) async fn watch(server: &Remote, args: WatchArgs, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = ExecutionServiceClient::new(server.open().await?);
    let request = pb::WatchRequest { execution_id: args.id, after_sequence: args.after };
    let stream = client.watch_execution(request).await?.into_inner();
    follow(stream, printer, false).await
}

async fn execute_request(args: ExecArgs) -> anyhow::Result<pb::ExecuteRequest> {
    let description = match (args.description, args.description_file) {
        // tokio's stdin needs the `io-std` feature; a blocking read on the
        // blocking pool does the same job for one read to the end.
        (_, Some(path)) if path.as_os_str() == "-" => {
            tokio::task::spawn_blocking(|| std::io::read_to_string(std::io::stdin()))
                .await
                .context("the stdin reader did not finish")?
                .context("cannot read the description from stdin")?
        }
        (_, Some(path)) => tokio::fs::read_to_string(&path)
            .await
            .with_context(|| format!("cannot read the description from {}", path.display()))?,
        (Some(text), None) => text,
        // clap's argument group makes one of the two mandatory.
        (None, None) => anyhow::bail!("one of --description or --description-file is required"),
    };
    let repo = repo_arg(args.repo)?;
    Ok(pb::ExecuteRequest {
        harness_profile_ref: args.profile,
        repo,
        title: args.title,
        description,
        request_id: args.request_id.unwrap_or_default(),
        correlation_id: args.correlation_id.unwrap_or_default(),
        assignment_ref: args.assignment_ref.unwrap_or_default(),
        report_to_hub: args.report_to_hub,
        actor: args.actor,
        project: args.project,
        cancel_on_disconnect: args.cancel_on_interrupt,
    })
}

/// Prints events as they arrive and returns the exit code once `finished`
/// comes. A `Status` from the stream propagates and becomes exit code 2.
/// `cancels`: leaving cancels the run (`--cancel-on-interrupt`).
async fn follow(
    mut stream: tonic::Streaming<pb::LifecycleEvent>,
    printer: &Printer,
    cancels: bool,
) -> anyhow::Result<i32> {
    // One signal future for the whole loop: recreating it per iteration
    // could lose a Ctrl-C that lands between two events.
    let interrupt = tokio::signal::ctrl_c();
    tokio::pin!(interrupt);
    let mut interrupt_armed = true;
    let mut last: Option<(String, u64)> = None;
    // A sign of life on a terminal: one status line with the elapsed time,
    // rewritten in place every second and cleared before anything prints.
    let status = Status::new();
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let next = tokio::select! {
            message = stream.message() => message?,
            _ = tick.tick(), if status.enabled => {
                status.show(last.as_ref().map(|(_, s)| *s));
                continue;
            }
            signal = &mut interrupt, if interrupt_armed => {
                match signal {
                    Ok(()) => {
                        report_interrupt(last.as_ref(), cancels);
                        return Ok(INTERRUPTED);
                    }
                    // No signal handler could be installed: keep following
                    // and let the default Ctrl-C behaviour apply.
                    Err(_) => {
                        interrupt_armed = false;
                        continue;
                    }
                }
            }
        };
        status.clear();
        let Some(event) = next else {
            eprintln!("error: the event stream ended before the execution finished");
            return Ok(1);
        };
        printer.event(&event)?;
        if let Some(Kind::Finished(finished)) = &event.kind {
            return Ok(exit_code(finished));
        }
        last = Some((subject_of(&event), event.sequence));
    }
}

/// The elapsed-time line on stderr, only when both stdout and stderr are
/// terminals (never in a pipe, a log or `--json` output read by a program).
struct Status {
    enabled: bool,
    started: std::time::Instant,
    shown: std::cell::Cell<bool>,
}

impl Status {
    fn new() -> Status {
        use std::io::IsTerminal;
        let enabled = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
        Status { enabled, started: std::time::Instant::now(), shown: std::cell::Cell::new(false) }
    }

    fn show(&self, last_sequence: Option<u64>) {
        let elapsed = self.started.elapsed().as_secs();
        let at = last_sequence.map(|s| format!(", last event #{s}")).unwrap_or_default();
        eprint!("\r\x1b[2K  running {}m{:02}s{at}", elapsed / 60, elapsed % 60);
        self.shown.set(true);
    }

    fn clear(&self) {
        if self.shown.replace(false) {
            eprint!("\r\x1b[2K");
        }
    }
}

/// The execution id to point a resumed `watch` at.
fn subject_of(event: &pb::LifecycleEvent) -> String {
    match &event.kind {
        Some(Kind::Accepted(accepted)) if !accepted.execution_id.is_empty() => accepted.execution_id.clone(),
        _ => event.subject_id.clone(),
    }
}

fn report_interrupt(last: Option<&(String, u64)>, cancels: bool) {
    match last {
        Some((id, _)) if !id.is_empty() && cancels => {
            eprintln!("interrupted: execution {id} is cancelled as this call goes (--cancel-on-interrupt)")
        }
        Some((id, sequence)) if !id.is_empty() => eprintln!(
            "interrupted: stopped following execution {id}; resume with `corral watch {id} --after {sequence}`"
        ),
        _ => eprintln!("interrupted before the daemon named the execution"),
    }
}

/// 0 only for an execution that succeeded; anything else the harness or
/// the daemon ended with is a failure for the shell.
pub(super) fn exit_code(finished: &pb::Finished) -> i32 {
    use pb::finished::Record;
    let succeeded = match &finished.record {
        Some(Record::Execution(execution)) => execution.state == pb::ExecutionState::Succeeded as i32,
        // Sessions carry a free-form state; their evidence outcome is the
        // typed verdict.
        Some(Record::Session(session)) => {
            session.evidence.as_ref().is_some_and(|e| e.outcome == pb::Outcome::Succeeded as i32)
        }
        None => false,
    };
    if succeeded {
        0
    } else {
        1
    }
}

/// `--repo` as the daemon reads it: the daemon resolves the repo on its
/// own filesystem with its own cwd, so a relative path is anchored to where
/// the user typed it (empty: none).
pub(super) fn repo_arg(repo: Option<std::path::PathBuf>) -> anyhow::Result<String> {
    let Some(path) = repo else { return Ok(String::new()) };
    let absolute =
        std::path::absolute(&path).with_context(|| format!("cannot make --repo {} absolute", path.display()))?;
    Ok(absolute.to_str().with_context(|| format!("--repo {} is not valid UTF-8", absolute.display()))?.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished_in(state: pb::ExecutionState) -> pb::Finished {
        pb::Finished {
            record: Some(pb::finished::Record::Execution(pb::Execution { state: state as i32, ..Default::default() })),
        }
    }

    #[test]
    fn only_a_succeeded_execution_exits_zero() {
        assert_eq!(exit_code(&finished_in(pb::ExecutionState::Succeeded)), 0);
        for state in [
            pb::ExecutionState::Failed,
            pb::ExecutionState::Refused,
            pb::ExecutionState::Cancelled,
            pb::ExecutionState::Running,
            pb::ExecutionState::Unspecified,
        ] {
            assert_eq!(exit_code(&finished_in(state)), 1, "{state:?}");
        }
        assert_eq!(exit_code(&pb::Finished { record: None }), 1);
    }

    #[tokio::test]
    async fn a_relative_repo_is_sent_absolute() {
        let args = ExecArgs {
            profile: "p".into(),
            repo: Some("some/repo".into()),
            title: "t".into(),
            description: Some("d".into()),
            description_file: None,
            actor: "agt".into(),
            project: "default".into(),
            request_id: None,
            correlation_id: None,
            assignment_ref: None,
            report_to_hub: false,
            cancel_on_interrupt: false,
        };
        let request = execute_request(args).await.expect("request");
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(request.repo, cwd.join("some/repo").to_str().expect("utf-8"));
        assert_eq!(request.description, "d");
        assert_eq!(request.actor, "agt");
    }
}
