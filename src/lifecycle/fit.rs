//! Keeping a `finished` (or `turn_finished`) event under the server's
//! largest message: the raw output and error riding on it to the direct
//! caller are cut to fit, and `output_truncated` events say how much of
//! each was dropped. A caller whose client keeps gRPC's default limit still
//! gets the result of a run that succeeded.

use super::RawResult;
use crate::events::EventKind;

/// Room for what a message holds besides the record and the raw parts
/// (subject, sequence, time, framing) and for an estimate's error.
const SLACK: usize = 16 * 1024;

/// Cuts `raw` so that it and the rest of the message (at most `rest`
/// bytes) fit in `max`. The head of each part is kept; the error gets at
/// least a quarter of the room when both are large. Returns one
/// `output_truncated` event per part that was cut (`tool_output`,
/// `tool_error`).
pub(super) fn fit_raw(raw: &mut RawResult, rest: usize, max: usize) -> Vec<EventKind> {
    let room = max.saturating_sub(rest.saturating_add(SLACK));
    let (output, error) = (raw.tool_output.len(), raw.tool_error.len());
    if output.saturating_add(error) <= room {
        return Vec::new();
    }
    let error_room = error.min((room / 4).max(room.saturating_sub(output)));
    let output_room = room - error_room;
    let mut cut = Vec::new();
    for (stream, text, keep) in
        [("tool_output", &mut raw.tool_output, output_room), ("tool_error", &mut raw.tool_error, error_room)]
    {
        if text.len() > keep {
            let at = floor_char_boundary(text, keep);
            let dropped = (text.len() - at) as u64;
            text.truncate(at);
            cut.push(EventKind::OutputTruncated { stream: stream.into(), bytes_dropped: dropped });
        }
    }
    cut
}

/// The largest index `<= at` that starts a character of `text`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    (0..=at.min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0)
}

/// An upper bound of a value's size in a protobuf message: its JSON form,
/// which spells out every field name, is never smaller.
pub(super) fn json_len(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).map(|v| v.len()).unwrap_or(usize::MAX / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(output: usize, error: usize) -> RawResult {
        RawResult { tool_output: "o".repeat(output), tool_error: "e".repeat(error) }
    }

    #[test]
    fn what_fits_is_untouched() {
        let mut r = raw(1000, 1000);
        assert!(fit_raw(&mut r, 100, 64 * 1024).is_empty());
        assert_eq!((r.tool_output.len(), r.tool_error.len()), (1000, 1000));
    }

    #[test]
    fn both_at_the_caps_are_cut_to_fit_and_said_so() {
        let max = 4 << 20;
        let mut r = raw(4 << 20, 4 << 20);
        let cut = fit_raw(&mut r, 10_000, max);
        assert!(r.tool_output.len() + r.tool_error.len() + 10_000 + SLACK <= max);
        assert!(r.tool_error.len() >= (max - 10_000 - SLACK) / 4);
        let dropped: Vec<_> = cut
            .iter()
            .map(|e| match e {
                EventKind::OutputTruncated { stream, bytes_dropped } => (stream.as_str(), *bytes_dropped),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(dropped[0], ("tool_output", (4 << 20) - r.tool_output.len() as u64));
        assert_eq!(dropped[1], ("tool_error", (4 << 20) - r.tool_error.len() as u64));
    }

    #[test]
    fn a_small_error_is_kept_whole_and_characters_are_not_split() {
        let mut r = RawResult { tool_output: "é".repeat(3 << 20), tool_error: "short".into() };
        let cut = fit_raw(&mut r, 0, 4 << 20);
        assert_eq!(r.tool_error, "short");
        assert_eq!(cut.len(), 1);
        assert!(r.tool_output.chars().all(|c| c == 'é'));
    }
}
