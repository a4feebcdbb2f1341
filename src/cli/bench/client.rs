//! The bench's side of the wire: one `Execute`, followed to its `finished`
//! event, with what the measurements need from it.

use std::time::{Duration, Instant};

use super::target::Channel;

use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;

/// What one `Execute` stream told the bench.
#[derive(Clone, Debug, Default)]
pub struct Executed {
    /// From sending the request to receiving the `finished` event.
    pub client: Duration,
    pub execution_id: String,
    pub state: i32,
    /// The execution's own stage timings (µs), as stored in its evidence.
    pub stages: Vec<(String, u64)>,
    pub sandbox_id: Option<String>,
    /// The host path of the workspace (its parent is the sandbox root).
    pub workspace_path: Option<String>,
    pub command_digest: Option<String>,
    pub effective_sandbox: Option<pb::SandboxSpec>,
    /// Its sandbox was made ahead, in a warm pool (the evidence says so).
    pub warm: bool,
    /// From receiving `accepted` to receiving `dispatched`, client-side.
    pub accepted_to_dispatched: Option<Duration>,
}

impl Executed {
    pub fn succeeded(&self) -> bool {
        self.state == pb::ExecutionState::Succeeded as i32
    }

    pub fn state_name(&self) -> String {
        pb::ExecutionState::try_from(self.state)
            .map(|s| s.as_str_name().trim_start_matches("EXECUTION_STATE_").to_string())
            .unwrap_or_else(|_| format!("STATE_{}", self.state))
    }

    pub fn stage_micros(&self, stage: &str) -> Option<u64> {
        self.stages.iter().find(|(s, _)| s == stage).map(|(_, us)| *us)
    }
}

/// The request every bench execution sends.
pub fn request(profile: &str, title: &str, description: &str) -> pb::ExecuteRequest {
    pb::ExecuteRequest {
        harness_profile_ref: profile.to_string(),
        title: title.to_string(),
        description: description.to_string(),
        // The caller's own type (the local admin for the in-process daemon).
        actor: String::new(),
        project: "bench".into(),
        ..Default::default()
    }
}

/// Runs one `Execute` and reads its stream to the end.
pub async fn execute(channel: &Channel, request: pb::ExecuteRequest) -> Result<Executed, tonic::Status> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let started = Instant::now();
    let mut stream = client.execute(request).await?.into_inner();
    let mut executed = Executed::default();
    let mut accepted = None;
    while let Some(event) = stream.message().await? {
        match event.kind {
            Some(Kind::Accepted(_)) => accepted = Some(Instant::now()),
            Some(Kind::Dispatched(_)) => executed.accepted_to_dispatched = accepted.map(|at| at.elapsed()),
            Some(Kind::SandboxReady(ready)) => {
                executed.sandbox_id = Some(ready.sandbox_id);
                executed.workspace_path = Some(ready.workspace_path);
                executed.command_digest = ready.receipt.map(|r| r.command_digest);
            }
            Some(Kind::Finished(finished)) => {
                let Some(pb::finished::Record::Execution(execution)) = finished.record else { continue };
                executed.client = started.elapsed();
                executed.execution_id = execution.execution_id;
                executed.state = execution.state;
                executed.effective_sandbox = execution.effective_sandbox;
                if let Some(evidence) = execution.evidence {
                    executed.warm = evidence.notes.iter().any(|n| n.contains("warm pool"));
                    executed.stages = evidence.stage_timings.into_iter().map(|t| (t.stage, t.micros)).collect();
                }
            }
            _ => {}
        }
    }
    if executed.execution_id.is_empty() {
        return Err(tonic::Status::unknown("the Execute stream ended without a finished event"));
    }
    Ok(executed)
}

/// A status code's name as the report counts it (`RESOURCE_EXHAUSTED`).
pub fn code_name(code: tonic::Code) -> String {
    let debug = format!("{code:?}");
    let mut name = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names_are_screaming_snake_case() {
        assert_eq!(code_name(tonic::Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(tonic::Code::Ok), "OK");
        assert_eq!(code_name(tonic::Code::DeadlineExceeded), "DEADLINE_EXCEEDED");
    }
}
