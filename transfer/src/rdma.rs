//! The rdma transport (cargo feature `rdma`): one-sided RDMA READ/WRITE over one RC queue pair
//! per opened segment, on the `kvfs-rdma` verbs layer.
//!
//! Mechanism.
//! - **Device.** `Engine::start` opens one [`Nic`] (`RdmaContext`: device, port, GID, PD) when
//!   `transports.rdma` is set. No device, or no rdma-core on the machine, is the normal case on
//!   most hosts: it is logged once at info level and the engine runs without rdma.
//! - **Registration.** Every region registered with the engine (owned buffers and raw memory,
//!   remote or local-only) is registered with the NIC too; the `MemoryRegion` lives in the
//!   registry entry, so unregistering deregisters it once no running transfer holds the entry.
//!   A registration the NIC refuses (e.g. `RLIMIT_MEMLOCK`) is logged; that region then moves
//!   over the other transports.
//! - **Handshake.** The first tcp `Welcome` says whether the peer serves rdma. If both do, the
//!   opener makes an endpoint (QP in INIT) and opens an *rdma control connection*: a tcp
//!   connection whose `Hello` carries the endpoint's 40-byte `EndpointInfo`. The acceptor makes
//!   its own endpoint, connects it, and answers with its `EndpointInfo` and its table of remote
//!   regions `(addr, len, rkey)` (chunked; `RdmaRequest::Regions` fetches more, and refreshes
//!   the table later when a request names an address the table lacks). The opener connects its
//!   endpoint. The control connection stays open as long as the pair: when either side closes
//!   it (exit, crash, drop), the other tears its endpoint down. Only the opener posts ops; the
//!   acceptor's endpoint is a passive responder that never needs polling.
//! - **Data path.** A [`Link`] is one connected endpoint owned by a worker thread (the verbs
//!   layer's `submit`/`poll` take `&mut`), fed by a bounded channel of ops
//!   (`rdma_queue_depth_max`); the worker submits them, polls the completion queue in slices of
//!   `POLL_SLICE`, and hands each completion to the item waiting for it on a oneshot channel.
//!
//! Policy.
//! - Per request: the remote range must lie inside one region of the peer's table (refreshed
//!   once on a miss; still missing is `OutOfRange` before anything is posted) that has an rkey,
//!   and the local range inside a region with a memory region; otherwise the request goes to
//!   tcp (the engine's fallback order is local, shm, rdma, tcp).
//! - A failed op (`RetryExceeded`, `Flushed`, `Broken`, `RemoteAccess` for a range the table
//!   said was valid, ...) marks its link broken: the endpoint is aborted, every op on it ends,
//!   and each is retried over tcp within its own deadline ("a failed path is retried on another
//!   within a bound"); tcp then gives the definitive answer (e.g. `OutOfRange` if the peer
//!   really unregistered the range, `PeerGone` if it died). The next rdma request builds a new
//!   link (fresh QP pair and region table); a failed build is not retried for `REBUILD_BACKOFF`,
//!   and requests meanwhile use tcp.
//! - A peer that restarted at the same address (new instance) is never connected to: the build
//!   fails with `PeerGone`, as a tcp reconnect does.
//!
//! Invariants.
//! - Every item finishes by its deadline: the waiter gives up at the deadline (`Timeout`), and
//!   the worker aborts the endpoint when any op passes its deadline, so the device stops
//!   touching that op's memory within the flush; the op's registry entry (memory region and
//!   owned buffer) stays held by the worker until the device has reported it.
//! - Memory registered for rdma outlives every op that uses it (see above), and ranges are
//!   checked against the registered regions on both sides before posting; the NIC checks them
//!   again against the keys.
//! - Every wait has a bound: connect and handshake by `connect_timeout_ms` (and the item's
//!   deadline), table fetches by `connect_timeout_ms`, queueing and completion by the item's
//!   deadline, a broken endpoint's flush by the verbs layer's stall check. The only unbounded
//!   waits are idle ones that end when their owner drops: the worker waiting for work, and the
//!   acceptor's control connection waiting for the next table request (tcp keepalive finds a
//!   vanished opener).
//!
//! Limits: per peer, `rdma_queue_depth_max` ops in the worker's queue and as many again
//! submitted to the endpoint (which posts at most its send-queue depth of 1 MiB slices); more
//! wait, then fail with `Busy` at their deadline. A new op may wait up to `POLL_SLICE` (1 ms) for
//! the worker while other ops are in flight. One worker thread per opened segment with rdma.
//!
//! Not handled: several NICs or ports (one context per engine), striping one request over
//! several QPs, notifications over rdma (they ride tcp), memory windows or per-region access
//! control (every NIC registration allows remote read and write, including local-only regions;
//! their rkeys are never advertised, and peers are trusted as they are over tcp), GPU memory.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use kvfs_proto::transfer::{
    HANDSHAKE_FRAME_MAX, Hello, RDMA_REGIONS_PER_MESSAGE_MAX, RdmaHello, RdmaRegion, RdmaRegions,
    RdmaRequest, RdmaWelcome, TE_PROTOCOL_VERSION, Welcome,
};
use kvfs_proto::{read_msg, write_msg};
use kvfs_rdma::{
    ContextOptions, Endpoint, EndpointInfo, EndpointOptions, Op, OpKind, Opened, RdmaContext,
    RemoteRegion,
};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::config::EngineConfig;
use crate::engine::{RdmaStatus, Shared, TransferOp, TransferRequest};
use crate::memory::Region;
use crate::tcp::PeerInfo;
use crate::{Error, ErrorKind, Result};

/// A region's registration with the NIC.
pub(crate) type Mr = kvfs_rdma::MemoryRegion;

/// Longest the worker waits for completions before looking at its queue and deadlines again.
const POLL_SLICE: Duration = Duration::from_millis(1);
/// After a failed link build, requests use tcp for this long before rdma is tried again.
const REBUILD_BACKOFF: Duration = Duration::from_millis(500);

/// What the rdma path did with a request.
pub(crate) enum Outcome {
    /// Finished (successfully or not); no other transport should try it.
    Done(Result<()>),
    /// Not carried (no registration, link down, op failed); another transport may try it
    /// within the deadline. The error says why, for when none can.
    Fallback(Error),
}

/// The engine's opened RDMA device and the options of the endpoints made on it.
#[derive(Debug, Clone)]
pub(crate) struct Nic {
    ctx: RdmaContext,
    opts: EndpointOptions,
}

impl Nic {
    /// Opens the device the configuration names (or the first usable one). `Ok(None)` when
    /// rdma is disabled or this machine has none (logged once, at info level); an error only
    /// when a device or GID named in the configuration cannot be used.
    pub fn open(cfg: &EngineConfig) -> Result<Option<Nic>> {
        if !cfg.transports.rdma {
            return Ok(None);
        }
        let copts = ContextOptions {
            device: cfg.rdma_device.clone(),
            port: None,
            gid_index: cfg.rdma_gid_index,
        };
        let ctx = match RdmaContext::open_with(&copts) {
            Ok(Opened::Ready(ctx)) => ctx,
            Ok(Opened::Unavailable(why)) => {
                tracing::info!(reason = %why, "rdma unavailable; peers are reached over shm and tcp");
                return Ok(None);
            }
            Err(e) if cfg.rdma_device.is_some() || cfg.rdma_gid_index.is_some() => {
                return Err(Error::new(ErrorKind::InvalidArgument, "engine start", e.to_string()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "rdma device could not be opened; continuing without");
                return Ok(None);
            }
        };
        let opts =
            EndpointOptions { queued_ops_max: cfg.rdma_queue_depth_max, ..Default::default() };
        tracing::info!(
            device = ctx.device_name(),
            port = ctx.port(),
            gid_index = ctx.gid_index(),
            gid = %std::net::Ipv6Addr::from(ctx.gid()),
            "rdma transport ready"
        );
        Ok(Some(Nic { ctx, opts }))
    }

    pub fn device_name(&self) -> &str {
        self.ctx.device_name()
    }

    /// Registers `[addr, addr+len)` with the NIC; `None` (logged) when the NIC refuses.
    ///
    /// # Safety
    /// The range must be memory this process owns, that stays allocated and in place until the
    /// returned region drops.
    pub unsafe fn register(&self, addr: u64, len: u64) -> Option<Arc<Mr>> {
        let Ok(n) = usize::try_from(len) else { return None };
        // SAFETY: forwarded from this function's contract.
        match unsafe { self.ctx.register(addr as *mut u8, n) } {
            Ok(mr) => Some(Arc::new(mr)),
            Err(e) => {
                tracing::warn!(addr, len, error = %e, "rdma registration refused; region uses tcp");
                None
            }
        }
    }
}

/// Maps a verbs-layer error to the engine's kinds.
fn engine_error(e: &kvfs_rdma::Error) -> Error {
    use kvfs_rdma::ErrorKind as K;
    let kind = match e.kind() {
        K::Timeout => ErrorKind::Timeout,
        K::RetryExceeded | K::Flushed | K::Broken | K::NotConnected => ErrorKind::PeerGone,
        K::RemoteAccess => ErrorKind::OutOfRange,
        K::QueueFull => ErrorKind::Busy,
        K::InvalidArgument | K::Malformed => ErrorKind::InvalidArgument,
        K::Unsupported | K::NotFound => ErrorKind::Unsupported,
        _ => ErrorKind::Io,
    };
    Error::new(kind, "rdma", e.to_string())
}

fn handshake_error(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::PeerGone, "rdma handshake", what.to_string())
}

// ---- acceptor side ----------------------------------------------------------------------------

/// Serves an rdma control connection (its `Hello` is read): connects an endpoint to the
/// opener's, answers with it and the region table, then serves table requests until the opener
/// closes the connection, and destroys the endpoint.
pub(crate) async fn serve_control(mut stream: TcpStream, shared: Arc<Shared>, hello: Hello) {
    let (Some(nic), Some(rdma)) = (shared.rdma.clone(), hello.rdma) else { return };
    let accepted = EndpointInfo::from_bytes(&rdma.endpoint).and_then(|remote| {
        let mut ep = Endpoint::new(&nic.ctx, &nic.opts)?;
        ep.connect(&remote)?;
        Ok(ep)
    });
    let (ep, rdma_endpoint, refused) = match accepted {
        Ok(ep) => {
            let endpoint = ep.local_info().to_bytes().to_vec();
            let regions = region_chunk(&shared, 0);
            (Some(ep), Some(RdmaWelcome { endpoint, regions }), None)
        }
        Err(e) => {
            tracing::warn!(peer = %hello.name, error = %e, "rdma endpoint for peer failed");
            (None, None, Some(format!("rdma endpoint: {e}")))
        }
    };
    let welcome = Welcome {
        version: TE_PROTOCOL_VERSION,
        name: shared.name.clone(),
        host_id: shared.host_id.clone(),
        instance: shared.instance,
        shm_socket: shared.shm_socket.clone(),
        refused,
        rdma: true,
        rdma_endpoint,

        first_buffer_addr: shared.registry.first_remote_addr(),
    };
    let timeout = shared.cfg.connect_timeout();
    let sent = tokio::time::timeout(timeout, write_msg(&mut stream, &welcome)).await;
    let Some(ep) = ep else { return };
    if !matches!(sent, Ok(Ok(()))) {
        return;
    }
    tracing::debug!(peer = %hello.name, qpn = ep.local_info().qpn, "rdma endpoint for peer up");
    // Idle until the opener asks or leaves (keepalive finds a vanished one); a closed or
    // garbled connection ends the pair.
    while let Ok(Some(RdmaRequest::Regions { start })) =
        read_msg::<_, RdmaRequest>(&mut stream, HANDSHAKE_FRAME_MAX).await
    {
        let chunk = region_chunk(&shared, start as usize);
        let sent = tokio::time::timeout(timeout, write_msg(&mut stream, &chunk)).await;
        if !matches!(sent, Ok(Ok(()))) {
            break;
        }
    }
    tracing::debug!(peer = %hello.name, qpn = ep.local_info().qpn, "rdma endpoint for peer closed");
}

fn region_chunk(shared: &Shared, start: usize) -> RdmaRegions {
    let (chunk, more) = shared.registry.remote_regions(start, RDMA_REGIONS_PER_MESSAGE_MAX);
    let regions = chunk
        .iter()
        .map(|r| RdmaRegion { addr: r.addr, len: r.len, rkey: r.mr.as_ref().map(|m| m.rkey()) })
        .collect();
    RdmaRegions { regions, more }
}

// ---- opener side ------------------------------------------------------------------------------

/// One op for the worker.
struct Cmd {
    op: Op,
    deadline: std::time::Instant,
    /// Keeps the local region (memory region and owned buffer) alive until the device is done.
    hold: Region,
    done: oneshot::Sender<kvfs_rdma::Result<()>>,
}

/// What a link's worker and control task share with the requests using it. Once broken, a
/// link never recovers: the worker exits when idle and the control task closes the control
/// connection (so the peer destroys its endpoint at once, not when the link is replaced).
struct LinkState {
    broken: AtomicBool,
    /// Tells the control task; a watch keeps the value, so no wake-up is lost.
    broken_tx: watch::Sender<bool>,
}

impl LinkState {
    fn new() -> LinkState {
        LinkState { broken: AtomicBool::new(false), broken_tx: watch::Sender::new(false) }
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn fail(&self, peer: &str, why: &str) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.broken_tx.send_replace(true);
            tracing::debug!(peer, why, "rdma link broken; the next request rebuilds it");
        }
    }
}

/// A connected queue pair to the peer: the worker's op queue, the control task's request queue.
/// Dropping the last clone ends both (the worker after its ops are reported).
#[derive(Clone)]
struct Link {
    ops: mpsc::Sender<Cmd>,
    control: mpsc::Sender<oneshot::Sender<Result<Vec<RdmaRegion>>>>,
    state: Arc<LinkState>,
}

#[derive(Default)]
struct Slot {
    link: Option<Link>,
    retry_at: Option<Instant>,
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    bytes: AtomicU64,
    fallbacks: AtomicU64,
    links_built: AtomicU64,
}

/// The peer's remote regions by start address, as its last table said.
type Table = BTreeMap<u64, RdmaRegion>;

enum Lookup {
    Found(RemoteRegion),
    NoKey,
    Missing,
}

/// The rdma side of one remote segment.
pub(crate) struct RdmaPeer {
    addr: SocketAddr,
    name: String,
    instance: u64,
    shared: Arc<Shared>,
    nic: Nic,
    table: RwLock<Table>,
    /// Bumped on every table replacement, so concurrent misses refresh once.
    table_gen: AtomicU64,
    refresh: tokio::sync::Mutex<()>,
    slot: tokio::sync::Mutex<Slot>,
    /// The current link's state, for status without taking `slot`.
    live: Mutex<Option<Arc<LinkState>>>,
    counters: Counters,
}

impl RdmaPeer {
    /// The rdma side of a segment just opened over tcp, with its first link up; `None` when
    /// either side lacks rdma or the first link cannot be made (logged: the segment uses tcp).
    pub async fn open(shared: &Arc<Shared>, addr: SocketAddr, info: &PeerInfo) -> Option<RdmaPeer> {
        let nic = shared.rdma.clone()?;
        if !info.rdma {
            tracing::debug!(segment = %info.name, "peer has no rdma; using tcp");
            return None;
        }
        let peer = RdmaPeer {
            addr,
            name: info.name.clone(),
            instance: info.instance,
            shared: shared.clone(),
            nic,
            table: RwLock::new(Table::new()),
            table_gen: AtomicU64::new(0),
            refresh: tokio::sync::Mutex::new(()),
            slot: tokio::sync::Mutex::new(Slot::default()),
            live: Mutex::new(None),
            counters: Counters::default(),
        };
        let deadline = Instant::now() + shared.cfg.connect_timeout();
        match peer.link(deadline).await {
            Ok(_) => Some(peer),
            Err(e) => {
                tracing::warn!(segment = %info.name, error = %e, "rdma to peer failed; using tcp");
                None
            }
        }
    }

    /// Whether a request for the range would be tried over rdma (its table has it, with a key).
    pub fn covers(&self, remote: u64, len: u64) -> bool {
        matches!(self.lookup(remote, len), Lookup::Found(_))
    }

    pub fn status(&self) -> RdmaStatus {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let c = &self.counters;
        RdmaStatus {
            connected: live.as_ref().is_some_and(|s| !s.is_broken()),
            peer_regions: self.table.read().unwrap_or_else(|e| e.into_inner()).len(),
            ops: c.ops.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            links_built: c.links_built.load(Ordering::Relaxed),
        }
    }

    /// Runs one request over rdma, or says why another transport should carry it.
    pub async fn request(
        &self,
        req: &TransferRequest,
        local: &Region,
        deadline: Instant,
    ) -> Outcome {
        let out = self.try_request(req, local, deadline).await;
        if let Outcome::Fallback(e) = &out {
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(segment = %self.name, error = %e, "request falls back from rdma");
        }
        out
    }

    async fn try_request(
        &self,
        req: &TransferRequest,
        local: &Region,
        deadline: Instant,
    ) -> Outcome {
        let Some(mr) = &local.mr else {
            return Outcome::Fallback(Error::new(
                ErrorKind::Unsupported,
                "rdma",
                "the local region is not registered with the NIC",
            ));
        };
        let link = match self.link(deadline).await {
            Ok(l) => l,
            Err(e) => return Outcome::Fallback(e),
        };
        let remote = match self.lookup(req.remote_addr, req.len) {
            Lookup::Found(r) => r,
            Lookup::NoKey => return Outcome::Fallback(no_key(req.remote_addr)),
            Lookup::Missing => match self.refresh_table(&link, deadline).await {
                Err(e) => return Outcome::Fallback(e),
                Ok(()) => match self.lookup(req.remote_addr, req.len) {
                    Lookup::Found(r) => r,
                    Lookup::NoKey => return Outcome::Fallback(no_key(req.remote_addr)),
                    Lookup::Missing => return Outcome::Done(Err(out_of_range(req))),
                },
            },
        };
        let slices = mr
            .slice((req.local_addr - local.addr) as usize, req.len as usize)
            .and_then(|l| Ok((l, remote.at(req.remote_addr - remote.addr, req.len)?)));
        let (local_slice, remote_at) = match slices {
            Ok(s) => s,
            Err(e) => return Outcome::Done(Err(engine_error(&e))),
        };
        let kind = match req.op {
            TransferOp::Read => OpKind::Read,
            TransferOp::Write => OpKind::Write,
        };
        let (done, wait) = oneshot::channel();
        let cmd = Cmd {
            op: Op { id: 0, kind, local: local_slice, remote: remote_at },
            deadline: deadline.into_std(),
            hold: local.clone(),
            done,
        };
        match tokio::time::timeout_at(deadline, link.ops.send(cmd)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                link.state.fail(&self.name, "worker gone");
                return Outcome::Fallback(Error::new(ErrorKind::PeerGone, "rdma", "worker gone"));
            }
            Err(_) => {
                let msg = "the rdma queue to the peer stayed full until the deadline";
                return Outcome::Done(Err(Error::new(ErrorKind::Busy, "rdma queue", msg)));
            }
        }
        let result = match tokio::time::timeout_at(deadline, wait).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                link.state.fail(&self.name, "worker dropped an op");
                return Outcome::Fallback(Error::new(ErrorKind::PeerGone, "rdma", "op lost"));
            }
            Err(_) => {
                // The worker aborts the endpoint at the same deadline.
                let msg = format!("no completion from {} before the deadline", self.name);
                return Outcome::Done(Err(Error::new(ErrorKind::Timeout, "rdma transfer", msg)));
            }
        };
        match result {
            Ok(()) => {
                self.counters.ops.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes.fetch_add(req.len, Ordering::Relaxed);
                Outcome::Done(Ok(()))
            }
            Err(e) if e.kind() == kvfs_rdma::ErrorKind::QueueFull => {
                Outcome::Fallback(engine_error(&e))
            }
            Err(e) => {
                link.state.fail(&self.name, "an op failed");
                if Instant::now() >= deadline {
                    let msg = format!("rdma op failed at the deadline: {e}");
                    return Outcome::Done(Err(Error::new(
                        ErrorKind::Timeout,
                        "rdma transfer",
                        msg,
                    )));
                }
                Outcome::Fallback(engine_error(&e))
            }
        }
    }

    fn lookup(&self, addr: u64, len: u64) -> Lookup {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        let Some((_, r)) = table.range(..=addr).next_back() else { return Lookup::Missing };
        let inside = addr.checked_add(len).is_some_and(|end| end <= r.addr.saturating_add(r.len));
        match (inside, r.rkey) {
            (false, _) => Lookup::Missing,
            (true, None) => Lookup::NoKey,
            (true, Some(rkey)) => Lookup::Found(RemoteRegion { addr: r.addr, len: r.len, rkey }),
        }
    }

    fn install_table(&self, regions: Vec<RdmaRegion>) {
        let table: Table = regions.into_iter().map(|r| (r.addr, r)).collect();
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = table;
        self.table_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// Fetches the peer's table again (once for concurrent misses), within the deadline.
    async fn refresh_table(&self, link: &Link, deadline: Instant) -> Result<()> {
        let seen = self.table_gen.load(Ordering::Acquire);
        let timed_out = || Error::new(ErrorKind::Timeout, "rdma table", "deadline passed");
        let _one = tokio::time::timeout_at(deadline, self.refresh.lock())
            .await
            .map_err(|_| timed_out())?;
        if self.table_gen.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        let (tx, rx) = oneshot::channel();
        let gone = || Error::new(ErrorKind::PeerGone, "rdma table", "control connection closed");
        tokio::time::timeout_at(deadline, link.control.send(tx))
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| gone())?;
        let regions = tokio::time::timeout_at(deadline, rx)
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| gone())??;
        self.install_table(regions);
        Ok(())
    }

    /// The current link, or a new one when there is none or it broke (not within
    /// `REBUILD_BACKOFF` of a failed build).
    async fn link(&self, deadline: Instant) -> Result<Link> {
        let timed_out = || Error::new(ErrorKind::Timeout, "rdma connect", "deadline passed");
        let mut slot =
            tokio::time::timeout_at(deadline, self.slot.lock()).await.map_err(|_| timed_out())?;
        if let Some(link) = &slot.link {
            if !link.state.is_broken() {
                return Ok(link.clone());
            }
            // Dropping it lets the worker finish its ops and exit, and closes the control
            // connection, which makes the peer destroy its endpoint.
            slot.link = None;
        }
        if let Some(at) = slot.retry_at
            && Instant::now() < at
        {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "rdma connect",
                format!("a link to {} failed less than {REBUILD_BACKOFF:?} ago", self.name),
            ));
        }
        let bound = deadline.min(Instant::now() + self.shared.cfg.connect_timeout());
        let built = match tokio::time::timeout_at(bound, self.build_link()).await {
            Ok(r) => r,
            Err(_) => Err(timed_out()),
        };
        match built {
            Ok(link) => {
                slot.link = Some(link.clone());
                slot.retry_at = None;
                *self.live.lock().unwrap_or_else(|e| e.into_inner()) = Some(link.state.clone());
                self.counters.links_built.fetch_add(1, Ordering::Relaxed);
                Ok(link)
            }
            Err(e) => {
                slot.retry_at = Some(Instant::now() + REBUILD_BACKOFF);
                Err(e)
            }
        }
    }

    /// Makes a QP pair with the peer over a new control connection, fetches the table, and
    /// starts the worker and the control task.
    async fn build_link(&self) -> Result<Link> {
        let mut ep = Endpoint::new(&self.nic.ctx, &self.nic.opts).map_err(|e| engine_error(&e))?;
        let stream =
            TcpStream::connect(self.addr).await.map_err(|e| Error::io("rdma connect", e))?;
        kvfs_proto::sock::tune(&stream, 0);
        let mut stream = stream;
        let timeout = self.shared.cfg.connect_timeout();
        tokio::time::timeout(
            timeout,
            crate::tcp::prove(&mut stream, &self.shared, "rdma handshake"),
        )
        .await
        .map_err(|_| {
            Error::new(ErrorKind::Timeout, "rdma handshake", "no secret handshake in time")
        })??;
        let hello = Hello {
            version: TE_PROTOCOL_VERSION,
            name: self.shared.name.clone(),
            host_id: self.shared.host_id.clone(),
            rdma: Some(RdmaHello { endpoint: ep.local_info().to_bytes().to_vec() }),
        };
        write_msg(&mut stream, &hello).await.map_err(handshake_error)?;
        let welcome: Welcome = read_msg(&mut stream, HANDSHAKE_FRAME_MAX)
            .await
            .map_err(handshake_error)?
            .ok_or_else(|| handshake_error("closed"))?;
        if let Some(why) = welcome.refused {
            return Err(Error::new(ErrorKind::Refused, "rdma handshake", why));
        }
        if welcome.instance != self.instance {
            return Err(Error::new(
                ErrorKind::PeerGone,
                "rdma handshake",
                format!("{} restarted: it is a new segment instance", self.addr),
            ));
        }
        let theirs = welcome.rdma_endpoint.ok_or_else(|| handshake_error("no rdma endpoint"))?;
        let remote = EndpointInfo::from_bytes(&theirs.endpoint).map_err(|e| engine_error(&e))?;
        ep.connect(&remote).map_err(|e| engine_error(&e))?;
        let mut regions = theirs.regions.regions;
        if theirs.regions.more {
            fetch_rest(&mut stream, &mut regions).await?;
        }
        self.install_table(regions);

        let state = Arc::new(LinkState::new());
        let (ops_tx, ops_rx) = mpsc::channel(self.shared.cfg.rdma_queue_depth_max);
        let (control_tx, control_rx) = mpsc::channel(4);
        tracing::debug!(
            segment = %self.name,
            qpn = ep.local_info().qpn,
            remote_qpn = remote.qpn,
            mtu = ep.path_mtu().map_or(0, |m| m.bytes()),
            regions = self.table.read().unwrap_or_else(|e| e.into_inner()).len(),
            "rdma link up"
        );
        let worker = Worker { ep, rx: ops_rx, state: state.clone(), peer: self.name.clone() };
        std::thread::Builder::new()
            .name(format!("kvfs-rdma {}", self.name))
            .spawn(move || worker.run())
            .map_err(|e| Error::io("rdma worker", e))?;
        let timeout = self.shared.cfg.connect_timeout();
        tokio::spawn(control_task(stream, control_rx, state.clone(), self.name.clone(), timeout));
        Ok(Link { ops: ops_tx, control: control_tx, state })
    }
}

fn no_key(addr: u64) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "rdma",
        format!("the peer's region at {addr:#x} is not registered with its NIC"),
    )
}

fn out_of_range(req: &TransferRequest) -> Error {
    Error::new(
        ErrorKind::OutOfRange,
        "rdma transfer",
        format!(
            "remote range {:#x}+{} is not inside one region the peer registered as remotely \
             accessible",
            req.remote_addr, req.len
        ),
    )
}

/// Fetches the table chunks after `regions` from an rdma control connection.
async fn fetch_rest(stream: &mut TcpStream, regions: &mut Vec<RdmaRegion>) -> Result<()> {
    loop {
        let start = u32::try_from(regions.len())
            .map_err(|_| handshake_error("peer region table larger than 2^32 entries"))?;
        write_msg(stream, &RdmaRequest::Regions { start }).await.map_err(handshake_error)?;
        let chunk: RdmaRegions = read_msg(stream, HANDSHAKE_FRAME_MAX)
            .await
            .map_err(handshake_error)?
            .ok_or_else(|| handshake_error("closed"))?;
        let got = chunk.regions.len();
        regions.extend(chunk.regions);
        if !chunk.more || got == 0 {
            return Ok(());
        }
    }
}

/// Owns the opener's end of an rdma control connection: serves table refreshes, and breaks the
/// link when the peer closes it (the acceptor never speaks first, so any byte or EOF while idle
/// means it is gone). Ends, closing the connection, when the link breaks or is dropped.
async fn control_task(
    mut stream: TcpStream,
    mut reqs: mpsc::Receiver<oneshot::Sender<Result<Vec<RdmaRegion>>>>,
    state: Arc<LinkState>,
    peer: String,
    timeout: Duration,
) {
    let mut probe = [0u8; 1];
    // The value only ever goes from false to true: any change means broken. Subscribing marks
    // the current value seen, so check it once after subscribing.
    let mut broken = state.broken_tx.subscribe();
    if state.is_broken() {
        return;
    }
    loop {
        tokio::select! {
            _ = broken.changed() => return,
            req = reqs.recv() => {
                let Some(reply) = req else { return };
                let mut regions = Vec::new();
                let fetched = tokio::time::timeout(timeout, fetch_rest(&mut stream, &mut regions))
                    .await
                    .unwrap_or_else(|_| Err(handshake_error("table fetch timed out")));
                let failed = fetched.is_err();
                let _ = reply.send(fetched.map(|()| regions));
                if failed {
                    state.fail(&peer, "table fetch failed");
                    return;
                }
            }
            _ = stream.read(&mut probe) => {
                state.fail(&peer, "control connection closed by the peer");
                return;
            }
        }
    }
}

/// The thread that owns one link's endpoint.
struct Worker {
    ep: Endpoint,
    rx: mpsc::Receiver<Cmd>,
    state: Arc<LinkState>,
    peer: String,
}

struct Pending {
    deadline: std::time::Instant,
    _hold: Region,
    done: oneshot::Sender<kvfs_rdma::Result<()>>,
}

impl Worker {
    /// Submits queued ops, polls completions and enforces deadlines until the link is dropped
    /// and every op it took has been reported.
    fn run(mut self) {
        let ops_max = self.ep.options().queued_ops_max;
        let mut pending: HashMap<u64, Pending> = HashMap::new();
        let mut next_id: u64 = 1;
        let mut out = Vec::new();
        let mut closed = false;
        let mut aborted = false;
        loop {
            while !closed && self.ep.outstanding() < ops_max {
                match self.rx.try_recv() {
                    Ok(cmd) => self.submit(cmd, &mut next_id, &mut pending),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => closed = true,
                }
            }
            if self.ep.outstanding() == 0 {
                fail_all(&mut pending, "endpoint reported no completion");
                if closed {
                    break;
                }
                if self.state.is_broken() {
                    // Requests that still hold this link find the queue closed and use tcp.
                    break;
                }
                // Idle: wait for work, or for the link to be dropped.
                match self.rx.blocking_recv() {
                    Some(cmd) => self.submit(cmd, &mut next_id, &mut pending),
                    None => break,
                }
                continue;
            }
            if !aborted {
                let now = std::time::Instant::now();
                let late = pending.values().any(|p| p.deadline <= now);
                if late || self.state.is_broken() {
                    let why = if late { "an op passed its deadline" } else { "link broken" };
                    self.state.fail(&self.peer, why);
                    self.ep.abort();
                    aborted = true;
                }
            }
            match self.ep.poll_into(&mut out, POLL_SLICE) {
                Ok(_) => {}
                Err(e) if e.kind() == kvfs_rdma::ErrorKind::Timeout => {}
                Err(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "rdma poll failed");
                    self.state.fail(&self.peer, "poll failed");
                    if !aborted {
                        self.ep.abort();
                        aborted = true;
                    }
                    if e.kind() != kvfs_rdma::ErrorKind::Broken {
                        break;
                    }
                }
            }
            for c in out.drain(..) {
                if c.result.is_err() {
                    self.state.fail(&self.peer, "an op failed");
                }
                if let Some(p) = pending.remove(&c.id) {
                    let _ = p.done.send(c.result);
                }
            }
        }
        // Destroy the QP before letting go of the memory of ops it never reported.
        let Worker { ep, peer, .. } = self;
        drop(ep);
        fail_all(&mut pending, "poll failed");
        tracing::debug!(peer = %peer, "rdma worker done; endpoint destroyed");
    }

    fn submit(&mut self, mut cmd: Cmd, next_id: &mut u64, pending: &mut HashMap<u64, Pending>) {
        cmd.op.id = *next_id;
        *next_id += 1;
        match self.ep.submit(&[cmd.op]) {
            Ok(()) => {
                let p = Pending { deadline: cmd.deadline, _hold: cmd.hold, done: cmd.done };
                pending.insert(cmd.op.id, p);
            }
            Err(e) => {
                if e.kind() != kvfs_rdma::ErrorKind::QueueFull {
                    self.state.fail(&self.peer, "submit failed");
                }
                let _ = cmd.done.send(Err(e));
            }
        }
    }
}

fn fail_all(pending: &mut HashMap<u64, Pending>, why: &str) {
    for (_, p) in pending.drain() {
        let e = kvfs_rdma::Error::new(kvfs_rdma::ErrorKind::Broken, "poll", why.to_string());
        let _ = p.done.send(Err(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_errors_map_to_the_kinds_the_engine_retries_or_reports() {
        use kvfs_rdma::ErrorKind as K;
        let kind = |k| engine_error(&kvfs_rdma::Error::new(k, "test", "")).kind();
        assert_eq!(kind(K::RetryExceeded), ErrorKind::PeerGone);
        assert_eq!(kind(K::Flushed), ErrorKind::PeerGone);
        assert_eq!(kind(K::RemoteAccess), ErrorKind::OutOfRange);
        assert_eq!(kind(K::QueueFull), ErrorKind::Busy);
        assert_eq!(kind(K::Timeout), ErrorKind::Timeout);
        assert_eq!(kind(K::LocalAccess), ErrorKind::Io);
    }
}
