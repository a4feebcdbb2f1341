//! Prometheus metrics (`metrics` + `metrics-exporter-prometheus`), served on
//! `metrics_listen` when it is set; OpenTelemetry traces (OTLP over gRPC,
//! `tracing-opentelemetry`) when `[telemetry] otlp_endpoint` is set: one
//! trace per execution (its span, a child per stage), joined to the
//! caller's trace when the call carries a W3C `traceparent`. Labels are fixed sets (outcome, stage,
//! source, action, kind): never a secret, a task text, an id or anything
//! else a caller controls the size of.

use metrics::{counter, gauge, histogram};

use crate::types::evidence::Evidence;

/// Histogram buckets (seconds) of every duration metric.
pub(crate) const BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0, 600.0];

/// The stages a run's evidence times (`Evidence::time`), each a label of
/// `corral_stage_duration_seconds`.
const STAGES: &[&str] =
    &["resolve", "gate", "workspace", "sandbox_create", "session_start", "harness", "capture", "teardown"];

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
    describe_gauge!("corral_sandboxes_alive", "Sandboxes created and not yet stopped.");
    describe_gauge!("corral_warm_sandboxes", "Warm sandboxes waiting for a run, by profile.");
    describe_counter!(
        "corral_warm_requests_total",
        "Runs of a warm pool's profile, by pool and what they found: a warm sandbox (warm), none waiting (empty), \
         only sandboxes whose waiter had exited (dead), or a pool made for another profile version, sandbox or \
         timeout (mismatch)."
    );
    describe_counter!(
        "corral_warm_sandboxes_died_total",
        "Warm sandboxes whose waiter exited (killed, out of memory) while they waited, by pool: each was destroyed \
         and replaced."
    );
    describe_counter!(
        "corral_sandbox_reclaim_failures_total",
        "Stopped sandboxes whose uid, cgroup or files could not be given back (left to recovery)."
    );
    describe_counter!("corral_events_stored_total", "Lifecycle events stored.");
    describe_histogram!("corral_store_write_seconds", Unit::Seconds, "Time to store a batch of events.");
    describe_gauge!("corral_watchers", "Event streams open to callers and watchers.");
    describe_counter!(
        "corral_hub_deliveries_total",
        "Hub reports accepted, or given up on past max_age_seconds (an attempt retried later is not counted), by result."
    );
    describe_histogram!("corral_run_duration_seconds", Unit::Seconds, "Time from acceptance to the end of a run.");
    describe_counter!(
        "corral_model_tokens_total",
        "Tokens the harnesses' models processed, as the harnesses reported."
    );
    describe_gauge!("corral_build_info", "Always 1; the daemon's version in its labels.");
    describe_gauge!("process_start_time_seconds", Unit::Seconds, "When the daemon's process started, in Unix seconds.");
    describe_counter!("process_cpu_seconds_total", Unit::Seconds, "User and system CPU time the daemon spent.");
    describe_gauge!("process_resident_memory_bytes", Unit::Bytes, "The daemon's resident memory.");
    describe_gauge!("process_virtual_memory_bytes", Unit::Bytes, "The daemon's virtual memory.");
    describe_gauge!("process_open_fds", "File descriptors the daemon has open.");
    describe_gauge!("process_max_fds", "The daemon's limit on open file descriptors.");
    describe_gauge!("process_threads", "Threads in the daemon's process.");
}

/// What the Prometheus process collector reports, read from
/// `/proc/self/stat` (proc(5)) at each scrape.
#[derive(Debug, PartialEq)]
pub(crate) struct ProcessStat {
    pub cpu_ticks: u64,
    pub threads: u64,
    pub start_ticks_after_boot: u64,
    pub virtual_bytes: u64,
    pub resident_pages: u64,
}

/// Parses one `/proc/<pid>/stat` line: the fields after the command name
/// (which is in parentheses and may itself hold spaces or parentheses).
pub(crate) fn parse_stat(line: &str) -> Option<ProcessStat> {
    let after_name = &line[line.rfind(')')? + 1..];
    let field: Vec<&str> = after_name.split_whitespace().collect();
    // proc(5) numbers fields from 1: `state` is field 3, our index 0.
    let at = |n: usize| field.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some(ProcessStat {
        cpu_ticks: at(14)? + at(15)?,
        threads: at(20)?,
        start_ticks_after_boot: at(22)?,
        virtual_bytes: at(23)?,
        resident_pages: at(24)?,
    })
}

/// Samples the process collector's series (before each scrape renders).
pub(crate) fn sample_process() {
    // SAFETY: sysconf and getrlimit only read.
    let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
    let (ticks, page) = (ticks.max(1) as f64, page.max(1) as f64);
    if let Some(stat) = std::fs::read_to_string("/proc/self/stat").ok().as_deref().and_then(parse_stat) {
        counter!("process_cpu_seconds_total").absolute((stat.cpu_ticks as f64 / ticks) as u64);
        gauge!("process_threads").set(stat.threads as f64);
        gauge!("process_virtual_memory_bytes").set(stat.virtual_bytes as f64);
        gauge!("process_resident_memory_bytes").set(stat.resident_pages as f64 * page);
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse::<f64>().ok()));
        if let Some(boot) = boot {
            gauge!("process_start_time_seconds").set(boot + stat.start_ticks_after_boot as f64 / ticks);
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        gauge!("process_open_fds").set(fds.count() as f64);
    }
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        gauge!("process_max_fds").set(limit.rlim_cur as f64);
    }
}

/// Every counter and gauge with its known label sets at 0, the build info
/// at 1: a scrape lists each family (with its HELP) before it is used.
pub(crate) fn initialise() {
    gauge!("corral_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    sample_process();
    use crate::types::evidence::FailureStage;
    let stages = [
        FailureStage::Resolution,
        FailureStage::Gate,
        FailureStage::SandboxCreate,
        FailureStage::SessionStart,
        FailureStage::Execution,
        FailureStage::Teardown,
    ];
    for outcome in ["succeeded", "failed", "refused", "cancelled"] {
        for stage in std::iter::once("none").chain(stages.map(FailureStage::as_str)) {
            counter!("corral_executions_finished_total", "outcome" => outcome, "stage" => stage).absolute(0);
        }
    }
    // Histograms too, with no observation yet: each stage's, the whole
    // run's and the store's writes.
    for stage in STAGES {
        let _ = histogram!("corral_stage_duration_seconds", "stage" => *stage);
    }
    let _ = histogram!("corral_run_duration_seconds");
    let _ = histogram!("corral_store_write_seconds");
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
    for kind in ["executions", "sessions", "quota", "fleet", "queue"] {
        counter!("corral_admission_refused_total", "kind" => kind).absolute(0);
    }
    for kind in ["executions", "sessions"] {
        gauge!("corral_running", "kind" => kind).increment(0.0);
    }
    gauge!("corral_sandboxes_alive").increment(0.0);
    counter!("corral_sandbox_reclaim_failures_total").absolute(0);
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
    let total = saturating_add(&MODEL_TOKENS, evidence.tokens_spent);
    counter!("corral_model_tokens_total").absolute(total);
}

/// The tokens counted in `corral_model_tokens_total` so far. Each run may
/// claim up to `rein::MAX_TOKENS` (2^53): 2,048 such runs would wrap an
/// incremented counter to a small number; the total saturates instead,
/// and the counter is set to it (a counter's `absolute` never lowers it).
static MODEL_TOKENS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Adds `n` to `total`, stopping at `u64::MAX`; returns the new total.
fn saturating_add(total: &std::sync::atomic::AtomicU64, n: u64) -> u64 {
    use std::sync::atomic::Ordering;
    match total.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| Some(t.saturating_add(n))) {
        Ok(before) | Err(before) => before.saturating_add(n),
    }
}

/// Counts a finished session under its final state
/// (`corral_sessions_finished_total`).
pub fn session_finished(state: &'static str) {
    counter!("corral_sessions_finished_total", "state" => state).increment(1);
}

/// Counts one policy verdict of the gate by its source and action
/// (`corral_gate_decisions_total`); a source outside the known four counts as
/// `other`.
pub fn gate_decision(source: &str, action: crate::policy::Action) {
    let source = match source {
        "session" | "profile" | "admin" | "builtin" => source.to_string(),
        _ => "other".to_string(),
    };
    counter!("corral_gate_decisions_total", "source" => source, "action" => serde_label(&action)).increment(1);
}

/// Counts one egress attempt as allowed or denied (`corral_egress_total`).
pub fn egress(allowed: bool) {
    counter!("corral_egress_total", "decision" => if allowed { "allowed" } else { "denied" }).increment(1);
}

/// Counts work admission refused: `executions`, `sessions`, `quota`,
/// `fleet` or `queue` (`corral_admission_refused_total`).
pub fn admission_refused(kind: &'static str) {
    counter!("corral_admission_refused_total", "kind" => kind).increment(1);
}

/// Sets how many executions or sessions (`kind`) run now (`corral_running`).
pub fn running(kind: &'static str, count: usize) {
    gauge!("corral_running", "kind" => kind).set(count as f64);
}

/// Moves the count of live sandboxes by `delta` (+1 created, -1 stopped)
/// (`corral_sandboxes_alive`).
pub fn sandbox_alive(delta: f64) {
    gauge!("corral_sandboxes_alive").increment(delta);
}

/// Lists a warm pool's `corral_warm_requests_total` and
/// `corral_warm_sandboxes_died_total` at 0.
pub fn warm_pool_listed(pool: &str) {
    for found in ["warm", "empty", "dead", "mismatch"] {
        counter!("corral_warm_requests_total", "profile" => pool.to_string(), "found" => found).absolute(0);
    }
    counter!("corral_warm_sandboxes_died_total", "profile" => pool.to_string()).absolute(0);
}

/// Counts a run of the warm pool `pool`'s profile by what it found there:
/// `warm`, `empty`, `dead` or `mismatch` (`corral_warm_requests_total`).
pub fn warm_request(pool: &str, found: &'static str) {
    counter!("corral_warm_requests_total", "profile" => pool.to_string(), "found" => found).increment(1);
}

/// Counts a warm sandbox of the pool `pool` whose waiter exited while it
/// waited (`corral_warm_sandboxes_died_total`).
pub fn warm_sandbox_died(pool: &str) {
    counter!("corral_warm_sandboxes_died_total", "profile" => pool.to_string()).increment(1);
}

/// Sets how many warm sandboxes of `profile_ref` wait for a run
/// (`corral_warm_sandboxes`).
pub fn warm_sandboxes(profile_ref: &str, waiting: usize) {
    gauge!("corral_warm_sandboxes", "profile" => profile_ref.to_string()).set(waiting as f64);
}

/// Counts a stopped sandbox whose uid, cgroup or files could not all be
/// given back (`corral_sandbox_reclaim_failures_total`); recovery tries
/// again at the next start.
pub fn sandbox_reclaim_failed() {
    counter!("corral_sandbox_reclaim_failures_total").increment(1);
}

/// Counts `count` events stored in one write and records how long the write
/// took, in seconds (`corral_events_stored_total`,
/// `corral_store_write_seconds`).
pub fn events_stored(count: usize, seconds: f64) {
    counter!("corral_events_stored_total").increment(count as u64);
    histogram!("corral_store_write_seconds").record(seconds);
}

/// Moves the count of open watch streams by `delta` (`corral_watchers`).
pub fn watchers(delta: f64) {
    gauge!("corral_watchers").increment(delta);
}

/// Counts a hub report settled as accepted or given up
/// (`corral_hub_deliveries_total`).
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

/// The no-export trace pipeline when no collector is configured: every
/// span still gets a trace id (the caller's, from `traceparent`), so log
/// lines of one run can be joined to each other and to the caller's trace.
pub fn local_tracer_provider() -> opentelemetry_sdk::trace::SdkTracerProvider {
    opentelemetry_sdk::trace::SdkTracerProvider::builder().build()
}

/// The daemon's filter over every span and log line: `RUST_LOG`, or info.
pub fn daemon_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())
}

/// The daemon's spans, given to OpenTelemetry through `provider` (only
/// spans, never log lines, reach a collector).
pub fn traces_layer<S>(
    provider: &opentelemetry_sdk::trace::SdkTracerProvider,
) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider as _;
    tracing_opentelemetry::layer().with_tracer(provider.tracer("corral"))
}

/// The subscriber `corral bench` runs its in-process daemon under: the one
/// `corral serve` installs without a collector (`filter`: [`daemon_filter`],
/// [`traces_layer`]), printing only warnings and errors, on stderr, so the
/// report stays readable. Without any subscriber every span of every crate
/// (h2 makes one per frame it buffers) falls back to the `log` crate, which
/// sqlx turns on: the bench would measure a cost the daemon never pays.
/// The level is cut where lines are written, not by a filter of the log
/// layer's own: a per-layer filter makes every callsite the global filter
/// turns off (h2's `trace!`s, on every frame) ask the subscriber again at
/// each call, which `corral serve` never does (1.5% of the bench process's
/// samples at W = 10,000).
pub fn bench_subscriber(filter: tracing_subscriber::EnvFilter) -> impl tracing::Subscriber + Send + Sync + 'static {
    use tracing_subscriber::fmt::writer::MakeWriterExt;
    use tracing_subscriber::layer::SubscriberExt;
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr.with_max_level(tracing::Level::WARN));
    let traces = traces_layer(&local_tracer_provider());
    tracing_subscriber::registry().with(filter).with(logs).with(traces)
}

/// Installs [`bench_subscriber`] over [`daemon_filter`]; does nothing if
/// the process already has a subscriber.
pub fn install_bench_subscriber() {
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = bench_subscriber(daemon_filter()).try_init();
}

/// tracing-subscriber's flat JSON line with the current span's
/// `trace_id` and `span_id` (W3C hex) first, as OpenTelemetry's log data
/// model names them, and the current span under `span`: its name and
/// fields, and the run's id (`execution_id`, `session_id`) from the span
/// around it when it has none itself (a stage's span inside an
/// execution's). A line outside any span is left as it is. The inner
/// format prints no span of its own (`with_current_span(false)`).
pub struct WithTraceIds<F>(pub F);

/// The fields a span inherits from the spans around it on a log line.
const RUN_IDS: &[&str] = &["execution_id", "session_id"];

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for WithTraceIds<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt;
        let mut line = String::new();
        self.0.format_event(ctx, tracing_subscriber::fmt::format::Writer::new(&mut line), event)?;
        let ids = ctx.lookup_current().and_then(|span| {
            tracing::dispatcher::get_default(|dispatch| tracing_opentelemetry::get_otel_context(&span.id(), dispatch))
                .map(|cx| cx.span().span_context().clone())
                .filter(|ids| ids.is_valid())
        });
        let body = line.trim_end().strip_prefix('{').and_then(|l| l.strip_suffix('}'));
        let (Some(body), Some(span)) = (body, span_object(ctx)) else { return writer.write_str(&line) };
        let ids = ids.map(|ids| format!("\"trace_id\":\"{}\",\"span_id\":\"{}\",", ids.trace_id(), ids.span_id()));
        let comma = if body.is_empty() { "" } else { "," };
        writeln!(writer, "{{{}{body}{comma}\"span\":{span}}}", ids.unwrap_or_default())
    }
}

/// The event's span as a JSON object: its name, its fields, and the
/// [`RUN_IDS`] of the spans around it that it does not carry itself.
fn span_object<S, N>(ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>) -> Option<serde_json::Value>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    let mut object = serde_json::Map::new();
    for (depth, span) in ctx.event_scope()?.enumerate() {
        let extensions = span.extensions();
        // The JSON layer keeps each span's fields as one JSON object.
        let fields = extensions
            .get::<tracing_subscriber::fmt::FormattedFields<N>>()
            .and_then(|fields| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(fields).ok())
            .unwrap_or_default();
        if depth == 0 {
            object.extend(fields);
            object.insert("name".into(), span.name().into());
            continue;
        }
        for key in RUN_IDS {
            if let (false, Some(id)) = (object.contains_key(*key), fields.get(*key)) {
                object.insert(key.to_string(), id.clone());
            }
        }
    }
    Some(serde_json::Value::Object(object))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_total_saturates_instead_of_wrapping() {
        let total = std::sync::atomic::AtomicU64::new(0);
        let most = crate::rein::MAX_TOKENS;
        let mut last = 0;
        for _ in 0..2_100 {
            let now = saturating_add(&total, most);
            assert!(now >= last, "the total went down: {last} -> {now}");
            last = now;
        }
        assert_eq!(last, u64::MAX);
        assert_eq!(saturating_add(&total, 7), u64::MAX);
        let small = std::sync::atomic::AtomicU64::new(5);
        assert_eq!(saturating_add(&small, 7), 12);
    }

    /// Two callsites as the macros make them: h2's per-frame `trace!` and
    /// the daemon's per-call `info` span.
    mod sites {
        use tracing::callsite::{Callsite, Identifier};
        use tracing::field::FieldSet;
        use tracing::metadata::Kind;
        use tracing::subscriber::Interest;
        use tracing::{Level, Metadata};

        pub struct Site(&'static Metadata<'static>);
        impl Callsite for Site {
            fn set_interest(&self, _: Interest) {}
            fn metadata(&self) -> &Metadata<'_> {
                self.0
            }
        }
        /// What the macros make for a callsite with no fields.
        const fn site(
            name: &'static str,
            target: &'static str,
            level: Level,
            kind: Kind,
            at: &'static Site,
        ) -> Metadata<'static> {
            Metadata::new(name, target, level, None, None, None, FieldSet::new(&[], Identifier(at)), kind)
        }
        static FRAME_SITE: Site = Site(&FRAME);
        pub static FRAME: Metadata<'static> =
            site("frame", "h2::codec::framed_write", Level::TRACE, Kind::EVENT, &FRAME_SITE);
        static RPC_SITE: Site = Site(&RPC);
        pub static RPC: Metadata<'static> = site("rpc", "corral::api", Level::INFO, Kind::SPAN, &RPC_SITE);
    }

    /// The bench's daemon never asks the subscriber about a callsite the
    /// daemon's filter turns off, as `corral serve`'s does not; its spans
    /// still reach the trace layer.
    #[test]
    fn the_bench_subscriber_leaves_off_what_the_daemons_filter_turns_off() {
        use tracing::Subscriber as _;
        // The daemon's filter when RUST_LOG is not set.
        let subscriber = bench_subscriber("info".into());
        assert!(subscriber.register_callsite(&sites::FRAME).is_never());
        assert!(!subscriber.register_callsite(&sites::RPC).is_never());
    }

    #[test]
    fn a_stat_line_parses_past_a_command_name_with_spaces_and_parentheses() {
        // A real line's shape (proc(5)), the name `corral (x) y`.
        let line = "4242 (corral (x) y) S 1 4242 4242 0 -1 4194560 2280 0 0 0 \
                    150 37 0 0 20 0 9 0 81234 1073741824 5120 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 17663 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(ProcessStat {
                cpu_ticks: 187,
                threads: 9,
                start_ticks_after_boot: 81234,
                virtual_bytes: 1073741824,
                resident_pages: 5120,
            })
        );
        assert_eq!(parse_stat("4242 (corral) S 1 2"), None, "a short line is no sample");
        assert_eq!(parse_stat("no parenthesis"), None);
    }
}
