//! A host-wide claim on a root daemon's sandbox uid range.
//!
//! Each daemon allocates uids from its own store, so two daemons on one host
//! (two data directories, two stores) would hand the same host uid to two
//! sandboxes at once: one tenant's processes, files and IPC would be the
//! other's. A daemon therefore claims its range for its whole life, in a
//! directory every daemon on the host shares (`[sandbox] lock_dir`, default
//! `/run/corral`):
//!
//! - `uids-<first>-<last>.lock`, one per live daemon, held under an
//!   exclusive `flock(2)` from start to exit. It names the daemon (pid, data
//!   directory). The kernel drops the lock when the daemon dies, even by
//!   SIGKILL, so a stale file never blocks a new daemon: it is found
//!   unlocked and removed.
//! - `registry.lock`, held exclusively only while a starting daemon reads
//!   the directory and writes its own file, so two daemons starting at once
//!   cannot both miss each other.
//!
//! A range that overlaps a live one, equal or not, is refused naming both.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::host::UidRange;

/// The claim; dropping it (or the daemon dying) releases the range.
#[derive(Debug)]
pub struct UidRangeLock {
    /// Holds the flock; never read.
    _file: File,
    /// The lock file (`uids-<first>-<last>.lock` in the lock directory).
    pub path: PathBuf,
}

/// The file name that claims `range`.
fn file_name(range: UidRange) -> String {
    format!("uids-{}-{}.lock", range.first, range.last)
}

/// The range a claim file names, if `name` is one.
fn parse_name(name: &str) -> Option<UidRange> {
    let inner = name.strip_prefix("uids-")?.strip_suffix(".lock")?;
    let (a, b) = inner.split_once('-')?;
    let range = UidRange { first: a.parse().ok()?, last: b.parse().ok()? };
    (range.first <= range.last).then_some(range)
}

fn overlaps(a: UidRange, b: UidRange) -> bool {
    a.first <= b.last && b.first <= a.last
}

/// `flock(2)` exclusive on `file`: blocking, or `Ok(false)` if another
/// open file description holds it (`LOCK_NB`). (std's `File::lock` is
/// newer than this crate's minimum Rust.)
pub(crate) fn flock_exclusive(file: &File, wait: bool) -> std::io::Result<bool> {
    let op = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
    loop {
        // SAFETY: flock(2) on a descriptor `file` owns for the call.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if !wait => return Ok(false),
            _ => return Err(err),
        }
    }
}

fn open_rw(path: &Path) -> std::io::Result<File> {
    // 0644: other daemons (all root) read who holds a range; nobody else writes.
    OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o644).open(path)
}

/// Claims `range` for this daemon (whose data directory is `data_dir`) in
/// `dir`. Err names the live daemon whose range overlaps, or what failed.
pub fn claim(dir: &Path, range: UidRange, data_dir: &Path) -> Result<UidRangeLock, String> {
    let ours = format!("{}-{}", range.first, range.last);
    let fail = |what: &str, path: &Path, e: std::io::Error| {
        format!("cannot claim sandbox uids {ours} in {}: {what} {}: {e}", dir.display(), path.display())
    };
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir).map_err(|e| fail("create", dir, e))?;
    let registry_path = dir.join("registry.lock");
    let registry = open_rw(&registry_path).map_err(|e| fail("open", &registry_path, e))?;
    flock_exclusive(&registry, true).map_err(|e| fail("lock", &registry_path, e))?;
    let entries = std::fs::read_dir(dir).map_err(|e| fail("read", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| fail("read", dir, e))?;
        let Some(theirs) = entry.file_name().to_str().and_then(parse_name) else { continue };
        if !overlaps(range, theirs) {
            continue;
        }
        let path = entry.path();
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(fail("open", &path, e)),
        };
        match flock_exclusive(&file, false) {
            Ok(true) => {
                // Its daemon is gone (the kernel let go of its lock): stale.
                drop(file);
                std::fs::remove_file(&path).map_err(|e| fail("remove stale", &path, e))?;
            }
            Ok(false) => {
                let mut holder = String::new();
                let _ = file.take(4096).read_to_string(&mut holder);
                let holder = holder.split_whitespace().collect::<Vec<_>>().join(" ");
                return Err(format!(
                    "sandbox uids {ours} of this daemon (data directory {}) overlap uids {}-{} of a running daemon ({}; \
                     lock {}): two daemons would run sandboxes as the same host uid; give each daemon its own \
                     [sandbox] uids range",
                    data_dir.display(),
                    theirs.first,
                    theirs.last,
                    if holder.is_empty() { "unknown pid and data directory".to_string() } else { holder },
                    path.display()
                ));
            }
            Err(e) => return Err(fail("lock", &path, e)),
        }
    }
    let path = dir.join(file_name(range));
    let mut file = open_rw(&path).map_err(|e| fail("open", &path, e))?;
    // No other daemon can hold it: it was removed above if stale, and the
    // registry lock keeps other claimers out.
    match flock_exclusive(&file, false) {
        Ok(true) => {}
        Ok(false) => return Err(fail("lock", &path, std::io::Error::from_raw_os_error(libc::EWOULDBLOCK))),
        Err(e) => return Err(fail("lock", &path, e)),
    }
    file.set_len(0).map_err(|e| fail("truncate", &path, e))?;
    let text = format!("pid {} data_dir {}\n", std::process::id(), data_dir.display());
    file.write_all(text.as_bytes()).map_err(|e| fail("write", &path, e))?;
    drop(registry);
    Ok(UidRangeLock { _file: file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u32, last: u32) -> UidRange {
        UidRange { first, last }
    }

    #[test]
    fn names_round_trip_and_overlap_is_inclusive() {
        assert_eq!(parse_name(&file_name(range(5, 9))), Some(range(5, 9)));
        for bad in ["uids-9-5.lock", "registry.lock", "uids-1.lock", "uids-a-b.lock", "uids-1-2.lock.tmp"] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
        assert!(overlaps(range(1, 10), range(10, 20)));
        assert!(overlaps(range(5, 6), range(1, 100)));
        assert!(!overlaps(range(1, 9), range(10, 20)));
    }

    #[test]
    fn a_live_claim_refuses_equal_and_overlapping_ranges_and_frees_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let held = claim(dir.path(), range(100, 199), Path::new("/data/a")).expect("first claim");
        for (first, last) in [(100, 199), (150, 160), (199, 300), (0, 100)] {
            let err = claim(dir.path(), range(first, last), Path::new("/data/b")).unwrap_err();
            assert!(err.contains("/data/a") && err.contains("/data/b"), "{err}");
            assert!(err.contains(&format!("pid {}", std::process::id())) && err.contains("100-199"), "{err}");
        }
        let beside = claim(dir.path(), range(200, 299), Path::new("/data/c")).expect("a disjoint range");
        drop(held);
        let again = claim(dir.path(), range(150, 160), Path::new("/data/b")).expect("free once dropped");
        assert!(!dir.path().join("uids-100-199.lock").exists(), "the stale claim file is removed");
        drop((again, beside));
    }
}
