//! Recovery does not trust the store: rows forged into a stopped daemon's
//! `sandboxes` table must not make the restarted (root) daemon delete a
//! directory outside its own `sandboxes/`, signal a process of a uid
//! outside its range. A genuine leftover in the same store is still
//! destroyed, and so are rows of another node name or of none: a SQLite
//! store is a fleet of one, whose other names are the daemon's own earlier
//! ones.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::ServeProcess;

const NODE: &str = "node-recovery-test";

async fn stop(daemon: ServeProcess) {
    assert!(daemon.stop().await.is_some(), "corral serve did not exit within 30 s of SIGTERM");
}

/// A `sleep` running as `uid` that carries `CORRAL_SANDBOX_ID=<id>`.
fn sleeper(uid: u32, id: &str) -> std::process::Child {
    std::process::Command::new("/bin/sleep")
        .arg("300")
        .env("CORRAL_SANDBOX_ID", id)
        .uid(uid)
        .gid(uid)
        .spawn()
        .expect("sleep starts as another uid (this test runs as root)")
}

fn alive(child: &mut std::process::Child) -> bool {
    matches!(child.try_wait(), Ok(None))
}

/// The first uid of the range the test config gave this daemon.
fn first_uid(data: &Path) -> u32 {
    let config = std::fs::read_to_string(data.with_extension("toml")).unwrap();
    let line = config.lines().find_map(|l| l.strip_prefix("uids = ")).expect("uids line");
    line.trim_matches('"').split('-').next().unwrap().parse().unwrap()
}

async fn insert(pool: &sqlx::SqlitePool, id: &str, root: &Path, node: Option<&str>, uid: Option<u32>) {
    sqlx::query(
        "INSERT INTO sandboxes (sandbox_id, subject_id, backend, state, root_path, instance_epoch, created_at_ms, updated_at_ms, node)
         VALUES ($1, $2, 'linux_bwrap', 'ready', $3, 'an-old-epoch', 1, 1, $4)",
    )
    .bind(id)
    .bind(format!("subject-{id}"))
    .bind(root.display().to_string())
    .bind(node)
    .execute(pool)
    .await
    .unwrap();
    if let Some(uid) = uid {
        sqlx::query("INSERT INTO sandbox_uids (node, uid, sandbox_id) VALUES ($1, $2, $3)")
            .bind(node.unwrap_or(NODE))
            .bind(uid as i64)
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
    }
}

fn dir_with_file(path: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(path).unwrap();
    std::fs::write(path.join("precious"), "keep me").unwrap();
    path.to_path_buf()
}

fn new_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_sandbox_rows_delete_nothing_and_kill_nothing_and_a_genuine_one_is_recovered() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test needs root: the daemon must run sandboxes as their own uids");
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let node_config = format!("node_id = {NODE:?}");
    stop(ServeProcess::start_with(&data, &profiles, &[], &node_config).await).await;
    let sandboxes = data.join("sandboxes");
    // A restart keeps the data directory's range (checked after it).
    let first = first_uid(&data);
    let outside = tempfile::tempdir().unwrap();

    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", data.join("corral.db").display())).await.unwrap();
    // A: a plain id, but the recorded path is somewhere else entirely.
    let a_dir = dir_with_file(&outside.path().join("victim"));
    insert(&pool, &new_id(), &a_dir, Some(NODE), None).await;
    // B: an id that is a path: "derived" from it, it would leave sandboxes/.
    let b_dir = dir_with_file(&data.join("escaped"));
    insert(&pool, "../escaped", &sandboxes.join("../escaped"), Some(NODE), None).await;
    // C: a proper row whose uid is 4343, outside the range; a process of
    // that uid carries its id.
    let c_id = new_id();
    let c_dir = dir_with_file(&sandboxes.join(&c_id));
    insert(&pool, &c_id, &c_dir, Some(NODE), Some(4343)).await;
    let mut c_process = sleeper(4343, &c_id);
    // D: a proper row without a uid, but a process of uid 4344 carries its
    // id: the directory goes, the process is not signalled.
    let d_id = new_id();
    let d_dir = dir_with_file(&sandboxes.join(&d_id));
    insert(&pool, &d_id, &d_dir, Some(NODE), None).await;
    let mut d_process = sleeper(4344, &d_id);
    // E, F: rows of another node name and of no node: on SQLite this
    // daemon's own under an earlier name, recovered (still checked).
    let e_id = new_id();
    let e_dir = dir_with_file(&sandboxes.join(&e_id));
    insert(&pool, &e_id, &e_dir, Some("another-node"), None).await;
    let f_id = new_id();
    let f_dir = dir_with_file(&sandboxes.join(&f_id));
    insert(&pool, &f_id, &f_dir, None, None).await;
    // G, the control: a genuine leftover with its own uid and process.
    let g_id = new_id();
    let g_dir = dir_with_file(&sandboxes.join(&g_id));
    insert(&pool, &g_id, &g_dir, Some(NODE), Some(first)).await;
    let mut g_process = sleeper(first, &g_id);
    pool.close().await;

    let daemon = ServeProcess::start_with(&data, &profiles, &[], &node_config).await;
    assert_eq!(first_uid(&data), first, "the genuine row's uid is the restarted daemon's first");
    // Recovery runs before the daemon listens; give a killed process a moment to be reaped.
    let start = Instant::now();
    while alive(&mut g_process) && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c_alive = alive(&mut c_process);
    let d_alive = alive(&mut d_process);
    let g_alive = alive(&mut g_process);
    for child in [&mut c_process, &mut d_process, &mut g_process] {
        let _ = child.kill();
        let _ = child.wait();
    }
    stop(daemon).await;
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap();

    assert!(a_dir.join("precious").exists(), "a recorded path outside sandboxes/ is never removed");
    assert!(b_dir.join("precious").exists(), "an id that is a path is never followed");
    assert!(c_dir.join("precious").exists(), "a row with a uid outside the range is left alone");
    assert!(c_alive, "a process of uid 4343 is never signalled");
    assert!(d_alive, "a process outside the range is not signalled even if it carries a sandbox id");
    assert!(!d_dir.exists(), "the proper row without a uid is destroyed");
    assert!(!e_dir.exists() && !f_dir.exists(), "another name's rows in its own SQLite store are its own");
    assert!(!g_alive, "the genuine leftover's process is killed");
    assert!(!g_dir.exists(), "the genuine leftover's directory is removed");

    for expected in [
        format!("is not {}", sandboxes.join("").display()),
        "sandbox id \"../escaped\" is not an id this daemon makes".to_string(),
        "recorded uid 4343 is outside this daemon's sandbox uid range".to_string(),
        "recovery does not signal a process whose uid is outside".to_string(),
        "recovery takes over what other node names left in this data directory's SQLite store".to_string(),
        "names=[\"\", \"another-node\"]".to_string(),
    ] {
        assert!(log.contains(&expected), "the log says {expected:?}:\n{log}");
    }
    assert!(log.contains(&a_dir.display().to_string()), "the refusal names the recorded path:\n{log}");
}
