//! `kvfs bench tiers`: the NVMe tier, the object store write-back and promotions, each figure
//! held against the machine's own limit measured in the same run (DESIGN.md section 11).
//!
//! Cases (table names):
//! - `nvme tier` (against `raw direct`, and `raw newfile`: a new fallocated file per object): the NVMe medium's put and get of `--object-size` objects (io_uring, O_DIRECT,
//!   blake3 on the way, fsync per put) against raw O_DIRECT writes and reads of the same disk
//!   with the same ring shape, rounds interleaved (`kvfs_tiers::bench::disk`). The figure that
//!   matters is `get` vs raw read: the target is a ratio of at least 0.85.
//!   With `--raw-device DEV` (the block device `--dir` is on, such as an NVMe-oF namespace)
//!   also `raw device`: the raw file's own blocks read straight from the device (found with
//!   FIEMAP, checked to hold the bytes written), and the tier's get against that too.
//! - `blake3`: the checksum's own cost, one thread and rayon (what verification costs).
//! - `write-back`: lazy write-back DRAM -> object store through the crash-safe queue (one
//!   journal fsync per record) against direct puts to the same store.
//! - `promotion`: a get of an object that only the NVMe tier holds, in a cluster started in
//!   this process (master, one node with a data directory under `--dir`, one client): the
//!   master has the node copy the object into DRAM (verified), then the client reads it with
//!   the Transfer Engine. p50/p99 per get, GB/s against raw O_DIRECT reads of the same object
//!   size; a get of the same objects once they are in DRAM (`dram get`) is printed next to
//!   it, against memcpy.
//!
//! `--dir` must be on the disk to measure (not tmpfs: O_DIRECT). Absolute times on a shared
//! 2-core machine are noise; the ratios are the figures.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvfs_client::{Client, ClientConfig, PutOptions, Tier};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig, TierConfig};
use kvfs_tiers::bench::{self as tb, DiskBenchConfig};
use kvfs_tiers::{ObjectStoreConfig, ObjectStoreMedium, RingConfig};
use kvfs_transfer::BufferOptions;

use super::limits::memcpy_gbps;
use super::report::{Figure, Reporter, Samples};

/// Options of `kvfs bench tiers`.
#[derive(Debug, Clone)]
pub struct TiersBench {
    pub dir: PathBuf,
    pub object_bytes: usize,
    pub objects: usize,
    pub rounds: usize,
    pub queue_depth: usize,
    pub chunk_bytes: usize,
    pub writeback_objects: usize,
    pub writeback_bytes: usize,
    pub promote_bytes: usize,
    pub promotes: usize,
    /// The block device `dir` is on, for the raw device read limit.
    pub raw_device: Option<PathBuf>,
    /// The object store for the write-back case (a directory under `dir` when `None`).
    pub object_store: Option<ObjectStoreConfig>,
    pub json: bool,
}

/// Short case and mode names for the table (the tiers crate's names are long).
fn names(f: &tb::Figure, ring: RingConfig) -> (String, String) {
    let disk_mode = format!("qd{}x{}K", ring.queue_depth, ring.chunk_bytes >> 10);
    let case = match f.case.as_str() {
        "raw O_DIRECT" => "raw direct",
        "raw O_DIRECT new file" => "raw newfile",
        "raw O_DIRECT device" => "raw device",
        c if c.starts_with("nvme medium") => "nvme tier",
        "lazy write-back" => return ("write-back".into(), "lazy".into()),
        other => other,
    };
    (case.to_string(), disk_mode)
}

fn convert(f: &tb::Figure, ring: RingConfig) -> Figure {
    let finite = |v: f64| v.is_finite().then_some(v);
    let (case, mode) = names(f, ring);
    Figure {
        bench: "tiers",
        case,
        transport: None,
        mode: Some(mode),
        op: f.op.to_string(),
        size_bytes: Some(f.size_bytes),
        gbps: finite(f.gbps),
        ops_per_s: finite(f.ops_per_s),
        p50_us: finite(f.p50_us).filter(|v| *v > 0.0),
        p99_us: finite(f.p99_us).filter(|v| *v > 0.0),
        limit: f.limit.map(str::to_string),
        limit_gbps: f.limit_gbps,
        rtt_p50_us: None,
    }
}

pub async fn run(o: TiersBench) -> anyhow::Result<()> {
    if o.objects == 0 || o.rounds == 0 || o.promotes == 0 || o.writeback_objects == 0 {
        bail!("--objects, --rounds, --promotes and --writeback-objects must be positive");
    }
    let ring = RingConfig {
        queue_depth: o.queue_depth,
        chunk_bytes: o.chunk_bytes,
        ..RingConfig::default()
    };
    ring.validate().map_err(|e| anyhow::anyhow!("--queue-depth / --chunk: {e}"))?;
    std::fs::create_dir_all(&o.dir).with_context(|| format!("creating {}", o.dir.display()))?;
    let work = o.dir.join(format!("kvfs-bench-tiers-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let r = run_in(&o, ring, &work).await;
    let _ = std::fs::remove_dir_all(&work);
    r
}

async fn run_in(o: &TiersBench, ring: RingConfig, work: &std::path::Path) -> anyhow::Result<()> {
    let mut rep = Reporter::new(o.json);
    // 1. The NVMe tier against raw O_DIRECT, same disk, same run.
    let cfg = DiskBenchConfig {
        object_bytes: o.object_bytes,
        objects: o.objects,
        rounds: o.rounds,
        ring,
        raw_device: o.raw_device.clone(),
        ..DiskBenchConfig::new(work)
    };
    for f in tb::disk(&cfg).await.context("NVMe tier vs raw O_DIRECT")? {
        rep.emit(&convert(&f, ring));
    }
    // 2. The checksum's own cost.
    let (one, par) = tb::blake3_gbps(o.object_bytes.min(256 << 20));
    for (mode, g) in [("1 thread", one), ("rayon", par)] {
        rep.emit(&Figure {
            bench: "tiers",
            case: "blake3".into(),
            mode: Some(mode.into()),
            op: "hash".into(),
            size_bytes: Some(o.object_bytes.min(256 << 20) as u64),
            gbps: Some(g),
            ..Default::default()
        });
    }
    // 3. Lazy write-back to the object store.
    let store = match &o.object_store {
        Some(c) => c.clone(),
        None => ObjectStoreConfig::Fs { root: work.join("objects") },
    };
    let target = Arc::new(ObjectStoreMedium::open(store.clone())?);
    let f = tb::writeback(target, work, o.writeback_objects, o.writeback_bytes)
        .await
        .context("write-back")?;
    rep.emit(&convert(&f, ring));
    // 4. Promotion: gets of NVMe-only objects through a real master and node.
    promotion(o, ring, work, &mut rep).await.context("promotion")
}

async fn promotion(
    o: &TiersBench,
    ring: RingConfig,
    work: &std::path::Path,
    rep: &mut Reporter,
) -> anyhow::Result<()> {
    let size = o.promote_bytes;
    // The limit: raw O_DIRECT reads of the same object size on the same disk.
    let raw = tb::disk(&DiskBenchConfig {
        object_bytes: size,
        objects: o.promotes.min(32),
        rounds: 3,
        ring,
        ..DiskBenchConfig::new(work)
    })
    .await?;
    let raw_read = raw.iter().find(|f| f.case == "raw O_DIRECT" && f.op == "read");
    let raw_read_gbps = raw_read.map(|f| f.gbps).context("raw read figure")?;
    let memcpy = memcpy_gbps(256 << 20);

    let mut mcfg = ServiceConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: None,
        heartbeat_ms: 200,
        recovery_grace_ms: 0,
        ..ServiceConfig::default()
    };
    mcfg.directory.lease_ttl_ms = 200;
    // Apart from the node's runtime, as `kvfs up` runs it (see `OwnRuntime`).
    let master_rt = crate::cmd::OwnRuntime::new("kvfs-master")?;
    let master = master_rt.run(MasterService::start(mcfg)).await??;
    let dram = ((o.promotes + 4) * size * 2).max(64 << 20) as u64;
    let mut tiers = TierConfig {
        nvme_bytes: (o.promotes as u64 + 4) * (size as u64 + (1 << 20)) * 2,
        tick_ms: 10,
        ring,
        ..TierConfig::default()
    };
    tiers.policy.dram_high_watermark = 1e-9;
    tiers.policy.dram_low_watermark = 1e-10;
    tiers.policy.demote_bytes_per_s = 100 << 30;
    tiers.policy.demote_burst_bytes = 1 << 30;
    let node = Node::start(NodeConfig {
        master: master.rpc_addr().to_string(),
        dram_bytes: dram,
        populate: true,
        data_dir: Some(work.join("node")),
        tiers,
        ..NodeConfig::default()
    })
    .await?;
    node.wait_registered(Duration::from_secs(10)).await?;
    let client = Client::connect(ClientConfig {
        master: master.rpc_addr().to_string(),
        rpc_timeout_ms: 60_000,
        ..ClientConfig::default()
    })
    .await?;
    let buf = client
        .engine()
        .alloc_buffer(size, &BufferOptions { populate: true, ..Default::default() })?;
    let keys: Vec<String> = (0..o.promotes).map(|i| format!("bench/promote/{i}")).collect();
    let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31) ^ (i >> 13) as u8).collect();
    for k in &keys {
        client.put(k, &data, &PutOptions::default()).await?;
    }
    // Wait until every object is on NVMe alone (the node demotes everything here).
    let deadline = Instant::now() + Duration::from_secs(120);
    for k in &keys {
        loop {
            let v = client.stat(k).await?;
            if v.replicas.iter().all(|r| r.tier == Tier::Nvme) {
                break;
            }
            if Instant::now() > deadline {
                bail!("{k} was not demoted to NVMe within 120 s: {:?}", v.replicas);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let mut cold = Samples::default();
    let mut warm = Samples::default();
    for k in &keys {
        let t = Instant::now();
        let n = client.get_into(k, buf.addr(), size as u64).await?;
        cold.lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        client.get_into(k, buf.addr(), size as u64).await?;
        warm.lat_us.push(t.elapsed().as_secs_f64() * 1e6);
        let mut check = vec![0u8; 64];
        buf.read_at(size - 64, &mut check)?;
        if n != size as u64 || check[..] != data[size - 64..] {
            bail!("{k}: the promoted object came back different");
        }
    }
    for (case, s, limit, limit_gbps) in
        [("promotion", &mut cold, "disk", raw_read_gbps), ("dram get", &mut warm, "memcpy", memcpy)]
    {
        let total_s: f64 = s.lat_us.iter().sum::<f64>() / 1e6;
        s.bytes = (size * s.lat_us.len()) as u64;
        s.ops = s.lat_us.len() as u64;
        s.elapsed_s = total_s;
        rep.emit(&Figure {
            bench: "tiers",
            case: case.into(),
            mode: Some("qd1".into()),
            op: "get".into(),
            size_bytes: Some(size as u64),
            gbps: Some(s.gbps()),
            ops_per_s: Some(s.ops_per_s()),
            p50_us: s.percentile(0.5),
            p99_us: s.percentile(0.99),
            limit: Some(limit.into()),
            limit_gbps: Some(limit_gbps),
            ..Default::default()
        });
    }
    client.close().await;
    node.shutdown().await;
    drop(master);
    Ok(())
}
