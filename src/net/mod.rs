//! Sandbox egress: each sandbox has its own empty network namespace, and its
//! only way out is an HTTP proxy the daemon runs for it (`proxy`), which lets
//! through what the sandbox's allowlist (`allowlist`) allows, records every
//! attempt (`EgressLog`), and never reaches the daemon itself.

pub mod allowlist;
pub mod budget;
pub mod client;
mod endpoint;
mod http;
mod ip;
mod log;
mod protect;
pub mod proxy;
mod scan;
pub mod server;

pub use allowlist::{host_addresses, intersect, parse_hosts, Allowlist, HostPattern, Verdict};
pub use budget::{ConnectionPermit, ProxyBudget, ProxyLimitsConfig};
pub use endpoint::Endpoint;
pub use ip::special_class;
pub use log::{EgressDecision, EgressLog, MAX_BYTE_HOSTS, MAX_DENIED_HOSTS, MAX_PENDING};
pub use protect::{protect, protected_addresses, Protected};
pub use proxy::{serve, ProxyConfig, ProxyHandle};

#[cfg(test)]
mod allowlist_tests;
#[cfg(test)]
mod budget_tests;
#[cfg(test)]
mod proxy_tests;
