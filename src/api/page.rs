//! Page tokens: opaque to the caller, checked by the daemon. A token is the
//! listing's cursor (the last id of the page) with an HMAC-SHA256 over the
//! listing it belongs to and the filter it was issued for, under a key kept
//! in the data directory (so tokens survive a restart). A token that does
//! not parse, was made up, edited, or comes from another listing or filter
//! is INVALID_ARGUMENT naming `page_token`, never a cursor.

use std::path::Path;

use sha2::{Digest, Sha256};
use tonic::Status;

use super::status::invalid_argument;

/// Longer than any token this daemon issues (a 128-byte id in hex and a MAC).
const MAX_TOKEN: usize = 512;
const VERSION: &str = "v1";

pub struct PageTokens {
    key: [u8; 32],
}

impl PageTokens {
    /// The key in `path`, created (32 random bytes, mode 0600) on first use.
    pub fn load_or_create(path: &Path) -> std::io::Result<PageTokens> {
        use std::io::{Read, Write};
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::read(path) {
            Ok(bytes) if bytes.len() == 32 => {
                let mut key = [0u8; 32];
                key.copy_from_slice(&bytes);
                return Ok(PageTokens { key });
            }
            Ok(_) => {
                return Err(std::io::Error::other("the page token key is not 32 bytes; delete it to make a new one"))
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            Err(_) => {}
        }
        let mut key = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        file.write_all(&key)?;
        Ok(PageTokens { key })
    }

    /// A token for `cursor` in `listing`, under `filter`.
    pub fn issue(&self, listing: &str, filter: &str, cursor: &str) -> String {
        let mac = self.mac(listing, filter, cursor);
        format!("{VERSION}.{}.{}", hex(cursor.as_bytes()), hex(&mac))
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
        let mut parts = token.split('.');
        let (Some(VERSION), Some(cursor), Some(mac), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(not_ours());
        };
        let cursor = unhex(cursor).and_then(|c| String::from_utf8(c).ok()).ok_or_else(not_ours)?;
        let mac = unhex(mac).ok_or_else(not_ours)?;
        let expected = self.mac(listing, filter, &cursor);
        // Compared in constant time: the MAC must not be guessable byte by byte.
        let differs =
            mac.len() != expected.len() || mac.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0;
        if differs || cursor.is_empty() {
            return Err(not_ours());
        }
        Ok(cursor)
    }

    fn mac(&self, listing: &str, filter: &str, cursor: &str) -> [u8; 32] {
        // Length-prefixed parts: no two (listing, filter, cursor) share an input.
        let mut message = Vec::new();
        for part in [VERSION, listing, filter, cursor] {
            message.extend_from_slice(&(part.len() as u64).to_be_bytes());
            message.extend_from_slice(part.as_bytes());
        }
        hmac_sha256(&self.key, &message)
    }
}

/// HMAC-SHA256 (RFC 2104) for a key of at most one block.
fn hmac_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut padded = [0u8; BLOCK];
    padded[..key.len()].copy_from_slice(key);
    let pad = |byte: u8| padded.map(|k| k ^ byte);
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(message).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> PageTokens {
        PageTokens { key: [7u8; 32] }
    }

    #[test]
    fn hmac_matches_rfc_4231_case_1() {
        // The case's key is 20 bytes of 0x0b; HMAC zero-pads a short key, so
        // the same bytes followed by zeros give the same MAC.
        let mut key = [0u8; 32];
        key[..20].copy_from_slice(&[0x0b; 20]);
        assert_eq!(
            hex(&hmac_sha256(&key, b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn tokens_round_trip_and_anything_else_is_refused() {
        let t = tokens();
        let token = t.issue("executions", "f", "0190-abc");
        assert_eq!(t.open("executions", "f", &token).unwrap(), "0190-abc");
        assert_eq!(t.open("executions", "f", "").unwrap(), "");
        let mut edited = token.clone();
        edited.replace_range(3..5, "31");
        let other_key = PageTokens { key: [8u8; 32] }.issue("executions", "f", "0190-abc");
        for bad in [
            "bogus-token".to_string(),
            edited,
            other_key,
            t.issue("sessions", "f", "0190-abc"),
            t.issue("executions", "g", "0190-abc"),
            format!("{token}.x"),
            "v1..".into(),
            "x".repeat(600),
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
