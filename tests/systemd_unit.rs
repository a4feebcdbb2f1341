//! `packaging/corral.service` runs the README's workflow: systemd accepts
//! it, the daemon tells systemd when it is ready and when it stops, and
//! fetch-back still writes a run's commit into its repository under the
//! unit's own mount hardening (ProtectSystem, ProtectHome, ReadWritePaths),
//! rebuilt here in a mount namespace from the unit's settings.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::ServeProcess;
use corral::pb::{self, execution_service_client::ExecutionServiceClient};

const UNIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/corral.service");

/// Every value of `key` in the unit.
fn values(key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(UNIT).unwrap();
    text.lines().filter_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(|v| v.trim().to_string())).collect()
}

fn value(key: &str) -> String {
    let found = values(key);
    assert_eq!(found.len(), 1, "{key} once in the unit: {found:?}");
    found[0].clone()
}

fn require_tool(tool: &str, package: &str) {
    let found = std::process::Command::new("sh").args(["-c", &format!("command -v {tool}")]).output();
    assert!(found.is_ok_and(|o| o.status.success()), "this test needs {tool}: install the Debian package `{package}`");
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    require_tool("systemd-analyze", "systemd");
    // verify also checks that ExecStart's binary exists: point it at ours.
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("corral.service");
    let text = std::fs::read_to_string(UNIT).unwrap().replace("/usr/local/bin/corral", env!("CARGO_BIN_EXE_corral"));
    std::fs::write(&unit, text).unwrap();
    let out = std::process::Command::new("systemd-analyze").arg("verify").arg(&unit).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "systemd-analyze verify failed:\n{said}");
    // Unknown keys are only warnings to verify: none may be printed.
    assert!(!said.contains("corral.service"), "systemd-analyze verify complained:\n{said}");
}

#[test]
fn the_units_settings_fit_the_daemon() {
    assert_eq!(value("Type"), "notify");
    assert_eq!(value("PrivateTmp"), "false", "a private /tmp hides operators' files");
    let default_root = corral::config::Config::default().repo_roots;
    let writable = values("ReadWritePaths").join(" ");
    for root in ["/srv/corral/repos".into()].iter().chain(default_root.iter()) {
        let root: &PathBuf = root;
        assert!(writable.contains(&root.display().to_string()), "repo root {} is writable: {writable}", root.display());
    }
    assert_eq!(value("Delegate"), "yes");
    let parent = values("Environment")
        .into_iter()
        .find_map(|e| e.strip_prefix("CORRAL_CGROUP_PARENT=").map(String::from))
        .expect("the unit names the sandboxes' cgroup parent");
    assert!(parent.starts_with("system.slice/corral.service/"), "inside the delegated subtree: {parent}");
    let nofile: u64 = value("LimitNOFILE").parse().unwrap();
    let defaults = corral::config::Config::default();
    assert_eq!(
        corral::fdlimit::proxy_connections(&defaults, nofile),
        Ok(corral::fdlimit::DEFAULT_MAX_CONNECTIONS as usize),
        "LimitNOFILE fits the default admission and proxy caps"
    );
    // Every sandbox the default admission runs at once, each at the default
    // pids limit, and room for the daemon's own threads (tokio's blocking
    // pool alone may reach 512) and the git processes it runs.
    let tasks: u64 = value("TasksMax").parse().unwrap();
    let sandboxes = (defaults.max_running_executions + defaults.max_running_sessions) as u64;
    let pids = defaults.default_limits.max_processes;
    let daemon = 1024;
    assert!(
        tasks >= sandboxes * pids + daemon,
        "TasksMax {tasks} fits {sandboxes} sandboxes of {pids} tasks and {daemon} of the daemon's"
    );
    assert_eq!(value("ExecReload"), "/bin/kill -HUP $MAINPID");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_notifies_ready_then_stopping() {
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).unwrap();
    let notify = socket_path.display().to_string();
    let mut daemon =
        ServeProcess::start_with(&dir.path().join("data"), &profiles, &[("NOTIFY_SOCKET", notify.as_str())], "").await;
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut buf)).await.expect("READY").unwrap();
    assert_eq!(&buf[..n], b"READY=1\n");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    let n = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut buf)).await.expect("STOPPING").unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1\n");
    assert!(daemon.child.wait().await.unwrap().success());
}

/// The shell script that rebuilds the unit's mounts: what ProtectSystem
/// and ProtectHome make read-only, then each writable root bound back
/// read-write (ReadWritePaths).
fn hardening_script(writable: &[&Path]) -> String {
    let mut read_only = Vec::new();
    match value("ProtectSystem").as_str() {
        "full" => read_only.extend(["/usr", "/boot", "/efi", "/etc"]),
        "yes" | "true" => read_only.extend(["/usr", "/boot", "/efi"]),
        other => panic!("ProtectSystem={other}: teach this test what it protects"),
    }
    match value("ProtectHome").as_str() {
        "read-only" => read_only.extend(["/home", "/root", "/run/user"]),
        other => panic!("ProtectHome={other}: teach this test what it protects"),
    }
    let mut script = String::from("set -e\n");
    for dir in read_only {
        script
            .push_str(&format!("if [ -d {dir} ]; then mount --bind {dir} {dir}; mount -o remount,bind,ro {dir}; fi\n"));
    }
    for dir in writable {
        let dir = dir.display();
        script.push_str(&format!("mount --bind {dir} {dir}; mount -o remount,bind,rw {dir}\n"));
    }
    script.push_str("exec \"$@\"\n");
    script
}

/// A repository root under /home (read-only under the unit), removed on drop.
struct HomeRoot(PathBuf);

impl Drop for HomeRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the fake agent (which commits) on a repository under a root in
/// /home, with the daemon inside the unit's mount hardening; `bind_root`:
/// whether the root is bound writable as ReadWritePaths does.
async fn run_under_hardening(bind_root: bool) -> (pb::Execution, String) {
    use std::os::unix::fs::PermissionsExt;
    require_tool("unshare", "util-linux");
    common::require_bwrap();
    let home = HomeRoot(PathBuf::from(format!("/home/corral-unit-test-{}-{bind_root}", std::process::id())));
    let root = home.0.join("repos");
    let repo = root.join("sample");
    std::fs::create_dir_all(&repo).unwrap();
    for dir in [&home.0, &root, &repo] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    common::git(&repo, &["init", "-q"]);
    common::git(&repo, &["-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "init"]);

    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), common::fake_agent_profile("test.fake-agent", "")).unwrap();
    let writable: Vec<&Path> = if bind_root { vec![root.as_path()] } else { vec![] };
    let script = hardening_script(&writable);
    let wrapper = ["unshare", "-m", "--propagation", "private", "--", "/bin/sh", "-c", script.as_str(), "sh"];
    // The environment layer names the root (it comes after the config file).
    let root_env = root.display().to_string();
    let env = [("CORRAL_REPO_ROOTS", root_env.as_str())];
    let daemon = ServeProcess::start_wrapped(&dir.path().join("data"), &profiles, &env, "", &wrapper).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut request = common::request("test.fake-agent", "make a change");
    request.repo = repo.display().to_string();
    let mut stream = client.execute(request).await.expect("execute").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let refs = common::git(&repo, &["for-each-ref", "--format=%(objectname)", "refs/corral"]);
    (common::finished(&events), refs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_back_reaches_a_repo_root_under_the_units_hardening() {
    let (execution, refs) = run_under_hardening(true).await;
    assert_eq!(
        pb::ExecutionState::try_from(execution.state).unwrap(),
        pb::ExecutionState::Succeeded,
        "{}",
        execution.tool_error
    );
    let commit = common::evidence(&execution).commit_sha;
    assert!(!commit.is_empty() && refs.contains(&commit), "the run's commit {commit:?} came back: {refs:?}");
}

/// The control: without the writable root (a unit without ReadWritePaths),
/// the same run fails at teardown and nothing comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_read_write_paths_fetch_back_fails() {
    let (execution, refs) = run_under_hardening(false).await;
    assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Failed);
    let evidence = common::evidence(&execution);
    assert_eq!(pb::FailureStage::try_from(evidence.failure_stage).unwrap(), pb::FailureStage::Teardown);
    assert!(refs.is_empty(), "{refs:?}");
    assert!(execution.tool_error.contains("Read-only file system"), "{}", execution.tool_error);
}

/// The unit's cgroup layout: the daemon starts inside a "service" cgroup
/// (as systemd puts it with Delegate=yes), cgroup_parent names a subtree of
/// it (as CORRAL_CGROUP_PARENT in the unit does): the daemon moves into the
/// leaf `daemon`, and a run with a pids limit gets its cgroup under the
/// parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_delegated_cgroup_the_daemon_takes_a_leaf_and_sandboxes_get_limits() {
    common::require_bwrap();
    let root = corral::delegate::v2_root(Path::new("/sys/fs/cgroup")).expect("this test needs a cgroup v2 hierarchy");
    let service = format!("corral-test-unit-{}/corral.service", std::process::id());
    std::fs::create_dir_all(root.join(&service)).unwrap();
    let parent = format!("{service}/sandboxes");
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let profile = common::fake_agent_profile("test.fake-agent", "max_processes = 64");
    std::fs::write(profiles.join("fake.toml"), profile).unwrap();
    let procs = root.join(&service).join("cgroup.procs");
    let script = format!("echo $$ > {}; exec \"$@\"", procs.display());
    let wrapper = ["/bin/sh", "-c", script.as_str(), "sh"];
    let env = [("CORRAL_CGROUP_PARENT", parent.as_str())];
    let mut daemon = ServeProcess::start_wrapped(&dir.path().join("data"), &profiles, &env, "", &wrapper).await;
    let own = std::fs::read_to_string(format!("/proc/{}/cgroup", daemon.pid())).unwrap();
    assert!(own.contains(&format!("0::/{service}/daemon")), "the daemon is in its leaf: {own}");
    assert_eq!(std::fs::read_to_string(&procs).unwrap().trim(), "", "the service cgroup itself holds no process");

    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let request = common::request("test.fake-agent", "NOWORK");
    let mut stream = client.execute(request).await.expect("execute").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let execution = common::finished(&events);
    assert_eq!(
        pb::ExecutionState::try_from(execution.state).unwrap(),
        pb::ExecutionState::Succeeded,
        "{}",
        execution.tool_error
    );
    let log = std::fs::read_to_string(dir.path().join("data").with_extension("log")).unwrap();
    assert!(log.contains("the daemon moved into the leaf of its delegated cgroup"), "{log}");
    assert!(root.join(&parent).is_dir(), "sandbox cgroups live under the delegated parent");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();
    for leftover in [parent.clone(), format!("{service}/daemon"), service.clone()] {
        let _ = std::fs::remove_dir(root.join(leftover));
    }
    let _ = std::fs::remove_dir(root.join(service.split('/').next().unwrap()));
}

/// The daemon raises its soft RLIMIT_NOFILE to the hard limit at start
/// (systemd's LimitNOFILE sets both; a shell may leave the soft one low).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_raises_its_descriptor_limit_to_the_hard_one() {
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let wrapper = ["/bin/sh", "-c", "ulimit -Sn 1024; exec \"$@\"", "sh"];
    let mut daemon = ServeProcess::start_wrapped(&dir.path().join("data"), &profiles, &[], "", &wrapper).await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", daemon.pid())).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard) = (fields[3], fields[4]);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();
    assert_ne!(soft, "1024", "{line}");
    assert_eq!(soft, hard, "{line}");
}
