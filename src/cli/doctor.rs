//! `corral doctor`: what this host can enforce, read the way the daemon
//! reads it at start (the same probe, the same cgroup detection), and which
//! profiles the gate would therefore refuse.

use crate::catalog::Catalog;
use crate::config::Config;
use crate::sandbox::{seccomp, Backends, BwrapBackend, Capabilities, SandboxBackend, SandboxType, UidMode, UidRange};

/// Prints the capability report, as text or (`json`) one JSON object per
/// line: `{"check": name, "ok": bool, "detail": text}` for each thing the
/// host can or cannot enforce, then `{"profile": reference, "ok": bool,
/// "detail": text}` for each profile (a catalog that does not load is the
/// check `catalog`). Exit code 0 when linux_bwrap is usable.
pub async fn run(config: &Config, json: bool) -> anyhow::Result<i32> {
    let backends = Backends::for_host(&config.sandbox);
    let bwrap = BwrapBackend::detect(Backends::cgroups_for(&config.sandbox));
    let probe = bwrap.probe().await.map_err(|e| e.to_string());
    let mut checks: Vec<Row> = Vec::new();
    let version = match bwrap.program() {
        Some(program) => std::process::Command::new(program)
            .arg("--version")
            .output()
            .map(|o| format!("{} ({})", program.display(), String::from_utf8_lossy(&o.stdout).trim()))
            .unwrap_or_else(|e| format!("{}: {e}", program.display())),
        None => "not found on PATH".into(),
    };
    checks.push(("bwrap".into(), Ok(version)));
    checks.push((
        "sandbox".into(),
        probe.clone().map(|()| "a hardened sandbox starts (user namespace, seccomp, --disable-userns)".into()),
    ));
    let filter = seccomp::sandbox_filter()
        .map(|f| format!("{} ({} syscalls denied)", f.digest(), seccomp::DENIED.len()))
        .map_err(|e| e.to_string());
    checks.push(("seccomp".into(), filter));
    let uids = UidRange::parse(&config.sandbox.uids).map(UidMode::detect);
    let uid_line = match &uids {
        Ok(mode @ UidMode::PerSandbox(_)) => Ok(mode.describe()),
        Ok(mode) => Err(mode.describe()),
        Err(e) => Err(format!("sandbox.uids: {e}")),
    };
    checks.push(("sandbox uids".into(), uid_line));
    let caps = backends.linux_bwrap.capabilities();
    let cgroups = Backends::cgroups_for(&config.sandbox)
        .map(|h| h.describe())
        .ok_or_else(|| format!("no usable cgroup hierarchy under {}", config.sandbox.cgroup_mount.display()));
    checks.push(("cgroups".into(), cgroups));
    let rows = [("memory", &caps.memory), ("pids", &caps.pids), ("cpu", &caps.cpu), ("kill", &caps.kill)];
    for (name, support) in rows {
        checks.push((format!("  {name}"), support.clone()));
    }
    checks.push(("egress".into(), caps.egress.clone()));
    let routes: Vec<&str> = config.credentials.names().collect();
    let profiles = match Catalog::load_with(&config.profile_dirs, &routes, &config.harness, &config.default_limits) {
        Ok(catalog) => Ok(catalog
            .list()
            .into_iter()
            .map(|profile| {
                let verdict = refusal(&profile.file.sandbox, &profile.file.limits.sandbox(), &probe, &backends)
                    .or(profile.unusable.clone())
                    .or_else(|| config.credentials.check(&profile.file.credential_route_refs).err())
                    .or_else(|| config.credentials.check_env_passthrough(&profile.file.sandbox.env_passthrough).err())
                    .or_else(|| {
                        let readiness = &profile.file.readiness;
                        (readiness.state == crate::catalog::ReadinessState::Blocked)
                            .then(|| format!("readiness blocked: {}", readiness.reason))
                    });
                let gating = match profile.file.rein.tool_calls_ungated(profile.file.sandbox.sandbox_type) {
                    None => "tool calls gated".to_string(),
                    Some(why) => format!("tool calls not gated, so a tool_call policy refuses it: {why}"),
                };
                let gating = format!("{gating}; {}", keys(config, &profile));
                let verdict = verdict.map_or(Ok(format!("can run here; {gating}")), |e| Err(format!("{e}; {gating}")));
                (profile.reference(), verdict)
            })
            .collect::<Vec<_>>()),
        Err(e) => Err(e.to_string()),
    };
    let text = if json { as_json(&checks, &profiles) } else { as_text(&checks, &profiles) };
    println!("{text}");
    Ok(if probe.is_ok() { 0 } else { 1 })
}

/// A check or a profile: its name and what the host can do, or why not.
type Row = (String, Result<String, String>);

fn as_text(checks: &[Row], profiles: &Result<Vec<Row>, String>) -> String {
    let mut out = vec!["corral doctor: what this host can enforce".to_string()];
    out.extend(checks.iter().map(|(name, result)| line(name, result)));
    out.push("profiles".into());
    match profiles {
        Ok(profiles) => out.extend(profiles.iter().map(|(name, verdict)| line(&format!("  {name}"), verdict))),
        Err(e) => out.push(line("  catalog", &Err(e.clone()))),
    }
    out.join("\n")
}

fn as_json(checks: &[Row], profiles: &Result<Vec<Row>, String>) -> String {
    let object = |key: &str, name: &str, result: &Result<String, String>| {
        let (ok, detail) = match result {
            Ok(detail) => (true, detail),
            Err(detail) => (false, detail),
        };
        serde_json::json!({ key: name.trim(), "ok": ok, "detail": detail }).to_string()
    };
    let mut out: Vec<String> = checks.iter().map(|(name, result)| object("check", name, result)).collect();
    match profiles {
        Ok(profiles) => out.extend(profiles.iter().map(|(name, verdict)| object("profile", name, verdict))),
        Err(e) => out.push(object("check", "catalog", &Err(e.clone()))),
    }
    out.join("\n")
}

fn refusal(
    sandbox: &crate::sandbox::SandboxSpec,
    limits: &crate::sandbox::SandboxLimits,
    probe: &Result<(), String>,
    backends: &Backends,
) -> Option<String> {
    let kind = sandbox.sandbox_type;
    if let (SandboxType::LinuxBwrap, Err(reason)) = (kind, probe) {
        return Some(format!("linux_bwrap cannot be enforced on this host: {reason}"));
    }
    let caps: Capabilities = backends.get(kind).capabilities();
    if let (SandboxType::LinuxBwrap, true, Err(reason)) = (kind, sandbox.allow_network, &caps.egress) {
        return Some(format!("allow_network cannot be enforced on this host: {reason}"));
    }
    caps.refuse(limits)
}

fn line(name: &str, result: &Result<String, String>) -> String {
    match result {
        Ok(text) => format!("{name:<28} ok    {text}"),
        Err(text) => format!("{name:<28} NO    {text}"),
    }
}

/// Where a profile's credential routes put their secrets: behind the
/// credential gateway (the harness holds placeholders) or in the harness's
/// environment.
fn keys(config: &Config, profile: &crate::catalog::Profile) -> String {
    let refs = &profile.file.credential_route_refs;
    if refs.is_empty() {
        return "no credentials".into();
    }
    let gated = match profile.file.sandbox.sandbox_type {
        crate::sandbox::SandboxType::LinuxBwrap => match config.credentials.gateway_routes(refs, &profile.file.rein) {
            Ok(routes) => routes.into_iter().map(|r| r.name).collect(),
            Err(e) => return format!("credentials: {e}"),
        },
        crate::sandbox::SandboxType::None => Vec::new(),
    };
    let exposed: Vec<&str> = refs.iter().filter(|r| !gated.contains(r)).map(String::as_str).collect();
    match (gated.is_empty(), exposed.is_empty()) {
        (false, true) => format!("keys stay in the daemon (credential gateway: {})", gated.join(", ")),
        (true, false) => format!("keys in the harness's environment: {}", exposed.join(", ")),
        _ => format!(
            "keys stay in the daemon for {} (credential gateway); in the harness's environment: {}",
            gated.join(", "),
            exposed.join(", ")
        ),
    }
}
