//! The tcp transport: several connections per peer, large requests striped across them,
//! small ones packed together, bytes received straight into the destination memory.
//!
//! Mechanism. Each peer has `tcp_conns_per_peer` connection slots. A request is cut into slices
//! of `slice_bytes` (or, alone on an idle peer, striped over every connection); many small
//! requests of one batch are packed into one ReadV/WriteV request carrying a table of ranges,
//! so their per-request costs (a header, a reply, a wakeup) are paid once per pack instead of
//! once per object. Every slice or pack becomes a [`Job`] queued on one connection (round
//! robin). Each connection has three tasks:
//! - the writer takes jobs from a bounded queue, records them as pending (in order) and writes
//!   headers, range tables and write payloads with vectored writes straight from the source
//!   memory, several queued jobs per system call;
//! - the reader reads replies in order, matches each to the oldest pending job, and for reads
//!   receives the payload straight into the destination memory (vectored reads spread one
//!   receive over every range of a pack; no staging copy);
//! - the watchdog resets the connection when the oldest pending job passes its deadline, which
//!   turns a silent peer into `Timeout` errors and unblocks both other tasks.
//!
//! A lone request of up to 1 MiB (a single small read or write, a guarded read) instead takes
//! the peer's *direct* connection when no other request is on it: the calling task writes the
//! request and reads the reply itself, polling the socket for up to `tcp_direct_spin_us` before
//! it parks, so a round trip wakes no other task on this side (see [`Direct`]). A request that
//! finds it in use takes the pooled connections; one cancelled or failed on it closes it.
//!
//! The acceptor serves each connection sequentially, reads request headers without a wait when
//! they are already there, and sends replies with their payload in one vectored write, holding
//! small replies back while more requests are queued behind them.
//!
//! Failure policy. A broken connection fails every job on it with a retryable error; the slice
//! or pack is retried on the next connection (reconnecting lazily, with a fresh handshake) up
//! to `retries_max` times, never past the items' deadline. A reconnect that finds a different
//! engine instance at the address fails with `PeerGone`: a restarted peer is a new segment and
//! its memory layout is not the one the caller addressed. Because connections are re-made on
//! demand and there is no idle timer anywhere, the first transfer after a long idle gap either
//! finds its connection alive or transparently replaces it. Within a pack every range has its
//! own status: one range outside the peer's regions fails alone.
//!
//! Invariants: replies arrive in request order per connection; a job's memory stays valid until
//! its completion is sent and its bytes are written (owned buffers are held by an `Arc` in the
//! job; raw registrations are the caller's promise); a pack's range table is checked whole
//! (count, lengths, total) before any byte moves, and a malformed one closes the connection.
//!
//! Authentication: with a cluster secret configured, every connection (tcp data, rdma control)
//! proves it both ways before its `Hello` ([`prove`], [`kvfs_proto::auth`]); a stranger is
//! refused before it can read, write or learn the engine's shm socket.
//!
//! Device memory (a region registered with [`crate::Engine::register_device_memory`]) is served
//! through host staging: a read's payload is copied out of the device in pieces of
//! [`DEVICE_CHUNK_BYTES`], each piece's copy running on a blocking thread while the previous one
//! is on the wire; a write's payload is received piece by piece and each piece copied in while
//! the next one arrives. Two staging buffers per connection, allocated on first use and
//! page-locked by the device ([`DeviceMemory::pin_host`]) so its copy engine moves them at full
//! speed.
//!
//! Not handled: encryption (peers are cluster members on a private network, as in the
//! reference system).

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvfs_proto::plain::{Inbound, PlainStream, ServeSpin};
use kvfs_proto::transfer::{
    DataHeader, DataOp, DataReply, DataStatus, GUARD_BYTES_MAX, HANDSHAKE_FRAME_MAX, Hello,
    RANGE_ENTRY_BYTES, RANGES_PER_REQUEST_MAX, TE_PROTOCOL_VERSION, Welcome, decode_ranges,
    encode_guards, encode_ranges,
};
use kvfs_proto::{read_msg, write_msg};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::engine::Shared;
use crate::memory::{Buffer, DEVICE_CHUNK_BYTES, DeviceMemory, Region};
use crate::{Error, ErrorKind, Result};

/// Keeps the memory of a job alive until it completes (the fields are never read: holding them
/// is the point).
#[derive(Clone)]
#[allow(dead_code)]
pub(crate) enum Hold {
    None,
    Buffer(Arc<Buffer>),
    Bytes(Arc<Vec<u8>>),
    Owner(Arc<dyn std::any::Any + Send + Sync>),
}

/// `len` bytes between `local` (this process) and `remote` (the peer's segment).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Range {
    pub remote: u64,
    pub local: u64,
    pub len: u64,
}

/// What a finished job reports: nothing more for single operations, a status per range for
/// packs.
enum Outcome {
    Done,
    Ranges(Vec<DataStatus>),
}

/// One slice or pack, queued on one connection.
struct Job {
    op: DataOp,
    /// The guard of a `ReadGuarded`, the encoded guard table of a `ReadGuardedV` (empty
    /// otherwise).
    guard: Arc<[u8]>,
    ranges: Vec<Range>,
    deadline: Instant,
    holds: Vec<Hold>,
    done: oneshot::Sender<Result<Outcome>>,
}

struct Pending {
    id: u64,
    op: DataOp,
    ranges: Vec<Range>,
    deadline: Instant,
    _holds: Vec<Hold>,
    done: oneshot::Sender<Result<Outcome>>,
}

/// Jobs one vectored write may gather, and the io vectors it may use (the kernel's limit is
/// 1024).
const WRITE_GATHER_JOBS_MAX: usize = 64;
const IOV_MAX: usize = 1000;
/// Replies the acceptor holds back while more requests are queued, at most.
const REPLY_BUFFER_BYTES_MAX: usize = 64 << 10;

struct ConnState {
    dead: AtomicBool,
    death: Mutex<Option<Error>>,
    pending: Mutex<VecDeque<Pending>>,
    /// A duplicate of the socket, used only to shut it down from the watchdog or on failure.
    shutdown_fd: OwnedFd,
    peer: String,
}

impl ConnState {
    fn kill(&self, err: Error) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(peer = %self.peer, error = %err, "tcp connection closed");
        *self.death.lock().unwrap_or_else(|e| e.into_inner()) = Some(err.clone());
        // SAFETY: shutdown on a descriptor we own (a dup of the socket); it only changes the
        // socket's state so blocked reads and writes return.
        unsafe { libc::shutdown(self.shutdown_fd.as_raw_fd(), libc::SHUT_RDWR) };
        let drained: Vec<Pending> =
            self.pending.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for p in drained {
            let _ = p.done.send(Err(err.clone()));
        }
    }

    fn death(&self) -> Error {
        self.death.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| {
            Error::new(ErrorKind::PeerGone, "tcp", format!("connection to {} closed", self.peer))
        })
    }

    fn oldest_deadline(&self) -> Option<Instant> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).front().map(|p| p.deadline)
    }
}

/// A live connection: the queue into its writer and its shared state.
#[derive(Clone)]
struct Conn {
    tx: mpsc::Sender<Job>,
    st: Arc<ConnState>,
}

impl Conn {
    fn is_alive(&self) -> bool {
        !self.st.dead.load(Ordering::Acquire) && !self.tx.is_closed()
    }
}

/// What the first handshake told us about the peer.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    pub name: String,
    pub host_id: String,
    pub instance: u64,
    pub shm_socket: Option<String>,
    /// The peer serves rdma control connections.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub rdma: bool,
    /// The peer's lowest remote region when it answered (0: none).
    pub first_buffer_addr: u64,
}

/// The connecting side's proof of the cluster secret, when the engine has one (the caller
/// bounds it with the connect timeout).
pub(crate) async fn prove(
    stream: &mut TcpStream,
    shared: &Shared,
    what: &'static str,
) -> Result<()> {
    let Some(secret) = &shared.cfg.cluster_secret else { return Ok(()) };
    kvfs_proto::auth::connect(stream, secret).await.map_err(|e| auth_error(e, what))
}

/// The accepting side's check of the cluster secret, within the connect timeout.
async fn check(stream: &mut TcpStream, shared: &Shared) -> Result<()> {
    let Some(secret) = &shared.cfg.cluster_secret else { return Ok(()) };
    let timeout = shared.cfg.connect_timeout();
    match tokio::time::timeout(timeout, kvfs_proto::auth::accept(stream, secret)).await {
        Ok(r) => r.map_err(|e| auth_error(e, "tcp accept")),
        Err(_) => Err(Error::new(ErrorKind::Timeout, "tcp accept", "no secret handshake in time")),
    }
}

pub(crate) fn auth_error(e: kvfs_proto::auth::AuthError, what: &'static str) -> Error {
    match e {
        kvfs_proto::auth::AuthError::Refused(m) => Error::new(ErrorKind::Refused, what, m),
        kvfs_proto::auth::AuthError::Io(m) => Error::new(ErrorKind::PeerGone, what, m),
    }
}

/// Connects and performs the handshake, within the connect timeout.
async fn connect(addr: SocketAddr, shared: &Shared) -> Result<(TcpStream, Welcome)> {
    let cfg = &shared.cfg;
    let fut = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| Error::io("tcp connect", e))?;
        kvfs_proto::sock::tune(&stream, cfg.socket_buffer_bytes);
        let mut stream = stream;
        prove(&mut stream, shared, "tcp handshake").await?;
        let hello = Hello {
            version: TE_PROTOCOL_VERSION,
            name: shared.name.clone(),
            host_id: shared.host_id.clone(),
            rdma: None,
        };
        write_msg(&mut stream, &hello)
            .await
            .map_err(|e| Error::new(ErrorKind::PeerGone, "tcp handshake", e.to_string()))?;
        let welcome: Welcome = read_msg(&mut stream, HANDSHAKE_FRAME_MAX)
            .await
            .map_err(|e| handshake_read_error(e, "tcp handshake"))?
            .ok_or_else(|| Error::new(ErrorKind::PeerGone, "tcp handshake", "closed"))?;
        if let Some(why) = &welcome.refused {
            return Err(Error::new(ErrorKind::Refused, "tcp handshake", why.clone()));
        }
        if welcome.version != TE_PROTOCOL_VERSION {
            return Err(Error::new(
                ErrorKind::Refused,
                "tcp handshake",
                format!(
                    "peer speaks protocol {}, we speak {}",
                    welcome.version, TE_PROTOCOL_VERSION
                ),
            ));
        }
        Ok((stream, welcome))
    };
    match tokio::time::timeout(cfg.connect_timeout(), fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            "tcp connect",
            format!("{addr} did not complete the handshake within {:?}", cfg.connect_timeout()),
        )),
    }
}

/// A failed read of a `Welcome`: a refusal for want of the cluster secret says so.
pub(crate) fn handshake_read_error(e: kvfs_proto::FrameError, what: &'static str) -> Error {
    match e {
        kvfs_proto::FrameError::SecretRequired(m) => Error::new(ErrorKind::Refused, what, m),
        e => Error::new(ErrorKind::PeerGone, what, e.to_string()),
    }
}

fn start_conn(stream: TcpStream, shared: &Arc<Shared>) -> Result<Conn> {
    // SAFETY: dup of a valid socket descriptor; the duplicate is owned by ConnState.
    let dup = unsafe { libc::dup(stream.as_raw_fd()) };
    if dup < 0 {
        return Err(Error::io("tcp dup", std::io::Error::last_os_error()));
    }
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let st = Arc::new(ConnState {
        dead: AtomicBool::new(false),
        death: Mutex::new(None),
        pending: Mutex::new(VecDeque::new()),
        // SAFETY: dup returned a fresh descriptor owned by nobody else.
        shutdown_fd: unsafe { OwnedFd::from_raw_fd(dup) },
        peer,
    });
    let (tx, rx) = mpsc::channel(shared.cfg.queue_depth_max);
    let (rd, wr) = stream.into_split();
    tokio::spawn(writer(wr, rx, st.clone()));
    tokio::spawn(reader(rd, st.clone()));
    let tick =
        (shared.cfg.op_timeout() / 8).clamp(Duration::from_millis(20), Duration::from_millis(500));
    tokio::spawn(watchdog(Arc::downgrade(&st), tick));
    Ok(Conn { tx, st })
}

/// Whether the job's request carries payload bytes after its header (and table).
fn sends_payload(op: DataOp) -> bool {
    matches!(op, DataOp::Write | DataOp::Notify | DataOp::WriteV | DataOp::WriteNoted)
}

/// The bytes of a job's header and, for packs, its range table.
fn request_head(job: &Job, id: u64) -> Vec<u8> {
    encode_head(job.op, id, &job.ranges, &job.guard, None)
}

/// A request's header, then its range table (packs), then `guard`: a `ReadGuarded`'s guard, a
/// `WriteNoted`'s note, a `ReadGuardedV`'s guard table; every other op's is empty.
fn encode_head(
    op: DataOp,
    id: u64,
    ranges: &[Range],
    guard: &[u8],
    idle_us: Option<u32>,
) -> Vec<u8> {
    let packed = op.is_pack();
    let total: u64 = ranges.iter().map(|r| r.len).sum();
    let first = ranges.first().copied().unwrap_or(Range { remote: 0, local: 0, len: 0 });
    let hdr = DataHeader {
        op,
        id,
        addr: if packed { 0 } else { first.remote },
        len: total,
        ranges: if packed {
            ranges.len() as u32
        } else if op.carries_note() {
            guard.len() as u32
        } else {
            0
        },
        idle_us,
    };
    let mut head = hdr.encode().to_vec();
    if packed {
        head.extend(encode_ranges(ranges.iter().map(|r| (r.remote, r.len))));
    }
    debug_assert!(guard.is_empty() || op.carries_note() || op == DataOp::ReadGuardedV);
    head.extend_from_slice(guard);
    head
}

async fn writer(mut wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Job>, st: Arc<ConnState>) {
    let mut next_id: u64 = 1;
    while let Some(first) = rx.recv().await {
        // Gather what is already queued into one vectored write.
        let mut jobs = vec![first];
        let mut iovs = 1 + jobs[0].ranges.len();
        while jobs.len() < WRITE_GATHER_JOBS_MAX && iovs < IOV_MAX / 2 {
            match rx.try_recv() {
                Ok(j) => {
                    iovs += 1 + j.ranges.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        if st.dead.load(Ordering::Acquire) {
            for j in jobs {
                let _ = j.done.send(Err(st.death()));
            }
            rx.close();
            continue;
        }
        let deadline = jobs.iter().map(|j| j.deadline).min().unwrap_or_else(Instant::now);
        let mut heads = Vec::with_capacity(jobs.len());
        let mut payloads: Vec<Vec<Range>> = Vec::with_capacity(jobs.len());
        let mut holds = Vec::new();
        {
            let mut pending = st.pending.lock().unwrap_or_else(|e| e.into_inner());
            for job in jobs {
                let id = next_id;
                next_id += 1;
                heads.push(request_head(&job, id));
                payloads.push(if sends_payload(job.op) { job.ranges.clone() } else { Vec::new() });
                holds.extend(job.holds.iter().cloned());
                pending.push_back(Pending {
                    id,
                    op: job.op,
                    ranges: job.ranges,
                    deadline: job.deadline,
                    _holds: job.holds,
                    done: job.done,
                });
            }
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(iovs);
        for (head, ranges) in heads.iter().zip(&payloads) {
            slices.push(IoSlice::new(head));
            for r in ranges.iter().filter(|r| r.len > 0) {
                // SAFETY: the job's memory is registered (and held in `holds`) until this write
                // has finished, even if the job completes meanwhile.
                slices.push(IoSlice::new(unsafe {
                    std::slice::from_raw_parts(r.local as *const u8, r.len as usize)
                }));
            }
        }
        let res = tokio::time::timeout_at(deadline, write_all_vectored(&mut wr, &mut slices)).await;
        drop(slices);
        drop(holds);
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => st.kill(Error::io("tcp send", e)),
            Err(_) => st.kill(Error::new(ErrorKind::Timeout, "tcp send", "peer stopped reading")),
        }
    }
    let _ = wr.shutdown().await;
}

/// Writes every byte of `bufs`, in as few system calls as the kernel allows.
async fn write_all_vectored(
    w: &mut OwnedWriteHalf,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

async fn reader(rd: OwnedReadHalf, st: Arc<ConnState>) {
    // Small replies (header and payload) come in with one system call.
    let mut rd = Inbound::new(rd, INBOUND_BUFFER_BYTES);
    let mut hb = [0u8; DataReply::SIZE];
    loop {
        if let Err(e) = rd.read_exact(&mut hb).await {
            return st.kill(Error::io("tcp receive", e));
        }
        let reply = match DataReply::decode(&hb) {
            Ok(r) => r,
            Err(e) => return st.kill(Error::new(ErrorKind::Io, "tcp receive", e.to_string())),
        };
        let Some(p) = st.pending.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else {
            return st.kill(Error::new(ErrorKind::Io, "tcp receive", "reply with no request"));
        };
        if p.id != reply.id {
            let err = Error::new(
                ErrorKind::Io,
                "tcp receive",
                format!("reply {} for request {}", reply.id, p.id),
            );
            let _ = p.done.send(Err(err.clone()));
            return st.kill(err);
        }
        let r = receive_reply(&mut rd, p.op, &p.ranges, &reply).await;
        // Let go of the job's memory before its caller learns it is done.
        let Pending { done, _holds, .. } = p;
        drop(_holds);
        match r {
            Ok(outcome) => {
                let _ = done.send(outcome);
            }
            Err(err) => {
                let _ = done.send(Err(err.clone()));
                return st.kill(err);
            }
        }
    }
}

/// Reads whatever follows a reply header; the outer `Err` means the stream is out of step.
/// A single-range read's destination, once the reply is checked to carry its length.
fn read_destination<'a>(r: &Range, reply: &DataReply) -> Result<&'a mut [u8]> {
    if reply.len != r.len {
        let detail = format!("read reply of {} bytes for {}", reply.len, r.len);
        return Err(Error::new(ErrorKind::Io, "tcp receive", detail));
    }
    // SAFETY: the destination is registered and held by the request's owner until its
    // completion is sent (or, on the direct connection, borrowed by the call that receives
    // into it: `TcpPeer::read_guarded_direct`), and nothing else writes it meanwhile.
    Ok(unsafe { std::slice::from_raw_parts_mut(r.local as *mut u8, r.len as usize) })
}

async fn receive_reply(
    rd: &mut Inbound,
    op: DataOp,
    ranges: &[Range],
    reply: &DataReply,
) -> Result<Result<Outcome>> {
    let bad = |msg: String| Error::new(ErrorKind::Io, "tcp receive", msg);
    if reply.status != DataStatus::Ok {
        return Ok(Err(status_error(reply.status, op)));
    }
    match op {
        DataOp::Read | DataOp::ReadGuarded => {
            let dst = read_destination(&ranges[0], reply)?;
            rd.read_exact(dst).await.map_err(|e| Error::io("tcp receive", e))?;
            Ok(Ok(Outcome::Done))
        }
        DataOp::ReadV | DataOp::WriteV | DataOp::ReadGuardedV => {
            let mut codes = vec![0u8; ranges.len()];
            rd.read_exact(&mut codes).await.map_err(|e| Error::io("tcp receive", e))?;
            let statuses: Vec<DataStatus> = codes
                .iter()
                .map(|&c| {
                    DataStatus::from_code(c.into())
                        .ok_or_else(|| bad(format!("unknown range status {c}")))
                })
                .collect::<Result<_>>()?;
            if op != DataOp::WriteV {
                let ok = ranges.iter().zip(&statuses).filter(|(_, s)| **s == DataStatus::Ok);
                let expect: u64 = ok.clone().map(|(r, _)| r.len).sum();
                if reply.len != expect {
                    return Err(bad(format!("pack reply of {} bytes for {expect}", reply.len)));
                }
                let mut dsts: Vec<IoSliceMut<'_>> = ok
                    .filter(|(r, _)| r.len > 0)
                    // SAFETY: each destination is registered and held until completion is sent;
                    // the ranges of one pack never overlap (the engine packs distinct items).
                    .map(|(r, _)| {
                        IoSliceMut::new(unsafe {
                            std::slice::from_raw_parts_mut(r.local as *mut u8, r.len as usize)
                        })
                    })
                    .collect();
                rd.read_exact_vectored(&mut dsts).await.map_err(|e| Error::io("tcp receive", e))?;
            }
            Ok(Ok(Outcome::Ranges(statuses)))
        }
        DataOp::Write | DataOp::WriteNoted | DataOp::Notify | DataOp::Ping => Ok(Ok(Outcome::Done)),
    }
}

async fn watchdog(st: Weak<ConnState>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let Some(st) = st.upgrade() else { return };
        if st.dead.load(Ordering::Acquire) {
            return;
        }
        if let Some(deadline) = st.oldest_deadline()
            && Instant::now() >= deadline
        {
            st.kill(Error::new(
                ErrorKind::Timeout,
                "tcp transfer",
                format!("no reply from {} before the deadline", st.peer),
            ));
            return;
        }
    }
}

/// What a request of `op` is, for its errors.
fn status_what(op: DataOp) -> &'static str {
    match op {
        DataOp::Read | DataOp::ReadV | DataOp::ReadGuarded | DataOp::ReadGuardedV => "remote read",
        DataOp::Write | DataOp::WriteV | DataOp::WriteNoted => "remote write",
        DataOp::Notify => "notify",
        DataOp::Ping => "ping",
    }
}

fn status_error(status: DataStatus, op: DataOp) -> Error {
    let what = status_what(op);
    let kind = match status {
        DataStatus::OutOfRange => ErrorKind::OutOfRange,
        DataStatus::Busy => ErrorKind::Busy,
        DataStatus::Stale => ErrorKind::Stale,
        DataStatus::TooLarge | DataStatus::InvalidArgument | DataStatus::Ok => {
            ErrorKind::InvalidArgument
        }
    };
    let detail = if status == DataStatus::OutOfRange {
        "remote range is not inside one region the peer registered as remotely accessible"
            .to_string()
    } else if status == DataStatus::Stale && op == DataOp::WriteNoted {
        "the bytes were written, but the peer's owner refused the write's note".to_string()
    } else if status == DataStatus::Stale {
        "the peer no longer holds what the guard names there".to_string()
    } else {
        format!("peer answered {status:?}")
    };
    Error::new(kind, what, detail)
}

/// The guard of requests that carry none.
fn no_guard() -> Arc<[u8]> {
    static EMPTY: std::sync::OnceLock<Arc<[u8]>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| Arc::from(&[][..])).clone()
}

/// The tcp side of one remote segment.
pub(crate) struct TcpPeer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    slots: Vec<tokio::sync::Mutex<Option<Conn>>>,
    next: AtomicUsize,
    instance: u64,
    slice_bytes: u64,
    /// Requests in flight to this peer (decides whether a mid-sized request is striped).
    busy: AtomicUsize,
    /// The direct connection (see [`Direct`]).
    direct: Mutex<DirectSlot>,
}

/// Largest request the direct connection carries: above it a request is striped (or is big
/// enough that two wakeups are noise next to its bytes).
const DIRECT_BYTES_MAX: u64 = 1 << 20;

/// A peer's direct connection: a lone small request's own task writes the request and reads
/// the reply on it, with no writer or reader task in between (so no other task is woken on
/// either end of the round trip), and polls the socket for up to `tcp_direct_spin_us` before
/// it parks. One request at a time: a request that finds it in use takes the pooled
/// connections, so concurrent requests still pipeline there.
///
/// Its socket is registered with no reactor while a request is written and its reply polled
/// for ([`PlainStream`]): registered, each readiness edge woke the runtime's parked thread
/// though no task waited, two wake-ups per small read or write.
struct Direct {
    sock: PlainStream,
    next_id: u64,
    /// When the last reply on it was read: each request tells the serving side how long its
    /// caller was away since (`DataHeader::idle_us`; see `ServeSpin`).
    answered: Option<std::time::Instant>,
}

enum DirectSlot {
    /// Not connected: not yet, or since a request on it failed or was cancelled.
    Closed,
    Idle(Direct),
    InUse,
}

/// The direct slot while a request uses it. Dropped, it puts back `back` (set only when the
/// request finished cleanly) or marks the slot closed: a cancelled or failed request may have
/// left the stream in the middle of a message.
struct DirectLease<'a> {
    slot: &'a Mutex<DirectSlot>,
    back: Option<Direct>,
}

impl Drop for DirectLease<'_> {
    fn drop(&mut self) {
        let next = match self.back.take() {
            Some(d) => DirectSlot::Idle(d),
            None => DirectSlot::Closed,
        };
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = next;
    }
}

impl Direct {
    /// Writes one request and reads its reply into `r.local`. The outer `Err`: the stream is
    /// broken or out of step; the inner result is the peer's answer.
    async fn round_trip(
        &mut self,
        op: DataOp,
        guard: &[u8],
        r: Range,
        spin: Duration,
    ) -> Result<Result<()>> {
        let id = self.next_id;
        self.next_id += 1;
        let idle_us = self.answered.map(|t| t.elapsed().as_micros().min(u32::MAX as u128) as u32);
        let head = encode_head(op, id, &[r], guard, idle_us);
        let mut slices = vec![IoSlice::new(&head)];
        if sends_payload(op) && r.len > 0 {
            // SAFETY: the caller's memory is registered and held (by the caller) until this
            // returns; the write finishes before it does.
            slices.push(IoSlice::new(unsafe {
                std::slice::from_raw_parts(r.local as *const u8, r.len as usize)
            }));
        }
        self.sock.write_all_vectored(&mut slices).await.map_err(|e| Error::io("tcp send", e))?;
        drop(slices);
        self.sock.spin_for_bytes(spin);
        let mut hb = [0u8; DataReply::SIZE];
        self.sock.read_exact(&mut hb).await.map_err(|e| Error::io("tcp receive", e))?;
        let reply = DataReply::decode(&hb)
            .map_err(|e| Error::new(ErrorKind::Io, "tcp receive", e.to_string()))?;
        if reply.id != id {
            let detail = format!("reply {} for request {id}", reply.id);
            return Err(Error::new(ErrorKind::Io, "tcp receive", detail));
        }
        if reply.status != DataStatus::Ok {
            return Ok(Err(status_error(reply.status, op)));
        }
        match op {
            DataOp::Read | DataOp::ReadGuarded => {
                let dst = read_destination(&r, &reply)?;
                self.sock.read_exact(dst).await.map_err(|e| Error::io("tcp receive", e))?;
            }
            DataOp::Write | DataOp::WriteNoted => {}
            other => {
                let detail = format!("{other:?} is not carried by the direct connection");
                return Err(Error::new(ErrorKind::InvalidArgument, "tcp direct", detail));
            }
        }
        self.answered = Some(std::time::Instant::now());
        Ok(Ok(()))
    }
}

/// Smallest slice a request is cut into when it is striped over idle connections.
const STRIPE_SLICE_MIN: u64 = 256 << 10;

impl TcpPeer {
    /// Connects the first connection and learns who the peer is.
    pub async fn open(addr: SocketAddr, shared: Arc<Shared>) -> Result<(TcpPeer, PeerInfo)> {
        let (stream, welcome) = connect(addr, &shared).await?;
        let info = PeerInfo {
            name: welcome.name,
            host_id: welcome.host_id,
            instance: welcome.instance,
            shm_socket: welcome.shm_socket,
            rdma: welcome.rdma,
            first_buffer_addr: welcome.first_buffer_addr,
        };
        let n = shared.cfg.tcp_conns_per_peer;
        let first = start_conn(stream, &shared)?;
        let slots: Vec<_> = (0..n)
            .map(|i| tokio::sync::Mutex::new(if i == 0 { Some(first.clone()) } else { None }))
            .collect();
        let slice_bytes = shared.cfg.slice_bytes;
        let peer = TcpPeer {
            addr,
            shared,
            slots,
            next: AtomicUsize::new(0),
            instance: info.instance,
            slice_bytes,
            busy: AtomicUsize::new(0),
            direct: Mutex::new(DirectSlot::Closed),
        };
        Ok((peer, info))
    }

    async fn conn(&self, slot: usize, deadline: Instant) -> Result<Conn> {
        let mut guard = self.slots[slot].lock().await;
        if let Some(c) = guard.as_ref()
            && c.is_alive()
        {
            return Ok(c.clone());
        }
        let conn = start_conn(self.reconnect(deadline).await?, &self.shared)?;
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// A fresh connection to the same engine instance, before `deadline`.
    async fn reconnect(&self, deadline: Instant) -> Result<TcpStream> {
        let (stream, welcome) = tokio::time::timeout_at(deadline, connect(self.addr, &self.shared))
            .await
            .map_err(|_| Error::new(ErrorKind::Timeout, "tcp connect", "deadline passed"))??;
        if welcome.instance != self.instance {
            return Err(Error::new(
                ErrorKind::PeerGone,
                "tcp reconnect",
                format!("{} restarted: it is a new segment instance", self.addr),
            ));
        }
        Ok(stream)
    }

    /// A lone request of at most [`DIRECT_BYTES_MAX`] on the direct connection (see
    /// [`Direct`]). `None`: the connection is in use, or it could not be made or broke before
    /// the peer answered; the caller then takes the pooled connections (which retry).
    async fn direct(
        &self,
        op: DataOp,
        guard: &[u8],
        r: Range,
        deadline: Instant,
    ) -> Option<Result<()>> {
        let idle = {
            let mut slot = self.direct.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *slot, DirectSlot::InUse) {
                DirectSlot::InUse => return None,
                DirectSlot::Idle(d) => Some(d),
                DirectSlot::Closed => None,
            }
        };
        let mut lease = DirectLease { slot: &self.direct, back: None };
        let mut d = match idle {
            Some(d) => d,
            None => match self.reconnect(deadline).await {
                Ok(stream) => match PlainStream::new(stream) {
                    Ok(sock) => Direct { sock, next_id: 1, answered: None },
                    Err(_) => return None,
                },
                Err(e) if matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Timeout) => {
                    return Some(Err(e));
                }
                Err(_) => return None,
            },
        };
        let spin = Duration::from_micros(self.shared.cfg.tcp_direct_spin_us);
        match tokio::time::timeout_at(deadline, d.round_trip(op, guard, r, spin)).await {
            Ok(Ok(answer)) => {
                lease.back = Some(d);
                Some(answer)
            }
            Ok(Err(e)) => {
                tracing::debug!(peer = %self.addr, error = %e, "direct connection broke");
                None
            }
            Err(_) => Some(Err(Error::new(
                ErrorKind::Timeout,
                "tcp transfer",
                format!("no reply from {} before the deadline", self.addr),
            ))),
        }
    }

    /// Runs one request (Read or Write), striped over at most `conns_max` of the connections
    /// (0: all of them), retrying broken slices.
    #[allow(clippy::too_many_arguments)]
    pub async fn request(
        &self,
        op: DataOp,
        remote: u64,
        local: u64,
        len: u64,
        hold: Hold,
        deadline: Instant,
        conns_max: usize,
    ) -> Result<()> {
        let _busy = BusyGuard::new(&self.busy);
        let all = self.slots.len();
        let width = if conns_max == 0 { all } else { conns_max.min(all) };
        let slice = self.slice_for(len, width);
        if len <= slice {
            let r = Range { remote, local, len };
            if len <= DIRECT_BYTES_MAX
                && let Some(done) = self.direct(op, &[], r, deadline).await
            {
                return done;
            }
            return self.single(op, r, &hold, deadline).await;
        }
        // A request held to fewer connections than the peer has takes a window of them; the
        // next such request takes the next window, so requests to one peer still spread.
        let first = (width < all).then(|| self.next.fetch_add(width, Ordering::Relaxed));
        let mut slices = Vec::with_capacity(len.div_ceil(slice) as usize);
        for (k, off) in (0..len).step_by(slice as usize).enumerate() {
            let r = Range { remote: remote + off, local: local + off, len: slice.min(len - off) };
            let slot = first.map(|f| (f + k % width) % all);
            slices.push(self.on_slot(op, r, &hold, deadline, slot));
        }
        let results = futures_util::future::join_all(slices).await;
        results.into_iter().find(|r| r.is_err()).unwrap_or(Ok(()))
    }

    /// Reads `reads` (each a range and what keeps its local memory alive) in order over the
    /// pooled connection `lane` (modulo the peer's connections): runs of small reads go as
    /// packs (`ReadV`, whose ranges the acceptor copies in table order, as the engine packs a
    /// batch's), larger ones as slices, all queued on that one connection in turn, and the
    /// acceptor serves a connection's requests in order and copies every reply's bytes out of
    /// its memory in that order, so each read sees the peer's memory no earlier than the reads
    /// before it did. A seqlock reader puts a header read before and after its data on each
    /// lane and needs no round trips of its own for them. Never on the direct connection,
    /// never retried (a retry would break the order): a broken connection fails the reads
    /// still on it, and the caller runs the whole lane again. One result per read, in order.
    pub async fn read_in_order(
        &self,
        reads: Vec<(Range, Hold)>,
        lane: usize,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        use crate::engine::{PACK_ITEM_BYTES_MAX, pack_is_full};
        let _busy = BusyGuard::new(&self.busy);
        let n = reads.len();
        let conn = match self.conn(lane % self.slots.len(), deadline).await {
            Ok(c) => c,
            Err(e) => return vec![Err(e); n],
        };
        // The requests, in order.
        let mut jobs: Vec<LaneRequest> = Vec::new();
        let mut pack = LaneRequest::default();
        let close = |pack: &mut LaneRequest, jobs: &mut Vec<LaneRequest>| {
            if !pack.ranges.is_empty() {
                let mut p = std::mem::take(pack);
                p.op = if p.ranges.len() == 1 { DataOp::Read } else { DataOp::ReadV };
                jobs.push(p);
            }
        };
        let slice = self.slice_bytes.max(1);
        let mut pack_bytes = 0;
        for (k, (r, hold)) in reads.into_iter().enumerate() {
            if r.len <= PACK_ITEM_BYTES_MAX {
                if pack_is_full(pack.ranges.len(), pack_bytes, r.len) {
                    close(&mut pack, &mut jobs);
                    pack_bytes = 0;
                }
                pack_bytes += r.len;
                pack.ranges.push(r);
                pack.holds.push(hold);
                pack.owners.push(k);
                continue;
            }
            close(&mut pack, &mut jobs);
            pack_bytes = 0;
            for off in (0..r.len).step_by(slice as usize) {
                let len = slice.min(r.len - off);
                jobs.push(LaneRequest {
                    op: DataOp::Read,
                    ranges: vec![Range { remote: r.remote + off, local: r.local + off, len }],
                    holds: vec![hold.clone()],
                    owners: vec![k],
                });
            }
        }
        close(&mut pack, &mut jobs);
        let mut out: Vec<Result<()>> = vec![Ok(()); n];
        let fail = |out: &mut Vec<Result<()>>, k: usize, e: Error| {
            if out[k].is_ok() {
                out[k] = Err(e);
            }
        };
        let mut waits = Vec::with_capacity(jobs.len());
        let mut jobs = jobs.into_iter();
        for LaneRequest { op, ranges, holds, owners } in jobs.by_ref() {
            let (done, wait) = oneshot::channel();
            let job = Job { op, guard: no_guard(), ranges, deadline, holds, done };
            let queued = tokio::time::timeout_at(deadline, conn.tx.send(job)).await;
            let e = match queued {
                Ok(Ok(())) => {
                    waits.push((wait, owners));
                    continue;
                }
                Ok(Err(_)) => conn.st.death(),
                Err(_) => Error::new(
                    ErrorKind::Timeout,
                    "tcp queue",
                    "the connection's queue stayed full until the deadline",
                ),
            };
            // Neither this request nor any after it is sent.
            for k in owners.into_iter().chain(jobs.by_ref().flat_map(|j| j.owners)) {
                fail(&mut out, k, e.clone());
            }
            break;
        }
        for (wait, owners) in waits {
            let done = wait.await.unwrap_or_else(|_| Err(conn.st.death()));
            let packed = owners.len() > 1;
            for (k, r) in owners.iter().zip(range_results(done, owners.len(), DataOp::Read, packed))
            {
                if let Err(e) = r {
                    fail(&mut out, *k, e);
                }
            }
        }
        out
    }

    /// One guarded read on one connection (never striped: the acceptor checks the guard once
    /// for the whole range); `Stale` when the peer no longer vouches for it.
    pub async fn read_guarded(
        &self,
        remote: u64,
        local: u64,
        len: u64,
        guard: Arc<[u8]>,
        hold: Hold,
        deadline: Instant,
    ) -> Result<()> {
        self.lone_with_note(DataOp::ReadGuarded, remote, local, len, guard, hold, deadline).await
    }

    /// [`TcpPeer::read_guarded`] into `dst`, which the call borrows: only on the idle direct
    /// connection, whose reply this task receives itself before it returns (a dropped call
    /// closes that connection, so no byte lands in `dst` afterwards). `None`: the request is
    /// too large for it, or it is busy or broke before the answer (the caller then reads
    /// through registered memory on the pooled connections).
    pub async fn read_guarded_direct(
        &self,
        remote: u64,
        dst: &mut [u8],
        guard: &[u8],
        deadline: Instant,
    ) -> Option<Result<()>> {
        let len = dst.len() as u64;
        if len > DIRECT_BYTES_MAX || guard.len() > GUARD_BYTES_MAX as usize {
            return None;
        }
        let _busy = BusyGuard::new(&self.busy);
        let r = Range { remote, local: dst.as_mut_ptr() as u64, len };
        self.direct(DataOp::ReadGuarded, guard, r, deadline).await
    }

    /// One noted write on one connection (never striped: the acceptor hands the whole range
    /// and the note to its owner once the bytes are in place); `Stale` when the owner refused
    /// the note (the bytes were written).
    pub async fn write_noted(
        &self,
        remote: u64,
        local: u64,
        len: u64,
        note: Arc<[u8]>,
        hold: Hold,
        deadline: Instant,
    ) -> Result<()> {
        self.lone_with_note(DataOp::WriteNoted, remote, local, len, note, hold, deadline).await
    }

    /// One request carrying owner bytes (`op.carries_note()`) on one connection: the direct
    /// one when it is free and the request small, else a pooled one, never striped.
    #[allow(clippy::too_many_arguments)]
    async fn lone_with_note(
        &self,
        op: DataOp,
        remote: u64,
        local: u64,
        len: u64,
        note: Arc<[u8]>,
        hold: Hold,
        deadline: Instant,
    ) -> Result<()> {
        if note.len() > GUARD_BYTES_MAX as usize {
            let detail = format!("{} owner bytes, the limit is {GUARD_BYTES_MAX}", note.len());
            return Err(Error::new(ErrorKind::InvalidArgument, status_what(op), detail));
        }
        let _busy = BusyGuard::new(&self.busy);
        let r = Range { remote, local, len };
        if len <= DIRECT_BYTES_MAX
            && let Some(done) = self.direct(op, &note, r, deadline).await
        {
            return done;
        }
        self.with_retries(op, &note, &[r], std::slice::from_ref(&hold), deadline, None)
            .await
            .map(|_| ())
    }

    /// Slice size for a request of `len` bytes striped over `width` connections: `slice_bytes`,
    /// except that a request alone on an otherwise idle peer is striped over the connections
    /// (one per CPU; slices of at least `STRIPE_SLICE_MIN`), so one mid-sized transfer still
    /// uses them all; when other requests are in flight the connections are busy anyway and
    /// bigger slices cost less per byte.
    fn slice_for(&self, len: u64, width: usize) -> u64 {
        if self.busy.load(Ordering::Relaxed) > 1 {
            return self.slice_bytes;
        }
        // More parallel slices than cores only adds wakeups: stripe over at most one
        // connection per CPU.
        let conns = (width.max(1) as u64).min(cpus());
        len.div_ceil(conns)
            .next_multiple_of(4096)
            .clamp(STRIPE_SLICE_MIN, self.slice_bytes.max(STRIPE_SLICE_MIN))
    }

    /// Runs many small requests of one direction as one pack (`ReadV`/`WriteV`); one result
    /// per range, in order. `op` is `Read` or `Write`.
    pub async fn request_pack(
        &self,
        op: DataOp,
        ranges: Vec<Range>,
        holds: Vec<Hold>,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        let _busy = BusyGuard::new(&self.busy);
        let n = ranges.len();
        let packed = if op == DataOp::Read { DataOp::ReadV } else { DataOp::WriteV };
        let done = self.with_retries(packed, &no_guard(), &ranges, &holds, deadline, None).await;
        range_results(done, n, op, true)
    }

    /// Runs many guarded reads as one pack (`ReadGuardedV`): one guard per range, checked by
    /// the acceptor's owner range by range; one result per range, in order, `Stale` for a
    /// range it no longer vouches for.
    pub async fn read_guarded_pack(
        &self,
        ranges: Vec<Range>,
        guards: &[Arc<[u8]>],
        holds: Vec<Hold>,
        deadline: Instant,
    ) -> Vec<Result<()>> {
        let n = ranges.len();
        let Some(table) = encode_guards(guards.iter().map(|g| &g[..])) else {
            let detail = format!("a guard is over the limit of {GUARD_BYTES_MAX} bytes");
            return vec![Err(Error::new(ErrorKind::InvalidArgument, "guarded read", detail)); n];
        };
        let _busy = BusyGuard::new(&self.busy);
        let op = DataOp::ReadGuardedV;
        let done = self.with_retries(op, &table.into(), &ranges, &holds, deadline, None).await;
        range_results(done, n, op, true)
    }

    async fn single(&self, op: DataOp, r: Range, hold: &Hold, deadline: Instant) -> Result<()> {
        self.on_slot(op, r, hold, deadline, None).await
    }

    /// [`single`](Self::single), first tried on connection `slot` when one is given.
    async fn on_slot(
        &self,
        op: DataOp,
        r: Range,
        hold: &Hold,
        deadline: Instant,
        slot: Option<usize>,
    ) -> Result<()> {
        self.with_retries(op, &no_guard(), &[r], std::slice::from_ref(hold), deadline, slot)
            .await
            .map(|_| ())
    }

    async fn with_retries(
        &self,
        op: DataOp,
        guard: &Arc<[u8]>,
        ranges: &[Range],
        holds: &[Hold],
        deadline: Instant,
        first: Option<usize>,
    ) -> Result<Outcome> {
        let mut attempt = 0;
        loop {
            // A retry goes to the next connection in turn, whatever the first one was.
            let slot = match first {
                Some(s) if attempt == 0 => s % self.slots.len(),
                _ => self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len(),
            };
            let res = self.try_job(slot, op, guard, ranges, holds, deadline).await;
            match res {
                Err(e)
                    if e.retryable()
                        && e.kind() != ErrorKind::Busy
                        && attempt < self.shared.cfg.retries_max
                        && Instant::now() < deadline =>
                {
                    attempt += 1;
                    tracing::debug!(peer = %self.addr, attempt, error = %e, "retrying on another connection");
                }
                other => return other,
            }
        }
    }

    async fn try_job(
        &self,
        slot: usize,
        op: DataOp,
        guard: &Arc<[u8]>,
        ranges: &[Range],
        holds: &[Hold],
        deadline: Instant,
    ) -> Result<Outcome> {
        let conn = self.conn(slot, deadline).await?;
        let (done, wait) = oneshot::channel();
        let job = Job {
            op,
            guard: guard.clone(),
            ranges: ranges.to_vec(),
            deadline,
            holds: holds.to_vec(),
            done,
        };
        match tokio::time::timeout_at(deadline, conn.tx.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(conn.st.death()),
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Busy,
                    "tcp queue",
                    "connection queue stayed full",
                ));
            }
        }
        match wait.await {
            Ok(r) => r,
            Err(_) => Err(conn.st.death()),
        }
    }

    /// Sends a notification (a small message) to the peer.
    pub async fn notify(&self, msg: Arc<Vec<u8>>, deadline: Instant) -> Result<()> {
        let r = Range { remote: 0, local: msg.as_ptr() as u64, len: msg.len() as u64 };
        self.single(DataOp::Notify, r, &Hold::Bytes(msg), deadline).await
    }

    /// Round trip with no payload: is the peer alive and answering?
    pub async fn ping(&self, deadline: Instant) -> Result<()> {
        self.single(DataOp::Ping, Range { remote: 0, local: 0, len: 0 }, &Hold::None, deadline)
            .await
    }

    /// Connections currently alive (for status output).
    pub fn live_connections(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| {
                s.try_lock().ok().and_then(|g| g.as_ref().map(Conn::is_alive)).unwrap_or(false)
            })
            .count()
    }
}

/// CPUs this process may use (at least 1).
fn cpus() -> u64 {
    static CPUS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1))
}

/// The per-range results of a request over `n` ranges of direction `op`: a pack (`packed`)
/// answers a status per range, a single request succeeds or fails whole.
fn range_results(done: Result<Outcome>, n: usize, op: DataOp, packed: bool) -> Vec<Result<()>> {
    match done {
        Ok(Outcome::Ranges(st)) if st.len() == n => st
            .into_iter()
            .map(|s| if s == DataStatus::Ok { Ok(()) } else { Err(status_error(s, op)) })
            .collect(),
        Ok(Outcome::Done) if !packed => vec![Ok(()); n],
        Ok(_) => {
            vec![Err(Error::new(ErrorKind::Io, "tcp pack", "reply without range statuses")); n]
        }
        Err(e) => vec![Err(e); n],
    }
}

/// One request of [`TcpPeer::read_in_order`]: a slice, a single small read or a pack, and the
/// read each of its ranges belongs to.
struct LaneRequest {
    op: DataOp,
    ranges: Vec<Range>,
    holds: Vec<Hold>,
    owners: Vec<usize>,
}

impl Default for LaneRequest {
    fn default() -> Self {
        LaneRequest { op: DataOp::Read, ranges: Vec::new(), holds: Vec::new(), owners: Vec::new() }
    }
}

/// Counts a request as in flight for as long as it lives.
struct BusyGuard<'a>(&'a AtomicUsize);

impl<'a> BusyGuard<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        BusyGuard(c)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one accepted connection: handshake, then requests in order until the peer leaves.
pub(crate) async fn serve_conn(mut stream: TcpStream, shared: Arc<Shared>) {
    kvfs_proto::sock::tune(&stream, shared.cfg.socket_buffer_bytes);
    if let Err(e) = check(&mut stream, &shared).await {
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        return tracing::warn!(%peer, error = %e, "transfer connection refused");
    }
    let hello = match tokio::time::timeout(
        shared.cfg.connect_timeout(),
        read_msg::<_, Hello>(&mut stream, HANDSHAKE_FRAME_MAX),
    )
    .await
    {
        Ok(Ok(Some(h))) => h,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => return tracing::debug!(error = %e, "bad handshake"),
        Err(_) => return tracing::debug!("handshake timed out"),
    };
    let version_ok = hello.version == TE_PROTOCOL_VERSION;
    if version_ok && hello.rdma.is_some() && shared.rdma.is_some() {
        return crate::rdma::serve_control(stream, shared, hello).await;
    }
    let refused = if !version_ok {
        Some(format!(
            "protocol version {} not supported (this engine speaks {})",
            hello.version, TE_PROTOCOL_VERSION
        ))
    } else {
        hello.rdma.is_some().then(|| "this engine does not serve rdma".to_string())
    };
    let welcome = Welcome {
        version: TE_PROTOCOL_VERSION,
        name: shared.name.clone(),
        host_id: shared.host_id.clone(),
        instance: shared.instance,
        shm_socket: shared.shm_socket.clone(),
        refused: refused.clone(),
        rdma: shared.rdma.is_some(),
        rdma_endpoint: None,

        first_buffer_addr: shared.registry.first_remote_addr(),
    };
    if write_msg(&mut stream, &welcome).await.is_err() || refused.is_some() {
        return;
    }
    if let Err(e) = serve_requests(stream, &shared, &hello.name).await {
        tracing::debug!(peer = %hello.name, error = %e, "tcp serving connection ended");
    }
}

/// Replies of one accepted connection, in request order. Small replies and read payloads are
/// held back while more requests are already queued behind them, then leave in one vectored
/// write (many replies, many payloads, one system call); the connection's owner flushes before
/// it waits for the next request, so nothing is held while the peer waits.
struct Replies {
    wr: PlainStream,
    /// Reply bytes not yet placed in `segs`.
    small: Vec<u8>,
    segs: Vec<Seg>,
    /// The regions whose memory `segs` points into, held until the write finishes.
    holds: Vec<Region>,
    payload_bytes: usize,
    /// Host staging for device payloads (empty until the first one).
    stage: Staging,
}

/// One piece of the next vectored write: reply bytes, or payload straight from registered
/// memory (by address: the region is held in `Replies::holds`).
enum Seg {
    Bytes(Vec<u8>),
    Payload { addr: usize, len: usize },
}

/// Payload bytes gathered into one vectored write at most.
const REPLY_GATHER_BYTES_MAX: usize = 8 << 20;

impl Replies {
    fn new(wr: PlainStream) -> Replies {
        Replies {
            wr,
            small: Vec::with_capacity(4096),
            segs: Vec::new(),
            holds: Vec::new(),
            payload_bytes: 0,
            stage: Staging::default(),
        }
    }

    async fn push(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.small.extend_from_slice(bytes);
        if self.small.len() >= REPLY_BUFFER_BYTES_MAX {
            self.flush().await?;
        }
        Ok(())
    }

    /// Queues `len` bytes of registered memory at `addr` (inside `hold`) after the replies
    /// pushed so far.
    async fn payload(&mut self, addr: u64, len: u64, hold: Region) -> std::io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if let Some(dev) = hold.device.clone() {
            self.flush().await?;
            return send_device(&mut self.wr, &mut self.stage, dev, addr - hold.addr, len).await;
        }
        if !self.small.is_empty() {
            self.segs.push(Seg::Bytes(std::mem::take(&mut self.small)));
        }
        self.segs.push(Seg::Payload { addr: addr as usize, len: len as usize });
        self.holds.push(hold);
        self.payload_bytes += len as usize;
        if self.payload_bytes >= REPLY_GATHER_BYTES_MAX || self.segs.len() >= IOV_MAX / 2 {
            self.flush().await?;
        }
        Ok(())
    }

    fn has_payload(&self) -> bool {
        self.payload_bytes > 0
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.small.is_empty() {
            self.segs.push(Seg::Bytes(std::mem::take(&mut self.small)));
        }
        if self.segs.is_empty() {
            return Ok(());
        }
        let mut slices: Vec<IoSlice<'_>> = self
            .segs
            .iter()
            .map(|s| match s {
                Seg::Bytes(b) => IoSlice::new(b),
                // SAFETY: the range lies inside a region registered as remotely readable
                // (checked when it was queued), held in `holds` until this write finishes.
                Seg::Payload { addr, len } => {
                    IoSlice::new(unsafe { std::slice::from_raw_parts(*addr as *const u8, *len) })
                }
            })
            .collect();
        self.wr.write_all_vectored(&mut slices).await?;
        drop(slices);
        self.segs.clear();
        self.holds.clear();
        self.payload_bytes = 0;
        Ok(())
    }
}

async fn serve_requests(stream: TcpStream, shared: &Shared, from: &str) -> std::io::Result<()> {
    // Off the runtime's reactor, as the caller's direct connection is (see `PlainStream`):
    // registered, every request arriving woke the runtime's parked thread though this task
    // was polling for it, and the caller's send paid that wake-up.
    let (mut rd, wr) = PlainStream::split(stream)?;
    let mut out = Replies::new(wr);
    let mut hb = [0u8; DataHeader::SIZE];
    // After a lone small request (the pattern of a peer's direct connection), whose caller
    // says how long it was away (`DataHeader::idle_us`).
    let mut spin = ServeSpin::new(Duration::from_micros(shared.cfg.tcp_serve_spin_us));
    loop {
        if !next_header(&mut rd, &mut out, &mut hb, &mut spin).await? {
            return Ok(());
        }
        let hdr = DataHeader::decode(&hb).map_err(std::io::Error::other)?;
        shared.count_served(hdr.op);
        spin.heard(hdr.idle_us);
        spin.lone = matches!(
            hdr.op,
            DataOp::Read | DataOp::Write | DataOp::ReadGuarded | DataOp::WriteNoted
        ) && hdr.len <= DIRECT_BYTES_MAX;
        if out.has_payload()
            && matches!(
                hdr.op,
                DataOp::Write | DataOp::WriteV | DataOp::Notify | DataOp::WriteNoted
            )
        {
            // Do not hold read payloads while waiting for this request's own payload.
            out.flush().await?;
        }
        match hdr.op {
            DataOp::Read => serve_read(&mut out, shared, &hdr).await?,
            DataOp::ReadGuarded => {
                if hdr.ranges > GUARD_BYTES_MAX {
                    return Err(std::io::Error::other(format!("guard of {} bytes", hdr.ranges)));
                }
                let mut g = vec![0u8; hdr.ranges as usize];
                rd.read_exact(&mut g).await?;
                if shared.vouches(hdr.addr, hdr.len, &g) {
                    serve_read(&mut out, shared, &hdr).await?
                } else {
                    let reply = DataReply { status: DataStatus::Stale, id: hdr.id, len: 0 };
                    out.push(&reply.encode()).await?;
                }
            }
            DataOp::WriteNoted => {
                if hdr.ranges > GUARD_BYTES_MAX {
                    return Err(std::io::Error::other(format!("note of {} bytes", hdr.ranges)));
                }
                let mut note = vec![0u8; hdr.ranges as usize];
                rd.read_exact(&mut note).await?;
                let mut status = serve_write(&mut rd, shared, &mut out.stage, &hdr).await?;
                if status == DataStatus::Ok && !shared.noted(hdr.addr, hdr.len, &note) {
                    status = DataStatus::Stale;
                }
                out.push(&DataReply { status, id: hdr.id, len: 0 }.encode()).await?;
            }
            DataOp::ReadV | DataOp::ReadGuardedV => {
                serve_read_pack(&mut rd, &mut out, shared, &hdr).await?
            }
            DataOp::WriteV => serve_write_pack(&mut rd, &mut out, shared, &hdr).await?,
            op => {
                let status = match op {
                    DataOp::Write => serve_write(&mut rd, shared, &mut out.stage, &hdr).await?,
                    DataOp::Notify => serve_notify(&mut rd, shared, &hdr, from).await?,
                    _ => DataStatus::Ok,
                };
                out.push(&DataReply { status, id: hdr.id, len: 0 }.encode()).await?;
            }
        }
    }
}

/// Reads the next request header: from what the last read already brought in, or, when that
/// is used up, after sending the held-back replies (the socket is then as good as drained:
/// waiting for more without answering would only add latency) and polling the socket as
/// `spin` says. `false` at a clean end of stream.
async fn next_header(
    rd: &mut PlainStream,
    out: &mut Replies,
    hb: &mut [u8; DataHeader::SIZE],
    spin: &mut ServeSpin,
) -> std::io::Result<bool> {
    let got = rd.take_buffered(hb);
    if got < hb.len() {
        out.flush().await?;
        if got == 0 {
            spin.next_request(rd).await?;
        }
        match rd.read_exact(&mut hb[got..]).await {
            Ok(_) => {}
            Err(e) if got == 0 && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Bytes a pooled connection's reply reader reads ahead at most.
const INBOUND_BUFFER_BYTES: usize = 16 << 10;

/// The region holding a remotely accessible range, if any.
fn remote_region(shared: &Shared, addr: u64, len: u64) -> Option<Region> {
    shared.registry.find(addr, len).filter(|r| r.remote)
}

async fn serve_write(
    rd: &mut PlainStream,
    shared: &Shared,
    stage: &mut Staging,
    hdr: &DataHeader,
) -> std::io::Result<DataStatus> {
    match remote_region(shared, hdr.addr, hdr.len) {
        Some(region) if region.device.is_some() => {
            receive_device(rd, stage, &region, hdr.addr, hdr.len).await?;
            Ok(DataStatus::Ok)
        }
        Some(region) => {
            // SAFETY: the range lies inside a region registered as remotely writable, and the
            // region's buffer (if owned) is held by `region` for the duration of the read.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(hdr.addr as *mut u8, hdr.len as usize) };
            rd.read_exact(dst).await?;
            drop(region);
            Ok(DataStatus::Ok)
        }
        None => {
            drain(rd, hdr.len, shared.cfg.write_drain_bytes_max).await?;
            Ok(DataStatus::OutOfRange)
        }
    }
}

async fn serve_read(out: &mut Replies, shared: &Shared, hdr: &DataHeader) -> std::io::Result<()> {
    match remote_region(shared, hdr.addr, hdr.len) {
        Some(region) => {
            out.push(&DataReply { status: DataStatus::Ok, id: hdr.id, len: hdr.len }.encode())
                .await?;
            out.payload(hdr.addr, hdr.len, region).await?;
        }
        None => {
            let reply = DataReply { status: DataStatus::OutOfRange, id: hdr.id, len: 0 };
            out.push(&reply.encode()).await?;
        }
    }
    Ok(())
}

/// Reads and checks a pack's range table; `Err` (closing the connection) when it is malformed.
async fn read_table(
    rd: &mut PlainStream,
    shared: &Shared,
    hdr: &DataHeader,
) -> std::io::Result<Vec<(u64, u64)>> {
    let malformed = |why: &str| std::io::Error::other(format!("malformed pack: {why}"));
    if hdr.ranges == 0 || hdr.ranges > RANGES_PER_REQUEST_MAX {
        return Err(malformed("range count out of bounds"));
    }
    let mut table = vec![0u8; hdr.ranges as usize * RANGE_ENTRY_BYTES];
    rd.read_exact(&mut table).await?;
    let ranges = decode_ranges(&table).map_err(std::io::Error::other)?;
    let total = ranges.iter().try_fold(0u64, |acc, r| acc.checked_add(r.1));
    if total != Some(hdr.len) {
        return Err(malformed("lengths do not add up to the header's"));
    }
    if hdr.op == DataOp::WriteV
        && hdr.len > shared.cfg.write_drain_bytes_max.max(shared.cfg.slice_bytes)
    {
        return Err(malformed("pack larger than a connection accepts"));
    }
    Ok(ranges)
}

fn range_status(shared: &Shared, addr: u64, len: u64) -> (DataStatus, Option<Region>) {
    if len == 0 {
        return (DataStatus::InvalidArgument, None);
    }
    match remote_region(shared, addr, len) {
        Some(r) => (DataStatus::Ok, Some(r)),
        None => (DataStatus::OutOfRange, None),
    }
}

async fn serve_read_pack(
    rd: &mut PlainStream,
    out: &mut Replies,
    shared: &Shared,
    hdr: &DataHeader,
) -> std::io::Result<()> {
    let ranges = read_table(rd, shared, hdr).await?;
    let mut checked: Vec<(DataStatus, Option<Region>)> =
        ranges.iter().map(|&(a, l)| range_status(shared, a, l)).collect();
    if hdr.op == DataOp::ReadGuardedV {
        // One guard per range; a range its owner no longer vouches for is `Stale`.
        let mut guard = Vec::with_capacity(256);
        for (&(addr, len), c) in ranges.iter().zip(checked.iter_mut()) {
            let mut lb = [0u8; 2];
            rd.read_exact(&mut lb).await?;
            let glen = u16::from_le_bytes(lb) as u32;
            if glen > GUARD_BYTES_MAX {
                return Err(std::io::Error::other(format!("guard of {glen} bytes")));
            }
            guard.resize(glen as usize, 0);
            rd.read_exact(&mut guard).await?;
            if c.0 == DataStatus::Ok && !shared.vouches(addr, len, &guard) {
                *c = (DataStatus::Stale, None);
            }
        }
    }
    let ok_bytes: u64 =
        ranges.iter().zip(&checked).filter(|(_, c)| c.0 == DataStatus::Ok).map(|(r, _)| r.1).sum();
    let mut head =
        DataReply { status: DataStatus::Ok, id: hdr.id, len: ok_bytes }.encode().to_vec();
    head.extend(checked.iter().map(|c| c.0 as u16 as u8));
    out.push(&head).await?;
    for (r, (_, region)) in ranges.iter().zip(checked) {
        if let Some(region) = region {
            out.payload(r.0, r.1, region).await?;
        }
    }
    Ok(())
}

async fn serve_write_pack(
    rd: &mut PlainStream,
    out: &mut Replies,
    shared: &Shared,
    hdr: &DataHeader,
) -> std::io::Result<()> {
    let ranges = read_table(rd, shared, hdr).await?;
    let checked: Vec<(DataStatus, Option<Region>)> =
        ranges.iter().map(|&(a, l)| range_status(shared, a, l)).collect();
    // Runs of accepted ranges are received with one vectored read; refused ones are drained.
    let mut i = 0;
    while i < ranges.len() {
        if checked[i].0 != DataStatus::Ok {
            drain(rd, ranges[i].1, u64::MAX).await?;
            i += 1;
            continue;
        }
        if let Some(region) = checked[i].1.as_ref().filter(|r| r.device.is_some()) {
            receive_device(rd, &mut out.stage, region, ranges[i].0, ranges[i].1).await?;
            i += 1;
            continue;
        }
        let start = i;
        let host = |c: &(DataStatus, Option<Region>)| {
            c.0 == DataStatus::Ok && c.1.as_ref().is_some_and(|r| r.device.is_none())
        };
        while i < ranges.len() && host(&checked[i]) && i - start < IOV_MAX {
            i += 1;
        }
        let mut dsts: Vec<IoSliceMut<'_>> = ranges[start..i]
            .iter()
            // SAFETY: each range lies inside a region registered as remotely writable, held by
            // `checked` until the read finishes. Ranges of one pack may overlap only if the
            // writer asked for it; the bytes then land in order, as sequential writes would.
            .map(|r| {
                IoSliceMut::new(unsafe {
                    std::slice::from_raw_parts_mut(r.0 as *mut u8, r.1 as usize)
                })
            })
            .collect();
        rd.read_exact_vectored(&mut dsts).await?;
    }
    let mut reply = DataReply { status: DataStatus::Ok, id: hdr.id, len: ranges.len() as u64 }
        .encode()
        .to_vec();
    reply.extend(checked.iter().map(|c| c.0 as u16 as u8));
    drop(checked);
    out.push(&reply).await
}

async fn serve_notify(
    rd: &mut PlainStream,
    shared: &Shared,
    hdr: &DataHeader,
    from: &str,
) -> std::io::Result<DataStatus> {
    if hdr.len as usize > shared.cfg.notify_bytes_max {
        drain(rd, hdr.len, shared.cfg.write_drain_bytes_max).await?;
        return Ok(DataStatus::TooLarge);
    }
    let mut msg = vec![0u8; hdr.len as usize];
    rd.read_exact(&mut msg).await?;
    Ok(match shared.deliver_notification(from, msg) {
        Ok(()) => DataStatus::Ok,
        Err(_) => DataStatus::Busy,
    })
}

/// Two host buffers of [`DEVICE_CHUNK_BYTES`] through which one connection moves device
/// memory: one on the wire while the other is copied to or from the device.
#[derive(Default)]
struct Staging {
    bufs: Vec<Piece>,
}

/// One staging buffer: page-aligned private memory, page-locked by the device that first used
/// it when it agrees (the copy engine then moves it at full speed), unpinned when dropped.
struct Piece {
    mem: Buffer,
    pinned: Option<Arc<dyn DeviceMemory>>,
}

impl Piece {
    fn slice(&self, n: usize) -> &[u8] {
        // SAFETY: `mem` is this piece's own mapping of DEVICE_CHUNK_BYTES; one user at a time
        // (the piece moves between the tasks that fill and send it).
        unsafe { &self.mem.as_slice()[..n] }
    }

    fn slice_mut(&mut self, n: usize) -> &mut [u8] {
        // SAFETY: as above; `&mut self` makes the access exclusive.
        unsafe { &mut self.mem.as_mut_slice()[..n] }
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        if let Some(dev) = &self.pinned {
            dev.unpin_host(self.mem.addr());
        }
    }
}

impl Staging {
    fn take(&mut self, dev: &Arc<dyn DeviceMemory>) -> std::io::Result<Piece> {
        if let Some(p) = self.bufs.pop() {
            return Ok(p);
        }
        let opts = crate::BufferOptions {
            huge_pages: false,
            populate: true,
            name: "kvfs-device-staging".into(),
            shareable: false,
        };
        let mem = Buffer::new(DEVICE_CHUNK_BYTES, &opts).map_err(std::io::Error::other)?;
        let pinned = dev.pin_host(mem.addr(), mem.len() as u64).then(|| dev.clone());
        Ok(Piece { mem, pinned })
    }

    fn give(&mut self, buf: Piece) {
        if self.bufs.len() < 2 {
            self.bufs.push(buf);
        }
    }
}

fn device_error(e: String) -> std::io::Error {
    std::io::Error::other(format!("device memory: {e}"))
}

/// Copies piece `[offset, offset+n)` of `dev` into `buf` on a blocking thread.
async fn device_read(
    dev: Arc<dyn DeviceMemory>,
    mut buf: Piece,
    offset: u64,
    n: usize,
) -> std::io::Result<Piece> {
    tokio::task::spawn_blocking(move || dev.read(offset, buf.slice_mut(n)).map(|()| buf))
        .await
        .map_err(std::io::Error::other)?
        .map_err(device_error)
}

/// Sends `len` bytes of device memory from `offset`: piece k+1 is copied out of the device
/// while piece k is written to the socket. An error closes the connection (the reply header
/// already promised the bytes).
async fn send_device(
    wr: &mut PlainStream,
    stage: &mut Staging,
    dev: Arc<dyn DeviceMemory>,
    offset: u64,
    len: u64,
) -> std::io::Result<()> {
    let piece = |at: u64| (DEVICE_CHUNK_BYTES as u64).min(len - at) as usize;
    let mut cur = device_read(dev.clone(), stage.take(&dev)?, offset, piece(0)).await?;
    let mut at = 0u64;
    loop {
        let n = piece(at);
        let next_at = at + n as u64;
        let next = match next_at < len {
            true => {
                let (d, buf) = (dev.clone(), stage.take(&dev)?);
                Some(tokio::spawn(device_read(d, buf, offset + next_at, piece(next_at))))
            }
            false => None,
        };
        let sent = wr.write_all(cur.slice(n)).await;
        let next = match next {
            Some(h) => Some(h.await.map_err(std::io::Error::other)?),
            None => None,
        };
        sent?;
        match next {
            Some(buf) => stage.give(std::mem::replace(&mut cur, buf?)),
            None => {
                stage.give(cur);
                return Ok(());
            }
        }
        at = next_at;
    }
}

/// Receives `len` bytes into device memory at `addr` (inside `region`): piece k is copied into
/// the device on a blocking thread while piece k+1 arrives.
async fn receive_device(
    rd: &mut PlainStream,
    stage: &mut Staging,
    region: &Region,
    addr: u64,
    len: u64,
) -> std::io::Result<()> {
    let Some(dev) = region.device.clone() else {
        return Err(std::io::Error::other("receive_device on host memory"));
    };
    let offset = addr - region.addr;
    let mut pending: Option<tokio::task::JoinHandle<std::io::Result<Piece>>> = None;
    let mut at = 0u64;
    let mut failed = None;
    while at < len {
        let n = (DEVICE_CHUNK_BYTES as u64).min(len - at) as usize;
        let mut buf = stage.take(&dev)?;
        rd.read_exact(buf.slice_mut(n)).await?;
        if let Some(h) = pending.take() {
            match h.await.map_err(std::io::Error::other)? {
                Ok(b) => stage.give(b),
                Err(e) => failed = Some(e),
            }
        }
        let (dev, o) = (dev.clone(), offset + at);
        pending = Some(tokio::task::spawn_blocking(move || {
            dev.write(o, buf.slice(n)).map(|()| buf).map_err(device_error)
        }));
        at += n as u64;
    }
    if let Some(h) = pending {
        match h.await.map_err(std::io::Error::other)? {
            Ok(b) => stage.give(b),
            Err(e) => failed = Some(e),
        }
    }
    // The payload was read whole, so the stream is still in step; a device failure still
    // closes the connection, since the write cannot be answered as done.
    failed.map_or(Ok(()), Err)
}

/// Reads and discards `len` bytes, or fails when that is more than `max` (the stream is then
/// closed by the caller: resynchronising would cost more than reconnecting).
async fn drain(rd: &mut PlainStream, len: u64, max: u64) -> std::io::Result<()> {
    if len > max {
        return Err(std::io::Error::other(format!(
            "refused payload of {len} bytes is too large to drain"
        )));
    }
    let mut sink = vec![0u8; (64 << 10).min(len as usize).max(1)];
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(sink.len());
        rd.read_exact(&mut sink[..n]).await?;
        left -= n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `ReadGuardedV` request is its header (ranges = the range count, len = their sum), the
    /// range table, then one u16-prefixed guard per range in table order: the layout
    /// `serve_read_pack` reads.
    #[test]
    fn guarded_packs_carry_the_range_table_then_one_guard_per_range() {
        let ranges = [
            Range { remote: 0x1000, local: 0x9000, len: 4096 },
            Range { remote: 0x8000, local: 0xa000, len: 100 },
            Range { remote: 0x20000, local: 0xb000, len: 65536 },
        ];
        let guards: [&[u8]; 3] = [b"v1key-a", b"", b"v9key-c"];
        let table = encode_guards(guards.iter().copied()).unwrap();
        let head = encode_head(DataOp::ReadGuardedV, 7, &ranges, &table, None);
        let hb: [u8; DataHeader::SIZE] = head[..DataHeader::SIZE].try_into().unwrap();
        let hdr = DataHeader::decode(&hb).unwrap();
        assert_eq!((hdr.op, hdr.id, hdr.ranges, hdr.len), (DataOp::ReadGuardedV, 7, 3, 69732));
        let rest = &head[DataHeader::SIZE..];
        let (t, mut g) = rest.split_at(3 * RANGE_ENTRY_BYTES);
        let want: Vec<(u64, u64)> = ranges.iter().map(|r| (r.remote, r.len)).collect();
        assert_eq!(decode_ranges(t).unwrap(), want);
        for expect in guards {
            let n = u16::from_le_bytes([g[0], g[1]]) as usize;
            assert_eq!(&g[2..2 + n], expect);
            g = &g[2 + n..];
        }
        assert!(g.is_empty(), "nothing after the last guard");
    }
}
