//! A model endpoint URL, `http(s)://host[:port][/path]`: the one parser of
//! the URLs corral is configured with (model base URLs, gateway upstreams,
//! the hub), and the allowlist entry that lets exactly it through.

/// A model endpoint, `http(s)://host[:port][/path]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The host name (lowercase) or address, IPv6 without brackets.
    pub host: String,
    /// The port, the scheme's default (443 or 80) when the URL names none.
    pub port: u16,
}

impl Endpoint {
    /// Parses `url`; the error quotes it and says what is wrong.
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let bad = |why: &str| format!("{url:?} is not an http(s)://host[:port][/path] URL: {why}");
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("whitespace or control characters"));
        }
        let lower = url.to_ascii_lowercase();
        let (rest, default_port) = if lower.starts_with("https://") {
            (&url[8..], 443)
        } else if lower.starts_with("http://") {
            (&url[7..], 80)
        } else {
            return Err(bad("the scheme must be http or https"));
        };
        if rest.contains(['?', '#']) {
            return Err(bad("no query or fragment"));
        }
        let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
        if authority.is_empty() || authority.contains('@') {
            return Err(bad("a host (and no user) is required"));
        }
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (inner, after) = v6.split_once(']').ok_or_else(|| bad("`[` without `]`"))?;
                (inner.to_string(), after.strip_prefix(':'))
            }
            None => match authority.split_once(':') {
                Some((host, port)) => (host.to_string(), Some(port)),
                None => (authority.to_string(), None),
            },
        };
        let port = match port {
            None => default_port,
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port > 0 && text.bytes().all(|b| b.is_ascii_digit()) => port,
                _ => return Err(bad("bad port")),
            },
        };
        let endpoint = Endpoint { host: host.to_ascii_lowercase(), port };
        super::HostPattern::parse(&endpoint.allow_entry()).map_err(|e| bad(&e))?;
        Ok(endpoint)
    }

    /// The `allow_hosts` entry that lets exactly this endpoint through.
    pub fn allow_entry(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}
