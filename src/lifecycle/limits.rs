//! The limits a run is held to while it runs, beyond what the sandbox
//! enforces by itself: the workspace's size (watched, and checked at the
//! end), the events it may record (count and bytes of harness text), and
//! the reading of what the sandbox's cgroup cut (OOM kills, refused forks),
//! each turned into one `limit` event.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::events::EventKind;
use crate::sandbox::cgroup::LimitHits;

/// How often a running harness's workspace is measured.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Bytes under `root` (apparent sizes, symlinks not followed), stopping
/// early once past `stop_above`.
pub fn tree_bytes(root: &Path, stop_above: u64) -> u64 {
    let mut total = 0u64;
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            total = total.saturating_add(meta.len());
            if meta.is_dir() {
                stack.push(entry.path());
            }
            if total > stop_above {
                return total;
            }
        }
    }
    total
}

/// A watch over a workspace while a turn runs: past `limit` bytes it
/// cancels the turn and remembers the size it saw.
pub struct WorkspaceWatch {
    task: tokio::task::JoinHandle<()>,
    seen: Arc<AtomicU64>,
}

impl WorkspaceWatch {
    pub fn start(workspace: PathBuf, limit: u64, cancel: CancellationToken) -> WorkspaceWatch {
        let seen = Arc::new(AtomicU64::new(0));
        let found = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(WATCH_EVERY).await;
                let ws = workspace.clone();
                let Ok(bytes) = tokio::task::spawn_blocking(move || tree_bytes(&ws, limit)).await else { return };
                if bytes > limit {
                    found.store(bytes, Ordering::SeqCst);
                    cancel.cancel();
                    return;
                }
            }
        });
        WorkspaceWatch { task, seen }
    }

    /// Stops watching; the size that broke the limit, if one did.
    pub fn stop(self) -> Option<u64> {
        self.task.abort();
        Some(self.seen.load(Ordering::SeqCst)).filter(|b| *b > 0)
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

/// The `limit` event and raw sentence for a workspace over its limit.
pub fn workspace_hit(bytes: u64, limit: u64) -> (EventKind, String) {
    let detail = format!("the workspace grew to {bytes} bytes, over limits.max_workspace_bytes = {limit}");
    (EventKind::LimitHit { limit: "workspace".into(), value: limit, detail: detail.clone() }, detail)
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

    #[test]
    fn tree_bytes_counts_files_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/a"), vec![0u8; 1000]).unwrap();
        std::os::unix::fs::symlink("/usr", dir.path().join("link")).unwrap();
        let total = tree_bytes(dir.path(), u64::MAX);
        assert!((1000..1000 + 8192).contains(&total), "{total}");
        assert!(tree_bytes(dir.path(), 10) > 10);
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
