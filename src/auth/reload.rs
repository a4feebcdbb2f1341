//! The principals in force, replaceable while the daemon runs (SIGHUP): a
//! reload builds a whole new [`Authenticator`] and swaps it in, so a call is
//! identified with either the old set or the new one, never a mix, and a
//! revoked token is refused from the next call on. Work already running
//! keeps the principal it was admitted with. A reload that fails to build
//! changes nothing.

use std::sync::{Arc, RwLock};

use super::Authenticator;

/// The [`Authenticator`] in force, swapped whole on reload.
pub struct Principals {
    current: RwLock<Arc<Authenticator>>,
}

impl Principals {
    /// Starts with `authenticator` in force.
    pub fn new(authenticator: Authenticator) -> Principals {
        Principals { current: RwLock::new(Arc::new(authenticator)) }
    }

    /// The set to identify one call with.
    pub fn current(&self) -> Arc<Authenticator> {
        // A panic while holding the lock cannot leave a half-swapped Arc.
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes `authenticator` the set for every call from now on.
    pub fn replace(&self, authenticator: Authenticator) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(authenticator);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Credential, PrincipalConfig};

    fn with_token(token: &str) -> Authenticator {
        let p = PrincipalConfig {
            name: "ci".into(),
            kind: "agt".into(),
            projects: vec!["a".into()],
            token_sha256: Some(hex::encode(super::super::config::token_digest(token))),
            ..Default::default()
        };
        Authenticator::new(vec![p.load("p", &|_| None).unwrap()], None, &[])
    }

    #[test]
    fn a_replaced_set_applies_to_the_next_identification() {
        let (old, new) = ("o".repeat(40), "n".repeat(40));
        let principals = Principals::new(with_token(&old));
        let before = principals.current();
        principals.replace(with_token(&new));
        assert!(principals.current().identify(Credential::Bearer(&old)).is_err(), "revoked");
        assert_eq!(principals.current().identify(Credential::Bearer(&new)).unwrap().name, "ci");
        // A call already identified keeps the set it had.
        assert!(before.identify(Credential::Bearer(&old)).is_ok());
    }
}
