//! Codex `exec --json`.
//!
//! What the stream says and how it maps:
//! - `item.started` / `item.updated` / `item.completed` with an item of
//!   type `command_execution` (as `Bash`), `file_change` (as
//!   `apply_patch`), `mcp_tool_call` (as `mcp__<server>__<tool>`),
//!   `collab_tool_call` or `web_search`: a `tool_use` the first time an
//!   item id is seen, progress when it ends;
//!   `agent_message`, `reasoning`, `todo_list` and `error` (a warning, not
//!   a failure): progress; any other item type: progress naming it.
//! - a top-level `error` is progress (`Reconnecting...` is a retry); the
//!   last one is kept for a run that ends without a turn result.
//! - `turn.completed` carries the turn's usage: the result, with tokens =
//!   input + output (cached and cache-write input are part of input, as in
//!   the Responses API), summed over the turns, each count and each sum
//!   bounded by `MAX_TOKENS`. `turn.failed` fails the run with the model
//!   API's own message when the error is the API's JSON.
//! - The model is never in the stream: it is the one corral wrote into
//!   Codex's config.

use std::collections::HashSet;

use serde_json::Value;

use super::{progress, str_of, tool_use, u64_of, Line, ParserState};
use crate::rein::{bounded_tokens, HarnessEvent, TokenUsage, ToolResult};

/// The longest item id remembered. A longer one (like an empty one) is not
/// remembered, so each of its lines reports the tool use again: a harness
/// sending such ids can only over-report its tool calls, never hide one.
const MAX_ITEM_ID: usize = 200;
/// Item ids remembered at once. When full they are all forgotten and
/// remembering starts over: an item still running then is reported twice,
/// and memory stays bounded.
const MAX_TOOLS_SEEN: usize = 10_000;

#[derive(Debug, Default)]
pub(super) struct State {
    /// Item ids already reported as a tool use (see [`MAX_TOOLS_SEEN`]).
    tools_seen: HashSet<String>,
    usage: TokenUsage,
}

pub(super) fn parse(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    match kind {
        "item.started" | "item.updated" | "item.completed" => {
            let item = v.get("item").cloned().unwrap_or_default();
            let events = item_events(&item, kind == "item.completed", state);
            if events.is_empty() {
                Line::Ignored
            } else {
                Line::Events(events)
            }
        }
        "thread.started" => {
            if let Some(id) = super::conversation_id(&str_of(v, "thread_id")) {
                state.conversation = id;
            }
            Line::Ignored
        }
        "turn.completed" => Line::Result(turn_completed(v, state)),
        "turn.failed" => {
            let message = v.get("error").map(|e| str_of(e, "message")).unwrap_or_default();
            Line::Result(failed(api_error(&message), state))
        }
        "error" => {
            let message = str_of(v, "message");
            if !message.starts_with("Reconnecting") {
                state.last_error = api_error(&message);
            }
            Line::Events(vec![progress(format!("error: {message}"), state)])
        }
        _ => Line::Ignored,
    }
}

/// The tool an item stands for, if it is a tool call: the name the model
/// called it by, which is what Codex's hook reports to the gate too (its
/// shell arrives there as `Bash`).
fn tool_of(item: &Value, item_type: &str) -> Option<String> {
    match item_type {
        "command_execution" => Some("Bash".into()),
        "file_change" => Some("apply_patch".into()),
        "web_search" => Some(item_type.to_string()),
        "mcp_tool_call" => Some(format!("mcp__{}__{}", str_of(item, "server"), str_of(item, "tool"))),
        "collab_tool_call" => Some(str_of(item, "tool")).filter(|t| !t.is_empty()),
        _ => None,
    }
}

fn item_events(item: &Value, completed: bool, state: &mut ParserState) -> Vec<HarnessEvent> {
    let item_type = str_of(item, "type");
    let mut events = Vec::new();
    if let Some(tool) = tool_of(item, &item_type) {
        let id = str_of(item, "id");
        if !state.codex.tools_seen.contains(&id) {
            let seen = &mut state.codex.tools_seen;
            if !id.is_empty() && id.len() <= MAX_ITEM_ID {
                if seen.len() >= MAX_TOOLS_SEEN {
                    seen.clear();
                }
                seen.insert(id);
            }
            events.push(tool_use(tool, state));
        }
    }
    let status = str_of(item, "status");
    let message = match item_type.as_str() {
        "command_execution" if completed => {
            let exit = item.get("exit_code").filter(|c| !c.is_null()).map_or("no exit code".into(), Value::to_string);
            // The command whole: the lifecycle scrubs the message of the
            // run's credentials, and a value cut in two here would keep a
            // prefix no pattern matches.
            Some(format!("command {status} ({exit}): {}", str_of(item, "command")))
        }
        "file_change" if completed => {
            let changes: Vec<String> = item
                .get("changes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|c| format!("{} {}", str_of(c, "kind"), str_of(c, "path")))
                .collect();
            Some(format!("file change {status}: {}", changes.join(", ")))
        }
        "mcp_tool_call" | "collab_tool_call" if completed => Some(format!("{} {status}", str_of(item, "tool"))),
        "web_search" if completed => Some(format!("web search: {}", str_of(item, "query"))),
        "todo_list" => {
            let items = item.get("items").and_then(Value::as_array).cloned().unwrap_or_default();
            let done = items.iter().filter(|i| i.get("completed").and_then(Value::as_bool).unwrap_or(false)).count();
            Some(format!("todo list: {done} of {} done", items.len()))
        }
        "reasoning" if completed => Some(format!("(reasoning) {}", str_of(item, "text"))),
        "agent_message" if completed => {
            state.last_message = str_of(item, "text");
            Some(state.last_message.clone())
        }
        "error" => Some(format!("warning: {}", str_of(item, "message"))),
        "command_execution" | "file_change" | "mcp_tool_call" | "collab_tool_call" | "web_search" | "reasoning"
        | "agent_message" => None,
        other if completed => Some(format!("{other} item")),
        _ => None,
    };
    if let Some(message) = message {
        events.push(progress(message, state));
    }
    events
}

fn turn_completed(v: &Value, state: &mut ParserState) -> ToolResult {
    let usage = v.get("usage").cloned().unwrap_or_default();
    let count = |key| bounded_tokens(u64_of(&usage, key).unwrap_or(0));
    let (input, cached, cache_write) =
        (count("input_tokens"), count("cached_input_tokens"), count("cache_write_input_tokens"));
    // Summed over the turns, each kind bounded as one count is.
    let add = |total: &mut u64, turn: u64| *total = bounded_tokens(total.saturating_add(turn));
    let total = &mut state.codex.usage;
    add(&mut total.cache_read, cached);
    add(&mut total.cache_creation, cache_write);
    add(&mut total.input, input.saturating_sub(cached.saturating_add(cache_write)));
    add(&mut total.output, count("output_tokens"));
    state.tokens = total.total();
    ToolResult {
        ok: true,
        output: state.last_message.clone(),
        error: String::new(),
        tokens_spent: state.tokens,
        resolved_model: state.model.clone(),
        usage: Some(state.codex.usage.clone()),
    }
}

fn failed(error: String, state: &ParserState) -> ToolResult {
    ToolResult {
        ok: false,
        output: state.last_message.clone(),
        error,
        tokens_spent: state.tokens,
        resolved_model: state.model.clone(),
        usage: (state.tokens > 0).then(|| state.codex.usage.clone()),
    }
}

/// Codex passes a model API's error body through as its message: the API's
/// own words and type, when the message is that JSON.
fn api_error(message: &str) -> String {
    let Ok(body) = serde_json::from_str::<Value>(message) else { return message.to_string() };
    let Some(error) = body.get("error") else { return message.to_string() };
    let kind = [str_of(error, "type"), str_of(error, "code")].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>();
    match str_of(error, "message") {
        text if text.is_empty() => message.to_string(),
        text if kind.is_empty() => format!("model API error: {text}"),
        text => format!("model API error ({}): {text}", kind.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_line;
    use super::*;
    use crate::catalog::Preset;

    fn replay(transcript: &str, model: &str) -> (Vec<HarnessEvent>, Option<ToolResult>) {
        let mut state = ParserState { model: model.into(), ..ParserState::default() };
        let mut events = Vec::new();
        let mut result = None;
        for line in transcript.lines() {
            match parse_line(Preset::CodexExecJson, line.as_bytes(), &mut state) {
                Line::Events(e) => events.extend(e),
                Line::Result(r) => result = Some(r),
                Line::Ignored | Line::Plain => {}
                other => panic!("unexpected {other:?} for {line}"),
            }
        }
        (events, result)
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

    #[test]
    fn a_run_that_writes_a_file() {
        let (events, r) = replay(include_str!("../../../tests/fixtures/codex/write_file.jsonl"), "gpt-mock-1");
        let r = r.expect("a result");
        assert!(r.ok, "{r:?}");
        assert_eq!(tools(&events), ["Bash"], "started and completed count once, by the tool's name");
        let usage = r.usage.clone().unwrap();
        assert!(usage.cache_read > 0, "{usage:?}");
        assert_eq!(r.tokens_spent, usage.total());
        assert_eq!(r.resolved_model, "gpt-mock-1");
        assert!(!r.output.is_empty());
    }

    #[test]
    fn a_model_api_error_fails_with_the_apis_message() {
        let (_, r) = replay(include_str!("../../../tests/fixtures/codex/api_error_400.jsonl"), "gpt-mock-1");
        let r = r.expect("a result");
        assert!(!r.ok);
        assert!(r.error.starts_with("model API error (invalid_request_error"), "{}", r.error);
        assert!(r.error.contains("mock-model rejects this request"), "{}", r.error);
        assert_eq!(r.resolved_model, "gpt-mock-1");
    }

    #[test]
    fn every_item_type_is_mapped() {
        let lines = [
            r#"{"type":"item.started","item":{"id":"1","type":"file_change","changes":[{"path":"a.txt","kind":"add"}],"status":"in_progress"}}"#,
            r#"{"type":"item.completed","item":{"id":"1","type":"file_change","changes":[{"path":"a.txt","kind":"add"}],"status":"completed"}}"#,
            r#"{"type":"item.started","item":{"id":"2","type":"mcp_tool_call","server":"docs","tool":"search","status":"in_progress"}}"#,
            r#"{"type":"item.completed","item":{"id":"3","type":"web_search","query":"rust bwrap"}}"#,
            r#"{"type":"item.started","item":{"id":"4","type":"todo_list","items":[{"text":"a","completed":true},{"text":"b","completed":false}]}}"#,
            r#"{"type":"item.completed","item":{"id":"5","type":"reasoning","text":"thinking"}}"#,
            r#"{"type":"item.completed","item":{"id":"6","type":"collab_tool_call","tool":"spawn_agent","status":"completed"}}"#,
            r#"{"type":"item.completed","item":{"id":"7","type":"error","message":"Model metadata not found"}}"#,
            r#"{"type":"item.completed","item":{"id":"8","type":"image_view","path":"x.png"}}"#,
            r#"{"type":"error","message":"Reconnecting... 1/5"}"#,
        ]
        .join("\n");
        let (events, r) = replay(&lines, "");
        assert!(r.is_none(), "nothing here ends the turn");
        assert_eq!(tools(&events), ["apply_patch", "mcp__docs__search", "web_search", "spawn_agent"]);
        let messages: Vec<&str> = events
            .iter()
            .filter_map(|e| match e {
                HarnessEvent::Progress { message, .. } => Some(message.as_str()),
                _ => None,
            })
            .collect();
        for expected in [
            "file change completed: add a.txt",
            "web search: rust bwrap",
            "todo list: 1 of 2 done",
            "(reasoning) thinking",
            "warning: Model metadata not found",
            "image_view item",
            "error: Reconnecting... 1/5",
        ] {
            assert!(messages.contains(&expected), "{expected:?} missing from {messages:?}");
        }
    }

    /// The lifecycle scrubs a progress message of the run's credentials: the
    /// parser cuts no command, so no value is cut in two before the scrub
    /// could see it (a cut at 300 characters kept a prefix of a key across
    /// it, which no pattern matches).
    #[test]
    fn a_command_is_whole_so_a_credential_in_it_is_scrubbed_whole() {
        let key = "sk-ant-api03-Zq7xK2mP9vR4tY8wB3nL6cH1jF5dS0aE";
        // The key across the old cut at 300 (19, 29, 39 and 8 characters
        // of it before the cut), then wholly before it.
        for lead in [280, 270, 260, 291, 250] {
            let command = format!("{} {key} tail", "x".repeat(lead));
            let item = serde_json::json!({
                "id": "c1", "type": "command_execution", "command": command, "exit_code": 0, "status": "completed"
            });
            let line = serde_json::json!({"type": "item.completed", "item": item}).to_string();
            let (events, _) = replay(&line, "");
            let mut scrubber = crate::credentials::Scrubber::default();
            scrubber.add("anthropic", key);
            let messages: Vec<String> = events
                .iter()
                .filter_map(|e| match e {
                    HarnessEvent::Progress { message, .. } => Some(scrubber.scrub(message)),
                    _ => None,
                })
                .collect();
            let [message] = &messages[..] else { panic!("one progress message: {messages:?}") };
            let pieces = (0..=key.len() - 8).map(|at| &key[at..at + 8]);
            assert!(!pieces.clone().any(|p| message.contains(p)), "lead {lead}: {message}");
            assert!(message.ends_with(" [REDACTED:anthropic] tail"), "lead {lead}: {message}");
        }
    }

    /// An `item.started` line of a command with item id `id`.
    fn command_line(id: &str) -> String {
        format!(r#"{{"type":"item.started","item":{{"id":"{id}","type":"command_execution","status":"in_progress"}}}}"#)
    }

    #[test]
    fn overlong_and_empty_item_ids_are_reported_but_not_kept() {
        let mut s = ParserState::default();
        for i in 0..1_000 {
            let id = format!("{i:06}{}", "x".repeat(64 << 10));
            parse_line(Preset::CodexExecJson, command_line(&id).as_bytes(), &mut s);
        }
        for _ in 0..100 {
            let Line::Events(events) = parse_line(Preset::CodexExecJson, command_line("").as_bytes(), &mut s) else {
                panic!("events")
            };
            assert_eq!(tools(&events), ["Bash"], "an id not kept reports its tool use each time");
        }
        let kept: usize = s.codex.tools_seen.iter().map(String::len).sum();
        assert!(kept < 1 << 20, "{kept} bytes of ids kept");
        assert!(s.codex.tools_seen.is_empty(), "{} ids kept", s.codex.tools_seen.len());
    }

    #[test]
    fn item_ids_kept_are_bounded_and_recent_ones_still_report_once() {
        let mut s = ParserState::default();
        for i in 0..20_000 {
            parse_line(Preset::CodexExecJson, command_line(&format!("item_{i}")).as_bytes(), &mut s);
        }
        assert!(s.codex.tools_seen.len() <= MAX_TOOLS_SEEN, "{} ids kept", s.codex.tools_seen.len());
        let again = parse_line(Preset::CodexExecJson, command_line("item_19999").as_bytes(), &mut s);
        assert_eq!(again, Line::Ignored, "the last item was already reported");
    }

    #[test]
    fn usage_adds_up_across_turns_and_cached_input_is_part_of_input() {
        let mut s = ParserState::default();
        for _ in 0..2 {
            let line =
                r#"{"type":"turn.completed","usage":{"input_tokens":100,"cached_input_tokens":80,"output_tokens":20}}"#;
            parse_line(Preset::CodexExecJson, line.as_bytes(), &mut s);
        }
        assert_eq!(s.tokens, 240);
        assert_eq!((s.codex.usage.input, s.codex.usage.cache_read, s.codex.usage.output), (40, 160, 40));
    }

    #[test]
    fn absurd_usage_is_bounded_not_overflowed() {
        use crate::rein::MAX_TOKENS;
        let max = u64::MAX;
        let mut s = ParserState::default();
        let line = format!(
            r#"{{"type":"turn.completed","usage":{{"input_tokens":{max},"cached_input_tokens":{max},"cache_write_input_tokens":{max},"output_tokens":{max}}}}}"#
        );
        for _ in 0..3 {
            parse_line(Preset::CodexExecJson, line.as_bytes(), &mut s);
        }
        assert_eq!(s.tokens, MAX_TOKENS);
        let usage = &s.codex.usage;
        assert_eq!((usage.cache_read, usage.cache_creation, usage.output), (MAX_TOKENS, MAX_TOKENS, MAX_TOKENS));
    }
}
