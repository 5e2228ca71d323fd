//! [`Endpoint`]: one RC queue pair with its own completion queue, connected to one peer.
//!
//! Mechanism:
//! - `new` creates a completion channel, a CQ sized to the send queue, and an RC QP in the
//!   context's PD, and moves the QP to INIT. `local_info` describes it for the peer.
//! - `connect(remote)` moves it INIT -> RTR -> RTS. Path MTU = min(both sides' advertised MTU:
//!   the port's active MTU, capped by `path_mtu_max`);
//!   outstanding READs = min(our `max_outstanding_reads`, the peer's responder resources), both
//!   clamped to the device limits. RoCE always uses a GRH to the peer's GID.
//! - `submit(ops)` queues one-sided READs/WRITEs (see `op.rs` for slicing and windows) and posts
//!   what the windows allow; `poll(timeout)` reaps completions, posts more, and returns the ops
//!   that finished.
//!
//! Invariants:
//! - If `submit` returns `Ok`, each of its ops is reported by `poll` exactly once, success or
//!   failure; if it returns `Err`, none of them was queued.
//! - Nothing waits without a deadline. `poll` sleeps on the completion channel (after a short
//!   busy-poll), never longer than its timeout; with nothing outstanding it just sleeps out the
//!   timeout and returns `Timeout`.
//! - The first failed completion breaks the endpoint for good: the QP is in the error state, all
//!   posted work comes back flushed, queued work is failed without posting, and `submit` returns
//!   `Broken`. A caller recovers by connecting a new endpoint (new handshake). When a `poll`
//!   deadline passes with no completion for `STALL_CHECK` (and at most that often), the QP state
//!   is queried; a QP found in the error state is reported, not waited on.
//! - Memory regions used by ops must outlive them (see `mr.rs`). Dropping an endpoint destroys
//!   its QP, after which the device touches none of the op buffers.
//!
//! Not handled: SEND/RECV and immediate data (notifications ride the engine's TCP connection),
//! shared CQs across endpoints, SRQs, path migration, reconnecting a broken QP in place.

use std::time::{Duration, Instant};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
};
use std::sync::Arc;

use crate::context::{RdmaContext, io_error};
use crate::error::{Error, ErrorKind, Result, WcStatus};
use crate::ffi;
use crate::info::{EndpointInfo, LinkLayer, PathMtu};
use crate::op::{Completion, Limits, Op, Scheduler, SliceWr, WindowStats};

/// Sizes and timers of an endpoint. Values above the device's limits are clamped to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointOptions {
    /// Send queue depth: most work requests (slices) posted at once. Default 128.
    pub send_queue_depth: u32,
    /// Most RDMA READ slices outstanding at once (initiator depth, `max_rd_atomic`); also capped
    /// by the peer's responder resources. Default 16.
    pub max_outstanding_reads: u8,
    /// Most RDMA READs this endpoint serves at once for the peer (`max_dest_rd_atomic`).
    /// Default 16.
    pub responder_resources: u8,
    /// Largest single work request; longer ops are split. Default 1 MiB.
    pub slice_bytes_max: u32,
    /// Most ops submitted and not yet reported; more is `QueueFull`. Default 4096.
    pub queued_ops_max: usize,
    /// Local ACK timeout exponent: 4.096 us * 2^n per transport retry. Default 14 (~67 ms).
    pub ack_timeout_exp: u8,
    /// Transport retries before an op fails with `RetryExceeded`: 0 ..= 6, default 6. The
    /// verbs value 7 is refused: Soft-RoCE (rxe) treats it as "retry forever", which would turn
    /// a dead peer into a hang instead of an error.
    pub retry_count: u8,
    /// How long `poll` spins on the CQ before sleeping on the completion channel. Default 20 us.
    pub busy_poll: Duration,
    /// Largest path MTU to advertise (`None`: the port's active MTU). The connection uses the
    /// smaller of both sides' advertised MTU.
    pub path_mtu_max: Option<PathMtu>,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            send_queue_depth: 128,
            max_outstanding_reads: 16,
            responder_resources: 16,
            slice_bytes_max: 1 << 20,
            queued_ops_max: 4096,
            ack_timeout_exp: 14,
            retry_count: 6,
            busy_poll: Duration::from_micros(20),
            path_mtu_max: None,
        }
    }
}

/// Longest single sleep on the completion channel, so that a lost event costs at most this.
const CHANNEL_WAIT_MAX: Duration = Duration::from_millis(50);
/// No completion for this long at a `poll` deadline: query the QP state (at most this often).
const STALL_CHECK: Duration = Duration::from_millis(500);
const WC_BATCH: usize = 64;
const HOP_LIMIT: u8 = 64;
const MIN_RNR_TIMER: u8 = 12;

/// Where an endpoint is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// Created; waiting for `connect`.
    Created,
    /// Connected; ops can be submitted.
    Connected,
    /// Failed for good (`connect` failed or an op failed); drop it and connect a new one.
    Broken,
}

struct Connected {
    remote: EndpointInfo,
    path_mtu: PathMtu,
    sched: Scheduler,
}

/// One RC queue pair connected to one peer, with its own CQ.
pub struct Endpoint {
    // Field order is drop order: the QP goes before the CQ and channel it uses.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    ctx: RdmaContext,
    opts: EndpointOptions,
    local: EndpointInfo,
    conn: Option<Connected>,
    failed: bool,
    armed: bool,
    last_progress: Instant,
    last_qp_check: Instant,
    wcs: Vec<rdma_mummy_sys::ibv_wc>,
    slices: Vec<SliceWr>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("device", &self.ctx.device_name())
            .field("qpn", &self.local.qpn)
            .field("remote_qpn", &self.conn.as_ref().map(|c| c.remote.qpn))
            .field("state", &self.state())
            .finish()
    }
}

impl Endpoint {
    /// Creates an RC QP and its CQ on `ctx`, in the INIT state.
    pub fn new(ctx: &RdmaContext, opts: &EndpointOptions) -> Result<Endpoint> {
        let opts = clamp_options(ctx, opts)?;
        let inner = &ctx.inner;
        let channel = inner
            .ctx
            .create_comp_channel()
            .map_err(|e| Error::os("create endpoint", "completion channel", io_error(&e)))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| Error::os("create endpoint", "completion channel O_NONBLOCK", e))?;
        let cq = inner
            .ctx
            .create_cq_builder()
            .setup_cqe(opts.send_queue_depth)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| {
                Error::os(
                    "create endpoint",
                    format!("CQ of {}", opts.send_queue_depth),
                    io_error(&e),
                )
            })?;
        let mut qp = inner
            .pd
            .create_qp_builder()
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .setup_max_send_wr(opts.send_queue_depth)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| Error::os("create endpoint", "RC QP", io_error(&e)))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(inner.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&attr).map_err(|e| Error::os("create endpoint", "QP to INIT", io_error(&e)))?;
        let local = EndpointInfo {
            qpn: qp.qp_number(),
            psn: random_psn(qp.qp_number()),
            gid: inner.gid,
            lid: inner.lid,
            mtu: opts.path_mtu_max.map_or(inner.active_mtu, |cap| cap.min(inner.active_mtu)),
            link_layer: inner.link_layer,
            responder_resources: opts.responder_resources,
        };
        tracing::debug!(device = %inner.device, qpn = local.qpn, "RDMA endpoint created");
        Ok(Endpoint {
            qp,
            cq,
            channel,
            ctx: ctx.clone(),
            opts,
            local,
            conn: None,
            failed: false,
            armed: false,
            last_progress: Instant::now(),
            last_qp_check: Instant::now(),
            wcs: vec![ffi::empty_wc(); WC_BATCH],
            slices: Vec::new(),
        })
    }

    /// What the peer needs to connect to this endpoint; send `to_bytes()` in the handshake.
    pub fn local_info(&self) -> EndpointInfo {
        self.local
    }

    /// The options in force, after clamping to the device limits.
    pub fn options(&self) -> &EndpointOptions {
        &self.opts
    }

    /// The peer's info, once connected.
    pub fn remote_info(&self) -> Option<EndpointInfo> {
        self.conn.as_ref().map(|c| c.remote)
    }

    /// The negotiated path MTU, once connected.
    pub fn path_mtu(&self) -> Option<PathMtu> {
        self.conn.as_ref().map(|c| c.path_mtu)
    }

    /// Where this endpoint is in its life.
    pub fn state(&self) -> EndpointState {
        match &self.conn {
            _ if self.failed => EndpointState::Broken,
            Some(c) if c.sched.broken().is_some() => EndpointState::Broken,
            Some(_) => EndpointState::Connected,
            None => EndpointState::Created,
        }
    }

    /// Ops submitted whose completion `poll` has not returned yet.
    pub fn outstanding(&self) -> usize {
        self.conn.as_ref().map_or(0, |c| c.sched.outstanding())
    }

    /// Send-queue high-water marks since connect.
    pub fn window_stats(&self) -> WindowStats {
        self.conn.as_ref().map(|c| c.sched.stats()).unwrap_or_default()
    }

    /// Connects to the peer described by `remote`: INIT -> RTR -> RTS.
    pub fn connect(&mut self, remote: &EndpointInfo) -> Result<()> {
        if self.conn.is_some() || self.failed {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "connect",
                format!("endpoint qpn {} is {:?}, not Created", self.local.qpn, self.state()),
            ));
        }
        if remote.link_layer != self.local.link_layer {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "connect",
                format!(
                    "local {:?} cannot reach a {:?} peer",
                    self.local.link_layer, remote.link_layer
                ),
            ));
        }
        let path_mtu = self.local.mtu.min(remote.mtu);
        let reads_max = self.opts.max_outstanding_reads.min(remote.responder_resources).max(1);
        let result = self.move_to_rtr(remote, path_mtu).and_then(|()| self.move_to_rts(reads_max));
        if let Err(e) = result {
            self.failed = true;
            return Err(e);
        }
        let limits = Limits {
            send_wr_max: self.opts.send_queue_depth,
            reads_max: reads_max as u32,
            slice_bytes_max: self.opts.slice_bytes_max,
            ops_max: self.opts.queued_ops_max,
        };
        tracing::debug!(
            qpn = self.local.qpn,
            remote_qpn = remote.qpn,
            mtu = path_mtu.bytes(),
            reads_max,
            "RDMA endpoint connected"
        );
        self.conn = Some(Connected { remote: *remote, path_mtu, sched: Scheduler::new(limits) });
        Ok(())
    }

    fn move_to_rtr(&mut self, remote: &EndpointInfo, path_mtu: PathMtu) -> Result<()> {
        let inner = &self.ctx.inner;
        let mut ah = AddressHandleAttribute::new();
        ah.setup_port(inner.port).setup_dest_lid(remote.lid).setup_service_level(0);
        if self.local.link_layer == LinkLayer::Ethernet || remote.lid == 0 {
            let gid_index = u8::try_from(inner.gid_index).map_err(|_| {
                Error::new(
                    ErrorKind::Unsupported,
                    "connect",
                    format!("GID index {} does not fit the address vector", inner.gid_index),
                )
            })?;
            ah.setup_grh(&Gid { raw: remote.gid }, 0, gid_index, HOP_LIMIT, 0);
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(sideway_mtu(path_mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.local.responder_resources)
            .setup_min_rnr_timer(MIN_RNR_TIMER)
            .setup_address_vector(&ah);
        self.qp.modify(&attr).map_err(|e| {
            Error::os(
                "connect",
                format!("QP {} to RTR towards qpn {}", self.local.qpn, remote.qpn),
                io_error(&e),
            )
        })
    }

    fn move_to_rts(&mut self, reads_max: u8) -> Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(self.opts.ack_timeout_exp)
            .setup_retry_cnt(self.opts.retry_count)
            .setup_rnr_retry(6)
            .setup_max_read_atomic(reads_max);
        self.qp.modify(&attr).map_err(|e| {
            Error::os("connect", format!("QP {} to RTS", self.local.qpn), io_error(&e))
        })
    }

    /// Queues `ops` (all or none) and posts what the send queue allows. Every op of an `Ok`
    /// submit is reported once by [`Endpoint::poll`].
    pub fn submit(&mut self, ops: &[Op]) -> Result<()> {
        let conn = self.conn.as_mut().ok_or_else(|| not_connected(self.local.qpn))?;
        conn.sched.submit(ops)?;
        if conn.sched.outstanding() == ops.len() {
            // Work after an idle gap: stall time counts from now.
            self.last_progress = Instant::now();
        }
        self.pump();
        Ok(())
    }

    /// Fails the endpoint now, e.g. when the engine's control connection to the peer died: the
    /// QP goes to the error state, posted work comes back flushed, queued work fails without
    /// being posted, and `poll` reports every outstanding op (then `Broken`).
    pub fn abort(&mut self) {
        self.failed = true;
        if let Some(conn) = self.conn.as_mut() {
            conn.sched.break_with(ErrorKind::Broken);
        }
        self.move_to_error();
        tracing::debug!(qpn = self.local.qpn, "RDMA endpoint aborted");
    }

    /// Waits up to `timeout` for ops to finish and returns those that did (at least one).
    /// `Timeout` if none finished in time (outstanding ops then stay outstanding; with nothing
    /// outstanding it sleeps out the timeout); `Broken` at once if the endpoint failed and all
    /// its ops have been reported.
    pub fn poll(&mut self, timeout: Duration) -> Result<Vec<Completion>> {
        let mut out = Vec::new();
        self.poll_into(&mut out, timeout)?;
        Ok(out)
    }

    /// Like [`Endpoint::poll`], appending to `out`; returns how many were appended.
    pub fn poll_into(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<usize> {
        if self.conn.is_none() {
            return Err(not_connected(self.local.qpn));
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let before = out.len();
        loop {
            self.reap()?;
            if let Some(conn) = self.conn.as_mut() {
                conn.sched.take_completions(out);
            }
            if out.len() > before {
                return Ok(out.len() - before);
            }
            let now = Instant::now();
            if self.outstanding() == 0 && self.state() == EndpointState::Broken {
                return Err(Error::new(
                    ErrorKind::Broken,
                    "poll",
                    format!("qpn {} failed earlier; nothing left to report", self.local.qpn),
                ));
            }
            if self.outstanding() == 0 {
                std::thread::sleep(deadline.saturating_duration_since(now));
                return Err(self.timeout_error(timeout, "nothing outstanding"));
            }
            if now >= deadline {
                let stalled = now.duration_since(self.last_progress) >= STALL_CHECK
                    && now.duration_since(self.last_qp_check) >= STALL_CHECK;
                if stalled && self.qp_in_error()? {
                    self.abandon("QP in the error state and its work did not come back");
                    continue;
                }
                return Err(self.timeout_error(timeout, "ops still outstanding"));
            }
            if now.duration_since(start) < self.opts.busy_poll {
                std::hint::spin_loop();
                continue;
            }
            self.wait_event(deadline)?;
        }
    }

    fn timeout_error(&self, timeout: Duration, what: &str) -> Error {
        Error::new(
            ErrorKind::Timeout,
            "poll",
            format!(
                "qpn {}: nothing completed in {timeout:?}, {what} ({} ops)",
                self.local.qpn,
                self.outstanding()
            ),
        )
    }

    /// Drains the CQ into the scheduler and posts what the freed slots allow.
    fn reap(&mut self) -> Result<()> {
        loop {
            let n = ffi::poll_cq(&self.cq, &mut self.wcs)
                .map_err(|e| Error::os("poll", format!("CQ of qpn {}", self.local.qpn), e))?;
            if n == 0 {
                return Ok(());
            }
            self.last_progress = Instant::now();
            let Some(conn) = self.conn.as_mut() else { return Ok(()) };
            let mut failed = false;
            for wc in &self.wcs[..n] {
                let status = WcStatus { status: wc.status, vendor_err: wc.vendor_err };
                failed |= wc.status != 0;
                conn.sched.on_completion(wc.wr_id, status);
            }
            if failed {
                tracing::debug!(qpn = self.local.qpn, "RDMA endpoint broken by a failed op");
            }
            self.pump();
            if n < self.wcs.len() {
                return Ok(());
            }
        }
    }

    /// Posts the slices the windows allow now.
    fn pump(&mut self) {
        let Some(conn) = self.conn.as_mut() else { return };
        self.slices.clear();
        conn.sched.next_slices(&mut self.slices);
        if self.slices.is_empty() {
            return;
        }
        if let Err((first_unposted, errno)) = ffi::post_send(&self.qp, &self.slices) {
            let cause = Error::os(
                "post",
                format!(
                    "qpn {}: {} work requests refused",
                    self.local.qpn,
                    self.slices.len() - first_unposted
                ),
                errno,
            );
            tracing::warn!(error = %cause, "RDMA post failed; endpoint broken");
            conn.sched.post_failed(&self.slices[first_unposted..], &cause);
            // Make sure what was posted comes back (flushed) rather than hanging.
            self.move_to_error();
        }
    }

    fn move_to_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        if let Err(e) = self.qp.modify(&attr) {
            tracing::warn!(qpn = self.local.qpn, error = %io_error(&e), "QP to ERR failed");
        }
    }

    fn qp_in_error(&mut self) -> Result<bool> {
        self.last_qp_check = Instant::now();
        let (attr, _) = self.qp.query(QueuePairAttributeMask::State).map_err(|e| {
            Error::os("poll", format!("query state of qpn {}", self.local.qpn), io_error(&e))
        })?;
        Ok(matches!(attr.state(), QueuePairState::Error | QueuePairState::SendQueueError))
    }

    fn abandon(&mut self, why: &str) {
        tracing::warn!(qpn = self.local.qpn, why, "RDMA endpoint abandoning its posted work");
        if let Some(conn) = self.conn.as_mut() {
            conn.sched.abandon_posted(why);
        }
    }

    /// Sleeps on the completion channel until an event or `deadline` (at most
    /// `CHANNEL_WAIT_MAX`). The first call only arms the CQ, so that the caller polls the CQ
    /// once more before sleeping: completions that arrived before arming raise no event.
    fn wait_event(&mut self, deadline: Instant) -> Result<()> {
        let qpn = self.local.qpn;
        if !self.armed {
            ffi::arm_cq(&self.cq)
                .map_err(|e| Error::os("poll", format!("arm CQ of qpn {qpn}"), e))?;
            self.armed = true;
            return Ok(());
        }
        let wait = deadline.saturating_duration_since(Instant::now()).min(CHANNEL_WAIT_MAX);
        let readable = ffi::wait_channel(&self.channel, wait)
            .map_err(|e| Error::os("poll", format!("wait on CQ channel of qpn {qpn}"), e))?;
        if readable
            && ffi::take_cq_event(&self.channel)
                .map_err(|e| Error::os("poll", format!("CQ event of qpn {qpn}"), e))?
        {
            self.armed = false;
        }
        Ok(())
    }
}

fn not_connected(qpn: u32) -> Error {
    Error::new(ErrorKind::NotConnected, "submit", format!("endpoint qpn {qpn} is not connected"))
}

fn sideway_mtu(mtu: PathMtu) -> Mtu {
    match mtu {
        PathMtu::Mtu256 => Mtu::Mtu256,
        PathMtu::Mtu512 => Mtu::Mtu512,
        PathMtu::Mtu1024 => Mtu::Mtu1024,
        PathMtu::Mtu2048 => Mtu::Mtu2048,
        PathMtu::Mtu4096 => Mtu::Mtu4096,
    }
}

/// Validates options and clamps them to the device's limits.
fn clamp_options(ctx: &RdmaContext, opts: &EndpointOptions) -> Result<EndpointOptions> {
    let lim = ctx.limits();
    let bad = |what: String| Err(Error::new(ErrorKind::InvalidArgument, "create endpoint", what));
    if opts.send_queue_depth == 0 || opts.slice_bytes_max == 0 || opts.queued_ops_max == 0 {
        return bad(format!("zero size in {opts:?}"));
    }
    if opts.max_outstanding_reads == 0 || opts.responder_resources == 0 {
        return bad(format!("zero READ depth in {opts:?}"));
    }
    if opts.ack_timeout_exp > 31 || opts.retry_count > 6 {
        return bad(format!("need ack_timeout_exp <= 31 and retry_count <= 6 in {opts:?}"));
    }
    let mut o = opts.clone();
    o.send_queue_depth = o.send_queue_depth.min(lim.max_qp_wr.max(1)).min(lim.max_cqe.max(1));
    o.max_outstanding_reads = o.max_outstanding_reads.min(lim.max_qp_init_rd_atom.max(1));
    o.responder_resources = o.responder_resources.min(lim.max_qp_rd_atom.max(1));
    // The wire carries at most 2^31 bytes per message; ports may allow less.
    let msg_max = if lim.max_msg_bytes == 0 { 1 << 30 } else { lim.max_msg_bytes.min(1 << 31) };
    o.slice_bytes_max = o.slice_bytes_max.min(msg_max);
    Ok(o)
}

/// A 24-bit initial PSN that differs between endpoints and runs.
fn random_psn(qpn: u32) -> u32 {
    use std::hash::{BuildHasher, RandomState};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (RandomState::new().hash_one((qpn, nanos)) & 0x00ff_ffff) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine moves endpoints into a polling thread and shares contexts and regions.
    #[test]
    fn handles_can_cross_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<Endpoint>();
        send_sync::<RdmaContext>();
        send_sync::<crate::MemoryRegion>();
        send::<Completion>();
    }
}
