//! A real etcd for tests: `etcd` (Debian's `etcd-server`) started on free loopback ports with
//! a data directory of its own, killed when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd member (a cluster of one) for a test.
pub struct EtcdServer {
    child: Child,
    pub client_url: String,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port")
}

impl EtcdServer {
    /// Starts etcd and waits until it answers (panics with the reason if it cannot).
    pub fn start() -> EtcdServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = dir.path().join("etcd.log");
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            // Elections within the member itself: fast start, short minimum lease TTL.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start etcd ({e}): install Debian's etcd-server (scripts/setup)")
            });
        let mut s = EtcdServer { child, client_url, _dir: dir, log };
        s.wait_ready();
        s
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = self.client_url.trim_start_matches("http://").to_string();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("etcd exited with {status}: {}", self.log_tail());
            }
            if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                use std::io::{Read, Write};
                let req = "GET /health HTTP/1.0\r\n\r\n";
                let mut out = String::new();
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                if s.write_all(req.as_bytes()).is_ok()
                    && s.read_to_string(&mut out).is_ok()
                    && out.contains("\"health\":\"true\"")
                {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy: {}", self.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The endpoint as kvfs takes it (`HOST:PORT`).
    pub fn endpoint(&self) -> String {
        self.client_url.trim_start_matches("http://").to_string()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        s.lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
