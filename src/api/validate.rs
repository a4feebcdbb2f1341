//! Input validation at the edge: the one module that knows each field's
//! grammar — profile references (`id` or `id@semver`, the catalog's own
//! rule), ids, client tokens, text, repository paths, enums, page sizes and
//! tokens, policies and tool calls. Every RPC of every service checks its
//! request here first, so the same bad value gets the same INVALID_ARGUMENT
//! naming the field (in `google.rpc.BadRequest`), before anything is stored
//! or created.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;
use tonic::Status;

use super::page::PageTokens;
use super::status::invalid_argument;
use super::words::Word;
use crate::auth::Principal;
use crate::catalog::ProfileRef;
use crate::lifecycle::{ExecuteCommand, ExecutionState};
use crate::pb;
use crate::policy::PolicySpec;

pub const MAX_TITLE: usize = 1024;
pub const MAX_DESCRIPTION: usize = 256 * 1024;
/// Ids and client tokens (request ids, actors, projects): far above any
/// real identifier. An actor string that is no governed type is refused at
/// resolution with the contract's sentence, whatever its length up to this.
pub const MAX_ID: usize = 128;
/// A reference: a profile id, `@`, and a version.
pub const MAX_REF: usize = 200;
pub const MAX_PATH: usize = 4096;
pub const MAX_PAGE: u32 = 500;
pub const DEFAULT_PAGE: u32 = 50;
pub const MAX_POLICIES: usize = 32;
pub const MAX_POLICY_ARGUMENTS: usize = 16 * 1024;
pub const MAX_SELECTORS: usize = 16;
/// A tool call's JSON arguments.
pub const MAX_ARGUMENTS: usize = 256 * 1024;

/// A client token (request id, correlation id, actor, project, ...):
/// empty, or up to `MAX_ID` bytes of printable ASCII without spaces.
pub fn token(field: &str, value: &str) -> Result<(), Status> {
    if value.len() > MAX_ID {
        return Err(invalid_argument(field, format!("at most {MAX_ID} bytes, got {}", value.len())));
    }
    if !value.chars().all(|c| c.is_ascii_graphic()) {
        return Err(invalid_argument(field, "printable ASCII without spaces only"));
    }
    Ok(())
}

/// An id naming a record (execution, session): a non-empty token.
pub fn id(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid_argument(field, "must not be empty"));
    }
    token(field, value)
}

/// The id a caller chooses for a new session: empty (the daemon picks a
/// UUID), or a token that is also always one component of a git ref name
/// (the session's work comes back as `refs/corral/<principal>/<id>`, see
/// `git check-ref-format`): none of `/ : ? * [ \\ ~ ^`, no `..` or `@{`,
/// not `@`, not starting with `.` or `-`, not ending with `.` or `.lock`.
pub fn session_id(field: &str, value: &str) -> Result<(), Status> {
    token(field, value)?;
    if value.is_empty() {
        return Ok(());
    }
    match crate::types::ref_component_problem(value) {
        Some(why) => Err(invalid_argument(field, format!("{why} (it names a git ref)"))),
        None => Ok(()),
    }
}

/// A session a call names: an id as its creator chose it, or in full as
/// stored (`<principal>/<id>`, see `scoped_session_id`), so up to a
/// principal name (64 bytes) and a `/` longer than an id.
pub fn session_ref(field: &str, value: &str) -> Result<(), Status> {
    match value.split_once('/') {
        Some((principal, id)) if crate::auth::is_principal_name(principal) => self::id(field, id),
        _ => self::id(field, value),
    }
}

/// A profile reference: `id` or `id@version`, the catalog's grammar.
pub fn profile_ref(field: &str, value: &str) -> Result<ProfileRef, Status> {
    if value.is_empty() {
        return Err(invalid_argument(field, "must not be empty"));
    }
    if value.len() > MAX_REF {
        return Err(invalid_argument(field, format!("at most {MAX_REF} bytes, got {}", value.len())));
    }
    ProfileRef::parse(value).map_err(|e| invalid_argument(field, e))
}

/// Free text: bounded, and no NUL (which the store and C tools cut at).
pub fn text(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(invalid_argument(field, format!("at most {max} bytes, got {}", value.len())));
    }
    if value.contains('\0') {
        return Err(invalid_argument(field, "must not contain NUL"));
    }
    Ok(())
}

/// Repositories resolved at once (see [`repo`]).
static RESOLVING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

/// A repository path: absolute, no `..`, beneath one of the daemon's
/// `roots` and the principal's `repos` (if it has any), opened there
/// without leaving the root, and a git repository. Returns the canonical
/// path, which is what the execution uses from then on; empty stays empty.
///
/// Whatever the reason, a refused path gets one answer, so a caller learns
/// nothing about what exists on the host; the reason goes to the audit
/// log, with the principal who asked.
pub async fn repo(field: &str, value: &str, roots: &[PathBuf], principal: &Principal) -> Result<String, Status> {
    use crate::sandbox::repo::{resolve, Refused, NOT_ALLOWED};
    if value.is_empty() {
        return Ok(String::new());
    }
    text(field, value, MAX_PATH)?;
    let path = Path::new(value);
    if !path.is_absolute() {
        return Err(invalid_argument(field, "must be an absolute path"));
    }
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(invalid_argument(field, "must not contain '..'"));
    }
    let refuse = |why: Refused| {
        tracing::info!(
            target: "corral::audit", principal = %principal.name, kind = principal.kind.as_str(), field,
            reason = %why, "repository refused"
        );
        invalid_argument(field, NOT_ALLOWED)
    };
    // Off the async worker: the walk of its git directory may look at up
    // to 100,000 directories. A few at a time: a walk goes on when its
    // caller has left, and callers that leave at once must not fill the
    // blocking pool the end of every run's workspace check uses.
    let turn = RESOLVING.acquire().await.map_err(|_| invalid_argument(field, NOT_ALLOWED))?;
    let (owned, roots, repos) = (path.to_path_buf(), roots.to_vec(), principal.repos.clone());
    // The turn is held by the walk, not by the call.
    let resolved = tokio::task::spawn_blocking(move || {
        let resolved = resolve(&owned, &roots, &repos);
        drop(turn);
        resolved
    })
    .await
    .map_err(|_| refuse(Refused::GitDir("its check failed (see the daemon's log)".into())))?;
    let open = resolved.map_err(refuse)?;
    if !crate::sandbox::workspace::is_git_repo(&open).await {
        return Err(refuse(Refused::NotGit));
    }
    open.canonical().to_str().map(str::to_string).ok_or_else(|| invalid_argument(field, "must be valid UTF-8"))
}

/// `UNSPECIFIED` means no filter; an unknown number is refused.
pub fn state_filter(value: i32) -> Result<Option<ExecutionState>, Status> {
    let state = pb::ExecutionState::try_from(value)
        .map_err(|_| invalid_argument("state", format!("unknown ExecutionState {value}")))?;
    Ok(match state {
        pb::ExecutionState::Unspecified => None,
        pb::ExecutionState::Pending => Some(ExecutionState::Pending),
        pb::ExecutionState::Running => Some(ExecutionState::Running),
        pb::ExecutionState::Succeeded => Some(ExecutionState::Succeeded),
        pb::ExecutionState::Failed => Some(ExecutionState::Failed),
        pb::ExecutionState::Refused => Some(ExecutionState::Refused),
        pb::ExecutionState::Cancelled => Some(ExecutionState::Cancelled),
    })
}

/// Whether the full view (raw output) was asked for.
pub fn view(value: i32) -> Result<bool, Status> {
    match pb::ExecutionView::try_from(value) {
        Ok(pb::ExecutionView::Full) => Ok(true),
        Ok(pb::ExecutionView::Basic | pb::ExecutionView::Unspecified) => Ok(false),
        Err(_) => Err(invalid_argument("view", format!("unknown ExecutionView {value}"))),
    }
}

/// A policy kind: required, and one the daemon has built in. Returns its
/// word, which is what the gate compiles.
pub fn policy_kind(field: &str, value: i32) -> Result<&'static str, Status> {
    match pb::PolicyKind::try_from(value) {
        Ok(pb::PolicyKind::Unspecified) => Err(invalid_argument(field, "is required")),
        Ok(kind) => Ok(kind.word()),
        Err(_) => Err(invalid_argument(field, format!("unknown PolicyKind {value}"))),
    }
}

/// A decision on a waiting tool call: its call id (`call-<n>`, as the
/// approval_requested event gave it), allow or deny, and a reason.
pub fn tool_call_decision(call_id: &str, decision: i32, reason: &str) -> Result<bool, Status> {
    let digits = call_id.strip_prefix("call-").unwrap_or_default();
    if digits.is_empty() || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid_argument("call_id", "must be a call id from an approval_requested event (call-<n>)"));
    }
    text("reason", reason, 1024)?;
    if reason.chars().any(|c| c.is_control()) {
        return Err(invalid_argument("reason", "must not contain control characters"));
    }
    match pb::ToolCallDecision::try_from(decision) {
        Ok(pb::ToolCallDecision::Allow) => Ok(true),
        Ok(pb::ToolCallDecision::Deny) => Ok(false),
        Ok(pb::ToolCallDecision::Unspecified) => Err(invalid_argument("decision", "is required (ALLOW or DENY)")),
        Err(_) => Err(invalid_argument("decision", format!("unknown ToolCallDecision {decision}"))),
    }
}

/// `0` is the default page; more than [`MAX_PAGE`] is refused.
pub fn page_size(value: u32) -> Result<u32, Status> {
    match value {
        0 => Ok(DEFAULT_PAGE),
        n if n > MAX_PAGE => Err(invalid_argument("page_size", format!("at most {MAX_PAGE}"))),
        n => Ok(n),
    }
}

pub async fn execute_request(
    req: pb::ExecuteRequest,
    roots: &[PathBuf],
    principal: &Principal,
) -> Result<ExecuteCommand, Status> {
    profile_ref("harness_profile_ref", &req.harness_profile_ref)?;
    text("title", &req.title, MAX_TITLE)?;
    text("description", &req.description, MAX_DESCRIPTION)?;
    token("request_id", &req.request_id)?;
    token("correlation_id", &req.correlation_id)?;
    token("assignment_ref", &req.assignment_ref)?;
    token("actor", &req.actor)?;
    token("project", &req.project)?;
    let repo = repo("repo", &req.repo, roots, principal).await?;
    Ok(ExecuteCommand {
        harness_profile_ref: req.harness_profile_ref,
        repo,
        title: req.title,
        description: req.description,
        request_id: req.request_id,
        correlation_id: req.correlation_id,
        assignment_ref: req.assignment_ref,
        report_to_hub: req.report_to_hub,
        actor: req.actor,
        project: req.project,
        principal: String::new(),
        quota: None,
        traceparent: None,
        follows: false,
        cancel_on_disconnect: req.cancel_on_disconnect,
    })
}

/// `CreateSession`'s fields; returns the canonical repository path and the
/// policies, checked for shape here and compiled once the caller may pass
/// them.
pub async fn create_session(
    req: &pb::CreateSessionRequest,
    roots: &[PathBuf],
    principal: &Principal,
) -> Result<(String, Vec<PolicySpec>), Status> {
    session_id("session_id", &req.session_id)?;
    profile_ref("profile_ref", &req.profile_ref)?;
    token("actor", &req.actor)?;
    token("project", &req.project)?;
    let specs = policies(&req.policies)?;
    Ok((repo("repo", &req.repo, roots, principal).await?, specs))
}

/// `EvaluateGate`'s fields, the same way.
pub async fn evaluate_gate(
    req: &pb::EvaluateGateRequest,
    roots: &[PathBuf],
    principal: &Principal,
) -> Result<(String, Vec<PolicySpec>), Status> {
    profile_ref("profile_ref", &req.profile_ref)?;
    token("actor", &req.actor)?;
    token("project", &req.project)?;
    let specs = policies(&req.policies)?;
    Ok((repo("repo", &req.repo, roots, principal).await?, specs))
}

/// Policies from the wire, in shape: sizes, names, JSON arguments. Whether
/// they compile is [`crate::policy::compile_all`]'s to say.
pub fn policies(specs: &[pb::PolicySpec]) -> Result<Vec<PolicySpec>, Status> {
    if specs.len() > MAX_POLICIES {
        return Err(invalid_argument("policies", format!("at most {MAX_POLICIES}, got {}", specs.len())));
    }
    let mut parsed = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let field = |name: &str| format!("policies[{i}].{name}");
        if spec.name.is_empty() {
            return Err(invalid_argument(&field("name"), "must not be empty"));
        }
        text(&field("name"), &spec.name, MAX_ID)?;
        let kind = policy_kind(&field("kind"), spec.kind)?;
        if spec.on.len() > MAX_SELECTORS {
            return Err(invalid_argument(&field("on"), format!("at most {MAX_SELECTORS} entries")));
        }
        for (j, on) in spec.on.iter().enumerate() {
            token(&format!("policies[{i}].on[{j}]"), on)?;
        }
        text(&field("arguments_json"), &spec.arguments_json, MAX_POLICY_ARGUMENTS)?;
        let arguments = json_object(&field("arguments_json"), &spec.arguments_json)?;
        parsed.push(PolicySpec { name: spec.name.clone(), kind: kind.into(), arguments, on: spec.on.clone() });
    }
    Ok(parsed)
}

/// A JSON object (or nothing, which is `{}`).
fn json_object(field: &str, text: &str) -> Result<Value, Status> {
    if text.is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    match serde_json::from_str(text) {
        Ok(value @ Value::Object(_)) => Ok(value),
        Ok(_) => Err(invalid_argument(field, "must be a JSON object")),
        Err(e) => Err(invalid_argument(field, format!("not JSON: {e}"))),
    }
}

/// `SendTurn`'s tool call: its name and JSON arguments.
pub fn tool_call(call: Option<&pb::ToolCall>) -> Result<(String, Value), Status> {
    let call = call.ok_or_else(|| invalid_argument("tool_call", "is required"))?;
    id("tool_call.tool", &call.tool)?;
    text("tool_call.arguments_json", &call.arguments_json, MAX_ARGUMENTS)?;
    let arguments = if call.arguments_json.is_empty() {
        Value::Object(Default::default())
    } else {
        serde_json::from_str(&call.arguments_json)
            .map_err(|e| invalid_argument("tool_call.arguments_json", format!("not JSON: {e}")))?
    };
    Ok((call.tool.clone(), arguments))
}

/// A checked `ListExecutions` request.
pub struct ExecutionListing {
    pub state: Option<ExecutionState>,
    pub limit: u32,
    /// The id the page starts after (exclusive), from the page token.
    pub before_id: String,
    /// What a page token of this listing is bound to.
    pub scope: String,
}

pub const EXECUTIONS: &str = "executions";
pub const SESSIONS: &str = "sessions";

/// `principal`: the caller, to whom a page token belongs.
pub fn list_executions(
    req: &pb::ListExecutionsRequest,
    tokens: &PageTokens,
    principal: &str,
) -> Result<ExecutionListing, Status> {
    let state = state_filter(req.state)?;
    if !req.profile_ref.is_empty() {
        profile_ref("profile_ref", &req.profile_ref)?;
    }
    token("actor", &req.actor)?;
    token("project", &req.project)?;
    let limit = page_size(req.page_size)?;
    // A token belongs to the filter it was issued for: the same cursor under
    // another filter would skip or repeat records.
    let scope = format!("{}\n{}\n{}\n{}\n{principal}", req.state, req.profile_ref, req.actor, req.project);
    let before_id = tokens.open(EXECUTIONS, &scope, &req.page_token)?;
    Ok(ExecutionListing { state, limit, before_id, scope })
}

/// A checked `ListSessions` request: the page size and the id it starts after.
/// A token belongs to its caller, `principal`.
pub fn list_sessions(
    req: &pb::ListSessionsRequest,
    tokens: &PageTokens,
    principal: &str,
) -> Result<(u32, String), Status> {
    let limit = page_size(req.page_size)?;
    let after_id = tokens.open(SESSIONS, principal, &req.page_token)?;
    Ok((limit, after_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(status: Status) -> String {
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        status.message().split(':').next().unwrap().to_string()
    }

    #[test]
    fn malformed_references_are_invalid_everywhere_they_appear() {
        for bad in ["", "a@", "@1.0.0", "x@not-semver", "p@1.0.0@2", "a b", "é", "a\0b"] {
            assert_eq!(field_of(profile_ref("profile_ref", bad).unwrap_err()), "profile_ref", "{bad:?}");
        }
        assert!(profile_ref("r", &"a".repeat(MAX_REF + 1)).is_err());
        assert_eq!(profile_ref("r", "team.a@1.0.0").unwrap().id, "team.a");
    }

    #[test]
    fn tokens_ids_and_text() {
        assert!(token("actor", "").is_ok());
        assert!(token("actor", "rein-aharness@railiance01").is_ok(), "refused at resolution, not here");
        for bad in ["a b", "ä", "a\0", "\t"] {
            assert!(token("actor", bad).is_err(), "{bad:?}");
        }
        assert!(token("actor", &"a".repeat(MAX_ID + 1)).is_err());
        assert!(id("execution_id", "").is_err());
        // A full session id names a principal and an id, never an empty one.
        assert_eq!(field_of(session_ref("session_id", "alice/").unwrap_err()), "session_id");
        assert!(session_ref("session_id", "alice/s1").is_ok() && session_ref("session_id", "s1").is_ok());
        assert!(text("title", "naïve title", MAX_TITLE).is_ok());
        assert!(text("title", "a\0", MAX_TITLE).is_err());
    }

    #[test]
    fn enums_and_pages() {
        assert_eq!(state_filter(0).unwrap(), None);
        assert_eq!(field_of(state_filter(99).unwrap_err()), "state");
        assert!(view(2).unwrap() && !view(0).unwrap());
        assert_eq!(field_of(view(-1).unwrap_err()), "view");
        assert_eq!(page_size(0).unwrap(), DEFAULT_PAGE);
        assert_eq!(field_of(page_size(MAX_PAGE + 1).unwrap_err()), "page_size");
        assert_eq!(policy_kind("k", pb::PolicyKind::Expr as i32).unwrap(), "expr");
        assert_eq!(field_of(policy_kind("k", 0).unwrap_err()), "k");
        assert_eq!(field_of(policy_kind("k", 99).unwrap_err()), "k");
        assert_eq!(field_of(policy_kind("k", -1).unwrap_err()), "k");
    }

    #[test]
    fn policies_and_tool_calls_name_the_element() {
        let spec = |args: &str| pb::PolicySpec {
            name: "p".into(),
            kind: pb::PolicyKind::Expr as i32,
            arguments_json: args.into(),
            on: vec![],
        };
        assert_eq!(field_of(policies(&[spec("{}"), spec("[1]")]).unwrap_err()), "policies[1].arguments_json");
        assert_eq!(field_of(policies(&[spec("{")]).unwrap_err()), "policies[0].arguments_json");
        assert!(policies(&vec![spec("{}"); MAX_POLICIES + 1]).is_err());
        let unkinded = pb::PolicySpec { kind: 0, ..spec("{}") };
        assert_eq!(field_of(policies(&[spec("{}"), unkinded]).unwrap_err()), "policies[1].kind");
        assert_eq!(field_of(tool_call(None).unwrap_err()), "tool_call");
        let call = pb::ToolCall { tool: "édit".into(), arguments_json: String::new() };
        assert_eq!(field_of(tool_call(Some(&call)).unwrap_err()), "tool_call.tool");
    }
}
