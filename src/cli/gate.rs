//! `corral gate`: a dry run of the `agent_start` gate (EvaluateGate). It
//! prints the verdict, the policies that decided it and the effective
//! sandbox, and runs nothing.
//!
//! Exit code 0 only when the gate allows; 1 when it denies (or answers
//! anything else: a script running `corral gate ... && corral exec ...`
//! goes on only on an allow).

use std::io::Write as _;

use super::json::{JsonEncoder, WireMessage};
use super::output::Printer;
use super::render::{gate_action, quote, sandbox_type};
use super::{GateArgs, Remote};
use crate::pb;
use crate::pb::catalog_service_client::CatalogServiceClient;

impl WireMessage for pb::EvaluateGateResponse {
    const FULL_NAME: &'static str = "corral.v1.EvaluateGateResponse";
}

pub(super) async fn gate(server: &Remote, args: GateArgs, printer: &Printer) -> anyhow::Result<i32> {
    let repo = super::exec::repo_arg(args.repo)?;
    let request = pb::EvaluateGateRequest {
        profile_ref: args.profile,
        actor: args.actor,
        project: args.project,
        repo,
        policies: Vec::new(),
    };
    let mut client = CatalogServiceClient::new(server.open().await?);
    let verdict = client.evaluate_gate(request).await?.into_inner();
    match printer {
        Printer::Json(encoder) => print_json(encoder, &verdict)?,
        Printer::Human(_) => print(&human(&verdict))?,
    }
    Ok(exit_code(&verdict))
}

/// 0 on an allow, 1 on anything else.
fn exit_code(verdict: &pb::EvaluateGateResponse) -> i32 {
    if verdict.action == pb::GateAction::Allow as i32 {
        0
    } else {
        1
    }
}

/// The verdict, then one line per policy that decided (in the order the
/// gate evaluated them), then the effective sandbox.
fn human(verdict: &pb::EvaluateGateResponse) -> String {
    let mut text = format!("gate agent_start action={}\n", gate_action(verdict.action));
    for d in &verdict.decisions {
        let source = pb::PolicySource::try_from(d.source)
            .ok()
            .map(|s| s.as_str_name().trim_start_matches("POLICY_SOURCE_").to_ascii_lowercase())
            .unwrap_or_else(|| format!("unknown({})", d.source));
        text.push_str(&format!("  {} {source} {}", gate_action(d.action), quote(&d.policy)));
        if !d.reason.is_empty() {
            text.push_str(&format!(": {}", quote(&d.reason)));
        }
        text.push('\n');
    }
    if let Some(sandbox) = &verdict.effective_sandbox {
        let network = if sandbox.allow_network { "allowed" } else { "denied" };
        text.push_str(&format!("sandbox={} network={network}", sandbox_type(sandbox.r#type)));
        if verdict.effective_timeout_seconds > 0 {
            text.push_str(&format!(" timeout_seconds={}", verdict.effective_timeout_seconds));
        }
        text.push('\n');
    }
    text
}

fn print_json(encoder: &JsonEncoder, verdict: &pb::EvaluateGateResponse) -> anyhow::Result<()> {
    print(&format!("{}\n", encoder.line(verdict)?))
}

/// A reader that went away (`| head -1`) ends the output, not the command:
/// the exit code is still the verdict's.
fn print(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => written.map_err(Into::into),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deny_names_each_deciding_policy_and_its_source() {
        let verdict = pb::EvaluateGateResponse {
            action: pb::GateAction::Deny as i32,
            decisions: vec![
                pb::PolicyDecision {
                    policy: "force-bwrap".into(),
                    source: pb::PolicySource::Profile as i32,
                    action: pb::GateAction::Allow as i32,
                    reason: String::new(),
                },
                pb::PolicyDecision {
                    policy: "no-network".into(),
                    source: pb::PolicySource::Admin as i32,
                    action: pb::GateAction::Deny as i32,
                    reason: "network requested\n\x1b[2J".into(),
                },
            ],
            effective_sandbox: Some(pb::SandboxSpec {
                r#type: pb::SandboxType::LinuxBwrap as i32,
                allow_network: true,
                ..Default::default()
            }),
            effective_timeout_seconds: 60,
        };
        assert_eq!(
            human(&verdict),
            "gate agent_start action=deny\n  allow profile force-bwrap\n  deny admin no-network: \
             \"network requested\\n\\u{1b}[2J\"\nsandbox=linux_bwrap network=allowed timeout_seconds=60\n"
        );
        assert_eq!(exit_code(&verdict), 1);
        let ask = pb::EvaluateGateResponse { action: pb::GateAction::Ask as i32, ..Default::default() };
        assert_eq!(exit_code(&ask), 1, "only an allow is 0");
        let allow = pb::EvaluateGateResponse { action: pb::GateAction::Allow as i32, ..Default::default() };
        assert_eq!((human(&allow), exit_code(&allow)), ("gate agent_start action=allow\n".to_string(), 0));
    }
}
