//! Per-subject broadcast of stored events to live subscribers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use super::Event;
use crate::records::RawResult;

/// What only the direct caller may see, riding alongside a stored event.
#[derive(Clone, Debug)]
pub enum RawPart {
    /// The harness's own words on a progress line.
    ProgressMessage(String),
    /// The raw tool output and error of a finished execution or turn.
    Finished(RawResult),
}

/// One stored event as the bus carries it, with the raw part only its direct
/// caller may see.
#[derive(Clone, Debug)]
pub struct BusItem {
    /// The event and its shared encoding, behind one count: every stream
    /// that gets the item takes it and lets go of it once. (A thousand
    /// streams of one event on two cores bounce the cache line of each
    /// count they share; with the event and its encoding counted apart
    /// there were two.)
    shared: Arc<SharedEvent>,
    /// What only the direct caller sees; `None` on most events.
    pub raw: Option<Arc<RawPart>>,
}

/// What every stream that gets an item shares.
#[derive(Debug)]
pub struct SharedEvent {
    /// The event, as stored.
    event: Arc<Event>,
    /// The event as the API sends it without its raw part, encoded by the
    /// first stream that sends it and shared with every other stream that
    /// gets this item (opaque bytes here: the API fills them).
    wire: std::sync::OnceLock<bytes::Bytes>,
}

impl SharedEvent {
    /// The item's shared encoding (see [`BusItem::wire`]).
    pub fn wire(&self) -> &std::sync::OnceLock<bytes::Bytes> {
        &self.wire
    }
}

impl BusItem {
    /// An item of `event`, encoded by nobody yet.
    pub fn new(event: Arc<Event>, raw: Option<Arc<RawPart>>) -> BusItem {
        BusItem { shared: Arc::new(SharedEvent { event, wire: Default::default() }), raw }
    }

    /// The event, as stored.
    pub fn event(&self) -> &Event {
        &self.shared.event
    }

    /// The event as the API sends it without its raw part (see [`SharedEvent`]).
    pub fn wire(&self) -> &std::sync::OnceLock<bytes::Bytes> {
        &self.shared.wire
    }

    /// What the item shares with every other stream that gets it, kept by
    /// the item's own count.
    pub fn into_shared(self) -> Arc<SharedEvent> {
        self.shared
    }
}

/// The live channels of every subject that is running in this daemon, one
/// broadcast channel each. Watchers of a subject that is not live read the
/// store instead.
pub struct EventBus {
    channels: Mutex<HashMap<String, broadcast::Sender<BusItem>>>,
    /// How many events a subscriber may fall behind before it is ended (if
    /// it also reads nothing for a second: one that keeps reading is never
    /// ended, it catches up from the store). Tokio rounds the channel up to
    /// a power of two; this is the limit, not the channel's size.
    capacity: usize,
}

impl EventBus {
    /// A bus whose subscribers may fall `capacity` events behind (at least 16)
    /// before they are ended, once they also read nothing for a second.
    pub fn new(capacity: usize) -> Self {
        EventBus { channels: Mutex::new(HashMap::new()), capacity: capacity.max(16) }
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<BusItem>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the live channel of a subject and subscribes to it, so the
    /// first subscriber cannot miss the first event.
    pub fn open(&self, subject: &str) -> broadcast::Receiver<BusItem> {
        let mut channels = self.channels();
        channels.entry(subject.to_string()).or_insert_with(|| broadcast::channel(self.capacity).0).subscribe()
    }

    /// Subscribes to a live subject; `None` when it is not live (finished,
    /// or run by another daemon).
    pub fn subscribe(&self, subject: &str) -> Option<broadcast::Receiver<BusItem>> {
        self.channels().get(subject).map(|tx| tx.subscribe())
    }

    /// Sends an item to the live subscribers of its subject. An item of a
    /// subject with no open channel, or with no subscriber, is dropped: it is
    /// in the store already.
    pub fn publish(&self, item: BusItem) {
        let tx = self.channels().get(&item.event().subject_id).cloned();
        if let Some(tx) = tx {
            // No receiver is fine: events are in the store already.
            let _ = tx.send(item);
        }
    }

    /// Ends the live channel; subscribers drain what they have, then end.
    pub fn close(&self, subject: &str) {
        self.channels().remove(subject);
    }

    /// How many events a subscriber may fall behind before it is ended
    /// (once it also reads nothing for a second; see `capacity`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many subjects have an open live channel.
    pub fn live_subjects(&self) -> usize {
        self.channels().len()
    }
}
