//! The raw verbs calls this crate makes itself, next to `sideway`'s safe wrappers.
//!
//! Mechanism: `sideway` covers devices, PDs, MRs, CQs and QP state changes. Four things it does
//! not expose the way an engine needs them, so they are called here through `rdma-mummy-sys`
//! (the same run-time-loaded rdma-core that sideway uses; no extra linking):
//! - `ibv_post_send` with `bad_wr`: on a partial failure we must know exactly which work
//!   requests reached the send queue (sideway's guard drops that information);
//! - `ibv_poll_cq` into a reused array (no allocation per poll, raw status kept);
//! - `ibv_req_notify_cq` + `ibv_get_cq_event`/`ibv_ack_cq_events` + `poll(2)` on the completion
//!   channel's fd, so a waiting endpoint sleeps instead of spinning, with a deadline.
//!
//! Invariants: every pointer handed to rdma-core comes from a live sideway object borrowed for
//! the call, or from buffers that outlive the call; `ibv_post_send` copies work requests into the
//! send queue before returning, so the request arrays are not needed afterwards. Every CQ event
//! taken is acked at once, so destroying the CQ never blocks on unacked events.
//!
//! Not handled: SENDs/receives, inline data, several SGEs per request, extended CQs.

use std::io;
use std::mem::{MaybeUninit, size_of};
use std::os::fd::AsRawFd;
use std::ptr::null_mut;
use std::time::Duration;

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};

use crate::op::SliceWr;

/// A zeroed work completion array entry.
pub(crate) fn empty_wc() -> sys::ibv_wc {
    // SAFETY: ibv_wc is a plain C struct of integers (and a union of integers); all-zero bytes
    // are a valid value of it.
    unsafe { MaybeUninit::<sys::ibv_wc>::zeroed().assume_init() }
}

/// Posts `slices` as one chain of signalled RDMA READ/WRITE work requests.
/// On failure returns the index of the first slice that was not posted, and the errno.
pub(crate) fn post_send(qp: &BasicQueuePair, slices: &[SliceWr]) -> Result<(), (usize, io::Error)> {
    let n = slices.len();
    if n == 0 {
        return Ok(());
    }
    let mut sges: Vec<sys::ibv_sge> = slices
        .iter()
        .map(|s| sys::ibv_sge { addr: s.local_addr, length: s.len, lkey: s.lkey })
        .collect();
    let mut wrs: Vec<sys::ibv_send_wr> = Vec::with_capacity(n);
    for s in slices {
        // SAFETY: ibv_send_wr is a plain C struct of integers, pointers and unions of those;
        // all-zero bytes (null pointers, zero counts) are a valid value of it.
        let mut wr: sys::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        wr.wr_id = s.wr_id;
        wr.num_sge = 1;
        wr.opcode = if s.read {
            sys::ibv_wr_opcode::IBV_WR_RDMA_READ
        } else {
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE
        };
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = sys::rdma_t { remote_addr: s.remote_addr, rkey: s.rkey };
        wrs.push(wr);
    }
    // Link the chain and the SGEs through raw pointers only (no references into the vectors
    // are created from here on, so the pointers stay valid).
    let base = wrs.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    for i in 0..n {
        // SAFETY: i < n = wrs.len() = sges.len(); both vectors are neither moved nor resized
        // until this function returns.
        unsafe {
            let wr = base.add(i);
            (*wr).sg_list = sge_base.add(i);
            (*wr).next = if i + 1 < n { base.add(i + 1) } else { null_mut() };
        }
    }
    let mut bad: *mut sys::ibv_send_wr = null_mut();
    // SAFETY: the QP is alive for the borrow of `qp`; the chain and its SGEs are valid,
    // null-terminated and outlive the call, which copies them into the send queue.
    let rc = unsafe { sys::ibv_post_send(qp.qp().as_ptr(), base, &mut bad) };
    if rc == 0 {
        return Ok(());
    }
    let first_unposted = if bad.is_null() {
        0
    } else {
        ((bad as usize).saturating_sub(base as usize) / size_of::<sys::ibv_send_wr>()).min(n)
    };
    Err((first_unposted, io::Error::from_raw_os_error(rc.abs())))
}

/// Polls up to `out.len()` work completions; returns how many were written.
pub(crate) fn poll_cq(cq: &BasicCompletionQueue, out: &mut [sys::ibv_wc]) -> io::Result<usize> {
    let max = out.len().min(i32::MAX as usize) as i32;
    // SAFETY: the CQ is alive for the borrow of `cq`; `out` has room for `max` entries.
    let n = unsafe { sys::ibv_poll_cq(cq.cq().as_ptr(), max, out.as_mut_ptr()) };
    if n < 0 {
        return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
    }
    Ok(n as usize)
}

/// Asks for an event on the channel when the next completion arrives.
pub(crate) fn arm_cq(cq: &BasicCompletionQueue) -> io::Result<()> {
    // SAFETY: the CQ is alive for the borrow of `cq`.
    let rc = unsafe { sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc.abs()));
    }
    Ok(())
}

/// Waits up to `timeout` for the channel's fd to become readable.
pub(crate) fn wait_channel(channel: &CompletionChannel, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: channel.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `pfd` is one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(err);
    }
    Ok(rc > 0)
}

/// Takes and acks one event from the (non-blocking) channel; false if there was none.
pub(crate) fn take_cq_event(channel: &CompletionChannel) -> io::Result<bool> {
    let mut cq: *mut sys::ibv_cq = null_mut();
    let mut cq_context: *mut libc::c_void = null_mut();
    // SAFETY: the channel is alive for the borrow; its fd is non-blocking, so this returns at
    // once; the out-pointers are valid locals.
    let rc =
        unsafe { sys::ibv_get_cq_event(channel.comp_channel().as_ptr(), &mut cq, &mut cq_context) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::WouldBlock {
            return Ok(false);
        }
        return Err(err);
    }
    // SAFETY: `cq` is the live CQ the event was for (the channel serves one CQ, owned by the
    // same endpoint as the channel); acking one event is always valid after taking one.
    unsafe { sys::ibv_ack_cq_events(cq, 1) };
    Ok(true)
}
