//! `throughput`: executions per second of the no-op profile at several
//! concurrency levels, what failed and how, and what was left behind; and
//! the floor's spawns per second at the same concurrency, the ceiling.

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
    /// Executions run at the level, succeeded or not.
    pub executions: usize,
    /// Executions that succeeded.
    pub succeeded: usize,
    /// Wall time of the level, in seconds.
    pub seconds: f64,
    /// Executions that succeeded, per second of the level.
    pub per_second: f64,
    /// Client-observed latency of the executions that succeeded.
    pub latency: Percentiles,
    /// The floor (the same bwrap command line spawned directly) at the
    /// same concurrency and count: spawns per second, the ceiling.
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
    /// Entries under `<data>/sandboxes` (in-process daemon only), not
    /// counting the warm pool's (`warm_pool` of them wait there, refilled,
    /// when the bench looks).
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
    let (floor, _) = latency::floor_for(target, &channels[0], &args.noop_profile).await?;
    let floor = Arc::new(floor);
    let sandboxes: Arc<Mutex<Vec<(String, PathBuf)>>> = Arc::default();
    let mut levels = Vec::new();
    for &concurrency in &args.concurrency {
        let count = args.n.unwrap_or((10 * concurrency).max(50));
        let before = HostCpu::now();
        let mut level = level(&channels, &args.noop_profile, concurrency, count, &sandboxes).await;
        let between = HostCpu::now();
        (level.floor_per_second, level.floor_errors) = floor_level(&floor, concurrency, count).await;
        let after = HostCpu::now();
        let used = |from: Option<HostCpu>, to: Option<HostCpu>, runs| from?.used_until(to?, runs, system::tick_ms());
        // A daemon elsewhere spends its CPU there: this host's is not its.
        level.cpu = used(before, between, level.executions).filter(|_| target.daemon_pid.is_some());
        level.floor_cpu = used(between, after, count);
        levels.push(level);
    }
    let sandboxes = std::mem::take(&mut *sandboxes.lock().unwrap_or_else(|e| e.into_inner()));
    let ids: HashSet<String> = sandboxes.iter().map(|(id, _)| id.clone()).collect();
    // The pool refills after the last run: wait for it (up to 10 s), so
    // that what is there beyond it is what leaked.
    if let Some(dir) = target.sandboxes_dir().filter(|_| warm_pool > 0) {
        for _ in 0..200 {
            if system::entries(&dir) >= warm_pool {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let leaks = Leaks {
        sandbox_dirs: sandboxes.iter().filter(|(_, root)| root.exists()).count(),
        data_sandboxes_entries: target.sandboxes_dir().map(|d| system::entries(&d).saturating_sub(warm_pool)),
        warm_pool,
        processes: system::leaked_processes(target.daemon_pid, &ids),
    };
    Ok(ThroughputReport { profile: args.noop_profile.clone(), levels, leaks })
}

pub(super) async fn level(
    channels: &[super::target::Channel],
    profile: &str,
    concurrency: usize,
    count: usize,
    sandboxes: &Arc<Mutex<Vec<(String, PathBuf)>>>,
) -> Level {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..concurrency.max(1) {
        let channel = channels[(worker / STREAMS_PER_CONNECTION) % channels.len()].clone();
        let (next, sandboxes, profile) = (next.clone(), sandboxes.clone(), profile.to_string());
        workers.spawn(async move {
            let mut latencies = Vec::new();
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
                        } else {
                            *errors.entry(e.state_name()).or_default() += 1;
                        }
                    }
                    Err(status) => *errors.entry(code_name(status.code())).or_default() += 1,
                }
            }
            (latencies, errors)
        });
    }
    let mut latencies = Vec::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok((l, e)) => {
                latencies.extend(l);
                for (k, v) in e {
                    *errors.entry(k).or_default() += v;
                }
            }
            Err(_) => *errors.entry("BENCH_WORKER_PANICKED".into()).or_default() += 1,
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let failed: usize = errors.values().sum();
    let executions = latencies.len() + failed;
    Level {
        concurrency,
        executions,
        succeeded: latencies.len(),
        seconds,
        per_second: if seconds > 0.0 { latencies.len() as f64 / seconds } else { 0.0 },
        latency: Percentiles::of_ms(&latencies),
        floor_per_second: 0.0,
        floor_errors: 0,
        cpu: None,
        floor_cpu: None,
        errors,
    }
}

/// `count` floor spawns by `concurrency` tasks: (successful spawns per
/// second, failed spawns).
async fn floor_level(floor: &Arc<Floor>, concurrency: usize, count: usize) -> (f64, usize) {
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
    let seconds = started.elapsed().as_secs_f64();
    (if seconds > 0.0 { ok as f64 / seconds } else { 0.0 }, failed)
}
