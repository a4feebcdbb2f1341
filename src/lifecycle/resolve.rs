//! Resolution as an execution does it, for the dry runs
//! (`CatalogService.ResolveProfile` and `EvaluateGate`): a profile they
//! call fine must not be refused at resolution when it is executed.

use std::sync::Arc;

use super::{missing_labels, Engine};
use crate::catalog::{check_actor, Catalog, Profile, Refusal};
use crate::credentials::CredentialsConfig;

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
        let rules = Resolution {
            catalog: &self.catalog,
            credentials: &self.credentials,
            node: self.store.node(),
            labels: &self.fleet.labels,
        };
        rules.resolve(actor, profile_ref, placed_here)
    }
}

/// What resolution reads on a node: the daemon's, and `corral doctor`'s
/// (which reads a config the way the daemon would), so both refuse alike.
pub struct Resolution<'a> {
    /// The profiles.
    pub catalog: &'a Catalog,
    /// The credential routes, each read now.
    pub credentials: &'a CredentialsConfig,
    /// This node's name.
    pub node: &'a str,
    /// This node's `[fleet] labels`.
    pub labels: &'a [String],
}

impl Resolution<'_> {
    /// The actor (when one is given), the catalog's rule 1, every
    /// credential route the profile needs, and, when `placed_here`, the
    /// node's labels covering its `[placement]`, in that order.
    pub fn resolve(&self, actor: Option<&str>, profile_ref: &str, placed_here: bool) -> Result<Arc<Profile>, Refusal> {
        if let Some(actor) = actor {
            check_actor(actor)?;
        }
        let profile = self.catalog.resolve(profile_ref)?;
        let refs = &profile.file.credential_route_refs;
        if let Err(why) =
            self.credentials.check(refs).and_then(|()| self.credentials.check_exposure(refs, &profile.file.rein))
        {
            return Err(Refusal(format!("profile {} cannot run: {why}", profile.reference())));
        }
        let missing = missing_labels(&profile, self.labels);
        if placed_here && !missing.is_empty() {
            return Err(Refusal(format!(
                "profile {} runs only on nodes labelled {}; node {} is not (it has: {})",
                profile.reference(),
                missing.join(", "),
                self.node,
                self.labels.join(", ")
            )));
        }
        Ok(profile)
    }
}
