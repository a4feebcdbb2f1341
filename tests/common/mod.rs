//! Shared helpers for integration tests: a real daemon on 127.0.0.1:0 with
//! a fresh data directory, the generated clients, real git repositories,
//! and fault-injecting wrappers around the real sandbox backend and rein.
#![allow(dead_code)]

pub mod faults;
pub mod model_mock;
pub mod witness;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral::config::Config;
use corral::daemon::{default_reins, Daemon};
use corral::lifecycle::Engine;
use corral::pb;
use corral::pb::catalog_service_client::CatalogServiceClient;
use corral::pb::execution_service_client::ExecutionServiceClient;
use corral::rein::Rein;
use corral::sandbox::Backends;
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The value of the `route.test` credential every test daemon defines.
pub const ROUTE_TEST_VALUE: &str = "route-test-value-5b1e0c";

pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// Fails (never skips) when the host cannot run bubblewrap.
pub fn require_bwrap() {
    let args = ["--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "/usr/bin/true"];
    let ok = std::process::Command::new("bwrap").args(args).status().map(|s| s.success()).unwrap_or(false);
    assert!(ok, "this test needs bubblewrap: install the Debian package `bubblewrap` (the host must allow namespaces)");
}

/// A TOML profile running the fake agent.
pub fn fake_agent_profile(id: &str, extra: &str) -> String {
    format!(
        r#"id = "{id}"
version = "1.0.0"
credential_route_refs = ["route.test"]
[rein]
argv = ["/usr/bin/python3", "{FIXTURES}/fake_agent.py"]
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
read_paths = ["{FIXTURES}"]
[limits]
timeout_seconds = 30
max_output_bytes = 65536
{extra}
"#
    )
}

/// A `linux_bwrap` profile (no network, workspace writable) running the
/// session agent (`fixtures/session_agent.py`), which takes one task line
/// per turn.
pub fn session_agent_profile(id: &str, extra: &str) -> String {
    format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/usr/bin/python3", "{FIXTURES}/session_agent.py"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
read_paths = ["{FIXTURES}"]
[limits]
timeout_seconds = 60
max_output_bytes = 65536
{extra}
"#
    )
}

/// `test.stubborn`: a task_json harness that ignores TERM and never exits
/// by itself.
pub fn stubborn_profile() -> String {
    r#"id = "test.stubborn"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
[limits]
timeout_seconds = 60
"#
    .to_string()
}

/// `message` as a request of the principal holding bearer `token`.
pub fn with_token<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

pub struct Options {
    /// A `postgres://` store to use; by default SQLite, or a fresh
    /// PostgreSQL database when `CORRAL_TEST_POSTGRES` is set.
    pub store_url: Option<String>,
    pub backends: Option<Backends>,
    pub reins: Option<HashMap<String, Arc<dyn Rein>>>,
    pub profiles: Vec<(String, String)>,
    pub config: Box<dyn FnOnce(&mut Config) + Send>,
    /// Where the daemon listens (default: 127.0.0.1:0).
    pub listen: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            store_url: None,
            backends: None,
            reins: None,
            profiles: vec![("fake.toml".into(), fake_agent_profile("test.fake-agent", ""))],
            config: Box::new(|_| {}),
            listen: None,
        }
    }
}

pub struct TestDaemon {
    pub addr: SocketAddr,
    pub url: String,
    pub engine: Arc<Engine>,
    pub data: TempDir,
    shutdown: CancellationToken,
    handle: Option<tokio::task::JoinHandle<()>>,
}

/// A run's sandbox is given back (its uid, cgroup and files) after its
/// `finished`: a test that ends right after would drop that work with its
/// runtime and leave the sandbox's cgroup on the host (seen: one in two
/// runs of `execution_contract` on a loaded host). So a daemon a test drops
/// first waits, up to 10 s, for what its runs stopped to be given back, on a
/// multi-threaded runtime (a current-thread one cannot run that work while
/// blocked here).
impl Drop for TestDaemon {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        let engine = self.engine.clone();
        tokio::task::block_in_place(|| {
            runtime.block_on(async {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(10), engine.reclaimed()).await;
            })
        });
    }
}

impl TestDaemon {
    pub async fn start(options: Options) -> TestDaemon {
        // The daemon's logs, shown for a failing test (RUST_LOG to change).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_test_writer()
            .try_init();
        let data = data_tempdir();
        let profiles = data.path().join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        for (name, text) in &options.profiles {
            std::fs::write(profiles.join(name), text).unwrap();
        }
        let mut config = Config {
            data_dir: data.path().join("data"),
            profile_dirs: vec![profiles],
            shutdown_grace_seconds: 5,
            ..Config::default()
        };
        config.sandbox.uids = unique_uids();
        config.principals = test_principals();
        // The tests' repositories are temporary directories.
        config.repo_roots = vec![std::env::temp_dir()];
        // The daemon runs inside the test binary: the hook helper is the
        // corral binary cargo built.
        config.gate.hook_program = Some(env!("CARGO_BIN_EXE_corral").into());
        // The fake agent's profile names `route.test`.
        let secret = data.path().join("route-test.secret");
        std::fs::write(&secret, ROUTE_TEST_VALUE).unwrap();
        config.credentials.routes.insert(
            "route.test".into(),
            corral::credentials::RouteConfig {
                env: None,
                file: Some(secret),
                inject_as: "ROUTE_TEST_TOKEN".into(),
                expose: true,
                ..Default::default()
            },
        );
        config.store.url = match options.store_url {
            Some(url) => Some(url),
            None => fresh_postgres_database().await,
        };
        (options.config)(&mut config);
        let backends = options.backends.unwrap_or_else(Backends::host_default);
        let reins = options.reins.unwrap_or_else(default_reins);
        let daemon = Daemon::build(config, backends, reins).await.expect("daemon builds");
        let engine = daemon.engine.clone();
        let listen = options.listen.unwrap_or_else(|| "127.0.0.1:0".into());
        let listener = tokio::net::TcpListener::bind(&listen).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = tokio::spawn(async move {
            daemon.serve(listener, token).await.expect("serve");
        });
        TestDaemon { addr, url: format!("http://{addr}"), engine, data, shutdown, handle: Some(handle) }
    }

    /// A channel over the daemon's unix socket: root's peer uid makes the
    /// test the local administrator (TCP needs a bearer token).
    pub async fn channel(&self) -> Channel {
        unix_channel(&self.socket()).await
    }

    pub fn socket(&self) -> PathBuf {
        self.data_dir().join("corral.sock")
    }

    /// The local admin token the daemon wrote into its data directory.
    pub fn admin_token(&self) -> String {
        std::fs::read_to_string(self.data_dir().join("admin.token")).expect("the daemon writes admin.token")
    }

    pub async fn executions(&self) -> ExecutionServiceClient<Channel> {
        ExecutionServiceClient::new(self.channel().await)
    }

    pub async fn catalog(&self) -> CatalogServiceClient<Channel> {
        CatalogServiceClient::new(self.channel().await)
    }

    /// Runs `Execute` and collects the whole stream.
    pub async fn execute(&self, request: pb::ExecuteRequest) -> Vec<pb::LifecycleEvent> {
        execute_all(self.channel().await, request).await
    }

    pub async fn watch_all(&self, execution_id: &str, after: u64) -> Vec<pb::LifecycleEvent> {
        let mut client = self.executions().await;
        let request = pb::WatchRequest { execution_id: execution_id.into(), after_sequence: after };
        let mut stream = client.watch_execution(request).await.expect("watch accepted").into_inner();
        let mut events = Vec::new();
        while let Some(event) = stream.message().await.expect("watch stream ok") {
            events.push(event);
        }
        events
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data.path().join("data")
    }

    /// What is left under the daemon's `sandboxes` directory once every
    /// stopped sandbox has been given back (a run's `finished` does not
    /// wait for that).
    pub async fn leftover_sandboxes(&self) -> Vec<PathBuf> {
        self.engine.reclaimed().await;
        std::fs::read_dir(self.data_dir().join("sandboxes"))
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(handle) = self.handle.take() {
            handle.await.unwrap();
        }
    }
}

/// The bearer tokens of the test daemons' non-admin principals. The unix
/// socket (root's peer uid) is the local admin; a request made as `agt` or
/// `atm` carries one of these (see [`as_actor`]).
pub const TEST_AGT_TOKEN: &str = "test-agt-token-0123456789abcdef0123456789";
pub const TEST_ATM_TOKEN: &str = "test-atm-token-0123456789abcdef0123456789";

pub fn test_principals() -> Vec<corral::auth::PrincipalConfig> {
    use sha2::Digest;
    let principal = |name: &str, kind: &str, token: &str| corral::auth::PrincipalConfig {
        name: name.into(),
        kind: kind.into(),
        projects: ["proj-a", "proj-b", "proj-s", "default", "p"].iter().map(|p| p.to_string()).collect(),
        token_sha256: Some(hex::encode(sha2::Sha256::digest(token.as_bytes()))),
        ..Default::default()
    };
    vec![principal("test-agt", "agt", TEST_AGT_TOKEN), principal("test-atm", "atm", TEST_ATM_TOKEN)]
}

/// `message` as a request of the test principal of type `actor` (`agt`,
/// `atm`); any other actor goes as the local admin of the unix socket.
pub fn as_actor<T>(actor: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let token = match actor {
        "agt" => Some(TEST_AGT_TOKEN),
        "atm" => Some(TEST_ATM_TOKEN),
        _ => None,
    };
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

/// A range of sandbox uids no other daemon uses, in this test process or
/// in another one running at the same time (several suites run side by
/// side on one machine, and every root daemon claims its range host-wide,
/// refusing to start on an overlap). Each process gets its own block of
/// 65536 uids from its pid (pids stay below 32768 here; above, two
/// processes share a block only if their pids differ by a multiple of
/// 32763), and each daemon 256 uids of it.
pub fn unique_uids() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    const PER_DAEMON: u32 = 256;
    const PER_PROCESS: u32 = 1 << 16;
    // 300000 + 32763 * 65536 + 65535 < 2^31.
    const BLOCKS: u32 = 32_763;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    assert!(n < PER_PROCESS / PER_DAEMON, "a test process starts at most 256 daemons");
    let first = 300_000 + (std::process::id() % BLOCKS) * PER_PROCESS + n * PER_DAEMON;
    format!("{first}-{}", first + PER_DAEMON - 1)
}

/// A loopback TCP port free now, for a daemon's configured listener
/// (`metrics_listen`, `listen`), from below the kernel's ephemeral range
/// (32768-60999): a port taken with `:0` and let go is the next test's
/// `:0` to take, and the daemon then found it in use (seen once in CI).
pub fn unused_port() -> u16 {
    let seed = std::process::id() as usize ^ std::time::UNIX_EPOCH.elapsed().unwrap().subsec_nanos() as usize;
    (0..12_000)
        .map(|i| 20_000 + ((seed + i * 7919) % 12_000) as u16)
        .find(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free loopback port in 20000-31999")
}

/// A temporary directory to hold a daemon's data directory: traversable
/// (0711) by the sandboxes' own uids, which must reach their workspaces.
pub fn data_tempdir() -> TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    dir
}

/// A channel over a daemon's unix socket, waiting for it to answer.
pub async fn unix_channel(socket: &Path) -> Channel {
    unix_channel_with(socket, tonic::transport::Endpoint::from_static("http://corral.sock")).await
}

/// The same with `endpoint`'s settings (window sizes and such).
pub async fn unix_channel_with(socket: &Path, endpoint: tonic::transport::Endpoint) -> Channel {
    for _ in 0..100 {
        if let Ok(channel) = corral::cli::connect_endpoint_unix(endpoint.clone(), socket).await {
            return channel;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("daemon at {} does not answer", socket.display());
}

/// With `CORRAL_TEST_STORE=postgres` and `CORRAL_TEST_POSTGRES` (an admin
/// URL, e.g. `postgres://corral:corral@127.0.0.1:5432/postgres`), a new empty
/// database for one test; otherwise `None` (SQLite).
pub async fn fresh_postgres_database() -> Option<String> {
    if std::env::var("CORRAL_TEST_STORE").ok().as_deref() != Some("postgres") {
        return None;
    }
    let admin = std::env::var("CORRAL_TEST_POSTGRES").ok().filter(|u| !u.is_empty());
    let admin = admin.expect("CORRAL_TEST_STORE=postgres needs CORRAL_TEST_POSTGRES (an admin URL)");
    Some(create_postgres_database(&admin).await)
}

/// `CORRAL_TEST_POSTGRES`, the admin URL of the tests' PostgreSQL; a test
/// that needs it fails, never skips, without it.
pub fn postgres_admin_url() -> String {
    std::env::var("CORRAL_TEST_POSTGRES").ok().filter(|u| !u.is_empty()).expect(
        "this test needs PostgreSQL: set CORRAL_TEST_POSTGRES to an admin URL such as \
         postgres://corral:corral@127.0.0.1:5432/postgres (scripts/test sets it up)",
    )
}

/// A new database, `corral_test_<run>_<uuid v7>` under scripts/test (which
/// sets `CORRAL_TEST_RUN` and drops the run's databases when it ends, and
/// leftovers by the uuid's time), `corral_test_<uuid v7>` otherwise.
pub async fn create_postgres_database(admin: &str) -> String {
    use sqlx::Connection;
    let uuid = uuid::Uuid::now_v7().simple();
    let run = std::env::var("CORRAL_TEST_RUN").ok();
    // Lower-case hex, as PostgreSQL folds the unquoted name; short enough
    // for its 63-byte identifiers.
    let lower_hex =
        |r: &String| (1..=16).contains(&r.len()) && r.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let name = match run.filter(lower_hex) {
        Some(run) => format!("corral_test_{run}_{uuid}"),
        None => format!("corral_test_{uuid}"),
    };
    let mut conn = sqlx::PgConnection::connect(admin).await.expect("CORRAL_TEST_POSTGRES answers");
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.expect("create test database");
    let base = admin.rsplit_once('/').map(|(base, _)| base).unwrap_or(admin);
    format!("{base}/{name}")
}

pub fn request(profile: &str, description: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        harness_profile_ref: profile.into(),
        title: "test task".into(),
        description: description.into(),
        // The caller's type: the unix socket's local admin.
        actor: String::new(),
        project: "proj-a".into(),
        ..Default::default()
    }
}

/// The `finished` execution of an event list.
pub fn finished(events: &[pb::LifecycleEvent]) -> pb::Execution {
    match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::Finished(f))
            if matches!(f.record, Some(pb::finished::Record::Execution(_))) =>
        {
            match f.record {
                Some(pb::finished::Record::Execution(e)) => e,
                _ => unreachable!(),
            }
        }
        other => panic!("last event is not finished: {other:?}"),
    }
}

pub fn kinds(events: &[pb::LifecycleEvent]) -> Vec<&'static str> {
    use pb::lifecycle_event::Kind;
    events
        .iter()
        .map(|e| match &e.kind {
            Some(Kind::Accepted(_)) => "accepted",
            Some(Kind::Resolved(_)) => "resolved",
            Some(Kind::Gated(_)) => "gated",
            Some(Kind::SandboxReady(_)) => "sandbox_ready",
            Some(Kind::Dispatched(_)) => "dispatched",
            Some(Kind::Progress(_)) => "progress",
            Some(Kind::OutputTruncated(_)) => "output_truncated",
            Some(Kind::Teardown(_)) => "teardown",
            Some(Kind::Finished(_)) => "finished",
            Some(Kind::HarnessRestarted(_)) => "harness_restarted",
            Some(Kind::TurnFinished(_)) => "turn_finished",
            Some(Kind::Reaped(_)) => "reaped",
            Some(Kind::Recovered(_)) => "recovered",
            Some(Kind::Limit(_)) => "limit",
            Some(Kind::Egress(_)) => "egress",
            Some(Kind::ApprovalRequested(_)) => "approval_requested",
            Some(Kind::ApprovalDecided(_)) => "approval_decided",
            None => "none",
        })
        .collect()
}

pub fn evidence(execution: &pb::Execution) -> pb::Evidence {
    execution.evidence.clone().expect("evidence")
}

/// A git repository with one commit.
pub fn git_repo() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    git(dir.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(dir.path().join("README.md"), "sample\n").unwrap();
    git(dir.path(), &["add", "."]);
    git(dir.path(), &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "init"]);
    dir
}

pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git").arg("-C").arg(dir).args(args).output().expect("git runs");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A real `corral serve` child process.
pub struct ServeProcess {
    pub child: tokio::process::Child,
    pub url: String,
    /// Its unix socket (in the data directory).
    pub socket: PathBuf,
    /// Its `[sandbox] uids` range.
    pub uids: String,
}

/// Runs `Execute` on `channel` and collects the whole stream.
pub async fn execute_all(channel: Channel, request: pb::ExecuteRequest) -> Vec<pb::LifecycleEvent> {
    let mut client = ExecutionServiceClient::new(channel);
    let mut stream = client.execute(request).await.expect("execute accepted").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        events.push(event);
    }
    events
}

impl ServeProcess {
    /// Runs `Execute` and collects the whole stream.
    pub async fn execute(&self, request: pb::ExecuteRequest) -> Vec<pb::LifecycleEvent> {
        execute_all(self.channel().await, request).await
    }

    /// Starts the binary on 127.0.0.1:0 and waits for its address line.
    pub async fn start(data_dir: &Path, profiles: &Path, env: &[(&str, &str)]) -> ServeProcess {
        Self::start_with(data_dir, profiles, env, "").await
    }

    /// The same, with `extra_config` appended to its TOML config file (which
    /// defines the `route.test` credential route).
    pub async fn start_with(
        data_dir: &Path,
        profiles: &Path,
        env: &[(&str, &str)],
        extra_config: &str,
    ) -> ServeProcess {
        Self::start_wrapped(data_dir, profiles, env, extra_config, &[]).await
    }

    /// The same, started through `wrapper` (a command that ends by running
    /// its arguments, e.g. `unshare -m ... sh -c '...; exec "$@"' sh`).
    pub async fn start_wrapped(
        data_dir: &Path,
        profiles: &Path,
        env: &[(&str, &str)],
        extra_config: &str,
        wrapper: &[&str],
    ) -> ServeProcess {
        use tokio::io::AsyncBufReadExt;
        let secret = data_dir.with_extension("secret");
        std::fs::write(&secret, ROUTE_TEST_VALUE).unwrap();
        let config = data_dir.with_extension("toml");
        // A restart of the same data directory keeps its uid range: recovery
        // acts only on uids of its own range.
        let uids = std::fs::read_to_string(&config)
            .ok()
            .and_then(|text| {
                text.lines().find_map(|l| l.strip_prefix("uids = ").map(|u| u.trim_matches('"').to_string()))
            })
            .unwrap_or_else(unique_uids);
        // With CORRAL_TEST_STORE=postgres, a database of its own (the same
        // one again when the data directory is restarted).
        let previous = std::fs::read_to_string(&config).ok().and_then(|text| {
            let mut lines = text.lines().skip_while(|l| *l != "[store]");
            lines.nth(1).and_then(|l| l.strip_prefix("url = ")).map(|u| u.trim_matches('"').to_string())
        });
        let store = match previous {
            Some(url) => Some(url),
            None => fresh_postgres_database().await,
        };
        let mut text = format!(
            // The extra config first: its top-level keys must come before
            // any table.
            "{extra_config}\n[credentials.routes.\"route.test\"]\nfile = {:?}\ninject_as = \"ROUTE_TEST_TOKEN\"\nexpose = true\n[sandbox]\nuids = {:?}\n",
            secret.display().to_string(),
            uids
        );
        if let Some(url) = store {
            text.push_str(&format!("[store]\nurl = {url:?}\n"));
        }
        std::fs::write(&config, text).unwrap();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(data_dir.with_extension("log")).unwrap();
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = tokio::process::Command::new(program);
                command.args(args).arg(env!("CARGO_BIN_EXE_corral"));
                command
            }
            None => tokio::process::Command::new(env!("CARGO_BIN_EXE_corral")),
        };
        let mut child = command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .arg("--config")
            .arg(&config)
            .arg("--profiles")
            .arg(profiles)
            // The tests' repositories are temporary directories.
            .env("CORRAL_REPO_ROOTS", std::env::temp_dir())
            .envs(env.iter().copied())
            .env_remove("CORRAL_CONFIG")
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("corral serve starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix("corral listening on ") {
                    return addr.to_string();
                }
                // `--log-format json`: the same line as a JSON object.
                if let Ok(ready) = serde_json::from_str::<serde_json::Value>(&line) {
                    if ready["message"] == "corral listening" {
                        return ready["listen"].as_str().expect("the ready line names its address").to_string();
                    }
                }
            }
            let log = std::fs::read_to_string(data_dir.with_extension("log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().filter(|l| !l.starts_with(' ')).rev().take(5).collect();
            panic!("corral serve ended without its address line; its log ends: {tail:?}");
        })
        .await
        .expect("corral serve prints its address");
        // Keep draining stdout so the child never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        ServeProcess { child, url: format!("http://{addr}"), socket: data_dir.join("corral.sock"), uids }
    }

    pub async fn channel(&self) -> Channel {
        unix_channel(&self.socket).await
    }

    /// The `--server` for the CLI: the unix socket, as the local admin.
    pub fn cli_url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// SIGTERM, and its exit awaited (see [`terminate`]; then SIGKILL, not
    /// a second wait in the drop). A graceful stop destroys what the daemon
    /// still runs, each sandbox's cgroup with it; a killed daemon leaves
    /// them to the next start's recovery, which a test's temporary data
    /// directory never has.
    pub async fn stop(mut self) -> Option<std::process::ExitStatus> {
        let status = terminate(&mut self.child).await;
        if status.is_none() {
            let _ = self.child.kill().await;
        }
        status
    }
}

/// A daemon a test leaves running is stopped as [`ServeProcess::stop`]
/// does, not killed: a run's sandbox is given back after its `finished`,
/// and a test that ended right after that left it, cgroup and all, about
/// once in four runs of `operability`. Blocking, at most 35 s (the
/// default grace and a margin); after that `kill_on_drop` SIGKILLs it.
impl Drop for ServeProcess {
    fn drop(&mut self) {
        // Exited already: stopped, or killed by the test itself.
        let (Ok(None), Some(pid)) = (self.child.try_wait(), self.child.id()) else { return };
        // SAFETY: kill(2) of our own child, not yet reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(35);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

/// Sends a `corral serve` child SIGTERM and awaits its exit: its status,
/// `None` if it still runs 30 s later.
pub async fn terminate(child: &mut tokio::process::Child) -> Option<std::process::ExitStatus> {
    let pid = child.id().expect("serve is running") as libc::pid_t;
    // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped).
    let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    tokio::time::timeout(std::time::Duration::from_secs(30), child.wait()).await.ok().map(|s| s.expect("wait"))
}

/// Polls `probe` (every 20 ms, up to 10 s) until it holds.
pub async fn wait_until(what: &str, mut probe: impl FnMut() -> bool) {
    for _ in 0..500 {
        if probe() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Calls `call` again while it is refused RESOURCE_EXHAUSTED, every 50 ms
/// for up to 10 s (a place given back is noticed a moment after its stream
/// goes); any other refusal, or that one past the 10 s, panics naming
/// `what`.
pub async fn once_admitted<T, F: std::future::Future<Output = Result<T, tonic::Status>>>(
    what: &str,
    mut call: impl FnMut() -> F,
) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match call().await {
            Ok(answer) => return answer,
            Err(status) if status.code() == tonic::Code::ResourceExhausted && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(status) => panic!("{what}: {status:?}"),
        }
    }
}

/// Host processes whose command line contains `marker`. Panics when /proc
/// cannot be read: a count of 0 must mean none, never "could not look".
pub fn processes_with(marker: &str) -> usize {
    let dir = std::fs::read_dir("/proc").unwrap_or_else(|e| panic!("cannot list /proc to count {marker:?}: {e}"));
    let own = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    assert!(!own.is_empty(), "/proc is no procfs here (no command line of this process): cannot count {marker:?}");
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        // Its arguments are NUL-separated: read as one line, as ps shows it.
        .filter(|cmdline| String::from_utf8_lossy(cmdline).replace('\0', " ").contains(marker))
        .count()
}

/// `GET /metrics` over plain HTTP/1.1.
pub async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("the metrics listener answers");
    socket.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
}

/// The value of the sample `name{labels}` in a Prometheus exposition,
/// checking every line is well-formed on the way.
pub fn sample(exposition: &str, name: &str, labels: &str) -> Option<f64> {
    let mut found = None;
    for line in exposition.lines() {
        if line.is_empty() || line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("malformed line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("malformed value in {line:?}"));
        let metric = key.split('{').next().unwrap();
        assert!(
            metric.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "malformed metric name in {line:?}"
        );
        if key.contains('{') {
            assert!(key.ends_with('}'), "malformed labels in {line:?}");
        }
        let want = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
        if key == want {
            found = Some(value);
        }
    }
    found
}
