//! Test harness: a real moto S3 server on 127.0.0.1.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const INSTALL: &str =
    "python3 -m venv /opt/kvfs-venv && /opt/kvfs-venv/bin/pip install 'moto[server]==5.2.5'";

/// `KVFS_MOTO_SERVER`, else `moto_server` on PATH, else `/opt/kvfs-venv/bin/moto_server`.
pub fn find_moto() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFS_MOTO_SERVER") {
        return PathBuf::from(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join("moto_server");
            if c.is_file()
                && Command::new(&c)
                    .arg("-h")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            {
                return c;
            }
        }
    }
    let venv = PathBuf::from("/opt/kvfs-venv/bin/moto_server");
    if venv.is_file() {
        return venv;
    }
    panic!(
        "no moto S3 server found (env KVFS_MOTO_SERVER, `moto_server` on PATH, /opt/kvfs-venv/bin/moto_server); install it with: {INSTALL}"
    );
}

/// A running moto server; killed on drop.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Moto {
    pub fn start() -> Moto {
        let bin = find_moto();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}; install with: {INSTALL}", bin.display()));
        let mut moto = Moto { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if moto.http("GET", "/").is_ok_and(|status| status < 500) {
                break;
            }
            if let Ok(Some(st)) = moto.child.try_wait() {
                panic!("moto server exited early with {st}");
            }
            assert!(Instant::now() < deadline, "moto server did not answer on port {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        moto
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A bodiless HTTP/1.1 request; returns the status code.
    pub fn http(&self, method: &str, path: &str) -> std::io::Result<u16> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp)?;
        let line = String::from_utf8_lossy(&resp);
        line.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad HTTP response: {line:.80}")))
    }

    pub fn create_bucket(&self, bucket: &str) {
        let status = self.http("PUT", &format!("/{bucket}")).expect("create bucket");
        assert_eq!(status, 200, "create bucket {bucket}");
    }

    pub fn s3_config(&self, bucket: &str, root: &str) -> kvfs_tiers::ObjectStoreConfig {
        kvfs_tiers::ObjectStoreConfig::S3 {
            endpoint: self.endpoint(),
            bucket: bucket.into(),
            region: "us-east-1".into(),
            access_key_id: "test".into(),
            secret_access_key: "test".into(),
            root: root.into(),
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
