//! The pure parts of the agents' pre-tool hooks: the managed settings
//! corral writes for each CLI, the call a hook reports (untrusted: typed
//! and bounded here), and the answer the CLI understands.
//!
//! Both CLIs send the same shape (`hook_event_name`, `tool_name`,
//! `tool_input`, `tool_use_id`, ...) and read the same answer: a
//! `hookSpecificOutput` with `permissionDecision: "deny"` blocks the call
//! and hands its reason to the model. corral's *allow* answers `{}`: no
//! objection, so the CLI's own permission rules (Claude Code's
//! `--allowedTools`) still apply; an explicit `"allow"` would bypass them.

use std::path::Path;

use serde_json::{json, Value};

use super::{GATE_PORT, HELPER_PATH, HOOK_PATH};
use crate::catalog::Preset;
pub use crate::catalog::{CLAUDE_MANAGED_SETTINGS, CODEX_REQUIREMENTS};
use crate::sandbox::{GateFile, GateSource};

/// The longest tool name kept; a longer one is refused.
pub const MAX_TOOL_NAME: usize = 200;
/// The longest call id kept; a longer one is refused.
pub const MAX_CALL_ID: usize = 200;
/// The most JSON values a hook's body may hold; more is refused. A tool's
/// input is mostly strings (a `Write` carries its whole file as one), so a
/// real call holds few values; but each value parsed takes tens of bytes,
/// so a body as large as the endpoint reads, made of `0,`, would take
/// hundreds of MiB.
pub const MAX_VALUES: usize = 100_000;

/// What the CLI sends to reach the gate endpoint directly: a `host:port`
/// entry in `NO_PROXY` (the proxy would refuse a loopback CONNECT).
pub fn no_proxy_entry() -> String {
    format!("127.0.0.1:{GATE_PORT}")
}

/// The URL Claude Code's `http` hook posts to.
pub fn endpoint_url() -> String {
    format!("http://127.0.0.1:{GATE_PORT}{HOOK_PATH}")
}

/// The files that install corral's hook in `preset`'s managed layer, for a
/// run of at most `timeout_seconds` (a hook may wait that long for an
/// approval). `helper` is the host path of the hook helper (the corral
/// binary), which Codex needs. `Ok(None)`: this harness has no hook.
pub fn managed_files(
    preset: Preset,
    timeout_seconds: u64,
    helper: Option<&Path>,
) -> Result<Option<Vec<GateFile>>, String> {
    let timeout = timeout_seconds.max(1);
    match preset {
        Preset::Protocol => Ok(None),
        Preset::ClaudeStreamJson => {
            let settings = claude_settings(timeout);
            Ok(Some(vec![GateFile {
                inside: CLAUDE_MANAGED_SETTINGS.into(),
                source: GateSource::Contents(format!("{settings:#}\n").into_bytes()),
            }]))
        }
        Preset::CodexExecJson => {
            let helper = helper.ok_or_else(|| {
                "Codex's hook is a program and the daemon has no hook helper (set [gate] hook_program to the \
                 corral binary)"
                    .to_string()
            })?;
            Ok(Some(vec![
                GateFile {
                    inside: CODEX_REQUIREMENTS.into(),
                    source: GateSource::Contents(codex_requirements(timeout).into_bytes()),
                },
                GateFile { inside: HELPER_PATH.into(), source: GateSource::Host(helper.to_path_buf()) },
            ]))
        }
    }
}

/// Managed hooks only, one `http` hook on every tool, blocking when the
/// endpoint cannot be reached.
pub fn claude_settings(timeout_seconds: u64) -> Value {
    json!({
        "allowManagedHooksOnly": true,
        "hooks": {
            "PreToolUse": [{
                "matcher": "*",
                "hooks": [{
                    "type": "http",
                    "url": endpoint_url(),
                    "timeout": timeout_seconds,
                    "onFailure": "block",
                }],
            }],
        },
    })
}

/// Managed hooks only, hooks on, one command hook on every tool (no
/// matcher: Codex reads a matcher as a regular expression, and without one
/// the hook applies to every tool); and no hosted web search, which runs
/// at the model provider and so past any pre-tool hook (verified with
/// Codex 0.171.0: the requirement alone takes `web_search` out of the
/// tools it offers the model, over a `web_search = "live"` in its config).
pub fn codex_requirements(timeout_seconds: u64) -> String {
    format!(
        "# Written by corral: every tool call asks corral's gate first.\n\
         allow_managed_hooks_only = true\n\
         allowed_web_search_modes = [\"disabled\"]\n\n\
         [features]\n\
         hooks = true\n\n\
         [[hooks.PreToolUse]]\n\n\
         [[hooks.PreToolUse.hooks]]\n\
         type = \"command\"\n\
         command = \"{HELPER_PATH}\"\n\
         timeout = {timeout_seconds}\n"
    )
}

/// One tool call as a hook reported it.
#[derive(Clone, Debug, PartialEq)]
pub struct HookCall {
    /// The agent's own tool name: `Bash`, `Write`, `mcp__server__tool`, ...
    pub tool: String,
    /// The tool's input (always an object).
    pub arguments: Value,
    /// The agent's id of the call (`tool_use_id`); may be empty.
    pub call_id: String,
}

/// Reads a hook's body. Anything but a well-formed `PreToolUse` call with
/// a plain tool name is an error, which the endpoint answers with a deny.
pub fn parse_call(body: &[u8]) -> Result<HookCall, String> {
    if values_in(body) > MAX_VALUES {
        return Err(format!("the hook's body holds more than {MAX_VALUES} JSON values"));
    }
    let mut value: Value = serde_json::from_slice(body).map_err(|e| format!("the hook's body is not JSON: {e}"))?;
    let event = value.get("hook_event_name").and_then(Value::as_str).unwrap_or_default();
    if event != "PreToolUse" {
        return Err(format!("hook_event_name must be PreToolUse, not {:?}", clip(event, 40)));
    }
    let tool = value.get("tool_name").and_then(Value::as_str).unwrap_or_default();
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-.:/@".contains(c);
    if tool.is_empty() || tool.len() > MAX_TOOL_NAME || !tool.chars().all(plain) {
        return Err(format!(
            "tool_name must be 1 to {MAX_TOOL_NAME} letters, digits or _-.:/@, not {:?}",
            clip(tool, 40)
        ));
    }
    let tool = tool.to_string();
    let arguments = match value.get_mut("tool_input").map(Value::take) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(input @ Value::Object(_)) => input,
        Some(_) => return Err("tool_input must be an object".into()),
    };
    let call_id = value.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
    if call_id.len() > MAX_CALL_ID || call_id.chars().any(|c| c.is_control()) {
        return Err(format!("tool_use_id must be at most {MAX_CALL_ID} printable characters"));
    }
    Ok(HookCall { tool, arguments, call_id: call_id.to_string() })
}

/// About how many JSON values `body` holds, counted without parsing it:
/// each `[`, `{` and `,` outside a string starts one.
fn values_in(body: &[u8]) -> usize {
    let (mut count, mut in_string, mut escaped) = (0, false, false);
    for &byte in body {
        if escaped {
            escaped = false;
        } else if in_string {
            match byte {
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match byte {
                b'"' => in_string = true,
                b'[' | b'{' | b',' => count += 1,
                _ => {}
            }
        }
    }
    count
}

fn clip(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// The gate's answer to one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the tool call may run.
    pub allow: bool,
    /// For a deny: what the model is told.
    pub reason: String,
}

impl Verdict {
    /// A verdict that lets the call run.
    pub fn allow() -> Verdict {
        Verdict { allow: true, reason: String::new() }
    }

    /// A verdict that blocks the call, telling the model `reason`.
    pub fn deny(reason: impl Into<String>) -> Verdict {
        Verdict { allow: false, reason: reason.into() }
    }

    /// The hook's answer body.
    pub fn answer(&self) -> Value {
        if self.allow {
            return json!({});
        }
        json!({"hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": self.reason,
        }})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_bound_are_the_ones_the_profile_check_keeps_clear() {
        // The catalog refuses read and write paths over
        // `Preset::managed_hook_paths`; these are what is bound.
        let helper = Path::new("/usr/bin/corral");
        for preset in [Preset::Protocol, Preset::ClaudeStreamJson, Preset::CodexExecJson] {
            let bound: Vec<String> = managed_files(preset, 1, Some(helper))
                .unwrap()
                .unwrap_or_default()
                .into_iter()
                .map(|f| f.inside)
                .collect();
            assert_eq!(bound, preset.managed_hook_paths(), "{preset:?}");
        }
        assert_eq!(
            Preset::CodexExecJson.managed_hook_paths(),
            ["/etc/codex/requirements.toml", "/etc/corral/corral-gate-hook"]
        );
    }

    #[test]
    fn claude_gets_one_blocking_http_hook_and_managed_hooks_only() {
        assert_eq!(
            claude_settings(600),
            json!({"allowManagedHooksOnly": true, "hooks": {"PreToolUse": [{"matcher": "*", "hooks": [
                {"type": "http", "url": "http://127.0.0.1:3129/v1/pre-tool-use", "timeout": 600,
                 "onFailure": "block"}]}]}})
        );
        let files = managed_files(Preset::ClaudeStreamJson, 0, None).unwrap().unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].inside, "/etc/claude-code/managed-settings.json");
        let GateSource::Contents(text) = &files[0].source else { panic!("contents") };
        let written: Value = serde_json::from_slice(text).unwrap();
        assert_eq!(written["hooks"]["PreToolUse"][0]["hooks"][0]["timeout"], 1, "never a zero timeout");
        assert_eq!(no_proxy_entry(), "127.0.0.1:3129");
    }

    #[test]
    fn codex_gets_its_requirements_and_the_helper_or_nothing() {
        let parsed: toml::Table = toml::from_str(&codex_requirements(300)).unwrap();
        assert_eq!(parsed["allow_managed_hooks_only"].as_bool(), Some(true));
        assert_eq!(parsed["allowed_web_search_modes"].as_array(), Some(&vec!["disabled".into()]));
        assert_eq!(parsed["features"]["hooks"].as_bool(), Some(true));
        let hook = &parsed["hooks"]["PreToolUse"][0]["hooks"][0];
        assert_eq!(hook["type"].as_str(), Some("command"));
        assert_eq!(hook["command"].as_str(), Some("/etc/corral/corral-gate-hook"));
        assert_eq!(hook["timeout"].as_integer(), Some(300));
        let helper = Path::new("/usr/bin/corral");
        let files = managed_files(Preset::CodexExecJson, 300, Some(helper)).unwrap().unwrap();
        let inside: Vec<&str> = files.iter().map(|f| f.inside.as_str()).collect();
        assert_eq!(inside, ["/etc/codex/requirements.toml", "/etc/corral/corral-gate-hook"]);
        assert_eq!(files[1].source, GateSource::Host(helper.into()));
        let err = managed_files(Preset::CodexExecJson, 300, None).unwrap_err();
        assert!(err.contains("hook_program"), "{err}");
        assert_eq!(managed_files(Preset::Protocol, 300, None).unwrap(), None);
    }

    #[test]
    fn a_call_is_typed_and_bounded() {
        let body = br#"{"session_id":"s","hook_event_name":"PreToolUse","tool_name":"Bash",
            "tool_input":{"command":"ls"},"tool_use_id":"toolu_1"}"#;
        assert_eq!(
            parse_call(body).unwrap(),
            HookCall { tool: "Bash".into(), arguments: json!({"command": "ls"}), call_id: "toolu_1".into() }
        );
        let mcp = br#"{"hook_event_name":"PreToolUse","tool_name":"mcp__git__commit"}"#;
        assert_eq!(parse_call(mcp).unwrap().arguments, json!({}));
        for (body, why) in [
            (&b"not json"[..], "not JSON"),
            (br#"{"hook_event_name":"PostToolUse","tool_name":"Bash"}"#, "PreToolUse"),
            (br#"{"hook_event_name":"PreToolUse","tool_name":""}"#, "tool_name"),
            (br#"{"hook_event_name":"PreToolUse","tool_name":"Ba sh"}"#, "tool_name"),
            (br#"{"hook_event_name":"PreToolUse","tool_name":"Bash\u0007"}"#, "tool_name"),
            (br#"{"hook_event_name":"PreToolUse","tool_name":"Bash","tool_input":"ls"}"#, "object"),
            (br#"{"hook_event_name":"PreToolUse","tool_name":"Bash","tool_use_id":"a\nb"}"#, "tool_use_id"),
        ] {
            let err = parse_call(body).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
        let long = format!(r#"{{"hook_event_name":"PreToolUse","tool_name":"{}"}}"#, "x".repeat(201));
        assert!(parse_call(long.as_bytes()).is_err());
    }

    #[test]
    fn a_body_of_many_values_is_refused_and_one_of_big_strings_is_not() {
        let zeros = vec!["0"; 1_000_000].join(",");
        let body = format!(r#"{{"hook_event_name":"PreToolUse","tool_name":"Bash","tool_input":{{"a":[{zeros}]}}}}"#);
        let err = parse_call(body.as_bytes()).unwrap_err();
        assert!(err.contains("JSON values"), "{err}");
        // A `Write` of a 1 MiB file full of what would be values outside a
        // string, between escaped quotes and backslashes, is a few values.
        let content = r#"{[\",\\,"#.repeat((1 << 20) / 6);
        let body = format!(
            r#"{{"hook_event_name":"PreToolUse","tool_name":"Write","tool_input":{{"file_path":"/w/a","content":"{content}"}}}}"#
        );
        let call = parse_call(body.as_bytes()).unwrap();
        assert_eq!(call.arguments["content"].as_str().unwrap().len(), (1 << 20) / 6 * 6);
        let edits = vec![r#"{"old_string":"a","new_string":"b"}"#; 1_000].join(",");
        let body =
            format!(r#"{{"hook_event_name":"PreToolUse","tool_name":"MultiEdit","tool_input":{{"edits":[{edits}]}}}}"#);
        assert!(parse_call(body.as_bytes()).is_ok(), "a thousand edits are far from the bound");
    }

    #[test]
    fn answers() {
        assert_eq!(Verdict::allow().answer(), json!({}));
        assert_eq!(
            Verdict::deny("denied by policy no-bash: not here").answer(),
            json!({"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                   "permissionDecisionReason": "denied by policy no-bash: not here"}})
        );
    }
}
