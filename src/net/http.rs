//! The proxy's view of HTTP/1.x: find the end of a request head, parse it
//! strictly, and rewrite an absolute-form request into the origin-form one
//! sent upstream. Pure; anything ambiguous (obsolete line folding, control
//! characters, spaces before `:`, non-UTF-8) is a 400, not a guess.

/// What the client asked the proxy for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// `CONNECT host:port`: a tunnel.
    Connect { host: String, port: u16 },
    /// `METHOD http://host[:port]/path`: `head` is the request to send upstream.
    Http { host: String, port: u16, head: Vec<u8> },
}

/// A request the proxy refuses with 400. The reason quotes the client's
/// text whole, escaped with `{:?}`: it is bounded by the head, and the
/// daemon scrubs it of the run's credentials (their plain and escaped
/// forms) before it cuts it. Cut here, or with its control characters
/// replaced, a credential in it would keep a form no pattern matches.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BadRequest {
    /// "connect" if the request line said CONNECT, else "http".
    pub method: &'static str,
    pub reason: String,
}

/// The length of the head (through its blank line) if `buf` holds all of it.
/// `from` is where the previous search stopped, so repeated calls stay linear.
pub(crate) fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    (start..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if rest.starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

fn is_token(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Splits `host:port` / `[v6]:port` (the port may be omitted only if a
/// default is given). The host is returned without brackets, unvalidated:
/// the allowlist judges it.
pub(crate) fn split_authority(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    if authority.is_empty() {
        return Err("empty host".into());
    }
    if authority.contains('@') {
        return Err("credentials in the authority are not supported".into());
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inner, after) = rest.split_once(']').ok_or("`[` without `]`")?;
        match after {
            "" => (inner, None),
            _ => (inner, Some(after.strip_prefix(':').ok_or("unexpected text after `]`")?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((_, _)) if authority.matches(':').count() > 1 => {
                return Err("an IPv6 host must be in brackets (`[::1]:443`)".into())
            }
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("empty host".into());
    }
    let port = match (port, default_port) {
        (Some(text), _) => match text.parse::<u16>() {
            Ok(port) if port != 0 && text.bytes().all(|b| b.is_ascii_digit()) => port,
            _ => return Err(format!("bad port {text:?}")),
        },
        (None, Some(port)) => port,
        (None, None) => return Err("missing port (`host:port`)".into()),
    };
    Ok((host.to_string(), port))
}

/// Headers never forwarded upstream: the client's `Host` (replaced by the
/// target's), `Connection`/`Keep-Alive` (replaced by `Connection: close`)
/// and every `Proxy-*` header (meant for this hop, e.g. credentials).
fn is_dropped(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    matches!(lower.as_str(), "host" | "connection" | "keep-alive") || lower.starts_with("proxy-")
}

/// The body's framing must be unambiguous (RFC 9112 §6.1, §6.3): the proxy
/// and the upstream must never disagree about where a request ends, or a
/// second request could be smuggled past the allowlist inside the first's
/// body. So: `Transfer-Encoding` and `Content-Length` together, several
/// `Content-Length`s that differ (or one that is not a decimal length),
/// `Transfer-Encoding` on HTTP/1.0 or not ending in `chunked` are refused.
fn check_framing(headers: &[(&str, &str)], version: &str) -> Result<(), String> {
    let mut length: Option<&str> = None;
    let mut chunked_last = None;
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("content-length") {
            for item in value.split(',').map(|v| v.trim_matches([' ', '\t'])) {
                if item.is_empty() || item.len() > 19 || !item.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!("bad Content-Length {value:?}"));
                }
                match length {
                    Some(seen) if seen.trim_start_matches('0') != item.trim_start_matches('0') => {
                        return Err("several differing Content-Length headers".into())
                    }
                    _ => length = Some(item),
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = value.rsplit(',').next().unwrap_or_default().trim_matches([' ', '\t']);
            chunked_last = Some(last.eq_ignore_ascii_case("chunked"));
        }
    }
    match (chunked_last, length) {
        (None, _) => Ok(()),
        (Some(_), Some(_)) => Err("both Transfer-Encoding and Content-Length (ambiguous framing)".into()),
        (Some(_), None) if version == "HTTP/1.0" => Err("Transfer-Encoding in an HTTP/1.0 request".into()),
        (Some(false), None) => Err("Transfer-Encoding that does not end in chunked".into()),
        (Some(true), None) => Ok(()),
    }
}

/// Parses a complete request head (as delimited by `head_end`).
pub(crate) fn parse(head: &[u8]) -> Result<Request, BadRequest> {
    let text = std::str::from_utf8(head).map_err(|_| BadRequest { method: "http", reason: "not UTF-8".into() })?;
    let mut lines = text.split('\n').map(|line| line.strip_suffix('\r').unwrap_or(line));
    let request_line = lines.next().unwrap_or_default();
    let method = if request_line.starts_with("CONNECT ") { "connect" } else { "http" };
    let bad = |reason: String| BadRequest { method, reason };
    if request_line.chars().any(char::is_control) {
        return Err(bad(format!("control character in the request line {request_line:?}")));
    }
    let parts: Vec<&str> = request_line.split(' ').collect();
    let [verb, target, version] = parts[..] else {
        return Err(bad(format!("malformed request line {request_line:?}")));
    };
    if !is_token(verb) {
        return Err(bad(format!("malformed method {verb:?}")));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(bad(format!("unsupported version {version:?}")));
    }
    let mut headers = Vec::new();
    for line in lines.take_while(|line| !line.is_empty()) {
        if line.starts_with([' ', '\t']) {
            return Err(bad("obsolete header line folding".into()));
        }
        let (name, value) = line.split_once(':').ok_or_else(|| bad(format!("header without `:`: {line:?}")))?;
        let value = value.trim_matches([' ', '\t']);
        if !is_token(name) || value.chars().any(|c| c.is_control() && c != '\t') {
            return Err(bad(format!("malformed header {name:?}")));
        }
        headers.push((name, value));
    }
    check_framing(&headers, version).map_err(bad)?;
    if verb == "CONNECT" {
        let (host, port) = split_authority(target, None).map_err(bad)?;
        return Ok(Request::Connect { host, port });
    }
    let scheme_end = target.find("://").unwrap_or(0);
    let rest = match target.split_at(scheme_end) {
        (scheme, rest) if scheme.eq_ignore_ascii_case("http") => &rest[3..],
        (scheme, _) if scheme.eq_ignore_ascii_case("https") => {
            return Err(bad("an https:// URL must go through CONNECT".into()))
        }
        _ => return Err(bad(format!("not a proxy request (target {target:?}); this is an HTTP proxy"))),
    };
    let (authority, path) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    let path = path.split('#').next().unwrap_or_default();
    let (host, port) = split_authority(authority, Some(80)).map_err(bad)?;
    let path = match path.as_bytes().first() {
        None => "/".to_string(),
        Some(b'?') => format!("/{path}"),
        Some(_) => path.to_string(),
    };
    let mut out = format!("{verb} {path} {version}\r\nHost: {authority}\r\n");
    for (name, value) in headers.iter().filter(|(name, _)| !is_dropped(name)) {
        out.push_str(name);
        out.push_str(": ");
        out.push_str(value);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    Ok(Request::Http { host, port, head: out.into_bytes() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(head: &str) -> String {
        parse(head.as_bytes()).expect_err(head).reason
    }

    #[test]
    fn the_head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nbody", 0), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nbody", 0), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n", 0), None);
        // Resuming just past a split terminator still finds it.
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\n", 17), Some(18));
    }

    #[test]
    fn connect_targets() {
        let connect = |t: &str| parse(format!("CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n").as_bytes());
        assert_eq!(connect("api.example.com:443"), Ok(Request::Connect { host: "api.example.com".into(), port: 443 }));
        assert_eq!(connect("[::1]:8080"), Ok(Request::Connect { host: "::1".into(), port: 8080 }));
        for bad in ["api.example.com", "api.example.com:0", "a:99999", "a:-1", "::1:443", ":443", "u@a:443", "[::1]x"] {
            let err = connect(bad).expect_err(bad);
            assert_eq!(err.method, "connect", "{bad}");
        }
    }

    #[test]
    fn absolute_form_is_rewritten_to_origin_form() {
        let head = "POST http://Example.com:8080/x/y?q=1#frag HTTP/1.1\r\nHost: evil.com\r\nProxy-Authorization: Basic eA==\r\n\
                    Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nKeep-Alive: 5\r\nContent-Length: 2\r\nX-A:  v \r\n\r\n";
        let Ok(Request::Http { host, port, head }) = parse(head.as_bytes()) else { panic!("parsed") };
        assert_eq!((host.as_str(), port), ("Example.com", 8080));
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST /x/y?q=1 HTTP/1.1\r\nHost: Example.com:8080\r\nContent-Length: 2\r\nX-A: v\r\nConnection: close\r\n\r\n"
        );
        let Ok(Request::Http { port, head, .. }) = parse(b"GET HTTP://a.example?x HTTP/1.0\n\n") else { panic!() };
        assert_eq!(port, 80);
        assert_eq!(head, b"GET /?x HTTP/1.0\r\nHost: a.example\r\nConnection: close\r\n\r\n");
    }

    #[test]
    fn everything_else_is_a_bad_request() {
        assert!(reason("GET /x HTTP/1.1\r\n\r\n").starts_with("not a proxy request"));
        assert!(reason("GET https://a.com/ HTTP/1.1\r\n\r\n").contains("CONNECT"));
        assert!(reason("GET ftp://a.com/ HTTP/1.1\r\n\r\n").starts_with("not a proxy request"));
        assert!(reason("hello\r\n\r\n").starts_with("malformed request line"));
        assert!(reason("GET  http://a.com/ HTTP/1.1\r\n\r\n").starts_with("malformed request line"));
        assert!(reason("GET http://a.com/x\ty HTTP/1.1\r\n\r\n").starts_with("control character"));
        assert!(reason("GET http://a.com/x\ry HTTP/1.1\r\n\r\n").starts_with("control character"));
        assert!(reason("GET http://a.com/ HTTP/2\r\n\r\n").starts_with("unsupported version"));
        assert!(reason("G(T http://a.com/ HTTP/1.1\r\n\r\n").starts_with("malformed method"));
        assert!(reason("GET http://a.com/ HTTP/1.1\r\nA: b\r\n c\r\n\r\n").contains("folding"));
        assert!(reason("GET http://a.com/ HTTP/1.1\r\nA b\r\n\r\n").starts_with("header without"));
        assert!(reason("GET http://a.com/ HTTP/1.1\r\nA : b\r\n\r\n").starts_with("malformed header"));
        assert!(reason("GET http://a.com/ HTTP/1.1\r\nA: b\rc\r\n\r\n").starts_with("malformed header"));
        assert!(reason("GET http:// HTTP/1.1\r\n\r\n").contains("empty host"));
        assert!(reason("GET http://u:p@a.com/ HTTP/1.1\r\n\r\n").contains("credentials"));
        assert_eq!(parse(b"GET http://a.com/ HTTP/1.1\r\nA: \xff\r\n\r\n").unwrap_err().reason, "not UTF-8");
        assert_eq!(parse(b"\r\n\r\n").unwrap_err().method, "http");
    }

    #[test]
    fn ambiguous_framing_is_a_bad_request() {
        let get = |headers: &str| parse(format!("POST http://a.com/ HTTP/1.1\r\n{headers}\r\n").as_bytes());
        for headers in [
            "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
            "content-length: 5\r\ntransfer-encoding: chunked\r\n",
            "Content-Length: 5\r\nContent-Length: 6\r\n",
            "Content-Length: 5, 6\r\n",
            "Content-Length: -1\r\n",
            "Content-Length: 0x10\r\n",
            "Content-Length: \r\n",
            "Transfer-Encoding: gzip\r\n",
            "Transfer-Encoding: chunked, gzip\r\n",
        ] {
            assert!(get(headers).is_err(), "{headers:?} is refused");
        }
        assert!(get("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n").unwrap_err().reason.contains("both"));
        let connect = "CONNECT a.com:443 HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(parse(connect.as_bytes()).unwrap_err().method, "connect");
        let te_10 = parse(b"POST http://a.com/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(te_10.unwrap_err().reason.contains("HTTP/1.0"));
        for fine in ["Content-Length: 5\r\nContent-Length: 5\r\n", "Transfer-Encoding: gzip, chunked\r\n", ""] {
            assert!(get(fine).is_ok(), "{fine:?} is unambiguous");
        }
    }

    /// An Anthropic-like key (108 characters), and a value with a control
    /// character (only its `{:?}` form can be found once quoted).
    const KEY: &str =
        "sk-ant-api03-PtYgjmUhBel31iEl2hpChYgCfrL1spNxnyVmihA_2O76UMFxFkM_R5Kjp1vRt-1fjORS_6ilI8ihN5KXSc7Tvo_hBKqFYAA";
    const TAB_KEY: &str = "tab\tsecret-0123456789abcdef";

    /// `reason` scrubbed of both keys as the daemon scrubs an egress
    /// reason (whole, then cut to 1,024 characters); fails if any 8
    /// characters of either key, plain or `{:?}`-escaped, are left.
    fn scrubbed(reason: &str) -> String {
        let mut scrubber = crate::credentials::Scrubber::default();
        scrubber.add("anthropic", KEY);
        scrubber.add("tab", TAB_KEY);
        let out = scrubber.scrub_within(reason, 1024);
        let lower = out.to_ascii_lowercase();
        for key in [KEY.to_string(), format!("{TAB_KEY:?}"), TAB_KEY.to_string()] {
            let key = key.trim_matches('"').to_ascii_lowercase();
            for i in 0..=key.len() - 8 {
                assert!(!lower.contains(&key[i..i + 8]), "{:?} of a key is left in {out:?}", &key[i..i + 8]);
            }
        }
        out
    }

    /// Every reason that quotes the request quotes the text whole and
    /// escaped (`{:?}`), never cut nor with control characters replaced
    /// first: a credential in it, cut, keeps a prefix no scrubber pattern
    /// matches, and replaced, is in neither its plain nor its escaped form.
    #[test]
    fn request_text_in_a_reason_is_quoted_whole_so_the_daemon_can_scrub_it() {
        // The key past the start, the text past 100 characters.
        let long = format!("xxxxxx{KEY}yyyyyy");
        assert_eq!(long.len(), 120);
        let open = format!("{long}(");
        let tab = format!("x{TAB_KEY}");
        let tab_open = format!("{tab}(");
        let line_with_tab = format!("GET http://a.com/{long}?{tab} HTTP/1.1");
        let line_with_tab_key = format!("GET http://a.com/{tab} HTTP/1.1");
        let cases = [
            (format!("CONNECT a.com:{long} HTTP/1.1\r\n\r\n"), format!("bad port {long:?}")),
            (format!("GET http://a.com:{long}/ HTTP/1.1\r\n\r\n"), format!("bad port {long:?}")),
            (
                format!("POST http://a.com/ HTTP/1.1\r\nContent-Length: {long}\r\n\r\n"),
                format!("bad Content-Length {long:?}"),
            ),
            (
                format!("POST http://a.com/ HTTP/1.1\r\nContent-Length: {tab}\r\n\r\n"),
                format!("bad Content-Length {tab:?}"),
            ),
            (format!("{line_with_tab}\r\n\r\n"), format!("control character in the request line {line_with_tab:?}")),
            (
                format!("{line_with_tab_key}\r\n\r\n"),
                format!("control character in the request line {line_with_tab_key:?}"),
            ),
            (format!("{open}\r\n\r\n"), format!("malformed request line {open:?}")),
            (format!("{open} http://a.com/ HTTP/1.1\r\n\r\n"), format!("malformed method {open:?}")),
            (format!("GET http://a.com/ {long}\r\n\r\n"), format!("unsupported version {long:?}")),
            (format!("GET http://a.com/ HTTP/1.1\r\n{long}\r\n\r\n"), format!("header without `:`: {long:?}")),
            (format!("GET http://a.com/ HTTP/1.1\r\n{tab}\r\n\r\n"), format!("header without `:`: {tab:?}")),
            (format!("GET http://a.com/ HTTP/1.1\r\n{open}: v\r\n\r\n"), format!("malformed header {open:?}")),
            (format!("GET http://a.com/ HTTP/1.1\r\n{tab_open}: v\r\n\r\n"), format!("malformed header {tab_open:?}")),
            (
                format!("GET {long} HTTP/1.1\r\n\r\n"),
                format!("not a proxy request (target {long:?}); this is an HTTP proxy"),
            ),
        ];
        for (head, expected) in cases {
            let reason = reason(&head);
            assert_eq!(reason, expected, "{head:?}");
            assert!(scrubbed(&reason).contains("[REDACTED:"), "{head:?}");
        }
        // A control character never reaches the port through `parse` (the
        // request line refuses it), but `split_authority` quotes it escaped.
        let reason = split_authority(&format!("a.com:{tab}"), None).unwrap_err();
        assert_eq!(reason, format!("bad port {tab:?}"));
        assert!(scrubbed(&reason).contains("[REDACTED:tab]"), "{reason}");
    }
}
