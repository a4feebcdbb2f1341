//! A scripted model server on 127.0.0.1 for tests of the real agent CLIs:
//! the Anthropic Messages streaming API (`POST .../v1/messages`) and the
//! OpenAI Responses streaming API (`POST .../responses`). Each model request
//! gets the next [`Step`] of the script, as a server-sent event stream (or
//! an HTTP error); every request is kept for the test to inspect. A request
//! past the end of the script gets a 400 saying so, so a run that asks for
//! more than the test planned fails visibly. [`ModelMock::failing`] answers
//! every request with one error: CLIs retry some errors with other
//! settings (Claude Code retries a 400 without its beta features).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// The model the mock says it is (what `resolved_model` must be).
pub const CLAUDE_MODEL: &str = "claude-mock-1";
pub const OPENAI_MODEL: &str = "gpt-mock-1";

/// The usage every Anthropic reply reports: input, output, cache read,
/// cache creation (disjoint, as the Messages API counts them).
pub const CLAUDE_USAGE: [u64; 4] = [120, 45, 1500, 30];
/// The usage every OpenAI reply reports: input (of which `cached` came
/// from the cache, as the Responses API counts them) and output.
pub const OPENAI_INPUT: u64 = 1200;
pub const OPENAI_CACHED: u64 = 1000;
pub const OPENAI_OUTPUT: u64 = 45;

/// One scripted model reply.
#[derive(Clone, Debug)]
pub enum Step {
    /// The model calls a tool (Anthropic `tool_use`, OpenAI `function_call`).
    Tool { name: String, input: Value },
    /// The model answers with text and ends its turn.
    Text(String),
    /// The API answers with an HTTP error.
    Error { status: u16, kind: String, message: String },
}

impl Step {
    pub fn tool(name: &str, input: Value) -> Step {
        Step::Tool { name: name.into(), input }
    }

    pub fn text(text: &str) -> Step {
        Step::Text(text.into())
    }

    pub fn error(status: u16, kind: &str, message: &str) -> Step {
        Step::Error { status, kind: kind.into(), message: message.into() }
    }
}

/// A request the mock received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Shared {
    script: VecDeque<Step>,
    /// Answers every request once the script is used up.
    always: Option<Step>,
    seen: Vec<Seen>,
    /// Called with each model request's index before it is answered.
    on_request: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    /// Tokens of the successful replies served so far.
    tokens: u64,
    replies: u64,
}

pub struct ModelMock {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    task: tokio::task::JoinHandle<()>,
    /// With TLS: the PEM of the test CA its certificate chains to.
    pub ca_pem: Option<String>,
}

impl Drop for ModelMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ModelMock {
    pub async fn start(script: Vec<Step>) -> ModelMock {
        Self::with(Shared { script: script.into(), ..Shared::default() }).await
    }

    /// A model API that answers every request with `error`.
    pub async fn failing(error: Step) -> ModelMock {
        Self::with(Shared { always: Some(error), ..Shared::default() }).await
    }

    async fn with(shared: Shared) -> ModelMock {
        Self::serving(shared, None).await
    }

    /// The same API over TLS, with a certificate for 127.0.0.1 from a test
    /// CA made here ([`ModelMock::ca_pem`]).
    pub async fn start_tls(script: Vec<Step>) -> ModelMock {
        let (acceptor, ca_pem) = loopback_tls();
        let shared = Shared { script: script.into(), ..Shared::default() };
        let mut mock = Self::serving(shared, Some(acceptor)).await;
        mock.ca_pem = Some(ca_pem);
        mock
    }

    async fn serving(shared: Shared, tls: Option<tokio_rustls::TlsAcceptor>) -> ModelMock {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the model mock");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Mutex::new(shared));
        let state = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (state, tls) = (state.clone(), tls.clone());
                tokio::spawn(async move {
                    let _ = socket.set_nodelay(true);
                    match tls {
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(socket).await {
                                let _ = serve(stream, state).await;
                            }
                        }
                        None => {
                            let _ = serve(socket, state).await;
                        }
                    }
                });
            }
        });
        ModelMock { addr, shared, task, ca_pem: None }
    }

    /// `http://127.0.0.1:<port>` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.ca_pem.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.shared.lock().unwrap().seen.clone()
    }

    /// The model requests (POSTs) received.
    pub fn model_requests(&self) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.method == "POST").collect()
    }

    /// Every token the mock's successful replies reported, summed the way
    /// the API bills them (cache tokens included).
    pub fn tokens_served(&self) -> u64 {
        self.shared.lock().unwrap().tokens
    }

    pub fn replies(&self) -> u64 {
        self.shared.lock().unwrap().replies
    }

    /// Runs `hook` with each model request's index (from 0) before the
    /// reply is sent.
    pub fn on_request(&self, hook: impl Fn(u64) + Send + Sync + 'static) {
        self.shared.lock().unwrap().on_request = Some(Arc::new(hook));
    }

    /// Adds steps to the script (for a script that needs the mock's
    /// address).
    pub fn then(&self, steps: Vec<Step>) {
        self.shared.lock().unwrap().script.extend(steps);
    }

    /// Steps not used yet.
    pub fn unused(&self) -> usize {
        self.shared.lock().unwrap().script.len()
    }
}

/// A TLS server identity for 127.0.0.1 from a test CA made here: the
/// acceptor, and the CA's PEM for the client to trust.
pub fn loopback_tls() -> (tokio_rustls::TlsAcceptor, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "corral test CA");
    ca.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &rcgen::Issuer::from_params(&ca, &ca_key)).unwrap();
    let chain = vec![rustls::pki_types::CertificateDer::from(cert.der().to_vec())];
    let private = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca_pem)
}

/// One connection: requests until the client closes or asks to.
async fn serve<S>(socket: S, shared: Arc<Mutex<Shared>>) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut reader = BufReader::new(socket);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).await? == 0 {
            return Ok(());
        }
        let mut parts = request_line.split_whitespace();
        let (method, path) =
            (parts.next().unwrap_or_default().to_string(), parts.next().unwrap_or_default().to_string());
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await? == 0 {
                return Ok(());
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
            }
        }
        let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            read_chunked(&mut reader).await?
        } else {
            let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0u8; len];
            reader.read_exact(&mut body).await?;
            body
        };
        let close = header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
        let seen = Seen { method, path, headers, body: serde_json::from_slice(&body).unwrap_or(Value::Null) };
        let response = respond(&seen, &shared);
        shared.lock().unwrap().seen.push(seen);
        reader.get_mut().write_all(&response).await?;
        reader.get_mut().flush().await?;
        if close {
            return Ok(());
        }
    }
}

async fn read_chunked<S: tokio::io::AsyncRead + Unpin>(reader: &mut BufReader<S>) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).await?;
        let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
        let mut chunk = vec![0u8; size + 2];
        reader.read_exact(&mut chunk).await?;
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&chunk[..size]);
    }
}

fn http(status: u16, content_type: &str, body: &str) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        _ => "Error",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

enum Api {
    Anthropic,
    OpenAi,
}

fn respond(seen: &Seen, shared: &Mutex<Shared>) -> Vec<u8> {
    let path = seen.path.split('?').next().unwrap_or_default();
    let api = match (seen.method.as_str(), path) {
        ("POST", p) if p.ends_with("/messages") => Api::Anthropic,
        ("POST", p) if p.ends_with("/responses") => Api::OpenAi,
        _ => return http(404, "application/json", r#"{"error":{"message":"the model mock has no such endpoint"}}"#),
    };
    let hook = shared.lock().unwrap().on_request.clone();
    if let Some(hook) = hook {
        let n = shared.lock().unwrap().replies;
        hook(n);
    }
    let mut shared = shared.lock().unwrap();
    let step = shared.script.pop_front().or_else(|| shared.always.clone()).unwrap_or_else(|| {
        Step::error(400, "invalid_request_error", "model mock: no scripted reply left for this request")
    });
    let n = shared.replies;
    shared.replies += 1;
    match (step, api) {
        (Step::Error { status, kind, message }, Api::Anthropic) => {
            let body = json!({"type": "error", "error": {"type": kind, "message": message}});
            http(status, "application/json", &body.to_string())
        }
        (Step::Error { status, kind, message }, Api::OpenAi) => {
            let body = json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
            http(status, "application/json", &body.to_string())
        }
        (step, Api::Anthropic) => {
            shared.tokens += CLAUDE_USAGE.iter().sum::<u64>();
            http(200, "text/event-stream", &anthropic_stream(&step, n))
        }
        (step, Api::OpenAi) => {
            shared.tokens += OPENAI_INPUT + OPENAI_OUTPUT;
            http(200, "text/event-stream", &openai_stream(&step, n))
        }
    }
}

fn sse(events: &[(&str, Value)]) -> String {
    events.iter().map(|(name, data)| format!("event: {name}\ndata: {data}\n\n")).collect()
}

/// A Messages API stream: `message_start` (with the input and cache usage),
/// one content block, `message_delta` (stop reason, output usage),
/// `message_stop`.
fn anthropic_stream(step: &Step, n: u64) -> String {
    let [input, output, cache_read, cache_creation] = CLAUDE_USAGE;
    let start = json!({"type": "message_start", "message": {
        "id": format!("msg_mock_{n:04}"), "type": "message", "role": "assistant", "model": CLAUDE_MODEL,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": input, "output_tokens": 1, "cache_read_input_tokens": cache_read,
                  "cache_creation_input_tokens": cache_creation}}});
    let (block, delta, stop_reason) = match step {
        Step::Tool { name, input } => (
            json!({"type": "tool_use", "id": format!("toolu_mock_{n:04}"), "name": name, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": input.to_string()}),
            "tool_use",
        ),
        Step::Text(text) => {
            (json!({"type": "text", "text": ""}), json!({"type": "text_delta", "text": text}), "end_turn")
        }
        Step::Error { .. } => unreachable!("errors are not streamed"),
    };
    sse(&[
        ("message_start", start),
        ("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": block})),
        ("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": delta})),
        ("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                   "usage": {"output_tokens": output}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ])
}

/// A Responses API stream: `response.created`, one output item added and
/// done, `response.completed` with the usage.
fn openai_stream(step: &Step, n: u64) -> String {
    let id = format!("resp_mock_{n:04}");
    let item = match step {
        Step::Tool { name, input } => json!({"type": "function_call", "id": format!("fc_mock_{n:04}"),
            "call_id": format!("call_mock_{n:04}"), "name": name, "arguments": input.to_string(), "status": "completed"}),
        Step::Text(text) => json!({"type": "message", "id": format!("msg_mock_{n:04}"), "role": "assistant",
            "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}),
        Step::Error { .. } => unreachable!("errors are not streamed"),
    };
    let response = |status: &str, output: Value, usage: Value| json!({"id": id, "object": "response", "status": status, "model": OPENAI_MODEL, "output": output, "usage": usage});
    let usage = json!({"input_tokens": OPENAI_INPUT, "input_tokens_details": {"cached_tokens": OPENAI_CACHED},
        "output_tokens": OPENAI_OUTPUT, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": OPENAI_INPUT + OPENAI_OUTPUT});
    let events = [
        json!({"type": "response.created", "sequence_number": 0, "response": response("in_progress", json!([]), Value::Null)}),
        json!({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": item}),
        json!({"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": item}),
        json!({"type": "response.completed", "sequence_number": 3, "response": response("completed", json!([item]), usage)}),
    ];
    events.iter().map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or_default())).collect()
}
