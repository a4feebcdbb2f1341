//! What a node does after each lease renewal: the pure part of the lease
//! loop, tested with exact vectors.
//!
//! A node renews every third of its lease. It fences itself (kills its
//! sandboxes, takes no work, exits to start again with a new epoch) when
//! the store says it was declared lost, or when it could not renew for two
//! thirds of a lease: well before the lease runs out, so nothing of it
//! still runs when a survivor fails its runs. A lease is counted from the
//! moment its renewal was sent (the store counts it from no earlier), and
//! no wait or attempt of the loop runs past the moment to fence: a store
//! that answers late cannot push the fence towards the lease's end.
//!
//! A node that could not renew for half a lease takes no new work (it
//! claims nothing from the queue, starts no run or session of its own)
//! until a renewal succeeds again: work it took then would be killed at
//! the fence.
//!
//! A node that is shutting down (SIGTERM) goes on renewing while its runs
//! end, until it has left the fleet: its lease must outlast the shutdown
//! grace, or a survivor would declare it lost and fail the runs it is
//! finishing.

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
    /// This start marked itself `stopped` at the end of its shutdown:
    /// nothing is left to renew.
    Left,
}

/// How often a node renews its lease.
pub fn renew_every(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(100))
}

/// How long a node may go without a renewal before it fences itself.
pub fn fence_after(lease: Duration) -> Duration {
    lease * 2 / 3
}

/// How long after a renewal that succeeded was sent a node takes new
/// work (claims from the queue, runs and sessions it would start itself):
/// half its lease, past the next renewal's due time and short of the
/// fence, so that a node that cannot renew stops taking work it would
/// kill at the fence.
pub fn takes_work_for(lease: Duration) -> Duration {
    lease / 2
}

/// The lease loop's clock: when the last renewal that succeeded was sent
/// (the lease runs from then: the store counts it from no earlier) and
/// when the last attempt was. Times are offsets from any fixed instant
/// (the loop's start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    lease: Duration,
    renewed: Duration,
    sent: Option<Duration>,
}

impl Clock {
    /// A loop starting at `now`: it renews at once, and counts its lease
    /// from no later than `now` (the join was earlier).
    pub fn new(lease: Duration, now: Duration) -> Clock {
        Clock { lease, renewed: now, sent: None }
    }

    /// How long to wait at `now` before the next renewal: a renewal
    /// interval after the last one was sent, but never past the moment
    /// the node has to fence itself.
    pub fn wait(&self, now: Duration) -> Duration {
        let Some(sent) = self.sent else { return Duration::ZERO };
        let due = renew_every(self.lease).saturating_sub(now.saturating_sub(sent));
        due.min(self.until_fence(now))
    }

    /// How long a renewal sent at `now` may take: a renewal interval, but
    /// never past the moment the node has to fence itself.
    pub fn limit(&self, now: Duration) -> Duration {
        renew_every(self.lease).min(self.until_fence(now))
    }

    /// A renewal is sent at `now`.
    pub fn sent(&mut self, now: Duration) {
        self.sent = Some(now);
    }

    /// The renewal last sent was answered with `renewal`.
    pub fn answered(&mut self, renewal: &Renewal) {
        if let (Renewal::Renewed(_), Some(sent)) = (renewal, self.sent) {
            self.renewed = sent;
        }
    }

    /// How long ago, at `now`, the last renewal that succeeded was sent.
    pub fn since_renewed(&self, now: Duration) -> Duration {
        now.saturating_sub(self.renewed)
    }

    fn until_fence(&self, now: Duration) -> Duration {
        fence_after(self.lease).saturating_sub(self.since_renewed(now))
    }
}

/// The next step after `renewal`, `since_renewed` after the last renewal
/// that succeeded was sent; `stopping`: this start is shutting down.
pub fn after(renewal: &Renewal, since_renewed: Duration, lease: Duration, stopping: bool) -> Step {
    match renewal {
        Renewal::Renewed(NodeState::Active) => Step::Continue,
        Renewal::Renewed(NodeState::Draining) => Step::Drain,
        Renewal::Renewed(NodeState::Lost) | Renewal::Fenced => {
            Step::Fence("the store says this node was declared lost".into())
        }
        // Only a start that has shut down writes this: this one, at the end
        // of its own shutdown; a start that still runs and reads it
        // otherwise is not the one the row speaks for.
        Renewal::Renewed(NodeState::Stopped) if stopping => Step::Left,
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
        assert_eq!(takes_work_for(LEASE), ms(4500));
        for lease in [ms(1000), LEASE, Duration::from_secs(60)] {
            assert!(renew_every(lease) < takes_work_for(lease) && takes_work_for(lease) < fence_after(lease));
        }
        assert_eq!(renew_every(ms(150)), ms(100), "never a busy loop");
        for stopping in [false, true] {
            assert_eq!(after(&Renewal::Renewed(NodeState::Active), ms(0), LEASE, stopping), Step::Continue);
            assert_eq!(after(&Renewal::Renewed(NodeState::Draining), ms(0), LEASE, stopping), Step::Drain);
            assert_eq!(after(&Renewal::Failed, ms(5999), LEASE, stopping), Step::Continue);
            assert_eq!(
                after(&Renewal::Failed, ms(6000), LEASE, stopping),
                Step::Fence("the lease could not be renewed for 6000 ms (lease 9000 ms)".into()),
                "a node shutting down fences itself as well"
            );
            let lost = Step::Fence("the store says this node was declared lost".into());
            assert_eq!(after(&Renewal::Fenced, ms(0), LEASE, stopping), lost);
            assert_eq!(after(&Renewal::Renewed(NodeState::Lost), ms(0), LEASE, stopping), lost);
        }
        assert_eq!(
            after(&Renewal::Renewed(NodeState::Stopped), ms(0), LEASE, false),
            Step::Fence("the store says this node stopped".into()),
            "a row a stopped start left is not a running start's"
        );
        assert_eq!(
            after(&Renewal::Renewed(NodeState::Stopped), ms(0), LEASE, true),
            Step::Left,
            "a start shutting down reads the row it marked itself"
        );
        // Fenced with a third of the lease to spare: a survivor can only
        // declare it lost after the whole lease.
        assert!(fence_after(LEASE) + renew_every(LEASE) <= LEASE);
    }

    /// No wait and no attempt of the loop ends past the moment to fence,
    /// however late the store answers or however fast it fails: the
    /// lease runs from when the renewal was sent, and a node whose last
    /// renewal that succeeded was sent at 0 fences itself at 2L/3, never
    /// at sleep + timeout after the answer.
    #[test]
    fn the_lease_counts_from_the_renewal_sent_and_no_wait_runs_past_the_fence() {
        let ms = Duration::from_millis;
        let mut clock = Clock::new(LEASE, ms(0));
        assert_eq!(clock.wait(ms(0)), ms(0), "the first renewal at once");
        clock.sent(ms(0));
        assert_eq!(clock.limit(ms(0)), ms(3000));
        // A slow store: the renewal sent at 0 is answered at 2900.
        clock.answered(&Renewal::Renewed(NodeState::Active));
        assert_eq!(clock.since_renewed(ms(2900)), ms(2900), "the lease runs from 0, not from the answer");
        assert_eq!(clock.wait(ms(2900)), ms(100), "the next one is due 3000 after the last was sent");
        // Sent at 3000, it fails at once (a refused connection).
        clock.sent(ms(3000));
        assert_eq!(clock.limit(ms(3000)), ms(3000));
        clock.answered(&Renewal::Failed);
        assert_eq!(after(&Renewal::Failed, clock.since_renewed(ms(3100)), LEASE, false), Step::Continue);
        assert_eq!(clock.wait(ms(3100)), ms(2900));
        // Sent at 6000, with nothing left before the fence: no wait for it.
        clock.sent(ms(6000));
        assert_eq!(clock.limit(ms(6000)), ms(0));
        clock.answered(&Renewal::Failed);
        assert_eq!(
            after(&Renewal::Failed, clock.since_renewed(ms(6000)), LEASE, false),
            Step::Fence("the lease could not be renewed for 6000 ms (lease 9000 ms)".into())
        );
        // A renewal that hangs is cut at the moment to fence.
        let mut clock = Clock::new(LEASE, ms(0));
        clock.sent(ms(0));
        clock.answered(&Renewal::Renewed(NodeState::Active));
        assert_eq!(clock.wait(ms(1000)), ms(2000));
        clock.sent(ms(3000));
        clock.answered(&Renewal::Failed);
        assert_eq!(clock.wait(ms(4500)), ms(1500), "a renewal interval after 3000 is 6000: the fence");
        clock.sent(ms(5000));
        assert_eq!(clock.limit(ms(5000)), ms(1000), "not 3000: it would end at 8000");
        assert_eq!(clock.wait(ms(7000)), ms(0));
        assert_eq!(clock.limit(ms(7000)), ms(0));
    }
}
