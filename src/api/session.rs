//! SessionService: validate, call the engine once, convert back.

use std::path::PathBuf;
use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::auth::{audit, caller, denied, not_visible};
use super::execution::{event_stream, traceparent, EventStream};
use super::page::PageTokens;
use super::streams_end::StreamsEnd;
use super::{convert, limits, status, validate};
use crate::lifecycle::{CreateSessionCommand, EndReason, Engine, RawResult};
use crate::pb;
use crate::pb_wire::session_service_server::SessionService;
use crate::policy::{compile_all, Policy, PolicySpec};

/// The SessionService: creates, drives and ends sessions.
pub struct SessionApi {
    /// The engine every call goes to.
    pub engine: Arc<Engine>,
    /// The daemon's `repo_roots`: a request's repository must be under one.
    pub repo_roots: Vec<PathBuf>,
    /// Ended once the daemon has drained; every open event stream then ends.
    pub shutdown: StreamsEnd,
    /// Seals and opens the listings' page tokens.
    pub page_tokens: Arc<PageTokens>,
}

/// Session policies from the wire, already checked for shape: only an
/// `adm` principal may set them, and each must compile.
pub fn session_policies(principal: &crate::auth::Principal, specs: Vec<PolicySpec>) -> Result<Vec<Policy>, Status> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    principal.may_set_policies().map_err(denied)?;
    compile_all(&specs, "session", "policies").map_err(|e| {
        let field = e.split_whitespace().next().unwrap_or("policies").to_string();
        status::invalid_argument(&field, e)
    })
}

/// The stored id of a session that `principal` names `id` when it creates
/// it: session ids a caller chooses are scoped to the caller, so two
/// principals may both have an `s1`, and neither learns of the other's.
/// (Principal names have no `/`, so no two scopes meet.) A generated id is
/// a UUID and needs no scope.
pub fn scoped_session_id(principal: &crate::auth::Principal, id: &str) -> String {
    if id.is_empty() {
        return String::new();
    }
    format!("{}/{id}", principal.name)
}

impl SessionApi {
    /// The session `principal` means by `id`: its own (`<principal>/<id>`)
    /// first, else the session stored under `id` exactly (a generated id,
    /// or a scoped id written in full) if the principal may see its
    /// project. NOT_FOUND otherwise, worded the same whatever exists.
    async fn visible(
        &self,
        principal: &crate::auth::Principal,
        id: &str,
    ) -> Result<crate::lifecycle::SessionRecord, Status> {
        use crate::lifecycle::EngineError;
        let own = scoped_session_id(principal, id);
        let found = match self.engine.get_session(&own).await {
            Err(EngineError::NotFound(_)) => self.engine.get_session(id).await,
            found => found,
        };
        match found {
            Ok(record) if principal.can_see(&record.consumer.project) => Ok(record),
            Ok(_) | Err(EngineError::NotFound(_)) => Err(not_visible("session", id)),
            Err(e) => Err(e.into()),
        }
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
        let trace_parent = traceparent(&request);
        let req = request.into_inner();
        let (repo, specs) = validate::create_session(&req, &self.repo_roots, &principal).await?;
        let (actor, project) = principal.admit(&req.actor, &req.project).map_err(denied)?;
        let policies = session_policies(&principal, specs.clone())?;
        // Chosen here when the caller chose none, so that the audit line
        // names it whatever comes of the create.
        let session_id = match scoped_session_id(&principal, &req.session_id) {
            id if id.is_empty() => uuid::Uuid::now_v7().to_string(),
            id => id,
        };
        let cmd = CreateSessionCommand {
            session_id: session_id.clone(),
            profile_ref: req.profile_ref,
            actor,
            project,
            repo,
            policies,
            policy_specs: specs,
            principal: principal.name.clone(),
            quota: principal.max_running,
            traceparent: trace_parent,
        };
        // Audited whatever came of it: a session refused or failed at its
        // start is stored too (a create refused before that, full or
        // draining, names an id nothing holds; a taken id names another's
        // session and is left out).
        let engine = self.engine.clone();
        let creating = async move { engine.create_session(cmd).await };
        let subject = move |created: &Result<_, _>| {
            (!matches!(created, Err(crate::lifecycle::EngineError::SessionExists(_)))).then_some(session_id)
        };
        let record = super::auth::audited(&self.engine, &principal, "CreateSession", creating, subject).await?;
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn send_turn(&self, request: Request<pb::SendTurnRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let deadline = limits::deadline(&request);
        let trace_parent = traceparent(&request);
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let (tool, arguments) = validate::tool_call(req.tool_call.as_ref())?;
        let id = self.visible(&principal, &req.session_id).await?.session_id;
        // Sent by a task of the engine's, which writes the audit line: a
        // caller gone before the answer sent its turn all the same.
        let sending = {
            let (engine, id, name) = (self.engine.clone(), id.clone(), principal.name.clone());
            async move { engine.send_turn(&id, tool, arguments, trace_parent, &name).await }
        };
        let subscription = super::auth::audited(&self.engine, &principal, "SendTurn", sending, move |sent| {
            super::auth::done_or_taken(sent).then_some(id)
        })
        .await?;
        Ok(Response::new(event_stream(subscription, &self.shutdown, deadline)))
    }

    async fn watch_session(&self, request: Request<pb::WatchSessionRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let deadline = limits::deadline(&request);
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let id = self.visible(&principal, &req.session_id).await?.session_id;
        let subscription = self.engine.watch(&id, req.after_sequence, &principal.name).await?;
        Ok(Response::new(event_stream(subscription, &self.shutdown, deadline)))
    }

    async fn get_session(&self, request: Request<pb::GetSessionRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let record = self.visible(&principal, &req.session_id).await?;
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        let (limit, after_id) = validate::list_sessions(&req, &self.page_tokens, &principal.name)?;
        let projects = principal.visible_projects();
        let records = self.engine.list_sessions(&after_id, limit, projects.as_deref()).await?;
        let next_page_token = if records.len() == limit as usize {
            let last = records.last().map(|r| r.session_id.as_str()).unwrap_or_default();
            self.page_tokens.issue(validate::SESSIONS, &principal.name, last)
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: records.iter().map(|r| convert::session(r, None)).collect(),
            next_page_token,
        }))
    }

    async fn cancel_turn(&self, request: Request<pb::CancelTurnRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let id = self.visible(&principal, &req.session_id).await?.session_id;
        let cancelling = {
            let (engine, id) = (self.engine.clone(), id.clone());
            async move { engine.cancel_turn(&id).await }
        };
        let record = super::auth::audited(&self.engine, &principal, "CancelTurn", cancelling, move |done| {
            super::auth::done_or_taken(done).then_some(id)
        })
        .await?;
        Ok(Response::new(convert::session(&record, None)))
    }

    async fn decide_tool_call(
        &self,
        request: Request<pb::DecideSessionToolCallRequest>,
    ) -> Result<Response<pb::DecideToolCallResponse>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let allow = validate::tool_call_decision(&req.call_id, req.decision, &req.reason)?;
        let record = self.visible(&principal, &req.session_id).await?;
        let run = (record.session_id.as_str(), &record.consumer);
        let decided =
            super::auth::decide_tool_call(&self.engine, &principal, run, &req.call_id, allow, &req.reason).await?;
        Ok(Response::new(decided))
    }

    async fn end_session(&self, request: Request<pb::EndSessionRequest>) -> Result<Response<pb::Session>, Status> {
        let principal = caller(&request)?;
        let trace_parent = traceparent(&request);
        let req = request.into_inner();
        validate::session_ref("session_id", &req.session_id)?;
        let id = self.visible(&principal, &req.session_id).await?.session_id;
        // Teardown belongs to the engine, not to this call: a caller that
        // goes away (or whose deadline passes) mid-teardown must not leave a
        // sandbox half destroyed, and a shutdown waits for it.
        let engine = self.engine.clone();
        // Its own trace (`session_end` > `teardown`), joined to the caller's.
        let span = tracing::info_span!("session_end", session_id = %id);
        crate::telemetry::set_parent(&span, trace_parent.as_deref());
        let ending = {
            let (id, engine, principal) = (id.clone(), engine.clone(), principal.clone());
            let end = async move {
                let ended = engine.end_session_with_cause(&id, EndReason::Requested).await;
                // There, not after the wait below: a caller gone before the
                // answer ended the session all the same.
                if ended.is_ok() {
                    audit(&principal, "EndSession", &id);
                }
                ended
            };
            self.engine.spawn_tracked(end.instrument(span))
        };
        let (record, cause) = ending.await.map_err(|_| Status::internal("ending the session failed"))??;
        // The raw cause of a failed end, for the caller that ended it when
        // that is the session's own principal or adm (as GetExecution's
        // FULL view): it is kept nowhere else.
        let raw = cause
            .filter(|_| principal.may_read_raw(&record.consumer.principal))
            .map(|tool_error| RawResult { tool_output: String::new(), tool_error });
        Ok(Response::new(convert::session(&record, raw.as_ref())))
    }
}
