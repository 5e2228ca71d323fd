//! One-sided ops ([`Op`], [`Completion`]) and the sans-IO scheduler that turns them into work
//! requests for one RC send queue.
//!
//! Mechanism: `Endpoint::submit` hands ops to the [`Scheduler`], which queues them FIFO and
//! splits each into slices of at most `slice_bytes_max`. The endpoint asks it for the slices that
//! may be posted now, posts them as signalled work requests, and feeds every work completion
//! back. An op completes when all its slices have completed; its result is its first failure.
//! The scheduler does no IO, so its limits and failure rules are unit-tested on any host.
//!
//! Limits (never exceeded, asserted in tests):
//! - posted slices <= `send_wr_max` (the QP's `max_send_wr`; the CQ is sized to match, since
//!   every slice is signalled and produces exactly one completion);
//! - posted READ slices <= `reads_max` (the negotiated `max_rd_atomic`: the smaller of our
//!   initiator depth and the peer's responder resources);
//! - ops submitted and not yet reported <= `ops_max` (back-pressure: `QueueFull`).
//!
//! Policy: slices are posted strictly in submission order; a READ that does not fit the read
//! window holds back the WRITEs queued after it (no reordering behind the caller's back). The
//! first failed completion breaks the scheduler: slices not yet posted are never posted and
//! their ops fail with `Flushed` (or `Broken` for ops submitted afterwards); slices already
//! posted come back from the device as flushed completions.
//!
//! Work request ids: `seq << 1 | is_read`, where `seq` numbers ops. The READ bit lets a failed
//! completion (whose opcode field is undefined) release the right window slot.
//!
//! Not handled: ordering guarantees between ops (RC executes them in order, but a caller that
//! needs "data before flag" should wait for the data op's completion), fencing, atomics, SENDs.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, ErrorKind, Result, WcStatus, kind_of_wc_status};
use crate::mr::{LocalSlice, RemoteAddr};

/// Direction of a one-sided op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// RDMA READ: copy the peer's bytes at `remote` into `local`.
    Read,
    /// RDMA WRITE: copy `local` into the peer's bytes at `remote`.
    Write,
}

/// A one-sided op: `local.len` bytes between a local slice and a remote address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// Caller's id, echoed in the [`Completion`]. Need not be unique, but should be.
    pub id: u64,
    /// READ or WRITE.
    pub kind: OpKind,
    /// Local range (source of a WRITE, destination of a READ).
    pub local: LocalSlice,
    /// Remote start address and rkey.
    pub remote: RemoteAddr,
}

/// The outcome of one [`Op`].
#[derive(Debug)]
pub struct Completion {
    /// The op's id.
    pub id: u64,
    /// The op's direction.
    pub kind: OpKind,
    /// The op's length in bytes.
    pub len: u64,
    /// `Ok` when every byte arrived; else the first failure among the op's slices. After a
    /// failure the destination range holds an undefined mix of old and new bytes (some slices
    /// may have landed): re-issue the whole op.
    pub result: Result<()>,
}

/// One work request's worth of an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SliceWr {
    pub wr_id: u64,
    pub read: bool,
    pub local_addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub send_wr_max: u32,
    pub reads_max: u32,
    pub slice_bytes_max: u32,
    pub ops_max: usize,
}

struct OpState {
    id: u64,
    kind: OpKind,
    len: u64,
    slices_total: u64,
    slices_done: u64,
    error: Option<Error>,
}

struct Queued {
    seq: u64,
    op: Op,
    /// Bytes of the op already posted.
    offset: u64,
}

/// High-water marks, for tests and the selftest's summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowStats {
    /// Most slices posted at once.
    pub posted_peak: u32,
    /// Most READ slices posted at once.
    pub reads_peak: u32,
    /// Slices posted in total.
    pub slices_posted: u64,
}

pub(crate) struct Scheduler {
    limits: Limits,
    next_seq: u64,
    ops: HashMap<u64, OpState>,
    queue: VecDeque<Queued>,
    posted: u32,
    reads_posted: u32,
    broken: Option<ErrorKind>,
    done: Vec<Completion>,
    stats: WindowStats,
}

impl Scheduler {
    pub fn new(limits: Limits) -> Scheduler {
        assert!(limits.send_wr_max >= 1 && limits.reads_max >= 1 && limits.slice_bytes_max >= 1);
        Scheduler {
            limits,
            next_seq: 0,
            ops: HashMap::new(),
            queue: VecDeque::new(),
            posted: 0,
            reads_posted: 0,
            broken: None,
            done: Vec::new(),
            stats: WindowStats::default(),
        }
    }

    /// Ops submitted whose completion has not been taken yet.
    pub fn outstanding(&self) -> usize {
        self.ops.len() + self.done.len()
    }

    #[cfg(test)]
    pub fn posted(&self) -> u32 {
        self.posted
    }

    pub fn broken(&self) -> Option<ErrorKind> {
        self.broken
    }

    pub fn stats(&self) -> WindowStats {
        self.stats
    }

    /// Queues `ops`, all or none.
    pub fn submit(&mut self, ops: &[Op]) -> Result<()> {
        if let Some(kind) = self.broken {
            return Err(Error::new(
                ErrorKind::Broken,
                "submit",
                format!("endpoint failed earlier ({kind}); connect a new endpoint"),
            ));
        }
        for op in ops {
            validate(op)?;
        }
        let queued = self.outstanding();
        if queued + ops.len() > self.limits.ops_max {
            return Err(Error::new(
                ErrorKind::QueueFull,
                "submit",
                format!("{queued} ops queued + {} > {} allowed", ops.len(), self.limits.ops_max),
            ));
        }
        let slice = self.limits.slice_bytes_max as u64;
        for op in ops {
            let seq = self.next_seq;
            self.next_seq += 1;
            let slices_total = op.local.len.div_ceil(slice);
            let state = OpState {
                id: op.id,
                kind: op.kind,
                len: op.local.len,
                slices_total,
                slices_done: 0,
                error: None,
            };
            self.ops.insert(seq, state);
            self.queue.push_back(Queued { seq, op: *op, offset: 0 });
        }
        Ok(())
    }

    /// Appends to `out` the slices the window allows now, and counts them as posted.
    pub fn next_slices(&mut self, out: &mut Vec<SliceWr>) {
        if self.broken.is_some() {
            return;
        }
        while self.posted < self.limits.send_wr_max {
            let Some(q) = self.queue.front_mut() else { break };
            let read = q.op.kind == OpKind::Read;
            if read && self.reads_posted >= self.limits.reads_max {
                break;
            }
            let len = (q.op.local.len - q.offset).min(self.limits.slice_bytes_max as u64);
            out.push(SliceWr {
                wr_id: q.seq << 1 | read as u64,
                read,
                local_addr: q.op.local.addr + q.offset,
                len: len as u32,
                lkey: q.op.local.lkey,
                remote_addr: q.op.remote.addr + q.offset,
                rkey: q.op.remote.rkey,
            });
            q.offset += len;
            if q.offset == q.op.local.len {
                self.queue.pop_front();
            }
            self.posted += 1;
            self.reads_posted += read as u32;
            self.stats.posted_peak = self.stats.posted_peak.max(self.posted);
            self.stats.reads_peak = self.stats.reads_peak.max(self.reads_posted);
            self.stats.slices_posted += 1;
        }
    }

    /// `unposted` were handed out by `next_slices` but the device refused them: they will never
    /// complete. Fails their ops and breaks the scheduler.
    pub fn post_failed(&mut self, unposted: &[SliceWr], cause: &Error) {
        for s in unposted {
            self.release(s.read);
            let err = || Error::new(cause.kind(), "post", cause.to_string());
            self.slice_done(s.wr_id >> 1, Some(err));
        }
        self.break_with(ErrorKind::Broken);
    }

    /// A work completion for `wr_id` with `ibv_wc_status` `status`.
    pub fn on_completion(&mut self, wr_id: u64, wc: WcStatus) {
        let seq = wr_id >> 1;
        self.release(wr_id & 1 == 1);
        if wc.status == 0 {
            self.slice_done(seq, None::<fn() -> Error>);
            return;
        }
        let kind = kind_of_wc_status(wc.status);
        let context = match self.ops.get(&seq) {
            Some(op) => format!("op id {} ({:?}, {} bytes)", op.id, op.kind, op.len),
            None => format!("work request {wr_id:#x} of an op already reported"),
        };
        self.slice_done(seq, Some(|| Error::completion(kind, wc, context)));
        self.break_with(kind);
    }

    /// Marks the scheduler failed: queued slices are dropped and their ops fail.
    pub fn break_with(&mut self, kind: ErrorKind) {
        if self.broken.is_none() {
            self.broken = Some(kind);
        }
        while let Some(q) = self.queue.pop_front() {
            let slice = self.limits.slice_bytes_max as u64;
            let unposted = (q.op.local.len - q.offset).div_ceil(slice);
            for _ in 0..unposted {
                let err = || {
                    Error::new(
                        ErrorKind::Flushed,
                        "submit",
                        format!("op id {} not posted: the endpoint failed first ({kind})", q.op.id),
                    )
                };
                self.slice_done(q.seq, Some(err));
            }
        }
    }

    /// The QP is in the error state and its posted slices will not come back (no flush
    /// completions arrived in time): fail them all.
    pub fn abandon_posted(&mut self, why: &str) {
        self.break_with(ErrorKind::Broken);
        self.posted = 0;
        self.reads_posted = 0;
        let seqs: Vec<u64> = self.ops.keys().copied().collect();
        for seq in seqs {
            if let Some(op) = self.ops.get_mut(&seq) {
                op.slices_done = op.slices_total - 1;
                let id = op.id;
                self.slice_done(
                    seq,
                    Some(|| Error::new(ErrorKind::Broken, "poll", format!("op id {id}: {why}"))),
                );
            }
        }
    }

    /// Moves finished ops into `out`.
    pub fn take_completions(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done);
    }

    fn release(&mut self, read: bool) {
        self.posted = self.posted.saturating_sub(1);
        if read {
            self.reads_posted = self.reads_posted.saturating_sub(1);
        }
    }

    fn slice_done(&mut self, seq: u64, err: Option<impl FnOnce() -> Error>) {
        let Some(op) = self.ops.get_mut(&seq) else { return };
        op.slices_done += 1;
        if let Some(err) = err
            && op.error.is_none()
        {
            op.error = Some(err());
        }
        if op.slices_done >= op.slices_total
            && let Some(op) = self.ops.remove(&seq)
        {
            self.done.push(Completion {
                id: op.id,
                kind: op.kind,
                len: op.len,
                result: op.error.map_or(Ok(()), Err),
            });
        }
    }
}

fn validate(op: &Op) -> Result<()> {
    let bad = |what: &str| {
        Err(Error::new(ErrorKind::InvalidArgument, "submit", format!("op id {}: {what}", op.id)))
    };
    if op.local.len == 0 {
        return bad("zero length");
    }
    if op.local.addr.checked_add(op.local.len).is_none() {
        return bad("local range wraps the address space");
    }
    if op.remote.addr.checked_add(op.local.len).is_none() {
        return bad("remote range wraps the address space");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn limits() -> Limits {
        Limits { send_wr_max: 8, reads_max: 2, slice_bytes_max: 1000, ops_max: 64 }
    }

    fn op(id: u64, kind: OpKind, len: u64) -> Op {
        Op {
            id,
            kind,
            local: LocalSlice { addr: 0x10_0000 + id * 0x1_0000, len, lkey: 1 },
            remote: RemoteAddr { addr: 0x90_0000 + id * 0x1_0000, rkey: 2 },
        }
    }

    const OK: WcStatus = WcStatus { status: 0, vendor_err: 0 };

    #[test]
    fn splits_ops_into_slices_that_cover_every_byte_once() {
        let mut s = Scheduler::new(limits());
        s.submit(&[op(1, OpKind::Write, 2500)]).unwrap();
        let mut wrs = Vec::new();
        s.next_slices(&mut wrs);
        let lens: Vec<u32> = wrs.iter().map(|w| w.len).collect();
        assert_eq!(lens, [1000, 1000, 500]);
        assert_eq!(wrs[1].local_addr, 0x11_0000 + 1000);
        assert_eq!(wrs[2].remote_addr, 0x91_0000 + 2000);
        assert!(wrs.iter().all(|w| w.wr_id == wrs[0].wr_id && !w.read));
        let mut out = Vec::new();
        for w in &wrs {
            s.take_completions(&mut out);
            assert!(out.is_empty(), "completed before its last slice");
            s.on_completion(w.wr_id, OK);
        }
        s.take_completions(&mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].id, out[0].len), (1, 2500));
        assert!(out[0].result.is_ok());
        assert_eq!(s.outstanding(), 0);
    }

    #[test]
    fn read_window_holds_back_later_ops_in_order() {
        let mut s = Scheduler::new(limits());
        s.submit(&[op(1, OpKind::Read, 3000), op(2, OpKind::Write, 10)]).unwrap();
        let mut wrs = Vec::new();
        s.next_slices(&mut wrs);
        assert_eq!(wrs.len(), 2, "reads_max = 2");
        s.on_completion(wrs[0].wr_id, OK);
        let mut more = Vec::new();
        s.next_slices(&mut more);
        assert_eq!(more.len(), 2, "third read slice, then the write");
        assert!(more[0].read && !more[1].read);
    }

    #[test]
    fn back_pressure_is_an_error_the_caller_sees() {
        let mut s = Scheduler::new(Limits { ops_max: 3, ..limits() });
        s.submit(&[op(1, OpKind::Write, 1), op(2, OpKind::Write, 1)]).unwrap();
        let e = s.submit(&[op(3, OpKind::Write, 1), op(4, OpKind::Write, 1)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::QueueFull);
        assert!(e.retryable());
        assert_eq!(s.outstanding(), 2, "all or none");
        let e = s.submit(&[op(5, OpKind::Write, 0)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn first_failure_breaks_the_queue_and_flushes_the_rest() {
        let mut s = Scheduler::new(limits());
        let ops: Vec<Op> = (0..6).map(|i| op(i, OpKind::Write, 1500)).collect();
        s.submit(&ops).unwrap();
        let mut wrs = Vec::new();
        s.next_slices(&mut wrs);
        assert_eq!(wrs.len(), 8, "4 ops x 2 slices fill the send queue");
        // Op 0's second slice hits a bad rkey; the device flushes everything after it.
        s.on_completion(wrs[0].wr_id, OK);
        s.on_completion(wrs[1].wr_id, WcStatus { status: 10, vendor_err: 0 });
        for w in &wrs[2..] {
            s.on_completion(w.wr_id, WcStatus { status: 5, vendor_err: 0 });
        }
        let mut out = Vec::new();
        s.take_completions(&mut out);
        assert_eq!(out.len(), 6);
        let kinds: Vec<(u64, ErrorKind)> =
            out.iter().map(|c| (c.id, c.result.as_ref().unwrap_err().kind())).collect();
        assert_eq!(kinds[0], (0, ErrorKind::RemoteAccess));
        assert!(kinds[1..].iter().all(|(_, k)| *k == ErrorKind::Flushed), "{kinds:?}");
        assert_eq!(s.posted(), 0);
        let e = s.submit(&[op(9, OpKind::Read, 1)]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Broken);
    }

    #[test]
    fn refused_posts_fail_their_ops() {
        let mut s = Scheduler::new(limits());
        s.submit(&[op(1, OpKind::Write, 10), op(2, OpKind::Write, 10)]).unwrap();
        let mut wrs = Vec::new();
        s.next_slices(&mut wrs);
        let cause = Error::new(ErrorKind::Device, "post", "ENOMEM");
        s.post_failed(&wrs[1..], &cause);
        s.on_completion(wrs[0].wr_id, OK);
        let mut out = Vec::new();
        s.take_completions(&mut out);
        out.sort_by_key(|c| c.id);
        assert!(out[0].result.is_ok());
        assert_eq!(out[1].result.as_ref().unwrap_err().kind(), ErrorKind::Device);
        assert_eq!(s.posted(), 0);
    }

    #[test]
    fn abandoning_a_dead_qp_reports_every_op() {
        let mut s = Scheduler::new(limits());
        s.submit(&[op(1, OpKind::Read, 5000), op(2, OpKind::Write, 10)]).unwrap();
        let mut wrs = Vec::new();
        s.next_slices(&mut wrs);
        s.abandon_posted("QP in error state");
        let mut out = Vec::new();
        s.take_completions(&mut out);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|c| c.result.is_err()));
        // Late flushed completions for the abandoned slices are ignored.
        s.on_completion(wrs[0].wr_id, WcStatus { status: 5, vendor_err: 0 });
        s.take_completions(&mut out);
        assert_eq!(out.len(), 2);
    }

    /// Random ops, completions in random order: every op completes exactly once and the
    /// windows are never exceeded.
    #[test]
    fn random_schedules_respect_the_windows() {
        for seed in 0..50 {
            let mut rng = StdRng::seed_from_u64(seed);
            let lim = Limits {
                send_wr_max: rng.random_range(1..16),
                reads_max: rng.random_range(1..4),
                slice_bytes_max: rng.random_range(1..3000),
                ops_max: 1000,
            };
            let mut s = Scheduler::new(lim);
            let ops: Vec<Op> = (0..100)
                .map(|i| {
                    let kind = if rng.random_bool(0.5) { OpKind::Read } else { OpKind::Write };
                    op(i, kind, rng.random_range(1..10_000))
                })
                .collect();
            s.submit(&ops).unwrap();
            let mut inflight: Vec<SliceWr> = Vec::new();
            let mut bytes = vec![0u64; ops.len()];
            let mut out = Vec::new();
            loop {
                s.next_slices(&mut inflight);
                assert!(inflight.len() as u32 <= lim.send_wr_max);
                assert!(inflight.iter().filter(|w| w.read).count() as u32 <= lim.reads_max);
                if inflight.is_empty() {
                    break;
                }
                let w = inflight.swap_remove(rng.random_range(0..inflight.len()));
                let op = &ops[(w.wr_id >> 1) as usize];
                assert!(w.len as u64 <= lim.slice_bytes_max as u64);
                assert_eq!(w.local_addr - op.local.addr, w.remote_addr - op.remote.addr);
                bytes[(w.wr_id >> 1) as usize] += w.len as u64;
                s.on_completion(w.wr_id, OK);
            }
            s.take_completions(&mut out);
            assert_eq!(out.len(), ops.len(), "seed {seed}");
            assert!(out.iter().all(|c| c.result.is_ok()));
            for (i, op) in ops.iter().enumerate() {
                assert_eq!(bytes[i], op.local.len, "seed {seed} op {i}");
            }
            assert!(s.stats().posted_peak <= lim.send_wr_max);
            assert!(s.stats().reads_peak <= lim.reads_max);
        }
    }
}
