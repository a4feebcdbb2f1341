//! Domain → wire conversions. The only place that knows both shapes;
//! enums the domain keeps as words go through [`super::words`].

use crate::catalog::{self, Profile, ReadinessState};
use crate::events::{BusItem, EventKind, RawPart};
use crate::lifecycle::{ExecutionRecord, ExecutionState, RawResult, SessionRecord, SessionState};
use crate::pb;
use crate::policy::{self, Action};
use crate::sandbox::{self, SandboxType};
use crate::types::evidence::{self, FailureStage, HubReportStatus, Outcome, TeardownResult};

use super::words::wire;

pub fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: ms.div_euclid(1000), nanos: (ms.rem_euclid(1000) * 1_000_000) as i32 }
}

pub fn sandbox_type(t: SandboxType) -> pb::SandboxType {
    match t {
        SandboxType::LinuxBwrap => pb::SandboxType::LinuxBwrap,
        SandboxType::None => pb::SandboxType::None,
    }
}

pub fn sandbox_spec(s: &sandbox::SandboxSpec) -> pb::SandboxSpec {
    pb::SandboxSpec {
        r#type: sandbox_type(s.sandbox_type) as i32,
        allow_network: s.allow_network,
        allow_hosts: s.allow_hosts.clone(),
        write_paths: s.write_paths.clone(),
        read_paths: s.read_paths.clone(),
        env_passthrough: s.env_passthrough.clone(),
    }
}

pub fn consumer(c: &sandbox::Consumer) -> pb::Consumer {
    pb::Consumer {
        actor: c.actor.clone(),
        project: c.project.clone(),
        run_id: c.run_id.clone(),
        session_id: c.session_id.clone(),
        principal: c.principal.clone(),
    }
}

pub fn readiness(r: &catalog::Readiness) -> pb::Readiness {
    let state = match r.state {
        ReadinessState::Ready => pb::ReadinessState::Ready,
        ReadinessState::Unverified => pb::ReadinessState::Unverified,
        ReadinessState::Blocked => pb::ReadinessState::Blocked,
    };
    pb::Readiness {
        state: state as i32,
        reason: r.reason.clone(),
        owner: r.owner.clone(),
        evidence_ref: r.evidence_ref.clone(),
    }
}

pub fn action(a: Action) -> pb::GateAction {
    match a {
        Action::Allow => pb::GateAction::Allow,
        Action::Deny => pb::GateAction::Deny,
        Action::Ask => pb::GateAction::Ask,
    }
}

pub fn decision(d: &policy::PolicyDecision) -> pb::PolicyDecision {
    pb::PolicyDecision {
        policy: d.policy.clone(),
        source: wire::<pb::PolicySource>(&d.source),
        action: action(d.action) as i32,
        reason: d.reason.clone(),
    }
}

fn teardown(t: TeardownResult) -> i32 {
    (match t {
        TeardownResult::Succeeded => pb::TeardownResult::Succeeded,
        TeardownResult::Failed => pb::TeardownResult::Failed,
        TeardownResult::NotAttempted => pb::TeardownResult::NotAttempted,
        TeardownResult::Unknown => pb::TeardownResult::Unknown,
    }) as i32
}

fn outcome(o: Outcome) -> i32 {
    (match o {
        Outcome::Unknown => pb::Outcome::Unspecified,
        Outcome::Succeeded => pb::Outcome::Succeeded,
        Outcome::Failed => pb::Outcome::Failed,
        Outcome::Refused => pb::Outcome::Refused,
        Outcome::Cancelled => pb::Outcome::Cancelled,
    }) as i32
}

fn stage(s: Option<FailureStage>) -> i32 {
    (match s {
        None => pb::FailureStage::Unspecified,
        Some(FailureStage::Resolution) => pb::FailureStage::Resolution,
        Some(FailureStage::Gate) => pb::FailureStage::Gate,
        Some(FailureStage::SandboxCreate) => pb::FailureStage::SandboxCreate,
        Some(FailureStage::SessionStart) => pb::FailureStage::SessionStart,
        Some(FailureStage::Execution) => pb::FailureStage::Execution,
        Some(FailureStage::Teardown) => pb::FailureStage::Teardown,
    }) as i32
}

fn hub(h: HubReportStatus) -> i32 {
    (match h {
        HubReportStatus::NotRequested => pb::HubReportStatus::NotRequested,
        HubReportStatus::Pending => pb::HubReportStatus::Pending,
        HubReportStatus::Accepted => pb::HubReportStatus::Accepted,
        HubReportStatus::Failed => pb::HubReportStatus::Failed,
        HubReportStatus::Unknown => pb::HubReportStatus::Unknown,
    }) as i32
}

pub fn execution_state(s: ExecutionState) -> pb::ExecutionState {
    match s {
        ExecutionState::Pending => pb::ExecutionState::Pending,
        ExecutionState::Running => pb::ExecutionState::Running,
        ExecutionState::Succeeded => pb::ExecutionState::Succeeded,
        ExecutionState::Failed => pb::ExecutionState::Failed,
        ExecutionState::Refused => pb::ExecutionState::Refused,
        ExecutionState::Cancelled => pb::ExecutionState::Cancelled,
    }
}

pub fn evidence(e: &evidence::Evidence) -> pb::Evidence {
    pb::Evidence {
        outcome: outcome(e.outcome),
        failure_stage: stage(e.failure_stage),
        error: e.error.clone(),
        session_cleanup: teardown(e.session_cleanup),
        sandbox_destroy: teardown(e.sandbox_destroy),
        profile_ref: e.profile_ref.clone(),
        profile_digest: e.profile_digest.clone(),
        readiness: e.readiness.as_ref().map(readiness),
        rein: wire::<pb::ReinKind>(&e.rein),
        sandbox_id: e.sandbox_id.clone(),
        commit_sha: e.commit_sha.clone(),
        tokens_spent: e.tokens_spent,
        resolved_model: e.resolved_model.clone(),
        gate_decisions: e.gate_decisions.iter().map(decision).collect(),
        hub_report_status: hub(e.hub_report_status),
        request_id: e.request_id.clone(),
        correlation_id: e.correlation_id.clone(),
        assignment_ref: e.assignment_ref.clone(),
        notes: e.notes.clone(),
        workspace_snapshot: e.workspace_snapshot,
        agent_commits: e.agent_commits,
        failure_class: e.failure_class.clone(),
        harness: e.harness.as_ref().map(|h| pb::HarnessInvocation {
            argv: h.argv.clone(),
            env_names: h.env_names.clone(),
            base_url: h.base_url.clone(),
            model: h.model.clone(),
            files: h
                .files
                .iter()
                .map(|(path, sha256)| pb::WrittenFile { path: path.clone(), sha256: sha256.clone() })
                .collect(),
        }),
        tool_calls: Some(pb::ToolCallCounts {
            allowed: e.tool_calls.allowed,
            denied: e.tool_calls.denied,
            asked: e.tool_calls.asked,
        }),
        egress: Some(pb::EgressSummary {
            allowed: e.egress.allowed,
            denied: e.egress.denied,
            denied_hosts: e.egress.denied_hosts.clone(),
            bytes: e
                .egress
                .bytes
                .iter()
                .map(|b| pb::HostBytes { host: b.host.clone(), up: b.up, down: b.down })
                .collect(),
        }),
        stage_timings: e
            .stage_timings
            .iter()
            .map(|t| pb::StageTiming { stage: t.stage.clone(), micros: t.micros })
            .collect(),
    }
}

/// The record as anyone may see it; `raw` adds what only the direct
/// caller may see.
pub fn execution(r: &ExecutionRecord, raw: Option<&RawResult>) -> pb::Execution {
    pb::Execution {
        execution_id: r.execution_id.clone(),
        request_id: r.request_id.clone(),
        state: execution_state(r.state) as i32,
        profile_ref: r.harness_profile_ref.clone(),
        title: r.title.clone(),
        repo: r.repo.clone(),
        consumer: Some(consumer(&r.consumer)),
        correlation_id: r.correlation_id.clone(),
        assignment_ref: r.assignment_ref.clone(),
        report_to_hub: r.report_to_hub,
        effective_sandbox: r.effective_sandbox.as_ref().map(sandbox_spec),
        evidence: Some(evidence(&r.evidence)),
        created_at: Some(timestamp(r.created_at_ms)),
        finished_at: r.finished_at_ms.map(timestamp),
        tool_output: raw.map(|r| r.tool_output.clone()).unwrap_or_default(),
        tool_error: raw.map(|r| r.tool_error.clone()).unwrap_or_default(),
    }
}

/// An event for the wire. Raw parts are present only on items that carry
/// them (the direct caller's stream).
pub fn event(item: &BusItem) -> pb::LifecycleEvent {
    use pb::lifecycle_event::Kind;
    let e = item.event();
    let raw = item.raw.as_deref();
    let kind = match &e.kind {
        EventKind::Accepted { execution_id, session_id, request_id, consumer: c } => {
            Kind::Accepted(Box::new(pb::Accepted {
                execution_id: execution_id.clone(),
                session_id: session_id.clone(),
                request_id: request_id.clone(),
                consumer: Some(consumer(c)),
            }))
        }
        EventKind::Resolved { profile_ref, profile_digest, readiness: r } => Kind::Resolved(Box::new(pb::Resolved {
            profile_ref: profile_ref.clone(),
            profile_digest: profile_digest.clone(),
            readiness: Some(readiness(r)),
        })),
        EventKind::Gated { phase, tool, action: a, decisions, effective_sandbox } => Kind::Gated(Box::new(pb::Gated {
            phase: wire::<pb::GatePhase>(phase),
            tool: tool.clone(),
            action: action(*a) as i32,
            decisions: decisions.iter().map(decision).collect(),
            effective_sandbox: Some(sandbox_spec(effective_sandbox)),
        })),
        EventKind::SandboxReady { sandbox_id, backend, workspace_path, receipt } => {
            Kind::SandboxReady(Box::new(pb::SandboxReady {
                sandbox_id: sandbox_id.clone(),
                backend: sandbox_type(*backend) as i32,
                workspace_path: workspace_path.clone(),
                receipt: Some(enforcement_receipt(receipt)),
            }))
        }
        EventKind::Dispatched { tool } => Kind::Dispatched(pb::Dispatched { tool: tool.clone() }),
        EventKind::Progress { progress_kind, tool, tokens_so_far } => Kind::Progress(pb::Progress {
            kind: wire::<pb::ProgressKind>(progress_kind),
            tool: tool.clone(),
            tokens_so_far: *tokens_so_far,
            message: match raw {
                Some(RawPart::ProgressMessage(m)) => m.clone(),
                _ => String::new(),
            },
        }),
        EventKind::OutputTruncated { stream, bytes_dropped } => Kind::OutputTruncated(pb::OutputTruncated {
            stream: wire::<pb::OutputStream>(stream),
            bytes_dropped: *bytes_dropped,
        }),
        EventKind::HarnessRestarted { attempt, reason } => {
            Kind::HarnessRestarted(pb::HarnessRestarted { attempt: *attempt, reason: reason.clone() })
        }
        EventKind::TurnFinished { turn, tool, ok, error, tokens_spent } => {
            let raw = match raw {
                Some(RawPart::Finished(r)) => Some(r),
                _ => None,
            };
            Kind::TurnFinished(Box::new(pb::TurnFinished {
                turn: *turn,
                tool: tool.clone(),
                ok: *ok,
                error: error.clone(),
                tokens_spent: *tokens_spent,
                output: raw.map(|r| r.tool_output.clone()).unwrap_or_default(),
                raw_error: raw.map(|r| r.tool_error.clone()).unwrap_or_default(),
            }))
        }
        EventKind::Reaped { idle_seconds } => Kind::Reaped(pb::Reaped { idle_seconds: *idle_seconds }),
        EventKind::Recovered { note } => Kind::Recovered(pb::Recovered { note: note.clone() }),
        EventKind::Egress { host, port, allowed, rule_or_reason, method } => Kind::Egress(pb::Egress {
            host: host.clone(),
            port: u32::from(*port),
            allowed: *allowed,
            rule_or_reason: rule_or_reason.clone(),
            method: wire::<pb::EgressMethod>(method),
        }),
        EventKind::ApprovalRequested { call_id, tool, summary, expires_at_ms } => {
            Kind::ApprovalRequested(pb::ApprovalRequested {
                call_id: call_id.clone(),
                tool: tool.clone(),
                summary: summary.clone(),
                expires_at: Some(timestamp(*expires_at_ms)),
            })
        }
        EventKind::ApprovalDecided { call_id, allow, decided_by, reason } => {
            Kind::ApprovalDecided(pb::ApprovalDecided {
                call_id: call_id.clone(),
                allow: *allow,
                decided_by: decided_by.clone(),
                reason: reason.clone(),
            })
        }
        EventKind::LimitHit { limit, value, detail } => {
            Kind::Limit(pb::LimitHit { limit: wire::<pb::LimitKind>(limit), value: *value, detail: detail.clone() })
        }
        EventKind::SessionFinished { session: record } => {
            let raw = match raw {
                Some(RawPart::Finished(r)) => Some(r),
                _ => None,
            };
            Kind::Finished(Box::new(pb::Finished { record: Some(pb::finished::Record::Session(session(record, raw))) }))
        }
        EventKind::Teardown { session_cleanup, sandbox_destroy } => Kind::Teardown(Box::new(pb::Teardown {
            session_cleanup: teardown(*session_cleanup),
            sandbox_destroy: teardown(*sandbox_destroy),
        })),
        EventKind::Finished { execution: record } => {
            let raw = match raw {
                Some(RawPart::Finished(r)) => Some(r),
                _ => None,
            };
            Kind::Finished(Box::new(pb::Finished {
                record: Some(pb::finished::Record::Execution(execution(record, raw))),
            }))
        }
    };
    pb::LifecycleEvent {
        subject_id: e.subject_id.clone(),
        sequence: e.sequence,
        time: Some(timestamp(e.time_ms)),
        kind: Some(kind),
    }
}

pub fn session(r: &SessionRecord, raw: Option<&RawResult>) -> pb::Session {
    let state = match r.state {
        SessionState::Starting => pb::SessionState::Starting,
        SessionState::Active => pb::SessionState::Active,
        SessionState::Ended => pb::SessionState::Ended,
        SessionState::Failed => pb::SessionState::Failed,
        SessionState::Refused => pb::SessionState::Refused,
        SessionState::Reaped => pb::SessionState::Reaped,
    };
    pb::Session {
        session_id: r.session_id.clone(),
        profile_ref: r.profile_ref.clone(),
        consumer: Some(consumer(&r.consumer)),
        effective_sandbox: r.effective_sandbox.as_ref().map(sandbox_spec),
        state: state as i32,
        evidence: Some(evidence(&r.evidence)),
        turns: r.turns,
        restarts: r.restarts,
        repo: r.repo.clone(),
        created_at: Some(timestamp(r.created_at_ms)),
        ended_at: r.ended_at_ms.map(timestamp),
        tool_error: raw.map(|r| r.tool_error.clone()).unwrap_or_default(),
    }
}

pub fn profile(p: &Profile) -> pb::Profile {
    let f = &p.file;
    let ungated = f.rein.tool_calls_ungated(f.sandbox.sandbox_type);
    pb::Profile {
        id: f.id.clone(),
        version: p.version.to_string(),
        r#ref: p.reference(),
        status: profile_status(f.status) as i32,
        readiness: Some(readiness(&f.readiness)),
        rein: Some(pb::Rein {
            kind: wire::<pb::ReinKind>(&f.rein.kind),
            preset: preset(f.rein.preset) as i32,
            argv: f.rein.argv.clone(),
            input: task_input(f.rein.input) as i32,
            tool_calls_gated: ungated.is_none(),
            tool_calls_ungated: ungated.unwrap_or_default(),
            base_url: f.rein.base_url.clone(),
            model: f.rein.model.clone(),
        }),
        sandbox: Some(sandbox_spec(&f.sandbox)),
        limits: Some(wire_limits(&f.limits)),
        credential_route_refs: f.credential_route_refs.clone(),
        policies: f
            .guardrails
            .policies
            .iter()
            .map(|p| pb::PolicySpec {
                name: p.name.clone(),
                kind: wire::<pb::PolicyKind>(&p.kind),
                arguments_json: p.arguments.to_string(),
                on: p.on.clone(),
            })
            .collect(),
        digest: p.digest.clone(),
        source: p.source.clone(),
        description: f.description.clone(),
        usable: p.unusable.is_none(),
        unusable_reason: p.unusable.clone().unwrap_or_default(),
    }
}

fn enforcement_receipt(r: &crate::sandbox::EnforcementReceipt) -> pb::EnforcementReceipt {
    pb::EnforcementReceipt {
        command_digest: r.command_digest.clone(),
        network_isolated: r.network_isolated,
        egress: wire::<pb::EgressMode>(&r.egress),
        allow_hosts: r.allow_hosts.clone(),
        gateway_routes: r.gateway_routes.clone(),
        exposed_routes: r.exposed_routes.clone(),
        write_roots: r.write_roots.clone(),
        host_uid: r.host_uid,
        own_uid: r.own_uid,
        inside_uid: r.inside_uid,
        seccomp_digest: r.seccomp_digest.clone(),
        userns_disabled: r.userns_disabled,
        limits: r
            .limits
            .iter()
            .map(|l| pb::LimitReceipt { name: l.name.clone(), value: l.value, mechanism: l.mechanism.clone() })
            .collect(),
    }
}

fn profile_status(s: catalog::ProfileStatus) -> pb::ProfileStatus {
    match s {
        catalog::ProfileStatus::Enabled => pb::ProfileStatus::Enabled,
        catalog::ProfileStatus::Disabled => pb::ProfileStatus::Disabled,
    }
}

fn preset(p: catalog::Preset) -> pb::ReinPreset {
    match p {
        catalog::Preset::Protocol => pb::ReinPreset::Protocol,
        catalog::Preset::ClaudeStreamJson => pb::ReinPreset::ClaudeStreamJson,
        catalog::Preset::CodexExecJson => pb::ReinPreset::CodexExecJson,
    }
}

fn task_input(t: catalog::TaskInput) -> pb::TaskInput {
    match t {
        catalog::TaskInput::TaskJson => pb::TaskInput::TaskJson,
        catalog::TaskInput::Description => pb::TaskInput::Description,
        catalog::TaskInput::Prompt => pb::TaskInput::Prompt,
        catalog::TaskInput::Nothing => pb::TaskInput::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::words::Word as _;

    /// The typed domain enums land on the wire value whose word is the one
    /// serde writes in profiles (so `corral profiles` prints what the TOML
    /// says).
    #[test]
    fn profile_enums_keep_their_words() {
        fn serde_word<T: serde::Serialize>(value: T) -> String {
            serde_json::to_value(value).unwrap().as_str().unwrap().to_owned()
        }
        use catalog::{Preset, ProfileStatus, TaskInput};
        for p in [Preset::Protocol, Preset::ClaudeStreamJson, Preset::CodexExecJson] {
            assert_eq!(preset(p).word(), serde_word(p));
        }
        for t in [TaskInput::TaskJson, TaskInput::Description, TaskInput::Prompt, TaskInput::Nothing] {
            assert_eq!(task_input(t).word(), serde_word(t));
        }
        for s in [ProfileStatus::Enabled, ProfileStatus::Disabled] {
            assert_eq!(profile_status(s).word(), serde_word(s));
        }
    }
}

/// A profile's limits on the wire.
pub fn wire_limits(l: &crate::catalog::Limits) -> pb::Limits {
    pb::Limits {
        timeout_seconds: l.timeout_seconds,
        max_output_bytes: l.max_output_bytes,
        max_processes: l.max_processes,
        memory_bytes: l.memory_bytes,
        cpu_millis: l.cpu_millis,
        max_workspace_bytes: l.max_workspace_bytes,
        max_open_files: l.max_open_files,
        address_space_bytes: l.address_space_bytes,
        tmp_bytes: l.tmp_bytes,
        max_events: l.max_events,
        max_event_bytes: l.max_event_bytes,
        max_workspace_inodes: l.max_workspace_inodes,
        shm_bytes: l.shm_bytes,
    }
}

/// A profile's limits as the wire says them (the bench's floor rebuilds a
/// daemon's sandbox from them): the inverse of [`wire_limits`].
pub fn limits_from_wire(l: &pb::Limits) -> crate::catalog::Limits {
    crate::catalog::Limits {
        timeout_seconds: l.timeout_seconds,
        max_output_bytes: l.max_output_bytes,
        max_processes: l.max_processes,
        memory_bytes: l.memory_bytes,
        cpu_millis: l.cpu_millis,
        max_workspace_bytes: l.max_workspace_bytes,
        max_workspace_inodes: l.max_workspace_inodes,
        max_open_files: l.max_open_files,
        address_space_bytes: l.address_space_bytes,
        tmp_bytes: l.tmp_bytes,
        shm_bytes: l.shm_bytes,
        max_events: l.max_events,
        max_event_bytes: l.max_event_bytes,
    }
}

#[cfg(test)]
mod limits_tests {
    use super::*;

    #[test]
    fn limits_survive_the_wire_both_ways() {
        // Every field a different value: a field dropped or swapped shows.
        let limits = crate::catalog::Limits {
            timeout_seconds: 1,
            max_output_bytes: 2,
            max_processes: 3,
            memory_bytes: 4,
            cpu_millis: 5,
            max_workspace_bytes: 6,
            max_workspace_inodes: 7,
            max_open_files: 8,
            address_space_bytes: 9,
            tmp_bytes: 10,
            shm_bytes: 11,
            max_events: 12,
            max_event_bytes: 13,
        };
        assert_eq!(limits_from_wire(&wire_limits(&limits)), limits);
    }
}

/// A node of the fleet on the wire.
pub fn node(n: &crate::store::NodeRow) -> pb::Node {
    let state = match n.state {
        crate::store::NodeState::Active => pb::NodeState::Active,
        crate::store::NodeState::Draining => pb::NodeState::Draining,
        crate::store::NodeState::Lost => pb::NodeState::Lost,
        crate::store::NodeState::Stopped => pb::NodeState::Stopped,
    };
    pb::Node {
        name: n.name.clone(),
        epoch: n.epoch.clone(),
        state: state as i32,
        capacity: n.capacity,
        labels: n.labels.clone(),
        version: n.version.clone(),
        started_at_ms: n.started_at_ms,
        lease_until_ms: n.lease_until_ms,
        running: n.running,
        renewed_at_ms: n.renewed_at_ms,
        drained: n.drained(),
    }
}
