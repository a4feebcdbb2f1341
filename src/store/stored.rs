//! The JSON the store keeps: a record or event without the fields that
//! hold their type's default (`""`, `0`, `false`, `[]`, `null`), and an
//! event without the `kind` its row's column already names. Reading puts
//! both back: every stored type reads a missing field as its default
//! (checked for each one in the tests below), and rows written before this
//! form (with every field and the `kind`) read as they always did.

use serde::Serialize;
use serde_json::Value;

use crate::records::EventKind;

/// `value` as stored: its JSON without default-valued fields. An object
/// that ends up empty is kept (`Some` of an all-default struct stays
/// `Some`).
pub fn to_stored(value: &impl Serialize) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(value)?;
    prune(&mut json);
    serde_json::to_string(&json)
}

/// [`to_stored`], also without the top-level fields `columns` (which the
/// row keeps in columns of their own).
pub fn to_stored_without(value: &impl Serialize, columns: &[&str]) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(value)?;
    prune(&mut json);
    if let Value::Object(fields) = &mut json {
        fields.retain(|name, _| !columns.contains(&name.as_str()));
    }
    serde_json::to_string(&json)
}

/// An event's stored body: [`to_stored`], less its `kind` when the row's
/// `kind` column names it. The two `finished` kinds share one column
/// value and `limit_hit`'s column says `limit`: those keep theirs, first.
pub fn event_body(kind: &EventKind) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(kind)?;
    prune(&mut json);
    let tag = json.as_object_mut().and_then(|fields| fields.remove("kind"));
    let rest = serde_json::to_string(&json)?;
    match tag.as_ref().and_then(Value::as_str) {
        Some(tag) if tag != kind.name() || kind.is_finished() => Ok(with_kind(tag, &rest)),
        _ => Ok(rest),
    }
}

/// Reads an event's stored body back, given its row's `kind` column.
pub fn event_from_stored(column_kind: &str, body: &str) -> Result<EventKind, serde_json::Error> {
    if body.starts_with(r#"{"kind":"#) {
        return serde_json::from_str(body);
    }
    serde_json::from_str(&with_kind(column_kind, body))
}

/// `{"kind":"<kind>", …fields of object}`.
fn with_kind(kind: &str, object: &str) -> String {
    let rest = object.strip_prefix('{').unwrap_or(object);
    let separator = if rest.starts_with('}') { "" } else { "," };
    format!(r#"{{"kind":"{kind}"{separator}{rest}"#)
}

fn prune(json: &mut Value) {
    match json {
        Value::Object(fields) => fields.retain(|_, field| {
            prune(field);
            !is_default(field)
        }),
        Value::Array(items) => items.iter_mut().for_each(prune),
        _ => {}
    }
}

fn is_default(json: &Value) -> bool {
    match json {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_u64() == Some(0) || n.as_i64() == Some(0) || n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(items) => items.is_empty(),
        Value::Object(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Readiness;
    use crate::evidence::{Evidence, StageTiming, TeardownResult};
    use crate::policy::{Action, PolicyDecision};
    use crate::records::{ExecutionRecord, SessionRecord};
    use crate::sandbox::{Consumer, EnforcementReceipt, LimitReceipt, SandboxSpec, SandboxType};

    fn round_trip(kind: EventKind) {
        let body = event_body(&kind).unwrap();
        let back = event_from_stored(kind.name(), &body).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(back, kind, "stored as {body}");
    }

    /// Every kind, once with every field at its default and once with
    /// values, reads back equal: no field a kind needs can be left out.
    #[test]
    fn every_event_kind_reads_back_from_its_stored_form() {
        let spec = SandboxSpec {
            sandbox_type: SandboxType::None,
            allow_network: false,
            allow_hosts: vec![],
            write_paths: vec![],
            read_paths: vec![],
            env_passthrough: vec![],
        };
        let zero = [
            EventKind::Accepted {
                execution_id: String::new(),
                session_id: String::new(),
                request_id: String::new(),
                consumer: Consumer::default(),
            },
            EventKind::Resolved {
                profile_ref: String::new(),
                profile_digest: String::new(),
                readiness: Readiness::default(),
            },
            EventKind::Gated {
                phase: String::new(),
                action: Action::default(),
                decisions: vec![PolicyDecision::default()],
                effective_sandbox: spec.clone(),
            },
            EventKind::SandboxReady {
                sandbox_id: String::new(),
                backend: SandboxType::None,
                workspace_path: String::new(),
                receipt: EnforcementReceipt { limits: vec![LimitReceipt::default()], ..Default::default() },
            },
            EventKind::Dispatched { tool: String::new() },
            EventKind::Progress { progress_kind: String::new(), tool: String::new(), tokens_so_far: 0 },
            EventKind::OutputTruncated { stream: String::new(), bytes_dropped: 0 },
            EventKind::HarnessRestarted { attempt: 0, reason: String::new() },
            EventKind::TurnFinished { turn: 0, tool: String::new(), ok: false, error: String::new(), tokens_spent: 0 },
            EventKind::Reaped { idle_seconds: 0 },
            EventKind::Recovered { note: String::new() },
            EventKind::Egress {
                host: String::new(),
                port: 0,
                allowed: false,
                rule_or_reason: String::new(),
                method: String::new(),
            },
            EventKind::LimitHit { limit: String::new(), value: 0, detail: String::new() },
            EventKind::Teardown {
                session_cleanup: TeardownResult::default(),
                sandbox_destroy: TeardownResult::default(),
            },
            EventKind::Finished { execution: Box::default() },
            EventKind::SessionFinished { session: Box::default() },
        ];
        for kind in zero {
            round_trip(kind);
        }
        round_trip(EventKind::Progress { progress_kind: "tool_call".into(), tool: "bash".into(), tokens_so_far: 7 });
        round_trip(EventKind::Egress {
            host: "example.test".into(),
            port: 443,
            allowed: true,
            rule_or_reason: "*.test".into(),
            method: "connect".into(),
        });
        let mut record = ExecutionRecord { execution_id: "e".into(), ..Default::default() };
        record.effective_sandbox = Some(spec);
        record.evidence = Evidence {
            readiness: Some(Readiness::default()),
            stage_timings: vec![StageTiming { stage: "workspace".into(), micros: 0 }],
            ..Default::default()
        };
        round_trip(EventKind::Finished { execution: Box::new(record) });
        round_trip(EventKind::SessionFinished { session: Box::new(SessionRecord::default()) });
    }

    #[test]
    fn stored_form_leaves_out_defaults_and_the_kind() {
        let kind = EventKind::Accepted {
            execution_id: "e1".into(),
            session_id: String::new(),
            request_id: String::new(),
            consumer: Consumer { actor: "adm".into(), ..Default::default() },
        };
        assert_eq!(event_body(&kind).unwrap(), r#"{"consumer":{"actor":"adm"},"execution_id":"e1"}"#);
        assert_eq!(event_body(&EventKind::Reaped { idle_seconds: 0 }).unwrap(), "{}");
        assert_eq!(event_from_stored("reaped", "{}").unwrap(), EventKind::Reaped { idle_seconds: 0 });
        // The finished kinds share a column value, so they keep theirs.
        let finished = event_body(&EventKind::SessionFinished { session: Box::default() }).unwrap();
        assert!(finished.starts_with(r#"{"kind":"session_finished","session":{"#), "{finished}");
        // A value inside an array is kept in place, even a default one.
        let mut list = serde_json::json!({"a": [0, "", {"b": ""}], "c": {}});
        prune(&mut list);
        assert_eq!(list.to_string(), r#"{"a":[0,"",{}],"c":{}}"#);
    }

    #[test]
    fn rows_written_with_every_field_still_read() {
        let old = r#"{"kind":"dispatched","tool":"run_task"}"#;
        assert_eq!(event_from_stored("dispatched", old).unwrap(), EventKind::Dispatched { tool: "run_task".into() });
    }
}
