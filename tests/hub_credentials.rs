//! What leaves the daemon: hub reports through the outbox, against a real
//! HTTP hub on 127.0.0.1 started by the test, and credential values that
//! never leak.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{finished, request, require_bwrap, Options, ServeProcess, TestDaemon};
use corral::hub::HubConfig;
use corral::pb::{self, execution_service_client::ExecutionServiceClient, lifecycle_event::Kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Clone, Copy)]
enum Answer {
    Status(u16),
    Hang,
}

/// A hub that records every POST and answers as told.
#[derive(Clone)]
struct TestHub {
    url: String,
    port: u16,
    requests: Arc<Mutex<Vec<(String, String)>>>,
}

impl TestHub {
    async fn start(answer: Answer) -> TestHub {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), answer)
    }

    fn start_on(listener: TcpListener, answer: Answer) -> TestHub {
        Self::serving(listener, answer, None)
    }

    /// The same hub over TLS (a certificate for 127.0.0.1 from a test CA,
    /// whose PEM is returned too).
    async fn start_tls(answer: Answer) -> (TestHub, String) {
        let (acceptor, ca_pem) = common::model_mock::loopback_tls();
        let hub = Self::serving(TcpListener::bind("127.0.0.1:0").await.unwrap(), answer, Some(acceptor));
        (TestHub { url: hub.url.replace("http://", "https://"), ..hub }, ca_pem)
    }

    fn serving(listener: TcpListener, answer: Answer, tls: Option<tokio_rustls::TlsAcceptor>) -> TestHub {
        let port = listener.local_addr().unwrap().port();
        let requests: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let log = requests.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (log, tls) = (log.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => answer_one(stream, log, answer).await,
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                answer_one(stream, log, answer).await;
                            }
                        }
                    }
                });
            }
        });
        TestHub { url: format!("http://127.0.0.1:{port}"), port, requests }
    }

    fn bodies(&self) -> Vec<String> {
        self.requests.lock().unwrap().iter().map(|(_, b)| b.clone()).collect()
    }
}

/// Reads one request, records it and answers as told.
async fn answer_one<S>(mut stream: S, log: Arc<Mutex<Vec<(String, String)>>>, answer: Answer)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let (head, body) = loop {
        let Ok(n) = stream.read(&mut buf).await else { return };
        if n == 0 {
            return;
        }
        data.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&data).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_string();
            let length: usize = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
                .unwrap_or(0);
            if data.len() >= end + 4 + length {
                break (head, String::from_utf8_lossy(&data[end + 4..end + 4 + length]).to_string());
            }
        }
    };
    log.lock().unwrap().push((head, body));
    match answer {
        Answer::Status(code) => {
            let reply = format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(reply.as_bytes()).await;
        }
        Answer::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
    }
}

fn hub_config(url: &str, max_age: u64) -> HubConfig {
    HubConfig {
        url: url.into(),
        ca_file: None,
        token_env: None,
        token_file: None,
        timeout_seconds: 1,
        initial_backoff_ms: 100,
        max_backoff_seconds: 1,
        max_age_seconds: max_age,
    }
}

fn with_hub(hub: HubConfig) -> Options {
    Options { config: Box::new(move |c| c.hub = Some(hub)), ..Options::default() }
}

async fn hub_status(
    daemon_client: &mut ExecutionServiceClient<tonic::transport::Channel>,
    id: &str,
) -> pb::HubReportStatus {
    let record = daemon_client
        .get_execution(pb::GetExecutionRequest { execution_id: id.into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    pb::HubReportStatus::try_from(record.evidence.unwrap().hub_report_status).unwrap()
}

async fn wait_for_status(
    client: &mut ExecutionServiceClient<tonic::transport::Channel>,
    id: &str,
    want: pb::HubReportStatus,
) {
    let start = Instant::now();
    loop {
        let status = hub_status(client, id).await;
        if status == want {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "hub status stays {status:?}, expected {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_is_reported_once_without_its_output() {
    require_bwrap();
    let hub = TestHub::start(Answer::Status(202)).await;
    let daemon = TestDaemon::start(with_hub(hub_config(&hub.url, 60))).await;
    let mut req = request("test.fake-agent", "NOWORK\nPROBE_WRITE /tmp/OUTPUT-MARKER-9041\nTASK-TEXT-MARKER-3310");
    req.report_to_hub = true;
    let execution = finished(&daemon.execute(req).await);
    assert!(execution.tool_output.contains("OUTPUT-MARKER-9041"), "the caller has the output");
    let mut client = daemon.executions().await;
    wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Accepted).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let bodies = hub.bodies();
    assert_eq!(bodies.len(), 1, "exactly one report");
    let head = &hub.requests.lock().unwrap()[0].0;
    assert!(head.starts_with("POST /progress/ HTTP/1.1"), "{head}");
    let report: serde_json::Value = serde_json::from_str(&bodies[0]).unwrap();
    assert_eq!(report["specversion"], "1.0");
    assert_eq!(report["type"], "dev.corral.execution.finished");
    assert_eq!(report["data"]["outcome"], "succeeded");
    assert_eq!(report["data"]["profile_ref"], "test.fake-agent@1.0.0");
    assert_eq!(report["data"]["execution_id"], execution.execution_id.as_str());
    assert!(!bodies[0].contains("OUTPUT-MARKER-9041"), "no trace of the tool output");
    assert!(!bodies[0].contains("TASK-TEXT-MARKER-3310"), "no trace of the task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_error_reaches_only_the_direct_caller() {
    require_bwrap();
    let hub = TestHub::start(Answer::Status(200)).await;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), common::fake_agent_profile("test.fake-agent", "")).unwrap();
    let data = dir.path().join("data");
    let hub_toml = format!("[hub]\nurl = \"{}\"\ntimeout_seconds = 1\ninitial_backoff_ms = 100\n", hub.url);
    let daemon = ServeProcess::start_with(&data, &profiles, &[("RUST_LOG", "debug")], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let secret = "RAW-ERROR-DISTINCT-66120";
    let mut req = request("test.fake-agent", &format!("NOWORK\nFAIL {secret}\nSTDERR {secret}"));
    req.report_to_hub = true;
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    let execution = finished(&events);
    assert!(execution.tool_error.contains(secret), "the direct caller sees the raw error");
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.error, "execution failed; its principal reads the cause with `corral get --full`");
    wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Accepted).await;
    let bodies = hub.bodies();
    assert_eq!(bodies.len(), 1);
    let report: serde_json::Value = serde_json::from_str(&bodies[0]).unwrap();
    assert_eq!(report["data"]["error"], "execution failed; its principal reads the cause with `corral get --full`");
    assert_eq!(report["data"]["failure_stage"], "execution");
    assert!(!bodies[0].contains(secret), "not in the hub report");
    let watched = {
        let req = pb::WatchRequest { execution_id: execution.execution_id.clone(), after_sequence: 0 };
        let mut stream = client.watch_execution(req).await.unwrap().into_inner();
        let mut all = Vec::new();
        while let Some(e) = stream.message().await.unwrap() {
            all.push(e);
        }
        all
    };
    assert!(!format!("{watched:?}").contains(secret), "not in any watched event");
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap();
    assert!(log.contains("execution finished"), "the log was captured");
    assert!(!log.contains(secret), "not in the daemon's log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_that_is_down_slow_or_failing_leaves_the_outcome_and_ends_failed() {
    require_bwrap();
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let down_url = format!("http://127.0.0.1:{}", closed.local_addr().unwrap().port());
    drop(closed);
    let slow = TestHub::start(Answer::Hang).await;
    let failing = TestHub::start(Answer::Status(503)).await;
    for (name, url) in [("down", down_url), ("timing out", slow.url.clone()), ("503", failing.url.clone())] {
        let daemon = TestDaemon::start(with_hub(hub_config(&url, 2))).await;
        let mut req = request("test.fake-agent", "NOWORK");
        req.report_to_hub = true;
        let execution = finished(&daemon.execute(req).await);
        assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Succeeded, "{name}");
        let mut client = daemon.executions().await;
        assert_eq!(hub_status(&mut client, &execution.execution_id).await, pb::HubReportStatus::Pending, "{name}");
        wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Failed).await;
        let record = client
            .get_execution(pb::GetExecutionRequest {
                execution_id: execution.execution_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(pb::ExecutionState::try_from(record.state).unwrap(), pb::ExecutionState::Succeeded, "{name}");
        // The texts a transport error could leak into (ids and timestamps
        // are left out: a uuid may well contain "503").
        let evidence = record.evidence.clone().unwrap();
        let text = format!("{:?} {:?} {:?}", evidence.error, evidence.notes, record.tool_error).to_ascii_lowercase();
        for transport in ["refused", "timed out", "503", "connection"] {
            assert!(!text.contains(transport), "{name}: the record mentions {transport:?}");
        }
    }
    assert!(failing.bodies().len() >= 2, "the 503 hub saw retries");
}

/// For a daemon process reporting to the hub at `url` (with short
/// retries): its profile directory (the fake agent), its data directory
/// and its `[hub]` config.
fn reporting_daemon_files(dir: &std::path::Path, url: &str) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let profiles = dir.join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("fake.toml"), common::fake_agent_profile("test.fake-agent", "")).unwrap();
    let hub_toml =
        format!("[hub]\nurl = \"{url}\"\ntimeout_seconds = 1\ninitial_backoff_ms = 100\nmax_backoff_seconds = 1\n");
    (profiles, dir.join("data"), hub_toml)
}

/// Starts the fake agent on `description`, asking for a report, and reads
/// its events until one `until` matches; returns the execution's id.
async fn start_reported(
    client: &mut ExecutionServiceClient<tonic::transport::Channel>,
    description: &str,
    until: fn(&Kind) -> bool,
) -> String {
    let mut req = request("test.fake-agent", description);
    req.report_to_hub = true;
    let id = client.start_execution(req).await.unwrap().into_inner().execution_id;
    let req = pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    while let Some(e) = stream.message().await.unwrap() {
        if e.kind.as_ref().is_some_and(until) {
            break;
        }
    }
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_waits_out_a_restart_and_is_delivered_when_the_hub_is_back() {
    require_bwrap();
    let reserved = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = reserved.local_addr().unwrap().port();
    drop(reserved);
    let dir = common::data_tempdir();
    let (profiles, data, hub_toml) = reporting_daemon_files(dir.path(), &format!("http://127.0.0.1:{port}"));

    let mut daemon = ServeProcess::start_with(&data, &profiles, &[], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_reported(&mut client, "NOWORK", |k| matches!(k, Kind::Finished(_))).await;
    assert_eq!(hub_status(&mut client, &id).await, pb::HubReportStatus::Pending);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();

    let hub = TestHub::start_on(TcpListener::bind(("127.0.0.1", port)).await.unwrap(), Answer::Status(200));
    assert_eq!(hub.port, port);
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    wait_for_status(&mut client, &id, pb::HubReportStatus::Accepted).await;
    assert_eq!(hub.bodies().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_sent_unless_asked_and_refusals_are_reported_when_asked() {
    require_bwrap();
    let hub = TestHub::start(Answer::Status(200)).await;
    let daemon = TestDaemon::start(with_hub(hub_config(&hub.url, 60))).await;
    let quiet = finished(&daemon.execute(request("test.fake-agent", "NOWORK")).await);
    let quiet_status = pb::HubReportStatus::try_from(quiet.evidence.unwrap().hub_report_status).unwrap();
    assert_eq!(quiet_status, pb::HubReportStatus::NotRequested);

    let mut client = daemon.executions().await;
    let mut refused_ids = Vec::new();
    for (profile, actor) in [("no.such.profile", ""), ("test.fake-agent", "worker-1")] {
        let mut req = request(profile, "");
        req.actor = actor.into();
        req.report_to_hub = true;
        let execution = finished(&daemon.execute(req).await);
        assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Refused);
        wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Accepted).await;
        refused_ids.push(execution.execution_id);
    }
    let bodies = hub.bodies();
    assert_eq!(bodies.len(), 2, "only the refusals that asked were reported");
    for (body, id) in bodies.iter().zip(&refused_ids) {
        let report: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(report["data"]["execution_id"], id.as_str());
        assert_eq!(report["data"]["outcome"], "refused");
        assert_eq!(report["data"]["failure_stage"], "resolution");
        assert_eq!(report["data"]["session_cleanup"], "not_attempted");
        assert_eq!(report["data"]["sandbox_destroy"], "not_attempted");
    }
}

fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..=c.len() {
            out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_the_harness_prints_is_redacted_everywhere() {
    require_bwrap();
    let hub = TestHub::start(Answer::Status(200)).await;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let leaky = common::fake_agent_profile("test.leaky", "").replace("[\"route.test\"]", "[\"leak\"]");
    std::fs::write(profiles.join("leaky.toml"), leaky).unwrap();
    let data = dir.path().join("data");
    let value = "s3cr3t-CREDENTIAL-7f9a2c41d0e8";
    let secret_file = dir.path().join("leak.secret");
    std::fs::write(&secret_file, format!("{value}\n")).unwrap();
    let extra = format!(
        "[credentials.routes.leak]\nfile = {:?}\ninject_as = \"LEAKY_TOKEN\"\nexpose = true\n[hub]\nurl = \"{}\"\ninitial_backoff_ms = 100\n",
        secret_file.display().to_string(),
        hub.url
    );
    let daemon = ServeProcess::start_with(&data, &profiles, &[("RUST_LOG", "debug")], &extra).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut req = request("test.leaky", "NOWORK\nLEAK LEAKY_TOKEN");
    req.report_to_hub = true;
    let mut stream = client.execute(req).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    let execution = finished(&events);
    let encoded = b64(format!("prefix:{value}").as_bytes());
    let hex: String = value.bytes().map(|b| format!("{b:02x}")).collect();
    let percent: String = value.bytes().map(|b| format!("%{b:02X}")).collect();
    // The harness named the key as its model: untrusted, so scrubbed and
    // then withheld (a redaction marker is no model name).
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.resolved_model, "", "{evidence:?}");
    assert!(evidence.notes.iter().any(|n| n.contains("not a model name")), "{:?}", evidence.notes);
    let tools: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Progress(p)) if p.kind == pb::ProgressKind::ToolUse as i32 => Some(p.tool.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(tools, vec!["[REDACTED:leak]"], "the hex-encoded key as a tool name");
    let caller = format!("{events:?}");
    assert!(!caller.contains(value), "the direct caller never sees the value");
    assert!(!caller.contains(&encoded[12..]), "nor its base64 form");
    assert!(!caller.contains(&hex) && !caller.contains(&percent), "nor its hex or percent form");
    assert!(execution.tool_output.contains("leak output: [REDACTED:leak]"), "{}", execution.tool_output);
    assert!(execution.tool_error.contains("[REDACTED:leak]"), "{}", execution.tool_error);
    let progress: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Progress(p)) if !p.message.is_empty() => Some(p.message.as_str()),
            _ => None,
        })
        .collect();
    assert!(progress.contains(&"leak progress [REDACTED:leak]"), "{progress:?}");

    wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Accepted).await;
    let req = pb::WatchRequest { execution_id: execution.execution_id.clone(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    let mut watched = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        watched.push(e);
    }
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap();
    let db = store_text(&data).await;
    for (place, text) in [
        ("a watched event", format!("{watched:?}")),
        ("the hub report", hub.bodies().join("\n")),
        ("the daemon log", log),
        ("the store", db),
    ] {
        assert!(!text.contains(value), "the credential is in {place}");
        assert!(!text.contains(&encoded[12..]), "its base64 form is in {place}");
        assert!(!text.contains(&hex) && !text.contains(&hex.to_uppercase()), "its hex form is in {place}");
        assert!(!text.contains(&percent), "its percent-encoded form is in {place}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_naming_an_unknown_route_is_listed_unusable_and_refused() {
    require_bwrap();
    let mut options = Options::default();
    let ghost = common::fake_agent_profile("test.ghost", "").replace("[\"route.test\"]", "[\"no.such.route\"]");
    options.profiles.push(("ghost.toml".into(), ghost));
    let daemon = TestDaemon::start(options).await;
    let profiles =
        daemon.catalog().await.list_profiles(pb::ListProfilesRequest {}).await.unwrap().into_inner().profiles;
    let ghost = profiles.iter().find(|p| p.id == "test.ghost").expect("listed");
    assert!(!ghost.usable);
    assert!(ghost.unusable_reason.contains("unknown credential route no.such.route"), "{}", ghost.unusable_reason);
    assert!(profiles.iter().find(|p| p.id == "test.fake-agent").unwrap().usable);
    let execution = finished(&daemon.execute(request("test.ghost", "")).await);
    let evidence = execution.evidence.unwrap();
    assert_eq!(pb::FailureStage::try_from(evidence.failure_stage).unwrap(), pb::FailureStage::Resolution);
    assert!(evidence.error.contains("unknown credential route no.such.route"), "{}", evidence.error);
}

/// Forwards every connection on a port of its own to `to`, keeping what
/// the client sent: the bytes on the wire.
async fn wire_recorder(to: u16) -> (u16, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let upstream = tokio::net::TcpStream::connect(("127.0.0.1", to)).await.unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut up_read, mut up_write) = upstream.into_split();
                let up = async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = client_read.read(&mut buf).await {
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if up_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut up_read, &mut client_write).await;
                };
                tokio::join!(up, down);
            });
        }
    });
    (port, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_goes_to_an_https_hub_with_its_token_only_inside_tls() {
    require_bwrap();
    const TOKEN: &str = "hub-token-4b1d9e07a2";
    let (hub, ca_pem) = TestHub::start_tls(Answer::Status(202)).await;
    let (wire_port, wire) = wire_recorder(hub.port).await;
    let dir = tempfile::tempdir().unwrap();
    let (token_file, ca_file) = (dir.path().join("token"), dir.path().join("ca.pem"));
    std::fs::write(&token_file, TOKEN).unwrap();
    std::fs::write(&ca_file, ca_pem).unwrap();
    let config = HubConfig {
        url: format!("https://127.0.0.1:{wire_port}"),
        ca_file: Some(ca_file),
        token_file: Some(token_file),
        ..hub_config("", 60)
    };
    let daemon = TestDaemon::start(with_hub(config)).await;
    let mut req = request("test.fake-agent", "NOWORK");
    req.report_to_hub = true;
    let execution = finished(&daemon.execute(req).await);
    let mut client = daemon.executions().await;
    wait_for_status(&mut client, &execution.execution_id, pb::HubReportStatus::Accepted).await;
    let (head, _) = hub.requests.lock().unwrap()[0].clone();
    assert!(head.starts_with("POST /progress/ HTTP/1.1"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains(&format!("authorization: bearer {}", TOKEN.to_ascii_lowercase())),
        "{head}"
    );
    let wire = wire.lock().unwrap().clone();
    assert!(!wire.is_empty(), "the report crossed the recorder");
    assert!(!wire.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()), "the token is on the wire in clear");
    assert!(!wire.windows(6).any(|w| w == b"Bearer" || w == b"bearer"), "a bearer header is on the wire in clear");
}

#[test]
fn a_token_for_a_plain_http_hub_beyond_loopback_is_refused_at_start() {
    let config = HubConfig { token_env: Some("HUB_TOKEN".into()), ..hub_config("http://hub.example:8080", 60) };
    let (key, why) = config.validate().unwrap_err();
    assert_eq!(key, "hub.url");
    assert!(why.contains("in clear") && why.contains("https"), "{why}");
    // Without a token, or on loopback, plain http stays allowed (a token
    // that can be read: one that cannot is refused at start too).
    assert!(hub_config("http://hub.example:8080", 60).validate().is_ok());
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("hub.token");
    std::fs::write(&token_file, "hub-token\n").unwrap();
    let local = HubConfig { token_file: Some(token_file.clone()), ..hub_config("http://127.0.0.1:8080", 60) };
    assert!(local.validate().is_ok());
    let tls = HubConfig { token_file: Some(token_file), ..hub_config("https://hub.example", 60) };
    assert!(tls.validate().is_ok());
    let unset =
        HubConfig { token_env: Some("CORRAL_TEST_UNSET_HUB_TOKEN".into()), ..hub_config("https://hub.example", 60) };
    assert_eq!(unset.validate().unwrap_err().0, "hub.token_env");
}

/// A run that asked for a report and was failed by recovery (its daemon
/// died mid-run) is reported too: the final record, its `finished` event
/// and the report are stored together when the next start fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_failed_by_recovery_is_reported_when_it_asked() {
    require_bwrap();
    let hub = TestHub::start(Answer::Status(200)).await;
    let dir = common::data_tempdir();
    let (profiles, data, hub_toml) = reporting_daemon_files(dir.path(), &hub.url);
    let mut daemon = ServeProcess::start_with(&data, &profiles, &[], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_reported(&mut client, "NOWORK\nHANG", |k| matches!(k, Kind::Progress(_))).await;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
    daemon.child.wait().await.unwrap();
    assert!(hub.bodies().is_empty(), "nothing reported before recovery");
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    wait_for_status(&mut client, &id, pb::HubReportStatus::Accepted).await;
    let bodies = hub.bodies();
    assert_eq!(bodies.len(), 1, "{bodies:?}");
    assert!(bodies[0].contains(&id) && bodies[0].contains("failed"), "{}", bodies[0]);
}

/// A run that asked for a report, accepted by a daemon with a hub (so
/// `pending`) and finished by recovery on a start without one, is not left
/// `pending` forever: no node will deliver it, so it is `failed`, and the
/// record says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_finished_by_a_daemon_without_a_hub_fails_rather_than_stays_pending() {
    require_bwrap();
    let dir = common::data_tempdir();
    let (profiles, data, hub_toml) = reporting_daemon_files(dir.path(), "http://127.0.0.1:9");
    let mut daemon = ServeProcess::start_with(&data, &profiles, &[], &hub_toml).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let id = start_reported(&mut client, "NOWORK\nHANG", |k| matches!(k, Kind::Progress(_))).await;
    assert_eq!(hub_status(&mut client, &id).await, pb::HubReportStatus::Pending);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGKILL) };
    daemon.child.wait().await.unwrap();

    let daemon = ServeProcess::start_with(&data, &profiles, &[], "").await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let start = Instant::now();
    let record = loop {
        let request = pb::GetExecutionRequest { execution_id: id.clone(), ..Default::default() };
        let record = client.get_execution(request).await.unwrap().into_inner();
        if record.state == pb::ExecutionState::Failed as i32 {
            break record;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "not failed by recovery: {record:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let evidence = record.evidence.unwrap();
    let status = pb::HubReportStatus::try_from(evidence.hub_report_status).unwrap();
    assert_eq!(status, pb::HubReportStatus::Failed, "{evidence:?}");
    assert!(evidence.notes.iter().any(|n| n.contains("no hub configured")), "{:?}", evidence.notes);
}

/// `test.env-printer`: `/bin/sh -s` given the task's description, in a
/// bwrap sandbox without network, naming credential route `route`, with
/// `sandbox` (more lines of its `[sandbox]`).
fn env_printer(route: &str, sandbox: &str) -> String {
    format!(
        "id = \"test.env-printer\"\nversion = \"1.0.0\"\ncredential_route_refs = [\"{route}\"]\n[rein]\n\
         argv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n[sandbox]\ntype = \"linux_bwrap\"\n\
         allow_network = false\nwrite_paths = [\".\"]\n{sandbox}\n[limits]\ntimeout_seconds = 60\n"
    )
}

/// `env_passthrough` is how a daemon variable enters a sandbox: a profile
/// passing through a credential route's source variable (the real key, of a
/// gatewayed route too) or the variable its placeholder is set under (the
/// daemon's own value would come first, and the first entry is the one a
/// program reads) is refused at load, naming the field. Otherwise the
/// harness's environment, as it was exec'd, holds the placeholder once and
/// the key nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_passing_a_credential_through_is_refused_and_the_key_never_enters() {
    require_bwrap();
    let key = "gatewayed-REAL-key-4e1f9a7c";
    let route =
        "[credentials.routes.gw]\nenv = \"GW_REAL_KEY\"\ninject_as = \"GW_TOKEN\"\nupstream = \"http://127.0.0.1:9\"\n";
    let profile = |passed: &str| env_printer("gw", &format!("env_passthrough = [\"INNOCENT\", {passed:?}]"));
    let env = [("GW_REAL_KEY", key), ("GW_TOKEN", key), ("INNOCENT", "innocent-value")];
    for passed in ["GW_REAL_KEY", "GW_TOKEN"] {
        let dir = common::data_tempdir();
        let profiles = dir.path().join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        std::fs::write(profiles.join("printer.toml"), profile(passed)).unwrap();
        let config = dir.path().join("corral.toml");
        std::fs::write(&config, format!("{route}[sandbox]\nuids = {:?}\n", common::unique_uids())).unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_corral"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join("data"))
            .arg("--config")
            .arg(&config)
            .arg("--profiles")
            .arg(&profiles)
            .envs(env)
            .env_remove("CORRAL_CONFIG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("the daemon started with {passed} passed through"))
            .unwrap();
        assert!(!out.status.success(), "the daemon started with {passed} passed through");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&format!("sandbox.env_passthrough: {passed} ")), "{stderr}");
        assert!(stderr.contains("printer.toml") && stderr.contains("credential route gw"), "{stderr}");
        assert!(!stderr.contains(key), "{stderr}");
    }

    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("printer.toml"), profile("LANG")).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start_with(&data, &profiles, &env, route).await;
    // The environment the harness was exec'd with, every entry, each line
    // reversed so that the scrubber of its output cannot hide a key.
    let events = daemon.execute(request("test.env-printer", "tr '\\0' '\\n' < /proc/$$/environ | rev")).await;
    let execution = finished(&events);
    let entries: Vec<String> = execution.tool_output.lines().map(|l| l.chars().rev().collect()).collect();
    assert!(entries.iter().any(|e| e == "INNOCENT=innocent-value"), "passthrough works: {entries:?}");
    assert!(entries.iter().all(|e| !e.contains(key)), "the key is in the sandbox: {entries:?}");
    let tokens: Vec<&String> = entries.iter().filter(|e| e.starts_with("GW_TOKEN=")).collect();
    assert_eq!(tokens.len(), 1, "{entries:?}");
    assert!(tokens[0].starts_with("GW_TOKEN=corral-gw-"), "{tokens:?}");
    assert!(!entries.iter().any(|e| e.starts_with("GW_REAL_KEY=")), "{entries:?}");
    daemon.stop().await;
}

/// A route with no upstream hands its real value to the harness only when
/// it says `expose = true`. A profile naming one that does not is refused
/// at resolution, naming the route and the way out, before any sandbox
/// exists, and `corral doctor` says so of the profile; with `expose = true`
/// the harness's environment holds the key, as the route asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_does_not_say_expose_never_hands_its_key_to_the_harness() {
    require_bwrap();
    let key = "raw-REAL-key-0b7d2e95c4";
    let profile = env_printer("raw", "");
    let route =
        |expose: &str| format!("[credentials.routes.raw]\nenv = \"RAW_REAL_KEY\"\ninject_as = \"RAW_TOKEN\"\n{expose}");
    // Every entry of the harness's environment, each line reversed so that
    // the scrubber of its output cannot hide a key.
    let script = "tr '\\0' '\\n' < /proc/$$/environ | rev";
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("printer.toml"), &profile).unwrap();

    let data = dir.path().join("data");
    let daemon = ServeProcess::start_with(&data, &profiles, &[("RAW_REAL_KEY", key)], &route("")).await;
    let events = daemon.execute(request("test.env-printer", script)).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Refused as i32, "{execution:?}");
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Resolution as i32, "{evidence:?}");
    assert!(
        evidence.error.contains("credential route raw has no upstream") && evidence.error.contains("expose = true"),
        "{}",
        evidence.error
    );
    assert!(evidence.sandbox_id.is_empty(), "a sandbox was made: {evidence:?}");
    assert!(!format!("{events:?}").contains(key), "{events:?}");
    daemon.stop().await;

    let config = dir.path().join("corral.toml");
    std::fs::write(&config, route("")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(["doctor", "--config"])
        .arg(&config)
        .arg("--profiles")
        .arg(&profiles)
        .env("RAW_REAL_KEY", key)
        .env_remove("CORRAL_CONFIG")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line =
        text.lines().find(|l| l.trim_start().starts_with("test.env-printer@")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("NO") && line.contains("credential route raw has no upstream"), "{line}");

    let data = dir.path().join("data-exposed");
    let daemon = ServeProcess::start_with(&data, &profiles, &[("RAW_REAL_KEY", key)], &route("expose = true\n")).await;
    let events = daemon.execute(request("test.env-printer", script)).await;
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    let entries: Vec<String> = execution.tool_output.lines().map(|l| l.chars().rev().collect()).collect();
    assert!(entries.contains(&format!("RAW_TOKEN={key}")), "{entries:?}");
    // The receipt says so.
    let receipt = events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(r)) => r.receipt.clone(),
            _ => None,
        })
        .expect("a receipt");
    assert_eq!((receipt.exposed_routes, receipt.gateway_routes), (vec!["raw".to_string()], Vec::new()));
    daemon.stop().await;
}

/// A 108-character key, as the `leak` route's file holds it.
const KEY_108: &str =
    "sk-live-Zq7xK2mP9vR4tY8wB3nL6cH1jF5dS0aEuG7iO2pW9yT4rE6qA1sD3fG5hJ8kL0zX2cV4bN6mQ9wE1rT3yU5iO7pA0sD2fG4hJ6kL";

/// What one `/bin/sh -s` run given `$LEAKY_TOKEN` (the `leak` route, a
/// file) left, each as text: the events its caller saw, its record as
/// `GetExecution` FULL gives it, the events a watcher reads back, and the
/// store's bytes (its file and write-ahead log; on PostgreSQL every row).
async fn leaky_shell_run(max_output_bytes: u64, script: &str) -> Vec<(&'static str, String)> {
    require_bwrap();
    assert_eq!(KEY_108.len(), 108);
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let profile = format!(
        "id = \"test.leaky-sh\"\nversion = \"1.0.0\"\ncredential_route_refs = [\"leak\"]\n[rein]\n\
         argv = [\"/bin/sh\", \"-s\"]\ninput = \"description\"\n[sandbox]\ntype = \"linux_bwrap\"\n\
         allow_network = false\nwrite_paths = [\".\"]\n[limits]\ntimeout_seconds = 60\n\
         max_output_bytes = {max_output_bytes}\n"
    );
    std::fs::write(profiles.join("leaky-sh.toml"), profile).unwrap();
    let data = dir.path().join("data");
    let secret_file = dir.path().join("leak.secret");
    std::fs::write(&secret_file, format!("{KEY_108}\n")).unwrap();
    let extra = format!(
        "[credentials.routes.leak]\nfile = {:?}\ninject_as = \"LEAKY_TOKEN\"\nexpose = true\n",
        secret_file.display().to_string()
    );
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut stream = client.execute(request("test.leaky-sh", script)).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    let id = finished(&events).execution_id;
    let full = pb::GetExecutionRequest { execution_id: id.clone(), view: pb::ExecutionView::Full as i32 };
    let record = client.get_execution(full).await.unwrap().into_inner();
    let req = pb::WatchRequest { execution_id: id, after_sequence: 0 };
    let mut stream = client.watch_execution(req).await.unwrap().into_inner();
    let mut watched = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        watched.push(e);
    }
    let store = store_text(&data).await;
    vec![
        ("the caller's events", format!("{events:?}")),
        ("the FULL record", format!("{record:?}")),
        ("a watched event", format!("{watched:?}")),
        ("the store", store),
    ]
}

/// coreutils' `base64` wraps at 76 columns, and output is scrubbed line by
/// line: each line of the key's encoding is redacted on its own, wherever
/// the key falls in what is encoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_printed_through_a_wrapping_base64_is_redacted_line_by_line() {
    let script = "printf %s \"$LEAKY_TOKEN\" | base64\n\
                  printf 'key=%s\\n' \"$LEAKY_TOKEN\" | base64\n\
                  printf %s \"$LEAKY_TOKEN\" | base64 >&2\n\
                  exit 3\n";
    let places = leaky_shell_run(65536, script).await;
    let lines: Vec<String> = [KEY_108.to_string(), format!("key={KEY_108}\n")]
        .iter()
        .flat_map(|text| {
            b64(text.as_bytes())
                .as_bytes()
                .chunks(76)
                .map(|l| String::from_utf8(l.to_vec()).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    // Every 8 digits of the key's encoding, at each of the three byte
    // alignments (the pieces past the scrubber's window).
    let pieces: Vec<String> = (0..3)
        .flat_map(|offset| {
            let mut bytes = vec![0u8; offset];
            bytes.extend_from_slice(KEY_108.as_bytes());
            let encoded = b64(&bytes);
            let form = encoded[(8 * offset).div_ceil(6)..8 * (offset + KEY_108.len()) / 6].to_string();
            (0..=form.len() - 8).map(move |at| form[at..at + 8].to_string()).collect::<Vec<_>>()
        })
        .collect();
    for (place, text) in &places {
        assert!(!text.contains(KEY_108), "the key is in {place}");
        for line in &lines {
            assert!(!text.contains(line.as_str()), "a line of its base64 is in {place}: {line}");
        }
        for piece in &pieces {
            assert!(!text.contains(piece.as_str()), "8 digits of its base64 are in {place}: {piece}");
        }
    }
    let record = &places[1].1;
    assert!(record.contains("[REDACTED:leak]\\n[REDACTED:leak]"), "stdout, line by line: {record}");
}

/// Output past `max_output_bytes` and a line past 1 MiB are cut; what is
/// kept is scrubbed later, so the cut keeps no part of a line, else a key
/// across it would keep a prefix no pattern matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_across_an_output_cut_leaves_no_piece_of_itself() {
    let eight: Vec<&str> = (0..=KEY_108.len() - 8).map(|at| &KEY_108[at..at + 8]).collect();
    let at_the_cap = "head -c 4035 /dev/zero | tr '\\0' x; echo\necho \"$LEAKY_TOKEN\"\n\
                      head -c 4035 /dev/zero | tr '\\0' x >&2; echo >&2\necho \"$LEAKY_TOKEN\" >&2\nexit 3\n";
    // 1 MiB less 50: the key's first 50 characters would be left of a line
    // cut at 1 MiB.
    let at_max_line = "head -c 1048526 /dev/zero | tr '\\0' x; echo \"$LEAKY_TOKEN\"\necho after\n\
                       head -c 1048526 /dev/zero | tr '\\0' x >&2; echo \"$LEAKY_TOKEN\" >&2\nexit 3\n";
    for (cap, script) in [(4096, at_the_cap), (4 << 20, at_max_line)] {
        let places = leaky_shell_run(cap, script).await;
        for (place, text) in &places {
            for piece in &eight {
                assert!(!text.contains(piece), "cap {cap}: 8 characters of the key are in {place}: {piece}");
            }
        }
        let record = &places[1].1;
        match cap {
            4096 => assert!(record.contains("xxxxxxxx"), "the lines before the cut are kept: {record:.300}"),
            _ => assert!(
                record.contains("tool_output: \"after\\n\""),
                "a line cut at 1 MiB is dropped alone: {record:.300}"
            ),
        }
    }
}

/// Everything the store of the daemon whose data directory is `data` holds,
/// as text: its SQLite file and write-ahead log (where recent writes live),
/// or on PostgreSQL every row of every table. Never empty.
async fn store_text(data: &std::path::Path) -> String {
    let config = std::fs::read_to_string(data.with_extension("toml")).unwrap();
    let postgres = config.lines().skip_while(|l| *l != "[store]").nth(1).and_then(|l| l.strip_prefix("url = "));
    let text = match postgres {
        None => {
            let mut db = std::fs::read(data.join("corral.db")).unwrap_or_default();
            db.extend(std::fs::read(data.join("corral.db-wal")).unwrap_or_default());
            String::from_utf8_lossy(&db).into_owned()
        }
        Some(url) => {
            use sqlx::{Connection, Row};
            let mut conn = sqlx::PgConnection::connect(url.trim_matches('"')).await.unwrap();
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
            )
            .fetch_all(&mut conn)
            .await
            .unwrap();
            let mut text = String::new();
            for table in tables {
                for row in sqlx::query(&format!("SELECT CAST(t AS text) FROM \"{table}\" t"))
                    .fetch_all(&mut conn)
                    .await
                    .unwrap()
                {
                    text.push_str(&row.get::<String, _>(0));
                }
            }
            text
        }
    };
    assert!(!text.is_empty(), "the store holds nothing");
    text
}
