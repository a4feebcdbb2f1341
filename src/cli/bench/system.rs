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
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
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

/// Entries under a directory (0 when it does not exist).
pub fn entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(unix_listener_pid(&path), None, "nobody listens there any more");
    }
}
