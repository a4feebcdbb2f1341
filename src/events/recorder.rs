//! The single writer of a subject's events.

use std::sync::Arc;

use super::{BusItem, Event, EventBus, EventKind, RawPart};
use crate::lifecycle::now_ms;
use crate::store::Store;

pub struct Recorder {
    subject: String,
    next: u64,
    store: Store,
    bus: Arc<EventBus>,
}

impl Recorder {
    /// A recorder whose next event gets `after + 1`.
    pub fn new(subject: String, after: u64, store: Store, bus: Arc<EventBus>) -> Self {
        Recorder { subject, next: after + 1, store, bus }
    }

    pub fn subject(&self) -> &str {
        &self.subject
    }

    pub fn last_sequence(&self) -> u64 {
        self.next - 1
    }

    /// Stores the event, then publishes it. An event the store refused is
    /// not published (nobody may see what a later watcher could not
    /// replay), and its sequence is reused, so there are never gaps.
    pub async fn emit(&mut self, kind: EventKind, raw: Option<RawPart>) -> Option<Arc<Event>> {
        let event = Event { subject_id: self.subject.clone(), sequence: self.next, time_ms: now_ms(), kind };
        if let Err(error) = self.store.append_event(&event).await {
            tracing::error!(subject = %self.subject, sequence = self.next, kind = event.kind.name(), %error, "event not stored");
            return None;
        }
        self.next += 1;
        let event = Arc::new(event);
        self.bus.publish(BusItem { event: event.clone(), raw: raw.map(Arc::new) });
        Some(event)
    }
}
