//! What operators look at: JSON logs that carry the execution's id, and
//! Prometheus metrics.

mod common;

use common::{request, require_bwrap, sample, scrape, ServeProcess};
use corral::pb;
use corral::pb::execution_service_client::ExecutionServiceClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_and_carry_the_execution_id() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let env = [("CORRAL_LOG_FORMAT", "json"), ("RUST_LOG", "info")];
    let mut daemon = ServeProcess::start(&data, &profiles, &env).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    // The caller's trace: every line of the run names it, with no
    // collector configured.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let message = request("builtin.shell", "echo hi");
    let mut stream = client.execute(traceparent(message, caller_trace)).await.unwrap().into_inner();
    let mut id = String::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(pb::lifecycle_event::Kind::Accepted(a)) = event.kind {
            id = a.execution_id;
        }
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    daemon.child.wait().await.unwrap();
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty());
    assert!(!log.contains('\u{1b}'), "ANSI escapes in a log file");
    assert!(lines.iter().all(|l| l.get("fields").is_none() && l["message"].is_string()), "flat lines: {log}");
    assert!(!log.contains("Some(") && !log.contains("\"Failed\""), "Rust debug text in the log: {log}");
    let of_run: Vec<_> = lines.iter().filter(|l| l["span"]["execution_id"] == id.as_str()).collect();
    assert!(
        of_run
            .iter()
            .any(|l| l["message"] == "execution finished" && l["outcome"] == "succeeded" && l["stage"] == "none"),
        "no line of the execution carries its id: {log}"
    );
    // Each line of the run names its trace (W3C hex) first, one trace for
    // the whole run, and its span.
    let traces: std::collections::BTreeSet<&str> = of_run
        .iter()
        .map(|l| {
            let trace = l["trace_id"].as_str().unwrap_or_else(|| panic!("a line of the run without trace_id: {l}"));
            let span = l["span_id"].as_str().unwrap_or_else(|| panic!("a line of the run without span_id: {l}"));
            assert!(trace.len() == 32 && span.len() == 16, "ids: {l}");
            assert!(trace.chars().chain(span.chars()).all(|c| c.is_ascii_hexdigit()), "ids: {l}");
            trace
        })
        .collect();
    assert_eq!(traces.into_iter().collect::<Vec<_>>(), vec![caller_trace], "one run, the caller's trace");
}

/// Every line inside a stage's span (`resolve`, `gate`, `sandbox_create`,
/// `harness`, `teardown`, ...) carries the execution's id under `span`
/// too, not only the lines of the `execution` span itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_inside_a_stage_carry_the_execution_id() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let env = [("CORRAL_LOG_FORMAT", "json"), ("RUST_LOG", "info,sqlx=debug")];
    let daemon = ServeProcess::start(&data, &profiles, &env).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut stream = client.execute(request("builtin.shell", "echo hi")).await.unwrap().into_inner();
    let mut id = String::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(pb::lifecycle_event::Kind::Accepted(a)) = event.kind {
            id = a.execution_id;
        }
    }
    daemon.stop().await;
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap();
    let stages = ["resolve", "gate", "workspace", "sandbox_create", "session_start", "harness", "capture", "teardown"];
    let in_stages: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .filter(|l| l["span"]["name"].as_str().is_some_and(|name| stages.contains(&name)))
        .collect();
    assert!(!in_stages.is_empty(), "no line inside a stage's span: {log}");
    for line in &in_stages {
        assert_eq!(line["span"]["execution_id"], id.as_str(), "a stage's line without its execution's id: {line}");
        assert!(line["trace_id"].is_string(), "{line}");
    }
}

/// A daemon whose serve fails before its listeners accept (a metrics token
/// too short, a unix socket group that does not exist) never prints its
/// ready line (nor sends READY=1): it exits non-zero with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_cannot_serve_never_says_it_listens() {
    let dir = common::data_tempdir();
    let token = dir.path().join("metrics.token");
    std::fs::write(&token, "0123456789\n").unwrap();
    let port = common::unused_port();
    let short_token =
        format!("metrics_listen = \"127.0.0.1:{port}\"\nmetrics_token_file = {:?}\n", token.display().to_string());
    let cases = [
        (short_token.as_str(), "the token must have at least 32 characters"),
        ("unix_socket_group = \"no-such-group-corral\"\n", "unix_socket_group: no group"),
    ];
    for (i, (config, reason)) in cases.into_iter().enumerate() {
        let file = dir.path().join(format!("corral-{i}.toml"));
        std::fs::write(&file, format!("{config}[sandbox]\nuids = {:?}\n", common::unique_uids())).unwrap();
        let serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_corral"))
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path().join(format!("data-{i}")))
            .arg("--config")
            .arg(&file)
            .env_remove("CORRAL_CONFIG")
            .env_remove("NOTIFY_SOCKET")
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(std::time::Duration::from_secs(30), serve).await.expect("it exits").unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            !stdout.contains("corral listening"),
            "{config}: a ready line for a daemon that did not start: {stdout}"
        );
        assert_eq!(out.status.code(), Some(1), "{config}: {stderr}");
        assert!(stderr.contains(reason), "{config}: the reason ({reason}) is not given: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_outcomes_stages_and_gate_decisions() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("deny.toml"),
        r#"id = "test.denied"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[[guardrails.policies]]
name = "never"
kind = "expr"
arguments = { expression = "false", reason = "never" }
"#,
    )
    .unwrap();
    let data = dir.path().join("data");
    let port = common::unused_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let daemon = ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    for (profile, script) in
        [("builtin.shell", "true"), ("builtin.shell", "exit 3"), ("no.such.profile", "true"), ("test.denied", "true")]
    {
        let mut stream = client.execute(request(profile, script)).await.unwrap().into_inner();
        while stream.message().await.unwrap().is_some() {}
    }
    let text = scrape(port).await;
    let count = |labels: &str| sample(&text, "corral_executions_finished_total", labels).unwrap_or(0.0);
    assert_eq!(count(r#"outcome="succeeded",stage="none""#), 1.0, "{text}");
    assert_eq!(count(r#"outcome="failed",stage="execution""#), 1.0, "{text}");
    assert_eq!(count(r#"outcome="refused",stage="resolution""#), 1.0, "{text}");
    assert_eq!(count(r#"outcome="refused",stage="gate""#), 1.0, "{text}");
    let denials = sample(&text, "corral_gate_decisions_total", r#"source="profile",action="deny""#);
    assert_eq!(denials, Some(1.0), "{text}");
    assert!(sample(&text, "corral_events_stored_total", "").unwrap_or(0.0) > 10.0, "{text}");
    assert_eq!(sample(&text, "corral_sandboxes_alive", ""), Some(0.0), "{text}");
    assert!(text.contains("corral_stage_duration_seconds_bucket{stage=\"harness\""), "{text}");
    assert!(!text.contains("exit 3"), "a task text in a label");
}

/// A no-op execution's eight events take three writes: `accepted`,
/// `resolved` and the first `gated` go in the commit of the sandbox's
/// intent row; `sandbox_ready` rides with the turn's `gated` and
/// `dispatched`; `teardown` with `finished`, in the final record's
/// transaction. Each is counted as a store write of events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_op_execution_stores_its_eight_events_in_three_writes() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let port = common::unused_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let daemon = ServeProcess::start_with(&dir.path().join("data"), &profiles, &[], &extra).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut stream = client.execute(request("builtin.noop", "")).await.unwrap().into_inner();
    let mut kinds = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        kinds.push(format!("{:?}", event.kind.unwrap()).split('(').next().unwrap().to_string());
    }
    let expected = ["Accepted", "Resolved", "Gated", "SandboxReady", "Gated", "Dispatched", "Teardown", "Finished"];
    assert_eq!(kinds, expected, "{kinds:?}");
    let text = scrape(port).await;
    assert_eq!(sample(&text, "corral_events_stored_total", ""), Some(kinds.len() as f64), "{text}");
    assert_eq!(sample(&text, "corral_store_write_seconds_count", ""), Some(3.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_exec_shows_each_output_line_as_it_is_printed() {
    use tokio::io::AsyncBufReadExt;
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let daemon = ServeProcess::start(&dir.path().join("data"), &profiles, &[]).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(["--server", &daemon.cli_url(), "exec", "--profile", "builtin.shell", "--title", "t", "--description"])
        .arg("for i in 1 2 3; do echo line-$i; sleep 1; done")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        if line.starts_with("line-") {
            seen.push((line, started.elapsed()));
        }
    }
    assert!(child.wait().await.unwrap().success());
    let names: Vec<&str> = seen.iter().map(|(l, _)| l.as_str()).collect();
    assert_eq!(names, ["line-1", "line-2", "line-3"], "each line once, in order");
    // Printed one second apart, shown one second apart: not all at the end.
    assert!(seen[2].1 - seen[0].1 >= std::time::Duration::from_millis(1500), "{seen:?}");
}

#[test]
fn serve_help_lists_only_the_daemons_flags_and_completions_and_man_print() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral")).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let help = run(&["serve", "--help"]);
    assert!(
        help.contains("Usage: corral serve") && help.contains("--listen") && help.contains("--log-format"),
        "{help}"
    );
    for client_only in ["--server", "--token-file", "--json", "--ca"] {
        assert!(!help.contains(client_only), "serve --help lists {client_only}:\n{help}");
    }
    assert!(run(&["exec", "--help"]).contains("--server"), "client commands keep their options");
    assert!(run(&["completions", "bash"]).contains("_corral()"));
    assert!(run(&["man"]).contains(".TH corral 1"));
    // Every page the main one refers to can be made.
    let main = run(&["man"]);
    for page in ["exec", "watch", "get", "ls", "cancel", "approve", "deny", "doctor"] {
        assert!(main.contains(&format!("corral\\-{page}(1)")), "corral(1) does not list {page}");
        assert!(run(&["man", page]).contains(&format!(".TH corral-{page} 1")), "{page}");
    }
    assert!(run(&["man", "session", "turn"]).contains(".TH corral-session-turn 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_version_shows_the_daemons_version_and_what_its_host_enforces() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let daemon = ServeProcess::start(&dir.path().join("data"), &profiles, &[]).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(["--server", &daemon.cli_url(), "version"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("corral {} (daemon)", env!("CARGO_PKG_VERSION"))), "{text}");
    for name in ["linux_bwrap", "seccomp", "sandbox_uids", "memory", "pids", "kill", "egress"] {
        assert!(text.lines().any(|l| l.trim_start().starts_with(name) && l.contains(" ok ")), "{name}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_exec_shows_the_elapsed_time_on_a_terminal_only() {
    require_bwrap();
    assert!(std::path::Path::new("/usr/bin/script").exists(), "this test needs script(1) (Debian package bsdutils)");
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let daemon = ServeProcess::start(&dir.path().join("data"), &profiles, &[]).await;
    let exec = format!(
        "{} --server {} exec --profile builtin.shell --title t --description 'sleep 2.5; echo done'",
        env!("CARGO_BIN_EXE_corral"),
        daemon.cli_url()
    );
    // On a pseudo-terminal (script(1) gives it one): the status line.
    let tty = tokio::process::Command::new("script").args(["-qec", &exec, "/dev/null"]).output().await.unwrap();
    let text = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success(), "{text}");
    assert!(text.contains("running 0m01s") || text.contains("running 0m02s"), "no elapsed time on a terminal: {text}");
    // In a pipe: none.
    let piped = tokio::process::Command::new("sh").args(["-c", &exec]).output().await.unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&piped.stdout), String::from_utf8_lossy(&piped.stderr));
    assert!(piped.status.success() && all.contains("done"), "{all}");
    assert!(!all.contains("running 0m") && !all.contains('\u{1b}'), "a status line in a pipe: {all}");
}

/// A test OTLP collector: keeps every span it is sent.
#[derive(Clone, Default)]
struct Collector {
    spans: std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>,
}

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest>,
    ) -> Result<
        tonic::Response<opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse>,
        tonic::Status,
    > {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

/// A collector on loopback and a daemon exporting its traces to it.
async fn traced_daemon(profiles: &[(&str, String)]) -> (Collector, tempfile::TempDir, ServeProcess) {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer;
    require_bwrap();
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let service = TraceServiceServer::new(collector.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    let dir = common::data_tempdir();
    let profile_dir = dir.path().join("profiles");
    std::fs::create_dir_all(&profile_dir).unwrap();
    for (name, text) in profiles {
        std::fs::write(profile_dir.join(name), text).unwrap();
    }
    let extra = format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}\"\n");
    let daemon = ServeProcess::start_with(&dir.path().join("data"), &profile_dir, &[], &extra).await;
    (collector, dir, daemon)
}

/// Stops the daemon: it flushes its spans on the way out.
async fn stop(daemon: ServeProcess) {
    assert!(daemon.stop().await.is_some(), "corral serve did not exit within 30 s of SIGTERM");
}

/// The names of the collected spans of `trace_id`, with their parents' ids.
fn spans_of(collector: &Collector, trace_id: &str) -> Vec<(String, String)> {
    let spans = collector.spans.lock().unwrap();
    spans
        .iter()
        .filter(|s| hex::encode(&s.trace_id) == trace_id)
        .map(|s| (s.name.clone(), hex::encode(&s.parent_span_id)))
        .collect()
}

fn traceparent<T>(message: T, trace_id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap());
    request
}

fn assert_spans(ours: &[(String, String)], root: &str, stages: &[&str]) {
    let names: Vec<&str> = ours.iter().map(|(name, _)| name.as_str()).collect();
    for stage in stages {
        assert!(names.contains(stage), "no {stage} span in the caller's trace: {names:?}");
    }
    let parent = ours.iter().find(|(name, _)| name == root).map(|(_, parent)| parent.as_str());
    assert_eq!(parent, Some("00f067aa0ba902b7"), "the {root} span is a child of the caller's: {ours:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_is_one_trace_joined_to_the_callers_with_a_span_per_stage() {
    let (collector, _dir, daemon) = traced_daemon(&[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut stream =
        client.execute(traceparent(request("builtin.shell", "echo traced"), trace_id)).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    stop(daemon).await;
    let ours = spans_of(&collector, trace_id);
    let stages = ["execution", "resolve", "gate", "sandbox_create", "session_start", "harness", "teardown"];
    assert_spans(&ours, "execution", &stages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_start_each_turn_and_its_end_join_the_callers_traces() {
    use corral::pb::session_service_client::SessionServiceClient;
    let profile = format!(
        r#"id = "test.traced-session"
version = "1.0.0"
[rein]
argv = ["/usr/bin/python3", "{fixtures}/session_agent.py"]
input = "task_json"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
read_paths = ["{fixtures}"]
[limits]
timeout_seconds = 60
max_output_bytes = 65536
"#,
        fixtures = common::FIXTURES
    );
    let (collector, _dir, daemon) = traced_daemon(&[("session.toml", profile)]).await;
    let mut client = SessionServiceClient::new(daemon.channel().await);
    let (start_trace, turn_trace, end_trace) =
        ("0af7651916cd43dd8448eb211c80319c", "5b8aa5a2d2c872e8321cf37308d69df2", "9c1b3e7d2a4f5e6b7c8d9e0f1a2b3c4d");
    let create = pb::CreateSessionRequest {
        profile_ref: "test.traced-session".into(),
        actor: "adm".into(),
        project: "proj".into(),
        ..Default::default()
    };
    let session = client.create_session(traceparent(create, start_trace)).await.unwrap().into_inner();
    let turn = pb::SendTurnRequest {
        session_id: session.session_id.clone(),
        tool_call: Some(pb::ToolCall { tool: "echo".into(), arguments_json: r#"{"echo": "traced"}"#.into() }),
    };
    let mut stream = client.send_turn(traceparent(turn, turn_trace)).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    let end = pb::EndSessionRequest { session_id: session.session_id.clone() };
    client.end_session(traceparent(end, end_trace)).await.unwrap();
    stop(daemon).await;
    let (started, turned) = (spans_of(&collector, start_trace), spans_of(&collector, turn_trace));
    assert_spans(&spans_of(&collector, end_trace), "session_end", &["session_end", "teardown"]);
    assert_spans(&started, "session", &["session", "resolve", "gate", "sandbox_create", "session_start"]);
    assert_spans(&turned, "turn", &["turn", "harness"]);
    assert!(!turned.iter().any(|(name, _)| name == "session_start"), "the turn's trace is the turn's: {turned:?}");
}

/// Every family a scrape lists has its `# HELP` and `# TYPE` first, each
/// sample belongs to a family so announced, and a fresh daemon already
/// lists its counters at 0, its build info and its start time.
fn strict(exposition: &str) -> std::collections::BTreeSet<String> {
    let (mut help, mut types) = (std::collections::BTreeSet::new(), std::collections::BTreeMap::new());
    for line in exposition.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or_else(|| panic!("HELP without text: {line:?}"));
            assert!(!text.trim().is_empty(), "{line:?}");
            help.insert(name.to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("{line:?}"));
            assert!(["counter", "gauge", "histogram", "summary"].contains(&kind), "{line:?}");
            assert!(help.contains(name), "TYPE before HELP (or no HELP) for {name}");
            types.insert(name.to_string(), kind.to_string());
        } else {
            assert!(!line.starts_with('#'), "an unknown comment: {line:?}");
            let metric = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| metric.strip_suffix(s).filter(|f| types.get(*f).is_some_and(|k| k == "histogram")))
                .unwrap_or(metric);
            assert!(types.contains_key(family), "a sample of an unannounced family: {line:?}");
        }
    }
    help
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_daemons_metrics_are_described_and_listed_at_zero() {
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let port = common::unused_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let _daemon = ServeProcess::start_with(&dir.path().join("data"), &profiles, &[], &extra).await;
    let text = scrape(port).await;
    let described = strict(&text);
    for family in [
        "corral_build_info",
        "process_start_time_seconds",
        "corral_executions_finished_total",
        "corral_admission_refused_total",
        "corral_gate_decisions_total",
        "corral_egress_total",
        "corral_model_tokens_total",
        "corral_sandboxes_alive",
        "corral_sandbox_reclaim_failures_total",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_threads",
    ] {
        assert!(described.contains(family), "no HELP for {family}:\n{text}");
    }
    for family in ["corral_stage_duration_seconds", "corral_store_write_seconds", "corral_run_duration_seconds"] {
        assert!(described.contains(family), "no HELP for {family}:\n{text}");
    }
    // Every known label set at 0: histograms with no observation, each
    // outcome with each stage, each kind of admission refusal.
    for stage in ["resolve", "gate", "sandbox_create", "harness", "teardown"] {
        let labels = format!(r#"stage="{stage}""#);
        assert_eq!(sample(&text, "corral_stage_duration_seconds_count", &labels), Some(0.0), "{stage}: {text}");
    }
    assert_eq!(sample(&text, "corral_store_write_seconds_count", ""), Some(0.0), "{text}");
    assert_eq!(sample(&text, "corral_run_duration_seconds_count", ""), Some(0.0), "{text}");
    for labels in [
        r#"outcome="succeeded",stage="none""#,
        r#"outcome="failed",stage="execution""#,
        r#"outcome="failed",stage="sandbox_create""#,
        r#"outcome="refused",stage="gate""#,
        r#"outcome="refused",stage="resolution""#,
        r#"outcome="cancelled",stage="none""#,
    ] {
        assert_eq!(sample(&text, "corral_executions_finished_total", labels), Some(0.0), "{labels}: {text}");
    }
    for kind in ["executions", "sessions", "quota", "fleet", "queue"] {
        let labels = format!(r#"kind="{kind}""#);
        assert_eq!(sample(&text, "corral_admission_refused_total", &labels), Some(0.0), "{kind}: {text}");
    }
    let version = format!(r#"version="{}""#, env!("CARGO_PKG_VERSION"));
    assert_eq!(sample(&text, "corral_build_info", &version), Some(1.0), "{text}");
    assert_eq!(sample(&text, "corral_admission_refused_total", r#"kind="executions""#), Some(0.0), "{text}");
    assert_eq!(sample(&text, "corral_gate_decisions_total", r#"source="admin",action="ask""#), Some(0.0), "{text}");
    assert_eq!(sample(&text, "corral_sandbox_reclaim_failures_total", ""), Some(0.0), "{text}");
    // The process collector reads the daemon's own process: started a
    // moment ago (its boot-relative start, not the first scrape), some
    // memory, a few descriptors under the limit.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let started = sample(&text, "process_start_time_seconds", "").unwrap_or(0.0);
    assert!(started <= now + 1.0 && now - started < 120.0, "started {started}, now {now}");
    assert!(sample(&text, "process_resident_memory_bytes", "").unwrap_or(0.0) > 1e6, "{text}");
    let open = sample(&text, "process_open_fds", "").unwrap_or(0.0);
    assert!(open >= 3.0 && sample(&text, "process_max_fds", "").unwrap_or(0.0) >= open, "{text}");
    assert!(sample(&text, "process_threads", "").unwrap_or(0.0) >= 2.0, "{text}");
}

/// A failed execution's span has an error status naming its failure class,
/// and outcome, profile and token attributes; the resource names the
/// daemon's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_execution_span_has_an_error_status_and_the_runs_attributes() {
    let (collector, _dir, daemon) = traced_daemon(&[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4737";
    let mut stream =
        client.execute(traceparent(request("builtin.shell", "exit 3"), trace_id)).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    stop(daemon).await;
    let spans = collector.spans.lock().unwrap();
    let span = spans
        .iter()
        .find(|s| hex::encode(&s.trace_id) == trace_id && s.name == "execution")
        .expect("the execution span");
    let status = span.status.clone().expect("a status");
    assert_eq!(status.code, 2, "STATUS_CODE_ERROR: {status:?}");
    assert_eq!(status.message, "harness_exited");
    let attribute = |key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.clone())
            .and_then(|v| v.value)
            .map(|v| format!("{v:?}"))
    };
    assert!(attribute("outcome").is_some_and(|v| v.contains("failed")), "{:?}", span.attributes);
    assert!(attribute("corral.profile").is_some_and(|v| v.contains("builtin.shell@")), "{:?}", span.attributes);
    assert!(attribute("corral.failure_class").is_some_and(|v| v.contains("harness_exited")));
    assert!(attribute("gen_ai.usage.total_tokens").is_some(), "{:?}", span.attributes);
}

/// Every call is a SERVER span with OpenTelemetry's RPC attributes, a
/// child of the caller's, ended by the response's last frame: a stream's
/// code comes from its trailers; a refusal is no server error, a call of
/// a method the daemon does not have is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_a_server_span_with_the_rpc_attributes_and_its_code() {
    let (collector, _dir, daemon) = traced_daemon(&[]).await;
    let channel = daemon.channel().await;
    let mut client = ExecutionServiceClient::new(channel.clone());
    let streamed = "6bf92f3577b34da6a3ce929d0e0e4738";
    let mut stream =
        client.execute(traceparent(request("builtin.shell", "echo hi"), streamed)).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    let refused = "7bf92f3577b34da6a3ce929d0e0e4739";
    let missing = pb::GetExecutionRequest { execution_id: uuid_like(), ..Default::default() };
    let code = client.get_execution(traceparent(missing, refused)).await.unwrap_err().code();
    assert_eq!(code, tonic::Code::NotFound);
    // A method no service has: UNIMPLEMENTED, a server error by the conventions.
    let unknown = "8bf92f3577b34da6a3ce929d0e0e4740";
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/corral.v1.ExecutionService/NoSuchMethod");
    let codec = tonic_prost::ProstCodec::<pb::GetExecutionRequest, pb::Execution>::default();
    let answer = grpc.unary(traceparent(pb::GetExecutionRequest::default(), unknown), path, codec).await;
    assert_eq!(answer.unwrap_err().code(), tonic::Code::Unimplemented);
    stop(daemon).await;

    let spans = collector.spans.lock().unwrap();
    let server_span = |trace: &str, name: &str| {
        spans
            .iter()
            .find(|s| hex::encode(&s.trace_id) == trace && s.name == name)
            .unwrap_or_else(|| {
                panic!("no {name} span in {trace}: {:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>())
            })
            .clone()
    };
    let attribute = |span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str| {
        span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.clone()).and_then(|v| v.value)
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let execute = server_span(streamed, "corral.v1.ExecutionService/Execute");
    assert_eq!(execute.kind, 2, "SPAN_KIND_SERVER: {execute:?}");
    assert_eq!(hex::encode(&execute.parent_span_id), "00f067aa0ba902b7", "a child of the caller's span");
    assert_eq!(attribute(&execute, "rpc.system"), Some(Value::StringValue("grpc".into())));
    assert_eq!(attribute(&execute, "rpc.service"), Some(Value::StringValue("corral.v1.ExecutionService".into())));
    assert_eq!(attribute(&execute, "rpc.method"), Some(Value::StringValue("Execute".into())));
    assert_eq!(attribute(&execute, "rpc.grpc.status_code"), Some(Value::IntValue(0)), "from the stream's trailers");
    // The span lasted as long as the stream, which outlived the run's start.
    let execution = server_span(streamed, "execution");
    assert!(execute.end_time_unix_nano >= execution.start_time_unix_nano, "{execute:?}");
    let get = server_span(refused, "corral.v1.ExecutionService/GetExecution");
    assert_eq!(attribute(&get, "rpc.grpc.status_code"), Some(Value::IntValue(5)));
    assert_ne!(get.status.map(|s| s.code), Some(2), "NOT_FOUND is the caller's, not a server error");
    let unimplemented = server_span(unknown, "corral.v1.ExecutionService/NoSuchMethod");
    assert_eq!(attribute(&unimplemented, "rpc.grpc.status_code"), Some(Value::IntValue(12)));
    assert_eq!(unimplemented.status.map(|s| s.code), Some(2), "UNIMPLEMENTED is a server error");
}

fn uuid_like() -> String {
    "01900000-0000-7000-8000-000000000000".to_string()
}

/// A Claude Code profile whose "CLI" is a script (named `claude`, so a
/// session's later turn resumes it) that reports `u64::MAX` of every kind
/// of token, on its messages and on its result.
fn absurd_usage_profile(dir: &std::path::Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let max = u64::MAX;
    let usage = format!(
        r#""usage":{{"input_tokens":{max},"output_tokens":{max},"cache_read_input_tokens":{max},"cache_creation_input_tokens":{max}}}"#
    );
    let script = format!(
        "#!/bin/sh\ncat >/dev/null\n\
         echo '{{\"type\":\"system\",\"subtype\":\"init\",\"session_id\":\"conversation-1\",\"model\":\"m\"}}'\n\
         echo '{{\"type\":\"assistant\",\"message\":{{\"id\":\"m1\",\"model\":\"m\",\"content\":[{{\"type\":\"text\",\"text\":\"hi\"}}],{usage}}}}}'\n\
         echo '{{\"type\":\"assistant\",\"message\":{{\"id\":\"m2\",\"model\":\"m\",\"content\":[{{\"type\":\"text\",\"text\":\"hi\"}}],{usage}}}}}'\n\
         echo '{{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"done\",{usage}}}'\n"
    );
    let claude = bin.join("claude");
    std::fs::write(&claude, script).unwrap();
    std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "id = \"test.absurd-usage\"\nversion = \"1.0.0\"\n[rein]\npreset = \"claude_stream_json\"\ninput = \"prompt\"\n\
         argv = [{:?}]\n[sandbox]\ntype = \"linux_bwrap\"\nwrite_paths = [\".\"]\nread_paths = [{:?}]\n[limits]\n\
         timeout_seconds = 30\n",
        claude.display().to_string(),
        bin.display().to_string()
    )
}

/// One `{"prompt": "go"}` turn of session `id`: its `turn_finished`.
async fn prompt_turn(
    sessions: &mut corral::pb::session_service_client::SessionServiceClient<tonic::transport::Channel>,
    id: &str,
) -> pb::TurnFinished {
    let call = pb::ToolCall { tool: "prompt".into(), arguments_json: r#"{"prompt": "go"}"#.into() };
    let send = pb::SendTurnRequest { session_id: id.into(), tool_call: Some(call) };
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let mut stream = sessions.send_turn(send).await.expect("turn sent").into_inner();
        let mut finished = None;
        while let Some(event) = stream.message().await.expect("turn events") {
            if let Some(pb::lifecycle_event::Kind::TurnFinished(f)) = event.kind {
                finished = Some(*f);
            }
        }
        finished.expect("a turn_finished event")
    })
    .await
    .expect("the turn finishes")
}

/// A harness reporting `u64::MAX` tokens of every kind neither panics nor
/// wraps a count: each is bounded by `MAX_TOKENS`, so is their sum, the
/// execution and both turns of a session finish, and nothing stays counted
/// as running or alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_token_counts_are_bounded_and_every_run_finishes() {
    use corral::pb::session_service_client::SessionServiceClient;
    use corral::rein::MAX_TOKENS;
    use std::time::Duration;
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("absurd.toml"), absurd_usage_profile(dir.path())).unwrap();
    let port = common::unused_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let daemon = ServeProcess::start_with(&dir.path().join("data"), &profiles, &[], &extra).await;

    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let events = tokio::time::timeout(Duration::from_secs(60), async {
        let mut stream = client.execute(request("test.absurd-usage", "go")).await.unwrap().into_inner();
        let mut events = Vec::new();
        while let Some(event) = stream.message().await.unwrap() {
            events.push(event);
        }
        events
    })
    .await
    // A run whose task died would never finish.
    .expect("the execution finishes");
    let execution = common::finished(&events);
    assert_eq!(pb::ExecutionState::try_from(execution.state).unwrap(), pb::ExecutionState::Succeeded, "{execution:?}");
    assert_eq!(execution.evidence.as_ref().unwrap().tokens_spent, MAX_TOKENS);

    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.absurd-usage".into(), ..Default::default() };
    let id = sessions.create_session(create).await.expect("session created").into_inner().session_id;
    for turn in 1..=2u64 {
        let finished = prompt_turn(&mut sessions, &id).await;
        assert!(finished.ok, "turn {turn}: {finished:?}");
        assert_eq!((finished.turn, finished.tokens_spent), (turn, MAX_TOKENS), "{finished:?}");
    }
    let ended = sessions.end_session(pb::EndSessionRequest { session_id: id }).await.expect("ended").into_inner();
    // Two turns of MAX_TOKENS each: their sum is bounded again.
    assert_eq!(ended.evidence.expect("evidence").tokens_spent, MAX_TOKENS);

    let gauges = [
        ("corral_running", r#"kind="executions""#),
        ("corral_running", r#"kind="sessions""#),
        ("corral_sandboxes_alive", ""),
    ];
    let started = std::time::Instant::now();
    loop {
        let text = scrape(port).await;
        let values: Vec<Option<f64>> = gauges.iter().map(|(name, labels)| sample(&text, name, labels)).collect();
        if values.iter().all(|v| *v == Some(0.0)) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "still counted: {gauges:?} = {values:?}\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    daemon.stop().await;
}

/// A harness cannot put a flag on its next turn's command line: the
/// "conversation id" a Claude Code harness reports goes after `--resume`,
/// and one that is a flag (`--dangerously-skip-permissions`) would be the
/// CLI's. The fake CLI prints its arguments as its result: the second turn
/// is refused (no plain conversation id), and no run ever got the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_harness_cannot_put_a_flag_on_its_next_turns_command_line() {
    use corral::pb::session_service_client::SessionServiceClient;
    use std::os::unix::fs::PermissionsExt;
    require_bwrap();
    let dir = common::data_tempdir();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let claude = bin.join("claude");
    std::fs::write(
        &claude,
        "#!/bin/sh\ncat >/dev/null\n\
         echo '{\"type\":\"system\",\"subtype\":\"init\",\"session_id\":\"--dangerously-skip-permissions\",\"model\":\"m\"}'\n\
         printf '{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"args: %s\"}\\n' \"$*\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).unwrap();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let profile = format!(
        "id = \"test.flag-id\"\nversion = \"1.0.0\"\n[rein]\npreset = \"claude_stream_json\"\ninput = \"prompt\"\n\
         argv = [{:?}]\n[sandbox]\ntype = \"linux_bwrap\"\nwrite_paths = [\".\"]\nread_paths = [{:?}]\n[limits]\n\
         timeout_seconds = 30\n",
        claude.display().to_string(),
        bin.display().to_string()
    );
    std::fs::write(profiles.join("flag.toml"), profile).unwrap();
    let daemon = ServeProcess::start(&dir.path().join("data"), &profiles, &[]).await;
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create = pb::CreateSessionRequest { profile_ref: "test.flag-id".into(), ..Default::default() };
    let id = sessions.create_session(create).await.expect("session created").into_inner().session_id;
    let mut turns = Vec::new();
    for _ in 1..=2 {
        let finished = prompt_turn(&mut sessions, &id).await;
        turns.push(finished);
    }
    assert!(turns[0].ok && turns[0].output == "args: ", "the first run has no resume: {:?}", turns[0]);
    assert!(!turns[1].ok, "the second turn resumed with the harness's flag: {:?}", turns[1]);
    assert!(turns[1].raw_error.contains("never said which conversation"), "{:?}", turns[1]);
    for turn in &turns {
        assert!(!turn.output.contains("--dangerously"), "a run got the flag: {turn:?}");
    }
    let ended = sessions.end_session(pb::EndSessionRequest { session_id: id }).await.expect("ended").into_inner();
    let evidence = ended.evidence.expect("evidence");
    let argv = evidence.harness.map(|h| h.argv).unwrap_or_default();
    assert!(!argv.iter().any(|a| a.starts_with("--dangerously")), "{argv:?}");
    daemon.stop().await;
}

/// A refused repository leaves one `corral::audit` line naming who asked,
/// as every other refusal does (and why, which the caller is not told).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_repository_is_audited_with_its_principal() {
    use corral::pb::session_service_client::SessionServiceClient;
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    let daemon = ServeProcess::start(&data, &profiles, &[]).await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let mut req = request("builtin.shell", "true");
    req.repo = "/etc".into();
    let refused = client.execute(req).await.expect_err("a repository outside repo_roots is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let mut sessions = SessionServiceClient::new(daemon.channel().await);
    let create =
        pb::CreateSessionRequest { profile_ref: "builtin.shell".into(), repo: "/etc".into(), ..Default::default() };
    let refused = sessions.create_session(create).await.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let log = data.with_extension("log");
    let started = std::time::Instant::now();
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<String> = text.lines().filter(|l| l.contains("repository refused")).map(String::from).collect();
        if lines.len() >= 2 {
            break lines;
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "no two audit lines:\n{text}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    for line in lines {
        assert!(line.contains("corral::audit") && line.contains("principal=local-admin"), "{line}");
        assert!(line.contains("field=\"repo\"") && line.contains("reason="), "{line}");
    }
    daemon.stop().await;
}
