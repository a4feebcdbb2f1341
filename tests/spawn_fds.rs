//! The descriptors a spawn passes arrive at 3, 4, … in order, whatever
//! numbers they had in the daemon, even 3 and 4 themselves in the other
//! order. The test runs itself again as a fresh process, where 3 and 4 are
//! free, so the files it passes are created at exactly those numbers.

use std::os::fd::AsRawFd;

use corral::sandbox::process::{data_fd, spawn_group, SpawnOptions};

const NAME: &str = "passed_descriptors_arrive_in_order_even_from_the_target_numbers";

#[test]
fn passed_descriptors_arrive_in_order_even_from_the_target_numbers() {
    if std::env::var_os("CORRAL_SPAWN_FDS_CHILD").is_some() {
        return child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env("CORRAL_SPAWN_FDS_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("passed: [first|second]"), "fd 3 gets the first passed file, fd 4 the second: {stdout}");
}

fn child() {
    // The lowest free numbers: 3 for the second passed file, 4 for the first.
    let second = data_fd("second", b"second").unwrap();
    let first = data_fd("first", b"first").unwrap();
    assert_eq!((second.as_raw_fd(), first.as_raw_fd()), (3, 4), "a fresh process has 3 and 4 free");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let output = runtime.block_on(async move {
        let options = SpawnOptions { pass_fds: vec![first, second], ..SpawnOptions::default() };
        let args = vec!["-c".into(), "printf '[%s|%s]' \"$(cat <&3)\" \"$(cat <&4)\"".into()];
        let mut process =
            spawn_group(std::path::Path::new("/bin/sh"), &args, &[], std::path::Path::new("/"), options).unwrap();
        drop(process.stdin.take());
        let mut out = String::new();
        use tokio::io::AsyncReadExt;
        process.stdout.take().unwrap().read_to_string(&mut out).await.unwrap();
        process.wait().await.unwrap();
        out
    });
    println!("passed: {output}");
}
