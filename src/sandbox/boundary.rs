//! What every backend does around the process it runs: the sandbox's
//! directory (owned by its own host uid), its cgroup, the rlimits and user
//! its processes start with, and a teardown that kills everything the
//! sandbox started — through its cgroup and its uid — and waits until
//! nothing of it is alive before it reports success.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cgroup::{CgroupHost, CgroupLimits, SandboxCgroup};
use super::host::{kill_uid, INSIDE_UID};
use super::process::{ProcessRegistry, Rlimits, SpawnOptions};
use super::uid_state;
use super::{CreateSandbox, LimitReceipt, Sandbox, SandboxError, SandboxLimits, SandboxProcess};
use crate::net::ProxyHandle;

/// How long destroy waits for a sandbox's processes to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a `none` sandbox needs a cgroup or a uid of its own.
pub(super) const NONE_CANNOT_BE_KILLED: &str = "a none sandbox's teardown finds what it started (setsid, double \
     forks) through its cgroup or its own host uid, and this daemon has neither (no usable cgroup hierarchy, and not \
     root)";

/// Host paths of one sandbox, all under its root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxPaths {
    /// The cloned repository the harness works in.
    pub workspace: PathBuf,
    /// The harness's writable HOME (`/home/agent` inside).
    pub home: PathBuf,
    /// A `none` sandbox's private TMPDIR (bwrap mounts its own tmpfs on
    /// /tmp: a `linux_bwrap` sandbox has none).
    pub tmp: PathBuf,
}

impl SandboxPaths {
    /// The paths of a sandbox whose root is `root` (nothing is created).
    pub fn under(root: &Path) -> SandboxPaths {
        SandboxPaths { workspace: root.join("workspace"), home: root.join("home"), tmp: root.join("tmp") }
    }
}

/// The passwd and group files every sandbox sees: its fixed inside uid
/// has a name and a home, so tools that look themselves up work. bwrap
/// copies them from descriptors into the sandbox (`--ro-bind-data`).
/// The same for every sandbox: made once.
pub(super) fn identity_files() -> &'static (String, String) {
    static FILES: std::sync::LazyLock<(String, String)> = std::sync::LazyLock::new(make_identity_files);
    &FILES
}

fn make_identity_files() -> (String, String) {
    let passwd = format!(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n\
         agent:x:{INSIDE_UID}:{INSIDE_UID}:corral agent:/home/agent:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    );
    let group = format!("root:x:0:\nagent:x:{INSIDE_UID}:\nnogroup:x:65534:\n");
    (passwd, group)
}

/// An egress proxy, with the reaped flag of the process whose network
/// namespace it serves.
type ServedProxy = (Arc<AtomicBool>, ProxyHandle);

/// The host side of every backend's sandboxes.
pub struct Boundary {
    /// The host's cgroups, shared by every backend; `None` when the host has
    /// no usable hierarchy.
    pub cgroups: Option<Arc<CgroupHost>>,
    /// Every process group started in a sandbox, so destroy can kill what a
    /// rein left behind.
    pub processes: ProcessRegistry,
    /// Each sandbox's egress proxies (one per harness start), each with
    /// the reaped flag of the process whose namespace it serves: dropped,
    /// and so closed, once that process is reaped, or at destroy.
    proxies: Mutex<HashMap<String, Vec<ServedProxy>>>,
    /// Each warm sandbox's waiting first process, until a spawn takes it
    /// (once) or destroy kills it.
    waiting: Mutex<HashMap<String, SandboxProcess>>,
}

impl Boundary {
    /// A boundary using `cgroups` (`None`: no cgroup limits or cgroup kill).
    pub fn new(cgroups: Option<Arc<CgroupHost>>) -> Boundary {
        Boundary {
            cgroups,
            processes: ProcessRegistry::default(),
            proxies: Mutex::default(),
            waiting: Mutex::default(),
        }
    }

    /// Creates the sandbox's directory tree and its cgroup. The root is
    /// 0711 root (traversable, not listable); the workspace and home (and
    /// a `none` sandbox's TMPDIR) belong to the sandbox's user. A
    /// `linux_bwrap` sandbox's /tmp, identity files and hook settings are
    /// bwrap's own, in memory: on disk it has these only.
    pub fn prepare(&self, req: &CreateSandbox) -> Result<(SandboxPaths, Option<Arc<SandboxCgroup>>), SandboxError> {
        let paths = SandboxPaths::under(&req.root);
        let create = |e: std::io::Error, path: &Path| SandboxError::Create(format!("{}: {e}", path.display()));
        let mut own = vec![&paths.workspace, &paths.home];
        if req.spec.sandbox_type == super::SandboxType::None {
            own.push(&paths.tmp);
        }
        for (dir, mode) in std::iter::once((&req.root, 0o711)).chain(own.iter().map(|dir| (*dir, 0o700))) {
            std::fs::create_dir_all(dir).map_err(|e| create(e, dir))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| create(e, dir))?;
        }
        if let Some(user) = req.user {
            for dir in own {
                std::os::unix::fs::lchown(dir, Some(user.uid), Some(user.gid)).map_err(|e| create(e, dir))?;
            }
        }
        for path in req.spec.read_paths.iter().chain(req.spec.write_paths.iter()) {
            let p = Path::new(path);
            if p.is_absolute() && !p.exists() {
                return Err(SandboxError::Create(format!("sandbox path {path} does not exist on the host")));
            }
        }
        let cgroup = match &self.cgroups {
            Some(host) => {
                let limits = CgroupLimits {
                    memory_bytes: req.limits.memory_bytes,
                    max_processes: req.limits.max_processes,
                    cpu_millis: req.limits.cpu_millis,
                };
                Some(Arc::new(host.create(&req.sandbox_id, &limits).map_err(|e| SandboxError::Create(e.to_string()))?))
            }
            None if req.limits.needs_cgroup() => {
                return Err(SandboxError::Create("the sandbox's limits need a cgroup and this host has none".into()));
            }
            None => None,
        };
        Ok((paths, cgroup))
    }

    /// The receipt lines for the limits a sandbox runs under.
    pub fn limit_receipts(&self, limits: &SandboxLimits, own_uid: bool, tmpfs: bool) -> Vec<LimitReceipt> {
        let cgroup = |which: fn(&CgroupHost) -> Result<super::cgroup::Mechanism, String>| {
            self.cgroups.as_ref().and_then(|h| which(h).ok()).map(|m| m.to_string()).unwrap_or_default()
        };
        let mut out = Vec::new();
        let mut add = |name: &str, value: u64, mechanism: String| {
            if value > 0 {
                out.push(LimitReceipt { name: name.into(), value, mechanism });
            }
        };
        add("memory_bytes", limits.memory_bytes, cgroup(CgroupHost::memory));
        let pids = match cgroup(CgroupHost::pids) {
            none if none.is_empty() && own_uid => "rlimit NPROC".to_string(),
            mechanism => mechanism,
        };
        add("max_processes", limits.max_processes, pids);
        add("cpu_millis", limits.cpu_millis, cgroup(CgroupHost::cpu));
        add("max_open_files", limits.max_open_files, "rlimit NOFILE".into());
        add("address_space_bytes", limits.address_space_bytes, "rlimit AS".into());
        add("max_file_bytes", limits.max_file_bytes, "rlimit FSIZE".into());
        add("max_workspace_bytes", limits.max_workspace_bytes, "daemon watch of the workspace and HOME".into());
        add("max_workspace_inodes", limits.max_workspace_inodes, "daemon watch of the workspace and HOME".into());
        if tmpfs {
            add("tmp_bytes", limits.tmp_bytes, "tmpfs size".into());
            add("shm_bytes", limits.shm_bytes, "tmpfs size".into());
        }
        out
    }

    /// How a process of `sandbox` starts: in its cgroup, under its rlimits,
    /// as its user.
    pub fn spawn_options(&self, sandbox: &Sandbox) -> Result<SpawnOptions, SandboxError> {
        let cgroup_procs = match &sandbox.cgroup {
            Some(cgroup) => cgroup.procs_files().map_err(|e| SandboxError::Spawn(e.to_string()))?,
            None => Vec::new(),
        };
        let limits = &sandbox.limits;
        Ok(SpawnOptions {
            rlimits: Rlimits {
                // One mechanism per limit: the pids cgroup when there is one
                // (it also reports its refusals); RLIMIT_NPROC counts per
                // host uid, so only for a uid of the sandbox's own.
                max_processes: if sandbox.cgroup.is_none() && sandbox.user.is_some() {
                    limits.max_processes
                } else {
                    0
                },
                address_space_bytes: limits.address_space_bytes,
                max_file_bytes: limits.max_file_bytes,
                max_open_files: limits.max_open_files,
            },
            user: sandbox.user,
            cgroup_procs,
            pass_fds: Vec::new(),
        })
    }

    /// Records a process (and its egress proxy, if any) so that destroy kills
    /// its group and closes the proxy.
    pub fn register(&self, sandbox: &Sandbox, process: &SandboxProcess, proxy: Option<ProxyHandle>) {
        self.processes.register(&sandbox.id, process);
        let mut proxies = self.proxies.lock().unwrap_or_else(|e| e.into_inner());
        let proxies = proxies.entry(sandbox.id.clone()).or_default();
        // A proxy serves its process's network namespace: once that process
        // is reaped (a session's harness restarted, a resumed turn), nothing
        // is left there, and its listener and task go.
        proxies.retain(|(reaped, _)| !reaped.load(Ordering::SeqCst));
        if let Some(proxy) = proxy {
            proxies.push((process.reaped_flag(), proxy));
        }
    }

    /// Keeps `process`, a warm sandbox's waiter (registered already), for
    /// the sandbox's first spawn.
    pub fn hold_waiting(&self, sandbox: &Sandbox, process: SandboxProcess) {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).insert(sandbox.id.clone(), process);
    }

    /// The sandbox's waiter, if it has one no spawn took yet: taken out, so
    /// it serves one request at most.
    pub fn take_waiting(&self, sandbox: &Sandbox) -> Option<SandboxProcess> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&sandbox.id)
    }

    /// Whether the sandbox's waiter, which no spawn took yet, has exited
    /// (killed, out of memory). Its first process is bwrap, which exits
    /// once the waiter inside it does; one that has is reaped here, as
    /// [`SandboxProcess::has_exited`] does.
    pub fn waiter_exited(&self, sandbox: &Sandbox) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.get_mut(&sandbox.id).is_some_and(SandboxProcess::has_exited)
    }

    /// Resolves once the sandbox's waiter, which no spawn took yet, has
    /// exited; `None` for a sandbox without one (or when no pidfd could
    /// be had: a request still finds it dead, [`Self::waiter_exited`]).
    pub fn waiter_exit(&self, sandbox: &Sandbox) -> Option<super::WaiterExit> {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let watch = waiting.get(&sandbox.id)?.exit_watch();
        match watch {
            Ok(watch) => Some(Box::pin(watch)),
            Err(error) => {
                tracing::warn!(sandbox_id = %sandbox.id, %error, "no pidfd to watch a warm sandbox's waiter");
                None
            }
        }
    }

    /// Kills everything of the sandbox and waits until nothing of it can
    /// run again: what a run reports as `sandbox_destroy`. [`reclaim`]
    /// gives back what it held.
    ///
    /// The cgroup finds and kills everything (nothing unprivileged leaves
    /// it), and it is empty only when nothing of the sandbox can run again:
    /// the kernel takes an exiting process out of `cgroup.procs`
    /// (`cgroup_exit`) after it has let go of its memory and its files, and
    /// such a task never returns to user space. Without a cgroup (a host
    /// without one), the sandbox's own uid is swept here instead: that is
    /// then the only way to find what it started.
    ///
    /// [`reclaim`]: Self::reclaim
    pub async fn stop(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        // A waiter nobody took dies with the rest (killed through its group below).
        drop(self.take_waiting(sandbox));
        self.processes.kill_all(&sandbox.id);
        // The proxies close with their sandbox: listener and every tunnel.
        drop(self.proxies.lock().unwrap_or_else(|e| e.into_inner()).remove(&sandbox.id));
        let result = match (&sandbox.cgroup, own_uid(sandbox)) {
            (Some(cgroup), _) => cgroup.kill_all(KILL_TIMEOUT).await.map_err(|e| e.to_string()),
            (None, Some(user)) => kill_uid(user.uid, KILL_TIMEOUT).await.map(drop),
            // A `none` sandbox without either has nothing that finds what
            // it started (`setsid`, double forks): never call that a kill.
            // (`create` refuses one; a crashed daemon's leftover, whose
            // backend is not known, is `Destroying`.)
            (None, None)
                if sandbox.backend == super::SandboxType::None && sandbox.state != super::SandboxState::Destroying =>
            {
                Err(NONE_CANNOT_BE_KILLED.to_string())
            }
            (None, None) => Ok(()),
        };
        result.map_err(SandboxError::Destroy)
    }

    /// Gives back what a stopped sandbox held: its uid (once no task of it
    /// is left), what a `none` sandbox left on the host, its cgroup, its
    /// files. Succeeds only if all of that did.
    ///
    /// Nothing of the sandbox's own uid may still be running when this
    /// succeeds, not even a killed task that has left `cgroup.procs` but
    /// not yet released its memory and files (under the sandbox's CPU
    /// quota that tail can be long). A sandbox that [`exits_in_its_cgroup`]
    /// waits for its cgroup's `populated 0`. Any other (a `none` one, one
    /// left by a crashed daemon, one without a v2 cgroup, one that binds
    /// host paths) has its uid swept: one
    /// getpriority(2) call when no task of it is left, else a walk of
    /// `/proc`. The walk is what a bubblewrap sandbox avoids: bwrap exits
    /// before it reaps its pid-1 child, so the uid keeps a zombie until the
    /// host's init reaps it, and getpriority counts zombies. Its uid goes
    /// to no other sandbox while any task of it is alive, nor while only
    /// its zombies are left unless no uid in the range is free of tasks:
    /// see `allocate_uid`.
    pub async fn reclaim(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        let mut errors = Vec::new();
        // Only a uid that is the sandbox's alone: never one shared with
        // anything else on the host (the benchmark's floor runs as nobody).
        // A `none` sandbox's host objects are purged next, and nothing of
        // its uid may make new ones meanwhile.
        let none = sandbox.backend == super::SandboxType::None;
        let own = own_uid(sandbox);
        let mut uid_gone = false;
        if let Some(user) = own {
            let gone = match exits_in_its_cgroup(sandbox) {
                Some(cgroup) => cgroup.wait_exited(KILL_TIMEOUT).await.map_err(|e| e.to_string()),
                None => kill_uid(user.uid, KILL_TIMEOUT).await.map(drop),
            };
            match gone {
                Ok(()) => uid_gone = true,
                Err(e) => errors.push(e),
            }
        }
        // What it left on the host outside its directory (IPC, /tmp,
        // /dev/shm, /run/lock, keyrings), before its uid can go to another
        // sandbox.
        if let Some(user) = own.filter(|_| none) {
            if uid_gone {
                let purged = tokio::task::spawn_blocking(move || {
                    let dirs = uid_state::shared_dirs();
                    let dirs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
                    uid_state::purge(user.uid, user.gid, &dirs)
                })
                .await
                .unwrap_or_else(|e| Err(format!("purge of uid {}: {e}", user.uid)));
                if let Err(e) = purged {
                    errors.push(e);
                }
            } else {
                errors.push(format!("host objects of uid {} not purged: its processes are still alive", user.uid));
            }
        }
        if let Some(cgroup) = &sandbox.cgroup {
            if let Err(e) = cgroup.remove() {
                errors.push(e.to_string());
            }
        }
        if let Err(e) = remove_root(&sandbox.root).await {
            errors.push(e.to_string());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(SandboxError::Destroy(errors.join("; ")))
        }
    }

    /// [`stop`](Self::stop), then [`reclaim`](Self::reclaim) whatever
    /// came of it; succeeds only if both did.
    pub async fn destroy(&self, sandbox: &Sandbox) -> Result<(), SandboxError> {
        let stopped = self.stop(sandbox).await;
        super::both(stopped, self.reclaim(sandbox).await)
    }
}

/// The cgroup that every process of a sandbox's own uid is in, when its
/// `populated 0` (see [`SandboxCgroup::wait_exited`]) proves that none of
/// them is left: a bubblewrap sandbox's with a cgroup v2 directory, that
/// binds no host path beyond the system's directories. Every process of
/// the uid started in that cgroup (`spawn_group` joins it before taking
/// the uid, and nothing else runs as it); none can leave it (no
/// capability, no cgroupfs inside); and with its own network namespace and
/// no host path that could hold a host service's socket, none can ask a
/// service on the host to start one outside it.
fn exits_in_its_cgroup(sandbox: &Sandbox) -> Option<&super::cgroup::SandboxCgroup> {
    let spec = &sandbox.spec;
    let binds_host = !spec.read_paths.is_empty() || spec.write_paths.iter().any(|p| Path::new(p).is_absolute());
    let bwrap = sandbox.backend == super::SandboxType::LinuxBwrap;
    sandbox.cgroup.as_deref().filter(|c| bwrap && !binds_host && c.tracks_exit())
}

/// The sandbox's uid when it is its own (not the daemon's, nor shared).
fn own_uid(sandbox: &Sandbox) -> Option<super::HostUser> {
    sandbox.user.filter(|_| sandbox.receipt.own_uid)
}

impl Boundary {
    /// Destroys what a crashed daemon left of a sandbox: its cgroup (found
    /// again by name), every process of its uid, its files.
    pub async fn destroy_leftover(
        &self,
        sandbox_id: &str,
        root: &Path,
        user: Option<super::HostUser>,
    ) -> Result<(), SandboxError> {
        let cgroup = self.cgroups.as_ref().and_then(|host| host.open(sandbox_id)).map(Arc::new);
        let leftover = Sandbox {
            id: sandbox_id.to_string(),
            backend: super::SandboxType::None,
            state: super::SandboxState::Destroying,
            consumer: Default::default(),
            spec: Default::default(),
            root: root.to_path_buf(),
            workspace: root.join("workspace"),
            home: root.join("home"),
            user,
            limits: SandboxLimits::default(),
            cgroup,
            egress: None,
            gate: Default::default(),
            // A uid from the store is the sandbox's own.
            receipt: super::EnforcementReceipt { own_uid: user.is_some(), ..Default::default() },
        };
        self.destroy(&leftover).await
    }
}

pub(super) async fn remove_root(root: &Path) -> Result<(), SandboxError> {
    let root = root.to_path_buf();
    tokio::task::spawn_blocking(move || remove_tree(&root))
        .await
        .unwrap_or_else(|e| Err(SandboxError::Destroy(format!("remove: {e}"))))
}

fn remove_tree(root: &Path) -> Result<(), SandboxError> {
    let mut removed = std::fs::remove_dir_all(root);
    if matches!(&removed, Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied) {
        // A directory the harness closed to its owner (the daemon's own
        // uid, under an unprivileged daemon): opened again, then removed.
        open_tree_to_owner(root);
        removed = std::fs::remove_dir_all(root);
    }
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SandboxError::Destroy(format!("remove {}: {e}", root.display()))),
    }
}

/// Gives the daemon back the use of a directory it owns that the harness
/// (running as the daemon's uid, under an unprivileged daemon) closed to
/// its owner (`chmod 300`), so that what is below it can be counted and
/// removed. A root daemon reads and removes any directory as it is.
pub fn open_to_owner(dir: &Path, meta: &std::fs::Metadata, euid: u32) {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.mode() & 0o7777;
    if euid != 0 && meta.is_dir() && meta.uid() == euid && mode & 0o700 != 0o700 {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o700));
    }
}

/// [`open_to_owner`] for every directory under `root`, parents first,
/// links not followed.
fn open_tree_to_owner(root: &Path) {
    let euid = super::host::effective_uid();
    if euid == 0 {
        return;
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&dir) else { continue };
        if !meta.is_dir() {
            continue;
        }
        open_to_owner(&dir, &meta, euid);
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::cgroup::tests::fixture::Tree;
    use super::super::cgroup::{CgroupHost, CgroupLimits};
    use super::*;

    fn sandbox(backend: super::super::SandboxType, cgroup: Option<&CgroupHost>) -> Sandbox {
        Sandbox {
            id: "sb1".into(),
            backend,
            state: super::super::SandboxState::Ready,
            consumer: Default::default(),
            spec: Default::default(),
            root: "/nonexistent".into(),
            workspace: "/nonexistent/workspace".into(),
            home: "/nonexistent/home".into(),
            user: Some(super::super::HostUser { uid: 200_000, gid: 200_000 }),
            limits: SandboxLimits::default(),
            cgroup: cgroup.map(|host| Arc::new(host.create("sb1", &CgroupLimits::default()).unwrap())),
            egress: None,
            gate: Default::default(),
            receipt: super::super::EnforcementReceipt { own_uid: true, ..Default::default() },
        }
    }

    /// Only a bubblewrap sandbox in a cgroup v2 directory, binding no host
    /// path, is trusted to have all of its uid's processes in its cgroup;
    /// every other one has its uid swept.
    #[test]
    fn which_sandboxes_skip_the_uid_sweep() {
        use super::super::SandboxType::{LinuxBwrap, None as NoneType};
        let (v2, v1) = (Tree::v2(&["memory", "pids", "cpu"], true), Tree::v1(&["memory", "pids", "cpu"]));
        let (v2, v1) = (CgroupHost::detect(v2.path(), "corral"), CgroupHost::detect(v1.path(), "corral"));
        let trusted = |s: &Sandbox| exits_in_its_cgroup(s).is_some();
        assert!(trusted(&sandbox(LinuxBwrap, Some(&v2))));
        let mut relative = sandbox(LinuxBwrap, Some(&v2));
        relative.spec.write_paths = vec![".".into(), "build".into()];
        assert!(trusted(&relative), "paths inside the workspace bind nothing of the host");
        let mut reads = sandbox(LinuxBwrap, Some(&v2));
        reads.spec.read_paths = vec!["/opt/tools".into()];
        assert!(!trusted(&reads), "a host path may hold a host service's socket");
        let mut writes = sandbox(LinuxBwrap, Some(&v2));
        writes.spec.write_paths = vec!["/var/cache/x".into()];
        assert!(!trusted(&writes));
        assert!(!trusted(&sandbox(NoneType, Some(&v2))), "a none sandbox reaches the host's services");
        assert!(!trusted(&sandbox(LinuxBwrap, Some(&v1))), "no cgroup.events to read");
        assert!(!trusted(&sandbox(LinuxBwrap, None)));
    }
}
