//! Page tokens: opaque to the caller, checked by the daemon. A token is the
//! listing's cursor (the last id of the page) sealed with ChaCha20-Poly1305
//! (ring) under a key kept in the data directory (so tokens survive a
//! restart), with the listing, the filter and the caller it was issued for
//! as associated data: nothing of the cursor can be read from a token, and
//! a token that does not parse, was made up, edited, or comes from another
//! listing, filter or caller is INVALID_ARGUMENT naming `page_token`, never
//! a cursor.

use std::path::Path;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use tonic::Status;

use super::status::invalid_argument;

/// Longer than any token this daemon issues (a 200-byte id sealed, in hex).
const MAX_TOKEN: usize = 600;
const VERSION: &str = "v2";

/// Issues and checks page tokens under the daemon's key.
pub struct PageTokens {
    key: LessSafeKey,
    random: SystemRandom,
}

impl PageTokens {
    fn with_key(key: &[u8; 32]) -> PageTokens {
        let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).expect("a 32-byte key"));
        PageTokens { key, random: SystemRandom::new() }
    }

    /// A new random key, as hex (for the fleet's shared secret; empty in
    /// the one case the system's randomness fails, which
    /// [`PageTokens::from_key_hex`] then refuses).
    pub fn new_key_hex() -> String {
        let mut key = [0u8; 32];
        match SystemRandom::new().fill(&mut key) {
            Ok(()) => hex::encode(key),
            Err(_) => String::new(),
        }
    }

    /// Tokens under a key given as 64 hex digits (the fleet's, from the
    /// store).
    pub fn from_key_hex(text: &str) -> Result<PageTokens, String> {
        let bytes = hex::decode(text.trim()).map_err(|e| format!("the fleet's page token key: {e}"))?;
        let key: [u8; 32] = bytes.try_into().map_err(|_| "the fleet's page token key is not 32 bytes".to_string())?;
        Ok(PageTokens::with_key(&key))
    }

    /// The key in `path`, created (32 random bytes, mode 0600) on first use.
    pub fn load_or_create(path: &Path) -> std::io::Result<PageTokens> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::read(path) {
            Ok(bytes) if bytes.len() == 32 => {
                let mut key = [0u8; 32];
                key.copy_from_slice(&bytes);
                return Ok(PageTokens::with_key(&key));
            }
            Ok(_) => {
                return Err(std::io::Error::other("the page token key is not 32 bytes; delete it to make a new one"))
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            Err(_) => {}
        }
        let mut key = [0u8; 32];
        SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| std::io::Error::other("no randomness for the page token key"))?;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        file.write_all(&key)?;
        Ok(PageTokens::with_key(&key))
    }

    /// A token for `cursor` in `listing`, under `filter` (which names the
    /// caller too). Empty (no next page) in the one case the system's
    /// randomness fails.
    pub fn issue(&self, listing: &str, filter: &str, cursor: &str) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        // A random 96-bit nonce per token: far more tokens than a daemon
        // will ever issue under one key before two share a nonce.
        if self.random.fill(&mut nonce).is_err() {
            return String::new();
        }
        let mut sealed = cursor.as_bytes().to_vec();
        let aad = associated(listing, filter);
        let nonce_value = Nonce::assume_unique_for_key(nonce);
        if self.key.seal_in_place_append_tag(nonce_value, Aad::from(&aad), &mut sealed).is_err() {
            return String::new();
        }
        format!("{VERSION}.{}{}", hex::encode(nonce), hex::encode(&sealed))
    }

    /// The cursor of a token this daemon issued for `listing` and `filter`;
    /// an empty token is the first page.
    pub fn open(&self, listing: &str, filter: &str, token: &str) -> Result<String, Status> {
        if token.is_empty() {
            return Ok(String::new());
        }
        let not_ours = || invalid_argument("page_token", "not a page token of this listing; start again without one");
        if token.len() > MAX_TOKEN {
            return Err(not_ours());
        }
        let body = token.strip_prefix(VERSION).and_then(|t| t.strip_prefix('.')).ok_or_else(not_ours)?;
        let mut bytes = hex::decode(body).map_err(|_| not_ours())?;
        if bytes.len() < NONCE_LEN {
            return Err(not_ours());
        }
        let mut sealed = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes).map_err(|_| not_ours())?;
        let aad = associated(listing, filter);
        // ring checks the tag (in constant time) before anything is opened.
        let cursor = self.key.open_in_place(nonce, Aad::from(&aad), &mut sealed).map_err(|_| not_ours())?;
        let cursor = String::from_utf8(cursor.to_vec()).map_err(|_| not_ours())?;
        if cursor.is_empty() {
            return Err(not_ours());
        }
        Ok(cursor)
    }
}

/// Length-prefixed parts: no two (listing, filter) share associated data.
fn associated(listing: &str, filter: &str) -> Vec<u8> {
    let mut message = Vec::new();
    for part in [VERSION, listing, filter] {
        message.extend_from_slice(&(part.len() as u64).to_be_bytes());
        message.extend_from_slice(part.as_bytes());
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> PageTokens {
        PageTokens::with_key(&[7u8; 32])
    }

    #[test]
    fn a_token_shows_nothing_of_its_cursor() {
        let t = tokens();
        let cursor = "tenant-a/secret-session";
        let token = t.issue("sessions", "tenant-a", cursor);
        assert!(!token.contains(&hex::encode(cursor.as_bytes())) && !token.contains("secret"), "{token}");
        assert_ne!(token, t.issue("sessions", "tenant-a", cursor), "a fresh nonce per token");
        assert_eq!(t.open("sessions", "tenant-a", &token).unwrap(), cursor);
        assert!(t.open("sessions", "tenant-b", &token).is_err(), "another caller's token");
    }

    #[test]
    fn tokens_round_trip_and_anything_else_is_refused() {
        let t = tokens();
        let token = t.issue("executions", "f", "0190-abc");
        assert_eq!(t.open("executions", "f", &token).unwrap(), "0190-abc");
        assert_eq!(t.open("executions", "f", "").unwrap(), "");
        let mut edited = token.clone();
        let flipped = if edited.ends_with('0') { "1" } else { "0" };
        edited.replace_range(edited.len() - 1.., flipped);
        let other_key = PageTokens::with_key(&[8u8; 32]).issue("executions", "f", "0190-abc");
        for bad in [
            "bogus-token".to_string(),
            edited,
            other_key,
            t.issue("sessions", "f", "0190-abc"),
            t.issue("executions", "g", "0190-abc"),
            format!("{token}.x"),
            "v2.".into(),
            "v1.30313930.00".into(),
            "x".repeat(700),
        ] {
            let status = t.open("executions", "f", &bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(status.message().starts_with("page_token:"), "{}", status.message());
        }
    }

    #[test]
    fn the_key_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("page.key");
        let token = PageTokens::load_or_create(&path).unwrap().issue("l", "", "c");
        assert_eq!(PageTokens::load_or_create(&path).unwrap().open("l", "", &token).unwrap(), "c");
    }
}
