//! One cgroup per sandbox: it enforces the sandbox's memory, pids and CPU
//! limits, and it is how teardown finds and kills *everything* the sandbox
//! started (process groups and sessions can be escaped with `setsid`; cgroup
//! membership cannot be escaped by an unprivileged process).
//!
//! Layouts supported:
//! - pure cgroup v2 (`<mount>/cgroup.controllers`): one directory
//!   `<mount>/<parent>/<name>` carries limits and membership, and
//!   `cgroup.kill` kills it atomically;
//! - hybrid (`<mount>/unified` is cgroup2, controllers on v1): the v2
//!   directory carries membership and `cgroup.kill`, v1
//!   `<mount>/{memory,pids,cpu}/<parent>/<name>` carry the limits;
//! - pure v1: v1 directories only; kill is a SIGKILL-and-re-read loop.
//!
//! What works is decided at daemon start by really creating a probe cgroup,
//! never by guessing from mount names; a limit the host cannot enforce makes
//! [`CgroupHost::create`] fail instead of being silently skipped.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// CFS period written with every CPU limit, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// Limits a sandbox's cgroup enforces; 0 = not limited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory of the whole cgroup, in bytes.
    pub memory_bytes: u64,
    /// Tasks (processes and threads) alive at once.
    pub max_processes: u64,
    /// CPU in millicores (1000 = one CPU).
    pub cpu_millis: u64,
}

/// Which mechanism enforces a given limit here (the reason none can is the
/// `Err` of the [`CgroupHost`] accessor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// The unified cgroup v2 hierarchy.
    CgroupV2,
    /// A cgroup v1 controller hierarchy.
    CgroupV1,
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mechanism::CgroupV2 => "cgroup v2",
            Mechanism::CgroupV1 => "cgroup v1",
        })
    }
}

/// Which limits a sandbox hit so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitHits {
    /// How many times a process was OOM-killed at the memory limit (a v1 host
    /// that only reports the limit was reached counts as one).
    pub memory_oom_kills: u64,
    /// How many forks the pids limit refused.
    pub pids_refused: u64,
}

/// Why a sandbox's cgroup could not be created, limited, emptied or removed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The cgroup name has characters other than `[A-Za-z0-9_-]`.
    #[error("invalid cgroup name {0:?}: only [A-Za-z0-9_-] are allowed")]
    InvalidName(String),
    /// A non-zero limit needs a controller this host lacks.
    #[error("cannot enforce {what} with cgroups: {reason}")]
    Unsupported {
        /// The limit, as a phrase ("a memory limit").
        what: &'static str,
        /// Why this host cannot enforce it.
        reason: String,
    },
    /// A file operation on the cgroup filesystem failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory it was done to.
        path: PathBuf,
        /// The error the filesystem returned.
        #[source]
        source: io::Error,
    },
    /// Processes were still in the cgroup when the kill gave up.
    #[error("cgroup {} still holds pids {pids:?} after {timeout:?}", path.display())]
    NotEmpty {
        /// The cgroup's directory.
        path: PathBuf,
        /// The processes still in it.
        pids: Vec<i32>,
        /// How long the kill was retried.
        timeout: Duration,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io { op, path: path.to_path_buf(), source }
}

/// Where one capability lives: the mechanism and the hierarchy's mount.
#[derive(Clone, Debug)]
struct Slot {
    mech: Mechanism,
    root: PathBuf,
}

/// What this host's cgroups can do for sandboxes, detected once at daemon start.
#[derive(Debug)]
pub struct CgroupHost {
    mount: PathBuf,
    parent: String,
    v2_root: Option<PathBuf>,
    /// Whether the v2 hierarchy's children have `cgroup.kill` (kernel >= 5.14).
    v2_kill: bool,
    v1_any: bool,
    memory: Result<Slot, String>,
    pids: Result<Slot, String>,
    cpu: Result<Slot, String>,
    kill: Result<Slot, String>,
}

/// Per controller: name, v2 limit file and the value that means "unlimited",
/// the same for v1.
const CONTROLLERS: [(&str, &str, &str, &str, &str); 3] = [
    ("memory", "memory.max", "max", "memory.limit_in_bytes", "-1"),
    ("pids", "pids.max", "max", "pids.max", "max"),
    ("cpu", "cpu.max", "max 100000", "cpu.cfs_quota_us", "-1"),
];

impl CgroupHost {
    /// Detects the layout under `mount` (normally "/sys/fs/cgroup") and
    /// prepares `<parent>` in every usable hierarchy (idempotent). Never panics.
    pub fn detect(mount: &Path, parent: &str) -> CgroupHost {
        let v2_root =
            [mount.to_path_buf(), mount.join("unified")].into_iter().find(|p| p.join("cgroup.controllers").is_file());
        let v1_root = |c: &str| {
            let p = mount.join(c);
            (p.join("cgroup.procs").is_file() && !p.join("cgroup.controllers").exists()).then_some(p)
        };
        let v1_any = ["memory", "pids", "cpu", "cpuacct", "freezer"].iter().any(|c| v1_root(c).is_some());
        let mut host = CgroupHost {
            mount: mount.to_path_buf(),
            parent: parent.to_string(),
            v2_root: v2_root.clone(),
            v2_kill: false,
            v1_any,
            memory: Err(String::new()),
            pids: Err(String::new()),
            cpu: Err(String::new()),
            kill: Err(String::new()),
        };
        if !valid_parent(parent) {
            let why = format!(
                "invalid cgroup parent {parent:?}: only /-separated names of [A-Za-z0-9_.-] (not . or ..) are allowed"
            );
            (host.memory, host.pids, host.cpu, host.kill) =
                (Err(why.clone()), Err(why.clone()), Err(why.clone()), Err(why));
            return host;
        }
        let v2_note = match &v2_root {
            Some(root) => prepare_v2_parent(root, parent).err().map(|e| format!("; {e}")).unwrap_or_default(),
            None => String::new(),
        };
        for (i, (ctrl, v2_file, v2_unlimited, v1_file, v1_unlimited)) in CONTROLLERS.into_iter().enumerate() {
            let mut tried = String::new();
            let mut found = None;
            let candidates = [
                (Mechanism::CgroupV2, v2_root.clone(), v2_file, v2_unlimited),
                (Mechanism::CgroupV1, v1_root(ctrl), v1_file, v1_unlimited),
            ];
            for (mech, root, file, unlimited) in candidates {
                let Some(root) = root else { continue };
                match probe(&root, parent, |dir| write(&dir.join(file), unlimited)) {
                    Ok(()) => {
                        found = Some(Slot { mech, root });
                        break;
                    }
                    Err(e) => tried.push_str(&format!("; {mech} at {}: {e}", root.display())),
                }
            }
            let result = found.ok_or_else(|| {
                format!(
                    "no writable {ctrl} controller under {} (cgroup v2 without +{ctrl} in cgroup.subtree_control, \
                     or v1 {ctrl} not mounted){tried}{v2_note}",
                    mount.display()
                )
            });
            match i {
                0 => host.memory = result,
                1 => host.pids = result,
                _ => host.cpu = result,
            }
        }
        // Membership/kill: v2 first (cgroup.kill), then any writable v1 hierarchy.
        let mut tried = String::new();
        let mut candidates: Vec<(Mechanism, PathBuf)> =
            v2_root.iter().map(|r| (Mechanism::CgroupV2, r.clone())).collect();
        candidates.extend(
            ["pids", "memory", "cpu", "cpuacct", "freezer"]
                .iter()
                .filter_map(|c| v1_root(c))
                .map(|r| (Mechanism::CgroupV1, r)),
        );
        for (mech, root) in candidates {
            let mut has_kill = false;
            match probe(&root, parent, |dir| {
                has_kill = dir.join("cgroup.kill").is_file();
                fs::read_to_string(dir.join("cgroup.procs")).map(drop).map_err(|e| format!("cgroup.procs: {e}"))
            }) {
                Ok(()) => {
                    host.v2_kill = mech == Mechanism::CgroupV2 && has_kill;
                    host.kill = Ok(Slot { mech, root });
                    break;
                }
                Err(e) => tried.push_str(&format!("; {mech} at {}: {e}", root.display())),
            }
        }
        if host.kill.is_err() {
            host.kill = Err(format!(
                "no writable cgroup hierarchy under {} to track a sandbox's processes (need cgroup v2 or a v1 \
                 controller mounted, and root){tried}",
                mount.display()
            ));
        }
        host
    }

    /// How a memory limit is enforced here, or why none can be.
    pub fn memory(&self) -> Result<Mechanism, String> {
        self.memory.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }
    /// How a process limit is enforced here, or why none can be.
    pub fn pids(&self) -> Result<Mechanism, String> {
        self.pids.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }
    /// How a CPU limit is enforced here, or why none can be.
    pub fn cpu(&self) -> Result<Mechanism, String> {
        self.cpu.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }
    /// Whether a cgroup can find and kill every process of a sandbox.
    pub fn kill(&self) -> Result<Mechanism, String> {
        self.kill.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }

    /// Creates the sandbox's cgroup(s) with `limits` applied (0 = not set).
    /// Always needs [`Self::kill`]; a non-zero limit the host cannot enforce
    /// is an error. A leftover empty directory of the same name is replaced;
    /// one that still holds processes is an error. On error nothing is left.
    pub fn create(&self, name: &str, limits: &CgroupLimits) -> Result<SandboxCgroup, CgroupError> {
        if !valid_name(name) {
            return Err(CgroupError::InvalidName(name.to_string()));
        }
        let need = |what: &'static str, slot: &Result<Slot, String>, on: bool| match (on, slot) {
            (false, _) => Ok(None),
            (true, Ok(s)) => Ok(Some(s.clone())),
            (true, Err(reason)) => Err(CgroupError::Unsupported { what, reason: reason.clone() }),
        };
        let memory = need("a memory limit", &self.memory, limits.memory_bytes > 0)?;
        let pids = need("a process limit", &self.pids, limits.max_processes > 0)?;
        let cpu = need("a cpu limit", &self.cpu, limits.cpu_millis > 0)?;
        let kill = need("process tracking", &self.kill, true)?.expect("needed");
        let mut cg = SandboxCgroup { dirs: Vec::new(), kill_file: None };
        let result = (|| {
            for slot in [Some(&kill), memory.as_ref(), pids.as_ref(), cpu.as_ref()].into_iter().flatten() {
                let dir = slot.root.join(&self.parent).join(name);
                if cg.dirs.contains(&dir) {
                    continue;
                }
                if slot.mech == Mechanism::CgroupV2 && !dir.parent().is_some_and(Path::exists) {
                    let _ = prepare_v2_parent(&slot.root, &self.parent);
                }
                make_dir(dir.parent().unwrap_or(&slot.root))?;
                if dir.exists() {
                    rmdir_retry(&dir).map_err(|e| match e {
                        CgroupError::Io { path, source, .. } => {
                            CgroupError::Io { op: "replace leftover cgroup (kill_all it first)", path, source }
                        }
                        e => e,
                    })?;
                }
                cgroup_mkdir(&dir).map_err(io_err("create cgroup", &dir))?;
                cg.dirs.push(dir);
            }
            let at = |slot: &Slot| slot.root.join(&self.parent).join(name);
            if let Some(s) = &memory {
                let (dir, bytes) = (at(s), limits.memory_bytes.to_string());
                // The swap limit too, so swapping out cannot dodge the memory limit.
                let (limit, swap, swap_value) = match s.mech {
                    Mechanism::CgroupV2 => ("memory.max", "memory.swap.max", "0"),
                    Mechanism::CgroupV1 => ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", bytes.as_str()),
                };
                write_limit(&dir.join(limit), &bytes)?;
                if dir.join(swap).exists() {
                    write_limit(&dir.join(swap), swap_value)?;
                }
            }
            if let Some(s) = &pids {
                write_limit(&at(s).join("pids.max"), &limits.max_processes.to_string())?;
            }
            if let Some(s) = &cpu {
                let quota = limits.cpu_millis.saturating_mul(CPU_PERIOD_US) / 1000;
                match s.mech {
                    Mechanism::CgroupV2 => write_limit(&at(s).join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?,
                    Mechanism::CgroupV1 => {
                        write_limit(&at(s).join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                        write_limit(&at(s).join("cpu.cfs_quota_us"), &quota.to_string())?;
                    }
                }
            }
            Ok(())
        })();
        cg.kill_file = cg.dirs.iter().map(|d| d.join("cgroup.kill")).find(|f| f.is_file());
        match result {
            Ok(()) => Ok(cg),
            Err(e) => {
                let _ = cg.remove();
                Err(e)
            }
        }
    }

    /// Re-opens the cgroups a previous daemon created for `name`, if any exist.
    pub fn open(&self, name: &str) -> Option<SandboxCgroup> {
        if !valid_name(name) {
            return None;
        }
        let mut dirs: Vec<PathBuf> = Vec::new();
        let roots = [&self.kill, &self.memory, &self.pids, &self.cpu].into_iter().filter_map(|s| s.as_ref().ok());
        for root in roots.map(|s| &s.root).chain(self.v2_root.as_ref()) {
            let dir = root.join(&self.parent).join(name);
            if !dirs.contains(&dir) && dir.is_dir() {
                dirs.push(dir);
            }
        }
        let kill_file = dirs.iter().map(|d| d.join("cgroup.kill")).find(|f| f.is_file());
        (!dirs.is_empty()).then_some(SandboxCgroup { dirs, kill_file })
    }

    /// A short human summary for `corral doctor` and the start log.
    pub fn describe(&self) -> String {
        let caps = [("kill", &self.kill), ("memory", &self.memory), ("pids", &self.pids), ("cpu", &self.cpu)];
        let names = |m: Mechanism| {
            let v: Vec<&str> = caps
                .iter()
                .filter(|(_, s)| s.as_ref().is_ok_and(|s| s.mech == m))
                .map(
                    |(n, _)| if *n == "kill" && !(m == Mechanism::CgroupV2 && self.v2_kill) { "membership" } else { n },
                )
                .collect();
            v.join(", ")
        };
        let (v2, v1) = (names(Mechanism::CgroupV2), names(Mechanism::CgroupV1));
        let v2 = if v2.is_empty() { "unused".to_string() } else { v2 };
        let mut out = match (&self.v2_root, self.v1_any) {
            (Some(r), false) => format!("cgroup v2 at {} ({v2})", r.display()),
            (Some(r), true) => format!("hybrid: v2 at {} ({v2}), v1 {v1}", r.display()),
            (None, true) => format!("cgroup v1: {v1}"),
            (None, false) => format!("no cgroup hierarchy under {}", self.mount.display()),
        };
        let missing: Vec<&str> = caps.iter().filter(|(_, s)| s.is_err()).map(|(n, _)| *n).collect();
        if !missing.is_empty() {
            out.push_str(&format!("; unavailable: {}", missing.join(", ")));
        }
        out
    }
}

/// A sandbox's cgroup directories (one per hierarchy it uses).
#[derive(Clone, Debug)]
pub struct SandboxCgroup {
    dirs: Vec<PathBuf>,
    /// `cgroup.kill` of the v2 directory, if the kernel has it.
    kill_file: Option<PathBuf>,
}

impl SandboxCgroup {
    /// Opens every `cgroup.procs` of this sandbox for writing (close-on-exec),
    /// for the spawner to pass to [`Self::join_self`] in the forked child.
    pub fn procs_files(&self) -> Result<Vec<fs::File>, CgroupError> {
        self.dirs
            .iter()
            .map(|d| {
                let path = d.join("cgroup.procs");
                fs::OpenOptions::new().write(true).open(&path).map_err(io_err("open", &path))
            })
            .collect()
    }

    /// Moves the calling process into every cgroup whose `cgroup.procs` fd is
    /// given ("0" means "me"). Async-signal-safe (no allocation, raw write),
    /// for `pre_exec`, before exec and before dropping root.
    pub fn join_self(fds: &[RawFd]) -> io::Result<()> {
        for &fd in fds {
            // SAFETY: write(2) is async-signal-safe; the buffer is a static
            // 1-byte literal valid for the call; a bad fd only yields EBADF.
            let n = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
            if n != 1 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// Every pid currently in the sandbox's cgroup(s), union over
    /// hierarchies; a `cgroup.procs` that cannot be read counts as none.
    pub fn pids(&self) -> Vec<i32> {
        self.read_pids().unwrap_or_default()
    }

    /// Whether no `cgroup.procs` names a process: each was read, or is gone
    /// with its cgroup (as [`Self::pids`] reads them); `false` when one
    /// could not be read.
    pub fn holds_no_process(&self) -> bool {
        matches!(self.read_pids(), Ok(pids) if pids.is_empty())
    }

    /// [`pids`](Self::pids), or the `cgroup.procs` that could not be read:
    /// a cgroup gone holds nothing, but a read that failed (a descriptor or
    /// memory short) says nothing of what runs there.
    fn read_pids(&self) -> Result<Vec<i32>, (PathBuf, io::Error)> {
        let mut all = BTreeSet::new();
        for dir in &self.dirs {
            let procs = dir.join("cgroup.procs");
            let text = match fs::read_to_string(&procs) {
                Ok(text) => text,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err((procs, e)),
            };
            all.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()).filter(|p| *p > 0));
        }
        Ok(all.into_iter().collect())
    }

    /// One kill pass: `cgroup.kill` if there is one (atomic against forks),
    /// else SIGKILL each listed pid. Never signals the daemon itself (and
    /// never uses `cgroup.kill` if the daemon is somehow inside).
    fn kill_pass(&self, pids: &[i32]) {
        let me = std::process::id() as i32;
        if let Some(file) = &self.kill_file {
            if !pids.contains(&me) && write(file, "1").is_ok() {
                return;
            }
        }
        for &pid in pids.iter().filter(|p| **p > 0 && **p != me) {
            // SAFETY: kill(2) touches no memory; pid > 0 so it targets one
            // process, never a group or "everyone". A pid that exited and
            // was reused in the instant since the read is the residual risk.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }

    /// Kills everything in the cgroup(s) and waits until they are empty, up
    /// to `timeout`. Processes forked during the loop are caught on the next
    /// pass. Zombies do not count (the kernel drops them from cgroup.procs).
    /// A `cgroup.procs` that cannot be read is never taken for an empty
    /// one: it is read again, and the kill fails if the read still fails at
    /// the deadline (nothing is written blind: the daemon could be inside).
    pub async fn kill_all(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        loop {
            let pids = match self.read_pids() {
                Ok(pids) => pids,
                Err((path, source)) if Instant::now() >= deadline => {
                    return Err(CgroupError::Io { op: "read", path, source })
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let path = self.dirs.first().cloned().unwrap_or_default();
                return Err(CgroupError::NotEmpty { path, pids, timeout });
            }
            self.kill_pass(&pids);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The v2 directory's `cgroup.events`, if the sandbox has one: its
    /// `populated` key is 0 only once every task of the cgroup has passed
    /// the kernel's `cgroup_exit`, which comes after the task released its
    /// memory and its files (`exit_mm`, `exit_files`, the final `fput`s) and
    /// just before it becomes a zombie. `cgroup.procs` is not that: it drops
    /// a process at the very start of its exit.
    fn events_file(&self) -> Option<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.events")).find(|f| f.is_file())
    }

    /// Whether [`Self::wait_exited`] can tell when every task has exited.
    pub fn tracks_exit(&self) -> bool {
        self.events_file().is_some()
    }

    /// Kills what is left and waits until every task of the cgroup has
    /// finished exiting (`populated 0` in `cgroup.events`: nothing left but
    /// zombies), up to `timeout`. Without a v2 directory there is nothing to
    /// read: an error, so the caller sweeps by uid instead.
    pub async fn wait_exited(&self, timeout: Duration) -> Result<(), CgroupError> {
        let Some(events) = self.events_file() else {
            let reason = "the sandbox has no cgroup v2 directory".to_string();
            return Err(CgroupError::Unsupported { what: "waiting for its tasks to exit", reason });
        };
        let deadline = Instant::now() + timeout;
        self.kill_all(timeout).await?;
        // Out of `cgroup.procs`, a killed task may still be exiting.
        loop {
            // An unreadable file counts as populated: this never reports an
            // exit it did not see.
            if read_key(&events, "populated") == Some(0) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CgroupError::NotEmpty { path: events, pids: self.pids(), timeout });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Which limits were hit so far. The v1 `memory.failcnt` fallback (old
    /// kernels without `oom_kill` in `memory.oom_control`) only tells that
    /// the limit was reached, so it counts as one.
    pub fn limit_hits(&self) -> LimitHits {
        let mut hits = LimitHits::default();
        for dir in &self.dirs {
            if let Some(n) = read_key(&dir.join("memory.events"), "oom_kill") {
                hits.memory_oom_kills += n;
            } else if let Some(n) = read_key(&dir.join("memory.oom_control"), "oom_kill") {
                hits.memory_oom_kills += n;
            } else if let Ok(text) = fs::read_to_string(dir.join("memory.failcnt")) {
                hits.memory_oom_kills += u64::from(text.trim().parse::<u64>().unwrap_or(0) > 0);
            }
            hits.pids_refused += read_key(&dir.join("pids.events"), "max").unwrap_or(0);
        }
        hits
    }

    /// Removes the cgroup directories (they must be empty: call
    /// [`Self::kill_all`] first). Idempotent.
    pub fn remove(&self) -> Result<(), CgroupError> {
        let mut first_err = None;
        for dir in self.dirs.iter().rev() {
            if let Err(e) = rmdir_retry(dir) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The cgroup directories, for the enforcement receipt.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.dirs.clone()
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 200 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A parent may be nested, e.g. a systemd unit's delegated subtree
/// (`system.slice/corral.service/sandboxes`).
fn valid_parent(parent: &str) -> bool {
    parent.len() <= 200
        && parent.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        })
}

/// Writes an existing control file; never creates one (a missing file means
/// the controller is not there, even on a look-alike non-cgroup directory).
fn write_file(path: &Path, value: &str) -> io::Result<()> {
    use std::io::Write as _;
    fs::OpenOptions::new().write(true).open(path)?.write_all(value.as_bytes())
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    write_file(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))
}

fn write_limit(path: &Path, value: &str) -> Result<(), CgroupError> {
    write_file(path, value).map_err(io_err("set limit", path))
}

fn make_dir(dir: &Path) -> Result<(), CgroupError> {
    // With its parents: a nested parent's levels may not exist yet.
    match fs::create_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(io_err("create cgroup", dir)(e)),
        _ => {
            #[cfg(test)]
            tests::fixture::kernel_mkdir(dir);
            Ok(())
        }
    }
}

/// `mkdir` of one cgroup directory. In a cgroup hierarchy the kernel fills
/// the new directory with its control files; the unit tests' fixture trees
/// are plain directories, so in tests the fixture adds those files here
/// (a no-op anywhere else, the real hierarchies included).
fn cgroup_mkdir(dir: &Path) -> io::Result<()> {
    fs::create_dir(dir)?;
    #[cfg(test)]
    tests::fixture::kernel_mkdir(dir);
    Ok(())
}

/// `rmdir` of one cgroup directory. The kernel drops a cgroup's control
/// files with it; in tests a fixture tree's are removed first (see
/// [`cgroup_mkdir`]).
fn cgroup_rmdir(dir: &Path) -> io::Result<()> {
    #[cfg(test)]
    tests::fixture::kernel_rmdir(dir);
    fs::remove_dir(dir)
}

/// rmdir, retried briefly on EBUSY (a cgroup can stay busy for a moment
/// after its last process exited); a missing directory is success.
fn rmdir_retry(dir: &Path) -> Result<(), CgroupError> {
    for attempt in 0.. {
        match cgroup_rmdir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && attempt < 50 => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(io_err("remove cgroup", dir)(e)),
        }
    }
    unreachable!("the loop returns")
}

/// The value of `key` in a "key value" lines file (memory.events, pids.events, …).
fn read_key(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// On v2, enables memory/pids/cpu (those the root offers) for the mount root's
/// children and for `<parent>`'s children, creating `<parent>` directly under
/// the root (which is exempt from the no-internal-processes rule).
fn prepare_v2_parent(root: &Path, parent: &str) -> Result<(), String> {
    let offered = |dir: &Path| fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    let wanted = |dir: &Path| {
        let have = offered(dir);
        ["memory", "pids", "cpu"].into_iter().filter(|c| have.split_whitespace().any(|h| h == *c)).collect::<Vec<_>>()
    };
    let mut errors = Vec::new();
    for c in wanted(root) {
        errors.extend(write(&root.join("cgroup.subtree_control"), &format!("+{c}")).err());
    }
    // Every level of a nested parent gives the controllers on (each must
    // hold no process: see `delegate` for a systemd unit's own cgroup).
    let mut dir = root.to_path_buf();
    for level in parent.split('/') {
        dir.push(level);
        make_dir(&dir).map_err(|e| e.to_string())?;
        for c in wanted(&dir) {
            errors.extend(write(&dir.join("cgroup.subtree_control"), &format!("+{c}")).err());
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Creates `<root>/<parent>/.probe-<pid>-<n>`, runs `check` in it, removes it.
fn probe(root: &Path, parent: &str, check: impl FnOnce(&Path) -> Result<(), String>) -> Result<(), String> {
    static N: AtomicU64 = AtomicU64::new(0);
    make_dir(&root.join(parent)).map_err(|e| e.to_string())?;
    let dir = root.join(parent).join(format!(".probe-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    cgroup_mkdir(&dir).map_err(|e| format!("creating probe {}: {e}", dir.display()))?;
    let result = check(&dir);
    let removed = rmdir_retry(&dir).map_err(|e| e.to_string());
    result.and(removed)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::fd::AsRawFd;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command, Stdio};

    const MOUNT: &str = "/sys/fs/cgroup";
    /// Not "corral", so tests never touch a real daemon's cgroups.
    const PARENT: &str = "corral-test";

    fn host() -> CgroupHost {
        CgroupHost::detect(Path::new(MOUNT), PARENT)
    }

    fn unique_name() -> String {
        static N: AtomicU64 = AtomicU64::new(0);
        format!("test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    /// Kills whatever is left and removes the cgroups, even when a test panics.
    struct Guard(SandboxCgroup);
    impl std::ops::Deref for Guard {
        type Target = SandboxCgroup;
        fn deref(&self) -> &SandboxCgroup {
            &self.0
        }
    }
    impl Drop for Guard {
        fn drop(&mut self) {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let pids = self.0.pids();
                if pids.is_empty() || Instant::now() > deadline {
                    break;
                }
                self.0.kill_pass(&pids);
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.0.remove();
        }
    }

    fn create(limits: CgroupLimits) -> Guard {
        Guard(host().create(&unique_name(), &limits).expect("create cgroup"))
    }

    /// Spawns `cmd` so that it joins the cgroups (via `files`) before exec.
    fn spawn_in(files: &[fs::File], cmd: &mut Command) -> Child {
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: the closure only calls join_self (raw write(2), no
        // allocation), which is async-signal-safe; `files` outlives spawn().
        unsafe { cmd.pre_exec(move || SandboxCgroup::join_self(&fds)) };
        cmd.spawn().expect("spawn")
    }

    /// The real python3 executable (not a pyenv shim that forks helpers).
    fn python3() -> PathBuf {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3 is required by the cgroup tests but was not found on PATH");
        assert!(out.status.success(), "python3 -c failed: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    }

    fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Field `n` of `/proc/PID/stat` after `(comm)` (0: the state, 1: the
    /// ppid), `None` once the process is gone.
    fn stat_field(pid: i32, n: usize) -> Option<String> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(stat.rsplit_once(')')?.1.split_whitespace().nth(n)?.to_string())
    }

    fn ppid(pid: i32) -> Option<i32> {
        stat_field(pid, 1)?.parse().ok()
    }

    /// Running (not gone and not a zombie awaiting its reaper).
    fn alive(pid: i32) -> bool {
        stat_field(pid, 0).is_some_and(|s| s != "Z")
    }

    /// Fixture trees: temporary directories laid out like a cgroup mount
    /// (pure v2, pure v1 or hybrid), so detection, limit writing,
    /// `limit_hits` and `remove` are tested in every layout, not only in
    /// the one of the host the tests run on.
    ///
    /// A real hierarchy's kernel fills each new directory with control files
    /// and drops them on `rmdir`; [`kernel_mkdir`] and [`kernel_rmdir`] do
    /// that for the hierarchies a [`Tree`] registered (and nothing anywhere
    /// else). Control files start empty: the kernel replaces a value on
    /// write, while a plain file opened without `O_TRUNC` would keep the tail
    /// of a longer old one, so empty files make a test read back exactly what
    /// the code wrote.
    pub(crate) mod fixture {
        use std::collections::BTreeMap;
        use std::fs;
        use std::path::{Path, PathBuf};
        use std::sync::Mutex;

        /// One hierarchy of a fixture tree.
        #[derive(Clone, Debug)]
        enum Kind {
            /// cgroup v2: `controllers` are offered by the root and enabled
            /// for every child; `kill` is whether children get `cgroup.kill`.
            V2 { controllers: Vec<&'static str>, kill: bool },
            /// A cgroup v1 hierarchy of one controller.
            V1(&'static str),
        }

        /// The registered hierarchies' roots, for all threads' tests.
        static HIERARCHIES: Mutex<Vec<(PathBuf, Kind)>> = Mutex::new(Vec::new());

        /// The files the kernel makes in a new directory of `kind`.
        fn control_files(kind: &Kind) -> Vec<&'static str> {
            let mut files = vec!["cgroup.procs"];
            match kind {
                Kind::V2 { controllers, kill } => {
                    files.extend(["cgroup.controllers", "cgroup.subtree_control", "cgroup.events", "cgroup.type"]);
                    if *kill {
                        files.push("cgroup.kill");
                    }
                    for c in controllers {
                        files.extend(match *c {
                            "memory" => &["memory.max", "memory.swap.max", "memory.events", "memory.current"][..],
                            "pids" => &["pids.max", "pids.events", "pids.current"],
                            "cpu" => &["cpu.max", "cpu.stat", "cpu.weight"],
                            other => panic!("no v2 files for {other}"),
                        });
                    }
                }
                Kind::V1(c) => {
                    files.extend(["tasks", "notify_on_release"]);
                    files.extend(match *c {
                        "memory" => &[
                            "memory.limit_in_bytes",
                            "memory.memsw.limit_in_bytes",
                            "memory.oom_control",
                            "memory.failcnt",
                            "memory.usage_in_bytes",
                        ][..],
                        "pids" => &["pids.max", "pids.events", "pids.current"],
                        "cpu" => &["cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares"],
                        other => panic!("no v1 files for {other}"),
                    });
                }
            }
            files
        }

        /// The registered hierarchy `dir` lies strictly inside, if any.
        fn hierarchy_of(dir: &Path) -> Option<(PathBuf, Kind)> {
            let all = HIERARCHIES.lock().unwrap_or_else(|e| e.into_inner());
            all.iter()
                .filter(|(root, _)| dir.starts_with(root) && dir != root)
                .max_by_key(|(r, _)| r.as_os_str().len())
                .cloned()
        }

        /// Fills `dir` and each of its ancestors inside a fixture hierarchy
        /// that has no control files yet, as the kernel would have on mkdir.
        pub(crate) fn kernel_mkdir(dir: &Path) {
            let Some((root, kind)) = hierarchy_of(dir) else { return };
            for level in dir.ancestors().take_while(|a| *a != root) {
                if level.join("cgroup.procs").exists() {
                    continue;
                }
                for file in control_files(&kind) {
                    let text = match (&kind, file) {
                        (Kind::V2 { controllers, .. }, "cgroup.controllers") => controllers.join(" ") + "\n",
                        _ => String::new(),
                    };
                    fs::write(level.join(file), text).expect("fixture control file");
                }
            }
        }

        /// Drops a fixture cgroup's control files, unless processes are
        /// listed in it or it has children (then the `rmdir` that follows
        /// fails, as the kernel's does with EBUSY).
        pub(crate) fn kernel_rmdir(dir: &Path) {
            if hierarchy_of(dir).is_none() {
                return;
            }
            let busy = fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|t| !t.trim().is_empty());
            let Ok(entries) = fs::read_dir(dir) else { return };
            let entries: Vec<_> = entries.flatten().collect();
            if busy || entries.iter().any(|e| e.path().is_dir()) {
                return;
            }
            for e in entries {
                fs::remove_file(e.path()).expect("remove fixture control file");
            }
        }

        /// Every file of `dir` the code wrote (non-empty, the read-only
        /// `cgroup.controllers` aside), name to content.
        pub(crate) fn written(dir: &Path) -> BTreeMap<String, String> {
            fs::read_dir(dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .flatten()
                .filter(|e| e.path().is_file())
                .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read_to_string(e.path()).unwrap()))
                .filter(|(name, text)| !text.is_empty() && name != "cgroup.controllers")
                .collect()
        }

        /// A temporary cgroup mount; its hierarchies are unregistered on drop.
        pub(crate) struct Tree {
            dir: tempfile::TempDir,
        }

        impl Tree {
            fn new() -> Tree {
                Tree { dir: tempfile::tempdir().expect("tempdir") }
            }

            /// Pure cgroup v2: the mount root is the v2 root and offers
            /// `controllers`.
            pub(crate) fn v2(controllers: &[&'static str], kill: bool) -> Tree {
                let tree = Tree::new();
                tree.add_v2(tree.path().to_path_buf(), controllers, kill);
                tree
            }

            /// Pure cgroup v1: one hierarchy per controller, `<mount>/<controller>`.
            pub(crate) fn v1(controllers: &[&'static str]) -> Tree {
                let tree = Tree::new();
                controllers.iter().for_each(|c| tree.add_v1(c));
                tree
            }

            /// Hybrid: v1 `controllers` and a v2 `<mount>/unified` that
            /// offers none (as systemd's hybrid mode mounts it).
            pub(crate) fn hybrid(controllers: &[&'static str], kill: bool) -> Tree {
                let tree = Tree::v1(controllers);
                tree.add_v2(tree.path().join("unified"), &[], kill);
                tree
            }

            pub(crate) fn path(&self) -> &Path {
                self.dir.path()
            }

            fn add_v2(&self, root: PathBuf, controllers: &[&'static str], kill: bool) {
                fs::create_dir_all(&root).unwrap();
                fs::write(root.join("cgroup.controllers"), controllers.join(" ") + "\n").unwrap();
                for file in ["cgroup.subtree_control", "cgroup.procs", "cgroup.stat"] {
                    fs::write(root.join(file), "").unwrap();
                }
                let kind = Kind::V2 { controllers: controllers.to_vec(), kill };
                HIERARCHIES.lock().unwrap_or_else(|e| e.into_inner()).push((root, kind));
            }

            fn add_v1(&self, controller: &'static str) {
                let root = self.path().join(controller);
                fs::create_dir(&root).unwrap();
                // The root cgroup has the control files too (limits are
                // never set there), and holds every process of the host.
                for file in control_files(&Kind::V1(controller)) {
                    fs::write(root.join(file), "").unwrap();
                }
                fs::write(root.join("cgroup.procs"), "1\n").unwrap();
                HIERARCHIES.lock().unwrap_or_else(|e| e.into_inner()).push((root, Kind::V1(controller)));
            }
        }

        impl Drop for Tree {
            fn drop(&mut self) {
                let mine = self.dir.path().to_path_buf();
                HIERARCHIES.lock().unwrap_or_else(|e| e.into_inner()).retain(|(root, _)| !root.starts_with(&mine));
            }
        }
    }

    /// A parent nested like a systemd unit's delegated subtree works as a
    /// flat one does; `..` and empty levels are refused.
    #[test]
    fn a_nested_parent_carries_limits() {
        let nested = CgroupHost::detect(Path::new(MOUNT), "corral-test-nested/unit.service/sandboxes");
        let flat = host();
        assert_eq!((nested.pids(), nested.kill()), (flat.pids(), flat.kill()));
        let limits = CgroupLimits { max_processes: 8, ..Default::default() };
        let cg = Guard(nested.create(&unique_name(), &limits).expect("create a nested cgroup"));
        assert!(cg.0.dirs.iter().all(|d| d.to_string_lossy().contains("corral-test-nested/unit.service/sandboxes/")));
        let pids_dir = cg.paths().into_iter().find(|d| d.starts_with(&nested.pids.as_ref().unwrap().root)).unwrap();
        assert_eq!(fs::read_to_string(pids_dir.join("pids.max")).unwrap().trim(), "8");
        drop(cg);
        for bad in ["a/../b", "a//b", "./a", "a/b c"] {
            assert!(CgroupHost::detect(Path::new(MOUNT), bad).kill().is_err(), "{bad}");
        }
    }

    /// On the real host, each limit lands in the file of the mechanism
    /// `detect()` reports, in the directory of that mechanism's hierarchy,
    /// holding the value written; a limit it reports unavailable fails
    /// closed. Holds on hybrid, pure v2 and pure v1 hosts alike.
    #[test]
    fn real_host_limits_land_where_detect_says() {
        let host = host();
        let kill = host.kill().expect("the cgroup tests need a writable cgroup hierarchy (run them as root)");
        let on = |r: Result<Mechanism, String>, v: u64| if r.is_ok() { v } else { 0 };
        let limits = CgroupLimits {
            memory_bytes: on(host.memory(), 256 << 20),
            max_processes: on(host.pids(), 64),
            cpu_millis: on(host.cpu(), 500),
        };
        for (what, r, one) in [
            ("a memory limit", host.memory(), CgroupLimits { memory_bytes: 1 << 28, ..Default::default() }),
            ("a process limit", host.pids(), CgroupLimits { max_processes: 8, ..Default::default() }),
            ("a cpu limit", host.cpu(), CgroupLimits { cpu_millis: 100, ..Default::default() }),
        ] {
            if r.is_err() {
                let e = host.create(&unique_name(), &one).unwrap_err();
                assert!(matches!(e, CgroupError::Unsupported { what: w, .. } if w == what), "{e}");
            }
        }
        let d = host.describe();
        let all = [host.memory(), host.pids(), host.cpu()].iter().all(Result::is_ok);
        assert_eq!(d.contains("unavailable"), !all, "{d}");

        let cg = create(limits);
        let paths = cg.paths();
        let kill_root = &host.kill.as_ref().unwrap().root;
        assert!(paths[0].starts_with(kill_root.join(PARENT)), "{paths:?} not led by {}", kill_root.display());
        let expected_kill_file = (kill == Mechanism::CgroupV2 && host.v2_kill).then(|| paths[0].join("cgroup.kill"));
        assert_eq!(cg.kill_file, expected_kill_file);
        let read = |p: PathBuf| fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let dir_of = |slot: &Result<Slot, String>| {
            let root = &slot.as_ref().unwrap().root;
            let dirs: Vec<&PathBuf> = paths.iter().filter(|p| p.starts_with(root)).collect();
            assert_eq!(dirs.len(), 1, "one directory under {} in {paths:?}", root.display());
            dirs[0].clone()
        };
        let mut roots = BTreeSet::from([kill_root.clone()]);
        if let Ok(mech) = host.memory() {
            let dir = dir_of(&host.memory);
            let bytes = (256u64 << 20).to_string();
            match mech {
                Mechanism::CgroupV2 => {
                    assert_eq!(read(dir.join("memory.max")).trim(), bytes);
                    if dir.join("memory.swap.max").exists() {
                        assert_eq!(read(dir.join("memory.swap.max")).trim(), "0");
                    }
                }
                Mechanism::CgroupV1 => {
                    assert_eq!(read(dir.join("memory.limit_in_bytes")).trim(), bytes);
                    if dir.join("memory.memsw.limit_in_bytes").exists() {
                        assert_eq!(read(dir.join("memory.memsw.limit_in_bytes")).trim(), bytes);
                    }
                }
            }
            roots.insert(host.memory.as_ref().unwrap().root.clone());
        }
        if host.pids().is_ok() {
            assert_eq!(read(dir_of(&host.pids).join("pids.max")).trim(), "64");
            roots.insert(host.pids.as_ref().unwrap().root.clone());
        }
        if let Ok(mech) = host.cpu() {
            let dir = dir_of(&host.cpu);
            match mech {
                Mechanism::CgroupV2 => assert_eq!(read(dir.join("cpu.max")).trim(), "50000 100000"),
                Mechanism::CgroupV1 => {
                    assert_eq!(read(dir.join("cpu.cfs_quota_us")).trim(), "50000");
                    assert_eq!(read(dir.join("cpu.cfs_period_us")).trim(), "100000");
                }
            }
            roots.insert(host.cpu.as_ref().unwrap().root.clone());
        }
        // One directory per hierarchy used, and none elsewhere.
        assert_eq!(paths.len(), roots.len(), "{paths:?} for {roots:?}");
    }

    /// A cgroup without limits is one directory in the hierarchy that
    /// tracks processes, and `kill_all` empties it (through `cgroup.kill`
    /// where `detect()` found one, else the kill loop).
    #[tokio::test]
    async fn a_cgroup_without_limits_tracks_and_kills() {
        let host = host();
        let cg = Guard(host.create(&unique_name(), &CgroupLimits::default()).unwrap());
        assert_eq!(cg.paths().len(), 1);
        assert!(cg.paths()[0].starts_with(&host.kill.as_ref().unwrap().root));
        assert_eq!(cg.kill_file.is_some(), host.v2_kill);
        let mut child = spawn_in(&cg.procs_files().unwrap(), Command::new("sleep").arg("600"));
        assert_eq!(cg.pids(), vec![child.id() as i32]);
        cg.kill_all(Duration::from_secs(5)).await.unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        cg.remove().unwrap();
        assert!(!cg.paths()[0].exists());
    }

    #[test]
    fn empty_dir_has_nothing_and_create_fails_closed() {
        let tmp = tempfile::tempdir().unwrap();
        let host = CgroupHost::detect(tmp.path(), "corral");
        for (ctrl, r) in [("memory", host.memory()), ("pids", host.pids()), ("cpu", host.cpu())] {
            let e = r.unwrap_err();
            assert!(e.contains(&format!("no writable {ctrl} controller under {}", tmp.path().display())), "{e}");
        }
        assert!(host.kill().unwrap_err().contains("no writable cgroup hierarchy"));
        assert!(host.describe().starts_with("no cgroup hierarchy"), "{}", host.describe());
        let err = host.create("sb1", &CgroupLimits { memory_bytes: 1 << 28, ..Default::default() }).unwrap_err();
        assert!(matches!(err, CgroupError::Unsupported { what: "a memory limit", .. }), "{err}");
        assert!(host.create("sb1", &CgroupLimits::default()).is_err(), "no hierarchy to track processes");
        assert!(host.open("sb1").is_none());
    }

    /// A directory that merely looks like cgroup v2 (the files exist, but
    /// children get no controller files) must not pass the probe.
    #[test]
    fn look_alike_v2_fails_the_probe() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("cgroup.controllers"), "memory pids cpu\n").unwrap();
        fs::write(tmp.path().join("cgroup.subtree_control"), "").unwrap();
        let host = CgroupHost::detect(tmp.path(), "corral");
        let e = host.memory().unwrap_err();
        assert!(e.contains("memory.max") && e.contains("cgroup v2 at"), "{e}");
        assert!(host.pids().is_err() && host.cpu().is_err() && host.kill().is_err());
        let probes = fs::read_dir(tmp.path().join("corral")).unwrap().count();
        assert_eq!(probes, 0, "probe directories removed");
    }

    #[test]
    fn names_are_validated() {
        let host = host();
        for bad in ["", "..", "a/b", "../x", "a.b", "a b", "é"] {
            let r = host.create(bad, &CgroupLimits::default());
            assert!(matches!(r, Err(CgroupError::InvalidName(_))), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn kill_all_catches_a_setsid_double_fork() {
        let limits = CgroupLimits { memory_bytes: 512 << 20, max_processes: 100, cpu_millis: 1000 };
        let host = host();
        let name = unique_name();
        let cg = Guard(host.create(&name, &limits).unwrap());
        let files = cg.procs_files().unwrap();
        // The same fds serve several spawns (the spawner keeps them).
        let mut plain = spawn_in(&files, Command::new("sleep").arg("600"));
        let script = "setsid sh -c 'sleep 600 & exit 0'; echo ready; exec sleep 600";
        let mut child = spawn_in(&files, Command::new("sh").args(["-c", script]).stdout(Stdio::piped()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        let (p1, p2) = (plain.id() as i32, child.id() as i32);
        wait_until("the orphaned sleep", || cg.pids().iter().any(|p| ![p1, p2].contains(p) && ppid(*p) != Some(p2)));
        let pids = cg.pids();
        assert!(pids.contains(&p1) && pids.contains(&p2) && pids.len() == 3, "{pids:?}");
        let orphan = *pids.iter().find(|p| ![p1, p2].contains(p)).unwrap();
        // Crash recovery finds the same cgroups.
        let reopened = host.open(&name).expect("open");
        assert_eq!(reopened.paths(), cg.paths());
        assert_eq!(reopened.pids(), pids);

        reopened.kill_all(Duration::from_secs(5)).await.expect("kill_all");
        assert!(cg.pids().is_empty());
        assert!(!alive(orphan), "the orphaned sleep {orphan} survived kill_all");
        assert_eq!(plain.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        cg.remove().expect("remove");
        for p in cg.paths() {
            assert!(!p.exists(), "{} still exists", p.display());
        }
        cg.remove().expect("remove is idempotent");
        assert!(host.open(&name).is_none());
    }

    /// A `cgroup.procs` that cannot be read (here: a directory in its
    /// place) is not an empty cgroup: the kill fails at its deadline.
    #[tokio::test]
    async fn fixture_an_unreadable_procs_file_fails_the_kill() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let cg = host.create("sb1", &LIMITS).unwrap();
        let procs = tree.path().join("corral/sb1/cgroup.procs");
        let _ = fs::remove_file(&procs);
        fs::create_dir(&procs).unwrap();
        let killed = cg.kill_all(Duration::from_millis(50)).await;
        assert!(matches!(&killed, Err(CgroupError::Io { op: "read", .. })), "{killed:?}");
        fs::remove_dir(&procs).unwrap();
        cg.kill_all(Duration::from_millis(50)).await.expect("a cgroup gone holds nothing");
    }

    /// `wait_exited` returns once `cgroup.events` says `populated 0`, not
    /// before, and not at all while it says 1; a cgroup without a v2
    /// directory cannot say, so the caller is told to sweep by uid.
    #[tokio::test]
    async fn fixture_wait_exited_reads_populated_and_nothing_else() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let cg = host.create("sb1", &LIMITS).unwrap();
        let events = tree.path().join("corral/sb1/cgroup.events");
        assert!(cg.tracks_exit());
        fs::write(&events, "populated 1\nfrozen 0\n").unwrap();
        let stuck = cg.wait_exited(Duration::from_millis(50)).await;
        assert!(matches!(stuck, Err(CgroupError::NotEmpty { .. })), "{stuck:?}");
        let flip = events.clone();
        let flipper = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(60)).await;
            fs::write(&flip, "populated 0\nfrozen 0\n").unwrap();
        });
        let started = Instant::now();
        cg.wait_exited(Duration::from_secs(5)).await.expect("populated 0 seen");
        assert!(started.elapsed() >= Duration::from_millis(60), "returned before the flip");
        flipper.await.unwrap();
        // The key, not the line: "frozen 0" alone is not an exit.
        fs::write(&events, "frozen 0\n").unwrap();
        assert!(cg.wait_exited(Duration::from_millis(20)).await.is_err());
        cg.remove().unwrap();

        let v1 = Tree::v1(&ALL);
        let cg = CgroupHost::detect(v1.path(), "corral").create("sb1", &LIMITS).unwrap();
        assert!(!cg.tracks_exit());
        assert!(matches!(cg.wait_exited(Duration::from_secs(1)).await, Err(CgroupError::Unsupported { .. })));
        cg.remove().unwrap();
    }

    /// On this kernel: `wait_exited` kills what is in the cgroup, and once
    /// it returns the process is a zombie (its memory and files released),
    /// not a task still exiting.
    #[tokio::test]
    async fn wait_exited_leaves_only_a_zombie() {
        let cg = create(CgroupLimits::default());
        if !cg.tracks_exit() {
            panic!("this host's sandbox cgroups have no v2 directory: cgroup.events cannot be read");
        }
        let files = cg.procs_files().unwrap();
        let mut child = spawn_in(&files, Command::new("sleep").arg("600"));
        let pid = child.id();
        wait_until("sleep to join the cgroup", || cg.pids().contains(&(pid as i32)));
        cg.wait_exited(Duration::from_secs(5)).await.expect("exited");
        assert_eq!(stat_field(pid as i32, 0).as_deref(), Some("Z"), "the state of {pid}");
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    /// The v1 path: no cgroup.kill, so SIGKILL every pid and re-read, while
    /// an escaped (setsid) shell keeps forking: forks that race a pass must
    /// be caught by the next one.
    #[tokio::test]
    async fn kill_loop_without_cgroup_kill_catches_forks_during_the_loop() {
        let cg = create(CgroupLimits { max_processes: 100, ..Default::default() });
        let files = cg.procs_files().unwrap();
        let forker = "while :; do sleep 600 & done";
        let script = format!("setsid sh -c '{forker}' & sleep 600 & echo ready; sleep 600");
        let mut child = spawn_in(&files, Command::new("sh").args(["-c", &script]).stdout(Stdio::piped()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        wait_until("the forker to hit the pids limit", || cg.limit_hits().pids_refused > 0);
        let no_kill_file = SandboxCgroup { dirs: cg.paths(), kill_file: None };
        no_kill_file.kill_all(Duration::from_secs(5)).await.expect("kill loop");
        assert!(cg.pids().is_empty());
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        cg.remove().unwrap();
    }

    #[tokio::test]
    async fn pids_limit_refuses_forks() {
        let cg = create(CgroupLimits { max_processes: 50, ..Default::default() });
        let files = cg.procs_files().unwrap();
        let script = r#"
import os, sys, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        try:
            os.execvp("sleep", ["sleep", "600"])
        finally:
            os._exit(127)
    n += 1
print(n, flush=True)
time.sleep(600)
"#;
        let mut child = spawn_in(&files, Command::new(python3()).args(["-c", script]).stdout(Stdio::piped()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let forked: usize = line.trim().parse().unwrap_or_else(|_| panic!("python printed {line:?}"));
        let pids = cg.pids();
        assert!(forked < 50 && pids.len() <= 50 && pids.len() > 1, "forked {forked}, in cgroup {}", pids.len());
        assert!(cg.limit_hits().pids_refused > 0, "{:?}", cg.limit_hits());
        assert_eq!(cg.limit_hits().memory_oom_kills, 0);
        cg.kill_all(Duration::from_secs(5)).await.unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        cg.remove().unwrap();
    }

    #[tokio::test]
    async fn memory_limit_oom_kills() {
        let cg = create(CgroupLimits { memory_bytes: 256 << 20, ..Default::default() });
        assert_eq!(cg.limit_hits(), LimitHits::default());
        let files = cg.procs_files().unwrap();
        let mut child = spawn_in(&files, Command::new(python3()).args(["-c", "b = b'x' * (1 << 30)"]));
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        assert!(cg.limit_hits().memory_oom_kills > 0, "{:?}", cg.limit_hits());
        cg.kill_all(Duration::from_secs(5)).await.unwrap();
        cg.remove().unwrap();
    }

    /// A leftover cgroup that still holds a process is not silently reused.
    #[tokio::test]
    async fn create_refuses_a_busy_leftover_and_replaces_an_empty_one() {
        let host = host();
        let name = unique_name();
        let cg = Guard(host.create(&name, &CgroupLimits { max_processes: 10, ..Default::default() }).unwrap());
        let mut child = spawn_in(&cg.procs_files().unwrap(), Command::new("sleep").arg("600"));
        let err = host.create(&name, &CgroupLimits::default()).unwrap_err();
        assert!(err.to_string().contains(&name), "{err}");
        assert_eq!(cg.pids(), vec![child.id() as i32], "the failed create left the live cgroup alone");
        cg.kill_all(Duration::from_secs(5)).await.unwrap();
        child.wait().unwrap();
        let again = Guard(host.create(&name, &CgroupLimits { max_processes: 20, ..Default::default() }).unwrap());
        let pids_max = again.paths().iter().map(|d| d.join("pids.max")).find(|f| f.exists()).unwrap();
        assert_eq!(fs::read_to_string(pids_max).unwrap().trim(), "20");
    }

    // ---- Fixture trees: every layout, whatever this host's is. ----

    use fixture::{written, Tree};
    use std::collections::BTreeMap;

    const ALL: [&str; 3] = ["memory", "pids", "cpu"];
    const LIMITS: CgroupLimits = CgroupLimits { memory_bytes: 256 << 20, max_processes: 64, cpu_millis: 500 };
    const BYTES: &str = "268435456";

    fn files(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The sub-directories of `dir` (cgroups; control files aside).
    fn children(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> =
            fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
        v.sort();
        v
    }

    fn mechanisms(host: &CgroupHost) -> [Result<Mechanism, String>; 4] {
        [host.memory(), host.pids(), host.cpu(), host.kill()]
    }

    #[test]
    fn fixture_v2_detects_every_controller_on_v2() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let v2 = Ok(Mechanism::CgroupV2);
        assert_eq!(mechanisms(&host), [v2.clone(), v2.clone(), v2.clone(), v2]);
        assert!(host.v2_kill);
        assert_eq!(host.describe(), format!("cgroup v2 at {} (kill, memory, pids, cpu)", tree.path().display()));
        assert_eq!(children(&tree.path().join("corral")), Vec::<PathBuf>::new(), "probes removed");
        assert_eq!(Mechanism::CgroupV2.to_string(), "cgroup v2");
    }

    /// The pure v2 layout (the common production one): every limit in the
    /// one v2 directory, in v2 files, and nothing else written.
    #[test]
    fn fixture_v2_limits_go_to_the_v2_files() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let cg = host.create("sb1", &LIMITS).unwrap();
        let dir = tree.path().join("corral/sb1");
        assert_eq!(cg.paths(), vec![dir.clone()]);
        assert_eq!(cg.kill_file, Some(dir.join("cgroup.kill")));
        let want = [("memory.max", BYTES), ("memory.swap.max", "0"), ("pids.max", "64"), ("cpu.max", "50000 100000")];
        assert_eq!(written(&dir), files(&want));
        // An unset limit writes nothing; 2.5 CPUs is a quota above the period.
        let cpu_only = host.create("sb2", &CgroupLimits { cpu_millis: 2500, ..Default::default() }).unwrap();
        assert_eq!(written(&tree.path().join("corral/sb2")), files(&[("cpu.max", "250000 100000")]));

        let reopened = host.open("sb1").expect("open");
        assert_eq!((reopened.paths(), reopened.kill_file.clone()), (cg.paths(), cg.kill_file.clone()));
        cg.remove().unwrap();
        assert!(!dir.exists());
        cg.remove().expect("remove is idempotent");
        assert!(host.open("sb1").is_none());
        cpu_only.remove().unwrap();
        assert_eq!(children(&tree.path().join("corral")), Vec::<PathBuf>::new());
    }

    /// A kernel before 5.14 has no cgroup.kill: v2 still tracks membership.
    #[test]
    fn fixture_v2_without_cgroup_kill_tracks_membership() {
        let tree = Tree::v2(&ALL, false);
        let host = CgroupHost::detect(tree.path(), "corral");
        assert_eq!(host.kill(), Ok(Mechanism::CgroupV2));
        assert!(!host.v2_kill);
        assert_eq!(host.describe(), format!("cgroup v2 at {} (membership, memory, pids, cpu)", tree.path().display()));
        let cg = host.create("sb1", &CgroupLimits::default()).unwrap();
        assert_eq!((cg.paths(), cg.kill_file.clone()), (vec![tree.path().join("corral/sb1")], None));
    }

    /// A v2 root that does not offer cpu: cpu is unavailable, named in the
    /// reason, and a cpu limit fails closed without leaving a directory.
    #[test]
    fn fixture_v2_without_cpu_fails_closed() {
        let tree = Tree::v2(&["memory", "pids"], true);
        let host = CgroupHost::detect(tree.path(), "corral");
        assert_eq!((host.memory(), host.pids()), (Ok(Mechanism::CgroupV2), Ok(Mechanism::CgroupV2)));
        let e = host.cpu().unwrap_err();
        let m = tree.path().display();
        let head = format!(
            "no writable cpu controller under {m} (cgroup v2 without +cpu in cgroup.subtree_control, or v1 cpu not \
             mounted); cgroup v2 at {m}: writing \"max 100000\" to {m}/corral/.probe-"
        );
        assert!(e.starts_with(&head) && e.contains("/cpu.max: "), "{e}");
        assert_eq!(host.describe(), format!("cgroup v2 at {m} (kill, memory, pids); unavailable: cpu"));
        match host.create("sb1", &LIMITS) {
            Err(CgroupError::Unsupported { what, reason }) => assert_eq!((what, reason), ("a cpu limit", e)),
            other => panic!("a cpu limit without a cpu controller: {other:?}"),
        }
        assert!(!tree.path().join("corral/sb1").exists());
        let cg = host.create("sb1", &CgroupLimits { cpu_millis: 0, ..LIMITS }).unwrap();
        let want = [("memory.max", BYTES), ("memory.swap.max", "0"), ("pids.max", "64")];
        assert_eq!(written(&cg.paths()[0]), files(&want));
    }

    /// A v2 root that delegates nothing (as hybrid's unified mount): only
    /// tracking works; each limit is refused with why.
    #[test]
    fn fixture_v2_without_controllers_only_tracks() {
        let tree = Tree::v2(&[], true);
        let host = CgroupHost::detect(tree.path(), "corral");
        assert_eq!(host.kill(), Ok(Mechanism::CgroupV2));
        for (ctrl, file, r) in [("memory", "memory.max", host.memory()), ("pids", "pids.max", host.pids())] {
            let e = r.unwrap_err();
            assert!(e.contains(&format!("without +{ctrl} in cgroup.subtree_control")) && e.contains(file), "{e}");
        }
        assert!(host.cpu().is_err());
        let m = tree.path().display();
        assert_eq!(host.describe(), format!("cgroup v2 at {m} (kill); unavailable: memory, pids, cpu"));
        for (what, limits) in [
            ("a memory limit", CgroupLimits { memory_bytes: 1 << 28, ..Default::default() }),
            ("a process limit", CgroupLimits { max_processes: 8, ..Default::default() }),
            ("a cpu limit", CgroupLimits { cpu_millis: 100, ..Default::default() }),
        ] {
            let e = host.create("sb1", &limits).unwrap_err();
            assert!(matches!(e, CgroupError::Unsupported { what: w, .. } if w == what), "{e}");
        }
        let cg = host.create("sb1", &CgroupLimits::default()).unwrap();
        assert_eq!(cg.paths(), vec![tree.path().join("corral/sb1")]);
        assert_eq!(written(&cg.paths()[0]), BTreeMap::new());
    }

    /// A nested parent (a systemd unit's delegated subtree) on v2.
    #[test]
    fn fixture_v2_nested_parent_carries_limits() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "system.slice/corral.service/sandboxes");
        assert_eq!(host.memory(), Ok(Mechanism::CgroupV2));
        let cg = host.create("sb1", &CgroupLimits { max_processes: 8, ..Default::default() }).unwrap();
        let dir = tree.path().join("system.slice/corral.service/sandboxes/sb1");
        assert_eq!(cg.paths(), vec![dir.clone()]);
        assert_eq!(written(&dir), files(&[("pids.max", "8")]));
    }

    #[test]
    fn fixture_v1_detects_every_controller_on_v1() {
        let tree = Tree::v1(&ALL);
        let host = CgroupHost::detect(tree.path(), "corral");
        let v1 = Ok(Mechanism::CgroupV1);
        assert_eq!(mechanisms(&host), [v1.clone(), v1.clone(), v1.clone(), v1]);
        assert_eq!(host.kill.as_ref().unwrap().root, tree.path().join("pids"));
        assert!(!host.v2_kill);
        assert_eq!(host.describe(), "cgroup v1: membership, memory, pids, cpu");
        assert_eq!(Mechanism::CgroupV1.to_string(), "cgroup v1");
    }

    /// Pure v1: one directory per controller, each with its v1 files.
    #[test]
    fn fixture_v1_limits_go_to_the_v1_files() {
        let tree = Tree::v1(&ALL);
        let host = CgroupHost::detect(tree.path(), "corral");
        let cg = host.create("sb1", &LIMITS).unwrap();
        let dir = |c: &str| tree.path().join(c).join("corral/sb1");
        assert_eq!(cg.paths(), vec![dir("pids"), dir("memory"), dir("cpu")]);
        assert_eq!(cg.kill_file, None);
        assert_eq!(written(&dir("pids")), files(&[("pids.max", "64")]));
        let memory = [("memory.limit_in_bytes", BYTES), ("memory.memsw.limit_in_bytes", BYTES)];
        assert_eq!(written(&dir("memory")), files(&memory));
        assert_eq!(written(&dir("cpu")), files(&[("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "50000")]));
        assert_eq!(host.open("sb1").expect("open").paths(), cg.paths());
        cg.remove().unwrap();
        assert!(cg.paths().iter().all(|d| !d.exists()), "{:?}", cg.paths());
        assert!(host.open("sb1").is_none());
    }

    /// v1 without the pids hierarchy: tracking moves to memory, and a
    /// process limit fails closed.
    #[test]
    fn fixture_v1_without_pids_fails_closed() {
        let tree = Tree::v1(&["memory", "cpu"]);
        let host = CgroupHost::detect(tree.path(), "corral");
        let e = host.pids().unwrap_err();
        let m = tree.path().display();
        let want = format!(
            "no writable pids controller under {m} (cgroup v2 without +pids in cgroup.subtree_control, or v1 pids not \
             mounted)"
        );
        assert_eq!(e, want);
        assert_eq!(host.kill.as_ref().unwrap().root, tree.path().join("memory"));
        assert_eq!(host.describe(), "cgroup v1: membership, memory, cpu; unavailable: pids");
        let e = host.create("sb1", &LIMITS).unwrap_err();
        assert!(matches!(e, CgroupError::Unsupported { what: "a process limit", .. }), "{e}");
        for c in ["memory", "cpu"] {
            assert_eq!(children(&tree.path().join(c).join("corral")), Vec::<PathBuf>::new(), "{c}");
        }
    }

    /// Hybrid: membership and cgroup.kill on v2 (which gets no limit),
    /// limits in the v1 hierarchies.
    #[test]
    fn fixture_hybrid_limits_on_v1_tracking_on_v2() {
        let tree = Tree::hybrid(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let v1 = Ok(Mechanism::CgroupV1);
        assert_eq!(mechanisms(&host), [v1.clone(), v1.clone(), v1, Ok(Mechanism::CgroupV2)]);
        let unified = tree.path().join("unified");
        assert_eq!(host.describe(), format!("hybrid: v2 at {} (kill), v1 memory, pids, cpu", unified.display()));
        let cg = host.create("sb1", &LIMITS).unwrap();
        let dir = |c: &str| tree.path().join(c).join("corral/sb1");
        assert_eq!(cg.paths(), vec![dir("unified"), dir("memory"), dir("pids"), dir("cpu")]);
        assert_eq!(cg.kill_file, Some(dir("unified").join("cgroup.kill")));
        assert_eq!(written(&dir("unified")), BTreeMap::new());
        let memory = [("memory.limit_in_bytes", BYTES), ("memory.memsw.limit_in_bytes", BYTES)];
        assert_eq!(written(&dir("memory")), files(&memory));
        assert_eq!(written(&dir("pids")), files(&[("pids.max", "64")]));
        assert_eq!(written(&dir("cpu")), files(&[("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "50000")]));
        cg.remove().unwrap();
        assert!(cg.paths().iter().all(|d| !d.exists()), "{:?}", cg.paths());
    }

    /// v2 counts OOM kills in memory.events and refused forks in pids.events.
    #[test]
    fn fixture_v2_limit_hits_read_the_events_files() {
        let tree = Tree::v2(&ALL, true);
        let cg = CgroupHost::detect(tree.path(), "corral").create("sb1", &LIMITS).unwrap();
        assert_eq!(cg.limit_hits(), LimitHits::default());
        let dir = &cg.paths()[0];
        fs::write(dir.join("memory.events"), "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\noom_group_kill 0\n").unwrap();
        fs::write(dir.join("pids.events"), "max 7\n").unwrap();
        assert_eq!(cg.limit_hits(), LimitHits { memory_oom_kills: 2, pids_refused: 7 });
    }

    /// v1 counts OOM kills in memory.oom_control, or (old kernels without
    /// its oom_kill line) counts a non-zero memory.failcnt as one.
    #[test]
    fn fixture_v1_limit_hits_read_oom_control_then_failcnt() {
        let tree = Tree::v1(&ALL);
        let cg = CgroupHost::detect(tree.path(), "corral").create("sb1", &LIMITS).unwrap();
        assert_eq!(cg.limit_hits(), LimitHits::default());
        let memory = tree.path().join("memory/corral/sb1");
        fs::write(memory.join("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        fs::write(memory.join("memory.failcnt"), "40\n").unwrap();
        fs::write(tree.path().join("pids/corral/sb1/pids.events"), "max 5\n").unwrap();
        assert_eq!(cg.limit_hits(), LimitHits { memory_oom_kills: 3, pids_refused: 5 });
        fs::write(memory.join("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\n").unwrap();
        assert_eq!(cg.limit_hits(), LimitHits { memory_oom_kills: 1, pids_refused: 5 });
        fs::write(memory.join("memory.failcnt"), "0\n").unwrap();
        assert_eq!(cg.limit_hits(), LimitHits { memory_oom_kills: 0, pids_refused: 5 });
    }

    /// A leftover that lists a process is refused (and left alone); an
    /// empty one is replaced, with the new limits.
    #[test]
    fn fixture_leftover_busy_is_refused_empty_is_replaced() {
        let tree = Tree::v2(&ALL, true);
        let host = CgroupHost::detect(tree.path(), "corral");
        let dir = tree.path().join("corral/sb1");
        host.create("sb1", &CgroupLimits { max_processes: 10, ..Default::default() }).unwrap();
        // A made-up pid: nothing here signals it.
        fs::write(dir.join("cgroup.procs"), "4194304\n").unwrap();
        match host.create("sb1", &CgroupLimits::default()) {
            Err(CgroupError::Io { op, path, .. }) => {
                assert_eq!((op, path), ("replace leftover cgroup (kill_all it first)", dir.clone()))
            }
            other => panic!("a busy leftover: {other:?}"),
        }
        assert_eq!(written(&dir), files(&[("cgroup.procs", "4194304\n"), ("pids.max", "10")]));
        fs::write(dir.join("cgroup.procs"), "").unwrap();
        host.create("sb1", &CgroupLimits { max_processes: 20, ..Default::default() }).unwrap();
        assert_eq!(written(&dir), files(&[("pids.max", "20")]));
    }
}
