//! A `none` sandbox runs on the host as its own uid: teardown must take
//! back everything it left outside its directory (System V IPC, POSIX shm
//! in /dev/shm, files in /tmp and /run/lock, its kernel keyring) before
//! its uid can go to the next tenant, and its uid is not handed out again
//! at once.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;

fn none_profile() -> (String, String) {
    let text = "id = \"test.none\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
                [sandbox]\ntype = \"none\"\nallow_network = true\nwrite_paths = [\".\"]\n[limits]\ntimeout_seconds = 60\n";
    ("none.toml".into(), text.into())
}

/// Leaves one of each behind, prints what it made, then sleeps `sleep`
/// seconds so the host can see them while the run is alive.
fn script(marker: &str, sleep: u32) -> String {
    format!(
        r#"echo "TMPDIR $TMPDIR"
python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
shm = libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o644)
sem = libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o644)
msg = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o644)
print("SYSV", shm, sem, msg, flush=True)
open("/dev/shm/{marker}", "w").write("left in /dev/shm")
open("/tmp/{marker}", "w").write("left in /tmp")
open("/var/lock/{marker}", "w").write("left in /run/lock, through its link")
os.mkdir("/tmp/{marker}.d")
open("/tmp/{marker}.d/inner", "w").write("x")
libc.syscall.restype = ctypes.c_long
add_key = 248 if os.uname().machine == "x86_64" else 217
serial = libc.syscall(ctypes.c_long(add_key), b"user", b"{marker}", b"secret", ctypes.c_size_t(6), ctypes.c_long(-4))
print("KEY", serial, os.strerror(ctypes.get_errno()) if serial < 0 else "ok", flush=True)
EOF
sleep {sleep}"#
    )
}

/// The ids of System V objects of `uid` in /proc/sysvipc/<kind>.
fn sysv_of(kind: &str, uid: u32) -> Vec<String> {
    let (owner, creator) = match kind {
        "sem" => (4, 6),
        _ => (7, 9),
    };
    let uid = uid.to_string();
    std::fs::read_to_string(format!("/proc/sysvipc/{kind}"))
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.get(owner) == Some(&uid.as_str()) || c.get(creator) == Some(&uid.as_str())).then(|| c[1].to_string())
        })
        .collect()
}

/// Whether `uid`'s user keyring holds a key described `marker`: asked as
/// that uid (root cannot search it), as the next tenant would.
fn key_visible_to(uid: u32, marker: &str) -> bool {
    use std::os::unix::process::CommandExt;
    let probe = format!(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n\
         nr = 250 if os.uname().machine == 'x86_64' else 219\n\
         r = libc.syscall(ctypes.c_long(nr), ctypes.c_long(10), ctypes.c_long(-4), b'user', b'{marker}', ctypes.c_long(0))\n\
         print('FOUND' if r >= 0 else 'ABSENT', r, os.strerror(ctypes.get_errno()))\n"
    );
    let out = std::process::Command::new("python3").args(["-c", &probe]).uid(uid).gid(uid).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.starts_with("FOUND") || text.starts_with("ABSENT"), "{text} {}", String::from_utf8_lossy(&out.stderr));
    text.starts_with("FOUND")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_none_run_leaves_no_ipc_shm_tmp_file_or_key_of_its_uid() {
    require_bwrap();
    let daemon = TestDaemon::start(Options { profiles: vec![none_profile()], ..Options::default() }).await;
    let marker = format!("corral-none-{}", std::process::id());
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request("test.none", &script(&marker, 3))).await.unwrap().into_inner();
    let mut uid = None;
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        let dispatched = matches!(event.kind, Some(Kind::Dispatched(_)));
        if let Some(Kind::SandboxReady(ready)) = &event.kind {
            uid = ready.receipt.as_ref().map(|r| r.host_uid);
        }
        events.push(event);
        if dispatched {
            break;
        }
    }
    let uid = uid.expect("a receipt with the host uid");
    assert!(uid >= 300_000, "a none sandbox with its own uid: {uid}");
    // Proof they existed: seen from the host while the run sleeps.
    let shm = PathBuf::from(format!("/dev/shm/{marker}"));
    let tmp = PathBuf::from(format!("/tmp/{marker}"));
    let lock = PathBuf::from(format!("/run/lock/{marker}"));
    let mut seen = false;
    for _ in 0..100 {
        if ["shm", "sem", "msg"].iter().all(|k| !sysv_of(k, uid).is_empty())
            && shm.exists()
            && tmp.exists()
            && lock.exists()
        {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(seen, "the run's objects never showed up on the host");
    assert_eq!(std::fs::metadata(&shm).unwrap().uid(), uid);
    assert!(key_visible_to(uid, &marker), "the key the run added is in its uid's keyring");
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{out} {}", execution.tool_error);
    assert!(out.contains("KEY ") && out.contains(" ok"), "{out}");
    let tmpdir = out.lines().find_map(|l| l.strip_prefix("TMPDIR ")).unwrap_or_default();
    assert!(tmpdir.starts_with(&daemon.data_dir().join("sandboxes").display().to_string()), "a private TMPDIR: {out}");
    assert_eq!(execution.evidence.unwrap().sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    // The purge is the reclaim, which runs after `finished`.
    daemon.engine.reclaimed().await;
    // After teardown: nothing of the uid.
    for kind in ["shm", "sem", "msg"] {
        assert_eq!(sysv_of(kind, uid), Vec::<String>::new(), "System V {kind} of uid {uid} survived teardown");
    }
    assert!(!shm.exists(), "{} survived teardown", shm.display());
    assert!(!tmp.exists(), "{} survived teardown", tmp.display());
    assert!(!lock.exists(), "{} survived teardown", lock.display());
    assert!(!Path::new(&format!("/tmp/{marker}.d")).exists(), "its /tmp directory survived");
    assert!(!key_visible_to(uid, &marker), "the next tenant of uid {uid} reads the key");
    daemon.stop().await;
}

/// The host uid in a run's `sandbox_ready` receipt.
fn host_uid(events: &[pb::LifecycleEvent]) -> u32 {
    events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(r)) => r.receipt.as_ref().map(|r| r.host_uid),
            _ => None,
        })
        .expect("a sandbox_ready receipt with the host uid")
}

/// A setuid-root binary the test makes (root here): what a `none`
/// sandbox's process would exec to become euid 0 while its real uid stays
/// the sandbox's.
fn setuid_copy(dir: &Path, of: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let copy = dir.join(Path::new(of).file_name().unwrap());
    std::fs::copy(of, &copy).unwrap();
    std::os::unix::fs::chown(&copy, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o4755)).unwrap();
    copy
}

/// Pids whose command line names `path`.
fn running(path: &Path) -> Vec<String> {
    let needle = path.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.parse::<u32>().is_ok()))
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// No process of a `none` sandbox gains privileges by exec: a setuid-root
/// binary runs as the sandbox's uid (no_new_privs), so a process it leaves
/// behind is still one of that uid, and teardown's sweep (which reads the
/// uid each /proc/<pid> belongs to) kills it before the uid goes to the
/// next tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_none_sandbox_cannot_become_root_by_a_setuid_binary_nor_hide_from_teardown() {
    require_bwrap();
    let dir = tempfile::Builder::new().prefix("corral-setuid-").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let id = setuid_copy(dir.path(), "/usr/bin/id");
    let sleep = setuid_copy(dir.path(), "/usr/bin/sleep");
    let daemon = TestDaemon::start(Options { profiles: vec![none_profile()], ..Options::default() }).await;
    let script = format!(
        "echo \"ID $({})\"\nsetsid {} 1000 </dev/null >/dev/null 2>&1 &\nsleep 0.3\necho \"STATUS $(grep -E '^(Uid|NoNewPrivs):' /proc/$!/status | tr -s '\\t\\n' ' ')\"\n",
        id.display(),
        sleep.display()
    );
    let events = daemon.execute(request("test.none", &script)).await;
    let execution = finished(&events);
    let out = execution.tool_output.clone();
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{out} {}", execution.tool_error);
    let uid = host_uid(&events);
    assert!(out.contains(&format!("ID uid={uid}")), "{out}");
    assert!(!out.contains("euid="), "a setuid binary ran as another user inside the sandbox: {out}");
    assert!(out.contains("NoNewPrivs: 1"), "{out}");
    daemon.engine.reclaimed().await;
    assert_eq!(running(&sleep), Vec::<String>::new(), "the sandbox's setuid process outlived its teardown");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_uid_is_not_handed_out_again_at_once() {
    require_bwrap();
    let daemon = TestDaemon::start(Options { profiles: vec![none_profile()], ..Options::default() }).await;
    let mut uids = Vec::new();
    for _ in 0..4 {
        let events = daemon.execute(request("test.none", "true")).await;
        let uid = host_uid(&events);
        assert_eq!(finished(&events).state, pb::ExecutionState::Succeeded as i32);
        uids.push(uid);
        // Nothing of it is left, not even a zombie: without rotation the
        // lowest free uid would be this one again.
        for _ in 0..200 {
            if !corral::sandbox::host::uid_may_have_processes(uid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(!corral::sandbox::host::uid_may_have_processes(uid), "uid {uid} still has tasks");
    }
    let mut distinct = uids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "runs one after another got uids {uids:?}: a released uid went out again at once");
    daemon.stop().await;
}

/// A session keyring of its own: a `none` sandbox started from the daemon
/// would otherwise possess the daemon's (root's) session keyring, write a
/// key into it, and the next sandbox (another uid, the same inherited
/// keyring) would read it.
///
/// The daemon here gets a session keyring of its own first, as a systemd
/// service does (`KeyringMode=private`): a process without one resolves
/// "session" to its uid's user-session keyring, which hides the leak.
#[test]
fn a_none_sandbox_cannot_pass_a_key_through_the_daemons_session_keyring() {
    require_bwrap();
    // SAFETY: keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL): a new anonymous session keyring.
    let joined = unsafe { libc::syscall(libc::SYS_keyctl, 1 as libc::c_long, std::ptr::null::<libc::c_char>()) };
    assert!(joined > 0, "join a session keyring: {}", std::io::Error::last_os_error());
    // Built after the join, so every worker thread (which spawns the
    // sandboxes) carries that keyring.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(session_keyring_attack());
}

async fn session_keyring_attack() {
    let daemon = TestDaemon::start(Options { profiles: vec![none_profile()], ..Options::default() }).await;
    let marker = format!("corral-session-{}", std::process::id());
    let keyctl = |body: &str| {
        format!(
            "python3 - <<'EOF'\nimport ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n\
             libc.syscall.restype = ctypes.c_long\nx86 = os.uname().machine == 'x86_64'\n{body}\nEOF"
        )
    };
    let add = keyctl(&format!(
        "r = libc.syscall(ctypes.c_long(248 if x86 else 217), b'user', b'{marker}', b'secret', ctypes.c_size_t(6), \
         ctypes.c_long(-3))\nprint('ADDED' if r >= 0 else 'REFUSED', os.strerror(ctypes.get_errno()))"
    ));
    let search = keyctl(&format!(
        "r = libc.syscall(ctypes.c_long(250 if x86 else 219), ctypes.c_long(10), ctypes.c_long(-3), b'user', \
         b'{marker}', ctypes.c_long(0))\nprint('FOUND' if r >= 0 else 'ABSENT', os.strerror(ctypes.get_errno()))"
    ));
    let first = finished(&daemon.execute(request("test.none", &add)).await);
    assert!(first.tool_output.contains("ADDED"), "{} {}", first.tool_output, first.tool_error);
    let second = finished(&daemon.execute(request("test.none", &search)).await);
    assert!(second.tool_output.contains("ABSENT"), "the next sandbox read the key: {}", second.tool_output);
    daemon.stop().await;
}

/// An unprivileged daemon refuses a `none` sandbox with the reason: its
/// harness would run as the daemon's own uid, with no namespace between
/// them, so it could read the daemon's admin token and be the local admin
/// on its socket (here it tries). Nothing of the task runs or is left
/// running (nor is a destroy called a success that could not kill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprivileged_daemon_refuses_a_none_sandbox_whose_harness_would_be_the_daemon() {
    use corral::pb::execution_service_client::ExecutionServiceClient;
    const UID: u32 = 64000;
    let marker = format!("77{}", std::process::id());
    let dir = common::data_tempdir();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::chown(&data, Some(UID), Some(UID)).unwrap();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir(&profiles).unwrap();
    let (name, text) = none_profile();
    let text = format!("{text}memory_bytes = 0\nmax_processes = 0\ncpu_millis = 0\n");
    std::fs::write(profiles.join(name), text).unwrap();
    let wrapper = ["setpriv", "--reuid", "64000", "--regid", "64000", "--clear-groups", "--"];
    let daemon = common::ServeProcess::start_wrapped(&data, &profiles, &[("HOME", "/tmp")], "", &wrapper).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let script = format!("setsid sleep {marker} & cat '{}/admin.token'; echo started", data.display());
    let mut stream = client.execute(request("test.none", &script)).await.expect("execute").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let execution = finished(&events);
    let alive = common::processes_with(&marker);
    daemon.stop().await;
    assert_eq!(alive, 0, "a setsid process of the none sandbox outlived its run: {execution:?}");
    assert_ne!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert!(
        execution.tool_error.contains("as the daemon itself") && execution.tool_error.contains("admin socket"),
        "the refusal names the reason: {}",
        execution.tool_error
    );
    assert!(!execution.tool_output.contains("started"), "the task ran: {execution:?}");
    assert!(!events.iter().any(|e| matches!(e.kind, Some(Kind::Dispatched(_)))), "the task ran");
    // Refused by the gate, before any sandbox exists: the host cannot enforce it.
    let stage = execution.evidence.as_ref().map(|e| e.failure_stage);
    assert_eq!(stage, Some(pb::FailureStage::Gate as i32), "{execution:?}");
}
