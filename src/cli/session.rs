//! `corral cancel` and `corral session create|turn|watch|end`: the CLI
//! side of `CancelExecution` and `SessionService`.

use super::output::Printer;
use super::{Remote, SessionCommand};
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;
use crate::pb::session_service_client::SessionServiceClient;

/// `corral cancel ID`: the execution as it is after the cancel.
pub(super) async fn cancel(server: &Remote, id: String, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = ExecutionServiceClient::new(server.open().await?);
    let execution = client.cancel_execution(pb::CancelExecutionRequest { execution_id: id }).await?.into_inner();
    printer.execution(&execution)?;
    Ok(0)
}

pub(super) async fn run(server: &Remote, command: SessionCommand, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = SessionServiceClient::new(server.open().await?);
    match command {
        SessionCommand::Create { profile, id, repo, project } => {
            let repo = match repo {
                Some(path) => std::path::absolute(&path)?.display().to_string(),
                None => String::new(),
            };
            let request = pb::CreateSessionRequest {
                session_id: id.unwrap_or_default(),
                profile_ref: profile,
                repo,
                project: project.unwrap_or_default(),
                ..Default::default()
            };
            let session = client.create_session(request).await?.into_inner();
            printer.session(&session)?;
            Ok(0)
        }
        SessionCommand::Turn { id, prompt, tool, arguments } => {
            let arguments_json = match (prompt, arguments) {
                (Some(prompt), None) => serde_json::json!({ "prompt": prompt }).to_string(),
                (None, Some(json)) => json,
                (None, None) => "{}".into(),
                (Some(_), Some(_)) => anyhow::bail!("give --prompt or --arguments, not both"),
            };
            let request =
                pb::SendTurnRequest { session_id: id, tool_call: Some(pb::ToolCall { tool, arguments_json }) };
            let stream = client.send_turn(request).await?.into_inner();
            follow(stream, printer).await
        }
        SessionCommand::Watch { id, after } => {
            let request = pb::WatchSessionRequest { session_id: id, after_sequence: after };
            let stream = client.watch_session(request).await?.into_inner();
            follow(stream, printer).await
        }
        SessionCommand::End { id } => {
            let session = client.end_session(pb::EndSessionRequest { session_id: id }).await?.into_inner();
            printer.ended_session(&session)?;
            // `exec`'s rule: 0 only when the session's verdict is a success.
            let succeeded = session.evidence.as_ref().is_some_and(|e| e.outcome == pb::Outcome::Succeeded as i32);
            Ok(if succeeded { 0 } else { 1 })
        }
    }
}

/// Prints every event. The exit code: 0 when the last turn ended well and,
/// if the session finished, its verdict is a success too (`exec`'s rule);
/// 1 for a failed last turn, a session that failed, was refused or
/// cancelled, and a stream that ended before either.
async fn follow(mut stream: tonic::Streaming<pb::LifecycleEvent>, printer: &Printer) -> anyhow::Result<i32> {
    let mut turn_ok = None;
    let mut session = None;
    while let Some(event) = stream.message().await? {
        printer.event(&event)?;
        match &event.kind {
            Some(Kind::TurnFinished(turn)) => turn_ok = Some(turn.ok),
            Some(Kind::Finished(finished)) => session = Some(super::exec::exit_code(finished)),
            _ => {}
        }
    }
    Ok(match (turn_ok, session) {
        (Some(false), _) | (None, None) => 1,
        (_, Some(code)) => code,
        (Some(true), None) => 0,
    })
}
