//! Starting a child without copying the daemon: `clone(CLONE_VM |
//! CLONE_VFORK)`, as glibc's `posix_spawn` does. A `fork` copies the
//! daemon's page tables and then makes every page the daemon writes before
//! the child's `exec` a copy-on-write fault; with many runs at once that
//! was a tenth of all CPU (BENCHMARKS.md). Here the child borrows the
//! daemon's memory and a stack of its own, the calling thread waits until
//! the child has called `execve` (or exited), and nothing is copied.
//!
//! The price is what the child may do: it shares memory with the daemon's
//! other threads, which keep running. So it allocates nothing, takes no
//! lock, and calls glibc only where glibc is a plain system call: the
//! identity changes are raw `setgroups`/`setresgid`/`setresuid` system
//! calls, because glibc's wrappers would signal every thread of what they
//! take for this process (its memory says it has the daemon's threads). No
//! handler of the daemon's may run in it: every signal is blocked across
//! the clone, and the child sets each handled signal back to its default
//! before it unblocks them.

use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack. Its code is a few dozen system calls.
const STACK_BYTES: usize = 64 * 1024;

struct Call<'a> {
    child: &'a mut dyn FnMut() -> libc::c_int,
}

extern "C" fn trampoline(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Call` that `spawn` keeps alive (its thread is
    // suspended until this child execs or exits). The loop makes only
    // sigaction/sigprocmask system calls on stack values.
    unsafe {
        let call = &mut *arg.cast::<Call>();
        for signal in 1..=64 {
            if signal == libc::SIGKILL || signal == libc::SIGSTOP {
                continue;
            }
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
                continue; // glibc's own signals
            }
            // A handler is the daemon's code: back to the default. An
            // ignored signal stays ignored across exec, except SIGPIPE
            // (Rust's runtime ignores it; std's Command restores it too).
            let ignored = old.sa_sigaction == libc::SIG_IGN && signal != libc::SIGPIPE;
            if old.sa_sigaction != libc::SIG_DFL && !ignored {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        let code = (call.child)();
        libc::_exit(code)
    }
}

/// Runs `child` in a new process that shares this one's memory, and
/// returns its pid once it has called `execve` or exited.
///
/// # Safety
///
/// `child` runs in the new process, concurrently with this process's other
/// threads, on a small stack: it must make only async-signal-safe system
/// calls, allocate and free nothing, take no lock, call no glibc wrapper
/// that acts on "all threads" (`setuid` and friends: use the raw system
/// calls), and end in `execve` or return an exit status (it then exits
/// with `_exit`). What it writes to memory, the caller sees after this
/// returns.
pub unsafe fn spawn(child: &mut dyn FnMut() -> libc::c_int) -> std::io::Result<libc::pid_t> {
    let mut stack = vec![0u8; STACK_BYTES];
    // The stack grows down from its (16-byte aligned) top.
    let top = (stack.as_mut_ptr() as usize + STACK_BYTES) & !15;
    let mut call = Call { child };
    // SAFETY: signal masks on stack values; clone with a stack that
    // outlives the child's use of it (CLONE_VFORK: this thread resumes
    // only once the child has exec'd or exited) and an argument likewise.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            trampoline,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut call as *mut Call).cast(),
        );
        let error = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        drop(stack);
        if pid < 0 {
            return Err(error);
        }
        Ok(pid)
    }
}

/// Closes, in a child of [`spawn`], every descriptor from 3 up but those
/// in `keep` (sorted, ascending): the child's copies of the daemon's
/// files, which the child would otherwise hold until its `execve`. A child
/// still on its way there when the daemon is SIGKILLed (blocked writing a
/// cgroup's `cgroup.procs`, say) held the data directory's lock, and a
/// daemon restarted at once found it "in use by a running daemon". Closing
/// a copy drops the child's reference alone (the daemon's `flock` and
/// `fcntl` locks stay: the table is the child's own). Async-signal-safe;
/// false on failure, with errno set.
pub fn close_all_but(keep: &[libc::c_int]) -> bool {
    let close = |first: libc::c_int, last: libc::c_uint| {
        // SAFETY: close_range on this child's own descriptor table.
        unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, last, 0 as libc::c_uint) == 0 }
    };
    let mut from = 3;
    for &fd in keep {
        if fd < from {
            continue;
        }
        if fd > from && !close(from, (fd - 1) as libc::c_uint) {
            return false;
        }
        from = fd + 1;
    }
    close(from, libc::c_uint::MAX)
}

/// Becomes `uid`:`gid` with no supplementary groups, in a child of
/// [`spawn`]: the raw system calls, which change this task alone (glibc's
/// wrappers would act on every thread of the daemon, whose memory the child
/// shares). Async-signal-safe; false on failure, with errno set.
pub fn become_user(uid: u32, gid: u32) -> bool {
    let (uid, gid) = (libc::c_long::from(uid), libc::c_long::from(gid));
    // SAFETY: three system calls with integer arguments and a null list.
    unsafe {
        libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0
            && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
            && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
    }
}

/// Where a child records the first step that failed and its errno, for the
/// parent to read after [`spawn`] returns.
#[derive(Default)]
pub struct Failure(AtomicI32);

impl Failure {
    /// Records errno (async-signal-safe: one atomic store).
    pub fn record(&self) {
        // SAFETY: reads this thread's errno.
        let errno = unsafe { *libc::__errno_location() };
        self.0.store(errno.max(1), Ordering::SeqCst);
    }

    /// The recorded errno, if any.
    pub fn get(&self) -> Option<std::io::Error> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            errno => Some(std::io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Reaps `pid` without waiting: its wait status once it has exited.
pub fn try_reap(pid: libc::pid_t) -> std::io::Result<Option<std::process::ExitStatus>> {
    use std::os::unix::process::ExitStatusExt;
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child with a valid pointer.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 => return Ok(None),
            p if p == pid => return Ok(Some(std::process::ExitStatus::from_raw(status))),
            _ => {
                let error = std::io::Error::last_os_error();
                if error.kind() != std::io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
}

/// Reaps `pid`, blocking until it exits.
pub fn reap(pid: libc::pid_t) -> std::io::Result<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid pointer.
    while unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    Ok(std::process::ExitStatus::from_raw(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_writes_what_the_parent_reads_and_exits_with_its_status() {
        let seen = AtomicI32::new(0);
        let mut child = || {
            seen.store(7, Ordering::SeqCst);
            3
        };
        // SAFETY: the child makes one atomic store and returns.
        let pid = unsafe { spawn(&mut child) }.unwrap();
        // The parent resumed only once the child was gone.
        assert_eq!(seen.load(Ordering::SeqCst), 7);
        assert_eq!(reap(pid).unwrap().code(), Some(3));
    }

    #[test]
    fn a_failed_exec_is_reported_with_its_errno() {
        let failure = Failure::default();
        let program = c"/nonexistent/program";
        let argv = [program.as_ptr(), std::ptr::null()];
        let envp = [std::ptr::null::<libc::c_char>()];
        let mut child = || {
            // SAFETY: execve with NUL-terminated arrays of C strings.
            unsafe { libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            failure.record();
            127
        };
        // SAFETY: execve, an atomic store, return.
        let pid = unsafe { spawn(&mut child) }.unwrap();
        assert_eq!(failure.get().unwrap().raw_os_error(), Some(libc::ENOENT));
        assert_eq!(reap(pid).unwrap().code(), Some(127));
        assert!(try_reap(pid).is_err(), "reaped once only");
    }
}
