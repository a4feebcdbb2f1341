//! The JSON the store keeps: a record or event without the fields that
//! hold their type's default (`""`, `0`, `false`, `[]`, `null`), and an
//! event without the `kind` its row's column already names. Reading puts
//! both back: every stored type reads a missing field as its default
//! (checked for each one in the tests below), and rows written before this
//! form (with every field and the `kind`) read as they always did. An
//! `accepted` event also leaves out the ids that are its row's subject, a
//! `sandbox_ready` its sandbox id within its workspace path, and an
//! execution's record what its row's columns hold.

use serde::Serialize;
use serde_json::Value;

use crate::records::{EventKind, ExecutionRecord};

/// `value` as stored: its JSON without default-valued fields. An object
/// that ends up empty is kept (`Some` of an all-default struct stays
/// `Some`).
pub fn to_stored(value: &impl Serialize) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(value)?;
    prune(&mut json);
    serde_json::to_string(&json)
}

/// The fields of an execution record that its row has columns for, which
/// its stored JSON leaves out (every write of the record writes them).
pub const EXECUTION_COLUMNS: [&str; 4] = ["execution_id", "state", "created_at_ms", "finished_at_ms"];

/// The fields of an execution's consumer that its row has columns for,
/// written once with the row (a run's consumer does not change): its
/// stored JSON leaves them out too.
const CONSUMER_COLUMNS: [&str; 3] = ["actor", "project", "principal"];

/// What an execution's `profile_ref` column holds, the profile its row is
/// listed under: the resolved reference once there is one, else the one
/// the request named.
pub fn profile_column(record: &ExecutionRecord) -> &str {
    if record.evidence.profile_ref.is_empty() {
        &record.harness_profile_ref
    } else {
        &record.evidence.profile_ref
    }
}

/// An execution's stored record: [`to_stored`], without the fields its
/// row's columns hold ([`EXECUTION_COLUMNS`], [`CONSUMER_COLUMNS`], and
/// the profile it asked for when that is [`profile_column`]'s), and
/// without its consumer's `run_id` when that is its id (an execution's
/// is): see `execution_from_row`. A no-op execution's record is 116
/// bytes shorter for it (BENCHMARKS.md).
pub fn execution_to_stored(record: &ExecutionRecord) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(record)?;
    prune(&mut json);
    if let Value::Object(fields) = &mut json {
        fields.retain(|name, _| !EXECUTION_COLUMNS.contains(&name.as_str()));
        if let Some(Value::Object(consumer)) = fields.get_mut("consumer") {
            remove_if(consumer, "run_id", &record.execution_id);
            consumer.retain(|name, _| !CONSUMER_COLUMNS.contains(&name.as_str()));
            if consumer.is_empty() {
                fields.remove("consumer");
            }
        }
        remove_if(fields, "harness_profile_ref", profile_column(record));
    }
    serde_json::to_string(&json)
}

/// An event's stored body: [`to_stored`], less its `kind` when the row's
/// `kind` column names it. The two `finished` kinds share one column
/// value and `limit_hit`'s column says `limit`: those keep theirs, first.
/// An `accepted` event leaves out its `execution_id` and its consumer's
/// `run_id` when they are the subject (an execution's are).
pub fn event_body(subject: &str, kind: &EventKind) -> Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(kind)?;
    prune(&mut json);
    match (kind, &mut json) {
        (EventKind::Accepted { .. }, Value::Object(fields)) => {
            remove_if(fields, "execution_id", subject);
            remove_run_id(fields, subject);
        }
        (EventKind::SandboxReady { sandbox_id, workspace_path, .. }, Value::Object(fields)) => {
            if let Some(dir) = sandboxes_dir(sandbox_id, workspace_path) {
                fields.remove("workspace_path");
                fields.insert(SANDBOXES_DIR.into(), Value::String(dir.into()));
            }
        }
        _ => {}
    }
    let tag = json.as_object_mut().and_then(|fields| fields.remove("kind"));
    let rest = serde_json::to_string(&json)?;
    match tag.as_ref().and_then(Value::as_str) {
        Some(tag) if tag != kind.name() || kind.is_finished() => Ok(with_kind(tag, &rest)),
        _ => Ok(rest),
    }
}

/// Reads an event's stored body back, given its row's subject and `kind`
/// column. An `accepted` event always names its subject: an execution's in
/// `execution_id`, a session's in `session_id`, and either's consumer in
/// `run_id`; a stored one without them gets the subject back.
pub fn event_from_stored(subject: &str, column_kind: &str, body: &str) -> Result<EventKind, serde_json::Error> {
    let tagged;
    let body = if body.starts_with(r#"{"kind":"#) {
        body
    } else {
        tagged = with_kind(column_kind, body);
        &tagged
    };
    let mut kind: EventKind = if column_kind == "sandbox_ready" && body.contains(SANDBOXES_DIR) {
        let mut json: Value = serde_json::from_str(body)?;
        if let Value::Object(fields) = &mut json {
            let id = fields.get("sandbox_id").and_then(Value::as_str).unwrap_or_default().to_owned();
            if let Some(Value::String(dir)) = fields.remove(SANDBOXES_DIR) {
                fields.insert("workspace_path".into(), Value::String(format!("{dir}/{id}/workspace")));
            }
        }
        serde_json::from_value(json)?
    } else {
        serde_json::from_str(body)?
    };
    if let EventKind::Accepted { execution_id, session_id, consumer, .. } = &mut kind {
        if execution_id.is_empty() && session_id.is_empty() {
            *execution_id = subject.to_string();
        }
        if consumer.run_id.is_empty() {
            consumer.run_id = subject.to_string();
        }
    }
    Ok(kind)
}

/// The field a stored `sandbox_ready` has instead of its `workspace_path`
/// when that path is `<sandboxes_dir>/<sandbox_id>/workspace` (every
/// sandbox's is): the sandbox's id is not stored twice, and the body stays
/// within the ~1,000 bytes an events row keeps in its page (BENCHMARKS.md).
const SANDBOXES_DIR: &str = "sandboxes_dir";

/// The directory `workspace_path` is `<dir>/<sandbox_id>/workspace` in.
fn sandboxes_dir<'a>(sandbox_id: &str, workspace_path: &'a str) -> Option<&'a str> {
    let dir = workspace_path.strip_suffix("/workspace")?.strip_suffix(sandbox_id)?.strip_suffix('/')?;
    (!sandbox_id.is_empty() && !dir.is_empty()).then_some(dir)
}

/// Removes `fields[name]` when it is the string `value`.
fn remove_if(fields: &mut serde_json::Map<String, Value>, name: &str, value: &str) {
    if fields.get(name).and_then(Value::as_str) == Some(value) {
        fields.remove(name);
    }
}

/// Removes the consumer's `run_id` when it is `id`.
fn remove_run_id(fields: &mut serde_json::Map<String, Value>, id: &str) {
    if let Some(Value::Object(consumer)) = fields.get_mut("consumer") {
        remove_if(consumer, "run_id", id);
    }
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
    use std::collections::BTreeSet;

    use super::*;
    use crate::catalog::{Readiness, ReadinessState};
    use crate::policy::{Action, PolicyDecision};
    use crate::records::{ExecutionRecord, SessionRecord, SessionState};
    use crate::sandbox::{Consumer, EnforcementReceipt, LimitReceipt, SandboxSpec, SandboxType};
    use crate::types::evidence::{Evidence, StageTiming, TeardownResult};

    /// `kind` stored as an event of `subject`, and read back.
    fn round_trip(subject: &str, kind: EventKind) {
        let body = event_body(subject, &kind).unwrap();
        let back = event_from_stored(subject, kind.name(), &body).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(back, kind, "stored as {body}");
    }

    /// The kinds `EventKind` has, as its `kind` tag names them, read off
    /// the type itself: serde lists every variant when it meets a kind it
    /// does not know. A kind added to the type is in this set at once.
    fn every_kind() -> BTreeSet<String> {
        let error = serde_json::from_str::<EventKind>(r#"{"kind":"no-such-kind"}"#).unwrap_err().to_string();
        let (_, listed) =
            error.split_once("expected one of ").unwrap_or_else(|| panic!("no variant list in {error:?}"));
        // `a`, `b`, ... `z` at line 1 column N: the names between backquotes.
        let names: BTreeSet<String> = listed.split('`').skip(1).step_by(2).map(String::from).collect();
        assert!(names.len() > 10 && names.contains("accepted") && names.contains("session_finished"), "{error}");
        names
    }

    /// The `kind` tag `kind` is written with.
    fn tag(kind: &EventKind) -> String {
        serde_json::to_value(kind).unwrap()["kind"].as_str().expect("a kind tag").to_string()
    }

    /// Every kind, once with every field at its default and once with
    /// every field set, reads back equal: no field a kind needs can be left
    /// out, and none is lost on the way. Both lists must cover every kind
    /// of the type (see [`every_kind`]): a new kind fails here until it has
    /// its two examples.
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
            // An execution's (it names its subject: see the next test).
            EventKind::Accepted {
                execution_id: "s1".into(),
                session_id: String::new(),
                request_id: String::new(),
                consumer: Consumer { run_id: "s1".into(), ..Default::default() },
            },
            EventKind::Resolved {
                profile_ref: String::new(),
                profile_digest: String::new(),
                readiness: Readiness::default(),
            },
            EventKind::Gated {
                phase: String::new(),
                tool: String::new(),
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
            EventKind::ApprovalRequested {
                call_id: String::new(),
                tool: String::new(),
                summary: String::new(),
                expires_at_ms: 0,
            },
            EventKind::ApprovalDecided {
                call_id: String::new(),
                allow: false,
                decided_by: String::new(),
                reason: String::new(),
            },
            EventKind::Teardown {
                session_cleanup: TeardownResult::default(),
                sandbox_destroy: TeardownResult::default(),
            },
            EventKind::Finished { execution: Box::default() },
            EventKind::SessionFinished { session: Box::default() },
        ];

        let full_spec = SandboxSpec {
            sandbox_type: SandboxType::LinuxBwrap,
            allow_network: true,
            allow_hosts: vec!["example.test:443".into()],
            write_paths: vec![".".into()],
            read_paths: vec!["/opt/tools".into()],
            env_passthrough: vec!["LANG".into()],
        };
        let consumer = Consumer {
            actor: "agt".into(),
            project: "proj-a".into(),
            run_id: "e2".into(),
            session_id: "s1".into(),
            principal: "team-a".into(),
        };
        let readiness = Readiness {
            state: ReadinessState::Unverified,
            reason: "new".into(),
            owner: "ops".into(),
            evidence_ref: "r".into(),
        };
        let evidence = Evidence {
            readiness: Some(readiness.clone()),
            stage_timings: vec![StageTiming { stage: "workspace".into(), micros: 12 }],
            commit_sha: "a".repeat(40),
            sandbox_destroy: TeardownResult::Succeeded,
            notes: vec!["a note".into()],
            ..Default::default()
        };
        let execution = ExecutionRecord {
            execution_id: "e2".into(),
            title: "a task".into(),
            repo: "/srv/repo".into(),
            consumer: consumer.clone(),
            effective_sandbox: Some(full_spec.clone()),
            evidence: evidence.clone(),
            harness_profile_ref: "builtin.shell@1.0.0".into(),
            state: crate::records::ExecutionState::Succeeded,
            created_at_ms: 5,
            finished_at_ms: Some(9),
            ..Default::default()
        };
        let session = SessionRecord {
            session_id: "s1".into(),
            profile_ref: "builtin.shell@1.0.0".into(),
            consumer: consumer.clone(),
            repo: "/srv/repo".into(),
            effective_sandbox: Some(full_spec.clone()),
            state: SessionState::Ended,
            evidence,
            turns: 3,
            restarts: 1,
            created_at_ms: 5,
            ended_at_ms: Some(9),
        };
        let valued = [
            // Ids that are not the subject (`s9`), so all of them are stored.
            EventKind::Accepted {
                execution_id: "e2".into(),
                session_id: "s1".into(),
                request_id: "req-1".into(),
                consumer: consumer.clone(),
            },
            EventKind::Resolved {
                profile_ref: "builtin.shell@1.0.0".into(),
                profile_digest: "sha256:00".into(),
                readiness: readiness.clone(),
            },
            EventKind::Gated {
                phase: "tool_call".into(),
                tool: "Bash".into(),
                action: Action::Ask,
                decisions: vec![PolicyDecision {
                    policy: "p".into(),
                    source: "profile".into(),
                    action: Action::Deny,
                    reason: "no".into(),
                }],
                effective_sandbox: full_spec.clone(),
            },
            EventKind::SandboxReady {
                sandbox_id: "sb-1".into(),
                backend: SandboxType::LinuxBwrap,
                workspace_path: "/var/lib/corral/sandboxes/sb-1/workspace".into(),
                receipt: EnforcementReceipt {
                    command_digest: "ab".into(),
                    network_isolated: true,
                    egress: "proxy".into(),
                    allow_hosts: vec!["example.test:443".into()],
                    write_roots: vec!["/workspace".into()],
                    host_uid: 300_001,
                    own_uid: true,
                    inside_uid: 1000,
                    seccomp_digest: "sha256:01".into(),
                    userns_disabled: true,
                    limits: vec![LimitReceipt { name: "max_processes".into(), value: 64, mechanism: "cgroup".into() }],
                    gateway_routes: vec!["anthropic".into()],
                    exposed_routes: vec!["github".into()],
                },
            },
            EventKind::Dispatched { tool: "run_task".into() },
            EventKind::Progress { progress_kind: "tool_call".into(), tool: "bash".into(), tokens_so_far: 7 },
            EventKind::OutputTruncated { stream: "stdout".into(), bytes_dropped: 4096 },
            EventKind::HarnessRestarted { attempt: 2, reason: "exited with 1".into() },
            EventKind::TurnFinished {
                turn: 3,
                tool: "run_task".into(),
                ok: true,
                error: "none".into(),
                tokens_spent: 11,
            },
            EventKind::Reaped { idle_seconds: 3 },
            EventKind::Recovered { note: "the daemon restarted".into() },
            EventKind::Egress {
                host: "example.test".into(),
                port: 443,
                allowed: true,
                rule_or_reason: "*.test".into(),
                method: "connect".into(),
            },
            EventKind::LimitHit { limit: "memory".into(), value: 1 << 28, detail: "oom kill".into() },
            EventKind::ApprovalRequested {
                call_id: "call-1".into(),
                tool: "Bash".into(),
                summary: "{\"command\":\"ls\"}".into(),
                expires_at_ms: 1_700_000_000_000,
            },
            EventKind::ApprovalDecided {
                call_id: "call-1".into(),
                allow: true,
                decided_by: "ops".into(),
                reason: "fine".into(),
            },
            EventKind::Teardown { session_cleanup: TeardownResult::Failed, sandbox_destroy: TeardownResult::Succeeded },
            EventKind::Finished { execution: Box::new(execution) },
            EventKind::SessionFinished { session: Box::new(session) },
        ];

        let all = every_kind();
        for (examples, label) in [(&zero, "at their defaults"), (&valued, "with values")] {
            let mut covered = BTreeSet::new();
            for kind in examples.iter() {
                assert!(covered.insert(tag(kind)), "{} twice among the kinds {label}", tag(kind));
            }
            assert_eq!(covered, all, "the kinds {label} are not every kind EventKind has");
        }
        for kind in zero {
            round_trip("s1", kind);
        }
        for kind in valued {
            // Every field set: nothing of it is left out as a default.
            let json = serde_json::to_value(&kind).unwrap();
            for (field, value) in json.as_object().unwrap() {
                assert!(!is_default(value), "{}: {field} is at its default in the example with values", tag(&kind));
            }
            round_trip("s9", kind);
        }
    }

    #[test]
    fn stored_form_leaves_out_defaults_the_kind_and_the_subject() {
        let consumer = |run_id: &str| Consumer { actor: "adm".into(), run_id: run_id.into(), ..Default::default() };
        let execution = EventKind::Accepted {
            execution_id: "e1".into(),
            session_id: String::new(),
            request_id: String::new(),
            consumer: consumer("e1"),
        };
        assert_eq!(event_body("e1", &execution).unwrap(), r#"{"consumer":{"actor":"adm"}}"#);
        assert_eq!(event_from_stored("e1", "accepted", r#"{"consumer":{"actor":"adm"}}"#).unwrap(), execution);
        let session = EventKind::Accepted {
            execution_id: String::new(),
            session_id: "s1".into(),
            request_id: "r".into(),
            consumer: consumer("s1"),
        };
        let body = event_body("s1", &session).unwrap();
        assert_eq!(body, r#"{"consumer":{"actor":"adm"},"request_id":"r","session_id":"s1"}"#);
        assert_eq!(event_from_stored("s1", "accepted", &body).unwrap(), session);
        // Ids that are not the subject stay.
        let other = EventKind::Accepted {
            execution_id: "e2".into(),
            session_id: "s1".into(),
            request_id: String::new(),
            consumer: consumer("e2"),
        };
        assert_eq!(event_from_stored("s1", "accepted", &event_body("s1", &other).unwrap()).unwrap(), other);

        assert_eq!(event_body("s1", &EventKind::Reaped { idle_seconds: 0 }).unwrap(), "{}");
        assert_eq!(event_from_stored("s1", "reaped", "{}").unwrap(), EventKind::Reaped { idle_seconds: 0 });
        // The finished kinds share a column value, so they keep theirs.
        let finished = event_body("s1", &EventKind::SessionFinished { session: Box::default() }).unwrap();
        assert!(finished.starts_with(r#"{"kind":"session_finished","session":{"#), "{finished}");
        // A value inside an array is kept in place, even a default one.
        let mut list = serde_json::json!({"a": [0, "", {"b": ""}], "c": {}});
        prune(&mut list);
        assert_eq!(list.to_string(), r#"{"a":[0,"",{}],"c":{}}"#);
    }

    #[test]
    fn rows_written_with_every_field_still_read() {
        let old = r#"{"kind":"dispatched","tool":"run_task"}"#;
        assert_eq!(
            event_from_stored("s1", "dispatched", old).unwrap(),
            EventKind::Dispatched { tool: "run_task".into() }
        );
    }

    #[test]
    fn a_limit_receipt_is_stored_as_a_triple_and_its_object_form_still_reads() {
        let ready = |limits| EventKind::SandboxReady {
            sandbox_id: String::new(),
            backend: SandboxType::LinuxBwrap,
            workspace_path: String::new(),
            receipt: EnforcementReceipt { limits, ..Default::default() },
        };
        let limits = vec![
            LimitReceipt { name: "memory_bytes".into(), value: 1 << 31, mechanism: "cgroup v2".into() },
            LimitReceipt { name: "tmp_bytes".into(), value: 0, mechanism: String::new() },
        ];
        let body = event_body("e1", &ready(limits.clone())).unwrap();
        assert_eq!(
            body,
            r#"{"backend":"linux_bwrap","receipt":{"limits":[["memory_bytes",2147483648,"cgroup v2"],["tmp_bytes",0,""]]}}"#
        );
        assert_eq!(event_from_stored("e1", "sandbox_ready", &body).unwrap(), ready(limits.clone()));
        // The workspace path keeps its directory, not the sandbox id again.
        let placed = EventKind::SandboxReady {
            sandbox_id: "01a2".into(),
            backend: SandboxType::LinuxBwrap,
            workspace_path: "/var/lib/corral/sandboxes/01a2/workspace".into(),
            receipt: EnforcementReceipt::default(),
        };
        let body = event_body("e1", &placed).unwrap();
        assert_eq!(
            body,
            r#"{"backend":"linux_bwrap","receipt":{},"sandbox_id":"01a2","sandboxes_dir":"/var/lib/corral/sandboxes"}"#
        );
        assert_eq!(event_from_stored("e1", "sandbox_ready", &body).unwrap(), placed);
        let old = r#"{"backend":"linux_bwrap","sandbox_id":"01a2","workspace_path":"/var/lib/corral/sandboxes/01a2/workspace"}"#;
        assert_eq!(event_from_stored("e1", "sandbox_ready", old).unwrap(), placed);
        // Any other path is stored as it is.
        for (id, path) in [("01a2", "/elsewhere/workspace"), ("01a2", "/01a2/workspace"), ("", "/d//workspace")] {
            let other = EventKind::SandboxReady {
                sandbox_id: id.into(),
                backend: SandboxType::LinuxBwrap,
                workspace_path: path.into(),
                receipt: EnforcementReceipt::default(),
            };
            let body = event_body("e1", &other).unwrap();
            assert!(body.contains(path) && !body.contains(SANDBOXES_DIR), "{body}");
            assert_eq!(event_from_stored("e1", "sandbox_ready", &body).unwrap(), other);
        }
        let old = r#"{"backend":"linux_bwrap","receipt":{"limits":[{"mechanism":"cgroup v2","name":"memory_bytes","value":2147483648},{"name":"tmp_bytes"}]}}"#;
        assert_eq!(event_from_stored("e1", "sandbox_ready", old).unwrap(), ready(limits));
    }
}
