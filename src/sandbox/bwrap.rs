//! The `linux_bwrap` backend: bubblewrap started as the sandbox's own
//! unprivileged host uid, with every namespace unshared (an unprivileged
//! user namespace mapping it to a fixed inside uid), nested user namespaces
//! refused, a seccomp filter, a read-only system, a minimal /etc, fresh
//! /proc /dev and a sized /tmp, a neutral hostname, and only the workspace,
//! HOME and declared write paths writable.
//!
//! The command line reaches bwrap through `--args FD`, not argv: the
//! sandbox's pid 1 is a copy of bwrap, and its `/proc/1/cmdline` would
//! otherwise show the host's paths to the harness.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use super::boundary::{identity_files, Boundary, SandboxPaths};
use super::cgroup::CgroupHost;
use super::host::{effective_uid, INSIDE_UID};
use super::netns;
use super::process::{data_fd, spawn_group, HostUser, SpawnOptions};
use super::seccomp::{sandbox_filter, SeccompFilter};
use super::workspace::open_beneath;
use super::{
    base_env, Capabilities, CreateSandbox, EnforcementReceipt, ExecSpec, GateFile, GateMounts, GateSource, Sandbox,
    SandboxBackend, SandboxError, SandboxProcess, SandboxSpec, SandboxState, SandboxType, Tmpfs,
};
use crate::net::{self, Allowlist, EgressLog, ProxyConfig, ProxyHandle};

/// Where the workspace appears inside the sandbox.
pub const WORKSPACE_MOUNT: &str = "/workspace";
/// The harness's HOME inside the sandbox.
pub const HOME_MOUNT: &str = "/home/agent";
/// The hostname every sandbox has.
pub const HOSTNAME: &str = "corral";
/// The descriptors bwrap gets: its arguments, the seccomp program, the
/// sandbox's /etc/passwd and /etc/group, and for a sandbox that joins its
/// network namespace the info and block pipes (see [`super::netns`]);
/// then the hook files' contents, then the write paths it binds, then the
/// read paths.
const ARGS_FD: &str = "3";
const SECCOMP_FD: &str = "4";
const PASSWD_FD: &str = "5";
const GROUP_FD: &str = "6";
const INFO_FD: &str = "7";
const BLOCK_FD: &str = "8";

/// The few files of /etc a harness needs; `--ro-bind-try` skips the absent.
/// The CA certificates only: never `/etc/ssl/private`. passwd and group
/// are the sandbox's own (see [`identity_files`]).
const ETC_FILES: &[&str] = &[
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/alternatives",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
];

/// How the host lays out its top-level system directories (merged-/usr
/// hosts have symlinks where older ones have directories).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    /// Each top-level directory that exists on the host, and whether it is a
    /// symlink (recreated inside) or a directory (bound read-only).
    pub entries: Vec<(String, TopLevel)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopLevel {
    Symlink(String),
    Dir,
}

impl HostLayout {
    /// Reads this host's layout of `/bin`, `/sbin` and the `/lib*` directories.
    pub fn detect() -> Self {
        let mut entries = Vec::new();
        for dir in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
            let path = Path::new(dir);
            match std::fs::symlink_metadata(path) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(path) {
                        entries.push((dir.to_string(), TopLevel::Symlink(target.to_string_lossy().into_owned())));
                    }
                }
                Ok(meta) if meta.is_dir() => entries.push((dir.to_string(), TopLevel::Dir)),
                _ => {}
            }
        }
        HostLayout { entries }
    }

    /// A merged-/usr layout, as on current Debian.
    pub fn merged_usr() -> Self {
        HostLayout {
            entries: ["bin", "sbin", "lib", "lib64"]
                .iter()
                .map(|d| (format!("/{d}"), TopLevel::Symlink(format!("usr/{d}"))))
                .collect(),
        }
    }
}

/// The bwrap arguments for `spec` in the sandbox laid out at `paths`, up
/// to and including the `--` that precedes the harness argv. bwrap reads
/// them from fd 3 (`--args`) and the seccomp program from fd 4.
///
/// Pure, so it can be checked against exact vectors; environment values
/// never appear here.
pub fn bwrap_args(
    spec: &SandboxSpec,
    paths: &SandboxPaths,
    layout: &HostLayout,
    tmpfs: Tmpfs,
    gate: &GateMounts,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |parts: &[&str]| args.extend(parts.iter().map(OsString::from));
    let inside = INSIDE_UID.to_string();
    push(&["--unshare-all", "--unshare-user", "--disable-userns", "--uid", &inside, "--gid", &inside]);
    // The network namespace is always the sandbox's own (--unshare-all):
    // with network, egress goes through the daemon's proxy only; with a
    // hook, the gate's endpoint listens there too.
    if joins_netns(spec, gate) {
        push(&["--info-fd", INFO_FD, "--block-fd", BLOCK_FD]);
    }
    push(&["--hostname", HOSTNAME, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]);
    push(&["--ro-bind", "/usr", "/usr"]);
    for (dir, kind) in &layout.entries {
        match kind {
            TopLevel::Symlink(target) => push(&["--symlink", target, dir]),
            TopLevel::Dir => push(&["--ro-bind", dir, dir]),
        }
    }
    for file in ETC_FILES {
        push(&["--ro-bind-try", file, file]);
    }
    // Copied by bwrap from descriptors into its own tmpfs and bound
    // read-only: nothing of them is on the host's disk.
    push(&["--perms", "0644", "--ro-bind-data", PASSWD_FD, "/etc/passwd"]);
    push(&["--perms", "0644", "--ro-bind-data", GROUP_FD, "/etc/group"]);
    let (tmp, shm) = (tmpfs.tmp_bytes.to_string(), tmpfs.shm_bytes.to_string());
    // bwrap covers /proc/sys only where the caller could write it; sysctls
    // of the sandbox's own namespaces (IPC, UTS) can be, so bind it
    // read-only always.
    push(&["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]);
    // --dev mounts an unsized tmpfs on /dev/shm (half the host's RAM):
    // cover it with a sized one, like /tmp. /dev itself is a tmpfs too,
    // remounted read-only below.
    push(&["--dev", "/dev", "--size", &shm, "--tmpfs", "/dev/shm", "--size", &tmp, "--tmpfs", "/tmp"]);
    // Read paths likewise from descriptors opened with no symlink on the
    // way (see [`open_bound_paths`]): one an agent put in a directory it
    // could write would otherwise show another tenant's files.
    for (n, path) in (first_read_fd(spec, gate)..).zip(&spec.read_paths) {
        push(&["--ro-bind-fd", &n.to_string(), path]);
    }
    let ws = paths.workspace.to_string_lossy();
    let workspace_writable = spec.write_paths.iter().any(|p| p == ".");
    push(&[if workspace_writable { "--bind" } else { "--ro-bind" }, &ws, WORKSPACE_MOUNT]);
    // Write paths are bound from descriptors the daemon opened without
    // following a symlink (see [`open_bound_paths`]): bwrap resolves a path
    // source on the host, so a symlink the repository commits, or one an
    // earlier run's agent left in a host directory it could write, would
    // pick what becomes writable (another tenant's directory).
    let first = first_write_fd(spec, gate);
    for (n, path) in (first..).zip(bound_write_paths(spec)) {
        let inside = if Path::new(path).is_absolute() { path.to_string() } else { format!("{WORKSPACE_MOUNT}/{path}") };
        push(&["--bind-fd", &n.to_string(), &inside]);
    }
    push(&["--bind", &paths.home.to_string_lossy(), HOME_MOUNT]);
    // The agent's managed hook last, so no mount above can hide it or make
    // its directory writable: profile validation refuses read and write
    // paths over it, but a host path can still reach it through a symlink
    // on the host. Over a read-only bind its mount point cannot be made,
    // and bwrap fails: closed. Its settings are copied by bwrap from
    // descriptors, as the identity files are.
    let mut data = gate_data_fd(spec, gate);
    for file in &gate.files {
        match &file.source {
            GateSource::Host(host) => push(&["--ro-bind", &host.to_string_lossy(), &file.inside]),
            GateSource::Contents(_) => {
                push(&["--perms", "0444", "--ro-bind-data", &data.to_string(), &file.inside]);
                data += 1;
            }
        }
    }
    // bwrap's root and /dev are writable tmpfs; remounting them read-only
    // (each alone: the mounts on them keep their own flags) leaves only the
    // binds above (workspace, HOME, write paths), /tmp and /dev/shm
    // writable. Device nodes work on a read-only /dev. Last, so the binds
    // can still make their mount points.
    push(&["--remount-ro", "/dev", "--remount-ro", "/"]);
    push(&["--chdir", WORKSPACE_MOUNT, "--seccomp", SECCOMP_FD, "--"]);
    args
}

/// The write paths bwrap binds, in order: every absolute one (a host
/// directory), and the relative ones of a read-only workspace (a writable
/// one holds them already).
fn bound_write_paths(spec: &SandboxSpec) -> impl Iterator<Item = &str> {
    let workspace_writable = spec.write_paths.iter().any(|p| p == ".");
    spec.write_paths
        .iter()
        .map(String::as_str)
        .filter(move |p| p != &"." && (Path::new(p).is_absolute() || !workspace_writable))
}

/// The descriptor number bwrap finds the first hook file's contents at:
/// after its arguments, seccomp program and identity files, and its info
/// and block pipes when it joins the network namespace.
fn gate_data_fd(spec: &SandboxSpec, gate: &GateMounts) -> u32 {
    let last: &str = if joins_netns(spec, gate) { BLOCK_FD } else { GROUP_FD };
    last.parse::<u32>().expect("a descriptor number") + 1
}

/// The descriptor number bwrap finds the first write path it binds at:
/// after the hook files' contents.
fn first_write_fd(spec: &SandboxSpec, gate: &GateMounts) -> u32 {
    gate_data_fd(spec, gate) + gate.contents().count() as u32
}

/// The descriptor number bwrap finds the first read path at: after the
/// write paths'.
fn first_read_fd(spec: &SandboxSpec, gate: &GateMounts) -> u32 {
    first_write_fd(spec, gate) + bound_write_paths(spec).count() as u32
}

/// Opens each write path the sandbox binds, then each read path (see
/// [`super::workspace::open_beneath`]): a relative one beneath
/// `workspace`, an absolute one from `/`, in the order [`bwrap_args`]
/// numbers them. A path that is missing, not a directory or regular file,
/// or reached through a symlink refuses the launch.
fn open_bound_paths(spec: &SandboxSpec, workspace: &Path) -> Result<Vec<std::os::fd::OwnedFd>, SandboxError> {
    let writes = bound_write_paths(spec).map(|path| ("write", path));
    let reads = spec.read_paths.iter().map(|path| ("read", path.as_str()));
    writes
        .chain(reads)
        .map(|(kind, path)| {
            let (from, whence) =
                if Path::new(path).is_absolute() { (Path::new("/"), "the host") } else { (workspace, "the workspace") };
            open_beneath(from, path)
                .map_err(|e| SandboxError::Spawn(format!("{kind} path {path:?} cannot be bound from {whence}: {e}")))
        })
        .collect()
}

/// bwrap's arguments as `--args` reads them: each one ended by a NUL. An
/// argument holding a NUL would split into several, each parsed as an
/// option of its own, so one refuses the launch (validation refuses such
/// paths earlier; this is the last line).
fn pack_args(args: &[OsString]) -> Result<Vec<u8>, SandboxError> {
    let mut packed = Vec::new();
    for arg in args {
        let bytes = arg.as_encoded_bytes();
        if bytes.contains(&0) {
            return Err(SandboxError::Spawn(format!("refusing a bwrap argument with a NUL byte: {arg:?}")));
        }
        packed.extend_from_slice(bytes);
        packed.push(0);
    }
    Ok(packed)
}

/// Whether the daemon enters the sandbox's network namespace before the
/// harness runs (bwrap reports its child and waits): for the egress proxy,
/// the gate's endpoint, or both.
fn joins_netns(spec: &SandboxSpec, gate: &GateMounts) -> bool {
    spec.allow_network || !gate.is_empty() || gate.gateway
}

/// The write roots a spec yields, as the harness sees them.
pub fn write_roots(spec: &SandboxSpec) -> Vec<String> {
    let mut roots = vec!["/tmp".to_string(), "/dev/shm".to_string(), HOME_MOUNT.to_string()];
    for path in &spec.write_paths {
        roots.push(match path.as_str() {
            "." => WORKSPACE_MOUNT.to_string(),
            p if Path::new(p).is_absolute() => p.to_string(),
            p => format!("{WORKSPACE_MOUNT}/{p}"),
        });
    }
    roots
}

/// sha256 of `program` and `args`, NUL-separated.
pub fn command_digest(program: &Path, args: &[OsString]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(program.as_os_str().as_encoded_bytes());
    for arg in args {
        hasher.update([0u8]);
        hasher.update(arg.as_encoded_bytes());
    }
    hex::encode(hasher.finalize())
}

/// The `linux_bwrap` backend: every process runs under bubblewrap in its
/// own namespaces, with the sandbox's seccomp filter, cgroup, uid and rlimits.
pub struct BwrapBackend {
    program: Option<PathBuf>,
    layout: HostLayout,
    seccomp: Result<SeccompFilter, String>,
    probe: OnceCell<Result<(), String>>,
    boundary: Boundary,
}

impl BwrapBackend {
    /// Finds `bwrap` on PATH; a missing binary makes every create fail with
    /// a clear reason rather than run anything unsandboxed.
    pub fn detect(cgroups: Option<Arc<CgroupHost>>) -> Self {
        BwrapBackend {
            program: find_on_path("bwrap"),
            layout: HostLayout::detect(),
            seccomp: sandbox_filter().map_err(|e| e.to_string()),
            probe: OnceCell::new(),
            boundary: Boundary::new(cgroups),
        }
    }

    /// The `bwrap` program found on PATH, if any.
    pub fn program(&self) -> Option<&Path> {
        self.program.as_deref()
    }

    /// The host layout the sandbox's system directories are mounted from.
    pub fn layout(&self) -> &HostLayout {
        &self.layout
    }

    /// Starts `argv` in a sandbox laid out at `paths`: the hardened bwrap
    /// command line through `--args`, the seccomp program, and `options`
    /// (user, cgroup, rlimits). With network, the egress proxy is put into
    /// the sandbox's network namespace before the harness runs, and its
    /// handle is returned (dropping it closes the proxy). Shared by real
    /// sandboxes, the probe and the benchmark's floor, so all three run the
    /// same boundary.
    // One call per kind of launch (sandbox, probe, bench floor); a struct
    // would only rename these.
    #[allow(clippy::too_many_arguments)]
    pub async fn launch(
        &self,
        spec: &SandboxSpec,
        paths: &SandboxPaths,
        tmpfs: Tmpfs,
        gate: &GateMounts,
        argv: &[String],
        env: &[(String, String)],
        mut options: SpawnOptions,
        egress: Option<Arc<EgressLog>>,
    ) -> Result<(SandboxProcess, Option<ProxyHandle>), SandboxError> {
        let program = self.program.as_deref().ok_or_else(|| SandboxError::Unavailable("bwrap not found".into()))?;
        let seccomp = self.seccomp.as_ref().map_err(|e| SandboxError::Unavailable(e.clone()))?;
        // tmpfs reads size 0 as "unlimited" (half the host's RAM): never that.
        if tmpfs.tmp_bytes == 0 || tmpfs.shm_bytes == 0 {
            return Err(SandboxError::Spawn(format!("refusing an unsized tmpfs: {tmpfs:?}")));
        }
        let args = bwrap_args(spec, paths, &self.layout, tmpfs, gate);
        // `--` goes on the real command line: bwrap ends option parsing
        // there, whatever the harness argv looks like.
        let (dashdash, packed_args) = args.split_last().expect("bwrap_args ends with --");
        let packed = pack_args(packed_args)?;
        let bound_fds = open_bound_paths(spec, &paths.workspace)?;
        let spawn = |e: std::io::Error| SandboxError::Spawn(format!("cannot pass bwrap its descriptors: {e}"));
        // The caller's own descriptors go after bwrap's (see `passed_fd`).
        let extra = std::mem::take(&mut options.pass_fds);
        let (passwd, group) = identity_files();
        options.pass_fds = vec![
            data_fd("corral-bwrap-args", &packed).map_err(spawn)?,
            data_fd("corral-seccomp", seccomp.bytes()).map_err(spawn)?,
            data_fd("corral-passwd", passwd.as_bytes()).map_err(spawn)?,
            data_fd("corral-group", group.as_bytes()).map_err(spawn)?,
        ];
        let network = if joins_netns(spec, gate) {
            let (info_r, info_w) = netns::pipe().map_err(spawn)?;
            let (block_r, block_w) = netns::pipe().map_err(spawn)?;
            options.pass_fds.extend([info_w, block_r]);
            Some((info_r, block_w))
        } else {
            None
        };
        for (_, bytes) in gate.contents() {
            options.pass_fds.push(data_fd("corral-gate", bytes).map_err(spawn)?);
        }
        options.pass_fds.extend(bound_fds);
        options.pass_fds.extend(extra);
        let mut argv_full: Vec<OsString> = vec!["--args".into(), ARGS_FD.into(), dashdash.clone()];
        argv_full.extend(argv.iter().map(OsString::from));
        let mut process = spawn_group(program, &argv_full, env, &paths.workspace, options)?;
        let Some((info, block)) = network else { return Ok((process, None)) };
        match self.enter_netns(spec, gate, info, block, egress.unwrap_or_default()).await {
            Ok((proxy, gate_listener, gateway_listener)) => {
                process.gate_listener = gate_listener;
                process.gateway_listener = gateway_listener;
                Ok((process, proxy))
            }
            Err(e) => {
                let _ = process.kill().await;
                Err(SandboxError::Spawn(format!("cannot set up the sandbox's egress proxy or gate endpoint: {e}")))
            }
        }
    }

    /// Waits for bwrap's child, listens in its network namespace (the
    /// proxy with network, the gate's endpoint with a hook), serves the
    /// proxy there, then lets bwrap run the harness.
    async fn enter_netns(
        &self,
        spec: &SandboxSpec,
        gate: &GateMounts,
        info: std::os::fd::OwnedFd,
        block: std::os::fd::OwnedFd,
        log: Arc<EgressLog>,
    ) -> std::io::Result<(Option<ProxyHandle>, Option<tokio::net::TcpListener>, Option<tokio::net::TcpListener>)> {
        let pid = netns::read_child_pid(info).await?;
        let mut ports = Vec::new();
        if spec.allow_network {
            ports.push(netns::PROXY_PORT);
        }
        if !gate.is_empty() {
            ports.push(super::GATE_PORT);
        }
        if gate.gateway {
            ports.push(super::GATEWAY_PORT);
        }
        let mut listeners = netns::listen_in(pid, ports).await?.into_iter();
        let proxy = match spec.allow_network {
            false => None,
            true => {
                let listener = tokio::net::TcpListener::from_std(listeners.next().expect("one per port"))?;
                let patterns = net::parse_hosts(&spec.allow_hosts).map_err(std::io::Error::other)?;
                let config = ProxyConfig {
                    allowlist: Allowlist::new(patterns),
                    protected: net::protected_addresses(),
                    host_addresses: net::host_addresses(),
                    connect_timeout: std::time::Duration::from_secs(10),
                };
                Some(net::serve(listener, config, log))
            }
        };
        let take = |listeners: &mut std::vec::IntoIter<std::net::TcpListener>, wanted: bool| match wanted {
            true => listeners.next().map(tokio::net::TcpListener::from_std).transpose(),
            false => Ok(None),
        };
        let hook = take(&mut listeners, !gate.is_empty())?;
        let gateway = take(&mut listeners, gate.gateway)?;
        netns::release(block)?;
        Ok((proxy, hook, gateway))
    }

    /// The number the first of a launch's own `pass_fds` has inside: after
    /// bwrap's arguments, seccomp program and identity files, its info and
    /// block pipes when it joins the network namespace, the hook files'
    /// contents, and the write and read paths it binds.
    fn passed_fd(spec: &SandboxSpec, gate: &GateMounts) -> u32 {
        first_read_fd(spec, gate) + spec.read_paths.len() as u32
    }

    /// The digest of the exact command line a sandbox with `spec` at
    /// `paths` runs: the program and every argument bwrap parses.
    pub fn command_digest(&self, spec: &SandboxSpec, paths: &SandboxPaths, tmpfs: Tmpfs, gate: &GateMounts) -> String {
        let program = self.program.as_deref().unwrap_or(Path::new("bwrap"));
        command_digest(program, &bwrap_args(spec, paths, &self.layout, tmpfs, gate))
    }

    /// Runs `/usr/bin/true` in a full sandbox, as the unprivileged `nobody`
    /// when the daemon is root (a uid no sandbox is ever given), to learn
    /// whether this host can create one at all.
    async fn run_probe(&self) -> Result<(), String> {
        if self.program.is_none() {
            return Err("bwrap not found on PATH (install the Debian package `bubblewrap`)".into());
        }
        self.seccomp.as_ref().map_err(|e| format!("no seccomp filter: {e}"))?;
        let scratch = tempfile_dir().map_err(|e| format!("cannot create a probe directory: {e}"))?;
        let paths = SandboxPaths::under(&scratch);
        let user = (effective_uid() == 0).then_some(HostUser { uid: 65534, gid: 65534 });
        let result = async {
            for dir in [&paths.workspace, &paths.home] {
                std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
            let options = SpawnOptions { user, ..SpawnOptions::default() };
            let (mut process, _) = self
                .launch(
                    &SandboxSpec::default(),
                    &paths,
                    Tmpfs { tmp_bytes: 1 << 20, shm_bytes: 1 << 20 },
                    &GateMounts::default(),
                    &["/usr/bin/true".into()],
                    &[],
                    options,
                    None,
                )
                .await
                .map_err(|e| format!("cannot run bwrap: {e}"))?;
            drop(process.stdin.take());
            let mut stderr = String::new();
            if let Some(mut pipe) = process.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = pipe.read_to_string(&mut stderr).await;
            }
            let status = process.wait().await.map_err(|e| e.to_string())?;
            if status.success() {
                Ok(())
            } else {
                Err(format!("bwrap cannot create a sandbox on this host: {}", stderr.trim()))
            }
        }
        .await;
        let _ = std::fs::remove_dir_all(&scratch);
        result
    }
}

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("corral-probe-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[async_trait]
impl SandboxBackend for BwrapBackend {
    fn kind(&self) -> SandboxType {
        SandboxType::LinuxBwrap
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        self.probe.get_or_init(|| self.run_probe()).await.clone().map_err(SandboxError::Unavailable)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::from_cgroups(self.boundary.cgroups.as_deref())
    }

    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        self.probe().await?;
        // Before the cgroup: a create refused for its hook files leaves
        // nothing behind.
        let mut gate = gate_mounts(&req.gate)
            .map_err(|e| SandboxError::Spawn(format!("cannot place the agent's hook files in the sandbox: {e}")))?;
        let (paths, cgroup) = self.boundary.prepare(req)?;
        gate.gateway = req.gateway;
        let seccomp_digest = self.seccomp.as_ref().map(|f| f.digest().to_string()).unwrap_or_default();
        let receipt = EnforcementReceipt {
            command_digest: self.command_digest(&req.spec, &paths, req.limits.tmpfs(), &gate),
            // Its own network namespace, always; with network, egress only
            // through the daemon's proxy to the allowlist; with gatewayed
            // credentials, through the daemon's credential gateway to its
            // routes' upstreams (even without network). Either is egress
            // the daemon forwards and records: never "none".
            network_isolated: true,
            egress: if req.spec.allow_network || req.gateway { "proxy".into() } else { "none".into() },
            allow_hosts: if req.spec.allow_network { req.spec.allow_hosts.clone() } else { Vec::new() },
            write_roots: write_roots(&req.spec),
            host_uid: req.user.map(|u| u.uid).unwrap_or_else(effective_uid),
            own_uid: req.user.is_some(),
            inside_uid: INSIDE_UID,
            seccomp_digest,
            userns_disabled: true,
            limits: self.boundary.limit_receipts(&req.limits, req.user.is_some(), true),
            gateway_routes: Vec::new(),
            exposed_routes: Vec::new(),
        };
        Ok(Sandbox {
            id: req.sandbox_id.clone(),
            backend: SandboxType::LinuxBwrap,
            state: SandboxState::Ready,
            consumer: req.consumer.clone(),
            spec: req.spec.clone(),
            root: req.root.clone(),
            workspace: paths.workspace,
            home: paths.home,
            user: req.user,
            limits: req.limits,
            cgroup,
            // What the proxy and the gateway forward is recorded here.
            egress: (req.spec.allow_network || req.gateway).then(Arc::default),
            gate,
            receipt,
        })
    }

    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError> {
        let mut env = base_env(sandbox, spec, HOME_MOUNT);
        if sandbox.spec.allow_network {
            for name in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"] {
                env.push((name.into(), netns::PROXY_URL.into()));
            }
        }
        if let Some(mut waiter) = self.boundary.take_waiting(sandbox) {
            // A warm sandbox: its first process becomes this one.
            let frame = super::waiter::encode(&spec.argv, &env).map_err(SandboxError::Spawn)?;
            use tokio::io::AsyncWriteExt;
            let stdin = waiter.stdin.as_mut().ok_or_else(|| SandboxError::Spawn("the waiter has no stdin".into()))?;
            let handed = async { stdin.write_all(&frame).await.and(stdin.flush().await) };
            handed.await.map_err(|e| SandboxError::Spawn(format!("the warm sandbox's waiter is gone: {e}")))?;
            return Ok(waiter);
        }
        let options = self.boundary.spawn_options(sandbox)?;
        let paths = SandboxPaths::under(&sandbox.root);
        let tmp = sandbox.limits.tmpfs();
        let egress = sandbox.egress.clone();
        let (process, proxy) =
            self.launch(&sandbox.spec, &paths, tmp, &sandbox.gate, &spec.argv, &env, options, egress).await?;
        self.boundary.register(sandbox, &process, proxy);
        Ok(process)
    }

    async fn prestart(&self, sandbox: &Sandbox, program: &Path) -> Result<(), SandboxError> {
        // The waiter, by descriptor: nothing is bound for it, so the
        // command line (and its digest) is the cold one's.
        let exe = std::fs::File::open(program)
            .map_err(|e| SandboxError::Spawn(format!("cannot open {} for a warm sandbox: {e}", program.display())))?;
        let mut options = self.boundary.spawn_options(sandbox)?;
        options.pass_fds = vec![exe.into()];
        let fd = Self::passed_fd(&sandbox.spec, &sandbox.gate);
        let argv = [format!("/proc/self/fd/{fd}"), super::waiter::PROGRAM.to_string()];
        let paths = SandboxPaths::under(&sandbox.root);
        let (tmp, egress) = (sandbox.limits.tmpfs(), sandbox.egress.clone());
        let (process, proxy) =
            self.launch(&sandbox.spec, &paths, tmp, &sandbox.gate, &argv, &[], options, egress).await?;
        self.boundary.register(sandbox, &process, proxy);
        self.boundary.hold_waiting(sandbox, process);
        Ok(())
    }

    fn waiter_exited(&self, sandbox: &Sandbox) -> bool {
        self.boundary.waiter_exited(sandbox)
    }

    fn waiter_exit(&self, sandbox: &Sandbox) -> Option<super::WaiterExit> {
        self.boundary.waiter_exit(sandbox)
    }

    async fn stop(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.boundary.stop(sandbox).await
    }

    async fn reclaim(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.boundary.reclaim(sandbox).await
    }

    async fn destroy_leftover(
        &self,
        sandbox_id: &str,
        root: &std::path::Path,
        user: Option<super::HostUser>,
    ) -> Result<(), SandboxError> {
        self.boundary.destroy_leftover(sandbox_id, root, user).await
    }
}

/// The hook files as a sandbox mounts them, in order; each path inside
/// must be an absolute path under `/etc` with plain names.
fn gate_mounts(files: &[GateFile]) -> Result<GateMounts, String> {
    for file in files {
        let plain = file.inside.starts_with("/etc/")
            && file.inside[1..].split('/').all(|p| !p.is_empty() && p != "." && p != "..");
        if !plain {
            return Err(format!("{:?} is not a plain path under /etc", file.inside));
        }
    }
    Ok(GateMounts { files: files.to_vec(), gateway: false })
}

/// The first executable file called `name` in the daemon's PATH.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A create refused for its hook files leaves no cgroup: its caller
    /// removes its directory and forgets it, so a cgroup made before the
    /// refusal stayed on the host. On a fixture v2 tree, with real bwrap
    /// (the probe runs it).
    #[tokio::test]
    async fn a_create_refused_for_its_hook_files_leaves_no_cgroup() {
        use crate::sandbox::cgroup::tests::fixture::Tree;
        use crate::sandbox::cgroup::CgroupHost;
        let tree = Tree::v2(&["memory", "pids", "cpu"], true);
        let backend = BwrapBackend::detect(Some(Arc::new(CgroupHost::detect(tree.path(), "corral"))));
        assert!(backend.program().is_some(), "bwrap is not on PATH: install the Debian package bubblewrap");
        let dir = tempfile::tempdir().unwrap();
        let req = CreateSandbox {
            sandbox_id: "sb-hook-files".into(),
            consumer: Default::default(),
            spec: SandboxSpec::default(),
            root: dir.path().join("sb-hook-files"),
            user: None,
            limits: crate::sandbox::SandboxLimits { memory_bytes: 1 << 30, max_processes: 64, ..Default::default() },
            gate: vec![GateFile { inside: "/usr/hook".into(), source: GateSource::Contents(b"{}".to_vec()) }],
            gateway: false,
        };
        let error = backend.create(&req).await.expect_err("a hook file outside /etc").to_string();
        assert!(error.contains("not a plain path under /etc"), "{error}");
        let left: Vec<_> = std::fs::read_dir(tree.path().join("corral"))
            .map(|d| d.flatten().filter(|e| e.path().is_dir()).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert_eq!(left, Vec::<std::ffi::OsString>::new(), "a cgroup of the refused sandbox is left");
    }

    fn strs(args: &[OsString]) -> Vec<String> {
        args.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    fn sizes(bytes: u64) -> Tmpfs {
        Tmpfs { tmp_bytes: bytes, shm_bytes: bytes / 2 }
    }

    fn paths(root: &str) -> SandboxPaths {
        SandboxPaths::under(Path::new(root))
    }

    #[test]
    fn no_network_spec_gives_the_exact_baseline() {
        let spec = SandboxSpec::default();
        let args = strs(&bwrap_args(
            &spec,
            &paths("/data/sb"),
            &HostLayout::merged_usr(),
            sizes(1 << 20),
            &GateMounts::default(),
        ));
        let mut expected: Vec<String> = [
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid",
            "1000",
            "--gid",
            "1000",
            "--hostname",
            "corral",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/sbin",
            "/sbin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for f in ETC_FILES {
            expected.extend(["--ro-bind-try".to_string(), f.to_string(), f.to_string()]);
        }
        expected.extend(
            [
                "--perms",
                "0644",
                "--ro-bind-data",
                "5",
                "/etc/passwd",
                "--perms",
                "0644",
                "--ro-bind-data",
                "6",
                "/etc/group",
                "--proc",
                "/proc",
                "--ro-bind",
                "/proc/sys",
                "/proc/sys",
                "--dev",
                "/dev",
                "--size",
                "524288",
                "--tmpfs",
                "/dev/shm",
                "--size",
                "1048576",
                "--tmpfs",
                "/tmp",
                "--bind",
                "/data/sb/workspace",
                "/workspace",
                "--bind",
                "/data/sb/home",
                "/home/agent",
                "--remount-ro",
                "/dev",
                "--remount-ro",
                "/",
                "--chdir",
                "/workspace",
                "--seccomp",
                "4",
                "--",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        assert_eq!(args, expected);
    }

    #[test]
    fn private_keys_are_never_bound() {
        let args = strs(&bwrap_args(
            &SandboxSpec::default(),
            &paths("/r"),
            &HostLayout::merged_usr(),
            sizes(1),
            &GateMounts::default(),
        ));
        assert!(args.contains(&"/etc/ssl/certs".to_string()));
        assert!(!args.iter().any(|a| a == "/etc/ssl" || a.starts_with("/etc/ssl/private")), "{args:?}");
    }

    #[test]
    fn the_host_network_is_never_shared() {
        let mut spec = SandboxSpec::default();
        let closed =
            strs(&bwrap_args(&spec, &paths("/w"), &HostLayout::merged_usr(), sizes(1), &GateMounts::default()));
        spec.allow_network = true;
        spec.allow_hosts = vec!["*".into()];
        let open = strs(&bwrap_args(&spec, &paths("/w"), &HostLayout::merged_usr(), sizes(1), &GateMounts::default()));
        for args in [&closed, &open] {
            assert_eq!(args[0], "--unshare-all");
            assert!(!args.contains(&"--share-net".to_string()), "{args:?}");
            assert!(!args.contains(&"/etc/resolv.conf".to_string()), "no resolver inside: {args:?}");
        }
        // With network, bwrap reports its child and waits for the proxy.
        let at = open.iter().position(|a| a == "--info-fd").expect("--info-fd");
        assert_eq!(open[at..at + 4], ["--info-fd", "7", "--block-fd", "8"]);
        assert!(!closed.contains(&"--info-fd".to_string()));
    }

    #[test]
    fn hook_files_are_mounted_read_only_and_the_netns_is_joined_for_the_gate() {
        let settings = GateFile {
            inside: "/etc/claude-code/managed-settings.json".into(),
            source: GateSource::Contents(b"{}".to_vec()),
        };
        let helper = GateFile {
            inside: "/etc/corral/corral-gate-hook".into(),
            source: GateSource::Host("/usr/bin/corral".into()),
        };
        let gate = gate_mounts(&[settings, helper]).unwrap();
        let spec = SandboxSpec { write_paths: vec!["src".into()], ..SandboxSpec::default() };
        let args = strs(&bwrap_args(&spec, &paths("/r"), &HostLayout::merged_usr(), sizes(1), &gate));
        let at = args.iter().position(|a| a == "/etc/claude-code/managed-settings.json").expect("the settings");
        // The settings from the first descriptor after the info and block
        // pipes, then the helper bound from the host.
        assert_eq!(
            args[at - 4..at + 4],
            [
                "--perms",
                "0444",
                "--ro-bind-data",
                "9",
                "/etc/claude-code/managed-settings.json",
                "--ro-bind",
                "/usr/bin/corral",
                "/etc/corral/corral-gate-hook"
            ]
        );
        // The relative write path comes after them; the launch's own
        // descriptors after it.
        let write = args.iter().position(|a| a == "/workspace/src").expect("the write path");
        assert_eq!(args[write - 2..=write], ["--bind-fd", "10", "/workspace/src"]);
        assert_eq!(BwrapBackend::passed_fd(&spec, &gate), 11);
        // Last, but before the root is made read-only, so the mount points
        // can be made.
        assert!(at > args.iter().position(|a| a == "/home/agent").unwrap());
        assert!(at < args.iter().position(|a| a == "--remount-ro").unwrap());
        // Without network, bwrap still waits for the gate's listener.
        let info = args.iter().position(|a| a == "--info-fd").expect("--info-fd");
        assert_eq!(args[info..info + 4], ["--info-fd", "7", "--block-fd", "8"]);
        assert_eq!(gate.contents().collect::<Vec<_>>(), [("/etc/claude-code/managed-settings.json", &b"{}"[..])]);
    }

    #[test]
    fn hook_files_are_mounted_only_under_etc() {
        let files = [
            GateFile { inside: "/etc/codex/requirements.toml".into(), source: GateSource::Contents(b"x = 1".to_vec()) },
            GateFile { inside: "/etc/corral/h".into(), source: GateSource::Host("/usr/bin/true".into()) },
        ];
        assert_eq!(gate_mounts(&files).unwrap().files, files);
        for bad in ["/home/agent/x", "/etc/../root", "etc/x", "/etc//x", "/etc/"] {
            let file = GateFile { inside: bad.into(), source: GateSource::Contents(Vec::new()) };
            assert!(gate_mounts(&[file]).is_err(), "{bad}");
        }
    }

    #[test]
    fn workspace_is_read_only_unless_dot_is_a_write_path() {
        let spec = SandboxSpec { write_paths: vec!["out".into(), "/var/cache/x".into()], ..SandboxSpec::default() };
        let args =
            strs(&bwrap_args(&spec, &paths("/r"), &HostLayout { entries: vec![] }, sizes(1), &GateMounts::default()));
        let tail: Vec<&str> = args.iter().rev().take(21).rev().map(|s| s.as_str()).collect();
        assert_eq!(
            tail,
            [
                "--ro-bind",
                "/r/workspace",
                "/workspace",
                "--bind-fd",
                "7",
                "/workspace/out",
                "--bind-fd",
                "8",
                "/var/cache/x",
                "--bind",
                "/r/home",
                "/home/agent",
                "--remount-ro",
                "/dev",
                "--remount-ro",
                "/",
                "--chdir",
                "/workspace",
                "--seccomp",
                "4",
                "--"
            ][..]
        );
        assert_eq!(write_roots(&spec), ["/tmp", "/dev/shm", "/home/agent", "/workspace/out", "/var/cache/x"]);
    }

    /// Write paths are numbered after bwrap's own descriptors,
    /// and the caller's come after them.
    #[test]
    fn write_paths_are_bound_by_descriptor_after_the_netns_pipes() {
        let spec = SandboxSpec {
            write_paths: vec!["a".into(), "/var/x".into(), "b/c".into()],
            allow_network: true,
            ..SandboxSpec::default()
        };
        let args =
            strs(&bwrap_args(&spec, &paths("/r"), &HostLayout { entries: vec![] }, sizes(1), &GateMounts::default()));
        let at = args.iter().position(|a| a == "--bind-fd").expect("--bind-fd");
        let bound =
            ["--bind-fd", "9", "/workspace/a", "--bind-fd", "10", "/var/x", "--bind-fd", "11", "/workspace/b/c"];
        assert_eq!(args[at..at + 9], bound);
        assert!(!args.iter().any(|a| a.starts_with("/r/workspace/")), "no path source under the workspace: {args:?}");
        assert!(!args.windows(2).any(|w| w == ["--bind", "/var/x"]), "a host path is no bind source: {args:?}");
        assert_eq!(BwrapBackend::passed_fd(&spec, &GateMounts::default()), 12);
        // A writable workspace holds the relative ones already: only a host
        // directory is bound.
        let spec = SandboxSpec { write_paths: vec![".".into(), "a".into()], ..SandboxSpec::default() };
        let args =
            strs(&bwrap_args(&spec, &paths("/r"), &HostLayout { entries: vec![] }, sizes(1), &GateMounts::default()));
        assert!(!args.contains(&"--bind-fd".to_string()), "{args:?}");
        assert_eq!(BwrapBackend::passed_fd(&spec, &GateMounts::default()), 7);
        let spec = SandboxSpec { write_paths: vec![".".into(), "a".into(), "/var/x".into()], ..SandboxSpec::default() };
        let args =
            strs(&bwrap_args(&spec, &paths("/r"), &HostLayout { entries: vec![] }, sizes(1), &GateMounts::default()));
        let at = args.iter().position(|a| a == "--bind-fd").expect("--bind-fd");
        assert_eq!(args[at..at + 3], ["--bind-fd", "7", "/var/x"]);
        assert_eq!(BwrapBackend::passed_fd(&spec, &GateMounts::default()), 8);
    }

    /// The last line against a NUL in an argument: bwrap would read the
    /// rest as options of their own (`--share-net`, a `--ro-bind` of a host
    /// file). Packing refuses it, and so the launch does, before it runs
    /// anything.
    #[tokio::test]
    async fn an_argument_with_a_nul_fails_the_launch_closed() {
        let injected = "/opt/x\0--share-net\0--setenv\0INJ".to_string();
        let error = pack_args(&["--ro-bind".into(), injected.clone().into()]).unwrap_err().to_string();
        assert!(error.contains("NUL"), "{error}");
        assert_eq!(pack_args(&["--a".into(), "b".into()]).unwrap(), b"--a\0b\0");

        let backend = BwrapBackend::detect(None);
        assert!(backend.program().is_some(), "bwrap is not on PATH: install the Debian package bubblewrap");
        let dir = tempfile::tempdir().unwrap();
        let sandbox_paths = SandboxPaths::under(dir.path());
        for spec in [
            SandboxSpec { read_paths: vec![injected.clone()], ..SandboxSpec::default() },
            SandboxSpec { write_paths: vec![injected.clone()], ..SandboxSpec::default() },
        ] {
            let launched = backend
                .launch(
                    &spec,
                    &sandbox_paths,
                    sizes(1 << 20),
                    &GateMounts::default(),
                    &["/usr/bin/true".into()],
                    &[],
                    SpawnOptions::default(),
                    None,
                )
                .await;
            let error = launched.err().expect("a launch with a NUL in an argument").to_string();
            assert!(error.contains("NUL"), "{error}");
        }
    }

    /// Read paths are bound read-only from descriptors, numbered after the
    /// write paths', none of them a path source bwrap would resolve.
    #[test]
    fn read_paths_are_bound_read_only_by_descriptor() {
        let spec = SandboxSpec {
            read_paths: vec!["/opt/tools".into(), "/srv/models".into()],
            write_paths: vec![".".into(), "/var/x".into()],
            ..SandboxSpec::default()
        };
        let args =
            strs(&bwrap_args(&spec, &paths("/w"), &HostLayout { entries: vec![] }, sizes(1), &GateMounts::default()));
        let at = args.iter().position(|a| a == "--ro-bind-fd").expect("read path bound");
        assert_eq!(args[at..at + 6], ["--ro-bind-fd", "8", "/opt/tools", "--ro-bind-fd", "9", "/srv/models"]);
        assert!(!args.windows(2).any(|w| w[0] == "--ro-bind" && w[1] == "/opt/tools"), "{args:?}");
        assert_eq!(BwrapBackend::passed_fd(&spec, &GateMounts::default()), 10);
    }

    #[test]
    fn digest_changes_with_any_argument() {
        let a = command_digest(Path::new("/usr/bin/bwrap"), &["--a".into(), "b".into()]);
        let b = command_digest(Path::new("/usr/bin/bwrap"), &["--ab".into()]);
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }
}
