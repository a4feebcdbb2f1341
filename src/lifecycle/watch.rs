//! A subscriber's view of one subject: stored events first, then live ones,
//! with no gap and no duplicate at the seam.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::broadcast::{self, error::RecvError};

use crate::events::{BusItem, Event};

/// The subscriber fell behind its bounded buffer and was ended; it can
/// resume with `after_sequence = last_sequence`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lagged {
    pub last_sequence: u64,
}

pub struct Subscription {
    replay: VecDeque<Event>,
    live: Option<broadcast::Receiver<BusItem>>,
    last: u64,
    done: bool,
    /// Whether raw parts (the direct caller's) are passed on.
    with_raw: bool,
    /// A turn's stream ends with that turn's `turn_finished`.
    until_turn: Option<u64>,
}

impl Subscription {
    /// The direct caller's stream: live from the first event, with raw parts.
    pub fn live(rx: broadcast::Receiver<BusItem>, with_raw: bool) -> Self {
        Subscription { replay: VecDeque::new(), live: Some(rx), last: 0, done: false, with_raw, until_turn: None }
    }

    pub fn replay_then_live(replay: Vec<Event>, live: Option<broadcast::Receiver<BusItem>>, after: u64) -> Self {
        Subscription { replay: replay.into(), live, last: after, done: false, with_raw: false, until_turn: None }
    }

    /// Ends the stream after the `turn_finished` of `turn`.
    pub fn until_turn(mut self, turn: u64) -> Self {
        self.until_turn = Some(turn);
        self
    }

    pub fn last_sequence(&self) -> u64 {
        self.last
    }

    /// The next event; `None` once `finished` was delivered or the subject
    /// is no longer live; `Err` when this subscriber fell behind.
    pub async fn next(&mut self) -> Option<Result<BusItem, Lagged>> {
        if self.done {
            return None;
        }
        if let Some(event) = self.replay.pop_front() {
            return Some(Ok(self.deliver(BusItem { event: Arc::new(event), raw: None })));
        }
        let rx = self.live.as_mut()?;
        loop {
            match rx.recv().await {
                Ok(item) if item.event.sequence <= self.last => continue,
                Ok(mut item) => {
                    if !self.with_raw {
                        item.raw = None;
                    }
                    return Some(Ok(self.deliver(item)));
                }
                Err(RecvError::Lagged(_)) => {
                    self.done = true;
                    return Some(Err(Lagged { last_sequence: self.last }));
                }
                Err(RecvError::Closed) => {
                    self.done = true;
                    return None;
                }
            }
        }
    }

    fn deliver(&mut self, item: BusItem) -> BusItem {
        self.last = item.event.sequence;
        let turn_done = matches!(
            (&item.event.kind, self.until_turn),
            (crate::events::EventKind::TurnFinished { turn, .. }, Some(until)) if *turn == until
        );
        if item.event.kind.is_finished() || turn_done {
            self.done = true;
        }
        item
    }
}
