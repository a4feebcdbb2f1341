//! The catalog: every profile the daemon knows, and the resolution rules
//! that turn a reference into exactly one runnable profile.

mod agents;
mod builtin;
mod profile;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use agents::{HarnessConfig, ANTHROPIC_ROUTE, CLAUDE_ALLOWED_TOOLS, CODEX_DEFAULT_MODEL, OPENAI_ROUTE};
pub use profile::{
    check_cpu_millis, check_id, check_label, GitSettings, Limits, Placement, Preset, Profile, ProfileFile, ProfileRef,
    ProfileStatus, Readiness, ReadinessState, ReinSpec, RunFacts, TaskInput, CLAUDE_MANAGED_SETTINGS,
    CODEX_REQUIREMENTS, DEFAULT_SHM_BYTES, DEFAULT_WORKSPACE_INODES, HELPER_PATH,
};

/// A profile file's TOML, with `default_limits` under its `[limits]`.
/// Parsed once as written first, so an error names its line and key.
fn parse_file(text: &str, default_limits: &Limits) -> Result<ProfileFile, String> {
    let _: ProfileFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let limits = Limits::merge_table(default_limits, table.get("limits"))?;
    table.insert("limits".into(), limits);
    // A `[sandbox]` that leaves out `write_paths` keeps the workspace
    // writable, as a profile without `[sandbox]` does (`[]` asks for a
    // read-only one).
    if let Some(toml::Value::Table(sandbox)) = table.get_mut("sandbox") {
        sandbox.entry("write_paths").or_insert_with(|| toml::Value::Array(vec![".".into()]));
    }
    toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| e.to_string())
}

/// The sentence rule 1 prescribes for a bad actor.
pub const ACTOR_REFUSAL: &str = "execution actor must be a governed consumer type: adm, agt, or atm; queue worker identifiers are not execution actors";

/// Why a reference does not resolve; the text is shown to callers as is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// Why the catalog could not be loaded; the daemon does not start with it.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// A profile file or directory could not be read, parsed or validated.
    #[error("{file}: {message}")]
    Invalid {
        /// The file or directory (`builtin` for a built-in profile).
        file: String,
        /// What is wrong, naming the key.
        message: String,
    },
    /// Two profiles have the same id and version.
    #[error("{reference} is defined twice: in {first} and in {second}")]
    Duplicate {
        /// The `id@version` both define.
        reference: String,
        /// Where the first one came from.
        first: String,
        /// Where the second one came from.
        second: String,
    },
}

/// All profiles, keyed by id then version.
#[derive(Debug, Default)]
pub struct Catalog {
    profiles: BTreeMap<String, BTreeMap<semver::Version, Arc<Profile>>>,
    /// The credential routes the daemon's config defines.
    routes: Vec<String>,
    /// What a profile's `[limits]` leaves out.
    default_limits: Limits,
}

impl Catalog {
    /// The built-in profiles plus every `*.toml` in `dirs`. A malformed file
    /// is an error naming the file and the key.
    pub fn load(dirs: &[impl AsRef<Path>], credential_routes: &[&str]) -> Result<Catalog, CatalogError> {
        Self::load_with(dirs, credential_routes, &HarnessConfig::default(), &Limits::default())
    }

    /// [`Catalog::load`], with the built-in agent profiles pointed where the
    /// daemon's `[harness]` section says, and `default_limits` (the daemon's
    /// `[default_limits]`) for every limit a profile does not set.
    pub fn load_with(
        dirs: &[impl AsRef<Path>],
        credential_routes: &[&str],
        harness: &HarnessConfig,
        default_limits: &Limits,
    ) -> Result<Catalog, CatalogError> {
        let mut catalog = Catalog {
            routes: credential_routes.iter().map(|r| r.to_string()).collect(),
            default_limits: default_limits.clone(),
            ..Catalog::default()
        };
        for mut file in builtin::builtin_profiles(harness) {
            file.limits = default_limits.clone();
            let profile = Profile::from_file(file, "builtin".into())
                .map_err(|message| CatalogError::Invalid { file: "builtin".into(), message })?;
            catalog.insert(profile)?;
        }
        for dir in dirs {
            catalog.load_dir(dir.as_ref())?;
        }
        Ok(catalog)
    }

    fn load_dir(&mut self, dir: &Path) -> Result<(), CatalogError> {
        let invalid = |message: String| CatalogError::Invalid { file: dir.display().to_string(), message };
        let entries = std::fs::read_dir(dir).map_err(|e| invalid(format!("cannot read profile directory: {e}")))?;
        let mut paths: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|ext| ext == "toml"))
            .collect();
        paths.sort();
        for path in paths {
            let file = path.display().to_string();
            let text = std::fs::read_to_string(&path)
                .map_err(|e| CatalogError::Invalid { file: file.clone(), message: e.to_string() })?;
            let parsed = parse_file(&text, &self.default_limits)
                .map_err(|message| CatalogError::Invalid { file: file.clone(), message })?;
            let profile =
                Profile::from_file(parsed, file.clone()).map_err(|message| CatalogError::Invalid { file, message })?;
            self.insert(profile)?;
        }
        Ok(())
    }

    fn insert(&mut self, mut profile: Profile) -> Result<(), CatalogError> {
        // An unknown route makes the profile unusable, not the daemon: it is
        // listed with the reason and refused at resolution.
        if let Some(unknown) = profile.file.credential_route_refs.iter().find(|r| !self.routes.contains(r)) {
            profile.unusable = Some(format!(
                "unknown credential route {unknown} (the daemon config has no [credentials.routes.{unknown}])"
            ));
        }
        let versions = self.profiles.entry(profile.id().to_string()).or_default();
        if let Some(existing) = versions.get(&profile.version) {
            return Err(CatalogError::Duplicate {
                reference: profile.reference(),
                first: existing.source.clone(),
                second: profile.source.clone(),
            });
        }
        versions.insert(profile.version.clone(), Arc::new(profile));
        Ok(())
    }

    /// Every profile, every version, ordered by id then version.
    pub fn list(&self) -> Vec<Arc<Profile>> {
        self.profiles.values().flat_map(|v| v.values().cloned()).collect()
    }

    /// Finds a profile by reference without judging whether it may run.
    pub fn lookup(&self, reference: &str) -> Result<Arc<Profile>, Refusal> {
        let unknown = || Refusal(format!("unknown harness profile: {reference}"));
        // The edge refuses a malformed reference first; here it is unknown.
        let parsed = ProfileRef::parse(reference).map_err(|_| unknown())?;
        match parsed.version {
            Some(version) => self.profiles.get(&parsed.id).and_then(|v| v.get(&version)).cloned().ok_or_else(unknown),
            None => {
                let versions = self.profiles.get(reference).ok_or_else(unknown)?;
                if versions.len() > 1 {
                    let list: Vec<String> = versions.keys().map(|v| format!("{reference}@{v}")).collect();
                    return Err(Refusal(format!(
                        "harness profile {reference} has several versions; pin one of {}",
                        list.join(", ")
                    )));
                }
                versions.values().next().cloned().ok_or_else(unknown)
            }
        }
    }

    /// Rule 1: exactly one enabled profile whose readiness is not blocked.
    /// `unverified` resolves; the caller labels it in the evidence.
    pub fn resolve(&self, reference: &str) -> Result<Arc<Profile>, Refusal> {
        let profile = self.lookup(reference)?;
        if profile.file.status == ProfileStatus::Disabled {
            return Err(Refusal(format!("profile disabled: {}", profile.reference())));
        }
        if let Some(reason) = &profile.unusable {
            return Err(Refusal(format!("profile {} is unusable: {reason}", profile.reference())));
        }
        if profile.file.readiness.state == ReadinessState::Blocked {
            return Err(Refusal(format!(
                "profile {} is blocked: \"{}\"",
                profile.reference(),
                profile.file.readiness.reason
            )));
        }
        Ok(profile)
    }
}

/// Rule 1's actor check: only governed consumer types run executions.
pub fn check_actor(actor: &str) -> Result<(), Refusal> {
    match actor {
        "adm" | "agt" | "atm" => Ok(()),
        _ => Err(Refusal(ACTOR_REFUSAL.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog_with(files: &[(&str, &str)]) -> Result<Catalog, CatalogError> {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        Catalog::load(&[dir.path()], &[])
    }

    const A1: &str = "id = \"team.a\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n";
    const A2: &str = "id = \"team.a\"\nversion = \"2.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n";

    /// Limits that would be accepted and then break: an output cap of 0
    /// (every byte dropped, or the output kept in memory without a bound)
    /// and a timeout past ten years are refused, naming the key.
    #[test]
    fn a_zero_output_cap_and_an_endless_timeout_are_refused_naming_the_key() {
        for (limits, key) in [
            ("max_output_bytes = 0", "limits.max_output_bytes: must be greater than 0"),
            ("timeout_seconds = 9223372036854775807", "limits.timeout_seconds: 9223372036854775807 is more than"),
        ] {
            let text = format!("{A1}[limits]\n{limits}\n");
            let err = catalog_with(&[("a.toml", &text)]).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(key), "{limits}: {err}");
        }
        let text = format!("{A1}[limits]\nmax_output_bytes = 1\ntimeout_seconds = 315360000\n");
        assert!(catalog_with(&[("a.toml", &text)]).is_ok());
    }

    /// A `[sandbox]` that leaves out `write_paths` has a writable
    /// workspace, as a profile without `[sandbox]` has; `[]` is read-only.
    #[test]
    fn a_sandbox_table_without_write_paths_keeps_the_workspace_writable() {
        let b =
            "id = \"team.b\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n[sandbox]\nallow_network = false\n";
        let c = "id = \"team.c\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n[sandbox]\nwrite_paths = []\n";
        let catalog = catalog_with(&[("a.toml", A1), ("b.toml", b), ("c.toml", c)]).unwrap();
        let paths = |id: &str| catalog.lookup(id).unwrap().file.sandbox.write_paths.clone();
        assert_eq!(paths("team.a"), ["."]);
        assert_eq!(paths("team.b"), ["."], "a [sandbox] without write_paths");
        assert!(paths("team.c").is_empty(), "write_paths = [] is a read-only workspace");
    }

    #[test]
    fn limits_a_profile_leaves_out_come_from_the_daemon_then_the_builtin_defaults() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.toml"), A1).unwrap();
        let b = "id = \"team.b\"\nversion = \"1.0.0\"\n[rein]\nargv = [\"/bin/true\"]\n[limits]\nmax_processes = 10\nmemory_bytes = 0\n";
        std::fs::write(dir.path().join("b.toml"), b).unwrap();
        let daemon = Limits { max_processes: 77, cpu_millis: 500, ..Limits::default() };
        let catalog = Catalog::load_with(&[dir.path()], &[], &HarnessConfig::default(), &daemon).unwrap();
        let a = &catalog.lookup("team.a").unwrap().file.limits;
        assert_eq!(a, &daemon, "a profile without [limits] runs under the daemon's defaults");
        let b = &catalog.lookup("team.b").unwrap().file.limits;
        assert_eq!((b.max_processes, b.memory_bytes, b.cpu_millis), (10, 0, 500), "its own keys win, 0 included");
        assert_eq!(b.max_workspace_inodes, DEFAULT_WORKSPACE_INODES);
        assert_eq!(&catalog.lookup("builtin.shell").unwrap().file.limits, &daemon, "built-ins too");
        // With no daemon section, the built-in defaults: never unlimited.
        let plain = Catalog::load(&[dir.path()], &[]).unwrap();
        for id in ["team.a", "builtin.shell", "builtin.claude-code", "builtin.codex", "builtin.noop"] {
            let l = &plain.lookup(id).unwrap().file.limits;
            assert_eq!(
                (
                    l.memory_bytes,
                    l.max_processes,
                    l.cpu_millis,
                    l.max_workspace_bytes,
                    l.max_workspace_inodes,
                    l.shm_bytes
                ),
                (2 << 30, 512, 2000, 2 << 30, 200_000, 64 << 20),
                "{id}"
            );
        }
        let bad = A1.to_string() + "[limits]\nmax_procs = 1\n";
        let err = catalog_with(&[("bad.toml", &bad)]).unwrap_err().to_string();
        assert!(err.contains("bad.toml") && err.contains("max_procs"), "{err}");
        let zero_shm = A1.to_string() + "[limits]\nshm_bytes = 0\n";
        let err = catalog_with(&[("z.toml", &zero_shm)]).unwrap_err().to_string();
        assert!(err.contains("limits.shm_bytes"), "an unsized /dev/shm is refused: {err}");
    }

    #[test]
    fn several_versions_must_be_pinned() {
        let catalog = catalog_with(&[("a1.toml", A1), ("a2.toml", A2)]).unwrap();
        let err = catalog.resolve("team.a").unwrap_err();
        assert_eq!(err.0, "harness profile team.a has several versions; pin one of team.a@1.0.0, team.a@2.0.0");
        assert_eq!(catalog.resolve("team.a@2.0.0").unwrap().reference(), "team.a@2.0.0");
    }

    #[test]
    fn unpinned_single_version_resolves() {
        let catalog = catalog_with(&[("a1.toml", A1)]).unwrap();
        assert_eq!(catalog.resolve("team.a").unwrap().reference(), "team.a@1.0.0");
        assert_eq!(catalog.resolve("team.b").unwrap_err().0, "unknown harness profile: team.b");
    }

    #[test]
    fn blocked_reason_is_quoted_and_disabled_refused() {
        let blocked = format!("{A1}[readiness]\nstate = \"blocked\"\nreason = \"OPS-1234 quota\"\n");
        let disabled = A2.replace("version = \"2.0.0\"", "version = \"2.0.0\"\nstatus = \"disabled\"");
        let catalog = catalog_with(&[("a1.toml", &blocked), ("a2.toml", &disabled)]).unwrap();
        assert_eq!(
            catalog.resolve("team.a@1.0.0").unwrap_err().0,
            "profile team.a@1.0.0 is blocked: \"OPS-1234 quota\""
        );
        assert_eq!(catalog.resolve("team.a@2.0.0").unwrap_err().0, "profile disabled: team.a@2.0.0");
    }

    /// Each bound path is a descriptor bwrap is passed: 32 together load,
    /// 33 are refused naming the key.
    #[test]
    fn at_most_32_read_and_write_paths() {
        let paths = |n: usize| (0..n).map(|i| format!("\"/opt/p{i}\"")).collect::<Vec<_>>().join(", ");
        let profile = |reads: usize, writes: usize| {
            format!("{A1}[sandbox]\nread_paths = [{}]\nwrite_paths = [\".\", {}]\n", paths(reads), paths(writes))
        };
        assert!(catalog_with(&[("ok.toml", &profile(20, 11))]).is_ok());
        let err = catalog_with(&[("big.toml", &profile(20, 12))]).unwrap_err().to_string();
        assert!(err.contains("sandbox.read_paths: 33 read and write paths; at most 32 together"), "{err}");
    }

    #[test]
    fn malformed_file_names_file_and_key() {
        let bad = A1.replace("[rein]", "colour = \"red\"\n[rein]");
        let err = catalog_with(&[("bad.toml", &bad)]).unwrap_err().to_string();
        assert!(err.contains("bad.toml"), "{err}");
        assert!(err.contains("colour"), "{err}");
        let err = catalog_with(&[("v.toml", &A1.replace("1.0.0", "one"))]).unwrap_err().to_string();
        assert!(err.contains("v.toml") && err.contains("version"), "{err}");
    }

    #[test]
    fn a_base_url_must_be_reachable_through_the_allowlist() {
        let codex = |hosts: &str, preset: &str| {
            format!(
                "id = \"team.codex\"\nversion = \"1.0.0\"\n[rein]\npreset = \"{preset}\"\nargv = [\"codex\", \"exec\", \"-\"]\n\
                 base_url = \"https://10.0.0.5:8080/v1\"\n[sandbox]\ntype = \"linux_bwrap\"\nallow_network = true\nallow_hosts = [{hosts}]\n"
            )
        };
        let ok = catalog_with(&[("c.toml", &codex("\"10.0.0.5:8080\"", "codex_exec_json"))]).unwrap();
        assert_eq!(ok.resolve("team.codex").unwrap().file.rein.base_url, "https://10.0.0.5:8080/v1");
        // Plain http beyond loopback: a keyless model server is fine, but a
        // model key would cross the network in clear.
        let clear = codex("\"10.0.0.5:8080\"", "codex_exec_json").replace("https://", "http://");
        catalog_with(&[("c.toml", &clear)]).unwrap();
        let keyed = clear.replacen("[rein]", "credential_route_refs = [\"openai\"]\n[rein]", 1);
        let err = catalog_with(&[("c.toml", &keyed)]).unwrap_err().to_string();
        assert!(err.contains("rein.base_url") && err.contains("must be on loopback"), "{err}");
        let err = catalog_with(&[("c.toml", &codex("\"api.openai.com\"", "codex_exec_json"))]).unwrap_err().to_string();
        assert!(err.contains("rein.base_url") && err.contains("10.0.0.5:8080"), "{err}");
        let err = catalog_with(&[("c.toml", &codex("\"10.0.0.5:8080\"", "protocol"))]).unwrap_err().to_string();
        assert!(err.contains("only for the claude_stream_json and codex_exec_json presets"), "{err}");
    }

    #[test]
    fn the_builtin_agents_follow_the_harness_section_and_name_their_routes() {
        let harness = HarnessConfig { anthropic_base_url: "http://127.0.0.1:9000".into(), ..HarnessConfig::default() };
        let catalog = Catalog::load_with(&[] as &[&Path], &["openai"], &harness, &Limits::default()).unwrap();
        let claude = catalog.lookup("builtin.claude-code").unwrap();
        assert_eq!(claude.file.sandbox.allow_hosts, ["127.0.0.1:9000"]);
        assert_eq!(claude.file.rein.base_url, "http://127.0.0.1:9000");
        let refusal = catalog.resolve("builtin.claude-code").unwrap_err().0;
        assert!(refusal.contains("unknown credential route anthropic"), "{refusal}");
        assert_eq!(catalog.lookup("builtin.codex").unwrap().unusable, None, "its route exists");
        let vendor = Catalog::load(&[] as &[&Path], &[]).unwrap();
        assert_ne!(
            vendor.lookup("builtin.claude-code").unwrap().digest,
            claude.digest,
            "the endpoint is in the digest"
        );
    }

    #[test]
    fn references_are_id_or_id_at_semver() {
        assert_eq!(ProfileRef::parse("team.a").unwrap(), ProfileRef { id: "team.a".into(), version: None });
        assert_eq!(ProfileRef::parse("team.a@1.2.3").unwrap().version, Some(semver::Version::new(1, 2, 3)));
        for bad in ["", "a@", "@1.0.0", "x@not-semver", "p@1.0.0@2", "a b", "a/b", "é", "a\0", &"a".repeat(129)] {
            assert!(ProfileRef::parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(check_id(&"a".repeat(128)).is_ok());
    }

    #[test]
    fn builtins_exist_and_actor_rule_holds() {
        let catalog = Catalog::load(&[] as &[&Path], &[]).unwrap();
        assert!(catalog.resolve("builtin.shell@1.0.0").is_ok());
        assert!(check_actor("agt").is_ok());
        assert_eq!(check_actor("worker-7").unwrap_err().0, ACTOR_REFUSAL);
    }
}
