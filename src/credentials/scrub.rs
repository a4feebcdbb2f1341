//! Replacing credential values with `[REDACTED:<route>]`.
//!
//! Harness output is read line by line, so a value written in two chunks
//! across a flush arrives whole within its line. Base64 forms are caught at
//! each of the three byte alignments a value can have inside a longer
//! encoded string.

use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct Scrubber {
    /// (pattern, replacement), longest pattern first.
    patterns: Arc<Vec<(String, String)>>,
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        let chars = chunk.len() + 1;
        for i in 0..4 {
            out.push(if i < chars { B64[(n >> (18 - 6 * i)) as usize & 63] as char } else { '=' });
        }
    }
    out
}

/// The base64 text a value produces at byte offset 0, 1 and 2 of a longer
/// encoded stream: only the characters that depend on the value alone.
fn base64_forms(value: &[u8]) -> Vec<String> {
    (0..3usize)
        .filter_map(|offset| {
            let mut padded = vec![0u8; offset];
            padded.extend_from_slice(value);
            let encoded = base64(&padded);
            let start = (8 * offset).div_ceil(6);
            let end = 8 * (offset + value.len()) / 6;
            // Too short a fragment would match innocent text.
            (end > start && end - start >= 8).then(|| encoded[start..end].to_string())
        })
        .collect()
}

impl Scrubber {
    pub fn add(&mut self, route: &str, value: &str) {
        let replacement = format!("[REDACTED:{route}]");
        let patterns = Arc::make_mut(&mut self.patterns);
        patterns.push((value.to_string(), replacement.clone()));
        for form in base64_forms(value.as_bytes()) {
            patterns.push((form, replacement.clone()));
        }
        patterns.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    pub fn scrub(&self, text: &str) -> String {
        let mut text = text.to_string();
        for (pattern, replacement) in self.patterns.iter() {
            if text.contains(pattern.as_str()) {
                text = text.replace(pattern.as_str(), replacement);
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_base64_forms_are_redacted_at_every_alignment() {
        let mut s = Scrubber::default();
        s.add("github", "ghp_SuperSecretValue123");
        assert_eq!(s.scrub("token=ghp_SuperSecretValue123!"), "token=[REDACTED:github]!");
        for prefix in ["", "a", "ab", "prefix:"] {
            let encoded = base64(format!("{prefix}ghp_SuperSecretValue123 trailing").as_bytes());
            let scrubbed = s.scrub(&encoded);
            assert!(scrubbed.contains("[REDACTED:github]"), "prefix {prefix:?}: {scrubbed}");
        }
        assert_eq!(s.scrub("nothing to see"), "nothing to see");
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b"hello"), "aGVsbG8=");
        assert_eq!(base64(b"hi!"), "aGkh");
    }
}
