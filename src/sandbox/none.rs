//! The `none` backend: a plain child process in a private workspace. No
//! namespaces, no filesystem or network isolation: the gate refuses a spec
//! that asks `none` for what it cannot enforce (e.g. no network). What it
//! does keep: the sandbox's own host uid, its cgroup (limits, and a
//! teardown that finds every process, `setsid` or not), rlimits, a private
//! `TMPDIR` under its own directory, a session keyring of its own, and a
//! teardown that purges what its uid left on the host (System V IPC, its
//! entries in /tmp, /var/tmp, /dev/shm, /dev/mqueue, /run/lock, its
//! keyrings; see `uid_state`) before the uid is released. Without a uid of
//! its own (an unprivileged daemon) it is not created: its harness would
//! run as the daemon, with the daemon's files and its admin socket.

use std::sync::Arc;

use async_trait::async_trait;

use super::boundary::Boundary;
use super::cgroup::CgroupHost;
use super::host::effective_uid;
use super::process::spawn_group;
use super::{
    base_env, Capabilities, CreateSandbox, EnforcementReceipt, ExecSpec, Sandbox, SandboxBackend, SandboxError,
    SandboxProcess, SandboxState, SandboxType,
};

/// The `none` backend: no namespaces or seccomp filter, but the sandbox's
/// own directory, host uid, cgroup and rlimits, and the same teardown.
pub struct NoneBackend {
    boundary: Boundary,
}

impl NoneBackend {
    /// A backend using `cgroups` (`None`: no cgroup limits or cgroup kill).
    pub fn new(cgroups: Option<Arc<CgroupHost>>) -> Self {
        NoneBackend { boundary: Boundary::new(cgroups) }
    }
}

impl Default for NoneBackend {
    fn default() -> Self {
        Self::new(None)
    }
}

#[async_trait]
impl SandboxBackend for NoneBackend {
    fn kind(&self) -> SandboxType {
        SandboxType::None
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        Ok(())
    }

    fn capabilities(&self) -> Capabilities {
        let mut capabilities = Capabilities::from_cgroups(self.boundary.cgroups.as_deref());
        // Without a cgroup, a root daemon's sandbox still has a uid of its
        // own to sweep; an unprivileged daemon's has nothing.
        if capabilities.kill.is_err() {
            capabilities.kill = if effective_uid() == 0 {
                Ok("a sweep of the sandbox's own host uid".into())
            } else {
                Err(super::boundary::NONE_CANNOT_BE_KILLED.into())
            };
        }
        capabilities
    }

    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        // No /etc of its own and no network namespace: an agent's managed
        // hook cannot be installed, so it is refused rather than left out.
        if !req.gate.is_empty() || req.gateway {
            return Err(SandboxError::Unavailable(
                "a none sandbox cannot carry an agent's pre-tool hook or the credential gateway (no /etc or network \
                 namespace of its own)"
                    .into(),
            ));
        }
        // Its harness would be the daemon (the gate refuses this first).
        let Some(user) = req.user else {
            return Err(SandboxError::Unavailable(
                "a none sandbox needs a host uid of its own (a root daemon): without one its harness would run as \
                 the daemon"
                    .into(),
            ));
        };
        let (paths, cgroup) = self.boundary.prepare(req)?;
        let mut write_roots = vec![paths.workspace.to_string_lossy().into_owned()];
        write_roots.extend(req.spec.write_paths.iter().filter(|p| p.starts_with('/')).cloned());
        let host_uid = user.uid;
        let receipt = EnforcementReceipt {
            network_isolated: false,
            write_roots,
            host_uid,
            own_uid: req.user.is_some(),
            inside_uid: host_uid,
            limits: self.boundary.limit_receipts(&req.limits, req.user.is_some(), false),
            ..EnforcementReceipt::default()
        };
        Ok(Sandbox {
            id: req.sandbox_id.clone(),
            backend: SandboxType::None,
            state: SandboxState::Ready,
            consumer: req.consumer.clone(),
            spec: req.spec.clone(),
            root: req.root.clone(),
            workspace: paths.workspace,
            home: paths.home,
            user: req.user,
            limits: req.limits,
            cgroup,
            egress: None,
            gate: Default::default(),
            receipt,
        })
    }

    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError> {
        let Some((program, args)) = spec.argv.split_first() else {
            return Err(SandboxError::Spawn("empty argv".into()));
        };
        let home = sandbox.home.to_string_lossy().into_owned();
        let mut env = base_env(sandbox, spec, &home);
        // A TMPDIR of its own, not the host's shared /tmp (which teardown
        // still purges of the uid's entries, for tools that ignore TMPDIR).
        let tmp = super::boundary::SandboxPaths::under(&sandbox.root).tmp.to_string_lossy().into_owned();
        for (name, value) in env.iter_mut() {
            if name == "TMPDIR" {
                *value = tmp.clone();
            }
        }
        let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        let options = self.boundary.spawn_options(sandbox)?;
        let process = spawn_group(program.as_ref(), &args, &env, &sandbox.workspace, options)?;
        self.boundary.register(sandbox, &process, None);
        Ok(process)
    }

    async fn stop(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.boundary.stop(sandbox).await
    }

    async fn reclaim(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.boundary.reclaim(sandbox).await
    }

    async fn destroy_leftover(
        &self,
        sandbox_id: &str,
        root: &std::path::Path,
        user: Option<super::HostUser>,
    ) -> Result<(), SandboxError> {
        self.boundary.destroy_leftover(sandbox_id, root, user).await
    }
}
