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

    /// Whether `repo` (a canonical path, or empty: no repository) may be
    /// used here for `principal`: beneath this node's `repo_roots` and,
    /// when this node knows the principal, beneath its `repos` now. The
    /// node that accepted the work checked its own; the node that runs it
    /// (one that claimed it from the fleet's queue, or was handed a
    /// session) may have other roots or a reloaded principal, and the
    /// host it touches is its own. The refusal reads as the API's does
    /// (nothing about what exists here); the reason goes to the audit log.
    pub(super) fn repo_here(&self, principal: &str, repo: &str) -> Result<(), Refusal> {
        use crate::sandbox::repo::{resolve, NOT_ALLOWED};
        if repo.is_empty() {
            return Ok(());
        }
        let known = self.repos.principals.current().named(principal);
        let prefixes = known.as_ref().map(|p| p.repos.as_slice()).unwrap_or_default();
        resolve(std::path::Path::new(repo), &self.repos.roots, prefixes).map(drop).map_err(|why| {
            tracing::info!(
                target: "corral::audit", principal, node = self.store.node(), reason = %why,
                "repository refused where the work runs"
            );
            Refusal(format!("repo {repo} {NOT_ALLOWED} on node {}", self.store.node()))
        })
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
