//! Who is calling: every corral RPC needs a principal; a principal sees
//! only its projects, cannot claim another type, cannot pass policies unless
//! adm; the owner (and adm) get the raw output; quotas are hard.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{require_bwrap, Options, TestDaemon};
use corral::auth::PrincipalConfig;
use corral::pb;
use corral::pb::catalog_service_client::CatalogServiceClient;
use corral::pb::execution_service_client::ExecutionServiceClient;
use corral::pb::session_service_client::SessionServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Code;

const TOKEN_A: &str = "token-of-principal-a-0123456789abcdef0123";
const TOKEN_A2: &str = "token-of-principal-a2-0123456789abcdef012";
const TOKEN_B: &str = "token-of-principal-b-0123456789abcdef0123";
const TOKEN_Q: &str = "token-of-principal-q-0123456789abcdef0123";

fn digest(token: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(token.as_bytes()))
}

fn principal(name: &str, kind: &str, projects: &[&str], token: &str) -> PrincipalConfig {
    PrincipalConfig {
        name: name.into(),
        kind: kind.into(),
        projects: projects.iter().map(|p| p.to_string()).collect(),
        token_sha256: Some(digest(token)),
        ..Default::default()
    }
}

async fn daemon(extra: Vec<PrincipalConfig>) -> TestDaemon {
    require_bwrap();
    let mut principals = vec![
        principal("agt-a", "agt", &["proj-a"], TOKEN_A),
        principal("agt-a2", "agt", &["proj-a"], TOKEN_A2),
        principal("agt-b", "agt", &["proj-b"], TOKEN_B),
    ];
    principals.extend(extra);
    TestDaemon::start(Options {
        config: Box::new(move |c| {
            c.principals = principals;
            c.unix_socket_group = Some("4242".into());
        }),
        ..Options::default()
    })
    .await
}

#[derive(Clone)]
struct Bearer(Option<String>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        Ok(request)
    }
}

type Conn = InterceptedService<Channel, Bearer>;

async fn tcp(daemon: &TestDaemon, token: Option<&str>) -> Conn {
    let _ = daemon.channel().await; // wait until it serves
    let channel = Channel::from_shared(daemon.url.clone()).unwrap().connect().await.unwrap();
    InterceptedService::new(channel, Bearer(token.map(String::from)))
}

fn start_request(project: &str, description: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        harness_profile_ref: "builtin.shell".into(),
        title: "t".into(),
        description: description.into(),
        project: project.into(),
        ..Default::default()
    }
}

fn reason(status: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    status.get_error_details().error_info().map(|i| i.reason.clone()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credentials_or_a_garbage_token_is_unauthenticated_and_health_answers() {
    let daemon = daemon(vec![]).await;
    for token in [None, Some("garbage")] {
        let conn = tcp(&daemon, token).await;
        let mut ex = ExecutionServiceClient::new(conn.clone());
        let mut cat = CatalogServiceClient::new(conn.clone());
        let mut ses = SessionServiceClient::new(conn.clone());
        let id = "01a2314c-63f1-72ed-b54e-9dacfa3005f8".to_string();
        let codes = vec![
            ex.list_executions(pb::ListExecutionsRequest::default()).await.map(|_| ()),
            ex.get_execution(pb::GetExecutionRequest { execution_id: id.clone(), view: 0 }).await.map(|_| ()),
            ex.start_execution(start_request("proj-a", "true")).await.map(|_| ()),
            ex.execute(start_request("proj-a", "true")).await.map(|_| ()),
            ex.watch_execution(pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 }).await.map(|_| ()),
            ex.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.map(|_| ()),
            cat.list_profiles(pb::ListProfilesRequest {}).await.map(|_| ()),
            cat.get_daemon_info(pb::GetDaemonInfoRequest {}).await.map(|_| ()),
            cat.resolve_profile(pb::ResolveProfileRequest {
                profile_ref: "builtin.shell".into(),
                actor: String::new(),
            })
            .await
            .map(|_| ()),
            ses.list_sessions(pb::ListSessionsRequest::default()).await.map(|_| ()),
            ses.get_session(pb::GetSessionRequest { session_id: id.clone() }).await.map(|_| ()),
        ];
        for (i, result) in codes.into_iter().enumerate() {
            let status = result.expect_err("served without a principal");
            assert_eq!(status.code(), Code::Unauthenticated, "call {i} with {token:?}: {status:?}");
        }
    }
    let conn = tcp(&daemon, None).await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(conn);
    let answer = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();
    assert_eq!(answer.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // Nothing was stored by the refused calls.
    let mut admin = ExecutionServiceClient::new(daemon.channel().await);
    assert!(admin
        .list_executions(pb::ListExecutionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .executions
        .is_empty());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_sees_and_touches_only_its_own_projects() {
    let daemon = daemon(vec![]).await;
    let mut a = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_A)).await);
    let mut b = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_B)).await);
    let mut b_sessions = SessionServiceClient::new(tcp(&daemon, Some(TOKEN_B)).await);
    let mut a_sessions = SessionServiceClient::new(tcp(&daemon, Some(TOKEN_A)).await);

    let theirs = b.start_execution(start_request("", "sleep 20")).await.unwrap().into_inner();
    assert_eq!(theirs.consumer.as_ref().unwrap().project, "proj-b", "the principal's only project");
    assert_eq!(theirs.consumer.as_ref().unwrap().actor, "agt");
    assert_eq!(theirs.consumer.as_ref().unwrap().principal, "agt-b");
    let id = theirs.execution_id.clone();
    let listed = a.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    assert!(listed.executions.iter().all(|e| e.execution_id != id), "A lists B's execution");
    for status in [
        a.get_execution(pb::GetExecutionRequest { execution_id: id.clone(), view: 0 }).await.unwrap_err(),
        a.watch_execution(pb::WatchRequest { execution_id: id.clone(), after_sequence: 0 }).await.unwrap_err(),
        a.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await.unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
    }
    // Its own project: fine. Another project or another type: refused.
    let mine = a.start_execution(start_request("proj-a", "true")).await.unwrap().into_inner();
    assert!(a.get_execution(pb::GetExecutionRequest { execution_id: mine.execution_id, view: 0 }).await.is_ok());
    let other = a.start_execution(start_request("proj-b", "true")).await.unwrap_err();
    assert_eq!((other.code(), reason(&other).as_str()), (Code::PermissionDenied, "PROJECT_NOT_ALLOWED"));
    let mut claim = start_request("proj-a", "true");
    claim.actor = "adm".into();
    let claimed = a.start_execution(claim).await.unwrap_err();
    assert_eq!((claimed.code(), reason(&claimed).as_str()), (Code::PermissionDenied, "ACTOR_NOT_PRINCIPAL_TYPE"));

    // Sessions: B's is invisible to A; A may not pass policies.
    let session = b_sessions
        .create_session(pb::CreateSessionRequest { profile_ref: "test.fake-agent".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let sid = session.session_id.clone();
    let turn = pb::SendTurnRequest {
        session_id: sid.clone(),
        tool_call: Some(pb::ToolCall { tool: "echo".into(), arguments_json: "{}".into() }),
    };
    for status in [
        a_sessions.send_turn(turn).await.unwrap_err(),
        a_sessions.get_session(pb::GetSessionRequest { session_id: sid.clone() }).await.unwrap_err(),
        a_sessions.end_session(pb::EndSessionRequest { session_id: sid.clone() }).await.unwrap_err(),
        a_sessions.cancel_turn(pb::CancelTurnRequest { session_id: sid.clone() }).await.unwrap_err(),
        a_sessions
            .watch_session(pb::WatchSessionRequest { session_id: sid.clone(), after_sequence: 0 })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
    }
    let listed = a_sessions.list_sessions(pb::ListSessionsRequest::default()).await.unwrap().into_inner();
    assert!(listed.sessions.iter().all(|s| s.session_id != sid));
    let with_policy = pb::CreateSessionRequest {
        profile_ref: "test.fake-agent".into(),
        policies: vec![pb::PolicySpec {
            name: "off".into(),
            kind: pb::PolicyKind::DenyNetwork as i32,
            ..Default::default()
        }],
        ..Default::default()
    };
    let refused = a_sessions.create_session(with_policy).await.unwrap_err();
    assert_eq!((refused.code(), reason(&refused).as_str()), (Code::PermissionDenied, "POLICIES_NEED_ADM"));
    b_sessions.end_session(pb::EndSessionRequest { session_id: sid }).await.unwrap();
    b.cancel_execution(pb::CancelExecutionRequest { execution_id: id }).await.unwrap();
    daemon.stop().await;
}

async fn finished_execution(client: &mut ExecutionServiceClient<Conn>, description: &str) -> String {
    let mut stream = client.execute(start_request("proj-a", description)).await.unwrap().into_inner();
    let mut id = String::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(pb::lifecycle_event::Kind::Accepted(a)) = event.kind {
            id = a.execution_id;
        }
    }
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_and_adm_get_the_raw_output_and_no_one_else() {
    let daemon = daemon(vec![]).await;
    let mut owner = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_A)).await);
    let mut peer = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_A2)).await);
    let id = finished_execution(&mut owner, "echo RAW-OUTPUT-5521").await;
    let full = pb::GetExecutionRequest { execution_id: id.clone(), view: pb::ExecutionView::Full as i32 };
    let mine = owner.get_execution(full.clone()).await.unwrap().into_inner();
    assert!(mine.tool_output.contains("RAW-OUTPUT-5521"), "{mine:?}");
    let basic = owner.get_execution(pb::GetExecutionRequest { execution_id: id.clone(), view: 0 }).await.unwrap();
    assert!(basic.into_inner().tool_output.is_empty(), "BASIC carries no raw output");
    let status = peer.get_execution(full.clone()).await.unwrap_err();
    assert_eq!((status.code(), reason(&status).as_str()), (Code::PermissionDenied, "RAW_OUTPUT_OWNER_ONLY"));
    let mut admin = ExecutionServiceClient::new(daemon.channel().await);
    assert!(admin.get_execution(full).await.unwrap().into_inner().tool_output.contains("RAW-OUTPUT-5521"));
    let watched = daemon.watch_all(&id, 0).await;
    assert!(!format!("{watched:?}").contains("RAW-OUTPUT-5521"), "a watcher saw the raw output");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_past_its_quota_is_refused_and_nothing_is_stored() {
    let mut quota = principal("agt-q", "agt", &["proj-a"], TOKEN_Q);
    quota.max_running = Some(1);
    let daemon = daemon(vec![quota]).await;
    let mut q = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_Q)).await);
    let first = q.start_execution(start_request("", "sleep 20")).await.unwrap().into_inner();
    let status = q.start_execution(start_request("", "true")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("max_running quota of 1"), "{}", status.message());
    let mut qs = SessionServiceClient::new(tcp(&daemon, Some(TOKEN_Q)).await);
    let session = qs
        .create_session(pb::CreateSessionRequest { profile_ref: "test.fake-agent".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(session.code(), Code::ResourceExhausted, "sessions count too");
    let mut admin = ExecutionServiceClient::new(daemon.channel().await);
    let all = admin.list_executions(pb::ListExecutionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(all.executions.len(), 1, "a refused request was stored");
    // Other principals are not held by it.
    let mut a = ExecutionServiceClient::new(tcp(&daemon, Some(TOKEN_A)).await);
    assert!(a.start_execution(start_request("proj-a", "true")).await.is_ok());
    q.cancel_execution(pb::CancelExecutionRequest { execution_id: first.execution_id }).await.unwrap();
    daemon.stop().await;
}

/// `corral` as another host user, over the unix socket.
fn corral_as(uid: u32, socket: &Path, args: &[&str]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("--server")
        .arg(format!("unix://{}", socket.display()))
        .args(args)
        .env("HOME", "/tmp")
        .env_remove("CORRAL_TOKEN")
        .uid(uid)
        .gid(4242)
        .output()
        .expect("corral runs as another user")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_peer_uid_is_its_principal_and_an_unmapped_one_is_refused() {
    let mut atm = principal("atm-user", "atm", &["proj-t"], "unused-token-0123456789abcdef0123456789");
    atm.token_sha256 = None;
    atm.unix_uids = vec![4242];
    let daemon = daemon(vec![atm]).await;
    let _ = daemon.channel().await;
    let socket = daemon.socket();
    let mapped = corral_as(
        4242,
        &socket,
        &["--json", "exec", "--profile", "builtin.shell", "--title", "t", "--description", "echo hi"],
    );
    let text = String::from_utf8_lossy(&mapped.stdout);
    assert!(mapped.status.success(), "{text}\n{}", String::from_utf8_lossy(&mapped.stderr));
    assert!(text.contains("\"actor\":\"atm\"") && text.contains("\"project\":\"proj-t\""), "{text}");
    let unmapped = corral_as(4343, &socket, &["ls"]);
    assert!(!unmapped.status.success());
    assert!(String::from_utf8_lossy(&unmapped.stderr).contains("Unauthenticated"), "{:?}", unmapped);
    tokio::time::sleep(Duration::from_millis(10)).await;
    daemon.stop().await;
}

/// A CA and the PEM of certificates it signs.
struct TestCa {
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
    pem: String,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let pem = params.self_signed(&key).unwrap().pem();
        TestCa { params, key, pem }
    }

    /// (certificate PEM, key PEM) for `names` (the first is the CN).
    fn sign(&self, names: &[&str], client: bool) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, names[0]);
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        (params.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
    }
}

async fn tls_channel(
    port: u16,
    ca: &str,
    client: Option<&(String, String)>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((cert, key)) = client {
        tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
    }
    Channel::from_shared(format!("https://127.0.0.1:{port}")).unwrap().tls_config(tls).unwrap().connect().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_maps_a_client_certificate_to_its_principal_and_refuses_another_ca() {
    require_bwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("corral test ca");
    let other = TestCa::new("some other ca");
    let (server_cert, server_key) = ca.sign(&["localhost", "127.0.0.1"], false);
    let good = ca.sign(&["ci-bot"], true);
    let forged = other.sign(&["ci-bot"], true);
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (cert, key, client_ca) =
        (write("server.pem", &server_cert), write("server.key", &server_key), write("ca.pem", &ca.pem));
    let mut bot = principal("ci-bot", "agt", &["proj-a"], "unused-0123456789abcdef0123456789abcdef");
    bot.token_sha256 = None;
    bot.tls_names = vec!["ci-bot".into()];
    let daemon = TestDaemon::start(Options {
        config: Box::new(move |c| {
            c.principals = vec![bot];
            c.tls_cert = Some(cert);
            c.tls_key = Some(key);
            c.client_ca = Some(client_ca);
        }),
        ..Options::default()
    })
    .await;
    let _ = daemon.channel().await;
    let port = daemon.addr.port();

    let channel = tls_channel(port, &ca.pem, Some(&good)).await.expect("a certificate from the configured CA");
    let mut client = ExecutionServiceClient::new(channel);
    let started = client.start_execution(start_request("", "true")).await.unwrap().into_inner();
    let consumer = started.consumer.unwrap();
    assert_eq!((consumer.principal.as_str(), consumer.actor.as_str()), ("ci-bot", "agt"));

    // Another CA's certificate for the same name: refused at the handshake.
    let refused = match tls_channel(port, &ca.pem, Some(&forged)).await {
        Err(e) => Err(e.to_string()),
        Ok(channel) => ExecutionServiceClient::new(channel)
            .list_executions(pb::ListExecutionsRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.to_string()),
    };
    assert!(refused.is_err(), "a certificate of another CA was served");
    assert!(!refused.unwrap_err().contains("Unauthenticated"), "refused by the handshake, not after it");
    // TLS without a certificate: no principal.
    let bare = tls_channel(port, &ca.pem, None).await.unwrap();
    let status =
        ExecutionServiceClient::new(bare).list_executions(pb::ListExecutionsRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    daemon.stop().await;
}

#[test]
fn a_non_loopback_plaintext_listener_fails_the_start_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("listen") && stderr.contains("TLS"), "{stderr}");
}

/// `EvaluateGate` admits the actor and project exactly as an execution
/// does: an `agt` cannot dry-run as `adm` or in another tenant's project
/// (the same refusals `Execute` gives), and an empty project is the
/// principal's own, as the gate's `project` sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluate_gate_admits_the_actor_and_project_as_an_execution_does() {
    require_bwrap();
    let policy = "[[guardrails.policies]]\nname = \"proj-a-only\"\nkind = \"expr\"\n\
                  arguments = { expression = \"project == 'proj-a'\", reason = \"only in proj-a\" }\n";
    let daemon = TestDaemon::start(Options {
        profiles: vec![("gated.toml".into(), common::fake_agent_profile("test.proj-a-only", policy))],
        config: Box::new(|c| c.principals = vec![principal("agt-a", "agt", &["proj-a"], TOKEN_A)]),
        ..Options::default()
    })
    .await;
    let conn = tcp(&daemon, Some(TOKEN_A)).await;
    let (mut catalog, mut executions) = (CatalogServiceClient::new(conn.clone()), ExecutionServiceClient::new(conn));
    let dry = |actor: &str, project: &str| pb::EvaluateGateRequest {
        profile_ref: "test.proj-a-only".into(),
        actor: actor.into(),
        project: project.into(),
        ..Default::default()
    };
    let run = |actor: &str, project: &str| pb::ExecuteRequest {
        harness_profile_ref: "test.proj-a-only".into(),
        title: "t".into(),
        description: "NOWORK".into(),
        actor: actor.into(),
        project: project.into(),
        ..Default::default()
    };
    for (actor, project, expected) in
        [("adm", "proj-a", "ACTOR_NOT_PRINCIPAL_TYPE"), ("", "proj-b", "PROJECT_NOT_ALLOWED")]
    {
        let dry_run = catalog.evaluate_gate(dry(actor, project)).await.expect_err("a dry run outside the principal");
        let execution = executions.start_execution(run(actor, project)).await.expect_err("an execution outside it");
        assert_eq!((dry_run.code(), reason(&dry_run).as_str()), (Code::PermissionDenied, expected), "{dry_run:?}");
        assert_eq!((execution.code(), reason(&execution)), (dry_run.code(), reason(&dry_run)), "{execution:?}");
    }
    // An empty project is the principal's only one, which the policy allows.
    for project in ["", "proj-a"] {
        let answer = catalog.evaluate_gate(dry("", project)).await.expect("its own project").into_inner();
        assert_eq!(answer.action, pb::GateAction::Allow as i32, "project {project:?}: {answer:?}");
    }
    assert!(executions
        .list_executions(pb::ListExecutionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .executions
        .is_empty());
    daemon.stop().await;
}

/// The daemon's start with `principals` (and `admin_token` in its data
/// directory beforehand): the error it refuses to start with.
async fn start_error(principals: Vec<PrincipalConfig>, admin_token: Option<&str>) -> String {
    let dir = common::data_tempdir();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    if let Some(token) = admin_token {
        std::fs::write(data.join("admin.token"), token).unwrap();
    }
    let mut config = corral::config::Config { data_dir: data, profile_dirs: Vec::new(), ..Default::default() };
    config.sandbox.uids = common::unique_uids();
    config.principals = principals;
    config.store.url = common::fresh_postgres_database().await;
    let backends = corral::sandbox::Backends::host_default();
    match corral::daemon::Daemon::build(config, backends, corral::daemon::default_reins()).await {
        Ok(_) => panic!("the daemon started"),
        Err(error) => error.to_string(),
    }
}

/// Principals that would make who is calling ambiguous, or a name no
/// session ref can hold, or an admin token anyone could guess: the daemon
/// does not start, and says which key and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_principals_and_a_short_admin_token_refuse_the_start() {
    require_bwrap();
    let mut admin = principal("local-admin", "adm", &[], TOKEN_Q);
    admin.unix_uids = vec![4242];
    let err = start_error(vec![admin], None).await;
    assert!(err.contains("principals[0].name: \"local-admin\" is the built-in administrator"), "{err}");

    let twice = vec![principal("agt-a", "agt", &["proj-a"], TOKEN_A), principal("agt-b", "agt", &["proj-b"], TOKEN_A)];
    let err = start_error(twice, None).await;
    assert!(err.contains("the same bearer token is claimed by both \"agt-a\" and \"agt-b\""), "{err}");
    let (mut a, mut b) =
        (principal("agt-a", "agt", &["proj-a"], TOKEN_A), principal("agt-b", "agt", &["proj-b"], TOKEN_B));
    (a.unix_uids, b.unix_uids) = (vec![4242], vec![4242]);
    let err = start_error(vec![a.clone(), b.clone()], None).await;
    assert!(err.contains("unix uid 4242 is claimed by both \"agt-a\" and \"agt-b\""), "{err}");
    (a.unix_uids, b.unix_uids) = (vec![], vec![]);
    (a.tls_names, b.tls_names) = (vec!["ci-bot".into()], vec!["ci-bot".into()]);
    let err = start_error(vec![a, b], None).await;
    assert!(err.contains("the TLS name \"ci-bot\" is claimed by both \"agt-a\" and \"agt-b\""), "{err}");

    for name in ["a..b", ".hidden", "-flag", "x.lock", "x."] {
        let err = start_error(vec![principal(name, "agt", &["proj-a"], TOKEN_A)], None).await;
        assert!(err.contains("principals[0].name") && err.contains("git ref component"), "{name}: {err}");
    }

    for token in ["", "\n", "0123456789abcdef"] {
        let err = start_error(Vec::new(), Some(token)).await;
        assert!(err.contains("admin.token: the local admin token has"), "{token:?}: {err}");
    }
}

/// Waits until the daemon's log holds `needle` `times` times.
async fn log_until(log: &Path, needle: &str, times: usize) -> String {
    let start = std::time::Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.matches(needle).count() >= times {
            return text;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the log never said {needle:?} {times}×:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The same checks on SIGHUP: a reload that fails one keeps the principals
/// in force (the old tokens work, the new file's does not) and logs why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_fails_the_checks_keeps_the_principals_in_force() {
    require_bwrap();
    let dir = common::data_tempdir();
    let profiles = dir.path().join("profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let principals = dir.path().join("principals.d");
    std::fs::create_dir_all(&principals).unwrap();
    let file = |name: &str, token: &str, extra: &str| {
        format!("name = {name:?}\ntype = \"agt\"\nprojects = [\"proj-a\"]\ntoken_sha256 = {:?}\n{extra}", digest(token))
    };
    std::fs::write(principals.join("agt-a.toml"), file("agt-a", TOKEN_A, "unix_uids = [4242]\n")).unwrap();
    let data = dir.path().join("data");
    let log = data.with_extension("log");
    let extra = format!("principals_dir = {:?}", principals.display().to_string());
    let daemon = common::ServeProcess::start_with(&data, &profiles, &[], &extra).await;
    let admin = std::fs::read_to_string(data.join("admin.token")).unwrap();
    let channel = tonic::transport::Endpoint::from_shared(daemon.url.clone()).unwrap().connect().await.unwrap();
    let catalog = CatalogServiceClient::new(channel);
    let known = |token: &str| {
        let (mut catalog, request) = (catalog.clone(), common::with_token(token, pb::ListProfilesRequest {}));
        async move { catalog.list_profiles(request).await.map(drop).map_err(|s| s.code()) }
    };
    assert_eq!(known(TOKEN_A).await, Ok(()));

    let cases = [
        ("local-admin.toml", file("local-admin", TOKEN_B, ""), "is the built-in administrator"),
        ("agt-b.toml", file("agt-b", TOKEN_B, "unix_uids = [4242]\n"), "unix uid 4242 is claimed by both"),
        ("agt-q.toml", file("agt-q", TOKEN_A, ""), "the same bearer token is claimed by both"),
        ("dots.toml", file("a..b", TOKEN_B, ""), "git ref component"),
    ];
    for (i, (name, text, why)) in cases.iter().enumerate() {
        std::fs::write(principals.join(name), text).unwrap();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(daemon.pid(), libc::SIGHUP) };
        let text = log_until(&log, "SIGHUP: principals not reloaded", i + 1).await;
        let line = text.lines().rfind(|l| l.contains("principals not reloaded")).unwrap();
        assert!(line.contains(why), "{name}: {line}");
        assert_eq!(known(TOKEN_A).await, Ok(()), "{name}: the set in force stays");
        assert_eq!(known(TOKEN_B).await, Err(Code::Unauthenticated), "{name}: the new file is not in force");
        std::fs::remove_file(principals.join(name)).unwrap();
    }

    std::fs::write(data.join("admin.token"), "").unwrap();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.pid(), libc::SIGHUP) };
    let text = log_until(&log, "SIGHUP: principals not reloaded", cases.len() + 1).await;
    let line = text.lines().rfind(|l| l.contains("principals not reloaded")).unwrap();
    assert!(line.contains("admin.token: the local admin token has 0 characters"), "{line}");
    assert_eq!(known(admin.trim()).await, Ok(()), "the admin token in force stays");
    daemon.stop().await;
}
