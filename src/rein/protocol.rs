//! The JSON-lines harness protocol, and the presets that map real
//! harnesses' stream formats onto it.
//!
//! corral's own protocol, one JSON object per line on stdout:
//! `{"type":"progress","message":"...","tokens":12}`,
//! `{"type":"tool_use","tool":"edit_file",...}`, and a final
//! `{"type":"result","ok":true,"output":"...","tokens_spent":123,"resolved_model":"..."}`.
//! Any other line is plain output.

use serde_json::Value;

use super::{HarnessEvent, ToolResult};
use crate::catalog::Preset;

/// What one stdout line means.
#[derive(Debug, PartialEq)]
pub enum Line {
    Plain,
    Event(HarnessEvent),
    Result(ToolResult),
    /// `{"type":"policy_request","id":..,"tool":..,"arguments":..}`: the
    /// harness asks the tool_call gate before using a tool.
    PolicyRequest {
        id: Value,
        tool: String,
        arguments: Value,
    },
    /// A protocol line with nothing to report (e.g. Claude's `system`).
    Ignored,
}

/// Per-stream state some presets need (the model, tokens so far, the last
/// agent message).
#[derive(Debug, Default)]
pub struct ParserState {
    pub tokens: u64,
    pub model: String,
    pub last_message: String,
}

pub fn parse_line(preset: Preset, line: &[u8], state: &mut ParserState) -> Line {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(line) else {
        return Line::Plain;
    };
    let Some(kind) = obj.get("type").and_then(Value::as_str) else {
        return Line::Plain;
    };
    let obj = Value::Object(obj.clone());
    match preset {
        Preset::Protocol => protocol(kind, &obj, state),
        Preset::ClaudeStreamJson => claude(kind, &obj, state),
        Preset::CodexExecJson => codex(kind, &obj, state),
    }
}

fn str_of(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or_default().to_string()
}

fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn protocol(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    match kind {
        "progress" => {
            if let Some(tokens) = u64_of(v, "tokens") {
                state.tokens = tokens;
            }
            Line::Event(HarnessEvent::Progress { message: str_of(v, "message"), tokens_so_far: state.tokens })
        }
        "tool_use" => Line::Event(HarnessEvent::ToolUse { tool: str_of(v, "tool"), tokens_so_far: state.tokens }),
        "result" => Line::Result(ToolResult {
            ok: v.get("ok").and_then(Value::as_bool).unwrap_or(false),
            output: str_of(v, "output"),
            error: str_of(v, "error"),
            tokens_spent: u64_of(v, "tokens_spent").unwrap_or(state.tokens),
            resolved_model: str_of(v, "resolved_model"),
        }),
        "policy_request" => Line::PolicyRequest {
            id: v.get("id").cloned().unwrap_or(Value::Null),
            tool: str_of(v, "tool"),
            arguments: v.get("arguments").cloned().unwrap_or(Value::Null),
        },
        _ => Line::Plain,
    }
}

/// Claude Code `-p --output-format stream-json --verbose`.
fn claude(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    match kind {
        "system" => {
            state.model = str_of(v, "model");
            Line::Ignored
        }
        "assistant" => {
            let message = v.get("message").cloned().unwrap_or_default();
            if let Some(usage) = message.get("usage") {
                let used = u64_of(usage, "input_tokens").unwrap_or(0) + u64_of(usage, "output_tokens").unwrap_or(0);
                state.tokens += used;
            }
            let content = message.get("content").and_then(Value::as_array).cloned().unwrap_or_default();
            for part in &content {
                if part.get("type").and_then(Value::as_str) == Some("tool_use") {
                    return Line::Event(HarnessEvent::ToolUse {
                        tool: str_of(part, "name"),
                        tokens_so_far: state.tokens,
                    });
                }
            }
            let text: Vec<String> = content.iter().map(|p| str_of(p, "text")).filter(|t| !t.is_empty()).collect();
            Line::Event(HarnessEvent::Progress { message: text.join("\n"), tokens_so_far: state.tokens })
        }
        "result" => {
            let usage = v.get("usage").cloned().unwrap_or_default();
            let tokens = u64_of(&usage, "input_tokens").unwrap_or(0) + u64_of(&usage, "output_tokens").unwrap_or(0);
            let is_error = v.get("is_error").and_then(Value::as_bool).unwrap_or(true);
            let model = v
                .get("modelUsage")
                .and_then(Value::as_object)
                .and_then(|m| m.keys().next().cloned())
                .unwrap_or_else(|| state.model.clone());
            Line::Result(ToolResult {
                ok: !is_error,
                output: str_of(v, "result"),
                error: if is_error { str_of(v, "subtype") } else { String::new() },
                tokens_spent: if tokens > 0 { tokens } else { state.tokens },
                resolved_model: model,
            })
        }
        _ => Line::Ignored,
    }
}

/// Codex `exec --json`.
fn codex(kind: &str, v: &Value, state: &mut ParserState) -> Line {
    let item = v.get("item").cloned().unwrap_or_default();
    let item_type = item.get("type").and_then(Value::as_str).unwrap_or_default();
    match (kind, item_type) {
        ("item.started", "command_execution") => {
            Line::Event(HarnessEvent::ToolUse { tool: "shell".into(), tokens_so_far: state.tokens })
        }
        ("item.started", "mcp_tool_call") => {
            Line::Event(HarnessEvent::ToolUse { tool: str_of(&item, "tool"), tokens_so_far: state.tokens })
        }
        ("item.completed", "agent_message") => {
            state.last_message = str_of(&item, "text");
            Line::Event(HarnessEvent::Progress { message: state.last_message.clone(), tokens_so_far: state.tokens })
        }
        ("turn.completed", _) => {
            let usage = v.get("usage").cloned().unwrap_or_default();
            state.tokens += u64_of(&usage, "input_tokens").unwrap_or(0) + u64_of(&usage, "output_tokens").unwrap_or(0);
            Line::Result(ToolResult {
                ok: true,
                output: state.last_message.clone(),
                error: String::new(),
                tokens_spent: state.tokens,
                resolved_model: state.model.clone(),
            })
        }
        ("turn.failed", _) | ("error", _) => {
            let error = v.get("error").map(|e| str_of(e, "message")).unwrap_or_else(|| str_of(v, "message"));
            Line::Result(ToolResult { ok: false, error, tokens_spent: state.tokens, ..ToolResult::default() })
        }
        _ => Line::Ignored,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(preset: Preset, line: &str, state: &mut ParserState) -> Line {
        parse_line(preset, line.as_bytes(), state)
    }

    #[test]
    fn protocol_lines() {
        let mut s = ParserState::default();
        assert_eq!(parse(Preset::Protocol, "hello", &mut s), Line::Plain);
        assert_eq!(parse(Preset::Protocol, "[1,2]", &mut s), Line::Plain);
        assert_eq!(
            parse(Preset::Protocol, r#"{"type":"progress","message":"m","tokens":7}"#, &mut s),
            Line::Event(HarnessEvent::Progress { message: "m".into(), tokens_so_far: 7 })
        );
        assert_eq!(
            parse(Preset::Protocol, r#"{"type":"tool_use","tool":"edit"}"#, &mut s),
            Line::Event(HarnessEvent::ToolUse { tool: "edit".into(), tokens_so_far: 7 })
        );
        let Line::Result(r) = parse(
            Preset::Protocol,
            r#"{"type":"result","ok":true,"output":"o","tokens_spent":42,"resolved_model":"m1"}"#,
            &mut s,
        ) else {
            panic!("result expected");
        };
        assert!(r.ok);
        assert_eq!((r.output.as_str(), r.tokens_spent, r.resolved_model.as_str()), ("o", 42, "m1"));
    }

    #[test]
    fn claude_stream_json() {
        let mut s = ParserState::default();
        assert_eq!(
            parse(Preset::ClaudeStreamJson, r#"{"type":"system","subtype":"init","model":"claude-x"}"#, &mut s),
            Line::Ignored
        );
        assert_eq!(
            parse(
                Preset::ClaudeStreamJson,
                r#"{"type":"assistant","message":{"content":[{"type":"tool_use","name":"Bash"}],"usage":{"input_tokens":3,"output_tokens":2}}}"#,
                &mut s
            ),
            Line::Event(HarnessEvent::ToolUse { tool: "Bash".into(), tokens_so_far: 5 })
        );
        let Line::Result(r) = parse(
            Preset::ClaudeStreamJson,
            r#"{"type":"result","subtype":"success","is_error":false,"result":"fixed","usage":{"input_tokens":10,"output_tokens":4}}"#,
            &mut s,
        ) else {
            panic!("result expected");
        };
        assert_eq!(
            (r.ok, r.output.as_str(), r.tokens_spent, r.resolved_model.as_str()),
            (true, "fixed", 14, "claude-x")
        );
    }

    #[test]
    fn codex_exec_json() {
        let mut s = ParserState::default();
        assert_eq!(
            parse(
                Preset::CodexExecJson,
                r#"{"type":"item.started","item":{"type":"command_execution","command":"ls"}}"#,
                &mut s
            ),
            Line::Event(HarnessEvent::ToolUse { tool: "shell".into(), tokens_so_far: 0 })
        );
        parse(
            Preset::CodexExecJson,
            r#"{"type":"item.completed","item":{"type":"agent_message","text":"all done"}}"#,
            &mut s,
        );
        let Line::Result(r) = parse(
            Preset::CodexExecJson,
            r#"{"type":"turn.completed","usage":{"input_tokens":8,"output_tokens":2}}"#,
            &mut s,
        ) else {
            panic!("result expected");
        };
        assert_eq!((r.ok, r.output.as_str(), r.tokens_spent), (true, "all done", 10));
    }
}
