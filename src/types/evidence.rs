//! Evidence: the normalized, redacted record of what an execution did.
//!
//! Everything here is safe for watchers, hubs and logs: the error is a
//! fixed sentence per failure stage, never the raw error, and there is no
//! field for raw output. Records written by an older version load with
//! `unknown` for the fields they lack (every field has a serde default).

use serde::{Deserialize, Serialize};

use super::{Action, PolicyDecision, Readiness};

/// How a run ended, as the evidence reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Not known: the run has not ended, or its record predates the field.
    #[default]
    Unknown,
    /// It did what was asked.
    Succeeded,
    /// It failed at some stage (see `failure_stage`).
    Failed,
    /// It was refused at resolution or by the gate.
    Refused,
    /// It was cancelled.
    Cancelled,
}

/// The stage whose failure decided the outcome; the first failure wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureStage {
    /// Resolving the profile (unknown, disabled, blocked or unusable profiles,
    /// missing credentials).
    Resolution,
    /// The policy gate denied it.
    Gate,
    /// Creating the sandbox.
    SandboxCreate,
    /// Starting the harness.
    SessionStart,
    /// Running the task.
    Execution,
    /// Tearing down: ending the session, destroying the sandbox, capturing the
    /// workspace.
    Teardown,
}

impl FailureStage {
    /// The sentence the evidence carries for a failure at this stage. Raw
    /// errors go only to the direct caller.
    pub fn fixed_error(self) -> &'static str {
        match self {
            FailureStage::Resolution => "resolution refused; its principal reads the cause with `corral get --full`",
            FailureStage::Gate => "gate denied; its principal reads the cause with `corral get --full`",
            FailureStage::SandboxCreate => {
                "sandbox creation failed; its principal reads the cause with `corral get --full`"
            }
            FailureStage::SessionStart => {
                "session start failed; its principal reads the cause with `corral get --full`"
            }
            FailureStage::Execution => "execution failed; its principal reads the cause with `corral get --full`",
            FailureStage::Teardown => "teardown failed; its principal reads the cause with `corral get --full`",
        }
    }

    /// The sentence a session's evidence carries for a failure at this
    /// stage: `corral get --full` reads executions, and a session's raw
    /// cause goes only to the call that started or ended it.
    pub fn session_error(self) -> &'static str {
        match self {
            FailureStage::Resolution => "resolution refused; the cause went to the call that started the session",
            FailureStage::Gate => "gate denied; the cause went to the call that started the session",
            FailureStage::SandboxCreate => {
                "sandbox creation failed; the cause went to the call that started the session"
            }
            FailureStage::SessionStart => "session start failed; the cause went to the call that started the session",
            FailureStage::Execution => "session failed; the cause went to the call that ended it",
            FailureStage::Teardown => "teardown failed; the cause went to the call that ended the session",
        }
    }

    /// The stage's snake_case word, as stored and reported.
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

/// How one teardown step went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TeardownResult {
    /// It was done.
    Succeeded,
    /// It was tried and failed.
    Failed,
    /// It was not needed or not reached.
    NotAttempted,
    /// Not known: the record predates the field.
    #[default]
    Unknown,
}

/// Where a run's report to the hub stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HubReportStatus {
    /// The caller did not ask for a report.
    NotRequested,
    /// Asked for and not delivered yet.
    Pending,
    /// The hub took the report.
    Accepted,
    /// It will not be delivered: no hub is configured, or the hub did not
    /// accept it within `max_age_seconds`.
    Failed,
    /// Not known: the record predates the field.
    #[default]
    Unknown,
}

/// Stored as `["stage", micros]` (a record has one per stage); the
/// `{"stage": …, "micros": …}` form of older records still reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "(String, u64)", from = "StoredTiming")]
pub struct StageTiming {
    /// The stage's name (`resolve`, `gate`, `sandbox_create`, `harness`,
    /// `total`, ...).
    pub stage: String,
    /// How long it took, in microseconds.
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

/// The normalized, redacted record of what a run did (see the module doc).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Evidence {
    /// How the run ended.
    pub outcome: Outcome,
    /// The stage whose failure decided the outcome; `None` when nothing failed.
    pub failure_stage: Option<FailureStage>,
    /// A fixed sentence per failure stage, or the daemon's own reason for a
    /// refusal; never the raw error.
    pub error: String,
    /// How ending the harness's session went.
    pub session_cleanup: TeardownResult,
    /// How destroying the sandbox went.
    pub sandbox_destroy: TeardownResult,
    /// The pinned `id@version` of the resolved profile; empty before
    /// resolution.
    pub profile_ref: String,
    /// The resolved profile's digest.
    pub profile_digest: String,
    /// The resolved profile's readiness; `None` before resolution.
    pub readiness: Option<Readiness>,
    /// The profile's rein kind (the adapter that ran the harness); empty before
    /// resolution.
    pub rein: String,
    /// The sandbox's id; empty when none was created.
    pub sandbox_id: String,
    /// The commit that came back as `refs/corral/<id>`; empty when none did,
    /// never the starting commit.
    pub commit_sha: String,
    /// Tokens the harness reported spending.
    pub tokens_spent: u64,
    /// The model the harness reported using; empty when it reported none.
    pub resolved_model: String,
    /// Every policy verdict of every gate evaluation of the run, in order.
    pub gate_decisions: Vec<PolicyDecision>,
    /// Where the report to the hub stands.
    pub hub_report_status: HubReportStatus,
    /// The caller's idempotency key; empty for a session.
    pub request_id: String,
    /// The caller's own reference, as it was given.
    pub correlation_id: String,
    /// The caller's assignment reference, as it was given.
    pub assignment_ref: String,
    /// Remarks in the daemon's own words (a tightened sandbox, an unverified
    /// profile, a cut output).
    pub notes: Vec<String>,
    /// How long each stage took.
    pub stage_timings: Vec<StageTiming>,
    /// What the sandbox's egress proxy decided.
    pub egress: EgressSummary,
    /// The daemon committed work the agent left uncommitted.
    pub workspace_snapshot: bool,
    /// Commits the agent made itself.
    pub agent_commits: u64,
    /// The tool_call gate's decisions, counted.
    pub tool_calls: ToolCallCounts,
    /// What kind of failure it was, in a fixed vocabulary every reader may
    /// see (see [`failure_class`]); empty when it did not fail.
    pub failure_class: String,
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
    /// The command line, with every flag the daemon added.
    pub argv: Vec<String>,
    /// The names, never the values, of its environment variables.
    pub env_names: Vec<String>,
    /// The model endpoint it was given; empty when none.
    pub base_url: String,
    /// The model it was given; empty when none.
    pub model: String,
    /// `(path as the harness sees it, sha256)` of each file written for it.
    pub files: Vec<(String, String)>,
}

/// The tool_call gate's decisions: `allowed` and `denied` count outcomes
/// (an asked call once more when it is decided), `asked` the calls that
/// waited for a person.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ToolCallCounts {
    /// Calls allowed (an asked call counts here too once it is allowed).
    pub allowed: u64,
    /// Calls denied (an asked call counts here too once it is denied).
    pub denied: u64,
    /// Calls that waited for a person.
    pub asked: u64,
}

impl ToolCallCounts {
    /// Counts one tool_call gate outcome under its action.
    pub fn count(&mut self, action: Action) {
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
    /// Attempts the proxy let through.
    pub allowed: u64,
    /// Attempts the proxy denied.
    pub denied: u64,
    /// The first distinct `host:port`s denied (at most 10).
    pub denied_hosts: Vec<String>,
    /// Bytes up and down per allowed host.
    pub bytes: Vec<HostBytes>,
}

/// The bytes of one allowed host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostBytes {
    /// The host, as the sandbox named it.
    pub host: String,
    /// Bytes sent to it.
    pub up: u64,
    /// Bytes received from it.
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

    /// A session's evidence: the stage's sentence (not a refusal's own
    /// reason) becomes the session's, which says where its cause went.
    pub fn of_session(&mut self) {
        if let Some(stage) = self.failure_stage.filter(|stage| self.error == stage.fixed_error()) {
            self.error = stage.session_error().into();
        }
    }

    /// The first failure's class, from its stage and raw error (which is
    /// not kept here: only the class and a status code are).
    pub fn classify(&mut self, stage: FailureStage, raw_error: &str) {
        if self.failure_class.is_empty() {
            self.failure_class = failure_class(stage, raw_error);
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

    /// Records how long `stage` took, measured from `started` until now.
    pub fn time(&mut self, stage: &str, started: std::time::Instant) {
        self.stage_timings.push(StageTiming { stage: stage.to_string(), micros: started.elapsed().as_micros() as u64 });
    }
}

/// A failure in a fixed vocabulary: `model_api_error <status>`,
/// `credential_missing`, `timed_out`, `cancelled`, `tool_refused`,
/// `harness_exited`, `harness_failed`, `policy_denied`, `profile_refused`,
/// `sandbox_create_failed`, `harness_start_failed`, `workspace_over_budget`,
/// `teardown_failed`. Only words of this list and a status number leave
/// the raw error.
pub fn failure_class(stage: FailureStage, raw: &str) -> String {
    if let Some(at) = raw.find("model API error ") {
        let status: String = raw[at + 16..].chars().take_while(|c| c.is_ascii_digit()).take(3).collect();
        return if status.is_empty() { "model_api_error".into() } else { format!("model_api_error {status}") };
    }
    let class = match stage {
        FailureStage::Resolution if raw.contains("credential route") => "credential_missing",
        FailureStage::Resolution => "profile_refused",
        FailureStage::Gate => "policy_denied",
        FailureStage::SandboxCreate => "sandbox_create_failed",
        FailureStage::SessionStart if raw.contains("credential route") => "credential_missing",
        FailureStage::SessionStart => "harness_start_failed",
        FailureStage::Teardown => "teardown_failed",
        FailureStage::Execution if raw.contains("timed out") => "timed_out",
        FailureStage::Execution if raw.contains("cancelled") => "cancelled",
        FailureStage::Execution if raw.contains("refused permission") => "tool_refused",
        FailureStage::Execution if raw.contains("workspace") && raw.contains("limit") => "workspace_over_budget",
        FailureStage::Execution if raw.contains("harness exited with status") || raw.contains("killed by a signal") => {
            "harness_exited"
        }
        FailureStage::Execution => "harness_failed",
    };
    class.into()
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
        assert_eq!(evidence.error, "execution failed; its principal reads the cause with `corral get --full`");
    }

    #[test]
    fn older_records_load_with_unknown() {
        let evidence: Evidence = serde_json::from_str(r#"{"outcome":"succeeded"}"#).unwrap();
        assert_eq!(evidence.session_cleanup, TeardownResult::Unknown);
        assert_eq!(evidence.sandbox_destroy, TeardownResult::Unknown);
        assert_eq!(evidence.hub_report_status, HubReportStatus::Unknown);
    }
}

#[cfg(test)]
mod class_tests {
    use super::{failure_class, FailureStage};

    #[test]
    fn failures_are_classed_in_a_fixed_vocabulary() {
        let cases = [
            (
                FailureStage::Execution,
                "Claude Code failed: model API error 400 invalid_request_error: s3cret",
                "model_api_error 400",
            ),
            (FailureStage::Execution, "model API error x", "model_api_error"),
            (
                FailureStage::Resolution,
                "profile p cannot run: credential route anthropic: $K is not set",
                "credential_missing",
            ),
            (FailureStage::Resolution, "unknown harness profile x", "profile_refused"),
            (FailureStage::Gate, "denied by policy p: r", "policy_denied"),
            (FailureStage::Execution, "harness timed out after 5s", "timed_out"),
            (FailureStage::Execution, "cancelled", "cancelled"),
            (FailureStage::Execution, "Claude Code was refused permission for 1 tool call(s)", "tool_refused"),
            (FailureStage::Execution, "harness exited with status 3: boom", "harness_exited"),
            (FailureStage::Execution, "anything else the harness said", "harness_failed"),
            (FailureStage::SandboxCreate, "no free sandbox uid", "sandbox_create_failed"),
            (FailureStage::SessionStart, "harness start failed: x", "harness_start_failed"),
            (FailureStage::Teardown, "workspace capture: y", "teardown_failed"),
        ];
        for (stage, raw, class) in cases {
            assert_eq!(failure_class(stage, raw), class, "{raw}");
            assert!(!failure_class(stage, raw).contains("s3cret"));
        }
    }
}
