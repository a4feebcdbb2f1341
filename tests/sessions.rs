//! SessionService and the policy gate over real gRPC (issue 3's acceptance
//! list): forced sandboxes that hold from inside the harness, whatever the
//! policy's source; tighten-only merges; restarts that pass the gate again;
//! denials at agent_start and tool_call; in-harness policy requests; CEL
//! errors at load and at run time; reaping; EvaluateGate as a faithful dry
//! run; and the session's own RPCs (EndSession, CancelTurn).

mod common;

use std::time::{Duration, Instant};

use common::faults::{bwrap_with, BackendFaults};
use common::{git, git_repo, kinds, require_bwrap, Options, TestDaemon, FIXTURES};
use corral::pb;
use corral::pb::lifecycle_event::Kind;
use corral::pb::session_service_client::SessionServiceClient;
use corral::policy::PolicySpec;
use serde_json::{json, Value};
use tempfile::TempDir;
use tonic::transport::Channel;
use tonic::Code;
use tonic_types::StatusExt;

/// How long any one stream may take before the test calls it a hang.
const STREAM_LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// profiles

/// The enforce_sandbox policy of the issue, as a profile guardrail.
const FORCE_BWRAP_GUARDRAIL: &str = r#"
[[guardrails.policies]]
name = "force-bwrap"
kind = "enforce_sandbox"
arguments = { sandbox_type = "linux_bwrap", allow_network = false, write_paths = ["."] }
"#;

/// A `none` profile (network on, workspace writable) running the session
/// agent from the workspace: `none` cannot restrict reads, so the script
/// comes with the session's repository (see [`agent_repo`]).
fn none_profile(id: &str, extra: &str) -> String {
    format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/usr/bin/python3", "session_agent.py"]
input = "task_json"
[sandbox]
type = "none"
allow_network = true
write_paths = ["."]
[limits]
timeout_seconds = 60
max_output_bytes = 65536
{extra}
"#
    )
}

/// A `linux_bwrap` profile (no network, workspace writable) running the
/// session agent from the fixtures directory.
fn bwrap_profile(id: &str, extra: &str) -> String {
    common::session_agent_profile(id, extra)
}

/// A repository holding `session_agent.py`, so that a workspace cloned from
/// it can run the agent under any backend (cwd is the workspace).
fn agent_repo() -> TempDir {
    let repo = git_repo();
    std::fs::copy(format!("{FIXTURES}/session_agent.py"), repo.path().join("session_agent.py")).unwrap();
    git(repo.path(), &["add", "."]);
    git(repo.path(), &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "agent"]);
    repo
}

fn repo_path(repo: &TempDir) -> String {
    repo.path().to_string_lossy().into_owned()
}

fn force_bwrap_spec(name: &str) -> PolicySpec {
    PolicySpec {
        name: name.into(),
        kind: "enforce_sandbox".into(),
        arguments: json!({"sandbox_type": "linux_bwrap", "allow_network": false, "write_paths": ["."]}),
        on: vec![],
    }
}

fn wire_policy(name: &str, kind: pb::PolicyKind, arguments: Value) -> pb::PolicySpec {
    pb::PolicySpec { name: name.into(), kind: kind as i32, arguments_json: arguments.to_string(), on: vec![] }
}

fn daemon_options(profiles: Vec<(&str, String)>) -> Options {
    Options { profiles: profiles.into_iter().map(|(n, t)| (n.to_string(), t)).collect(), ..Options::default() }
}

/// A session id unique to this test process and `tag` (host-wide searches
/// by `CORRAL_SESSION_ID` must not match another test's harness).
fn unique_id(tag: &str) -> String {
    format!("sess-{tag}-{}", std::process::id())
}

/// The stored id of a session that the test principal of type `actor`
/// created as `id`: ids a caller chooses are scoped to that caller, and
/// anyone else (the local admin here) names them in full.
fn stored_id(actor: &str, id: &str) -> String {
    match actor {
        "agt" | "atm" => format!("test-{actor}/{id}"),
        _ => format!("local-admin/{id}"),
    }
}

// ---------------------------------------------------------------------------
// RPC helpers

async fn sessions(daemon: &TestDaemon) -> SessionServiceClient<Channel> {
    SessionServiceClient::new(daemon.channel().await)
}

fn create_request(profile: &str, actor: &str, repo: &str) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        profile_ref: profile.into(),
        actor: actor.into(),
        project: "proj-s".into(),
        repo: repo.into(),
        ..Default::default()
    }
}

async fn create(
    client: &mut SessionServiceClient<Channel>,
    request: pb::CreateSessionRequest,
) -> Result<pb::Session, tonic::Status> {
    let actor = request.actor.clone();
    client.create_session(common::as_actor(&actor, request)).await.map(|r| r.into_inner())
}

async fn collect(mut stream: tonic::Streaming<pb::LifecycleEvent>) -> Vec<pb::LifecycleEvent> {
    let mut events = Vec::new();
    let all = async {
        while let Some(event) = stream.message().await.expect("stream ok") {
            events.push(event);
        }
    };
    tokio::time::timeout(STREAM_LIMIT, all).await.expect("the stream ends in time");
    events
}

fn turn_request(session_id: &str, tool: &str, arguments: Value) -> pb::SendTurnRequest {
    pb::SendTurnRequest {
        session_id: session_id.into(),
        tool_call: Some(pb::ToolCall { tool: tool.into(), arguments_json: arguments.to_string() }),
    }
}

/// SendTurn, collected to its `turn_finished`.
async fn send_turn(
    client: &mut SessionServiceClient<Channel>,
    session_id: &str,
    tool: &str,
    arguments: Value,
) -> Vec<pb::LifecycleEvent> {
    let stream = client.send_turn(turn_request(session_id, tool, arguments)).await.expect("turn accepted");
    collect(stream.into_inner()).await
}

/// WatchSession from `after`; the session must have finished (the stream
/// ends after `finished`).
async fn watch(client: &mut SessionServiceClient<Channel>, session_id: &str, after: u64) -> Vec<pb::LifecycleEvent> {
    let request = pb::WatchSessionRequest { session_id: session_id.into(), after_sequence: after };
    let stream = client.watch_session(request).await.expect("watch accepted");
    collect(stream.into_inner()).await
}

async fn end(client: &mut SessionServiceClient<Channel>, session_id: &str) -> pb::Session {
    let request = pb::EndSessionRequest { session_id: session_id.into() };
    client.end_session(request).await.expect("session ends").into_inner()
}

async fn get(client: &mut SessionServiceClient<Channel>, session_id: &str) -> pb::Session {
    let request = pb::GetSessionRequest { session_id: session_id.into() };
    client.get_session(request).await.expect("get session").into_inner()
}

/// The stream's last event, which must be a `turn_finished`.
fn turn_finished(events: &[pb::LifecycleEvent]) -> pb::TurnFinished {
    match events.last().and_then(|e| e.kind.clone()) {
        Some(Kind::TurnFinished(t)) => *t,
        other => panic!("last event is not turn_finished: {other:?}\nkinds: {:?}", kinds(events)),
    }
}

fn gated(events: &[pb::LifecycleEvent]) -> Vec<pb::Gated> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Gated(g)) => Some((**g).clone()),
            _ => None,
        })
        .collect()
}

fn position(events: &[pb::LifecycleEvent], what: impl Fn(&Kind) -> bool) -> Option<usize> {
    events.iter().position(|e| e.kind.as_ref().is_some_and(&what))
}

fn session_of(events: &[pb::LifecycleEvent]) -> pb::Session {
    match events.last().and_then(|e| e.kind.clone()) {
        Some(Kind::Finished(f)) if matches!(f.record, Some(pb::finished::Record::Session(_))) => match f.record {
            Some(pb::finished::Record::Session(s)) => s,
            _ => unreachable!(),
        },
        other => panic!("last event is not a finished session: {other:?}"),
    }
}

fn sandbox_type(spec: &Option<pb::SandboxSpec>) -> pb::SandboxType {
    pb::SandboxType::try_from(spec.as_ref().expect("a sandbox spec").r#type).expect("known sandbox type")
}

/// The forced sandbox of the issue: linux_bwrap, network off, workspace only.
fn assert_forced_spec(spec: &Option<pb::SandboxSpec>, context: &str) {
    let s = spec.as_ref().unwrap_or_else(|| panic!("{context}: no effective sandbox"));
    assert_eq!(sandbox_type(spec), pb::SandboxType::LinuxBwrap, "{context}: {s:?}");
    assert!(!s.allow_network, "{context}: network must be off: {s:?}");
    assert_eq!(s.write_paths, vec!["."], "{context}: {s:?}");
}

// ---------------------------------------------------------------------------
// what the harness sees from inside

/// The probe turn's arguments: the network probe connects to `target`, a
/// listener the test holds on the host's loopback.
fn probe_args(target: std::net::SocketAddr) -> Value {
    json!({"probe_network": target.to_string(), "probe_pid": true})
}

fn probe_line<'a>(output: &'a str, prefix: &str) -> &'a str {
    output
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in the harness output:\n{output}"))
}

/// Proof from inside that the harness runs under bubblewrap: no network,
/// and a private pid namespace whose init is bwrap.
fn assert_probe_under_bwrap(output: &str) {
    assert!(output.contains("network: unreachable"), "network must be unreachable under the forced sandbox:\n{output}");
    let pid1 = probe_line(output, "pid1: ");
    assert!(pid1.contains("bwrap"), "pid 1 must be bwrap's init (private pid namespace), got {pid1:?}");
    let pid: u32 = probe_line(output, "pid: ").trim().parse().expect("a pid");
    assert!(pid <= 5, "in a private pid namespace the harness has a small pid, got {pid}");
}

/// The harness runs on the host: pid 1 is the host's init, not bwrap.
fn assert_probe_not_under_bwrap(output: &str) {
    let pid1 = probe_line(output, "pid1: ");
    assert!(!pid1.contains("bwrap"), "a none sandbox must not be bwrap, pid 1 is {pid1:?}");
    assert!(output.contains("network: reachable"), "a none sandbox shares the host's network: {output}");
}

async fn probe_turn(client: &mut SessionServiceClient<Channel>, session_id: &str) -> (Vec<pb::LifecycleEvent>, String) {
    // Held for the turn: the kernel accepts a connection into its backlog.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let events = send_turn(client, session_id, "probe", probe_args(listener.local_addr().unwrap())).await;
    let done = turn_finished(&events);
    assert!(done.ok, "probe turn failed: {done:?}");
    (events, done.output)
}

/// The harness processes of a session, found on the host by the identity
/// every in-sandbox process carries.
fn session_processes(session_id: &str) -> Vec<i32> {
    let needle = format!("CORRAL_SESSION_ID={session_id}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if environ.split(|b| *b == 0).any(|var| var == needle.as_bytes()) && running(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// Alive and not a zombie.
fn running(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z') | Some('X') | None)
}

// ---------------------------------------------------------------------------
// 1. a forced sandbox, proven from inside

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_enforce_sandbox_runs_a_none_profile_under_bwrap() {
    require_bwrap();
    let profile = none_profile("test.none-forced", FORCE_BWRAP_GUARDRAIL);
    let daemon = TestDaemon::start(daemon_options(vec![("forced.toml", profile)])).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;

    let session =
        create(&mut client, create_request("test.none-forced", "adm", &repo_path(&repo))).await.expect("created");
    assert_eq!(session.state, pb::SessionState::Active as i32, "{session:?}");
    assert_forced_spec(&session.effective_sandbox, "CreateSession");

    let (events, output) = probe_turn(&mut client, &session.session_id).await;
    assert_probe_under_bwrap(&output);
    assert_eq!(turn_finished(&events).tool, "probe");

    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    let history = watch(&mut client, &session.session_id, 0).await;
    let start = &gated(&history)[0];
    assert_eq!(start.phase(), pb::GatePhase::AgentStart);
    assert_eq!(start.action, pb::GateAction::Allow as i32);
    assert_forced_spec(&start.effective_sandbox, "gated event");
    let profile_decision = start.decisions.iter().find(|d| d.policy == "force-bwrap").expect("force-bwrap decided");
    assert_eq!(profile_decision.source(), pb::PolicySource::Profile);
    let ready = history
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("sandbox_ready");
    assert_eq!(ready.backend, pb::SandboxType::LinuxBwrap as i32, "{ready:?}");
    assert!(ready.receipt.expect("receipt").network_isolated);
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_none_profile_without_the_policy_runs_unchanged() {
    require_bwrap();
    let profile = none_profile("test.none-plain", "");
    let daemon = TestDaemon::start(daemon_options(vec![("plain.toml", profile)])).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;

    let session =
        create(&mut client, create_request("test.none-plain", "adm", &repo_path(&repo))).await.expect("created");
    let spec = session.effective_sandbox.clone().expect("effective sandbox");
    assert_eq!(sandbox_type(&session.effective_sandbox), pb::SandboxType::None, "{spec:?}");
    assert!(spec.allow_network, "{spec:?}");
    assert_eq!(spec.write_paths, vec!["."]);
    assert!(spec.read_paths.is_empty(), "{spec:?}");

    let (_, output) = probe_turn(&mut client, &session.session_id).await;
    assert_probe_not_under_bwrap(&output);

    end(&mut client, &session.session_id).await;
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 2. the same enforcement from the admin config and from the session

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_enforce_sandbox_runs_a_none_profile_under_bwrap() {
    require_bwrap();
    let mut options = daemon_options(vec![("plain.toml", none_profile("test.none-plain", ""))]);
    options.config = Box::new(|config| config.policies = vec![force_bwrap_spec("admin-force-bwrap")]);
    let daemon = TestDaemon::start(options).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;

    let session =
        create(&mut client, create_request("test.none-plain", "adm", &repo_path(&repo))).await.expect("created");
    assert_forced_spec(&session.effective_sandbox, "CreateSession with an admin policy");
    let (_, output) = probe_turn(&mut client, &session.session_id).await;
    assert_probe_under_bwrap(&output);

    end(&mut client, &session.session_id).await;
    let history = watch(&mut client, &session.session_id, 0).await;
    let start = &gated(&history)[0];
    let decision = start.decisions.iter().find(|d| d.policy == "admin-force-bwrap").expect("admin policy decided");
    assert_eq!(decision.source(), pb::PolicySource::Admin);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_enforce_sandbox_runs_a_none_profile_under_bwrap() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("plain.toml", none_profile("test.none-plain", ""))])).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;
    let policy = wire_policy(
        "session-force-bwrap",
        pb::PolicyKind::EnforceSandbox,
        json!({"sandbox_type": "linux_bwrap", "allow_network": false, "write_paths": ["."]}),
    );

    // Only an adm caller may bring policies.
    let mut request = create_request("test.none-plain", "agt", &repo_path(&repo));
    request.policies = vec![policy.clone()];
    let status = create(&mut client, request).await.expect_err("a non-adm caller may not set policies");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    let mut request = create_request("test.none-plain", "adm", &repo_path(&repo));
    request.policies = vec![policy];
    let session = create(&mut client, request).await.expect("created");
    assert_forced_spec(&session.effective_sandbox, "CreateSession with a session policy");
    let (_, output) = probe_turn(&mut client, &session.session_id).await;
    assert_probe_under_bwrap(&output);

    end(&mut client, &session.session_id).await;
    let history = watch(&mut client, &session.session_id, 0).await;
    let start = &gated(&history)[0];
    let decision = start.decisions.iter().find(|d| d.policy == "session-force-bwrap").expect("session policy decided");
    assert_eq!(decision.source(), pb::PolicySource::Session);
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 3. tighten-only

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_sandbox_never_loosens_a_spec() {
    require_bwrap();
    use std::os::unix::fs::PermissionsExt;
    // A host directory anyone may write: only the sandbox's mounts can keep
    // the harness out of it (root's /etc would refuse its uid anyway).
    let host_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(host_dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let host = host_dir.path().display().to_string();
    let loosen = format!(
        r#"
[[guardrails.policies]]
name = "try-to-loosen"
kind = "enforce_sandbox"
arguments = {{ allow_network = true, write_paths = [".", "/etc", "{host}"], sandbox_type = "none" }}
"#
    );
    let loosen = loosen.as_str();
    let daemon = TestDaemon::start(daemon_options(vec![("loose.toml", bwrap_profile("test.loosen", loosen))])).await;
    let mut client = sessions(&daemon).await;
    let mut catalog = daemon.catalog().await;

    let dry = catalog
        .evaluate_gate(pb::EvaluateGateRequest {
            profile_ref: "test.loosen".into(),
            actor: "adm".into(),
            project: "proj-s".into(),
            ..Default::default()
        })
        .await
        .expect("evaluate gate")
        .into_inner();
    assert_eq!(dry.action, pb::GateAction::Allow as i32, "{dry:?}");
    assert_forced_spec(&dry.effective_sandbox, "EvaluateGate");
    assert!(!dry.effective_sandbox.as_ref().unwrap().write_paths.contains(&"/etc".to_string()));

    let session = create(&mut client, create_request("test.loosen", "adm", "")).await.expect("created");
    let spec = session.effective_sandbox.clone().expect("effective sandbox");
    assert_forced_spec(&session.effective_sandbox, "CreateSession");
    assert!(!spec.write_paths.iter().any(|p| p == "/etc"), "/etc must not be added: {spec:?}");

    // And from inside: still no network, and the host's /etc was not bound
    // writable (a write there, if it succeeds at all, lands in the
    // sandbox's own ephemeral root, never on the host).
    assert!(!spec.write_paths.contains(&host), "{host} must not be added: {spec:?}");
    let probe_file = format!("{host}/corral-probe-{}", std::process::id());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap().to_string();
    let arguments = json!({"probe_network": target, "probe_write": probe_file});
    let events = send_turn(&mut client, &session.session_id, "probe", arguments).await;
    let done = turn_finished(&events);
    assert!(done.ok, "{done:?}");
    assert!(done.output.contains("network: unreachable"), "{}", done.output);
    let on_host = std::path::Path::new(&probe_file).exists();
    if on_host {
        let _ = std::fs::remove_file(&probe_file);
    }
    assert!(!on_host, "the harness wrote the host's {host}: {}", done.output);

    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 4. a dead harness is restarted through the gate, under the same sandbox

/// Checks a restart turn's own events and the whole history: `gated`
/// (agent_start, forced sandbox) precedes `harness_restarted`, and the
/// restarted harness is under bwrap again.
async fn assert_restarted_under_forced_sandbox(
    client: &mut SessionServiceClient<Channel>,
    session_id: &str,
    turns_before: usize,
) {
    let (events, output) = probe_turn(client, session_id).await;
    assert_probe_under_bwrap(&output);
    let start = position(&events, |k| matches!(k, Kind::Gated(g) if g.phase() == pb::GatePhase::AgentStart))
        .unwrap_or_else(|| panic!("no agent_start gate before the restart: {:?}", kinds(&events)));
    let restarted = position(&events, |k| matches!(k, Kind::HarnessRestarted(_)))
        .unwrap_or_else(|| panic!("no harness_restarted: {:?}", kinds(&events)));
    assert!(start < restarted, "the gate must run before the restart: {:?}", kinds(&events));
    match &events[start].kind {
        Some(Kind::Gated(g)) => {
            assert_eq!(g.action, pb::GateAction::Allow as i32);
            assert_forced_spec(&g.effective_sandbox, "restart gate");
        }
        _ => unreachable!(),
    }
    let dispatched = position(&events, |k| matches!(k, Kind::Dispatched(_))).expect("dispatched");
    assert!(restarted < dispatched, "{:?}", kinds(&events));

    let ended = end(client, session_id).await;
    assert_eq!(ended.restarts, 1, "{ended:?}");
    let history = watch(client, session_id, 0).await;
    let names = kinds(&history);
    let agent_starts: Vec<usize> = history
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(&e.kind, Some(Kind::Gated(g)) if g.phase() == pb::GatePhase::AgentStart))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(agent_starts.len(), 2, "one gate for the start, one for the restart: {names:?}");
    let restarted = names.iter().position(|k| *k == "harness_restarted").expect("harness_restarted");
    assert_eq!(names.iter().filter(|k| **k == "harness_restarted").count(), 1, "{names:?}");
    assert!(agent_starts[1] < restarted, "{names:?}");
    assert_eq!(names.iter().filter(|k| **k == "turn_finished").count(), turns_before + 1, "{names:?}");
    // No turn_finished between the restart gate and the restart itself.
    assert!(names[agent_starts[1]..restarted].iter().all(|k| *k == "gated"), "{names:?}");
    assert_eq!(&names[..4], &["accepted", "resolved", "gated", "sandbox_ready"], "{names:?}");
    assert_eq!(&names[names.len() - 2..], &["teardown", "finished"], "{names:?}");
    for g in gated(&history).iter().filter(|g| g.phase() == pb::GatePhase::AgentStart) {
        assert_forced_spec(&g.effective_sandbox, "every agent_start gate");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_that_dies_mid_turn_restarts_through_the_gate_under_the_forced_sandbox() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![(
        "forced.toml",
        none_profile("test.none-forced", FORCE_BWRAP_GUARDRAIL),
    )]))
    .await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;
    let session =
        create(&mut client, create_request("test.none-forced", "adm", &repo_path(&repo))).await.expect("created");

    let (_, output) = probe_turn(&mut client, &session.session_id).await;
    assert_probe_under_bwrap(&output);
    let events = send_turn(&mut client, &session.session_id, "die", json!({"exit": 3})).await;
    let died = turn_finished(&events);
    assert!(!died.ok, "a harness that exits mid-turn fails the turn: {died:?}");
    assert!(died.raw_error.contains("status 3"), "{died:?}");

    assert_restarted_under_forced_sandbox(&mut client, &session.session_id, 2).await;
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_killed_from_outside_restarts_through_the_gate_under_the_forced_sandbox() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![(
        "forced.toml",
        none_profile("test.none-forced", FORCE_BWRAP_GUARDRAIL),
    )]))
    .await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;
    let mut request = create_request("test.none-forced", "adm", &repo_path(&repo));
    request.session_id = unique_id("killed");
    let session = create(&mut client, request).await.expect("created");

    let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": "alive"})).await;
    assert!(turn_finished(&events).output.contains("echo alive"));

    let victims = session_processes(&session.session_id);
    assert!(!victims.is_empty(), "the harness's processes carry CORRAL_SESSION_ID");
    for pid in &victims {
        // SAFETY: kill(2) on pids this test found; no memory is involved.
        unsafe {
            libc::kill(*pid, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !session_processes(&session.session_id).is_empty() {
        assert!(Instant::now() < deadline, "the killed harness is still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let bwrap's outer process notice its child is gone.
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_restarted_under_forced_sandbox(&mut client, &session.session_id, 1).await;
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 5. denials at agent_start and at tool_call

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_start_deny_is_permission_denied_and_creates_no_sandbox() {
    require_bwrap();
    let only_adm = r#"
[[guardrails.policies]]
name = "only-adm"
kind = "allowed_actors"
arguments = { types = ["adm"] }
"#;
    let (backends, log) = bwrap_with(BackendFaults::default());
    let mut options = daemon_options(vec![("adm.toml", bwrap_profile("test.adm-only", only_adm))]);
    options.backends = Some(backends);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;

    let mut request = create_request("test.adm-only", "agt", "");
    request.session_id = unique_id("denied");
    let status = create(&mut client, request).await.expect_err("agt is not allowed to start this harness");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let info = status.get_details_error_info().unwrap_or_else(|| panic!("no ErrorInfo: {status:?}"));
    assert_eq!(info.reason, "AGENT_START_DENIED", "{info:?}");
    assert_eq!(info.metadata.get("policy").map(String::as_str), Some("only-adm"), "{info:?}");
    let reason = info.metadata.get("reason").expect("a reason");
    assert!(reason.contains("agt"), "the reason says why: {reason:?}");
    assert_eq!(log.lock().unwrap().creates, 0, "no sandbox may be created for a denied start");
    assert!(daemon.leftover_sandboxes().await.is_empty());

    let record = get(&mut client, &stored_id("agt", &unique_id("denied"))).await;
    assert_eq!(record.state, pb::SessionState::Refused as i32, "{record:?}");
    assert_eq!(record.session_id, stored_id("agt", &unique_id("denied")));
    let history = watch(&mut client, &stored_id("agt", &unique_id("denied")), 0).await;
    let names = kinds(&history);
    assert_eq!(names, vec!["accepted", "resolved", "gated", "teardown", "finished"], "{names:?}");
    assert_eq!(gated(&history)[0].action, pb::GateAction::Deny as i32);

    // The same profile starts for adm.
    let session = create(&mut client, create_request("test.adm-only", "adm", "")).await.expect("adm may start it");
    assert_eq!(log.lock().unwrap().creates, 1);
    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}

const NO_RM: &str = r#"
[[guardrails.policies]]
name = "no-rm"
kind = "expr"
arguments = { expression = "tool != 'rm'", reason = "rm is not allowed" }
on = ["tool_call"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_deny_fails_the_turn_and_the_session_stays_usable() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("norm.toml", bwrap_profile("test.no-rm", NO_RM))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.no-rm", "agt", "")).await.expect("created");

    let events = send_turn(&mut client, &session.session_id, "rm", json!({"echo": "should not run"})).await;
    let gates = gated(&events);
    assert_eq!(gates.len(), 1, "{:?}", kinds(&events));
    assert_eq!(gates[0].phase(), pb::GatePhase::ToolCall);
    assert_eq!(gates[0].action, pb::GateAction::Deny as i32, "{:?}", gates[0]);
    let deny = gates[0].decisions.iter().find(|d| d.policy == "no-rm").expect("no-rm decided");
    assert_eq!(deny.reason, "rm is not allowed");
    assert!(position(&events, |k| matches!(k, Kind::Dispatched(_))).is_none(), "a denied call is not dispatched");
    let done = turn_finished(&events);
    assert!(!done.ok, "{done:?}");
    assert!(done.error.contains("rm is not allowed"), "{done:?}");
    assert!(done.error.contains("no-rm"), "the deciding policy is named: {done:?}");
    assert!(!done.output.contains("should not run"), "{done:?}");

    let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": "x"})).await;
    let done = turn_finished(&events);
    assert!(done.ok, "the session stays usable after a denied turn: {done:?}");
    assert!(done.output.contains("echo x"), "{done:?}");
    assert_eq!(gated(&events)[0].action, pb::GateAction::Allow as i32);
    assert!(position(&events, |k| matches!(k, Kind::HarnessRestarted(_))).is_none(), "{:?}", kinds(&events));

    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.turns, 2, "{ended:?}");
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 6. in-harness policy requests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_requests_from_inside_the_harness_get_the_tool_call_verdict() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("norm.toml", bwrap_profile("test.no-rm", NO_RM))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.no-rm", "agt", "")).await.expect("created");

    let events =
        send_turn(&mut client, &session.session_id, "plan", json!({"ask": {"tool": "rm", "arguments": {}}})).await;
    let done = turn_finished(&events);
    assert!(done.ok, "{done:?}");
    assert!(done.output.contains("verdict rm: deny"), "{}", done.output);
    assert!(done.output.contains("rm is not allowed"), "the verdict carries the reason: {}", done.output);
    let gates = gated(&events);
    assert_eq!(gates.len(), 2, "one gate for the turn, one for the request: {:?}", kinds(&events));
    assert_eq!(gates[1].phase(), pb::GatePhase::ToolCall);
    assert_eq!(gates[1].action, pb::GateAction::Deny as i32);

    let events =
        send_turn(&mut client, &session.session_id, "plan", json!({"ask": {"tool": "ls", "arguments": {"path": "."}}}))
            .await;
    let done = turn_finished(&events);
    assert!(done.ok, "{done:?}");
    assert!(done.output.contains("verdict ls: allow"), "{}", done.output);

    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 7. CEL: a syntax error stops the daemon's start; a run-time error denies

async fn build_error(profiles: Vec<(&str, String)>, policies: Vec<PolicySpec>) -> String {
    let data = common::data_tempdir();
    let dir = data.path().join("profiles");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in &profiles {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let config = corral::config::Config {
        data_dir: data.path().join("data"),
        profile_dirs: vec![dir],
        shutdown_grace_seconds: 5,
        policies,
        ..corral::config::Config::default()
    };
    match corral::daemon::Daemon::build(
        config,
        corral::sandbox::Backends::host_default(),
        corral::daemon::default_reins(),
    )
    .await
    {
        Ok(_) => panic!("the daemon must not start"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cel_syntax_error_fails_the_daemon_start_naming_the_file_and_policy() {
    require_bwrap();
    let broken = r#"
[[guardrails.policies]]
name = "bad-cel"
kind = "expr"
arguments = { expression = "tool == ", reason = "never" }
"#;
    let error = build_error(vec![("broken.toml", bwrap_profile("test.broken", broken))], vec![]).await;
    assert!(error.contains("broken.toml"), "the file is named: {error}");
    assert!(error.contains("bad-cel"), "the policy is named: {error}");
    assert!(error.to_lowercase().contains("syntax"), "{error}");

    let admin = PolicySpec {
        name: "bad-admin-cel".into(),
        kind: "expr".into(),
        arguments: json!({"expression": "actor == ", "reason": "never"}),
        on: vec![],
    };
    let error = build_error(vec![], vec![admin]).await;
    assert!(error.contains("policies"), "the config key is named: {error}");
    assert!(error.contains("bad-admin-cel"), "the policy is named: {error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cel_expression_that_fails_at_run_time_denies() {
    require_bwrap();
    let fragile = r#"
[[guardrails.policies]]
name = "fragile"
kind = "expr"
arguments = { expression = "arguments.missing.deeper == 1", reason = "never says this" }
on = ["tool_call"]
"#;
    let daemon =
        TestDaemon::start(daemon_options(vec![("fragile.toml", bwrap_profile("test.fragile", fragile))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.fragile", "agt", "")).await.expect("created");

    let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": "x"})).await;
    let gates = gated(&events);
    assert_eq!(gates[0].action, pb::GateAction::Deny as i32, "{gates:?}");
    let done = turn_finished(&events);
    assert!(!done.ok, "{done:?}");
    assert!(done.error.contains("fail closed"), "{done:?}");
    assert!(done.error.contains("fragile"), "{done:?}");
    assert!(position(&events, |k| matches!(k, Kind::Dispatched(_))).is_none(), "{:?}", kinds(&events));

    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 8. reaping

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_is_reaped_and_torn_down() {
    require_bwrap();
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.config = Box::new(|config| config.session_idle_seconds = 1);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let record = get(&mut client, &session.session_id).await;
        if record.state == pb::SessionState::Reaped as i32 {
            let evidence = record.evidence.expect("evidence");
            assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
            assert_eq!(evidence.session_cleanup, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the idle session was not reaped in 20 s: {record:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let history = watch(&mut client, &session.session_id, 0).await;
    let names = kinds(&history);
    assert_eq!(&names[names.len() - 3..], &["reaped", "teardown", "finished"], "{names:?}");
    assert_eq!(session_of(&history).state, pb::SessionState::Reaped as i32);
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);

    let status = client
        .send_turn(turn_request(&session.session_id, "echo", json!({"echo": "late"})))
        .await
        .expect_err("a reaped session takes no turns");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_with_a_turn_in_flight_is_not_reaped() {
    require_bwrap();
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.config = Box::new(|config| config.session_idle_seconds = 1);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");

    let events = send_turn(&mut client, &session.session_id, "slow", json!({"sleep": 3, "echo": "done"})).await;
    let done = turn_finished(&events);
    assert!(done.ok, "a turn longer than the idle time completes: {done:?}");
    assert!(done.output.contains("echo done"), "{done:?}");
    assert!(position(&events, |k| matches!(k, Kind::Reaped(_))).is_none(), "{:?}", kinds(&events));
    let record = get(&mut client, &session.session_id).await;
    assert_eq!(record.state, pb::SessionState::Active as i32, "not reaped mid-turn: {record:?}");
    daemon.stop().await;
}

/// A drain of this node alone (DrainNode, no shutdown) takes no new
/// session but finishes those it runs: they take turns, and an idle one is
/// reaped, so the node empties. Before, the drain stopped the reaper and
/// refused every turn: each session held its sandbox, its uid and its
/// slot until its caller ended it, and the node never drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_goes_on_with_its_sessions_until_they_end() {
    require_bwrap();
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.config = Box::new(|config| config.session_idle_seconds = 2);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");
    let mut catalog = daemon.catalog().await;
    let nodes = catalog.list_nodes(pb::ListNodesRequest {}).await.expect("nodes").into_inner().nodes;
    let name = nodes.first().expect("this daemon's node").name.clone();
    catalog.drain_node(pb::DrainNodeRequest { name }).await.expect("drained");
    assert!(daemon.engine.is_draining());
    let refused = create(&mut client, create_request("test.session", "agt", "")).await.expect_err("no new session");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

    let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": "while draining"})).await;
    let done = turn_finished(&events);
    assert!(done.ok && done.output.contains("while draining"), "a session it runs takes turns: {done:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let record = get(&mut client, &session.session_id).await;
        if record.state == pb::SessionState::Reaped as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "the idle session was not reaped while draining: {record:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(daemon.engine.running(), 0, "the node is empty");
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

/// A shutdown ends its sessions side by side, each within the grace: a
/// harness deaf to the end of its input costs its session the end's own
/// wait (5 s) and no more. Ended one after another, three such sessions
/// took 15 s, and the last one's capture was cut by a 12 s grace: it
/// ended `failed` with nothing fetched back, for coming last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_ends_its_sessions_side_by_side_within_the_grace() {
    require_bwrap();
    let deaf = "id = \"test.deaf\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-c\", \"cat >/dev/null; exec sleep 4\"]\n\
                input = \"task_json\"\n[sandbox]\ntype = \"linux_bwrap\"\nwrite_paths = [\".\"]\n[limits]\n\
                timeout_seconds = 60\n";
    let mut options = daemon_options(vec![("deaf.toml", deaf.to_string())]);
    options.config = Box::new(|config| config.shutdown_grace_seconds = 6);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let repo = git_repo();
    let mut watchers = Vec::new();
    for _ in 0..3 {
        let session =
            create(&mut client, create_request("test.deaf", "agt", &repo_path(&repo))).await.expect("created");
        let request = pb::WatchSessionRequest { session_id: session.session_id, after_sequence: 0 };
        let stream = client.watch_session(request).await.expect("watch").into_inner();
        watchers.push(tokio::spawn(async move {
            let mut stream = stream;
            let mut events = Vec::new();
            while let Ok(Some(event)) = stream.message().await {
                events.push(event);
            }
            events
        }));
    }
    daemon.stop().await;
    for watcher in watchers {
        let events = watcher.await.unwrap();
        let session = session_of(&events);
        assert_eq!(session.state, pb::SessionState::Ended as i32, "{:?}: {session:?}", kinds(&events));
    }
}

/// A shutdown gives a turn in flight the grace an execution gets, then
/// cancels it and ends the session: it never waits for the turn's own
/// timeout (systemd would SIGKILL the daemon first and leave the sandbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_a_turn_in_flight_after_the_grace_and_ends_the_session() {
    require_bwrap();
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.config = Box::new(|config| config.shutdown_grace_seconds = 1);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");
    let id = session.session_id.clone();
    let history = {
        let request = pb::WatchSessionRequest { session_id: id.clone(), after_sequence: 0 };
        let stream = client.watch_session(request).await.expect("watch accepted").into_inner();
        tokio::spawn(collect(stream))
    };
    let mut stream =
        client.send_turn(turn_request(&id, "slow", json!({"sleep": 30}))).await.expect("turn accepted").into_inner();
    let mut events = until_dispatched(&mut stream).await;
    let turn = tokio::spawn(collect(stream));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let started = Instant::now();
    daemon.stop().await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "the shutdown waited {took:?} for a 30 s turn (grace 1 s)");
    events.extend(turn.await.unwrap());
    let done = turn_finished(&events);
    assert!(!done.ok, "the turn was cancelled, not finished: {done:?}");
    assert_eq!(done.error, "turn cancelled", "{done:?}");
    let history = history.await.unwrap();
    let ended = session_of(&history);
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    let evidence = ended.evidence.expect("evidence");
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
    assert!(session_processes(&id).is_empty(), "the session's harness outlived the shutdown");
}

/// A session being reaped when the daemon shuts down is ended to the end
/// first: the shutdown waits for its teardown (here 5 s, a harness that
/// ignores the end of its input) before the store closes, so it is stored
/// `reaped`, not left active for the next start to fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_waits_for_a_session_being_reaped() {
    require_bwrap();
    let mut options = daemon_options(vec![("stubborn.toml", common::stubborn_profile())]);
    options.config = Box::new(|config| config.session_idle_seconds = 1);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.stubborn", "agt", "")).await.expect("created");
    let request = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_session(request).await.expect("watch accepted").into_inner();
    let mut history = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        let reaped = matches!(event.kind, Some(Kind::Reaped(_)));
        history.push(event);
        if reaped {
            break;
        }
    }
    daemon.stop().await;
    history.extend(collect(stream).await);
    let ended = session_of(&history);
    assert_eq!(ended.state, pb::SessionState::Reaped as i32, "{:?}", kinds(&history));
    let evidence = ended.evidence.expect("evidence");
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
}

/// A session's workspace budget holds between its turns too: what the
/// harness left running fills the workspace while no turn runs; past
/// `max_workspace_inodes` every process of the sandbox is killed at once,
/// a `limit` event says so, the next turn is refused, and the session ends
/// failed with nothing fetched back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workspace_budget_holds_between_turns() {
    require_bwrap();
    let marker = format!("8{}", std::process::id());
    let profile = format!(
        r#"id = "test.filler"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "while read -r task; do (sleep 1; i=0; while :; do touch f$i; i=$((i+1)); done) & sleep {marker} & echo '{{\"type\":\"result\",\"ok\":true,\"output\":\"started\"}}'; done"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
write_paths = ["."]
[limits]
max_workspace_inodes = 1000
"#
    );
    let daemon = TestDaemon::start(daemon_options(vec![("filler.toml", profile)])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.filler", "agt", "")).await.expect("created");
    let done = turn_finished(&send_turn(&mut client, &session.session_id, "t", json!({})).await);
    assert!(done.ok && done.output.contains("started"), "{done:?}");
    // No turn runs now: the background loop fills the workspace.
    let deadline = Instant::now() + Duration::from_secs(20);
    while common::processes_with(&marker) > 0 {
        assert!(Instant::now() < deadline, "the sandbox's processes still run 20 s after the workspace filled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = turn_finished(&send_turn(&mut client, &session.session_id, "t", json!({})).await);
    assert!(!refused.ok && refused.raw_error.contains("over its budget"), "{refused:?}");
    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.state, pb::SessionState::Failed as i32, "{ended:?}");
    let history = watch(&mut client, &session.session_id, 0).await;
    let limits: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Limit(l)) => Some(l.limit()),
            _ => None,
        })
        .collect();
    assert_eq!(limits, [pb::LimitKind::WorkspaceInodes], "{:?}", kinds(&history));
    daemon.stop().await;
}

/// Descriptors process `pid` holds open: its sockets and files.
fn open_descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// A session whose harness exits after each turn starts it again for the
/// next, in a new network namespace with a new egress proxy: the old
/// proxy (its listener, its task) goes with the old run, so twenty turns
/// leave the daemon (a `corral serve` of its own, counted alone) holding
/// no more descriptors than two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_harness_leaves_no_egress_proxy_behind() {
    require_bwrap();
    let marker = format!("once-{}", std::process::id());
    let profile = format!(
        r#"id = "test.once"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "read -r task; echo '{{\"type\":\"result\",\"ok\":true,\"output\":\"once\"}}'", "{marker}"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
allow_network = true
allow_hosts = ["example.invalid"]
write_paths = ["."]
"#
    );
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("once.toml"), profile).unwrap();
    let daemon = common::ServeProcess::start(&dir.path().join("data"), &profiles, &[]).await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.once".into(), ..Default::default() };
    let session = client.create_session(create).await.expect("created").into_inner();
    let mut turn = async || {
        let done = turn_finished(&send_turn(&mut client, &session.session_id, "t", json!({})).await);
        assert!(done.ok && done.output.contains("once"), "{done:?}");
        // The run exits once it has answered: the next turn starts the
        // harness again.
        let deadline = Instant::now() + Duration::from_secs(10);
        while common::processes_with(&marker) > 0 {
            assert!(Instant::now() < deadline, "the harness did not exit after its answer");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    turn().await;
    turn().await;
    let before = open_descriptors(daemon.pid());
    for _ in 0..20 {
        turn().await;
    }
    let after = open_descriptors(daemon.pid());
    assert!(after < before + 5, "{before} descriptors open after 2 turns, {after} after 20 more");
    daemon.stop().await;
}

/// Token counts a harness reports are bounded, and so is their sum over a
/// session's turns: two turns each claiming u64::MAX tokens leave the
/// evidence at `MAX_TOKENS` (2^53, exact in JSON and in a double).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_token_count_stays_bounded_across_turns() {
    require_bwrap();
    let profile = r#"id = "test.greedy"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "while read -r task; do echo '{\"type\":\"result\",\"ok\":true,\"tokens_spent\":18446744073709551615}'; done"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
write_paths = ["."]
"#;
    let daemon = TestDaemon::start(daemon_options(vec![("greedy.toml", profile.to_string())])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.greedy", "agt", "")).await.expect("created");
    for _ in 0..2 {
        let done = turn_finished(&send_turn(&mut client, &session.session_id, "t", json!({})).await);
        assert!(done.ok, "{done:?}");
    }
    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.evidence.expect("evidence").tokens_spent, corral::rein::MAX_TOKENS);
    daemon.stop().await;
}

/// A shutdown with nothing in flight ends every session within its grace,
/// workspace capture included: the agent's work comes back before the
/// sandbox goes, and the session ends `ended`, not `failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_brings_an_idle_sessions_work_back_before_it_ends_it() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))])).await;
    let mut client = sessions(&daemon).await;
    let repo = git_repo();
    let request = pb::CreateSessionRequest {
        session_id: unique_id("shutdown-capture"),
        ..create_request("test.session", "agt", &repo_path(&repo))
    };
    let session = create(&mut client, request).await.expect("created");
    let done =
        turn_finished(&send_turn(&mut client, &session.session_id, "write", json!({"probe_write": "work.txt"})).await);
    assert!(done.ok && done.output.contains("write work.txt: ok"), "{done:?}");
    let history = {
        let request = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: 0 };
        tokio::spawn(collect(client.watch_session(request).await.expect("watch accepted").into_inner()))
    };
    daemon.stop().await;
    let ended = session_of(&history.await.unwrap());
    let evidence = ended.evidence.clone().expect("evidence");
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{:?}: {evidence:?}", ended.state);
    assert!(!evidence.commit_sha.is_empty(), "the work came back: {evidence:?}");
    let refs = git(repo.path(), &["for-each-ref", "--format=%(objectname)", "refs/corral/"]);
    assert!(refs.contains(&evidence.commit_sha), "{refs}");
}

/// A session's work comes back as `refs/corral/<principal>/<id>`: an id
/// that is no valid ref component is INVALID_ARGUMENT naming `session_id`,
/// and nothing is stored; an id that is one brings its work back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_id_that_cannot_name_a_git_ref_is_invalid_and_a_valid_one_brings_the_work_back() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))])).await;
    let mut client = sessions(&daemon).await;
    let repo = git_repo();
    let bad = [
        "fix:1",
        "a..b",
        "v1.lock",
        "x~1",
        "q?",
        "a*",
        "a[1]",
        "a^",
        "back\\slash",
        "a/b",
        "a@{1}",
        "@",
        ".hidden",
        "-x",
        "trailing.",
    ];
    for id in bad {
        let request = pb::CreateSessionRequest {
            session_id: id.into(),
            ..create_request("test.session", "agt", &repo_path(&repo))
        };
        let status = create(&mut client, request).await.expect_err(id);
        assert_eq!(status.code(), Code::InvalidArgument, "{id}: {status:?}");
        let violations = status.get_details_bad_request().unwrap_or_else(|| panic!("{id}: no BadRequest: {status:?}"));
        assert_eq!(violations.field_violations[0].field, "session_id", "{id}: {violations:?}");
    }
    let rows = daemon.engine.store.row_counts().await.unwrap();
    let sessions_stored = rows.iter().find(|(t, _)| *t == "sessions").map(|(_, n)| *n).unwrap();
    assert_eq!(sessions_stored, 0, "a refused id stores nothing");

    // Dots, dashes and underscores inside an id are fine refs.
    let id = "fix-1_v1.2";
    let request =
        pb::CreateSessionRequest { session_id: id.into(), ..create_request("test.session", "agt", &repo_path(&repo)) };
    let session = create(&mut client, request).await.expect("a valid ref component is a valid id");
    let done =
        turn_finished(&send_turn(&mut client, &session.session_id, "write", json!({"probe_write": "work.txt"})).await);
    assert!(done.ok && done.output.contains("write work.txt: ok"), "{done:?}");
    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    let commit = ended.evidence.expect("evidence").commit_sha;
    assert!(!commit.is_empty(), "the work came back");
    let refs = git(repo.path(), &["for-each-ref", "--format=%(refname) %(objectname)", "refs/corral/"]);
    assert!(refs.contains(&format!("refs/corral/{} {commit}", stored_id("agt", id))), "{refs}");
    daemon.stop().await;
}

/// A session id is taken from the moment its session is stored: a second
/// CreateSession of it, while the first still starts or once it runs, is
/// ALREADY_EXISTS naming `session_id` (not "overloaded", not a request id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_create_of_a_starting_session_id_is_already_exists_naming_session_id() {
    require_bwrap();
    // Each sandbox takes 300 ms to make: the first create is STARTING that long.
    let (backends, _log) = bwrap_with(BackendFaults { slow_create: true, ..Default::default() });
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.backends = Some(backends);
    let daemon = TestDaemon::start(options).await;
    let client = sessions(&daemon).await;
    let id = unique_id("twice");
    let request = pb::CreateSessionRequest { session_id: id.clone(), ..create_request("test.session", "agt", "") };
    let first = {
        let (mut client, request) = (client.clone(), request.clone());
        tokio::spawn(async move { create(&mut client, request).await })
    };
    let stored = stored_id("agt", &id);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let get = pb::GetSessionRequest { session_id: stored.clone() };
        match client.clone().get_session(get).await {
            Ok(s) if s.get_ref().state == pb::SessionState::Starting as i32 => break,
            Ok(s) => panic!("the first create was never seen starting: {:?}", s.into_inner()),
            Err(status) => assert_eq!(status.code(), Code::NotFound, "{status:?}"),
        }
        assert!(Instant::now() < deadline, "the first create was never stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let assert_taken = |status: tonic::Status, when: &str| {
        assert_eq!(status.code(), Code::AlreadyExists, "{when}: {status:?}");
        let info = status.get_details_error_info().unwrap_or_else(|| panic!("{when}: no ErrorInfo: {status:?}"));
        assert_eq!(info.reason, "SESSION_ID_TAKEN", "{when}: {info:?}");
        assert_eq!(info.metadata.get("session_id"), Some(&stored), "{when}: {info:?}");
        assert!(status.message().contains("session_id"), "{when}: {status:?}");
    };
    let second = create(&mut client.clone(), request.clone()).await.expect_err("the id is taken while it starts");
    assert_taken(second, "while starting");
    let first = first.await.unwrap().expect("the first create is unaffected");
    assert_eq!(first.state, pb::SessionState::Active as i32, "{first:?}");
    let third = create(&mut client.clone(), request).await.expect_err("the id is taken while it runs");
    assert_taken(third, "while active");
    end(&mut client.clone(), &first.session_id).await;
    daemon.stop().await;
}

/// EndSession while the session's sandbox is being made ends the start
/// there: no harness is started in it, the create is told, and the
/// sandbox is destroyed. Before, the cancel was looked at only before the
/// sandbox was made, and the agent was launched in it, then torn down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_a_session_while_its_sandbox_is_made_starts_no_harness() {
    require_bwrap();
    // Each sandbox takes 300 ms to make: the create is STARTING that long.
    let (backends, log) = bwrap_with(BackendFaults { slow_create: true, ..Default::default() });
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.backends = Some(backends);
    let daemon = TestDaemon::start(options).await;
    let client = sessions(&daemon).await;
    let id = unique_id("ended-starting");
    let request = pb::CreateSessionRequest { session_id: id.clone(), ..create_request("test.session", "agt", "") };
    let created = {
        let mut client = client.clone();
        tokio::spawn(async move { create(&mut client, request).await })
    };
    let stored = stored_id("agt", &id);
    let deadline = Instant::now() + Duration::from_secs(20);
    while log.lock().unwrap().creates == 0 {
        assert!(Instant::now() < deadline, "the sandbox was never being made");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    client.clone().end_session(pb::EndSessionRequest { session_id: stored.clone() }).await.expect("ended");
    let refused = created.await.unwrap().expect_err("ended while it was starting");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("ended while it was starting"), "{refused:?}");
    let (spawns, destroys) = {
        let log = log.lock().unwrap();
        (log.spawns.len(), log.destroys.clone())
    };
    assert_eq!(spawns, 0, "a harness was started in it");
    assert_eq!(destroys.len(), 1, "its sandbox is destroyed: {destroys:?}");
    assert_eq!(get(&mut client.clone(), &stored).await.state, pb::SessionState::Ended as i32);
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 9. EvaluateGate is a faithful dry run

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluate_gate_matches_create_session() {
    require_bwrap();
    let only_adm = r#"
[[guardrails.policies]]
name = "only-adm"
kind = "allowed_actors"
arguments = { types = ["adm"] }
"#;
    let mut options = daemon_options(vec![
        ("forced.toml", none_profile("test.none-forced", FORCE_BWRAP_GUARDRAIL)),
        ("adm.toml", bwrap_profile("test.adm-only", only_adm)),
    ]);
    options.config = Box::new(|config| {
        config.policies = vec![PolicySpec {
            name: "admin-actors".into(),
            kind: "allowed_actors".into(),
            arguments: json!({"types": ["adm", "agt"]}),
            on: vec![],
        }]
    });
    let daemon = TestDaemon::start(options).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;
    let mut catalog = daemon.catalog().await;
    let session_policies = vec![
        wire_policy("session-timeout", pb::PolicyKind::MaxTimeout, json!({"seconds": 30})),
        wire_policy("session-no-env", pb::PolicyKind::EnforceSandbox, json!({"env_passthrough": []})),
    ];

    let cases = [
        ("test.none-forced", "adm", repo_path(&repo), session_policies.clone(), unique_id("eval-allow")),
        ("test.adm-only", "agt", String::new(), vec![], unique_id("eval-deny")),
    ];
    for (profile, actor, repo, policies, session_id) in cases {
        // Asked as the caller that then creates it (EvaluateGate admits the
        // actor as CreateSession does).
        let ask = pb::EvaluateGateRequest {
            profile_ref: profile.into(),
            actor: actor.into(),
            project: "proj-s".into(),
            repo: repo.clone(),
            policies: policies.clone(),
        };
        let dry = catalog.evaluate_gate(common::as_actor(actor, ask)).await.expect("evaluate gate").into_inner();
        let mut request = create_request(profile, actor, &repo);
        request.session_id = session_id.clone();
        request.policies = policies;
        let created = create(&mut client, request).await;
        // Each case's verdict is known: the deny case must deny.
        let expected = if session_id.contains("eval-deny") { pb::GateAction::Deny } else { pb::GateAction::Allow };
        assert_eq!(dry.action, expected as i32, "{profile}: {dry:?}");
        if dry.action == pb::GateAction::Allow as i32 {
            let session = created.expect("the dry run allowed it");
            assert_eq!(session.effective_sandbox, dry.effective_sandbox, "{profile}");
            end(&mut client, &session_id).await;
        } else {
            let status = created.expect_err("the dry run denied it");
            assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        }
        let history = watch(&mut client, &stored_id(actor, &session_id), 0).await;
        let real = &gated(&history)[0];
        assert_eq!(real.phase(), pb::GatePhase::AgentStart);
        assert_eq!(real.action, dry.action, "{profile}: action");
        assert_eq!(real.decisions, dry.decisions, "{profile}: decisions");
        assert_eq!(real.effective_sandbox, dry.effective_sandbox, "{profile}: effective sandbox");
    }
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 10. EndSession and CancelTurn

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_session_tears_down_and_cancel_turn_only_acts_on_a_turn_in_flight() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");
    let id = session.session_id.clone();

    // Nothing in flight: nothing to cancel.
    let status =
        client.cancel_turn(pb::CancelTurnRequest { session_id: id.clone() }).await.expect_err("no turn is in flight");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    // A long turn, cancelled once it is dispatched.
    let mut stream =
        client.send_turn(turn_request(&id, "slow", json!({"sleep": 30}))).await.expect("turn accepted").into_inner();
    let mut events = until_dispatched(&mut stream).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    client.cancel_turn(pb::CancelTurnRequest { session_id: id.clone() }).await.expect("cancel accepted");
    events.extend(collect(stream).await);
    assert!(started.elapsed() < Duration::from_secs(15), "the cancel ended the turn early");
    let done = turn_finished(&events);
    assert!(!done.ok, "{done:?}");
    assert_eq!(done.error, "turn cancelled", "{done:?}");

    // The session is still usable: the next turn restarts the harness
    // through the gate.
    let events = send_turn(&mut client, &id, "echo", json!({"echo": "after cancel"})).await;
    let done = turn_finished(&events);
    assert!(done.ok, "{done:?}");
    assert!(done.output.contains("echo after cancel"), "{done:?}");
    let start = position(&events, |k| matches!(k, Kind::Gated(g) if g.phase() == pb::GatePhase::AgentStart))
        .expect("agent_start gate");
    let restarted = position(&events, |k| matches!(k, Kind::HarnessRestarted(_))).expect("harness_restarted");
    assert!(start < restarted, "{:?}", kinds(&events));

    let listed = client.list_sessions(pb::ListSessionsRequest::default()).await.expect("list sessions").into_inner();
    assert!(listed.sessions.iter().any(|s| s.session_id == id && s.state == pb::SessionState::Active as i32));

    let ended = end(&mut client, &id).await;
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    let evidence = ended.evidence.clone().expect("evidence");
    assert_eq!(evidence.session_cleanup, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
    assert_eq!(ended.turns, 2, "{ended:?}");
    assert!(ended.ended_at.is_some());
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);

    // Ended: GetSession agrees, no more turns or cancels.
    assert_eq!(get(&mut client, &id).await.state, pb::SessionState::Ended as i32);
    let status = client.send_turn(turn_request(&id, "echo", json!({}))).await.expect_err("ended");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let status = client.cancel_turn(pb::CancelTurnRequest { session_id: id.clone() }).await.expect_err("ended");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    let history = watch(&mut client, &id, 0).await;
    let names = kinds(&history);
    assert_eq!(&names[names.len() - 2..], &["teardown", "finished"], "{names:?}");
    let sequences: Vec<u64> = history.iter().map(|e| e.sequence).collect();
    assert_eq!(sequences, (1..=history.len() as u64).collect::<Vec<_>>(), "no gaps");
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// around the acceptance list: re-validation of the merged sandbox, argument
// schemas checked at load, and a tool_call built-in

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merged_sandbox_the_host_cannot_enforce_is_denied() {
    require_bwrap();
    // none + "network off" cannot be enforced: the gate must deny rather
    // than run a none sandbox that claims no network.
    let no_net = r#"
[[guardrails.policies]]
name = "network-off"
kind = "enforce_sandbox"
arguments = { allow_network = false }
"#;
    let (backends, log) = bwrap_with(BackendFaults::default());
    let mut options = daemon_options(vec![("nonet.toml", none_profile("test.none-no-net", no_net))]);
    options.backends = Some(backends);
    let daemon = TestDaemon::start(options).await;
    let repo = agent_repo();
    let mut client = sessions(&daemon).await;

    let status = create(&mut client, create_request("test.none-no-net", "adm", &repo_path(&repo)))
        .await
        .expect_err("none without network is not enforceable");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let info = status.get_details_error_info().unwrap_or_else(|| panic!("no ErrorInfo: {status:?}"));
    assert_eq!(info.reason, "AGENT_START_DENIED", "{info:?}");
    assert_eq!(info.metadata.get("policy").map(String::as_str), Some("host_enforceability"), "{info:?}");
    assert_eq!(log.lock().unwrap().creates, 0);
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policy_arguments_fail_the_daemon_start_naming_the_file_and_policy() {
    require_bwrap();
    let unknown_field = r#"
[[guardrails.policies]]
name = "typo"
kind = "enforce_sandbox"
arguments = { allow_netwrk = false }
"#;
    let error = build_error(vec![("typo.toml", bwrap_profile("test.typo", unknown_field))], vec![]).await;
    assert!(error.contains("typo.toml") && error.contains("typo") && error.contains("allow_netwrk"), "{error}");

    let wrong_type = r#"
[[guardrails.policies]]
name = "short"
kind = "max_timeout"
arguments = { seconds = "ten" }
"#;
    let error = build_error(vec![("short.toml", bwrap_profile("test.short", wrong_type))], vec![]).await;
    assert!(error.contains("short.toml") && error.contains("short"), "{error}");

    let unknown_kind = PolicySpec { name: "mystery".into(), kind: "sudo".into(), arguments: json!({}), on: vec![] };
    let error = build_error(vec![], vec![unknown_kind]).await;
    assert!(error.contains("policies") && error.contains("mystery") && error.contains("sudo"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tool_calls_denies_past_the_limit_and_the_session_stays_open() {
    require_bwrap();
    let limit = r#"
[[guardrails.policies]]
name = "two-calls"
kind = "max_tool_calls"
arguments = { limit = 2 }
"#;
    let daemon = TestDaemon::start(daemon_options(vec![("limit.toml", bwrap_profile("test.limit", limit))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.limit", "agt", "")).await.expect("created");
    for n in 1..=2 {
        let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": n})).await;
        assert!(turn_finished(&events).ok, "turn {n}: {:?}", turn_finished(&events));
    }
    let events = send_turn(&mut client, &session.session_id, "echo", json!({"echo": 3})).await;
    let done = turn_finished(&events);
    assert!(!done.ok, "{done:?}");
    assert!(done.error.contains("two-calls"), "{done:?}");
    assert_eq!(get(&mut client, &session.session_id).await.state, pb::SessionState::Active as i32);
    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}

/// The CLI drives a session end to end: `corral session create`, `turn`
/// (exit 0 on a good turn, 1 on a failed one), `watch`, `end`; `corral
/// cancel` on an execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_turns_watches_and_ends_a_session() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))])).await;
    let url = format!("unix://{}", daemon.socket().display());
    let _ = daemon.channel().await;
    for _ in 0..100 {
        if daemon.socket().exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let corral = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("--server")
            .arg(&url)
            .args(args)
            .env_remove("CORRAL_SERVER")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, out, err) = corral(&["session", "create", "--profile", "test.session", "--id", "cli-1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("session local-admin/cli-1 state=active"), "{out}");
    let (code, out, err) = corral(&["session", "turn", "cli-1", "--tool", "run", "--arguments", r#"{"echo":"hello"}"#]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("turn_finished") && out.contains("echo hello"), "{out}");
    let (code, out, _) = corral(&["session", "turn", "cli-1", "--tool", "run", "--arguments", r#"{"fail":"no"}"#]);
    assert_eq!(code, Some(1), "a failed turn: {out}");
    let (code, out, err) = corral(&["session", "end", "cli-1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("session local-admin/cli-1 state=ended") && out.contains("turns=2"), "{out}");
    // `watch` exits with how it ended: the session ended, but its last turn
    // failed.
    let (code, out, _) = corral(&["--json", "session", "watch", "cli-1"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.lines().last().is_some_and(|l| l.contains("\"finished\"")), "{out}");
    let (code, _, err) = corral(&["cancel", "no-such-execution"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("NotFound"), "{err}");
}

/// Reads a turn's stream up to its `dispatched` event (within
/// STREAM_LIMIT), and returns what came.
async fn until_dispatched(stream: &mut tonic::Streaming<pb::LifecycleEvent>) -> Vec<pb::LifecycleEvent> {
    let mut events = Vec::new();
    let dispatched = async {
        while let Some(event) = stream.message().await.expect("stream ok") {
            let is_dispatched = matches!(event.kind, Some(Kind::Dispatched(_)));
            events.push(event);
            if is_dispatched {
                return;
            }
        }
        panic!("the stream ended before dispatch: {:?}", kinds(&events));
    };
    tokio::time::timeout(STREAM_LIMIT, dispatched).await.expect("dispatched in time");
    events
}

// ---------------------------------------------------------------------------
// 11. a long session's record stays under the largest message

/// A protocol harness that asks the gate about `arguments.n` tool calls
/// per turn, a hundred at a time (each hundred's verdicts are read before
/// the next: neither pipe fills), then answers how many were allowed.
const ASKING_AGENT: &str = r#"
import json, sys
def out(o):
    sys.stdout.write(json.dumps(o) + "\n")
    sys.stdout.flush()
asked = 0
while True:
    line = sys.stdin.readline()
    if not line:
        break
    task = json.loads(line)
    if task.get("type") != "task":
        continue
    n = (task.get("arguments") or {}).get("n", 0)
    allowed = 0
    while n > 0:
        k = min(n, 100)
        for _ in range(k):
            asked += 1
            out({"type": "policy_request", "id": "r%d" % asked, "tool": "t", "arguments": {}})
        got = 0
        while got < k:
            v = json.loads(sys.stdin.readline())
            if v.get("type") == "policy_verdict":
                got += 1
                allowed += v.get("action") == "allow"
        n -= k
    out({"type": "result", "ok": True, "output": "allowed %d" % allowed})
"#;

/// A bwrap profile running [`ASKING_AGENT`], with four `max_tool_calls`
/// policies of long names that never stop a call: every gate decision
/// adds four verdicts to the evidence.
fn asking_profile() -> String {
    let mut policies = String::new();
    for n in 1..=4 {
        policies.push_str(&format!(
            "[[guardrails.policies]]\nname = \"every-tool-call-is-counted-by-this-long-named-policy-{n}\"\nkind = \
             \"max_tool_calls\"\narguments = {{ limit = 10000000 }}\n"
        ));
    }
    format!(
        r#"id = "test.asking"
version = "1.0.0"
[rein]
argv = ["/usr/bin/python3", "-c", '''{ASKING_AGENT}''']
input = "task_json"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
[limits]
timeout_seconds = 300
max_output_bytes = 65536
{policies}"#
    )
}

/// Thousands of gate decisions over a session's turns (more than 2 MiB of
/// verdicts) and a server whose largest message is 2 MiB: GetSession,
/// EndSession and the `finished` event still arrive, the record keeps the
/// first and last verdicts and says how many more there were, and the
/// counts are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_of_thousands_of_gate_decisions_still_fits_one_message() {
    require_bwrap();
    const TURNS: u64 = 3;
    const ASKS: u64 = 2000;
    let daemon = TestDaemon::start(Options {
        profiles: vec![("asking.toml".into(), asking_profile())],
        config: Box::new(|c| c.grpc.max_send_message_bytes = 2 << 20),
        ..Options::default()
    })
    .await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.asking", "agt", "")).await.expect("created");
    for turn in 1..=TURNS {
        let events = send_turn(&mut client, &session.session_id, "ask", json!({"n": ASKS})).await;
        let done = turn_finished(&events);
        assert!(done.ok, "turn {turn}: {done:?}");
        assert_eq!(done.output, format!("allowed {ASKS}"), "turn {turn}");
    }
    // Every turn's own call and every call its harness asked about.
    let calls = TURNS * (ASKS + 1);
    let check = |session: &pb::Session, what: &str| {
        let evidence = session.evidence.as_ref().expect("evidence");
        let counts = evidence.tool_calls.as_ref().expect("tool_calls");
        assert_eq!((counts.allowed, counts.denied, counts.asked), (calls, 0, 0), "{what}");
        let kept = evidence.gate_decisions.len() as u64;
        assert!(kept < 1000, "{what}: {kept} verdicts kept");
        let agent_start = evidence.gate_decisions.iter().filter(|d| d.policy == "host_enforceability").count();
        assert_eq!(agent_start, 1, "{what}: the first verdicts are kept");
        let more = 4 * calls + 1 - kept;
        let note = format!("{more} more gate decisions");
        assert!(evidence.notes.iter().any(|n| n.contains(&note)), "{what}: no {note:?} in {:?}", evidence.notes);
    };
    let got = get(&mut client, &session.session_id).await;
    check(&got, "GetSession");
    let ended = end(&mut client, &session.session_id).await;
    assert_eq!(ended.state, pb::SessionState::Ended as i32, "{ended:?}");
    check(&ended, "EndSession");
    let history = watch(&mut client, &session.session_id, 0).await;
    check(&session_of(&history), "finished");
    daemon.stop().await;
}

// ---------------------------------------------------------------------------
// 12. the raw cause of a failed end, for its principal only

/// A turn whose task panics (a bug; injected in the rein's dispatch, while
/// the harness runs in its sandbox) ends its session `failed`, torn down,
/// instead of leaving it busy for good (every later turn refused, its
/// sandbox alive until EndSession).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_panics_ends_its_session_failed_and_torn_down() {
    use common::faults::{reins_with, RecordingRein, ReinFaults};
    require_bwrap();
    let (rein, _) = RecordingRein::new(ReinFaults { panic_dispatch: true, ..Default::default() });
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.reins = Some(reins_with(rein));
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.session", "agt", "")).await.expect("created");
    let request = common::as_actor("agt", turn_request(&session.session_id, "echo", json!({})));
    let mut stream = client.send_turn(request).await.expect("turn accepted").into_inner();
    let drained = async { while let Ok(Some(_)) = stream.message().await {} };
    tokio::time::timeout(Duration::from_secs(60), drained).await.expect("the turn's stream ends");
    let read = || {
        let mut client = client.clone();
        let id = session.session_id.clone();
        async move {
            let read = pb::GetSessionRequest { session_id: id };
            client.get_session(common::as_actor("agt", read)).await.expect("stored").into_inner()
        }
    };
    let started = Instant::now();
    let mut record = read().await;
    while record.state != pb::SessionState::Failed as i32 && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        record = read().await;
    }
    assert_eq!(record.state, pb::SessionState::Failed as i32, "{record:?}");
    assert!(daemon.leftover_sandboxes().await.is_empty(), "its sandbox is destroyed");
    daemon.stop().await;
}

/// A session whose start panics (a bug; injected in the rein's start, in
/// the sandbox the session holds, before its harness exists) is recorded
/// `failed` with its sandbox destroyed and its slot given back, as
/// recovery would after a crash; not left `starting`, its sandbox alive
/// and its slot held until the daemon restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_panics_records_its_session_failed_and_gives_back_what_it_held() {
    use common::faults::{reins_with, RecordingRein, ReinFaults};
    require_bwrap();
    let (rein, calls) = RecordingRein::new(ReinFaults { panic_start: true, ..Default::default() });
    let mut options = daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))]);
    options.reins = Some(reins_with(rein));
    // One session at a time: a slot not given back refuses the next start.
    options.config = Box::new(|c| c.max_running_sessions = 1);
    let daemon = TestDaemon::start(options).await;
    let mut client = sessions(&daemon).await;
    for attempt in ["panic-1", "panic-2"] {
        let request =
            pb::CreateSessionRequest { session_id: attempt.into(), ..create_request("test.session", "agt", "") };
        let status = create(&mut client, request).await.expect_err("its start panicked");
        assert_eq!(status.code(), Code::Unavailable, "{attempt}: the slot was not given back: {status:?}");
        assert!(status.message().contains("it is recorded failed"), "{status:?}");
        let read = pb::GetSessionRequest { session_id: attempt.into() };
        let record = client.get_session(common::as_actor("agt", read)).await.expect("stored").into_inner();
        assert_eq!(record.state, pb::SessionState::Failed as i32, "{record:?}");
        let evidence = record.evidence.expect("evidence");
        assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{evidence:?}");
        assert!(daemon.leftover_sandboxes().await.is_empty(), "{attempt}: its sandbox is destroyed");
    }
    assert_eq!(calls.lock().unwrap().iter().filter(|c| **c == "start_session").count(), 2, "both reached the rein");
    daemon.stop().await;
}

/// A session whose start fails says in its evidence where the cause went
/// (the error of the call that started it), not `corral get --full`,
/// which reads executions only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_names_where_its_cause_went() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.session", ""))])).await;
    let mut client = sessions(&daemon).await;
    // A repository whose objects are gone: its clone fails.
    let empty = git_repo();
    for entry in std::fs::read_dir(empty.path().join(".git/objects")).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().is_some_and(|n| n.len() == 2) {
            std::fs::remove_dir_all(path).unwrap();
        }
    }
    let request = pb::CreateSessionRequest {
        session_id: "no-commit".into(),
        ..create_request("test.session", "agt", &repo_path(&empty))
    };
    let status = create(&mut client, request).await.expect_err("nothing can be cloned");
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    let sentence = "sandbox creation failed; the cause went to the call that started the session";
    assert!(status.message().starts_with(&format!("{sentence}: ")), "{status:?}");
    let read = pb::GetSessionRequest { session_id: "no-commit".into() };
    let read = client.get_session(common::as_actor("agt", read)).await.expect("stored").into_inner();
    assert_eq!(read.state, pb::SessionState::Failed as i32, "{read:?}");
    assert_eq!(read.evidence.expect("evidence").error, sentence);
}

/// A session whose harness will not exit ends `failed`: the evidence has
/// the fixed sentence, and the raw cause comes back on EndSession to the
/// session's own principal; another principal of the project, ending or
/// reading such a session, never gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raw_cause_of_a_failed_end_is_read_by_the_sessions_principal_only() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("stubborn.toml", common::stubborn_profile())])).await;
    let mut client = sessions(&daemon).await;
    let mut ids = Vec::new();
    for id in ["stubborn-1", "stubborn-2"] {
        let request = pb::CreateSessionRequest { session_id: id.into(), ..create_request("test.stubborn", "agt", "") };
        ids.push(create(&mut client, request).await.expect("created").session_id);
    }
    let end_as = |actor: &str, id: &str| common::as_actor(actor, pb::EndSessionRequest { session_id: id.into() });

    // Its own principal ends it: the cause comes back.
    let ended = client.end_session(end_as("agt", &ids[0])).await.expect("ends").into_inner();
    assert_eq!(ended.state, pb::SessionState::Failed as i32, "{ended:?}");
    assert!(ended.tool_error.contains("did not exit within"), "{ended:?}");
    let evidence = ended.evidence.as_ref().expect("evidence");
    assert!(!evidence.error.contains("did not exit"), "the evidence keeps a fixed sentence: {}", evidence.error);
    // …which points at where the cause went, not at `corral get`, which
    // reads executions only.
    assert_eq!(evidence.error, "session failed; the cause went to the call that ended it");
    // Another principal of the project reads it: no cause.
    let read = pb::GetSessionRequest { session_id: ids[0].clone() };
    let read = client.get_session(common::as_actor("atm", read)).await.expect("visible").into_inner();
    assert_eq!(read.state, pb::SessionState::Failed as i32, "{read:?}");
    assert_eq!(read.tool_error, "", "{read:?}");

    // Another principal of the project ends one: it fails the same way,
    // and its raw cause is not for that principal.
    let ended = client.end_session(end_as("atm", &ids[1])).await.expect("ends").into_inner();
    assert_eq!(ended.state, pb::SessionState::Failed as i32, "{ended:?}");
    assert_eq!(ended.tool_error, "", "{ended:?}");
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

/// A watcher of a live session gets every stored event, past the first
/// page the store is read in (1,024 events), without waiting for anything
/// new to happen: the proto's "replays stored events, then follows live
/// ones".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_a_live_session_replays_past_the_first_page_without_a_new_event() {
    require_bwrap();
    let daemon = TestDaemon::start(daemon_options(vec![("s.toml", bwrap_profile("test.pages", ""))])).await;
    let mut client = sessions(&daemon).await;
    let session = create(&mut client, create_request("test.pages", "agt", "")).await.expect("created");
    let events = send_turn(&mut client, &session.session_id, "run", json!({"progress": 3000})).await;
    assert!(turn_finished(&events).ok, "{:?}", turn_finished(&events));
    let last = events.last().expect("the turn's events").sequence;
    assert!(last > 3000, "more than two pages stored: {last}");

    // The session stays open and nothing more happens in it.
    let request = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_session(request).await.expect("watch accepted").into_inner();
    let mut seen = Vec::new();
    let to_turn_finished = async {
        while let Some(event) = stream.message().await.expect("stream ok") {
            seen.push(event.sequence);
            if event.sequence == last {
                break;
            }
        }
    };
    let reached = tokio::time::timeout(Duration::from_secs(5), to_turn_finished).await;
    assert!(reached.is_ok(), "the watch stopped after {} events of {last}", seen.len());
    assert_eq!(seen, (1..=last).collect::<Vec<_>>(), "every stored event, in order, once");
    end(&mut client, &session.session_id).await;
    daemon.stop().await;
}
