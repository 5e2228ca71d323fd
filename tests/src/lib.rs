//! Harness for integration tests that run real kvfs processes: a master and nodes started from
//! the `kvfs` binary, on loopback, with ephemeral ports, killed with real signals.
//!
//! The binary is found through `KVFS_BIN`, or next to the test executable in the cargo target
//! directory (`target/<profile>/kvfs`, built by `cargo build --bin kvfs`; `scripts/test`
//! builds it before running the suite). Every process is killed when its handle drops, so a
//! failing test leaves nothing running; and every process gets SIGKILL when the test process
//! itself dies (a test killed by its runner's timeout, a signal), see [`spawn_tied`].
//! [`netns`] makes hosts of network namespaces for tests that cut links between them.

pub mod netns;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvfs_client::{Client, ClientConfig};

/// Path of the `kvfs` binary under test.
pub fn kvfs_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFS_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/kvfs
    let candidate = exe.parent().and_then(|d| d.parent()).map(|d| d.join("kvfs"));
    match candidate {
        Some(p) if p.exists() => p,
        _ => panic!(
            "the kvfs binary was not found next to {}: run `cargo build --bin kvfs` (scripts/test does) or set KVFS_BIN",
            exe.display()
        ),
    }
}

/// A free loopback port (bound and released: another process could take it meanwhile, which
/// only makes a test fail loudly, never pass wrongly).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The /metrics text of an admin endpoint (the master's `--admin`).
pub fn admin_metrics(admin: &str) -> String {
    use std::io::{Read, Write};
    let mut t = std::net::TcpStream::connect(admin).expect("admin http");
    t.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    t.read_to_string(&mut out).unwrap();
    out
}

/// The value of `series` (a metric's name, with its labels where it has any) in a /metrics
/// text.
pub fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The sum of the series of metric `name` whose labels include `label` (`op="read"`).
pub fn metric_sum(text: &str, name: &str, label: &str) -> u64 {
    text.lines()
        .filter_map(|l| {
            let (labels, value) = l.strip_prefix(name)?.strip_prefix('{')?.split_once("} ")?;
            labels.split(',').any(|x| x == label).then(|| value.trim().parse::<u64>().ok())?
        })
        .sum()
}

/// One kvfs process; killed (SIGKILL) when dropped.
pub struct Proc {
    child: Child,
    pub first_line: String,
}

/// Spawns `cmd` so that the child gets SIGKILL when this process dies, however it dies.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process: a
/// child spawned from a runtime worker or a scoped thread would be killed when that thread
/// ends, while the test still uses it. So every child is forked by one spawner thread that
/// lives as long as the process (it waits on a channel that is never closed), and the signal
/// fires only when the whole test process is gone.
pub fn spawn_tied(cmd: Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    use std::sync::mpsc;
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<mpsc::Sender<Request>>> =
        std::sync::OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("kvfs-tests-spawner".into())
            .spawn(move || {
                let parent = std::process::id() as libc::pid_t;
                for (mut cmd, reply) in rx {
                    // SAFETY: prctl and getppid are async-signal-safe; the closure touches no
                    // memory of the parent.
                    unsafe {
                        cmd.pre_exec(move || {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            // The parent died before the prctl: nobody will signal us.
                            if libc::getppid() != parent {
                                return Err(std::io::Error::other("the test process is gone"));
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("the spawner thread starts");
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    tx.lock().unwrap_or_else(|e| e.into_inner()).send((cmd, reply)).expect("spawner alive");
    answer.recv().expect("spawner answers")
}

impl Proc {
    /// Starts `kvfs ARGS` and waits (at most 20 s) for its first line on stdout.
    pub fn start(args: &[String]) -> Proc {
        Proc::start_cmd(Command::new(kvfs_bin()), args)
    }

    /// [`Proc::start`] with `cmd` running kvfs (in a network namespace: `ip netns exec NS
    /// kvfs`).
    pub fn start_cmd(mut cmd: Command, args: &[String]) -> Proc {
        cmd.args(args)
            .env("KVFS_LOG", std::env::var("KVFS_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = spawn_tied(cmd).unwrap_or_else(|e| panic!("starting kvfs {args:?}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let first_line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("kvfs {args:?} printed nothing within 20 s"));
        Proc { child, first_line }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// SIGSTOP, and waits (at most 5 s) until the kernel reports every thread stopped: the
    /// signal stops the process only when one of its threads next runs, and until then the
    /// others may still answer a request (on a loaded machine, long enough to matter).
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.pid());
        let deadline = Instant::now() + Duration::from_secs(5);
        let stopped = || {
            let Ok(dir) = std::fs::read_dir(&tasks) else { return false };
            dir.flatten().all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name; T is stopped.
                stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
            })
        };
        while !stopped() {
            assert!(Instant::now() < deadline, "kvfs did not stop within 5 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvfs mount` process. Dropped or killed, the process gets SIGKILL and its (now dead)
/// mount is detached, so a failing test leaves no mount behind.
pub struct MountProc {
    proc: Option<Proc>,
    pub dir: PathBuf,
}

impl MountProc {
    /// SIGKILL (the kernel aborts the FUSE connection: the mount answers `ENOTCONN`), then a
    /// lazy unmount of what is left.
    pub fn kill(mut self) {
        self.kill_and_detach();
    }

    fn kill_and_detach(&mut self) {
        if let Some(p) = self.proc.take() {
            p.kill();
        }
        lazy_unmount(&self.dir);
    }
}

impl Drop for MountProc {
    fn drop(&mut self) {
        self.kill_and_detach();
    }
}

/// `fusermount3 -uz DIR`, else `umount -l DIR` (a mount whose daemon died).
pub fn lazy_unmount(dir: &Path) {
    let quiet = |cmd: &str, args: &[&std::ffi::OsStr]| {
        Command::new(cmd)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let d = dir.as_os_str();
    if !quiet("fusermount3", &["-uz".as_ref(), d]) {
        quiet("umount", &["-l".as_ref(), d]);
    }
}

/// Options of a test cluster.
#[derive(Debug, Clone)]
pub struct ClusterOpts {
    pub nodes: usize,
    pub dram: String,
    pub master_args: Vec<String>,
    pub node_args: Vec<String>,
    /// Give every node started a data directory of its own under this one (a node started
    /// again gets a new, empty one: a new node id, nothing carried over).
    pub data_root: Option<PathBuf>,
    /// The cluster secret file given to the master, every node and mount, and the clients.
    pub secret_file: Option<PathBuf>,
    /// The master's admin endpoint (`--admin`): an address, or "off".
    pub admin: String,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts {
            nodes: 3,
            dram: "256MiB".into(),
            master_args: vec![
                "--node-ttl-ms".into(),
                "3000".into(),
                "--heartbeat-ms".into(),
                "200".into(),
                "--recovery-grace-ms".into(),
                "1500".into(),
            ],
            node_args: vec!["--no-populate".into()],
            data_root: None,
            secret_file: None,
            admin: "off".into(),
        }
    }
}

/// A master and its nodes, each a separate `kvfs` process.
pub struct Cluster {
    pub opts: ClusterOpts,
    pub master_addr: String,
    pub master: Option<Proc>,
    pub nodes: Vec<Option<Proc>>,
}

impl Cluster {
    /// Starts the master and `opts.nodes` nodes and waits until every node is registered.
    pub async fn start(opts: ClusterOpts) -> Cluster {
        let master_addr = format!("127.0.0.1:{}", free_port());
        let mut c = Cluster { opts, master_addr, master: None, nodes: Vec::new() };
        c.start_master();
        for _ in 0..c.opts.nodes {
            c.start_node();
        }
        c.wait_nodes(c.opts.nodes).await;
        c
    }

    pub fn start_master(&mut self) {
        let mut args = vec![
            "master".into(),
            "--listen".into(),
            self.master_addr.clone(),
            "--admin".into(),
            self.opts.admin.clone(),
        ];
        args.extend(self.opts.master_args.iter().cloned());
        args.extend(self.secret_args());
        self.master = Some(Proc::start(&args));
    }

    /// Starts one more node; returns its index.
    pub fn start_node(&mut self) -> usize {
        let mut args = vec![
            "node".into(),
            "--master".into(),
            self.master_addr.clone(),
            "--dram".into(),
            self.opts.dram.clone(),
        ];
        args.extend(self.opts.node_args.iter().cloned());
        args.extend(self.secret_args());
        if let Some(root) = &self.opts.data_root {
            args.push("--data".into());
            args.push(root.join(format!("node{}", self.nodes.len())).display().to_string());
        }
        self.nodes.push(Some(Proc::start(&args)));
        self.nodes.len() - 1
    }

    /// SIGKILLs every node still running.
    pub fn kill_nodes(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_node(i);
        }
    }

    /// Starts `kvfs mount` of this cluster at `dir` (made if missing).
    pub fn start_mount(&self, dir: &Path) -> MountProc {
        let mut args = vec![
            "mount".into(),
            "--master".into(),
            self.master_addr.clone(),
            dir.display().to_string(),
        ];
        args.extend(self.secret_args());
        MountProc { proc: Some(Proc::start(&args)), dir: dir.to_path_buf() }
    }

    pub fn kill_node(&mut self, i: usize) {
        if let Some(p) = self.nodes[i].take() {
            p.kill();
        }
    }

    pub fn kill_master(&mut self) {
        if let Some(p) = self.master.take() {
            p.kill();
        }
    }

    fn secret_args(&self) -> Vec<String> {
        match &self.opts.secret_file {
            Some(f) => vec!["--cluster-secret-file".into(), f.display().to_string()],
            None => Vec::new(),
        }
    }

    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig { master: self.master_addr.clone(), ..ClientConfig::default() };
        cfg.engine.cluster_secret = self.opts.secret_file.as_ref().map(|f| {
            kvfs_transfer::ClusterSecret::from_file(f).expect("the test's secret file reads")
        });
        cfg
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.client_config()).await.expect("client connects")
    }

    /// Waits (at most 30 s) until the master reports `n` registered nodes.
    pub async fn wait_nodes(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(c) = Client::connect(self.client_config()).await
                && let Ok(s) = c.stats().await
                && s.nodes as usize == n
            {
                return;
            }
            assert!(Instant::now() < deadline, "the master never reported {n} nodes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Deterministic, distinct content for an object.
pub fn content(seed: u64, len: usize) -> Vec<u8> {
    kvfs_transfer::testing::pattern(seed, 0, len)
}
