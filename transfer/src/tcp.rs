//! The tcp transport: several connections per peer, large requests striped across them, bytes
//! received straight into the destination memory.
//!
//! Mechanism. Each peer has `tcp_conns_per_peer` connection slots. A request is cut into slices
//! of `slice_bytes`; every slice becomes a [`Job`] queued on one connection (round robin). Each
//! connection has three tasks:
//! - the writer takes jobs from a bounded queue, records them as pending (in order) and writes
//!   the 40-byte header, followed by the payload for writes, straight from the source memory;
//! - the reader reads 24-byte replies in order, matches each to the oldest pending job, and
//!   for reads receives the payload straight into the destination memory (no staging copy);
//! - the watchdog resets the connection when the oldest pending job passes its deadline, which
//!   turns a silent peer into `Timeout` errors and unblocks both other tasks.
//!
//! Failure policy. A broken connection fails every job on it with a retryable error; the slice
//! is retried on the next connection (reconnecting lazily, with a fresh handshake) up to
//! `retries_max` times, never past the item's deadline. A reconnect that finds a different
//! engine instance at the address fails with `PeerGone`: a restarted peer is a new segment and
//! its memory layout is not the one the caller addressed. Because connections are re-made on
//! demand and there is no idle timer anywhere, the first transfer after a long idle gap either
//! finds its connection alive or transparently replaces it.
//!
//! Invariants: replies arrive in request order per connection (the acceptor serves each
//! connection sequentially); a job's memory stays valid until its completion is sent (owned
//! buffers are held by an `Arc` in the job; raw registrations are the caller's promise).
//!
//! Not handled: encryption and authentication (peers are trusted cluster members on a private
//! network, as in the reference system).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvfs_proto::transfer::{
    DataHeader, DataOp, DataReply, DataStatus, HANDSHAKE_FRAME_MAX, Hello, TE_PROTOCOL_VERSION,
    Welcome,
};
use kvfs_proto::{read_msg, write_msg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::engine::Shared;
use crate::memory::Buffer;
use crate::{Error, ErrorKind, Result};

/// Keeps the memory of a job alive until it completes (the fields are never read: holding them
/// is the point).
#[derive(Clone)]
#[allow(dead_code)]
pub(crate) enum Hold {
    None,
    Buffer(Arc<Buffer>),
    Bytes(Arc<Vec<u8>>),
}

/// One slice of a request, queued on one connection.
pub(crate) struct Job {
    pub op: DataOp,
    pub remote: u64,
    pub local: u64,
    pub len: u64,
    pub deadline: Instant,
    pub hold: Hold,
    pub done: oneshot::Sender<Result<()>>,
}

struct Pending {
    id: u64,
    op: DataOp,
    local: u64,
    len: u64,
    deadline: Instant,
    _hold: Hold,
    done: oneshot::Sender<Result<()>>,
}

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
}

/// Connects and performs the handshake, within the connect timeout.
async fn connect(addr: SocketAddr, shared: &Shared) -> Result<(TcpStream, Welcome)> {
    let cfg = &shared.cfg;
    let fut = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| Error::io("tcp connect", e))?;
        tune_socket(&stream, cfg.socket_buffer_bytes);
        let mut stream = stream;
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
            .map_err(|e| Error::new(ErrorKind::PeerGone, "tcp handshake", e.to_string()))?
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

pub(crate) fn tune_socket(stream: &TcpStream, buffer_bytes: usize) {
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let set = |level, name, value: libc::c_int| {
        // SAFETY: setsockopt with a pointer to a local c_int of the right size.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    };
    // Keepalive finds peers that vanished while a connection sat idle.
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
    if buffer_bytes > 0 {
        let v = buffer_bytes.min(i32::MAX as usize) as libc::c_int;
        set(libc::SOL_SOCKET, libc::SO_SNDBUF, v);
        set(libc::SOL_SOCKET, libc::SO_RCVBUF, v);
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

async fn writer(wr: OwnedWriteHalf, mut rx: mpsc::Receiver<Job>, st: Arc<ConnState>) {
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let mut next_id: u64 = 1;
    while let Some(job) = rx.recv().await {
        if st.dead.load(Ordering::Acquire) {
            let _ = job.done.send(Err(st.death()));
            rx.close();
            continue;
        }
        let id = next_id;
        next_id += 1;
        let hdr = DataHeader { op: job.op, id, addr: job.remote, len: job.len }.encode();
        let (local, len, op, deadline) = (job.local, job.len, job.op, job.deadline);
        st.pending.lock().unwrap_or_else(|e| e.into_inner()).push_back(Pending {
            id,
            op: job.op,
            local: job.local,
            len: job.len,
            deadline: job.deadline,
            _hold: job.hold.clone(),
            done: job.done,
        });
        let carries_payload = matches!(op, DataOp::Write | DataOp::Notify);
        let res = tokio::time::timeout_at(deadline, async {
            wr.write_all(&hdr).await?;
            if carries_payload {
                // SAFETY: the job's memory is registered (and held) until its completion is
                // sent, which happens only after this write finishes or the connection dies.
                let src = unsafe { std::slice::from_raw_parts(local as *const u8, len as usize) };
                wr.write_all(src).await?;
            }
            if rx.is_empty() {
                wr.flush().await?;
            }
            Ok::<_, std::io::Error>(())
        })
        .await;
        drop(job.hold);
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => st.kill(Error::io("tcp send", e)),
            Err(_) => st.kill(Error::new(ErrorKind::Timeout, "tcp send", "peer stopped reading")),
        }
    }
    let _ = wr.shutdown().await;
}

async fn reader(mut rd: OwnedReadHalf, st: Arc<ConnState>) {
    let mut hb = [0u8; DataReply::SIZE];
    loop {
        if let Err(e) = rd.read_exact(&mut hb).await {
            st.kill(Error::io("tcp receive", e));
            return;
        }
        let reply = match DataReply::decode(&hb) {
            Ok(r) => r,
            Err(e) => return st.kill(Error::new(ErrorKind::Io, "tcp receive", e.to_string())),
        };
        let Some(p) = st.pending.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else {
            return st.kill(Error::new(ErrorKind::Io, "tcp receive", "reply with no request"));
        };
        if p.id != reply.id {
            let msg = format!("reply {} for request {}", reply.id, p.id);
            st.kill(Error::new(ErrorKind::Io, "tcp receive", msg.clone()));
            let _ = p.done.send(Err(Error::new(ErrorKind::Io, "tcp receive", msg)));
            return;
        }
        let result = match reply.status {
            DataStatus::Ok if p.op == DataOp::Read => {
                if reply.len != p.len {
                    let msg = format!("read reply of {} bytes for {}", reply.len, p.len);
                    let _ = p.done.send(Err(Error::new(ErrorKind::Io, "tcp receive", msg.clone())));
                    return st.kill(Error::new(ErrorKind::Io, "tcp receive", msg));
                }
                // SAFETY: the destination is registered and held until completion is sent.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(p.local as *mut u8, p.len as usize) };
                if let Err(e) = rd.read_exact(dst).await {
                    let err = Error::io("tcp receive", e);
                    let _ = p.done.send(Err(err.clone()));
                    return st.kill(err);
                }
                Ok(())
            }
            DataStatus::Ok => Ok(()),
            status => Err(status_error(status, p.op)),
        };
        let _ = p.done.send(result);
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

fn status_error(status: DataStatus, op: DataOp) -> Error {
    let what = match op {
        DataOp::Read => "remote read",
        DataOp::Write => "remote write",
        DataOp::Notify => "notify",
        DataOp::Ping => "ping",
    };
    let kind = match status {
        DataStatus::OutOfRange => ErrorKind::OutOfRange,
        DataStatus::Busy => ErrorKind::Busy,
        DataStatus::TooLarge | DataStatus::InvalidArgument | DataStatus::Ok => {
            ErrorKind::InvalidArgument
        }
    };
    Error::new(kind, what, format!("peer answered {status:?}"))
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
        let conn = start_conn(stream, &self.shared)?;
        *guard = Some(conn.clone());
        Ok(conn)
    }

    /// Runs one request, striped over the connections, retrying broken slices.
    pub async fn request(
        &self,
        op: DataOp,
        remote: u64,
        local: u64,
        len: u64,
        hold: Hold,
        deadline: Instant,
    ) -> Result<()> {
        let _busy = BusyGuard::new(&self.busy);
        let slice = self.slice_for(len);
        if len <= slice {
            return self.slice(op, remote, local, len, &hold, deadline).await;
        }
        let mut slices = Vec::with_capacity(len.div_ceil(slice) as usize);
        let mut off = 0;
        while off < len {
            let n = slice.min(len - off);
            slices.push(self.slice(op, remote + off, local + off, n, &hold, deadline));
            off += n;
        }
        let results = futures_util::future::join_all(slices).await;
        results.into_iter().find(|r| r.is_err()).unwrap_or(Ok(()))
    }

    /// Slice size for a request of `len` bytes: `slice_bytes`, except that a request alone on an
    /// otherwise idle peer is striped over every connection (slices of at least
    /// `STRIPE_SLICE_MIN`), so one mid-sized transfer still uses them all; when other requests
    /// are in flight the connections are busy anyway and bigger slices cost less per byte.
    fn slice_for(&self, len: u64) -> u64 {
        if self.busy.load(Ordering::Relaxed) > 1 {
            return self.slice_bytes;
        }
        let conns = self.slots.len() as u64;
        len.div_ceil(conns)
            .next_multiple_of(4096)
            .clamp(STRIPE_SLICE_MIN, self.slice_bytes.max(STRIPE_SLICE_MIN))
    }

    async fn slice(
        &self,
        op: DataOp,
        remote: u64,
        local: u64,
        len: u64,
        hold: &Hold,
        deadline: Instant,
    ) -> Result<()> {
        let mut attempt = 0;
        loop {
            let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
            let res = self.try_slice(slot, op, remote, local, len, hold, deadline).await;
            match res {
                Err(e)
                    if e.retryable()
                        && e.kind() != ErrorKind::Busy
                        && attempt < self.shared.cfg.retries_max
                        && Instant::now() < deadline =>
                {
                    attempt += 1;
                    tracing::debug!(peer = %self.addr, attempt, error = %e, "retrying slice");
                }
                other => return other,
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn try_slice(
        &self,
        slot: usize,
        op: DataOp,
        remote: u64,
        local: u64,
        len: u64,
        hold: &Hold,
        deadline: Instant,
    ) -> Result<()> {
        let conn = self.conn(slot, deadline).await?;
        let (done, wait) = oneshot::channel();
        let job = Job { op, remote, local, len, deadline, hold: hold.clone(), done };
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
        let local = msg.as_ptr() as u64;
        let len = msg.len() as u64;
        self.slice(DataOp::Notify, 0, local, len, &Hold::Bytes(msg), deadline).await
    }

    /// Round trip with no payload: is the peer alive and answering?
    pub async fn ping(&self, deadline: Instant) -> Result<()> {
        self.slice(DataOp::Ping, 0, 0, 0, &Hold::None, deadline).await
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
    tune_socket(&stream, shared.cfg.socket_buffer_bytes);
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
    };
    if write_msg(&mut stream, &welcome).await.is_err() || refused.is_some() {
        return;
    }
    if let Err(e) = serve_requests(stream, &shared, &hello.name).await {
        tracing::debug!(peer = %hello.name, error = %e, "tcp serving connection ended");
    }
}

async fn serve_requests(stream: TcpStream, shared: &Shared, from: &str) -> std::io::Result<()> {
    let (mut rd, wr) = stream.into_split();
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let mut hb = [0u8; DataHeader::SIZE];
    loop {
        // Flush replies before blocking on the next request.
        if rd.peek(&mut [0u8; 1]).now_or_never_empty() {
            wr.flush().await?;
        }
        match rd.read_exact(&mut hb).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                wr.flush().await?;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        let hdr = DataHeader::decode(&hb).map_err(std::io::Error::other)?;
        let status = match hdr.op {
            DataOp::Write => serve_write(&mut rd, shared, &hdr).await?,
            DataOp::Read => {
                serve_read(&mut wr, shared, &hdr).await?;
                continue;
            }
            DataOp::Notify => serve_notify(&mut rd, shared, &hdr, from).await?,
            DataOp::Ping => DataStatus::Ok,
        };
        wr.write_all(&DataReply { status, id: hdr.id, len: 0 }.encode()).await?;
    }
}

async fn serve_write(
    rd: &mut OwnedReadHalf,
    shared: &Shared,
    hdr: &DataHeader,
) -> std::io::Result<DataStatus> {
    match shared.registry.find(hdr.addr, hdr.len).filter(|r| r.remote) {
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

async fn serve_read(
    wr: &mut BufWriter<OwnedWriteHalf>,
    shared: &Shared,
    hdr: &DataHeader,
) -> std::io::Result<()> {
    match shared.registry.find(hdr.addr, hdr.len).filter(|r| r.remote) {
        Some(region) => {
            wr.write_all(&DataReply { status: DataStatus::Ok, id: hdr.id, len: hdr.len }.encode())
                .await?;
            // SAFETY: the range lies inside a region registered as remotely readable; held.
            let src =
                unsafe { std::slice::from_raw_parts(hdr.addr as *const u8, hdr.len as usize) };
            wr.write_all(src).await?;
            drop(region);
        }
        None => {
            let reply = DataReply { status: DataStatus::OutOfRange, id: hdr.id, len: 0 };
            wr.write_all(&reply.encode()).await?;
        }
    }
    Ok(())
}

async fn serve_notify(
    rd: &mut OwnedReadHalf,
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

/// Reads and discards `len` bytes, or fails when that is more than `max` (the stream is then
/// closed by the caller: resynchronising would cost more than reconnecting).
async fn drain(rd: &mut OwnedReadHalf, len: u64, max: u64) -> std::io::Result<()> {
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

/// Whether a non-blocking peek found nothing to read yet.
trait PeekEmpty {
    fn now_or_never_empty(self) -> bool;
}

impl<F: std::future::Future<Output = std::io::Result<usize>>> PeekEmpty for F {
    fn now_or_never_empty(self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut fut = std::pin::pin!(self);
        !matches!(fut.as_mut().poll(&mut cx), std::task::Poll::Ready(Ok(n)) if n > 0)
    }
}
