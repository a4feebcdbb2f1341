//! The JSON-lines harness protocol, and the presets that map real
//! harnesses' stream formats onto it.
//!
//! corral's own protocol, one JSON object per line on stdout:
//! `{"type":"progress","message":"...","tokens":12}`,
//! `{"type":"tool_use","tool":"edit_file",...}`, and a final
//! `{"type":"result","ok":true,"output":"...","tokens_spent":123,"resolved_model":"..."}`.
//! Any other line is plain output.

mod claude;
mod codex;

use serde_json::Value;

use super::{HarnessEvent, ToolResult};
use crate::catalog::Preset;

/// What one stdout line means.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// Not a protocol line (not a JSON object with a `type`): plain output.
    Plain,
    /// Progress, tool use: one line can carry several (a message with two
    /// tool calls).
    Events(Vec<HarnessEvent>),
    /// The harness's final answer to the tool call.
    Result(ToolResult),
    /// `{"type":"policy_request","id":..,"tool":..,"arguments":..}`: the
    /// harness asks the tool_call gate before using a tool.
    PolicyRequest {
        /// The request's id, echoed back in the `policy_verdict` answer.
        id: Value,
        /// The tool the harness wants to use.
        tool: String,
        /// The arguments it wants to call it with.
        arguments: Value,
    },
    /// A protocol line with nothing to report (e.g. Claude's `user` lines).
    Ignored,
}

/// Per-stream state the presets keep: the model, tokens so far, the last
/// agent message and error, and each preset's own bookkeeping.
#[derive(Debug, Default)]
pub struct ParserState {
    /// Tokens the harness reported so far on this stream.
    pub tokens: u64,
    /// The model: Claude's init line (then the model the API says it
    /// served); for Codex the one corral wrote into its config.
    pub model: String,
    /// The agent's last message as the preset read it (a Codex run's output is
    /// its last message).
    pub last_message: String,
    /// The last error the harness reported before it stopped, for a run
    /// that ends without a result line.
    pub last_error: String,
    /// The agent's own id of its conversation (Claude Code's `session_id`,
    /// Codex's `thread_id`): what the next turn of a session resumes.
    pub conversation: String,
    /// The agent's ids of the calls corral's gate refused (through its
    /// hook): refusals the run goes on after, not failures.
    pub gate_denied: Vec<String>,
    claude: claude::State,
    codex: codex::State,
}

impl ParserState {
    /// A fresh stream whose model is `model` until the stream says otherwise.
    pub fn new(model: String) -> ParserState {
        ParserState { model, ..ParserState::default() }
    }
}

/// A conversation id as an agent reported it, if it is a plain one (it
/// goes on the next turn's command line): it starts with a letter or a
/// digit, so a harness cannot make it a flag (`--dangerously-skip-permissions`
/// after `--resume`).
fn conversation_id(text: &str) -> Option<String> {
    let plain = text.len() <= 128
        && text.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    plain.then(|| text.to_string())
}

/// Reads one stdout line in `preset`'s format, updating `state`; a line that is
/// not a JSON object with a `type` is [`Line::Plain`].
pub fn parse_line(preset: Preset, line: &[u8], state: &mut ParserState) -> Line {
    let Ok(value @ Value::Object(_)) = serde_json::from_slice::<Value>(line) else {
        return Line::Plain;
    };
    let Some(kind) = value.get("type").and_then(Value::as_str) else {
        return Line::Plain;
    };
    match preset {
        Preset::Protocol => protocol(kind, &value, state),
        Preset::ClaudeStreamJson => claude::parse(kind, &value, state),
        Preset::CodexExecJson => codex::parse(kind, &value, state),
    }
}

fn str_of(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or_default().to_string()
}

fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn progress(message: String, state: &ParserState) -> HarnessEvent {
    HarnessEvent::Progress { message, tokens_so_far: state.tokens }
}

fn tool_use(tool: String, state: &ParserState) -> HarnessEvent {
    HarnessEvent::ToolUse { tool, tokens_so_far: state.tokens }
}

/// At most `max` characters of `text`, marked when cut.
fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

fn protocol(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    match kind {
        "progress" => {
            if let Some(tokens) = u64_of(v, "tokens") {
                state.tokens = crate::rein::bounded_tokens(tokens);
            }
            Line::Events(vec![progress(str_of(v, "message"), state)])
        }
        "tool_use" => Line::Events(vec![tool_use(str_of(v, "tool"), state)]),
        "result" => Line::Result(ToolResult {
            ok: v.get("ok").and_then(Value::as_bool).unwrap_or(false),
            output: str_of(v, "output"),
            error: str_of(v, "error"),
            tokens_spent: u64_of(v, "tokens_spent").map_or(state.tokens, crate::rein::bounded_tokens),
            resolved_model: str_of(v, "resolved_model"),
            usage: None,
        }),
        "policy_request" => Line::PolicyRequest {
            id: v.get("id").cloned().unwrap_or(Value::Null),
            tool: str_of(v, "tool"),
            arguments: v.get("arguments").cloned().unwrap_or(Value::Null),
        },
        _ => Line::Plain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id goes on the next turn's command line: one that would be a
    /// flag there is not kept, from either agent.
    #[test]
    fn a_conversation_id_that_would_be_a_flag_is_not_kept() {
        let claude = |id: &str| {
            let mut s = ParserState::default();
            let line = serde_json::json!({"type": "system", "subtype": "init", "session_id": id}).to_string();
            parse_line(Preset::ClaudeStreamJson, line.as_bytes(), &mut s);
            s.conversation
        };
        let codex = |id: &str| {
            let mut s = ParserState::default();
            let line = serde_json::json!({"type": "thread.started", "thread_id": id}).to_string();
            parse_line(Preset::CodexExecJson, line.as_bytes(), &mut s);
            s.conversation
        };
        let uuid = "0199a7c2-5f3e-7d10-9a4b-3c2d1e0f9a8b";
        assert_eq!((claude(uuid), codex(uuid)), (uuid.to_string(), uuid.to_string()));
        for flag in ["--dangerously-skip-permissions", "--dangerously-bypass-approvals-and-sandbox", "-x", "_a", ""] {
            assert_eq!((claude(flag), codex(flag)), (String::new(), String::new()), "{flag:?}");
        }
        assert_eq!(conversation_id(&"a".repeat(129)), None);
        assert!(crate::rein::command::resume_argv(Preset::ClaudeStreamJson, &["claude".into()], "--yolo").is_err());
    }

    #[test]
    fn protocol_lines() {
        let mut s = ParserState::default();
        let parse = |line: &str, s: &mut ParserState| parse_line(Preset::Protocol, line.as_bytes(), s);
        assert_eq!(parse("hello", &mut s), Line::Plain);
        assert_eq!(parse("[1,2]", &mut s), Line::Plain);
        assert_eq!(
            parse(r#"{"type":"progress","message":"m","tokens":7}"#, &mut s),
            Line::Events(vec![HarnessEvent::Progress { message: "m".into(), tokens_so_far: 7 }])
        );
        assert_eq!(
            parse(r#"{"type":"tool_use","tool":"edit"}"#, &mut s),
            Line::Events(vec![HarnessEvent::ToolUse { tool: "edit".into(), tokens_so_far: 7 }])
        );
        let Line::Result(r) =
            parse(r#"{"type":"result","ok":true,"output":"o","tokens_spent":42,"resolved_model":"m1"}"#, &mut s)
        else {
            panic!("result expected");
        };
        assert!(r.ok);
        assert_eq!((r.output.as_str(), r.tokens_spent, r.resolved_model.as_str()), ("o", 42, "m1"));
    }

    #[test]
    fn clip_marks_a_cut() {
        assert_eq!(clip("abcdef", 3), "abc…");
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("éé", 1), "é…");
    }
}
