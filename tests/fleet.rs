//! A fleet on one PostgreSQL: real daemons (processes) on one real
//! database. Nodes are listed; a node killed with SIGKILL is declared lost
//! by a survivor, which fails its runs exactly once; a node cut off from
//! the store (it runs in a network namespace of the test's own, and the
//! test takes its veth link down) kills its sandboxes before its lease
//! runs out and exits; a
//! lost epoch can write nothing; a page token works on every node; a
//! drained node takes no new work and finishes what it runs; a node
//! stopped with SIGTERM is listed stopped, never declared lost; a session
//! create is never held for a dead node; queued work is not hidden behind
//! work a node cannot take.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{request, require_bwrap, ServeProcess};
use corral::pb;
use corral::pb::catalog_service_client::CatalogServiceClient;
use corral::pb::execution_service_client::ExecutionServiceClient;

const LEASE_SECONDS: u64 = 5;

/// One test of this file at a time: each runs two or three daemons with
/// short leases, and a dozen of them at once on a 2-core machine starve a
/// node's renewals into fencing it, which is what some tests check for.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A node: a daemon process on the shared database `url`, named `name`.
struct Node {
    name: String,
    data: PathBuf,
    profiles: PathBuf,
    config: String,
    /// What the daemon is started through (e.g. `ip netns exec NS`).
    wrapper: Vec<String>,
    process: ServeProcess,
}

/// Stops the nodes gracefully, so that what they still run (sessions,
/// sandboxes, their cgroups) is destroyed rather than left behind.
async fn stop_all<const N: usize>(nodes: [Node; N]) {
    for node in nodes {
        let name = node.name.clone();
        assert!(node.process.stop().await.is_some_and(|s| s.success()), "{name} did not stop on SIGTERM");
    }
}

impl Node {
    async fn start(dir: &Path, name: &str, url: &str) -> Node {
        Node::start_with(dir, name, url, "").await
    }

    /// A node whose `[fleet]` section also holds `fleet` (e.g.
    /// `capacity = 0`), followed by `tables` (e.g. `[[principals]]`).
    async fn start_configured(dir: &Path, name: &str, url: &str, fleet: &str, tables: &str) -> Node {
        Node::start_with(dir, name, url, &format!("{fleet}\n{tables}")).await
    }

    async fn start_with(dir: &Path, name: &str, url: &str, extra: &str) -> Node {
        Node::start_through(dir, name, url, extra, Vec::new()).await
    }

    /// A node whose config starts with the top-level keys `top` (e.g.
    /// `max_running_sessions = 1`).
    async fn start_topped(dir: &Path, name: &str, url: &str, top: &str, tables: &str) -> Node {
        Node::start_through(dir, name, url, &format!("{top}\0{tables}"), Vec::new()).await
    }

    /// `extra` goes after the `[fleet]` section; a part of it before a NUL
    /// goes before it, at the top of the file.
    async fn start_through(dir: &Path, name: &str, url: &str, extra: &str, wrapper: Vec<String>) -> Node {
        Node::start_leased(dir, name, url, LEASE_SECONDS, extra, wrapper).await
    }

    /// [`Node::start_through`] with a lease of `lease_seconds`.
    async fn start_leased(
        dir: &Path,
        name: &str,
        url: &str,
        lease_seconds: u64,
        extra: &str,
        wrapper: Vec<String>,
    ) -> Node {
        let data = dir.join(name);
        let profiles = dir.join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        // ServeProcess keeps the store URL a config of this data directory
        // already names.
        if !data.with_extension("toml").exists() {
            std::fs::write(data.with_extension("toml"), format!("[store]\nurl = {url:?}\n")).unwrap();
        }
        let (top, extra) = extra.split_once('\0').unwrap_or(("", extra));
        let config = format!("{top}\n[fleet]\nnode = {name:?}\nlease_seconds = {lease_seconds}\n{extra}\n");
        let wrap: Vec<&str> = wrapper.iter().map(String::as_str).collect();
        let process = ServeProcess::start_wrapped(&data, &profiles, &[], &config, &wrap).await;
        Node { name: name.into(), data, profiles, config, wrapper, process }
    }

    /// Starts this node's data directory again (after it died or fenced).
    async fn restart(&mut self) {
        let wrap: Vec<&str> = self.wrapper.iter().map(String::as_str).collect();
        self.process = ServeProcess::start_wrapped(&self.data, &self.profiles, &[], &self.config, &wrap).await;
    }

    async fn executions(&self) -> ExecutionServiceClient<tonic::transport::Channel> {
        ExecutionServiceClient::new(self.process.channel().await)
    }

    async fn catalog(&self) -> CatalogServiceClient<tonic::transport::Channel> {
        CatalogServiceClient::new(self.process.channel().await)
    }

    async fn nodes(&self) -> Vec<pb::Node> {
        self.catalog().await.list_nodes(pb::ListNodesRequest {}).await.unwrap().into_inner().nodes
    }

    async fn sessions(&self) -> corral::pb::session_service_client::SessionServiceClient<tonic::transport::Channel> {
        corral::pb::session_service_client::SessionServiceClient::new(self.process.channel().await)
    }

    /// SIGKILL, and its exit awaited.
    async fn kill(&mut self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.process.pid(), libc::SIGKILL) };
        self.process.child.wait().await.unwrap();
    }
}

/// Starts a shell execution on `node` that works until killed, and waits
/// until its harness runs (its marker is in a process's command line).
async fn start_long_run(node: &Node, marker: &str) -> String {
    // The marker is the inner shell's $0: in its command line.
    let script = format!("echo started; exec sh -c 'sleep 600; :' {marker}");
    let execution = node.executions().await.start_execution(request("builtin.shell", &script)).await.unwrap();
    let id = execution.into_inner().execution_id;
    wait_for("the long run's harness", Duration::from_secs(30), || !processes_with(marker).is_empty()).await;
    id
}

/// Pids whose command line carries `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable") {
        let Ok(entry) = entry else { continue };
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmdline.windows(needle.len()).any(|w| w == needle.as_bytes()) && pid != std::process::id() as i32 {
            pids.push(pid);
        }
    }
    pids
}

async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every stored event of `id`, read on `node`.
async fn events(node: &Node, id: &str) -> Vec<pb::LifecycleEvent> {
    let watch = pb::WatchRequest { execution_id: id.into(), after_sequence: 0 };
    let mut stream = node.executions().await.watch_execution(watch).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Ok(Some(event)) = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.unwrap() {
        out.push(event);
    }
    out
}

async fn state_of(node: &Node, id: &str) -> pb::ExecutionState {
    let get = pb::GetExecutionRequest { execution_id: id.into(), ..Default::default() };
    let record = node.executions().await.get_execution(get).await.unwrap().into_inner();
    pb::ExecutionState::try_from(record.state).unwrap()
}

/// Waits until `id` is finished as seen from `node`; returns how long.
async fn until_finished(node: &Node, id: &str, limit: Duration) -> (pb::ExecutionState, Duration) {
    let started = Instant::now();
    loop {
        let state = state_of(node, id).await;
        if !matches!(state, pb::ExecutionState::Pending | pb::ExecutionState::Running) {
            return (state, started.elapsed());
        }
        assert!(started.elapsed() < limit, "{id} not finished after {limit:?}: {state:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn note_of(events: &[pb::LifecycleEvent]) -> String {
    events
        .iter()
        .find_map(|e| match &e.kind {
            Some(pb::lifecycle_event::Kind::Recovered(r)) => Some(r.note.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

fn finished_count(events: &[pb::LifecycleEvent]) -> usize {
    events.iter().filter(|e| matches!(e.kind, Some(pb::lifecycle_event::Kind::Finished(_)))).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_declared_lost_once_and_rejoins_with_a_new_epoch() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let mut b = Node::start(dir.path(), "node-b", &url).await;

    let nodes = a.nodes().await;
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, vec!["node-a", "node-b"], "{nodes:?}");
    assert!(nodes.iter().all(|n| n.state == pb::NodeState::Active as i32 && !n.epoch.is_empty()), "{nodes:?}");
    assert!(nodes.iter().all(|n| n.labels.contains(&"linux_bwrap".to_string())), "{nodes:?}");
    let old_epoch = nodes[1].epoch.clone();

    // A page token made on one node works on the other (one fleet key).
    for n in 0..2 {
        a.executions().await.execute(request("builtin.shell", &format!("echo {n}"))).await.unwrap();
    }
    let first = pb::ListExecutionsRequest { page_size: 1, ..Default::default() };
    let page = a.executions().await.list_executions(first).await.unwrap().into_inner();
    assert!(!page.next_page_token.is_empty());
    let next = pb::ListExecutionsRequest { page_size: 1, page_token: page.next_page_token, ..Default::default() };
    let on_b = b.executions().await.list_executions(next).await.expect("a page token of node-a works on node-b");
    assert_eq!(on_b.into_inner().executions.len(), 1);

    let marker = format!("fleet-kill-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&b, &marker).await;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(b.process.pid(), libc::SIGKILL) };
    let _ = b.process.child.wait().await;
    let (state, after) = until_finished(&a, &id, Duration::from_secs(LEASE_SECONDS + 5)).await;
    assert_eq!(state, pb::ExecutionState::Failed);
    let seen = events(&a, &id).await;
    assert!(note_of(&seen).starts_with("node node-b lost during "), "{:?}", note_of(&seen));
    assert_eq!(finished_count(&seen), 1, "one finished event: {seen:?}");
    let lost = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(lost.state, pb::NodeState::Lost as i32, "{lost:?} ({after:?} after the kill)");
    // Its harness died with it (bwrap --die-with-parent); its sandbox's
    // directory is left for node-b's next start.
    wait_for("node-b's harness gone", Duration::from_secs(10), || processes_with(&marker).is_empty()).await;
    let leftovers = |node: &Node| std::fs::read_dir(node.data.join("sandboxes")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(leftovers(&b), 1, "the killed node's sandbox is still on disk");

    // node-b starts again: a new epoch, its leftover recovered, and the run
    // it lost left as the survivor finished it.
    b.restart().await;
    let rejoined = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(rejoined.state, pb::NodeState::Active as i32);
    assert_ne!(rejoined.epoch, old_epoch, "a new epoch per start");
    assert_eq!(leftovers(&b), 0, "recovery destroyed node-b's own leftover sandbox");
    let after_restart = events(&b, &id).await;
    assert_eq!(after_restart, seen, "node-b appended to a run it no longer owns");
}

/// A TCP forwarder to PostgreSQL listening on `bind` (the host's end of a
/// test network's veth pair): PostgreSQL itself listens on loopback only.
struct Forwarder {
    port: u16,
}

impl Forwarder {
    async fn start(bind: std::net::IpAddr, target: std::net::SocketAddr) -> Forwarder {
        let listener = tokio::net::TcpListener::bind((bind, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { return };
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
        Forwarder { port }
    }
}

/// A network namespace of the test's own, joined to the host by a veth
/// pair (198.18.N.1 on the host, .2 inside: the benchmarking range, on no
/// real network); removed, with the pair, when dropped.
struct TestNet {
    ns: String,
    host_if: String,
    host_ip: std::net::Ipv4Addr,
}

fn ip(args: &[&str]) {
    let status = std::process::Command::new("ip").args(args).status().expect("ip(8) runs (iproute2)");
    assert!(status.success(), "ip {args:?} failed");
}

impl TestNet {
    fn create() -> TestNet {
        let n = std::process::id() % 250;
        let (ns, host_if, peer) = (format!("corral-fleet-{n}"), format!("cfh{n}"), format!("cfn{n}"));
        // What an earlier run of the same pid left, if anything.
        for leftover in [["netns", "del", &ns], ["link", "del", &host_if]] {
            let _ = std::process::Command::new("ip").args(leftover).stderr(std::process::Stdio::null()).status();
        }
        ip(&["netns", "add", &ns]);
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &ns]);
        ip(&["addr", "add", &format!("198.18.{n}.1/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&["netns", "exec", &ns, "ip", "addr", "add", &format!("198.18.{n}.2/30"), "dev", &peer]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", &peer, "up"]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        TestNet { ns, host_if, host_ip: std::net::Ipv4Addr::new(198, 18, n as u8, 1) }
    }

    /// The link between the namespace and the host, up or down.
    fn link(&self, up: bool) {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }]);
    }

    /// Waits until a TCP connection from inside the namespace reaches
    /// `port` on the host's end: a link set up again carries nothing until
    /// the kernel sees its carrier and resolves the neighbour the
    /// partition left failed, and a daemon started before then fails with
    /// "no route to host" (as it should: that is not what this tests).
    async fn until_reachable(&self, port: u16) {
        let _ = std::process::Command::new("ip").args(["-n", &self.ns, "neigh", "flush", "all"]).status();
        let probe = format!("exec 3<>/dev/tcp/{}/{port}", self.host_ip);
        let reaches = || {
            std::process::Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", self.ns))
                .args(["--", "timeout", "2", "bash", "-c", &probe])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        wait_for("the namespace reaching the host again", Duration::from_secs(15), reaches).await;
    }

    /// Runs a command in the namespace's network only: `ip netns exec`
    /// would also remount /sys, hiding the host's cgroups from the daemon.
    fn wrapper(&self) -> Vec<String> {
        vec!["nsenter".into(), format!("--net=/run/netns/{}", self.ns), "--".into()]
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.host_if]).status();
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_the_store_kills_its_sandboxes_before_its_lease_runs_out() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    // node-b runs in a network namespace of its own; it reaches the same
    // database through the veth pair (postgres://user:password@host/db).
    let net = TestNet::create();
    let (before, rest) = url.split_once('@').expect("a URL with user@host");
    let (authority, path) = rest.split_once('/').expect("a URL with a database");
    let target = tokio::net::lookup_host(authority).await.unwrap().next().expect("PostgreSQL's address");
    let forwarder = Forwarder::start(net.host_ip.into(), target).await;
    let through = format!("{before}@{}:{}/{path}", net.host_ip, forwarder.port);
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let mut b = Node::start_through(dir.path(), "node-b", &through, "", net.wrapper()).await;
    let marker = format!("fleet-cut-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&b, &marker).await;
    let renewed = b.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();

    // The partition: the link down.
    net.link(false);
    // Its harness is killed before the lease it last renewed runs out.
    wait_for("node-b's harness killed", Duration::from_secs(LEASE_SECONDS + 2), || processes_with(&marker).is_empty())
        .await;
    let killed_at = corral::records::now_ms();
    assert!(
        killed_at < renewed.lease_until_ms + LEASE_SECONDS as i64 * 1000 / 3,
        "killed at {killed_at}, the lease ran out at {} (renewed again at most once before the cut)",
        renewed.lease_until_ms
    );
    // And node-b exits, saying why.
    let status = tokio::time::timeout(Duration::from_secs(10), b.process.child.wait()).await.unwrap().unwrap();
    assert!(!status.success(), "a fenced node exits with an error");
    let log = std::fs::read_to_string(b.data.with_extension("log")).unwrap();
    assert!(log.contains("fleet: this node fences itself"), "{log}");
    // The survivor fails the run.
    let (state, _) = until_finished(&a, &id, Duration::from_secs(LEASE_SECONDS + 5)).await;
    assert_eq!(state, pb::ExecutionState::Failed);
    let seen = events(&a, &id).await;
    assert_eq!(finished_count(&seen), 1);

    // The link restored, node-b rejoins with a new epoch and appends
    // nothing to its old run.
    net.link(true);
    net.until_reachable(forwarder.port).await;
    b.restart().await;
    let rejoined = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(rejoined.state, pb::NodeState::Active as i32);
    assert_ne!(rejoined.epoch, renewed.epoch);
    assert_eq!(events(&a, &id).await, seen);
}

/// The sweep for lost nodes waits on the store beside the lease loop,
/// never in it: with the executions table locked for two leases (the
/// sweep's query waits on it; the renewal, which writes only the node's
/// row, does not), the node goes on renewing its lease and its run goes
/// on, rather than renew nothing, see no renewal fail, and never fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_held_up_by_the_store_does_not_hold_up_the_lease() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let b = Node::start(dir.path(), "node-b", &url).await;
    let marker = format!("fleet-sweep-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&b, &marker).await;
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let mut lock = db.begin().await.unwrap();
    sqlx::query("LOCK TABLE executions IN ACCESS EXCLUSIVE MODE").execute(&mut *lock).await.unwrap();
    let locked_at = corral::records::now_ms();
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECONDS)).await;
    let renewed: i64 =
        sqlx::query_scalar("SELECT renewed_at_ms FROM nodes WHERE name = 'node-b'").fetch_one(&db).await.unwrap();
    let running = !processes_with(&marker).is_empty();
    lock.rollback().await.unwrap();
    assert!(
        renewed > locked_at + LEASE_SECONDS as i64 * 1000,
        "node-b renewed last at {renewed}, {} ms after the lock: its lease loop waited on the sweep",
        renewed - locked_at
    );
    assert!(running, "node-b's run ended while the store answered its renewals");
    b.executions().await.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.unwrap();
    let (state, _) = until_finished(&b, &id, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Cancelled);
    stop_all([b]).await;
}

/// Two starts on a new database: `name`, whose lease of 1 ms has run out
/// by the time it is looked at, and `survivor`, holding one of a minute;
/// with their data directory and the database's URL.
async fn two_starts(name: &str) -> (tempfile::TempDir, String, corral::store::Store, corral::store::Store) {
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let first = corral::store::Store::open(dir.path(), Some(&url), name).await.unwrap();
    let survivor = corral::store::Store::open(dir.path(), Some(&url), "survivor").await.unwrap();
    first.join_fleet(1, &[], 1).await.unwrap();
    survivor.join_fleet(1, &[], 60_000).await.unwrap();
    (dir, url, first, survivor)
}

/// A start leaves the fleet as `stopped` only once the store holds no
/// unfinished run of its node; a stopped node is never declared lost,
/// however long ago its lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_leaves_the_fleet_only_with_every_run_finished_and_is_never_declared_lost() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::{ExecutionRecord, ExecutionState};
    let (dir, url, leaver, survivor) = two_starts("leaver").await;
    let mut record =
        ExecutionRecord { execution_id: "e1".into(), state: ExecutionState::Running, ..Default::default() };
    leaver.insert_execution(&record, "d").await.unwrap();
    assert!(!leaver.leave_fleet().await.unwrap(), "a running execution of the node keeps it in the fleet");
    record.state = ExecutionState::Succeeded;
    record.finished_at_ms = Some(corral::records::now_ms());
    leaver.update_execution(&record).await.unwrap();
    assert!(leaver.leave_fleet().await.unwrap(), "nothing unfinished: it leaves");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        survivor.claim_lost_nodes(corral::records::now_ms()).await.unwrap().is_empty(),
        "a stopped node is not lost"
    );
    let states: Vec<(String, corral::store::NodeState)> =
        survivor.list_nodes().await.unwrap().into_iter().map(|n| (n.name, n.state)).collect();
    assert_eq!(
        states,
        vec![
            ("leaver".into(), corral::store::NodeState::Stopped),
            ("survivor".into(), corral::store::NodeState::Active)
        ]
    );
    // A start of another epoch under the same name cannot mark it.
    let other = corral::store::Store::open(dir.path(), Some(&url), "survivor").await.unwrap();
    assert!(!other.leave_fleet().await.unwrap(), "the row is another start's");
}

/// A node stopped with SIGTERM, having run an execution to its end, is
/// listed `stopped` once its lease has run out and rejoins active with a
/// new epoch; a node killed instead is declared lost (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_cleanly_is_listed_stopped_not_lost() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let mut b = Node::start(dir.path(), "node-b", &url).await;
    let run = b.executions().await.execute(request("builtin.shell", "echo done")).await.unwrap().into_inner();
    assert_whole(&stream_to_end(run).await, "node-b's run");
    let old_epoch = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap().epoch;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(b.process.pid(), libc::SIGTERM) };
    let status = b.process.child.wait().await.unwrap();
    assert!(status.success(), "node-b stopped on SIGTERM: {status:?}");
    // Past its lease, with node-a's sweep running after every renewal.
    tokio::time::sleep(Duration::from_secs(LEASE_SECONDS + 2)).await;
    let stopped = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(stopped.state, pb::NodeState::Stopped as i32, "{stopped:?}");
    b.restart().await;
    let rejoined = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(rejoined.state, pb::NodeState::Active as i32);
    assert_ne!(rejoined.epoch, old_epoch);
    stop_all([a, b]).await;
}

/// A node stopped with SIGTERM while it runs an execution longer than its
/// lease goes on renewing its lease through the shutdown grace: the run
/// ends as it would have, nobody declares the node lost, and it leaves the
/// fleet `stopped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopping_renews_its_lease_until_its_runs_have_ended() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start_topped(dir.path(), "node-b", &url, "shutdown_grace_seconds = 60", "").await;
    // Longer than the lease and the survivor's sweep after it together.
    let marker = format!("fleet-sigterm-{}", uuid::Uuid::now_v7().simple());
    let script = format!("echo start; sh -c 'sleep {}' {marker}; echo done-ok", LEASE_SECONDS * 2);
    let started = b.executions().await.start_execution(request("builtin.shell", &script)).await.unwrap();
    let id = started.into_inner().execution_id;
    wait_for("the run's harness", Duration::from_secs(30), || !processes_with(&marker).is_empty()).await;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(b.process.pid(), libc::SIGTERM) };
    let (state, _) = until_finished(&a, &id, Duration::from_secs(LEASE_SECONDS * 4)).await;
    let seen = events(&a, &id).await;
    assert_eq!(state, pb::ExecutionState::Succeeded, "{:?}", note_of(&seen));
    assert_eq!(finished_count(&seen), 1, "{seen:?}");
    let mut b = b;
    let status = b.process.child.wait().await.unwrap();
    assert!(status.success(), "node-b stopped on SIGTERM: {status:?}");
    let node_b = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(node_b.state, pb::NodeState::Stopped as i32, "{node_b:?}");
    stop_all([a]).await;
}

/// A survivor that declared a node lost and then died (or failed) before
/// failing its runs does not leave them running for ever: another node
/// fails them at its next sweep, once no live survivor holds the lost
/// node; while one does, nobody else touches them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_nodes_runs_are_failed_even_when_its_first_claimer_died() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::{ExecutionRecord, ExecutionState};
    let (dir, url, lost, survivor) = two_starts("lost").await;
    let record = ExecutionRecord { execution_id: "e1".into(), state: ExecutionState::Running, ..Default::default() };
    lost.insert_execution(&record, "d").await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let claimed = survivor.claim_lost_nodes(corral::records::now_ms()).await.unwrap();
    assert_eq!(claimed.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), vec!["lost"]);
    // The survivor is failing them (it holds the node), when node-c comes.
    let failing = survivor.claim_lost_node("lost").await.unwrap().expect("the survivor takes the lost node");
    let c = Node::start(dir.path(), "node-c", &url).await;
    let state = || async { survivor.get_execution("e1").await.unwrap().unwrap().state };
    tokio::time::sleep(Duration::from_millis(LEASE_SECONDS * 1000 * 2 / 3)).await;
    assert_eq!(state().await, ExecutionState::Running, "failed by node-c while the survivor held the node");
    // The survivor dies before it failed them: its lock goes with it.
    drop(failing);
    let started = Instant::now();
    while state().await == ExecutionState::Running {
        assert!(started.elapsed() < Duration::from_secs(LEASE_SECONDS * 2), "e1 is still running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state().await, ExecutionState::Failed);
    let events = survivor.events_after("e1", 0).await.unwrap();
    let notes: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.kind {
            corral::records::EventKind::Recovered { note } => Some(note.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(notes.len(), 1, "failed once: {notes:?}");
    assert!(notes[0].starts_with("node lost lost during "), "{notes:?}");
    assert!(survivor.lost_nodes_with_unfinished_runs().await.unwrap().is_empty());
    stop_all([c]).await;
}

/// A hub on 127.0.0.1 that counts the reports POSTed to it and answers
/// each with the status `status` holds then.
async fn switchable_hub(
    status: std::sync::Arc<std::sync::atomic::AtomicU16>,
    posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> String {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (status, posts) = (status.clone(), posts.clone());
            tokio::spawn(async move {
                let mut data = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = stream.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&data).to_ascii_lowercase();
                    let Some(end) = text.find("\r\n\r\n") else { continue };
                    let length: usize = text[..end]
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
                        .unwrap_or(0);
                    if data.len() >= end + 4 + length {
                        break;
                    }
                }
                let code = status.load(Ordering::SeqCst);
                if code == 200 {
                    posts.fetch_add(1, Ordering::SeqCst);
                }
                let reply = format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                let _ = stream.write_all(reply.as_bytes()).await;
            });
        }
    });
    url
}

/// The hub report status of execution `id`, read on `node`.
async fn hub_status(node: &Node, id: &str) -> pb::HubReportStatus {
    let get = pb::GetExecutionRequest { execution_id: id.into(), ..Default::default() };
    let record = node.executions().await.get_execution(get).await.unwrap().into_inner();
    pb::HubReportStatus::try_from(record.evidence.unwrap().hub_report_status).unwrap()
}

/// A node that stops with a hub report still undelivered (the hub is
/// down) leaves it to the fleet: once the hub is back, another node
/// delivers it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_nodes_pending_hub_report_is_delivered_by_another_node() {
    use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
    use std::sync::Arc;
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let status = Arc::new(AtomicU16::new(503));
    let accepted = Arc::new(AtomicUsize::new(0));
    let hub = switchable_hub(status.clone(), accepted.clone()).await;
    let hub_toml =
        format!("[hub]\nurl = \"{hub}\"\ntimeout_seconds = 1\ninitial_backoff_ms = 100\nmax_backoff_seconds = 1\n");
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start_with(dir.path(), "node-a", &url, &hub_toml).await;
    let b = Node::start_with(dir.path(), "node-b", &url, &hub_toml).await;
    let mut req = request("builtin.shell", "echo reported");
    req.report_to_hub = true;
    let run = a.executions().await.execute(req).await.unwrap().into_inner();
    assert_whole(&stream_to_end(run).await, "node-a's run");
    let id = a.executions().await.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    let id = id.executions[0].execution_id.clone();
    assert_eq!(hub_status(&a, &id).await, pb::HubReportStatus::Pending);
    let stopped = a.process.stop().await;
    assert!(stopped.is_some_and(|s| s.success()), "node-a stopped on SIGTERM");
    assert_eq!(hub_status(&b, &id).await, pb::HubReportStatus::Pending, "the hub is still down");
    status.store(200, Ordering::SeqCst);
    let started = Instant::now();
    while hub_status(&b, &id).await != pb::HubReportStatus::Accepted {
        assert!(started.elapsed() < Duration::from_secs(LEASE_SECONDS * 2), "node-a's report never delivered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "delivered once");
    let node_a = b.nodes().await.into_iter().find(|n| n.name == "node-a").unwrap();
    assert_eq!(node_a.state, pb::NodeState::Stopped as i32, "{node_a:?}");
    stop_all([b]).await;
}

/// The store refuses every write of a run by a start that was declared
/// lost, while the survivor's writes go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_epoch_can_write_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::{Event, EventKind};
    let (_dir, _, lost, survivor) = two_starts("lost").await;
    let event = |sequence| Event {
        subject_id: "e1".into(),
        sequence,
        time_ms: 1,
        kind: EventKind::Recovered { note: format!("event {sequence}") },
    };
    lost.append_events(&[event(1)]).await.expect("a node that holds its lease writes");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let claimed = survivor.claim_lost_nodes(corral::records::now_ms()).await.unwrap();
    assert_eq!(claimed.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), vec!["lost"]);
    assert!(survivor.claim_lost_nodes(corral::records::now_ms()).await.unwrap().is_empty(), "claimed once");
    let refused = lost.append_events(&[event(2)]).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "{refused}");
    assert!(matches!(lost.renew_lease(1000, 0).await, Err(corral::store::StoreError::Fenced { .. })));
    let mut record = corral::records::ExecutionRecord { execution_id: "e1".into(), ..Default::default() };
    record.state = corral::records::ExecutionState::Running;
    let refused = lost.update_execution(&record).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "a record update too: {refused}");
    // A sandbox's intent row carrying the run's first events: neither the
    // events, nor the row, nor its uid.
    let root = std::path::Path::new("/nowhere/sb");
    let new = |id| corral::store::NewSandbox { sandbox_id: id, subject_id: "e1", backend: "none", root, epoch: "x" };
    let refused = lost.insert_sandbox_with_uid(new("sb1"), (10, 11), |_| true, &[event(2)]).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "an intent row's events too: {refused}");
    let refused = lost.insert_sandbox_carrying(new("sb2"), &[event(2)]).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "without a uid too: {refused}");
    assert_eq!(survivor.sandboxes().await.unwrap(), vec![], "no row of either");
    assert_eq!(lost.sandbox_uid("sb1").await.unwrap(), None, "no uid of the lost node's");
    survivor.append_events(&[event(2)]).await.expect("the survivor writes");
    let stored: Vec<u64> = survivor.events_after("e1", 0).await.unwrap().iter().map(|e| e.sequence).collect();
    assert_eq!(stored, vec![1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_finishes_what_it_runs_and_takes_nothing_new() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start(dir.path(), "node-b", &url).await;
    let running = b
        .executions()
        .await
        .start_execution(request("builtin.shell", "sleep 2; echo done"))
        .await
        .unwrap()
        .into_inner()
        .execution_id;
    // `corral drain` and `corral nodes`, as an operator runs them.
    let server = format!("unix://{}", a.process.socket.display());
    let corral = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("--server")
            .arg(&server)
            .args(args)
            .env_remove("CORRAL_TOKEN")
            .output()
            .unwrap();
        assert!(out.status.success(), "corral {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let drained = corral(&["drain", "node-b"]);
    assert!(drained.lines().nth(1).is_some_and(|l| l.starts_with("node-b  draining")), "not drained yet: {drained}");
    let listed = corral(&["nodes"]);
    assert!(listed.starts_with("NODE    STATE"), "{listed}");
    assert!(listed.lines().any(|l| l.starts_with("node-a  active")), "{listed}");
    // node-b reads it at its next renewal (a third of the lease).
    let started = Instant::now();
    let refused = loop {
        let attempt = b.executions().await.start_execution(request("builtin.shell", "echo new")).await;
        match attempt {
            Err(status) => break status,
            Ok(_) => assert!(started.elapsed() < Duration::from_secs(LEASE_SECONDS), "node-b still takes work"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let (state, _) = until_finished(&b, &running, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded, "a drained node finishes what it runs");
    let node = a.nodes().await.into_iter().find(|n| n.name == "node-b").unwrap();
    assert_eq!(node.state, pb::NodeState::Draining as i32);
    // Empty, it says so at its next renewal.
    let started = Instant::now();
    while !a.nodes().await.into_iter().any(|n| n.name == "node-b" && n.drained) {
        assert!(started.elapsed() < Duration::from_secs(LEASE_SECONDS), "node-b never reported drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(corral(&["nodes"]).lines().any(|l| l.starts_with("node-b  drained")));
    // node-a still takes work; an unknown node is NOT_FOUND; no name is
    // INVALID_ARGUMENT.
    a.executions().await.execute(request("builtin.shell", "echo a")).await.unwrap();
    let missing = a.catalog().await.drain_node(pb::DrainNodeRequest { name: "nope".into() }).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let empty = a.catalog().await.drain_node(pb::DrainNodeRequest::default()).await.unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
    stop_all([a, b]).await;
}

/// A cancel sent to a node that does not run the execution reaches the
/// node that does (through the store, woken by NOTIFY): the caller gets
/// the owner's answer, the run ends CANCELLED with one `finished` event,
/// and nothing of it is left running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_sent_to_another_node_reaches_the_owner() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start(dir.path(), "node-b", &url).await;
    let marker = format!("fleet-cancel-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&b, &marker).await;
    let cancel = pb::CancelExecutionRequest { execution_id: id.clone() };
    let asked = Instant::now();
    let answer = a.executions().await.cancel_execution(cancel).await.expect("node-a forwards the cancel");
    let answered = asked.elapsed();
    assert_eq!(answer.into_inner().execution_id, id);
    let (state, _) = until_finished(&a, &id, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Cancelled);
    wait_for("the cancelled run's harness gone", Duration::from_secs(10), || processes_with(&marker).is_empty()).await;
    let seen = events(&a, &id).await;
    assert_eq!(finished_count(&seen), 1, "{seen:?}");
    assert!(answered < Duration::from_secs(1), "NOTIFY, not the one-second look: answered in {answered:?}");
    // The owner running nothing of it any more, a second cancel anywhere
    // is answered with the finished record (idempotent, as on the owner).
    let again = pb::CancelExecutionRequest { execution_id: id.clone() };
    let record = a.executions().await.cancel_execution(again).await.unwrap().into_inner();
    assert_eq!(record.state, pb::ExecutionState::Cancelled as i32);
}

/// A watcher following, through one node, a run that goes on elsewhere is
/// ended when that node shuts down: its stream does not end by itself (the
/// run goes on), so the drain ends it with UNAVAILABLE and the last
/// sequence it was sent, and the watch resumes on the owner from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_through_a_node_that_shuts_down_ends_with_where_to_resume() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start(dir.path(), "node-b", &url).await;
    let marker = format!("fleet-watch-end-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&b, &marker).await;
    let watch = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut stream = a.executions().await.watch_execution(watch).await.unwrap().into_inner();
    // Up to its dispatch: the run is under way on node-b.
    let mut last = loop {
        let event = tokio::time::timeout(Duration::from_secs(30), stream.message()).await.expect("events").unwrap();
        let event = event.expect("the run goes on");
        if matches!(&event.kind, Some(pb::lifecycle_event::Kind::Dispatched(_))) {
            break event.sequence;
        }
    };
    let stopping = tokio::spawn(a.process.stop());
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.message()).await.expect("ended within 30 s") {
            Ok(Some(event)) => last = event.sequence,
            Ok(None) => panic!("the stream ended as if the run had (after {last})"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
    let resume = format!("daemon shutting down; resume with after_sequence = {last}");
    assert_eq!(ended.message(), resume);
    assert!(stopping.await.unwrap().is_some_and(|s| s.success()), "node-a did not stop on SIGTERM");
    // On the owner, from there: the next event is the one after `last`.
    let cancel = pb::CancelExecutionRequest { execution_id: id.clone() };
    b.executions().await.cancel_execution(cancel).await.unwrap();
    let watch = pb::WatchRequest { execution_id: id.clone(), after_sequence: last };
    let mut stream = b.executions().await.watch_execution(watch).await.unwrap().into_inner();
    let next = tokio::time::timeout(Duration::from_secs(30), stream.message()).await.expect("resumed").unwrap();
    assert_eq!(next.expect("an event after the resume point").sequence, last + 1);
    assert!(b.process.stop().await.is_some_and(|s| s.success()), "node-b did not stop on SIGTERM");
}

/// Two nodes on one database with leases long enough (60 s) that a node
/// stopped for seconds is neither fenced nor swept, an agent session on
/// node-b, and a session client of node-a.
struct SessionOnB {
    a: Node,
    b: Node,
    session: pb::Session,
    on_a: corral::pb::session_service_client::SessionServiceClient<tonic::transport::Channel>,
    _dir: tempfile::TempDir,
}

async fn session_on_b() -> SessionOnB {
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let a = Node::start_leased(dir.path(), "node-a", &url, 60, "", Vec::new()).await;
    let b = Node::start_leased(dir.path(), "node-b", &url, 60, "", Vec::new()).await;
    let mut on_b = SessionServiceClient::new(b.process.channel().await);
    let session = on_b.create_session(create_agent_session()).await.unwrap().into_inner();
    let on_a = SessionServiceClient::new(a.process.channel().await);
    SessionOnB { a, b, session, on_a, _dir: dir }
}

/// A turn of `session_id` asking the agent to echo `text`.
fn echo_turn(session_id: &str, text: &str) -> pb::SendTurnRequest {
    pb::SendTurnRequest {
        session_id: session_id.to_string(),
        tool_call: Some(pb::ToolCall { tool: "echo".into(), arguments_json: format!(r#"{{"echo": "{text}"}}"#) }),
    }
}

/// What `call` gives while `node` is stopped (SIGSTOP); it runs again
/// (SIGCONT) once `call` returned.
async fn while_stopped<T>(node: &Node, call: impl std::future::Future<Output = T>) -> T {
    // SAFETY: kill(2) on our own child, alive.
    unsafe { libc::kill(node.process.pid(), libc::SIGSTOP) };
    let answer = call.await;
    // SAFETY: as above.
    unsafe { libc::kill(node.process.pid(), libc::SIGCONT) };
    answer
}

/// A turn forwarded to an owner that does not take it in time (node-b is
/// stopped for the forward's 10 s) is withdrawn: its caller is told that
/// nothing was done there, and the owner, running again, never runs it, so
/// the caller's next turn is the session's first and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_turn_not_taken_in_time_is_withdrawn_and_never_runs() {
    let _serial = ONE_AT_A_TIME.lock().await;
    // Stopped for the forward's 10 s.
    let SessionOnB { a, b, session, mut on_a, _dir } = session_on_b().await;
    let turn = |text: &str| echo_turn(&session.session_id, text);
    let unanswered = while_stopped(&b, on_a.send_turn(turn("withdrawn"))).await;
    let status = unanswered.expect_err("node-b answers nothing while stopped");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("did not answer within 10 s; the request is withdrawn: nothing was done there"),
        "{status:?}"
    );
    let events =
        stream_to_end(on_a.send_turn(turn("after")).await.expect("node-b takes turns again").into_inner()).await;
    let finished = match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::TurnFinished(t)) => *t,
        other => panic!("the turn's stream ends with turn_finished, not {other:?}"),
    };
    assert_eq!((finished.turn, finished.ok), (1, true), "the withdrawn turn ran before it: {finished:?}");
    assert!(finished.output.contains("echo after") && !finished.output.contains("withdrawn"), "{finished:?}");
    let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
    let ended = on_a.end_session(end).await.expect("node-a forwards EndSession").into_inner();
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    stop_all([a, b]).await;
}

/// SendTurn, EndSession and CancelTurn sent to a node that does not run
/// the session reach the node that does, and their callers get what the
/// owner's callers get (the turn's events, its raw output, the owner's
/// refusals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_driven_through_another_node_as_on_its_owner() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start(dir.path(), "node-b", &url).await;
    let create = create_agent_session();
    let mut on_b = SessionServiceClient::new(b.process.channel().await);
    let session = on_b.create_session(create).await.unwrap().into_inner();
    let mut on_a = SessionServiceClient::new(a.process.channel().await);
    let turn = |text: &str| pb::SendTurnRequest {
        session_id: session.session_id.clone(),
        tool_call: Some(pb::ToolCall {
            tool: "echo".into(),
            arguments_json: format!(r#"{{"progress": 2, "echo": "{text}"}}"#),
        }),
    };
    // A turn sent to node-a runs on node-b, the owner, and its caller gets
    // what the owner's caller gets: the turn's events, each once, ending
    // with `turn_finished` and its raw output.
    let kinds = |events: &[pb::LifecycleEvent]| -> Vec<String> {
        events.iter().map(|e| format!("{:?}", std::mem::discriminant(e.kind.as_ref().unwrap()))).collect()
    };
    let turn_finished = |events: &[pb::LifecycleEvent]| match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::TurnFinished(t)) => *t,
        other => panic!("the turn's stream ends with turn_finished, not {other:?}"),
    };
    let forwarded =
        stream_to_end(on_a.send_turn(turn("through-a")).await.expect("node-a forwards the turn").into_inner()).await;
    let direct = stream_to_end(on_b.send_turn(turn("on-b")).await.unwrap().into_inner()).await;
    assert_eq!(kinds(&forwarded), kinds(&direct), "the same events: {forwarded:?} / {direct:?}");
    let (f, d) = (turn_finished(&forwarded), turn_finished(&direct));
    assert_eq!((f.turn, d.turn, f.ok, d.ok), (1, 2, true, true), "{f:?} / {d:?}");
    assert!(f.output.contains("echo through-a"), "the forwarded turn's raw output: {f:?}");
    assert!(d.output.contains("echo on-b"), "{d:?}");
    let first = forwarded.first().unwrap().sequence;
    let sequences: Vec<u64> = forwarded.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (first..first + forwarded.len() as u64).collect::<Vec<_>>(), "each event once, in order");
    assert!(direct.first().unwrap().sequence > forwarded.last().unwrap().sequence, "the owner's turn comes after");
    // A turn while one is in flight is refused as on the owner.
    let busy = turn(r#"busy", "sleep": 3, "x": "1"#);
    let mut on_b2 = on_b.clone();
    let in_flight = tokio::spawn(async move { stream_to_end(on_b2.send_turn(busy).await.unwrap().into_inner()).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let refused = on_a.send_turn(turn("second")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert_eq!(refused.message(), "a turn is already in flight in this session", "the owner's answer");
    in_flight.await.unwrap();
    // CancelTurn reaches the owner too: with no turn in flight, its answer.
    let cancel = pb::CancelTurnRequest { session_id: session.session_id.clone() };
    let answered = on_a.cancel_turn(cancel).await.unwrap_err();
    assert_eq!(answered.code(), tonic::Code::FailedPrecondition, "{answered:?}");
    assert_eq!(answered.message(), "no turn is in flight in this session", "the owner's answer");
    let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
    let ended = on_a.end_session(end).await.expect("node-a forwards EndSession").into_inner();
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    let get = pb::GetSessionRequest { session_id: session.session_id.clone() };
    let stored = on_b.get_session(get).await.unwrap().into_inner();
    assert_eq!(stored.state, pb::SessionState::Ended as i32, "the owner ended it");
    wait_for("node-b's session sandbox gone", Duration::from_secs(10), || {
        std::fs::read_dir(b.data.join("sandboxes")).map(|d| d.count()).unwrap_or(0) == 0
    })
    .await;
}

/// A session whose end fails on its owner gives its raw cause to the
/// caller that ended it through another node, as on the owner itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raw_cause_of_a_failed_end_comes_back_through_another_node() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    std::fs::create_dir_all(dir.path().join("profiles")).unwrap();
    std::fs::write(dir.path().join("profiles/stubborn.toml"), common::stubborn_profile()).unwrap();
    let a = Node::start(dir.path(), "node-a", &url).await;
    let b = Node::start(dir.path(), "node-b", &url).await;
    let create = pb::CreateSessionRequest {
        profile_ref: "test.stubborn".into(),
        project: "proj-a".into(),
        ..Default::default()
    };
    let session = b.sessions().await.create_session(create).await.unwrap().into_inner().session_id;
    let end = pb::EndSessionRequest { session_id: session.clone() };
    let ended = a.sessions().await.end_session(end).await.expect("node-a forwards EndSession").into_inner();
    assert_eq!(ended.state, pb::SessionState::Failed as i32, "{ended:?}");
    assert!(ended.tool_error.contains("did not exit within"), "the owner's raw cause, handed on: {ended:?}");
    // Ended there already: a second end through node-a is the ended record.
    let again = pb::EndSessionRequest { session_id: session.clone() };
    let again = a.sessions().await.end_session(again).await.expect("ended already").into_inner();
    assert_eq!((again.state, again.tool_error.as_str()), (pb::SessionState::Failed as i32, ""), "{again:?}");
    stop_all([a, b]).await;
}

/// An event stored by one node wakes the watchers on every other node:
/// the write's transaction notifies `corral_events` with its subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_write_notifies_every_node_of_its_subject() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::{Event, EventKind};
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let writer = corral::store::Store::open(dir.path(), Some(&url), "writer").await.unwrap();
    let watcher = corral::store::Store::open(dir.path(), Some(&url), "watcher").await.unwrap();
    writer.join_fleet(1, &[], 60_000).await.unwrap();
    let mut listener = watcher.listen(&["corral_events"]).await.unwrap().expect("a shared store listens");
    let event = Event {
        subject_id: "e-notified".into(),
        sequence: 1,
        time_ms: 1,
        kind: EventKind::Recovered { note: "x".into() },
    };
    writer.append_events(&[event]).await.unwrap();
    let notified = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await.expect("notified").unwrap();
    assert_eq!(notified.payload(), "e-notified");
}

/// The nodes' profile `test.session-agent`, the tests' session harness.
fn write_session_agent(dir: &Path) {
    std::fs::create_dir_all(dir.join("profiles")).unwrap();
    std::fs::write(dir.join("profiles/agent.toml"), common::session_agent_profile("test.session-agent", "")).unwrap();
}

/// A session of `test.session-agent` in project `proj-a`.
fn create_agent_session() -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        profile_ref: "test.session-agent".into(),
        project: "proj-a".into(),
        ..Default::default()
    }
}

/// Every event of one execution as its caller's stream delivered them.
async fn stream_to_end(mut stream: tonic::Streaming<pb::LifecycleEvent>) -> Vec<pb::LifecycleEvent> {
    let mut out = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), stream.message())
        .await
        .expect("an event within a minute")
        .expect("the stream ends cleanly")
    {
        out.push(event);
    }
    out
}

/// Events 1..=n, each once, from `accepted` to `finished`.
fn assert_whole(events: &[pb::LifecycleEvent], what: &str) {
    let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=events.len() as u64).collect::<Vec<_>>(), "{what}: every event once, in order");
    assert!(matches!(events.first().and_then(|e| e.kind.as_ref()), Some(pb::lifecycle_event::Kind::Accepted(_))));
    assert_eq!(finished_count(events), 1, "{what}: {events:?}");
    assert!(events.last().unwrap().kind.as_ref().is_some_and(|k| matches!(k, pb::lifecycle_event::Kind::Finished(_))));
}

/// Thirty executions sent to a front end (`capacity = 0`) all run on the
/// two nodes that have room, each caller's stream carries every event of
/// its run once (the direct caller gets its raw output too), and a
/// watcher on a third node sees exactly the same events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_sent_to_a_front_end_runs_on_the_nodes_with_room_and_every_caller_sees_every_event() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", "").await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 4", "").await;
    let c = Node::start_configured(dir.path(), "node-c", &url, "capacity = 4", "").await;
    let nodes = front.nodes().await;
    let capacities: Vec<(String, u64)> = nodes.iter().map(|n| (n.name.clone(), n.capacity)).collect();
    assert_eq!(capacities, vec![("front".into(), 0), ("node-b".into(), 4), ("node-c".into(), 4)]);

    let mut calls = Vec::new();
    for n in 0..30 {
        let mut client = front.executions().await;
        calls.push(tokio::spawn(async move {
            let script = format!("echo output-{n}; sleep 0.2");
            let stream = client.execute(request("builtin.shell", &script)).await.expect("accepted").into_inner();
            (n, stream_to_end(stream).await)
        }));
    }
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let mut ran_on = std::collections::BTreeMap::new();
    for call in calls {
        let Ok((n, seen)) = call.await else {
            let log = std::fs::read_to_string(front.data.with_extension("log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(8).collect();
            panic!("a caller's stream failed; the front end's log: {tail:#?}");
        };
        assert_whole(&seen, &format!("execution {n}"));
        let record = common::finished(&seen);
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
        assert!(record.tool_output.contains(&format!("output-{n}")), "the direct caller's raw output: {record:?}");
        let node = store.node_of_execution(&record.execution_id).await.unwrap().unwrap_or_default();
        *ran_on.entry(node.clone()).or_insert(0) += 1;
        // A watcher on the node that did not run it: the same events.
        let other = if node == "node-b" { &c } else { &b };
        let watched = events(other, &record.execution_id).await;
        let strip = |events: &[pb::LifecycleEvent]| -> Vec<(u64, String)> {
            events
                .iter()
                .map(|e| (e.sequence, format!("{:?}", std::mem::discriminant(e.kind.as_ref().unwrap()))))
                .collect()
        };
        assert_eq!(strip(&watched), strip(&seen), "execution {n} watched on {}", other.name);
    }
    assert_eq!(ran_on.keys().cloned().collect::<Vec<_>>(), vec!["node-b", "node-c"], "{ran_on:?}");
    assert_eq!(ran_on.values().sum::<i32>(), 30);
    assert_eq!(store.queued_count().await.unwrap(), 0, "nothing left in the queue");
}

/// A principal's `max_running` holds across the fleet: a burst sent to two
/// nodes at once (each with room for more) never has more harnesses alive
/// than the quota, counted from inside the sandboxes; all of it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_across_nodes_under_a_concurrent_burst() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let witness = common::witness::Witness::new();
    let script = format!("{} sleep 1; {}", witness.enter(), witness.leave());
    std::fs::create_dir_all(dir.path().join("profiles")).unwrap();
    std::fs::write(dir.path().join("profiles/burst.toml"), witness.profile("test.burst", &script, "nothing")).unwrap();
    let token = "burst-token-5a1f-0c2e-4b7d-9e3a-quota-test";
    let token_file = dir.path().join("burst.token");
    std::fs::write(&token_file, token).unwrap();
    // The witness's directory is a host directory its profile writes.
    let principal = format!(
        "[[principals]]\nname = \"burst\"\ntype = \"agt\"\nprojects = [\"proj-q\"]\ntoken_file = {:?}\nmax_running = 2\n\
         write_roots = [{:?}]\n",
        token_file.display().to_string(),
        witness.path()
    );
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 4", &principal).await;
    let c = Node::start_configured(dir.path(), "node-c", &url, "capacity = 4", &principal).await;
    let mut calls = Vec::new();
    for n in 0..12 {
        let node = if n % 2 == 0 { &b } else { &c };
        let mut client = node.executions().await;
        calls.push(tokio::spawn(async move {
            let mut req = request("test.burst", "burst");
            req.project = "proj-q".into();
            let stream = client.execute(common::with_token(token, req)).await.expect("accepted").into_inner();
            stream_to_end(stream).await
        }));
    }
    for call in calls {
        let seen = call.await.unwrap();
        assert_whole(&seen, "a burst execution");
        let record = common::finished(&seen);
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    }
    let (started, most) = witness.counts();
    assert_eq!(started, 12, "every execution of the burst ran");
    assert!(most <= 2, "{most} harnesses of a principal with max_running = 2 were alive at once");
    assert_eq!(most, 2, "the quota's two ran side by side");
}

/// An execution waiting in the queue is cancelled by any node: it is taken
/// out, finished CANCELLED with `accepted` and one `finished`, and never
/// runs; the work queued behind it runs once there is room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_execution_is_cancelled_before_it_runs_and_the_next_one_runs() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", "").await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 1", "").await;
    let marker = format!("fleet-queued-{}", uuid::Uuid::now_v7().simple());
    let busy = start_long_run(&b, &marker).await;
    let never = format!("fleet-never-{}", uuid::Uuid::now_v7().simple());
    let mut client = front.executions().await;
    let queued = client
        .start_execution(request("builtin.shell", &format!("exec sh -c 'sleep 5' {never}")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(queued.state, pb::ExecutionState::Pending as i32, "{queued:?}");
    // Nothing of it is stored while it waits: no caller has seen an event.
    let past = pb::WatchRequest { execution_id: queued.execution_id.clone(), after_sequence: 1 };
    let status = client.watch_execution(past).await.expect_err("no event stored yet");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    let info = tonic_types::StatusExt::get_details_error_info(&status).expect("details");
    assert_eq!(info.metadata.get("last_sequence").map(String::as_str), Some("0"));
    let next = client.start_execution(request("builtin.shell", "echo next")).await.unwrap().into_inner();
    let cancel = pb::CancelExecutionRequest { execution_id: queued.execution_id.clone() };
    let cancelled = b.executions().await.cancel_execution(cancel).await.unwrap().into_inner();
    assert_eq!(cancelled.state, pb::ExecutionState::Cancelled as i32, "{cancelled:?}");
    let seen = events(&front, &queued.execution_id).await;
    assert_whole(&seen, "the cancelled queued execution");
    assert_eq!(seen.len(), 2, "accepted and finished only: {seen:?}");
    // The long run ends: the one queued behind the cancelled one runs.
    let cancel = pb::CancelExecutionRequest { execution_id: busy.clone() };
    front.executions().await.cancel_execution(cancel).await.unwrap();
    let (state, _) = until_finished(&front, &next.execution_id, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded);
    assert!(processes_with(&never).is_empty(), "the cancelled execution never ran");
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    assert_eq!(store.node_of_execution(&next.execution_id).await.unwrap().as_deref(), Some("node-b"));
}

/// A node that cannot renew its lease takes no new work before it fences.
/// node-b's row is share-locked by another transaction: its renewal's
/// UPDATE waits on the lock, while its claims' fence check (a share lock
/// too) and every other statement of a claim go through. Half a lease
/// after its last renewal it claims nothing, though the store would let
/// it; the lock let go, the renewal goes through and it runs the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_renew_its_lease_claims_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    // Renewed every 7 s, no new work 10.5 s after a renewal, fenced at 14 s.
    const LEASE_MS: i64 = 21_000;
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let leased = |name: &'static str, fleet: &'static str| {
        Node::start_leased(dir.path(), name, &url, LEASE_MS as u64 / 1000, fleet, Vec::new())
    };
    let front = leased("front", "capacity = 0").await;
    let b = leased("node-b", "capacity = 1").await;
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let lease_until =
        || sqlx::query_scalar::<_, i64>("SELECT lease_until_ms FROM nodes WHERE name = 'node-b'").fetch_one(&db);
    // Just after a renewal of node-b's: the lease runs from then.
    let joined = lease_until().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(12);
    let renewed = loop {
        let now = lease_until().await.unwrap();
        if now > joined {
            break now;
        }
        assert!(Instant::now() < deadline, "node-b did not renew its lease");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut lock = db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM nodes WHERE name = 'node-b' FOR SHARE").execute(&mut *lock).await.unwrap();
    let sent = renewed - LEASE_MS;
    let (stops_taking, fences) = (sent + LEASE_MS / 2, sent + LEASE_MS * 2 / 3);
    tokio::time::sleep(Duration::from_millis((stops_taking + 300 - corral::records::now_ms()).max(0) as u64)).await;
    let queued = front.executions().await.start_execution(request("builtin.shell", "echo claimed")).await.unwrap();
    let id = queued.into_inner().execution_id;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(state_of(&front, &id).await, pb::ExecutionState::Pending, "node-b took work it could not keep");
    let now = corral::records::now_ms();
    // The renewal must go through (below) before the fence, with time to
    // spare.
    assert!(now < fences - 2000, "this machine was too slow to look before node-b's fence ({now} vs {fences})");
    lock.rollback().await.unwrap();
    let (state, _) = until_finished(&front, &id, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded);
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    assert_eq!(store.node_of_execution(&id).await.unwrap().as_deref(), Some("node-b"));
    stop_all([front, b]).await;
}

/// kill -9 of a node mid-run: its run is failed by a survivor, once; the
/// work waiting in the queue is not lost with it and runs on another node
/// once that one has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_work_outlives_a_killed_node() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", "").await;
    let mut b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 1", "").await;
    let c = Node::start_configured(dir.path(), "node-c", &url, "capacity = 1", "").await;
    let on_b = format!("fleet-b-{}", uuid::Uuid::now_v7().simple());
    let on_c = format!("fleet-c-{}", uuid::Uuid::now_v7().simple());
    let lost = start_long_run(&b, &on_b).await;
    let busy = start_long_run(&c, &on_c).await;
    let queued = front.executions().await.start_execution(request("builtin.shell", "echo queued")).await.unwrap();
    let queued = queued.into_inner().execution_id;
    assert_eq!(state_of(&front, &queued).await, pb::ExecutionState::Pending);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(b.process.pid(), libc::SIGKILL) };
    let _ = b.process.child.wait().await;
    let (state, _) = until_finished(&front, &lost, Duration::from_secs(LEASE_SECONDS + 5)).await;
    assert_eq!(state, pb::ExecutionState::Failed);
    assert_eq!(finished_count(&events(&front, &lost).await), 1);
    assert_eq!(state_of(&front, &queued).await, pb::ExecutionState::Pending, "still queued: no node has room");
    // node-c gets room: the queued execution runs there.
    let cancel = pb::CancelExecutionRequest { execution_id: busy.clone() };
    front.executions().await.cancel_execution(cancel).await.unwrap();
    let (state, _) = until_finished(&front, &queued, Duration::from_secs(30)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded);
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    assert_eq!(store.node_of_execution(&queued).await.unwrap().as_deref(), Some("node-c"));
    // node-b restarted recovers its own leftover only: the queued run and
    // node-c's are untouched.
    b.restart().await;
    let seen = events(&front, &queued).await;
    assert_whole(&seen, "the queued execution");
    assert!(note_of(&seen).is_empty(), "node-b's recovery touched another node's run: {seen:?}");
    assert_eq!(std::fs::read_dir(b.data.join("sandboxes")).map(|d| d.count()).unwrap_or(0), 0);
}

/// A tool call waiting for approval on one node is decided through
/// another: the decision reaches the owner, the harness gets the verdict,
/// and the owner's answers (a call nobody waits on, one decided already)
/// come back as they are, the session's end past too; once the owner has
/// stopped, its calls are unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_waiting_on_one_node_is_decided_through_another() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let ask = "[[policies]]\nname = \"ask-deploy\"\nkind = \"require_approval\"\narguments = { timeout_seconds = 60 }\non = [\"tool_call:deploy\"]\n";
    let a = Node::start_configured(dir.path(), "node-a", &url, "", ask).await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "", ask).await;
    let mut on_b = SessionServiceClient::new(b.process.channel().await);
    let create = create_agent_session();
    let session = on_b.create_session(create).await.unwrap().into_inner().session_id;
    let asks = serde_json::json!({"ask": {"tool": "deploy", "arguments": {"to": "prod"}}});
    let turn = pb::SendTurnRequest {
        session_id: session.clone(),
        tool_call: Some(pb::ToolCall { tool: "run".into(), arguments_json: asks.to_string() }),
    };
    let mut stream = on_b.send_turn(turn).await.unwrap().into_inner();
    let call_id = loop {
        match stream.message().await.unwrap().expect("the turn asks before it ends").kind {
            Some(pb::lifecycle_event::Kind::ApprovalRequested(asked)) => break asked.call_id,
            _ => continue,
        }
    };
    let mut on_a = SessionServiceClient::new(a.process.channel().await);
    let decide = |call: &str| pb::DecideSessionToolCallRequest {
        session_id: session.clone(),
        call_id: call.into(),
        decision: pb::ToolCallDecision::Allow as i32,
        reason: "through node-a".into(),
    };
    let unknown = on_a.decide_tool_call(decide("call-999999")).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "the owner knows no such call: {unknown:?}");
    let decided = on_a.decide_tool_call(decide(&call_id)).await.expect("node-a forwards the decision").into_inner();
    assert!(decided.allow, "{decided:?}");
    let again = on_a.decide_tool_call(decide(&call_id)).await.unwrap_err();
    assert_eq!(again.code(), tonic::Code::FailedPrecondition, "decided already, on the owner: {again:?}");
    let mut rest = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        rest.push(event);
    }
    let finished = match rest.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::TurnFinished(t)) => *t,
        other => panic!("the turn ends with turn_finished: {other:?}"),
    };
    assert!(finished.output.contains("verdict deploy: allow"), "the harness got the verdict: {finished:?}");
    assert!(
        rest.iter().any(|e| matches!(&e.kind, Some(pb::lifecycle_event::Kind::ApprovalDecided(d)) if d.allow && d.reason == "through node-a")),
        "{rest:?}"
    );
    // Ended, the owner still tells the call decided already from one it
    // never had, and node-a answers as it does: the same code, the same
    // message, whichever node is asked.
    let end = pb::EndSessionRequest { session_id: session.clone() };
    on_b.end_session(end).await.expect("node-b ends its session");
    let mut answers = Vec::new();
    for client in [&mut on_b, &mut on_a] {
        let settled = client.decide_tool_call(decide(&call_id)).await.unwrap_err();
        let unknown = client.decide_tool_call(decide("call-999999")).await.unwrap_err();
        answers.push([settled, unknown].map(|s| (s.code(), s.message().to_string())));
    }
    let [on_owner, through_a] = [&answers[0], &answers[1]];
    assert_eq!(on_owner[0].0, tonic::Code::FailedPrecondition, "decided already, on the owner: {on_owner:?}");
    assert_eq!(on_owner[1].0, tonic::Code::NotFound, "no such call, on the owner: {on_owner:?}");
    assert_eq!(through_a, on_owner, "node-a answers for the ended session as its owner does");
    // Its owner stopped (its calls were in its memory): NOT_FOUND at once,
    // as it would answer itself once restarted, not a wait for a node that
    // is gone.
    assert!(b.process.stop().await.is_some_and(|s| s.success()), "node-b did not stop on SIGTERM");
    let asked = Instant::now();
    let gone = on_a.decide_tool_call(decide(&call_id)).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "its owner stopped: {gone:?}");
    assert!(asked.elapsed() < Duration::from_secs(5), "answered without waiting for node-b: {:?}", asked.elapsed());
    stop_all([a]).await;
}

/// A profile's `[placement] labels` keep its runs on nodes with those
/// labels (`[fleet] labels`): sent to a front end or to a node without
/// them, they run on the node that has them; when no node has them, the
/// request is refused naming what it needs, never queued for nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_labels_keep_runs_on_the_nodes_that_have_them() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let placed = |id: &str, label: &str| {
        format!(
            "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
             [sandbox]\ntype = \"linux_bwrap\"\n[limits]\ntimeout_seconds = 60\n[placement]\nlabels = [\"{label}\"]\n"
        )
    };
    std::fs::write(profiles.join("gpu.toml"), placed("test.gpu", "gpu")).unwrap();
    std::fs::write(profiles.join("tpu.toml"), placed("test.tpu", "tpu")).unwrap();
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", "").await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 2", "").await;
    let c = Node::start_configured(dir.path(), "node-c", &url, "capacity = 2\nlabels = [\"gpu\"]", "").await;
    let labelled = front.nodes().await.into_iter().find(|n| n.name == "node-c").unwrap();
    assert!(labelled.labels.contains(&"gpu".to_string()), "{labelled:?}");
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    for node in [&front, &b, &c] {
        let stream = node.executions().await.execute(request("test.gpu", "echo placed")).await.unwrap().into_inner();
        let seen = stream_to_end(stream).await;
        let record = common::finished(&seen);
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "sent to {}: {record:?}", node.name);
        let ran_on = store.node_of_execution(&record.execution_id).await.unwrap();
        assert_eq!(ran_on.as_deref(), Some("node-c"), "sent to {}", node.name);
    }
    let refused = front.executions().await.execute(request("test.tpu", "echo nowhere")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("tpu"), "{}", refused.message());
    assert_eq!(store.queued_count().await.unwrap(), 0);
}

/// Sessions sent to a front end start on the nodes with room: each create
/// is handed to a node able to take it, the next one when the first is
/// full; with every node full the create is RESOURCE_EXHAUSTED. A
/// principal's `max_running` counts its sessions across the fleet, on
/// every node it is sent to. A handed session is driven and ended through
/// the front end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_sent_to_a_front_end_start_on_nodes_with_room_within_a_fleet_wide_quota() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::pb::session_service_client::SessionServiceClient;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let principal = |name: &str, max_running: usize| {
        let token = format!("{name}-token-7c1e-44d2-9b0a-session-placement");
        let file = dir.path().join(format!("{name}.token"));
        std::fs::write(&file, &token).unwrap();
        let table = format!(
            "[[principals]]\nname = {name:?}\ntype = \"agt\"\nprojects = [\"proj-s\"]\ntoken_file = {:?}\n\
             max_running = {max_running}\n",
            file.display().to_string()
        );
        (token, table)
    };
    let (wide, wide_table) = principal("wide", 3);
    let (narrow, narrow_table) = principal("narrow", 1);
    let tables = format!("{wide_table}{narrow_table}");
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", &tables).await;
    let b = Node::start_topped(dir.path(), "node-b", &url, "max_running_sessions = 1", &tables).await;
    let c = Node::start_topped(dir.path(), "node-c", &url, "max_running_sessions = 1", &tables).await;
    let mut on_front = SessionServiceClient::new(front.process.channel().await);
    let create = |token: &str| {
        let mut create = create_agent_session();
        create.project = "proj-s".into();
        common::with_token(token, create)
    };
    let sandboxes = |node: &Node| std::fs::read_dir(node.data.join("sandboxes")).map(|d| d.count()).unwrap_or(0);
    // node-b full: every create sent to the front end opens on node-c, the
    // one of two that starts its tries at node-b as well (the front end
    // starts each create's tries at the next node).
    let mut on_b = SessionServiceClient::new(b.process.channel().await);
    let on_b_itself = on_b.create_session(create(&wide)).await.unwrap().into_inner();
    let mut opened = Vec::new();
    for _ in 0..2 {
        let session = on_front.create_session(create(&wide)).await.expect("handed to node-c").into_inner();
        assert_eq!(session.state, pb::SessionState::Active as i32, "{session:?}");
        assert_eq!((sandboxes(&front), sandboxes(&b), sandboxes(&c)), (0, 1, 1), "on the node with room");
        // Driven through the front end, where it runs.
        let turn = pb::SendTurnRequest {
            session_id: session.session_id.clone(),
            tool_call: Some(pb::ToolCall { tool: "echo".into(), arguments_json: r#"{"echo": "via-front"}"#.into() }),
        };
        let turned = on_front.send_turn(common::with_token(&wide, turn)).await.unwrap().into_inner();
        match stream_to_end(turned).await.last().and_then(|e| e.kind.clone()) {
            Some(pb::lifecycle_event::Kind::TurnFinished(t)) => {
                assert!(t.ok && t.output.contains("echo via-front"), "{t:?}")
            }
            other => panic!("the turn ends with turn_finished, not {other:?}"),
        }
        opened.push(session);
        if opened.len() == 1 {
            let end = pb::EndSessionRequest { session_id: opened[0].session_id.clone() };
            on_front.end_session(common::with_token(&wide, end)).await.unwrap();
            wait_for("the first session's sandbox gone", Duration::from_secs(10), || sandboxes(&c) == 0).await;
        }
    }
    let full = on_front.create_session(create(&wide)).await.unwrap_err();
    assert_eq!(full.code(), tonic::Code::ResourceExhausted, "{full:?}");
    assert!(full.message().contains("no node of the fleet has room"), "{full:?}");
    for session in [&on_b_itself, &opened[1]] {
        let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
        let ended = on_front.end_session(common::with_token(&wide, end)).await.unwrap().into_inner();
        assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    }
    wait_for("both sessions' sandboxes gone", Duration::from_secs(10), || sandboxes(&b) + sandboxes(&c) == 0).await;
    // Room on both nodes now; `narrow` may run one thing in the whole fleet.
    let only = on_front.create_session(create(&narrow)).await.expect("narrow's one session").into_inner();
    assert_eq!(only.state, pb::SessionState::Active as i32);
    for node in [&front, &b, &c] {
        let mut client = SessionServiceClient::new(node.process.channel().await);
        let over = client.create_session(create(&narrow)).await.unwrap_err();
        assert_eq!(over.code(), tonic::Code::ResourceExhausted, "sent to {}: {over:?}", node.name);
        assert!(over.message().contains("max_running quota of 1"), "sent to {}: {over:?}", node.name);
    }
    assert_eq!(sandboxes(&b) + sandboxes(&c), 1, "nothing started past the quota");
    stop_all([front, b, c]).await;
}

/// Builds (in this process) a daemon that wants node `twin`'s place: its
/// store, its node name, `uids`, in `data_dir`; the error text when it
/// refuses.
async fn build_twin(url: &str, data_dir: PathBuf, uids: &str) -> Result<(), String> {
    let mut config = corral::config::Config { data_dir, ..corral::config::Config::default() };
    config.store.url = Some(url.to_string());
    config.fleet.node = Some("twin".into());
    config.fleet.lease_seconds = LEASE_SECONDS;
    config.sandbox.uids = uids.to_string();
    let built = corral::daemon::Daemon::build(
        config,
        corral::sandbox::Backends::host_default(),
        corral::daemon::default_reins(),
    )
    .await;
    built.map(drop).map_err(|e| e.to_string())
}

/// A second daemon started as a live node (its node name, and its uid range
/// or its data directory) refuses to start, and refusing takes nothing from
/// the live one: it keeps its epoch (a start that joined the fleet first
/// would have fenced it: killed its run and made it exit), its lease and
/// its run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_refused_at_start_does_not_fence_the_live_node_it_collides_with() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let mut live = Node::start(dir.path(), "twin", &url).await;
    let epoch = live.nodes().await.into_iter().find(|n| n.name == "twin").expect("listed").epoch;
    let marker = format!("twin-run-{}", uuid::Uuid::now_v7().simple());
    let id = start_long_run(&live, &marker).await;

    // Another data directory, the same uids: the uid range is taken.
    let other = common::data_tempdir();
    let err = build_twin(&url, other.path().join("data"), &live.process.uids).await.expect_err("the same uids");
    assert!(err.contains(&format!("overlap uids {}", live.process.uids)), "{err}");
    // The same data directory, uids of its own: the data directory is taken.
    let err = build_twin(&url, live.data.clone(), &common::unique_uids()).await.expect_err("the same data dir");
    assert!(err.contains("in use by a running daemon"), "{err}");
    assert!(err.contains(&format!("pid {}", live.process.pid())), "names the live daemon: {err}");

    // Two leases: a node whose row was taken renews, finds itself fenced
    // within a third of one, kills its run and exits.
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECONDS)).await;
    assert!(matches!(live.process.child.try_wait(), Ok(None)), "the live node still runs");
    assert!(!processes_with(&marker).is_empty(), "its run's harness still runs");
    assert_eq!(state_of(&live, &id).await, pb::ExecutionState::Running);
    let row = live.nodes().await.into_iter().find(|n| n.name == "twin").expect("listed");
    assert_eq!(row.state, pb::NodeState::Active as i32, "{row:?}");
    assert_eq!(row.epoch, epoch, "the live start still owns its node row");
    let cancel = pb::CancelExecutionRequest { execution_id: id.clone() };
    live.executions().await.cancel_execution(cancel).await.unwrap();
    until_finished(&live, &id, Duration::from_secs(30)).await;
    stop_all([live]).await;
}

/// Drops the test's database (its daemons stopped or killed).
async fn drop_database(url: &str) {
    use sqlx::Connection;
    let name = url.rsplit_once('/').map(|(_, name)| name).unwrap();
    let mut admin = sqlx::PgConnection::connect(&common::postgres_admin_url()).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut admin).await.unwrap();
}

/// As [`wait_for`], for a condition that must be awaited (a store or RPC read).
async fn wait_until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `(state, node)` of every session the store holds.
async fn stored_sessions(db: &sqlx::PgPool) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as("SELECT session_id, state, node FROM sessions ORDER BY session_id").fetch_all(db).await.unwrap()
}

/// Two creates sent to a front end right after node-b was killed (its
/// lease not yet run out, nobody has swept it): the one handed to node-b
/// first is withdrawn once node-b's lease runs out and started on node-c,
/// which has room; neither caller waits the hand-over's two minutes, and
/// no request to node-b is left for it to act on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_handed_to_a_killed_node_is_withdrawn_and_started_on_a_node_with_room() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let front = Node::start_with(dir.path(), "front", &url, "capacity = 0").await;
    let mut b = Node::start(dir.path(), "node-b", &url).await;
    let c = Node::start(dir.path(), "node-c", &url).await;
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    assert_eq!(front.nodes().await.len(), 3);
    b.kill().await;
    let killed = Instant::now();
    let create = || async {
        let mut client = front.sessions().await;
        tokio::time::timeout(Duration::from_secs(30), client.create_session(create_agent_session()))
            .await
            .expect("a create is not held for a dead node's two minutes")
    };
    let (one, two) = tokio::join!(create(), create());
    let took = killed.elapsed();
    let (one, two) = (one.expect("started on node-c").into_inner(), two.expect("started on node-c").into_inner());
    assert!(took < Duration::from_secs(LEASE_SECONDS + 6), "both within node-b's lease and a look: {took:?}");
    let stored = stored_sessions(&db).await;
    let mut expected = vec![
        (one.session_id.clone(), "active".to_string(), Some("node-c".to_string())),
        (two.session_id.clone(), "active".to_string(), Some("node-c".to_string())),
    ];
    expected.sort();
    assert_eq!(stored, expected, "both on the node with room");
    let asked: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT state, error FROM node_requests WHERE node = 'node-b'").fetch_all(&db).await.unwrap();
    let withdrawn = ("done".to_string(), Some("withdrawn by its sender".to_string()));
    assert_eq!(asked, vec![withdrawn], "one of the two was handed to node-b first, and withdrawn");
    // node-b back: nothing for it to act on.
    b.restart().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(stored_sessions(&db).await, expected, "node-b started nothing");
    db.close().await;
    stop_all([front, b, c]).await;
    drop_database(&url).await;
}

/// A create handed to node-b, whose sender (a front end) died before it
/// could withdraw it, is still pending when node-b restarts: the new start
/// of node-b does not start it (nobody waits for it; it would run as an
/// orphan).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_never_starts_a_create_handed_to_its_previous_start() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    write_session_agent(dir.path());
    let mut front = Node::start_with(dir.path(), "front", &url, "capacity = 0").await;
    let mut b = Node::start(dir.path(), "node-b", &url).await;
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    assert_eq!(front.nodes().await.len(), 2);
    b.kill().await;
    let mut client = front.sessions().await;
    let creating = tokio::spawn(async move { client.create_session(create_agent_session()).await });
    let pending = || async {
        sqlx::query_as::<_, (String,)>(
            "SELECT subject FROM node_requests WHERE node = 'node-b' AND kind = 'create_session' AND state = 'pending'",
        )
        .fetch_optional(&db)
        .await
        .unwrap()
    };
    wait_until("the create handed to node-b", Duration::from_secs(3), async || pending().await.is_some()).await;
    let (session_id,) = pending().await.unwrap();
    // The sender dies waiting: the request stays pending.
    front.kill().await;
    assert!(creating.await.unwrap().is_err(), "its caller got no session");
    b.restart().await;
    wait_until("node-b's answer to the old request", Duration::from_secs(15), async || pending().await.is_none()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stored = stored_sessions(&db).await;
    assert!(stored.iter().all(|(id, _, _)| *id != session_id), "no session started for nobody: {stored:?}");
    db.close().await;
    stop_all([b]).await;
    drop(front);
    drop_database(&url).await;
}

/// Eighteen runs that only node-g (label `gpu`, capacity 1) may run queue
/// ahead of one plain run: node-n, idle, claims and runs the plain run at
/// once, the queue of work it cannot run ahead of it notwithstanding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_work_an_idle_node_can_run_is_not_hidden_behind_work_it_cannot() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let gpu = "id = \"test.gpu\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
               [sandbox]\ntype = \"linux_bwrap\"\n[limits]\ntimeout_seconds = 120\n[placement]\nlabels = [\"gpu\"]\n";
    std::fs::write(profiles.join("gpu.toml"), gpu).unwrap();
    let front = Node::start_with(dir.path(), "front", &url, "capacity = 0").await;
    let g = Node::start_with(dir.path(), "node-g", &url, "capacity = 1\nlabels = [\"gpu\"]").await;
    let n = Node::start_with(dir.path(), "node-n", &url, "capacity = 2").await;
    let mut on_front = front.executions().await;
    let mut gpu_runs = Vec::new();
    for _ in 0..18 {
        let started = on_front.start_execution(request("test.gpu", "sleep 100")).await.unwrap().into_inner();
        gpu_runs.push(started.execution_id);
    }
    let plain = on_front.start_execution(request("builtin.shell", "echo plain")).await.unwrap().into_inner();
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let (state, took) = until_finished(&front, &plain.execution_id, Duration::from_secs(15)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded, "after {took:?}");
    assert_eq!(store.node_of_execution(&plain.execution_id).await.unwrap().as_deref(), Some("node-n"));
    assert!(store.queued_count().await.unwrap() >= 16, "the gpu runs still queued");
    for id in gpu_runs {
        let cancel = pb::CancelExecutionRequest { execution_id: id };
        on_front.cancel_execution(cancel).await.unwrap();
    }
    stop_all([front, g, n]).await;
    drop_database(&url).await;
}

/// Eighteen runs of `narrow` (`max_running = 1`, its one run under way)
/// queue ahead of one run of `wide`: node-n, with room, claims and runs
/// `wide`'s at once, the queue of work whose principal is at its quota
/// ahead of it notwithstanding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_work_is_not_hidden_behind_work_of_a_principal_at_its_quota() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let principal = |name: &str, max_running: usize| {
        let token = format!("{name}-token-5e0b-4a8f-91c3-queue-window");
        let file = dir.path().join(format!("{name}.token"));
        std::fs::write(&file, &token).unwrap();
        let table = format!(
            "[[principals]]\nname = {name:?}\ntype = \"agt\"\nprojects = [\"proj-a\"]\ntoken_file = {:?}\n\
             max_running = {max_running}\n",
            file.display().to_string()
        );
        (token, table)
    };
    let (narrow, narrow_table) = principal("narrow", 1);
    let (wide, wide_table) = principal("wide", 5);
    let tables = format!("{narrow_table}{wide_table}");
    let front = Node::start_with(dir.path(), "front", &url, &format!("capacity = 0\n{tables}")).await;
    let n = Node::start_with(dir.path(), "node-n", &url, &format!("capacity = 2\n{tables}")).await;
    let mut on_front = front.executions().await;
    let mut narrow_runs = Vec::new();
    for _ in 0..19 {
        let run = common::with_token(&narrow, request("builtin.shell", "sleep 100"));
        narrow_runs.push(on_front.start_execution(run).await.unwrap().into_inner().execution_id);
    }
    let run = common::with_token(&wide, request("builtin.shell", "echo wide"));
    let plain = on_front.start_execution(run).await.unwrap().into_inner();
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let (state, took) = until_finished(&front, &plain.execution_id, Duration::from_secs(15)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded, "after {took:?}");
    assert_eq!(store.queued_count().await.unwrap(), 18, "narrow's runs past its quota still queued");
    for id in narrow_runs {
        let cancel = pb::CancelExecutionRequest { execution_id: id };
        on_front.cancel_execution(cancel).await.unwrap();
    }
    stop_all([front, n]).await;
    drop_database(&url).await;
}

/// A start declared lost (its lease ran out, a survivor swept it) stores
/// no session, however it creates one: the write is refused and no row is
/// left that no sweep would ever fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_epoch_stores_no_session() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::SessionRecord;
    use corral::types::Consumer;
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let lost = corral::store::Store::open(dir.path(), Some(&url), "lost").await.unwrap();
    let survivor = corral::store::Store::open(dir.path(), Some(&url), "survivor").await.unwrap();
    lost.join_fleet(1, &[], 1).await.unwrap();
    survivor.join_fleet(1, &[], 60_000).await.unwrap();
    let session = |id: &str| SessionRecord {
        session_id: id.into(),
        consumer: Consumer { principal: "p".into(), ..Default::default() },
        ..Default::default()
    };
    assert!(lost.insert_session(&session("s-before")).await.unwrap(), "a node that holds its lease stores one");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(survivor.claim_lost_nodes(corral::records::now_ms()).await.unwrap().len(), 1);
    let refused = lost.insert_session(&session("s-plain")).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "{refused}");
    let refused = lost.insert_session_admitted(&session("s-quota"), Some(10)).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "under a quota too: {refused}");
    let refused = lost.insert_session_admitted(&session("s-none"), None).await.unwrap_err();
    assert!(matches!(refused, corral::store::StoreError::Fenced { .. }), "without one too: {refused}");
    for id in ["s-plain", "s-quota", "s-none"] {
        assert!(survivor.get_session(id).await.unwrap().is_none(), "no row of {id}");
    }
    assert!(survivor.insert_session(&session("s-survivor")).await.unwrap(), "the survivor stores one");
    drop((lost, survivor));
    drop_database(&url).await;
}

/// Two nodes claim at once: the rows one holds in its claim's transaction
/// are passed over by the other, which claims the rows behind them rather
/// than nothing (its window counts only the rows it can lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_takes_the_rows_behind_those_another_claimer_holds() {
    let _serial = ONE_AT_A_TIME.lock().await;
    use corral::records::{ExecuteCommand, ExecutionRecord};
    use corral::store::{Admit, QueuedWork, Store};
    use corral::types::Consumer;
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let front = Store::open(dir.path(), Some(&url), "front").await.unwrap();
    let node = Store::open(dir.path(), Some(&url), "node").await.unwrap();
    front.join_fleet(0, &[], 60_000).await.unwrap();
    node.join_fleet(4, &[], 60_000).await.unwrap();
    let work = QueuedWork { command: ExecuteCommand::default(), traceparent: None, quota: None };
    for i in 0..40 {
        let record = ExecutionRecord {
            execution_id: format!("e{i:02}"),
            consumer: Consumer { principal: "p".into(), ..Default::default() },
            ..Default::default()
        };
        let admit = Admit { take_here: false, needs: &[], max_queued: 100, max_queued_per_principal: 100 };
        front.enqueue_execution(&record, &format!("digest-{i}"), &work, admit).await.unwrap();
    }
    // Another claimer holds the 16 oldest rows (as its claim does, in its
    // transaction).
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let mut other = db.begin().await.unwrap();
    sqlx::query("SELECT execution_id FROM queue ORDER BY queued_at_ms, execution_id LIMIT 16 FOR UPDATE")
        .fetch_all(&mut *other)
        .await
        .unwrap();
    let claimed = node.claim_queued(4, &[]).await.unwrap();
    let ids: Vec<String> = claimed.iter().map(|c| c.record.execution_id.clone()).collect();
    assert_eq!(ids.len(), 4, "the node claims its room's worth behind the held rows: {ids:?}");
    assert!(ids.iter().all(|id| id.as_str() >= "e16"), "none of the held rows: {ids:?}");
    other.rollback().await.unwrap();
    db.close().await;
    drop((front, node));
    drop_database(&url).await;
}

/// The bearer token of [`one_place_tenant`].
const TENANT_TOKEN: &str = "fleet-tenant-token-0123456789abcdef012345";

/// Config tables for principal `tenant` (`agt`, project `proj-a`, more of
/// its keys in `extra`), holding [`TENANT_TOKEN`], with one watch place per
/// principal.
fn one_place_tenant(dir: &Path, extra: &str) -> String {
    let token_file = dir.join("tenant.token");
    std::fs::write(&token_file, TENANT_TOKEN).unwrap();
    format!(
        "[grpc]\nmax_watchers_per_principal = 1\n\n[[principals]]\nname = \"tenant\"\ntype = \"agt\"\n\
         projects = [\"proj-a\"]\ntoken_file = {:?}\n{extra}",
        token_file.display().to_string()
    )
}

/// One principal cannot fill the fleet's queue for every other: past its
/// share (`max_queued_per_principal`) its next run is refused with
/// RESOURCE_EXHAUSTED naming it, while another principal still queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_principal_cannot_fill_the_fleets_queue() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let tenant = one_place_tenant(dir.path(), "");
    let front =
        Node::start_configured(dir.path(), "front", &url, "capacity = 0\nmax_queued_per_principal = 2", &tenant).await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 1", &tenant).await;
    let mut client = front.executions().await;
    let start = |script: &str| common::with_token(TENANT_TOKEN, request("builtin.shell", script));
    let busy = client.start_execution(start("sleep 60")).await.expect("node-b's one run").into_inner();
    let deadline = Instant::now() + Duration::from_secs(20);
    while state_of(&front, &busy.execution_id).await != pb::ExecutionState::Running {
        assert!(Instant::now() < deadline, "node-b never took the first run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut queued = Vec::new();
    let retried = |i: usize| {
        let mut request = start(&format!("echo {i}"));
        request.get_mut().request_id = format!("queued-{i}");
        request
    };
    for i in 0..2 {
        let started = client.start_execution(retried(i)).await.expect("queued").into_inner();
        assert_eq!(started.state, pb::ExecutionState::Pending as i32, "{started:?}");
        queued.push(started.execution_id);
    }
    let status = client.start_execution(start("echo past")).await.expect_err("past the principal's share");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("principal tenant has 2 executions in the fleet's queue"),
        "names the principal and its share: {status:?}"
    );
    // A retry of a queued run (its answer lost) starts nothing and is not
    // refused for the place its first copy fills: it gets that run.
    let again = client.start_execution(retried(1)).await.expect("a retry gets its execution").into_inner();
    assert_eq!((again.execution_id.as_str(), again.state), (queued[1].as_str(), pb::ExecutionState::Pending as i32));
    // Another principal (the local administrator) still queues.
    let other = client.start_execution(request("builtin.shell", "echo other")).await.expect("queued").into_inner();
    assert_eq!(other.state, pb::ExecutionState::Pending as i32, "{other:?}");
    for id in queued.into_iter().chain([busy.execution_id, other.execution_id]) {
        front.executions().await.cancel_execution(pb::CancelExecutionRequest { execution_id: id }).await.unwrap();
    }
    stop_all([front, b]).await;
}

/// The node that runs queued work checks the repository against its own
/// rules, not only the accepting node's: a front end lets the tenant use any
/// repository under the roots, node-b (which reloaded a narrower rule, or
/// was configured so) only those under `elsewhere`. The tenant's run is
/// refused at resolution on node-b, before any sandbox, and its repository
/// gets nothing; the administrator's run of the same repository there runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_runs_queued_work_only_on_a_repository_its_own_rules_allow() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let repo = common::git_repo();
    let narrower = format!("repos = [{:?}]\n", dir.path().join("elsewhere").display().to_string());
    let front =
        Node::start_configured(dir.path(), "front", &url, "capacity = 0", &one_place_tenant(dir.path(), "")).await;
    let b =
        Node::start_configured(dir.path(), "node-b", &url, "capacity = 1", &one_place_tenant(dir.path(), &narrower))
            .await;
    let mut client = front.executions().await;
    let mut req = request("builtin.shell", "echo ran > ran.txt && git add ran.txt");
    req.repo = repo.path().display().to_string();
    let tenant =
        client.start_execution(common::with_token(TENANT_TOKEN, req.clone())).await.expect("accepted").into_inner();
    assert_eq!(tenant.state, pb::ExecutionState::Pending as i32, "queued by the front end: {tenant:?}");
    let (state, _) = until_finished(&front, &tenant.execution_id, Duration::from_secs(60)).await;
    let get = pb::GetExecutionRequest { execution_id: tenant.execution_id.clone(), ..Default::default() };
    let record = client.get_execution(get).await.unwrap().into_inner();
    assert_eq!(state, pb::ExecutionState::Refused, "{record:?}");
    let evidence = record.evidence.expect("evidence");
    assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32, "{evidence:?}");
    assert!(evidence.error.contains("is not an allowed repository on node node-b"), "{evidence:?}");
    assert!(evidence.sandbox_id.is_empty(), "a sandbox was made: {evidence:?}");
    let refs = common::git(repo.path(), &["for-each-ref", "refs/corral/"]);
    assert!(refs.is_empty(), "the refused run brought work back: {refs}");
    // The administrator has no narrower rule on node-b: the same repository runs.
    let admin = client.start_execution(req).await.expect("accepted").into_inner();
    let (state, _) = until_finished(&front, &admin.execution_id, Duration::from_secs(60)).await;
    assert_eq!(state, pb::ExecutionState::Succeeded, "the administrator's run of the same repository");
    let refs = common::git(repo.path(), &["for-each-ref", "--format=%(refname)", "refs/corral/"]);
    assert_eq!(refs, format!("refs/corral/{}", admin.execution_id));
    stop_all([front, b]).await;
}

/// The stream of an `Execute` queued on a front end is a watcher of its
/// principal's: one past `max_watchers_per_principal` is refused with
/// RESOURCE_EXHAUSTED naming it, and nothing is queued for it (a caller
/// told no never has work run behind its back); the place comes back when
/// the stream goes. The local administrator is not bounded so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_execute_past_its_principals_watch_places_is_refused_and_queues_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let tenant = one_place_tenant(dir.path(), "");
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", &tenant).await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 2", &tenant).await;
    let mut client = front.executions().await;
    let run = |script: &str| common::with_token(TENANT_TOKEN, request("builtin.shell", script));
    let mut held = client.execute(run("sleep 30")).await.expect("the first").into_inner();
    let first = held.message().await.unwrap().expect("its first event").subject_id;
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let before = store.row_counts().await.unwrap();
    let status = client.execute(run("echo never")).await.expect_err("a second stream");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("principal tenant holds 1 watch streams"), "{status:?}");
    assert_eq!(store.row_counts().await.unwrap(), before, "the refused Execute queued or stored something");
    // A StartExecution has no stream: it takes no place, and is queued.
    let started = client.start_execution(run("echo started")).await.expect("no stream, no place").into_inner();
    assert_eq!(started.state, pb::ExecutionState::Pending as i32, "{started:?}");
    // The operator is not a tenant: its places are not bounded so.
    let mut admin =
        client.execute(request("builtin.shell", "echo admin")).await.expect("the local admin's").into_inner();
    admin.message().await.unwrap().expect("its first event");
    drop(admin);
    drop(held);
    let mut again = common::once_admitted("the place was not given back", || {
        let mut client = client.clone();
        async move { client.execute(run("echo again")).await.map(|stream| stream.into_inner()) }
    })
    .await;
    let mut last = None;
    while let Some(event) = again.message().await.unwrap() {
        last = Some(event);
    }
    let record = common::finished(&[last.expect("events")]);
    assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    let cancel = pb::CancelExecutionRequest { execution_id: first };
    front.executions().await.cancel_execution(cancel).await.unwrap();
    stop_all([front, b]).await;
}

/// On a node with room, an Execute its principal's fleet-wide quota holds
/// back is queued, and its stream is a watcher then: past the principal's
/// places it is refused and nothing is queued. A run the node takes holds
/// no place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execute_held_back_by_its_quota_on_a_node_with_room_needs_a_watch_place_first() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    let tenant = one_place_tenant(dir.path(), "max_running = 1\n");
    let a = Node::start_configured(dir.path(), "node-a", &url, "capacity = 4", &tenant).await;
    let mut client = a.executions().await;
    let run = |script: &str| common::with_token(TENANT_TOKEN, request("builtin.shell", script));
    // Taken here: its stream holds no place.
    let marker = format!("fleet-quota-{}", uuid::Uuid::now_v7().simple());
    let script = format!("echo started; exec sh -c 'sleep 600; :' {marker}");
    let mut running = client.execute(run(&script)).await.expect("the first").into_inner();
    wait_for("the first run's harness", Duration::from_secs(30), || !processes_with(&marker).is_empty()).await;
    let first = running.message().await.unwrap().expect("its first event").subject_id;
    // At its quota: queued, and its stream takes the one place.
    let mut queued = client.execute(run("echo queued")).await.expect("the second").into_inner();
    // Its first event comes when it is claimed, once the first ends.
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let before = store.row_counts().await.unwrap();
    // Three times: each refused Execute gives back the slot it held here.
    for _ in 0..3 {
        let status = client.execute(run("echo never")).await.expect_err("a third");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("principal tenant holds 1 watch streams"), "{status:?}");
    }
    assert_eq!(store.row_counts().await.unwrap(), before, "the refused Execute queued or stored something");
    // Of node-a's 4 slots the tenant's first run holds one: the local
    // administrator's run (no quota) is taken here at once, not queued.
    let admin = client.start_execution(request("builtin.shell", "echo admin")).await.expect("admin's").into_inner();
    assert_eq!(admin.state, pb::ExecutionState::Running as i32, "node-a's slots were held by refused calls: {admin:?}");
    let cancel = pb::CancelExecutionRequest { execution_id: first };
    a.executions().await.cancel_execution(common::with_token(TENANT_TOKEN, cancel)).await.unwrap();
    let mut last = None;
    while let Some(event) = queued.message().await.unwrap() {
        last = Some(event);
    }
    let record = common::finished(&[last.expect("events")]);
    assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "the queued one ran: {record:?}");
    drop(running);
    stop_all([a]).await;
}

/// A TCP relay to PostgreSQL that cuts one connection right after
/// relaying the `COMMIT` of a transaction that ran `statement` (sent
/// whole, NUL-terminated, the first time a connection prepares it), before
/// PostgreSQL's answer: the transaction lands, its answer is lost, as to a
/// reset connection or a failover.
struct CommitCutter {
    /// The database URL through the relay.
    url: String,
    /// Set once a commit was cut.
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl CommitCutter {
    async fn start(url: &str, statement: &'static [u8]) -> CommitCutter {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let (head, rest) = url.rsplit_once('@').expect("a URL with credentials");
        let (upstream, path) = rest.split_once('/').expect("a URL with a database");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let through = format!("{head}@{}/{path}", listener.local_addr().unwrap());
        let cut = Arc::new(AtomicBool::new(false));
        let (upstream, armed) = (upstream.to_string(), cut.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(Self::relay(client, upstream.clone(), armed.clone(), statement));
            }
        });
        CommitCutter { url: through, cut, task }
    }

    async fn relay(
        client: tokio::net::TcpStream,
        upstream: String,
        cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
        statement: &'static [u8],
    ) {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { return };
        let (mut client_in, mut client_out) = client.into_split();
        let (mut server_in, mut server_out) = server.into_split();
        let silenced = std::sync::Arc::new(AtomicBool::new(false));
        let quiet = silenced.clone();
        let answers = async move {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n @ 1..) = server_in.read(&mut buf).await {
                if quiet.load(Ordering::SeqCst) || client_out.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let has = |data: &[u8], what: &[u8]| data.windows(what.len()).any(|w| w == what);
        let queries = async move {
            let mut claiming = false;
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n @ 1..) = client_in.read(&mut buf).await {
                let data = &buf[..n];
                // The statement, up to the end of its transaction.
                claiming |= has(data, statement);
                if has(data, b"ROLLBACK") {
                    claiming = false;
                }
                let ends = has(data, b"COMMIT");
                let commit = claiming && ends && !cut.swap(true, Ordering::SeqCst);
                claiming &= !ends;
                if commit {
                    silenced.store(true, Ordering::SeqCst);
                }
                if server_out.write_all(data).await.is_err() {
                    return;
                }
                if commit {
                    // PostgreSQL commits meanwhile; then both sides close.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return;
                }
            }
        };
        tokio::select! { () = answers => {}, () = queries => {} }
    }
}

impl Drop for CommitCutter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A claim whose commit lands but whose answer is lost still runs what it
/// claimed: the claiming node reads whether its commit landed, rather than
/// leave the claimed run `running` on it, its queued work deleted, with
/// nothing running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_commit_answer_is_lost_runs_its_work() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    // The claim's own statement: a fresh node's first claim prepares it.
    let relay = CommitCutter::start(&url, b"DELETE FROM queue WHERE execution_id = $1 RETURNING work\0").await;
    let front = Node::start_configured(dir.path(), "front", &url, "capacity = 0", "").await;
    let b = Node::start_configured(dir.path(), "node-b", &relay.url, "capacity = 1", "").await;
    let mut client = front.executions().await;
    let queued = client.start_execution(request("builtin.shell", "echo claimed")).await.expect("queued").into_inner();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = state_of(&front, &queued.execution_id).await;
        if state == pb::ExecutionState::Succeeded {
            break;
        }
        assert!(Instant::now() < deadline, "the claimed run is {state:?}, with nothing running it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(relay.cut.load(std::sync::atomic::Ordering::SeqCst), "no claim's commit was cut: the test tested nothing");
    let log = std::fs::read_to_string(b.data.with_extension("log")).unwrap_or_default();
    assert!(
        log.contains("a claim's commit answered an error but landed"),
        "node-b ran it another way:
{log}"
    );
    stop_all([front, b]).await;
}

/// A turn forwarded to the node that runs its session, whose caller left
/// before the answer (its deadline passed while that node was stopped),
/// still runs there once that node answers in time, and the node that
/// forwarded it writes its audit line: the forward is the engine's work,
/// not the call's, so a short deadline is no way around the audit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_turn_whose_caller_left_runs_and_is_audited() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let SessionOnB { a, b, session, mut on_a, _dir } = session_on_b().await;
    let turn = |text: &str| echo_turn(&session.session_id, text);
    let mut left = tonic::Request::new(turn("left"));
    left.set_timeout(Duration::from_millis(500));
    // Well within the forward's 10 s.
    let gone = while_stopped(&b, on_a.send_turn(left)).await;
    let status = gone.expect_err("the caller's deadline passed while node-b was stopped");
    assert!(matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled), "{status:?}");
    let line = format!("subject=\"{}\"", session.session_id);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(a.data.with_extension("log")).unwrap_or_default();
        if log.lines().any(|l| l.contains("corral::audit") && l.contains("rpc=\"SendTurn\"") && l.contains(&line)) {
            break;
        }
        assert!(Instant::now() < deadline, "node-a never audited the turn it forwarded:\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // It ran: the next turn is the session's second.
    let events = loop {
        match on_a.send_turn(turn("next")).await {
            Ok(stream) => break stream_to_end(stream.into_inner()).await,
            // The forwarded turn may still be in flight.
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                assert!(Instant::now() < deadline, "{status:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    let finished = match events.last().and_then(|e| e.kind.clone()) {
        Some(pb::lifecycle_event::Kind::TurnFinished(t)) => *t,
        other => panic!("the turn's stream ends with turn_finished, not {other:?}"),
    };
    assert_eq!((finished.turn, finished.ok), (2, true), "the left caller's turn did not run first: {finished:?}");
    let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
    on_a.end_session(end).await.expect("node-a forwards EndSession");
    stop_all([a, b]).await;
}

/// A cancel of a queued run whose commit lands but whose answer is lost
/// still cancels it: the node that took it out of the queue asks whether
/// its commit landed, rather than leave the run `pending` in no queue,
/// which no node would ever claim or finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_whose_commit_answer_is_lost_still_cancels() {
    let _serial = ONE_AT_A_TIME.lock().await;
    require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let dir = common::data_tempdir();
    // The cancel's own statement (the claim's goes on with RETURNING).
    let relay = CommitCutter::start(&url, b"DELETE FROM queue WHERE execution_id = $1\0").await;
    let front = Node::start_configured(dir.path(), "front", &relay.url, "capacity = 0", "").await;
    let b = Node::start_configured(dir.path(), "node-b", &url, "capacity = 1", "").await;
    let mut client = front.executions().await;
    // node-b's one place is taken: the next run waits in the queue.
    let busy = client.start_execution(request("builtin.shell", "sleep 60")).await.expect("node-b's run").into_inner();
    let deadline = Instant::now() + Duration::from_secs(20);
    while state_of(&front, &busy.execution_id).await != pb::ExecutionState::Running {
        assert!(Instant::now() < deadline, "node-b never took the first run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let queued = client.start_execution(request("builtin.shell", "echo never")).await.expect("queued").into_inner();
    assert_eq!(queued.state, pb::ExecutionState::Pending as i32, "{queued:?}");
    let cancel = pb::CancelExecutionRequest { execution_id: queued.execution_id.clone() };
    let cancelled = client.cancel_execution(cancel).await.expect("cancelled, its commit landed").into_inner();
    assert_eq!(cancelled.state, pb::ExecutionState::Cancelled as i32, "{cancelled:?}");
    assert_eq!(state_of(&front, &queued.execution_id).await, pb::ExecutionState::Cancelled);
    assert!(relay.cut.load(std::sync::atomic::Ordering::SeqCst), "no cancel's commit was cut: the test tested nothing");
    let log = std::fs::read_to_string(front.data.with_extension("log")).unwrap_or_default();
    assert!(log.contains("a cancel's commit answered an error but landed"), "the cancel went another way:\n{log}");
    client.cancel_execution(pb::CancelExecutionRequest { execution_id: busy.execution_id }).await.expect("cancelled");
    stop_all([front, b]).await;
}
