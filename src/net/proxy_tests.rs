//! The proxy over real sockets, all on 127.0.0.1: a test server, the proxy
//! in front of it, and a client talking HTTP/1.1 to the proxy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;

use super::proxy::{serve_with, Limits};
use super::*;

const WAIT: Duration = Duration::from_secs(5);

struct Proxy {
    addr: SocketAddr,
    handle: ProxyHandle,
    log: Arc<EgressLog>,
}

async fn proxy_with(allow: &[String], protected: Vec<SocketAddr>, limits: Limits) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        allowlist: Allowlist::new(parse_hosts(allow).unwrap()),
        protected,
        host_addresses: host_addresses(),
        connect_timeout: Duration::from_secs(2),
    };
    let log = Arc::new(EgressLog::default());
    log.attach_budget(ProxyBudget::new(10_000, 10_000, Duration::from_secs(300)), "tester");
    let handle = serve_with(listener, config, log.clone(), limits);
    Proxy { addr, handle, log }
}

async fn proxy(allow: &[String]) -> Proxy {
    proxy_with(allow, vec![], Limits::default()).await
}

/// Echoes every connection back, reporting what it received to `seen`.
async fn echo_server() -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    let _ = seen.send(buf[..n].to_vec());
                    if stream.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Answers one request per connection with `200 ok`, reporting the head and
/// the `Content-Length` body it received.
async fn http_server() -> (SocketAddr, mpsc::UnboundedReceiver<(String, Vec<u8>)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            let end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                match stream.read(&mut chunk).await {
                    Ok(n @ 1..) => buf.extend_from_slice(&chunk[..n]),
                    _ => return,
                }
            };
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .map_or(0, |n| n.trim().parse::<usize>().unwrap());
            while buf.len() < end + length {
                match stream.read(&mut chunk).await {
                    Ok(n @ 1..) => buf.extend_from_slice(&chunk[..n]),
                    _ => return,
                }
            }
            let _ = seen.send((head, buf[end..].to_vec()));
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").await;
        }
    });
    (addr, rx)
}

/// A port on 127.0.0.1 nothing listens on.
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

/// Sends `request` and reads until the proxy closes.
async fn exchange(proxy: SocketAddr, request: &[u8]) -> String {
    let mut client = TcpStream::connect(proxy).await.unwrap();
    client.write_all(request).await.unwrap();
    let mut response = Vec::new();
    timeout(WAIT, client.read_to_end(&mut response)).await.expect("the proxy answers and closes").unwrap();
    String::from_utf8_lossy(&response).to_string()
}

/// Opens a CONNECT tunnel and checks the proxy's exact answer.
async fn tunnel(proxy: SocketAddr, target: SocketAddr) -> TcpStream {
    let mut client = TcpStream::connect(proxy).await.unwrap();
    client.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes()).await.unwrap();
    let expected = b"HTTP/1.1 200 Connection established\r\n\r\n";
    let mut answer = vec![0u8; expected.len()];
    timeout(WAIT, client.read_exact(&mut answer)).await.expect("answered").unwrap();
    assert_eq!(String::from_utf8_lossy(&answer), String::from_utf8_lossy(expected));
    client
}

fn one_decision(log: &EgressLog) -> EgressDecision {
    let mut drained = log.drain();
    assert_eq!(drained.len(), 1, "exactly one decision per attempt: {drained:?}");
    drained.remove(0)
}

fn allowed(host: &str, port: u16, rule: &str, method: &'static str) -> EgressDecision {
    EgressDecision { host: host.into(), port, allowed: true, rule_or_reason: rule.into(), method }
}

#[tokio::test]
async fn connect_tunnels_both_ways_and_counts_bytes() {
    let (server, mut seen) = echo_server().await;
    let rule = server.to_string();
    let p = proxy(std::slice::from_ref(&rule)).await;
    let mut client = tunnel(p.addr, server).await;
    client.write_all(b"hello through the proxy").await.unwrap();
    let mut echo = [0u8; 23];
    timeout(WAIT, client.read_exact(&mut echo)).await.unwrap().unwrap();
    assert_eq!(&echo, b"hello through the proxy");
    assert_eq!(seen.recv().await.unwrap(), b"hello through the proxy");
    assert_eq!(one_decision(&p.log), allowed("127.0.0.1", server.port(), &rule, "connect"));
    assert_eq!(p.log.counts(), (1, 0));
    assert_eq!(p.log.bytes(), vec![(rule.clone(), 23, 23)]);
    assert!(p.log.denied_hosts(10).is_empty());
}

#[tokio::test]
async fn bytes_sent_with_the_connect_head_are_forwarded() {
    let (server, mut seen) = echo_server().await;
    let p = proxy(&[server.to_string()]).await;
    let mut client = TcpStream::connect(p.addr).await.unwrap();
    client.write_all(format!("CONNECT {server} HTTP/1.1\r\n\r\nearly").as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 39 + 5];
    timeout(WAIT, client.read_exact(&mut answer)).await.unwrap().unwrap();
    assert_eq!(answer, b"HTTP/1.1 200 Connection established\r\n\r\nearly");
    assert_eq!(seen.recv().await.unwrap(), b"early");
}

#[tokio::test]
async fn connect_to_another_loopback_port_is_forbidden() {
    let (server, _seen) = echo_server().await;
    let (other, mut other_seen) = echo_server().await;
    let p = proxy(&[server.to_string()]).await;
    let response = exchange(p.addr, format!("CONNECT {other} HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
    assert!(
        response.ends_with(&format!("\r\n\r\ncorral egress proxy: {other} is not in the allowlist\n")),
        "{response}"
    );
    let decision = one_decision(&p.log);
    assert_eq!((decision.host.as_str(), decision.port, decision.allowed), ("127.0.0.1", other.port(), false));
    assert_eq!(decision.rule_or_reason, format!("{other} is not in the allowlist"));
    assert_eq!(decision.method, "connect");
    assert_eq!(p.log.denied_hosts(10), vec![other.to_string()]);
    assert!(other_seen.try_recv().is_err(), "nothing reached the other server");
}

#[tokio::test]
async fn a_name_resolving_to_loopback_is_refused_after_resolution() {
    let (server, _seen) = echo_server().await;
    let p = proxy(&[format!("localhost:{}", server.port())]).await;
    let response = exchange(p.addr, format!("CONNECT localhost:{} HTTP/1.1\r\n\r\n", server.port()).as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
    assert!(response.contains("loopback"), "{response}");
    let decision = one_decision(&p.log);
    assert_eq!((decision.host.as_str(), decision.allowed), ("localhost", false));
    assert!(decision.rule_or_reason.contains("only an exact `ip:port` rule allows it"), "{decision:?}");
}

#[tokio::test]
async fn protected_addresses_are_forbidden_even_when_allowlisted() {
    let (server, mut seen) = echo_server().await;
    for protected in [server, SocketAddr::new([0, 0, 0, 0].into(), server.port())] {
        let p = proxy_with(&[server.to_string()], vec![protected], Limits::default()).await;
        let response = exchange(p.addr, format!("CONNECT {server} HTTP/1.1\r\n\r\n").as_bytes()).await;
        assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
        assert!(response.contains("daemon's own listeners"), "{response}");
        assert!(!one_decision(&p.log).allowed);
    }
    assert!(seen.try_recv().is_err());
}

/// A listener the daemon binds after a proxy was made (a warm sandbox's
/// proxy, made as the daemon starts, before it serves) is refused too.
#[tokio::test]
async fn a_listener_protected_after_the_proxy_was_made_is_forbidden() {
    let (server, mut seen) = echo_server().await;
    let p = proxy(&[server.to_string()]).await;
    let guard = crate::net::protect(server);
    let response = exchange(p.addr, format!("CONNECT {server} HTTP/1.1\r\n\r\n").as_bytes()).await;
    drop(guard);
    assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
    assert!(response.contains("daemon's own listeners"), "{response}");
    assert!(seen.try_recv().is_err(), "the connection reached the daemon's listener");
}

#[tokio::test]
async fn a_refused_connection_is_a_502_and_a_denial() {
    let port = closed_port().await;
    let p = proxy(&[format!("127.0.0.1:{port}")]).await;
    let response = exchange(p.addr, format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{response}");
    let decision = one_decision(&p.log);
    assert!(!decision.allowed);
    assert!(decision.rule_or_reason.starts_with(&format!("connecting to 127.0.0.1:{port}:")), "{decision:?}");
    assert_eq!(p.log.counts(), (0, 1));
}

#[tokio::test]
async fn plain_http_is_forwarded_in_origin_form() {
    let (server, mut seen) = http_server().await;
    let rule = server.to_string();
    let p = proxy(std::slice::from_ref(&rule)).await;
    let request = format!(
        "POST http://{server}/x?y=1 HTTP/1.1\r\nHost: {server}\r\nProxy-Authorization: Basic c2VjcmV0\r\n\
         Proxy-Connection: keep-alive\r\nUser-Agent: test\r\nContent-Length: 4\r\n\r\nbody"
    );
    let response = exchange(p.addr, request.as_bytes()).await;
    assert_eq!(response, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
    let (head, body) = seen.recv().await.unwrap();
    assert_eq!(
        head,
        format!("POST /x?y=1 HTTP/1.1\r\nHost: {server}\r\nUser-Agent: test\r\nContent-Length: 4\r\nConnection: close\r\n\r\n")
    );
    assert_eq!(body, b"body", "body bytes read with the head are forwarded");
    assert_eq!(one_decision(&p.log), allowed("127.0.0.1", server.port(), &rule, "http"));
    let (_, up, down) = p.log.bytes()[0].clone();
    assert_eq!((up, down), ((head.len() + 4) as u64, response.len() as u64));

    let response = exchange(p.addr, format!("GET http://{server}/x HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 200 OK"));
    assert!(seen.recv().await.unwrap().0.starts_with("GET /x HTTP/1.1\r\n"));
    assert_eq!(p.log.counts(), (2, 0));
}

#[tokio::test]
async fn plain_http_to_a_host_not_allowed_is_forbidden() {
    let (server, mut seen) = http_server().await;
    let p = proxy(&[server.to_string()]).await;
    let port = closed_port().await;
    let response = exchange(p.addr, format!("GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
    let response = exchange(p.addr, b"GET http://localhost/ HTTP/1.1\r\n\r\n").await;
    assert!(response.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{response}");
    let decisions = p.log.drain();
    assert_eq!(decisions.len(), 2);
    assert!(decisions.iter().all(|d| !d.allowed && d.method == "http"));
    assert_eq!(p.log.denied_hosts(10), vec![format!("127.0.0.1:{port}"), "localhost:80".into()]);
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn garbage_and_origin_form_are_bad_requests() {
    let p = proxy(&["*".to_string()]).await;
    for (request, reason) in [
        (&b"hello\r\n\r\n"[..], "malformed request line \"hello\""),
        (b"GET /x HTTP/1.1\r\nHost: example.com\r\n\r\n", "not a proxy request"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n", "not UTF-8"),
        (b"CONNECT example.com HTTP/1.1\r\n\r\n", "missing port"),
    ] {
        let response = exchange(p.addr, request).await;
        assert!(response.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{response}");
        let decision = one_decision(&p.log);
        assert!(!decision.allowed);
        assert!(decision.rule_or_reason.starts_with(reason), "{decision:?}");
    }
    assert_eq!(p.log.counts(), (0, 4));
    assert!(p.log.denied_hosts(10).is_empty(), "nothing named a host");
}

#[tokio::test]
async fn an_oversized_head_is_431() {
    let p = proxy(&["*".to_string()]).await;
    let request = format!("GET http://example.com/ HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(20_000));
    let response = exchange(p.addr, request.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{response}");
    assert_eq!(one_decision(&p.log).rule_or_reason, "request head over 16384 bytes");
}

#[tokio::test]
async fn a_silent_client_is_closed_after_the_head_timeout() {
    let limits = Limits { head_timeout: Duration::from_millis(200), ..Limits::default() };
    let p = proxy_with(&["*".to_string()], vec![], limits).await;
    let mut client = TcpStream::connect(p.addr).await.unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(timeout(WAIT, client.read(&mut buf)).await.expect("closed").unwrap(), 0);
    assert!(one_decision(&p.log).rule_or_reason.starts_with("no complete request head within 0.2s"));
    // A client that connects and closes without a byte is not an attempt.
    drop(TcpStream::connect(p.addr).await.unwrap());
    let probe = exchange(p.addr, b"hello\r\n\r\n").await;
    assert!(probe.starts_with("HTTP/1.1 400"));
    assert_eq!(p.log.counts(), (0, 2));
}

#[tokio::test]
async fn the_log_adds_up_over_mixed_attempts() {
    let (server, _seen) = echo_server().await;
    let rule = server.to_string();
    let p = proxy(std::slice::from_ref(&rule)).await;
    for _ in 0..2 {
        let mut client = tunnel(p.addr, server).await;
        client.write_all(b"ping").await.unwrap();
        let mut pong = [0u8; 4];
        timeout(WAIT, client.read_exact(&mut pong)).await.unwrap().unwrap();
    }
    for port in [1, 2, 1] {
        let response = exchange(p.addr, format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").as_bytes()).await;
        assert!(response.starts_with("HTTP/1.1 403"));
    }
    assert_eq!(p.log.counts(), (2, 3));
    assert_eq!(p.log.drain().len(), 5);
    assert_eq!(p.log.denied_hosts(10), vec!["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()]);
    assert_eq!(p.log.denied_hosts(1), vec!["127.0.0.1:1".to_string()]);
    assert_eq!(p.log.bytes(), vec![(rule, 8, 8)]);
    assert_eq!(p.log.dropped(), 0);
}

#[tokio::test]
async fn dropping_the_handle_closes_the_listener_and_open_tunnels() {
    let (server, _seen) = echo_server().await;
    let p = proxy(&[server.to_string()]).await;
    let mut client = tunnel(p.addr, server).await;
    client.write_all(b"x").await.unwrap();
    let mut one = [0u8; 1];
    timeout(WAIT, client.read_exact(&mut one)).await.unwrap().unwrap();

    drop(p.handle);
    let mut buf = [0u8; 16];
    assert_eq!(timeout(WAIT, client.read(&mut buf)).await.expect("the tunnel ends").unwrap(), 0, "EOF");
    let refused = timeout(WAIT, async {
        loop {
            match TcpStream::connect(p.addr).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    })
    .await;
    assert!(refused.is_ok(), "the listener is closed");
}

#[tokio::test]
async fn abort_stops_the_proxy_too() {
    let p = proxy(&["*".to_string()]).await;
    p.handle.abort();
    tokio::task::yield_now().await;
    let refused = timeout(WAIT, async {
        while TcpStream::connect(p.addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(refused.is_ok());
}

/// Past the sandbox's connection limit a client is not left waiting in the
/// backlog: it is answered 503 at once, and the refusal is an egress deny
/// naming the target and the limit.
#[tokio::test]
async fn past_the_connection_limit_a_client_is_answered_503_at_once() {
    let (server, _seen) = echo_server().await;
    let limits = Limits { max_connections: 1, ..Limits::default() };
    let p = proxy_with(&[server.to_string()], vec![], limits).await;
    let first = tunnel(p.addr, server).await;
    let mut second = TcpStream::connect(p.addr).await.unwrap();
    second.write_all(format!("CONNECT {server} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    timeout(Duration::from_secs(2), second.read_to_end(&mut answer)).await.expect("answered within 2 s").unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("this sandbox's proxy connection limit (1) is reached"), "{answer}");
    let decisions = p.log.drain();
    let denied = decisions.iter().find(|d| !d.allowed).expect("a deny");
    assert_eq!((denied.host.as_str(), denied.port, denied.method), ("127.0.0.1", server.port(), "connect"));
    assert_eq!(p.log.counts(), (1, 1));
    // The slot comes back when the first ends.
    drop(first);
    timeout(WAIT, async {
        loop {
            let mut again = TcpStream::connect(p.addr).await.unwrap();
            again.write_all(format!("CONNECT {server} HTTP/1.1\r\n\r\n").as_bytes()).await.unwrap();
            let mut head = [0u8; 12];
            if again.read_exact(&mut head).await.is_ok() && head.starts_with(b"HTTP/1.1 200") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("served once the first ends");
}

/// A name lookup never waits for a share of the lookups in flight (a
/// resolver that never answers would hold the runtime's blocking threads):
/// past this sandbox's limit, or the daemon's, the request is answered 503
/// at once and is an egress deny with the reason.
#[tokio::test]
async fn past_the_lookups_in_flight_a_name_is_answered_503_at_once() {
    let allow = ["lookup.invalid:443".to_string()];
    let mine = proxy_with(&allow, vec![], Limits { max_lookups: 0, ..Limits::default() }).await;
    let answer = exchange(mine.addr, b"CONNECT lookup.invalid:443 HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    let decision = one_decision(&mine.log);
    assert!(!decision.allowed);
    assert_eq!((decision.host.as_str(), decision.port), ("lookup.invalid", 443));
    assert_eq!(decision.rule_or_reason, "this sandbox's limit of name lookups in flight (0) is reached");

    let all = proxy(&allow).await;
    let (budget, _) = all.log.budget().unwrap();
    // The daemon's cap, filled by other principals, each within its share.
    let held: Vec<_> =
        (0..super::budget::MAX_LOOKUPS).map(|i| budget.lookup_for(&format!("other-{}", i % 8)).unwrap()).collect();
    let answer = exchange(all.addr, b"CONNECT lookup.invalid:443 HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert_eq!(
        one_decision(&all.log).rule_or_reason,
        format!("the daemon's limit of name lookups in flight ({}) is reached", super::budget::MAX_LOOKUPS)
    );
    drop(held);
    let answer = exchange(all.addr, b"CONNECT lookup.invalid:443 HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "resolved (and failed) once a share is free: {answer}");
}

/// A placeholder split between the CONNECT head's read and the tunnel's
/// first bytes is still one placeholder: the tunnel is closed before it
/// reaches the upstream, and it is an egress deny.
#[tokio::test]
async fn a_placeholder_split_between_the_connect_head_and_the_tunnel_is_refused() {
    let placeholder = "corral-anthropic-0123456789abcdef".to_string();
    let (echo, mut echoed) = echo_server().await;
    let p = proxy(&[format!("127.0.0.1:{}", echo.port())]).await;
    p.log.forbid(vec![placeholder.clone()]);
    let mut client = TcpStream::connect(p.addr).await.unwrap();
    let (start, rest) = placeholder.split_at(10);
    let first = format!("CONNECT {echo} HTTP/1.1\r\nHost: {echo}\r\n\r\nGET / HTTP/1.1\r\nx-api-key: {start}");
    client.write_all(first.as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = timeout(WAIT, client.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let _ = client.write_all(format!("{rest}\r\n\r\n").as_bytes()).await;
    let mut end = Vec::new();
    let _ = timeout(WAIT, client.read_to_end(&mut end)).await;
    let mut upstream = Vec::new();
    while let Ok(Some(chunk)) = timeout(Duration::from_millis(200), echoed.recv()).await {
        upstream.extend_from_slice(&chunk);
    }
    let upstream = String::from_utf8_lossy(&upstream);
    assert!(!upstream.contains(&placeholder), "the upstream saw it: {upstream}");
    let decisions = p.log.drain();
    assert!(
        decisions.iter().any(|d| !d.allowed && d.rule_or_reason.contains("credential placeholder")),
        "{decisions:?}"
    );
}

/// RFC 9112 §6.1: a request whose body framing is ambiguous (both
/// `Transfer-Encoding` and `Content-Length`, or differing lengths) could
/// smuggle a second request; the proxy answers 400, closes, and the
/// upstream never sees it.
#[tokio::test]
async fn ambiguous_framing_is_refused_before_the_upstream() {
    let (server, mut seen) = http_server().await;
    let rule = server.to_string();
    let p = proxy(std::slice::from_ref(&rule)).await;
    for framing in ["Transfer-Encoding: chunked\r\nContent-Length: 4", "Content-Length: 4\r\nContent-Length: 40"] {
        let request = format!(
            "POST http://{server}/ HTTP/1.1\r\nHost: {server}\r\n{framing}\r\n\r\n0\r\n\r\nGET http://{server}/smuggled HTTP/1.1\r\n\r\n"
        );
        let response = exchange(p.addr, request.as_bytes()).await;
        assert!(response.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{framing:?}: {response}");
        assert!(response.contains("Connection: close"), "{response}");
        let decision = one_decision(&p.log);
        assert!(!decision.allowed, "{decision:?}");
        assert!(
            decision.rule_or_reason.contains("Content-Length") || decision.rule_or_reason.contains("Transfer-Encoding"),
            "the deny names the framing: {decision:?}"
        );
    }
    assert!(timeout(Duration::from_millis(300), seen.recv()).await.is_err(), "the upstream received nothing");
}

#[test]
fn the_scanner_finds_a_placeholder_across_chunks() {
    let mut s = super::proxy::Scanner::new(&["corral-x-abcdef".to_string()]);
    assert!(!s.hit(b"GET / HTTP/1.1\r\nx-api-key: corral-x-"));
    assert!(s.hit(b"abcdef\r\n\r\n"), "split across two chunks");
    let mut s = super::proxy::Scanner::new(&["corral-x-abcdef".to_string()]);
    for byte in b"..corral-x-abcde" {
        assert!(!s.hit(&[*byte]));
    }
    assert!(s.hit(b"f"), "one byte at a time");
    let mut none = super::proxy::Scanner::new(&[]);
    assert!(!none.hit(b"corral-x-abcdef"), "nothing forbidden");
}

#[tokio::test]
async fn a_request_or_tunnel_carrying_a_placeholder_is_refused_and_reported() {
    let placeholder = "corral-anthropic-0123456789abcdef".to_string();
    let (http, mut seen) = http_server().await;
    let p = proxy(&[format!("127.0.0.1:{}", http.port())]).await;
    p.log.forbid(vec![placeholder.clone()]);
    // In a plain request's URL or headers: refused before any connection.
    for request in [
        format!("GET http://{http}/leak?k={placeholder} HTTP/1.1\r\nHost: {http}\r\n\r\n"),
        format!("GET http://{http}/ HTTP/1.1\r\nHost: {http}\r\nx-api-key: {placeholder}\r\n\r\n"),
    ] {
        let answer = exchange(p.addr, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        assert!(answer.contains("credential placeholder"), "{answer}");
    }
    // Through a CONNECT tunnel, in clear: the tunnel is closed before it.
    let (echo, mut echoed) = echo_server().await;
    let p2 = proxy(&[format!("127.0.0.1:{}", echo.port())]).await;
    p2.log.forbid(vec![placeholder.clone()]);
    let mut client = TcpStream::connect(p2.addr).await.unwrap();
    client.write_all(format!("CONNECT {echo} HTTP/1.1\r\nHost: {echo}\r\n\r\n").as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = timeout(WAIT, client.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    client.write_all(b"hello ").await.unwrap();
    let first = timeout(WAIT, echoed.recv()).await.unwrap().unwrap();
    assert_eq!(first, b"hello ");
    let _ = client.write_all(format!("x-api-key: {placeholder}\r\n").as_bytes()).await;
    let mut rest = Vec::new();
    let _ = timeout(WAIT, client.read_to_end(&mut rest)).await;
    while let Ok(Some(chunk)) = timeout(Duration::from_millis(200), echoed.recv()).await {
        assert!(!String::from_utf8_lossy(&chunk).contains(&placeholder), "the echo server saw it");
    }
    let reasons: Vec<String> = p.log.drain().into_iter().chain(p2.log.drain()).map(|d| d.rule_or_reason).collect();
    assert_eq!(reasons.iter().filter(|r| r.contains("credential placeholder")).count(), 3, "{reasons:?}");
    assert!(seen.try_recv().is_err(), "the plain server got no request");
    drop((p, p2));
}

/// An Anthropic-like key: 108 characters.
const KEY: &str =
    "sk-ant-api03-PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA_2O76UMFxFkM_R5Kjp1vRt-1fjORS_6ilI8ihN5KXSc7Tvo_hBKqFYAA";

/// `text` scrubbed of `KEY`, as the daemon scrubs what the proxy records
/// (`record_egress`: whole, then cut to `max` characters) and a harness's
/// output (whole lines); fails if any 8 characters of the key are left.
fn scrubbed(text: &str, max: usize) -> String {
    let mut scrubber = crate::credentials::Scrubber::default();
    scrubber.add("anthropic", KEY);
    let out = scrubber.scrub_within(text, max);
    let lower = out.to_ascii_lowercase();
    for i in 0..=KEY.len() - 8 {
        let piece = KEY[i..i + 8].to_ascii_lowercase();
        assert!(!lower.contains(&piece), "{piece:?} of the key is left in {out:?}");
    }
    out
}

/// A credential asked as a host, or sent in a request the proxy cannot
/// parse, is in the egress decision whole (host and reason), so the daemon
/// redacts it before it cuts; so is the answer's reason, which a harness
/// may print (curl does) into its output, scrubbed line by line.
#[tokio::test]
async fn a_credential_asked_as_a_host_reaches_the_daemon_whole_and_is_redacted() {
    let p = proxy(&["*".to_string()]).await;
    let host = format!("{KEY}.example.com");
    assert_eq!(host.len(), 120);
    for (request, named) in [
        (format!("CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n"), true),
        (format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n"), true),
        (format!("GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nxxxxxx{KEY}\r\n\r\n"), false),
    ] {
        let answer = exchange(p.addr, request.as_bytes()).await;
        let decision = one_decision(&p.log);
        assert!(!decision.allowed, "{decision:?}");
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        assert_eq!(body, format!("corral egress proxy: {}\n", decision.rule_or_reason), "the reason whole");
        assert!(scrubbed(body, usize::MAX).contains("[REDACTED:anthropic]"), "{answer}");
        assert!(decision.rule_or_reason.contains(KEY), "{decision:?}");
        assert!(scrubbed(&decision.rule_or_reason, 1024).contains("[REDACTED:anthropic]"), "{decision:?}");
        if named {
            assert_eq!(decision.host, host);
            assert_eq!(scrubbed(&decision.host, 256), "[REDACTED:anthropic].example.com");
        } else {
            assert_eq!(decision.host, "");
        }
    }
}

/// Past the connection limit the head is read only to name the target in
/// the deny: a credential asked as a host is named whole there too.
#[tokio::test]
async fn past_the_connection_limit_a_credential_asked_as_a_host_is_named_whole() {
    let (server, _seen) = echo_server().await;
    let limits = Limits { max_connections: 1, ..Limits::default() };
    let p = proxy_with(&[server.to_string()], vec![], limits).await;
    let first = tunnel(p.addr, server).await;
    let host = format!("{KEY}.example.com");
    let answer = exchange(p.addr, format!("CONNECT {host}:443 HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    let denied = p.log.drain().into_iter().find(|d| !d.allowed).expect("a deny");
    assert_eq!((denied.host.as_str(), denied.port, denied.method), (host.as_str(), 443, "connect"));
    assert_eq!(scrubbed(&denied.host, 256), "[REDACTED:anthropic].example.com");
    drop(first);
}
