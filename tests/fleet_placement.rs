//! Where a fleet places work, through real daemons on one real
//! PostgreSQL: a session create handed to a node killed but not yet swept
//! is withdrawn and started on a node with room; a restarted node never
//! acts on a create handed to its previous start; queued work an idle node
//! can run is claimed however much work it cannot run is queued ahead of
//! it; a lost epoch stores no session.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{request, require_bwrap, ServeProcess};
use corral::pb;
use corral::pb::catalog_service_client::CatalogServiceClient;
use corral::pb::execution_service_client::ExecutionServiceClient;
use corral::pb::session_service_client::SessionServiceClient;

const LEASE_SECONDS: u64 = 4;

/// One test of this file at a time: each runs two or three daemons with
/// short leases, and more at once on a 2-core machine starve a node's
/// renewals into fencing it.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A node: a daemon process on the shared database `url`, named `name`.
struct Node {
    name: String,
    data: PathBuf,
    profiles: PathBuf,
    config: String,
    process: ServeProcess,
}

impl Node {
    /// A node whose `[fleet]` section also holds `fleet` (e.g.
    /// `capacity = 0`).
    async fn start(dir: &Path, name: &str, url: &str, fleet: &str) -> Node {
        let data = dir.join(name);
        let profiles = dir.join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        // ServeProcess keeps the store URL a config of this data directory
        // already names.
        if !data.with_extension("toml").exists() {
            std::fs::write(data.with_extension("toml"), format!("[store]\nurl = {url:?}\n")).unwrap();
        }
        let config = format!("[fleet]\nnode = {name:?}\nlease_seconds = {LEASE_SECONDS}\n{fleet}\n");
        let process = ServeProcess::start_wrapped(&data, &profiles, &[], &config, &[]).await;
        Node { name: name.into(), data, profiles, config, process }
    }

    /// Starts this node's data directory again (after it was killed).
    async fn restart(&mut self) {
        self.process = ServeProcess::start_wrapped(&self.data, &self.profiles, &[], &self.config, &[]).await;
    }

    /// SIGKILL, and its exit awaited.
    async fn kill(&mut self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.process.pid(), libc::SIGKILL) };
        self.process.child.wait().await.unwrap();
    }

    async fn executions(&self) -> ExecutionServiceClient<tonic::transport::Channel> {
        ExecutionServiceClient::new(self.process.channel().await)
    }

    async fn sessions(&self) -> SessionServiceClient<tonic::transport::Channel> {
        SessionServiceClient::new(self.process.channel().await)
    }

    async fn nodes(&self) -> Vec<pb::Node> {
        let mut catalog = CatalogServiceClient::new(self.process.channel().await);
        catalog.list_nodes(pb::ListNodesRequest {}).await.unwrap().into_inner().nodes
    }
}

/// Stops the nodes gracefully, so that what they still run (sessions,
/// sandboxes, their cgroups) is destroyed rather than left behind.
async fn stop_all(nodes: Vec<Node>) {
    for node in nodes {
        let name = node.name.clone();
        assert!(node.process.stop().await.is_some_and(|s| s.success()), "{name} did not stop on SIGTERM");
    }
}

/// Drops the test's database (its daemons stopped or killed).
async fn drop_database(url: &str) {
    use sqlx::Connection;
    let name = url.rsplit_once('/').map(|(_, name)| name).unwrap();
    let mut admin = sqlx::PgConnection::connect(&common::postgres_admin_url()).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut admin).await.unwrap();
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The nodes' profile `test.session-agent`, the tests' session harness.
fn write_session_agent(dir: &Path) {
    std::fs::create_dir_all(dir.join("profiles")).unwrap();
    std::fs::write(dir.join("profiles/agent.toml"), common::session_agent_profile("test.session-agent", "")).unwrap();
}

fn create_agent_session() -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        profile_ref: "test.session-agent".into(),
        project: "proj-a".into(),
        ..Default::default()
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
    let front = Node::start(dir.path(), "front", &url, "capacity = 0").await;
    let mut b = Node::start(dir.path(), "node-b", &url, "").await;
    let c = Node::start(dir.path(), "node-c", &url, "").await;
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
    stop_all(vec![front, b, c]).await;
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
    let mut front = Node::start(dir.path(), "front", &url, "capacity = 0").await;
    let mut b = Node::start(dir.path(), "node-b", &url, "").await;
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
    wait_for("the create handed to node-b", Duration::from_secs(3), async || pending().await.is_some()).await;
    let (session_id,) = pending().await.unwrap();
    // The sender dies waiting: the request stays pending.
    front.kill().await;
    assert!(creating.await.unwrap().is_err(), "its caller got no session");
    b.restart().await;
    wait_for("node-b's answer to the old request", Duration::from_secs(15), async || pending().await.is_none()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stored = stored_sessions(&db).await;
    assert!(stored.iter().all(|(id, _, _)| *id != session_id), "no session started for nobody: {stored:?}");
    db.close().await;
    stop_all(vec![b]).await;
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
    let front = Node::start(dir.path(), "front", &url, "capacity = 0").await;
    let g = Node::start(dir.path(), "node-g", &url, "capacity = 1\nlabels = [\"gpu\"]").await;
    let n = Node::start(dir.path(), "node-n", &url, "capacity = 2").await;
    let mut on_front = front.executions().await;
    let mut gpu_runs = Vec::new();
    for _ in 0..18 {
        let started = on_front.start_execution(request("test.gpu", "sleep 100")).await.unwrap().into_inner();
        gpu_runs.push(started.execution_id);
    }
    let plain = on_front.start_execution(request("builtin.shell", "echo plain")).await.unwrap().into_inner();
    let sent = Instant::now();
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let state = async || {
        let get = pb::GetExecutionRequest { execution_id: plain.execution_id.clone(), ..Default::default() };
        let record = front.executions().await.get_execution(get).await.unwrap().into_inner();
        pb::ExecutionState::try_from(record.state).unwrap()
    };
    wait_for("the plain run finished", Duration::from_secs(15), async || {
        !matches!(state().await, pb::ExecutionState::Pending | pb::ExecutionState::Running)
    })
    .await;
    assert_eq!(state().await, pb::ExecutionState::Succeeded, "after {:?}", sent.elapsed());
    assert_eq!(store.node_of_execution(&plain.execution_id).await.unwrap().as_deref(), Some("node-n"));
    assert!(store.queued_count().await.unwrap() >= 16, "the gpu runs still queued");
    for id in gpu_runs {
        let cancel = pb::CancelExecutionRequest { execution_id: id };
        on_front.cancel_execution(cancel).await.unwrap();
    }
    stop_all(vec![front, g, n]).await;
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
    let front = Node::start(dir.path(), "front", &url, &format!("capacity = 0\n{tables}")).await;
    let n = Node::start(dir.path(), "node-n", &url, &format!("capacity = 2\n{tables}")).await;
    let mut on_front = front.executions().await;
    let mut narrow_runs = Vec::new();
    for _ in 0..19 {
        let run = common::with_token(&narrow, request("builtin.shell", "sleep 100"));
        narrow_runs.push(on_front.start_execution(run).await.unwrap().into_inner().execution_id);
    }
    let run = common::with_token(&wide, request("builtin.shell", "echo wide"));
    let plain = on_front.start_execution(run).await.unwrap().into_inner();
    let sent = Instant::now();
    let store = corral::store::Store::open(dir.path(), Some(&url), "test-reader").await.unwrap();
    let state = async || {
        let get = pb::GetExecutionRequest { execution_id: plain.execution_id.clone(), ..Default::default() };
        let record = front.executions().await.get_execution(get).await.unwrap().into_inner();
        pb::ExecutionState::try_from(record.state).unwrap()
    };
    wait_for("wide's run finished", Duration::from_secs(15), async || {
        !matches!(state().await, pb::ExecutionState::Pending | pb::ExecutionState::Running)
    })
    .await;
    assert_eq!(state().await, pb::ExecutionState::Succeeded, "after {:?}", sent.elapsed());
    assert_eq!(store.queued_count().await.unwrap(), 18, "narrow's runs past its quota still queued");
    for id in narrow_runs {
        let cancel = pb::CancelExecutionRequest { execution_id: id };
        on_front.cancel_execution(cancel).await.unwrap();
    }
    stop_all(vec![front, n]).await;
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
