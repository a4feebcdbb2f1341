//! The first process of a warm sandbox: it waits, blocked on its stdin,
//! for the one request it will ever serve, then becomes the harness.
//!
//! A warm sandbox is started with everything that does not depend on a
//! request (uid, cgroup, namespaces, mounts, seccomp, proxy, HOME). Its
//! command is [`PROGRAM`], a program of its own built with the daemon
//! (`src/bin/`, this module's code) and installed beside it, run through a
//! descriptor bwrap inherits (`/proc/self/fd/N`: nothing is bound into the
//! sandbox for it, so bwrap's options, which the receipt's digest covers,
//! are the cold one's to the byte; only the argv after `--` names the
//! waiter). It reads
//! one frame from stdin, a pipe only it holds, closes every descriptor
//! above 2 and `exec`s the frame's argv with the frame's environment (and
//! the `PWD` bwrap sets), searching the frame's `PATH` as bwrap's `execvp`
//! does on the cold path. A command it cannot `exec` fails as bwrap's does
//! there (see [`exec_failure`]).
//! What follows on stdin (the task) is the harness's.
//!
//! A frame: `u32` payload length, then the payload: `u32` argc, `u32` envc,
//! then each argument and each `NAME=value` ending in a NUL. Little-endian.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// The waiter's file name, beside the corral binary; also its first
/// argument, so that `ps` names it (its `argv[0]` is the descriptor).
pub const PROGRAM: &str = "corral-sandbox-wait";

/// Where the waiter is for the corral binary at `corral`: beside it.
pub fn beside(corral: &Path) -> PathBuf {
    corral.with_file_name(PROGRAM)
}
/// The largest payload a waiter reads: the kernel refuses an argv and
/// environment this large long before.
pub const MAX_FRAME: usize = 8 << 20;

/// The frame that hands `argv` and `env` to a waiter. An empty argv, a NUL
/// in any string, a `=` in a name or a frame above [`MAX_FRAME`] is an error:
/// the cold path could not run them either.
pub fn encode(argv: &[String], env: &[(String, String)]) -> Result<Vec<u8>, String> {
    if argv.is_empty() {
        return Err("an empty argv".into());
    }
    let mut payload = Vec::new();
    payload.extend_from_slice(&(argv.len() as u32).to_le_bytes());
    payload.extend_from_slice(&(env.len() as u32).to_le_bytes());
    let mut push = |text: &str| -> Result<(), String> {
        if text.contains('\0') {
            return Err("a NUL in an argument or the environment".into());
        }
        payload.extend_from_slice(text.as_bytes());
        payload.push(0);
        Ok(())
    };
    for arg in argv {
        push(arg)?;
    }
    for (name, value) in env {
        if name.is_empty() || name.contains('=') {
            return Err(format!("environment name {name:?}"));
        }
        push(&format!("{name}={value}"))?;
    }
    if payload.len() > MAX_FRAME {
        return Err(format!("the request is {} bytes, above {MAX_FRAME}", payload.len()));
    }
    let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// A frame's payload back as the argv and the environment (`NAME=value`).
pub fn decode(payload: &[u8]) -> Result<(Vec<CString>, Vec<CString>), String> {
    let count = |at: usize| -> Result<usize, String> {
        let bytes = payload.get(at..at + 4).ok_or("a short header")?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")) as usize)
    };
    let (argc, envc) = (count(0)?, count(4)?);
    let mut rest = &payload[8..];
    // Each string runs to its NUL; nothing may follow the last one.
    let mut take = |n: usize| -> Result<Vec<CString>, String> {
        let mut out = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let end = rest.iter().position(|b| *b == 0).ok_or("fewer strings than counted, or one without its NUL")?;
            out.push(CString::new(&rest[..end]).expect("cut at the first NUL"));
            rest = &rest[end + 1..];
        }
        Ok(out)
    };
    let (argv, env) = (take(argc)?, take(envc)?);
    if !rest.is_empty() {
        return Err("more than the counted strings".into());
    }
    if argv.is_empty() {
        return Err("an empty argv".into());
    }
    if env.iter().any(|e| !e.as_bytes().contains(&b'=')) {
        return Err("an environment entry without =".into());
    }
    Ok((argv, env))
}

/// The exit status of a command that cannot be `exec`ed: bwrap's, whose
/// `execvp` fails for it on the cold path (`die_with_error`).
pub const EXEC_FAILED: i32 = 1;

/// What bwrap writes on stderr when its `execvp` of `program` fails with
/// `errno` on the cold path: the waiter writes the same, byte for byte,
/// and exits [`EXEC_FAILED`] as bwrap does, so that a harness that cannot
/// be started leaves the same record warm and cold. bwrap sets no locale:
/// the reason is the C locale's `strerror`, as the waiter's is.
pub fn exec_failure(program: &std::ffi::CStr, errno: i32) -> Vec<u8> {
    // SAFETY: strerror returns a NUL-terminated string, read before any
    // other call to it (the waiter is single-threaded).
    let reason = unsafe { std::ffi::CStr::from_ptr(libc::strerror(errno)) };
    let mut line = b"bwrap: execvp ".to_vec();
    line.extend_from_slice(program.to_bytes());
    line.extend_from_slice(b": ");
    line.extend_from_slice(reason.to_bytes());
    line.push(b'\n');
    line
}

/// Why the waiter did not become the harness.
enum Failure {
    /// No request it could read: exit 127, with the reason on stderr.
    Request(String),
    /// The request's command could not be `exec`ed: the program, and the
    /// errno of the last `exec`.
    Exec(CString, i32),
}

impl From<String> for Failure {
    fn from(why: String) -> Failure {
        Failure::Request(why)
    }
}

/// The waiter itself: never returns. A command it cannot `exec` fails as
/// bwrap's `execvp` does on the cold path ([`exec_failure`]); a request it
/// cannot read exits 127 (with the reason on stderr), as a shell does for
/// a command it cannot find.
pub fn run() -> ! {
    use std::io::Write;
    let failure = match wait_and_exec() {
        Ok(never) => match never {},
        Err(failure) => failure,
    };
    match failure {
        Failure::Exec(program, errno) => {
            let _ = std::io::stderr().write_all(&exec_failure(&program, errno));
            std::process::exit(EXEC_FAILED)
        }
        Failure::Request(why) => {
            eprintln!("corral: the sandbox could not start its command: {why}");
            std::process::exit(127)
        }
    }
}

fn wait_and_exec() -> Result<std::convert::Infallible, Failure> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // Unbuffered: exactly the frame is read, the task after it is the harness's.
    // SAFETY: fd 0 is this process's stdin; ManuallyDrop keeps it open.
    let mut stdin = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(0) });
    let mut header = [0u8; 4];
    stdin.read_exact(&mut header).map_err(|e| format!("no request: {e}"))?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(format!("a request of {len} bytes").into());
    }
    let mut payload = vec![0u8; len];
    stdin.read_exact(&mut payload).map_err(|e| format!("a cut request: {e}"))?;
    let (argv, mut env) = decode(&payload)?;
    // bwrap sets PWD to its --chdir in the command's environment, over the
    // caller's: so does the waiter, from the PWD bwrap gave it.
    if let Some(pwd) = std::env::var_os("PWD") {
        let mut entry = b"PWD=".to_vec();
        entry.extend_from_slice(pwd.as_encoded_bytes());
        let entry = CString::new(entry).map_err(|_| "a NUL in PWD".to_string())?;
        match env.iter_mut().find(|e| e.to_bytes().starts_with(b"PWD=")) {
            Some(old) => *old = entry,
            None => env.push(entry),
        }
    }
    let path = env.iter().find_map(|e| e.to_bytes().strip_prefix(b"PATH=").map(<[u8]>::to_vec));
    // SAFETY: plain syscalls on this single-threaded process; every
    // pointer array is NUL-terminated and outlives the exec.
    let errno = unsafe {
        // The daemon's binary and whatever else bwrap passed on: the harness
        // gets stdio only.
        libc::syscall(libc::SYS_close_range, 3, libc::c_uint::MAX, 0);
        // execvpe searches the caller's own PATH: make it the frame's.
        match path {
            Some(path) => std::env::set_var("PATH", std::ffi::OsStr::from_encoded_bytes_unchecked(&path)),
            None => std::env::remove_var("PATH"),
        }
        let mut argp: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
        argp.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
        envp.push(std::ptr::null());
        libc::execvpe(argv[0].as_ptr(), argp.as_ptr(), envp.as_ptr());
        // Returned: it failed. Its errno, before anything else can set it.
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    };
    Err(Failure::Exec(argv[0].clone(), errno))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_its_length_then_the_counts_then_nul_ended_strings() {
        let frame =
            encode(&["/bin/echo".into(), "".into(), "a b".into()], &[("PATH".into(), "/usr/bin".into())]).unwrap();
        let mut expected = vec![37, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0];
        expected.extend_from_slice(b"/bin/echo\0\0a b\0PATH=/usr/bin\0");
        assert_eq!(frame, expected);
        let (argv, env) = decode(&frame[4..]).unwrap();
        assert_eq!(argv, [c"/bin/echo", c"", c"a b"]);
        assert_eq!(env, [c"PATH=/usr/bin"]);
    }

    #[test]
    fn what_the_cold_path_could_not_run_is_refused() {
        assert!(encode(&[], &[]).is_err());
        assert!(encode(&["a\0b".into()], &[]).is_err());
        assert!(encode(&["a".into()], &[("A=B".into(), "c".into())]).is_err());
        assert!(encode(&["a".into()], &[("".into(), "c".into())]).is_err());
        assert!(encode(&["a".into()], &[("A".into(), "\0".into())]).is_err());
        assert!(encode(&["x".repeat(MAX_FRAME)], &[]).is_err());
    }

    /// bwrap 0.8's own words for an `execvp` that fails (`bwrap -- nope`).
    #[test]
    fn an_exec_failure_reads_as_bwraps() {
        let missing = exec_failure(c"corral-no-such-harness", libc::ENOENT);
        assert_eq!(missing, b"bwrap: execvp corral-no-such-harness: No such file or directory\n");
        assert_eq!(exec_failure(c"/usr", libc::EACCES), b"bwrap: execvp /usr: Permission denied\n");
    }

    #[test]
    fn a_bad_payload_never_decodes() {
        for bad in [
            &b""[..],
            &[1, 0, 0, 0][..],
            &[0, 0, 0, 0, 0, 0, 0, 0][..],                   // no argv
            &[1, 0, 0, 0, 0, 0, 0, 0][..],                   // counted, not there
            &[1, 0, 0, 0, 0, 0, 0, 0, b'a'][..],             // no NUL
            &[2, 0, 0, 0, 0, 0, 0, 0, b'a', 0][..],          // fewer than counted
            &[1, 0, 0, 0, 0, 0, 0, 0, b'a', 0, b'b', 0][..], // more than counted
            &[1, 0, 0, 0, 1, 0, 0, 0, b'a', 0, b'B', 0][..], // env without =
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        assert_eq!(decode(&[1, 0, 0, 0, 0, 0, 0, 0, b'a', 0]).unwrap().0, [c"a"]);
    }
}
