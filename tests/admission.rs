//! Admission control: overload is refused with RESOURCE_EXHAUSTED, never a
//! crash or a leaked sandbox, and the store is unchanged by a refusal.

mod common;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb::{self, lifecycle_event::Kind};
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_limit_executions_are_refused_with_resource_exhausted() {
    require_bwrap();
    let daemon =
        TestDaemon::start(Options { config: Box::new(|c| c.max_running_executions = 1), ..Options::default() }).await;
    let mut client = daemon.executions().await;
    let running = client.start_execution(request("test.fake-agent", "NOWORK\nHANG")).await.unwrap().into_inner();
    // Wait until it really runs.
    let req = pb::WatchRequest { execution_id: running.execution_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    while let Some(e) = stream.message().await.unwrap() {
        if matches!(e.kind, Some(Kind::Progress(_))) {
            break;
        }
    }
    let before = daemon.engine.store.count_executions().await.unwrap();
    let status = client.start_execution(request("test.fake-agent", "NOWORK")).await.expect_err("over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.get_details_error_info().unwrap().reason, "OVERLOADED");
    let status = client.execute(request("test.fake-agent", "NOWORK")).await.expect_err("over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(daemon.engine.store.count_executions().await.unwrap(), before, "a refusal stores nothing");

    client.cancel_execution(pb::CancelExecutionRequest { execution_id: running.execution_id.clone() }).await.unwrap();
    let events = daemon.watch_all(&running.execution_id, 0).await;
    assert_eq!(pb::ExecutionState::try_from(finished(&events).state).unwrap(), pb::ExecutionState::Cancelled);
    // Room again once the first one is done.
    let next = finished(&daemon.execute(request("test.fake-agent", "NOWORK")).await);
    assert_eq!(pb::ExecutionState::try_from(next.state).unwrap(), pb::ExecutionState::Succeeded);
    assert!(daemon.leftover_sandboxes().is_empty());
}
