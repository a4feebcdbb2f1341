//! The end of a run's workspace: the capture script runs inside the
//! sandbox (see [`workspace::CAPTURE_SCRIPT`]), and the one bundle it wrote
//! is taken into a daemon-private file and fetched into the origin.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;

use crate::catalog::GitSettings;
use crate::sandbox::workspace::{self, Capture, WorkspaceError};
use crate::sandbox::{Consumer, ExecSpec, Sandbox, SandboxBackend, SandboxType};

/// The capture script's output is a few lines; more is not read.
const MAX_CAPTURE_OUTPUT: u64 = 64 << 10;

/// What the capture brought back.
#[derive(Debug, Default)]
pub struct Captured {
    pub capture: Capture,
    /// The commit now at `refs/corral/<name>` in the origin (empty when the
    /// workspace's HEAD did not move).
    pub fetched: String,
}

pub struct CaptureJob<'a> {
    pub backend: Arc<dyn SandboxBackend>,
    pub sandbox: &'a Sandbox,
    pub consumer: &'a Consumer,
    pub git: &'a GitSettings,
    /// The commit the workspace started from.
    pub base: &'a str,
    pub origin: &'a Path,
    /// `refs/corral/<name>`.
    pub name: &'a str,
    /// A daemon-private path for the bundle's copy.
    pub private: &'a Path,
    /// One fetch back into a repository at a time.
    pub locks: &'a workspace::OriginLocks,
    pub timeout: Duration,
    pub max_bundle_bytes: u64,
    /// What the origin may hold (see [`workspace::OriginRoom`]).
    pub room: workspace::OriginRoom,
    /// The daemon's shutdown grace is over: stop now.
    pub stop: tokio_util::sync::CancellationToken,
    /// The run's principal's part of the origin's refs; `None` for the
    /// local administrator.
    pub share: Option<PrincipalShare<'a>>,
}

/// One principal's part of the `refs/corral/*` refs an origin may hold
/// (`git.max_capture_refs_per_principal`): those naming its executions
/// and sessions. A tenant sharing a repository with others cannot use up
/// `git.max_capture_refs` for all of them.
pub struct PrincipalShare<'a> {
    pub store: &'a crate::store::Store,
    pub principal: &'a str,
    pub refs: u64,
}

impl PrincipalShare<'_> {
    /// Whether the principal may have one more ref in `origin`.
    async fn check(&self, origin: &crate::sandbox::repo::OpenRepo) -> Result<(), WorkspaceError> {
        let names = workspace::ref_names(origin).await?;
        // A session's own id is `<principal>/<id>`; the rest are run ids.
        let scoped = format!("{}/", self.principal);
        let (mine, ids): (Vec<String>, Vec<String>) = names.into_iter().partition(|n| n.starts_with(&scoped));
        let ids: Vec<String> = ids.into_iter().filter(|n| !n.contains('/')).collect();
        let owned = self.store.count_owned(self.principal, &ids).await.map_err(|e| {
            WorkspaceError(format!("fetch back: the principal's refs in the repository cannot be counted: {e}"))
        })?;
        let held = mine.len() as u64 + owned;
        if held >= self.refs {
            return Err(WorkspaceError(format!(
                "principal {} holds {held} of the repository's refs/corral refs, its share \
                 (git.max_capture_refs_per_principal = {}): delete old ones (git update-ref -d refs/corral/<id>) \
                 to bring its work back again",
                self.principal, self.refs
            )));
        }
        Ok(())
    }
}

impl CaptureJob<'_> {
    pub async fn run(self) -> Result<Captured, WorkspaceError> {
        let inside_home = match self.sandbox.backend {
            SandboxType::LinuxBwrap => crate::sandbox::HOME_MOUNT.to_string(),
            SandboxType::None => self.sandbox.home.to_string_lossy().into_owned(),
        };
        let (host_bundle, inside_bundle) = workspace::bundle_paths(&self.sandbox.home, &inside_home);
        let message = format!("corral: snapshot of the workspace of {}", self.name);
        let (name, email) = self.git.snapshot_identity();
        let spec = ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), workspace::CAPTURE_SCRIPT.into()],
            env: vec![
                ("CAPTURE_BASE".into(), self.base.into()),
                ("CAPTURE_OUT".into(), inside_bundle),
                ("CAPTURE_SNAPSHOT".into(), if self.git.snapshot { "1" } else { "0" }.into()),
                ("CAPTURE_MESSAGE".into(), message),
                ("CAPTURE_NAME".into(), name),
                ("CAPTURE_EMAIL".into(), email),
                ("GIT_NO_LAZY_FETCH".into(), "1".into()),
                ("GIT_TERMINAL_PROMPT".into(), "0".into()),
                // The capture runs with the whole workspace writable; the
                // agent's HOME was writable all run long. Configuration it
                // could write there (a filter, `commit.gpgSign`, an
                // attributes file) must not run with more than the run had:
                // only the workspace's own `.git` configures this git.
                ("GIT_CONFIG_GLOBAL".into(), "/dev/null".into()),
                ("GIT_CONFIG_NOSYSTEM".into(), "1".into()),
                ("GIT_ATTR_NOSYSTEM".into(), "1".into()),
                ("XDG_CONFIG_HOME".into(), "/dev/null".into()),
            ],
            consumer: self.consumer.clone(),
            credential_route_refs: Vec::new(),
            timeout: self.timeout,
        };
        let stdout = self.run_in_sandbox(&spec).await?;
        let capture = Capture::parse(&stdout)?;
        if !capture.bundle {
            return Ok(Captured { capture, fetched: String::new() });
        }
        let taken = workspace::take_bundle(&host_bundle, self.private, self.max_bundle_bytes);
        let fetched = match taken {
            Ok(()) => self.fetch_in_turn().await,
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(self.private);
        let fetched = fetched?;
        if fetched != capture.head {
            return Err(WorkspaceError(format!("the bundle holds {fetched}, the capture reported {}", capture.head)));
        }
        Ok(Captured { capture, fetched })
    }

    /// Fetches the bundle into the origin in its turn: the principal's
    /// share and the origin's room are counted, and the ref taken, under
    /// one lock, in the repository it opened.
    async fn fetch_in_turn(&self) -> Result<String, WorkspaceError> {
        let turn = self.locks.lock(self.origin, &self.stop).await?;
        if let Some(share) = &self.share {
            share.check(&turn.repo).await?;
        }
        workspace::fetch_bundle(&turn.repo, self.private, self.name, self.room).await
    }

    /// Spawns the capture in the sandbox, reads its stdout, and kills it
    /// (through the whole process group) past the timeout.
    async fn run_in_sandbox(&self, spec: &ExecSpec) -> Result<String, WorkspaceError> {
        // The capture writes `.git` (a snapshot's objects and refs), which
        // a run allowed to write only some paths of its workspace had
        // read-only: it runs with the whole workspace writable, in a
        // sandbox otherwise the run's. Nothing of the agent's runs in it
        // (hooks and fsmonitor off; no configuration from its HOME; a
        // filter configured in `.git`, which the run could write only if
        // its workspace was writable, runs as the agent, in the sandbox,
        // as the agent's own could).
        let mut sandbox = self.sandbox.clone();
        sandbox.spec.write_paths = vec![".".into()];
        let mut process =
            self.backend.spawn(&sandbox, spec).await.map_err(|e| WorkspaceError(format!("capture: {e}")))?;
        drop(process.stdin.take());
        if let Some(mut stderr) = process.stderr.take() {
            // Drained and dropped: git's complaints must not block it.
            tokio::spawn(async move {
                while let Ok(n) = stderr.read(&mut [0u8; 4096]).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
        let stdout = process.stdout.take();
        let read = async {
            let mut text = Vec::new();
            if let Some(pipe) = stdout {
                let _ = pipe.take(MAX_CAPTURE_OUTPUT).read_to_end(&mut text).await;
            }
            let status = process.wait().await;
            (text, status)
        };
        let outcome = tokio::select! {
            done = tokio::time::timeout(self.timeout, read) => done.map_err(|_| {
                format!("the capture of the workspace did not finish within {:?}", self.timeout)
            }),
            _ = self.stop.cancelled() => Err("the daemon's shutdown grace ended the capture of the workspace".into()),
        };
        match outcome {
            Ok((text, _)) => Ok(String::from_utf8_lossy(&text).into_owned()),
            Err(why) => {
                let _ = process.kill().await;
                Err(WorkspaceError(why))
            }
        }
    }
}
