//! The word each value of a wire enum stands for: the word profiles,
//! policies and stored records spell (`claude_stream_json`, `tool_use`,
//! `agent_start`) and the CLI prints. The daemon maps its words onto the
//! wire with these tables and the CLI maps the wire back to the same words,
//! so neither depends on the enums' generated names.
//!
//! One table per enum, written once in [`words!`]: the match it generates
//! is exhaustive, so a value added to the proto without a word does not
//! compile.

use crate::pb;

/// A wire enum whose values have words. `UNSPECIFIED` has none (`""`).
pub trait Word: Copy + Eq + TryFrom<i32> + Into<i32> + 'static {
    /// Every value but `UNSPECIFIED`, in wire order.
    const ALL: &'static [Self];

    /// The word this value stands for; `""` for `UNSPECIFIED`.
    fn word(self) -> &'static str;

    /// The value of `word`; `None` for a word the enum does not have.
    fn from_word(word: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|value| value.word() == word)
    }
}

/// The value of a word the daemon wrote itself; `UNSPECIFIED` for one the
/// enum lacks (an empty word, or a record older than the enum).
pub fn wire<E: Word + Default>(word: &str) -> i32 {
    E::from_word(word).unwrap_or_default().into()
}

/// What the CLI prints for a number off the wire: its word, `""` for
/// `UNSPECIFIED` (left out like any empty field), `unknown(N)` for a value
/// this client does not know yet (a newer daemon).
pub fn shown<E: Word>(raw: i32) -> String {
    match E::try_from(raw) {
        Ok(value) => value.word().to_owned(),
        Err(_) => format!("unknown({raw})"),
    }
}

macro_rules! words {
    ($ty:ident { $($variant:ident => $word:literal),+ $(,)? }) => {
        impl Word for pb::$ty {
            const ALL: &'static [Self] = &[$(pb::$ty::$variant),+];

            fn word(self) -> &'static str {
                match self {
                    pb::$ty::Unspecified => "",
                    $(pb::$ty::$variant => $word),+
                }
            }
        }
    };
}

words!(ReinKind { Command => "command" });
words!(ReinPreset {
    Protocol => "protocol",
    ClaudeStreamJson => "claude_stream_json",
    CodexExecJson => "codex_exec_json",
});
words!(TaskInput { TaskJson => "task_json", Description => "description", Prompt => "prompt", Nothing => "nothing" });
words!(ProfileStatus { Enabled => "enabled", Disabled => "disabled" });
words!(NodeState { Active => "active", Draining => "draining", Lost => "lost", Stopped => "stopped" });
words!(PolicyKind {
    EnforceSandbox => "enforce_sandbox",
    DenyNetwork => "deny_network",
    EgressAllowlist => "egress_allowlist",
    MaxTimeout => "max_timeout",
    AllowedActors => "allowed_actors",
    AllowedRepos => "allowed_repos",
    MaxToolCalls => "max_tool_calls",
    Expr => "expr",
    RequireApproval => "require_approval",
});
words!(PolicySource { Session => "session", Profile => "profile", Admin => "admin", Builtin => "builtin" });
words!(GatePhase { AgentStart => "agent_start", ToolCall => "tool_call" });
words!(ProgressKind { Progress => "progress", ToolUse => "tool_use", Output => "output" });
words!(OutputStream { Stdout => "stdout", Stderr => "stderr", ToolOutput => "tool_output", ToolError => "tool_error" });
words!(EgressMethod { Connect => "connect", Http => "http", Gateway => "gateway" });
words!(EgressMode { None => "none", Proxy => "proxy" });
words!(LimitKind {
    Memory => "memory",
    Pids => "pids",
    Workspace => "workspace",
    Events => "events",
    EventBytes => "event_bytes",
    WorkspaceInodes => "workspace_inodes",
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact table of `E`, both ways: each word maps to its value and
    /// back, the table covers every number the enum has, and words of
    /// other things map to nothing.
    fn check<E: Word + std::fmt::Debug + Default>(expected: &[(E, &str)]) {
        let table: Vec<(E, &str)> = E::ALL.iter().map(|&v| (v, v.word())).collect();
        assert_eq!(table, expected);
        for &(value, word) in expected {
            assert_eq!(E::from_word(word), Some(value), "{word}");
            assert_eq!(wire::<E>(word), value.into(), "{word}");
            assert_eq!(shown::<E>(value.into()), word);
        }
        let numbers: Vec<i32> = (1..64).filter(|&n| E::try_from(n).is_ok()).collect();
        let listed: Vec<i32> = E::ALL.iter().map(|&v| v.into()).collect();
        assert_eq!(numbers, listed, "every value but UNSPECIFIED has a word");
        assert_eq!(E::default().word(), "");
        assert_eq!(E::from_word(""), None);
        assert_eq!(E::from_word("UNSPECIFIED"), None);
        assert_eq!(wire::<E>("no such word"), 0);
        assert_eq!(shown::<E>(0), "");
        assert_eq!(shown::<E>(99), "unknown(99)");
    }

    #[test]
    fn catalog_words() {
        check(&[(pb::ReinKind::Command, "command")]);
        check(&[
            (pb::ReinPreset::Protocol, "protocol"),
            (pb::ReinPreset::ClaudeStreamJson, "claude_stream_json"),
            (pb::ReinPreset::CodexExecJson, "codex_exec_json"),
        ]);
        check(&[
            (pb::TaskInput::TaskJson, "task_json"),
            (pb::TaskInput::Description, "description"),
            (pb::TaskInput::Prompt, "prompt"),
            (pb::TaskInput::Nothing, "nothing"),
        ]);
        check(&[(pb::ProfileStatus::Enabled, "enabled"), (pb::ProfileStatus::Disabled, "disabled")]);
    }

    #[test]
    fn policy_words() {
        check(&[
            (pb::PolicyKind::EnforceSandbox, "enforce_sandbox"),
            (pb::PolicyKind::DenyNetwork, "deny_network"),
            (pb::PolicyKind::EgressAllowlist, "egress_allowlist"),
            (pb::PolicyKind::MaxTimeout, "max_timeout"),
            (pb::PolicyKind::AllowedActors, "allowed_actors"),
            (pb::PolicyKind::AllowedRepos, "allowed_repos"),
            (pb::PolicyKind::MaxToolCalls, "max_tool_calls"),
            (pb::PolicyKind::Expr, "expr"),
            (pb::PolicyKind::RequireApproval, "require_approval"),
        ]);
        check(&[
            (pb::PolicySource::Session, "session"),
            (pb::PolicySource::Profile, "profile"),
            (pb::PolicySource::Admin, "admin"),
            (pb::PolicySource::Builtin, "builtin"),
        ]);
        check(&[(pb::GatePhase::AgentStart, "agent_start"), (pb::GatePhase::ToolCall, "tool_call")]);
    }

    #[test]
    fn event_words() {
        check(&[
            (pb::ProgressKind::Progress, "progress"),
            (pb::ProgressKind::ToolUse, "tool_use"),
            (pb::ProgressKind::Output, "output"),
        ]);
        check(&[
            (pb::OutputStream::Stdout, "stdout"),
            (pb::OutputStream::Stderr, "stderr"),
            (pb::OutputStream::ToolOutput, "tool_output"),
            (pb::OutputStream::ToolError, "tool_error"),
        ]);
        check(&[
            (pb::EgressMethod::Connect, "connect"),
            (pb::EgressMethod::Http, "http"),
            (pb::EgressMethod::Gateway, "gateway"),
        ]);
        check(&[(pb::EgressMode::None, "none"), (pb::EgressMode::Proxy, "proxy")]);
        check(&[
            (pb::LimitKind::Memory, "memory"),
            (pb::LimitKind::Pids, "pids"),
            (pb::LimitKind::Workspace, "workspace"),
            (pb::LimitKind::Events, "events"),
            (pb::LimitKind::EventBytes, "event_bytes"),
            (pb::LimitKind::WorkspaceInodes, "workspace_inodes"),
        ]);
    }

    /// The words are the gate's own: the policy kinds it compiles, in its
    /// order, and its phases. (The profile's enums: `convert`'s tests.)
    #[test]
    fn words_are_the_gates_own() {
        let known: Vec<&str> = crate::policy::KNOWN_KINDS.split(", ").collect();
        let words: Vec<&str> = pb::PolicyKind::ALL.iter().map(|k| k.word()).collect();
        assert_eq!(words, known);
        for phase in [crate::policy::Phase::AgentStart, crate::policy::Phase::ToolCall] {
            assert!(pb::GatePhase::from_word(phase.as_str()).is_some(), "{phase:?}");
        }
    }
}
