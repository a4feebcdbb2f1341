//! `fleet`: two in-process nodes on one PostgreSQL (`--postgres`), a front
//! end (`capacity = 0`) and a node with room. Every execution sent to the
//! front end goes through the fleet's queue. Measured: the claim latency
//! (from the front end storing the execution to the claiming node's
//! `accepted` event), the cross-node event delay (from the running node
//! storing an event to the front end's caller receiving it), and no-op
//! executions per second at concurrency 16 through the queue against the
//! same node taking them itself.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use super::target::Channel;
use serde::Serialize;

use super::client::request;
use super::stats::Percentiles;
use super::target::Target;
use super::BenchArgs;
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;
use crate::pb::lifecycle_event::Kind;

/// The concurrency the throughput comparison runs at.
pub const CONCURRENCY: usize = 16;

/// What `corral bench fleet` measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FleetReport {
    /// Why nothing was measured, when nothing was (no `--postgres`, or a
    /// `--server`).
    pub not_measured: Option<String>,
    /// The harness profile run.
    pub profile: String,
    /// Executions sent one at a time through the front end.
    pub sequential: usize,
    /// Front end stores the execution → a node's `accepted` event (both
    /// store timestamps: 1 ms resolution, one host's clock).
    pub claim_latency: Percentiles,
    /// An event stored by the running node → received by the caller on the
    /// front end (the event's store timestamp against this host's clock at
    /// receipt: 1 ms resolution).
    pub cross_node_delay: Percentiles,
    /// No-op executions per second at [`CONCURRENCY`] sent to the front end
    /// (every one through the queue, run by the other node).
    pub queued_per_second: f64,
    /// The same sent to the node with room itself (taken at once).
    pub single_per_second: f64,
    /// `queued_per_second / single_per_second`.
    pub ratio: f64,
    /// Executions of the two throughput runs that did not succeed.
    pub errors: usize,
}

fn now_ms() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1e3).unwrap_or_default()
}

fn ms(t: &Option<prost_types::Timestamp>) -> f64 {
    t.as_ref().map(|t| t.seconds as f64 * 1e3 + f64::from(t.nanos) / 1e6).unwrap_or_default()
}

/// Runs the scenario: two fresh in-process nodes on `--postgres`, or
/// "not measured" with the reason.
pub async fn run(args: &BenchArgs, server: Option<&crate::cli::Remote>) -> anyhow::Result<FleetReport> {
    let not = |why: &str| FleetReport { not_measured: Some(why.into()), ..FleetReport::default() };
    if server.is_some() {
        return Ok(not("the fleet scenario starts its own two nodes (no --server)"));
    }
    let Some(url) = args.postgres.clone() else {
        return Ok(not("needs --postgres URL (or CORRAL_BENCH_POSTGRES): a database its two nodes share"));
    };
    let tag = uuid::Uuid::now_v7().simple().to_string();
    let node = |role: &str, capacity: usize| {
        let (url, name) = (url.clone(), format!("bench-{role}-{}", &tag[tag.len() - 8..]));
        move |config: &mut crate::config::Config| {
            config.store.url = Some(url);
            config.fleet.node = Some(name);
            config.fleet.capacity = Some(capacity);
        }
    };
    let front = Target::in_process_with(None, node("front", 0)).await?;
    let runner = Target::in_process_with(None, node("runner", CONCURRENCY)).await?;
    let measured = measure(args, &front, &runner).await;
    let stopped = (front.stop().await, runner.stop().await);
    let report = measured?;
    stopped.0?;
    stopped.1?;
    Ok(report)
}

async fn measure(args: &BenchArgs, front: &Target, runner: &Target) -> anyhow::Result<FleetReport> {
    let profile = args.noop_profile.clone();
    let via_front = front.connect().await?;
    let sequential = args.n.unwrap_or(100);
    // One untimed run first: connections, the profile's first resolution.
    followed(&via_front, &profile).await?;
    let mut claims = Vec::new();
    let mut delays = Vec::new();
    for _ in 0..sequential {
        let run = followed(&via_front, &profile).await?;
        claims.push(run.claim_ms);
        delays.extend(run.delays_ms);
    }
    let count = args.n.unwrap_or(10 * CONCURRENCY).max(CONCURRENCY);
    let sandboxes = Arc::new(Mutex::new(Vec::new()));
    let channels = async |target: &Target| {
        let mut channels = Vec::new();
        for _ in 0..2 {
            channels.push(target.connect().await?);
        }
        anyhow::Ok(channels)
    };
    use super::throughput::{round, Level};
    let queued = round(&channels(front).await?, &profile, CONCURRENCY, count, &sandboxes).await;
    let single = round(&channels(runner).await?, &profile, CONCURRENCY, count, &sandboxes).await;
    let (queued, single) = (Level::of(CONCURRENCY, &[queued], &[]), Level::of(CONCURRENCY, &[single], &[]));
    let errors = (queued.executions - queued.succeeded) + (single.executions - single.succeeded);
    Ok(FleetReport {
        not_measured: None,
        profile,
        sequential,
        claim_latency: Percentiles::of_ms(&claims),
        cross_node_delay: Percentiles::of_ms(&delays),
        queued_per_second: queued.per_second,
        single_per_second: single.per_second,
        ratio: if single.per_second > 0.0 { queued.per_second / single.per_second } else { 0.0 },
        errors,
    })
}

/// One execution through the front end, its stream read to the end.
struct Followed {
    claim_ms: f64,
    delays_ms: Vec<f64>,
}

async fn followed(channel: &Channel, profile: &str) -> anyhow::Result<Followed> {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let mut stream = client.execute(request(profile, "corral bench fleet", "")).await?.into_inner();
    let (mut accepted_ms, mut delays_ms, mut created_ms) = (None, Vec::new(), None);
    while let Some(event) = stream.message().await? {
        let received = now_ms();
        let stored = ms(&event.time);
        delays_ms.push((received - stored).max(0.0));
        match &event.kind {
            Some(Kind::Accepted(_)) => accepted_ms = Some(stored),
            Some(Kind::Finished(finished)) => {
                if let Some(pb::finished::Record::Execution(e)) = &finished.record {
                    anyhow::ensure!(
                        e.state == pb::ExecutionState::Succeeded as i32,
                        "a bench execution did not succeed: {e:?}"
                    );
                    created_ms = Some(ms(&e.created_at));
                }
            }
            _ => {}
        }
    }
    match (accepted_ms, created_ms) {
        (Some(accepted), Some(created)) => Ok(Followed { claim_ms: (accepted - created).max(0.0), delays_ms }),
        _ => anyhow::bail!("the Execute stream ended without accepted and finished events"),
    }
}
