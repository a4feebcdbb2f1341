//! Input validation at the edge: sizes, references, paths, enums. A bad
//! request is refused before anything is stored or created.

use std::path::{Component, Path};

use tonic::Status;

use super::status::invalid_argument;
use crate::lifecycle::{ExecuteCommand, ExecutionState};
use crate::pb;

pub const MAX_TITLE: usize = 1024;
pub const MAX_DESCRIPTION: usize = 256 * 1024;
pub const MAX_ID: usize = 128;
pub const MAX_REF: usize = 200;
pub const MAX_PATH: usize = 4096;

pub fn id_like(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(invalid_argument(field, format!("at most {max} bytes")));
    }
    if !value.chars().all(|c| c.is_ascii_graphic()) {
        return Err(invalid_argument(field, "printable ASCII without spaces only"));
    }
    Ok(())
}

pub fn profile_ref(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid_argument(field, "must not be empty"));
    }
    if value.len() > MAX_REF {
        return Err(invalid_argument(field, format!("at most {MAX_REF} bytes")));
    }
    if !value.chars().all(|c| c.is_ascii_alphanumeric() || "._-@+".contains(c)) {
        return Err(invalid_argument(field, "use `id` or `id@version` (letters, digits, . _ - @ +)"));
    }
    Ok(())
}

fn text(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(invalid_argument(field, format!("at most {max} bytes, got {}", value.len())));
    }
    if value.contains('\0') {
        return Err(invalid_argument(field, "must not contain NUL"));
    }
    Ok(())
}

/// A repository path: absolute, no `..`, under an allowed root once every
/// symlink is resolved, and a git repository. Returns the canonical path,
/// which is what the execution uses from then on.
pub async fn repo(value: &str, roots: &[std::path::PathBuf]) -> Result<String, Status> {
    if value.is_empty() {
        return Ok(String::new());
    }
    text("repo", value, MAX_PATH)?;
    let path = Path::new(value);
    if !path.is_absolute() {
        return Err(invalid_argument("repo", "must be an absolute path"));
    }
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(invalid_argument("repo", "must not contain '..'"));
    }
    let canonical = path.canonicalize().map_err(|_| invalid_argument("repo", "does not exist"))?;
    let under = |root: &std::path::PathBuf| root.canonicalize().is_ok_and(|root| canonical.starts_with(root));
    if !roots.is_empty() && !roots.iter().any(under) {
        return Err(invalid_argument("repo", "is outside the daemon's allowed repository roots"));
    }
    if !crate::sandbox::workspace::is_git_repo(&canonical).await {
        return Err(invalid_argument("repo", "is not a git repository"));
    }
    canonical.into_os_string().into_string().map_err(|_| invalid_argument("repo", "must be valid UTF-8"))
}

pub async fn execute_request(req: pb::ExecuteRequest, roots: &[std::path::PathBuf]) -> Result<ExecuteCommand, Status> {
    profile_ref("harness_profile_ref", &req.harness_profile_ref)?;
    text("title", &req.title, MAX_TITLE)?;
    text("description", &req.description, MAX_DESCRIPTION)?;
    id_like("request_id", &req.request_id, MAX_ID)?;
    id_like("correlation_id", &req.correlation_id, MAX_ID)?;
    id_like("assignment_ref", &req.assignment_ref, MAX_ID)?;
    // Well above any real identifier: a queue worker's id is refused at
    // resolution with the contract's sentence, not here.
    id_like("actor", &req.actor, MAX_ID)?;
    id_like("project", &req.project, MAX_ID)?;
    let repo = repo(&req.repo, roots).await?;
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
    })
}

pub fn execution_id(value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid_argument("execution_id", "must not be empty"));
    }
    id_like("execution_id", value, MAX_ID)
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
