//! A `none` harness that leaves a process in the background (which keeps
//! its stdout open) still ends its run when it exits itself: the run does
//! not wait for the timeout, and teardown kills what it left behind.

mod common;

use std::time::{Duration, Instant};

use common::{finished, processes_with, request, Options, TestDaemon};
use corral::pb;

const MARKER: &str = "987654321";

fn background_profile() -> String {
    format!(
        r#"id = "test.background"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "sleep {MARKER} & echo started; exit 0"]
input = "description"
[sandbox]
type = "none"
allow_network = true
write_paths = ["."]
[limits]
timeout_seconds = 30
max_output_bytes = 65536
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_process_does_not_hold_the_run_until_its_timeout() {
    let daemon = TestDaemon::start(Options {
        profiles: vec![("background.toml".into(), background_profile())],
        ..Options::default()
    })
    .await;
    let started = Instant::now();
    let events = daemon.execute(request("test.background", "")).await;
    let elapsed = started.elapsed();
    let execution = finished(&events);
    assert!(elapsed < Duration::from_secs(15), "the run waited {elapsed:?} (its timeout is 30 s)");
    assert_eq!(
        pb::ExecutionState::try_from(execution.state).unwrap(),
        pb::ExecutionState::Succeeded,
        "{}\n{:?}",
        execution.tool_error,
        common::kinds(&events)
    );
    assert!(execution.tool_output.contains("started"), "what it printed before exiting is kept: {execution:?}");
    let evidence = common::evidence(&execution);
    assert_eq!(pb::TeardownResult::try_from(evidence.sandbox_destroy).unwrap(), pb::TeardownResult::Succeeded);
    assert_eq!(processes_with(MARKER), 0, "teardown killed the background process");
    daemon.stop().await;
}
