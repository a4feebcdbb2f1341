//! corral: a gRPC control plane that runs AI coding-agent harnesses inside
//! sandboxes it creates and destroys itself. For each task it resolves a
//! versioned harness profile, runs the policy gate, creates the sandbox,
//! starts the harness, dispatches the task, tears everything down whatever
//! failed, and records redacted evidence, streaming every step to the
//! caller and to any number of watchers.
//!
//! The folders follow the lifecycle: `api` (the thin gRPC edge) →
//! `lifecycle` (the engine) → `catalog`, `policy`, `sandbox`, `rein`,
//! `events`, `store`, `records`, and at the bottom `types` (the value types
//! every record is made of, depending on nothing). `cli` is the client
//! side of the binary.

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

/// The wire contract, generated from `proto/corral/v1`.
pub mod pb {
    tonic::include_proto!("corral.v1");

    /// The encoded descriptor set of the corral protos (served through
    /// reflection, and used by the CLI for canonical JSON output).
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("corral_descriptor");
}
