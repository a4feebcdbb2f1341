//! The workspace: a fresh clone of the request's repository at the start,
//! and at the end its final state brought back to the origin as
//! `refs/corral/<id>`, so nothing is lost when the sandbox is destroyed.
//!
//! What the agent wrote is never read by host git. At the end the daemon
//! runs [`CAPTURE_SCRIPT`] *inside the sandbox* (as its uid, under its
//! seccomp filter, with its limits): it commits uncommitted work (a
//! snapshot), and writes a git bundle of the result to a file name the
//! agent cannot predict. Whatever the agent's `.git` makes git do (hooks,
//! fsmonitor, filters, gitfiles, alternates, a FIFO for HEAD) happens
//! inside the boundary. The host only copies that one regular file (opened
//! without following links, size-capped) into a private file and fetches
//! it into the origin with `fsckObjects`; every host git call runs with a
//! clean, fixed environment and a timeout.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

use super::repo::OpenRepo;

/// Why preparing or capturing a workspace failed: which git step, and git's
/// own message or why it did not run.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WorkspaceError(pub String);

/// How long any one host git call may take before it is killed.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(120);

/// The ref the capture bundle carries.
const CAPTURE_REF: &str = "refs/corral/capture";

/// Settings that override whatever the repository's own configuration
/// says (command-line configuration comes last, so it wins over the
/// repository's `config` and anything it includes), for every host git
/// call that runs in the origin. The origin belongs to a tenant, and host
/// git runs as the daemon: nothing in it may run a program or reach a
/// remote. Each one, from `git-config(1)`:
const OVERRIDES: &[&str] = &[
    // Hooks (`reference-transaction`, run when fetch updates a ref;
    // `pre-auto-gc`): the repository's `core.hooksPath` or `.git/hooks`.
    "core.hooksPath=/dev/null",
    // A program git would ask about changed files.
    "core.fsmonitor=false",
    // A shell command git runs (as `<cmd> <alternate path>`) to list the
    // refs of an alternate object store, in the connectivity check of a
    // fetch. `true` prints no refs: git then just walks a little further.
    "core.alternateRefsCommand=true",
    // Fetches into submodules, which would run git in their repositories
    // (and those fetch from wherever their remotes say).
    "fetch.recurseSubmodules=false",
    "submodule.recurse=false",
    // A bundle URI git would download (over http, or by a remote helper)
    // before fetching.
    "fetch.bundleURI=",
    // `git maintenance run --auto` / `git gc --auto` after a fetch: more
    // git processes, each reading the same configuration.
    "gc.auto=0",
    "maintenance.auto=false",
    // A fetch with pruning would delete refs/corral refs the bundle does not
    // carry.
    "fetch.prune=false",
    "fetch.pruneTags=false",
    // A commit-graph written on the origin's behalf: not ours to do.
    "fetch.writeCommitGraph=false",
    // No transport but local paths and bundles (`file`), whatever the
    // repository allows: `ext::` runs a command, `ssh` runs a program,
    // the others reach the network. A per-protocol setting beats
    // `protocol.allow`, so each one the repository could allow is named.
    "protocol.allow=never",
    "protocol.file.allow=always",
    "protocol.ext.allow=never",
    "protocol.ssh.allow=never",
    "protocol.git.allow=never",
    "protocol.http.allow=never",
    "protocol.https.allow=never",
    "protocol.ftp.allow=never",
    "protocol.ftps.allow=never",
];

/// A git command that trusts nothing in the repositories it touches: no
/// system or global config, no hooks, no fsmonitor, no prompts, none of
/// the repository's settings that run a program or reach a remote
/// ([`OVERRIDES`]).
fn git() -> Command {
    let mut cmd = Command::new("git");
    cmd.env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_NO_LAZY_FETCH", "1")
        .env("LANG", "C")
        .args(OVERRIDES.iter().flat_map(|o| ["-c", o]))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// `-c safe.directory=…` for each of `dirs`, work tree and `.git` both:
/// the repositories host git may trust though another user owns them, and
/// no other. Command-line config is protected config: a repository cannot
/// set it.
fn safe_directories(dirs: &[&Path]) -> Vec<String> {
    dirs.iter()
        .flat_map(|dir| [dir.to_path_buf(), dir.join(".git")])
        .flat_map(|dir| ["-c".to_string(), format!("safe.directory={}", dir.display())])
        .collect()
}

/// A host git command run in the daemon's own fresh clone at `workspace`,
/// before the sandbox has run anything (its directory may already belong
/// to the sandbox's uid).
fn git_in_fresh_clone(workspace: &Path) -> Command {
    let mut cmd = git();
    cmd.args(safe_directories(&[workspace])).arg("-C").arg(workspace);
    cmd
}

/// A host git command run on `repo`'s git directory, the one opened
/// beneath it (see [`OpenRepo`]): git is handed that open directory as
/// `--git-dir` and never looks for a repository itself, so neither a
/// `.git` that leads elsewhere nor a parent repository is ever reached. It
/// runs in `/`: these commands need no work tree.
fn git_in(repo: &OpenRepo) -> Command {
    let mut cmd = git();
    cmd.args(safe_directories(&[&repo.git_dir_proc_path(), repo.canonical_git_dir()]))
        .arg(format!("--git-dir={}", repo.git_dir_proc_path().display()))
        .current_dir("/");
    cmd
}

/// Runs a host git command with [`GIT_TIMEOUT`]: past it, git is killed
/// and the call fails saying so.
async fn run(mut cmd: Command, what: &str) -> Result<String, WorkspaceError> {
    let output = match tokio::time::timeout(GIT_TIMEOUT, cmd.output()).await {
        Ok(output) => output.map_err(|e| WorkspaceError(format!("{what}: cannot run git: {e}")))?,
        Err(_) => return Err(WorkspaceError(format!("{what}: git did not finish within {GIT_TIMEOUT:?}"))),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(WorkspaceError(format!("{what}: {}", stderr.trim())));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Whether `repo` is a git repository: the top of a work tree (its `.git`
/// a repository) or a bare repository. A directory inside a repository is
/// not one: git is told where the repository is and does not look above.
pub async fn is_git_repo(repo: &OpenRepo) -> bool {
    let mut cmd = git_in(repo);
    cmd.args(["rev-parse", "--git-dir"]);
    run(cmd, "rev-parse").await.is_ok()
}

/// Clones `repo` (a canonical path that passed [`super::repo::resolve`])
/// into the (empty) `workspace` and returns the HEAD commit it started from
/// (empty for a repository with no commits).
///
/// The workspace gets only what the origin's HEAD branch reaches: the
/// clone goes through `git upload-pack` (`--no-local`), which sends the
/// objects of the refs asked for and nothing else, on one branch, without
/// tags. A local clone would copy every object of the origin, including
/// those that earlier agents' work brought back under `refs/corral/*` —
/// another tenant's commits. The origin is opened again without following
/// any symlink (see [`OpenRepo::reopen`]).
pub async fn clone_into(repo: &Path, workspace: &Path) -> Result<String, WorkspaceError> {
    let origin =
        OpenRepo::reopen(repo).map_err(|e| WorkspaceError(format!("clone: the repository cannot be opened: {e}")))?;
    // upload-pack runs with the environment a local transport gives it,
    // which drops command-line config: it gets its own safe.directory and
    // overrides. It is given the open git directory, `--strict`, so it
    // takes that directory as it is instead of trying `<dir>/.git` and
    // `<dir>.git` first. The `/proc/<pid>/fd/<n>` path and the overrides
    // (asserted by a test) have no character a shell would read; the
    // canonical path might, so it is left out.
    let upload_pack = format!(
        "git {} {} upload-pack --strict",
        OVERRIDES.iter().map(|o| format!("-c {o}")).collect::<Vec<_>>().join(" "),
        safe_directories(&[&origin.git_dir_proc_path()]).join(" ")
    );
    let mut cmd = git();
    cmd.args(["clone", "--quiet", "--no-local", "--single-branch", "--no-tags", "--upload-pack"])
        .arg(&upload_pack)
        .arg("--")
        .arg(origin.git_dir_proc_path())
        .arg(workspace);
    run(cmd, "clone").await?;
    // The origin as the agent would know it (it cannot reach it).
    let mut cmd = git_in_fresh_clone(workspace);
    cmd.args(["remote", "set-url", "origin"]).arg(origin.canonical());
    run(cmd, "remote set-url").await?;
    // Still the daemon's own, untouched clone: safe to read.
    let mut cmd = git_in_fresh_clone(workspace);
    cmd.args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]);
    Ok(run(cmd, "rev-parse HEAD").await.unwrap_or_default())
}

/// Gives the cloned workspace to the sandbox's user: every entry is
/// re-owned without following symlinks.
pub fn hand_over(workspace: &Path, user: Option<crate::sandbox::HostUser>) -> Result<(), WorkspaceError> {
    let Some(user) = user else { return Ok(()) };
    let mut stack = vec![workspace.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).map_err(|e| WorkspaceError(format!("{}: {e}", path.display())))?;
        std::os::unix::fs::lchown(&path, Some(user.uid), Some(user.gid))
            .map_err(|e| WorkspaceError(format!("chown {}: {e}", path.display())))?;
        if meta.is_dir() {
            let entries = std::fs::read_dir(&path).map_err(|e| WorkspaceError(format!("{}: {e}", path.display())))?;
            for entry in entries {
                stack.push(entry.map_err(|e| WorkspaceError(e.to_string()))?.path());
            }
        }
    }
    Ok(())
}

/// Run inside the sandbox at the end (`/bin/sh -c`, in the workspace), with `CAPTURE_BASE`
/// (the commit the workspace started from), `CAPTURE_OUT` (where to write
/// the bundle), `CAPTURE_SNAPSHOT` (`1` to commit uncommitted work) and
/// `CAPTURE_MESSAGE` in its environment. It prints `SNAPSHOT`, `HEAD
/// <sha>`, `COMMITS <n>` (commits the agent made) and `BUNDLE` lines, or
/// `CAPTURE-ERROR <why>` and exits non-zero.
pub const CAPTURE_SCRIPT: &str = r#"
fail() { echo "CAPTURE-ERROR $*"; exit 3; }
g() { git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.attributesFile=/dev/null -c gc.auto=0 -c maintenance.auto=false "$@"; }
[ -d .git ] && [ ! -L .git ] || fail ".git is not a directory (a gitfile or a symlink)"
[ ! -e .git/objects/info/alternates ] || fail ".git/objects/info/alternates points outside the workspace"
[ ! -e .git/commondir ] || fail ".git/commondir points outside the workspace"
for d in .git/objects .git/refs; do [ -d "$d" ] && [ ! -L "$d" ] || fail "$d is not a directory"; done
agent_commits=0
head=$(g rev-parse --verify -q 'HEAD^{commit}') || head=""
if [ -n "$head" ]; then
  if [ -n "$CAPTURE_BASE" ]; then agent_commits=$(g rev-list --count "$head" "^$CAPTURE_BASE" 2>/dev/null || g rev-list --count "$head"); else agent_commits=$(g rev-list --count "$head"); fi
fi
if [ "$CAPTURE_SNAPSHOT" = 1 ] && [ -n "$(g status --porcelain --untracked-files=all 2>/dev/null | head -c 1)" ]; then
  g add -A || fail "git add failed"
  GIT_AUTHOR_NAME="$CAPTURE_NAME" GIT_AUTHOR_EMAIL="$CAPTURE_EMAIL" GIT_COMMITTER_NAME="$CAPTURE_NAME" GIT_COMMITTER_EMAIL="$CAPTURE_EMAIL" \
    g commit -q --no-verify --allow-empty-message -m "$CAPTURE_MESSAGE" || fail "snapshot commit failed"
  echo SNAPSHOT
  head=$(g rev-parse --verify -q 'HEAD^{commit}') || fail "no HEAD after the snapshot"
fi
[ -n "$head" ] || { echo "HEAD"; echo "COMMITS 0"; exit 0; }
echo "HEAD $head"
echo "COMMITS $agent_commits"
[ "$head" != "$CAPTURE_BASE" ] || exit 0
g update-ref "refs/corral/capture" "$head" || fail "update-ref failed"
if [ -n "$CAPTURE_BASE" ] && g cat-file -e "$CAPTURE_BASE^{commit}" 2>/dev/null; then
  g bundle create -q "$CAPTURE_OUT" refs/corral/capture "^$CAPTURE_BASE" || fail "git bundle failed"
else
  g bundle create -q "$CAPTURE_OUT" refs/corral/capture || fail "git bundle failed"
fi
echo BUNDLE
"#;

/// What the capture script reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capture {
    /// The workspace's HEAD after any snapshot (empty: no commit at all).
    pub head: String,
    /// Uncommitted work was committed by the daemon.
    pub snapshot: bool,
    /// Commits the agent made on top of the base.
    pub agent_commits: u64,
    /// A bundle was written (HEAD moved).
    pub bundle: bool,
}

impl Capture {
    /// Parses the script's output; `CAPTURE-ERROR` and garbage are errors.
    pub fn parse(stdout: &str) -> Result<Capture, WorkspaceError> {
        let mut capture = Capture::default();
        let mut saw_head = false;
        for line in stdout.lines() {
            if let Some(why) = line.strip_prefix("CAPTURE-ERROR ") {
                return Err(WorkspaceError(why.to_string()));
            } else if line == "SNAPSHOT" {
                capture.snapshot = true;
            } else if line == "BUNDLE" {
                capture.bundle = true;
            } else if let Some(head) = line.strip_prefix("HEAD").map(str::trim) {
                if !head.is_empty() && !is_hex_id(head) {
                    return Err(WorkspaceError(format!("capture reported a bad HEAD {head:?}")));
                }
                capture.head = head.to_string();
                saw_head = true;
            } else if let Some(n) = line.strip_prefix("COMMITS ") {
                capture.agent_commits = n.trim().parse().map_err(|_| WorkspaceError(format!("bad count {n:?}")))?;
            }
        }
        if !saw_head {
            return Err(WorkspaceError("the capture in the sandbox reported nothing".into()));
        }
        Ok(capture)
    }
}

fn is_hex_id(text: &str) -> bool {
    matches!(text.len(), 40 | 64) && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Copies the bundle the sandbox wrote at `path` into `private` (a file
/// only the daemon can reach): `path` must be a regular file (never
/// followed through a link) of at most `max_bytes`.
pub fn take_bundle(path: &Path, private: &Path, max_bytes: u64) -> Result<(), WorkspaceError> {
    let err = |e: std::io::Error| WorkspaceError(format!("capture bundle: {e}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    if !meta.is_file() {
        return Err(WorkspaceError("capture bundle: not a regular file".into()));
    }
    if meta.len() > max_bytes {
        return Err(WorkspaceError(format!("capture bundle: {} bytes, over the limit of {max_bytes}", meta.len())));
    }
    let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(private).map_err(err)?;
    // Read at most the limit, whatever the file grows to meanwhile.
    std::io::copy(&mut file.take(max_bytes + 1), &mut out).map_err(err)?;
    if out.metadata().map_err(err)?.len() > max_bytes {
        return Err(WorkspaceError(format!("capture bundle: over the limit of {max_bytes} bytes")));
    }
    Ok(())
}

/// What one origin may hold for a fetch back to be made into it: runs
/// cannot grow a shared repository without bound.
#[derive(Clone, Copy, Debug)]
pub struct OriginRoom {
    /// `refs/corral/*` refs.
    pub max_refs: u64,
    /// Bytes of objects on disk (loose and packed), bundle included.
    pub max_bytes: u64,
}

/// Whether `origin` has room for a bundle of `bundle_bytes`.
async fn check_room(origin: &OpenRepo, bundle_bytes: u64, room: OriginRoom) -> Result<(), WorkspaceError> {
    let refs = ref_names(origin).await?.len() as u64;
    if refs >= room.max_refs {
        return Err(WorkspaceError(format!(
            "the repository holds {refs} refs/corral refs, the most git.max_capture_refs allows: \
             delete old ones (git update-ref -d refs/corral/<id>) to bring work back again"
        )));
    }
    let mut cmd = git_in(origin);
    cmd.args(["count-objects", "-v"]);
    let counts = run(cmd, "count-objects").await?;
    let kib: u64 = counts
        .lines()
        .filter_map(|l| l.strip_prefix("size: ").or_else(|| l.strip_prefix("size-pack: ")))
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum();
    let bytes = kib.saturating_mul(1024).saturating_add(bundle_bytes);
    if bytes > room.max_bytes {
        return Err(WorkspaceError(format!(
            "the repository's objects would take {bytes} bytes, over git.max_origin_bytes ({}): \
             prune refs/corral and gc it to bring work back again",
            room.max_bytes
        )));
    }
    Ok(())
}

/// The names below `refs/corral/` that the repository `origin` holds
/// (`<id>`, or `<principal>/<id>` for a session).
pub async fn ref_names(origin: &OpenRepo) -> Result<Vec<String>, WorkspaceError> {
    let mut cmd = git_in(origin);
    cmd.args(["for-each-ref", "--format=%(refname)", "refs/corral/"]);
    let refs = run(cmd, "for-each-ref").await?;
    Ok(refs.lines().filter_map(|l| l.strip_prefix("refs/corral/")).map(str::to_string).collect())
}

/// One fetch back into a repository at a time in this daemon, in the
/// order they asked: held from the checks of its room (and of the
/// principal's share) to the end of the fetch, so runs finishing at once
/// cannot each see room for one more ref and all take it. Nothing outside
/// the daemon can hold it (a lock on a file in the repository could be
/// taken by any user who can read it, a `none` sandbox's agent among them).
#[derive(Default)]
pub struct OriginLocks {
    /// By canonical git directory; an entry goes once nobody holds or
    /// waits for its lock.
    held: std::sync::Mutex<std::collections::HashMap<PathBuf, std::sync::Weak<tokio::sync::Mutex<()>>>>,
}

/// One repository's turn (see [`OriginLocks`]), with the repository open:
/// what is counted and fetched into under it.
pub struct OriginLock {
    /// The repository, opened once for its turn.
    pub repo: OpenRepo,
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl OriginLocks {
    /// Waits for `origin`'s turn (tokio's mutex is first come, first
    /// served), or until `stop`.
    pub async fn lock(
        &self,
        origin: &Path,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<OriginLock, WorkspaceError> {
        let repo = OpenRepo::reopen(origin)
            .map_err(|e| WorkspaceError(format!("fetch back: the repository cannot be opened: {e}")))?;
        let key = repo.canonical_git_dir().to_path_buf();
        let turn = {
            let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            held.retain(|_, lock| lock.strong_count() > 0);
            match held.get(&key).and_then(std::sync::Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = std::sync::Arc::new(tokio::sync::Mutex::new(()));
                    held.insert(key, std::sync::Arc::downgrade(&lock));
                    lock
                }
            }
        };
        tokio::select! {
            turn = turn.lock_owned() => Ok(OriginLock { repo, _turn: turn }),
            () = stop.cancelled() => Err(WorkspaceError("fetch back: stopped waiting for the repository".into())),
        }
    }
}

/// Verifies the private bundle and fetches it into `origin` as
/// `refs/corral/<name>` if the origin has `room`; returns the commit it
/// brought (the one the daemon saw in the bundle, not what anyone claimed).
pub async fn fetch_bundle(
    origin: &OpenRepo,
    bundle: &Path,
    name: &str,
    room: OriginRoom,
) -> Result<String, WorkspaceError> {
    let bundle_bytes = std::fs::metadata(bundle).map(|m| m.len()).unwrap_or(0);
    check_room(origin, bundle_bytes, room).await?;
    let mut cmd = git_in(origin);
    cmd.args(["bundle", "list-heads"]).arg(bundle).arg(CAPTURE_REF);
    let heads = run(cmd, "bundle list-heads").await?;
    let commit = heads
        .lines()
        .find_map(|l| l.strip_suffix(CAPTURE_REF).map(str::trim).filter(|id| is_hex_id(id)))
        .ok_or_else(|| WorkspaceError("capture bundle names no commit".into()))?
        .to_string();
    // The origin's `url.<base>.insteadOf` would rewrite the bundle's path
    // into any URL (`ext::<command>`, another repository); the longest
    // match wins, so the path pinned to itself wins over every prefix of
    // it. A name no one can predict (a hard link beside the bundle) means
    // no rule of the origin's can match it exactly.
    let pinned = bundle.with_file_name(format!(
        "{}.{}",
        bundle.file_name().and_then(|n| n.to_str()).unwrap_or("bundle"),
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::hard_link(bundle, &pinned).map_err(|e| WorkspaceError(format!("fetch back: {e}")))?;
    let _unlink = RemoveOnDrop(&pinned);
    let mut cmd = git_in(origin);
    // The key holds a path: given by the environment, which takes it as
    // it is (`-c` would split it at a `=`).
    cmd.env("GIT_CONFIG_COUNT", "1")
        .env("GIT_CONFIG_KEY_0", format!("url.{}.insteadOf", pinned.display()))
        .env("GIT_CONFIG_VALUE_0", &pinned)
        .args(["-c", "fetch.fsckObjects=true", "-c", "transfer.fsckObjects=true"])
        .args(["fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--no-recurse-submodules"])
        .args(["--no-auto-maintenance", "--no-prune"])
        .arg(&pinned)
        .arg(format!("+{CAPTURE_REF}:refs/corral/{name}"));
    run(cmd, "fetch back").await?;
    Ok(commit)
}

/// Removes a file when dropped: the fetch back's link to the bundle goes
/// whether the fetch ends, fails or is abandoned.
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Where the capture bundle goes: inside the sandbox's HOME (`home` on the
/// host, `inside_home` in the sandbox), under a name the agent cannot
/// predict. Returns (host path, sandbox path).
pub fn bundle_paths(home: &Path, inside_home: &str) -> (PathBuf, String) {
    let name = format!(".corral-capture-{}.bundle", uuid::Uuid::now_v7().simple());
    (home.join(&name), format!("{inside_home}/{name}"))
}

/// Checks a read or write path as a profile or a policy names it, before
/// it is bound into a sandbox: no `..` component, and no NUL or other
/// control character (bwrap reads its arguments NUL-separated, so a NUL
/// would end the path and start an option of its own).
pub fn check_sandbox_path(path: &str) -> Result<(), String> {
    if path.chars().any(char::is_control) {
        return Err(format!("{path:?} must not contain a NUL or other control character"));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(format!("{path:?} must not contain '..'"));
    }
    Ok(())
}

/// Checks that a path a profile binds into its sandbox is not the host's
/// private keys (`/etc/ssl/private`), nor a directory holding them. (A
/// policy's paths only narrow a profile's: they bind nothing of their own.)
pub fn check_no_private_keys(path: &str) -> Result<(), String> {
    if path.starts_with('/') {
        let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
        let keys = ["etc", "ssl", "private"];
        let n = parts.len().min(keys.len());
        if parts[..n] == keys[..n] {
            return Err(format!("{path:?} would show the sandbox the host's private keys (/etc/ssl/private)"));
        }
    }
    Ok(())
}

/// Checks the name of a daemon environment variable a profile or a policy
/// passes through: not empty, no `=`, no NUL or other control character.
pub fn check_env_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.contains('=') || name.chars().any(char::is_control) {
        return Err(format!("{name:?} is not an environment variable name"));
    }
    Ok(())
}

/// Opens `relative` beneath `workspace` without following a symlink
/// anywhere on the way: each component is opened `O_PATH | O_NOFOLLOW`
/// from the directory before it, so a symlink the repository commits
/// (`out -> .`, `out -> /etc`) is refused, not followed. The path must
/// name a directory or a regular file; `..` is refused, empty and `.`
/// components are skipped. The descriptor is for bwrap to bind
/// (`--bind-fd`): what it binds is what was checked here.
pub fn open_beneath(workspace: &Path, relative: &str) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let components: Vec<&str> = relative.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    if components.is_empty() || components.contains(&"..") {
        return Err(invalid(format!("{relative:?} does not name a path beneath {}", workspace.display())));
    }
    let mut dir: OwnedFd =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_DIRECTORY).open(workspace)?.into();
    for (i, component) in components.iter().enumerate() {
        let name = std::ffi::CString::new(*component).map_err(|_| invalid(format!("{relative:?} holds a NUL byte")))?;
        // SAFETY: `dir` is an open descriptor and `name` a NUL-terminated
        // string, both alive for the call; the result is checked before use.
        let raw =
            unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor openat just returned, owned by no one else.
        let next = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        let kind = next.metadata()?.file_type();
        let last = i + 1 == components.len();
        let root = if relative.starts_with('/') { "/" } else { "" };
        let at = format!("{root}{}", components[..=i].join("/"));
        if kind.is_symlink() {
            return Err(invalid(format!("{at:?} is a symlink")));
        }
        let fits = kind.is_dir() || (last && kind.is_file());
        if !fits {
            let want = if last { "a directory or a regular file" } else { "a directory" };
            return Err(invalid(format!("{at:?} is not {want}")));
        }
        dir = next.into();
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_paths_open_beneath_the_workspace_and_never_through_a_symlink() {
        let ws = tempfile::tempdir().unwrap();
        let root = ws.path();
        std::fs::create_dir_all(root.join("out/deep")).unwrap();
        std::fs::write(root.join("file.txt"), "x").unwrap();
        std::os::unix::fs::symlink(".", root.join("dot")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("etc")).unwrap();
        std::os::unix::fs::symlink("out", root.join("a")).unwrap();
        std::os::unix::fs::symlink("/dev/null", root.join("null")).unwrap();
        for ok in ["out", "out/deep", "./out//deep/", "file.txt"] {
            assert!(open_beneath(root, ok).is_ok(), "{ok}");
        }
        for bad in ["dot", "etc", "etc/ssl", "a/deep", "out/../dot", "null", "missing", ".", "", "file.txt/x"] {
            assert!(open_beneath(root, bad).is_err(), "{bad}");
        }
        let error = open_beneath(root, "a/deep").unwrap_err().to_string();
        assert!(error.contains("\"a\" is a symlink"), "{error}");
    }

    #[test]
    fn sandbox_paths_and_env_names_refuse_nul_and_control_characters() {
        for bad in ["file.txt\0--share-net", "a\nb", "x/../y", "..", "\u{7f}"] {
            assert!(check_sandbox_path(bad).is_err(), "{bad:?}");
        }
        for ok in [".", "out", "/var/cache/x", "a/b.c", "/etc/ssl/certs", "/etc/sslx", "/etc/ssl/privatex", "etc/ssl"] {
            assert!(check_sandbox_path(ok).is_ok(), "{ok:?}");
        }
        for ok in [".", "out", "/var/cache/x", "a/b.c", "/etc/ssl/certs", "/etc/sslx", "/etc/ssl/privatex", "etc/ssl"] {
            assert!(check_no_private_keys(ok).is_ok(), "{ok:?}");
        }
        // The host's private keys, or a directory above them, whatever the spelling.
        for bad in ["/", "/etc", "/etc/", "/etc/ssl", "//etc/./ssl", "/etc/ssl/private", "/etc/ssl/private/k.pem"] {
            let error = check_no_private_keys(bad).unwrap_err();
            assert!(error.contains("private keys"), "{bad:?}: {error}");
        }
        for bad in ["", "A=B", "A\0B", "A\tB"] {
            assert!(check_env_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_env_name("ANTHROPIC_API_KEY").is_ok());
    }

    #[test]
    fn the_overrides_are_safe_in_the_upload_pack_command_line() {
        // `--upload-pack` is run by a shell: no override may hold a
        // character the shell would read.
        for o in OVERRIDES {
            assert!(o.bytes().all(|b| b.is_ascii_alphanumeric() || b"._=/-".contains(&b)), "{o}");
        }
    }

    #[test]
    fn capture_output_parses_and_refuses_what_it_must() {
        let sha = "a".repeat(40);
        let ok = Capture::parse(&format!("SNAPSHOT\nHEAD {sha}\nCOMMITS 2\nBUNDLE\n")).unwrap();
        assert_eq!(ok, Capture { head: sha.clone(), snapshot: true, agent_commits: 2, bundle: true });
        assert_eq!(Capture::parse("HEAD\nCOMMITS 0\n").unwrap(), Capture::default());
        let err = Capture::parse("CAPTURE-ERROR .git is not a directory (a gitfile or a symlink)\n").unwrap_err();
        assert!(err.0.contains("gitfile"));
        assert!(Capture::parse("").is_err(), "silence is not a capture");
        assert!(Capture::parse("HEAD ../../etc\n").is_err());
        assert!(Capture::parse(&format!("HEAD {sha}\nCOMMITS lots\n")).is_err());
    }

    #[test]
    fn a_bundle_is_taken_only_as_a_regular_file_within_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("b");
        std::fs::write(&real, b"0123456789").unwrap();
        take_bundle(&real, &dir.path().join("copy"), 10).unwrap();
        assert_eq!(std::fs::read(dir.path().join("copy")).unwrap(), b"0123456789");
        assert!(take_bundle(&real, &dir.path().join("small"), 9).is_err(), "over the limit");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(take_bundle(&link, &dir.path().join("via-link"), 100).is_err(), "followed a symlink");
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(take_bundle(&fifo, &dir.path().join("via-fifo"), 100).is_err(), "read a FIFO");
    }
}
