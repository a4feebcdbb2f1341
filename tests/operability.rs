//! What operators look at: JSON logs that carry the execution's id, and
//! Prometheus metrics.

mod common;

use common::{request, require_bwrap, ServeProcess};
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
    let mut stream = client.execute(request("builtin.shell", "echo hi")).await.unwrap().into_inner();
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
    let of_run: Vec<_> = lines.iter().filter(|l| l["span"]["execution_id"] == id.as_str()).collect();
    assert!(
        of_run.iter().any(|l| l["fields"]["message"] == "execution finished"),
        "no line of the execution carries its id: {log}"
    );
}
