//! kvfs-node: the node daemon. It contributes a DRAM segment to the pool, serves transfers
//! into and out of it, runs its tiers (NVMe, object store) and keeps the master informed
//! (through `kvfs_client`'s master link). `kvfs node`, `kvfs up` and the Python package's
//! embedded node run it.
//!
//! Mechanism. A node runs a Transfer Engine with one registered, shareable DRAM buffer (its
//! segment 0). The master allocates ranges in it; writers and readers move bytes directly with
//! the node's engine, which serves them without the node's code being involved. The node keeps
//! one connection to the master: it registers (with every copy it holds), heartbeats (with its
//! counters; the answer carries the reads the master granted of its objects), and answers the
//! master's calls: `Commit` and `Drop` records keep its index exact, `Persist` writes an eager
//! object to the object store before the put completes, `Load` copies an object from NVMe or
//! the object store into a DRAM range for a reader. When the connection breaks (master
//! restart, network), the node reconnects with backoff and registers again with its index: the
//! master rebuilds its directory from that, so a master restart loses nothing nodes hold.
//!
//! Tiers (with a data directory, see `data_dir`): an NVMe tier (segment 1; the master accounts
//! its capacity, the node places its files), an object store, and the lazy write-back queue.
//! The tier manager (`tiering`) drives the sans-IO `kvfs_tiers::policy` from a timer: it
//! demotes cold objects DRAM -> NVMe above the DRAM watermark (then reports the NVMe copy and
//! the DRAM copy's release to the master, which refuses the release while a read lease is
//! live), drops NVMe copies of persisted objects above the NVMe watermark, and asks the master
//! to promote hot NVMe objects (which it does with a `Load`). Restarted with the same data
//! directory, a node keeps its id and re-reports its NVMe objects; its DRAM objects are gone.
//!
//! For same-process users (the FUSE daemon under `kvfs up --mount`),
//! [`Node::local_object_file`] hands out the NVMe file of an object: the file is exactly the
//! object's bytes from offset 0, so FUSE passthrough can serve it.
//!
//! Invariants: the index holds exactly the copies the master committed, loaded or accepted
//! from this node and has not dropped, and those a writer committed before its `PutEnd`: a
//! client in this process (see [`Embedded`]; taken back when the `PutEnd` fails) or a remote
//! one whose noted write carried the commit (`noted_commit`; the master drops the ranges of
//! every put it abandons, so one that never completes is forgotten); a `Drop` for a range
//! that now holds another object, or a newer version of the key, is ignored; a copy this node made is reported before it is relied on, and
//! undone when the master refuses it.
//!
//! HBM (`TierConfig::hbm_bytes`): a block of GPU memory becomes the node's segment 2 (tier
//! `Hbm`), registered with the engine as device memory ([`kvfs_tiers::HbmBlock`] behind
//! [`kvfs_transfer::DeviceMemory`]): the master allocates ranges in it for puts that ask for
//! HBM, and peers read and write them over tcp through host staging. Its copies are indexed like
//! DRAM copies (commit, drop, guarded reads, noted and embedded commits, re-registration).
//!
//! NVMe over Fabrics (`TierConfig::nvmeof`): the NVMe tier's directory, `data_dir/nvme`, is
//! the mount of a remote namespace's ext4 file system, attached at start (connected over
//! nvme-tcp, formatted only when the spec says `format` and the namespace is blank; see
//! [`kvfs_tiers::nvmeof`]) and detached when the node goes away, after the NVMe medium is
//! closed: [`Node::shutdown`] waits for the node's tasks and drops it on a blocking thread.
//! Everything above the directory is the local NVMe tier unchanged.
//!
//! The tier manager (`tiering.rs`) moves HBM copies down to DRAM above the HBM watermark and
//! objects put into HBM back up when hot.
//!
//! Not handled here: several GPUs per node, several NVMe directories per node.

mod data_dir;
mod held;
mod tiering;
mod watch;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_proto::store::{
    ErrorCode, MasterRequest, MasterResponse, NodeRegistration, NodeRequest, NodeResponse, Role,
    SegmentSpec, Tier,
};
use kvfs_rpc::{RpcConn, handler_fn};
use kvfs_tiers::policy::PolicyConfig;
use kvfs_tiers::{
    NvmeConfig, NvmeMedium, NvmeofAttachment, NvmeofSpec, ObjectStoreConfig, ObjectStoreMedium,
    RingConfig,
};
use kvfs_transfer::{Buffer, BufferOptions, Engine, EngineConfig};
use tokio::task::JoinHandle;

use held::{DRAM_SEGMENT, HBM_SEGMENT, Index, NVME_SEGMENT};
use kvfs_client::master::MasterLink;
use kvfs_client::read_guard;
use kvfs_client::{Client, ClientConfig, Error, ErrorKind, LocalCommit, LocalNode, Result};
pub use kvfs_proto::store::NodeStats;

/// Configuration of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub master: String,
    pub engine: EngineConfig,
    /// Bytes of DRAM contributed to the pool.
    pub dram_bytes: u64,
    /// Stable identity. With a `data_dir` it is stored there (and must match on later
    /// starts); without one and without an id, a random id (a restarted node is a new node).
    pub node_id: Option<u64>,
    /// Fault every page of the segment in at start (first writes then pay no page faults).
    pub populate: bool,
    pub rpc_timeout_ms: u64,
    /// Upper bound of the reconnect backoff.
    pub reconnect_backoff_max_ms: u64,
    /// Where the node keeps its id, NVMe tier and write-back journal. `None`: DRAM only.
    pub data_dir: Option<PathBuf>,
    pub tiers: TierConfig,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            master: "127.0.0.1:50051".into(),
            engine: EngineConfig::default(),
            dram_bytes: 1 << 30,
            node_id: None,
            populate: true,
            rpc_timeout_ms: 5_000,
            reconnect_backoff_max_ms: 2_000,
            data_dir: None,
            tiers: TierConfig::default(),
        }
    }
}

/// The node's tiers beyond DRAM.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Capacity of the NVMe tier under `data_dir/nvme`; 0 disables it (needs a `data_dir`).
    pub nvme_bytes: u64,
    /// The object store for eager and lazy persistence (the same one the master scans).
    pub object_store: Option<ObjectStoreConfig>,
    /// Watermarks, admission and rate limits of the tier policy.
    pub policy: PolicyConfig,
    /// Period of the tier manager's rounds.
    pub tick_ms: u64,
    /// Bounds of the lazy write-back queue (entries, bytes) and its concurrent uploads.
    pub writeback_entries_max: usize,
    pub writeback_bytes_max: u64,
    pub writeback_workers: usize,
    /// Contribute this many bytes of GPU memory (device 0) as an HBM segment (0: only probe
    /// for a CUDA driver and report it). Refused with a clear error where no driver is found.
    pub hbm_bytes: u64,
    /// io_uring shape of the NVMe tier.
    pub ring: RingConfig,
    /// Keep the NVMe tier on this remote namespace (nvme-tcp), mounted at `data_dir/nvme`;
    /// `nvme_bytes` 0 then means most of its file system ([`kvfs_tiers::nvmeof::CAPACITY_SHARE`]).
    pub nvmeof: Option<NvmeofSpec>,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            nvme_bytes: 0,
            object_store: None,
            policy: PolicyConfig::default(),
            tick_ms: 100,
            writeback_entries_max: 65_536,
            writeback_bytes_max: 16 << 30,
            writeback_workers: 4,
            hbm_bytes: 0,
            ring: RingConfig::default(),
            nvmeof: None,
        }
    }
}

struct Inner {
    id: u64,
    cfg: NodeConfig,
    engine: Engine,
    dram: Arc<Buffer>,
    /// The HBM segment's device block, registered with the engine.
    hbm: Option<Arc<kvfs_tiers::HbmBlock>>,
    index: Arc<Mutex<Index>>,
    tiers: tiering::Tiers,
    /// The remote namespace under the NVMe tier; declared after `tiers` so that it is
    /// detached (unmounted, disconnected) after the medium is closed.
    _nvmeof: Option<NvmeofAttachment>,
    started: Instant,
    registered_once: AtomicBool,
    registered: tokio::sync::watch::Sender<bool>,
    /// Held for the node's life: no other node uses the data directory meanwhile.
    _dir_lock: Option<std::fs::File>,
    /// The watch on the runtime the node's tasks run on (none on a current-thread runtime,
    /// which stops by design whenever its thread blocks outside it).
    watch: Option<watch::RuntimeWatch>,
}

/// A running node. Dropping it stops it (without telling the master, which then expires it);
/// [`Node::shutdown`] leaves cleanly.
/// See [`Node::object_files`].
#[derive(Clone)]
pub struct NodeFiles(Arc<Inner>);

impl NodeFiles {
    /// Same as [`Node::local_object_file`].
    pub fn local_object_file(&self, key: &str) -> Option<(std::fs::File, u64)> {
        self.0.local_object_file(key)
    }
}

pub struct Node {
    inner: Arc<Inner>,
    link: Arc<MasterLink>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn tier_err(op: &'static str, e: kvfs_tiers::Error) -> Error {
    let kind = match e.kind() {
        kvfs_tiers::ErrorKind::InvalidArgument => ErrorKind::InvalidArgument,
        kvfs_tiers::ErrorKind::Corrupt => ErrorKind::Corrupt,
        kvfs_tiers::ErrorKind::NotFound => ErrorKind::NotFound,
        kvfs_tiers::ErrorKind::NoSpace => ErrorKind::NoSpace,
        _ => ErrorKind::Unavailable,
    };
    Error::new(kind, op, e.to_string())
}

impl Node {
    /// Starts the engine, allocates the segment, opens the tiers (an NVMe directory left by a
    /// previous run is re-read and its objects re-reported) and begins registering with the
    /// master (in the background: a node started before its master keeps trying).
    pub async fn start(mut cfg: NodeConfig) -> Result<Node> {
        let invalid = |m: String| Err(Error::new(ErrorKind::InvalidArgument, "node", m));
        if cfg.dram_bytes == 0 {
            return invalid("dram_bytes must be positive".into());
        }
        if (cfg.tiers.nvme_bytes > 0 || cfg.tiers.nvmeof.is_some()) && cfg.data_dir.is_none() {
            return invalid("an NVMe tier needs a data directory".into());
        }
        kvfs_client::master::check_addr(&cfg.master)?;
        let (dir_lock, id) = match &cfg.data_dir {
            Some(dir) => {
                let l = data_dir::lock(dir)?;
                (Some(l), data_dir::node_id(dir, cfg.node_id)?)
            }
            None => (None, cfg.node_id.unwrap_or_else(rand::random)),
        };
        let (hbm_available, hbm) = probe_hbm(cfg.tiers.hbm_bytes)?;
        let nvmeof = match (&cfg.tiers.nvmeof, &cfg.data_dir) {
            (Some(spec), Some(dir)) => {
                let a = attach_nvmeof(spec.clone(), dir.join("nvme")).await?;
                cfg.tiers.nvme_bytes = nvmeof_capacity(&a, cfg.tiers.nvme_bytes)?;
                Some(a)
            }
            _ => None,
        };
        let nvme = match (&cfg.data_dir, cfg.tiers.nvme_bytes) {
            (Some(dir), bytes) if bytes > 0 => {
                let ncfg =
                    NvmeConfig { ring: cfg.tiers.ring, ..NvmeConfig::new(dir.join("nvme"), bytes) };
                let (m, report) = tokio::task::spawn_blocking(move || NvmeMedium::open(ncfg))
                    .await
                    .map_err(|e| Error::new(ErrorKind::Internal, "node", e.to_string()))?
                    .map_err(|e| tier_err("open the NVMe tier", e))?;
                tracing::info!(
                    node = id,
                    objects = report.objects,
                    quarantined = report.quarantined,
                    "NVMe tier opened"
                );
                Some(Arc::new(m))
            }
            _ => None,
        };
        let object_store = match &cfg.tiers.object_store {
            Some(c) => Some(Arc::new(
                ObjectStoreMedium::open(c.clone())
                    .map_err(|e| tier_err("open the object store", e))?,
            )),
            None => None,
        };
        let engine = Engine::start(cfg.engine.clone())
            .await
            .map_err(|e| Error::from_transfer("node", &e))?;
        let opts = BufferOptions {
            populate: cfg.populate,
            name: "kvfs-dram-segment".into(),
            ..Default::default()
        };
        let dram = engine
            .alloc_buffer(cfg.dram_bytes as usize, &opts)
            .map_err(|e| Error::from_transfer("node", &e))?;
        if let Some(block) = &hbm {
            let dev: Arc<dyn kvfs_transfer::DeviceMemory> = Arc::new(HbmDevice(block.clone()));
            engine
                .register_device_memory(block.base(), block.len(), dev)
                .map_err(|e| Error::from_transfer("node", &e))?;
        }
        let index = Arc::new(Mutex::new(Index::new(cfg.tiers.nvme_bytes)));
        let tiers = tiering::Tiers::open(tiering::TiersParts {
            cfg: &cfg,
            index: index.clone(),
            dram: dram.clone(),
            hbm: hbm.clone(),
            nvme,
            object_store,
            hbm_available,
        })
        .await?;
        let (registered, _) = tokio::sync::watch::channel(false);
        let watch = match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => None,
            _ => Some(
                watch::RuntimeWatch::start(id)
                    .map_err(|e| Error::new(ErrorKind::Internal, "node", e.to_string()))?,
            ),
        };
        let inner = Arc::new(Inner {
            id,
            cfg,
            engine,
            dram,
            hbm,
            index,
            tiers,
            _nvmeof: nvmeof,
            started: Instant::now(),
            registered_once: AtomicBool::new(false),
            registered,
            _dir_lock: dir_lock,
            watch,
        });
        inner.adopt_nvme_objects().await;
        let guard_owner = Arc::downgrade(&inner);
        inner
            .engine
            .set_read_guard(Box::new(move |addr, len, guard| {
                guard_owner.upgrade().is_some_and(|n| n.vouches(addr, len, guard))
            }))
            .map_err(|e| Error::from_transfer("node", &e))?;
        let note_owner = Arc::downgrade(&inner);
        inner
            .engine
            .set_write_note(Box::new(move |addr, len, note| {
                note_owner.upgrade().is_some_and(|n| n.noted_commit(addr, len, note))
            }))
            .map_err(|e| Error::from_transfer("node", &e))?;
        let handler = {
            let inner = Arc::downgrade(&inner);
            handler_fn(move |_conn: RpcConn, req: NodeRequest| {
                let inner = inner.upgrade();
                async move {
                    match inner {
                        Some(inner) => inner.apply(req).await,
                        None => NodeResponse::Refused(kvfs_proto::store::WireError::new(
                            ErrorCode::Internal,
                            "node stopping",
                        )),
                    }
                }
            })
        };
        let timeout = Duration::from_millis(inner.cfg.rpc_timeout_ms);
        let link = Arc::new(MasterLink::new(
            inner.cfg.master.clone(),
            Role::Node,
            kvfs_transfer::host_id().to_string(),
            handler,
            timeout,
            inner.engine.config().cluster_secret,
        ));
        let mut tasks = vec![tokio::spawn(run(inner.clone(), link.clone()))];
        tasks.extend(inner.tiers.start_tasks(&inner, &link));
        tracing::info!(node = id, segment = %inner.engine.name(), bytes = inner.cfg.dram_bytes, "node started");
        Ok(Node { inner, link, tasks })
    }

    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The node's Transfer Engine segment name.
    pub fn endpoint(&self) -> &str {
        self.inner.engine.name()
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Objects this node holds a copy of (DRAM or NVMe).
    pub fn held_objects(&self) -> usize {
        self.inner.index.lock().unwrap_or_else(|e| e.into_inner()).objects.len()
    }

    /// The node's counters (what its heartbeats carry to the master's /metrics).
    pub fn stats(&self) -> NodeStats {
        self.inner.stats()
    }

    /// The NVMe file of `key`, opened read-only, and the object's size, when this node holds
    /// the object on its NVMe tier; for same-process readers that serve it from the file
    /// (FUSE passthrough under `kvfs up --mount`).
    ///
    /// The file holds exactly the object's bytes from offset 0 (no header, no padding), and
    /// the descriptor stays readable if the node later drops or replaces the copy (the data
    /// file is only unlinked). The first hand-out of a copy (since it was written, or since
    /// the node started) verifies its blake3 by reading the whole file through the page cache,
    /// which also warms the cache for the passthrough reads (a corrupt copy gives `None` and
    /// is counted in `corrupt_reads_nvme`); later hand-outs are not re-verified.
    /// `None` also when the object is not on this node's NVMe tier (read it with a
    /// [`Client`](crate::Client) then: the master will load it into memory).
    ///
    /// Blocking (it may read the file): call it from a blocking thread, as FUSE request
    /// handlers are.
    pub fn local_object_file(&self, key: &str) -> Option<(std::fs::File, u64)> {
        self.inner.local_object_file(key)
    }

    /// A handle that hands out [`Node::local_object_file`]s and outlives borrows of the node
    /// (for a FUSE mount in the node's process, which serves them with passthrough).
    pub fn object_files(&self) -> NodeFiles {
        NodeFiles(self.inner.clone())
    }

    /// A client of this process that shares the node's engine and records the commits of the
    /// replicas it writes into this node's segment here, before their `PutEnd` (one master
    /// round trip fewer per put; see [`Client::connect_local`]).
    pub async fn client(&self, cfg: ClientConfig) -> Result<Client> {
        let local = Arc::new(Embedded(Arc::downgrade(&self.inner)));
        Client::connect_local(cfg, self.engine().clone(), local).await
    }

    /// Waits until the node is registered with the master (at most `timeout`).
    pub async fn wait_registered(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.inner.registered.subscribe();
        let wait = rx.wait_for(|r| *r);
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(Error::new(
                ErrorKind::Unavailable,
                "node",
                format!("not registered within {timeout:?}"),
            )),
        }
    }

    /// Leaves the cluster: tells the master (its objects here are then gone, unless persisted
    /// or on NVMe for the next start) and stops.
    /// With an NVMe-oF tier, the node's tasks are awaited and its state dropped on a blocking
    /// thread before this returns, so the namespace is unmounted and disconnected by then
    /// (unless a [`NodeFiles`] handle still holds the node).
    pub async fn shutdown(mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = self
            .link
            .call("unregister", &MasterRequest::UnregisterNode { node: self.inner.id })
            .await;
        self.link.close().await;
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
        let inner = self.inner.clone();
        drop(self);
        let _ = tokio::task::spawn_blocking(move || drop(inner)).await;
    }
}

/// Attach the NVMe-oF namespace at `dir` (the NVMe tier's directory), on a blocking thread.
async fn attach_nvmeof(spec: NvmeofSpec, dir: PathBuf) -> Result<NvmeofAttachment> {
    tokio::task::spawn_blocking(move || NvmeofAttachment::attach(&spec, &dir))
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, "node", e.to_string()))?
        .map_err(|e| tier_err("attach the NVMe-oF namespace", e))
}

/// The NVMe tier's capacity on an attached namespace: `asked`, or most of the file system
/// when 0; more than the file system holds is refused.
fn nvmeof_capacity(a: &NvmeofAttachment, asked: u64) -> Result<u64> {
    let fits = a.capacity_bytes().map_err(|e| tier_err("size the NVMe-oF namespace", e))?;
    if asked > fits {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "node",
            format!(
                "an NVMe tier of {asked} bytes does not fit the file system on {} ({fits} bytes usable)",
                a.device().display()
            ),
        ));
    }
    Ok(if asked == 0 { fits } else { asked })
}

/// A node as a client in its own process sees it: a writer whose replica lies in this node's
/// segment records the commit here itself, before its `PutEnd` (which names the node, so the
/// master sends it no record): one round trip fewer for every put an engine makes into its own
/// segment. Only objects without persistence (a lazy write-back and an eager persisted copy
/// start from the master's record). The master's drops name the version they mean, so an older
/// drop of the same range that arrives after such a commit leaves it alone.
#[derive(Clone)]
struct Embedded(std::sync::Weak<Inner>);

impl LocalNode for Embedded {
    fn commit(&self, c: &LocalCommit<'_>) -> Option<u64> {
        let inner = self.0.upgrade()?;
        let (segment, offset) = inner.memory_offset(c.addr, c.size)?;
        inner.commit(vec![kvfs_proto::store::CommitItem {
            key: c.key.to_string(),
            segment,
            offset,
            size: c.size,
            checksum: c.checksum,
            version: c.version,
            persistence: kvfs_proto::store::Persistence::None,
            pin: c.pin,
        }]);
        inner.count_writer_commit();
        Some(inner.id)
    }

    fn undo(&self, c: &LocalCommit<'_>) {
        let Some(inner) = self.0.upgrade() else { return };
        let Some((segment, offset)) = inner.memory_offset(c.addr, c.size) else { return };
        inner.drop_copies(vec![kvfs_proto::store::DropItem {
            key: c.key.to_string(),
            segment,
            offset,
            len: c.size,
            version: c.version,
        }]);
    }
}

/// A device block as a Transfer Engine reaches it ([`kvfs_transfer::DeviceMemory`]): what the
/// node registers for its HBM segment.
pub struct HbmDevice(pub Arc<kvfs_tiers::HbmBlock>);

impl kvfs_transfer::DeviceMemory for HbmDevice {
    fn read(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String> {
        self.0.read(offset, dst).map_err(|e| e.to_string())
    }

    fn write(&self, offset: u64, src: &[u8]) -> std::result::Result<(), String> {
        self.0.write(offset, src).map_err(|e| e.to_string())
    }

    fn pin_host(&self, addr: u64, len: u64) -> bool {
        // SAFETY: the engine pins only regions it keeps registered (mapped), and unpins them
        // when they are unregistered.
        unsafe { self.0.pin_host(addr, len) }
    }

    fn unpin_host(&self, addr: u64) {
        self.0.unpin_host(addr)
    }
}

/// Looks for a CUDA driver; allocates `hbm_bytes` of GPU memory on device 0 for the HBM
/// segment when asked. Where no driver is found, says so (and refuses a request for HBM
/// bytes). Returns whether a driver is present, and the block.
fn probe_hbm(hbm_bytes: u64) -> Result<(bool, Option<Arc<kvfs_tiers::HbmBlock>>)> {
    let present = kvfs_tiers::hbm::driver_present();
    if hbm_bytes == 0 {
        if present {
            tracing::info!("HBM tier: CUDA driver found (no HBM bytes configured)");
        } else {
            tracing::info!("HBM tier: off, no CUDA driver (libcuda.so) found on this machine");
        }
        return Ok((present, None));
    }
    match kvfs_tiers::HbmBlock::open(0, hbm_bytes) {
        Ok(b) => {
            tracing::info!(
                bytes = hbm_bytes,
                base = b.base(),
                "HBM segment: GPU memory on device 0"
            );
            Ok((true, Some(Arc::new(b))))
        }
        Err(e) => Err(Error::new(
            ErrorKind::Unavailable,
            "node",
            format!("{hbm_bytes} bytes of HBM were asked for, but the HBM tier cannot open: {e}"),
        )),
    }
}

/// The offset of `[addr, addr+size)` in the range `[base, base+len)`, when it lies inside.
fn within(addr: u64, size: u64, base: u64, len: u64) -> Option<u64> {
    let offset = addr.checked_sub(base)?;
    let end = offset.checked_add(size)?;
    (end <= len).then_some(offset)
}

impl Inner {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The offset in the DRAM segment of `[addr, addr+size)`, when it lies inside it.
    fn dram_offset(&self, addr: u64, size: u64) -> Option<u64> {
        within(addr, size, self.dram.addr(), self.dram.len() as u64)
    }

    /// The memory segment (DRAM or HBM) holding `[addr, addr+size)` and the offset there.
    fn memory_offset(&self, addr: u64, size: u64) -> Option<(u32, u64)> {
        if let Some(off) = self.dram_offset(addr, size) {
            return Some((DRAM_SEGMENT, off));
        }
        let hbm = self.hbm.as_ref()?;
        within(addr, size, hbm.base(), hbm.len()).map(|off| (HBM_SEGMENT, off))
    }

    async fn apply(self: Arc<Self>, req: NodeRequest) -> NodeResponse {
        match req {
            NodeRequest::Commit(items) => {
                self.commit(items);
                NodeResponse::Done
            }
            NodeRequest::Drop(items) => {
                self.drop_copies(items);
                NodeResponse::Done
            }
            NodeRequest::Persist(items) => NodeResponse::Persisted(self.persist(items).await),
            NodeRequest::Load(items) => NodeResponse::Loaded(self.load(items).await),
            NodeRequest::Rename(items) => {
                self.rename(items).await;
                NodeResponse::Done
            }
        }
    }

    /// A guarded read of our DRAM segment (a client reading a location it cached under a
    /// lease, without asking the master): served while the index still holds that version of
    /// that key around the range, and counted as an access for the tier policy like the reads
    /// the master reports.
    fn vouches(&self, addr: u64, len: u64, guard: &[u8]) -> bool {
        let Some((version, key)) = read_guard::decode(guard) else { return false };
        let Some((segment, offset)) = self.memory_offset(addr, len) else { return false };
        let ok = self
            .index
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .vouches(key, version, segment, offset, len);
        if ok {
            self.on_served_read(key);
        }
        ok
    }

    /// A writer's noted write into our DRAM segment: its bytes are in place, and the note is
    /// the commit record of the object they are ([`kvfs_proto::store::CommitNote`]), recorded
    /// now so the writer's `PutEnd` needs no record from the master. Refused (the master then
    /// sends the record) for a note that does not decode or a range outside the segment.
    fn noted_commit(self: &Arc<Self>, addr: u64, len: u64, note: &[u8]) -> bool {
        let Some(note) = kvfs_proto::store::CommitNote::decode(note) else { return false };
        let Some((segment, offset)) = self.memory_offset(addr, len) else { return false };
        self.commit(vec![kvfs_proto::store::CommitItem {
            key: note.key,
            segment,
            offset,
            size: len,
            checksum: None,
            version: note.version,
            persistence: kvfs_proto::store::Persistence::None,
            pin: note.pin,
        }]);
        self.count_writer_commit();
        true
    }

    fn registration(&self) -> NodeRegistration {
        let held = self.index.lock().unwrap_or_else(|e| e.into_inner()).held_objects();
        let mut segments = vec![SegmentSpec {
            index: DRAM_SEGMENT,
            tier: Tier::Dram,
            base_addr: self.dram.addr(),
            capacity: self.dram.len() as u64,
        }];
        if let Some(hbm) = &self.hbm {
            segments.push(SegmentSpec {
                index: HBM_SEGMENT,
                tier: Tier::Hbm,
                base_addr: hbm.base(),
                capacity: hbm.len(),
            });
        }
        if self.tiers.nvme.is_some() {
            let capacity =
                self.index.lock().unwrap_or_else(|e| e.into_inner()).nvme_alloc.region_bytes();
            segments.push(SegmentSpec {
                index: NVME_SEGMENT,
                tier: Tier::Nvme,
                base_addr: 0,
                capacity,
            });
        }
        NodeRegistration {
            node: self.id,
            host: kvfs_transfer::host_id().to_string(),
            endpoint: self.engine.name().to_string(),
            segments,
            held,
            reconnect: self.registered_once.load(Ordering::Acquire),
        }
    }
}

/// Register, heartbeat, and start over whenever the master goes away.
async fn run(inner: Arc<Inner>, link: Arc<MasterLink>) {
    let mut backoff = Duration::from_millis(50);
    let backoff_max = Duration::from_millis(inner.cfg.reconnect_backoff_max_ms.max(50));
    loop {
        match register(&inner, &link).await {
            Ok(heartbeat) => {
                backoff = Duration::from_millis(50);
                // `send` would not store the value while nobody subscribes.
                inner.registered.send_replace(true);
                heartbeat_until_lost(&inner, &link, heartbeat).await;
                inner.registered.send_replace(false);
            }
            Err(e) => {
                tracing::debug!(node = inner.id, error = %e, "registration failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(backoff_max);
            }
        }
    }
}

async fn register(inner: &Inner, link: &MasterLink) -> Result<Duration> {
    let reg = inner.registration();
    let held = reg.held.len();
    // The master adopts every object before it answers (about 2 us each, more under load).
    let timeout = link.timeout() + Duration::from_micros(20 * held as u64);
    match link.call_within("register", &MasterRequest::RegisterNode(reg), timeout).await? {
        MasterResponse::Registered(Ok(ack)) => {
            inner.registered_once.store(true, Ordering::Release);
            tracing::info!(
                node = inner.id,
                held,
                adopted = ack.adopted,
                conflicts = ack.conflicts,
                "registered with the master"
            );
            Ok(Duration::from_millis(ack.heartbeat_ms.max(10)))
        }
        MasterResponse::Registered(Err(e)) => Err(Error::from_wire("register", &e)),
        other => {
            Err(Error::new(ErrorKind::Internal, "register", format!("unexpected answer {other:?}")))
        }
    }
}

/// Heartbeats until the master forgets the node or the connection fails.
async fn heartbeat_until_lost(inner: &Inner, link: &MasterLink, every: Duration) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            // A new leader (HA): register with it now rather than at the next heartbeat.
            _ = link.leader_changed() => {
                tracing::info!(node = inner.id, "the master's leader changed; registering with the new one");
                return;
            }
        }
        let req = MasterRequest::Heartbeat { node: inner.id, stats: inner.stats() };
        let answer = tokio::select! {
            a = link.call("heartbeat", &req) => a,
            // A leader that stopped answering was replaced: do not wait out the call.
            _ = link.leader_changed() => {
                tracing::info!(node = inner.id, "the master's leader changed; registering with the new one");
                return;
            }
        };
        match answer {
            Ok(MasterResponse::Heartbeat(Ok(ack))) => inner.on_accessed(ack.accessed),
            Ok(MasterResponse::Heartbeat(Err(e))) if e.code == ErrorCode::NodeUnknown => {
                tracing::warn!(
                    node = inner.id,
                    "the master does not know this node; registering again"
                );
                return;
            }
            Ok(other) => {
                tracing::warn!(node = inner.id, answer = ?other, "unexpected heartbeat answer");
                return;
            }
            Err(e) => {
                tracing::warn!(node = inner.id, error = %e, "lost the master; reconnecting");
                return;
            }
        }
    }
}
