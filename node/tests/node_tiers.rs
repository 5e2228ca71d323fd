//! The node's in-process tier API, with a real master service and a real NVMe tier on disk:
//! `Node::local_object_file` (what the FUSE daemon's passthrough uses) and the HBM probe.
//! The multi-process tier scenarios are in `tools/tests/tiers.rs`.

use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig, TierConfig};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 11) as u8).collect()
}

async fn master() -> Result<MasterService> {
    let mut cfg = ServiceConfig {
        listen: "127.0.0.1:0".parse()?,
        heartbeat_ms: 100,
        recovery_grace_ms: 0,
        ..ServiceConfig::default()
    };
    cfg.directory.lease_ttl_ms = 200;
    Ok(MasterService::start(cfg).await?)
}

fn node_config(master: &MasterService, dir: &std::path::Path) -> NodeConfig {
    let mut tiers = TierConfig { nvme_bytes: 64 << 20, tick_ms: 20, ..TierConfig::default() };
    // Everything is cold: every committed object is demoted to NVMe.
    tiers.policy.dram_high_watermark = 0.001;
    tiers.policy.dram_low_watermark = 0.0005;
    NodeConfig {
        master: master.rpc_addr().to_string(),
        dram_bytes: 16 << 20,
        populate: false,
        data_dir: Some(dir.to_owned()),
        tiers,
        ..NodeConfig::default()
    }
}

async fn wait_nvme_only(c: &Client, key: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = c.stat(key).await?;
        if v.replicas.len() == 1 && v.replicas[0].tier == kvfs_client::Tier::Nvme {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{key} was not demoted: {:?}", v.replicas);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_object_file_hands_out_exactly_the_object_and_refuses_corrupt_copies() -> Result<()> {
    let m = master().await?;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let node = Node::start(node_config(&m, dir.path())).await?;
    node.wait_registered(Duration::from_secs(10)).await?;
    let c = Client::connect(ClientConfig {
        master: m.rpc_addr().to_string(),
        ..ClientConfig::default()
    })
    .await?;
    let good = pattern(1_234_567, 1);
    let bad = pattern(70_001, 2);
    c.put("fs/good", &good, &PutOptions::default()).await?;
    c.put("fs/bad", &bad, &PutOptions::default()).await?;
    wait_nvme_only(&c, "fs/good").await?;
    wait_nvme_only(&c, "fs/bad").await?;

    let (mut f, size) = node.local_object_file("fs/good").context("an NVMe object")?;
    ensure!(size == good.len() as u64);
    ensure!(f.metadata()?.len() == size, "the file ends where the object ends (passthrough)");
    let mut got = Vec::new();
    f.read_to_end(&mut got)?;
    ensure!(got == good, "the file is the object from offset 0");

    // Damage the other object's file behind the node's back.
    let digest = blake3::hash(b"fs/bad").to_hex().to_string();
    let sub = dir.path().join("nvme/objects").join(&digest[..2]);
    let data = std::fs::read_dir(&sub)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{digest}.")))
        })
        .context("data file")?;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&data)?;
        f.write_all_at(b"!", 777)?;
    }
    ensure!(node.local_object_file("fs/bad").is_none(), "a corrupt copy is not handed out");
    ensure!(node.stats().corrupt_reads_nvme == 1, "and it is counted");
    ensure!(node.local_object_file("fs/none").is_none());
    // A get still works for the good object (the master loads it into DRAM).
    ensure!(c.get("fs/good").await? == good);
    ensure!(node.local_object_file("fs/good").is_some(), "the NVMe copy stays after a load");
    Ok(())
}

/// There is no GPU on this machine's kind: the node says so in its stats, and a request for
/// HBM bytes is refused with a message that names the missing CUDA driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbm_is_reported_clearly() -> Result<()> {
    let m = master().await?;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let present = kvfs_tiers::hbm::driver_present();
    let node = Node::start(node_config(&m, dir.path())).await?;
    ensure!(node.stats().hbm_available == present);
    drop(node);
    if !present {
        let mut cfg = node_config(&m, &dir.path().join("hbm"));
        cfg.tiers.hbm_bytes = 1 << 20;
        let e = Node::start(cfg).await.err().context("HBM bytes without a driver")?;
        ensure!(e.to_string().contains("CUDA driver"), "{e}");
        ensure!(e.kind() == kvfs_client::ErrorKind::Unavailable);
    }
    Ok(())
}

/// The node's stats (what every heartbeat carries) read while the master's commit records
/// arrive: the two take the node's index and policy locks, and once took them in opposite
/// orders, so a heartbeat and a commit could deadlock the whole node (the master then expired
/// it and forgot its objects). Puts and stats both keep going here. The node runs on a runtime
/// of its own, so a deadlocked node fails the test (the client's calls time out) instead of
/// hanging it.
#[test]
fn stats_read_during_commits_never_deadlock() -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let runtime =
        || tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
    let (node_rt, test_rt) = (runtime()?, runtime()?);
    let m = test_rt.block_on(master())?;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let mut cfg = node_config(&m, dir.path());
    // Everything stays in DRAM: the commits, not demotions, are what runs beside the stats.
    cfg.tiers.policy.dram_high_watermark = 0.95;
    cfg.tiers.policy.dram_low_watermark = 0.9;
    cfg.dram_bytes = 64 << 20;
    let node = Arc::new(node_rt.block_on(Node::start(cfg))?);
    node_rt.block_on(node.wait_registered(Duration::from_secs(10)))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = {
        let (node, stop) = (node.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(node.stats());
                reads += 1;
            }
            let _ = tx.send(reads);
        })
    };
    let data = pattern(4096, 9);
    let puts = test_rt.block_on(async {
        let c = Client::connect(ClientConfig {
            master: m.rpc_addr().to_string(),
            ..ClientConfig::default()
        })
        .await?;
        for round in 0..40 {
            let keys: Vec<String> = (0..50).map(|i| format!("stats/{round}/{i}")).collect();
            let items: Vec<(&str, &[u8])> =
                keys.iter().map(|k| (k.as_str(), data.as_slice())).collect();
            for r in c.put_batch(&items, &PutOptions::default()).await {
                r?;
            }
            for r in c.remove_batch(&keys, true).await {
                r?;
            }
        }
        // The node still answers after the run.
        c.put("stats/after", &data, &PutOptions::default()).await?;
        ensure!(c.get("stats/after").await? == data, "read back different");
        anyhow::Ok(())
    });
    stop.store(true, Ordering::Relaxed);
    let reads = rx.recv_timeout(Duration::from_secs(10));
    if puts.is_err() || reads.is_err() {
        // A deadlocked node's threads never end: leave them rather than hang on them.
        std::mem::forget(node);
        std::mem::forget(node_rt);
        std::mem::forget(reader);
    } else {
        reader.join().map_err(|_| anyhow::anyhow!("the stats reader panicked"))?;
        // Each closes its connections on its own runtime.
        let entered = node_rt.enter();
        drop(node);
        drop(entered);
    }
    let entered = test_rt.enter();
    drop(m);
    drop(entered);
    puts.context("puts while stats were read")?;
    let reads = reads.context("the stats reader is stuck: the node's locks deadlocked")?;
    ensure!(reads > 0, "no stats read");
    Ok(())
}
