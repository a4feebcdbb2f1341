//! Processes run inside a sandbox, each in its own process group so that a
//! timeout or a cancel kills everything it started, not only its first pid.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use super::{vfork, SandboxError};

/// A sandbox process's stdin, as the daemon writes it.
pub type ProcessStdin = tokio::net::unix::pipe::Sender;
/// A sandbox process's stdout or stderr, as the daemon reads it.
pub type ProcessStdout = tokio::net::unix::pipe::Receiver;

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
    /// The first process's pidfd, readable once it has exited; `None` once
    /// it is reaped (or handed to the reaper on drop).
    exited: Option<AsyncFd<OwnedFd>>,
    pgid: i32,
    /// The process's piped stdin; `None` once taken.
    pub stdin: Option<ProcessStdin>,
    /// The process's piped stdout; `None` once taken.
    pub stdout: Option<ProcessStdout>,
    /// The process's piped stderr; `None` once taken.
    pub stderr: Option<ProcessStdout>,
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

impl SandboxProcess {
    /// Set once the leader is reaped.
    pub(super) fn reaped_flag(&self) -> Arc<AtomicBool> {
        self.reaped.clone()
    }
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
/// descriptor but stdio and `pass_fds`. The process gets SIGKILL if the
/// daemon dies.
///
/// The clone itself happens on the daemon's spawning thread (`Spawner`),
/// whichever thread calls this: the caller waits for it as long as a
/// clone takes. Must be called inside a tokio runtime (the process's pidfd
/// and pipes are registered with it).
pub fn spawn_group(
    program: &Path,
    args: &[OsString],
    env: &[(String, String)],
    cwd: &Path,
    options: SpawnOptions,
) -> Result<SandboxProcess, SandboxError> {
    let spawn_error = |e: std::io::Error| SandboxError::Spawn(format!("{}: {e}", program.display()));
    let c = |bytes: &[u8]| CString::new(bytes).map_err(|_| SandboxError::Spawn("a NUL byte in an argument".into()));
    let path = c(program.as_os_str().as_bytes())?;
    let cwd = c(cwd.as_os_str().as_bytes())?;
    let argv: Vec<CString> =
        std::iter::once(Ok(path.clone())).chain(args.iter().map(|a| c(a.as_bytes()))).collect::<Result<_, _>>()?;
    let envp: Vec<CString> = env.iter().map(|(k, v)| c(format!("{k}={v}").as_bytes())).collect::<Result<_, _>>()?;
    if options.pass_fds.len() > (FD_PARKING - 3) as usize {
        return Err(SandboxError::Spawn("too many descriptors to pass".into()));
    }
    // A passed descriptor at 0, 1 or 2 (a daemon started with its stdio
    // closed) would be overwritten by the child's stdio before it moved.
    let mut options = options;
    options.pass_fds = options.pass_fds.into_iter().map(above_stdio).collect::<Result<_, _>>().map_err(spawn_error)?;
    options.cgroup_procs = (options.cgroup_procs.into_iter())
        .map(|f| above_stdio(f.into()).map(std::fs::File::from))
        .collect::<Result<_, _>>()
        .map_err(spawn_error)?;
    let (stdin_child, stdin_ours) = pipe().map_err(spawn_error)?;
    let (stdout_ours, stdout_child) = pipe().map_err(spawn_error)?;
    let (stderr_ours, stderr_child) = pipe().map_err(spawn_error)?;
    let child = Child { path, cwd, argv, envp, stdio: [stdin_child, stdout_child, stderr_child], options };
    let pid = Spawner::start(child).map_err(spawn_error)?;
    let exited = pidfd(pid).map_err(|e| {
        signal_group(pid, libc::SIGKILL);
        let _ = vfork::reap(pid);
        spawn_error(e)
    })?;
    let io = |e: std::io::Error| SandboxError::Spawn(format!("stdio of {}: {e}", program.display()));
    Ok(SandboxProcess {
        gate_listener: None,
        gateway_listener: None,
        stdin: Some(ProcessStdin::from_owned_fd(stdin_ours).map_err(io)?),
        stdout: Some(ProcessStdout::from_owned_fd(stdout_ours).map_err(io)?),
        stderr: Some(ProcessStdout::from_owned_fd(stderr_ours).map_err(io)?),
        exited: Some(exited),
        pgid: pid,
        exit: None,
        reaped: Arc::new(AtomicBool::new(false)),
    })
}

/// What a child of [`spawn_group`] starts with, all of it built before the
/// clone (the child allocates nothing), and owned: it is handed to the
/// spawning thread.
struct Child {
    path: CString,
    cwd: CString,
    argv: Vec<CString>,
    envp: Vec<CString>,
    /// The child's ends of its stdin, stdout and stderr pipes.
    stdio: [OwnedFd; 3],
    options: SpawnOptions,
}

impl Child {
    /// Clones the child, which sets itself up and execs; returns its pid
    /// once it has exec'd, or the errno of the step that failed (the child
    /// is reaped then). The child's descriptors close here, after the
    /// clone: it has its copies.
    fn start(self) -> std::io::Result<libc::pid_t> {
        let (path, cwd) = (&self.path, &self.cwd);
        let argv_ptrs: Vec<*const libc::c_char> =
            self.argv.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect();
        let envp_ptrs: Vec<*const libc::c_char> =
            self.envp.iter().map(|e| e.as_ptr()).chain([std::ptr::null()]).collect();
        let cgroup_fds: Vec<RawFd> = self.options.cgroup_procs.iter().map(|f| f.as_raw_fd()).collect();
        let pass_fds: Vec<RawFd> = self.options.pass_fds.iter().map(|f| f.as_raw_fd()).collect();
        let stdio = self.stdio.each_ref().map(|f| f.as_raw_fd());
        // What the child uses of the daemon's descriptors; it closes the rest first.
        let mut keep: Vec<RawFd> = stdio.iter().chain(&cgroup_fds).chain(&pass_fds).copied().collect();
        keep.sort_unstable();
        let limits = self.options.rlimits;
        let user = self.options.user;
        let failure = vfork::Failure::default();
        let daemon = std::process::id() as libc::pid_t;
        let mut child = || {
            // SAFETY: runs in the vfork'd child (see `vfork::spawn`): system
            // calls only (close_range, dup2, setpgid, write, setrlimit, `vfork::become_user`,
            // keyctl, prctl, getppid, fcntl, close_range, chdir, execve) on values built
            // before the clone; no allocation.
            unsafe {
                let run = || -> Result<(), ()> {
                    let check = |rc: libc::c_long| if rc < 0 { Err(()) } else { Ok(()) };
                    if !vfork::close_all_but(&keep) {
                        return Err(());
                    }
                    for (target, fd) in stdio.iter().enumerate() {
                        check(libc::dup2(*fd, target as libc::c_int).into())?;
                    }
                    // Its own process group, which signals reach as one.
                    check(libc::setpgid(0, 0).into())?;
                    // Into the cgroups first, while still root: from here on
                    // everything this process starts is counted, limited and
                    // killable.
                    for fd in &cgroup_fds {
                        if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                            return Err(());
                        }
                    }
                    // The descriptors before the limits: parked at 64 and up, they
                    // would break a smaller RLIMIT_NOFILE (EINVAL, every spawn).
                    // Park every passed descriptor high first, then put them at 3,
                    // 4, … (dup2 clears close-on-exec on the copy). All parked
                    // before any is moved: a passed descriptor may itself be 3 or
                    // 4, and moving the first onto it would pass the wrong file in
                    // its place (bwrap then read its arguments as the seccomp
                    // program and refused to start, EINVAL).
                    let mut parked = [0 as libc::c_int; (FD_PARKING - 3) as usize];
                    for (i, fd) in pass_fds.iter().enumerate() {
                        parked[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, FD_PARKING);
                        check(parked[i].into())?;
                    }
                    for (i, fd) in parked.iter().take(pass_fds.len()).enumerate() {
                        check(libc::dup2(*fd, 3 + i as libc::c_int).into())?;
                    }
                    check(set_rlimit(libc::RLIMIT_CORE, 0))?;
                    for (resource, value) in [
                        (libc::RLIMIT_NPROC, limits.max_processes),
                        (libc::RLIMIT_AS, limits.address_space_bytes),
                        (libc::RLIMIT_FSIZE, limits.max_file_bytes),
                        (libc::RLIMIT_NOFILE, limits.max_open_files),
                    ] {
                        if value > 0 {
                            check(set_rlimit(resource, value))?;
                        }
                    }
                    if let Some(user) = user {
                        if !vfork::become_user(user.uid, user.gid) {
                            return Err(());
                        }
                        // Not the daemon's (root's) session keyring: the sandbox
                        // would possess it, could write it, and pass keys on.
                        super::uid_state::join_fresh_session_keyring().map_err(|_| ())?;
                    }
                    // After the uid change, which clears the parent-death signal.
                    // If the daemon dies, so does this process (and with bwrap, the
                    // whole sandbox: its --die-with-parent follows).
                    check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong).into())?;
                    // A daemon that died before that line set it sent no signal:
                    // then this process has another parent already, and stops.
                    if libc::getppid() != daemon {
                        return Err(());
                    }
                    // No process of the sandbox gains privileges by exec (a setuid
                    // or file-capability binary, in a `none` sandbox too; bwrap sets
                    // it again inside): its effective uid stays its real one, the
                    // sandbox's own, which is what teardown's sweep of that uid
                    // reads (`host::processes_of_uid`) where it cannot wait on the
                    // cgroup instead (`boundary::exits_in_its_cgroup`).
                    check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0).into())?;
                    // Everything else the daemon has open closes at exec.
                    let first = 3 + pass_fds.len() as libc::c_uint;
                    check(libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC))?;
                    check(libc::chdir(cwd.as_ptr()).into())?;
                    libc::execve(path.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr());
                    Err(())
                };
                let _ = run();
                failure.record();
                127
            }
        };
        // SAFETY: the closure keeps to what `vfork::spawn` requires (above).
        let pid = unsafe { vfork::spawn(&mut child) }?;
        if let Some(error) = failure.get() {
            let _ = vfork::reap(pid);
            return Err(error);
        }
        Ok(pid)
    }
}

/// The thread every sandbox process is cloned from, for the daemon's whole
/// life. A child's parent-death signal (PR_SET_PDEATHSIG, which
/// [`spawn_group`] sets and bwrap's `--die-with-parent` sets again) fires
/// when the *thread* that cloned it exits, not the process. Cloned from a
/// runtime worker, a sandbox was SIGKILLed whenever that thread ended:
/// tokio ends a thread `block_in_place` took a worker's place from (an
/// `expr` policy's evaluation) once it has idled 10 s. This thread never
/// ends, so the signal comes only when the daemon dies.
struct Spawner;

/// A child to clone, and where its pid goes.
type Start = (Child, std::sync::mpsc::SyncSender<std::io::Result<libc::pid_t>>);

impl Spawner {
    /// Clones `child` on the spawning thread (started by the first call)
    /// and waits for its pid.
    fn start(child: Child) -> std::io::Result<libc::pid_t> {
        let gone = || std::io::Error::other("the sandbox spawning thread is gone");
        let (reply, pid) = std::sync::mpsc::sync_channel(1);
        Spawner::thread()?.send((child, reply)).map_err(|_| gone())?;
        pid.recv().map_err(|_| gone())?
    }

    fn thread() -> std::io::Result<&'static std::sync::mpsc::Sender<Start>> {
        static REQUESTS: OnceLock<std::sync::mpsc::Sender<Start>> = OnceLock::new();
        if let Some(requests) = REQUESTS.get() {
            return Ok(requests);
        }
        let (requests, incoming) = std::sync::mpsc::channel::<Start>();
        std::thread::Builder::new().name("corral-spawn".into()).spawn(move || {
            for (child, reply) in incoming {
                // A panic would end the thread, and every sandbox with it.
                let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child.start()));
                let _ = reply.send(started.unwrap_or_else(|_| Err(std::io::Error::other("spawn panicked"))));
            }
        })?;
        // Two first calls at once start a thread each: the one whose sender
        // is not kept ends at once, having cloned nothing.
        Ok(REQUESTS.get_or_init(|| requests))
    }
}

/// A pipe as (read end, write end), both close-on-exec and above 2: the
/// child moves them onto 0, 1 and 2, and one that already was one of those
/// (a daemon started with a standard descriptor closed) would be lost.
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array; we own both.
    let (read, write) = unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    Ok((above_stdio(read)?, above_stdio(write)?))
}

fn above_stdio(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: fcntl duplicates a descriptor we own; the copy is ours.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns (the original closes on drop).
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// A pidfd of our child `pid`, readable once it has exited.
fn pidfd(pid: libc::pid_t) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: pidfd_open with integer arguments; the descriptor is ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::PIDFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    // SAFETY: the `AsyncFd` owns the descriptor and nothing replaces or
    // closes it while it is registered.
    Ok(unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? })
}

/// setrlimit(2): its return value (async-signal-safe, for the child).
fn set_rlimit(resource: libc::__rlimit_resource_t, value: u64) -> libc::c_long {
    let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: plain syscall with a valid pointer to a stack value.
    libc::c_long::from(unsafe { libc::setrlimit(resource, &lim) })
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
        loop {
            if let Some(status) = self.exit {
                return Ok(status);
            }
            let Some(exited) = &self.exited else { return Err(std::io::Error::other("not a child any more")) };
            let mut ready = exited.readable().await?;
            match vfork::try_reap(self.pgid)? {
                Some(status) => {
                    drop(ready);
                    self.mark_reaped(status);
                }
                // Not exited after all: wait for the pidfd's next readiness.
                None => ready.clear_ready(),
            }
        }
    }

    /// A future that resolves once the first process has exited (at once
    /// if it has been reaped), without reaping it: a pidfd of its own, so
    /// it can be awaited while the process is held elsewhere.
    pub fn exit_watch(&self) -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
        // Not reaped: the pid is still the child's (a zombie at worst).
        let fd = match self.exit {
            Some(_) => None,
            None => Some(pidfd(self.pgid)?),
        };
        Ok(async move {
            if let Some(fd) = fd {
                let _ = fd.readable().await;
            }
        })
    }

    /// Whether the first process has exited already.
    pub fn has_exited(&mut self) -> bool {
        if self.exit.is_some() {
            return true;
        }
        match vfork::try_reap(self.pgid) {
            Ok(Some(status)) => {
                self.mark_reaped(status);
                true
            }
            _ => false,
        }
    }

    fn mark_reaped(&mut self, status: ExitStatus) {
        self.exit = Some(status);
        self.exited = None;
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

/// A process dropped before it was reaped is killed (its first process;
/// teardown kills the rest of the sandbox) and reaped in the background,
/// so it leaves no zombie.
impl Drop for SandboxProcess {
    fn drop(&mut self) {
        let Some(exited) = self.exited.take() else { return };
        let pid = self.pgid;
        // SAFETY: kill(2) of our own unreaped child: its pid is not reused.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = exited.readable().await;
                    let _ = vfork::reap(pid);
                });
            }
            Err(_) => {
                let _ = vfork::reap(pid);
            }
        }
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
        let groups = groups.entry(sandbox_id.to_string()).or_default();
        // A session restarts its harness: groups already reaped go.
        groups.retain(|(_, reaped)| !reaped.load(Ordering::SeqCst));
        groups.push((process.pgid, process.reaped.clone()));
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
