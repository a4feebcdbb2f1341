//! Processes run inside a sandbox, each in its own process group so that a
//! timeout or a cancel kills everything it started, not only its first pid.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

use super::SandboxError;

/// Resource limits applied to the spawned process (and so inherited by
/// everything inside the sandbox).
#[derive(Clone, Copy, Debug, Default)]
pub struct ResourceLimits {
    /// RLIMIT_NPROC; 0 = inherit. Note: root ignores it.
    pub max_processes: u64,
    /// RLIMIT_AS in bytes; 0 = inherit.
    pub memory_bytes: u64,
}

/// A running process inside a sandbox.
pub struct SandboxProcess {
    child: Child,
    pgid: i32,
    pub stdin: Option<ChildStdin>,
    pub stdout: Option<ChildStdout>,
    pub stderr: Option<ChildStderr>,
    exit: Option<ExitStatus>,
    /// Set once the leader is reaped: from then on its pid (and so the
    /// group id) may belong to someone else and must not be signalled.
    reaped: Arc<AtomicBool>,
}

impl std::fmt::Debug for SandboxProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxProcess").field("pgid", &self.pgid).finish()
    }
}

/// Spawns `program args` with exactly `env` (the inherited environment is
/// cleared first), in a new process group, with piped stdio.
///
/// Must be called from a task on a runtime worker thread, never from
/// `spawn_blocking`: bwrap's `--die-with-parent` is PR_SET_PDEATHSIG, which
/// fires when the spawning *thread* exits.
pub fn spawn_group(
    program: &Path,
    args: &[OsString],
    env: &[(String, String)],
    cwd: &Path,
    limits: ResourceLimits,
) -> Result<SandboxProcess, SandboxError> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        // A safety net only: teardown kills the whole group explicitly.
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe syscalls (prctl, getppid, setrlimit).
    unsafe {
        cmd.pre_exec(move || {
            // If the daemon dies, so does this process (and with bwrap, the
            // whole sandbox: its --die-with-parent follows).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if limits.max_processes > 0 {
                set_rlimit(libc::RLIMIT_NPROC, limits.max_processes)?;
            }
            if limits.memory_bytes > 0 {
                set_rlimit(libc::RLIMIT_AS, limits.memory_bytes)?;
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| SandboxError::Spawn(format!("{}: {e}", program.display())))?;
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    Ok(SandboxProcess {
        stdin: child.stdin.take(),
        stdout: child.stdout.take(),
        stderr: child.stderr.take(),
        child,
        pgid,
        exit: None,
        reaped: Arc::new(AtomicBool::new(false)),
    })
}

fn set_rlimit(resource: libc::__rlimit_resource_t, value: u64) -> std::io::Result<()> {
    let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: plain syscall with a valid pointer to a stack value.
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl SandboxProcess {
    /// The process group id (the first process's pid).
    pub fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Waits for the first process to exit.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(status) = self.exit {
            return Ok(status);
        }
        let status = self.child.wait().await?;
        self.mark_reaped(status);
        Ok(status)
    }

    /// Whether the first process has exited already.
    pub fn has_exited(&mut self) -> bool {
        if self.exit.is_some() {
            return true;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.mark_reaped(status);
                true
            }
            _ => false,
        }
    }

    fn mark_reaped(&mut self, status: ExitStatus) {
        self.exit = Some(status);
        self.reaped.store(true, Ordering::SeqCst);
    }

    /// SIGTERM to the whole group, SIGKILL after `grace`, then reaps the
    /// first process so no zombie is left.
    /// Sends `signal` to the group unless its leader was reaped already.
    fn signal(&self, signal: libc::c_int) {
        if !self.reaped.load(Ordering::SeqCst) {
            signal_group(self.pgid, signal);
        }
    }

    pub async fn terminate(&mut self, grace: Duration) -> std::io::Result<ExitStatus> {
        self.signal(libc::SIGTERM);
        if let Ok(status) = tokio::time::timeout(grace, self.wait()).await {
            return status;
        }
        self.kill().await
    }

    /// SIGKILL to the whole group, then reaps the first process.
    pub async fn kill(&mut self) -> std::io::Result<ExitStatus> {
        self.signal(libc::SIGKILL);
        self.wait().await
    }
}

/// Sends `signal` to process group `pgid`; a group that is gone already is
/// not an error.
pub fn signal_group(pgid: i32, signal: libc::c_int) {
    if pgid > 1 {
        // SAFETY: kill(2) with a negative pid targets a process group; no
        // memory is involved.
        unsafe {
            libc::kill(-pgid, signal);
        }
    }
}

/// The process groups each sandbox has started, so that destroy can kill
/// whatever a rein failed to clean up.
#[derive(Default)]
pub struct ProcessRegistry {
    groups: Mutex<HashMap<String, Vec<(i32, Arc<AtomicBool>)>>>,
}

impl ProcessRegistry {
    pub fn register(&self, sandbox_id: &str, process: &SandboxProcess) {
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        groups.entry(sandbox_id.to_string()).or_default().push((process.pgid, process.reaped.clone()));
    }

    /// SIGKILLs every group of the sandbox whose leader was not reaped, and
    /// forgets the sandbox. Returns how many groups were signalled.
    pub fn kill_all(&self, sandbox_id: &str) -> usize {
        let entries = {
            let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            groups.remove(sandbox_id).unwrap_or_default()
        };
        let mut signalled = 0;
        for (pgid, reaped) in entries {
            if !reaped.load(Ordering::SeqCst) {
                signal_group(pgid, libc::SIGKILL);
                signalled += 1;
            }
        }
        signalled
    }
}
