//! The built-in profiles of real agent CLIs (Claude Code, Codex), the
//! daemon's `[harness]` section that points them at a model endpoint, and
//! what this host has of each CLI.
//!
//! The endpoint is part of the profile (`rein.base_url`, `rein.model`), so
//! its digest changes with it and the egress allowlist is derived from it:
//! a built-in pointed at `https://10.0.0.5:8443` may reach exactly
//! `10.0.0.5:8443` and nothing else (its key is added by the daemon's
//! credential gateway, which requires https beyond loopback).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::profile::{check_model, Preset, Readiness, ReadinessState, ReinSpec, TaskInput};
use crate::net::Endpoint;
use crate::sandbox::{SandboxSpec, SandboxType};

/// The credential route the built-in Claude Code profile takes its key
/// from; it must inject `ANTHROPIC_API_KEY` (or `ANTHROPIC_AUTH_TOKEN`).
pub const ANTHROPIC_ROUTE: &str = "anthropic";
/// The credential route of the built-in Codex profile; whatever it injects
/// as becomes the provider's `env_key`.
pub const OPENAI_ROUTE: &str = "openai";

/// The vendor hosts the built-ins reach when `[harness]` names no endpoint.
const ANTHROPIC_HOST: &str = "api.anthropic.com";
const OPENAI_HOST: &str = "api.openai.com";

/// The tools Claude Code may use without asking (it cannot ask in `-p`
/// mode: anything else is refused and the run fails). Bash is among them
/// because the agent runs inside corral's sandbox, which is the boundary.
pub const CLAUDE_ALLOWED_TOOLS: &str = "Bash,Edit,Write,MultiEdit,NotebookEdit,Read,Glob,Grep,TodoWrite,Task";

/// `[harness]`: where the built-in Claude Code and Codex profiles send their
/// model requests and which model they ask for. An endpoint set here
/// replaces the vendor host in the built-in's `allow_hosts` (its
/// `host:port` becomes the only host it may reach); the key always comes
/// from the `anthropic` / `openai` credential route.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HarnessConfig {
    /// The Anthropic Messages API for `builtin.claude-code`
    /// (`ANTHROPIC_BASE_URL`), e.g. a gateway `https://10.0.0.5:8443`.
    pub anthropic_base_url: String,
    /// The model it asks for (`ANTHROPIC_MODEL`); empty: Claude Code's default.
    pub anthropic_model: String,
    /// The OpenAI Responses API for `builtin.codex`, e.g.
    /// `https://10.0.0.5:8443/v1`; empty: `https://api.openai.com/v1`.
    pub openai_base_url: String,
    /// The model Codex asks for; empty: [`CODEX_DEFAULT_MODEL`].
    pub openai_model: String,
}

/// The model written into Codex's config when `[harness] openai_model` is
/// empty: the default of the Codex version `.ci/run` pins (0.171.0), named
/// explicitly so that the evidence can say which model ran (Codex's JSON
/// stream never does).
pub const CODEX_DEFAULT_MODEL: &str = "gpt-6.2-sol";

impl HarnessConfig {
    /// Checks every key; errors name it.
    pub fn validate(&self) -> Result<(), (String, String)> {
        for (key, url) in [
            ("harness.anthropic_base_url", &self.anthropic_base_url),
            ("harness.openai_base_url", &self.openai_base_url),
        ] {
            // The model key goes there (by the gateway, or the harness
            // itself when exposed): a URL, and never in clear beyond
            // loopback.
            if !url.is_empty() {
                crate::net::client::secret_origin(url).map_err(|e| (key.to_string(), e))?;
            }
        }
        for (key, model) in
            [("harness.anthropic_model", &self.anthropic_model), ("harness.openai_model", &self.openai_model)]
        {
            check_model(model).map_err(|e| (key.to_string(), e))?;
        }
        Ok(())
    }
}

/// A sandbox with egress to the model endpoint only.
fn model_sandbox(base_url: &str, vendor_host: &str) -> SandboxSpec {
    // A bad URL is caught by `HarnessConfig::validate` and again by profile
    // validation; this falls back to the vendor so the error names the URL.
    let host = match Endpoint::parse(base_url) {
        Ok(endpoint) if !base_url.is_empty() => endpoint.allow_entry(),
        _ => vendor_host.to_string(),
    };
    SandboxSpec {
        sandbox_type: SandboxType::LinuxBwrap,
        allow_network: true,
        allow_hosts: vec![host],
        write_paths: vec![".".into()],
        read_paths: Vec::new(),
        env_passthrough: Vec::new(),
    }
}

/// `builtin.claude-code`: print mode, stream-json, edits accepted and an
/// explicit tool allowlist (in `-p` mode anything else is refused).
pub fn claude_code(harness: &HarnessConfig) -> (ReinSpec, SandboxSpec, Vec<String>) {
    let argv = [
        "claude",
        "-p",
        "--output-format",
        "stream-json",
        "--verbose",
        "--permission-mode",
        "acceptEdits",
        "--allowedTools",
        CLAUDE_ALLOWED_TOOLS,
    ];
    let rein = ReinSpec {
        kind: "command".into(),
        preset: Preset::ClaudeStreamJson,
        argv: argv.map(String::from).to_vec(),
        input: TaskInput::Prompt,
        base_url: harness.anthropic_base_url.clone(),
        model: harness.anthropic_model.clone(),
    };
    (rein, model_sandbox(&harness.anthropic_base_url, ANTHROPIC_HOST), vec![ANTHROPIC_ROUTE.into()])
}

/// `builtin.codex`: `exec --json`, its provider written by the daemon; its
/// own sandbox is turned off by the rein only inside a verified corral
/// sandbox (see `rein::cli_setup`).
pub fn codex(harness: &HarnessConfig) -> (ReinSpec, SandboxSpec, Vec<String>) {
    let model = if harness.openai_model.is_empty() { CODEX_DEFAULT_MODEL } else { &harness.openai_model };
    let rein = ReinSpec {
        kind: "command".into(),
        preset: Preset::CodexExecJson,
        argv: ["codex", "exec", "--json", "--skip-git-repo-check", "-"].map(String::from).to_vec(),
        input: TaskInput::Prompt,
        base_url: harness.openai_base_url.clone(),
        model: model.to_string(),
    };
    (rein, model_sandbox(&harness.openai_base_url, OPENAI_HOST), vec![OPENAI_ROUTE.into()])
}

/// How long `<cli> --version` may take before the CLI counts as broken.
const VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// The oldest version of each agent CLI whose managed pre-tool hook was
/// verified to hold (every call asks the gate, the agent's own settings
/// cannot switch it off, a hook that cannot reach the gate blocks the
/// call): Claude Code 2.1.332 and Codex 0.171.0 (../shared/AGENT-HOOKS.md).
/// An older one may not fail closed, so it is not run.
pub fn verified_minimum(binary: &str) -> Option<[u64; 3]> {
    match binary {
        "claude" => Some([2, 1, 332]),
        "codex" => Some([0, 171, 0]),
        _ => None,
    }
}

/// Whether the version a CLI reported (its first `x.y.z`: `2.1.332 (Claude
/// Code)`, `codex-cli 0.171.0`) is at least `minimum`; why not otherwise,
/// a version that cannot be read included.
pub fn version_at_least(reported: &str, minimum: [u64; 3]) -> Result<(), String> {
    let [a, b, c] = minimum;
    let found = reported.split(|c: char| !(c.is_ascii_digit() || c == '.')).find_map(|word| {
        let mut parts = word.split('.').map(|p| p.parse::<u64>().ok());
        let version = [parts.next()??, parts.next()??, parts.next()??];
        Some(version)
    });
    match found {
        None => Err(format!("its version cannot be read from {reported:?}; {a}.{b}.{c} or later is needed")),
        Some(version) if version < minimum => Err(format!(
            "version {}.{}.{} is older than {a}.{b}.{c}, the oldest whose managed pre-tool hook was verified to \
             fail closed",
            version[0], version[1], version[2]
        )),
        Some(_) => Ok(()),
    }
}

/// What this host has of a harness CLI: usable only when installed where
/// the sandbox can see it (under /usr, bound read-only), when it runs, and
/// when it is no older than its [`verified_minimum`]. The version it
/// reports goes into the reason, so `corral profiles` says what was found
/// (the catalog service adds the last end-to-end success).
pub fn cli_readiness(binary: &str, package: &str) -> Readiness {
    let blocked = |reason: String| Readiness { state: ReadinessState::Blocked, reason, ..Readiness::default() };
    let Some(path) = crate::sandbox::find_on_path(binary) else {
        return blocked(format!("{binary} CLI not found on PATH (install {package})"));
    };
    if !path.starts_with("/usr") {
        return blocked(format!("{binary} at {} is outside /usr and not visible inside the sandbox", path.display()));
    }
    judged(binary, package, &path, cli_version(&path))
}

/// The readiness of CLI `binary` found at `path`, from what its
/// `--version` said (`Err`: it did not run).
fn judged(binary: &str, package: &str, path: &Path, version: Result<String, String>) -> Readiness {
    let blocked = |reason: String| Readiness { state: ReadinessState::Blocked, reason, ..Readiness::default() };
    let version = match version {
        Ok(version) => version,
        Err(why) => return blocked(format!("{binary} at {} does not run: {why}", path.display())),
    };
    if let Some(Err(why)) = verified_minimum(binary).map(|minimum| version_at_least(&version, minimum)) {
        return blocked(format!("{binary} at {}: {why} (install {package})", path.display()));
    }
    Readiness {
        state: ReadinessState::Unverified,
        reason: format!("{version} at {}", path.display()),
        ..Readiness::default()
    }
}

/// [`probe_version`], once per binary per process: a daemon loads its
/// catalog once, and a test process starts many daemons.
fn cli_version(path: &Path) -> Result<String, String> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashMap<PathBuf, Result<String, String>>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Mutex::default);
    if let Some(known) = seen.lock().unwrap_or_else(|e| e.into_inner()).get(path) {
        return known.clone();
    }
    let found = probe_version(path);
    seen.lock().unwrap_or_else(|e| e.into_inner()).insert(path.to_path_buf(), found.clone());
    found
}

/// The first line `<cli> --version` prints, run with a clean environment
/// and no HOME (so it writes no state of its own).
fn probe_version(path: &Path) -> Result<String, String> {
    let mut child = std::process::Command::new(path)
        .arg("--version")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", "/nonexistent")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if started.elapsed() > VERSION_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("--version did not answer within {VERSION_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    if let Some(stdout) = child.stdout.take() {
        use std::io::Read;
        let _ = stdout.take(4096).read_to_string(&mut out);
    }
    let first = out.lines().next().unwrap_or_default().trim().to_string();
    if !status.success() || first.is_empty() {
        return Err(format!("--version exited with {status} and printed {first:?}"));
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cli_older_than_the_verified_hooks_is_refused() {
        let claude = verified_minimum("claude").unwrap();
        let codex = verified_minimum("codex").unwrap();
        assert_eq!(version_at_least("2.1.332 (Claude Code)", claude), Ok(()));
        assert_eq!(version_at_least("2.2.0 (Claude Code)", claude), Ok(()));
        assert_eq!(version_at_least("10.0.1", claude), Ok(()));
        assert_eq!(
            version_at_least("2.1.295 (Claude Code)", claude),
            Err("version 2.1.295 is older than 2.1.332, the oldest whose managed pre-tool hook was verified to \
                 fail closed"
                .into())
        );
        assert_eq!(version_at_least("codex-cli 0.171.0", codex), Ok(()));
        assert!(version_at_least("codex-cli 0.99.9", codex).is_err());
        assert_eq!(
            version_at_least("Claude Code", claude),
            Err("its version cannot be read from \"Claude Code\"; 2.1.332 or later is needed".into())
        );
        assert!(version_at_least("2.1", claude).is_err(), "two numbers are no version");
        assert_eq!(verified_minimum("sh"), None);
        let at = Path::new("/usr/bin/claude");
        let judge = |version: &str| {
            let r = judged("claude", "the npm package x", at, Ok(version.into()));
            (r.state, r.reason)
        };
        assert_eq!(
            judge("2.1.332 (Claude Code)"),
            (ReadinessState::Unverified, "2.1.332 (Claude Code) at /usr/bin/claude".into())
        );
        assert_eq!(
            judge("2.1.200 (Claude Code)"),
            (
                ReadinessState::Blocked,
                "claude at /usr/bin/claude: version 2.1.200 is older than 2.1.332, the oldest whose managed pre-tool \
                 hook was verified to fail closed (install the npm package x)"
                    .into()
            )
        );
        let broken = judged("claude", "x", at, Err("exit 1".into()));
        assert_eq!(
            (broken.state, broken.reason.as_str()),
            (ReadinessState::Blocked, "claude at /usr/bin/claude does not run: exit 1")
        );
        assert_eq!(judged("other", "x", at, Ok("0.0.1".into())).state, ReadinessState::Unverified, "no minimum known");
    }

    #[test]
    fn endpoints_parse_to_exact_allow_entries() {
        let entry = |url: &str| Endpoint::parse(url).map(|e| e.allow_entry());
        assert_eq!(entry("http://127.0.0.1:43117"), Ok("127.0.0.1:43117".into()));
        assert_eq!(entry("http://127.0.0.1:43117/v1"), Ok("127.0.0.1:43117".into()));
        assert_eq!(entry("HTTPS://Gateway.Example.com/anthropic"), Ok("gateway.example.com:443".into()));
        assert_eq!(entry("http://[::1]:8080/v1"), Ok("[::1]:8080".into()));
        for bad in [
            "ftp://a.example",
            "http://",
            "http://u:p@a.example",
            "http://a.example:0",
            "http://a.example:99999",
            "http://a.example/?x=1",
            "http://a b",
            "api.anthropic.com",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    /// A model endpoint gets the model key: https, or plain http only on
    /// loopback, refused at load rather than at every run.
    #[test]
    fn a_model_endpoint_in_clear_is_on_loopback_or_refused() {
        let validate =
            |url: &str| HarnessConfig { anthropic_base_url: url.into(), ..HarnessConfig::default() }.validate();
        assert_eq!(validate("https://10.0.0.5:8443"), Ok(()));
        assert_eq!(validate("http://127.0.0.1:8080"), Ok(()));
        let (key, why) = validate("http://10.0.0.5:8080").unwrap_err();
        assert_eq!(key, "harness.anthropic_base_url");
        assert!(why.contains("must be on loopback"), "{why}");
    }

    #[test]
    fn an_endpoint_replaces_the_vendor_host() {
        let (rein, sandbox, routes) = claude_code(&HarnessConfig::default());
        assert_eq!((rein.base_url.as_str(), sandbox.allow_hosts), ("", vec!["api.anthropic.com".to_string()]));
        assert_eq!(routes, ["anthropic"]);
        let harness = HarnessConfig {
            openai_base_url: "https://10.1.2.3:8080/v1".into(),
            openai_model: "m-1".into(),
            ..HarnessConfig::default()
        };
        let (rein, sandbox, routes) = codex(&harness);
        assert_eq!((rein.base_url.as_str(), rein.model.as_str()), ("https://10.1.2.3:8080/v1", "m-1"));
        assert_eq!(sandbox.allow_hosts, ["10.1.2.3:8080"]);
        assert_eq!(routes, ["openai"]);
        assert_eq!(codex(&HarnessConfig::default()).0.model, CODEX_DEFAULT_MODEL);
    }

    #[test]
    fn harness_config_errors_name_the_key() {
        let bad = HarnessConfig { openai_base_url: "file:///etc".into(), ..HarnessConfig::default() };
        assert_eq!(bad.validate().unwrap_err().0, "harness.openai_base_url");
        let bad = HarnessConfig { anthropic_model: "a\"b".into(), ..HarnessConfig::default() };
        assert_eq!(bad.validate().unwrap_err().0, "harness.anthropic_model");
        assert!(HarnessConfig::default().validate().is_ok());
    }

    #[test]
    fn a_missing_cli_is_blocked_with_the_package_to_install() {
        let readiness = cli_readiness("no-such-cli-for-corral", "the npm package @x/y");
        assert_eq!(readiness.state, ReadinessState::Blocked);
        assert!(readiness.reason.contains("install the npm package @x/y"), "{}", readiness.reason);
    }
}
