//! Where a run is, and what it holds there: the run's phase as one type
//! with guarded transitions (after youki's container state). What exists
//! in a phase lives in its variant — a sandbox only once it was made, a
//! harness only inside a sandbox — so `Core` cannot hold a harness without
//! a sandbox, or a sandbox after it was destroyed.
//!
//! ```text
//!   New ──resolve──▶ Resolved ──allow──▶ Allowed ──make sandbox──▶ Ready
//!                                                                   │ destroy
//!   (any) ──close──▶ Closed                      Destroyed ◀────────┘
//! ```
//!
//! A transition from any other phase is refused with [`PhaseError`] (a
//! bug in the lifecycle, logged; never a panic).

use std::sync::Arc;

use crate::catalog::Profile;
use crate::rein::HarnessSession;
use crate::sandbox::{Sandbox, SandboxBackend, SandboxSpec};

/// The phase of a run without its contents: what transitions are checked
/// against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseKind {
    New,
    Resolved,
    Allowed,
    Ready,
    Destroyed,
    Closed,
}

impl PhaseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PhaseKind::New => "new",
            PhaseKind::Resolved => "resolved",
            PhaseKind::Allowed => "allowed",
            PhaseKind::Ready => "ready",
            PhaseKind::Destroyed => "destroyed",
            PhaseKind::Closed => "closed",
        }
    }

    /// Whether a run may go from `self` to `to`: forward only, `Allowed`
    /// again from `Ready` (a restart goes through the gate again), `Closed`
    /// from anywhere.
    pub fn may_become(self, to: PhaseKind) -> bool {
        use PhaseKind::*;
        matches!(
            (self, to),
            (New, Resolved)
                | (Resolved, Allowed)
                | (Allowed, Ready)
                | (Ready, Allowed)
                | (Ready, Destroyed)
                | (_, Closed)
        )
    }
}

/// A transition the lifecycle asked for from the wrong phase.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a run cannot become {to} from {from}")]
pub struct PhaseError {
    pub from: &'static str,
    pub to: &'static str,
}

/// A run's harness inside its sandbox.
pub enum Harness {
    /// None was started yet.
    NotStarted,
    /// Started and here (it may have exited since: ask it).
    Here(Box<dyn HarnessSession>),
    /// Started, and out: being dispatched to, or cleaned up after it died.
    /// Its cleanup is owed or done by whoever took it.
    Out,
}

impl Harness {
    /// The harness, if it is here; it is `Out` from now on.
    pub fn take_here(&mut self) -> Option<Box<dyn HarnessSession>> {
        match std::mem::replace(self, Harness::Out) {
            Harness::Here(harness) => Some(harness),
            Harness::NotStarted => {
                *self = Harness::NotStarted;
                None
            }
            Harness::Out => None,
        }
    }
}

/// What a run holds once its sandbox exists.
pub struct Ready {
    pub profile: Arc<Profile>,
    /// The sandbox the gate's last agent_start decision allowed.
    pub effective: SandboxSpec,
    pub backend: Arc<dyn SandboxBackend>,
    pub sandbox: Sandbox,
    /// The workspace's commit when it was cloned (none without a repo).
    pub base_commit: Option<String>,
    pub harness: Harness,
}

/// The phase with what the run holds in it.
pub enum RunPhase {
    New,
    Resolved {
        profile: Arc<Profile>,
    },
    Allowed {
        profile: Arc<Profile>,
        effective: SandboxSpec,
    },
    Ready(Box<Ready>),
    /// The sandbox is gone (made, then destroyed after a failure); the
    /// run is not closed yet.
    Destroyed {
        profile: Arc<Profile>,
        effective: SandboxSpec,
        harness_started: bool,
    },
    /// Torn down. What it was resolved to and allowed is kept for the record.
    Closed {
        profile: Option<Arc<Profile>>,
        effective: Option<SandboxSpec>,
    },
}

impl RunPhase {
    pub fn kind(&self) -> PhaseKind {
        match self {
            RunPhase::New => PhaseKind::New,
            RunPhase::Resolved { .. } => PhaseKind::Resolved,
            RunPhase::Allowed { .. } => PhaseKind::Allowed,
            RunPhase::Ready(_) => PhaseKind::Ready,
            RunPhase::Destroyed { .. } => PhaseKind::Destroyed,
            RunPhase::Closed { .. } => PhaseKind::Closed,
        }
    }

    fn check(&self, to: PhaseKind) -> Result<(), PhaseError> {
        match self.kind().may_become(to) {
            true => Ok(()),
            false => Err(PhaseError { from: self.kind().as_str(), to: to.as_str() }),
        }
    }

    /// The profile, from resolution on.
    pub fn profile(&self) -> Option<&Arc<Profile>> {
        match self {
            RunPhase::New => None,
            RunPhase::Resolved { profile }
            | RunPhase::Allowed { profile, .. }
            | RunPhase::Destroyed { profile, .. } => Some(profile),
            RunPhase::Ready(ready) => Some(&ready.profile),
            RunPhase::Closed { profile, .. } => profile.as_ref(),
        }
    }

    /// The sandbox the gate allowed, from the gate's allow on.
    pub fn effective(&self) -> Option<&SandboxSpec> {
        match self {
            RunPhase::New | RunPhase::Resolved { .. } => None,
            RunPhase::Allowed { effective, .. } | RunPhase::Destroyed { effective, .. } => Some(effective),
            RunPhase::Ready(ready) => Some(&ready.effective),
            RunPhase::Closed { effective, .. } => effective.as_ref(),
        }
    }

    /// The sandbox, while it exists.
    pub fn ready(&self) -> Option<&Ready> {
        match self {
            RunPhase::Ready(ready) => Some(ready),
            _ => None,
        }
    }

    pub fn ready_mut(&mut self) -> Option<&mut Ready> {
        match self {
            RunPhase::Ready(ready) => Some(ready),
            _ => None,
        }
    }

    /// Whether a harness was ever started (so its cleanup is owed).
    pub fn harness_started(&self) -> bool {
        match self {
            RunPhase::Ready(ready) => !matches!(ready.harness, Harness::NotStarted),
            RunPhase::Destroyed { harness_started, .. } => *harness_started,
            _ => false,
        }
    }

    /// New → Resolved.
    pub fn resolve(&mut self, profile: Arc<Profile>) -> Result<(), PhaseError> {
        self.check(PhaseKind::Resolved)?;
        *self = RunPhase::Resolved { profile };
        Ok(())
    }

    /// Resolved → Allowed; in Ready (a restart's decision), the allowed
    /// sandbox is replaced and the run stays Ready.
    pub fn allow(&mut self, effective: SandboxSpec) -> Result<(), PhaseError> {
        self.check(PhaseKind::Allowed)?;
        match std::mem::replace(self, RunPhase::New) {
            RunPhase::Resolved { profile } => *self = RunPhase::Allowed { profile, effective },
            RunPhase::Ready(mut ready) => {
                ready.effective = effective;
                *self = RunPhase::Ready(ready);
            }
            _ => unreachable!("checked above"),
        }
        Ok(())
    }

    /// Allowed → Ready: the sandbox exists.
    pub fn sandbox_made(&mut self, backend: Arc<dyn SandboxBackend>, sandbox: Sandbox) -> Result<(), PhaseError> {
        self.check(PhaseKind::Ready)?;
        let RunPhase::Allowed { profile, effective } = std::mem::replace(self, RunPhase::New) else {
            unreachable!("checked above")
        };
        let ready = Ready { profile, effective, backend, sandbox, base_commit: None, harness: Harness::NotStarted };
        *self = RunPhase::Ready(Box::new(ready));
        Ok(())
    }

    /// Ready → Destroyed: hands over the sandbox (and the harness, if one
    /// is here) for the caller to destroy — at most once, since the phase
    /// no longer holds it.
    pub fn take_sandbox(&mut self) -> Result<Box<Ready>, PhaseError> {
        self.check(PhaseKind::Destroyed)?;
        let RunPhase::Ready(ready) = std::mem::replace(self, RunPhase::New) else { unreachable!("checked above") };
        let harness_started = !matches!(ready.harness, Harness::NotStarted);
        *self =
            RunPhase::Destroyed { profile: ready.profile.clone(), effective: ready.effective.clone(), harness_started };
        Ok(ready)
    }

    /// Any phase → Closed; `None` when the run was closed already.
    pub fn close(&mut self) -> Option<RunPhase> {
        if self.kind() == PhaseKind::Closed {
            return None;
        }
        let closed = RunPhase::Closed { profile: self.profile().cloned(), effective: self.effective().cloned() };
        Some(std::mem::replace(self, closed))
    }
}

#[cfg(test)]
mod tests {
    use super::PhaseKind::{self, *};

    const ALL: [PhaseKind; 6] = [New, Resolved, Allowed, Ready, Destroyed, Closed];

    #[test]
    fn the_transitions_are_exactly_the_drawn_ones() {
        let allowed: Vec<(PhaseKind, PhaseKind)> = ALL
            .iter()
            .flat_map(|&from| ALL.iter().map(move |&to| (from, to)))
            .filter(|(f, t)| f.may_become(*t))
            .collect();
        assert_eq!(
            allowed,
            vec![
                (New, Resolved),
                (New, Closed),
                (Resolved, Allowed),
                (Resolved, Closed),
                (Allowed, Ready),
                (Allowed, Closed),
                (Ready, Allowed),
                (Ready, Destroyed),
                (Ready, Closed),
                (Destroyed, Closed),
                (Closed, Closed),
            ]
        );
    }

    #[test]
    fn a_refused_transition_names_both_phases_and_changes_nothing() {
        let mut phase = super::RunPhase::New;
        let error = phase.allow(crate::sandbox::SandboxSpec::default()).unwrap_err();
        assert_eq!(error.to_string(), "a run cannot become allowed from new");
        assert_eq!(phase.kind(), New);
        assert!(phase.take_sandbox().is_err());
        assert_eq!(phase.kind(), New);
        assert!(phase.close().is_some(), "closing a new run is allowed");
        assert_eq!(phase.kind(), Closed);
        assert!(phase.close().is_none(), "and happens once");
        assert!(phase.profile().is_none() && phase.effective().is_none() && !phase.harness_started());
    }
}
