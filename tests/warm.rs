//! Warm pools (`[sandbox] warm`): sandboxes made ahead of any request, each
//! waiting in real bubblewrap for the one execution it serves.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use corral::pb;

const PROFILE: &str = "test.fake-agent";

fn pooled(size: usize) -> Options {
    Options {
        config: Box::new(move |c| {
            c.sandbox.warm.insert(PROFILE.into(), size);
        }),
        ..Options::default()
    }
}

/// Waits until every pool of the daemon holds its size.
async fn full(daemon: &TestDaemon) {
    for _ in 0..400 {
        if daemon.engine.warm_levels().iter().all(|(_, waiting, size)| waiting == size) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the warm pool did not fill: {:?}", daemon.engine.warm_levels());
}

fn ready(events: &[pb::LifecycleEvent]) -> pb::SandboxReady {
    events
        .iter()
        .find_map(|e| match &e.kind {
            Some(pb::lifecycle_event::Kind::SandboxReady(r)) => Some((**r).clone()),
            _ => None,
        })
        .expect("a sandbox_ready event")
}

fn was_warm(execution: &pb::Execution) -> bool {
    evidence(execution).notes.iter().any(|n| n.contains("warm pool"))
}

/// The lines of a PROBE_SELF run, and the sandbox they ran in.
async fn probe(daemon: &TestDaemon) -> (Vec<String>, pb::Execution, pb::SandboxReady) {
    let events = daemon.execute(request(PROFILE, "NOWORK\nPROBE_SELF")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    let lines = execution.tool_output.lines().filter(|l| !l.starts_with("done:")).map(String::from).collect();
    (lines, execution, ready(&events))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_run_is_confined_and_receipted_exactly_as_a_cold_one() {
    require_bwrap();
    let warm = TestDaemon::start(pooled(1)).await;
    let cold = TestDaemon::start(Options::default()).await;
    full(&warm).await;
    let waiting = warm.leftover_sandboxes().await;
    assert_eq!(waiting.len(), 1, "one sandbox waits before any request");
    let (warm_lines, warm_run, warm_ready) = probe(&warm).await;
    let (cold_lines, cold_run, cold_ready) = probe(&cold).await;
    assert!(was_warm(&warm_run), "the pooled daemon's run took its warm sandbox: {:?}", evidence(&warm_run).notes);
    assert!(!was_warm(&cold_run));
    assert_eq!(waiting[0].file_name().unwrap().to_str(), Some(warm_ready.sandbox_id.as_str()));

    // The boundary seen from inside: ids, capabilities, seccomp, every
    // descriptor, rlimits, mounts, cgroups, environment names.
    assert!(warm_lines.iter().any(|l| l == "status Seccomp: 2"), "{warm_lines:#?}");
    assert!(warm_lines.iter().any(|l| l.starts_with("mount /workspace ")), "{warm_lines:#?}");
    assert_eq!(warm_lines, cold_lines, "the warm run sees another boundary than the cold one");
    // The waiter's own binary never reaches the harness.
    // (The one that is gone is the listing's own, closed once read.)
    let fds: Vec<&str> = warm_lines
        .iter()
        .filter(|l| l.starts_with("fd ") && !l.ends_with("<FileNotFoundError>"))
        .map(|l| l.as_str())
        .collect();
    assert_eq!(fds, ["fd 0 -> pipe", "fd 1 -> pipe", "fd 2 -> pipe"], "stdio only");

    // The receipt: the same but for what is the sandbox's own (its uid,
    // and the digest of a command line that names its directory).
    let strip = |r: &pb::SandboxReady| {
        let mut receipt = r.receipt.clone().expect("a receipt");
        assert_eq!(receipt.command_digest.len(), 64);
        receipt.command_digest.clear();
        receipt.host_uid = 0;
        receipt
    };
    assert_eq!(strip(&warm_ready), strip(&cold_ready));
    warm.stop().await;
    cold.stop().await;
}

/// A finished run's record without what is its own (ids, times, its
/// sandbox, how long each stage took, the note that it took a warm
/// sandbox): what a warm and a cold run of one request have alike.
fn comparable(mut execution: pb::Execution) -> pb::Execution {
    execution.execution_id.clear();
    execution.request_id.clear();
    execution.correlation_id.clear();
    execution.consumer.as_mut().expect("a consumer").run_id.clear();
    execution.created_at = None;
    execution.finished_at = None;
    let evidence = execution.evidence.as_mut().expect("evidence");
    evidence.sandbox_id.clear();
    evidence.request_id.clear();
    evidence.correlation_id.clear();
    evidence.notes.retain(|n| !n.contains("warm pool"));
    for timing in &mut evidence.stage_timings {
        timing.micros = 0;
    }
    execution
}

/// The execution's stored record, in the full view (its raw error too).
async fn stored(daemon: &TestDaemon, execution_id: &str) -> pb::Execution {
    let get = pb::GetExecutionRequest { execution_id: execution_id.into(), view: pb::ExecutionView::Full as i32 };
    daemon.executions().await.get_execution(get).await.expect("a stored execution").into_inner()
}

/// A harness that cannot be started (its program is not in the sandbox,
/// or is not executable) fails warm exactly as cold: there bwrap's own
/// `execvp` fails (`bwrap: execvp <program>: <reason>`, status 1), here
/// the waiter's, which reports it the same way. The waiter said
/// otherwise (its own sentence, status 127), so the record told a warm
/// run from a cold one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_that_cannot_start_fails_warm_exactly_as_cold() {
    require_bwrap();
    // (profile, its program, why it cannot run): a name PATH does not
    // find, and a file the sandbox has that is no program.
    let cases = [
        ("test.missing", "corral-no-such-harness", "No such file or directory"),
        ("test.not-executable", "/etc/passwd", "Permission denied"),
    ];
    let profiles: Vec<(String, String)> = cases
        .iter()
        .map(|(id, program, _)| {
            let text = format!(
                "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"{program}\", \"--flag\"]\n\
                 input = \"nothing\"\n[sandbox]\ntype = \"linux_bwrap\"\n"
            );
            (format!("{id}.toml"), text)
        })
        .collect();
    let pools = profiles.clone();
    let warm = TestDaemon::start(Options {
        profiles: pools,
        config: Box::new(move |c| {
            for (id, _, _) in cases {
                c.sandbox.warm.insert(id.into(), 1);
            }
        }),
        ..Options::default()
    })
    .await;
    let cold = TestDaemon::start(Options { profiles, ..Options::default() }).await;
    full(&warm).await;
    for (id, program, why) in cases {
        let warm_events = warm.execute(request(id, "")).await;
        let cold_events = cold.execute(request(id, "")).await;
        let (warm_run, cold_run) = (finished(&warm_events), finished(&cold_events));
        assert!(was_warm(&warm_run), "{id}: the pooled daemon's run took no warm sandbox");
        assert!(!was_warm(&cold_run));
        assert_eq!(cold_run.state, pb::ExecutionState::Failed as i32, "{id}: {cold_run:?}");
        // The failure names the program and why it could not run.
        for text in [program, why] {
            assert!(cold_run.tool_error.contains(text), "{id}: {text:?} not in {:?}", cold_run.tool_error);
        }
        assert_eq!(warm_run.tool_error, cold_run.tool_error, "{id}: the raw error");
        assert_eq!(evidence(&warm_run).failure_class, evidence(&cold_run).failure_class, "{id}");
        assert_eq!(kinds(&warm_events), kinds(&cold_events), "{id}: the events");
        // As the caller's stream gave them, and as stored (the full view).
        let warm_stored = stored(&warm, &warm_run.execution_id).await;
        let cold_stored = stored(&cold, &cold_run.execution_id).await;
        assert!(cold_stored.tool_error.contains(program), "{id}: {:?}", cold_stored.tool_error);
        assert_eq!(warm_stored.tool_error, cold_stored.tool_error, "{id}: the stored raw error");
        assert_eq!(comparable(warm_stored), comparable(cold_stored), "{id}: the stored records");
        assert_eq!(comparable(warm_run), comparable(cold_run), "{id}: the records");
    }
    warm.stop().await;
    cold.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_serves_one_execution_and_the_pool_refills() {
    require_bwrap();
    let daemon = TestDaemon::start(pooled(1)).await;
    let origin = git_repo();
    let mut seen = std::collections::BTreeSet::new();
    for round in 0..3 {
        full(&daemon).await;
        let waiting = daemon.leftover_sandboxes().await;
        assert_eq!(waiting.len(), 1);
        // A run that commits in the workspace cloned into the warm
        // sandbox: its capture is a second process in the same sandbox,
        // which must start a bwrap of its own (the waiter is spent), and
        // the commit comes back to the origin.
        let mut req = request(PROFILE, "");
        req.repo = origin.path().display().to_string();
        let events = daemon.execute(req).await;
        let execution = finished(&events);
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "round {round}: {:?}", execution.tool_error);
        assert!(was_warm(&execution), "round {round}");
        let evidence = evidence(&execution);
        assert_eq!(evidence.agent_commits, 1, "round {round}: {:?}", evidence.notes);
        let head = git(origin.path(), &["rev-parse", &format!("refs/corral/{}", execution.execution_id)]);
        assert_eq!(evidence.commit_sha, head, "round {round}");
        let notes = git(origin.path(), &["show", &format!("{head}:AGENT_NOTES.md")]);
        assert!(notes.contains("edited by fake agent"), "round {round}: {notes}");
        let sandbox = ready(&events).sandbox_id;
        assert_eq!(waiting[0].file_name().unwrap().to_str(), Some(sandbox.as_str()));
        assert!(seen.insert(sandbox.clone()), "sandbox {sandbox} served a second execution");
        daemon.engine.reclaimed().await;
        assert!(!daemon.data_dir().join("sandboxes").join(&sandbox).exists(), "destroyed after its run");
    }
    daemon.stop().await;
}

/// A warm sandbox whose waiter dies while it waits (killed, out of memory)
/// is destroyed as soon as it does and replaced, with no run needed to
/// find it dead: its directory goes, the pool's level drops and comes
/// back with another sandbox, and the next run takes that one, warm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_whose_waiter_dies_is_destroyed_and_replaced_without_a_run() {
    require_bwrap();
    let daemon = TestDaemon::start(pooled(1)).await;
    full(&daemon).await;
    let waiting = daemon.leftover_sandboxes().await;
    assert_eq!(waiting.len(), 1);
    let dead = waiting[0].clone();
    wait_until("the waiter runs", || daemon.engine.warm_processes().iter().flatten().any(is_waiter)).await;
    // On the host's disk a waiting sandbox is its workspace and HOME only
    // (its /tmp and identity files are bwrap's, in memory).
    let mut on_disk: Vec<String> =
        std::fs::read_dir(&dead).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    on_disk.sort();
    assert_eq!(on_disk, ["home", "workspace"]);
    // Everything in its cgroup: bwrap, bwrap's pid 1 and the waiter.
    for pid in daemon.engine.warm_processes().concat() {
        // SAFETY: a plain kill(2).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }

    // No request: the daemon sees it die.
    wait_until("the dead sandbox is destroyed without a run", || !dead.exists()).await;
    full(&daemon).await;
    let now = daemon.leftover_sandboxes().await;
    assert_eq!(now.len(), 1, "the new sandbox only: {now:?}");
    assert_ne!(now[0], dead, "the pool counts the dead sandbox as waiting");
    wait_until("the new sandbox's waiter runs", || daemon.engine.warm_processes().iter().flatten().any(is_waiter))
        .await;
    let events = daemon.execute(request(PROFILE, "NOWORK")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    assert!(was_warm(&execution), "the run did not take the new sandbox");
    assert_eq!(Some(ready(&events).sandbox_id.as_str()), now[0].file_name().unwrap().to_str());
    daemon.stop().await;
}

/// A fenced node (its lease lost) kills the processes of its waiting warm
/// sandboxes too, without the store: their waiters carry no sandbox id in
/// their environment, so the fence's search by id alone missed them, and
/// they lived on until the daemon exited. Their directories (and rows) are
/// left to the next start's recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_kills_the_waiting_warm_sandboxes_and_leaves_them_to_recovery() {
    require_bwrap();
    let daemon = TestDaemon::start(pooled(2)).await;
    full(&daemon).await;
    wait_until("both waiters run", || {
        daemon.engine.warm_processes().iter().filter(|pids| pids.iter().any(is_waiter)).count() == 2
    })
    .await;
    let pids = daemon.engine.warm_processes().concat();
    let roots = daemon.leftover_sandboxes().await;
    assert_eq!(roots.len(), 2);

    let killed = daemon.engine.fence().await;
    assert!(killed >= pids.len(), "{killed} killed, {} processes were waiting", pids.len());
    wait_until("the waiting sandboxes' processes are dead", || !pids.iter().any(|pid| live_status(*pid).is_some()))
        .await;
    assert_eq!(daemon.engine.warm_levels(), [(PROFILE.to_string(), 0, 2)], "the pool is closed and empty");
    for root in &roots {
        assert!(root.exists(), "{} was destroyed through the store; a fence leaves it to recovery", root.display());
    }
    daemon.stop().await;
    // What the next start's recovery would remove: their cgroups (emptied
    // by the fence) are the host's, and go here.
    for root in &roots {
        let id = root.file_name().unwrap().to_str().unwrap();
        let cgroups = dirs_named(Path::new("/sys/fs/cgroup"), id, 5);
        for cgroup in cgroups {
            let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
            assert_eq!(procs, "", "{} still holds processes after the fence", cgroup.display());
            std::fs::remove_dir(&cgroup).unwrap_or_else(|e| panic!("cannot remove {}: {e}", cgroup.display()));
        }
    }
}

/// Every directory named `name` under `dir`, at most `depth` levels down.
fn dirs_named(dir: &Path, name: &str, depth: usize) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if entry.file_name() == name {
            found.push(entry.path());
        } else if depth > 1 {
            found.extend(dirs_named(&entry.path(), name, depth - 1));
        }
    }
    found
}

/// A run that took a warm sandbox and panicked (a bug; injected in the
/// harness's start, before any write named the run in the sandbox's row)
/// leaves no sandbox behind: the taken one is destroyed (its processes,
/// directory and uid) and the pool refills to its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_panics_in_a_taken_warm_sandbox_leaves_none_behind() {
    use common::faults::{reins_with, RecordingRein, ReinFaults};
    require_bwrap();
    let (rein, _) = RecordingRein::new(ReinFaults { panic_start: true, ..Default::default() });
    let daemon = TestDaemon::start(Options { reins: Some(reins_with(rein)), ..pooled(1) }).await;
    full(&daemon).await;
    let taken = daemon.leftover_sandboxes().await;
    assert_eq!(taken.len(), 1);
    let events = daemon.execute(request(PROFILE, "NOWORK")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    // Taken by the run (a cold one would have left it waiting), then
    // destroyed.
    wait_until("the taken warm sandbox is destroyed", || !taken[0].exists()).await;
    full(&daemon).await;
    assert_eq!(daemon.leftover_sandboxes().await.len(), 1, "the refilled one only");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_refills_more_than_one_sandbox_at_once_and_each_serves_one_run() {
    require_bwrap();
    let (backends, log) = faults::bwrap_with(faults::BackendFaults { slow_create: true, ..Default::default() });
    let daemon = TestDaemon::start(Options { backends: Some(backends), ..pooled(4) }).await;
    full(&daemon).await;
    assert!(log.lock().unwrap().most_creating >= 2, "the pool of 4 was made one sandbox at a time");
    // Four runs at once take the four, and the pool makes four more.
    let runs: Vec<_> = (0..4).map(|_| daemon.execute(request(PROFILE, ""))).collect();
    let mut served = std::collections::BTreeSet::new();
    for events in futures_util::future::join_all(runs).await {
        let execution = finished(&events);
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
        assert!(was_warm(&execution));
        assert!(served.insert(ready(&events).sandbox_id), "one warm sandbox served two runs");
    }
    full(&daemon).await;
    assert_eq!(log.lock().unwrap().creates, 8);
    daemon.stop().await;
}

/// Making a sandbox keeps a core busy: the pool a run took its sandbox
/// from refills once the run is over (or has run a while, next test), not
/// while the harness is being started (a start held 300 ms sees no second
/// create).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_does_not_refill_while_the_harness_of_the_run_that_took_from_it_starts() {
    require_bwrap();
    let (backends, log) = faults::bwrap_with(faults::BackendFaults { slow_spawn: true, ..Default::default() });
    let daemon = TestDaemon::start(Options { backends: Some(backends), ..pooled(1) }).await;
    full(&daemon).await;
    assert_eq!(log.lock().unwrap().creates, 1);
    let events = daemon.execute(request(PROFILE, "")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    assert!(was_warm(&execution));
    let at_spawn = log.lock().unwrap().creates_at_spawn.clone();
    assert_eq!(at_spawn.first(), Some(&1), "the refill began while the harness was starting: {at_spawn:?}");
    full(&daemon).await;
    assert_eq!(log.lock().unwrap().creates, 2, "the pool refilled after the run");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_the_gate_tightens_takes_the_cold_path_and_leaves_the_pool_alone() {
    require_bwrap();
    // Every run's timeout is cut to 5 s: its hook files and its limits are
    // not those the pool's sandbox was made with (the profile's 30 s).
    let options = Options {
        config: Box::new(|c| {
            c.sandbox.warm.insert(PROFILE.into(), 1);
            c.policies.push(corral::policy::PolicySpec {
                name: "short".into(),
                kind: "max_timeout".into(),
                arguments: serde_json::json!({ "seconds": 5 }),
                on: vec![],
            });
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    full(&daemon).await;
    let waiting = daemon.leftover_sandboxes().await;
    for _ in 0..2 {
        let events = daemon.execute(request(PROFILE, "NOWORK")).await;
        let execution = finished(&events);
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
        assert!(!was_warm(&execution), "a tightened run took a sandbox made for another timeout");
        assert_ne!(waiting[0].file_name().unwrap().to_str(), Some(ready(&events).sandbox_id.as_str()));
        assert_eq!(daemon.leftover_sandboxes().await, waiting, "the warm sandbox still waits, the only one left");
    }
    daemon.stop().await;
}

/// The same with the sandbox: a profile whose network is on, under an
/// admin policy that turns it off. The run gets the sandbox the gate
/// allowed, made for it, and the sandbox waiting for the profile's own
/// (network on, behind its egress proxy) is left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_sandbox_the_gate_tightens_takes_the_cold_path_and_leaves_the_pool_alone() {
    require_bwrap();
    let netted = fake_agent_profile(PROFILE, "")
        .replace("allow_network = false", "allow_network = true\nallow_hosts = [\"example.com\"]");
    assert!(netted.contains("allow_network = true"), "{netted}");
    let options = Options {
        profiles: vec![("fake.toml".into(), netted)],
        config: Box::new(|c| {
            c.sandbox.warm.insert(PROFILE.into(), 1);
            c.policies.push(corral::policy::PolicySpec {
                name: "no-network".into(),
                kind: "deny_network".into(),
                arguments: serde_json::json!({}),
                on: vec![],
            });
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    full(&daemon).await;
    let waiting = daemon.leftover_sandboxes().await;
    assert_eq!(waiting.len(), 1);
    wait_until("the waiter runs", || daemon.engine.warm_processes().iter().flatten().any(is_waiter)).await;
    let processes = daemon.engine.warm_processes();
    for _ in 0..2 {
        let events = daemon.execute(request(PROFILE, "NOWORK")).await;
        let execution = finished(&events);
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
        let effective = execution.effective_sandbox.clone().expect("an effective sandbox");
        assert!(
            !effective.allow_network && effective.allow_hosts.is_empty(),
            "not the tightened sandbox: {effective:?}"
        );
        assert!(evidence(&execution).gate_decisions.iter().any(|d| d.policy == "no-network"));
        assert!(!was_warm(&execution), "a tightened run took a sandbox made with the network on");
        assert_ne!(waiting[0].file_name().unwrap().to_str(), Some(ready(&events).sandbox_id.as_str()));
        assert_eq!(daemon.leftover_sandboxes().await, waiting, "the warm sandbox still waits, the only one left");
        assert_eq!(daemon.engine.warm_levels()[0].1, 1);
        assert_eq!(daemon.engine.warm_processes(), processes, "the waiting sandbox's processes changed");
    }
    daemon.stop().await;
}

/// A session takes a warm sandbox too: its harness starts in the waiting
/// sandbox, its turns run there, its pool refills once the harness has
/// started (the session still going), and the sandbox serves that one
/// session: destroyed when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_serves_one_session_and_the_pool_refills_once_its_harness_started() {
    require_bwrap();
    const SESSION_PROFILE: &str = "test.session-agent";
    let options = Options {
        profiles: vec![("session.toml".into(), session_agent_profile(SESSION_PROFILE, ""))],
        config: Box::new(|c| {
            c.sandbox.warm.insert(SESSION_PROFILE.into(), 1);
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    full(&daemon).await;
    let waiting = daemon.leftover_sandboxes().await;
    assert_eq!(waiting.len(), 1, "one sandbox waits before any request");
    let taken = waiting[0].file_name().unwrap().to_str().unwrap().to_string();

    let mut client = pb::session_service_client::SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest {
        profile_ref: SESSION_PROFILE.into(),
        project: "proj-s".into(),
        ..Default::default()
    };
    let session = client.create_session(create).await.expect("the session starts").into_inner();
    assert_eq!(session.state, pb::SessionState::Active as i32, "{session:?}");
    let opened = session.evidence.clone().expect("evidence");
    assert!(
        opened.notes.iter().any(|n| n.contains("warm pool")),
        "the session took no warm sandbox: {:?}",
        opened.notes
    );
    assert_eq!(opened.sandbox_id, taken, "the session's sandbox is not the one that waited");

    // Its pool refills while the session goes on, with another sandbox.
    full(&daemon).await;
    let refilled = daemon.engine.warm_roots();
    assert_eq!(refilled.len(), 1);
    assert_ne!(refilled[0], waiting[0], "the taken sandbox waits in the pool again");

    // A turn runs in the taken sandbox, its harness started by the waiter:
    // bwrap's pid 1 names the waiter, not the harness.
    let turn = pb::SendTurnRequest {
        session_id: session.session_id.clone(),
        tool_call: Some(pb::ToolCall {
            tool: "probe".into(),
            arguments_json: serde_json::json!({"echo": "warm", "probe_pid": true}).to_string(),
        }),
    };
    let mut stream = client.send_turn(turn).await.expect("turn accepted").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        events.push(event);
    }
    let done = match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::TurnFinished(done)) => *done,
        other => panic!("last event is not turn_finished: {other:?}"),
    };
    assert!(done.ok, "{done:?}");
    assert!(done.output.lines().any(|l| l == "echo warm"), "{}", done.output);
    let pid1 = done.output.lines().find_map(|l| l.strip_prefix("pid1: ")).expect("a pid1 line");
    assert!(pid1.ends_with(corral::sandbox::waiter::PROGRAM), "pid 1 is not a warm sandbox's: {pid1}");

    // Ended, the session's sandbox is destroyed; the refilled one waits.
    let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
    let ended = client.end_session(end).await.expect("the session ends").into_inner();
    let closed = ended.evidence.expect("evidence");
    assert_eq!(closed.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{closed:?}");
    let left = daemon.leftover_sandboxes().await;
    assert!(!daemon.data_dir().join("sandboxes").join(&taken).exists(), "the session's sandbox outlived it");
    assert_eq!(left, refilled, "only the refilled sandbox is left");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_the_daemon_could_not_keep_is_refused_at_start() {
    require_bwrap();
    let none = r#"id = "test.none"
version = "1.0.0"
[rein]
argv = ["/bin/true"]
[sandbox]
type = "none"
write_paths = ["."]
[limits]
memory_bytes = 0
max_processes = 0
cpu_millis = 0
"#;
    // A corral binary with no waiter beside it.
    let alone = data_tempdir();
    let lonely = alone.path().join("corral");
    std::fs::copy(env!("CARGO_BIN_EXE_corral"), &lonely).unwrap();
    let built = Some(std::path::PathBuf::from(env!("CARGO_BIN_EXE_corral")));
    let one = |profile: &'static str, size: usize| vec![(profile, size)];
    for (pools, key, binary, capacity) in [
        (one("no.such-profile", 1), "sandbox.warm.\"no.such-profile\"", built.clone(), None),
        (one(PROFILE, 100), "sandbox.warm", built.clone(), None),
        // A front end runs nothing: no run would take its pool.
        (one(PROFILE, 1), "sandbox.warm", built.clone(), Some(0)),
        (one("test.none", 1), "sandbox.warm.\"test.none\"", built.clone(), None),
        // Its runs go to nodes labelled gpu, which this one is not.
        (one("test.placed", 1), "sandbox.warm.\"test.placed\"", built.clone(), None),
        // The test binary is no corral binary: nothing to run as the waiter.
        (one(PROFILE, 1), "gate.hook_program", None, None),
        (one(PROFILE, 1), "corral-sandbox-wait, which is not there", Some(lonely.clone()), None),
        // One profile version twice: runs would take from one pool only.
        (
            vec![(PROFILE, 1), ("test.fake-agent@1.0.0", 1)],
            "sandbox.warm.\"test.fake-agent\" and sandbox.warm.\"test.fake-agent@1.0.0\" are both",
            built.clone(),
            None,
        ),
    ] {
        let data = data_tempdir();
        let profiles = data.path().join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        std::fs::write(profiles.join("fake.toml"), fake_agent_profile(PROFILE, "")).unwrap();
        std::fs::write(profiles.join("none.toml"), none).unwrap();
        let placed = fake_agent_profile("test.placed", "[placement]\nlabels = [\"gpu\"]");
        std::fs::write(profiles.join("placed.toml"), placed).unwrap();
        let mut config = corral::config::Config {
            data_dir: data.path().join("data"),
            profile_dirs: vec![profiles],
            ..Default::default()
        };
        config.sandbox.uids = unique_uids();
        config.credentials.routes.insert(
            "route.test".into(),
            corral::credentials::RouteConfig {
                env: Some("PATH".into()),
                inject_as: "ROUTE_TEST_TOKEN".into(),
                expose: true,
                ..Default::default()
            },
        );
        for (profile, size) in &pools {
            config.sandbox.warm.insert(profile.to_string(), *size);
        }
        config.fleet.capacity = capacity;
        config.gate.hook_program = binary;
        let built = corral::daemon::Daemon::build(
            config,
            corral::sandbox::Backends::host_default(),
            corral::daemon::default_reins(),
        )
        .await;
        let error = match built {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a daemon started with impossible pools {pools:?}"),
        };
        assert!(error.contains(key), "{error}");
    }
}

/// A node that drains (`start_draining`, as a fleet drain's lease loop
/// calls it) destroys its waiting warm sandboxes, no run being left to
/// take them, and makes none more, not even for a run that took one and
/// ends during the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_destroys_its_waiting_warm_sandboxes_and_makes_no_more() {
    require_bwrap();
    // A spawn held 300 ms: the drain begins while the run's harness starts.
    let (backends, log) = faults::bwrap_with(faults::BackendFaults { slow_spawn: true, ..Default::default() });
    let daemon = TestDaemon::start(Options { backends: Some(backends), ..pooled(2) }).await;
    full(&daemon).await;
    let drain = async {
        while daemon.engine.warm_levels()[0].1 == 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(daemon.engine.start_draining());
        // Let go of at once, not once the run ends: its harness is starting.
        while daemon.engine.warm_levels()[0].1 > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(log.lock().unwrap().creates_at_spawn.is_empty(), "the waiting sandbox was kept until the run went on");
    };
    let (events, ()) = tokio::join!(daemon.execute(request(PROFILE, "NOWORK")), drain);
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    assert!(was_warm(&execution));
    for _ in 0..400 {
        if daemon.leftover_sandboxes().await.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(daemon.leftover_sandboxes().await, Vec::<std::path::PathBuf>::new(), "a warm sandbox still waits");
    assert_eq!(daemon.engine.warm_levels()[0].1, 0);
    // Time for a refill the run's end would have begun.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(log.lock().unwrap().creates, 2, "a warm sandbox was made while the node drained");
    daemon.stop().await;
}

/// A pool whose sandboxes cannot be made tries again later and later (the
/// sixth failure waits 6.4 s); a shutdown does not wait that out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_pool_does_not_hold_up_the_shutdown() {
    require_bwrap();
    let (backends, log) = faults::bwrap_with(faults::BackendFaults { fail_init: true, ..Default::default() });
    let options = Options {
        backends: Some(backends),
        config: Box::new(|c| {
            c.sandbox.warm.insert(PROFILE.into(), 1);
            // Longer than the wait: its end would not cut the wait short.
            c.shutdown_grace_seconds = 60;
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    let began = std::time::Instant::now();
    while log.lock().unwrap().created < 6 {
        assert!(began.elapsed() < Duration::from_secs(30), "the pool did not try six times");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stopping = std::time::Instant::now();
    daemon.stop().await;
    let took = stopping.elapsed();
    assert!(took < Duration::from_secs(3), "the shutdown waited {took:?} for a failing pool's next try");
}

/// A pool whose sandboxes are made but die at once (one task at most:
/// bwrap cannot start the waiter, after the sandbox was made) waits longer after each
/// (200 ms doubled), rather than making one after another: in 3 s it
/// makes a handful, not the hundreds a loop would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_sandboxes_die_at_once_backs_off() {
    require_bwrap();
    let dir = data_tempdir();
    let (data, profiles) = (dir.path().join("data"), dir.path().join("profiles"));
    std::fs::create_dir_all(&profiles).unwrap();
    let profile =
        "id = \"test.doomed\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/usr/bin/true\"]\ninput = \"nothing\"\n\
                   [limits]\nmax_processes = 1\n";
    std::fs::write(profiles.join("doomed.toml"), profile).unwrap();
    let port = common::unused_port();
    let config = format!("metrics_listen = \"127.0.0.1:{port}\"\n[sandbox.warm]\n\"test.doomed\" = 1\n");
    let serve = ServeProcess::start_with(&data, &profiles, &[], &config).await;
    let died = |text: &str| sample(text, "corral_warm_sandboxes_died_total", "profile=\"test.doomed\"").unwrap_or(0.0);
    let began = std::time::Instant::now();
    while died(&scrape(port).await) < 1.0 {
        assert!(began.elapsed() < Duration::from_secs(20), "no doomed sandbox was made and seen dying");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let deaths = died(&scrape(port).await);
    // 200 + 400 + 800 + 1600 ms of waiting fit in 3 s: at most 5 more.
    assert!(deaths <= 6.0, "{deaths} sandboxes made and dead in about 3 s: the pool does not back off");
    assert!(serve.stop().await.is_some_and(|s| s.success()));
}

/// Refills stay within admission: a node that runs one execution at once,
/// running one, makes no warm sandbox besides it, and refills once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_refills_only_within_the_executions_the_node_admits() {
    require_bwrap();
    let (backends, log) = faults::bwrap_with(faults::BackendFaults::default());
    let options = Options {
        backends: Some(backends),
        config: Box::new(|c| {
            c.sandbox.warm.insert(PROFILE.into(), 1);
            c.max_running_executions = 1;
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    full(&daemon).await;
    let (run, _) = start_hanging(daemon.channel().await, "").await;
    // Its refill would have begun 100 ms after the harness had its task.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(log.lock().unwrap().creates, 1, "a warm sandbox was made beside the one execution admitted");
    assert_eq!(daemon.engine.warm_levels()[0].1, 0);
    let mut client = daemon.executions().await;
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: run }).await.unwrap();
    // Its end makes room.
    full(&daemon).await;
    assert_eq!(log.lock().unwrap().creates, 2);
    daemon.stop().await;
}

/// Whether `pid` is a process of the waiter program.
fn is_waiter(pid: &i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e.ends_with(corral::sandbox::waiter::PROGRAM))
}

/// The `/proc/<pid>/status` of a live process: `None` for one gone or a
/// zombie (which holds no memory, file or namespace: it is dead, waiting
/// for its reparented parent to read its status).
fn live_status(pid: i32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    (!status.lines().any(|l| l.starts_with("State:") && l.contains("zombie"))).then_some(status)
}

/// The live processes whose real uid is in `range` (`first-last`).
fn live_pids_of(range: &str) -> Vec<i32> {
    let (first, last) = range.split_once('-').unwrap();
    let (first, last): (u32, u32) = (first.parse().unwrap(), last.parse().unwrap());
    let pids = std::fs::read_dir("/proc").expect("/proc").flatten();
    pids.filter_map(|entry| entry.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            let Some(status) = live_status(*pid) else { return false };
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().next());
            uid.and_then(|u| u.parse::<u32>().ok()).is_some_and(|uid| (first..=last).contains(&uid))
        })
        .collect()
}

/// Live processes whose real uid is in `range` (`first-last`): the
/// program each runs, then its command line.
fn processes_of(range: &str) -> Vec<String> {
    let describe = |pid: i32| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        format!("{}: {}", exe.display(), String::from_utf8_lossy(&cmdline).replace('\0', " "))
    };
    live_pids_of(range).into_iter().map(describe).collect()
}

/// SIGKILLs every live process whose real uid is in `range`: with no run
/// going, the waiting warm sandboxes'. How many it signalled.
fn kill_waiting(range: &str) -> usize {
    let pids = live_pids_of(range);
    for pid in &pids {
        // SAFETY: a plain kill(2).
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    pids.len()
}

fn sandboxes(data: &Path) -> Vec<String> {
    std::fs::read_dir(data.join("sandboxes"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Waits for `n` warm sandboxes' waiters in `range`: processes of the
/// small waiter program (not of the corral binary) under their bwrap.
async fn waiters(range: &str, n: usize) {
    for _ in 0..400 {
        let processes = processes_of(range);
        let waiting = processes.iter().filter(|p| p.contains("/corral-sandbox-wait: ")).count();
        if waiting >= n && processes.iter().filter(|p| p.contains("corral-sandbox-wait")).count() >= n * 2 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{n} warm sandboxes did not start: {:?}", processes_of(range));
}

/// A data directory, a profile directory holding the pool's profile, and
/// the config that keeps a pool of 2 of it: for `corral serve` processes.
fn serve_dirs() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf, String) {
    let dir = data_tempdir();
    let (data, profiles) = (dir.path().join("data"), dir.path().join("profiles"));
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), fake_agent_profile(PROFILE, "")).unwrap();
    (dir, data, profiles, format!("[sandbox.warm]\n{PROFILE:?} = 2\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_no_warm_sandbox_alive_and_recovery_sweeps_what_a_crash_left() {
    require_bwrap();
    let (_dir, data, profiles, pool) = serve_dirs();

    // SIGTERM: the pool is destroyed, nothing of it runs, nothing is left.
    let mut serve = ServeProcess::start_with(&data, &profiles, &[], &pool).await;
    let uids = serve.uids.clone();
    waiters(&uids, 2).await;
    assert_eq!(sandboxes(&data).len(), 2);
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(serve.pid(), libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(30), serve.child.wait()).await.expect("exits").unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(processes_of(&uids), Vec::<String>::new(), "a warm sandbox outlived its daemon");
    assert_eq!(sandboxes(&data), Vec::<String>::new());

    // SIGKILL: the next start's recovery destroys what the pool left.
    let mut serve = ServeProcess::start_with(&data, &profiles, &[], &pool).await;
    waiters(&uids, 2).await;
    let crashed = sandboxes(&data);
    // SAFETY: as above.
    unsafe { libc::kill(serve.pid(), libc::SIGKILL) };
    let _ = serve.child.wait().await;
    let mut serve = ServeProcess::start_with(&data, &profiles, &[], &pool).await;
    waiters(&uids, 2).await;
    let now = sandboxes(&data);
    assert_eq!(now.len(), 2, "{now:?}");
    for old in &crashed {
        assert!(!now.contains(old), "recovery left the crashed daemon's warm sandbox {old}");
    }
    // SAFETY: as above.
    unsafe { libc::kill(serve.pid(), libc::SIGTERM) };
    let _ = serve.child.wait().await;
    assert_eq!(processes_of(&uids), Vec::<String>::new());
}

/// `corral_warm_requests_total{profile,found}` says what the runs of a
/// pool's profile found in it, so a pool that serves nothing is seen: a
/// warm sandbox, none waiting (a burst of one pool's size and more), or a
/// pool made for another version of the profile. A run of a profile with
/// no pool is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_say_what_the_runs_of_a_pools_profile_found() {
    require_bwrap();
    let dir = data_tempdir();
    let (data, profiles) = (dir.path().join("data"), dir.path().join("profiles"));
    std::fs::create_dir_all(&profiles).unwrap();
    for version in ["1.0.0", "1.1.0"] {
        let profile = format!(
            "id = \"test.pooled\"\nversion = \"{version}\"\n[rein]\nargv = [\"/usr/bin/true\"]\ninput = \"nothing\"\n"
        );
        std::fs::write(profiles.join(format!("pooled-{version}.toml")), profile).unwrap();
    }
    let port = common::unused_port();
    let config = format!("metrics_listen = \"127.0.0.1:{port}\"\n[sandbox.warm]\n\"test.pooled@1.1.0\" = 1\n");
    let serve = ServeProcess::start_with(&data, &profiles, &[], &config).await;
    let found = |text: &str, found: &str| {
        sample(text, "corral_warm_requests_total", &format!("profile=\"test.pooled@1.1.0\",found=\"{found}\""))
    };
    let text = scrape(port).await;
    for what in ["warm", "empty", "dead", "mismatch"] {
        assert_eq!(found(&text, what), Some(0.0), "listed at 0 before any run: {text}");
    }
    let died = |text: &str| sample(text, "corral_warm_sandboxes_died_total", "profile=\"test.pooled@1.1.0\"");
    assert_eq!(died(&text), Some(0.0), "listed at 0: {text}");
    waiters(&serve.uids, 1).await;
    let level = sample(&scrape(port).await, "corral_warm_sandboxes", "profile=\"test.pooled@1.1.0\"");
    assert_eq!(level, Some(1.0), "the pool's level");

    let run = |profile: &'static str| {
        let channel = serve.channel();
        async move {
            let mut client = pb::execution_service_client::ExecutionServiceClient::new(channel.await);
            let mut stream = client.execute(request(profile, "")).await.unwrap().into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream.message().await.unwrap() {
                events.push(event);
            }
            let execution = finished(&events);
            assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
            was_warm(&execution)
        }
    };
    // Four at once: one takes the waiting sandbox, the others find none
    // (its refill begins once that run has sent its `finished`).
    let burst = futures_util::future::join_all((0..4).map(|_| run("test.pooled@1.1.0"))).await;
    let warm_runs = burst.iter().filter(|warm| **warm).count();
    assert!(warm_runs >= 1, "the waiting sandbox served none of the burst");
    assert!(!run("test.pooled@1.0.0").await, "another version took the pool's sandbox");
    assert!(!run("builtin.noop").await);

    let text = scrape(port).await;
    assert_eq!(found(&text, "warm"), Some(warm_runs as f64), "{text}");
    assert_eq!(found(&text, "empty"), Some((4 - warm_runs) as f64), "{text}");
    assert!(warm_runs < 4, "four runs at once, one sandbox waiting: none found the pool empty");
    assert_eq!(found(&text, "mismatch"), Some(1.0), "the run of 1.0.0: {text}");
    assert!(!text.contains("builtin.noop"), "a profile with no pool has no series: {text}");

    // A waiting sandbox killed: counted as died, and replaced.
    waiters(&serve.uids, 1).await;
    let killed = kill_waiting(&serve.uids);
    assert!(killed > 0, "no process of a waiting sandbox to kill");
    let mut text = String::new();
    for _ in 0..200 {
        text = scrape(port).await;
        if died(&text) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(died(&text), Some(1.0), "the killed sandbox: {text}");
    assert_eq!(found(&text, "dead"), Some(0.0), "no run found it dead: {text}");
    waiters(&serve.uids, 1).await;
}

/// Starts a hanging execution of the pool's profile and returns its id and
/// its sandbox's once its harness runs.
async fn start_hanging(channel: tonic::transport::Channel, repo: &str) -> (String, String) {
    let mut client = pb::execution_service_client::ExecutionServiceClient::new(channel);
    let mut req = request(PROFILE, "NOWORK\nHANG");
    req.repo = repo.into();
    let execution = client.start_execution(req).await.expect("start").into_inner();
    let watch = pb::WatchRequest { execution_id: execution.execution_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(watch).await.unwrap().into_inner();
    let mut sandbox = None;
    while let Some(event) = stream.message().await.unwrap() {
        match event.kind {
            Some(pb::lifecycle_event::Kind::SandboxReady(ready)) => sandbox = Some(ready.sandbox_id),
            Some(pb::lifecycle_event::Kind::Progress(_)) => {
                return (execution.execution_id, sandbox.expect("sandbox_ready before progress"))
            }
            _ => {}
        }
    }
    panic!("the execution ended before its harness reported progress");
}

/// A run that goes on does not keep its pool short: the refill begins a
/// short while after the harness has its task, the run still going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_refills_while_the_run_that_took_from_it_goes_on() {
    require_bwrap();
    let (backends, log) = faults::bwrap_with(faults::BackendFaults::default());
    let daemon = TestDaemon::start(Options { backends: Some(backends), ..pooled(1) }).await;
    full(&daemon).await;
    let (run, sandbox) = start_hanging(daemon.channel().await, "").await;
    full(&daemon).await;
    assert_eq!(log.lock().unwrap().creates, 2, "the pool refilled while the run went on");
    let mut client = daemon.executions().await;
    let get = pb::GetExecutionRequest { execution_id: run.clone(), ..Default::default() };
    let running = client.get_execution(get).await.unwrap().into_inner();
    assert_eq!(running.state, pb::ExecutionState::Running as i32, "the run {run} in {sandbox} ended");
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: run }).await.unwrap();
    daemon.stop().await;
}

/// A sandbox made for a run (no pool here) reads `ready` in the store
/// once the run's `sandbox_ready` is stored: the write that stores it marks
/// it, as it names a warm sandbox the run took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_runs_sandbox_row_is_ready_once_its_sandbox_ready_is_stored() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let (run, sandbox) = start_hanging(daemon.channel().await, "").await;
    let rows = daemon.engine.store.sandboxes().await.unwrap();
    assert_eq!(rows, [(sandbox, run.clone(), "ready".to_string())]);
    let mut client = daemon.executions().await;
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: run }).await.unwrap();
    daemon.stop().await;
}

/// A warm sandbox's row names the run that took it (in the write that
/// stores the run's `sandbox_ready` when there is nothing to clone, in a
/// write of its own before a clone): after a crash, recovery destroys it *for* that run,
/// whose teardown then reads `succeeded`, not `not attempted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_recovery_destroys_a_taken_warm_sandbox_for_the_run_that_took_it() {
    require_bwrap();
    let (_dir, data, profiles, pool) = serve_dirs();
    let repo = git_repo();

    let mut serve = ServeProcess::start_with(&data, &profiles, &[], &pool).await;
    waiters(&serve.uids, 2).await;
    let warm = sandboxes(&data);
    let (bare, in_bare) = start_hanging(serve.channel().await, "").await;
    let (cloned, in_cloned) = start_hanging(serve.channel().await, &repo.path().display().to_string()).await;
    for sandbox in [&in_bare, &in_cloned] {
        assert!(warm.contains(sandbox), "{sandbox} was not one of the warm {warm:?}");
    }
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(serve.pid(), libc::SIGKILL) };
    let _ = serve.child.wait().await;

    let mut serve = ServeProcess::start_with(&data, &profiles, &[], &pool).await;
    let mut client = pb::execution_service_client::ExecutionServiceClient::new(serve.channel().await);
    for id in [&bare, &cloned] {
        let req = pb::GetExecutionRequest { execution_id: id.clone(), ..Default::default() };
        let record = client.get_execution(req).await.unwrap().into_inner();
        assert_eq!(record.state, pb::ExecutionState::Failed as i32);
        let destroy = pb::TeardownResult::try_from(evidence(&record).sandbox_destroy).unwrap();
        assert_eq!(destroy, pb::TeardownResult::Succeeded, "run {id} (repo: {})", id == &cloned);
    }
    // SAFETY: as above.
    unsafe { libc::kill(serve.pid(), libc::SIGTERM) };
    let _ = serve.child.wait().await;
}

/// Allows, after a thousand loop steps: an evaluation long enough that its
/// worker's place always goes to another thread (one that ends at once
/// hands it back).
const SLOW_ALLOW: &str = "actor != 'zzz' && [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(a, \
     [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(b, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(c, a + b + c > 0)))";

/// A warm sandbox outlives the runtime's threads. Its bwrap dies with the
/// thread that spawned it (the parent-death signal is per thread), and
/// evaluating an `expr` policy hands its worker's place to a new thread
/// (`block_in_place`): the old one ends after 10 s idle. Spawned from a
/// worker, the waiting bwrap was SIGKILLed then, and the pool kept (and
/// counted) a dead sandbox until a run found it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_outlives_the_worker_threads_an_expr_policy_retires() {
    require_bwrap();
    let policy = corral::policy::PolicySpec {
        name: "not-zzz".into(),
        kind: "expr".into(),
        arguments: serde_json::json!({"expression": SLOW_ALLOW, "reason": "not zzz"}),
        on: vec![],
    };
    let options = Options {
        config: Box::new(move |c| {
            c.sandbox.warm.insert(PROFILE.into(), 1);
            c.policies.push(policy);
        }),
        ..Options::default()
    };
    let daemon = TestDaemon::start(options).await;
    full(&daemon).await;
    wait_until("the waiter runs", || daemon.engine.warm_processes().iter().flatten().any(is_waiter)).await;
    let waiting = daemon.engine.warm_processes();

    let catalog = daemon.catalog().await;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..80 {
        let mut catalog = catalog.clone();
        let gate = pb::EvaluateGateRequest { profile_ref: PROFILE.into(), ..Default::default() };
        calls.spawn(async move { catalog.evaluate_gate(gate).await.map(|r| r.into_inner().action) });
    }
    let mut allowed = 0;
    while let Some(call) = calls.join_next().await {
        // Past the evaluations allowed at once, a policy denies.
        allowed += usize::from(call.unwrap().unwrap() == pb::GateAction::Allow as i32);
    }
    assert!(allowed > 0, "no evaluation allowed");
    // Past the blocking pool's 10 s keep-alive.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(daemon.engine.warm_processes(), waiting, "the waiting sandbox's processes died");
    let execution = finished(&daemon.execute(request(PROFILE, "NOWORK")).await);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    assert!(was_warm(&execution), "the run went cold: {:?}", evidence(&execution).notes);
    daemon.stop().await;
}

/// A root daemon's pools hold a uid each while they wait, and every run
/// it admits needs one too: a `[sandbox] uids` range smaller than the
/// pools and the executions and sessions it runs at once is refused at
/// start, naming the numbers; one exactly that large starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_range_too_small_for_the_pools_and_the_runs_is_refused_at_start() {
    require_bwrap();
    let first: u32 = unique_uids().split_once('-').unwrap().0.parse().unwrap();
    let config = |uids: u32, pool: usize, executions: usize| {
        move |c: &mut corral::config::Config| {
            c.sandbox.uids = format!("{first}-{}", first + uids - 1);
            c.sandbox.warm.insert(PROFILE.into(), pool);
            c.max_running_executions = executions;
            c.max_running_sessions = 1;
        }
    };
    for (uids, pool, executions) in [(1, 2, 2), (4, 2, 2), (4, 1, 3)] {
        let data = data_tempdir();
        let profiles = data.path().join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        std::fs::write(profiles.join("fake.toml"), fake_agent_profile(PROFILE, "")).unwrap();
        let mut c = corral::config::Config {
            data_dir: data.path().join("data"),
            profile_dirs: vec![profiles],
            ..Default::default()
        };
        c.gate.hook_program = Some(env!("CARGO_BIN_EXE_corral").into());
        c.credentials.routes.insert(
            "route.test".into(),
            corral::credentials::RouteConfig {
                env: Some("PATH".into()),
                inject_as: "ROUTE_TEST_TOKEN".into(),
                expose: true,
                ..Default::default()
            },
        );
        config(uids, pool, executions)(&mut c);
        let built = corral::daemon::Daemon::build(
            c,
            corral::sandbox::Backends::host_default(),
            corral::daemon::default_reins(),
        )
        .await;
        let error = match built {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a daemon started with {uids} uids, a pool of {pool} and {executions} executions"),
        };
        let need = pool + executions + 1;
        for part in [format!("{uids} uid"), format!("{need} sandboxes"), format!("{pool} warm")] {
            assert!(error.contains(&part), "{part:?} not in: {error}");
        }
    }
    // Exactly enough: 2 warm, 2 executions, 1 session.
    let daemon = TestDaemon::start(Options { config: Box::new(config(5, 2, 2)), ..Options::default() }).await;
    full(&daemon).await;
    let execution = finished(&daemon.execute(request(PROFILE, "NOWORK")).await);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}", execution.tool_error);
    daemon.stop().await;
}
