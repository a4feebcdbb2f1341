//! Tying a call to a principal: a bearer token (by the sha256 of what was
//! presented, compared with every known digest in constant time), or the
//! peer uid of the unix socket (SO_PEERCRED). Root and the daemon's own uid
//! on the socket are the local administrator unless a principal claims
//! them; so is the holder of the local admin token the daemon writes (0600)
//! into its data directory.

use std::collections::HashMap;
use std::sync::Arc;

use subtle::ConstantTimeEq;

use super::config::{token_digest, Loaded};
use super::{ConsumerType, Principal, Projects};

/// The implicit administrator of the host.
pub const LOCAL_ADMIN: &str = "local-admin";

/// What a call presented.
#[derive(Clone, Copy, Debug)]
pub enum Credential<'a> {
    /// A bearer token, as presented after `Bearer ` in `authorization`.
    Bearer(&'a str),
    /// The names of a verified client certificate (subject CN, DNS SANs).
    ClientCert(&'a [String]),
    /// The peer uid of a unix socket connection (SO_PEERCRED).
    UnixPeer(u32),
    /// Nothing the daemon could tie to a principal.
    None,
}

/// Ties a [`Credential`] to a principal: the configured principals' token
/// digests, unix uids and certificate names, and the local admin.
pub struct Authenticator {
    tokens: Vec<([u8; 32], Arc<Principal>)>,
    uids: HashMap<u32, Arc<Principal>>,
    cert_names: HashMap<String, Arc<Principal>>,
}

impl Authenticator {
    /// `admin_token`: the digest of the local admin token, if the daemon
    /// keeps one; `local_uids`: the uids that are the local admin on the
    /// unix socket unless a configured principal names them.
    pub fn new(loaded: Vec<Loaded>, admin_token: Option<[u8; 32]>, local_uids: &[u32]) -> Authenticator {
        let admin = Arc::new(Principal {
            name: LOCAL_ADMIN.into(),
            kind: ConsumerType::Adm,
            projects: Projects::All,
            max_running: None,
            repos: Vec::new(),
            write_roots: Vec::new(),
            approve: false,
        });
        let mut tokens = Vec::new();
        let mut uids = HashMap::new();
        let mut cert_names = HashMap::new();
        for uid in local_uids {
            uids.insert(*uid, admin.clone());
        }
        if let Some(digest) = admin_token {
            tokens.push((digest, admin.clone()));
        }
        for l in loaded {
            let principal = Arc::new(l.principal);
            for digest in l.token_digests {
                tokens.push((digest, principal.clone()));
            }
            for uid in l.unix_uids {
                uids.insert(uid, principal.clone());
            }
            for name in l.tls_names {
                cert_names.insert(name, principal.clone());
            }
        }
        Authenticator { tokens, uids, cert_names }
    }

    /// How many distinct principals it knows (the local admin included).
    pub fn principal_count(&self) -> usize {
        let mut names: Vec<&str> = self.tokens.iter().map(|(_, p)| p.name.as_str()).collect();
        names.extend(self.uids.values().map(|p| p.name.as_str()));
        names.extend(self.cert_names.values().map(|p| p.name.as_str()));
        names.sort_unstable();
        names.dedup();
        names.len()
    }

    /// The principal configured as `name`, if this set knows it (the local
    /// administrator only where it can call: by its token or a local uid).
    pub fn named(&self, name: &str) -> Option<Arc<Principal>> {
        let mut all = self.tokens.iter().map(|(_, p)| p).chain(self.uids.values()).chain(self.cert_names.values());
        all.find(|p| p.name == name).cloned()
    }

    /// The principal behind a credential, or why there is none.
    pub fn identify(&self, credential: Credential<'_>) -> Result<Arc<Principal>, &'static str> {
        match credential {
            Credential::Bearer(token) => {
                let presented = token_digest(token);
                // Every digest is compared, whatever matches first.
                let mut found = None;
                for (digest, principal) in &self.tokens {
                    if bool::from(digest[..].ct_eq(&presented[..])) && found.is_none() {
                        found = Some(principal.clone());
                    }
                }
                found.ok_or("the bearer token is not known")
            }
            Credential::ClientCert(names) => names
                .iter()
                .find_map(|n| self.cert_names.get(n).cloned())
                .ok_or("the client certificate's names map to no principal"),
            Credential::UnixPeer(uid) => {
                self.uids.get(&uid).cloned().ok_or("the socket peer's uid maps to no principal")
            }
            Credential::None => Err("no credentials: send `authorization: Bearer <token>` or use the unix socket"),
        }
    }
}

/// The length of the local admin token the daemon writes: 32 random bytes, hex.
const ADMIN_TOKEN_LEN: usize = 64;

/// The local admin token in `data_dir/admin.token`: read, or created (32
/// random bytes, hex, mode 0600) on first start. Returns its digest. One
/// that is there but shorter than the daemon writes (an empty file is one)
/// is refused: whoever presents it would be the administrator, and a short
/// token can be guessed.
pub fn local_admin_token(path: &std::path::Path) -> std::io::Result<[u8; 32]> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::read_to_string(path) {
        Ok(token) if token.trim().len() < ADMIN_TOKEN_LEN => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{}: the local admin token has {} characters, fewer than the {ADMIN_TOKEN_LEN} the daemon \
                     writes, and would be easy to guess; remove the file and a new one is made at start",
                    path.display(),
                    token.trim().len()
                ),
            ))
        }
        Ok(token) => return Ok(token_digest(&token)),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        Err(_) => {}
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    let token = hex::encode(bytes);
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(token.as_bytes())?;
    Ok(token_digest(&token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::PrincipalConfig;

    fn authenticator() -> Authenticator {
        let token = "k".repeat(40);
        let ci = PrincipalConfig {
            name: "ci".into(),
            kind: "agt".into(),
            projects: vec!["a".into()],
            token_sha256: Some(hex::encode(token_digest(&token))),
            unix_uids: vec![1234],
            ..Default::default()
        };
        let loaded = vec![ci.load("p", &|_| None).unwrap()];
        Authenticator::new(loaded, Some(token_digest(&"a".repeat(64))), &[0, 999])
    }

    #[test]
    fn tokens_and_peer_uids_map_to_principals() {
        let auth = authenticator();
        assert_eq!(auth.identify(Credential::Bearer(&"k".repeat(40))).unwrap().name, "ci");
        assert_eq!(auth.identify(Credential::Bearer(&"a".repeat(64))).unwrap().name, LOCAL_ADMIN);
        assert!(auth.identify(Credential::Bearer("garbage")).is_err());
        assert!(auth.identify(Credential::Bearer("")).is_err());
        assert_eq!(auth.identify(Credential::UnixPeer(1234)).unwrap().name, "ci");
        assert_eq!(auth.identify(Credential::UnixPeer(0)).unwrap().name, LOCAL_ADMIN);
        assert_eq!(auth.identify(Credential::UnixPeer(999)).unwrap().name, LOCAL_ADMIN);
        assert!(auth.identify(Credential::UnixPeer(4321)).is_err(), "an unmapped uid");
        assert!(auth.identify(Credential::None).is_err());
    }

    #[test]
    fn the_local_admin_token_is_made_once_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.token");
        let first = local_admin_token(&path).unwrap();
        assert_eq!(local_admin_token(&path).unwrap(), first);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap().len(), 64);
    }

    #[test]
    fn an_empty_or_short_admin_token_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.token");
        for (text, count) in [("", 0), ("\n", 0), (&"a".repeat(63) as &str, 63), (" short \n", 5)] {
            std::fs::write(&path, text).unwrap();
            let err = local_admin_token(&path).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
            let expected = format!("the local admin token has {count} characters, fewer than the 64");
            assert!(err.to_string().contains(&expected), "{err}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "left as it was");
        }
        let token = format!("{}\n", "b".repeat(64));
        std::fs::write(&path, &token).unwrap();
        assert_eq!(local_admin_token(&path).unwrap(), token_digest(&token));
    }
}
