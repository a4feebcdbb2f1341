//! Resolution as an execution does it, for the dry runs
//! (`CatalogService.ResolveProfile` and `EvaluateGate`): a profile they
//! call fine must not be refused at resolution when it is executed.

use std::sync::Arc;

use super::Engine;
use crate::catalog::{check_actor, Profile, Refusal};

impl Engine {
    /// Resolves `profile_ref` with every rule an execution applies at its
    /// stage `resolution`, before any sandbox exists: the actor (when one
    /// is given), the catalog's rule 1, every credential route the profile
    /// needs readable now, and this node's `[fleet] labels` covering its
    /// `[placement]` (on a single node; a fleet places at Execute). The
    /// refusal's text is the one the execution records.
    pub fn resolve_for_run(&self, actor: Option<&str>, profile_ref: &str) -> Result<Arc<Profile>, Refusal> {
        // On a fleet the placement is the fleet's: Execute queues the run
        // for a live node that has the labels (UNAVAILABLE NO_NODE_CAN_RUN,
        // "retry later", while none has), so this node's own labels refuse
        // nothing there.
        self.resolve_checked(actor, profile_ref, !self.store.is_shared())
    }

    /// The rules of [`Engine::resolve_for_run`], in that order; this node's
    /// labels are checked when `placed_here` (the run would run here: an
    /// execution's own resolution always is).
    pub(super) fn resolve_checked(
        &self,
        actor: Option<&str>,
        profile_ref: &str,
        placed_here: bool,
    ) -> Result<Arc<Profile>, Refusal> {
        if let Some(actor) = actor {
            check_actor(actor)?;
        }
        let profile = self.catalog.resolve(profile_ref)?;
        if let Err(why) = self.credentials.check(&profile.file.credential_route_refs) {
            return Err(Refusal(format!("profile {} cannot run: {why}", profile.reference())));
        }
        if placed_here {
            if let Some(why) = self.misplaced(&profile) {
                return Err(Refusal(why));
            }
        }
        Ok(profile)
    }
}
