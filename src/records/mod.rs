//! The records: what an execution, a session and a lifecycle event are, as
//! the store keeps them, the bus carries them and the hub reports them. Below the store,
//! the event bus and the lifecycle, so that every import points down:
//! `lifecycle` → `store`, `events`, `hub` → `records` → `evidence`, `sandbox`.

pub mod bounded;
mod event;
mod execution;
mod session;

pub use event::{Event, EventKind};
pub use execution::{now_ms, ExecuteCommand, ExecutionRecord, ExecutionState, RawResult};
pub use session::{SessionRecord, SessionState};
