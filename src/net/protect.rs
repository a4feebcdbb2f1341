//! The daemon's own listeners, which no sandbox's proxy ever connects to,
//! whatever an allowlist says. Process-wide: every daemon in this process
//! (tests run several) adds its listener when it starts serving.

use std::net::SocketAddr;
use std::sync::Mutex;

static PROTECTED: Mutex<Vec<SocketAddr>> = Mutex::new(Vec::new());

/// Adds a listener of this process to the protected set.
pub fn protect(addr: SocketAddr) {
    let mut set = PROTECTED.lock().unwrap_or_else(|e| e.into_inner());
    if !set.contains(&addr) {
        set.push(addr);
    }
}

/// The protected set, for a proxy's configuration.
pub fn protected_addresses() -> Vec<SocketAddr> {
    PROTECTED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

impl std::fmt::Debug for super::EgressLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (allowed, denied) = self.counts();
        f.debug_struct("EgressLog").field("allowed", &allowed).field("denied", &denied).finish()
    }
}
