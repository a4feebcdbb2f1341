//! The floor: the exact hardened bwrap command line corral runs for a
//! profile, spawned directly the way corral spawns it — the sandbox's
//! directories, its cgroup, the uid switch, rlimits, the seccomp program,
//! the identity files and `--args` by descriptor, cleared environment, new
//! process group, PR_SET_PDEATHSIG — each time in a fresh sandbox created
//! before and destroyed after (cgroup emptied and removed), as corral's
//! create and destroy do. No gRPC, no store, no gate: what is left is the
//! cost of the sandbox itself.
//!
//! A spawn's time ends where corral's Execute sample does: corral stops a
//! sandbox (kills what is left in its cgroup, closes its proxy) before it
//! sends `finished`, and reclaims it (cgroup removed, files, uid) after.
//! So [`Floor::spawn_once`] times the stop and not the reclaim; latency
//! waits for both sides' reclaims before each sample, and throughput's
//! rounds count both sides' in their wall time.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::io::AsyncReadExt;

use crate::pb;
use crate::sandbox::{
    base_env, bwrap_args, find_on_path, Boundary, BwrapBackend, Consumer, CreateSandbox, EnforcementReceipt, ExecSpec,
    HostLayout, HostUser, Sandbox, SandboxConfig, SandboxLimits, SandboxPaths, SandboxSpec, SandboxState, SandboxType,
    HOME_MOUNT,
};

pub struct Floor {
    program: PathBuf,
    spec: SandboxSpec,
    layout: HostLayout,
    /// The profile's harness argv (`/usr/bin/true` for `builtin.noop`).
    argv: Vec<String>,
    credential_route_refs: Vec<String>,
    timeout: Duration,
    limits: SandboxLimits,
    /// Sandboxes are made under here, one fresh directory per spawn.
    root: PathBuf,
    backend: BwrapBackend,
    boundary: Boundary,
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
        let limits = profile.limits.unwrap_or_default();
        let cgroups = crate::sandbox::Backends::cgroups_for(&SandboxConfig::default());
        Ok(Floor {
            program,
            spec: SandboxSpec {
                sandbox_type: SandboxType::LinuxBwrap,
                allow_network: effective.allow_network,
                allow_hosts: effective.allow_hosts.clone(),
                write_paths: effective.write_paths.clone(),
                read_paths: effective.read_paths.clone(),
                env_passthrough: effective.env_passthrough.clone(),
            },
            layout: HostLayout::detect(),
            argv: rein.argv,
            credential_route_refs: profile.credential_route_refs.clone(),
            timeout: Duration::from_secs(limits.timeout_seconds),
            // What the daemon's sandbox enforces, mapped by the code that
            // maps it for the daemon.
            limits: {
                let mut sandbox = crate::api::limits_from_wire(&limits).sandbox();
                // An older server does not send it; 0 would be an unsized tmpfs.
                if sandbox.shm_bytes == 0 {
                    sandbox.shm_bytes = crate::catalog::DEFAULT_SHM_BYTES;
                }
                sandbox
            },
            root: root.to_path_buf(),
            backend: BwrapBackend::detect(cgroups.clone()),
            boundary: Boundary::new(cgroups),
        })
    }

    /// The full command line (program excluded) for a sandbox at `root`.
    pub fn args(&self, root: &Path) -> Vec<OsString> {
        let mut args =
            bwrap_args(&self.spec, &SandboxPaths::under(root), &self.layout, self.limits.tmpfs(), &Default::default());
        args.extend(self.argv.iter().map(OsString::from));
        args
    }

    /// Whether corral's enforcement receipt for a sandbox whose workspace
    /// is `workspace` is the digest of this floor's command line up to
    /// `--`: proof that the floor runs exactly what corral ran.
    pub fn matches_receipt(&self, workspace: &str, command_digest: &str) -> bool {
        let Some(root) = Path::new(workspace).parent() else { return false };
        let args: Vec<OsString> =
            bwrap_args(&self.spec, &SandboxPaths::under(root), &self.layout, self.limits.tmpfs(), &Default::default());
        crate::sandbox::command_digest(&self.program, &args) == command_digest
    }

    /// One spawn: create the sandbox (directories, cgroup) → bwrap …
    /// harness → drain stdout and stderr → wait → stop (cgroup emptied,
    /// proxy closed), timed; then, untimed, reclaim (cgroup and directory
    /// removed). Fails unless the harness exits 0 and the sandbox is
    /// stopped and reclaimed.
    pub async fn spawn_once(&self) -> anyhow::Result<Duration> {
        let (elapsed, spawned) = self.timed_spawn().await?;
        spawned.reclaim(self).await?;
        Ok(elapsed)
    }

    /// The timed part of [`spawn_once`](Self::spawn_once): what corral's
    /// sample covers, up to its `finished`. The sandbox is stopped, not
    /// yet reclaimed.
    async fn timed_spawn(&self) -> anyhow::Result<(Duration, Spawned)> {
        let started = Instant::now();
        let id = uuid::Uuid::now_v7().to_string();
        let root = self.root.join(&id);
        let consumer =
            Consumer { actor: "agt".into(), project: "bench".into(), run_id: id.clone(), ..Consumer::default() };
        // A root daemon gives every sandbox its own uid; the floor switches
        // to `nobody`, which costs the same and collides with no sandbox.
        let user = (crate::sandbox::host::effective_uid() == 0).then_some(HostUser { uid: 65534, gid: 65534 });
        let request = CreateSandbox {
            sandbox_id: id.clone(),
            consumer: consumer.clone(),
            spec: self.spec.clone(),
            root: root.clone(),
            user,
            limits: self.limits,
            gate: Vec::new(),
            gateway: false,
        };
        let (paths, cgroup) = self.boundary.prepare(&request)?;
        let sandbox = Sandbox {
            id,
            backend: SandboxType::LinuxBwrap,
            state: SandboxState::Ready,
            consumer: consumer.clone(),
            spec: self.spec.clone(),
            root: root.clone(),
            workspace: paths.workspace.clone(),
            home: paths.home.clone(),
            user,
            limits: self.limits,
            cgroup,
            egress: None,
            gate: Default::default(),
            receipt: EnforcementReceipt::default(),
        };
        let exec = ExecSpec {
            argv: self.argv.clone(),
            env: Vec::new(),
            consumer,
            credential_route_refs: self.credential_route_refs.clone(),
            timeout: self.timeout,
        };
        let env = base_env(&sandbox, &exec, HOME_MOUNT);
        let options = self.boundary.spawn_options(&sandbox)?;
        let egress = self.spec.allow_network.then(Default::default);
        let (mut process, proxy) = self
            .backend
            .launch(&self.spec, &paths, self.limits.tmpfs(), &Default::default(), &self.argv, &env, options, egress)
            .await?;
        drop(process.stdin.take());
        let (stdout, stderr) = (process.stdout.take(), process.stderr.take());
        let (_, err) = tokio::join!(drain(stdout), drain(stderr));
        let status = process.wait().await?;
        let stopped = self.boundary.stop(&sandbox).await;
        drop(proxy);
        let elapsed = started.elapsed();
        let spawned = Spawned { sandbox };
        if let Err(e) = stopped {
            // Still given back; the spawn fails either way.
            let _ = spawned.reclaim(self).await;
            return Err(anyhow::Error::new(e).context(format!("cannot stop {}", root.display())));
        }
        if !status.success() {
            spawned.reclaim(self).await?;
            bail!("bwrap exited with {status}: {}", String::from_utf8_lossy(&err).trim());
        }
        Ok((elapsed, spawned))
    }
}

/// A floor sandbox stopped, not yet reclaimed.
struct Spawned {
    sandbox: Sandbox,
}

impl Spawned {
    /// Gives back its cgroup and directory, as corral's reclaim after
    /// `finished` does.
    async fn reclaim(self, floor: &Floor) -> anyhow::Result<()> {
        let root = self.sandbox.root.display().to_string();
        floor.boundary.reclaim(&self.sandbox).await.with_context(|| format!("cannot destroy {root}"))
    }
}

async fn drain<R: tokio::io::AsyncRead + Unpin>(pipe: Option<R>) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut out).await;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The floor's timer stops where corral's sample does, at its stop:
    /// the sandbox's directory (and cgroup) are still there when the time
    /// is taken, and gone once the untimed reclaim ran. With real bwrap.
    #[tokio::test]
    async fn the_floor_times_the_stop_and_not_the_reclaim() {
        let profile = pb::Profile {
            r#ref: "builtin.noop@1.0.0".into(),
            rein: Some(pb::Rein { argv: vec!["/usr/bin/true".into()], ..Default::default() }),
            limits: Some(crate::api::wire_limits(&crate::catalog::Limits::default())),
            ..Default::default()
        };
        let effective = pb::SandboxSpec { r#type: pb::SandboxType::LinuxBwrap as i32, ..Default::default() };
        let dir = tempfile::tempdir().unwrap();
        let floor = Floor::new(&profile, &effective, dir.path()).expect("bwrap on PATH: the Debian package bubblewrap");
        let (elapsed, spawned) = floor.timed_spawn().await.expect("the floor's no-op runs");
        let root = spawned.sandbox.root.clone();
        assert!(elapsed > Duration::ZERO);
        assert!(root.exists(), "the timer stopped after the sandbox's directory was removed");
        let cgroups = spawned.sandbox.cgroup.as_ref().map(|c| c.paths()).unwrap_or_default();
        assert!(cgroups.iter().all(|c| c.exists()), "the timer stopped after the sandbox's cgroup was removed");
        spawned.reclaim(&floor).await.expect("reclaimed");
        assert!(!root.exists(), "the reclaim removes the sandbox's directory");
        assert!(!cgroups.iter().any(|c| c.exists()), "the reclaim removes the sandbox's cgroup");
        assert!(floor.spawn_once().await.expect("a whole spawn") > Duration::ZERO);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "every floor sandbox is reclaimed");
    }
}
