//! A warm sandbox's first process: it waits, blocked on its stdin, for
//! the one request it will ever serve, then becomes the harness (see
//! `corral::sandbox::waiter`, whose code this is).
//!
//! Its own program rather than the daemon's binary run with an argument:
//! it starts once per warm run, and the daemon's binary (24 MB, ~29,000
//! relocations) costs ~0.5 ms of CPU more to start and to leave by `exec`
//! than this one (std and libc only), on every warm run: 1.11 ms against
//! 0.60-0.65 ms with `/usr/bin/true` as the harness (BENCHMARKS.md).

#[allow(dead_code)] // `encode` is the daemon's half.
#[path = "../sandbox/waiter.rs"]
mod waiter;

fn main() {
    waiter::run()
}
