//! `fanout`: one execution streams P progress events to W watchers. The
//! harness waits behind a barrier until every watcher is subscribed, so
//! each event is delivered live (or, for a watcher that fell behind and was
//! ended with RESOURCE_EXHAUSTED, replayed after it resumed).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::target::Channel;
use anyhow::Context as _;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::client::{code_name, request};
use super::emitter::{release, Emitter};
use super::stats::{median, Histogram};
use super::target::Target;
use super::{BenchArgs, Daemons};
use crate::pb;
use crate::pb::execution_service_client::ExecutionServiceClient;

/// Watchers per HTTP/2 connection.
const WATCHERS_PER_CONNECTION: usize = 50;
/// How often the daemon's RSS is sampled during a level (for the RSS
/// limit, and for the peak where the kernel's cannot be reset).
const RSS_EVERY: Duration = Duration::from_millis(50);

/// One fanout level: what W watchers of one execution received, how fast,
/// and what the daemon's memory did.
#[derive(Clone, Debug, Serialize)]
pub struct FanoutLevel {
    /// Watchers subscribed to the execution.
    pub watchers: usize,
    /// Progress events the harness emits.
    pub events: u64,
    /// The execution the watchers follow.
    pub execution_id: String,
    /// Its state at the end (`SUCCEEDED`, ...), or the status code if it could
    /// not be read.
    pub execution_state: String,
    /// Watchers that received every progress event and `finished`.
    pub complete_watchers: usize,
    /// Progress events received, summed over the watchers.
    pub delivered: u64,
    /// From the barrier's release to the last watcher's `finished`.
    pub seconds: f64,
    /// Progress events delivered per second, over every watcher.
    pub aggregate_per_second: f64,
    /// The median watcher's progress events per second.
    pub per_watcher_per_second_median: f64,
    /// The slowest watcher's progress events per second.
    pub per_watcher_per_second_min: f64,
    /// Event `time` (stamped by the daemon as it stores the event, 1 ms
    /// resolution) to receipt by a watcher, over every delivery.
    pub delay_p50_ms: f64,
    /// The 99th percentile of the same delay, in ms.
    pub delay_p99_ms: f64,
    /// The largest such delay, in ms.
    pub delay_max_ms: f64,
    /// Times a watcher was ended with RESOURCE_EXHAUSTED and resumed.
    pub resumes: u64,
    /// Watchers that ended with an error, by status code.
    pub errors: BTreeMap<String, usize>,
    /// One message for each status code in `errors`.
    pub error_messages: BTreeMap<String, String>,
    /// The daemon's RSS before any watcher subscribed, in KiB; `None` when it
    /// could not be read.
    pub rss_before_kib: Option<u64>,
    /// Every watcher subscribed, no event streamed yet.
    pub rss_attached_kib: Option<u64>,
    /// The highest RSS over the level, in KiB: the kernel's peak
    /// (`VmHWM`, reset as the level began), or, when that reset was
    /// refused, the highest sampled every 50 ms while events streamed,
    /// which can miss the peak (`rss_peak_sampled`).
    pub rss_peak_kib: Option<u64>,
    /// Whether `rss_peak_kib` was sampled rather than the kernel's.
    pub rss_peak_sampled: bool,
    /// After every watcher ended (allocators keep some of what was freed).
    pub rss_after_kib: Option<u64>,
    /// RSS growth per watcher once all were subscribed, in KiB.
    pub per_watcher_attached_kib: Option<f64>,
    /// RSS growth per watcher at the peak, in KiB.
    pub per_watcher_peak_kib: Option<f64>,
    /// CPU time (user + system) of the process the RSS figures are of, from
    /// the barrier's release to the last watcher's end, per progress event
    /// delivered, in microseconds: the daemon's alone against `--server`,
    /// the daemon's and its watchers' together in-process.
    pub cpu_us_per_delivery: Option<f64>,
    /// Whether the harness's barrier was released (false: it never started emitting).
    pub barrier_released: bool,
    /// Why the level stopped early, if it did.
    pub aborted: Option<String>,
}

/// What `corral bench fanout` measured, level by level.
#[derive(Clone, Debug, Serialize)]
pub struct FanoutReport {
    /// The harness profile run.
    pub profile: String,
    /// Which harness emitted the events.
    pub emitter: Emitter,
    /// What the RSS figures are the memory of.
    pub rss_of: String,
    /// Whether the daemon ran in the bench's own process.
    pub in_process: bool,
    /// Events per second the harness was paced at (`--pace`); none: as
    /// fast as it could.
    pub pace: Option<u64>,
    /// One entry per `--fanout` level, in order.
    pub levels: Vec<FanoutLevel>,
}

#[derive(Default)]
struct Shared {
    subscribed: AtomicUsize,
    /// Watchers whose stream is over (for whatever reason).
    ended: AtomicUsize,
    workspace: OnceLock<String>,
    delays: Histogram,
    stop: CancellationToken,
}

#[derive(Default)]
struct Watched {
    progress: u64,
    finished: Option<Instant>,
    resumes: u64,
    /// Status code and message.
    error: Option<(String, String)>,
}

pub fn rss_of(target: &Target) -> String {
    match (target.in_process_mode(), target.daemon_pid) {
        (true, _) => "the bench process: in-process daemon AND its W watcher clients (each decodes an event's sequence, time and kind, skipping the rest)".into(),
        (false, Some(pid)) => format!("the daemon process (pid {pid})"),
        (false, None) => "nothing: the daemon's pid was not found on this host".into(),
    }
}

/// Each level on a daemon of its own (see [`Daemons`]).
pub async fn run(daemons: &Daemons, args: &BenchArgs) -> anyhow::Result<FanoutReport> {
    let mut report = None;
    for spec in &args.watchers {
        let events = spec.events.unwrap_or(args.events);
        let name = format!("fanout-{}x{events}", spec.watchers);
        let (level, emitter, profile, rss_of, in_process) = daemons
            .with(&name, async |target| {
                let emitter = args.emitter(target);
                if args.pace.is_some() && emitter != Emitter::FakeAgent {
                    anyhow::bail!("--pace needs the fake-agent emitter");
                }
                let (profile, _) = emitter.task(events, args.pace);
                let profile = args.emitter_profile.clone().unwrap_or(profile);
                let level = level(target, args, emitter, &profile, spec.watchers.max(1), events).await?;
                Ok((level, emitter, profile, rss_of(target), target.in_process_mode()))
            })
            .await?;
        report
            .get_or_insert_with(|| FanoutReport {
                profile,
                emitter,
                rss_of,
                in_process,
                pace: args.pace,
                levels: Vec::new(),
            })
            .levels
            .push(level);
    }
    report.ok_or_else(|| anyhow::anyhow!("no fanout level given (--watchers)"))
}

async fn level(
    target: &Target,
    args: &BenchArgs,
    emitter: Emitter,
    profile: &str,
    watchers: usize,
    events: u64,
) -> anyhow::Result<FanoutLevel> {
    let (_, description) = emitter.task(events, args.pace);
    let control = target.connect().await?;
    // The kernel keeps the peak from here on (`VmHWM`): a spike between
    // two samples is not missed.
    let peak_reset = target.daemon_pid.is_some_and(super::system::reset_peak_rss);
    let rss_before = target.daemon_rss_kib();
    let mut channels = Vec::new();
    for _ in 0..watchers.div_ceil(WATCHERS_PER_CONNECTION) {
        channels.push(target.connect().await?);
    }
    let mut executions = ExecutionServiceClient::new(control.clone());
    let started = executions
        .start_execution(request(profile, "corral bench fanout", &description))
        .await
        .with_context(|| format!("StartExecution of {profile}"))?
        .into_inner();
    let id = started.execution_id.clone();

    let shared = Arc::new(Shared::default());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..watchers {
        let (channel, shared, id) = (channels[i / WATCHERS_PER_CONNECTION].clone(), shared.clone(), id.clone());
        tasks.spawn(watch(channel, id, shared));
    }

    let mut aborted = None;
    let ready_by = Instant::now() + Duration::from_secs(120);
    while shared.subscribed.load(Ordering::SeqCst) < watchers || shared.workspace.get().is_none() {
        let ended = shared.ended.load(Ordering::SeqCst);
        if ended > 0 || Instant::now() > ready_by {
            aborted = Some(format!(
                "{} of {watchers} watchers subscribed and {ended} ended before the harness could start",
                shared.subscribed.load(Ordering::SeqCst)
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rss_attached = target.daemon_rss_kib();
    let cpu_released = target.daemon_pid.and_then(super::system::process_cpu_ticks);
    let barrier_released = shared.workspace.get().map(|ws| release(ws).is_ok()).unwrap_or(false);
    let released = Instant::now();
    if aborted.is_some() {
        shared.stop.cancel();
    }

    let mut rss_peak = rss_attached;
    let limit_kib = args.rss_limit_mib * 1024;
    let deadline = released + Duration::from_secs(args.level_timeout);
    let mut outcomes = Vec::with_capacity(watchers);
    let mut panicked = 0;
    let mut tick = tokio::time::interval(RSS_EVERY);
    while !tasks.is_empty() {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                Some(Ok(w)) => outcomes.push(w),
                Some(Err(_)) => panicked += 1,
                None => break,
            },
            _ = tick.tick() => {
                let rss = target.daemon_rss_kib();
                rss_peak = rss_peak.max(rss);
                if aborted.is_none() {
                    if let Some(rss) = rss.filter(|&r| r > limit_kib) {
                        aborted = Some(format!("RSS {} MiB passed --rss-limit-mib {}", rss / 1024, args.rss_limit_mib));
                        shared.stop.cancel();
                    } else if Instant::now() > deadline {
                        aborted = Some(format!("not done within --level-timeout {} s", args.level_timeout));
                        shared.stop.cancel();
                    }
                }
            }
        }
    }
    let cpu_ended = target.daemon_pid.and_then(super::system::process_cpu_ticks);
    let kernel_peak = target.daemon_pid.filter(|_| peak_reset).and_then(super::system::peak_rss_kib);
    let rss_peak_sampled = kernel_peak.is_none();
    let rss_peak = kernel_peak.map_or(rss_peak, |k| Some(rss_peak.map_or(k, |s| s.max(k))));
    let last_finished = outcomes.iter().filter_map(|w| w.finished).max();
    if aborted.is_some() {
        let _ = executions.cancel_execution(pb::CancelExecutionRequest { execution_id: id.clone() }).await;
    }
    let execution_state = final_state(&control, &id).await;
    drop(channels);
    // Give the daemon a moment to drop the ended streams' tasks.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_after = target.daemon_rss_kib();

    let seconds = last_finished.map(|t| t.saturating_duration_since(released).as_secs_f64()).unwrap_or(0.0);
    let rates: Vec<f64> = outcomes
        .iter()
        .filter_map(|w| {
            w.finished.map(|t| w.progress as f64 / t.saturating_duration_since(released).as_secs_f64().max(1e-9))
        })
        .collect();
    let delivered: u64 = outcomes.iter().map(|w| w.progress).sum();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    let mut error_messages: BTreeMap<String, String> = BTreeMap::new();
    for (code, message) in outcomes.iter().filter_map(|w| w.error.clone()) {
        error_messages.entry(code.clone()).or_insert(message);
        *errors.entry(code).or_default() += 1;
    }
    if panicked > 0 {
        errors.insert("BENCH_WATCHER_PANICKED".into(), panicked);
    }
    let per_watcher = |rss: Option<u64>| match (rss, rss_before) {
        // Less than before (the allocator gave memory back): not a cost.
        (Some(after), Some(before)) if after >= before => Some((after - before) as f64 / watchers as f64),
        _ => None,
    };
    let ms = |us: u64| us as f64 / 1e3;
    Ok(FanoutLevel {
        watchers,
        events,
        execution_id: id,
        execution_state,
        complete_watchers: outcomes.iter().filter(|w| w.finished.is_some() && w.progress == events).count(),
        delivered,
        seconds,
        aggregate_per_second: if seconds > 0.0 { delivered as f64 / seconds } else { 0.0 },
        per_watcher_per_second_median: if rates.is_empty() { 0.0 } else { median(&rates) },
        per_watcher_per_second_min: rates.iter().copied().reduce(f64::min).unwrap_or(0.0),
        delay_p50_ms: ms(shared.delays.quantile(0.50)),
        delay_p99_ms: ms(shared.delays.quantile(0.99)),
        delay_max_ms: ms(shared.delays.quantile(1.0)),
        resumes: outcomes.iter().map(|w| w.resumes).sum(),
        errors,
        error_messages,
        rss_before_kib: rss_before,
        rss_attached_kib: rss_attached,
        rss_peak_kib: rss_peak,
        rss_peak_sampled,
        rss_after_kib: rss_after,
        per_watcher_attached_kib: per_watcher(rss_attached),
        per_watcher_peak_kib: per_watcher(rss_peak),
        cpu_us_per_delivery: match (cpu_released, cpu_ended) {
            (Some(from), Some(to)) if delivered > 0 && to >= from => {
                Some(((to - from) as f64 * super::system::tick_ms() * 1e3) / delivered as f64)
            }
            _ => None,
        },
        barrier_released,
        aborted,
    })
}

/// One watcher: follows the execution to `finished`, resuming after its
/// last sequence whenever the daemon ends it for falling behind.
async fn watch(channel: Channel, execution_id: String, shared: Arc<Shared>) -> Watched {
    let mut client = tonic::client::Grpc::new(channel);
    let mut out = Watched::default();
    let mut after = 0;
    let mut seen = false;
    // Made once: a fresh `cancelled()` per message would register and drop
    // a waiter on the shared token for every delivery to every watcher,
    // the bench's own cost on the cores the daemon is measured on.
    let stopped = shared.stop.cancelled();
    tokio::pin!(stopped);
    'streams: loop {
        let req = pb::WatchRequest { execution_id: execution_id.clone(), after_sequence: after };
        let reply = tokio::select! {
            reply = watch_call(&mut client, req) => reply,
            _ = &mut stopped => break,
        };
        let mut stream = match reply {
            Ok(reply) => reply.into_inner(),
            Err(status) => {
                out.error = Some((code_name(status.code()), status.message().chars().take(200).collect()));
                break;
            }
        };
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                _ = &mut stopped => break 'streams,
            };
            match message {
                Ok(Some(event)) => {
                    if !seen {
                        seen = true;
                        shared.subscribed.fetch_add(1, Ordering::SeqCst);
                    }
                    after = event.sequence;
                    match event.kind {
                        Some(Seen::Progress(p)) if p.kind == pb::ProgressKind::Progress as i32 => {
                            out.progress += 1;
                            if let Some(time) = event.time {
                                shared.delays.record(delay_us(&time));
                            }
                        }
                        Some(Seen::SandboxReady(ready)) => {
                            let _ = shared.workspace.set(ready.workspace_path);
                        }
                        Some(Seen::Finished(_)) => out.finished = Some(Instant::now()),
                        _ => {}
                    }
                }
                Ok(None) => break 'streams,
                Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                    out.resumes += 1;
                    continue 'streams;
                }
                Err(status) => {
                    out.error = Some((code_name(status.code()), status.message().chars().take(200).collect()));
                    break 'streams;
                }
            }
        }
    }
    shared.ended.fetch_add(1, Ordering::SeqCst);
    out
}

/// `WatchExecution` as the generated client calls it, each event decoded
/// as a [`WatchedEvent`]: only the fields a watcher reads.
async fn watch_call(
    client: &mut tonic::client::Grpc<Channel>,
    request: pb::WatchRequest,
) -> Result<tonic::Response<tonic::codec::Streaming<WatchedEvent>>, tonic::Status> {
    client.ready().await.map_err(|e| tonic::Status::unknown(format!("service was not ready: {e}")))?;
    let path = http::uri::PathAndQuery::from_static("/corral.v1.ExecutionService/WatchExecution");
    client.server_streaming(tonic::Request::new(request), path, tonic_prost::ProstCodec::default()).await
}

/// A `LifecycleEvent` as a fanout watcher decodes it: its sequence, its
/// time and which of three kinds it is; every other field is skipped
/// unread. The W watchers run on the cores the daemon is measured on
/// (in-process, or beside `--server`), and decoding each event in full
/// (its subject id, tool and receipt as owned strings) was a seventh of
/// the bench process's CPU at W = 10,000, work a real watcher does on
/// its own machine. Every byte still crosses HTTP/2 and gRPC's framing
/// and is parsed as the message it is; `watched_events_read_as_the_full_message`
/// tests that the two decodings agree.
#[derive(Clone, PartialEq, prost::Message)]
struct WatchedEvent {
    #[prost(uint64, tag = "2")]
    sequence: u64,
    #[prost(message, optional, tag = "3")]
    time: Option<prost_types::Timestamp>,
    #[prost(oneof = "Seen", tags = "13, 15, 18")]
    kind: Option<Seen>,
}

/// The kinds of event a fanout watcher acts on.
#[derive(Clone, PartialEq, prost::Oneof)]
enum Seen {
    #[prost(message, tag = "13")]
    SandboxReady(SeenReady),
    #[prost(message, tag = "15")]
    Progress(SeenProgress),
    #[prost(message, tag = "18")]
    Finished(SeenFinished),
}

/// `SandboxReady`: where the harness's barrier is.
#[derive(Clone, PartialEq, prost::Message)]
struct SeenReady {
    #[prost(string, tag = "3")]
    workspace_path: String,
}

/// `Progress`: which kind.
#[derive(Clone, PartialEq, prost::Message)]
struct SeenProgress {
    #[prost(int32, tag = "5")]
    kind: i32,
}

/// `Finished`: that it came.
#[derive(Clone, PartialEq, prost::Message)]
struct SeenFinished {}

/// Microseconds from an event's `time` to now (0 if the clock says the
/// event is from the future).
pub fn delay_us(time: &prost_types::Timestamp) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let stamped = Duration::new(time.seconds.max(0) as u64, time.nanos.max(0) as u32);
    now.saturating_sub(stamped).as_micros() as u64
}

/// The execution's state once it is no longer running (up to 60 s).
pub async fn final_state(channel: &Channel, execution_id: &str) -> String {
    let mut client = ExecutionServiceClient::new(channel.clone());
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let req = pb::GetExecutionRequest { execution_id: execution_id.to_string(), ..Default::default() };
        let state = match client.get_execution(req).await {
            Ok(reply) => reply.into_inner().state,
            Err(status) => return code_name(status.code()),
        };
        let terminal = ![pb::ExecutionState::Pending as i32, pb::ExecutionState::Running as i32].contains(&state);
        if terminal || Instant::now() > until {
            return pb::ExecutionState::try_from(state)
                .map(|s| s.as_str_name().trim_start_matches("EXECUTION_STATE_").to_string())
                .unwrap_or_default();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    /// Every test event's `time`.
    fn stamp() -> Option<prost_types::Timestamp> {
        Some(prost_types::Timestamp { seconds: 1_780_000_000, nanos: 123_000_000 })
    }

    fn event(sequence: u64, kind: pb::lifecycle_event::Kind) -> pb::LifecycleEvent {
        pb::LifecycleEvent {
            subject_id: "0190c0de-0000-7000-8000-000000000001".into(),
            sequence,
            time: stamp(),
            kind: Some(kind),
        }
    }

    fn watched(event: &pb::LifecycleEvent) -> WatchedEvent {
        WatchedEvent::decode(&event.encode_to_vec()[..]).expect("a LifecycleEvent decodes as a WatchedEvent")
    }

    #[test]
    fn watched_events_read_as_the_full_message() {
        use pb::lifecycle_event::Kind;
        let time = stamp();
        let progress = event(
            7,
            Kind::Progress(pb::Progress {
                kind: pb::ProgressKind::Progress as i32,
                tool: "Bash".into(),
                tokens_so_far: 4_096,
                message: "step 7".into(),
            }),
        );
        assert_eq!(
            watched(&progress),
            WatchedEvent {
                sequence: 7,
                time,
                kind: Some(Seen::Progress(SeenProgress { kind: pb::ProgressKind::Progress as i32 }))
            }
        );
        let ready = event(
            4,
            Kind::SandboxReady(Box::new(pb::SandboxReady {
                sandbox_id: "sb-1".into(),
                workspace_path: "/var/lib/corral/ws/1".into(),
                receipt: Some(Default::default()),
                ..Default::default()
            })),
        );
        assert_eq!(
            watched(&ready).kind,
            Some(Seen::SandboxReady(SeenReady { workspace_path: "/var/lib/corral/ws/1".into() }))
        );
        let finished = event(
            9,
            Kind::Finished(Box::new(pb::Finished {
                record: Some(pb::finished::Record::Execution(Default::default())),
            })),
        );
        assert_eq!(watched(&finished).kind, Some(Seen::Finished(SeenFinished {})));
        // A kind no watcher acts on is skipped whole; its place is still read.
        let accepted = event(1, Kind::Accepted(Default::default()));
        assert_eq!(watched(&accepted), WatchedEvent { sequence: 1, time, kind: None });
    }
}
