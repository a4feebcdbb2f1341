//! Profiles the daemon knows with no files: a shell runner for scripted
//! tasks and demos, a no-op for benchmarks, and presets for real harnesses.

use super::profile::{Limits, Preset, ProfileFile, ProfileStatus, Readiness, ReadinessState, ReinSpec, TaskInput};
use crate::sandbox::{SandboxSpec, SandboxType};

fn isolated() -> SandboxSpec {
    SandboxSpec::default()
}

fn with_network(env: &[&str], hosts: &[&str]) -> SandboxSpec {
    SandboxSpec {
        sandbox_type: SandboxType::LinuxBwrap,
        allow_network: true,
        allow_hosts: hosts.iter().map(|s| s.to_string()).collect(),
        write_paths: vec![".".into()],
        read_paths: Vec::new(),
        env_passthrough: env.iter().map(|s| s.to_string()).collect(),
    }
}

fn file(id: &str, description: &str, rein: ReinSpec, sandbox: SandboxSpec, readiness: Readiness) -> ProfileFile {
    ProfileFile {
        id: id.into(),
        version: "1.0.0".into(),
        status: ProfileStatus::Enabled,
        description: description.into(),
        readiness,
        rein,
        sandbox,
        limits: Limits::default(),
        credential_route_refs: Vec::new(),
        guardrails: Default::default(),
        git: Default::default(),
    }
}

/// A harness CLI preset is usable only when its binary is installed where
/// the sandbox can see it (under /usr, which is bound read-only).
fn cli_readiness(binary: &str, package: &str) -> Readiness {
    match crate::sandbox::find_on_path(binary) {
        Some(path) if path.starts_with("/usr") => Readiness {
            state: ReadinessState::Unverified,
            reason: format!("{binary} found at {}; not verified end to end by this daemon", path.display()),
            ..Readiness::default()
        },
        Some(path) => Readiness {
            state: ReadinessState::Blocked,
            reason: format!("{binary} at {} is outside /usr and not visible inside the sandbox", path.display()),
            ..Readiness::default()
        },
        None => Readiness {
            state: ReadinessState::Blocked,
            reason: format!("{binary} CLI not found on PATH (install {package})"),
            ..Readiness::default()
        },
    }
}

pub fn builtin_profiles() -> Vec<ProfileFile> {
    vec![
        file(
            "builtin.shell",
            "The task description is a shell script, fed on stdin to `sh -s` in a bwrap sandbox without network.",
            ReinSpec {
                kind: "command".into(),
                preset: Preset::Protocol,
                argv: vec!["/bin/sh".into(), "-s".into()],
                input: TaskInput::Description,
            },
            isolated(),
            Readiness::default(),
        ),
        file(
            "builtin.noop",
            "Runs /usr/bin/true in a bwrap sandbox without network: the floor for benchmarks.",
            ReinSpec {
                kind: "command".into(),
                preset: Preset::Protocol,
                argv: vec!["/usr/bin/true".into()],
                input: TaskInput::Nothing,
            },
            isolated(),
            Readiness::default(),
        ),
        file(
            "builtin.noop-net",
            "Runs /usr/bin/true in a bwrap sandbox whose egress goes through the daemon's proxy (nothing allowed): \
             the floor for the proxy's set-up cost.",
            ReinSpec {
                kind: "command".into(),
                preset: Preset::Protocol,
                argv: vec!["/usr/bin/true".into()],
                input: TaskInput::Nothing,
            },
            with_network(&[], &[]),
            Readiness::default(),
        ),
        file(
            "builtin.claude-code",
            "Claude Code in print mode with stream-json output; the prompt goes on stdin.",
            ReinSpec {
                kind: "command".into(),
                preset: Preset::ClaudeStreamJson,
                argv: ["claude", "-p", "--output-format", "stream-json", "--verbose"].map(String::from).to_vec(),
                input: TaskInput::Prompt,
            },
            with_network(&["ANTHROPIC_API_KEY"], &["api.anthropic.com"]),
            cli_readiness("claude", "the npm package @anthropic-ai/claude-code"),
        ),
        file(
            "builtin.codex",
            "Codex `exec --json`; the prompt goes on stdin.",
            ReinSpec {
                kind: "command".into(),
                preset: Preset::CodexExecJson,
                argv: ["codex", "exec", "--json", "-"].map(String::from).to_vec(),
                input: TaskInput::Prompt,
            },
            with_network(&["OPENAI_API_KEY"], &["api.openai.com", "chatgpt.com"]),
            cli_readiness("codex", "the npm package @openai/codex"),
        ),
    ]
}
