//! Network for agents without the host network: from inside a real
//! sandbox, egress goes only through the daemon's proxy, only to the hosts
//! the (gated) profile allows, never to the daemon itself, with no DNS; each
//! attempt is an `egress` event and counted in the evidence.

mod common;

use std::sync::{Arc, Mutex};

use common::{finished, request, require_bwrap, Options, TestDaemon};
use corral::pb;
use corral::pb::lifecycle_event::Kind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A test server on the host's loopback: answers `GET` with `hello`,
/// echoes anything else, and keeps every byte it received.
struct TestServer {
    port: u16,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl TestServer {
    async fn start() -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let sink = sink.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        sink.lock().unwrap().extend_from_slice(&buf[..n]);
                        if buf.starts_with(b"GET ") {
                            let _ = socket
                                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
                                .await;
                            break;
                        }
                        let _ = socket.write_all(&buf[..n]).await;
                    }
                });
            }
        });
        TestServer { port, seen }
    }

    fn seen(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }
}

fn net_profile(id: &str, hosts: &[String], extra: &str) -> (String, String) {
    let hosts: Vec<String> = hosts.iter().map(|h| format!("{h:?}")).collect();
    let text = format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
allow_network = true
allow_hosts = [{}]
write_paths = ["."]
[limits]
timeout_seconds = 60
{extra}
"#,
        hosts.join(", ")
    );
    (format!("{id}.toml"), text)
}

/// A Python probe: CONNECT through the proxy to each port, a direct
/// connect, a DNS lookup; one line each.
fn probe(ports: &[u16], direct: &[u16]) -> String {
    format!(
        r#"python3 - <<'EOF'
import os, socket
proxy = os.environ.get("HTTPS_PROXY", "")
print("proxy", proxy)
def tunnel(port):
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
        s.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port))
        head = s.recv(4096).split(b"\r\n")[0].decode()
        if " 200 " in head:
            s.sendall(b"PING-THROUGH-PROXY\n")
            print("tunnel", port, "open", s.recv(100).decode().strip())
        else:
            print("tunnel", port, "refused", head)
    except OSError as e:
        print("tunnel", port, "error", e)
for port in {ports:?}:
    tunnel(port)
for port in {direct:?}:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2)
        print("direct", port, "connected")
    except OSError as e:
        print("direct", port, "failed")
try:
    socket.getaddrinfo("example.com", 443)
    print("dns resolved")
except OSError:
    print("dns failed")
EOF"#
    )
}

fn egress_events(events: &[pb::LifecycleEvent]) -> Vec<pb::Egress> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Egress(x)) => Some(x.clone()),
            _ => None,
        })
        .collect()
}

async fn daemon_with(profiles: Vec<(String, String)>) -> TestDaemon {
    require_bwrap();
    TestDaemon::start(Options { profiles, ..Options::default() }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_goes_only_through_the_proxy_to_allowed_hosts() {
    let server = TestServer::start().await;
    let other = TestServer::start().await;
    let (a, b) = (server.port, other.port);
    let daemon = daemon_with(vec![net_profile("test.net", &[format!("127.0.0.1:{a}")], "")]).await;
    let grpc = daemon.addr.port();
    let script = probe(&[a, b, grpc], &[a, grpc]);
    let events = daemon.execute(request("test.net", &script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(
        out.contains("proxy http://127.0.0.1:3128"),
        "{out}\n{}\n{:?}",
        execution.tool_error,
        common::kinds(&events)
    );
    assert!(out.contains(&format!("tunnel {a} open PING-THROUGH-PROXY")), "{out}");
    assert!(server.seen().contains("PING-THROUGH-PROXY"), "the server never saw the bytes");
    assert!(out.contains(&format!("tunnel {b} refused HTTP/1.1 403")), "{out}");
    assert!(!other.seen().contains("PING"), "an unlisted port was reached");
    assert!(out.contains(&format!("tunnel {grpc} refused HTTP/1.1 403")), "the daemon's port through the proxy: {out}");
    assert!(out.contains(&format!("direct {a} failed")), "a direct connection bypassed the proxy: {out}");
    assert!(out.contains(&format!("direct {grpc} failed")), "the daemon's port directly: {out}");
    assert!(out.contains("dns failed"), "a resolver answered inside: {out}");

    let decisions = egress_events(&events);
    let allowed: Vec<_> = decisions.iter().filter(|d| d.allowed).collect();
    let denied: Vec<_> = decisions.iter().filter(|d| !d.allowed).collect();
    assert_eq!(allowed.len(), 1, "{decisions:?}");
    assert_eq!((allowed[0].host.as_str(), allowed[0].port), ("127.0.0.1", u32::from(a)));
    assert_eq!(denied.len(), 2, "{decisions:?}");
    let egress = execution.evidence.unwrap().egress.unwrap();
    assert_eq!((egress.allowed, egress.denied), (1, 2));
    assert!(egress.denied_hosts.contains(&format!("127.0.0.1:{b}")), "{egress:?}");
    let bytes = egress.bytes.iter().find(|h| h.host == format!("127.0.0.1:{a}")).expect("bytes for the allowed host");
    assert!(bytes.up >= "PING-THROUGH-PROXY\n".len() as u64 && bytes.down > 0, "{bytes:?}");
    let ready = events.iter().find_map(|e| match &e.kind {
        Some(Kind::SandboxReady(r)) => r.receipt.clone(),
        _ => None,
    });
    let receipt = ready.expect("receipt");
    assert!(receipt.network_isolated);
    assert_eq!(receipt.egress(), pb::EgressMode::Proxy);
    assert_eq!(receipt.allow_hosts, [format!("127.0.0.1:{a}")]);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemons_own_port_stays_unreachable_even_when_listed() {
    require_bwrap();
    // Choose the daemon's port first, so a profile can list it exactly.
    let grpc = common::unused_port();
    let profile = net_profile("test.self", &[format!("127.0.0.1:{grpc}")], "");
    let daemon = TestDaemon::start(Options {
        profiles: vec![profile],
        listen: Some(format!("127.0.0.1:{grpc}")),
        ..Options::default()
    })
    .await;
    assert_eq!(daemon.addr.port(), grpc);
    let events = daemon.execute(request("test.self", &probe(&[grpc], &[grpc]))).await;
    let out = finished(&events).tool_output;
    assert!(out.contains(&format!("tunnel {grpc} refused HTTP/1.1 403")), "{out}");
    assert!(out.contains(&format!("direct {grpc} failed")), "{out}");
    let denied = egress_events(&events);
    assert!(denied.iter().all(|d| !d.allowed) && !denied.is_empty(), "{denied:?}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_and_urllib_work_through_the_proxy_unmodified() {
    assert!(std::path::Path::new("/usr/bin/curl").exists(), "this test needs curl (Debian package `curl`)");
    let server = TestServer::start().await;
    let a = server.port;
    let daemon = daemon_with(vec![net_profile("test.clients", &[format!("127.0.0.1:{a}")], "")]).await;
    let script = format!(
        r#"echo "curl: $(curl -sS --max-time 10 http://127.0.0.1:{a}/from-curl)"
python3 -c 'import urllib.request; print("urllib:", urllib.request.urlopen("http://127.0.0.1:{a}/from-urllib", timeout=10).read().decode())'"#
    );
    let events = daemon.execute(request("test.clients", &script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("curl: hello"), "{out}\n{}", execution.tool_error);
    assert!(out.contains("urllib: hello"), "{out}\n{}", execution.tool_error);
    let seen = server.seen();
    assert!(seen.contains("GET /from-curl HTTP/1.1"), "origin-form request expected: {seen}");
    assert!(seen.contains("GET /from-urllib HTTP/1.1"), "{seen}");
    assert_eq!(egress_events(&events).iter().filter(|d| d.allowed).count(), 2);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_sandbox_narrows_and_never_widens_the_allowlist() {
    let (s1, s2, s3) = (TestServer::start().await, TestServer::start().await, TestServer::start().await);
    let (a, b, c) = (s1.port, s2.port, s3.port);
    // The profile allows a and b; its policy lists a and c: only a remains.
    let policy = format!(
        r#"[[guardrails.policies]]
name = "narrow"
kind = "enforce_sandbox"
arguments = {{ allow_hosts = ["127.0.0.1:{a}", "127.0.0.1:{c}"] }}"#
    );
    let hosts = [format!("127.0.0.1:{a}"), format!("127.0.0.1:{b}")];
    let daemon = daemon_with(vec![net_profile("test.narrow", &hosts, &policy)]).await;
    let events = daemon.execute(request("test.narrow", &probe(&[a, b, c], &[]))).await;
    let execution = finished(&events);
    let out = execution.tool_output.clone();
    assert!(out.contains(&format!("tunnel {a} open")), "{out}\n{}", execution.tool_error);
    assert!(out.contains(&format!("tunnel {b} refused")), "the policy did not narrow: {out}");
    assert!(out.contains(&format!("tunnel {c} refused")), "the policy widened the allowlist: {out}");
    let gated = events.iter().find_map(|e| match &e.kind {
        Some(Kind::Gated(g)) if g.phase() == pb::GatePhase::AgentStart => g.effective_sandbox.clone(),
        _ => None,
    });
    assert_eq!(gated.unwrap().allow_hosts, [format!("127.0.0.1:{a}")]);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_network_leaves_nothing_reachable() {
    let server = TestServer::start().await;
    let a = server.port;
    let policy = "[[guardrails.policies]]\nname = \"offline\"\nkind = \"deny_network\"\n";
    let daemon = daemon_with(vec![net_profile("test.offline", &[format!("127.0.0.1:{a}")], policy)]).await;
    let events = daemon.execute(request("test.offline", &probe(&[a], &[a]))).await;
    let out = finished(&events).tool_output;
    assert!(out.contains("proxy \n") || out.contains("proxy\n"), "a proxy is offered: {out}");
    assert!(out.contains(&format!("tunnel {a} error")), "{out}");
    assert!(out.contains(&format!("direct {a} failed")), "{out}");
    assert!(!server.seen().contains("PING"));
    assert!(egress_events(&events).is_empty());
    daemon.stop().await;
}

/// A plain `GET /metrics` on the host, with an optional bearer token: the
/// status line and body.
async fn scrape(port: u16, token: Option<&str>) -> String {
    // The daemon binds it as it starts serving: wait for it.
    let mut attempts = 0;
    let mut stream = loop {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(stream) => break stream,
            Err(e) if attempts < 100 => {
                attempts += 1;
                let _ = e;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the metrics listener does not answer: {e}"),
        }
    };
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_listener_is_protected_and_needs_its_token() {
    require_bwrap();
    let metrics = common::unused_port();
    let token_dir = tempfile::tempdir().unwrap();
    let token = "m".repeat(40);
    let token_file = token_dir.path().join("metrics.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let profile = net_profile("test.metrics", &[format!("127.0.0.1:{metrics}")], "");
    let daemon = TestDaemon::start(Options {
        profiles: vec![profile],
        config: Box::new(move |config| {
            config.metrics_listen = Some(format!("127.0.0.1:{metrics}"));
            config.metrics_token_file = Some(token_file);
        }),
        ..Options::default()
    })
    .await;
    assert!(scrape(metrics, None).await.starts_with("HTTP/1.1 401"), "no token");
    assert!(scrape(metrics, Some(&"x".repeat(40))).await.starts_with("HTTP/1.1 401"), "a wrong token");
    let events = daemon.execute(request("test.metrics", &probe(&[metrics], &[metrics]))).await;
    let out = finished(&events).tool_output;
    assert!(out.contains(&format!("tunnel {metrics} refused HTTP/1.1 403")), "listed, yet refused: {out}");
    assert!(out.contains(&format!("direct {metrics} failed")), "{out}");
    let denied = egress_events(&events);
    assert!(!denied.is_empty() && denied.iter().all(|d| !d.allowed), "{denied:?}");
    let scraped = scrape(metrics, Some(&token)).await;
    assert!(scraped.starts_with("HTTP/1.1 200"), "{scraped}");
    assert!(scraped.contains("corral_egress_total"), "the run's egress is counted: {scraped}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_daemon_wide_connection_cap_a_sandbox_is_refused_with_the_reason() {
    require_bwrap();
    let server = TestServer::start().await;
    let port = server.port;
    let profile = net_profile("test.many", &[format!("127.0.0.1:{port}")], "");
    let daemon = TestDaemon::start(Options {
        profiles: vec![profile],
        config: Box::new(|config| config.proxy.max_connections = Some(2)),
        ..Options::default()
    })
    .await;
    // Three tunnels held open at once: the third is past the cap of 2.
    let script = format!(
        r#"python3 - <<'EOF'
import socket
held = []
for i in range(3):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n")
    print("tunnel", i, s.recv(4096).split(b"\r\n")[0].decode())
    held.append(s)
EOF"#
    );
    let events = daemon.execute(request("test.many", &script)).await;
    let out = finished(&events).tool_output;
    assert!(out.contains("tunnel 0 HTTP/1.1 200") && out.contains("tunnel 1 HTTP/1.1 200"), "{out}");
    assert!(out.contains("tunnel 2 HTTP/1.1 503"), "the third is refused: {out}");
    let decisions = egress_events(&events);
    let denied: Vec<_> = decisions.iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{decisions:?}");
    assert_eq!(denied[0].port, u32::from(port));
    assert!(denied[0].rule_or_reason.contains("the daemon's proxy connection limit (2) is reached"), "{denied:?}");
    // Its shares came back with the sandbox: the next run gets its own.
    let again = daemon.execute(request("test.many", &script)).await;
    assert!(finished(&again).tool_output.contains("tunnel 1 HTTP/1.1 200"));
    daemon.stop().await;
}

/// A sandbox's CONNECT script: `count` tunnels to `port`, each sending
/// `tag` once open, all held for `hold` seconds.
fn tunnels(port: u16, count: usize, tag: &str, hold: u32) -> String {
    format!(
        r#"python3 - <<'EOF'
import socket, time
held = []
for i in range({count}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n")
    head = s.recv(4096).split(b"\r\n")[0].decode()
    print("tunnel", i, head, flush=True)
    if " 200 " in head:
        s.sendall(b"{tag}\n")
    held.append(s)
time.sleep({hold})
EOF"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_sandbox_filling_the_daemon_wide_cap_refuses_another_tenants_until_it_ends() {
    require_bwrap();
    let server = TestServer::start().await;
    let port = server.port;
    let daemon = TestDaemon::start(Options {
        profiles: vec![net_profile("test.fill", &[format!("127.0.0.1:{port}")], "")],
        config: Box::new(|config| config.proxy.max_connections = Some(2)),
        ..Options::default()
    })
    .await;
    // Tenant A (test-agt) takes both shares and holds them.
    let mut client = daemon.executions().await;
    let hog = client
        .start_execution(common::as_actor("agt", request("test.fill", &tunnels(port, 2, "HOLD-A", 120))))
        .await
        .unwrap()
        .into_inner();
    let start = std::time::Instant::now();
    while server.seen().matches("HOLD-A").count() < 2 {
        assert!(start.elapsed() < std::time::Duration::from_secs(20), "tenant A never held its tunnels");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Tenant B (test-atm), another sandbox: refused, with the reason.
    let mut b = request("test.fill", &tunnels(port, 1, "HOLD-B", 0));
    b.actor = "atm".into();
    let mut stream = client.execute(common::as_actor("atm", b.clone())).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    assert!(finished(&events).tool_output.contains("tunnel 0 HTTP/1.1 503"), "{:?}", finished(&events));
    let denied: Vec<_> = egress_events(&events).into_iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert_eq!(denied[0].rule_or_reason, "the daemon's proxy connection limit (2) is reached");
    assert!(!server.seen().contains("HOLD-B"));

    // Once A's sandbox is gone, B gets through.
    let cancel = pb::CancelExecutionRequest { execution_id: hog.execution_id.clone() };
    client.cancel_execution(common::as_actor("agt", cancel)).await.unwrap();
    daemon.watch_all(&hog.execution_id, 0).await;
    let mut stream = client.execute(common::as_actor("atm", b)).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    assert!(finished(&events).tool_output.contains("tunnel 0 HTTP/1.1 200"), "{:?}", finished(&events));
    assert!(server.seen().contains("HOLD-B"));
    daemon.stop().await;
}

/// A credential the harness holds (an exposed route) never reaches the
/// run's records through the hosts it asks the proxy for: every egress
/// event and the evidence's denied hosts are scrubbed of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_credential_in_an_asked_host_is_scrubbed_from_egress_records() {
    let server = TestServer::start().await;
    let (id, text) = net_profile("test.leaky-host", &[format!("127.0.0.1:{}", server.port)], "");
    let text = text.replacen("[rein]", "credential_route_refs = [\"route.test\"]\n[rein]", 1);
    let daemon = daemon_with(vec![(id, text)]).await;
    // A valid name (CONNECT) and one no DNS name can be (its reason quotes it).
    let script = r#"echo "token ${#ROUTE_TEST_TOKEN}"
curl -sS --max-time 10 -x "$HTTPS_PROXY" "https://$ROUTE_TEST_TOKEN.example:443/" 2>&1
python3 - <<'PY'
import os, socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT x_%s.example:443 HTTP/1.1\r\nHost: x\r\n\r\n" % os.environ["ROUTE_TEST_TOKEN"].encode())
print("bad name", s.recv(4096).split(b"\r\n")[0].decode())
PY"#;
    let events = daemon.execute(request("test.leaky-host", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains(&format!("token {}", common::ROUTE_TEST_VALUE.len())), "the route is not exposed: {out}");
    assert!(out.contains("bad name HTTP/1.1 403"), "{out}\n{}", execution.tool_error);
    let decisions = egress_events(&events);
    assert_eq!(decisions.iter().filter(|d| !d.allowed).count(), 2, "{decisions:?}");
    for d in &decisions {
        assert!(!d.host.contains(common::ROUTE_TEST_VALUE), "the value in an egress host: {d:?}");
        assert!(!d.rule_or_reason.contains(common::ROUTE_TEST_VALUE), "the value in an egress reason: {d:?}");
    }
    assert!(decisions.iter().any(|d| d.host == "[REDACTED:route.test].example"), "{decisions:?}");
    let egress = execution.evidence.clone().unwrap().egress.unwrap();
    assert_eq!(egress.denied, 2, "{egress:?}");
    assert!(!egress.denied_hosts.is_empty(), "{egress:?}");
    for host in &egress.denied_hosts {
        assert!(!host.contains(common::ROUTE_TEST_VALUE), "the value in the evidence's denied hosts: {egress:?}");
    }
    let everything = format!("{events:?}");
    assert!(!everything.contains(common::ROUTE_TEST_VALUE), "the value is somewhere in the run's events");
    daemon.stop().await;
}

/// A sandbox without network still reaches the credential gateway (how an
/// agent reaches its model without holding the key): every request it
/// forwards is a `gateway` egress event, counted in the evidence, and the
/// receipt does not claim there is no egress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_of_a_sandbox_without_network_is_recorded_as_egress() {
    require_bwrap();
    let model = common::model_mock::ModelMock::start(vec![common::model_mock::Step::text("through the gateway")]).await;
    let (daemon, _key) = gatewayed_daemon("test.gatewayed", "mock", "mock-upstream-secret-7d41", model.url()).await;
    let script = r#"curl -sS --max-time 20 -H "authorization: Bearer $MOCK_TOKEN" -H "content-type: application/json" \
  -d '{"model":"m","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"hi"}]}' \
  http://127.0.0.1:3130/mock/v1/messages 2>&1 | head -c 4000"#;
    let events = daemon.execute(request("test.gatewayed", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("through the gateway"), "the model was not reached: {out}\n{}", execution.tool_error);
    assert_eq!(model.model_requests().len(), 1);

    let decisions = egress_events(&events);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert!(decisions[0].allowed, "{decisions:?}");
    assert_eq!(decisions[0].method(), pb::EgressMethod::Gateway, "{decisions:?}");
    assert_eq!((decisions[0].host.as_str(), decisions[0].port), ("127.0.0.1", u32::from(model.addr.port())));
    let egress = execution.evidence.clone().unwrap().egress.unwrap();
    assert_eq!((egress.allowed, egress.denied), (1, 0), "{egress:?}");
    let receipt = events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(r)) => r.receipt.clone(),
            _ => None,
        })
        .expect("receipt");
    assert!(receipt.network_isolated);
    assert_ne!(receipt.egress(), pb::EgressMode::None, "the gateway was reachable: {receipt:?}");
    assert!(receipt.allow_hosts.is_empty(), "{receipt:?}");
    assert_eq!(receipt.gateway_routes, ["mock"]);
    assert!(receipt.exposed_routes.is_empty(), "{receipt:?}");
    daemon.stop().await;
}

/// The egress proxy lowercases a host name it was asked for: a credential
/// of mixed case asked as a CONNECT host is recorded lowercased, and must
/// still be scrubbed from every egress record and the evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_case_credential_asked_as_a_host_is_scrubbed_once_lowercased() {
    require_bwrap();
    let value = "MixedCase-Route-Value-7Qx";
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("mixed.secret");
    std::fs::write(&secret, value).unwrap();
    let (id, text) = net_profile("test.mixed-host", &["127.0.0.1:9".into()], "");
    let text = text.replacen("[rein]", "credential_route_refs = [\"mixed\"]\n[rein]", 1);
    let daemon = TestDaemon::start(Options {
        profiles: vec![(id, text)],
        config: Box::new(move |c| {
            let route = corral::credentials::RouteConfig {
                file: Some(secret),
                inject_as: "MIXED_TOKEN".into(),
                expose: true,
                ..Default::default()
            };
            c.credentials.routes.insert("mixed".into(), route);
        }),
        ..Options::default()
    })
    .await;
    let script = r#"echo "token ${#MIXED_TOKEN}"
python3 - <<'PY'
import os, socket
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT %s.example:443 HTTP/1.1\r\nHost: x\r\n\r\n" % os.environ["MIXED_TOKEN"].encode())
print("asked", s.recv(4096).split(b"\r\n")[0].decode())
PY"#;
    let events = daemon.execute(request("test.mixed-host", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains(&format!("token {}", value.len())), "the route is not exposed: {out}");
    assert!(out.contains("asked HTTP/1.1 403"), "{out}\n{}", execution.tool_error);
    let lower = value.to_ascii_lowercase();
    let decisions = egress_events(&events);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert_eq!(decisions[0].host, "[REDACTED:mixed].example", "{decisions:?}");
    assert!(!decisions[0].rule_or_reason.contains(&lower), "the value in an egress reason: {decisions:?}");
    let egress = execution.evidence.clone().unwrap().egress.unwrap();
    assert_eq!(egress.denied, 1, "{egress:?}");
    for host in &egress.denied_hosts {
        assert!(!host.contains(&lower), "the value in the evidence's denied hosts: {egress:?}");
    }
    let everything = format!("{events:?}").to_ascii_lowercase();
    assert!(!everything.contains(&lower), "the value, in some case, is somewhere in the run's events");
    daemon.stop().await;
}

/// A daemon whose one profile, `id`, runs its task with `sh -s` in a
/// sandbox without network, with the credential route `route` going
/// through the gateway to `upstream`: its key `secret` read from a file
/// (kept alive by the second value), its placeholder in
/// `<ROUTE>_TOKEN`.
async fn gatewayed_daemon(
    id: &str,
    route: &str,
    secret: &str,
    upstream: String,
) -> (TestDaemon, tempfile::NamedTempFile) {
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), secret).unwrap();
    let profile = format!(
        r#"id = "{id}"
version = "1.0.0"
credential_route_refs = ["{route}"]
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
[limits]
timeout_seconds = 60
"#
    );
    let (file, name) = (key.path().to_path_buf(), route.to_string());
    let daemon = TestDaemon::start(Options {
        profiles: vec![(format!("{route}.toml"), profile)],
        config: Box::new(move |c| {
            let config = corral::credentials::RouteConfig {
                file: Some(file),
                inject_as: format!("{}_TOKEN", name.to_uppercase()),
                upstream: Some(upstream),
                ..Default::default()
            };
            c.credentials.routes.insert(name, config);
        }),
        ..Options::default()
    })
    .await;
    (daemon, key)
}

/// An upstream on loopback that answers every request with its own head,
/// as one with TRACE enabled (or an echo endpoint) does; and the heads it
/// got.
async fn echoing_upstream() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let (mut head, mut buf) = (Vec::new(), [0u8; 4096]);
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).to_string();
                seen.lock().unwrap().push(head.clone());
                let answer =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{head}", head.len());
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, heads)
}

/// An agent that asks the gateway to TRACE (which an upstream with it
/// enabled answers with the request, the real key in it) or to climb
/// above the route's base path with `..` is refused: nothing reaches the
/// upstream, no key comes back, and each refusal is a denied `gateway`
/// egress event with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_forwards_no_reflecting_method_and_no_path_above_its_base() {
    require_bwrap();
    let (upstream, heads) = echoing_upstream().await;
    let secret = "echo-upstream-secret-58d1";
    let (daemon, _key) = gatewayed_daemon("test.gateway-echo", "echo", secret, format!("{upstream}/v1")).await;
    let script = r#"curl -sS --max-time 20 -X TRACE -w ' trace %{http_code}\n' -H "authorization: Bearer $ECHO_TOKEN" \
  http://127.0.0.1:3130/echo/messages
curl -sS --max-time 20 --path-as-is -w ' climb %{http_code}\n' -H "authorization: Bearer $ECHO_TOKEN" \
  http://127.0.0.1:3130/echo/../admin
curl -sS --max-time 20 --path-as-is -w ' encoded %{http_code}\n' -H "authorization: Bearer $ECHO_TOKEN" \
  http://127.0.0.1:3130/echo/%2e%2e/admin"#;
    let events = daemon.execute(request("test.gateway-echo", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    for expected in ["trace 403", "climb 403", "encoded 403"] {
        assert!(out.contains(expected), "{expected}: {out}\n{}", execution.tool_error);
    }
    assert!(!out.contains(secret), "the key came back into the sandbox: {out}");
    assert!(heads.lock().unwrap().is_empty(), "the upstream was reached: {:?}", heads.lock().unwrap());
    let decisions = egress_events(&events);
    let reasons: Vec<&str> = decisions.iter().map(|d| d.rule_or_reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            "credential gateway echo: method TRACE is not forwarded with a credential",
            "credential gateway echo: a path that climbs above the route's base path",
            "credential gateway echo: a path that climbs above the route's base path",
        ],
        "{decisions:?}"
    );
    assert!(decisions.iter().all(|d| !d.allowed), "{decisions:?}");
    daemon.stop().await;
}

/// The credential gateway records what it could not forward too: a route
/// the run does not have (404) and an upstream that is down (502) are each
/// a denied `gateway` egress event with the reason, counted in the
/// evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_request_refused_or_failed_is_recorded_as_egress() {
    require_bwrap();
    // A loopback port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let upstream = format!("http://127.0.0.1:{port}");
    let (daemon, _key) = gatewayed_daemon("test.gateway-down", "down", "down-upstream-secret-3c9e", upstream).await;
    let script = r#"curl -sS --max-time 20 -o /dev/null -w 'down %{http_code}\n' -H "authorization: Bearer $DOWN_TOKEN" \
  http://127.0.0.1:3130/down/v1/messages
curl -sS --max-time 20 -o /dev/null -w 'unknown %{http_code}\n' http://127.0.0.1:3130/nosuch/v1/messages"#;
    let events = daemon.execute(request("test.gateway-down", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("down 502") && out.contains("unknown 404"), "{out}\n{}", execution.tool_error);
    let decisions = egress_events(&events);
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    assert!(decisions.iter().all(|d| !d.allowed && d.method() == pb::EgressMethod::Gateway), "{decisions:?}");
    let down = decisions.iter().find(|d| d.port == u32::from(port)).expect("the failed forward");
    assert_eq!(down.host, "127.0.0.1");
    assert!(down.rule_or_reason.starts_with("credential gateway down: the upstream failed"), "{down:?}");
    let unknown = decisions.iter().find(|d| d.port == 0).expect("the unknown route");
    assert!(unknown.rule_or_reason.contains("no credential route \"nosuch\""), "{unknown:?}");
    let egress = execution.evidence.clone().unwrap().egress.unwrap();
    assert_eq!((egress.allowed, egress.denied), (0, 2), "{egress:?}");
    daemon.stop().await;
}

/// Sockets this process (the daemon runs in it) holds on a gateway's port
/// 3130: its listeners and the connections they accepted, whatever else
/// the tests running beside this one hold.
fn gateway_sockets() -> usize {
    let mut count = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: getsockname on a descriptor number of this process with a
        // buffer of the advertised size; a non-socket (or a closed number) just fails.
        if unsafe { libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_storage).cast(), &mut len) } != 0 {
            continue;
        }
        if addr.ss_family as i32 == libc::AF_INET {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let sin: libc::sockaddr_in = unsafe { std::ptr::read((&addr as *const libc::sockaddr_storage).cast()) };
            count += usize::from(u16::from_be(sin.sin_port) == 3130);
        }
    }
    count
}

/// A sandbox without network cannot exhaust the daemon's descriptors
/// through its credential gateway: of 1,500 connections held open at once,
/// the daemon holds at most the sandbox's cap, answers one past it 503
/// (an egress deny with the reason), and another run starts promptly
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_flood_is_capped_and_answered_503_while_another_run_goes_on() {
    require_bwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = format!("http://127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    let (daemon, _key) = gatewayed_daemon("test.gateway-flood", "flood", "flood-upstream-secret-91ae", upstream).await;
    let script = r#"python3 - <<'EOF'
import os, resource, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [socket.create_connection(("127.0.0.1", 3130), timeout=5) for _ in range(1500)]
print("opened", len(held), flush=True)
time.sleep(1.5)
s = socket.create_connection(("127.0.0.1", 3130), timeout=5)
s.sendall(b"GET /flood/v1 HTTP/1.1\r\nHost: x\r\n\r\n")
print("one more", s.recv(4096).split(b"\r\n")[0].decode(), flush=True)
open("opened", "w").close()
for _ in range(600):
    if os.path.exists("done"):
        break
    time.sleep(0.05)
EOF"#;
    let before = gateway_sockets();
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request("test.gateway-flood", script)).await.unwrap().into_inner();
    let (mut events, mut workspace) = (Vec::new(), String::new());
    while let Some(event) = stream.message().await.unwrap() {
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
    let marker = std::path::Path::new(&workspace).join("opened");
    let (start, mut held) = (std::time::Instant::now(), 0);
    while !marker.exists() {
        held = held.max(gateway_sockets().saturating_sub(before));
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "never held open; {held} more descriptors");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let held = held.max(gateway_sockets().saturating_sub(before));
    assert!(held < 400, "the daemon held {held} gateway sockets for 1,500 connections");

    let start = std::time::Instant::now();
    let other = daemon.execute(request("test.gateway-flood", "echo other-run")).await;
    assert!(finished(&other).tool_output.contains("other-run"), "{:?}", finished(&other));
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "another run took {:?}", start.elapsed());

    std::fs::write(std::path::Path::new(&workspace).join("done"), "").unwrap();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("opened 1500"), "{out}\n{}", execution.tool_error);
    assert!(out.contains("one more HTTP/1.1 503"), "{out}\n{}", execution.tool_error);
    let denied: Vec<_> = egress_events(&events).into_iter().filter(|d| !d.allowed).collect();
    assert!(!denied.is_empty(), "no egress deny for a refused connection");
    for d in &denied {
        assert_eq!(d.method(), pb::EgressMethod::Gateway, "{d:?}");
        assert!(d.rule_or_reason.contains("connection limit"), "{d:?}");
    }
    daemon.stop().await;
}

/// A placeholder split between the CONNECT head's packet and the tunnel's
/// next one is still seen: the proxy closes the tunnel before its second
/// half reaches the upstream, and records an egress deny that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placeholder_split_across_the_connect_head_never_reaches_the_upstream() {
    require_bwrap();
    let server = TestServer::start().await;
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), "split-upstream-secret-5b0c").unwrap();
    let (id, text) = net_profile("test.split", &[format!("127.0.0.1:{}", server.port)], "");
    let text = text.replacen("[rein]", "credential_route_refs = [\"split\"]\n[rein]", 1);
    let file = key.path().to_path_buf();
    let daemon = TestDaemon::start(Options {
        profiles: vec![(id, text)],
        config: Box::new(move |c| {
            let route = corral::credentials::RouteConfig {
                file: Some(file),
                inject_as: "SPLIT_TOKEN".into(),
                upstream: Some("http://127.0.0.1:9".into()),
                ..Default::default()
            };
            c.credentials.routes.insert("split".into(), route);
        }),
        ..Options::default()
    })
    .await;
    let script = format!(
        r#"python3 - <<'PY'
import os, socket, time
token = os.environ["SPLIT_TOKEN"].encode()
print("placeholder", token.startswith(b"corral-split-"))
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\nPOST / HTTP/1.1\r\nx-api-key: " + token[:10])
print("tunnel", s.recv(4096).split(b"\r\n")[0].decode(), flush=True)
time.sleep(0.2)
try:
    s.sendall(token[10:] + b"\r\n\r\n")
    s.recv(4096)
except OSError:
    pass
PY"#,
        port = server.port
    );
    let events = daemon.execute(request("test.split", &script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("placeholder True") && out.contains("tunnel HTTP/1.1 200"), "{out}\n{}", execution.tool_error);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let seen = server.seen();
    assert!(seen.contains("x-api-key: corral-spl"), "the first half went through: {seen:?}");
    assert!(!seen.contains("corral-split-"), "the upstream saw the placeholder: {seen:?}");
    let denied: Vec<_> = egress_events(&events).into_iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert!(denied[0].rule_or_reason.contains("credential placeholder"), "{denied:?}");
    daemon.stop().await;
}

/// Past the 256 connections one sandbox's proxy serves at once, the next
/// is answered 503 at once (never left waiting in the backlog) and is an
/// egress deny naming the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_257th_connection_of_a_sandbox_is_answered_503_at_once() {
    let server = TestServer::start().await;
    let port = server.port;
    let daemon = daemon_with(vec![net_profile("test.257", &[format!("127.0.0.1:{port}")], "")]).await;
    let script = format!(
        r#"python3 - <<'EOF'
import socket, time
held = []
for i in range(256):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n")
    if b" 200 " not in s.recv(4096):
        print("tunnel", i, "not open")
    held.append(s)
start = time.monotonic()
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n")
try:
    head = s.recv(4096).split(b"\r\n")[0].decode()
except OSError as e:
    head = str(e)
print("257th", head, "fast" if time.monotonic() - start < 2 else "slow", flush=True)
EOF"#
    );
    let events = daemon.execute(request("test.257", &script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(!out.contains("not open"), "{out}\n{}", execution.tool_error);
    assert!(out.contains("257th HTTP/1.1 503 Service Unavailable fast"), "{out}\n{}", execution.tool_error);
    let denied: Vec<_> = egress_events(&events).into_iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert_eq!(denied[0].rule_or_reason, "this sandbox's proxy connection limit (256) is reached");
    assert_eq!((denied[0].host.as_str(), denied[0].port), ("127.0.0.1", u32::from(port)));
    daemon.stop().await;
}

/// A custom (protocol) profile with network reaches its own gatewayed
/// route at `http://127.0.0.1:3130/<route>/…`, as the README says: the
/// request goes past the egress proxy (which would refuse it: loopback,
/// carrying a placeholder) to the gateway, which forwards it to the
/// upstream with the real key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_profile_with_network_reaches_its_own_gateway() {
    require_bwrap();
    let upstream = TestServer::start().await;
    let secret = "net-gateway-upstream-secret-5be2";
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), secret).unwrap();
    let (id, text) = net_profile("test.net-gateway", &["127.0.0.1:9".into()], "");
    let text = text.replacen("[rein]", "credential_route_refs = [\"api\"]\n[rein]", 1);
    let (file, url) = (key.path().to_path_buf(), format!("http://127.0.0.1:{}", upstream.port));
    let daemon = TestDaemon::start(Options {
        profiles: vec![(id, text)],
        config: Box::new(move |c| {
            let route = corral::credentials::RouteConfig {
                file: Some(file),
                inject_as: "API_TOKEN".into(),
                upstream: Some(url),
                ..Default::default()
            };
            c.credentials.routes.insert("api".into(), route);
        }),
        ..Options::default()
    })
    .await;
    let script = r#"echo "proxy ${HTTP_PROXY:-none}"
curl -sS --max-time 20 -H "authorization: Bearer $API_TOKEN" http://127.0.0.1:3130/api/v1/ping 2>&1 | head -c 4000
echo
echo "curl done""#;
    let events = daemon.execute(request("test.net-gateway", script)).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("proxy http://"), "the sandbox has no egress proxy: {out}");
    assert!(
        out.contains("hello") && out.contains("curl done"),
        "the gateway was not reached: {out}\n{}",
        execution.tool_error
    );
    assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Succeeded, "{out}");
    let seen = upstream.seen().to_ascii_lowercase();
    assert!(seen.starts_with("get /v1/ping "), "the upstream was not asked the route's path: {seen}");
    assert!(seen.contains(&format!("authorization: bearer {secret}")), "the real key was not injected: {seen}");
    assert!(!seen.contains("corral-"), "a placeholder reached the upstream: {seen}");

    let decisions = egress_events(&events);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert!(decisions[0].allowed, "{decisions:?}");
    assert_eq!(decisions[0].method(), pb::EgressMethod::Gateway, "{decisions:?}");
    let egress = execution.evidence.clone().unwrap().egress.unwrap();
    assert_eq!((egress.allowed, egress.denied), (1, 0), "{egress:?}");
    daemon.stop().await;
}
