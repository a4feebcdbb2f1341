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

/// A directory every sandbox may write to (its own uid each, as root):
/// `alive/` holds one file per harness while it runs, `seen/` what each
/// harness counted there when it started and before it ended.
struct Witness {
    dir: tempfile::TempDir,
}

impl Witness {
    fn new() -> Witness {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for sub in ["", "alive", "seen"] {
            let path = dir.path().join(sub);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o1777)).unwrap();
        }
        Witness { dir }
    }

    fn path(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// The shell lines that mark a harness alive and record what it sees.
    fn enter(&self) -> String {
        let d = self.path();
        format!(r#"me="${{CORRAL_RUN_ID:?}}"; touch "{d}/alive/$me"; ls "{d}/alive" | wc -l > "{d}/seen/$me.start";"#)
    }

    fn leave(&self) -> String {
        let d = self.path();
        format!(r#"ls "{d}/alive" | wc -l > "{d}/seen/$me.end"; rm -f "{d}/alive/$me";"#)
    }

    /// A bwrap profile whose harness is `script`, with the witness
    /// directory writable.
    fn profile(&self, id: &str, script: &str, input: &str) -> String {
        format!(
            r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", '''{script}''']
input = "{input}"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = [".", "{}"]
[limits]
timeout_seconds = 60
max_output_bytes = 65536
"#,
            self.path()
        )
    }

    /// How many harnesses started, and the most any of them saw alive at
    /// once (itself included).
    fn counts(&self) -> (usize, usize) {
        let mut started = 0;
        let mut most = 0;
        for entry in std::fs::read_dir(self.dir.path().join("seen")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "start") {
                started += 1;
            }
            let n: usize = std::fs::read_to_string(&path).unwrap().trim().parse().unwrap_or(0);
            most = most.max(n);
        }
        (started, most)
    }
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
    assert_eq!(started, 4, "harnesses that started");
    assert_eq!(most, 4, "the four admitted ran side by side");
    assert_eq!((admitted.len(), refused), (4, 36));
    for record in &admitted {
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    }
    // Nothing stored for the 36; the four sandboxes were destroyed, and a
    // destroyed sandbox keeps no row.
    let after = daemon.engine.store.row_counts().await.unwrap();
    assert_eq!(count_of(&after, "executions"), 4);
    assert_eq!(count_of(&after, "sandboxes"), 0);
    assert!(daemon.leftover_sandboxes().is_empty());
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
    assert!(daemon.leftover_sandboxes().is_empty());
    daemon.stop().await;
}
