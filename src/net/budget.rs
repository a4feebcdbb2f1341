//! Daemon-wide bounds on what the egress proxies of all sandboxes together
//! may hold open, so one tenant cannot exhaust the daemon's file
//! descriptors: a cap on proxied connections in total and one per principal
//! (each connection costs the daemon two descriptors: the sandbox's side
//! and the upstream), and an idle timeout after which a connection that
//! moved no byte either way is closed. A connection past a cap is refused
//! (503) and recorded as an `egress` deny with the reason.
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

#[derive(Default)]
struct Counts {
    total: usize,
    per_principal: HashMap<String, usize>,
}

/// Name lookups in flight for all sandboxes' proxies at once. A lookup
/// (getaddrinfo) runs on one of the runtime's blocking threads (512) and
/// cannot be cancelled: a resolver that never answers holds it until the
/// system's own timeout, so without this bound one tenant could take them
/// all and stall every other tenant's file and process work.
pub const MAX_LOOKUPS: usize = 128;

/// The proxies' shared budget of connections.
pub struct ProxyBudget {
    max_total: usize,
    max_per_principal: usize,
    idle_timeout: Duration,
    counts: Mutex<Counts>,
    lookups: Arc<tokio::sync::Semaphore>,
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
        let mut counts = self.budget.counts();
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.per_principal.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.per_principal.remove(&self.principal);
            }
        }
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
            lookups: Arc::new(tokio::sync::Semaphore::new(MAX_LOOKUPS)),
        })
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Plain counters: a panic while holding the lock cannot break them.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
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
        let mut counts = self.counts();
        if counts.total >= self.max_total {
            return Err(format!("the daemon's proxy connection limit ({}) is reached", self.max_total));
        }
        let mine = counts.per_principal.get(principal).copied().unwrap_or(0);
        if mine >= self.max_per_principal {
            return Err(format!("this principal's proxy connection limit ({}) is reached", self.max_per_principal));
        }
        counts.total += 1;
        *counts.per_principal.entry(principal.to_string()).or_default() += 1;
        drop(counts);
        Ok(ConnectionPermit { budget: self.clone(), principal: principal.to_string() })
    }

    /// One name lookup's share of [`MAX_LOOKUPS`], held until the lookup
    /// returns; never waits: at the limit, says so.
    pub fn lookup(&self) -> Result<tokio::sync::OwnedSemaphorePermit, String> {
        self.lookups
            .clone()
            .try_acquire_owned()
            .map_err(|_| format!("the daemon's limit of name lookups in flight ({MAX_LOOKUPS}) is reached"))
    }

    /// Connections held now: in total, and by `principal`.
    pub fn in_use(&self, principal: &str) -> (usize, usize) {
        let counts = self.counts();
        (counts.total, counts.per_principal.get(principal).copied().unwrap_or(0))
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

    #[test]
    fn bad_limits_name_their_key() {
        let zero = ProxyLimitsConfig { max_connections: Some(0), ..Default::default() };
        assert_eq!(zero.validate().unwrap_err().0, "proxy.max_connections");
        let idle = ProxyLimitsConfig { idle_timeout_seconds: 0, ..Default::default() };
        assert_eq!(idle.validate().unwrap_err().0, "proxy.idle_timeout_seconds");
        assert!(ProxyLimitsConfig::default().validate().is_ok());
    }
}
