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
    pub memory_bytes: u64,
    pub max_processes: u64,
    /// CPU in millicores (1000 = one CPU).
    pub cpu_millis: u64,
}

/// Which mechanism enforces a given limit here (the reason none can is the
/// `Err` of the [`CgroupHost`] accessor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mechanism {
    CgroupV2,
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
    pub memory_oom_kills: u64,
    pub pids_refused: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("invalid cgroup name {0:?}: only [A-Za-z0-9_-] are allowed")]
    InvalidName(String),
    #[error("cannot enforce {what} with cgroups: {reason}")]
    Unsupported { what: &'static str, reason: String },
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cgroup {} still holds pids {pids:?} after {timeout:?}", path.display())]
    NotEmpty { path: PathBuf, pids: Vec<i32>, timeout: Duration },
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

    pub fn memory(&self) -> Result<Mechanism, String> {
        self.memory.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }
    pub fn pids(&self) -> Result<Mechanism, String> {
        self.pids.as_ref().map(|s| s.mech.clone()).map_err(Clone::clone)
    }
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
                fs::create_dir(&dir).map_err(io_err("create cgroup", &dir))?;
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

    /// Every pid currently in the sandbox's cgroup(s), union over hierarchies.
    pub fn pids(&self) -> Vec<i32> {
        let mut all = BTreeSet::new();
        for dir in &self.dirs {
            let text = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            all.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()).filter(|p| *p > 0));
        }
        all.into_iter().collect()
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
    pub async fn kill_all(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        loop {
            let pids = self.pids();
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
        _ => Ok(()),
    }
}

/// rmdir, retried briefly on EBUSY (a cgroup can stay busy for a moment
/// after its last process exited); a missing directory is success.
fn rmdir_retry(dir: &Path) -> Result<(), CgroupError> {
    for attempt in 0.. {
        match fs::remove_dir(dir) {
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
    fs::create_dir(&dir).map_err(|e| format!("creating probe {}: {e}", dir.display()))?;
    let result = check(&dir);
    let removed = rmdir_retry(&dir).map_err(|e| e.to_string());
    result.and(removed)
}

#[cfg(test)]
mod tests {
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

    fn ppid(pid: i32) -> Option<i32> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
    }

    /// Running (not gone and not a zombie awaiting its reaper).
    fn alive(pid: i32) -> bool {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z")
    }

    /// A parent nested like a systemd unit's delegated subtree works as a
    /// flat one does; `..` and empty levels are refused.
    #[test]
    fn a_nested_parent_carries_limits() {
        let nested = CgroupHost::detect(Path::new(MOUNT), "corral-test-nested/unit.service/sandboxes");
        assert_eq!((nested.pids(), nested.kill()), (Ok(Mechanism::CgroupV1), Ok(Mechanism::CgroupV2)));
        let limits = CgroupLimits { max_processes: 8, ..Default::default() };
        let cg = Guard(nested.create(&unique_name(), &limits).expect("create a nested cgroup"));
        assert!(cg.0.dirs.iter().all(|d| d.to_string_lossy().contains("corral-test-nested/unit.service/sandboxes/")));
        drop(cg);
        for bad in ["a/../b", "a//b", "./a", "a/b c"] {
            assert!(CgroupHost::detect(Path::new(MOUNT), bad).kill().is_err(), "{bad}");
        }
    }

    #[test]
    fn detects_this_hybrid_host() {
        let host = host();
        assert_eq!(host.memory(), Ok(Mechanism::CgroupV1));
        assert_eq!(host.pids(), Ok(Mechanism::CgroupV1));
        assert_eq!(host.cpu(), Ok(Mechanism::CgroupV1));
        assert_eq!(host.kill(), Ok(Mechanism::CgroupV2));
        let d = host.describe();
        assert!(d.starts_with("hybrid: v2 at /sys/fs/cgroup/unified (kill)"), "{d}");
        assert!(d.contains("v1 memory, pids, cpu") && !d.contains("unavailable"), "{d}");
        assert_eq!(Mechanism::CgroupV2.to_string(), "cgroup v2");
    }

    /// The pure-v2 layout, as far as this host allows: the unified mount
    /// as the mount root (no controllers there, but cgroup.kill).
    #[tokio::test]
    async fn pure_v2_layout_on_the_unified_mount() {
        let unified = Path::new(MOUNT).join("unified");
        let host = CgroupHost::detect(&unified, PARENT);
        assert_eq!(host.kill(), Ok(Mechanism::CgroupV2));
        let e = host.memory().unwrap_err();
        assert!(e.contains("without +memory in cgroup.subtree_control") && e.contains("memory.max"), "{e}");
        assert!(host.pids().is_err() && host.cpu().is_err());
        let d = host.describe();
        assert_eq!(d, format!("cgroup v2 at {} (kill); unavailable: memory, pids, cpu", unified.display()));
        let limits = CgroupLimits { cpu_millis: 100, ..Default::default() };
        assert!(matches!(
            host.create(&unique_name(), &limits),
            Err(CgroupError::Unsupported { what: "a cpu limit", .. })
        ));
        let cg = Guard(host.create(&unique_name(), &CgroupLimits::default()).unwrap());
        assert_eq!(cg.paths().len(), 1);
        assert!(cg.kill_file.is_some());
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

    #[test]
    fn cpu_and_memory_files_hold_what_was_written() {
        let limits = CgroupLimits { memory_bytes: 256 << 20, max_processes: 64, cpu_millis: 500 };
        let cg = create(limits);
        let read = |p: PathBuf| fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let mut seen = 0;
        for dir in cg.paths() {
            if dir.join("cpu.cfs_quota_us").exists() {
                assert_eq!(read(dir.join("cpu.cfs_quota_us")).trim(), "50000");
                assert_eq!(read(dir.join("cpu.cfs_period_us")).trim(), "100000");
                seen += 1;
            }
            if dir.join("cpu.max").exists() {
                assert_eq!(read(dir.join("cpu.max")).trim(), "50000 100000");
                seen += 1;
            }
            if dir.join("memory.limit_in_bytes").exists() {
                assert_eq!(read(dir.join("memory.limit_in_bytes")).trim(), (256u64 << 20).to_string());
                if dir.join("memory.memsw.limit_in_bytes").exists() {
                    assert_eq!(read(dir.join("memory.memsw.limit_in_bytes")).trim(), (256u64 << 20).to_string());
                }
            }
            if dir.join("pids.max").exists() {
                assert_eq!(read(dir.join("pids.max")).trim(), "64");
            }
        }
        assert_eq!(seen, 1, "exactly one cpu limit in {:?}", cg.paths());
        // Hybrid: v2 membership + one v1 dir per limit.
        assert_eq!(cg.paths().len(), 4, "{:?}", cg.paths());
        assert!(cg.paths()[0].starts_with("/sys/fs/cgroup/unified/corral-test"));
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
}
