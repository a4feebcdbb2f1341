use serde_json::json;

use super::*;

fn policy(name: &str, kind: &str, arguments: Value, on: &[&str], source: &'static str) -> Policy {
    let spec =
        PolicySpec { name: name.into(), kind: kind.into(), arguments, on: on.iter().map(|s| s.to_string()).collect() };
    Policy::compile(&spec, source).unwrap()
}

static NO_LIMITS: SandboxLimits = SandboxLimits {
    memory_bytes: 0,
    max_processes: 0,
    cpu_millis: 0,
    max_open_files: 0,
    address_space_bytes: 0,
    max_file_bytes: 0,
    max_workspace_bytes: 0,
    max_workspace_inodes: 0,
    tmp_bytes: 0,
    shm_bytes: 0,
};

fn gate() -> Gate {
    Gate::new(vec![], HostCapabilities::everything())
}

fn none_spec() -> SandboxSpec {
    SandboxSpec { sandbox_type: SandboxType::None, allow_network: true, ..SandboxSpec::default() }
}

fn input<'a>(sandbox: &'a SandboxSpec, profile: &'a [Policy], session: &'a [Policy]) -> GateInput<'a> {
    GateInput {
        phase: Phase::AgentStart,
        profile_ref: "p@1.0.0",
        actor: "agt",
        project: "proj",
        repo: "",
        sandbox,
        limits: &NO_LIMITS,
        timeout_seconds: 600,
        tool: "",
        arguments: &Value::Null,
        tool_calls: 0,
        session_policies: session,
        profile_policies: profile,
        ungated_tool_calls: Ungated::default(),
        host_writes: HostWrites::Anywhere,
    }
}

#[test]
fn enforce_sandbox_upgrades_none_to_bwrap_without_network() {
    let spec = none_spec();
    let enforce = [policy(
        "force-bwrap",
        "enforce_sandbox",
        json!({"sandbox_type": "linux_bwrap", "allow_network": false, "write_paths": ["."]}),
        &[],
        "profile",
    )];
    let outcome = gate().evaluate(&input(&spec, &enforce, &[]));
    assert_eq!(outcome.action, Action::Allow);
    assert_eq!(outcome.effective_sandbox.sandbox_type, SandboxType::LinuxBwrap);
    assert!(!outcome.effective_sandbox.allow_network);
    assert_eq!(outcome.effective_sandbox.write_paths, ["."]);
    // Without the policy the spec is unchanged.
    let plain = gate().evaluate(&input(&spec, &[], &[]));
    assert_eq!(plain.effective_sandbox, spec);
    assert_eq!(plain.action, Action::Allow);
}

#[test]
fn enforce_sandbox_only_tightens() {
    let spec = SandboxSpec { write_paths: vec![".".into()], ..SandboxSpec::default() };
    let loosen = [policy(
        "loosen",
        "enforce_sandbox",
        json!({"sandbox_type": "none", "allow_network": true, "write_paths": ["src", "/etc"]}),
        &[],
        "admin",
    )];
    let outcome = gate().evaluate(&input(&spec, &loosen, &[]));
    let effective = &outcome.effective_sandbox;
    assert_eq!(effective.sandbox_type, SandboxType::LinuxBwrap, "never downgraded");
    assert!(!effective.allow_network, "never turned on");
    assert_eq!(effective.write_paths, ["src"], "narrowed to a path inside the workspace, /etc not added");
    assert!(outcome.decisions[0].reason.contains("/etc not in the spec"), "{}", outcome.decisions[0].reason);
}

#[test]
fn unknown_fields_and_bad_arguments_fail_at_load() {
    let spec = |kind: &str, arguments: Value| PolicySpec { name: "p".into(), kind: kind.into(), arguments, on: vec![] };
    assert!(Policy::compile(&spec("enforce_sandbox", json!({"colour": "red"})), "profile")
        .unwrap_err()
        .contains("colour"));
    assert!(Policy::compile(&spec("max_timeout", json!({})), "profile").unwrap_err().contains("seconds"));
    assert!(Policy::compile(&spec("allowed_actors", json!({"types": ["root"]})), "profile").is_err());
    assert!(Policy::compile(&spec("nope", json!({})), "profile").unwrap_err().contains("unknown policy kind"));
    assert!(Policy::compile(&spec("expr", json!({"expression": "1 +", "reason": "r"})), "profile").is_err());
    let bad_on = PolicySpec { on: vec!["sometimes".into()], ..spec("deny_network", json!({})) };
    assert!(Policy::compile(&bad_on, "profile").unwrap_err().contains("on:"));
}

#[test]
fn sources_run_session_then_profile_then_admin_and_a_deny_stops() {
    let spec = SandboxSpec::default();
    let session = [policy("s", "allowed_actors", json!({"types": ["agt"]}), &[], "session")];
    let profile = [policy("p", "allowed_actors", json!({"types": ["adm"]}), &[], "profile")];
    let gate = Gate::new(vec![policy("a", "deny_network", json!({}), &[], "admin")], HostCapabilities::everything());
    let outcome = gate.evaluate(&input(&spec, &profile, &session));
    let order: Vec<(&str, &str)> = outcome.decisions.iter().map(|d| (d.source.as_str(), d.policy.as_str())).collect();
    assert_eq!(order, [("session", "s"), ("profile", "p")], "admin never reached after a deny");
    assert_eq!(outcome.action, Action::Deny);
    assert_eq!(outcome.denial().unwrap().policy, "p");
}

#[test]
fn a_merged_none_without_network_is_denied() {
    let spec = none_spec();
    let off = [policy("off", "deny_network", json!({}), &[], "admin")];
    let outcome = gate().evaluate(&input(&spec, &off, &[]));
    assert_eq!(outcome.action, Action::Deny);
    assert_eq!(outcome.denial().unwrap().policy, "host_enforceability");
}

#[test]
fn tool_call_policies_narrow_by_tool_and_count_calls() {
    let spec = SandboxSpec::default();
    let profile = [
        policy(
            "no-rm",
            "expr",
            json!({"expression": "tool != 'rm'", "reason": "rm is not allowed"}),
            &["tool_call:rm"],
            "profile",
        ),
        policy("three", "max_tool_calls", json!({"limit": 3}), &[], "profile"),
    ];
    let mut call = input(&spec, &profile, &[]);
    call.phase = Phase::ToolCall;
    call.tool = "edit";
    let allowed = gate().evaluate(&call);
    assert_eq!(allowed.action, Action::Allow);
    assert_eq!(allowed.decisions.len(), 1, "the rm rule does not apply to edit: {:?}", allowed.decisions);
    call.tool = "rm";
    let denied = gate().evaluate(&call);
    assert_eq!(denied.denial().unwrap().reason, "rm is not allowed");
    call.tool = "edit";
    call.tool_calls = 3;
    assert_eq!(gate().evaluate(&call).denial().unwrap().policy, "three");
}

#[test]
fn an_expression_that_errors_at_run_time_denies() {
    let spec = SandboxSpec::default();
    let profile = [policy(
        "broken",
        "expr",
        json!({"expression": "arguments.missing.deeper == 1", "reason": "r"}),
        &[],
        "profile",
    )];
    let outcome = gate().evaluate(&input(&spec, &profile, &[]));
    assert_eq!(outcome.action, Action::Deny);
    assert!(outcome.denial().unwrap().reason.contains("fail closed"));
}

#[test]
fn missing_bwrap_refuses_with_the_reason() {
    let gate = Gate::new(
        vec![],
        HostCapabilities { bwrap: Err("bwrap not found on PATH".into()), ..HostCapabilities::everything() },
    );
    let outcome = gate.evaluate(&input(&SandboxSpec::default(), &[], &[]));
    assert_eq!(outcome.action, Action::Deny);
    assert!(outcome.denial().unwrap().reason.contains("bwrap not found"));
}

/// A `none` sandbox of a daemon whose sandboxes share its uid would run
/// the harness as the daemon itself: refused, whatever else the host has.
#[test]
fn a_none_sandbox_sharing_the_daemons_uid_is_refused_with_the_reason() {
    let shared = Gate::new(
        vec![],
        HostCapabilities {
            sandbox_uids: Err("the daemon runs as uid 1000: sandboxes share it".into()),
            ..HostCapabilities::everything()
        },
    );
    let spec = SandboxSpec { sandbox_type: SandboxType::None, allow_network: true, ..SandboxSpec::default() };
    let outcome = shared.evaluate(&input(&spec, &[], &[]));
    assert_eq!(outcome.action, Action::Deny);
    let denial = outcome.denial().unwrap();
    assert_eq!(denial.policy, "host_enforceability");
    assert!(denial.reason.contains("as the daemon itself (the daemon runs as uid 1000"), "{}", denial.reason);
    // With a uid per sandbox, the same spec is allowed.
    assert_eq!(gate().evaluate(&input(&spec, &[], &[])).action, Action::Allow);
}

/// A `none` sandbox binds no host path: an absolute write path there
/// (a stored profile that predates the load check) is refused, not
/// written into the receipt as if it were bound.
#[test]
fn a_none_sandbox_refuses_a_host_write_path() {
    let spec = SandboxSpec {
        sandbox_type: SandboxType::None,
        allow_network: true,
        write_paths: vec![".".into(), "/srv/cache".into()],
        ..SandboxSpec::default()
    };
    let outcome = gate().evaluate(&input(&spec, &[], &[]));
    let denial = outcome.denial().expect("refused");
    assert_eq!(denial.policy, "host_enforceability");
    assert_eq!(denial.reason, "sandbox type none binds no host path (/srv/cache); use linux_bwrap");
    let workspace = SandboxSpec { write_paths: vec![".".into()], ..spec };
    assert_eq!(gate().evaluate(&input(&workspace, &[], &[])).action, Action::Allow);
}

#[test]
fn max_timeout_clamps() {
    let spec = SandboxSpec::default();
    let profile = [policy("short", "max_timeout", json!({"seconds": 60}), &[], "profile")];
    assert_eq!(gate().evaluate(&input(&spec, &profile, &[])).effective_timeout_seconds, 60);
}

#[test]
fn a_limit_the_host_cannot_enforce_is_refused_with_the_reason() {
    let no_memory = Capabilities {
        memory: Err("no writable memory controller".into()),
        ..HostCapabilities::everything().linux_bwrap
    };
    let gate = Gate::new(vec![], HostCapabilities { linux_bwrap: no_memory, ..HostCapabilities::everything() });
    let spec = SandboxSpec::default();
    let limits = SandboxLimits { memory_bytes: 256 << 20, ..NO_LIMITS };
    let outcome = gate.evaluate(&GateInput { limits: &limits, ..input(&spec, &[], &[]) });
    assert_eq!(outcome.action, Action::Deny);
    let denial = outcome.denial().unwrap();
    assert_eq!(denial.policy, "host_enforceability");
    assert_eq!(
        denial.reason,
        "limits.memory_bytes cannot be enforced on this host: no writable memory controller (to run without it, set \
         memory_bytes = 0 in the profile's [limits] or the daemon's [default_limits])"
    );
    // Without the limit the same host allows the run.
    assert_eq!(gate.evaluate(&input(&spec, &[], &[])).action, Action::Allow);
}

#[test]
fn a_policy_on_tool_calls_refuses_a_harness_whose_tool_calls_are_not_gated() {
    let spec = SandboxSpec::default();
    let why = "Claude Code runs its own tools without asking corral's gate";
    let cases: Vec<(Policy, bool)> = vec![
        // (policy, refused when the harness is not gated)
        (policy("no-bash", "expr", json!({"expression": "false", "reason": "r"}), &["tool_call:Bash"], "admin"), true),
        (policy("any-call", "expr", json!({"expression": "true", "reason": "r"}), &["tool_call"], "profile"), true),
        (policy("few", "max_tool_calls", json!({"limit": 3}), &[], "admin"), true),
        (policy("reads-tool", "expr", json!({"expression": "tool != 'Bash'", "reason": "r"}), &[], "admin"), true),
        (
            policy(
                "reads-args",
                "expr",
                json!({"expression": "arguments == null || size(arguments) < 10", "reason": "r"}),
                &[],
                "admin",
            ),
            true,
        ),
        // What corral dispatches itself, or what never looks at a call.
        (policy("dispatch", "max_tool_calls", json!({"limit": 1}), &["tool_call:run_task"], "admin"), false),
        (policy("actor", "expr", json!({"expression": "actor == 'agt'", "reason": "r"}), &[], "admin"), false),
        (policy("start", "expr", json!({"expression": "true", "reason": "r"}), &["agent_start"], "admin"), false),
        (policy("repos", "allowed_repos", json!({"prefixes": ["/"]}), &[], "admin"), false),
    ];
    for (p, refused) in cases {
        let name = p.name.clone();
        let profile = [p];
        let gated = gate().evaluate(&input(&spec, &profile, &[]));
        assert_eq!(gated.action, Action::Allow, "{name}: a gated harness starts");
        let ungated =
            gate().evaluate(&GateInput { ungated_tool_calls: Ungated::anywhere(why), ..input(&spec, &profile, &[]) });
        if refused {
            assert_eq!(ungated.action, Action::Deny, "{name}");
            let last = ungated.decisions.last().unwrap();
            assert_eq!((last.policy.as_str(), last.source.as_str()), ("tool_call_gating", "builtin"));
            assert_eq!(
                last.reason,
                format!("policy {name} governs tool calls, but {why}: it would be ignored, so the run is refused")
            );
        } else {
            assert_eq!(ungated.action, Action::Allow, "{name}: {:?}", ungated.decisions);
        }
    }
    // Session and admin policies count as much as the profile's.
    let admin = Gate::new(
        vec![policy("no-bash", "expr", json!({"expression": "false", "reason": "r"}), &["tool_call:Bash"], "admin")],
        HostCapabilities::everything(),
    );
    let ungated = admin.evaluate(&GateInput { ungated_tool_calls: Ungated::anywhere(why), ..input(&spec, &[], &[]) });
    assert_eq!(ungated.action, Action::Deny);
}

/// Whether a harness's own tool calls can be gated is judged on the
/// sandbox the policies leave: Claude Code in a `none` sandbox that an
/// admin policy upgrades to `linux_bwrap` carries the managed hook, so a
/// `tool_call` policy is enforced, not a reason to refuse the run.
#[test]
fn tool_call_gating_is_judged_on_the_effective_sandbox() {
    let spec = none_spec();
    let hookless = "Claude Code's tool calls reach corral's gate through a managed hook that only a linux_bwrap \
                    sandbox can carry";
    let claude = Ungated { in_bwrap: None, in_none: Some(hookless) };
    let no_bash =
        policy("no-bash", "expr", json!({"expression": "false", "reason": "r"}), &["tool_call:Bash"], "admin");
    let upgrade = policy(
        "force-bwrap",
        "enforce_sandbox",
        json!({"sandbox_type": "linux_bwrap", "allow_network": false, "write_paths": ["."]}),
        &[],
        "admin",
    );
    let upgraded = Gate::new(vec![upgrade, no_bash.clone()], HostCapabilities::everything());
    let outcome = upgraded.evaluate(&GateInput { ungated_tool_calls: claude, ..input(&spec, &[], &[]) });
    assert_eq!(outcome.effective_sandbox.sandbox_type, SandboxType::LinuxBwrap);
    assert_eq!(outcome.action, Action::Allow, "{:?}", outcome.decisions);
    let left = Gate::new(vec![no_bash], HostCapabilities::everything());
    let outcome = left.evaluate(&GateInput { ungated_tool_calls: claude, ..input(&spec, &[], &[]) });
    assert_eq!(outcome.action, Action::Deny);
    assert_eq!(outcome.decisions.last().unwrap().policy, "tool_call_gating");
}

/// A profile's absolute write paths are host directories every run of it
/// shares: a principal other than `adm` may have them only beneath its
/// `write_roots`, judged on the sandbox the policies leave; a path with
/// `..` is never beneath a root.
#[test]
fn host_write_paths_lie_beneath_the_principals_write_roots() {
    let roots = [std::path::PathBuf::from("/srv/cache/tenant-a")];
    let tenant = HostWrites::Beneath { principal: "tenant-a", roots: &roots };
    let none = HostWrites::Beneath { principal: "tenant-b", roots: &[] };
    let paths = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for (writes, write_paths, refused) in [
        (tenant, paths(&[".", "out"]), None),
        (tenant, paths(&[".", "/srv/cache/tenant-a"]), None),
        (tenant, paths(&["/srv/cache/tenant-a/pip"]), None),
        (tenant, paths(&[".", "/srv/cache/tenant-ab"]), Some("/srv/cache/tenant-ab")),
        (tenant, paths(&["/srv/cache"]), Some("/srv/cache")),
        (tenant, paths(&["/srv/cache/tenant-a/../tenant-b"]), Some("/srv/cache/tenant-a/../tenant-b")),
        (tenant, paths(&["/srv/cache/tenant-a/./x"]), None),
        (none, paths(&["/srv/cache/tenant-a"]), Some("/srv/cache/tenant-a")),
        (HostWrites::Anywhere, paths(&["/srv/cache"]), None),
    ] {
        let reason = writes.refusal(&write_paths);
        assert_eq!(reason.is_some(), refused.is_some(), "{write_paths:?}: {reason:?}");
        if let (Some(reason), Some(path)) = (reason, refused) {
            assert!(reason.starts_with(&format!("sandbox.write_paths: {path} is a host directory")), "{reason}");
        }
    }
    let reason = none.refusal(&paths(&["/srv/x"])).unwrap();
    assert!(reason.contains("principal tenant-b may write host directories only beneath its write_roots (none)"));

    // Judged on the effective sandbox: a policy that narrows the write
    // paths to the workspace leaves nothing to refuse.
    let spec = SandboxSpec { write_paths: paths(&[".", "/srv/shared"]), ..SandboxSpec::default() };
    let outcome = gate().evaluate(&GateInput { host_writes: none, ..input(&spec, &[], &[]) });
    assert_eq!(outcome.action, Action::Deny);
    assert_eq!(outcome.decisions.last().unwrap().policy, "host_write_paths");
    let narrow = policy("ws-only", "enforce_sandbox", json!({"write_paths": ["."]}), &[], "admin");
    let narrowed = Gate::new(vec![narrow], HostCapabilities::everything());
    let outcome = narrowed.evaluate(&GateInput { host_writes: none, ..input(&spec, &[], &[]) });
    assert_eq!(outcome.action, Action::Allow, "{:?}", outcome.decisions);
}

#[test]
fn require_approval_asks_waits_the_shortest_time_within_the_run_and_a_later_deny_wins() {
    let spec = SandboxSpec::default();
    let ask = |name: &str, seconds: u64| {
        policy(name, "require_approval", json!({"timeout_seconds": seconds}), &["tool_call:Bash"], "admin")
    };
    let profile = [ask("slow", 900), ask("quick", 30)];
    let call = |tool: &'static str, timeout_seconds: u64, policies: &[Policy]| {
        let outcome = gate().evaluate(&GateInput {
            phase: Phase::ToolCall,
            tool,
            timeout_seconds,
            ..input(&spec, policies, &[])
        });
        (outcome.action, outcome.approval_timeout_seconds)
    };
    assert_eq!(call("Bash", 600, &profile), (Action::Ask, 30), "the shortest asking policy");
    assert_eq!(call("Bash", 10, &profile), (Action::Ask, 10), "never past the run's timeout");
    assert_eq!(call("Write", 600, &profile), (Action::Allow, 0), "another tool does not ask");
    let denied = [ask("quick", 30), policy("no", "expr", json!({"expression": "false", "reason": "r"}), &[], "admin")];
    assert_eq!(call("Bash", 600, &denied).0, Action::Deny, "a deny after an ask wins");
    let default = policy("d", "require_approval", json!({}), &[], "admin");
    assert!(matches!(default.kind, Kind::RequireApproval { timeout_seconds: 300 }));
    let zero = PolicySpec {
        name: "z".into(),
        kind: "require_approval".into(),
        arguments: json!({"timeout_seconds": 0}),
        on: vec![],
    };
    assert!(Policy::compile(&zero, "admin").unwrap_err().contains("timeout_seconds"));
    // Not at agent_start: it has nothing to say there...
    let start = gate().evaluate(&input(&spec, &profile, &[]));
    assert_eq!(start.action, Action::Allow);
    // ...but an ungated harness under it is refused, not run unasked.
    let refused =
        gate().evaluate(&GateInput { ungated_tool_calls: Ungated::anywhere("no hook"), ..input(&spec, &profile, &[]) });
    assert_eq!(refused.action, Action::Deny);
}

#[test]
fn a_selector_for_a_phase_the_kind_never_applies_at_is_refused_at_load() {
    let spec = |kind: &str, arguments: Value, on: &[&str]| PolicySpec {
        name: "p".into(),
        kind: kind.into(),
        arguments,
        on: on.iter().map(|s| s.to_string()).collect(),
    };
    let hosts = json!({"hosts": ["example.com"]});
    let seconds = json!({"seconds": 5});
    let start_only: [(&str, Value); 4] = [
        ("enforce_sandbox", json!({})),
        ("deny_network", json!({})),
        ("egress_allowlist", hosts),
        ("max_timeout", seconds),
    ];
    let call_only: [(&str, Value); 2] =
        [("max_tool_calls", json!({"limit": 1})), ("require_approval", json!({"timeout_seconds": 2}))];
    let both: [(&str, Value); 3] = [
        ("allowed_actors", json!({"types": ["adm"]})),
        ("allowed_repos", json!({"prefixes": ["/"]})),
        ("expr", json!({"expression": "true", "reason": "r"})),
    ];
    for (kind, arguments) in &start_only {
        for on in ["tool_call", "tool_call:Bash", "tool_call:run_task"] {
            let error = Policy::compile(&spec(kind, arguments.clone(), &["agent_start", on]), "admin").unwrap_err();
            assert_eq!(
                error,
                format!("on[1]: {on:?} names tool_call, but {kind} applies only at agent_start: it would never apply")
            );
        }
        Policy::compile(&spec(kind, arguments.clone(), &["agent_start"]), "admin").unwrap();
    }
    for (kind, arguments) in &call_only {
        let error = Policy::compile(&spec(kind, arguments.clone(), &["agent_start"]), "admin").unwrap_err();
        assert_eq!(
            error,
            format!(
                "on[0]: \"agent_start\" names agent_start, but {kind} applies only at tool_call: it would never apply"
            )
        );
        for on in ["tool_call", "tool_call:Bash"] {
            Policy::compile(&spec(kind, arguments.clone(), &[on]), "admin").unwrap();
        }
    }
    for (kind, arguments) in &both {
        Policy::compile(&spec(kind, arguments.clone(), &["agent_start", "tool_call", "tool_call:Bash"]), "admin")
            .unwrap();
    }
    // The list names the key, the index and the policy.
    let listed = [spec("deny_network", json!({}), &[]), spec("deny_network", json!({}), &["tool_call:Bash"])];
    let error = compile_all(&listed, "session", "policies").unwrap_err();
    assert!(error.starts_with("policies[1] (p): on[0]: \"tool_call:Bash\" names tool_call"), "{error}");
}
