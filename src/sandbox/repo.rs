//! Repositories are policy: a request's `repo` must lie beneath one of the
//! daemon's `repo_roots` (and, when the principal has them, beneath one of
//! its own `repos` prefixes), and it is opened there without ever leaving
//! the root, so a symlink cannot point it elsewhere.
//!
//! Every refusal reads the same ("is not an allowed repository"), whatever
//! exists on the host: a root daemon must not become an oracle for which
//! paths exist or what they are.
//!
//! The path is checked lexically against the roots before the filesystem is
//! touched at all; then it is opened with `openat2(RESOLVE_BENEATH)` below
//! the root (a symlink there must be relative and stay beneath the root),
//! and the canonical path is what the kernel says the opened
//! directory is. Later uses (the clone, the fetch back) open that canonical
//! path again with `RESOLVE_NO_SYMLINKS` and hand git the open directory
//! (`/proc/<pid>/fd/<n>`), so a symlink swapped in between the check and
//! the use makes the use fail instead of reaching another directory.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// Why a path was refused, for the daemon's own log. The caller is told
/// only [`NOT_ALLOWED`].
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The path is not beneath any of the daemon's `repo_roots`.
    #[error("not beneath any of the daemon's repo_roots")]
    OutsideRoots,
    /// The path is not beneath any repository the principal may use.
    #[error("not beneath any of the principal's repos")]
    OutsidePrincipal,
    /// The path could not be opened beneath its root (it is missing, or resolves outside it).
    #[error("cannot be opened beneath its root: {0}")]
    Open(std::io::Error),
    /// The directory is not a git repository.
    #[error("not a git repository")]
    NotGit,
}

/// The one sentence every refusal of `repo` gets.
pub const NOT_ALLOWED: &str = "is not an allowed repository";

/// A repository directory held open: what git is pointed at.
#[derive(Debug)]
pub struct OpenRepo {
    fd: OwnedFd,
    canonical: PathBuf,
}

impl OpenRepo {
    /// Opens `canonical` (a path [`resolve`] returned) again, refusing any
    /// symlink on the way: what was checked is what is used.
    pub fn reopen(canonical: &Path) -> std::io::Result<OpenRepo> {
        let fd = openat2(libc::AT_FDCWD, canonical, libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS)?;
        Ok(OpenRepo { fd, canonical: canonical.to_path_buf() })
    }

    /// The path that reaches exactly the opened directory, for a child
    /// process of this one (git): `/proc/<pid>/fd/<n>`.
    pub fn proc_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd()))
    }

    /// The canonical path it was opened at.
    pub fn canonical(&self) -> &Path {
        &self.canonical
    }
}

/// `path` lexically normal: absolute, `.` and repeated slashes dropped; a
/// `..` or a relative path is `None`.
fn normal(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(part) => out.push(part),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    path.is_absolute().then_some(out)
}

/// The part of `path` below `root` (both lexically normal), if any.
fn below<'a>(path: &'a Path, root: &Path) -> Option<&'a Path> {
    path.strip_prefix(root).ok()
}

/// `openat2(dirfd, path, O_PATH | O_DIRECTORY | O_CLOEXEC, resolve)`.
fn openat2(dirfd: libc::c_int, path: &Path, resolve: u64) -> std::io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `open_how` is plain data; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // SAFETY: openat2 with a valid C string and a properly sized open_how;
    // the returned descriptor (if any) is owned by us alone.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dirfd,
            c_path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor returned by the kernel, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// What a descriptor's path is, as the kernel says.
fn fd_path(fd: &OwnedFd) -> std::io::Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Checks `value` against `roots` (the daemon's) and `prefixes` (the
/// principal's; empty: no further restriction) and opens it. The roots are
/// compared as written and as they resolve, so a root that is itself a
/// symlink (`/srv/repos` → `/data/repos`) works either way.
pub fn resolve(value: &Path, roots: &[PathBuf], prefixes: &[PathBuf]) -> Result<OpenRepo, Refused> {
    let path = normal(value).ok_or(Refused::OutsideRoots)?;
    let mut candidates = Vec::new();
    for root in roots {
        let Some(root) = normal(root) else { continue };
        if let Some(rest) = below(&path, &root) {
            candidates.push((root.clone(), rest.to_path_buf()));
        }
        if let Ok(real) = root.canonicalize() {
            if real != root {
                if let Some(rest) = below(&path, &real) {
                    candidates.push((real, rest.to_path_buf()));
                }
            }
        }
    }
    if candidates.is_empty() {
        return Err(Refused::OutsideRoots);
    }
    // Before anything is opened: the principal's prefixes, as written.
    let lexically_allowed =
        |p: &Path| prefixes.is_empty() || prefixes.iter().filter_map(|x| normal(x)).any(|x| p.starts_with(x));
    if !lexically_allowed(&path) {
        return Err(Refused::OutsidePrincipal);
    }
    let mut last = Refused::OutsideRoots;
    for (root, rest) in candidates {
        let root_fd = match openat2(libc::AT_FDCWD, &root, libc::RESOLVE_NO_MAGICLINKS) {
            Ok(fd) => fd,
            Err(e) => {
                last = Refused::Open(e);
                continue;
            }
        };
        let rel = if rest.as_os_str().is_empty() { Path::new(".") } else { rest.as_path() };
        let fd = match openat2(root_fd.as_raw_fd(), rel, libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS) {
            Ok(fd) => fd,
            Err(e) => {
                last = Refused::Open(e);
                continue;
            }
        };
        let canonical = fd_path(&fd).map_err(Refused::Open)?;
        // A symlink inside the root may lead elsewhere inside it: the
        // prefixes are checked again on where it really is.
        if !lexically_allowed(&canonical) {
            return Err(Refused::OutsidePrincipal);
        }
        return Ok(OpenRepo { fd, canonical });
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_lexically() {
        assert_eq!(normal(Path::new("/srv//repos/./a/")), Some(PathBuf::from("/srv/repos/a")));
        assert_eq!(normal(Path::new("/srv/repos/../etc")), None);
        assert_eq!(normal(Path::new("srv/repos")), None);
        assert_eq!(below(Path::new("/srv/repos/a"), Path::new("/srv/repos")), Some(Path::new("a")));
        assert_eq!(
            below(Path::new("/srv/repository"), Path::new("/srv/repos")),
            None,
            "a prefix of a name is not a parent"
        );
    }

    #[test]
    fn only_what_lies_beneath_a_root_opens() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("team/a")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside"), root.join("escape")).unwrap();
        std::os::unix::fs::symlink("team/a", root.join("alias")).unwrap();
        std::os::unix::fs::symlink(root.join("team/a"), root.join("absolute")).unwrap();
        let roots = vec![root.clone()];
        let canonical_a = root.join("team/a").canonicalize().unwrap();
        assert_eq!(resolve(&root.join("team/a"), &roots, &[]).unwrap().canonical(), canonical_a);
        assert_eq!(
            resolve(&root.join("alias"), &roots, &[]).unwrap().canonical(),
            canonical_a,
            "a link within the root"
        );
        assert!(matches!(resolve(&root.join("escape"), &roots, &[]), Err(Refused::Open(_))), "a link out of the root");
        assert!(matches!(resolve(&root.join("absolute"), &roots, &[]), Err(Refused::Open(_))), "an absolute link");
        assert!(matches!(resolve(&dir.path().join("outside"), &roots, &[]), Err(Refused::OutsideRoots)));
        assert!(matches!(resolve(Path::new("/etc/shadow"), &roots, &[]), Err(Refused::OutsideRoots)));
        assert!(matches!(resolve(&root.join("missing"), &roots, &[]), Err(Refused::Open(_))));
        let only_b = vec![root.join("team/b")];
        assert!(matches!(resolve(&root.join("team/a"), &roots, &only_b), Err(Refused::OutsidePrincipal)));
        assert!(
            matches!(resolve(&root.join("alias"), &roots, &[root.join("alias")]), Err(Refused::OutsidePrincipal)),
            "prefixes hold where the link leads"
        );
        assert!(resolve(&root.join("team/a"), &roots, &[root.join("team")]).is_ok());
    }

    #[test]
    fn a_reopen_refuses_a_swapped_in_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir(&repo).unwrap();
        let open = resolve(&repo, &[dir.path().to_path_buf()], &[]).unwrap();
        assert!(OpenRepo::reopen(open.canonical()).is_ok());
        assert!(std::fs::metadata(open.proc_path()).unwrap().is_dir());
        std::fs::remove_dir(&repo).unwrap();
        std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &repo).unwrap();
        assert!(OpenRepo::reopen(open.canonical()).is_err(), "followed a symlink swapped in after the check");
    }
}
