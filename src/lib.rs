//! corral: a gRPC control plane that runs AI coding-agent harnesses inside
//! sandboxes it creates and destroys itself. For each task it resolves a
//! versioned harness profile, runs the policy gate, creates the sandbox,
//! starts the harness, dispatches the task, tears everything down whatever
//! failed, and records redacted evidence, streaming every step to the
//! caller and to any number of watchers.
//!
//! Words a newcomer meets everywhere:
//!
//! - **rein**: the harness adapter (`rein/`): how to start an agent inside
//!   a sandbox, hand it a task, read its progress and result, and end it
//!   (the `command` rein speaks corral's JSON-lines protocol, or Claude
//!   Code's and Codex's own JSON output through a preset).
//! - **profile**: a versioned harness profile, `id@version`: which rein,
//!   the sandbox template, limits, credential routes, policies, readiness.
//! - **gate**: the server-side policy check before a harness starts
//!   (`agent_start`) and before each tool call (`tool_call`; the agents'
//!   own calls reach it through their managed pre-tool hook, `gate/`).
//! - **hub**: an optional HTTP endpoint that receives redacted progress and
//!   evidence from an outbox in the store (`hub/`).
//! - **`adm`, `agt`, `atm`**: the governed consumer types a principal and a
//!   run's actor are one of — an administrator, an agent, an automation
//!   (a pipeline or scheduler). Only `adm` may set policies or see every
//!   project.
//! - **floor**: in `corral bench`, the cost of spawning the exact sandbox
//!   command line corral ran, without corral: what every figure is a
//!   ratio against.
//!
//! The folders follow the lifecycle, every import pointing down
//! (`tests/house.rs` checks it): `cli` (the client side of the binary) →
//! `daemon` → `api` (the thin gRPC edge) → `lifecycle` (the engine; a
//! run's phase in `lifecycle/phase.rs`) → `rein`, `gate`, `credentials`,
//! `events`, `hub` → `catalog`, `policy`, `store`, `sandbox` → `records` →
//! `types` (the value types every record is made of, depending on nothing).

#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod catalog;
pub mod cli;
pub mod config;
pub mod credentials;
pub mod daemon;
pub mod delegate;
pub mod events;
pub mod fdlimit;
pub mod fleet;
pub mod gate;
pub mod hub;
pub mod lifecycle;
pub mod metrics_http;
pub mod net;
pub mod policy;
pub mod records;
pub mod rein;
pub mod sandbox;
pub mod store;
pub mod telemetry;
pub mod types;

/// The wire contract, generated from `proto/corral/v1` (documented in the
/// .proto files; a field without a comment there has none here).
#[allow(missing_docs)]
pub mod pb {
    tonic::include_proto!("corral.v1");

    /// The encoded descriptor set of the corral protos (served through
    /// reflection, and used by the CLI for canonical JSON output).
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("corral_descriptor");
}

/// The services as the daemon serves them: the messages of [`pb`], with
/// each streamed `LifecycleEvent` sent as bytes encoded once for every
/// stream that carries it (see `api::wire`).
pub mod pb_wire {
    include!(concat!(env!("OUT_DIR"), "/wire/corral.v1.rs"));
}
