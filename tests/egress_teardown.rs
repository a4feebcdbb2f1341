//! No egress proxy socket outlives its sandbox. Alone in its own test
//! binary: it looks at every socket of this process, and the other egress
//! tests' sandboxes would be alive beside it.

mod common;

use std::time::Duration;

use common::{finished, request, require_bwrap, wait_until, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn echo_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// Ports of the sockets this process holds (the daemon runs in it).
fn own_socket_ports() -> Vec<u16> {
    let mut ports = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: getsockname on a descriptor number of this process with a
        // buffer of the advertised size; a non-socket just fails.
        if unsafe { libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_storage).cast(), &mut len) } != 0 {
            continue;
        }
        if addr.ss_family as i32 == libc::AF_INET {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let sin: libc::sockaddr_in = unsafe { std::ptr::read((&addr as *const libc::sockaddr_storage).cast()) };
            ports.push(u16::from_be(sin.sin_port));
        }
    }
    ports
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_proxy_socket_outlives_its_sandbox() {
    require_bwrap();
    let a = echo_server().await;
    let profile = format!(
        "id = \"test.gone\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n\
         [sandbox]\ntype = \"linux_bwrap\"\nallow_network = true\nallow_hosts = [\"127.0.0.1:{a}\"]\n"
    );
    let before = own_socket_ports();
    assert!(!before.contains(&3128));
    // The echo server's listener; each tunnel through the proxy adds the
    // server's end of its connection on the same port.
    assert_eq!(before.iter().filter(|p| **p == a).count(), 1, "{before:?}");
    let daemon =
        TestDaemon::start(Options { profiles: vec![("gone.toml".into(), profile)], ..Options::default() }).await;
    // A tunnel left open by the harness's child when the run ends; the run
    // ends only once the test has seen the proxy and the tunnel (it writes
    // `seen` into the workspace), so "gone" below cannot pass for a proxy
    // that never listened.
    let script = format!(
        "python3 -c 'import socket,time; s=socket.create_connection((\"127.0.0.1\",3128)); s.sendall(b\"CONNECT 127.0.0.1:{a} HTTP/1.1\\r\\n\\r\\n\"); print(s.recv(100)); time.sleep(60)' &\n\
         while [ ! -e seen ]; do sleep 0.05; done; echo started"
    );
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request("test.gone", &script)).await.unwrap().into_inner();
    let mut events = Vec::new();
    let mut workspace = String::new();
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        let dispatched = matches!(event.kind, Some(Kind::Dispatched(_)));
        if let Some(Kind::SandboxReady(ready)) = &event.kind {
            workspace = ready.workspace_path.clone();
        }
        events.push(event);
        if dispatched {
            break;
        }
    }
    assert!(!workspace.is_empty(), "no sandbox_ready with a workspace: {events:?}");
    wait_until("the proxy listens on 3128 and the tunnel reaches the echo server", || {
        let ports = own_socket_ports();
        ports.contains(&3128) && ports.iter().filter(|p| **p == a).count() >= 2
    })
    .await;
    std::fs::write(format!("{workspace}/seen"), "").unwrap();
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        events.push(event);
    }
    assert_eq!(finished(&events).state, pb::ExecutionState::Succeeded as i32);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ports = own_socket_ports();
    assert!(!ports.contains(&3128), "a proxy listener outlived its sandbox: {ports:?}");
    // Nor does the tunnel: the proxy closed its upstream end, so the echo
    // server saw EOF and dropped its own.
    wait_until("the tunnel is closed", || own_socket_ports().iter().filter(|p| **p == a).count() == 1).await;
    daemon.stop().await;
}
