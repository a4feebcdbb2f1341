//! ExecutionService: validate, call the engine once, convert back.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::auth::{audit, caller, denied, not_visible};
use super::page::PageTokens;
use super::{convert, limits, status, validate};
use crate::lifecycle::{Engine, Lagged, Subscription};
use crate::pb;
use crate::pb_wire::execution_service_server::ExecutionService;
use crate::store::ExecutionFilter;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<super::wire::WireEvent, Status>> + Send>>;

/// The ExecutionService: runs, watches, lists and cancels executions.
pub struct ExecutionApi {
    /// The engine every call goes to.
    pub engine: Arc<Engine>,
    /// The daemon's `repo_roots`: a request's repository must be under one.
    pub repo_roots: Vec<PathBuf>,
    /// Cancelled once the daemon has drained; every open event stream then ends.
    pub shutdown: CancellationToken,
    /// Seals and opens the listings' page tokens.
    pub page_tokens: Arc<PageTokens>,
}

/// Pumps a subscription into a response stream on its own task, until the
/// subject ends, the daemon stops, or the caller's deadline passes.
pub fn event_stream(subscription: Subscription, shutdown: CancellationToken, deadline: Option<Instant>) -> EventStream {
    event_stream_with(subscription, shutdown, deadline, None)
}

/// How long a client may read nothing while it is further behind than the
/// live buffer before it is ended as stalled.
const STALL: Duration = Duration::from_secs(1);

/// Like [`event_stream`]; `on_disconnect` runs if the client goes away
/// before the stream has ended.
///
/// A client that reads slowly catches up from the store (see
/// [`Subscription`]); one that stops reading while the subject runs on past
/// the live buffer is ended with RESOURCE_EXHAUSTED and the last sequence it
/// was sent, so it can resume. One slot of the channel is kept free for
/// that final status, since the client is not draining it.
///
/// A call with a deadline (`grpc-timeout`) ends with DEADLINE_EXCEEDED and
/// the last sequence sent when it passes; for the caller that is the call
/// going away, so `on_disconnect` runs as if it had disconnected.
pub fn event_stream_with(
    mut subscription: Subscription,
    shutdown: CancellationToken,
    deadline: Option<Instant>,
    on_disconnect: Option<Box<dyn FnOnce() + Send>>,
) -> EventStream {
    let (tx, rx) = mpsc::channel(17);
    tokio::spawn(async move {
        // Counted while it streams.
        struct Watching;
        impl Drop for Watching {
            fn drop(&mut self) {
                crate::telemetry::watchers(-1.0);
            }
        }
        crate::telemetry::watchers(1.0);
        let _watching = Watching;
        let disconnected = |on_disconnect: Option<Box<dyn FnOnce() + Send>>| {
            if let Some(callback) = on_disconnect {
                callback();
            }
        };
        let expired = async move {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        // Made once: a future per event (and a timer per event below) would
        // be registered and dropped for every delivery to every watcher.
        let closed = tx.closed();
        tokio::pin!(closed);
        // A token of this stream's own, cancelled with the daemon's: every
        // stream polls it whenever it has no event ready, and polling the
        // daemon's one token from thousands of streams contends on its
        // lock (a tenth of the CPU at W = 10,000 paced).
        let shutdown = shutdown.child_token();
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        let mut sent = subscription.last_sequence();
        // The next event comes first; the stream's own ends are looked at
        // whenever none is ready, and at least every CHECK_EVERY events.
        const CHECK_EVERY: u32 = 64;
        let mut unchecked = 0u32;
        loop {
            unchecked += 1;
            let check = unchecked >= CHECK_EVERY;
            let next = tokio::select! {
                biased;
                next = subscription.next(), if !check => Some(next),
                _ = &mut closed => return disconnected(on_disconnect),
                _ = &mut cancelled => {
                    let _ = tx.try_send(Err(Status::unavailable(format!(
                        "daemon shutting down; resume with after_sequence = {sent}"
                    ))));
                    return;
                }
                _ = &mut expired => {
                    let _ = tx.try_send(Err(Status::deadline_exceeded(format!(
                        "the call's deadline passed; resume with after_sequence = {sent}"
                    ))));
                    return disconnected(on_disconnect);
                }
                _ = std::future::ready(()), if check => None,
            };
            let Some(next) = next else {
                unchecked = 0;
                continue;
            };
            let (message, sequence) = match next {
                None => return,
                Some(Ok(item)) => {
                    let sequence = item.event.sequence;
                    (Ok(super::wire::WireEvent::of(item)), sequence)
                }
                Some(Err(lag)) => {
                    let _ = tx.send(Err(status::lagged(lag))).await;
                    return;
                }
            };
            // Room in the channel (the usual case): sent without a timer.
            let message = match tx.try_reserve_many(2) {
                Ok(mut permits) => {
                    if let Some(permit) = permits.next() {
                        permit.send(message);
                    }
                    sent = sequence;
                    continue;
                }
                Err(mpsc::error::TrySendError::Closed(())) => return disconnected(on_disconnect),
                Err(mpsc::error::TrySendError::Full(())) => message,
            };
            let mut stalled_since: Option<Instant> = None;
            loop {
                tokio::select! {
                    permits = tx.reserve_many(2) => {
                        let Ok(mut permits) = permits else { return disconnected(on_disconnect) };
                        if let Some(permit) = permits.next() {
                            permit.send(message);
                        }
                        sent = sequence;
                        break;
                    }
                    _ = tokio::time::sleep(STALL / 4) => {
                        if !subscription.overrun() {
                            stalled_since = None;
                        } else if stalled_since.get_or_insert_with(Instant::now).elapsed() >= STALL {
                            let _ = tx.try_send(Err(status::lagged(Lagged { last_sequence: sent })));
                            return;
                        }
                    }
                }
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// The W3C `traceparent` the caller sent, if any (bounded: it is 55 bytes).
pub(super) fn traceparent<T>(request: &Request<T>) -> Option<String> {
    let value = request.metadata().get("traceparent")?.to_str().ok()?;
    (value.len() <= 128).then(|| value.to_string())
}

impl ExecutionApi {
    /// The request as a command of `principal`: validated, its actor and
    /// project checked against the principal's.
    async fn command(
        &self,
        principal: &crate::auth::Principal,
        request: pb::ExecuteRequest,
    ) -> Result<crate::lifecycle::ExecuteCommand, Status> {
        let mut cmd = validate::execute_request(request, &self.repo_roots, &principal.repos).await?;
        let (actor, project) = principal.admit(&cmd.actor, &cmd.project).map_err(denied)?;
        cmd.actor = actor;
        cmd.project = project;
        cmd.principal = principal.name.clone();
        cmd.quota = principal.max_running;
        Ok(cmd)
    }

    /// The execution, if the principal may see it; NOT_FOUND otherwise,
    /// worded as for one that does not exist.
    async fn visible(
        &self,
        principal: &crate::auth::Principal,
        execution_id: &str,
    ) -> Result<crate::lifecycle::ExecutionRecord, Status> {
        let record = self.engine.get(execution_id).await?;
        if !principal.can_see(&record.consumer.project) {
            return Err(not_visible("execution", execution_id));
        }
        Ok(record)
    }
}

#[tonic::async_trait]
impl ExecutionService for ExecutionApi {
    type ExecuteStream = EventStream;
    type WatchExecutionStream = EventStream;

    async fn execute(&self, request: Request<pb::ExecuteRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let deadline = limits::deadline(&request);
        let traceparent = traceparent(&request);
        let request = request.into_inner();
        let cancel_on_disconnect = request.cancel_on_disconnect;
        let mut cmd = self.command(&principal, request).await?;
        cmd.traceparent = traceparent;
        let submitted = self.engine.submit(cmd).await?;
        audit(&principal, "Execute", &submitted.record.execution_id);
        let on_disconnect: Option<Box<dyn FnOnce() + Send>> = if cancel_on_disconnect && !submitted.existing {
            let engine = self.engine.clone();
            let id = submitted.record.execution_id.clone();
            Some(Box::new(move || {
                tokio::spawn(async move {
                    tracing::info!(execution_id = %id, "caller disconnected; cancelling as asked");
                    let _ = engine.cancel(&id).await;
                });
            }))
        } else {
            None
        };
        Ok(Response::new(event_stream_with(submitted.subscription, self.shutdown.clone(), deadline, on_disconnect)))
    }

    async fn start_execution(&self, request: Request<pb::ExecuteRequest>) -> Result<Response<pb::Execution>, Status> {
        let principal = caller(&request)?;
        let traceparent = traceparent(&request);
        let mut cmd = self.command(&principal, request.into_inner()).await?;
        cmd.traceparent = traceparent;
        let submitted = self.engine.submit(cmd).await?;
        audit(&principal, "StartExecution", &submitted.record.execution_id);
        Ok(Response::new(convert::execution(&submitted.record, None)))
    }

    async fn watch_execution(&self, request: Request<pb::WatchRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let deadline = limits::deadline(&request);
        let req = request.into_inner();
        validate::id("execution_id", &req.execution_id)?;
        self.visible(&principal, &req.execution_id).await?;
        let subscription = self.engine.watch(&req.execution_id, req.after_sequence).await?;
        Ok(Response::new(event_stream(subscription, self.shutdown.clone(), deadline)))
    }

    async fn get_execution(
        &self,
        request: Request<pb::GetExecutionRequest>,
    ) -> Result<Response<pb::Execution>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::id("execution_id", &req.execution_id)?;
        let full = validate::view(req.view)?;
        let record = self.visible(&principal, &req.execution_id).await?;
        if full {
            if !principal.may_read_raw(&record.consumer.principal) {
                return Err(denied(crate::auth::Denied {
                    reason: "RAW_OUTPUT_OWNER_ONLY",
                    message: format!("the raw output of {} is for its owner and adm", record.execution_id),
                }));
            }
            let raw = self.engine.raw(&record.execution_id).await?;
            return Ok(Response::new(convert::execution(&record, raw.as_ref())));
        }
        Ok(Response::new(convert::execution(&record, None)))
    }

    async fn list_executions(
        &self,
        request: Request<pb::ListExecutionsRequest>,
    ) -> Result<Response<pb::ListExecutionsResponse>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        let listing = validate::list_executions(&req, &self.page_tokens, &principal.name)?;
        let filter = ExecutionFilter {
            state: listing.state,
            profile: req.profile_ref,
            actor: req.actor,
            project: req.project,
            before_id: listing.before_id,
            projects: principal.visible_projects(),
            limit: listing.limit,
        };
        let records = self.engine.list(&filter).await?;
        let next_page_token = if records.len() == filter.limit as usize {
            let last = records.last().map(|r| r.execution_id.as_str()).unwrap_or_default();
            self.page_tokens.issue(validate::EXECUTIONS, &listing.scope, last)
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListExecutionsResponse {
            executions: records.iter().map(|r| convert::execution(r, None)).collect(),
            next_page_token,
        }))
    }

    async fn cancel_execution(
        &self,
        request: Request<pb::CancelExecutionRequest>,
    ) -> Result<Response<pb::Execution>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::id("execution_id", &req.execution_id)?;
        self.visible(&principal, &req.execution_id).await?;
        let record = self.engine.cancel(&req.execution_id).await?;
        audit(&principal, "CancelExecution", &req.execution_id);
        Ok(Response::new(convert::execution(&record, None)))
    }

    async fn decide_tool_call(
        &self,
        request: Request<pb::DecideToolCallRequest>,
    ) -> Result<Response<pb::DecideToolCallResponse>, Status> {
        let principal = caller(&request)?;
        let req = request.into_inner();
        validate::id("execution_id", &req.execution_id)?;
        let allow = validate::tool_call_decision(&req.call_id, req.decision, &req.reason)?;
        let record = self.visible(&principal, &req.execution_id).await?;
        let run = (req.execution_id.as_str(), &record.consumer);
        let decided =
            super::auth::decide_tool_call(&self.engine, &principal, run, &req.call_id, allow, &req.reason).await?;
        Ok(Response::new(decided))
    }
}
