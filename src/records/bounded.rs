//! What a harness reports, typed and bounded before a record holds it.
//! Everything a harness says is untrusted data: these take text that has
//! already been through the credential scrubber and keep only what fits
//! the field's grammar. The evidence's lists that grow with a run (gate
//! verdicts, stage timings, notes) are held to their ends.

use crate::types::evidence::Evidence;

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

/// How many of a run's gate verdicts its record keeps: the first and the
/// last this many.
pub const KEEP_DECISIONS: usize = 64;
/// How many of a run's stage timings and notes its record keeps: the first
/// and the last this many of each.
pub const KEEP_ENTRIES: usize = 32;

/// What [`bound_evidence`] has cut from one run's evidence so far, counted,
/// and the note that says so.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Omitted {
    /// Gate verdicts cut.
    pub gate_decisions: u64,
    /// Stage timings cut.
    pub stage_timings: u64,
    /// Notes cut.
    pub notes: u64,
    /// The note in `evidence.notes`, with its place.
    note: Option<(usize, String)>,
}

impl Omitted {
    fn describe(&self) -> String {
        let counts =
            [(self.gate_decisions, "gate decisions"), (self.stage_timings, "stage timings"), (self.notes, "notes")];
        let cut: Vec<String> =
            counts.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!("{n} more {what}")).collect();
        format!(
            "not kept, to keep the record under one message: {} (the first and the last are kept; \
             tool_calls counts every decision)",
            cut.join(", ")
        )
    }
}

/// Keeps the first `first` and the last `last` entries of `list`; returns
/// how many went.
pub fn keep_ends<T>(list: &mut Vec<T>, first: usize, last: usize) -> u64 {
    let over = list.len().saturating_sub(first + last);
    if over > 0 {
        list.drain(first..first + over);
    }
    over as u64
}

/// Holds a run's growing evidence lists (gate verdicts, stage timings,
/// notes) to their first and last entries, so a record of a session of any
/// length fits one message; one note, kept between the first and the last
/// notes, says how many of each went. Call it after the lists grow.
pub fn bound_evidence(evidence: &mut Evidence, omitted: &mut Omitted) {
    // The note of the last call is taken out first: the notes are cut, and
    // it goes back, with the new counts, where the cut is.
    if let Some((at, note)) = omitted.note.take() {
        if evidence.notes.get(at) == Some(&note) {
            evidence.notes.remove(at);
        }
    }
    omitted.gate_decisions += keep_ends(&mut evidence.gate_decisions, KEEP_DECISIONS, KEEP_DECISIONS);
    omitted.stage_timings += keep_ends(&mut evidence.stage_timings, KEEP_ENTRIES, KEEP_ENTRIES);
    omitted.notes += keep_ends(&mut evidence.notes, KEEP_ENTRIES, KEEP_ENTRIES);
    if omitted.gate_decisions + omitted.stage_timings + omitted.notes > 0 {
        let at = evidence.notes.len().min(KEEP_ENTRIES);
        let note = omitted.describe();
        evidence.notes.insert(at, note.clone());
        omitted.note = Some((at, note));
    }
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

    #[test]
    fn long_evidence_lists_keep_their_ends_and_count_the_rest() {
        use crate::types::evidence::StageTiming;
        use crate::types::{Action, PolicyDecision};
        let decision = |n: usize| PolicyDecision {
            policy: format!("p{n}"),
            source: "profile".into(),
            action: Action::Allow,
            reason: String::new(),
        };
        let (mut evidence, mut omitted) = (Evidence::default(), Omitted::default());
        evidence.notes.push("first note".into());
        bound_evidence(&mut evidence, &mut omitted);
        assert_eq!(evidence.notes, ["first note"], "nothing cut, nothing said");
        for n in 0..1000 {
            evidence.gate_decisions.push(decision(n));
            evidence.stage_timings.push(StageTiming { stage: "harness".into(), micros: n as u64 });
            evidence.notes.push(format!("note {n}"));
            bound_evidence(&mut evidence, &mut omitted);
        }
        assert_eq!(evidence.gate_decisions.len(), 2 * KEEP_DECISIONS);
        assert_eq!(evidence.gate_decisions[0].policy, "p0");
        assert_eq!(evidence.gate_decisions.last().unwrap().policy, "p999");
        assert_eq!(evidence.stage_timings.len(), 2 * KEEP_ENTRIES);
        assert_eq!(evidence.stage_timings.last().unwrap().micros, 999);
        // The kept notes, with the one that counts the rest where the cut is.
        assert_eq!(evidence.notes.len(), 2 * KEEP_ENTRIES + 1);
        assert_eq!(evidence.notes[0], "first note");
        assert_eq!(evidence.notes.last().unwrap(), "note 999");
        let note = &evidence.notes[KEEP_ENTRIES];
        let more = 1000 - 2 * KEEP_DECISIONS;
        assert!(note.contains(&format!("{more} more gate decisions")), "{note}");
        assert!(note.contains(&format!("{} more stage timings", 1000 - 2 * KEEP_ENTRIES)), "{note}");
        assert!(note.contains(&format!("{} more notes", 1001 - 2 * KEEP_ENTRIES)), "{note}");
        assert_eq!(evidence.notes.iter().filter(|n| n.starts_with("not kept")).count(), 1);
    }
}
