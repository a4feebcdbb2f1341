//! Several daemons on one PostgreSQL record: any of them serves Watch for
//! any execution, and each recovers only what it ran itself.

mod common;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_watches_an_execution_the_first_runs() {
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let a = TestDaemon::start(Options {
        store_url: Some(url.clone()),
        config: Box::new(|c| c.node_id = Some("node-a".into())),
        ..Options::default()
    })
    .await;
    let b = TestDaemon::start(Options {
        store_url: Some(url),
        config: Box::new(|c| c.node_id = Some("node-b".into())),
        ..Options::default()
    })
    .await;
    let mut on_a = a.executions().await;
    let execution =
        on_a.start_execution(request("test.fake-agent", "NOWORK\nPROGRESS 200")).await.unwrap().into_inner();
    // B never ran it: it follows it through the shared record.
    let watched_on_b = b.watch_all(&execution.execution_id, 0).await;
    let watched_on_a = a.watch_all(&execution.execution_id, 0).await;
    assert_eq!(watched_on_b, watched_on_a);
    let sequences: Vec<u64> = watched_on_b.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=sequences.len() as u64).collect::<Vec<_>>());
    let record = finished(&watched_on_b);
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Succeeded);
    let listed = b
        .executions()
        .await
        .list_executions(pb::ListExecutionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .executions;
    assert!(listed.iter().any(|e| e.execution_id == execution.execution_id), "B lists A's execution");
}

/// Recovery touches only the starting daemon's own rows: a daemon that
/// starts on the shared store while another one runs an execution (its
/// sandbox up, its harness working) leaves that execution, its sandbox
/// and its uid alone, and it finishes as if nothing happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_starting_beside_a_running_one_leaves_its_work_alone() {
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let a = TestDaemon::start(Options {
        store_url: Some(url.clone()),
        config: Box::new(|c| c.node_id = Some("node-a".into())),
        ..Options::default()
    })
    .await;
    let mut on_a = a.executions().await;
    let execution =
        on_a.start_execution(request("test.fake-agent", "NOWORK\nPROGRESS 30\nPACE 10")).await.unwrap().into_inner();
    let id = execution.execution_id.clone();
    // Until its sandbox is up and the harness is working.
    let watch = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut stream = on_a.watch_execution(watch).await.unwrap().into_inner();
    while let Some(event) = stream.message().await.unwrap() {
        if matches!(event.kind, Some(pb::lifecycle_event::Kind::Progress(_))) {
            break;
        }
    }
    // A's row as a daemon from before nodes (not yet upgraded) writes it:
    // with no node. It may be a live daemon's: B's recovery leaves it too.
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let node_of = "UPDATE executions SET node = $1 WHERE execution_id = $2";
    sqlx::query(node_of).bind(None::<String>).bind(&id).execute(&db).await.unwrap();
    // B starts on the same store: its recovery runs before it serves.
    let b = TestDaemon::start(Options {
        store_url: Some(url),
        config: Box::new(|c| c.node_id = Some("node-b".into())),
        ..Options::default()
    })
    .await;
    let state: String = sqlx::query_scalar("SELECT state FROM executions WHERE execution_id = $1")
        .bind(&id)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(state, "running", "B's recovery took a row with no node");
    sqlx::query(node_of).bind("node-a").bind(&id).execute(&db).await.unwrap();
    let events = a.watch_all(&id, 0).await;
    let record = finished(&events);
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Succeeded, "{record:?}");
    assert!(
        !events.iter().any(|e| matches!(e.kind, Some(pb::lifecycle_event::Kind::Recovered(_)))),
        "B recovered A's execution"
    );
    let progress = events.iter().filter(|e| matches!(e.kind, Some(pb::lifecycle_event::Kind::Progress(_)))).count();
    assert!(progress >= 30, "the harness ran to its end: {progress} progress events");
    assert!(a.leftover_sandboxes().await.is_empty() && b.leftover_sandboxes().await.is_empty());
}
