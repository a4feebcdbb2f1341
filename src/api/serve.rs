//! Serving the routes over HTTP/2 with hyper directly, for one setting
//! tonic's server builder does not expose: h2's per-stream send buffer
//! (`[grpc] max_send_buffer_bytes`). Without it a watcher that reads
//! slowly holds up to h2's default send buffer, 400 KiB a stream, whatever
//! its client's stream window (the window is no limit: see the test
//! below); with it,
//! the stream stops pulling events once that many bytes wait to be
//! written, and the watcher catches up from the store when it reads again.
//!
//! What tonic's server did around each connection is here too: the peer's
//! connect info in every request's extensions (so `peer_certs` and the
//! unix peer's uid work as before), TLS with a bounded handshake, the
//! caller's `grpc-timeout` on the answer's headers (a unary call's whole
//! run), and a graceful end: on shutdown no new connection is accepted,
//! each open one gets GOAWAY and is waited for.

use std::future::Future;
use std::io;
use std::time::Duration;

use futures_util::StreamExt;
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::body::Body;
use tonic::service::Routes;
use tonic::transport::server::Connected;
use tower::ServiceExt;

use crate::config::GrpcConfig;

/// A TLS handshake that takes longer ends the connection.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP/2 settings of every connection, from `[grpc]`.
fn http2_builder(limits: &GrpcConfig) -> http2::Builder<TokioExecutor> {
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_send_buf_size(limits.max_send_buffer_bytes);
    if limits.keepalive_interval_seconds > 0 {
        builder
            .keep_alive_interval(Duration::from_secs(limits.keepalive_interval_seconds))
            .keep_alive_timeout(Duration::from_secs(limits.keepalive_timeout_seconds));
    }
    builder
}

/// Serves `routes` on every connection `incoming` yields (behind TLS when
/// `tls` is given) until `stop` completes, then ends each connection
/// gracefully and returns once all are closed.
pub(super) async fn serve<I, IO>(
    incoming: I,
    routes: Routes,
    limits: &GrpcConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stop: impl Future<Output = ()>,
) where
    I: futures_core::Stream<Item = io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let builder = http2_builder(limits);
    let graceful = GracefulShutdown::new();
    // Boxed, so that dropping it closes the listener before the wait.
    let mut incoming = Box::pin(incoming);
    let mut stop = std::pin::pin!(stop);
    loop {
        let io = tokio::select! {
            () = &mut stop => break,
            io = incoming.next() => match io {
                Some(Ok(io)) => io,
                Some(Err(e)) => {
                    // EMFILE and its kind: wait a little instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                None => break,
            },
        };
        let (routes, builder, watcher) = (routes.clone(), builder.clone(), graceful.watcher());
        match tls.clone() {
            None => {
                tokio::spawn(connection(io, routes, builder, watcher));
            }
            Some(acceptor) => {
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                        Ok(Ok(io)) => connection(io, routes, builder, watcher).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                });
            }
        }
    }
    drop(incoming);
    graceful.shutdown().await;
}

/// Serves one connection until it closes. Its connect info goes into each
/// request, as tonic's server put it there.
async fn connection<IO>(io: IO, routes: Routes, builder: http2::Builder<TokioExecutor>, watcher: Watcher)
where
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let info = io.connect_info();
    let service = hyper::service::service_fn(move |mut request: http::Request<Incoming>| {
        request.extensions_mut().insert(info.clone());
        let timeout = super::limits::timeout_of(request.headers());
        let call = routes.clone().oneshot(request.map(Body::new));
        async move {
            let Some(timeout) = timeout else { return call.await };
            match tokio::time::timeout(timeout, call).await {
                Ok(answer) => answer,
                Err(_) => Ok(tonic::Status::deadline_exceeded("the call's grpc-timeout passed").into_http()),
            }
        }
    });
    logged(watcher.watch(builder.serve_connection(TokioIo::new(io), service))).await;
}

/// Logs a connection that ended with an error (a reset peer, a protocol
/// error): nothing a caller waits for.
async fn logged<F: Future<Output = Result<(), hyper::Error>>>(connection: F) {
    if let Err(e) = connection.await {
        tracing::debug!(error = %e, "connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Bytes a response produced for a client that reads none of them,
    /// over a connection whose transport takes 1 KiB and no more.
    async fn produced_for_a_reader_that_stops(send_buffer: usize) -> usize {
        let produced = Arc::new(AtomicUsize::new(0));
        let (client_io, server_io) = tokio::io::duplex(1024);
        let limits = GrpcConfig { max_send_buffer_bytes: send_buffer, ..GrpcConfig::default() };
        let counter = produced.clone();
        let service = hyper::service::service_fn(move |_request: http::Request<Incoming>| {
            let counter = counter.clone();
            let frames = futures_util::stream::repeat_with(move || {
                counter.fetch_add(1024, Ordering::Relaxed);
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(vec![7u8; 1024])))
            });
            async move { Ok::<_, Infallible>(http::Response::new(http_body_util::StreamBody::new(frames))) }
        });
        tokio::spawn(logged(http2_builder(&limits).serve_connection(TokioIo::new(server_io), service)));
        // The client offers 16 MiB of window, stream and connection, and
        // then reads nothing: only the server's own buffer bounds it.
        let (mut client, connection) = h2::client::Builder::new()
            .initial_window_size(16 << 20)
            .initial_connection_window_size(16 << 20)
            .handshake::<_, Bytes>(client_io)
            .await
            .unwrap();
        let driver = tokio::spawn(connection);
        let request = http::Request::post("http://corral/x").body(()).unwrap();
        let (response, _send) = client.send_request(request, false).unwrap();
        let _response = tokio::time::timeout(Duration::from_secs(5), response).await.unwrap().unwrap();
        // From here the client reads nothing: the transport backs up.
        driver.abort();
        tokio::time::sleep(Duration::from_millis(300)).await;
        produced.load(Ordering::Relaxed)
    }

    #[tokio::test]
    async fn a_stream_stops_pulling_once_its_send_buffer_is_full() {
        let capped = produced_for_a_reader_that_stops(16 * 1024).await;
        // The buffer, h2's write buffer of frames (16 KiB) and the 1 KiB the
        // transport took: 37 KiB measured.
        assert!(capped <= 48 * 1024, "{capped} bytes produced under a 16 KiB send buffer");
        // hyper's default (400 KiB) for contrast, 421 KiB measured: the
        // client's window is no limit.
        let uncapped = produced_for_a_reader_that_stops(400 * 1024).await;
        assert!(uncapped >= 300 * 1024, "{uncapped} bytes produced under a 400 KiB send buffer");
    }
}
