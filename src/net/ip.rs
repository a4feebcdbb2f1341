//! Which addresses are not "the public internet", and which belong to this
//! host. A name rule (`api.example.com`, `*.github.com`, `*`) only ever
//! reaches public unicast addresses: anything else (loopback, private,
//! link-local incl. cloud metadata, CGNAT, multicast, documentation and
//! reserved ranges, and every IPv6 form that embeds such an IPv4 address) is
//! refused unless a rule names that exact `ip:port`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Special-purpose IPv4 ranges (IANA registry + RFC 6890 family), first match wins.
const V4_SPECIAL: &[(u32, u8, &str)] = &[
    (0x0000_0000, 8, "unspecified (0.0.0.0/8)"),
    (0x0A00_0000, 8, "private (10.0.0.0/8)"),
    (0x6440_0000, 10, "shared CGNAT (100.64.0.0/10)"),
    (0x7F00_0000, 8, "loopback (127.0.0.0/8)"),
    (0xA9FE_0000, 16, "link-local (169.254.0.0/16)"),
    (0xAC10_0000, 12, "private (172.16.0.0/12)"),
    (0xC000_0000, 24, "IETF protocol assignment (192.0.0.0/24)"),
    (0xC000_0200, 24, "documentation (192.0.2.0/24)"),
    (0xC058_6300, 24, "6to4 relay anycast (192.88.99.0/24)"),
    (0xC0A8_0000, 16, "private (192.168.0.0/16)"),
    (0xC612_0000, 15, "benchmarking (198.18.0.0/15)"),
    (0xC633_6400, 24, "documentation (198.51.100.0/24)"),
    (0xCB00_7100, 24, "documentation (203.0.113.0/24)"),
    (0xE000_0000, 4, "multicast (224.0.0.0/4)"),
    (0xFFFF_FFFF, 32, "broadcast (255.255.255.255)"),
    (0xF000_0000, 4, "reserved (240.0.0.0/4)"),
];

/// NAT64 well-known prefix: the low 32 bits are an IPv4 address, judged as such.
const NAT64: (u128, u8) = (0x0064_ff9b_0000_0000_0000_0000_0000_0000, 96);

/// Special-purpose IPv6 ranges, first match wins. IPv4-mapped addresses are
/// turned into IPv4 before this table is consulted.
const V6_SPECIAL: &[(u128, u8, &str)] = &[
    (0, 128, "unspecified (::)"),
    (1, 128, "loopback (::1)"),
    (0, 96, "IPv4-compatible (::/96)"),
    (0xffff_0000_0000_0000, 96, "IPv4-translated (::ffff:0:0:0/96)"),
    (0x0064_ff9b_0001_0000_0000_0000_0000_0000, 48, "local-use NAT64 (64:ff9b:1::/48)"),
    (0x0100_0000_0000_0000_0000_0000_0000_0000, 64, "discard-only (100::/64)"),
    (0x2001_0db8_0000_0000_0000_0000_0000_0000, 32, "documentation (2001:db8::/32)"),
    (0x2001_0000_0000_0000_0000_0000_0000_0000, 23, "IETF protocol assignment incl. Teredo (2001::/23)"),
    (0x2002_0000_0000_0000_0000_0000_0000_0000, 16, "6to4 (2002::/16)"),
    (0x3fff_0000_0000_0000_0000_0000_0000_0000, 20, "documentation (3fff::/20)"),
    (0xfc00_0000_0000_0000_0000_0000_0000_0000, 7, "unique local (fc00::/7)"),
    (0xfe80_0000_0000_0000_0000_0000_0000_0000, 10, "link-local (fe80::/10)"),
    (0xfec0_0000_0000_0000_0000_0000_0000_0000, 10, "site-local (fec0::/10)"),
    (0xff00_0000_0000_0000_0000_0000_0000_0000, 8, "multicast (ff00::/8)"),
    // Only 2000::/3 is allocated as global unicast; the rest is reserved.
    (0x0000_0000_0000_0000_0000_0000_0000_0000, 0, "not global unicast (outside 2000::/3)"),
];

fn in_v4(addr: u32, net: u32, len: u8) -> bool {
    len == 0 || (addr ^ net) >> (32 - u32::from(len)) == 0
}

fn in_v6(addr: u128, net: u128, len: u8) -> bool {
    len == 0 || (addr ^ net) >> (128 - u32::from(len)) == 0
}

/// Why `ip` is not a public unicast address (e.g. `"loopback (127.0.0.0/8)"`),
/// or `None` if it is one. IPv4-mapped (`::ffff:a.b.c.d`) and NAT64
/// (`64:ff9b::a.b.c.d`) forms are judged by the IPv4 address they carry.
pub fn special_class(ip: IpAddr) -> Option<&'static str> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4_class(v4),
        IpAddr::V6(v6) => v6_class(v6),
    }
}

fn v4_class(ip: Ipv4Addr) -> Option<&'static str> {
    let addr = u32::from(ip);
    V4_SPECIAL.iter().find(|(net, len, _)| in_v4(addr, *net, *len)).map(|(_, _, class)| *class)
}

fn v6_class(ip: Ipv6Addr) -> Option<&'static str> {
    let addr = u128::from(ip);
    if in_v6(addr, NAT64.0, NAT64.1) {
        // Truncation is the point: the low 32 bits are the embedded IPv4 address.
        return v4_class(Ipv4Addr::from(addr as u32));
    }
    if in_v6(addr, 0x2000_0000_0000_0000_0000_0000_0000_0000, 3) {
        // Global unicast, minus the special blocks carved out of it.
        return V6_SPECIAL
            .iter()
            .filter(|(net, _, _)| in_v6(*net, 0x2000_0000_0000_0000_0000_0000_0000_0000, 3))
            .find(|(net, len, _)| in_v6(addr, *net, *len))
            .map(|(_, _, class)| *class);
    }
    V6_SPECIAL.iter().find(|(net, len, _)| in_v6(addr, *net, *len)).map(|(_, _, class)| *class)
}

/// The addresses of this host's interfaces (`getifaddrs(3)`), IPv4-mapped
/// forms folded to IPv4, deduplicated. A name rule must not reach the
/// daemon's host through one of its own public addresses. Empty if the call
/// fails (then only the range checks protect the host; logged).
pub fn host_addresses() -> Vec<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs only writes a list pointer into `head`, a valid
    // out-parameter; on failure it returns -1 and leaves nothing to free.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "getifaddrs failed; host addresses unknown");
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, which stays
        // valid and unmodified until the freeifaddrs call below.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr at least as
            // large as its family's struct; read_unaligned makes no alignment
            // assumption, and the family field tells which struct it is.
            let ip = unsafe {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = std::ptr::read_unaligned(ifa.ifa_addr as *const libc::sockaddr_in);
                        Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
                    }
                    libc::AF_INET6 => {
                        let sin6 = std::ptr::read_unaligned(ifa.ifa_addr as *const libc::sockaddr_in6);
                        Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                    }
                    _ => None,
                }
            };
            if let Some(ip) = ip.map(|ip| ip.to_canonical()) {
                if !out.contains(&ip) {
                    out.push(ip);
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once;
    // no reference into the list outlives this point.
    unsafe { libc::freeifaddrs(head) };
    out
}
