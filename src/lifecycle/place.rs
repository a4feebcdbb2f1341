//! Sessions on a fleet: a session is created on a node that can run it.
//!
//! A session is not queued: its caller waits in `CreateSession` for an
//! active session, and a turn-by-turn conversation that waited minutes in a
//! queue for its first turn is not what an interactive caller wants. A node
//! that cannot take it (a front end, no room under its admission limit, or
//! a profile whose labels it lacks) hands the create to another active node
//! that can, through the store (a `create_session` request, as for every
//! forwarded call), trying each such node once; the first that takes it
//! runs the session, and every later call reaches it there. When none has
//! room, the create is `RESOURCE_EXHAUSTED`, as on a single node. The
//! principal's quota is counted across the fleet where the session is
//! stored, on whichever node takes it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::queue::{can_take, covers};
use super::{CreateSessionCommand, Engine, EngineError, SessionRecord};
use crate::types::evidence::FailureStage;

/// How long a node waits for another to start a session it handed over:
/// the whole start (sandbox, harness) happens there.
pub const CREATE_FORWARD_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// labels the profile needs.
    pub(super) fn takes_sessions_of(&self, profile_ref: &str) -> bool {
        !self.store.is_shared() || (self.runs_work() && covers(self.fleet_labels(), &self.needs_of(profile_ref)))
    }

    /// Hands a create to the other active nodes able to run it, one after
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
        let able: Vec<&str> = nodes
            .iter()
            .filter(|n| can_take(n, &needs))
            .map(|n| n.name.as_str())
            .filter(|name| *name != self.store.node())
            .collect();
        if able.is_empty() {
            return Err(match refused_here {
                Some(why) => EngineError::Overloaded(why),
                None => self.no_node_can_run(&cmd.profile_ref, &needs),
            });
        }
        // The id this node chose, for every node it asks.
        cmd.session_id = session_id.clone();
        let payload = serde_json::to_string(&cmd).map_err(crate::store::StoreError::from)?;
        let first = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut full = Vec::new();
        for i in 0..able.len() {
            let node = able[(first + i) % able.len()];
            let (_, answer) =
                self.forward_for(node, "create_session", &session_id, &payload, CREATE_FORWARD_TIMEOUT).await?;
            let answer: CreateAnswer = serde_json::from_str(&answer).map_err(crate::store::StoreError::from)?;
            match answer {
                CreateAnswer::NoRoom(why) => full.push(format!("node {node}: {why}")),
                answer => {
                    if let CreateAnswer::Created(_) = answer {
                        tracing::info!(session_id = %session_id, node, "session handed to a node with room");
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

    /// Starts a session another node handed over (request `request`), on its
    /// own task: a start takes seconds, and the requests behind it must not
    /// wait for it.
    pub(super) fn answer_create(self: &Arc<Self>, request: String, session_id: String, payload: String) {
        let engine = self.clone();
        tokio::spawn(async move {
            let answer = match serde_json::from_str::<CreateSessionCommand>(&payload) {
                Err(e) => CreateAnswer::Unavailable(format!("a create_session request: {e}")),
                Ok(cmd) => engine.create_handed(cmd, session_id).await,
            };
            let answer = serde_json::to_string(&answer).map_err(|e| e.to_string());
            if let Err(e) = engine.store.answer_request(&request, answer).await {
                tracing::warn!(error = %e, request = %request, "fleet: a handed create not answered");
            }
        });
    }

    async fn create_handed(self: &Arc<Self>, mut cmd: CreateSessionCommand, session_id: String) -> CreateAnswer {
        if self.is_draining() || !self.takes_sessions_of(&cmd.profile_ref) {
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
