//! The seccomp filter bwrap loads with `--seccomp FD` for every `linux_bwrap` sandbox.
//!
//! A denylist (default: allow) in the tradition of Docker's default profile
//! (moby `profiles/seccomp/default.json`) and Flatpak's (`setup_seccomp` in
//! `common/flatpak-run.c`). bwrap's namespaces already confine the agent; this
//! filter removes the kernel surface a coding agent never needs, above all the
//! ways back out of those namespaces (nested user namespaces, mounts) and into
//! the terminal it shares with its parent (TIOCSTI).
//!
//! The program has two parts, concatenated (classic BPF jumps are relative and
//! forward-only, so both parts keep their meaning):
//!
//! 1. A hand-written prologue: kill the process unless `seccomp_data.arch` is
//!    this build's audit arch (i386 on x86_64, AArch32 on aarch64); on x86_64,
//!    kill x32 calls too (they carry `AUDIT_ARCH_X86_64` but set
//!    `__X32_SYSCALL_BIT`, so no x86_64 rule would match them); answer `clone3`
//!    with `ENOSYS`. It exists because seccompiler has one match action per
//!    filter and `clone3` needs a second one.
//! 2. seccompiler's program for the EPERM rules (it repeats the arch check).
#![cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_imports, dead_code))]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule,
};
use sha2::{Digest, Sha256};

/// A compiled classic-BPF seccomp program in the exact byte layout bwrap's
/// `--seccomp FD` reads (an array of `struct sock_filter`, native endian, 8 bytes each).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeccompFilter {
    bytes: Vec<u8>,
    digest: String,
}

impl SeccompFilter {
    /// The program, ready to be written to the fd handed to `bwrap --seccomp`.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// "sha256:<hex>" of bytes(); goes into the sandbox's enforcement receipt.
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

/// Why the sandbox's seccomp filter could not be built; bwrap sandboxes
/// are refused rather than run without it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SeccompError {
    /// The daemon runs on an architecture the filter is not built for.
    #[error(
        "no seccomp filter for the {0} architecture (corral builds it for x86_64 and aarch64 only); \
         refusing to run bwrap sandboxes unconfined"
    )]
    UnsupportedArch(&'static str),
    /// A syscall in the deny table has no number on this architecture.
    #[error("syscall {0:?} in the seccomp deny table has no number on this architecture")]
    UnknownSyscall(&'static str),
    /// seccompiler could not compile the filter.
    #[error("compiling the seccomp filter failed: {0}")]
    Compile(String),
}

impl From<seccompiler::BackendError> for SeccompError {
    fn from(e: seccompiler::BackendError) -> Self {
        SeccompError::Compile(e.to_string())
    }
}

/// The documented deny table: (syscall name, why it is denied). Denied calls
/// fail with `EPERM`, except `clone3` (`ENOSYS`). A few names exist only on
/// x86_64 (see their reasons); on aarch64 there is nothing to deny for them.
///
/// Deliberately allowed (each was weighed against Docker and Flatpak):
/// - `ptrace`, `process_vm_readv`/`process_vm_writev`, `pidfd_getfd`, `kcmp`:
///   all are gated by ptrace access checks, and the sandbox has its own pid
///   namespace and its own host uid, so they reach only the sandbox's own tree;
///   agents' debuggers and profilers need them. (Docker gates them on
///   CAP_SYS_PTRACE; Flatpak denies ptrace outside `--devel`.)
/// - `chroot`: needs CAP_SYS_CHROOT, which the sandbox lacks, and cannot cross
///   bwrap's mount namespace anyway (Flatpak denies it; Docker allows it to
///   containers holding CAP_SYS_CHROOT).
/// - `adjtimex`, `clock_adjtime`: glibc's `adjtimex()` and `ntp_gettime()`
///   issue `clock_adjtime(CLOCK_REALTIME, {modes=0})` (seen with strace on
///   glibc 2.36) to read clock state. The mode sits in a struct the filter
///   cannot read, and any change needs CAP_SYS_TIME in the initial user
///   namespace, which the sandbox never has. `settimeofday`/`clock_settime`
///   only write, so they are denied.
/// - `modify_ldt` and the NUMA calls (`mbind`, `set_mempolicy`,
///   `migrate_pages`, `move_pages`): Flatpak denies them; runtimes (Wine,
///   NUMA-aware JVMs) use them, and they do not cross a namespace boundary.
/// - `umount`: the one-argument form exists on neither x86_64 nor aarch64.
pub const DENIED: &[(&str, &str)] = &[
    ("unshare", "only with CLONE_NEWUSER: a nested user namespace grants every capability inside it and reopens the mount and namespace surface bwrap removed (Flatpak denies unshare outright; Docker gates it on CAP_SYS_ADMIN)"),
    ("clone", "only with CLONE_NEWUSER in the flags (argument 0 on x86_64 and aarch64): same reason as unshare (Flatpak, same masked rule; Docker)"),
    ("clone3", "answers ENOSYS, not EPERM: its flags sit in a struct seccomp cannot read, so glibc must fall back to clone(2), whose flags the filter checks (Flatpak, since CVE-2021-41133)"),
    ("setns", "joins another namespace: a way out of the sandbox's own (Flatpak; Docker: CAP_SYS_ADMIN)"),
    ("mount", "mount surface, usable by anyone holding a nested user namespace (Flatpak; Docker: CAP_SYS_ADMIN)"),
    ("umount2", "mount surface: could uncover what bwrap's mounts hide (Flatpak; Docker)"),
    ("pivot_root", "mount surface (Flatpak; Docker)"),
    ("fsopen", "new mount API (Flatpak, since CVE-2021-41133, answers ENOSYS; corral answers EPERM like the rest of the mount surface)"),
    ("fsconfig", "new mount API (Flatpak)"),
    ("fsmount", "new mount API (Flatpak)"),
    ("fspick", "new mount API (Flatpak)"),
    ("move_mount", "new mount API (Flatpak)"),
    ("open_tree", "new mount API: clones mount trees (Flatpak)"),
    ("open_tree_attr", "new mount API (Linux 6.15): open_tree that also changes the clone's mount flags"),
    ("mount_setattr", "new mount API: changes mount flags such as read-only (Flatpak)"),
    ("kexec_load", "loads a new kernel for later execution (Docker)"),
    ("kexec_file_load", "loads a new kernel for later execution (Docker)"),
    ("init_module", "loads kernel modules (Docker)"),
    ("finit_module", "loads kernel modules (Docker)"),
    ("delete_module", "unloads kernel modules (Docker)"),
    ("bpf", "loads BPF programs into the kernel, a steady source of kernel bugs (Docker)"),
    ("perf_event_open", "tracing and profiling that can leak host information; large kernel surface (Docker; Flatpak outside --devel)"),
    ("userfaultfd", "user-space page-fault handling, a staple for widening kernel race windows in exploits (Docker)"),
    ("io_uring_setup", "io_uring: its submitted operations bypass per-syscall seccomp checks, and it is a leading source of kernel CVEs (Docker's profile dropped it)"),
    ("io_uring_enter", "io_uring (see io_uring_setup)"),
    ("io_uring_register", "io_uring (see io_uring_setup)"),
    ("keyctl", "the kernel keyring is not namespaced (Docker; Flatpak)"),
    ("add_key", "the kernel keyring is not namespaced (Docker; Flatpak)"),
    ("request_key", "the kernel keyring is not namespaced (Docker; Flatpak)"),
    ("open_by_handle_at", "opens files by handle, bypassing the mount tree: the 'shocker' container breakout (Docker)"),
    ("name_to_handle_at", "the handle-producing half of open_by_handle_at (Docker)"),
    ("acct", "process accounting is host-wide (Docker: CAP_SYS_PACCT; Flatpak)"),
    ("swapon", "host swap configuration (Docker: CAP_SYS_ADMIN)"),
    ("swapoff", "host swap configuration (Docker: CAP_SYS_ADMIN)"),
    ("reboot", "reboots the host or loads a kexec kernel (Docker: CAP_SYS_BOOT)"),
    ("syslog", "reads the kernel log buffer: host information and kernel addresses (Flatpak: 'block dmesg'; Docker: CAP_SYSLOG)"),
    ("settimeofday", "the wall clock is not namespaced (Docker: CAP_SYS_TIME)"),
    ("clock_settime", "the wall clock is not namespaced (Docker: CAP_SYS_TIME)"),
    ("lookup_dcookie", "profiling call that can leak host information (Docker)"),
    ("quotactl", "host disk quotas (Docker; Flatpak)"),
    ("quotactl_fd", "host disk quotas (see quotactl)"),
    ("iopl", "x86_64 only: raises the I/O privilege level (Docker: CAP_SYS_RAWIO)"),
    ("ioperm", "x86_64 only: grants raw I/O port access (Docker: CAP_SYS_RAWIO)"),
    ("uselib", "x86_64 only: obsolete a.out library loader (Docker; Flatpak)"),
    ("vhangup", "hangs up the terminal (Docker: CAP_SYS_TTY_CONFIG)"),
    ("personality", "unless the argument is PER_LINUX (0) or 0xffffffff (query): other personas (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, ...) weaken exploit mitigations. Docker also allows 0x8, 0x20000 and 0x20008; Flatpak allows only PER_LINUX. gdb's disable-randomization then warns and goes on"),
    ("socket", "unless the family is AF_UNIX, AF_INET, AF_INET6, or AF_NETLINK with NETLINK_ROUTE: AF_VSOCK reaches the hypervisor past the network namespace, AF_PACKET, AF_ALG and the rest are kernel surface an agent never needs (see socket_family.rs)"),
    ("socketpair", "the same families as socket (only AF_UNIX makes pairs, but the rule is the same)"),
    ("ioctl", "only with request TIOCSTI (0x5412) or TIOCLINUX (0x541C), compared on the 32-bit request the kernel reads: they inject keystrokes into, or drive, the terminal the sandbox shares with its parent (Flatpak: CVE-2017-5226, CVE-2019-10063, CVE-2023-28100)"),
];

/// The sandbox filter for the architecture this binary was built for (x86_64 and aarch64;
/// other arches: Err with a clear reason so the daemon can refuse bwrap profiles).
/// Built once; every call returns the same bytes.
pub fn sandbox_filter() -> Result<SeccompFilter, SeccompError> {
    static FILTER: OnceLock<Result<SeccompFilter, SeccompError>> = OnceLock::new();
    FILTER.get_or_init(build).clone()
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn build() -> Result<SeccompFilter, SeccompError> {
    Err(SeccompError::UnsupportedArch(std::env::consts::ARCH))
}

#[cfg(target_arch = "x86_64")]
mod arch {
    pub const TARGET: seccompiler::TargetArch = seccompiler::TargetArch::x86_64;
    /// EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
    pub const AUDIT_ARCH: u32 = 0xC000_003E;
}

#[cfg(target_arch = "aarch64")]
mod arch {
    pub const TARGET: seccompiler::TargetArch = seccompiler::TargetArch::aarch64;
    /// EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
    pub const AUDIT_ARCH: u32 = 0xC000_00B7;
}

/// Deny-table names that only x86_64 has.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const X86_64_ONLY: &[&str] = &["iopl", "ioperm", "uselib"];

// Classic BPF opcodes and `struct seccomp_data` offsets (linux/filter.h, linux/seccomp.h).
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
/// The kernel refuses longer programs (BPF_MAXINSNS).
const MAX_INSNS: usize = 4096;

const _: () = assert!(std::mem::size_of::<libc::sock_filter>() == 8);

/// `open_tree_attr(2)`, Linux 6.15.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const OPEN_TREE_ATTR: i64 = 467;

/// The number of `name` on this architecture; `None` for a name it does not have.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn syscall_nr(name: &str) -> Option<i64> {
    use libc::*;
    Some(match name {
        "unshare" => SYS_unshare,
        "clone" => SYS_clone,
        "clone3" => SYS_clone3,
        "setns" => SYS_setns,
        "mount" => SYS_mount,
        "umount2" => SYS_umount2,
        "pivot_root" => SYS_pivot_root,
        "fsopen" => SYS_fsopen,
        "fsconfig" => SYS_fsconfig,
        "fsmount" => SYS_fsmount,
        "fspick" => SYS_fspick,
        "move_mount" => SYS_move_mount,
        "open_tree" => SYS_open_tree,
        // Not in libc yet; 467 on both architectures (the shared numbering
        // every architecture uses since Linux 5.1).
        "open_tree_attr" => OPEN_TREE_ATTR,
        "mount_setattr" => SYS_mount_setattr,
        "kexec_load" => SYS_kexec_load,
        "kexec_file_load" => SYS_kexec_file_load,
        "init_module" => SYS_init_module,
        "finit_module" => SYS_finit_module,
        "delete_module" => SYS_delete_module,
        "bpf" => SYS_bpf,
        "perf_event_open" => SYS_perf_event_open,
        "userfaultfd" => SYS_userfaultfd,
        "io_uring_setup" => SYS_io_uring_setup,
        "io_uring_enter" => SYS_io_uring_enter,
        "io_uring_register" => SYS_io_uring_register,
        "keyctl" => SYS_keyctl,
        "add_key" => SYS_add_key,
        "request_key" => SYS_request_key,
        "open_by_handle_at" => SYS_open_by_handle_at,
        "name_to_handle_at" => SYS_name_to_handle_at,
        "acct" => SYS_acct,
        "swapon" => SYS_swapon,
        "swapoff" => SYS_swapoff,
        "reboot" => SYS_reboot,
        "syslog" => SYS_syslog,
        "settimeofday" => SYS_settimeofday,
        "clock_settime" => SYS_clock_settime,
        "lookup_dcookie" => SYS_lookup_dcookie,
        "quotactl" => SYS_quotactl,
        "quotactl_fd" => SYS_quotactl_fd,
        #[cfg(target_arch = "x86_64")]
        "iopl" => SYS_iopl,
        #[cfg(target_arch = "x86_64")]
        "ioperm" => SYS_ioperm,
        #[cfg(target_arch = "x86_64")]
        "uselib" => SYS_uselib,
        "vhangup" => SYS_vhangup,
        "personality" => SYS_personality,
        "ioctl" => SYS_ioctl,
        "socket" => SYS_socket,
        "socketpair" => SYS_socketpair,
        _ => return None,
    })
}

/// The EPERM rules of DENIED, keyed by syscall number. An empty rule list
/// denies the call outright; otherwise the call is denied when any rule (an
/// AND of conditions) matches. `clone3` is absent: the prologue answers it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut map = BTreeMap::new();
    for &(name, _) in DENIED {
        if name == "clone3" {
            continue;
        }
        let nr = match syscall_nr(name) {
            Some(nr) => nr,
            None if !cfg!(target_arch = "x86_64") && X86_64_ONLY.contains(&name) => continue,
            None => return Err(SeccompError::UnknownSyscall(name)),
        };
        map.insert(nr, arg_rules(name)?);
    }
    Ok(map)
}

/// The argument conditions under which `name` is denied (empty: always).
/// Every condition is Dword: these arguments are 32-bit in the kernel (or, for
/// clone, only their low 32 bits are read), so garbage in the upper half can
/// neither dodge a rule nor trip one.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn arg_rules(name: &str) -> Result<Vec<SeccompRule>, SeccompError> {
    use SeccompCmpOp::{Eq, MaskedEq, Ne};
    let cond = |arg, op, value| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value);
    let rule = |conds| SeccompRule::new(conds);
    let newuser = libc::CLONE_NEWUSER as u64;
    Ok(match name {
        // clone's flags are argument 0 on x86_64 and aarch64 (argument 1 only on s390/cris).
        "unshare" | "clone" => vec![rule(vec![cond(0, MaskedEq(newuser), newuser)?])?],
        // The request is argument 1, an `unsigned int` in the kernel.
        "ioctl" => [libc::TIOCSTI, libc::TIOCLINUX]
            .into_iter()
            // c_ulong on this target, c_int on others.
            .map(|req| {
                rule(vec![cond(
                    1,
                    Eq,
                    #[allow(clippy::unnecessary_cast)]
                    {
                        req as u64
                    },
                )?])
            })
            .collect::<Result<_, _>>()?,
        "personality" => vec![rule(vec![cond(0, Ne, 0)?, cond(0, Ne, 0xFFFF_FFFF)?])?],
        "socket" | "socketpair" => super::socket_family::deny_rules()?,
        _ => Vec::new(),
    })
}

/// Arch check, x32 kill (x86_64), clone3 → ENOSYS. Falls through to the next
/// part with the syscall number loaded.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn prologue() -> Vec<sock_filter> {
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let mut p = vec![
        ins(BPF_LD_W_ABS, 0, 0, DATA_ARCH),
        ins(BPF_JEQ_K, 1, 0, arch::AUDIT_ARCH),
        ins(BPF_RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        ins(BPF_LD_W_ABS, 0, 0, DATA_NR),
    ];
    // x32 numbers are nr | __X32_SYSCALL_BIT. Kill them all, except -1, which
    // tracers (strace --inject, rr) write to skip a call and the kernel answers ENOSYS.
    #[cfg(target_arch = "x86_64")]
    p.extend([
        ins(BPF_JGE_K, 0, 2, 0x4000_0000),
        ins(BPF_JEQ_K, 1, 0, u32::MAX),
        ins(BPF_RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
    ]);
    p.extend([
        ins(BPF_JEQ_K, 0, 1, libc::SYS_clone3 as u32),
        ins(BPF_RET_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
    ]);
    p
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn build() -> Result<SeccompFilter, SeccompError> {
    let filter = seccompiler::SeccompFilter::new(
        rules()?,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch::TARGET,
    )?;
    let body: BpfProgram = filter.try_into()?;
    let mut program = prologue();
    program.extend(body);
    if program.len() > MAX_INSNS {
        return Err(SeccompError::Compile(format!("{} instructions, the kernel takes {MAX_INSNS}", program.len())));
    }
    let mut bytes = Vec::with_capacity(program.len() * 8);
    for ins in &program {
        bytes.extend_from_slice(&ins.code.to_ne_bytes());
        bytes.extend_from_slice(&[ins.jt, ins.jf]);
        bytes.extend_from_slice(&ins.k.to_ne_bytes());
    }
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    Ok(SeccompFilter { bytes, digest })
}

#[cfg(all(test, any(target_arch = "x86_64", target_arch = "aarch64")))]
// libc's request and flag constants are c_ulong on one target, c_int on
// another: the casts stay.
#[allow(clippy::unnecessary_cast)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::io::{Seek, SeekFrom, Write};
    use std::os::fd::FromRawFd;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Command, Output};

    use super::*;
    use crate::sandbox::find_on_path;

    /// What the program returned, decoded so a failing assert reads well.
    #[derive(Debug, PartialEq, Eq)]
    enum Ret {
        Allow,
        Kill,
        Errno(i32),
        Other(u32),
    }
    use Ret::{Allow as ALLOW, Kill as KILL};
    const EPERM: Ret = Ret::Errno(libc::EPERM);
    const ENOSYS: Ret = Ret::Errno(libc::ENOSYS);
    /// A foreign ABI the kernel can report on this arch: i386 resp. AArch32.
    #[cfg(target_arch = "x86_64")]
    const COMPAT_ARCH: u32 = 0x4000_0003;
    #[cfg(target_arch = "aarch64")]
    const COMPAT_ARCH: u32 = 0x4000_0028;

    fn bytes() -> Vec<u8> {
        sandbox_filter().expect("filter builds on this arch").bytes().to_vec()
    }

    /// Runs the program on one `struct seccomp_data`, as the kernel would: a
    /// classic-BPF interpreter for exactly the opcodes the prologue and
    /// seccompiler emit; any other opcode, or running off the end, fails the test.
    fn run_on(bytes: &[u8], arch: u32, nr: i64, args: [u64; 6]) -> Ret {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&(nr as u32).to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
        }
        let prog: Vec<(u16, u8, u8, u32)> = bytes
            .chunks_exact(8)
            .map(|c| (u16::from_ne_bytes([c[0], c[1]]), c[2], c[3], u32::from_ne_bytes([c[4], c[5], c[6], c[7]])))
            .collect();
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let (code, jt, jf, k) = *prog.get(pc).unwrap_or_else(|| panic!("ran off the program at {pc}"));
            pc += 1;
            let taken = match code {
                0x20 => {
                    acc = u32::from_ne_bytes(data[k as usize..k as usize + 4].try_into().unwrap());
                    continue;
                }
                0x54 => {
                    acc &= k;
                    continue;
                }
                0x05 => {
                    pc += k as usize;
                    continue;
                }
                0x06 => {
                    return match k {
                        libc::SECCOMP_RET_ALLOW => ALLOW,
                        libc::SECCOMP_RET_KILL_PROCESS => KILL,
                        k if k & 0xFFFF_0000 == libc::SECCOMP_RET_ERRNO => Ret::Errno((k & 0xFFFF) as i32),
                        k => Ret::Other(k),
                    }
                }
                0x15 => acc == k,
                0x25 => acc > k,
                0x35 => acc >= k,
                _ => panic!("unexpected BPF opcode {code:#x} at {}", pc - 1),
            };
            pc += usize::from(if taken { jt } else { jf });
        }
    }

    fn run(nr: i64, args: [u64; 6]) -> Ret {
        run_on(&bytes(), arch::AUDIT_ARCH, nr, args)
    }

    fn nr(name: &str) -> i64 {
        syscall_nr(name).unwrap_or_else(|| panic!("{name} has no number here"))
    }

    #[test]
    fn rules_cover_exactly_the_deny_table() {
        let rules = rules().expect("rules");
        let mut compiled: BTreeSet<i64> = rules.keys().copied().collect();
        compiled.insert(libc::SYS_clone3);
        let mut documented = BTreeSet::new();
        for &(name, why) in DENIED {
            assert!(!why.is_empty(), "{name} has no reason");
            match syscall_nr(name) {
                Some(n) => assert!(documented.insert(n), "{name} listed twice"),
                None => assert!(
                    !cfg!(target_arch = "x86_64") && X86_64_ONLY.contains(&name),
                    "{name} has no number on this arch and is not marked x86_64-only"
                ),
            }
        }
        assert_eq!(compiled, documented);
        // Only these carry argument conditions; the rest are denied outright.
        let conditional: BTreeMap<i64, usize> =
            rules.iter().filter(|(_, r)| !r.is_empty()).map(|(n, r)| (*n, r.len())).collect();
        let expected = BTreeMap::from([
            (nr("unshare"), 1),
            (nr("clone"), 1),
            (nr("ioctl"), 2),
            (nr("personality"), 1),
            (nr("socket"), 2),
            (nr("socketpair"), 2),
        ]);
        assert_eq!(conditional, expected);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_64_numbers_are_the_kernel_abi() {
        let abi = [
            ("ioctl", 16),
            ("clone", 56),
            ("personality", 135),
            ("mount", 165),
            ("iopl", 172),
            ("unshare", 272),
            ("setns", 308),
            ("bpf", 321),
            ("io_uring_setup", 425),
            ("clone3", 435),
            ("mount_setattr", 442),
        ];
        for (name, n) in abi {
            assert_eq!(syscall_nr(name), Some(n), "{name}");
        }
    }

    #[test]
    fn bytes_and_digest_are_stable() {
        let a = build().expect("first build");
        let b = build().expect("second build");
        assert_eq!(a, b, "two builds differ");
        assert_eq!(sandbox_filter().unwrap(), a, "cached filter differs from a fresh build");
        assert!(!a.bytes().is_empty() && a.bytes().len() % 8 == 0, "{} bytes", a.bytes().len());
        assert!(a.bytes().len() / 8 <= MAX_INSNS);
        let hex = a.digest().strip_prefix("sha256:").expect("sha256: prefix");
        assert_eq!(hex.len(), 64);
        assert!(hex.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)), "{hex}");
        assert_eq!(a.digest(), format!("sha256:{}", hex::encode(Sha256::digest(a.bytes()))));
    }

    #[test]
    fn every_denied_call_is_denied_by_the_program() {
        let program = bytes();
        for &(name, _) in DENIED {
            let Some(n) = syscall_nr(name) else { continue };
            let args = match name {
                "unshare" | "clone" => [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0],
                "ioctl" => [0, libc::TIOCSTI as u64, 0, 0, 0, 0],
                "personality" => [8, 0, 0, 0, 0, 0],
                "socket" | "socketpair" => [libc::AF_VSOCK as u64, libc::SOCK_STREAM as u64, 0, 0, 0, 0],
                _ => [0; 6],
            };
            let want = if name == "clone3" { ENOSYS } else { EPERM };
            assert_eq!(run_on(&program, arch::AUDIT_ARCH, n, args), want, "{name}");
        }
        // libc has no constant for it: by number, so a table that loses
        // the name fails here.
        assert_eq!(run_on(&program, arch::AUDIT_ARCH, 467, [0; 6]), EPERM, "open_tree_attr (467)");
    }

    #[test]
    fn argument_conditions() {
        let newuser = libc::CLONE_NEWUSER as u64;
        let sigchld = libc::SIGCHLD as u64;
        let hi = 0xFFFF_FFFF_0000_0000u64;
        for name in ["unshare", "clone"] {
            assert_eq!(run(nr(name), [newuser | sigchld, 0, 0, 0, 0, 0]), EPERM, "{name} NEWUSER");
            assert_eq!(run(nr(name), [newuser | libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0]), EPERM, "{name}");
            assert_eq!(run(nr(name), [hi | newuser, 0, 0, 0, 0, 0]), EPERM, "{name} upper garbage");
            assert_eq!(run(nr(name), [sigchld, 0, 0, 0, 0, 0]), ALLOW, "{name} plain");
            assert_eq!(run(nr(name), [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0]), ALLOW, "{name} NEWNS");
        }
        let ioctl = nr("ioctl");
        for req in [libc::TIOCSTI as u64, libc::TIOCLINUX as u64] {
            assert_eq!(run(ioctl, [0, req, 0, 0, 0, 0]), EPERM, "{req:#x}");
            assert_eq!(run(ioctl, [0, hi | req, 0, 0, 0, 0]), EPERM, "{req:#x} with upper garbage");
        }
        assert_eq!(run(ioctl, [0, libc::TCGETS as u64, 0, 0, 0, 0]), ALLOW);
        assert_eq!(run(ioctl, [0, libc::FIONREAD as u64, 0, 0, 0, 0]), ALLOW);
        let pers = nr("personality");
        for ok in [0, 0xFFFF_FFFF, hi] {
            assert_eq!(run(pers, [ok, 0, 0, 0, 0, 0]), ALLOW, "personality({ok:#x})");
        }
        for bad in [0x8, 0x20000, 0x0040000, 0x0400000] {
            assert_eq!(run(pers, [bad, 0, 0, 0, 0, 0]), EPERM, "personality({bad:#x})");
        }
    }

    #[test]
    fn socket_families_are_an_allowlist() {
        use libc::{
            AF_ALG, AF_BLUETOOTH, AF_CAN, AF_INET, AF_INET6, AF_KEY, AF_NETLINK, AF_NFC, AF_PACKET, AF_RDS, AF_TIPC,
            AF_UNIX, AF_UNSPEC, AF_VSOCK, AF_XDP, NETLINK_AUDIT, NETLINK_GENERIC, NETLINK_KOBJECT_UEVENT,
            NETLINK_NETFILTER, NETLINK_ROUTE, NETLINK_XFRM, SOCK_CLOEXEC, SOCK_DGRAM, SOCK_NONBLOCK, SOCK_RAW,
            SOCK_STREAM,
        };
        let hi = 0xFFFF_FFFF_0000_0000u64;
        for name in ["socket", "socketpair"] {
            let n = nr(name);
            let call = |family: i32, ty: i32, proto: i32| run(n, [family as u64, ty as u64, proto as u64, 0, 0, 0]);
            for family in [AF_UNIX, AF_INET, AF_INET6] {
                for ty in [SOCK_STREAM, SOCK_DGRAM, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK] {
                    assert_eq!(call(family, ty, 0), ALLOW, "{name}({family}, {ty})");
                }
                assert_eq!(run(n, [hi | family as u64, SOCK_STREAM as u64, 0, 0, 0, 0]), ALLOW, "{name} upper bits");
            }
            assert_eq!(call(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE), ALLOW, "{name} NETLINK_ROUTE");
            assert_eq!(call(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_ROUTE), ALLOW, "{name} NETLINK_ROUTE");
            for proto in [NETLINK_AUDIT, NETLINK_KOBJECT_UEVENT, NETLINK_NETFILTER, NETLINK_XFRM, NETLINK_GENERIC] {
                assert_eq!(call(AF_NETLINK, SOCK_RAW, proto), EPERM, "{name} netlink protocol {proto}");
            }
            for family in [AF_VSOCK, AF_PACKET, AF_ALG, AF_BLUETOOTH, AF_CAN, AF_XDP, AF_KEY, AF_TIPC, AF_RDS, AF_NFC]
                .into_iter()
                .chain([AF_UNSPEC, 46, 1000, i32::MAX, -1])
            {
                assert_eq!(call(family, SOCK_STREAM, 0), EPERM, "{name}({family})");
                assert_eq!(call(family, SOCK_DGRAM, 0), EPERM, "{name}({family}) dgram");
            }
            // A VSOCK family with only the upper half set to an allowed value is still VSOCK.
            assert_eq!(run(n, [(1u64 << 32) | AF_VSOCK as u64, SOCK_STREAM as u64, 0, 0, 0, 0]), EPERM);
        }
    }

    #[test]
    fn allowed_calls_and_foreign_abis() {
        use libc::*;
        for n in [SYS_read, SYS_execve, SYS_ptrace, SYS_chroot, SYS_process_vm_writev, SYS_pidfd_getfd]
            .into_iter()
            .chain([SYS_clock_adjtime, SYS_kcmp, SYS_mbind, SYS_exit_group])
        {
            assert_eq!(run(n, [0; 6]), ALLOW, "syscall {n}");
        }
        let program = bytes();
        assert_eq!(run_on(&program, COMPAT_ARCH, SYS_read, [0; 6]), KILL, "compat ABI");
        assert_eq!(run_on(&program, 0, 0, [0; 6]), KILL, "unknown arch");
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(run(SYS_adjtimex, [0; 6]), ALLOW);
            assert_eq!(run(0x4000_0000 | SYS_unshare, [0; 6]), KILL, "x32 unshare");
            assert_eq!(run(0x4000_0000 | SYS_getpid, [0; 6]), KILL, "x32 getpid");
            assert_eq!(run(-1, [0; 6]), ALLOW, "-1 (tracer skip) reaches the kernel's ENOSYS");
        }
    }

    fn require(bin: &str) -> std::path::PathBuf {
        find_on_path(bin).unwrap_or_else(|| panic!("{bin} is not on PATH; the seccomp tests need it (not skipped)"))
    }

    /// `program` with the filter installed in the forked child just before exec.
    fn filtered(program: &std::path::Path) -> Command {
        let bytes = bytes();
        let install = move || {
            let prog = libc::sock_fprog {
                len: (bytes.len() / 8) as u16,
                // The kernel copies the array with copy_from_user; no alignment needed.
                filter: bytes.as_ptr() as *mut libc::sock_filter,
            };
            // SAFETY: prctl(2) with integer arguments only.
            if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mode = libc::SECCOMP_MODE_FILTER as libc::c_ulong;
            // SAFETY: `prog` points at `bytes`, both alive for the call; the kernel copies them.
            if unsafe { libc::prctl(libc::PR_SET_SECCOMP, mode, &prog as *const libc::sock_fprog) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        let mut cmd = Command::new(program);
        // SAFETY: `install` runs in the forked child before exec and only calls
        // prctl(2), which is async-signal-safe; it allocates nothing.
        unsafe { cmd.pre_exec(install) };
        cmd
    }

    fn show(out: &Output) -> String {
        format!(
            "status {:?}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    #[test]
    fn installed_filter_denies_in_a_real_process() {
        let out = filtered(&require("true")).output().expect("spawn true");
        assert!(out.status.success(), "true under the filter: {}", show(&out));

        let out = filtered(&require("grep")).args(["Seccomp:", "/proc/self/status"]).output().expect("spawn grep");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "Seccomp:\t2\n", "{}", show(&out));

        let out = filtered(&require("unshare")).args(["--user", "true"]).output().expect("spawn unshare");
        assert!(!out.status.success(), "unshare --user succeeded under the filter: {}", show(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"), "{}", show(&out));

        // Raw calls through ctypes (os.unshare needs Python 3.12); the numbers come
        // from libc so the script is right on either arch. Every argument list is
        // harmless even unfiltered and as root (bad pointers, bad fds, bad commands),
        // so a broken filter shows up as a different errno, never as damage.
        use libc::*;
        let script = format!(
            r#"
import ctypes, errno, fcntl, os, pty, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def report(label, r):
    e = ctypes.get_errno()
    print(label, "ok" if r >= 0 else errno.errorcode.get(e, str(e)), flush=True)
def sc(label, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in args])
    if r == 0 and label.startswith("clone"):
        os._exit(0)
    report(label, r)
report("unshare_newuser", libc.unshare({newuser}))
sc("clone_newuser", {clone}, {newuser} | {sigchld}, 0, 0, 0, 0)
sc("clone3", {clone3}, 0, 0)
sc("setns", {setns}, 2**64 - 1, 0)
sc("mount", {mount}, 0, 0, 0, 0, 0)
sc("io_uring_setup", {io_uring_setup}, 0, 0)
sc("bpf", {bpf}, 2**31 - 1, 0, 0)
sc("keyctl", {keyctl}, 2**31 - 1, 0, 0, 0, 0)
sc("personality_8", {personality}, 8)
sc("personality_query", {personality}, 2**32 - 1)
master, slave = pty.openpty()
try:
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    print("tiocsti ok")
except OSError as e:
    print("tiocsti", errno.errorcode[e.errno])
ch = ctypes.c_char(b"x")
sc("tiocsti_upper_bits", {ioctl}, slave, 0xFFFFFFFF00000000 | {tiocsti}, ctypes.addressof(ch))
sc("tioclinux", {ioctl}, slave, {tioclinux}, ctypes.addressof(ch))
report("tcgetattr", 0 if termios.tcgetattr(slave) else -1)
timex = ctypes.create_string_buffer(512)
report("adjtimex_read", libc.adjtimex(timex))
"#,
            newuser = CLONE_NEWUSER,
            clone = SYS_clone,
            sigchld = SIGCHLD,
            clone3 = SYS_clone3,
            setns = SYS_setns,
            mount = SYS_mount,
            io_uring_setup = SYS_io_uring_setup,
            bpf = SYS_bpf,
            keyctl = SYS_keyctl,
            personality = SYS_personality,
            ioctl = SYS_ioctl,
            tiocsti = TIOCSTI,
            tioclinux = TIOCLINUX,
        );
        let out = filtered(&require("python3")).args(["-c", &script]).output().expect("spawn python3");
        assert!(out.status.success(), "python3 under the filter: {}", show(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let got: BTreeMap<&str, &str> = stdout.lines().filter_map(|l| l.split_once(' ')).collect();
        let want = BTreeMap::from([
            ("unshare_newuser", "EPERM"),
            ("clone_newuser", "EPERM"),
            ("clone3", "ENOSYS"),
            ("setns", "EPERM"),
            ("mount", "EPERM"),
            ("io_uring_setup", "EPERM"),
            ("bpf", "EPERM"),
            ("keyctl", "EPERM"),
            ("personality_8", "EPERM"),
            ("personality_query", "ok"),
            ("tiocsti", "EPERM"),
            ("tiocsti_upper_bits", "EPERM"),
            ("tioclinux", "EPERM"),
            ("tcgetattr", "ok"),
            ("adjtimex_read", "ok"),
        ]);
        assert_eq!(got, want, "{}", show(&out));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x32_syscall_kills_the_process() {
        let script = format!(
            "import ctypes\nctypes.CDLL(None).syscall(ctypes.c_long({}))\nprint('survived')",
            0x4000_0000 | libc::SYS_getpid
        );
        let no_core = || {
            let zero = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: setrlimit(2) with a valid pointer to a stack value.
            match unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        };
        let mut cmd = filtered(&require("python3"));
        // SAFETY: `no_core` runs in the forked child before exec and only calls
        // setrlimit(2), which is async-signal-safe. SIGSYS would otherwise dump core.
        unsafe { cmd.pre_exec(no_core) };
        let out = cmd.args(["-c", &script]).output().expect("spawn python3");
        assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{}", show(&out));
    }

    #[test]
    fn bwrap_loads_the_filter() {
        let bwrap = require("bwrap");
        // SAFETY: memfd_create with a NUL-terminated name; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(c"corral-seccomp".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let mut memfd = unsafe { std::fs::File::from_raw_fd(fd) };
        memfd.write_all(&bytes()).unwrap();
        memfd.seek(SeekFrom::Start(0)).unwrap();
        let script = "grep Seccomp: /proc/self/status; unshare -U true && echo ESCAPED";
        let sandboxed = |seccomp: bool| {
            let mut cmd = Command::new(&bwrap);
            cmd.args(["--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]);
            if seccomp {
                cmd.args(["--seccomp", &fd.to_string()]);
                let keep_fd = move || {
                    // SAFETY: fcntl(2) on an fd this process owns; it only lets the
                    // memfd (opened CLOEXEC so no other child inherits it) survive this exec.
                    match unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                };
                // SAFETY: `keep_fd` runs in the forked child before exec and only
                // calls fcntl(2), which is async-signal-safe.
                unsafe { cmd.pre_exec(keep_fd) };
            }
            cmd.args(["--", "/bin/sh", "-c", script]).output().expect("spawn bwrap")
        };
        let control = sandboxed(false);
        let stdout = String::from_utf8_lossy(&control.stdout);
        assert!(
            stdout.contains("Seccomp:\t0") && stdout.contains("ESCAPED"),
            "control run without --seccomp should escape, else this test proves nothing: {}",
            show(&control)
        );
        let out = sandboxed(true);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("Seccomp:\t2"), "filter not loaded: {}", show(&out));
        assert!(!stdout.contains("ESCAPED"), "nested user namespace created: {}", show(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"), "{}", show(&out));
        drop(memfd); // kept open until both bwrap runs are done
    }
}
