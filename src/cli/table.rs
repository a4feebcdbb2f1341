//! Column-aligned tables for `corral ls` and `corral profiles`.

use super::render;
use crate::api::words::shown;
use crate::pb;

/// Left-aligned columns separated by two spaces; the last column is not
/// padded so lines carry no trailing blanks.
pub(super) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    // Cells are flattened first so a newline in a title or a reason
    // cannot break the grid, and widths are measured on what is printed.
    let rows: Vec<Vec<String>> = rows.iter().map(|row| row.iter().map(|cell| flatten(cell)).collect()).collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header_row: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header_row).chain(&rows) {
        let last = row.len().min(widths.len()).saturating_sub(1);
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let pad = width - cell.chars().count();
                out.push_str(cell);
                out.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push('\n');
    }
    out
}

/// One-line, control-free cell text; `-` for empty so columns stay visible.
fn flatten(cell: &str) -> String {
    if cell.is_empty() {
        return "-".to_owned();
    }
    cell.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// `corral ls`: id, state, profile, actor, project, created.
pub(super) fn executions(response: &pb::ListExecutionsResponse) -> String {
    let rows: Vec<Vec<String>> = response
        .executions
        .iter()
        .map(|e| {
            let (actor, project) = match &e.consumer {
                Some(c) => (c.actor.clone(), c.project.clone()),
                None => (String::new(), String::new()),
            };
            let evidence = e.evidence.clone().unwrap_or_default();
            let duration = match (&e.created_at, &e.finished_at) {
                (Some(start), Some(end)) => {
                    let ms = (end.seconds - start.seconds) * 1000 + i64::from(end.nanos - start.nanos) / 1_000_000;
                    format!("{:.1}s", ms.max(0) as f64 / 1000.0)
                }
                _ => String::new(),
            };
            let commit = match (evidence.commit_sha.as_str(), evidence.sandbox_id.is_empty()) {
                ("", false) => "none".to_string(),
                (sha, _) => sha.chars().take(12).collect(),
            };
            vec![
                e.execution_id.clone(),
                render::state(e.state),
                e.profile_ref.clone(),
                e.title.chars().take(32).collect(),
                actor,
                project,
                render::timestamp_seconds(e.created_at.as_ref()),
                duration,
                evidence.tokens_spent.to_string(),
                commit,
            ]
        })
        .collect();
    let header = ["ID", "STATE", "PROFILE", "TITLE", "ACTOR", "PROJECT", "CREATED", "DURATION", "TOKENS", "COMMIT"];
    let mut out = table(&header, &rows);
    if !response.next_page_token.is_empty() {
        out.push_str(&format!("next page: --page-token {}\n", response.next_page_token));
    }
    out
}

/// `corral profiles`: ref, status, readiness (+reason; first `unusable`
/// and why, for a profile a run of would be refused), sandbox type,
/// whether the harness's own tool calls pass the gate, source.
pub(super) fn profiles(response: &pb::ListProfilesResponse) -> String {
    let rows: Vec<Vec<String>> = response
        .profiles
        .iter()
        .map(|p| {
            vec![
                p.r#ref.clone(),
                shown::<pb::ProfileStatus>(p.status),
                match (p.usable, render::readiness(p.readiness.as_ref())) {
                    (true, readiness) => readiness,
                    (false, readiness) if readiness.is_empty() => format!("unusable ({})", p.unusable_reason),
                    (false, readiness) => format!("unusable ({}); {readiness}", p.unusable_reason),
                },
                p.sandbox.as_ref().map(|s| render::sandbox_type(s.r#type)).unwrap_or_default(),
                match &p.rein {
                    Some(r) if r.tool_calls_gated => "gated".into(),
                    Some(_) => "not gated".into(),
                    None => String::new(),
                },
                p.source.clone(),
            ]
        })
        .collect();
    table(&["REF", "STATUS", "READINESS", "SANDBOX", "TOOL CALLS", "SOURCE"], &rows)
}

/// `corral nodes`: name, state (`drained` for a draining node that
/// reported nothing running since it was asked to drain), running/capacity,
/// the lease's time left, version, labels.
pub(super) fn nodes(response: &pb::ListNodesResponse, now_ms: i64) -> String {
    let rows: Vec<Vec<String>> = response
        .nodes
        .iter()
        .map(|n| {
            let state = match pb::NodeState::try_from(n.state) {
                Ok(pb::NodeState::Draining) if n.drained => "drained".to_string(),
                _ => shown::<pb::NodeState>(n.state),
            };
            let lease = match n.lease_until_ms - now_ms {
                left if left >= 0 => format!("{}s", left / 1000),
                over => format!("expired {}s ago", -over / 1000),
            };
            vec![
                n.name.clone(),
                state,
                format!("{}/{}", n.running, n.capacity),
                lease,
                n.version.clone(),
                n.labels.join(","),
            ]
        })
        .collect();
    table(&["NODE", "STATE", "RUNNING", "LEASE", "VERSION", "LABELS"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_show_drained_and_the_lease_left() {
        let node = |name: &str, state: pb::NodeState, running: u64, lease_until_ms: i64| pb::Node {
            name: name.into(),
            state: state as i32,
            running,
            capacity: 4,
            lease_until_ms,
            version: "0.1.0".into(),
            labels: vec!["linux_bwrap".into(), "claude".into()],
            ..Default::default()
        };
        let response = pb::ListNodesResponse {
            nodes: vec![
                node("a", pb::NodeState::Active, 2, 19_000),
                pb::Node { drained: true, ..node("b", pb::NodeState::Draining, 0, 12_000) },
                node("d", pb::NodeState::Draining, 0, 12_000),
                node("c", pb::NodeState::Lost, 1, 4_000),
            ],
        };
        assert_eq!(
            nodes(&response, 10_000),
            "NODE  STATE     RUNNING  LEASE           VERSION  LABELS\n\
             a     active    2/4      9s              0.1.0    linux_bwrap,claude\n\
             b     drained   0/4      2s              0.1.0    linux_bwrap,claude\n\
             d     draining  0/4      2s              0.1.0    linux_bwrap,claude\n\
             c     lost      1/4      expired 6s ago  0.1.0    linux_bwrap,claude\n"
        );
    }

    #[test]
    fn columns_line_up_without_trailing_blanks() {
        let rows = vec![
            vec!["a".to_owned(), "long value".to_owned(), "x".to_owned()],
            vec!["bbbb".to_owned(), "v\nw".to_owned(), String::new()],
        ];
        assert_eq!(
            table(&["ID", "STATE", "END"], &rows),
            "ID    STATE       END\n\
             a     long value  x\n\
             bbbb  v w         -\n"
        );
    }

    #[test]
    fn profiles_show_readiness_reason_and_sandbox() {
        let response = pb::ListProfilesResponse {
            profiles: vec![pb::Profile {
                r#ref: "claude@1.0.0".into(),
                status: pb::ProfileStatus::Enabled as i32,
                readiness: Some(pb::Readiness {
                    state: pb::ReadinessState::Blocked as i32,
                    reason: "no credentials".into(),
                    ..Default::default()
                }),
                sandbox: Some(pb::SandboxSpec { r#type: pb::SandboxType::LinuxBwrap as i32, ..Default::default() }),
                rein: Some(pb::Rein { tool_calls_gated: false, ..Default::default() }),
                source: "builtin".into(),
                usable: true,
                ..Default::default()
            }],
        };
        assert_eq!(
            profiles(&response),
            "REF           STATUS   READINESS                 SANDBOX      TOOL CALLS  SOURCE\n\
             claude@1.0.0  enabled  blocked (no credentials)  linux_bwrap  not gated   builtin\n"
        );
        // A profile a run of would be refused says so instead, with why.
        let mut unusable = response.clone();
        unusable.profiles[0].usable = false;
        unusable.profiles[0].unusable_reason = "unknown credential route anthropic".into();
        let text = profiles(&unusable);
        assert!(text.contains("  unusable (unknown credential route anthropic); blocked (no credentials)  "), "{text}");
    }
}
