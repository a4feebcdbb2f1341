//! Who may decide a tool call waiting for approval, on a real daemon with
//! a real bwrap sandbox: the session's harness asks the gate about
//! `deploy` (a `policy_request`), a `require_approval` policy makes it
//! wait, and principals try `DecideToolCall`. The run's own principal,
//! `adm` and an approver of its project may; a principal of the project
//! without `approve` is PERMISSION_DENIED; an approver of another project
//! sees NOT_FOUND, as for a session that does not exist; a call id nobody
//! waits on is NOT_FOUND, one decided already FAILED_PRECONDITION; a
//! malformed request INVALID_ARGUMENT naming its field, and changes
//! nothing.

mod common;

use common::{require_bwrap, Options, TestDaemon};
use corral::auth::PrincipalConfig;
use corral::pb;
use corral::pb::session_service_client::SessionServiceClient;
use tonic::transport::Channel;
use tonic::Code;

const OWNER: &str = "owner-token-0123456789abcdef0123456789abcd";
const APPROVER: &str = "approver-token-0123456789abcdef0123456789";
const BYSTANDER: &str = "bystander-token-0123456789abcdef012345678";
const FAR_APPROVER: &str = "far-approver-token-0123456789abcdef01234";

fn session_profile() -> String {
    common::session_agent_profile("test.session", "")
}

fn principal(name: &str, project: &str, token: &str, approve: bool) -> PrincipalConfig {
    use sha2::Digest;
    PrincipalConfig {
        name: name.into(),
        kind: "agt".into(),
        projects: vec![project.into()],
        token_sha256: Some(hex::encode(sha2::Sha256::digest(token.as_bytes()))),
        approve,
        ..Default::default()
    }
}

fn as_token<T>(token: &str, message: T) -> tonic::Request<T> {
    common::with_token(token, message)
}

/// An admin policy named `name` making every call of `tool` ask a person,
/// who has `timeout_seconds` to decide.
fn asking(name: &str, tool: &str, timeout_seconds: u64) -> corral::policy::PolicySpec {
    corral::policy::PolicySpec {
        name: name.into(),
        kind: "require_approval".into(),
        arguments: serde_json::json!({ "timeout_seconds": timeout_seconds }),
        on: vec![format!("tool_call:{tool}")],
    }
}

/// The session `s1` of the session agent, in project `pa`.
fn create_s1() -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        session_id: "s1".into(),
        profile_ref: "test.session".into(),
        project: "pa".into(),
        ..Default::default()
    }
}

fn decide(call_id: &str, decision: pb::ToolCallDecision, reason: &str) -> pb::DecideSessionToolCallRequest {
    pb::DecideSessionToolCallRequest {
        session_id: "owner/s1".into(),
        call_id: call_id.into(),
        decision: decision as i32,
        reason: reason.into(),
    }
}

/// A daemon where every `deploy` call waits up to 60 s for approval, with
/// the principal `owner` (project `pa`) and `others`, and owner's session
/// `s1` of the session agent; a TCP client for it.
async fn daemon_with_session(others: Vec<PrincipalConfig>) -> (TestDaemon, SessionServiceClient<Channel>) {
    let daemon = TestDaemon::start(Options {
        profiles: vec![("session.toml".into(), session_profile())],
        config: Box::new(move |c| {
            c.principals.push(principal("owner", "pa", OWNER, false));
            c.principals.extend(others);
            c.policies.push(asking("ask-deploy", "deploy", 60));
        }),
        ..Options::default()
    })
    .await;
    let tcp = Channel::from_shared(daemon.url.clone()).unwrap().connect().await.unwrap();
    let mut client = SessionServiceClient::new(tcp);
    client.create_session(as_token(OWNER, create_s1())).await.expect("session created");
    (daemon, client)
}

/// Reads `stream` until an `approval_requested` (its call id), keeping
/// each `approval_decided` on the way as (allow, by, reason) and the raw
/// text of the rest.
async fn next_ask(
    stream: &mut tonic::Streaming<pb::LifecycleEvent>,
    decided: &mut Vec<(bool, String, String)>,
    rest: &mut String,
) -> Option<String> {
    while let Some(event) = stream.message().await.expect("stream ok") {
        match event.kind {
            Some(pb::lifecycle_event::Kind::ApprovalRequested(asked)) => {
                assert_eq!(asked.tool, "deploy");
                assert!(asked.summary.contains("prod"), "{}", asked.summary);
                return Some(asked.call_id);
            }
            Some(pb::lifecycle_event::Kind::ApprovalDecided(d)) => decided.push((d.allow, d.decided_by, d.reason)),
            other => rest.push_str(&format!("{other:?}\n")),
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_adm_and_the_projects_approvers_decide_a_waiting_call() {
    require_bwrap();
    let others = vec![
        principal("approver", "pa", APPROVER, true),
        principal("bystander", "pa", BYSTANDER, false),
        principal("far-approver", "pb", FAR_APPROVER, true),
    ];
    let (daemon, mut client) = daemon_with_session(others).await;
    let ask = serde_json::json!({"ask": [
        {"tool": "deploy", "arguments": {"to": "prod"}},
        {"tool": "deploy", "arguments": {"to": "prod"}},
        {"tool": "deploy", "arguments": {"to": "prod"}},
    ]});
    let turn = pb::SendTurnRequest {
        session_id: "s1".into(),
        tool_call: Some(pb::ToolCall { tool: "run".into(), arguments_json: ask.to_string() }),
    };
    let mut stream = client.send_turn(as_token(OWNER, turn)).await.expect("turn accepted").into_inner();
    let (mut decided, mut rest) = (Vec::new(), String::new());
    let first = next_ask(&mut stream, &mut decided, &mut rest).await.expect("asks");

    // Malformed: INVALID_ARGUMENT naming the field; the call still waits.
    use pb::ToolCallDecision::{Allow, Deny, Unspecified};
    for (request, field) in [
        (decide(&first, Unspecified, ""), "decision"),
        (decide("x", Allow, ""), "call_id"),
        (decide("call-", Allow, ""), "call_id"),
        (decide(&first, Allow, "a\nb"), "reason"),
        (decide(&first, Allow, &"r".repeat(1025)), "reason"),
        (pb::DecideSessionToolCallRequest { decision: 7, ..decide(&first, Allow, "") }, "decision"),
        (pb::DecideSessionToolCallRequest { session_id: String::new(), ..decide(&first, Allow, "") }, "session_id"),
    ] {
        let status = client.decide_tool_call(as_token(OWNER, request)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().contains(field), "{field}: {status:?}");
    }
    // Not the owner, adm or an approver of pa.
    let status = client.decide_tool_call(as_token(BYSTANDER, decide(&first, Allow, ""))).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    // An approver of another project does not see the session at all.
    let far = client.decide_tool_call(as_token(FAR_APPROVER, decide(&first, Allow, ""))).await.unwrap_err();
    assert_eq!(far.code(), Code::NotFound, "{far:?}");
    let missing = pb::DecideSessionToolCallRequest { session_id: "owner/nope".into(), ..decide(&first, Allow, "") };
    let nope = client.decide_tool_call(as_token(FAR_APPROVER, missing)).await.unwrap_err();
    assert_eq!(far.message().replace("owner/s1", "X"), nope.message().replace("owner/nope", "X"), "one answer");
    // A call nobody waits on.
    let unknown = client.decide_tool_call(as_token(OWNER, decide("call-999999", Allow, ""))).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    assert!(unknown.message().contains("call_id"), "{unknown:?}");

    // The approver of pa allows the first; a second decision is too late.
    let answer = client.decide_tool_call(as_token(APPROVER, decide(&first, Allow, "ok"))).await.unwrap().into_inner();
    assert_eq!((answer.allow, answer.decided_by.as_str(), answer.call_id.as_str()), (true, "approver", first.as_str()));
    let twice = client.decide_tool_call(as_token(OWNER, decide(&first, Deny, ""))).await.unwrap_err();
    assert_eq!(twice.code(), Code::FailedPrecondition, "{twice:?}");
    // The owner denies the second, adm (the unix socket) allows the third.
    let second = next_ask(&mut stream, &mut decided, &mut rest).await.expect("asks again");
    client.decide_tool_call(as_token(OWNER, decide(&second, Deny, "not today"))).await.expect("the owner decides");
    let third = next_ask(&mut stream, &mut decided, &mut rest).await.expect("asks a third time");
    let mut admin = SessionServiceClient::new(daemon.channel().await);
    admin.decide_tool_call(decide(&third, Allow, "")).await.expect("adm decides");

    assert_eq!(next_ask(&mut stream, &mut decided, &mut rest).await, None);
    let by = |allow: bool, who: &str, why: &str| (allow, who.to_string(), why.to_string());
    assert_eq!(decided, [by(true, "approver", "ok"), by(false, "owner", "not today"), by(true, "local-admin", "")]);
    // The harness was told each verdict, the owner's reason with the deny.
    assert!(rest.contains("verdict deploy: allow"), "{rest}");
    assert!(rest.contains("verdict deploy: deny (denied by owner: not today)"), "{rest}");
    // Its session's sandbox (and cgroup) go with the daemon's drain.
    daemon.stop().await;
}

/// A turn cancelled while its call waits: the call is not run, the wait
/// is withdrawn (a late decision is FAILED_PRECONDITION) and decided for
/// watchers (`approval_decided` by `corral`: no request stays open), and
/// the session takes its next turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_turn_while_a_call_waits_withdraws_the_call() {
    require_bwrap();
    let (daemon, mut client) = daemon_with_session(Vec::new()).await;
    let ask = serde_json::json!({"ask": {"tool": "deploy", "arguments": {"to": "prod"}}});
    let turn = |arguments: serde_json::Value| pb::SendTurnRequest {
        session_id: "s1".into(),
        tool_call: Some(pb::ToolCall { tool: "run".into(), arguments_json: arguments.to_string() }),
    };
    let mut stream = client.send_turn(as_token(OWNER, turn(ask))).await.expect("turn accepted").into_inner();
    let (mut decided, mut rest) = (Vec::new(), String::new());
    let call = next_ask(&mut stream, &mut decided, &mut rest).await.expect("asks");
    let cancel = pb::CancelTurnRequest { session_id: "s1".into() };
    client.cancel_turn(as_token(OWNER, cancel)).await.expect("cancelled");
    assert_eq!(next_ask(&mut stream, &mut decided, &mut rest).await, None, "the turn ends");
    assert!(!rest.contains("verdict deploy"), "the harness got no verdict: {rest}");
    let closed = (false, "corral".to_string(), "the turn ended before a decision".to_string());
    assert_eq!(decided, [closed], "{rest}");
    let late = client.decide_tool_call(as_token(OWNER, decide(&call, pb::ToolCallDecision::Allow, ""))).await;
    assert_eq!(late.unwrap_err().code(), Code::FailedPrecondition, "the wait was withdrawn");
    assert_eq!(daemon.engine.approvals.pending(), 0);
    let mut next =
        client.send_turn(as_token(OWNER, turn(serde_json::json!({"echo": "again"})))).await.unwrap().into_inner();
    let (mut decided, mut rest) = (Vec::new(), String::new());
    assert_eq!(next_ask(&mut next, &mut decided, &mut rest).await, None);
    assert!(rest.contains("echo again"), "the session takes its next turn: {rest}");
    daemon.stop().await;
}

/// A daemon whose admin policy makes corral's own `run_task` dispatch wait
/// up to 2 s for a person.
async fn daemon_asking_for_run_task() -> TestDaemon {
    let mut profiles = Options::default().profiles;
    profiles.push(("no-input.toml".into(), NO_INPUT_PROFILE.into()));
    TestDaemon::start(Options {
        config: Box::new(|c| {
            c.policies.push(asking("ask-run", "run_task", 2));
        }),
        profiles,
        ..Options::default()
    })
    .await
}

/// A harness that reads no input: it does its work as soon as it runs.
const NO_INPUT_PROFILE: &str = r#"id = "test.no-input"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "echo made > made.txt; echo ran"]
input = "nothing"
[sandbox]
type = "linux_bwrap"
write_paths = ["."]
"#;

/// `refs/corral/<id>` in `repo`, if the run brought anything back.
fn corral_ref(repo: &std::path::Path, id: &str) -> Option<String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["rev-parse", "--verify", "-q", &format!("refs/corral/{id}")])
        .output()
        .unwrap();
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// An execution of `builtin.shell` in `repo` that would create `made.txt`.
fn make_a_file(repo: &std::path::Path) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        repo: repo.display().to_string(),
        ..common::request("builtin.shell", "echo made > made.txt; echo ran")
    }
}

/// Reads `stream` to its end, deciding the first `approval_requested`
/// with `decide` (when given); every event, in order.
async fn run_deciding(
    stream: &mut tonic::Streaming<pb::LifecycleEvent>,
    decide: Option<(pb::ToolCallDecision, &mut corral::pb::execution_service_client::ExecutionServiceClient<Channel>)>,
) -> Vec<pb::LifecycleEvent> {
    let mut decide = decide;
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        if let Some(pb::lifecycle_event::Kind::ApprovalRequested(asked)) = &event.kind {
            if let Some((decision, client)) = decide.take() {
                let request = pb::DecideToolCallRequest {
                    execution_id: event.subject_id.clone(),
                    call_id: asked.call_id.clone(),
                    decision: decision as i32,
                    reason: String::new(),
                };
                client.decide_tool_call(request).await.expect("adm decides");
            }
        }
        events.push(event);
    }
    events
}

/// corral's own dispatch under `require_approval` waits for a person like
/// any other call: nobody decides within 2 s, so the task never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_on_the_dispatched_run_task_waits_and_nobody_deciding_denies_it() {
    require_bwrap();
    let daemon = daemon_asking_for_run_task().await;
    let origin = common::git_repo();
    let events = daemon.execute(make_a_file(origin.path())).await;
    let execution = common::finished(&events);
    let kinds = common::kinds(&events);
    assert!(!kinds.contains(&"dispatched"), "{kinds:?}");
    let asked = events.iter().find_map(|e| match &e.kind {
        Some(pb::lifecycle_event::Kind::ApprovalRequested(a)) => Some(a.clone()),
        _ => None,
    });
    let asked = asked.expect("approval_requested");
    assert_eq!(asked.tool, "run_task");
    assert!(asked.summary.contains("made.txt"), "a person sees the task: {}", asked.summary);
    let decided: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(pb::lifecycle_event::Kind::ApprovalDecided(d)) => {
                Some((d.allow, d.decided_by.clone(), d.reason.clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(decided, [(false, "corral".to_string(), "no decision within 2 s".to_string())]);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    assert!(execution.tool_error.contains("no decision within 2 s"), "{}", execution.tool_error);
    assert!(!execution.tool_output.contains("ran"), "{}", execution.tool_output);
    assert_eq!(common::evidence(&execution).commit_sha, "");
    assert_eq!(corral_ref(origin.path(), &execution.execution_id), None, "no file was made");
    assert_eq!(daemon.engine.approvals.pending(), 0);
    daemon.stop().await;
}

/// A harness that reads no input starts its work when it starts, so it
/// starts only once the gate allowed corral's dispatch: denied, it never
/// ran; allowed, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_that_reads_no_input_never_runs_before_the_dispatch_is_allowed() {
    require_bwrap();
    let daemon = daemon_asking_for_run_task().await;
    let origin = common::git_repo();
    let request =
        pb::ExecuteRequest { repo: origin.path().display().to_string(), ..common::request("test.no-input", "") };
    let events = daemon.execute(request.clone()).await;
    let execution = common::finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    assert!(execution.tool_error.contains("no decision within 2 s"), "{}", execution.tool_error);
    assert_eq!(corral_ref(origin.path(), &execution.execution_id), None, "the harness ran before the decision");
    let mut client = daemon.executions().await;
    let mut decider = daemon.executions().await;
    let mut stream = client.execute(request).await.expect("accepted").into_inner();
    let events = run_deciding(&mut stream, Some((pb::ToolCallDecision::Allow, &mut decider))).await;
    let execution = common::finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert!(execution.tool_output.contains("ran"), "{}", execution.tool_output);
    let head = corral_ref(origin.path(), &execution.execution_id).expect("the file came back");
    assert_eq!(common::git(origin.path(), &["show", &format!("{head}:made.txt")]), "made");
    daemon.stop().await;
}

/// The same ask, allowed by `DecideToolCall`: then, and only then, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_on_the_dispatched_run_task_runs_once_a_person_allows_it() {
    require_bwrap();
    let daemon = daemon_asking_for_run_task().await;
    let origin = common::git_repo();
    let mut client = daemon.executions().await;
    let mut decider = daemon.executions().await;
    let mut stream = client.execute(make_a_file(origin.path())).await.expect("accepted").into_inner();
    let events = run_deciding(&mut stream, Some((pb::ToolCallDecision::Allow, &mut decider))).await;
    let kinds = common::kinds(&events);
    let at = |kind: &str| kinds.iter().position(|k| *k == kind).unwrap_or_else(|| panic!("{kind}: {kinds:?}"));
    assert!(
        at("approval_requested") < at("approval_decided") && at("approval_decided") < at("dispatched"),
        "{kinds:?}"
    );
    let execution = common::finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert!(execution.tool_output.contains("ran"), "{}", execution.tool_output);
    let head = corral_ref(origin.path(), &execution.execution_id).expect("the file came back");
    assert_eq!(common::git(origin.path(), &["show", &format!("{head}:made.txt")]), "made");
    daemon.stop().await;
}

/// A credential across the summary's 512-character cut: the summary is
/// scrubbed whole before it is cut, so not even the value's prefix is
/// recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_across_the_summarys_cut_leaves_no_prefix_behind() {
    require_bwrap();
    const SECRET: &str = common::ROUTE_TEST_VALUE;
    let profile = session_profile().replace("[rein]", "credential_route_refs = [\"route.test\"]\n[rein]");
    let daemon = TestDaemon::start(Options {
        profiles: vec![("session.toml".into(), profile)],
        config: Box::new(|c| {
            c.policies.push(asking("ask-deploy", "deploy", 1));
        }),
        ..Options::default()
    })
    .await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let session_id = client.create_session(create_s1()).await.expect("session created").into_inner().session_id;
    // The value starts 12 characters before the cut.
    let before = r#"{"a_pad":""#.len() + r#"","b_key":""#.len();
    let arguments = serde_json::json!({"a_pad": "x".repeat(500 - before), "b_key": SECRET});
    assert_eq!(arguments.to_string().find(SECRET), Some(500), "the value straddles character 512");
    let ask = serde_json::json!({"ask": {"tool": "deploy", "arguments": arguments}});
    let turn = pb::SendTurnRequest {
        session_id,
        tool_call: Some(pb::ToolCall { tool: "run".into(), arguments_json: ask.to_string() }),
    };
    let mut stream = client.send_turn(turn).await.expect("turn accepted").into_inner();
    let mut summaries = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        if let Some(pb::lifecycle_event::Kind::ApprovalRequested(asked)) = event.kind {
            summaries.push(asked.summary);
        }
    }
    assert_eq!(summaries.len(), 1, "{summaries:?}");
    let summary = &summaries[0];
    assert!(summary.starts_with(r#"{"a_pad":"xxx"#), "{summary}");
    assert!(summary.chars().count() <= 512, "{summary}");
    assert!(!summary.contains(&SECRET[..8]), "a prefix of the credential was recorded: {summary}");
    daemon.stop().await;
}

/// Past the session's event budget nobody would see an `approval_requested`:
/// a call that would wait for a person is denied at once, saying why, and
/// the evidence still counts every tool_call decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_event_budget_a_call_that_would_ask_is_denied_at_once_and_counted() {
    require_bwrap();
    let daemon = TestDaemon::start(Options {
        profiles: vec![("session.toml".into(), common::session_agent_profile("test.session", "max_events = 20"))],
        config: Box::new(|c| {
            c.principals.push(principal("owner", "pa", OWNER, false));
            c.policies.push(asking("ask-deploy", "deploy", 60));
        }),
        ..Options::default()
    })
    .await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    client.create_session(as_token(OWNER, create_s1())).await.expect("session created");
    let turn = |arguments: serde_json::Value| {
        as_token(
            OWNER,
            pb::SendTurnRequest {
                session_id: "s1".into(),
                tool_call: Some(pb::ToolCall { tool: "run".into(), arguments_json: arguments.to_string() }),
            },
        )
    };
    // The budget goes on the first turn's progress.
    let mut stream = client.send_turn(turn(serde_json::json!({"progress": 40}))).await.unwrap().into_inner();
    let (mut decided, mut rest) = (Vec::new(), String::new());
    assert_eq!(next_ask(&mut stream, &mut decided, &mut rest).await, None);
    assert!(rest.contains("Limit("), "the budget was spent: {rest}");

    let asked = std::time::Instant::now();
    let ask = serde_json::json!({"ask": {"tool": "deploy", "arguments": {"to": "prod"}}});
    let mut stream = client.send_turn(turn(ask)).await.unwrap().into_inner();
    let (mut decided, mut rest) = (Vec::new(), String::new());
    assert_eq!(next_ask(&mut stream, &mut decided, &mut rest).await, None, "no request nobody would see");
    assert!(asked.elapsed() < std::time::Duration::from_secs(30), "denied at once, not after the wait");
    assert!(decided.is_empty(), "{decided:?}");
    assert!(rest.contains("verdict deploy: deny"), "{rest}");
    assert!(rest.contains("max_events"), "the verdict says why: {rest}");
    assert_eq!(daemon.engine.approvals.pending(), 0);

    let session = client.get_session(as_token(OWNER, pb::GetSessionRequest { session_id: "s1".into() })).await;
    let evidence = session.expect("get").into_inner().evidence.expect("evidence");
    let counts = evidence.tool_calls.expect("tool_calls");
    assert_eq!((counts.allowed, counts.denied, counts.asked), (2, 1, 0), "both turns and the denied call");
    daemon.stop().await;
}
