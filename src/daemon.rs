//! Assembling a daemon from its config: store, catalog, host probe, gate,
//! engine. Tests use the same path with fault-injecting backends or reins.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ApiParts, ServeError};
use crate::catalog::{Catalog, CatalogError};
use crate::config::Config;
use crate::hub::Hub;
use crate::lifecycle::{Engine, EngineParts};
use crate::policy::{compile_all, Gate, HostCapabilities};
use crate::rein::{CommandRein, Rein};
use crate::sandbox::{Backends, UidMode, UidRange};
use crate::store::{Store, StoreError};

/// Why the daemon could not start or serve. Each message names what to fix: a
/// path, a config key, a profile.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The data directory could not be created, restricted or used (also a TLS
    /// file that could not be read, named by its key).
    #[error("data directory {path}: {source}")]
    DataDir {
        /// The directory (or the TLS key) concerned.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The store could not be opened or migrated.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A harness profile could not be loaded.
    #[error("profiles: {0}")]
    Catalog(#[from] CatalogError),
    /// A config value was refused when the daemon was built or served
    /// (policies, sandbox uids, file descriptors, principals, metrics); the
    /// message starts with the key.
    #[error("config key {0}")]
    Policies(String),
    /// Recovering what a previous instance left behind failed.
    #[error("recovery: {0}")]
    Recovery(String),
    /// The sandbox uid range could not be claimed: the message names the live
    /// daemon whose range overlaps, or what failed.
    #[error("{0}")]
    UidRange(String),
    /// The gRPC server could not be set up or failed while serving.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// The node lost its lease and killed its sandboxes (see `fleet`).
    #[error("fenced: this node lost its lease and killed its sandboxes; start it again to rejoin with a new epoch")]
    Fenced,
}

/// A daemon built from its config, ready to serve: its engine (recovered
/// already), its catalog, its gate and its callers.
pub struct Daemon {
    /// Who may call; replaced whole by [`reload_principals`] (SIGHUP).
    pub authenticator: Arc<crate::auth::Principals>,
    /// The key that signs and checks page tokens, kept in the data directory so
    /// tokens survive a restart.
    pub page_tokens: Arc<crate::api::page::PageTokens>,
    /// The config the daemon was built from.
    pub config: Config,
    /// The lifecycle engine.
    pub engine: Arc<Engine>,
    /// The harness profiles.
    pub catalog: Arc<Catalog>,
    /// The policy gate.
    pub gate: Arc<Gate>,
    /// This daemon's host-wide claim on its sandbox uid range (root only),
    /// held until the daemon is dropped.
    pub uid_lock: Option<crate::sandbox::uid_lock::UidRangeLock>,
    /// This daemon's claim on its data directory, held until it is dropped.
    pub data_dir_lock: DataDirLock,
    /// Stops the metrics listener (`metrics_listen`) when dropped: it is
    /// bound before recovery, and serves until [`Daemon::serve`] returns.
    metrics: Option<tokio_util::sync::DropGuard>,
}

/// One daemon per data directory: an exclusive `flock(2)` on
/// `<data_dir>/daemon.lock` (naming the daemon's pid), held for the daemon's
/// life. The kernel drops it when the daemon dies, even by SIGKILL. So the
/// directory's SQLite store, its sandboxes and what recovery finds there
/// are one daemon's at a time.
#[derive(Debug)]
pub struct DataDirLock {
    /// Holds the flock; never read.
    _file: std::fs::File,
}

impl DataDirLock {
    /// Claims `data_dir`, or says which running daemon holds it.
    async fn claim(data_dir: &std::path::Path) -> Result<DataDirLock, StartError> {
        use std::io::{Read, Write};
        use std::os::unix::fs::OpenOptionsExt;
        let path = data_dir.join("daemon.lock");
        let failed = |source| StartError::DataDir { path: path.display().to_string(), source };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(failed)?;
        // A holder whose named daemon is gone is a process that daemon
        // started, on its way to `execve` (which closes its copy of the
        // lock): waited for, up to 3 s, so a restart right after a SIGKILL
        // is not refused.
        let mut waited = 0;
        while !crate::sandbox::uid_lock::flock_exclusive(&file, false).map_err(failed)? {
            let mut holder = String::new();
            let _ = std::fs::File::open(&path).and_then(|f| f.take(256).read_to_string(&mut holder));
            let named = holder.strip_prefix("pid ").and_then(|p| p.trim().parse::<libc::pid_t>().ok());
            let gone = named.is_some_and(|pid| {
                // Our own pid names a daemon before this one (a container
                // gives its daemon the same pid at each start).
                // SAFETY: kill with signal 0 sends nothing: it asks whether the pid exists.
                pid > 0
                    && (pid as u32 == std::process::id()
                        || (unsafe { libc::kill(pid, 0) } != 0
                            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)))
            });
            if gone && waited < 60 {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                waited += 1;
                continue;
            }
            let holder = holder.split_whitespace().collect::<Vec<_>>().join(" ");
            let holder = if holder.is_empty() { "unknown pid".to_string() } else { holder };
            let why = if gone {
                format!(
                    "its daemon ({holder}) is gone, but a process it started still holds the lock {} after 3 s: \
                     stop that process (fuser {0})",
                    path.display()
                )
            } else {
                format!(
                    "in use by a running daemon ({holder}; lock {}): one daemon per data directory; give this one \
                     its own --data-dir",
                    path.display()
                )
            };
            return Err(StartError::DataDir {
                path: data_dir.display().to_string(),
                source: std::io::Error::other(why),
            });
        }
        file.set_len(0).map_err(failed)?;
        file.write_all(format!("pid {}\n", std::process::id()).as_bytes()).map_err(failed)?;
        Ok(DataDirLock { _file: file })
    }
}

/// The reins a daemon ships with.
pub fn default_reins() -> HashMap<String, Arc<dyn Rein>> {
    let mut reins: HashMap<String, Arc<dyn Rein>> = HashMap::new();
    reins.insert("command".into(), Arc::new(CommandRein));
    reins
}

impl Daemon {
    /// Builds the daemon: prepares and claims the data directory, opens the
    /// store, loads the profiles, probes the host, claims the uid range, joins
    /// the fleet, starts the metrics listener (if configured), recovers what
    /// a previous instance left, and starts the hub, the reaper and the
    /// compactor. The API is not served yet.
    pub async fn build(
        config: Config,
        backends: Backends,
        reins: HashMap<String, Arc<dyn Rein>>,
    ) -> Result<Daemon, StartError> {
        let data_dir = &config.data_dir;
        prepare_data_dir(data_dir)
            .map_err(|source| StartError::DataDir { path: data_dir.display().to_string(), source })?;
        // Before its SQLite store is opened (and migrated): a second daemon
        // on this data directory refuses to start having changed nothing.
        let data_dir_lock = DataDirLock::claim(data_dir).await?;
        let store = Store::open(data_dir, config.store.url.as_deref(), &config.node()).await?;
        restrict_store_files(data_dir)
            .map_err(|source| StartError::DataDir { path: data_dir.display().to_string(), source })?;
        let routes: Vec<&str> = config.credentials.names().collect();
        let catalog =
            Arc::new(Catalog::load_with(&config.profile_dirs, &routes, &config.harness, &config.default_limits)?);
        check_env_passthrough(&config, &catalog)?;
        let uid_mode = UidMode::detect(UidRange::parse(&config.sandbox.uids).map_err(StartError::Policies)?);
        // Probed once: a host that cannot run bwrap refuses bwrap profiles
        // at the gate, with the reason, instead of running them unsandboxed.
        let bwrap = backends.linux_bwrap.probe().await.map_err(|e| e.to_string());
        let labels = crate::fleet::labels(bwrap.is_ok(), &config.fleet.labels);
        check_warm_pools(&config, &catalog, &bwrap, &labels, &uid_mode).map_err(StartError::Policies)?;
        // Before anything is written that a live neighbour uses (up to here
        // only the schema's idempotent migrations): a daemon whose uid range
        // overlaps a live one's refuses to start having changed nothing.
        // Joining the fleet gives the node a new epoch, which fences the
        // start that holds it (a daemon with the same node name); recovery
        // kills what runs under the range's uids.
        let uid_lock = match uid_mode {
            UidMode::PerSandbox(range) => Some(
                crate::sandbox::uid_lock::claim(&config.sandbox.lock_dir, range, data_dir)
                    .map_err(StartError::UidRange)?,
            ),
            UidMode::Daemon { .. } => None,
        };
        let lease_ms = config.fleet.lease().as_millis() as i64;
        let capacity = config.fleet.capacity(config.max_running_executions);
        // A node of the fleet from here on: every write of a run checks
        // this start's epoch against the node's row. The lease runs from
        // no earlier than the join was sent.
        let joined = std::time::Instant::now();
        store.join_fleet(capacity as u64, &labels, lease_ms).await?;
        let host = HostCapabilities {
            bwrap,
            linux_bwrap: backends.linux_bwrap.capabilities(),
            none: backends.none.capabilities(),
            seccomp: crate::sandbox::seccomp::sandbox_filter()
                .map(|f| f.digest().to_string())
                .map_err(|e| e.to_string()),
            sandbox_uids: match uid_mode {
                UidMode::PerSandbox(_) => Ok("one host uid per sandbox".to_string()),
                UidMode::Daemon { uid, .. } => Err(format!("the daemon runs as uid {uid}: sandboxes share it")),
            },
        };
        if let UidMode::PerSandbox(_) = uid_mode {
            reachable_by_sandboxes(&data_dir.join("sandboxes")).map_err(|message| StartError::DataDir {
                path: data_dir.display().to_string(),
                source: std::io::Error::other(message),
            })?;
        }
        log_capabilities(&host, &uid_mode);
        let nofile = crate::fdlimit::raise_nofile();
        let max_connections = crate::fdlimit::proxy_connections(&config, nofile).map_err(StartError::Policies)?;
        tracing::info!(nofile, proxy_max_connections = max_connections, "file descriptors");
        let proxy_budget = crate::net::ProxyBudget::new(
            max_connections,
            config.proxy.max_connections_per_principal,
            Duration::from_secs(config.proxy.idle_timeout_seconds),
        );
        let admin = compile_all(&config.policies, "admin", "policies").map_err(StartError::Policies)?;
        let gate = Arc::new(Gate::new(admin, host));
        let hub = config.hub.clone().map(|hub| Hub::new(hub, store.clone()));
        let authenticator = Arc::new(crate::auth::Principals::new(authenticator(&config)?));
        let engine = Engine::new(EngineParts {
            catalog: catalog.clone(),
            gate: gate.clone(),
            backends,
            reins,
            store,
            data_dir: data_dir.clone(),
            bus_capacity: config.watch_buffer,
            hub: hub.clone(),
            credentials: Arc::new(config.credentials.clone()),
            max_running: config.max_running_executions,
            max_sessions: config.max_running_sessions,
            watch_bounds: crate::lifecycle::WatchBounds {
                per_subject: config.grpc.max_watchers_per_subject,
                per_principal: config.grpc.watchers_per_principal(),
                total: config.grpc.max_watchers,
            },
            max_message_bytes: config.grpc.max_send_message_bytes,
            git: config.git.clone(),
            proxy_budget,
            hook_program: config.gate.hook_program(),
            capacity,
            labels,
            max_queued: (config.fleet.max_queued, config.fleet.queued_per_principal()),
            warm: config.sandbox.warm.clone(),
            repo_roots: config.repo_roots.clone(),
            principals: authenticator.clone(),
            uid_range: match uid_mode {
                UidMode::PerSandbox(range) => Some(range),
                UidMode::Daemon { .. } => None,
            },
        });
        // The join is this start's first renewal: it takes work from now.
        engine.lease_holds_until(joined + crate::fleet::lease::takes_work_for(config.fleet.lease()));
        // Before recovery, so the runs it finishes are counted: the
        // recorder is installed with the listener.
        let metrics = match &config.metrics_listen {
            Some(addr) => {
                let stop = serve_metrics(&config, addr).await?;
                engine.list_warm_metrics();
                Some(stop)
            }
            None => None,
        };
        // Before serving: nothing a crashed predecessor left may linger.
        engine.recover().await.map_err(|e| StartError::Recovery(e.to_string()))?;
        if let Some(hub) = &hub {
            // After recovery, so reports of recovered executions go too.
            hub.spawn();
        }
        engine.spawn_reaper(Duration::from_secs(config.session_idle_seconds));
        // After recovery: its uids and rows are the new epoch's.
        engine.start_warm_pools();
        let retention = Duration::from_secs(config.event_retention_seconds);
        engine.spawn_compactor(retention, (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(3600)));
        // Kept in the data directory, so page tokens survive a restart; on
        // a shared store, one key for the fleet, so a page from one node
        // works on every node.
        let page_tokens = if engine.store.is_shared() {
            let key = engine.store.fleet_secret("page_token_key", crate::api::page::PageTokens::new_key_hex).await?;
            crate::api::page::PageTokens::from_key_hex(&key).map_err(StartError::Policies)?
        } else {
            crate::api::page::PageTokens::load_or_create(&data_dir.join("page-token.key"))
                .map_err(|source| StartError::DataDir { path: data_dir.display().to_string(), source })?
        };
        Ok(Daemon {
            metrics,
            authenticator,
            page_tokens: Arc::new(page_tokens),
            config,
            engine,
            catalog,
            gate,
            uid_lock,
            data_dir_lock,
        })
    }

    /// Serves the gRPC API on `listener` until `shutdown` is cancelled, then
    /// drains: in-flight executions get the shutdown grace, then are
    /// cancelled and torn down. The metrics endpoint, if configured, is
    /// served until this returns.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<(), StartError> {
        // The uid range and the data directory stay claimed while the
        // daemon serves.
        let _uid_lock = self.uid_lock;
        let _data_dir_lock = self.data_dir_lock;
        let group = match &self.config.unix_socket_group {
            Some(group) => Some(group_id(group).map_err(StartError::Policies)?),
            None => None,
        };
        let tls = tls_config(&self.config).map_err(|(key, source)| StartError::DataDir { path: key, source })?;
        // Scrapes are answered until the drain is over.
        let _metrics = self.metrics;
        let fenced = CancellationToken::new();
        // Not `shutdown`: the lease is renewed while the runs end in their
        // grace, until the node has left the fleet (`Engine::shutdown`).
        let left = CancellationToken::new();
        let _stop_renewing = left.clone().drop_guard();
        crate::fleet::spawn(
            self.engine.clone(),
            self.config.fleet.lease(),
            shutdown.clone(),
            left.clone(),
            fenced.clone(),
        );
        crate::fleet::serve_notifications(self.engine.clone(), shutdown.clone());
        if self.engine.store.is_shared() {
            crate::fleet::spawn_claimer(self.engine.clone(), shutdown.clone());
        }
        let parts = ApiParts {
            tls,
            authenticator: self.authenticator,
            unix_socket: self.config.unix_socket_path().map(|p| (p, group)),
            engine: self.engine,
            catalog: self.catalog,
            gate: self.gate,
            repo_roots: self.config.repo_roots.clone(),
            shutdown_grace: Duration::from_secs(self.config.shutdown_grace_seconds),
            grpc: self.config.grpc.clone(),
            page_tokens: self.page_tokens,
        };
        // A fenced node's sandboxes are dead already; what is left of its
        // runs (their teardown, their last writes) may wait on a store it
        // cannot reach (a partition drops no connection, it stalls them):
        // it exits after a short grace instead of waiting on them, and its
        // next start recovers what they left.
        let fence_exit = async {
            fenced.cancelled().await;
            tokio::time::sleep(FENCE_EXIT_GRACE).await;
        };
        tokio::select! {
            served = api::serve(parts, listener, shutdown) => served?,
            () = fence_exit => tracing::error!(
                grace_ms = FENCE_EXIT_GRACE.as_millis() as u64,
                "fleet: fenced; exiting without waiting for the rest of the shutdown"
            ),
        }
        if fenced.is_cancelled() {
            return Err(StartError::Fenced);
        }
        Ok(())
    }
}

/// Binds `metrics_listen` and serves scrapes (which installs the metrics
/// recorder) until the returned guard is dropped.
async fn serve_metrics(config: &Config, addr: &str) -> Result<tokio_util::sync::DropGuard, StartError> {
    let addr = addr.parse().map_err(|e| StartError::Policies(format!("metrics_listen {addr:?}: {e}")))?;
    let token = match &config.metrics_token_file {
        Some(file) => Some(crate::metrics_http::load_token(file).map_err(StartError::Policies)?),
        None => None,
    };
    let stop = CancellationToken::new();
    crate::metrics_http::serve(addr, token, stop.clone()).await.map_err(StartError::Policies)?;
    Ok(stop.drop_guard())
}

/// How long a fenced node's shutdown may take before it exits regardless.
const FENCE_EXIT_GRACE: Duration = Duration::from_secs(2);

/// A profile whose `sandbox.env_passthrough` names a credential route's
/// variable would put the daemon's value of it (a key) in the sandbox's
/// environment: refused at start, naming the profile's file
/// ([`crate::credentials::CredentialsConfig::check_env_passthrough`]).
pub fn check_env_passthrough(config: &Config, catalog: &Catalog) -> Result<(), CatalogError> {
    for profile in catalog.list() {
        config
            .credentials
            .check_env_passthrough(&profile.file.sandbox.env_passthrough)
            .map_err(|message| CatalogError::Invalid { file: profile.source.clone(), message })?;
    }
    Ok(())
}

/// Reads the principals of `config` again (its `principals` and
/// `principals_dir`, the local admin token) and makes them current: calls
/// from now on are identified with them, running work is untouched. On an
/// error nothing changes, and the error names the key or file.
pub fn reload_principals(principals: &crate::auth::Principals, config: &Config) -> Result<usize, StartError> {
    let authenticator = authenticator(config)?;
    let count = authenticator.principal_count();
    principals.replace(authenticator);
    Ok(count)
}

/// The principals of the config, the local admin token, and root and the
/// daemon's own uid as the local administrator on the unix socket.
fn authenticator(config: &Config) -> Result<crate::auth::Authenticator, StartError> {
    let env = |name: &str| std::env::var(name).ok();
    let loaded = crate::auth::load_principals(&config.principals, config.principals_dir.as_deref(), &env)
        .map_err(StartError::Policies)?;
    let token = crate::auth::local_admin_token(&config.data_dir.join("admin.token"))
        .map_err(|source| StartError::DataDir { path: config.data_dir.display().to_string(), source })?;
    let mut local = vec![0];
    local.push(crate::sandbox::host::effective_uid());
    Ok(crate::auth::Authenticator::new(loaded, Some(token), &local))
}

/// The TCP listener's TLS from `tls_cert`, `tls_key` and `client_ca`
/// (HTTP/2 only, by ALPN); errors name the key and the file.
pub(crate) fn tls_config(config: &Config) -> Result<Option<tokio_rustls::TlsAcceptor>, (String, std::io::Error)> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else { return Ok(None) };
    let client_ca = config.client_ca.as_deref();
    fn bad(name: &str, path: &std::path::Path, e: impl std::fmt::Display) -> (String, std::io::Error) {
        (format!("{name} {}", path.display()), std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
    }
    let read =
        |name: &str, path: &std::path::Path| std::fs::read(path).map_err(|e| (format!("{name} {}", path.display()), e));
    let chain: Vec<_> = CertificateDer::pem_slice_iter(&read("tls_cert", cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| bad("tls_cert", cert, e))?;
    if chain.is_empty() {
        return Err(bad("tls_cert", cert, "no certificate in the file"));
    }
    let private = PrivateKeyDer::from_pem_slice(&read("tls_key", key)?).map_err(|e| bad("tls_key", key, e))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("tls_cert", cert, e))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let invalid =
                |e: String| ("client_ca".to_string(), std::io::Error::new(std::io::ErrorKind::InvalidData, e));
            let roots = crate::net::client::roots(ca).map_err(invalid)?;
            // Optional: a client without a certificate may still present a
            // bearer token; one with a certificate from another CA fails the
            // handshake.
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| bad("client_ca", ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut tls = builder.with_single_cert(chain, private).map_err(|e| bad("tls_key", key, e))?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Some(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(tls))))
}

/// A group name or number as a gid.
fn group_id(group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let text = std::fs::read_to_string("/etc/group").map_err(|e| format!("unix_socket_group: /etc/group: {e}"))?;
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            Some((f.next()?, f.nth(1)?))
        })
        .find(|(name, _)| *name == group)
        .and_then(|(_, gid)| gid.parse().ok())
        .ok_or_else(|| format!("unix_socket_group: no group {group:?}"))
}

/// Refuses a warm pool the daemon could not keep: a profile that does not
/// resolve, cannot start ahead, runs on other nodes, or is pooled twice
/// (two references to one version), a host without bwrap, or a root
/// daemon whose `[sandbox] uids` are fewer than the sandboxes it may hold.
/// (A pool that was accepted and never filled, or never taken from, would
/// be a promise not kept.)
pub(crate) fn check_warm_pools(
    config: &Config,
    catalog: &Catalog,
    bwrap: &Result<(), String>,
    labels: &[String],
    uid_mode: &UidMode,
) -> Result<(), String> {
    let warm = &config.sandbox.warm;
    // Within admission: the pools together are no bigger than what this
    // node runs at once (a front end, fleet.capacity = 0, runs none: its
    // pool would never be taken). While it runs, a filler keeps running
    // executions and warm sandboxes within the same bound (`lifecycle::warm`).
    let total = config.sandbox.warm_total();
    let room = config.fleet.capacity(config.max_running_executions).min(config.max_running_executions);
    if total > room {
        return Err(format!(
            "sandbox.warm: {total} warm sandboxes in all is more than this node runs at once ({room}: \
             fleet.capacity, else max_running_executions)"
        ));
    }
    // Each sandbox of a root daemon holds a uid of its own while it lives:
    // the waiting ones too, and runs admitted while the pools are full
    // (cold ones, of other profiles) find the rest. Fewer uids than that,
    // and every run past them fails for want of one.
    if let (UidMode::PerSandbox(range), true) = (uid_mode, total > 0) {
        let uids = (range.last - range.first) as usize + 1;
        let sessions = config.max_running_sessions;
        let need = total + room + sessions;
        if uids < need {
            return Err(format!(
                "sandbox.uids: {}-{} is {uids} uid{}, fewer than the {need} sandboxes this node may hold at \
                 once, each with a uid of its own: {total} warm (sandbox.warm), {room} executions \
                 (fleet.capacity, else max_running_executions) and {sessions} sessions (max_running_sessions)",
                range.first,
                range.last,
                if uids == 1 { "" } else { "s" },
            ));
        }
    }
    if total > 0 {
        let Some(corral) = config.gate.hook_program() else {
            return Err("sandbox.warm: a warm sandbox's first process is the waiter installed beside the corral \
                        binary, and this daemon is not running as one: set gate.hook_program to its path"
                .into());
        };
        let waiter = crate::sandbox::waiter::beside(&corral);
        if !waiter.is_file() {
            return Err(format!(
                "sandbox.warm: a warm sandbox's first process is {}, which is not there: install it beside {} \
                 (`cargo build --release` builds both)",
                waiter.display(),
                corral.display()
            ));
        }
    }
    // The profile version each pool is made for, by digest: a run takes
    // from the first pool of its version only.
    let mut versions: Vec<(String, &String)> = Vec::new();
    for (profile_ref, size) in warm.iter().filter(|(_, size)| **size > 0) {
        let key = format!("sandbox.warm.{profile_ref:?}");
        let profile = catalog.resolve(profile_ref).map_err(|refusal| format!("{key}: {}", refusal.0))?;
        if let Some((_, other)) = versions.iter().find(|(digest, _)| *digest == profile.digest) {
            return Err(format!(
                "{key}: sandbox.warm.{other:?} and sandbox.warm.{profile_ref:?} are both profile {}: a run would \
                 take from one pool only; keep one entry",
                profile.reference()
            ));
        }
        versions.push((profile.digest.clone(), profile_ref));
        if let Some(why) = crate::lifecycle::unpoolable(&profile) {
            return Err(format!("{key}: profile {} cannot have a warm pool: {why}", profile.reference()));
        }
        // A run of a profile this node may not run goes to another node
        // (or is refused): a pool of it here would never be taken.
        let missing = crate::lifecycle::missing_labels(&profile, labels);
        if !missing.is_empty() {
            return Err(format!(
                "{key}: profile {} runs only on nodes labelled {}; this node is not (it has: {}), so no run \
                 would take its warm sandboxes",
                profile.reference(),
                missing.join(", "),
                labels.join(", ")
            ));
        }
        // A run of it would be refused at resolution, and every fill with it.
        let refs = &profile.file.credential_route_refs;
        if let Err(why) = config.credentials.check_exposure(refs, &profile.file.rein) {
            return Err(format!("{key}: profile {} cannot run: {why}", profile.reference()));
        }
        if let Err(why) = bwrap {
            return Err(format!("{key}: {size} warm linux_bwrap sandboxes cannot be made on this host: {why}"));
        }
    }
    Ok(())
}

/// The data directory is root's (0711: sandboxes' uids may traverse it to
/// reach their own workspace, never list or read it), and so is its
/// `sandboxes` directory.
fn prepare_data_dir(data_dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let sandboxes = data_dir.join("sandboxes");
    std::fs::create_dir_all(&sandboxes)?;
    for dir in [data_dir, &sandboxes] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(())
}

/// bwrap runs as each sandbox's own uid and must reach its workspace: every
/// directory above `sandboxes` must let others traverse it (x, not r).
fn reachable_by_sandboxes(sandboxes: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let canonical = sandboxes.canonicalize().map_err(|e| format!("{}: {e}", sandboxes.display()))?;
    for dir in canonical.ancestors() {
        let mode = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?.permissions().mode();
        if mode & 0o001 == 0 {
            return Err(format!(
                "{} (mode {:o}) cannot be traversed by sandbox uids; make it traversable (chmod o+x) or choose a data directory below traversable ones, e.g. /var/lib/corral",
                dir.display(),
                mode & 0o7777
            ));
        }
    }
    Ok(())
}

/// The SQLite files are readable by the daemon alone.
fn restrict_store_files(data_dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for name in ["corral.db", "corral.db-wal", "corral.db-shm"] {
        match std::fs::set_permissions(data_dir.join(name), std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// What this host can enforce, once at start.
fn log_capabilities(host: &HostCapabilities, uid_mode: &UidMode) {
    match &host.bwrap {
        Ok(()) => tracing::info!("linux_bwrap: available"),
        Err(reason) => tracing::warn!(%reason, "linux_bwrap is unavailable; profiles that need it will be refused"),
    }
    tracing::info!(sandbox_uids = %uid_mode.describe(), "sandbox identity");
    let caps = &host.linux_bwrap;
    for (name, support) in [("memory", &caps.memory), ("pids", &caps.pids), ("cpu", &caps.cpu), ("kill", &caps.kill)] {
        match support {
            Ok(mechanism) => tracing::info!(limit = name, %mechanism, "enforceable"),
            Err(reason) => tracing::warn!(limit = name, %reason, "not enforceable; profiles that set it are refused"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that was a process and is no more: a child, reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        child.id()
    }

    /// Holds `dir`'s lock from another open of the file (a process the
    /// named daemon started), with `pid` written in it.
    fn hold(dir: &std::path::Path, pid: u32) -> std::fs::File {
        let path = dir.join("daemon.lock");
        std::fs::write(&path, format!("pid {pid}\n")).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        assert!(crate::sandbox::uid_lock::flock_exclusive(&file, false).unwrap());
        file
    }

    #[tokio::test]
    async fn a_lock_left_by_a_gone_daemons_child_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let held = hold(dir.path(), dead_pid());
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        });
        let claimed = DataDirLock::claim(dir.path()).await;
        release.join().unwrap();
        assert!(claimed.is_ok(), "{claimed:?}");
        let text = std::fs::read_to_string(dir.path().join("daemon.lock")).unwrap();
        assert_eq!(text, format!("pid {}\n", std::process::id()));
    }

    #[tokio::test]
    async fn a_lock_held_by_a_live_daemon_or_too_long_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut live = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let _held = hold(dir.path(), live.id());
        let started = std::time::Instant::now();
        let error = DataDirLock::claim(dir.path()).await.unwrap_err().to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "a live holder is not waited for");
        assert!(error.contains(&format!("in use by a running daemon (pid {};", live.id())), "{error}");
        live.kill().unwrap();
        live.wait().unwrap();
        drop(_held);

        // Gone, or this very pid (a container's daemon has the same one at
        // each start): waited for, then named as gone.
        for pid in [dead_pid(), std::process::id()] {
            let _held = hold(dir.path(), pid);
            let error = DataDirLock::claim(dir.path()).await.unwrap_err().to_string();
            let gone = format!("its daemon (pid {pid}) is gone, but a process it started still holds the lock");
            assert!(error.contains(&gone), "{error}");
        }
    }
}
