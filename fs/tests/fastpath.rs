//! The ioctl fast path from a separate process: a C program compiled with gcc against
//! `fs/abi/include/kvfs.h` registers buffers, runs batches of gets and puts, and checks every
//! documented errno (bad ids, offsets past the buffer, unregistered buffers, another process's
//! descriptors and ids). Then the objects it put are read back through the client.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;
use kvfs_fs::MountConfig;

fn pattern_c(len: usize, i: usize) -> Vec<u8> {
    (0..len).map(|j| ((j * 31 + i) % 251) as u8).collect()
}

fn compile(dir: &std::path::Path) -> PathBuf {
    let root = manifest_dir();
    let bin = dir.join("fastpath");
    let out = Command::new("gcc")
        .args(["-std=gnu11", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(root.join("tests/c/fastpath.c"))
        .arg("-I")
        .arg(root.join("abi/include"))
        .output()
        .expect("gcc must be installed");
    assert!(out.status.success(), "gcc: {}", String::from_utf8_lossy(&out.stderr));
    bin
}

#[test]
fn fast_path_from_a_c_program() {
    let c = Cluster::start(ClusterOpts::default());
    let nget = 4;
    for i in 0..nget {
        c.put(&format!("fp/get/{i}"), &pattern_c((i + 1) * 4096 + 123, i));
    }
    let m = c.mount(MountConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let bin = compile(dir.path());
    let out = run_timeout(
        Command::new(&bin).arg(&m.path).arg("fp").arg(nget.to_string()),
        Duration::from_secs(120),
    )
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for case in [
        "info",
        "register-bad-version",
        "register-unsealed",
        "register-not-shared-memory",
        "register-fd-not-open",
        "register-len-past-file",
        "batch-get",
        "item-missing-key",
        "item-buffer-too-small",
        "item-data-past-buffer",
        "item-key-past-buffer",
        "batch-put",
        "submit-bad-id",
        "submit-items-past-buffer",
        "submit-too-many-items",
        "other-process-id",
        "other-process-fd",
        "ioctl-on-object",
        "submit-unregistered-buffer",
        "id-dies-with-control-fd",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {case}")),
            "case {case} did not run:\n{stdout}"
        );
    }
    assert!(stdout.ends_with("done\n"));
    for i in 0..3 {
        assert_eq!(
            c.get(&format!("fp/put/{i}")).unwrap(),
            pattern_c((i + 1) * 65536 + 7, i),
            "put {i}"
        );
    }
    let status: serde_json::Value =
        serde_json::from_str(&sh_ok(&format!("cat {}", m.s(".kvfs/status.json")))).unwrap();
    assert_eq!(status["counters"]["fastpath_items_ok"], (nget + 3) as u64);
    let bufs: serde_json::Value =
        serde_json::from_str(&sh_ok(&format!("cat {}", m.s(".kvfs/buffers.json")))).unwrap();
    assert_eq!(bufs["buffers"].as_array().unwrap().len(), 0, "every buffer went with its process");
}

/// The Rust side of the ABI (kvfs_fs_abi::sys) against the same daemon, from this process.
#[test]
fn fast_path_from_rust() {
    use kvfs_fs::abi::{self, sys};
    let c = Cluster::start(ClusterOpts::default());
    let obj = pattern(16 << 20, 77);
    c.put("rust/obj", &obj);
    let m = c.mount(MountConfig::default());
    let path = m.path.clone();
    // The test process talks to its own daemon: do it on a thread with a deadline.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = (|| -> std::io::Result<Vec<u8>> {
            let ctl = sys::Control::open(&path)?;
            let buf = sys::SealedMemfd::new("rust-test", 32 << 20)?;
            let id = ctl.register(buf.fd(), buf.len() as u64)?;
            let key = b"rust/obj";
            buf.write_at(4096, key);
            let it = abi::Item {
                key_offset: 4096,
                key_len: key.len() as u32,
                data_offset: 1 << 20,
                data_len: 20 << 20,
                ..Default::default()
            };
            buf.write_at(0, &it.to_bytes());
            let mut s = abi::Submit {
                abi_version: abi::ABI_VERSION,
                op: abi::OP_GET,
                buffer_id: id,
                count: 1,
                ..Default::default()
            };
            ctl.submit(&mut s)?;
            let mut back = [0u8; abi::Item::SIZE];
            buf.read_at(0, &mut back);
            let it = abi::Item::from_bytes(&back).unwrap();
            assert_eq!((s.ok, it.status, it.size), (1, 0, 16 << 20));
            let mut data = vec![0u8; 16 << 20];
            buf.read_at(1 << 20, &mut data);
            ctl.unregister(id)?;
            Ok(data)
        })();
        let _ = tx.send(r);
    });
    let data = rx.recv_timeout(Duration::from_secs(60)).expect("fast path hung").unwrap();
    assert!(data == obj, "the fast path returned other bytes");
}

/// The crate's source folder as the test runner reports it now (cargo and nextest set it when
/// they run a test), so a test binary built from another checkout still finds this one's files.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}
