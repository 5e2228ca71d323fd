//! Prints the tier figures: raw O_DIRECT vs the NVMe medium (ratio), blake3 cost, and lazy
//! write-back throughput. Usage:
//!   cargo run --release -p kvfs-tiers --example tiers_bench -- [DIR] [OBJECT_MIB] [OBJECTS] [--json]
//! DIR must be on the disk to measure (default: the system temp dir). KVFS_BENCH_QD and
//! KVFS_BENCH_CHUNK_KIB override the ring's queue depth and chunk size.

use std::sync::Arc;

use kvfs_tiers::bench::{self, DiskBenchConfig, Figure};
use kvfs_tiers::{ObjectStoreConfig, ObjectStoreMedium, RingConfig};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--json").collect();
    let json = std::env::args().any(|a| a == "--json");
    let dir =
        args.first().cloned().map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let mib: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(64);
    let objects: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let base = RingConfig {
        queue_depth: env("KVFS_BENCH_QD").unwrap_or(RingConfig::default().queue_depth),
        chunk_bytes: env("KVFS_BENCH_CHUNK_KIB")
            .map_or(RingConfig::default().chunk_bytes, |k| k << 10),
        ..RingConfig::default()
    };
    let mut figures = Vec::new();
    for rayon in [true, false] {
        let cfg = DiskBenchConfig {
            object_bytes: mib << 20,
            objects,
            ring: RingConfig { hash_with_rayon: rayon, ..base },
            ..DiskBenchConfig::new(&dir)
        };
        figures.extend(bench::disk(&cfg).await?);
    }
    let (one, par) = bench::blake3_gbps(mib << 20);
    let wb_dir = dir.join(format!("kvfs-bench-wb-{}", std::process::id()));
    std::fs::create_dir_all(&wb_dir)?;
    let target =
        Arc::new(ObjectStoreMedium::open(ObjectStoreConfig::Fs { root: wb_dir.join("bucket") })?);
    figures.push(bench::writeback(target, &wb_dir, 32, 4 << 20).await?);
    std::fs::remove_dir_all(&wb_dir)?;
    if json {
        for f in &figures {
            println!("{}", f.to_json());
        }
        println!(
            "{{\"bench\":\"tiers\",\"case\":\"blake3\",\"mode\":\"1 thread\",\"op\":\"hash\",\"size_bytes\":{},\"gbps\":{one:.4}}}",
            mib << 20
        );
        println!(
            "{{\"bench\":\"tiers\",\"case\":\"blake3\",\"mode\":\"rayon\",\"op\":\"hash\",\"size_bytes\":{},\"gbps\":{par:.4}}}",
            mib << 20
        );
    } else {
        println!("{}", Figure::header());
        for f in &figures {
            println!("{}", f.to_row());
        }
        println!("blake3 over {mib} MiB: {one:.3} GB/s one thread, {par:.3} GB/s rayon");
    }
    Ok(())
}
