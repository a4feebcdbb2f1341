//! The success path with the real bwrap backend and the fake agent: the
//! commit comes back to the origin, and the sandbox really isolates.

mod common;

use common::{evidence, finished, git, kinds, processes_with, request, require_bwrap, Options, TestDaemon};
use corral::pb::{self, lifecycle_event::Kind, FailureStage, Outcome};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_harness_commit_is_fetched_back_under_refs_corral() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let repo = common::git_repo();
    let base = git(repo.path(), &["rev-parse", "HEAD"]);
    let mut req = request("test.fake-agent", "");
    req.repo = repo.path().display().to_string();
    let events = daemon.execute(req).await;
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!(Outcome::try_from(ev.outcome).unwrap(), Outcome::Succeeded, "{}", execution.tool_error);
    assert_eq!(ev.commit_sha.len(), 40);
    assert_ne!(ev.commit_sha, base, "the agent committed");
    let fetched = git(repo.path(), &["rev-parse", &format!("refs/corral/{}", execution.execution_id)]);
    assert_eq!(fetched, ev.commit_sha);
    let notes = git(repo.path(), &["show", &format!("{fetched}:AGENT_NOTES.md")]);
    assert!(notes.contains(&execution.execution_id), "{notes}");
    // The origin's own branch and work tree are untouched.
    assert_eq!(git(repo.path(), &["rev-parse", "HEAD"]), base);
    assert!(!repo.path().join("AGENT_NOTES.md").exists());
    assert!(daemon.leftover_sandboxes().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_new_commit_no_ref_is_written() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    let repo = common::git_repo();
    let base = git(repo.path(), &["rev-parse", "HEAD"]);
    let mut req = request("test.fake-agent", "NOWORK");
    req.repo = repo.path().display().to_string();
    let execution = finished(&daemon.execute(req).await);
    let _ = base;
    assert_eq!(evidence(&execution).commit_sha, "", "nothing came back: no commit, not the base");
    assert_eq!(git(repo.path(), &["for-each-ref", "refs/corral"]), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_cannot_reach_the_network_nor_write_outside_its_workspace() {
    require_bwrap();
    use std::os::unix::fs::PermissionsExt;
    let daemon = TestDaemon::start(Options::default()).await;
    let repo = common::git_repo();
    let outside = tempfile::tempdir().unwrap();
    // Writable by anyone: only the sandbox's mounts can keep the harness's
    // uid from writing there (the test runs as root).
    for dir in [outside.path(), repo.path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let outside_file = outside.path().join("escaped.txt");
    let origin_file = repo.path().join("escaped.txt");
    // On the host's loopback: reachable from anything sharing its network.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let description = format!(
        "NOWORK\nPROBE_NETWORK {}\nPROBE_WRITE {}\nPROBE_WRITE {}\nPROBE_WRITE /usr/escaped.txt\nPROBE_WRITE /escaped.txt\nPROBE_WRITE /etc/escaped.txt\nPROBE_WRITE /workspace/inside.txt\nPROBE_WRITE /tmp/scratch.txt\nPROBE_WRITE /etc/passwd\nPROBE_WRITE /etc/group\nPROBE_SELF",
        listener.local_addr().unwrap(),
        outside_file.display(),
        origin_file.display()
    );
    let mut req = request("test.fake-agent", &description);
    req.repo = repo.path().display().to_string();
    let events = daemon.execute(req).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(out.contains("network: unreachable"), "{out}");
    assert!(listener.accept().is_err(), "a connection from the sandbox reached the host's loopback");
    assert!(out.contains(&format!("write {}: denied", outside_file.display())), "{out}");
    assert!(out.contains(&format!("write {}: denied", origin_file.display())), "{out}");
    assert!(out.contains("write /usr/escaped.txt: denied"), "{out}");
    assert!(out.contains("write /escaped.txt: denied"), "the sandbox root is read-only: {out}");
    assert!(out.contains("write /etc/escaped.txt: denied"), "{out}");
    assert!(out.contains("write /workspace/inside.txt: ok"), "{out}");
    assert!(out.contains("write /tmp/scratch.txt: ok"), "{out}");
    // Its identity files are its own, and read-only.
    assert!(out.contains("write /etc/passwd: denied"), "{out}");
    assert!(out.contains("write /etc/group: denied"), "{out}");
    assert!(out.contains("self user=agent home=/home/agent group=agent"), "{out}");
    assert!(!outside_file.exists() && !origin_file.exists(), "a file escaped the sandbox");
    let ready = events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::SandboxReady(ready)) => Some(ready.clone()),
            _ => None,
        })
        .expect("a sandbox_ready event");
    let receipt = ready.receipt.unwrap();
    assert!(receipt.network_isolated);
    assert_eq!(receipt.command_digest.len(), 64);
    assert_eq!(receipt.write_roots, ["/tmp", "/dev/shm", "/home/agent", "/workspace"]);
    assert_eq!(pb::SandboxType::try_from(ready.backend).unwrap(), pb::SandboxType::LinuxBwrap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flooded_output_is_capped_and_reported() {
    require_bwrap();
    let daemon = TestDaemon::start(Options::default()).await;
    // The fake agent's profile caps each stream at 64 KiB.
    let events = daemon.execute(request("test.fake-agent", "NOWORK\nFLOOD 512K")).await;
    let execution = finished(&events);
    assert_eq!(Outcome::try_from(evidence(&execution).outcome).unwrap(), Outcome::Succeeded);
    let truncated: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::OutputTruncated(t)) => Some(*t),
            _ => None,
        })
        .collect();
    assert_eq!(truncated.len(), 1, "{:?}", kinds(&events));
    assert_eq!(truncated[0].stream(), pb::OutputStream::Stdout);
    assert!(truncated[0].bytes_dropped >= 512 * 1024 - 65536, "{}", truncated[0].bytes_dropped);
    assert!(execution.tool_output.len() <= 65536 + 1024);
}

/// Output past the cap is reported even when the run is cut at its timeout
/// (the harness never ends its turn itself): one event per stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_dropped_before_a_timeout_is_reported() {
    require_bwrap();
    let profile = r#"id = "test.flood-hang"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
write_paths = ["."]
[limits]
timeout_seconds = 2
max_output_bytes = 1000
"#;
    let options = Options { profiles: vec![("flood-hang.toml".into(), profile.into())], ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    let line = "x".repeat(99);
    let script = format!("i=0; while [ $i -lt 50 ]; do echo {line}; echo {line} >&2; i=$((i+1)); done; sleep 30");
    let events = daemon.execute(request("test.flood-hang", &script)).await;
    let execution = finished(&events);
    assert!(execution.tool_error.contains("timed out"), "{}", execution.tool_error);
    let mut truncated: Vec<(pb::OutputStream, u64)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::OutputTruncated(t)) => Some((t.stream(), t.bytes_dropped)),
            _ => None,
        })
        .collect();
    truncated.sort();
    assert_eq!(
        truncated.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![pb::OutputStream::Stdout, pb::OutputStream::Stderr],
        "{:?}",
        kinds(&events)
    );
    assert!(truncated.iter().all(|t| t.1 >= 5000 - 1000), "{truncated:?}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_harness_is_killed_at_its_timeout_with_its_whole_group() {
    require_bwrap();
    // The marker rides in argv (not the task) so the test can find every
    // process of this harness in /proc.
    let marker = format!("HANG-MARKER-{}", std::process::id());
    let profile = common::fake_agent_profile("test.hang", "")
        .replace("timeout_seconds = 30", "timeout_seconds = 2")
        .replace("fake_agent.py\"]", &format!("fake_agent.py\", \"{marker}\"]"));
    assert!(profile.contains(&marker), "the marker is not in the harness's argv:\n{profile}");
    let options = Options { profiles: vec![("hang.toml".into(), profile)], ..Options::default() };
    let daemon = TestDaemon::start(options).await;
    let mut client = daemon.executions().await;
    let mut stream = client.execute(request("test.hang", "NOWORK\nHANG")).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        let dispatched = matches!(event.kind, Some(Kind::Dispatched(_)));
        events.push(event);
        if dispatched {
            break;
        }
    }
    // The harness hangs until its 2 s timeout: it must be seen running,
    // or "none survived" below would hold for a harness that never ran.
    let mut running = 0;
    for _ in 0..100 {
        running = processes_with(&marker);
        if running > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(running > 0, "the hanging harness was never seen running ({:?})", kinds(&events));
    while let Some(event) = stream.message().await.expect("the execution's stream") {
        events.push(event);
    }
    let execution = finished(&events);
    let ev = evidence(&execution);
    assert_eq!(FailureStage::try_from(ev.failure_stage).unwrap(), FailureStage::Execution);
    assert!(execution.tool_error.contains("timed out"), "{}", execution.tool_error);
    assert_eq!(processes_with(&marker), 0, "a harness process survived its timeout ({running} were running)");
    assert!(daemon.leftover_sandboxes().await.is_empty());
}

/// A Claude Code profile whose "CLI" is a probe of the managed hook from
/// inside: what the settings file says, and whether the agent can write,
/// remove, move or chmod it or add a file beside it. Then it says it is
/// `waiting` (a file in `/workspace/out` when that is there, else in the
/// workspace) and waits up to 20 s for `go` beside it, so the test can
/// look at the sandbox from the host while it runs. It answers with Claude
/// Code's `result` line. `sandbox` is the rest of its `[sandbox]`.
fn hook_probe_profile(id: &str, sandbox: &str) -> String {
    format!(
        r#"id = "{id}"
version = "1.0.0"
[rein]
preset = "claude_stream_json"
input = "prompt"
argv = ["/usr/bin/python3", "-c", '''
import json, os
f = "/etc/claude-code/managed-settings.json"
out = []
try:
    s = json.load(open(f))
    hook = s["hooks"]["PreToolUse"][0]["hooks"][0]
    out.append("settings: managed-only=%s url=%s" % (s.get("allowManagedHooksOnly"), hook.get("url")))
except Exception as e:
    out.append("settings: missing (%s)" % type(e).__name__)
probes = [
    ("write", lambda: open(f, "a").write("{{}}")),
    ("remove", lambda: os.remove(f)),
    ("rename", lambda: os.rename(f, f + ".old")),
    ("create", lambda: open("/etc/claude-code/managed-settings.d", "w")),
    ("chmod", lambda: os.chmod(f, 0o666)),
]
for name, probe in probes:
    try:
        probe()
        out.append(name + ": ok")
    except OSError:
        out.append(name + ": denied")
import time
d = "/workspace/out" if os.path.isdir("/workspace/out") else "/workspace"
open(d + "/waiting", "w").close()
for _ in range(200):
    if os.path.exists(d + "/go"):
        break
    time.sleep(0.1)
print(json.dumps({{"type": "result", "subtype": "success", "is_error": False, "result": "\n".join(out)}}))
''']
[sandbox]
type = "linux_bwrap"
{sandbox}
[limits]
timeout_seconds = 30
"#
    )
}

/// Inside a real sandbox of a gated Claude Code profile, under an admin
/// `tool_call:Bash` deny, the managed settings are corral's and the agent
/// can neither change, remove, move nor chmod them, nor add a file beside
/// them; on the host's disk the sandbox has only its workspace and HOME
/// (bwrap has the settings from a descriptor, and a relative write path
/// from the one after it).
/// And no read path can hide them: validation refuses one over /etc
/// (`gating`), and one that reaches /etc through a symlink (which
/// validation cannot see) is refused as the sandbox starts, a read path
/// being bound from a descriptor opened with no symlink on the way (and
/// were it bound, it is mounted before the hook, over which bwrap could
/// not put the hook): the harness never runs without its hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_managed_hook_is_corrals_read_only_and_no_read_path_hides_it() {
    use std::os::unix::fs::PermissionsExt;
    require_bwrap();
    // `<dir>/etc` -> /etc, through a relative link: bwrap resolves it on
    // the host for the source (the host's /etc) and in the new root for
    // the destination (the sandbox's /etc, holding the hook).
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let up = "../".repeat(dir.path().components().count() - 1);
    std::os::unix::fs::symlink(format!("{up}etc"), dir.path().join("etc")).unwrap();
    assert!(dir.path().join("etc/passwd").exists(), "the link reaches the host's /etc");
    let linked = format!(
        "write_paths = [\".\"]\nread_paths = [{:?}, {:?}]",
        dir.path().display(),
        dir.path().join("etc").display()
    );
    let deny = corral::policy::PolicySpec {
        name: "no-bash".into(),
        kind: "expr".into(),
        arguments: serde_json::json!({"expression": "false", "reason": "Bash is not allowed here"}),
        on: vec!["tool_call:Bash".into()],
    };
    let daemon = TestDaemon::start(Options {
        profiles: vec![
            ("probe.toml".into(), hook_probe_profile("test.hook-probe", "write_paths = [\"out\"]")),
            ("linked.toml".into(), hook_probe_profile("test.hook-linked", &linked)),
        ],
        config: Box::new(move |c| c.policies.push(deny)),
        ..Options::default()
    })
    .await;

    // A read-only workspace with one relative write path, bound from the
    // descriptor after the settings'.
    let repo = common::git_repo();
    std::fs::create_dir(repo.path().join("out")).unwrap();
    std::fs::write(repo.path().join("out/.keep"), "").unwrap();
    git(repo.path(), &["add", "."]);
    git(repo.path(), &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "out"]);
    let mut req = request("test.hook-probe", "probe");
    req.repo = repo.path().display().to_string();
    let probe = tokio::spawn({
        let mut client = daemon.executions().await;
        async move {
            let mut stream = client.execute(req).await.unwrap().into_inner();
            let mut events = Vec::new();
            while let Some(event) = stream.message().await.unwrap() {
                events.push(event);
            }
            events
        }
    });
    let sandboxes = daemon.data_dir().join("sandboxes");
    let waiting = || {
        std::fs::read_dir(&sandboxes)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|root| root.join("workspace/out/waiting").exists())
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let root = loop {
        if let Some(root) = waiting() {
            break root;
        }
        assert!(!probe.is_finished(), "the probe ended before it waited: {:?}", finished(&probe.await.unwrap()));
        assert!(std::time::Instant::now() < deadline, "timed out waiting for the probe to run");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let mut on_disk: Vec<String> =
        std::fs::read_dir(&root).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    on_disk.sort();
    std::fs::write(root.join("workspace/out/go"), "").unwrap();
    let execution = finished(&probe.await.unwrap());
    assert_eq!(on_disk, ["home", "workspace"], "the sandbox's root on the host holds more");
    let out = &execution.tool_output;
    assert_eq!(execution.state, pb::ExecutionState::Succeeded as i32, "{execution:?}");
    assert!(out.contains("settings: managed-only=True url=http://127.0.0.1:3129/v1/pre-tool-use"), "{out}");
    for probe in ["write", "remove", "rename", "create", "chmod"] {
        assert!(out.contains(&format!("{probe}: denied")), "{probe}: {out}");
    }

    let events = daemon.execute(request("test.hook-linked", "probe")).await;
    let execution = finished(&events);
    let out = &execution.tool_output;
    assert!(!out.contains("settings: missing"), "the harness ran with its hook hidden: {out}");
    assert_ne!(execution.state, pb::ExecutionState::Succeeded as i32, "{:?}: {out}", kinds(&events));
    let error = &execution.tool_error;
    let link = dir.path().join("etc");
    assert!(
        error.contains(&format!(
            "read path {:?} cannot be bound from the host: {link:?} is a symlink",
            link.display().to_string()
        )),
        "the symlinked read path was refused: {error}"
    );
    daemon.stop().await;
}
