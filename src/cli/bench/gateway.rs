//! `gateway`: what the credential gateway adds to one model request. The
//! same POST to the same loopback upstream (answering a short SSE stream),
//! once through the egress proxy as plain HTTP (the path a request takes
//! without the gateway) and once through the gateway, which checks the
//! placeholder, reads the secret, swaps it in and forwards on a connection
//! of its own. Sequential, interleaved halves, in this process.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use serde::Serialize;

use super::stats::Percentiles;
use super::BenchArgs;
use crate::credentials::gateway::{self, GatewayRoute, Presented};
use crate::net::{self, Allowlist, EgressLog, ProxyBudget, ProxyConfig};

/// What `corral bench gateway` measured: a model request through the
/// egress proxy and through the credential gateway.
#[derive(Clone, Debug, Serialize)]
pub struct GatewayReport {
    /// Requests timed, both halves together.
    pub n: usize,
    /// Through the egress proxy (plain HTTP proxying), no gateway.
    pub proxy: Percentiles,
    /// Through the credential gateway.
    pub gateway: Percentiles,
    /// gateway p50 - proxy p50.
    pub added_p50_ms: f64,
}

const SSE: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

/// A loopback upstream answering every request with [`SSE`].
async fn upstream() -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req: hyper::Request<Incoming>| async {
                    let mut response = hyper::Response::new(Full::new(Bytes::from_static(SSE.as_bytes())));
                    response.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
                    Ok::<_, std::convert::Infallible>(response)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// One request on a new connection (`Connection: close`); its ms.
fn request(addr: SocketAddr, target: &str, key: &str) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {key}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let text = String::from_utf8_lossy(&answer);
    if !text.starts_with("HTTP/1.1 200") || !text.contains("message_stop") {
        anyhow::bail!("unexpected answer: {}", text.lines().next().unwrap_or_default());
    }
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

async fn timed(addr: SocketAddr, target: String, key: String, n: usize, warmup: usize) -> anyhow::Result<Vec<f64>> {
    tokio::task::spawn_blocking(move || {
        let mut ms = Vec::with_capacity(n);
        for i in 0..n + warmup {
            let took = request(addr, &target, &key)?;
            if i >= warmup {
                ms.push(took);
            }
        }
        Ok(ms)
    })
    .await?
}

pub async fn run(args: &BenchArgs) -> anyhow::Result<GatewayReport> {
    let n = args.n.unwrap_or(500);
    let up = upstream().await?;
    // The egress proxy, allowing exactly the upstream.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let config = ProxyConfig {
        allowlist: Allowlist::new(net::parse_hosts(&[up.to_string()]).map_err(anyhow::Error::msg)?),
        protected: Vec::new(),
        host_addresses: net::host_addresses(),
        connect_timeout: Duration::from_secs(5),
    };
    let log = Arc::new(EgressLog::default());
    log.attach_budget(ProxyBudget::new(1024, 1024, Duration::from_secs(60)), "bench");
    let _proxy = net::serve(listener, config, log.clone());
    // The gateway, towards the same upstream.
    let placeholder = gateway::placeholder("anthropic");
    let route = GatewayRoute {
        name: "anthropic".into(),
        placeholder: placeholder.clone(),
        presented: Presented::Header("x-api-key".into()),
        upstream: gateway::upstream(&format!("http://{up}")).map_err(anyhow::Error::msg)?,
        secret: Box::new(|| Ok("sk-bench-secret".to_string())),
        tls: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway_addr = listener.local_addr()?;
    let _gateway = gateway::serve(listener, Arc::new(vec![route]), Arc::new(EgressLog::default()));
    let warmup = args.warmup.max(1);
    let half = (n / 2).max(1);
    let (mut proxied, mut gated) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let plain = format!("http://{up}/v1/messages");
        proxied.extend(timed(proxy_addr, plain, "sk-in-the-sandbox".into(), half, warmup).await?);
        let through = "/anthropic/v1/messages".to_string();
        gated.extend(timed(gateway_addr, through, placeholder.clone(), half, warmup).await?);
    }
    let (proxy, gateway) = (Percentiles::of_ms(&proxied), Percentiles::of_ms(&gated));
    Ok(GatewayReport { n: 2 * half, added_p50_ms: gateway.p50_ms - proxy.p50_ms, proxy, gateway })
}
