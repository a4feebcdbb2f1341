//! What a sandbox's host uid leaves on the host outside its own directory,
//! and its removal at teardown.
//!
//! A `none` sandbox runs on the host as its own uid, with the host's IPC
//! namespace, `/tmp`, `/dev/shm`, `/run/lock` and kernel keyrings.
//! Whatever it leaves there under its uid would be readable by the next
//! sandbox given that uid (or, for world-readable objects, by anyone).
//! Teardown, once nothing of the uid is alive, removes:
//!
//! - its System V IPC objects (shared memory, semaphores, message queues):
//!   found in `/proc/sysvipc/{shm,sem,msg}` by owner or creator uid,
//!   removed with `IPC_RMID`;
//! - its top-level entries in the world-writable directories `/tmp`,
//!   `/var/tmp`, `/dev/shm` (POSIX shared memory), `/dev/mqueue` (POSIX
//!   message queues), `/run/lock` (`/var/lock`) and `/var/crash`, where the
//!   host has them ([`SHARED_DIRS`]), unlinked without following symlinks
//!   (a directory goes with everything in it, `remove_dir_all` does not
//!   follow links either).
//!   Files of the uid deeper in other users' directories are not searched;
//! - the keys of its user, user-session and persistent keyrings: a forked
//!   helper takes the uid, joins a fresh session keyring so that it
//!   possesses them, and clears each (`KEYCTL_CLEAR`). Root cannot clear
//!   another uid's keyring directly: the kernel checks write permission,
//!   which only the owner (possessing it) has.
//!
//! Every step reports what it could not do; teardown fails with it rather
//! than recording a clean uid that is not.

use std::path::Path;

/// World-writable directories a process of any uid can leave entries in,
/// on some Linux host or other (`/var/lock` and `/run/shm` are links to
/// others on most; `/run/lock` is 1777 on Debian and Ubuntu, `/var/crash`
/// on Ubuntu). See [`shared_dirs`] for the ones this host has.
pub const SHARED_DIRS: &[&str] =
    &["/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/lock", "/run/shm", "/var/crash"];

/// The [`SHARED_DIRS`] this host has, each once: links resolved (so
/// `/var/lock` and `/run/lock` are one), the missing left out.
pub fn shared_dirs() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    for dir in SHARED_DIRS {
        if let Ok(real) = std::fs::canonicalize(dir) {
            if real.is_dir() && !dirs.contains(&real) {
                dirs.push(real);
            }
        }
    }
    dirs
}

/// Removes everything of `uid` this module knows to look for. Err lists
/// each thing that could not be removed. Call only once no process of
/// `uid` is alive (else it could make new objects meanwhile), and only for
/// a uid that belongs to one sandbox alone.
pub fn purge(uid: u32, gid: u32, dirs: &[&Path]) -> Result<(), String> {
    if uid == 0 {
        return Err("refusing to purge the objects of uid 0".into());
    }
    let mut errors = Vec::new();
    for kind in [Ipc::Shm, Ipc::Sem, Ipc::Msg] {
        errors.extend(remove_ipc(kind, uid));
    }
    for dir in dirs {
        errors.extend(remove_entries_of(dir, uid));
    }
    if let Err(e) = clear_keyrings(uid, gid) {
        errors.push(e);
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// A kind of System V IPC object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipc {
    /// Shared memory segments.
    Shm,
    /// Semaphore sets.
    Sem,
    /// Message queues.
    Msg,
}

impl Ipc {
    fn file(self) -> &'static str {
        match self {
            Ipc::Shm => "/proc/sysvipc/shm",
            Ipc::Sem => "/proc/sysvipc/sem",
            Ipc::Msg => "/proc/sysvipc/msg",
        }
    }

    /// Columns of the id, the owner uid and the creator uid (see
    /// `sysvipc_*_proc_show` in ipc/shm.c, sem.c, msg.c).
    fn columns(self) -> (usize, usize, usize) {
        match self {
            // key shmid perms size cpid lpid nattch uid gid cuid ...
            Ipc::Shm => (1, 7, 9),
            // key semid perms nsems uid gid cuid ...
            Ipc::Sem => (1, 4, 6),
            // key msqid perms cbytes qnum lspid lrpid uid gid cuid ...
            Ipc::Msg => (1, 7, 9),
        }
    }
}

/// Ids of the objects of `kind` that `uid` owns or created, from the text
/// of `/proc/sysvipc/<kind>`.
pub fn ipc_ids_of(kind: Ipc, table: &str, uid: u32) -> Vec<i32> {
    let (id, owner, creator) = kind.columns();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let of = |i: usize| cols.get(i).and_then(|c| c.parse::<u32>().ok());
            let mine = of(owner) == Some(uid) || of(creator) == Some(uid);
            mine.then(|| cols.get(id)?.parse::<i32>().ok()).flatten()
        })
        .collect()
}

fn remove_ipc(kind: Ipc, uid: u32) -> Vec<String> {
    let table = match std::fs::read_to_string(kind.file()) {
        Ok(table) => table,
        // A kernel without System V IPC has nothing to leave behind.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => return vec![format!("read {}: {e}", kind.file())],
    };
    let mut errors = Vec::new();
    for id in ipc_ids_of(kind, &table, uid) {
        // SAFETY: IPC_RMID takes no buffer (null is allowed); the id is
        // an integer the kernel checks.
        let rc = unsafe {
            match kind {
                Ipc::Shm => libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
                Ipc::Sem => libc::semctl(id, 0, libc::IPC_RMID),
                Ipc::Msg => libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()),
            }
        };
        let err = std::io::Error::last_os_error();
        // EINVAL/EIDRM: gone already.
        if rc != 0 && !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::EIDRM)) {
            errors.push(format!("remove System V {kind:?} {id} of uid {uid}: {err}"));
        }
    }
    errors
}

/// Unlinks the top-level entries of `dir` that `uid` owns.
pub fn remove_entries_of(dir: &Path, uid: u32) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => return vec![format!("read {}: {e}", dir.display())],
    };
    let mut errors = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        // lstat: a symlink is judged, and removed, as itself.
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if meta.uid() != uid {
            continue;
        }
        // In a sticky directory only the owner (whose processes are all
        // gone) or root may rename or unlink the entry: it cannot be
        // swapped between the lstat and the removal.
        let removed = if meta.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errors.push(format!("remove {}: {e}", path.display())),
        }
    }
    errors
}

// keyctl(2) commands and special ids (linux/keyctl.h); libc has no constants for them all.
const KEYCTL_JOIN_SESSION_KEYRING: libc::c_long = 1;
const KEYCTL_CLEAR: libc::c_long = 7;
const KEYCTL_LINK: libc::c_long = 8;
const KEYCTL_GET_PERSISTENT: libc::c_long = 22;
const KEY_SPEC_SESSION_KEYRING: libc::c_long = -3;
const KEY_SPEC_USER_KEYRING: libc::c_long = -4;
const KEY_SPEC_USER_SESSION_KEYRING: libc::c_long = -5;

/// Joins a fresh anonymous session keyring: a process spawned for a
/// sandbox must not share the daemon's (root's) session keyring, which it
/// would possess and could write, and which the next sandbox would inherit.
/// Async-signal-safe (one syscall), for a `pre_exec` closure. ENOSYS: a
/// kernel without keyrings, nothing to share.
pub fn join_fresh_session_keyring() -> std::io::Result<()> {
    // SAFETY: keyctl with integer arguments and a null name (anonymous keyring).
    let rc = unsafe { libc::syscall(libc::SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, std::ptr::null::<libc::c_char>()) };
    let err = std::io::Error::last_os_error();
    if rc < 0 && err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    Ok(())
}

/// Clears the user, user-session and persistent keyrings of `uid` in a
/// child that becomes `uid` (and exits without exec). The child shares the
/// daemon's memory rather than copying it (`vfork::spawn`).
fn clear_keyrings(uid: u32, gid: u32) -> Result<(), String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    // The failed step (high half) and its errno (low half).
    let report = AtomicU32::new(0);
    let mut child = || -> libc::c_int {
        // SAFETY: runs in the vfork'd child: close_range, `vfork::become_user`, raw
        // keyctl system calls and an atomic store, nothing else.
        unsafe {
            let fail = |step: u32| -> libc::c_int {
                let errno = *libc::__errno_location() as u32;
                report.store((step << 16) | (errno & 0xffff), Ordering::SeqCst);
                1
            };
            // None of the daemon's files (its data directory's lock) past the daemon.
            if !super::vfork::close_all_but(&[]) {
                return fail(9);
            }
            if !super::vfork::become_user(uid, gid) {
                return fail(1);
            }
            let keyctl2 =
                |cmd: libc::c_long, a: libc::c_long, b: libc::c_long| libc::syscall(libc::SYS_keyctl, cmd, a, b);
            if libc::syscall(libc::SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, std::ptr::null::<libc::c_char>()) < 0 {
                if *libc::__errno_location() == libc::ENOSYS {
                    return 0; // no keyrings in this kernel
                }
                return fail(2);
            }
            // Linked into the session keyring, they are possessed: the
            // possessor may write (clear) them.
            for (step, keyring) in [(3u32, KEY_SPEC_USER_KEYRING), (4, KEY_SPEC_USER_SESSION_KEYRING)] {
                if keyctl2(KEYCTL_LINK, keyring, KEY_SPEC_SESSION_KEYRING) < 0 {
                    return fail(step);
                }
                if keyctl2(KEYCTL_CLEAR, keyring, 0) < 0 {
                    return fail(step + 2);
                }
            }
            let persistent = keyctl2(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING);
            if persistent < 0 {
                // Persistent keyrings are a kernel option.
                if *libc::__errno_location() != libc::EOPNOTSUPP {
                    return fail(7);
                }
            } else if keyctl2(KEYCTL_CLEAR, persistent, 0) < 0 {
                return fail(8);
            }
            0
        }
    };
    // SAFETY: the child keeps to what `vfork::spawn` requires (above).
    let pid = unsafe { super::vfork::spawn(&mut child) }.map_err(|e| format!("keyrings of uid {uid}: clone: {e}"))?;
    let status = super::vfork::reap(pid).map_err(|e| format!("keyrings of uid {uid}: wait: {e}"))?;
    if status.success() {
        return Ok(());
    }
    let report = report.load(Ordering::SeqCst);
    let step = match report >> 16 {
        1 => "become the uid",
        2 => "join a session keyring",
        3 => "possess the user keyring",
        4 => "possess the user-session keyring",
        5 => "clear the user keyring",
        6 => "clear the user-session keyring",
        7 => "find the persistent keyring",
        8 => "clear the persistent keyring",
        9 => "close the daemon's descriptors",
        _ => "run the helper",
    };
    let why = match report {
        0 => format!("status {status}"),
        _ => std::io::Error::from_raw_os_error((report & 0xffff) as i32).to_string(),
    };
    Err(format!("keyrings of uid {uid}: cannot {step}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_tables_are_read_by_owner_and_creator() {
        let shm = "       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime      dtime      ctime                   rss                  swap\n\
                   0 32769 600 4096 10 10 0 300001 300001 300001 300001 0 0 0 4096 0\n\
                   1234 5 600 4096 10 10 0 0 0 300001 0 0 0 0 0 0\n\
                   99 7 600 4096 10 10 0 1000 1000 1000 1000 0 0 0 0 0\n";
        assert_eq!(ipc_ids_of(Ipc::Shm, shm, 300001), vec![32769, 5]);
        let sem = "       key      semid perms      nsems   uid   gid  cuid  cgid      otime      ctime\n\
                   0 3 600 1 300001 300001 300001 300001 0 0\n\
                   0 4 600 1 0 0 0 0 0 0\n";
        assert_eq!(ipc_ids_of(Ipc::Sem, sem, 300001), vec![3]);
        let msg = "       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid      stime      rtime      ctime\n\
                   0 9 600 0 0 0 0 300001 300001 300001 300001 0 0 0\n";
        assert_eq!(ipc_ids_of(Ipc::Msg, msg, 300001), vec![9]);
        assert!(ipc_ids_of(Ipc::Msg, msg, 1).is_empty());
    }

    #[test]
    fn shared_dirs_are_each_named_once_by_their_real_path() {
        let dirs = shared_dirs();
        for (i, dir) in dirs.iter().enumerate() {
            assert_eq!(&std::fs::canonicalize(dir).unwrap(), dir);
            assert!(!dirs[i + 1..].contains(dir), "{} twice: {dirs:?}", dir.display());
        }
        if let Ok(lock) = std::fs::canonicalize("/run/lock") {
            assert!(dirs.contains(&lock), "{dirs:?}");
        }
    }

    #[test]
    fn entries_of_the_uid_go_without_following_links() {
        use std::os::unix::fs::symlink;
        let shared = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "x").unwrap();
        let uid = 3_999_998;
        let own = |p: &Path| std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
        std::fs::write(shared.path().join("file"), "x").unwrap();
        own(&shared.path().join("file"));
        std::fs::create_dir(shared.path().join("dir")).unwrap();
        symlink(outside.path(), shared.path().join("dir/link")).unwrap();
        own(&shared.path().join("dir"));
        symlink(outside.path(), shared.path().join("link")).unwrap();
        own(&shared.path().join("link"));
        std::fs::write(shared.path().join("other"), "x").unwrap();
        assert!(remove_entries_of(shared.path(), uid).is_empty());
        let left: Vec<String> = std::fs::read_dir(shared.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["other".to_string()]);
        assert!(outside.path().join("keep").exists(), "a link was followed");
    }
}
