//! Two daemons on one host never hand out the same host uid: each root
//! daemon claims its `[sandbox] uids` range host-wide for its life, and a
//! second daemon whose range overlaps a live one refuses to start, naming
//! both. A daemon killed with SIGKILL leaves no claim behind.

mod common;

use std::path::Path;

use common::{data_tempdir, unique_uids, Options, ServeProcess, TestDaemon};
use corral::config::Config;
use corral::daemon::{default_reins, Daemon};
use corral::sandbox::Backends;

/// Builds a daemon with `uids` in a fresh data directory under `dir`; the
/// error text when it refuses.
async fn build(dir: &Path, uids: &str) -> Result<Daemon, String> {
    let mut config = Config { data_dir: dir.join("data"), ..Config::default() };
    config.sandbox.uids = uids.to_string();
    Daemon::build(config, Backends::host_default(), default_reins()).await.map_err(|e| e.to_string())
}

fn range(text: &str) -> (u32, u32) {
    let (a, b) = text.split_once('-').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_with_the_same_or_an_overlapping_range_refuses_to_start() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "uid ranges are claimed by root daemons; run as root");
    // Every range below lies in one block of 256 uids that no other daemon
    // of this or another test process uses.
    let (base, _) = range(&unique_uids());
    let sub = |a: u32, b: u32| format!("{}-{}", base + a, base + b);
    let uids = sub(64, 127);
    let set = uids.clone();
    let live =
        TestDaemon::start(Options { config: Box::new(move |c| c.sandbox.uids = set), ..Options::default() }).await;
    let live_dir = live.data_dir();

    let other = data_tempdir();
    for attempt in [uids.clone(), sub(100, 150), sub(10, 64), sub(127, 127)] {
        let err = match build(other.path(), &attempt).await {
            Ok(_) => panic!("a daemon with uids {attempt} started beside a live one with {uids}"),
            Err(err) => err,
        };
        assert!(err.contains(&format!("sandbox uids {attempt}")), "{err}");
        assert!(err.contains(&format!("overlap uids {uids}")), "{err}");
        assert!(err.contains(&live_dir.display().to_string()), "names the live daemon's data directory: {err}");
        assert!(err.contains(&other.path().join("data").display().to_string()), "names its own: {err}");
        assert!(err.contains(&format!("pid {}", std::process::id())), "names the live daemon's pid: {err}");
    }
    // A disjoint range starts beside it.
    let beside = build(other.path(), &sub(128, 191)).await.expect("a disjoint range starts");
    drop(beside);
    live.stop().await;
    // Once the first has stopped, its range is free.
    let after = build(data_tempdir().path(), &uids).await.expect("the range is free once its daemon stopped");
    drop(after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_with_sigkill_leaves_no_claim_behind() {
    let dir = data_tempdir();
    let data = dir.path().join("data");
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let mut serving = ServeProcess::start(&data, &profiles, &[]).await;
    let uids = serving.uids.clone();
    let pid = serving.pid();
    let err = build(data_tempdir().path(), &uids).await.err().expect("refused while the binary runs");
    assert!(err.contains(&format!("pid {pid}")) && err.contains(&data.display().to_string()), "{err}");
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    serving.child.wait().await.unwrap();
    let lock = Path::new("/run/corral").join(format!("uids-{uids}.lock"));
    assert!(lock.exists(), "the killed daemon's claim file is still there (stale), {}", lock.display());
    let next = build(data_tempdir().path(), &uids).await.expect("a stale claim does not block a new daemon");
    drop(next);
}
