//! Seccomp keeps a sandbox to the socket families its network namespace
//! covers: `AF_VSOCK` (the hypervisor, past any namespace), `AF_PACKET` and
//! the rest fail inside a real `linux_bwrap` sandbox before anything is
//! connected, while `AF_UNIX`, `AF_INET`, `AF_INET6` and netlink's
//! `NETLINK_ROUTE` keep working.

mod common;

use std::collections::BTreeMap;

use common::{finished, request, require_bwrap, Options, TestDaemon};

/// Opens one socket per family and prints `<label> ok` or `<label> <errno name>`.
/// Only `socket(2)` / `socketpair(2)`: nothing is ever connected or sent.
const PROBE: &str = r#"
import errno, socket
def probe(label, make):
    try:
        make().close()
        print(label, "ok", flush=True)
    except OSError as e:
        print(label, errno.errorcode.get(e.errno, str(e.errno)), flush=True)
probe("vsock_stream", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM, 0))
probe("vsock_dgram", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_DGRAM, 0))
probe("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0))
probe("alg", lambda: socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0))
probe("netlink_audit", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_AUDIT if hasattr(socket, "NETLINK_AUDIT") else 9))
probe("netlink_uevent", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 15))
probe("netlink_route", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE))
probe("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0))
class Pair:
    def __init__(self):
        self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    def close(self):
        self.a.close(); self.b.close()
probe("unix_pair", Pair)
probe("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0))
probe("inet6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, 0))
"#;

fn parse(out: &str) -> BTreeMap<String, String> {
    out.lines().filter_map(|l| l.split_once(' ')).map(|(k, v)| (k.to_string(), v.trim().to_string())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_unix_inet_and_netlink_route_sockets_open_inside_a_sandbox() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let script = format!("python3 - <<'EOF'\n{PROBE}\nEOF");
    let execution = finished(&daemon.execute(request("builtin.shell", &script)).await);
    let got = parse(&execution.tool_output);
    let want: BTreeMap<String, String> = [
        ("vsock_stream", "EPERM"),
        ("vsock_dgram", "EPERM"),
        ("packet", "EPERM"),
        ("alg", "EPERM"),
        ("netlink_audit", "EPERM"),
        ("netlink_uevent", "EPERM"),
        ("netlink_route", "ok"),
        ("unix", "ok"),
        ("unix_pair", "ok"),
        ("inet", "ok"),
        ("inet6", "ok"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(got, want, "output: {}\nerror: {}", execution.tool_output, execution.tool_error);
    daemon.stop().await;
}

/// The control: the same probe under bwrap with the same namespaces and no
/// filter opens an `AF_VSOCK` socket, so the test above would catch a
/// filter that lets it through. (A missing vsock module would make this
/// say EAFNOSUPPORT: then the kernel, not the filter, refused, and the
/// test above proves nothing on this host; fail rather than pass blind.)
#[test]
fn without_the_filter_the_same_probe_opens_vsock() {
    require_bwrap();
    let out = std::process::Command::new("bwrap")
        .args(["--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"])
        .args(["--", "python3", "-c", PROBE])
        .output()
        .expect("bwrap runs");
    let got = parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(
        got.get("vsock_stream").map(String::as_str),
        Some("ok"),
        "{got:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(got.get("packet").map(String::as_str), Some("ok"), "{got:?}");
    assert_eq!(got.get("netlink_uevent").map(String::as_str), Some("ok"), "{got:?}");
}
