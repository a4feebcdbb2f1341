//! Claude Code `-p --output-format stream-json --verbose`.
//!
//! What the stream says and how it maps:
//! - `system/init` names the model and the permission mode: progress.
//! - `system/api_retry` is a failed model request about to be retried:
//!   progress, so a run waiting on an unreachable API is visibly alive.
//! - `system/permission_denied` is a tool call refused by the permission
//!   rules: progress, and the run fails at the end.
//! - `assistant` lines carry one content block each (text, thinking,
//!   tool_use) and repeat their message's usage on every block: tokens so
//!   far count each message id once. Its `model` is the one the API says it
//!   served (`<synthetic>` for Claude Code's own error messages).
//! - `result` decides: `is_error` (with `api_error_status` for a model API
//!   error), a non-`success` subtype, or any `permission_denials` fail the
//!   run; its usage (input + output + cache read + cache creation) is the
//!   run's tokens.
//! - Every count is bounded by `MAX_TOKENS`, and so is every sum of them:
//!   a harness reporting absurd usage gets a large count, not an overflow.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::{clip, progress, str_of, tool_use, u64_of, Line, ParserState};
use crate::rein::{bounded_tokens, TokenUsage, ToolResult};

/// The longest message id remembered. A longer one (like an empty one) is
/// not remembered, so each of its lines counts as a new message: a harness
/// sending such ids can only overcount its own tokens, never hide them.
const MAX_MESSAGE_ID: usize = 200;
/// Message ids remembered at once. When full they are all forgotten and
/// remembering starts over: the message being read then may count twice
/// (an overcount once in that many messages) and memory stays bounded.
const MAX_MESSAGES: usize = 10_000;
/// Tools whose refusal reason is kept (the first reason of each).
const MAX_DENIALS: usize = 64;
/// Characters kept of a refused tool's name; a reason longer than this is
/// not kept at all, only its length (see [`kept`]).
const MAX_DENIAL_TEXT: usize = 200;
/// Refused calls a result's error names; the rest are only counted.
const MAX_DENIALS_LISTED: usize = 20;

#[derive(Debug, Default)]
pub(super) struct State {
    /// Tokens of each message id seen recently (see [`MAX_MESSAGES`]).
    messages: HashMap<String, u64>,
    /// Tokens of every message so far. Wider than a count, so a harness's
    /// absurd counts neither overflow it nor make a replaced count's
    /// subtraction inexact.
    message_tokens: u128,
    /// The tool, clipped, and the message ([`kept`]) of each refused tool.
    denials: Vec<(String, String)>,
}

impl State {
    /// Counts `tokens` as message `id`'s usage so far (Claude Code repeats
    /// a message's usage on each of its blocks, so a known id's count is
    /// replaced, not added to); the tokens of all messages so far.
    fn count(&mut self, id: String, tokens: u64) -> u64 {
        let replaced = match self.messages.get_mut(&id) {
            Some(counted) => std::mem::replace(counted, tokens),
            None => {
                if !id.is_empty() && id.len() <= MAX_MESSAGE_ID {
                    if self.messages.len() >= MAX_MESSAGES {
                        self.messages.clear();
                    }
                    self.messages.insert(id, tokens);
                }
                0
            }
        };
        self.message_tokens = self.message_tokens.saturating_sub(replaced.into()).saturating_add(tokens.into());
        bounded_tokens(u64::try_from(self.message_tokens).unwrap_or(u64::MAX))
    }
}

pub(super) fn parse(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    match kind {
        "system" => system(v, state),
        "assistant" => assistant(v, state),
        "result" => Line::Result(result(v, state)),
        _ => Line::Ignored,
    }
}

fn system(v: &Value, state: &mut ParserState) -> Line {
    let message = match str_of(v, "subtype").as_str() {
        "init" => {
            if let Some(id) = super::conversation_id(&str_of(v, "session_id")) {
                state.conversation = id;
            }
            let model = str_of(v, "model");
            if !model.is_empty() {
                state.model = model;
            }
            format!(
                "Claude Code {}: model {}, permission mode {}",
                str_of(v, "claude_code_version"),
                state.model,
                str_of(v, "permissionMode")
            )
        }
        "api_retry" => {
            let status = v.get("error_status").filter(|s| !s.is_null()).map_or("no status".into(), Value::to_string);
            let text = format!(
                "model API request failed ({status}, {}); retry {} of {} in {} ms",
                str_of(v, "error"),
                u64_of(v, "attempt").unwrap_or(0),
                u64_of(v, "max_retries").unwrap_or(0),
                u64_of(v, "retry_delay_ms").unwrap_or(0)
            );
            state.last_error = text.clone();
            text
        }
        "permission_denied" => {
            let tool = clip(&str_of(v, "tool_name"), MAX_DENIAL_TEXT);
            let message = str_of(v, "message");
            let text = format!("permission denied: {tool}: {message}");
            // Only the first reason of a tool is ever shown (see `refused`).
            let denials = &mut state.claude.denials;
            if denials.len() < MAX_DENIALS && !denials.iter().any(|(seen, _)| *seen == tool) {
                denials.push((tool, kept(message)));
            }
            text
        }
        _ => return Line::Ignored,
    };
    Line::Events(vec![progress(message, state)])
}

/// A usage object's four counts, each bounded ([`bounded_tokens`]).
fn usage_of(usage: &Value) -> TokenUsage {
    let count = |key| bounded_tokens(u64_of(usage, key).unwrap_or(0));
    TokenUsage {
        input: count("input_tokens"),
        output: count("output_tokens"),
        cache_read: count("cache_read_input_tokens"),
        cache_creation: count("cache_creation_input_tokens"),
        cost_usd: None,
    }
}

fn assistant(v: &Value, state: &mut ParserState) -> Line {
    let message = v.get("message").cloned().unwrap_or_default();
    let synthetic = v.get("is_api_error_message").and_then(Value::as_bool).unwrap_or(false);
    let model = str_of(&message, "model");
    if !synthetic && !model.is_empty() && !model.starts_with('<') {
        state.model = model;
    }
    if let Some(usage) = message.get("usage") {
        state.tokens = state.claude.count(str_of(&message, "id"), usage_of(usage).total());
    }
    let mut events = Vec::new();
    let mut text = Vec::new();
    for part in message.get("content").and_then(Value::as_array).into_iter().flatten() {
        match part.get("type").and_then(Value::as_str) {
            Some("tool_use") | Some("server_tool_use") => events.push(tool_use(str_of(part, "name"), state)),
            Some("text") => text.push(str_of(part, "text")),
            Some("thinking") => text.push(format!("(thinking) {}", str_of(part, "thinking"))),
            _ => {}
        }
    }
    let text: Vec<String> = text.into_iter().filter(|t| !t.trim().is_empty()).collect();
    if !text.is_empty() {
        let joined = text.join("\n");
        state.last_message = joined.clone();
        events.push(progress(joined, state));
    }
    if events.is_empty() {
        Line::Ignored
    } else {
        Line::Events(events)
    }
}

fn result(v: &Value, state: &mut ParserState) -> ToolResult {
    let mut usage = usage_of(&v.get("usage").cloned().unwrap_or_default());
    usage.cost_usd = v.get("total_cost_usd").and_then(Value::as_f64);
    let subtype = str_of(v, "subtype");
    let is_error = v.get("is_error").and_then(Value::as_bool).unwrap_or(subtype != "success");
    let text = str_of(v, "result");
    let (refusals, listed) = refused(v, state);
    let error = if is_error {
        match v.get("api_error_status").and_then(Value::as_u64) {
            Some(status) => {
                let kind = str_of(v, "api_error_type");
                let kind = if kind.is_empty() { String::new() } else { format!(" {kind}") };
                format!("model API error {status}{kind}: {text}")
            }
            None if subtype != "success" => format!("Claude Code stopped ({subtype}): {text}"),
            None => format!("Claude Code failed ({}): {text}", str_of(v, "terminal_reason")),
        }
    } else if refusals > 0 {
        let more = match refusals - listed.len() {
            0 => String::new(),
            more => format!("; and {more} more"),
        };
        format!("Claude Code was refused permission for {refusals} tool call(s): {}{more}", listed.join("; "))
    } else if subtype != "success" {
        format!("Claude Code stopped ({subtype})")
    } else {
        String::new()
    };
    if state.model.is_empty() {
        // No init line: the model the usage is counted under.
        if let Some(model) = v.get("modelUsage").and_then(Value::as_object).and_then(|m| m.keys().next()) {
            state.model = model.clone();
        }
    }
    let tokens = if usage.total() > 0 { usage.total() } else { state.tokens };
    ToolResult {
        ok: error.is_empty(),
        output: text,
        error,
        tokens_spent: tokens,
        resolved_model: state.model.clone(),
        usage: Some(usage),
    }
}

/// `text` if it has at most [`MAX_DENIAL_TEXT`] characters, else only its
/// length: never a part of it. What the parser reports is scrubbed of the
/// run's credentials later, by the lifecycle, as a whole; a value cut in
/// two here would keep a prefix no pattern matches.
fn kept(text: String) -> String {
    match text.chars().count() {
        n if n <= MAX_DENIAL_TEXT => text,
        n => format!("a reason of {n} characters, not kept"),
    }
}

/// The refused tool calls of a result: how many, and the first
/// [`MAX_DENIALS_LISTED`] of them, each with the reason Claude Code gave
/// (from its `permission_denied` line) and what the call wanted, whole
/// (bounded by the result's line; the error is scrubbed as a whole, see
/// [`kept`]).
/// Calls corral's gate refused are left out: the model was told why, and
/// the run goes on.
fn refused(v: &Value, state: &ParserState) -> (usize, Vec<String>) {
    let denials = v.get("permission_denials").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    if denials.is_empty() {
        return (0, Vec::new());
    }
    // One look-up per call: a result may list many calls, and the gate may
    // have refused thousands.
    let gate_denied: HashSet<&str> = state.gate_denied.iter().map(String::as_str).collect();
    let mut refused = denials.iter().filter(|d| {
        let id = d.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
        !gate_denied.contains(id)
    });
    let listed: Vec<String> = refused
        .by_ref()
        .take(MAX_DENIALS_LISTED)
        .map(|d| {
            let tool = clip(&str_of(d, "tool_name"), MAX_DENIAL_TEXT);
            let reason = state
                .claude
                .denials
                .iter()
                .find(|(seen, _)| *seen == tool)
                .map_or("not allowed", |(_, reason)| reason.as_str());
            let input = d.get("tool_input").map(Value::to_string).unwrap_or_default();
            format!("{tool} ({reason}) {input}")
        })
        .collect();
    (listed.len() + refused.count(), listed)
}

#[cfg(test)]
mod tests {
    use super::super::parse_line;
    use super::*;
    use crate::catalog::Preset;
    use crate::rein::HarnessEvent;
    use serde_json::json;

    /// Every line of a recorded transcript, and the result.
    fn replay(transcript: &str) -> (Vec<HarnessEvent>, ToolResult) {
        let mut state = ParserState::default();
        let mut events = Vec::new();
        let mut result = None;
        for line in transcript.lines() {
            match parse_line(Preset::ClaudeStreamJson, line.as_bytes(), &mut state) {
                Line::Events(e) => events.extend(e),
                Line::Result(r) => result = Some(r),
                Line::Ignored => {}
                other => panic!("unexpected {other:?} for {line}"),
            }
        }
        (events, result.expect("a result line"))
    }

    fn tools(events: &[HarnessEvent]) -> Vec<&str> {
        events
            .iter()
            .filter_map(|e| match e {
                HarnessEvent::ToolUse { tool, .. } => Some(tool.as_str()),
                _ => None,
            })
            .collect()
    }

    fn tokens_so_far(events: &[HarnessEvent]) -> Vec<u64> {
        events
            .iter()
            .map(|e| match e {
                HarnessEvent::Progress { tokens_so_far, .. } | HarnessEvent::ToolUse { tokens_so_far, .. } => {
                    *tokens_so_far
                }
                _ => 0,
            })
            .collect()
    }

    #[test]
    fn a_run_that_writes_a_file() {
        let (events, r) = replay(include_str!("../../../tests/fixtures/claude/write_file.jsonl"));
        assert!(r.ok, "{r:?}");
        assert_eq!(tools(&events), ["Write"]);
        let usage = r.usage.clone().unwrap();
        assert_eq!(r.tokens_spent, usage.total());
        assert!(usage.cache_read > 0 && usage.cache_creation > 0, "{usage:?}");
        assert_eq!(r.resolved_model, "claude-mock-1", "the model the API served");
        // Tokens so far never go down, and a message's usage counts once.
        let so_far = tokens_so_far(&events);
        assert!(so_far.windows(2).all(|w| w[0] <= w[1]), "{so_far:?}");
        assert!(*so_far.last().unwrap() <= r.tokens_spent, "{so_far:?} vs {}", r.tokens_spent);
    }

    #[test]
    fn a_model_api_error_fails_with_its_status_and_message() {
        let (_, r) = replay(include_str!("../../../tests/fixtures/claude/api_error_400.jsonl"));
        assert!(!r.ok);
        assert!(r.error.starts_with("model API error 400"), "{}", r.error);
        assert!(r.error.contains("mock-model rejects this request"), "{}", r.error);
        assert_ne!(r.resolved_model, "<synthetic>");
        assert!(!r.resolved_model.is_empty(), "the init line's model is kept");
    }

    #[test]
    fn a_refused_permission_fails_the_run() {
        let (events, r) = replay(include_str!("../../../tests/fixtures/claude/permission_denied.jsonl"));
        assert!(!r.ok, "{r:?}");
        assert!(r.error.contains("refused permission") && r.error.contains("WebFetch"), "{}", r.error);
        assert_eq!(tools(&events), ["WebFetch"]);
    }

    #[test]
    fn retries_are_progress() {
        let (events, r) = replay(include_str!("../../../tests/fixtures/claude/api_retry.jsonl"));
        let retries = events
            .iter()
            .filter(|e| matches!(e, HarnessEvent::Progress { message, .. } if message.contains("retry")))
            .count();
        assert!(retries >= 1, "{events:?}");
        assert!(!r.ok && r.error.contains("529"), "{}", r.error);
    }

    #[test]
    fn repeated_usage_of_one_message_counts_once() {
        let mut s = ParserState::default();
        let line = |id: &str, part: &str| {
            format!(
                r#"{{"type":"assistant","message":{{"id":"{id}","model":"m","content":[{part}],"usage":{{"input_tokens":100,"output_tokens":1,"cache_read_input_tokens":0,"cache_creation_input_tokens":0}}}}}}"#
            )
        };
        for l in [line("a", r#"{"type":"text","text":"hi"}"#), line("a", r#"{"type":"tool_use","name":"Bash"}"#)] {
            parse_line(Preset::ClaudeStreamJson, l.as_bytes(), &mut s);
        }
        assert_eq!(s.tokens, 101);
        parse_line(Preset::ClaudeStreamJson, line("b", r#"{"type":"text","text":"x"}"#).as_bytes(), &mut s);
        assert_eq!(s.tokens, 202);
    }

    /// An assistant line of message `id` with 101 tokens.
    fn usage_line(id: &str) -> String {
        format!(
            r#"{{"type":"assistant","message":{{"id":"{id}","content":[],"usage":{{"input_tokens":100,"output_tokens":1}}}}}}"#
        )
    }

    #[test]
    fn overlong_and_empty_message_ids_are_counted_but_not_kept() {
        let mut s = ParserState::default();
        for i in 0..1_000 {
            let id = format!("{i:06}{}", "x".repeat(64 << 10));
            parse_line(Preset::ClaudeStreamJson, usage_line(&id).as_bytes(), &mut s);
        }
        let no_id = r#"{"type":"assistant","message":{"content":[],"usage":{"input_tokens":100,"output_tokens":1}}}"#;
        for _ in 0..100 {
            parse_line(Preset::ClaudeStreamJson, no_id.as_bytes(), &mut s);
        }
        let kept: usize = s.claude.messages.keys().map(String::len).sum();
        assert!(kept < 1 << 20, "{kept} bytes of ids kept");
        assert!(s.claude.messages.is_empty(), "{} ids kept", s.claude.messages.len());
        assert_eq!(s.tokens, 1_100 * 101, "each such line counts as a message of its own");
    }

    #[test]
    fn message_ids_kept_are_bounded_and_recent_ones_still_count_once() {
        let mut s = ParserState::default();
        for i in 0..20_000 {
            parse_line(Preset::ClaudeStreamJson, usage_line(&format!("msg_{i}")).as_bytes(), &mut s);
        }
        assert!(s.claude.messages.len() <= MAX_MESSAGES, "{} ids kept", s.claude.messages.len());
        assert_eq!(s.tokens, 20_000 * 101, "forgetting ids loses no tokens");
        parse_line(Preset::ClaudeStreamJson, usage_line("msg_19999").as_bytes(), &mut s);
        assert_eq!(s.tokens, 20_000 * 101, "the last message's repeated usage counts once");
    }

    #[test]
    fn a_flood_of_refusals_is_clipped_and_counted() {
        let mut s = ParserState::default();
        let denied = |tool: &str| {
            format!(
                r#"{{"type":"system","subtype":"permission_denied","tool_name":"{tool}","message":"{}"}}"#,
                "m".repeat(100 << 10)
            )
        };
        parse_line(Preset::ClaudeStreamJson, denied("x").as_bytes(), &mut s);
        for i in 0..100 {
            parse_line(Preset::ClaudeStreamJson, denied(&format!("t{i}")).as_bytes(), &mut s);
        }
        let kept: usize = s.claude.denials.iter().map(|(tool, reason)| tool.len() + reason.len()).sum();
        assert!(kept < 64 << 10, "{kept} bytes of refusals kept");
        assert!(s.claude.denials.len() <= MAX_DENIALS, "{} refusals kept", s.claude.denials.len());
        let calls = vec![r#"{"tool_name":"x"}"#; 2_000].join(",");
        let line = format!(
            r#"{{"type":"result","subtype":"success","is_error":false,"result":"r","permission_denials":[{calls}]}}"#
        );
        let Line::Result(r) = parse_line(Preset::ClaudeStreamJson, line.as_bytes(), &mut s) else { panic!("a result") };
        assert!(!r.ok);
        assert!(r.error.len() < 16 << 10, "{} bytes of error", r.error.len());
        let reason = format!("a reason of {} characters, not kept", 100 << 10);
        assert!(r.error.contains(&format!("for 2000 tool call(s): x ({reason})")), "{}", &r.error[..200]);
        assert!(r.error.ends_with("; and 1980 more"), "{}", &r.error[r.error.len() - 100..]);
    }

    /// The lifecycle scrubs progress and a result's error of the run's
    /// credentials, each as a whole: the parser cuts neither a refused
    /// call's input nor its reason, so no value is cut in two before the
    /// scrub could see it (a cut at 200 characters kept a prefix of a key
    /// across it, which no pattern matches).
    #[test]
    fn a_refusal_keeps_no_part_of_a_credential_the_scrub_cannot_see() {
        let key = "sk-ant-api03-Zq7xK2mP9vR4tY8wB3nL6cH1jF5dS0aE";
        let mut scrubber = crate::credentials::Scrubber::default();
        scrubber.add("anthropic", key);
        let no_piece = |text: &str| (0..=key.len() - 8).all(|at| !text.contains(&key[at..at + 8]));
        // The key across the old cut at 200 characters of the reason (39,
        // 29, 24 characters of it before the cut) and of the input (27, 17,
        // 12), then wholly before both cuts.
        for lead in [160, 170, 175, 100] {
            let mut s = ParserState::default();
            let reason = format!("{} {key} and more", "m".repeat(lead));
            let denied =
                json!({"type": "system", "subtype": "permission_denied", "tool_name": "Bash", "message": reason});
            let Line::Events(events) = parse_line(Preset::ClaudeStreamJson, denied.to_string().as_bytes(), &mut s)
            else {
                panic!("progress")
            };
            let [HarnessEvent::Progress { message, .. }] = &events[..] else { panic!("{events:?}") };
            let message = scrubber.scrub(message);
            assert!(message.contains("[REDACTED:anthropic] and more") && no_piece(&message), "{lead}: {message}");
            let command = format!("{} {key} tail", "x".repeat(lead));
            let denial = json!({"tool_name": "Bash", "tool_use_id": "t1", "tool_input": {"command": command}});
            let result =
                json!({"type": "result", "subtype": "success", "is_error": false, "permission_denials": [denial]});
            let Line::Result(r) = parse_line(Preset::ClaudeStreamJson, result.to_string().as_bytes(), &mut s) else {
                panic!("a result")
            };
            let error = scrubber.scrub(&r.error);
            assert!(error.contains("[REDACTED:anthropic] tail\"}") && no_piece(&error), "{lead}: {error}");
            let shown = if reason.len() > MAX_DENIAL_TEXT { "Bash (a reason of " } else { "Bash (mmm" };
            assert!(error.contains(shown), "a reason is kept whole or not at all, never cut: {error}");
        }
    }

    #[test]
    fn calls_the_gate_refused_are_not_the_runs_refusals() {
        let gate_denied = (0..10_000).map(|i| format!("toolu_{i}")).collect();
        let mut s = ParserState { gate_denied, ..ParserState::default() };
        let calls =
            (0..20_000).map(|i| format!(r#"{{"tool_name":"x","tool_use_id":"toolu_{i}"}}"#)).collect::<Vec<_>>();
        let line = format!(
            r#"{{"type":"result","subtype":"success","is_error":false,"result":"r","permission_denials":[{}]}}"#,
            calls.join(",")
        );
        let Line::Result(r) = parse_line(Preset::ClaudeStreamJson, line.as_bytes(), &mut s) else { panic!("a result") };
        assert!(r.error.starts_with("Claude Code was refused permission for 10000 tool call(s): x (not allowed)"));
        let gated = r#"{"type":"result","subtype":"success","is_error":false,"result":"r","permission_denials":[{"tool_name":"x","tool_use_id":"toolu_7"}]}"#;
        let Line::Result(r) = parse_line(Preset::ClaudeStreamJson, gated.as_bytes(), &mut s) else {
            panic!("a result")
        };
        assert!(r.ok, "{r:?}");
    }

    #[test]
    fn absurd_usage_is_bounded_not_overflowed() {
        use crate::rein::MAX_TOKENS;
        let max = u64::MAX;
        let mut s = ParserState::default();
        for id in ["a", "b"] {
            let l = format!(
                r#"{{"type":"assistant","message":{{"id":"{id}","content":[{{"type":"text","text":"hi"}}],"usage":{{"input_tokens":{max},"output_tokens":{max}}}}}}}"#
            );
            parse_line(Preset::ClaudeStreamJson, l.as_bytes(), &mut s);
        }
        assert_eq!(s.tokens, MAX_TOKENS);
        let l = format!(
            r#"{{"type":"result","subtype":"success","is_error":false,"result":"r","usage":{{"input_tokens":{max},"output_tokens":{max},"cache_read_input_tokens":{max},"cache_creation_input_tokens":{max}}}}}"#
        );
        let Line::Result(r) = parse_line(Preset::ClaudeStreamJson, l.as_bytes(), &mut s) else { panic!("a result") };
        assert_eq!(r.tokens_spent, MAX_TOKENS);
        assert_eq!(r.usage.unwrap().input, MAX_TOKENS, "each count is bounded too");
    }
}
