//! The client against a fake daemon on 127.0.0.1:0: real gRPC, real
//! streams, canned answers. Checks the exit-code contract end to end.

use std::net::SocketAddr;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use super::*;
use pb::execution_service_server::{ExecutionService, ExecutionServiceServer};
use pb::lifecycle_event::Kind;

type EventStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::LifecycleEvent, Status>>>;

/// Finishes an execution in SUCCEEDED when its title is "succeed", else in
/// FAILED; refuses relative repo paths, as a real daemon could not use them.
struct FakeDaemon;

#[async_trait::async_trait]
impl ExecutionService for FakeDaemon {
    type ExecuteStream = EventStream;
    type WatchExecutionStream = EventStream;

    async fn execute(&self, request: Request<pb::ExecuteRequest>) -> Result<Response<EventStream>, Status> {
        let request = request.into_inner();
        if !request.repo.starts_with('/') {
            return Err(Status::invalid_argument("repo must be absolute"));
        }
        let state = if request.title == "succeed" { pb::ExecutionState::Succeeded } else { pb::ExecutionState::Failed };
        let events = vec![
            Ok(event(1, Kind::Accepted(Box::new(pb::Accepted { execution_id: "e1".into(), ..Default::default() })))),
            Ok(event(
                2,
                Kind::Finished(Box::new(pb::Finished {
                    record: Some(pb::finished::Record::Execution(pb::Execution {
                        execution_id: "e1".into(),
                        state: state as i32,
                        repo: request.repo,
                        ..Default::default()
                    })),
                })),
            )),
        ];
        Ok(Response::new(tokio_stream::iter(events)))
    }

    async fn watch_execution(&self, request: Request<pb::WatchRequest>) -> Result<Response<EventStream>, Status> {
        Err(Status::not_found(format!("no execution {}", request.into_inner().execution_id)))
    }

    async fn start_execution(&self, _: Request<pb::ExecuteRequest>) -> Result<Response<pb::Execution>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_execution(
        &self,
        request: Request<pb::GetExecutionRequest>,
    ) -> Result<Response<pb::Execution>, Status> {
        Ok(Response::new(pb::Execution { execution_id: request.into_inner().execution_id, ..Default::default() }))
    }

    async fn list_executions(
        &self,
        _: Request<pb::ListExecutionsRequest>,
    ) -> Result<Response<pb::ListExecutionsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn cancel_execution(
        &self,
        _: Request<pb::CancelExecutionRequest>,
    ) -> Result<Response<pb::Execution>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn decide_tool_call(
        &self,
        _: Request<pb::DecideToolCallRequest>,
    ) -> Result<Response<pb::DecideToolCallResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

fn event(sequence: u64, kind: Kind) -> pb::LifecycleEvent {
    pb::LifecycleEvent { subject_id: "e1".into(), sequence, time: None, kind: Some(kind) }
}

async fn start_fake() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExecutionServiceServer::new(FakeDaemon))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    addr
}

fn opts(addr: SocketAddr, json: bool) -> ClientOpts {
    ClientOpts { server: Some(format!("http://{addr}")), token_file: None, ca: None, cert: None, key: None, json }
}

fn exec_args(title: &str) -> ExecArgs {
    ExecArgs {
        profile: "fake@1.0.0".into(),
        repo: Some("relative/repo".into()),
        title: title.into(),
        description: Some("d".into()),
        description_file: None,
        actor: "adm".into(),
        project: "default".into(),
        request_id: None,
        correlation_id: None,
        assignment_ref: None,
        report_to_hub: false,
        cancel_on_interrupt: false,
    }
}

#[tokio::test]
async fn exec_exit_code_follows_the_final_state() {
    let addr = start_fake().await;
    let ok = run(opts(addr, false), ClientCommand::Exec(exec_args("succeed"))).await;
    assert_eq!(ok.expect("exec"), 0);
    let failed = run(opts(addr, true), ClientCommand::Exec(exec_args("fail"))).await;
    assert_eq!(failed.expect("exec"), 1);
}

#[tokio::test]
async fn rpc_errors_exit_two() {
    let addr = start_fake().await;
    let watch = WatchArgs { id: "nope".into(), after: 0 };
    let code = run(opts(addr, false), ClientCommand::Watch(watch)).await;
    assert_eq!(code.expect("watch"), 2);
    let get = run(opts(addr, false), ClientCommand::Get(GetArgs { id: "e9".into(), full: false })).await;
    assert_eq!(get.expect("get"), 0);

    // A port nobody listens on: the transport error is also exit code 2.
    let closed = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        listener.local_addr().expect("local addr")
    };
    let code = run(opts(closed, false), ClientCommand::Profiles(ProfilesArgs {})).await;
    assert_eq!(code.expect("profiles"), 2);
}

#[tokio::test]
async fn a_bad_server_address_is_a_usage_error() {
    let bad =
        ClientOpts { server: Some("not a url".into()), token_file: None, ca: None, cert: None, key: None, json: false };
    assert_eq!(run(bad, ClientCommand::Get(GetArgs { id: "e1".into(), full: false })).await.expect("reported"), 2);
}
