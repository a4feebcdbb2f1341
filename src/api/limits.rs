//! The server's limits, from the config's `[grpc]` section: message sizes
//! per service and the caller's deadline (`grpc-timeout`); the connection's
//! own (streams, keepalive, send buffer) are set in [`super::serve`].
//! Watchers are bounded by the engine, which owns the subscriptions.
//!
//! Deadlines: the server ends a unary call whose `grpc-timeout` passes
//! before it answers (its handler future is dropped, which is why work that must go
//! on — an execution, a session's start — runs on the engine's own tasks).
//! A stream's deadline is this module's: [`deadline`] reads it, and the
//! stream ends with DEADLINE_EXCEEDED when it passes.

use std::time::{Duration, Instant};

use tonic::Request;

/// Applies the message size limits to a generated service server.
macro_rules! sized {
    ($server:expr, $limits:expr) => {
        $server
            .max_decoding_message_size($limits.max_recv_message_bytes)
            .max_encoding_message_size($limits.max_send_message_bytes)
    };
}
pub(crate) use sized;

/// When the caller's deadline passes, if it set one.
pub fn deadline<T>(request: &Request<T>) -> Option<Instant> {
    let value = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    Some(Instant::now() + parse_grpc_timeout(value)?)
}

/// The caller's `grpc-timeout` from a request's headers, if it set one.
pub fn timeout_of(headers: &http::HeaderMap) -> Option<Duration> {
    parse_grpc_timeout(headers.get("grpc-timeout")?.to_str().ok()?)
}

/// `grpc-timeout`: at most 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if !value.is_ascii() {
        return None;
    }
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_values() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        for bad in ["", "S", "5", "5s", "123456789S", "-1S", "1.5S", "５S", "1５"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
