//! The client examples of `examples/` (Python with grpcio, TypeScript with
//! @grpc/grpc-js), run end to end through their own `run.sh` against a real
//! daemon: a task executed with live events, an execution watched from a
//! sequence and resumed after a disconnect, and the google.rpc error details
//! of bad calls. Both print the same lines, so one set of checks reads both.
//!
//! The first run installs each example's pinned packages (PyPI, npm) into
//! its own directory; later runs reuse them.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Options, TestDaemon};
use corral::pb;

/// One run of an example: its exit code, each stdout line with the time it
/// arrived, and its stderr.
struct Run {
    code: Option<i32>,
    lines: Vec<(Duration, String)>,
    stderr: String,
}

impl Run {
    fn stdout(&self) -> String {
        self.lines.iter().map(|(_, l)| format!("{l}\n")).collect()
    }

    fn has(&self, line_start: &str) -> bool {
        self.lines.iter().any(|(_, l)| l.starts_with(line_start))
    }

    fn first(&self, line_start: &str) -> Option<&(Duration, String)> {
        self.lines.iter().find(|(_, l)| l.starts_with(line_start))
    }

    /// The `event SEQ KIND ...` lines, as (sequence, kind, whole line).
    fn events(&self) -> Vec<(u64, String, String)> {
        self.lines
            .iter()
            .filter_map(|(_, line)| {
                let mut words = line.strip_prefix("event ")?.split(' ');
                let sequence = words.next()?.parse().ok()?;
                Some((sequence, words.next()?.to_string(), line.clone()))
            })
            .collect()
    }

    /// The lines of `probe NAME` up to the next probe.
    fn probe(&self, name: &str) -> Vec<String> {
        let start = format!("probe {name}");
        self.lines
            .iter()
            .map(|(_, l)| l)
            .skip_while(|l| !l.starts_with(&start))
            .enumerate()
            .take_while(|(i, l)| *i == 0 || !l.starts_with("probe "))
            .map(|(_, l)| l.clone())
            .collect()
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {:?}\n--- stdout\n{}--- stderr\n{}", self.code, self.stdout(), self.stderr)
    }
}

struct Example {
    name: &'static str,
    dir: PathBuf,
    /// A copy of the checkout's `examples/<name>` and `proto/`, which the
    /// example runs from and must not write to.
    copy: tempfile::TempDir,
}

/// Every path under `root` with its length: what a run must leave as it is.
fn tree(root: &Path) -> Vec<(PathBuf, u64)> {
    let mut all = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                pending.push(entry.path());
            }
            all.push((entry.path(), if meta.is_dir() { 0 } else { meta.len() }));
        }
    }
    all.sort();
    all
}

impl Example {
    fn new(name: &'static str) -> Example {
        let checkout = Path::new(env!("CARGO_MANIFEST_DIR"));
        let copy = tempfile::tempdir().unwrap();
        let copy_dir = |from: &Path, to: &Path| {
            // The sources only: what a fresh checkout holds.
            let status = std::process::Command::new("cp").arg("-r").arg(from).arg(to).status().unwrap();
            assert!(status.success());
            for built in [".venv", ".gen", "node_modules", "dist", ".setup.lock"] {
                let _ = std::fs::remove_dir_all(to.join(built));
                let _ = std::fs::remove_file(to.join(built));
            }
        };
        std::fs::create_dir_all(copy.path().join("examples")).unwrap();
        copy_dir(&checkout.join("examples").join(name), &copy.path().join("examples").join(name));
        copy_dir(&checkout.join("proto"), &copy.path().join("proto"));
        Example { name, dir: copy.path().join("examples").join(name), copy }
    }

    /// What the example's copy of the checkout holds now.
    fn checkout(&self) -> Vec<(PathBuf, u64)> {
        tree(self.copy.path())
    }

    /// Runs `run.sh ARGS...`, reading its stdout line by line as it comes.
    async fn run(&self, args: &[&str], limit: Duration) -> Run {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt};
        let mut child = tokio::process::Command::new(self.dir.join("run.sh"))
            .args(args)
            // Built once per machine, outside any checkout.
            .env("CORRAL_EXAMPLES_OUT", std::env::temp_dir().join("corral-examples-tests"))
            // The examples read these; the test says everything on the command line.
            .env_remove("CORRAL_SERVER")
            .env_remove("CORRAL_TOKEN")
            .env_remove("CORRAL_TOKEN_FILE")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}/run.sh: {e}", self.dir.display()));
        let mut stderr_pipe = child.stderr.take().unwrap();
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr_pipe.read_to_string(&mut text).await;
            text
        });
        let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let started = Instant::now();
        let mut lines = Vec::new();
        let read = tokio::time::timeout(limit, async {
            while let Ok(Some(line)) = stdout.next_line().await {
                lines.push((started.elapsed(), line));
            }
            child.wait().await
        })
        .await;
        let code = match read {
            Ok(status) => status.expect("wait for run.sh").code(),
            Err(_) => {
                let _ = child.kill().await;
                let run = Run { code: None, lines, stderr: stderr.await.unwrap() };
                panic!("{} run.sh {args:?} did not finish within {limit:?}:\n{run}", self.name);
            }
        };
        Run { code, lines, stderr: stderr.await.unwrap() }
    }
}

/// Fails, never skips, when the example's toolchain is missing.
fn require_tools(example: &Example) {
    let check = |program: &str, args: &[&str], hint: &str| {
        let out = std::process::Command::new(program).args(args).output();
        match out {
            Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_string(),
            Ok(out) => panic!(
                "the {} example needs {program}: `{program} {}` failed: {}; {hint}",
                example.name,
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!("the {} example needs {program} ({e}); {hint}", example.name),
        }
    };
    match example.name {
        "python" => {
            check(
                "python3",
                &["-c", "import sys, venv, ensurepip; assert sys.version_info >= (3, 9), sys.version"],
                "install Python 3.9+ with its venv module (Debian: python3 python3-venv)",
            );
        }
        _ => {
            let version = check("node", &["--version"], "install Node.js 18+ (Debian: nodejs)");
            let major: u32 = version.trim_start_matches('v').split('.').next().unwrap_or("0").parse().unwrap_or(0);
            assert!(major >= 18, "the typescript example needs Node.js 18+, this is {version}");
            check("npm", &["--version"], "install npm (Debian: npm)");
        }
    }
}

/// A task whose events come over a couple of seconds: one progress line,
/// a pause, then its result.
const SLOW_TASK: &str = r#"echo '{"type":"progress","message":"step 1","tokens":10}'
sleep 2
echo '{"type":"result","ok":true,"output":"done MARKER","tokens_spent":10}'"#;

/// A task with several progress events, for the watcher.
const STEPS_TASK: &str = r#"for i in 1 2 3 4; do
  echo "{\"type\":\"progress\",\"message\":\"secret step $i\",\"tokens\":$i}"
  sleep 0.4
done
echo '{"type":"result","ok":true,"output":"stepped"}'"#;

const STEP: Duration = Duration::from_secs(120);

async fn exercise(example: Example) {
    require_tools(&example);
    let daemon = TestDaemon::start(Options::default()).await;
    let _ = daemon.channel().await; // the socket answers
    let unix = format!("unix://{}", daemon.socket().display());
    let tcp = daemon.addr.to_string();
    let token_file = daemon.data_dir().join("admin.token");
    let token_file = token_file.to_str().unwrap();

    // The first run installs the pinned packages: give it time, apart from
    // the timed steps below.
    let before = example.checkout();
    let setup = example.run(&["--help"], Duration::from_secs(900)).await;
    assert_eq!(setup.code, Some(0), "{} setup:\n{setup}", example.name);
    assert_eq!(example.checkout(), before, "{}: run.sh wrote into the checkout", example.name);

    // (1) Execute with live events, over the unix socket (the local admin).
    let marker = format!("{}-{}", example.name, uuid::Uuid::now_v7().simple());
    let task = SLOW_TASK.replace("MARKER", &marker);
    let run =
        example.run(&["--server", &unix, "execute", "--title", "example task", "--description", &task], STEP).await;
    assert_eq!(run.code, Some(0), "execute exits 0 when the execution succeeded:\n{run}");
    let events = run.events();
    let sequences: Vec<u64> = events.iter().map(|e| e.0).collect();
    assert_eq!(sequences, (1..=events.len() as u64).collect::<Vec<_>>(), "sequences 1..n:\n{run}");
    let kinds: Vec<&str> = events.iter().map(|e| e.1.as_str()).collect();
    let mut expected =
        ["accepted", "resolved", "gated", "sandbox_ready", "dispatched", "progress", "teardown", "finished"]
            .into_iter()
            .peekable();
    for kind in &kinds {
        if expected.peek() == Some(kind) {
            expected.next();
        }
    }
    assert_eq!(expected.next(), None, "the events in the contract's order, got {kinds:?}:\n{run}");
    assert_eq!(kinds.last(), Some(&"finished"), "{run}");
    let (_, _, progress) = events.iter().find(|e| e.1 == "progress").unwrap();
    assert!(progress.ends_with("message=step 1"), "the direct caller sees the harness's words:\n{run}");
    assert!(events.iter().any(|e| e.2.contains("backend=SANDBOX_TYPE_LINUX_BWRAP")), "{run}");
    assert!(events.last().unwrap().2.contains("state=EXECUTION_STATE_SUCCEEDED outcome=OUTCOME_SUCCEEDED"), "{run}");
    assert!(run.has(&format!("output: done {marker}")), "the raw output, for the direct caller:\n{run}");
    let id = run
        .first("execution ")
        .and_then(|(_, l)| l.strip_suffix(" EXECUTION_STATE_SUCCEEDED"))
        .and_then(|l| l.strip_prefix("execution "))
        .unwrap_or_else(|| panic!("no `execution ID EXECUTION_STATE_SUCCEEDED` line:\n{run}"))
        .to_string();
    // Printed as they arrived: the progress line came before the harness's
    // two-second pause was over, not with the rest at the end.
    let arrived = |kind: &str| {
        let (at, _) = run.lines.iter().find(|(_, l)| l.starts_with("event ") && l.contains(kind)).unwrap();
        *at
    };
    let (progress_at, finished_at) = (arrived(" progress "), arrived(" finished "));
    assert!(
        finished_at.saturating_sub(progress_at) >= Duration::from_secs(1),
        "progress at {progress_at:?}, finished at {finished_at:?}: events were not printed as they arrived:\n{run}"
    );
    // What the example printed is what the daemon recorded.
    let stored = daemon.watch_all(&id, 0).await;
    assert_eq!(stored.len(), events.len(), "the daemon's events of {id}:\n{run}");
    assert_eq!(common::finished(&stored).state, pb::ExecutionState::Succeeded as i32);

    // Exit 0 only on success: a failing task exits 1 with the state.
    let run = example.run(&["--server", &unix, "execute", "--description", "echo doomed >&2; exit 3"], STEP).await;
    assert_eq!(run.code, Some(1), "execute exits 1 when the execution failed:\n{run}");
    assert!(run.events().last().is_some_and(|e| e.2.contains("state=EXECUTION_STATE_FAILED")), "{run}");
    assert!(
        run.lines.iter().any(|(_, l)| l.starts_with("execution ") && l.ends_with(" EXECUTION_STATE_FAILED")),
        "{run}"
    );

    // (2) Watch from a sequence: started detached, watched after sequence 2,
    // dropped after three events and resumed from the last one seen.
    let run = example.run(&["--server", &unix, "execute", "--detach", "--description", STEPS_TASK], STEP).await;
    assert_eq!(run.code, Some(0), "{run}");
    let id = run
        .first("execution ")
        .and_then(|(_, l)| l.strip_prefix("execution ")?.strip_suffix(" EXECUTION_STATE_RUNNING"))
        .unwrap_or_else(|| panic!("no `execution ID EXECUTION_STATE_RUNNING` line:\n{run}"))
        .to_string();
    let run = example.run(&["--server", &unix, "watch", &id, "--after", "2", "--disconnect-after", "3"], STEP).await;
    assert_eq!(run.code, Some(0), "watch exits 0 when the execution succeeded:\n{run}");
    let events = run.events();
    let sequences: Vec<u64> = events.iter().map(|e| e.0).collect();
    assert_eq!(sequences, (3..3 + events.len() as u64).collect::<Vec<_>>(), "from sequence 3, no gap:\n{run}");
    let stdout = run.stdout();
    let dropped = stdout.find("disconnecting after sequence 5\n");
    let resumed = stdout.find(&format!("resuming {id} after 5\n"));
    let six = stdout.find("event 6 ");
    assert!(dropped.is_some() && resumed > dropped && six > resumed, "dropped after 5, resumed at 6:\n{run}");
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("finished"), "{run}");
    assert!(events.iter().filter(|e| e.1 == "progress").count() >= 4, "every progress event:\n{run}");
    assert!(!stdout.contains("secret step"), "a watcher never sees the harness's words:\n{run}");
    let last = events.last().unwrap().0;
    assert!(run.has(&format!("watched {} events, sequences 3..{last}, no gap, no duplicate", events.len())), "{run}");
    assert!(run.has(&format!("execution {id} EXECUTION_STATE_SUCCEEDED")), "{run}");
    assert_eq!(daemon.watch_all(&id, 0).await.len() as u64, last, "the daemon's last sequence");

    // (3) Error details, over TCP with the admin token: the ErrorInfo reason
    // and the BadRequest field from the grpc-status-details-bin trailer.
    let run = example.run(&["--server", &tcp, "--token-file", token_file, "errors"], STEP).await;
    assert_eq!(run.code, Some(0), "{run}");
    let title = run.probe("title of 2000 bytes");
    for line in [
        "  status INVALID_ARGUMENT (3): title: at most 1024 bytes",
        "  error_info reason=INVALID_ARGUMENT domain=corral.dev field=title",
        "  bad_request field=title description=at most 1024 bytes",
    ] {
        assert!(title.iter().any(|l| l.starts_with(line)), "the over-long title: no line {line:?}:\n{run}");
    }
    let unknown = run.probe("watch an unknown execution");
    assert!(unknown.iter().any(|l| l.starts_with("  status NOT_FOUND (5): execution no-such-")), "{run}");
    assert!(unknown.iter().any(|l| l == "  error_info reason=NOT_FOUND domain=corral.dev"), "{run}");
    // `x@not-semver`: the edge parses every profile ref before anything
    // else of the request (`validate::execute_request`), version and all,
    // so the call itself fails with INVALID_ARGUMENT naming
    // harness_profile_ref, and no execution is made to be refused later.
    let bad_ref = run.probe("bad profile ref 'x@not-semver'");
    let why = r#"use `id` or `id@version`: "not-semver" is not semver: "#;
    for line in [
        format!("  status INVALID_ARGUMENT (3): harness_profile_ref: {why}"),
        "  error_info reason=INVALID_ARGUMENT domain=corral.dev field=harness_profile_ref".to_string(),
        format!("  bad_request field=harness_profile_ref description={why}"),
    ] {
        assert!(bad_ref.iter().any(|l| l.starts_with(&line)), "the bad profile ref: no line {line:?}:\n{run}");
    }
    assert!(!bad_ref.iter().any(|l| l.starts_with("  no error status")), "refused past the edge:\n{run}");
    // A ref whose characters are bad is refused at the edge by every daemon.
    let run =
        example.run(&["--server", &unix, "errors", "--profile", "not a ref!", "--title-bytes", "1025"], STEP).await;
    assert_eq!(run.code, Some(0), "{run}");
    let bad_ref = run.probe("bad profile ref 'not a ref!'");
    assert!(bad_ref.iter().any(|l| l.starts_with("  status INVALID_ARGUMENT (3): harness_profile_ref")), "{run}");
    assert!(
        bad_ref.iter().any(|l| l == "  error_info reason=INVALID_ARGUMENT domain=corral.dev field=harness_profile_ref"),
        "{run}"
    );
    assert!(bad_ref.iter().any(|l| l.starts_with("  bad_request field=harness_profile_ref description=")), "{run}");
    assert!(run.probe("title of 1025 bytes").iter().any(|l| l.starts_with("  bad_request field=title")), "{run}");

    // TCP without a token: UNAUTHENTICATED with its reason, exit 2.
    let run = example.run(&["--server", &tcp, "execute"], STEP).await;
    assert_eq!(run.code, Some(2), "a failed call exits 2:\n{run}");
    assert!(run.has("  status UNAUTHENTICATED (16): "), "{run}");
    assert!(run.has("  error_info reason=UNAUTHENTICATED domain=corral.dev"), "{run}");
    // With the token the same call over TCP runs.
    let run = example
        .run(&["--server", &tcp, "--token-file", token_file, "execute", "--description", "echo over tcp"], STEP)
        .await;
    assert_eq!(run.code, Some(0), "{run}");
    assert!(run.has("output: over tcp"), "{run}");

    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_example_executes_watches_and_reads_error_details() {
    exercise(Example::new("python")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typescript_example_executes_watches_and_reads_error_details() {
    exercise(Example::new("typescript")).await;
}
