//! The `linux_bwrap` backend: bubblewrap with every namespace unshared, a
//! read-only system, a minimal /etc, fresh /proc /dev /tmp, and only the
//! workspace (and declared write paths) writable.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use super::process::{spawn_group, ProcessRegistry, ResourceLimits};
use super::{
    base_env, CreateSandbox, EnforcementReceipt, ExecSpec, Sandbox, SandboxBackend, SandboxError, SandboxProcess,
    SandboxSpec, SandboxState, SandboxType,
};

/// Where the workspace appears inside the sandbox.
pub const WORKSPACE_MOUNT: &str = "/workspace";

/// The few files of /etc a harness needs; `--ro-bind-try` skips the absent.
const ETC_FILES: &[&str] = &[
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/alternatives",
    "/etc/ssl",
    "/etc/ca-certificates",
];

/// How the host lays out its top-level system directories (merged-/usr
/// hosts have symlinks where older ones have directories).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    pub entries: Vec<(String, TopLevel)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopLevel {
    Symlink(String),
    Dir,
}

impl HostLayout {
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

/// The bwrap arguments for `spec` with the host workspace at `workspace`,
/// up to and including the `--` that precedes the harness argv.
///
/// Pure, so it can be checked against exact vectors; environment values
/// never appear here (they would show in `/proc/<pid>/cmdline`).
pub fn bwrap_args(spec: &SandboxSpec, workspace: &Path, layout: &HostLayout) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |parts: &[&str]| args.extend(parts.iter().map(OsString::from));
    push(&["--unshare-all"]);
    if spec.allow_network {
        push(&["--share-net"]);
    }
    push(&["--die-with-parent", "--new-session", "--cap-drop", "ALL"]);
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
    if spec.allow_network {
        push(&["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]);
    }
    push(&["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
    for path in &spec.read_paths {
        push(&["--ro-bind", path, path]);
    }
    let ws = workspace.to_string_lossy();
    let workspace_writable = spec.write_paths.iter().any(|p| p == ".");
    push(&[if workspace_writable { "--bind" } else { "--ro-bind" }, &ws, WORKSPACE_MOUNT]);
    for path in &spec.write_paths {
        if path == "." {
            continue;
        }
        if Path::new(path).is_absolute() {
            push(&["--bind", path, path]);
        } else if !workspace_writable {
            let host = format!("{ws}/{path}");
            let inside = format!("{WORKSPACE_MOUNT}/{path}");
            push(&["--bind", &host, &inside]);
        }
    }
    // bwrap's root is a writable tmpfs; remounting it read-only leaves only
    // the binds above (workspace, write paths) and /tmp writable.
    push(&["--remount-ro", "/", "--chdir", WORKSPACE_MOUNT, "--"]);
    args
}

/// The write roots a spec yields, as the harness sees them.
pub fn write_roots(spec: &SandboxSpec) -> Vec<String> {
    let mut roots = vec!["/tmp".to_string()];
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
    hex(&hasher.finalize())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub struct BwrapBackend {
    program: Option<PathBuf>,
    layout: HostLayout,
    probe: OnceCell<Result<(), String>>,
    processes: Arc<ProcessRegistry>,
    limits: ResourceLimits,
}

impl BwrapBackend {
    /// Finds `bwrap` on PATH; a missing binary makes every create fail with
    /// a clear reason rather than run anything unsandboxed.
    pub fn detect() -> Self {
        BwrapBackend {
            program: find_on_path("bwrap"),
            layout: HostLayout::detect(),
            probe: OnceCell::new(),
            processes: Arc::default(),
            limits: ResourceLimits::default(),
        }
    }

    pub fn program(&self) -> Option<&Path> {
        self.program.as_deref()
    }

    pub fn layout(&self) -> &HostLayout {
        &self.layout
    }

    async fn run_probe(&self) -> Result<(), String> {
        let Some(program) = &self.program else {
            return Err("bwrap not found on PATH (install the Debian package `bubblewrap`)".into());
        };
        let scratch = std::env::temp_dir();
        let mut args = bwrap_args(&SandboxSpec::default(), &scratch, &self.layout);
        args.push("/usr/bin/true".into());
        let output = tokio::process::Command::new(program)
            .args(&args)
            .env_clear()
            .output()
            .await
            .map_err(|e| format!("cannot run bwrap: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            Err(format!("bwrap cannot create a sandbox on this host: {}", stderr.trim()))
        }
    }
}

#[async_trait]
impl SandboxBackend for BwrapBackend {
    fn kind(&self) -> SandboxType {
        SandboxType::LinuxBwrap
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        self.probe.get_or_init(|| self.run_probe()).await.clone().map_err(SandboxError::Unavailable)
    }

    async fn create(&self, req: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        self.probe().await?;
        let program = self.program.as_deref().unwrap_or(Path::new("bwrap"));
        let workspace = prepare_root(req)?;
        let args = bwrap_args(&req.spec, &workspace, &self.layout);
        Ok(Sandbox {
            id: req.sandbox_id.clone(),
            backend: SandboxType::LinuxBwrap,
            state: SandboxState::Ready,
            consumer: req.consumer.clone(),
            spec: req.spec.clone(),
            root: req.root.clone(),
            workspace,
            receipt: EnforcementReceipt {
                command_digest: command_digest(program, &args),
                network_isolated: !req.spec.allow_network,
                write_roots: write_roots(&req.spec),
            },
        })
    }

    async fn spawn(&self, sandbox: &Sandbox, spec: &ExecSpec) -> Result<SandboxProcess, SandboxError> {
        let program = self.program.as_deref().ok_or_else(|| SandboxError::Unavailable("bwrap not found".into()))?;
        let mut args = bwrap_args(&sandbox.spec, &sandbox.workspace, &self.layout);
        args.extend(spec.argv.iter().map(OsString::from));
        let env = base_env(sandbox, spec, "/tmp");
        let process = spawn_group(program, &args, &env, &sandbox.workspace, self.limits)?;
        self.processes.register(&sandbox.id, &process);
        Ok(process)
    }

    async fn destroy(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        self.processes.kill_all(&sandbox.id);
        remove_root(&sandbox.root).await
    }
}

/// Creates the sandbox root and its workspace, and checks that every path
/// the spec binds exists (a bind of a missing path would fail at spawn).
pub(super) fn prepare_root(req: &CreateSandbox) -> Result<PathBuf, SandboxError> {
    let workspace = req.root.join("workspace");
    std::fs::create_dir_all(&workspace)
        .map_err(|e| SandboxError::Create(format!("workspace {}: {e}", workspace.display())))?;
    for path in req.spec.read_paths.iter().chain(req.spec.write_paths.iter()) {
        let p = Path::new(path);
        if p.is_absolute() && !p.exists() {
            return Err(SandboxError::Create(format!("sandbox path {path} does not exist on the host")));
        }
    }
    Ok(workspace)
}

pub(super) async fn remove_root(root: &Path) -> Result<(), SandboxError> {
    match tokio::fs::remove_dir_all(root).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SandboxError::Destroy(format!("remove {}: {e}", root.display()))),
    }
}

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

    fn strs(args: &[OsString]) -> Vec<String> {
        args.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn no_network_spec_gives_the_exact_baseline() {
        let spec = SandboxSpec::default();
        let args = strs(&bwrap_args(&spec, Path::new("/data/sb/workspace"), &HostLayout::merged_usr()));
        let mut expected: Vec<String> = [
            "--unshare-all",
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
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--tmpfs",
                "/tmp",
                "--bind",
                "/data/sb/workspace",
                "/workspace",
                "--remount-ro",
                "/",
                "--chdir",
                "/workspace",
                "--",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        assert_eq!(args, expected);
    }

    #[test]
    fn network_is_shared_only_when_allowed() {
        let mut spec = SandboxSpec::default();
        let closed = strs(&bwrap_args(&spec, Path::new("/w"), &HostLayout::merged_usr()));
        assert!(!closed.contains(&"--share-net".to_string()));
        assert!(!closed.contains(&"/etc/resolv.conf".to_string()));
        spec.allow_network = true;
        let open = strs(&bwrap_args(&spec, Path::new("/w"), &HostLayout::merged_usr()));
        assert_eq!(&open[..2], ["--unshare-all", "--share-net"]);
        assert!(open.contains(&"/etc/resolv.conf".to_string()));
    }

    #[test]
    fn workspace_is_read_only_unless_dot_is_a_write_path() {
        let spec = SandboxSpec { write_paths: vec!["out".into(), "/var/cache/x".into()], ..SandboxSpec::default() };
        let args = strs(&bwrap_args(&spec, Path::new("/w"), &HostLayout { entries: vec![] }));
        let tail: Vec<&str> = args.iter().rev().take(14).rev().map(|s| s.as_str()).collect();
        assert_eq!(
            tail,
            [
                "--ro-bind",
                "/w",
                "/workspace",
                "--bind",
                "/w/out",
                "/workspace/out",
                "--bind",
                "/var/cache/x",
                "/var/cache/x",
                "--remount-ro",
                "/",
                "--chdir",
                "/workspace",
                "--"
            ]
        );
        assert_eq!(write_roots(&spec), ["/tmp", "/workspace/out", "/var/cache/x"]);
    }

    #[test]
    fn read_paths_are_bound_read_only() {
        let spec = SandboxSpec { read_paths: vec!["/opt/tools".into()], ..SandboxSpec::default() };
        let args = strs(&bwrap_args(&spec, Path::new("/w"), &HostLayout { entries: vec![] }));
        let at = args.iter().position(|a| a == "/opt/tools").expect("read path bound");
        assert_eq!(args[at - 1], "--ro-bind");
        assert_eq!(args[at + 1], "/opt/tools");
    }

    #[test]
    fn digest_changes_with_any_argument() {
        let a = command_digest(Path::new("/usr/bin/bwrap"), &["--a".into(), "b".into()]);
        let b = command_digest(Path::new("/usr/bin/bwrap"), &["--ab".into()]);
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }
}
