//! Human rendering of events and execution records: pure functions from
//! messages to text, so that the exact output can be tested.

use std::fmt::Write as _;

use prost_types::Timestamp;

use crate::api::words::shown;
use crate::pb;
use crate::pb::lifecycle_event::Kind;
use crate::types::{rfc3339, Fraction};

const NANOS_PER_SECOND: i128 = 1_000_000_000;

/// RFC 3339 in UTC, with the fraction protobuf JSON uses (none, 3, 6 or 9
/// digits), e.g. `2023-11-14T22:13:20.500Z`.
pub(super) fn timestamp(ts: &Timestamp) -> String {
    // Out-of-range nanos come from a sloppy peer; fold them into seconds
    // rather than print a nonsense fraction.
    let nanos = i128::from(ts.seconds) * NANOS_PER_SECOND + i128::from(ts.nanos);
    let fraction = match nanos.rem_euclid(NANOS_PER_SECOND) {
        0 => Fraction::None,
        n if n % 1_000_000 == 0 => Fraction::Millis,
        n if n % 1_000 == 0 => Fraction::Micros,
        _ => Fraction::Nanos,
    };
    rfc3339(nanos, fraction)
}

/// A timestamp to the second, for table columns that should line up.
pub(super) fn timestamp_seconds(ts: Option<&Timestamp>) -> String {
    match ts {
        Some(ts) => timestamp(&Timestamp { seconds: ts.seconds, nanos: 0 }),
        None => "-".to_owned(),
    }
}

/// `EXECUTION_STATE_SUCCEEDED` -> `succeeded`; values this client does not
/// know yet (a newer daemon) print as `unknown(N)`.
fn short(name: Option<&str>, prefix: &str, raw: i32) -> String {
    match name {
        Some(name) => name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase(),
        None => format!("unknown({raw})"),
    }
}

macro_rules! enum_namer {
    ($fn_name:ident, $ty:ty, $prefix:literal) => {
        pub(super) fn $fn_name(raw: i32) -> String {
            short(<$ty>::try_from(raw).ok().map(|v| v.as_str_name()), $prefix, raw)
        }
    };
}

enum_namer!(state, pb::ExecutionState, "EXECUTION_STATE_");
enum_namer!(outcome, pb::Outcome, "OUTCOME_");
enum_namer!(failure_stage, pb::FailureStage, "FAILURE_STAGE_");
enum_namer!(teardown, pb::TeardownResult, "TEARDOWN_RESULT_");
enum_namer!(gate_action, pb::GateAction, "GATE_ACTION_");
enum_namer!(sandbox_type, pb::SandboxType, "SANDBOX_TYPE_");
enum_namer!(readiness_state, pb::ReadinessState, "READINESS_STATE_");
enum_namer!(hub_status, pb::HubReportStatus, "HUB_REPORT_STATUS_");

/// A value safe to put on one terminal line: plain words go as they are,
/// anything with spaces, quotes or control characters is quoted and
/// escaped, so a harness message cannot break the line or send escape
/// sequences to the terminal.
pub(super) fn quote(value: &str) -> String {
    let plain = value.chars().all(|c| !c.is_whitespace() && !c.is_control() && c != '"' && c != '\\');
    if plain && !value.is_empty() {
        value.to_owned()
    } else {
        format!("{value:?}")
    }
}

/// `key=value` pairs of one line; empty values are left out, since proto3
/// cannot tell them from unset ones.
#[derive(Default)]
struct Facts(Vec<String>);

impl Facts {
    fn add(&mut self, key: &str, value: impl AsRef<str>) -> &mut Self {
        let value = value.as_ref();
        if !value.is_empty() {
            self.0.push(format!("{key}={}", quote(value)));
        }
        self
    }
}

/// `readiness` as `state` or `state (reason)`.
pub(super) fn readiness(readiness: Option<&pb::Readiness>) -> String {
    match readiness {
        None => String::new(),
        Some(r) if r.reason.is_empty() => readiness_state(r.state),
        Some(r) => format!("{} ({})", readiness_state(r.state), r.reason),
    }
}

/// One line per event: sequence, time, kind, then the facts that matter.
pub(super) fn event_line(event: &pb::LifecycleEvent) -> String {
    let mut facts = Facts::default();
    let kind = match &event.kind {
        None => "unknown",
        Some(Kind::Accepted(a)) => {
            facts.add("execution", &a.execution_id).add("session", &a.session_id);
            facts.add("request", &a.request_id);
            if let Some(c) = &a.consumer {
                facts.add("actor", &c.actor).add("project", &c.project);
            }
            "accepted"
        }
        Some(Kind::Resolved(r)) => {
            facts.add("profile", &r.profile_ref);
            facts.add("readiness", readiness(r.readiness.as_ref()));
            "resolved"
        }
        Some(Kind::Gated(g)) => {
            facts.add("phase", shown::<pb::GatePhase>(g.phase));
            if !g.tool.is_empty() {
                facts.add("tool", &g.tool);
            }
            facts.add("action", gate_action(g.action));
            if let Some(sandbox) = &g.effective_sandbox {
                facts.add("sandbox", sandbox_type(sandbox.r#type));
                facts.add("network", if sandbox.allow_network { "allowed" } else { "denied" });
            }
            // A denial is only actionable with the policy that said no.
            for d in &g.decisions {
                if d.action == pb::GateAction::Deny as i32 {
                    facts.add("denied_by", format!("{}: {}", d.policy, d.reason));
                }
            }
            "gated"
        }
        Some(Kind::SandboxReady(s)) => {
            facts.add("sandbox", &s.sandbox_id).add("backend", sandbox_type(s.backend));
            facts.add("workspace", &s.workspace_path);
            if let Some(receipt) = &s.receipt {
                facts.add("network_isolated", receipt.network_isolated.to_string());
                if receipt.egress == pb::EgressMode::Proxy as i32 {
                    facts.add("egress", format!("proxy to [{}]", receipt.allow_hosts.join(", ")));
                }
                facts.add("host_uid", receipt.host_uid.to_string());
                if !receipt.seccomp_digest.is_empty() {
                    facts.add("seccomp", &receipt.seccomp_digest);
                }
                for limit in &receipt.limits {
                    facts.add(&limit.name, format!("{} ({})", limit.value, limit.mechanism));
                }
            }
            "sandbox_ready"
        }
        Some(Kind::Dispatched(d)) => {
            facts.add("tool", &d.tool);
            "dispatched"
        }
        Some(Kind::Progress(p)) => {
            facts.add("kind", shown::<pb::ProgressKind>(p.kind)).add("tool", &p.tool);
            facts.add("tokens", p.tokens_so_far.to_string()).add("message", &p.message);
            "progress"
        }
        Some(Kind::OutputTruncated(t)) => {
            facts.add("stream", shown::<pb::OutputStream>(t.stream));
            facts.add("bytes_dropped", t.bytes_dropped.to_string());
            "output_truncated"
        }
        Some(Kind::Teardown(t)) => {
            facts.add("session_cleanup", teardown(t.session_cleanup));
            facts.add("sandbox_destroy", teardown(t.sandbox_destroy));
            "teardown"
        }
        Some(Kind::Finished(f)) => {
            finished_facts(f, &mut facts);
            "finished"
        }
        Some(Kind::HarnessRestarted(r)) => {
            facts.add("attempt", r.attempt.to_string()).add("reason", &r.reason);
            "harness_restarted"
        }
        Some(Kind::TurnFinished(t)) => {
            facts.add("turn", t.turn.to_string()).add("tool", &t.tool).add("ok", t.ok.to_string());
            facts.add("error", &t.error).add("tokens", t.tokens_spent.to_string());
            facts.add("output", &t.output).add("raw_error", &t.raw_error);
            "turn_finished"
        }
        Some(Kind::Reaped(r)) => {
            facts.add("idle_seconds", r.idle_seconds.to_string());
            "reaped"
        }
        Some(Kind::Recovered(r)) => {
            facts.add("note", &r.note);
            "recovered"
        }
        Some(Kind::Egress(e)) => {
            facts.add("host", format!("{}:{}", e.host, e.port));
            facts.add(if e.allowed { "allowed" } else { "denied" }, &e.rule_or_reason);
            "egress"
        }
        Some(Kind::Limit(l)) => {
            facts.add("limit", shown::<pb::LimitKind>(l.limit)).add("value", l.value.to_string());
            facts.add("detail", &l.detail);
            "limit"
        }
        Some(Kind::ApprovalRequested(a)) => {
            facts.add("call", &a.call_id).add("tool", &a.tool).add("arguments", &a.summary);
            facts.add("expires", timestamp_seconds(a.expires_at.as_ref()));
            // How to decide it, for the person watching.
            let id = &event.subject_id;
            facts.add("decide", format!("corral approve {id} {0} | corral deny {id} {0} --reason TEXT", a.call_id));
            "approval_requested"
        }
        Some(Kind::ApprovalDecided(d)) => {
            facts.add("call", &d.call_id).add("action", if d.allow { "allow" } else { "deny" });
            facts.add("by", &d.decided_by).add("reason", &d.reason);
            "approval_decided"
        }
    };
    let time = match &event.time {
        Some(ts) => timestamp(ts),
        None => "-".to_owned(),
    };
    let mut line = format!("#{} {time} {kind}", event.sequence);
    for fact in &facts.0 {
        line.push(' ');
        line.push_str(fact);
    }
    line
}

/// One line for a session record.
pub(super) fn session_line(session: &pb::Session) -> String {
    let mut facts = Facts::default();
    facts.add("state", session_state(session.state)).add("profile", &session.profile_ref);
    facts.add("turns", session.turns.to_string()).add("repo", &session.repo);
    if let Some(ev) = &session.evidence {
        facts.add("class", &ev.failure_class);
    }
    let mut line = format!("session {}", session.session_id);
    for fact in &facts.0 {
        line.push(' ');
        line.push_str(fact);
    }
    line.push('\n');
    line
}

fn session_state(value: i32) -> String {
    pb::SessionState::try_from(value)
        .map(|s| s.as_str_name().trim_start_matches("SESSION_STATE_").to_ascii_lowercase())
        .unwrap_or_else(|_| value.to_string())
}

fn finished_facts(finished: &pb::Finished, facts: &mut Facts) {
    use pb::finished::Record;
    let evidence = match &finished.record {
        Some(Record::Execution(e)) => {
            facts.add("state", state(e.state));
            e.evidence.as_ref()
        }
        Some(Record::Session(s)) => {
            facts.add("session", &s.session_id).add("state", session_state(s.state));
            s.evidence.as_ref()
        }
        None => None,
    };
    if let Some(ev) = evidence {
        facts.add("outcome", outcome(ev.outcome));
        if ev.failure_stage != pb::FailureStage::Unspecified as i32 {
            facts.add("failure_stage", failure_stage(ev.failure_stage));
            facts.add("class", &ev.failure_class);
        }
        facts.add("error", &ev.error);
        // A run with a workspace always says what came back of it.
        let commit = if ev.commit_sha.is_empty() { "none (no changes)".to_string() } else { ev.commit_sha.clone() };
        if !ev.sandbox_id.is_empty() {
            facts.add("commit", commit);
        }
        facts.add("tokens", ev.tokens_spent.to_string());
    }
}

/// The raw harness output and error a `finished` event carries on the
/// direct caller's stream, printed verbatim after the event line; empty
/// when there is none.
/// The raw output and error of a finished execution; the output is left
/// out when its lines were shown live already.
pub(super) fn raw_outputs(finished: &pb::Finished, output_shown: bool) -> String {
    match &finished.record {
        Some(pb::finished::Record::Execution(e)) => {
            raw_block(if output_shown { "" } else { &e.tool_output }, &e.tool_error)
        }
        _ => String::new(),
    }
}

pub(super) fn raw_block(tool_output: &str, tool_error: &str) -> String {
    let mut out = String::new();
    for (title, text) in [("tool output", tool_output), ("tool error", tool_error)] {
        if text.is_empty() {
            continue;
        }
        let _ = writeln!(out, "--- {title} ---");
        out.push_str(text);
        if !text.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(seconds: i64, nanos: i32) -> String {
        timestamp(&Timestamp { seconds, nanos })
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(ts(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(ts(1_700_000_000, 0), "2023-11-14T22:13:20Z");
        assert_eq!(ts(951_782_400, 0), "2000-02-29T00:00:00Z");
        assert_eq!(ts(253_402_300_799, 0), "9999-12-31T23:59:59Z");
        assert_eq!(ts(-1, 0), "1969-12-31T23:59:59Z");
        assert_eq!(ts(0, 500_000_000), "1970-01-01T00:00:00.500Z");
        assert_eq!(ts(0, 1_000), "1970-01-01T00:00:00.000001Z");
        assert_eq!(ts(0, 1), "1970-01-01T00:00:00.000000001Z");
        assert_eq!(ts(0, -500_000_000), "1969-12-31T23:59:59.500Z");
        // Extreme values from a broken peer must not panic.
        let _ = ts(i64::MAX, i32::MAX);
        let _ = ts(i64::MIN, i32::MIN);
    }

    #[test]
    fn progress_messages_stay_on_one_line() {
        let event = pb::LifecycleEvent {
            subject_id: "e1".into(),
            sequence: 7,
            time: Some(Timestamp { seconds: 1_700_000_000, nanos: 0 }),
            kind: Some(Kind::Progress(pb::Progress {
                kind: pb::ProgressKind::ToolUse as i32,
                tool: "Bash".into(),
                tokens_so_far: 1200,
                message: "ran tests\n\u{1b}[31mok".into(),
            })),
        };
        assert_eq!(
            event_line(&event),
            r#"#7 2023-11-14T22:13:20Z progress kind=tool_use tool=Bash tokens=1200 message="ran tests\n\u{1b}[31mok""#
        );
    }

    #[test]
    fn finished_line_carries_the_verdict_and_raw_output_follows() {
        let finished = pb::Finished {
            record: Some(pb::finished::Record::Execution(pb::Execution {
                state: pb::ExecutionState::Failed as i32,
                tool_output: "partial".into(),
                tool_error: "boom\n".into(),
                evidence: Some(pb::Evidence {
                    outcome: pb::Outcome::Failed as i32,
                    failure_stage: pb::FailureStage::Execution as i32,
                    error: "the harness failed".into(),
                    tokens_spent: 42,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        };
        let event = pb::LifecycleEvent {
            sequence: 9,
            kind: Some(Kind::Finished(Box::new(finished.clone()))),
            ..Default::default()
        };
        assert_eq!(
            event_line(&event),
            r#"#9 - finished state=failed outcome=failed failure_stage=execution error="the harness failed" tokens=42"#
        );
        assert_eq!(raw_outputs(&finished, false), "--- tool output ---\npartial\n--- tool error ---\nboom\n");
    }

    #[test]
    fn gate_denials_name_the_policy_and_unknown_enums_survive() {
        let event = pb::LifecycleEvent {
            sequence: 3,
            kind: Some(Kind::Gated(Box::new(pb::Gated {
                phase: pb::GatePhase::AgentStart as i32,
                action: pb::GateAction::Deny as i32,
                decisions: vec![pb::PolicyDecision {
                    policy: "no-network".into(),
                    source: pb::PolicySource::Admin as i32,
                    action: pb::GateAction::Deny as i32,
                    reason: "network requested".into(),
                }],
                effective_sandbox: None,
                tool: String::new(),
            }))),
            ..Default::default()
        };
        assert_eq!(
            event_line(&event),
            r#"#3 - gated phase=agent_start action=deny denied_by="no-network: network requested""#
        );
        let Some(Kind::Gated(mut gated)) = event.kind.clone() else { unreachable!() };
        gated.phase = pb::GatePhase::ToolCall as i32;
        gated.tool = "Bash".into();
        let call = pb::LifecycleEvent { sequence: 4, kind: Some(Kind::Gated(gated)), ..Default::default() };
        assert_eq!(
            event_line(&call),
            r#"#4 - gated phase=tool_call tool=Bash action=deny denied_by="no-network: network requested""#
        );
        assert_eq!(state(99), "unknown(99)");
    }

    #[test]
    fn event_enums_print_their_words() {
        let line = |kind| event_line(&pb::LifecycleEvent { sequence: 1, kind: Some(kind), ..Default::default() });
        let cut = pb::OutputTruncated { stream: pb::OutputStream::Stderr as i32, bytes_dropped: 5 };
        assert_eq!(line(Kind::OutputTruncated(cut)), "#1 - output_truncated stream=stderr bytes_dropped=5");
        let hit = pb::LimitHit { limit: pb::LimitKind::EventBytes as i32, value: 9, detail: "cut".into() };
        assert_eq!(line(Kind::Limit(hit)), "#1 - limit limit=event_bytes value=9 detail=cut");
        let hit = pb::LimitHit { limit: 42, value: 9, detail: String::new() };
        assert_eq!(line(Kind::Limit(hit)), "#1 - limit limit=unknown(42) value=9");
        let ready = pb::SandboxReady {
            sandbox_id: "s1".into(),
            backend: pb::SandboxType::LinuxBwrap as i32,
            receipt: Some(pb::EnforcementReceipt {
                egress: pb::EgressMode::Proxy as i32,
                allow_hosts: vec!["api.anthropic.com".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            line(Kind::SandboxReady(Box::new(ready))),
            r#"#1 - sandbox_ready sandbox=s1 backend=linux_bwrap network_isolated=false egress="proxy to [api.anthropic.com]" host_uid=0"#
        );
    }
}
