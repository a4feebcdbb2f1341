//! Replacing credential values with `[REDACTED:<route>]`.
//!
//! Harness output is read line by line, so a value written in two chunks
//! across a flush arrives whole within its line. Besides the value itself,
//! the encodings an agent most easily produces are caught: base64 (standard
//! and URL-safe alphabets) at each of the three byte alignments a value can
//! have inside a longer encoded string, hex and percent-encoding (as in a
//! URL).
//!
//! The value, its hex and its percent-encoded forms are matched whatever
//! their ASCII case: what the daemon records may have been case-folded on
//! the way (the egress proxy lowercases a host name, so a value asked as a
//! host comes back in lower case), and upper case is as easy for an agent
//! to produce. Base64 is matched exactly: its case carries the value, and a
//! case-folded fragment encodes other bytes.

use std::sync::Arc;

use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use base64::Engine as _;

/// Replaces credential values, and their common encodings, with
/// `[REDACTED:<route>]`. Cheap to clone (the patterns are shared).
#[derive(Clone, Debug, Default)]
pub struct Scrubber {
    /// Longest pattern first.
    patterns: Arc<Vec<Pattern>>,
}

/// One form of a value and what replaces it.
#[derive(Clone, Debug)]
struct Pattern {
    /// The form; in ASCII lower case when `any_case`.
    text: String,
    replacement: String,
    /// Matched whatever the ASCII case of the text it is found in.
    any_case: bool,
}

/// `text` with every occurrence of `lower` (ASCII lower case), in any
/// ASCII case, replaced; `None` when there is none. Lowering ASCII keeps
/// every byte where it was and every other byte as it was, so the offsets
/// found in the lowered text are char boundaries of `text` too.
fn replace_any_case(text: &str, lower: &str, replacement: &str) -> Option<String> {
    let lowered = text.to_ascii_lowercase();
    let mut matches = lowered.match_indices(lower).peekable();
    matches.peek()?;
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for (at, found) in matches {
        out.push_str(&text[last..at]);
        out.push_str(replacement);
        last = at + found.len();
    }
    out.push_str(&text[last..]);
    Some(out)
}

/// The base64 text (standard and URL-safe alphabets) a value produces at
/// byte offset 0, 1 and 2 of a longer encoded stream: only the characters
/// that depend on the value alone (so never padding).
fn base64_forms(value: &[u8]) -> Vec<String> {
    (0..3usize)
        .flat_map(|offset| [(offset, &STANDARD), (offset, &URL_SAFE)])
        .filter_map(|(offset, engine)| {
            let mut padded = vec![0u8; offset];
            padded.extend_from_slice(value);
            let encoded = engine.encode(&padded);
            let start = (8 * offset).div_ceil(6);
            let end = 8 * (offset + value.len()) / 6;
            // Too short a fragment would match innocent text.
            (end > start && end - start >= 8).then(|| encoded[start..end].to_string())
        })
        .collect()
}

/// The value in hex, lower and upper case.
fn hex_forms(value: &[u8]) -> [String; 2] {
    [hex::encode(value), hex::encode_upper(value)]
}

/// The value percent-encoded as in a URL: the reserved characters only
/// (RFC 3986's minimal form, when it differs from the value) and every
/// byte, each with upper- and lower-case hex digits.
fn percent_forms(value: &[u8]) -> Vec<String> {
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    let encode = |all: bool, upper: bool| -> String {
        value
            .iter()
            .map(|&b| match (unreserved(b) && !all, upper) {
                (true, _) => (b as char).to_string(),
                (false, true) => format!("%{b:02X}"),
                (false, false) => format!("%{b:02x}"),
            })
            .collect()
    };
    let mut forms = vec![encode(true, true), encode(true, false)];
    if !value.iter().all(|b| unreserved(*b)) {
        forms.extend([encode(false, true), encode(false, false)]);
    }
    forms
}

impl Scrubber {
    /// Adds `value` (and its encodings) as the secret of `route`.
    pub fn add(&mut self, route: &str, value: &str) {
        if value.is_empty() {
            return;
        }
        let replacement = format!("[REDACTED:{route}]");
        let patterns = Arc::make_mut(&mut self.patterns);
        let mut any_case = vec![value.to_ascii_lowercase()];
        any_case.extend(hex_forms(value.as_bytes()).iter().map(|f| f.to_ascii_lowercase()));
        any_case.extend(percent_forms(value.as_bytes()).iter().map(|f| f.to_ascii_lowercase()));
        let mut exact = base64_forms(value.as_bytes());
        for (forms, any_case) in [(&mut any_case, true), (&mut exact, false)] {
            forms.sort();
            forms.dedup();
            patterns.extend(forms.drain(..).map(|text| Pattern { text, replacement: replacement.clone(), any_case }));
        }
        patterns.sort_by_key(|p| std::cmp::Reverse(p.text.len()));
    }

    /// Whether there is nothing to replace.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// `text` with every known value replaced, longest pattern first.
    pub fn scrub(&self, text: &str) -> String {
        let mut text = text.to_string();
        for pattern in self.patterns.iter() {
            if pattern.any_case {
                if let Some(replaced) = replace_any_case(&text, &pattern.text, &pattern.replacement) {
                    text = replaced;
                }
            } else if text.contains(pattern.text.as_str()) {
                text = text.replace(pattern.text.as_str(), &pattern.replacement);
            }
        }
        text
    }

    /// `text` scrubbed whole, then cut to `max_chars` characters. Never the
    /// other way round: cut first, a value across the cut would keep its
    /// prefix, which no pattern matches.
    pub fn scrub_within(&self, text: &str, max_chars: usize) -> String {
        self.scrub(text).chars().take(max_chars).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standard base64, padded.
    fn base64(bytes: &[u8]) -> String {
        STANDARD.encode(bytes)
    }

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
    fn hex_url_safe_base64_and_percent_forms_are_redacted() {
        let mut s = Scrubber::default();
        s.add("anthropic", "sk-ant/Key+9?x");
        // Exact vectors of each form.
        assert_eq!(hex_forms(b"sk"), ["736b".to_string(), "736B".to_string()]);
        assert_eq!(percent_forms(b"a/"), ["%61%2F", "%61%2f", "a%2F", "a%2f"]);
        assert_eq!(percent_forms(b"ab"), ["%61%62", "%61%62"], "no minimal form for a value needing none");
        let hex = "736b2d616e742f4b65792b393f78";
        for text in [
            format!("tool={hex}"),
            format!("tool={}", hex.to_ascii_uppercase()),
            "GET /x?k=sk-ant%2FKey%2B9%3Fx".to_string(),
            "GET /x?k=sk-ant%2fKey%2b9%3fx".to_string(),
            base64(b"sk-ant/Key+9?x").replace('+', "-").replace('/', "_"),
        ] {
            let scrubbed = s.scrub(&text);
            assert!(scrubbed.contains("[REDACTED:anthropic]"), "{text} -> {scrubbed}");
            assert!(!scrubbed.contains(hex) && !scrubbed.contains("Key"), "{scrubbed}");
        }
        let mut empty = Scrubber::default();
        empty.add("r", "");
        assert!(empty.is_empty(), "an empty value would match everything");
    }

    #[test]
    fn base64_forms_are_both_alphabets_at_each_alignment_without_padding() {
        // Offset 0, 1, 2: standard, then URL-safe (differing only at offset 2).
        assert_eq!(
            base64_forms(b"sk-ant/Key+9?x"),
            [
                "c2stYW50L0tleSs5P3",
                "c2stYW50L0tleSs5P3",
                "NrLWFudC9LZXkrOT94",
                "NrLWFudC9LZXkrOT94",
                "zay1hbnQvS2V5Kzk/e",
                "zay1hbnQvS2V5Kzk_e",
            ]
        );
        assert!(base64_forms(b"short").is_empty(), "fragments under 8 characters would match innocent text");
    }

    /// The egress proxy lowercases a host name: a value asked as a host
    /// comes back in lower case, and an agent can as easily upper-case it.
    #[test]
    fn the_value_hex_and_percent_forms_are_redacted_in_any_ascii_case() {
        let mut s = Scrubber::default();
        s.add("mixed", "MixedCase-Value-9Zq");
        for (text, scrubbed) in [
            ("mixedcase-value-9zq.example:443", "[REDACTED:mixed].example:443"),
            ("MIXEDCASE-VALUE-9ZQ", "[REDACTED:mixed]"),
            ("a mIxEdCaSe-vAlUe-9zQ b MixedCase-Value-9Zq", "a [REDACTED:mixed] b [REDACTED:mixed]"),
            // Around multi-byte characters, whose bytes lowering leaves alone.
            ("é«mixedcase-value-9zq»ü", "é«[REDACTED:mixed]»ü"),
            // Hex of the value with mixed-case digits.
            ("4D69786564436173652D56616c75652D395A71", "[REDACTED:mixed]"),
            ("mixedcase-value-9z", "mixedcase-value-9z"),
        ] {
            assert_eq!(s.scrub(text), scrubbed, "{text}");
        }
        let mut p = Scrubber::default();
        p.add("p", "Ab/Cd+Ef?Gh");
        assert_eq!(p.scrub("q=aB%2fcD%2BeF%3fgH&"), "q=[REDACTED:p]&", "the minimal percent form, any case");
        assert_eq!(p.scrub("ab/cd+ef?gh"), "[REDACTED:p]");
        // Base64 stays exact: lowered, a fragment encodes other bytes.
        let b64 = base64_forms(b"MixedCase-Value-9Zq").remove(0);
        assert_eq!(s.scrub(&b64), "[REDACTED:mixed]");
        assert_eq!(s.scrub(&b64.to_ascii_lowercase()), b64.to_ascii_lowercase());
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b"hello"), "aGVsbG8=");
        assert_eq!(base64(b"hi!"), "aGkh");
    }
}
