//! The value types the records are made of: what a sandbox is asked for
//! and proves ([`SandboxSpec`], [`EnforcementReceipt`]), who it is for
//! ([`Consumer`]), a policy's verdict ([`PolicyDecision`]), a profile's
//! [`Readiness`], and a run's [`evidence`]. The bottom layer: it depends on
//! nothing else in the crate (serde and std only), so a newcomer learns
//! the shape of every record and event here, and every other module may
//! use it.

pub mod evidence;
mod policy;
mod readiness;
mod sandbox;

pub use policy::{Action, PolicyDecision};
pub use readiness::{Readiness, ReadinessState};
pub use sandbox::{Consumer, EnforcementReceipt, LimitReceipt, SandboxSpec, SandboxState, SandboxType};

/// Lower-case hex of `bytes` (digests in receipts and records).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
