//! `enforce_sandbox` merges tighten-only: a policy can turn the network off
//! but never on, narrow write and read paths but never add one, upgrade
//! `none` to `linux_bwrap` but never downgrade. Returns what it did, for
//! the decision's reason.

use std::path::Path;

use super::EnforceSandbox;
use crate::sandbox::{SandboxSpec, SandboxType};

/// Whether `path` lies within one of `allowed` (relative paths are inside
/// the workspace, which "." covers).
fn covered(path: &str, allowed: &[String]) -> bool {
    let relative = !path.starts_with('/');
    allowed.iter().any(|a| {
        a == path
            || (a == "." && relative)
            || (relative && !a.starts_with('/') && Path::new(path).starts_with(a))
            || (!relative && a.starts_with('/') && Path::new(path).starts_with(a))
    })
}

fn narrow(current: &mut Vec<String>, wanted: &[String], what: &str, notes: &mut Vec<String>) {
    let kept: Vec<String> = wanted.iter().filter(|p| covered(p, current)).cloned().collect();
    for dropped in wanted.iter().filter(|p| !kept.contains(p)) {
        notes.push(format!("{what} {dropped} not in the spec: not added"));
    }
    if &kept != current {
        notes.push(format!("{what}s [{}]", kept.join(", ")));
    }
    *current = kept;
}

/// Applies `enforce` to `spec`, tighten-only (see the module doc), and
/// returns what changed, for the decision's reason.
pub fn tighten(spec: &mut SandboxSpec, enforce: &EnforceSandbox) -> String {
    let mut notes = Vec::new();
    match (spec.sandbox_type, enforce.sandbox_type) {
        (SandboxType::None, Some(SandboxType::LinuxBwrap)) => {
            spec.sandbox_type = SandboxType::LinuxBwrap;
            notes.push("sandbox none -> linux_bwrap".to_string());
        }
        (SandboxType::LinuxBwrap, Some(SandboxType::None)) => {
            notes.push("linux_bwrap kept: never downgraded to none".to_string());
        }
        _ => {}
    }
    match enforce.allow_network {
        Some(false) if spec.allow_network => {
            spec.allow_network = false;
            notes.push("network off".to_string());
        }
        Some(true) if !spec.allow_network => notes.push("network stays off: never turned on".to_string()),
        _ => {}
    }
    if !spec.allow_network {
        spec.allow_hosts.clear();
    }
    if let Some(wanted) = &enforce.allow_hosts {
        let kept = crate::net::intersect(&spec.allow_hosts, wanted);
        if kept != spec.allow_hosts {
            notes.push(format!("allow_hosts [{}]", kept.join(", ")));
        }
        spec.allow_hosts = kept;
    }
    if let Some(wanted) = &enforce.write_paths {
        narrow(&mut spec.write_paths, wanted, "write path", &mut notes);
    }
    if let Some(wanted) = &enforce.read_paths {
        narrow(&mut spec.read_paths, wanted, "read path", &mut notes);
    }
    if let Some(wanted) = &enforce.env_passthrough {
        let kept: Vec<String> = spec.env_passthrough.iter().filter(|v| wanted.contains(v)).cloned().collect();
        if kept != spec.env_passthrough {
            notes.push(format!("env_passthrough [{}]", kept.join(", ")));
        }
        spec.env_passthrough = kept;
    }
    if notes.is_empty() {
        "sandbox already as strict".into()
    } else {
        notes.join("; ")
    }
}
