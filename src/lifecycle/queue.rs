//! The engine's side of the fleet's queue (shared stores; see
//! `store::queue`): an execution accepted here runs here when this node has
//! room, can run its profile and its principal's fleet-wide quota allows;
//! otherwise it waits in the queue and the node with room that claims it
//! first runs it. Its caller's stream follows it wherever it runs (events
//! come from the store, woken by NOTIFY). On SQLite nothing queues: there
//! is one node, and admission refuses at once.

use std::sync::Arc;

use tokio::sync::{Mutex, Notify};
use tokio_util::sync::CancellationToken;

use super::{admission, execution_span, now_ms, Engine, EngineError, ExecuteCommand, ExecutionRecord};
use super::{ExecutionState, Submitted};
use crate::events::{EventKind, Recorder};
use crate::store::{Admit, Claimed, Enqueued, QueuedWork};
use crate::types::evidence::Outcome;

/// This node's part in the queue.
pub(super) struct FleetRoom {
    /// Executions it runs at once (0: a front end).
    capacity: usize,
    /// What it can run.
    pub(super) labels: Vec<String>,
    /// The most executions the queue holds, and one principal may have in it.
    max_queued: (u64, u64),
    /// Held while claiming, so that a cancel never falls between a claim
    /// and the admission slot it gets here.
    claiming: Mutex<()>,
    /// Wakes the claim loop: room here, or new work in the queue.
    pub(super) wake: Notify,
    /// The fleet's nodes, as last read (see `someone_can_run`).
    nodes: Mutex<Option<(std::time::Instant, Arc<Vec<crate::store::NodeRow>>)>>,
    /// Until when this node's lease is known to hold (set by the lease
    /// loop after each renewal that succeeded); none before the first.
    lease_holds_until: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long a read of the fleet's nodes is used before it is read again:
/// nodes change state in seconds (leases, drains), submits come many a
/// second.
const NODES_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

impl FleetRoom {
    pub(super) fn new(capacity: usize, labels: Vec<String>, max_queued: (u64, u64)) -> FleetRoom {
        FleetRoom {
            capacity,
            labels,
            max_queued,
            claiming: Mutex::new(()),
            wake: Notify::new(),
            nodes: Mutex::new(None),
            lease_holds_until: std::sync::Mutex::new(None),
        }
    }
}

/// Whether `labels` cover everything `needs` names.
pub fn covers(labels: &[String], needs: &[String]) -> bool {
    needs.iter().all(|need| labels.contains(need))
}

/// Whether node `node` takes work that needs `needs` at `now_ms`: live
/// (see [`is_live`]), with capacity, and every label.
pub fn can_take(node: &crate::store::NodeRow, needs: &[String], now_ms: i64) -> bool {
    is_live(node, now_ms) && node.capacity > 0 && covers(&node.labels, needs)
}

/// Whether node `node` is active and its lease still holds at `now_ms`: a
/// node whose lease ran out is dead to the fleet even before a survivor
/// sweeps it (marks it lost), and nothing is handed to it.
pub fn is_live(node: &crate::store::NodeRow, now_ms: i64) -> bool {
    node.state == crate::store::NodeState::Active && node.lease_until_ms >= now_ms
}

/// Whether node `node` still answers for what it owns at `now_ms` (a tool
/// call waiting there, a run it finished): active or draining, and its
/// lease holding. One that stopped, was marked lost, or whose lease ran
/// out (it crashed and no sweep has marked it yet) answers nothing.
pub fn answers(node: &crate::store::NodeRow, now_ms: i64) -> bool {
    use crate::store::NodeState;
    matches!(node.state, NodeState::Active | NodeState::Draining) && node.lease_until_ms >= now_ms
}

/// The labels of `profile`'s `[placement]` that a node labelled `labels`
/// lacks; empty when it may run the profile.
pub fn missing_labels<'a>(profile: &'a crate::catalog::Profile, labels: &[String]) -> Vec<&'a str> {
    profile.file.placement.labels.iter().filter(|label| !labels.contains(label)).map(String::as_str).collect()
}

impl Engine {
    /// What a node needs to run `profile_ref`; nothing when it does not
    /// resolve (any node then records the refusal).
    pub(super) fn needs_of(&self, profile_ref: &str) -> Vec<String> {
        self.catalog.resolve(profile_ref).map(|p| p.needs()).unwrap_or_default()
    }

    /// Whether this node runs work (a front end, `fleet.capacity = 0`,
    /// only accepts it).
    pub fn runs_work(&self) -> bool {
        self.fleet.capacity > 0
    }

    /// Wakes this node's claim loop.
    pub fn wake_claims(&self) {
        self.fleet.wake.notify_one();
    }

    /// Waits until the claim loop should look at the queue again.
    pub async fn claims_wanted(&self) {
        self.fleet.wake.notified().await;
    }

    /// Accepts an execution on a shared store: taken here, or queued.
    pub(super) async fn submit_to_fleet(self: &Arc<Self>, cmd: ExecuteCommand) -> Result<Submitted, EngineError> {
        let execution_id = uuid::Uuid::now_v7().to_string();
        let needs = self.needs_of(&cmd.harness_profile_ref);
        let can_here = self.fleet.capacity > 0 && covers(&self.fleet.labels, &needs) && self.lease_holds();
        // A slot here when there is room; the store decides on the quota.
        let slot = match can_here && self.admission.running(admission::Work::Execution) < self.fleet.capacity {
            true => self.admission.reserve(&execution_id, admission::Work::Execution, &cmd.principal, None).ok(),
            false => None,
        };
        if slot.is_none() {
            if let Err(refused) = self.someone_can_run(&cmd.harness_profile_ref, &needs).await {
                return self.refused_unless_retry(&cmd, refused).await;
            }
        }
        let (answer, submitted) = tokio::sync::oneshot::channel();
        let engine = self.clone();
        let span = execution_span(&execution_id, cmd.traceparent.as_deref());
        self.tasks.spawn(tracing::Instrument::instrument(
            async move { engine.accept_in_fleet(execution_id, cmd, slot, needs, answer).await },
            span,
        ));
        submitted.await.unwrap_or_else(|_| Err(EngineError::Unavailable("the execution was not accepted".into())))
    }

    /// The lease loop's word that this node's lease holds until `until`
    /// (see `fleet::lease::takes_work_for`). A node that took no work
    /// until now (it had just started, or could not renew) looks at the
    /// queue at once.
    pub fn lease_holds_until(&self, until: std::time::Instant) {
        let held = self.lease_holds();
        *self.fleet.lease_holds_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(until);
        if !held {
            self.wake_claims();
        }
    }

    /// Whether this node may take new work on a shared store: its lease
    /// was renewed recently enough (a node that cannot renew stops taking
    /// work before it fences). Always on a store of its own.
    pub(super) fn lease_holds(&self) -> bool {
        if !self.store.is_shared() {
            return true;
        }
        let until = *self.fleet.lease_holds_until.lock().unwrap_or_else(|e| e.into_inner());
        until.is_some_and(|until| std::time::Instant::now() < until)
    }

    /// The fleet's nodes as read at most [`NODES_FRESH`] ago.
    pub(super) async fn fleet_nodes(&self) -> Result<Arc<Vec<crate::store::NodeRow>>, EngineError> {
        if let Some((read, nodes)) = &*self.fleet.nodes.lock().await {
            if read.elapsed() < NODES_FRESH {
                return Ok(nodes.clone());
            }
        }
        let nodes = Arc::new(self.store.list_nodes().await?);
        *self.fleet.nodes.lock().await = Some((std::time::Instant::now(), nodes.clone()));
        Ok(nodes)
    }

    /// Refuses work no active node of the fleet could ever claim, rather
    /// than queueing it for nobody.
    async fn someone_can_run(&self, profile_ref: &str, needs: &[String]) -> Result<(), EngineError> {
        let nodes = self.fleet_nodes().await?;
        let now = now_ms();
        match nodes.iter().any(|n| can_take(n, needs, now)) {
            true => Ok(()),
            false => Err(self.no_node_can_run(profile_ref, needs)),
        }
    }

    /// The refusal of work no active node of the fleet can run.
    pub(super) fn no_node_can_run(&self, profile_ref: &str, needs: &[String]) -> EngineError {
        EngineError::NoNodeCanRun(format!(
            "no active node of the fleet with capacity can run {profile_ref} (it needs {}); retry later",
            if needs.is_empty() { "nothing in particular".to_string() } else { needs.join(", ") }
        ))
    }

    /// The labels this node has (`[fleet] labels` and what it detected).
    pub(super) fn fleet_labels(&self) -> &[String] {
        &self.fleet.labels
    }

    async fn accept_in_fleet(
        self: Arc<Self>,
        execution_id: String,
        cmd: ExecuteCommand,
        slot: Option<CancellationToken>,
        needs: Vec<String>,
        answer: tokio::sync::oneshot::Sender<Result<Submitted, EngineError>>,
    ) {
        // The lease may have stopped holding since the slot was taken (a
        // slow store is when it does): then the run is queued.
        let slot = match slot {
            Some(_) if !self.lease_holds() => {
                self.release(&execution_id);
                None
            }
            slot => slot,
        };
        let mut record = self.new_record(&execution_id, &cmd, ExecutionState::Pending);
        // A caller that follows a run that may be queued (this node has no
        // room, or the principal's fleet-wide quota may hold it back) is a
        // watcher: its place is taken first, so a caller refused one queues
        // nothing. A run taken here gives it back before it runs; a
        // StartExecution, with no stream, needs none.
        let may_queue = slot.is_none() || cmd.quota.is_some();
        let place = (cmd.follows && may_queue).then(|| self.watch_place(&execution_id, &cmd.principal));
        let mut place = match place.transpose() {
            Ok(place) => place,
            Err(refused) => {
                // A slot held for a principal with a quota goes back with
                // the refusal (else one at its watch places could fill the
                // node with refused Executes).
                if slot.is_some() {
                    self.release(&execution_id);
                }
                let _ = answer.send(Err(refused));
                return;
            }
        };
        let work = QueuedWork { command: cmd.clone(), traceparent: cmd.traceparent.clone(), quota: cmd.quota };
        let (max_queued, max_queued_per_principal) = self.fleet.max_queued;
        let admit = Admit { take_here: slot.is_some(), needs: &needs, max_queued, max_queued_per_principal };
        let enqueued = self.store.enqueue_execution(&record, &cmd.digest(), &work, admit).await;
        let taken = matches!(enqueued, Ok(Enqueued::Taken));
        if !taken && slot.is_some() {
            self.release(&execution_id);
        }
        let mut run = None;
        let answered = match enqueued {
            Ok(Enqueued::Taken) => {
                record.state = ExecutionState::Running;
                run = Some(record.clone());
                // Opened before the run starts (below), so the caller sees
                // event 1.
                let subscription = super::Subscription::live(self.bus.open(&execution_id), true).catching_up(
                    self.event_pages.clone(),
                    execution_id.clone(),
                    self.bus.capacity(),
                );
                let unless_kept = self.unless_kept(&cmd, &execution_id);
                Ok(Submitted { record: record.clone(), subscription, existing: false, unless_kept })
            }
            Ok(Enqueued::Queued) => {
                tracing::info!(execution_id = %execution_id, "queued for a node with room");
                let subscription = self.watch_queued(&execution_id, place.take());
                Ok(Submitted {
                    record,
                    subscription: subscription.for_direct_caller(self.store.clone(), execution_id.clone()),
                    existing: false,
                    unless_kept: self.unless_kept(&cmd, &execution_id),
                })
            }
            Ok(Enqueued::Existing { record, digest }) => self.existing(*record, &digest, &cmd).await,
            Ok(Enqueued::Full(queued)) => {
                crate::telemetry::admission_refused("queue");
                let refused = EngineError::Overloaded(format!(
                    "the fleet's queue holds {queued} executions, its max_queued; retry later"
                ));
                self.refused_unless_retry(&cmd, refused).await
            }
            Ok(Enqueued::PrincipalFull(queued)) => {
                crate::telemetry::admission_refused("queue");
                let refused = EngineError::Overloaded(format!(
                    "principal {} has {queued} executions in the fleet's queue, its max_queued_per_principal; \
                     retry later",
                    cmd.principal
                ));
                self.refused_unless_retry(&cmd, refused).await
            }
            Err(e) => Err(e.into()),
        };
        // Not queued: the stream, if any, is not a watcher's.
        drop(place);
        let _ = answer.send(answered);
        // The caller may be gone already; the execution runs regardless.
        if let (Some(record), Some(cancel)) = (run, slot) {
            self.run_here(record, cmd, cancel).await;
        }
    }

    /// Claims queued work while this node has room (one claimer at a
    /// time), and starts each claimed execution on its own task.
    pub async fn claim_work(self: &Arc<Self>) {
        if !self.store.is_shared() || self.fleet.capacity == 0 {
            return;
        }
        let _claiming = self.fleet.claiming.lock().await;
        loop {
            if self.is_draining() || !self.lease_holds() {
                return;
            }
            let room = self.fleet.capacity.saturating_sub(self.admission.running(admission::Work::Execution));
            if room == 0 {
                // A run ending here wakes this loop again.
                return;
            }
            // Slots held for a claim are not free for work sent here: look
            // first (most wakeups find the queue empty).
            let queued = match self.store.queued_count().await {
                Ok(queued) => queued,
                Err(e) => return tracing::warn!(error = %e, "fleet: cannot read the queue"),
            };
            let room = room.min(queued);
            // The slots first, under placeholder names: nothing else takes
            // them between the claim and the start.
            let placeholders: Vec<String> = (0..room)
                // Not a valid execution or session id: never taken.
                .map(|i| format!("\0claim-{i}"))
                .filter(|name| self.admission.reserve(name, admission::Work::Execution, "", None).is_ok())
                .collect();
            // The queue's count was a read of the store: the lease may have
            // stopped holding meanwhile.
            if placeholders.is_empty() || !self.lease_holds() {
                for placeholder in &placeholders {
                    self.admission.release(placeholder);
                }
                return;
            }
            let claimed = match self.store.claim_queued(placeholders.len(), &self.fleet.labels).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    tracing::warn!(error = %e, "fleet: cannot claim queued work");
                    Vec::new()
                }
            };
            let full = claimed.len() == placeholders.len();
            // At most one claimed execution per placeholder (the claim's
            // limit); the placeholders left over are given back.
            let used = claimed.len();
            for (claimed, placeholder) in claimed.into_iter().zip(&placeholders) {
                let id = claimed.record.execution_id.clone();
                match self.admission.rename(placeholder, &id, &claimed.record.consumer.principal) {
                    Some(cancel) => self.start_claimed(claimed, cancel),
                    None => tracing::error!(execution_id = %id, "fleet: a claimed execution got no slot"),
                }
            }
            for placeholder in placeholders.iter().skip(used) {
                self.admission.release(placeholder);
            }
            if used < placeholders.len() {
                // Room no claim took: a warm pool held back may refill.
                self.wake_held_back_fillers();
            }
            if !full {
                return;
            }
        }
    }

    /// Runs a claimed execution here, on the engine's own task.
    fn start_claimed(self: &Arc<Self>, claimed: Claimed, cancel: CancellationToken) {
        let Claimed { record, work } = claimed;
        let mut cmd = work.command;
        cmd.quota = work.quota;
        cmd.traceparent = work.traceparent;
        let span = execution_span(&record.execution_id, cmd.traceparent.as_deref());
        tracing::info!(parent: &span, "claimed from the fleet's queue");
        let engine = self.clone();
        let _ = self.bus.open(&record.execution_id);
        self.tasks
            .spawn(tracing::Instrument::instrument(async move { engine.run_here(record, cmd, cancel).await }, span));
    }

    /// Cancels the execution if it holds an admission slot here (waiting
    /// out a claim under way, which may be taking it).
    pub(super) async fn cancel_here(&self, execution_id: &str) -> bool {
        if self.admission.cancel(execution_id) {
            return true;
        }
        if !self.store.is_shared() {
            return false;
        }
        let _claiming = self.fleet.claiming.lock().await;
        self.admission.cancel(execution_id)
    }

    /// Finishes, as cancelled, an execution this node took out of the queue
    /// before any node ran it: `accepted`, then `finished`, as for any run.
    pub(super) async fn cancel_unclaimed(&self, mut record: ExecutionRecord) -> Result<ExecutionRecord, EngineError> {
        let id = record.execution_id.clone();
        let mut recorder = Recorder::new(id.clone(), 0, self.store.clone(), self.bus.clone());
        recorder.hold(EventKind::Accepted {
            execution_id: id.clone(),
            session_id: String::new(),
            request_id: record.request_id.clone(),
            consumer: record.consumer.clone(),
        });
        record.state = ExecutionState::Cancelled;
        record.finished_at_ms = Some(now_ms());
        record.evidence.outcome = Outcome::Cancelled;
        record.evidence.error = "execution cancelled before a node took it from the queue".into();
        if !super::execution::store_finished(self, &mut recorder, &record, None).await {
            return Err(EngineError::Unavailable(format!("execution {id} was taken out of the queue, not stored")));
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::{answers, can_take, covers};
    use crate::store::{NodeRow, NodeState};

    /// An active node with room for 2, labelled `gpu`, its lease until 10 s.
    fn node() -> NodeRow {
        NodeRow {
            name: "b".into(),
            epoch: "e".into(),
            state: NodeState::Active,
            capacity: 2,
            labels: vec!["gpu".into()],
            version: String::new(),
            started_at_ms: 0,
            renewed_at_ms: 0,
            lease_until_ms: 10_000,
            running: 0,
            drain_requested_at_ms: 0,
        }
    }

    #[test]
    fn a_node_whose_lease_ran_out_takes_nothing_before_it_is_swept() {
        let node = node();
        assert!(can_take(&node, &["gpu".into()], 10_000));
        assert!(!can_take(&node, &["gpu".into()], 10_001), "its lease ran out: dead, even if still listed active");
        assert!(!can_take(&node, &["tpu".into()], 9_000));
        assert!(!can_take(&NodeRow { capacity: 0, ..node.clone() }, &[], 9_000), "a front end");
        assert!(!can_take(&NodeRow { state: NodeState::Draining, ..node }, &[], 9_000));
    }

    #[test]
    fn a_node_answers_for_what_it_owns_only_while_its_lease_holds() {
        let node = NodeRow { capacity: 0, labels: vec![], ..node() };
        assert!(answers(&node, 10_000), "a front end (no capacity) answers too");
        assert!(!answers(&node, 10_001), "its lease ran out: it crashed, even if no sweep marked it lost");
        assert!(answers(&NodeRow { state: NodeState::Draining, ..node.clone() }, 9_000), "draining: still running");
        assert!(!answers(&NodeRow { state: NodeState::Stopped, ..node.clone() }, 9_000));
        assert!(!answers(&NodeRow { state: NodeState::Lost, ..node }, 9_000));
    }

    #[test]
    fn a_node_covers_what_a_profile_needs_only_with_every_label() {
        let labels = vec!["linux_bwrap".to_string(), "claude".to_string()];
        assert!(covers(&labels, &[]));
        assert!(covers(&labels, &["linux_bwrap".into()]));
        assert!(covers(&labels, &["claude".into(), "linux_bwrap".into()]));
        assert!(!covers(&labels, &["codex".into()]));
        assert!(!covers(&[], &["linux_bwrap".into()]));
    }
}
