//! `gate`: the round trip of one allowed tool call through the agents'
//! hook path — an HTTP POST of a Claude Code `PreToolUse` body to the gate
//! endpoint, the tool_call gate over a realistic policy set, the answer —
//! against the same round trip to the same endpoint answering at once
//! without the gate (the baseline, in this process). Loopback TCP on the
//! host, not inside a sandbox's namespace and not through a CLI process.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use super::stats::Percentiles;
use super::BenchArgs;
use crate::gate::{helper, serve, HookRequest, Verdict};
use crate::policy::{compile_all, Action, Gate, GateInput, HostCapabilities, Phase, PolicySpec};
use crate::sandbox::{SandboxLimits, SandboxSpec};

/// What `corral bench gate` measured: a hook call's round trip with and
/// without the tool_call gate.
#[derive(Clone, Debug, Serialize)]
pub struct GateReport {
    /// Round trips timed, both halves together.
    pub n: usize,
    /// Through the endpoint, answered at once.
    pub baseline: Percentiles,
    /// Through the endpoint and the tool_call gate.
    pub gated: Percentiles,
    /// gated p50 / baseline p50.
    pub ratio_p50: f64,
    /// Policies the gate evaluated for each call.
    pub policies: usize,
}

fn policies() -> Vec<PolicySpec> {
    let spec = |name: &str, kind: &str, arguments: serde_json::Value, on: &[&str]| PolicySpec {
        name: name.into(),
        kind: kind.into(),
        arguments,
        on: on.iter().map(|s| s.to_string()).collect(),
    };
    vec![
        spec("calls", "max_tool_calls", json!({"limit": u64::MAX}), &[]),
        spec(
            "no-push",
            "expr",
            json!({"expression": "!(tool == 'Bash' && arguments.command.contains('git push'))", "reason": "no"}),
            &["tool_call"],
        ),
        spec("web", "expr", json!({"expression": "false", "reason": "no web"}), &["tool_call:WebFetch"]),
    ]
}

/// Serves the endpoint; each call answered by `answer`.
async fn endpoint(
    answer: Arc<dyn Fn(&HookRequest) -> Verdict + Send + Sync>,
) -> anyhow::Result<(std::net::SocketAddr, crate::gate::endpoint::Endpoint)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<HookRequest>(16);
    let endpoint = serve(listener, tx);
    tokio::spawn(async move {
        while let Some(request) = rx.recv().await {
            let verdict = answer(&request);
            let _ = request.reply.send(verdict);
        }
    });
    Ok((addr, endpoint))
}

/// `n` sequential POSTs of `body`, in ms each (after `warmup` untimed).
async fn round_trips(addr: std::net::SocketAddr, body: Vec<u8>, n: usize, warmup: usize) -> anyhow::Result<Vec<f64>> {
    tokio::task::spawn_blocking(move || {
        let mut ms = Vec::with_capacity(n);
        for i in 0..n + warmup {
            let started = Instant::now();
            let answer = helper::post(addr, &body)?;
            if answer.trim() != "{}" {
                anyhow::bail!("the call was not allowed: {answer}");
            }
            if i >= warmup {
                ms.push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(ms)
    })
    .await?
}

pub async fn run(args: &BenchArgs) -> anyhow::Result<GateReport> {
    let n = args.n.unwrap_or(500);
    let specs = policies();
    let compiled = compile_all(&specs, "admin", "policies").map_err(anyhow::Error::msg)?;
    let gate = Arc::new(Gate::new(compiled, HostCapabilities::everything()));
    let body = json!({"session_id": "s", "hook_event_name": "PreToolUse", "tool_name": "Bash",
        "tool_input": {"command": "cargo test --locked", "description": "run the tests"}, "tool_use_id": "toolu_1"})
    .to_string()
    .into_bytes();
    let (at_once, _a) = endpoint(Arc::new(|_: &HookRequest| Verdict::allow())).await?;
    let evaluate = {
        let gate = gate.clone();
        move |request: &HookRequest| {
            let (sandbox, limits) = (SandboxSpec::default(), SandboxLimits::default());
            let outcome = gate.evaluate(&GateInput {
                phase: Phase::ToolCall,
                profile_ref: "builtin.claude-code@1.0.0",
                actor: "agt",
                project: "bench",
                repo: "",
                sandbox: &sandbox,
                limits: &limits,
                timeout_seconds: 600,
                tool: &request.call.tool,
                arguments: &request.call.arguments,
                tool_calls: 0,
                session_policies: &[],
                profile_policies: &[],
                ungated_tool_calls: Default::default(),
                host_writes: crate::policy::HostWrites::Anywhere,
            });
            if outcome.action == Action::Allow {
                Verdict::allow()
            } else {
                Verdict::deny("denied")
            }
        }
    };
    let (gated_at, _g) = endpoint(Arc::new(evaluate)).await?;
    let warmup = args.warmup.max(1);
    // Interleaved halves, so drift on the host falls on both sides.
    let (mut base, mut gated) = (Vec::new(), Vec::new());
    let half = (n / 2).max(1);
    for _ in 0..2 {
        base.extend(round_trips(at_once, body.clone(), half, warmup).await?);
        gated.extend(round_trips(gated_at, body.clone(), half, warmup).await?);
    }
    let (baseline, gated) = (Percentiles::of_ms(&base), Percentiles::of_ms(&gated));
    let ratio_p50 = if baseline.p50_ms > 0.0 { gated.p50_ms / baseline.p50_ms } else { 0.0 };
    Ok(GateReport { n: 2 * half, baseline, gated, ratio_p50, policies: specs.len() })
}
