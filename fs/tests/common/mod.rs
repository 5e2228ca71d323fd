//! Shared fixtures of the mount tests: a real master and node in this process, a real FUSE
//! mount (unmounted by a guard even when the test fails, with the FUSE connection aborted if
//! the daemon hangs), and shell commands run with a deadline.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_fs::{Mount, MountConfig};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig, TierConfig};

pub struct Cluster {
    pub rt: tokio::runtime::Runtime,
    pub master: Option<MasterService>,
    pub node: Option<Node>,
    pub client: Client,
    pub addr: String,
}

pub struct ClusterOpts {
    pub lease_ttl_ms: u64,
    pub dram_bytes: u64,
    /// A local-directory object store shared by the master and the node (persistence, jobs).
    pub object_store: Option<PathBuf>,
    /// The master's wait after its start for nodes to report what they hold (jobs start
    /// after it).
    pub recovery_grace_ms: u64,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts {
            lease_ttl_ms: 10_000,
            dram_bytes: 256 << 20,
            object_store: None,
            recovery_grace_ms: ServiceConfig::default().recovery_grace_ms,
        }
    }
}

impl Cluster {
    pub fn start(opts: ClusterOpts) -> Cluster {
        sweep_dead_mounts();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let (master, node, client, addr) = rt.block_on(async {
            let mut cfg = ServiceConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                admin_listen: None,
                ..ServiceConfig::default()
            };
            cfg.directory.lease_ttl_ms = opts.lease_ttl_ms;
            cfg.recovery_grace_ms = opts.recovery_grace_ms;
            let store = opts.object_store.map(|root| kvfs_tiers::ObjectStoreConfig::Fs { root });
            cfg.object_store = store.clone();
            let master = MasterService::start(cfg).await.unwrap();
            let addr = master.rpc_addr().to_string();
            let node = Node::start(NodeConfig {
                master: addr.clone(),
                dram_bytes: opts.dram_bytes,
                populate: false,
                tiers: TierConfig { object_store: store, ..TierConfig::default() },
                ..NodeConfig::default()
            })
            .await
            .unwrap();
            node.wait_registered(Duration::from_secs(10)).await.unwrap();
            let client =
                Client::connect(ClientConfig { master: addr.clone(), ..ClientConfig::default() })
                    .await
                    .unwrap();
            (master, node, client, addr)
        });
        Cluster { rt, master: Some(master), node: Some(node), client, addr }
    }

    pub fn put(&self, key: &str, data: &[u8]) {
        self.rt
            .block_on(self.client.put(
                key,
                data,
                &PutOptions { checksum: true, ..PutOptions::default() },
            ))
            .unwrap();
    }

    pub fn get(&self, key: &str) -> kvfs_client::Result<Vec<u8>> {
        self.rt.block_on(self.client.get(key))
    }

    pub fn exists(&self, key: &str) -> bool {
        self.rt.block_on(self.client.exists(key)).unwrap()
    }

    /// Mounts the pool at a fresh temporary directory.
    pub fn mount(&self, cfg: MountConfig) -> MountGuard {
        let dir = tempfile::Builder::new().prefix("kvfs-mnt-").tempdir().unwrap();
        let client = self
            .rt
            .block_on(Client::connect(ClientConfig {
                master: self.addr.clone(),
                ..ClientConfig::default()
            }))
            .unwrap();
        let cfg = MountConfig {
            mountpoint: dir.path().to_path_buf(),
            fs_name: "kvfs-test".into(),
            ..cfg
        };
        let mount = Mount::start(cfg, client, self.rt.handle().clone()).unwrap();
        MountGuard::new(dir, Some(mount))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let node = self.node.take();
        let master = self.master.take();
        self.rt.block_on(async move {
            drop(node);
            drop(master);
        });
    }
}

/// Unmounts when dropped, whatever happened: a clean unmount if the daemon answers within
/// 10 s, otherwise the FUSE connection is aborted and the mount detached.
pub struct MountGuard {
    pub dir: Option<tempfile::TempDir>,
    pub path: PathBuf,
    mount: Option<Mount>,
    conn: Option<u64>,
}

impl MountGuard {
    pub fn new(dir: tempfile::TempDir, mount: Option<Mount>) -> MountGuard {
        let path = dir.path().to_path_buf();
        let conn = fuse_connection(&path);
        MountGuard { dir: Some(dir), path, mount, conn }
    }

    /// A guard for a mount made by another process at `path`.
    pub fn external(path: PathBuf) -> MountGuard {
        let conn = fuse_connection(&path);
        MountGuard { dir: None, path, mount: None, conn }
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.path.join(rel)
    }

    pub fn s(&self, rel: &str) -> String {
        self.p(rel).display().to_string()
    }

    pub fn mount(&self) -> &Mount {
        self.mount.as_ref().unwrap()
    }

    /// Unmounts now (what drop does), reporting whether the unmount was clean.
    pub fn unmount(&mut self) -> bool {
        let clean = match self.mount.take() {
            Some(m) => {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let _ = tx.send(m.unmount().is_ok());
                });
                rx.recv_timeout(Duration::from_secs(10)).unwrap_or(false)
            }
            None => umount_path(&self.path),
        };
        if !clean {
            if let Some(c) = self.conn {
                abort_connection(c);
            }
            kvfs_fs::lazy_unmount(&self.path);
        }
        self.conn = None;
        clean
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if self.mount.is_some() || self.conn.is_some() {
            self.unmount();
        }
    }
}

/// `umount PATH` with a deadline; true when it succeeded.
pub fn umount_path(path: &Path) -> bool {
    run_timeout(Command::new("umount").arg(path), Duration::from_secs(10))
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The FUSE connection number of a mount (its device minor).
fn fuse_connection(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    Some(libc::minor(dev) as u64)
}

fn abort_connection(conn: u64) {
    let ctl = Path::new("/sys/fs/fuse/connections");
    if !ctl.join(conn.to_string()).exists() {
        let _ = Command::new("mount").args(["-t", "fusectl", "fusectl"]).arg(ctl).status();
    }
    let _ = std::fs::write(ctl.join(conn.to_string()).join("abort"), "1");
}

/// Detaches test mounts whose daemon died (a test process killed by a timeout).
pub fn sweep_dead_mounts() {
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else { return };
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (Some(src), Some(dir)) = (f.next(), f.next()) else { continue };
        if src == "kvfs-test"
            && let Err(e) = std::fs::metadata(dir)
            && e.raw_os_error() == Some(libc::ENOTCONN)
        {
            kvfs_fs::lazy_unmount(Path::new(dir));
        }
    }
}

/// Runs a command in its own process group; kills the group after `timeout`.
pub fn run_timeout(cmd: &mut Command, timeout: Duration) -> std::io::Result<Output> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()?;
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            // SAFETY: kill(2) of our own child's process group.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{cmd:?} ran past {timeout:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    })
}

/// `bash -c script` with a 60 s deadline; panics on timeout, returns (status ok, stdout, stderr).
pub fn sh(script: &str) -> (bool, String, String) {
    let o = run_timeout(Command::new("bash").args(["-c", script]), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `bash -c script` that must succeed; returns stdout.
pub fn sh_ok(script: &str) -> String {
    let (ok, out, err) = sh(script);
    assert!(ok, "{script} failed: {err}");
    out
}

/// The errno a small Python operation on a path fails with (0 when it succeeds, minus the
/// signal number when a signal killed it).
pub fn errno_of(py: &str) -> i32 {
    let script = format!(
        "import os, errno, sys\ntry:\n    {py}\n    print(0)\nexcept OSError as e:\n    print(e.errno)\n"
    );
    let o = run_timeout(Command::new("python3").args(["-c", &script]), Duration::from_secs(60))
        .unwrap();
    let s = String::from_utf8_lossy(&o.stdout);
    if let (true, Some(sig)) =
        (s.trim().is_empty(), std::os::unix::process::ExitStatusExt::signal(&o.status))
    {
        return -sig;
    }
    s.trim()
        .parse()
        .unwrap_or_else(|_| panic!("python said {s:?} {}", String::from_utf8_lossy(&o.stderr)))
}

/// Deterministic bytes for object `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn sha256_hex(data: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f");
    std::fs::write(&p, data).unwrap();
    sh_ok(&format!("sha256sum {}", p.display())).split_whitespace().next().unwrap().to_string()
}
