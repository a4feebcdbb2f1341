//! The gate endpoint inside one sandbox: HTTP/1.1 on a listener the daemon
//! opened in the sandbox's network namespace. Each `POST /v1/pre-tool-use`
//! becomes a [`HookRequest`] for the rein, which asks the tool_call gate
//! and replies; the hook's answer is always `200` with a verdict, and
//! everything that is not a clean allow is a deny (a malformed call, a
//! body too large, a run that is no longer taking calls).

use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use tokio::sync::{mpsc, oneshot};

use super::hook::{parse_call, HookCall, Verdict};
use super::HOOK_PATH;

/// The largest hook body read (a `Write` carries the whole file).
pub const MAX_BODY: usize = 16 << 20;
/// Connections served at once; more wait for a slot.
const MAX_CONNECTIONS: usize = 16;

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
    crate::net::server::serve_http1(listener, MAX_CONNECTIONS, Duration::from_secs(10), move |req| {
        let calls = calls.clone();
        async move { respond(req, &calls).await }
    })
}

async fn respond(req: Request<Incoming>, calls: &mpsc::Sender<HookRequest>) -> Response<Full<Bytes>> {
    if req.uri().path() != HOOK_PATH || req.method() != hyper::Method::POST {
        let mut response = Response::new(Full::new(Bytes::from_static(b"not found\n")));
        *response.status_mut() = StatusCode::NOT_FOUND;
        return response;
    }
    let verdict = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Err(_) => Verdict::deny(format!("corral's gate refused the call: its hook body is over {MAX_BODY} bytes")),
        Ok(body) => match parse_call(&body.to_bytes()) {
            Err(why) => Verdict::deny(format!("corral's gate refused the call: {why}")),
            Ok(call) => decide(call, calls).await,
        },
    };
    let mut response = Response::new(Full::new(Bytes::from(verdict.answer().to_string())));
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    response
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
