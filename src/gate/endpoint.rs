//! The gate endpoint inside one sandbox: HTTP/1.1 on a listener the daemon
//! opened in the sandbox's network namespace. Each `POST /v1/pre-tool-use`
//! becomes a [`HookRequest`] for the rein, which asks the tool_call gate
//! and replies; the hook's answer is always `200` with a verdict, and
//! everything that is not a clean allow is a deny (a malformed call, a
//! body too large, a run that is no longer taking calls).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::hook::{parse_call, HookCall, Verdict};
use super::HOOK_PATH;

/// The largest hook body read (a `Write` carries the whole file).
pub const MAX_BODY: usize = 16 << 20;
/// Connections served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;
/// The hook bytes one sandbox may have in the daemon's memory at once:
/// read, or held until their call is answered. The daemon's memory, not
/// the sandbox's cgroup's: without it 16 connections of 16 MiB bodies
/// held while an approval waits would be half a GiB per sandbox. A body
/// past it is denied (its own sandbox's call only).
pub const BODY_BUDGET: usize = 2 * MAX_BODY;
/// How long a hook body may take to arrive once its head has.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// One call waiting for the gate's verdict.
pub struct HookRequest {
    /// The tool call the hook asks about.
    pub call: HookCall,
    /// Where the rein sends the verdict; dropping it denies the call.
    pub reply: oneshot::Sender<Verdict>,
}

/// The endpoint; dropping it closes the listener and every connection (a
/// hook still waiting gets no answer, which its CLI treats as a failure
/// and so as a block).
pub type Endpoint = crate::net::server::Served;

/// Serves hook calls from `listener` into `calls`.
pub fn serve(listener: tokio::net::TcpListener, calls: mpsc::Sender<HookRequest>) -> Endpoint {
    serve_within(listener, calls, BODY_BUDGET, BODY_TIMEOUT)
}

/// [`serve`] with its body budget and timeout given (tests).
fn serve_within(
    listener: tokio::net::TcpListener,
    calls: mpsc::Sender<HookRequest>,
    budget: usize,
    timeout: Duration,
) -> Endpoint {
    let budget = (Arc::new(Semaphore::new(budget)), budget);
    crate::net::server::serve_http1(listener, MAX_CONNECTIONS, Duration::from_secs(10), move |req| {
        let (calls, budget) = (calls.clone(), budget.clone());
        async move { respond(req, &calls, &budget, timeout).await }
    })
}

async fn respond(
    req: Request<Incoming>,
    calls: &mpsc::Sender<HookRequest>,
    budget: &(Arc<Semaphore>, usize),
    timeout: Duration,
) -> Response<Full<Bytes>> {
    if req.uri().path() != HOOK_PATH || req.method() != hyper::Method::POST {
        let mut response = Response::new(Full::new(Bytes::from_static(b"not found\n")));
        *response.status_mut() = StatusCode::NOT_FOUND;
        return response;
    }
    let verdict = match read_body(req.into_body(), budget, timeout).await {
        Err(why) => Verdict::deny(format!("corral's gate refused the call: {why}")),
        // The budget's share is held until the call is answered: the
        // parsed call grows with its body.
        Ok((body, _share)) => {
            let parsed = parse_call(&body);
            drop(body);
            match parsed {
                Err(why) => Verdict::deny(format!("corral's gate refused the call: {why}")),
                Ok(call) => decide(call, calls).await,
            }
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(verdict.answer().to_string())));
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    response
}

/// A hook body, at most [`MAX_BODY`] bytes, each charged to `budget` as it
/// arrives (the share comes back when the returned permit drops), within
/// `timeout`.
async fn read_body(
    mut body: Incoming,
    (budget, size): &(Arc<Semaphore>, usize),
    timeout: Duration,
) -> Result<(Vec<u8>, Option<OwnedSemaphorePermit>), String> {
    let mut bytes = Vec::new();
    let mut share: Option<OwnedSemaphorePermit> = None;
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("its hook body could not be read: {e}"))?;
            let Ok(data) = frame.into_data() else { continue };
            if bytes.len().saturating_add(data.len()) > MAX_BODY {
                return Err(format!("its hook body is over {MAX_BODY} bytes"));
            }
            let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
            let more = budget.clone().try_acquire_many_owned(n).map_err(|_| {
                format!("this sandbox's hook calls would hold over {size} bytes of the daemon's memory at once")
            })?;
            match &mut share {
                Some(share) => share.merge(more),
                None => share = Some(more),
            }
            bytes.extend_from_slice(&data);
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(())) => Ok((bytes, share)),
        Ok(Err(why)) => Err(why),
        Err(_) => Err(format!("its hook body took over {timeout:?} to arrive")),
    }
}

async fn decide(call: HookCall, calls: &mpsc::Sender<HookRequest>) -> Verdict {
    let (reply, answer) = oneshot::channel();
    if calls.send(HookRequest { call, reply }).await.is_err() {
        return Verdict::deny("corral is not taking tool calls now (the run is ending)");
    }
    answer.await.unwrap_or_else(|_| Verdict::deny("corral is not taking tool calls now (the run is ending)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        let status = text[9..12].parse().unwrap();
        (status, text.split_once("\r\n\r\n").unwrap().1.to_string())
    }

    #[tokio::test]
    async fn calls_reach_the_gate_and_everything_else_is_denied() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let endpoint = serve(listener, tx);
        tokio::spawn(async move {
            while let Some(HookRequest { call, reply }) = rx.recv().await {
                let verdict = if call.tool == "Bash" { Verdict::deny("no Bash") } else { Verdict::allow() };
                let _ = reply.send(verdict);
            }
        });
        let call = |tool: &str| json!({"hook_event_name": "PreToolUse", "tool_name": tool, "tool_input": {}});
        let (status, body) = post(addr, HOOK_PATH, &call("Write").to_string()).await;
        assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({})));
        let (_, body) = post(addr, HOOK_PATH, &call("Bash").to_string()).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["hookSpecificOutput"]["permissionDecision"], "deny");
        assert_eq!(body["hookSpecificOutput"]["permissionDecisionReason"], "no Bash");
        let (_, body) = post(addr, HOOK_PATH, "{\"hook_event_name\":\"PreToolUse\"}").await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["hookSpecificOutput"]["permissionDecision"], "deny", "a malformed call is denied");
        assert_eq!(post(addr, "/other", "{}").await.0, 404);
        drop(endpoint);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "dropping the endpoint closes it");
    }

    /// What one sandbox's hook calls hold of the daemon's memory is
    /// bounded: a body past the budget, while another call holds its share
    /// waiting for its answer, is denied, and the share comes back with
    /// that answer; a body that does not arrive is denied at its timeout.
    #[tokio::test]
    async fn a_sandbox_s_hook_bodies_are_bounded_in_bytes_and_in_time() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let _endpoint = serve_within(listener, tx, 1000, Duration::from_millis(300));
        let call = |pad: usize| {
            json!({"hook_event_name": "PreToolUse", "tool_name": "Write", "tool_input": {"content": "x".repeat(pad)}})
                .to_string()
        };
        let decision = |body: &str| {
            let body: Value = serde_json::from_str(body).unwrap();
            (
                body["hookSpecificOutput"]["permissionDecision"].clone(),
                body["hookSpecificOutput"]["permissionDecisionReason"].clone(),
            )
        };
        let held = tokio::spawn(async move { post(addr, HOOK_PATH, &call(500)).await });
        let waiting = rx.recv().await.expect("the first call reaches the gate");
        let over = tokio::time::timeout(Duration::from_secs(5), post(addr, HOOK_PATH, &call(500))).await;
        let (_, body) = over.expect("a body past the budget is answered at once, not queued for the gate");
        assert_eq!(
            decision(&body),
            (
                json!("deny"),
                json!("corral's gate refused the call: this sandbox's hook calls would hold over 1000 bytes of the daemon's memory at once")
            )
        );
        waiting.reply.send(Verdict::allow()).unwrap();
        assert_eq!(held.await.unwrap().1, "{}", "the first call is answered as its gate said");
        let answering = tokio::spawn(async move {
            while let Some(HookRequest { reply, .. }) = rx.recv().await {
                let _ = reply.send(Verdict::allow());
            }
        });
        assert_eq!(post(addr, HOOK_PATH, &call(500)).await.1, "{}", "its share came back with its answer");
        // A head that promises 100 bytes, then 10 of them.
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("POST {HOOK_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(b"{\"tool_nam").await.unwrap();
        let mut text = String::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut text)).await;
        assert!(read.is_ok(), "a body that never arrives is answered at its timeout");
        let body = text.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(
            decision(body),
            (json!("deny"), json!("corral's gate refused the call: its hook body took over 300ms to arrive"))
        );
        answering.abort();
    }

    /// A hook that goes away while its call waits (its CLI gave up, or
    /// died) closes the call's reply: the gate sees it and withdraws it.
    #[tokio::test]
    async fn a_hook_that_hangs_up_closes_its_reply() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let _endpoint = serve(listener, tx);
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let body = json!({"hook_event_name": "PreToolUse", "tool_name": "Write", "tool_input": {}}).to_string();
        let request = format!(
            "POST {HOOK_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut waiting = rx.recv().await.expect("the call reaches the gate");
        assert!(!waiting.reply.is_closed());
        drop(stream);
        let closed = tokio::time::timeout(Duration::from_secs(5), waiting.reply.closed()).await;
        assert!(closed.is_ok(), "the reply of a call whose hook hung up is still open");
    }

    #[tokio::test]
    async fn a_run_that_stops_taking_calls_denies() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::channel(4);
        let _endpoint = serve(listener, tx);
        drop(rx);
        let call = json!({"hook_event_name": "PreToolUse", "tool_name": "Write"});
        let (_, body) = post(addr, HOOK_PATH, &call.to_string()).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["hookSpecificOutput"]["permissionDecision"], "deny");
    }
}
