//! Admission: a hard bound on what runs at once, reserved atomically
//! *before* anything is stored and released exactly once. Executions and
//! sessions are bounded separately; a principal's `max_running` counts
//! both of its kinds.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Execution,
    Session,
}

struct Slot {
    work: Work,
    principal: String,
    cancel: CancellationToken,
}

/// Why admission said no.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused(pub String);

pub struct Admission {
    max_executions: usize,
    max_sessions: usize,
    slots: Mutex<HashMap<String, Slot>>,
}

impl Admission {
    pub fn new(max_executions: usize, max_sessions: usize) -> Admission {
        Admission { max_executions: max_executions.max(1), max_sessions: max_sessions.max(1), slots: Mutex::default() }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a slot for `id`, or says which bound is full.
    pub fn reserve(
        &self,
        id: &str,
        work: Work,
        principal: &str,
        quota: Option<usize>,
    ) -> Result<CancellationToken, Refused> {
        self.take(id, work, principal, quota, CancellationToken::new())
    }

    /// [`Admission::reserve`], with a slot token that `parent` cancels too
    /// (a shutdown past its grace).
    pub fn reserve_under(
        &self,
        id: &str,
        work: Work,
        principal: &str,
        quota: Option<usize>,
        parent: &CancellationToken,
    ) -> Result<CancellationToken, Refused> {
        self.take(id, work, principal, quota, parent.child_token())
    }

    fn take(
        &self,
        id: &str,
        work: Work,
        principal: &str,
        quota: Option<usize>,
        cancel: CancellationToken,
    ) -> Result<CancellationToken, Refused> {
        let mut slots = self.slots();
        // A taken id is said so whatever else is full: the caller then
        // learns the id is in use, not that it should retry.
        if slots.contains_key(id) {
            return Err(Refused(format!("{id} is already running")));
        }
        let of_kind = slots.values().filter(|s| s.work == work).count();
        let (max, what) = match work {
            Work::Execution => (self.max_executions, "executions"),
            Work::Session => (self.max_sessions, "sessions"),
        };
        if of_kind >= max {
            crate::telemetry::admission_refused(what);
            return Err(Refused(format!("{of_kind} {what} are running, the most this daemon admits; retry later")));
        }
        if let Some(quota) = quota {
            let mine = slots.values().filter(|s| s.principal == principal).count();
            if mine >= quota {
                crate::telemetry::admission_refused("quota");
                return Err(Refused(format!(
                    "principal {principal} has {mine} executions and sessions running: its max_running quota of {quota} is reached"
                )));
            }
        }
        slots.insert(id.to_string(), Slot { work, principal: principal.to_string(), cancel: cancel.clone() });
        crate::telemetry::running(what, of_kind + 1);
        Ok(cancel)
    }

    /// Moves the slot held under `from` to `to` (its principal now
    /// `principal`), keeping its cancel token; `None` when `from` holds
    /// none or `to` holds one already.
    pub fn rename(&self, from: &str, to: &str, principal: &str) -> Option<CancellationToken> {
        let mut slots = self.slots();
        if slots.contains_key(to) {
            return None;
        }
        let mut slot = slots.remove(from)?;
        slot.principal = principal.to_string();
        let cancel = slot.cancel.clone();
        slots.insert(to.to_string(), slot);
        Some(cancel)
    }

    /// Gives the slot back; a second release does nothing.
    pub fn release(&self, id: &str) {
        let mut slots = self.slots();
        if let Some(slot) = slots.remove(id) {
            let (work, what) = match slot.work {
                Work::Execution => (Work::Execution, "executions"),
                Work::Session => (Work::Session, "sessions"),
            };
            crate::telemetry::running(what, slots.values().filter(|s| s.work == work).count());
        }
    }

    /// The cancel token of the slot `id` holds as `work`, if it holds one.
    pub fn token(&self, id: &str, work: Work) -> Option<CancellationToken> {
        self.slots().get(id).filter(|slot| slot.work == work).map(|slot| slot.cancel.clone())
    }

    /// Whether `id` holds a slot as `work`.
    pub fn holds(&self, id: &str, work: Work) -> bool {
        self.slots().get(id).is_some_and(|slot| slot.work == work)
    }

    /// Cancels the work holding `id`'s slot, if it runs here.
    pub fn cancel(&self, id: &str) -> bool {
        match self.slots().get(id) {
            Some(slot) => {
                slot.cancel.cancel();
                true
            }
            None => false,
        }
    }

    pub fn running(&self, work: Work) -> usize {
        self.slots().values().filter(|s| s.work == work).count()
    }

    /// How many more of `work` it admits now (quotas aside).
    pub fn room(&self, work: Work) -> usize {
        let max = match work {
            Work::Execution => self.max_executions,
            Work::Session => self.max_sessions,
        };
        max.saturating_sub(self.running(work))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_hard_and_per_kind() {
        let a = Admission::new(2, 1);
        assert!(a.reserve("e1", Work::Execution, "p", None).is_ok());
        assert!(a.reserve("e2", Work::Execution, "p", None).is_ok());
        assert!(a.reserve("e3", Work::Execution, "p", None).unwrap_err().0.contains("2 executions"));
        assert!(a.reserve("s1", Work::Session, "p", None).is_ok());
        assert!(a.reserve("s2", Work::Session, "p", None).unwrap_err().0.contains("1 sessions"));
        a.release("e1");
        a.release("e1");
        assert_eq!((a.room(Work::Execution), a.room(Work::Session)), (1, 0));
        assert!(a.reserve("e3", Work::Execution, "p", None).is_ok());
        assert_eq!(a.running(Work::Execution), 2);
        assert_eq!(a.room(Work::Execution), 0);
    }

    #[test]
    fn a_principals_quota_counts_both_kinds() {
        let a = Admission::new(10, 10);
        assert!(a.reserve("e1", Work::Execution, "ci", Some(2)).is_ok());
        assert!(a.reserve("s1", Work::Session, "ci", Some(2)).is_ok());
        let refused = a.reserve("e2", Work::Execution, "ci", Some(2)).unwrap_err();
        assert!(refused.0.contains("max_running quota of 2"), "{}", refused.0);
        assert!(a.reserve("e2", Work::Execution, "other", Some(2)).is_ok(), "another principal is not affected");
    }

    #[test]
    fn a_renamed_slot_keeps_its_place_and_its_token() {
        let a = Admission::new(1, 1);
        let token = a.reserve("claim-1", Work::Execution, "", None).unwrap();
        let renamed = a.rename("claim-1", "e1", "ci").unwrap();
        assert!(a.reserve("e2", Work::Execution, "ci", None).is_err(), "the slot is still taken");
        assert!(a.cancel("e1") && token.is_cancelled() && renamed.is_cancelled());
        assert!(a.rename("claim-1", "e3", "ci").is_none(), "nothing is left under the old name");
        assert!(a.reserve("x", Work::Session, "ci", Some(1)).is_err(), "the renamed slot counts for its principal");
        a.release("e1");
        assert_eq!(a.running(Work::Execution), 0);
    }

    #[test]
    fn cancel_reaches_the_slot() {
        let a = Admission::new(1, 1);
        let token = a.reserve("e1", Work::Execution, "p", None).unwrap();
        assert!(a.cancel("e1") && token.is_cancelled());
        assert!(!a.cancel("nope"));
    }
}
