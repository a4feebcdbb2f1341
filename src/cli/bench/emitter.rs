//! The harness that `fanout` and `ingest` run: it waits for the start
//! barrier, then writes P progress lines as fast as it can.

use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use anyhow::Context as _;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::target::{barrier_script, Target, FAKE_AGENT_PROFILE, GO_FILE};

/// Which harness emits the progress events.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Emitter {
    /// tests/fixtures/fake_agent.py (`NOWORK`, `PROGRESS P`) in the
    /// `bench.fake-agent` profile the in-process daemon gets; a daemon
    /// named by --server needs that profile installed.
    FakeAgent,
    /// A `printf` loop run by `builtin.shell`: works against any daemon.
    Shell,
}

impl Emitter {
    /// The profile and the task description that make `events` progress
    /// lines after the barrier, at `pace` per second (fake agent only;
    /// as fast as it can without).
    pub fn task(self, events: u64, pace: Option<u64>) -> (String, String) {
        match self {
            Emitter::FakeAgent => {
                let pace = pace.map(|p| format!("\nPACE {p}")).unwrap_or_default();
                (FAKE_AGENT_PROFILE.to_string(), format!("NOWORK\nPROGRESS {events}{pace}"))
            }
            Emitter::Shell => ("builtin.shell@1.0.0".to_string(), shell_script(events, true)),
        }
    }

    /// Progress lines per second of this emitter alone, outside any
    /// sandbox, writing to a pipe the bench reads: the ceiling of what a
    /// daemon could ingest from it.
    pub async fn alone_per_second(self, target: &Target, events: u64) -> anyhow::Result<f64> {
        let mut cmd = match self {
            Emitter::FakeAgent => {
                let mut cmd = tokio::process::Command::new("/usr/bin/python3");
                cmd.arg(&target.fake_agent);
                cmd
            }
            Emitter::Shell => {
                let mut cmd = tokio::process::Command::new("/bin/sh");
                cmd.arg("-c").arg(shell_script(events, false));
                cmd
            }
        };
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).kill_on_drop(true);
        let started = Instant::now();
        let mut child = cmd.spawn().context("cannot run the emitter alone")?;
        if let Some(mut stdin) = child.stdin.take() {
            let task = serde_json::json!({"type": "task", "title": "alone", "description": format!("NOWORK\nPROGRESS {events}")});
            let _ = stdin.write_all(task.to_string().as_bytes()).await;
        }
        let mut lines = tokio::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut progress = 0u64;
        while let Some(line) = lines.next_line().await? {
            if line.contains("\"progress\"") {
                progress += 1;
            }
        }
        child.wait().await?;
        let seconds = started.elapsed().as_secs_f64();
        Ok(if seconds > 0.0 { progress as f64 / seconds } else { 0.0 })
    }
}

/// A POSIX shell script: barrier (optional), `events` progress lines, one
/// result line.
pub fn shell_script(events: u64, barrier: bool) -> String {
    let mut script = String::new();
    if barrier {
        script.push_str(&barrier_script());
        script.push('\n');
    }
    script.push_str(&format!(
        "i=1; while [ $i -le {events} ]; do printf '{{\"type\":\"progress\",\"message\":\"step %d\",\"tokens\":%d}}\\n' $i $i; i=$((i+1)); done\n"
    ));
    script.push_str("printf '{\"type\":\"result\",\"ok\":true,\"output\":\"done\"}\\n'\n");
    script
}

/// Lets the harness of a sandbox whose workspace is at `workspace` start.
pub fn release(workspace: &str) -> std::io::Result<()> {
    std::fs::write(Path::new(workspace).join(GO_FILE), b"go\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shell_emitter_prints_exactly_n_progress_lines_and_a_result() {
        let out = std::process::Command::new("/bin/sh").arg("-c").arg(shell_script(3, false)).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0], r#"{"type":"progress","message":"step 1","tokens":1}"#);
        assert_eq!(lines[3], r#"{"type":"result","ok":true,"output":"done"}"#);
    }
}
