//! The harness profile: its TOML format and its validated, in-memory form.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::policy::{compile_all, Policy, PolicySpec};
use crate::sandbox::workspace::{check_env_name, check_no_private_keys, check_sandbox_path};
use crate::sandbox::{SandboxSpec, SandboxType};
pub use crate::types::{Readiness, ReadinessState};

/// Whether a profile may run at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileStatus {
    /// It resolves (unless unusable or blocked).
    #[default]
    Enabled,
    /// It is listed but every resolution is refused.
    Disabled,
}

/// How the harness's stdout maps to the JSON-lines protocol.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// corral's own protocol: progress, tool_use and result lines.
    #[default]
    Protocol,
    /// Claude Code `--output-format stream-json`.
    ClaudeStreamJson,
    /// Codex `exec --json`.
    CodexExecJson,
}

/// Claude Code's managed (administrator) settings file, where corral puts
/// its pre-tool hook.
pub const CLAUDE_MANAGED_SETTINGS: &str = "/etc/claude-code/managed-settings.json";
/// Codex's administrator requirements file, where corral puts its pre-tool
/// hook.
pub const CODEX_REQUIREMENTS: &str = "/etc/codex/requirements.toml";
/// Where the hook helper is bound inside the sandbox (read-only; the corral
/// binary, which runs as the helper when started under this name).
pub const HELPER_PATH: &str = "/etc/corral/corral-gate-hook";

impl Preset {
    /// The files inside the sandbox that make up corral's managed pre-tool
    /// hook for this preset (`gate::hook::managed_files` binds them); none
    /// for corral's own protocol, whose harness asks the gate itself.
    pub fn managed_hook_paths(self) -> &'static [&'static str] {
        match self {
            Preset::Protocol => &[],
            Preset::ClaudeStreamJson => &[CLAUDE_MANAGED_SETTINGS],
            Preset::CodexExecJson => &[CODEX_REQUIREMENTS, HELPER_PATH],
        }
    }
}

/// What the harness gets on stdin. Never on the command line: `/proc`
/// shows command lines to every user of the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskInput {
    /// One JSON object: `{"type":"task", "title", "description", ...}`.
    #[default]
    TaskJson,
    /// The description as-is (e.g. a shell script for `sh -s`).
    Description,
    /// Title and description as a plain prompt (Claude Code, Codex).
    Prompt,
    /// Nothing; stdin is closed at once.
    Nothing,
}

/// How the harness is started: the `[rein]` section of a profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReinSpec {
    /// The rein; only `command` (the default) exists.
    #[serde(default = "default_rein_kind")]
    pub kind: String,
    /// How its stdout is read.
    #[serde(default)]
    pub preset: Preset,
    /// The program and its arguments, run inside the sandbox.
    pub argv: Vec<String>,
    /// What it gets on stdin.
    #[serde(default)]
    pub input: TaskInput,
    /// For the `claude_stream_json` and `codex_exec_json` presets: the model
    /// API the CLI is pointed at, `http(s)://host[:port][/path]`; its
    /// `host:port` must be in `sandbox.allow_hosts`. Empty: the vendor's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub base_url: String,
    /// The model the CLI asks for; empty: the CLI's own default.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
}

impl ReinSpec {
    /// Whether a session of this harness can take turn after turn: a
    /// protocol harness reading task lines, or Claude Code / Codex, which
    /// run once per turn and resume their own conversation.
    pub fn takes_turns(&self) -> bool {
        self.input == TaskInput::TaskJson || self.resumes()
    }

    /// Claude Code or Codex taking its prompt on stdin: each turn of a
    /// session is a new run of the CLI resuming the conversation.
    pub fn resumes(&self) -> bool {
        matches!(self.preset, Preset::ClaudeStreamJson | Preset::CodexExecJson) && self.input == TaskInput::Prompt
    }

    /// Why the harness's own tool calls cannot pass the tool_call gate
    /// before they run in a sandbox of type `sandbox`; `None` when they
    /// can. A policy that governs tool calls is then refused at
    /// agent_start rather than silently ignored.
    pub fn tool_calls_ungated(&self, sandbox: SandboxType) -> Option<String> {
        match (self.preset, self.input) {
            // The harness asks with `policy_request` and waits for the
            // verdict on the task channel.
            (Preset::Protocol, TaskInput::TaskJson) => None,
            (Preset::Protocol, input) => {
                let input = match input {
                    TaskInput::Description => "description",
                    TaskInput::Prompt => "prompt",
                    TaskInput::Nothing | TaskInput::TaskJson => "nothing",
                };
                Some(format!(
                    "the harness gets its task as input = \"{input}\", so it has no channel to ask the gate \
                     before a tool runs (a protocol harness needs input = \"task_json\")"
                ))
            }
            // Their managed pre-tool hook asks the gate endpoint in the
            // sandbox's own network namespace (see `gate`).
            (Preset::ClaudeStreamJson | Preset::CodexExecJson, _) if sandbox == SandboxType::LinuxBwrap => None,
            (Preset::ClaudeStreamJson, _) => Some(
                "Claude Code's tool calls reach corral's gate through a managed hook that only a linux_bwrap \
                 sandbox can carry"
                    .into(),
            ),
            (Preset::CodexExecJson, _) => Some(
                "Codex's tool calls reach corral's gate through a managed hook that only a linux_bwrap sandbox \
                 can carry"
                    .into(),
            ),
        }
    }
}

fn default_rein_kind() -> String {
    "command".into()
}

/// What a run may use. Every non-zero limit is enforced, by the mechanism
/// the enforcement receipt names; a limit this host cannot enforce makes the
/// gate refuse the run (fail closed). 0 means "not limited", and must be
/// written out: a key a profile leaves out takes the daemon's
/// `[default_limits]`, and a key that leaves out takes [`Limits::default`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// How long one dispatch (an execution's run, a session's turn) may
    /// take, in seconds; 0 and more than ten years are refused.
    pub timeout_seconds: u64,
    /// Per stream (stdout, stderr; a `result` line's output too); bytes
    /// past it are dropped and reported. 0 is refused: the daemon keeps the
    /// output in memory until the run ends.
    pub max_output_bytes: u64,
    /// Tasks (processes and threads) alive at once: the cgroup's pids.max
    /// (RLIMIT_NPROC of its own host uid for a sandbox without a cgroup).
    pub max_processes: u64,
    /// Memory (RSS, page cache, /tmp and /dev/shm) of the whole sandbox: its cgroup.
    pub memory_bytes: u64,
    /// CPU time in millicores (1000 = one CPU): the cgroup's CPU quota.
    pub cpu_millis: u64,
    /// Bytes under the sandbox's own directory (the workspace, HOME and,
    /// for `none`, its TMPDIR), checked while the harness runs and at the
    /// end (exceeding it fails the run); also the largest file (RLIMIT_FSIZE).
    pub max_workspace_bytes: u64,
    /// Files, directories and links under the same tree (a million empty
    /// files cost the host inodes, not bytes): the same watch and the same cut.
    pub max_workspace_inodes: u64,
    /// RLIMIT_NOFILE.
    pub max_open_files: u64,
    /// RLIMIT_AS. Virtual address space, not memory: Node-based harnesses
    /// reserve far more than they use, so prefer `memory_bytes`.
    pub address_space_bytes: u64,
    /// Size of the sandbox's private /tmp (tmpfs; `linux_bwrap`). A `none`
    /// sandbox has no /tmp of its own: its TMPDIR lies under its directory,
    /// which `max_workspace_bytes` bounds, and /tmp is the host's.
    pub tmp_bytes: u64,
    /// Size of the sandbox's private /dev/shm (tmpfs; `linux_bwrap`).
    pub shm_bytes: u64,
    /// Events one run may record; past it progress is dropped and one
    /// `limit` event says so.
    pub max_events: u64,
    /// Bytes of harness-supplied event text (progress, tool names) one run
    /// may record; the same cut as `max_events`.
    pub max_event_bytes: u64,
}

/// The built-in defaults, for every profile and every key the profile and
/// the daemon's `[default_limits]` leave out. Sized for one coding agent
/// (a Node CLI, git, a test run of a mid-sized project) on a shared host,
/// so that a handful of runs side by side cannot take the host down:
/// - memory 2 GiB: Claude Code or Codex plus a compiler or test runner fit;
///   a runaway allocation is cut long before it starves the host.
/// - 512 tasks (processes and threads): a build with `-j` and a Node
///   runtime's threads stay far below; a fork bomb stops there.
/// - 2 CPUs (2000 millicores): a run is never starved, and no single run
///   takes every core of a small host.
/// - workspace 2 GiB and 200,000 inodes: a clone of a large repository
///   with its dependencies installed (node_modules runs to ~100k files).
/// - /tmp 256 MiB and /dev/shm 64 MiB (Docker's /dev/shm size): both are
///   tmpfs, so their pages count against `memory_bytes` as well.
pub const DEFAULT_MEMORY_BYTES: u64 = 2 << 30;
pub const DEFAULT_MAX_PROCESSES: u64 = 512;
pub const DEFAULT_CPU_MILLIS: u64 = 2000;
pub const DEFAULT_WORKSPACE_BYTES: u64 = 2 << 30;
/// The default `max_workspace_inodes` (see above).
pub const DEFAULT_WORKSPACE_INODES: u64 = 200_000;
/// The default `shm_bytes`, in bytes (see above).
pub const DEFAULT_SHM_BYTES: u64 = 64 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout_seconds: 600,
            max_output_bytes: 4 << 20,
            max_processes: DEFAULT_MAX_PROCESSES,
            memory_bytes: DEFAULT_MEMORY_BYTES,
            cpu_millis: DEFAULT_CPU_MILLIS,
            max_workspace_bytes: DEFAULT_WORKSPACE_BYTES,
            max_workspace_inodes: DEFAULT_WORKSPACE_INODES,
            max_open_files: 0,
            address_space_bytes: 0,
            tmp_bytes: 256 << 20,
            shm_bytes: DEFAULT_SHM_BYTES,
            max_events: 100_000,
            max_event_bytes: 32 << 20,
        }
    }
}

impl Limits {
    /// The `[limits]` of a profile file over `defaults`: every key the
    /// table sets wins, every other key is the default's. Unknown keys and
    /// wrong types stay errors (the merged table is deserialized strictly).
    pub fn merge_table(defaults: &Limits, table: Option<&toml::Value>) -> Result<toml::Value, String> {
        let mut merged = toml::Value::try_from(defaults).map_err(|e| format!("default limits: {e}"))?;
        if let (Some(toml::Value::Table(set)), toml::Value::Table(out)) = (table, &mut merged) {
            for (key, value) in set {
                out.insert(key.clone(), value.clone());
            }
        } else if let Some(other) = table {
            return Err(format!("limits: expected a table, found {}", other.type_str()));
        }
        Ok(merged)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Guardrails {
    pub policies: Vec<PolicySpec>,
}

impl Limits {
    /// The limits the sandbox itself enforces.
    pub fn sandbox(&self) -> crate::sandbox::SandboxLimits {
        crate::sandbox::SandboxLimits {
            memory_bytes: self.memory_bytes,
            max_processes: self.max_processes,
            cpu_millis: self.cpu_millis,
            max_open_files: self.max_open_files,
            address_space_bytes: self.address_space_bytes,
            // No single file may be larger than the whole workspace may be.
            max_file_bytes: self.max_workspace_bytes,
            max_workspace_bytes: self.max_workspace_bytes,
            max_workspace_inodes: self.max_workspace_inodes,
            tmp_bytes: self.tmp_bytes,
            shm_bytes: self.shm_bytes,
        }
    }
}

/// The git identities of a run: the harness's own (`GIT_AUTHOR_*` and
/// `GIT_COMMITTER_*` in its environment, so its `git commit` works), and
/// the daemon's for snapshots of uncommitted work.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GitSettings {
    /// The harness's commit author and committer name.
    pub author_name: String,
    /// The harness's commit author and committer email.
    pub author_email: String,
    /// Commit what the agent left uncommitted at the end (in the sandbox),
    /// so `refs/corral/<id>` holds it.
    pub snapshot: bool,
    /// The author name of a snapshot commit.
    pub snapshot_name: String,
    /// The author email of a snapshot commit.
    pub snapshot_email: String,
}

impl Default for GitSettings {
    fn default() -> Self {
        GitSettings {
            author_name: "corral agent".into(),
            author_email: "agent@corral.invalid".into(),
            snapshot: true,
            snapshot_name: "corral".into(),
            snapshot_email: "corral@localhost".into(),
        }
    }
}

impl GitSettings {
    /// The `(name, email)` a snapshot commit is made with.
    pub fn snapshot_identity(&self) -> (String, String) {
        (self.snapshot_name.clone(), self.snapshot_email.clone())
    }

    /// The harness's git identity as environment variables.
    pub fn author_env(&self) -> Vec<(String, String)> {
        let (name, email) = (&self.author_name, &self.author_email);
        [
            ("GIT_AUTHOR_NAME", name),
            ("GIT_AUTHOR_EMAIL", email),
            ("GIT_COMMITTER_NAME", name),
            ("GIT_COMMITTER_EMAIL", email),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
    }
}

/// The longest profile id.
pub const MAX_ID: usize = 128;

/// A profile id: 1 to [`MAX_ID`] letters, digits, '.', '_' and '-'. The
/// same rule for a profile file and for a reference in a request.
pub fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID || !id.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
        return Err(format!("must be 1-{MAX_ID} letters, digits, '.', '_' and '-'"));
    }
    Ok(())
}

/// A reference to a profile: `id`, or `id@version` with a semver version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRef {
    /// The profile id.
    pub id: String,
    /// The pinned version; `None` when the reference names only the id.
    pub version: Option<semver::Version>,
}

impl ProfileRef {
    /// Parses a reference; the error says what is wrong without repeating it.
    pub fn parse(text: &str) -> Result<ProfileRef, String> {
        let (id, version) = match text.split_once('@') {
            Some((id, version)) => (id, Some(version)),
            None => (text, None),
        };
        check_id(id).map_err(|e| format!("use `id` or `id@version`: the id {e}"))?;
        let version = match version {
            None => None,
            Some(v) => {
                let version = semver::Version::parse(v)
                    .map_err(|e| format!("use `id` or `id@version`: {v:?} is not semver: {e}"))?;
                check_no_build(&version).map_err(|e| format!("use `id` or `id@version`: {e}"))?;
                Some(version)
            }
        };
        Ok(ProfileRef { id: id.to_string(), version })
    }
}

/// A version with build metadata (`1.0.0+a`) is refused: semver gives it no
/// precedence, so `1.0.0+a` and `1.0.0+b` would both load as different
/// profiles that `id@1.0.0` names neither of.
fn check_no_build(version: &semver::Version) -> Result<(), String> {
    if version.build.is_empty() {
        return Ok(());
    }
    Err(format!(
        "\"{version}\" has build metadata (+{}), which semver ignores when it compares versions: drop it",
        version.build
    ))
}

/// A profile file exactly as written in TOML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    /// Letters, digits, '.', '_' and '-', at most `MAX_ID` (128) of them.
    pub id: String,
    /// A semver version; one id may have several.
    pub version: String,
    /// A disabled profile is listed but never runs.
    #[serde(default)]
    pub status: ProfileStatus,
    /// Free text shown in listings.
    #[serde(default)]
    pub description: String,
    /// Whether it is known to work; a blocked one never runs.
    #[serde(default)]
    pub readiness: Readiness,
    /// How the harness is started.
    pub rein: ReinSpec,
    /// The sandbox it asks for (the gate may only tighten it).
    #[serde(default)]
    pub sandbox: SandboxSpec,
    /// What one run may use; keys left out take the daemon's `[default_limits]`.
    #[serde(default)]
    pub limits: Limits,
    /// Names of the daemon's `[credentials.routes]` the harness may use; an
    /// unknown name makes the profile unusable.
    #[serde(default)]
    pub credential_route_refs: Vec<String>,
    /// The profile's own policies, evaluated after the session's.
    #[serde(default)]
    pub guardrails: Guardrails,
    /// Git identities and the end-of-run snapshot.
    #[serde(default)]
    pub git: GitSettings,
    /// Which nodes may run it (a fleet): labels a node must have besides
    /// the ones its backend and CLI need.
    #[serde(default, skip_serializing_if = "Placement::is_empty")]
    pub placement: Placement,
}

/// The `[placement]` section of a profile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// Labels every node that runs it must have (`[fleet] labels`).
    #[serde(default)]
    pub labels: Vec<String>,
}

impl Placement {
    fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// A node label: 1-64 lowercase letters, digits, `.`, `_` or `-`.
pub fn check_label(label: &str) -> Result<(), String> {
    let ok = !label.is_empty()
        && label.len() <= 64
        && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!("{label:?} must be 1-64 lowercase letters, digits, '.', '_' or '-'"))
    }
}

/// A validated profile.
#[derive(Clone, Debug)]
pub struct Profile {
    /// The file as parsed.
    pub file: ProfileFile,
    /// Its version, parsed.
    pub version: semver::Version,
    /// `guardrails.policies`, compiled.
    pub policies: Vec<Policy>,
    /// sha256 of the profile's canonical JSON form.
    pub digest: String,
    /// The file it came from, or `builtin`.
    pub source: String,
    /// Why it cannot run, though it parsed (e.g. an unknown credential route).
    pub unusable: Option<String>,
}

/// The smallest `cpu_millis` a cgroup can enforce: CFS takes no quota
/// below 1000 µs a period, which at the 100 ms period is 10 millicores.
pub const MIN_CPU_MILLIS: u64 = 10;

/// `cpu_millis` is 0 (not limited) or at least [`MIN_CPU_MILLIS`]: a smaller
/// quota loads and then fails every run at `sandbox_create`. The caller
/// names the key.
pub fn check_cpu_millis(cpu_millis: u64) -> Result<(), String> {
    if (1..MIN_CPU_MILLIS).contains(&cpu_millis) {
        return Err(format!(
            "{cpu_millis} is below the {MIN_CPU_MILLIS} millicores a cgroup can enforce (0 = not limited)"
        ));
    }
    Ok(())
}

/// A model name is written into a CLI's config and environment: plain
/// characters only.
pub fn check_model(model: &str) -> Result<(), String> {
    let ok = model.len() <= 200 && model.chars().all(|c| c.is_ascii_alphanumeric() || "._-:/@[]".contains(c));
    if ok {
        Ok(())
    } else {
        Err(format!("{model:?} must be at most 200 letters, digits or ._-:/@[]"))
    }
}

/// A `rein.base_url` must belong to a CLI preset, be reachable through
/// the sandbox's egress allowlist and, when the profile names credential
/// routes, not be plain http beyond loopback; `rein.model` must be plain
/// text.
fn check_endpoint(
    rein: &ReinSpec,
    sandbox: &crate::sandbox::SandboxSpec,
    hosts: Vec<crate::net::HostPattern>,
    routes: &[String],
) -> Result<(), String> {
    check_model(&rein.model).map_err(|e| format!("rein.model: {e}"))?;
    // A protocol harness is never told a model: accepted, it would be
    // recorded as the run's model though the harness never got it.
    if rein.preset == Preset::Protocol && !rein.model.is_empty() {
        return Err("rein.model: only for the claude_stream_json and codex_exec_json presets".into());
    }
    if rein.base_url.is_empty() {
        return Ok(());
    }
    if rein.preset == Preset::Protocol {
        return Err("rein.base_url: only for the claude_stream_json and codex_exec_json presets".into());
    }
    let endpoint = crate::net::Endpoint::parse(&rein.base_url).map_err(|e| format!("rein.base_url: {e}"))?;
    // A model key goes there (by the gateway, or the harness itself when
    // exposed): never in clear beyond loopback. A profile without routes
    // has no key to send (a keyless model server on the LAN).
    if !routes.is_empty() {
        crate::net::client::secret_origin(&rein.base_url).map_err(|e| format!("rein.base_url: {e}"))?;
    }
    let allowed = sandbox.allow_network
        && matches!(
            crate::net::Allowlist::new(hosts).check_name(&endpoint.host, endpoint.port),
            crate::net::Verdict::Allow { .. }
        );
    if !allowed {
        return Err(format!(
            "rein.base_url: {} is not reachable: set sandbox.allow_network and add it to sandbox.allow_hosts",
            endpoint.allow_entry()
        ));
    }
    Ok(())
}

/// The most read and write paths one profile's sandbox binds.
const MAX_BOUND_PATHS: usize = 32;

/// A profile whose harness gets corral's managed pre-tool hook (Claude
/// Code, Codex) must not bind a host path over it: its read and write
/// paths are mounted into the same tree, and one that covers a hook file
/// (`/`, `/etc`, `/etc/codex`) or lies in a hook file's directory
/// (`/etc/codex/...`) would hide the hook or let the agent change what the
/// CLI reads there, while the profile still counts as gated. Refused for
/// every sandbox type: an `enforce_sandbox` policy can upgrade `none` to
/// `linux_bwrap`, which carries the hook. Relative write paths are inside
/// the workspace. Nor may a path show the sandbox the host's private keys.
fn check_bound_paths(rein: &ReinSpec, sandbox: &SandboxSpec) -> Result<(), String> {
    let files = rein.preset.managed_hook_paths();
    for (key, paths) in [("sandbox.read_paths", &sandbox.read_paths), ("sandbox.write_paths", &sandbox.write_paths)] {
        for (i, path) in paths.iter().enumerate() {
            let bound = Path::new(path);
            if !bound.is_absolute() {
                continue;
            }
            for file in files {
                let inside = Path::new(file);
                let dir = inside.parent().unwrap_or(inside);
                let how = if inside.starts_with(bound) {
                    "covers"
                } else if bound.starts_with(dir) {
                    "lies inside"
                } else {
                    continue;
                };
                return Err(format!(
                    "{key}[{i}]: {path:?} {how} {}, where corral binds the managed hook that sends every tool \
                     call of this harness to the gate ({}): a bind there would hide the hook or let the agent \
                     change it, and the tool_call gate would be bypassed",
                    dir.display(),
                    file
                ));
            }
            // Never the host's private keys (the hook's reason first, where both hold).
            check_no_private_keys(path).map_err(|e| format!("{key}[{i}]: {e}"))?;
        }
    }
    Ok(())
}

/// Who and what a run is for, as the agent_start gate sees it.
pub struct RunFacts<'a> {
    /// The caller's consumer type (`adm`, `agt` or `atm`).
    pub actor: &'a str,
    /// The project the run is for.
    pub project: &'a str,
    /// The repository path the run works on; empty when there is none.
    pub repo: &'a str,
    /// Tool calls already allowed in the run.
    pub tool_calls: u64,
    /// The session's policies, evaluated first.
    pub session_policies: &'a [Policy],
    /// Where the run's principal may write on the host.
    pub host_writes: crate::policy::HostWrites<'a>,
}

impl Profile {
    /// The labels a node must have to run this profile (see
    /// `fleet::labels`): its sandbox backend and its agent CLI.
    pub fn needs(&self) -> Vec<String> {
        let mut needs = Vec::new();
        if self.file.sandbox.sandbox_type == crate::sandbox::SandboxType::LinuxBwrap {
            needs.push("linux_bwrap".to_string());
        }
        match self.file.rein.preset {
            Preset::ClaudeStreamJson => needs.push("claude".to_string()),
            Preset::CodexExecJson => needs.push("codex".to_string()),
            Preset::Protocol => {}
        }
        for label in &self.file.placement.labels {
            if !needs.contains(label) {
                needs.push(label.clone());
            }
        }
        needs
    }

    /// The agent_start gate's decision on running this profile for
    /// `facts`: the one place that input is built (a run's start, a
    /// restart, and `EvaluateGate`'s dry run, so the dry run and the real
    /// run cannot disagree).
    pub fn gate_agent_start(&self, gate: &crate::policy::Gate, facts: RunFacts<'_>) -> crate::policy::GateOutcome {
        let profile_ref = self.reference();
        let limits = self.file.limits.sandbox();
        // Judged on the sandbox the policies leave: one may upgrade `none`.
        let (in_bwrap, in_none) = (
            self.file.rein.tool_calls_ungated(SandboxType::LinuxBwrap),
            self.file.rein.tool_calls_ungated(SandboxType::None),
        );
        gate.evaluate(&crate::policy::GateInput {
            phase: crate::policy::Phase::AgentStart,
            profile_ref: &profile_ref,
            actor: facts.actor,
            project: facts.project,
            repo: facts.repo,
            sandbox: &self.file.sandbox,
            limits: &limits,
            timeout_seconds: self.file.limits.timeout_seconds,
            tool: "",
            arguments: &serde_json::Value::Null,
            tool_calls: facts.tool_calls,
            session_policies: facts.session_policies,
            profile_policies: &self.policies,
            ungated_tool_calls: crate::policy::Ungated { in_bwrap: in_bwrap.as_deref(), in_none: in_none.as_deref() },
            host_writes: facts.host_writes,
        })
    }

    /// Validates a parsed profile; errors name the offending key.
    pub fn from_file(file: ProfileFile, source: String) -> Result<Profile, String> {
        check_id(&file.id).map_err(|e| format!("id: {:?} {e}", file.id))?;
        let version = semver::Version::parse(&file.version)
            .map_err(|e| format!("version: {:?} is not semver: {e}", file.version))?;
        check_no_build(&version).map_err(|e| format!("version: {e}"))?;
        if file.rein.kind != "command" {
            return Err(format!("rein.kind: unknown rein {:?} (known: command)", file.rein.kind));
        }
        if file.rein.argv.is_empty() || file.rein.argv[0].is_empty() {
            return Err("rein.argv: must name a program".into());
        }
        if file.limits.timeout_seconds == 0 {
            return Err("limits.timeout_seconds: must be greater than 0".into());
        }
        crate::types::at_most_ten_years(file.limits.timeout_seconds)
            .map_err(|e| format!("limits.timeout_seconds: {e}"))?;
        // The daemon keeps a run's output in memory until the run ends.
        for (key, value) in [
            ("limits.max_output_bytes", file.limits.max_output_bytes),
            ("limits.tmp_bytes", file.limits.tmp_bytes),
            ("limits.shm_bytes", file.limits.shm_bytes),
            ("limits.max_events", file.limits.max_events),
            ("limits.max_event_bytes", file.limits.max_event_bytes),
        ] {
            if value == 0 {
                return Err(format!("{key}: must be greater than 0"));
            }
        }
        check_cpu_millis(file.limits.cpu_millis).map_err(|e| format!("limits.cpu_millis: {e}"))?;
        if !file.sandbox.allow_network && !file.sandbox.allow_hosts.is_empty() {
            return Err("sandbox.allow_hosts: set, but allow_network = false: no egress at all would reach them \
                        (set allow_network = true, or leave allow_hosts out)"
                .into());
        }
        // A none sandbox leaves its whole workspace writable: a relative
        // write path other than "." (or none at all) would narrow what it
        // cannot narrow.
        if file.sandbox.sandbox_type == SandboxType::None {
            // Nor can it bind a host path: its uid writes wherever the
            // host's permissions let it, and nowhere else, whatever a
            // write path says.
            if let Some((i, path)) = file.sandbox.write_paths.iter().enumerate().find(|(_, p)| p.starts_with('/')) {
                return Err(format!(
                    "sandbox.write_paths[{i}]: {path}: a none sandbox binds no host path (its uid writes wherever \
                     the host's permissions let it, and nowhere they do not); use linux_bwrap"
                ));
            }
            let mut relative = file.sandbox.write_paths.iter().filter(|p| !p.starts_with('/'));
            if !relative.clone().any(|p| p == ".") || relative.any(|p| p != ".") {
                return Err("sandbox.write_paths: a none sandbox leaves its whole workspace writable and cannot \
                            narrow it: list \".\" as its only write path, or use linux_bwrap"
                    .into());
            }
        }
        for (key, paths) in
            [("sandbox.read_paths", &file.sandbox.read_paths), ("sandbox.write_paths", &file.sandbox.write_paths)]
        {
            for (i, path) in paths.iter().enumerate() {
                check_sandbox_path(path).map_err(|e| format!("{key}[{i}]: {e}"))?;
            }
        }
        for (i, name) in file.sandbox.env_passthrough.iter().enumerate() {
            check_env_name(name).map_err(|e| format!("sandbox.env_passthrough[{i}]: {e}"))?;
        }
        for (key, value) in [
            ("git.author_name", &file.git.author_name),
            ("git.author_email", &file.git.author_email),
            ("git.snapshot_name", &file.git.snapshot_name),
            ("git.snapshot_email", &file.git.snapshot_email),
        ] {
            if value.is_empty() || value.len() > 200 || value.chars().any(|c| c.is_control() || "<>".contains(c)) {
                return Err(format!("{key}: {value:?} must be 1-200 characters without control characters or <>"));
            }
        }
        let hosts =
            crate::net::parse_hosts(&file.sandbox.allow_hosts).map_err(|e| format!("sandbox.allow_hosts: {e}"))?;
        check_endpoint(&file.rein, &file.sandbox, hosts, &file.credential_route_refs)?;
        for path in &file.sandbox.read_paths {
            if !path.starts_with('/') {
                return Err(format!("sandbox.read_paths: {path:?} must be absolute"));
            }
        }
        check_bound_paths(&file.rein, &file.sandbox)?;
        // Each bound path is a descriptor bwrap is passed (at most 61).
        let bound = file.sandbox.read_paths.len() + file.sandbox.write_paths.len();
        if bound > MAX_BOUND_PATHS {
            return Err(format!(
                "sandbox.read_paths: {bound} read and write paths; at most {MAX_BOUND_PATHS} together (each is bound from a \
                 descriptor bwrap is passed)"
            ));
        }
        for label in &file.placement.labels {
            check_label(label).map_err(|e| format!("placement.labels: {e}"))?;
        }
        let policies = compile_all(&file.guardrails.policies, "profile", "guardrails.policies")?;
        let canonical = serde_json::to_vec(&file).map_err(|e| format!("cannot encode profile: {e}"))?;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&canonical)));
        Ok(Profile { file, version, policies, digest, source, unusable: None })
    }

    /// The profile id, without its version.
    pub fn id(&self) -> &str {
        &self.file.id
    }

    /// The pinned reference, `id@version`.
    pub fn reference(&self) -> String {
        format!("{}@{}", self.file.id, self.version)
    }
}
