//! Sessions on a fleet: a session is created on a node that can run it.
//!
//! A session is not queued: its caller waits in `CreateSession` for an
//! active session, and a turn-by-turn conversation that waited minutes in a
//! queue for its first turn is not what an interactive caller wants. A node
//! that cannot take it (a front end, no room under its admission limit, or
//! a profile whose labels it lacks) hands the create to another active node
//! whose lease holds and that can, through the store (a `create_session`
//! request, as for every forwarded call), trying each such node once; a
//! request not taken when that node's lease runs out is withdrawn, and the
//! next node asked. The first that takes it runs the session, and every later call reaches it there. When none has
//! room, the create is `RESOURCE_EXHAUSTED`, as on a single node. The
//! principal's quota is counted across the fleet where the session is
//! stored, on whichever node takes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::queue::{can_take, covers, is_live};
use super::{now_ms, CreateSessionCommand, Engine, EngineError, SessionRecord};
use crate::store::NodeRow;
use crate::types::evidence::FailureStage;

/// How long a node waits for another to start a session it handed over:
/// the whole start (sandbox, harness) happens there.
pub const CREATE_FORWARD_TIMEOUT: Duration = Duration::from_secs(120);

/// A create handed to a node: the command, and the start of that node it
/// is for. Another start (the node restarted) never acts on it: its sender
/// has withdrawn it, or gave up on it long ago.
#[derive(Serialize, Deserialize)]
struct Handed<C> {
    /// The epoch of the node's start it was handed to.
    epoch: String,
    /// The create ([`CreateSessionCommand`]), with the session's id.
    command: C,
}

/// The taker's answer: the session, or why not, kept apart where the
/// accepting node acts on the difference.
#[derive(Debug, Serialize, Deserialize)]
enum CreateAnswer {
    Created(Box<SessionRecord>),
    /// No room there (admission, or draining): the next node may have some.
    NoRoom(String),
    /// The principal's fleet-wide quota: no node will take it.
    AtQuota(String),
    Exists(String),
    Refused(String),
    Denied {
        policy: String,
        reason: String,
    },
    StageFailed {
        stage: FailureStage,
        raw: String,
    },
    Unavailable(String),
}

impl CreateAnswer {
    fn from_result(created: Result<SessionRecord, EngineError>) -> CreateAnswer {
        match created {
            Ok(record) => CreateAnswer::Created(Box::new(record)),
            Err(EngineError::AlreadyExists(what)) => CreateAnswer::Exists(what),
            Err(EngineError::Overloaded(why)) => CreateAnswer::AtQuota(why),
            Err(EngineError::Refused(why)) => CreateAnswer::Refused(why),
            Err(EngineError::AgentStartDenied { policy, reason }) => CreateAnswer::Denied { policy, reason },
            Err(EngineError::StageFailed { stage, raw }) => CreateAnswer::StageFailed { stage, raw },
            Err(other) => CreateAnswer::Unavailable(other.to_string()),
        }
    }

    fn into_result(self) -> Result<SessionRecord, EngineError> {
        match self {
            CreateAnswer::Created(record) => Ok(*record),
            CreateAnswer::NoRoom(why) | CreateAnswer::AtQuota(why) => Err(EngineError::Overloaded(why)),
            CreateAnswer::Exists(what) => Err(EngineError::AlreadyExists(what)),
            CreateAnswer::Refused(why) => Err(EngineError::Refused(why)),
            CreateAnswer::Denied { policy, reason } => Err(EngineError::AgentStartDenied { policy, reason }),
            CreateAnswer::StageFailed { stage, raw } => Err(EngineError::StageFailed { stage, raw }),
            CreateAnswer::Unavailable(why) => Err(EngineError::Unavailable(why)),
        }
    }
}

/// Where the next hand-over starts among the able nodes, so that creates
/// spread over them instead of all trying the first.
static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Engine {
    /// Whether this node takes a session itself rather than handing it on:
    /// always on a single node; on a fleet when it runs work and has the
    /// labels the profile needs (and, to start one now, its lease holds).
    pub(super) fn takes_sessions_of(&self, profile_ref: &str) -> bool {
        !self.store.is_shared() || (self.runs_work() && covers(self.fleet_labels(), &self.needs_of(profile_ref)))
    }

    /// Hands a create to the other live nodes able to run it, one after
    /// another, until one takes it; `refused_here` is why this node did not
    /// (when it could have and was full).
    pub(super) async fn create_elsewhere(
        &self,
        mut cmd: CreateSessionCommand,
        session_id: String,
        refused_here: Option<String>,
    ) -> Result<SessionRecord, EngineError> {
        let needs = self.needs_of(&cmd.profile_ref);
        let nodes = self.fleet_nodes().await?;
        let now = now_ms();
        let able: Vec<&NodeRow> =
            nodes.iter().filter(|n| can_take(n, &needs, now)).filter(|n| n.name != self.store.node()).collect();
        if able.is_empty() {
            return Err(match refused_here {
                Some(why) => EngineError::Overloaded(why),
                None => self.no_node_can_run(&cmd.profile_ref, &needs),
            });
        }
        // The id this node chose, for every node it asks.
        cmd.session_id = session_id.clone();
        let first = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut full = Vec::new();
        for i in 0..able.len() {
            let node = able[(first + i) % able.len()];
            let handed = Handed { epoch: node.epoch.clone(), command: &cmd };
            let payload = serde_json::to_string(&handed).map_err(crate::store::StoreError::from)?;
            let answer = match self.hand_to(node, &session_id, &payload).await? {
                Some(answer) => answer,
                None => {
                    full.push(format!("node {}: did not take it (its lease ran out, or it did not answer)", node.name));
                    continue;
                }
            };
            match answer {
                CreateAnswer::NoRoom(why) => full.push(format!("node {}: {why}", node.name)),
                answer => {
                    if let CreateAnswer::Created(_) = answer {
                        tracing::info!(session_id = %session_id, node = %node.name, "session handed to a node with room");
                    }
                    return answer.into_result();
                }
            }
        }
        crate::telemetry::admission_refused("fleet");
        Err(EngineError::Overloaded(format!(
            "no node of the fleet has room for a session; retry later ({})",
            refused_here.into_iter().chain(full).collect::<Vec<_>>().join("; ")
        )))
    }

    /// Files the create for `node` and waits for its answer. `None` when
    /// the node never took it and the request is withdrawn, so that no
    /// start of that node ever acts on it: its lease ran out (a node killed
    /// and not yet swept), another start of it joined, or it did not take
    /// it within [`CREATE_FORWARD_TIMEOUT`]. A node that took it and then
    /// lost its lease, or did not answer in that time, is `NodeUnreachable`
    /// (its sessions are failed by the survivor that sweeps it).
    async fn hand_to(
        &self,
        node: &NodeRow,
        session_id: &str,
        payload: &str,
    ) -> Result<Option<CreateAnswer>, EngineError> {
        let request = self.store.ask_node(&node.name, "create_session", session_id, payload).await?;
        let started = std::time::Instant::now();
        loop {
            match self.store.request_answer(&request).await? {
                Some(Ok(json)) => {
                    return Ok(Some(serde_json::from_str(&json).map_err(crate::store::StoreError::from)?))
                }
                Some(Err(why)) => return Err(EngineError::FailedPrecondition(why)),
                None => {}
            }
            let late = started.elapsed() >= CREATE_FORWARD_TIMEOUT;
            let live = self.fleet_nodes().await?.iter().any(|n| n.epoch == node.epoch && is_live(n, now_ms()));
            if late || !live {
                if self.store.withdraw_request(&request).await? {
                    tracing::warn!(session_id, node = %node.name, live, "fleet: a handed create withdrawn, not taken");
                    return Ok(None);
                }
                // Taken: that node started it (or answered just now).
                if let Some(answer) = self.store.request_answer(&request).await? {
                    let json = answer.map_err(EngineError::FailedPrecondition)?;
                    return Ok(Some(serde_json::from_str(&json).map_err(crate::store::StoreError::from)?));
                }
                return Err(EngineError::NodeUnreachable {
                    node: node.name.clone(),
                    seconds: started.elapsed().as_secs(),
                    outcome: super::TAKEN,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts a session another node handed over (request `request`), on its
    /// own task: a start takes seconds, and the requests behind it must not
    /// wait for it.
    pub(super) fn answer_create(self: &Arc<Self>, request: String, session_id: String, payload: String) {
        let engine = self.clone();
        tokio::spawn(async move {
            let answer = match serde_json::from_str::<Handed<CreateSessionCommand>>(&payload) {
                Err(e) => CreateAnswer::Unavailable(format!("a create_session request: {e}")),
                Ok(handed) if handed.epoch != engine.store.epoch() => CreateAnswer::NoRoom(format!(
                    "node {} was handed this create in an earlier start; it does not start it now",
                    engine.store.node()
                )),
                Ok(handed) => engine.create_handed(handed.command, session_id).await,
            };
            let answer = serde_json::to_string(&answer).map_err(|e| e.to_string());
            if let Err(e) = engine.store.answer_request(&request, answer).await {
                tracing::warn!(error = %e, request = %request, "fleet: a handed create not answered");
            }
        });
    }

    async fn create_handed(self: &Arc<Self>, mut cmd: CreateSessionCommand, session_id: String) -> CreateAnswer {
        if self.is_draining() || !self.takes_sessions_of(&cmd.profile_ref) || !self.lease_holds() {
            return CreateAnswer::NoRoom(format!("node {} does not take this session now", self.store.node()));
        }
        cmd.policies = match crate::policy::compile_all(&cmd.policy_specs, "session", "policies") {
            Ok(policies) => policies,
            Err(e) => return CreateAnswer::Refused(format!("session policies: {e}")),
        };
        if let Err(full) = self.reserve_session(&session_id, &cmd) {
            return CreateAnswer::NoRoom(full);
        }
        CreateAnswer::from_result(self.start_session(cmd, session_id).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_node_without_room_sends_the_create_on() {
        let full = CreateAnswer::NoRoom("full".into());
        assert!(matches!(full.into_result(), Err(EngineError::Overloaded(_))));
        let at_quota = CreateAnswer::from_result(Err(EngineError::Overloaded("quota".into())));
        assert!(matches!(at_quota, CreateAnswer::AtQuota(_)), "a quota refusal stops the hand-over");
        let stage = CreateAnswer::from_result(Err(EngineError::StageFailed {
            stage: FailureStage::SessionStart,
            raw: "boom".into(),
        }));
        let json = serde_json::to_string(&stage).unwrap();
        assert_eq!(json, r#"{"StageFailed":{"stage":"session_start","raw":"boom"}}"#);
        let back: CreateAnswer = serde_json::from_str(&json).unwrap();
        assert!(matches!(back.into_result(), Err(EngineError::StageFailed { stage: FailureStage::SessionStart, .. })));
    }
}
