//! Safe defaults: a profile that sets no limits (the built-ins, or a file
//! without `[limits]`) still runs under memory, pids, CPU, workspace and
//! inode limits and a sized `/dev/shm`, and the workspace budget counts
//! HOME. Each test attacks one of them from inside a real bwrap sandbox.

mod common;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;

fn receipt(events: &[pb::LifecycleEvent]) -> pb::EnforcementReceipt {
    events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(ready)) => ready.receipt.clone(),
            _ => None,
        })
        .expect("a sandbox_ready event with a receipt")
}

fn limit_events(events: &[pb::LifecycleEvent]) -> Vec<pb::LimitHit> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Limit(l)) => Some(l.clone()),
            _ => None,
        })
        .collect()
}

fn receipt_limit(receipt: &pb::EnforcementReceipt, name: &str) -> pb::LimitReceipt {
    receipt.limits.iter().find(|l| l.name == name).cloned().unwrap_or_else(|| panic!("no {name} in {receipt:?}"))
}

/// A shell profile with no `[limits]` of its own but `limits`.
fn shell(id: &str, limits: &str) -> (String, String) {
    let text = format!(
        "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
         [sandbox]\ntype = \"linux_bwrap\"\nwrite_paths = [\".\"]\n[limits]\ntimeout_seconds = 60\n{limits}\n"
    );
    (format!("{id}.toml"), text)
}

async fn daemon(profiles: Vec<(String, String)>) -> TestDaemon {
    require_bwrap();
    TestDaemon::start(Options { profiles, ..Options::default() }).await
}

/// Forks `n` children that sleep, and prints how many started.
fn fork_script(n: u32) -> String {
    format!(
        r#"python3 - <<'EOF'
import os, time
started = 0
for _ in range({n}):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    started += 1
print("started", started)
EOF"#
    )
}

fn started(execution: &pb::Execution) -> u32 {
    execution
        .tool_output
        .lines()
        .find_map(|l| l.strip_prefix("started "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count: {} / {}", execution.tool_output, execution.tool_error))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_shell_cannot_start_more_than_its_default_pids() {
    let daemon = daemon(vec![]).await;
    let events = daemon.execute(request("builtin.shell", &fork_script(700))).await;
    let execution = finished(&events);
    let n = started(&execution);
    assert!(n < 512, "{n} of 700 children started under the default max_processes = 512");
    assert!(n > 400, "the default leaves room for real work: only {n} started");
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Pids), "no limit event for pids");
    let receipt = receipt(&events);
    let pids = receipt_limit(&receipt, "max_processes");
    assert_eq!(pids.value, 512);
    assert!(pids.mechanism.contains("cgroup"), "{pids:?}");
    for (name, value) in [("memory_bytes", 2u64 << 30), ("cpu_millis", 2000), ("max_workspace_bytes", 2 << 30)] {
        assert_eq!(receipt_limit(&receipt, name).value, value, "{name}");
    }
    assert_eq!(receipt_limit(&receipt, "max_workspace_inodes").value, 200_000);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_default_limits_apply_to_builtins() {
    require_bwrap();
    let daemon =
        TestDaemon::start(Options { config: Box::new(|c| c.default_limits.max_processes = 40), ..Options::default() })
            .await;
    let events = daemon.execute(request("builtin.shell", &fork_script(100))).await;
    let n = started(&finished(&events));
    assert!(n < 40, "{n} of 100 children started under [default_limits] max_processes = 40");
    assert_eq!(receipt_limit(&receipt(&events), "max_processes").value, 40);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_shm_cannot_be_filled_past_its_size() {
    let daemon = daemon(vec![]).await;
    let script = r#"python3 - <<'EOF'
import os
st = os.statvfs("/dev/shm")
print("size", st.f_blocks * st.f_frsize)
written = 0
try:
    with open("/dev/shm/fill", "wb") as f:
        for _ in range(200):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as e:
    print("stopped", e.strerror)
print("written", written)
EOF"#;
    let events = daemon.execute(request("builtin.shell", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    let value = |key: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key}: {out} / {}", execution.tool_error))
    };
    assert_eq!(value("size "), 64 << 20, "/dev/shm is the default 64 MiB tmpfs: {out}");
    assert!(value("written ") <= 64 << 20, "{out}");
    assert!(out.contains("stopped No space left on device"), "{out}");
    assert_eq!(receipt_limit(&receipt(&events), "shm_bytes").value, 64 << 20);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10_mib_workspace_cap_counts_home() {
    let daemon = daemon(vec![shell("test.home", "max_workspace_bytes = 10485760")]).await;
    let script = "head -c 20000000 /dev/zero > \"$HOME/blob\"; sleep 5; echo DONE";
    let events = daemon.execute(request("test.home", script)).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert_eq!(execution.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Execution as i32);
    let hits = limit_events(&events);
    assert!(hits.iter().any(|l| l.limit() == pb::LimitKind::Workspace && l.value == 10 << 20), "{hits:?}");
    assert!(!execution.tool_output.contains("DONE"), "the run went on past its workspace limit");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workspace_budget_counts_inodes() {
    let daemon = daemon(vec![shell("test.inodes", "max_workspace_inodes = 2000")]).await;
    let script =
        "mkdir many && cd many && i=0; while [ $i -lt 5000 ]; do : > f$i; i=$((i+1)); done; sleep 5; echo DONE";
    let events = daemon.execute(request("test.inodes", script)).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    let hits = limit_events(&events);
    assert!(hits.iter().any(|l| l.limit() == pb::LimitKind::WorkspaceInodes && l.value == 2000), "{hits:?}");
    assert!(!execution.tool_output.contains("DONE"), "the run went on past its inode limit");
    assert!(execution.tool_error.contains("max_workspace_inodes = 2000"), "{}", execution.tool_error);
    daemon.stop().await;
}

/// A small `max_open_files` is the sandbox's descriptor limit, not a spawn
/// failure: the daemon's descriptors are moved into place before the limit
/// is set (before, any value under the daemon's parking slot, 64, made
/// every spawn fail with EINVAL). Inside, opening past it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_open_files_limit_holds_inside_and_the_sandbox_starts() {
    let daemon = daemon(vec![shell("test.few-files", "max_open_files = 32")]).await;
    let script = r#"echo "nofile $(ulimit -n)"
python3 - <<'EOF'
fds = []
try:
    for _ in range(100):
        fds.append(open("/dev/null"))
except OSError as e:
    print("opened", len(fds), "then", e.strerror)
EOF"#;
    let events = daemon.execute(request("test.few-files", script)).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    assert!(execution.tool_output.contains("nofile 32"), "{}", execution.tool_output);
    let opened: u32 = execution
        .tool_output
        .lines()
        .find_map(|l| l.strip_prefix("opened ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("never hit the limit: {}", execution.tool_output));
    assert!(opened < 32, "{opened} files opened under a limit of 32");
    assert_eq!(receipt_limit(&receipt(&events), "max_open_files").value, 32);
    daemon.stop().await;
}
