//! Black-box tests of the real `corral` binary: `corral serve` as a child
//! process on 127.0.0.1:0, the client commands against it, and a graceful
//! exit on SIGTERM.

mod common;

use std::path::Path;
use std::process::{Output, Stdio};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};

const CORRAL: &str = env!("CARGO_BIN_EXE_corral");

/// The `CORRAL_*` variables a developer's shell may carry; none may leak
/// into the commands under test.
fn clean(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CORRAL_") {
            command.env_remove(name);
        }
    }
    command
}

struct Served {
    child: Child,
    url: String,
    /// Drains stdout after the banner line, so the pipe never fills.
    drain: tokio::task::JoinHandle<String>,
}

async fn serve(data_dir: &Path, stderr_log: &Path) -> Served {
    serve_with(data_dir, stderr_log, None).await
}

/// The same, with a directory of profiles.
async fn serve_with(data_dir: &Path, stderr_log: &Path, profiles: Option<&Path>) -> Served {
    serve_configured(data_dir, stderr_log, profiles, "").await
}

/// The same, with more daemon config (TOML after the `[sandbox]` section).
async fn serve_configured(data_dir: &Path, stderr_log: &Path, profiles: Option<&Path>, extra_config: &str) -> Served {
    let log = std::fs::File::create(stderr_log).expect("stderr log file");
    // A uid range of its own: every root daemon claims its range host-wide,
    // and other suites may be running beside this one.
    let config = data_dir.with_extension("toml");
    std::fs::write(&config, format!("[sandbox]\nuids = {:?}\n{extra_config}", common::unique_uids())).unwrap();
    let mut command = Command::new(CORRAL);
    clean(&mut command);
    if let Some(profiles) = profiles {
        command.arg("serve").arg("--profiles").arg(profiles);
    } else {
        command.arg("serve");
    }
    let mut child = command
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .arg("--config")
        .arg(&config)
        // The tests' repositories are temporary directories.
        .env("CORRAL_REPO_ROOTS", std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .expect("corral serve starts");
    let stdout = child.stdout.take().expect("stdout piped");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    let read = reader.read_line(&mut line).await.expect("read serve stdout");
    assert!(
        read > 0,
        "corral serve printed nothing on stdout; stderr:\n{}",
        std::fs::read_to_string(stderr_log).unwrap_or_default()
    );
    let addr = line
        .trim()
        .strip_prefix("corral listening on ")
        .unwrap_or_else(|| panic!("unexpected first stdout line: {line:?}"))
        .to_string();
    let port: u16 = addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    assert_ne!(port, 0, "the daemon printed port 0");
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let drain = tokio::spawn(async move {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest).await;
        rest
    });
    let _ = addr;
    Served { child, url: format!("unix://{}", data_dir.join("corral.sock").display()), drain }
}

/// Runs `corral --server URL ARGS...` to completion.
async fn corral(url: &str, args: &[&str]) -> Output {
    clean(&mut Command::new(CORRAL))
        .arg("--server")
        .arg(url)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("corral runs")
}

fn text(output: &Output) -> (String, String) {
    (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned())
}

fn describe(args: &[&str], output: &Output) -> String {
    let (stdout, stderr) = text(output);
    format!("corral {args:?} exited {:?}\n--- stdout ---\n{stdout}--- stderr ---\n{stderr}", output.status.code())
}

fn json_lines(args: &[&str], output: &Output) -> Vec<serde_json::Value> {
    let (stdout, _) = text(output);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}\n{}", describe(args, output)))
        })
        .collect();
    assert!(!lines.is_empty(), "no JSON output\n{}", describe(args, output));
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_runs_lists_and_stops_on_sigterm() {
    common::require_bwrap();
    let tmp = common::data_tempdir();
    let stderr_log = tmp.path().join("serve.stderr");
    let mut served = serve(&tmp.path().join("data"), &stderr_log).await;
    let url = served.url.clone();
    let repo = common::git_repo();
    let repo_path = repo.path().to_str().unwrap().to_string();

    // A successful task: exit 0, the raw output, the finished line.
    let args = [
        "exec",
        "--profile",
        "builtin.shell",
        "--repo",
        &repo_path,
        "--title",
        "t",
        "--description",
        "echo hello-from-sandbox",
    ];
    let out = corral(&url, &args).await;
    let (stdout, _) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    assert!(stdout.contains("hello-from-sandbox"), "{}", describe(&args, &out));
    assert!(stdout.contains("finished"), "{}", describe(&args, &out));
    assert!(stdout.contains("state=succeeded"), "{}", describe(&args, &out));

    // A task that fails: exit 1.
    let args = [
        "exec",
        "--profile",
        "builtin.shell",
        "--repo",
        &repo_path,
        "--title",
        "t",
        "--description",
        "echo bad >&2; exit 3",
    ];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    assert!(text(&out).0.contains("state=failed"), "{}", describe(&args, &out));

    // A refused task: exit 1, with the reason.
    let args = ["exec", "--profile", "no.such", "--title", "t", "--description", "x"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    let (stdout, stderr) = text(&out);
    assert!(stdout.contains("state=refused"), "{}", describe(&args, &out));
    assert!(
        stdout.contains("unknown harness profile") || stderr.contains("unknown harness profile"),
        "{}",
        describe(&args, &out)
    );

    // Profiles.
    let args = ["profiles"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    assert!(text(&out).0.contains("builtin.shell@1.0.0"), "{}", describe(&args, &out));

    // ls, as JSON and as a table: the three executions, newest first.
    let args = ["--json", "ls"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let mut listed: Vec<(String, String)> = Vec::new();
    for line in json_lines(&args, &out) {
        for e in line["executions"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let id = e["executionId"].as_str().expect("executionId").to_string();
            let state = e["state"].as_str().unwrap_or_default().to_string();
            listed.push((id, state));
        }
    }
    let states: Vec<&str> = listed.iter().map(|(_, s)| s.as_str()).collect();
    assert_eq!(
        states,
        ["EXECUTION_STATE_REFUSED", "EXECUTION_STATE_FAILED", "EXECUTION_STATE_SUCCEEDED"],
        "{}",
        describe(&args, &out)
    );
    let first_id = listed.last().unwrap().0.clone();

    let args = ["ls"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let header = text(&out).0.lines().next().unwrap_or_default().to_string();
    for column in ["ID", "STATE", "PROFILE", "TITLE", "CREATED", "DURATION", "TOKENS", "COMMIT"] {
        assert!(header.split_whitespace().any(|c| c == column), "no {column} column: {header}");
    }
    for (id, _) in &listed {
        assert!(text(&out).0.contains(id.as_str()), "{id} not listed\n{}", describe(&args, &out));
    }

    // get, human and JSON.
    let args = ["get", first_id.as_str()];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let (stdout, _) = text(&out);
    assert!(stdout.contains(&first_id) && stdout.contains("succeeded"), "{}", describe(&args, &out));
    let args = ["--json", "get", first_id.as_str()];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let got = json_lines(&args, &out);
    assert_eq!(got.len(), 1, "{}", describe(&args, &out));
    assert_eq!(got[0]["executionId"], first_id.as_str());
    assert_eq!(got[0]["state"], "EXECUTION_STATE_SUCCEEDED");

    // get of an unknown id: the RPC fails, exit 2.
    let args = ["get", "no-such-execution"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(2), "{}", describe(&args, &out));
    assert!(text(&out).1.contains("NotFound"), "{}", describe(&args, &out));

    // exec --json: one JSON object per line, the last one `finished`.
    let args = [
        "exec",
        "--json",
        "--profile",
        "builtin.shell",
        "--repo",
        &repo_path,
        "--title",
        "t",
        "--description",
        "echo hello-json",
    ];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let events = json_lines(&args, &out);
    assert!(events.len() >= 3, "{}", describe(&args, &out));
    let last = events.last().unwrap();
    let execution = &last["finished"]["execution"];
    assert!(execution.is_object(), "last line is not finished: {last}");
    assert_eq!(execution["state"], "EXECUTION_STATE_SUCCEEDED", "{last}");
    assert!(execution["toolOutput"].as_str().unwrap_or_default().contains("hello-json"), "{last}");
    assert!(events[0]["accepted"].is_object(), "first line is not accepted: {}", events[0]);
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence"].as_str().and_then(|s| s.parse::<u64>().ok()), Some(i as u64 + 1), "{event}");
    }

    // SIGTERM: a graceful exit with code 0.
    let status = common::terminate(&mut served.child).await;
    let log = std::fs::read_to_string(&stderr_log).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("corral serve did not exit within 30 s of SIGTERM; stderr:\n{log}"));
    assert_eq!(status.code(), Some(0), "corral serve exited with {status:?}; stderr:\n{log}");
    let rest = served.drain.await.expect("stdout drained");
    assert!(!rest.contains("panicked"), "{rest}");
    assert!(!log.contains("panicked"), "{log}");

    // The sandboxes were all destroyed.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path().join("data/sandboxes"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "sandboxes left behind: {leftovers:?}");
}

/// `corral --json exec ... | head -1`: the reader goes away after one line;
/// the client says nothing and still exits with the run's outcome: 0 for a
/// run that succeeded, 1 for one that failed after the reader left.
/// `corral version` without a daemon prints this client's version and one
/// error line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_pipe_ends_quietly_and_version_works_without_a_daemon() {
    common::require_bwrap();
    let tmp = common::data_tempdir();
    let served = serve(&tmp.path().join("data"), &tmp.path().join("serve.stderr")).await;
    let script = "for i in $(seq 1 200); do echo line $i; done";
    let pipeline = format!(
        "{CORRAL} --server {} --json exec --profile builtin.shell --title t --description '{script}' | head -1",
        served.url
    );
    let out = clean(&mut Command::new("/bin/bash")).args(["-o", "pipefail", "-c", &pipeline]).output().await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stderr.is_empty(), "error text on a closed pipe: {stderr}");
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status.code());
    // The first line is read, the reader is gone, then the run fails.
    let pipeline = format!(
        "{CORRAL} --server {} --json exec --profile builtin.shell --title t --description 'sleep 1; exit 3' | head -1; \
         exit ${{PIPESTATUS[0]}}",
        served.url
    );
    let out = clean(&mut Command::new("/bin/bash")).args(["-c", &pipeline]).output().await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stderr.is_empty(), "error text on a closed pipe: {stderr}");
    assert_eq!(out.status.code(), Some(1), "a failed run piped into head: {stdout}{stderr}");
    // Gracefully: killed, it would leave its run's sandbox (cgroup included).
    let mut served = served;
    let status = common::terminate(&mut served.child).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "corral serve after SIGTERM: {status:?}");

    let gone = format!("unix://{}", tmp.path().join("no-such.sock").display());
    let out = corral(&gone, &["version"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(stdout.trim(), format!("corral {} (client)", env!("CARGO_PKG_VERSION")));
    assert_eq!(stderr.lines().count(), 1, "one error: {stderr}");
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
    assert_eq!(out.status.code(), Some(2));
}

/// `corral session watch` exits with the session's verdict, as `exec`
/// does with the execution's: 1 for a session the gate refused and for one
/// whose last turn failed, 0 for one whose turns and end went well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_watch_exits_with_the_sessions_outcome() {
    common::require_bwrap();
    let tmp = common::data_tempdir();
    let profiles = tmp.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("agent.toml"), common::session_agent_profile("test.session", "")).unwrap();
    let never = "[[guardrails.policies]]\nname = \"never\"\nkind = \"expr\"\n\
                 arguments = { expression = \"false\", reason = \"never\" }\n";
    std::fs::write(profiles.join("never.toml"), common::session_agent_profile("test.never", never)).unwrap();
    std::fs::write(profiles.join("stubborn.toml"), common::stubborn_profile()).unwrap();
    let served = serve_with(&tmp.path().join("data"), &tmp.path().join("serve.stderr"), Some(&profiles)).await;
    let url = served.url.clone();

    // A profile a run of would be refused says so, with the reason.
    let args = ["profiles"];
    let out = corral(&url, &args).await;
    let listed = text(&out).0;
    let claude = listed.lines().find(|l| l.starts_with("builtin.claude-code@")).unwrap_or_default().to_string();
    assert!(claude.contains("unusable (unknown credential route anthropic"), "{}", describe(&args, &out));

    // A session whose end fails: the raw cause, which only EndSession's
    // answer carries, is printed, and the exit code says it failed.
    let args = ["--json", "session", "create", "--profile", "test.stubborn"];
    let out = corral(&url, &args).await;
    let id = json_lines(&args, &out)[0]["sessionId"].as_str().expect("sessionId").to_string();
    let args = ["session", "end", id.as_str()];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    assert!(text(&out).0.contains("did not exit within"), "{}", describe(&args, &out));

    // A session with one turn, ended, then watched from its start.
    let watched = |arguments: &'static str, turn_code: i32| {
        let url = url.clone();
        async move {
            let args = ["--json", "session", "create", "--profile", "test.session"];
            let out = corral(&url, &args).await;
            assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
            let id = json_lines(&args, &out)[0]["sessionId"].as_str().expect("sessionId").to_string();
            let args = ["session", "turn", id.as_str(), "--arguments", arguments];
            let out = corral(&url, &args).await;
            assert_eq!(out.status.code(), Some(turn_code), "{}", describe(&args, &out));
            let args = ["session", "end", id.as_str()];
            let out = corral(&url, &args).await;
            assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
            let args = ["session", "watch", id.as_str()];
            let out = corral(&url, &args).await;
            (out.status.code(), describe(&args, &out))
        }
    };
    let (code, said) = watched(r#"{"echo": "fine"}"#, 0).await;
    assert_eq!(code, Some(0), "a session that went well: {said}");
    let (code, said) = watched(r#"{"fail": "on purpose"}"#, 1).await;
    assert_eq!(code, Some(1), "a session whose last turn failed: {said}");

    // Refused at agent_start: the session is stored, refused.
    let args = ["session", "create", "--profile", "test.never", "--id", "never"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(2), "{}", describe(&args, &out));
    let args = ["session", "watch", "local-admin/never"];
    let out = corral(&url, &args).await;
    assert!(text(&out).0.contains("finished"), "{}", describe(&args, &out));
    assert_eq!(out.status.code(), Some(1), "a refused session: {}", describe(&args, &out));

    let mut served = served;
    let status = common::terminate(&mut served.child).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "corral serve after SIGTERM: {status:?}");
}

/// `corral gate` is the dry run of the agent_start gate: it prints the
/// verdict and the policy that decided it, exits 1 when the gate denies
/// and 0 when it allows, and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_prints_the_verdict_and_the_deciding_policy_and_exits_with_it() {
    common::require_bwrap();
    let tmp = common::data_tempdir();
    let profiles = tmp.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(profiles.join("clean.toml"), common::session_agent_profile("test.clean", "")).unwrap();
    std::fs::write(profiles.join("forbidden.toml"), common::session_agent_profile("test.forbidden", "")).unwrap();
    let admin = "[[policies]]\nname = \"no-forbidden\"\nkind = \"expr\"\n\
                 arguments = { expression = \"!profile.startsWith('test.forbidden')\", reason = \"not here\" }\n";
    let data = tmp.path().join("data");
    let served = serve_configured(&data, &tmp.path().join("serve.stderr"), Some(&profiles), admin).await;
    let url = served.url.clone();

    let args = ["gate", "--profile", "test.forbidden"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    let (stdout, _) = text(&out);
    assert!(stdout.starts_with("gate agent_start action=deny\n"), "{}", describe(&args, &out));
    assert!(stdout.contains("  deny admin no-forbidden: \"not here\"\n"), "{}", describe(&args, &out));

    let args = ["--json", "gate", "--profile", "test.forbidden"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    let verdict = &json_lines(&args, &out)[0];
    assert_eq!(verdict["action"], "GATE_ACTION_DENY", "{verdict}");
    let decisions = verdict["decisions"].as_array().expect("decisions");
    assert!(
        decisions.iter().any(|d| d["policy"] == "no-forbidden"
            && d["action"] == "GATE_ACTION_DENY"
            && d["source"] == "POLICY_SOURCE_ADMIN"),
        "{verdict}"
    );

    let args = ["gate", "--profile", "test.clean"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    let (stdout, _) = text(&out);
    assert!(stdout.starts_with("gate agent_start action=allow\n"), "{}", describe(&args, &out));
    assert!(stdout.contains("sandbox=linux_bwrap network=denied"), "{}", describe(&args, &out));

    // A dry run: nothing was run or recorded.
    let args = ["--json", "ls"];
    let out = corral(&url, &args).await;
    assert_eq!(out.status.code(), Some(0), "{}", describe(&args, &out));
    assert!(
        json_lines(&args, &out)[0]["executions"].as_array().is_none_or(|e| e.is_empty()),
        "{}",
        describe(&args, &out)
    );

    let mut served = served;
    let status = common::terminate(&mut served.child).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0), "corral serve after SIGTERM: {status:?}");
}

/// `--json` is one JSON object per line wherever it is accepted: `doctor`
/// prints one per check and profile; the commands with no JSON output
/// (`serve`, `completions`, `man`) refuse it instead of ignoring it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_is_printed_by_doctor_and_refused_where_there_is_none() {
    async fn run(args: &[&str]) -> std::io::Result<Output> {
        clean(&mut Command::new(CORRAL)).args(args).stdin(Stdio::null()).output().await
    }
    for args in [&["--json", "serve"][..], &["--json", "completions", "bash"], &["--json", "man"]] {
        let out = run(args).await.unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{}", describe(args, &out));
        assert!(stdout.is_empty(), "{}", describe(args, &out));
        assert!(stderr.contains("--json") && stderr.contains(args[1]), "{}", describe(args, &out));
    }
    let args = &["--json", "doctor"];
    let out = run(args).await.unwrap();
    let lines = json_lines(args, &out);
    assert!(lines.iter().all(|l| l["ok"].is_boolean() && l["detail"].is_string()), "{}", describe(args, &out));
    let checks: Vec<&str> = lines.iter().filter_map(|l| l["check"].as_str()).collect();
    for check in ["bwrap", "sandbox", "seccomp", "cgroups", "egress"] {
        assert!(checks.contains(&check), "no {check} check: {}", describe(args, &out));
    }
    assert!(lines.iter().any(|l| l["profile"] == "builtin.shell@1.0.0"), "{}", describe(args, &out));
}

/// `corral bench --server` calls the daemon with the client's token
/// (`CORRAL_TOKEN`), as every other command does: without it the daemon's
/// TCP listener refuses the bench's first call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_against_a_server_sends_the_clients_token() {
    common::require_bwrap();
    let daemon = common::TestDaemon::start(common::Options::default()).await;
    let bench = |token: Option<String>| {
        let mut command = tokio::process::Command::new(CORRAL);
        command.args(["--server", &daemon.url, "bench", "latency", "--n", "1", "--warmup", "1"]);
        command.env_remove("CORRAL_TOKEN").env_remove("CORRAL_TOKEN_FILE").env_remove("CORRAL_SERVER");
        if let Some(token) = token {
            command.env("CORRAL_TOKEN", token);
        }
        command.output()
    };
    let refused = bench(None).await.unwrap();
    assert_ne!(refused.status.code(), Some(0), "no token, no bench");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("no credentials"), "{refused:?}");
    let out = bench(Some(daemon.admin_token())).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("(server daemon at http://"), "{stdout}");
    daemon.stop().await;
}

/// `corral doctor` judges each profile with the daemon's own gate and the
/// config's policies: a `require_approval` policy the harness cannot honour
/// refuses builtin.shell in both, naming `tool_call_gating`. A config the
/// daemon would not start with (a profile file with an unknown key, a
/// policy that does not compile, a warm pool it could not keep or that
/// would never fill, a principal's token it refuses, a missing TLS file)
/// makes doctor exit non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_judges_profiles_as_the_daemons_gate_does() {
    common::require_bwrap();
    let tmp = common::data_tempdir();
    let ask = "[[policies]]\nname = \"ask\"\nkind = \"require_approval\"\n";
    let data = tmp.path().join("data");
    let served = serve_configured(&data, &tmp.path().join("serve.stderr"), None, ask).await;
    let args = ["--json", "gate", "--profile", "builtin.shell"];
    let out = corral(&served.url, &args).await;
    assert_eq!(out.status.code(), Some(1), "{}", describe(&args, &out));
    let verdict = &json_lines(&args, &out)[0];
    assert!(verdict["decisions"].as_array().unwrap().iter().any(|d| d["policy"] == "tool_call_gating"), "{verdict}");
    let mut served = served;
    common::terminate(&mut served.child).await;

    // The daemon's own config file (serve_configured wrote it).
    let config = data.with_extension("toml");
    let doctor = |args: Vec<std::ffi::OsString>| async move {
        clean(&mut Command::new(CORRAL)).args(&args).stdin(Stdio::null()).output().await.unwrap()
    };
    let args: Vec<std::ffi::OsString> = vec!["--json".into(), "doctor".into(), "--config".into(), config.into()];
    let out = doctor(args.clone()).await;
    let lines = json_lines(&[], &out);
    let shell = lines.iter().find(|l| l["profile"] == "builtin.shell@1.0.0").expect("builtin.shell's line");
    assert_eq!(shell["ok"], false, "{shell}");
    assert!(shell["detail"].as_str().unwrap().contains("tool_call_gating"), "{shell}");
    assert_eq!(out.status.code(), Some(0), "the daemon starts with this config: {}", describe(&[], &out));

    let profiles = tmp.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let broken = common::session_agent_profile("test.broken", "").replace("[rein]", "bogus = 1\n[rein]");
    std::fs::write(profiles.join("broken.toml"), broken).unwrap();
    let mut broken_args = args.clone();
    broken_args.extend(["--profiles".into(), profiles.into()]);
    let out = doctor(broken_args).await;
    assert_eq!(out.status.code(), Some(1), "a catalog the daemon refuses: {}", describe(&[], &out));
    let catalog = json_lines(&[], &out).into_iter().find(|l| l["check"] == "catalog").expect("the catalog check");
    assert!(catalog["ok"] == false && catalog["detail"].as_str().unwrap().contains("bogus"), "{catalog}");

    let bad_policy = tmp.path().join("bad-policy.toml");
    std::fs::write(&bad_policy, "[[policies]]\nname = \"x\"\nkind = \"expr\"\narguments = { expression = \"(\" }\n")
        .unwrap();
    let out = doctor(vec!["doctor".into(), "--config".into(), bad_policy.into()]).await;
    assert_eq!(out.status.code(), Some(1), "a policy the daemon refuses: {}", describe(&[], &out));

    // A warm pool the daemon refuses to start with: one uid (as root, each
    // sandbox holds its own) for a pool of one and the runs beside it.
    let small = tmp.path().join("small-range.toml");
    std::fs::write(&small, "[sandbox]\nuids = \"1900300-1900300\"\nwarm = { \"builtin.noop\" = 1 }\n").unwrap();
    let out = doctor(vec!["--json".into(), "doctor".into(), "--config".into(), small.into()]).await;
    assert_eq!(out.status.code(), Some(1), "a pool the daemon refuses: {}", describe(&[], &out));
    let warm = json_lines(&[], &out).into_iter().find(|l| l["check"] == "warm pools").expect("the warm pools check");
    assert!(warm["ok"] == false && warm["detail"].as_str().unwrap().contains("sandbox.uids"), "{warm}");

    // A principal whose token `serve` refuses (too short), and a listener
    // certificate that is not there: each stops the daemon, so each is a
    // doctor's NO and exit 1.
    let token = tmp.path().join("short.token");
    std::fs::write(&token, "short").unwrap();
    let short = tmp.path().join("short-token.toml");
    let principal = format!(
        "[[principals]]\nname = \"tenant-a\"\ntype = \"agt\"\nprojects = [\"proj-a\"]\ntoken_file = {:?}\n",
        token.display().to_string()
    );
    std::fs::write(&short, principal).unwrap();
    let missing_cert = tmp.path().join("missing-cert.toml");
    std::fs::write(&missing_cert, "tls_cert = \"/nonexistent/cert.pem\"\ntls_key = \"/nonexistent/key.pem\"\n")
        .unwrap();
    for (config, check, said) in
        [(short, "principals", "principals[0].token_file"), (missing_cert, "tls", "/nonexistent/cert.pem")]
    {
        let out = doctor(vec!["--json".into(), "doctor".into(), "--config".into(), config.into()]).await;
        assert_eq!(out.status.code(), Some(1), "{check}: {}", describe(&[], &out));
        let line = json_lines(&[], &out).into_iter().find(|l| l["check"] == check).expect(check);
        assert!(line["ok"] == false && line["detail"].as_str().unwrap().contains(said), "{line}");
    }

    // A warm pool of a profile whose credential route would hand its key
    // over in clear (no upstream, no `expose`): no run of it resolves, so
    // the pool would never fill.
    let raw = tmp.path().join("raw-profiles");
    std::fs::create_dir_all(&raw).unwrap();
    let profile =
        "id = \"test.raw-route\"\nversion = \"1.0.0\"\ncredential_route_refs = [\"raw\"]\n[rein]\nargv = [\"/bin/true\"]\n\
         input = \"nothing\"\n[sandbox]\ntype = \"linux_bwrap\"\nwrite_paths = [\".\"]\n";
    std::fs::write(raw.join("raw.toml"), profile).unwrap();
    let config = tmp.path().join("raw-route.toml");
    std::fs::write(
        &config,
        "[sandbox]\nwarm = { \"test.raw-route\" = 1 }\n[credentials.routes.raw]\nfile = \"/etc/hostname\"\ninject_as = \"RAW_TOKEN\"\n",
    )
    .unwrap();
    let args =
        vec!["--json".into(), "doctor".into(), "--config".into(), config.into(), "--profiles".into(), raw.into()];
    let out = doctor(args).await;
    assert_eq!(out.status.code(), Some(1), "a pool that would never fill: {}", describe(&[], &out));
    let warm = json_lines(&[], &out).into_iter().find(|l| l["check"] == "warm pools").expect("the warm pools check");
    let detail = warm["detail"].as_str().unwrap();
    assert!(warm["ok"] == false && detail.contains("credential route raw has no upstream"), "{warm}");
}

/// Every client-side failure of a call exits 2, like an RPC that failed,
/// and names where the bad path came from: the flag or its variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_fails_before_the_rpc_exits_2() {
    /// Runs `corral ARGS` (with `VARIABLE=VALUE` when `env` names one):
    /// exit 2, and `said` in its error.
    async fn fails(args: &[&str], env: &[(&str, &str)], said: &str) {
        let out = clean(&mut Command::new(CORRAL))
            .args(["--server", "unix:///nonexistent/corral.sock"])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{env:?} {}", describe(args, &out));
        assert!(stderr.contains(said), "{env:?}: {said} not named: {}", describe(args, &out));
    }
    let exec = ["exec", "--profile", "builtin.shell", "--title", "t", "--description", "x"];
    fails(&[&["--token-file", "/missing/token"][..], &exec].concat(), &[], "--token-file /missing/token").await;
    fails(&exec, &[("CORRAL_TOKEN_FILE", "/missing/token")], "CORRAL_TOKEN_FILE /missing/token").await;
    fails(&exec, &[("CORRAL_CA", "/missing/ca.pem")], "CORRAL_CA /missing/ca.pem").await;
    let from_file = ["exec", "--profile", "builtin.shell", "--title", "t", "--description-file", "/missing/task"];
    fails(&from_file, &[], "/missing/task").await;
}

/// `corral doctor` and `corral completions` into a reader that is already
/// gone end as `corral man` does: quietly, exit 0, no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_and_completions_end_quietly_on_a_closed_pipe() {
    for args in [&["doctor", "--json"][..], &["completions", "bash"], &["man"]] {
        for _ in 0..5 {
            let mut child = clean(&mut Command::new(CORRAL))
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            // The reader goes away before the first write.
            drop(child.stdout.take());
            let out = child.wait_with_output().await.unwrap();
            let (_, stderr) = text(&out);
            assert_eq!(out.status.code(), Some(0), "corral {args:?} into a closed pipe: {stderr}");
            assert!(!stderr.contains("panicked"), "corral {args:?}: {stderr}");
        }
    }
}

/// The commands that talk to no daemon do not offer the client options
/// (`--server`, `--token-file`, TLS files) in their help or man page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_without_a_daemon_do_not_offer_the_client_options() {
    for args in [&["doctor", "--help"][..], &["completions", "--help"], &["man", "--help"], &["man", "doctor"]] {
        let out = clean(&mut Command::new(CORRAL)).args(args).stdin(Stdio::null()).output().await.unwrap();
        let (stdout, _) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{}", describe(args, &out));
        for option in ["server", "token-file", "--ca", "--cert", "--key"] {
            assert!(!stdout.contains(option), "{args:?} offers {option}:\n{stdout}");
        }
    }
    let out = clean(&mut Command::new(CORRAL)).args(["exec", "--help"]).output().await.unwrap();
    let (stdout, _) = text(&out);
    assert!(stdout.contains("--server") && stdout.contains("--token-file"), "{stdout}");
    // bash completion offers what each command takes: clap_complete's
    // script lists hidden options too.
    let out = clean(&mut Command::new(CORRAL)).args(["completions", "bash"]).output().await.unwrap();
    let (script, _) = text(&out);
    // The `opts=` line after the case `<command>)` of the completion function.
    let offered = |command: &str| -> String {
        let case = format!("{command})");
        let mut lines = script.lines().skip_while(|l| l.trim() != case);
        assert!(lines.next().is_some(), "no case {case} in:\n{script}");
        lines.find(|l| l.trim_start().starts_with("opts=")).expect("its opts line").to_string()
    };
    for command in ["corral__subcmd__doctor", "corral__subcmd__completions", "corral__subcmd__serve"] {
        let opts = offered(command);
        for option in ["--server", "--token-file", "--ca", "--cert", "--key"] {
            assert!(!opts.split_whitespace().any(|o| o == option), "{command} offers {option}: {opts}");
        }
    }
    for command in ["corral__subcmd__exec", "corral__subcmd__session__subcmd__turn"] {
        let opts = offered(command);
        assert!(opts.contains("--server") && opts.contains("--token-file"), "{command}: {opts}");
    }
    assert!(offered("corral").contains("--server"), "the top level offers the client options");
}
