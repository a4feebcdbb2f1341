//! Human rendering of one execution record (`corral get`): aligned
//! `label  value` lines, empty fields left out.

use std::fmt::Write as _;

use super::render::{self, quote};
use crate::api::words::shown;
use crate::pb;

/// Labels are padded to this width so the values line up.
const LABEL_WIDTH: usize = 16;

#[derive(Default)]
struct Lines(String);

impl Lines {
    fn field(&mut self, label: &str, value: impl AsRef<str>) -> &mut Self {
        let value = value.as_ref();
        if !value.is_empty() {
            // Values come from the daemon and the harness; keep each on
            // one line and free of terminal control characters.
            let value = if value.chars().any(char::is_control) { quote(value) } else { value.to_owned() };
            let _ = writeln!(self.0, "{label:<LABEL_WIDTH$} {value}");
        }
        self
    }

    /// An enum field; 0 (UNSPECIFIED) is proto3's "not set" and is left out.
    fn enum_field(&mut self, label: &str, raw: i32, name: fn(i32) -> String) -> &mut Self {
        if raw != 0 {
            self.field(label, name(raw));
        }
        self
    }
}

/// The whole record, one field per line, then the raw output if present.
pub(super) fn execution(e: &pb::Execution) -> String {
    let mut out = Lines::default();
    out.field("execution", &e.execution_id).field("state", render::state(e.state));
    out.field("profile", &e.profile_ref).field("title", &e.title);
    out.field("repo", &e.repo);
    if let Some(c) = &e.consumer {
        out.field("actor", &c.actor).field("project", &c.project);
        out.field("run", &c.run_id).field("session", &c.session_id);
    }
    out.field("request", &e.request_id).field("correlation", &e.correlation_id);
    out.field("assignment", &e.assignment_ref);
    if e.report_to_hub {
        out.field("report_to_hub", "yes");
    }
    if let Some(ts) = &e.created_at {
        out.field("created", render::timestamp(ts));
    }
    if let Some(ts) = &e.finished_at {
        out.field("finished", render::timestamp(ts));
    }
    if let Some(s) = &e.effective_sandbox {
        out.field("sandbox", sandbox_summary(s));
    }
    if let Some(ev) = &e.evidence {
        evidence(&mut out, ev);
    }
    let mut text = out.0;
    text.push_str(&render::raw_block(&e.tool_output, &e.tool_error));
    text
}

fn sandbox_summary(s: &pb::SandboxSpec) -> String {
    let mut summary = render::sandbox_type(s.r#type);
    summary.push_str(if s.allow_network { " network=allowed" } else { " network=denied" });
    if !s.write_paths.is_empty() {
        let _ = write!(summary, " write={}", s.write_paths.join(","));
    }
    if !s.read_paths.is_empty() {
        let _ = write!(summary, " read={}", s.read_paths.join(","));
    }
    if !s.env_passthrough.is_empty() {
        let _ = write!(summary, " env={}", s.env_passthrough.join(","));
    }
    summary
}

fn evidence(out: &mut Lines, ev: &pb::Evidence) {
    out.enum_field("outcome", ev.outcome, render::outcome);
    out.enum_field("failure_stage", ev.failure_stage, render::failure_stage);
    out.field("error", &ev.error);
    out.field("failure_class", &ev.failure_class);
    out.enum_field("session_cleanup", ev.session_cleanup, render::teardown);
    out.enum_field("sandbox_destroy", ev.sandbox_destroy, render::teardown);
    out.field("resolved_ref", &ev.profile_ref).field("digest", &ev.profile_digest);
    out.field("readiness", render::readiness(ev.readiness.as_ref()));
    out.field("rein", shown::<pb::ReinKind>(ev.rein)).field("sandbox_id", &ev.sandbox_id);
    let commit = if ev.commit_sha.is_empty() && !ev.sandbox_id.is_empty() {
        "none (no changes)".to_string()
    } else {
        ev.commit_sha.clone()
    };
    out.field("commit", &commit).field("model", &ev.resolved_model);
    if let Some(h) = &ev.harness {
        out.field("harness", h.argv.join(" ")).field("harness_base_url", &h.base_url);
        out.field("harness_env", h.env_names.join(" "));
    }
    out.field("tokens", ev.tokens_spent.to_string());
    out.enum_field("hub_report", ev.hub_report_status, render::hub_status);
    for d in &ev.gate_decisions {
        let source = shown::<pb::PolicySource>(d.source);
        let line = format!("{} [{source}] {}: {}", d.policy, render::gate_action(d.action), d.reason);
        out.field("gate", line);
    }
    for t in &ev.stage_timings {
        out.field("timing", format!("{} {}", t.stage, micros(t.micros)));
    }
    for note in &ev.notes {
        out.field("note", note);
    }
}

/// Microseconds as the most readable of µs, ms or s.
fn micros(us: u64) -> String {
    match us {
        0..=999 => format!("{us}µs"),
        1_000..=999_999 => format!("{:.1}ms", us as f64 / 1e3),
        _ => format!("{:.2}s", us as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_record_names_its_stage_and_skips_empty_fields() {
        let e = pb::Execution {
            execution_id: "e1".into(),
            state: pb::ExecutionState::Failed as i32,
            profile_ref: "claude@1.0.0".into(),
            evidence: Some(pb::Evidence {
                outcome: pb::Outcome::Failed as i32,
                failure_stage: pb::FailureStage::SandboxCreate as i32,
                error: "the sandbox could not be created".into(),
                stage_timings: vec![pb::StageTiming { stage: "gate".into(), micros: 1_500 }],
                rein: pb::ReinKind::Command as i32,
                gate_decisions: vec![pb::PolicyDecision {
                    policy: "host_enforceability".into(),
                    source: pb::PolicySource::Builtin as i32,
                    action: pb::GateAction::Deny as i32,
                    reason: "no cgroup".into(),
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let text = execution(&e);
        assert!(text.starts_with("execution        e1\nstate            failed\n"), "{text}");
        assert!(text.contains("failure_stage    sandbox_create\n"), "{text}");
        assert!(text.contains("timing           gate 1.5ms\n"), "{text}");
        assert!(text.contains("\nprofile          claude@1.0.0\n"), "{text}");
        assert!(text.contains("\nrein             command\n"), "{text}");
        assert!(text.contains("\ngate             host_enforceability [builtin] deny: no cgroup\n"), "{text}");
        assert!(!text.contains("\nrepo "), "{text}");
        assert!(!text.contains("unspecified"), "{text}");
        assert!(!text.contains("tool output"), "{text}");
    }
}
