//! The host side of the sandbox boundary: which host uid a sandbox runs
//! as, what this host can enforce (the capability report), and how every
//! process of a sandbox is found again by its uid.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use serde::Deserialize;

use super::process::HostUser;

/// The `[sandbox]` section of the daemon config.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// Host uids (and gids) a root daemon runs sandboxes as, `first-last`;
    /// each live sandbox holds one of its own.
    pub uids: String,
    /// Where the cgroup hierarchies are mounted.
    pub cgroup_mount: std::path::PathBuf,
    /// The cgroup directory corral creates one child per sandbox in.
    pub cgroup_parent: String,
    /// Where a root daemon claims its `uids` range for its life, shared by
    /// every daemon on the host (see `uid_lock`): a second daemon whose
    /// range overlaps a live one refuses to start.
    pub lock_dir: std::path::PathBuf,
    /// Warm sandboxes to keep ready, by profile reference (`"builtin.noop"
    /// = 2`, at most [`MAX_WARM`]): made ahead of any request, each serves
    /// one execution or session.
    pub warm: std::collections::BTreeMap<String, usize>,
}

/// The most warm sandboxes one profile's pool may keep.
pub const MAX_WARM: usize = 256;

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            uids: "200000-265535".into(),
            cgroup_mount: "/sys/fs/cgroup".into(),
            cgroup_parent: "corral".into(),
            lock_dir: "/run/corral".into(),
            warm: Default::default(),
        }
    }
}

impl SandboxConfig {
    /// The warm sandboxes of every pool together.
    pub fn warm_total(&self) -> usize {
        self.warm.values().sum()
    }

    /// Errors name the key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        UidRange::parse(&self.uids).map_err(|e| ("sandbox.uids".to_string(), e))?;
        let parent = &self.cgroup_parent;
        if parent.is_empty() || parent.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
            return Err(("sandbox.cgroup_parent".into(), format!("{parent:?} must be a relative path without '..'")));
        }
        for (profile, size) in &self.warm {
            if *size > MAX_WARM {
                return Err((format!("sandbox.warm.{profile:?}"), format!("{size} is above {MAX_WARM}")));
            }
        }
        Ok(())
    }
}

/// An inclusive range of host uids for sandboxes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UidRange {
    /// The lowest uid of the range.
    pub first: u32,
    /// The highest uid of the range (inclusive).
    pub last: u32,
}

impl UidRange {
    /// `first-last`; both above 0, first ≤ last, and never 65534 (nobody)
    /// or 4294967295 (the kernel's "no uid").
    pub fn parse(text: &str) -> Result<UidRange, String> {
        let (a, b) = text.split_once('-').ok_or_else(|| format!("{text:?} is not first-last"))?;
        let parse = |s: &str| s.trim().parse::<u32>().map_err(|e| format!("{text:?}: {s:?}: {e}"));
        let range = UidRange { first: parse(a)?, last: parse(b)? };
        if range.first == 0 || range.first > range.last {
            return Err(format!("{text:?} must be a non-empty range above 0"));
        }
        if range.contains(65534) || range.contains(u32::MAX) {
            return Err(format!("{text:?} must not contain 65534 (nobody) or 4294967295"));
        }
        Ok(range)
    }

    /// Whether `uid` lies in the range.
    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

/// Who sandboxes run as on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UidMode {
    /// A root daemon: each sandbox gets its own uid from the range.
    PerSandbox(UidRange),
    /// An unprivileged daemon: sandboxes run as the daemon's own uid.
    Daemon {
        /// The daemon's effective uid.
        uid: u32,
        /// The daemon's effective gid.
        gid: u32,
    },
}

impl UidMode {
    /// Per-sandbox uids from `range` when the daemon runs as root, else the
    /// daemon's own uid.
    pub fn detect(range: UidRange) -> UidMode {
        // SAFETY: getters with no arguments and no failure mode.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if uid == 0 {
            UidMode::PerSandbox(range)
        } else {
            UidMode::Daemon { uid, gid }
        }
    }

    /// A sentence for `corral doctor` and the startup log saying who sandboxes run as.
    pub fn describe(&self) -> String {
        match self {
            UidMode::PerSandbox(r) => format!("one host uid per sandbox from {}-{}", r.first, r.last),
            UidMode::Daemon { uid, .. } => {
                format!("the daemon runs as uid {uid}, not root: every sandbox runs as uid {uid} (no uid of its own)")
            }
        }
    }
}

/// The daemon's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: a getter with no arguments and no failure mode.
    unsafe { libc::geteuid() }
}

/// The uid inside every sandbox (its user namespace maps it to the host uid).
pub const INSIDE_UID: u32 = 1000;

/// A sandbox's own host user, from a uid the store allocated.
pub fn own_user(uid: u32) -> HostUser {
    HostUser { uid, gid: uid }
}

/// Pids of every live process whose real uid is `uid`. With a uid per
/// sandbox, that is exactly the sandbox's processes, wherever they went
/// (setsid, double fork, another process group). Zombies are dead already
/// (their parent, often the host's init, reaps them in its own time),
/// unless threads of theirs still run (see [`live_uid`]). `Err` when
/// `/proc` cannot be read: that says nothing of what runs.
///
/// A sandbox's processes cannot gain privileges by exec (`spawn_group`
/// sets no_new_privs) nor change uid (they hold no capability on the
/// host), so their effective uid is their real one: the walk stats each
/// `/proc/<pid>` (owned by the process's effective uid, whatever its
/// dumpable state: proc(5)), which the kernel answers without formatting
/// anything, and reads the status of those it owns only.
pub fn processes_of_uid(uid: u32) -> Result<Vec<i32>, String> {
    if !uid_may_have_processes(uid) {
        return Ok(Vec::new());
    }
    let proc_dir = std::fs::read_dir("/proc").map_err(|e| format!("cannot read /proc: {e}"))?;
    Ok(proc_dir
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.metadata().is_ok_and(|m| m.uid() == uid))
        .filter_map(|entry| entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| live_uid(*pid) == Some(uid))
        .collect())
}

/// Whether any task may have `uid` as its real uid, in one system call:
/// `getpriority(PRIO_USER, uid)` fails with ESRCH when the kernel knows no
/// task of that user (it looks the user up, then every task's real uid).
/// `true` is only a maybe (it counts zombies too): the caller then walks
/// /proc.
pub fn uid_may_have_processes(uid: u32) -> bool {
    // SAFETY: getpriority reads no memory of ours; errno is this thread's.
    unsafe {
        *libc::__errno_location() = 0;
        let value = libc::getpriority(libc::PRIO_USER, uid);
        !(value == -1 && *libc::__errno_location() == libc::ESRCH)
    }
}

/// The real uid of `pid`, unless it is dead: a zombie with no other
/// thread. A process whose main thread exited while others run shows its
/// leader as a zombie, and is alive (a SIGKILL to its pid ends them all).
fn live_uid(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    if field("State:").is_some_and(|s| s.starts_with('Z') || s.starts_with('X')) {
        let threads_run = match std::fs::read_dir(format!("/proc/{pid}/task")) {
            Ok(tasks) => tasks.count() > 1,
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        };
        if !threads_run {
            return None;
        }
    }
    field("Uid:")?.split_whitespace().next()?.parse().ok()
}

/// SIGKILLs every process of `uid` until none is left, up to `timeout`.
/// Never used for a uid that is not a sandbox's own.
pub async fn kill_uid(uid: u32, timeout: Duration) -> Result<usize, String> {
    if uid == 0 {
        return Err("refusing to kill the processes of uid 0".into());
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut killed = 0;
    loop {
        // The /proc walk stats every process on the host, so it gets a
        // thread of its own.
        let pids = match uid_may_have_processes(uid) {
            false => Vec::new(),
            true => match tokio::task::spawn_blocking(move || processes_of_uid(uid))
                .await
                .map_err(|e| format!("processes of uid {uid} not listed: {e}"))?
            {
                Ok(pids) => pids,
                // Read again until the deadline: never taken for none.
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(format!("processes of uid {uid} not listed: {e}"))
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        if pids.is_empty() {
            return Ok(killed);
        }
        for pid in pids {
            // SAFETY: kill(2) on a pid just seen running as this sandbox's
            // own uid; no memory is involved.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("processes of uid {uid} still alive after {timeout:?}"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `pid` (its thread group's leader) shows as a zombie within
    /// 10 s.
    fn becomes_zombie(pid: i32) -> bool {
        let zombie = || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'))
        };
        for _ in 0..1000 {
            if zombie() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        zombie()
    }

    #[test]
    fn the_kernel_says_which_uids_have_no_task() {
        assert!(uid_may_have_processes(unsafe { libc::getuid() }), "this test's own uid has a task");
        assert!(!uid_may_have_processes(3_999_999), "nothing runs as uid 3999999");
        assert_eq!(processes_of_uid(3_999_999), Ok(Vec::new()));
    }

    #[test]
    fn the_walk_finds_a_process_of_the_uid_and_not_its_zombie() {
        use std::os::unix::process::CommandExt;
        let uid = 3_999_998;
        let mut child = std::process::Command::new("sleep").arg("30").uid(uid).gid(uid).spawn().expect("spawn sleep");
        let pid = child.id() as i32;
        assert_eq!(processes_of_uid(uid), Ok(vec![pid]));
        child.kill().unwrap();
        // Dead, not yet reaped: a zombie of the uid, which the walk skips
        // (waited for: on a loaded host the exit can take a while).
        assert!(becomes_zombie(pid), "pid {pid} is not a zombie after 10 s");
        assert!(uid_may_have_processes(uid), "the zombie is still a task of the uid");
        assert_eq!(processes_of_uid(uid), Ok(Vec::new()));
        child.wait().unwrap();
        assert!(!uid_may_have_processes(uid));
    }

    /// A process whose main thread exited while another thread runs shows
    /// its leader as a zombie: the walk finds it all the same, and the
    /// kill ends it.
    #[tokio::test]
    async fn a_process_whose_main_thread_exited_is_found_and_killed() {
        use std::os::unix::process::CommandExt;
        let uid = 3_999_997;
        let script = "import threading, time, ctypes\n\
                      threading.Thread(target=time.sleep, args=(60,)).start()\n\
                      ctypes.CDLL(None).syscall(60, 0)\n";
        let mut child = std::process::Command::new("python3")
            .args(["-c", script])
            .uid(uid)
            .gid(uid)
            .spawn()
            .expect("python3 on PATH");
        let pid = child.id() as i32;
        assert!(becomes_zombie(pid), "pid {pid}'s main thread did not exit");
        assert_eq!(processes_of_uid(uid), Ok(vec![pid]), "its thread still runs");
        assert_eq!(kill_uid(uid, Duration::from_secs(10)).await, Ok(1));
        assert_eq!(processes_of_uid(uid), Ok(Vec::new()));
        child.wait().unwrap();
    }

    #[test]
    fn uid_ranges_parse_and_refuse_what_they_must() {
        assert_eq!(UidRange::parse("200000-265535"), Ok(UidRange { first: 200000, last: 265535 }));
        assert_eq!(UidRange::parse(" 7 - 7 "), Ok(UidRange { first: 7, last: 7 }));
        for bad in ["", "5", "0-10", "10-5", "a-b", "60000-70000", "4294967000-4294967295"] {
            assert!(UidRange::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn cgroup_parent_must_stay_below_the_mount() {
        for bad in ["", "..", "a/../b", "/abs", "a//b"] {
            let config = SandboxConfig { cgroup_parent: bad.into(), ..SandboxConfig::default() };
            assert_eq!(config.validate().unwrap_err().0, "sandbox.cgroup_parent", "{bad:?}");
        }
        assert!(SandboxConfig::default().validate().is_ok());
    }

    #[test]
    fn a_warm_pool_holds_at_most_256() {
        let mut config = SandboxConfig::default();
        config.warm.insert("builtin.noop".into(), MAX_WARM);
        assert_eq!(config.validate(), Ok(()));
        config.warm.insert("builtin.noop".into(), MAX_WARM + 1);
        let refused = ("sandbox.warm.\"builtin.noop\"".to_string(), "257 is above 256".to_string());
        assert_eq!(config.validate(), Err(refused));
    }

    #[test]
    fn uid_zero_is_never_swept() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        assert!(rt.block_on(kill_uid(0, Duration::from_millis(1))).is_err());
    }
}
