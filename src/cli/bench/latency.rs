//! `latency`: N sequential Executes of the no-op profile against N direct
//! spawns of the identical bwrap command line, interleaved so both sides
//! see the same machine, plus the per-stage breakdown from the
//! executions' own timings.

use std::collections::BTreeMap;

use super::target::Channel;
use anyhow::{bail, Context as _};
use serde::Serialize;

use super::client::{code_name, execute, request, Executed};
use super::floor::Floor;
use super::stats::{median, Percentiles};
use super::target::Target;
use super::BenchArgs;
use crate::pb;
use crate::pb::catalog_service_client::CatalogServiceClient;

/// The stages an execution times, in the order they happen.
pub const STAGES: &[&str] = &["resolve", "gate", "sandbox_create", "workspace", "session_start", "harness", "teardown"];

/// What `corral bench latency` measured: corral's Execute against the
/// same bwrap command line spawned directly.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyReport {
    /// The harness profile run.
    pub profile: String,
    /// Executions timed (and floor spawns, as many).
    pub n: usize,
    /// Untimed runs of each side before the timed ones.
    pub warmup: usize,
    /// Client-observed: Execute sent → `finished` received.
    pub corral: Percentiles,
    /// The same bwrap command line, spawned directly: create, harness,
    /// drain, wait, stop, as corral's sample up to `finished`; its reclaim
    /// (cgroup and directory removed), after `finished` in corral, untimed.
    pub floor: Percentiles,
    /// corral p50 / floor p50.
    pub ratio_p50: f64,
    /// corral p90 / floor p90.
    pub ratio_p90: f64,
    /// corral p99 / floor p99.
    pub ratio_p99: f64,
    /// The floor's command line hashes to corral's enforcement receipt.
    pub floor_matches_receipt: bool,
    /// The floor's command line, with `<workspace>` for the fresh directory.
    pub floor_command: Vec<String>,
    /// Median of each stage over the executions, plus what no stage covers.
    pub stages_p50_ms: BTreeMap<String, f64>,
    /// Executions that did not succeed, by status code or final state.
    pub errors: BTreeMap<String, usize>,
    /// Direct spawns of the floor that failed.
    pub floor_errors: usize,
    /// What one execution adds to the store on disk: the growth of the
    /// SQLite store over the N timed executions, divided by N (in-process
    /// daemons only: the bench must know the data directory).
    pub store_bytes_per_execution: Option<f64>,
    /// Warm sandboxes the daemon kept of the profile (`--warm`; 0: none).
    pub warm_pool: usize,
    /// Whether every timed sample began on a quiet daemon (see
    /// `Target::settle`); `false` against `--server`, which the bench
    /// cannot see into.
    pub settled: bool,
    /// Timed executions whose sandbox was made ahead, in the warm pool:
    /// counted on every run, so a cold run against a daemon that keeps a
    /// pool (`--server`) shows it was not cold.
    pub warm_runs: usize,
    /// Client-observed, `accepted` received → `dispatched` received.
    pub accepted_to_dispatched: Percentiles,
    /// `corral` over the warm runs alone: the warm goals' figure (a run
    /// that found the pool empty ran cold, and is left out of it).
    pub warm_corral: Percentiles,
    /// warm_corral p50 / floor p50.
    pub warm_ratio_p50: f64,
    /// `accepted_to_dispatched` over the warm runs alone.
    pub warm_accepted_to_dispatched: Percentiles,
}

/// (Execute → `finished`, accepted → dispatched) of `runs`, in ms.
fn client_figures<'a>(runs: impl Iterator<Item = &'a Executed> + Clone) -> (Percentiles, Percentiles) {
    let client: Vec<f64> = runs.clone().map(|e| e.client.as_secs_f64() * 1e3).collect();
    let dispatch: Vec<f64> = runs.filter_map(|e| e.accepted_to_dispatched).map(|d| d.as_secs_f64() * 1e3).collect();
    (Percentiles::of_ms(&client), Percentiles::of_ms(&dispatch))
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// One Execute of `profile`; a failure is counted in `errors`.
pub async fn one(channel: &Channel, profile: &str, errors: &mut BTreeMap<String, usize>) -> Option<Executed> {
    match execute(channel, request(profile, "corral bench", "")).await {
        Ok(e) if e.succeeded() => Some(e),
        Ok(e) => {
            *errors.entry(e.state_name()).or_default() += 1;
            None
        }
        Err(status) => {
            *errors.entry(code_name(status.code())).or_default() += 1;
            None
        }
    }
}

/// The profile as the daemon describes it (argv, limits, routes).
pub async fn profile(channel: &Channel, reference: &str) -> anyhow::Result<pb::Profile> {
    let mut catalog = CatalogServiceClient::new(channel.clone());
    let reply = catalog.get_profile(pb::GetProfileRequest { profile_ref: reference.to_string() }).await;
    Ok(reply.with_context(|| format!("GetProfile {reference}"))?.into_inner())
}

/// One execution that must succeed: the warm-up, and the source of the
/// effective sandbox the floor copies.
pub async fn first(channel: &Channel, profile: &str) -> anyhow::Result<Executed> {
    let first = execute(channel, request(profile, "corral bench", "")).await.context("the first Execute")?;
    if !first.succeeded() {
        bail!("the first execution of {profile} ended {} (execution {})", first.state_name(), first.execution_id);
    }
    Ok(first)
}

/// The floor for `profile_ref`: one execution first (it must succeed),
/// whose effective sandbox the floor copies; and whether the floor's
/// command line hashes to that execution's enforcement receipt.
pub async fn floor_for(target: &Target, channel: &Channel, profile_ref: &str) -> anyhow::Result<(Floor, bool)> {
    let described = profile(channel, profile_ref).await?;
    let first = first(channel, profile_ref).await?;
    let effective = first.effective_sandbox.clone().context("the finished execution has no effective sandbox")?;
    let floor = Floor::new(&described, &effective, &target.scratch.join("floor"))?;
    let matches = match (&first.workspace_path, &first.command_digest) {
        (Some(ws), Some(digest)) => floor.matches_receipt(ws, digest),
        _ => false,
    };
    Ok((floor, matches))
}

/// `warm_pool`: how many warm sandboxes of the profile the daemon keeps
/// (0: none; the report counts the runs that took one).
pub async fn run(target: &Target, args: &BenchArgs, warm_pool: usize) -> anyhow::Result<LatencyReport> {
    let n = args.n.unwrap_or(200);
    let channel = target.connect().await?;
    let (floor, floor_matches_receipt) = floor_for(target, &channel, &args.noop_profile).await?;
    let mut floor_command = vec![crate::sandbox::find_on_path("bwrap").unwrap_or_default().display().to_string()];
    floor_command
        .extend(floor.args(std::path::Path::new("<sandbox>")).iter().map(|a| a.to_string_lossy().into_owned()));

    let mut errors = BTreeMap::new();
    let mut floor_errors = 0;
    // The first execution was one warm-up run; the floor gets as many.
    floor.spawn_once().await.context("the first floor spawn")?;
    for _ in 1..args.warmup {
        one(&channel, &args.noop_profile, &mut errors).await;
        let _ = floor.spawn_once().await;
    }
    errors.clear();
    let mut ok = Vec::with_capacity(n);
    let mut floor_ms = Vec::with_capacity(n);
    let store_before = target.store_bytes().await;
    // Each timed sample, either side, starts on a quiet daemon (what an
    // earlier run stopped given back, the pool refilled): what a request
    // costs, not the background work of the one before. That work is
    // throughput's to count.
    let mut settled = true;
    for _ in 0..n {
        settled &= target.settle().await;
        if let Some(e) = one(&channel, &args.noop_profile, &mut errors).await {
            ok.push(e);
        }
        settled &= target.settle().await;
        match floor.spawn_once().await {
            Ok(d) => floor_ms.push(d.as_secs_f64() * 1e3),
            Err(_) => floor_errors += 1,
        }
    }
    let store_bytes_per_execution = match (store_before, target.store_bytes().await) {
        (Some(before), Some(after)) if n > 0 => Some(after.saturating_sub(before) as f64 / n as f64),
        _ => None,
    };
    let (corral, accepted_to_dispatched) = client_figures(ok.iter());
    let (warm_corral, warm_accepted_to_dispatched) = client_figures(ok.iter().filter(|e| e.warm));
    let floor_p = Percentiles::of_ms(&floor_ms);
    Ok(LatencyReport {
        profile: args.noop_profile.clone(),
        n,
        warmup: args.warmup.max(1),
        ratio_p50: ratio(corral.p50_ms, floor_p.p50_ms),
        ratio_p90: ratio(corral.p90_ms, floor_p.p90_ms),
        ratio_p99: ratio(corral.p99_ms, floor_p.p99_ms),
        corral,
        floor: floor_p,
        floor_matches_receipt,
        floor_command,
        stages_p50_ms: stage_breakdown(&ok),
        errors,
        floor_errors,
        store_bytes_per_execution,
        warm_pool,
        settled,
        warm_runs: ok.iter().filter(|e| e.warm).count(),
        accepted_to_dispatched,
        warm_ratio_p50: ratio(warm_corral.p50_ms, floor_p.p50_ms),
        warm_corral,
        warm_accepted_to_dispatched,
    })
}

/// Median of each stage, and of what the stages leave out:
/// `daemon_other` = total − Σ stages (event and record writes between
/// stages), `outside_total` = client − total (gRPC in and out, accepting,
/// the final record write and `finished`), `store_other` = client − Σ
/// stages (the two together).
/// (Σ stages, total, client) of one execution, in ms.
type Parts = (f64, f64, f64);

pub fn stage_breakdown(executions: &[Executed]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if executions.is_empty() {
        return out;
    }
    let ms = |us: u64| us as f64 / 1e3;
    for stage in STAGES.iter().chain(&["total"]) {
        let values: Vec<f64> = executions.iter().map(|e| ms(e.stage_micros(stage).unwrap_or(0))).collect();
        out.insert(stage.to_string(), median(&values));
    }
    let parts: Vec<Parts> = executions
        .iter()
        .map(|e| {
            let sum: u64 = STAGES.iter().map(|s| e.stage_micros(s).unwrap_or(0)).sum();
            (ms(sum), ms(e.stage_micros("total").unwrap_or(0)), ms(e.client.as_micros() as u64))
        })
        .collect();
    let med = |f: fn(&Parts) -> f64| median(&parts.iter().map(f).collect::<Vec<_>>());
    out.insert("daemon_other".into(), med(|(sum, total, _)| total - sum));
    out.insert("outside_total".into(), med(|(_, total, client)| client - total));
    out.insert("store_other".into(), med(|(sum, _, client)| client - sum));
    out.insert("client".into(), med(|(_, _, client)| *client));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn run(warm: bool, client_ms: u64, dispatch_ms: u64) -> Executed {
        Executed {
            client: Duration::from_millis(client_ms),
            warm,
            accepted_to_dispatched: Some(Duration::from_millis(dispatch_ms)),
            ..Default::default()
        }
    }

    /// The warm goals' figures are of the warm runs alone: the runs that
    /// found the pool empty and ran cold do not pull them up.
    #[test]
    fn warm_figures_leave_the_cold_runs_out() {
        let runs = [run(true, 3, 1), run(false, 9, 8), run(false, 10, 9), run(true, 4, 2)];
        let (all, all_dispatch) = client_figures(runs.iter());
        assert_eq!((all.count, all.p50_ms, all_dispatch.p50_ms), (4, 4.0, 2.0));
        let (warm, warm_dispatch) = client_figures(runs.iter().filter(|e| e.warm));
        assert_eq!((warm.count, warm.p50_ms, warm.max_ms), (2, 3.0, 4.0));
        assert_eq!((warm_dispatch.count, warm_dispatch.p50_ms), (2, 1.0));
        let (none, _) = client_figures(runs.iter().filter(|_| false));
        assert_eq!(none, Percentiles::default());
        assert_eq!((ratio(3.0, 6.0), ratio(3.0, 0.0)), (0.5, 0.0));
    }
}
