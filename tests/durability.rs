//! Nothing lost across restarts, crashes, slow watchers and retries. The
//! first two tests kill a real `corral serve` process.

mod common;

use std::time::{Duration, Instant};

use common::{finished, kinds, processes_with, request, require_bwrap, Options, ServeProcess, TestDaemon};
use corral::pb::{self, execution_service_client::ExecutionServiceClient, lifecycle_event::Kind};
use tonic::Code;
use tonic_types::StatusExt;

/// A profile dir whose fake agent carries `marker` in its argv, so the test
/// can find every process of it in /proc.
fn marked_profiles(dir: &std::path::Path, marker: &str) -> std::path::PathBuf {
    let profiles = dir.join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let profile = common::fake_agent_profile("test.fake-agent", "")
        .replace("fake_agent.py\"]", &format!("fake_agent.py\", \"{marker}\"]"));
    std::fs::write(profiles.join("fake.toml"), profile).unwrap();
    profiles
}

/// Starts a hanging execution and returns its id once the harness runs.
async fn start_hanging(client: &mut ExecutionServiceClient<tonic::transport::Channel>, repo: &str) -> String {
    let mut req = request("test.fake-agent", "NOWORK\nHANG");
    req.repo = repo.into();
    let execution = client.start_execution(req).await.expect("start").into_inner();
    let watch = pb::WatchRequest { execution_id: execution.execution_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(watch).await.unwrap().into_inner();
    while let Some(event) = stream.message().await.unwrap() {
        if matches!(event.kind, Some(Kind::Progress(_))) {
            return execution.execution_id;
        }
    }
    panic!("the execution ended before its harness reported progress");
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sandbox_dirs(data: &std::path::Path) -> usize {
    std::fs::read_dir(data.join("sandboxes")).map(|d| d.count()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_leaves_no_agent_and_a_restart_recovers_the_execution() {
    require_bwrap();
    let dir = common::data_tempdir();
    let marker = format!("CRASH-MARKER-{}", std::process::id());
    let profiles = marked_profiles(dir.path(), &marker);
    let data = dir.path().join("data");
    let repo = common::git_repo();

    let mut daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_hanging(&mut client, &repo.path().display().to_string()).await;
    let before: Vec<pb::LifecycleEvent> = {
        // What was stored before the crash, as a watcher saw it.
        let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
        let mut stream = client.watch_execution(req).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Ok(Ok(Some(e))) = tokio::time::timeout(Duration::from_millis(500), stream.message()).await {
            events.push(e);
        }
        events
    };
    assert!(processes_with(&marker) > 0, "the harness runs");
    assert_eq!(sandbox_dirs(&data), 1);

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
    daemon.child.wait().await.unwrap();
    wait_until("no agent process survives the daemon", || processes_with(&marker) == 0).await;

    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let record = client
        .get_execution(pb::GetExecutionRequest { execution_id: id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let evidence = record.evidence.clone().unwrap();
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Failed);
    assert_eq!(pb::FailureStage::try_from(evidence.failure_stage).unwrap(), pb::FailureStage::Execution);
    assert!(evidence.notes.iter().any(|n| n == "daemon restarted during execution"), "{:?}", evidence.notes);
    assert_eq!(sandbox_dirs(&data), 0, "the workspace is gone");

    let replay = {
        let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
        let mut stream = client.watch_execution(req).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.message().await.unwrap() {
            events.push(e);
        }
        events
    };
    assert_eq!(&replay[..before.len()], &before[..], "every event stored before the crash is replayed");
    assert_eq!(&kinds(&replay)[before.len()..], ["recovered", "teardown", "finished"]);
    let Some(Kind::Teardown(teardown)) = &replay[before.len() + 1].kind else { panic!() };
    assert_eq!(pb::TeardownResult::try_from(teardown.sandbox_destroy).unwrap(), pb::TeardownResult::Succeeded);

    // Recovery a second time changes nothing more.
    drop(client);
    let mut daemon = daemon;
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    let mut again = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        again.push(e);
    }
    assert_eq!(again, replay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_tears_down_and_exits_zero() {
    require_bwrap();
    let dir = common::data_tempdir();
    let marker = format!("TERM-MARKER-{}", std::process::id());
    let profiles = marked_profiles(dir.path(), &marker);
    let data = dir.path().join("data");
    let mut daemon = ServeProcess::start(&data, &profiles, &[("CORRAL_SHUTDOWN_GRACE_SECONDS", "1")]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_hanging(&mut client, "").await;
    // A watcher still following gets the run's end before its stream ends:
    // the drain finishes the run first, then ends the streams.
    let watch = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut watching = client.watch_execution(watch).await.unwrap().into_inner();
    let mut last = None;
    while let Some(event) = watching.message().await.unwrap() {
        if matches!(event.kind, Some(Kind::Progress(_))) {
            break;
        }
    }

    let started = Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match watching.message().await {
                Ok(Some(event)) => last = event.kind,
                Ok(None) => return Ok(()),
                Err(status) => return Err(status),
            }
        }
    })
    .await
    .expect("the watch ends at shutdown");
    assert!(ended.is_ok(), "{ended:?}");
    let Some(Kind::Finished(finished)) = &last else { panic!("the watch's last event: {last:?}") };
    let Some(pb::finished::Record::Execution(execution)) = &finished.record else { panic!("{finished:?}") };
    assert_eq!(execution.state, pb::ExecutionState::Cancelled as i32);
    let status = tokio::time::timeout(Duration::from_secs(30), daemon.child.wait()).await.expect("exits").unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(processes_with(&marker), 0, "no sandbox process is left");
    assert_eq!(sandbox_dirs(&data), 0, "no workspace is left");

    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let record = client
        .get_execution(pb::GetExecutionRequest { execution_id: id, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Cancelled);
    let evidence = record.evidence.unwrap();
    assert_eq!(pb::TeardownResult::try_from(evidence.sandbox_destroy).unwrap(), pb::TeardownResult::Succeeded);
}

async fn read_all(
    client: &mut ExecutionServiceClient<tonic::transport::Channel>,
    id: &str,
    after: u64,
) -> Vec<pb::LifecycleEvent> {
    let req = pb::WatchRequest { execution_id: id.into(), after_sequence: after };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    events
}

async fn timed_run(daemon: &TestDaemon, description: &str) -> (String, Duration) {
    let mut client = daemon.executions().await;
    let started = Instant::now();
    let execution = client.start_execution(request("test.fake-agent", description)).await.unwrap().into_inner();
    let events = read_all(&mut client, &execution.execution_id, 0).await;
    finished(&events);
    (execution.execution_id, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_watchers_get_everything_and_a_stalled_one_is_ended_then_resumes() {
    require_bwrap();
    let options = Options::default();
    let daemon = TestDaemon::start(options).await;
    // Paced over two seconds, so that every watcher below subscribes while
    // the run still emits: unpaced, on a fast host, the run could end
    // before the stalled watcher subscribed, which then reads the stored
    // events at its own pace and is never ended.
    let task = "NOWORK\nPACE 5000\nPROGRESS 10000";
    let (_, baseline) = timed_run(&daemon, task).await;

    let mut client = daemon.executions().await;
    let started = Instant::now();
    let execution = client.start_execution(request("test.fake-agent", task)).await.unwrap().into_inner();
    let id = execution.execution_id.clone();

    // The stalled watcher: reads one event, then nothing for a while. A
    // small HTTP/2 window makes the transport push back on the daemon soon,
    // as a slow client across a real network would.
    let endpoint = tonic::transport::Endpoint::from_static("http://corral.sock")
        .initial_stream_window_size(Some(16 * 1024))
        .initial_connection_window_size(Some(16 * 1024));
    let mut stalled_client = ExecutionServiceClient::new(common::unix_channel_with(&daemon.socket(), endpoint).await);
    let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut stalled = stalled_client.watch_execution(req).await.unwrap().into_inner();
    let first = stalled.message().await.unwrap().unwrap();
    assert_eq!(first.sequence, 1);

    let mut watchers = Vec::new();
    for _ in 0..50 {
        let channel = daemon.channel().await;
        let id = id.clone();
        watchers.push(tokio::spawn(async move { read_all(&mut ExecutionServiceClient::new(channel), &id, 0).await }));
    }
    let mut all = Vec::new();
    for watcher in watchers {
        all.push(watcher.await.unwrap());
    }
    let duration = started.elapsed();
    let n = all[0].len() as u64;
    assert!(n > 10_000, "{n} events, ending with {:?}", all[0].last().map(|e| &e.kind));
    for events in &all {
        let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
        assert_eq!(sequences, (1..=n).collect::<Vec<_>>(), "every watcher gets every event in order");
    }
    // The structural proof is that the execution finished at all while the
    // stalled watcher read nothing (it only reads again below). The time
    // check is deliberately loose: other tests share these two cores.
    assert!(
        duration < baseline * 10 + Duration::from_secs(30),
        "with a stalled watcher {duration:?}, without {baseline:?}"
    );

    // The stalled watcher now reads: it gets what was buffered for it, then
    // RESOURCE_EXHAUSTED with its last delivered sequence.
    let mut last = first.sequence;
    let status = loop {
        match stalled.message().await {
            Ok(Some(e)) => {
                assert_eq!(e.sequence, last + 1);
                last = e.sequence;
            }
            Ok(None) => panic!("the stalled watcher was not ended"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted);
    let info = status.get_details_error_info().expect("error info");
    assert_eq!(info.metadata.get("last_sequence"), Some(&last.to_string()));
    assert!(last < n);
    let rest = read_all(&mut stalled_client, &id, last).await;
    let sequences: Vec<u64> = rest.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (last + 1..=n).collect::<Vec<_>>(), "resuming yields the rest, no gap, no duplicate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_at_any_seam_has_no_gap_and_no_duplicate() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let execution =
        client.start_execution(request("test.fake-agent", "NOWORK\nPROGRESS 300")).await.unwrap().into_inner();
    let id = execution.execution_id;
    // Interrupt live watches at pseudo-random points while the run goes on.
    let mut seed = std::process::id() as u64;
    for _ in 0..6 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let k_target = 1 + (seed >> 33) % 250;
        let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
        let mut stream = client.watch_execution(req).await.unwrap().into_inner();
        let mut k = 0;
        while let Some(e) = stream.message().await.unwrap() {
            assert_eq!(e.sequence, k + 1);
            k = e.sequence;
            if k == k_target {
                break;
            }
        }
        drop(stream);
        let rest = read_all(&mut client, &id, k).await;
        let sequences: Vec<u64> = rest.iter().map(|e| e.sequence).collect();
        let n = k + sequences.len() as u64;
        assert_eq!(sequences, (k + 1..=n).collect::<Vec<_>>(), "resume after {k}");
        assert!(matches!(rest.last().and_then(|e| e.kind.as_ref()), Some(Kind::Finished(_))));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compacted_events_answer_out_of_range_with_the_oldest_sequence() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let (id, _) = timed_run(&daemon, "NOWORK").await;
    let mut client = daemon.executions().await;
    let n = read_all(&mut client, &id, 0).await.len() as u64;
    let removed = daemon.engine.store.compact_events(corral::lifecycle::now_ms() + 1).await.unwrap();
    assert_eq!(removed, n - 1);
    let status = client
        .watch_execution(pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 })
        .await
        .expect_err("older than retention");
    assert_eq!(status.code(), Code::OutOfRange);
    let info = status.get_details_error_info().unwrap();
    assert_eq!(info.metadata.get("oldest_sequence"), Some(&n.to_string()));
    // From the oldest available, the record is still there.
    let rest = read_all(&mut client, &id, n - 1).await;
    assert_eq!(kinds(&rest), ["finished"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_disconnect_cancels_only_when_asked() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let mut req = request("test.fake-agent", "NOWORK\nHANG");
    req.cancel_on_disconnect = true;
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let accepted = stream.message().await.unwrap().unwrap();
    let Some(Kind::Accepted(a)) = accepted.kind else { panic!("accepted first") };
    drop(stream);
    let events = read_all(&mut client, &a.execution_id, 0).await;
    let execution = finished(&events);
    assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Cancelled);
    assert!(daemon.leftover_sandboxes().await.is_empty());
}

/// A session that had started and sat idle (its last event `sandbox_ready`)
/// was past its start when the daemon died: recovery says so, not
/// "during session_start".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_active_session_is_recovered_as_past_its_start() {
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("s.toml"), common::session_agent_profile("test.session", "")).unwrap();
    let data = dir.path().join("data");

    let mut daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest {
        session_id: "idle".into(),
        profile_ref: "test.session".into(),
        ..Default::default()
    };
    let session = client.create_session(create).await.expect("created").into_inner();
    assert_eq!(session.state, pb::SessionState::Active as i32, "{session:?}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
    daemon.child.wait().await.unwrap();

    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let record = client
        .get_session(pb::GetSessionRequest { session_id: "idle".into() })
        .await
        .expect("the session is still stored")
        .into_inner();
    assert_eq!(record.state, pb::SessionState::Failed as i32, "{record:?}");
    let evidence = record.evidence.expect("evidence");
    let stage = pb::FailureStage::try_from(evidence.failure_stage).unwrap();
    assert_ne!(stage, pb::FailureStage::SessionStart, "it had started: {evidence:?}");
    assert_eq!(stage, pb::FailureStage::Execution, "{evidence:?}");
    assert!(evidence.notes.iter().any(|n| n == "daemon restarted during execution"), "{:?}", evidence.notes);
    // Its error is the daemon's own note: no call was told the cause, and
    // `corral get --full` reads executions only.
    assert_eq!(evidence.error, "daemon restarted during execution");
    assert_eq!(sandbox_dirs(&data), 0, "the sandbox is gone");
}

/// The record of execution `id`, read through `daemon`.
async fn record_of(daemon: &ServeProcess, id: &str) -> pb::Execution {
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let get = pb::GetExecutionRequest { execution_id: id.into(), ..Default::default() };
    client.get_execution(get).await.expect("the execution is stored").into_inner()
}

/// SIGKILL, and the daemon's harnesses (which carry `marker`) gone with it.
async fn kill_9(mut daemon: ServeProcess, marker: &str) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
    daemon.child.wait().await.unwrap();
    wait_until("no process of the killed daemon's runs survives it", || processes_with(marker) == 0).await;
}

/// The default node name is the host and the data directory, resolved: a
/// daemon started again on the same directory spelled otherwise (through a
/// symlink, with a trailing slash) is the same node, and recovers what its
/// predecessor left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_through_another_spelling_of_the_data_directory_recovers_the_execution() {
    require_bwrap();
    let dir = common::data_tempdir();
    let marker = format!("SPELLING-MARKER-{}", std::process::id());
    let profiles = marked_profiles(dir.path(), &marker);
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_hanging(&mut client, "").await;
    assert_eq!(sandbox_dirs(&data), 1);
    kill_9(daemon, &marker).await;

    // The same directory through a symlink, with a trailing slash; its
    // config (uids, store) is the first one's.
    let alias = dir.path().join("alias");
    std::os::unix::fs::symlink(&data, &alias).unwrap();
    std::fs::copy(data.with_extension("toml"), alias.with_extension("toml")).unwrap();
    let spelled = std::path::PathBuf::from(format!("{}/", alias.display()));
    let daemon = ServeProcess::start(&spelled, &profiles, &[]).await;
    let record = record_of(&daemon, &id).await;
    let evidence = record.evidence.clone().unwrap();
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Failed, "{record:?}");
    assert!(evidence.notes.iter().any(|n| n == "daemon restarted during execution"), "{:?}", evidence.notes);
    assert_eq!(sandbox_dirs(&data), 0, "the workspace is gone");
    let mut catalog = corral::pb::catalog_service_client::CatalogServiceClient::new(daemon.channel().await);
    let nodes = catalog.list_nodes(pb::ListNodesRequest {}).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.len(), 1, "one node, whatever the spelling: {nodes:?}");
    assert!(nodes[0].name.ends_with(&format!(":{}", data.canonicalize().unwrap().display())), "{nodes:?}");
}

/// A crash while the workspace is being captured (a clean filter the
/// agent configured makes the capture's `git add` take minutes) is
/// recorded as during teardown, not during the execution; and the capture
/// bundles a crash leaves in `sandboxes/` go with the rest, while a file
/// there that no run could have written is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_the_capture_is_recovered_as_during_teardown_and_leaves_no_bundle() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let repo = common::git_repo();
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    // The marker is the filter's $0 once git runs it; the script names it
    // in two halves, so the agent's own shell does not carry it.
    let marker = format!("CAPTURE-SLOW-{}", std::process::id());
    let (front, back) = marker.split_at(8);
    let script = format!(
        "git config filter.slow.clean \"sh -c 'sleep 600; cat' {front}\"'{back}'\n\
         echo '* filter=slow' > .gitattributes\necho work > work.txt\necho done\n"
    );
    let mut req = request("builtin.shell", &script);
    req.repo = repo.path().display().to_string();
    let id = client.start_execution(req).await.expect("start").into_inner().execution_id;
    wait_until("the capture runs the slow filter", || processes_with(&marker) > 0).await;
    // Well past the moment a teardown that lasts is stored.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sandbox_id = std::fs::read_dir(data.join("sandboxes"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find(|name| uuid::Uuid::parse_str(name).is_ok())
        .expect("the run's sandbox directory");
    kill_9(daemon, &marker).await;
    // What a crash between the bundle's copy and its fetch leaves, one of
    // no run, and a file no run could have written.
    let sandboxes = data.join("sandboxes");
    let stray = uuid::Uuid::now_v7().to_string();
    for name in [format!("{sandbox_id}.bundle"), format!("{stray}.bundle"), "keep.bundle".to_string()] {
        std::fs::write(sandboxes.join(name), "bundle").unwrap();
    }

    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let record = record_of(&daemon, &id).await;
    let evidence = record.evidence.clone().unwrap();
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Failed, "{record:?}");
    assert_eq!(pb::FailureStage::try_from(evidence.failure_stage).unwrap(), pb::FailureStage::Teardown, "{evidence:?}");
    assert!(evidence.notes.iter().any(|n| n == "daemon restarted during teardown"), "{:?}", evidence.notes);
    let left: Vec<String> =
        std::fs::read_dir(&sandboxes).unwrap().filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    assert_eq!(left, ["keep.bundle"], "the sandbox and every bundle of a run are gone");
    drop(daemon);
}

/// A harness that takes a while to start (here its spawn takes 300 ms)
/// has its `sandbox_ready` stored while it starts, not only with the
/// dispatch that follows: a crash then is recovered as during
/// session_start, not sandbox_create (recovery reads the last stored event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_harness_start_is_stored_as_reached_while_it_starts() {
    use common::faults::{bwrap_with, BackendFaults};
    use corral::records::EventKind;
    require_bwrap();
    let (backends, _log) = bwrap_with(BackendFaults { slow_spawn: true, ..Default::default() });
    let daemon = TestDaemon::start(Options { backends: Some(backends), ..Options::default() }).await;
    let mut client = daemon.executions().await;
    let id = client.start_execution(request("test.fake-agent", "quick")).await.unwrap().into_inner().execution_id;
    let store = &daemon.engine.store;
    let started = Instant::now();
    let mut seen_starting = false;
    loop {
        let kinds: Vec<EventKind> = store.events_after(&id, 0).await.unwrap().into_iter().map(|e| e.kind).collect();
        let ready = kinds.iter().any(|k| matches!(k, EventKind::SandboxReady { .. }));
        let dispatched = kinds.iter().any(|k| matches!(k, EventKind::Dispatched { .. }));
        seen_starting |= ready && !dispatched;
        if dispatched || started.elapsed() > Duration::from_secs(20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(seen_starting, "sandbox_ready was stored while the harness started, before its dispatch");
    let events = read_all(&mut client, &id, 0).await;
    assert_eq!(pb::ExecutionState::try_from(finished(&events).state).unwrap(), pb::ExecutionState::Succeeded);
}

/// What recovery finishes is counted as any finished run is: after a
/// SIGKILL during a running execution and an idle session, the next start
/// (which installs its metrics recorder before it recovers) counts one
/// execution failed during its execution and one session failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_finished_by_recovery_are_counted_in_the_metrics() {
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let dir = common::data_tempdir();
    let marker = format!("COUNTED-MARKER-{}", std::process::id());
    let profiles = marked_profiles(dir.path(), &marker);
    std::fs::write(profiles.join("s.toml"), common::session_agent_profile("test.session", "")).unwrap();
    let data = dir.path().join("data");
    let metrics = || {
        let port = common::unused_port();
        (port, format!("metrics_listen = \"127.0.0.1:{port}\"\n"))
    };
    let (_, extra) = metrics();
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_hanging(&mut client, "").await;
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.session".into(), ..Default::default() };
    sessions.create_session(create).await.expect("session created");
    kill_9(daemon, &marker).await;

    let (port, extra) = metrics();
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let record = record_of(&daemon, &id).await;
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Failed, "{record:?}");
    let text = common::scrape(port).await;
    let executions = |labels| common::sample(&text, "corral_executions_finished_total", labels);
    assert_eq!(executions(r#"outcome="failed",stage="execution""#), Some(1.0), "{text}");
    let sessions = common::sample(&text, "corral_sessions_finished_total", r#"state="failed""#);
    assert_eq!(sessions, Some(1.0), "{text}");
    daemon.stop().await;
}

/// A session counted as it ends: one whose harness will not exit ends
/// `failed` (its record says so), and is counted `failed`, not under the
/// state it was asked to end in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_ends_failed_is_counted_failed() {
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("s.toml"), common::stubborn_profile()).unwrap();
    let data = dir.path().join("data");
    let port = common::unused_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.stubborn".into(), ..Default::default() };
    let id = sessions.create_session(create).await.expect("session created").into_inner().session_id;
    let ended = sessions.end_session(pb::EndSessionRequest { session_id: id }).await.expect("ends").into_inner();
    assert_eq!(ended.state, pb::SessionState::Failed as i32, "{ended:?}");
    let text = common::scrape(port).await;
    let count = |state: &str| common::sample(&text, "corral_sessions_finished_total", &format!("state=\"{state}\""));
    assert_eq!(count("failed"), Some(1.0), "{text}");
    assert_eq!(count("ended").unwrap_or(0.0), 0.0, "{text}");
    daemon.stop().await;
}
