//! `kvfs bench reshard`: weights moved between processes by kvfs-reshard's executor, against
//! memcpy and raw loopback TCP measured in the same run, and the planner's time on a large
//! model.
//!
//! Each case runs real processes (`kvfs bench reshard-rank`, this binary running
//! `kvfs_reshard::rank`) joined in a kvfs-pg group whose coordinator runs here: one f32 matrix
//! of SIZE, TP on rows, the sources on the first slots and the targets on the next ones, so
//! every byte crosses processes. Each iteration starts after a barrier; its time is the
//! slowest target's `execute` (generation checks, the reads, the second check), and GB/s is
//! the plan's bytes over the p50 of those. Every target verifies its bytes at the end. Each
//! figure's limit (raw loopback TCP over 1 or 4 streams, or memcpy) is the mean of measurements
//! just before and just after its case.
//!
//! The planning figure builds a 1,000-tensor model (250 layers of experts, qkv, o and norm, in
//! torch's [out, in] layout) and plans pp4/ep2/tp8 (64 ranks) -> pp2/ep4/tp4/dp2 (64 ranks).

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvfs_pg::{Coordinator, CoordinatorConfig};
use kvfs_reshard::{Limits, Parallel, Rule, TensorDesc};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::limits::{Direction, Limit, memcpy_gbps};
use super::report::{Figure, Reporter};

pub struct ReshardBench {
    pub sizes: Vec<u64>,
    pub transports: Vec<String>,
    pub iters: usize,
    pub json: bool,
}

/// (from, to, source slots): every target slot is a process of its own after the sources.
const CASES: [(&str, &str, u32); 2] = [("tp1", "tp1", 1), ("tp2", "tp4", 2)];

pub async fn run(b: ReshardBench) -> anyhow::Result<()> {
    let peer = super::transfer::start_peer().await?;
    let mut rep = Reporter::new(b.json);
    let tcp = Limit::Tcp {
        addr: peer.raw_addr,
        bytes: 512 << 20,
        streams: 4,
        dir: Some(Direction::Receive),
    };
    for transport in &b.transports {
        if transport != "shm" && transport != "tcp" {
            bail!("unknown transport {transport:?} (shm, tcp)");
        }
        for &(from, to, sources) in &CASES {
            for &size in &b.sizes {
                let mib = size >> 20;
                if mib == 0 {
                    bail!("sizes are whole MiB (got {size} bytes)");
                }
                // The limit is measured just before and just after its case, and their mean
                // taken: this machine's loopback moves by 10-30% from minute to minute, and a
                // figure is only comparable with the limit of its own moment.
                let limit_now = || async {
                    if transport == "tcp" {
                        tcp.measure().await
                    } else {
                        Ok(tokio::task::spawn_blocking(|| memcpy_gbps(256 << 20)).await?)
                    }
                };
                let limit = if transport == "tcp" { "tcp" } else { "memcpy" };
                let before = limit_now().await?;
                let (lat, bytes) = run_case(from, to, sources, mib, transport == "tcp", b.iters)
                    .await
                    .with_context(|| format!("{from} -> {to}, {mib} MiB over {transport}"))?;
                let limit_gbps = (before + limit_now().await?) / 2.0;
                let p50 = percentile(&lat, 0.5);
                rep.emit(&Figure {
                    bench: "reshard",
                    case: format!("{from}->{to}"),
                    transport: Some(transport.clone()),
                    op: "execute".into(),
                    size_bytes: Some(size),
                    gbps: Some(bytes as f64 / p50 / 1e3),
                    p50_us: Some(p50),
                    p99_us: Some(percentile(&lat, 0.99)),
                    limit: Some(limit.into()),
                    limit_gbps: Some(limit_gbps),
                    ..Figure::default()
                });
            }
        }
    }
    drop(peer);
    plan_figure(&mut rep)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs one case; returns per iteration the slowest target's time (us) and the bytes moved.
async fn run_case(
    from: &str,
    to: &str,
    sources: u32,
    mib: u64,
    tcp_only: bool,
    iters: usize,
) -> anyhow::Result<(Vec<f64>, u64)> {
    let targets = Parallel::parse(to)?.world();
    let world = sources + targets;
    let mut cfg = CoordinatorConfig::new("default", world);
    cfg.heartbeat_ms = 200;
    let coord = Coordinator::start(cfg).await?;
    let exe = std::env::current_exe().context("locating the kvfs binary")?;
    let mut children = Vec::new();
    for slot in 0..world {
        let mut args = vec![
            "bench".to_string(),
            "reshard-rank".into(),
            coord.addr(),
            slot.to_string(),
            world.to_string(),
            from.into(),
            to.into(),
            format!("model=matrix:{mib}"),
            format!("iters={iters}"),
            format!("dst_offset={sources}"),
        ];
        if tcp_only {
            args.push("tcp_only=1".into());
        }
        args.extend(
            std::env::var("KVFS_RESHARD_RANK_ARGS")
                .unwrap_or_default()
                .split_whitespace()
                .map(String::from),
        );
        let mut child = tokio::process::Command::new(&exe)
            .args(&args)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting a reshard rank")?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        children.push((slot, child, out));
    }
    let mut per_rank: Vec<Vec<f64>> = Vec::new();
    let mut bytes = 0u64;
    for (slot, _child, out) in &mut children {
        let mut lines = out.lines();
        let done = loop {
            let line = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
                .await
                .with_context(|| format!("slot {slot} did not finish within 300 s"))??
                .with_context(|| format!("slot {slot} exited early"))?;
            if line.starts_with("done") {
                break line;
            }
        };
        let field =
            |k: &str| done.split(' ').find_map(|w| w.strip_prefix(k)).unwrap_or("").to_string();
        if field("committed=") != "true" || field("verified=") != "true" {
            bail!("slot {slot}: {done}");
        }
        if *slot >= sources {
            bytes += field("bytes=").parse::<u64>().unwrap_or(0);
            per_rank.push(field("exec_us=").split(',').filter_map(|x| x.parse().ok()).collect());
        }
    }
    let lat = (0..iters).map(|i| per_rank.iter().map(|r| r[i]).fold(0.0, f64::max)).collect();
    Ok((lat, bytes))
}

fn plan_figure(rep: &mut Reporter) -> anyhow::Result<()> {
    // torch's Linear layout ([out, in]): column-parallel splits dim 0, row-parallel dim 1.
    let layers = 250u32;
    let mut tensors = Vec::new();
    let bf16 = |name: String, shape: &[u64], rule: Rule| {
        (TensorDesc::new(&name, shape, "bfloat16", 2), rule)
    };
    for l in 0..layers {
        let layer = Some((l, layers));
        let col = Rule { tp_dim: Some(0), ep_dim: None, layer };
        let row = Rule { tp_dim: Some(1), ep_dim: None, layer };
        let experts = Rule { tp_dim: Some(1), ep_dim: Some(0), layer };
        tensors.push(bf16(format!("l{l}.experts.w13"), &[64, 3072, 4096], experts));
        tensors.push(bf16(format!("l{l}.qkv"), &[12288, 4096], col));
        tensors.push(bf16(format!("l{l}.o"), &[4096, 4096], row));
        tensors.push((
            TensorDesc::new(&format!("l{l}.norm"), &[4096], "float32", 4),
            Rule { layer, ..Rule::default() },
        ));
    }
    let src = Parallel::parse("pp4/ep2/tp8")?.placement(&tensors)?;
    let dst = Parallel::parse("pp2/ep4/tp4/dp2")?.placement(&tensors)?;
    // Row-parallel weights expand to a segment per row: allow the expansion.
    let limits = Limits { regions_max: 1 << 20, segments_max: 1 << 32 };
    let mut times = Vec::new();
    let mut shape = (0, 0);
    for _ in 0..5 {
        let t = Instant::now();
        let p = kvfs_reshard::plan(&src, &dst, &limits)?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        shape = (p.regions.len(), p.segments());
    }
    rep.emit(&Figure {
        bench: "reshard",
        case: format!("plan 1000 tensors 64->64 ranks: {} regions, {} segments", shape.0, shape.1),
        op: "plan".into(),
        ops_per_s: Some(1e6 / percentile(&times, 0.5)),
        p50_us: Some(percentile(&times, 0.5)),
        p99_us: Some(percentile(&times, 0.99)),
        ..Figure::default()
    });
    Ok(())
}
