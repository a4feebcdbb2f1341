//! How a sandbox's first process starts (`spawn_group`, a vfork-style
//! clone). The descriptors a spawn passes arrive at 3, 4, … in order,
//! whatever numbers they had in the daemon, even 3 and 4 themselves in the
//! other order: that test runs itself again as a fresh process, where 3 and
//! 4 are free, so the files it passes are created at exactly those numbers.
//! The process starts with no signal blocked and SIGPIPE not ignored,
//! though the daemon blocks every signal across the clone; a failed exec is
//! an error with its errno; a process dropped unreaped is killed and reaped;
//! a daemon started with its stdin closed still hands its child a stdin (and a
//! file passed from fd 0 arrives at 3); a
//! spawn under way holds none of the daemon's files (its data directory's
//! lock).

use std::os::fd::AsRawFd;

use corral::sandbox::process::{data_fd, spawn_group, SandboxProcess, SpawnOptions};
use corral::sandbox::SandboxError;

const NAME: &str = "passed_descriptors_arrive_in_order_even_from_the_target_numbers";

#[test]
fn passed_descriptors_arrive_in_order_even_from_the_target_numbers() {
    if std::env::var_os("CORRAL_SPAWN_FDS_CHILD").is_some() {
        return child();
    }
    let stdout = run_again(NAME, "CORRAL_SPAWN_FDS_CHILD");
    assert!(stdout.contains("passed: [first|second]"), "fd 3 gets the first passed file, fd 4 the second: {stdout}");
}

/// Runs the test `name` again in a fresh process with `env` set, and
/// returns what it printed once it passed.
fn run_again(name: &str, env: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn child() {
    // The lowest free numbers: 3 for the second passed file, 4 for the first.
    let second = data_fd("second", b"second").unwrap();
    let first = data_fd("first", b"first").unwrap();
    assert_eq!((second.as_raw_fd(), first.as_raw_fd()), (3, 4), "a fresh process has 3 and 4 free");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let output = runtime.block_on(async move {
        let options = SpawnOptions { pass_fds: vec![first, second], ..SpawnOptions::default() };
        let args = vec!["-c".into(), "printf '[%s|%s]' \"$(cat <&3)\" \"$(cat <&4)\"".into()];
        let mut process =
            spawn_group(std::path::Path::new("/bin/sh"), &args, &[], std::path::Path::new("/"), options).unwrap();
        drop(process.stdin.take());
        let mut out = String::new();
        use tokio::io::AsyncReadExt;
        process.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
        process.wait().await.unwrap();
        out
    });
    println!("passed: {output}");
}

/// `program args`, spawned with no environment, in `/`, with default options.
fn spawn(program: &str, args: &[&str]) -> Result<SandboxProcess, SandboxError> {
    let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    spawn_group(std::path::Path::new(program), &args, &[], std::path::Path::new("/"), SpawnOptions::default())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A field of `/proc/self/status` as the spawned process saw it.
fn status_field(status: &str, name: &str) -> u64 {
    let line = status.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in {status}"));
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

#[test]
fn a_spawned_process_starts_with_no_signal_blocked_nor_sigpipe_ignored() {
    let status = runtime().block_on(async {
        // Handlers of the daemon's own, as a running daemon has them.
        let _term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        // cat itself, not a shell (which sets its own mask).
        let mut process = spawn("/bin/cat", &["/proc/self/status"]).unwrap();
        drop(process.stdin.take());
        let mut out = String::new();
        use tokio::io::AsyncReadExt;
        process.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
        assert!(process.wait().await.unwrap().success());
        out
    });
    assert_eq!(status_field(&status, "SigBlk:"), 0, "no signal blocked: {status}");
    let sigpipe = 1u64 << (libc::SIGPIPE - 1);
    assert_eq!(status_field(&status, "SigIgn:") & sigpipe, 0, "SIGPIPE at its default: {status}");
    assert_eq!(status_field(&status, "NoNewPrivs:"), 1, "{status}");
}

#[test]
fn a_failed_exec_is_an_error_naming_the_program_and_its_errno() {
    let error = runtime().block_on(async { spawn("/nonexistent/harness", &[]).unwrap_err() });
    let error = error.to_string();
    assert!(error.contains("/nonexistent/harness") && error.contains("No such file"), "{error}");
}

#[test]
fn a_process_dropped_before_it_is_reaped_is_killed_and_leaves_no_zombie() {
    let runtime = runtime();
    let pid = runtime.block_on(async {
        let process = spawn("/bin/sleep", &["1000"]).unwrap();
        let pid = process.pgid();
        drop(process);
        for _ in 0..200 {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        pid
    });
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "pid {pid} is still there (alive or a zombie)");
}

const STDIN_CLOSED: &str = "a_daemon_with_its_stdin_closed_still_gives_the_child_a_stdin";

#[test]
fn a_daemon_with_its_stdin_closed_still_gives_the_child_a_stdin() {
    if std::env::var_os("CORRAL_SPAWN_STDIN_CLOSED").is_some() {
        let echoed = runtime().block_on(async {
            // SAFETY: closes this process's fd 0, which nothing here reads;
            // the passed file takes it.
            unsafe { libc::close(0) };
            let passed = data_fd("passed", b"passed").unwrap();
            assert_eq!(passed.as_raw_fd(), 0);
            let options = SpawnOptions { pass_fds: vec![passed], ..SpawnOptions::default() };
            let args: Vec<std::ffi::OsString> =
                ["-c", "read line; echo got:$line; cat <&3"].iter().map(Into::into).collect();
            let mut process =
                spawn_group(std::path::Path::new("/bin/sh"), &args, &[], std::path::Path::new("/"), options).unwrap();
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stdin = process.stdin.take().unwrap();
            stdin.write_all(b"hello\n").await.unwrap();
            drop(stdin);
            let mut out = String::new();
            process.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
            process.wait().await.unwrap();
            out
        });
        println!("child said {echoed}");
        return;
    }
    let stdout = run_again(STDIN_CLOSED, "CORRAL_SPAWN_STDIN_CLOSED");
    assert!(stdout.contains("child said got:hello\npassed"), "{stdout}");
}

/// The descriptors `/proc/<pid>/fd` of `pid` points at.
fn open_files(pid: i32) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    entries.flatten().filter_map(|e| std::fs::read_link(e.path()).ok()).collect()
}

/// This process's children (the spawn's clone), from `/proc`.
fn children() -> Vec<i32> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status.lines().any(|l| l.strip_prefix("PPid:").is_some_and(|p| p.trim() == me))
        })
        .collect()
}

/// A spawn still on its way to `execve` when the daemon dies holds none of
/// the daemon's files: a daemon SIGKILLed while its pool was refilling was
/// restarted at once, and found its data directory "in use by a running
/// daemon": the clone, blocked writing a cgroup's `cgroup.procs`, held its
/// copy of the lock. Here the clone is held at that write (a full pipe in
/// place of `cgroup.procs`) while the lock's holder lets it go: another
/// open of the file must then take it.
#[test]
fn a_spawn_under_way_holds_none_of_the_daemons_files() {
    use std::os::fd::FromRawFd;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("daemon.lock");
    let flock = |file: &std::fs::File| {
        // SAFETY: flock on an open descriptor.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    };
    let lock = std::fs::File::create(&path).unwrap();
    assert!(flock(&lock));

    // A pipe filled up: the child's write of "0" to it blocks.
    let mut fds = [0; 2];
    // SAFETY: pipe2 and fcntl on descriptors this test owns.
    let (read, write) = unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK), 0);
        (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1]))
    };
    use std::io::Write;
    while (&write).write(&[0u8; 4096]).is_ok() {}
    // SAFETY: as above.
    unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETFL, 0) };

    let pipe = std::fs::read_link(format!("/proc/self/fd/{}", write.as_raw_fd())).unwrap();

    let runtime = runtime();
    let handle = runtime.handle().clone();
    let spawn = std::thread::spawn(move || {
        let _entered = handle.enter();
        let options = SpawnOptions { cgroup_procs: vec![write], ..SpawnOptions::default() };
        spawn_group(std::path::Path::new("/bin/true"), &[], &[], std::path::Path::new("/"), options).unwrap()
    });
    // The clone (the child holding the pipe) appears, and lets go of the
    // lock's file before it writes.
    let mut holds = true;
    for _ in 0..500 {
        let clone = children().into_iter().map(open_files).find(|files| files.contains(&pipe));
        if clone.is_some_and(|files| !files.contains(&path)) {
            holds = false;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(lock);
    let again = std::fs::File::open(&path).unwrap();
    let taken = flock(&again);

    // Unblocked, the child goes on to exec.
    let mut sink = [0u8; 65536];
    use std::io::Read;
    let _ = (&read).read(&mut sink);
    let mut process = spawn.join().unwrap();
    assert!(runtime.block_on(process.wait()).unwrap().success());
    assert!(!holds, "the clone still held the lock's file while it waited to write cgroup.procs");
    assert!(taken, "the lock stayed held after its holder let it go");
}
