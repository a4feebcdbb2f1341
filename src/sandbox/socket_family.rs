//! Which socket address families a `linux_bwrap` sandbox may open: the
//! seccomp rules for `socket(2)` and `socketpair(2)`.
//!
//! An allowlist, because the dangerous families are the ones the network
//! namespace does not cover: `AF_VSOCK` talks to the hypervisor and other
//! VMs whatever namespace the socket is made in, `AF_PACKET`, `AF_BLUETOOTH`,
//! `AF_CAN`, `AF_XDP`, `AF_ALG` (kernel crypto) and the rest are kernel
//! surface a coding agent never needs. Allowed:
//!
//! - `AF_UNIX`: local IPC (git, python's multiprocessing, language servers);
//!   abstract names are per network namespace.
//! - `AF_INET`, `AF_INET6`: the sandbox's own network namespace, which has
//!   only loopback (network off) or the daemon's proxy (network on).
//! - `AF_NETLINK` with protocol `NETLINK_ROUTE` only: `getifaddrs(3)` (Node's
//!   `os.networkInterfaces`, libuv), glibc's `getaddrinfo` with
//!   `AI_ADDRCONFIG` and `if_nameindex` read the interface list through it.
//!   It shows only the sandbox's own namespace, and changing anything needs
//!   CAP_NET_ADMIN, which the sandbox lacks. Other netlink protocols
//!   (audit, uevents, netfilter, xfrm, ...) are refused.
//!
//! Everything else fails with `EPERM` (the filter has one errno for all its
//! rules, see `seccomp.rs`), before any connect is attempted.

use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

/// The families allowed with any protocol.
pub const ALLOWED_FAMILIES: &[(u64, &str)] =
    &[(libc::AF_UNIX as u64, "AF_UNIX"), (libc::AF_INET as u64, "AF_INET"), (libc::AF_INET6 as u64, "AF_INET6")];

/// `AF_NETLINK`, allowed only with [`NETLINK_ROUTE`].
pub const NETLINK: u64 = libc::AF_NETLINK as u64;
pub const NETLINK_ROUTE: u64 = libc::NETLINK_ROUTE as u64;

/// The deny rules for `socket` and `socketpair` (the family is argument 0,
/// the protocol argument 2, both `int` in the kernel: compared as Dword so
/// garbage in the upper half changes nothing). Denied when either rule
/// matches:
/// 1. the family is none of the allowed ones and not `AF_NETLINK`;
/// 2. the family is `AF_NETLINK` and the protocol is not `NETLINK_ROUTE`.
pub fn deny_rules() -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
    let cond = |arg, op, value| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value);
    let mut other_family: Vec<SeccompCondition> =
        ALLOWED_FAMILIES.iter().map(|&(family, _)| cond(0, SeccompCmpOp::Ne, family)).collect::<Result<_, _>>()?;
    other_family.push(cond(0, SeccompCmpOp::Ne, NETLINK)?);
    let other_netlink = vec![cond(0, SeccompCmpOp::Eq, NETLINK)?, cond(2, SeccompCmpOp::Ne, NETLINK_ROUTE)?];
    Ok(vec![SeccompRule::new(other_family)?, SeccompRule::new(other_netlink)?])
}
