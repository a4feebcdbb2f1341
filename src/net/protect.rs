//! The daemon's own listeners, which no sandbox's proxy ever connects to,
//! whatever an allowlist says, for as long as they listen. Process-wide:
//! every daemon in this process (tests run several) adds its listener when
//! it starts serving.

use std::net::SocketAddr;
use std::sync::Mutex;

static PROTECTED: Mutex<Vec<SocketAddr>> = Mutex::new(Vec::new());

/// A listener's place in the protected set, while it is held. A port no
/// longer listened on is the system's to give to another program (in
/// tests, a server of this same process), which is not the daemon's.
#[must_use = "the address is protected only while this is held"]
pub struct Protected(SocketAddr);

/// Adds a listener of this process to the protected set, until the
/// returned guard is dropped.
pub fn protect(addr: SocketAddr) -> Protected {
    PROTECTED.lock().unwrap_or_else(|e| e.into_inner()).push(addr);
    Protected(addr)
}

impl Drop for Protected {
    fn drop(&mut self) {
        let mut set = PROTECTED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = set.iter().position(|a| *a == self.0) {
            set.swap_remove(at);
        }
    }
}

/// The protected set, for a proxy's configuration.
pub fn protected_addresses() -> Vec<SocketAddr> {
    let mut set = PROTECTED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    set.dedup();
    set
}

impl std::fmt::Debug for super::EgressLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (allowed, denied) = self.counts();
        f.debug_struct("EgressLog").field("allowed", &allowed).field("denied", &denied).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_protected_while_its_guard_is_held() {
        let addr: SocketAddr = "127.0.0.77:61077".parse().unwrap();
        let first = protect(addr);
        let second = protect(addr);
        assert!(protected_addresses().contains(&addr));
        drop(first);
        assert!(protected_addresses().contains(&addr), "another listener of the address still holds it");
        drop(second);
        assert!(!protected_addresses().contains(&addr), "a port no longer listened on is not the daemon's");
    }
}
