//! The single writer of a subject's events.

use std::sync::Arc;

use super::{BusItem, Event, EventBus, EventKind, RawPart};
use crate::records::now_ms;
use crate::store::Store;

/// Numbers, stores and then publishes one subject's events, so that each has
/// the next sequence and none is seen before it is stored. One per subject.
pub struct Recorder {
    subject: String,
    next: u64,
    store: Store,
    bus: Arc<EventBus>,
    /// Events held back to be stored with the next one (see
    /// [`Recorder::hold`]).
    held: Vec<EventKind>,
    /// The warm sandbox the write of the held events gives this subject
    /// (see [`Recorder::hold_adopting`]).
    held_adopt: Option<String>,
}

impl Recorder {
    /// A recorder whose next event gets `after + 1`.
    pub fn new(subject: String, after: u64, store: Store, bus: Arc<EventBus>) -> Self {
        Recorder { subject, next: after + 1, store, bus, held: Vec::new(), held_adopt: None }
    }

    /// The execution or session id the events belong to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The sequence of the last event stored (or of the one the recorder was
    /// created after); 0 when there is none.
    pub fn last_sequence(&self) -> u64 {
        self.next - 1
    }

    /// Keeps `kind` back, to be stored in one write with the next event
    /// emitted, and published with it: for steps that follow one another
    /// within microseconds (an execution's `accepted`, `resolved` and first
    /// `gated`), one write instead of one each. Nobody sees a held event
    /// before it is stored, and nothing emitted later overtakes it.
    pub fn hold(&mut self, kind: EventKind) {
        self.held.push(kind);
    }

    /// [`Recorder::hold`], and the write that stores it gives the sandbox
    /// `sandbox_id` to this subject and marks it ready too (see
    /// [`Store::append_events_adopting`]): a run names a warm sandbox it
    /// took, or marks the one made for it ready, in the write of its
    /// dispatch, not in one of its own.
    pub fn hold_adopting(&mut self, kind: EventKind, sandbox_id: &str) {
        self.held.push(kind);
        self.held_adopt = Some(sandbox_id.to_string());
    }

    /// The held events as the next write would store them, for a caller
    /// that stores them in a write of its own (the intent row of a sandbox
    /// made for this run: see `lifecycle::warm::make_sandbox`) and then
    /// hands them to [`Recorder::publish_held`]; they stay held until then.
    pub fn held_events(&self) -> Vec<Event> {
        numbered(&self.subject, self.next, self.held.iter().cloned())
    }

    /// Publishes the events from [`Recorder::held_events`] that the caller
    /// stored, in a write of `write_seconds` (counted as the recorder's own
    /// writes are): they are held no more.
    pub fn publish_held(&mut self, events: Vec<Event>, write_seconds: f64) {
        debug_assert_eq!(events.len(), self.held.len(), "the held events, all of them");
        if events.is_empty() {
            return;
        }
        crate::telemetry::events_stored(events.len(), write_seconds);
        self.held.clear();
        self.publish(events, None);
    }

    /// Stores and publishes the held events, if any.
    pub async fn flush(&mut self) {
        if !self.held.is_empty() {
            self.emit_batch(Vec::new()).await;
        }
    }

    /// Stores the event (after any held ones), then publishes it. A store
    /// error is retried a few times (a busy pool, a failover); events the
    /// store still refuses are not published (nobody may see what a later
    /// watcher could not replay), and their sequences are reused, so there
    /// are never gaps.
    pub async fn emit(&mut self, kind: EventKind, raw: Option<RawPart>) -> Option<Arc<Event>> {
        self.emit_batch(vec![(kind, raw)]).await
    }

    /// Stores several events (after any held ones) in one write, then
    /// publishes them in order; the last one, once published. Same rules
    /// as [`Recorder::emit`].
    pub async fn emit_batch(&mut self, mut kinds: Vec<(EventKind, Option<RawPart>)>) -> Option<Arc<Event>> {
        let held = self.held.len();
        if held > 0 {
            kinds.splice(0..0, self.held.drain(..).map(|kind| (kind, None)));
        }
        let adopt = self.held_adopt.take();
        if kinds.is_empty() {
            return None;
        }
        let (kinds, raws): (Vec<EventKind>, Vec<Option<RawPart>>) = kinds.into_iter().unzip();
        let events = numbered(&self.subject, self.next, kinds);
        let stored = match &adopt {
            None => self.persist_with(events.len(), || self.store.append_events(&events)).await,
            Some(sandbox) => {
                self.persist_with(events.len(), || self.store.append_events_adopting(&events, sandbox)).await
            }
        };
        if !stored {
            // The held events are the run's own record (`accepted`,
            // `resolved`, `gated`, `sandbox_ready`), promised to the next
            // write: held again, with the sandbox's adoption, for the write
            // after this one; only the events asked now are dropped.
            self.held = events.into_iter().take(held).map(|event| event.kind).collect();
            self.held_adopt = adopt;
            return None;
        }
        self.next += events.len() as u64;
        let mut last = None;
        for (event, raw) in events.into_iter().zip(raws) {
            let event = Arc::new(event);
            self.bus.publish(BusItem::new(event.clone(), raw.map(Arc::new)));
            last = Some(event);
        }
        last
    }

    /// The subject's last events, not stored yet: the held ones, then
    /// `kind`, for a caller that stores them in a transaction of its own
    /// (the final record's, see [`Store::finish_execution`]) through
    /// [`Recorder::persist_with`], then hands them to
    /// [`Recorder::publish`]. A run's `teardown` rides with its `finished`
    /// so: one commit where there were two.
    pub async fn prepare(&mut self, kind: EventKind) -> Vec<Event> {
        if self.held_adopt.is_some() {
            // The final record's transaction adopts nothing: the adopting
            // write goes first.
            self.flush().await;
        }
        numbered(&self.subject, self.next, self.held.drain(..).chain(std::iter::once(kind)))
    }

    /// Publishes the events from [`Recorder::prepare`] that the caller
    /// stored, in order; `raw` goes with the last. The last, once published.
    pub fn publish(&mut self, events: Vec<Event>, raw: Option<RawPart>) -> Option<Arc<Event>> {
        let count = events.len();
        let mut raw = raw.map(Arc::new);
        let mut last = None;
        for (i, event) in events.into_iter().enumerate() {
            debug_assert_eq!(event.sequence, self.next, "events are published in order");
            self.next = event.sequence + 1;
            let event = Arc::new(event);
            let raw = if i + 1 == count { raw.take() } else { None };
            self.bus.publish(BusItem::new(event.clone(), raw));
            last = Some(event);
        }
        last
    }

    /// Runs `write`, a run's final write (its record and `finished`), until
    /// the store takes it: a record left `running` would hold its
    /// principal's quota and keep every watcher waiting until the next
    /// start. Retried with a backoff up to 5 s; `false` only when the store
    /// can never take it (this node is fenced, the record cannot be
    /// encoded) or `give_up` is cancelled (the shutdown's grace is over:
    /// the next start's recovery finishes it).
    pub async fn persist_final_with<F, Fut>(
        &self,
        count: usize,
        give_up: &tokio_util::sync::CancellationToken,
        mut write: F,
    ) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), crate::store::StoreError>>,
    {
        use crate::store::StoreError;
        let mut delay = std::time::Duration::from_millis(20);
        for attempt in 1u64.. {
            let started = std::time::Instant::now();
            match write().await {
                Ok(()) => {
                    crate::telemetry::events_stored(count, started.elapsed().as_secs_f64());
                    return true;
                }
                Err(error @ (StoreError::Fenced { .. } | StoreError::Encoding(_))) => {
                    tracing::error!(subject = %self.subject, count, %error, "final record not stored");
                    return false;
                }
                Err(error) if self.committed_anyway(count).await => {
                    tracing::warn!(subject = %self.subject, %error, "the final record's write answered an error but committed");
                    return true;
                }
                Err(error) => {
                    tracing::warn!(subject = %self.subject, attempt, %error, "storing the final record failed; retrying");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = give_up.cancelled() => {
                    tracing::error!(subject = %self.subject, count, "final record not stored before the shutdown");
                    return false;
                }
            }
            delay = (delay * 4).min(std::time::Duration::from_secs(5));
        }
        false
    }

    /// Runs `write` (which stores `count` events), retrying a few times (a
    /// busy pool, a failover); `false` when the store still refuses.
    pub async fn persist_with<F, Fut>(&self, count: usize, mut write: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), crate::store::StoreError>>,
    {
        use crate::store::StoreError;
        let mut delay = std::time::Duration::from_millis(20);
        for attempt in 1..=5 {
            let started = std::time::Instant::now();
            match write().await {
                Ok(()) => {
                    crate::telemetry::events_stored(count, started.elapsed().as_secs_f64());
                    return true;
                }
                // A fenced node's or an unencodable write never committed.
                Err(error)
                    if !matches!(error, StoreError::Fenced { .. } | StoreError::Encoding(_))
                        && self.committed_anyway(count).await =>
                {
                    tracing::warn!(subject = %self.subject, %error, "events' write answered an error but committed");
                    return true;
                }
                Err(error) if attempt == 5 => {
                    tracing::error!(subject = %self.subject, count, %error, "events not stored");
                }
                Err(error) => {
                    tracing::warn!(subject = %self.subject, attempt, %error, "storing events failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 4;
                }
            }
        }
        false
    }

    /// Whether a write of `count` events from the next sequence that
    /// answered an error committed all the same (a PostgreSQL commit whose
    /// answer was lost to a failover or a reset connection): this recorder
    /// is its subject's one writer, so a stored sequence at or past the
    /// write's last is its own. Retrying it would conflict on every try,
    /// and every later write with it: the run would never finish.
    async fn committed_anyway(&self, count: usize) -> bool {
        let Some(last) = (self.next + count as u64).checked_sub(1) else { return false };
        matches!(self.store.sequence_bounds(&self.subject).await, Ok(Some((_, stored))) if stored >= last)
    }
}

/// `kinds` as events of `subject` numbered from `first`, stamped now (one
/// time for a batch stored in one write).
fn numbered(subject: &str, first: u64, kinds: impl IntoIterator<Item = EventKind>) -> Vec<Event> {
    let time_ms = now_ms();
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| Event { subject_id: subject.to_string(), sequence: first + i as u64, time_ms, kind })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write the store refuses (past its retries) drops the events asked
    /// for then, never the held ones before them: they are stored by the
    /// next write that succeeds, first, with no gap in the sequences.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_events_survive_a_write_the_store_refuses() {
        use sqlx::Connection;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "test").await.unwrap();
        let url = format!("sqlite://{}", dir.path().join("corral.db").display());
        let mut db = sqlx::SqliteConnection::connect(&url).await.unwrap();
        let refuse = "CREATE TRIGGER refuse_events BEFORE INSERT ON events \
                      BEGIN SELECT RAISE(ABORT, 'injected: the store refuses writes'); END";
        sqlx::query(refuse).execute(&mut db).await.unwrap();
        let mut recorder = Recorder::new("e1".into(), 0, store.clone(), Arc::new(EventBus::new(16)));
        let accepted = EventKind::Accepted {
            execution_id: "e1".into(),
            session_id: String::new(),
            request_id: String::new(),
            consumer: Default::default(),
        };
        recorder.hold(accepted);
        let progress =
            |tool: &str| EventKind::Progress { progress_kind: "tool_use".into(), tool: tool.into(), tokens_so_far: 0 };
        assert!(recorder.emit(progress("lost"), None).await.is_none(), "the store refused it");
        sqlx::query("DROP TRIGGER refuse_events").execute(&mut db).await.unwrap();
        assert!(recorder.emit(progress("kept"), None).await.is_some());
        let stored = store.events_after("e1", 0).await.unwrap();
        assert_eq!(stored.iter().map(|e| e.sequence).collect::<Vec<_>>(), [1, 2], "{stored:?}");
        assert!(
            matches!(&stored[0].kind, EventKind::Accepted { execution_id, .. } if execution_id == "e1"),
            "{stored:?}"
        );
        assert_eq!(stored[1].kind, progress("kept"));
    }

    /// A write that committed but answered an error (a PostgreSQL commit
    /// whose answer a failover lost) counts as stored, events' and final
    /// alike. Before, every retry conflicted on the stored sequence, and so
    /// did every later write: the run never finished. One that did not
    /// commit is still not stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_committed_but_answered_an_error_counts_as_stored() {
        use crate::store::StoreError;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "test").await.unwrap();
        let mut recorder = Recorder::new("e1".into(), 0, store.clone(), Arc::new(EventBus::new(16)));
        let progress =
            |tool: &str| EventKind::Progress { progress_kind: "tool_use".into(), tool: tool.into(), tokens_so_far: 0 };
        let answer_lost = |events: &Vec<Event>| {
            let (store, events) = (store.clone(), events.clone());
            move || {
                let (store, events) = (store.clone(), events.clone());
                async move {
                    store.append_events(&events).await?;
                    Err(StoreError::Database(sqlx::Error::PoolTimedOut))
                }
            }
        };
        let events = recorder.prepare(progress("first")).await;
        assert!(recorder.persist_with(events.len(), answer_lost(&events)).await, "it committed");
        recorder.publish(events, None);
        let last = recorder.prepare(progress("last")).await;
        let give_up = tokio_util::sync::CancellationToken::new();
        let stored = recorder.persist_final_with(last.len(), &give_up, answer_lost(&last));
        assert!(tokio::time::timeout(std::time::Duration::from_secs(10), stored).await.expect("not retried forever"));
        recorder.publish(last, None);
        let stored = store.events_after("e1", 0).await.unwrap();
        assert_eq!(stored.iter().map(|e| e.sequence).collect::<Vec<_>>(), [1, 2], "{stored:?}");
        assert_eq!(stored[1].kind, progress("last"));

        let never = recorder.prepare(progress("never")).await;
        let refused = || async { Err(StoreError::Database(sqlx::Error::PoolTimedOut)) };
        assert!(!recorder.persist_with(never.len(), refused).await, "nothing committed");
    }
}
