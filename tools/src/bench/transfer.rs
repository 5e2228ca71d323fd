//! `kvfs bench transfer`: the Transfer Engine between two processes, per transport, operation
//! and block size, each figure held against the machine's limit measured in the same run.
//!
//! The bench starts a peer process (`kvfs bench transfer-peer`, this same binary) that runs an
//! engine with one registered buffer and a raw TCP server. This process measures the limits
//! (single-thread memcpy of 1 GiB; plain loopback sockets to the peer), then runs two cases per
//! transport, operation and size:
//! - `qd1`: one request at a time (`transfer_one`): latency percentiles and the GB/s they give;
//! - `batch`: batches of up to 256 requests over disjoint ranges (at most 32 MiB per batch):
//!   the throughput an engine sees when it submits a layer's worth of blocks at once.
//!
//! tcp figures are held against raw loopback TCP in the same direction (the best of one plain
//! stream and as many streams as the engine uses connections), shm figures against
//! single-thread memcpy. Each figure runs in three rounds, each preceded by a measurement of
//! its limit (and one after the last): the ratio uses the median limit, so a neighbour that
//! slows the machine down slows both sides of the ratio.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvfs_transfer::{
    Buffer, BufferOptions, Engine, EngineConfig, SegmentHandle, TransferOp, TransferRequest,
    TransportKind, Transports,
};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::limits::{Direction, Limit, TcpLimits, Timed, interleaved, memcpy_gbps, serve_raw_tcp};
use super::report::{Figure, Reporter, Samples, human_bytes};

/// Rounds of (limit, case) per figure: the limit is measured next to the figure it divides.
const ROUNDS: usize = 3;

/// Size of the buffer on each side; every request fits inside it.
const BUF_BYTES: usize = 64 << 20;
const BATCH_BYTES_MAX: u64 = 32 << 20;
const BATCH_ITEMS_MAX: u64 = 256;

/// Options of `kvfs bench transfer`.
#[derive(Debug, Clone)]
pub struct TransferBench {
    pub sizes: Vec<u64>,
    pub transports: Vec<TransportKind>,
    pub min_ms: u64,
    pub json: bool,
    pub conns_per_peer: usize,
    pub slice_bytes: u64,
    pub limit_bytes: usize,
}

/// The peer side: an engine with one buffer plus a raw TCP server; prints
/// `READY <segment> <buffer addr> <raw tcp addr>` and serves until stdin closes.
pub async fn serve_peer(buffer_bytes: usize) -> anyhow::Result<()> {
    let engine = Engine::start(EngineConfig::default()).await?;
    let buf = engine
        .alloc_buffer(buffer_bytes, &BufferOptions { populate: true, ..Default::default() })?;
    let raw = std::net::TcpListener::bind("127.0.0.1:0")?;
    let raw_addr = raw.local_addr()?;
    std::thread::spawn(move || serve_raw_tcp(raw));
    println!("READY {} {} {}", engine.name(), buf.addr(), raw_addr);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(_)) = lines.next_line().await {}
    Ok(())
}

pub(crate) struct PeerProc {
    _child: tokio::process::Child,
    segment: String,
    buf_addr: u64,
    pub(crate) raw_addr: std::net::SocketAddr,
}

pub(crate) async fn start_peer() -> anyhow::Result<PeerProc> {
    let exe = std::env::current_exe().context("locating the kvfs binary")?;
    let mut child = tokio::process::Command::new(exe)
        .args(["bench", "transfer-peer", "--buffer-bytes", &BUF_BYTES.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the bench peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    tokio::time::timeout(Duration::from_secs(20), BufReader::new(stdout).read_line(&mut line))
        .await
        .context("the bench peer did not start within 20 s")??;
    let w: Vec<&str> = line.split_whitespace().collect();
    if w.len() != 4 || w[0] != "READY" {
        bail!("unexpected answer from the bench peer: {line:?}");
    }
    Ok(PeerProc {
        _child: child,
        segment: w[1].into(),
        buf_addr: w[2].parse()?,
        raw_addr: w[3].parse()?,
    })
}

struct Side {
    engine: Engine,
    buf: Arc<Buffer>,
    seg: SegmentHandle,
}

pub async fn run(opts: TransferBench) -> anyhow::Result<()> {
    let peer = start_peer().await?;
    let mut rep = Reporter::new(opts.json);
    let limit_bytes = opts.limit_bytes;
    let memcpy = tokio::task::spawn_blocking(move || memcpy_gbps(limit_bytes)).await?;
    let (raw, streams) = (peer.raw_addr, opts.conns_per_peer);
    let tcp = tokio::task::spawn_blocking(move || TcpLimits::measure(raw, limit_bytes, streams))
        .await??;
    emit_limits(&mut rep, memcpy, &tcp);
    for &kind in &opts.transports {
        let side = open_side(&opts, kind, &peer).await?;
        for op in [TransferOp::Read, TransferOp::Write] {
            let limit = match kind {
                TransportKind::Tcp => Limit::Tcp {
                    addr: peer.raw_addr,
                    bytes: opts.limit_bytes,
                    streams: opts.conns_per_peer,
                    dir: Some(if op == TransferOp::Read {
                        Direction::Receive
                    } else {
                        Direction::Send
                    }),
                },
                _ => Limit::Memcpy { bytes: opts.limit_bytes },
            };
            for &size in &opts.sizes {
                for case in ["qd1", "batch"] {
                    let (limit_gbps, mut s) =
                        run_case(&side, &peer, op, size, case, &limit, opts.min_ms).await?;
                    rep.emit(&Figure {
                        bench: "transfer",
                        case: case.into(),
                        transport: Some(transport_name(kind).into()),
                        op: op_name(op).into(),
                        size_bytes: Some(size),
                        gbps: Some(s.gbps()),
                        ops_per_s: Some(s.ops_per_s()),
                        p50_us: s.percentile(0.5),
                        p99_us: s.percentile(0.99),
                        limit: Some(limit.name().into()),
                        limit_gbps: Some(limit_gbps),
                        ..Default::default()
                    });
                }
            }
        }
    }
    Ok(())
}

fn emit_limits(rep: &mut Reporter, memcpy: f64, tcp: &TcpLimits) {
    let limit = |op: &str, transport: Option<&str>, gbps: f64, case: String| Figure {
        bench: "transfer",
        case,
        transport: transport.map(String::from),
        op: op.into(),
        gbps: Some(gbps),
        limit: Some(if transport.is_some() { "tcp" } else { "memcpy" }.into()),
        ..Default::default()
    };
    rep.emit(&limit("memcpy", None, memcpy, "limit 1 thread".into()));
    let n = tcp.streams;
    rep.emit(&limit("send", Some("raw-tcp"), tcp.send_1, "limit 1 stream".into()));
    rep.emit(&limit("receive", Some("raw-tcp"), tcp.receive_1, "limit 1 stream".into()));
    rep.emit(&limit("send", Some("raw-tcp"), tcp.send_n, format!("limit {n} streams")));
    rep.emit(&limit("receive", Some("raw-tcp"), tcp.receive_n, format!("limit {n} streams")));
    // Not a limit: the same streams re-sending one cache-resident buffer (see limits.rs).
    for (op, gbps) in [("send", tcp.resident_send_n), ("receive", tcp.resident_receive_n)] {
        let mut f = limit(op, Some("raw-tcp"), gbps, format!("{n} streams in cache"));
        f.limit = None;
        rep.emit(&f);
    }
}

async fn open_side(
    opts: &TransferBench,
    kind: TransportKind,
    peer: &PeerProc,
) -> anyhow::Result<Side> {
    let transports = match kind {
        TransportKind::Tcp => Transports::tcp_only(),
        _ => Transports::default(),
    };
    let cfg = EngineConfig {
        transports,
        tcp_conns_per_peer: opts.conns_per_peer,
        slice_bytes: opts.slice_bytes,
        op_timeout_ms: 30_000,
        ..EngineConfig::default()
    };
    let engine = Engine::start(cfg).await?;
    let buf =
        engine.alloc_buffer(BUF_BYTES, &BufferOptions { populate: true, ..Default::default() })?;
    let seg = engine.open_segment(&peer.segment).await?;
    let got = seg.transport_for(peer.buf_addr, 1);
    if got != Some(kind) {
        bail!("asked to bench {kind:?} but the engine would use {got:?} for the peer");
    }
    Ok(Side { engine, buf, seg })
}

async fn run_case(
    side: &Side,
    peer: &PeerProc,
    op: TransferOp,
    size: u64,
    case: &str,
    limit: &Limit,
    min_ms: u64,
) -> anyhow::Result<(f64, Samples)> {
    if size == 0 || size as usize > BUF_BYTES {
        bail!("block size {} must be between 1 byte and {}", size, human_bytes(BUF_BYTES as u64));
    }
    let items =
        if case == "batch" { (BATCH_BYTES_MAX / size).clamp(1, BATCH_ITEMS_MAX) } else { 1 };
    let slots = (BUF_BYTES as u64 / size).max(1);
    let reqs = |round: u64| -> Vec<TransferRequest> {
        (0..items)
            .map(|i| {
                let off = ((round * items + i) % slots) * size;
                TransferRequest {
                    op,
                    segment: side.seg.clone(),
                    local_addr: side.buf.addr() + off,
                    remote_addr: peer.buf_addr + off,
                    len: size,
                }
            })
            .collect()
    };
    let once = |round: u64| {
        let batch = reqs(round);
        async move {
            let t = Instant::now();
            if batch.len() == 1 {
                side.engine.transfer_one(&batch[0]).await?;
            } else {
                for r in side.engine.transfer(batch).await? {
                    r?;
                }
            }
            Ok::<_, kvfs_transfer::Error>(Timed {
                took: t.elapsed(),
                bytes: items * size,
                ops: items,
            })
        }
    };
    once(0).await?; // warm-up: connections, mappings
    let round = std::cell::Cell::new(1u64);
    let per_round = Duration::from_millis(min_ms.div_ceil(ROUNDS as u64));
    interleaved(limit, ROUNDS, per_round, || {
        let r = round.get();
        round.set(r + 1);
        async move { Ok(once(r).await?) }
    })
    .await
}

fn op_name(op: TransferOp) -> &'static str {
    match op {
        TransferOp::Read => "read",
        TransferOp::Write => "write",
    }
}

pub fn transport_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Tcp => "tcp",
        TransportKind::Shm => "shm",
        TransportKind::Rdma => "rdma",
        TransportKind::Local => "local",
    }
}
