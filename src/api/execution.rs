//! ExecutionService: validate, call the engine once, convert back.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::auth::{audited, caller, denied, not_visible};
use super::page::PageTokens;
use super::streams_end::{Listener, StreamsEnd};
use super::{convert, limits, status, validate};
use crate::lifecycle::{Cut, Engine, Lagged, Submitted, Subscription};
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
    /// Ended once the daemon has drained; every open event stream then ends.
    pub shutdown: StreamsEnd,
    /// Seals and opens the listings' page tokens.
    pub page_tokens: Arc<PageTokens>,
}

/// A subscription as a response stream, until the subject ends, the daemon
/// stops, or the caller's deadline passes.
pub fn event_stream(subscription: Subscription, shutdown: &StreamsEnd, deadline: Option<Instant>) -> EventStream {
    event_stream_with(subscription, shutdown, deadline, None)
}

/// How long a client may read nothing while it is further behind than the
/// live buffer before it is ended as stalled.
const STALL: Duration = Duration::from_secs(1);

/// The stream's own ends are looked at whenever no event is ready, and at
/// least every this many events.
const CHECK_EVERY: u32 = 64;

/// Like [`event_stream`]; `on_disconnect` runs if the client goes away
/// before the stream has ended.
///
/// The stream is polled by the connection's own task for the response
/// body: each event goes from the subscription to the encoder with no task
/// or channel of its own in between (at W = 10,000 that would be 10,000
/// more wakeups per event). HTTP/2 stops polling it when the client reads
/// nothing, so it holds only its place in the live channel, never a
/// backlog.
///
/// A client that reads slowly catches up from the store (see
/// [`Subscription`]). One that read nothing for [`STALL`] and is by then
/// further behind than the live buffer is ended, when it reads again, with
/// RESOURCE_EXHAUSTED and the last sequence it was sent, so it can resume.
/// It never slows the execution: the live channel does not wait for it.
///
/// A call with a deadline (`grpc-timeout`) ends with DEADLINE_EXCEEDED and
/// the last sequence sent when it passes; for the caller that is the call
/// going away, so `on_disconnect` runs as if it had disconnected.
pub fn event_stream_with(
    subscription: Subscription,
    shutdown: &StreamsEnd,
    deadline: Option<Instant>,
    on_disconnect: Option<Box<dyn FnOnce() + Send>>,
) -> EventStream {
    let expired: Pin<Box<dyn Future<Output = ()> + Send>> = match deadline {
        Some(at) => Box::pin(tokio::time::sleep_until(at.into())),
        None => Box::pin(std::future::pending()),
    };
    let pump = Pump {
        sent: subscription.last_sequence(),
        subscription,
        shutdown: shutdown.listen(),
        expired,
        unchecked: 0,
        asked_at: coarse_now(),
        end: End::new(on_disconnect),
    };
    // Boxed: each item moves the state into the next call and back out.
    Box::pin(futures_util::stream::unfold(Box::new(pump), Pump::next))
}

/// The state of one event stream between two items.
struct Pump {
    subscription: Subscription,
    shutdown: Listener,
    expired: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The last sequence handed to the encoder.
    sent: u64,
    /// Events since the stream's own ends were last looked at.
    unchecked: u32,
    /// When the encoder last asked for an item (see [`coarse_now`]).
    asked_at: Duration,
    end: End,
}

type Item = Result<super::wire::WireEvent, Status>;

impl Pump {
    /// The next item, and the state for the one after; `None` once ended.
    async fn next(mut self: Box<Self>) -> Option<(Item, Box<Pump>)> {
        if self.end.ended {
            return None;
        }
        // Not asked for STALL (HTTP/2 had no room: the client read nothing),
        // or an event was that long in coming (then it is not behind).
        let asked_at = std::mem::replace(&mut self.asked_at, coarse_now());
        if self.asked_at.saturating_sub(asked_at) >= STALL && self.subscription.overrun() {
            let lag = Lagged { last_sequence: self.sent, cut: Cut::Behind };
            return Some(self.last(Err(status::lagged(lag))));
        }
        loop {
            self.unchecked += 1;
            let check = self.unchecked >= CHECK_EVERY;
            let next = tokio::select! {
                biased;
                next = self.subscription.next(), if !check => Some(next),
                _ = self.shutdown.ended() => {
                    let sent = self.sent;
                    return Some(self.last(Err(Status::unavailable(format!(
                        "daemon shutting down; resume with after_sequence = {sent}"
                    )))));
                }
                _ = &mut self.expired => {
                    let sent = self.sent;
                    self.end.disconnected();
                    return Some(self.last(Err(Status::deadline_exceeded(format!(
                        "the call's deadline passed; resume with after_sequence = {sent}"
                    )))));
                }
                _ = std::future::ready(()), if check => None,
            };
            match next {
                None => self.unchecked = 0,
                Some(None) => {
                    self.end.ended = true;
                    return None;
                }
                Some(Some(Ok(item))) => {
                    self.sent = item.event().sequence;
                    return Some((Ok(super::wire::WireEvent::of(item)), self));
                }
                Some(Some(Err(lag))) => return Some(self.last(Err(status::lagged(lag)))),
            }
        }
    }

    /// `item` as the stream's last.
    fn last(mut self: Box<Self>, item: Item) -> (Item, Box<Pump>) {
        self.end.ended = true;
        (item, self)
    }
}

/// The monotonic clock at the kernel's tick (a few ms), for the stall rule,
/// which counts in seconds: it is read for every item of every stream, and
/// the coarse clock is a plain read of the vDSO's page, where
/// `Instant::now` also reads the TSC (1.8% of the CPU of 10,000 paced
/// watchers).
fn coarse_now() -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes only the timespec it is given; Linux
    // has had CLOCK_MONOTONIC_COARSE since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    Duration::new(now.tv_sec.max(0) as u64, now.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// Counts the stream as a watcher while it lives, and runs `on_disconnect`
/// if it is dropped (the client went away) before it ended.
struct End {
    ended: bool,
    on_disconnect: Option<Box<dyn FnOnce() + Send>>,
}

impl End {
    fn new(on_disconnect: Option<Box<dyn FnOnce() + Send>>) -> End {
        crate::telemetry::watchers(1.0);
        End { ended: false, on_disconnect }
    }

    fn disconnected(&mut self) {
        if let Some(callback) = self.on_disconnect.take() {
            callback();
        }
    }
}

impl Drop for End {
    fn drop(&mut self) {
        crate::telemetry::watchers(-1.0);
        if !self.ended {
            self.disconnected();
        }
    }
}

/// The W3C `traceparent` the caller sent, if any (bounded: it is 55 bytes).
pub(super) fn traceparent<T>(request: &Request<T>) -> Option<String> {
    let value = request.metadata().get("traceparent")?.to_str().ok()?;
    (value.len() <= 128).then(|| value.to_string())
}

impl ExecutionApi {
    /// Submits `cmd` for `principal`, audited as `rpc` by the task that
    /// accepts it (see [`audited`]).
    async fn submit(
        &self,
        principal: &crate::auth::Principal,
        rpc: &'static str,
        cmd: crate::records::ExecuteCommand,
    ) -> Result<Submitted, Status> {
        let engine = self.engine.clone();
        let submitting = async move { engine.submit(cmd).await };
        let id_of = |s: &Result<Submitted, _>| s.as_ref().ok().map(|s| s.record.execution_id.clone());
        audited(&self.engine, principal, rpc, submitting, id_of).await
    }

    /// The request as a command of `principal`: validated, its actor and
    /// project checked against the principal's.
    async fn command(
        &self,
        principal: &crate::auth::Principal,
        request: pb::ExecuteRequest,
    ) -> Result<crate::lifecycle::ExecuteCommand, Status> {
        let mut cmd = validate::execute_request(request, &self.repo_roots, principal).await?;
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
        cmd.follows = true;
        let mut submitted = self.submit(&principal, "Execute", cmd).await?;
        // The answer was read: from here the stream cancels on a
        // disconnect (nothing below awaits), and a refusal below is an
        // answer, not a caller gone away.
        if let Some(guard) = submitted.unless_kept.take() {
            guard.keep();
        }
        let id = submitted.record.execution_id.clone();
        // A retry (same request id, same request) follows the execution it
        // did not start: counted as a watcher, like any stream that does.
        let subscription = match submitted.existing {
            true => self.engine.counted(submitted.subscription, &id, &principal.name)?,
            false => submitted.subscription,
        };
        // Armed for a retry too: the retrying caller asked for it, and its
        // stream is the one it keeps (a finished execution is not changed
        // by a cancel).
        let on_disconnect: Option<Box<dyn FnOnce() + Send>> = if cancel_on_disconnect {
            let engine = self.engine.clone();
            Some(Box::new(move || {
                tokio::spawn(async move {
                    tracing::info!(execution_id = %id, "caller disconnected; cancelling as asked");
                    let _ = engine.cancel(&id).await;
                });
            }))
        } else {
            None
        };
        Ok(Response::new(event_stream_with(subscription, &self.shutdown, deadline, on_disconnect)))
    }

    async fn start_execution(&self, request: Request<pb::ExecuteRequest>) -> Result<Response<pb::Execution>, Status> {
        let principal = caller(&request)?;
        let traceparent = traceparent(&request);
        let request = request.into_inner();
        // StartExecution's caller has no stream to disconnect from: asked
        // for, it could not be kept.
        if request.cancel_on_disconnect {
            return Err(status::invalid_argument(
                "cancel_on_disconnect",
                "is for Execute only: StartExecution returns at once, with no stream whose end could cancel it",
            ));
        }
        let mut cmd = self.command(&principal, request).await?;
        cmd.traceparent = traceparent;
        let submitted = self.submit(&principal, "StartExecution", cmd).await?;
        Ok(Response::new(convert::execution(&submitted.record, None)))
    }

    async fn watch_execution(&self, request: Request<pb::WatchRequest>) -> Result<Response<EventStream>, Status> {
        let principal = caller(&request)?;
        let deadline = limits::deadline(&request);
        let req = request.into_inner();
        validate::id("execution_id", &req.execution_id)?;
        self.visible(&principal, &req.execution_id).await?;
        let subscription = self.engine.watch(&req.execution_id, req.after_sequence, &principal.name).await?;
        Ok(Response::new(event_stream(subscription, &self.shutdown, deadline)))
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
        let engine = self.engine.clone();
        let id = req.execution_id.clone();
        let cancelling = async move { engine.cancel(&id).await };
        let id = req.execution_id.clone();
        let record = audited(&self.engine, &principal, "CancelExecution", cancelling, move |done| {
            super::auth::done_or_taken(done).then_some(id)
        })
        .await?;
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
