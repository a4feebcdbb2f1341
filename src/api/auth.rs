//! Authentication at the edge: an interceptor on every corral service
//! (health and reflection stay open) ties the call to a principal — its
//! bearer token, or the unix socket's peer uid — and puts it in the
//! request's extensions; handlers take it with [`caller`]. Every call that
//! creates, cancels or ends something is written to the `corral::audit`
//! log target with the principal, the RPC and the subject, never task text;
//! every refusal too (`audit`).

use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Code, Request, Status};

use super::status;
use crate::auth::{Credential, Denied, Principal, Principals};

/// Identifies each call with the principals current when it arrives (see
/// [`Principals`]: a reload applies from the next call on).
#[derive(Clone)]
pub struct Authenticate(pub Arc<Principals>);

impl Interceptor for Authenticate {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let header = request.metadata().get("authorization").map(|v| v.to_str().unwrap_or(""));
        let bearer = match header {
            Some(value) => Some(
                value
                    .strip_prefix("Bearer ")
                    .or_else(|| value.strip_prefix("bearer "))
                    .ok_or_else(|| unauthenticated("the authorization header is not `Bearer <token>`"))?,
            ),
            None => None,
        };
        let peer = request.extensions().get::<UdsConnectInfo>().and_then(|i| i.peer_cred).map(|c| c.uid());
        // A client certificate is verified against client_ca by the TLS
        // handshake before any request arrives; here only its names count.
        let cert_names: Vec<String> = request
            .peer_certs()
            .and_then(|certs| certs.first().map(|c| crate::auth::certificate_names(c.as_ref())))
            .unwrap_or_default();
        let credential = match (bearer, peer) {
            (Some(token), _) => Credential::Bearer(token),
            (None, _) if !cert_names.is_empty() => Credential::ClientCert(&cert_names),
            (None, Some(uid)) => Credential::UnixPeer(uid),
            (None, None) => Credential::None,
        };
        let principal = self.0.current().identify(credential).map_err(unauthenticated)?;
        if let Some(slot) = request.extensions().get::<super::audit::AuditSlot>() {
            slot.set(&principal.name);
        }
        request.extensions_mut().insert(principal);
        Ok(request)
    }
}

fn unauthenticated(why: &str) -> Status {
    status::with_reason(Code::Unauthenticated, why.to_string(), "UNAUTHENTICATED", vec![])
}

/// The principal the interceptor found for this call.
pub fn caller<T>(request: &Request<T>) -> Result<Arc<Principal>, Status> {
    request.extensions().get::<Arc<Principal>>().cloned().ok_or_else(|| unauthenticated("no principal"))
}

/// PERMISSION_DENIED with the rule that said no.
pub fn denied(denied: Denied) -> Status {
    status::with_reason(Code::PermissionDenied, denied.message, denied.reason, vec![])
}

/// NOT_FOUND for a record the principal may not see, worded exactly as for
/// one that does not exist.
pub fn not_visible(what: &str, id: &str) -> Status {
    Status::from(crate::lifecycle::EngineError::NotFound(format!("{what} {id}")))
}

/// One audit line: who did what to which subject.
pub fn audit(principal: &Principal, rpc: &str, subject: &str) {
    tracing::info!(target: "corral::audit", principal = %principal.name, kind = principal.kind.as_str(), rpc, subject, "call");
}

/// Runs `work` (what a call creates or ends) on a task of `engine`'s own
/// (a shutdown waits for it), and writes the call's audit line there once
/// it is done, naming what `subject` finds in its result (none: no line).
/// A caller that goes away before the answer (its deadline passed, it
/// reset the stream) drops this call, not the work, and the work's line is
/// written all the same: what runs was always audited.
pub async fn audited<T: Send + 'static>(
    engine: &crate::lifecycle::Engine,
    principal: &Principal,
    rpc: &'static str,
    work: impl std::future::Future<Output = Result<T, crate::lifecycle::EngineError>> + Send + 'static,
    subject: impl FnOnce(&Result<T, crate::lifecycle::EngineError>) -> Option<String> + Send + 'static,
) -> Result<T, Status> {
    use tracing::Instrument;
    let principal = principal.clone();
    let done = engine.spawn_tracked(
        async move {
            let done = work.await;
            if let Some(subject) = subject(&done) {
                audit(&principal, rpc, &subject);
            }
            done
        }
        // In the call's span: its line and the work's logs carry its trace.
        .instrument(tracing::Span::current()),
    );
    done.await.map_err(|_| Status::internal(format!("{rpc} failed")))?.map_err(Status::from)
}

/// Whether a call's work is done, or may be doing: the node it was
/// forwarded to took the request and did not answer in time. Either gets
/// the call's audit line.
pub fn done_or_taken<T>(result: &Result<T, crate::lifecycle::EngineError>) -> bool {
    match result {
        Ok(_) => true,
        Err(crate::lifecycle::EngineError::NodeUnreachable { outcome, .. }) => *outcome == crate::lifecycle::TAKEN,
        Err(_) => false,
    }
}

/// `DecideToolCall` on either service, once the run is known to be
/// visible: the run's own principal, `adm`, or an approver of its project
/// may decide; then the call must still be waiting. One audit line each,
/// written by the task that decides (here, or through the store on the
/// run's node): a caller gone before the answer decided all the same.
pub async fn decide_tool_call(
    engine: &Arc<crate::lifecycle::Engine>,
    principal: &Principal,
    run: (&str, &crate::sandbox::Consumer),
    call_id: &str,
    allow: bool,
    reason: &str,
) -> Result<crate::pb::DecideToolCallResponse, Status> {
    use crate::gate::approvals::{Decision, Undecidable};
    let (subject, consumer) = run;
    let own = consumer.principal == principal.name;
    let approver = principal.approve && principal.can_see(&consumer.project);
    if !(own || principal.is_admin() || approver) {
        return Err(denied(Denied {
            reason: "NOT_AN_APPROVER",
            message: format!(
                "{} may not decide the tool calls of {subject}: only its own principal, adm, or a principal with \
                 approve = true in project {} may",
                principal.name, consumer.project
            ),
        }));
    }
    let decision = Decision { allow, by: principal.name.clone(), reason: reason.to_string() };
    // Here, or on the node of the fleet that runs it.
    let deciding = {
        let (engine, principal) = (engine.clone(), principal.clone());
        let (subject, call_id) = (subject.to_string(), call_id.to_string());
        async move {
            let decided = engine.decide_tool_call(&subject, &call_id, decision).await;
            let done = match &decided {
                Ok(decision) => decision.is_ok(),
                Err(_) => done_or_taken(&decided),
            };
            if done {
                tracing::info!(
                    target: "corral::audit", principal = %principal.name, kind = principal.kind.as_str(),
                    rpc = "DecideToolCall", subject, call_id, allow, "tool call decided"
                );
            }
            decided
        }
    };
    let decided = engine.spawn_tracked(tracing::Instrument::instrument(deciding, tracing::Span::current())).await;
    match decided.map_err(|_| Status::internal("DecideToolCall failed"))?? {
        Ok(()) => {}
        Err(Undecidable::Unknown) => {
            return Err(status::with_reason(
                Code::NotFound,
                format!("call_id: no tool call {call_id} waits for a decision in {subject}"),
                "NOT_FOUND",
                vec![("call_id".into(), call_id.to_string())],
            ))
        }
        Err(Undecidable::Settled) => {
            return Err(status::with_reason(
                Code::FailedPrecondition,
                format!("call_id: tool call {call_id} of {subject} was already decided (or no longer waits)"),
                "ALREADY_DECIDED",
                vec![("call_id".into(), call_id.to_string())],
            ))
        }
    }
    Ok(crate::pb::DecideToolCallResponse { call_id: call_id.to_string(), allow, decided_by: principal.name.clone() })
}
