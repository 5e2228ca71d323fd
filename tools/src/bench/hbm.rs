//! `kvfs bench hbm`: GPU memory (HBM) as kvfs moves it, against the driver's own copies
//! measured in the same run.
//!
//! Per size: the limit, raw synchronous `cuMemcpyHtoD`/`DtoH` between page-locked host memory
//! and device memory with nothing of kvfs in between (`kvfs_tiers::hbm::raw_pinned_copy_gbps`);
//! then the HBM medium's put and get (allocator, index, copy) from and into page-locked host
//! memory (how an engine's pinned CPU buffers reach it) and from ordinary pageable memory; then
//! the Transfer Engine reaching an HBM segment (a device block registered as device memory,
//! as a node's `--hbm` segment is): a peer engine writing and reading it over loopback tcp,
//! against raw loopback TCP measured in the same run (best of one and four streams), and the
//! owner's own engine copying from and into its registered host memory (page-locked by the
//! first copy), against the raw pinned copies.
//!
//! Where no CUDA driver is found it says so and exits with status 2 (`scripts/test-gpu`
//! relies on that).

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use kvfs_tiers::{HbmBlock, HbmMedium, Medium, PinnedHost, PutMode, PutOptions};
use kvfs_transfer::{BufferOptions, Engine, EngineConfig, TransferOp, TransferRequest, Transports};

use super::limits::{Direction, raw_tcp_gbps, serve_raw_tcp};
use super::report::{Figure, Reporter};

#[derive(clap::Args, Debug)]
pub struct HbmArgs {
    /// Object sizes (comma separated; K/M/G are binary units).
    #[arg(long, value_delimiter = ',', default_value = "4K,1M,16M,64M,256M",
          value_parser = super::report::parse_bytes)]
    pub sizes: Vec<u64>,
    /// Timed repetitions per case (the median is reported).
    #[arg(long, default_value_t = 9)]
    pub iters: usize,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The exit status when no CUDA driver is found.
pub const NO_DRIVER_EXIT: i32 = 2;

pub async fn run(a: HbmArgs) -> anyhow::Result<()> {
    if !kvfs_tiers::hbm::driver_present() {
        eprintln!(
            "kvfs bench hbm: no CUDA driver found (libcuda.so not loadable): HBM needs an NVIDIA \
             GPU and its driver"
        );
        std::process::exit(NO_DRIVER_EXIT);
    }
    anyhow::ensure!(!a.sizes.is_empty() && a.iters > 0, "sizes and iters must be given");
    let max = *a.sizes.iter().max().expect("sizes") as usize;
    let mut out = Reporter::new(a.json);
    let limits_block = HbmBlock::open(0, 4096).context("open the GPU")?;
    let medium = HbmMedium::open(0, 2 * max as u64 + (1 << 20)).context("open the HBM medium")?;
    let mut pinned = PinnedHost::new(medium.context(), max).context("pinned host memory")?;
    pinned.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let mut pageable = vec![0u8; max];
    pageable.copy_from_slice(pinned.as_slice());

    // The Transfer Engine: an owner with the device block registered (as a node's HBM
    // segment), a peer over loopback tcp.
    let block = Arc::new(HbmBlock::open(0, max as u64).context("open the segment's block")?);
    let cfg = EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() };
    let owner = Engine::start(cfg.clone()).await?;
    let dev: Arc<dyn kvfs_transfer::DeviceMemory> = Arc::new(kvfs_node::HbmDevice(block.clone()));
    owner.register_device_memory(block.base(), block.len(), dev)?;
    let peer = Engine::start(cfg).await?;
    let peer_buf =
        peer.alloc_buffer(max, &BufferOptions { populate: true, ..Default::default() })?;
    peer_buf.write_at(0, &pageable)?;
    let own_buf =
        owner.alloc_buffer(max, &BufferOptions { populate: true, ..Default::default() })?;
    let to_owner = peer.open_segment(owner.name()).await?;
    let to_self = owner.open_segment(owner.name()).await?;
    let raw_listener = TcpListener::bind("127.0.0.1:0")?;
    let raw_addr = raw_listener.local_addr()?;
    std::thread::spawn(move || serve_raw_tcp(raw_listener));

    for &size in &a.sizes {
        let n = size as usize;
        let h2d = kvfs_tiers::hbm::raw_pinned_copy_gbps(&limits_block, n, true, a.iters)?;
        let d2h = kvfs_tiers::hbm::raw_pinned_copy_gbps(&limits_block, n, false, a.iters)?;
        let fig = |case: &str, op: &str, gbps: f64, limit: &str, limit_gbps: f64| Figure {
            bench: "hbm",
            case: case.into(),
            mode: Some("hbm".into()),
            op: op.into(),
            size_bytes: Some(size),
            gbps: Some(gbps),
            limit: Some(limit.into()),
            limit_gbps: Some(limit_gbps),
            ..Figure::default()
        };
        out.emit(&fig("raw pinned", "h2d", h2d, "cuMemcpy", h2d));
        out.emit(&fig("raw pinned", "d2h", d2h, "cuMemcpy", d2h));

        // The medium from and into pinned memory, then pageable memory.
        let opts = |v| PutOptions {
            mode: PutMode::Overwrite,
            checksum: Some([0; 32]),
            version: v,
            ..PutOptions::default()
        };
        let key = format!("bench/{size}");
        let mut v = 0;
        let put = median(a.iters, || {
            v += 1;
            let t = Instant::now();
            futures_block(medium.put(&key, &pinned.as_slice()[..n], opts(v)))?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        out.emit(&fig("medium pinned", "put", gbps(n, put), "cuMemcpy", h2d));
        let get = median(a.iters, || {
            let t = Instant::now();
            futures_block(medium.get_into(&key, &mut pinned.as_mut_slice()[..n]))?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        out.emit(&fig("medium pinned", "get", gbps(n, get), "cuMemcpy", d2h));
        anyhow::ensure!(pinned.as_slice()[..n] == pageable[..n], "HBM medium: bytes differ");
        let put = median(a.iters, || {
            v += 1;
            let t = Instant::now();
            futures_block(medium.put(&key, &pageable[..n], opts(v)))?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        out.emit(&fig("medium pageable", "put", gbps(n, put), "cuMemcpy", h2d));
        let mut back = vec![0u8; n];
        let get = median(a.iters, || {
            let t = Instant::now();
            futures_block(medium.get_into(&key, &mut back))?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        out.emit(&fig("medium pageable", "get", gbps(n, get), "cuMemcpy", d2h));
        anyhow::ensure!(back == pageable[..n], "HBM medium (pageable): bytes differ");
        futures_block(medium.remove(&key))?;

        // The engine: a peer over tcp, and the owner's own copies.
        // Raw loopback TCP, the best of one and four plain streams each way (the engine
        // stripes a large transfer over several connections).
        let mut tcp_limit = 0.0f64;
        for streams in [1, 4] {
            for dir in [Direction::Send, Direction::Receive] {
                tcp_limit = tcp_limit.max(raw_tcp_gbps(raw_addr, n.max(64 << 20), streams, dir)?);
            }
        }
        for (case, eng, seg, local, limit, lw, lr) in [
            ("engine tcp peer", &peer, &to_owner, peer_buf.addr(), "tcp", tcp_limit, tcp_limit),
            ("engine own", &owner, &to_self, own_buf.addr(), "cuMemcpy", h2d, d2h),
        ] {
            if case == "engine own" {
                own_buf.write_at(0, &pageable[..n])?;
            }
            for (op, name, lim) in
                [(TransferOp::Write, "write", lw), (TransferOp::Read, "read", lr)]
            {
                let req = TransferRequest {
                    op,
                    segment: seg.clone(),
                    local_addr: local,
                    remote_addr: block.base(),
                    len: size,
                };
                eng.transfer_one(&req).await?;
                let mut secs = Vec::with_capacity(a.iters);
                for _ in 0..a.iters {
                    let t = Instant::now();
                    eng.transfer_one(&req).await?;
                    secs.push(t.elapsed().as_secs_f64());
                }
                secs.sort_by(f64::total_cmp);
                out.emit(&fig(case, name, gbps(n, secs[secs.len() / 2]), limit, lim));
            }
            let mut check = vec![0u8; n];
            let b = if case == "engine own" { &own_buf } else { &peer_buf };
            b.read_at(0, &mut check)?;
            anyhow::ensure!(check == pageable[..n], "{case}: bytes read back differ");
        }
    }
    Ok(())
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// The median of `iters` timings after one untimed call.
fn median(iters: usize, mut f: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<f64> {
    f()?;
    let mut v = Vec::with_capacity(iters);
    for _ in 0..iters {
        v.push(f()?);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// Runs one of the medium's futures (they do their copies synchronously inside) to its end on
/// this thread.
fn futures_block<T>(
    f: impl std::future::Future<Output = kvfs_tiers::Result<T>>,
) -> anyhow::Result<T> {
    Ok(tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))?)
}
