//! A real etcd for tests: `etcd` (Debian's `etcd-server`) members started on free loopback
//! ports (or on given hosts' addresses, in network namespaces a test made) with data
//! directories of their own, killed when dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port")
}

/// One etcd process.
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

impl EtcdMember {
    /// Starts member `name` of the cluster `initial` (`name=peer_url,...`) under `dir`, at
    /// `host` with `etcd` (a command that runs the etcd binary).
    fn spawn(
        dir: &Path,
        name: &str,
        (host, mut etcd): (String, Command),
        (client, peer): (u16, u16),
        initial: &str,
    ) -> EtcdMember {
        let client_url = format!("http://{host}:{client}");
        let peer_url = format!("http://{host}:{peer}");
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let child = etcd
            .args(["--name", name, "--data-dir"])
            .arg(dir.join(name))
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", initial, "--initial-cluster-state", "new"])
            // Elections within the cluster itself: fast start, short minimum lease TTL.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start etcd ({e}): install Debian's etcd-server (scripts/setup)")
            });
        EtcdMember { child, client_url, log }
    }

    /// The endpoint as kvfs takes it (`HOST:PORT`).
    pub fn endpoint(&self) -> String {
        self.client_url.trim_start_matches("http://").to_string()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of its log.
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

    /// Waits (at most 30 s) until it answers healthy; `Err` with its log if it exits first,
    /// panics with its log if it never answers.
    fn wait_healthy(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = self.endpoint();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("etcd exited with {status}: {}", self.log_tail()));
            }
            if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                use std::io::{Read, Write};
                let mut out = String::new();
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
                    && s.read_to_string(&mut out).is_ok()
                    && out.contains("\"health\":\"true\"")
                {
                    return Ok(());
                }
            }
            assert!(Instant::now() < deadline, "etcd at {addr} not healthy: {}", self.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A new command running what `c` runs (program, arguments, environment), for another try.
fn copy_command(c: &Command) -> Command {
    let mut n = Command::new(c.get_program());
    n.args(c.get_args());
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => n.env(k, v),
            None => n.env_remove(k),
        };
    }
    n
}

/// A cluster of etcd members on loopback, each a process of its own.
pub struct EtcdCluster {
    pub members: Vec<Option<EtcdMember>>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members on loopback and waits until each answers healthy.
    pub fn start(n: usize) -> EtcdCluster {
        EtcdCluster::start_on(
            (0..n).map(|_| ("127.0.0.1".to_string(), Command::new("etcd"))).collect(),
        )
    }

    /// Starts one member per `(address, command running etcd)` (a host in a network
    /// namespace: `ip netns exec NS etcd`) and waits until each answers healthy.
    ///
    /// The ports are probed free and then given to etcd, so another process may bind one in
    /// between: a member that exits with "address already in use" starts the whole cluster
    /// again on new ports (at most 5 times).
    pub fn start_on(hosts: Vec<(String, Command)>) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        for attempt in 0.. {
            let at = dir.path().join(format!("try{attempt}"));
            std::fs::create_dir(&at).expect("data directory");
            let ports: Vec<(u16, u16)> = hosts.iter().map(|_| (free_port(), free_port())).collect();
            let initial: Vec<String> = hosts
                .iter()
                .zip(&ports)
                .enumerate()
                .map(|(i, ((h, _), (_, p)))| format!("m{i}=http://{h}:{p}"))
                .collect();
            let initial = initial.join(",");
            let mut members: Vec<EtcdMember> = hosts
                .iter()
                .zip(ports)
                .enumerate()
                .map(|(i, ((h, c), p))| {
                    let host = (h.clone(), copy_command(c));
                    EtcdMember::spawn(&at, &format!("m{i}"), host, p, &initial)
                })
                .collect();
            match members.iter_mut().try_for_each(EtcdMember::wait_healthy) {
                Ok(()) => {
                    return EtcdCluster {
                        members: members.into_iter().map(Some).collect(),
                        _dir: dir,
                    };
                }
                Err(e) if e.contains("address already in use") && attempt < 4 => {}
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// Every live member's endpoint (`HOST:PORT`), comma-separated, as kvfs takes them.
    pub fn endpoints(&self) -> String {
        self.members.iter().flatten().map(EtcdMember::endpoint).collect::<Vec<_>>().join(",")
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        self.members[i] = None;
    }
}

/// A single etcd member (a cluster of one) for a test.
pub struct EtcdServer {
    cluster: EtcdCluster,
}

impl std::ops::Deref for EtcdServer {
    type Target = EtcdMember;

    fn deref(&self) -> &EtcdMember {
        self.cluster.members[0].as_ref().expect("the only member is never killed")
    }
}

impl EtcdServer {
    /// Starts etcd and waits until it answers (panics with the reason if it cannot).
    pub fn start() -> EtcdServer {
        EtcdServer { cluster: EtcdCluster::start(1) }
    }
}
