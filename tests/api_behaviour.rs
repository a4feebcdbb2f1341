//! The gRPC API's observable behaviour against a real daemon: watch
//! replay and resumption, idempotency on request ids, input validation at
//! the edge, listing and pagination, cancellation, client disconnects, and
//! the catalog's dry runs.

mod common;

use std::collections::HashSet;

use common::{evidence, finished, kinds, request, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;
use tonic::Code;
use tonic_types::StatusExt;

const FAKE: &str = "test.fake-agent";

fn progress_messages(events: &[pb::LifecycleEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Progress(p)) if p.kind() == pb::ProgressKind::Progress => Some(p.message.clone()),
            _ => None,
        })
        .collect()
}

fn sequences(events: &[pb::LifecycleEvent]) -> Vec<u64> {
    events.iter().map(|e| e.sequence).collect()
}

/// The caller's events with what only the direct caller may see removed.
fn without_raw_parts(events: &[pb::LifecycleEvent]) -> Vec<pb::LifecycleEvent> {
    let mut events = events.to_vec();
    for event in &mut events {
        match &mut event.kind {
            Some(Kind::Progress(p)) => p.message.clear(),
            Some(Kind::Finished(f)) => {
                let Some(pb::finished::Record::Execution(e)) = &mut f.record else { continue };
                e.tool_output.clear();
                e.tool_error.clear();
            }
            _ => {}
        }
    }
    events
}

async fn count(daemon: &TestDaemon) -> i64 {
    daemon.engine.store.count_executions().await.expect("count executions")
}

/// INVALID_ARGUMENT naming `field` in the message and in the
/// `google.rpc.BadRequest` details.
fn assert_invalid(status: &tonic::Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
    assert!(status.message().contains(field), "message should name `{field}`: {:?}", status.message());
    let bad = status.get_details_bad_request().unwrap_or_else(|| panic!("no BadRequest details: {status:?}"));
    assert!(!bad.field_violations.is_empty(), "no field violations: {bad:?}");
    assert_eq!(bad.field_violations[0].field, field, "{bad:?}");
}

/// A watcher following the run live gets the very events the caller's
/// stream carries (each encoded once for every stream), and never the
/// caller's raw parts riding on them: the progress messages stay the
/// caller's even though both streams share each event as it happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_watcher_shares_the_callers_events_but_not_their_raw_parts() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let mut caller = client.execute(request(FAKE, "PROGRESS 40\nPACE 40")).await.unwrap().into_inner();
    let first = caller.message().await.unwrap().expect("accepted");
    let Some(Kind::Accepted(accepted)) = first.kind.clone() else { panic!("first is accepted: {first:?}") };
    let watch = pb::WatchRequest { execution_id: accepted.execution_id.clone(), after_sequence: 0 };
    let mut watcher = client.watch_execution(watch).await.unwrap().into_inner();
    let (mut seen_by_caller, mut watched) = (vec![first], Vec::new());
    while let Some(event) = caller.message().await.unwrap() {
        seen_by_caller.push(event);
    }
    while let Some(event) = watcher.message().await.unwrap() {
        watched.push(event);
    }
    let messages = progress_messages(&seen_by_caller);
    assert_eq!(messages.len(), 40);
    assert!(messages.iter().all(|m| m.starts_with("step ")), "the caller sees its messages: {messages:?}");
    let watched_messages = progress_messages(&watched);
    assert_eq!(watched_messages.len(), 40, "{:?}", kinds(&watched));
    assert!(watched_messages.iter().all(|m| m.is_empty()), "the live watcher saw raw parts: {watched_messages:?}");
    assert_eq!(without_raw_parts(&seen_by_caller), watched, "the same events, raw parts aside");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_from_zero_replays_the_callers_events_without_raw_parts() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let caller = daemon.execute(request(FAKE, "PROGRESS 3")).await;
    let record = finished(&caller);
    assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    assert!(!record.tool_output.is_empty(), "the direct caller sees the raw output");
    assert_eq!(progress_messages(&caller), vec!["step 1", "step 2", "step 3"], "{:?}", kinds(&caller));

    let watched = daemon.watch_all(&record.execution_id, 0).await;
    let watched_messages = progress_messages(&watched);
    assert_eq!(watched_messages.len(), 3);
    assert!(
        watched_messages.iter().all(|m| m.is_empty()),
        "watchers never see progress messages: {watched_messages:?}"
    );
    let watched_record = finished(&watched);
    assert!(watched_record.tool_output.is_empty(), "watcher got raw output: {:?}", watched_record.tool_output);
    assert!(watched_record.tool_error.is_empty(), "watcher got raw error: {:?}", watched_record.tool_error);

    assert_eq!(without_raw_parts(&caller), watched, "replay differs from what the caller saw");

    // The replayed record came from the execution's row: `finished` is
    // stored as a stub, not as a second copy of the record (issue 16).
    let stored = daemon.engine.store.stored_event_sizes(&record.execution_id).await.expect("stored events");
    let (sequence, kind, bytes) = stored.last().cloned().expect("events stored");
    assert_eq!((sequence, kind.as_str()), (watched.last().unwrap().sequence, "finished"));
    assert!(bytes < 64, "finished stored in {bytes} bytes: it repeats the record");
    daemon.stop().await;
}

/// A watch replays a finished execution a page (1,024 events) at a time:
/// across page boundaries, from the start and from the middle, nothing is
/// missed or repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_replay_comes_page_by_page_without_gap_or_duplicate() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let caller = daemon.execute(request(FAKE, "PROGRESS 2500")).await;
    let record = finished(&caller);
    assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    let n = caller.last().unwrap().sequence;
    assert!(n > 2500, "{n} events");
    for after in [0, 1023, 1200, n - 1] {
        let watched = daemon.watch_all(&record.execution_id, after).await;
        assert_eq!(sequences(&watched), (after + 1..=n).collect::<Vec<_>>(), "watch after {after}");
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_after_any_sequence_resumes_without_gap_or_duplicate() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let caller = daemon.execute(request(FAKE, "PROGRESS 3")).await;
    let id = finished(&caller).execution_id;
    let n = caller.len() as u64;
    assert_eq!(sequences(&caller), (1..=n).collect::<Vec<_>>(), "the caller's own stream has a gap");
    assert!(n >= 8, "expected a full lifecycle with progress: {:?}", kinds(&caller));
    for k in 0..=n {
        let watched = daemon.watch_all(&id, k).await;
        assert_eq!(sequences(&watched), (k + 1..=n).collect::<Vec<_>>(), "after_sequence = {k}");
        assert!(watched.iter().all(|e| e.subject_id == id), "after_sequence = {k}: foreign subject");
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_id_makes_execute_idempotent() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut req = request(FAKE, "NOWORK");
    req.request_id = "req-idem-1".into();

    let first = finished(&daemon.execute(req.clone()).await);
    assert_eq!(first.state, pb::ExecutionState::Succeeded as i32);
    assert_eq!(first.request_id, "req-idem-1");
    assert_eq!(count(&daemon).await, 1);

    let second = daemon.execute(req.clone()).await;
    let second_record = finished(&second);
    assert_eq!(second_record.execution_id, first.execution_id);
    assert_eq!(second_record.state, pb::ExecutionState::Succeeded as i32);
    assert_eq!(count(&daemon).await, 1, "a repeated request created a second execution");

    let mut client = daemon.executions().await;
    let started = client.start_execution(req.clone()).await.expect("start with the same request id").into_inner();
    assert_eq!(started.execution_id, first.execution_id);
    assert_eq!(count(&daemon).await, 1);

    let mut different = req.clone();
    different.description = "PROGRESS 2".into();
    let status = client.start_execution(different.clone()).await.expect_err("a different request with the same id");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    let Err(status) = client.execute(different).await else { panic!("Execute with a reused request id is refused") };
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    assert_eq!(count(&daemon).await, 1);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_input_is_refused_naming_the_field_and_changes_nothing() {
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let not_a_repo = tempfile::tempdir().unwrap();

    let mut cases: Vec<(&str, pb::ExecuteRequest)> = Vec::new();
    cases.push(("harness_profile_ref", request("", "NOWORK")));
    let mut long_title = request(FAKE, "NOWORK");
    long_title.title = "t".repeat(1 << 20);
    cases.push(("title", long_title));
    for repo in ["relative/path".to_string(), "/tmp/../etc".to_string(), not_a_repo.path().display().to_string()] {
        let mut req = request(FAKE, "NOWORK");
        req.repo = repo;
        cases.push(("repo", req));
    }

    for (field, req) in cases {
        let before = count(&daemon).await;
        let status = client.start_execution(req.clone()).await.expect_err("StartExecution must refuse");
        assert_invalid(&status, field);
        let Err(status) = client.execute(req).await else { panic!("Execute must refuse") };
        assert_invalid(&status, field);
        assert_eq!(count(&daemon).await, before, "{field}: a refused request changed the store");
    }

    let before = count(&daemon).await;
    let status = client
        .list_executions(pb::ListExecutionsRequest { state: 99, ..Default::default() })
        .await
        .expect_err("unknown state");
    assert_invalid(&status, "state");
    assert_eq!(count(&daemon).await, before);
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_list_executions_filter_and_paginate() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;

    let status = client
        .get_execution(pb::GetExecutionRequest {
            execution_id: "00000000-0000-7000-8000-000000000000".into(),
            ..Default::default()
        })
        .await
        .expect_err("unknown id");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");

    // Oldest first.
    let mut created = Vec::new();
    for project in ["proj-a", "proj-a", "proj-b"] {
        let mut req = request(FAKE, "NOWORK");
        req.project = project.into();
        let record = finished(&daemon.execute(req).await);
        assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
        created.push(record.execution_id);
    }
    let mut refused_req = request("no.such.profile", "NOWORK");
    refused_req.project = "proj-c".into();
    let refused = finished(&daemon.execute(refused_req).await);
    assert_eq!(refused.state, pb::ExecutionState::Refused as i32, "{refused:?}");
    created.push(refused.execution_id.clone());
    let newest_first: Vec<String> = created.iter().rev().cloned().collect();

    let got = client
        .get_execution(pb::GetExecutionRequest { execution_id: created[0].clone(), ..Default::default() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.execution_id, created[0]);
    assert_eq!(got.state, pb::ExecutionState::Succeeded as i32);
    assert!(got.tool_output.is_empty() && got.tool_error.is_empty(), "GetExecution leaks raw parts");

    let list = |req: pb::ListExecutionsRequest| {
        let mut client = client.clone();
        async move { client.list_executions(req).await.expect("list").into_inner() }
    };

    let all = list(pb::ListExecutionsRequest::default()).await;
    assert_eq!(all.executions.iter().map(|e| e.execution_id.clone()).collect::<Vec<_>>(), newest_first);
    assert!(all.next_page_token.is_empty());

    let a = list(pb::ListExecutionsRequest { project: "proj-a".into(), ..Default::default() }).await;
    assert_eq!(a.executions.len(), 2, "{a:?}");
    assert!(a.executions.iter().all(|e| e.consumer.as_ref().unwrap().project == "proj-a"));
    let b = list(pb::ListExecutionsRequest { project: "proj-b".into(), ..Default::default() }).await;
    assert_eq!(b.executions.iter().map(|e| e.execution_id.clone()).collect::<Vec<_>>(), vec![created[2].clone()]);
    let none = list(pb::ListExecutionsRequest { project: "proj-none".into(), ..Default::default() }).await;
    assert!(none.executions.is_empty());

    let mut paged = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let page =
            list(pb::ListExecutionsRequest { page_size: 1, page_token: token.clone(), ..Default::default() }).await;
        assert!(page.executions.len() <= 1, "page_size 1 returned {}", page.executions.len());
        paged.extend(page.executions.into_iter().map(|e| e.execution_id));
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert!(token.is_empty(), "pagination did not end");
    assert_eq!(paged, newest_first, "pages are not newest first without gaps");
    assert_eq!(paged.iter().collect::<HashSet<_>>().len(), paged.len(), "duplicate across pages");

    let succeeded =
        list(pb::ListExecutionsRequest { state: pb::ExecutionState::Succeeded as i32, ..Default::default() }).await;
    assert_eq!(
        succeeded.executions.iter().map(|e| e.execution_id.clone()).collect::<Vec<_>>(),
        newest_first[1..].to_vec()
    );
    let refused_list =
        list(pb::ListExecutionsRequest { state: pb::ExecutionState::Refused as i32, ..Default::default() }).await;
    assert_eq!(
        refused_list.executions.iter().map(|e| e.execution_id.clone()).collect::<Vec<_>>(),
        vec![refused.execution_id]
    );
    let cancelled =
        list(pb::ListExecutionsRequest { state: pb::ExecutionState::Cancelled as i32, ..Default::default() }).await;
    assert!(cancelled.executions.is_empty());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_hanging_harness_and_tears_everything_down() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut client = daemon.executions().await;
    let started = client.start_execution(request(FAKE, "HANG")).await.expect("start").into_inner();
    assert_eq!(started.state, pb::ExecutionState::Running as i32);
    let id = started.execution_id.clone();

    let mut watch = client
        .watch_execution(pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 })
        .await
        .expect("watch")
        .into_inner();
    let mut events = Vec::new();
    loop {
        let event = watch.message().await.expect("watch ok").expect("stream ended before dispatch");
        let dispatched = matches!(event.kind, Some(Kind::Dispatched(_)));
        assert!(!matches!(event.kind, Some(Kind::Finished(_))), "finished before dispatch: {event:?}");
        events.push(event);
        if dispatched {
            break;
        }
    }

    client.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.expect("cancel");
    while let Some(event) = watch.message().await.expect("watch ok") {
        events.push(event);
    }
    let record = finished(&events);
    assert_eq!(record.state, pb::ExecutionState::Cancelled as i32, "{record:?}");
    let ev = evidence(&record);
    assert_eq!(ev.outcome, pb::Outcome::Cancelled as i32, "{ev:?}");
    assert_eq!(ev.session_cleanup, pb::TeardownResult::Succeeded as i32, "{ev:?}");
    assert_eq!(ev.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{ev:?}");
    let teardown = events.iter().find_map(|e| match &e.kind {
        Some(Kind::Teardown(t)) => Some(t.clone()),
        _ => None,
    });
    let teardown = teardown.expect("a teardown event");
    assert_eq!(teardown.session_cleanup, pb::TeardownResult::Succeeded as i32);
    assert_eq!(teardown.sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    assert_eq!(sequences(&events), (1..=events.len() as u64).collect::<Vec<_>>());
    assert!(daemon.leftover_sandboxes().await.is_empty(), "left behind: {:?}", daemon.leftover_sandboxes().await);

    let again = client.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.expect("again");
    let again = again.into_inner();
    assert_eq!(again.state, pb::ExecutionState::Cancelled as i32, "{again:?}");
    assert_eq!(evidence(&again).outcome, pb::Outcome::Cancelled as i32);
    let stored = client
        .get_execution(pb::GetExecutionRequest { execution_id: id, ..Default::default() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(again, stored, "cancelling a finished execution changed it");

    let status = client
        .cancel_execution(pb::CancelExecutionRequest { execution_id: "no-such-execution".into() })
        .await
        .expect_err("unknown id");
    assert_eq!(status.code(), Code::NotFound);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_does_not_cancel_the_execution() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let id = {
        let mut client = daemon.executions().await;
        let mut stream = client.execute(request(FAKE, "PROGRESS 2")).await.expect("execute").into_inner();
        let first = stream.message().await.expect("stream ok").expect("a first event");
        match first.kind {
            Some(Kind::Accepted(a)) => a.execution_id,
            other => panic!("first event is not accepted: {other:?}"),
        }
        // The stream and its client are dropped here.
    };
    let watched = daemon.watch_all(&id, 0).await;
    let record = finished(&watched);
    assert_eq!(record.state, pb::ExecutionState::Succeeded as i32, "{record:?}");
    assert_eq!(evidence(&record).outcome, pb::Outcome::Succeeded as i32);
    assert_eq!(progress_messages(&watched).len(), 2, "{:?}", kinds(&watched));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_lists_resolves_and_dry_runs_the_gate() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let mut catalog = daemon.catalog().await;

    let profiles = catalog.list_profiles(pb::ListProfilesRequest {}).await.expect("list").into_inner();
    let refs: HashSet<String> = profiles.profiles.iter().map(|p| p.r#ref.clone()).collect();
    for expected in [
        "builtin.shell@1.0.0",
        "builtin.noop@1.0.0",
        "builtin.claude-code@1.0.0",
        "builtin.codex@1.0.0",
        "test.fake-agent@1.0.0",
    ] {
        assert!(refs.contains(expected), "{expected} missing from {refs:?}");
    }

    let resolved = catalog
        .resolve_profile(pb::ResolveProfileRequest { profile_ref: FAKE.into(), actor: String::new() })
        .await
        .expect("resolve")
        .into_inner();
    assert_eq!(resolved.pinned_ref, "test.fake-agent@1.0.0");
    assert_eq!(resolved.profile.expect("profile").r#ref, "test.fake-agent@1.0.0");

    let status = catalog
        .resolve_profile(pb::ResolveProfileRequest { profile_ref: "nope".into(), actor: String::new() })
        .await
        .expect_err("unknown profile");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("unknown harness profile"), "{:?}", status.message());

    // The local administrator dry-runs as an agent the way it would run as
    // one: through the actor header, as Execute admits it.
    let gate = catalog
        .evaluate_gate(common::as_actor(
            "agt",
            pb::EvaluateGateRequest {
                profile_ref: FAKE.into(),
                actor: "agt".into(),
                project: "proj-a".into(),
                repo: String::new(),
                policies: vec![],
            },
        ))
        .await
        .expect("evaluate gate")
        .into_inner();
    assert_eq!(gate.action, pb::GateAction::Allow as i32, "{gate:?}");
    let sandbox = gate.effective_sandbox.expect("effective sandbox");
    assert_eq!(sandbox.r#type, pb::SandboxType::LinuxBwrap as i32, "{sandbox:?}");
    assert!(!sandbox.allow_network, "{sandbox:?}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverified_profile_says_when_it_last_succeeded_end_to_end() {
    common::require_bwrap();
    let unverified = "[readiness]\nstate = \"unverified\"\nreason = \"new agent\"\n";
    let mut options = Options::default();
    options.profiles.push(("unverified.toml".into(), common::fake_agent_profile("test.unverified", unverified)));
    let daemon = TestDaemon::start(options).await;
    let mut catalog = daemon.catalog().await;
    let reason = |profile: pb::Profile| profile.readiness.expect("readiness").reason;
    let get = pb::GetProfileRequest { profile_ref: "test.unverified".into() };

    let before = reason(catalog.get_profile(get.clone()).await.expect("get").into_inner());
    assert_eq!(before, "new agent; no end-to-end success on this daemon yet");
    // A failure is not a success; a ready profile says nothing of the kind.
    daemon.execute(request("test.unverified", "FAIL boom")).await;
    assert_eq!(reason(catalog.get_profile(get.clone()).await.expect("get").into_inner()), before);
    let ready =
        reason(catalog.get_profile(pb::GetProfileRequest { profile_ref: FAKE.into() }).await.unwrap().into_inner());
    assert!(!ready.contains("end-to-end"), "{ready}");

    let events = daemon.execute(request("test.unverified", "PROGRESS 1")).await;
    let finished = events.iter().rev().find_map(|e| match &e.kind {
        Some(Kind::Finished(f)) => match &f.record {
            Some(pb::finished::Record::Execution(e)) => Some(e.clone()),
            _ => None,
        },
        _ => None,
    });
    let finished = finished.expect("finished");
    assert_eq!(finished.state, pb::ExecutionState::Succeeded as i32);
    let when = convert_time(finished.finished_at.expect("finished_at"));
    let listed = catalog.list_profiles(pb::ListProfilesRequest {}).await.expect("list").into_inner();
    let after = listed.profiles.into_iter().find(|p| p.r#ref == "test.unverified@1.0.0").map(reason).unwrap();
    assert_eq!(after, format!("new agent; last end-to-end success on this daemon: {when}"));
}

/// A protobuf timestamp as the catalog writes it: RFC 3339, UTC, to the ms.
fn convert_time(ts: prost_types::Timestamp) -> String {
    let ms = ts.seconds * 1000 + i64::from(ts.nanos) / 1_000_000;
    let secs = ms.div_euclid(1000);
    let out = std::process::Command::new("date")
        .args(["-u", "-d", &format!("@{secs}"), "+%Y-%m-%dT%H:%M:%S"])
        .output()
        .unwrap();
    format!("{}.{:03}Z", String::from_utf8_lossy(&out.stdout).trim(), ms.rem_euclid(1000))
}

/// A policy whose `on` names a phase its kind never applies at would be
/// accepted and never applied: CreateSession and EvaluateGate refuse it,
/// naming `policies[0]`, and nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_selected_for_a_phase_its_kind_never_applies_at_is_invalid_argument() {
    use pb::PolicyKind::{DenyNetwork, EgressAllowlist, EnforceSandbox, MaxTimeout, MaxToolCalls, RequireApproval};
    let daemon = TestDaemon::start(Options::default()).await;
    let mut sessions = pb::session_service_client::SessionServiceClient::new(daemon.channel().await);
    let mut catalog = daemon.catalog().await;
    let stored = || async { daemon.engine.store.list_sessions("", 1000, None).await.expect("list sessions").len() };
    let cases = [
        (DenyNetwork, "{}", "tool_call:Bash"),
        (EnforceSandbox, r#"{"allow_network": false}"#, "tool_call"),
        (EgressAllowlist, r#"{"hosts": ["example.com"]}"#, "tool_call:run_task"),
        (MaxTimeout, r#"{"seconds": 5}"#, "tool_call"),
        (MaxToolCalls, r#"{"limit": 1}"#, "agent_start"),
        (RequireApproval, r#"{"timeout_seconds": 2}"#, "agent_start"),
    ];
    for (kind, arguments_json, on) in cases {
        let policy = pb::PolicySpec {
            name: "p".into(),
            kind: kind as i32,
            arguments_json: arguments_json.into(),
            on: vec![on.into()],
        };
        let before = stored().await;
        let create = pb::CreateSessionRequest {
            profile_ref: FAKE.into(),
            project: "proj-a".into(),
            policies: vec![policy.clone()],
            ..Default::default()
        };
        let status = sessions.create_session(create).await.expect_err("a policy that would never apply");
        assert_invalid(&status, "policies[0]");
        assert!(status.message().contains("it would never apply"), "{kind:?} on {on}: {:?}", status.message());
        assert_eq!(stored().await, before, "{kind:?} on {on}: a refused session was stored");
        let gate = pb::EvaluateGateRequest {
            profile_ref: FAKE.into(),
            actor: String::new(),
            project: "proj-a".into(),
            repo: String::new(),
            policies: vec![policy],
        };
        let status = catalog.evaluate_gate(gate).await.expect_err("a policy that would never apply");
        assert_invalid(&status, "policies[0]");
    }
    daemon.stop().await;
}

/// An error's `google.rpc.ErrorInfo`: its code, reason and metadata.
fn assert_reason(status: &tonic::Status, code: Code, reason: &str) -> std::collections::HashMap<String, String> {
    assert_eq!(status.code(), code, "{status:?}");
    let info = status.get_details_error_info().unwrap_or_else(|| panic!("no ErrorInfo: {status:?}"));
    assert_eq!(info.reason, reason, "{info:?}");
    assert_eq!(info.domain, "corral.dev", "{info:?}");
    info.metadata
}

/// Every error carries `google.rpc.ErrorInfo`: a decision for a tool call
/// that no one waits for and a drain of a node that does not exist are
/// NOT_FOUND with a stable reason naming what was not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_tool_call_and_drain_node_errors_carry_error_info() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let execution = finished(&daemon.execute(request(FAKE, "NOWORK")).await);
    let decide = pb::DecideToolCallRequest {
        execution_id: execution.execution_id.clone(),
        call_id: "call-987".into(),
        decision: pb::ToolCallDecision::Allow as i32,
        reason: String::new(),
    };
    let status = daemon.executions().await.decide_tool_call(decide).await.expect_err("no call waits");
    let metadata = assert_reason(&status, Code::NotFound, "NOT_FOUND");
    assert_eq!(metadata.get("call_id").map(String::as_str), Some("call-987"), "{metadata:?}");

    let mut catalog = daemon.catalog().await;
    let status =
        catalog.drain_node(pb::DrainNodeRequest { name: "no-such-node".into() }).await.expect_err("no such node");
    let metadata = assert_reason(&status, Code::NotFound, "NOT_FOUND");
    assert_eq!(metadata.get("name").map(String::as_str), Some("no-such-node"), "{metadata:?}");
    for bad in ["n".repeat(201), "node\nforged: line".to_string()] {
        let status = catalog.drain_node(pb::DrainNodeRequest { name: bad.clone() }).await.expect_err("a bad name");
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}: {status:?}");
        assert!(status.message().contains("name"), "{status:?}");
    }
    daemon.stop().await;
}

/// A store error's own words (paths, SQL, the pool's state) are logged,
/// never sent: the catalog's node and profile listings answer with the
/// one store error every other RPC gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_store_errors_are_not_sent_to_the_caller() {
    let mut options = Options::default();
    let unverified = "[readiness]\nstate = \"unverified\"\nreason = \"new agent\"\n";
    options.profiles.push(("unverified.toml".into(), common::fake_agent_profile("test.unverified", unverified)));
    let daemon = TestDaemon::start(options).await;
    let mut catalog = daemon.catalog().await;
    daemon.engine.store.close().await;
    let statuses = [
        catalog.list_nodes(pb::ListNodesRequest::default()).await.expect_err("the store is closed"),
        catalog.drain_node(pb::DrainNodeRequest { name: "n1".into() }).await.expect_err("the store is closed"),
        catalog.list_profiles(pb::ListProfilesRequest {}).await.expect_err("the store is closed"),
    ];
    for status in statuses {
        assert_reason(&status, Code::Internal, "STORE");
        assert_eq!(status.message(), "internal store error", "{status:?}");
    }
    daemon.stop().await;
}

/// A finished execution leaves no task of the daemon's behind: the daemon's
/// live tasks after 40 more runs are as many as before them (a task per
/// run, kept until the shutdown, would grow without bound on a daemon that
/// runs for weeks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_executions_leave_no_task_behind() {
    common::require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let alive = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
    let settled = || async {
        daemon.engine.reclaimed().await;
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    };
    for _ in 0..5 {
        finished(&daemon.execute(request(FAKE, "NOWORK")).await);
    }
    settled().await;
    let before = alive();
    for _ in 0..40 {
        let execution = finished(&daemon.execute(request(FAKE, "NOWORK")).await);
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    }
    settled().await;
    let after = alive();
    assert!(after < before + 10, "{before} live tasks before 40 runs, {after} after");
    daemon.stop().await;
}

/// A harness may print any byte: a NUL in its output reaches the caller
/// and the store as U+FFFD, and the run finishes (on PostgreSQL, whose text
/// columns refuse NUL, its final write failed and the run stayed RUNNING).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_harness_output_is_stored_on_postgresql() {
    common::require_bwrap();
    let url = common::create_postgres_database(&common::postgres_admin_url()).await;
    let daemon = TestDaemon::start(Options { store_url: Some(url), ..Options::default() }).await;
    let execution = finished(&daemon.execute(request("builtin.shell", r"printf 'a\000b\n'")).await);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert_eq!(execution.tool_output, "a\u{FFFD}b\n");
    let full =
        pb::GetExecutionRequest { execution_id: execution.execution_id.clone(), view: pb::ExecutionView::Full as i32 };
    let stored = daemon.executions().await.get_execution(full).await.expect("stored").into_inner();
    assert_eq!(
        (stored.tool_output.as_str(), stored.tool_error.as_str()),
        (execution.tool_output.as_str(), execution.tool_error.as_str())
    );
    daemon.stop().await;
}
