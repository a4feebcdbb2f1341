//! The small HTTP/1.1 servers the daemon runs on listeners inside a
//! sandbox's network namespace (the tool-call gate's endpoint, the
//! credential gateway): one accept task, every connection on that task's
//! own set, so dropping the [`Served`] handle closes the listener and
//! every connection at once.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// Refusals (503) being written at once by one server; a connection past
/// both caps is closed without an answer (still told to [`Admission::refused`]),
/// so refusing costs a bounded number of descriptors too.
pub const MAX_REFUSING: usize = 16;

/// A server's task; dropping it ends the server and its connections.
pub struct Served {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a connection costs beyond its server: a share of a wider budget,
/// held while the connection is served.
pub type Charge = Box<dyn Fn() -> Result<Box<dyn Send>, String> + Send + Sync>;

/// How a server that must never make a client wait takes connections: at
/// most `max_connections` at once, each charged to a wider budget; a
/// connection past either is answered 503 with the reason and closed.
pub struct Admission {
    /// Connections served at once.
    pub max_connections: usize,
    /// Why a connection past `max_connections` is refused.
    pub full: String,
    /// Takes one connection's share of a wider budget (the daemon's), or says why not.
    pub charge: Charge,
    /// Told why each refused connection was refused (to record it).
    pub refused: Box<dyn Fn(&str) + Send + Sync>,
}

/// Serves `handle` on `listener`: at most `max_connections` at once (more
/// wait to be accepted), each given `header_timeout` to send a request head.
pub fn serve_http1<H, F, B>(
    listener: tokio::net::TcpListener,
    max_connections: usize,
    header_timeout: Duration,
    handle: H,
) -> Served
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(max_connections));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else { return };
            let Some(stream) = accept(&listener, &mut connections).await else { continue };
            connections.spawn(connection(stream, handle.clone(), header_timeout, permit));
        }
    });
    Served { task }
}

/// Serves `handle` on `listener` as `admission` says: a connection within
/// its caps is served (given `header_timeout` to send a request head), one
/// past them is answered 503 at once, never left waiting in the backlog.
pub fn serve_http1_admitted<H, F, B>(
    listener: tokio::net::TcpListener,
    admission: Admission,
    header_timeout: Duration,
    handle: H,
) -> Served
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(admission.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Some(stream) = accept(&listener, &mut connections).await else { continue };
            let admitted = match slots.clone().try_acquire_owned() {
                Ok(slot) => (admission.charge)().map(|share| (slot, share)),
                Err(_) => Err(admission.full.clone()),
            };
            match admitted {
                Ok(held) => {
                    connections.spawn(connection(stream, handle.clone(), header_timeout, held));
                }
                Err(reason) => {
                    (admission.refused)(&reason);
                    // Past the refusals in flight too: closed unanswered.
                    if let Ok(refusal) = refusing.clone().try_acquire_owned() {
                        connections.spawn(async move {
                            refuse(stream, &reason).await;
                            drop(refusal);
                        });
                    }
                }
            }
        }
    });
    Served { task }
}

/// The next connection, reaping finished ones while waiting; `None` when
/// there is none yet (a reaped connection, or a failed accept after a
/// short back-off).
async fn accept(listener: &tokio::net::TcpListener, connections: &mut JoinSet<()>) -> Option<TcpStream> {
    tokio::select! {
        accepted = listener.accept() => match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                Some(stream)
            }
            Err(_) => {
                // EMFILE and friends: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(50)).await;
                None
            }
        },
        Some(_) = connections.join_next(), if !connections.is_empty() => None,
    }
}

/// One connection served by hyper; `held` is given back when it ends.
async fn connection<H, F, B, P>(stream: TcpStream, handle: H, header_timeout: Duration, held: P)
where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let answer = handle(req);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
        .await;
    drop(held);
}

/// Answers 503 with `reason`, then closes; what the client already sent is
/// drained briefly first, so closing does not reset the connection before
/// the client has read the answer.
async fn refuse(mut stream: TcpStream, reason: &str) {
    let body = format!("{reason}\n");
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 64 * 1024 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}
