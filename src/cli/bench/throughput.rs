//! `throughput`: executions per second of the no-op profile at several
//! concurrency levels, what failed and how, and what was left behind; and
//! the floor's spawns per second at the same concurrency, the ceiling.
//!
//! At each level corral and the floor take turns, `--rounds` times: each
//! side's rate is all its runs over all its time. The host's speed drifts
//! (the floor alone moved between 130 and 212 spawns/s within one run
//! here), and a single pair measured a second apart caught it on one side.
//! An in-process daemon's round lasts until the daemon is quiet again, so
//! the teardown after each run's `finished` and a warm pool's refills are
//! counted on corral's side, never in the floor's time.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use super::client::{code_name, execute, request};
use super::floor::Floor;
use super::latency;
use super::stats::Percentiles;
use super::system::{self, CpuUse, HostCpu, LeakedProcesses};
use super::target::Target;
use super::BenchArgs;

/// Concurrent streams per HTTP/2 connection (servers commonly allow
/// 100–200; the bench stays well under).
const STREAMS_PER_CONNECTION: usize = 16;

/// One concurrency level of `corral bench throughput`.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    /// Executions in flight at once.
    pub concurrency: usize,
    /// Rounds of corral then the floor the figures add up.
    pub rounds: usize,
    /// Executions run at the level, succeeded or not.
    pub executions: usize,
    /// Executions that succeeded.
    pub succeeded: usize,
    /// Of those, the ones whose sandbox was made ahead, in a warm pool
    /// (their evidence says so); the others found it empty and ran cold.
    pub warm_runs: usize,
    /// Wall time of the level's executions (its rounds' corral parts, each
    /// until an in-process daemon was quiet again), in seconds.
    pub seconds: f64,
    /// Executions that succeeded, per second of the level.
    pub per_second: f64,
    /// Client-observed latency of the executions that succeeded.
    pub latency: Percentiles,
    /// The floor (the same bwrap command line spawned directly) at the
    /// same concurrency and count: spawns that succeeded per second of wall
    /// time over the level's floor parts, each spawn's reclaim (cgroup and
    /// directory removed) inside that time, as corral's rounds wait for its
    /// reclaims: the ceiling.
    pub floor_per_second: f64,
    /// Direct spawns of the floor that failed.
    pub floor_errors: usize,
    /// The host's busy CPU (every process and the kernel) per execution at
    /// this level, and how busy the CPUs were: what an execution costs the
    /// machine. `None` when the daemon is not on this host.
    pub cpu: Option<CpuUse>,
    /// The same for the floor's spawns at this level.
    pub floor_cpu: Option<CpuUse>,
    /// What did not succeed: a status code (`RESOURCE_EXHAUSTED`, ...) or
    /// the final state of an execution that ran (`FAILED`, ...).
    pub errors: BTreeMap<String, usize>,
}

/// What the run's sandboxes left behind.
#[derive(Clone, Debug, Serialize)]
pub struct Leaks {
    /// Sandbox roots of this run's executions that still exist.
    pub sandbox_dirs: usize,
    /// Entries under `<data>/sandboxes` that are not a warm sandbox
    /// waiting in a pool (in-process daemon only; with a pool, counted once
    /// the daemon is quiet, its pool refilled: not measured when it did not
    /// get quiet).
    pub data_sandboxes_entries: Option<usize>,
    /// The warm sandboxes the daemon keeps (`--warm`; 0: none).
    pub warm_pool: usize,
    /// Processes left running and bwrap zombies nobody reaped.
    pub processes: LeakedProcesses,
}

/// What `corral bench throughput` measured, level by level.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputReport {
    /// The harness profile run.
    pub profile: String,
    /// One entry per concurrency level, in order.
    pub levels: Vec<Level>,
    /// The floor's command line hashes to corral's enforcement receipt.
    pub floor_matches_receipt: bool,
    /// Counted right after the last stream ended.
    pub leaks: Leaks,
}

/// `warm_pool`: how many warm sandboxes of the profile the daemon keeps.
pub async fn run(target: &Target, args: &BenchArgs, warm_pool: usize) -> anyhow::Result<ThroughputReport> {
    let mut channels = Vec::new();
    let max = args.concurrency.iter().copied().max().unwrap_or(1);
    for _ in 0..max.div_ceil(STREAMS_PER_CONNECTION) {
        channels.push(target.connect().await?);
    }
    let (floor, floor_matches_receipt) = latency::floor_for(target, &channels[0], &args.noop_profile).await?;
    let floor = Arc::new(floor);
    let sandboxes: Arc<Mutex<Vec<(String, PathBuf)>>> = Arc::default();
    let mut levels = Vec::new();
    for &concurrency in &args.concurrency {
        let count = args.n.unwrap_or((10 * concurrency).max(50));
        let (mut corral, mut floors) = (Vec::new(), Vec::new());
        // The CPU ticks each side used, summed over the rounds.
        let (mut corral_cpu, mut floor_cpu) = (Some(HostCpu::default()), Some(HostCpu::default()));
        for _ in 0..args.rounds.max(1) {
            // Each round starts from a quiet daemon, its pool full, and
            // ends when the daemon is quiet again: the sandboxes its runs
            // stopped given back and the pool refilled behind them are
            // its time and CPU, not the floor's (an in-process daemon; one
            // elsewhere cannot be watched).
            target.settle().await;
            let (before, started) = (HostCpu::now(), Instant::now());
            let mut executed = round(&channels, &args.noop_profile, concurrency, count, &sandboxes).await;
            target.settle().await;
            executed.seconds = started.elapsed().as_secs_f64();
            corral.push(executed);
            let between = HostCpu::now();
            floors.push(floor_round(&floor, concurrency, count).await);
            let after = HostCpu::now();
            corral_cpu = add_span(corral_cpu, before, between);
            floor_cpu = add_span(floor_cpu, between, after);
        }
        let mut level = Level::of(concurrency, &corral, &floors);
        let used = |ticks: Option<HostCpu>, runs| HostCpu::default().used_until(ticks?, runs, system::tick_ms());
        // A daemon elsewhere spends its CPU there: this host's is not its.
        level.cpu = used(corral_cpu, level.executions).filter(|_| target.daemon_pid.is_some());
        level.floor_cpu = used(floor_cpu, floors.iter().map(|f| f.ok + f.failed).sum());
        levels.push(level);
    }
    let sandboxes = std::mem::take(&mut *sandboxes.lock().unwrap_or_else(|e| e.into_inner()));
    let ids: HashSet<String> = sandboxes.iter().map(|(id, _)| id.clone()).collect();
    // The pool refills after the last run: what is under data/sandboxes
    // besides the sandboxes waiting in it is what leaked, counted once the
    // daemon is quiet (a refill being made is no leak).
    let quiet = warm_pool == 0 || target.settle().await;
    let data_sandboxes_entries = match (target.sandboxes_dir(), target.warm_roots()) {
        (Some(dir), Some(warm)) if quiet => Some(system::entries_except(&dir, &warm)),
        _ => None,
    };
    let leaks = Leaks {
        sandbox_dirs: sandboxes.iter().filter(|(_, root)| root.exists()).count(),
        data_sandboxes_entries,
        warm_pool,
        processes: system::leaked_processes(target.daemon_pid, &ids),
    };
    Ok(ThroughputReport { profile: args.noop_profile.clone(), levels, floor_matches_receipt, leaks })
}

/// `total` plus the CPU ticks from `from` to `to`; `None` once any reading
/// is missing (no `/proc/stat`, or a counter that went back).
fn add_span(total: Option<HostCpu>, from: Option<HostCpu>, to: Option<HostCpu>) -> Option<HostCpu> {
    let (total, from, to) = (total?, from?, to?);
    Some(HostCpu {
        busy: total.busy + to.busy.checked_sub(from.busy)?,
        idle: total.idle + to.idle.checked_sub(from.idle)?,
    })
}

/// One round of executions at a level: what each that succeeded took, in
/// ms, what did not succeed, and the round's wall time.
#[derive(Clone, Debug, Default)]
pub(super) struct Round {
    latencies_ms: Vec<f64>,
    /// Successful executions that took a warm sandbox.
    warm: usize,
    errors: BTreeMap<String, usize>,
    seconds: f64,
}

/// One round of floor spawns at a level.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FloorRound {
    ok: usize,
    failed: usize,
    seconds: f64,
}

impl Level {
    /// A level's figures from its rounds: each side's rate is all its
    /// successful runs over all its time; the CPU is left to the caller.
    pub(super) fn of(concurrency: usize, corral: &[Round], floor: &[FloorRound]) -> Level {
        let latencies: Vec<f64> = corral.iter().flat_map(|r| r.latencies_ms.iter().copied()).collect();
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        for (code, n) in corral.iter().flat_map(|r| &r.errors) {
            *errors.entry(code.clone()).or_default() += n;
        }
        let rate = |runs: usize, seconds: f64| if seconds > 0.0 { runs as f64 / seconds } else { 0.0 };
        let seconds = corral.iter().map(|r| r.seconds).sum();
        let floor_seconds = floor.iter().map(|f| f.seconds).sum();
        Level {
            concurrency,
            rounds: corral.len(),
            executions: latencies.len() + errors.values().sum::<usize>(),
            succeeded: latencies.len(),
            warm_runs: corral.iter().map(|r| r.warm).sum(),
            seconds,
            per_second: rate(latencies.len(), seconds),
            latency: Percentiles::of_ms(&latencies),
            floor_per_second: rate(floor.iter().map(|f| f.ok).sum(), floor_seconds),
            floor_errors: floor.iter().map(|f| f.failed).sum(),
            cpu: None,
            floor_cpu: None,
            errors,
        }
    }
}

/// `count` executions by `concurrency` clients.
pub(super) async fn round(
    channels: &[super::target::Channel],
    profile: &str,
    concurrency: usize,
    count: usize,
    sandboxes: &Arc<Mutex<Vec<(String, PathBuf)>>>,
) -> Round {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..concurrency.max(1) {
        let channel = channels[(worker / STREAMS_PER_CONNECTION) % channels.len()].clone();
        let (next, sandboxes, profile) = (next.clone(), sandboxes.clone(), profile.to_string());
        workers.spawn(async move {
            let (mut latencies, mut warm) = (Vec::new(), 0);
            let mut errors: BTreeMap<String, usize> = BTreeMap::new();
            while next.fetch_add(1, Ordering::SeqCst) < count {
                match execute(&channel, request(&profile, "corral bench", "")).await {
                    Ok(e) => {
                        // The workspace sits in the sandbox's root directory.
                        let root = e.workspace_path.as_deref().and_then(|ws| std::path::Path::new(ws).parent());
                        if let (Some(id), Some(root)) = (&e.sandbox_id, root) {
                            sandboxes.lock().unwrap_or_else(|e| e.into_inner()).push((id.clone(), root.to_path_buf()));
                        }
                        if e.succeeded() {
                            latencies.push(e.client.as_secs_f64() * 1e3);
                            warm += usize::from(e.warm);
                        } else {
                            *errors.entry(e.state_name()).or_default() += 1;
                        }
                    }
                    Err(status) => *errors.entry(code_name(status.code())).or_default() += 1,
                }
            }
            (latencies, warm, errors)
        });
    }
    let (mut latencies, mut warm) = (Vec::new(), 0);
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok((l, w, e)) => {
                latencies.extend(l);
                warm += w;
                for (k, v) in e {
                    *errors.entry(k).or_default() += v;
                }
            }
            Err(_) => *errors.entry("BENCH_WORKER_PANICKED".into()).or_default() += 1,
        }
    }
    Round { latencies_ms: latencies, warm, errors, seconds: started.elapsed().as_secs_f64() }
}

/// `count` floor spawns by `concurrency` tasks; the round's wall time
/// ends when the last spawn's sandbox is reclaimed (a spawn's own timer
/// leaves its reclaim out, latency's; this one does not).
async fn floor_round(floor: &Arc<Floor>, concurrency: usize, count: usize) -> FloorRound {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (floor, next) = (floor.clone(), next.clone());
        workers.spawn(async move {
            let (mut ok, mut failed) = (0usize, 0usize);
            while next.fetch_add(1, Ordering::SeqCst) < count {
                match floor.spawn_once().await {
                    Ok(_) => ok += 1,
                    Err(_) => failed += 1,
                }
            }
            (ok, failed)
        });
    }
    let (mut ok, mut failed) = (0, 0);
    while let Some(joined) = workers.join_next().await {
        let (o, f) = joined.unwrap_or((0, 1));
        ok += o;
        failed += f;
    }
    FloorRound { ok, failed, seconds: started.elapsed().as_secs_f64() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each side's rate is its runs over its time across the rounds, not a
    /// mean of the rounds' rates; latencies and errors are all the rounds'.
    #[test]
    fn a_levels_rates_are_all_its_rounds_runs_over_all_their_time() {
        let errors = |code: &str| BTreeMap::from([(code.to_string(), 1)]);
        let corral = [
            Round { latencies_ms: vec![10.0, 20.0, 30.0], warm: 2, errors: errors("FAILED"), seconds: 1.0 },
            Round { latencies_ms: vec![40.0], warm: 1, errors: errors("FAILED"), seconds: 0.5 },
        ];
        let floor = [FloorRound { ok: 10, failed: 0, seconds: 1.0 }, FloorRound { ok: 5, failed: 1, seconds: 2.0 }];
        let level = Level::of(16, &corral, &floor);
        assert_eq!((level.rounds, level.executions, level.succeeded, level.warm_runs), (2, 6, 4, 3));
        assert_eq!(level.seconds, 1.5);
        assert_eq!(level.per_second, 4.0 / 1.5);
        assert_eq!((level.floor_per_second, level.floor_errors), (5.0, 1));
        assert_eq!(level.errors, BTreeMap::from([("FAILED".to_string(), 2)]));
        assert_eq!(level.latency.count, 4);
    }

    #[test]
    fn the_cpu_of_the_rounds_adds_up_and_a_missing_reading_measures_nothing() {
        let at = |busy, idle| Some(HostCpu { busy, idle });
        let total = add_span(Some(HostCpu::default()), at(100, 50), at(130, 60));
        let total = add_span(total, at(200, 90), at(210, 130));
        assert_eq!(total, at(40, 50));
        assert_eq!(add_span(total, None, at(1, 1)), None);
        assert_eq!(add_span(total, at(5, 5), at(4, 6)), None, "a counter that went back");
    }
}
