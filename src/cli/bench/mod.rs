//! `corral bench`: how much corral costs on top of the sandbox itself.
//!
//! Without an address (no `--server`, no `CORRAL_SERVER`) the bench starts
//! a daemon in this process with a fresh data directory and talks to it on
//! its unix socket;
//! with one, it measures that daemon, called with the client's token
//! (`CORRAL_TOKEN`, `--token-file`) and TLS material. Scenarios: `latency` (against the
//! floor: the exact bwrap command line corral runs, spawned directly),
//! `throughput`, `fanout`, `ingest`, `peer`; `gate` and `gateway` (their
//! parts always in-process, `--server` or not); `fleet` (two nodes of its
//! own on `--postgres`; not measured with `--server`); or `all`. The figures and the method are in
//! BENCHMARKS.md.

mod client;
mod emitter;
mod fanout;
pub mod fleet;
mod floor;
mod gate;
mod gateway;
mod ingest;
mod latency;
mod peer;
mod render;
mod stats;
mod system;
mod target;
mod throughput;

use std::path::PathBuf;

use serde::Serialize;

pub use emitter::Emitter;
pub use fanout::{FanoutLevel, FanoutReport};

pub use gate::GateReport;
pub use gateway::GatewayReport;
pub use ingest::{IngestParallel, IngestReport};
pub use latency::LatencyReport;
pub use peer::PeerReport;
pub use render::TargetCheck;
pub use stats::Percentiles;
pub use system::{HostInfo, LeakedProcesses};
pub use throughput::{Leaks, Level, ThroughputReport};

use target::Target;

/// What to measure.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// Sequential no-op Executes against direct spawns of the same bwrap command line.
    Latency,
    /// No-op executions per second at several concurrency levels; leaks after.
    Throughput,
    /// One execution's progress events streamed to many watchers.
    Fanout,
    /// Harness progress lines turned into stored events, per second.
    Ingest,
    /// The no-op through another sandbox wrapper (`srt`) when one is on PATH.
    Peer,
    /// One allowed tool call's hook round trip through the gate endpoint
    /// and the tool_call gate, against the endpoint answering at once.
    Gate,
    /// One model request through the credential gateway, against the same
    /// request through the egress proxy.
    Gateway,
    /// Two in-process nodes on one PostgreSQL (`--postgres`): a front end
    /// and a node with room; claim latency, cross-node event delay, and
    /// executions per second through the queue against the node alone.
    Fleet,
    /// Every scenario above, one after the other.
    All,
}

/// Arguments of `corral bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// latency: Executes (and floor spawns) [default: 200]; throughput:
    /// executions (and floor spawns) per round of a level [default: 10 ×
    /// concurrency, at least 50];
    /// peer: runs of each side [default: 20]; gate, gateway: round trips
    /// of each side [default: 500].
    #[arg(long)]
    pub n: Option<usize>,
    /// latency, throughput: also run the scenario against a fresh
    /// in-process daemon keeping this many warm sandboxes of the no-op
    /// profile (`[sandbox] warm`), against the same floor.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warm: usize,
    /// The corral binary beside which the in-process daemons find a warm
    /// sandbox's waiter (`gate.hook_program`); `None`: this process's own,
    /// when it is corral. Not a flag: for a bench run inside another program (tests).
    #[arg(skip)]
    pub corral_binary: Option<PathBuf>,
    /// latency: untimed runs of each side first (at least one Execute).
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// throughput: corral and the floor take turns this many times at
    /// each level (`--n` runs each, per turn); each side's rate is all its
    /// runs over all its time.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// throughput: concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub concurrency: Vec<usize>,
    /// fanout: one level per entry, one execution each: `W` watchers (of
    /// `--events` events), or `W:N` (W watchers of N events).
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000,10000:10000")]
    pub watchers: Vec<FanoutSpec>,
    /// fanout, ingest: progress events the harness emits.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// fanout: the harness emits this many events per second (fake-agent
    /// emitter only) instead of as fast as it can: the delay then measures
    /// delivery at that rate, not the queue a faster harness builds.
    #[arg(long, value_name = "EVENTS_PER_SECOND")]
    pub pace: Option<u64>,
    /// ingest: also this many harnesses emitting at once (0 or 1: not).
    #[arg(long, default_value_t = 4)]
    pub ingest_harnesses: usize,
    /// fanout, ingest: the emitting harness [default: fake-agent in-process,
    /// shell with --server].
    #[arg(long, value_enum)]
    pub emitter: Option<Emitter>,
    /// fanout, ingest: run the emitter under this profile instead.
    #[arg(long, value_name = "REF")]
    pub emitter_profile: Option<String>,
    /// The no-op profile (latency, throughput, peer).
    #[arg(long, value_name = "REF", default_value = "builtin.noop@1.0.0")]
    pub noop_profile: String,
    /// fanout: stop a level when the daemon's RSS passes this (MiB).
    #[arg(long, default_value_t = 4096)]
    pub rss_limit_mib: u64,
    /// fanout, ingest: stop a level after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub level_timeout: u64,
    /// Also write the JSON report to this file (the tables still print).
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// fleet: a PostgreSQL database the bench's two nodes share (it writes
    /// executions, events and two nodes' rows there) [env:
    /// CORRAL_BENCH_POSTGRES].
    #[arg(long, value_name = "URL", env = "CORRAL_BENCH_POSTGRES")]
    pub postgres: Option<String>,
    /// In-process daemon: keep its data here (default: a temporary
    /// directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// One fanout level: W watchers of an execution that emits N events
/// (`--events` when not given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FanoutSpec {
    /// Watchers subscribed to the execution.
    pub watchers: usize,
    /// Progress events the execution emits; `None` takes `--events`.
    pub events: Option<u64>,
}

impl std::str::FromStr for FanoutSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (w, n) = match s.split_once(':') {
            Some((w, n)) => (w, Some(n)),
            None => (s, None),
        };
        let watchers = w.trim().parse().map_err(|_| format!("{s:?}: expected W or W:N (watchers, events)"))?;
        let events = n.map(|n| n.trim().parse()).transpose().map_err(|_| format!("{s:?}: N must be a number"))?;
        if watchers == 0 || events == Some(0) {
            return Err(format!("{s:?}: watchers and events must be at least 1"));
        }
        Ok(FanoutSpec { watchers, events })
    }
}

impl BenchArgs {
    /// Parses `corral bench`'s arguments (without `bench`), defaults
    /// included: `BenchArgs::parse(&["latency", "--n", "3"])`.
    pub fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Bench {
            #[command(flatten)]
            args: BenchArgs,
        }
        use clap::Parser as _;
        Bench::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|b| b.args)
    }

    fn emitter(&self, target: &Target) -> Emitter {
        self.emitter.unwrap_or(if target.in_process_mode() { Emitter::FakeAgent } else { Emitter::Shell })
    }
}

/// Everything one `corral bench` run measured (`--json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Which scenario ran.
    pub scenario: Scenario,
    /// `in-process` or `server`.
    pub mode: String,
    /// The daemon's address.
    pub server: String,
    /// Whether the daemon runs on this host (in-process, a unix socket, a
    /// loopback address): only then are its ratios against the floor
    /// spawned here, and its clock the bench's, judged.
    pub daemon_on_this_host: bool,
    /// The machine the run was made on.
    pub host: HostInfo,
    /// The daemon's RSS when the bench started: idle for an in-process or
    /// a fresh daemon (in-process: the whole bench process).
    pub daemon_idle_rss_kib: Option<u64>,
    /// Whether the daemon had run no execution before this bench (its
    /// store lists none): only then is the RSS above an idle figure.
    pub daemon_fresh: bool,
    /// The `latency` scenario's figures, when it ran.
    pub latency: Option<LatencyReport>,
    /// The same against a daemon with a warm pool (`--warm`).
    pub latency_warm: Option<LatencyReport>,
    /// The `throughput` scenario's figures, when it ran.
    pub throughput: Option<ThroughputReport>,
    /// The same against a daemon with warm pools (`--warm`).
    pub throughput_warm: Option<ThroughputReport>,
    /// The `fanout` scenario's figures, when it ran.
    pub fanout: Option<FanoutReport>,
    /// The `ingest` scenario's figures, when it ran.
    pub ingest: Option<IngestReport>,
    /// The `peer` scenario's figures, when it ran.
    pub peer: Option<PeerReport>,
    /// The `gate` scenario's figures, when it ran.
    pub gate: Option<GateReport>,
    /// The `gateway` scenario's figures, when it ran.
    pub gateway: Option<GatewayReport>,
    /// The `fleet` scenario's figures, when it ran.
    pub fleet: Option<fleet::FleetReport>,
    /// Issues 6's, 16's and 27's targets, judged on what this run measured.
    pub targets: Vec<TargetCheck>,
    /// `/proc/loadavg` when the run ended.
    pub load_average_end: String,
}

/// Where each scenario's daemon comes from. With an address, that daemon,
/// every time (run one scenario per fresh `corral serve` to get figures
/// that do not depend on what ran before). Without one, a **fresh**
/// in-process daemon per scenario and per fanout level: a daemon keeps the
/// memory it grew and then forks more slowly, so no figure is taken on a
/// daemon another one grew, and each means the same alone and in `all`.
pub struct Daemons {
    server: Option<crate::cli::Remote>,
    data_dir: Option<PathBuf>,
    started: std::sync::atomic::AtomicUsize,
}

impl Daemons {
    /// Daemons at `server` when given, else fresh in-process ones keeping
    /// their data under `data_dir` (default: a temporary directory).
    pub fn new(server: Option<&crate::cli::Remote>, data_dir: Option<&std::path::Path>) -> Daemons {
        Daemons { server: server.cloned(), data_dir: data_dir.map(|d| d.to_path_buf()), started: Default::default() }
    }

    /// The daemon for the next scenario (or level) named `name`; an
    /// in-process one with `configure` applied to its config.
    async fn next(&self, name: &str, configure: impl FnOnce(&mut crate::config::Config)) -> anyhow::Result<Target> {
        match &self.server {
            Some(remote) => Target::server(remote).await,
            None => {
                let n = self.started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // With --data-dir each daemon gets a directory of its own in it.
                let dir = self.data_dir.as_ref().map(|d| d.join(format!("{n:02}-{name}")));
                Target::in_process_with(dir.as_deref(), configure).await
            }
        }
    }

    /// Runs `f` against the next daemon, then stops that daemon.
    async fn with<T>(&self, name: &str, f: impl AsyncFnOnce(&Target) -> anyhow::Result<T>) -> anyhow::Result<T> {
        self.with_config(name, |_| {}, f).await
    }

    /// [`with`](Self::with), the in-process daemon configured by `configure`.
    async fn with_config<T>(
        &self,
        name: &str,
        configure: impl FnOnce(&mut crate::config::Config),
        f: impl AsyncFnOnce(&Target) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let target = self.next(name, configure).await?;
        // Connected once first, so an in-process daemon is serving.
        let result = match target.connect().await {
            Ok(channel) => {
                drop(channel);
                f(&target).await
            }
            Err(e) => Err(e),
        };
        let stopped = target.stop().await;
        let value = result?;
        stopped?;
        Ok(value)
    }
}

/// Runs a scenario against the daemon at `server`, or against fresh ones
/// started in this process when `server` is `None` (see [`Daemons`]).
pub async fn run_scenario(args: &BenchArgs, server: Option<&crate::cli::Remote>) -> anyhow::Result<BenchReport> {
    if args.warm > 0 && server.is_some() {
        anyhow::bail!(
            "--warm starts an in-process daemon with a warm pool; against --server, configure [sandbox] warm on \
             that daemon and run the scenario without --warm"
        );
    }
    let daemons = Daemons::new(server, args.data_dir.as_deref());
    let mut report = daemons
        .with("idle", async |target| {
            Ok(BenchReport {
                scenario: args.scenario,
                mode: if target.in_process_mode() { "in-process" } else { "server" }.into(),
                server: target.url.clone(),
                daemon_on_this_host: target.on_this_host(),
                host: HostInfo::detect(),
                daemon_idle_rss_kib: target.daemon_rss_kib(),
                daemon_fresh: target.is_fresh().await,
                latency: None,
                latency_warm: None,
                throughput: None,
                throughput_warm: None,
                fanout: None,
                ingest: None,
                peer: None,
                gate: None,
                gateway: None,
                fleet: None,
                targets: Vec::new(),
                load_average_end: String::new(),
            })
        })
        .await?;
    let all = args.scenario == Scenario::All;
    // A daemon keeping `--warm` sandboxes of the no-op profile ready.
    let warm = |config: &mut crate::config::Config| {
        config.sandbox.warm.insert(args.noop_profile.clone(), args.warm);
        config.max_running_executions = config.max_running_executions.max(args.warm);
        if let Some(binary) = &args.corral_binary {
            config.gate.hook_program = Some(binary.clone());
        }
    };
    if all || args.scenario == Scenario::Latency {
        report.latency = Some(daemons.with("latency", async |t| latency::run(t, args, 0).await).await?);
        if args.warm > 0 {
            let run = async |t: &Target| latency::run(t, args, args.warm).await;
            report.latency_warm = Some(daemons.with_config("latency-warm", warm, run).await?);
        }
    }
    if all || args.scenario == Scenario::Peer {
        report.peer = Some(daemons.with("peer", async |t| peer::run(t, args).await).await?);
    }
    if all || args.scenario == Scenario::Throughput {
        report.throughput = Some(daemons.with("throughput", async |t| throughput::run(t, args, 0).await).await?);
        if args.warm > 0 {
            let run = async |t: &Target| throughput::run(t, args, args.warm).await;
            report.throughput_warm = Some(daemons.with_config("throughput-warm", warm, run).await?);
        }
    }
    if all || args.scenario == Scenario::Ingest {
        report.ingest = Some(daemons.with("ingest", async |t| ingest::run(t, args).await).await?);
    }
    if all || args.scenario == Scenario::Gate {
        report.gate = Some(gate::run(args).await?);
    }
    if all || args.scenario == Scenario::Gateway {
        report.gateway = Some(gateway::run(args).await?);
    }
    if all || args.scenario == Scenario::Fleet {
        report.fleet = Some(fleet::run(args, server).await?);
    }
    if all || args.scenario == Scenario::Fanout {
        report.fanout = Some(fanout::run(&daemons, args).await?);
    }
    report.targets = render::targets(&report);
    report.load_average_end = system::load_average();
    Ok(report)
}

/// `corral bench`: runs the scenario and prints the tables (or, with
/// `--json`, one JSON object). Exit code 0 once the run completed, whether
/// or not the targets were met.
pub async fn run(server: Option<&crate::cli::Remote>, args: BenchArgs, json: bool) -> anyhow::Result<i32> {
    crate::telemetry::install_bench_subscriber();
    let report = run_scenario(&args, server).await?;
    if let Some(path) = &args.save {
        use anyhow::Context as _;
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render::human(&report));
    }
    Ok(0)
}
