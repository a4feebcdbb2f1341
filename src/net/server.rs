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
use tokio::task::JoinSet;

/// A server's task; dropping it ends the server and its connections.
pub struct Served {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `handle` on `listener`: at most `max_connections` at once (more
/// wait to be accepted; `None`: no bound), each given `header_timeout` to
/// send a request head.
pub fn serve_http1<H, F, B>(
    listener: tokio::net::TcpListener,
    max_connections: Option<usize>,
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
    let slots = max_connections.map(|max| Arc::new(tokio::sync::Semaphore::new(max)));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let permit = match &slots {
                Some(slots) => match slots.clone().acquire_owned().await {
                    Ok(permit) => Some(permit),
                    Err(_) => return,
                },
                None => None,
            };
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                // Reap finished connections while waiting.
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            };
            let _ = stream.set_nodelay(true);
            let handle = handle.clone();
            connections.spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let answer = handle(req);
                    async move { Ok::<_, Infallible>(answer.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                drop(permit);
            });
        }
    });
    Served { task }
}
