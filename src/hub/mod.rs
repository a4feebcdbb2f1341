//! Hub reporting: the redacted evidence of a finished execution, as a
//! CloudEvents 1.0 JSON envelope POSTed to `<url>/progress/`, through a
//! stored outbox so that a hub that is down, slow or failing never changes
//! an execution and nothing is lost across restarts.

mod http;

use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::records::{now_ms, ExecutionRecord};
use crate::store::{OutboxRow, Store};
use crate::types::evidence::HubReportStatus;

/// Where and how to deliver hub reports: the daemon config's `hub` section.
/// Without it, no report is delivered and a request that asks for one notes
/// that no hub is configured.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HubConfig {
    /// `https://host[:port][/base]` (or `http://` on loopback, or without
    /// a token); reports go to `<url>/progress/`.
    pub url: String,
    /// The CA certificates (PEM) an `https://` hub's certificate must chain
    /// to, instead of the system's.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// A daemon environment variable holding the bearer token. Read at start
    /// (unset or empty: refused) and at each delivery; a delivery that cannot
    /// read it fails and is retried, never sent without it.
    pub token_env: Option<String>,
    /// A file holding the bearer token; read as `token_env` is.
    pub token_file: Option<std::path::PathBuf>,
    /// How long one delivery may take, in seconds (default 5; must be above 0).
    #[serde(default = "defaults::timeout")]
    pub timeout_seconds: u64,
    /// The wait before the first retry, in milliseconds (default 500); it
    /// doubles with each failed attempt.
    #[serde(default = "defaults::backoff")]
    pub initial_backoff_ms: u64,
    /// The longest wait between retries, in seconds (default 60).
    #[serde(default = "defaults::max_backoff")]
    pub max_backoff_seconds: u64,
    /// A report still undelivered this long after the execution finished
    /// is given up (`hub_report_status = failed`).
    #[serde(default = "defaults::max_age")]
    pub max_age_seconds: u64,
}

/// The longest `max_age_seconds` or `max_backoff_seconds` a hub section may
/// set: ten years. The daemon's other seconds keys that become milliseconds
/// or `Instant`s have the same bound (`config::at_most_ten_years`).
pub const MAX_WAIT_SECONDS: u64 = crate::types::TEN_YEARS_SECONDS;

mod defaults {
    pub fn timeout() -> u64 {
        5
    }
    pub fn backoff() -> u64 {
        500
    }
    pub fn max_backoff() -> u64 {
        60
    }
    pub fn max_age() -> u64 {
        3600
    }
}

impl HubConfig {
    /// Checks the section before the daemon starts: a usable URL, at most one
    /// token source, no token in clear beyond loopback, a token that can be
    /// read now and is not empty, a CA file only for `https://` (and one that
    /// loads), a timeout above 0, waits of at most [`MAX_WAIT_SECONDS`]. The
    /// error names the offending key and says why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let url = crate::net::client::Origin::parse(&self.url).map_err(|e| ("hub.url".to_string(), e))?;
        if self.token_env.is_some() && self.token_file.is_some() {
            return Err(("hub".into(), "set at most one of token_env and token_file".into()));
        }
        let token = self.token_env.is_some() || self.token_file.is_some();
        if token && url.is_clear_beyond_loopback() {
            return Err((
                "hub.url".into(),
                format!("{}: the bearer token would cross the network in clear; use https://", self.url),
            ));
        }
        // Without it every report would go without Authorization.
        self.token()?;
        if let Some(ca) = &self.ca_file {
            if !url.tls {
                return Err(("hub.ca_file".into(), "only for an https:// hub".into()));
            }
            crate::net::client::tls_config(Some(ca)).map_err(|e| ("hub.ca_file".to_string(), e))?;
        }
        if self.timeout_seconds == 0 {
            return Err(("hub.timeout_seconds".into(), "must be greater than 0".into()));
        }
        // In milliseconds they are added to Unix times (i64): a larger value
        // would wrap and give a report up at its first failure.
        for (key, seconds) in
            [("max_age_seconds", self.max_age_seconds), ("max_backoff_seconds", self.max_backoff_seconds)]
        {
            if seconds > MAX_WAIT_SECONDS {
                return Err((format!("hub.{key}"), format!("{seconds} is more than {MAX_WAIT_SECONDS} (ten years)")));
            }
        }
        Ok(())
    }

    /// The token (`None` without a token source), read at each delivery so
    /// it can rotate. Never logged: the error `(key, why)` names the source,
    /// never a value.
    fn token(&self) -> Result<Option<String>, (String, String)> {
        let (key, read) = match (&self.token_env, &self.token_file) {
            (Some(var), _) => (
                "hub.token_env",
                std::env::var(var).map_err(|e| match e {
                    std::env::VarError::NotPresent => format!("{var} is not set"),
                    // Not the error's own words: they would show the value.
                    std::env::VarError::NotUnicode(_) => format!("{var} is not UTF-8"),
                }),
            ),
            (None, Some(path)) => {
                ("hub.token_file", std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display())))
            }
            (None, None) => return Ok(None),
        };
        match read.as_deref().map(str::trim) {
            Err(why) => Err((key.into(), why.clone())),
            Ok("") => Err((key.into(), "the token is empty".into())),
            Ok(token) => Ok(Some(token.to_string())),
        }
    }

    fn backoff(&self, attempts: u32) -> Duration {
        let base = Duration::from_millis(self.initial_backoff_ms.max(1));
        let cap = Duration::from_secs(self.max_backoff_seconds.max(1));
        base.saturating_mul(1u32 << attempts.min(20)).min(cap)
    }
}

/// The report: the evidence's redacted facts and nothing else. Built field
/// by field so that a field added to the evidence is not reported unless
/// someone decides it may be.
pub fn report(record: &ExecutionRecord) -> Value {
    let e = &record.evidence;
    let data = json!({
        "execution_id": record.execution_id,
        "state": record.state.as_str(),
        "outcome": e.outcome,
        "failure_stage": e.failure_stage.map(|s| s.as_str()),
        "error": e.error,
        "profile_ref": e.profile_ref,
        "profile_digest": e.profile_digest,
        "readiness": e.readiness,
        "rein": e.rein,
        "sandbox_id": e.sandbox_id,
        "request_id": e.request_id,
        "correlation_id": e.correlation_id,
        "assignment_ref": e.assignment_ref,
        "actor": record.consumer.actor,
        "project": record.consumer.project,
        "commit_sha": e.commit_sha,
        "tokens_spent": e.tokens_spent,
        "resolved_model": e.resolved_model,
        "session_cleanup": e.session_cleanup,
        "sandbox_destroy": e.sandbox_destroy,
        "gate_decisions": e.gate_decisions,
        "egress": { "allowed": e.egress.allowed, "denied": e.egress.denied },
        "workspace_snapshot": e.workspace_snapshot,
        "agent_commits": e.agent_commits,
    });
    json!({
        "specversion": "1.0",
        "type": "dev.corral.execution.finished",
        "source": "corral",
        "id": record.execution_id,
        "time": rfc3339(record.finished_at_ms.unwrap_or_else(now_ms)),
        "datacontenttype": "application/json",
        "subject": record.execution_id,
        "data": data,
    })
}

/// RFC 3339 in UTC to the millisecond, e.g. `2023-11-14T22:13:20.123Z`.
pub(crate) fn rfc3339(ms: i64) -> String {
    crate::types::rfc3339(i128::from(ms) * 1_000_000, crate::types::Fraction::Millis)
}

/// Delivers the outbox in the background.
pub struct Hub {
    config: HubConfig,
    store: Store,
    wake: Notify,
    /// `None` when the URL or CA cannot be used (validation refuses such a
    /// config at start; a report then fails and is retried).
    client: Option<http::Client>,
}

impl Hub {
    /// A hub for `config` that delivers the reports of `store`'s outbox. A URL
    /// or CA file that cannot be used is logged; its reports then fail and are
    /// retried.
    pub fn new(config: HubConfig, store: Store) -> Arc<Hub> {
        let client = http::Client::new(&config.url, config.ca_file.as_deref())
            .map_err(|e| tracing::error!(error = %e, "the hub client cannot be set up"))
            .ok();
        Arc::new(Hub { config, store, wake: Notify::new(), client })
    }

    /// A new report was stored: deliver it now rather than at the next tick.
    pub fn notify(&self) {
        self.wake.notify_one();
    }

    /// Starts the delivery loop on the Tokio runtime: due reports are tried
    /// every 200 ms, or at once after [`Hub::notify`]. The loop ends when the
    /// last `Arc` of the hub is dropped.
    pub fn spawn(self: &Arc<Self>) {
        let hub: Weak<Hub> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(this) = hub.upgrade() else { return };
                if let Err(e) = this.deliver_due().await {
                    tracing::warn!(error = %e, "hub outbox pass failed");
                }
                let wait = tokio::time::sleep(Duration::from_millis(200));
                tokio::select! {
                    _ = wait => {}
                    _ = this.wake.notified() => {}
                }
            }
        });
    }

    async fn deliver_due(&self) -> Result<(), crate::store::StoreError> {
        let now = now_ms();
        for row in self.store.due_reports(now, 32).await? {
            self.attempt(row).await?;
        }
        Ok(())
    }

    async fn attempt(&self, row: OutboxRow) -> Result<(), crate::store::StoreError> {
        let timeout = Duration::from_secs(self.config.timeout_seconds);
        let result = match (self.config.token(), &self.client) {
            // A token that cannot be read fails the attempt: the report is
            // never sent without it.
            (Err((key, why)), _) => Err(format!("{key}: {why}")),
            (Ok(token), Some(client)) => client
                .post_json("/progress/", token.as_deref(), row.body.as_bytes(), timeout)
                .await
                .map_err(|e| e.to_string()),
            (Ok(_), None) => Err(http::PostError::Connect.to_string()),
        };
        let attempts = row.attempts + 1;
        let outcome = match result {
            Ok(code) if (200..300).contains(&code) => {
                tracing::info!(execution_id = %row.subject_id, attempts, "hub accepted the report");
                crate::telemetry::hub_delivery(true);
                Some(HubReportStatus::Accepted)
            }
            other => {
                // Only the class of failure is logged: transport errors can
                // carry addresses and texts that do not belong in logs.
                let why = match other {
                    Ok(code) => format!("status {code}"),
                    Err(e) => e,
                };
                let max_age_ms = i64::try_from(self.config.max_age_seconds.saturating_mul(1000)).unwrap_or(i64::MAX);
                let expired = now_ms().saturating_sub(row.created_at_ms) >= max_age_ms;
                if expired {
                    tracing::warn!(execution_id = %row.subject_id, attempts, %why, "hub report given up");
                    crate::telemetry::hub_delivery(false);
                    Some(HubReportStatus::Failed)
                } else {
                    tracing::debug!(execution_id = %row.subject_id, attempts, %why, "hub report will be retried");
                    None
                }
            }
        };
        match outcome {
            Some(status) => self.store.settle_report(&row.id, &row.subject_id, status, attempts).await,
            None => {
                let backoff_ms = i64::try_from(self.config.backoff(attempts).as_millis()).unwrap_or(i64::MAX);
                let next = now_ms().saturating_add(backoff_ms);
                self.store.retry_report(&row.id, attempts, next).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let config = HubConfig {
            url: "http://h".into(),
            ca_file: None,
            token_env: None,
            token_file: None,
            timeout_seconds: 1,
            initial_backoff_ms: 100,
            max_backoff_seconds: 1,
            max_age_seconds: 10,
        };
        assert_eq!(config.backoff(0), Duration::from_millis(100));
        assert_eq!(config.backoff(3), Duration::from_millis(800));
        assert_eq!(config.backoff(9), Duration::from_secs(1));
    }

    #[test]
    fn waits_too_long_to_count_in_milliseconds_are_refused_naming_the_key() {
        let config = |max_age_seconds: u64, max_backoff_seconds: u64| HubConfig {
            url: "http://127.0.0.1:9".into(),
            ca_file: None,
            token_env: None,
            token_file: None,
            timeout_seconds: 1,
            initial_backoff_ms: 100,
            max_backoff_seconds,
            max_age_seconds,
        };
        let refused =
            |key: &str, value: u64| Err((key.to_string(), format!("{value} is more than 315360000 (ten years)")));
        let cases = [
            (config(18_446_744_073_709_551, 60), refused("hub.max_age_seconds", 18_446_744_073_709_551)),
            (config(u64::MAX, 60), refused("hub.max_age_seconds", u64::MAX)),
            (config(MAX_WAIT_SECONDS + 1, 60), refused("hub.max_age_seconds", MAX_WAIT_SECONDS + 1)),
            (config(3600, u64::MAX / 1000), refused("hub.max_backoff_seconds", u64::MAX / 1000)),
            (config(MAX_WAIT_SECONDS, MAX_WAIT_SECONDS), Ok(())),
            (config(0, 0), Ok(())),
        ];
        for (config, expected) in cases {
            assert_eq!(config.validate(), expected, "{config:?}");
        }
    }

    fn with_token(token_env: Option<&str>, token_file: Option<&std::path::Path>) -> HubConfig {
        HubConfig {
            url: "http://127.0.0.1:9".into(),
            ca_file: None,
            token_env: token_env.map(Into::into),
            token_file: token_file.map(Into::into),
            timeout_seconds: 1,
            initial_backoff_ms: 100,
            max_backoff_seconds: 1,
            max_age_seconds: 3600,
        }
    }

    /// A token that cannot be read would have every report POSTed without
    /// Authorization: refused at start, naming the key.
    #[test]
    fn a_token_that_cannot_be_read_is_refused_naming_the_key() {
        let unset = "CORRAL_TEST_HUB_TOKEN_NEVER_SET";
        assert_eq!(
            with_token(Some(unset), None).validate(),
            Err(("hub.token_env".into(), format!("{unset} is not set")))
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let (key, why) = with_token(None, Some(&file)).validate().unwrap_err();
        assert!(key == "hub.token_file" && why.starts_with(&file.display().to_string()), "{key}: {why}");
        std::fs::write(&file, " \n").unwrap();
        assert_eq!(
            with_token(None, Some(&file)).validate(),
            Err(("hub.token_file".into(), "the token is empty".into()))
        );
        std::fs::write(&file, "hub-token\n").unwrap();
        assert_eq!(with_token(None, Some(&file)).validate(), Ok(()));
        assert_eq!(with_token(None, Some(&file)).token(), Ok(Some("hub-token".into())));
    }

    /// At delivery a token that cannot be read (it rotated away) fails the
    /// attempt: nothing reaches the hub, never a request without the header.
    #[tokio::test]
    async fn a_delivery_without_its_token_sends_nothing() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), None, "n").await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let file = dir.path().join("token");
        let config =
            HubConfig { url: format!("http://{}", listener.local_addr().unwrap()), ..with_token(None, Some(&file)) };
        let hub = Hub::new(config, store);
        let row = || OutboxRow {
            id: "r1".into(),
            subject_id: "e1".into(),
            body: "{}".into(),
            attempts: 0,
            created_at_ms: now_ms(),
        };
        hub.attempt(row()).await.unwrap();
        let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
        assert!(accepted.is_err(), "a report went to the hub without its token");
        // Once the token is there again, the report goes, with it.
        std::fs::write(&file, "hub-token\n").unwrap();
        let delivery = tokio::spawn({
            let hub = hub.clone();
            async move { hub.attempt(row()).await }
        });
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8];
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
        assert!(head.contains("authorization: bearer hub-token\r\n"), "{head}");
        stream.write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n").await.unwrap();
        delivery.await.unwrap().unwrap();
    }
}
