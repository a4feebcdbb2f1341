//! Compiles the wire contract with protox (no `protoc` needed) and writes the
//! descriptor set the server serves through gRPC reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/corral/v1/types.proto",
        "proto/corral/v1/events.proto",
        "proto/corral/v1/execution.proto",
        "proto/corral/v1/session.proto",
        "proto/corral/v1/catalog.proto",
    ];
    // Each file, not only the directory: a directory's own mtime does not
    // change when a file in a subdirectory is edited in place.
    println!("cargo:rerun-if-changed=proto");
    // sqlx::migrate! reads these at compile time: a new file must rebuild.
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=migrations/sqlite");
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let bytes = prost::Message::encode_to_vec(&fds);
    std::fs::write(out.join("corral_descriptor.bin"), bytes)?;
    // Every watcher's stream moves each event through a channel and the
    // encoder: the rare, large kinds are boxed so that a LifecycleEvent
    // (and a progress event in it) stays small.
    let mut builder = tonic_prost_build::configure().build_client(true).build_server(true);
    for kind in ["accepted", "resolved", "gated", "sandbox_ready", "finished", "turn_finished", "teardown"] {
        builder = builder.boxed(format!(".corral.v1.LifecycleEvent.kind.{kind}"));
    }
    builder.compile_fds(fds.clone())?;
    // The services once more, as the daemon serves them: every message is
    // the one above, but a stream's LifecycleEvent is sent as bytes encoded
    // once for all its watchers (`api::wire::WireEvent`).
    let wire = out.join("wire");
    std::fs::create_dir_all(&wire)?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .out_dir(&wire)
        .extern_path(".corral.v1.LifecycleEvent", "crate::api::wire::WireEvent")
        .codec_path("crate::api::wire::WireCodec")
        .extern_path(".corral.v1", "crate::pb")
        .compile_fds(fds)?;
    Ok(())
}
