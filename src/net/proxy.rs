//! The per-sandbox egress proxy. The daemon creates its listening socket
//! inside the sandbox's network namespace, so this is the sandbox's only way
//! out; its outgoing connections are made from the daemon's namespace, after
//! the allowlist has judged the name AND every address it resolved to.
//!
//! One task per client connection, all owned by the accept task: dropping
//! the [`ProxyHandle`] closes the listener and every socket at once.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{timeout, timeout_at, Instant};

use super::allowlist::{Allowlist, Target, Verdict};
use super::http::{self, BadRequest, Request};
pub use super::log::{EgressDecision, EgressLog};
pub use super::scan::Scanner;
use super::scan::{carries_forbidden, PLACEHOLDER_REFUSAL};

/// Resolved addresses considered per attempt.
const MAX_ADDRESSES: usize = 16;
/// Copy buffer per direction.
const COPY_BUFFER: usize = 16 * 1024;

/// What one sandbox's egress proxy allows and refuses.
pub struct ProxyConfig {
    /// The hosts and ports the sandbox may reach.
    pub allowlist: Allowlist,
    /// Listeners never reachable, whatever the allowlist says, besides the
    /// daemon's own as they are at each request (`net::protected_addresses`).
    pub protected: Vec<SocketAddr>,
    /// This host's interface addresses (see `host_addresses`).
    pub host_addresses: Vec<IpAddr>,
    /// For resolving a name, and for each connect attempt.
    pub connect_timeout: Duration,
}

/// Bounds on what one client can make the proxy hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Largest request head; more is answered 431.
    pub max_head: usize,
    /// The whole head must arrive within this.
    pub head_timeout: Duration,
    /// Concurrent connections; one past it is answered 503 (an egress deny).
    pub max_connections: usize,
    /// Name lookups in flight for this sandbox; one past it is answered 503.
    pub max_lookups: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_head: 16 * 1024, head_timeout: Duration::from_secs(30), max_connections: 256, max_lookups: 16 }
    }
}

/// Refusals of connections past [`Limits::max_connections`] in progress at
/// once (each reads the head briefly, to name the target in its deny); one
/// past it too is recorded and closed at once, so refusing has a bound as well.
const MAX_REFUSING: usize = 16;

/// One sandbox's name lookups in flight, and how many may be.
type Lookups = (Arc<Semaphore>, usize);

/// Stops the proxy when dropped (or aborted): the accept loop, its listener
/// and every connection task with their sockets.
pub struct ProxyHandle {
    task: JoinHandle<()>,
}

impl ProxyHandle {
    /// Stops the proxy now, as dropping the handle does.
    pub fn abort(&self) {
        self.task.abort();
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `listener` until the returned handle is dropped or aborted: every accepted
/// connection is handled on its own task; dropping the handle ends the accept loop AND every
/// connection task, so no socket of the sandbox outlives it. Must be called within a tokio
/// runtime. At most 256 connections are served at once; one past that is answered 503 and
/// recorded as an egress deny. At most 16 name lookups are in flight for it (and at most
/// [`super::budget::MAX_LOOKUPS_PER_PRINCIPAL`] for all its principal's sandboxes, and
/// [`super::budget::MAX_LOOKUPS`] for all sandboxes); one past that is answered 503 as well.
/// The whole request head must arrive within 30 s.
pub fn serve(listener: TcpListener, config: ProxyConfig, log: Arc<EgressLog>) -> ProxyHandle {
    serve_with(listener, config, log, Limits::default())
}

pub(crate) fn serve_with(
    listener: TcpListener,
    config: ProxyConfig,
    log: Arc<EgressLog>,
    limits: Limits,
) -> ProxyHandle {
    let config = Arc::new(config);
    let lookups = Arc::new((Arc::new(Semaphore::new(limits.max_lookups)), limits.max_lookups));
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let full = format!("this sandbox's proxy connection limit ({}) is reached", limits.max_connections);
    let task = tokio::spawn(async move {
        // Owned by this task: aborting it drops the set, which aborts every connection.
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    // Never left waiting in the backlog: served, or refused at once.
                    Ok((stream, _)) => match slots.clone().try_acquire_owned() {
                        Ok(slot) => {
                            let (config, log, lookups) = (config.clone(), log.clone(), lookups.clone());
                            connections.spawn(async move {
                                handle(stream, config, log, limits, lookups).await;
                                drop(slot);
                            });
                        }
                        Err(_) => match refusing.clone().try_acquire_owned() {
                            Ok(refusal) => {
                                let (log, full) = (log.clone(), full.clone());
                                connections.spawn(async move {
                                    over_budget(stream, &log, limits, &full).await;
                                    drop(refusal);
                                });
                            }
                            Err(_) => log.record(denied(String::new(), 0, "http", &full)),
                        },
                    },
                    Err(error) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::debug!(%error, "proxy accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
    });
    ProxyHandle { task }
}

enum Head {
    /// The head is `buf[..len]`; anything after it is body already read.
    Complete(usize),
    /// Closed before sending a byte: not an attempt, nothing is logged.
    Silent,
    Failed {
        status: Option<u16>,
        reason: String,
    },
}

async fn read_head(client: &mut TcpStream, buf: &mut Vec<u8>, limits: Limits) -> Head {
    let deadline = Instant::now() + limits.head_timeout;
    let mut chunk = [0u8; 4096];
    loop {
        let searched = buf.len();
        let room = limits.max_head - buf.len();
        if room == 0 {
            return Head::Failed { status: Some(431), reason: format!("request head over {} bytes", limits.max_head) };
        }
        let want = room.min(chunk.len());
        match timeout_at(deadline, client.read(&mut chunk[..want])).await {
            Err(_) => {
                let reason = format!("no complete request head within {}s", limits.head_timeout.as_secs_f32());
                return Head::Failed { status: None, reason };
            }
            Ok(Ok(0)) if buf.is_empty() => return Head::Silent,
            Ok(Ok(0)) => {
                return Head::Failed { status: None, reason: "closed in the middle of the request head".into() }
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(_)) if buf.is_empty() => return Head::Silent,
            Ok(Err(error)) => {
                return Head::Failed { status: None, reason: format!("reading the request head: {error}") }
            }
        }
        if let Some(len) = http::head_end(buf, searched) {
            return Head::Complete(len);
        }
    }
}

/// One client connection: take its share of the daemon's connection
/// budget, read the head, decide, connect, then copy until both sides are
/// done or it has been idle for the budget's idle timeout.
async fn handle(
    mut client: TcpStream,
    config: Arc<ProxyConfig>,
    log: Arc<EgressLog>,
    limits: Limits,
    lookups: Arc<Lookups>,
) {
    let _ = client.set_nodelay(true);
    let permit = match log.budget() {
        Some((budget, principal)) => budget.acquire(principal),
        None => Err("no connection budget is attached to this proxy".to_string()),
    };
    let permit = match permit {
        Ok(permit) => permit,
        Err(reason) => return over_budget(client, &log, limits, &reason).await,
    };
    let mut buf = Vec::with_capacity(4096);
    let len = match read_head(&mut client, &mut buf, limits).await {
        Head::Complete(len) => len,
        Head::Silent => return,
        Head::Failed { status, reason } => {
            log.record(denied(String::new(), 0, "http", &reason));
            if let Some(status) = status {
                refuse(client, status, &reason).await;
            }
            return;
        }
    };
    if let Some(refusal) = carries_forbidden(&buf, log.forbidden()) {
        log.record(denied(String::new(), 0, "http", &refusal));
        return refuse(client, 403, &refusal).await;
    }
    let (method, host, port, upstream_head) = match http::parse(&buf[..len]) {
        Ok(Request::Connect { host, port }) => ("connect", host, port, None),
        Ok(Request::Http { host, port, head }) => ("http", host, port, Some(head)),
        Err(BadRequest { method, reason }) => {
            log.record(denied(String::new(), 0, method, &reason));
            return refuse(client, 400, &reason).await;
        }
    };
    // A host that is no name nor address is logged whole (it is bounded by
    // the head; `http::parse` refused control characters): the daemon
    // scrubs it of the run's credentials, then cuts it. Cut here, a
    // credential asked as a host would keep a prefix no pattern matches.
    let shown = Target::parse(&host).map(|t| t.to_string()).unwrap_or_else(|_| host.clone());
    let (mut upstream, rule) = match open(&config, &host, port, &log, &lookups).await {
        Ok(opened) => opened,
        Err((status, reason)) => {
            log.record(denied(shown, port, method, &reason));
            return refuse(client, status, &reason).await;
        }
    };
    let key = super::log::host_port(&shown, port);
    // The log has no scrubber and the host is the harness's text (a
    // credential can be asked as a host name): only the operator's rule
    // that allowed it, the port and the host's length.
    let host_len = shown.len();
    tracing::debug!(target: "corral::net", %rule, port, host_len, method, "egress allowed");
    log.record(EgressDecision { host: shown, port, allowed: true, rule_or_reason: rule, method });

    let leftover = &buf[len..];
    let first_write = match &upstream_head {
        None => client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await,
        Some(head) => upstream.write_all(head).await,
    };
    let up = upstream_head.as_ref().map_or(0, Vec::len) + leftover.len();
    if first_write.is_err() || upstream.write_all(leftover).await.is_err() {
        return;
    }
    log.add_bytes(&key, up as u64, 0);
    // The tunnel's scan goes on from what came with the head: a
    // placeholder split between the two is still one placeholder.
    let mut scanner = Scanner::new(log.forbidden());
    scanner.hit(&buf);
    drop(buf);
    if !tunnel(client, upstream, &key, &log, permit.idle_timeout(), scanner).await {
        tracing::debug!(target: "corral::net", port, host_len, "proxied connection closed: idle");
    }
    drop(permit);
}

/// A connection past a cap: its head is read briefly, only to name what it
/// asked for in the `egress` deny, then it is answered 503 and closed.
async fn over_budget(mut client: TcpStream, log: &EgressLog, limits: Limits, reason: &str) {
    let mut buf = Vec::with_capacity(1024);
    let brief = Limits { head_timeout: Duration::from_secs(1), ..limits };
    let (host, port, method) = match read_head(&mut client, &mut buf, brief).await {
        Head::Silent => return,
        Head::Failed { .. } => (String::new(), 0, "http"),
        Head::Complete(len) => match http::parse(&buf[..len]) {
            Ok(Request::Connect { host, port }) => (host, port, "connect"),
            Ok(Request::Http { host, port, .. }) => (host, port, "http"),
            Err(BadRequest { method, .. }) => (String::new(), 0, method),
        },
    };
    // Whole, as in `handle`: the daemon scrubs it before it cuts it.
    let shown = Target::parse(&host).map(|t| t.to_string()).unwrap_or(host);
    log.record(denied(shown, port, method, reason));
    refuse(client, 503, reason).await;
}

/// Judges `host:port` and connects to it: name check, resolution, a check of
/// every resolved address, then the first address that accepts. The error is
/// the status to answer and why.
async fn open(
    config: &ProxyConfig,
    host: &str,
    port: u16,
    log: &EgressLog,
    lookups: &Lookups,
) -> Result<(TcpStream, String), (u16, String)> {
    let rule = match config.allowlist.check_name(host, port) {
        Verdict::Allow { rule } => rule,
        Verdict::Deny { reason } => return Err((403, reason)),
    };
    let mut addresses: Vec<SocketAddr> = match Target::parse(host) {
        Ok(Target::Ip(ip)) => vec![SocketAddr::new(ip, port)],
        Ok(Target::Name(name)) => {
            let permits = lookup_permits(log, lookups).map_err(|reason| (503, reason))?;
            let lookup = {
                let name = name.clone();
                // getaddrinfo cannot be cancelled: the permits stay with the
                // blocking thread until it returns, timed out here or not,
                // so a resolver that never answers holds a bounded number of
                // the runtime's blocking threads.
                tokio::task::spawn_blocking(move || {
                    let found = std::net::ToSocketAddrs::to_socket_addrs(&(name.as_str(), port));
                    drop(permits);
                    found.map(|found| found.take(MAX_ADDRESSES).collect::<Vec<_>>())
                })
            };
            match timeout(config.connect_timeout, lookup).await {
                Ok(Ok(Ok(found))) => {
                    found.into_iter().map(|a| SocketAddr::new(a.ip().to_canonical(), a.port())).collect()
                }
                Ok(Ok(Err(error))) => return Err((502, format!("cannot resolve {name}: {error}"))),
                Ok(Err(_)) => return Err((502, format!("resolving {name} failed"))),
                Err(_) => return Err((502, format!("resolving {name} timed out"))),
            }
        }
        Err(reason) => return Err((403, reason)),
    };
    let mut seen = Vec::with_capacity(addresses.len());
    addresses.retain(|a| {
        !seen.contains(a) && {
            seen.push(*a);
            true
        }
    });
    if addresses.is_empty() {
        return Err((502, format!("{host} has no address")));
    }
    // The daemon's listeners as they are now: a proxy made before one was
    // bound (a warm sandbox's, made as the daemon starts) refuses it too.
    let mut protected = super::protected_addresses();
    protected.extend_from_slice(&config.protected);
    // Every address, not just the one used: a name must not be able to point
    // anywhere it may not go (DNS rebinding).
    for address in &addresses {
        if let Verdict::Deny { reason } =
            config.allowlist.check_address(&rule, *address, &config.host_addresses, &protected)
        {
            return Err((403, reason));
        }
    }
    let mut last_error = String::new();
    for address in addresses {
        match timeout(config.connect_timeout, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok((stream, rule));
            }
            Ok(Err(error)) => last_error = format!("connecting to {address}: {error}"),
            Err(_) => last_error = format!("connecting to {address} timed out"),
        }
    }
    Err((502, last_error))
}

/// One name lookup's share: of this sandbox's, of its principal's and of the
/// daemon's, taken at once or refused with the reason (a lookup never waits
/// for a share).
fn lookup_permits(
    log: &EgressLog,
    lookups: &Lookups,
) -> Result<(tokio::sync::OwnedSemaphorePermit, super::budget::LookupPermit), String> {
    let Some((budget, principal)) = log.budget() else {
        return Err("no connection budget is attached to this proxy".to_string());
    };
    let mine = lookups
        .0
        .clone()
        .try_acquire_owned()
        .map_err(|_| format!("this sandbox's limit of name lookups in flight ({}) is reached", lookups.1))?;
    Ok((mine, budget.lookup_for(principal)?))
}

fn denied(host: String, port: u16, method: &'static str, reason: &str) -> EgressDecision {
    EgressDecision { host, port, allowed: false, rule_or_reason: reason.to_string(), method }
}

/// Answers `status` with the plain-text reason, then closes. The client's
/// unread input is drained briefly first, so closing does not reset the
/// connection before the client has read the answer. The reason is whole
/// (it is bounded by the head it quotes): a harness may print it into its
/// output, which the daemon scrubs line by line, and a credential cut off
/// in it would keep a prefix no pattern matches.
async fn refuse(mut client: TcpStream, status: u16, reason: &str) {
    let title = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        502 => "Bad Gateway",
        _ => "Error",
    };
    let body = format!("corral egress proxy: {reason}\n");
    let response = format!(
        "HTTP/1.1 {status} {title}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = async {
        client.write_all(response.as_bytes()).await?;
        client.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 256 * 1024 {
            match client.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        std::io::Result::Ok(())
    };
    let _ = timeout(Duration::from_secs(2), answer).await;
}

/// Copies both ways until the upstream closes (or either side fails); a
/// client that half-closes still gets the rest of the answer. Bytes are
/// counted as they are read, so the log is current even if the proxy is
/// aborted mid-transfer. A tunnel that moves no byte either way for `idle`
/// is closed: false then.
async fn tunnel(
    mut client: TcpStream,
    mut upstream: TcpStream,
    key: &str,
    log: &EgressLog,
    idle: Duration,
    mut scanner: Scanner,
) -> bool {
    use std::sync::atomic::{AtomicU64, Ordering};
    let (mut client_read, mut client_write) = client.split();
    let (mut upstream_read, mut upstream_write) = upstream.split();
    let start = Instant::now();
    // Milliseconds after `start` of the last byte read either way.
    let last = AtomicU64::new(0);
    let touch = || last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    // What the client sends is looked through for the run's credential
    // placeholders (only plain text can show one: a TLS tunnel is opaque,
    // and its far end sees a placeholder, never the secret), by `scanner`,
    // which has seen what came before.
    let up = pump(&mut client_read, &mut upstream_write, |chunk: &[u8]| {
        touch();
        log.add_bytes(key, chunk.len() as u64, 0);
        if scanner.hit(chunk) {
            let (host, port) = key.rsplit_once(':').map(|(h, p)| (h, p.parse().unwrap_or(0))).unwrap_or((key, 0));
            log.record(denied(host.to_string(), port, "connect", PLACEHOLDER_REFUSAL));
            return false;
        }
        true
    });
    let down = pump(&mut upstream_read, &mut client_write, |chunk: &[u8]| {
        touch();
        log.add_bytes(key, 0, chunk.len() as u64);
        true
    });
    let idle_out = async {
        loop {
            let quiet = start.elapsed().saturating_sub(Duration::from_millis(last.load(Ordering::Relaxed)));
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    };
    tokio::pin!(up, down, idle_out);
    tokio::select! {
        _ = &mut idle_out => return false,
        _ = &mut down => {}
        finished = &mut up => if finished.is_ok() {
            tokio::select! {
                _ = &mut down => {}
                _ = &mut idle_out => return false,
            }
        },
    }
    true
}

/// Copies until EOF; `pass` sees each chunk first and may stop the copy.
async fn pump<R, W>(from: &mut R, to: &mut W, mut pass: impl FnMut(&[u8]) -> bool) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; COPY_BUFFER];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        if !pass(&buf[..n]) {
            return Err(std::io::Error::other(PLACEHOLDER_REFUSAL));
        }
        to.write_all(&buf[..n]).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::budget::{ProxyBudget, MAX_LOOKUPS_PER_PRINCIPAL};
    use crate::net::{host_addresses, parse_hosts};

    const NAME: &[u8] = b"CONNECT lookup.invalid:443 HTTP/1.1\r\n\r\n";

    /// A proxy for one sandbox of `principal`, on the shared `budget`.
    async fn proxy_for(budget: &Arc<ProxyBudget>, principal: &str) -> (SocketAddr, Arc<EgressLog>, ProxyHandle) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = ProxyConfig {
            allowlist: Allowlist::new(parse_hosts(&["lookup.invalid:443".to_string()]).unwrap()),
            protected: vec![],
            host_addresses: host_addresses(),
            connect_timeout: Duration::from_secs(2),
        };
        let log = Arc::new(EgressLog::default());
        log.attach_budget(budget.clone(), principal);
        (addr, log.clone(), serve(listener, config, log))
    }

    async fn ask(proxy: SocketAddr) -> String {
        let mut client = TcpStream::connect(proxy).await.unwrap();
        client.write_all(NAME).await.unwrap();
        let mut answer = Vec::new();
        timeout(Duration::from_secs(10), client.read_to_end(&mut answer)).await.expect("answered").unwrap();
        String::from_utf8_lossy(&answer).to_string()
    }

    /// A principal whose other sandboxes hold its whole share of the
    /// daemon's lookups (a resolver that never answers) has its next name
    /// refused 503, as an egress deny saying its share is used up, while
    /// another principal's sandbox still resolves; the share comes back.
    #[tokio::test]
    async fn a_principal_past_its_share_of_lookups_is_refused_and_another_still_resolves() {
        let budget = ProxyBudget::new(100, 100, Duration::from_secs(300));
        let (greedy, greedy_log, _greedy) = proxy_for(&budget, "greedy").await;
        let (other, other_log, _other) = proxy_for(&budget, "other").await;
        let stuck: Vec<_> = (0..MAX_LOOKUPS_PER_PRINCIPAL).map(|_| budget.lookup_for("greedy").unwrap()).collect();

        let answer = ask(greedy).await;
        assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
        let reason =
            format!("this principal's share of name lookups in flight ({MAX_LOOKUPS_PER_PRINCIPAL}) is used up");
        assert!(answer.ends_with(&format!("corral egress proxy: {reason}\n")), "{answer}");
        let decisions = greedy_log.drain();
        assert_eq!(decisions.len(), 1, "{decisions:?}");
        assert!(!decisions[0].allowed);
        assert_eq!((decisions[0].host.as_str(), decisions[0].port), ("lookup.invalid", 443));
        assert_eq!(decisions[0].rule_or_reason, reason);

        let answer = ask(other).await;
        assert!(answer.starts_with("HTTP/1.1 502 "), "another principal resolves (and fails): {answer}");
        assert!(!other_log.drain()[0].rule_or_reason.contains("name lookups in flight"));

        drop(stuck);
        let answer = ask(greedy).await;
        assert!(answer.starts_with("HTTP/1.1 502 "), "resolved (and failed) once its share is back: {answer}");
    }
}
