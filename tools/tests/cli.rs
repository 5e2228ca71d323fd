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
    for cmd in
        ["up", "master", "node", "put", "get", "ls", "stat", "rm", "bench", "reshard", "nvmeof"]
    {
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

/// `--nvmeof` and `kvfs nvmeof`: bad specs, a node without a data directory, and (on a host
/// without the nvme-fabrics module, like CI's) the missing module, each a clear error.
#[test]
fn nvmeof_errors_are_clear() {
    let err = |args: &[&str]| {
        let out = kvfs(args);
        assert!(!out.status.success(), "kvfs {args:?} succeeded");
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!e.contains("panicked"), "{e}");
        e
    };
    let e = err(&["node", "--nvmeof", "transport=tcp,traddr=storage.example,nqn=n"]);
    assert!(e.contains("resolves no host names"), "{e}");
    let e = err(&["node", "--nvmeof", "transport=rdma,traddr=10.0.0.1,nqn=n"]);
    assert!(e.contains("tcp only"), "{e}");
    let spec = "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn=nqn.2026-12.io.kvfs:cli";
    let e = err(&["node", "--nvmeof", spec]);
    assert!(e.contains("--nvmeof needs --data DIR"), "{e}");
    let e = err(&["node", "--data", "/nonexistent/kvfs", "--nvmeof", spec, "--nvme", "0"]);
    assert!(e.contains("drop --nvme 0"), "{e}");
    if !std::path::Path::new("/dev/nvme-fabrics").exists() {
        let dir = std::env::temp_dir().join(format!("kvfs-cli-nvmeof-{}", std::process::id()));
        let e = err(&["nvmeof", "attach", spec, "--mount", dir.to_str().unwrap()]);
        assert!(e.contains("the kernel has no nvme-fabrics module"), "{e}");
        assert!(!dir.exists(), "a failed attach made its mount directory");
        let out = kvfs(&["nvmeof", "detach", spec, "--mount", dir.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("was not attached"));
    }
}
