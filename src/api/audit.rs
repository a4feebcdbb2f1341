//! Audit lines for refusals, and a server span per call. Every corral
//! service is wrapped in [`Audited`]:
//!
//! - a call answered UNAUTHENTICATED, PERMISSION_DENIED or NOT_FOUND
//!   (which is also what a record of another project looks like) leaves one
//!   line on the `corral::audit` target with the principal (or
//!   `anonymous`), the RPC and the code — never the status message, the
//!   request, a token or task text. The principal is learned from the
//!   authentication interceptor through an [`AuditSlot`] in the request's
//!   extensions, so the caller is identified once;
//! - every call is one `SERVER` span named `<service>/<method>` with
//!   OpenTelemetry's RPC attributes (`rpc.system`, `rpc.service`,
//!   `rpc.method`, `rpc.grpc.status_code`), a child of the caller's
//!   `traceparent`. It lasts until the response's last frame (a stream's
//!   trailers), and has an error status for the codes the semantic
//!   conventions call server errors. The run a call starts has its own
//!   span (`execution`, `session`, `turn`), also a child of the caller's.

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

/// The `grpc-status` a header map carries, if any.
fn grpc_status(headers: &http::HeaderMap) -> Option<tonic::Code> {
    let code = headers.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(tonic::Code::from_i32(code))
}

/// Whether a server span with this code is an error (OpenTelemetry's gRPC
/// conventions: the codes that mean the server failed, not the caller).
fn server_error(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(code, Unknown | DeadlineExceeded | Unimplemented | Internal | Unavailable | DataLoss)
}

/// Records a call's final code on its span.
fn finish(span: &tracing::Span, code: tonic::Code) {
    span.record("rpc.grpc.status_code", code as i32);
    if server_error(code) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.set_status(opentelemetry::trace::Status::error(format!("{code:?}")));
    }
}

impl<S, B, RB> tower::Service<http::Request<B>> for Audited<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let slot = AuditSlot::default();
        request.extensions_mut().insert(slot.clone());
        let rpc = rpc_name(request.uri().path());
        let (service, method) = rpc.split_once('/').unwrap_or((rpc.as_str(), ""));
        let span = tracing::info_span!(
            "rpc",
            otel.name = %format!("corral.v1.{service}/{method}"),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %format!("corral.v1.{service}"),
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let traceparent = request.headers().get("traceparent").and_then(|v| v.to_str().ok());
        crate::telemetry::set_parent(&span, traceparent);
        let answer = span.in_scope(|| self.0.call(request));
        Box::pin(async move {
            let response = tracing::Instrument::instrument(answer, span.clone()).await?;
            // Refusals are answered at once: the status is in the headers
            // (trailers-only), not in trailers after a stream.
            let code = grpc_status(response.headers());
            if let Some(refused) = code.and_then(refusal) {
                let principal = slot.0.get().map(String::as_str).unwrap_or("anonymous");
                tracing::info!(target: "corral::audit", principal, rpc, code = refused, "refused");
            }
            if let Some(code) = code {
                finish(&span, code);
            }
            Ok(response.map(|body| tonic::body::Body::new(Traced { body, span: Some(span) })))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds its call's span until the last frame,
    /// and records the code its trailers carry.
    struct Traced<B> {
        #[pin]
        body: B,
        span: Option<tracing::Span>,
    }
}

impl<B: http_body::Body> http_body::Body for Traced<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let polled = this.body.poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(code), Some(span)) = (frame.trailers_ref().and_then(grpc_status), this.span.as_ref()) {
                    finish(span, code);
                }
            }
            // The end: the span closes now, not when the body is dropped.
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => *this.span = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
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

    #[test]
    fn server_errors_are_the_conventions_list() {
        use tonic::Code::*;
        let errors: Vec<_> = [
            Ok,
            Cancelled,
            Unknown,
            InvalidArgument,
            DeadlineExceeded,
            NotFound,
            AlreadyExists,
            PermissionDenied,
            ResourceExhausted,
            FailedPrecondition,
            Aborted,
            OutOfRange,
            Unimplemented,
            Internal,
            Unavailable,
            DataLoss,
            Unauthenticated,
        ]
        .into_iter()
        .filter(|c| server_error(*c))
        .collect();
        assert_eq!(errors, vec![Unknown, DeadlineExceeded, Unimplemented, Internal, Unavailable, DataLoss]);
        let mut headers = http::HeaderMap::new();
        assert_eq!(grpc_status(&headers), None);
        headers.insert("grpc-status", http::HeaderValue::from_static("7"));
        assert_eq!(grpc_status(&headers), Some(PermissionDenied));
    }
}
