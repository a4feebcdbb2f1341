//! The one mapping from domain errors to gRPC statuses, with a stable
//! machine reason (`google.rpc.ErrorInfo`) and the offending field
//! (`google.rpc.BadRequest`).

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::lifecycle::{Cut, EngineError, Lagged};

/// The `domain` of every `google.rpc.ErrorInfo` corral sends.
pub const DOMAIN: &str = "corral.dev";

/// A status with `code` and `message` whose `ErrorInfo` carries the stable
/// machine `reason` and `metadata`.
pub fn with_reason(code: Code, message: String, reason: &str, metadata: Vec<(String, String)>) -> Status {
    let details = ErrorDetails::with_error_info(
        reason,
        DOMAIN,
        metadata.into_iter().collect::<std::collections::HashMap<_, _>>(),
    );
    Status::with_error_details(code, message, details)
}

/// Bad input: INVALID_ARGUMENT naming the field.
pub fn invalid_argument(field: &str, description: impl Into<String>) -> Status {
    let description = description.into();
    let mut details = ErrorDetails::new();
    details.set_bad_request(vec![FieldViolation::new(field, description.clone())]);
    details.set_error_info("INVALID_ARGUMENT", DOMAIN, [("field".to_string(), field.to_string())]);
    Status::with_error_details(Code::InvalidArgument, format!("{field}: {description}"), details)
}

impl From<EngineError> for Status {
    fn from(error: EngineError) -> Status {
        let message = error.to_string();
        match error {
            EngineError::NotFound(_) => with_reason(Code::NotFound, message, "NOT_FOUND", vec![]),
            EngineError::AlreadyExists(request_id) => {
                with_reason(Code::AlreadyExists, message, "REQUEST_ID_REUSED", vec![("request_id".into(), request_id)])
            }
            EngineError::SessionExists(session_id) => {
                with_reason(Code::AlreadyExists, message, "SESSION_ID_TAKEN", vec![("session_id".into(), session_id)])
            }
            EngineError::Unavailable(_) => with_reason(Code::Unavailable, message, "DRAINING", vec![]),
            EngineError::NoNodeCanRun(_) => with_reason(Code::Unavailable, message, "NO_NODE_CAN_RUN", vec![]),
            EngineError::NodeUnreachable { node, .. } => {
                with_reason(Code::Unavailable, message, "NODE_UNREACHABLE", vec![("node".into(), node)])
            }
            EngineError::OutOfRange { oldest, .. } => with_reason(
                Code::OutOfRange,
                message,
                "SEQUENCE_COMPACTED",
                vec![("oldest_sequence".into(), oldest.to_string())],
            ),
            EngineError::PastEnd { last, .. } => with_reason(
                Code::OutOfRange,
                message,
                "SEQUENCE_NOT_STORED",
                vec![("last_sequence".into(), last.to_string())],
            ),
            EngineError::Refused(_) => with_reason(Code::FailedPrecondition, message, "RESOLUTION_REFUSED", vec![]),
            EngineError::AgentStartDenied { policy, reason } => with_reason(
                Code::PermissionDenied,
                message,
                "AGENT_START_DENIED",
                vec![("policy".into(), policy), ("reason".into(), reason)],
            ),
            EngineError::StageFailed { stage, raw } => {
                // The caller of CreateSession is the direct caller: it gets
                // the raw error in the status message.
                with_reason(
                    Code::Internal,
                    format!("{message}: {raw}"),
                    "STAGE_FAILED",
                    vec![("stage".into(), stage.as_str().into())],
                )
            }
            EngineError::FailedPrecondition(_) => {
                with_reason(Code::FailedPrecondition, message, "FAILED_PRECONDITION", vec![])
            }
            EngineError::PermissionDenied(_) => {
                with_reason(Code::PermissionDenied, message, "PERMISSION_DENIED", vec![])
            }
            EngineError::Overloaded(_) => with_reason(Code::ResourceExhausted, message, "OVERLOADED", vec![]),
            EngineError::Store(e) => {
                // The store's words may carry paths and SQL: log them, do
                // not send them.
                tracing::error!(error = %e, "store error");
                with_reason(Code::Internal, "internal store error".into(), "STORE", vec![])
            }
        }
    }
}

/// A watcher ended before its subject's end (see [`Cut`]): it can resume
/// after `last_sequence`.
pub fn lagged(lag: Lagged) -> Status {
    let (code, message, reason) = match lag.cut {
        Cut::Behind => (Code::ResourceExhausted, "watcher fell behind", "WATCHER_LAGGED"),
        Cut::StoreFailed => (Code::Unavailable, "reading stored events failed", "STORE_UNAVAILABLE"),
        Cut::EndNotStored => {
            (Code::Unavailable, "the subject's live events closed before its end was stored", "END_NOT_STORED")
        }
    };
    with_reason(
        code,
        format!("{message}; resume with after_sequence = {}", lag.last_sequence),
        reason,
        vec![("last_sequence".into(), lag.last_sequence.to_string())],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_store_read_is_unavailable_with_the_last_sequence_not_lagged() {
        let failed = lagged(Lagged { last_sequence: 7, cut: Cut::StoreFailed });
        assert_eq!(failed.code(), Code::Unavailable);
        let info = failed.get_details_error_info().unwrap();
        assert_eq!(info.reason, "STORE_UNAVAILABLE");
        assert_eq!(info.metadata.get("last_sequence").map(String::as_str), Some("7"));
        let behind = lagged(Lagged { last_sequence: 7, cut: Cut::Behind });
        assert_eq!(behind.code(), Code::ResourceExhausted);
        assert_eq!(behind.get_details_error_info().unwrap().reason, "WATCHER_LAGGED");
        let cut = lagged(Lagged { last_sequence: 7, cut: Cut::EndNotStored });
        assert_eq!(cut.code(), Code::Unavailable);
        assert_eq!(
            cut.message(),
            "the subject's live events closed before its end was stored; resume with after_sequence = 7"
        );
        assert_eq!(cut.get_details_error_info().unwrap().reason, "END_NOT_STORED");
    }
}
