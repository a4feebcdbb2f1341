//! Running inside a delegated cgroup subtree (systemd `Delegate=yes`). The
//! unit's own cgroup (`system.slice/corral.service`) holds the daemon, and
//! cgroup v2 lets a cgroup hand controllers (memory, pids, cpu) to its
//! children only while it holds no process itself. So when
//! `[sandbox] cgroup_parent` lies inside the daemon's own cgroup, the
//! daemon first moves itself into the leaf `<own>/daemon`; the sandbox
//! cgroups then live in the sibling subtree the parent names.

use std::path::{Path, PathBuf};

/// The leaf the daemon belongs in, relative to the v2 root: `<own>/daemon`
/// when `parent` is `own` or below it; `None` when the parent lies outside
/// the daemon's cgroup (e.g. the default `corral` at the root) or the
/// daemon sits at the root.
pub fn leaf_for(proc_self_cgroup: &str, parent: &str) -> Option<String> {
    let own = proc_self_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/');
    if own.is_empty() || own.ends_with("/daemon") {
        return None;
    }
    (parent == own || parent.starts_with(&format!("{own}/"))).then(|| format!("{own}/daemon"))
}

/// Moves process `pid` (all its threads) into `<v2_root>/<leaf>`.
pub fn move_into(v2_root: &Path, leaf: &str, pid: u32) -> Result<PathBuf, String> {
    let dir = v2_root.join(leaf);
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, pid.to_string()).map_err(|e| format!("moving into {}: {e}", procs.display()))?;
    Ok(dir)
}

/// The cgroup v2 root under `mount`: the mount itself on a pure v2 host,
/// `<mount>/unified` on a hybrid one.
pub fn v2_root(mount: &Path) -> Option<PathBuf> {
    [mount.to_path_buf(), mount.join("unified")].into_iter().find(|p| p.join("cgroup.controllers").is_file())
}

/// At start, before the cgroups are probed: enters the leaf if the parent
/// is inside the daemon's own cgroup. Failing leaves the daemon where it
/// is; the probe then finds which limits cannot be enforced, and profiles
/// that need them are refused with the reason.
pub fn enter_leaf_if_delegated(mount: &Path, parent: &str) {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let Some(leaf) = leaf_for(&own, parent) else { return };
    let Some(root) = v2_root(mount) else { return };
    match move_into(&root, &leaf, std::process::id()) {
        Ok(dir) => {
            tracing::info!(cgroup = %dir.display(), parent, "the daemon moved into the leaf of its delegated cgroup")
        }
        Err(error) => tracing::warn!(%error, parent, "cannot move into a leaf of the delegated cgroup"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leaf_is_beside_a_parent_inside_the_daemons_cgroup() {
        let systemd = "0::/system.slice/corral.service\n";
        assert_eq!(
            leaf_for(systemd, "system.slice/corral.service/sandboxes").as_deref(),
            Some("system.slice/corral.service/daemon")
        );
        assert_eq!(
            leaf_for(systemd, "system.slice/corral.service").as_deref(),
            Some("system.slice/corral.service/daemon")
        );
        assert_eq!(leaf_for(systemd, "corral"), None, "outside: nothing to move");
        assert_eq!(leaf_for(systemd, "system.slice/corral.serviceX"), None);
        assert_eq!(leaf_for("0::/\n", "corral"), None);
        assert_eq!(leaf_for("0::/system.slice/corral.service/daemon\n", "system.slice/corral.service/sandboxes"), None);
        let hybrid = "12:pids:/system.slice/corral.service\n0::/system.slice/corral.service\n";
        assert!(leaf_for(hybrid, "system.slice/corral.service/sandboxes").is_some());
    }

    /// A real move: a process in a "service" cgroup ends up in its leaf,
    /// leaving the service cgroup empty, as cgroup v2 needs.
    #[test]
    fn a_process_moves_into_its_leaf() {
        let root = v2_root(Path::new("/sys/fs/cgroup")).expect("this test needs a cgroup v2 hierarchy");
        let service = format!("corral-test-delegate-{}/unit.service", std::process::id());
        let mut child = std::process::Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        move_into(&root, &service, pid).expect("into the service cgroup");
        let leaf = leaf_for(&format!("0::/{service}\n"), &format!("{service}/sandboxes")).unwrap();
        move_into(&root, &leaf, pid).expect("into the leaf");
        let now = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert!(now.contains(&format!("0::/{service}/daemon")), "{now}");
        assert_eq!(std::fs::read_to_string(root.join(&service).join("cgroup.procs")).unwrap().trim(), "");
        let _ = child.kill();
        let _ = child.wait();
        for dir in [root.join(&leaf), root.join(&service), root.join(service.split('/').next().unwrap())] {
            let _ = std::fs::remove_dir(dir);
        }
    }
}
