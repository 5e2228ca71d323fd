//! The mount daemon as its own process (`kvfs mount`, `kvfs up --mount`): killed with SIGKILL,
//! its mount point is cleanly unmounted and a new daemon serves the same objects again from
//! the node that holds them; stopped with SIGTERM, it unmounts itself.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig};

const KVFS: &str = env!("CARGO_BIN_EXE_kvfs");

/// A child process killed (and its mount point detached) when dropped.
struct Daemon {
    child: Child,
    mountpoint: PathBuf,
}

impl Daemon {
    /// Starts `kvfs ARGS` and waits (at most 30 s) for a stdout line containing `ready`.
    fn start(args: &[&str], mountpoint: &Path, ready: &str) -> Daemon {
        let mut child = Command::new(KVFS)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let ready = ready.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains(&ready) {
                    let _ = tx.send(());
                }
            }
        });
        let d = Daemon { child, mountpoint: mountpoint.to_path_buf() };
        rx.recv_timeout(Duration::from_secs(30)).expect("the daemon did not come up");
        d
    }

    fn signal(&mut self, sig: i32) {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        lazy_unmount(&self.mountpoint);
    }
}

fn lazy_unmount(p: &Path) {
    let _ = run(Command::new("umount").arg("-l").arg(p));
}

/// Runs a command with a 30 s deadline; (success, stdout).
fn run(cmd: &mut Command) -> (bool, String) {
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (status.success(), String::from_utf8_lossy(&out.stdout).into_owned());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} hung");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn mounted(p: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    mounts.lines().any(|l| l.split_whitespace().nth(1) == Some(p.to_str().unwrap()))
}

#[test]
fn a_killed_daemon_unmounts_cleanly_and_a_new_one_serves_the_objects() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Master and node are dropped inside the runtime even when an assertion unwinds.
    let _in_rt = rt.enter();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    let (master, node, addr) = rt.block_on(async {
        let master = MasterService::start(ServiceConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_listen: None,
            ..ServiceConfig::default()
        })
        .await
        .unwrap();
        let addr = master.rpc_addr().to_string();
        let node = Node::start(NodeConfig {
            master: addr.clone(),
            dram_bytes: 64 << 20,
            populate: false,
            ..NodeConfig::default()
        })
        .await
        .unwrap();
        node.wait_registered(Duration::from_secs(10)).await.unwrap();
        let client =
            Client::connect(ClientConfig { master: addr.clone(), ..ClientConfig::default() })
                .await
                .unwrap();
        client.put("survive/blob", &data, &PutOptions::default()).await.unwrap();
        (master, node, addr)
    });
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().to_path_buf();
    let args = ["mount", "--master", addr.as_str(), mnt.to_str().unwrap()];
    let mut first = Daemon::start(&args, &mnt, "kvfs mounted at");
    let (ok, _) = run(Command::new("test").arg("-f").arg(mnt.join("survive/blob")));
    assert!(ok);

    first.signal(libc::SIGKILL);
    assert!(first.wait(Duration::from_secs(10)).is_some());
    // The kernel still has the mount, and says its daemon is gone (for a name it has not
    // cached).
    let e = std::fs::metadata(mnt.join("never-looked-up")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN));
    assert!(mounted(&mnt));
    let (ok, _) = run(Command::new("umount").arg(&mnt));
    assert!(ok, "a plain umount of the dead mount must succeed");
    assert!(!mounted(&mnt));
    drop(first);

    // A new daemon serves the objects again from the node.
    let second = Daemon::start(&args, &mnt, "kvfs mounted at");
    let (ok, sum) = run(Command::new("sha256sum").arg(mnt.join("survive/blob")));
    assert!(ok);
    let tmp = dir.path().with_extension("expected");
    std::fs::write(&tmp, &data).unwrap();
    let (_, want) = run(Command::new("sha256sum").arg(&tmp));
    let _ = std::fs::remove_file(&tmp);
    assert_eq!(sum.split_whitespace().next(), want.split_whitespace().next());
    drop(second);
    drop(node);
    drop(master);
}

#[test]
fn kvfs_up_mounts_and_unmounts_on_sigterm() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let data_dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().to_path_buf();
    let mut up = Daemon::start(
        &[
            "up",
            "--listen",
            &listen,
            "--admin",
            "off",
            "--dram",
            "64MiB",
            "--no-populate",
            "--data",
            data_dir.path().to_str().unwrap(),
            "--mount",
            mnt.to_str().unwrap(),
        ],
        &mnt,
        "mounted at",
    );
    let src = dir.path().with_extension("src");
    std::fs::write(&src, b"through the cli").unwrap();
    let (ok, _) = run(Command::new(KVFS).args(["put", "--master", &listen, "cli/obj"]).arg(&src));
    let _ = std::fs::remove_file(&src);
    assert!(ok);
    let (ok, text) = run(Command::new("cat").arg(mnt.join("cli/obj")));
    assert!(ok);
    assert_eq!(text, "through the cli");
    up.signal(libc::SIGTERM);
    let status = up.wait(Duration::from_secs(20)).expect("kvfs up did not stop on SIGTERM");
    assert!(status.success());
    assert!(!mounted(&mnt), "kvfs up left its mount behind");
}
