//! How the daemon's egress proxy (and the tool-call gate's endpoint) reach
//! into a sandbox: bwrap reports the
//! sandbox's first pid on `--info-fd` and waits on `--block-fd`; meanwhile
//! the daemon creates a listening socket *inside the sandbox's network
//! namespace* (from a short-lived thread that enters it with setns), hands
//! it to the proxy, and only then lets bwrap run the harness. Nothing is
//! bound into the sandbox, no process of the daemon's lives in it, and the
//! socket goes away with the proxy.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

/// Where the proxy listens inside every sandbox with network.
pub const PROXY_PORT: u16 = 3128;
/// What the harness gets in `HTTPS_PROXY` and its siblings.
pub const PROXY_URL: &str = "http://127.0.0.1:3128";

/// How long bwrap gets to report its child.
const INFO_TIMEOUT: Duration = Duration::from_secs(10);

/// A pipe as (read end, write end), both close-on-exec.
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (std::os::fd::FromRawFd::from_raw_fd(fds[0]), std::os::fd::FromRawFd::from_raw_fd(fds[1])) })
}

/// Reads bwrap's `--info-fd` JSON to its end, then the child's pid. (Not
/// sooner: bwrap writes the namespace ids after the pid, and a pipe closed
/// under it kills it with SIGPIPE.)
pub async fn read_child_pid(info: OwnedFd) -> std::io::Result<i32> {
    let task = tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::from(info);
        let mut text = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let so_far = String::from_utf8_lossy(&text);
            if so_far.trim_end().ends_with('}') {
                return child_pid(&so_far).ok_or_else(|| std::io::Error::other("bwrap's info has no child-pid"));
            }
            let n = file.read(&mut buf)?;
            if n == 0 || text.len() > 64 << 10 {
                return Err(std::io::Error::other("bwrap ended without reporting its child"));
            }
            text.extend_from_slice(&buf[..n]);
        }
    });
    match tokio::time::timeout(INFO_TIMEOUT, task).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(std::io::Error::other(e)),
        Err(_) => Err(std::io::Error::other("bwrap did not report its child in time")),
    }
}

/// `"child-pid": N` once the line with it is complete.
fn child_pid(text: &str) -> Option<i32> {
    let rest = &text[text.find("\"child-pid\"")? + "\"child-pid\"".len()..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end = rest.find(|c: char| !c.is_ascii_digit())?;
    rest[..end].parse().ok()
}

/// A listening TCP socket on each of `ports` (all of the namespace's
/// addresses: only its loopback exists) inside the network namespace of
/// `pid`, in order. Enters it from a thread of its own, so no daemon thread
/// changes namespace.
pub async fn listen_in(pid: i32, ports: Vec<u16>) -> std::io::Result<Vec<std::net::TcpListener>> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let task = tokio::task::spawn_blocking(move || {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: setns on a namespace descriptor we hold; it
                    // affects only this thread, which ends right after.
                    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let mut listeners = Vec::new();
                    for port in ports {
                        let listener = std::net::TcpListener::bind(("0.0.0.0", port))?;
                        listener.set_nonblocking(true)?;
                        listeners.push(listener);
                    }
                    Ok(listeners)
                })
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("netns thread panicked")))
        })
    });
    task.await.map_err(std::io::Error::other)?
}

/// Lets bwrap go on (one byte on its `--block-fd`).
pub fn release(block: OwnedFd) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::File::from(block).write_all(b"1")
}

#[cfg(test)]
mod tests {
    use super::child_pid;

    #[test]
    fn the_child_pid_is_read_from_bwraps_info() {
        assert_eq!(child_pid("{\n    \"child-pid\": 4242,\n    \"cgroup-namespace\": 1"), Some(4242));
        assert_eq!(child_pid("{\n    \"child-pid\": 42"), None, "a number still being written");
        assert_eq!(child_pid("{\"child-pid\":7}"), Some(7));
        assert_eq!(child_pid("{}"), None);
    }
}
