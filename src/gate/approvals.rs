//! Tool calls waiting for a person: one registry per daemon. A call the
//! gate answered with *ask* is registered under its run (an execution or
//! session id) and a call id corral gives it; `DecideToolCall` settles it
//! once. The waiting side owns the entry: when it stops waiting (decided,
//! timed out, the run cancelled) the entry goes, and a late decision finds
//! nothing to decide.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// Settled calls remembered, so a second decision is told it came too late
/// rather than that the call never existed.
const REMEMBERED: usize = 4096;

/// A person's decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the call may run.
    pub allow: bool,
    /// The deciding principal.
    pub by: String,
    /// Why, as the person wrote it.
    pub reason: String,
}

/// Why a decision was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Undecidable {
    /// No such call is waiting under that run.
    Unknown,
    /// It was decided already (or stopped waiting).
    Settled,
}

type Key = (String, String);

#[derive(Default)]
struct Inner {
    pending: HashMap<Key, oneshot::Sender<Decision>>,
    settled: VecDeque<Key>,
    next: u64,
}

impl Inner {
    fn settle(&mut self, key: Key) {
        if self.settled.len() == REMEMBERED {
            self.settled.pop_front();
        }
        self.settled.push_back(key);
    }
}

/// The registry of tool calls waiting for a person's decision.
#[derive(Default)]
pub struct Approvals {
    inner: Mutex<Inner>,
}

/// One waiting call. Dropping it withdraws the call.
pub struct Waiter {
    /// The id corral gave the call (`call-<n>`); `DecideToolCall` names it.
    pub call_id: String,
    key: Key,
    rx: Option<oneshot::Receiver<Decision>>,
    approvals: Arc<Approvals>,
}

impl Approvals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a call of run `subject`; its id is `call-<n>`, unique in
    /// this daemon.
    pub fn open(self: &Arc<Self>, subject: &str) -> Waiter {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.lock();
        inner.next += 1;
        let call_id = format!("call-{}", inner.next);
        let key = (subject.to_string(), call_id.clone());
        inner.pending.insert(key.clone(), tx);
        Waiter { call_id, key, rx: Some(rx), approvals: self.clone() }
    }

    /// Settles call `call_id` of run `subject`.
    pub fn decide(&self, subject: &str, call_id: &str, decision: Decision) -> Result<(), Undecidable> {
        let key = (subject.to_string(), call_id.to_string());
        let mut inner = self.lock();
        match inner.pending.remove(&key) {
            Some(tx) => {
                inner.settle(key);
                // The waiter may have just timed out: then it was too late.
                tx.send(decision).map_err(|_| Undecidable::Settled)
            }
            None if inner.settled.contains(&key) => Err(Undecidable::Settled),
            None => Err(Undecidable::Unknown),
        }
    }

    /// Calls waiting now.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }
}

impl Waiter {
    /// The decision, or `None` when the registry dropped it.
    pub async fn decision(&mut self) -> Option<Decision> {
        self.rx.as_mut()?.await.ok()
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut inner = self.approvals.lock();
        if inner.pending.remove(&self.key).is_some() {
            let key = self.key.clone();
            inner.settle(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yes(by: &str) -> Decision {
        Decision { allow: true, by: by.into(), reason: "ok".into() }
    }

    #[tokio::test]
    async fn a_call_is_decided_once_under_its_own_run() {
        let approvals = Arc::new(Approvals::default());
        let mut waiter = approvals.open("exec-1");
        assert_eq!(waiter.call_id, "call-1");
        assert_eq!(approvals.decide("exec-2", "call-1", yes("p")), Err(Undecidable::Unknown), "another run's id");
        assert_eq!(approvals.decide("exec-1", "call-9", yes("p")), Err(Undecidable::Unknown));
        assert_eq!(approvals.decide("exec-1", "call-1", yes("p")), Ok(()));
        assert_eq!(waiter.decision().await, Some(yes("p")));
        assert_eq!(approvals.decide("exec-1", "call-1", yes("q")), Err(Undecidable::Settled), "decided twice");
        drop(waiter);
        assert_eq!(approvals.pending(), 0);
    }

    #[test]
    fn a_call_that_stopped_waiting_cannot_be_decided() {
        let approvals = Arc::new(Approvals::default());
        let waiter = approvals.open("exec-1");
        assert_eq!(approvals.pending(), 1);
        drop(waiter);
        assert_eq!(approvals.pending(), 0);
        assert_eq!(approvals.decide("exec-1", "call-1", yes("p")), Err(Undecidable::Settled));
        assert_eq!(approvals.open("exec-1").call_id, "call-2", "ids are never reused");
    }

    #[test]
    fn a_settled_call_is_told_apart_for_the_last_remembered_calls_then_unknown() {
        let approvals = Arc::new(Approvals::default());
        let oldest = approvals.open("exec-1");
        let call_id = oldest.call_id.clone();
        drop(oldest);
        for _ in 1..REMEMBERED {
            drop(approvals.open("exec-2"));
        }
        assert_eq!(approvals.decide("exec-1", &call_id, yes("p")), Err(Undecidable::Settled), "the oldest remembered");
        drop(approvals.open("exec-2"));
        assert_eq!(approvals.decide("exec-1", &call_id, yes("p")), Err(Undecidable::Unknown), "as the README says");
    }
}
