//! `corral get`, `corral ls`, `corral approve`/`deny` and `corral profiles`:
//! one unary call each.

use super::output::Printer;
use super::{DecideArgs, GetArgs, LsArgs, Remote};
use crate::pb;
use crate::pb::catalog_service_client::CatalogServiceClient;
use crate::pb::execution_service_client::ExecutionServiceClient;

pub(super) async fn get(server: &Remote, args: GetArgs, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = ExecutionServiceClient::new(server.open().await?);
    let view = if args.full { pb::ExecutionView::Full } else { pb::ExecutionView::Basic };
    let request = pb::GetExecutionRequest { execution_id: args.id, view: view as i32 };
    let execution = client.get_execution(request).await?.into_inner();
    printer.execution(&execution)?;
    Ok(0)
}

/// `corral approve` / `corral deny`: the call of an execution, else of a
/// session of that id.
pub(super) async fn decide(server: &Remote, args: DecideArgs, allow: bool, printer: &Printer) -> anyhow::Result<i32> {
    use crate::pb::session_service_client::SessionServiceClient;
    let decision = if allow { pb::ToolCallDecision::Allow } else { pb::ToolCallDecision::Deny } as i32;
    let channel = server.open().await?;
    let request = pb::DecideToolCallRequest {
        execution_id: args.id.clone(),
        call_id: args.call.clone(),
        decision,
        reason: args.reason.clone(),
    };
    let decided = match ExecutionServiceClient::new(channel.clone()).decide_tool_call(request).await {
        Err(status) if status.code() == tonic::Code::NotFound && !status.message().starts_with("call_id") => {
            let request = pb::DecideSessionToolCallRequest {
                session_id: args.id,
                call_id: args.call,
                decision,
                reason: args.reason,
            };
            SessionServiceClient::new(channel).decide_tool_call(request).await?
        }
        other => other?,
    };
    printer.decided(&decided.into_inner())?;
    Ok(0)
}

pub(super) async fn ls(server: &Remote, args: LsArgs, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = ExecutionServiceClient::new(server.open().await?);
    // Absent filters go as proto3 defaults, which the daemon reads as
    // "no filter".
    let request = pb::ListExecutionsRequest {
        state: args.state.map_or(0, |s| s as i32),
        profile_ref: args.profile.unwrap_or_default(),
        actor: args.actor.unwrap_or_default(),
        project: args.project.unwrap_or_default(),
        page_size: args.page_size.unwrap_or_default(),
        page_token: args.page_token.unwrap_or_default(),
    };
    let response = client.list_executions(request).await?.into_inner();
    printer.executions(&response)?;
    Ok(0)
}

/// `corral version`: this binary's version, then the daemon's and what its
/// host can enforce.
pub(super) async fn version(server: &Remote, printer: &Printer) -> anyhow::Result<i32> {
    let channel = match server.open().await {
        Ok(channel) => channel,
        Err(e) => {
            // This client's version is known without a daemon.
            if matches!(printer, Printer::Human(_)) {
                println!("corral {} (client)", env!("CARGO_PKG_VERSION"));
            }
            return Err(e);
        }
    };
    let mut client = CatalogServiceClient::new(channel);
    let info = client.get_daemon_info(pb::GetDaemonInfoRequest {}).await?.into_inner();
    printer.daemon_info(&info)?;
    Ok(0)
}

pub(super) async fn nodes(server: &Remote, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = CatalogServiceClient::new(server.open().await?);
    let response = client.list_nodes(pb::ListNodesRequest {}).await?.into_inner();
    printer.nodes(&response)?;
    Ok(0)
}

pub(super) async fn drain(server: &Remote, name: String, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = CatalogServiceClient::new(server.open().await?);
    let node = client.drain_node(pb::DrainNodeRequest { name }).await?.into_inner();
    printer.nodes(&pb::ListNodesResponse { nodes: vec![node] })?;
    Ok(0)
}

pub(super) async fn profiles(server: &Remote, printer: &Printer) -> anyhow::Result<i32> {
    let mut client = CatalogServiceClient::new(server.open().await?);
    let response = client.list_profiles(pb::ListProfilesRequest {}).await?.into_inner();
    printer.profiles(&response)?;
    Ok(0)
}
