//! The hook helper: the corral binary, bound read-only inside the sandbox
//! as `/etc/corral/corral-gate-hook`, which Codex runs before every tool
//! call. It forwards the call (JSON on stdin) to the gate endpoint on the
//! sandbox's loopback and prints the answer. Any failure prints a deny: a
//! helper that cannot reach the gate blocks the call.
//!
//! Plain blocking std I/O, no runtime: it runs once per call, inside the
//! sandbox's seccomp filter.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use super::endpoint::MAX_BODY;
use super::hook::Verdict;
use super::{GATE_PORT, HOOK_PATH};

/// The largest answer read back.
const MAX_ANSWER: u64 = 1 << 20;

/// Runs the helper: reads the call, prints the answer; always exits 0 (the
/// answer, not the status, carries the decision).
pub fn run() -> i32 {
    let answer = forward(std::io::stdin().lock()).unwrap_or_else(|e| {
        Verdict::deny(format!("corral's gate cannot be reached, so the call is blocked: {e}")).answer().to_string()
    });
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(answer.as_bytes());
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    0
}

fn forward(input: impl Read) -> std::io::Result<String> {
    let mut body = Vec::new();
    input.take(MAX_BODY as u64 + 1).read_to_end(&mut body)?;
    if body.len() > MAX_BODY {
        return Err(std::io::Error::other(format!("the call is over {MAX_BODY} bytes")));
    }
    post(SocketAddr::from((Ipv4Addr::LOCALHOST, GATE_PORT)), &body)
}

/// One `POST` with `Connection: close`; the answer's body when the status
/// is 200. No read timeout: an approval may take minutes, and the CLI's own
/// hook timeout bounds the wait.
pub fn post(addr: SocketAddr, body: &[u8]) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    let head = format!(
        "POST {HOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut response = Vec::new();
    stream.take(MAX_ANSWER).read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    let (head, answer) = text.split_once("\r\n\r\n").ok_or_else(|| std::io::Error::other("a truncated answer"))?;
    if !head.starts_with("HTTP/1.1 200 ") {
        let status = head.lines().next().unwrap_or_default();
        return Err(std::io::Error::other(format!("the gate answered {status:?}")));
    }
    serde_json::from_str::<serde_json::Value>(answer)
        .map_err(|e| std::io::Error::other(format!("the gate's answer is not JSON: {e}")))?;
    Ok(answer.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::{serve, HookRequest};
    use serde_json::{json, Value};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_helper_carries_the_call_and_the_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let _endpoint = serve(listener, tx);
        tokio::spawn(async move {
            while let Some(HookRequest { call, reply }) = rx.recv().await {
                let _ = reply.send(Verdict::deny(format!("no {}", call.tool)));
            }
        });
        let call = json!({"hook_event_name": "PreToolUse", "tool_name": "Bash", "tool_input": {"command": "ls"}});
        let answer = tokio::task::spawn_blocking(move || post(addr, call.to_string().as_bytes())).await.unwrap();
        let answer: Value = serde_json::from_str(&answer.unwrap()).unwrap();
        assert_eq!(answer["hookSpecificOutput"]["permissionDecisionReason"], "no Bash");
    }

    #[test]
    fn a_gate_that_is_not_there_is_an_error_the_helper_turns_into_a_deny() {
        // A port nothing listens on: bind one, then close it.
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert!(post(addr, b"{}").is_err());
        let deny: Value = serde_json::from_str(
            &Verdict::deny("corral's gate cannot be reached, so the call is blocked: x").answer().to_string(),
        )
        .unwrap();
        assert_eq!(deny["hookSpecificOutput"]["permissionDecision"], "deny");
    }
}
