//! The workspace comes back safely and completely: whatever the agent does
//! to its `.git`, no host repository reaches the origin and no code runs on
//! the host; uncommitted work comes back as a snapshot; the agent's own
//! commits work and come back.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{finished, git, git_repo, request, require_bwrap, Options, TestDaemon};
use corral::pb;

/// A host repository the agent must never get: one commit with a secret.
fn secret_repo() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    git(dir.path(), &["init", "-q", "-b", "main"]);
    std::fs::write(dir.path().join("SECRET.txt"), "host secret 7f3a\n").unwrap();
    git(dir.path(), &["add", "."]);
    git(dir.path(), &["-c", "user.name=h", "-c", "user.email=h@h.invalid", "commit", "-qm", "secret"]);
    let sha = git(dir.path(), &["rev-parse", "HEAD"]);
    (dir, sha)
}

async fn daemon(timeout_seconds: u64) -> TestDaemon {
    require_bwrap();
    TestDaemon::start(Options {
        config: Box::new(move |c| c.git.timeout_seconds = timeout_seconds),
        ..Options::default()
    })
    .await
}

async fn run_on(daemon: &TestDaemon, origin: &Path, script: &str) -> pb::Execution {
    let mut req = request("builtin.shell", script);
    req.repo = origin.display().to_string();
    finished(&daemon.execute(req).await)
}

fn has_object(repo: &Path, sha: &str) -> bool {
    std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["cat-file", "-e", sha])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn corral_ref(repo: &Path, id: &str) -> Option<String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["rev-parse", "--verify", "-q", &format!("refs/corral/{id}")])
        .output()
        .unwrap();
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_trick_on_dot_git_brings_a_host_repository_back() {
    let daemon = daemon(30).await;
    let (secret, secret_sha) = secret_repo();
    let s = secret.path().display();
    let tricks = [
        ("gitfile", format!("rm -rf .git && printf 'gitdir: {s}/.git\\n' > .git")),
        ("symlink", format!("rm -rf .git && ln -s {s}/.git .git")),
        ("objects", format!("rm -rf .git/objects && ln -s {s}/.git/objects .git/objects && echo {secret_sha} > .git/HEAD")),
        (
            "alternates",
            format!("mkdir -p .git/objects/info && echo {s}/.git/objects > .git/objects/info/alternates && echo {secret_sha} > .git/HEAD"),
        ),
    ];
    for (name, script) in tricks {
        let origin = git_repo();
        let execution = run_on(&daemon, origin.path(), &script).await;
        let evidence = execution.evidence.clone().unwrap();
        assert!(!has_object(origin.path(), &secret_sha), "{name}: the host repository's commit reached the origin");
        assert_ne!(evidence.commit_sha, secret_sha, "{name}");
        assert_ne!(corral_ref(origin.path(), &execution.execution_id).as_deref(), Some(secret_sha.as_str()), "{name}");
        assert_eq!(evidence.failure_stage, pb::FailureStage::Teardown as i32, "{name}: {execution:?}");
        assert!(
            evidence.notes.iter().any(|n| n.contains("workspace could not be brought back")),
            "{name}: {:?}",
            evidence.notes
        );
        assert!(execution.tool_error.contains("workspace capture"), "{name}: {}", execution.tool_error);
        assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32, "{name}");
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_head_or_a_huge_packed_refs_ends_within_the_git_timeout() {
    let timeout = 4;
    let daemon = daemon(timeout).await;
    let origin = git_repo();
    let started = Instant::now();
    let execution = run_on(&daemon, origin.path(), "rm .git/HEAD && mkfifo .git/HEAD && echo fifo").await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(timeout + 20), "the run took {took:?}");
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Teardown as i32);
    assert!(execution.tool_error.contains("did not finish within"), "{}", execution.tool_error);
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    assert!(daemon.leftover_sandboxes().await.is_empty(), "{:?}", daemon.leftover_sandboxes().await);

    let origin = git_repo();
    let script = r##"python3 - <<'EOF'
head = open(".git/refs/heads/main").read().strip() if __import__("os").path.exists(".git/refs/heads/main") else None
import subprocess
head = head or subprocess.check_output(["git", "rev-parse", "HEAD"]).decode().strip()
with open(".git/packed-refs", "w") as f:
    f.write("# pack-refs with: peeled fully-peeled sorted\n")
    for i in range(100000):
        f.write("%s refs/heads/b%06d\n" % (head, i))
EOF
echo more >> README.md"##;
    let started = Instant::now();
    let execution = run_on(&daemon, origin.path(), script).await;
    assert!(started.elapsed() < Duration::from_secs(timeout + 20), "took {:?}", started.elapsed());
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_tricks_never_run_code_on_the_host() {
    let daemon = daemon(30).await;
    let host = tempfile::tempdir().unwrap();
    let m = host.path().display();
    let script = format!(
        r#"git config core.fsmonitor "touch {m}/fsmonitor"
git config core.pager "touch {m}/pager"
git config filter.evil.clean "touch {m}/clean; cat"
git config filter.evil.smudge "touch {m}/smudge; cat"
git config filter.evil.process "touch {m}/process"
git config uploadpack.packObjectsHook "touch {m}/packobjects"
git config credential.helper "!touch {m}/credential"
git config core.hooksPath .git/hooks
echo "* filter=evil" > .gitattributes
for h in post-checkout reference-transaction pre-commit post-commit fsmonitor-watchman pre-auto-gc; do
  printf '#!/bin/sh\ntouch {m}/hook-%s\n' "$h" > .git/hooks/$h; chmod +x .git/hooks/$h
done
echo uncommitted >> README.md"#
    );
    let origin = git_repo();
    let execution = run_on(&daemon, origin.path(), &script).await;
    let markers: Vec<_> = std::fs::read_dir(host.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(markers.is_empty(), "code ran on the host: {markers:?}");
    // The capture runs in the sandbox with hooks and fsmonitor off, but
    // with the agent's filters: its `git add` starts the process filter,
    // which exits without the protocol's handshake, and git dies of that
    // (a filter need not be `required` to stop `git add`). So the capture
    // fails, and the run says so instead of claiming success; the origin
    // gets nothing.
    assert_eq!(execution.state, pb::ExecutionState::Failed as i32, "{execution:?}");
    let evidence = execution.evidence.clone().unwrap();
    assert_eq!(evidence.failure_stage, pb::FailureStage::Teardown as i32, "{execution:?}");
    assert_eq!(execution.tool_error, "teardown: workspace capture: git add failed", "{execution:?}");
    assert!(evidence.notes.iter().any(|n| n.contains("workspace could not be brought back")), "{:?}", evidence.notes);
    assert_eq!(evidence.commit_sha, "");
    assert_eq!(corral_ref(origin.path(), &execution.execution_id), None);
    assert_eq!(evidence.sandbox_destroy, pb::TeardownResult::Succeeded as i32);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origins_own_config_runs_nothing_on_the_host_during_the_fetch_back() {
    let daemon = daemon(30).await;
    let host = tempfile::tempdir().unwrap();
    let m = host.path().display();
    let set = |origin: &Path, key: &str, value: &str| git(origin, &["config", key, value]);
    // What the origin's owner may put in its config and hooks: each would
    // run as the daemon when host git works in the origin (the clone, the
    // checks of the room, the fetch back).
    let other = git_repo();
    let hooked = git_repo();
    let origin = hooked.path();
    std::fs::write(origin.join(".git/objects/info/alternates"), format!("{}/.git/objects\n", other.path().display()))
        .unwrap();
    set(origin, "core.alternateRefsCommand", &format!("touch {m}/alternate-refs; true"));
    set(origin, "core.fsmonitor", &format!("touch {m}/fsmonitor; false"));
    // A bundle to download first: a connection to this listener.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    set(origin, "fetch.bundleURI", &format!("http://{}/x.bundle", listener.local_addr().unwrap()));
    set(origin, "protocol.http.allow", "always");
    set(origin, "fetch.recurseSubmodules", "true");
    set(origin, "gc.auto", "1");
    for hook in ["reference-transaction", "pre-auto-gc", "post-checkout", "post-merge"] {
        let path = origin.join(".git/hooks").join(hook);
        std::fs::write(&path, format!("#!/bin/sh\ntouch {m}/hook-{hook}\n")).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    // A rewrite of every absolute path (the bundle's among them) into a
    // command, with that transport allowed.
    let rewriting = git_repo();
    set(rewriting.path(), "protocol.ext.allow", "always");
    set(rewriting.path(), &format!("url.ext::sh -c touch% {m}/rewritten.insteadOf"), "/");

    let work = "echo work > work.txt && git add work.txt && git commit -qm work && echo committed";
    for origin in [hooked.path(), rewriting.path()] {
        let execution = run_on(&daemon, origin, work).await;
        let markers: Vec<_> = std::fs::read_dir(host.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(markers.is_empty(), "the origin's config ran code on the host: {markers:?}");
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
        let evidence = execution.evidence.unwrap();
        assert_eq!(evidence.agent_commits, 1);
        let head = corral_ref(origin, &execution.execution_id).expect("the fetch back still brings refs/corral/<id>");
        assert_eq!(evidence.commit_sha, head);
        assert_eq!(git(origin, &["show", &format!("{head}:work.txt")]), "work");
    }
    assert!(listener.accept().is_err(), "host git reached the network for the origin's fetch.bundleURI");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_inside_a_repository_is_not_a_repository() {
    let daemon = daemon(30).await;
    let origin = git_repo();
    std::fs::create_dir(origin.path().join("src")).unwrap();
    std::fs::write(origin.path().join("src/lib.rs"), "").unwrap();
    let mut client = daemon.executions().await;
    let mut req = request("builtin.shell", "true");
    req.repo = origin.path().join("src").display().to_string();
    let status = client.execute(req).await.expect_err("a subdirectory of a repository was accepted");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), "repo: is not an allowed repository");
    let listed = client.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    assert!(listed.executions.is_empty(), "a refused request was stored");
    // Its top level is one, and a bare repository is one.
    let bare = tempfile::tempdir().unwrap();
    git(bare.path(), &["clone", "-q", "--bare", &origin.path().display().to_string(), "."]);
    for repo in [origin.path(), bare.path()] {
        let execution = run_on(&daemon, repo, "echo new > new.txt").await;
        assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}: {execution:?}", repo.display());
        let head = corral_ref(repo, &execution.execution_id).expect("refs/corral/<id>");
        assert_eq!(git(repo, &["show", &format!("{head}:new.txt")]), "new");
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncommitted_edits_come_back_as_a_snapshot() {
    let daemon = daemon(30).await;
    let origin = git_repo();
    let execution = run_on(&daemon, origin.path(), "echo edited >> README.md; echo new > new.txt").await;
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    let evidence = execution.evidence.unwrap();
    assert!(evidence.workspace_snapshot);
    assert_eq!(evidence.agent_commits, 0);
    let head = corral_ref(origin.path(), &execution.execution_id).expect("refs/corral/<id>");
    assert_eq!(evidence.commit_sha, head);
    let readme = git(origin.path(), &["show", &format!("{head}:README.md")]);
    assert!(readme.ends_with("edited"), "{readme}");
    assert_eq!(git(origin.path(), &["show", &format!("{head}:new.txt")]), "new");
    assert_eq!(git(origin.path(), &["log", "-1", "--format=%an <%ae>", &head]), "corral <corral@localhost>");
    daemon.stop().await;
}

/// A daemon with `test.narrow` (a shell harness that may write only
/// `out/`) and a repository that has an `out/`.
async fn narrowed() -> (TestDaemon, tempfile::TempDir) {
    require_bwrap();
    let narrow = r#"id = "test.narrow"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["out"]
[limits]
timeout_seconds = 60
"#;
    let daemon =
        TestDaemon::start(Options { profiles: vec![("narrow.toml".into(), narrow.into())], ..Options::default() })
            .await;
    let origin = git_repo();
    std::fs::create_dir(origin.path().join("out")).unwrap();
    std::fs::write(origin.path().join("out/.keep"), "").unwrap();
    git(origin.path(), &["add", "."]);
    git(origin.path(), &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "out"]);
    (daemon, origin)
}

/// A run that may write only some paths of its workspace gets its edits
/// back as a snapshot too: the capture writes `.git`, which the run had
/// read-only (every run that wrote anything ended `git add failed` at
/// teardown), while the run itself still could not write outside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_under_narrowed_write_paths_come_back_as_a_snapshot() {
    let (daemon, origin) = narrowed().await;
    let script = "echo made > out/made.txt; (echo x >> README.md) 2>/dev/null && echo README-WRITABLE; true";
    let mut req = request("test.narrow", script);
    req.repo = origin.path().display().to_string();
    let execution = finished(&daemon.execute(req).await);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    assert!(!execution.tool_output.contains("README-WRITABLE"), "{}", execution.tool_output);
    let evidence = execution.evidence.unwrap();
    assert!(evidence.workspace_snapshot, "{evidence:?}");
    let head = corral_ref(origin.path(), &execution.execution_id).expect("refs/corral/<id>");
    assert_eq!(git(origin.path(), &["show", &format!("{head}:out/made.txt")]), "made");
    assert_eq!(git(origin.path(), &["show", &format!("{head}:README.md")]), "sample");
    daemon.stop().await;
}

/// A run that may write only `out/` brings nothing else back through the
/// capture, which writes the whole workspace: the agent's HOME (writable
/// all run long) configured a git clean filter for every file, which
/// would commit a README.md of its own onto HEAD when the capture's
/// `git add` cleans `out/new.txt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_home_config_does_not_write_through_the_capture() {
    let (daemon, origin) = narrowed().await;
    // Once: git may clean the file again (the commit refreshes the index).
    let filter = "[ -e /tmp/agent-done ] && exec cat\n\
                  touch /tmp/agent-done; cd /workspace || exit 1\n\
                  echo pwned > README.md 2>/dev/null || exit 1\n\
                  export GIT_INDEX_FILE=/tmp/agent-index\n\
                  git read-tree HEAD && git update-index --add README.md && t=$(git write-tree) && \
                  c=$(git commit-tree \"$t\" -p HEAD -m mine) && git update-ref HEAD \"$c\"\n\
                  cat\n";
    let script = format!(
        "(echo x >> README.md) 2>/dev/null && echo README-WRITABLE\n\
         printf '%s' '{filter}' > $HOME/f.sh\n\
         git config --global user.name a && git config --global user.email a@a.invalid\n\
         git config --global filter.x.clean \"sh $HOME/f.sh\"\n\
         echo '* filter=x' > $HOME/.gitattributes && git config --global core.attributesFile $HOME/.gitattributes\n\
         mkdir -p $HOME/.config/git && cp $HOME/.gitattributes $HOME/.config/git/attributes\n\
         echo new > out/new.txt && echo configured"
    );
    let mut req = request("test.narrow", &script);
    req.repo = origin.path().display().to_string();
    let execution = finished(&daemon.execute(req).await);
    assert!(execution.tool_output.contains("configured"), "{}", execution.tool_output);
    assert!(!execution.tool_output.contains("README-WRITABLE"), "{}", execution.tool_output);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    let head = corral_ref(origin.path(), &execution.execution_id).expect("out/new.txt comes back");
    assert_eq!(git(origin.path(), &["show", &format!("{head}:out/new.txt")]), "new");
    for commit in git(origin.path(), &["rev-list", &head]).lines() {
        let readme = git(origin.path(), &["show", &format!("{commit}:README.md")]);
        assert_eq!(readme, "sample", "commit {commit} came back with the agent's README.md");
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_commit_with_the_provided_identity_comes_back() {
    let daemon = daemon(30).await;
    let origin = git_repo();
    let script = "echo work > work.txt && git add work.txt && git commit -qm 'agent work' && echo committed";
    let execution = run_on(&daemon, origin.path(), script).await;
    assert!(
        execution.tool_output.contains("committed"),
        "git commit failed inside: {} {}",
        execution.tool_output,
        execution.tool_error
    );
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{}", execution.tool_error);
    let evidence = execution.evidence.unwrap();
    assert!(!evidence.workspace_snapshot);
    assert_eq!(evidence.agent_commits, 1);
    let head = corral_ref(origin.path(), &execution.execution_id).expect("refs/corral/<id>");
    assert_eq!(evidence.commit_sha, head);
    assert_eq!(
        git(origin.path(), &["log", "-1", "--format=%an <%ae>|%s", &head]),
        "corral agent <agent@corral.invalid>|agent work"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_under_repo_roots_pointing_outside_is_invalid() {
    require_bwrap();
    let roots = tempfile::tempdir().unwrap();
    let outside = git_repo();
    std::os::unix::fs::symlink(outside.path(), roots.path().join("link")).unwrap();
    let inside = roots.path().join("inside");
    std::fs::create_dir(&inside).unwrap();
    git(&inside, &["init", "-q"]);
    let root = roots.path().to_path_buf();
    let daemon =
        TestDaemon::start(Options { config: Box::new(move |c| c.repo_roots = vec![root]), ..Options::default() }).await;
    let mut client = daemon.executions().await;
    let mut req = request("builtin.shell", "true");
    req.repo = roots.path().join("link").display().to_string();
    let status = client.execute(req).await.expect_err("a symlink out of repo_roots");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("repo"), "{}", status.message());
    let listed = client.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    assert!(listed.executions.is_empty(), "a rejected request was stored");
    // A real repository under the root still works.
    let mut req = request("builtin.shell", "echo ran");
    req.repo = inside.display().to_string();
    let mut stream = client.execute(req).await.expect("a repository under the root").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        events.push(event);
    }
    let execution = finished(&events);
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert_eq!(execution.repo, inside.canonicalize().unwrap().display().to_string());
    assert_eq!(execution.tool_output.trim(), "ran");
    // A repository with no commit and a task that made none: nothing to
    // bring back.
    let evidence = execution.evidence.unwrap();
    assert_eq!(evidence.commit_sha, "");
    assert!(!evidence.workspace_snapshot);
    assert_eq!(corral_ref(&inside, &execution.execution_id), None);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_hung_capture_exits_within_the_grace() {
    use corral::pb::execution_service_client::ExecutionServiceClient;
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let data = dir.path().join("data");
    // A capture that would wait ten minutes on the FIFO; a 2 s grace.
    let env = [("CORRAL_SHUTDOWN_GRACE_SECONDS", "2")];
    let mut daemon = common::ServeProcess::start_with(&data, &profiles, &env, "[git]\ntimeout_seconds = 600\n").await;
    let mut client = ExecutionServiceClient::new(daemon.channel().await);
    let origin = git_repo();
    let mut req = request("builtin.shell", "rm .git/HEAD && mkfifo .git/HEAD && echo fifo");
    req.repo = origin.path().display().to_string();
    let id = client.start_execution(req).await.unwrap().into_inner().execution_id;
    // Wait for the harness to be done: the capture is then hanging.
    let watch = pb::WatchRequest { execution_id: id, after_sequence: 0 };
    let mut stream = client.watch_execution(watch).await.unwrap().into_inner();
    while let Some(event) = stream.message().await.unwrap() {
        if matches!(event.kind, Some(pb::lifecycle_event::Kind::Dispatched(_))) {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(30), daemon.child.wait()).await.expect("exits").unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(started.elapsed() < Duration::from_secs(12), "SIGTERM took {:?}", started.elapsed());
    let left: Vec<_> = std::fs::read_dir(data.join("sandboxes")).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
}
