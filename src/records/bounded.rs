//! What a harness reports, typed and bounded before a record holds it.
//! Everything a harness says is untrusted data: these take text that has
//! already been through the credential scrubber and keep only what fits
//! the field's grammar.

/// The longest model or tool name a record keeps.
pub const MAX_NAME: usize = 128;

/// A model name: 1 to [`MAX_NAME`] bytes of letters, digits and `._:/@+-`
/// (`claude-sonnet-4-5`, `gpt-5.1-codex`, `org/model:tag`). Anything else
/// — a sentence, a redaction marker, a value too long to be a name — is
/// not a model name, and `None`.
pub fn model_name(text: &str) -> Option<String> {
    let ok = !text.is_empty()
        && text.len() <= MAX_NAME
        && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:/@+-".contains(&b));
    ok.then(|| text.to_string())
}

/// A tool name: printable, at most [`MAX_NAME`] bytes (cut at a character
/// boundary), control characters and whitespace runs replaced by one space.
pub fn tool_name(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_NAME));
    for c in text.chars() {
        let c = if c.is_control() || c.is_whitespace() { ' ' } else { c };
        if c == ' ' && (out.is_empty() || out.ends_with(' ')) {
            continue;
        }
        if out.len() + c.len_utf8() > MAX_NAME {
            break;
        }
        out.push(c);
    }
    out.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_identifiers() {
        for good in ["claude-sonnet-4-5", "gpt-5.1-codex", "org/model:tag@v1+x", &"m".repeat(MAX_NAME)] {
            assert_eq!(model_name(good).as_deref(), Some(good), "{good}");
        }
        for bad in ["", "a b", "[REDACTED:anthropic]", "model\n", "é", &"m".repeat(MAX_NAME + 1)] {
            assert_eq!(model_name(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tool_names_are_bounded_and_printable() {
        assert_eq!(tool_name("Bash"), "Bash");
        assert_eq!(tool_name("mcp__server__tool"), "mcp__server__tool");
        assert_eq!(tool_name("a\n\tb\u{7}c  "), "a b c");
        assert_eq!(tool_name(&"é".repeat(100)).len(), MAX_NAME);
        assert_eq!(tool_name(&"x".repeat(1000)), "x".repeat(MAX_NAME));
    }
}
