//! Guest self-test of `kvfs-rdma` on a real (Soft-RoCE) device; `scripts/test-rdma` runs it in
//! the QEMU guest. Exits non-zero on the first failed check.
//!
//! Mechanism: two "engines" in one process, each with its own context and protection domain on
//! the same device, exchange `EndpointInfo` through its byte encoding and register buffers on
//! both sides, exactly as two kvfs processes would. Then:
//! 1. `poll` with nothing outstanding returns `Timeout` after its timeout, not before, not never;
//! 2. a seeded random batch of RDMA READs and WRITEs (lengths 1 B ..= 4 MiB, log-uniform, at
//!    random unaligned offsets, plus the edge lengths) runs from A to B, then another from B to
//!    A; each side's whole buffer is compared by blake3 with an image the test maintains by
//!    memcpy, so every byte moved and every byte that must not move is checked;
//! 3. a WRITE running past the end of the peer's region fails with `RemoteAccess` (and the ops
//!    behind it with `Flushed`), the endpoint reports itself broken, the peer's bytes are intact;
//! 4. a bad rkey fails with `RemoteAccess`, a local range outside its lkey with `LocalAccess`;
//! 5. a WRITE to a peer whose endpoint is gone fails with `RetryExceeded` within a bound;
//! 6. a fresh endpoint pair after all that moves and verifies bytes again (recovery path), with
//!    one side advertising a smaller MTU (the pair must agree on the minimum);
//! 7. `abort` with work in flight reports every op once, failed ops as `Flushed`.
//!
//! Environment: `RXE_DEVICE` (set by the guest runner) or `KVFS_RDMA_DEVICE` names the device,
//! `KVFS_RDMA_GID_INDEX` overrides the GID, `KVFS_RDMA_SEED` changes the batch, and
//! `KVFS_RDMA_OPS` its size. The MB/s printed under TCG emulation is a functional figure only.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kvfs_rdma::{
    Completion, ContextOptions, Endpoint, EndpointInfo, EndpointOptions, EndpointState, ErrorKind,
    MemoryRegion, Op, OpKind, Opened, PathMtu, RdmaContext, RemoteAddr, RemoteRegion,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};

const BUF_BYTES: usize = 40 << 20;
const OP_BYTES_MAX: u64 = 4 << 20;
const SLICE_BYTES: u32 = 256 << 10;
const POLL_TIMEOUT: Duration = Duration::from_secs(30);
const BATCH_DEADLINE: Duration = Duration::from_secs(300);

/// One engine: a context with a registered buffer and the image its bytes must equal.
struct Engine {
    name: &'static str,
    ctx: RdmaContext,
    // Field order is drop order: deregister before freeing the bytes.
    mr: MemoryRegion,
    bytes: Vec<u8>,
    expected: Vec<u8>,
}

impl Engine {
    fn new(name: &'static str, opts: &ContextOptions, rng: &mut StdRng) -> Result<Engine> {
        let ctx = match RdmaContext::open_with(opts).context("open RDMA context")? {
            Opened::Ready(ctx) => ctx,
            Opened::Unavailable(why) => bail!("no usable RDMA device: {}", why.reason),
        };
        let mut bytes = vec![0u8; BUF_BYTES];
        rng.fill_bytes(&mut bytes);
        let expected = bytes.clone();
        // SAFETY: `bytes` is owned by the Engine, never resized, and outlives `mr` (declared
        // before it, so dropped first). The test reads or changes `bytes` only while no op is
        // outstanding.
        let mr = unsafe { ctx.register(bytes.as_mut_ptr(), bytes.len()) }.context("register")?;
        Ok(Engine { name, ctx, mr, bytes, expected })
    }

    fn verify(&self) -> Result<()> {
        let (got, want) = (blake3::hash(&self.bytes), blake3::hash(&self.expected));
        if got != want {
            let first = self.bytes.iter().zip(&self.expected).position(|(a, b)| a != b);
            bail!(
                "{}: buffer blake3 {got} != expected {want}; first bad byte at {first:?}",
                self.name
            );
        }
        Ok(())
    }
}

fn endpoint_options() -> EndpointOptions {
    EndpointOptions {
        send_queue_depth: 64,
        max_outstanding_reads: 8,
        slice_bytes_max: SLICE_BYTES,
        ..EndpointOptions::default()
    }
}

/// Creates and connects a pair of endpoints the way two engines would: through the bytes.
fn connect_pair(a: &Engine, b: &Engine) -> Result<(Endpoint, Endpoint)> {
    connect_pair_with(a, b, &endpoint_options(), &endpoint_options())
}

fn connect_pair_with(
    a: &Engine,
    b: &Engine,
    opts_a: &EndpointOptions,
    opts_b: &EndpointOptions,
) -> Result<(Endpoint, Endpoint)> {
    let mut ea = Endpoint::new(&a.ctx, opts_a).context("endpoint A")?;
    let mut eb = Endpoint::new(&b.ctx, opts_b).context("endpoint B")?;
    let (wire_a, wire_b) = (ea.local_info().to_bytes(), eb.local_info().to_bytes());
    let info_a = EndpointInfo::from_bytes(&wire_a).context("decode A's info")?;
    let info_b = EndpointInfo::from_bytes(&wire_b).context("decode B's info")?;
    ensure!(info_a == ea.local_info() && info_b == eb.local_info(), "info round trip");
    ea.connect(&info_b).context("connect A to B")?;
    eb.connect(&info_a).context("connect B to A")?;
    ensure!(ea.state() == EndpointState::Connected && eb.state() == EndpointState::Connected);
    Ok((ea, eb))
}

/// Polls `ep` until `n` ops have completed, within `deadline`.
fn collect(ep: &mut Endpoint, n: usize, deadline: Duration) -> Result<Vec<Completion>> {
    let start = Instant::now();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        ensure!(start.elapsed() < deadline, "{} of {n} ops done after {deadline:?}", out.len());
        match ep.poll_into(&mut out, POLL_TIMEOUT) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Timeout => continue,
            Err(e) => return Err(e).context("poll"),
        }
    }
    ensure!(out.len() == n, "{} completions for {n} ops", out.len());
    ensure!(ep.outstanding() == 0, "ops outstanding after all completed");
    Ok(out)
}

/// Log-uniform length in 1 ..= OP_BYTES_MAX.
fn random_len(rng: &mut StdRng) -> u64 {
    let bits = rng.random_range(0.0..=(OP_BYTES_MAX as f64).log2());
    (2f64.powf(bits) as u64).clamp(1, OP_BYTES_MAX)
}

/// Random disjoint, unaligned placements of `lens` in a buffer of `BUF_BYTES`.
fn place(lens: &[u64], rng: &mut StdRng) -> Vec<u64> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.shuffle(rng);
    let total: u64 = lens.iter().sum();
    let mut free = BUF_BYTES as u64 - total;
    let mut offsets = vec![0u64; lens.len()];
    let mut cursor = 0u64;
    for (k, &i) in order.iter().enumerate() {
        let gap = rng.random_range(0..=free / (lens.len() - k) as u64);
        free -= gap;
        offsets[i] = cursor + gap;
        cursor = offsets[i] + lens[i];
    }
    offsets
}

struct BatchStats {
    ops: usize,
    reads: usize,
    bytes: u64,
    elapsed: Duration,
}

/// Runs a random batch initiated by `from`'s endpoint against `to`'s buffer, and checks both.
fn random_batch(
    ep: &mut Endpoint,
    from: &mut Engine,
    to: &mut Engine,
    n_ops: usize,
    rng: &mut StdRng,
) -> Result<BatchStats> {
    let mut lens: Vec<u64> = vec![1, 2, OP_BYTES_MAX, OP_BYTES_MAX - 1];
    lens.extend([SLICE_BYTES as u64 - 1, SLICE_BYTES as u64, SLICE_BYTES as u64 + 1]);
    while lens.len() < n_ops {
        lens.push(random_len(rng));
    }
    while lens.iter().sum::<u64>() > BUF_BYTES as u64 {
        lens.pop();
    }
    lens.shuffle(rng);
    let (local_off, remote_off) = (place(&lens, rng), place(&lens, rng));
    let remote = to.mr.remote();
    let mut ops = Vec::with_capacity(lens.len());
    for (i, &len) in lens.iter().enumerate() {
        let kind = if rng.random_bool(0.5) { OpKind::Read } else { OpKind::Write };
        let (lo, ro) = (local_off[i] as usize, remote_off[i] as usize);
        ops.push(Op {
            id: 1000 + i as u64,
            kind,
            local: from.mr.slice(lo, len as usize)?,
            remote: remote.at(ro as u64, len)?,
        });
        // The image of what each buffer must hold afterwards.
        let n = len as usize;
        match kind {
            OpKind::Write => to.expected[ro..ro + n].copy_from_slice(&from.expected[lo..lo + n]),
            OpKind::Read => from.expected[lo..lo + n].copy_from_slice(&to.expected[ro..ro + n]),
        }
    }
    let start = Instant::now();
    ep.submit(&ops).context("submit batch")?;
    let done = collect(ep, ops.len(), BATCH_DEADLINE)?;
    let elapsed = start.elapsed();
    let mut seen = vec![false; ops.len()];
    for c in &done {
        let i = (c.id - 1000) as usize;
        ensure!(i < ops.len() && !seen[i], "completion for unknown or repeated op id {}", c.id);
        seen[i] = true;
        ensure!(
            c.len == ops[i].local.len && c.kind == ops[i].kind,
            "completion fields of {}",
            c.id
        );
        if let Err(e) = &c.result {
            bail!("op {} ({:?}, {} bytes) failed: {e}", c.id, c.kind, c.len);
        }
    }
    from.verify()?;
    to.verify()?;
    let reads = ops.iter().filter(|o| o.kind == OpKind::Read).count();
    Ok(BatchStats { ops: ops.len(), reads, bytes: lens.iter().sum(), elapsed })
}

/// Submits `ops` on a fresh pair and checks the first fails with `want` and the rest with
/// `Flushed`; the endpoint must then be broken.
fn expect_failure(ep: &mut Endpoint, ops: &[Op], want: ErrorKind, bound: Duration) -> Result<()> {
    let start = Instant::now();
    ep.submit(ops).context("submit failing op")?;
    let mut done = collect(ep, ops.len(), bound)?;
    done.sort_by_key(|c| c.id);
    let kinds: Vec<Option<ErrorKind>> =
        done.iter().map(|c| c.result.as_ref().err().map(|e| e.kind())).collect();
    ensure!(kinds[0] == Some(want), "first op: {:?}, want {want:?}", done[0].result);
    ensure!(kinds[1..].iter().all(|k| *k == Some(ErrorKind::Flushed)), "later ops: {kinds:?}");
    ensure!(ep.state() == EndpointState::Broken, "endpoint state {:?}", ep.state());
    let again = ep.submit(&ops[..1]).expect_err("submit on a broken endpoint");
    ensure!(again.kind() == ErrorKind::Broken && again.retryable(), "{again}");
    let t = Instant::now();
    let polled = ep.poll(Duration::from_secs(10)).expect_err("poll on a drained broken endpoint");
    ensure!(polled.kind() == ErrorKind::Broken, "{polled}");
    ensure!(
        t.elapsed() < Duration::from_secs(1),
        "poll on a broken endpoint waited {:?}",
        t.elapsed()
    );
    println!(
        "  {want:?} as expected in {:?}: {}",
        start.elapsed(),
        done[0].result.as_ref().err().map(ToString::to_string).unwrap_or_default()
    );
    Ok(())
}

fn good_write(id: u64, from: &Engine, to: &RemoteRegion, off: u64) -> Result<Op> {
    Ok(Op { id, kind: OpKind::Write, local: from.mr.slice(0, 4096)?, remote: to.at(off, 4096)? })
}

fn main() -> Result<()> {
    let start = Instant::now();
    let device = std::env::var("KVFS_RDMA_DEVICE").or_else(|_| std::env::var("RXE_DEVICE")).ok();
    let gid_index = match std::env::var("KVFS_RDMA_GID_INDEX") {
        Ok(v) => Some(v.parse().context("KVFS_RDMA_GID_INDEX")?),
        Err(_) => None,
    };
    let seed: u64 = std::env::var("KVFS_RDMA_SEED").map_or(Ok(0x6b76_6673), |v| v.parse())?;
    let n_ops: usize = std::env::var("KVFS_RDMA_OPS").map_or(Ok(48), |v| v.parse())?;
    let mut rng = StdRng::seed_from_u64(seed);
    let copts = ContextOptions { device, port: None, gid_index };
    let mut a = Engine::new("A", &copts, &mut rng)?;
    let mut b = Engine::new("B", &copts, &mut rng)?;
    println!("rdma_selftest: {:?} limits {:?}, seed {seed:#x}", a.ctx, a.ctx.limits());

    println!("[1] poll with nothing outstanding");
    let (mut ea, mut eb) = connect_pair(&a, &b)?;
    println!(
        "  connected qpn {} <-> qpn {}, path MTU {} bytes",
        ea.local_info().qpn,
        eb.local_info().qpn,
        ea.path_mtu().map_or(0, |m| m.bytes())
    );
    let t = Instant::now();
    let err = ea.poll(Duration::from_millis(300)).expect_err("poll with nothing outstanding");
    let waited = t.elapsed();
    ensure!(err.kind() == ErrorKind::Timeout, "{err}");
    ensure!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "{waited:?}");
    println!("  Timeout after {waited:?}: {err}");

    println!("[2] random batches, every byte of both buffers checked with blake3");
    let ab = random_batch(&mut ea, &mut a, &mut b, n_ops, &mut rng)?;
    let ba = random_batch(&mut eb, &mut b, &mut a, n_ops / 3, &mut rng)?;
    let stats = ea.window_stats();
    let opts = ea.options().clone();
    ensure!(stats.posted_peak <= opts.send_queue_depth, "{stats:?}");
    ensure!(stats.reads_peak <= opts.max_outstanding_reads as u32, "{stats:?}");
    for (name, s) in [("A->B", &ab), ("B->A", &ba)] {
        println!(
            "  {name}: {} ops ({} READ, {} WRITE), {} bytes verified in {:?} ({:.1} MB/s)",
            s.ops,
            s.reads,
            s.ops - s.reads,
            s.bytes,
            s.elapsed,
            s.bytes as f64 / s.elapsed.as_secs_f64() / 1e6
        );
    }
    println!(
        "  A's window: {} slices posted, peak {} in flight (depth {}), peak {} READs (max {})",
        stats.slices_posted,
        stats.posted_peak,
        opts.send_queue_depth,
        stats.reads_peak,
        opts.max_outstanding_reads
    );

    println!("[3] WRITE past the end of the peer's region");
    let remote = b.mr.remote();
    let past_end = RemoteAddr { addr: remote.addr + remote.len - 100, rkey: remote.rkey };
    let bad = Op { id: 1, kind: OpKind::Write, local: a.mr.slice(0, 4096)?, remote: past_end };
    let ops = [bad, good_write(2, &a, &remote, 0)?, good_write(3, &a, &remote, 8192)?];
    expect_failure(&mut ea, &ops, ErrorKind::RemoteAccess, POLL_TIMEOUT)?;
    b.verify().context("peer bytes after the refused WRITE")?;
    drop((ea, eb));

    println!("[4] bad rkey, and a local range outside its lkey");
    let (mut ea, _eb) = connect_pair(&a, &b)?;
    let bad_key = RemoteAddr { addr: remote.addr, rkey: remote.rkey ^ 0x5a5a_0000 };
    let bad = Op { id: 1, kind: OpKind::Read, local: a.mr.slice(0, 64)?, remote: bad_key };
    expect_failure(
        &mut ea,
        &[bad, good_write(2, &a, &remote, 0)?],
        ErrorKind::RemoteAccess,
        POLL_TIMEOUT,
    )?;
    let (mut ea, _eb) = connect_pair(&a, &b)?;
    let mut outside = a.mr.slice(0, 64)?;
    outside.addr = a.mr.addr() + a.mr.len() as u64 - 32;
    let bad = Op { id: 1, kind: OpKind::Write, local: outside, remote: remote.at(0, 64)? };
    expect_failure(
        &mut ea,
        &[bad, good_write(2, &a, &remote, 0)?],
        ErrorKind::LocalAccess,
        POLL_TIMEOUT,
    )?;
    a.verify()?;
    b.verify()?;

    println!("[5] WRITE to a peer whose endpoint is gone");
    let (mut ea, eb) = connect_pair(&a, &b)?;
    drop(eb);
    let ops = [good_write(1, &a, &remote, 0)?, good_write(2, &a, &remote, 8192)?];
    expect_failure(&mut ea, &ops, ErrorKind::RetryExceeded, POLL_TIMEOUT)?;
    b.verify()?;

    println!("[6] a fresh endpoint pair after the failures; A advertises MTU 1024, B 4096");
    let capped = EndpointOptions { path_mtu_max: Some(PathMtu::Mtu1024), ..endpoint_options() };
    let (mut ea, eb) = connect_pair_with(&a, &b, &capped, &endpoint_options())?;
    ensure!(eb.local_info().mtu == a.ctx.active_mtu(), "B advertises its active MTU");
    for (name, ep) in [("A", &ea), ("B", &eb)] {
        ensure!(ep.path_mtu() == Some(PathMtu::Mtu1024), "{name}: path MTU {:?}", ep.path_mtu());
    }
    let again = random_batch(&mut ea, &mut a, &mut b, 12, &mut rng)?;
    println!("  path MTU 1024 on both sides; {} ops, {} bytes verified", again.ops, again.bytes);

    println!("[7] abort with work in flight");
    let (mut ea, _eb) = connect_pair(&a, &b)?;
    let ops: Vec<Op> = (0..8u64)
        .map(|i| {
            let len = OP_BYTES_MAX;
            let (lo, ro) = (i * len, (7 - i) * len);
            Ok(Op {
                id: 1 + i,
                kind: if i % 2 == 0 { OpKind::Write } else { OpKind::Read },
                local: a.mr.slice(lo as usize, len as usize)?,
                remote: remote.at(ro, len)?,
            })
        })
        .collect::<Result<_>>()?;
    ea.submit(&ops)?;
    let t = Instant::now();
    ea.abort();
    let done = collect(&mut ea, ops.len(), POLL_TIMEOUT)?;
    let flushed = done
        .iter()
        .filter(|c| c.result.as_ref().is_err_and(|e| e.kind() == ErrorKind::Flushed))
        .count();
    let ok = done.iter().filter(|c| c.result.is_ok()).count();
    ensure!(
        flushed + ok == ops.len(),
        "after abort: {:?}",
        done.iter().map(|c| &c.result).collect::<Vec<_>>()
    );
    ensure!(flushed > 0, "abort right after submit flushed nothing");
    ensure!(ea.state() == EndpointState::Broken);
    println!(
        "  {} ops reported in {:?}: {ok} done before the abort, {flushed} Flushed",
        done.len(),
        t.elapsed()
    );

    let ops = ab.ops + ba.ops + again.ops;
    let bytes = ab.bytes + ba.bytes + again.bytes;
    println!(
        "rdma_selftest OK: {ops} ops, {bytes} bytes verified, {:.1} MB/s in the batches, {:?} in all",
        bytes as f64 / (ab.elapsed + ba.elapsed + again.elapsed).as_secs_f64() / 1e6,
        start.elapsed()
    );
    Ok(())
}
