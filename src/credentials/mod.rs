//! Credential routes: where a harness's secrets come from, how they reach
//! it (only its process environment inside the sandbox), and the scrubber
//! that keeps their values out of everything the daemon stores, streams,
//! reports or logs.

mod scrub;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

pub use scrub::Scrubber;

/// `[credentials.routes.NAME]`: exactly one of `env` (a daemon environment
/// variable) or `file`, and the variable the harness receives it as.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub env: Option<String>,
    pub file: Option<PathBuf>,
    pub inject_as: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CredentialsConfig {
    pub routes: BTreeMap<String, RouteConfig>,
}

fn env_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

impl CredentialsConfig {
    /// Checks every route; errors name the config key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        for (name, route) in &self.routes {
            let key = format!("credentials.routes.{name}");
            match (&route.env, &route.file) {
                (Some(_), Some(_)) | (None, None) => {
                    return Err((key, "set exactly one of `env` or `file`".into()));
                }
                (Some(env), None) if !env_name_ok(env) => {
                    return Err((format!("{key}.env"), "not a variable name".into()))
                }
                _ => {}
            }
            if !env_name_ok(&route.inject_as) || route.inject_as.starts_with("CORRAL_") {
                return Err((format!("{key}.inject_as"), "must be a variable name not starting with CORRAL_".into()));
            }
        }
        Ok(())
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.routes.keys().map(String::as_str)
    }

    /// Reads the values of `refs` now (so rotated secrets are picked up per
    /// run). Returns `(inject_as, value)` pairs and the scrubber for them.
    /// Errors name the route, never a value.
    pub fn resolve(&self, refs: &[String]) -> Result<(Vec<(String, String)>, Scrubber), String> {
        let mut env = Vec::new();
        let mut scrubber = Scrubber::default();
        for name in refs {
            let route = self.routes.get(name).ok_or_else(|| format!("unknown credential route {name}"))?;
            let value = match (&route.env, &route.file) {
                (Some(var), _) => {
                    std::env::var(var).map_err(|_| format!("credential route {name}: ${var} is not set"))?
                }
                (None, Some(path)) => std::fs::read_to_string(path)
                    .map(|v| v.trim_end_matches(['\n', '\r']).to_string())
                    .map_err(|_| format!("credential route {name}: its file cannot be read"))?,
                (None, None) => return Err(format!("credential route {name} has no source")),
            };
            if value.is_empty() {
                return Err(format!("credential route {name} has an empty value"));
            }
            scrubber.add(name, &value);
            env.push((route.inject_as.clone(), value));
        }
        Ok((env, scrubber))
    }
}
