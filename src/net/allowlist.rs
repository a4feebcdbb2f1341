//! The egress allowlist: which `(host, port)` a sandbox may reach through its
//! proxy. Pure: parsing, matching a name, and judging each resolved address.
//!
//! Decisions happen twice. [`Allowlist::check_name`] judges the name the
//! client asked for, before anything is resolved; [`Allowlist::check_address`]
//! judges every address that name resolved to, so a public name that resolves
//! (or is rebound) to loopback, a private network or the cloud metadata
//! service is still refused. Only a rule naming an exact `ip:port` may reach a
//! non-public address, and nothing ever reaches the daemon's own listeners.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub use super::ip::host_addresses;
use super::ip::special_class;

/// The host half of a pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Host {
    /// `*`: any name, and any public IP literal.
    Any,
    /// `*.suffix`: strict subdomains of `suffix`, never `suffix` itself.
    Suffix(String),
    /// An exact DNS name, lowercase, no trailing dot.
    Name(String),
    /// An IP literal (IPv4-mapped IPv6 folded to IPv4).
    Ip(IpAddr),
}

/// One allowlist entry as written in a profile/policy: `api.anthropic.com`, `*.github.com`,
/// optional `:port` (`api.example.com:8443`), `*` (any public host), an IP literal with a port
/// (`127.0.0.1:8080`, `[::1]:8080`), or an IP literal without a port (public IPs only).
/// Without a port an entry means ports 443 and 80. Host names are matched case-insensitively,
/// without a trailing dot. Parsing rejects: empty, whitespace, `*` inside a label other than a
/// leading `*.`, schemes (`https://`), paths, ports 0 or > 65535, non-LDH names, `*.` alone.
/// It also rejects a name whose last label does not start with a letter (`127.1`,
/// `2130706433`: numeric spellings of addresses that the resolver would turn into IPs), and a
/// non-public IP literal without a port (it could never match anything).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern {
    host: Host,
    /// `None` = ports 443 and 80.
    port: Option<u16>,
    /// Canonical text, as returned by `as_str` and used as the rule name.
    text: String,
}

/// What a client asked to reach, normalized: a DNS name or an IP literal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Name(String),
    Ip(IpAddr),
}

impl Target {
    /// Normalizes `host` as a client named it: `[v6]`, a bare IP literal, or a
    /// DNS name (lowercased, one trailing dot dropped, LDH-validated).
    pub(crate) fn parse(host: &str) -> Result<Target, String> {
        if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            return inner
                .parse::<Ipv6Addr>()
                .map(|ip| Target::Ip(IpAddr::V6(ip).to_canonical()))
                .map_err(|_| "`[...]` does not hold an IPv6 address".to_string());
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(Target::Ip(ip.to_canonical()));
        }
        normalize_name(host).map(Target::Name)
    }

    /// `host:port` for logs and byte counters (`[v6]:port` for IPv6).
    pub(crate) fn with_port(&self, port: u16) -> String {
        match self {
            Target::Ip(IpAddr::V6(ip)) => format!("[{ip}]:{port}"),
            other => format!("{other}:{port}"),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Name(name) => f.write_str(name),
            Target::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Lowercases, drops one trailing dot and checks LDH syntax (RFC 1123): labels of 1-63
/// letters, digits and inner hyphens, 253 characters in all, the last label starting with
/// a letter so no numeric spelling of an address (`127.1`, `0x7f000001`) passes as a name.
fn normalize_name(name: &str) -> Result<String, String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return Err("empty host name".into());
    }
    if name.len() > 253 {
        return Err("host name longer than 253 characters".into());
    }
    let name = name.to_ascii_lowercase();
    for label in name.split('.') {
        if label.is_empty() {
            return Err("empty label in host name".into());
        }
        if label.len() > 63 {
            return Err("label longer than 63 characters".into());
        }
        if !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err("host name may only hold letters, digits, `-` and `.`".into());
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("label starts or ends with `-`".into());
        }
    }
    if !name.rsplit('.').next().is_some_and(|last| last.starts_with(|c: char| c.is_ascii_alphabetic())) {
        return Err("last label must start with a letter (write IP addresses in dotted form)".into());
    }
    Ok(name)
}

fn parse_port(text: &str) -> Result<u16, String> {
    if text.is_empty() {
        return Err("empty port".into());
    }
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("port {text:?} is not a number"));
    }
    match text.parse::<u32>() {
        Ok(port @ 1..=65535) if text.len() <= 5 => Ok(port as u16),
        _ => Err(format!("port {text} is out of range (1-65535)")),
    }
}

/// `name` is a strict subdomain of `suffix`.
fn is_subdomain(name: &str, suffix: &str) -> bool {
    name.len() > suffix.len() + 1 && name.ends_with(suffix) && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
}

impl HostPattern {
    /// Parses one `allow_hosts` entry; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<HostPattern, String> {
        if text.is_empty() {
            return Err("empty entry".into());
        }
        if text.chars().any(char::is_whitespace) {
            return Err("contains whitespace".into());
        }
        if text.contains("://") {
            return Err("has a scheme; write the host only (`api.example.com`)".into());
        }
        if text.contains('/') {
            return Err("has a path; write the host only (`api.example.com`)".into());
        }
        let (host_text, port) = if let Some(rest) = text.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or("`[` without `]`")?;
            let ip = inner.parse::<Ipv6Addr>().map_err(|_| "`[...]` does not hold an IPv6 address")?;
            let port = match after {
                "" => None,
                _ => Some(parse_port(after.strip_prefix(':').ok_or("unexpected text after `]`")?)?),
            };
            return HostPattern::from_ip(IpAddr::V6(ip), port);
        } else if text.matches(':').count() > 1 {
            let ip = text.parse::<Ipv6Addr>().map_err(|_| "not an IPv6 address (write `[addr]:port` for a port)")?;
            return HostPattern::from_ip(IpAddr::V6(ip), None);
        } else if let Some((host, port)) = text.split_once(':') {
            (host, Some(parse_port(port)?))
        } else {
            (text, None)
        };
        let host = if host_text == "*" {
            Host::Any
        } else if let Some(suffix) = host_text.strip_prefix("*.") {
            if suffix.is_empty() {
                return Err("`*.` needs a domain after it (`*.example.com`)".into());
            }
            if suffix.contains('*') {
                return Err("`*` is only allowed as a whole leading label (`*.example.com`)".into());
            }
            Host::Suffix(normalize_name(suffix)?)
        } else if host_text.contains('*') {
            return Err("`*` is only allowed as a whole leading label (`*.example.com`)".into());
        } else if let Ok(ip) = host_text.parse::<Ipv4Addr>() {
            return HostPattern::from_ip(IpAddr::V4(ip), port);
        } else {
            Host::Name(normalize_name(host_text)?)
        };
        Ok(HostPattern::build(host, port))
    }

    fn from_ip(ip: IpAddr, port: Option<u16>) -> Result<HostPattern, String> {
        let ip = ip.to_canonical();
        if let (Some(class), None) = (special_class(ip), port) {
            return Err(format!("{ip} is a {class} address; such an address needs an explicit port (`ip:port`)"));
        }
        Ok(HostPattern::build(Host::Ip(ip), port))
    }

    fn build(host: Host, port: Option<u16>) -> HostPattern {
        let host_text = match &host {
            Host::Any => "*".to_string(),
            Host::Suffix(suffix) => format!("*.{suffix}"),
            Host::Name(name) => name.clone(),
            Host::Ip(IpAddr::V6(ip)) if port.is_some() => format!("[{ip}]"),
            Host::Ip(ip) => ip.to_string(),
        };
        let text = match port {
            Some(port) => format!("{host_text}:{port}"),
            None => host_text,
        };
        HostPattern { host, port, text }
    }

    /// Canonical text: lowercase, no trailing dot, IPv6 with a port in brackets.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    fn matches_port(&self, port: u16) -> bool {
        match self.port {
            None => port == 443 || port == 80,
            Some(p) => p == port,
        }
    }

    fn matches(&self, target: &Target, port: u16) -> bool {
        self.matches_port(port)
            && match (&self.host, target) {
                (Host::Any, _) => true,
                (Host::Suffix(suffix), Target::Name(name)) => is_subdomain(name, suffix),
                (Host::Name(own), Target::Name(name)) => own == name,
                (Host::Ip(own), Target::Ip(ip)) => own == ip,
                _ => false,
            }
    }

    /// How specific a rule is; the most specific matching rule is the one
    /// reported, so an exact `ip:port` rule wins over `*` for that address.
    fn specificity(&self) -> u8 {
        match (&self.host, self.port) {
            (Host::Ip(_), Some(_)) => 4,
            (Host::Ip(_), None) => 3,
            (Host::Name(_), _) => 2,
            (Host::Suffix(_), _) => 1,
            (Host::Any, _) => 0,
        }
    }

    /// Whether every (host, port) `other` matches is matched by `self` (used to intersect lists).
    /// "Matched" means what the proxy would let through, so `*` never covers a
    /// non-public IP literal: only an exact `ip:port` rule reaches such an address.
    pub fn covers(&self, other: &HostPattern) -> bool {
        let ports = match (self.port, other.port) {
            (None, None) => true,
            (None, Some(p)) => p == 443 || p == 80,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        ports
            && match (&self.host, &other.host) {
                (Host::Any, Host::Ip(ip)) => special_class(*ip).is_none(),
                (Host::Any, _) => true,
                (Host::Suffix(own), Host::Suffix(theirs)) => own == theirs || is_subdomain(theirs, own),
                (Host::Suffix(own), Host::Name(name)) => is_subdomain(name, own),
                (Host::Name(own), Host::Name(name)) => own == name,
                (Host::Ip(own), Host::Ip(ip)) => own == ip,
                _ => false,
            }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Validates a list (for config/profile loading; the error names the entry).
pub fn parse_hosts(list: &[String]) -> Result<Vec<HostPattern>, String> {
    list.iter()
        .map(|entry| HostPattern::parse(entry).map_err(|reason| format!("allowlist entry {entry:?}: {reason}")))
        .collect()
}

/// The intersection of two allowlists, never a union: entries of `a` covered by some entry of
/// `b`, plus entries of `b` covered by some entry of `a`, deduplicated, in a stable order
/// (`a`'s first, then `b`'s, as canonical text). Invalid entries are dropped. Example:
/// a=[*.github.com, api.anthropic.com], b=[api.github.com, evil.com] → [api.github.com].
pub fn intersect(a: &[String], b: &[String]) -> Vec<String> {
    let parse = |list: &[String]| list.iter().filter_map(|e| HostPattern::parse(e).ok()).collect::<Vec<_>>();
    let (a, b) = (parse(a), parse(b));
    let from_a = a.iter().filter(|x| b.iter().any(|y| y.covers(x)));
    let from_b = b.iter().filter(|y| a.iter().any(|x| x.covers(y)));
    let mut out: Vec<String> = Vec::new();
    for pattern in from_a.chain(from_b) {
        if !out.iter().any(|t| t == pattern.as_str()) {
            out.push(pattern.text.clone());
        }
    }
    out
}

/// Decision at the name level, before any resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The connection may go ahead.
    Allow {
        /// The allowlist entry that allows it.
        rule: String,
    },
    /// The connection is refused.
    Deny {
        /// Why, as the egress log records it.
        reason: String,
    },
}

/// A parsed allowlist. Empty = nothing is allowed.
#[derive(Clone, Debug, Default)]
pub struct Allowlist {
    patterns: Vec<HostPattern>,
}

impl Allowlist {
    /// An allowlist of `patterns`.
    pub fn new(patterns: Vec<HostPattern>) -> Allowlist {
        Allowlist { patterns }
    }

    /// Its patterns, in the order given.
    pub fn patterns(&self) -> &[HostPattern] {
        &self.patterns
    }

    /// `host` as the client named it (a DNS name or an IP literal, IPv6 possibly in brackets).
    /// The most specific matching rule is reported (exact `ip:port` first, `*` last). An
    /// invalid host is quoted whole in the reason (`{:?}`): the daemon scrubs the reason
    /// before it cuts it, so a credential asked as a host is redacted, not left a prefix.
    pub fn check_name(&self, host: &str, port: u16) -> Verdict {
        let target = match Target::parse(host) {
            Ok(target) => target,
            Err(why) => return Verdict::Deny { reason: format!("invalid host {host:?}: {why}") },
        };
        if port == 0 {
            return Verdict::Deny { reason: "port 0".into() };
        }
        let best =
            self.patterns.iter().filter(|p| p.matches(&target, port)).fold(
                None::<&HostPattern>,
                |best, p| match best {
                    Some(b) if b.specificity() >= p.specificity() => Some(b),
                    _ => Some(p),
                },
            );
        match best {
            Some(rule) => Verdict::Allow { rule: rule.text.clone() },
            None => Verdict::Deny { reason: format!("{} is not in the allowlist", target.with_port(port)) },
        }
    }

    /// After resolution: every address the proxy would connect to is checked. Loopback,
    /// private (10/8, 172.16/12, 192.168/16, 100.64/10 CGNAT, fc00::/7), link-local
    /// (169.254/16 incl. cloud metadata 169.254.169.254, fe80::/10), unspecified, multicast,
    /// broadcast, documentation/benchmark ranges, IPv4-mapped IPv6 forms of all of these,
    /// and any address in `host_addresses` (the host's own interfaces) are refused UNLESS the
    /// allowing rule is an exact IP literal with that same address AND port. Also refused,
    /// always, even if allowlisted: any (addr, port) in `protected` (the daemon's own listeners;
    /// a protected 0.0.0.0:P or [::]:P means port P on every local address).
    /// `rule` must be one this allowlist returned from `check_name`.
    pub fn check_address(
        &self,
        rule: &str,
        addr: SocketAddr,
        host_addresses: &[IpAddr],
        protected: &[SocketAddr],
    ) -> Verdict {
        let ip = addr.ip().to_canonical();
        let port = addr.port();
        let shown = SocketAddr::new(ip, port);
        let own = host_addresses.iter().any(|h| h.to_canonical() == ip);
        let local = ip.is_loopback() || ip.is_unspecified() || own;
        let is_protected = protected.iter().any(|p| {
            let pip = p.ip().to_canonical();
            p.port() == port && (pip == ip || (pip.is_unspecified() && local))
        });
        if is_protected {
            return Verdict::Deny { reason: format!("{shown} is one of the daemon's own listeners") };
        }
        let Some(pattern) = self.patterns.iter().find(|p| p.text == rule) else {
            return Verdict::Deny { reason: format!("rule {rule:?} is not in the allowlist") };
        };
        if !pattern.matches_port(port) {
            return Verdict::Deny { reason: format!("{shown}: port {port} is not allowed by rule {rule}") };
        }
        let exact = match pattern.host {
            Host::Ip(rule_ip) if rule_ip != ip => {
                return Verdict::Deny { reason: format!("{shown} is not the address rule {rule} names") };
            }
            Host::Ip(_) => pattern.port == Some(port),
            _ => false,
        };
        if !exact {
            if let Some(class) = special_class(ip) {
                return Verdict::Deny {
                    reason: format!("{shown} is a {class} address; only an exact `ip:port` rule allows it"),
                };
            }
            if own {
                return Verdict::Deny {
                    reason: format!("{shown} is an address of this host; only an exact `ip:port` rule allows it"),
                };
            }
        }
        Verdict::Allow { rule: pattern.text.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::credentials::Scrubber;

    /// An Anthropic-like key: 108 characters.
    const KEY: &str =
        "sk-ant-api03-PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA_2O76UMFxFkM_R5Kjp1vRt-1fjORS_6ilI8ihN5KXSc7Tvo_hBKqFYAA";

    /// The daemon's egress reason, scrubbed of `KEY` as the daemon does
    /// (`record_egress`: scrubbed whole, then cut to 1,024 characters);
    /// fails if any 8 characters of the key are left.
    fn scrubbed(reason: &str) -> String {
        let mut scrubber = Scrubber::default();
        scrubber.add("anthropic", KEY);
        let out = scrubber.scrub_within(reason, 1024);
        let lower = out.to_ascii_lowercase();
        for i in 0..=KEY.len() - 8 {
            let piece = KEY[i..i + 8].to_ascii_lowercase();
            assert!(!lower.contains(&piece), "{piece:?} of the key is left in {out:?}");
        }
        out
    }

    /// A credential asked as a host is quoted whole in the reason, never
    /// cut first: cut, it would keep a prefix no scrubber pattern matches.
    #[test]
    fn an_invalid_host_is_quoted_whole_so_the_daemon_can_scrub_it() {
        let host = format!("{KEY}.example.com");
        assert_eq!(host.len(), 120);
        let Verdict::Deny { reason } = Allowlist::default().check_name(&host, 443) else { panic!("denied") };
        assert!(reason.starts_with(&format!("invalid host {host:?}: ")), "{reason}");
        assert!(scrubbed(&reason).starts_with("invalid host \"[REDACTED:anthropic].example.com\": "));
    }

    /// The rule a `check_address` caller passes is quoted whole too.
    #[test]
    fn an_unknown_rule_is_quoted_whole() {
        let rule = format!("{KEY}.example.com");
        let addr: SocketAddr = "192.0.2.1:443".parse().unwrap();
        let Verdict::Deny { reason } = Allowlist::default().check_address(&rule, addr, &[], &[]) else {
            panic!("denied")
        };
        assert_eq!(reason, format!("rule {rule:?} is not in the allowlist"));
        assert_eq!(scrubbed(&reason), "rule \"[REDACTED:anthropic].example.com\" is not in the allowlist");
    }
}
