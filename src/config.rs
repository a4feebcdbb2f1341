//! Daemon configuration, layered: defaults → TOML file → `CORRAL_*`
//! environment → command-line flags, validated once.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::credentials::CredentialsConfig;
use crate::hub::HubConfig;
use crate::policy::PolicySpec;

/// The daemon's configuration, as [`Config::load`] builds it; every key has a
/// default.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address.
    pub listen: String,
    /// Where the store and the sandboxes' workspaces live.
    pub data_dir: PathBuf,
    /// Directories of profile TOML files, added to the built-in profiles.
    pub profile_dirs: Vec<PathBuf>,
    /// How long in-flight executions get on SIGTERM before they are cancelled.
    pub shutdown_grace_seconds: u64,
    /// How many events a watcher may fall behind before it is ended: one
    /// that is more than this many behind and has read nothing for a second
    /// is ended (a watcher that keeps reading is never ended; it catches up
    /// from the store). At most [`MAX_WATCH_BUFFER`]: each live execution
    /// and session holds a buffer of this many events.
    pub watch_buffer: usize,
    /// Sessions with no turn for this long are reaped (never mid-turn).
    pub session_idle_seconds: u64,
    /// Admission control: executions running at once; more are refused
    /// with RESOURCE_EXHAUSTED (nothing is stored for them) on SQLite, and
    /// queued in the fleet's queue on a shared PostgreSQL store.
    pub max_running_executions: usize,
    /// The same bound for live sessions.
    pub max_running_sessions: usize,
    /// A finished execution's events are kept this long (at most ten
    /// years), then compacted to its final `finished` event (record and
    /// evidence).
    pub event_retention_seconds: u64,
    /// Repositories an execution or session may name must be beneath one
    /// of these (default: [`DEFAULT_REPO_ROOT`]; empty: none at all, every
    /// workspace starts empty). `CORRAL_REPO_ROOTS` (colon-separated)
    /// replaces the list.
    pub repo_roots: Vec<PathBuf>,
    /// The daemon's admin policies, evaluated after session and profile ones.
    pub policies: Vec<PolicySpec>,
    /// Where reports go (`report_to_hub`); none: reports are refused.
    pub hub: Option<HubConfig>,
    /// Credential routes profiles may name in `credential_route_refs`.
    pub credentials: CredentialsConfig,
    /// The `[store]` section: where the record is kept.
    pub store: StoreConfig,
    /// Host identity and cgroups of sandboxes.
    pub sandbox: crate::sandbox::SandboxConfig,
    /// `[default_limits]`: the limits of every profile (built-in or file)
    /// for each key its own `[limits]` leaves out; keys left out here take
    /// the built-in defaults (`catalog::Limits::default`). Set a key to 0
    /// to run without that limit, where a profile's `[limits]` may (six
    /// keys must be greater than 0, see `catalog::Limits`).
    pub default_limits: crate::catalog::Limits,
    /// How a run's workspace is brought back.
    pub git: GitConfig,
    /// Who may call: see `auth`. Root and the daemon's own uid on the unix
    /// socket, and the holder of `<data_dir>/admin.token`, are the local
    /// administrator; everyone else must be a principal listed here.
    pub principals: Vec<crate::auth::PrincipalConfig>,
    /// A directory of principal files (`*.toml`, one principal each).
    pub principals_dir: Option<PathBuf>,
    /// The unix socket (peer uid → principal); default
    /// `<data_dir>/corral.sock`, `""` for none.
    pub unix_socket: Option<PathBuf>,
    /// The group that owns the socket (mode 0660), by name or number.
    pub unix_socket_group: Option<String>,
    /// TLS for the TCP listener: certificate chain and key (PEM).
    pub tls_cert: Option<PathBuf>,
    /// The TLS private key (PEM) for `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// With TLS, verify client certificates against this CA (PEM): mTLS.
    /// A verified certificate's names map to principals (`tls_names`);
    /// clients without one may still use bearer tokens.
    pub client_ca: Option<PathBuf>,
    /// Where the built-in Claude Code and Codex profiles send their model
    /// requests (and which model they ask for).
    pub harness: crate::catalog::HarnessConfig,
    /// Where Prometheus scrapes `GET /metrics` (unset: no metrics listener).
    pub metrics_listen: Option<String>,
    /// A file holding the bearer token a scrape must present (at least 32
    /// characters); required when `metrics_listen` is not loopback, refused
    /// without `metrics_listen`.
    pub metrics_token_file: Option<PathBuf>,
    /// OpenTelemetry traces.
    pub telemetry: TelemetryConfig,
    /// Names this daemon in a shared store (default: host name and data
    /// directory): recovery and hub delivery only touch its own rows. As
    /// `[fleet] node` (1-200 characters, none of them control characters),
    /// which it may not be set beside.
    pub node_id: Option<String>,
    /// The server's limits: message sizes, streams, keepalive, watchers.
    pub grpc: GrpcConfig,
    /// The sandboxes' egress proxies together: connection caps, idle timeout.
    pub proxy: crate::net::ProxyLimitsConfig,
    /// How the real agents' tool calls reach the gate.
    pub gate: crate::gate::GateConfig,
    /// This daemon as a node of a fleet on one store: its name, its lease.
    pub fleet: FleetConfig,
}

/// The `[grpc]` section: what one client can ask of the server.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// The largest request message accepted (beyond it tonic answers
    /// OUT_OF_RANGE, naming the limit).
    pub max_recv_message_bytes: usize,
    /// The largest response message sent. A `finished` event is kept under
    /// it: the raw output riding on it is cut to fit, and an
    /// `output_truncated` event says how much was dropped.
    pub max_send_message_bytes: usize,
    /// Streams (calls) at once on one HTTP/2 connection.
    pub max_concurrent_streams: u32,
    /// An HTTP/2 PING to each connection this often (0: never; at most ten
    /// years), so dead peers are noticed and their streams ended.
    pub keepalive_interval_seconds: u64,
    /// A PING unanswered this long (at most ten years) closes the connection.
    pub keepalive_timeout_seconds: u64,
    /// Bytes one stream may have waiting to be written to its connection;
    /// beyond it the stream stops producing until the client reads (a slow
    /// watcher catches up from the store). h2's own default is 400 KiB. A
    /// stream's memory is this plus its 4 KiB encode buffer.
    pub max_send_buffer_bytes: usize,
    /// Watcher streams on one execution or session at once; more are refused
    /// with RESOURCE_EXHAUSTED. Counted: WatchExecution/WatchSession, an
    /// `Execute` waiting in the fleet's queue, an `Execute` retried with a
    /// taken request id, a `SendTurn` forwarded to another node; not the
    /// direct caller of an `Execute` or `SendTurn` run on the node it called.
    pub max_watchers_per_subject: usize,
    /// The same streams, of one principal's calls, on any subjects: one
    /// tenant cannot take every place of `max_watchers`. Not the local
    /// administrator's (the operator's, not a tenant's). A queued `Execute`
    /// or a forwarded `SendTurn` refused for want of a place is neither
    /// queued nor sent. Unset: 4096, or `max_watchers` when that is lower.
    pub max_watchers_per_principal: Option<usize>,
    /// The same streams in total.
    pub max_watchers: usize,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig {
            // What gRPC clients accept by default: a larger response would
            // be refused by a client left at its defaults.
            max_recv_message_bytes: 4 << 20,
            max_send_message_bytes: 4 << 20,
            max_concurrent_streams: 256,
            keepalive_interval_seconds: 60,
            keepalive_timeout_seconds: 20,
            max_send_buffer_bytes: 16 << 10,
            max_watchers_per_subject: 2048,
            max_watchers_per_principal: None,
            max_watchers: 16384,
        }
    }
}

impl GrpcConfig {
    /// `max_watchers_per_principal` unless set.
    pub const DEFAULT_WATCHERS_PER_PRINCIPAL: usize = 4096;

    /// The watch streams one principal may hold.
    pub fn watchers_per_principal(&self) -> usize {
        self.max_watchers_per_principal.unwrap_or(Self::DEFAULT_WATCHERS_PER_PRINCIPAL).min(self.max_watchers)
    }

    /// The smallest request limit: a request with every field at its
    /// largest (a 256 KiB description, 32 policies of 16 KiB, ...) fits.
    pub const MIN_RECV_BYTES: usize = 1 << 20;
    /// The smallest response limit: a progress event carries a harness
    /// line of up to 1 MiB, and a `finished` record needs room of its own.
    pub const MIN_SEND_BYTES: usize = 2 << 20;

    fn validate(&self) -> Result<(), (String, String)> {
        let key = |name: &str| format!("grpc.{name}");
        for (name, value, min) in [
            ("max_recv_message_bytes", self.max_recv_message_bytes, Self::MIN_RECV_BYTES),
            ("max_send_message_bytes", self.max_send_message_bytes, Self::MIN_SEND_BYTES),
            // One 16 KiB HTTP/2 frame at least.
            ("max_send_buffer_bytes", self.max_send_buffer_bytes, 16 << 10),
        ] {
            if !(min..=1 << 30).contains(&value) {
                return Err((key(name), format!("{value} must be between {min} and {}", 1 << 30)));
            }
        }
        if self.max_concurrent_streams == 0 {
            return Err((key("max_concurrent_streams"), "must be greater than 0".into()));
        }
        if self.keepalive_interval_seconds > 0 && self.keepalive_timeout_seconds == 0 {
            return Err((key("keepalive_timeout_seconds"), "must be greater than 0 when keepalive is on".into()));
        }
        // hyper adds them to `Instant`s, which panics on overflow.
        for (name, seconds) in [
            ("keepalive_interval_seconds", self.keepalive_interval_seconds),
            ("keepalive_timeout_seconds", self.keepalive_timeout_seconds),
        ] {
            crate::types::at_most_ten_years(seconds).map_err(|message| (key(name), message))?;
        }
        let per_principal = self.max_watchers_per_principal.unwrap_or(1);
        for (name, value) in [
            ("max_watchers", self.max_watchers),
            ("max_watchers_per_subject", self.max_watchers_per_subject),
            ("max_watchers_per_principal", per_principal),
        ] {
            if value == 0 {
                return Err((key(name), "must be greater than 0".into()));
            }
        }
        for (name, value) in
            [("max_watchers_per_subject", self.max_watchers_per_subject), ("max_watchers_per_principal", per_principal)]
        {
            if value > self.max_watchers {
                return Err((key(name), "must not be greater than max_watchers".into()));
            }
        }
        Ok(())
    }
}

/// The `[telemetry]` section: OpenTelemetry traces over OTLP/gRPC.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// e.g. `http://127.0.0.1:4317`; unset: no traces are exported.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` the exported traces carry (default `corral`).
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig { otlp_endpoint: None, service_name: "corral".into() }
    }
}

/// The `[git]` section: the capture of a workspace at the end of a run.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GitConfig {
    /// How long the capture inside the sandbox may take before it is
    /// killed and the run fails at `teardown`.
    pub timeout_seconds: u64,
    /// The largest bundle fetched back into the origin.
    pub max_bundle_bytes: u64,
    /// The most `refs/corral/*` refs one origin may hold: past it a run's
    /// work is not fetched back (the run fails at `teardown` saying so)
    /// until an operator prunes old ones.
    pub max_capture_refs: u64,
    /// The most bytes one origin's objects may take on disk (git
    /// `count-objects`) for a fetch back to be made: runs cannot grow a
    /// repository without bound.
    pub max_origin_bytes: u64,
    /// Of `max_capture_refs`, the most that name one principal's runs
    /// (default: a quarter, at least 1): one tenant's runs cannot use up a
    /// repository it shares with others. The local administrator is not
    /// bounded so.
    pub max_capture_refs_per_principal: Option<u64>,
}

impl GitConfig {
    /// The most `refs/corral/*` refs of one principal in one origin.
    pub fn capture_refs_per_principal(&self) -> u64 {
        self.max_capture_refs_per_principal.unwrap_or((self.max_capture_refs / 4).max(1))
    }
}

impl Default for GitConfig {
    fn default() -> Self {
        GitConfig {
            timeout_seconds: 120,
            max_bundle_bytes: 256 << 20,
            max_capture_refs: 1000,
            max_origin_bytes: 8 << 30,
            max_capture_refs_per_principal: None,
        }
    }
}

/// The `[store]` section: SQLite in the data directory, or a shared PostgreSQL.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `postgres://user:password@host/db` to share one record between
    /// daemons; unset: SQLite in the data directory.
    pub url: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:50051".into(),
            data_dir: default_data_dir(),
            profile_dirs: Vec::new(),
            shutdown_grace_seconds: 30,
            watch_buffer: 4096,
            session_idle_seconds: 900,
            max_running_executions: 64,
            max_running_sessions: 64,
            event_retention_seconds: 7 * 24 * 3600,
            repo_roots: vec![PathBuf::from(DEFAULT_REPO_ROOT)],
            policies: Vec::new(),
            hub: None,
            credentials: CredentialsConfig::default(),
            store: StoreConfig::default(),
            sandbox: crate::sandbox::SandboxConfig::default(),
            default_limits: crate::catalog::Limits::default(),
            git: GitConfig::default(),
            principals: Vec::new(),
            principals_dir: None,
            unix_socket: None,
            unix_socket_group: None,
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            harness: crate::catalog::HarnessConfig::default(),
            metrics_listen: None,
            metrics_token_file: None,
            telemetry: TelemetryConfig::default(),
            node_id: None,
            grpc: GrpcConfig::default(),
            proxy: crate::net::ProxyLimitsConfig::default(),
            gate: crate::gate::GateConfig::default(),
            fleet: FleetConfig::default(),
        }
    }
}

/// Where repositories are, unless `repo_roots` says otherwise: a
/// directory an operator fills on purpose, never "anything on the host".
pub const DEFAULT_REPO_ROOT: &str = "/srv/corral/repos";

/// `/var/lib/corral` for a root daemon (its sandboxes' uids must traverse
/// it, and root's home is private); otherwise `$XDG_DATA_HOME/corral`, else
/// `~/.local/share/corral`, else `./corral-data`.
pub fn default_data_dir() -> PathBuf {
    if crate::sandbox::host::effective_uid() == 0 {
        return PathBuf::from("/var/lib/corral");
    }
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("corral");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home).join(".local/share/corral");
    }
    PathBuf::from("corral-data")
}

/// Why the configuration was refused. Each variant names what to fix: the file,
/// the environment variable or the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or is not valid TOML for the config.
    #[error("{file}: {message}")]
    File {
        /// The file's path.
        file: String,
        /// What is wrong with it.
        message: String,
    },
    /// A `CORRAL_*` environment variable holds a value that cannot be used.
    #[error("environment variable {name}: {message}")]
    Env {
        /// The variable's name.
        name: String,
        /// What is wrong with its value.
        message: String,
    },
    /// A key's value was refused by validation.
    #[error("config key {key}: {message}")]
    Invalid {
        /// The key, as the file spells it (`grpc.max_watchers`).
        key: String,
        /// Why its value was refused.
        message: String,
    },
}

/// Command-line values that override everything else.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// The `--listen` address; `None` keeps the configured one.
    pub listen: Option<String>,
    /// The `--data-dir`; `None` keeps the configured one.
    pub data_dir: Option<PathBuf>,
    /// Profile directories added after the configured ones.
    pub profile_dirs: Vec<PathBuf>,
}

/// `dir` with its symlinks, `.` and `..` resolved and no trailing slash;
/// while it does not exist, made absolute (from the working directory) with
/// its `.` and trailing slashes dropped.
fn canonical_dir(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir)
        .unwrap_or_else(|_| std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()).components().collect())
}

impl Config {
    /// Where the unix socket is, if there is one.
    pub fn unix_socket_path(&self) -> Option<PathBuf> {
        match &self.unix_socket {
            Some(path) if path.as_os_str().is_empty() => None,
            Some(path) => Some(path.clone()),
            None => Some(self.data_dir.join("corral.sock")),
        }
    }

    /// This daemon's name in a shared store: `[fleet] node`, else
    /// `node_id`, else the host name and the data directory, resolved (see
    /// [`canonical_dir`]): the same directory spelled otherwise is the same
    /// node, whose rows recovery finds again.
    pub fn node(&self) -> String {
        self.fleet.node.clone().or_else(|| self.node_id.clone()).unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}:{}", host.trim(), canonical_dir(&self.data_dir).display())
        })
    }

    /// Checks the name [`Config::node`] resolves to, naming the key it
    /// comes from: `DrainNode` could not name a node of another name.
    /// `node_id` beside `[fleet] node` would be ignored, so it is refused.
    fn check_node_name(&self) -> Result<(), (&'static str, String)> {
        const RULE: &str = "must be 1-200 characters, none of them control characters";
        match (&self.fleet.node, &self.node_id) {
            (Some(_), Some(_)) => Err(("node_id", "set at most one of node_id and fleet.node".into())),
            (Some(name), None) if !node_name_ok(name) => Err(("fleet.node", RULE.into())),
            (None, Some(name)) if !node_name_ok(name) => Err(("node_id", RULE.into())),
            (None, None) => match self.node() {
                name if node_name_ok(&name) => Ok(()),
                name => Err((
                    "fleet.node",
                    format!("unset, this node is named {name:?} (host name and data_dir), which {RULE}: set it"),
                )),
            },
            _ => Ok(()),
        }
    }

    /// The configuration: `file` (or the defaults, without one), then the
    /// `CORRAL_*` environment, then `overrides`, validated once at the end.
    pub fn load(file: Option<&Path>, overrides: Overrides) -> Result<Config, ConfigError> {
        let mut config = match file {
            Some(path) => Self::from_file(path)?,
            None => Config::default(),
        };
        config.apply_env(|name| std::env::var(name).ok())?;
        if let Some(listen) = overrides.listen {
            config.listen = listen;
        }
        if let Some(dir) = overrides.data_dir {
            config.data_dir = dir;
        }
        config.profile_dirs.extend(overrides.profile_dirs);
        config.validate()?;
        Ok(config)
    }

    /// The file's keys over the defaults, neither validated nor overridden by
    /// the environment.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::File { file: file.clone(), message: e.to_string() })?;
        toml::from_str(&text).map_err(|e| ConfigError::File { file, message: e.to_string() })
    }

    fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(v) = get("CORRAL_LISTEN") {
            self.listen = v;
        }
        if let Some(v) = get("CORRAL_DATA_DIR") {
            self.data_dir = v.into();
        }
        if let Some(v) = get("CORRAL_PROFILES") {
            self.profile_dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
        }
        if let Some(v) = get("CORRAL_REPO_ROOTS") {
            self.repo_roots = std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()).collect();
        }
        if let Some(v) = get("CORRAL_UNIX_SOCKET") {
            self.unix_socket = Some(v.into());
        }
        if let Some(v) = get("CORRAL_CGROUP_PARENT") {
            // The systemd unit names its delegated subtree this way.
            self.sandbox.cgroup_parent = v;
        }
        if let Some(v) = get("CORRAL_STORE_URL") {
            self.store.url = Some(v);
        }
        if let Some(v) = get("CORRAL_SHUTDOWN_GRACE_SECONDS") {
            self.shutdown_grace_seconds = v.parse().map_err(|e| ConfigError::Env {
                name: "CORRAL_SHUTDOWN_GRACE_SECONDS".into(),
                message: format!("{v:?}: {e}"),
            })?;
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid { key: key.into(), message };
        let listen = self
            .listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| invalid("listen", format!("{:?} is not an address: {e}", self.listen)))?;
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(invalid("tls_cert", "tls_cert and tls_key go together".into()));
        }
        if self.client_ca.is_some() && self.tls_cert.is_none() {
            return Err(invalid("client_ca", "needs tls_cert and tls_key".into()));
        }
        // Plaintext TCP is for loopback only (every RPC still needs a
        // principal).
        if !listen.ip().is_loopback() && self.tls_cert.is_none() {
            return Err(invalid(
                "listen",
                format!("{listen} is not a loopback address: a non-loopback listener needs TLS (tls_cert, tls_key)"),
            ));
        }
        if self.max_running_executions == 0 {
            return Err(invalid("max_running_executions", "must be greater than 0".into()));
        }
        if self.fleet.lease_seconds == 0 {
            return Err(invalid("fleet.lease_seconds", "must be at least 1".into()));
        }
        // In milliseconds they are added to and taken from Unix times (i64):
        // a larger value would wrap (a retention cutoff in the future would
        // compact every finished run's events).
        for (key, seconds) in [
            ("event_retention_seconds", self.event_retention_seconds),
            ("fleet.lease_seconds", self.fleet.lease_seconds),
        ] {
            crate::types::at_most_ten_years(seconds).map_err(|message| invalid(key, message))?;
        }
        match self.fleet.capacity {
            Some(c) if c > self.max_running_executions => {
                return Err(invalid(
                    "fleet.capacity",
                    format!("{c} is more than max_running_executions ({})", self.max_running_executions),
                ))
            }
            Some(0) if self.store.url.is_none() => {
                return Err(invalid(
                    "fleet.capacity",
                    "0 (a front end) needs a shared store (store.url): on its own store nothing would run".into(),
                ))
            }
            _ => {}
        }
        for label in &self.fleet.labels {
            crate::catalog::check_label(label).map_err(|e| invalid("fleet.labels", e))?;
        }
        if self.fleet.max_queued == 0 {
            return Err(invalid("fleet.max_queued", "must be at least 1".into()));
        }
        if self.git.max_capture_refs_per_principal == Some(0) {
            return Err(invalid("git.max_capture_refs_per_principal", "must be at least 1".into()));
        }
        if self.fleet.max_queued_per_principal == Some(0) {
            return Err(invalid("fleet.max_queued_per_principal", "must be at least 1".into()));
        }
        self.check_node_name().map_err(|(key, message)| invalid(key, message))?;
        if self.max_running_sessions == 0 {
            return Err(invalid("max_running_sessions", "must be greater than 0".into()));
        }
        if self.session_idle_seconds == 0 {
            return Err(invalid("session_idle_seconds", "must be greater than 0".into()));
        }
        // Without a listener the token would protect nothing.
        if self.metrics_token_file.is_some() && self.metrics_listen.is_none() {
            return Err(invalid(
                "metrics_token_file",
                "there is no metrics listener for it: set metrics_listen".into(),
            ));
        }
        if let Some(addr) = &self.metrics_listen {
            let metrics = addr
                .parse::<std::net::SocketAddr>()
                .map_err(|e| invalid("metrics_listen", format!("{addr:?} is not an address: {e}")))?;
            if !metrics.ip().is_loopback() && self.metrics_token_file.is_none() {
                return Err(invalid(
                    "metrics_listen",
                    format!(
                        "{metrics} is not a loopback address: a non-loopback metrics listener needs metrics_token_file"
                    ),
                ));
            }
        }
        if self.git.timeout_seconds == 0 {
            return Err(invalid("git.timeout_seconds", "must be greater than 0".into()));
        }
        if self.git.max_bundle_bytes == 0 {
            return Err(invalid("git.max_bundle_bytes", "must be greater than 0".into()));
        }
        if self.git.max_capture_refs == 0 || self.git.max_origin_bytes == 0 {
            return Err(invalid(
                "git.max_capture_refs",
                "max_capture_refs and max_origin_bytes must be greater than 0".into(),
            ));
        }
        // Every live execution and session allocates a live buffer of this
        // many events: a huge value would fail at the first execution, not here.
        if !(16..=MAX_WATCH_BUFFER).contains(&self.watch_buffer) {
            return Err(invalid("watch_buffer", format!("must be between 16 and {MAX_WATCH_BUFFER}")));
        }
        if let Some(url) = &self.store.url {
            if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
                return Err(invalid(
                    "store.url",
                    "must be a postgres:// URL (unset for SQLite in the data directory)".into(),
                ));
            }
        }
        if let Some(hub) = &self.hub {
            hub.validate().map_err(|(key, message)| invalid(&key, message))?;
        }
        self.credentials.validate().map_err(|(key, message)| invalid(&key, message))?;
        self.grpc.validate().map_err(|(key, message)| invalid(&key, message))?;
        self.proxy.validate().map_err(|(key, message)| invalid(&key, message))?;
        self.sandbox.validate().map_err(|(key, message)| invalid(&key, message))?;
        let limits = &self.default_limits;
        crate::types::at_most_ten_years(limits.timeout_seconds)
            .map_err(|e| invalid("default_limits.timeout_seconds", e))?;
        for (key, value) in [
            ("default_limits.timeout_seconds", limits.timeout_seconds),
            ("default_limits.max_output_bytes", limits.max_output_bytes),
            ("default_limits.tmp_bytes", limits.tmp_bytes),
            ("default_limits.shm_bytes", limits.shm_bytes),
            ("default_limits.max_events", limits.max_events),
            ("default_limits.max_event_bytes", limits.max_event_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0".into()));
            }
        }
        crate::catalog::check_cpu_millis(limits.cpu_millis).map_err(|e| invalid("default_limits.cpu_millis", e))?;
        self.harness.validate().map_err(|(key, message)| invalid(&key, message))?;
        // A credential no listener presents would load and never identify
        // anyone: refused here, where the listeners are known.
        let (socket, client_ca) = (self.unix_socket_path().is_some(), self.client_ca.is_some());
        crate::auth::PrincipalConfig::check_listeners(
            &self.principals,
            self.principals_dir.as_deref(),
            socket,
            client_ca,
        )
        .map_err(|(key, message)| invalid(&key, message))?;
        self.gate.validate().map_err(|(key, message)| invalid(&key, message))?;
        for root in &self.repo_roots {
            if !root.is_absolute() {
                return Err(invalid("repo_roots", format!("{} must be absolute", root.display())));
            }
            // "/" would make every directory of the host a repository a
            // principal may name.
            if root.components().count() < 2 {
                return Err(invalid("repo_roots", format!("{} would allow the whole host", root.display())));
            }
        }
        Ok(())
    }
}

/// The largest `watch_buffer` accepted (1,048,576 events).
pub const MAX_WATCH_BUFFER: usize = 1 << 20;

/// Whether `name` can name a node: 1-200 characters, none of them control
/// characters, as `DrainNode` accepts (characters, not bytes).
fn node_name_ok(name: &str) -> bool {
    (1..=200).contains(&name.chars().count()) && !name.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_buffer_is_bounded() {
        assert!(Config { watch_buffer: MAX_WATCH_BUFFER, ..Config::default() }.validate().is_ok());
        for bad in [15, MAX_WATCH_BUFFER + 1, usize::MAX / 2 + 1] {
            let err = Config { watch_buffer: bad, ..Config::default() }.validate().unwrap_err().to_string();
            assert!(err.contains("watch_buffer"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_zero_watcher_limit_names_its_own_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.toml");
        std::fs::write(&file, "[grpc]\nmax_watchers_per_subject = 0\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_watchers_per_subject:"), "{err}");
        std::fs::write(&file, "[grpc]\nmax_watchers = 0\nmax_watchers_per_subject = 0\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_watchers:"), "{err}");
    }

    /// The README's configuration block is a file the daemon reads: every
    /// key in it exists, in the table it is written under.
    #[test]
    fn the_readme_configuration_parses_as_written() {
        let readme = include_str!("../README.md");
        let start = readme.find("## Configuration").expect("the README has a Configuration section");
        let block = &readme[start..];
        let block = &block[block.find("```toml\n").expect("a toml block") + 8..];
        let block = &block[..block.find("```").expect("the block ends")];
        let config: Config = toml::from_str(block).unwrap_or_else(|e| panic!("the README's configuration: {e}"));
        assert_eq!(config.fleet.capacity, Some(8));
        assert_eq!(config.fleet.max_queued, 1000);
        assert_eq!(config.fleet.labels, vec!["gpu".to_string()]);
        assert!(config.unix_socket.is_some(), "a top-level key after the tables would belong to the last one");
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("corral.toml");
        std::fs::write(&file, "listen = \"127.0.0.1:7000\"\nshutdown_grace_seconds = 5\n").unwrap();
        let mut config = Config::from_file(&file).unwrap();
        assert_eq!(config.listen, "127.0.0.1:7000");
        config
            .apply_env(|name| match name {
                "CORRAL_LISTEN" => Some("127.0.0.1:7001".into()),
                "CORRAL_SHUTDOWN_GRACE_SECONDS" => Some("9".into()),
                "CORRAL_CGROUP_PARENT" => Some("system.slice/corral.service/sandboxes".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!((config.listen.as_str(), config.shutdown_grace_seconds), ("127.0.0.1:7001", 9));
        assert_eq!(config.sandbox.cgroup_parent, "system.slice/corral.service/sandboxes");
    }

    #[test]
    fn repositories_are_policy_by_default() {
        assert_eq!(Config::default().repo_roots, vec![PathBuf::from(DEFAULT_REPO_ROOT)]);
        let mut config = Config::default();
        config.apply_env(|name| (name == "CORRAL_REPO_ROOTS").then(|| "/srv/a:/srv/b".into())).unwrap();
        assert_eq!(config.repo_roots, vec![PathBuf::from("/srv/a"), PathBuf::from("/srv/b")]);
        for bad in ["/", "relative/path"] {
            let config = Config { repo_roots: vec![PathBuf::from(bad)], ..Config::default() };
            assert!(config.validate().unwrap_err().to_string().contains("repo_roots"), "{bad}");
        }
    }

    #[test]
    fn the_harness_section_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("corral.toml");
        std::fs::write(&file, "[harness]\nanthropic_base_url = \"http://127.0.0.1:9000\"\nopenai_model = \"m-1\"\n")
            .unwrap();
        let config = Config::from_file(&file).unwrap();
        assert_eq!(config.harness.anthropic_base_url, "http://127.0.0.1:9000");
        assert!(config.validate().is_ok());
        let mut bad = config.clone();
        bad.harness.openai_base_url = "ftp://x".into();
        assert!(bad.validate().unwrap_err().to_string().contains("harness.openai_base_url"));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "lisen = \"x\"\n").unwrap();
        let err = Config::from_file(&file).unwrap_err().to_string();
        assert!(err.contains("bad.toml") && err.contains("lisen"), "{err}");
        let config = Config { listen: "nowhere".into(), ..Config::default() };
        assert!(config.validate().unwrap_err().to_string().contains("listen"));
    }

    #[test]
    fn a_metrics_listener_off_loopback_needs_a_token() {
        let open = Config { metrics_listen: Some("0.0.0.0:9464".into()), ..Config::default() };
        let err = open.validate().unwrap_err().to_string();
        assert!(err.contains("metrics_listen") && err.contains("metrics_token_file"), "{err}");
        let with_token = Config { metrics_token_file: Some("/etc/corral/metrics.token".into()), ..open };
        assert!(with_token.validate().is_ok());
        assert!(Config { metrics_listen: Some("127.0.0.1:9464".into()), ..Config::default() }.validate().is_ok());
    }

    #[test]
    fn server_limits_are_checked() {
        assert!(Config::default().validate().is_ok());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.toml");
        std::fs::write(&file, "[grpc]\nmax_send_message_bytes = 1024\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_send_message_bytes"), "{err}");
        std::fs::write(&file, "[grpc]\nmax_watchers = 10\nmax_watchers_per_subject = 11\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_watchers_per_subject"), "{err}");
        std::fs::write(
            &file,
            "[grpc]\nmax_watchers = 10\nmax_watchers_per_subject = 5\nmax_watchers_per_principal = 11\n",
        )
        .unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_watchers_per_principal: must not be greater than max_watchers"), "{err}");
        std::fs::write(&file, "[grpc]\nmax_watchers_per_principal = 0\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("grpc.max_watchers_per_principal: must be greater than 0"), "{err}");
        // Unset, it follows a lowered max_watchers rather than refuse it.
        std::fs::write(&file, "[grpc]\nmax_watchers = 10\nmax_watchers_per_subject = 5\n").unwrap();
        let config = Config::from_file(&file).unwrap();
        assert!(config.validate().is_ok());
        assert_eq!(config.grpc.watchers_per_principal(), 10);
        assert_eq!(Config::default().grpc.watchers_per_principal(), 4096);
        std::fs::write(&file, "[grpc]\nmax_streams = 1\n").unwrap();
        assert!(Config::from_file(&file).unwrap_err().to_string().contains("max_streams"));
    }

    /// The error `text` (a config file) is refused with at validation.
    fn refusal(text: &str) -> Option<String> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("corral.toml");
        std::fs::write(&file, text).unwrap();
        Config::from_file(&file).unwrap().validate().err().map(|e| e.to_string())
    }

    /// In milliseconds they are added to Unix times or `Instant`s: i64::MAX
    /// seconds would wrap (a retention cutoff in the future compacts every
    /// run's events) or panic.
    #[test]
    fn a_principals_share_of_a_repositorys_refs_is_a_quarter_by_default_and_never_zero() {
        let mut git = GitConfig::default();
        assert_eq!(git.capture_refs_per_principal(), 250);
        git.max_capture_refs = 2;
        assert_eq!(git.capture_refs_per_principal(), 1, "at least one");
        git.max_capture_refs_per_principal = Some(7);
        assert_eq!(git.capture_refs_per_principal(), 7);
        let err = refusal("[git]\nmax_capture_refs_per_principal = 0\n").expect("refused");
        assert!(err.contains("git.max_capture_refs_per_principal: must be at least 1"), "{err}");
    }

    #[test]
    fn a_principals_share_of_the_queue_is_a_quarter_by_default_and_never_zero() {
        let mut fleet = FleetConfig::default();
        assert_eq!(fleet.queued_per_principal(), 250);
        fleet.max_queued = 3;
        assert_eq!(fleet.queued_per_principal(), 1, "at least one");
        let text = "[fleet]\nmax_queued_per_principal = 0\n";
        let config: Config = toml::from_str(text).unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("fleet.max_queued_per_principal: must be at least 1"), "{err}");
    }

    #[test]
    fn seconds_keys_are_at_most_ten_years_naming_the_key() {
        let cases = [
            ("event_retention_seconds", "event_retention_seconds = {}\n"),
            ("fleet.lease_seconds", "[fleet]\nlease_seconds = {}\n"),
            ("grpc.keepalive_interval_seconds", "[grpc]\nkeepalive_interval_seconds = {}\n"),
            ("grpc.keepalive_timeout_seconds", "[grpc]\nkeepalive_timeout_seconds = {}\n"),
        ];
        let got: Vec<_> = cases.iter().map(|(_, text)| refusal(&text.replace("{}", "9223372036854775807"))).collect();
        let want: Vec<_> = cases
            .iter()
            .map(|(key, _)| Some(format!("config key {key}: 9223372036854775807 is more than 315360000 (ten years)")))
            .collect();
        assert_eq!(got, want);
        for (key, text) in cases {
            assert_eq!(refusal(&text.replace("{}", &crate::hub::MAX_WAIT_SECONDS.to_string())), None, "{key}");
        }
    }

    /// The name the node is known by passes DrainNode's check whichever key
    /// gives it, counted in characters.
    #[test]
    fn the_node_name_is_checked_whichever_key_gives_it() {
        let rule = "must be 1-200 characters, none of them control characters";
        for bad in [String::new(), "n".repeat(201), "node\nb".into(), "é".repeat(201)] {
            let err = refusal(&format!("node_id = {bad:?}\n")).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(err, format!("config key node_id: {rule}"), "{bad:?}");
            let err = refusal(&format!("[fleet]\nnode = {bad:?}\n")).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(err, format!("config key fleet.node: {rule}"), "{bad:?}");
        }
        for good in ["node-a".to_string(), "n".repeat(200), "é".repeat(200)] {
            assert_eq!(refusal(&format!("node_id = {good:?}\n")), None);
            assert_eq!(refusal(&format!("[fleet]\nnode = {good:?}\n")), None);
        }
        // Beside `[fleet] node` it would be ignored.
        let err = refusal("node_id = \"a\"\n[fleet]\nnode = \"b\"\n").unwrap();
        assert_eq!(err, "config key node_id: set at most one of node_id and fleet.node");
        // Neither set: the default name (host and data directory) is checked.
        let long = Config { data_dir: PathBuf::from(format!("/{}", "d".repeat(200))), ..Config::default() };
        let err = long.validate().unwrap_err().to_string();
        assert!(err.starts_with("config key fleet.node: unset, this node is named"), "{err}");
        let named = Config { node_id: Some("n".into()), ..long };
        assert!(named.validate().is_ok());
    }

    #[test]
    fn a_metrics_token_without_a_listener_is_refused() {
        let err = refusal("metrics_token_file = \"/etc/corral/metrics.token\"\n").unwrap();
        assert_eq!(err, "config key metrics_token_file: there is no metrics listener for it: set metrics_listen");
    }

    /// `unix_uids` without a socket and `tls_names` without `client_ca`
    /// would load and never identify anyone.
    #[test]
    fn principal_credentials_no_listener_presents_are_refused() {
        let principal = "[[principals]]\nname = \"ci\"\ntype = \"agt\"\nprojects = [\"p\"]\n";
        let tls = "tls_cert = \"/c.pem\"\ntls_key = \"/c.key\"\n";
        let err = refusal(&format!("{tls}{principal}tls_names = [\"ci\"]\n")).unwrap();
        assert!(err.starts_with("config key principals[0].tls_names: client certificates are not asked for"), "{err}");
        assert_eq!(refusal(&format!("{tls}client_ca = \"/ca.pem\"\n{principal}tls_names = [\"ci\"]\n")), None);
        let err = refusal(&format!("unix_socket = \"\"\n{principal}unix_uids = [1001]\n")).unwrap();
        assert!(err.starts_with("config key principals[0].unix_uids: no unix socket is served"), "{err}");
        assert_eq!(refusal(&format!("{principal}unix_uids = [1001]\n")), None, "the default socket");
        // The same in a principals_dir file, naming it.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ci.toml");
        std::fs::write(&file, format!("{}tls_names = [\"ci\"]\n", principal.trim_start_matches("[[principals]]\n")))
            .unwrap();
        let err = refusal(&format!("principals_dir = {:?}\n", dir.path().display().to_string())).unwrap();
        assert!(err.starts_with(&format!("config key {}.tls_names:", file.display())), "{err}");
    }

    #[test]
    fn default_limits_are_read_key_by_key_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("limits.toml");
        std::fs::write(&file, "[default_limits]\nmax_processes = 40\nmemory_bytes = 0\n").unwrap();
        let config = Config::from_file(&file).unwrap();
        config.validate().unwrap();
        let want = crate::catalog::Limits { max_processes: 40, memory_bytes: 0, ..crate::catalog::Limits::default() };
        assert_eq!(config.default_limits, want);
        std::fs::write(&file, "[default_limits]\nshm_bytes = 0\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("default_limits.shm_bytes"), "{err}");
        // A quota below what a cgroup takes would fail every run at sandbox_create.
        std::fs::write(&file, "[default_limits]\ncpu_millis = 9\n").unwrap();
        let err = Config::from_file(&file).unwrap().validate().unwrap_err().to_string();
        assert!(err.contains("default_limits.cpu_millis") && err.contains("9 is below"), "{err}");
        std::fs::write(&file, "[default_limits]\ncpu_millis = 10\n").unwrap();
        Config::from_file(&file).unwrap().validate().unwrap();
        std::fs::write(&file, "[default_limits]\nmax_procs = 1\n").unwrap();
        assert!(Config::from_file(&file).unwrap_err().to_string().contains("max_procs"));
    }
}

/// The `[fleet]` section.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// This node's name in the store (default: `node_id`, else the host
    /// name and data directory): 1-200 characters, none of them control
    /// characters, as `DrainNode` accepts; checked whichever it comes from.
    pub node: Option<String>,
    /// How long a node's lease lasts without renewal (seconds, 1 to ten
    /// years). A node is declared lost this long after its last renewal; it
    /// fences itself after two thirds of it.
    pub lease_seconds: u64,
    /// Executions this node runs at once (default: `max_running_executions`,
    /// which it may not exceed). `0`: a front end, which accepts work and
    /// queues it for the other nodes (a shared store only).
    pub capacity: Option<usize>,
    /// The most executions the fleet's queue holds (shared stores); a
    /// submit beyond it is refused with RESOURCE_EXHAUSTED.
    pub max_queued: u64,
    /// The most of them one principal may have queued (default: a quarter
    /// of `max_queued`, at least 1): one tenant cannot fill the queue for
    /// every other.
    pub max_queued_per_principal: Option<u64>,
    /// Labels of this node besides the ones it finds itself (its backend
    /// and agent CLIs): a profile's `[placement] labels` must all be here.
    pub labels: Vec<String>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            node: None,
            lease_seconds: 10,
            capacity: None,
            max_queued: 1000,
            max_queued_per_principal: None,
            labels: Vec::new(),
        }
    }
}

impl FleetConfig {
    /// The most executions one principal may have in the fleet's queue.
    pub fn queued_per_principal(&self) -> u64 {
        self.max_queued_per_principal.unwrap_or((self.max_queued / 4).max(1))
    }

    /// Executions this node runs at once (see `capacity`).
    pub fn capacity(&self, max_running_executions: usize) -> usize {
        self.capacity.unwrap_or(max_running_executions)
    }

    /// The lease, once checked (`lease_seconds` ≥ 1).
    pub fn lease(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.lease_seconds.max(1))
    }
}
