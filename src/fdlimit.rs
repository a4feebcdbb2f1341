//! The daemon's file descriptor budget. At start it raises its own
//! `RLIMIT_NOFILE` soft limit to the hard limit (systemd's `LimitNOFILE`,
//! or the shell's `ulimit -Hn`), then checks that what admission lets in
//! fits: every running execution and session, and every warm sandbox
//! waiting, costs descriptors of its own (pipes, the proxy's listener, git
//! during capture), and every proxied connection two (the sandbox's side
//! and the upstream). When it does not
//! fit the daemon refuses to start and says which keys to lower; the
//! proxies' daemon-wide cap, unless configured, is what is left.

use crate::config::Config;

/// Descriptors the daemon holds whatever it runs: store, listeners, client
/// connections, logs.
pub const BASE_FDS: u64 = 512;
/// Descriptors one running sandbox may need at once, proxy connections
/// aside.
pub const FDS_PER_SANDBOX: u64 = 16;
/// Descriptors per proxied connection.
pub const FDS_PER_CONNECTION: u64 = 2;
/// The proxies' daemon-wide cap when `proxy.max_connections` is unset and
/// the limit allows it.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 4096;

/// Raises the soft `RLIMIT_NOFILE` to the hard one; returns the soft limit
/// now in force.
pub fn raise_nofile() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit(2) writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit(2) reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        }
    }
    limit.rlim_cur
}

/// The proxies' daemon-wide connection cap under a soft limit of `nofile`
/// descriptors, or why admission does not fit in it (naming the keys).
pub fn proxy_connections(config: &Config, nofile: u64) -> Result<usize, String> {
    // A warm sandbox waits outside admission's count, holding its own
    // descriptors (its waiter's pipes and pidfds, its proxy's listener).
    let sandboxes = (config.max_running_executions + config.max_running_sessions + config.sandbox.warm_total()) as u64;
    let reserved = BASE_FDS + sandboxes * FDS_PER_SANDBOX;
    let left = nofile.saturating_sub(reserved) / FDS_PER_CONNECTION;
    match config.proxy.max_connections {
        Some(wanted) if wanted as u64 > left => Err(format!(
            "proxy.max_connections {wanted} needs {} file descriptors beyond the {reserved} that \
             max_running_executions + max_running_sessions + sandbox.warm ({sandboxes}) reserve, but RLIMIT_NOFILE is {nofile}: \
             raise LimitNOFILE (ulimit -n) or lower these keys",
            wanted as u64 * FDS_PER_CONNECTION
        )),
        Some(wanted) => Ok(wanted),
        None if left == 0 => Err(format!(
            "max_running_executions + max_running_sessions + sandbox.warm ({sandboxes}) need {reserved} file descriptors and leave \
             none for proxy connections, but RLIMIT_NOFILE is {nofile}: raise LimitNOFILE (ulimit -n) or lower them"
        )),
        None => Ok(left.min(DEFAULT_MAX_CONNECTIONS) as usize),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_and_proxy_caps_must_fit_the_limit() {
        let config = Config::default();
        // 64 + 64 sandboxes: 512 + 128 * 16 = 2560 reserved.
        assert_eq!(proxy_connections(&config, 1 << 20), Ok(4096));
        assert_eq!(proxy_connections(&config, 2560 + 200), Ok(100));
        let err = proxy_connections(&config, 2000).unwrap_err();
        assert!(err.contains("max_running_executions") && err.contains("2000"), "{err}");
        let mut wanted = Config::default();
        wanted.proxy.max_connections = Some(1000);
        assert_eq!(proxy_connections(&wanted, 2560 + 2000), Ok(1000));
        let err = proxy_connections(&wanted, 2560 + 1999).unwrap_err();
        assert!(err.contains("proxy.max_connections 1000"), "{err}");
        // Warm sandboxes wait outside admission, each with descriptors of
        // its own: 64 more reserve 64 * 16 = 1024 more.
        let mut warm = Config::default();
        warm.sandbox.warm = [("builtin.noop".to_string(), 64)].into_iter().collect();
        assert_eq!(proxy_connections(&warm, 2560 + 1024 + 200), Ok(100));
        let err = proxy_connections(&warm, 2560 + 1000).unwrap_err();
        assert!(err.contains("sandbox.warm (192)"), "{err}");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let soft = raise_nofile();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit(2) writes into the struct we pass.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!((soft, limit.rlim_cur), (limit.rlim_max, limit.rlim_max));
    }
}
