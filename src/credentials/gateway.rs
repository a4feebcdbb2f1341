//! The credential gateway: the agent's API key never enters the sandbox.
//!
//! A gatewayed route gives the harness a **placeholder** (random per run,
//! `corral-<route>-<hex>`) where the real secret would go, and a base URL
//! on a listener the daemon opens inside the sandbox's own network
//! namespace (plain HTTP on its loopback). A request there for the route's
//! path space (`/<route>/...`) must present the placeholder in the route's
//! header and nowhere else; the daemon swaps in the real secret (read from
//! its file or variable at that moment: a rotated key is used by the next
//! request) and forwards to the upstream over TLS (or plain HTTP to a
//! loopback upstream only), streaming both ways. The egress proxy refuses
//! anything else that carries a placeholder (see `net::proxy`).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Request, Response, StatusCode};

pub use crate::sandbox::GATEWAY_PORT;
/// How long connecting to the upstream (TCP and TLS) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How the secret is presented to the upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presented {
    /// The header's whole value (`x-api-key: <secret>`).
    Header(String),
    /// `authorization: Bearer <secret>`.
    Bearer,
}

impl Presented {
    /// The name of the header the secret goes in.
    pub fn header(&self) -> &str {
        match self {
            Presented::Header(name) => name,
            Presented::Bearer => "authorization",
        }
    }
}

/// An upstream origin and base path: `https://host[:port][/path]`, or
/// `http://` to a loopback host (the secret never crosses a network in
/// clear); see [`upstream`].
pub type Upstream = crate::net::client::Origin;

/// Parses an upstream, refusing plain HTTP beyond loopback.
pub fn upstream(url: &str) -> Result<Upstream, String> {
    crate::net::client::secret_origin(url)
}

/// A placeholder for route `route`: recognisable, and random per run.
pub fn placeholder(route: &str) -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    // The system RNG does not fail on Linux; a zero placeholder would still
    // be no secret.
    let _ = ring::rand::SystemRandom::new().fill(&mut bytes);
    let name: String = route.chars().filter(|c| c.is_ascii_alphanumeric()).take(32).collect();
    format!("corral-{name}-{}", hex::encode(bytes))
}

/// One route as the gateway serves it for one run.
pub struct GatewayRoute {
    /// The credential route's name; also the path prefix (`/<name>/...`)
    /// the harness reaches it at.
    pub name: String,
    /// What the harness holds instead of the secret (random per run).
    pub placeholder: String,
    /// How the secret is presented to the upstream.
    pub presented: Presented,
    /// Where requests are forwarded.
    pub upstream: Upstream,
    /// Reads the real secret now (rotation).
    pub secret: Box<dyn Fn() -> Result<String, String> + Send + Sync>,
    /// The TLS client settings for an `https` upstream, read again when
    /// their CA file changes; `None` for plain HTTP.
    pub tls: Option<Arc<crate::net::client::TlsSource>>,
}

impl std::fmt::Debug for GatewayRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayRoute").field("name", &self.name).field("upstream", &self.upstream).finish()
    }
}

/// Headers that belong to one hop, never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The request's head as the upstream gets it: hop-by-hop headers
/// dropped, `Host` the upstream's, and the placeholder in the route's
/// header replaced by `secret`. A placeholder anywhere else (another
/// header, the path or query), or a request that does not present it, is
/// refused with the reason.
pub fn rewrite(
    headers: &mut HeaderMap,
    path_and_query: &str,
    presented: &Presented,
    placeholder: &str,
    secret: &str,
    authority: &str,
) -> Result<(), String> {
    if path_and_query.contains(placeholder) {
        return Err("the credential placeholder is in the URL".into());
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
    let wanted = presented.header();
    for (name, value) in headers.iter() {
        if name.as_str() != wanted && value.as_bytes().windows(placeholder.len()).any(|w| w == placeholder.as_bytes()) {
            return Err(format!("header {name} carries the credential placeholder"));
        }
    }
    let shown = headers.get(wanted).map(|v| v.as_bytes().to_vec()).unwrap_or_default();
    let value = match presented {
        Presented::Header(_) if shown == placeholder.as_bytes() => secret.to_string(),
        Presented::Bearer if shown == format!("Bearer {placeholder}").as_bytes() => format!("Bearer {secret}"),
        _ => return Err(format!("the request does not present this run's credential placeholder in {wanted}")),
    };
    let mut value = HeaderValue::from_str(&value).map_err(|_| "the secret is not a valid header value".to_string())?;
    value.set_sensitive(true);
    headers.insert(HeaderName::from_bytes(wanted.as_bytes()).map_err(|e| e.to_string())?, value);
    headers.insert(hyper::header::HOST, HeaderValue::from_str(authority).map_err(|e| e.to_string())?);
    Ok(())
}

type Body = BoxBody<Bytes, hyper::Error>;

fn answer(status: StatusCode, text: String) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(text + "\n")).map_err(|never| match never {}).boxed());
    *response.status_mut() = status;
    response
}

/// The gateway; dropping it closes the listener and every request.
pub type Gateway = crate::net::server::Served;

/// What the gateway refused, for the run's `egress` events.
pub type Refusals = Arc<crate::net::EgressLog>;

/// Connections one sandbox's gateway serves at once (as its egress proxy).
pub const MAX_CONNECTIONS: usize = 256;

/// Serves `routes` from `listener` (inside the sandbox's namespace). Each
/// connection (the sandbox's side and the upstream's: two descriptors) is
/// charged to the daemon's proxy budget the log carries, for its principal;
/// past that budget or [`MAX_CONNECTIONS`] of this sandbox, a connection is
/// answered 503 at once and recorded as a denied `gateway` egress event.
pub fn serve(listener: tokio::net::TcpListener, routes: Arc<Vec<GatewayRoute>>, log: Refusals) -> Gateway {
    let budget = log.clone();
    let refusals = log.clone();
    let admission = crate::net::server::Admission {
        max_connections: MAX_CONNECTIONS,
        full: format!("this sandbox's gateway connection limit ({MAX_CONNECTIONS}) is reached"),
        // The daemon always attaches its budget before the harness starts;
        // a log without one (a bench) is bound by the cap above alone.
        charge: Box::new(move || match budget.budget() {
            Some((budget, principal)) => budget.acquire(principal).map(|p| Box::new(p) as Box<dyn Send>),
            None => Ok(Box::new(())),
        }),
        refused: Box::new(move |reason| record(&refusals, None, Err(reason))),
    };
    crate::net::server::serve_http1_admitted(listener, admission, Duration::from_secs(30), move |req| {
        let (routes, log) = (routes.clone(), log.clone());
        async move { forward(req, &routes, &log).await }
    })
}

/// Records one request in the run's `egress` events: where it was going
/// (nothing for a route the run does not have) and, unless it was
/// forwarded, why not.
fn record(log: &crate::net::EgressLog, route: Option<&GatewayRoute>, outcome: Result<(), &str>) {
    let (host, port) = route.map(|r| (r.upstream.host.clone(), r.upstream.port)).unwrap_or_default();
    let name = route.map(|r| format!(" {}", r.name)).unwrap_or_default();
    log.record(crate::net::EgressDecision {
        host,
        port,
        allowed: outcome.is_ok(),
        rule_or_reason: match outcome {
            Ok(()) => format!("credential gateway{name}"),
            Err(reason) => format!("credential gateway{name}: {reason}"),
        },
        method: "gateway",
    });
}

fn refused(log: &crate::net::EgressLog, route: &GatewayRoute, reason: &str) -> Response<Body> {
    record(log, Some(route), Err(reason));
    answer(StatusCode::FORBIDDEN, format!("corral's credential gateway refused the request: {reason}"))
}

/// Whether a request with `method` for `rest` (the path after the route's
/// name) may carry the route's credential: the methods of an API, not
/// TRACE or TRACK (an upstream that allows them reflects the request, its
/// credential with it, back into the sandbox) nor CONNECT; and a path
/// that stays beneath the route's base path (no `.` or `..` segment,
/// percent-encoded or not, which the upstream would resolve above it).
pub fn check_request(method: &hyper::Method, rest: &str) -> Result<(), String> {
    use hyper::Method;
    let api = [Method::GET, Method::HEAD, Method::POST, Method::PUT, Method::PATCH, Method::DELETE, Method::OPTIONS];
    if !api.contains(method) {
        return Err(format!("method {} is not forwarded with a credential", shown(method.as_str())));
    }
    let dots = |segment: &str| {
        let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
        decoded == "." || decoded == ".."
    };
    if rest.split(['/', '\\']).any(dots) {
        return Err("a path that climbs above the route's base path".into());
    }
    Ok(())
}

/// A route name as the harness asked for it, bounded for a record.
fn shown(name: &str) -> String {
    name.chars().take(64).map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// Every request is recorded: forwarded (allowed), or refused or failed
/// (denied, with the reason), so the evidence counts what the gateway
/// could not do as well as what it did.
async fn forward(req: Request<Incoming>, routes: &[GatewayRoute], log: &crate::net::EgressLog) -> Response<Body> {
    let path = req.uri().path().to_string();
    // The route is the first segment after exactly one `/`: `//name/...`
    // names no route (the rest is cut after that one slash and the name).
    let name = path.strip_prefix('/').unwrap_or_default().split('/').next().unwrap_or_default();
    let Some(route) = routes.iter().find(|r| r.name == name) else {
        record(log, None, Err(&format!("no credential route {:?} in this run", shown(name))));
        return answer(StatusCode::NOT_FOUND, format!("no credential route {name:?} here"));
    };
    let rest = &path[1 + name.len()..];
    let query = req.uri().query().map(|q| format!("?{q}")).unwrap_or_default();
    let target = format!("{}{rest}{query}", route.upstream.path);
    let secret = match (route.secret)() {
        Ok(secret) => secret,
        Err(why) => {
            record(log, Some(route), Err(&why));
            return answer(StatusCode::BAD_GATEWAY, why);
        }
    };
    let (mut parts, body) = req.into_parts();
    if let Err(reason) = check_request(&parts.method, rest) {
        return refused(log, route, &reason);
    }
    let authority = route.upstream.authority();
    if let Err(reason) = rewrite(
        &mut parts.headers,
        &format!("{path}{query}"),
        &route.presented,
        &route.placeholder,
        &secret,
        &authority,
    ) {
        return refused(log, route, &reason);
    }
    parts.uri = match target.parse() {
        Ok(uri) => uri,
        Err(_) => {
            let reason = "a path the upstream cannot take";
            record(log, Some(route), Err(reason));
            return answer(StatusCode::BAD_REQUEST, reason.into());
        }
    };
    parts.version = hyper::Version::HTTP_11;
    let request = Request::from_parts(parts, body);
    match send(route, request).await {
        Ok(response) => {
            record(log, Some(route), Ok(()));
            response.map(|b| b.boxed())
        }
        Err(why) => {
            record(log, Some(route), Err(&format!("the upstream failed: {why}")));
            answer(StatusCode::BAD_GATEWAY, format!("corral's credential gateway: {why}"))
        }
    }
}

/// One request on a connection of its own to the upstream (TLS unless a
/// loopback `http://` upstream), the response streamed back as it comes.
async fn send(route: &GatewayRoute, request: Request<Incoming>) -> Result<Response<Incoming>, String> {
    let up = &route.upstream;
    // The reason names a host path: the daemon's log has it, the harness
    // (who reads the answer and the egress event) does not.
    let tls = route.tls.as_ref().map(|source| source.config()).transpose().map_err(|e| {
        tracing::warn!(route = %route.name, error = %e, "credential gateway: the route's CA file cannot be used");
        format!("credential route {}: its CA file cannot be used", route.name)
    })?;
    let stream = crate::net::client::connect(&up.host, up.port, tls.as_ref(), CONNECT_TIMEOUT).await?;
    let mut sender = crate::net::client::handshake(stream).await?;
    sender.send_request(request).await.map_err(|e| format!("upstream: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_api_s_methods_beneath_the_base_path_carry_a_credential() {
        use hyper::Method;
        let trace = Method::from_bytes(b"TRACE").unwrap();
        let track = Method::from_bytes(b"TRACK").unwrap();
        let cases: [(&Method, &str, Result<(), &str>); 13] = [
            (&Method::POST, "/v1/messages", Ok(())),
            (&Method::GET, "/repos/o/r/pulls?state=open", Ok(())),
            (&Method::DELETE, "", Ok(())),
            (&Method::OPTIONS, "/v1/a.b/..c", Ok(())),
            (&trace, "/v1", Err("method TRACE is not forwarded with a credential")),
            (&track, "/v1", Err("method TRACK is not forwarded with a credential")),
            (&Method::CONNECT, "/", Err("method CONNECT is not forwarded with a credential")),
            (&Method::GET, "/../admin", Err("a path that climbs above the route's base path")),
            (&Method::GET, "/v1/..", Err("a path that climbs above the route's base path")),
            (&Method::GET, "/%2e%2E/admin", Err("a path that climbs above the route's base path")),
            (&Method::GET, "/.%2e/admin", Err("a path that climbs above the route's base path")),
            (&Method::GET, "/./x", Err("a path that climbs above the route's base path")),
            (&Method::GET, "/v1\\..\\admin", Err("a path that climbs above the route's base path")),
        ];
        for (method, rest, expected) in cases {
            assert_eq!(check_request(method, rest), expected.map_err(String::from), "{method} {rest}");
        }
    }

    /// The first event of a stream reaches the client while the upstream
    /// is still holding back the rest: nothing is buffered on the way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_passes_through_as_it_is_sent() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let held = std::sync::Mutex::new(Some(held));
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = upstream.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let mut head = Vec::new();
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                head.extend_from_slice(&buf[..n]);
            }
            let text = String::from_utf8_lossy(&head).to_string();
            assert!(text.contains("x-api-key: sk-real"), "{text}");
            let first = "event: one\ndata: 1\n\n";
            let chunk = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
            let start = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            stream.write_all(format!("{start}{}", chunk(first)).as_bytes()).await.unwrap();
            let held = held.lock().unwrap().take().unwrap();
            held.await.unwrap();
            stream.write_all(format!("{}0\r\n\r\n", chunk("event: two\ndata: 2\n\n")).as_bytes()).await.unwrap();
        });
        let placeholder = placeholder("anthropic");
        let route = GatewayRoute {
            name: "anthropic".into(),
            placeholder: placeholder.clone(),
            presented: Presented::Header("x-api-key".into()),
            upstream: super::upstream(&format!("http://{up}")).unwrap(),
            secret: Box::new(|| Ok("sk-real".into())),
            tls: None,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _gateway = serve(listener, Arc::new(vec![route]), Arc::default());
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST /anthropic/v1/messages HTTP/1.1\r\nhost: 127.0.0.1\r\nx-api-key: {placeholder}\r\n\
             content-length: 2\r\n\r\n{{}}"
        );
        client.write_all(request.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data: 1") {
            let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0, "closed before the first event: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        assert!(!String::from_utf8_lossy(&seen).contains("data: 2"), "the rest was not sent yet");
        release.send(()).unwrap();
        while !String::from_utf8_lossy(&seen).contains("data: 2") {
            let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf)).await.unwrap().unwrap();
            assert!(n > 0);
            seen.extend_from_slice(&buf[..n]);
        }
    }

    /// What the gateway cannot forward is an egress event too: a route the
    /// run does not have, a secret that cannot be read, an upstream that is
    /// down; each denied, with the reason, and counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_or_failed_request_is_recorded() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let down = closed.local_addr().unwrap();
        drop(closed);
        let route = |name: &str, secret: Result<String, String>| GatewayRoute {
            name: name.into(),
            placeholder: format!("corral-{name}-00"),
            presented: Presented::Bearer,
            upstream: super::upstream(&format!("http://{down}")).unwrap(),
            secret: Box::new(move || secret.clone()),
            tls: None,
        };
        let routes = vec![
            route("down", Ok("sk-real".into())),
            route("unreadable", Err("credential route unreadable: its file cannot be read".into())),
        ];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log: Refusals = Arc::default();
        let _gateway = serve(listener, Arc::new(routes), log.clone());
        let mut statuses = Vec::new();
        // `//down/v1` names no route (the one after exactly one `/`): it
        // was taken as `down` and its path cut one byte off.
        for (path, token) in [
            ("/down/v1", "corral-down-00"),
            ("/unreadable/v1", "corral-unreadable-00"),
            ("/nosuch/v1", "x"),
            ("//down/v1", "corral-down-00"),
        ] {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let request = format!(
                "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\nconnection: close\r\n\r\n"
            );
            client.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            tokio::time::timeout(Duration::from_secs(20), client.read_to_string(&mut answer)).await.unwrap().unwrap();
            statuses.push(answer.split(' ').nth(1).unwrap_or_default().to_string());
        }
        assert_eq!(statuses, ["502", "502", "404", "404"]);
        let decisions = log.drain();
        let seen: Vec<(&str, u16, bool, &str)> =
            decisions.iter().map(|d| (d.host.as_str(), d.port, d.allowed, d.method)).collect();
        assert_eq!(
            seen,
            [
                ("127.0.0.1", down.port(), false, "gateway"),
                ("127.0.0.1", down.port(), false, "gateway"),
                ("", 0, false, "gateway"),
                ("", 0, false, "gateway")
            ]
        );
        assert!(
            decisions[0].rule_or_reason.starts_with("credential gateway down: the upstream failed: "),
            "{decisions:?}"
        );
        assert_eq!(
            decisions[1].rule_or_reason,
            "credential gateway unreadable: credential route unreadable: its file cannot be read"
        );
        assert_eq!(decisions[2].rule_or_reason, "credential gateway: no credential route \"nosuch\" in this run");
        assert_eq!(decisions[3].rule_or_reason, "credential gateway: no credential route \"\" in this run");
        assert_eq!(log.counts(), (0, 4));
    }

    /// A route's CA file that can no longer be used fails the request
    /// without showing the harness where it is on the host.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_ca_file_fails_the_request_without_naming_its_path() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("private-ca.pem");
        std::fs::write(&ca, rcgen::generate_simple_self_signed(vec!["ca".into()]).unwrap().cert.pem()).unwrap();
        let route = GatewayRoute {
            name: "vendor".into(),
            placeholder: "corral-vendor-00".into(),
            presented: Presented::Bearer,
            upstream: super::upstream("https://api.vendor.example").unwrap(),
            secret: Box::new(|| Ok("sk-real".into())),
            tls: Some(Arc::new(crate::net::client::TlsSource::new(Some(&ca)).unwrap())),
        };
        std::fs::remove_file(&ca).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log: Refusals = Arc::default();
        let _gateway = serve(listener, Arc::new(vec![route]), log.clone());
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = "GET /vendor/v1 HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer corral-vendor-00\r\n\
                       connection: close\r\n\r\n";
        client.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(20), client.read_to_string(&mut answer)).await.unwrap().unwrap();
        assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
        let shown = dir.path().display().to_string();
        assert!(!answer.contains(&shown), "the answer names the host path: {answer}");
        let decisions = log.drain();
        assert_eq!(decisions.len(), 1, "{decisions:?}");
        assert!(!decisions[0].rule_or_reason.contains(&shown), "{decisions:?}");
        assert!(decisions[0].rule_or_reason.contains("its CA file cannot be used"), "{decisions:?}");
    }

    #[test]
    fn upstreams_are_tls_or_loopback() {
        assert_eq!(
            upstream("https://api.anthropic.com").unwrap(),
            Upstream { tls: true, host: "api.anthropic.com".into(), port: 443, path: String::new() }
        );
        let openai = upstream("https://api.openai.com/v1/").unwrap();
        assert_eq!((openai.path.as_str(), openai.authority()), ("/v1", "api.openai.com".to_string()));
        let local = upstream("http://127.0.0.1:8080/v1").unwrap();
        assert_eq!((local.tls, local.authority(), local.path.as_str()), (false, "127.0.0.1:8080".into(), "/v1"));
        let err = upstream("http://10.0.0.5:8080").unwrap_err();
        assert!(err.contains("loopback") && err.contains("https"), "{err}");
        assert!(upstream("ftp://x").is_err());
    }

    #[test]
    fn placeholders_are_per_run_and_name_their_route() {
        let (a, b) = (placeholder("anthropic"), placeholder("anthropic"));
        assert!(a.starts_with("corral-anthropic-") && a.len() == "corral-anthropic-".len() + 32, "{a}");
        assert_ne!(a, b);
        assert!(placeholder("route.test").starts_with("corral-routetest-"));
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap()))
            .collect()
    }

    #[test]
    fn only_the_routes_header_gets_the_secret() {
        let p = "corral-anthropic-00";
        let key = Presented::Header("x-api-key".into());
        let mut h = headers(&[("x-api-key", p), ("connection", "keep-alive"), ("host", "127.0.0.1:3130")]);
        rewrite(&mut h, "/anthropic/v1/messages", &key, p, "sk-real", "api.anthropic.com").unwrap();
        assert_eq!(h["x-api-key"], "sk-real");
        assert!(h["x-api-key"].is_sensitive());
        assert_eq!(h["host"], "api.anthropic.com");
        assert!(h.get("connection").is_none(), "hop-by-hop headers are dropped");
        let mut h = headers(&[("authorization", &format!("Bearer {p}"))]);
        rewrite(&mut h, "/openai/responses", &Presented::Bearer, p, "sk-real", "api.openai.com").unwrap();
        assert_eq!(h["authorization"], "Bearer sk-real");
        for (pairs, path, why) in [
            (vec![("x-api-key", p), ("x-other", p)], "/a", "header x-other"),
            (vec![("x-api-key", p)], "/a?k=corral-anthropic-00", "URL"),
            (vec![("x-api-key", "something-else")], "/a", "does not present"),
            (vec![], "/a", "does not present"),
            (vec![("x-api-key", &format!("{p}x"))], "/a", "does not present"),
        ] {
            let mut h = headers(&pairs);
            let err = rewrite(&mut h, path, &key, p, "sk-real", "a").unwrap_err();
            assert!(err.contains(why), "{err}");
            assert!(h.values().all(|v| v != "sk-real"), "the secret is never set on a refused request");
        }
    }
}
