//! What a sandbox's proxy saw, shared with the daemon. Everything here is
//! bounded: a sandbox that floods its proxy with attempts costs counters,
//! not memory.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

/// Pending decisions kept until the daemon drains them; later ones are only counted.
pub const MAX_PENDING: usize = 256;
/// Bytes of host and reason the pending decisions may hold: a reason
/// quotes the request whole (the daemon scrubs it, then cuts it), up to
/// ~96 KiB of a 16 KiB head escaped; past this, decisions are only counted.
pub const MAX_PENDING_BYTES: usize = 1 << 20;
/// Distinct denied `host:port`s remembered for `denied_hosts`.
pub const MAX_DENIED_HOSTS: usize = 64;
/// Distinct `host:port`s with their own byte counters; the rest go to `"other"`.
pub const MAX_BYTE_HOSTS: usize = 64;

/// One connection attempt, decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressDecision {
    /// Normalized host as the client named it (lowercase name, or IP without
    /// brackets); empty when the request could not be parsed that far.
    pub host: String,
    /// 0 when the request could not be parsed that far.
    pub port: u16,
    /// Whether the connection was let through.
    pub allowed: bool,
    /// the rule that allowed it, or why it was denied
    pub rule_or_reason: String,
    /// "connect" or "http"
    pub method: &'static str,
}

#[derive(Default)]
struct State {
    pending: VecDeque<EgressDecision>,
    /// Bytes of host and reason in `pending`.
    pending_bytes: usize,
    dropped: u64,
    allowed: u64,
    denied: u64,
    denied_hosts: Vec<String>,
    bytes: BTreeMap<String, (u64, u64)>,
    other: Option<(u64, u64)>,
}

/// What a proxy saw, shared with the daemon: bounded.
#[derive(Default)]
pub struct EgressLog {
    state: Mutex<State>,
    notify: Notify,
    /// The daemon's connection budget and the principal this sandbox runs
    /// for; a proxy without it refuses every connection.
    budget: std::sync::OnceLock<(std::sync::Arc<super::ProxyBudget>, String)>,
    forbidden: std::sync::OnceLock<Vec<String>>,
}

impl EgressLog {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters invalid.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Values no request through the proxy may carry (the run's credential
    /// placeholders: only the gateway takes them).
    pub fn forbid(&self, values: Vec<String>) {
        let _ = self.forbidden.set(values);
    }

    /// The values set by [`Self::forbid`]; empty before.
    pub fn forbidden(&self) -> &[String] {
        self.forbidden.get().map(Vec::as_slice).unwrap_or_default()
    }

    /// Ties this sandbox's proxy to the daemon's connection budget, counted
    /// for `principal`. Set once; later calls change nothing.
    pub fn attach_budget(&self, budget: std::sync::Arc<super::ProxyBudget>, principal: &str) {
        let _ = self.budget.set((budget, principal.to_string()));
    }

    /// The budget and principal, if attached.
    pub fn budget(&self) -> Option<&(std::sync::Arc<super::ProxyBudget>, String)> {
        self.budget.get()
    }

    /// Records one decision and wakes the daemon.
    pub fn record(&self, decision: EgressDecision) {
        {
            let mut state = self.state();
            if decision.allowed {
                state.allowed += 1;
            } else {
                state.denied += 1;
                if !decision.host.is_empty() && state.denied_hosts.len() < MAX_DENIED_HOSTS {
                    let key = host_port(&decision.host, decision.port);
                    if !state.denied_hosts.contains(&key) {
                        state.denied_hosts.push(key);
                    }
                }
            }
            let bytes = decision.host.len() + decision.rule_or_reason.len();
            if state.pending.len() < MAX_PENDING && state.pending_bytes + bytes <= MAX_PENDING_BYTES {
                state.pending_bytes += bytes;
                state.pending.push_back(decision);
            } else {
                state.dropped += 1;
            }
        }
        // notify_one keeps a permit if the daemon is not waiting yet.
        self.notify.notify_one();
    }

    /// Adds bytes copied for an allowed connection to `key` (`host:port`).
    pub fn add_bytes(&self, key: &str, up: u64, down: u64) {
        let mut state = self.state();
        let state = &mut *state;
        let slot = if state.bytes.contains_key(key) || state.bytes.len() < MAX_BYTE_HOSTS {
            state.bytes.entry(key.to_string()).or_default()
        } else {
            state.other.get_or_insert((0, 0))
        };
        slot.0 = slot.0.saturating_add(up);
        slot.1 = slot.1.saturating_add(down);
    }

    /// Decisions not yet taken by the daemon; at most `max_pending` (256) are kept, later ones
    /// only counted in `dropped()`.
    pub fn drain(&self) -> Vec<EgressDecision> {
        let mut state = self.state();
        state.pending_bytes = 0;
        state.pending.drain(..).collect()
    }

    /// Total decisions that did not fit in the pending queue, since creation.
    pub fn dropped(&self) -> u64 {
        self.state().dropped
    }

    /// (allowed, denied) totals, all attempts.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.state();
        (state.allowed, state.denied)
    }

    /// The first distinct denied `host:port`s, at most `max` (and at most 64 are remembered).
    pub fn denied_hosts(&self, max: usize) -> Vec<String> {
        self.state().denied_hosts.iter().take(max).cloned().collect()
    }

    /// Bytes (up, down) per `host:port` of allowed connections, sorted by host; at most 64
    /// hosts, the rest summed under a final `"other"`.
    pub fn bytes(&self) -> Vec<(String, u64, u64)> {
        let state = self.state();
        let mut out: Vec<_> = state.bytes.iter().map(|(k, (up, down))| (k.clone(), *up, *down)).collect();
        if let Some((up, down)) = state.other {
            out.push(("other".to_string(), up, down));
        }
        out
    }

    /// Notified after every new decision (the daemon drains on it).
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

/// `host:port`, IPv6 in brackets.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(i: usize, allowed: bool) -> EgressDecision {
        EgressDecision {
            host: format!("h{i}.example.com"),
            port: 443,
            allowed,
            rule_or_reason: if allowed { "*".into() } else { "not in the allowlist".into() },
            method: "connect",
        }
    }

    #[test]
    fn pending_decisions_hold_at_most_a_mebibyte_of_text() {
        let log = EgressLog::default();
        let big = |i: u16| EgressDecision {
            host: String::new(),
            port: i,
            allowed: false,
            rule_or_reason: "x".repeat(96 << 10),
            method: "http",
        };
        for i in 0..20 {
            log.record(big(i));
        }
        assert_eq!(log.dropped(), 10, "ten of 96 KiB fit in 1 MiB");
        assert_eq!(log.drain().len(), 10);
        log.record(big(20));
        assert_eq!(log.drain().len(), 1, "a drain frees the room");
    }

    #[test]
    fn a_flood_keeps_256_pending_and_counts_the_rest() {
        let log = EgressLog::default();
        for i in 0..10_000 {
            log.record(decision(i, i % 2 == 0));
        }
        let pending = log.drain();
        assert_eq!(pending.len(), MAX_PENDING);
        assert_eq!(pending[0], decision(0, true), "the oldest are kept");
        assert_eq!(pending[255], decision(255, false));
        assert_eq!(log.dropped(), 10_000 - 256);
        assert_eq!(log.counts(), (5_000, 5_000));
        assert_eq!(log.denied_hosts(usize::MAX).len(), MAX_DENIED_HOSTS);
        assert_eq!(log.denied_hosts(2), vec!["h1.example.com:443".to_string(), "h3.example.com:443".to_string()]);
        assert!(log.drain().is_empty(), "drained means taken");
        log.record(decision(1, false));
        assert_eq!(log.drain().len(), 1, "room again after a drain");
        assert_eq!(log.dropped(), 9_744);
        assert_eq!(log.denied_hosts(usize::MAX).len(), MAX_DENIED_HOSTS, "a repeat is not a new host");
    }

    #[test]
    fn denied_hosts_are_distinct_and_skip_unparsed_requests() {
        let log = EgressLog::default();
        log.record(decision(1, false));
        log.record(decision(1, false));
        log.record(EgressDecision { host: String::new(), port: 0, ..decision(2, false) });
        log.record(EgressDecision { host: "::1".into(), port: 8080, ..decision(2, false) });
        assert_eq!(log.denied_hosts(10), vec!["h1.example.com:443".to_string(), "[::1]:8080".to_string()]);
        assert_eq!(log.counts(), (0, 4));
    }

    #[test]
    fn bytes_are_sorted_and_capped_at_64_hosts() {
        let log = EgressLog::default();
        for i in (0..70u64).rev() {
            log.add_bytes(&format!("h{i:02}:443"), i, 1);
        }
        log.add_bytes("h69:443", 0, 0);
        let bytes = log.bytes();
        assert_eq!(bytes.len(), MAX_BYTE_HOSTS + 1);
        assert_eq!(bytes[0], ("h06:443".to_string(), 6, 1), "the first 64 seen keep their own counter");
        assert_eq!(bytes[63], ("h69:443".to_string(), 69, 1));
        assert_eq!(bytes[64], ("other".to_string(), 15, 6));
    }

    #[tokio::test]
    async fn every_decision_notifies() {
        let log = EgressLog::default();
        log.record(decision(0, true));
        // The permit is kept for a daemon that starts waiting later.
        tokio::time::timeout(std::time::Duration::from_secs(1), log.notify().notified()).await.expect("notified");
    }
}
