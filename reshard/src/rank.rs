//! One participant of a reshard in its own process: the multi-process tests start
//! `kvfs-reshard-rank`, `kvfs bench reshard` starts `kvfs bench reshard-rank`; both run [`main`].
//!
//! Usage: kvfs-reshard-rank COORDINATOR SLOT WORLD FROM TO [KEY=VALUE...]
//! FROM and TO are parallel layouts (`tp2`, `pp2/ep8/tp4/dp2`); slot `s` is participant `s` of
//! both (a slot beyond a layout's world holds nothing there). The model is `model=mixed` (a
//! few layers of experts, attention, norms and an embedding) or `model=matrix:MIB` (one f32
//! matrix of MIB MiB, TP on rows). Every source fragment is filled with its elements' global
//! linear indices; the rank prints `bound` once bindings are exchanged, `executing` before it
//! reads, then `done committed=.. state=.. verified=.. bytes=.. exec_us=.. err=..`.
//! Settings: `hold_ms=N` (wait between reading and the commit: a test kills the rank there),
//! `stale=target` or `stale=source` (re-allocate this rank's target, or its source, refilled
//! and active again, after binding: the plan's generation is stale),
//! `tcp_only=1`, `op_timeout_ms=N`, `iters=N` (execute N times after a barrier each, printing
//! each one's time on this rank as `exec_us`), `dst_offset=K` (slot `s` is target participant
//! `s-K`: with sources on slots below K every byte crosses processes), `slice_bytes=N` and
//! `tcp_conns=N`, `socket_buffer_bytes=N` (the Transfer Engine's tcp slicing, connections per
//! peer and socket buffers), `spin_us=N` (how long the engine polls for a small request's
//! reply, and for the next request after serving one, before it parks).

use std::time::{Duration, Instant};

use crate::testing::linear_fragment;
use crate::{Binding, BoundPlan, Holder, Limits, Parallel, Placement, Rule, TensorDesc};
use kvfs_pg::{Group, PgConfig};
use kvfs_transfer::{Engine, EngineConfig, Transports};

/// The test models: `mixed` or `matrix:MIB`.
pub fn model(spec: &str) -> Vec<(TensorDesc, Rule)> {
    if let Some(mib) = spec.strip_prefix("matrix:") {
        let mib: u64 = mib.parse().expect("matrix:MIB");
        let cols = 1024u64;
        let rows = (mib << 20) / 4 / cols;
        return vec![(
            TensorDesc::new("w", &[rows, cols], "float32", 4),
            Rule { tp_dim: Some(0), ..Rule::default() },
        )];
    }
    let layers = 4u32;
    let mut t = Vec::new();
    for l in 0..layers {
        t.push((
            TensorDesc::new(&format!("l{l}.experts"), &[16, 24, 40], "bfloat16", 2),
            Rule { tp_dim: Some(2), ep_dim: Some(0), layer: Some((l, layers)) },
        ));
        t.push((
            TensorDesc::new(&format!("l{l}.qkv"), &[24, 72], "float32", 4),
            Rule { tp_dim: Some(1), ep_dim: None, layer: Some((l, layers)) },
        ));
        t.push((
            TensorDesc::new(&format!("l{l}.norm"), &[24], "float32", 4),
            Rule { layer: Some((l, layers)), ..Rule::default() },
        ));
    }
    t.push((
        TensorDesc::new("embed", &[100, 24], "float64", 8),
        Rule { tp_dim: Some(0), ..Rule::default() },
    ));
    t
}

/// Runs one participant; `args` are the command line after the program name. Returns the
/// exit code.
pub fn main(args: &[String]) -> i32 {
    let mut args = args.to_vec();
    args.insert(0, String::new());
    if args.len() < 6 || args.iter().any(|a| a == "--help" || a == "-h") {
        eprintln!(
            "usage: kvfs-reshard-rank COORDINATOR SLOT WORLD FROM TO [KEY=VALUE...] (see kvfs_reshard::rank)"
        );
        return if args.iter().any(|a| a == "--help") { 0 } else { 2 };
    }
    let slot: u32 = args[2].parse().expect("SLOT");
    let world: u32 = args[3].parse().expect("WORLD");
    let (mut model_spec, mut hold_ms, mut stale, mut iters, mut off) =
        ("mixed".to_string(), 0u64, String::new(), 1usize, 0u32);
    let mut pg = PgConfig::default();
    let mut ec = EngineConfig { name: None, ..EngineConfig::default() };
    for kv in &args[6..] {
        let (k, v) = kv.split_once('=').expect("settings are KEY=VALUE");
        match k {
            "model" => model_spec = v.to_string(),
            "hold_ms" => hold_ms = v.parse().expect("hold_ms"),
            "stale" => stale = v.to_string(),
            "iters" => iters = v.parse().expect("iters"),
            "dst_offset" => off = v.parse().expect("dst_offset"),
            "slice_bytes" => ec.slice_bytes = v.parse().expect("slice_bytes"),
            "tcp_conns" => ec.tcp_conns_per_peer = v.parse().expect("tcp_conns"),
            "spin_us" => {
                ec.tcp_direct_spin_us = v.parse().expect("spin_us");
                ec.tcp_serve_spin_us = ec.tcp_direct_spin_us;
            }
            "socket_buffer_bytes" => {
                ec.socket_buffer_bytes = v.parse().expect("socket_buffer_bytes")
            }
            "tcp_only" if v == "1" => {
                pg.transports = Transports::tcp_only();
                ec.transports = Transports::tcp_only();
            }
            "op_timeout_ms" => {
                pg.op_timeout_ms = v.parse().expect("op_timeout_ms");
                ec.op_timeout_ms = pg.op_timeout_ms;
            }
            other => panic!("unknown setting {other}"),
        }
    }
    let tensors = model(&model_spec);
    let src = Parallel::parse(&args[4]).and_then(|p| p.placement(&tensors)).expect("FROM layout");
    let dst = Parallel::parse(&args[5]).and_then(|p| p.placement(&tensors)).expect("TO layout");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(slot, world, &args[1], src, dst, pg, ec, hold_ms, &stale, iters, off))
}

#[allow(clippy::too_many_arguments)]
async fn run(
    slot: u32,
    world: u32,
    coord: &str,
    src: Placement,
    dst: Placement,
    pg: PgConfig,
    ec: EngineConfig,
    hold_ms: u64,
    stale: &str,
    iters: usize,
    off: u32,
) -> i32 {
    let group = match Group::join(coord, slot, world, pg).await {
        Ok(g) => g,
        Err(e) => {
            println!("done committed=false err={:?}:{e}", e.kind());
            return 1;
        }
    };
    let engine = Engine::start(ec).await.expect("engine");
    let mut source = (slot < src.participants)
        .then(|| Holder::new(engine.clone(), &src, slot).expect("source holder"));
    let mut target = (slot >= off && slot - off < dst.participants)
        .then(|| Holder::new(engine.clone(), &dst, slot - off).expect("target holder"));
    if let Some(h) = source.as_mut() {
        h.allocate().expect("allocate source");
        for (t, f, b) in h.buffers() {
            let tp = &src.tensors[t as usize];
            b.write_at(0, &linear_fragment(&tp.desc, &tp.fragments[f as usize])).expect("fill");
        }
        h.activate().expect("activate");
    }
    if let Some(h) = target.as_mut() {
        h.allocate().expect("allocate target");
    }
    // Everyone learns everyone's bindings (an allgather of variable-length messages).
    let mine =
        serde_json_pair(source.as_ref().map(Holder::binding), target.as_ref().map(Holder::binding));
    let (_, data, lens) = group
        .alltoallv_with(|slots: &[u32]| {
            let all: Vec<u8> = slots.iter().flat_map(|_| mine.iter().copied()).collect();
            (all, vec![mine.len() as u64; slots.len()])
        })
        .await
        .expect("exchange bindings");
    let (mut sb, mut db) = (Vec::new(), Vec::new());
    let mut at = 0usize;
    for l in lens {
        let (s, d) = parse_pair(&data[at..at + l as usize]);
        at += l as usize;
        sb.extend(s);
        db.extend(d);
    }
    let plan = crate::plan(&src, &dst, &Limits::default()).expect("plan");
    let bound = BoundPlan::new(plan, &src, &dst, &sb, &db).expect("bind");
    println!("bound");
    if stale == "target"
        && let Some(h) = target.as_mut()
    {
        h.allocate().expect("re-allocate");
    }
    if stale == "source"
        && let Some(h) = source.as_mut()
    {
        // The same weights in a new allocation: a plan bound to the old one must not read it.
        h.allocate().expect("re-allocate");
        for (t, f, b) in h.buffers() {
            let tp = &src.tensors[t as usize];
            b.write_at(0, &linear_fragment(&tp.desc, &tp.fragments[f as usize])).expect("fill");
        }
        h.activate().expect("activate");
    }
    let mut last = None;
    let mut exec_us = Vec::new();
    for i in 0..iters {
        group.barrier().await.expect("barrier");
        if i == iters - 1 {
            println!("executing");
        }
        let t0 = Instant::now();
        let report = match target.as_ref() {
            Some(h) => Some(crate::execute(h, &bound).await),
            None => None,
        };
        exec_us.push(t0.elapsed().as_micros());
        let _ = group.barrier().await;
        last = Some(report);
    }
    let report = last.expect("one iteration");
    if hold_ms > 0 {
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
    }
    let (rep, err) = match &report {
        Some(Ok(r)) => (Some(r.clone()), r.first_error().map(|e| format!("{:?}:{e}", e.kind()))),
        Some(Err(e)) => (None, Some(format!("{:?}:{e}", e.kind()))),
        None => (None, None),
    };
    let ok = match &report {
        Some(Ok(r)) => r.ok(),
        Some(Err(_)) => false,
        None => true,
    };
    let outcome = crate::commit(&group, target.as_ref(), ok, &(0..world).collect::<Vec<_>>()).await;
    let verified = target.as_ref().is_none_or(|h| {
        h.buffers().all(|(t, f, b)| {
            let tp = &dst.tensors[t as usize];
            let want = linear_fragment(&tp.desc, &tp.fragments[f as usize]);
            let mut got = vec![0u8; want.len()];
            b.read_at(0, &mut got).is_ok() && got == want
        })
    });
    let err = err.or_else(|| outcome.as_ref().err().map(|e| format!("{:?}:{e}", e.kind())));
    println!(
        "done committed={} state={:?} verified={verified} bytes={} exec_us={} err={}",
        outcome.is_ok(),
        target.as_ref().map(Holder::state),
        rep.as_ref().map_or(0, |r| r.bytes),
        exec_us.iter().map(u128::to_string).collect::<Vec<_>>().join(","),
        err.unwrap_or_else(|| "-".into()).replace(' ', "_"),
    );
    group.close().await;
    i32::from(outcome.is_err())
}

fn serde_json_pair(s: Option<Binding>, d: Option<Binding>) -> Vec<u8> {
    let enc = |b: Option<Binding>| b.map(|b| b.to_bytes()).unwrap_or_default();
    let (s, d) = (enc(s), enc(d));
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s);
    out.extend(d);
    out
}

fn parse_pair(b: &[u8]) -> (Option<Binding>, Option<Binding>) {
    let n = u64::from_le_bytes(b[..8].try_into().expect("length")) as usize;
    let dec = |x: &[u8]| (!x.is_empty()).then(|| Binding::from_bytes(x).expect("a binding"));
    (dec(&b[8..8 + n]), dec(&b[8 + n..]))
}
