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
