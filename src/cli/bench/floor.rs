//! The floor: the exact bwrap command line corral runs for a profile,
//! spawned directly, the way corral spawns it (`spawn_group`: cleared
//! environment with corral's own variables, new process group, piped
//! stdio, PR_SET_PDEATHSIG), each time in a fresh empty workspace that is
//! created before and removed after, as corral's sandbox create and
//! destroy do. No gRPC, no store, no gate: what is left is the cost of the
//! sandbox itself.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

use crate::pb;
use crate::sandbox::process::{spawn_group, ResourceLimits};
use crate::sandbox::{
    base_env, bwrap_args, find_on_path, Consumer, EnforcementReceipt, ExecSpec, HostLayout, Sandbox, SandboxSpec,
    SandboxState, SandboxType,
};

pub struct Floor {
    program: PathBuf,
    spec: SandboxSpec,
    layout: HostLayout,
    /// The profile's harness argv (`/usr/bin/true` for `builtin.noop`).
    argv: Vec<String>,
    credential_route_refs: Vec<String>,
    timeout: Duration,
    /// Workspaces are made under here, one fresh directory per spawn.
    root: PathBuf,
}

impl Floor {
    /// The floor for `profile` run in the sandbox an execution of it got
    /// (`effective`: the spec after the gate).
    pub fn new(profile: &pb::Profile, effective: &pb::SandboxSpec, root: &Path) -> anyhow::Result<Floor> {
        if effective.r#type != pb::SandboxType::LinuxBwrap as i32 {
            bail!("the floor needs a linux_bwrap profile; {} runs in sandbox type {}", profile.r#ref, effective.r#type);
        }
        let program = find_on_path("bwrap").context("bwrap not found on PATH")?;
        let rein = profile.rein.clone().unwrap_or_default();
        std::fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
        Ok(Floor {
            program,
            spec: SandboxSpec {
                sandbox_type: SandboxType::LinuxBwrap,
                allow_network: effective.allow_network,
                write_paths: effective.write_paths.clone(),
                read_paths: effective.read_paths.clone(),
                env_passthrough: effective.env_passthrough.clone(),
            },
            layout: HostLayout::detect(),
            argv: rein.argv,
            credential_route_refs: profile.credential_route_refs.clone(),
            timeout: Duration::from_secs(profile.limits.as_ref().map(|l| l.timeout_seconds).unwrap_or(600)),
            root: root.to_path_buf(),
        })
    }

    /// The full command line (program excluded) for a workspace.
    pub fn args(&self, workspace: &Path) -> Vec<OsString> {
        let mut args = bwrap_args(&self.spec, workspace, &self.layout);
        args.extend(self.argv.iter().map(OsString::from));
        args
    }

    /// Whether corral's enforcement receipt for a sandbox at `workspace`
    /// is the digest of this floor's command line up to `--`: proof that
    /// the floor runs exactly what corral ran.
    pub fn matches_receipt(&self, workspace: &str, command_digest: &str) -> bool {
        let args = bwrap_args(&self.spec, Path::new(workspace), &self.layout);
        let mut hasher = Sha256::new();
        hasher.update(self.program.as_os_str().as_encoded_bytes());
        for arg in &args {
            hasher.update([0u8]);
            hasher.update(arg.as_encoded_bytes());
        }
        crate::sandbox::hex_digest(&hasher.finalize()) == command_digest
    }

    /// One spawn: mkdir workspace → bwrap … harness → drain stdout and
    /// stderr → wait → remove the directory. Fails unless the harness
    /// exits 0.
    pub async fn spawn_once(&self) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let id = uuid::Uuid::now_v7().to_string();
        let root = self.root.join(&id);
        let workspace = root.join("workspace");
        std::fs::create_dir_all(&workspace).with_context(|| format!("cannot create {}", workspace.display()))?;
        let consumer =
            Consumer { actor: "agt".into(), project: "bench".into(), run_id: id.clone(), session_id: String::new() };
        let sandbox = Sandbox {
            id,
            backend: SandboxType::LinuxBwrap,
            state: SandboxState::Ready,
            consumer: consumer.clone(),
            spec: self.spec.clone(),
            root: root.clone(),
            workspace: workspace.clone(),
            receipt: EnforcementReceipt::default(),
        };
        let exec = ExecSpec {
            argv: self.argv.clone(),
            env: Vec::new(),
            consumer,
            credential_route_refs: self.credential_route_refs.clone(),
            timeout: self.timeout,
        };
        let env = base_env(&sandbox, &exec, "/tmp");
        let args = self.args(&workspace);
        let mut process = spawn_group(&self.program, &args, &env, &workspace, ResourceLimits::default())?;
        drop(process.stdin.take());
        let (stdout, stderr) = (process.stdout.take(), process.stderr.take());
        let (_, err) = tokio::join!(drain(stdout), drain(stderr));
        let status = process.wait().await?;
        tokio::fs::remove_dir_all(&root).await.with_context(|| format!("cannot remove {}", root.display()))?;
        let elapsed = started.elapsed();
        if !status.success() {
            bail!("bwrap exited with {status}: {}", String::from_utf8_lossy(&err).trim());
        }
        Ok(elapsed)
    }
}

async fn drain<R: tokio::io::AsyncRead + Unpin>(pipe: Option<R>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut out).await;
    }
    out
}
