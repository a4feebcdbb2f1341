//! Tenants stay apart: two `agt` principals, `tenant-a` (project `pa`) and
//! `tenant-b` (project `pb`), on one real daemon with real bubblewrap and
//! real git. tenant-b attacks what tenant-a has — its repositories, the
//! objects its agent brought back, its session and request ids — and
//! learns nothing.

mod common;

use std::path::{Path, PathBuf};

use common::{finished, git, require_bwrap, Options, TestDaemon};
use corral::auth::PrincipalConfig;
use corral::pb;
use corral::pb::execution_service_client::ExecutionServiceClient;
use corral::pb::session_service_client::SessionServiceClient;
use tonic::transport::Channel;
use tonic::Code;

const TOKEN_A: &str = "tenant-a-token-0123456789abcdef0123456789";
const TOKEN_B: &str = "tenant-b-token-0123456789abcdef0123456789";

/// Runs its task description with `sh -s` in a bwrap sandbox.
const SHELL: &str = r#"id = "test.sh"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-s"]
input = "description"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = ["."]
[limits]
timeout_seconds = 60
"#;

fn session_profile() -> String {
    common::session_agent_profile("test.session", "")
}

fn tenant(name: &str, project: &str, token: &str, repos: Vec<PathBuf>) -> PrincipalConfig {
    use sha2::Digest;
    PrincipalConfig {
        name: name.into(),
        kind: "agt".into(),
        projects: vec![project.into()],
        token_sha256: Some(hex::encode(sha2::Sha256::digest(token.as_bytes()))),
        repos,
        ..Default::default()
    }
}

/// The repository roots of one test: `<tmp>/roots`, with `pa/` and `pb/`
/// the tenants' own prefixes and `shared/` for both.
struct Roots {
    dir: tempfile::TempDir,
}

impl Roots {
    fn new() -> Roots {
        let dir = common::data_tempdir();
        for sub in ["roots/pa", "roots/pb", "roots/shared"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        Roots { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("roots")
    }

    /// A git repository with one commit at `path`.
    fn repo(&self, path: &Path) -> PathBuf {
        std::fs::create_dir_all(path).unwrap();
        git(path, &["init", "-q", "-b", "main"]);
        std::fs::write(path.join("README.md"), "sample\n").unwrap();
        git(path, &["add", "."]);
        git(path, &["-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "init"]);
        path.to_path_buf()
    }
}

async fn daemon(roots: &Roots, b_repos: Vec<PathBuf>) -> TestDaemon {
    let root = roots.root();
    let a_repos = vec![root.join("pa"), root.join("shared")];
    TestDaemon::start(Options {
        profiles: vec![("sh.toml".into(), SHELL.into()), ("session.toml".into(), session_profile())],
        config: Box::new(move |c| {
            c.repo_roots = vec![root];
            c.principals.push(tenant("tenant-a", "pa", TOKEN_A, a_repos));
            c.principals.push(tenant("tenant-b", "pb", TOKEN_B, b_repos));
        }),
        ..Options::default()
    })
    .await
}

/// `message` as a request of the principal holding `token`.
fn as_tenant<T>(token: &str, message: T) -> tonic::Request<T> {
    common::with_token(token, message)
}

async fn tcp(daemon: &TestDaemon) -> Channel {
    Channel::from_shared(daemon.url.clone()).unwrap().connect().await.unwrap()
}

fn shell(project: &str, repo: &Path, script: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        harness_profile_ref: "test.sh".into(),
        repo: repo.display().to_string(),
        title: "t".into(),
        description: script.into(),
        project: project.into(),
        ..Default::default()
    }
}

async fn execute(client: &mut ExecutionServiceClient<Channel>, token: &str, req: pb::ExecuteRequest) -> pb::Execution {
    let mut stream = client.execute(as_tenant(token, req)).await.expect("execute accepted").into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("stream ok") {
        events.push(event);
    }
    finished(&events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_outside_the_roots_or_the_principals_repos_is_refused_with_one_answer() {
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let outside = roots.repo(&roots.dir.path().join("outside/secret-repo"));
    let a_repo = roots.repo(&root.join("pa/repo"));
    let b_repo = roots.repo(&root.join("pb/repo"));
    std::fs::create_dir_all(root.join("pb/plain-dir")).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("pb/link-out")).unwrap();
    std::os::unix::fs::symlink("../pa/repo", root.join("pb/link-to-a")).unwrap();
    let daemon = daemon(&roots, vec![root.join("pb")]).await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    let before = daemon.engine.store.row_counts().await.unwrap();

    let attempts: Vec<(&str, PathBuf)> = vec![
        ("a root-only host file", PathBuf::from("/etc/shadow")),
        ("a missing path", PathBuf::from("/nonexistent/repo")),
        ("an existing repository outside the roots", outside.clone()),
        ("tenant-a's repository", a_repo.clone()),
        ("a missing path under its own prefix", root.join("pb/missing")),
        ("a directory that is no repository", root.join("pb/plain-dir")),
        ("a symlink out of the root", root.join("pb/link-out")),
        ("a symlink into tenant-a's prefix", root.join("pb/link-to-a")),
    ];
    let mut answers = Vec::new();
    for (what, path) in &attempts {
        let status = client
            .start_execution(as_tenant(TOKEN_B, shell("pb", path, "true")))
            .await
            .expect_err(&format!("{what} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        answers.push((what, status.message().to_string()));
    }
    for (what, message) in &answers {
        assert_eq!(message, "repo: is not an allowed repository", "{what} reads differently");
    }
    assert_eq!(daemon.engine.store.row_counts().await.unwrap(), before, "a refused request stores nothing");

    // Control: its own repository runs, and tenant-a's is tenant-a's.
    let ok = execute(&mut client, TOKEN_B, shell("pb", &b_repo, "echo hi")).await;
    assert_eq!(ok.state, pb::ExecutionState::Succeeded as i32, "{}", ok.tool_error);
    let ok = execute(&mut client, TOKEN_A, shell("pa", &a_repo, "echo hi")).await;
    assert_eq!(ok.state, pb::ExecutionState::Succeeded as i32, "{}", ok.tool_error);
    daemon.stop().await;
}

/// Every ref of `repo`, with what it points at.
fn refs(repo: &Path) -> String {
    git(repo, &["for-each-ref", "--format=%(objectname) %(refname)"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dot_git_leading_into_another_tenants_repository_is_refused() {
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let b_repo = roots.repo(&root.join("pb/repo"));
    let b_head = git(&b_repo, &["rev-parse", "HEAD"]);
    // Directories under tenant-a's own prefix whose `.git` is tenant-b's:
    // host git, which runs as the daemon, would clone it and fetch the
    // agent's work back into it.
    let links = [
        ("an absolute symlink .git", root.join("pa/abs")),
        ("a relative symlink .git", root.join("pa/rel")),
        ("a gitfile", root.join("pa/gitfile")),
        ("a symlinked objects directory", root.join("pa/objects")),
        ("a commondir", root.join("pa/commondir")),
    ];
    for (_, dir) in &links[..3] {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::os::unix::fs::symlink(b_repo.join(".git"), root.join("pa/abs/.git")).unwrap();
    std::os::unix::fs::symlink("../../pb/repo/.git", root.join("pa/rel/.git")).unwrap();
    std::fs::write(root.join("pa/gitfile/.git"), format!("gitdir: {}/.git\n", b_repo.display())).unwrap();
    roots.repo(&root.join("pa/objects"));
    std::fs::remove_dir_all(root.join("pa/objects/.git/objects")).unwrap();
    std::os::unix::fs::symlink(b_repo.join(".git/objects"), root.join("pa/objects/.git/objects")).unwrap();
    roots.repo(&root.join("pa/commondir"));
    std::fs::write(root.join("pa/commondir/.git/commondir"), format!("{}/.git\n", b_repo.display())).unwrap();
    let b_refs = refs(&b_repo);
    let daemon = daemon(&roots, vec![root.join("pb")]).await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    let before = daemon.engine.store.row_counts().await.unwrap();

    // The agent would commit, so a fetch back would write into the origin.
    let work = "echo a > a.txt && git add a.txt && git -c user.name=a -c user.email=a@a.invalid commit -qm a; \
                git log --format=%H";
    for (what, dir) in &links {
        let status = client
            .execute(as_tenant(TOKEN_A, shell("pa", dir, work)))
            .await
            .expect_err(&format!("{what} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert_eq!(status.message(), "repo: is not an allowed repository", "{what}");
    }
    assert_eq!(daemon.engine.store.row_counts().await.unwrap(), before, "a refused request stores nothing");
    assert_eq!(refs(&b_repo), b_refs, "tenant-b's repository got a ref");
    assert!(!b_refs.contains("refs/corral/"));

    // Control: tenant-b's repository is tenant-b's, and its HEAD reached no
    // one else.
    let ok = execute(&mut client, TOKEN_B, shell("pb", &b_repo, "git log --format=%H")).await;
    assert_eq!(ok.state, pb::ExecutionState::Succeeded as i32, "{}", ok.tool_error);
    assert_eq!(ok.tool_output.trim(), b_head);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_tenants_workspace_holds_no_object_of_an_earlier_agents_commits() {
    require_bwrap();
    let roots = Roots::new();
    let shared = roots.repo(&roots.root().join("shared/repo"));
    let daemon = daemon(&roots, vec![roots.root().join("pb"), roots.root().join("shared")]).await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);

    // tenant-a's agent commits a secret; it comes back as refs/corral/<id>.
    let commit_secret = "echo 'tenant-a secret 8d1f' > secret.txt && git add secret.txt && \
                         git -c user.name=a -c user.email=a@a.invalid commit -qm secret";
    let a = execute(&mut client, TOKEN_A, shell("pa", &shared, commit_secret)).await;
    assert_eq!(a.state, pb::ExecutionState::Succeeded as i32, "{}", a.tool_error);
    let a_commit = a.evidence.as_ref().unwrap().commit_sha.clone();
    let a_blob = git(&shared, &["rev-parse", &format!("{a_commit}:secret.txt")]);
    git(&shared, &["cat-file", "-e", &a_blob]); // it is in the origin

    // tenant-b's agent lists every object its workspace holds.
    let b = execute(&mut client, TOKEN_B, shell("pb", &shared, "git cat-file --batch-all-objects --batch-check")).await;
    assert_eq!(b.state, pb::ExecutionState::Succeeded as i32, "{}", b.tool_error);
    let objects: Vec<&str> = b.tool_output.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(objects.len() >= 3, "the workspace has the base commit, its tree and README: {}", b.tool_output);
    assert!(!objects.contains(&a_commit.as_str()), "tenant-a's commit is in tenant-b's workspace");
    assert!(!objects.contains(&a_blob.as_str()), "tenant-a's secret is in tenant-b's workspace");
    assert!(!b.tool_output.contains("8d1f"));

    // And tenant-a's execution does not exist for tenant-b.
    let status = client
        .get_execution(as_tenant(TOKEN_B, pb::GetExecutionRequest { execution_id: a.execution_id.clone(), view: 0 }))
        .await
        .expect_err("tenant-a's execution");
    assert_eq!(status.code(), Code::NotFound);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_and_request_ids_are_the_callers_own() {
    require_bwrap();
    let roots = Roots::new();
    let daemon = daemon(&roots, vec![roots.root().join("pb")]).await;
    let channel = tcp(&daemon).await;
    let mut sessions = SessionServiceClient::new(channel.clone());
    let mut executions = ExecutionServiceClient::new(channel);
    let create = |project: &str, id: &str| pb::CreateSessionRequest {
        session_id: id.into(),
        profile_ref: "test.session".into(),
        project: project.into(),
        ..Default::default()
    };

    // Both may hold an `s1`; neither learns of the other's.
    let a = sessions.create_session(as_tenant(TOKEN_A, create("pa", "s1"))).await.expect("tenant-a's s1").into_inner();
    assert_eq!(a.session_id, "tenant-a/s1");
    let b = sessions.create_session(as_tenant(TOKEN_B, create("pb", "s1"))).await.expect("tenant-b's own s1");
    assert_eq!(b.into_inner().session_id, "tenant-b/s1");
    let again = sessions.create_session(as_tenant(TOKEN_B, create("pb", "s1"))).await.expect_err("its own s1 again");
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    // tenant-a's session under its full name is what a missing one is.
    let get = |id: &str| pb::GetSessionRequest { session_id: id.into() };
    let theirs = sessions.get_session(as_tenant(TOKEN_B, get("tenant-a/s1"))).await.expect_err("tenant-a's s1");
    let missing = sessions.get_session(as_tenant(TOKEN_B, get("tenant-a/s9"))).await.expect_err("a missing one");
    assert_eq!((theirs.code(), missing.code()), (Code::NotFound, Code::NotFound));
    assert_eq!(theirs.message().replace("s1", "s9"), missing.message(), "the answers differ");
    let end = pb::EndSessionRequest { session_id: "tenant-a/s1".into() };
    assert_eq!(sessions.end_session(as_tenant(TOKEN_B, end)).await.unwrap_err().code(), Code::NotFound);

    // Listing: only its own, and a page token carries no id in the clear.
    sessions.create_session(as_tenant(TOKEN_B, create("pb", "s2"))).await.expect("tenant-b's s2");
    let page = |token: &str| pb::ListSessionsRequest { page_size: 1, page_token: token.into() };
    let first = sessions.list_sessions(as_tenant(TOKEN_B, page(""))).await.unwrap().into_inner();
    assert_eq!(first.sessions.iter().map(|s| s.session_id.as_str()).collect::<Vec<_>>(), ["tenant-b/s1"]);
    let token = first.next_page_token.clone();
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    assert!(!token.is_empty() && !token.contains("tenant") && !token.contains(&hex("tenant-b/s1")), "{token}");
    let second = sessions.list_sessions(as_tenant(TOKEN_B, page(&token))).await.unwrap().into_inner();
    assert_eq!(second.sessions.iter().map(|s| s.session_id.as_str()).collect::<Vec<_>>(), ["tenant-b/s2"]);
    let stolen = sessions.list_sessions(as_tenant(TOKEN_A, page(&token))).await.expect_err("another caller's token");
    assert_eq!(stolen.code(), Code::InvalidArgument);
    let all_a = sessions.list_sessions(as_tenant(TOKEN_A, page(""))).await.unwrap().into_inner();
    assert_eq!(all_a.sessions.iter().map(|s| s.session_id.as_str()).collect::<Vec<_>>(), ["tenant-a/s1"]);
    for id in ["tenant-a/s1", "tenant-b/s1", "tenant-b/s2"] {
        let token = if id.starts_with("tenant-a") { TOKEN_A } else { TOKEN_B };
        sessions.end_session(as_tenant(token, pb::EndSessionRequest { session_id: id.into() })).await.unwrap();
    }

    // A request id tenant-a used is free for tenant-b: its own execution,
    // not ALREADY_EXISTS, not tenant-a's record.
    let request = |project: &str, script: &str| pb::ExecuteRequest {
        harness_profile_ref: "test.sh".into(),
        title: "t".into(),
        description: script.into(),
        project: project.into(),
        request_id: "req-1".into(),
        ..Default::default()
    };
    let first_a = executions.start_execution(as_tenant(TOKEN_A, request("pa", "echo a"))).await.unwrap().into_inner();
    let first_b = executions.start_execution(as_tenant(TOKEN_B, request("pb", "echo b"))).await;
    let first_b = first_b.expect("tenant-b's own req-1").into_inner();
    assert_ne!(first_b.execution_id, first_a.execution_id, "tenant-b was handed tenant-a's execution");
    assert_eq!(first_b.consumer.as_ref().unwrap().project, "pb");
    // Within one principal the id still makes the call idempotent.
    let again_a = executions.start_execution(as_tenant(TOKEN_A, request("pa", "echo a"))).await.unwrap().into_inner();
    assert_eq!(again_a.execution_id, first_a.execution_id);
    let other_a = executions.start_execution(as_tenant(TOKEN_A, request("pa", "echo other"))).await;
    assert_eq!(other_a.expect_err("a different request under tenant-a's id").code(), Code::AlreadyExists);
    daemon.stop().await;
}

/// A daemon with tenant-a alone (on the shared repositories) and `git`
/// set as the test needs.
async fn tenant_a_alone(roots: &Roots, git: fn(&mut corral::config::GitConfig)) -> TestDaemon {
    let root = roots.root();
    TestDaemon::start(Options {
        profiles: vec![("sh.toml".into(), SHELL.into())],
        config: Box::new(move |c| {
            c.repo_roots = vec![root.clone()];
            git(&mut c.git);
            c.principals.push(tenant("tenant-a", "pa", TOKEN_A, vec![root.join("shared")]));
        }),
        ..Options::default()
    })
    .await
}

/// A task that commits one new file, `f<n>`: a run whose work comes back.
fn commit_script(n: u32) -> String {
    format!("echo {n} > f{n} && git add f{n} && git -c user.name=a -c user.email=a@a commit -qm {n}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_stops_coming_back_into_an_origin_that_is_full() {
    require_bwrap();
    let roots = Roots::new();
    let shared = roots.repo(&roots.root().join("shared/repo"));
    let daemon = tenant_a_alone(&roots, |git| {
        git.max_capture_refs = 2;
        git.max_capture_refs_per_principal = Some(2);
    })
    .await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    for n in 0..2 {
        let run = execute(&mut client, TOKEN_A, shell("pa", &shared, &commit_script(n))).await;
        assert_eq!(run.state, pb::ExecutionState::Succeeded as i32, "{}", run.tool_error);
    }
    let third = execute(&mut client, TOKEN_A, shell("pa", &shared, &commit_script(2))).await;
    assert_eq!(third.state, pb::ExecutionState::Failed as i32);
    assert_eq!(third.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Teardown as i32);
    assert!(third.tool_error.contains("git.max_capture_refs"), "{}", third.tool_error);
    let refs = git(&shared, &["for-each-ref", "--format=%(refname)", "refs/corral/"]);
    assert_eq!(refs.lines().count(), 2, "{refs}");
    daemon.stop().await;

    // And by size: an origin already over its byte budget takes nothing.
    let daemon = tenant_a_alone(&roots, |git| git.max_origin_bytes = 1).await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    let other = roots.repo(&roots.root().join("shared/other"));
    let run = execute(&mut client, TOKEN_A, shell("pa", &other, &commit_script(9))).await;
    assert!(run.tool_error.contains("git.max_origin_bytes"), "{}", run.tool_error);
    assert_eq!(git(&other, &["for-each-ref", "refs/corral/"]), "");
    daemon.stop().await;
}

/// A repository two tenants share: tenant-a's runs fill only its share of
/// the refs the repository may hold (`max_capture_refs_per_principal`),
/// and then its work stops coming back, saying why, while tenant-b's
/// still does (before, tenant-a could use up `max_capture_refs` for both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_fills_only_its_share_of_a_shared_repositorys_refs() {
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let shared = roots.repo(&root.join("shared/repo"));
    let (a_repos, b_repos) = (vec![root.join("shared")], vec![root.join("shared")]);
    let daemon = TestDaemon::start(Options {
        profiles: vec![("sh.toml".into(), SHELL.into())],
        config: Box::new(move |c| {
            c.repo_roots = vec![root];
            c.git.max_capture_refs = 8;
            c.git.max_capture_refs_per_principal = Some(2);
            c.principals.push(tenant("tenant-a", "pa", TOKEN_A, a_repos));
            c.principals.push(tenant("tenant-b", "pb", TOKEN_B, b_repos));
        }),
        ..Options::default()
    })
    .await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    for n in 0..2 {
        let run = execute(&mut client, TOKEN_A, shell("pa", &shared, &commit_script(n))).await;
        assert_eq!(run.state, pb::ExecutionState::Succeeded as i32, "{}", run.tool_error);
    }
    let third = execute(&mut client, TOKEN_A, shell("pa", &shared, &commit_script(2))).await;
    assert_eq!(third.state, pb::ExecutionState::Failed as i32, "past its share: {third:?}");
    assert_eq!(third.evidence.as_ref().unwrap().failure_stage, pb::FailureStage::Teardown as i32);
    assert!(
        third.tool_error.contains("principal tenant-a holds 2 of the repository's refs/corral refs"),
        "{}",
        third.tool_error
    );
    let b = execute(&mut client, TOKEN_B, shell("pb", &shared, &commit_script(3))).await;
    assert_eq!(b.state, pb::ExecutionState::Succeeded as i32, "tenant-b's work still comes back: {}", b.tool_error);
    let refs = git(&shared, &["for-each-ref", "--format=%(refname)", "refs/corral/"]);
    assert_eq!(refs.lines().count(), 3, "{refs}");
    assert!(refs.contains(&b.execution_id), "{refs}");
    daemon.stop().await;
}

/// Runs of one tenant finishing at once take no more than its share: the
/// share and the room are counted, and the ref taken, under one lock on
/// the repository (before, each counted the refs before any had fetched,
/// and all of them came back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_finishing_at_once_take_no_more_than_their_share() {
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let shared = roots.repo(&root.join("shared/repo"));
    let a_repos = vec![root.join("shared")];
    let daemon = TestDaemon::start(Options {
        profiles: vec![("sh.toml".into(), SHELL.into())],
        config: Box::new(move |c| {
            c.repo_roots = vec![root];
            c.git.max_capture_refs = 8;
            c.git.max_capture_refs_per_principal = Some(1);
            c.principals.push(tenant("tenant-a", "pa", TOKEN_A, a_repos));
        }),
        ..Options::default()
    })
    .await;
    let client = ExecutionServiceClient::new(tcp(&daemon).await);
    // Each commits, then waits for the same moment to end.
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let deadline = now_ms + 3_000;
    let runs = (0..4).map(|n| {
        let mut client = client.clone();
        let script = format!("{} && while [ $(date +%s%3N) -lt {deadline} ]; do sleep 0.005; done", commit_script(n));
        let req = shell("pa", &shared, &script);
        async move { execute(&mut client, TOKEN_A, req).await }
    });
    let runs = futures_util::future::join_all(runs).await;
    let back: Vec<&pb::Execution> = runs.iter().filter(|r| r.state == pb::ExecutionState::Succeeded as i32).collect();
    assert_eq!(back.len(), 1, "one run's work comes back, its share: {runs:#?}");
    for run in runs.iter().filter(|r| r.state != pb::ExecutionState::Succeeded as i32) {
        assert!(run.tool_error.contains("principal tenant-a holds 1 of"), "{}", run.tool_error);
    }
    let refs = git(&shared, &["for-each-ref", "--format=%(refname)", "refs/corral/"]);
    assert_eq!(refs.lines().count(), 1, "{refs}");
    daemon.stop().await;
}

/// A profile's absolute write path is a host directory every run of the
/// profile writes, whoever runs it: tenant-a's agent left a file there and
/// tenant-b's next run read it. A principal other than `adm` may now have
/// the sandbox write the host only beneath its `write_roots` (none by
/// default): refused at the gate, naming the path, before any sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_writes_the_host_only_beneath_its_write_roots() {
    use std::os::unix::fs::PermissionsExt;
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let (a_repo, b_repo) = (roots.repo(&root.join("pa/repo")), roots.repo(&root.join("pb/repo")));
    let host = common::data_tempdir();
    let (shared, own) = (host.path().join("shared"), host.path().join("a"));
    let (own_cache, own_models) = (own.join("cache"), own.join("models"));
    for dir in [&shared, &own, &own_cache, &own_models] {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let reading = |id: &str, path: &Path| {
        SHELL
            .replace("test.sh", id)
            .replace("write_paths = [\".\"]", &format!("write_paths = [\".\"]\nread_paths = [{path:?}]"))
    };
    let profile = |id: &str, path: &Path| {
        SHELL.replace("test.sh", id).replace("write_paths = [\".\"]", &format!("write_paths = [\".\", {:?}]", path))
    };
    let a_roots = vec![own.clone()];
    let daemon = TestDaemon::start(Options {
        profiles: vec![
            ("shared.toml".into(), profile("test.shared", &shared)),
            ("own.toml".into(), profile("test.own", &own_cache)),
            ("root.toml".into(), profile("test.root", &own)),
            ("read.toml".into(), reading("test.read", &own_models)),
        ],
        config: Box::new(move |c| {
            c.repo_roots = vec![root.clone()];
            let mut a = tenant("tenant-a", "pa", TOKEN_A, vec![root.join("pa")]);
            a.write_roots = a_roots;
            c.principals.push(a);
            c.principals.push(tenant("tenant-b", "pb", TOKEN_B, vec![root.join("pb")]));
        }),
        ..Options::default()
    })
    .await;
    let mut client = ExecutionServiceClient::new(tcp(&daemon).await);
    let run = |profile: &str, project: &str, repo: &Path, script: String| pb::ExecuteRequest {
        harness_profile_ref: profile.into(),
        ..shell(project, repo, &script)
    };
    let refused = |run: &pb::Execution, path: &Path| {
        assert_eq!(run.state, pb::ExecutionState::Refused as i32, "{run:?}");
        let evidence = run.evidence.as_ref().unwrap();
        assert_eq!(evidence.failure_stage, pb::FailureStage::Gate as i32);
        let decision = evidence.gate_decisions.iter().find(|d| d.policy == "host_write_paths").expect("refusal");
        assert!(decision.reason.contains(&format!("{} is a host directory", path.display())), "{}", decision.reason);
    };

    let plant = format!("echo planted > {}/x", shared.display());
    let a = execute(&mut client, TOKEN_A, run("test.shared", "pa", &a_repo, plant.clone())).await;
    refused(&a, &shared);
    let b =
        execute(&mut client, TOKEN_B, run("test.shared", "pb", &b_repo, format!("cat {}/x", shared.display()))).await;
    refused(&b, &shared);
    assert!(!shared.join("x").exists(), "nothing ran");

    // Beneath its own root, tenant-a writes; tenant-b may not use that profile.
    let mine = format!("echo mine > {}/y", own_cache.display());
    let a = execute(&mut client, TOKEN_A, run("test.own", "pa", &a_repo, mine.clone())).await;
    assert_eq!(a.state, pb::ExecutionState::Succeeded as i32, "{}", a.tool_error);
    assert_eq!(std::fs::read_to_string(own_cache.join("y")).unwrap(), "mine\n");
    let b =
        execute(&mut client, TOKEN_B, run("test.own", "pb", &b_repo, format!("cat {}/y", own_cache.display()))).await;
    refused(&b, &own_cache);

    // Its agent, writing its root, puts a symlink where a profile's path
    // lies: the next run binds nothing through it (bwrap follows a symlink
    // in a bind's source, and would have made the shared directory writable).
    let swap = format!("rm -rf {0} && ln -s {1} {0}", own_cache.display(), shared.display());
    let a = execute(&mut client, TOKEN_A, run("test.root", "pa", &a_repo, swap)).await;
    assert_eq!(a.state, pb::ExecutionState::Succeeded as i32, "{}", a.tool_error);
    assert!(own_cache.is_symlink());
    let leak = format!("echo leaked > {}/z", own_cache.display());
    let a = execute(&mut client, TOKEN_A, run("test.own", "pa", &a_repo, leak)).await;
    assert_eq!(a.state, pb::ExecutionState::Failed as i32, "{a:?}");
    assert!(a.tool_error.contains("is a symlink"), "{}", a.tool_error);
    assert!(!shared.join("z").exists(), "the symlink's target was bound writable");

    // The dry run says the same; the administrator writes anywhere.
    let mut catalog = pb::catalog_service_client::CatalogServiceClient::new(tcp(&daemon).await);
    let dry = pb::EvaluateGateRequest { profile_ref: "test.shared".into(), project: "pb".into(), ..Default::default() };
    let dry = catalog.evaluate_gate(as_tenant(TOKEN_B, dry)).await.unwrap().into_inner();
    assert_eq!(dry.action, pb::GateAction::Deny as i32);
    assert!(dry.decisions.iter().any(|d| d.policy == "host_write_paths"), "{dry:?}");
    let admin = common::finished(&daemon.execute(run("test.shared", "", &a_repo, plant)).await);
    assert_eq!(admin.state, pb::ExecutionState::Succeeded as i32, "{}", admin.tool_error);
    assert_eq!(std::fs::read_to_string(shared.join("x")).unwrap(), "planted\n");

    // A read path likewise: a symlink put where it lies shows nothing.
    let swap = format!("rm -rf {0} && ln -s {1} {0}", own_models.display(), shared.display());
    let a = execute(&mut client, TOKEN_A, run("test.root", "pa", &a_repo, swap)).await;
    assert_eq!(a.state, pb::ExecutionState::Succeeded as i32, "{}", a.tool_error);
    let peek = format!("cat {}/x", own_models.display());
    let a = execute(&mut client, TOKEN_A, run("test.read", "pa", &a_repo, peek)).await;
    assert_eq!(a.state, pb::ExecutionState::Failed as i32, "{a:?}");
    assert!(a.tool_error.contains("is a symlink") && !a.tool_output.contains("planted"), "{a:?}");
    daemon.stop().await;
}

/// A tenant that opens watch streams and never reads them runs out of its
/// own places (`max_watchers_per_principal`), on any of its runs and
/// sessions, not of everyone's: the other tenant still watches its own; a
/// stream that goes away gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holding_watch_streams_takes_only_its_own_places() {
    require_bwrap();
    let roots = Roots::new();
    let root = roots.root();
    let a_repo = roots.repo(&root.join("pa/repo"));
    let b_repo = roots.repo(&root.join("pb/repo"));
    let daemon = TestDaemon::start(Options {
        profiles: vec![("sh.toml".into(), SHELL.into()), ("session.toml".into(), session_profile())],
        config: Box::new(move |c| {
            c.repo_roots = vec![root.clone()];
            c.principals.push(tenant("tenant-a", "pa", TOKEN_A, vec![root.join("pa")]));
            c.principals.push(tenant("tenant-b", "pb", TOKEN_B, vec![root.join("pb")]));
            c.grpc.max_watchers_per_principal = Some(2);
        }),
        ..Options::default()
    })
    .await;
    let client = ExecutionServiceClient::new(tcp(&daemon).await);
    let start = |token: &'static str, req: pb::ExecuteRequest| {
        let mut c = client.clone();
        async move { c.start_execution(as_tenant(token, req)).await.expect("started").into_inner().execution_id }
    };
    let watch = |token: &'static str, id: &str| {
        let mut c = client.clone();
        let req = pb::WatchRequest { execution_id: id.to_string(), after_sequence: 0 };
        async move {
            let mut stream = c.watch_execution(as_tenant(token, req)).await?.into_inner();
            stream.message().await?.expect("a first event");
            Ok::<_, tonic::Status>(stream)
        }
    };
    let a1 = start(TOKEN_A, shell("pa", &a_repo, "sleep 60")).await;
    let a2 = start(TOKEN_A, shell("pa", &a_repo, "sleep 60")).await;
    let b1 = start(TOKEN_B, shell("pb", &b_repo, "sleep 60")).await;

    // tenant-a holds two streams it does not read, on two of its runs.
    let first = watch(TOKEN_A, &a1).await.expect("tenant-a's first watcher");
    let _second = watch(TOKEN_A, &a2).await.expect("tenant-a's second watcher");
    for id in [&a1, &a2] {
        let status = watch(TOKEN_A, id).await.expect_err("a third watcher of tenant-a");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("principal tenant-a holds 2 watch streams"), "{status:?}");
    }
    // tenant-b's places are its own.
    let _b_first = watch(TOKEN_B, &b1).await.expect("tenant-b watches its run");
    let _b_second = watch(TOKEN_B, &b1).await.expect("tenant-b watches it again");
    // A stream tenant-a drops gives its place back (once the daemon
    // notices the stream is gone).
    drop(first);
    let _again = common::once_admitted("tenant-a's place was not given back", || watch(TOKEN_A, &a1)).await;
    // A WatchSession is one of its places too.
    let mut sessions = SessionServiceClient::new(tcp(&daemon).await);
    let create = pb::CreateSessionRequest {
        session_id: "w1".into(),
        profile_ref: "test.session".into(),
        project: "pa".into(),
        ..Default::default()
    };
    let session = sessions.create_session(as_tenant(TOKEN_A, create)).await.expect("a session").into_inner();
    let watch = pb::WatchSessionRequest { session_id: session.session_id.clone(), after_sequence: 0 };
    let status = sessions.watch_session(as_tenant(TOKEN_A, watch)).await.expect_err("a third place of tenant-a");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("principal tenant-a holds 2 watch streams"), "{status:?}");
    let end = pb::EndSessionRequest { session_id: session.session_id };
    sessions.end_session(as_tenant(TOKEN_A, end)).await.expect("ended");
    let mut c = client.clone();
    for (token, id) in [(TOKEN_A, &a1), (TOKEN_A, &a2), (TOKEN_B, &b1)] {
        c.cancel_execution(as_tenant(token, pb::CancelExecutionRequest { execution_id: id.clone() })).await.unwrap();
    }
    daemon.stop().await;
}
