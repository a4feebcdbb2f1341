//! Replacing credential values with `[REDACTED:<route>]`.
//!
//! Harness output is read line by line, so a value written in two chunks
//! across a flush arrives whole within its line. Besides the value itself,
//! the encodings an agent most easily produces are caught: base64 (standard
//! and URL-safe alphabets) at each of the three byte alignments a value can
//! have inside a longer encoded string, hex and percent-encoding (as in a
//! URL), and the value escaped as in a JSON string or in Rust's `{:?}`
//! (text the daemon escapes before it scrubs it).
//!
//! Base64 and hex are also caught in part: any run of at least
//! [`BASE64`]'s or [`HEX`]'s window (8 base64 digits, 6 bytes of the value;
//! 16 hex digits, 8 bytes) that is a piece of the value's encoding. An
//! encoder that wraps its lines (`base64` at 76 columns, `openssl base64`
//! and PEM at 64, `xxd -p` at 60) cuts the encoding into pieces wherever
//! the value falls in its input; each line is scrubbed on its own, so each
//! piece must be caught on its own. What is left of a value's encoding is
//! a piece shorter than the window at either end of a line.
//!
//! The value, its hex and its percent-encoded forms are matched whatever
//! their ASCII case: what the daemon records may have been case-folded on
//! the way (the egress proxy lowercases a host name, so a value asked as a
//! host comes back in lower case), and upper case is as easy for an agent
//! to produce. Base64 is matched exactly: its case carries the value, and a
//! case-folded fragment encodes other bytes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

/// Replaces credential values, and their common encodings, with
/// `[REDACTED:<route>]`. Cheap to clone (the patterns are shared).
#[derive(Clone, Debug)]
pub struct Scrubber {
    /// The value, its hex, percent, JSON- and `{:?}`-escaped forms, in
    /// ASCII lower case; longest first.
    patterns: Arc<Vec<Pattern>>,
    /// Pieces of the values' base64 forms.
    base64: Arc<Pieces>,
    /// Pieces of the values' hex forms.
    hex: Arc<Pieces>,
}

impl Default for Scrubber {
    fn default() -> Self {
        Scrubber { patterns: Arc::default(), base64: Arc::new(Pieces::new(BASE64)), hex: Arc::new(Pieces::new(HEX)) }
    }
}

/// One form of a value, in ASCII lower case, and what replaces it.
#[derive(Clone, Debug)]
struct Pattern {
    text: String,
    replacement: String,
}

/// An encoding whose text is searched for pieces of a value's encoded
/// forms, a window of digits at a time.
#[derive(Clone, Copy, Debug)]
struct Encoding {
    /// A character's digit, if it is one of the encoding's.
    digit: fn(u8) -> Option<u8>,
    /// Bits per digit.
    bits: u32,
    /// The fewest digits a piece has: at most 64 bits in all (a window is
    /// looked up as one `u64`), and enough that innocent text does not
    /// match by chance.
    window: usize,
}

/// Base64, both alphabets: `+` and `-` are the same digit, so are `/` and
/// `_`.
const BASE64: Encoding = Encoding { digit: base64_digit, bits: 6, window: 8 };

/// Hex, either case.
const HEX: Encoding = Encoding { digit: hex_digit, bits: 4, window: 16 };

fn base64_digit(b: u8) -> Option<u8> {
    match b {
        b'A'..=b'Z' => Some(b - b'A'),
        b'a'..=b'z' => Some(b - b'a' + 26),
        b'0'..=b'9' => Some(b - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    }
}

fn hex_digit(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Where every window of every form starts, by the window's digits.
#[derive(Clone, Debug)]
struct Pieces {
    encoding: Encoding,
    /// Each form as digits, and what replaces a piece of it.
    forms: Vec<(Vec<u8>, String)>,
    /// A window's digits, packed, and where it starts: which form, at which
    /// digit.
    windows: HashMap<u64, Vec<(u32, u32)>, BuildHasherDefault<WindowHasher>>,
}

/// A window is already its digits, packed: a multiply spreads them over
/// the hash, with no per-lookup setup (this runs at every digit of every
/// output line).
#[derive(Default)]
struct WindowHasher(u64);

impl Hasher for WindowHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

impl Pieces {
    fn new(encoding: Encoding) -> Self {
        Pieces { encoding, forms: Vec::new(), windows: HashMap::default() }
    }

    /// The digits of a window, packed.
    fn pack(&self, digits: &[u8]) -> u64 {
        digits.iter().fold(0, |key, &d| key << self.encoding.bits | u64::from(d))
    }

    /// Adds `form` (all of it in the encoding's alphabet) and its windows.
    /// A form shorter than the window is not added.
    fn add(&mut self, form: &str, replacement: &str) {
        let digits: Vec<u8> = form.bytes().filter_map(self.encoding.digit).collect();
        debug_assert_eq!(digits.len(), form.len(), "{form} is not all digits");
        let id = self.forms.len() as u32;
        for (at, window) in digits.windows(self.encoding.window).enumerate() {
            self.windows.entry(self.pack(window)).or_default().push((id, at as u32));
        }
        if digits.len() >= self.encoding.window {
            self.forms.push((digits, replacement.to_string()));
        }
    }

    /// `text` with every piece of a form, at least a window long and as
    /// long as it goes on, replaced; `None` when there is none. Left to
    /// right: the first window that matches starts the piece.
    fn redact(&self, text: &str) -> Option<String> {
        if self.forms.is_empty() {
            return None;
        }
        let Encoding { digit, bits, window } = self.encoding;
        let bytes = text.as_bytes();
        let mask = u64::MAX >> (64 - bits * window as u32);
        let (mut out, mut last) = (String::new(), 0);
        let (mut key, mut run, mut at) = (0u64, 0usize, 0usize);
        while at < bytes.len() {
            let Some(d) = digit(bytes[at]) else {
                (run, at) = (0, at + 1);
                continue;
            };
            key = (key << bits | u64::from(d)) & mask;
            (run, at) = (run + 1, at + 1);
            if run < window {
                continue;
            }
            let Some(starts) = self.windows.get(&key) else {
                continue;
            };
            let start = at - window;
            let (len, form) = starts
                .iter()
                .map(|&(form, from)| {
                    let digits = &self.forms[form as usize].0[from as usize..];
                    let len = bytes[start..].iter().zip(digits).take_while(|(b, d)| digit(**b) == Some(**d)).count();
                    (len, form as usize)
                })
                .max()
                .expect("a window is listed with where it starts");
            // Digits are ASCII: both ends are char boundaries.
            out.push_str(&text[last..start]);
            out.push_str(&self.forms[form].1);
            (last, at, run) = (start + len, start + len, 0);
        }
        if last == 0 {
            return None;
        }
        out.push_str(&text[last..]);
        Some(out)
    }
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

/// The standard base64 text a value produces at byte offset 0, 1 and 2 of
/// a longer encoded stream: only the characters that depend on the value
/// alone (so never padding). The URL-safe text is the same digits.
fn base64_forms(value: &[u8]) -> Vec<String> {
    (0..3usize)
        .map(|offset| {
            let mut padded = vec![0u8; offset];
            padded.extend_from_slice(value);
            let encoded = STANDARD.encode(&padded);
            let start = (8 * offset).div_ceil(6);
            let end = (8 * (offset + value.len()) / 6).max(start);
            encoded[start..end].to_string()
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

/// The value as it reads inside a JSON string and inside Rust's `{:?}` of
/// a string, each without its quotes and only where it differs from the
/// value (a quote, a backslash, a control character). Text is escaped
/// before it is scrubbed: an approval's summary is the call's arguments as
/// JSON, the egress proxy's reasons quote the request with `{:?}`.
fn escaped_forms(value: &str) -> Vec<String> {
    let json = serde_json::Value::from(value).to_string();
    let debug = format!("{value:?}");
    [json, debug]
        .into_iter()
        .map(|quoted| quoted[1..quoted.len() - 1].to_string())
        .filter(|form| form != value)
        .collect()
}

/// The shortest line of a multi-line value that is redacted on its own.
const MIN_LINE_PATTERN: usize = 8;

impl Scrubber {
    /// Adds `value` (and its encodings) as the secret of `route`.
    pub fn add(&mut self, route: &str, value: &str) {
        if value.is_empty() {
            return;
        }
        let replacement = format!("[REDACTED:{route}]");
        let mut forms = vec![value.to_ascii_lowercase()];
        forms.extend(hex_forms(value.as_bytes()).iter().map(|f| f.to_ascii_lowercase()));
        forms.extend(percent_forms(value.as_bytes()).iter().map(|f| f.to_ascii_lowercase()));
        forms.extend(escaped_forms(value).iter().map(|f| f.to_ascii_lowercase()));
        // A value of several lines (a PEM key) printed reaches the live
        // path one line at a time: each line long enough to be its own is
        // a pattern too.
        if value.contains('\n') {
            let lines = value.lines().map(|line| line.trim_end_matches('\r'));
            forms.extend(lines.filter(|line| line.len() >= MIN_LINE_PATTERN).map(str::to_ascii_lowercase));
        }
        forms.sort();
        forms.dedup();
        let patterns = Arc::make_mut(&mut self.patterns);
        patterns.extend(forms.into_iter().map(|text| Pattern { text, replacement: replacement.clone() }));
        patterns.sort_by_key(|p| std::cmp::Reverse(p.text.len()));
        let base64 = Arc::make_mut(&mut self.base64);
        for form in base64_forms(value.as_bytes()) {
            base64.add(&form, &replacement);
        }
        Arc::make_mut(&mut self.hex).add(&hex::encode(value), &replacement);
    }

    /// Whether there is nothing to replace.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// `text` with every known value replaced, longest pattern first, then
    /// every piece of a base64 or hex form.
    pub fn scrub(&self, text: &str) -> String {
        let mut text = text.to_string();
        for pattern in self.patterns.iter() {
            if let Some(replaced) = replace_any_case(&text, &pattern.text, &pattern.replacement) {
                text = replaced;
            }
        }
        for pieces in [&self.base64, &self.hex] {
            if let Some(replaced) = pieces.redact(&text) {
                text = replaced;
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
    fn each_line_of_a_multi_line_value_is_redacted_on_its_own() {
        let mut s = Scrubber::default();
        let pem = "-----BEGIN PRIVATE KEY-----\r\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nshort\n-----END PRIVATE KEY-----\n";
        s.add("tls", pem);
        assert_eq!(s.scrub("MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"), "[REDACTED:tls]");
        assert_eq!(s.scrub("key: -----BEGIN PRIVATE KEY-----"), "key: [REDACTED:tls]");
        // Too short to be told from ordinary text: left alone.
        assert_eq!(s.scrub("short"), "short");
        // A value of one line adds no line pattern of itself.
        let mut one = Scrubber::default();
        one.add("k", "abcdefghij");
        assert_eq!(one.scrub("abcdefgh"), "abcdefgh");
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
    fn base64_forms_are_the_three_alignments_without_padding() {
        assert_eq!(base64_forms(b"sk-ant/Key+9?x"), ["c2stYW50L0tleSs5P3", "NrLWFudC9LZXkrOT94", "zay1hbnQvS2V5Kzk/e"]);
        let mut s = Scrubber::default();
        s.add("short", "short");
        assert_eq!(s.scrub(&base64(b"short")), "c2hvcnQ=", "pieces under 8 characters would match innocent text");
    }

    /// Every 8-digit window of the value's base64 forms that `text` holds.
    fn base64_windows_in(text: &str, value: &[u8]) -> Vec<String> {
        let forms = base64_forms(value);
        let windows = forms.iter().flat_map(|f| (0..=f.len() - 8).map(move |at| &f[at..at + 8]));
        windows.filter(|w| text.contains(*w)).map(str::to_string).collect()
    }

    /// `base64` wraps at 76 columns, `openssl base64` at 64: wherever the
    /// value falls in the input, each line is a piece of its encoding, and
    /// each is redacted on its own (output is scrubbed line by line).
    #[test]
    fn wrapped_base64_is_redacted_line_by_line_wherever_the_value_falls() {
        let value = format!("ghp_{}", "Zq7xK2mP9vR4tY8wB3nL6cH1jF5dS0aE".repeat(3)).into_bytes();
        assert_eq!(value.len(), 100);
        let mut s = Scrubber::default();
        s.add("gh", std::str::from_utf8(&value).unwrap());
        for width in [76, 64] {
            for lead in 0..60 {
                let mut input = vec![b'#'; lead];
                input.extend_from_slice(&value);
                input.extend_from_slice(b" and more after it\n");
                let encoded = base64(&input);
                let lines: Vec<&str> =
                    encoded.as_bytes().chunks(width).map(|l| std::str::from_utf8(l).unwrap()).collect();
                let scrubbed: Vec<String> = lines.iter().map(|line| s.scrub(line)).collect();
                let joined = scrubbed.join("\n");
                assert_eq!(
                    base64_windows_in(&joined, &value),
                    Vec::<String>::new(),
                    "width {width}, lead {lead}: {joined}"
                );
                assert!(joined.contains("[REDACTED:gh]"), "{joined}");
                // What is not the value's is left as it was.
                let lead_digits = (lead * 4 / 3).min(lines[0].len());
                assert!(scrubbed[0].starts_with(&lines[0][..lead_digits]), "{joined}");
            }
        }
        // URL-safe, unwrapped, amid other base64: the piece and only it.
        let url_safe = base64(&value).replace('+', "-").replace('/', "_");
        // (The last digit and padding depend on what would follow.)
        assert_eq!(s.scrub(&format!("QUJD{url_safe}")), "QUJD[REDACTED:gh]Q==");
    }

    /// `xxd -p` wraps hex at 60 columns.
    #[test]
    fn wrapped_hex_is_redacted_line_by_line() {
        let value = "s3cr3t-CREDENTIAL-7f9a2c41d0e8-0123456789abcdef";
        let mut s = Scrubber::default();
        s.add("leak", value);
        for lead in 0..30 {
            let hex = hex::encode(format!("{}{value}\n", "x".repeat(lead)));
            for case in [hex.clone(), hex.to_ascii_uppercase()] {
                let lines: Vec<String> =
                    case.as_bytes().chunks(60).map(|l| s.scrub(std::str::from_utf8(l).unwrap())).collect();
                let value_hex = hex::encode(value);
                for piece in (0..=value_hex.len() - 16).map(|at| &value_hex[at..at + 16]) {
                    assert!(lines.iter().all(|l| !l.to_ascii_lowercase().contains(piece)), "lead {lead}: {lines:?}");
                }
            }
        }
    }

    #[test]
    fn innocent_text_and_other_encodings_are_left_alone() {
        let mut s = Scrubber::default();
        s.add("k", "Zq7xK2mP9vR4tY8wB3nL6cH1jF5dS0aE");
        let other = base64(&[7u8; 300]);
        for text in [
            "a line of ordinary output, with words of considerable length",
            other.as_str(),
            "0123456789abcdef0123456789abcdef",
            "é«ü» multi-byte text around ASCII digits 12345678",
        ] {
            assert_eq!(s.scrub(text), text);
        }
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

    /// A value with a quote, a backslash or a control character reads
    /// otherwise once escaped: inside a JSON string (an approval's summary
    /// is the call's arguments as JSON) and inside Rust's `{:?}` (the
    /// egress proxy's reasons). Both forms are redacted.
    #[test]
    fn json_and_debug_escaped_forms_are_redacted() {
        // Exact vectors: JSON, then `{:?}`, each without its quotes.
        for (value, json, debug) in [
            (r#"pa"ss\word-123456"#, r#"pa\"ss\\word-123456"#, r#"pa\"ss\\word-123456"#),
            ("pa\tss\nword-123456", r"pa\tss\nword-123456", r"pa\tss\nword-123456"),
            ("k\u{1}ey\u{8}\0-123456", r"k\u0001ey\b\u0000-123456", r"k\u{1}ey\u{8}\0-123456"),
        ] {
            assert_eq!(escaped_forms(value), [json, debug], "{value:?}");
            let mut s = Scrubber::default();
            s.add("db", value);
            let in_json = serde_json::json!({"c": format!("x {value}")}).to_string();
            assert!(in_json.contains(json), "{in_json}");
            let scrubbed = s.scrub(&in_json);
            assert!(scrubbed.contains("[REDACTED:db]") && !scrubbed.contains(json), "{value:?}: {scrubbed}");
            assert_eq!(scrubbed, r#"{"c":"x [REDACTED:db]"}"#);
            let in_debug = format!("{:?}", format!("x {value}"));
            assert!(in_debug.contains(debug), "{in_debug}");
            let scrubbed = s.scrub(&in_debug);
            assert!(scrubbed.contains("[REDACTED:db]") && !scrubbed.contains(debug), "{value:?}: {scrubbed}");
            assert_eq!(scrubbed, r#""x [REDACTED:db]""#);
            // In any ASCII case, as the value's other forms.
            assert_eq!(s.scrub(&in_json.to_ascii_uppercase()), r#"{"C":"X [REDACTED:db]"}"#);
        }
        // Nothing to escape: no form of its own.
        assert_eq!(escaped_forms("plain-Value_9'é"), Vec::<String>::new());
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b"hello"), "aGVsbG8=");
        assert_eq!(base64(b"hi!"), "aGkh");
    }
}
