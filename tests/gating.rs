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

/// A profile cannot show its sandbox the host's private keys: a read or
/// write path that is /etc/ssl/private, lies under it or holds it is
/// refused at load, naming the key (DESIGN: "never /etc/ssl/private").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_binding_the_hosts_private_keys_does_not_load() {
    for (key, path) in [("read_paths", "/etc/ssl"), ("read_paths", "/etc"), ("write_paths", "/etc/ssl/private")] {
        let first = if key == "read_paths" { "/opt" } else { "." };
        let profile = format!(
            "id = \"test.keys\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\ninput = \"nothing\"\n\
             [sandbox]\n{key} = [{first:?}, {path:?}]\n"
        );
        let error = load_error(&[("keys.toml", profile)]).await;
        assert!(error.contains(&format!("sandbox.{key}[1]")) && error.contains("private keys"), "{path}: {error}");
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

/// A `none` profile running the shell with the task description as its
/// script: the host network and the whole workspace, nothing isolated.
fn none_shell_profile(id: &str, extra: &str) -> String {
    format!(
        "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
         [sandbox]\ntype = \"none\"\nallow_network = true\nwrite_paths = [\".\"]\n[limits]\ntimeout_seconds = 30\n{extra}"
    )
}

/// Asserts the run was refused at the gate by `host_enforceability` with a
/// reason containing each of `says`, before any sandbox existed.
fn assert_refused_unenforceable(events: &[pb::LifecycleEvent], says: &[&str]) {
    let execution = finished(events);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Gate as i32, "{evidence:?}");
    let refusal =
        evidence.gate_decisions.iter().find(|d| d.policy == "host_enforceability").expect("the host's refusal");
    assert_eq!(refusal.action, pb::GateAction::Deny as i32, "{refusal:?}");
    for word in says {
        assert!(refusal.reason.contains(word), "{word:?} not in {:?}", refusal.reason);
    }
    assert!(evidence.sandbox_id.is_empty(), "a sandbox was made");
    assert!(!common::kinds(events).contains(&"sandbox_ready"));
}

/// An admin `egress_allowlist` narrows `allow_hosts`; a `none` sandbox
/// shares the host network, where an empty allowlist is the whole network.
/// Accepting the run would ignore the policy (the harness reached a
/// loopback port no list allows), so it is refused at the gate, naming the
/// policy and linux_bwrap. The dry run says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_egress_allowlist_on_a_none_sandbox_is_refused_not_ignored() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let daemon = TestDaemon::start(Options {
        profiles: vec![("none.toml".into(), none_shell_profile("test.none-net", ""))],
        config: Box::new(|c| {
            c.policies.push(PolicySpec {
                name: "github-only".into(),
                kind: "egress_allowlist".into(),
                arguments: json!({"hosts": ["api.github.com"]}),
                on: vec![],
            })
        }),
        ..Options::default()
    })
    .await;
    let dry = daemon
        .catalog()
        .await
        .evaluate_gate(pb::EvaluateGateRequest {
            profile_ref: "test.none-net".into(),
            actor: "adm".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dry.action, pb::GateAction::Deny as i32, "{dry:?}");

    let script = format!("python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\"");
    let events = daemon.execute(request("test.none-net", &script)).await;
    assert_refused_unenforceable(&events, &["policy github-only narrows allow_hosts", "none", "linux_bwrap"]);
    assert!(listener.accept().is_err(), "the harness reached the host network");
    daemon.stop().await;
}

/// An `enforce_sandbox` that narrows write paths cannot be enforced by a
/// `none` sandbox (the whole workspace is writable there): refused at the
/// gate, and nothing was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narrowed_write_paths_on_a_none_sandbox_are_refused_not_ignored() {
    let guardrail = "[[guardrails.policies]]\nname = \"src-only\"\nkind = \"enforce_sandbox\"\n\
                     arguments = { write_paths = [\"src\"] }\n";
    let daemon = TestDaemon::start(Options {
        profiles: vec![("none.toml".into(), none_shell_profile("test.none-src", guardrail))],
        ..Options::default()
    })
    .await;
    // Writable by the sandbox's own uid, so that a run that goes ahead leaves it.
    let outside = tempfile::tempdir().unwrap();
    std::fs::set_permissions(outside.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let marker = outside.path().join("outside-src-written");
    let script = format!("touch ./outside-src && touch {}", marker.display());
    let events = daemon.execute(request("test.none-src", &script)).await;
    assert_refused_unenforceable(&events, &["policy src-only narrows write_paths to [src]", "none"]);
    assert!(!marker.exists(), "the harness ran");
    daemon.stop().await;
}

/// A protocol profile (`/bin/true`, no network) with `rein` and `extra`
/// TOML lines added.
fn protocol_profile(id: &str, rein: &str, extra: &str) -> String {
    format!(
        "id = \"{id}\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n{rein}\n[sandbox]\ntype = \"linux_bwrap\"\n\
         write_paths = [\".\"]\n{extra}\n"
    )
}

/// A `none` profile whose write paths are `paths` (a TOML list's inside).
fn none_profile_writing(id: &str, paths: &str) -> String {
    protocol_profile(id, "", "")
        .replace("type = \"linux_bwrap\"", "type = \"none\"\nallow_network = true")
        .replace("write_paths = [\".\"]", &format!("write_paths = [{paths}]"))
}

/// A value that loads but is never enforced (or makes every run fail) is
/// refused at load, naming the key: a model a protocol harness is never
/// told (it would be recorded as the run's model), a CPU quota below what
/// a cgroup takes, egress hosts with the network off, a `max_timeout` of 0.
/// On the wire, the same policy is INVALID_ARGUMENT naming `policies[0]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_that_would_be_accepted_and_not_enforced_refuse_the_profile() {
    let zero_timeout =
        "[[guardrails.policies]]\nname = \"instant\"\nkind = \"max_timeout\"\narguments = { seconds = 0 }";
    let cases = [
        (protocol_profile("test.model", "model = \"gpt-4o\"", ""), "rein.model", "claude_stream_json"),
        (protocol_profile("test.cpu", "", "[limits]\ncpu_millis = 9"), "limits.cpu_millis", "9 is below"),
        (
            protocol_profile("test.hosts", "", "allow_hosts = [\"example.com\"]"),
            "sandbox.allow_hosts",
            "allow_network = false",
        ),
        (protocol_profile("test.instant", "", zero_timeout), "guardrails.policies[0] (instant)", "seconds"),
        (protocol_profile("test.build", "", "").replace("1.0.0", "1.0.0+a"), "version", "build metadata"),
        (none_profile_writing("test.none-src", "\"src\""), "sandbox.write_paths", "cannot narrow"),
        (none_profile_writing("test.none-nothing", ""), "sandbox.write_paths", "cannot narrow"),
        (none_profile_writing("test.none-host", "\".\", \"/srv\""), "sandbox.write_paths[1]", "binds no host path"),
    ];
    for (text, key, says) in cases {
        let error = load_error(&[("p.toml", text.clone())]).await;
        assert!(error.contains("p.toml") && error.contains(key) && error.contains(says), "{text}: {error}");
    }

    // Control: the least quota a cgroup takes loads; a max_timeout of 1 too.
    let one_second = zero_timeout.replace("seconds = 0", "seconds = 1");
    let daemon = TestDaemon::start(Options {
        profiles: vec![
            ("cpu.toml".into(), protocol_profile("test.cpu", "", "[limits]\ncpu_millis = 10")),
            ("short.toml".into(), protocol_profile("test.short", "", &one_second)),
            // A [sandbox] that names no type is linux_bwrap, as documented.
            ("untyped.toml".into(), protocol_profile("test.untyped", "", "").replace("type = \"linux_bwrap\"\n", "")),
        ],
        ..Options::default()
    })
    .await;
    let mut catalog = daemon.catalog().await;
    let resolve =
        |profile_ref: &str| pb::ResolveProfileRequest { profile_ref: profile_ref.into(), actor: String::new() };
    let untyped = catalog.resolve_profile(resolve("test.untyped")).await.expect("untyped").into_inner();
    assert_eq!(untyped.profile.unwrap().sandbox.unwrap().r#type, pb::SandboxType::LinuxBwrap as i32);
    let status = catalog.resolve_profile(resolve("test.cpu@1.0.0+a")).await.expect_err("a build in a reference");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("build metadata"), "{status:?}");
    let max_timeout = |seconds: u32| pb::PolicySpec {
        name: "instant".into(),
        kind: pb::PolicyKind::MaxTimeout as i32,
        arguments_json: json!({ "seconds": seconds }).to_string(),
        on: vec![],
    };
    let dry = |policy| pb::EvaluateGateRequest {
        profile_ref: "test.cpu".into(),
        actor: "adm".into(),
        policies: vec![policy],
        ..Default::default()
    };
    let status = catalog.evaluate_gate(dry(max_timeout(0))).await.expect_err("a max_timeout of 0");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("policies[0]") && status.message().contains("seconds"), "{status:?}");
    let shortened = catalog.evaluate_gate(dry(max_timeout(1))).await.expect("a max_timeout of 1").into_inner();
    assert_eq!(shortened.effective_timeout_seconds, 1);
    daemon.stop().await;
}

/// Resolution for a dry run applies the rules an execution applies at its
/// stage `resolution`, beyond the catalog's own: a profile whose
/// `[placement]` names a label this daemon lacks is refused by both, with
/// the same reason, and a readable profile resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolution_for_a_dry_run_refuses_what_an_execution_refuses() {
    let daemon = TestDaemon::start(Options {
        profiles: vec![
            ("gpu.toml".into(), protocol_profile("test.gpu", "", "[placement]\nlabels = [\"gpu\"]")),
            ("plain.toml".into(), protocol_profile("test.plain", "", "")),
        ],
        ..Options::default()
    })
    .await;
    if daemon.engine.store.is_shared() {
        // On a fleet the placement is decided at Execute, against the live
        // nodes: the profile resolves, and Execute answers that no node can
        // run it now.
        daemon.engine.resolve_for_run(Some("adm"), "test.gpu").expect("a fleet places at Execute");
        let status = daemon.executions().await.execute(request("test.gpu", "")).await.expect_err("no node has gpu");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    } else {
        let refusal = daemon.engine.resolve_for_run(Some("adm"), "test.gpu").expect_err("no gpu label here");
        assert!(refusal.0.contains("gpu"), "{}", refusal.0);
        let execution = finished(&daemon.execute(request("test.gpu", "")).await);
        assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
        let evidence = execution.evidence.unwrap();
        assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32, "{evidence:?}");
        assert!(evidence.error.contains(&refusal.0), "{:?} vs {:?}", evidence.error, refusal.0);

        // Over the wire, both dry runs refuse it as the execution did.
        let mut catalog = daemon.catalog().await;
        let resolved = catalog
            .resolve_profile(pb::ResolveProfileRequest { profile_ref: "test.gpu".into(), actor: String::new() })
            .await
            .expect_err("ResolveProfile refuses what Execute refuses");
        assert_eq!(resolved.code(), tonic::Code::FailedPrecondition, "{resolved:?}");
        assert!(resolved.message().contains(&refusal.0), "{resolved:?}");
        let dry = catalog
            .evaluate_gate(pb::EvaluateGateRequest { profile_ref: "test.gpu".into(), ..Default::default() })
            .await
            .expect_err("EvaluateGate refuses what Execute refuses");
        assert_eq!(dry.code(), tonic::Code::FailedPrecondition, "{dry:?}");
        assert!(dry.message().contains(&refusal.0), "{dry:?}");
    }

    let refusal = daemon.engine.resolve_for_run(Some("nobody"), "test.plain").expect_err("not a consumer type");
    assert!(refusal.0.contains("adm"), "{}", refusal.0);
    let plain = daemon.engine.resolve_for_run(None, "test.plain").expect("resolves");
    assert_eq!(plain.reference(), "test.plain@1.0.0");
    daemon.stop().await;
}

/// A DrainNode naming this daemon's own node takes effect at once (the
/// proto: a drained node "takes no new work"), not at its next lease
/// renewal — on SQLite, where there is no lease, not never. Its health
/// goes NOT_SERVING then, as at a shutdown, so that a load balancer's
/// probe stops sending it work it would refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_this_node_refuses_new_work_at_once() {
    let daemon = TestDaemon::start(Options {
        profiles: vec![("plain.toml".into(), protocol_profile("test.plain", "", ""))],
        ..Options::default()
    })
    .await;
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient};
    /// The server's status and each corral service's.
    async fn statuses(channel: tonic::transport::Channel) -> Vec<ServingStatus> {
        let mut health = HealthClient::new(channel);
        let mut statuses = Vec::new();
        for service in ["", "corral.v1.ExecutionService", "corral.v1.SessionService", "corral.v1.CatalogService"] {
            let asked = tonic_health::pb::HealthCheckRequest { service: service.into() };
            statuses.push(health.check(asked).await.expect(service).into_inner().status());
        }
        statuses
    }
    assert_eq!(statuses(daemon.channel().await).await, [ServingStatus::Serving; 4]);
    let asked = pb::ExecuteRequest { request_id: "r-1".into(), ..request("test.plain", "") };
    let started = daemon.executions().await.start_execution(asked.clone()).await.expect("started").into_inner();
    let mut catalog = daemon.catalog().await;
    let nodes = catalog.list_nodes(pb::ListNodesRequest {}).await.expect("nodes").into_inner().nodes;
    let name = nodes.first().expect("this daemon's node").name.clone();
    let drained = catalog.drain_node(pb::DrainNodeRequest { name }).await.expect("drained").into_inner();
    assert!(daemon.engine.is_draining(), "the engine still takes work: {drained:?}");
    let refused = daemon.executions().await.start_execution(request("test.plain", "")).await.expect_err("draining");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("draining"), "{refused:?}");
    // A retry starts nothing: it gets its execution, draining or not
    // (DESIGN: request_id makes StartExecution idempotent).
    let again = daemon.executions().await.start_execution(asked.clone()).await.expect("a retry").into_inner();
    assert_eq!(again.execution_id, started.execution_id);
    let other = pb::ExecuteRequest { title: "another".into(), ..asked };
    let refused = daemon.executions().await.start_execution(other).await.expect_err("another request");
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused:?}");
    // The reporter's task sets it after the drain: a moment, not never.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = statuses(daemon.channel().await).await;
        if now == [ServingStatus::NotServing; 4] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still {now:?} after the drain");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    daemon.stop().await;
}

/// A NUL in a read or write path would reach bwrap's NUL-separated
/// arguments and start options of its own (`--share-net`, a `--ro-bind`
/// of a host file, `--setenv` swallowing the `--seccomp` after it): the
/// profile does not load, naming the key; a control character, or a NUL
/// in a passed-through variable's name, is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_or_control_character_in_a_sandbox_path_refuses_the_profile() {
    let injected =
        r#""file.txt\u0000/workspace/file.txt\u0000--ro-bind\u0000/etc/shadow\u0000/leak\u0000--setenv\u0000INJ""#;
    let cases = [
        (format!("write_paths = [\".\", {injected}]"), "sandbox.write_paths[1]"),
        (format!("write_paths = [{injected}]"), "sandbox.write_paths[0]"),
        ("write_paths = [\".\"]\nread_paths = [\"/opt\\u0000--share-net\"]".to_string(), "sandbox.read_paths[0]"),
        ("write_paths = [\"out\\nx\"]".to_string(), "sandbox.write_paths[0]"),
        ("write_paths = [\".\"]\nenv_passthrough = [\"HOME\\u0000X\"]".to_string(), "sandbox.env_passthrough[0]"),
    ];
    for (paths, key) in cases {
        let text = protocol_profile("test.nul-path", "", "").replace("write_paths = [\".\"]", &paths);
        let error = load_error(&[("p.toml", text)]).await;
        assert!(error.contains("p.toml") && error.contains(key), "{paths}: {error}");
        assert!(error.contains("control character") || error.contains("environment variable"), "{paths}: {error}");
    }
}

/// The same through the API: an `enforce_sandbox` session policy whose
/// write path holds a NUL is INVALID_ARGUMENT naming the field, and
/// nothing is created (no session, no sandbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_policy_with_a_nul_in_a_path_is_invalid() {
    let daemon = TestDaemon::start(Options {
        profiles: vec![("s.toml".into(), common::session_agent_profile("test.session-nul", ""))],
        ..Options::default()
    })
    .await;
    let mut sessions = pb::session_service_client::SessionServiceClient::new(daemon.channel().await);
    let arguments = json!({ "write_paths": ["file.txt\u{0}/workspace/file.txt\u{0}--share-net\u{0}--setenv\u{0}INJ"] });
    let request = pb::CreateSessionRequest {
        profile_ref: "test.session-nul".into(),
        project: "proj-a".into(),
        policies: vec![pb::PolicySpec {
            name: "narrow".into(),
            kind: pb::PolicyKind::EnforceSandbox as i32,
            arguments_json: arguments.to_string(),
            on: vec![],
        }],
        ..Default::default()
    };
    let status = sessions.create_session(request).await.expect_err("a NUL in a session policy's path");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(message.contains("policies[0]") && message.contains("arguments.write_paths[0]"), "{message}");
    assert!(message.contains("control character"), "{message}");
    let listed = sessions.list_sessions(pb::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert!(listed.sessions.is_empty(), "{listed:?}");
    assert!(daemon.leftover_sandboxes().await.is_empty());
    daemon.stop().await;
}
