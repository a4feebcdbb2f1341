//! `corral`: the daemon (`corral serve`) and its client commands.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use corral::cli::{ClientCommand, ClientOpts};
use corral::config::{Config, Overrides};
use corral::daemon::{default_reins, Daemon};
use corral::sandbox::Backends;

#[derive(Parser, Debug)]
#[command(
    name = "corral",
    version,
    about = "Runs AI coding-agent harnesses in sandboxes it owns, under a policy gate."
)]
struct Cli {
    #[command(flatten)]
    client: ClientOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon.
    Serve(ServeArgs),
    /// Report what this host can enforce (bwrap, seccomp, uids, cgroups)
    /// and which profiles the daemon's gate would refuse here; exit 1 if
    /// linux_bwrap cannot run or the config's uid range, admin policies,
    /// catalog, warm pools, descriptor limit, principals or TLS files would
    /// stop the daemon (not its data directory, which it may create).
    Doctor(DoctorArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff) on stdout: corral(1), or a subcommand's
    /// own page (`corral man exec` is corral-exec(1)).
    Man {
        /// A subcommand (`session turn` for a nested one).
        page: Vec<String>,
    },
    #[command(flatten)]
    Client(ClientCommand),
}

impl Command {
    /// Why `--json` (global, for the client commands) is refused with this
    /// command: it has no JSON output, and accepting the flag to ignore it
    /// would hand a script text it cannot parse.
    fn json_refused(&self) -> Option<&'static str> {
        match self {
            Command::Serve(_) => Some("`corral serve` prints no JSON; its log lines are JSON with --log-format json"),
            Command::Completions { .. } => Some("`corral completions` prints a shell script, not JSON"),
            Command::Man { .. } => Some("`corral man` prints a man page (roff), not JSON"),
            Command::Doctor(_) | Command::Client(_) => None,
        }
    }
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// A TOML config file (layered: defaults, file, CORRAL_* env, flags).
    #[arg(long, env = "CORRAL_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50051].
    #[arg(long)]
    listen: Option<String>,
    /// Data directory for the store and the workspaces [default: /var/lib/corral as root, else $XDG_DATA_HOME/corral or ~/.local/share/corral].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// A directory of profile TOML files (repeatable).
    #[arg(long = "profiles")]
    profiles: Vec<PathBuf>,
    /// Log lines as text (coloured only on a terminal) or as JSON objects.
    #[arg(long, value_enum, default_value = "text", env = "CORRAL_LOG_FORMAT")]
    log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args, Debug)]
struct DoctorArgs {
    /// The daemon's TOML config file (its [sandbox] section and profiles).
    #[arg(long, env = "CORRAL_CONFIG")]
    config: Option<PathBuf>,
    /// A directory of profile TOML files (repeatable).
    #[arg(long = "profiles")]
    profiles: Vec<PathBuf>,
}

/// What each command that does not talk to a daemon ignores of the global
/// client options (and `--json`, where it is refused): hidden from its
/// help and man page, left out of its completions.
const IGNORED_OPTIONS: [(&str, &[&str]); 4] = [
    ("serve", &["server", "token_file", "ca", "cert", "key", "json"]),
    ("doctor", &["server", "token_file", "ca", "cert", "key"]),
    ("completions", &["server", "token_file", "ca", "cert", "key", "json"]),
    ("man", &["server", "token_file", "ca", "cert", "key", "json"]),
];

/// The command line for shell completions: as [`command`], but with the
/// ignored options left out of the commands that ignore them, not hidden
/// (clap_complete's bash script offers hidden options). The client
/// options are global to every other command and its subcommands, and
/// offered at the top, where they may also be given.
fn completion_command() -> clap::Command {
    let command = <Cli as clap::CommandFactory>::command();
    let globals: Vec<clap::Arg> = command.get_arguments().filter(|arg| arg.is_global_set()).cloned().collect();
    let command = globals.iter().fold(command, |command, arg| command.mut_arg(arg.get_id(), |a| a.global(false)));
    let names: Vec<String> = command.get_subcommands().map(|sub| sub.get_name().to_string()).collect();
    names.iter().fold(command, |command, name| {
        let ignored = IGNORED_OPTIONS.iter().find(|(n, _)| n == name).map_or(&[][..], |(_, options)| *options);
        let kept = globals.iter().filter(|arg| !ignored.contains(&arg.get_id().as_str())).cloned();
        command.mut_subcommand(name, |sub| sub.args(kept))
    })
}

/// The command line, for parsing, help and man pages.
fn command() -> clap::Command {
    let command = <Cli as clap::CommandFactory>::command();
    let globals: Vec<clap::Arg> = command.get_arguments().filter(|arg| arg.is_global_set()).cloned().collect();
    IGNORED_OPTIONS.iter().fold(command, |command, (name, options)| {
        // A hidden copy on the subcommand takes the global option's place
        // there: clap copies a global option only into subcommands that
        // lack it.
        command.mut_subcommand(name, |sub| {
            let hidden = globals.iter().filter(|arg| options.contains(&arg.get_id().as_str()));
            sub.args(hidden.map(|arg| arg.clone().hide(true)))
        })
    })
}

/// `corral serve …` on its own, so that its help lists the daemon's flags
/// only (the client options are global to every other command).
#[derive(Parser, Debug)]
#[command(name = "corral serve", version, about = "Run the daemon.")]
struct ServeOnly {
    #[command(flatten)]
    args: ServeArgs,
}

fn main() -> anyhow::Result<()> {
    // Bound into a sandbox under this name, the binary is the agent's hook
    // helper and nothing else (see `gate::helper`).
    let argv0 = std::env::args_os().next().map(std::path::PathBuf::from);
    if argv0.as_deref().and_then(|p| p.file_name()).is_some_and(|n| n == corral::gate::HELPER_NAME) {
        std::process::exit(corral::gate::helper::run());
    }
    let serve_only = std::env::args_os().nth(1).is_some_and(|a| a == "serve");
    let cli = if serve_only {
        let rest = std::env::args_os().skip(2);
        let args = std::iter::once(std::ffi::OsString::from("corral serve")).chain(rest);
        Cli { client: ClientOpts::default(), command: Command::Serve(ServeOnly::parse_from(args).args) }
    } else {
        let mut matches = command().get_matches();
        <Cli as clap::FromArgMatches>::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.exit())
    };
    // One multi-threaded runtime. (bwrap's --die-with-parent is tied to the
    // thread that spawned it: every sandbox is spawned by one thread that
    // lives as long as the daemon, see `sandbox::process`.)
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = runtime.block_on(async move {
        if let Some(refused) = cli.command.json_refused().filter(|_| cli.client.json) {
            eprintln!("error: --json: {refused}");
            return Ok(2);
        }
        match cli.command {
            Command::Serve(args) => serve(args).await.map(|()| 0),
            Command::Completions { shell } => {
                // Written here, not by `generate`, which panics when the
                // reader has gone away (`| head`).
                let mut script = Vec::new();
                clap_complete::generate(shell, &mut completion_command(), "corral", &mut script);
                std::io::Write::write_all(&mut std::io::stdout(), &script)?;
                Ok(0)
            }
            Command::Man { page } => {
                let mut command = command();
                command.build();
                let mut name = "corral".to_string();
                for word in &page {
                    let Some(sub) = command.find_subcommand(word).cloned() else {
                        eprintln!("error: no subcommand {word:?} of {name}");
                        return Ok(2);
                    };
                    name = format!("{name}-{word}");
                    command = sub;
                }
                let name: &'static str = Box::leak(name.into_boxed_str());
                let command = command.name(name).bin_name(name.replace('-', " "));
                clap_mangen::Man::new(command).render(&mut std::io::stdout())?;
                Ok(0)
            }
            Command::Doctor(args) => {
                let overrides = Overrides { profile_dirs: args.profiles, ..Overrides::default() };
                let config = Config::load(args.config.as_deref(), overrides)?;
                corral::cli::doctor::run(&config, cli.client.json).await
            }
            Command::Client(cmd) => corral::cli::run(cli.client, cmd).await,
        }
    });
    let code = match code {
        Ok(code) => code,
        // The reader went away (`corral man | head`): how a pipe ends.
        Err(e) if corral::cli::is_broken_pipe(&e) => 0,
        // As returning the error would print it, without dropping the
        // runtime: a fenced daemon must not wait there for store calls a
        // partition stalls.
        Err(e) => {
            eprintln!("Error: {e:?}");
            1
        }
    };
    std::process::exit(code);
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let overrides =
        Overrides { listen: args.listen.clone(), data_dir: args.data_dir.clone(), profile_dirs: args.profiles.clone() };
    let config = Config::load(args.config.as_deref(), overrides.clone())?;
    // Before anything slow (recovery): a SIGHUP during start must not end
    // the daemon, whose default action it is.
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let filter = corral::telemetry::daemon_filter();
    // Spans (an execution's id) go into every line of either format.
    let logs = match args.log_format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            // One flat object a line: `trace_id` and `span_id`, then the
            // event's fields beside `level`, `target` and `timestamp`, the
            // current span's under `span` with the run's id from the spans
            // around it (`WithTraceIds` writes it).
            .event_format(corral::telemetry::WithTraceIds(
                tracing_subscriber::fmt::format()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(false),
            ))
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .boxed(),
    };
    // Without a collector, spans still get trace ids (for the log lines)
    // and go nowhere.
    let provider = match &config.telemetry.otlp_endpoint {
        Some(endpoint) => corral::telemetry::otlp_tracer_provider(endpoint, &config.telemetry.service_name)
            .map_err(anyhow::Error::msg)?,
        None => corral::telemetry::local_tracer_provider(),
    };
    let traces = corral::telemetry::traces_layer(&provider);
    tracing_subscriber::registry().with(filter).with(logs).with(traces).init();
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let local = listener.local_addr()?;
    // Under systemd's Delegate=yes: out of the unit's own cgroup first, so
    // the sandboxes' parent beside it can have controllers.
    corral::delegate::enter_leaf_if_delegated(&config.sandbox.cgroup_mount, &config.sandbox.cgroup_parent);
    let backends = Backends::for_host(&config.sandbox);
    let daemon = Daemon::build(config, backends, default_reins()).await?;
    tracing::info!(listen = %local, data_dir = %daemon.config.data_dir.display(), "corral serving");
    let socket = daemon.config.unix_socket_path();
    if let Some(stale) = &socket {
        use std::os::unix::fs::FileTypeExt;
        // A socket left by an earlier run would look ready too soon.
        if std::fs::symlink_metadata(stale).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(stale);
        }
    }

    reload_principals_on_hup(hup, daemon.authenticator.clone(), args.config.clone(), overrides);
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        // systemd (Type=notify): the stop has begun; draining may take the grace period.
        notify(sd_notify::NotifyState::Stopping);
        signal.cancel();
    });
    let mut serving = tokio::spawn(daemon.serve(listener, shutdown));
    // Ready once every listener accepts. `serve` checks the rest of the
    // config first (TLS files, the socket's group, the metrics token) and
    // binds the metrics listener and the unix socket before it accepts on
    // TCP: a serve that ends before that did not start, and its error is
    // the start error; neither the ready line nor READY=1 is sent.
    let started = tokio::select! {
        served = &mut serving => Some(served),
        () = listeners_accept(local, socket.as_deref()) => None,
    };
    if let Some(served) = started {
        if let Err(e) = provider.shutdown() {
            tracing::warn!(error = %e, "traces not flushed");
        }
        served??;
        // Stopped (SIGTERM) before it was ready.
        return Ok(());
    }
    // The readiness line on stdout, in the log's format, so scripts can
    // find the port of :0.
    match args.log_format {
        LogFormat::Json => {
            println!("{}", serde_json::json!({"message": "corral listening", "listen": local.to_string()}))
        }
        LogFormat::Text => println!("corral listening on {local}"),
    }
    // systemd (Type=notify): every listener accepts now.
    notify(sd_notify::NotifyState::Ready);
    let served = (&mut serving).await;
    // Flush the spans still batched.
    if let Err(e) = provider.shutdown() {
        tracing::warn!(error = %e, "traces not flushed");
    }
    served??;
    Ok(())
}

/// Returns once the gRPC server accepts: its unix socket (if it has one)
/// exists and its TCP listener answers (see [`answers`]).
async fn listeners_accept(tcp: std::net::SocketAddr, socket: Option<&std::path::Path>) {
    let mut target = tcp;
    // Listening on every address: reached on the loopback one.
    if target.ip().is_unspecified() {
        target.set_ip(match target {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    loop {
        if socket.is_none_or(|s| s.exists()) && answers(target).await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Whether the server behind `addr` accepts connections, not only the
/// kernel's backlog (which takes them as soon as the socket listens). It
/// is sent HTTP/2's client preface: a plaintext server answers with its
/// SETTINGS, a TLS one with an alert; either is a byte back.
async fn answers(addr: std::net::SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The preface, then an empty SETTINGS frame.
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(PREFACE).await.ok()?;
        let mut byte = [0u8; 1];
        (stream.read(&mut byte).await.ok()? > 0).then_some(())
    };
    matches!(tokio::time::timeout(std::time::Duration::from_secs(1), probe).await, Ok(Some(())))
}

/// On SIGHUP, reads the config again and replaces the principals (its
/// `principals` and `principals_dir`; nothing else is re-applied). A reload
/// that fails keeps the set in force and logs why.
fn reload_principals_on_hup(
    hup: Option<tokio::signal::unix::Signal>,
    principals: std::sync::Arc<corral::auth::Principals>,
    file: Option<std::path::PathBuf>,
    overrides: Overrides,
) {
    let Some(mut hup) = hup else {
        tracing::warn!("no SIGHUP handler: principals are read only at start");
        return;
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            let reloaded = Config::load(file.as_deref(), overrides.clone())
                .map_err(|e| e.to_string())
                .and_then(|config| corral::daemon::reload_principals(&principals, &config).map_err(|e| e.to_string()));
            match reloaded {
                Ok(count) => tracing::info!(principals = count, "SIGHUP: principals reloaded"),
                Err(error) => {
                    tracing::error!(%error, "SIGHUP: principals not reloaded; the previous set stays in force")
                }
            }
        }
    });
}

/// Tells the service manager, when there is one (`NOTIFY_SOCKET`; sandboxes
/// never inherit it: their environment is built from an allowlist).
fn notify(state: sd_notify::NotifyState<'_>) {
    if let Err(error) = sd_notify::notify(&[state]) {
        tracing::warn!(%error, "cannot notify the service manager");
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without handlers the default action (exit) still applies.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}
