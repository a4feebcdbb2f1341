//! `--json` output: canonical protobuf JSON (the mapping grpcurl prints),
//! produced by re-reading each prost message through its descriptor.

use anyhow::Context as _;
use prost_reflect::{DescriptorPool, DynamicMessage};

use crate::pb;

/// A generated message that `--json` can print; prost-build does not emit
/// type names by default, so each printable type declares its own.
pub(super) trait WireMessage: prost::Message {
    const FULL_NAME: &'static str;
}

impl WireMessage for pb::LifecycleEvent {
    const FULL_NAME: &'static str = "corral.v1.LifecycleEvent";
}
impl WireMessage for pb::Execution {
    const FULL_NAME: &'static str = "corral.v1.Execution";
}
impl WireMessage for pb::ListExecutionsResponse {
    const FULL_NAME: &'static str = "corral.v1.ListExecutionsResponse";
}
impl WireMessage for pb::ListProfilesResponse {
    const FULL_NAME: &'static str = "corral.v1.ListProfilesResponse";
}
impl WireMessage for pb::DecideToolCallResponse {
    const FULL_NAME: &'static str = "corral.v1.DecideToolCallResponse";
}
impl WireMessage for pb::Session {
    const FULL_NAME: &'static str = "corral.v1.Session";
}
impl WireMessage for pb::DaemonInfo {
    const FULL_NAME: &'static str = "corral.v1.DaemonInfo";
}
impl WireMessage for pb::ListNodesResponse {
    const FULL_NAME: &'static str = "corral.v1.ListNodesResponse";
}

/// The corral descriptors, decoded once per process.
pub(super) struct JsonEncoder {
    pool: DescriptorPool,
}

impl JsonEncoder {
    pub(super) fn new() -> anyhow::Result<Self> {
        let pool = DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET)
            .context("cannot decode the embedded corral descriptor set")?;
        // Timestamps print as RFC 3339 strings only if the well-known type
        // is in the pool; without it decoding the corral files fails above.
        anyhow::ensure!(
            pool.get_message_by_name("google.protobuf.Timestamp").is_some(),
            "the embedded descriptor set lacks google.protobuf.Timestamp"
        );
        Ok(Self { pool })
    }

    /// One line of canonical JSON for `message`, without a trailing newline.
    pub(super) fn line<M: WireMessage>(&self, message: &M) -> anyhow::Result<String> {
        let descriptor = self
            .pool
            .get_message_by_name(M::FULL_NAME)
            .with_context(|| format!("no descriptor for {}", M::FULL_NAME))?;
        let bytes = message.encode_to_vec();
        let dynamic = DynamicMessage::decode(descriptor, bytes.as_slice())
            .with_context(|| format!("cannot re-read a {} for JSON", M::FULL_NAME))?;
        // serde_json's compact writer never emits a newline, so each
        // message stays on one line even when a string holds newlines.
        serde_json::to_string(&dynamic).with_context(|| format!("cannot print a {} as JSON", M::FULL_NAME))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_prints_as_canonical_json() {
        let encoder = JsonEncoder::new().expect("descriptor pool");
        let execution = pb::Execution {
            execution_id: "e1".into(),
            state: pb::ExecutionState::Succeeded as i32,
            created_at: Some(prost_types::Timestamp { seconds: 1_700_000_000, nanos: 0 }),
            tool_output: "a\nb".into(),
            ..Default::default()
        };
        let line = encoder.line(&execution).expect("json");
        assert!(!line.contains('\n'), "{line}");
        let value: serde_json::Value = serde_json::from_str(&line).expect("valid json");
        assert_eq!(
            value,
            serde_json::json!({
                "executionId": "e1",
                "state": "EXECUTION_STATE_SUCCEEDED",
                "createdAt": "2023-11-14T22:13:20Z",
                "toolOutput": "a\nb",
            })
        );
    }

    #[test]
    fn every_printable_type_has_a_descriptor() {
        let encoder = JsonEncoder::new().expect("descriptor pool");
        assert!(encoder.line(&pb::LifecycleEvent::default()).is_ok());
        assert!(encoder.line(&pb::ListExecutionsResponse::default()).is_ok());
        assert!(encoder.line(&pb::ListProfilesResponse::default()).is_ok());
        assert!(encoder.line(&pb::ListNodesResponse::default()).is_ok());
    }
}
