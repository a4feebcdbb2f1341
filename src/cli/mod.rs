//! The client side of the `corral` binary: `exec`, `watch`, `get`, `ls`,
//! `profiles` and `gate` talk to a running daemon over gRPC and print what
//! it answers, either as human lines or (`--json`) as canonical protobuf
//! JSON; `bench` measures a daemon (or one it starts in-process).
//!
//! Exit codes: 0 on success (for `exec`/`watch`: the execution finished in
//! state SUCCEEDED; for `gate`: the gate allows), 1 when the execution did
//! not succeed (or the gate does not allow), 2 when the call itself failed
//! (a file it names cannot be read, the daemon cannot be reached, or it
//! answers with a `Status`), 130 when the user interrupted a stream. A
//! reader that closes stdout early ends the output, not the command: the
//! exit code is still the outcome's.

pub mod bench;
pub mod doctor;
mod exec;
mod gate;
mod json;
mod output;
mod query;
mod record;
mod render;
mod session;
mod table;

use std::path::PathBuf;

use tonic::transport::Channel;
use tonic_types::StatusExt;

use crate::pb;
use output::Printer;

/// The daemon address when neither `--server` nor `CORRAL_SERVER` names
/// one: the unix socket in the default data directory (the zero-config
/// path on the daemon's host: the peer's uid is its credential).
pub fn default_server() -> String {
    format!("unix://{}", crate::config::default_data_dir().join("corral.sock").display())
}

/// Options shared by every client command.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClientOpts {
    /// Daemon address: `unix:///path/to/corral.sock` or `http://host:port`
    /// [default: the unix socket in the default data directory; `bench`
    /// starts a daemon in-process instead when no address is given].
    #[arg(long, env = "CORRAL_SERVER", global = true)]
    pub server: Option<String>,
    /// A file holding the bearer token to send (or the token itself in
    /// CORRAL_TOKEN).
    #[arg(long, env = "CORRAL_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// https: the CA that signed the daemon's certificate (PEM).
    #[arg(long, env = "CORRAL_CA", global = true)]
    pub ca: Option<PathBuf>,
    /// https: a client certificate (PEM) for mTLS, with --key.
    #[arg(long, env = "CORRAL_CERT", global = true, requires = "key")]
    pub cert: Option<PathBuf>,
    /// https: the client certificate's key (PEM).
    #[arg(long, env = "CORRAL_KEY", global = true, requires = "cert")]
    pub key: Option<PathBuf>,
    /// Machine output: one JSON object per line (canonical protobuf JSON;
    /// `bench`: its report, one object; `doctor`: one per check and
    /// profile). Refused by serve, completions and man.
    #[arg(long, global = true)]
    pub json: bool,
}

impl ClientOpts {
    /// Where to connect, and with which token.
    pub fn remote(&self) -> anyhow::Result<Remote> {
        use anyhow::Context as _;
        let token = match (&self.token_file, std::env::var("CORRAL_TOKEN").ok().filter(|t| !t.is_empty())) {
            (Some(path), _) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {} {}", given_by("token-file", path), path.display()))?
                    .trim()
                    .to_string(),
            ),
            (None, token) => token,
        };
        let read = |flag: &str, path: &Option<PathBuf>| -> anyhow::Result<Option<Vec<u8>>> {
            path.as_ref()
                .map(|p| std::fs::read(p).with_context(|| format!("cannot read {} {}", given_by(flag, p), p.display())))
                .transpose()
        };
        let tls =
            ClientTls { ca: read("ca", &self.ca)?, cert: read("cert", &self.cert)?, key: read("key", &self.key)? };
        Ok(Remote { url: self.server.clone().unwrap_or_else(default_server), token, tls })
    }
}

/// Where the path of a client option came from, for an error about it: its
/// variable (`--token-file`: `CORRAL_TOKEN_FILE`) when that holds the path
/// (clap reads it only without the flag; with both the same, either is
/// right), else the flag.
fn given_by(flag: &str, path: &std::path::Path) -> String {
    let variable = format!("CORRAL_{}", flag.replace('-', "_").to_ascii_uppercase());
    match std::env::var_os(&variable) {
        Some(value) if std::path::Path::new(&value) == path => variable,
        _ => format!("--{flag}"),
    }
}

/// TLS material for an `https://` daemon (PEM).
#[derive(Clone, Debug, Default)]
pub struct ClientTls {
    /// The CA that signed the daemon's certificate.
    pub ca: Option<Vec<u8>>,
    /// The client certificate, for a daemon that asks for one (mTLS).
    pub cert: Option<Vec<u8>>,
    /// The client certificate's private key.
    pub key: Option<Vec<u8>>,
}

/// A daemon to talk to.
#[derive(Clone, Debug)]
pub struct Remote {
    /// The daemon's address: `unix:///path`, `http://host:port` or `https://host:port`.
    pub url: String,
    /// The bearer token sent on every call; `None` sends none.
    pub token: Option<String>,
    /// The TLS material for an `https://` daemon.
    pub tls: ClientTls,
}

/// Sends the bearer token, if there is one, on every call.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// A connection with the caller's credentials.
pub type Conn = tonic::service::interceptor::InterceptedService<Channel, Bearer>;

impl Remote {
    /// Connects to the daemon, with the token (if any) on every call.
    pub async fn open(&self) -> anyhow::Result<Conn> {
        use anyhow::Context as _;
        let bearer = match &self.token {
            Some(token) => Some(format!("Bearer {token}").parse().context("the token is not valid header text")?),
            None => None,
        };
        Ok(tonic::service::interceptor::InterceptedService::new(
            connect_with(&self.url, &self.tls).await?,
            Bearer(bearer),
        ))
    }
}

/// The commands that talk to a running daemon.
#[derive(clap::Subcommand, Debug)]
pub enum ClientCommand {
    /// Run one task in a sandbox and follow it live; exit 0 only on success.
    Exec(ExecArgs),
    /// Follow an execution's events (stored ones first, then live ones).
    Watch(WatchArgs),
    /// Print one execution record.
    Get(GetArgs),
    /// Cancel an execution (idempotent: a finished one is printed as it is).
    Cancel {
        /// Execution id.
        id: String,
    },
    /// Sessions: create one, send it turns, follow it, end it.
    #[command(subcommand)]
    Session(SessionCommand),
    /// Allow a tool call waiting for approval (an approval_requested event).
    Approve(DecideArgs),
    /// Deny a tool call waiting for approval; the reason reaches the model.
    Deny(DecideArgs),
    /// List executions.
    Ls(LsArgs),
    /// List the harness profiles the daemon knows.
    Profiles(ProfilesArgs),
    /// Ask the daemon what its agent_start gate would decide for a run,
    /// and why, without running anything; exit 0 only when it allows.
    Gate(GateArgs),
    /// List the nodes of the fleet on the daemon's store (adm).
    Nodes,
    /// Ask a node to drain: it takes no new work and finishes what it
    /// runs; `corral nodes` shows it empty when 0 run (adm).
    Drain {
        /// The node's name, as `corral nodes` shows it.
        node: String,
    },
    /// This client's version, the daemon's, and what the daemon's host can
    /// enforce.
    Version,
    /// Measure corral against the bare sandbox: latency, throughput,
    /// fanout, ingest, peer (in-process daemon unless --server is given);
    /// gate and gateway (in-process); fleet (two nodes of its own on
    /// --postgres, not with --server).
    Bench(bench::BenchArgs),
}

/// Arguments of `corral exec`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("task_description")
    .required(true)
    .args(["description", "description_file"])))]
pub struct ExecArgs {
    /// Harness profile: `id@version`, or a bare `id` when only one version exists.
    #[arg(long)]
    pub profile: String,
    /// A local git repository for the workspace (relative paths are resolved
    /// against the current directory); without it the workspace starts empty.
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// Task title.
    #[arg(long)]
    pub title: String,
    /// Task description.
    #[arg(long)]
    pub description: Option<String>,
    /// Read the task description from a file (`-` for stdin).
    #[arg(long, value_name = "FILE")]
    pub description_file: Option<PathBuf>,
    /// Governed consumer type [default: the calling principal's type].
    #[arg(long, default_value = "", value_parser = ["", "adm", "agt", "atm"], hide_default_value = true)]
    pub actor: String,
    /// Project the execution is accounted to [default: the principal's only
    /// project, or `default` for one that sees all].
    #[arg(long, default_value = "", hide_default_value = true)]
    pub project: String,
    /// Idempotency key: repeating a request id returns the same execution.
    #[arg(long, value_name = "ID")]
    pub request_id: Option<String>,
    /// Caller's correlation id, recorded in the evidence.
    #[arg(long, value_name = "ID")]
    pub correlation_id: Option<String>,
    /// Caller's assignment reference, recorded in the evidence.
    #[arg(long, value_name = "REF")]
    pub assignment_ref: Option<String>,
    /// Report the evidence to the hub.
    #[arg(long)]
    pub report_to_hub: bool,
    /// Cancel the execution if this command is interrupted (by default it
    /// runs on in the daemon and can be watched again).
    #[arg(long)]
    pub cancel_on_interrupt: bool,
}

/// Arguments of `corral watch`.
#[derive(clap::Args, Debug)]
pub struct WatchArgs {
    /// Execution id.
    pub id: String,
    /// Replay only the events after this sequence number.
    #[arg(long, value_name = "SEQ", default_value_t = 0)]
    pub after: u64,
}

/// Arguments of `corral get`.
#[derive(clap::Args, Debug)]
pub struct GetArgs {
    /// Execution id.
    pub id: String,
    /// Add the raw tool output and error (for the execution's owner and adm).
    #[arg(long)]
    pub full: bool,
}

/// `corral session ...`.
#[derive(clap::Subcommand, Debug)]
pub enum SessionCommand {
    /// Start a session: its sandbox and harness, ready for turns.
    Create {
        /// Harness profile: `id@version`, or a bare `id`.
        #[arg(long)]
        profile: String,
        /// The session's id (default: the daemon picks one).
        #[arg(long)]
        id: Option<String>,
        /// A git repository to clone into the workspace.
        #[arg(long)]
        repo: Option<std::path::PathBuf>,
        /// Project the session is accounted to [default: the principal's only
        /// project, or `default` for one that sees all].
        #[arg(long)]
        project: Option<String>,
    },
    /// Send one turn and follow it to `turn_finished`; exit 0 when it succeeded.
    Turn {
        /// The session's id.
        id: String,
        /// The turn's prompt (Claude Code, Codex): `arguments_json = {"prompt": ...}`.
        #[arg(long)]
        prompt: Option<String>,
        /// The turn's tool (a protocol harness's).
        #[arg(long, default_value = "prompt")]
        tool: String,
        /// The turn's arguments as JSON.
        #[arg(long)]
        arguments: Option<String>,
    },
    /// Follow a session's events (stored ones first).
    Watch {
        /// The session's id.
        id: String,
        /// Replay only the events after this sequence number.
        #[arg(long, value_name = "SEQ", default_value_t = 0)]
        after: u64,
    },
    /// End a session: its harness and sandbox are torn down.
    End {
        /// The session's id.
        id: String,
    },
}

/// Arguments of `corral approve` and `corral deny`.
#[derive(clap::Args, Debug)]
pub struct DecideArgs {
    /// The execution or session the call belongs to.
    pub id: String,
    /// The call id from the approval_requested event (`call-<n>`).
    pub call: String,
    /// Why; with a deny, the model is told.
    #[arg(long, default_value = "")]
    pub reason: String,
}

/// Arguments of `corral ls`.
#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// Only executions in this state (e.g. `running`, `succeeded`, `failed`).
    #[arg(long, value_name = "S", value_parser = parse_state)]
    pub state: Option<pb::ExecutionState>,
    /// Only executions of this profile.
    #[arg(long, value_name = "P")]
    pub profile: Option<String>,
    /// Only executions of this actor.
    #[arg(long, value_name = "A")]
    pub actor: Option<String>,
    /// Only executions of this project.
    #[arg(long, value_name = "P")]
    pub project: Option<String>,
    /// At most this many executions (the daemon picks a default when absent).
    #[arg(long, value_name = "N")]
    pub page_size: Option<u32>,
    /// Continue from the `next page` token of a previous listing.
    #[arg(long, value_name = "T")]
    pub page_token: Option<String>,
}

/// Arguments of `corral gate`: what `corral exec` would send to the gate.
#[derive(clap::Args, Debug)]
pub struct GateArgs {
    /// Harness profile: `id@version`, or a bare `id` when only one version exists.
    #[arg(long)]
    pub profile: String,
    /// A local git repository for the workspace (relative paths are resolved
    /// against the current directory).
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// Governed consumer type [default: the calling principal's type].
    #[arg(long, default_value = "", value_parser = ["", "adm", "agt", "atm"], hide_default_value = true)]
    pub actor: String,
    /// Project the run would be accounted to [default: the principal's only
    /// project, or `default` for one that sees all].
    #[arg(long, default_value = "", hide_default_value = true)]
    pub project: String,
}

/// Arguments of `corral profiles` (none yet).
#[derive(clap::Args, Debug)]
pub struct ProfilesArgs {}

/// Accepts `succeeded`, `SUCCEEDED` or `EXECUTION_STATE_SUCCEEDED`.
fn parse_state(s: &str) -> Result<pb::ExecutionState, String> {
    let upper = s.to_ascii_uppercase();
    let full = if upper.starts_with("EXECUTION_STATE_") { upper } else { format!("EXECUTION_STATE_{upper}") };
    match pb::ExecutionState::from_str_name(&full) {
        Some(state) if state != pb::ExecutionState::Unspecified => Ok(state),
        _ => Err(format!("unknown state `{s}` (expected pending, running, succeeded, failed, refused or cancelled)")),
    }
}

/// Runs one client command; returns the process exit code.
///
/// A call that fails (a file it names cannot be read, a bad `--server`
/// URL, the daemon unreachable, a `Status` from it) is reported on stderr
/// and is exit code 2. The error returned is a write to a reader that went
/// away (`| head`), for `main` to end quietly.
pub async fn run(opts: ClientOpts, cmd: ClientCommand) -> anyhow::Result<i32> {
    match call(opts, cmd).await {
        Ok(code) => Ok(code),
        Err(err) if is_broken_pipe(&err) => Err(err),
        Err(err) => {
            // Status first: a Status can itself carry a transport error as
            // its source, and its code is the more useful thing to show.
            match err.downcast_ref::<tonic::Status>() {
                Some(status) => report_status(status),
                None => eprintln!("error: {}", one_line(&err)),
            }
            Ok(2)
        }
    }
}

/// The command itself: its outcome's exit code, or why the call failed.
async fn call(opts: ClientOpts, cmd: ClientCommand) -> anyhow::Result<i32> {
    let printer = Printer::new(opts.json)?;
    let remote = opts.remote()?;
    let server = &remote;
    match cmd {
        ClientCommand::Exec(args) => exec::exec(server, args, &printer).await,
        ClientCommand::Watch(args) => exec::watch(server, args, &printer).await,
        ClientCommand::Get(args) => query::get(server, args, &printer).await,
        ClientCommand::Cancel { id } => session::cancel(server, id, &printer).await,
        ClientCommand::Session(command) => session::run(server, command, &printer).await,
        ClientCommand::Approve(args) => query::decide(server, args, true, &printer).await,
        ClientCommand::Deny(args) => query::decide(server, args, false, &printer).await,
        ClientCommand::Ls(args) => query::ls(server, args, &printer).await,
        ClientCommand::Profiles(_) => query::profiles(server, &printer).await,
        ClientCommand::Gate(args) => gate::gate(server, args, &printer).await,
        ClientCommand::Nodes => query::nodes(server, &printer).await,
        ClientCommand::Drain { node } => query::drain(server, node, &printer).await,
        ClientCommand::Version => query::version(server, &printer).await,
        // `--server` (or CORRAL_SERVER): that daemon, called with the token
        // and TLS material given; none: in-process daemons.
        ClientCommand::Bench(args) => bench::run(opts.server.is_some().then_some(&remote), args, opts.json).await,
    }
}

/// Whether `err` is a write to a reader that went away (`| head`): how a
/// pipe ends, not an error.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|e| e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// An error and its causes on one line, each cause once (transport errors
/// repeat their source in their own message).
fn one_line(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        let part = part.strip_prefix("transport error: ").unwrap_or(&part).to_string();
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// Opens a channel to the daemon: `unix:///path` or an http(s) URL.
pub async fn connect(server: &str) -> anyhow::Result<Channel> {
    connect_with(server, &ClientTls::default()).await
}

/// The same, with TLS material for `https://`.
pub async fn connect_with(server: &str, tls: &ClientTls) -> anyhow::Result<Channel> {
    use anyhow::Context as _;
    if let Some(path) = server.strip_prefix("unix://") {
        // The URI is a placeholder: the connector ignores it.
        let endpoint = tonic::transport::Endpoint::from_static("http://corral.sock");
        return connect_endpoint_unix(endpoint, std::path::Path::new(path))
            .await
            .with_context(|| format!("cannot connect to {server}"));
    }
    let mut endpoint = Channel::from_shared(server.to_owned())
        .with_context(|| format!("invalid --server address `{server}`"))?
        .tcp_nodelay(true);
    if server.starts_with("https://") {
        let mut config = tonic::transport::ClientTlsConfig::new().with_enabled_roots();
        if let Some(ca) = &tls.ca {
            config = config.ca_certificate(tonic::transport::Certificate::from_pem(ca));
        }
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            config = config.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        endpoint = endpoint.tls_config(config).context("TLS configuration")?;
    }
    // The context keeps the transport error downcastable, so `run` still
    // maps a refused connection to exit code 2.
    endpoint.connect().await.with_context(|| format!("cannot connect to {server}"))
}

/// Connects `endpoint` (its settings; the URI is ignored) over the unix
/// socket at `path`.
pub async fn connect_endpoint_unix(
    endpoint: tonic::transport::Endpoint,
    path: &std::path::Path,
) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(path).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    endpoint.connect_with_connector(connector).await
}

/// Prints a failed RPC: its code and message, plus the machine reason and
/// offending fields the daemon attaches as `google.rpc` error details.
fn report_status(status: &tonic::Status) {
    eprintln!("error: {:?} ({}): {}", status.code(), status.code() as i32, status.message());
    let details = status.get_error_details();
    if let Some(info) = details.error_info() {
        eprintln!("  reason: {} ({})", info.reason, info.domain);
    }
    if let Some(bad) = details.bad_request() {
        for violation in &bad.field_violations {
            eprintln!("  field {}: {}", violation.field, violation.description);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_names_are_accepted_in_every_spelling() {
        for s in ["failed", "FAILED", "execution_state_failed", "EXECUTION_STATE_FAILED"] {
            assert_eq!(parse_state(s), Ok(pb::ExecutionState::Failed));
        }
        assert!(parse_state("unspecified").is_err());
        assert!(parse_state("done").is_err());
    }

    #[test]
    fn exec_requires_exactly_one_description_source() {
        use clap::Parser;
        #[derive(clap::Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            opts: ClientOpts,
            #[command(subcommand)]
            cmd: ClientCommand,
        }
        let base = ["corral", "exec", "--profile", "p", "--title", "t"];
        assert!(Cli::try_parse_from(base).is_err());
        let both = [&base[..], &["--description", "d", "--description-file", "-"]].concat();
        assert!(Cli::try_parse_from(both).is_err());
        let one = [&base[..], &["--description", "d", "--json"]].concat();
        let cli = Cli::try_parse_from(one).expect("valid command line");
        assert!(cli.opts.json);
        match cli.cmd {
            ClientCommand::Exec(args) => {
                assert_eq!(args.actor, "", "the principal's type decides");
                assert_eq!(args.project, "", "the principal's project decides");
            }
            other => panic!("parsed as {other:?}"),
        }
    }
}

#[cfg(test)]
mod daemon_tests;
