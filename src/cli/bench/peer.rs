//! `peer`: the same no-op through another sandbox wrapper, when one is on
//! PATH (Anthropic's `srt`, npm `@anthropic-ai/sandbox-runtime`), next to
//! corral's own Execute, for the side-by-side ratio. Nothing is installed.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use super::latency::{first, one};
use super::stats::Percentiles;
use super::target::Target;
use super::BenchArgs;
use crate::sandbox::find_on_path;

/// What `corral bench peer` measured: the same no-op through another
/// sandbox wrapper and through corral.
#[derive(Clone, Debug, Serialize)]
pub struct PeerReport {
    /// The wrapper found, or `None` when the scenario was skipped.
    pub wrapper: Option<String>,
    /// Why the scenario was skipped, if it was.
    pub skipped: Option<String>,
    /// Runs timed on each side.
    pub n: usize,
    /// The wrapper's timings; `None` when skipped.
    pub peer: Option<Percentiles>,
    /// corral's timings; `None` when skipped.
    pub corral: Option<Percentiles>,
    /// peer p50 / corral p50.
    pub ratio_p50: Option<f64>,
    /// Runs of the wrapper that failed.
    pub peer_failures: usize,
    /// corral executions that did not succeed, by status code or final state.
    pub corral_errors: BTreeMap<String, usize>,
}

pub async fn run(target: &Target, args: &BenchArgs) -> anyhow::Result<PeerReport> {
    let n = args.n.unwrap_or(20);
    let Some(srt) = find_on_path("srt") else {
        return Ok(PeerReport {
            wrapper: None,
            skipped: Some("srt not found on PATH; skipped".into()),
            n: 0,
            peer: None,
            corral: None,
            ratio_p50: None,
            peer_failures: 0,
            corral_errors: BTreeMap::new(),
        });
    };
    let channel = target.connect().await?;
    first(&channel, &args.noop_profile).await?;
    let (mut peer_ms, mut corral_ms, mut failures, mut errors) = (Vec::new(), Vec::new(), 0, BTreeMap::new());
    for _ in 0..n {
        let started = Instant::now();
        let status = tokio::process::Command::new(&srt)
            .arg("/usr/bin/true")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await;
        match status {
            Ok(s) if s.success() => peer_ms.push(started.elapsed().as_secs_f64() * 1e3),
            _ => failures += 1,
        }
        if let Some(e) = one(&channel, &args.noop_profile, &mut errors).await {
            corral_ms.push(e.client.as_secs_f64() * 1e3);
        }
    }
    let (peer, corral) = (Percentiles::of_ms(&peer_ms), Percentiles::of_ms(&corral_ms));
    Ok(PeerReport {
        wrapper: Some(format!("{} /usr/bin/true", srt.display())),
        skipped: None,
        n,
        ratio_p50: (corral.p50_ms > 0.0 && peer.count > 0).then(|| peer.p50_ms / corral.p50_ms),
        peer: Some(peer),
        corral: Some(corral),
        peer_failures: failures,
        corral_errors: errors,
    })
}
