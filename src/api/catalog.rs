//! CatalogService: what the daemon knows, and dry runs of resolution and
//! the gate with exactly the rules an execution uses.

use std::path::PathBuf;
use std::sync::Arc;

use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::{convert, status, validate};
use crate::catalog::{Catalog, Profile, ReadinessState, Refusal, RunFacts};
use crate::lifecycle::Engine;
use crate::pb;
use crate::pb_wire::catalog_service_server::CatalogService;
use crate::policy::Gate;
use crate::store::Store;

/// The CatalogService: profile listings and dry runs of resolution and the gate.
pub struct CatalogApi {
    /// The profiles the daemon loaded.
    pub catalog: Arc<Catalog>,
    /// The same gate executions are decided by.
    pub gate: Arc<Gate>,
    /// The daemon's `repo_roots`: a request's repository must be under one.
    pub repo_roots: Vec<PathBuf>,
    /// Where the last end-to-end success of an unverified profile is read.
    pub store: Store,
    /// The engine: the dry runs resolve as its executions do, and a
    /// DrainNode naming this node drains it at once.
    pub engine: Arc<Engine>,
}

impl CatalogApi {
    /// The profile as the API shows it. An `unverified` profile's reason
    /// says when it last succeeded end to end on this daemon (its store),
    /// or that it never did: what `corral profiles` shows an operator.
    async fn profile(&self, profile: &Profile) -> Result<pb::Profile, Status> {
        let mut shown = convert::profile(profile);
        if profile.file.readiness.state != ReadinessState::Unverified {
            return Ok(shown);
        }
        let last = self.store.last_success(&profile.reference()).await.map_err(store_error)?;
        let check = match last {
            Some(ms) => format!("last end-to-end success on this daemon: {}", crate::hub::rfc3339(ms)),
            None => "no end-to-end success on this daemon yet".to_string(),
        };
        if let Some(readiness) = shown.readiness.as_mut() {
            readiness.reason =
                if readiness.reason.is_empty() { check } else { format!("{}; {check}", readiness.reason) };
        }
        Ok(shown)
    }
}

/// A store error as a status: its words may carry paths and SQL, so they
/// are logged, never sent (the one mapping of `EngineError::Store`).
fn store_error(error: crate::store::StoreError) -> Status {
    Status::from(crate::lifecycle::EngineError::Store(error))
}

/// A resolution refusal as a status: FAILED_PRECONDITION with the reason.
fn refused(refusal: Refusal) -> Status {
    let details = ErrorDetails::with_error_info(
        "RESOLUTION_REFUSED",
        status::DOMAIN,
        [("reason".to_string(), refusal.0.clone())].into_iter().collect::<std::collections::HashMap<_, _>>(),
    );
    Status::with_error_details(Code::FailedPrecondition, refusal.0, details)
}

#[tonic::async_trait]
impl CatalogService for CatalogApi {
    async fn list_profiles(
        &self,
        _request: Request<pb::ListProfilesRequest>,
    ) -> Result<Response<pb::ListProfilesResponse>, Status> {
        let mut profiles = Vec::new();
        for profile in self.catalog.list().iter() {
            profiles.push(self.profile(profile).await?);
        }
        Ok(Response::new(pb::ListProfilesResponse { profiles }))
    }

    async fn get_profile(&self, request: Request<pb::GetProfileRequest>) -> Result<Response<pb::Profile>, Status> {
        let req = request.into_inner();
        validate::profile_ref("profile_ref", &req.profile_ref)?;
        let profile = self
            .catalog
            .lookup(&req.profile_ref)
            .map_err(|r| status::with_reason(Code::NotFound, r.0, "NOT_FOUND", vec![]))?;
        Ok(Response::new(self.profile(&profile).await?))
    }

    async fn resolve_profile(
        &self,
        request: Request<pb::ResolveProfileRequest>,
    ) -> Result<Response<pb::ResolveProfileResponse>, Status> {
        let req = request.into_inner();
        validate::profile_ref("profile_ref", &req.profile_ref)?;
        validate::token("actor", &req.actor)?;
        let actor = (!req.actor.is_empty()).then_some(req.actor.as_str());
        let profile = self.engine.resolve_for_run(actor, &req.profile_ref).map_err(refused)?;
        Ok(Response::new(pb::ResolveProfileResponse {
            pinned_ref: profile.reference(),
            profile: Some(convert::profile(&profile)),
        }))
    }

    async fn evaluate_gate(
        &self,
        request: Request<pb::EvaluateGateRequest>,
    ) -> Result<Response<pb::EvaluateGateResponse>, Status> {
        let principal = super::auth::caller(&request)?;
        let req = request.into_inner();
        let (repo, specs) = validate::evaluate_gate(&req, &self.repo_roots, &principal).await?;
        // The actor and project exactly as an execution admits them: an
        // empty actor is the principal's type, another type is refused, an
        // empty project is the principal's default, another tenant's is refused.
        let (actor, project) = principal.admit(&req.actor, &req.project).map_err(super::auth::denied)?;
        // Who may send policies first, as CreateSession checks it.
        let session_policies = super::session::session_policies(&principal, specs)?;
        let profile = self.engine.resolve_for_run(Some(&actor), &req.profile_ref).map_err(refused)?;
        let facts = RunFacts {
            actor: &actor,
            project: &project,
            repo: &repo,
            tool_calls: 0,
            session_policies: &session_policies,
            host_writes: principal.host_writes(),
        };
        let outcome = profile.gate_agent_start(&self.gate, facts);
        Ok(Response::new(pb::EvaluateGateResponse {
            action: convert::action(outcome.action) as i32,
            decisions: outcome.decisions.iter().map(convert::decision).collect(),
            effective_sandbox: Some(convert::sandbox_spec(&outcome.effective_sandbox)),
            effective_timeout_seconds: outcome.effective_timeout_seconds,
        }))
    }

    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        super::auth::caller(&request)?.may_manage_nodes().map_err(super::auth::denied)?;
        let nodes = self.store.list_nodes().await.map_err(store_error)?;
        Ok(Response::new(pb::ListNodesResponse { nodes: nodes.iter().map(convert::node).collect() }))
    }

    async fn drain_node(&self, request: Request<pb::DrainNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let principal = super::auth::caller(&request)?;
        principal.may_manage_nodes().map_err(super::auth::denied)?;
        let name = &request.get_ref().name;
        if name.is_empty() {
            return Err(status::invalid_argument("name", "name the node to drain (see ListNodes)"));
        }
        // As `[fleet] node` allows: nothing longer or stranger reaches the
        // store or the answer.
        if name.chars().count() > 200 || name.chars().any(char::is_control) {
            return Err(status::invalid_argument(
                "name",
                "a node name is 1-200 characters, none of them control characters",
            ));
        }
        // Drained by a task of the engine's, which writes the audit line: a
        // caller gone before the answer drained the node all the same.
        let draining = {
            let (store, engine, name) = (self.store.clone(), self.engine.clone(), name.clone());
            async move {
                let node = store.drain_node(&name).await?;
                // This node learns of its own row at its next renewal: a
                // drain of itself takes effect now, as the proto says.
                if node.is_some() && name == store.node() && engine.start_draining() {
                    tracing::warn!("draining as asked; no new work is taken");
                }
                Ok(node)
            }
        };
        let subject = name.clone();
        let drained = move |done: &Result<Option<_>, _>| matches!(done, Ok(Some(_))).then_some(subject);
        match super::auth::audited(&self.engine, &principal, "DrainNode", draining, drained).await? {
            Some(node) => Ok(Response::new(convert::node(&node))),
            None => Err(status::with_reason(
                Code::NotFound,
                format!("no node named {name:?}"),
                "NOT_FOUND",
                vec![("name".into(), name.clone())],
            )),
        }
    }

    async fn get_daemon_info(
        &self,
        request: Request<pb::GetDaemonInfoRequest>,
    ) -> Result<Response<pb::DaemonInfo>, Status> {
        super::auth::caller(&request)?;
        let host = self.gate.host();
        let caps = &host.linux_bwrap;
        let entry = |name: &str, support: &Result<String, String>| pb::Capability {
            name: name.into(),
            available: support.is_ok(),
            detail: support.clone().unwrap_or_else(|reason| reason),
        };
        // What the host enforces was probed once, at start.
        let capabilities = vec![
            entry("linux_bwrap", &host.bwrap.clone().map(|()| "bubblewrap".to_string())),
            entry("seccomp", &host.seccomp),
            entry("sandbox_uids", &host.sandbox_uids),
            entry("memory", &caps.memory),
            entry("pids", &caps.pids),
            entry("cpu", &caps.cpu),
            entry("kill", &caps.kill),
            entry("egress", &caps.egress),
        ];
        Ok(Response::new(pb::DaemonInfo { version: env!("CARGO_PKG_VERSION").into(), capabilities }))
    }
}
