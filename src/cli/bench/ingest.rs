//! `ingest`: one harness writes P progress lines; how fast the daemon turns
//! them into stored events. The rate comes from the execution's own stored
//! events (their `time`, stamped by the daemon), from the first progress
//! event to `finished`, so the bench client's speed does not enter it: no
//! one follows the execution live while it runs.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Serialize;
use tonic::transport::Channel;

use super::client::request;
use super::emitter::{release, Emitter};
use super::fanout::final_state;
use super::target::Target;
use super::BenchArgs;
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;

#[derive(Clone, Debug, Serialize)]
pub struct IngestReport {
    pub profile: String,
    pub emitter: Emitter,
    pub events: u64,
    pub execution_id: String,
    pub execution_state: String,
    /// Progress events stored for the execution.
    pub stored: u64,
    /// First progress event → `finished`, by the events' own times (ms).
    pub span_ms: f64,
    pub per_second: f64,
    /// The same emitter alone, outside any sandbox, into a pipe: the
    /// ceiling the daemon could reach with it.
    pub emitter_alone_per_second: f64,
    pub barrier_released: bool,
}

pub async fn run(target: &Target, args: &BenchArgs) -> anyhow::Result<IngestReport> {
    let emitter = args.emitter(target);
    let (profile, description) = emitter.task(args.events);
    let profile = args.emitter_profile.clone().unwrap_or(profile);
    let channel = target.connect().await?;
    let mut client = ExecutionServiceClient::new(channel.clone());
    let started = client
        .start_execution(request(&profile, "corral bench ingest", &description))
        .await
        .with_context(|| format!("StartExecution of {profile}"))?
        .into_inner();
    let id = started.execution_id;
    let workspace = tokio::time::timeout(Duration::from_secs(60), workspace_of(&channel, &id))
        .await
        .context("no sandbox_ready within 60 s")??;
    let barrier_released = release(&workspace).is_ok();
    let execution_state = final_state_within(&channel, &id, Duration::from_secs(args.level_timeout)).await;

    let (stored, span_ms) = stored_span(&channel, &id).await?;
    let emitter_alone_per_second = emitter.alone_per_second(target, args.events).await?;
    Ok(IngestReport {
        profile,
        emitter,
        events: args.events,
        execution_id: id,
        execution_state,
        stored,
        span_ms,
        per_second: if span_ms > 0.0 { stored as f64 / (span_ms / 1e3) } else { 0.0 },
        emitter_alone_per_second,
        barrier_released,
    })
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

/// Progress events stored, and the ms from the first of them to `finished`.
async fn stored_span(channel: &Channel, id: &str) -> anyhow::Result<(u64, f64)> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let req = pb::WatchRequest { execution_id: id.to_string(), after_sequence: 0 };
    let mut stream = client.watch_execution(req).await?.into_inner();
    let ms = |t: &prost_types::Timestamp| t.seconds as f64 * 1e3 + f64::from(t.nanos) / 1e6;
    let (mut first, mut finished, mut stored) = (None, None, 0u64);
    while let Some(event) = stream.message().await? {
        match &event.kind {
            Some(Kind::Progress(p)) if p.kind == pb::ProgressKind::Progress as i32 => {
                stored += 1;
                if first.is_none() {
                    first = event.time.as_ref().map(ms);
                }
            }
            Some(Kind::Finished(_)) => finished = event.time.as_ref().map(ms),
            _ => {}
        }
    }
    Ok(match (first, finished) {
        (Some(a), Some(b)) => (stored, (b - a).max(0.0)),
        _ => (stored, 0.0),
    })
}
