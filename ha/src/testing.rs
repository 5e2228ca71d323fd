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
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("etcd exited with {status}: {}", self.log_tail());
        }
        let addr = self.client_url.trim_start_matches("http://").to_string();
        let log = self.log.clone();
        wait_healthy(&addr, || std::fs::read_to_string(&log).unwrap_or_default());
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

/// A cluster of etcd members on loopback, each a process of its own.
pub struct EtcdCluster {
    pub members: Vec<Option<EtcdMember>>,
    _dir: tempfile::TempDir,
}

/// One member of an [`EtcdCluster`].
pub struct EtcdMember {
    child: Child,
    pub client_url: String,
    log: PathBuf,
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl EtcdCluster {
    /// Starts `n` members and waits until each answers healthy.
    pub fn start(n: usize) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}"))
            .collect();
        let initial = initial.join(",");
        let mut members = Vec::new();
        for (i, (c, p)) in ports.iter().enumerate() {
            let client_url = format!("http://127.0.0.1:{c}");
            let peer_url = format!("http://127.0.0.1:{p}");
            let log = dir.path().join(format!("m{i}.log"));
            let out = std::fs::File::create(&log).expect("log file");
            let child = Command::new("etcd")
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join(format!("m{i}")))
                .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial, "--initial-cluster-state", "new"])
                .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
                .stdout(Stdio::null())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("cannot start etcd ({e}): install Debian's etcd-server (scripts/setup)")
                });
            members.push(Some(EtcdMember { child, client_url, log }));
        }
        let c = EtcdCluster { members, _dir: dir };
        for m in c.members.iter().flatten() {
            let addr = m.client_url.trim_start_matches("http://").to_string();
            wait_healthy(&addr, || std::fs::read_to_string(&m.log).unwrap_or_default());
        }
        c
    }

    /// Every member's endpoint (`HOST:PORT`), comma-separated, as kvfs takes them.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .flatten()
            .map(|m| m.client_url.trim_start_matches("http://").to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        self.members[i] = None;
    }
}

fn wait_healthy(addr: &str, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            use std::io::{Read, Write};
            let mut out = String::new();
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
                && s.read_to_string(&mut out).is_ok()
                && out.contains("\"health\":\"true\"")
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "etcd at {addr} did not become healthy: {}", log());
        std::thread::sleep(Duration::from_millis(50));
    }
}
