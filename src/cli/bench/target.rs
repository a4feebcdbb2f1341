//! The daemon a bench runs against: one started in this process with a
//! fresh data directory, called on its unix socket (no address given), or a
//! running one named by `--server` / `CORRAL_SERVER`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::system;
use crate::cli::Remote;
use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

/// A connection to the bench's daemon, with the caller's bearer token (if
/// any) on every call.
pub type Channel = crate::cli::Conn;
use crate::config::Config;
use crate::daemon::{default_reins, Daemon};
use crate::sandbox::Backends;

/// The fake agent of the test suite, shipped inside the binary so that
/// `corral bench` needs no checkout.
const FAKE_AGENT: &str = include_str!("../../../tests/fixtures/fake_agent.py");

/// The profile the in-process daemon gets for `fanout` and `ingest`.
pub const FAKE_AGENT_PROFILE: &str = "bench.fake-agent@1.0.0";

/// The file whose appearance in the workspace lets an emitting harness
/// start, so every watcher is subscribed before the first progress event.
pub const GO_FILE: &str = ".corral-bench-go";

/// A shell loop that waits (at most 120 s) for [`GO_FILE`].
pub fn barrier_script() -> String {
    format!(
        "n=0; while [ ! -e {ws}/{GO_FILE} ] && [ $n -lt 12000 ]; do sleep 0.01; n=$((n+1)); done",
        ws = crate::sandbox::WORKSPACE_MOUNT
    )
}

pub enum Mode {
    InProcess { shutdown: CancellationToken, handle: tokio::task::JoinHandle<anyhow::Result<()>> },
    Server,
}

pub struct Target {
    pub url: String,
    /// How to reach it: its address, the token and the TLS material.
    remote: Remote,
    pub mode: Mode,
    /// The daemon's data directory, when this process knows it.
    pub data_dir: Option<PathBuf>,
    /// Scratch space for the floor's workspaces and the standalone emitter.
    pub scratch: PathBuf,
    /// The daemon's pid, when it runs on this host and is ours to read.
    pub daemon_pid: Option<u32>,
    /// The fake agent, written out for the standalone emitter measurement.
    pub fake_agent: PathBuf,
    /// Removed when the target stops (a directory this bench created).
    remove: Option<PathBuf>,
    /// The daemon's engine, when it runs in this process.
    engine: Option<std::sync::Arc<crate::lifecycle::Engine>>,
    /// Set once [`Target::settle`] waited in vain for a warm sandbox's
    /// waiter (a host whose `/proc/<pid>/wchan` names no function): later
    /// samples are reported unsettled at once instead of each waiting out
    /// the deadline.
    waiters_unseen: std::sync::atomic::AtomicBool,
}

/// Whether `pid` runs `waiter` (the program the daemon starts as a warm
/// sandbox's first process) and sleeps reading a pipe (its request,
/// on stdin).
fn blocked_waiter(pid: i32, waiter: Option<&Path>) -> bool {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    exe.is_some() && exe.as_deref() == waiter && wchan.ends_with("pipe_read")
}

impl Target {
    pub fn in_process_mode(&self) -> bool {
        matches!(self.mode, Mode::InProcess { .. })
    }

    /// Whether the daemon runs on this host: in this process, behind a
    /// unix socket, or on a loopback address.
    pub fn on_this_host(&self) -> bool {
        self.in_process_mode() || self.url.starts_with("unix://") || loopback_port(&self.url).is_some()
    }

    /// The roots of the warm sandboxes waiting in the in-process daemon's
    /// pools; `None` for a daemon elsewhere.
    pub fn warm_roots(&self) -> Option<Vec<PathBuf>> {
        self.engine.as_ref().map(|e| e.warm_roots())
    }

    /// Starts a daemon in this process: built-in profiles plus the bench's
    /// fake-agent profile, data under `root` (a temporary directory when
    /// `None`, removed at the end).
    pub async fn in_process(root: Option<&Path>) -> anyhow::Result<Target> {
        Target::in_process_with(root, |_| {}).await
    }

    /// [`Target::in_process`] with `configure` applied to its config last
    /// (the `fleet` scenario's nodes: a shared store, a name, a capacity).
    pub async fn in_process_with(root: Option<&Path>, configure: impl FnOnce(&mut Config)) -> anyhow::Result<Target> {
        let (root, remove) = match root {
            Some(root) => (root.to_path_buf(), None),
            None => {
                let dir = std::env::temp_dir().join(format!("corral-bench-{}", uuid::Uuid::now_v7()));
                (dir.clone(), Some(dir))
            }
        };
        let profiles = root.join("profiles");
        let harness = root.join("harness");
        for dir in [&profiles, &harness] {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let fake_agent = harness.join("fake_agent.py");
        std::fs::write(&fake_agent, FAKE_AGENT)?;
        std::fs::write(profiles.join("bench-fake-agent.toml"), fake_agent_profile(&harness, &fake_agent))?;
        let mut config = Config {
            data_dir: root.join("data"),
            profile_dirs: vec![profiles],
            shutdown_grace_seconds: 5,
            ..Config::default()
        };
        // Every daemon on a host needs its own sandbox uids: benches (and
        // their tests) may run several in-process daemons side by side.
        config.sandbox.uids = bench_uids();
        // The fanout scenario's widest level follows one execution with
        // 10,000 watchers.
        config.grpc.max_watchers_per_subject = config.grpc.max_watchers_per_subject.max(16_384);
        config.grpc.max_watchers = config.grpc.max_watchers.max(20_000);
        configure(&mut config);
        let data_dir = config.data_dir.clone();
        let daemon = Daemon::build(config, Backends::host_default(), default_reins())
            .await
            .context("cannot start the in-process daemon")?;
        let engine = Some(daemon.engine.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        // The bench talks to its own daemon over the daemon's unix socket,
        // as the local administrator (its uid is the daemon's).
        let url = format!("unix://{}", data_dir.join("corral.sock").display());
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move { daemon.serve(listener, token).await.map_err(anyhow::Error::from) });
        let scratch = root.join("scratch");
        std::fs::create_dir_all(&scratch)?;
        Ok(Target {
            remote: Remote { url: url.clone(), token: None, tls: Default::default() },
            url,
            mode: Mode::InProcess { shutdown, handle },
            data_dir: Some(data_dir),
            scratch,
            daemon_pid: Some(std::process::id()),
            fake_agent,
            remove,
            engine,
            waiters_unseen: Default::default(),
        })
    }

    /// Waits (up to 10 s) until the in-process daemon is quiet: every
    /// sandbox a run stopped given back, every warm pool full, and every
    /// warm sandbox's waiter started and blocked on its request (not still
    /// being started: bwrap sets up and the waiter starts after the
    /// sandbox is in its pool). A timed sample then pays for no earlier
    /// run's background work. `false` when it cannot know (a `--server`
    /// daemon, a warm sandbox without a cgroup) or did not get quiet in
    /// time.
    pub async fn settle(&self) -> bool {
        let Some(engine) = &self.engine else { return false };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        if tokio::time::timeout_at(deadline, engine.reclaimed()).await.is_err() {
            return false;
        }
        while !engine.warm_levels().iter().all(|(_, waiting, size)| waiting == size) {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let waiter = engine.waiter_program();
        let waiter = waiter.as_deref();
        let unseen = &self.waiters_unseen;
        loop {
            let sandboxes = engine.warm_processes();
            if sandboxes.iter().any(Vec::is_empty) {
                return false;
            }
            if sandboxes.iter().all(|pids| pids.iter().any(|pid| blocked_waiter(*pid, waiter))) {
                return true;
            }
            if unseen.load(std::sync::atomic::Ordering::Relaxed) {
                return false;
            }
            if tokio::time::Instant::now() >= deadline {
                unseen.store(true, std::sync::atomic::Ordering::Relaxed);
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A daemon that runs already, called with `remote`'s token and TLS
    /// material (`CORRAL_TOKEN`, `--token-file`, `--ca`...). Its pid (for RSS
    /// and zombies) is found when it listens on a loopback port of this host.
    pub async fn server(remote: &Remote) -> anyhow::Result<Target> {
        let url = remote.url.as_str();
        let root = std::env::temp_dir().join(format!("corral-bench-{}", uuid::Uuid::now_v7()));
        let scratch = root.join("scratch");
        std::fs::create_dir_all(&scratch).with_context(|| format!("cannot create {}", scratch.display()))?;
        let fake_agent = root.join("fake_agent.py");
        std::fs::write(&fake_agent, FAKE_AGENT)?;
        let daemon_pid = match url.strip_prefix("unix://") {
            Some(path) => system::unix_listener_pid(std::path::Path::new(path)),
            None => loopback_port(url).and_then(system::listener_pid),
        };
        Ok(Target {
            url: url.to_string(),
            remote: remote.clone(),
            mode: Mode::Server,
            data_dir: None,
            scratch,
            daemon_pid,
            fake_agent,
            remove: Some(root),
            engine: None,
            waiters_unseen: Default::default(),
        })
    }

    /// A new connection (HTTP/2 channel) to the daemon: its unix socket
    /// (`unix://…`, where the peer uid is the credential), or a TCP address
    /// (with the token, when one was given).
    pub async fn connect(&self) -> anyhow::Result<Channel> {
        let mut last = None;
        for _ in 0..50 {
            match self.remote.open().await {
                Ok(channel) => return Ok(channel),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(last.expect("tried"))
    }

    /// The daemon's resident memory in KiB (in-process: the whole bench
    /// process, client included).
    pub fn daemon_rss_kib(&self) -> Option<u64> {
        self.daemon_pid.and_then(system::rss_kib)
    }

    /// Bytes the daemon's SQLite store uses (pages in use × page size, the
    /// write-ahead log included), when this process knows its data
    /// directory.
    pub async fn store_bytes(&self) -> Option<u64> {
        use sqlx::{Connection as _, Row as _};
        let db = self.data_dir.as_ref()?.join("corral.db");
        let url = format!("sqlite://{}?mode=ro", db.display());
        let mut conn = sqlx::AnyConnection::connect(&url).await.ok()?;
        let mut pragma = async |name: &str| -> Option<i64> {
            sqlx::query(&format!("PRAGMA {name}")).fetch_one(&mut conn).await.ok()?.try_get(0).ok()
        };
        let (pages, free, size) =
            (pragma("page_count").await?, pragma("freelist_count").await?, pragma("page_size").await?);
        Some(((pages - free) * size) as u64)
    }

    /// Whether the daemon's store lists no execution yet.
    pub async fn is_fresh(&self) -> bool {
        let Ok(channel) = self.connect().await else { return false };
        let mut client = crate::pb::execution_service_client::ExecutionServiceClient::new(channel);
        let request = crate::pb::ListExecutionsRequest { page_size: 1, ..Default::default() };
        client.list_executions(request).await.map(|r| r.into_inner().executions.is_empty()).unwrap_or(false)
    }

    /// The sandboxes directory, when this process knows the data directory.
    pub fn sandboxes_dir(&self) -> Option<PathBuf> {
        self.data_dir.as_ref().map(|d| d.join("sandboxes"))
    }

    /// Stops an in-process daemon and removes what this bench created.
    pub async fn stop(self) -> anyhow::Result<()> {
        if let Mode::InProcess { shutdown, handle } = self.mode {
            shutdown.cancel();
            handle.await.context("in-process daemon panicked")??;
        }
        if let Some(dir) = self.remove {
            let _ = tokio::fs::remove_dir_all(&dir).await;
        }
        Ok(())
    }
}

/// The port of a `http://127.0.0.1:PORT`-like URL on this host.
fn loopback_port(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let local = matches!(host, "127.0.0.1" | "localhost" | "::1" | "0.0.0.0" | "::");
    local.then(|| port.parse().ok()).flatten()
}

/// The fake agent behind the start barrier, in a bwrap sandbox without
/// network; generous limits so 100,000 events fit.
fn fake_agent_profile(harness_dir: &Path, fake_agent: &Path) -> String {
    let quote = |s: &str| serde_json::to_string(s).expect("a string serialises");
    let script = format!("{}; exec /usr/bin/python3 {}", barrier_script(), fake_agent.display());
    let (id, version) = FAKE_AGENT_PROFILE.split_once('@').expect("a pinned ref");
    format!(
        r#"id = "{id}"
version = "{version}"
description = "The test suite's fake agent behind a start barrier, for `corral bench fanout` and `ingest`."
[rein]
argv = ["/bin/sh", "-c", {script}]
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
read_paths = [{dir}]
[limits]
timeout_seconds = 600
max_output_bytes = 67108864
"#,
        script = quote(&script),
        dir = quote(&harness_dir.to_string_lossy()),
    )
}

/// A range of 256 sandbox uids for one in-process bench daemon (throughput
/// runs 64 at once, and a uid whose last processes are still exiting is
/// skipped), away from the default range and from other bench processes'
/// ranges.
fn bench_uids() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // 64 per process: a bench (or its smoke tests, several at once) starts
    // a fresh daemon per scenario, and the fleet scenario two at a time.
    let slot = (std::process::id() % 1000) * 64 + NEXT.fetch_add(1, Ordering::SeqCst) % 64;
    let first = 600_000 + slot * 256;
    format!("{first}-{}", first + 255)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_ports() {
        assert_eq!(loopback_port("http://127.0.0.1:50051"), Some(50051));
        assert_eq!(loopback_port("http://localhost:7/"), Some(7));
        assert_eq!(loopback_port("http://[::1]:9"), Some(9));
        assert_eq!(loopback_port("http://example.com:50051"), None);
    }

    /// The predicate a settled warm sample waits for, on real processes:
    /// the program reading its stdin pipe is a blocked waiter; the same
    /// program under another path, or a process asleep elsewhere, is not.
    #[test]
    fn a_blocked_waiter_is_its_program_asleep_in_a_pipe_read() {
        use std::process::{Command, Stdio};
        let (cat, sleep) = (Path::new("/usr/bin/cat"), Path::new("/usr/bin/sleep"));
        let mut reader = Command::new(cat).stdin(Stdio::piped()).stdout(Stdio::null()).spawn().expect("cat");
        let mut sleeper = Command::new(sleep).arg("30").stdin(Stdio::piped()).spawn().expect("sleep");
        let (r, z) = (reader.id() as i32, sleeper.id() as i32);
        let blocked = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            blocked_waiter(r, Some(cat))
        });
        assert!(blocked, "cat never seen blocked on its stdin");
        assert!(!blocked_waiter(r, Some(sleep)), "another program");
        assert!(!blocked_waiter(r, None), "no waiter program known");
        assert!(!blocked_waiter(z, Some(sleep)), "asleep, but not in a pipe read");
        let _ = (reader.kill(), sleeper.kill(), reader.wait(), sleeper.wait());
        assert!(!blocked_waiter(r, Some(cat)), "reaped: no such process");
    }

    #[test]
    fn the_fake_agent_profile_parses() {
        let text = fake_agent_profile(Path::new("/x/harness"), Path::new("/x/harness/fake_agent.py"));
        let profile: crate::catalog::ProfileFile = toml::from_str(&text).expect("valid profile");
        assert_eq!(profile.rein.argv[0], "/bin/sh");
        assert!(profile.rein.argv[2].ends_with("exec /usr/bin/python3 /x/harness/fake_agent.py"));
        assert_eq!(profile.sandbox.read_paths, vec!["/x/harness".to_string()]);
    }
}
