//! The gateway contract (DESIGN.md, "Execution semantics"), one scenario per
//! test, over real gRPC with the real bwrap backend and the real command
//! rein, wrapped to inject the failures each rule is about.

mod common;

use std::time::Duration;

use common::faults::{bwrap_with, reins_with, BackendFaults, RecordingRein, ReinFaults};
use common::{evidence, finished, kinds, request, require_bwrap, Options, TestDaemon};
use corral::catalog::ACTOR_REFUSAL;
use corral::pb::{self, lifecycle_event::Kind, ExecutionState, FailureStage, Outcome, TeardownResult};

struct Harness {
    daemon: TestDaemon,
    backend: std::sync::Arc<std::sync::Mutex<common::faults::BackendLog>>,
    calls: std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>,
}

async fn start(
    backend_faults: BackendFaults,
    rein_faults: ReinFaults,
    extra_profiles: Vec<(String, String)>,
) -> Harness {
    require_bwrap();
    let (backends, backend) = bwrap_with(backend_faults);
    let (rein, calls) = RecordingRein::new(rein_faults);
    let mut options = Options { backends: Some(backends), reins: Some(reins_with(rein)), ..Options::default() };
    options.profiles.extend(extra_profiles);
    Harness { daemon: TestDaemon::start(options).await, backend, calls }
}

impl Harness {
    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().clone()
    }
    fn creates(&self) -> usize {
        self.backend.lock().unwrap().creates
    }
    fn destroys(&self) -> usize {
        self.backend.lock().unwrap().destroys.len()
    }
}

fn stage(e: &pb::Evidence) -> FailureStage {
    FailureStage::try_from(e.failure_stage).unwrap()
}
fn outcome(e: &pb::Evidence) -> Outcome {
    Outcome::try_from(e.outcome).unwrap()
}
fn teardown(e: &pb::Evidence) -> (TeardownResult, TeardownResult) {
    (TeardownResult::try_from(e.session_cleanup).unwrap(), TeardownResult::try_from(e.sandbox_destroy).unwrap())
}

/// Watchers never see a raw string: not in any event, not in the record.
async fn assert_hidden_from_watchers(daemon: &TestDaemon, execution_id: &str, secret: &str) {
    let watched = daemon.watch_all(execution_id, 0).await;
    assert!(!watched.is_empty());
    assert!(!format!("{watched:?}").contains(secret), "watcher saw {secret}");
    let record = daemon
        .executions()
        .await
        .get_execution(pb::GetExecutionRequest { execution_id: execution_id.into(), ..Default::default() })
        .await;
    assert!(!format!("{:?}", record.unwrap().into_inner()).contains(secret), "GetExecution shows {secret}");
}

/// A harness that wrote all it had to say and exited, on a host too busy
/// to take its events as fast (each is handed on 20 ms after the last):
/// every line it wrote is recorded, in order, its result line included.
/// (The reads once the harness has exited, `lines::ExitDrain`, are tested
/// in the lib: here the turn, preferring a ready line to the exit, notices
/// the exit only once the lines are through, unless the reader task is
/// starved, as under `corral bench fanout` at W = 10,000.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_line_a_harness_wrote_before_it_exited_is_read_however_slow_the_lifecycle() {
    let pause = Duration::from_millis(20);
    let faults = ReinFaults { slow_events: Some(pause), ..Default::default() };
    let h = start(BackendFaults::default(), faults, vec![]).await;
    // 300 progress lines (about 17 KiB) fit in the pipe: the harness exits
    // at once, and its events take 6 s to be taken.
    let started = std::time::Instant::now();
    let events = h.daemon.execute(request("test.fake-agent@1.0.0", "NOWORK\nPROGRESS 300")).await;
    assert!(started.elapsed() > 300 * pause, "the events were not slowed: {:?}", started.elapsed());
    let execution = finished(&events);
    assert_eq!(execution.state, ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    let progress: Vec<u64> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Progress(p)) if p.kind == pb::ProgressKind::Progress as i32 => Some(p.tokens_so_far),
            _ => None,
        })
        .collect();
    assert_eq!(progress, (1..=300).collect::<Vec<u64>>(), "every progress line, in order");
    // Its result line, the last it wrote, was read: its output and its
    // token count, not the progress lines' (300).
    assert_eq!(execution.tool_output, "done: test task");
    assert_eq!(evidence(&execution).tokens_spent, 42);
    h.daemon.stop().await;
}

/// A command that reads no input may end before its turn comes (the
/// daemon was busy storing events): that exit is its run, read as its
/// result. It used to be taken for a dead harness and started again, a
/// second spawn and a `harness_restarted` in a run of `/usr/bin/true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_shot_harness_that_ended_before_its_turn_is_its_result_not_a_restart() {
    let h = start(BackendFaults { spawn_then_wait: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("builtin.noop", "")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    let expected = ["accepted", "resolved", "gated", "sandbox_ready", "gated", "dispatched", "teardown", "finished"];
    assert_eq!(kinds(&events), expected);
    assert_eq!(h.backend.lock().unwrap().spawns.len(), 1, "the harness was spawned again");
    h.daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn success_runs_the_rein_in_order_and_destroys_the_sandbox_once() {
    let h = start(BackendFaults::default(), ReinFaults::default(), vec![]).await;
    let repo = common::git_repo();
    let mut req = request("test.fake-agent@1.0.0", "PROGRESS 2");
    req.repo = repo.path().display().to_string();
    let events = h.daemon.execute(req).await;

    let k = kinds(&events);
    assert_eq!(&k[..6], ["accepted", "resolved", "gated", "sandbox_ready", "gated", "dispatched"]);
    let phases: Vec<pb::GatePhase> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Gated(g)) => Some(g.phase()),
            _ => None,
        })
        .collect();
    assert_eq!(
        phases,
        [pb::GatePhase::AgentStart, pb::GatePhase::ToolCall],
        "the gate runs before the start and before the dispatch"
    );
    assert_eq!(&k[k.len() - 2..], ["teardown", "finished"]);
    assert!(k.contains(&"progress"));
    let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=events.len() as u64).collect::<Vec<_>>(), "sequence 1..n without gaps");

    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!(ExecutionState::try_from(execution.state).unwrap(), ExecutionState::Succeeded);
    assert_eq!(outcome(&ev), Outcome::Succeeded);
    assert_eq!(stage(&ev), FailureStage::Unspecified);
    assert_eq!(teardown(&ev), (TeardownResult::Succeeded, TeardownResult::Succeeded));
    assert_eq!((ev.tokens_spent, ev.resolved_model.as_str()), (42, "fake-model-1"));
    assert_eq!(ev.profile_ref, "test.fake-agent@1.0.0");
    assert!(execution.tool_output.contains("done: test task"), "{}", execution.tool_output);
    assert_eq!(h.calls(), ["start_session", "dispatch_tool", "end_session", "cleanup_session"]);
    assert_eq!((h.creates(), h.destroys()), (1, 1));
    assert!(h.daemon.leftover_sandboxes().await.is_empty(), "workspace removed");
    let timings: Vec<&str> = ev.stage_timings.iter().map(|t| t.stage.as_str()).collect();
    for stage in ["resolve", "gate", "sandbox_create", "workspace", "session_start", "harness", "teardown", "total"] {
        assert!(timings.contains(&stage), "stage timing {stage} missing: {timings:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execution_failure_keeps_the_raw_error_for_the_direct_caller_only() {
    let h = start(BackendFaults::default(), ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK\nFAIL SECRET-RAW-ERROR-7781")).await;
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!(outcome(&ev), Outcome::Failed);
    assert_eq!(stage(&ev), FailureStage::Execution);
    assert_eq!(ev.error, "execution failed; its principal reads the cause with `corral get --full`");
    assert!(execution.tool_error.contains("SECRET-RAW-ERROR-7781"), "{}", execution.tool_error);
    assert_eq!(teardown(&ev), (TeardownResult::Succeeded, TeardownResult::Succeeded));
    assert_eq!(h.calls(), ["start_session", "dispatch_tool", "end_session", "cleanup_session"]);
    assert_eq!(h.destroys(), 1);
    assert_hidden_from_watchers(&h.daemon, &execution.execution_id, "SECRET-RAW-ERROR-7781").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_exit_code_without_result_is_an_execution_failure() {
    let h = start(BackendFaults::default(), ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK\nEXIT 3")).await;
    let execution = finished(&events);
    assert_eq!(stage(&evidence(&execution)), FailureStage::Execution);
    assert!(execution.tool_error.contains("status 3"), "{}", execution.tool_error);
}

fn profile(id: &str, version: &str, extra: &str) -> String {
    common::fake_agent_profile(id, extra).replace("version = \"1.0.0\"", &format!("version = \"{version}\""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolution_refusals_never_touch_the_backend() {
    let extra = vec![
        (
            "disabled.toml".to_string(),
            profile("test.disabled", "1.0.0", "").replace("[rein]", "status = \"disabled\"\n[rein]"),
        ),
        ("multi1.toml".to_string(), profile("test.multi", "1.0.0", "")),
        ("multi2.toml".to_string(), profile("test.multi", "1.1.0", "")),
        (
            "blocked.toml".to_string(),
            profile("test.blocked", "1.0.0", "[readiness]\nstate = \"blocked\"\nreason = \"OPS-4411 vendor outage\"\n"),
        ),
    ];
    let h = start(BackendFaults::default(), ReinFaults::default(), extra).await;
    let cases = [
        ("test.unknown", "", "unknown harness profile"),
        ("test.disabled", "", "profile disabled"),
        ("test.multi", "", "pin one of test.multi@1.0.0, test.multi@1.1.0"),
        ("test.blocked", "", "\"OPS-4411 vendor outage\""),
        ("test.fake-agent", "queue-worker-3", ACTOR_REFUSAL),
    ];
    for (profile_ref, actor, expected) in cases {
        let mut req = request(profile_ref, "");
        req.actor = actor.into();
        let events = h.daemon.execute(req).await;
        assert_eq!(kinds(&events), ["accepted", "teardown", "finished"], "{profile_ref}");
        let execution = finished(&events);
        let ev = evidence(&execution);
        assert_eq!(ExecutionState::try_from(execution.state).unwrap(), ExecutionState::Refused, "{profile_ref}");
        assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Refused, FailureStage::Resolution), "{profile_ref}");
        assert!(ev.error.contains(expected), "{profile_ref}: {:?} lacks {expected:?}", ev.error);
        assert_eq!(teardown(&ev), (TeardownResult::NotAttempted, TeardownResult::NotAttempted));
        assert!(ev.sandbox_id.is_empty());
    }
    assert_eq!(h.creates(), 0, "no sandbox was created for a refusal");
    assert!(h.calls().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unverified_readiness_runs_and_is_labelled() {
    let extra = vec![(
        "unverified.toml".to_string(),
        profile("test.unverified", "1.0.0", "[readiness]\nstate = \"unverified\"\nreason = \"not yet soaked\"\n"),
    )];
    let h = start(BackendFaults::default(), ReinFaults::default(), extra).await;
    let events = h.daemon.execute(request("test.unverified", "NOWORK")).await;
    let ev = evidence(&finished(&events));
    assert_eq!(outcome(&ev), Outcome::Succeeded);
    let readiness = ev.readiness.clone().unwrap();
    assert_eq!(pb::ReadinessState::try_from(readiness.state).unwrap(), pb::ReadinessState::Unverified);
    assert!(ev.notes.iter().any(|n| n.contains("unverified") && n.contains("not yet soaked")), "{:?}", ev.notes);
    let Some(Kind::Resolved(resolved)) = &events[1].kind else { panic!("resolved expected") };
    assert_eq!(
        pb::ReadinessState::try_from(resolved.readiness.clone().unwrap().state).unwrap(),
        pb::ReadinessState::Unverified
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_is_not_ready_is_destroyed_and_the_rein_never_starts() {
    let h = start(BackendFaults { not_ready: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "")).await;
    let ev = evidence(&finished(&events));
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::SandboxCreate));
    assert_eq!(ev.error, "sandbox creation failed; its principal reads the cause with `corral get --full`");
    assert!(h.calls().is_empty(), "rein started: {:?}", h.calls());
    assert_eq!((h.creates(), h.destroys()), (1, 1));
    assert_eq!(teardown(&ev), (TeardownResult::NotAttempted, TeardownResult::Succeeded));
    assert!(!ev.sandbox_id.is_empty());
    assert!(!kinds(&events).contains(&"sandbox_ready"));
    assert!(h.daemon.leftover_sandboxes().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_cannot_initialise_fails_sandbox_create_with_no_sandbox_id() {
    let h = start(BackendFaults { fail_init: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "")).await;
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::SandboxCreate));
    assert!(ev.sandbox_id.is_empty());
    assert_eq!(h.destroys(), 0);
    assert_eq!(teardown(&ev), (TeardownResult::NotAttempted, TeardownResult::NotAttempted));
    assert!(execution.tool_error.contains("cannot initialise"), "{}", execution.tool_error);
    assert!(h.daemon.leftover_sandboxes().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_start_failure_skips_cleanup_and_destroys() {
    let h = start(BackendFaults::default(), ReinFaults { fail_start: true, ..Default::default() }, vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "")).await;
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::SessionStart));
    assert_eq!(teardown(&ev), (TeardownResult::NotAttempted, TeardownResult::Succeeded));
    assert_eq!(h.calls(), ["start_session"]);
    assert_eq!(h.destroys(), 1);
    assert!(execution.tool_error.contains("SECRET-START"));
    assert_hidden_from_watchers(&h.daemon, &execution.execution_id, "SECRET-START").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_failure_after_success_fails_at_teardown() {
    let h = start(BackendFaults { fail_destroy: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK")).await;
    let ev = evidence(&finished(&events));
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::Teardown));
    assert_eq!(ev.error, "teardown failed; its principal reads the cause with `corral get --full`");
    assert_eq!(teardown(&ev), (TeardownResult::Succeeded, TeardownResult::Failed));
    assert_eq!(h.destroys(), 1, "destroyed exactly once, even when it fails");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_failure_after_finished_keeps_the_run_and_leaves_the_sandbox_to_recovery() {
    let h = start(BackendFaults { fail_reclaim: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK")).await;
    let ev = evidence(&finished(&events));
    // Stopped before `finished`: nothing of the sandbox runs, the run stands.
    assert_eq!(outcome(&ev), Outcome::Succeeded);
    assert_eq!(teardown(&ev), (TeardownResult::Succeeded, TeardownResult::Succeeded));
    h.daemon.engine.reclaimed().await;
    assert_eq!(
        h.backend.lock().unwrap().reclaims,
        std::slice::from_ref(&ev.sandbox_id),
        "reclaimed once, after the run"
    );
    // Its row stays, `failed`, with its uid held: the next start's recovery
    // finds it (a row of another epoch that is not destroyed).
    let rows = h.daemon.engine.store.sandboxes().await.unwrap();
    assert_eq!(rows, [(ev.sandbox_id.clone(), finished(&events).execution_id, "failed".to_string())]);
    let leftover = h.daemon.engine.store.leftover_sandboxes("the-next-epoch").await.unwrap();
    assert_eq!(leftover.len(), 1);
    assert_eq!(leftover[0].sandbox_id, ev.sandbox_id);
    assert!(leftover[0].uid.is_some(), "its uid is not handed out again before recovery");
}

/// A harness that leaves a process of its own session behind and exits
/// (once that process leads its session: out of reach of the harness's
/// process group).
fn leaving_profile(id: &str, sandbox_type: &str, marker: &str) -> (String, String) {
    let text = format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", '''setsid sleep {marker} </dev/null >/dev/null 2>&1 &
child=$!; sid=
while [ "$sid" != "$child" ]; do read -r _ _ _ _ _ sid _ < /proc/$child/stat; done
echo started''']
input = "description"
[sandbox]
type = "{sandbox_type}"
allow_network = {allow}
write_paths = ["."]
[limits]
timeout_seconds = 30
max_output_bytes = 65536
"#,
        allow = sandbox_type == "none"
    );
    (format!("{id}.toml"), text)
}

/// `finished` is sent before the sandbox's files and uid are given back,
/// never before all of it is dead: with reclaim held back a second, a
/// setsid process the harness left is already gone when the caller reads
/// `finished` (for bwrap, and for `none`, which has no pid namespace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_sandbox_runs_once_finished_is_sent_though_its_reclaim_is_later() {
    let marker = format!("{}{}", 7_000_000 + std::process::id() % 1_000_000, 17);
    let (backends, log) = common::faults::all_with(BackendFaults { slow_reclaim: true, ..Default::default() });
    require_bwrap();
    let profiles = vec![
        leaving_profile("test.leave-bwrap", "linux_bwrap", &marker),
        leaving_profile("test.leave-none", "none", &marker),
    ];
    let daemon = TestDaemon::start(Options { backends: Some(backends), profiles, ..Options::default() }).await;
    for profile in ["test.leave-bwrap", "test.leave-none"] {
        let events = daemon.execute(request(profile, "")).await;
        let execution = finished(&events);
        assert_eq!(execution.state, ExecutionState::Succeeded as i32, "{profile}: {execution:?}");
        assert!(execution.tool_output.contains("started"), "{profile}: {}", execution.tool_output);
        let ev = evidence(&execution);
        assert_eq!(teardown(&ev).1, TeardownResult::Succeeded, "{profile}");
        assert!(
            log.lock().unwrap().reclaims.is_empty(),
            "{profile}: reclaimed before `finished`: the check proves nothing"
        );
        let alive = common::processes_with(&marker);
        assert_eq!(alive, 0, "{profile}: a process of the sandbox runs after `finished`");
        daemon.engine.reclaimed().await;
        assert_eq!(log.lock().unwrap().reclaims.drain(..).collect::<Vec<_>>(), [ev.sandbox_id], "{profile}");
    }
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

/// A bug that panics a run's task (injected: `dispatch_tool` panics
/// while the harness runs in its sandbox) ends the run as a crash of the
/// daemon would, for that run alone: `failed` with its note, its caller
/// told, its sandbox destroyed, its admission slot given back. Without
/// the guard it stayed `running` with its sandbox alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_runs_task_fails_the_run_and_gives_back_what_it_held() {
    let h = start(BackendFaults::default(), ReinFaults { panic_dispatch: true, ..Default::default() }, vec![]).await;
    let events = tokio::time::timeout(Duration::from_secs(60), h.daemon.execute(request("test.fake-agent", "NOWORK")))
        .await
        .expect("the caller hears the end");
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!(outcome(&ev), Outcome::Failed, "{ev:?}");
    assert!(ev.notes.iter().any(|n| n.starts_with("the daemon's task for it failed during ")), "{ev:?}");
    assert_eq!(h.daemon.engine.running(), 0, "its slot is given back");
    assert!(h.daemon.leftover_sandboxes().await.is_empty(), "its sandbox is destroyed");
    let stored = h.daemon.engine.get(&execution.execution_id).await.unwrap();
    assert_eq!(stored.state, corral::lifecycle::ExecutionState::Failed);
    h.daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_failure_after_success_fails_at_teardown_and_still_destroys() {
    let h = start(BackendFaults::default(), ReinFaults { fail_cleanup: true, ..Default::default() }, vec![]).await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK")).await;
    let ev = evidence(&finished(&events));
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::Teardown));
    assert_eq!(teardown(&ev), (TeardownResult::Failed, TeardownResult::Succeeded));
    assert_eq!(h.destroys(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_failures_after_an_execution_failure_keep_the_execution_stage() {
    let h = start(
        BackendFaults { fail_destroy: true, ..Default::default() },
        ReinFaults { fail_dispatch: true, fail_cleanup: true, ..Default::default() },
        vec![],
    )
    .await;
    let events = h.daemon.execute(request("test.fake-agent", "NOWORK")).await;
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::Execution));
    assert_eq!(ev.error, "execution failed; its principal reads the cause with `corral get --full`");
    assert_eq!(teardown(&ev), (TeardownResult::Failed, TeardownResult::Failed));
    assert_eq!(h.calls(), ["start_session", "dispatch_tool", "end_session", "cleanup_session"]);
    assert_eq!(h.destroys(), 1);
    assert!(execution.tool_error.contains("SECRET-DISPATCH"));
    assert_hidden_from_watchers(&h.daemon, &execution.execution_id, "SECRET-DISPATCH").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sandbox_command_carries_identity_routes_and_timeout_and_never_the_task() {
    let h = start(BackendFaults::default(), ReinFaults::default(), vec![]).await;
    let task_text = "UNIQUE-TASK-TEXT-93c1";
    let events = h.daemon.execute(request("test.fake-agent", &format!("NOWORK\nPROBE_ENV\n{task_text}"))).await;
    let execution = finished(&events);
    assert_eq!(outcome(&evidence(&execution)), Outcome::Succeeded);
    let spawns = h.backend.lock().unwrap().spawns.clone();
    assert!(!spawns.is_empty());
    for spec in &spawns {
        // The caller is the unix socket's local admin: its type and name.
        assert_eq!(spec.consumer.actor, "adm");
        assert_eq!(spec.consumer.principal, "local-admin");
        assert_eq!(spec.consumer.project, "proj-a");
        assert_eq!(spec.consumer.run_id, execution.execution_id);
        assert_eq!(spec.consumer.session_id, "");
        assert_eq!(spec.credential_route_refs, ["route.test"]);
        assert_eq!(spec.timeout, Duration::from_secs(30));
        assert!(!spec.argv.iter().any(|a| a.contains(task_text)), "task text in argv: {:?}", spec.argv);
    }
    // Inside the sandbox, the harness sees the same identity.
    let out = &execution.tool_output;
    for expected in [
        "env CORRAL_ACTOR=adm".to_string(),
        "env CORRAL_PROJECT=proj-a".to_string(),
        format!("env CORRAL_RUN_ID={}", execution.execution_id),
        "env CORRAL_CREDENTIAL_ROUTES=route.test".to_string(),
        "env CORRAL_TIMEOUT_SECONDS=30".to_string(),
    ] {
        assert!(out.contains(&expected), "missing {expected:?} in {out}");
    }
    // /proc shows command lines to everyone: the task is not in any of them.
    assert!(!out.contains(task_text) || !out.lines().any(|l| l.starts_with("pid1:") && l.contains(task_text)));
}

/// On one node, a profile whose `[placement]` names a label the node does
/// not have is refused at resolution, with the reason: never run anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_placed_on_labels_this_node_lacks_is_refused() {
    let profile = "id = \"test.placed\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n[sandbox]\ntype = \"none\"\nwrite_paths = [\".\"]\n[limits]\ntimeout_seconds = 5\n[placement]\nlabels = [\"gpu\"]\n";
    let daemon =
        TestDaemon::start(Options { profiles: vec![("placed.toml".into(), profile.into())], ..Options::default() })
            .await;
    if daemon.engine.store.is_shared() {
        // A fleet (of one here) refuses it before storing anything.
        let mut client = daemon.executions().await;
        let refused = client.execute(request("test.placed", "")).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert!(refused.message().contains("needs gpu"), "{}", refused.message());
        use tonic_types::StatusExt;
        assert_eq!(refused.get_details_error_info().unwrap().reason, "NO_NODE_CAN_RUN");
        assert_eq!(daemon.engine.store.count_executions().await.unwrap(), 0);
        return;
    }
    let execution = finished(&daemon.execute(request("test.placed", "")).await);
    assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Refused);
    let ev = execution.evidence.unwrap();
    assert!(ev.error.contains("runs only on nodes labelled gpu"), "{}", ev.error);
}

/// A run's first events travel with its sandbox's intent row. When no uid
/// of the daemon's range is free (the only one has a live process), the
/// row is stored and marked destroyed, the run fails at sandbox_create,
/// and its events are in the store once each, 1..n with no gap: the ones
/// the row carried are not written again with the final record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_no_free_uid_stores_its_first_events_once_with_the_sandbox_row() {
    use std::os::unix::process::CommandExt;
    require_bwrap();
    let first: u32 = common::unique_uids().split('-').next().unwrap().parse().unwrap();
    let mut squatter = std::process::Command::new("sleep").arg("60").uid(first).gid(first).spawn().unwrap();
    let uids = format!("{first}-{first}");
    let options = Options { config: Box::new(move |c| c.sandbox.uids = uids), ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    let events = daemon.execute(request("test.fake-agent", "")).await;
    squatter.kill().unwrap();
    squatter.wait().unwrap();
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!((outcome(&ev), stage(&ev)), (Outcome::Failed, FailureStage::SandboxCreate));
    assert!(execution.tool_error.contains("no free sandbox uid"), "{}", execution.tool_error);
    assert_eq!(&kinds(&events)[..3], ["accepted", "resolved", "gated"]);
    let stored = daemon.watch_all(&execution.execution_id, 0).await;
    assert_eq!(kinds(&stored), kinds(&events), "the store holds what the caller saw");
    let sequences: Vec<u64> = stored.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=events.len() as u64).collect::<Vec<_>>(), "sequence 1..n without gaps");
    let record = daemon.engine.get(&execution.execution_id).await.unwrap();
    assert_eq!(record.state, corral::records::ExecutionState::Failed, "the final record is stored");
    assert!(daemon.leftover_sandboxes().await.is_empty(), "the row is marked destroyed");
}

/// The first events are the caller's as soon as they are stored with the
/// sandbox's intent row: `accepted`, `resolved` and `gated` reach the
/// stream before the backend has made the sandbox (here it holds its
/// thread for 300 ms, as a real one's synchronous work does), not once it
/// is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_events_reach_the_caller_before_the_sandbox_is_made() {
    let h = start(BackendFaults { busy_create: true, ..Default::default() }, ReinFaults::default(), vec![]).await;
    let mut client = h.daemon.executions().await;
    let mut stream = client.execute(request("test.fake-agent", "")).await.unwrap().into_inner();
    let mut first = Vec::new();
    for _ in 0..3 {
        first.push(stream.message().await.unwrap().expect("an event"));
    }
    let created = h.backend.lock().unwrap().created;
    assert_eq!(kinds(&first), ["accepted", "resolved", "gated"]);
    assert_eq!(created, 0, "the sandbox was made before its first events were sent");
    while stream.message().await.unwrap().is_some() {}
    assert_eq!((h.creates(), h.destroys()), (1, 1));
}

/// A retry of request `id`: the fake agent's long run (it hangs after its
/// first progress line), as the local admin.
fn hanging(id: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest { request_id: id.into(), ..request("test.fake-agent", "NOWORK\nHANG") }
}

/// Cancels `id` and waits for its `finished`.
async fn cancel_and_wait(daemon: &TestDaemon, id: &str) {
    let mut client = daemon.executions().await;
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: id.into() }).await.expect("cancelled");
    assert!(matches!(daemon.watch_all(id, 0).await.last().and_then(|e| e.kind.as_ref()), Some(Kind::Finished(_))));
}

/// Idempotency outlives event retention: once a finished run's events are
/// compacted to its `finished`, a retry of its request id still returns
/// it (StartExecution the record, Execute the `finished` kept), where it
/// used to be OUT_OF_RANGE (`SEQUENCE_COMPACTED`). Before compaction a
/// retried Execute's `finished` carries the raw output, as the first
/// caller's did: the one retrying is the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_returns_the_execution_with_its_raw_output_and_after_compaction() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let req = pb::ExecuteRequest { request_id: "retry-compacted".into(), ..request("test.fake-agent", "NOWORK") };
    let first = finished(&daemon.execute(req.clone()).await);
    assert_eq!(first.tool_output, "done: test task");

    let again = finished(&daemon.execute(req.clone()).await);
    assert_eq!(again.execution_id, first.execution_id);
    assert_eq!(again.tool_output, first.tool_output, "a retried Execute's finished has the raw output");

    // What event retention leaves of it (what the compactor does once
    // `event_retention_seconds` have passed).
    let removed = daemon.engine.store.compact_events(corral::lifecycle::now_ms() + 1).await.unwrap();
    assert!(removed > 0, "nothing compacted");
    let mut client = daemon.executions().await;
    let started = client.start_execution(req.clone()).await.expect("StartExecution retried").into_inner();
    assert_eq!(started.execution_id, first.execution_id);
    let replayed = daemon.execute(req).await;
    assert_eq!(kinds(&replayed), ["finished"]);
    assert_eq!(finished(&replayed).execution_id, first.execution_id);
    assert_eq!(daemon.engine.store.count_executions().await.unwrap(), 1);
}

/// A StartExecution retry watches nothing: with the one watcher slot of its
/// execution taken, it still returns the execution. An Execute retry,
/// whose stream follows a run it did not start, counts as a watcher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_execution_retry_takes_no_watcher_slot() {
    require_bwrap();
    let options = Options { config: Box::new(|c| c.grpc.max_watchers_per_subject = 1), ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    let mut client = daemon.executions().await;
    let first = client.start_execution(hanging("retry-watched")).await.expect("started").into_inner();
    let watch = pb::WatchRequest { execution_id: first.execution_id.clone(), after_sequence: 0 };
    let mut watcher = client.watch_execution(watch).await.expect("the one watcher").into_inner();
    watcher.message().await.unwrap().expect("an event");

    let again = client.start_execution(hanging("retry-watched")).await.expect("StartExecution retried").into_inner();
    assert_eq!(again.execution_id, first.execution_id);
    let Err(status) = client.execute(hanging("retry-watched")).await else { panic!("an Execute retry is a watcher") };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    drop(watcher);
    cancel_and_wait(&daemon, &first.execution_id).await;
}

/// A retry starts nothing, so a full quota does not refuse it: with its
/// principal's `max_running = 1` taken by the run that holds the request
/// id, the same request gets that run back, and a different one with the
/// same id ALREADY_EXISTS (REQUEST_ID_REUSED), not RESOURCE_EXHAUSTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_its_execution_back_while_the_quota_is_full() {
    use tonic_types::StatusExt;
    require_bwrap();
    let options = Options { config: Box::new(|c| c.principals[0].max_running = Some(1)), ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    let mut client = daemon.executions().await;
    let first = client.start_execution(common::as_actor("agt", hanging("retry-1"))).await.expect("started");
    let first = first.into_inner();
    assert_eq!(first.state, ExecutionState::Running as i32);

    let again = client.start_execution(common::as_actor("agt", hanging("retry-1"))).await.expect("retried");
    assert_eq!(again.into_inner().execution_id, first.execution_id);
    let mut stream = client.execute(common::as_actor("agt", hanging("retry-1"))).await.expect("Execute retried");
    let replayed = stream.get_mut().message().await.unwrap().expect("an event");
    assert_eq!(replayed.subject_id, first.execution_id);
    drop(stream);

    let other = pb::ExecuteRequest { description: "NOWORK".into(), ..hanging("retry-1") };
    let status = client.start_execution(common::as_actor("agt", other)).await.expect_err("a reused request id");
    assert_eq!(status.code(), tonic::Code::AlreadyExists, "{status:?}");
    assert_eq!(status.get_details_error_info().unwrap().reason, "REQUEST_ID_REUSED");
    // The quota still holds for new work: refused on one node, queued on
    // a fleet.
    let next = client.start_execution(common::as_actor("agt", hanging("retry-2"))).await;
    match daemon.engine.store.is_shared() {
        false => assert_eq!(next.expect_err("over quota").code(), tonic::Code::ResourceExhausted),
        true => {
            let queued = next.expect("queued").into_inner();
            assert_eq!(queued.state, ExecutionState::Pending as i32, "{queued:?}");
            cancel_and_wait(&daemon, &queued.execution_id).await;
        }
    }
    cancel_and_wait(&daemon, &first.execution_id).await;
}

/// A running execution started with a bare profile reference is listed
/// under the pinned reference it resolved to, not only once it has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_execution_is_listed_under_its_pinned_profile() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let run = client.start_execution(hanging("")).await.expect("started").into_inner();
    let list = |profile_ref: &str| pb::ListExecutionsRequest {
        state: ExecutionState::Running as i32,
        profile_ref: profile_ref.into(),
        ..Default::default()
    };
    for profile_ref in ["test.fake-agent@1.0.0", "test.fake-agent"] {
        let listed = client.list_executions(list(profile_ref)).await.unwrap().into_inner().executions;
        let ids: Vec<&str> = listed.iter().map(|e| e.execution_id.as_str()).collect();
        assert_eq!(ids, [run.execution_id.as_str()], "listed by {profile_ref}");
    }
    cancel_and_wait(&daemon, &run.execution_id).await;
}

/// The profile filter is an exact comparison: `_` is no wildcard and case
/// counts (SQL `LIKE` took `test_fake-agent` for `test.fake-agent`, and on
/// SQLite `Case.Probe` for `case.probe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profile_filter_matches_exactly() {
    require_bwrap();
    let extra = vec![("case.toml".to_string(), common::fake_agent_profile("Case.Probe", ""))];
    let options = Options { profiles: [Options::default().profiles, extra].concat(), ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    for profile in ["test.fake-agent", "Case.Probe"] {
        finished(&daemon.execute(request(profile, "NOWORK")).await);
    }
    let mut client = daemon.executions().await;
    for (profile_ref, expected) in [
        ("test.fake-agent", 1),
        ("Case.Probe", 1),
        ("Case.Probe@1.0.0", 1),
        ("test_fake-agent", 0),
        ("test.fake_agent", 0),
        ("case.probe", 0),
        ("CASE.PROBE", 0),
    ] {
        let req = pb::ListExecutionsRequest { profile_ref: profile_ref.into(), ..Default::default() };
        let listed = client.list_executions(req).await.unwrap().into_inner().executions;
        assert_eq!(listed.len(), expected, "filter {profile_ref}");
    }
}

/// A retried Execute asking for `cancel_on_disconnect` that is refused a
/// watcher place (its principal holds all of them) is an answer, not a
/// caller gone away: the execution another call started runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_refused_a_watch_place_does_not_cancel_the_run() {
    require_bwrap();
    let daemon = TestDaemon::start(Options {
        config: Box::new(|c| c.grpc.max_watchers_per_principal = Some(1)),
        ..Options::default()
    })
    .await;
    let mut client = daemon.executions().await;
    let started =
        client.start_execution(common::as_actor("agt", hanging("refused-retry"))).await.expect("started").into_inner();
    let mut held =
        client.execute(common::as_actor("agt", hanging("refused-retry"))).await.expect("a place").into_inner();
    held.message().await.unwrap().expect("an event");
    let asked = pb::ExecuteRequest { cancel_on_disconnect: true, ..hanging("refused-retry") };
    let status = client.execute(common::as_actor("agt", asked)).await.expect_err("no place left");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let get = pb::GetExecutionRequest { execution_id: started.execution_id.clone(), ..Default::default() };
    let record = client.get_execution(get).await.unwrap().into_inner();
    assert_eq!(record.state, ExecutionState::Running as i32, "the refused retry cancelled the run: {record:?}");
    drop(held);
    cancel_and_wait(&daemon, &started.execution_id).await;
}

/// `cancel_on_disconnect` is Execute's: StartExecution refuses it, naming
/// it, and starts nothing. An Execute retry that asks for it has it: its
/// caller going away cancels the run another call started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_disconnect_is_refused_on_start_and_armed_on_an_execute_retry() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let asked = pb::ExecuteRequest { cancel_on_disconnect: true, ..hanging("retry-disconnect") };
    let status = client.start_execution(asked.clone()).await.expect_err("not for StartExecution");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("cancel_on_disconnect:"), "{}", status.message());
    assert_eq!(daemon.engine.store.count_executions().await.unwrap(), 0, "nothing was started");

    let first = client.start_execution(hanging("retry-disconnect")).await.expect("started").into_inner();
    let mut stream = client.execute(asked).await.expect("Execute retried").into_inner();
    let event = stream.message().await.unwrap().expect("an event");
    assert_eq!(event.subject_id, first.execution_id);
    drop(stream);
    let events = daemon.watch_all(&first.execution_id, 0).await;
    assert_eq!(finished(&events).state, ExecutionState::Cancelled as i32, "the retry's disconnect cancelled it");
}
