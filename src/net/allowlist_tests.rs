//! Exact vectors for the allowlist: parsing, covering, intersecting, and the
//! two checks. Addresses here are values in pure functions; nothing is contacted.

use std::net::{IpAddr, SocketAddr};

use super::*;

fn pattern(text: &str) -> HostPattern {
    HostPattern::parse(text).unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
}

fn list(entries: &[&str]) -> Allowlist {
    Allowlist::new(entries.iter().map(|e| pattern(e)).collect())
}

fn strings(entries: &[&str]) -> Vec<String> {
    entries.iter().map(|e| e.to_string()).collect()
}

fn sa(text: &str) -> SocketAddr {
    text.parse().unwrap_or_else(|_| panic!("{text} is a socket address"))
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn allow(rule: &str) -> Verdict {
    Verdict::Allow { rule: rule.into() }
}

fn deny_reason(verdict: Verdict) -> String {
    match verdict {
        Verdict::Deny { reason } => reason,
        allowed => panic!("expected a denial, got {allowed:?}"),
    }
}

#[test]
fn valid_entries_parse_to_their_canonical_text() {
    let vectors = [
        ("api.anthropic.com", "api.anthropic.com"),
        ("API.Anthropic.COM.", "api.anthropic.com"),
        ("*.github.com", "*.github.com"),
        ("*.GitHub.com.", "*.github.com"),
        ("api.example.com:8443", "api.example.com:8443"),
        ("api.example.com:00443", "api.example.com:443"),
        ("api.example.com:65535", "api.example.com:65535"),
        ("*", "*"),
        ("*:8080", "*:8080"),
        ("localhost", "localhost"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("a-b.c0m", "a-b.c0m"),
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("10.0.0.5:22", "10.0.0.5:22"),
        ("[::1]:8080", "[::1]:8080"),
        ("[::FFFF:127.0.0.1]:8080", "127.0.0.1:8080"),
        ("93.184.216.34", "93.184.216.34"),
        ("93.184.216.34:443", "93.184.216.34:443"),
        ("2606:2800:220:1::1", "2606:2800:220:1::1"),
        ("[2606:2800:220:1::1]", "2606:2800:220:1::1"),
        ("[2606:2800:0220:0001::1]:443", "[2606:2800:220:1::1]:443"),
    ];
    for (text, canonical) in vectors {
        assert_eq!(pattern(text).as_str(), canonical, "{text}");
        assert_eq!(pattern(canonical), pattern(text), "the canonical text of {text} parses back to the same");
    }
}

#[test]
fn every_rejected_form_names_its_reason() {
    let long_label = format!("{}.com", "a".repeat(64));
    let long_name = format!("{}.com", vec!["a".repeat(60); 5].join("."));
    let vectors: Vec<(&str, &str)> = vec![
        ("", "empty entry"),
        (" api.com", "contains whitespace"),
        ("api .com", "contains whitespace"),
        ("api.com\t", "contains whitespace"),
        ("https://api.com", "has a scheme"),
        ("http://api.com:80", "has a scheme"),
        ("api.com/v1", "has a path"),
        ("api.com:0", "port 0 is out of range (1-65535)"),
        ("api.com:65536", "port 65536 is out of range (1-65535)"),
        ("api.com:999999", "port 999999 is out of range (1-65535)"),
        ("1.2.3.4:0", "port 0 is out of range (1-65535)"),
        ("api.com:", "empty port"),
        ("api.com:http", "port \"http\" is not a number"),
        ("api.com:+443", "port \"+443\" is not a number"),
        ("*.", "`*.` needs a domain after it"),
        ("*.*.com", "`*` is only allowed as a whole leading label"),
        ("a*.com", "`*` is only allowed as a whole leading label"),
        ("*a.com", "`*` is only allowed as a whole leading label"),
        ("api.*.com", "`*` is only allowed as a whole leading label"),
        ("**", "`*` is only allowed as a whole leading label"),
        ("api_x.com", "host name may only hold letters, digits, `-` and `.`"),
        ("ümlaut.de", "host name may only hold letters, digits, `-` and `.`"),
        ("user@api.com", "host name may only hold letters, digits, `-` and `.`"),
        ("api.com?x", "host name may only hold letters, digits, `-` and `.`"),
        ("-a.com", "label starts or ends with `-`"),
        ("a-.com", "label starts or ends with `-`"),
        ("a..com", "empty label in host name"),
        ("a.com..", "empty label in host name"),
        (".", "empty host name"),
        (":443", "empty host name"),
        (&long_label, "label longer than 63 characters"),
        (&long_name, "host name longer than 253 characters"),
        ("127.1", "last label must start with a letter"),
        ("2130706433", "last label must start with a letter"),
        ("0x7f000001", "last label must start with a letter"),
        ("*.1.2.3.4", "last label must start with a letter"),
        ("10.0.0.5", "10.0.0.5 is a private (10.0.0.0/8) address; such an address needs an explicit port"),
        ("127.0.0.1", "127.0.0.1 is a loopback (127.0.0.0/8) address"),
        ("169.254.169.254", "is a link-local (169.254.0.0/16) address"),
        ("[::1]", "::1 is a loopback (::1) address"),
        ("::1", "::1 is a loopback (::1) address"),
        ("fc00::1", "is a unique local (fc00::/7) address"),
        ("[::1", "`[` without `]`"),
        ("[::1]8080", "unexpected text after `]`"),
        ("[1.2.3.4]:80", "`[...]` does not hold an IPv6 address"),
        ("1.2.3.4:80:90", "not an IPv6 address (write `[addr]:port` for a port)"),
    ];
    for (text, reason) in vectors {
        let err = HostPattern::parse(text).expect_err(text);
        assert!(err.contains(reason), "{text:?}: {err:?} should say {reason:?}");
    }
}

#[test]
fn parse_hosts_names_the_bad_entry() {
    let ok = parse_hosts(&strings(&["api.anthropic.com", "*.GitHub.com"])).unwrap();
    assert_eq!(ok.iter().map(HostPattern::as_str).collect::<Vec<_>>(), ["api.anthropic.com", "*.github.com"]);
    let err = parse_hosts(&strings(&["api.anthropic.com", "https://evil.com", "x"])).unwrap_err();
    assert_eq!(err, "allowlist entry \"https://evil.com\": has a scheme; write the host only (`api.example.com`)");
    assert_eq!(parse_hosts(&[]).unwrap(), vec![]);
}

#[test]
fn covers_vectors() {
    let vectors = [
        ("*", "api.github.com", true),
        ("*", "*.github.com", true),
        ("*", "*", true),
        ("*", "93.184.216.34", true),
        ("*", "api.com:443", true),
        ("*", "api.com:8080", false),
        ("*:8080", "api.com:8080", true),
        ("*:8080", "127.0.0.1:8080", false),
        ("*:443", "api.com", false),
        ("*.github.com", "api.github.com", true),
        ("*.github.com", "a.b.github.com", true),
        ("*.github.com", "*.api.github.com", true),
        ("*.github.com", "*.github.com", true),
        ("*.github.com", "github.com", false),
        ("*.github.com", "evilgithub.com", false),
        ("*.github.com", "*.com", false),
        ("*.github.com", "*", false),
        ("*.github.com", "api.github.com:8443", false),
        ("api.github.com", "api.github.com:443", true),
        ("api.github.com", "api.github.com:80", true),
        ("api.github.com", "API.github.com.", true),
        ("api.github.com", "api.github.com:8443", false),
        ("api.github.com", "*.github.com", false),
        ("api.github.com:443", "api.github.com", false),
        ("127.0.0.1:8080", "127.0.0.1:8080", true),
        ("127.0.0.1:8080", "[::ffff:127.0.0.1]:8080", true),
        ("127.0.0.1:8080", "127.0.0.1:8081", false),
        ("127.0.0.1:8080", "127.0.0.2:8080", false),
        ("93.184.216.34", "93.184.216.34:80", true),
        ("93.184.216.34", "93.184.216.34:8080", false),
        ("93.184.216.34", "*", false),
        ("api.github.com", "140.82.112.3", false),
    ];
    for (a, b, expected) in vectors {
        assert_eq!(pattern(a).covers(&pattern(b)), expected, "{a} covers {b}");
    }
}

#[test]
fn intersect_vectors() {
    let vectors: [(&[&str], &[&str], &[&str]); 12] = [
        (&["*.github.com", "api.anthropic.com"], &["api.github.com", "evil.com"], &["api.github.com"]),
        (&["api.github.com", "evil.com"], &["*.github.com", "api.anthropic.com"], &["api.github.com"]),
        (&["*"], &["api.github.com", "127.0.0.1:8080", "93.184.216.34"], &["api.github.com", "93.184.216.34"]),
        (&["*"], &["*"], &["*"]),
        (&["api.com", "API.com."], &["api.com"], &["api.com"]),
        (&["api.com:443"], &["api.com"], &["api.com:443"]),
        (&["", "https://x.com", "x.com", "*.*"], &["x.com", "bad host"], &["x.com"]),
        (&["*.github.com"], &["*.api.github.com", "github.com"], &["*.api.github.com"]),
        (&[], &["*"], &[]),
        (&["b.com", "a.com"], &["*"], &["b.com", "a.com"]),
        (&["*.github.com", "api.github.com"], &["*.github.com"], &["*.github.com", "api.github.com"]),
        (&["127.0.0.1:8080"], &["127.0.0.1:8080", "*"], &["127.0.0.1:8080"]),
    ];
    for (a, b, expected) in vectors {
        assert_eq!(intersect(&strings(a), &strings(b)), strings(expected), "{a:?} ∩ {b:?}");
    }
}

#[test]
fn check_name_matches_hosts_and_ports() {
    let allowlist = list(&["api.anthropic.com", "*.github.com"]);
    let vectors = [
        ("api.anthropic.com", 443, Some("api.anthropic.com")),
        ("api.anthropic.com", 80, Some("api.anthropic.com")),
        ("api.anthropic.com", 8443, None),
        ("api.anthropic.com", 22, None),
        ("API.Anthropic.COM.", 443, Some("api.anthropic.com")),
        ("api.github.com", 443, Some("*.github.com")),
        ("a.b.github.com", 80, Some("*.github.com")),
        ("github.com", 443, None),
        ("evilgithub.com", 443, None),
        ("api.github.com.evil.com", 443, None),
        ("api.anthropic.com.evil.com", 443, None),
        ("anthropic.com", 443, None),
        ("140.82.112.3", 443, None),
    ];
    for (host, port, rule) in vectors {
        let expected = match rule {
            Some(rule) => allow(rule),
            None => Verdict::Deny { reason: format!("{}:{port} is not in the allowlist", host.to_ascii_lowercase()) },
        };
        assert_eq!(allowlist.check_name(host, port), expected, "{host}:{port}");
    }
    for (host, reason) in [
        ("", "invalid host \"\": empty host name"),
        ("api.github.com:443", "invalid host \"api.github.com:443\": host name may only hold"),
        ("a b.github.com", "invalid host \"a b.github.com\": host name may only hold"),
        ("[::1", "invalid host \"[::1\": host name may only hold"),
        ("[api.github.com]", "invalid host \"[api.github.com]\": `[...]` does not hold an IPv6 address"),
        ("127.1", "invalid host \"127.1\": last label must start with a letter"),
    ] {
        let got = deny_reason(allowlist.check_name(host, 443));
        assert!(got.starts_with(reason), "{host:?}: {got:?}");
    }
    assert_eq!(allowlist.check_name("api.github.com", 0), Verdict::Deny { reason: "port 0".into() });
    assert!(matches!(Allowlist::new(vec![]).check_name("api.github.com", 443), Verdict::Deny { .. }));
}

#[test]
fn star_allows_any_name_on_the_default_ports() {
    let star = list(&["*"]);
    for host in ["example.com", "LOCALHOST", "a.b.c.d.e", "127.0.0.1", "[::1]", "2606:2800:220:1::1"] {
        assert_eq!(star.check_name(host, 443), allow("*"), "{host}");
        assert_eq!(star.check_name(host, 80), allow("*"), "{host}");
        assert!(matches!(star.check_name(host, 8080), Verdict::Deny { .. }), "{host}");
    }
    assert_eq!(deny_reason(star.check_name("[::1]", 8080)), "[::1]:8080 is not in the allowlist");
    assert_eq!(list(&["*:8080"]).check_name("example.com", 8080), allow("*:8080"));
}

#[test]
fn the_most_specific_rule_is_reported() {
    for entries in [["*:8080", "127.0.0.1:8080"], ["127.0.0.1:8080", "*:8080"]] {
        let allowlist = list(&entries);
        assert_eq!(allowlist.check_name("127.0.0.1", 8080), allow("127.0.0.1:8080"));
        assert_eq!(allowlist.check_name("[::ffff:127.0.0.1]", 8080), allow("127.0.0.1:8080"));
        assert_eq!(allowlist.check_name("127.0.0.2", 8080), allow("*:8080"));
    }
    let allowlist = list(&["*", "*.github.com", "api.github.com"]);
    assert_eq!(allowlist.check_name("api.github.com", 443), allow("api.github.com"));
    assert_eq!(allowlist.check_name("x.github.com", 443), allow("*.github.com"));
    let v6 = list(&["[::1]:8080"]);
    assert_eq!(v6.check_name("[::1]", 8080), allow("[::1]:8080"));
    assert_eq!(v6.check_name("::1", 8080), allow("[::1]:8080"));
    assert!(matches!(v6.check_name("::1", 8081), Verdict::Deny { .. }));
}

#[test]
fn check_address_refuses_non_public_addresses_under_star() {
    let star = list(&["*"]);
    let refused = [
        ("127.0.0.1:443", "loopback (127.0.0.0/8)"),
        ("127.255.0.9:443", "loopback (127.0.0.0/8)"),
        ("10.0.0.5:443", "private (10.0.0.0/8)"),
        ("172.20.1.1:443", "private (172.16.0.0/12)"),
        ("192.168.1.1:443", "private (192.168.0.0/16)"),
        ("169.254.169.254:80", "link-local (169.254.0.0/16)"),
        ("100.64.0.1:443", "shared CGNAT (100.64.0.0/10)"),
        ("0.0.0.0:443", "unspecified (0.0.0.0/8)"),
        ("255.255.255.255:443", "broadcast (255.255.255.255)"),
        ("224.0.0.1:443", "multicast (224.0.0.0/4)"),
        ("240.0.0.1:443", "reserved (240.0.0.0/4)"),
        ("192.0.2.1:443", "documentation (192.0.2.0/24)"),
        ("198.51.100.7:443", "documentation (198.51.100.0/24)"),
        ("203.0.113.9:443", "documentation (203.0.113.0/24)"),
        ("198.18.0.1:443", "benchmarking (198.18.0.0/15)"),
        ("192.0.0.8:443", "IETF protocol assignment (192.0.0.0/24)"),
        ("[::1]:443", "loopback (::1)"),
        ("[::]:443", "unspecified (::)"),
        ("[fe80::1]:443", "link-local (fe80::/10)"),
        ("[fc00::1]:443", "unique local (fc00::/7)"),
        ("[fd12:3456::1]:443", "unique local (fc00::/7)"),
        ("[fec0::1]:443", "site-local (fec0::/10)"),
        ("[ff02::1]:443", "multicast (ff00::/8)"),
        ("[2001:db8::1]:443", "documentation (2001:db8::/32)"),
        ("[2001::1]:443", "IETF protocol assignment incl. Teredo (2001::/23)"),
        ("[2002:7f00:1::]:443", "6to4 (2002::/16)"),
        ("[::ffff:127.0.0.1]:443", "loopback (127.0.0.0/8)"),
        ("[::ffff:10.0.0.1]:443", "private (10.0.0.0/8)"),
        ("[::ffff:169.254.169.254]:80", "link-local (169.254.0.0/16)"),
        ("[::127.0.0.1]:443", "IPv4-compatible (::/96)"),
        ("[64:ff9b::7f00:1]:443", "loopback (127.0.0.0/8)"),
        ("[64:ff9b::a9fe:a9fe]:80", "link-local (169.254.0.0/16)"),
        ("[100::1]:443", "discard-only (100::/64)"),
        ("[4000::1]:443", "not global unicast (outside 2000::/3)"),
    ];
    for (addr, class) in refused {
        let reason = deny_reason(star.check_address("*", sa(addr), &[], &[]));
        assert!(reason.contains(class), "{addr}: {reason:?} should name {class:?}");
        assert!(reason.ends_with("only an exact `ip:port` rule allows it"), "{reason}");
    }
    let allowed = [
        "93.184.216.34:443",
        "[2606:2800:220:1::1]:443",
        "1.1.1.1:80",
        "172.32.0.1:443",
        "172.15.255.255:443",
        "100.128.0.1:443",
        "169.253.0.1:443",
        "11.0.0.1:443",
        "[::ffff:93.184.216.34]:443",
        "[64:ff9b::5db8:d822]:443",
    ];
    for addr in allowed {
        assert_eq!(star.check_address("*", sa(addr), &[], &[]), allow("*"), "{addr}");
    }
    assert_eq!(
        deny_reason(star.check_address("*", sa("93.184.216.34:8080"), &[], &[])),
        "93.184.216.34:8080: port 8080 is not allowed by rule *"
    );
    assert_eq!(
        deny_reason(star.check_address("api.github.com", sa("93.184.216.34:443"), &[], &[])),
        "rule \"api.github.com\" is not in the allowlist"
    );
}

#[test]
fn an_exact_ip_rule_reaches_exactly_that_address_and_port() {
    let allowlist = list(&["127.0.0.1:8080", "93.184.216.34"]);
    let rule = "127.0.0.1:8080";
    assert_eq!(allowlist.check_address(rule, sa("127.0.0.1:8080"), &[], &[]), allow(rule));
    assert_eq!(allowlist.check_address(rule, sa("[::ffff:127.0.0.1]:8080"), &[], &[]), allow(rule));
    assert_eq!(
        deny_reason(allowlist.check_address(rule, sa("127.0.0.1:8081"), &[], &[])),
        "127.0.0.1:8081: port 8081 is not allowed by rule 127.0.0.1:8080"
    );
    assert_eq!(
        deny_reason(allowlist.check_address(rule, sa("127.0.0.2:8080"), &[], &[])),
        "127.0.0.2:8080 is not the address rule 127.0.0.1:8080 names"
    );
    let public = "93.184.216.34";
    assert_eq!(allowlist.check_address(public, sa("93.184.216.34:443"), &[], &[]), allow(public));
    assert!(matches!(allowlist.check_address(public, sa("93.184.216.35:443"), &[], &[]), Verdict::Deny { .. }));
}

#[test]
fn protected_listeners_are_refused_even_when_exactly_allowed() {
    let allowlist = list(&["127.0.0.1:50051", "10.1.2.3:50051", "10.9.9.9:50051", "*"]);
    let exact = |rule: &str, addr: &str, hosts: &[IpAddr], protected: &[SocketAddr]| {
        allowlist.check_address(rule, sa(addr), hosts, protected)
    };
    let own_listener = "127.0.0.1:50051 is one of the daemon's own listeners";
    assert_eq!(deny_reason(exact("127.0.0.1:50051", "127.0.0.1:50051", &[], &[sa("127.0.0.1:50051")])), own_listener);
    assert_eq!(deny_reason(exact("127.0.0.1:50051", "127.0.0.1:50051", &[], &[sa("0.0.0.0:50051")])), own_listener);
    assert_eq!(deny_reason(exact("127.0.0.1:50051", "127.0.0.1:50051", &[], &[sa("[::]:50051")])), own_listener);
    assert_eq!(
        deny_reason(exact("127.0.0.1:50051", "[::ffff:127.0.0.1]:50051", &[], &[sa("[::ffff:127.0.0.1]:50051")])),
        own_listener
    );
    // Another port of the same address is not protected.
    assert_eq!(exact("127.0.0.1:50051", "127.0.0.1:50051", &[], &[sa("127.0.0.1:50052")]), allow("127.0.0.1:50051"));
    // 0.0.0.0:P covers the host's own addresses, not remote hosts.
    let hosts = [ip("10.1.2.3")];
    assert!(matches!(exact("10.1.2.3:50051", "10.1.2.3:50051", &hosts, &[sa("0.0.0.0:50051")]), Verdict::Deny { .. }));
    assert_eq!(exact("10.9.9.9:50051", "10.9.9.9:50051", &hosts, &[sa("0.0.0.0:50051")]), allow("10.9.9.9:50051"));
    // A protected public address is refused under `*` too.
    let public = sa("93.184.216.34:443");
    assert!(matches!(allowlist.check_address("*", public, &[], &[public]), Verdict::Deny { .. }));
}

#[test]
fn the_hosts_own_addresses_need_an_exact_rule() {
    let allowlist = list(&["*", "93.184.216.34", "93.184.216.34:443"]);
    let addr = sa("93.184.216.34:443");
    for hosts in [[ip("93.184.216.34")], [ip("::ffff:93.184.216.34")]] {
        assert_eq!(
            deny_reason(allowlist.check_address("*", addr, &hosts, &[])),
            "93.184.216.34:443 is an address of this host; only an exact `ip:port` rule allows it"
        );
        assert!(matches!(allowlist.check_address("93.184.216.34", addr, &hosts, &[]), Verdict::Deny { .. }));
        assert_eq!(allowlist.check_address("93.184.216.34:443", addr, &hosts, &[]), allow("93.184.216.34:443"));
    }
    assert_eq!(allowlist.check_address("*", addr, &[ip("93.184.216.35")], &[]), allow("*"));
}

#[test]
fn special_class_and_host_addresses() {
    assert_eq!(special_class(ip("8.8.8.8")), None);
    assert_eq!(special_class(ip("2a00:1450::1")), None);
    assert_eq!(special_class(ip("::ffff:192.168.0.1")), Some("private (192.168.0.0/16)"));
    let own = host_addresses();
    assert!(own.contains(&ip("127.0.0.1")), "the loopback interface is listed: {own:?}");
    assert!(own.iter().all(|a| a.to_canonical() == *a), "mapped forms are folded");
}
