//! The command line as users meet it: help texts, and clear errors for bad arguments and
//! unreachable masters (never a panic or a backtrace).

use std::process::Command;

fn kvfs(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvfs"))
        .args(args)
        .env_remove("KVFS_MASTER")
        .output()
        .expect("run kvfs")
}

#[test]
fn every_command_explains_itself() {
    for cmd in ["up", "master", "node", "put", "get", "ls", "stat", "rm", "bench", "reshard"] {
        let out = kvfs(&[cmd, "--help"]);
        assert!(out.status.success(), "kvfs {cmd} --help failed");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Usage: kvfs"), "kvfs {cmd} --help: {text}");
    }
    let text = String::from_utf8_lossy(&kvfs(&["node", "--help"]).stdout).into_owned();
    assert!(text.contains("--dram"), "{text}");
}

#[test]
fn bad_arguments_and_unreachable_masters_are_clear_errors() {
    let out = kvfs(&["node", "--dram", "12 parsecs"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("parsecs"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = kvfs(&["--master", &format!("127.0.0.1:{port}"), "get", "k", "-"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("kvfs: ") && err.contains("master"), "{err}");
    assert!(!err.contains("panicked") && !err.contains("stack backtrace"), "{err}");
}
