//! `ingest`: one harness writes P progress lines; how fast the daemon turns
//! them into stored events. The rate comes from the execution's own stored
//! events (their `time`, stamped by the daemon), from the first progress
//! event to `finished`, so the bench client's speed does not enter it: no
//! one follows the execution live while it runs.

use std::time::{Duration, Instant};

use super::target::Channel;
use anyhow::{bail, Context as _};
use serde::Serialize;

use super::client::request;
use super::emitter::{release, Emitter};
use super::fanout::final_state;
use super::target::Target;
use super::BenchArgs;
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;

/// What `corral bench ingest` measured: how fast the daemon stores one
/// harness's progress events.
#[derive(Clone, Debug, Serialize)]
pub struct IngestReport {
    /// The harness profile run.
    pub profile: String,
    /// Which harness emitted the events.
    pub emitter: Emitter,
    /// Progress events the harness was asked to emit.
    pub events: u64,
    /// The execution measured.
    pub execution_id: String,
    /// Its state at the end (`SUCCEEDED`, ...), or the status code if it could
    /// not be read.
    pub execution_state: String,
    /// Progress events stored for the execution.
    pub stored: u64,
    /// First progress event → `finished`, by the events' own times (ms).
    pub span_ms: f64,
    /// Stored progress events per second over `span_ms`.
    pub per_second: f64,
    /// The same emitter alone, outside any sandbox, into a pipe: the
    /// ceiling the daemon could reach with it.
    pub emitter_alone_per_second: f64,
    /// Whether the harness's barrier was released (false: it never started emitting).
    pub barrier_released: bool,
    /// `--ingest-harnesses` emitters at once (absent when 0 or 1).
    pub parallel: Option<IngestParallel>,
}

/// H harnesses emitting at once, each `events` progress lines.
#[derive(Clone, Debug, Serialize)]
pub struct IngestParallel {
    /// Harnesses run at once.
    pub harnesses: usize,
    /// Progress events stored, over every execution.
    pub stored: u64,
    /// From the earliest first progress event to the latest `finished`.
    pub span_ms: f64,
    /// Stored progress events per second over `span_ms`, all executions together.
    pub per_second: f64,
    /// The same H emitters at once outside any sandbox, summed.
    pub emitter_alone_per_second: f64,
    /// Each execution's state at the end.
    pub execution_states: Vec<String>,
}

pub async fn run(target: &Target, args: &BenchArgs) -> anyhow::Result<IngestReport> {
    let emitter = args.emitter(target);
    let (profile, description) = emitter.task(args.events, None);
    let profile = args.emitter_profile.clone().unwrap_or(profile);
    let channel = target.connect().await?;
    let (id, workspace) = start_behind_barrier(&channel, &profile, &description).await?;
    let barrier_released = release(&workspace).is_ok();
    let execution_state = final_state_within(&channel, &id, Duration::from_secs(args.level_timeout)).await;

    let span = stored_span(&channel, &id).await?;
    let (stored, span_ms) = (span.stored, span.ms());
    let emitter_alone_per_second = emitter.alone_per_second(target, args.events).await?;
    let parallel = match args.ingest_harnesses {
        0 | 1 => None,
        h => Some(parallel(target, args, &profile, &description, h).await?),
    };
    Ok(IngestReport {
        profile,
        emitter,
        events: args.events,
        execution_id: id,
        execution_state,
        stored,
        span_ms,
        per_second: per_second(stored, span_ms),
        emitter_alone_per_second,
        barrier_released,
        parallel,
    })
}

/// `harnesses` executions of the emitter, released together.
async fn parallel(
    target: &Target,
    args: &BenchArgs,
    profile: &str,
    description: &str,
    harnesses: usize,
) -> anyhow::Result<IngestParallel> {
    let channel = target.connect().await?;
    let mut ids = Vec::new();
    let mut workspaces = Vec::new();
    for _ in 0..harnesses {
        let (id, workspace) = start_behind_barrier(&channel, profile, description).await?;
        ids.push(id);
        workspaces.push(workspace);
    }
    for workspace in &workspaces {
        let _ = release(workspace);
    }
    let mut execution_states = Vec::new();
    for id in &ids {
        execution_states.push(final_state_within(&channel, id, Duration::from_secs(args.level_timeout)).await);
    }
    let (mut stored, mut first, mut last) = (0, f64::MAX, 0f64);
    for id in &ids {
        let span = stored_span(&channel, id).await?;
        stored += span.stored;
        if let (Some(a), Some(b)) = (span.first_ms, span.finished_ms) {
            first = first.min(a);
            last = last.max(b);
        }
    }
    let span_ms = (last - first).max(0.0);
    let emitter = args.emitter(target);
    let alone =
        futures_util::future::try_join_all((0..harnesses).map(|_| emitter.alone_per_second(target, args.events)));
    let emitter_alone_per_second = alone.await?.into_iter().sum();
    Ok(IngestParallel {
        harnesses,
        stored,
        span_ms,
        per_second: per_second(stored, span_ms),
        emitter_alone_per_second,
        execution_states,
    })
}

/// Starts the emitter; its harness waits behind the barrier in the
/// returned workspace.
async fn start_behind_barrier(channel: &Channel, profile: &str, description: &str) -> anyhow::Result<(String, String)> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let started = client
        .start_execution(request(profile, "corral bench ingest", description))
        .await
        .with_context(|| format!("StartExecution of {profile}"))?
        .into_inner();
    let workspace = tokio::time::timeout(Duration::from_secs(60), workspace_of(channel, &started.execution_id))
        .await
        .context("no sandbox_ready within 60 s")??;
    Ok((started.execution_id, workspace))
}

fn per_second(stored: u64, span_ms: f64) -> f64 {
    if span_ms > 0.0 {
        stored as f64 / (span_ms / 1e3)
    } else {
        0.0
    }
}

/// Follows the execution until its `sandbox_ready`, then lets go.
async fn workspace_of(channel: &Channel, id: &str) -> anyhow::Result<String> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let req = pb::WatchRequest { execution_id: id.to_string(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await?.into_inner();
    while let Some(event) = stream.message().await? {
        match event.kind {
            Some(Kind::SandboxReady(ready)) => return Ok(ready.workspace_path),
            Some(Kind::Finished(_)) => bail!("execution {id} finished before its sandbox was ready"),
            _ => {}
        }
    }
    bail!("the watch of {id} ended before sandbox_ready")
}

async fn final_state_within(channel: &Channel, id: &str, limit: Duration) -> String {
    let until = Instant::now() + limit;
    loop {
        let state = final_state(channel, id).await;
        if !matches!(state.as_str(), "PENDING" | "RUNNING") || Instant::now() > until {
            return state;
        }
    }
}

/// Progress events stored, with the times of the first of them and of
/// `finished` (ms since the epoch, as the daemon stamped them).
struct StoredSpan {
    stored: u64,
    first_ms: Option<f64>,
    finished_ms: Option<f64>,
}

impl StoredSpan {
    fn ms(&self) -> f64 {
        match (self.first_ms, self.finished_ms) {
            (Some(a), Some(b)) => (b - a).max(0.0),
            _ => 0.0,
        }
    }
}

async fn stored_span(channel: &Channel, id: &str) -> anyhow::Result<StoredSpan> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let req = pb::WatchRequest { execution_id: id.to_string(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await?.into_inner();
    let ms = |t: &prost_types::Timestamp| t.seconds as f64 * 1e3 + f64::from(t.nanos) / 1e6;
    let mut span = StoredSpan { stored: 0, first_ms: None, finished_ms: None };
    while let Some(event) = stream.message().await? {
        match &event.kind {
            Some(Kind::Progress(p)) if p.kind == pb::ProgressKind::Progress as i32 => {
                span.stored += 1;
                if span.first_ms.is_none() {
                    span.first_ms = event.time.as_ref().map(ms);
                }
            }
            Some(Kind::Finished(_)) => span.finished_ms = event.time.as_ref().map(ms),
            _ => {}
        }
    }
    Ok(span)
}
