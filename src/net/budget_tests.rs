//! The daemon-wide connection budget over real sockets: two sandboxes'
//! proxies (two principals) share one budget, as the engine's do.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use super::proxy::{serve_with, Limits};
use super::*;

const WAIT: Duration = Duration::from_secs(5);

/// Echoes every connection back.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    if stream.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A sandbox's proxy allowing `target`, for `principal`, on `budget`
/// (`None`: no budget attached).
async fn proxy(
    target: SocketAddr,
    budget: Option<(&Arc<ProxyBudget>, &str)>,
) -> (SocketAddr, Arc<EgressLog>, ProxyHandle) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        allowlist: Allowlist::new(parse_hosts(&[target.to_string()]).unwrap()),
        protected: vec![],
        host_addresses: host_addresses(),
        connect_timeout: Duration::from_secs(2),
    };
    let log = Arc::new(EgressLog::default());
    if let Some((budget, principal)) = budget {
        log.attach_budget(budget.clone(), principal);
    }
    let handle = serve_with(listener, config, log.clone(), Limits::default());
    (addr, log, handle)
}

/// CONNECT through `proxy`: the open tunnel, or the status line it got.
async fn connect(proxy: SocketAddr, target: SocketAddr) -> Result<TcpStream, String> {
    let mut client = TcpStream::connect(proxy).await.unwrap();
    client.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match timeout(WAIT, client.read(&mut byte)).await.expect("answered") {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if head.starts_with("HTTP/1.1 200 ") {
        Ok(client)
    } else {
        Err(head.lines().next().unwrap_or_default().to_string())
    }
}

/// The tunnel still carries bytes both ways.
async fn works(tunnel: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4];
    tunnel.write_all(b"ping").await.is_ok()
        && matches!(timeout(WAIT, tunnel.read_exact(&mut buf)).await, Ok(Ok(_)))
        && &buf == b"ping"
}

fn denials(log: &EgressLog) -> Vec<EgressDecision> {
    log.drain().into_iter().filter(|d| !d.allowed).collect()
}

#[tokio::test]
async fn past_the_daemon_wide_cap_every_sandbox_is_refused_until_one_closes() {
    let server = echo_server().await;
    let budget = ProxyBudget::new(2, 2, Duration::from_secs(300));
    let (a, a_log, _a) = proxy(server, Some((&budget, "tenant-a"))).await;
    let (b, b_log, _b) = proxy(server, Some((&budget, "tenant-b"))).await;
    let mut first = connect(a, server).await.unwrap();
    let _second = connect(a, server).await.unwrap();
    let refused = connect(a, server).await.unwrap_err();
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(connect(b, server).await.unwrap_err().starts_with("HTTP/1.1 503"), "the cap is daemon-wide");
    for log in [&a_log, &b_log] {
        let denied = denials(log);
        assert_eq!(denied.len(), 1, "{denied:?}");
        assert_eq!(
            (denied[0].host.as_str(), denied[0].port, denied[0].method),
            ("127.0.0.1", server.port(), "connect")
        );
        assert_eq!(denied[0].rule_or_reason, "the daemon's proxy connection limit (2) is reached");
    }
    assert!(works(&mut first).await, "the tunnels within the cap are untouched");
    drop(first);
    // The closed tunnel's share comes back once its task sees the close.
    let start = tokio::time::Instant::now();
    let mut reopened = loop {
        match connect(b, server).await {
            Ok(tunnel) => break tunnel,
            Err(_) if start.elapsed() < WAIT => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the freed share never came back: {e}"),
        }
    };
    assert!(works(&mut reopened).await);
}

#[tokio::test]
async fn one_principal_cannot_take_the_whole_budget() {
    let server = echo_server().await;
    let budget = ProxyBudget::new(10, 2, Duration::from_secs(300));
    let (a1, a_log, _a1) = proxy(server, Some((&budget, "tenant-a"))).await;
    // A second sandbox of the same principal shares its cap.
    let (a2, _, _a2) = proxy(server, Some((&budget, "tenant-a"))).await;
    let (b, _, _b) = proxy(server, Some((&budget, "tenant-b"))).await;
    let _t1 = connect(a1, server).await.unwrap();
    let _t2 = connect(a2, server).await.unwrap();
    assert!(connect(a1, server).await.unwrap_err().starts_with("HTTP/1.1 503"));
    let denied = denials(&a_log);
    assert_eq!(denied[0].rule_or_reason, "this principal's proxy connection limit (2) is reached");
    let mut tb1 = connect(b, server).await.expect("another principal still gets its own");
    let _tb2 = connect(b, server).await.unwrap();
    assert!(works(&mut tb1).await);
    assert_eq!(budget.in_use("tenant-a"), (4, 2));
}

#[tokio::test]
async fn an_idle_tunnel_is_closed_and_a_busy_one_is_not() {
    let server = echo_server().await;
    let budget = ProxyBudget::new(10, 10, Duration::from_millis(300));
    let (p, _, _handle) = proxy(server, Some((&budget, "tenant-a"))).await;
    let mut idle = connect(p, server).await.unwrap();
    let mut busy = connect(p, server).await.unwrap();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(works(&mut busy).await, "a tunnel that moves bytes stays open");
    }
    let mut buf = [0u8; 1];
    let closed = timeout(WAIT, idle.read(&mut buf)).await.expect("the proxy closed the idle tunnel");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    let start = tokio::time::Instant::now();
    while budget.in_use("tenant-a").1 != 1 {
        assert!(start.elapsed() < WAIT, "the idle tunnel's share is given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_proxy_without_a_budget_refuses_everything() {
    let server = echo_server().await;
    let (p, log, _handle) = proxy(server, None).await;
    assert!(connect(p, server).await.unwrap_err().starts_with("HTTP/1.1 503"));
    assert_eq!(denials(&log)[0].rule_or_reason, "no connection budget is attached to this proxy");
}
