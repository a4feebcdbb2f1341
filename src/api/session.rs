//! SessionService: validate, call the engine once, convert back.

use std::path::PathBuf;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::auth::{audit, caller, denied, not_visible};
use super::execution::{event_stream, EventStream};
use super::{convert, status, validate};
use crate::lifecycle::{CreateSessionCommand, EndReason, Engine};
use crate::pb;
use crate::pb::session_service_server::SessionService;
use crate::policy::{compile_all, Policy, PolicySpec};

pub struct SessionApi {
    pub engine: Arc<Engine>,
    pub repo_roots: Vec<PathBuf>,
    pub shutdown: CancellationToken,
}

/// Session policies from the wire: only an `adm` principal may set them,
/// and each must compile.
pub fn session_policies(principal: &crate::auth::Principal, specs: &[pb::PolicySpec]) -> Result<Vec<Policy>, Status> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    principal.may_set_policies().map_err(denied)?;
    let mut parsed = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let arguments = if spec.arguments_json.is_empty() {
            serde_json::Value::Object(Default::default())
        } else {
            serde_json::from_str(&spec.arguments_json)
                .map_err(|e| status::invalid_argument(&format!("policies[{i}].arguments_json"), e.to_string()))?
        };
        parsed.push(PolicySpec { name: spec.name.clone(), kind: spec.kind.clone(), arguments, on: spec.on.clone() });
    }
    compile_all(&parsed, "session", "policies").map_err(|e| {
        let field = e.split_whitespace().next().unwrap_or("policies").to_string();
        status::invalid_argument(&field, e)
    })
}

fn session_id(value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(status::invalid_argument("session_id", "must not be empty"));
    }
    validate::id_like("session_id", value, validate::MAX_ID)
}

impl SessionApi {
    /// The session, if the principal may see it; NOT_FOUND otherwise.
    async fn visible(
        &self,
        principal: &crate::auth::Principal,
        id: &str,
    ) -> Result<crate::lifecycle::SessionRecord, Status> {
        let record = self.engine.get_session(id).await?;
        if !principal.can_see(&record.consumer.project) {
            return Err(not_visible("session", id));
        }
        Ok(record)
    }
}

#[tonic::async_trait]
impl SessionService for SessionApi {
    type SendTurnStream = EventStream;
    type WatchSessionStream = EventStream;

    async fn create_session(
        &self,
        request: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        if !req.session_id.is_empty() {
            session_id(&req.session_id)?;
        }
        validate::profile_ref("profile_ref", &req.profile_ref)?;
        validate::id_like("actor", &req.actor, validate::MAX_ID)?;
        validate::id_like("project", &req.project, validate::MAX_ID)?;
        let repo = validate::repo(&req.repo, &self.repo_roots).await?;
        let (actor, project) = principal.admit(&req.actor, &req.project).map_err(denied)?;
        let policies = session_policies(&principal, &req.policies)?;
        let cmd = CreateSessionCommand {
            session_id: req.session_id,
            profile_ref: req.profile_ref,
            actor,
            project,
            repo,
            policies,
            principal: principal.name.clone(),
            quota: principal.max_running,
        };
        let record = self.engine.create_session(cmd).await?;
        audit(&principal, "CreateSession", &record.session_id);
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn send_turn(&self, request: Request<pb::SendTurnRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        session_id(&req.session_id)?;
        self.visible(&principal, &req.session_id).await?;
        let call = req.tool_call.ok_or_else(|| status::invalid_argument("tool_call", "is required"))?;
        if call.tool.is_empty() {
            return Err(status::invalid_argument("tool_call.tool", "must not be empty"));
        }
        validate::id_like("tool_call.tool", &call.tool, validate::MAX_ID)?;
        if call.arguments_json.len() > validate::MAX_DESCRIPTION {
            return Err(status::invalid_argument("tool_call.arguments_json", "too large"));
        }
        let arguments = if call.arguments_json.is_empty() {
            serde_json::Value::Object(Default::default())
        } else {
            serde_json::from_str(&call.arguments_json)
                .map_err(|e| status::invalid_argument("tool_call.arguments_json", e.to_string()))?
        };
        let subscription = self.engine.send_turn(&req.session_id, call.tool, arguments).await?;
        Ok(Response::new(event_stream(subscription, self.shutdown.clone())))
    }

    async fn watch_session(&self, request: Request<pb::WatchSessionRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        session_id(&req.session_id)?;
        self.visible(&principal, &req.session_id).await?;
        let subscription = self.engine.watch(&req.session_id, req.after_sequence).await?;
        Ok(Response::new(event_stream(subscription, self.shutdown.clone())))
    }

    async fn get_session(&self, request: Request<pb::GetSessionRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        session_id(&req.session_id)?;
        let record = self.visible(&principal, &req.session_id).await?;
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        if req.page_size > 500 {
            return Err(status::invalid_argument("page_size", "at most 500"));
        }
        if !req.page_token.is_empty() {
            session_id(&req.page_token).map_err(|_| status::invalid_argument("page_token", "not a page token"))?;
        }
        let limit = if req.page_size == 0 { 50 } else { req.page_size };
        let records = self.engine.list_sessions(&req.page_token, limit).await?;
        let next_page_token = if records.len() == limit as usize {
            records.last().map(|r| r.session_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: records
                .iter()
                .filter(|r| principal.can_see(&r.consumer.project))
                .map(|r| convert::session(r, None))
                .collect(),
            next_page_token,
        }))
    }

    async fn cancel_turn(&self, request: Request<pb::CancelTurnRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        session_id(&req.session_id)?;
        self.visible(&principal, &req.session_id).await?;
        let record = self.engine.cancel_turn(&req.session_id).await?;
        audit(&principal, "CancelTurn", &req.session_id);
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn end_session(&self, request: Request<pb::EndSessionRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        session_id(&req.session_id)?;
        self.visible(&principal, &req.session_id).await?;
        let record = self.engine.end_session(&req.session_id, EndReason::Requested).await?;
        audit(&principal, "EndSession", &req.session_id);
        Ok(Response::new(convert::session(&record, None)))
    }
}
