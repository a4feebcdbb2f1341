//! The sandbox is a boundary: each test here is an attack run from inside a
//! real bubblewrap sandbox (a shell or Python task of a real daemon), and
//! each fails on a build without the protection it names.

mod common;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;

/// A shell-task profile with extra `[limits]` lines (and optionally another
/// sandbox type).
fn shell_profile(id: &str, sandbox: &str, limits: &str) -> String {
    format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
{sandbox}
write_paths = ["."]
[limits]
timeout_seconds = 60
{limits}
"#
    )
}

fn bwrap_shell(id: &str, limits: &str) -> (String, String) {
    (format!("{id}.toml"), shell_profile(id, "type = \"linux_bwrap\"", limits))
}

async fn daemon_with(profiles: Vec<(String, String)>) -> TestDaemon {
    require_bwrap();
    TestDaemon::start(Options { profiles, ..Options::default() }).await
}

/// Runs `script` in a fresh `builtin.shell` (or `profile`) sandbox and
/// returns the finished execution and all events.
async fn run(daemon: &TestDaemon, profile: &str, script: &str) -> (pb::Execution, Vec<pb::LifecycleEvent>) {
    let events = daemon.execute(request(profile, script)).await;
    (finished(&events), events)
}

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

/// Host pids whose command line contains `marker`, with their real uid.
fn host_processes(marker: &str) -> Vec<(i32, u32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        if !String::from_utf8_lossy(&cmdline).contains(marker) {
            continue;
        }
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        if status.lines().any(|l| l.starts_with("State:") && l.contains('Z')) {
            continue;
        }
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse().ok())
            .unwrap_or(u32::MAX);
        out.push((pid, uid));
    }
    out
}

/// Host processes running as `uid` that can still run its code: neither a
/// zombie nor a task in the kernel's exit path (`PF_EXITING` in the flags
/// of `/proc/PID/stat`: set at the start of `do_exit`, which never returns
/// to user space). A killed task is in that path until it becomes a
/// zombie, after it left its cgroup: on a busy host, or under the
/// sandbox's CPU quota, for a while.
fn processes_of_uid(uid: u32) -> Vec<i32> {
    const PF_EXITING: u64 = 0x4;
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        let flags = stat_field(pid, 6).and_then(|f| f.parse::<u64>().ok());
        let exiting = flags.is_some_and(|f| f & PF_EXITING != 0);
        let zombie = status.lines().any(|l| l.starts_with("State:") && l.contains('Z'));
        let real = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().next());
        if !zombie && !exiting && real == Some(uid.to_string().as_str()) {
            out.push(pid);
        }
    }
    out
}

/// `pid (name) state, in <cgroup>` of a host process, for a failure's message.
fn describe(pid: i32) -> String {
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let state = stat_field(pid, 0).unwrap_or_default();
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let unified = cgroup.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("?");
    format!("{pid} ({}) {state}, in {unified}", name.trim_end())
}

/// Field `n` of `/proc/PID/stat` after `(comm)`, which may hold spaces and
/// parentheses: 0 the state, 3 the session, 6 the flags.
fn stat_field(pid: i32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().nth(n)?.to_string())
}

async fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(found) = probe() {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

// ---------------------------------------------------------------------------
// Identity

/// Starts `script` and reads its stream up to `dispatched`: the execution
/// id, the host workspace, the receipt, and the live stream.
async fn start(
    daemon: &TestDaemon,
    profile: &str,
    script: &str,
) -> (String, String, pb::EnforcementReceipt, tonic::Streaming<pb::LifecycleEvent>) {
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request(profile, script)).await.unwrap().into_inner();
    let (mut id, mut ws, mut receipt) = (String::new(), String::new(), None);
    loop {
        let event = stream.message().await.unwrap().expect("a dispatched event");
        match event.kind {
            Some(Kind::Accepted(a)) => id = a.execution_id,
            Some(Kind::SandboxReady(r)) => (ws, receipt) = (r.workspace_path, r.receipt),
            Some(Kind::Dispatched(_)) => break,
            _ => {}
        }
    }
    (id, ws, receipt.expect("a receipt"), stream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sandbox_runs_as_its_own_unprivileged_host_uid() {
    let daemon = daemon_with(vec![]).await;
    let marker = format!("UID-MARKER-{}", std::process::id());
    let script = format!(
        "touch owned && cp /usr/bin/id suid-id && chmod 4755 suid-id && exec python3 -c 'import time; time.sleep(30)' {marker}"
    );
    let (id_a, ws, receipt_a, _a) = start(&daemon, "builtin.shell", &script).await;
    let (id_b, _, receipt_b, _b) = start(&daemon, "builtin.shell", &script).await;
    let both = wait_for("two sandboxed harnesses", || {
        let found = host_processes(&marker);
        (found.len() >= 2).then_some(found)
    })
    .await;
    // Read from the host's /proc, not from the daemon.
    let mut uids: Vec<u32> = both.iter().map(|(_, uid)| *uid).collect();
    uids.sort();
    assert!(uids.iter().all(|uid| *uid != 0), "a harness runs as host root: {uids:?}");
    assert_ne!(uids[0], uids[1], "two concurrent sandboxes share a host uid");
    let mut named = vec![receipt_a.host_uid, receipt_b.host_uid];
    named.sort();
    assert_eq!(uids, named, "the receipts name the uids the harnesses run as");

    // What the harness made belongs to its uid on the host, and a setuid
    // bit it sets can only ever grant that uid.
    let owned = std::fs::metadata(format!("{ws}/owned")).expect("the harness's file on the host");
    assert_eq!(owned.uid(), receipt_a.host_uid);
    let suid = std::fs::metadata(format!("{ws}/suid-id")).unwrap();
    assert_eq!(suid.mode() & 0o4000, 0o4000, "the setuid bit was set");
    assert_eq!(suid.uid(), receipt_a.host_uid, "a setuid binary made inside belongs to host root");
    let out = std::process::Command::new(format!("{ws}/suid-id")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("euid={}", receipt_a.host_uid)), "{text}");

    let mut client = daemon.executions().await;
    for id in [id_a, id_b] {
        client.cancel_execution(pb::CancelExecutionRequest { execution_id: id }).await.unwrap();
    }
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// View and kernel surface

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_file_under_proc_sys_is_writable() {
    let daemon = daemon_with(vec![]).await;
    // Each sysctl gets its own current value back: harmless even on a
    // build where the write goes through (and that build fails here).
    let script = r#"n=0
for f in $(find /proc/sys -type f 2>/dev/null); do
  v=$(cat "$f" 2>/dev/null) || continue
  if (printf '%s\n' "$v" > "$f") 2>/dev/null; then n=$((n+1)); echo "WRITABLE $f"; fi
done
echo "writable: $n"
cat /proc/self/mountinfo"#;
    let (execution, _) = run(&daemon, "builtin.shell", script).await;
    let out = &execution.tool_output;
    // The mechanism first: the read-only bind of /proc/sys, in the
    // sandbox's own mount table (mountinfo: ID PARENT MAJ:MIN ROOT
    // MOUNTPOINT OPTIONS ...). Without it the sysctls of the sandbox's
    // own namespaces (IPC, pid) are writable, and the count below says so.
    let proc_sys: Vec<&str> =
        out.lines().filter(|l| l.split(' ').nth(4) == Some("/proc/sys")).filter_map(|l| l.split(' ').nth(5)).collect();
    assert!(!proc_sys.is_empty(), "/proc/sys is no mount of its own in the sandbox:\n{out}");
    assert!(
        proc_sys.last().unwrap().split(',').any(|o| o == "ro"),
        "the mount over /proc/sys is not read-only ({proc_sys:?}):\n{out}"
    );
    assert!(out.contains("writable: 0"), "{out}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_private_keys_are_absent_and_the_hostname_is_neutral() {
    let daemon = daemon_with(vec![]).await;
    let script = "test -e /etc/ssl/private && echo PRIVATE-PRESENT; test -d /etc/ssl/certs && echo CERTS-PRESENT; \
                  echo host=$(cat /proc/sys/kernel/hostname); tr '\\0' ' ' < /proc/1/cmdline; echo";
    let (execution, _) = run(&daemon, "builtin.shell", script).await;
    let out = &execution.tool_output;
    assert!(!out.contains("PRIVATE-PRESENT"), "{out}");
    assert!(out.contains("CERTS-PRESENT"), "{out}");
    assert!(out.contains("host=corral"), "{out}");
    let data_dir = daemon.data_dir().display().to_string();
    assert!(!out.contains(&data_dir), "pid 1's command line shows the host's data directory: {out}");
    daemon.stop().await;
}

/// Runs `/bin/sh -c script` in a bare bwrap sandbox shaped like the
/// daemon's (its own namespaces, nested user namespaces disabled, uid
/// 1000, a new session, no capabilities) but without the seccomp filter,
/// and returns its stdout: the control that shows an attack works when
/// only the filter is missing, so that its refusal in a real sandbox is
/// the filter's doing (as `bwrap_loads_the_filter` in seccomp.rs does).
fn without_the_filter(script: &str) -> String {
    let out = std::process::Command::new("bwrap")
        .args(["--unshare-all", "--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000"])
        .args(["--new-session", "--cap-drop", "ALL"])
        .args(["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
        .args(["--", "/bin/sh", "-c", script])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .expect("bwrap runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the control without the filter failed: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A nested user namespace and two mounts. `--disable-userns` alone
/// answers the unshare with ENOSPC and a missing capability answers a
/// mount on /tmp with EPERM, both without the filter; a mount on a
/// missing directory fails its path lookup (ENOENT) before the kernel
/// checks any capability. So only the filter answers EPERM to all three.
const NAMESPACE_ATTACK: &str = r#"unshare -U true 2>/dev/null && echo USERNS-CREATED
unshare -Urm true 2>/dev/null && echo USERNS-MOUNT-CREATED
python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER = 0x10000000
r = libc.unshare(CLONE_NEWUSER)
print("unshare:", os.strerror(ctypes.get_errno()) if r else "ok")
for target in [b"/tmp", b"/tmp/no-such-dir"]:
    r = libc.mount(b"none", target, b"tmpfs", 0, None)
    print("mount %s:" % target.decode(), os.strerror(ctypes.get_errno()) if r else "ok")
EOF"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_user_namespaces_and_mount_are_refused() {
    let daemon = daemon_with(vec![]).await;
    let (execution, _) = run(&daemon, "builtin.shell", NAMESPACE_ATTACK).await;
    let out = &execution.tool_output;
    assert!(!out.contains("CREATED"), "{out}");
    assert!(out.contains("unshare: Operation not permitted"), "{out}");
    assert!(out.contains("mount /tmp: Operation not permitted"), "{out}");
    assert!(out.contains("mount /tmp/no-such-dir: Operation not permitted"), "the filter lets mount through:\n{out}");
    // The control: the same attack in bwrap without the filter gets the
    // kernel's own answers, which differ.
    let control = without_the_filter(NAMESPACE_ATTACK);
    assert!(control.contains("unshare: No space left on device"), "control: {control}");
    assert!(control.contains("mount /tmp/no-such-dir: No such file or directory"), "control: {control}");
    daemon.stop().await;
}

/// TIOCSTI on a pty that is not the caller's controlling tty (the kernel
/// refuses that without any filter), then, from a child that makes the
/// pty its controlling tty (setsid + TIOCSCTTY), the attack itself:
/// pushing a byte into its own terminal's input, read back raw.
const TIOCSTI_ATTACK: &str = r#"python3 - <<'EOF'
import fcntl, os, select, termios, tty
master, slave = os.openpty()
try:
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    print("other tty: TIOCSTI accepted", flush=True)
except OSError as e:
    print("other tty: TIOCSTI", os.strerror(e.errno), flush=True)
pid = os.fork()
if pid == 0:
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    # Only the controlling tty of the caller has its foreground group.
    print("controlling tty:", "yes" if os.tcgetpgrp(slave) == os.getpid() else "no", flush=True)
    tty.setraw(slave)
    try:
        fcntl.ioctl(slave, termios.TIOCSTI, b"x")
        ready, _, _ = select.select([slave], [], [], 5)
        print("own tty: TIOCSTI injected", os.read(slave, 1) if ready else "nothing", flush=True)
    except OSError as e:
        print("own tty: TIOCSTI", os.strerror(e.errno), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
EOF"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seccomp_filter_is_loaded_and_refuses_tiocsti() {
    let daemon = daemon_with(vec![]).await;
    let script = format!("grep '^Seccomp:' /proc/self/status\n{TIOCSTI_ATTACK}");
    let (execution, events) = run(&daemon, "builtin.shell", &script).await;
    let out = &execution.tool_output;
    assert!(out.contains("Seccomp:\t2"), "{out}");
    assert!(out.contains("controlling tty: yes"), "the attack did not get a controlling tty: {out}");
    assert!(out.contains("own tty: TIOCSTI Operation not permitted"), "TIOCSTI on its own tty: {out}");
    // The control: without the filter the same attack injects its byte
    // (the kernel allows TIOCSTI on the caller's own tty), while the
    // ioctl on another pty fails anyway, which is why that one proves
    // nothing about the filter.
    let control = without_the_filter(TIOCSTI_ATTACK);
    assert!(
        control.contains("controlling tty: yes") && control.contains("own tty: TIOCSTI injected b'x'"),
        "control run without the filter should inject, else this test proves nothing \
         (a kernel with dev.tty.legacy_tiocsti = 0 refuses TIOCSTI to everyone): {control}"
    );
    assert!(control.contains("other tty: TIOCSTI Operation not permitted"), "control: {control}");
    let receipt = receipt(&events);
    assert!(receipt.seccomp_digest.starts_with("sha256:") && receipt.seccomp_digest.len() == 71, "{receipt:?}");
    assert!(receipt.userns_disabled);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_descriptor_above_2_is_open_at_harness_start() {
    use std::os::fd::IntoRawFd;
    // A descriptor the daemon's process holds without close-on-exec (as an
    // inherited one would be): it must not reach the sandbox.
    let leak = std::fs::File::open("/etc/hostname").unwrap().into_raw_fd();
    // SAFETY: clearing FD_CLOEXEC on a descriptor this test owns.
    unsafe { libc::fcntl(leak, libc::F_SETFD, 0) };
    let daemon = daemon_with(vec![]).await;
    // Read from the host: the descriptors of the harness process itself.
    let marker = format!("FD-MARKER-{}", std::process::id());
    let script = format!("exec python3 -c 'import time; time.sleep(30)' {marker}");
    let (id, _, _, _stream) = start(&daemon, "builtin.shell", &script).await;
    let (pid, _) = wait_for("the harness", || host_processes(&marker).first().copied()).await;
    let read_fds = || {
        let mut fds: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        fds.sort();
        fds
    };
    // Python opens (and closes) its own modules while it starts: wait for
    // that to end. An inherited descriptor stays open for good.
    let mut fds = read_fds();
    for _ in 0..60 {
        if fds == [0, 1, 2] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        fds = read_fds();
    }
    assert_eq!(fds, [0, 1, 2], "descriptors of the harness once it sleeps");
    let mut client = daemon.executions().await;
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: id }).await.unwrap();
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// Limits

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_processes_caps_forks_and_says_so() {
    let daemon = daemon_with(vec![bwrap_shell("test.pids", "max_processes = 50")]).await;
    let script = r#"python3 - <<'EOF'
import os, time
started = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    started += 1
print("started", started)
EOF"#;
    let (execution, events) = run(&daemon, "test.pids", script).await;
    let started: u32 = execution
        .tool_output
        .lines()
        .find_map(|l| l.strip_prefix("started "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count: {}", execution.tool_output));
    assert!(started < 50, "{started} of 200 children started under max_processes = 50");
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Pids), "no limit event for pids");
    let receipt = receipt(&events);
    let pids = receipt.limits.iter().find(|l| l.name == "max_processes").expect("max_processes in the receipt");
    assert_eq!(pids.value, 50);
    assert!(pids.mechanism.contains("cgroup"), "{pids:?}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_bytes_stops_a_1_gib_allocation_and_reports_a_limit_hit() {
    let daemon = daemon_with(vec![bwrap_shell("test.memory", "memory_bytes = 268435456")]).await;
    let script = "python3 -c \"b = b'x' * (1 << 30); print('ALLOCATED', len(b))\"";
    let (execution, events) = run(&daemon, "test.memory", script).await;
    assert!(!execution.tool_output.contains("ALLOCATED"), "1 GiB allocated under a 256 MiB limit");
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32);
    let hits = limit_events(&events);
    assert!(hits.iter().any(|l| l.limit() == pb::LimitKind::Memory && l.value == 256 << 20), "{hits:?}");
    assert!(execution.tool_error.contains("memory_bytes"), "{}", execution.tool_error);
    // The daemon is fine: the next run works.
    let (next, _) = run(&daemon, "builtin.shell", "echo alive").await;
    assert!(next.tool_output.contains("alive"));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_workspace_bytes_exceeded_fails_the_run() {
    let daemon = daemon_with(vec![bwrap_shell("test.workspace", "max_workspace_bytes = 10485760")]).await;
    let script = "head -c 6000000 /dev/zero > a; head -c 6000000 /dev/zero > b; sleep 5; echo DONE";
    let (execution, events) = run(&daemon, "test.workspace", script).await;
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert_eq!(execution.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Execution as i32);
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Workspace), "no workspace limit event");
    assert!(!execution.tool_output.contains("DONE"), "the run went on past its workspace limit");
    daemon.stop().await;
}

/// The run of `script` under a 10 MiB workspace budget ends with that
/// budget's failure, before it prints DONE.
async fn fails_the_workspace_budget(id: &str, script: &str) {
    let daemon = daemon_with(vec![bwrap_shell(id, "max_workspace_bytes = 10485760")]).await;
    let (execution, events) = run(&daemon, id, script).await;
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert_eq!(execution.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Execution as i32);
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Workspace), "no workspace limit event");
    assert!(!execution.tool_output.contains("DONE"), "the run went on past its workspace limit");
    daemon.stop().await;
}

/// A harness that fills its workspace and exits before the daemon's watch
/// looks (every 250 ms) is caught by the check at the end of the run,
/// which walks a tree this small on the async worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_filled_as_the_harness_exits_fails_the_run() {
    let daemon = daemon_with(vec![bwrap_shell("test.last", "max_workspace_bytes = 10485760")]).await;
    // Two files, each under the file size limit.
    let script = "head -c 6000000 /dev/zero > a; head -c 6000000 /dev/zero > b";
    let (execution, events) = run(&daemon, "test.last", script).await;
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert_eq!(execution.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Execution as i32);
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Workspace), "no workspace limit event");
    daemon.stop().await;
}

/// Blocks allocated past a file's end (`fallocate --keep-size`) show in no
/// file size, and RLIMIT_FSIZE does not stop them: they count all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_allocated_past_a_files_end_count_against_the_workspace() {
    fails_the_workspace_budget("test.fallocate", "touch pre; fallocate -n -l 100M pre; sleep 5; echo DONE").await;
}

/// Files deleted while held open are nowhere in the tree but on its disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_files_held_open_count_against_the_workspace() {
    // One at a time: no moment has more than 9 MiB named in the tree.
    let script = "exec 3>a; head -c 9437184 /dev/zero >&3; rm a; exec 4>b; head -c 9437184 /dev/zero >&4; rm b; \
                  exec 5>c; head -c 9437184 /dev/zero >&5; rm c; sleep 5; echo DONE";
    fails_the_workspace_budget("test.unlinked", script).await;
}

/// Under an unprivileged daemon the harness runs as the daemon's own uid
/// and can close a directory to it (`chmod 300`): what is below still
/// counts against the workspace, and teardown still removes it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_closed_to_an_unprivileged_daemon_still_counts_and_goes() {
    use corral::pb::execution_service_client::ExecutionServiceClient;
    require_bwrap();
    const UID: u32 = 64000;
    let dir = common::data_tempdir();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::chown(&data, Some(UID), Some(UID)).unwrap();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir(&profiles).unwrap();
    // No cgroup for an unprivileged daemon: its limits written off.
    let limits = "max_workspace_bytes = 10485760\nmemory_bytes = 0\nmax_processes = 0\ncpu_millis = 0";
    let (name, text) = bwrap_shell("test.closed", limits);
    std::fs::write(profiles.join(name), text).unwrap();
    let wrapper = ["setpriv", "--reuid", "64000", "--regid", "64000", "--clear-groups", "--"];
    let daemon = common::ServeProcess::start_wrapped(&data, &profiles, &[("HOME", "/tmp")], "", &wrapper).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let script = "mkdir hide; chmod 300 hide; for i in 1 2 3 4; do head -c 9437184 /dev/zero > hide/$i; done; \
                  sleep 5; echo DONE";
    let mut stream = client.execute(request("test.closed", script)).await.expect("execute").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let execution = finished(&events);
    let sandboxes = data.join("sandboxes");
    let empty = || std::fs::read_dir(&sandboxes).map(|d| d.count() == 0).unwrap_or(true);
    for _ in 0..100 {
        if empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left = empty();
    daemon.stop().await;
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert!(limit_events(&events).iter().any(|l| l.limit() == pb::LimitKind::Workspace), "no workspace limit event");
    assert!(!execution.tool_output.contains("DONE"), "the run went on past its workspace limit");
    assert!(left, "the sandbox's directory was not removed: {:?}", std::fs::read_dir(&sandboxes).unwrap().count());
}

/// A protocol harness's `result` line carries its own output: held to
/// `max_output_bytes` like plain output (a line may be up to 1 MiB), cut
/// between its lines like plain output, the rest reported as dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_lines_output_is_held_to_max_output_bytes() {
    let daemon = daemon_with(vec![bwrap_shell("test.capped", "max_output_bytes = 1005")]).await;
    // 500 lines of nine x and a newline (escaped in the JSON string).
    let script = r#"lines=$(i=0; while [ $i -lt 500 ]; do printf 'xxxxxxxxx\\n'; i=$((i+1)); done)
printf '{"type":"result","ok":true,"output":"%s"}\n' "$lines""#;
    let (execution, events) = run(&daemon, "test.capped", script).await;
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert_eq!(execution.tool_output, "xxxxxxxxx\n".repeat(100), "whole lines, up to the cap");
    let dropped: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::OutputTruncated(t)) => Some((t.stream(), t.bytes_dropped)),
            _ => None,
        })
        .collect();
    assert_eq!(dropped, [(pb::OutputStream::Stdout, 4000)]);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_flood_is_cut_at_the_limit() {
    let daemon = daemon_with(vec![bwrap_shell("test.flood", "max_events = 100")]).await;
    let script = r#"i=0; while [ $i -lt 3000 ]; do echo '{"type":"progress","message":"flood"}'; i=$((i+1)); done"#;
    let (execution, events) = run(&daemon, "test.flood", script).await;
    let progress = events.iter().filter(|e| matches!(e.kind, Some(Kind::Progress(_)))).count();
    assert!(progress <= 100, "{progress} progress events recorded past max_events = 100");
    let hits = limit_events(&events);
    assert_eq!(hits.len(), 1, "exactly one event says the stream was cut: {hits:?}");
    assert_eq!(hits[0].limit(), pb::LimitKind::Events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32);
    let stored = daemon.watch_all(&execution.execution_id, 0).await;
    assert!(stored.len() < 120, "{} events stored", stored.len());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_the_host_cannot_enforce_is_refused_at_the_gate() {
    require_bwrap();
    let no_cgroups = tempfile::tempdir().unwrap();
    let mount = no_cgroups.path().to_path_buf();
    let daemon = TestDaemon::start(Options {
        profiles: vec![bwrap_shell("test.memory", "memory_bytes = 268435456")],
        backends: Some(corral::sandbox::Backends::for_host(&corral::sandbox::SandboxConfig {
            cgroup_mount: mount.clone(),
            ..Default::default()
        })),
        ..Options::default()
    })
    .await;
    let (execution, events) = run(&daemon, "test.memory", "echo ran").await;
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32);
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Gate as i32);
    assert!(
        execution.tool_error.contains("limits.memory_bytes cannot be enforced on this host"),
        "{}",
        execution.tool_error
    );
    assert!(!events.iter().any(|e| matches!(e.kind, Some(Kind::SandboxReady(_)))), "a sandbox was created");
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// Teardown

/// Runs a sleeping task, cancels it `delay` after `dispatched`, and checks
/// that once it is CANCELLED nothing of its sandbox is alive on the host.
async fn cancel_after(daemon: &TestDaemon, delay: Duration, marker: &str, on_disconnect: bool) {
    let script = format!("exec python3 -c 'import time; time.sleep(600)' {marker}");
    let mut client = daemon.executions().await;
    let mut req = request("builtin.shell", &script);
    req.cancel_on_disconnect = on_disconnect;
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let mut id = String::new();
    let mut host_uid = 0;
    loop {
        let event = stream.message().await.unwrap().expect("a dispatched event");
        match event.kind {
            Some(Kind::Accepted(a)) => id = a.execution_id,
            Some(Kind::SandboxReady(r)) => host_uid = r.receipt.unwrap().host_uid,
            Some(Kind::Dispatched(_)) => break,
            _ => {}
        }
    }
    tokio::time::sleep(delay).await;
    if on_disconnect {
        drop(stream);
    } else {
        client.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.unwrap();
    }
    let events = daemon.watch_all(&id, 0).await;
    let record = finished(&events);
    assert_eq!(record.state, pb::ExecutionState::Cancelled as i32, "{record:?}");
    assert_ne!(host_uid, 0);
    let left = processes_of_uid(host_uid);
    let described: Vec<String> = left.iter().map(|pid| describe(*pid)).collect();
    assert!(left.is_empty(), "after CANCELLED, processes of the sandbox's uid {host_uid} live: {described:?}");
    let marked = host_processes(marker);
    assert!(marked.is_empty(), "after CANCELLED, the task lives: {marked:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_cancel_leaves_nothing_alive() {
    let daemon = daemon_with(vec![]).await;
    for ms in [0u64, 1, 2, 5, 10, 20] {
        for n in 0..20 {
            let marker = format!("CANCEL-MARKER-{}-{ms}-{n}", std::process::id());
            cancel_after(&daemon, Duration::from_millis(ms), &marker, false).await;
        }
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_leaves_at_once_leaves_nothing_alive() {
    let daemon = daemon_with(vec![]).await;
    for n in 0..20 {
        let marker = format!("DISCONNECT-MARKER-{}-{n}", std::process::id());
        cancel_after(&daemon, Duration::ZERO, &marker, true).await;
    }
    daemon.stop().await;
}

/// The session a host process leads or belongs to (`/proc/PID/stat`).
fn session_of(pid: i32) -> Option<i32> {
    stat_field(pid, 3)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setsid_child_of_a_none_sandbox_does_not_survive_teardown() {
    let profile = ("none.toml".to_string(), shell_profile("test.none", "type = \"none\"\nallow_network = true", ""));
    let daemon = daemon_with(vec![profile]).await;
    let marker = format!("SETSID-MARKER-{}", std::process::id());
    // The task ends only once the test has seen its setsid child alive (it
    // writes `seen` into the workspace), so "nothing left" below cannot
    // pass for a child that never ran.
    let script = format!(
        "setsid python3 -c 'import time; time.sleep(600)' {marker} >/dev/null 2>&1 < /dev/null &\n\
         while [ ! -e seen ]; do sleep 0.05; done; echo started"
    );
    let (_, ws, receipt, mut stream) = start(&daemon, "test.none", &script).await;
    assert_ne!(receipt.host_uid, 0, "a none sandbox runs as host root");
    // setsid(1) may fork first: until its child has called setsid() and
    // exec'd python3, the marker is in a process of the task's session.
    // So this waits for the marked processes to lead their own session
    // (and fails by timing out if they never do).
    let alive = wait_for("the setsid child alive on the host, leading a session of its own", || {
        let found = host_processes(&marker);
        let settled = !found.is_empty() && found.iter().all(|(pid, _)| session_of(*pid) == Some(*pid));
        settled.then_some(found)
    })
    .await;
    for (pid, uid) in &alive {
        assert_eq!(*uid, receipt.host_uid, "the marked process {pid} is not the sandbox's");
    }
    std::fs::write(format!("{ws}/seen"), "").unwrap();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        events.push(event);
    }
    let execution = finished(&events);
    let left = host_processes(&marker);
    assert!(left.is_empty(), "a setsid child outlived its none sandbox (alive before: {alive:?}): {left:?}");
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert!(execution.tool_output.contains("started"), "{}", execution.tool_output);
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    daemon.stop().await;
}

/// Teardown trusts an emptied cgroup to mean nothing of the sandbox is
/// left (it sweeps the sandbox's uid only without one), so no process of
/// a sandbox may move itself out of its cgroup: not from bwrap (no
/// cgroupfs inside), not from a `none` sandbox (the host's cgroupfs, but
/// root's files), into any cgroup it can find.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sandbox_process_can_leave_its_cgroup() {
    let none = ("none.toml".to_string(), shell_profile("test.none", "type = \"none\"\nallow_network = true", ""));
    let daemon = daemon_with(vec![none, bwrap_shell("test.bwrap", "")]).await;
    let script = "for f in $(find /sys/fs/cgroup -maxdepth 4 -name cgroup.procs 2>/dev/null); do \
                  echo \"try $f\"; if echo $$ > \"$f\" 2>/dev/null; then echo \"moved to $f\"; fi; done; \
                  echo tried; cat /proc/self/cgroup";
    for profile in ["test.none", "test.bwrap"] {
        let (execution, events) = run(&daemon, profile, script).await;
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{profile}: {execution:?}");
        let output = &execution.tool_output;
        assert!(output.contains("tried"), "{profile}: {output}");
        assert!(!output.contains("moved"), "{profile}: a sandbox process left its cgroup:\n{output}");
        if profile == "test.bwrap" {
            // What keeps it in: no cgroupfs inside at all.
            assert!(!output.contains("try "), "bwrap shows the sandbox a cgroupfs:\n{output}");
        }
        if profile == "test.none" {
            // It saw the host's cgroups (the root's among them) and tried them.
            assert!(output.contains("try /sys/fs/cgroup/"), "{output}");
            // The host's view: still in the sandbox's own cgroup.
            let sandbox_id = events
                .iter()
                .find_map(|e| match &e.kind {
                    Some(Kind::SandboxReady(ready)) => Some(ready.sandbox_id.clone()),
                    _ => None,
                })
                .unwrap();
            assert!(output.lines().any(|l| l.contains(&sandbox_id)), "not in its cgroup: {output}");
        }
    }
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// Receipt and capability report

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receipt_names_uid_seccomp_and_limits() {
    let daemon = daemon_with(vec![bwrap_shell(
        "test.limits",
        "memory_bytes = 536870912\nmax_processes = 64\nmax_open_files = 256",
    )])
    .await;
    let (execution, events) = run(&daemon, "test.limits", "ulimit -n; ulimit -c").await;
    let receipt = receipt(&events);
    assert!(receipt.host_uid >= 200000 && receipt.own_uid, "{receipt:?}");
    assert_eq!(receipt.inside_uid, 1000);
    assert!(receipt.seccomp_digest.starts_with("sha256:"));
    let names: Vec<&str> = receipt.limits.iter().map(|l| l.name.as_str()).collect();
    for name in ["memory_bytes", "max_processes", "max_open_files", "tmp_bytes"] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    let lines: Vec<&str> = execution.tool_output.lines().collect();
    assert_eq!(lines, ["256", "0"], "RLIMIT_NOFILE and RLIMIT_CORE inside");
    daemon.stop().await;
}

#[test]
fn corral_doctor_prints_the_capability_report() {
    require_bwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral")).arg("doctor").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for line in ["bwrap", "seccomp", "sandbox uids", "cgroups", "memory", "pids", "builtin.shell@1.0.0"] {
        assert!(text.lines().any(|l| l.trim_start().starts_with(line)), "no {line} line in\n{text}");
    }
    assert!(text.contains("one host uid per sandbox"), "{text}");
}

#[test]
fn an_unprivileged_daemon_says_its_sandboxes_share_its_uid() {
    require_bwrap();
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("doctor")
        .env("HOME", "/tmp")
        .uid(65534)
        .gid(65534)
        .output()
        .expect("corral doctor runs as nobody (the binary must be readable by others)");
    let text = String::from_utf8_lossy(&out.stdout);
    let uids = text.lines().find(|l| l.starts_with("sandbox uids")).unwrap_or_else(|| panic!("{text}"));
    assert!(uids.contains("NO") && uids.contains("every sandbox runs as uid 65534"), "{uids}");
    let egress = text.lines().find(|l| l.starts_with("egress")).unwrap_or_else(|| panic!("{text}"));
    assert!(egress.contains("NO"), "an unprivileged daemon claims it can proxy egress: {egress}");
}

#[test]
fn corral_doctor_says_where_each_profiles_keys_go() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "sk-doctor\n").unwrap();
    let config = dir.path().join("corral.toml");
    std::fs::write(
        &config,
        format!(
            "[credentials.routes.anthropic]\nfile = {key:?}\ninject_as = \"ANTHROPIC_API_KEY\"\n\
             [credentials.routes.openai]\nfile = {key:?}\ninject_as = \"OPENAI_API_KEY\"\nexpose = true\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("doctor")
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |profile: &str| {
        text.lines().find(|l| l.trim_start().starts_with(profile)).unwrap_or_else(|| panic!("{text}")).to_string()
    };
    assert!(line("builtin.claude-code@").contains("keys stay in the daemon (credential gateway: anthropic)"), "{text}");
    assert!(line("builtin.codex@").contains("keys in the harness's environment: openai"), "exposed: {text}");
}

/// A bwrap shell profile whose workspace is read-only but for `write_paths`.
fn read_only_workspace(id: &str, write_paths: &str) -> (String, String) {
    let profile = format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
write_paths = {write_paths}
[limits]
timeout_seconds = 60
"#
    );
    (format!("{id}.toml"), profile)
}

/// A repository with one commit holding `files` and the symlinks `links`
/// (`name -> target`).
fn repo_with(files: &[&str], links: &[(&str, &str)]) -> tempfile::TempDir {
    let repo = common::git_repo();
    for file in files {
        let path = repo.path().join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "original\n").unwrap();
    }
    for (name, target) in links {
        std::os::unix::fs::symlink(target, repo.path().join(name)).unwrap();
    }
    common::git(repo.path(), &["add", "-A"]);
    common::git(repo.path(), &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "links"]);
    repo
}

/// The run of `script` on `repo` with `profile`: refused before the
/// harness starts, saying a write path is a symlink.
async fn refused_for_a_symlink(daemon: &TestDaemon, profile: &str, repo: &std::path::Path, script: &str) {
    let mut req = request(profile, script);
    req.repo = repo.display().to_string();
    let events = daemon.execute(req).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    assert!(execution.tool_error.contains("is a symlink"), "{}", execution.tool_error);
    assert!(!execution.tool_output.contains("WROTE"), "the harness ran: {}", execution.tool_output);
}

/// A symlink the repository commits at a relative write path (`out -> .`)
/// would make bwrap bind the whole workspace writable, `.git` and all,
/// while the receipt's write roots say `/workspace/out`: the run is
/// refused, and nothing the harness could write reaches the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_symlink_at_a_write_path_cannot_widen_it() {
    let daemon = daemon_with(vec![read_only_workspace("test.out-link", r#"["out"]"#)]).await;
    let repo = repo_with(&["file.txt"], &[("out", ".")]);
    let script = "echo pwned > /workspace/file.txt && echo pwned > /workspace/.git/pwned && echo WROTE";
    refused_for_a_symlink(&daemon, "test.out-link", repo.path(), script).await;
    for (name, id) in common::git(repo.path(), &["for-each-ref", "--format=%(refname) %(objectname)", "refs/corral"])
        .lines()
        .filter_map(|l| l.split_once(' '))
    {
        let text = common::git(repo.path(), &["show", &format!("{id}:file.txt")]);
        assert_eq!(text, "original", "{name} carries the harness's write");
    }
    daemon.stop().await;
}

/// A symlink higher up a nested write path (`a/tmp`, with `a` committed
/// as `../../..` up to the root) points the bind's source, which bwrap
/// resolves outside the sandbox, out of the workspace (the run went on
/// and wrote before the fix): refused, and nothing lands in the host's
/// /tmp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_above_a_nested_write_path_cannot_reach_the_host() {
    let daemon = daemon_with(vec![read_only_workspace("test.nested-link", r#"["a/tmp"]"#)]).await;
    // bwrap resolves the source under its own root, where the host's is
    // /oldroot: an absolute link would miss it, exactly enough `..` do not.
    let workspace = daemon.data_dir().join("sandboxes/id/workspace");
    let up = "../".repeat(workspace.components().count() - 1);
    let repo = repo_with(&[], &[("a", &up)]);
    let name = format!("corral-escape-{}", std::process::id());
    let script = format!("echo pwned > /workspace/a/tmp/{name} && echo WROTE");
    refused_for_a_symlink(&daemon, "test.nested-link", repo.path(), &script).await;
    let escaped = std::path::Path::new("/tmp").join(&name);
    let landed = escaped.exists();
    let _ = std::fs::remove_file(&escaped);
    assert!(!landed, "the harness wrote {} on the host", escaped.display());
    daemon.stop().await;
}

/// /dev is bwrap's own tmpfs, without a size: writable, it would hold
/// whatever the harness wrote there, past every tmpfs limit. It is
/// read-only; its device nodes still work, and /dev/shm stays writable
/// (and is among the receipt's write roots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_is_read_only_but_its_devices_and_shm_work() {
    let daemon = daemon_with(vec![]).await;
    let script = "echo x > /dev/x 2>/dev/null && echo DEV-WRITABLE; \
                  mkdir /dev/d 2>/dev/null && echo DEV-MKDIR; \
                  echo x > /dev/null && echo NULL-OK; \
                  head -c 8 /dev/urandom > /dev/null && echo x > /dev/urandom && echo URANDOM-OK; \
                  echo x > /dev/shm/x && echo SHM-OK";
    let (execution, events) = run(&daemon, "builtin.shell", script).await;
    let out = &execution.tool_output;
    assert!(!out.contains("DEV-WRITABLE") && !out.contains("DEV-MKDIR"), "/dev is writable: {out}");
    for ok in ["NULL-OK", "URANDOM-OK", "SHM-OK"] {
        assert!(out.contains(ok), "{ok}: {out}");
    }
    assert!(receipt(&events).write_roots.contains(&"/dev/shm".to_string()), "{:?}", receipt(&events));
    daemon.stop().await;
}
