//! `corral doctor`: what this host can enforce, read the way the daemon
//! reads it at start (the same probe, the same cgroup detection, the same
//! catalog and admin policies), and what the daemon's gate would decide for
//! each profile here.

use crate::catalog::{Catalog, Profile, RunFacts};
use crate::config::Config;
use crate::lifecycle::Resolution;
use crate::policy::{compile_all, Gate, HostCapabilities};
use crate::sandbox::{seccomp, Backends, BwrapBackend, SandboxBackend, UidMode, UidRange};

/// Prints the capability report, as text or (`json`) one JSON object per
/// line: `{"check": name, "ok": bool, "detail": text}` for each thing the
/// host can or cannot enforce and for what the daemon loads at start (its
/// admin `policies` and the `catalog`), then `{"profile": reference, "ok":
/// bool, "detail": text}` for each profile when the daemon would start.
/// Exit code 0 when linux_bwrap is usable and the daemon would start with
/// this config; 1 otherwise.
pub async fn run(config: &Config, json: bool) -> anyhow::Result<i32> {
    use std::io::Write as _;
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
    checks.push(("seccomp".into(), filter.clone()));
    let uids = UidRange::parse(&config.sandbox.uids).map(UidMode::detect);
    let uid_line = match &uids {
        Ok(mode @ UidMode::PerSandbox(_)) => Ok(mode.describe()),
        Ok(mode) => Err(mode.describe()),
        Err(e) => Err(format!("sandbox.uids: {e}")),
    };
    checks.push(("sandbox uids".into(), uid_line.clone()));
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
    // What the daemon refuses to start without (`Daemon::build`): a uid
    // range that parses, admin policies that compile, a catalog that loads.
    let admin = compile_all(&config.policies, "admin", "policies").map_err(|e| format!("config key {e}"));
    checks
        .push(("policies".into(), admin.as_ref().map(|p| format!("{} admin policies", p.len())).map_err(Clone::clone)));
    let catalog = load_catalog(config);
    checks.push((
        "catalog".into(),
        catalog.as_ref().map(|c| format!("{} profiles", c.list().len())).map_err(Clone::clone),
    ));
    let labels = crate::fleet::labels(probe.is_ok(), &config.fleet.labels);
    // The warm pools the daemon could keep, once the catalog loads.
    let warm = match (&catalog, &uids) {
        (Ok(catalog), Ok(uid_mode)) => crate::daemon::check_warm_pools(config, catalog, &probe, &labels, uid_mode)
            .map(|()| format!("{} warm sandboxes", config.sandbox.warm_total())),
        _ => Err("not judged: the catalog or the uid range does not load".into()),
    };
    checks.push(("warm pools".into(), warm.clone()));
    // The descriptors the daemon would raise itself to, and whether its
    // proxy fits them.
    let descriptors = crate::fdlimit::proxy_connections(config, crate::fdlimit::raise_nofile())
        .map(|n| format!("{n} proxy connections fit the descriptor limit"));
    checks.push(("file descriptors".into(), descriptors.clone()));
    // Who may call, and the TCP listener's TLS files, as `serve` loads them.
    let env = |name: &str| std::env::var(name).ok();
    let principals = crate::auth::load_principals(&config.principals, config.principals_dir.as_deref(), &env)
        .map(|loaded| format!("{} principals", loaded.len()));
    checks.push(("principals".into(), principals.clone()));
    let tls = match crate::daemon::tls_config(config) {
        Ok(Some(_)) => Ok("the listener's certificate and key load".to_string()),
        Ok(None) => Ok("none configured".to_string()),
        Err((what, e)) => Err(format!("{what}: {e}")),
    };
    checks.push(("tls".into(), tls.clone()));
    let starts = uids.is_ok()
        && admin.is_ok()
        && catalog.is_ok()
        && warm.is_ok()
        && descriptors.is_ok()
        && principals.is_ok()
        && tls.is_ok();
    let profiles = match (catalog, admin) {
        (Ok(catalog), Ok(admin)) => {
            // The host as the daemon's gate sees it (`Daemon::build`).
            let host = HostCapabilities {
                bwrap: probe.clone(),
                linux_bwrap: caps.clone(),
                none: backends.none.capabilities(),
                seccomp: filter,
                sandbox_uids: uid_line,
            };
            let here = Here { config, catalog: &catalog, gate: &Gate::new(admin, host), labels: &labels };
            Some(catalog.list().iter().map(|profile| (profile.reference(), here.report(profile))).collect::<Vec<Row>>())
        }
        _ => None,
    };
    let text = if json { as_json(&checks, profiles.as_deref()) } else { as_text(&checks, profiles.as_deref()) };
    // A reader that goes away (`| head`) is an error for `main` to end
    // quietly, not a panic.
    writeln!(std::io::stdout(), "{text}")?;
    Ok(if probe.is_ok() && starts { 0 } else { 1 })
}

/// The catalog as the daemon loads it at start, with its check of every
/// profile's `env_passthrough` against the credential routes.
fn load_catalog(config: &Config) -> Result<Catalog, String> {
    let routes: Vec<&str> = config.credentials.names().collect();
    let catalog = Catalog::load_with(&config.profile_dirs, &routes, &config.harness, &config.default_limits)
        .map_err(|e| format!("profiles: {e}"))?;
    crate::daemon::check_env_passthrough(config, &catalog).map_err(|e| format!("profiles: {e}"))?;
    Ok(catalog)
}

/// What a daemon started with this config on this host would decide.
struct Here<'a> {
    config: &'a Config,
    catalog: &'a Catalog,
    gate: &'a Gate,
    labels: &'a [String],
}

impl Here<'_> {
    /// A profile's line: its verdict, whether its tool calls are gated, and
    /// where its keys go.
    fn report(&self, profile: &Profile) -> Result<String, String> {
        let verdict = self.verdict(profile);
        let gating = match profile.file.rein.tool_calls_ungated(profile.file.sandbox.sandbox_type) {
            None => "tool calls gated".to_string(),
            // The gate's refusal has said why.
            Some(_) if verdict.as_ref().is_err_and(|e| e.starts_with("gate tool_call_gating")) => {
                "tool calls not gated".to_string()
            }
            Some(why) => format!("tool calls not gated, so a tool_call policy refuses it: {why}"),
        };
        let gating = format!("{gating}; {}", keys(self.config, profile));
        match verdict {
            Ok(()) => Ok(format!("can run here; {gating}")),
            Err(why) => Err(format!("{why}; {gating}")),
        }
    }

    /// Why a run of `profile` by the local admin (actor `adm`, project
    /// `default`, no repository, no session policies) would be refused:
    /// resolution's rules through the daemon's own [`Resolution`] (this
    /// node's placement labels on a single node: a fleet places at
    /// Execute), then the agent_start gate through
    /// [`Profile::gate_agent_start`], the call a run and `EvaluateGate`
    /// make, with the config's admin policies.
    fn verdict(&self, profile: &Profile) -> Result<(), String> {
        let node = self.config.node();
        let rules = Resolution {
            catalog: self.catalog,
            credentials: &self.config.credentials,
            node: &node,
            labels: self.labels,
        };
        let placed_here = self.config.store.url.is_none();
        let profile = rules.resolve(None, &profile.reference(), placed_here).map_err(|refusal| refusal.0)?;
        let facts = RunFacts {
            actor: "adm",
            project: crate::auth::DEFAULT_PROJECT,
            repo: "",
            tool_calls: 0,
            session_policies: &[],
            host_writes: crate::policy::HostWrites::Anywhere,
        };
        // The first deny ends the gate's evaluation and decides it.
        match profile.gate_agent_start(self.gate, facts).denial() {
            Some(d) => Err(format!("gate {} ({}): {}", d.policy, d.source, d.reason)),
            None => Ok(()),
        }
    }
}

/// A check or a profile: its name and what the host can do, or why not.
type Row = (String, Result<String, String>);

fn as_text(checks: &[Row], profiles: Option<&[Row]>) -> String {
    let mut out = vec!["corral doctor: what this host can enforce".to_string()];
    out.extend(checks.iter().map(|(name, result)| line(name, result)));
    out.push("profiles".into());
    match profiles {
        Some(profiles) => out.extend(profiles.iter().map(|(name, verdict)| line(&format!("  {name}"), verdict))),
        None => out.push("  none judged: the daemon would not start with this config".into()),
    }
    out.join("\n")
}

fn as_json(checks: &[Row], profiles: Option<&[Row]>) -> String {
    let object = |key: &str, name: &str, result: &Result<String, String>| {
        let (ok, detail) = match result {
            Ok(detail) => (true, detail),
            Err(detail) => (false, detail),
        };
        serde_json::json!({ key: name.trim(), "ok": ok, "detail": detail }).to_string()
    };
    let mut out: Vec<String> = checks.iter().map(|(name, result)| object("check", name, result)).collect();
    out.extend(profiles.unwrap_or_default().iter().map(|(name, verdict)| object("profile", name, verdict)));
    out.join("\n")
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
    if let Err(e) = config.credentials.check_exposure(refs, &profile.file.rein) {
        return format!("credentials: {e}");
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
