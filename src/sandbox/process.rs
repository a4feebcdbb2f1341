//! Processes run inside a sandbox, each in its own process group so that a
//! timeout or a cancel kills everything it started, not only its first pid.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

use super::SandboxError;

/// Per-process resource limits (rlimits) applied before the sandbox's
/// first process runs, and so inherited by everything inside it. 0 means
/// "inherit". RLIMIT_CORE is always 0: a sandbox never dumps core.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rlimits {
    /// RLIMIT_NPROC: tasks of the sandbox's host uid. Only meaningful when
    /// the sandbox has a uid of its own (root ignores it, and a shared uid
    /// would count the daemon's own threads).
    pub max_processes: u64,
    /// RLIMIT_AS in bytes (address space, not memory: runtimes that reserve
    /// large virtual ranges, such as Node's, fail under a small one).
    pub address_space_bytes: u64,
    /// RLIMIT_FSIZE: the largest file the sandbox may write.
    pub max_file_bytes: u64,
    /// RLIMIT_NOFILE.
    pub max_open_files: u64,
}

/// The host identity a sandbox's first process takes before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostUser {
    /// The host uid.
    pub uid: u32,
    /// The host gid (no supplementary groups).
    pub gid: u32,
}

/// How to start a sandbox's process beyond its argv and environment.
#[derive(Default)]
pub struct SpawnOptions {
    /// The resource limits the process starts with.
    pub rlimits: Rlimits,
    /// Drop to this uid/gid (no supplementary groups) before exec; `None`
    /// keeps the daemon's own identity.
    pub user: Option<HostUser>,
    /// `cgroup.procs` files of the sandbox's cgroups, opened by the daemon:
    /// the child writes "0" to each before it drops root, so it and all it
    /// starts are inside the cgroups before anything of the sandbox runs.
    pub cgroup_procs: Vec<std::fs::File>,
    /// Files handed to the child as fds 3, 4, … in this order (bwrap's
    /// `--args`, `--seccomp`); every other descriptor above 2 is closed.
    pub pass_fds: Vec<OwnedFd>,
}

/// A running process inside a sandbox.
pub struct SandboxProcess {
    child: Child,
    pgid: i32,
    /// The process's piped stdin; `None` once taken.
    pub stdin: Option<ChildStdin>,
    /// The process's piped stdout; `None` once taken.
    pub stdout: Option<ChildStdout>,
    /// The process's piped stderr; `None` once taken.
    pub stderr: Option<ChildStderr>,
    exit: Option<ExitStatus>,
    /// Set once the leader is reaped: from then on its pid (and so the
    /// group id) may belong to someone else and must not be signalled.
    reaped: Arc<AtomicBool>,
    /// The tool-call gate's listener in the sandbox's network namespace,
    /// for a sandbox with hook files: the rein serves it.
    pub gate_listener: Option<tokio::net::TcpListener>,
    /// The credential gateway's listener there, likewise.
    pub gateway_listener: Option<tokio::net::TcpListener>,
}

impl std::fmt::Debug for SandboxProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxProcess").field("pgid", &self.pgid).finish()
    }
}

/// Where passed descriptors are parked while they are moved to 3, 4, …
const FD_PARKING: libc::c_int = 64;

/// Spawns `program args` with exactly `env` (the inherited environment is
/// cleared first), in a new process group, with piped stdio, inside the
/// given cgroups, under the given rlimits and host user, with no inherited
/// descriptor but stdio and `pass_fds`.
///
/// Must be called from a task on a runtime worker thread, never from
/// `spawn_blocking`: bwrap's `--die-with-parent` is PR_SET_PDEATHSIG, which
/// fires when the spawning *thread* exits.
pub fn spawn_group(
    program: &Path,
    args: &[OsString],
    env: &[(String, String)],
    cwd: &Path,
    options: SpawnOptions,
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
        // A safety net only: teardown kills the whole sandbox explicitly.
        .kill_on_drop(true);
    let cgroup_fds: Vec<RawFd> = options.cgroup_procs.iter().map(|f| f.as_raw_fd()).collect();
    let pass_fds: Vec<RawFd> = options.pass_fds.iter().map(|f| f.as_raw_fd()).collect();
    if pass_fds.len() > (FD_PARKING - 3) as usize {
        return Err(SandboxError::Spawn("too many descriptors to pass".into()));
    }
    let limits = options.rlimits;
    let user = options.user;
    // SAFETY: the closure runs in the forked child before exec and makes
    // only async-signal-safe syscalls (write, setrlimit, setgroups,
    // setresgid, setresuid, keyctl, prctl, fcntl, dup2, close_range); it allocates
    // nothing (the vectors were built before the fork).
    unsafe {
        cmd.pre_exec(move || {
            // Into the cgroups first, while still root: from here on
            // everything this process starts is counted, limited and killable.
            for fd in &cgroup_fds {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            set_rlimit(libc::RLIMIT_CORE, 0)?;
            for (resource, value) in [
                (libc::RLIMIT_NPROC, limits.max_processes),
                (libc::RLIMIT_AS, limits.address_space_bytes),
                (libc::RLIMIT_FSIZE, limits.max_file_bytes),
                (libc::RLIMIT_NOFILE, limits.max_open_files),
            ] {
                if value > 0 {
                    set_rlimit(resource, value)?;
                }
            }
            if let Some(user) = user {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(user.gid, user.gid, user.gid) != 0
                    || libc::setresuid(user.uid, user.uid, user.uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // Not the daemon's (root's) session keyring: the sandbox
                // would possess it, could write it, and pass keys on.
                super::uid_state::join_fresh_session_keyring()?;
            }
            // After the uid change, which clears the parent-death signal.
            // If the daemon dies, so does this process (and with bwrap, the
            // whole sandbox: its --die-with-parent follows).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // No process of the sandbox gains privileges by exec (a setuid
            // or file-capability binary, in a `none` sandbox too; bwrap sets
            // it again inside): its effective uid stays its real one, the
            // sandbox's own, which is what teardown's sweep of that uid
            // reads (`host::processes_of_uid`).
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Park every passed descriptor high first, then put them at 3,
            // 4, … (dup2 clears close-on-exec on the copy). All parked
            // before any is moved: a passed descriptor may itself be 3 or
            // 4, and moving the first onto it would pass the wrong file in
            // its place (bwrap then read its arguments as the seccomp
            // program and refused to start, EINVAL).
            let mut parked = [0 as libc::c_int; (FD_PARKING - 3) as usize];
            for (i, fd) in pass_fds.iter().enumerate() {
                parked[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, FD_PARKING);
                if parked[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, fd) in parked.iter().take(pass_fds.len()).enumerate() {
                if libc::dup2(*fd, 3 + i as libc::c_int) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Everything else the daemon has open closes at exec. (Marked
            // close-on-exec rather than closed, so the runtime's own
            // exec-error pipe still works.)
            let first = 3 + pass_fds.len() as libc::c_uint;
            if libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| SandboxError::Spawn(format!("{}: {e}", program.display())))?;
    // The child has its copies; ours close here.
    drop(options);
    let pgid = child.id().map(|p| p as i32).unwrap_or(0);
    Ok(SandboxProcess {
        gate_listener: None,
        gateway_listener: None,
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

/// A sealed-in-spirit anonymous file holding `bytes`, positioned at its
/// start, for handing data to bwrap by descriptor (`--args`, `--seccomp`).
pub fn data_fd(name: &str, bytes: &[u8]) -> std::io::Result<OwnedFd> {
    use std::io::{Seek, Write};
    let name = std::ffi::CString::new(name).map_err(|_| std::io::Error::other("NUL in memfd name"))?;
    // SAFETY: memfd_create with a valid C string; the returned descriptor
    // is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes)?;
    file.rewind()?;
    Ok(file.into())
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

    /// SIGTERM to the whole group, SIGKILL after `grace` if the first process
    /// has not exited, then reaps it so no zombie is left.
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
    groups: Mutex<HashMap<String, Vec<Group>>>,
}

/// A process group id, and whether its leader has been reaped.
type Group = (i32, Arc<AtomicBool>);

impl ProcessRegistry {
    /// Records `process`'s group under `sandbox_id`, for [`Self::kill_all`].
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
