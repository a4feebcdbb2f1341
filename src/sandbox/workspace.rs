//! The workspace: a fresh clone of the request's repository, and the way a
//! harness's commit gets back to the origin before the sandbox is destroyed.
//!
//! The workspace's `.git` is written by an untrusted harness, so every git
//! command the daemon runs on it disables hooks and fsmonitor and ignores
//! system and global config.

use std::path::Path;

use tokio::process::Command;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WorkspaceError(pub String);

/// A git command that trusts nothing in the repositories it touches.
fn git() -> Command {
    let mut cmd = Command::new("git");
    cmd.env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_TERMINAL_PROMPT", "0")
        .args(["-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "protocol.file.allow=always"])
        // Workspaces belong to their sandbox's uid, not to the daemon; the
        // daemon only ever names repositories it chose. Command-line config
        // is protected config: a repository cannot set it.
        .args(["-c", "safe.directory=*"])
        .stdin(std::process::Stdio::null());
    cmd
}

async fn run(mut cmd: Command, what: &str) -> Result<String, WorkspaceError> {
    let output = cmd.output().await.map_err(|e| WorkspaceError(format!("{what}: cannot run git: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(WorkspaceError(format!("{what}: {}", stderr.trim())));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Whether `path` is a git repository (work tree or bare).
pub async fn is_git_repo(path: &Path) -> bool {
    let mut cmd = git();
    cmd.arg("-C").arg(path).args(["rev-parse", "--git-dir"]);
    run(cmd, "rev-parse").await.is_ok()
}

/// Clones `repo` into the (empty) `workspace` and returns the HEAD commit it
/// started from (empty for a repository with no commits).
///
/// `--no-hardlinks`: a local clone would otherwise share object files with
/// the origin, and a harness could rewrite them in place.
pub async fn clone_into(repo: &Path, workspace: &Path) -> Result<String, WorkspaceError> {
    let mut cmd = git();
    cmd.args(["clone", "--quiet", "--no-hardlinks", "--"]).arg(repo).arg(workspace);
    run(cmd, "clone").await?;
    Ok(head(workspace).await.unwrap_or_default())
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

/// The commit HEAD points at in `workspace`, as the daemon sees it.
pub async fn head(workspace: &Path) -> Result<String, WorkspaceError> {
    let mut cmd = git();
    cmd.arg("-C").arg(workspace).args(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"]);
    run(cmd, "rev-parse HEAD").await
}

/// Fetches the workspace's HEAD into `origin` as `refs/corral/<name>`.
pub async fn fetch_back(origin: &Path, workspace: &Path, name: &str) -> Result<(), WorkspaceError> {
    let mut cmd = git();
    cmd.arg("-C")
        .arg(origin)
        .args(["fetch", "--quiet", "--no-tags", "--no-write-fetch-head"])
        // A local fetch runs upload-pack with the caller's config scrubbed
        // from its environment: it gets the same protected settings here.
        .arg("--upload-pack=git -c safe.directory=* -c core.hooksPath=/dev/null -c core.fsmonitor=false upload-pack")
        .arg(workspace)
        .arg(format!("+HEAD:refs/corral/{name}"));
    run(cmd, "fetch back").await.map(|_| ())
}
