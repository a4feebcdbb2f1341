//! What the bench reads from the host: the machine, a process's resident
//! memory, which process listens on a port, and what sandboxes left behind.

use std::collections::HashSet;
use std::path::Path;

use serde::Serialize;

/// The machine a run was made on.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HostInfo {
    /// CPUs available to the bench.
    pub nproc: usize,
    /// The CPU model from `/proc/cpuinfo`; empty when unknown.
    pub cpu_model: String,
    /// Total memory, in MiB.
    pub mem_total_mib: u64,
    /// The kernel release.
    pub kernel: String,
    /// `bwrap --version`, or `not found`.
    pub bwrap: String,
    /// `/proc/loadavg` when the run started: other work on the machine
    /// shares its cores with the bench.
    pub load_average_start: String,
}

impl HostInfo {
    /// Reads the machine's figures from `/proc` and `bwrap --version`.
    pub fn detect() -> HostInfo {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.to_string()))
            .and_then(|l| l.split_once(':').map(|(_, v)| v.trim().to_string()))
            .unwrap_or_default();
        let bwrap = std::process::Command::new("bwrap")
            .arg("--version")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "not found".into());
        HostInfo {
            nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cpu_model,
            mem_total_mib: meminfo_kib("MemTotal:").unwrap_or(0) / 1024,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string(),
            bwrap,
            load_average_start: load_average(),
        }
    }
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// A `/proc/meminfo` value in KiB.
pub fn meminfo_kib(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// Resident memory (`VmRSS`) of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// The highest resident memory (`VmHWM`) of `pid` since it started or
/// since [`reset_peak_rss`], in KiB: the kernel's own peak, which no
/// sampling interval can miss.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

/// Resets the peak resident memory of `pid` to its current RSS ("5" to
/// `/proc/<pid>/clear_refs`, Linux >= 4.0). `false` when that is refused
/// (another user's process, an older kernel): its peak must then be
/// sampled.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// A `kB` line of `/proc/<pid>/status`.
fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// CPU time `pid` used so far (user + system, every thread), in clock
/// ticks.
pub fn process_cpu_ticks(pid: u32) -> Option<u64> {
    parse_process_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `utime + stime` of a `/proc/<pid>/stat` line: its 14th and 15th fields,
/// counted after the `)` that ends the command name (which may itself
/// hold spaces and parentheses).
fn parse_process_cpu(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // `rest` starts at field 3 (state): utime is field 14, stime 15.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The process on this host that listens on TCP `port` (and whose file
/// descriptors we may read: our own user's), found through the socket
/// inode in `/proc/net/tcp{,6}`.
pub fn listener_pid(port: u16) -> Option<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st ... inode (field 9)
            let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9)) else {
                continue;
            };
            let local_port = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && *state == "0A" {
                inodes.push(format!("socket:[{inode}]"));
            }
        }
    }
    pid_holding(&inodes)
}

/// The process on this host that listens on the unix socket at `path`,
/// found through the socket inode in `/proc/net/unix`.
pub fn unix_listener_pid(path: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string("/proc/net/unix").ok()?;
    let path = path.to_str()?;
    let inodes: Vec<String> = text
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode Path
            let fields: Vec<&str> = line.split_whitespace().collect();
            let listening = fields.get(3) == Some(&"00010000");
            (listening && fields.get(7) == Some(&path)).then(|| format!("socket:[{}]", fields[6]))
        })
        .collect();
    pid_holding(&inodes)
}

/// The first process holding one of `inodes` (`socket:[N]`) open.
fn pid_holding(inodes: &[String]) -> Option<u32> {
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path()) {
                if inodes.iter().any(|i| link.as_os_str() == i.as_str()) {
                    return Some(pid);
                }
            }
        }
    }
    None
}

/// Processes a sandbox left running, and bwrap zombies nobody reaped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LeakedProcesses {
    /// Live processes whose environment carries the `CORRAL_SANDBOX_ID` of
    /// one of the run's sandboxes (everything corral starts in a sandbox
    /// does; readable for our own user's processes only).
    pub with_sandbox_id: usize,
    /// Of those, how many are `bwrap` itself.
    pub bwrap: usize,
    /// `bwrap` zombies whose parent is the daemon.
    pub bwrap_zombies: usize,
}

/// Scans `/proc` for what the sandboxes `ids` left behind (so other
/// daemons and runs on the host do not count). `daemon_pid` names the
/// parent whose unreaped bwrap children count as zombies.
pub fn leaked_processes(daemon_pid: Option<u32>, ids: &HashSet<String>) -> LeakedProcesses {
    let mut leaks = LeakedProcesses::default();
    let Ok(dir) = std::fs::read_dir("/proc") else { return leaks };
    let me = std::process::id();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid ...: comm may hold spaces, so split at ')'.
        let (comm, rest) = match (stat.find('('), stat.rfind(')')) {
            (Some(open), Some(close)) if close > open => (&stat[open + 1..close], &stat[close + 1..]),
            _ => continue,
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
        if comm == "bwrap" && state == "Z" && daemon_pid.is_some() && ppid == daemon_pid {
            leaks.bwrap_zombies += 1;
            continue;
        }
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let ours = environ
            .split(|b| *b == 0)
            .filter_map(|var| var.strip_prefix(b"CORRAL_SANDBOX_ID="))
            .any(|id| std::str::from_utf8(id).is_ok_and(|id| ids.contains(id)));
        if ours {
            leaks.with_sandbox_id += 1;
            if comm == "bwrap" {
                leaks.bwrap += 1;
            }
        }
    }
    leaks
}

/// The host's CPU time so far, from `/proc/stat`'s `cpu` line, in clock
/// ticks: every process's and the kernel's, so a level's figure counts the
/// daemon, bwrap, the harness, the bench and the kernel's own workers alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCpu {
    /// user + nice + system + irq + softirq (guest time is inside user;
    /// steal, the hypervisor running others, is no one's here).
    pub busy: u64,
    /// idle + iowait.
    pub idle: u64,
}

/// What the host's CPUs did over part of a run, per unit of work.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CpuUse {
    /// Busy CPU time on the whole host, in milliseconds, per execution (or
    /// per floor spawn).
    pub ms_per_run: f64,
    /// Busy share of all the CPUs' time (1.0: every CPU busy throughout).
    pub busy_share: f64,
}

impl HostCpu {
    /// Now, or `None` where there is no `/proc/stat`.
    pub fn now() -> Option<HostCpu> {
        HostCpu::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The totals of the `cpu` line of a `/proc/stat` text.
    pub fn parse(stat: &str) -> Option<HostCpu> {
        let line = stat.lines().find(|l| l.split_whitespace().next() == Some("cpu"))?;
        let v: Vec<u64> = line.split_whitespace().skip(1).map(|f| f.parse().ok()).collect::<Option<_>>()?;
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal guest guest_nice
        (v.len() >= 4).then(|| HostCpu { busy: at(0) + at(1) + at(2) + at(5) + at(6), idle: at(3) + at(4) })
    }

    /// The CPU used from `self` to `later` for `runs` runs, with `tick_ms`
    /// milliseconds in a tick; `None` without runs or ticks.
    pub fn used_until(self, later: HostCpu, runs: usize, tick_ms: f64) -> Option<CpuUse> {
        let busy = later.busy.checked_sub(self.busy)?;
        let total = busy + later.idle.checked_sub(self.idle)?;
        (runs > 0 && total > 0)
            .then(|| CpuUse { ms_per_run: busy as f64 * tick_ms / runs as f64, busy_share: busy as f64 / total as f64 })
    }
}

/// Milliseconds in one `/proc/stat` clock tick (`_SC_CLK_TCK`; 10 on Linux).
pub fn tick_ms() -> f64 {
    // SAFETY: sysconf reads a constant of the system; no memory is touched.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        1000.0 / hz as f64
    } else {
        10.0
    }
}

/// Entries under a directory (0 when it does not exist).
/// Entries of `dir` whose path is not one of `except`.
pub fn entries_except(dir: &Path, except: &[std::path::PathBuf]) -> usize {
    let Ok(read) = std::fs::read_dir(dir) else { return 0 };
    read.filter_map(Result::ok).filter(|e| !except.contains(&e.path())).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's peak holds what a sampler could miss, and resetting it
    /// brings it back to the RSS of now.
    #[test]
    fn the_peak_rss_holds_a_spike_until_it_is_reset() {
        let me = std::process::id();
        assert!(reset_peak_rss(me), "writing 5 to /proc/self/clear_refs (Linux >= 4.0)");
        let base = peak_rss_kib(me).unwrap();
        // 64 MiB touched, then given back (a large allocation is unmapped on free).
        let spike = vec![1u8; 64 << 20];
        assert_eq!(spike.iter().step_by(4096).map(|&b| b as usize).sum::<usize>(), 16_384);
        drop(spike);
        let peak = peak_rss_kib(me).unwrap();
        assert!(peak >= base + 60 * 1024, "peak {peak} KiB, base {base} KiB");
        assert!(rss_kib(me).unwrap() < peak - 32 * 1024, "the spike is gone from VmRSS");
        assert!(reset_peak_rss(me));
        assert!(peak_rss_kib(me).unwrap() < peak - 32 * 1024, "the reset forgets the spike");
    }

    #[test]
    fn host_cpu_is_the_cpu_lines_busy_and_idle_ticks() {
        let stat = "cpu  100 5 50 1000 20 3 7 2 40 0\ncpu0 50 2 25 500 10 1 3 1 20 0\nintr 12345\n";
        // busy: user 100 + nice 5 + system 50 + irq 3 + softirq 7 (guest 40
        // is inside user; steal 2 is not ours); idle: idle 1000 + iowait 20.
        assert_eq!(HostCpu::parse(stat), Some(HostCpu { busy: 165, idle: 1020 }));
        assert_eq!(HostCpu::parse("cpu0 1 2 3 4\n"), None, "only the host's total line counts");
        assert_eq!(HostCpu::parse("cpu 1 x 3 4\n"), None);
        let (before, after) = (HostCpu { busy: 167, idle: 1020 }, HostCpu { busy: 367, idle: 1070 });
        // 200 busy ticks of 10 ms over 40 runs: 50 ms each; 200 of 250 ticks busy.
        assert_eq!(before.used_until(after, 40, 10.0), Some(CpuUse { ms_per_run: 50.0, busy_share: 0.8 }));
        assert_eq!(before.used_until(after, 0, 10.0), None);
        assert_eq!(after.used_until(before, 40, 10.0), None, "a counter that went back measures nothing");
        assert!(HostCpu::now().is_some_and(|c| c.busy > 0));
        assert!(tick_ms() > 0.0);
    }

    #[test]
    fn a_process_cpu_time_is_its_user_and_system_ticks() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
        // majflt cmajflt utime stime cutime ...
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 900 0 3 0 1234 56 7 8 20 0 3 0";
        assert_eq!(parse_process_cpu(stat), Some(1290), "children's cutime/cstime are not the process's");
        assert_eq!(parse_process_cpu("4242 (x) S 1 2 3"), None);
        assert_eq!(parse_process_cpu("no parenthesis 1 2 3 4 5 6 7 8 9 10 11 12 13"), None);
        let own = process_cpu_ticks(std::process::id()).expect("this process's own stat");
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(60) {
            std::hint::black_box(0u64);
        }
        assert!(process_cpu_ticks(std::process::id()).unwrap() > own, "60 ms of spinning shows");
    }

    #[test]
    fn the_process_listening_on_a_unix_socket_is_found() {
        let dir = std::env::temp_dir().join(format!("corral-unix-pid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(unix_listener_pid(&path), Some(std::process::id()));
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
        // A test beside this one that forks holds a copy of the listener in
        // its child until that child's exec closes it (close-on-exec): the
        // socket listens until then, in that child.
        let mut left = unix_listener_pid(&path);
        for _ in 0..200 {
            if left.is_none() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
            left = unix_listener_pid(&path);
        }
        assert_eq!(left, None, "nobody listens there any more");
    }
}
