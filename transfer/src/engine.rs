//! The engine: one per process (or per embedded client), owning its segment, its registered
//! memory, its listeners and its connections to peers.
//!
//! A segment is addressed by name (`host:port` of the peer's listener by default). Opening one
//! performs the peer-to-peer handshake and picks transports per request: the engine's own
//! segment is a local memcpy; a peer on the same host is reached over shm when the remote range
//! is in a shareable buffer; otherwise over rdma when both engines have a device (feature
//! `rdma`) and both ranges are registered with it; otherwise over tcp. An rdma request that fails
//! on the wire is retried over tcp within its deadline (see `rdma.rs`). A batch is
//! a list of reads and writes between registered local memory and remote addresses; it runs
//! asynchronously, every item reports its own status, and every item finishes — successfully
//! or with a typed error — within `op_timeout_ms` of its submission.
//!
//! Invariants: the local range of every item lies inside one registered region, and the remote
//! range inside one region the peer registered as remotely accessible (checked by the peer
//! before any byte moves); a failed item never leaves the connection it used out of step.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvfs_proto::transfer::{DataOp, ServedRequests};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::config::EngineConfig;
use crate::memory::{
    Buffer, BufferOptions, DEVICE_CHUNK_BYTES, DeviceMemory, HostPin, Region, Registry,
};
use crate::rdma::{self, RdmaPeer};
use crate::shm::{self, ShmPeer};
use crate::tcp::{self, Hold, TcpPeer};
use crate::{Error, ErrorKind, Result};

/// Read remote memory into local memory, or write local memory to remote memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferOp {
    Read,
    Write,
}

/// How a batch may use its peers' connections.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchOptions {
    /// The most tcp connections one item is striped over (0: all `tcp_conns_per_peer`). When
    /// several engines read from one peer at once (a reshard's targets reading the same
    /// source), each striping over every connection multiplies the streams the peer's cores
    /// serve without adding any capacity; a caller that knows how many share the peer divides
    /// the connections among them.
    pub tcp_conns_max: usize,
}

/// One item of a batch.
#[derive(Clone)]
pub struct TransferRequest {
    pub op: TransferOp,
    pub segment: SegmentHandle,
    /// Address in this process, inside a registered region.
    pub local_addr: u64,
    /// Address in the peer's segment, inside a region it registered as remotely accessible.
    pub remote_addr: u64,
    pub len: u64,
}

/// A small message received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Segment name of the sender.
    pub from: String,
    pub msg: Vec<u8>,
}

/// The transport an item would take (for status output and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    Local,
    Shm,
    Tcp,
    Rdma,
}

/// State shared by the engine's tasks.
pub(crate) struct Shared {
    pub cfg: EngineConfig,
    pub name: String,
    pub host_id: String,
    pub instance: u64,
    pub shm_socket: Option<String>,
    pub registry: Registry,
    /// The opened RDMA device, when the feature is built, enabled and a device exists.
    pub rdma: Option<rdma::Nic>,
    notify_tx: mpsc::Sender<Notification>,
    /// The owner's check of guarded reads (`Engine::set_read_guard`); none: refuse them all.
    read_guard: std::sync::OnceLock<ReadGuard>,
    /// The owner's hook for noted writes (`Engine::set_write_note`); none: refuse every note.
    write_note: std::sync::OnceLock<WriteNote>,
    /// Requests served over tcp, by [`DataOp::index`] (`Engine::requests_served`).
    served: [AtomicU64; DataOp::COUNT],
}

/// Says whether `[addr, addr+len)` of this engine's memory still holds what `guard` names
/// (see [`Engine::set_read_guard`]).
pub type ReadGuard = Box<dyn Fn(u64, u64, &[u8]) -> bool + Send + Sync>;

/// Told that `[addr, addr+len)` of this engine's memory now holds the bytes of a noted write,
/// with the write's note; says whether it accepts the note (see [`Engine::set_write_note`]).
/// It runs on the task serving the connection, before the writer is answered: it must not
/// block.
pub type WriteNote = Box<dyn Fn(u64, u64, &[u8]) -> bool + Send + Sync>;

impl Shared {
    /// Whether the owner vouches for a guarded read; never without a guard installed.
    pub fn vouches(&self, addr: u64, len: u64, guard: &[u8]) -> bool {
        self.read_guard.get().is_some_and(|g| g(addr, len, guard))
    }

    /// Whether the owner accepts a noted write's note; never without a hook installed.
    pub fn noted(&self, addr: u64, len: u64, note: &[u8]) -> bool {
        self.write_note.get().is_some_and(|h| h(addr, len, note))
    }

    /// Counts one request served over tcp.
    pub fn count_served(&self, op: DataOp) {
        self.served[op.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn deliver_notification(&self, from: &str, msg: Vec<u8>) -> Result<()> {
        self.notify_tx.try_send(Notification { from: from.to_string(), msg }).map_err(|_| {
            Error::new(ErrorKind::Busy, "notify", "the receiver's notification queue is full")
        })
    }
}

#[allow(clippy::large_enum_variant)] // one per peer, never moved around in bulk
enum PeerKind {
    Local,
    Remote { tcp: Option<TcpPeer>, shm: Option<ShmPeer>, rdma: Option<RdmaPeer> },
}

struct Peer {
    name: String,
    kind: PeerKind,
    /// The peer's lowest remote region when the segment was opened (0: none).
    first_buffer_addr: u64,
}

/// An opened segment: cheap to clone, usable in any number of batches.
#[derive(Clone)]
pub struct SegmentHandle(Arc<Peer>);

impl SegmentHandle {
    /// The segment's name, as the peer itself reports it.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Start of the lowest region the peer had registered as remotely accessible when the
    /// segment was opened (0: none); for the engine's own segment, the current one.
    pub fn first_buffer_addr(&self, engine: &Engine) -> u64 {
        match self.0.kind {
            PeerKind::Local => engine.inner.shared.registry.first_remote_addr(),
            PeerKind::Remote { .. } => self.0.first_buffer_addr,
        }
    }

    /// Whether the peer is known to be gone (its shm liveness watch closed).
    pub fn is_dead(&self) -> bool {
        matches!(&self.0.kind, PeerKind::Remote { shm: Some(s), .. } if s.is_dead())
    }

    pub fn status(&self) -> SegmentStatus {
        let (tcp, shm, rdma) = match &self.0.kind {
            PeerKind::Local => (None, None, None),
            PeerKind::Remote { tcp, shm, rdma } => (
                tcp.as_ref().map(TcpPeer::live_connections),
                shm.as_ref().map(ShmPeer::mapped_buffers),
                rdma.as_ref().map(RdmaPeer::status),
            ),
        };
        SegmentStatus {
            name: self.0.name.clone(),
            local: matches!(self.0.kind, PeerKind::Local),
            tcp_connections: tcp,
            shm_buffers: shm,
            rdma,
            dead: self.is_dead(),
        }
    }

    /// The transport a request for `[remote_addr, remote_addr+len)` would use right now.
    pub fn transport_for(&self, remote_addr: u64, len: u64) -> Option<TransportKind> {
        match &self.0.kind {
            PeerKind::Local => Some(TransportKind::Local),
            PeerKind::Remote { tcp, shm, rdma } => {
                if shm.as_ref().is_some_and(|s| s.translate(remote_addr, len).is_some()) {
                    Some(TransportKind::Shm)
                } else if rdma.as_ref().is_some_and(|r| r.covers(remote_addr, len)) {
                    Some(TransportKind::Rdma)
                } else {
                    tcp.as_ref().map(|_| TransportKind::Tcp)
                }
            }
        }
    }
}

/// What an opened segment currently uses, for status pages and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentStatus {
    pub name: String,
    pub local: bool,
    /// Live tcp connections (0..=tcp_conns_per_peer; connections are made on demand).
    pub tcp_connections: Option<usize>,
    /// Peer buffers mapped over shm, when shm is in use.
    pub shm_buffers: Option<usize>,
    /// The rdma side, when both engines have rdma and the first link came up at open.
    pub rdma: Option<RdmaStatus>,
    pub dead: bool,
}

/// What the rdma side of an opened segment is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaStatus {
    /// A queue pair to the peer is connected and not failed (a failed one is rebuilt on the
    /// next request).
    pub connected: bool,
    /// Remotely accessible regions of the peer in the local copy of its table.
    pub peer_regions: usize,
    /// Requests carried over rdma successfully, and their bytes.
    pub ops: u64,
    pub bytes: u64,
    /// Requests the rdma path handed to another transport (no NIC registration, link down,
    /// failed op).
    pub fallbacks: u64,
    /// Queue pair connections made to the peer (the first, then one per rebuild).
    pub links_built: u64,
}

/// Status of one item of a submitted batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemStatus {
    Pending,
    Done,
    Failed(Error),
}

struct BatchState {
    results: Mutex<Vec<Option<Result<()>>>>,
    remaining: AtomicUsize,
    done: Notify,
}

impl BatchState {
    fn complete(&self, item: usize, r: Result<()>) {
        self.results.lock().unwrap_or_else(|e| e.into_inner())[item] = Some(r);
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_waiters();
        }
    }
}

/// Small tcp items of one batch, of one direction and one peer, sent as one request.
struct Pack {
    segment: SegmentHandle,
    op: DataOp,
    /// Batch indices, ranges and what keeps their memory alive, in the same order.
    items: (Vec<usize>, Vec<tcp::Range>, Vec<Hold>),
}

/// Most items in one pack, and the largest item that is packed (larger ones are sliced).
pub(crate) const PACK_ITEMS_MAX: usize = 256;
pub(crate) const PACK_ITEM_BYTES_MAX: u64 = 1 << 20;
/// Packs of 2 MiB beat 4 MiB ones on loopback (1 MiB items, paired against raw TCP in the
/// same rounds: reads 0.88-0.91 against 0.79-0.84, writes 0.90-0.97 against 0.84-0.89).
pub(crate) const PACK_BYTES_MAX: u64 = 2 << 20;

/// Whether a pack of `items` ranges and `bytes` bytes has no room for one more of `len`.
pub(crate) fn pack_is_full(items: usize, bytes: u64, len: u64) -> bool {
    items >= PACK_ITEMS_MAX || bytes + len > PACK_BYTES_MAX
}

/// One read of [`Engine::read_guarded_batch`]: local address, remote address, length, guard.
pub type GuardedRead = (u64, u64, u64, Arc<[u8]>);

/// The guarded reads of one `ReadGuardedV` request: batch indices, ranges, guards and what
/// keeps each local range alive, in the same order.
#[derive(Default)]
struct GuardedPack {
    items: Vec<usize>,
    ranges: Vec<tcp::Range>,
    guards: Vec<Arc<[u8]>>,
    holds: Vec<Hold>,
}

/// Splits a batch into items that run on their own and packs of small items that can share one
/// tcp request: remote ranges reached only over tcp (outside the peer's shared buffers, no rdma
/// link), valid
/// lengths, registered local memory. Everything else runs on its own, where its errors are
/// reported. Packs hold at most `PACK_ITEMS_MAX` items and `slice_bytes` bytes.
fn plan_batch(
    shared: &Shared,
    reqs: Vec<TransferRequest>,
) -> (Vec<(usize, TransferRequest)>, Vec<Pack>) {
    let mut singles = Vec::new();
    let mut open: HashMap<(usize, bool), Pack> = HashMap::new();
    let mut packs = Vec::new();
    for (i, req) in reqs.into_iter().enumerate() {
        let Some(hold) = packable(shared, &req) else {
            singles.push((i, req));
            continue;
        };
        let write = req.op == TransferOp::Write;
        let key = (Arc::as_ptr(&req.segment.0) as usize, write);
        let pack = open.entry(key).or_insert_with(|| Pack {
            segment: req.segment.clone(),
            op: if write { DataOp::Write } else { DataOp::Read },
            items: (Vec::new(), Vec::new(), Vec::new()),
        });
        let bytes: u64 = pack.items.1.iter().map(|r| r.len).sum();
        if pack_is_full(pack.items.0.len(), bytes, req.len) {
            let full = std::mem::take(&mut pack.items);
            packs.push(Pack { segment: pack.segment.clone(), op: pack.op, items: full });
        }
        pack.items.0.push(i);
        pack.items.1.push(tcp::Range {
            remote: req.remote_addr,
            local: req.local_addr,
            len: req.len,
        });
        pack.items.2.push(hold);
    }
    for (_, pack) in open {
        if !pack.items.0.is_empty() {
            packs.push(pack);
        }
    }
    // A pack of one item is just an item: no table needed.
    let (ones, packs): (Vec<Pack>, Vec<Pack>) =
        packs.into_iter().partition(|p| p.items.0.len() == 1);
    for p in ones {
        let r = p.items.1[0];
        let op = if p.op == DataOp::Write { TransferOp::Write } else { TransferOp::Read };
        singles.push((
            p.items.0[0],
            TransferRequest {
                op,
                segment: p.segment,
                local_addr: r.local,
                remote_addr: r.remote,
                len: r.len,
            },
        ));
    }
    (singles, packs)
}

/// What keeps the local memory of `req` alive, when `req` can go into a tcp pack.
fn packable(shared: &Shared, req: &TransferRequest) -> Option<Hold> {
    let PeerKind::Remote { tcp: Some(_), shm, rdma } = &req.segment.0.kind else {
        return None;
    };
    // A same-host peer's shared buffers are copied directly; its other registered memory
    // (raw registrations: an engine's KV cache) goes over tcp like a remote peer's.
    let over_shm = shm.as_ref().is_some_and(|s| {
        s.is_dead()
            || req.remote_addr.checked_add(req.len).is_none()
            || s.translate(req.remote_addr, req.len).is_some()
    });
    if over_shm
        || rdma.is_some()
        || req.len == 0
        || req.len > PACK_ITEM_BYTES_MAX
        || req.remote_addr.checked_add(req.len).is_none()
    {
        return None;
    }
    let local = shared.registry.find(req.local_addr, req.len)?;
    Some(local.hold())
}

/// A submitted batch: poll item statuses or wait for all of them.
pub struct Batch {
    state: Arc<BatchState>,
    len: usize,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_done(&self) -> bool {
        self.state.remaining.load(Ordering::Acquire) == 0
    }

    pub fn status(&self, item: usize) -> ItemStatus {
        let results = self.state.results.lock().unwrap_or_else(|e| e.into_inner());
        match results.get(item) {
            Some(Some(Ok(()))) => ItemStatus::Done,
            Some(Some(Err(e))) => ItemStatus::Failed(e.clone()),
            Some(None) => ItemStatus::Pending,
            None => ItemStatus::Failed(Error::new(
                ErrorKind::InvalidArgument,
                "batch status",
                "no such item",
            )),
        }
    }

    /// Waits for every item and returns their results in submission order.
    pub async fn wait(self) -> Vec<Result<()>> {
        loop {
            let notified = self.state.done.notified();
            if self.is_done() {
                break;
            }
            notified.await;
        }
        let mut results = self.state.results.lock().unwrap_or_else(|e| e.into_inner());
        results
            .drain(..)
            .map(|r| r.unwrap_or_else(|| Err(Error::new(ErrorKind::Io, "batch", "item lost"))))
            .collect()
    }
}

struct Inner {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    /// Opened segments by name; looked up on every transfer's open, so a plain lock.
    peers: std::sync::Mutex<HashMap<String, SegmentHandle>>,
    /// Held while a segment is being connected: one handshake at a time, and a task that
    /// waited for it finds the segment opened instead of connecting again.
    connecting: tokio::sync::Mutex<()>,
    notify_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The Transfer Engine. Clones share one engine; it stops when the last clone is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Starts an engine on the current tokio runtime: binds its listeners and starts serving.
    pub async fn start(cfg: EngineConfig) -> Result<Engine> {
        cfg.validate()?;
        let listener =
            TcpListener::bind(cfg.listen).await.map_err(|e| Error::io("engine bind", e))?;
        let local_addr = listener.local_addr().map_err(|e| Error::io("engine bind", e))?;
        let name = cfg.name.clone().unwrap_or_else(|| default_name(local_addr));
        let instance: u64 = rand::random();
        let (shm_listener, shm_socket) = if cfg.transports.shm {
            let (l, n) = shm::bind(instance)?;
            (Some(l), Some(n))
        } else {
            (None, None)
        };
        let nic = rdma::Nic::open(&cfg)?;
        let (notify_tx, notify_rx) = mpsc::channel(cfg.notify_queue_max);
        let shared = Arc::new(Shared {
            cfg,
            name,
            host_id: crate::host_id().to_string(),
            instance,
            shm_socket,
            registry: Registry::default(),
            rdma: nic,
            notify_tx,
            read_guard: std::sync::OnceLock::new(),
            write_note: std::sync::OnceLock::new(),
            served: Default::default(),
        });
        let mut tasks = vec![tokio::spawn(accept_loop(listener, shared.clone()))];
        if let Some(l) = shm_listener {
            tasks.push(tokio::spawn(shm::serve(l, shared.clone())));
        }
        tracing::info!(segment = %shared.name, listen = %local_addr, "transfer engine started");
        Ok(Engine {
            inner: Arc::new(Inner {
                shared,
                local_addr,
                peers: std::sync::Mutex::new(HashMap::new()),
                connecting: tokio::sync::Mutex::new(()),
                notify_rx: tokio::sync::Mutex::new(notify_rx),
                tasks,
            }),
        })
    }

    /// This engine's segment name (what peers pass to [`Engine::open_segment`]).
    pub fn name(&self) -> &str {
        &self.inner.shared.name
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.shared.cfg
    }

    /// The RDMA device this engine opened (`None`: built without the `rdma` feature, rdma
    /// disabled in the configuration, or no usable device here).
    pub fn rdma_device(&self) -> Option<&str> {
        self.inner.shared.rdma.as_ref().map(rdma::Nic::device_name)
    }

    /// Allocates a shareable buffer and registers it as remotely accessible.
    pub fn alloc_buffer(&self, len: usize, opts: &BufferOptions) -> Result<Arc<Buffer>> {
        let buf = Arc::new(Buffer::new(len, opts)?);
        self.register_buffer(buf.clone(), true)?;
        Ok(buf)
    }

    /// Registers an owned buffer; `remote` makes it readable and writable by peers. With rdma,
    /// the buffer is registered with the NIC too (a failure there is logged, and the buffer is
    /// then reached over the other transports).
    pub fn register_buffer(&self, buf: Arc<Buffer>, remote: bool) -> Result<()> {
        let (addr, len) = (buf.addr(), buf.len() as u64);
        // SAFETY: the region holds `buf` (an owned mapping of `len` bytes at `addr`) for as long
        // as it holds the memory region, and drops the memory region first.
        let mr = self.inner.shared.rdma.as_ref().and_then(|nic| unsafe { nic.register(addr, len) });
        let region = Region {
            addr,
            len,
            remote,
            mr,
            buffer: Some(buf),
            owner: None,
            device: None,
            pin: HostPin::Untried,
        };
        self.inner.shared.registry.insert(region)
    }

    /// Registers raw memory (not shareable over shm; reachable over tcp/rdma when `remote`).
    ///
    /// # Safety
    /// `[addr, addr+len)` must stay valid, readable and writable memory until it is
    /// unregistered and no transfer that uses it is still running.
    pub unsafe fn register_memory(&self, addr: u64, len: u64, remote: bool) -> Result<()> {
        // SAFETY: this function's contract: the memory stays valid until it is unregistered and
        // no transfer uses it; the memory region lives in the registry entry and in the entry's
        // clones held by running transfers, so it is gone by then.
        let mr = self.inner.shared.rdma.as_ref().and_then(|nic| unsafe { nic.register(addr, len) });
        self.inner.shared.registry.insert(Region {
            addr,
            len,
            remote,
            mr,
            buffer: None,
            owner: None,
            device: None,
            pin: HostPin::Untried,
        })
    }

    /// Registers device memory (a GPU's) at `[addr, addr+len)` of this engine's address space
    /// as remotely readable and writable. `addr` is where peers address it (for CUDA, the
    /// device pointer: unified addressing keeps it clear of host mappings); the engine never
    /// dereferences it and moves its bytes only through `dev` (see [`DeviceMemory`]). Peers on
    /// the same host and rdma peers reach it over tcp. It may not be the local side of this
    /// engine's own transfers (`InvalidArgument`): those stage through host memory.
    pub fn register_device_memory(
        &self,
        addr: u64,
        len: u64,
        dev: Arc<dyn DeviceMemory>,
    ) -> Result<()> {
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(dev.clone());
        self.inner.shared.registry.insert(Region {
            addr,
            len,
            remote: true,
            mr: None,
            buffer: None,
            owner: Some(owner),
            device: Some(dev),
            pin: HostPin::Untried,
        })
    }

    /// Registers raw memory that `owner` keeps valid, for local use only (the source or
    /// destination of this engine's own transfers, never reachable by peers): every transfer
    /// that uses it holds a clone of `owner` until it has finished with the memory, even one
    /// whose caller gave up on it, so unregistering and dropping the last other reference is
    /// always safe. What a binding registers for one call (a Python `bytes` object a put
    /// reads from or a get fills) so that the engine moves its bytes without a staging copy.
    ///
    /// # Safety
    /// `[addr, addr+len)` must be valid, readable and writable memory for as long as `owner`
    /// lives, and nothing else may write it while transfers use it.
    pub unsafe fn register_memory_owned(
        &self,
        addr: u64,
        len: u64,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<()> {
        // SAFETY: this function's contract; the memory region lives in the registry entry and
        // in the clones held by running transfers, next to the owner.
        let mr = self.inner.shared.rdma.as_ref().and_then(|nic| unsafe { nic.register(addr, len) });
        let region = Region {
            addr,
            len,
            remote: false,
            mr,
            buffer: None,
            owner: Some(owner),
            device: None,
            pin: HostPin::Untried,
        };
        self.inner.shared.registry.insert(region)
    }

    /// Whether `[addr, addr+len)` lies inside one region registered with this engine.
    pub fn is_registered(&self, addr: u64, len: u64) -> bool {
        self.inner.shared.registry.find(addr, len).is_some()
    }

    /// Unregisters the region starting at `addr`.
    pub fn unregister(&self, addr: u64) -> Result<()> {
        let region = self.inner.shared.registry.remove(addr)?;
        if let HostPin::By(dev) = &region.pin {
            dev.unpin_host(addr);
        }
        Ok(())
    }

    /// Opens (or returns the already opened) segment `name`, given as `host:port`.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        if let Some(h) = self.opened(name) {
            return Ok(h);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(h) = self.opened(name) {
            return Ok(h);
        }
        let handle = self.connect_segment(name).await?;
        self.peers().insert(name.to_string(), handle.clone());
        Ok(handle)
    }

    /// Forgets an opened segment; the next open performs a fresh handshake.
    pub async fn close_segment(&self, name: &str) {
        self.peers().remove(name);
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, HashMap<String, SegmentHandle>> {
        self.inner.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live segment `name`, if it is open (never opens one).
    pub fn opened_segment(&self, name: &str) -> Option<SegmentHandle> {
        self.opened(name)
    }

    /// The live segment `name`, if it is open.
    fn opened(&self, name: &str) -> Option<SegmentHandle> {
        self.peers().get(name).filter(|h| !h.is_dead()).cloned()
    }

    async fn connect_segment(&self, name: &str) -> Result<SegmentHandle> {
        let shared = &self.inner.shared;
        if name == shared.name {
            return Ok(SegmentHandle(Arc::new(Peer {
                name: name.to_string(),
                kind: PeerKind::Local,
                first_buffer_addr: 0,
            })));
        }
        let addr = resolve(name).await?;
        let rdma_on = shared.rdma.is_some();
        if !shared.cfg.transports.tcp && !shared.cfg.transports.shm && !rdma_on {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "open segment",
                "no usable transport enabled",
            ));
        }
        // The handshake always runs over tcp: it is how peers learn each other's identity.
        let (tcp, info) = TcpPeer::open(addr, shared.clone()).await.map_err(|e| {
            if e.kind() == ErrorKind::PeerGone || e.kind() == ErrorKind::Io {
                Error::new(ErrorKind::UnknownSegment, "open segment", format!("{name}: {e}"))
            } else {
                e
            }
        })?;
        let shm = match (&info.shm_socket, shared.cfg.transports.shm) {
            (Some(sock), true) if info.host_id == shared.host_id => {
                match ShmPeer::open(
                    sock.clone(),
                    shared.cfg.connect_timeout(),
                    shared.cfg.cluster_secret,
                )
                .await
                {
                    Ok(p) => Some(p),
                    Err(e) => {
                        tracing::warn!(segment = %name, error = %e, "shm unavailable, using tcp");
                        None
                    }
                }
            }
            _ => None,
        };
        let rdma = RdmaPeer::open(shared, addr, &info).await;
        let tcp = shared.cfg.transports.tcp.then_some(tcp);
        if tcp.is_none() && shm.is_none() && rdma.is_none() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "open segment",
                format!("{name} is not reachable over shm or rdma, and tcp is disabled"),
            ));
        }
        tracing::debug!(
            segment = %info.name,
            shm = shm.is_some(),
            rdma = rdma.is_some(),
            "segment opened"
        );
        let kind = PeerKind::Remote { tcp, shm, rdma };
        let first_buffer_addr = info.first_buffer_addr;
        Ok(SegmentHandle(Arc::new(Peer { name: info.name, kind, first_buffer_addr })))
    }

    /// Submits a batch; items run concurrently and report individually.
    pub fn submit(&self, reqs: Vec<TransferRequest>) -> Result<Batch> {
        self.submit_with(reqs, BatchOptions::default())
    }

    /// [`submit`](Self::submit) with `opts`.
    pub fn submit_with(&self, reqs: Vec<TransferRequest>, opts: BatchOptions) -> Result<Batch> {
        let cfg = &self.inner.shared.cfg;
        if reqs.len() > cfg.batch_items_max {
            return Err(Error::new(
                ErrorKind::BatchTooLarge,
                "submit",
                format!("{} items, the limit is {}", reqs.len(), cfg.batch_items_max),
            ));
        }
        let len = reqs.len();
        let state = Arc::new(BatchState {
            results: Mutex::new(vec![None; len]),
            remaining: AtomicUsize::new(len),
            done: Notify::new(),
        });
        let deadline = Instant::now() + cfg.op_timeout();
        let shared = self.inner.shared.clone();
        let st = state.clone();
        tokio::spawn(async move {
            let (singles, packs) = plan_batch(&shared, reqs);
            let mut runs: Vec<
                std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>,
            > = Vec::with_capacity(singles.len() + packs.len());
            for (i, req) in singles {
                let (shared, st) = (shared.clone(), st.clone());
                runs.push(Box::pin(async move {
                    let r = run_item(&shared, &req, deadline, opts.tcp_conns_max).await;
                    st.complete(i, r);
                }));
            }
            for pack in packs {
                let st = st.clone();
                runs.push(Box::pin(async move {
                    let PeerKind::Remote { tcp: Some(tcp), .. } = &pack.segment.0.kind else {
                        return;
                    };
                    let (idx, ranges, holds) = pack.items;
                    for (i, r) in idx
                        .into_iter()
                        .zip(tcp.request_pack(pack.op, ranges, holds, deadline).await)
                    {
                        st.complete(i, r);
                    }
                }));
            }
            futures_util::future::join_all(runs).await;
        });
        Ok(Batch { state, len })
    }

    /// Submits a batch and waits for it.
    pub async fn transfer(&self, reqs: Vec<TransferRequest>) -> Result<Vec<Result<()>>> {
        Ok(self.submit(reqs)?.wait().await)
    }

    /// [`transfer`](Self::transfer) with `opts`.
    pub async fn transfer_with(
        &self,
        reqs: Vec<TransferRequest>,
        opts: BatchOptions,
    ) -> Result<Vec<Result<()>>> {
        Ok(self.submit_with(reqs, opts)?.wait().await)
    }

    /// Whether [`read_in_order`](Self::read_in_order) can run on `segment`: it is reached
    /// over tcp alone (no shm, no rdma; not this engine's own segment).
    pub fn ordered_reads(&self, segment: &SegmentHandle) -> bool {
        tcp_alone(segment).is_some()
    }

    /// Reads `items` (local address, remote address, length) from `segment` in order, on its
    /// tcp connection `lane` (modulo `tcp_conns_per_peer`): each item's bytes are read from
    /// the peer's memory no earlier than the item before it was (the acceptor serves a
    /// connection's requests, and copies their bytes out, in order). One round trip's
    /// worth of waiting for the whole sequence, where awaiting each read in turn would cost
    /// one per read: a seqlock reader brackets its data with two header reads on each lane.
    /// Not retried (a broken connection fails the rest of the lane; run it again whole).
    /// `Unsupported` where [`ordered_reads`](Self::ordered_reads) is false; per item, the
    /// errors of a transfer (unregistered local range, range out of the peer's regions).
    pub async fn read_in_order(
        &self,
        segment: &SegmentHandle,
        items: &[(u64, u64, u64)],
        lane: usize,
    ) -> Result<Vec<Result<()>>> {
        let Some(tcp) = tcp_alone(segment) else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "read in order",
                format!("{} is not reached over tcp alone", segment.name()),
            ));
        };
        let shared = &self.inner.shared;
        let deadline = Instant::now() + shared.cfg.op_timeout();
        let mut out: Vec<Option<Result<()>>> = vec![None; items.len()];
        let mut reads = Vec::with_capacity(items.len());
        let mut at = Vec::with_capacity(items.len());
        for (k, &(local, remote, len)) in items.iter().enumerate() {
            match checked_item(shared, "transfer", local, remote, len) {
                Ok(region) => {
                    reads.push((crate::tcp::Range { remote, local, len }, region.hold()));
                    at.push(k);
                }
                Err(e) => out[k] = Some(Err(e)),
            }
        }
        for (k, r) in at.into_iter().zip(tcp.read_in_order(reads, lane, deadline).await) {
            out[k] = Some(r);
        }
        Ok(out.into_iter().map(|r| r.expect("every item answered")).collect())
    }

    /// Runs one request on the calling task (no batch bookkeeping): the lowest-latency path.
    pub async fn transfer_one(&self, req: &TransferRequest) -> Result<()> {
        let deadline = Instant::now() + self.inner.shared.cfg.op_timeout();
        run_item(&self.inner.shared, req, deadline, 0).await
    }

    /// Copies `data` into this engine's own remotely accessible host memory at `remote_addr`:
    /// what a write to the engine's own segment does, run on the calling thread with no
    /// batch and no task. A process writing small objects into its own embedded node pays
    /// more for a batch's bookkeeping than for the copy. `data` need not be registered (the
    /// caller's borrow keeps it alive). Errors as such a transfer: `InvalidArgument` for no
    /// bytes or device memory, `OutOfRange` when the range is not inside one remotely
    /// accessible region of this engine.
    pub fn write_own(&self, remote_addr: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "transfer", "zero length"));
        }
        // `region` (holding its owner) stays alive while the bytes land.
        let region = remote_region(&self.inner.shared, remote_addr, len)?;
        host_side(&region, "transfer")?;
        // The local side is only read by a write.
        copy(TransferOp::Write, data.as_ptr() as *mut u8, remote_addr as *mut u8, data.len());
        Ok(())
    }

    /// [`Engine::write_own`] of many ranges: `(remote_addr, data)` each, one result per item in
    /// order. From `shm_parallel_bytes_min` bytes in all, the items are split by bytes over
    /// the copy threads (scoped threads, so the borrowed bytes outlive every copy), as one
    /// large copy is: a batch of 1 MiB objects into this process's own segment then uses
    /// every core, not one.
    pub fn write_own_batch(&self, items: &[(u64, &[u8])]) -> Vec<Result<()>> {
        let cfg = &self.inner.shared.cfg;
        let parts = copy_threads(cfg.shm_copy_threads_max);
        let len = |i: &(u64, &[u8])| i.1.len() as u64;
        run_split(items, len, parts, cfg.shm_parallel_bytes_min, |(addr, data)| {
            self.write_own(*addr, data)
        })
    }

    /// Requests this engine served over tcp since it started, by op (see
    /// [`ServedRequests`]).
    pub fn requests_served(&self) -> ServedRequests {
        let served = &self.inner.shared.served;
        ServedRequests::new(std::array::from_fn(|i| served[i].load(Ordering::Relaxed)))
    }

    /// Installs the check of guarded reads of this engine's memory (once per engine): peers'
    /// [`Engine::read_guarded`] calls (and this engine's own, on its own segment) are served
    /// only while `guard(addr, len, guard)` says yes. The store's node passes a check that the
    /// range still holds the object version the guard names; without one every guarded read
    /// is refused.
    pub fn set_read_guard(&self, guard: ReadGuard) -> Result<()> {
        self.inner.shared.read_guard.set(guard).map_err(|_| {
            Error::new(ErrorKind::InvalidArgument, "set read guard", "already installed")
        })
    }

    /// Installs the hook of noted writes into this engine's memory (once per engine): after a
    /// peer's [`Engine::write_noted`] (or this engine's own, on its own segment) has put its
    /// bytes in place, `note(addr, len, note)` is called before the writer is answered, and a
    /// `false` answers `Stale`. The store's node records the commit the note carries, so the
    /// object is known to it the moment the writer learns its bytes landed; without a hook
    /// every note is refused (the bytes are still written).
    pub fn set_write_note(&self, note: WriteNote) -> Result<()> {
        self.inner.shared.write_note.set(note).map_err(|_| {
            Error::new(ErrorKind::InvalidArgument, "set write note", "already installed")
        })
    }

    /// Whether a guarded read of `seg` goes without shared memory or rdma: over tcp, or on
    /// this engine's own memory. Guarded reads need the owner to check them, so they never
    /// take a one-sided transport; a caller that could read a peer through shared memory or
    /// rdma may prefer an unguarded read after asking whoever vouches for the range.
    pub fn guarded_is_direct(&self, seg: &SegmentHandle, remote_addr: u64, len: u64) -> bool {
        matches!(
            seg.transport_for(remote_addr, len),
            Some(TransportKind::Tcp | TransportKind::Local)
        )
    }

    /// Reads `[remote_addr, remote_addr+len)` of `seg` into local memory if the segment's
    /// owner vouches for `guard` there ([`Engine::set_read_guard`]): one request and one
    /// reply over tcp, checked and served by the owner; on this engine's own memory, a check
    /// and a memcpy. `Stale` when the owner refuses, `Unsupported` when the segment is
    /// reachable only over shared memory or rdma.
    pub async fn read_guarded(
        &self,
        seg: &SegmentHandle,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        guard: Arc<[u8]>,
    ) -> Result<()> {
        let shared = &self.inner.shared;
        let local = checked_item(shared, "guarded read", local_addr, remote_addr, len)?;
        let deadline = Instant::now() + shared.cfg.op_timeout();
        match &seg.0.kind {
            PeerKind::Local => {
                if !shared.vouches(remote_addr, len, &guard) {
                    return Err(not_vouched());
                }
                let req = TransferRequest {
                    op: TransferOp::Read,
                    segment: seg.clone(),
                    local_addr,
                    remote_addr,
                    len,
                };
                local_copy(shared, &req).await
            }
            PeerKind::Remote { tcp: Some(tcp), .. } => {
                let hold = local.hold();
                tcp.read_guarded(remote_addr, local_addr, len, guard, hold, deadline).await
            }
            PeerKind::Remote { tcp: None, .. } => Err(Error::new(
                ErrorKind::Unsupported,
                "guarded read",
                "guarded reads need the tcp transport",
            )),
        }
    }

    /// [`Engine::read_guarded`] into memory the call borrows instead of registered memory, for
    /// a small object's new vector: no staging buffer, no copy after the receive. Only where
    /// this task moves every byte itself before it returns, so nothing writes `dst` once the
    /// call is over (or dropped): this engine's own host memory (the owner's check and one
    /// copy) and a tcp peer's idle direct connection. `None` where it cannot (the connection is
    /// busy or broke before the answer, the segment is reached over shm or rdma only, the
    /// range is device memory): the caller reads through registered memory instead.
    pub async fn read_guarded_into(
        &self,
        seg: &SegmentHandle,
        dst: &mut [u8],
        remote_addr: u64,
        guard: &[u8],
    ) -> Option<Result<()>> {
        let shared = &self.inner.shared;
        let len = dst.len() as u64;
        if len == 0 || remote_addr.checked_add(len).is_none() {
            return None;
        }
        match &seg.0.kind {
            PeerKind::Local => {
                let region = remote_region(shared, remote_addr, len).ok()?;
                if region.device.is_some() {
                    return None;
                }
                let done = vouched_own_copy(shared, dst.as_mut_ptr(), remote_addr, len, guard);
                drop(region);
                Some(done)
            }
            PeerKind::Remote { tcp: Some(tcp), .. } => {
                let deadline = Instant::now() + shared.cfg.op_timeout();
                tcp.read_guarded_direct(remote_addr, dst, guard, deadline).await
            }
            PeerKind::Remote { tcp: None, .. } => None,
        }
    }

    /// [`Engine::read_guarded`] of many ranges of one segment: `(local_addr, remote_addr,
    /// len, guard)` each. Over tcp the reads go as packs (`ReadGuardedV`: at most
    /// `PACK_ITEMS_MAX` ranges and `PACK_BYTES_MAX` bytes a request, one guard per range,
    /// checked range by range by the owner), spread over the peer's connections; a range
    /// larger than a pack item goes alone. One result per item, in order: `Stale` where the
    /// owner refuses the guard, the item's own error where it is malformed.
    pub async fn read_guarded_batch(
        &self,
        seg: &SegmentHandle,
        items: &[GuardedRead],
    ) -> Vec<Result<()>> {
        let shared = &self.inner.shared;
        let tcp = match &seg.0.kind {
            PeerKind::Remote { tcp: Some(tcp), .. } => tcp,
            PeerKind::Local => {
                // Own host memory: checks and copies, split over the copy threads when large
                // in all, as own writes are. A device range among them: each item on its own.
                let host: Option<Vec<Region>> = items
                    .iter()
                    .map(|i| remote_region(shared, i.1, i.2).ok().filter(|r| r.device.is_none()))
                    .collect();
                if let Some(regions) = host {
                    let reads: Vec<_> = items.iter().zip(regions).collect();
                    let parts = copy_threads(shared.cfg.shm_copy_threads_max);
                    let len = |(i, _): &(&GuardedRead, Region)| i.2;
                    return run_split(&reads, len, parts, shared.cfg.shm_parallel_bytes_min, |r| {
                        read_own_guarded(shared, r.0, &r.1)
                    });
                }
                let reads = items.iter().map(|(local, remote, len, guard)| {
                    self.read_guarded(seg, *local, *remote, *len, guard.clone())
                });
                return futures_util::future::join_all(reads).await;
            }
            PeerKind::Remote { tcp: None, .. } => {
                let e = Error::new(
                    ErrorKind::Unsupported,
                    "guarded read",
                    "guarded reads need the tcp transport",
                );
                return vec![Err(e); items.len()];
            }
        };
        let deadline = Instant::now() + shared.cfg.op_timeout();
        let mut out: Vec<Result<()>> = Vec::with_capacity(items.len());
        // Packs, and the items too large for one.
        let mut packs: Vec<GuardedPack> = Vec::new();
        let mut alone = Vec::new();
        let mut bytes = 0;
        for (k, (local, remote, len, guard)) in items.iter().enumerate() {
            let region = match checked_item(shared, "guarded read", *local, *remote, *len) {
                Ok(r) => r,
                Err(e) => {
                    out.push(Err(e));
                    continue;
                }
            };
            out.push(Ok(()));
            if *len > PACK_ITEM_BYTES_MAX {
                alone.push(k);
                continue;
            }
            if packs.last().is_none_or(|p| pack_is_full(p.items.len(), bytes, *len)) {
                packs.push(GuardedPack::default());
                bytes = 0;
            }
            bytes += len;
            let p = packs.last_mut().expect("a pack");
            p.items.push(k);
            p.ranges.push(tcp::Range { remote: *remote, local: *local, len: *len });
            p.guards.push(guard.clone());
            p.holds.push(region.hold());
        }
        let packed = packs.into_iter().map(|p| async move {
            let done = if let ([r], [guard], [hold]) = (&p.ranges[..], &p.guards[..], &p.holds[..])
            {
                // A pack of one is just a guarded read (the direct connection when free).
                let (guard, hold) = (guard.clone(), hold.clone());
                vec![tcp.read_guarded(r.remote, r.local, r.len, guard, hold, deadline).await]
            } else {
                tcp.read_guarded_pack(p.ranges, &p.guards, p.holds, deadline).await
            };
            p.items.into_iter().zip(done).collect::<Vec<_>>()
        });
        let single = alone.into_iter().map(|k| async move {
            let (local, remote, len, guard) = &items[k];
            (k, self.read_guarded(seg, *local, *remote, *len, guard.clone()).await)
        });
        let (packed, single) = futures_util::future::join(
            futures_util::future::join_all(packed),
            futures_util::future::join_all(single),
        )
        .await;
        for (k, r) in packed.into_iter().flatten().chain(single) {
            out[k] = r;
        }
        out
    }

    /// Writes local memory to `[remote_addr, remote_addr+len)` of `seg` and hands `note` to
    /// the segment's owner once the bytes are in place ([`Engine::set_write_note`]), in the
    /// one request and one reply of a plain tcp write (on this engine's own memory: a memcpy,
    /// then the hook). `Ok(true)`: written and the note accepted; `Ok(false)`: written, the
    /// note refused (no hook, or the owner said no). Always over tcp, even to a peer that
    /// shared memory or rdma would reach (their writes are one-sided: the owner never sees
    /// them); `Unsupported` for a peer without tcp. [`Engine::guarded_is_direct`] says whether
    /// tcp is the peer's usual transport for the range anyway.
    pub async fn write_noted(
        &self,
        seg: &SegmentHandle,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        note: Arc<[u8]>,
    ) -> Result<bool> {
        let shared = &self.inner.shared;
        let local = checked_item(shared, "noted write", local_addr, remote_addr, len)?;
        let deadline = Instant::now() + shared.cfg.op_timeout();
        let written = match &seg.0.kind {
            PeerKind::Local => {
                let req = TransferRequest {
                    op: TransferOp::Write,
                    segment: seg.clone(),
                    local_addr,
                    remote_addr,
                    len,
                };
                local_copy(shared, &req).await?;
                return Ok(shared.noted(remote_addr, len, &note));
            }
            PeerKind::Remote { tcp: Some(tcp), .. } => {
                let hold = local.hold();
                tcp.write_noted(remote_addr, local_addr, len, note, hold, deadline).await
            }
            PeerKind::Remote { tcp: None, .. } => Err(Error::new(
                ErrorKind::Unsupported,
                "noted write",
                "noted writes need the tcp transport",
            )),
        };
        match written {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::Stale => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sends a small message to a peer's notification queue.
    pub async fn notify(&self, seg: &SegmentHandle, msg: &[u8]) -> Result<()> {
        let shared = &self.inner.shared;
        if msg.len() > shared.cfg.notify_bytes_max {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "notify",
                format!("{} bytes, the limit is {}", msg.len(), shared.cfg.notify_bytes_max),
            ));
        }
        match &seg.0.kind {
            PeerKind::Local => shared.deliver_notification(&shared.name, msg.to_vec()),
            PeerKind::Remote { tcp: Some(tcp), .. } => {
                let deadline = Instant::now() + shared.cfg.op_timeout();
                tcp.notify(Arc::new(msg.to_vec()), deadline).await
            }
            PeerKind::Remote { tcp: None, .. } => Err(Error::new(
                ErrorKind::Unsupported,
                "notify",
                "notifications need the tcp transport",
            )),
        }
    }

    /// Checks that a peer answers, within the operation timeout.
    pub async fn ping(&self, seg: &SegmentHandle) -> Result<()> {
        match &seg.0.kind {
            PeerKind::Local => Ok(()),
            PeerKind::Remote { tcp: Some(tcp), .. } => {
                tcp.ping(Instant::now() + self.inner.shared.cfg.op_timeout()).await
            }
            PeerKind::Remote { shm: Some(s), .. } if !s.is_dead() => Ok(()),
            PeerKind::Remote { .. } => Err(Error::new(ErrorKind::PeerGone, "ping", "peer gone")),
        }
    }

    /// Waits for the next notification.
    pub async fn recv_notification(&self) -> Option<Notification> {
        self.inner.notify_rx.lock().await.recv().await
    }

    /// Takes a notification if one is waiting.
    pub fn try_recv_notification(&self) -> Option<Notification> {
        self.inner.notify_rx.try_lock().ok()?.try_recv().ok()
    }
}

fn default_name(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() { format!("127.0.0.1:{}", addr.port()) } else { addr.to_string() }
}

async fn resolve(name: &str) -> Result<SocketAddr> {
    let unknown = |detail: String| Error::new(ErrorKind::UnknownSegment, "open segment", detail);
    let mut addrs = tokio::net::lookup_host(name)
        .await
        .map_err(|e| unknown(format!("{name} is not a host:port address: {e}")))?;
    addrs.next().ok_or_else(|| unknown(format!("{name} resolves to no address")))
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => { conns.spawn(tcp::serve_conn(stream, shared.clone())); }
                Err(e) => {
                    // Usually fd exhaustion: back off instead of spinning.
                    tracing::warn!(error = %e, "tcp accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// The tcp peer of a segment reached over tcp alone (no shm, no rdma; not our own).
fn tcp_alone(segment: &SegmentHandle) -> Option<&tcp::TcpPeer> {
    match &segment.0.kind {
        PeerKind::Remote { tcp: Some(tcp), shm: None, rdma: None } => Some(tcp),
        _ => None,
    }
}

/// The checks of a transfer's item (a batch's, a lane's, a lone owner-checked request's)
/// before it leaves: a non-empty range that does not wrap, and local host memory inside one
/// registered region (whose hold the request keeps).
fn checked_item(
    shared: &Shared,
    what: &'static str,
    local_addr: u64,
    remote_addr: u64,
    len: u64,
) -> Result<Region> {
    if len == 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, what, "zero length"));
    }
    if remote_addr.checked_add(len).is_none() {
        return Err(Error::new(ErrorKind::OutOfRange, what, "remote range wraps around"));
    }
    let local = shared.registry.find(local_addr, len).ok_or_else(|| {
        Error::new(
            ErrorKind::NotRegistered,
            what,
            format!("local range {local_addr:#x}+{len} is not inside one registered region"),
        )
    })?;
    host_side(&local, what)?;
    Ok(local)
}

/// Refuses device memory as the local side of a transfer: the transports read and write the
/// local side through slices.
fn host_side(local: &Region, what: &'static str) -> Result<()> {
    match local.device {
        Some(_) => Err(Error::new(
            ErrorKind::InvalidArgument,
            what,
            "the local side of a transfer must be host memory, not device memory",
        )),
        None => Ok(()),
    }
}

/// Runs one item; `tcp_conns_max` as [`BatchOptions::tcp_conns_max`].
async fn run_item(
    shared: &Shared,
    req: &TransferRequest,
    deadline: Instant,
    tcp_conns_max: usize,
) -> Result<()> {
    let local = checked_item(shared, "transfer", req.local_addr, req.remote_addr, req.len)?;
    match &req.segment.0.kind {
        PeerKind::Local => local_copy(shared, req).await,
        PeerKind::Remote { tcp, shm, rdma } => {
            if let Some(shm) = shm {
                if shm.is_dead() {
                    return Err(Error::new(
                        ErrorKind::PeerGone,
                        "transfer",
                        "segment owner exited",
                    ));
                }
                if let Some(done) = shm_copy(shared, shm, req).await {
                    return done;
                }
            }
            let mut rdma_failed = None;
            if let Some(rdma) = rdma {
                match rdma.request(req, &local, deadline).await {
                    rdma::Outcome::Done(r) => return r,
                    rdma::Outcome::Fallback(e) => rdma_failed = Some(e),
                }
            }
            let Some(tcp) = tcp else {
                return Err(rdma_failed.unwrap_or_else(|| {
                    Error::new(
                        ErrorKind::OutOfRange,
                        "transfer",
                        "remote range is not in a shared buffer and tcp is disabled",
                    )
                }));
            };
            let hold = local.hold();
            let op = match req.op {
                TransferOp::Read => DataOp::Read,
                TransferOp::Write => DataOp::Write,
            };
            let (remote, local) = (req.remote_addr, req.local_addr);
            tcp.request(op, remote, local, req.len, hold, deadline, tcp_conns_max).await
        }
    }
}

/// A transfer within this engine's own memory (the caller's segment is ours): a memcpy, spread
/// over the copy threads when it is large, like a copy over shm.
async fn local_copy(shared: &Shared, req: &TransferRequest) -> Result<()> {
    let remote = remote_region(shared, req.remote_addr, req.len)?;
    if let Some(dev) = remote.device.clone() {
        let local = shared.registry.find(req.local_addr, req.len);
        if let Some(l) = local.as_ref().filter(|l| matches!(l.pin, HostPin::Untried)) {
            // The first copy between this long-lived host region and a device asks it to
            // page-lock the region (once: a refusal is recorded too), so this copy and every
            // later one runs at the copy engine's speed.
            if !l.per_call() {
                let pinned = dev.pin_host(l.addr, l.len);
                if !shared.registry.record_pin(l.addr, pinned.then_some(&dev)) && pinned {
                    dev.unpin_host(l.addr);
                }
            }
        }
        let keep = (remote.hold(), local.map(|r| r.hold()));
        let (op, local, offset, len) =
            (req.op, req.local_addr as usize, req.remote_addr - remote.addr, req.len as usize);
        if len <= DEVICE_CHUNK_BYTES {
            // Tens of microseconds at most: cheaper inline than a hop to a blocking thread.
            return device_copy(&*dev, op, local, offset, len);
        }
        return tokio::task::spawn_blocking(move || {
            let _keep = keep;
            device_copy(&*dev, op, local, offset, len)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "device copy", e.to_string()))?;
    }
    let remote = Far { addr: req.remote_addr as usize, keep: remote.hold() };
    parallel_copy(shared, req.op, req.local_addr as usize, remote, req.len as usize).await
}

/// A guarded read of this engine's own host memory, on the calling thread: `(local, remote,
/// len, guard)` with `remote`'s region (host memory, found by the caller), the local range
/// checked, the owner's check, one copy.
fn read_own_guarded(shared: &Shared, item: &GuardedRead, remote_region: &Region) -> Result<()> {
    let (local, remote, len, guard) = item;
    // The local region (holding its owner) stays alive while the bytes move, as the remote
    // one does in the caller's hands.
    let _local_region = checked_item(shared, "guarded read", *local, *remote, *len)?;
    debug_assert!(remote_region.device.is_none());
    vouched_own_copy(shared, *local as *mut u8, *remote, *len, guard)
}

/// The owner's check of a guarded read of this engine's own host memory, then its one copy
/// into `local` (both ranges checked by the caller, who holds their regions).
fn vouched_own_copy(
    shared: &Shared,
    local: *mut u8,
    remote: u64,
    len: u64,
    guard: &[u8],
) -> Result<()> {
    if !shared.vouches(remote, len, guard) {
        return Err(not_vouched());
    }
    copy(TransferOp::Read, local, remote as *mut u8, len as usize);
    Ok(())
}

/// A guarded read of this engine's own memory that its owner no longer vouches for.
fn not_vouched() -> Error {
    Error::new(
        ErrorKind::Stale,
        "guarded read",
        "this engine's owner no longer holds what the guard names there",
    )
}

/// Runs `f` on every item, one result per item in order: on this thread, or, from `min_total`
/// bytes in all (`len` of each item) and with at least two items, in contiguous groups of
/// about equal bytes over `parts` scoped threads, this one included (scoped: whatever the
/// items borrow outlives every call).
fn run_split<T: Sync, R: Send>(
    items: &[T],
    len: impl Fn(&T) -> u64,
    parts: usize,
    min_total: u64,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let total: u64 = items.iter().map(&len).sum();
    let parts = parts.min(items.len());
    if total < min_total || parts < 2 {
        return items.iter().map(f).collect();
    }
    let per = total.div_ceil(parts as u64);
    let mut groups: Vec<&[T]> = Vec::with_capacity(parts);
    let (mut start, mut bytes) = (0, 0u64);
    for (i, it) in items.iter().enumerate() {
        bytes += len(it);
        if bytes >= per && groups.len() + 1 < parts {
            groups.push(&items[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < items.len() {
        groups.push(&items[start..]);
    }
    let f = &f;
    std::thread::scope(|s| {
        let helpers: Vec<_> = groups[1..]
            .iter()
            .map(|g| s.spawn(move || g.iter().map(f).collect::<Vec<R>>()))
            .collect();
        let mut out: Vec<R> = groups[0].iter().map(f).collect();
        for h in helpers {
            match h.join() {
                Ok(r) => out.extend(r),
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        out
    })
}

/// The remotely accessible region of this engine that holds `[addr, addr+len)`.
fn remote_region(shared: &Shared, addr: u64, len: u64) -> Result<Region> {
    shared.registry.find(addr, len).filter(|r| r.remote).ok_or_else(|| {
        Error::new(ErrorKind::OutOfRange, "transfer", "range not in a remotely accessible region")
    })
}

/// Copies between host memory at `local` (registered, checked by the caller) and device
/// memory at `offset` of `dev`, in one call (a page-locked host region goes at the copy
/// engine's speed; see [`DeviceMemory::pin_host`]).
fn device_copy(
    dev: &dyn DeviceMemory,
    op: TransferOp,
    local: usize,
    offset: u64,
    len: usize,
) -> Result<()> {
    let done = match op {
        // SAFETY: [local, local+len) lies inside a registered host region that the caller holds
        // for the duration of the copy.
        TransferOp::Read => {
            dev.read(offset, unsafe { std::slice::from_raw_parts_mut(local as *mut u8, len) })
        }
        // SAFETY: as above.
        TransferOp::Write => {
            dev.write(offset, unsafe { std::slice::from_raw_parts(local as *const u8, len) })
        }
    };
    done.map_err(|e| Error::new(ErrorKind::Io, "device copy", e))
}

/// The far side of a copy: its address, and what keeps its memory alive while helper threads
/// copy parts of it.
struct Far {
    addr: usize,
    keep: crate::tcp::Hold,
}

/// Copies over shm when the remote range is mapped (refreshing the mapping table once);
/// `None` means the range is not shareable and another transport must carry it.
async fn shm_copy(shared: &Shared, shm: &ShmPeer, req: &TransferRequest) -> Option<Result<()>> {
    let found = match shm.translate(req.remote_addr, req.len) {
        Some(t) => Some(t),
        None => {
            if let Err(e) = shm.refresh().await {
                return Some(Err(e));
            }
            shm.translate(req.remote_addr, req.len)
        }
    };
    let (mapping, offset) = found?;
    // SAFETY: offset+len lies inside the mapping (translate checked it), which `keep` holds.
    let addr = unsafe { mapping.as_ptr().add(offset) } as usize;
    let remote = Far { addr, keep: crate::tcp::Hold::Buffer(mapping) };
    Some(parallel_copy(shared, req.op, req.local_addr as usize, remote, req.len as usize).await)
}

/// Copies between local memory and a peer's mapped buffer (or another region of this
/// engine). Small copies run inline on the calling task; from `shm_parallel_bytes_min` up, the
/// copy is cut into as many parts as there are copy threads (at most `shm_copy_threads_max`):
/// one part inline, the others on blocking threads, so a large transfer uses every core
/// instead of one.
async fn parallel_copy(
    shared: &Shared,
    op: TransferOp,
    local: usize,
    remote: Far,
    len: usize,
) -> Result<()> {
    let parts = copy_threads(shared.cfg.shm_copy_threads_max);
    // Overlapping ranges (within this engine's own memory) must be copied as one memmove.
    let overlap = local < remote.addr + len && remote.addr < local + len;
    if (len as u64) < shared.cfg.shm_parallel_bytes_min || parts < 2 || overlap {
        copy(op, local as *mut u8, remote.addr as *mut u8, len);
        return Ok(());
    }
    let chunk = len.div_ceil(parts).next_multiple_of(64 << 10);
    let mut helpers = Vec::with_capacity(parts - 1);
    let keep_local = shared.registry.find(local as u64, len as u64).map(|r| r.hold());
    let mut at = chunk;
    while at < len {
        let n = chunk.min(len - at);
        let keep_remote = remote.keep.clone();
        let keep = keep_local.clone();
        let far = remote.addr + at;
        helpers.push(tokio::task::spawn_blocking(move || {
            // Both memories' owners stay alive while this part copies.
            let _keep = (keep, keep_remote);
            copy(op, (local + at) as *mut u8, far as *mut u8, n);
        }));
        at += n;
    }
    copy(op, local as *mut u8, remote.addr as *mut u8, chunk.min(len));
    for h in helpers {
        h.await.map_err(|e| Error::new(ErrorKind::Io, "shm copy", e.to_string()))?;
    }
    Ok(())
}

/// Threads a large copy is spread over: the CPUs this process may use, capped.
fn copy_threads(max: usize) -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus =
        *CPUS.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    cpus.min(max).max(1)
}

fn copy(op: TransferOp, local: *mut u8, remote: *mut u8, len: usize) {
    let (src, dst) = match op {
        TransferOp::Read => (remote as *const u8, local),
        TransferOp::Write => (local as *const u8, remote),
    };
    let overlap = (src as usize) < dst as usize + len && (dst as usize) < src as usize + len;
    // SAFETY: every caller checked both ranges: the local one inside registered memory (or, for
    // `Engine::write_own` and `Engine::read_guarded_into`, a live borrow of `len` bytes), the
    // remote one inside remotely accessible or mapped memory of at least `len` bytes. They may
    // overlap only when a caller transfers between overlapping ranges of its own segment:
    // those take the overlapping copy.
    unsafe {
        if len >= crate::memory::STREAM_BYTES_MIN && !overlap {
            crate::memory::copy_streaming(src, dst, len);
        } else {
            std::ptr::copy(src, dst, len);
        }
    }
}
