//! Audit lines for refusals. Every corral service is wrapped in
//! [`Audited`]: a call answered UNAUTHENTICATED, PERMISSION_DENIED or
//! NOT_FOUND (which is also what a record of another project looks like)
//! leaves one line on the `corral::audit` target with the principal (or
//! `anonymous`), the RPC and the code — never the status message, the
//! request, a token or task text. The principal is learned from the
//! authentication interceptor through an [`AuditSlot`] in the request's
//! extensions, so the caller is identified once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use tonic::codegen::http;
use tonic::server::NamedService;

/// Filled by the interceptor with the name of the principal it found.
#[derive(Clone, Default)]
pub struct AuditSlot(Arc<OnceLock<String>>);

impl AuditSlot {
    pub fn set(&self, principal: &str) {
        let _ = self.0.set(principal.to_string());
    }
}

/// A corral service whose refusals are audited.
#[derive(Clone)]
pub struct Audited<S>(pub S);

impl<S: NamedService> NamedService for Audited<S> {
    const NAME: &'static str = S::NAME;
}

/// The codes that are refusals: who was turned away matters to an operator.
fn refusal(code: tonic::Code) -> Option<&'static str> {
    match code {
        tonic::Code::Unauthenticated => Some("UNAUTHENTICATED"),
        tonic::Code::PermissionDenied => Some("PERMISSION_DENIED"),
        tonic::Code::NotFound => Some("NOT_FOUND"),
        _ => None,
    }
}

/// The RPC of a gRPC path (`/corral.v1.ExecutionService/GetExecution` →
/// `ExecutionService/GetExecution`), bounded: the path is the caller's.
fn rpc_name(path: &str) -> String {
    let rpc = path.strip_prefix("/corral.v1.").unwrap_or(path);
    rpc.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '/' || *c == '.').take(96).collect()
}

impl<S, B, RB> tower::Service<http::Request<B>> for Audited<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let slot = AuditSlot::default();
        request.extensions_mut().insert(slot.clone());
        let rpc = rpc_name(request.uri().path());
        let answer = self.0.call(request);
        Box::pin(async move {
            let response = answer.await?;
            // Refusals are answered at once: the status is in the headers
            // (trailers-only), not in trailers after a stream.
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map(tonic::Code::from_i32);
            if let Some(code) = code.and_then(refusal) {
                let principal = slot.0.get().map(String::as_str).unwrap_or("anonymous");
                tracing::info!(target: "corral::audit", principal, rpc, code, "refused");
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refusals_are_audited_and_the_rpc_is_bounded() {
        assert_eq!(refusal(tonic::Code::NotFound), Some("NOT_FOUND"));
        assert_eq!(refusal(tonic::Code::Ok), None);
        assert_eq!(refusal(tonic::Code::InvalidArgument), None);
        assert_eq!(rpc_name("/corral.v1.ExecutionService/GetExecution"), "ExecutionService/GetExecution");
        assert_eq!(rpc_name(&format!("/x\n{}", "a".repeat(500))).len(), 96);
        assert!(!rpc_name("/x\ny").contains('\n'));
    }
}
