//! What recovery may believe of a `sandboxes` row. The store is not trusted:
//! anyone who can write to it (a shared PostgreSQL, a tampered SQLite file)
//! could otherwise make a restarted root daemon delete any directory or
//! signal any process. So a row is acted on only when its id is one this
//! daemon could have made, its path is the one derived from that id under
//! the daemon's own `sandboxes/` directory, and its uid is in the daemon's
//! own range; and a process is signalled only when its uid is one the
//! daemon hands to sandboxes (never 0).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox::UidRange;
use crate::store::SandboxRow;

/// The uids whose processes recovery may signal: the configured sandbox
/// range of a root daemon, or the unprivileged daemon's own uid (its
/// sandboxes run as it). Never uid 0.
#[derive(Clone, Copy, Debug)]
pub(super) enum SignalScope {
    Range(UidRange),
    Own(u32),
}

impl SignalScope {
    pub(super) fn new(range: Option<UidRange>) -> SignalScope {
        match range {
            Some(range) => SignalScope::Range(range),
            None => SignalScope::Own(crate::sandbox::host::effective_uid()),
        }
    }

    pub(super) fn allows(&self, uid: u32) -> bool {
        uid != 0
            && match self {
                SignalScope::Range(range) => (range.first..=range.last).contains(&uid),
                SignalScope::Own(own) => uid == *own,
            }
    }
}

/// A sandbox id as the daemon makes them: a UUID in its canonical
/// lowercase hyphenated form (36 characters, nothing else), so it can
/// never name a path component other than itself nor a cgroup elsewhere.
pub(super) fn is_own_id(id: &str) -> bool {
    uuid::Uuid::parse_str(id).map(|u| u.hyphenated().to_string() == id).unwrap_or(false)
}

/// Why recovery must not act on `row`, if it must not: the path it may
/// touch is derived from the id, never taken from the row.
pub(super) fn refuse_reason(row: &SandboxRow, sandboxes_dir: &Path, scope: SignalScope) -> Option<String> {
    if !is_own_id(&row.sandbox_id) {
        return Some(format!("sandbox id {:?} is not an id this daemon makes", clip(&row.sandbox_id)));
    }
    let derived = derived_root(sandboxes_dir, &row.sandbox_id);
    if row.root_path != derived && !same_place(&row.root_path, sandboxes_dir, &row.sandbox_id) {
        return Some(format!(
            "recorded path {} is not {} (the path derived from its id)",
            row.root_path.display(),
            derived.display()
        ));
    }
    match (row.uid, scope) {
        (Some(uid), SignalScope::Range(_)) if !scope.allows(uid) => {
            Some(format!("recorded uid {uid} is outside this daemon's sandbox uid range"))
        }
        (Some(uid), SignalScope::Own(_)) => {
            Some(format!("recorded uid {uid}, but this daemon gives sandboxes no uid of their own"))
        }
        _ => None,
    }
}

/// Whether `recorded` is `<id>` in `sandboxes_dir` spelled otherwise (the
/// data directory given through a symlink, or relative, at another start):
/// its last component is the id and its parent resolves to the same
/// directory. What is removed is still the derived path.
fn same_place(recorded: &Path, sandboxes_dir: &Path, id: &str) -> bool {
    let (Some(name), Some(parent)) = (recorded.file_name(), recorded.parent()) else { return false };
    name == id
        && match (std::fs::canonicalize(parent), std::fs::canonicalize(sandboxes_dir)) {
            (Ok(recorded), Ok(own)) => recorded == own,
            _ => false,
        }
}

/// `<sandboxes_dir>/<id>`: the only path recovery ever removes for a row.
pub(super) fn derived_root(sandboxes_dir: &Path, id: &str) -> PathBuf {
    sandboxes_dir.join(id)
}

/// Removes every `<id>.bundle` in `sandboxes_dir` whose id is one this
/// daemon makes: the private copy of a run's capture bundle, which the run
/// removes once fetched (`lifecycle::capture`), so one found at start is a
/// crashed run's. The name is read from the directory, not from the
/// store; a directory is left, a link is removed (not followed). Returns
/// how many went.
pub(super) fn remove_bundles(sandboxes_dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(sandboxes_dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some(id) = name.to_str().and_then(bundle_of) else { continue };
        if !is_own_id(id) || entry.file_type().map_or(true, |t| t.is_dir()) {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed += 1,
            Err(error) => {
                tracing::error!(path = %entry.path().display(), %error, "leftover capture bundle not removed")
            }
        }
    }
    removed
}

/// The run id a capture bundle's name carries: `<id>.bundle`, the private
/// copy, or `<id>.bundle.<32 hex>`, the link the fetch back pins its path
/// with (`sandbox::workspace`), left by a crash during the fetch.
fn bundle_of(name: &str) -> Option<&str> {
    if let Some(id) = name.strip_suffix(".bundle") {
        return Some(id);
    }
    let (rest, pin) = name.rsplit_once('.')?;
    let pinned = pin.len() == 32 && pin.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    rest.strip_suffix(".bundle").filter(|_| pinned)
}

fn clip(text: &str) -> String {
    text.chars().take(80).collect()
}

/// The uids (real, effective, saved, filesystem) of a process, from its
/// `/proc/<pid>/status`.
fn process_uids(pid: i32) -> Option<[u32; 4]> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut uids = line.split_whitespace().map(|u| u.parse::<u32>().ok());
    Some([uids.next()??, uids.next()??, uids.next()??, uids.next()??])
}

fn carries_id(pid: i32, needle: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|env| env.split(|b| *b == 0).any(|var| var == needle))
        .unwrap_or(false)
}

fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative return is a fresh fd that we alone own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Every process whose environment names `CORRAL_SANDBOX_ID=<id>` (that is
/// how a sandbox's processes are found again without trusting a recorded
/// pid) and whose every uid `scope` allows is sent SIGKILL, through a pidfd
/// taken before the checks so a recycled pid is never hit. A process that
/// carries the id under a uid outside `scope` is logged and left alone.
/// Returns how many were killed.
pub(super) async fn kill_sandbox_processes(sandbox_id: &str, scope: SignalScope) -> usize {
    let needle = format!("CORRAL_SANDBOX_ID={sandbox_id}");
    let mut killed = 0;
    let mut spared = Vec::new();
    for _ in 0..20 {
        let Ok(proc_dir) = std::fs::read_dir("/proc") else { break };
        let pids: Vec<i32> = proc_dir
            .filter_map(|entry| entry.ok())
            .filter_map(|entry| entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
            .collect();
        let mut found = false;
        for pid in pids {
            let Some(pidfd) = pidfd_open(pid) else { continue };
            if !carries_id(pid, needle.as_bytes()) {
                continue;
            }
            let Some(uids) = process_uids(pid) else { continue };
            if !uids.iter().all(|uid| scope.allows(*uid)) {
                if !spared.contains(&pid) {
                    tracing::error!(
                        sandbox_id,
                        pid,
                        uid = uids[0],
                        "recovery does not signal a process whose uid is outside this daemon's sandbox uids"
                    );
                    spared.push(pid);
                }
                continue;
            }
            found = true;
            // SAFETY: pidfd_send_signal(2) on a pidfd we own; no memory is passed.
            let sent = unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<u8>(), 0)
            };
            if sent == 0 {
                killed += 1;
            }
        }
        if !found {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, root: &str, uid: Option<u32>) -> SandboxRow {
        SandboxRow {
            sandbox_id: id.into(),
            subject_id: "s".into(),
            backend: "linux_bwrap".into(),
            root_path: root.into(),
            uid,
            destroying: false,
        }
    }

    const ID: &str = "0192f0c1-7b5e-7c3a-9d2e-3f4a5b6c7d8e";

    #[test]
    fn only_own_ids_paths_and_uids_are_trusted() {
        let dir = Path::new("/var/lib/corral/sandboxes");
        let scope = SignalScope::Range(UidRange { first: 1000, last: 1999 });
        let good = format!("{}/{ID}", dir.display());
        assert_eq!(refuse_reason(&row(ID, &good, Some(1500)), dir, scope), None);
        assert_eq!(refuse_reason(&row(ID, &good, None), dir, scope), None);
        for bad_id in
            ["../../etc", "", "0192F0C1-7B5E-7C3A-9D2E-3F4A5B6C7D8E", "0192f0c17b5e7c3a9d2e3f4a5b6c7d8e", "x/y"]
        {
            let reason = refuse_reason(&row(bad_id, &good, None), dir, scope).expect(bad_id);
            assert!(reason.contains("not an id"), "{reason}");
        }
        let reason = refuse_reason(&row(ID, "/home/victim", None), dir, scope).unwrap();
        assert!(reason.contains("/home/victim") && reason.contains("derived"), "{reason}");
        let reason = refuse_reason(&row(ID, &format!("{good}/.."), None), dir, scope).unwrap();
        assert!(reason.contains("derived"), "{reason}");
        for uid in [0, 999, 2000, 4343] {
            let reason = refuse_reason(&row(ID, &good, Some(uid)), dir, scope).expect("uid outside");
            assert!(reason.contains(&format!("uid {uid}")), "{reason}");
        }
        assert!(refuse_reason(&row(ID, &good, Some(1500)), dir, SignalScope::Own(1500)).is_some());
    }

    #[test]
    fn the_sandboxes_directory_spelled_otherwise_is_the_same_place() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("data").join("sandboxes");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::create_dir_all(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("data"), dir.path().join("alias")).unwrap();
        let scope = SignalScope::Own(1000);
        let via = dir.path().join("alias").join("sandboxes").join(ID);
        assert_eq!(refuse_reason(&row(ID, via.to_str().unwrap(), None), &own, scope), None);
        let elsewhere = dir.path().join("elsewhere").join(ID);
        assert!(refuse_reason(&row(ID, elsewhere.to_str().unwrap(), None), &own, scope).is_some());
        let other_id = own.join("0192f0c1-7b5e-7c3a-9d2e-3f4a5b6c7d8f");
        assert!(refuse_reason(&row(ID, other_id.to_str().unwrap(), None), &own, scope).is_some());
    }

    #[test]
    fn only_bundles_named_by_an_own_id_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let pin = "0123456789abcdef0123456789abcdef";
        let kept = [
            "keep.bundle".to_string(),
            ID.into(),
            format!("{ID}.bundle.tmp"),
            format!("{ID}.bundle.{}", pin.to_uppercase()),
            format!("keep.bundle.{pin}"),
        ];
        for name in kept.iter().cloned().chain([format!("{ID}.bundle"), format!("{ID}.bundle.{pin}")]) {
            std::fs::write(dir.path().join(name), "x").unwrap();
        }
        std::fs::create_dir(dir.path().join("0192f0c1-7b5e-7c3a-9d2e-3f4a5b6c7d8f.bundle")).unwrap();
        assert_eq!(remove_bundles(dir.path()), 2, "the private copy and the link the fetch back pinned");
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut expected: Vec<String> =
            kept.into_iter().chain(["0192f0c1-7b5e-7c3a-9d2e-3f4a5b6c7d8f.bundle".to_string()]).collect();
        expected.sort();
        assert_eq!(left, expected);
    }

    #[test]
    fn uid_zero_is_never_signalled() {
        assert!(!SignalScope::Range(UidRange { first: 0, last: 10 }).allows(0));
        assert!(!SignalScope::Own(0).allows(0));
        assert!(SignalScope::Own(1000).allows(1000) && !SignalScope::Own(1000).allows(1001));
    }
}
