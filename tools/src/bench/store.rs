//! `kvfs bench store`: the store's client calls against a node in another process, per mode,
//! call and object size, each figure held against the machine's limit measured next to it.
//!
//! The bench starts a peer process (`kvfs bench store-peer`, this same binary) running a master
//! and a node that holds the data, plus a raw TCP server. This process is the client, in two
//! modes: `tcp` (its engine uses tcp only, so bytes cross loopback sockets between the two
//! processes) and `shm` (same host: the node's segment is mapped and a transfer is a memcpy).
//! Per mode and size it measures put/get (bytes API, staged), put_from/get_into (zero-copy,
//! registered memory) one object at a time (latency percentiles), and their batch forms
//! (up to 256 objects or 128 MiB per call), then exists and remove rates on 10 000-key
//! batches. Put keys are fresh every round (first writer wins would make repeats no-ops) and
//! are removed between rounds, outside the timed region, so the node never fills up.
//!
//! Limits: raw loopback TCP in the same direction (plain sockets to the peer process, the best
//! of one and four streams) for tcp mode, single-thread memcpy for shm mode, measured before
//! each of three rounds of every figure and after the last (`limits::interleaved_with`; six
//! rounds for a single call over tcp, which also takes the raw round trip of its size with
//! each): the ratios use the medians, so a busy neighbour moves figure and limit together.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvfs_client::{Client, ClientConfig, GetInto, PutFrom, PutOptions};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig};
use kvfs_transfer::{Buffer, BufferOptions, EngineConfig, Transports};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::limits::{Direction, Limit, Timed, interleaved_with, raw_rtt_p50_us, serve_raw_tcp};
use super::report::{Figure, Reporter, Samples};

/// Rounds of (limit, case) per figure; see `limits::interleaved`.
const ROUNDS: usize = 3;
/// Rounds of a single call over tcp, whose round-trip limit is measured with each round.
const RTT_ROUNDS: usize = 6;

const BATCH_BYTES_MAX: u64 = 128 << 20;
const BATCH_ITEMS_MAX: u64 = 256;
const META_KEYS: usize = 10_000;

/// Options of `kvfs bench store`.
#[derive(Debug, Clone)]
pub struct StoreBench {
    pub sizes: Vec<u64>,
    pub modes: Vec<String>,
    pub min_ms: u64,
    pub json: bool,
    pub node_dram: u64,
    pub limit_bytes: usize,
    /// The calls to measure; empty: all of them.
    pub ops: Vec<String>,
}

/// The calls moving data, in the order measured.
const DATA_OPS: [&str; 8] = [
    "put",
    "get",
    "put_from",
    "get_into",
    "put_batch",
    "get_batch",
    "put_from_batch",
    "get_into_batch",
];

/// The calls on keys alone.
const META_OPS: [&str; 3] = ["exists", "exists_batch", "remove_batch"];

/// The peer: master + node + raw TCP server; prints `READY <master> <raw tcp>`.
pub async fn serve_peer(dram: u64) -> anyhow::Result<()> {
    let cfg = ServiceConfig { listen: "127.0.0.1:0".parse()?, ..ServiceConfig::default() };
    // Apart from the node's runtime, as `kvfs up` runs it (see `OwnRuntime`).
    let master_rt = crate::cmd::OwnRuntime::new("kvfs-master")?;
    let master = master_rt.run(MasterService::start(cfg)).await??;
    let addr = master.rpc_addr().to_string();
    let node =
        Node::start(NodeConfig { master: addr.clone(), dram_bytes: dram, ..NodeConfig::default() })
            .await?;
    node.wait_registered(Duration::from_secs(120)).await?;
    let raw = std::net::TcpListener::bind("127.0.0.1:0")?;
    let raw_addr = raw.local_addr()?;
    std::thread::spawn(move || serve_raw_tcp(raw));
    println!("READY {addr} {raw_addr}");
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = lines.next_line().await {}
    drop(node);
    drop(master);
    drop(master_rt);
    Ok(())
}

async fn start_peer(
    dram: u64,
) -> anyhow::Result<(tokio::process::Child, String, std::net::SocketAddr)> {
    let exe = std::env::current_exe().context("locating the kvfs binary")?;
    let mut child = tokio::process::Command::new(exe)
        .args(["bench", "store-peer", "--dram", &dram.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the bench peer")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    tokio::time::timeout(Duration::from_secs(180), BufReader::new(stdout).read_line(&mut line))
        .await
        .context("the bench peer did not start within 180 s")??;
    let w: Vec<&str> = line.split_whitespace().collect();
    if w.len() != 3 || w[0] != "READY" {
        bail!("unexpected answer from the bench peer: {line:?}");
    }
    Ok((child, w[1].to_string(), w[2].parse()?))
}

struct Ctx {
    client: Client,
    src: Arc<Buffer>,
    dst: Arc<Buffer>,
    mode: String,
    raw: std::net::SocketAddr,
    limit_bytes: usize,
    min: Duration,
    round: u64,
}

impl Ctx {
    /// tcp mode: raw loopback TCP in the op's direction; shm mode: memcpy.
    fn limit_for(&self, op: &str) -> Limit {
        if self.mode == "tcp" {
            let dir = if op.starts_with("put") { Direction::Send } else { Direction::Receive };
            Limit::Tcp { addr: self.raw, bytes: self.limit_bytes, streams: 4, dir: Some(dir) }
        } else {
            Limit::Memcpy { bytes: self.limit_bytes }
        }
    }
}

pub async fn run(opts: StoreBench) -> anyhow::Result<()> {
    if let Some(bad) =
        opts.ops.iter().find(|o| !DATA_OPS.contains(&o.as_str()) && !META_OPS.contains(&o.as_str()))
    {
        bail!("unknown op {bad:?} ({}, {})", DATA_OPS.join(", "), META_OPS.join(", "));
    }
    let wanted = |op: &str| opts.ops.is_empty() || opts.ops.iter().any(|o| o == op);
    // As the Python package does at import: large gets land on pages already faulted in.
    kvfs_client::keep_freed_buffers();
    let (_peer, master, raw) = start_peer(opts.node_dram).await?;
    let mut rep = Reporter::new(opts.json);
    let max_size = opts.sizes.iter().copied().max().unwrap_or(1 << 20);
    let buf_bytes = (max_size.max(BATCH_BYTES_MAX.min(max_size * BATCH_ITEMS_MAX))) as usize;
    for mode in &opts.modes {
        let transports = match mode.as_str() {
            "tcp" => Transports::tcp_only(),
            "shm" => Transports::default(),
            other => bail!("unknown mode {other:?} (tcp, shm)"),
        };
        let cfg = ClientConfig {
            master: master.clone(),
            engine: EngineConfig { transports, ..EngineConfig::default() },
            ..ClientConfig::default()
        };
        let client = Client::connect(cfg).await.context("connecting to the bench peer's master")?;
        let bopts = BufferOptions { populate: true, ..BufferOptions::default() };
        let src = client.engine().alloc_buffer(buf_bytes, &bopts)?;
        let dst = client.engine().alloc_buffer(buf_bytes, &bopts)?;
        let mut ctx = Ctx {
            client,
            src,
            dst,
            mode: mode.clone(),
            raw,
            limit_bytes: opts.limit_bytes,
            min: Duration::from_millis(opts.min_ms),
            round: 0,
        };
        for &size in &opts.sizes {
            for op in DATA_OPS.into_iter().filter(|op| wanted(op)) {
                let (limit_gbps, rtt, mut s) = run_op(&mut ctx, op, size)
                    .await
                    .with_context(|| format!("{mode} {op} {size} B"))?;
                let limit = ctx.limit_for(op);
                let mut f = figure(&ctx, op, Some(size), &mut s, Some((limit.name(), limit_gbps)));
                f.rtt_p50_us = rtt;
                rep.emit(&f);
            }
        }
        for op in META_OPS.into_iter().filter(|op| wanted(op)) {
            let mut s = run_meta(&mut ctx, op).await.with_context(|| format!("{mode} {op}"))?;
            rep.emit(&figure(&ctx, op, None, &mut s, None));
        }
    }
    Ok(())
}

fn figure(
    ctx: &Ctx,
    op: &str,
    size: Option<u64>,
    s: &mut Samples,
    limit: Option<(&str, f64)>,
) -> Figure {
    let moves_bytes = size.is_some();
    Figure {
        bench: "store",
        case: if op.ends_with("_batch") { "batch".into() } else { "qd1".into() },
        mode: Some(ctx.mode.clone()),
        op: op.into(),
        size_bytes: size,
        gbps: moves_bytes.then(|| s.gbps()),
        ops_per_s: Some(s.ops_per_s()),
        p50_us: s.percentile(0.5),
        p99_us: s.percentile(0.99),
        limit: limit.map(|l| l.0.to_string()),
        limit_gbps: limit.map(|l| l.1),
        ..Default::default()
    }
}

fn batch_items(op: &str, size: u64) -> u64 {
    if op.ends_with("_batch") { (BATCH_BYTES_MAX / size).clamp(1, BATCH_ITEMS_MAX) } else { 1 }
}

/// Raw round trips timed per measurement of the round-trip limit (each figure takes seven),
/// for small objects; large ones take as many as move `RTT_BYTES` (at least `RTT_ITERS_MIN`),
/// so a 64 MiB figure's limits take a few seconds, not minutes.
const RTT_ITERS: usize = 1000;
const RTT_ITERS_MIN: usize = 7;
const RTT_BYTES: u64 = 512 << 20;

fn rtt_iters(size: u64) -> usize {
    ((RTT_BYTES / size.max(1)) as usize).clamp(RTT_ITERS_MIN, RTT_ITERS)
}

/// p50 of a raw request/response round trip of `size` bytes in `op`'s direction between this
/// process and the peer (see `limits::raw_rtt_p50_us`).
async fn raw_rtt(ctx: &Ctx, op: &str, size: u64) -> anyhow::Result<f64> {
    let dir = if op.starts_with("put") { Direction::Send } else { Direction::Receive };
    let addr = ctx.raw;
    Ok(tokio::task::spawn_blocking(move || {
        raw_rtt_p50_us(addr, size as usize, dir, rtt_iters(size))
    })
    .await??)
}

/// Runs one operation for at least the minimum time; every round is one timed call. Single
/// calls over tcp also get the raw round trip of their size, measured next to the bandwidth
/// limit before each of their rounds and after the last (the median of those p50s, as for the
/// other limits: on a 2-core VM the host moves a 10 us round trip by a fifth from one second
/// to the next, and a round trip measured only before and after the calls let that swing
/// decide the ratio: 1.09-1.81x in six runs of the same build).
async fn run_op(ctx: &mut Ctx, op: &str, size: u64) -> anyhow::Result<(f64, Option<f64>, Samples)> {
    let single = !op.ends_with("_batch") && ctx.mode == "tcp";
    let n = batch_items(op, size);
    let is_put = op.starts_with("put");
    let prefix = format!("bench/{}/{op}/{size}", ctx.mode);
    let fixed: Vec<String> = (0..n).map(|i| format!("{prefix}/{i}")).collect();
    // Gets read a fixed set of objects, put once up front.
    if !is_put {
        put_keys(ctx, &fixed, size).await?;
    }
    let limit = ctx.limit_for(op);
    let round = std::cell::Cell::new(ctx.round);
    let ctx_ref = &*ctx;
    let one = || {
        let r = round.get() + 1;
        round.set(r);
        let keys: Vec<String> = if is_put {
            (0..n).map(|i| format!("{prefix}/{r}/{i}")).collect()
        } else {
            fixed.clone()
        };
        async move {
            let t = Instant::now();
            call(ctx_ref, op, &keys, size).await?;
            let took = t.elapsed();
            if is_put {
                // Untimed: keep the node from filling up.
                for r in ctx_ref.client.remove_batch(&keys, true).await {
                    r?;
                }
            }
            Ok(Timed { took, bytes: n * size, ops: n })
        }
    };
    one().await?; // warm-up
    let rounds = if single { RTT_ROUNDS } else { ROUNDS };
    let per_round = ctx.min.div_f64(rounds as f64);
    let rtts = std::cell::RefCell::new(Vec::with_capacity(rounds + 1));
    let measure = || {
        let (limit, rtts) = (&limit, &rtts);
        async move {
            let gbps = limit.measure().await?;
            if single {
                let rtt = raw_rtt(ctx_ref, op, size).await?;
                rtts.borrow_mut().push(rtt);
            }
            Ok(gbps)
        }
    };
    let out = interleaved_with(measure, rounds, per_round, one).await?;
    ctx.round = round.get();
    if !is_put {
        for r in ctx.client.remove_batch(&fixed, true).await {
            r?;
        }
    }
    let mut rtts = rtts.into_inner();
    rtts.sort_by(|a, b| a.total_cmp(b));
    let rtt = rtts.get(rtts.len() / 2).copied();
    Ok((out.0, rtt, out.1))
}

async fn put_keys(ctx: &Ctx, keys: &[String], size: u64) -> anyhow::Result<()> {
    let items: Vec<PutFrom> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| PutFrom { key: k, addr: ctx.src.addr() + i as u64 * size, len: size })
        .collect();
    for r in ctx.client.put_from_batch(&items, &PutOptions::default()).await {
        r?;
    }
    Ok(())
}

async fn call(ctx: &Ctx, op: &str, keys: &[String], size: u64) -> anyhow::Result<()> {
    let c = &ctx.client;
    let opts = PutOptions::default();
    match op {
        "put" => {
            // SAFETY: no transfer writes the source buffer during the bench.
            let data = unsafe { &ctx.src.as_slice()[..size as usize] };
            c.put(&keys[0], data, &opts).await?;
        }
        "get" => {
            let v = c.get(&keys[0]).await?;
            anyhow::ensure!(v.len() as u64 == size, "short read");
        }
        "put_from" => c.put_from(&keys[0], ctx.src.addr(), size, &opts).await?,
        "get_into" => {
            c.get_into(&keys[0], ctx.dst.addr(), size).await?;
        }
        "put_batch" => {
            // SAFETY: as above.
            let all = unsafe { ctx.src.as_slice() };
            let items: Vec<(&str, &[u8])> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), &all[i * size as usize..(i + 1) * size as usize]))
                .collect();
            for r in c.put_batch(&items, &opts).await {
                r?;
            }
        }
        "get_batch" => {
            for r in c.get_batch(keys).await {
                anyhow::ensure!(r?.len() as u64 == size, "short read");
            }
        }
        "put_from_batch" => put_keys(ctx, keys, size).await?,
        "get_into_batch" => {
            let items: Vec<GetInto> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| GetInto { key: k, addr: ctx.dst.addr() + i as u64 * size, cap: size })
                .collect();
            for r in c.get_into_batch(&items).await {
                r?;
            }
        }
        other => bail!("unknown op {other}"),
    }
    Ok(())
}

/// exists and remove rates on batches of 10 000 small objects.
async fn run_meta(ctx: &mut Ctx, op: &str) -> anyhow::Result<Samples> {
    let mut s = Samples::default();
    if op == "exists" {
        // One key per call: the master round trip a lookup costs.
        put_keys_small(ctx, &["bench/meta/one".to_string()]).await?;
        let start = Instant::now();
        while s.ops < 100 || start.elapsed() < ctx.min {
            let t = Instant::now();
            anyhow::ensure!(ctx.client.exists("bench/meta/one").await?, "the key vanished");
            let took = t.elapsed();
            s.lat_us.push(took.as_secs_f64() * 1e6);
            s.ops += 1;
            s.elapsed_s += took.as_secs_f64();
        }
        ctx.client.remove("bench/meta/one", true).await?;
        return Ok(s);
    }
    let start = Instant::now();
    while s.ops < (5 * META_KEYS) as u64 || start.elapsed() < ctx.min {
        ctx.round += 1;
        let keys: Vec<String> =
            (0..META_KEYS).map(|i| format!("bench/meta/{}/{:064x}", ctx.round, i)).collect();
        let t = Instant::now();
        let took = if op == "exists_batch" {
            // Half hits, half misses, as a prefix lookup of an engine sees them.
            put_keys_small(ctx, &keys[..META_KEYS / 2]).await?;
            let t = Instant::now();
            for r in ctx.client.exists_batch(&keys).await {
                r?;
            }
            let took = t.elapsed();
            ctx.client.remove_batch(&keys[..META_KEYS / 2], true).await;
            took
        } else {
            put_keys_small(ctx, &keys).await?;
            let t = Instant::now();
            for r in ctx.client.remove_batch(&keys, true).await {
                r?;
            }
            t.elapsed()
        };
        let _ = t;
        s.lat_us.push(took.as_secs_f64() * 1e6);
        s.ops += META_KEYS as u64;
        s.elapsed_s += took.as_secs_f64();
    }
    Ok(s)
}

async fn put_keys_small(ctx: &Ctx, keys: &[String]) -> anyhow::Result<()> {
    let items: Vec<PutFrom> =
        keys.iter().map(|k| PutFrom { key: k, addr: ctx.src.addr(), len: 64 }).collect();
    for r in ctx.client.put_from_batch(&items, &PutOptions::default()).await {
        r?;
    }
    Ok(())
}
