//! The Transfer Engine's rdma transport between two engines in two processes, on a real
//! (Soft-RoCE) device: `scripts/test-rdma` runs it inside the QEMU guest after kvfs-rdma's
//! self-test. Exits non-zero on the first failed check.
//!
//! Mechanism: this process runs engine A; a `kvfs-te-peer` child (built with the `rdma`
//! feature, next to this example in the target directory, or `KVFS_TE_PEER`) runs engine B.
//! Both are on one host, so shm is disabled on both sides (`--no-shm`, `Transports { shm: false,
//! .. }`) and rdma is what remains above tcp. Checks, in order:
//! 1. A and B open the device; `transport_for` says `Rdma`; the segment status says connected;
//! 2. seeded random batches of mixed READs and WRITEs (disjoint random ranges, 1 B ..= 4 MiB,
//!    edge lengths included) run from A; after each, A's whole buffer and B's (hashed by B) are
//!    compared by blake3 with models kept by memcpy; the status shows every item went over rdma
//!    (no fallback, one link);
//! 3. raw memory (a `Vec` registered local-only) as the local side of READs and WRITEs;
//! 4. remote ranges outside B's regions are `OutOfRange`, caught before posting (the link
//!    stays up, no fallback counted);
//! 5. B re-registers its buffer (new rkey): the next op fails on the NIC with a remote access
//!    error and is retried over tcp within its deadline (bytes verified), and the op after that
//!    runs over a rebuilt link with a refreshed table;
//! 6. mixed peers: A against a `--no-rdma` peer, and an rdma-disabled engine against B, use tcp;
//! 7. B is SIGKILLed while batches of writes run: every item ends with `PeerGone` or `Timeout`
//!    well within a bound, and later batches fail fast instead of hanging.
//!
//! Environment: `RXE_DEVICE` (set by the guest runner) or `KVFS_RDMA_DEVICE` names the device,
//! `KVFS_RDMA_GID_INDEX` the GID; `KVFS_TE_SEED`, `KVFS_TE_ROUNDS`, `KVFS_TE_ITEMS` shape the
//! batches; `RUST_LOG` turns on the engine's logs. The MB/s printed under TCG emulation is a
//! functional figure only.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvfs_transfer::testing::{fill_pattern, pattern};
use kvfs_transfer::{
    Buffer, BufferOptions, Engine, EngineConfig, ErrorKind, SegmentHandle, TransferOp,
    TransferRequest, TransportKind, Transports,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const BUF: usize = 32 << 20;
const OP_BYTES_MAX: usize = 4 << 20;
const REMOTE_SEED: u64 = 0xfeed;
const LOCAL_SEED: u64 = 0xbeef;
/// The whole program must finish within this (the guest's own timeout is longer).
const BUDGET: Duration = Duration::from_secs(600);

struct Opts {
    device: Option<String>,
    gid_index: Option<u32>,
    seed: u64,
    rounds: usize,
    items: usize,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v}")),
        Err(_) => Ok(default),
    }
}

fn opts() -> Result<Opts> {
    let device = std::env::var("KVFS_RDMA_DEVICE").or_else(|_| std::env::var("RXE_DEVICE")).ok();
    let gid_index = match std::env::var("KVFS_RDMA_GID_INDEX") {
        Ok(v) => Some(v.parse().context("KVFS_RDMA_GID_INDEX")?),
        Err(_) => None,
    };
    Ok(Opts {
        device,
        gid_index,
        seed: env_or("KVFS_TE_SEED", 0x6b76_6673)?,
        rounds: env_or("KVFS_TE_ROUNDS", 8)?,
        items: env_or("KVFS_TE_ITEMS", 32)?,
    })
}

// ---- the peer process -------------------------------------------------------------------------

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
    addr: u64,
    len: usize,
}

fn peer_binary() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("KVFS_TE_PEER") {
        return Ok(PathBuf::from(p));
    }
    // target/<profile>/examples/te_rdma_guest -> target/<profile>/kvfs-te-peer
    let exe = std::env::current_exe().context("current_exe")?;
    let dir = exe.parent().and_then(|d| d.parent()).context("example has no grandparent dir")?;
    Ok(dir.join("kvfs-te-peer"))
}

impl Peer {
    fn start(o: &Opts, extra: &[&str]) -> Result<Peer> {
        let bin = peer_binary()?;
        let mut args: Vec<String> =
            vec!["--no-shm".into(), "--buffer-bytes".into(), BUF.to_string()];
        if let Some(d) = &o.device {
            args.extend(["--rdma-device".into(), d.clone()]);
        }
        if let Some(g) = o.gid_index {
            args.extend(["--rdma-gid-index".into(), g.to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(&bin)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let stdin = child.stdin.take().context("peer stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("peer stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line).context("peer READY line")?;
        let w: Vec<&str> = line.split_whitespace().collect();
        ensure!(w.len() == 4 && w[0] == "READY", "peer said {line:?}");
        let (name, addr, len) = (w[1].to_string(), w[2].parse()?, w[3].parse()?);
        Ok(Peer { child, stdin, stdout, name, addr, len })
    }

    fn ask(&mut self, cmd: &str) -> Result<String> {
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        Ok(line.trim().to_string())
    }

    fn expect_ok(&mut self, cmd: &str) -> Result<()> {
        let got = self.ask(cmd)?;
        ensure!(got == "OK", "peer answered {got:?} to {cmd:?}");
        Ok(())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---- batches and models -----------------------------------------------------------------------

struct Item {
    op: TransferOp,
    local: usize,
    remote: usize,
    len: usize,
}

/// Random disjoint placements of `lens` in `[0, BUF)`.
fn place(lens: &[usize], rng: &mut StdRng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.shuffle(rng);
    let mut free = BUF - lens.iter().sum::<usize>();
    let mut pos = vec![0; lens.len()];
    let mut at = 0;
    for (k, &i) in order.iter().enumerate() {
        let gap = rng.random_range(0..=free / (lens.len() - k));
        free -= gap;
        pos[i] = at + gap;
        at = pos[i] + lens[i];
    }
    pos
}

/// Lengths: the edges first (1 B, 4 MiB, around the 1 MiB slice), then log-uniform.
fn random_items(rng: &mut StdRng, count: usize, round: usize) -> Vec<Item> {
    let mut lens: Vec<usize> = match round {
        0 => vec![1, 2, OP_BYTES_MAX, (1 << 20) - 1, 1 << 20, (1 << 20) + 1],
        _ => Vec::new(),
    };
    while lens.len() < count {
        let bits = rng.random_range(0.0..=(OP_BYTES_MAX as f64).log2());
        lens.push((2f64.powf(bits) as usize).clamp(1, OP_BYTES_MAX));
    }
    while lens.iter().sum::<usize>() > BUF / 2 {
        lens.pop();
    }
    let (locals, remotes) = (place(&lens, rng), place(&lens, rng));
    (0..lens.len())
        .map(|i| Item {
            op: if rng.random_bool(0.5) { TransferOp::Read } else { TransferOp::Write },
            local: locals[i],
            remote: remotes[i],
            len: lens[i],
        })
        .collect()
}

fn apply(items: &[Item], local: &mut [u8], remote: &mut [u8]) {
    for it in items {
        let (l, r) = (it.local..it.local + it.len, it.remote..it.remote + it.len);
        match it.op {
            TransferOp::Write => remote[r].copy_from_slice(&local[l]),
            TransferOp::Read => local[l].copy_from_slice(&remote[r]),
        }
    }
}

fn requests(items: &[Item], seg: &SegmentHandle, local: u64, remote: u64) -> Vec<TransferRequest> {
    items
        .iter()
        .map(|it| TransferRequest {
            op: it.op,
            segment: seg.clone(),
            local_addr: local + it.local as u64,
            remote_addr: remote + it.remote as u64,
            len: it.len as u64,
        })
        .collect()
}

/// The local buffer and the peer's buffer equal their models, every byte.
fn verify(local: &Buffer, local_model: &[u8], peer: &mut Peer, remote_model: &[u8]) -> Result<()> {
    // SAFETY: called between batches; nothing writes the buffer now.
    let got = blake3::hash(unsafe { &local.as_slice()[..local_model.len()] });
    ensure!(got == blake3::hash(local_model), "local buffer differs from its model");
    let remote = peer.ask(&format!("hash 0 {}", remote_model.len()))?;
    let want = blake3::hash(remote_model).to_hex().to_string();
    ensure!(remote == want, "peer buffer differs from its model: {remote} != {want}");
    Ok(())
}

fn config(o: &Opts, rdma: bool, op_timeout_ms: u64) -> EngineConfig {
    EngineConfig {
        transports: Transports { shm: false, rdma, tcp: true },
        op_timeout_ms,
        rdma_device: o.device.clone(),
        rdma_gid_index: o.gid_index,
        ..EngineConfig::default()
    }
}

async fn local_engine(o: &Opts, rdma: bool, op_timeout_ms: u64) -> Result<(Engine, Arc<Buffer>)> {
    let engine = Engine::start(config(o, rdma, op_timeout_ms)).await?;
    let buf = engine.alloc_buffer(BUF, &BufferOptions { populate: true, ..Default::default() })?;
    // SAFETY: no transfer runs yet.
    fill_pattern(unsafe { buf.as_mut_slice() }, LOCAL_SEED, 0);
    Ok((engine, buf))
}

fn all_ok(results: &[kvfs_transfer::Result<()>], what: &str) -> Result<()> {
    for (i, r) in results.iter().enumerate() {
        if let Err(e) = r {
            bail!("{what}: item {i} failed: {e}");
        }
    }
    Ok(())
}

// ---- the checks -------------------------------------------------------------------------------

struct Totals {
    ops: u64,
    bytes: u64,
    elapsed: Duration,
}

async fn run(o: Opts) -> Result<()> {
    let start = Instant::now();
    let mut peer = Peer::start(&o, &[])?;
    ensure!(peer.len == BUF, "peer buffer of {} bytes", peer.len);
    peer.expect_ok(&format!("fill {REMOTE_SEED}"))?;
    let (engine, local) = local_engine(&o, true, 60_000).await?;
    let device = engine.rdma_device().context("engine A opened no RDMA device")?.to_string();
    println!("te_rdma_guest: device {device}, seed {:#x}, peer {}", o.seed, peer.name);

    println!("[1] handshake");
    let seg = engine.open_segment(&peer.name).await?;
    let kind = seg.transport_for(peer.addr, 1);
    ensure!(kind == Some(TransportKind::Rdma), "transport_for says {kind:?}");
    let st = seg.status().rdma.context("segment has no rdma side")?;
    ensure!(st.connected && st.peer_regions == 1 && st.links_built == 1, "{st:?}");
    println!("  transport_for = Rdma; {st:?}");

    println!("[2] random batches, every byte of both buffers checked with blake3");
    let mut local_model = pattern(LOCAL_SEED, 0, BUF);
    let mut remote_model = pattern(REMOTE_SEED, 0, BUF);
    let mut rng = StdRng::seed_from_u64(o.seed);
    let mut totals = Totals { ops: 0, bytes: 0, elapsed: Duration::ZERO };
    for round in 0..o.rounds {
        let items = random_items(&mut rng, o.items, round);
        let reads = items.iter().filter(|i| i.op == TransferOp::Read).count();
        let bytes: usize = items.iter().map(|i| i.len).sum();
        let t = Instant::now();
        let results = engine.transfer(requests(&items, &seg, local.addr(), peer.addr)).await?;
        let took = t.elapsed();
        all_ok(&results, &format!("round {round}"))?;
        apply(&items, &mut local_model, &mut remote_model);
        verify(&local, &local_model, &mut peer, &remote_model)?;
        totals.ops += items.len() as u64;
        totals.bytes += bytes as u64;
        totals.elapsed += took;
        println!(
            "  round {round}: {} items ({reads} READ), {bytes} bytes in {took:?} ({:.1} MB/s), \
             verified",
            items.len(),
            bytes as f64 / took.as_secs_f64() / 1e6
        );
    }
    let st = seg.status().rdma.context("rdma status")?;
    ensure!(st.ops == totals.ops && st.bytes == totals.bytes, "not all over rdma: {st:?}");
    ensure!(st.fallbacks == 0 && st.links_built == 1 && st.connected, "{st:?}");
    println!("  {st:?}");

    println!("[3] raw memory (registered local-only) as the local side");
    let mut raw = vec![0u8; 3 << 20];
    let raw_addr = raw.as_mut_ptr() as u64;
    // SAFETY: `raw` lives until after it is unregistered below, and is only read once no
    // transfer runs.
    unsafe { engine.register_memory(raw_addr, raw.len() as u64, false)? };
    let (ro, wo) = (5 << 20, 9 << 20);
    let read = TransferRequest {
        op: TransferOp::Read,
        segment: seg.clone(),
        local_addr: raw_addr,
        remote_addr: peer.addr + ro as u64,
        len: raw.len() as u64,
    };
    engine.transfer_one(&read).await.context("read into raw memory")?;
    let write = TransferRequest {
        op: TransferOp::Write,
        remote_addr: peer.addr + wo as u64,
        len: (1 << 20) + 17,
        ..read.clone()
    };
    engine.transfer_one(&write).await.context("write from raw memory")?;
    engine.unregister(raw_addr)?;
    ensure!(raw[..] == remote_model[ro..ro + raw.len()], "raw memory did not get the peer's bytes");
    let n = write.len as usize;
    remote_model[wo..wo + n].copy_from_slice(&raw[..n]);
    verify(&local, &local_model, &mut peer, &remote_model)?;
    let before = seg.status().rdma.context("rdma status")?;
    ensure!(before.ops == totals.ops + 2 && before.fallbacks == 0, "{before:?}");
    println!("  3 MiB read and 1 MiB + 17 B written over rdma, verified");

    println!("[4] remote ranges outside the peer's regions");
    for (what, remote_addr, len) in [
        ("past the end", peer.addr + BUF as u64 - 10, 100),
        ("never registered", 4096, 100),
        ("wrapping", u64::MAX - 5, 100),
    ] {
        let req = TransferRequest {
            op: TransferOp::Write,
            segment: seg.clone(),
            local_addr: local.addr(),
            remote_addr,
            len,
        };
        let err = engine.transfer_one(&req).await.expect_err(what);
        ensure!(err.kind() == ErrorKind::OutOfRange, "{what}: {err}");
        println!("  {what}: {err}");
    }
    let after = seg.status().rdma.context("rdma status")?;
    ensure!(after.connected && after.links_built == 1 && after.fallbacks == 0, "{after:?}");
    verify(&local, &local_model, &mut peer, &remote_model)?;

    println!("[5] the peer re-registers its buffer: stale rkey, retried over tcp, link rebuilt");
    peer.expect_ok("reregister")?;
    let mut rng5 = StdRng::seed_from_u64(o.seed ^ 5);
    for step in ["stale rkey", "rebuilt link"] {
        let items = random_items(&mut rng5, 4, 1);
        let req = requests(&items[..1], &seg, local.addr(), peer.addr).remove(0);
        engine.transfer_one(&req).await.with_context(|| format!("{step}: op must succeed"))?;
        apply(&items[..1], &mut local_model, &mut remote_model);
        verify(&local, &local_model, &mut peer, &remote_model)?;
        println!("  {step}: {:?}", seg.status().rdma);
    }
    let st = seg.status().rdma.context("rdma status")?;
    ensure!(st.fallbacks == 1 && st.links_built == 2 && st.connected, "{st:?}");
    ensure!(st.ops == before.ops + 1, "the op after the rebuild went over rdma: {st:?}");

    println!("[6] mixed peers fall back to tcp");
    let mut plain_peer = Peer::start(&o, &["--no-rdma"])?;
    plain_peer.expect_ok(&format!("fill {REMOTE_SEED}"))?;
    let seg2 = engine.open_segment(&plain_peer.name).await?;
    ensure!(seg2.transport_for(plain_peer.addr, 1) == Some(TransportKind::Tcp));
    ensure!(seg2.status().rdma.is_none(), "{:?}", seg2.status());
    let (plain, plain_buf) = local_engine(&o, false, 60_000).await?;
    ensure!(plain.rdma_device().is_none());
    let seg3 = plain.open_segment(&peer.name).await?;
    ensure!(seg3.transport_for(peer.addr, 1) == Some(TransportKind::Tcp));
    let mut m2 = (pattern(LOCAL_SEED, 0, BUF), pattern(REMOTE_SEED, 0, BUF));
    let items = random_items(&mut rng, 8, 1);
    all_ok(
        &engine.transfer(requests(&items, &seg2, local.addr(), plain_peer.addr)).await?,
        "A->plain",
    )?;
    apply(&items, &mut local_model, &mut m2.1);
    verify(&local, &local_model, &mut plain_peer, &m2.1)?;
    let items = random_items(&mut rng, 8, 1);
    all_ok(
        &plain.transfer(requests(&items, &seg3, plain_buf.addr(), peer.addr)).await?,
        "plain->B",
    )?;
    apply(&items, &mut m2.0, &mut remote_model);
    verify(&plain_buf, &m2.0, &mut peer, &remote_model)?;
    drop((plain_peer, seg3, plain));
    println!("  rdma engine -> plain peer and plain engine -> rdma peer: tcp, verified");

    println!("[7] the peer is killed while batches run");
    let timeout_ms = 8_000;
    let (engine7, local7) = local_engine(&o, true, timeout_ms).await?;
    let seg7 = engine7.open_segment(&peer.name).await?;
    ensure!(seg7.transport_for(peer.addr, 1) == Some(TransportKind::Rdma));
    let reqs: Vec<TransferRequest> = (0..4u64)
        .map(|i| TransferRequest {
            op: if i % 2 == 0 { TransferOp::Write } else { TransferOp::Read },
            segment: seg7.clone(),
            local_addr: local7.addr() + (i << 22),
            remote_addr: peer.addr + (i << 22),
            len: 1 << 20,
        })
        .collect();
    all_ok(&engine7.transfer(reqs.clone()).await?, "before the kill")?;
    let pid = peer.child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        peer.kill();
        Instant::now()
    });
    let bound = Duration::from_millis(2 * timeout_ms);
    let mut failures = Vec::new();
    let mut batches = 0;
    let hammer = async {
        while failures.is_empty() {
            let results = engine7.transfer(reqs.clone()).await?;
            batches += 1;
            failures.extend(results.into_iter().filter_map(|r| r.err()));
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(bound + Duration::from_secs(10), hammer)
        .await
        .context("batches hung after the peer was killed")??;
    let killed_at = killer.join().map_err(|_| anyhow::anyhow!("killer thread panicked"))?;
    let waited = killed_at.elapsed();
    ensure!(waited < bound, "errors came {waited:?} after the kill");
    for e in &failures {
        ensure!(matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Timeout), "unexpected {e}");
    }
    let t = Instant::now();
    let again = tokio::time::timeout(bound, engine7.transfer(reqs)).await.context("hang")??;
    ensure!(again.iter().all(|r| r.is_err()), "transfers to a dead peer succeeded");
    println!(
        "  pid {pid} killed; {batches} batches ran, first errors {waited:?} after the kill: {}; \
         a later batch failed in {:?}",
        failures[0],
        t.elapsed()
    );

    println!(
        "te_rdma_guest OK: {} ops over rdma, {} bytes verified, {:.1} MB/s in the batches, {:?} \
         in all",
        totals.ops,
        totals.bytes,
        totals.bytes as f64 / totals.elapsed.as_secs_f64() / 1e6,
        start.elapsed()
    );
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let o = opts()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        tokio::time::timeout(BUDGET, run(o)).await.context("te_rdma_guest ran out of time")?
    })
}
