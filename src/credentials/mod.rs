//! Credential routes: where a harness's secrets come from, how they reach
//! it (only its process environment inside the sandbox), and the scrubber
//! that keeps their values out of everything the daemon stores, streams,
//! reports or logs.

pub mod gateway;
mod scrub;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use crate::catalog::{Preset, ReinSpec};
pub use gateway::{GatewayRoute, Presented, Upstream, GATEWAY_PORT};
pub use scrub::Scrubber;

/// `[credentials.routes.NAME]`: exactly one of `env` (a daemon environment
/// variable) or `file`, and the variable the harness receives it as.
///
/// With `upstream` the route goes through the credential gateway: the
/// harness gets a placeholder in `inject_as` and the daemon presents the
/// real value to the upstream in `header` (see [`gateway`]). The routes
/// Claude Code and Codex read their model key from use the gateway without
/// one (their upstream is the profile's model endpoint) unless `expose`
/// hands the real value to the harness. Any other route must say one or
/// the other: a profile naming a route with neither does not resolve
/// ([`CredentialsConfig::check_exposure`]).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The daemon environment variable holding the value.
    pub env: Option<String>,
    /// The file holding the value (trailing newlines are dropped).
    pub file: Option<PathBuf>,
    /// The variable the harness receives the value (or its placeholder) as;
    /// never `CORRAL_*`.
    pub inject_as: String,
    /// `https://host[:port][/path]` (or `http://` on loopback).
    #[serde(default)]
    pub upstream: Option<String>,
    /// `authorization` (as `Bearer <secret>`, the default) or a header
    /// that carries the secret as its whole value, e.g. `x-api-key`.
    #[serde(default)]
    pub header: Option<String>,
    /// The CA certificates (PEM) the upstream's certificate must chain to,
    /// instead of the system's; refused on an `http://` upstream.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Put the real value in the harness's environment (no gateway): for a
    /// tool that needs the raw key inside the sandbox. A route without an
    /// `upstream` must say so, unless it is a built-in's model key.
    #[serde(default)]
    pub expose: bool,
}

impl RouteConfig {
    /// The value now (a rotated file or variable is read anew).
    pub fn read(&self, name: &str) -> Result<String, String> {
        let value = match (&self.env, &self.file) {
            (Some(var), _) => std::env::var(var).map_err(|_| format!("credential route {name}: ${var} is not set"))?,
            (None, Some(path)) => std::fs::read_to_string(path)
                .map(|v| v.trim_end_matches(['\n', '\r']).to_string())
                .map_err(|_| format!("credential route {name}: its file cannot be read"))?,
            (None, None) => return Err(format!("credential route {name} has no source")),
        };
        if value.is_empty() {
            return Err(format!("credential route {name} has an empty value"));
        }
        Ok(value)
    }

    fn presented(&self) -> Presented {
        match self.header.as_deref().map(str::to_ascii_lowercase) {
            None => Presented::Bearer,
            Some(h) if h == "authorization" => Presented::Bearer,
            Some(h) => Presented::Header(h),
        }
    }
}

/// Variables Claude Code reads its key from, and how each is presented.
const CLAUDE_KEYS: &[(&str, &str)] = &[("ANTHROPIC_API_KEY", "x-api-key"), ("ANTHROPIC_AUTH_TOKEN", "authorization")];
const ANTHROPIC_UPSTREAM: &str = "https://api.anthropic.com";
const OPENAI_UPSTREAM: &str = "https://api.openai.com/v1";

/// A run's credentials: what the harness's environment gets (real values
/// of exposed routes, placeholders of gatewayed ones), the gateway's
/// routes, and the scrubber of every real value.
pub struct Plan {
    /// What the harness's environment gets: real values of exposed routes and
    /// placeholders of gatewayed ones.
    pub env: Vec<(String, String)>,
    /// The routes the credential gateway serves for the run.
    pub gateway: Vec<GatewayRoute>,
    /// Replaces every real value in what the daemon stores, streams or logs.
    pub scrubber: Scrubber,
}

impl Plan {
    /// The URL the harness reaches route `name` at through the gateway.
    pub fn gateway_url(name: &str) -> String {
        format!("http://127.0.0.1:{GATEWAY_PORT}/{name}")
    }
}

/// The `[credentials]` section of the daemon config.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CredentialsConfig {
    /// The routes by name; profiles name them in `credential_route_refs`.
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
            if let Some(upstream) = &route.upstream {
                if route.expose {
                    return Err((format!("{key}.expose"), "a route with an upstream never exposes its value".into()));
                }
                let upstream = gateway::upstream(upstream).map_err(|e| (format!("{key}.upstream"), e))?;
                // A plain http upstream is never verified: its CA would be ignored.
                if route.ca_file.is_some() && !upstream.tls {
                    return Err((format!("{key}.ca_file"), "only for an https:// upstream".into()));
                }
            }
            if let Some(header) = &route.header {
                let plain = !header.is_empty() && header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
                if !plain || route.upstream.is_none() {
                    return Err((format!("{key}.header"), "a header name, on a route with an upstream".into()));
                }
            }
            if let Some(ca) = &route.ca_file {
                if route.expose {
                    return Err((format!("{key}.ca_file"), "an exposed route has no upstream to verify".into()));
                }
                crate::net::client::tls_config(Some(ca)).map_err(|e| (format!("{key}.ca_file"), e))?;
            }
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
                return Err((key, "a route name is letters, digits and -_.".into()));
            }
        }
        Ok(())
    }

    /// Refuses a profile's `sandbox.env_passthrough` that names a variable
    /// of a configured route: its `env` (the daemon variable holding the
    /// real value: passed through, the key of even a gatewayed route would
    /// be in the sandbox) or its `inject_as` (the daemon's own value of that
    /// name would sit in the sandbox's environment before the route's value
    /// or placeholder, and the first entry is the one a program reads).
    /// Every route counts, not only the profile's: no key enters a sandbox
    /// this way. The error names the field, the variable and the route.
    pub fn check_env_passthrough(&self, env_passthrough: &[String]) -> Result<(), String> {
        for var in env_passthrough {
            for (name, route) in &self.routes {
                if route.env.as_deref() == Some(var.as_str()) {
                    return Err(format!(
                        "sandbox.env_passthrough: {var} holds the value of credential route {name} \
                         ([credentials.routes.{name}] env); passed through, the key would enter the sandbox"
                    ));
                }
                if route.inject_as == *var {
                    return Err(format!(
                        "sandbox.env_passthrough: {var} is where credential route {name} puts its value or \
                         placeholder (inject_as); the daemon's own {var} would enter the sandbox before it"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The names of every configured route.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.routes.keys().map(String::as_str)
    }

    /// Refuses a route of `refs` whose real value would reach the harness's
    /// environment though the route does not say so: every route names an
    /// `upstream` (the gateway), is the model key of a built-in harness
    /// (the gateway in a `linux_bwrap` sandbox; handed over in a `none`
    /// one, which has no namespace for it), or says `expose = true`.
    /// Before, a route with none of these was handed over in clear.
    pub fn check_exposure(&self, refs: &[String], rein: &ReinSpec) -> Result<(), String> {
        for name in refs {
            let Some(route) = self.routes.get(name) else { continue };
            if route.upstream.is_none() && !route.expose && model_route(name, route, refs, rein).is_none() {
                return Err(unexposed(name));
            }
        }
        Ok(())
    }

    /// The routes of `refs` that go through the gateway for a harness of
    /// `rein`, with their upstreams and how the secret is presented: every
    /// route with an `upstream`, and (unless `expose`) the route Claude
    /// Code or Codex reads its model key from, towards the profile's model
    /// endpoint. Placeholders are made here, once per run.
    pub fn gateway_routes(&self, refs: &[String], rein: &ReinSpec) -> Result<Vec<GatewayRoute>, String> {
        let mut routes = Vec::new();
        for name in refs {
            let Some(route) = self.routes.get(name) else { continue };
            let (upstream, presented) = match (&route.upstream, model_route(name, route, refs, rein)) {
                (Some(upstream), _) => (upstream.clone(), route.presented()),
                (None, Some(_)) if route.expose => continue,
                (None, Some((vendor, header))) => {
                    let url = if rein.base_url.is_empty() { vendor.to_string() } else { rein.base_url.clone() };
                    let presented =
                        if header == "authorization" { Presented::Bearer } else { Presented::Header(header.into()) };
                    (url, presented)
                }
                (None, None) if route.expose => continue,
                (None, None) => return Err(unexposed(name)),
            };
            let upstream = gateway::upstream(&upstream).map_err(|e| format!("credential route {name}: {e}"))?;
            let tls = match upstream.tls {
                true => Some(Arc::new(
                    crate::net::client::TlsSource::new(route.ca_file.as_deref())
                        .map_err(|e| format!("credential route {name}: {e}"))?,
                )),
                false => None,
            };
            let (reader, route_name) = (route.clone(), name.clone());
            routes.push(GatewayRoute {
                name: name.clone(),
                placeholder: gateway::placeholder(name),
                presented,
                upstream,
                secret: Box::new(move || reader.read(&route_name)),
                tls,
            });
        }
        Ok(routes)
    }

    /// [`resolve`](Self::resolve), with the gatewayed routes' values left
    /// in the daemon: their variables get the placeholders instead.
    pub fn plan(
        &self,
        refs: &[String],
        gateway: &Arc<Vec<GatewayRoute>>,
    ) -> Result<(Vec<(String, String)>, Scrubber), String> {
        let (mut env, scrubber) = self.resolve(refs)?;
        for (name, (var, value)) in refs.iter().zip(env.iter_mut()) {
            if let Some(route) = gateway.iter().find(|r| &r.name == name) {
                debug_assert_eq!(self.routes.get(name).map(|r| r.inject_as.as_str()), Some(var.as_str()));
                *value = route.placeholder.clone();
            }
        }
        Ok((env, scrubber))
    }

    /// Whether every route of `refs` exists and has a value now (read and
    /// dropped at once). The error names the route, never a value.
    pub fn check(&self, refs: &[String]) -> Result<(), String> {
        for name in refs {
            let route = self.routes.get(name).ok_or_else(|| format!("unknown credential route {name}"))?;
            route.read(name)?;
        }
        Ok(())
    }

    /// Reads the values of `refs` now (so rotated secrets are picked up per
    /// run). Returns `(inject_as, value)` pairs and the scrubber for them.
    /// Errors name the route, never a value.
    pub fn resolve(&self, refs: &[String]) -> Result<(Vec<(String, String)>, Scrubber), String> {
        let mut env = Vec::new();
        let mut scrubber = Scrubber::default();
        for name in refs {
            let route = self.routes.get(name).ok_or_else(|| format!("unknown credential route {name}"))?;
            let value = route.read(name)?;
            scrubber.add(name, &value);
            env.push((route.inject_as.clone(), value));
        }
        Ok((env, scrubber))
    }
}

/// The vendor upstream and the header of route `name` when it is the one
/// Claude Code or Codex reads its model key from, for a harness of `rein`
/// naming `refs`: Claude Code's by its variable, Codex's as the first.
fn model_route(
    name: &str,
    route: &RouteConfig,
    refs: &[String],
    rein: &ReinSpec,
) -> Option<(&'static str, &'static str)> {
    match rein.preset {
        Preset::ClaudeStreamJson => {
            CLAUDE_KEYS.iter().find(|(var, _)| *var == route.inject_as).map(|(_, header)| (ANTHROPIC_UPSTREAM, *header))
        }
        Preset::CodexExecJson if refs.first().map(String::as_str) == Some(name) => {
            Some((OPENAI_UPSTREAM, "authorization"))
        }
        _ => None,
    }
}

fn unexposed(name: &str) -> String {
    format!(
        "credential route {name} has no upstream, so its real value would enter the sandbox in clear: give \
         [credentials.routes.{name}] an upstream (the credential gateway keeps the key in the daemon), or \
         expose = true to hand the key to the harness"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route reaches the harness in clear only when it says `expose`, or
    /// as a built-in's model key; a gatewayed route never does.
    #[test]
    fn a_route_without_an_upstream_must_say_expose_unless_it_is_a_model_key() {
        let mut config = CredentialsConfig::default();
        let route = |inject_as: &str, upstream: Option<&str>, expose: bool| RouteConfig {
            file: Some("/k".into()),
            inject_as: inject_as.into(),
            upstream: upstream.map(Into::into),
            expose,
            ..Default::default()
        };
        config.routes.insert("raw".into(), route("GITHUB_TOKEN", None, false));
        config.routes.insert("exposed".into(), route("GITHUB_TOKEN", None, true));
        config.routes.insert("gw".into(), route("GW_TOKEN", Some("https://api.example.com"), false));
        config.routes.insert("anthropic".into(), route("ANTHROPIC_API_KEY", None, false));
        config.routes.insert("openai".into(), route("OPENAI_API_KEY", None, false));
        let rein = |preset: Preset| ReinSpec {
            kind: "command".into(),
            preset,
            argv: vec!["/bin/true".into()],
            input: Default::default(),
            base_url: String::new(),
            model: String::new(),
        };
        let check = |refs: &[&str], preset: Preset| {
            let refs: Vec<String> = refs.iter().map(|r| r.to_string()).collect();
            config.check_exposure(&refs, &rein(preset))
        };
        let refused = Err(unexposed("raw"));
        assert_eq!(check(&["exposed", "gw"], Preset::Protocol), Ok(()));
        assert_eq!(check(&["gw", "raw"], Preset::Protocol), refused);
        assert_eq!(check(&["raw"], Preset::ClaudeStreamJson), refused, "not Claude Code's key variable");
        assert_eq!(check(&["anthropic", "exposed"], Preset::ClaudeStreamJson), Ok(()));
        assert_eq!(check(&["anthropic"], Preset::Protocol), Err(unexposed("anthropic")), "a key of no built-in here");
        assert_eq!(check(&["raw", "gw"], Preset::CodexExecJson), Ok(()), "Codex's key is its first route");
        assert_eq!(check(&["openai", "raw"], Preset::CodexExecJson), refused);
        // The gateway's own list refuses it too, so no path hands it over.
        let refs = vec!["gw".to_string(), "raw".to_string()];
        assert_eq!(config.gateway_routes(&refs, &rein(Preset::Protocol)).err(), refused.err());
        let refs = vec!["exposed".to_string(), "gw".to_string()];
        let names: Vec<String> =
            config.gateway_routes(&refs, &rein(Preset::Protocol)).unwrap().into_iter().map(|r| r.name).collect();
        assert_eq!(names, ["gw"]);
        assert_eq!(
            unexposed("raw"),
            "credential route raw has no upstream, so its real value would enter the sandbox in clear: give \
             [credentials.routes.raw] an upstream (the credential gateway keeps the key in the daemon), or \
             expose = true to hand the key to the harness"
        );
    }

    /// As the hub's: a plain http upstream is never verified, so its CA
    /// would be accepted and ignored.
    #[test]
    fn a_ca_file_is_only_for_an_https_upstream() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, rcgen::generate_simple_self_signed(vec!["ca".into()]).unwrap().cert.pem()).unwrap();
        let config = |upstream: &str| {
            let route = RouteConfig {
                file: Some("/k".into()),
                inject_as: "TOKEN".into(),
                upstream: Some(upstream.into()),
                ca_file: Some(ca.clone()),
                ..Default::default()
            };
            CredentialsConfig { routes: BTreeMap::from([("r".to_string(), route)]) }
        };
        assert_eq!(
            config("http://127.0.0.1:8080").validate(),
            Err(("credentials.routes.r.ca_file".into(), "only for an https:// upstream".into()))
        );
        assert_eq!(config("https://api.example.com").validate(), Ok(()));
    }

    #[test]
    fn env_passthrough_never_names_a_routes_variable() {
        let mut config = CredentialsConfig::default();
        let gatewayed = RouteConfig {
            env: Some("GW_REAL_KEY".into()),
            inject_as: "GW_TOKEN".into(),
            upstream: Some("https://api.example.com".into()),
            ..Default::default()
        };
        config.routes.insert("gw".into(), gatewayed);
        let exposed = RouteConfig {
            file: Some("/k".into()),
            inject_as: "GITHUB_TOKEN".into(),
            expose: true,
            ..Default::default()
        };
        config.routes.insert("github".into(), exposed);
        let check =
            |vars: &[&str]| config.check_env_passthrough(&vars.iter().map(|v| v.to_string()).collect::<Vec<_>>());
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["LANG", "TERM", "gw_real_key"]), Ok(()));
        assert_eq!(
            check(&["LANG", "GW_REAL_KEY"]).unwrap_err(),
            "sandbox.env_passthrough: GW_REAL_KEY holds the value of credential route gw ([credentials.routes.gw] \
             env); passed through, the key would enter the sandbox"
        );
        assert_eq!(
            check(&["GW_TOKEN"]).unwrap_err(),
            "sandbox.env_passthrough: GW_TOKEN is where credential route gw puts its value or placeholder \
             (inject_as); the daemon's own GW_TOKEN would enter the sandbox before it"
        );
        assert!(
            check(&["GITHUB_TOKEN"]).unwrap_err().contains("credential route github"),
            "any route, not only the profile's"
        );
    }
}
