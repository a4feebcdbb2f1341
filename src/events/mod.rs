//! Lifecycle events: stored first, then fanned out to live subscribers.
//!
//! Each subject (execution or session) has one writer, its [`Recorder`],
//! which numbers events 1..n without gaps. Subscribers get a bounded
//! broadcast receiver: one that falls behind is told so (and ends with its
//! last delivered sequence) instead of slowing the writer or the others.

mod bus;
mod recorder;

pub use bus::{BusItem, EventBus, RawPart, SharedEvent};
pub use recorder::Recorder;

pub use crate::records::{Event, EventKind};
