//! The Prometheus scrape endpoint, `GET /metrics` on `metrics_listen`. The
//! daemon serves it itself (not the exporter's own listener) so that it can
//! (1) put the listener in the protected set, which no sandbox's egress
//! proxy ever connects to whatever an allowlist says, and (2) require a
//! bearer token (`metrics_token_file`), compared by digest in constant time.
//! A non-loopback listener without a token is refused at config time.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Scrapes served at once; more connections wait in the backlog.
const MAX_CONNECTIONS: usize = 16;
/// A scrape connection is closed after this, whatever it is doing.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Shortest token accepted in `metrics_token_file`.
pub const MIN_TOKEN_CHARS: usize = 32;

/// The process-wide recorder's handle: installed once, shared by every
/// daemon in the process (tests run several).
fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new();
        // Only an empty bucket list is an error; ours is fixed and not empty.
        let builder = builder.set_buckets(crate::telemetry::BUCKETS).unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("another metrics recorder is installed; /metrics will be empty");
        }
        crate::telemetry::describe();
        crate::telemetry::initialise();
        handle
    })
}

/// The token a scrape must present, from `metrics_token_file` (trimmed; at
/// least [`MIN_TOKEN_CHARS`]). Errors name the key.
pub fn load_token(path: &Path) -> Result<[u8; 32], String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("metrics_token_file {}: {e}", path.display()))?;
    let token = text.trim();
    if token.chars().count() < MIN_TOKEN_CHARS {
        return Err(format!(
            "metrics_token_file {}: the token must have at least {MIN_TOKEN_CHARS} characters",
            path.display()
        ));
    }
    Ok(Sha256::digest(token.as_bytes()).into())
}

/// Binds `addr`, protects it from every sandbox's proxy, and serves scrapes
/// until `shutdown`. Returns the bound address.
pub async fn serve(
    addr: SocketAddr,
    token: Option<[u8; 32]>,
    shutdown: CancellationToken,
) -> Result<SocketAddr, String> {
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("metrics_listen {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| format!("metrics_listen {addr}: {e}"))?;
    let protected = crate::net::protect(local);
    let handle = handle();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tracing::info!(addr = %local, token = token.is_some(), "metrics on GET /metrics");
    tokio::spawn(async move {
        // Protected while it accepts.
        let _protected = protected;
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else { return };
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| async move {
                    Ok::<_, std::convert::Infallible>(respond(&req, token.as_ref(), handle))
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .keep_alive(false)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
                drop(permit);
            });
        }
    });
    Ok(local)
}

fn respond(req: &Request<Incoming>, token: Option<&[u8; 32]>, handle: &PrometheusHandle) -> Response<Full<Bytes>> {
    let answer = |status: StatusCode, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response
    };
    if req.uri().path() != "/metrics" {
        return answer(StatusCode::NOT_FOUND, "not found\n".into());
    }
    if req.method() != hyper::Method::GET {
        return answer(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
    }
    if let Some(expected) = token {
        if !authorized(req.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes()), expected) {
            let mut response = answer(StatusCode::UNAUTHORIZED, "a bearer token is required\n".into());
            response
                .headers_mut()
                .insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    crate::telemetry::sample_process();
    let mut response = answer(StatusCode::OK, handle.render());
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"));
    response
}

/// `Bearer <token>` whose digest is `expected` (constant-time comparison).
fn authorized(header: Option<&[u8]>, expected: &[u8; 32]) -> bool {
    let Some(token) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else { return false };
    let presented: [u8; 32] = Sha256::digest(token.trim_ascii()).into();
    presented[..].ct_eq(&expected[..]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_bearer_token_is_authorized() {
        let expected: [u8; 32] = Sha256::digest(b"t".repeat(40)).into();
        let good = [b"Bearer ".as_slice(), &b"t".repeat(40)].concat();
        assert!(authorized(Some(&good), &expected));
        assert!(!authorized(Some(&b"t".repeat(40)), &expected), "without the scheme");
        assert!(!authorized(Some(b"Bearer wrong"), &expected));
        assert!(!authorized(None, &expected));
    }

    #[test]
    fn a_short_token_file_is_an_error_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t");
        std::fs::write(&file, "short\n").unwrap();
        assert!(load_token(&file).unwrap_err().contains("metrics_token_file"));
        assert!(load_token(&dir.path().join("missing")).unwrap_err().contains("metrics_token_file"));
        std::fs::write(&file, format!("{}\n", "x".repeat(32))).unwrap();
        assert_eq!(load_token(&file).unwrap(), <[u8; 32]>::from(Sha256::digest("x".repeat(32).as_bytes())));
    }
}
