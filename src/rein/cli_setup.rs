//! What the daemon decides for a real agent CLI before it starts, so that a
//! built-in profile works unchanged: the model endpoint and model, where
//! the key is read from, the flags that let it edit the workspace, its
//! config file in HOME, and its knobs against non-essential traffic.
//!
//! Every harness also learns whether corral's sandbox around it is
//! verified (`CORRAL_SANDBOX=verified` and the receipt's command digest in
//! `CORRAL_SANDBOX_RECEIPT`). A vendor flag that turns the CLI's own
//! sandbox or permission checks off is used only then: Codex's own bwrap
//! cannot nest inside corral's, so inside a verified sandbox corral turns
//! it off, and anywhere else it stays on.

use crate::catalog::{Preset, ReinSpec};
use crate::sandbox::{Sandbox, SandboxType};

/// Flags that switch a CLI's own sandbox or permission prompts off.
const BYPASS_FLAGS: &[&str] = &[
    "--dangerously-bypass-approvals-and-sandbox",
    "--yolo",
    "--dangerously-skip-permissions",
    "--allow-dangerously-skip-permissions",
];
/// The flag in `argv` that turns a CLI's own sandbox or permission checks
/// off, as it is written there: one of [`BYPASS_FLAGS`] (also as
/// `--flag=value`), Claude Code's `--permission-mode bypassPermissions`,
/// or Codex's `danger-full-access` sandbox (`--sandbox`/`-s`, or
/// `-c`/`--config sandbox_mode=`), in any of their spellings.
fn bypass_in(argv: &[String]) -> Option<String> {
    // `--flag value`, `--flag=value`, and for a one-letter flag also
    // `-fvalue` (clap takes a short option's value attached).
    let valued = |flags: &[&str], arg: &str, next: Option<&String>| -> Option<String> {
        flags.iter().find_map(|flag| match arg.strip_prefix(flag) {
            Some("") => next.map(|v| v.to_string()),
            Some(rest) if rest.starts_with('=') => Some(rest[1..].to_string()),
            Some(rest) if flag.len() == 2 => Some(rest.to_string()),
            Some(_) | None => None,
        })
    };
    let bypasses_sandbox = |mode: &str| mode.trim_matches(|c| c == '"' || c == '\'') == "danger-full-access";
    for (i, arg) in argv.iter().enumerate() {
        let next = argv.get(i + 1);
        let shown = || match next {
            Some(v) if !arg.contains('=') => format!("{arg} {v}"),
            _ => arg.clone(),
        };
        if BYPASS_FLAGS.iter().any(|f| arg == f || arg.strip_prefix(f).is_some_and(|r| r.starts_with('='))) {
            return Some(arg.clone());
        }
        if valued(&["--permission-mode"], arg, next).is_some_and(|m| m == "bypassPermissions") {
            return Some(shown());
        }
        if valued(&["--sandbox", "-s"], arg, next).is_some_and(|m| bypasses_sandbox(&m)) {
            return Some(shown());
        }
        let config = valued(&["--config", "-c"], arg, next);
        if config
            .and_then(|kv| kv.split_once('=').map(|(k, v)| (k.trim() == "sandbox_mode", v.trim().to_string())))
            .is_some_and(|(key, mode)| key && bypasses_sandbox(&mode))
        {
            return Some(shown());
        }
    }
    None
}

/// Codex flags that choose its sandbox; with one in the profile's argv the
/// rein adds none.
const CODEX_SANDBOX_FLAGS: &[&str] =
    &["--dangerously-bypass-approvals-and-sandbox", "--yolo", "--sandbox", "-s", "--full-auto"];
/// Where Codex's config goes, under HOME (Codex's default `CODEX_HOME`).
pub const CODEX_CONFIG: &str = ".codex/config.toml";
/// The provider name corral writes into Codex's config.
const CODEX_PROVIDER: &str = "corral";
const OPENAI_DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";
/// Variables Claude Code reads its key from (x-api-key, or a bearer token).
const CLAUDE_KEY_VARS: &[&str] = &["ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"];

/// Whether corral's own sandbox is the boundary, as its receipt shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SandboxTrust {
    /// `sha256:` digest of the exact sandbox command line.
    Verified {
        receipt: String,
    },
    Unverified {
        why: String,
    },
}

impl SandboxTrust {
    /// Verified: bubblewrap with its own network namespace, seccomp, nested
    /// user namespaces refused, and neither inside nor host uid 0.
    pub fn of(sandbox: &Sandbox) -> SandboxTrust {
        let r = &sandbox.receipt;
        let missing = [
            (sandbox.backend != SandboxType::LinuxBwrap, "the sandbox backend is not linux_bwrap"),
            (r.command_digest.is_empty(), "the receipt has no command digest"),
            (!r.network_isolated, "the network is not isolated"),
            (r.seccomp_digest.is_empty(), "no seccomp filter"),
            (!r.userns_disabled, "nested user namespaces are allowed"),
            (r.inside_uid == 0 || r.host_uid == 0, "the harness would run as uid 0"),
        ];
        match missing.iter().find(|(missing, _)| *missing) {
            Some((_, why)) => SandboxTrust::Unverified { why: why.to_string() },
            None => SandboxTrust::Verified { receipt: format!("sha256:{}", r.command_digest) },
        }
    }

    fn is_verified(&self) -> bool {
        matches!(self, SandboxTrust::Verified { .. })
    }

    fn env(&self) -> Vec<(String, String)> {
        match self {
            SandboxTrust::Verified { receipt } => {
                vec![("CORRAL_SANDBOX".into(), "verified".into()), ("CORRAL_SANDBOX_RECEIPT".into(), receipt.clone())]
            }
            SandboxTrust::Unverified { .. } => vec![("CORRAL_SANDBOX".into(), "unverified".into())],
        }
    }
}

/// How a harness is started, as the daemon decided it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    pub argv: Vec<String>,
    /// Added to the harness's environment (never its arguments).
    pub env: Vec<(String, String)>,
    /// `(path under HOME, contents)` written before the harness starts.
    pub home_files: Vec<(String, String)>,
    /// The model the stream parser starts from (Codex never names it).
    pub model: String,
}

/// Decides argv, environment and HOME files for `rein` in a sandbox of
/// `trust`, with the credential variables `credential_vars` (names only);
/// `gated`: the sandbox carries the agent's managed hook and the gate's
/// endpoint. An error is why the harness must not start.
pub fn prepare(
    rein: &ReinSpec,
    trust: &SandboxTrust,
    credential_vars: &[&str],
    gated: bool,
    model_gateway: Option<&str>,
) -> Result<Prepared, String> {
    let mut prepared =
        Prepared { argv: rein.argv.clone(), env: trust.env(), home_files: Vec::new(), model: rein.model.clone() };
    if let (Some(flag), SandboxTrust::Unverified { why }) = (bypass_in(&rein.argv), trust) {
        return Err(format!("{flag} turns the agent's own sandbox off, and corral's sandbox is not verified: {why}"));
    }
    match rein.preset {
        Preset::Protocol => {}
        Preset::ClaudeStreamJson => claude(rein, credential_vars, gated, model_gateway, &mut prepared)?,
        Preset::CodexExecJson => codex(rein, trust, credential_vars, model_gateway, &mut prepared)?,
    }
    if model_gateway.is_some() {
        bypass_gateway(&mut prepared, gated);
    }
    Ok(prepared)
}

/// Sends a run's requests to its credential gateway past the egress proxy
/// (which refuses loopback, and anything carrying a placeholder): for
/// every run with gatewayed routes, whatever its preset. The gateway and
/// the hook listen on the namespace's loopback, where nothing else does.
/// (Codex's client matches NO_PROXY by host only.)
pub fn bypass_gateway(prepared: &mut Prepared, gated: bool) {
    let mut entries = vec!["127.0.0.1".to_string(), format!("127.0.0.1:{}", crate::credentials::GATEWAY_PORT)];
    if gated {
        entries.push(crate::gate::hook::no_proxy_entry());
    }
    prepared.env.retain(|(k, _)| k != "NO_PROXY" && k != "no_proxy");
    let joined = entries.join(",");
    prepared.env.extend([("NO_PROXY".into(), joined.clone()), ("no_proxy".into(), joined)]);
}

/// Knobs that keep a CLI from phoning home (telemetry, update checks, error
/// reports); the egress proxy would refuse that traffic anyway, but a CLI
/// that waits for it slows every run.
fn quiet(prepared: &mut Prepared, vars: &[&str]) {
    prepared.env.extend(vars.iter().map(|v| (v.to_string(), "1".to_string())));
}

fn claude(
    rein: &ReinSpec,
    credential_vars: &[&str],
    gated: bool,
    model_gateway: Option<&str>,
    prepared: &mut Prepared,
) -> Result<(), String> {
    if !credential_vars.is_empty() && !credential_vars.iter().any(|v| CLAUDE_KEY_VARS.contains(v)) {
        return Err(format!(
            "Claude Code reads its key from {}; the profile's credential routes inject {}",
            CLAUDE_KEY_VARS.join(" or "),
            credential_vars.join(", ")
        ));
    }
    match model_gateway {
        Some(url) => prepared.env.push(("ANTHROPIC_BASE_URL".into(), url.to_string())),
        None if !rein.base_url.is_empty() => prepared.env.push(("ANTHROPIC_BASE_URL".into(), rein.base_url.clone())),
        None => {}
    }
    if !rein.model.is_empty() {
        prepared.env.push(("ANTHROPIC_MODEL".into(), rein.model.clone()));
    }
    if gated {
        // Its http hook would otherwise go through HTTPS_PROXY, which
        // refuses loopback: only the gate's host:port bypasses the proxy.
        let entry = crate::gate::hook::no_proxy_entry();
        prepared.env.extend([("NO_PROXY".into(), entry.clone()), ("no_proxy".into(), entry)]);
    }
    quiet(
        prepared,
        &[
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
            "DISABLE_TELEMETRY",
            "DISABLE_ERROR_REPORTING",
            "DISABLE_AUTOUPDATER",
        ],
    );
    Ok(())
}

fn codex(
    rein: &ReinSpec,
    trust: &SandboxTrust,
    credential_vars: &[&str],
    model_gateway: Option<&str>,
    prepared: &mut Prepared,
) -> Result<(), String> {
    // Only an argv that runs `codex exec` itself gets flags; a wrapper
    // (`sh -c ...`) chooses its own.
    let runs_codex = rein.argv.first().is_some_and(|p| p == "codex" || p.ends_with("/codex"));
    let exec_at = rein.argv.iter().position(|a| a == "exec").filter(|_| runs_codex);
    let chooses_sandbox = rein.argv.iter().any(|a| {
        CODEX_SANDBOX_FLAGS.iter().any(|f| a == f || a.strip_prefix(f).is_some_and(|r| r.starts_with('=')))
            || (a.starts_with("-s") && !a.starts_with("--"))
    });
    if let (Some(exec_at), false) = (exec_at, chooses_sandbox) {
        let flags: &[&str] = if trust.is_verified() {
            &["--dangerously-bypass-approvals-and-sandbox"]
        } else {
            &["--sandbox", "workspace-write"]
        };
        // Right after `exec`, before the prompt argument.
        prepared.argv.splice(exec_at + 1..exec_at + 1, flags.iter().map(|f| f.to_string()));
    }
    let env_key = credential_vars.first().copied().unwrap_or("OPENAI_API_KEY");
    let base_url = match model_gateway {
        Some(url) => url,
        None if rein.base_url.is_empty() => OPENAI_DEFAULT_BASE_URL,
        None => &rein.base_url,
    };
    prepared.home_files.push((CODEX_CONFIG.into(), codex_config(base_url, &rein.model, env_key)));
    Ok(())
}

/// Codex's `config.toml`: a model provider at `base_url` speaking the
/// Responses API with its key in `env_key`, and nothing phoning home.
pub fn codex_config(base_url: &str, model: &str, env_key: &str) -> String {
    use toml::{Table, Value};
    let table = |pairs: &[(&str, Value)]| -> Value {
        Value::Table(pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<Table>())
    };
    let text = |s: &str| Value::String(s.to_string());
    let mut root = Table::new();
    if !model.is_empty() {
        root.insert("model".into(), text(model));
    }
    root.insert("model_provider".into(), text(CODEX_PROVIDER));
    root.insert("check_for_update_on_startup".into(), Value::Boolean(false));
    // Its hosted web search runs at the provider, where no pre-tool hook
    // sees it; the managed requirement (see `gate::hook`) holds it off too.
    root.insert("web_search".into(), text("disabled"));
    let provider = table(&[
        ("name", text(CODEX_PROVIDER)),
        ("base_url", text(base_url)),
        ("wire_api", text("responses")),
        ("env_key", text(env_key)),
    ]);
    root.insert("model_providers".into(), table(&[(CODEX_PROVIDER, provider)]));
    // Plugins sync a curated catalog from github.com and chatgpt.com at
    // every start.
    root.insert("features".into(), table(&[("plugins", Value::Boolean(false))]));
    root.insert("analytics".into(), table(&[("enabled", Value::Boolean(false))]));
    root.insert("feedback".into(), table(&[("enabled", Value::Boolean(false))]));
    root.insert("otel".into(), table(&[("exporter", text("none")), ("log_user_prompt", Value::Boolean(false))]));
    let body = toml::to_string(&root).unwrap_or_default();
    format!("# Written by corral before the harness starts; rewritten at every start.\n{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::TaskInput;

    fn rein(preset: Preset, argv: &[&str], base_url: &str, model: &str) -> ReinSpec {
        ReinSpec {
            kind: "command".into(),
            preset,
            argv: argv.iter().map(|s| s.to_string()).collect(),
            input: TaskInput::Prompt,
            base_url: base_url.into(),
            model: model.into(),
        }
    }

    fn verified() -> SandboxTrust {
        SandboxTrust::Verified { receipt: "sha256:abc".into() }
    }

    fn unverified() -> SandboxTrust {
        SandboxTrust::Unverified { why: "the sandbox backend is not linux_bwrap".into() }
    }

    fn env<'a>(p: &'a Prepared, name: &str) -> Option<&'a str> {
        p.env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Every spelling of a flag that turns a CLI's own checks off is found;
    /// a flag that keeps them on is not.
    #[test]
    fn a_bypass_is_found_in_any_spelling() {
        let found = |argv: &[&str]| bypass_in(&argv.iter().map(|a| a.to_string()).collect::<Vec<_>>());
        let cases: &[(&[&str], Option<&str>)] = &[
            (&["codex", "exec", "--yolo", "-"], Some("--yolo")),
            (&["claude", "--dangerously-skip-permissions=true"], Some("--dangerously-skip-permissions=true")),
            (&["claude", "--permission-mode", "bypassPermissions"], Some("--permission-mode bypassPermissions")),
            (&["claude", "--permission-mode=bypassPermissions"], Some("--permission-mode=bypassPermissions")),
            (&["codex", "exec", "--sandbox", "danger-full-access"], Some("--sandbox danger-full-access")),
            (&["codex", "exec", "-s", "danger-full-access", "-"], Some("-s danger-full-access")),
            (&["codex", "exec", "--sandbox=danger-full-access"], Some("--sandbox=danger-full-access")),
            (&["codex", "exec", "-c", "sandbox_mode=danger-full-access"], Some("-c sandbox_mode=danger-full-access")),
            (&["codex", "-c", "sandbox_mode=\"danger-full-access\""], Some("-c sandbox_mode=\"danger-full-access\"")),
            (
                &["codex", "--config=sandbox_mode='danger-full-access'"],
                Some("--config=sandbox_mode='danger-full-access'"),
            ),
            (&["claude", "--permission-mode", "acceptEdits"], None),
            (&["codex", "exec", "-sdanger-full-access"], Some("-sdanger-full-access")),
            (&["codex", "-csandbox_mode=danger-full-access"], Some("-csandbox_mode=danger-full-access")),
            (&["codex", "exec", "--sandbox", "workspace-write", "-"], None),
            (&["claude", "-c", "-p"], None),
            (&["codex", "--sandboxed"], None),
            (&["codex", "exec", "-s", "read-only"], None),
            (&["codex", "-c", "model=danger-full-access"], None),
            (&["codex", "exec", "--sandbox"], None),
            (&["claude", "-p", "--output-format", "stream-json"], None),
        ];
        for (argv, expected) in cases {
            assert_eq!(found(argv).as_deref(), *expected, "{argv:?}");
        }
        let codex = rein(Preset::CodexExecJson, &["codex", "exec", "--sandbox", "danger-full-access", "-"], "", "");
        let err = prepare(&codex, &unverified(), &[], false, None).unwrap_err();
        assert!(err.starts_with("--sandbox danger-full-access turns the agent's own sandbox off"), "{err}");
        assert_eq!(
            prepare(&codex, &verified(), &[], false, None).unwrap().argv,
            codex.argv,
            "corral's is the boundary"
        );
    }

    #[test]
    fn codex_turns_its_own_sandbox_off_only_inside_a_verified_one() {
        let codex = rein(Preset::CodexExecJson, &["codex", "exec", "--json", "-"], "http://127.0.0.1:9/v1", "m-1");
        let p = prepare(&codex, &verified(), &["OPENAI_API_KEY"], false, None).unwrap();
        assert_eq!(p.argv, ["codex", "exec", "--dangerously-bypass-approvals-and-sandbox", "--json", "-"]);
        assert_eq!(
            (env(&p, "CORRAL_SANDBOX"), env(&p, "CORRAL_SANDBOX_RECEIPT")),
            (Some("verified"), Some("sha256:abc"))
        );
        assert_eq!(p.model, "m-1");
        let p = prepare(&codex, &unverified(), &["OPENAI_API_KEY"], false, None).unwrap();
        assert_eq!(p.argv, ["codex", "exec", "--sandbox", "workspace-write", "--json", "-"]);
        assert_eq!((env(&p, "CORRAL_SANDBOX"), env(&p, "CORRAL_SANDBOX_RECEIPT")), (Some("unverified"), None));
        // A bypass flag in the profile itself is refused outside a verified sandbox.
        let yolo = rein(Preset::CodexExecJson, &["codex", "exec", "--yolo", "-"], "", "");
        let err = prepare(&yolo, &unverified(), &[], false, None).unwrap_err();
        assert!(err.contains("--yolo") && err.contains("not linux_bwrap"), "{err}");
        assert_eq!(prepare(&yolo, &verified(), &[], false, None).unwrap().argv, ["codex", "exec", "--yolo", "-"]);
        let claude = rein(Preset::ClaudeStreamJson, &["claude", "--dangerously-skip-permissions"], "", "");
        assert!(prepare(&claude, &unverified(), &[], false, None).is_err());
        let wrapper = rein(Preset::CodexExecJson, &["/bin/sh", "-c", "codex exec - | tee t"], "", "");
        assert_eq!(
            prepare(&wrapper, &verified(), &[], false, None).unwrap().argv,
            wrapper.argv,
            "a wrapper chooses its flags"
        );
        let script = rein(Preset::Protocol, &["/bin/agent", "--yolo"], "", "");
        assert!(prepare(&script, &unverified(), &[], false, None).is_err(), "whatever the preset");
    }

    #[test]
    fn codex_config_names_the_provider_and_the_key_variable() {
        let codex = rein(Preset::CodexExecJson, &["codex", "exec", "-"], "http://10.0.0.5:8080/v1", "m-1");
        let p = prepare(&codex, &verified(), &["CODEX_KEY"], false, None).unwrap();
        let [(path, text)] = &p.home_files[..] else { panic!("one file: {:?}", p.home_files) };
        assert_eq!(path, ".codex/config.toml");
        let parsed: toml::Table = toml::from_str(text).unwrap();
        assert_eq!(parsed["model"].as_str(), Some("m-1"));
        assert_eq!(parsed["model_provider"].as_str(), Some("corral"));
        let provider = &parsed["model_providers"]["corral"];
        assert_eq!(provider["base_url"].as_str(), Some("http://10.0.0.5:8080/v1"));
        assert_eq!(provider["wire_api"].as_str(), Some("responses"));
        assert_eq!(provider["env_key"].as_str(), Some("CODEX_KEY"));
        assert_eq!(parsed["analytics"]["enabled"].as_bool(), Some(false));
        assert_eq!(parsed["features"]["plugins"].as_bool(), Some(false));
        assert_eq!(parsed["web_search"].as_str(), Some("disabled"));
        let vendor =
            prepare(&rein(Preset::CodexExecJson, &["codex", "exec", "-"], "", ""), &verified(), &[], false, None)
                .unwrap();
        let parsed: toml::Table = toml::from_str(&vendor.home_files[0].1).unwrap();
        assert_eq!(parsed["model_providers"]["corral"]["base_url"].as_str(), Some("https://api.openai.com/v1"));
        assert_eq!(parsed["model_providers"]["corral"]["env_key"].as_str(), Some("OPENAI_API_KEY"));
        assert!(parsed.get("model").is_none());
    }

    /// A protocol command with gatewayed routes reaches its gateway past
    /// the proxy as the CLI presets do, with the gate's entry when gated.
    #[test]
    fn a_run_with_gatewayed_routes_bypasses_the_proxy_for_its_gateway() {
        let script = rein(Preset::Protocol, &["/bin/sh", "-s"], "", "");
        let mut p = prepare(&script, &verified(), &["MOCK_TOKEN"], false, None).unwrap();
        assert_eq!(env(&p, "NO_PROXY"), None, "nothing to bypass yet");
        bypass_gateway(&mut p, false);
        assert_eq!(env(&p, "NO_PROXY"), Some("127.0.0.1,127.0.0.1:3130"));
        assert_eq!(env(&p, "no_proxy"), Some("127.0.0.1,127.0.0.1:3130"));
        let mut gated = prepare(&script, &verified(), &["MOCK_TOKEN"], true, None).unwrap();
        bypass_gateway(&mut gated, true);
        assert_eq!(env(&gated, "NO_PROXY"), Some("127.0.0.1,127.0.0.1:3130,127.0.0.1:3129"));
        assert_eq!(gated.env.iter().filter(|(k, _)| k == "NO_PROXY").count(), 1, "set once");
    }

    #[test]
    fn claude_gets_its_endpoint_and_quiet_knobs() {
        let claude = rein(Preset::ClaudeStreamJson, &["claude", "-p"], "http://127.0.0.1:9", "claude-x");
        let p = prepare(&claude, &verified(), &["ANTHROPIC_API_KEY"], false, None).unwrap();
        assert_eq!(p.argv, ["claude", "-p"]);
        assert_eq!(env(&p, "ANTHROPIC_BASE_URL"), Some("http://127.0.0.1:9"));
        assert_eq!(env(&p, "ANTHROPIC_MODEL"), Some("claude-x"));
        assert_eq!(env(&p, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"), Some("1"));
        assert!(p.home_files.is_empty());
        assert_eq!(env(&p, "NO_PROXY"), None, "no gate, no bypass");
        let gated = prepare(&claude, &verified(), &["ANTHROPIC_API_KEY"], true, None).unwrap();
        assert_eq!(env(&gated, "NO_PROXY"), Some("127.0.0.1:3129"), "only the gate's host:port bypasses the proxy");
        assert_eq!(env(&gated, "no_proxy"), Some("127.0.0.1:3129"));
        let vendor =
            prepare(&rein(Preset::ClaudeStreamJson, &["claude"], "", ""), &verified(), &[], false, None).unwrap();
        assert_eq!(env(&vendor, "ANTHROPIC_BASE_URL"), None);
        let err = prepare(&claude, &verified(), &["OPENAI_API_KEY"], false, None).unwrap_err();
        assert!(err.contains("ANTHROPIC_API_KEY") && err.contains("OPENAI_API_KEY"), "{err}");
    }
}
