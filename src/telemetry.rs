//! Prometheus metrics (`metrics` + `metrics-exporter-prometheus`), served on
//! `metrics_listen` when it is set; OpenTelemetry traces (OTLP over gRPC,
//! `tracing-opentelemetry`) when `[telemetry] otlp_endpoint` is set: one
//! trace per execution (its span, a child per stage), joined to the
//! caller's trace when the call carries a W3C `traceparent`. Labels are fixed sets (outcome, stage,
//! source, action, kind): never a secret, a task text, an id or anything
//! else a caller controls the size of.

use metrics::{counter, gauge, histogram};

use crate::evidence::Evidence;

/// Histogram buckets (seconds) of every duration metric.
pub(crate) const BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0, 600.0];

/// Describes every metric to the installed recorder (see `metrics_http`).
pub(crate) fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!("corral_executions_finished_total", "Executions finished, by outcome and failure stage.");
    describe_counter!("corral_sessions_finished_total", "Sessions finished, by final state.");
    describe_histogram!("corral_stage_duration_seconds", Unit::Seconds, "Time spent in each stage of a run.");
    describe_counter!("corral_gate_decisions_total", "Policy decisions, by policy source and action.");
    describe_counter!("corral_egress_total", "Egress attempts through sandbox proxies, by decision.");
    describe_counter!("corral_admission_refused_total", "Requests refused by admission, by kind.");
    describe_gauge!("corral_running", "Executions and sessions running, by kind.");
    describe_gauge!("corral_sandboxes_alive", "Sandboxes created and not yet destroyed.");
    describe_counter!("corral_events_stored_total", "Lifecycle events stored.");
    describe_histogram!("corral_store_write_seconds", Unit::Seconds, "Time to store a batch of events.");
    describe_gauge!("corral_watchers", "Event streams open to callers and watchers.");
    describe_counter!("corral_hub_deliveries_total", "Hub report delivery attempts, by result.");
    describe_histogram!("corral_run_duration_seconds", Unit::Seconds, "Time from acceptance to the end of a run.");
    describe_counter!(
        "corral_model_tokens_total",
        "Tokens the harnesses' models processed, as the harnesses reported."
    );
    describe_gauge!("corral_build_info", "Always 1; the daemon's version in its labels.");
    describe_gauge!("process_start_time_seconds", Unit::Seconds, "When the daemon's process started, in Unix seconds.");
}

/// Every counter and gauge with its known label sets at 0, the build info
/// at 1: a scrape lists each family (with its HELP) before it is used.
pub(crate) fn initialise() {
    gauge!("corral_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    gauge!("process_start_time_seconds").set(started.as_secs_f64());
    for outcome in ["succeeded", "failed", "refused", "cancelled"] {
        counter!("corral_executions_finished_total", "outcome" => outcome, "stage" => "none").absolute(0);
    }
    for state in ["ended", "failed", "refused", "reaped"] {
        counter!("corral_sessions_finished_total", "state" => state).absolute(0);
    }
    for source in ["session", "profile", "admin", "builtin"] {
        for action in ["allow", "deny", "ask"] {
            counter!("corral_gate_decisions_total", "source" => source, "action" => action).absolute(0);
        }
    }
    for decision in ["allowed", "denied"] {
        counter!("corral_egress_total", "decision" => decision).absolute(0);
    }
    for kind in ["executions", "sessions", "quota"] {
        counter!("corral_admission_refused_total", "kind" => kind).absolute(0);
    }
    for kind in ["executions", "sessions"] {
        gauge!("corral_running", "kind" => kind).increment(0.0);
    }
    gauge!("corral_sandboxes_alive").increment(0.0);
    gauge!("corral_watchers").increment(0.0);
    counter!("corral_events_stored_total").absolute(0);
    for result in ["accepted", "failed"] {
        counter!("corral_hub_deliveries_total", "result" => result).absolute(0);
    }
    counter!("corral_model_tokens_total").absolute(0);
}

/// A finished execution: its outcome, its stage, its stage timings.
pub fn execution_finished(evidence: &Evidence) {
    let outcome = serde_label(&evidence.outcome);
    let stage = evidence.failure_stage.map(|s| s.as_str()).unwrap_or("none");
    counter!("corral_executions_finished_total", "outcome" => outcome, "stage" => stage).increment(1);
    for timing in &evidence.stage_timings {
        let seconds = timing.micros as f64 / 1e6;
        // Stage names are the daemon's own fixed set; `total` is the whole
        // run, not a stage.
        match timing.stage.as_str() {
            "total" => histogram!("corral_run_duration_seconds").record(seconds),
            stage => histogram!("corral_stage_duration_seconds", "stage" => stage.to_string()).record(seconds),
        }
    }
    counter!("corral_model_tokens_total").increment(evidence.tokens_spent);
}

pub fn session_finished(state: &'static str) {
    counter!("corral_sessions_finished_total", "state" => state).increment(1);
}

pub fn gate_decision(source: &str, action: crate::policy::Action) {
    let source = match source {
        "session" | "profile" | "admin" | "builtin" => source.to_string(),
        _ => "other".to_string(),
    };
    counter!("corral_gate_decisions_total", "source" => source, "action" => serde_label(&action)).increment(1);
}

pub fn egress(allowed: bool) {
    counter!("corral_egress_total", "decision" => if allowed { "allowed" } else { "denied" }).increment(1);
}

pub fn admission_refused(kind: &'static str) {
    counter!("corral_admission_refused_total", "kind" => kind).increment(1);
}

pub fn running(kind: &'static str, count: usize) {
    gauge!("corral_running", "kind" => kind).set(count as f64);
}

pub fn sandbox_alive(delta: f64) {
    gauge!("corral_sandboxes_alive").increment(delta);
}

pub fn events_stored(count: usize, seconds: f64) {
    counter!("corral_events_stored_total").increment(count as u64);
    histogram!("corral_store_write_seconds").record(seconds);
}

pub fn watchers(delta: f64) {
    gauge!("corral_watchers").increment(delta);
}

pub fn hub_delivery(accepted: bool) {
    counter!("corral_hub_deliveries_total", "result" => if accepted { "accepted" } else { "failed" }).increment(1);
}

/// The snake_case name serde gives a unit enum variant.
pub(crate) fn serde_label<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_else(|| "unknown".into())
}

/// An OTLP (gRPC) trace pipeline to `endpoint`, batched; shut it down to
/// flush what is pending.
pub fn otlp_tracer_provider(
    endpoint: &str,
    service_name: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint {endpoint}: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_string())
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// What a finished run's span carries: its outcome, profile, model and
/// tokens (OpenTelemetry's GenAI names where they exist), and an error
/// status with the failure class when it did not succeed.
pub fn finished_span(span: &tracing::Span, evidence: &Evidence) {
    span.record("outcome", serde_label(&evidence.outcome));
    span.record("corral.profile", evidence.profile_ref.as_str());
    if !evidence.resolved_model.is_empty() {
        span.record("gen_ai.response.model", evidence.resolved_model.as_str());
    }
    span.record("gen_ai.usage.total_tokens", evidence.tokens_spent);
    if evidence.failure_stage.is_some() {
        span.record("corral.failure_class", evidence.failure_class.as_str());
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.set_status(opentelemetry::trace::Status::error(evidence.failure_class.clone()));
    }
}

/// Makes `span` a child of the caller's trace named by a W3C `traceparent`
/// (nothing when the caller sent none or it does not parse).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(traceparent) = traceparent else { return };
    use opentelemetry::propagation::TextMapPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let carrier: std::collections::HashMap<String, String> =
        [("traceparent".to_string(), traceparent.to_string())].into_iter().collect();
    let context = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(context);
}
