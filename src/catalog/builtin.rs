//! Profiles the daemon knows with no files: a shell runner for scripted
//! tasks and demos, a no-op for benchmarks, and presets for real harnesses.

use super::agents::{self, HarnessConfig};
use super::profile::{Limits, Preset, ProfileFile, ProfileStatus, Readiness, ReinSpec, TaskInput};
use crate::sandbox::{SandboxSpec, SandboxType};

fn isolated() -> SandboxSpec {
    SandboxSpec::default()
}

fn with_network(hosts: &[&str]) -> SandboxSpec {
    SandboxSpec {
        sandbox_type: SandboxType::LinuxBwrap,
        allow_network: true,
        allow_hosts: hosts.iter().map(|s| s.to_string()).collect(),
        write_paths: vec![".".into()],
        read_paths: Vec::new(),
        env_passthrough: Vec::new(),
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
        placement: Default::default(),
    }
}

/// A command rein with corral's own protocol.
fn command(argv: &[&str], input: TaskInput) -> ReinSpec {
    ReinSpec {
        kind: "command".into(),
        preset: Preset::Protocol,
        argv: argv.iter().map(|s| s.to_string()).collect(),
        input,
        base_url: String::new(),
        model: String::new(),
    }
}

/// A real agent CLI: its rein, sandbox and credential routes come from
/// [`agents`], pointed where `[harness]` says.
fn agent(
    id: &str,
    description: &str,
    parts: (ReinSpec, SandboxSpec, Vec<String>),
    readiness: Readiness,
) -> ProfileFile {
    let (rein, sandbox, routes) = parts;
    ProfileFile { credential_route_refs: routes, ..file(id, description, rein, sandbox, readiness) }
}

pub fn builtin_profiles(harness: &HarnessConfig) -> Vec<ProfileFile> {
    vec![
        file(
            "builtin.shell",
            "The task description is a shell script, fed on stdin to `sh -s` in a bwrap sandbox without network.",
            command(&["/bin/sh", "-s"], TaskInput::Description),
            isolated(),
            Readiness::default(),
        ),
        file(
            "builtin.noop",
            "Runs /usr/bin/true in a bwrap sandbox without network: the floor for benchmarks.",
            command(&["/usr/bin/true"], TaskInput::Nothing),
            isolated(),
            Readiness::default(),
        ),
        file(
            "builtin.noop-net",
            "Runs /usr/bin/true in a bwrap sandbox whose egress goes through the daemon's proxy (nothing allowed): \
             the floor for the proxy's set-up cost.",
            command(&["/usr/bin/true"], TaskInput::Nothing),
            with_network(&[]),
            Readiness::default(),
        ),
        agent(
            "builtin.claude-code",
            "Claude Code in print mode with stream-json output, edits accepted and an explicit tool allowlist; \
             the prompt goes on stdin, the key comes from the `anthropic` credential route.",
            agents::claude_code(harness),
            agents::cli_readiness("claude", "the npm package @anthropic-ai/claude-code"),
        ),
        agent(
            "builtin.codex",
            "Codex `exec --json` with a model provider written by the daemon; the prompt goes on stdin, the key \
             comes from the `openai` credential route.",
            agents::codex(harness),
            agents::cli_readiness("codex", "the npm package @openai/codex"),
        ),
    ]
}
