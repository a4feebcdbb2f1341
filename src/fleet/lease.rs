//! What a node does after each lease renewal: the pure part of the lease
//! loop, tested with exact vectors.
//!
//! A node renews every third of its lease. It fences itself (kills its
//! sandboxes, takes no work, exits to start again with a new epoch) when
//! the store says it was declared lost, or when it could not renew for two
//! thirds of a lease: well before the lease runs out, so nothing of it
//! still runs when a survivor fails its runs.

use std::time::Duration;

use crate::store::NodeState;

/// How a renewal went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// Renewed; the node's state in the store.
    Renewed(NodeState),
    /// The store says this start no longer owns the node (declared lost).
    Fenced,
    /// The store could not be reached or failed.
    Failed,
}

/// What the node does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Carry on.
    Continue,
    /// An operator asked this node to drain: take no new work.
    Drain,
    /// Kill every sandbox and stop; the reason is logged.
    Fence(String),
}

/// How often a node renews its lease.
pub fn renew_every(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(100))
}

/// How long a node may go without a renewal before it fences itself.
pub fn fence_after(lease: Duration) -> Duration {
    lease * 2 / 3
}

/// The next step after `renewal`, `since_renewed` after the last renewal
/// that succeeded.
pub fn after(renewal: &Renewal, since_renewed: Duration, lease: Duration) -> Step {
    match renewal {
        Renewal::Renewed(NodeState::Active) => Step::Continue,
        Renewal::Renewed(NodeState::Draining) => Step::Drain,
        Renewal::Renewed(NodeState::Lost) | Renewal::Fenced => {
            Step::Fence("the store says this node was declared lost".into())
        }
        // Only a start that has shut down writes this; a start that still
        // runs and reads it is not the one the row speaks for.
        Renewal::Renewed(NodeState::Stopped) => Step::Fence("the store says this node stopped".into()),
        Renewal::Failed if since_renewed >= fence_after(lease) => Step::Fence(format!(
            "the lease could not be renewed for {} ms (lease {} ms)",
            since_renewed.as_millis(),
            lease.as_millis()
        )),
        Renewal::Failed => Step::Continue,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(9);

    #[test]
    fn a_node_fences_itself_before_its_lease_runs_out() {
        let ms = Duration::from_millis;
        assert_eq!(renew_every(LEASE), ms(3000));
        assert_eq!(fence_after(LEASE), ms(6000));
        assert_eq!(renew_every(ms(150)), ms(100), "never a busy loop");
        assert_eq!(after(&Renewal::Renewed(NodeState::Active), ms(0), LEASE), Step::Continue);
        assert_eq!(after(&Renewal::Renewed(NodeState::Draining), ms(0), LEASE), Step::Drain);
        assert_eq!(after(&Renewal::Failed, ms(5999), LEASE), Step::Continue);
        assert_eq!(
            after(&Renewal::Failed, ms(6000), LEASE),
            Step::Fence("the lease could not be renewed for 6000 ms (lease 9000 ms)".into())
        );
        let lost = Step::Fence("the store says this node was declared lost".into());
        assert_eq!(after(&Renewal::Fenced, ms(0), LEASE), lost);
        assert_eq!(after(&Renewal::Renewed(NodeState::Lost), ms(0), LEASE), lost);
        assert_eq!(
            after(&Renewal::Renewed(NodeState::Stopped), ms(0), LEASE),
            Step::Fence("the store says this node stopped".into()),
            "a row a stopped start left is not a running start's"
        );
        // Fenced with a third of the lease to spare: a survivor can only
        // declare it lost after the whole lease.
        assert!(fence_after(LEASE) + renew_every(LEASE) <= LEASE);
    }
}
