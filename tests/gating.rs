//! A policy is never silently ignored: a harness whose own tool calls
//! cannot pass the tool_call gate, under a policy that governs tool calls,
//! is refused at agent_start with the reason — before any sandbox exists.

mod common;

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;
use corral::policy::PolicySpec;
use serde_json::json;

fn no_bash() -> PolicySpec {
    PolicySpec {
        name: "no-bash".into(),
        kind: "expr".into(),
        arguments: json!({"expression": "false", "reason": "Bash is not allowed here"}),
        on: vec!["tool_call:Bash".into()],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_harness_under_a_tool_call_policy_is_refused_and_a_protocol_harness_runs() {
    require_bwrap();
    let daemon =
        TestDaemon::start(Options { config: Box::new(|c| c.policies.push(no_bash())), ..Options::default() }).await;
    let mut catalog = daemon.catalog().await;

    // What the catalog says of each.
    let shell = catalog
        .resolve_profile(pb::ResolveProfileRequest { profile_ref: "builtin.shell".into(), actor: String::new() })
        .await
        .unwrap()
        .into_inner();
    let rein = shell.profile.unwrap().rein.unwrap();
    assert!(!rein.tool_calls_gated);
    assert!(rein.tool_calls_ungated.contains("input = \"description\""), "{}", rein.tool_calls_ungated);
    let fake = catalog
        .resolve_profile(pb::ResolveProfileRequest { profile_ref: "test.fake-agent".into(), actor: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert!(fake.profile.unwrap().rein.unwrap().tool_calls_gated, "a task_json protocol harness asks the gate");

    // The dry run and the real run agree: refused, naming the policy.
    let dry = catalog
        .evaluate_gate(pb::EvaluateGateRequest {
            profile_ref: "builtin.shell".into(),
            actor: "adm".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dry.action, pb::GateAction::Deny as i32);
    let events = daemon.execute(request("builtin.shell", "touch /tmp/ran-anyway")).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Gate as i32);
    let refusal = evidence.gate_decisions.iter().find(|d| d.policy == "tool_call_gating").expect("the refusal");
    assert!(
        refusal.reason.contains("policy no-bash governs tool calls") && refusal.reason.contains("would be ignored")
    );
    assert!(evidence.sandbox_id.is_empty(), "a sandbox was made");
    assert!(!common::kinds(&events).contains(&"sandbox_ready"));

    // Control: a harness that asks the gate runs under the same policy.
    let events = daemon.execute(request("test.fake-agent", "NOWORK")).await;
    assert_eq!(finished(&events).state, pb::ExecutionState::Succeeded as i32);
    daemon.stop().await;
}

/// `EvaluateGate` reads an empty actor as the caller's own type, like
/// every other RPC: an `agt` sending policies is told they need `adm`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluate_gate_takes_an_empty_actor_as_the_callers_type() {
    let daemon = TestDaemon::start(Options::default()).await;
    let mut catalog = daemon.catalog().await;
    let dry = |policies: Vec<pb::PolicySpec>| pb::EvaluateGateRequest {
        profile_ref: "test.fake-agent".into(),
        project: "proj-a".into(),
        policies,
        ..Default::default()
    };
    let as_adm = catalog.evaluate_gate(dry(vec![])).await.expect("the local admin, empty actor").into_inner();
    assert_eq!(as_adm.action, pb::GateAction::Allow as i32);
    let policy = pb::PolicySpec {
        name: "p".into(),
        kind: pb::PolicyKind::DenyNetwork as i32,
        arguments_json: String::new(),
        on: vec![],
    };
    let status = catalog.evaluate_gate(common::as_actor("agt", dry(vec![policy]))).await.expect_err("agt policies");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    daemon.stop().await;
}

/// A session needs a harness that takes turns: one that reads its whole
/// task at once and cannot resume (the shell runner, the no-op) is refused
/// at resolution, before any sandbox exists, instead of failing every turn
/// after the first. (Claude Code and Codex resume: `real_agents`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_of_a_harness_that_cannot_take_turns_is_refused() {
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), "model-key-value").unwrap();
    let file = key.path().to_path_buf();
    let daemon = TestDaemon::start(Options {
        config: Box::new(move |c| {
            for (route, var) in [("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY")] {
                let route_config = corral::credentials::RouteConfig {
                    env: None,
                    file: Some(file.clone()),
                    inject_as: var.into(),
                    ..Default::default()
                };
                c.credentials.routes.insert(route.into(), route_config);
            }
        }),
        ..Options::default()
    })
    .await;
    let mut sessions = pb::session_service_client::SessionServiceClient::new(daemon.channel().await);
    for profile in ["builtin.shell", "builtin.noop"] {
        let request =
            pb::CreateSessionRequest { profile_ref: profile.into(), project: "proj-a".into(), ..Default::default() };
        let status = sessions.create_session(request).await.expect_err(profile);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{profile}: {status:?}");
        assert!(status.message().contains("cannot take turns"), "{profile}: {}", status.message());
    }
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}

/// A credential the profile needs but the daemon cannot read refuses the
/// run at resolution, naming the route and not any value, before any
/// sandbox exists; `corral doctor` says the same of the profile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_credential_refuses_the_run_before_a_sandbox_and_doctor_says_so() {
    let daemon = TestDaemon::start(Options {
        config: Box::new(|c| {
            c.credentials.routes.insert(
                "route.test".into(),
                corral::credentials::RouteConfig {
                    env: Some("CORRAL_TEST_NEVER_SET_7781".into()),
                    inject_as: "ROUTE_TEST_TOKEN".into(),
                    ..Default::default()
                },
            );
        }),
        ..Options::default()
    })
    .await;
    let execution = common::finished(&daemon.execute(common::request("test.fake-agent", "NOWORK")).await);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32);
    assert!(
        evidence.error.contains("route.test") && evidence.error.contains("CORRAL_TEST_NEVER_SET_7781"),
        "{}",
        evidence.error
    );
    assert!(evidence.sandbox_id.is_empty(), "a sandbox was made");
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), common::fake_agent_profile("test.fake-agent", "")).unwrap();
    let config = dir.path().join("corral.toml");
    std::fs::write(
        &config,
        "[credentials.routes.\"route.test\"]\nenv = \"CORRAL_TEST_NEVER_SET_7781\"\ninject_as = \"ROUTE_TEST_TOKEN\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(["doctor", "--config"])
        .arg(&config)
        .arg("--profiles")
        .arg(&profiles)
        .env_remove("CORRAL_TEST_NEVER_SET_7781")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line =
        text.lines().find(|l| l.trim_start().starts_with("test.fake-agent@")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("NO") && line.contains("$CORRAL_TEST_NEVER_SET_7781 is not set"), "{line}");
}

/// A Claude Code or Codex profile with `paths` (TOML lines of its
/// `[sandbox]`) and an admin `tool_call:Bash` deny.
fn agent_profile(id: &str, preset: &str, paths: &str) -> String {
    format!(
        "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\npreset = \"{preset}\"\ninput = \"prompt\"\nargv = [\"/bin/true\"]\n\
         [sandbox]\ntype = \"linux_bwrap\"\n{paths}\n"
    )
}

/// Why the daemon would not start with `profiles`; panics when it starts.
async fn load_error(profiles: &[(&str, String)]) -> String {
    let data = common::data_tempdir();
    let dir = data.path().join("profiles");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in profiles {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let config = corral::config::Config {
        data_dir: data.path().join("data"),
        profile_dirs: vec![dir],
        shutdown_grace_seconds: 5,
        policies: vec![no_bash()],
        ..corral::config::Config::default()
    };
    let built = corral::daemon::Daemon::build(
        config,
        corral::sandbox::Backends::host_default(),
        corral::daemon::default_reins(),
    )
    .await;
    match built {
        Ok(_) => panic!("the daemon started with {profiles:?}"),
        Err(e) => e.to_string(),
    }
}

/// The managed hook that carries Claude Code's and Codex's tool calls to
/// the gate is bound at a fixed path under /etc; a read or write path over
/// it (or in its directory) would hide it or let the agent change it, and
/// the run would count as gated with no hook at all: an admin
/// `tool_call:Bash` deny accepted and ignored. Such a profile does not
/// load, naming the key and the hook; a path beside the hook does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_or_write_path_over_the_managed_hook_refuses_the_profile() {
    let cases = [
        ("claude_stream_json", "read_paths = [\"/opt\", \"/etc\"]", "sandbox.read_paths[1]", "/etc/claude-code"),
        ("claude_stream_json", "read_paths = [\"/\"]", "sandbox.read_paths[0]", "/etc/claude-code"),
        ("claude_stream_json", "read_paths = [\"/etc/claude-code/\"]", "sandbox.read_paths[0]", "/etc/claude-code"),
        ("claude_stream_json", "read_paths = [\"/etc//./claude-code\"]", "sandbox.read_paths[0]", "/etc/claude-code"),
        ("codex_exec_json", "write_paths = [\".\", \"/etc/codex\"]", "sandbox.write_paths[1]", "/etc/codex"),
        (
            "codex_exec_json",
            "write_paths = [\"/etc/codex/managed_config.toml\"]",
            "sandbox.write_paths[0]",
            "/etc/codex",
        ),
        ("codex_exec_json", "read_paths = [\"/etc/corral\"]", "sandbox.read_paths[0]", "/etc/corral"),
    ];
    for (preset, paths, key, dir) in cases {
        let error = load_error(&[("agent.toml", agent_profile("test.hidden-hook", preset, paths))]).await;
        assert!(error.contains("agent.toml") && error.contains(key), "{preset} {paths}: {error}");
        assert!(error.contains(dir) && error.contains("managed hook"), "{preset} {paths}: says why: {error}");
    }

    // Control: paths beside the hook load, and the profile is gated.
    let beside = "read_paths = [\"/etc/ssl/certs\", \"/etc/claude-codex\"]\nwrite_paths = [\".\", \"etc/codex\"]";
    let daemon = TestDaemon::start(Options {
        profiles: vec![("agent.toml".into(), agent_profile("test.beside-hook", "claude_stream_json", beside))],
        ..Options::default()
    })
    .await;
    let resolved = daemon
        .catalog()
        .await
        .resolve_profile(pb::ResolveProfileRequest { profile_ref: "test.beside-hook".into(), actor: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert!(resolved.profile.unwrap().rein.unwrap().tool_calls_gated);
    daemon.stop().await;
}
