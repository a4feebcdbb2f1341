//! Files the daemon writes into a sandbox's HOME before its harness starts
//! (a CLI's config). HOME belongs to the sandbox's uid, and a harness that
//! ran before (a restarted session) may have planted links there, so every
//! step is taken relative to an open directory without following a link,
//! and the file is always created anew: a symlink or a hard link to a host
//! file is replaced, never written through.

use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::sandbox::HostUser;

fn cstring(text: &[u8]) -> std::io::Result<CString> {
    CString::new(text).map_err(|_| std::io::Error::other("a path with a NUL byte"))
}

fn check(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens directory `name` under `dir` (or `home` itself when `dir` is
/// `None`), refusing a symlink.
fn open_dir(dir: Option<&OwnedFd>, name: &CString) -> std::io::Result<OwnedFd> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: openat with a valid NUL-terminated name and a directory fd we
    // own (or AT_FDCWD); the returned descriptor is fresh and ours.
    let fd = check(unsafe { libc::openat(at, name.as_ptr(), flags) })?;
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn chown_fd(fd: &OwnedFd, owner: Option<HostUser>) -> std::io::Result<()> {
    let Some(user) = owner else { return Ok(()) };
    // SAFETY: fchown on a descriptor we own.
    check(unsafe { libc::fchown(fd.as_raw_fd(), user.uid, user.gid) }).map(|_| ())
}

/// Writes `contents` to `relative` (e.g. `.codex/config.toml`) under
/// `home`, creating missing directories (mode 0700) and the file (0600),
/// all owned by `owner` (the sandbox's user) when given.
pub fn write_file(home: &Path, relative: &str, contents: &[u8], owner: Option<HostUser>) -> std::io::Result<()> {
    let parts: Vec<&str> = relative.split('/').collect();
    if parts.iter().any(|p| p.is_empty() || *p == "." || *p == "..") {
        return Err(std::io::Error::other(format!("{relative:?} is not a plain relative path")));
    }
    let (file, dirs) = parts.split_last().expect("split always yields one part");
    let mut dir = open_dir(None, &cstring(home.as_os_str().as_bytes())?)?;
    for part in dirs {
        let name = cstring(part.as_bytes())?;
        // SAFETY: mkdirat with a directory fd we own and a valid name.
        let created = match check(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o700) }) {
            Ok(_) => true,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
            Err(e) => return Err(e),
        };
        dir = open_dir(Some(&dir), &name)?;
        if created {
            chown_fd(&dir, owner)?;
        }
    }
    let name = cstring(file.as_bytes())?;
    // SAFETY: unlinkat with a directory fd we own; a missing file is fine.
    if let Err(e) = check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) }) {
        if e.raw_os_error() != Some(libc::ENOENT) {
            return Err(e);
        }
    }
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat with a directory fd we own and a valid name; O_EXCL
    // fails rather than follow anything created meanwhile.
    let fd = check(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, 0o600 as libc::c_uint) })?;
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    chown_fd(&fd, owner)?;
    std::fs::File::from(fd).write_all(contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_through_new_directories_and_replaces_an_old_file() {
        let home = tempfile::tempdir().unwrap();
        write_file(home.path(), ".codex/config.toml", b"one", None).unwrap();
        write_file(home.path(), ".codex/config.toml", b"two", None).unwrap();
        assert_eq!(std::fs::read(home.path().join(".codex/config.toml")).unwrap(), b"two");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(home.path().join(".codex/config.toml")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn never_writes_through_a_link() {
        let home = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("host-file");
        std::fs::write(&target, b"host").unwrap();
        // A symlinked directory is refused.
        std::os::unix::fs::symlink(outside.path(), home.path().join(".codex")).unwrap();
        assert!(write_file(home.path(), ".codex/config.toml", b"x", None).is_err());
        assert!(!outside.path().join("config.toml").exists());
        // A symlinked file and a hard link are replaced, not written through.
        std::fs::remove_file(home.path().join(".codex")).unwrap();
        std::fs::create_dir(home.path().join(".codex")).unwrap();
        std::os::unix::fs::symlink(&target, home.path().join(".codex/config.toml")).unwrap();
        write_file(home.path(), ".codex/config.toml", b"x", None).unwrap();
        std::fs::remove_file(home.path().join(".codex/config.toml")).unwrap();
        std::fs::hard_link(&target, home.path().join(".codex/config.toml")).unwrap();
        write_file(home.path(), ".codex/config.toml", b"y", None).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"host");
        assert_eq!(std::fs::read(home.path().join(".codex/config.toml")).unwrap(), b"y");
        for bad in ["../x", "/etc/passwd", ".codex//x", "./x"] {
            assert!(write_file(home.path(), bad, b"x", None).is_err(), "{bad}");
        }
    }
}
