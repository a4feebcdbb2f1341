//! A subscriber's view of one subject: stored events first, then live ones,
//! with no gap and no duplicate at the seam.
//!
//! The live buffer is bounded and shared. A subscriber that reads slower
//! than the subject produces skips ahead in it; what it skipped is read
//! back from the store (every event is stored before it is sent), so a slow
//! reader costs no memory and still sees every event. A subscriber that
//! stops reading altogether is ended by its stream (see `api::execution`),
//! using [`Subscription::overrun`].

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::broadcast::{self, error::RecvError};

use crate::events::{BusItem, Event};
use crate::store::{Store, StoreError};

/// The subscriber was ended before its subject's end: it fell behind its
/// bounded buffer, could not read what it skipped back from the store, or
/// the subject's live events closed with its end not stored. It can resume
/// with `after_sequence = last_sequence`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lagged {
    /// The sequence of the last event the subscriber received.
    pub last_sequence: u64,
    /// Why it was ended.
    pub cut: Cut,
}

/// Why a subscriber was ended before its subject's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Further behind than the live buffer holds, with no store to catch
    /// up from (or stalled: see the API's event stream).
    Behind,
    /// Reading the store failed.
    StoreFailed,
    /// The subject's live events closed and every stored one was read, its
    /// `finished` (or the turn's `turn_finished`) not among them: a final
    /// write that gave up at shutdown, or a turn whose end the store
    /// refused. Never a clean end: whatever is stored later is found by a
    /// watch resumed after the last sequence.
    EndNotStored,
}

/// How many watch streams may be open: per subject, per principal (so one
/// tenant cannot hold every place) and in total.
pub(super) struct Watchers {
    bounds: WatchBounds,
    open: std::sync::Mutex<Open>,
}

/// The bounds of [`Watchers`] (each at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchBounds {
    /// Streams following one execution or session.
    pub per_subject: usize,
    /// Streams one principal holds with its own watch calls.
    pub per_principal: usize,
    /// All streams.
    pub total: usize,
}

#[derive(Default)]
struct Open {
    total: usize,
    by_subject: HashMap<String, usize>,
    by_principal: HashMap<String, usize>,
}

/// One open watch stream, counted until it is dropped (with its
/// subscription, when the stream ends for whatever reason).
pub struct WatchPermit {
    watchers: Arc<Watchers>,
    subject: String,
    principal: Option<String>,
}

impl Watchers {
    pub(super) fn new(bounds: WatchBounds) -> Arc<Watchers> {
        let bounds = WatchBounds {
            per_subject: bounds.per_subject.max(1),
            per_principal: bounds.per_principal.max(1),
            total: bounds.total.max(1),
        };
        Arc::new(Watchers { bounds, open: Default::default() })
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A permit for one more watcher of `subject` held by `principal`
    /// (`None`: one not bounded per principal), or which bound is full.
    pub(super) fn admit(self: &Arc<Self>, subject: &str, principal: Option<&str>) -> Result<WatchPermit, String> {
        let mut open = self.open();
        let Open { total, by_subject, by_principal } = &mut *open;
        if *total >= self.bounds.total {
            return Err(format!("{total} watch streams are open, the most this daemon serves; retry later"));
        }
        if let Some(principal) = principal {
            let held = by_principal.get(principal).copied().unwrap_or(0);
            if held >= self.bounds.per_principal {
                return Err(format!(
                    "principal {principal} holds {held} watch streams, the most one principal may; close one or retry \
                     later"
                ));
            }
        }
        let here = by_subject.entry(subject.to_string()).or_default();
        if *here >= self.bounds.per_subject {
            return Err(format!("{here} watch streams follow {subject}, the most one subject may have; retry later"));
        }
        *here += 1;
        *total += 1;
        if let Some(principal) = principal {
            *by_principal.entry(principal.to_string()).or_default() += 1;
        }
        Ok(WatchPermit {
            watchers: self.clone(),
            subject: subject.to_string(),
            principal: principal.map(str::to_string),
        })
    }
}

impl Drop for WatchPermit {
    fn drop(&mut self) {
        let mut open = self.watchers.open();
        let Open { total, by_subject, by_principal } = &mut *open;
        *total = total.saturating_sub(1);
        for (map, key) in [(by_subject, Some(&self.subject)), (by_principal, self.principal.as_ref())] {
            let Some(key) = key else { continue };
            if let Some(count) = map.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    map.remove(key);
                }
            }
        }
    }
}

/// One watcher's stream of a subject's events: the stored ones first, then the
/// live ones. Counts against the watch bounds while it lives.
pub struct Subscription {
    /// Held while the subscription lives: the watcher counts against the bounds.
    _permit: Option<WatchPermit>,
    /// Stored events to deliver before anything else: a run of a page
    /// shared with every other subscriber reading the same stretch.
    replay: Run,
    live: Option<broadcast::Receiver<BusItem>>,
    last: u64,
    done: bool,
    /// Whether raw parts (the direct caller's) are passed on.
    with_raw: bool,
    /// Where a direct caller's `finished` (or `turn_finished`) event of a
    /// run on another node gets its raw result from.
    raw_from: Option<RawFrom>,
    /// A turn's stream ends with that turn's `turn_finished`.
    until_turn: Option<u64>,
    /// A subject running on another daemon (shared store): followed by
    /// polling the store, since its live channel is not here.
    poll: Option<(Store, String)>,
    /// Woken when the polled subject has new events (see `polling`).
    wakeup: Option<Arc<Wakeup>>,
    /// The wakeup's generation when the store was last read: while it is
    /// the same, nothing was stored since, and the next read waits for news.
    read_at: Option<u64>,
    /// Where skipped events are read back from, and the live buffer's size.
    catch_up: Option<(Arc<EventPages>, String, usize)>,
    /// The live event that showed a gap, held until the gap before it has
    /// been read back, page by page.
    held: Option<BusItem>,
    /// The subject ended: what this subscriber has not seen is read back
    /// from the store, page by page.
    draining: bool,
    /// The live channel closed: the subject's `finished` is in the store,
    /// or it was never stored ([`Cut::EndNotStored`]).
    live_closed: bool,
    /// The stored events delivered last filled their page to its end: more
    /// may be stored after them, from before this subscriber joined the
    /// live channel (which holds none of them), so the next page is read
    /// before the live channel is waited on.
    more_stored: bool,
}

/// Stored events read back in aligned pages (page k holds sequences
/// k·PAGE+1 ..= (k+1)·PAGE), shared by every subscriber: a thousand
/// watchers that fell behind together cost one store query per page, not
/// one each, hold the page once (each a [`Run`] of it: two indices), and
/// share each event's encoding (a page holds [`BusItem`]s, whose wire
/// bytes the first stream to send one fills for all). A page is found
/// again for as long as any subscriber still holds a run of it, and the
/// [`PAGES_KEPT`] read last are held here too, for the subscribers that
/// reach them next: the memory is that of the stretches watchers are on,
/// not of every page read lately. A page still filling is found again too,
/// and read again only by a subscriber that needs an event past its end.
pub struct EventPages {
    store: Store,
    /// Every page a subscriber may still hold, by (subject, index); the
    /// [`PAGES_KEPT`] read last, held, oldest first.
    kept: std::sync::Mutex<Kept>,
    /// One store read at a time: subscribers that miss the same page wait
    /// for the first one's read and then find it kept.
    fill: tokio::sync::Mutex<()>,
}

type Page = Arc<[BusItem]>;
type PageKey = (String, u64);

/// Every page a subscriber may still hold, found by key, and the pages
/// read last, held, oldest first.
#[derive(Default)]
struct Kept {
    pages: HashMap<PageKey, Weak<[BusItem]>>,
    held: VecDeque<Page>,
}

/// A stretch of a shared page: `items[next..end]`, in sequence order.
#[derive(Clone, Default)]
pub struct Run {
    items: Option<Page>,
    next: usize,
    end: usize,
}

impl Run {
    /// The events of `page` with `after < sequence < before`.
    fn of(page: Page, after: u64, before: u64) -> Run {
        let next = page.partition_point(|item| item.event().sequence <= after);
        let end = page.partition_point(|item| item.event().sequence < before).max(next);
        Run { items: Some(page), next, end }
    }

    /// Events from elsewhere (a poll of the store), as a run of their own.
    fn owned(events: Vec<Event>) -> Run {
        let page: Page = events.into_iter().map(|e| BusItem::new(Arc::new(e), None)).collect();
        Run { end: page.len(), items: Some(page), next: 0 }
    }

    /// Whether it runs to the end of a full page: the events after it are
    /// on the next page.
    fn ends_a_full_page(&self) -> bool {
        self.items.as_ref().is_some_and(|page| page.len() as u64 == PAGE && self.end == page.len())
    }

    fn items(&self) -> &[BusItem] {
        self.items.as_deref().map(|items| &items[self.next..self.end]).unwrap_or_default()
    }

    /// Whether nothing is left in it.
    pub fn is_empty(&self) -> bool {
        self.items().is_empty()
    }

    /// The last event in it.
    pub fn last(&self) -> Option<&Event> {
        self.items().last().map(|item| item.event())
    }

    fn pop_front(&mut self) -> Option<BusItem> {
        let item = self.items().first()?.clone();
        self.next += 1;
        if self.next == self.end {
            // Let go of the page as soon as this subscriber is past it.
            *self = Run::default();
        }
        Some(item)
    }
}

/// Pages held after their read whether or not a subscriber holds them.
const PAGES_KEPT: usize = 4;

impl EventPages {
    pub fn new(store: Store) -> Arc<EventPages> {
        Arc::new(EventPages { store, kept: Default::default(), fill: tokio::sync::Mutex::new(()) })
    }

    fn kept(&self, key: &PageKey) -> Option<Page> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).pages.get(key).and_then(Weak::upgrade)
    }

    /// The stored events of `subject` with `after < sequence < before`, up
    /// to the end of the page that holds `after + 1`.
    pub async fn between(&self, subject: &str, after: u64, before: u64) -> Result<Run, StoreError> {
        let page = self.page(subject, after / PAGE, before.saturating_sub(1)).await?;
        Ok(Run::of(page, after, before))
    }

    /// Page `index` of `subject`, holding every stored event up to
    /// `through` that it can hold: a kept page that is full, or that
    /// already reaches `through`, is not read again.
    async fn page(&self, subject: &str, index: u64, through: u64) -> Result<Page, StoreError> {
        let key = (subject.to_string(), index);
        let enough =
            |page: &Page| page.len() as u64 == PAGE || page.last().is_some_and(|item| item.event().sequence >= through);
        if let Some(page) = self.kept(&key).filter(enough) {
            return Ok(page);
        }
        let _fill = self.fill.lock().await;
        if let Some(page) = self.kept(&key).filter(enough) {
            return Ok(page);
        }
        let first = index.saturating_mul(PAGE);
        let events = self.store.events_between(subject, first, first.saturating_add(PAGE + 1)).await?;
        let page: Page = events.into_iter().map(|event| BusItem::new(Arc::new(event), None)).collect();
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let Kept { pages, held } = &mut *kept;
        pages.insert(key, Arc::downgrade(&page));
        held.push_back(page.clone());
        if held.len() > PAGES_KEPT {
            held.pop_front();
            // Forget what nobody holds any more (at most a few entries: one
            // per page still held, plus those dropped since the last read).
            pages.retain(|_, page| page.strong_count() > 0);
        }
        Ok(page)
    }
}

/// Events read back from the store at a time: what one lagging subscriber
/// holds in memory at most, however far behind it is (a watch that starts
/// far back, too).
const PAGE: u64 = 1024;

/// How often a subject of another daemon is polled.
const POLL_EVERY: Duration = Duration::from_millis(100);

impl Subscription {
    /// The direct caller's stream: live from the first event, with raw parts.
    pub fn live(rx: broadcast::Receiver<BusItem>, with_raw: bool) -> Self {
        Subscription {
            _permit: None,
            replay: Run::default(),
            live: Some(rx),
            last: 0,
            done: false,
            with_raw,
            raw_from: None,
            until_turn: None,
            poll: None,
            wakeup: None,
            read_at: None,
            catch_up: None,
            held: None,
            draining: false,
            live_closed: false,
            more_stored: false,
        }
    }

    /// `replay` is the first page of stored events after `after`; without a
    /// live channel the rest is read back from the store (see
    /// [`Subscription::catching_up`]) a page at a time.
    pub fn replay_then_live(replay: Run, live: Option<broadcast::Receiver<BusItem>>, after: u64) -> Self {
        let draining = live.is_none();
        let more_stored = replay.ends_a_full_page();
        Subscription {
            _permit: None,
            replay,
            live,
            last: after,
            done: false,
            with_raw: false,
            raw_from: None,
            until_turn: None,
            poll: None,
            wakeup: None,
            read_at: None,
            catch_up: None,
            held: None,
            draining,
            live_closed: false,
            more_stored,
        }
    }

    /// Reads events this subscriber skipped in the live buffer back from
    /// the store through `pages`; `capacity` is the live buffer's size.
    pub fn catching_up(mut self, pages: Arc<EventPages>, subject: String, capacity: usize) -> Self {
        self.catch_up = Some((pages, subject, capacity));
        self
    }

    /// Whether this subscriber is further behind than the live buffer holds
    /// (it has to catch up from the store, or is doing so): what the live
    /// channel holds for it, and the gap it is reading back before the live
    /// event it holds.
    pub fn overrun(&self) -> bool {
        let (Some(rx), Some((_, _, capacity))) = (&self.live, &self.catch_up) else { return false };
        let gap = self.held.as_ref().map_or(0, |held| held.event().sequence.saturating_sub(self.last));
        // The configured capacity, not the channel's (tokio rounds it up to a
        // power of two): `watch_buffer` is the documented limit.
        (rx.len() as u64).saturating_add(gap) > *capacity as u64
    }

    /// Counts this subscription as a watcher until it is dropped.
    pub fn holding(mut self, permit: WatchPermit) -> Self {
        self._permit = Some(permit);
        self
    }

    /// Follows the subject through the store instead of a live channel.
    pub fn polling(mut self, store: Store, subject: String, wakeup: Arc<Wakeup>) -> Self {
        self.poll = Some((store, subject));
        self.wakeup = Some(wakeup);
        self.draining = false;
        // Polling reads on a page at a time by itself.
        self.more_stored = false;
        self
    }

    /// Starts after `sequence`: events up to it belong to someone else.
    pub fn after(mut self, sequence: u64) -> Self {
        self.last = sequence;
        self
    }

    /// Ends the stream after the `turn_finished` of `turn`.
    pub fn until_turn(mut self, turn: u64) -> Self {
        self.until_turn = Some(turn);
        self
    }

    /// The sequence of the last event delivered (or the one the stream started
    /// after).
    pub fn last_sequence(&self) -> u64 {
        self.last
    }

    /// The direct caller's stream of a run on another node (one it queued):
    /// its `finished` event gets the raw result the running node stored for
    /// the owner in `store`, as the live one would carry it (whether it
    /// comes from the first replay or from polling).
    pub fn for_direct_caller(mut self, store: Store, subject: String) -> Self {
        self.raw_from = Some(RawFrom::Execution(store, subject));
        self
    }

    /// The caller's stream of a turn sent to another node through request
    /// `request`: its `turn_finished` gets the raw result the owner hands
    /// back on that request (see `Engine::answer_turn`).
    pub fn for_forwarded_turn(mut self, store: Store, request: String) -> Self {
        self.raw_from = Some(RawFrom::Turn(store, request));
        self
    }

    /// The next event; `None` once `finished` (or the turn's
    /// `turn_finished`) was delivered, or an ended subject's stored events
    /// were all read back; `Err` when this subscriber was cut before its
    /// subject's end (see [`Cut`]).
    pub async fn next(&mut self) -> Option<Result<BusItem, Lagged>> {
        let mut next = self.next_event().await;
        if let (Some(Ok(item)), Some(from)) = (&mut next, &self.raw_from) {
            if item.raw.is_none() {
                if let Some(raw) = from.raw_of(&item.event().kind).await {
                    item.raw = Some(Arc::new(crate::events::RawPart::Finished(raw)));
                }
            }
        }
        next
    }

    async fn next_event(&mut self) -> Option<Result<BusItem, Lagged>> {
        if self.done {
            return None;
        }
        if let Some(item) = self.replay.pop_front() {
            return Some(Ok(self.deliver(item)));
        }
        if let Some(result) = self.read_back().await {
            return result;
        }
        if self.draining {
            self.done = true;
            return None;
        }
        if self.live.is_none() {
            return self.poll_next().await;
        }
        let rx = self.live.as_mut()?;
        loop {
            match rx.recv().await {
                Ok(item) if item.event().sequence <= self.last => continue,
                Ok(mut item) => {
                    if !self.with_raw {
                        item.raw = None;
                    }
                    if item.event().sequence > self.last.saturating_add(1) && self.catch_up.is_some() {
                        // Skipped in the live buffer: the gap comes from the
                        // store, a page at a time, then this event.
                        self.held = Some(item);
                        return self.read_back().await.flatten();
                    }
                    return Some(Ok(self.deliver(item)));
                }
                Err(RecvError::Lagged(_)) if self.catch_up.is_some() => continue,
                Err(RecvError::Lagged(_)) => {
                    self.done = true;
                    return Some(Err(Lagged { last_sequence: self.last, cut: Cut::Behind }));
                }
                Err(RecvError::Closed) => {
                    // The subject ended; whatever this subscriber has not
                    // seen yet (it may have been behind) is in the store.
                    self.live = None;
                    self.live_closed = true;
                    self.draining = self.catch_up.is_some();
                    if let Some(result) = self.read_back().await {
                        return result;
                    }
                    // Every event reached it live, and none was its end.
                    self.done = true;
                    return Some(Err(Lagged { last_sequence: self.last, cut: Cut::EndNotStored }));
                }
            }
        }
    }

    /// The next event read back from the store: the next page of the gap
    /// before a held live event (then that event), of what is left after
    /// the subject ended, or of what was stored after a full page before
    /// this subscriber joined the live channel. `None` when there is
    /// nothing to read back.
    async fn read_back(&mut self) -> Option<Option<Result<BusItem, Lagged>>> {
        // While live events wait, the next one shows any gap by itself
        // (then read back up to it): reading on unbounded would chase a fast
        // harness while the live buffer fills. Only an idle channel needs it.
        let more_stored = std::mem::take(&mut self.more_stored) && self.live.as_ref().is_none_or(|rx| rx.is_empty());
        if self.held.is_none() && !self.draining && !more_stored {
            return None;
        }
        let (pages, subject, _) = self.catch_up.clone()?;
        // A read gives at most the rest of one page (see EventPages).
        let before = match &self.held {
            Some(held) if held.event().sequence <= self.last.saturating_add(1) => {
                let held = self.held.take()?;
                return Some(Some(Ok(self.deliver(held))));
            }
            Some(held) => held.event().sequence,
            None => u64::MAX,
        };
        let reading_on = self.held.is_none() && !self.draining;
        match pages.between(&subject, self.last, before).await {
            // Nothing stored past the full page: the live channel has the rest.
            Ok(run) if run.is_empty() && reading_on => None,
            Ok(run) if run.is_empty() => {
                // Nothing stored where the gap is (compacted away): go on
                // with the held event, or end.
                self.draining = false;
                match self.held.take() {
                    Some(held) => Some(Some(Ok(self.deliver(held)))),
                    // Read to the end after its live events closed, with
                    // no end among them (`deliver` ends on one).
                    None if self.live_closed => {
                        self.done = true;
                        Some(Some(Err(Lagged { last_sequence: self.last, cut: Cut::EndNotStored })))
                    }
                    None => {
                        self.done = true;
                        Some(None)
                    }
                }
            }
            Ok(run) => {
                self.more_stored = before == u64::MAX && run.ends_a_full_page();
                self.replay = run;
                let item = self.replay.pop_front()?;
                Some(Some(Ok(self.deliver(item))))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading skipped events failed; ending the watch");
                self.done = true;
                Some(Some(Err(Lagged { last_sequence: self.last, cut: Cut::StoreFailed })))
            }
        }
    }

    async fn poll_next(&mut self) -> Option<Result<BusItem, Lagged>> {
        let (store, subject) = self.poll.clone()?;
        loop {
            let generation = self.wakeup.as_ref().map(|w| w.generation());
            if let (Some(wakeup), Some(read_at)) = (self.wakeup.clone(), self.read_at) {
                if generation == Some(read_at) {
                    // Nothing announced since the last read: wait for the
                    // store's NOTIFY, or POLL_EVERY anyway (one missed
                    // while the listener reconnects), then read.
                    let notified = wakeup.notify.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    if wakeup.generation() == read_at {
                        let _ = tokio::time::timeout(POLL_EVERY, notified).await;
                    }
                    self.read_at = None;
                    continue;
                }
            }
            // The generation is taken before the read: an event stored
            // after the read began is announced after it, so it changes.
            // A page at a time: a follower far behind never holds its whole
            // backlog. A full page may have more after it, so the next read
            // comes at once rather than waiting for an announcement.
            match store.events_after_limited(&subject, self.last, PAGE).await {
                Ok(events) if !events.is_empty() => {
                    self.read_at = if events.len() as u64 >= PAGE { None } else { generation };
                    self.replay = Run::owned(events);
                    let item = self.replay.pop_front()?;
                    return Some(Ok(self.deliver(item)));
                }
                Ok(_) if self.wakeup.is_some() => self.read_at = generation,
                Ok(_) => tokio::time::sleep(POLL_EVERY).await,
                Err(e) => {
                    // Not a clean end: the run goes on elsewhere, and this
                    // watcher has not seen its `finished`; it may resume.
                    tracing::warn!(%subject, error = %e, "polling the store failed; ending the watch");
                    self.done = true;
                    return Some(Err(Lagged { last_sequence: self.last, cut: Cut::StoreFailed }));
                }
            }
        }
    }

    fn deliver(&mut self, item: BusItem) -> BusItem {
        self.last = item.event().sequence;
        let turn_done = matches!(
            (&item.event().kind, self.until_turn),
            (crate::events::EventKind::TurnFinished { turn, .. }, Some(until)) if *turn == until
        );
        if item.event().kind.is_finished() || turn_done {
            self.done = true;
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchers_are_bounded_per_subject_per_principal_and_in_total() {
        let w = Watchers::new(WatchBounds { per_subject: 2, per_principal: 3, total: 5 });
        let a1 = w.admit("a", Some("p")).unwrap();
        let _a2 = w.admit("a", Some("p")).unwrap();
        assert_eq!(
            w.admit("a", Some("q")).err().unwrap(),
            "2 watch streams follow a, the most one subject may have; retry later"
        );
        let _b1 = w.admit("b", Some("p")).unwrap();
        assert_eq!(
            w.admit("c", Some("p")).err().unwrap(),
            "principal p holds 3 watch streams, the most one principal may; close one or retry later"
        );
        // Other principals, and one not bounded per principal, still get in.
        let _c1 = w.admit("c", Some("q")).unwrap();
        let _c2 = w.admit("c", None).unwrap();
        assert_eq!(
            w.admit("d", Some("q")).err().unwrap(),
            "5 watch streams are open, the most this daemon serves; retry later"
        );
        drop(a1);
        assert_eq!(w.open().by_principal.get("p"), Some(&2));
        let _a3 = w.admit("a", Some("p")).expect("a dropped permit is given back, to its subject and its principal");
        drop((_a2, _b1, _a3, _c1, _c2));
        let open = w.open();
        assert_eq!((open.total, open.by_subject.len(), open.by_principal.len()), (0, 0, 0), "every count is gone");
    }

    fn event(subject: &str, sequence: u64) -> Event {
        let kind = crate::events::EventKind::Progress {
            progress_kind: "output".into(),
            tool: String::new(),
            tokens_so_far: sequence,
        };
        Event { subject_id: subject.into(), sequence, time_ms: 1_000, kind }
    }

    fn sequences(mut run: Run) -> Vec<u64> {
        std::iter::from_fn(|| run.pop_front()).map(|item| item.event().sequence).collect()
    }

    #[test]
    fn a_run_is_the_stretch_of_its_page_strictly_between_its_bounds() {
        let page: Page = [3, 4, 5, 6].into_iter().map(|s| BusItem::new(Arc::new(event("e", s)), None)).collect();
        let cases: [(u64, u64, &[u64]); 7] = [
            (0, u64::MAX, &[3, 4, 5, 6]),
            (3, u64::MAX, &[4, 5, 6]),
            (3, 6, &[4, 5]),
            (4, 5, &[]),
            (6, u64::MAX, &[]),
            (9, 2, &[]),
            (0, 3, &[]),
        ];
        for (after, before, expected) in cases {
            let run = Run::of(page.clone(), after, before);
            assert_eq!(run.is_empty(), expected.is_empty(), "({after}, {before})");
            assert_eq!(run.last().map(|e| e.sequence), expected.last().copied(), "({after}, {before})");
            assert_eq!(sequences(run), expected, "({after}, {before})");
        }
        let mut run = Run::of(page.clone(), 4, u64::MAX);
        assert_eq!(Arc::strong_count(&page), 2);
        run.pop_front();
        run.pop_front();
        assert!(run.pop_front().is_none() && run.is_empty());
        assert_eq!(Arc::strong_count(&page), 1, "an exhausted run lets go of its page");
        assert!(Run::default().pop_front().is_none());
    }

    #[tokio::test]
    async fn overrun_is_past_the_configured_capacity_not_the_channel_s() {
        // 5000 is not a power of two: tokio's channel holds 8192, but a
        // watcher is behind once more than 5000 events are waiting for it.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let (tx, rx) = broadcast::channel(5000);
        let pages = EventPages::new(store.clone());
        let sub = Subscription::live(rx, false).catching_up(pages, "e".into(), 5000);
        for s in 1..=5000 {
            tx.send(BusItem::new(Arc::new(event("e", s)), None)).unwrap();
        }
        assert!(!sub.overrun(), "5000 behind with watch_buffer 5000 is not overrun");
        tx.send(BusItem::new(Arc::new(event("e", 5001)), None)).unwrap();
        assert!(sub.overrun(), "5001 behind with watch_buffer 5000 is overrun");
    }

    #[tokio::test]
    async fn a_follower_of_a_run_elsewhere_reads_the_store_a_page_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let total = 2 * PAGE + 5;
        let stored: Vec<Event> = (1..=total).map(|s| event("e", s)).collect();
        store.append_events(&stored).await.unwrap();
        assert_eq!(store.events_after_limited("e", 0, PAGE).await.unwrap().len() as u64, PAGE);
        let tail = store.events_after_limited("e", 2 * PAGE, PAGE).await.unwrap();
        assert_eq!(tail.iter().map(|e| e.sequence).collect::<Vec<_>>(), (2 * PAGE + 1..=total).collect::<Vec<_>>());
        let wakeup = Arc::new(Wakeup::default());
        let mut sub = Subscription::replay_then_live(Run::default(), None, 0).polling(store, "e".into(), wakeup);
        for expected in 1..=total {
            assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, expected, "in order, no gap");
            assert!(sub.replay.items().len() < PAGE as usize, "never more than a page held");
            if expected <= 2 * PAGE {
                // A full page was read: the next one is read at once, not
                // after waiting for an announcement.
                assert!(sub.read_at.is_none(), "at {expected}");
            }
        }
        assert_eq!(sub.read_at, Some(0), "caught up: waits for the next announcement");
    }

    #[tokio::test]
    async fn a_follower_whose_store_read_fails_ends_with_the_store_failure_not_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        store.append_events(&[event("e", 1), event("e", 2)]).await.unwrap();
        let wakeup = Arc::new(Wakeup::default());
        let mut sub =
            Subscription::replay_then_live(Run::default(), None, 0).polling(store.clone(), "e".into(), wakeup);
        for expected in 1..=2 {
            assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, expected);
        }
        // The run goes on elsewhere, but this node can no longer read it.
        store.close().await;
        let ended = sub.next().await.expect("not a clean end: no `finished` was seen");
        assert_eq!(ended.err(), Some(Lagged { last_sequence: 2, cut: Cut::StoreFailed }));
        assert!(sub.next().await.is_none(), "ended");
    }

    /// A subject's live events that close with no end among them (a
    /// final write given up at shutdown, a turn's end the store refused)
    /// cut the subscriber with the last sequence it got: never a clean
    /// end. One behind finds an end that was stored and not sent.
    #[tokio::test]
    async fn live_events_that_close_with_no_end_cut_the_subscriber_not_end_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let turn_end = |subject: &str, sequence: u64| {
            let kind = crate::events::EventKind::TurnFinished {
                turn: 1,
                tool: "echo".into(),
                ok: true,
                error: String::new(),
                tokens_spent: 0,
            };
            Event { subject_id: subject.into(), sequence, time_ms: 1_000, kind }
        };
        let pages = EventPages::new(store.clone());
        let cut = |last_sequence| Some(Lagged { last_sequence, cut: Cut::EndNotStored });
        for (subject, catch_up) in [("caught-up", true), ("no-store", false)] {
            let (tx, rx) = broadcast::channel(16);
            let sub = Subscription::live(rx, false).until_turn(1);
            let mut sub = if catch_up { sub.catching_up(pages.clone(), subject.into(), 16) } else { sub };
            let events: Vec<Event> = (1..=3).map(|s| event(subject, s)).collect();
            store.append_events(&events).await.unwrap();
            for e in events {
                tx.send(BusItem::new(Arc::new(e), None)).unwrap();
            }
            drop(tx);
            for expected in 1..=3 {
                assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, expected, "{subject}");
            }
            assert_eq!(sub.next().await.and_then(Result::err), cut(3), "{subject}");
            assert!(sub.next().await.is_none(), "{subject}: ended");
        }
        // Behind the live buffer (4) when it closed: reads 1..=10 back, and
        // the turn's end, stored but never sent, ends it cleanly.
        let (tx, rx) = broadcast::channel(4);
        let mut sub = Subscription::live(rx, false).until_turn(1).catching_up(pages.clone(), "behind".into(), 4);
        let mut events: Vec<Event> = (1..=10).map(|s| event("behind", s)).collect();
        for e in &events {
            let _ = tx.send(BusItem::new(Arc::new(e.clone()), None));
        }
        events.push(turn_end("behind", 11));
        store.append_events(&events).await.unwrap();
        drop(tx);
        let mut seen = Vec::new();
        for _ in 1..=11 {
            seen.push(sub.next().await.unwrap().unwrap().event().sequence);
        }
        assert_eq!(seen, (1..=11).collect::<Vec<_>>());
        assert!(sub.next().await.is_none(), "its end was read back: a clean end");
        // A subject read back after it ended (no live channel) still ends
        // cleanly at its last stored event, an end or not (compacted).
        let mut sub = Subscription::replay_then_live(Run::default(), None, 0).catching_up(pages, "no-store".into(), 16);
        for expected in 1..=3 {
            assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, expected);
        }
        assert!(sub.next().await.is_none());
    }

    #[tokio::test]
    async fn a_subscriber_reading_back_a_gap_counts_it_as_behind() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let (tx, rx) = broadcast::channel(16);
        let pages = EventPages::new(store.clone());
        let mut sub = Subscription::live(rx, false).catching_up(pages, "e".into(), 16);
        let send = |from: u64, to: u64| {
            let events: Vec<Event> = (from..=to).map(|s| event("e", s)).collect();
            let (store, tx) = (&store, &tx);
            async move {
                store.append_events(&events).await.unwrap();
                for e in events {
                    tx.send(BusItem::new(Arc::new(e), None)).unwrap();
                }
            }
        };
        send(1, 1).await;
        assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, 1);
        assert!(!sub.overrun(), "caught up");
        // 40 more: the live buffer keeps the last 16 (25..=40), so this
        // subscriber holds 25 and reads 2..=24 back from the store.
        send(2, 40).await;
        assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, 2);
        assert!(sub.held.is_some());
        // Behind: 15 left in the live buffer and the gap 2 -> 25 (23).
        assert_eq!(sub.live.as_ref().unwrap().len(), 15);
        assert!(sub.overrun(), "15 in the live buffer and 23 to read back: behind more than 16");
        for expected in 3..=40 {
            assert_eq!(sub.next().await.unwrap().unwrap().event().sequence, expected);
        }
        assert!(!sub.overrun(), "caught up again");
    }

    #[tokio::test]
    async fn watchers_behind_on_the_same_stretch_share_one_read_and_each_event_s_encoding() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let stored: Vec<Event> = (1..=PAGE + 10).map(|s| event("e", s)).collect();
        store.append_events(&stored).await.unwrap();
        let pages = EventPages::new(store.clone());

        let (mut a, mut b) = (pages.between("e", 0, 500).await.unwrap(), pages.between("e", 0, 500).await.unwrap());
        let (first_a, first_b) = (a.pop_front().unwrap(), b.pop_front().unwrap());
        assert_eq!(first_a.event().sequence, 1);
        assert!(std::ptr::eq(first_a.wire(), first_b.wire()), "one encoding cell for both watchers");
        assert!(std::ptr::eq(first_a.event(), first_b.event()));
        assert_eq!(sequences(a).len(), 498);

        // The second page is still filling: it is kept, and read again only
        // for an event past its end.
        let partial = pages.between("e", PAGE, u64::MAX).await.unwrap();
        assert_eq!(partial.last().map(|e| e.sequence), Some(PAGE + 10));
        let again = pages.between("e", PAGE + 2, PAGE + 11).await.unwrap();
        assert!(
            Arc::ptr_eq(&partial.items.clone().unwrap(), &again.items.clone().unwrap()),
            "reaches `before`: not read again"
        );
        store.append_events(&[event("e", PAGE + 11)]).await.unwrap();
        let grown = pages.between("e", PAGE + 2, u64::MAX).await.unwrap();
        assert_eq!(grown.last().map(|e| e.sequence), Some(PAGE + 11), "an event past the kept end is read");
        assert_eq!(sequences(grown).len(), 9);
    }

    #[tokio::test]
    async fn a_page_is_kept_while_a_watcher_holds_it_and_let_go_once_nobody_does() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let pages_stored = PAGES_KEPT as u64 + 3;
        let stored: Vec<Event> = (1..=PAGE * pages_stored).map(|s| event("e", s)).collect();
        store.append_events(&stored).await.unwrap();
        let pages = EventPages::new(store.clone());
        let page = |run: &Run| run.items.clone().unwrap();

        // A watcher stays on page 0 while others read every later page.
        let holder = pages.between("e", 0, u64::MAX).await.unwrap();
        let first = pages.between("e", 0, u64::MAX).await.unwrap();
        let mut later: Vec<Page> = Vec::new();
        for index in 1..pages_stored {
            later.push(page(&pages.between("e", index * PAGE, u64::MAX).await.unwrap()));
        }
        assert!(Arc::ptr_eq(&page(&holder), &page(&first)), "one read for both");
        let again = pages.between("e", 5, u64::MAX).await.unwrap();
        assert!(Arc::ptr_eq(&page(&holder), &page(&again)), "a held page is found again, however many were read since");

        // Nobody holds page 1 now; it is older than the pages kept: it is let go.
        let weak_1 = Arc::downgrade(&later[0]);
        later.remove(0);
        assert_eq!(weak_1.strong_count(), 0, "page 1 is held by no one, not even the pages kept");
        let kept_last = Arc::downgrade(later.last().unwrap());
        later.clear();
        assert!(kept_last.strong_count() > 0, "the pages read last are kept");
        let reread = pages.between("e", PAGE, u64::MAX).await.unwrap();
        assert_eq!(reread.items().first().map(|i| i.event().sequence), Some(PAGE + 1), "read again from the store");
        drop((holder, first, again, reread));
        let kept = pages.kept.lock().unwrap();
        assert!(
            kept.pages.len() <= PAGES_KEPT + 1,
            "entries of pages nobody holds are forgotten: {}",
            kept.pages.len()
        );
        assert_eq!(kept.held.len(), PAGES_KEPT);
    }
}

/// Which watchers of runs on other nodes wait for news of which subject:
/// the store's `NOTIFY corral_events` wakes them (see `fleet`).
#[derive(Default)]
pub struct Wakeups {
    waiting: Mutex<HashMap<String, std::sync::Weak<Wakeup>>>,
}

/// What the watchers of one subject on another node wait on: woken, and
/// counted, at every NOTIFY of the subject.
#[derive(Default)]
pub struct Wakeup {
    notify: tokio::sync::Notify,
    generation: std::sync::atomic::AtomicU64,
}

impl Wakeup {
    /// How many times the subject was announced so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn wake(&self) {
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl Wakeups {
    /// What a watcher of `subject` waits on (shared by its watchers).
    pub fn waiter(&self, subject: &str) -> Arc<Wakeup> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.retain(|_, w| w.strong_count() > 0);
        if let Some(existing) = waiting.get(subject).and_then(|w| w.upgrade()) {
            return existing;
        }
        let wakeup = Arc::new(Wakeup::default());
        waiting.insert(subject.to_string(), Arc::downgrade(&wakeup));
        wakeup
    }

    /// `subject` has new events: every watcher waiting for it reads now.
    pub fn wake(&self, subject: &str) {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(wakeup) = waiting.get(subject).and_then(|w| w.upgrade()) {
            wakeup.wake();
        }
    }
}

#[cfg(test)]
mod wakeup_tests {
    use super::*;

    #[tokio::test]
    async fn a_wake_reaches_the_waiters_of_its_subject_only() {
        let wakeups = Wakeups::default();
        let a = wakeups.waiter("a");
        assert!(Arc::ptr_eq(&a, &wakeups.waiter("a")), "one waiter per subject");
        let b = wakeups.waiter("b");
        {
            let (woken_a, woken_b) = (a.notify.notified(), b.notify.notified());
            tokio::pin!(woken_a, woken_b);
            woken_a.as_mut().enable();
            woken_b.as_mut().enable();
            wakeups.wake("a");
            assert!(tokio::time::timeout(Duration::from_millis(100), woken_a).await.is_ok());
            assert!(tokio::time::timeout(Duration::from_millis(50), woken_b).await.is_err(), "b was not woken");
        }
        assert_eq!((a.generation(), b.generation()), (1, 0), "a wake counts, for a watcher that was reading");
        drop((a, b));
        assert!(wakeups.waiting.lock().unwrap().values().all(|w| w.strong_count() == 0));
        let _c = wakeups.waiter("c");
        assert_eq!(wakeups.waiting.lock().unwrap().len(), 1, "dropped waiters are forgotten");
    }
}

/// Where the raw result of a run on another node is read back from.
enum RawFrom {
    /// An execution's, kept in the store for its owner.
    Execution(Store, String),
    /// A forwarded turn's, handed back on its request by the owner just
    /// after the turn's `turn_finished` is stored.
    Turn(Store, String),
}

/// How long a forwarded turn's caller waits for the raw result after the
/// `turn_finished` event (the owner writes it right after the event).
const TURN_RAW_WAIT: Duration = Duration::from_secs(2);

impl RawFrom {
    async fn raw_of(&self, kind: &crate::events::EventKind) -> Option<crate::records::RawResult> {
        use crate::events::EventKind;
        match (self, kind) {
            (RawFrom::Execution(store, subject), EventKind::Finished { .. }) => {
                let (tool_output, tool_error) = store.get_raw(subject).await.ok().flatten()?;
                Some(crate::records::RawResult { tool_output, tool_error })
            }
            (RawFrom::Turn(store, request), EventKind::TurnFinished { .. }) => {
                let deadline = std::time::Instant::now() + TURN_RAW_WAIT;
                loop {
                    if let Ok(Some(raw)) = store.request_raw(request).await {
                        return serde_json::from_str(&raw).ok();
                    }
                    if std::time::Instant::now() >= deadline {
                        tracing::warn!(request = %request, "a forwarded turn's raw result did not come back");
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            _ => None,
        }
    }
}
