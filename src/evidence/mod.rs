//! Evidence: the normalized, redacted record of what an execution did.
//!
//! Everything here is safe for watchers, hubs and logs: the error is a
//! fixed sentence per failure stage, never the raw error, and there is no
//! field for raw output. Records written by an older version load with
//! `unknown` for the fields they lack (every field has a serde default).

use serde::{Deserialize, Serialize};

use crate::catalog::Readiness;
use crate::policy::PolicyDecision;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    #[default]
    Unknown,
    Succeeded,
    Failed,
    Refused,
    Cancelled,
}

/// The stage whose failure decided the outcome; the first failure wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureStage {
    Resolution,
    Gate,
    SandboxCreate,
    SessionStart,
    Execution,
    Teardown,
}

impl FailureStage {
    /// The sentence the evidence carries for a failure at this stage. Raw
    /// errors go only to the direct caller.
    pub fn fixed_error(self) -> &'static str {
        match self {
            FailureStage::Resolution => "resolution refused; inspect direct caller error",
            FailureStage::Gate => "gate denied; inspect direct caller error",
            FailureStage::SandboxCreate => "sandbox creation failed; inspect direct caller error",
            FailureStage::SessionStart => "session start failed; inspect direct caller error",
            FailureStage::Execution => "execution failed; inspect direct caller error",
            FailureStage::Teardown => "teardown failed; inspect direct caller error",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FailureStage::Resolution => "resolution",
            FailureStage::Gate => "gate",
            FailureStage::SandboxCreate => "sandbox_create",
            FailureStage::SessionStart => "session_start",
            FailureStage::Execution => "execution",
            FailureStage::Teardown => "teardown",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TeardownResult {
    Succeeded,
    Failed,
    NotAttempted,
    #[default]
    Unknown,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HubReportStatus {
    NotRequested,
    Pending,
    Accepted,
    Failed,
    #[default]
    Unknown,
}

/// Stored as `["stage", micros]` (a record has one per stage); the
/// `{"stage": …, "micros": …}` form of older records still reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "(String, u64)", from = "StoredTiming")]
pub struct StageTiming {
    pub stage: String,
    pub micros: u64,
}

impl From<StageTiming> for (String, u64) {
    fn from(t: StageTiming) -> Self {
        (t.stage, t.micros)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StoredTiming {
    Pair(String, u64),
    Object {
        #[serde(default)]
        stage: String,
        #[serde(default)]
        micros: u64,
    },
}

impl From<StoredTiming> for StageTiming {
    fn from(t: StoredTiming) -> Self {
        match t {
            StoredTiming::Pair(stage, micros) | StoredTiming::Object { stage, micros } => StageTiming { stage, micros },
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Evidence {
    pub outcome: Outcome,
    pub failure_stage: Option<FailureStage>,
    pub error: String,
    pub session_cleanup: TeardownResult,
    pub sandbox_destroy: TeardownResult,
    pub profile_ref: String,
    pub profile_digest: String,
    pub readiness: Option<Readiness>,
    pub rein: String,
    pub sandbox_id: String,
    pub commit_sha: String,
    pub tokens_spent: u64,
    pub resolved_model: String,
    pub gate_decisions: Vec<PolicyDecision>,
    pub hub_report_status: HubReportStatus,
    pub request_id: String,
    pub correlation_id: String,
    pub assignment_ref: String,
    pub notes: Vec<String>,
    pub stage_timings: Vec<StageTiming>,
    /// What the sandbox's egress proxy decided.
    pub egress: EgressSummary,
    /// The daemon committed work the agent left uncommitted.
    pub workspace_snapshot: bool,
    /// Commits the agent made itself.
    pub agent_commits: u64,
    /// The tool_call gate's decisions, counted.
    pub tool_calls: ToolCallCounts,
    /// How the harness was started (the last start of a session's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub harness: Option<HarnessInvocation>,
}

/// The harness as the daemon started it: argv, the names of its
/// environment variables, its model endpoint and model, and `(path, sha256)`
/// of each file written for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HarnessInvocation {
    pub argv: Vec<String>,
    pub env_names: Vec<String>,
    pub base_url: String,
    pub model: String,
    pub files: Vec<(String, String)>,
}

/// The tool_call gate's decisions: `allowed` and `denied` count outcomes
/// (an asked call once more when it is decided), `asked` the calls that
/// waited for a person.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ToolCallCounts {
    pub allowed: u64,
    pub denied: u64,
    pub asked: u64,
}

impl ToolCallCounts {
    pub fn count(&mut self, action: crate::policy::Action) {
        use crate::policy::Action;
        match action {
            Action::Allow => self.allowed += 1,
            Action::Deny => self.denied += 1,
            Action::Ask => self.asked += 1,
        }
    }
}

/// Egress of a run: every attempt counted, the first denied hosts named,
/// bytes per allowed host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EgressSummary {
    pub allowed: u64,
    pub denied: u64,
    /// The first distinct `host:port`s denied (at most 10).
    pub denied_hosts: Vec<String>,
    pub bytes: Vec<HostBytes>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostBytes {
    pub host: String,
    pub up: u64,
    pub down: u64,
}

impl Evidence {
    /// Records a failure unless an earlier one already decided the stage
    /// (rule 6: the first failure decides `failure_stage`).
    pub fn fail(&mut self, stage: FailureStage) {
        if self.failure_stage.is_none() {
            self.failure_stage = Some(stage);
            self.error = stage.fixed_error().to_string();
        }
    }

    /// A refusal: the reason is the daemon's own words (e.g. `unknown
    /// harness profile`), never harness output, so it is kept.
    pub fn refuse(&mut self, stage: FailureStage, reason: &str) {
        if self.failure_stage.is_none() {
            self.failure_stage = Some(stage);
            self.error = reason.to_string();
        }
    }

    pub fn time(&mut self, stage: &str, started: std::time::Instant) {
        self.stage_timings.push(StageTiming { stage: stage.to_string(), micros: started.elapsed().as_micros() as u64 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_timing_is_stored_as_a_pair_and_reads_in_either_form() {
        let t = StageTiming { stage: "gate".into(), micros: 10 };
        assert_eq!(serde_json::to_string(&t).unwrap(), r#"["gate",10]"#);
        assert_eq!(serde_json::from_str::<StageTiming>(r#"["gate",10]"#).unwrap(), t);
        assert_eq!(serde_json::from_str::<StageTiming>(r#"{"stage":"gate","micros":10}"#).unwrap(), t);
        let zero = StageTiming { stage: "workspace".into(), micros: 0 };
        assert_eq!(serde_json::from_str::<StageTiming>(r#"{"stage":"workspace"}"#).unwrap(), zero);
    }

    #[test]
    fn first_failure_decides_the_stage() {
        let mut evidence = Evidence::default();
        evidence.fail(FailureStage::Execution);
        evidence.fail(FailureStage::Teardown);
        assert_eq!(evidence.failure_stage, Some(FailureStage::Execution));
        assert_eq!(evidence.error, "execution failed; inspect direct caller error");
    }

    #[test]
    fn older_records_load_with_unknown() {
        let evidence: Evidence = serde_json::from_str(r#"{"outcome":"succeeded"}"#).unwrap();
        assert_eq!(evidence.session_cleanup, TeardownResult::Unknown);
        assert_eq!(evidence.sandbox_destroy, TeardownResult::Unknown);
        assert_eq!(evidence.hub_report_status, HubReportStatus::Unknown);
    }
}
