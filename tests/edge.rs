//! The edge holds (issue 13), against a real daemon through the generated
//! clients: every malformed field of every RPC is INVALID_ARGUMENT naming
//! it and stores nothing; page tokens are checked; `after_sequence` near
//! u64::MAX is "nothing after it"; a queue worker's id is refused at
//! resolution with the contract's sentence on every path; a CEL bomb denies
//! within its deadline while health keeps answering; watchers and deadlines
//! are bounded; a run whose output is at the caps still reaches `corral
//! exec`. Arbitrary requests (proptest) never panic the daemon and never
//! store a row when they are rejected.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use common::{finished, kinds, request, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;
use corral::pb::session_service_client::SessionServiceClient;
use corral::policy::PolicySpec;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

const FAKE: &str = "test.fake-agent";
const WORKER: &str = "rein-aharness@railiance01";

type Call = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;

async fn rows(daemon: &TestDaemon) -> Vec<(&'static str, i64)> {
    daemon.engine.store.row_counts().await.expect("row counts").to_vec()
}

/// INVALID_ARGUMENT naming `field` in the message and in BadRequest.
fn assert_invalid(label: &str, status: &Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{label}: {status:?}");
    assert!(status.message().starts_with(&format!("{field}:")), "{label}: message should name `{field}`: {status:?}");
    let bad = status.get_details_bad_request().unwrap_or_else(|| panic!("{label}: no BadRequest: {status:?}"));
    assert_eq!(bad.field_violations.first().map(|v| v.field.as_str()), Some(field), "{label}: {bad:?}");
}

fn malformed_refs() -> Vec<String> {
    ["", "a\0b", "ünïcode", "a b", "a@", "@1.0.0", "x@not-semver", "p@1.0.0@2"]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("{}@1.0.0", "a".repeat(129)), "a".repeat(201)])
        .collect()
}

/// Values no token field (ids, actor, project, request ids) accepts.
fn malformed_tokens() -> Vec<String> {
    vec!["a".repeat(129), "a\0".into(), "ü".into(), "a b".into()]
}

fn malformed_ids() -> Vec<String> {
    let mut ids = malformed_tokens();
    ids.push(String::new());
    ids
}

fn malformed_repos(not_a_repo: &str) -> Vec<String> {
    vec!["relative/path".into(), "/tmp/../etc".into(), not_a_repo.into(), "/tmp/a\0b".into(), "/".repeat(4097)]
}

struct Clients {
    exec: pb::execution_service_client::ExecutionServiceClient<Channel>,
    sessions: SessionServiceClient<Channel>,
    catalog: pb::catalog_service_client::CatalogServiceClient<Channel>,
}

impl Clients {
    async fn new(daemon: &TestDaemon) -> Clients {
        Clients {
            exec: daemon.executions().await,
            sessions: SessionServiceClient::new(daemon.channel().await),
            catalog: daemon.catalog().await,
        }
    }
}

/// A call per RPC kind, each taking its request.
fn start_execution(c: &Clients, req: pb::ExecuteRequest) -> Call {
    let mut client = c.exec.clone();
    Box::pin(async move { client.start_execution(req).await.map(|_| ()) })
}
fn execute(c: &Clients, req: pb::ExecuteRequest) -> Call {
    let mut client = c.exec.clone();
    Box::pin(async move { client.execute(req).await.map(|_| ()) })
}
fn create_session(c: &Clients, req: pb::CreateSessionRequest) -> Call {
    let mut client = c.sessions.clone();
    Box::pin(async move { client.create_session(req).await.map(|_| ()) })
}
fn evaluate_gate(c: &Clients, req: pb::EvaluateGateRequest) -> Call {
    let mut client = c.catalog.clone();
    Box::pin(async move { client.evaluate_gate(req).await.map(|_| ()) })
}
fn list_executions(c: &Clients, req: pb::ListExecutionsRequest) -> Call {
    let mut client = c.exec.clone();
    Box::pin(async move { client.list_executions(req).await.map(|_| ()) })
}

fn session_request() -> pb::CreateSessionRequest {
    pb::CreateSessionRequest { profile_ref: FAKE.into(), project: "proj-a".into(), ..Default::default() }
}

fn policy(name: &str, kind: pb::PolicyKind, arguments_json: &str, on: &[&str]) -> pb::PolicySpec {
    pb::PolicySpec {
        name: name.into(),
        kind: kind as i32,
        arguments_json: arguments_json.into(),
        on: on.iter().map(|s| s.to_string()).collect(),
    }
}

/// Session and gate policies that are wrong in shape, and the field named.
fn malformed_policies() -> Vec<(&'static str, Vec<pb::PolicySpec>)> {
    use pb::PolicyKind::{DenyNetwork, Expr};
    let expr = |expression: &str| format!(r#"{{"expression": {expression:?}, "reason": "r"}}"#);
    let kind = |kind: i32| pb::PolicySpec { kind, ..policy("p", DenyNetwork, "{}", &[]) };
    vec![
        ("policies[0].name", vec![policy("", DenyNetwork, "{}", &[])]),
        // A kind is required, and must be one the daemon has built in.
        ("policies[0].kind", vec![kind(pb::PolicyKind::Unspecified as i32)]),
        ("policies[1].kind", vec![policy("p", DenyNetwork, "{}", &[]), kind(99)]),
        ("policies[0].kind", vec![kind(-1)]),
        ("policies[1].arguments_json", vec![policy("p", DenyNetwork, "{}", &[]), policy("q", Expr, "[1]", &[])]),
        ("policies[0].arguments_json", vec![policy("p", Expr, "{", &[])]),
        ("policies[0].on[0]", vec![policy("p", DenyNetwork, "{}", &["tool call"])]),
        ("policies", vec![policy("p", DenyNetwork, "{}", &[]); 33]),
        // Shape is right; it does not load: too large, too deep, arguments
        // its kind does not take.
        ("policies[0]", vec![policy("big", Expr, &expr(&format!("actor == '{}'", "a".repeat(5000))), &[])]),
        ("policies[0]", vec![policy("deep", Expr, &expr(&format!("{}true{}", "(".repeat(80), ")".repeat(80))), &[])]),
        ("policies[0]", vec![policy("p", DenyNetwork, r#"{"hosts": ["x"]}"#, &[])]),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_malformed_field_of_every_rpc_is_invalid_argument_and_stores_nothing() {
    let daemon = TestDaemon::start(Options::default()).await;
    let c = Clients::new(&daemon).await;
    let not_a_repo = tempfile::tempdir().unwrap();
    let not_a_repo = not_a_repo.path().display().to_string();

    // Records to page over: two refused executions, two refused sessions.
    for _ in 0..2 {
        finished(&daemon.execute(request("no.such.profile", "NOWORK")).await);
        let mut refused = session_request();
        refused.profile_ref = "no.such.profile".into();
        let status = c.sessions.clone().create_session(refused).await.expect_err("unknown profile");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    }
    let page = |req: pb::ListExecutionsRequest| {
        let mut client = c.exec.clone();
        async move { client.list_executions(req).await.expect("list").into_inner() }
    };
    let execution_token = page(pb::ListExecutionsRequest { page_size: 1, ..Default::default() }).await.next_page_token;
    assert!(!execution_token.is_empty());
    let second =
        page(pb::ListExecutionsRequest { page_size: 1, page_token: execution_token.clone(), ..Default::default() })
            .await;
    assert_eq!(second.executions.len(), 1, "a real token pages on");
    let project_token =
        page(pb::ListExecutionsRequest { page_size: 1, project: "proj-a".into(), ..Default::default() })
            .await
            .next_page_token;
    let session_token = c
        .sessions
        .clone()
        .list_sessions(pb::ListSessionsRequest { page_size: 1, page_token: String::new() })
        .await
        .expect("list sessions")
        .into_inner()
        .next_page_token;
    assert!(!session_token.is_empty() && !project_token.is_empty());
    let mut edited = execution_token.clone();
    let at = edited.len() - 1;
    edited.replace_range(at.., if edited.ends_with('0') { "1" } else { "0" });
    let bogus_tokens = [
        "bogus-token".to_string(),
        edited,
        session_token.clone(),
        project_token.clone(),
        format!("{execution_token}x"),
        "v1.zz.zz".into(),
    ];

    let mut cases: Vec<(String, &'static str, Call)> = Vec::new();
    let mut add = |label: String, field: &'static str, call: Call| cases.push((label, field, call));

    // ExecutionService: Execute and StartExecution, field by field.
    type Set = fn(&mut pb::ExecuteRequest, String);
    let mut execute_fields: Vec<(&'static str, Set, Vec<String>)> = vec![
        ("harness_profile_ref", |r, v| r.harness_profile_ref = v, malformed_refs()),
        ("title", |r, v| r.title = v, vec!["t".repeat(1025), "a\0b".into()]),
        ("description", |r, v| r.description = v, vec!["d".repeat(256 * 1024 + 1), "\0".into()]),
        ("repo", |r, v| r.repo = v, malformed_repos(&not_a_repo)),
    ];
    for field in ["request_id", "correlation_id", "assignment_ref", "actor", "project"] {
        let set: Set = match field {
            "request_id" => |r, v| r.request_id = v,
            "correlation_id" => |r, v| r.correlation_id = v,
            "assignment_ref" => |r, v| r.assignment_ref = v,
            "actor" => |r, v| r.actor = v,
            _ => |r, v| r.project = v,
        };
        execute_fields.push((field, set, malformed_tokens()));
    }
    for (field, set, values) in &execute_fields {
        for value in values {
            let mut req = request(FAKE, "NOWORK");
            set(&mut req, value.clone());
            let shown = format!("{value:.40?}");
            add(format!("StartExecution {field}={shown}"), field, start_execution(&c, req.clone()));
            add(format!("Execute {field}={shown}"), field, execute(&c, req));
        }
    }
    // Records by id.
    for id in malformed_ids() {
        let (mut e1, mut e2, mut e3) = (c.exec.clone(), c.exec.clone(), c.exec.clone());
        let watch = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
        add(
            format!("WatchExecution {id:.20?}"),
            "execution_id",
            Box::pin(async move { e1.watch_execution(watch).await.map(|_| ()) }),
        );
        let get = pb::GetExecutionRequest { execution_id: id.clone(), ..Default::default() };
        add(
            format!("GetExecution {id:.20?}"),
            "execution_id",
            Box::pin(async move { e2.get_execution(get).await.map(|_| ()) }),
        );
        let cancel = pb::CancelExecutionRequest { execution_id: id.clone() };
        add(
            format!("CancelExecution {id:.20?}"),
            "execution_id",
            Box::pin(async move { e3.cancel_execution(cancel).await.map(|_| ()) }),
        );
        for rpc in ["SendTurn", "WatchSession", "GetSession", "CancelTurn", "EndSession"] {
            let mut s = c.sessions.clone();
            let id = id.clone();
            let call: Call = match rpc {
                "SendTurn" => Box::pin(async move {
                    let call = pb::ToolCall { tool: "edit".into(), arguments_json: "{}".into() };
                    s.send_turn(pb::SendTurnRequest { session_id: id, tool_call: Some(call) }).await.map(|_| ())
                }),
                "WatchSession" => Box::pin(async move {
                    s.watch_session(pb::WatchSessionRequest { session_id: id, after_sequence: 0 }).await.map(|_| ())
                }),
                "GetSession" => {
                    Box::pin(async move { s.get_session(pb::GetSessionRequest { session_id: id }).await.map(|_| ()) })
                }
                "CancelTurn" => {
                    Box::pin(async move { s.cancel_turn(pb::CancelTurnRequest { session_id: id }).await.map(|_| ()) })
                }
                _ => Box::pin(async move { s.end_session(pb::EndSessionRequest { session_id: id }).await.map(|_| ()) }),
            };
            add(format!("{rpc} session_id"), "session_id", call);
        }
    }
    let mut e = c.exec.clone();
    let get = pb::GetExecutionRequest { execution_id: "x".into(), view: 7 };
    add("GetExecution view=7".into(), "view", Box::pin(async move { e.get_execution(get).await.map(|_| ()) }));
    // ListExecutions.
    add(
        "ListExecutions state=99".into(),
        "state",
        list_executions(&c, pb::ListExecutionsRequest { state: 99, ..Default::default() }),
    );
    add(
        "ListExecutions page_size".into(),
        "page_size",
        list_executions(&c, pb::ListExecutionsRequest { page_size: 501, ..Default::default() }),
    );
    for value in malformed_refs().into_iter().filter(|v| !v.is_empty()) {
        let req = pb::ListExecutionsRequest { profile_ref: value, ..Default::default() };
        add("ListExecutions profile_ref".into(), "profile_ref", list_executions(&c, req));
    }
    for value in malformed_tokens() {
        let req = pb::ListExecutionsRequest { actor: value.clone(), ..Default::default() };
        add("ListExecutions actor".into(), "actor", list_executions(&c, req));
        let req = pb::ListExecutionsRequest { project: value, ..Default::default() };
        add("ListExecutions project".into(), "project", list_executions(&c, req));
    }
    for token in &bogus_tokens {
        let req = pb::ListExecutionsRequest { page_token: token.clone(), ..Default::default() };
        add(format!("ListExecutions page_token={token:.30}"), "page_token", list_executions(&c, req));
        // A session listing's own token is good there, and nowhere else.
        if *token != session_token {
            let mut s = c.sessions.clone();
            let req = pb::ListSessionsRequest { page_size: 0, page_token: token.clone() };
            add(
                format!("ListSessions page_token={token:.30}"),
                "page_token",
                Box::pin(async move { s.list_sessions(req).await.map(|_| ()) }),
            );
        }
    }
    let mut s = c.sessions.clone();
    add(
        "ListSessions page_size".into(),
        "page_size",
        Box::pin(async move {
            s.list_sessions(pb::ListSessionsRequest { page_size: 501, page_token: String::new() }).await.map(|_| ())
        }),
    );
    // SendTurn's tool call.
    let calls: Vec<(&'static str, Option<pb::ToolCall>)> = vec![
        ("tool_call", None),
        ("tool_call.tool", Some(pb::ToolCall { tool: String::new(), arguments_json: String::new() })),
        ("tool_call.tool", Some(pb::ToolCall { tool: "édit".into(), arguments_json: String::new() })),
        ("tool_call.arguments_json", Some(pb::ToolCall { tool: "edit".into(), arguments_json: "{".into() })),
        ("tool_call.arguments_json", Some(pb::ToolCall { tool: "edit".into(), arguments_json: "\0".repeat(300_000) })),
    ];
    for (field, tool_call) in calls {
        let mut s = c.sessions.clone();
        let req = pb::SendTurnRequest { session_id: "s-1".into(), tool_call };
        add(format!("SendTurn {field}"), field, Box::pin(async move { s.send_turn(req).await.map(|_| ()) }));
    }
    // CreateSession.
    for value in malformed_refs() {
        add(
            "CreateSession profile_ref".into(),
            "profile_ref",
            create_session(&c, pb::CreateSessionRequest { profile_ref: value, ..session_request() }),
        );
    }
    for value in malformed_tokens() {
        add(
            "CreateSession session_id".into(),
            "session_id",
            create_session(&c, pb::CreateSessionRequest { session_id: value.clone(), ..session_request() }),
        );
        add(
            "CreateSession actor".into(),
            "actor",
            create_session(&c, pb::CreateSessionRequest { actor: value.clone(), ..session_request() }),
        );
        add(
            "CreateSession project".into(),
            "project",
            create_session(&c, pb::CreateSessionRequest { project: value, ..session_request() }),
        );
    }
    for repo in malformed_repos(&not_a_repo) {
        add(
            "CreateSession repo".into(),
            "repo",
            create_session(&c, pb::CreateSessionRequest { repo, ..session_request() }),
        );
    }
    for (field, policies) in malformed_policies() {
        add(
            format!("CreateSession {field}"),
            field,
            create_session(&c, pb::CreateSessionRequest { policies: policies.clone(), ..session_request() }),
        );
        let gate =
            pb::EvaluateGateRequest { profile_ref: FAKE.into(), actor: "adm".into(), policies, ..Default::default() };
        add(format!("EvaluateGate {field}"), field, evaluate_gate(&c, gate));
    }
    // CatalogService.
    for value in malformed_refs() {
        let mut k = c.catalog.clone();
        let get = pb::GetProfileRequest { profile_ref: value.clone() };
        add(
            "GetProfile profile_ref".into(),
            "profile_ref",
            Box::pin(async move { k.get_profile(get).await.map(|_| ()) }),
        );
        let mut k = c.catalog.clone();
        let resolve = pb::ResolveProfileRequest { profile_ref: value.clone(), actor: String::new() };
        add(
            "ResolveProfile profile_ref".into(),
            "profile_ref",
            Box::pin(async move { k.resolve_profile(resolve).await.map(|_| ()) }),
        );
        let gate = pb::EvaluateGateRequest { profile_ref: value, actor: "adm".into(), ..Default::default() };
        add("EvaluateGate profile_ref".into(), "profile_ref", evaluate_gate(&c, gate));
    }
    for value in malformed_tokens() {
        let mut k = c.catalog.clone();
        let resolve = pb::ResolveProfileRequest { profile_ref: FAKE.into(), actor: value.clone() };
        add(
            "ResolveProfile actor".into(),
            "actor",
            Box::pin(async move { k.resolve_profile(resolve).await.map(|_| ()) }),
        );
        let gate = pb::EvaluateGateRequest { profile_ref: FAKE.into(), actor: value.clone(), ..Default::default() };
        add("EvaluateGate actor".into(), "actor", evaluate_gate(&c, gate));
        let gate = pb::EvaluateGateRequest {
            profile_ref: FAKE.into(),
            actor: "adm".into(),
            project: value,
            ..Default::default()
        };
        add("EvaluateGate project".into(), "project", evaluate_gate(&c, gate));
    }
    for repo in malformed_repos(&not_a_repo) {
        let gate =
            pb::EvaluateGateRequest { profile_ref: FAKE.into(), actor: "adm".into(), repo, ..Default::default() };
        add("EvaluateGate repo".into(), "repo", evaluate_gate(&c, gate));
    }

    let total = cases.len();
    assert!(total >= 240, "only {total} cases");
    for (label, field, call) in cases {
        let before = rows(&daemon).await;
        let status = call.await.expect_err(&label);
        assert_invalid(&label, &status, field);
        assert_eq!(rows(&daemon).await, before, "{label}: a rejected request changed the store");
    }

    // Past the server's largest request (tonic answers OUT_OF_RANGE for a
    // message over the limit), nothing stored.
    let before = rows(&daemon).await;
    let huge = request(FAKE, &"d".repeat(5 << 20));
    let status = c.exec.clone().start_execution(huge).await.expect_err("too large");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("4194304"), "{status:?}");
    assert_eq!(rows(&daemon).await, before);

    // after_sequence past the last stored event names an event no caller
    // has seen: OUT_OF_RANGE with the last one, for executions and
    // sessions alike, up to u64::MAX; the last itself is "nothing after
    // it". An unknown subject is still NOT_FOUND.
    let execution_id = second.executions[0].execution_id.clone();
    let sessions = c.sessions.clone().list_sessions(pb::ListSessionsRequest::default()).await.unwrap().into_inner();
    let session_id = sessions.sessions[0].session_id.clone();
    let last = |events: &[pb::LifecycleEvent]| events.last().expect("events").sequence;
    let execution_last = last(&daemon.watch_all(&execution_id, 0).await);
    let session_events = |after| {
        let mut s = c.sessions.clone();
        let req = pb::WatchSessionRequest { session_id: session_id.clone(), after_sequence: after };
        async move {
            let mut stream = s.watch_session(req).await?.into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream.message().await? {
                events.push(event);
            }
            Ok::<_, tonic::Status>(events)
        }
    };
    let session_last = last(&session_events(0).await.expect("session events"));
    assert!(daemon.watch_all(&execution_id, execution_last).await.is_empty());
    assert!(session_events(session_last).await.expect("after the last").is_empty());
    let refused = |status: tonic::Status, past: u64, last: u64| {
        assert_eq!(status.code(), Code::OutOfRange, "after {past}: {status:?}");
        let info = status.get_details_error_info().expect("details");
        assert_eq!(info.reason, "SEQUENCE_NOT_STORED");
        assert_eq!(info.metadata.get("last_sequence"), Some(&last.to_string()), "after {past}");
    };
    for past in [execution_last + 1, u64::MAX, i64::MAX as u64 + 1] {
        let req = pb::WatchRequest { execution_id: execution_id.clone(), after_sequence: past };
        refused(c.exec.clone().watch_execution(req).await.expect_err("past the last"), past, execution_last);
    }
    for past in [session_last + 1, u64::MAX - 1, i64::MAX as u64] {
        refused(session_events(past).await.expect_err("past the last"), past, session_last);
    }
    let watch = pb::WatchRequest { execution_id: "no-such-execution".into(), after_sequence: u64::MAX };
    let status = c.exec.clone().watch_execution(watch).await.expect_err("unknown");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(rows(&daemon).await, before);
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_worker_actor_is_refused_at_resolution_on_every_path() {
    let daemon = TestDaemon::start(Options::default()).await;
    let c = Clients::new(&daemon).await;
    let refused = |record: &pb::Execution, label: &str| {
        assert_eq!(record.state, pb::ExecutionState::Refused as i32, "{label}: {record:?}");
        let evidence = record.evidence.clone().expect("evidence");
        assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32, "{label}: {evidence:?}");
        assert_eq!(evidence.error, corral::catalog::ACTOR_REFUSAL, "{label}");
        assert!(evidence.sandbox_id.is_empty(), "{label}: a sandbox was created");
    };
    // Any non-governed string up to the bound, however long.
    for (i, actor) in [WORKER.to_string(), "w".repeat(128)].into_iter().enumerate() {
        let mut req = request(FAKE, "NOWORK");
        req.actor = actor.clone();
        let events = daemon.execute(req.clone()).await;
        assert_eq!(kinds(&events), ["accepted", "teardown", "finished"], "Execute");
        refused(&finished(&events), "Execute");

        let started = c.exec.clone().start_execution(req).await.expect("StartExecution accepts").into_inner();
        let events = daemon.watch_all(&started.execution_id, 0).await;
        assert!(!kinds(&events).contains(&"sandbox_ready"));
        refused(&finished(&events), "StartExecution");

        let session_id = format!("worker-session-{i}");
        let req = pb::CreateSessionRequest { session_id: session_id.clone(), actor, ..session_request() };
        let status = c.sessions.clone().create_session(req).await.expect_err("CreateSession refuses");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(status.message(), corral::catalog::ACTOR_REFUSAL);
        assert_eq!(status.get_details_error_info().expect("error info").reason, "RESOLUTION_REFUSED");
        let session = c
            .sessions
            .clone()
            .get_session(pb::GetSessionRequest { session_id })
            .await
            .expect("the refusal is recorded")
            .into_inner();
        let evidence = session.evidence.expect("evidence");
        assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32, "{evidence:?}");
        assert_eq!(evidence.error, corral::catalog::ACTOR_REFUSAL);
    }
    // ResolveProfile says the same.
    let req = pb::ResolveProfileRequest { profile_ref: FAKE.into(), actor: WORKER.into() };
    let status = c.catalog.clone().resolve_profile(req).await.expect_err("refused");
    assert_eq!((status.code(), status.message()), (Code::FailedPrecondition, corral::catalog::ACTOR_REFUSAL));
    // Only past the size bound is it malformed.
    let mut req = request(FAKE, "NOWORK");
    req.actor = "w".repeat(129);
    assert_invalid("129-byte actor", &c.exec.clone().start_execution(req).await.unwrap_err(), "actor");

    let sandboxes = rows(&daemon).await.into_iter().find(|(t, _)| *t == "sandboxes").unwrap().1;
    assert_eq!(sandboxes, 0, "no sandbox was ever created");
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

/// Eight nested `all` over ten elements: 10^8 iterations, under 1 KiB.
fn cel_bomb() -> String {
    let list = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]";
    let mut bomb = "true".to_string();
    for v in ["a", "b", "c", "d", "e", "f", "g", "h"] {
        bomb = format!("{list}.all({v}, {bomb})");
    }
    assert!(bomb.len() < 1024);
    bomb
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cel_bomb_denies_within_its_deadline_while_health_answers() {
    let bomb = PolicySpec {
        name: "bomb".into(),
        kind: "expr".into(),
        arguments: serde_json::json!({"expression": cel_bomb(), "reason": "never reached"}),
        on: vec![],
    };
    let daemon =
        TestDaemon::start(Options { config: Box::new(move |c| c.policies = vec![bomb]), ..Options::default() }).await;
    let c = Clients::new(&daemon).await;

    // Health, probed all along on its own connection.
    let mut health = tonic_health::pb::health_client::HealthClient::new(daemon.channel().await);
    let probing = tokio_util::sync::CancellationToken::new();
    let stop = probing.clone();
    let prober = tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        let mut probes = 0;
        while !stop.is_cancelled() {
            let t = Instant::now();
            health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.expect("health");
            worst = worst.max(t.elapsed());
            probes += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (worst, probes)
    });

    let gate = |c: &Clients| {
        let mut k = c.catalog.clone();
        async move {
            let req = pb::EvaluateGateRequest {
                profile_ref: FAKE.into(),
                actor: "adm".into(),
                project: "proj-a".into(),
                ..Default::default()
            };
            let t = Instant::now();
            let answer = k.evaluate_gate(req).await.expect("evaluate gate").into_inner();
            (t.elapsed(), answer)
        }
    };
    let mut slowest = Duration::ZERO;
    for _ in 0..8 {
        let ((a, first), (b, second)) = tokio::join!(gate(&c), gate(&c));
        slowest = slowest.max(a).max(b);
        for answer in [first, second] {
            assert_eq!(answer.action, pb::GateAction::Deny as i32, "{answer:?}");
            let decision = answer.decisions.iter().find(|d| d.policy == "bomb").expect("the bomb decided");
            assert!(decision.reason.contains("exceeded its evaluation budget"), "{decision:?}");
            assert!(decision.reason.contains("fail closed"), "{decision:?}");
        }
    }
    // The deadline is 100 ms; a call carries it and its own round trip.
    assert!(slowest < Duration::from_millis(600), "a bomb took {slowest:?} to deny");

    // An execution under the same policy is refused at the gate.
    let record = finished(&daemon.execute(request(FAKE, "NOWORK")).await);
    assert_eq!(record.state, pb::ExecutionState::Refused as i32, "{record:?}");
    let evidence = record.evidence.expect("evidence");
    assert_eq!(evidence.failure_stage, pb::FailureStage::Gate as i32);
    assert!(evidence.error.contains("bomb") && evidence.error.contains("evaluation budget"), "{}", evidence.error);

    probing.cancel();
    let (worst, probes) = prober.await.unwrap();
    assert!(probes >= 10, "only {probes} health probes");
    assert!(worst < Duration::from_millis(100), "health waited {worst:?} while bombs were evaluated");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_are_bounded_and_a_deadline_ends_a_stream() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options {
        config: Box::new(|c| {
            c.grpc.max_watchers_per_subject = 2;
            c.grpc.max_watchers = 3;
        }),
        ..Options::default()
    })
    .await;
    let c = Clients::new(&daemon).await;
    let hang = |c: &Clients| {
        let mut e = c.exec.clone();
        async move { e.start_execution(request(FAKE, "NOWORK\nHANG")).await.expect("start").into_inner().execution_id }
    };
    let watch = |c: &Clients, id: &str| {
        let mut e = c.exec.clone();
        let req = pb::WatchRequest { execution_id: id.to_string(), after_sequence: 0 };
        async move {
            let mut stream = e.watch_execution(req).await?.into_inner();
            stream.message().await?.expect("a first event");
            Ok::<_, Status>(stream)
        }
    };
    let (a, b) = (hang(&c).await, hang(&c).await);
    let a1 = watch(&c, &a).await.expect("first watcher of a");
    let _a2 = watch(&c, &a).await.expect("second watcher of a");
    let status = watch(&c, &a).await.expect_err("third watcher of a");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("follow"), "{status:?}");
    let _b1 = watch(&c, &b).await.expect("first watcher of b");
    let status = watch(&c, &b).await.expect_err("past the total");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // A watcher that goes away gives its place back.
    drop(a1);
    let _b2 = common::once_admitted("the place was not given back", || watch(&c, &b)).await;
    drop((_a2, _b1, _b2));

    // A stream with a deadline ends with DEADLINE_EXCEEDED when it passes;
    // the execution goes on. (The watchers just dropped give their places
    // back as the daemon notices they are gone.)
    let deadline_watch = async {
        let (t, mut stream) = common::once_admitted("watch with a deadline", || {
            let mut e = c.exec.clone();
            let mut req = tonic::Request::new(pb::WatchRequest { execution_id: a.clone(), after_sequence: 0 });
            req.set_timeout(Duration::from_millis(500));
            async move {
                let t = Instant::now();
                e.watch_execution(req).await.map(|stream| (t, stream.into_inner()))
            }
        })
        .await;
        let ended = loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => break status,
            }
        };
        (t.elapsed(), ended)
    };
    let (took, status) = deadline_watch.await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let record = c.exec.clone().get_execution(pb::GetExecutionRequest { execution_id: a.clone(), view: 0 }).await;
    assert_eq!(record.unwrap().into_inner().state, pb::ExecutionState::Running as i32, "a deadline cancels nothing");
    for id in [&a, &b] {
        c.exec.clone().cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.unwrap();
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_at_the_caps_still_reaches_corral_exec() {
    common::require_bwrap();
    // Default output caps (4 MiB per stream); both streams past them.
    let profile = r#"id = "test.big-output"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", "yes 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef | head -c 6000000; yes e | head -c 6000000 >&2"]
input = "nothing"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
[limits]
timeout_seconds = 60
"#;
    let daemon =
        TestDaemon::start(Options { profiles: vec![("big.toml".into(), profile.into())], ..Options::default() }).await;
    // The daemon answers on its socket before the client runs.
    let c = Clients::new(&daemon).await;
    let server = format!("unix://{}", daemon.socket().display());
    let args =
        ["--server", &server, "--json", "exec", "--profile", "test.big-output", "--title", "t", "--description", "d"];
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(args)
        .env_remove("CORRAL_SERVER")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("corral runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "corral exec: {}\n{:.2000}",
        String::from_utf8_lossy(&output.stderr),
        stdout
    );
    let events: Vec<serde_json::Value> = stdout.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let text = serde_json::to_string(&events).unwrap();
    assert!(text.contains("OUTPUT_STREAM_TOOL_OUTPUT"), "no output_truncated for tool_output in {:.3000}", text);

    // The record holds the same, cut output for its owner.
    let list = c.exec.clone().list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    let id = list.executions[0].execution_id.clone();
    let full = c.exec.clone().get_execution(pb::GetExecutionRequest { execution_id: id.clone(), view: 2 }).await;
    let full = full.expect("GetExecution FULL fits in one message").into_inner();
    assert_eq!(full.state, pb::ExecutionState::Succeeded as i32);
    assert!(full.tool_output.len() > 3 << 20 && full.tool_output.len() < 4 << 20, "{}", full.tool_output.len());
    let events = daemon.watch_all(&id, 0).await;
    let cut: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::OutputTruncated(t)) => Some((t.stream(), t.bytes_dropped)),
            _ => None,
        })
        .collect();
    assert!(cut.iter().any(|&(s, n)| s == pb::OutputStream::Stdout && n > 0), "{cut:?}");
    assert!(cut.iter().any(|&(s, n)| s == pb::OutputStream::ToolOutput && n > 0), "{cut:?}");
    daemon.stop().await;
}

/// Arbitrary requests: the daemon never panics (every answer is a status
/// of the contract), and a request it rejects stores nothing. The gate
/// denies everything here, so no sandbox is ever made.
#[test]
fn arbitrary_requests_never_panic_and_rejected_ones_store_nothing() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let deny_all = PolicySpec {
        name: "deny-all".into(),
        kind: "expr".into(),
        arguments: serde_json::json!({"expression": "false", "reason": "property test"}),
        on: vec![],
    };
    let daemon = runtime.block_on(TestDaemon::start(Options {
        config: Box::new(move |c| c.policies = vec![deny_all]),
        ..Options::default()
    }));
    let clients = runtime.block_on(Clients::new(&daemon));

    let text = || {
        prop_oneof![
            Just(String::new()),
            Just(FAKE.to_string()),
            Just("test.fake-agent@1.0.0".to_string()),
            Just("adm".to_string()),
            Just("proj-a".to_string()),
            Just(WORKER.to_string()),
            proptest::sample::select(vec!["a@", "@1.0.0", "x@not-semver", "p@1.0.0@2"]).prop_map(String::from),
            "[a-z.@0-9-]{0,12}",
            "\\PC{0,16}",
            ".{120,140}",
            any::<String>(),
        ]
    };
    let execute = (text(), text(), text(), text(), text(), text()).prop_map(|(r, title, id, actor, project, repo)| {
        pb::ExecuteRequest {
            harness_profile_ref: r,
            title,
            description: "NOWORK".into(),
            request_id: id,
            actor,
            project,
            repo,
            ..Default::default()
        }
    });
    let session = (text(), text(), text(), text()).prop_map(|(id, r, actor, project)| pb::CreateSessionRequest {
        session_id: id,
        profile_ref: r,
        actor,
        project,
        ..Default::default()
    });
    let listing = (text(), text(), any::<i32>(), 0u32..600, text()).prop_map(
        |(profile_ref, actor, state, page_size, page_token)| pb::ListExecutionsRequest {
            state,
            profile_ref,
            actor,
            project: String::new(),
            page_size,
            page_token,
        },
    );
    let strategy = (execute, session, listing, text(), any::<u64>(), any::<i32>());

    let mut runner = TestRunner::new(Config { cases: 48, failure_persistence: None, ..Config::default() });
    let allowed = [
        Code::InvalidArgument,
        Code::NotFound,
        Code::FailedPrecondition,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::AlreadyExists,
    ];
    runner
        .run(&strategy, |(execute, session, listing, id, after, view)| {
            runtime
                .block_on(async {
                    let c = &clients;
                    let outcomes: Vec<(&str, Result<(), Status>)> = vec![
                        ("StartExecution", {
                            let before = rows(&daemon).await;
                            let r = c.exec.clone().start_execution(execute.clone()).await;
                            match &r {
                                Err(_) => assert_eq!(rows(&daemon).await, before, "{execute:?}"),
                                // The gate refuses it at once; wait for its end, so
                                // the counts around the next calls are settled.
                                Ok(e) => {
                                    finished(&daemon.watch_all(&e.get_ref().execution_id, 0).await);
                                }
                            }
                            r.map(|_| ())
                        }),
                        ("CreateSession", {
                            let before = rows(&daemon).await;
                            let r = c.sessions.clone().create_session(session.clone()).await;
                            if let Err(status) = &r {
                                let recorded = status.get_details_error_info().is_some_and(|i| {
                                    i.reason == "RESOLUTION_REFUSED" || i.reason == "AGENT_START_DENIED"
                                });
                                if !recorded {
                                    assert_eq!(rows(&daemon).await, before, "{session:?}: {status:?}");
                                }
                            }
                            r.map(|_| ())
                        }),
                        ("ListExecutions", c.exec.clone().list_executions(listing.clone()).await.map(|_| ())),
                        ("GetExecution", {
                            let req = pb::GetExecutionRequest { execution_id: id.clone(), view };
                            c.exec.clone().get_execution(req).await.map(|_| ())
                        }),
                        ("WatchExecution", {
                            let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: after };
                            match c.exec.clone().watch_execution(req).await {
                                Ok(stream) => {
                                    let mut stream = stream.into_inner();
                                    while stream.message().await?.is_some() {}
                                    Ok(())
                                }
                                Err(e) => Err(e),
                            }
                        }),
                        (
                            "GetProfile",
                            c.catalog
                                .clone()
                                .get_profile(pb::GetProfileRequest { profile_ref: id.clone() })
                                .await
                                .map(|_| ()),
                        ),
                    ];
                    for (rpc, outcome) in outcomes {
                        if let Err(status) = outcome {
                            assert!(allowed.contains(&status.code()), "{rpc}: {status:?}");
                        }
                    }
                    Ok::<(), Status>(())
                })
                .map_err(|e| TestCaseError::fail(format!("{e:?}")))
        })
        .unwrap();
    let sandboxes = runtime.block_on(rows(&daemon)).into_iter().find(|(t, _)| *t == "sandboxes").unwrap().1;
    assert_eq!(sandboxes, 0);
    runtime.block_on(daemon.stop());
}

/// A caller whose deadline passes while its session starts leaves a whole
/// session: the start goes on, on the engine's own task, and its admission
/// slot comes back exactly once. Creating the sandbox takes 300 ms here, so
/// a 100 ms deadline passes in the middle of the start. A deadline can also
/// pass before the request reaches the engine (a busy machine, still in
/// validation); such an attempt must have left nothing, and is tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unary_deadline_never_leaves_a_half_made_session() {
    common::require_bwrap();
    let (backends, log) =
        common::faults::bwrap_with(common::faults::BackendFaults { slow_create: true, ..Default::default() });
    let daemon = TestDaemon::start(Options {
        backends: Some(backends),
        config: Box::new(|c| c.max_running_sessions = 1),
        ..Options::default()
    })
    .await;
    let c = Clients::new(&daemon).await;
    let get = |id: String| {
        let mut s = c.sessions.clone();
        async move { s.get_session(pb::GetSessionRequest { session_id: id }).await }
    };
    let mut hurried = None;
    for attempt in 0..5 {
        let id = format!("hurried-{attempt}");
        let creates = log.lock().unwrap().creates;
        let mut req = tonic::Request::new(pb::CreateSessionRequest { session_id: id.clone(), ..session_request() });
        req.set_timeout(Duration::from_millis(100));
        let status = c.sessions.clone().create_session(req).await.expect_err("past its deadline");
        assert!(matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded), "{status:?}");
        // A start that reached the engine is in its sandbox's create by now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        if log.lock().unwrap().creates > creates {
            hurried = Some(id);
            break;
        }
        let none = get(id.clone()).await.expect_err("the deadline passed before the engine had the request");
        assert_eq!(none.code(), Code::NotFound, "attempt {attempt}: {none:?}");
    }
    let hurried = hurried.expect("in 5 attempts, no 100 ms deadline passed after the engine had the request");
    let until = Instant::now() + Duration::from_secs(30);
    let state = loop {
        match get(hurried.clone()).await {
            Ok(session) if session.get_ref().state != pb::SessionState::Starting as i32 => {
                break session.into_inner().state
            }
            _ if Instant::now() < until => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("the session never settled: {other:?}"),
        }
    };
    assert_eq!(state, pb::SessionState::Active as i32);
    let busy = c.sessions.clone().create_session(session_request()).await.expect_err("its slot is held");
    assert_eq!(busy.code(), Code::ResourceExhausted, "{busy:?}");
    let ended = c.sessions.clone().end_session(pb::EndSessionRequest { session_id: hurried }).await.unwrap();
    assert_eq!(ended.into_inner().state, pb::SessionState::Ended as i32);
    // Its admission slot came back exactly once.
    let req = pb::CreateSessionRequest { session_id: "after".into(), ..session_request() };
    let again = c.sessions.clone().create_session(req).await.expect("room again").into_inner();
    c.sessions.clone().end_session(pb::EndSessionRequest { session_id: again.session_id }).await.unwrap();
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);
    daemon.stop().await;
}

/// `cancel_on_disconnect` holds while the submit itself is under way: a
/// caller that goes away before its answer (here the store is held by
/// another writer, so the insert waits) has its execution cancelled once
/// it is stored, rather than run for nobody. (SQLite: the test holds its
/// write lock; this binary is not run again against PostgreSQL.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_disconnect_holds_while_the_submit_waits_on_the_store() {
    use sqlx::Connection;
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let db = format!("sqlite://{}", daemon.data.path().join("data/corral.db").display());
    let mut holder = sqlx::SqliteConnection::connect(&db).await.expect("the test daemon's SQLite store");
    // The write lock: the daemon's insert waits (its busy timeout is 10 s).
    sqlx::query("BEGIN IMMEDIATE").execute(&mut holder).await.unwrap();
    let mut client = daemon.executions().await;
    let mut req = request("test.fake-agent", "NOWORK\nHANG");
    req.request_id = "gone-while-submitted".into();
    let asked = pb::ExecuteRequest { cancel_on_disconnect: true, ..req.clone() };
    let mut caller = client.clone();
    let call = tokio::spawn(async move { caller.execute(asked).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!call.is_finished(), "the insert did not wait for the store: {:?}", call.await);
    call.abort();
    let _ = call.await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The same request id finds the execution the gone caller started.
    let id = common::once_admitted("the execution was not stored", || {
        let mut client = client.clone();
        let req = req.clone();
        async move { client.start_execution(req).await.map(|r| r.into_inner().execution_id) }
    })
    .await;
    let started = Instant::now();
    let state = loop {
        let get = pb::GetExecutionRequest { execution_id: id.clone(), ..Default::default() };
        let state = client.get_execution(get).await.unwrap().into_inner().state;
        if !matches!(pb::ExecutionState::try_from(state).unwrap(), pb::ExecutionState::Running) {
            break state;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = client.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await;
            break state;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(pb::ExecutionState::try_from(state).unwrap(), pb::ExecutionState::Cancelled, "it ran for nobody");
    let events = daemon.watch_all(&id, 0).await;
    assert_eq!(pb::ExecutionState::try_from(finished(&events).state).unwrap(), pb::ExecutionState::Cancelled);
    assert!(daemon.leftover_sandboxes().await.is_empty());
}

/// The store refuses a run's final write for longer than a few retries
/// (here a trigger, as a failover or a full disk would): the run keeps
/// trying and, once the store takes writes again, finishes. Before, it
/// gave up after five tries and stayed RUNNING until the next start,
/// holding its slot in the principal's quota and every watcher waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_write_the_store_refuses_for_a_while_is_stored_when_it_comes_back() {
    use sqlx::Connection;
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let db = format!("sqlite://{}", daemon.data.path().join("data/corral.db").display());
    let mut db = sqlx::SqliteConnection::connect(&db).await.expect("the test daemon's SQLite store");
    sqlx::query(
        "CREATE TRIGGER refuse_finish BEFORE UPDATE ON executions WHEN NEW.state <> 'running'
         BEGIN SELECT RAISE(ABORT, 'injected: the store refuses final writes'); END",
    )
    .execute(&mut db)
    .await
    .unwrap();
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request("builtin.shell", "echo done")).await.expect("accepted").into_inner();
    // The run is done and its final write refused for 3 s: past the
    // five retries (about 1.7 s) the daemon used to give.
    tokio::time::sleep(Duration::from_secs(3)).await;
    sqlx::query("DROP TRIGGER refuse_finish").execute(&mut db).await.unwrap();
    let mut events = Vec::new();
    let read = async {
        while let Some(event) = stream.message().await.expect("stream ok") {
            events.push(event);
        }
    };
    tokio::time::timeout(Duration::from_secs(15), read).await.expect("the finished event within 15 s");
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    let get = pb::GetExecutionRequest { execution_id: execution.execution_id.clone(), view: 0 };
    let stored = client.get_execution(get).await.expect("stored").into_inner();
    assert_eq!(stored.state, pb::ExecutionState::Succeeded as i32, "{stored:?}");
    daemon.stop().await;
}

/// A session watched in the moment between its row's store and its start
/// opening its events (stored, neither live nor ended) is followed through
/// the store until its `finished`, never ended at once with no `finished`
/// (the stream ended OK with nothing, and the caller took it for over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stored_but_not_yet_live_is_followed_until_it_finishes() {
    use corral::records::{Event, EventKind, SessionRecord, SessionState};
    let daemon = TestDaemon::start(Options::default()).await;
    let store = daemon.engine.store.clone();
    let consumer = corral::types::Consumer { principal: corral::auth::LOCAL_ADMIN.into(), ..Default::default() };
    let record =
        SessionRecord { session_id: "s-window".into(), state: SessionState::Active, consumer, ..Default::default() };
    assert!(store.insert_session(&record).await.unwrap());
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let req = pb::WatchSessionRequest { session_id: "s-window".into(), after_sequence: 0 };
    let mut stream = client.watch_session(req).await.expect("watch").into_inner();
    let early = tokio::time::timeout(Duration::from_millis(500), stream.message()).await;
    assert!(early.is_err(), "the watch ended before the session did: {early:?}");
    let ended = SessionRecord { state: SessionState::Ended, ended_at_ms: Some(1), ..record };
    let time_ms = corral::records::now_ms();
    let kind = EventKind::SessionFinished { session: Box::new(ended.clone()) };
    let finished = Event { subject_id: "s-window".into(), sequence: 1, time_ms, kind };
    store.finish_session(&ended, &[finished]).await.unwrap();
    let last = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("followed");
    let last = last.expect("stream ok").expect("its finished");
    assert!(matches!(last.kind, Some(Kind::Finished(_))), "{last:?}");
    assert!(stream.message().await.expect("stream ok").is_none(), "ends after finished");
    daemon.stop().await;
}

/// A turn whose `turn_finished` the store refuses (past its retries) ends
/// its session: the turn's stream ends, and the next turn is refused.
/// Before, the stream waited for an end that was never sent, the session
/// took the next turn (maybe another caller's), and that turn's events,
/// its raw output with them, went down the first turn's stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_end_is_not_stored_ends_its_session() {
    use sqlx::Connection;
    common::require_bwrap();
    let profile = common::session_agent_profile("test.session", "");
    let daemon = TestDaemon::start(Options { profiles: vec![("s.toml".into(), profile)], ..Options::default() }).await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.session".into(), ..Default::default() };
    let session = client.create_session(create).await.expect("created").into_inner();
    let db = format!("sqlite://{}", daemon.data.path().join("data/corral.db").display());
    let mut db = sqlx::SqliteConnection::connect(&db).await.expect("the test daemon's SQLite store");
    let refuse = "CREATE TRIGGER refuse_turn_ends BEFORE INSERT ON events WHEN NEW.kind = 'turn_finished' \
                  BEGIN SELECT RAISE(ABORT, 'injected: the store refuses turn ends'); END";
    sqlx::query(refuse).execute(&mut db).await.unwrap();
    let turn = |echo: &str| pb::SendTurnRequest {
        session_id: session.session_id.clone(),
        tool_call: Some(pb::ToolCall {
            tool: "echo".into(),
            arguments_json: serde_json::json!({ "echo": echo }).to_string(),
        }),
    };
    // A watcher of the session from its start.
    let watch = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: 0 };
    let mut watcher = client.watch_session(watch).await.expect("watched").into_inner();
    let mut first = client.send_turn(turn("first")).await.expect("the first turn").into_inner();
    let mut seen = Vec::new();
    let read = async {
        loop {
            match first.message().await {
                Ok(Some(event)) => seen.push(event),
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    };
    let ended = tokio::time::timeout(Duration::from_secs(30), read).await;
    let ended = ended.unwrap_or_else(|_| panic!("the turn's stream never ended: {:?}", kinds(&seen)));
    assert!(!seen.iter().any(|e| matches!(e.kind, Some(Kind::TurnFinished(_)))), "{:?}", kinds(&seen));
    // Not a clean end: the caller is told its turn's end was not stored.
    let cut = ended.unwrap_or_else(|| panic!("the turn's stream ended OK with no end: {:?}", kinds(&seen)));
    assert_eq!(
        (cut.code(), cut.get_details_error_info().map(|i| i.reason).unwrap_or_default().as_str()),
        (Code::Unavailable, "END_NOT_STORED"),
        "{cut:?}"
    );
    // The watcher is cut too, or gets the session's `finished`; resumed
    // after what it got, it gets that `finished`. Never an OK end without it.
    let mut last = 0;
    let mut finished = false;
    for _ in 0..2 {
        let read = async {
            loop {
                match watcher.message().await {
                    Ok(Some(event)) => {
                        last = event.sequence;
                        finished |= matches!(event.kind, Some(Kind::Finished(_)));
                    }
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        };
        match tokio::time::timeout(Duration::from_secs(30), read).await.expect("the watch ends") {
            None => {
                assert!(finished, "the watch ended OK with no `finished`");
                break;
            }
            Some(cut) => {
                assert_eq!(
                    cut.get_details_error_info().map(|i| i.reason).as_deref(),
                    Some("END_NOT_STORED"),
                    "{cut:?}"
                );
                let resume = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: last };
                watcher = client.watch_session(resume).await.expect("resumed").into_inner();
            }
        }
    }
    assert!(finished, "the session's `finished` reached its watcher");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let get = pb::GetSessionRequest { session_id: session.session_id.clone() };
        let record = client.get_session(get).await.expect("the session").into_inner();
        if record.state != pb::SessionState::Active as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "the session still takes turns: {record:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = client.send_turn(turn("second")).await.expect_err("the session ended");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    sqlx::query("DROP TRIGGER refuse_turn_ends").execute(&mut db).await.unwrap();
    daemon.stop().await;
}
