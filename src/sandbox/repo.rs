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
//!
//! The git directory is opened the same way, beneath the repository:
//! `<repo>/.git` must be a real directory (a symlink or a gitfile could
//! lead host git, which runs as the daemon, into any repository on the
//! host), or, with no `.git` at all, the named directory must itself be a
//! bare repository. Inside it nothing that git would follow elsewhere is
//! accepted: no `commondir`, no symlink among `HEAD`, `packed-refs`,
//! `config` or the directories of `objects/` and `refs/`. Host git is then
//! pointed at that open directory (`--git-dir=/proc/<pid>/fd/<n>`) and never
//! looks for a repository by itself.

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
    /// Its git directory leads elsewhere, so host git cannot be kept to it.
    #[error("{0}")]
    GitDir(String),
}

/// The one sentence every refusal of `repo` gets.
pub const NOT_ALLOWED: &str = "is not an allowed repository";

/// A repository directory held open, with its git directory: what git is
/// pointed at.
#[derive(Debug)]
pub struct OpenRepo {
    fd: OwnedFd,
    canonical: PathBuf,
    git_dir: OwnedFd,
    canonical_git_dir: PathBuf,
}

impl OpenRepo {
    /// Opens `canonical` (a path [`resolve`] returned) again, refusing any
    /// symlink on the way, and its git directory as [`resolve`] did: what
    /// was checked is what is used.
    pub fn reopen(canonical: &Path) -> Result<OpenRepo, Refused> {
        let fd = openat2(libc::AT_FDCWD, canonical, libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS)
            .map_err(Refused::Open)?;
        OpenRepo::with_git_dir(fd, canonical.to_path_buf())
    }

    /// Opens the git directory of the repository open at `fd`: `.git`
    /// beneath it, a real directory, or else `fd` itself (a bare
    /// repository; [`super::workspace::is_git_repo`] tells whether it is
    /// one). Refuses what would lead git out of it.
    fn with_git_dir(fd: OwnedFd, canonical: PathBuf) -> Result<OpenRepo, Refused> {
        let beneath = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        let git_dir = match openat2(fd.as_raw_fd(), Path::new(".git"), beneath) {
            Ok(git_dir) => git_dir,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(Refused::GitDir("its .git is a symlink".into()));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                return Err(Refused::GitDir(
                    "its .git is a gitfile (a worktree or a submodule), not a directory".into(),
                ));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => fd.try_clone().map_err(Refused::Open)?,
            Err(e) => return Err(Refused::Open(e)),
        };
        kept_inside(&git_dir)?;
        let canonical_git_dir = fd_path(&git_dir).map_err(Refused::Open)?;
        Ok(OpenRepo { fd, canonical, git_dir, canonical_git_dir })
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

    /// The path that reaches exactly the opened git directory (`.git`, or
    /// the repository itself if bare), for a child process: what host git
    /// gets as `--git-dir`.
    pub fn git_dir_proc_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.git_dir.as_raw_fd()))
    }

    /// The canonical path of the git directory.
    pub fn canonical_git_dir(&self) -> &Path {
        &self.canonical_git_dir
    }
}

/// At most this many directories under `objects/` and `refs/` are looked
/// at; a git directory with more is refused rather than half checked.
const MAX_GIT_DIRS: usize = 100_000;

/// Refuses a git directory (open at `git_dir`) that would lead git
/// elsewhere: a `commondir` (refs and objects in another repository), a
/// symlinked `HEAD`, `packed-refs` or `config`, or a symlink among the
/// directories of `objects/` and `refs/` (where a fetch writes). A missing
/// entry is no refusal here: whether it is a repository at all is git's to
/// say.
fn kept_inside(git_dir: &OwnedFd) -> Result<(), Refused> {
    let refuse = |what: &str| Err(Refused::GitDir(format!("its git directory has {what}")));
    for name in ["commondir", "HEAD", "packed-refs", "config"] {
        match lstat_at(git_dir, name) {
            Ok(_) if name == "commondir" => return refuse("a commondir (it shares another repository's refs)"),
            Ok(mode) if mode & libc::S_IFMT == libc::S_IFLNK => return refuse(&format!("a symlink {name}")),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(Refused::Open(e)),
        }
    }
    let beneath = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    let mut seen = 0usize;
    for top in ["objects", "refs"] {
        let dir = match openat2(git_dir.as_raw_fd(), Path::new(top), beneath) {
            Ok(dir) => dir,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENOTDIR)) => {
                return refuse(&format!("{top} that is no directory (a symlink?)"));
            }
            Err(e) => return Err(Refused::Open(e)),
        };
        let mut stack = vec![(dir, PathBuf::from(top))];
        while let Some((dir, path)) = stack.pop() {
            seen += 1;
            if seen > MAX_GIT_DIRS {
                return refuse(&format!("more than {MAX_GIT_DIRS} directories under objects/ and refs/"));
            }
            let listing = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())).map_err(Refused::Open)?;
            for entry in listing {
                let entry = entry.map_err(Refused::Open)?;
                let kind = entry.file_type().map_err(Refused::Open)?;
                if kind.is_symlink() {
                    return refuse(&format!("a symlink {}", path.join(entry.file_name()).display()));
                }
                if kind.is_dir() {
                    let sub =
                        openat2(dir.as_raw_fd(), Path::new(&entry.file_name()), beneath).map_err(Refused::Open)?;
                    stack.push((sub, path.join(entry.file_name())));
                }
            }
        }
    }
    Ok(())
}

/// The `st_mode` of `name` in the directory open at `dir`, not following a
/// symlink.
fn lstat_at(dir: &OwnedFd, name: &str) -> std::io::Result<libc::mode_t> {
    let c_name = CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `stat` is plain data; zeroed is a valid value.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, a valid C string and a properly sized
    // `stat` the kernel writes into.
    let rc = unsafe { libc::fstatat(dir.as_raw_fd(), c_name.as_ptr(), &mut stat, libc::AT_SYMLINK_NOFOLLOW) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stat.st_mode)
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
        return OpenRepo::with_git_dir(fd, canonical);
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
