//! The limits a run is held to while it runs, beyond what the sandbox
//! enforces by itself: the workspace's size (watched, and checked at the
//! end), the events it may record (count and bytes of harness text), and
//! the reading of what the sandbox's cgroup cut (OOM kills, refused forks),
//! each turned into one `limit` event.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::events::EventKind;
use crate::sandbox::cgroup::{LimitHits, SandboxCgroup};
use crate::sandbox::open_to_owner;

/// How often a running harness's workspace is measured, at most (a tree
/// that takes long to walk is walked less often).
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// How long a kill of a sandbox over its workspace budget may take.
const KILL_PAST_BUDGET: Duration = Duration::from_secs(10);

/// What a sandbox's own tree holds: bytes (the larger of each file's
/// apparent size and its allocated blocks, plus the blocks of files its
/// processes deleted but keep open) and inodes (every file, directory and
/// link below the root).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeUsage {
    /// Bytes the tree holds on disk or claims to (see above).
    pub bytes: u64,
    /// Files, directories and links below the root.
    pub inodes: u64,
}

impl TreeUsage {
    /// What a tree counts as when a directory in it cannot be read: over
    /// any budget (what it holds cannot be known, so it is not allowed).
    pub const UNMEASURABLE: TreeUsage = TreeUsage { bytes: u64::MAX, inodes: u64::MAX };
}

/// `max_workspace_bytes` and `max_workspace_inodes` of a run; 0 = not limited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeBudget {
    /// `max_workspace_bytes`.
    pub max_bytes: u64,
    /// `max_workspace_inodes`.
    pub max_inodes: u64,
}

impl TreeBudget {
    /// The budget a profile's `[limits]` set.
    pub fn from_limits(limits: &crate::catalog::Limits) -> TreeBudget {
        TreeBudget { max_bytes: limits.max_workspace_bytes, max_inodes: limits.max_workspace_inodes }
    }

    /// Whether either limit is set.
    pub fn is_limited(&self) -> bool {
        self.max_bytes > 0 || self.max_inodes > 0
    }

    /// Whether `usage` is over either limit.
    pub fn exceeded_by(&self, usage: TreeUsage) -> bool {
        (self.max_bytes > 0 && usage.bytes > self.max_bytes) || (self.max_inodes > 0 && usage.inodes > self.max_inodes)
    }
}

/// What one file costs the budget: its apparent size, or what it holds on
/// disk when that is more (`fallocate --keep-size` allocates blocks past
/// the end of a file, which no size shows and RLIMIT_FSIZE does not stop).
fn file_bytes(meta: &std::fs::Metadata) -> u64 {
    meta.len().max(meta.blocks().saturating_mul(512))
}

/// Bytes and inodes under `root` (symlinks not followed), stopping early
/// once past `budget`. The root is the sandbox's own directory, so the
/// workspace, HOME and any other writable place under it are all counted,
/// and so are the files on its filesystem that its uid's processes
/// deleted but keep open (see [`unlinked_open_bytes`]).
///
/// Each directory is opened relative to its parent, so no path the walk
/// uses is longer than one name: a tree deeper than `PATH_MAX` cannot hide
/// what is below it. A directory that cannot be read at all makes the tree
/// [`TreeUsage::UNMEASURABLE`], over any budget.
pub fn tree_usage(root: &Path, budget: TreeBudget, cgroup: Option<&SandboxCgroup>) -> TreeUsage {
    walk(root, budget, cgroup, u64::MAX).unwrap_or(TreeUsage::UNMEASURABLE)
}

/// Entries a walk may read on the async worker (see [`small_tree_usage`]).
pub const SMALL_TREE: u64 = 64;

/// The largest directory (its own size) a walk on the async worker reads.
const SMALL_DIR_BYTES: u64 = 64 << 10;

/// [`tree_usage`] of a small tree whose sandbox runs nothing: `None` once
/// the tree has more than `max_entries` entries or a directory larger
/// than [`SMALL_DIR_BYTES`], or when its cgroup holds
/// a process (or cannot say), whose deleted but open files may take long
/// to look at. Quick enough for the async worker at the end of a run,
/// where a hop to a blocking thread and back costs more than the walk;
/// `None` is for [`tree_usage`] off the worker.
pub fn small_tree_usage(
    root: &Path,
    budget: TreeBudget,
    cgroup: &SandboxCgroup,
    max_entries: u64,
) -> Option<TreeUsage> {
    if !cgroup.holds_no_process() {
        return None;
    }
    walk(root, budget, Some(cgroup), max_entries)
}

/// [`tree_usage`], or `None` past `max_entries` entries.
fn walk(root: &Path, budget: TreeBudget, cgroup: Option<&SandboxCgroup>, max_entries: u64) -> Option<TreeUsage> {
    let mut usage = TreeUsage::default();
    let Ok(top) = std::fs::symlink_metadata(root) else { return Some(usage) };
    let euid = crate::sandbox::host::effective_uid();
    open_to_owner(root, &top, euid);
    let Ok(root_dir) = open_dir(None, root.as_os_str()) else { return Some(usage) };
    // Directories still to read, each as its parent and its name: a
    // parent stays open only while a child of it waits.
    let mut pending: Vec<(Rc<File>, OsString)> = Vec::new();
    let mut next = Some(Rc::new(root_dir));
    loop {
        let dir = match next.take() {
            Some(dir) => dir,
            None => match pending.pop() {
                None => break,
                Some((parent, name)) => match open_dir(Some(&parent), &name) {
                    Ok(dir) => Rc::new(dir),
                    // Removed since it was listed.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(_) => return Some(TreeUsage::UNMEASURABLE),
                },
            },
        };
        let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())) else {
            return Some(TreeUsage::UNMEASURABLE);
        };
        for entry in entries {
            let Ok(entry) = entry else { return Some(TreeUsage::UNMEASURABLE) };
            usage.inodes += 1;
            if usage.inodes > max_entries {
                return None;
            }
            // fstatat(2) in the directory read: no path.
            let Ok(meta) = entry.metadata() else { continue };
            usage.bytes = usage.bytes.saturating_add(file_bytes(&meta));
            if meta.is_dir() {
                // A directory that once held many entries reads slowly
                // however few it holds now (its size stays).
                if max_entries != u64::MAX && meta.len() > SMALL_DIR_BYTES {
                    return None;
                }
                open_child_to_owner(&dir, &entry.file_name(), &meta, euid);
                pending.push((dir.clone(), entry.file_name()));
            }
            if budget.exceeded_by(usage) {
                return Some(usage);
            }
        }
    }
    // The sandbox's user owns its workspace (the daemon's own uid when the
    // daemon is not root). Never root: a root daemon gives every sandbox a
    // uid of its own, and root's deleted files are the host's.
    let owner = std::fs::symlink_metadata(root.join("workspace")).ok().filter(|m| m.uid() != 0);
    if let Some(workspace) = owner.filter(|_| budget.max_bytes > 0) {
        let held = unlinked_open_bytes(workspace.uid(), top.dev(), cgroup);
        usage.bytes = usage.bytes.saturating_add(held);
    }
    Some(usage)
}

/// Directory `name`, in `parent` when given (else a path), opened without
/// following a link.
fn open_dir(parent: Option<&File>, name: &OsStr) -> std::io::Result<File> {
    let name = CString::new(name.as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let at = parent.map_or(libc::AT_FDCWD, |p| p.as_raw_fd());
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat(2) with a valid C string; the fd it returns is ours.
    let fd = unsafe { libc::openat(at, name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// [`open_to_owner`] for directory `name` in `parent`: a daemon that is not
/// root can read what its sandbox's uid (its own) closed to itself.
fn open_child_to_owner(parent: &File, name: &OsStr, meta: &std::fs::Metadata, euid: u32) {
    let mode = meta.mode() & 0o7777;
    if euid == 0 || meta.uid() != euid || mode & 0o700 == 0o700 {
        return;
    }
    let Ok(name) = CString::new(name.as_bytes()) else { return };
    // SAFETY: fchmodat(2) on a directory fd we hold and a valid C string.
    unsafe { libc::fchmodat(parent.as_raw_fd(), name.as_ptr(), mode | 0o700, 0) };
}

/// Open files and mappings [`unlinked_open_bytes`] looks at in one
/// measure, over all the sandbox's processes: a million stats take about
/// a second; a harness that dups a descriptor millions of times would
/// otherwise make each measure take minutes (and the limit come late).
const MAX_HELD_LINKS: usize = 1_000_000;

/// Blocks, on device `dev`, of the files that processes of host uid `uid`
/// hold open (or mapped) after deleting them: they are nowhere in the tree
/// but fill its disk all the same until the last holder exits. Each file
/// counts once, whoever holds it how often; the daemon's own files never.
/// The holders are the processes of the sandbox's cgroup when it has one
/// (one read, whatever runs on the host), else every process in `/proc`
/// whose real uid is `uid`. More than [`MAX_HELD_LINKS`] to look at:
/// `u64::MAX` (over any byte budget).
pub fn unlinked_open_bytes(uid: u32, dev: u64, cgroup: Option<&SandboxCgroup>) -> u64 {
    unlinked_open_bytes_within(uid, dev, cgroup, MAX_HELD_LINKS)
}

/// [`unlinked_open_bytes`] looking at no more than `max_links`.
fn unlinked_open_bytes_within(uid: u32, dev: u64, cgroup: Option<&SandboxCgroup>, max_links: usize) -> u64 {
    let me = std::process::id().to_string();
    let holders: Vec<String> = match cgroup {
        Some(cgroup) => cgroup.pids().iter().map(|p| p.to_string()).filter(|p| *p != me).collect(),
        None => {
            let Ok(procs) = std::fs::read_dir("/proc") else { return 0 };
            procs
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|p| p.bytes().all(|b| b.is_ascii_digit()) && *p != me)
                .filter(|p| real_uid(p) == Some(uid))
                .collect()
        }
    };
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0u64;
    let mut looked = 0usize;
    for pid in &holders {
        for table in ["fd", "map_files"] {
            let Ok(held) = std::fs::read_dir(format!("/proc/{pid}/{table}")) else { continue };
            for link in held.flatten() {
                // Each is a stat(2): past the bound, the sandbox holds more
                // than can be looked at in one tick, and counts as full.
                looked += 1;
                if looked > max_links {
                    return u64::MAX;
                }
                // stat(2) follows the link to the file itself, deleted or not.
                let Ok(meta) = std::fs::metadata(link.path()) else { continue };
                if meta.nlink() == 0 && meta.dev() == dev && meta.is_file() && seen.insert(meta.ino()) {
                    bytes = bytes.saturating_add(file_bytes(&meta));
                }
            }
        }
    }
    bytes
}

/// The real uid of process `pid` (from its status, which a process cannot
/// hide by making itself undumpable as it can the owner of its `/proc` entry).
fn real_uid(pid: &str) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// A watch over a sandbox's tree while a turn runs: past its budget it
/// cancels the turn and remembers what it saw. Between a session's turns
/// (see [`WorkspaceWatch::between_turns`]) it kills the sandbox's processes
/// instead: nothing else would stop them filling the disk until the next
/// turn or the end.
pub struct WorkspaceWatch {
    task: tokio::task::JoinHandle<()>,
    seen: Arc<(AtomicU64, AtomicU64)>,
}

/// What a watch does past its budget.
enum Past {
    /// Cancels the turn.
    Cancel(CancellationToken),
    /// Kills every process of the sandbox (through its cgroup).
    Kill,
}

impl WorkspaceWatch {
    pub fn start(
        root: PathBuf,
        budget: TreeBudget,
        cgroup: Option<Arc<SandboxCgroup>>,
        cancel: CancellationToken,
    ) -> WorkspaceWatch {
        Self::spawn(root, budget, cgroup, Past::Cancel(cancel))
    }

    /// A watch while no turn runs: past the budget, every process of the
    /// sandbox is killed (a sandbox without a cgroup is only found over at
    /// its next turn or its end).
    pub fn between_turns(root: PathBuf, budget: TreeBudget, cgroup: Option<Arc<SandboxCgroup>>) -> WorkspaceWatch {
        Self::spawn(root, budget, cgroup, Past::Kill)
    }

    fn spawn(root: PathBuf, budget: TreeBudget, cgroup: Option<Arc<SandboxCgroup>>, past: Past) -> WorkspaceWatch {
        let seen = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let found = seen.clone();
        let task = tokio::spawn(async move {
            let mut pause = WATCH_EVERY;
            loop {
                tokio::time::sleep(pause).await;
                let (dir, measured) = (root.clone(), cgroup.clone());
                let walking = std::time::Instant::now();
                let Ok(usage) =
                    tokio::task::spawn_blocking(move || tree_usage(&dir, budget, measured.as_deref())).await
                else {
                    return;
                };
                // A large tree is measured less often: a watch costs at
                // most a tenth of one CPU (an idle session's too).
                pause = WATCH_EVERY.max(walking.elapsed() * 9);
                if budget.exceeded_by(usage) {
                    found.0.store(usage.bytes, Ordering::SeqCst);
                    found.1.store(usage.inodes, Ordering::SeqCst);
                    match (past, cgroup) {
                        (Past::Cancel(cancel), _) => cancel.cancel(),
                        (Past::Kill, Some(cgroup)) => {
                            if let Err(e) = cgroup.kill_all(KILL_PAST_BUDGET).await {
                                tracing::warn!(error = %e, "a sandbox over its workspace budget not killed");
                            }
                        }
                        (Past::Kill, None) => {}
                    }
                    return;
                }
            }
        });
        WorkspaceWatch { task, seen }
    }

    /// Stops watching; what broke the budget, if anything did.
    pub fn stop(self) -> Option<TreeUsage> {
        let usage = TreeUsage { bytes: self.seen.0.load(Ordering::SeqCst), inodes: self.seen.1.load(Ordering::SeqCst) };
        Some(usage).filter(|u| u.inodes > 0)
    }
}

/// A watch ends with its turn, however the turn ends (a panic included):
/// left running, it would measure a tree gone long ago every 250 ms.
impl Drop for WorkspaceWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The event budget of one run.
#[derive(Debug, Default)]
pub struct EventBudget {
    pub max_events: u64,
    pub max_bytes: u64,
    events: u64,
    bytes: u64,
    /// Events dropped since the budget ran out.
    pub dropped: u64,
}

impl EventBudget {
    pub fn new(max_events: u64, max_bytes: u64) -> EventBudget {
        EventBudget { max_events, max_bytes, ..EventBudget::default() }
    }

    /// Whether an event carrying `bytes` of harness text may be recorded.
    /// The first refusal returns the `limit` event to record in its place.
    #[allow(clippy::result_large_err)] // built once per run, at the cut
    pub fn admit(&mut self, bytes: usize) -> Result<(), Option<EventKind>> {
        let bytes = bytes as u64;
        if self.dropped > 0 {
            self.dropped += 1;
            return Err(None);
        }
        let (limit, value) = if self.events >= self.max_events {
            ("events", self.max_events)
        } else if self.bytes.saturating_add(bytes) > self.max_bytes {
            ("event_bytes", self.max_bytes)
        } else {
            self.events += 1;
            self.bytes += bytes;
            return Ok(());
        };
        self.dropped = 1;
        let detail = format!(
            "limits.max_{limit} reached after {} events and {} bytes: further progress is not recorded",
            self.events, self.bytes
        );
        Err(Some(EventKind::LimitHit { limit: limit.into(), value, detail }))
    }
}

/// What the cgroup cut since `before`, as `limit` events with the raw
/// sentence for the direct caller.
pub fn cgroup_hits(before: LimitHits, now: LimitHits, memory: u64, pids: u64) -> Vec<(EventKind, String)> {
    let mut out = Vec::new();
    if now.memory_oom_kills > before.memory_oom_kills {
        let n = now.memory_oom_kills - before.memory_oom_kills;
        let detail = format!("the sandbox reached limits.memory_bytes = {memory}: {n} process(es) killed");
        out.push((EventKind::LimitHit { limit: "memory".into(), value: memory, detail: detail.clone() }, detail));
    }
    if now.pids_refused > before.pids_refused {
        let n = now.pids_refused - before.pids_refused;
        let detail = format!("the sandbox reached limits.max_processes = {pids}: {n} fork(s) refused");
        out.push((EventKind::LimitHit { limit: "pids".into(), value: pids, detail: detail.clone() }, detail));
    }
    out
}

/// The `limit` event and raw sentence for a sandbox tree over its budget
/// (bytes first, when both broke): `workspace` in bytes, or
/// `workspace_inodes` in files.
pub fn workspace_hit(usage: TreeUsage, budget: TreeBudget) -> (EventKind, String) {
    let (detail, value, limit) = if usage == TreeUsage::UNMEASURABLE {
        let (value, limit) = match budget.max_bytes {
            0 => (budget.max_inodes, "workspace_inodes"),
            bytes => (bytes, "workspace"),
        };
        (
            "the sandbox's workspace and HOME hold a directory that cannot be read, so their size cannot be \
          measured: counted as over budget"
                .to_string(),
            value,
            limit,
        )
    } else if budget.max_bytes > 0 && usage.bytes > budget.max_bytes {
        (
            format!(
                "the sandbox's workspace and HOME grew to {} bytes, over limits.max_workspace_bytes = {}",
                usage.bytes, budget.max_bytes
            ),
            budget.max_bytes,
            "workspace",
        )
    } else {
        (
            format!(
                "the sandbox's workspace and HOME hold {} files, over limits.max_workspace_inodes = {}",
                usage.inodes, budget.max_inodes
            ),
            budget.max_inodes,
            "workspace_inodes",
        )
    };
    (EventKind::LimitHit { limit: limit.into(), value, detail: detail.clone() }, detail)
}

/// At most this many `egress` events per run; later attempts are counted
/// in the evidence only, so a connect loop cannot flood the store.
pub const MAX_EGRESS_EVENTS: u64 = 1000;

/// The `egress` events a run has recorded, against [`MAX_EGRESS_EVENTS`].
#[derive(Debug, Default)]
pub struct EgressEvents {
    recorded: u64,
}

impl EgressEvents {
    /// Whether one more event may be recorded (and counts it if so).
    pub fn admit(&mut self) -> bool {
        if self.recorded >= MAX_EGRESS_EVENTS {
            return false;
        }
        self.recorded += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_cuts_once_and_then_counts() {
        let mut budget = EventBudget::new(3, 1000);
        assert!(budget.admit(10).is_ok() && budget.admit(10).is_ok() && budget.admit(10).is_ok());
        match budget.admit(10) {
            Err(Some(EventKind::LimitHit { limit, value, .. })) => assert_eq!((limit.as_str(), value), ("events", 3)),
            other => panic!("expected one limit event, got {other:?}"),
        }
        assert!(matches!(budget.admit(1), Err(None)));
        assert_eq!(budget.dropped, 2);
    }

    #[test]
    fn bytes_cut_too() {
        let mut budget = EventBudget::new(100, 25);
        assert!(budget.admit(20).is_ok());
        assert!(matches!(budget.admit(6), Err(Some(EventKind::LimitHit { ref limit, .. })) if limit == "event_bytes"));
    }

    /// The walk on the async worker: the full walk's answer for a tree of
    /// at most `max_entries` whose cgroup runs nothing, else `None` (a
    /// process in the cgroup, a `cgroup.procs` that cannot be read, one
    /// entry too many).
    #[test]
    fn a_small_tree_of_a_sandbox_that_runs_nothing_is_walked_inline() {
        use crate::sandbox::cgroup::{tests::fixture::Tree, CgroupHost, CgroupLimits};
        let fixture = Tree::v2(&["memory", "pids"], true);
        let host = CgroupHost::detect(fixture.path(), "corral");
        let cgroup =
            host.create("sb1", &CgroupLimits { memory_bytes: 1 << 20, max_processes: 8, cpu_millis: 0 }).unwrap();
        let procs = fixture.path().join("corral/sb1/cgroup.procs");
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("workspace/d")).unwrap();
        std::fs::create_dir(dir.path().join("home")).unwrap();
        std::fs::write(dir.path().join("workspace/d/a"), vec![0u8; 1000]).unwrap();
        let budget = TreeBudget { max_bytes: 1 << 20, max_inodes: 100 };
        let full = tree_usage(dir.path(), budget, Some(&cgroup));
        assert_eq!(full.inodes, 4, "workspace, d, a, home: {full:?}");
        assert_eq!(small_tree_usage(dir.path(), budget, &cgroup, 4), Some(full));
        assert_eq!(small_tree_usage(dir.path(), budget, &cgroup, 3), None, "one entry too many");
        // A directory larger than 64 KiB (4,000 entries, on ext4 and tmpfs
        // alike) is not read inline, however many entries may be.
        let big = dir.path().join("workspace/big");
        std::fs::create_dir(&big).unwrap();
        (0..4000).for_each(|i| std::fs::write(big.join(format!("f{i}")), "").unwrap());
        let size = std::fs::metadata(&big).unwrap().len();
        assert!(size > SMALL_DIR_BYTES, "{size}");
        let roomy = TreeBudget { max_bytes: 1 << 30, max_inodes: 1 << 20 };
        assert_eq!(small_tree_usage(dir.path(), roomy, &cgroup, 1 << 20), None, "a directory of {size} bytes");
        std::fs::remove_dir_all(&big).unwrap();
        std::fs::write(&procs, "4242\n").unwrap();
        assert_eq!(small_tree_usage(dir.path(), budget, &cgroup, 64), None, "a process runs");
        std::fs::remove_file(&procs).unwrap();
        std::fs::create_dir(&procs).unwrap();
        assert_eq!(small_tree_usage(dir.path(), budget, &cgroup, 64), None, "cgroup.procs cannot be read");
    }

    #[test]
    fn tree_usage_counts_bytes_and_inodes_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("workspace/d")).unwrap();
        std::fs::create_dir(dir.path().join("home")).unwrap();
        std::fs::write(dir.path().join("workspace/d/a"), vec![0u8; 1000]).unwrap();
        std::fs::write(dir.path().join("home/big"), vec![0u8; 5000]).unwrap();
        std::os::unix::fs::symlink("/usr", dir.path().join("workspace/link")).unwrap();
        let none = TreeBudget::default();
        let usage = tree_usage(dir.path(), none, None);
        assert!((6000..6000 + 5 * 8192).contains(&usage.bytes), "{usage:?}");
        assert_eq!(usage.inodes, 6, "workspace, d, a, home, big, link: {usage:?}");
        let bytes = TreeBudget { max_bytes: 5500, max_inodes: 0 };
        assert!(bytes.exceeded_by(tree_usage(dir.path(), bytes, None)), "HOME counts");
        let inodes = TreeBudget { max_bytes: 0, max_inodes: 5 };
        assert!(inodes.exceeded_by(tree_usage(dir.path(), inodes, None)));
        assert!(!TreeBudget { max_bytes: 1 << 20, max_inodes: 6 }.exceeded_by(usage));
        let (event, raw) = workspace_hit(TreeUsage { bytes: 10, inodes: 9 }, inodes);
        assert!(raw.contains("9 files, over limits.max_workspace_inodes = 5"), "{raw}");
        let EventKind::LimitHit { limit, value, .. } = event else { panic!("{event:?}") };
        assert_eq!((limit.as_str(), value), ("workspace_inodes", 5), "a count of files, not bytes");
        let (event, _) =
            workspace_hit(TreeUsage { bytes: 6000, inodes: 9 }, TreeBudget { max_bytes: 5500, max_inodes: 5 });
        let EventKind::LimitHit { limit, value, .. } = event else { panic!("{event:?}") };
        assert_eq!((limit.as_str(), value), ("workspace", 5500), "bytes first when both broke");
    }

    /// A chain of directories deeper than PATH_MAX (4096 bytes) hides
    /// nothing: what is at its bottom is counted.
    #[test]
    fn a_tree_deeper_than_path_max_is_counted_to_its_bottom() {
        let dir = tempfile::tempdir().unwrap();
        let name = "d".repeat(200);
        let mut at = open_dir(None, dir.path().as_os_str()).unwrap();
        for _ in 0..30 {
            let c = CString::new(name.as_str()).unwrap();
            // SAFETY: mkdirat(2) in a directory fd we hold.
            assert_eq!(unsafe { libc::mkdirat(at.as_raw_fd(), c.as_ptr(), 0o755) }, 0);
            at = open_dir(Some(&at), OsStr::new(&name)).unwrap();
        }
        // 30 * 201 bytes deep: the file is past PATH_MAX from the root.
        let c = CString::new("bottom").unwrap();
        // SAFETY: openat(2) creating a file in a directory fd we hold.
        let fd = unsafe {
            libc::openat(at.as_raw_fd(), c.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o644)
        };
        assert!(fd >= 0);
        // SAFETY: the fd just opened.
        let mut bottom = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        std::io::Write::write_all(&mut bottom, &vec![1u8; 1 << 20]).unwrap();
        let usage = tree_usage(dir.path(), TreeBudget::default(), None);
        assert_eq!(usage.inodes, 31, "{usage:?}");
        assert!(usage.bytes >= 1 << 20, "{usage:?}");
        assert!(TreeBudget { max_bytes: 512 << 10, max_inodes: 0 }.exceeded_by(usage));
        let (_, raw) = workspace_hit(TreeUsage::UNMEASURABLE, TreeBudget { max_bytes: 10, max_inodes: 0 });
        assert!(raw.contains("cannot be read"), "{raw}");
    }

    /// More open files and mappings than can be looked at in one measure
    /// count as over any byte budget, rather than taking minutes.
    #[test]
    fn too_many_held_files_to_look_at_count_as_full() {
        let dev = std::fs::metadata("/proc/self").map(|m| m.dev()).unwrap();
        // This host's root processes hold more than 3 descriptors between them.
        assert_eq!(unlinked_open_bytes_within(0, dev, None, 3), u64::MAX);
        assert_ne!(unlinked_open_bytes_within(0, dev, None, usize::MAX), u64::MAX);
    }

    #[test]
    fn cgroup_hits_name_only_what_grew() {
        let before = LimitHits { memory_oom_kills: 1, pids_refused: 0 };
        let now = LimitHits { memory_oom_kills: 1, pids_refused: 4 };
        let hits = cgroup_hits(before, now, 1, 50);
        assert_eq!(hits.len(), 1);
        assert!(hits[0].1.contains("max_processes = 50: 4 fork(s) refused"), "{}", hits[0].1);
    }
}
