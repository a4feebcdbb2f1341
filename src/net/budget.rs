//! Daemon-wide bounds on what the egress proxies of all sandboxes together
//! may hold open, so one tenant cannot exhaust the daemon's file
//! descriptors: a cap on proxied connections in total and one per principal
//! (each connection costs the daemon two descriptors: the sandbox's side
//! and the upstream), and an idle timeout after which a connection that
//! moved no byte either way is closed. A connection past a cap is refused
//! (503) and recorded as an `egress` deny with the reason. Name lookups in
//! flight are capped the same way, in total ([`MAX_LOOKUPS`]) and per
//! principal ([`MAX_LOOKUPS_PER_PRINCIPAL`]).
//!
//! The budget is the engine's; each sandbox's [`super::EgressLog`] carries
//! it with the principal the sandbox runs for. A proxy whose log carries no
//! budget refuses every connection (fail closed).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;

/// The `[proxy]` section.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyLimitsConfig {
    /// Proxied connections of all sandboxes at once (unset: derived from the
    /// daemon's file descriptor limit, at most 4096).
    pub max_connections: Option<usize>,
    /// Proxied connections of one principal's sandboxes at once.
    pub max_connections_per_principal: usize,
    /// A proxied connection that moves no byte for this long is closed.
    pub idle_timeout_seconds: u64,
}

impl Default for ProxyLimitsConfig {
    fn default() -> Self {
        ProxyLimitsConfig { max_connections: None, max_connections_per_principal: 1024, idle_timeout_seconds: 300 }
    }
}

impl ProxyLimitsConfig {
    /// Errors name the key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.max_connections == Some(0) {
            return Err(("proxy.max_connections".into(), "must be greater than 0".into()));
        }
        if self.max_connections_per_principal == 0 {
            return Err(("proxy.max_connections_per_principal".into(), "must be greater than 0".into()));
        }
        if self.idle_timeout_seconds == 0 {
            return Err(("proxy.idle_timeout_seconds".into(), "must be greater than 0".into()));
        }
        Ok(())
    }
}

/// What is held now, in total and by each principal (a principal holding
/// nothing has no entry).
#[derive(Default)]
struct Counts {
    total: usize,
    per_principal: HashMap<String, usize>,
}

/// Which cap `Counts::take` found reached.
enum Full {
    Total,
    Principal,
}

impl Counts {
    /// Takes one for `principal`, unless `max_total` or `max_per_principal`
    /// is reached.
    fn take(&mut self, principal: &str, max_total: usize, max_per_principal: usize) -> Result<(), Full> {
        if self.total >= max_total {
            return Err(Full::Total);
        }
        if self.held_by(principal) >= max_per_principal {
            return Err(Full::Principal);
        }
        *self.per_principal.entry(principal.to_string()).or_default() += 1;
        self.total += 1;
        Ok(())
    }

    /// Gives back one taken for `principal`.
    fn give_back(&mut self, principal: &str) {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.per_principal.get_mut(principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_principal.remove(principal);
            }
        }
    }

    fn held_by(&self, principal: &str) -> usize {
        self.per_principal.get(principal).copied().unwrap_or(0)
    }
}

fn lock(counts: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    // Plain counters: a panic while holding the lock cannot break them.
    counts.lock().unwrap_or_else(|e| e.into_inner())
}

/// Name lookups in flight for all sandboxes' proxies at once. A lookup
/// (getaddrinfo) runs on one of the runtime's blocking threads (512) and
/// cannot be cancelled: a resolver that never answers holds it until the
/// system's own timeout, so without this bound one tenant could take them
/// all and stall every other tenant's file and process work.
pub const MAX_LOOKUPS: usize = 128;

/// Name lookups in flight for one principal's sandboxes at once: a quarter
/// of [`MAX_LOOKUPS`], as the default `max_connections_per_principal`
/// (1,024) is a quarter of the most `max_connections` derived (4,096). So
/// one tenant whose resolver never answers (a wildcard rule under a domain
/// it controls, say) cannot take the daemon's lookups from every other
/// tenant: it is refused at its share, two sandboxes' worth (16 each).
pub const MAX_LOOKUPS_PER_PRINCIPAL: usize = MAX_LOOKUPS / 4;

/// The proxies' shared budget of connections and of name lookups.
pub struct ProxyBudget {
    max_total: usize,
    max_per_principal: usize,
    idle_timeout: Duration,
    counts: Mutex<Counts>,
    lookups: Mutex<Counts>,
}

impl std::fmt::Debug for ProxyBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyBudget").field("max_total", &self.max_total).finish()
    }
}

/// One proxied connection's share of the budget, given back when dropped.
#[derive(Debug)]
pub struct ConnectionPermit {
    budget: Arc<ProxyBudget>,
    principal: String,
}

impl ConnectionPermit {
    /// How long the connection may stay idle.
    pub fn idle_timeout(&self) -> Duration {
        self.budget.idle_timeout
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        lock(&self.budget.counts).give_back(&self.principal);
    }
}

/// One name lookup's share of [`MAX_LOOKUPS`] and of its principal's
/// [`MAX_LOOKUPS_PER_PRINCIPAL`], given back when dropped.
#[derive(Debug)]
pub struct LookupPermit {
    budget: Arc<ProxyBudget>,
    principal: String,
}

impl Drop for LookupPermit {
    fn drop(&mut self) {
        lock(&self.budget.lookups).give_back(&self.principal);
    }
}

impl ProxyBudget {
    /// A budget of `max_total` connections, `max_per_principal` of them for any
    /// one principal (capped at `max_total`), each closed after `idle_timeout`
    /// without traffic.
    pub fn new(max_total: usize, max_per_principal: usize, idle_timeout: Duration) -> Arc<ProxyBudget> {
        Arc::new(ProxyBudget {
            max_total,
            max_per_principal: max_per_principal.min(max_total),
            idle_timeout,
            counts: Mutex::default(),
            lookups: Mutex::default(),
        })
    }

    /// The most proxied connections of all sandboxes at once.
    pub fn max_total(&self) -> usize {
        self.max_total
    }

    /// How long a proxied connection may move no byte before it is closed.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Takes one connection for `principal`, or says which cap is reached.
    pub fn acquire(self: &Arc<Self>, principal: &str) -> Result<ConnectionPermit, String> {
        match lock(&self.counts).take(principal, self.max_total, self.max_per_principal) {
            Ok(()) => Ok(ConnectionPermit { budget: self.clone(), principal: principal.to_string() }),
            Err(Full::Total) => Err(format!("the daemon's proxy connection limit ({}) is reached", self.max_total)),
            Err(Full::Principal) => {
                Err(format!("this principal's proxy connection limit ({}) is reached", self.max_per_principal))
            }
        }
    }

    /// One name lookup for `principal`: its share of [`MAX_LOOKUPS`] and of
    /// the principal's [`MAX_LOOKUPS_PER_PRINCIPAL`], held until the lookup
    /// returns; never waits: at either limit, says which.
    pub fn lookup_for(self: &Arc<Self>, principal: &str) -> Result<LookupPermit, String> {
        match lock(&self.lookups).take(principal, MAX_LOOKUPS, MAX_LOOKUPS_PER_PRINCIPAL) {
            Ok(()) => Ok(LookupPermit { budget: self.clone(), principal: principal.to_string() }),
            Err(Full::Total) => Err(format!("the daemon's limit of name lookups in flight ({MAX_LOOKUPS}) is reached")),
            Err(Full::Principal) => Err(format!(
                "this principal's share of name lookups in flight ({MAX_LOOKUPS_PER_PRINCIPAL}) is used up"
            )),
        }
    }

    /// Connections held now: in total, and by `principal`.
    pub fn in_use(&self, principal: &str) -> (usize, usize) {
        let counts = lock(&self.counts);
        (counts.total, counts.held_by(principal))
    }

    /// Name lookups in flight now: in total, and for `principal`.
    pub fn lookups_in_flight(&self, principal: &str) -> (usize, usize) {
        let lookups = lock(&self.lookups);
        (lookups.total, lookups.held_by(principal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_in_total_and_per_principal_and_permits_give_back() {
        let budget = ProxyBudget::new(3, 2, Duration::from_secs(1));
        let a1 = budget.acquire("a").unwrap();
        let _a2 = budget.acquire("a").unwrap();
        assert!(budget.acquire("a").unwrap_err().contains("principal's proxy connection limit (2)"));
        let _b1 = budget.acquire("b").unwrap();
        assert!(budget.acquire("b").unwrap_err().contains("daemon's proxy connection limit (3)"));
        assert_eq!(budget.in_use("a"), (3, 2));
        drop(a1);
        assert_eq!(budget.in_use("a"), (2, 1));
        assert!(budget.acquire("b").is_ok());
        assert_eq!(budget.in_use("b"), (2, 1), "the permit above was dropped at once");
    }

    /// One principal whose lookups never return holds at most its share of
    /// the daemon's lookups in flight: past it that principal is refused,
    /// saying its share is used up, while another still gets one; the
    /// daemon's cap holds over all principals; a share comes back on drop.
    #[test]
    fn lookups_are_capped_per_principal_and_in_total_and_permits_give_back() {
        let budget = ProxyBudget::new(1, 1, Duration::from_secs(1));
        let mut a: Vec<_> = (0..MAX_LOOKUPS_PER_PRINCIPAL).map(|_| budget.lookup_for("a").unwrap()).collect();
        assert_eq!(budget.lookups_in_flight("a"), (MAX_LOOKUPS_PER_PRINCIPAL, MAX_LOOKUPS_PER_PRINCIPAL));
        assert_eq!(
            budget.lookup_for("a").unwrap_err(),
            format!("this principal's share of name lookups in flight ({MAX_LOOKUPS_PER_PRINCIPAL}) is used up")
        );
        assert_eq!(budget.lookups_in_flight("a"), (MAX_LOOKUPS_PER_PRINCIPAL, MAX_LOOKUPS_PER_PRINCIPAL));
        let b = budget.lookup_for("b").expect("another principal still gets a lookup");
        assert_eq!(budget.lookups_in_flight("b"), (MAX_LOOKUPS_PER_PRINCIPAL + 1, 1));

        // A released share of "a" lets "a" look up again, and only once.
        drop(a.pop());
        assert_eq!(budget.lookups_in_flight("a"), (MAX_LOOKUPS_PER_PRINCIPAL, MAX_LOOKUPS_PER_PRINCIPAL - 1));
        a.push(budget.lookup_for("a").expect("a share of a's came back"));
        assert!(budget.lookup_for("a").unwrap_err().contains("principal's share"));

        // The daemon's cap still holds, over principals within their shares.
        let (mut others, mut refused) = (Vec::new(), None);
        for i in 0..MAX_LOOKUPS {
            match budget.lookup_for(&format!("p{}", i / MAX_LOOKUPS_PER_PRINCIPAL)) {
                Ok(permit) => others.push(permit),
                Err(reason) => {
                    refused = Some(reason);
                    break;
                }
            }
        }
        assert_eq!(refused, Some(format!("the daemon's limit of name lookups in flight ({MAX_LOOKUPS}) is reached")));
        assert_eq!(a.len() + 1 + others.len(), MAX_LOOKUPS);
        assert_eq!(budget.lookups_in_flight("b"), (MAX_LOOKUPS, 1));
        assert!(
            budget.lookup_for("b").unwrap_err().contains("daemon's limit"),
            "b within its share, but the daemon is full"
        );

        // Everything given back: nothing held, and no principal left behind.
        drop((a, b, others));
        assert_eq!(budget.lookups_in_flight("a"), (0, 0));
        assert!(super::lock(&budget.lookups).per_principal.is_empty());
        assert_eq!(budget.in_use("a"), (0, 0), "lookups are not connections");
        assert!(budget.lookup_for("a").is_ok());
    }

    #[test]
    fn bad_limits_name_their_key() {
        let zero = ProxyLimitsConfig { max_connections: Some(0), ..Default::default() };
        assert_eq!(zero.validate().unwrap_err().0, "proxy.max_connections");
        let idle = ProxyLimitsConfig { idle_timeout_seconds: 0, ..Default::default() };
        assert_eq!(idle.validate().unwrap_err().0, "proxy.idle_timeout_seconds");
        assert!(ProxyLimitsConfig::default().validate().is_ok());
    }
}
