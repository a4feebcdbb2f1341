//! The `none` backend: a plain child process in a private workspace. No
//! isolation: the gate refuses a spec that asks `none` for what it cannot
//! enforce (e.g. no network).

use std::sync::Arc;

use async_trait::async_trait;

use super::bwrap::{prepare_root, remove_root};
use super::process::{spawn_group, ProcessRegistry, ResourceLimits};
use super::{
    base_env, CreateSandbox, EnforcementReceipt, ExecSpec, Sandbox, SandboxBackend, SandboxError, SandboxProcess,
    SandboxState, SandboxType,
};

#[derive(Default)]
pub struct NoneBackend {
    processes: Arc<ProcessRegistry>,
}

#[async_trait]
impl SandboxBackend for NoneBackend {
    fn kind(&self) -> SandboxType {
        SandboxType::None
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        Ok(())
    }

    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        let workspace = prepare_root(req)?;
        let mut write_roots = vec![workspace.to_string_lossy().into_owned()];
        write_roots.extend(req.spec.write_paths.iter().filter(|p| p.starts_with('/')).cloned());
        Ok(Sandbox {
            id: req.sandbox_id.clone(),
            backend: SandboxType::None,
            state: SandboxState::Ready,
            consumer: req.consumer.clone(),
            spec: req.spec.clone(),
            root: req.root.clone(),
            workspace,
            receipt: EnforcementReceipt { command_digest: String::new(), network_isolated: false, write_roots },
        })
    }

    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError> {
        let Some((program, args)) = spec.argv.split_first() else {
            return Err(SandboxError::Spawn("empty argv".into()));
        };
        let home = sandbox.workspace.to_string_lossy().into_owned();
        let env = base_env(sandbox, spec, &home);
        let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
        let process = spawn_group(program.as_ref(), &args, &env, &sandbox.workspace, ResourceLimits::default())?;
        self.processes.register(&sandbox.id, &process);
        Ok(process)
    }

    async fn destroy(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.processes.kill_all(&sandbox.id);
        remove_root(&sandbox.root).await
    }
}
