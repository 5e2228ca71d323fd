//! The collectives and point-to-point calls (group.rs holds the machinery they run in).
//!
//! Algorithms, chosen by size (the same choice on every rank, since it depends only on the
//! arguments, which the frames' signatures check):
//! - *Inline* (per-rank data up to `inline_bytes_max`): one round, each rank's data inside its
//!   notification to each peer; reductions run on every rank over all contributions.
//! - *Staged* (larger): in segments of the staging half, each rank copies its data into
//!   staging, announces it, and pulls what it needs from the peers' staging. Allreduce is
//!   reduce-scatter then allgather: rank `r` pulls block `r` of every peer, reduces it and
//!   exposes the result, then every rank pulls every reduced block (each byte crosses twice,
//!   like a ring, with two rounds of announcements instead of `2(n-1)`). Broadcast, scatter,
//!   gather and reduce pull from or into the root; alltoall(v) pulls each rank's block.
//!
//! Determinism: a reduction always folds contributions in slot order, once, on one rank (the
//! block's owner for staged allreduce), so every rank gets the same bits and the same group and
//! size always give the same result.

use kvfs_transfer::Buffer;

use crate::dtype::{self, DType, ReduceOp};
use crate::group::{Ctx, Group, StepResult};
use crate::wire::P2pKind;
use crate::{Error, ErrorKind, Result};

/// Runs one operation to its end, again after a reconciliation that says so.
macro_rules! run_op {
    ($self:ident, $name:expr, |$ctx:ident| $step:expr) => {{
        let _op = $self.inner.op_lock.lock().await;
        let deadline = $self.deadline();
        loop {
            let $ctx = $self.begin($name, deadline).await?;
            let outcome = $step.await;
            if $self.end_step($name, &$ctx, outcome, deadline).await? {
                break Ok(());
            }
        }
    }};
}

const OP_ALLREDUCE: u64 = 1;
const OP_BROADCAST: u64 = 2;
const OP_ALLGATHER: u64 = 3;
const OP_REDUCE_SCATTER: u64 = 4;
const OP_REDUCE: u64 = 5;
const OP_GATHER: u64 = 6;
const OP_SCATTER: u64 = 7;
const OP_ALLTOALL: u64 = 8;
const OP_ALLTOALLV: u64 = 9;
const OP_BARRIER: u64 = 10;
const OP_ALLTOALLV_WITH: u64 = 11;

/// A frame signature: ranks calling with different arguments see different ones.
fn sig(parts: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Where each of consecutive blocks of `counts` bytes starts.
fn offsets(counts: &[u64]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |acc, &x| {
            let o = *acc;
            *acc += x as usize;
            Some(o)
        })
        .collect()
}

fn bad(op: &'static str, detail: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, op, detail)
}

/// `[off, off+len)` of a buffer this member owns.
///
/// The returned slice must not outlive the operation: staging is read by peers (through the
/// engine) only while its announcement is current, and written only by this member's one
/// running operation (`op_lock`); landing is written only by this member's own pulls, which
/// have completed when it is read.
#[allow(clippy::mut_from_ref)]
fn region(buf: &Buffer, off: usize, len: usize) -> &mut [u8] {
    assert!(off + len <= buf.len(), "region {off}+{len} outside a {} byte buffer", buf.len());
    // SAFETY: in bounds (checked above); the buffer lives as long as the borrow of `buf`;
    // exclusive use follows from the rules above (one operation at a time per member).
    unsafe { std::slice::from_raw_parts_mut(buf.as_ptr().add(off), len) }
}

/// Split of `len` bytes of `es`-byte elements into `n` blocks: block `j` is `ranges[j]`.
fn blocks(len: usize, es: usize, n: usize) -> (usize, Vec<(usize, usize)>) {
    let elems = len / es;
    let per = elems.div_ceil(n).max(1);
    let ranges = (0..n)
        .map(|j| {
            let a = (j * per).min(elems) * es;
            let b = ((j + 1) * per).min(elems) * es;
            (a, b - a)
        })
        .collect();
    (per * es, ranges)
}

/// Segments of `len` bytes, each at most `max` (a multiple of `es`).
fn segments(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = len.div_ceil(max).max(1);
    (0..count).map(move |s| (s * max, max.min(len - (s * max).min(len))))
}

fn round_down(x: usize, es: usize) -> usize {
    (x / es).max(1) * es
}

impl Group {
    fn inline_max(&self) -> usize {
        self.inner.cfg.inline_bytes_max
    }

    fn staging(&self, ctx: &Ctx, segment: u64) -> &Buffer {
        &self.inner.staging[ctx.half(segment)]
    }

    /// Allreduce in place: every active rank ends with the reduction of all ranks' `data`.
    pub async fn allreduce(&self, data: &mut [u8], dt: DType, op: ReduceOp) -> Result<()> {
        dtype::check(dt, op, data.len())?;
        let s = sig(&[OP_ALLREDUCE, dt as u64, op as u64, data.len() as u64]);
        run_op!(self, "allreduce", |ctx| self.allreduce_step(&ctx, data, dt, op, s))
    }

    async fn allreduce_step(
        &self,
        ctx: &Ctx,
        data: &mut [u8],
        dt: DType,
        op: ReduceOp,
        s: u64,
    ) -> StepResult<u64> {
        let n = ctx.n();
        if n == 1 || data.is_empty() {
            self.commit(ctx).await?;
            return Ok(0);
        }
        let others: Vec<usize> = ctx.others().collect();
        if data.len() <= self.inline_max() {
            self.send_many(ctx, others.iter().copied(), 0, s, data).await?;
            let got = self.recv_many(ctx, &others, 0, s, "allreduce").await?;
            let mut out = vec![0u8; data.len()];
            {
                let mut parts: Vec<&[u8]> = got.iter().map(Vec::as_slice).collect();
                parts.insert(ctx.me, data);
                dtype::reduce(dt, op, &parts, &mut out);
            }
            self.commit(ctx).await?;
            data.copy_from_slice(&out);
            return Ok(0);
        }
        self.allreduce_staged(ctx, data, dt, op, s, &others).await
    }

    /// Staged allreduce, per segment of at most the staging size: each rank writes block `j`
    /// of its data straight from the caller's memory into rank `j`'s inbox (reduce-scatter by
    /// writes), rank `j` folds its block in slot order into its staging, and every rank reads
    /// the reduced blocks straight into the caller's memory (allgather by reads). The
    /// caller's buffer is registered with the engine for the call, so neither side copies
    /// through staging; where it cannot be registered it bounces through local memory.
    async fn allreduce_staged(
        &self,
        ctx: &Ctx,
        data: &mut [u8],
        dt: DType,
        op: ReduceOp,
        s: u64,
        others: &[usize],
    ) -> StepResult<u64> {
        let (n, es) = (ctx.n(), dt.size());
        let seg_max = round_down(ctx.staging_min().min(ctx.inbox_min() - n * es), es);
        // SAFETY: `data` is borrowed for the whole call; `move_items` awaits every transfer.
        let user = unsafe { self.register_user(data.as_ptr() as u64, data.len() as u64) };
        let mut seg_no = 0u64;
        for (a, len) in segments(data.len(), seg_max) {
            let half = ctx.half(seg_no);
            let phase = 2 * seg_no as u32;
            let (blk, ranges) = blocks(len, es, n);
            let (mine_at, mine_len) = ranges[ctx.me];
            // The segment's source: the caller's memory, or a copy in the bounce buffer.
            let src = match &user {
                Some(_) => data[a..].as_ptr() as u64,
                None => {
                    region(&self.inner.bounce, 0, len).copy_from_slice(&data[a..a + len]);
                    self.inner.bounce.addr()
                }
            };
            let pushes: Vec<_> = others
                .iter()
                .map(|&j| {
                    let (at, l) = ranges[j];
                    let dst = ctx.members[j].inbox[half] + (ctx.me * blk) as u64;
                    (j, src + at as u64, dst, l as u64, true)
                })
                .collect();
            self.move_items(ctx, &pushes).await?;
            self.send_many(ctx, others.iter().copied(), phase, s, &[]).await?;
            self.recv_many(ctx, others, phase, s, "allreduce").await?;
            let stage = self.staging(ctx, seg_no);
            if mine_len > 0 {
                let inbox = &self.inner.inbox[half];
                let own: &[u8] = match &user {
                    Some(_) => &data[a + mine_at..a + mine_at + mine_len],
                    None => region(&self.inner.bounce, mine_at, mine_len),
                };
                let parts: Vec<&[u8]> = (0..n)
                    .map(|j| if j == ctx.me { own } else { &*region(inbox, j * blk, mine_len) })
                    .collect();
                dtype::reduce(dt, op, &parts, region(stage, mine_at, mine_len));
            }
            self.send_many(ctx, others.iter().copied(), phase + 1, s, &[]).await?;
            self.recv_many(ctx, others, phase + 1, s, "allreduce").await?;
            self.commit(ctx).await?;
            let dst = match &user {
                Some(_) => data[a..].as_mut_ptr() as u64,
                None => self.inner.bounce.addr(),
            };
            let pulls: Vec<_> = others
                .iter()
                .map(|&j| {
                    let (at, l) = ranges[j];
                    (j, dst + at as u64, ctx.members[j].staging[half] + at as u64, l as u64, false)
                })
                .collect();
            self.move_items(ctx, &pulls).await?;
            let reduced = region(stage, mine_at, mine_len);
            data[a + mine_at..a + mine_at + mine_len].copy_from_slice(reduced);
            if user.is_none() {
                for &j in others {
                    let (at, l) = ranges[j];
                    data[a + at..a + at + l].copy_from_slice(region(&self.inner.bounce, at, l));
                }
            }
            seg_no += 1;
        }
        self.reads_done(ctx);
        Ok(seg_no)
    }

    /// Broadcast in place from `root` (a slot).
    pub async fn broadcast(&self, data: &mut [u8], root: u32) -> Result<()> {
        let s = sig(&[OP_BROADCAST, root as u64, data.len() as u64]);
        run_op!(self, "broadcast", |ctx| self.broadcast_step(&ctx, data, root, s))
    }

    async fn broadcast_step(
        &self,
        ctx: &Ctx,
        data: &mut [u8],
        root: u32,
        s: u64,
    ) -> StepResult<u64> {
        let r = ctx.rank_of(root, "broadcast")?;
        let others: Vec<usize> = ctx.others().collect();
        if ctx.n() == 1 || data.is_empty() {
            return Ok(0);
        }
        if data.len() <= self.inline_max() {
            if r == ctx.me {
                self.send_many(ctx, others.iter().copied(), 0, s, data).await?;
            } else {
                let got = self.recv_many(ctx, &[r], 0, s, "broadcast").await?;
                self.commit(ctx).await?;
                data.copy_from_slice(&got[0]);
            }
            return Ok(0);
        }
        let seg_max = ctx.staging_min().min(ctx.landing_min());
        let mut seg_no = 0u64;
        for (a, len) in segments(data.len(), seg_max) {
            let phase = 2 * seg_no as u32;
            if r == ctx.me {
                region(self.staging(ctx, seg_no), 0, len).copy_from_slice(&data[a..a + len]);
                self.send_many(ctx, others.iter().copied(), phase, s, &[]).await?;
                self.recv_many(ctx, &others, phase + 1, s, "broadcast").await?;
            } else {
                self.pull_from_root(ctx, r, seg_no, 0, len, s, "broadcast").await?;
                data[a..a + len].copy_from_slice(region(&self.inner.landing, 0, len));
            }
            seg_no += 1;
        }
        Ok(seg_no)
    }

    /// A reader's step of a rooted operation: waits for the root's announcement of segment
    /// `seg_no`, pulls `len` bytes at `off` of its staging into the landing, tells the root it
    /// is done, and commits (the caller copies the landing out).
    #[allow(clippy::too_many_arguments)]
    async fn pull_from_root(
        &self,
        ctx: &Ctx,
        root: usize,
        seg_no: u64,
        off: usize,
        len: usize,
        s: u64,
        op: &'static str,
    ) -> StepResult<()> {
        let phase = 2 * seg_no as u32;
        self.recv_many(ctx, &[root], phase, s, op).await?;
        self.pull(ctx, ctx.half(seg_no), &[(root, off as u64, len as u64, 0)]).await?;
        self.frame(ctx, root, phase + 1, s, Vec::new()).await?;
        self.commit(ctx).await
    }

    /// Allgather: `output` (`n * input.len()` bytes) receives every active rank's `input`, in
    /// slot order.
    pub async fn allgather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let s = sig(&[OP_ALLGATHER, input.len() as u64]);
        run_op!(self, "allgather", |ctx| self.allgather_step(&ctx, input, output, s))
    }

    async fn allgather_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        output: &mut [u8],
        s: u64,
    ) -> StepResult<u64> {
        let (n, l) = (ctx.n(), input.len());
        if output.len() != n * l {
            return Err(bad(
                "allgather",
                format!("output holds {} bytes, {n} ranks x {l} need {}", output.len(), n * l),
            )
            .into());
        }
        let others: Vec<usize> = ctx.others().collect();
        if n == 1 || l == 0 || l <= self.inline_max() {
            if n > 1 && l > 0 {
                self.send_many(ctx, others.iter().copied(), 0, s, input).await?;
            }
            let got = if n > 1 && l > 0 {
                self.recv_many(ctx, &others, 0, s, "allgather").await?
            } else {
                vec![]
            };
            self.commit(ctx).await?;
            output[ctx.me * l..(ctx.me + 1) * l].copy_from_slice(input);
            for (j, body) in others.iter().zip(got) {
                output[j * l..(j + 1) * l].copy_from_slice(&body);
            }
            return Ok(0);
        }
        let seg_max = ctx.staging_min().min(ctx.landing_min() / (n - 1));
        let mut seg_no = 0u64;
        for (a, len) in segments(l, seg_max) {
            region(self.staging(ctx, seg_no), 0, len).copy_from_slice(&input[a..a + len]);
            self.send_many(ctx, others.iter().copied(), seg_no as u32, s, &[]).await?;
            self.recv_many(ctx, &others, seg_no as u32, s, "allgather").await?;
            let pulls: Vec<_> = others
                .iter()
                .enumerate()
                .map(|(i, &j)| (j, 0, len as u64, (i * len) as u64))
                .collect();
            self.pull(ctx, ctx.half(seg_no), &pulls).await?;
            self.commit(ctx).await?;
            output[ctx.me * l + a..ctx.me * l + a + len].copy_from_slice(&input[a..a + len]);
            for (i, &j) in others.iter().enumerate() {
                output[j * l + a..j * l + a + len].copy_from_slice(region(
                    &self.inner.landing,
                    i * len,
                    len,
                ));
            }
            seg_no += 1;
        }
        self.reads_done(ctx);
        Ok(seg_no)
    }

    /// Reduce-scatter: `input` holds `n` blocks of `output.len()` bytes, block `j` for the
    /// `j`-th active rank; each rank's `output` receives the reduction of its block.
    pub async fn reduce_scatter(
        &self,
        input: &[u8],
        output: &mut [u8],
        dt: DType,
        op: ReduceOp,
    ) -> Result<()> {
        dtype::check(dt, op, output.len())?;
        let s = sig(&[OP_REDUCE_SCATTER, dt as u64, op as u64, output.len() as u64]);
        run_op!(self, "reduce_scatter", |ctx| self
            .reduce_scatter_step(&ctx, input, output, dt, op, s))
    }

    async fn reduce_scatter_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        output: &mut [u8],
        dt: DType,
        op: ReduceOp,
        s: u64,
    ) -> StepResult<u64> {
        let (n, l) = (ctx.n(), output.len());
        if input.len() != n * l {
            return Err(bad(
                "reduce_scatter",
                format!("input holds {} bytes, {n} ranks x {l} need {}", input.len(), n * l),
            )
            .into());
        }
        let others: Vec<usize> = ctx.others().collect();
        let block = |j: usize| &input[j * l..(j + 1) * l];
        if n == 1 || l == 0 || l <= self.inline_max() {
            let mut got = Vec::new();
            if n > 1 && l > 0 {
                let sends: Vec<_> =
                    others.iter().map(|&j| self.frame(ctx, j, 0, s, block(j).to_vec())).collect();
                for r in self.unless_interrupted(ctx, futures_util::future::join_all(sends)).await?
                {
                    r?;
                }
                got = self.recv_many(ctx, &others, 0, s, "reduce_scatter").await?;
            }
            let mut out = vec![0u8; l];
            {
                let mut parts: Vec<&[u8]> = got.iter().map(Vec::as_slice).collect();
                parts.insert(ctx.me, block(ctx.me));
                dtype::reduce(dt, op, &parts, &mut out);
            }
            self.commit(ctx).await?;
            output.copy_from_slice(&out);
            return Ok(0);
        }
        let es = dt.size();
        let seg_max = round_down(ctx.staging_min().min(ctx.landing_min()) / n, es);
        let mut seg_no = 0u64;
        for (a, len) in segments(l, seg_max) {
            let stage = self.staging(ctx, seg_no);
            for j in 0..n {
                region(stage, j * len, len).copy_from_slice(&block(j)[a..a + len]);
            }
            self.send_many(ctx, others.iter().copied(), seg_no as u32, s, &[]).await?;
            self.recv_many(ctx, &others, seg_no as u32, s, "reduce_scatter").await?;
            let pulls: Vec<_> = others
                .iter()
                .map(|&j| (j, (ctx.me * len) as u64, len as u64, (j * len) as u64))
                .collect();
            self.pull(ctx, ctx.half(seg_no), &pulls).await?;
            let landing = &self.inner.landing;
            let parts: Vec<&[u8]> = (0..n)
                .map(|j| {
                    if j == ctx.me {
                        &*region(stage, j * len, len)
                    } else {
                        &*region(landing, j * len, len)
                    }
                })
                .collect();
            let out = region(landing, ctx.me * len, len);
            dtype::reduce(dt, op, &parts, out);
            self.commit(ctx).await?;
            output[a..a + len].copy_from_slice(out);
            seg_no += 1;
        }
        self.reads_done(ctx);
        Ok(seg_no)
    }

    /// Reduce into `root`'s `data`; other ranks' `data` is left as it was.
    pub async fn reduce(&self, data: &mut [u8], dt: DType, op: ReduceOp, root: u32) -> Result<()> {
        dtype::check(dt, op, data.len())?;
        let s = sig(&[OP_REDUCE, dt as u64, op as u64, root as u64, data.len() as u64]);
        run_op!(self, "reduce", |ctx| self.reduce_step(&ctx, data, dt, op, root, s))
    }

    async fn reduce_step(
        &self,
        ctx: &Ctx,
        data: &mut [u8],
        dt: DType,
        op: ReduceOp,
        root: u32,
        s: u64,
    ) -> StepResult<u64> {
        let r = ctx.rank_of(root, "reduce")?;
        let (n, es) = (ctx.n(), dt.size());
        let others: Vec<usize> = ctx.others().collect();
        if n == 1 || data.is_empty() {
            self.commit(ctx).await?;
            return Ok(0);
        }
        if data.len() <= self.inline_max() {
            if r != ctx.me {
                self.frame(ctx, r, 0, s, data.to_vec()).await?;
                return Ok(0);
            }
            let got = self.recv_many(ctx, &others, 0, s, "reduce").await?;
            let mut out = vec![0u8; data.len()];
            {
                let mut parts: Vec<&[u8]> = got.iter().map(Vec::as_slice).collect();
                parts.insert(ctx.me, data);
                dtype::reduce(dt, op, &parts, &mut out);
            }
            self.commit(ctx).await?;
            data.copy_from_slice(&out);
            return Ok(0);
        }
        let seg_max = round_down(ctx.staging_min().min(ctx.landing_min() / n), es);
        let mut seg_no = 0u64;
        for (a, len) in segments(data.len(), seg_max) {
            let phase = 2 * seg_no as u32;
            let stage = self.staging(ctx, seg_no);
            region(stage, 0, len).copy_from_slice(&data[a..a + len]);
            if r != ctx.me {
                self.frame(ctx, r, phase, s, Vec::new()).await?;
                self.recv_many(ctx, &[r], phase + 1, s, "reduce").await?;
            } else {
                self.recv_many(ctx, &others, phase, s, "reduce").await?;
                let pulls: Vec<_> =
                    others.iter().map(|&j| (j, 0, len as u64, (j * len) as u64)).collect();
                self.pull(ctx, ctx.half(seg_no), &pulls).await?;
                self.send_many(ctx, others.iter().copied(), phase + 1, s, &[]).await?;
                let landing = &self.inner.landing;
                let parts: Vec<&[u8]> = (0..n)
                    .map(|j| {
                        if j == ctx.me {
                            &*region(stage, 0, len)
                        } else {
                            &*region(landing, j * len, len)
                        }
                    })
                    .collect();
                let out = region(landing, ctx.me * len, len);
                dtype::reduce(dt, op, &parts, out);
                self.commit(ctx).await?;
                data[a..a + len].copy_from_slice(out);
            }
            seg_no += 1;
        }
        Ok(seg_no)
    }

    /// Gather to `root`: its `output` (`n * input.len()` bytes) receives every rank's `input`
    /// in slot order; other ranks pass `None`.
    pub async fn gather(
        &self,
        input: &[u8],
        mut output: Option<&mut [u8]>,
        root: u32,
    ) -> Result<()> {
        let s = sig(&[OP_GATHER, root as u64, input.len() as u64]);
        run_op!(self, "gather", |ctx| self.gather_step(&ctx, input, output.as_deref_mut(), root, s))
    }

    async fn gather_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: u32,
        s: u64,
    ) -> StepResult<u64> {
        let r = ctx.rank_of(root, "gather")?;
        let (n, l) = (ctx.n(), input.len());
        let others: Vec<usize> = ctx.others().collect();
        if r != ctx.me {
            if n == 1 || l == 0 {
                return Ok(0);
            }
            if l <= self.inline_max() {
                self.frame(ctx, r, 0, s, input.to_vec()).await?;
                return Ok(0);
            }
            let seg_max = ctx.staging_min().min(ctx.landing_min() / n);
            let mut seg_no = 0u64;
            for (a, len) in segments(l, seg_max) {
                let phase = 2 * seg_no as u32;
                region(self.staging(ctx, seg_no), 0, len).copy_from_slice(&input[a..a + len]);
                self.frame(ctx, r, phase, s, Vec::new()).await?;
                self.recv_many(ctx, &[r], phase + 1, s, "gather").await?;
                seg_no += 1;
            }
            return Ok(seg_no);
        }
        let Some(output) = output else {
            return Err(bad("gather", "the root needs an output buffer".into()).into());
        };
        if output.len() != n * l {
            return Err(bad(
                "gather",
                format!("output holds {} bytes, {n} x {l} needed", output.len()),
            )
            .into());
        }
        if n == 1 || l == 0 || l <= self.inline_max() {
            let got = if n > 1 && l > 0 {
                self.recv_many(ctx, &others, 0, s, "gather").await?
            } else {
                vec![]
            };
            self.commit(ctx).await?;
            output[ctx.me * l..(ctx.me + 1) * l].copy_from_slice(input);
            for (&j, body) in others.iter().zip(got) {
                output[j * l..(j + 1) * l].copy_from_slice(&body);
            }
            return Ok(0);
        }
        let seg_max = ctx.staging_min().min(ctx.landing_min() / n);
        let mut seg_no = 0u64;
        for (a, len) in segments(l, seg_max) {
            let phase = 2 * seg_no as u32;
            self.recv_many(ctx, &others, phase, s, "gather").await?;
            let pulls: Vec<_> =
                others.iter().map(|&j| (j, 0, len as u64, (j * len) as u64)).collect();
            self.pull(ctx, ctx.half(seg_no), &pulls).await?;
            self.send_many(ctx, others.iter().copied(), phase + 1, s, &[]).await?;
            self.commit(ctx).await?;
            output[ctx.me * l + a..ctx.me * l + a + len].copy_from_slice(&input[a..a + len]);
            for &j in &others {
                output[j * l + a..j * l + a + len].copy_from_slice(region(
                    &self.inner.landing,
                    j * len,
                    len,
                ));
            }
            seg_no += 1;
        }
        Ok(seg_no)
    }

    /// Scatter from `root`: its `input` holds `n` blocks of `output.len()` bytes, block `j` for
    /// the `j`-th active rank; other ranks pass `None`.
    pub async fn scatter(&self, input: Option<&[u8]>, output: &mut [u8], root: u32) -> Result<()> {
        let s = sig(&[OP_SCATTER, root as u64, output.len() as u64]);
        run_op!(self, "scatter", |ctx| self.scatter_step(&ctx, input, output, root, s))
    }

    async fn scatter_step(
        &self,
        ctx: &Ctx,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: u32,
        s: u64,
    ) -> StepResult<u64> {
        let r = ctx.rank_of(root, "scatter")?;
        let (n, l) = (ctx.n(), output.len());
        let others: Vec<usize> = ctx.others().collect();
        if r == ctx.me {
            let Some(input) = input else {
                return Err(bad("scatter", "the root needs an input buffer".into()).into());
            };
            if input.len() != n * l {
                return Err(bad(
                    "scatter",
                    format!("input holds {} bytes, {n} x {l} needed", input.len()),
                )
                .into());
            }
            let block = |j: usize| &input[j * l..(j + 1) * l];
            let mut steps = 0;
            if n > 1 && l > 0 {
                if l <= self.inline_max() {
                    let sends: Vec<_> = others
                        .iter()
                        .map(|&j| self.frame(ctx, j, 0, s, block(j).to_vec()))
                        .collect();
                    for res in
                        self.unless_interrupted(ctx, futures_util::future::join_all(sends)).await?
                    {
                        res?;
                    }
                } else {
                    let seg_max = ctx.staging_min() / n;
                    for (seg_no, (a, len)) in segments(l, seg_max).enumerate() {
                        let stage = self.staging(ctx, seg_no as u64);
                        for j in 0..n {
                            region(stage, j * len, len).copy_from_slice(&block(j)[a..a + len]);
                        }
                        let phase = 2 * seg_no as u32;
                        self.send_many(ctx, others.iter().copied(), phase, s, &[]).await?;
                        self.recv_many(ctx, &others, phase + 1, s, "scatter").await?;
                        steps += 1;
                    }
                }
            }
            self.commit(ctx).await?;
            output.copy_from_slice(block(ctx.me));
            return Ok(steps);
        }
        if l == 0 {
            return Ok(0);
        }
        if l <= self.inline_max() {
            let got = self.recv_many(ctx, &[r], 0, s, "scatter").await?;
            self.commit(ctx).await?;
            output.copy_from_slice(&got[0]);
            return Ok(0);
        }
        let seg_max = ctx.staging_min() / n;
        let mut seg_no = 0u64;
        for (a, len) in segments(l, seg_max) {
            self.pull_from_root(ctx, r, seg_no, ctx.me * len, len, s, "scatter").await?;
            output[a..a + len].copy_from_slice(region(&self.inner.landing, 0, len));
            seg_no += 1;
        }
        Ok(seg_no)
    }

    /// Alltoall: `input` and `output` hold `n` blocks of equal size; block `j` of `input` goes
    /// to the `j`-th active rank, block `j` of `output` comes from it.
    pub async fn alltoall(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        if input.len() != output.len() {
            return Err(bad(
                "alltoall",
                format!("input {} and output {} bytes differ", input.len(), output.len()),
            ));
        }
        let s = sig(&[OP_ALLTOALL, input.len() as u64]);
        run_op!(self, "alltoall", |ctx| self.alltoall_step(&ctx, input, output, s))
    }

    async fn alltoall_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        output: &mut [u8],
        s: u64,
    ) -> StepResult<u64> {
        let n = ctx.n();
        if !input.len().is_multiple_of(n) {
            return Err(bad(
                "alltoall",
                format!("{} bytes do not split into {n} blocks", input.len()),
            )
            .into());
        }
        let l = input.len() / n;
        let counts = vec![l as u64; n];
        self.alltoallv_step(ctx, input, &counts, output, &counts, s, false).await
    }

    /// Alltoallv: `send_counts[j]` bytes of `input` (consecutive, in rank order) go to the
    /// `j`-th active rank; `recv_counts[j]` bytes from it land in `output` (consecutive).
    pub async fn alltoallv(
        &self,
        input: &[u8],
        send_counts: &[u64],
        output: &mut [u8],
        recv_counts: &[u64],
    ) -> Result<()> {
        if send_counts.iter().sum::<u64>() != input.len() as u64
            || recv_counts.iter().sum::<u64>() != output.len() as u64
        {
            return Err(bad("alltoallv", "counts do not add up to the buffers' sizes".into()));
        }
        let s = sig(&[OP_ALLTOALLV, send_counts.len() as u64]);
        run_op!(self, "alltoallv", |ctx| self.alltoallv_step(
            &ctx,
            input,
            send_counts,
            output,
            recv_counts,
            s,
            true
        ))
    }

    /// Alltoallv where each rank knows only what it sends: `build` gets the active slots of
    /// the attempt (it runs again over the survivors when a failure interrupts one) and returns
    /// the messages for them, consecutive in one buffer, with each one's length. Returns the
    /// slots the exchange ran over, what each of them sent here (consecutive), and the lengths.
    pub async fn alltoallv_with(
        &self,
        build: impl Fn(&[u32]) -> (Vec<u8>, Vec<u64>),
    ) -> Result<(Vec<u32>, Vec<u8>, Vec<u64>)> {
        let s = sig(&[OP_ALLTOALLV_WITH]);
        let _op = self.inner.op_lock.lock().await;
        let deadline = self.deadline();
        loop {
            let ctx = self.begin("alltoallv", deadline).await?;
            let slots = ctx.slots();
            let (input, send) = build(&slots);
            let mut got = (Vec::new(), Vec::new());
            let outcome = self.alltoallv_with_step(&ctx, &input, &send, &mut got, s).await;
            if self.end_step("alltoallv", &ctx, outcome, deadline).await? {
                return Ok((slots, got.0, got.1));
            }
        }
    }

    async fn alltoallv_with_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        send: &[u64],
        got: &mut (Vec<u8>, Vec<u64>),
        s: u64,
    ) -> StepResult<u64> {
        let n = ctx.n();
        if send.len() != n || send.iter().sum::<u64>() != input.len() as u64 {
            return Err(bad(
                "alltoallv",
                format!("{} messages of {} bytes for {n} active ranks", send.len(), input.len()),
            )
            .into());
        }
        let others: Vec<usize> = ctx.others().collect();
        let mut matrix = vec![vec![0u64; n]; n];
        matrix[ctx.me] = send.to_vec();
        if n > 1 {
            for (j, theirs) in self.exchange_counts(ctx, &others, send, s).await? {
                matrix[j] = theirs;
            }
        }
        let recv: Vec<u64> = (0..n).map(|j| matrix[j][ctx.me]).collect();
        let mut output = vec![0u8; recv.iter().sum::<u64>() as usize];
        let steps =
            self.alltoallv_move(ctx, input, send, &mut output, &recv, &matrix, 1, s).await?;
        *got = (output, recv);
        Ok(steps)
    }

    /// Round 0 of an alltoallv: sends `mine` to every other rank and returns each one's list
    /// (of the same length, or `Mismatch`), by rank.
    async fn exchange_counts(
        &self,
        ctx: &Ctx,
        others: &[usize],
        mine: &[u64],
        s: u64,
    ) -> StepResult<Vec<(usize, Vec<u64>)>> {
        let bytes: Vec<u8> = mine.iter().flat_map(|c| c.to_le_bytes()).collect();
        self.send_many(ctx, others.iter().copied(), 0, s, &bytes).await?;
        let bodies = self.recv_many(ctx, others, 0, s, "alltoallv").await?;
        let mut out = Vec::with_capacity(others.len());
        for (&j, body) in others.iter().zip(&bodies) {
            if body.len() != bytes.len() {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    "alltoallv",
                    format!("slot {} has another group size", ctx.members[j].slot),
                )
                .into());
            }
            let theirs = body
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
                .collect();
            out.push((j, theirs));
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    async fn alltoallv_step(
        &self,
        ctx: &Ctx,
        input: &[u8],
        send: &[u64],
        output: &mut [u8],
        recv: &[u64],
        s: u64,
        exchange: bool,
    ) -> StepResult<u64> {
        let n = ctx.n();
        if send.len() != n || recv.len() != n {
            return Err(bad(
                "alltoallv",
                format!("{} send and {} recv counts for {n} active ranks", send.len(), recv.len()),
            )
            .into());
        }
        let others: Vec<usize> = ctx.others().collect();
        // Uneven counts: exchange them first so every rank plans the same rounds.
        let mut matrix = vec![send.to_vec(); n];
        if exchange && n > 1 {
            let mine: Vec<u64> = send.iter().chain(recv).copied().collect();
            for (j, theirs) in self.exchange_counts(ctx, &others, &mine, s).await? {
                if theirs[ctx.me] != recv[j] || theirs[n + ctx.me] != send[j] {
                    return Err(Error::new(
                        ErrorKind::Mismatch,
                        "alltoallv",
                        format!(
                            "slot {} sends {} bytes here and expects {}; this rank expects {} and sends {}",
                            ctx.members[j].slot, theirs[ctx.me], theirs[n + ctx.me], recv[j], send[j]
                        ),
                    )
                    .into());
                }
                matrix[j] = theirs[..n].to_vec();
            }
        } else if recv.iter().zip(send).any(|(r, s)| r != s) {
            return Err(bad("alltoall", "send and receive blocks differ".into()).into());
        }
        let base = if exchange { 1u32 } else { 0 };
        self.alltoallv_move(ctx, input, send, output, recv, &matrix, base, s).await
    }

    /// The data movement of an alltoallv whose count matrix (`matrix[j]`: what rank `j` sends
    /// to each rank) every rank knows, from phase `base` on.
    #[allow(clippy::too_many_arguments)]
    async fn alltoallv_move(
        &self,
        ctx: &Ctx,
        input: &[u8],
        send: &[u64],
        output: &mut [u8],
        recv: &[u64],
        matrix: &[Vec<u64>],
        base: u32,
        s: u64,
    ) -> StepResult<u64> {
        let n = ctx.n();
        let others: Vec<usize> = ctx.others().collect();
        let (soff, roff) = (offsets(send), offsets(recv));
        let most = matrix.iter().flatten().copied().max().unwrap_or(0) as usize;
        if n == 1 || most <= self.inline_max() {
            let mut got = Vec::new();
            if n > 1 && most > 0 {
                let sends: Vec<_> = others
                    .iter()
                    .map(|&j| {
                        self.frame(
                            ctx,
                            j,
                            base,
                            s,
                            input[soff[j]..soff[j] + send[j] as usize].to_vec(),
                        )
                    })
                    .collect();
                for res in
                    self.unless_interrupted(ctx, futures_util::future::join_all(sends)).await?
                {
                    res?;
                }
                got = self.recv_many(ctx, &others, base, s, "alltoall").await?;
            }
            self.commit(ctx).await?;
            output[roff[ctx.me]..roff[ctx.me] + recv[ctx.me] as usize]
                .copy_from_slice(&input[soff[ctx.me]..soff[ctx.me] + send[ctx.me] as usize]);
            for (&j, body) in others.iter().zip(got) {
                if body.len() != recv[j] as usize {
                    return Err(Error::new(
                        ErrorKind::Mismatch,
                        "alltoall",
                        format!(
                            "slot {} sent {} bytes, {} expected",
                            ctx.members[j].slot,
                            body.len(),
                            recv[j]
                        ),
                    )
                    .into());
                }
                output[roff[j]..roff[j] + body.len()].copy_from_slice(&body);
            }
            return Ok(0);
        }
        let l = (ctx.staging_min().min(ctx.landing_min()) / n).max(1);
        let rounds = most.div_ceil(l);
        let mut committed = false;
        for round in 0..rounds {
            let a = round * l;
            let stage = self.staging(ctx, round as u64);
            let part = |count: u64| (count as usize).saturating_sub(a).min(l);
            for j in 0..n {
                let len = part(send[j]);
                if len > 0 {
                    region(stage, j * l, len)
                        .copy_from_slice(&input[soff[j] + a..soff[j] + a + len]);
                }
            }
            let phase = base + round as u32;
            self.send_many(ctx, others.iter().copied(), phase, s, &[]).await?;
            self.recv_many(ctx, &others, phase, s, "alltoall").await?;
            let pulls: Vec<_> = others
                .iter()
                .map(|&j| (j, (ctx.me * l) as u64, part(matrix[j][ctx.me]) as u64, (j * l) as u64))
                .collect();
            self.pull(ctx, ctx.half(round as u64), &pulls).await?;
            if !committed {
                self.commit(ctx).await?;
                committed = true;
            }
            let own = part(send[ctx.me]);
            output[roff[ctx.me] + a..roff[ctx.me] + a + own]
                .copy_from_slice(&input[soff[ctx.me] + a..soff[ctx.me] + a + own]);
            for &j in &others {
                let len = part(recv[j]);
                output[roff[j] + a..roff[j] + a + len].copy_from_slice(region(
                    &self.inner.landing,
                    j * l,
                    len,
                ));
            }
        }
        self.reads_done(ctx);
        Ok(rounds as u64)
    }

    /// Returns once every active rank has called it.
    pub async fn barrier(&self) -> Result<()> {
        let s = sig(&[OP_BARRIER]);
        run_op!(self, "barrier", |ctx| self.barrier_step(&ctx, s))
    }

    async fn barrier_step(&self, ctx: &Ctx, s: u64) -> StepResult<u64> {
        let others: Vec<usize> = ctx.others().collect();
        self.send_many(ctx, others.iter().copied(), 0, s, &[]).await?;
        self.recv_many(ctx, &others, 0, s, "barrier").await?;
        self.commit(ctx).await?;
        Ok(0)
    }

    fn p2p_peer(&self, slot: u32, op: &'static str) -> Result<(u64, crate::wire::MemberInfo)> {
        let v = self.view();
        if slot == self.slot() {
            return Err(bad(op, "a rank cannot send to or receive from itself".into()));
        }
        let m = v.member(slot).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::UnknownSlot,
                op,
                format!("slot {slot} is not active at epoch {}", v.epoch),
            )
        })?;
        Ok((v.epoch, m))
    }

    /// Sends `data` to slot `dst`, matched by the receiver's `recv(src, tag)` calls in order.
    /// Small messages travel inline and return at once; a large one returns once the receiver
    /// has pulled all of it but its last part.
    pub async fn send(&self, data: &[u8], dst: u32, tag: u32) -> Result<()> {
        let (epoch, m) = self.p2p_peer(dst, "send")?;
        let pseq = self.next_send_seq(&m, tag);
        if data.len() <= self.inline_max() {
            return self.p2p_notify(&m, epoch, tag, pseq, P2pKind::Inline(data.to_vec())).await;
        }
        let _one = self.inner.send_lock.lock().await;
        let deadline = self.deadline();
        // The previous large send's last part may still be waiting to be pulled.
        self.wait_p2p_staging(deadline).await?;
        let max = self.inner.cfg.staging_bytes.min(m.staging_bytes as usize);
        let parts = data.len().div_ceil(max);
        for (part, (a, len)) in segments(data.len(), max).enumerate() {
            if part > 0 {
                self.wait_p2p_staging(deadline).await?;
            }
            region(&self.inner.p2p_staging, 0, len).copy_from_slice(&data[a..a + len]);
            let kind = P2pKind::Ready {
                total: data.len() as u64,
                part: part as u32,
                addr: self.inner.p2p_staging.addr(),
                len: len as u64,
            };
            self.p2p_notify(&m, epoch, tag, pseq, kind).await?;
            self.set_p2p_outstanding(&m, tag, pseq, part as u32);
        }
        debug_assert!(parts >= 1);
        Ok(())
    }

    /// Receives the next message from slot `src` with `tag` into `out` (its size must match).
    pub async fn recv(&self, out: &mut [u8], src: u32, tag: u32) -> Result<()> {
        let pseq = self.post_recv(src, tag)?;
        self.recv_posted(out, src, tag, pseq).await
    }

    /// Reserves the next message from `src` with `tag` (receives match in the order they are
    /// posted, whenever they are waited for); [`Group::recv_posted`] takes it.
    pub fn post_recv(&self, src: u32, tag: u32) -> Result<u64> {
        let m = match self.p2p_peer(src, "recv") {
            Ok((_, m)) => m,
            Err(e) => self.departed(src).ok_or(e)?,
        };
        Ok(self.next_recv_seq(&m, tag))
    }

    /// Receives the message reserved by [`Group::post_recv`] into `out` (sizes must match).
    pub async fn recv_posted(&self, out: &mut [u8], src: u32, tag: u32, pseq: u64) -> Result<()> {
        // A peer that left after sending: what it sent is still receivable.
        let (epoch, m) = match self.p2p_peer(src, "recv") {
            Ok(x) => x,
            Err(e) => match self.departed(src) {
                Some(m) => (self.epoch(), m),
                None => return Err(e),
            },
        };
        let deadline = self.deadline();
        let mut at = 0usize;
        let mut part = 0u32;
        loop {
            match self.p2p_wait(&m, tag, pseq, deadline).await? {
                P2pKind::Inline(body) => {
                    if body.len() != out.len() {
                        return Err(Error::new(
                            ErrorKind::Mismatch,
                            "recv",
                            format!("slot {src} sent {} bytes, {} expected", body.len(), out.len()),
                        ));
                    }
                    out.copy_from_slice(&body);
                    return Ok(());
                }
                P2pKind::Ready { total, part: p, addr, len } => {
                    if total != out.len() as u64 || p != part || at + len as usize > out.len() {
                        return Err(Error::new(
                            ErrorKind::Mismatch,
                            "recv",
                            format!("slot {src} sent {total} bytes, {} expected", out.len()),
                        ));
                    }
                    self.p2p_pull(&m, epoch, addr, len).await?;
                    out[at..at + len as usize].copy_from_slice(region(
                        &self.inner.p2p_landing,
                        0,
                        len as usize,
                    ));
                    self.p2p_notify(&m, epoch, tag, pseq, P2pKind::Done { part }).await?;
                    at += len as usize;
                    part += 1;
                    if at == out.len() {
                        return Ok(());
                    }
                }
                P2pKind::Done { .. } => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_range_once() {
        for (len, es, n) in [(40, 4, 3), (4, 4, 5), (1000, 8, 7), (12, 2, 6)] {
            let (per, r) = blocks(len, es, n);
            assert_eq!(r.iter().map(|x| x.1).sum::<usize>(), len);
            let mut at = 0;
            for &(a, l) in &r {
                assert!(a == at || l == 0);
                assert!(l <= per && l % es == 0);
                at = a + l;
            }
        }
    }

    #[test]
    fn segments_cover_the_range() {
        let s: Vec<_> = segments(10, 4).collect();
        assert_eq!(s, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(segments(0, 4).collect::<Vec<_>>(), vec![(0, 0)]);
    }

    #[test]
    fn signatures_differ_with_arguments() {
        assert_ne!(sig(&[1, 2, 3]), sig(&[1, 2, 4]));
        assert_ne!(sig(&[1, 2]), sig(&[2, 1]));
    }
}
