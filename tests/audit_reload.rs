//! Refusals are audited, and principals reload on SIGHUP: against a real
//! `corral serve` with two tenants from `principals_dir`, each refusal
//! (anonymous, permission denied, another project's record) leaves one
//! `corral::audit` line without any secret or task text; revoking tenant-b's
//! file and sending SIGHUP refuses its next call on the same connection
//! while tenant-a's running execution goes on; a broken file on the next
//! SIGHUP keeps the set in force and the log says why.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::ServeProcess;
use corral::pb::{self, execution_service_client::ExecutionServiceClient};
use sha2::{Digest, Sha256};
use tonic::Code;

const TITLE: &str = "SECRET-TITLE-TEXT-7d1f";

fn token(c: char) -> String {
    std::iter::repeat_n(c, 48).collect()
}

fn principal_file(dir: &Path, name: &str, project: &str, token: &str) {
    let digest: String = Sha256::digest(token.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
    let text = format!("name = {name:?}\ntype = \"agt\"\nprojects = [{project:?}]\ntoken_sha256 = {digest:?}\n");
    std::fs::write(dir.join(format!("{name}.toml")), text).unwrap();
}

fn as_tenant<T>(token: Option<&str>, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

async fn get(
    client: &mut ExecutionServiceClient<tonic::transport::Channel>,
    token: Option<&str>,
    id: &str,
) -> Result<pb::Execution, Code> {
    let req = pb::GetExecutionRequest { execution_id: id.into(), ..Default::default() };
    client.get_execution(as_tenant(token, req)).await.map(|r| r.into_inner()).map_err(|s| s.code())
}

/// Waits until the daemon's log holds `needle` `times` times.
async fn log_until(log: &Path, needle: &str, times: usize) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.matches(needle).count() >= times {
            return text;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the log never said {needle:?} {times}×:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What `call` gives while another writer holds the write lock of the
/// daemon's SQLite store in `data` (the daemon's writes wait: its busy
/// timeout is 10 s); the lock is let go once `call` returned.
async fn while_store_locked<T>(data: &Path, call: impl std::future::Future<Output = T>) -> T {
    use sqlx::Connection;
    let db = format!("sqlite://{}", data.join("corral.db").display());
    let mut holder = sqlx::SqliteConnection::connect(&db).await.expect("the daemon's SQLite store");
    sqlx::query("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let answer = call.await;
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    answer
}

fn hup(daemon: &ServeProcess) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGHUP) };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_audited_and_a_sighup_revokes_a_token_without_dropping_work() {
    common::require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), common::fake_agent_profile("test.fake-agent", "")).unwrap();
    let principals = dir.path().join("principals.d");
    std::fs::create_dir_all(&principals).unwrap();
    let (a, b) = (token('a'), token('b'));
    principal_file(&principals, "tenant-a", "pa", &a);
    principal_file(&principals, "tenant-b", "pb", &b);
    let data = dir.path().join("data");
    let log = data.with_extension("log");
    let extra = format!("principals_dir = {:?}", principals.display().to_string());
    let mut daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    // One TCP connection for every call: a revocation must hold on it too.
    let channel = tonic::transport::Endpoint::from_shared(daemon.url.clone()).unwrap().connect().await.unwrap();
    let mut client = ExecutionServiceClient::new(channel);

    let mut start = common::request("test.fake-agent", "NOWORK\nHANG");
    start.title = TITLE.into();
    start.project = "pa".into();
    let running =
        client.start_execution(as_tenant(Some(&a), start.clone())).await.expect("tenant-a starts").into_inner();
    let id = running.execution_id.clone();

    assert_eq!(get(&mut client, None, &id).await.unwrap_err(), Code::Unauthenticated);
    assert_eq!(get(&mut client, Some(&b), &id).await.unwrap_err(), Code::NotFound, "another project's record");
    let refused = client.start_execution(as_tenant(Some(&b), start.clone())).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let text = log_until(&log, "corral::audit", 4).await;
    for expected in [
        "principal=\"anonymous\" rpc=\"ExecutionService/GetExecution\" code=\"UNAUTHENTICATED\"",
        "principal=\"tenant-b\" rpc=\"ExecutionService/GetExecution\" code=\"NOT_FOUND\"",
        "principal=\"tenant-b\" rpc=\"ExecutionService/StartExecution\" code=\"PERMISSION_DENIED\"",
    ] {
        assert!(text.contains(expected), "the audit says {expected:?}:\n{text}");
    }

    // Revoke tenant-b; tenant-a's run is not touched.
    std::fs::remove_file(principals.join("tenant-b.toml")).unwrap();
    hup(&daemon);
    log_until(&log, "SIGHUP: principals reloaded", 1).await;
    assert_eq!(get(&mut client, Some(&b), &id).await.unwrap_err(), Code::Unauthenticated, "revoked");
    let record = get(&mut client, Some(&a), &id).await.expect("tenant-a still known");
    assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Running, "work goes on");
    log_until(&log, "principal=\"anonymous\" rpc=\"ExecutionService/GetExecution\" code=\"UNAUTHENTICATED\"", 2).await;

    // A broken file: the reload fails, naming it, and the set stays.
    std::fs::write(principals.join("tenant-c.toml"), "name = \n").unwrap();
    hup(&daemon);
    let text = log_until(&log, "SIGHUP: principals not reloaded", 1).await;
    assert!(text.contains("tenant-c.toml"), "the failure names the file:\n{text}");
    assert!(get(&mut client, Some(&a), &id).await.is_ok(), "the previous set is still in force");
    assert_eq!(get(&mut client, Some(&b), &id).await.unwrap_err(), Code::Unauthenticated);

    let cancel = pb::CancelExecutionRequest { execution_id: id.clone() };
    client.cancel_execution(as_tenant(Some(&a), cancel)).await.expect("tenant-a cancels its run");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    for secret in [a.as_str(), b.as_str(), TITLE, "HANG"] {
        assert!(!text.contains(secret), "the log holds {secret:?}:\n{text}");
    }
}

/// A turn is audited as the calls that start, cancel or end a session are:
/// one `corral::audit` line with the principal, `rpc="SendTurn"` and the
/// session's id, never the turn's arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_audited() {
    use corral::pb::session_service_client::SessionServiceClient;
    common::require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("agent.toml"), common::session_agent_profile("test.session", "")).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.session".into(), ..Default::default() };
    let session = sessions.create_session(create).await.expect("session created").into_inner();
    let id = session.session_id;
    let call = pb::ToolCall { tool: "prompt".into(), arguments_json: format!(r#"{{"echo": "{TITLE}"}}"#) };
    let turn = pb::SendTurnRequest { session_id: id.clone(), tool_call: Some(call) };
    let mut stream = sessions.send_turn(turn).await.expect("turn sent").into_inner();
    while stream.message().await.expect("turn events").is_some() {}
    let text = log_until(&data.with_extension("log"), "rpc=\"SendTurn\"", 1).await;
    let line = text.lines().find(|l| l.contains("rpc=\"SendTurn\"")).unwrap();
    assert!(line.contains("corral::audit") && line.contains(&format!("subject=\"{id}\"")), "{line}");
    assert!(!text.contains(TITLE), "the turn's arguments are in the log:\n{text}");
    sessions.end_session(pb::EndSessionRequest { session_id: id }).await.expect("session ended");
    daemon.stop().await;
}

/// A session refused at its start is stored (as refused) and audited
/// like one that starts: a profile whose harness cannot take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_refused_at_its_start_is_audited() {
    use corral::pb::session_service_client::SessionServiceClient;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "builtin.shell".into(), ..Default::default() };
    let status = sessions.create_session(create).await.expect_err("builtin.shell takes no turns");
    assert!(status.message().contains("cannot take turns"), "{status:?}");
    let text = log_until(&data.with_extension("log"), "rpc=\"CreateSession\"", 1).await;
    let line = text.lines().find(|l| l.contains("rpc=\"CreateSession\"")).unwrap();
    let id = line.split("subject=\"").nth(1).and_then(|rest| rest.split('"').next()).unwrap_or_default().to_string();
    assert!(line.contains("corral::audit") && !id.is_empty(), "{line}");
    let stored = sessions.get_session(pb::GetSessionRequest { session_id: id.clone() }).await.expect("stored");
    assert_eq!(stored.into_inner().state, pb::SessionState::Refused as i32, "the audited id is the stored session");
    daemon.stop().await;
}

/// Draining a node changes what it takes: audited like the calls that
/// start, cancel or end something (the node's name as the subject), by
/// the task that drains it: here the caller's deadline passes while
/// another writer holds the store, and the drain, done once the store is
/// free, still has its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_is_audited() {
    use corral::pb::catalog_service_client::CatalogServiceClient;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut catalog = CatalogServiceClient::new(daemon.channel().await);
    let nodes = catalog.list_nodes(pb::ListNodesRequest {}).await.expect("nodes").into_inner().nodes;
    let name = nodes.first().expect("this daemon's node").name.clone();
    let mut drain = tonic::Request::new(pb::DrainNodeRequest { name: name.clone() });
    drain.set_timeout(Duration::from_millis(300));
    let gone = while_store_locked(&data, catalog.drain_node(drain)).await.expect_err("the deadline passed first");
    assert!(matches!(gone.code(), Code::DeadlineExceeded | Code::Cancelled), "{gone:?}");
    let text = log_until(&data.with_extension("log"), "rpc=\"DrainNode\"", 1).await;
    let line = text.lines().find(|l| l.contains("rpc=\"DrainNode\"")).unwrap();
    assert!(line.contains("corral::audit") && line.contains(&format!("subject=\"{name}\"")), "{line}");
    let nodes = catalog.list_nodes(pb::ListNodesRequest {}).await.expect("nodes").into_inner().nodes;
    assert_eq!(nodes[0].state, pb::NodeState::Draining as i32, "the audited drain was done: {nodes:?}");
    daemon.stop().await;
}

/// A call whose caller goes away before its answer (here its deadline
/// passes while another writer holds the store) still leaves its audit
/// line for the execution it started: what runs was always audited, and
/// a short deadline is no way around the audit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_whose_caller_left_before_its_answer_is_audited() {
    common::require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut start = tonic::Request::new(common::request("builtin.shell", "echo audited"));
    start.set_timeout(Duration::from_millis(300));
    let gone = while_store_locked(&data, client.start_execution(start)).await.expect_err("the deadline passed first");
    // The client's own timer may answer first (CANCELLED), the server's
    // (DEADLINE_EXCEEDED) otherwise: the server drops the call either way.
    assert!(matches!(gone.code(), Code::DeadlineExceeded | Code::Cancelled), "{gone:?}");
    let id = loop {
        let listed = client.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
        if let Some(execution) = listed.executions.first() {
            break execution.execution_id.clone();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text = log_until(&data.with_extension("log"), &format!("subject=\"{id}\""), 1).await;
    let line = text.lines().find(|l| l.contains(&format!("subject=\"{id}\""))).unwrap();
    assert!(line.contains("corral::audit") && line.contains("rpc=\"StartExecution\""), "{line}");
    daemon.stop().await;
}
