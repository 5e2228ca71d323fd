//! Renames across crashes, with real processes killed by SIGKILL: the master in the middle of
//! a client's rename loop, a `kvfs mount` daemon in the middle of a shell's `mv` loop, and the
//! whole cluster after renames of persisted objects (restarted with empty nodes, the master
//! rebuilding from its object-store scan). Afterwards every object has exactly one name, the
//! new one wherever the rename was acknowledged, and its bytes are the original ones.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvfs_client::{Client, ErrorKind, Persistence, PutOptions, RenameMode, Tier};
use kvfs_tests::{Cluster, ClusterOpts, content};

const WAIT: Duration = Duration::from_secs(30);

/// What happened to each rename of a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The rename returned success.
    Acked,
    /// The rename failed (the process answering it died): either name may be the one.
    Failed,
    /// The loop stopped before trying it.
    NotTried,
}

/// Renames `from(i)` to `to(i)` for every `i` in `todo` from `workers` concurrent loops, each
/// stopping at its first error; `done` counts the acknowledged ones as they happen.
async fn rename_loops(
    c: &Client,
    pairs: Arc<Vec<(String, String)>>,
    workers: usize,
    done: Arc<AtomicUsize>,
) -> Vec<Outcome> {
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (c, pairs, done) = (c.clone(), pairs.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in (w..pairs.len()).step_by(workers) {
                let (from, to) = &pairs[i];
                match c.rename(from, to, RenameMode::NoReplace).await {
                    Ok(_) => {
                        out.push((i, Outcome::Acked));
                        done.fetch_add(1, Ordering::AcqRel);
                    }
                    Err(e) => {
                        eprintln!("rename {from} -> {to}: {e}");
                        out.push((i, Outcome::Failed));
                        break;
                    }
                }
            }
            out
        }));
    }
    let mut outcomes = vec![Outcome::NotTried; pairs.len()];
    for t in tasks {
        for (i, o) in t.await.unwrap() {
            outcomes[i] = o;
        }
    }
    outcomes
}

async fn wait_until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f().await {
        assert!(Instant::now() < deadline, "waited {WAIT:?} for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Every object is under exactly one of its names with its original bytes: the new name where
/// the rename was acknowledged, the old one where it was never tried.
async fn check_one_name(
    c: &Client,
    pairs: &[(String, String)],
    outcomes: &[Outcome],
    bytes: &dyn Fn(usize) -> Vec<u8>,
) {
    let mut moved = 0;
    for (i, ((from, to), o)) in pairs.iter().zip(outcomes).enumerate() {
        let old = c.exists(from).await.unwrap();
        let new = c.exists(to).await.unwrap();
        assert!(old != new, "{from} -> {to} ({o:?}): old name there {old}, new name there {new}");
        match o {
            Outcome::Acked => assert!(new, "acknowledged rename {from} -> {to} was lost"),
            Outcome::NotTried => assert!(old, "{from} moved without a rename"),
            Outcome::Failed => {}
        }
        moved += usize::from(new);
        let name = if new { to } else { from };
        let got = c.get(name).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == bytes(i), "{name}: {} bytes that are not the original", got.len());
    }
    eprintln!("{moved} of {} under the new name", pairs.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_rename_leaves_every_object_under_one_name() {
    let mut cluster = Cluster::start(ClusterOpts { nodes: 2, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    let n = 200;
    let two = PutOptions { replicas: 2, ..PutOptions::default() };
    // Kill points: at once, early and late in the loop.
    for (round, kill_at) in [1usize, 20, 60].into_iter().enumerate() {
        let bytes = move |i: usize| content((round * 1000 + i) as u64, 10_000 + i * 311);
        let pairs: Arc<Vec<(String, String)>> = Arc::new(
            (0..n).map(|i| (format!("k{round}/a{i}"), format!("k{round}/b{i}"))).collect(),
        );
        for (i, (from, _)) in pairs.iter().enumerate() {
            c.put(from, &bytes(i), &two).await.unwrap();
            assert_eq!(c.stat(from).await.unwrap().replicas.len(), 2, "two replicas of {from}");
        }
        let done = Arc::new(AtomicUsize::new(0));
        let loops = {
            let (c, pairs, done) = (c.clone(), pairs.clone(), done.clone());
            tokio::spawn(async move { rename_loops(&c, pairs, 4, done).await })
        };
        wait_until("renames before the kill", async || done.load(Ordering::Acquire) >= kill_at)
            .await;
        cluster.kill_master();
        let outcomes = loops.await.unwrap();
        cluster.start_master();
        cluster.wait_nodes(2).await;
        let acked = outcomes.iter().filter(|o| **o == Outcome::Acked).count();
        assert!(acked >= kill_at, "round {round}: {acked} acknowledged");
        assert!(acked < n, "round {round}: the kill came after the whole loop");
        check_one_name(&c, &pairs, &outcomes, &bytes).await;
    }
}

/// `bash -c script` in its own process group, killed with its group when dropped.
struct Shell(std::process::Child);

impl Shell {
    fn start(script: &str) -> Shell {
        use std::os::unix::process::CommandExt;
        let child = Command::new("bash")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        Shell(child)
    }

    /// Waits (bounded) for the shell to end; its exit code.
    fn wait(mut self) -> Option<i32> {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                return s.code();
            }
            assert!(Instant::now() < deadline, "the shell loop did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        // SAFETY: kill(2) of our own child's process group.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// Names under `dir` of the mount (`ls`), bounded.
fn ls(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("ls {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_killed_mid_mv_loop_leaves_every_file_under_one_name() {
    let cluster = Cluster::start(ClusterOpts { nodes: 2, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    let dirs = tempfile::tempdir().unwrap();
    let mnt = dirs.path().join("mnt");
    let n = 150;
    for (round, kill_at) in [3usize, 100].into_iter().enumerate() {
        let bytes = |i: usize| content((round * 1000 + i) as u64, 5_000 + i * 97);
        for i in 0..n {
            c.put(&format!("mv{round}/f{i}"), &bytes(i), &PutOptions::default()).await.unwrap();
        }
        let mount = cluster.start_mount(&mnt);
        let d = mnt.join(format!("mv{round}"));
        assert_eq!(ls(&d).len(), n);
        let shell = Shell::start(&format!(
            "cd {} && for i in $(seq 0 {}); do mv f$i g$i || exit 3; done",
            d.display(),
            n - 1
        ));
        let target = format!("mv{round}/g{kill_at}");
        wait_until("mv before the kill", async || c.exists(&target).await.unwrap()).await;
        mount.kill();
        let code = shell.wait();
        assert_eq!(code, Some(3), "the loop ended by a failed mv (the mount died)");

        // A new mount of the same cluster at the same place.
        let _mount = cluster.start_mount(&mnt);
        let names = ls(&d);
        let mut moved = 0;
        for i in 0..n {
            let (f, g) = (format!("f{i}"), format!("g{i}"));
            let (old, new) = (names.contains(&f), names.contains(&g));
            assert!(old != new, "file {i}: f{i} there {old}, g{i} there {new}");
            if i <= kill_at {
                assert!(new, "g{i} was seen before the kill (mv runs in order)");
            }
            moved += usize::from(new);
            let name = if new { &g } else { &f };
            let got = std::fs::read(d.join(name)).unwrap();
            assert!(got == bytes(i), "{name}: {} bytes that are not the original", got.len());
            let other = format!("mv{round}/{}", if new { &f } else { &g });
            assert!(!c.exists(&other).await.unwrap(), "{other} is still in the store");
        }
        assert_eq!(names.len(), n, "{names:?}");
        assert!(moved < n, "the kill came after the whole loop");
        eprintln!("round {round}: {moved} of {n} moved before the kill");
    }
}

fn persisted(replicas: &[kvfs_client::ReplicaDesc]) -> bool {
    replicas.iter().any(|r| r.tier == Tier::ObjectStore)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renamed_persisted_objects_keep_their_new_names_after_every_process_is_killed() {
    let data = tempfile::tempdir().unwrap();
    let store = format!("fs:{}", data.path().join("objects").display());
    let mut o = ClusterOpts { nodes: 2, ..ClusterOpts::default() };
    o.master_args.extend(["--object-store".to_string(), store.clone()]);
    o.node_args.extend(["--object-store".into(), store, "--nvme".into(), "0".into()]);
    o.data_root = Some(data.path().join("nodes"));
    let mut cluster = Cluster::start(o).await;
    let c = cluster.client().await;

    // Eager and lazy objects, renamed once they are in the object store.
    let mut objects: BTreeMap<String, (String, Vec<u8>)> = BTreeMap::new();
    let mut persisted_first = Vec::new();
    for i in 0..8u64 {
        for (kind, p) in [("e", Persistence::Eager), ("l", Persistence::Lazy)] {
            let key = format!("{kind}{i}");
            let v = content(100 + i + if kind == "e" { 0 } else { 50 }, 30_000 + i as usize * 4099);
            c.put(&key, &v, &PutOptions { persistence: p, ..PutOptions::default() }).await.unwrap();
            persisted_first.push(key.clone());
            objects.insert(key.to_uppercase(), (key, v));
        }
    }
    for k in &persisted_first {
        wait_until(&format!("{k} in the object store"), async || {
            persisted(&c.stat(k).await.unwrap().replicas)
        })
        .await;
        c.rename(k, &k.to_uppercase(), RenameMode::NoReplace).await.unwrap();
    }
    for new in objects.keys() {
        wait_until(&format!("{new} in the object store"), async || {
            persisted(&c.stat(new).await.unwrap().replicas)
        })
        .await;
    }

    // Persisted objects renamed in a loop while every process is killed.
    let n = 60;
    let bytes = |i: usize| content(5000 + i as u64, 8_000 + i * 131);
    let pairs: Arc<Vec<(String, String)>> =
        Arc::new((0..n).map(|i| (format!("k/a{i}"), format!("k/b{i}"))).collect());
    let eager = PutOptions { persistence: Persistence::Eager, ..PutOptions::default() };
    for (i, (from, _)) in pairs.iter().enumerate() {
        c.put(from, &bytes(i), &eager).await.unwrap();
    }
    let done = Arc::new(AtomicUsize::new(0));
    let loops = {
        let (c, pairs, done) = (c.clone(), pairs.clone(), done.clone());
        tokio::spawn(async move { rename_loops(&c, pairs, 3, done).await })
    };
    wait_until("renames before the kill", async || done.load(Ordering::Acquire) >= 20).await;
    cluster.kill_master();
    cluster.kill_nodes();
    let outcomes = loops.await.unwrap();
    drop(c);

    // Everything again, nodes with new, empty data directories: only the object store is left.
    cluster.start_master();
    cluster.start_node();
    cluster.start_node();
    let c = cluster.client().await;
    wait_until("2 nodes and the object store scanned", async || {
        c.stats().await.is_ok_and(|s| s.nodes == 2 && !s.scanning_object_store)
    })
    .await;
    for (new, (old, v)) in &objects {
        match c.get(old).await {
            Err(e) => assert_eq!(e.kind(), ErrorKind::NotFound, "{old}: {e}"),
            Ok(got) => panic!("{old} came back ({} bytes, the original: {})", got.len(), &got == v),
        }
        let got = c.get(new).await.unwrap_or_else(|e| panic!("{new}: {e}"));
        assert!(&got == v, "{new}: {} bytes that are not the original", got.len());
    }
    check_one_name(&c, &pairs, &outcomes, &bytes).await;
}

/// A lazy object renamed right after its put, while its write-back may be queued or running
/// under the old name: after every process is killed and restarted empty, only the new name
/// comes back from the object store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_objects_renamed_while_their_write_back_runs_keep_one_name() {
    let data = tempfile::tempdir().unwrap();
    let store = format!("fs:{}", data.path().join("objects").display());
    let mut o = ClusterOpts { nodes: 1, ..ClusterOpts::default() };
    o.master_args.extend(["--object-store".to_string(), store.clone()]);
    o.node_args.extend(["--object-store".into(), store, "--nvme".into(), "0".into()]);
    o.data_root = Some(data.path().join("nodes"));
    let mut cluster = Cluster::start(o).await;
    let c = cluster.client().await;
    let lazy = PutOptions { persistence: Persistence::Lazy, ..PutOptions::default() };
    let n = 16;
    let bytes = |i: usize| content(300 + i as u64, 20_000 + i * 777);
    for i in 0..n {
        c.put(&format!("q{i}"), &bytes(i), &lazy).await.unwrap();
        c.rename(&format!("q{i}"), &format!("Q{i}"), RenameMode::NoReplace).await.unwrap();
    }
    for i in 0..n {
        wait_until(&format!("Q{i} in the object store"), async || {
            persisted(&c.stat(&format!("Q{i}")).await.unwrap().replicas)
        })
        .await;
    }
    cluster.kill_master();
    cluster.kill_nodes();
    drop(c);
    cluster.start_master();
    cluster.start_node();
    let c = cluster.client().await;
    wait_until("a node and the object store scanned", async || {
        c.stats().await.is_ok_and(|s| s.nodes == 1 && !s.scanning_object_store)
    })
    .await;
    for i in 0..n {
        assert!(!c.exists(&format!("q{i}")).await.unwrap(), "q{i} came back");
        assert!(c.get(&format!("Q{i}")).await.unwrap() == bytes(i), "Q{i}");
    }
}
