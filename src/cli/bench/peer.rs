//! `peer`: the same no-op through another sandbox wrapper, when one is on
//! PATH (Anthropic's `srt`, npm `@anthropic-ai/sandbox-runtime`), next to
//! corral's own Execute, for the side-by-side ratio. Nothing is installed.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;
use tokio::io::AsyncReadExt as _;

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
    /// Why the first of them failed: its exit status and the first
    /// [`STDERR_KEPT`] bytes of what it wrote to stderr (or why it could
    /// not be started). Without it a peer that never ran says nothing.
    pub peer_first_failure: Option<String>,
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
            peer_first_failure: None,
            corral_errors: BTreeMap::new(),
        });
    };
    let channel = target.connect().await?;
    first(&channel, &args.noop_profile).await?;
    let (mut peer_ms, mut corral_ms, mut failures, mut errors) = (Vec::new(), Vec::new(), 0, BTreeMap::new());
    let mut first_failure = None;
    for _ in 0..n {
        let started = Instant::now();
        match run_peer(&srt).await {
            Ok(()) => peer_ms.push(started.elapsed().as_secs_f64() * 1e3),
            Err(why) => {
                failures += 1;
                first_failure.get_or_insert(why);
            }
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
        peer_first_failure: first_failure,
        corral_errors: errors,
    })
}

/// What of a failed run's stderr is kept.
const STDERR_KEPT: u64 = 2048;

/// One `srt /usr/bin/true`; on failure, why: its status and the start of
/// its stderr (the rest is read and dropped, so the wrapper never blocks
/// on a full pipe).
async fn run_peer(srt: &std::path::Path) -> Result<(), String> {
    let mut child = tokio::process::Command::new(srt)
        .arg("/usr/bin/true")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", srt.display()))?;
    let mut kept = Vec::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = (&mut stderr).take(STDERR_KEPT).read_to_end(&mut kept).await;
        let _ = tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await;
    }
    let status = child.wait().await.map_err(|e| format!("cannot wait for {}: {e}", srt.display()))?;
    if status.success() {
        return Ok(());
    }
    Err(format!("{status}: {}", String::from_utf8_lossy(&kept).trim()))
}
