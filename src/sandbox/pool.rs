//! Warm pools: sandboxes made ahead of any request, each waiting for the
//! one execution or session it will serve (see [`super::waiter`]).
//!
//! This is the bookkeeping only, generic over what a warm sandbox is so it
//! can be checked with exact vectors: which pool is filled next, and
//! whether there is room for it, which waiting sandbox a request takes
//! (never one made for another profile version, sandbox or timeout, nor
//! one whose first process died while it waited) and, when it takes none,
//! why, and what a closed pool or a dead sandbox hands back to be
//! destroyed, whether a request found it dead or it was seen dying while
//! it waited. The daemon fills, takes and destroys (`lifecycle::warm`).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::SandboxSpec;

/// What a warm sandbox was made for. A request takes one only when its
/// resolved profile and the gate's effective sandbox and timeout are
/// exactly these; any other request takes the cold path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolKey {
    /// The digest of the profile version it was made from.
    pub profile_digest: String,
    /// The sandbox it has: the profile's, untightened.
    pub spec: SandboxSpec,
    /// The timeout its hook settings were made with.
    pub timeout_seconds: u64,
}

struct Pool<T> {
    /// As configured: a profile id, or `id@version`.
    profile_ref: String,
    size: usize,
    /// What its sandboxes are made for now (`None` before the first).
    key: Option<PoolKey>,
    warm: VecDeque<T>,
    filling: usize,
    /// Sandboxes that failed to be made, or whose first process died soon
    /// after, since one was last taken: the pool waits [`backoff`] of it.
    failures: u32,
    /// Nothing is made for it before this (see `failures`).
    not_before: Option<Instant>,
}

/// How long a pool waits after `failures` failures in a row: 200 ms,
/// doubled each time, at most 30 s.
pub fn backoff(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(200);
    const MOST: Duration = Duration::from_secs(30);
    FIRST.saturating_mul(1u32 << failures.saturating_sub(1).min(16)).min(MOST)
}

impl<T> Pool<T> {
    fn back_off(&mut self, now: Instant) {
        self.failures = self.failures.saturating_add(1);
        self.not_before = Some(now + backoff(self.failures));
    }

    /// Whether its sandboxes are of the profile `profile_id` (any version).
    fn is_of(&self, profile_id: &str) -> bool {
        self.profile_ref.split('@').next() == Some(profile_id)
    }
}

/// What a request found in the pools; each but the last names the pool
/// (its configured profile reference).
#[derive(Debug, PartialEq)]
pub enum Take<T> {
    /// A sandbox made for exactly the request, taken out: it serves this
    /// request and no other.
    Warm(String, T),
    /// The pool made for the request had none waiting (all taken, being
    /// made, or none made yet).
    Empty(String),
    /// The pool made for the request had only sandboxes whose first
    /// process had exited while they waited ([`Pools::take_live`]).
    Dead(String),
    /// The pools of the request's profile are made for another version of
    /// it, or for another sandbox or timeout (the gate tightened the run's).
    Mismatch(String),
    /// No pool keeps sandboxes of the request's profile.
    NoPool,
}

/// What a filler does next ([`Pools::next_fill`]).
#[derive(Debug, PartialEq)]
pub enum Fill {
    /// Make a sandbox for the pool at this index (its profile reference).
    Make(usize, String),
    /// Every pool holds its size, waiting and being made.
    Full,
    /// A pool is short, but the pools hold all the room there is: nothing
    /// until a run ends.
    NoRoom,
    /// Every short pool is waiting after a failure: nothing before then.
    Wait(Instant),
    /// The pools are closed: nothing, ever.
    Closed,
}

/// Every configured pool, by profile reference.
pub struct Pools<T> {
    pools: Vec<Pool<T>>,
    closed: bool,
}

impl<T> Pools<T> {
    /// A pool of `size` for each profile reference (size 0: none).
    pub fn new(sizes: &BTreeMap<String, usize>) -> Pools<T> {
        let pools = sizes
            .iter()
            .filter(|(_, size)| **size > 0)
            .map(|(profile_ref, size)| Pool {
                profile_ref: profile_ref.clone(),
                size: *size,
                key: None,
                warm: VecDeque::new(),
                filling: 0,
                failures: 0,
                not_before: None,
            })
            .collect();
        Pools { pools, closed: false }
    }

    /// Whether any pool is configured.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    /// The oldest waiting sandbox made for exactly `key` (a request for the
    /// profile `profile_id`), taken out; else why there is none. The pool a
    /// miss is counted against: the one made for `key`; else one of the
    /// same profile version (made for another sandbox or timeout); else one
    /// of the profile that has made nothing yet (it may be for `key`); else
    /// any of the profile. (The daemon refuses, at start, two pools whose
    /// references resolve to one profile version: only the first would
    /// ever be taken from.)
    pub fn take(&mut self, key: &PoolKey, profile_id: &str) -> Take<T> {
        if let Some(pool) = self.pools.iter_mut().find(|p| p.key.as_ref() == Some(key)) {
            return match pool.warm.pop_front() {
                Some(item) => {
                    // One served: what failed before is behind it.
                    pool.failures = 0;
                    Take::Warm(pool.profile_ref.clone(), item)
                }
                None => Take::Empty(pool.profile_ref.clone()),
            };
        }
        let of_profile = || self.pools.iter().filter(|p| p.is_of(profile_id));
        let same_version = |p: &&Pool<T>| p.key.as_ref().is_some_and(|k| k.profile_digest == key.profile_digest);
        if let Some(pool) = of_profile().find(same_version) {
            return Take::Mismatch(pool.profile_ref.clone());
        }
        if let Some(pool) = of_profile().find(|p| p.key.is_none()) {
            return Take::Empty(pool.profile_ref.clone());
        }
        match of_profile().next() {
            Some(pool) => Take::Mismatch(pool.profile_ref.clone()),
            None => Take::NoPool,
        }
    }

    /// [`take`](Self::take), past every waiting sandbox that `live` says
    /// is no longer usable (its first process exited while it waited):
    /// those are taken out too, and handed back to be destroyed.
    pub fn take_live(&mut self, key: &PoolKey, profile_id: &str, live: impl Fn(&T) -> bool) -> (Take<T>, Vec<T>) {
        let mut dead = Vec::new();
        loop {
            match self.take(key, profile_id) {
                Take::Warm(_, item) if !live(&item) => dead.push(item),
                Take::Empty(pool) if !dead.is_empty() => return (Take::Dead(pool), dead),
                taken => return (taken, dead),
            }
        }
    }

    /// Takes out every waiting sandbox for which `dead` holds (its first
    /// process was seen to exit while it waited), with its pool's profile
    /// reference, to be destroyed; its place is made again like a taken
    /// one's.
    pub fn remove_dead(&mut self, dead: impl Fn(&T) -> bool) -> Vec<(String, T)> {
        let mut out = Vec::new();
        for pool in &mut self.pools {
            let (gone, kept): (VecDeque<T>, VecDeque<T>) = pool.warm.drain(..).partition(|item| dead(item));
            pool.warm = kept;
            out.extend(gone.into_iter().map(|item| (pool.profile_ref.clone(), item)));
        }
        out
    }

    /// What to make next at `now`, given `room`: how many sandboxes the
    /// pools may hold now, waiting and being made together (what admission
    /// would still let run). The pool to make one for is the one furthest
    /// below its size, counting those being made, among those not waiting
    /// after a failure (one that keeps failing holds up no other); it is
    /// counted as being made until [`filled`](Self::filled) or
    /// [`failed`](Self::failed).
    pub fn next_fill(&mut self, room: usize, now: Instant) -> Fill {
        if self.closed {
            return Fill::Closed;
        }
        let held: usize = self.pools.iter().map(|p| p.warm.len() + p.filling).sum();
        let short = || self.pools.iter().filter(|p| p.warm.len() + p.filling < p.size);
        let Some(first_ready) = short().map(|p| p.not_before.filter(|t| *t > now)).min() else {
            return Fill::Full;
        };
        if held >= room {
            return Fill::NoRoom;
        }
        if let Some(until) = first_ready {
            return Fill::Wait(until);
        }
        let Some((index, pool)) = self
            .pools
            .iter_mut()
            .enumerate()
            .filter(|(_, p)| p.warm.len() + p.filling < p.size && p.not_before.is_none_or(|t| t <= now))
            .max_by_key(|(i, p)| (p.size - p.warm.len() - p.filling, usize::MAX - i))
        else {
            return Fill::Full;
        };
        pool.filling += 1;
        Fill::Make(index, pool.profile_ref.clone())
    }

    /// A sandbox for pool `index` is ready, made for `key`. Returns what is
    /// to be destroyed: the sandbox itself when the pools closed meanwhile,
    /// else every waiting one made for an earlier key (a new profile
    /// version: they would never be taken).
    pub fn filled(&mut self, index: usize, key: PoolKey, item: T) -> Vec<T> {
        let closed = self.closed;
        let Some(pool) = self.pools.get_mut(index) else { return vec![item] };
        pool.filling = pool.filling.saturating_sub(1);
        if closed {
            return vec![item];
        }
        let stale = match pool.key.as_ref() == Some(&key) {
            true => Vec::new(),
            false => pool.warm.drain(..).collect(),
        };
        pool.key = Some(key);
        pool.warm.push_back(item);
        stale
    }

    /// Making a sandbox for pool `index` failed at `now`: nothing more is
    /// made for it for [`backoff`] of its failures.
    pub fn failed(&mut self, index: usize, now: Instant) {
        if let Some(pool) = self.pools.get_mut(index) {
            pool.filling = pool.filling.saturating_sub(1);
            pool.back_off(now);
        }
    }

    /// A sandbox of the pool `profile_ref` died soon after it was made (at
    /// `now`): a fault that making it did not show (a path the host lacks,
    /// a limit too small). Counted as a failure, so the pool does not make
    /// sandbox after sandbox at once.
    pub fn died_young(&mut self, profile_ref: &str, now: Instant) {
        if let Some(pool) = self.pools.iter_mut().find(|p| p.profile_ref == profile_ref) {
            pool.back_off(now);
        }
    }

    /// No more filling: every waiting sandbox, to be destroyed.
    pub fn close(&mut self) -> Vec<T> {
        self.closed = true;
        self.pools.iter_mut().flat_map(|p| p.warm.drain(..)).collect()
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// `(profile reference, waiting, size)` of each pool.
    pub fn levels(&self) -> Vec<(String, usize, usize)> {
        self.pools.iter().map(|p| (p.profile_ref.clone(), p.warm.len(), p.size)).collect()
    }

    /// Every waiting item, in every pool.
    pub fn waiting(&self) -> impl Iterator<Item = &T> {
        self.pools.iter().flat_map(|p| p.warm.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(digest: &str) -> PoolKey {
        PoolKey { profile_digest: digest.into(), spec: SandboxSpec::default(), timeout_seconds: 60 }
    }

    fn pools(sizes: &[(&str, usize)]) -> Pools<u32> {
        Pools::new(&sizes.iter().map(|(r, n)| (r.to_string(), *n)).collect())
    }

    /// The index of the pool to make a sandbox for, room aside.
    fn make(p: &mut Pools<u32>) -> usize {
        match p.next_fill(usize::MAX, now()) {
            Fill::Make(index, _) => index,
            other => panic!("nothing to make: {other:?}"),
        }
    }

    #[test]
    fn the_pool_furthest_below_its_size_fills_first_and_none_past_its_size() {
        let mut p = pools(&[("a", 2), ("b", 1), ("z", 0)]);
        assert_eq!(p.levels(), [("a".to_string(), 0, 2), ("b".to_string(), 0, 1)]);
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()));
        // a: 1 short (one being made), b: 1 short; the first wins a tie.
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()));
        assert_eq!(p.next_fill(9, now()), Fill::Make(1, "b".into()));
        assert_eq!(p.next_fill(9, now()), Fill::Full, "everything is being made");
        let t0 = now();
        p.failed(1, t0);
        let ms = Duration::from_millis;
        assert_eq!(p.next_fill(9, t0), Fill::Wait(t0 + ms(200)), "b waits after its failure");
        assert_eq!(p.next_fill(9, t0 + ms(200)), Fill::Make(1, "b".into()));
    }

    /// A pool that keeps failing waits longer each time (200 ms doubled, at
    /// most 30 s) and holds up no other pool; a sandbox of it that dies
    /// soon after it was made counts as a failure; one taken resets it.
    #[test]
    fn a_failing_pool_backs_off_and_starves_no_other() {
        let ms = Duration::from_millis;
        let backoffs: Vec<Duration> = (1..=10).map(backoff).collect();
        let expected = [200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000].map(ms);
        assert_eq!(backoffs, expected);
        assert_eq!(backoff(u32::MAX), ms(30_000));
        let mut p = pools(&[("a", 1), ("b", 1)]);
        let t0 = now();
        assert_eq!(p.next_fill(9, t0), Fill::Make(0, "a".into()));
        p.failed(0, t0);
        // a is furthest below its size again, but waits: b is made.
        assert_eq!(p.next_fill(9, t0), Fill::Make(1, "b".into()));
        assert!(p.filled(1, key("b1"), 7).is_empty());
        assert_eq!(p.next_fill(9, t0 + ms(199)), Fill::Wait(t0 + ms(200)));
        assert_eq!(p.next_fill(9, t0 + ms(200)), Fill::Make(0, "a".into()));
        let t1 = t0 + ms(300);
        p.failed(0, t1);
        assert_eq!(
            p.next_fill(9, t1 + ms(399)),
            Fill::Wait(t1 + ms(400)),
            "the second failure in a row waits twice as long"
        );
        // b's sandbox taken: b is made again at once, whatever a waits for.
        assert_eq!(p.take(&key("b1"), "b"), Take::Warm("b".into(), 7));
        assert_eq!(p.next_fill(9, t1), Fill::Make(1, "b".into()));
        assert!(p.filled(1, key("b1"), 8).is_empty());
        // b's next one dies at once: b waits too.
        assert_eq!(p.remove_dead(|item| *item == 8), [("b".to_string(), 8)]);
        p.died_young("b", t1);
        assert_eq!(p.next_fill(9, t1), Fill::Wait(t1 + ms(200)));
        assert_eq!(p.next_fill(9, t1 + ms(400)), Fill::Make(0, "a".into()));
        assert!(p.filled(0, key("a1"), 9).is_empty());
        assert_eq!(p.take(&key("a1"), "a"), Take::Warm("a".into(), 9));
        let t2 = t1 + ms(1000);
        let index = p_index(&mut p, t2);
        p.failed(index, t2);
        assert_eq!(p.next_fill(9, t2), Fill::Make(1, "b".into()), "b's wait is over");
        assert_eq!(p.next_fill(9, t2), Fill::Wait(t2 + ms(200)), "a served one: its count started again");
    }

    fn p_index(p: &mut Pools<u32>, at: Instant) -> usize {
        match p.next_fill(9, at) {
            Fill::Make(index, _) => index,
            other => panic!("nothing to make: {other:?}"),
        }
    }

    fn now() -> Instant {
        Instant::now()
    }

    #[test]
    fn the_pools_make_nothing_past_the_room_they_are_given() {
        let mut p = pools(&[("a", 2), ("b", 1)]);
        assert_eq!(p.next_fill(0, now()), Fill::NoRoom, "a node running all it may");
        assert_eq!(p.next_fill(2, now()), Fill::Make(0, "a".into()));
        assert_eq!(p.next_fill(2, now()), Fill::Make(0, "a".into()));
        assert_eq!(p.next_fill(2, now()), Fill::NoRoom, "two being made: all the room");
        assert!(p.filled(0, key("d"), 1).is_empty());
        assert_eq!(p.next_fill(2, now()), Fill::NoRoom, "one waiting, one being made");
        assert_eq!(p.next_fill(3, now()), Fill::Make(1, "b".into()));
        assert_eq!(p.next_fill(0, now()), Fill::Full, "full: nothing to wait for");
        assert_eq!(p.take(&key("d"), "a"), Take::Warm("a".into(), 1));
        assert_eq!(p.next_fill(2, now()), Fill::NoRoom, "one being made for each pool");
        assert_eq!(p.next_fill(3, now()), Fill::Make(0, "a".into()));
    }

    #[test]
    fn a_warm_sandbox_is_taken_once_oldest_first_and_only_for_its_key() {
        let mut p = pools(&[("a", 3)]);
        for item in [10, 11] {
            let i = make(&mut p);
            assert!(p.filled(i, key("d1"), item).is_empty());
        }
        assert_eq!(p.take(&key("d2"), "a"), Take::Mismatch("a".into()), "another profile version");
        let mut tighter = key("d1");
        tighter.spec.allow_network = true;
        assert_eq!(p.take(&tighter, "a"), Take::Mismatch("a".into()), "another sandbox");
        let mut shorter = key("d1");
        shorter.timeout_seconds = 30;
        assert_eq!(p.take(&shorter, "a"), Take::Mismatch("a".into()), "another timeout");
        assert_eq!(p.take(&key("d1"), "a"), Take::Warm("a".into(), 10));
        assert_eq!(p.take(&key("d1"), "a"), Take::Warm("a".into(), 11));
        assert_eq!(p.take(&key("d1"), "a"), Take::Empty("a".into()));
        assert_eq!(p.take(&key("d1"), "b"), Take::Empty("a".into()), "the key decides, not the id");
        assert_eq!(p.take(&key("d9"), "b"), Take::NoPool);
        assert_eq!(p.levels(), [("a".to_string(), 0, 3)]);
    }

    #[test]
    fn a_dead_sandbox_is_handed_back_and_the_next_one_taken() {
        let mut p = pools(&[("a", 3)]);
        for item in [1, 2, 3] {
            let i = make(&mut p);
            p.filled(i, key("d"), item);
        }
        assert_eq!(p.take_live(&key("d"), "a", |i| *i != 1), (Take::Warm("a".into(), 2), vec![1]));
        assert_eq!(p.take_live(&key("d"), "a", |_| false), (Take::Dead("a".into()), vec![3]));
        assert_eq!(p.take_live(&key("d"), "a", |_| false), (Take::Empty("a".into()), vec![]), "none was waiting");
        assert_eq!(p.levels(), [("a".to_string(), 0, 3)]);
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()), "the dead ones' places are made again");
        let i = make(&mut p);
        p.filled(i, key("d"), 4);
        let mismatch = p.take_live(&key("other"), "a", |_| panic!("a sandbox made for another key was looked at"));
        assert_eq!(mismatch, (Take::Mismatch("a".into()), vec![]));
        assert_eq!(p.levels(), [("a".to_string(), 1, 3)]);
    }

    #[test]
    fn a_sandbox_seen_dying_is_taken_out_and_its_place_made_again() {
        let mut p = pools(&[("a", 3), ("b", 1)]);
        for item in [1, 2, 3, 4] {
            let i = make(&mut p);
            p.filled(i, key(if i == 0 { "da" } else { "db" }), item);
        }
        assert_eq!(p.levels(), [("a".to_string(), 3, 3), ("b".to_string(), 1, 1)]);
        assert_eq!(p.remove_dead(|i| *i == 9), [], "none dead");
        assert_eq!(p.remove_dead(|i| *i == 2 || *i == 4), [("a".to_string(), 2), ("b".to_string(), 4)]);
        assert_eq!(p.levels(), [("a".to_string(), 2, 3), ("b".to_string(), 0, 1)]);
        assert_eq!(p.remove_dead(|i| *i == 2), [], "taken out once");
        assert_eq!(p.take(&key("da"), "a"), Take::Warm("a".into(), 1), "the rest keep their order");
        assert_eq!(p.take(&key("da"), "a"), Take::Warm("a".into(), 3));
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()), "the dead one's place is made again");
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()));
        assert_eq!(p.next_fill(9, now()), Fill::Make(0, "a".into()));
        assert_eq!(p.next_fill(9, now()), Fill::Make(1, "b".into()));
        assert_eq!(p.next_fill(9, now()), Fill::Full);
    }

    #[test]
    fn a_miss_is_counted_against_the_pool_that_could_have_served_it() {
        let mut p = pools(&[("x@1.0.0", 1), ("x@2.0.0", 1), ("y", 1)]);
        assert_eq!(p.take(&key("d1"), "x"), Take::Empty("x@1.0.0".into()), "nothing made yet");
        assert_eq!(p.take(&key("d1"), "z"), Take::NoPool, "no pool of that profile");
        let filled = |p: &mut Pools<u32>, digest: &str, item| {
            let i = make(p);
            p.filled(i, key(digest), item);
        };
        filled(&mut p, "d1", 1);
        assert_eq!(p.take(&key("d2"), "x"), Take::Empty("x@2.0.0".into()), "x@2.0.0 has made nothing yet");
        filled(&mut p, "d2", 2);
        let mut tighter = key("d2");
        tighter.spec.allow_network = true;
        assert_eq!(p.take(&tighter, "x"), Take::Mismatch("x@2.0.0".into()), "the pool of its version");
        assert_eq!(p.take(&key("d3"), "x"), Take::Mismatch("x@1.0.0".into()), "a version no pool keeps");
        assert_eq!(p.take(&key("d2"), "x"), Take::Warm("x@2.0.0".into(), 2));
        assert_eq!(p.take(&key("d2"), "x"), Take::Empty("x@2.0.0".into()));
    }

    #[test]
    fn a_new_profile_version_hands_back_the_sandboxes_made_for_the_old_one() {
        let mut p = pools(&[("a", 3)]);
        for item in [1, 2] {
            let i = make(&mut p);
            p.filled(i, key("old"), item);
        }
        let i = make(&mut p);
        assert_eq!(p.filled(i, key("new"), 3), [1, 2]);
        assert_eq!(p.take(&key("old"), "a"), Take::Mismatch("a".into()));
        assert_eq!(p.take(&key("new"), "a"), Take::Warm("a".into(), 3));
    }

    #[test]
    fn closed_pools_fill_nothing_and_hand_back_everything() {
        let mut p = pools(&[("a", 2), ("b", 2)]);
        let a = make(&mut p);
        p.filled(a, key("da"), 1);
        let b = make(&mut p);
        assert_eq!(b, 1);
        p.filled(b, key("db"), 2);
        let late = make(&mut p);
        let mut all = p.close();
        all.sort();
        assert_eq!(all, [1, 2]);
        assert!(p.is_closed());
        assert_eq!(p.next_fill(9, now()), Fill::Closed);
        assert_eq!(p.filled(late, key("da"), 3), [3], "made while closing: destroyed at once");
        assert_eq!(p.take(&key("da"), "a"), Take::Empty("a".into()));
    }
}
