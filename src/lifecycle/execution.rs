//! An execution: a one-turn session. accepted → open → one `run_task` turn
//! → close → finished, with evidence.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::core::{Core, OpenFailure, TurnOutcome};
use super::fit::{fit_raw, json_len};
use super::{now_ms, Engine, ExecuteCommand, ExecutionRecord, ExecutionState, RawResult};
use crate::events::{EventKind, RawPart, Recorder};
use crate::rein::{Task, ToolCall};
use crate::sandbox::WORKSPACE_MOUNT;
use crate::types::evidence::{FailureStage, HubReportStatus, Outcome};

pub(super) async fn run(
    engine: Arc<Engine>,
    mut record: ExecutionRecord,
    cmd: ExecuteCommand,
    cancel: CancellationToken,
) {
    let started = Instant::now();
    let recorder = Recorder::new(record.execution_id.clone(), 0, engine.store.clone(), engine.bus.clone());
    let mut core = Core::new(engine, recorder, record.consumer.clone(), cmd.repo.clone(), Vec::new());
    core.evidence = std::mem::take(&mut record.evidence);
    let accepted = EventKind::Accepted {
        execution_id: record.execution_id.clone(),
        session_id: String::new(),
        request_id: record.request_id.clone(),
        consumer: record.consumer.clone(),
    };
    // Stored with `resolved` and the gate's decision in one write: with
    // the intent row of the sandbox made for the run, alone when it takes
    // a warm one, with the final record when none is made.
    core.recorder.hold(accepted);

    let mut cancelled = false;
    match core.open(&cmd.harness_profile_ref, &cancel).await {
        Ok(()) => {
            let call = ToolCall {
                tool: "run_task".into(),
                task: Task {
                    kind: "task",
                    tool: "run_task".into(),
                    arguments: serde_json::Value::Null,
                    execution_id: record.execution_id.clone(),
                    session_id: String::new(),
                    title: cmd.title.clone(),
                    description: cmd.description.clone(),
                    workspace: WORKSPACE_MOUNT.into(),
                },
            };
            match core.turn(call, cancel.clone()).instrument(tracing::info_span!("harness")).await {
                TurnOutcome::Done(result) => {
                    core.raw.tool_output = result.output;
                    if !result.ok {
                        core.failed(FailureStage::Execution, &result.error);
                    }
                }
                TurnOutcome::Denied { policy, reason } => {
                    core.evidence.refuse(FailureStage::Gate, &format!("denied by policy {policy}: {reason}"));
                    core.raw.tool_error = format!("tool_call denied by policy {policy}: {reason}");
                }
                TurnOutcome::Failed(e) => core.failed(FailureStage::Execution, &e.to_string()),
                TurnOutcome::Cancelled => cancelled = true,
            }
            core.close(cancelled).instrument(tracing::info_span!("teardown")).await;
        }
        Err(OpenFailure::Cancelled) => {
            cancelled = true;
            core.close(true).instrument(tracing::info_span!("teardown")).await;
        }
        Err(_) => core.close(false).instrument(tracing::info_span!("teardown")).await,
    }
    finish(&mut core, &mut record, cancelled, started).await;
}

async fn finish(core: &mut Core, record: &mut ExecutionRecord, cancelled: bool, started: Instant) {
    let mut evidence = std::mem::take(&mut core.evidence);
    evidence.outcome = match evidence.failure_stage {
        _ if cancelled => Outcome::Cancelled,
        Some(FailureStage::Resolution | FailureStage::Gate) => Outcome::Refused,
        Some(_) => Outcome::Failed,
        None => Outcome::Succeeded,
    };
    if cancelled {
        core.raw.tool_error = "cancelled".into();
        if evidence.error.is_empty() {
            evidence.error = "execution cancelled".into();
        }
    }
    evidence.time("total", started);
    record.evidence = evidence;
    record.effective_sandbox = core.effective();
    record.state = ExecutionState::from_outcome(record.evidence.outcome);
    record.finished_at_ms = Some(now_ms());
    // The `finished` event carries the record and the raw parts to the
    // direct caller in one message: cut the raw parts to fit it, and say so.
    core.raw.without_nul();
    let cut = fit_raw(&mut core.raw, json_len(record), core.engine.max_message_bytes);
    if !cut.is_empty() {
        record.evidence.notes.push("the raw output was cut to fit one message; see output_truncated".into());
        core.recorder.emit_batch(cut.into_iter().map(|e| (e, None)).collect()).await;
    }
    // Out of admission's count before anyone hears it finished, so a caller
    // may start the next one at once (its sandbox is gone already).
    core.engine.release(&record.execution_id);
    crate::telemetry::execution_finished(&record.evidence);
    // Its raw result is kept scrubbed, like everything the harness said,
    // for the owner and adm.
    let raw = std::mem::take(&mut core.raw);
    if !store_finished(&core.engine, &mut core.recorder, record, Some(raw)).await {
        tracing::error!(execution_id = %record.execution_id, "execution record not stored");
    }
    // The caller's stream, which the publish woke, sends `finished` before
    // this task goes on: the reclaim spawned below would take the stream's
    // place in this thread's next-task slot, and the caller would wait for
    // the sandbox's cgroup, uid and files to be given back.
    tokio::task::yield_now().await;
    core.reclaim_sandbox();
    crate::telemetry::finished_span(&tracing::Span::current(), &record.evidence);
    tracing::info!(
        execution_id = %record.execution_id,
        outcome = crate::telemetry::serde_label(&record.evidence.outcome),
        stage = record.evidence.failure_stage.map(|s| s.as_str()).unwrap_or("none"),
        class = record.evidence.failure_class.as_str(),
        "execution finished"
    );
}

/// Stores an execution's final record, its raw result, its hub report
/// (when it asked for one and a hub is configured) and its `finished`
/// event in one transaction, then sends the event (with the raw result,
/// for the direct caller) and wakes the hub's reporter. `false` when the
/// store refused: nothing was stored or sent.
pub(super) async fn store_finished(
    engine: &Engine,
    recorder: &mut Recorder,
    record: &ExecutionRecord,
    raw: Option<RawResult>,
) -> bool {
    let finishing = without_a_hub(engine, record);
    let record: &ExecutionRecord = &finishing;
    // The report goes into the outbox with the final record, or not at all.
    let report = match (&engine.hub, record.report_to_hub) {
        (Some(_), true) => Some(crate::hub::report(record).to_string()),
        _ => None,
    };
    let finished = recorder.prepare(EventKind::Finished { execution: Box::new(record.clone()) }).await;
    let store = &engine.store;
    let kept = raw.as_ref().map(|r| (r.tool_output.as_str(), r.tool_error.as_str()));
    let stored = recorder
        .persist_final_with(finished.len(), &engine.grace_over(), || {
            store.finish_execution(record, report.as_deref(), kept, &finished)
        })
        .await;
    if stored {
        if let (Some(hub), Some(_)) = (&engine.hub, &report) {
            hub.notify();
        }
        recorder.publish(finished, raw.map(RawPart::Finished));
    }
    stored
}

/// The record as this node can finish it: a report the accepting node
/// left `pending` cannot be delivered by a node without a hub (an outbox
/// row is delivered by the node that wrote it), so it is `failed` with the
/// reason rather than `pending` forever.
fn without_a_hub<'a>(engine: &Engine, record: &'a ExecutionRecord) -> Cow<'a, ExecutionRecord> {
    if engine.hub.is_some() || !record.report_to_hub || record.evidence.hub_report_status != HubReportStatus::Pending {
        return Cow::Borrowed(record);
    }
    let mut record = record.clone();
    record.evidence.hub_report_status = HubReportStatus::Failed;
    record.evidence.notes.push(format!(
        "report_to_hub was asked but node {}, which finished the execution, has no hub configured",
        engine.store.node()
    ));
    Cow::Owned(record)
}
