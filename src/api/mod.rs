//! The gRPC edge: thin services over the engine, one server builder that
//! registers them with health and reflection (v1 and v1alpha, since
//! grpcurl 1.8 speaks only v1alpha).

mod audit;
mod auth;
mod catalog;
mod convert;
mod execution;
mod limits;
pub mod page;
mod serve;
mod session;
pub mod status;
mod streams_end;
mod unix;
mod validate;
pub mod wire;
pub mod words;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

pub use catalog::CatalogApi;
pub use convert::{limits_from_wire, wire_limits};
pub use execution::ExecutionApi;
pub use session::SessionApi;

use crate::catalog::Catalog;
use crate::lifecycle::Engine;
use crate::pb;
use crate::pb_wire::catalog_service_server::CatalogServiceServer;
use crate::pb_wire::execution_service_server::ExecutionServiceServer;
use crate::pb_wire::session_service_server::SessionServiceServer;
use crate::policy::Gate;
use streams_end::StreamsEnd;

/// Everything [`serve`] needs besides its listener.
pub struct ApiParts {
    /// The principals in force (replaced on reload), used to identify every call.
    pub authenticator: Arc<crate::auth::Principals>,
    /// The unix socket to serve on too (peer uid → principal), and the
    /// group that may connect (mode 0660).
    pub unix_socket: Option<(PathBuf, Option<u32>)>,
    /// TLS for the TCP listener (with a client CA: mTLS).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// The engine the services call.
    pub engine: Arc<Engine>,
    /// The profiles the daemon loaded.
    pub catalog: Arc<Catalog>,
    /// The policy gate, for CatalogService's dry runs.
    pub gate: Arc<Gate>,
    /// The daemon's `repo_roots`: a request's repository must be under one.
    pub repo_roots: Vec<PathBuf>,
    /// How long in-flight executions may run on after shutdown begins before
    /// they are cancelled and torn down.
    pub shutdown_grace: Duration,
    /// The server's limits (`[grpc]`).
    pub grpc: crate::config::GrpcConfig,
    /// Signs and checks the listings' page tokens.
    pub page_tokens: Arc<page::PageTokens>,
}

/// Why the gRPC server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Building the reflection service failed.
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The unix socket could not be set up.
    #[error("unix socket {path}: {source}")]
    Socket {
        /// The socket's path.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
}

/// Serves every service on `listener` until `shutdown` is cancelled, then
/// drains: health goes NOT_SERVING, new work gets UNAVAILABLE, in-flight
/// executions get the grace period, then are cancelled and torn down, and
/// every stream ends.
pub async fn serve(parts: ApiParts, listener: TcpListener, shutdown: CancellationToken) -> Result<(), ServeError> {
    // No sandbox's egress proxy ever connects to this daemon while it
    // listens.
    let _protected = listener.local_addr().ok().map(crate::net::protect);
    let (health, health_service) = health().await;
    let streams_end = StreamsEnd::default();
    let drained = drain(shutdown, health, parts.engine.clone(), parts.shutdown_grace, streams_end.clone());
    let unix = match &parts.unix_socket {
        Some((path, group)) => Some(unix::bind(path, *group)?),
        None => None,
    };
    let (grpc, tls) = (parts.grpc.clone(), parts.tls.clone());
    let routes = routes(parts, health_service, streams_end)?;
    listen(routes, &grpc, tls, listener, unix, drained).await
}

/// The health service, every corral service SERVING.
async fn health() -> (
    tonic_health::server::HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<ExecutionServiceServer<ExecutionApi>>().await;
    health.set_serving::<CatalogServiceServer<CatalogApi>>().await;
    health.set_serving::<SessionServiceServer<SessionApi>>().await;
    (health, health_service)
}

/// Reflection v1 and v1alpha (grpcurl 1.8 speaks only v1alpha), each
/// listing every service.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        // Each builder adds only its own protocol's file; register both
        // so either reflection version lists both services.
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
}

/// Every route: health and reflection open; the three corral services
/// sized by `[grpc]`, each behind authentication and the audit/trace layer.
fn routes(
    parts: ApiParts,
    health: impl tower::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    streams_end: StreamsEnd,
) -> Result<tonic::service::Routes, ServeError> {
    let execution = ExecutionApi {
        engine: parts.engine.clone(),
        repo_roots: parts.repo_roots,
        shutdown: streams_end.clone(),
        page_tokens: parts.page_tokens.clone(),
    };
    let sessions = SessionApi {
        engine: parts.engine.clone(),
        repo_roots: execution.repo_roots.clone(),
        shutdown: streams_end,
        page_tokens: parts.page_tokens,
    };
    let catalog = CatalogApi {
        catalog: parts.catalog,
        gate: parts.gate,
        repo_roots: execution.repo_roots.clone(),
        store: parts.engine.store.clone(),
        engine: parts.engine.clone(),
    };
    let grpc = &parts.grpc;
    let execution = limits::sized!(ExecutionServiceServer::new(execution), grpc);
    let catalog = limits::sized!(CatalogServiceServer::new(catalog), grpc);
    let sessions = limits::sized!(SessionServiceServer::new(sessions), grpc);
    let authenticate = auth::Authenticate(parts.authenticator);
    Ok(tonic::service::Routes::new(health)
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .add_service(audit::Audited(InterceptedService::new(execution, authenticate.clone())))
        .add_service(audit::Audited(InterceptedService::new(catalog, authenticate.clone())))
        .add_service(audit::Audited(InterceptedService::new(sessions, authenticate))))
}

/// Waits for `shutdown`, then drains (see [`serve`]).
async fn drain(
    shutdown: CancellationToken,
    health: tonic_health::server::HealthReporter,
    engine: Arc<Engine>,
    grace: Duration,
    streams_end: StreamsEnd,
) {
    // A drain without a shutdown (a DrainNode of this node, its fleet row
    // marked draining) takes no new work either: probes see it at once.
    let started = engine.drain_started();
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = started.cancelled() => {
            not_serving(&health).await;
            shutdown.cancelled().await;
        }
    }
    tracing::info!(grace_seconds = grace.as_secs(), "shutting down: draining");
    not_serving(&health).await;
    engine.start_draining();
    engine.shutdown(grace).await;
    streams_end.end();
    tracing::info!("drained");
}

/// Every corral service, and the server as a whole, NOT_SERVING.
async fn not_serving(health: &tonic_health::server::HealthReporter) {
    health.set_not_serving::<ExecutionServiceServer<ExecutionApi>>().await;
    health.set_not_serving::<CatalogServiceServer<CatalogApi>>().await;
    health.set_not_serving::<SessionServiceServer<SessionApi>>().await;
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
}

/// Serves `routes` on TCP (with TLS when configured) and on the unix
/// socket, both with the `[grpc]` limits, until `drained` completes.
async fn listen(
    routes: tonic::service::Routes,
    grpc: &crate::config::GrpcConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
    listener: TcpListener,
    unix: Option<(tokio::net::UnixListener, PathBuf)>,
    drained: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let drain_done = CancellationToken::new();
    let done = drain_done.clone();
    let drained = async move {
        drained.await;
        done.cancel();
    };
    // Lifecycle events are small frames: without TCP_NODELAY each waits
    // on Nagle and the peer's delayed ACK (tens of ms per Execute).
    let accepted = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.and_then(|(stream, _)| stream.set_nodelay(true).map(|()| stream));
        Some((accepted, listener))
    });
    let tcp = serve::serve(accepted, routes.clone(), grpc, tls, drained);
    let Some((listener, path)) = unix else {
        tcp.await;
        return Ok(());
    };
    let on_unix = serve::serve(unix::incoming(listener), routes, grpc, None, drain_done.cancelled_owned());
    tokio::join!(tcp, on_unix);
    let _ = std::fs::remove_file(&path);
    Ok(())
}
