//! Tiers in a running cluster, with real processes: the `kvfs` binary started as a master and
//! as nodes (each node with a data directory holding a real NVMe tier through io_uring and
//! O_DIRECT), a local-directory object store, and a real moto S3 server for the S3 path.
//! Processes are stopped with SIGKILL, never asked to leave, where a test is about crashes.
//!
//! Timing knobs are small (heartbeats 100 ms, node TTL 1.5 s, leases 300 ms, tier rounds
//! 20 ms) so the whole file runs in seconds; every wait is bounded and says what it waited for.

#[path = "../../tiers/tests/common/mod.rs"]
mod moto;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvfs_client::{Client, ClientConfig, ErrorKind, Persistence, PutOptions, Tier};

const MIB: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(30);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port()
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
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

/// A `kvfs` child process, killed with SIGKILL when dropped; its output goes to a log file
/// that is printed when a test fails.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(log: PathBuf, args: &[String]) -> Result<Proc> {
        let out = std::fs::File::create(&log)?;
        let child = Command::new(env!("CARGO_BIN_EXE_kvfs"))
            .args(args)
            .env("KVFS_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("spawn kvfs")?;
        Ok(Proc { child, log })
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::forget(self);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            print_tail(&self.log, 40);
        }
    }
}

/// The last `lines` lines of the log file `log` on stderr, under its name.
fn print_tail(log: &Path, lines: usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = all[all.len().saturating_sub(lines)..].join("\n");
    eprintln!("----- {} -----\n{tail}", log.display());
}

/// Where persisted objects go, as command-line flags.
#[derive(Clone)]
struct Store {
    args: Vec<String>,
    /// The local directory of an `fs` store (to damage objects in it).
    fs_root: Option<PathBuf>,
}

impl Store {
    fn fs(root: &Path) -> Store {
        Store {
            args: vec!["--object-store".into(), format!("fs:{}", root.display())],
            fs_root: Some(root.to_owned()),
        }
    }

    fn s3(m: &moto::Moto, bucket: &str) -> Store {
        let args = [
            "--object-store",
            &format!("s3://{bucket}/cluster"),
            "--s3-endpoint",
            &m.endpoint(),
            "--s3-access-key-id",
            "test",
            "--s3-secret-access-key",
            "test",
        ];
        Store { args: args.iter().map(|s| s.to_string()).collect(), fs_root: None }
    }
}

/// Node options a test varies.
#[derive(Clone)]
struct NodeOpts {
    dram: &'static str,
    nvme: &'static str,
    demote_high: f64,
    demote_low: f64,
}

impl Default for NodeOpts {
    fn default() -> Self {
        NodeOpts { dram: "32MiB", nvme: "256MiB", demote_high: 0.5, demote_low: 0.3 }
    }
}

/// A master and nodes as processes, sharing one object store.
struct Cluster {
    dir: tempfile::TempDir,
    store: Store,
    master_addr: String,
    admin_addr: String,
    master: Option<Proc>,
    nodes: Vec<Option<Proc>>,
    runs: usize,
    /// More flags for the master.
    master_args: Vec<String>,
    /// The master's `--node-ttl-ms`.
    node_ttl_ms: u64,
}

impl Cluster {
    fn new(store: impl FnOnce(&Path) -> Store) -> Result<Cluster> {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
        let store = store(dir.path());
        Ok(Cluster {
            store,
            master_addr: format!("127.0.0.1:{}", free_port()),
            admin_addr: format!("127.0.0.1:{}", free_port()),
            dir,
            master: None,
            nodes: Vec::new(),
            runs: 0,
            master_args: Vec::new(),
            node_ttl_ms: 1500,
        })
    }

    fn log(&mut self, name: &str) -> PathBuf {
        self.runs += 1;
        self.dir.path().join(format!("{name}.{}.log", self.runs))
    }

    fn start_master(&mut self) -> Result<()> {
        let mut args: Vec<String> = [
            "master",
            "--listen",
            &self.master_addr,
            "--admin",
            &self.admin_addr,
            "--heartbeat-ms",
            "100",
            "--node-ttl-ms",
            &self.node_ttl_ms.to_string(),
            "--lease-ttl-ms",
            "300",
            "--recovery-grace-ms",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(self.store.args.iter().cloned());
        args.extend(self.master_args.iter().cloned());
        let log = self.log("master");
        self.master = Some(Proc::spawn(log, &args)?);
        Ok(())
    }

    /// The data directory of node `i` in generation `gen` (a new generation starts empty).
    fn node_dir(&self, i: usize, generation: usize) -> PathBuf {
        self.dir.path().join(format!("node{i}.{generation}"))
    }

    fn start_node(&mut self, i: usize, generation: usize, o: &NodeOpts) -> Result<()> {
        let data = self.node_dir(i, generation);
        let mut args: Vec<String> =
            vec!["--master".into(), self.master_addr.clone(), "node".into()];
        let flags = [
            ("--data", data.display().to_string()),
            ("--dram", o.dram.to_string()),
            ("--nvme", o.nvme.to_string()),
            ("--tier-tick-ms", "20".into()),
            ("--demote-high-watermark", o.demote_high.to_string()),
            ("--demote-low-watermark", o.demote_low.to_string()),
            ("--tier-rate", "4GB".into()),
        ];
        for (k, v) in flags {
            args.push(k.into());
            args.push(v);
        }
        args.push("--no-populate".into());
        args.extend(self.store.args.iter().cloned());
        let log = self.log(&format!("node{i}"));
        if self.nodes.len() <= i {
            self.nodes.resize_with(i + 1, || None);
        }
        self.nodes[i] = Some(Proc::spawn(log, &args)?);
        Ok(())
    }

    fn kill_all(&mut self) {
        for n in self.nodes.iter_mut() {
            if let Some(p) = n.take() {
                p.kill();
            }
        }
        if let Some(p) = self.master.take() {
            p.kill();
        }
    }

    async fn client(&self) -> Result<Client> {
        let cfg = ClientConfig {
            master: self.master_addr.clone(),
            rpc_timeout_ms: 20_000,
            ..ClientConfig::default()
        };
        let deadline = Instant::now() + WAIT;
        loop {
            match Client::connect(cfg.clone()).await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => bail!("no master at {}: {e}", self.master_addr),
            }
        }
    }

    /// Waits until `nodes` nodes are registered and the object-store scan is done.
    async fn ready(&self, c: &Client, nodes: u64) -> Result<()> {
        wait_for(&format!("{nodes} nodes and the object store scanned"), || async {
            let s = c.stats().await.ok()?;
            (s.nodes == nodes && !s.scanning_object_store).then_some(())
        })
        .await
    }

    /// One metric line's value (the first whose name and labels start with `prefix`).
    fn metric(&self, prefix: &str) -> Result<f64> {
        let mut s = TcpStream::connect(&self.admin_addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        let line = body
            .lines()
            .find(|l| l.starts_with(prefix))
            .with_context(|| format!("no metric {prefix}"))?;
        Ok(line.rsplit(' ').next().unwrap_or("").parse()?)
    }

    /// The tail of every process log of the cluster on stderr (for a test that fails with an
    /// error rather than a panic, which the processes' own drop does not see).
    fn print_logs(&self) {
        let Ok(dir) = std::fs::read_dir(self.dir.path()) else { return };
        let mut logs: Vec<PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            print_tail(&log, 60);
        }
    }

    async fn wait_metric(&self, prefix: &str, at_least: f64) -> Result<()> {
        wait_for(&format!("{prefix} >= {at_least}"), || async {
            (self.metric(prefix).ok()? >= at_least).then_some(())
        })
        .await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
        if std::env::var_os("KVFS_TEST_KEEP").is_some() {
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            eprintln!("kept the cluster's files in {}", dir.keep().display());
        }
    }
}

async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {WAIT:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn tiers_of(c: &Client, key: &str) -> Result<Vec<Tier>> {
    let mut t: Vec<Tier> = c.stat(key).await?.replicas.iter().map(|r| r.tier).collect();
    t.sort_by_key(|t| *t as u8);
    Ok(t)
}

/// Waits until `key`'s copies are exactly `want` (sorted Hbm, Dram, Nvme, ObjectStore).
async fn wait_tiers(c: &Client, key: &str, want: &[Tier]) -> Result<()> {
    wait_for(&format!("{key:?} on {want:?}"), || async {
        (tiers_of(c, key).await.ok()? == want).then_some(())
    })
    .await
}

fn opts(persistence: Persistence) -> PutOptions {
    PutOptions { persistence, ..PutOptions::default() }
}

/// The NVMe data file of `key` under a node's data directory.
fn nvme_file(node_dir: &Path, key: &str) -> Result<PathBuf> {
    let d = blake3::hash(key.as_bytes()).to_hex().to_string();
    let sub = node_dir.join("nvme").join("objects").join(&d[..2]);
    for e in std::fs::read_dir(&sub)? {
        let p = e?.path();
        let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if name.starts_with(&format!("{d}.")) {
            return Ok(p);
        }
    }
    bail!("no NVMe data file for {key:?} in {}", sub.display())
}

/// Flips one byte of a file in place.
fn flip_byte(path: &Path, at: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at)?;
    f.write_all_at(&[b[0] ^ 0x5a], at)?;
    f.sync_all()?;
    Ok(())
}

/// Keeps writers and readers at the demotion rate (DRAM back under 60 %), so the master never
/// has to evict an object that is only in DRAM (that would be a loss by design, not a tier
/// move).
async fn pace(c: &Client) -> Result<()> {
    let r = wait_for("DRAM under 60 %", || async {
        let s = c.stats().await.ok()?;
        let d = s.tiers.iter().find(|t| t.tier == Tier::Dram)?;
        (d.used_bytes * 10 <= d.capacity_bytes * 6).then_some(())
    })
    .await;
    if r.is_err() {
        eprintln!("stats at the timeout: {:?}", c.stats().await);
    }
    r
}

/// Objects of 300 KiB to 1.2 MiB under DRAM pressure (DRAM 32 MiB, demotion above 50 %): the
/// node demotes them to NVMe, reads promote them back (a load per get of an NVMe-only
/// object), and every byte comes back as written, twice over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_demote_and_promote_under_pressure_and_stay_identical() -> Result<()> {
    let mut cl = Cluster::new(|d| Store::fs(&d.join("objects")))?;
    cl.start_master()?;
    cl.start_node(0, 0, &NodeOpts::default())?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    let mut objects = BTreeMap::new();
    for batch in 0..6u64 {
        for i in 0..8u64 {
            let n = batch * 8 + i;
            let data = pattern(300 * 1024 + (n as usize * 37_123) % (900 * 1024), n);
            let key = format!("pressure/{n:03}");
            c.put(&key, &data, &opts(Persistence::None)).await?;
            objects.insert(key, data);
        }
        pace(&c).await?;
    }
    let on_nvme = {
        let mut n = 0;
        for k in objects.keys() {
            n += usize::from(tiers_of(&c, k).await? == [Tier::Nvme]);
        }
        n
    };
    ensure!(on_nvme >= 10, "only {on_nvme} objects were demoted to NVMe alone");
    for round in 0..2 {
        for (k, v) in objects.iter().rev() {
            let got = c.get(k).await.with_context(|| format!("round {round}: get {k}"))?;
            ensure!(&got == v, "round {round}: {k} came back different");
            pace(&c).await?;
        }
    }
    ensure!(cl.metric("kvfs_master_loads_total{source=\"nvme\"}")? >= on_nvme as f64);
    cl.wait_metric("kvfs_node_demotions_total", 10.0).await?;
    cl.wait_metric("kvfs_node_promotions_total", on_nvme as f64).await?;
    ensure!(cl.metric("kvfs_master_evicted_objects_total")? == 0.0, "nothing was evicted");
    Ok(())
}

/// Every object demoted to NVMe; the node is killed (SIGKILL) and started again on the same
/// data directory: it is the same node, re-reports its NVMe objects, and serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_serves_its_nvme_objects_again() -> Result<()> {
    let mut cl = Cluster::new(|_| Store {
        args: vec!["--object-store".into(), "none".into()],
        fs_root: None,
    })?;
    let all_cold = NodeOpts { demote_high: 0.01, demote_low: 0.005, ..NodeOpts::default() };
    cl.start_master()?;
    cl.start_node(0, 0, &all_cold)?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    let objects: Vec<(String, Vec<u8>)> =
        (0..10u64).map(|i| (format!("restart/{i}"), pattern(MIB + i as usize * 4099, i))).collect();
    for (k, v) in &objects {
        c.put(k, v, &opts(Persistence::None)).await?;
    }
    for (k, _) in &objects {
        wait_tiers(&c, k, &[Tier::Nvme]).await?;
    }
    let node_before = c.stat(&objects[0].0).await?.replicas[0].node;
    cl.nodes[0].take().context("node")?.kill();
    cl.start_node(0, 0, &all_cold)?;
    cl.wait_metric("kvfs_master_requests_total{op=\"register_node\"}", 2.0).await?;
    wait_for("the node's objects re-reported", || async {
        let v = c.stat(&objects[0].0).await.ok()?;
        v.replicas.iter().any(|r| r.tier == Tier::Nvme && r.node == node_before).then_some(())
    })
    .await?;
    for (k, v) in &objects {
        ensure!(&c.get(k).await.with_context(|| format!("get {k}"))? == v, "{k} after restart");
    }
    ensure!(
        c.stat(&objects[3].0).await?.replicas.iter().all(|r| r.node == node_before),
        "same node id"
    );
    Ok(())
}

/// Eager objects survive the loss of everything but the object store: every node and the
/// master are SIGKILLed and started empty (new data directories), and every object reads back
/// from the object store, byte for byte; objects without persistence are gone, and so are
/// persisted objects removed before the crash (an upserted one comes back with its new value).
/// A namespace's default persistence applies to puts that asked for none. A byte flipped in
/// the object store is detected on that read (an error, counted).
async fn eager_survives_total_loss(store: impl FnOnce(&Path) -> Store) -> Result<()> {
    let mut cl = Cluster::new(store)?;
    let roomy = NodeOpts { demote_high: 0.95, demote_low: 0.9, ..NodeOpts::default() };
    cl.master_args = vec!["--persistence".into(), "ns/=eager".into()];
    cl.start_master()?;
    cl.start_node(0, 0, &roomy)?;
    cl.start_node(1, 0, &roomy)?;
    let c = cl.client().await?;
    cl.ready(&c, 2).await?;
    let eager: Vec<(String, Vec<u8>)> = (0..12u64)
        .map(|i| (format!("eager/{i}"), pattern(64 * 1024 + i as usize * 77_777, 100 + i)))
        .collect();
    for (k, v) in &eager {
        c.put(k, v, &opts(Persistence::Eager)).await?;
        ensure!(
            tiers_of(&c, k).await?.contains(&Tier::ObjectStore),
            "an acknowledged eager put has its object-store copy"
        );
    }
    c.put("volatile", &pattern(4096, 1), &opts(Persistence::None)).await?;
    // The namespace's default persistence applies to a put that asked for none.
    c.put("ns/by-default", &pattern(4096, 2), &opts(Persistence::None)).await?;
    ensure!(cl.metric("kvfs_master_eager_persisted_total")? == 13.0);
    // A removed persisted object must not come back; an upserted one comes back new.
    c.remove("eager/11", true).await?;
    let newer = pattern(5000, 77);
    c.put("eager/10", &newer, &PutOptions { upsert: true, ..opts(Persistence::Eager) }).await?;
    cl.wait_metric("kvfs_master_object_store_deletes_total", 2.0).await?;
    drop(c);
    cl.kill_all();
    cl.start_master()?;
    cl.start_node(0, 1, &roomy)?;
    cl.start_node(1, 1, &roomy)?;
    let c = cl.client().await?;
    cl.ready(&c, 2).await?;
    let damaged = "eager/5";
    if let Some(root) = &cl.store.fs_root {
        let d = blake3::hash(damaged.as_bytes()).to_hex().to_string();
        flip_byte(&root.join("objects").join(&d[..2]).join(&d), 200 + 5000)?;
    }
    ensure!(c.get("eager/11").await.unwrap_err().kind() == ErrorKind::NotFound, "removed");
    ensure!(c.get("ns/by-default").await? == pattern(4096, 2), "namespace default persisted");
    ensure!(c.get("eager/10").await? == newer, "the upserted value");
    for (k, v) in eager.iter().take(10) {
        match c.get(k).await {
            Ok(got) => ensure!(&got == v, "{k} read back different"),
            Err(e) if k == damaged && cl.store.fs_root.is_some() => {
                ensure!(e.kind() == ErrorKind::Corrupt, "a flipped byte is Corrupt: {e}");
            }
            Err(e) => bail!("{k}: {e}"),
        }
    }
    ensure!(c.get("volatile").await.unwrap_err().kind() == ErrorKind::NotFound);
    if cl.store.fs_root.is_some() {
        ensure!(cl.metric("kvfs_master_corrupt_copies_total{tier=\"object_store\"}")? == 1.0);
        wait_for("a node counted the corrupt read", || async {
            let mut s = TcpStream::connect(&cl.admin_addr).ok()?;
            write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
            let mut body = String::new();
            s.read_to_string(&mut body).ok()?;
            body.lines()
                .filter(|l| {
                    l.starts_with("kvfs_node_corrupt_reads_total") && l.contains("object_store")
                })
                .any(|l| l.ends_with(" 1"))
                .then_some(())
        })
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_objects_survive_every_process_killed_fs_store() -> Result<()> {
    eager_survives_total_loss(|d| Store::fs(&d.join("objects"))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_objects_survive_every_process_killed_s3_store_on_moto() -> Result<()> {
    let m = moto::Moto::start();
    m.create_bucket("kvfs-eager");
    eager_survives_total_loss(|_| Store::s3(&m, "kvfs-eager")).await
}

/// Lazy objects are written back in the background; the node and the master are SIGKILLed
/// while the queue is still working. Every object the master had acknowledged as persisted
/// (an object-store replica) before the kill reads back after everything restarted empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_queue_killed_loses_nothing_it_acknowledged() -> Result<()> {
    let mut cl = Cluster::new(|d| Store::fs(&d.join("objects")))?;
    let roomy =
        NodeOpts { dram: "96MiB", demote_high: 0.95, demote_low: 0.9, ..NodeOpts::default() };
    cl.start_master()?;
    cl.start_node(0, 0, &roomy)?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    let objects: BTreeMap<String, Vec<u8>> = (0..40u64)
        .map(|i| (format!("lazy/{i:02}"), pattern(2 * MIB - i as usize * 1000, 500 + i)))
        .collect();
    let keys: Vec<&str> = objects.keys().map(String::as_str).collect();
    let items: Vec<(&str, &[u8])> =
        objects.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in c.put_batch(&items, &opts(Persistence::Lazy)).await {
        r?;
    }
    let last = std::sync::Mutex::new(String::new());
    let acknowledged = wait_for("a few write-backs acknowledged", || async {
        let views = c.stat_batch(&keys).await;
        let errors: Vec<String> =
            views.iter().filter_map(|v| v.as_ref().err()).map(|e| e.to_string()).collect();
        let done: Vec<String> = views
            .iter()
            .zip(&keys)
            .filter(|(v, _)| {
                v.as_ref().is_ok_and(|v| v.replicas.iter().any(|r| r.tier == Tier::ObjectStore))
            })
            .map(|(_, k)| k.to_string())
            .collect();
        *last.lock().unwrap() =
            format!("{} persisted, {} stat errors {:?}", done.len(), errors.len(), errors.first());
        (done.len() >= 3).then_some(done)
    })
    .await;
    let acknowledged = match acknowledged {
        Ok(a) => a,
        Err(e) => {
            cl.print_logs();
            bail!("{e} (last seen: {})", last.lock().unwrap());
        }
    };
    cl.kill_all();
    eprintln!(
        "{} of {} acknowledged as persisted before the kill",
        acknowledged.len(),
        objects.len()
    );
    cl.start_master()?;
    cl.start_node(0, 1, &roomy)?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    for k in &acknowledged {
        let got = c.get(k).await.with_context(|| format!("acknowledged {k} after the kill"))?;
        ensure!(got == objects[k], "{k} read back different");
    }
    Ok(())
}

/// A write-back that finishes while the master does not answer (stopped with SIGSTOP past the
/// node's 5 s call timeout) is reported once it answers again: the master learns that the
/// object is in the object store without a restart's scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_report_the_master_missed_is_made_again() -> Result<()> {
    let mut cl = Cluster::new(|d| Store::fs(&d.join("objects")))?;
    // The node stays registered through the pause.
    cl.node_ttl_ms = 60_000;
    let roomy = NodeOpts { dram: "96MiB", ..NodeOpts::default() };
    cl.start_master()?;
    cl.start_node(0, 0, &roomy)?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    let data = pattern(24 * MIB, 7);
    c.put("missed/report", &data, &opts(Persistence::Lazy)).await?;
    // The write-back (24 MiB hashed and written) is under way; its report meets a stopped
    // master.
    let pid = cl.master.as_ref().context("master")?.child.id().to_string();
    ensure!(Command::new("kill").args(["-STOP", &pid]).status()?.success(), "SIGSTOP");
    tokio::time::sleep(Duration::from_secs(7)).await;
    ensure!(Command::new("kill").args(["-CONT", &pid]).status()?.success(), "SIGCONT");
    let seen = wait_tiers(&c, "missed/report", &[Tier::Dram, Tier::ObjectStore]).await;
    if seen.is_err() {
        cl.print_logs();
    }
    seen?;
    ensure!(c.get("missed/report").await? == data, "read back different");
    Ok(())
}

/// A byte flipped in an NVMe file is detected on read: the copy is dropped and counted; an
/// object that is also in the object store is served from there, one that is not fails with
/// `Corrupt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_on_nvme_is_detected_and_falls_back() -> Result<()> {
    let mut cl = Cluster::new(|d| Store::fs(&d.join("objects")))?;
    let all_cold = NodeOpts { demote_high: 0.01, demote_low: 0.005, ..NodeOpts::default() };
    cl.start_master()?;
    cl.start_node(0, 0, &all_cold)?;
    let c = cl.client().await?;
    cl.ready(&c, 1).await?;
    let plain = pattern(3 * MIB + 5, 1);
    let safe = pattern(2 * MIB + 7, 2);
    c.put("flip/plain", &plain, &opts(Persistence::None)).await?;
    c.put("flip/safe", &safe, &opts(Persistence::Eager)).await?;
    wait_tiers(&c, "flip/plain", &[Tier::Nvme]).await?;
    wait_tiers(&c, "flip/safe", &[Tier::Nvme, Tier::ObjectStore]).await?;
    let dir = cl.node_dir(0, 0);
    flip_byte(&nvme_file(&dir, "flip/plain")?, 1_000_000)?;
    flip_byte(&nvme_file(&dir, "flip/safe")?, 12_345)?;
    let e = c.get("flip/plain").await.unwrap_err();
    ensure!(e.kind() == ErrorKind::Corrupt, "the only copy is corrupt: {e}");
    ensure!(c.get("flip/safe").await? == safe, "served from the object store");
    ensure!(cl.metric("kvfs_master_corrupt_copies_total{tier=\"nvme\"}")? == 2.0);
    ensure!(
        c.stat("flip/plain").await.unwrap_err().kind() == ErrorKind::NotFound,
        "its only copy was bad"
    );
    wait_for("the node counted both corrupt reads", || async {
        (cl.metric("kvfs_node_corrupt_reads_total").ok()? >= 2.0).then_some(())
    })
    .await?;
    Ok(())
}

/// `kvfs bench tiers` runs end to end (tiny sizes) and prints one JSON object per figure with
/// the fields of DESIGN.md section 11.
#[test]
fn bench_tiers_prints_its_figures() -> Result<()> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let out = Command::new(env!("CARGO_BIN_EXE_kvfs"))
        .args([
            "bench",
            "tiers",
            "--json",
            "--object-size",
            "1M",
            "--objects",
            "2",
            "--rounds",
            "1",
        ])
        .args(["--writeback-objects", "2", "--writeback-size", "64K", "--promote-size", "256K"])
        .args(["--promotes", "3", "--dir"])
        .arg(dir.path())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        stdout.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    let find =
        |case: &str, op: &str| lines.iter().find(|l| l["case"] == case && l["op"] == op).cloned();
    let get = find("nvme tier", "get").context("nvme tier get")?;
    ensure!(get["limit"] == "disk" && get["ratio"].as_f64().is_some_and(|r| r > 0.0), "{get}");
    let promo = find("promotion", "get").context("promotion")?;
    ensure!(promo["p50_us"].as_f64().is_some() && promo["p99_us"].as_f64().is_some(), "{promo}");
    ensure!(find("write-back", "persist").is_some(), "write-back figure");
    for l in &lines {
        for field in ["bench", "case", "op", "size_bytes", "gbps", "limit", "limit_gbps", "ratio"] {
            ensure!(l.get(field).is_some(), "{field} missing in {l}");
        }
    }
    ensure!(std::fs::read_dir(dir.path())?.count() == 0, "the work directory was removed");
    Ok(())
}
