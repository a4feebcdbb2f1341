//! Admission control: overload is refused with RESOURCE_EXHAUSTED, never a
//! crash or a leaked sandbox, and the store is unchanged by a refusal. On a
//! shared store (PostgreSQL, a fleet) work past a node's room waits in the
//! fleet's queue instead, up to `fleet.max_queued`, and is refused beyond
//! it; what runs at once is bounded the same way.

mod common;

use common::witness::Witness;
use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb::{self, lifecycle_event::Kind};
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_limit_executions_are_refused_with_resource_exhausted() {
    require_bwrap();
    let daemon = TestDaemon::start(Options {
        config: Box::new(|c| {
            c.max_running_executions = 1;
            c.fleet.max_queued = 1;
        }),
        ..Options::default()
    })
    .await;
    let shared = daemon.engine.store.is_shared();
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
    // A fleet queues one past the node's room (max_queued = 1): it waits,
    // pending, while the first one runs.
    let queued = match shared {
        true => {
            let queued = client.start_execution(request("test.fake-agent", "NOWORK")).await.unwrap().into_inner();
            assert_eq!(queued.state, pb::ExecutionState::Pending as i32, "{queued:?}");
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
            let get = pb::GetExecutionRequest { execution_id: queued.execution_id.clone(), ..Default::default() };
            let still = client.get_execution(get).await.unwrap().into_inner();
            assert_eq!(still.state, pb::ExecutionState::Pending as i32, "no room: it is not started: {still:?}");
            Some(queued.execution_id)
        }
        false => None,
    };
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
    // The queued one runs once there is room, and its events are whole.
    if let Some(queued) = queued {
        let events = daemon.watch_all(&queued, 0).await;
        assert_eq!(pb::ExecutionState::try_from(finished(&events).state).unwrap(), pb::ExecutionState::Succeeded);
        let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
        assert_eq!(sequences, (1..=events.len() as u64).collect::<Vec<_>>());
    }
    // Room again once the first one is done.
    let next = finished(&daemon.execute(request("test.fake-agent", "NOWORK")).await);
    assert_eq!(pb::ExecutionState::try_from(next.state).unwrap(), pb::ExecutionState::Succeeded);
    assert!(daemon.leftover_sandboxes().await.is_empty());
}

fn count_of(rows: &[(&'static str, i64)], table: &str) -> i64 {
    rows.iter().find(|(t, _)| *t == table).map(|(_, n)| *n).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_executions_never_runs_more_than_the_bound() {
    require_bwrap();
    let witness = Witness::new();
    let script = format!("{} sleep 2; {}", witness.enter(), witness.leave());
    let profile = witness.profile("test.burst", &script, "nothing");
    let daemon = TestDaemon::start(Options {
        profiles: vec![("burst.toml".into(), profile)],
        config: Box::new(|c| c.max_running_executions = 4),
        ..Options::default()
    })
    .await;
    let client = daemon.executions().await;
    let before = daemon.engine.store.row_counts().await.unwrap();
    assert_eq!(count_of(&before, "executions"), 0);

    // 40 at once, each on its own stream of one connection.
    let calls = (0..40).map(|_| {
        let mut client = client.clone();
        tokio::spawn(async move {
            let mut stream = client.execute(request("test.burst", "burst")).await?.into_inner();
            let mut last = None;
            while let Some(event) = stream.message().await? {
                last = Some(event);
            }
            Ok::<_, tonic::Status>(last)
        })
    });
    // On a fleet all 40 are accepted: past the room they wait in the queue.
    let shared = daemon.engine.store.is_shared();
    let mut admitted = Vec::new();
    let mut refused = 0;
    for call in calls.collect::<Vec<_>>() {
        match call.await.unwrap() {
            Ok(last) => admitted.push(finished(&[last.expect("a finished event")])),
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert_eq!(status.get_details_error_info().unwrap().reason, "OVERLOADED");
                refused += 1;
            }
        }
    }
    // From inside the sandboxes: four harnesses, never more than four alive.
    let (started, most) = witness.counts();
    assert!(most <= 4, "{most} harnesses were alive at once");
    assert_eq!(most, 4, "the four admitted ran side by side");
    let expect = if shared { 40 } else { 4 };
    assert_eq!(started, expect, "harnesses that started");
    assert_eq!((admitted.len(), refused), (expect, 40 - expect));
    for record in &admitted {
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    }
    // Nothing stored for the refused; the sandboxes were destroyed, and a
    // destroyed sandbox keeps no row once it is reclaimed.
    daemon.engine.reclaimed().await;
    let after = daemon.engine.store.row_counts().await.unwrap();
    assert_eq!(count_of(&after, "executions"), expect as i64);
    assert_eq!(count_of(&after, "sandboxes"), 0);
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_sessions_never_runs_more_than_the_bound() {
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let witness = Witness::new();
    // Alive from its start until its stdin closes (the session ends).
    let script = format!(
        r#"{} while read -r line; do echo '{{"type":"result","ok":true,"output":"ok"}}'; done; {}"#,
        witness.enter(),
        witness.leave()
    );
    let profile = witness.profile("test.burst-session", &script, "task_json");
    let daemon = TestDaemon::start(Options {
        profiles: vec![("burst.toml".into(), profile)],
        config: Box::new(|c| c.max_running_sessions = 4),
        ..Options::default()
    })
    .await;
    let client = SessionServiceClient::new(daemon.channel().await);
    let calls = (0..40).map(|_| {
        let mut client = client.clone();
        tokio::spawn(async move {
            let req = pb::CreateSessionRequest {
                profile_ref: "test.burst-session".into(),
                project: "proj-a".into(),
                ..Default::default()
            };
            client.create_session(req).await.map(|r| r.into_inner().session_id)
        })
    });
    let mut admitted = Vec::new();
    let mut refused = 0;
    for call in calls.collect::<Vec<_>>() {
        match call.await.unwrap() {
            Ok(id) => admitted.push(id),
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                refused += 1;
            }
        }
    }
    // Every admitted harness has marked itself alive; give a fifth the time
    // to show up if one were running.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while witness.counts().0 < admitted.len() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (started, most) = witness.counts();
    assert!(most <= 4, "{most} harnesses were alive at once");
    assert_eq!(started, 4, "harnesses that started");
    assert_eq!((admitted.len(), refused), (4, 36));
    let rows = daemon.engine.store.row_counts().await.unwrap();
    assert_eq!(count_of(&rows, "sessions"), 4, "nothing stored for the refused");
    for id in admitted {
        client.clone().end_session(pb::EndSessionRequest { session_id: id }).await.unwrap();
    }
    // Ended, their places are free again.
    let req = pb::CreateSessionRequest {
        profile_ref: "test.burst-session".into(),
        project: "proj-a".into(),
        ..Default::default()
    };
    let again = client.clone().create_session(req).await.expect("room again").into_inner();
    client.clone().end_session(pb::EndSessionRequest { session_id: again.session_id }).await.unwrap();
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

/// An EndSession while the session is still starting ends it: the start is
/// cancelled, tears down what it made and gives back its own slot once. It
/// never goes active afterwards, and the one slot never holds two sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_a_starting_session_ends_it_and_frees_its_one_slot_once() {
    use common::faults::{bwrap_with, BackendFaults};
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let witness = Witness::new();
    let script = format!(
        r#"{} while read -r line; do echo '{{"type":"result","ok":true,"output":"ok"}}'; done; {}"#,
        witness.enter(),
        witness.leave()
    );
    let profile = witness.profile("test.slow-session", &script, "task_json");
    // Each sandbox takes 300 ms to make: the session is STARTING that long.
    let (backends, _log) = bwrap_with(BackendFaults { slow_create: true, ..Default::default() });
    let daemon = TestDaemon::start(Options {
        profiles: vec![("slow.toml".into(), profile)],
        backends: Some(backends),
        config: Box::new(|c| c.max_running_sessions = 1),
        ..Options::default()
    })
    .await;
    let client = SessionServiceClient::new(daemon.channel().await);
    let create = |id: &str| {
        let mut client = client.clone();
        let req = pb::CreateSessionRequest {
            session_id: id.into(),
            profile_ref: "test.slow-session".into(),
            project: "proj-a".into(),
            ..Default::default()
        };
        tokio::spawn(async move { client.create_session(req).await.map(|r| r.into_inner()) })
    };
    let get = |id: &str| {
        let mut client = client.clone();
        let req = pb::GetSessionRequest { session_id: id.into() };
        async move { client.get_session(req).await.map(|r| r.into_inner()) }
    };

    let creating_a = create("a");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match get("a").await {
            Ok(s) if s.state == pb::SessionState::Starting as i32 => break,
            Ok(s) => panic!("a was never seen starting: {s:?}"),
            Err(status) => assert_eq!(status.code(), Code::NotFound, "{status:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "a was never stored");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let ended = client
        .clone()
        .end_session(pb::EndSessionRequest { session_id: "a".into() })
        .await
        .expect("a ends")
        .into_inner();
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "EndSession returns the ended record: {ended:?}");
    let status = creating_a.await.unwrap().expect_err("a start that was ended is no session");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let a = get("a").await.unwrap();
    assert_eq!(a.state, pb::SessionState::Ended as i32, "a never goes active once ended: {a:?}");

    // The one slot is free again, exactly once: b takes it, c is refused.
    let b = create("b").await.unwrap().expect("b is admitted");
    assert_eq!(b.state, pb::SessionState::Active as i32, "{b:?}");
    let status = create("c").await.unwrap().expect_err("one slot, held by b");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (_, most) = witness.counts();
    assert!(most <= 1, "{most} session harnesses were alive at once with one slot");
    assert_eq!(get("a").await.unwrap().state, pb::SessionState::Ended as i32);
    client.clone().end_session(pb::EndSessionRequest { session_id: "b".into() }).await.unwrap();
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}
