//! Offload and restore jobs across real processes: `kvfs offload` persists a prefix of
//! thousands of objects while the CLI, a node and the master are SIGKILLed mid-job (the job is
//! the master's: it runs on, and the restarted master resumes it); every object of the job is
//! then in the object store exactly once, byte for byte, and nothing written after the job
//! started is in it; `--move` frees the pool; after every process is killed and restarted
//! empty, `kvfs restore` brings the objects back and they read back verified. The CLI's
//! progress lines and report are checked from its output.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvfs_client::{Client, JobState, PutOptions, Tier};
use kvfs_tests::{Cluster, ClusterOpts, content, kvfs_bin, spawn_tied};
use kvfs_tiers::{Medium, ObjectStoreConfig, ObjectStoreMedium};

const N: usize = 3000;

fn key(i: usize) -> String {
    format!("job/{:02}/obj-{i:05}", i % 17)
}

fn bytes(i: usize) -> Vec<u8> {
    content(7_000 + i as u64, 12_000 + (i * 37) % 9_000)
}

async fn wait_until(what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `kvfs` CLI run with its standard error read line by line.
struct Cli {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Cli {
    fn start(master: &str, args: &[&str]) -> Cli {
        let mut cmd = Command::new(kvfs_bin());
        cmd.arg("--master").arg(master).args(args);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn_tied(cmd).expect("kvfs CLI starts");
        let (tx, rx) = mpsc::channel();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Cli { child, lines: rx, seen: Vec::new() }
    }

    /// Lines until one matches `f` (at most `secs`).
    fn until(&mut self, secs: u64, f: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if f(&l) {
                        return l;
                    }
                }
                Err(_) => panic!("no such line within {secs} s; output so far:\n{}", self.out()),
            }
        }
    }

    /// Waits for the process to end (at most `secs`); its exit status and whole output.
    fn finish(mut self, secs: u64) -> (bool, String) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "the CLI did not end; output:\n{}", self.out());
            std::thread::sleep(Duration::from_millis(50));
        };
        // The readers end with the pipes.
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        (status.success(), self.out())
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn out(&self) -> String {
        self.seen.join("\n")
    }
}

fn job_id(started_line: &str) -> u64 {
    // "job ID started: ..."
    started_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no job id in {started_line:?}"))
}

/// What the object store holds: key -> bytes, every read verified by the medium (blake3).
async fn bucket(root: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let store = ObjectStoreMedium::open(ObjectStoreConfig::Fs { root: root.to_path_buf() })
        .expect("object store opens");
    let mut out = BTreeMap::new();
    for (k, meta) in store.list().await.expect("object store lists") {
        let mut v = vec![0u8; meta.size_bytes as usize];
        store.get_into(&k, &mut v).await.unwrap_or_else(|e| panic!("{k}: {e}"));
        assert!(out.insert(k.clone(), v).is_none(), "{k} listed twice");
    }
    out
}

/// A master and `nodes` nodes sharing an `fs` object store in a temporary directory (kept
/// alive by the first value; the second is the store's root).
async fn with_object_store(nodes: usize) -> (tempfile::TempDir, std::path::PathBuf, Cluster) {
    let data = tempfile::tempdir().unwrap();
    let root = data.path().join("objects");
    let store = format!("fs:{}", root.display());
    let mut o = ClusterOpts { nodes, ..ClusterOpts::default() };
    o.master_args.extend(["--object-store".to_string(), store.clone()]);
    o.node_args.extend(["--object-store".into(), store]);
    (data, root, Cluster::start(o).await)
}

async fn dram_used(c: &Client) -> u64 {
    let s = c.stats().await.unwrap();
    s.tiers.iter().filter(|t| t.tier == Tier::Dram).map(|t| t.used_bytes).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offload_survives_the_cli_a_node_and_the_master_killed_mid_job_and_restore_brings_it_back()
{
    let (_data, root, mut cluster) = with_object_store(2).await;
    let c = cluster.client().await;

    // N objects under the prefix on both nodes, and some outside it.
    let two = PutOptions { replicas: 2, ..PutOptions::default() };
    for chunk in (0..N).collect::<Vec<_>>().chunks(500) {
        let (keys, vals): (Vec<String>, Vec<Vec<u8>>) =
            chunk.iter().map(|&i| (key(i), bytes(i))).unzip();
        let items: Vec<(&str, &[u8])> =
            keys.iter().zip(&vals).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        for r in c.put_batch(&items, &two).await {
            r.unwrap();
        }
    }
    for i in 0..50 {
        c.put(&format!("other/{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
    }
    let in_pool = dram_used(&c).await;

    // The CLI starts the job (paced, so the kills land mid-job) and is killed once it shows
    // progress: the job runs on in the master.
    let mut cli = Cli::start(&cluster.master_addr, &["offload", "job/", "--rate", "6M"]);
    let id = job_id(&cli.until(20, |l| l.starts_with("job ") && l.contains(" started: ")));
    cli.until(20, |l| l.starts_with('[') && !l.contains("% 0/"));
    cli.kill();
    let s = c.job(id).await.unwrap();
    assert_eq!(s.state, JobState::Running, "{s:?}");
    assert_eq!(s.objects_total, N as u64, "{s:?}");

    // Written while the job runs: not in it.
    for i in 0..20 {
        c.put(&format!("job/late-{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
    }

    // A node, then the master, SIGKILLed mid-job.
    wait_until("a third of the job", 30, async || {
        c.job(id).await.is_ok_and(|s| s.objects_done >= N as u64 / 3)
    })
    .await;
    cluster.kill_node(1);
    wait_until("half of the job", 30, async || {
        c.job(id).await.is_ok_and(|s| s.objects_done >= N as u64 / 2)
    })
    .await;
    let before = c.job(id).await.unwrap();
    assert_eq!(before.state, JobState::Running, "the job ended too early: {before:?}");
    cluster.kill_master();
    drop(c);
    cluster.start_master();
    cluster.wait_nodes(1).await;

    // `kvfs jobs wait` follows the resumed job to its end.
    let cli = Cli::start(&cluster.master_addr, &["jobs", "wait", &id.to_string()]);
    let (ok, out) = cli.finish(120);
    assert!(ok, "kvfs jobs wait failed:\n{out}");
    assert!(out.contains(&format!("job {id} offload \"job/\": done")), "{out}");
    assert!(out.contains("resumed 1 time(s)"), "{out}");
    assert!(out.contains(&format!("/{N} objects")), "no progress line:\n{out}");
    assert!(out.contains("written to the object store"), "{out}");
    let c = cluster.client().await;
    let s = c.job(id).await.unwrap();
    assert_eq!((s.state, s.failed, s.gone, s.resumed), (JobState::Done, 0, 0, 1), "{s:?}");
    assert_eq!(s.objects_done, N as u64, "{s:?}");
    assert_eq!(s.moved + s.already, N as u64, "{s:?}");

    // Exactly the job's objects, each once and byte for byte; nothing written later.
    let held = bucket(&root).await;
    assert_eq!(held.len(), N, "the bucket holds {} objects", held.len());
    for i in 0..N {
        let got = held.get(&key(i)).unwrap_or_else(|| panic!("{} not in the bucket", key(i)));
        assert!(*got == bytes(i), "{}: other bytes in the bucket", key(i));
    }
    // The master knows them as persisted.
    let v = c.stat(&key(7)).await.unwrap();
    assert!(v.replicas.iter().any(|r| r.tier == Tier::ObjectStore), "{v:?}");

    // --move: the job's objects are written already (the late ones, those that survived
    // their node, are not); every pool copy goes.
    let mut cli = Cli::start(&cluster.master_addr, &["offload", "job/", "--move"]);
    let moved = job_id(&cli.until(20, |l| l.starts_with("job ") && l.contains(" started: ")));
    let (ok, out) = cli.finish(120);
    assert!(ok, "offload --move failed:\n{out}");
    assert!(out.contains("offload --move \"job/\": done"), "{out}");
    assert!(out.contains("pool copies dropped"), "{out}");
    let s = c.job(moved).await.unwrap();
    assert!(s.objects_total >= N as u64 && s.objects_total <= N as u64 + 20, "{s:?}");
    assert_eq!(
        (s.already, s.evicted, s.kept, s.failed),
        (N as u64, s.objects_total, 0, 0),
        "{s:?}"
    );
    let left = dram_used(&c).await;
    assert!(left < in_pool / 10, "DRAM used {left} after --move ({in_pool} before)");
    let v = c.stat(&key(11)).await.unwrap();
    assert!(v.replicas.iter().all(|r| r.tier == Tier::ObjectStore), "{v:?}");

    // Every process killed; a new master and new, empty nodes: only the object store is left.
    cluster.kill_master();
    cluster.kill_nodes();
    drop(c);
    cluster.start_master();
    cluster.start_node();
    cluster.start_node();
    cluster.wait_nodes(2).await;
    let c = cluster.client().await;
    wait_until("the object store scanned", 60, async || {
        c.stats().await.is_ok_and(|s| !s.scanning_object_store)
    })
    .await;
    assert!(dram_used(&c).await < in_pool / 10);
    // The restore, paced, with the master SIGKILLed and restarted a third of the way in.
    let mut cli = Cli::start(
        &cluster.master_addr,
        &["restore", "job/", "--concurrency", "16", "--rate", "8M", "--detach"],
    );
    let restored: u64 = cli.until(20, |l| l.parse::<u64>().is_ok()).parse().unwrap();
    assert!(cli.finish(30).0);
    wait_until("a third of the restore", 30, async || {
        c.job(restored).await.is_ok_and(|r| r.objects_done >= N as u64 / 3)
    })
    .await;
    assert_eq!(c.job(restored).await.unwrap().state, JobState::Running);
    cluster.kill_master();
    drop(c);
    cluster.start_master();
    cluster.wait_nodes(2).await;
    let cli = Cli::start(&cluster.master_addr, &["jobs", "wait", &restored.to_string()]);
    let (ok, out) = cli.finish(120);
    assert!(ok, "restore failed:\n{out}");
    assert!(out.contains("loaded into memory") && out.contains("resumed 1 time(s)"), "{out}");
    let c = cluster.client().await;
    let r = c.job(restored).await.unwrap();
    // Loaded before the kill: the nodes reported them, the resumed job finds them in memory.
    assert_eq!(
        (r.objects_total, r.moved + r.already, r.failed, r.resumed),
        (s.objects_total, s.objects_total, 0, 1),
        "{r:?}"
    );
    assert!(dram_used(&c).await >= in_pool / 3, "restore left DRAM nearly empty");
    for chunk in (0..N).collect::<Vec<_>>().chunks(500) {
        let keys: Vec<String> = chunk.iter().map(|&i| key(i)).collect();
        for (&i, r) in chunk.iter().zip(c.get_batch(&keys).await) {
            let got = r.unwrap_or_else(|e| panic!("{}: {e}", key(i)));
            assert!(got == bytes(i), "{}: other bytes after the restore", key(i));
        }
    }
    let v = c.stat(&key(3)).await.unwrap();
    assert!(v.replicas.iter().any(|r| r.tier == Tier::Dram), "{v:?}");

    // The jobs survive the restarts in the list.
    let jobs = c.jobs().await.unwrap();
    assert!(jobs.iter().any(|j| j.id == id && j.state == JobState::Done), "{jobs:?}");
    assert_eq!(jobs.len(), 3, "{jobs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_refuse_bad_input_and_cancel() {
    let (_data, root, cluster) = with_object_store(1).await;
    let c = cluster.client().await;
    for i in 0..200 {
        c.put(&format!("c/{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
    }
    // Bad concurrency, a missing job.
    let cli = Cli::start(&cluster.master_addr, &["offload", "c/", "--concurrency", "0"]);
    let (ok, out) = cli.finish(30);
    assert!(!ok && out.contains("concurrency 0 is outside 1..=256"), "{out}");
    let cli = Cli::start(&cluster.master_addr, &["jobs", "show", "12345"]);
    let (ok, out) = cli.finish(30);
    assert!(!ok && out.contains("no job 12345"), "{out}");

    // A slow job, cancelled: it stops, and says so.
    let mut cli =
        Cli::start(&cluster.master_addr, &["offload", "c/", "--rate", "200K", "--detach"]);
    let id: u64 = cli.until(20, |l| l.parse::<u64>().is_ok()).parse().unwrap();
    assert!(cli.finish(30).0);
    wait_until("some progress", 30, async || c.job(id).await.is_ok_and(|s| s.objects_done > 0))
        .await;
    let cli = Cli::start(&cluster.master_addr, &["jobs", "cancel", &id.to_string()]);
    let (ok, out) = cli.finish(30);
    assert!(ok && out.contains("cancelling after the objects in flight"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = c.job(id).await.unwrap();
        if s.state == JobState::Cancelled {
            break;
        }
        assert!(Instant::now() < deadline, "not cancelled: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = c.job(id).await.unwrap();
    assert!(s.objects_done < 200, "{s:?}");
    let cli = Cli::start(&cluster.master_addr, &["jobs"]);
    let (ok, out) = cli.finish(30);
    assert!(ok && out.contains(&id.to_string()) && out.contains("cancelled"), "{out}");
    // What a cancelled job wrote is whole: every object in the bucket reads back verified.
    let held = bucket(&root).await;
    assert!(!held.is_empty() && held.len() < 200, "{} objects in the bucket", held.len());
    for (k, v) in &held {
        let i: usize = k.trim_start_matches("c/").parse().unwrap();
        assert!(*v == bytes(i), "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_without_an_object_store_refuses_jobs() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let cli = Cli::start(&cluster.master_addr, &["restore", "x/"]);
    let (ok, out) = cli.finish(30);
    assert!(!ok && out.contains("this master has no object store"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_job_covers_its_keys_and_only_it_sees_the_job() {
    use kvfs_client::{ErrorKind, JobKind, JobSpec};
    let (_data, root, cluster) = with_object_store(1).await;
    let tenant = |t: &str| {
        let mut cfg = cluster.client_config();
        cfg.tenant = Some(t.into());
        Client::connect(cfg)
    };
    let (a, b) = (tenant("acme").await.unwrap(), tenant("bolt").await.unwrap());
    for i in 0..30 {
        a.put(&format!("m/{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
        b.put(&format!("m/{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
    }
    let spec = JobSpec {
        kind: JobKind::Offload { evict: false },
        prefix: "m/".into(),
        concurrency: 4,
        rate_bytes_per_s: 0,
    };
    let s = a.job_start(spec).await.unwrap();
    assert_eq!(s.spec.prefix, "m/");
    wait_until("the job done", 30, async || {
        a.job(s.id).await.is_ok_and(|s| s.state == JobState::Done)
    })
    .await;
    assert_eq!(a.job(s.id).await.unwrap().moved, 30);
    // The other tenant neither lists, reads nor cancels it; the operator sees the whole prefix.
    assert!(b.jobs().await.unwrap().is_empty());
    assert_eq!(b.job(s.id).await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(b.job_cancel(s.id).await.unwrap_err().kind(), ErrorKind::NotFound);
    let all = cluster.client().await.jobs().await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].spec.prefix, "tenants/acme/m/");
    let held = bucket(&root).await;
    assert_eq!(held.len(), 30);
    assert!(held.keys().all(|k| k.starts_with("tenants/acme/m/")), "{:?}", held.keys());
}

/// `--move` with readers holding leases on some objects: the master is SIGKILLed while the job
/// waits for those leases; the restarted master resumes the job from its checkpoint, which
/// names the objects still to evict, and drops their pool copies too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_resumed_after_a_master_crash_still_frees_what_was_leased() {
    use kvfs_client::{JobKind, JobSpec};
    let (_data, _root, mut cluster) = with_object_store(1).await;
    let c = cluster.client().await;
    for i in 0..20 {
        c.put(&format!("l/{i:02}"), &bytes(i), &PutOptions::default()).await.unwrap();
    }
    let spec = |evict| JobSpec {
        kind: JobKind::Offload { evict },
        prefix: "l/".into(),
        concurrency: 4,
        rate_bytes_per_s: 0,
    };
    let first = c.job_start(spec(false)).await.unwrap().id;
    wait_until("the offload", 30, async || {
        c.job(first).await.is_ok_and(|s| s.state == JobState::Done)
    })
    .await;
    // Readers lease five objects (10 s, the master's default lease).
    for i in 0..5 {
        c.get(&format!("l/{i:02}")).await.unwrap();
    }
    let id = c.job_start(spec(true)).await.unwrap().id;
    wait_until("the fifteen unleased objects freed", 30, async || {
        c.job(id).await.is_ok_and(|s| s.evicted == 15)
    })
    .await;
    let s = c.job(id).await.unwrap();
    assert_eq!(s.state, JobState::Running, "{s:?}");
    // The walk is over; the job waits for the readers' leases. Its checkpoint is written.
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.kill_master();
    drop(c);
    cluster.start_master();
    cluster.wait_nodes(1).await;
    let c = cluster.client().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let s = loop {
        match c.job(id).await {
            Ok(s) if s.state != JobState::Running => break s,
            _ => {}
        }
        assert!(Instant::now() < deadline, "the resumed job did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((s.state, s.resumed, s.evicted, s.kept), (JobState::Done, 1, 20, 0), "{s:?}");
    for i in 0..20 {
        let v = c.stat(&format!("l/{i:02}")).await.unwrap();
        assert!(v.replicas.iter().all(|r| r.tier == Tier::ObjectStore), "l/{i:02}: {v:?}");
    }
    assert_eq!(dram_used(&c).await, 0);
}
