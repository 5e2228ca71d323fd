//! The store client: puts and gets of whole objects, zero-copy from and into registered memory,
//! batches of everything, and the metadata calls.
//!
//! Put: `PutStart` for the whole batch (the master allocates one range per replica on distinct
//! nodes), then one Transfer Engine batch writes every replica of every object in parallel,
//! then `PutEnd` for the objects whose replicas were all written and `PutRevoke` for the rest.
//! First writer wins: a key that already exists is a success that keeps the old value; a key
//! another writer is still putting is retried until it completes (then it exists) or until
//! the retry budget runs out (`PutInProgress`).
//!
//! Get: `Get` for the whole batch (grants read leases), then one Transfer Engine batch reads
//! each object from its best replica (same host first, then the least loaded by bytes in
//! flight from this client), straight into the destination; items whose replica failed are
//! read again from their next replica, until none is left.
//!
//! The bytes API (`put`, `get`) stages through registered buffers; the zero-copy API
//! (`put_from`, `get_into`) moves bytes directly from and into memory registered with the
//! client's engine ([`Client::engine`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_proto::store::{
    CommitNote, DirPage, ErrorCode, JobSpec, JobStatus, ListPage, MasterRequest, MasterResponse,
    MasterStats, ObjectView, Persistence, Pin, PutEndItem, PutGrant, PutStartItem, RemoveCounts,
    RenameItem, RenameMode, ReplicaDesc, Role, Strategy, Tier, WireError,
};
use kvfs_transfer::{Engine, EngineConfig, SegmentHandle, TransferOp, TransferRequest};

use crate::locations::{self, Location, Locations};
use crate::master::MasterLink;
use crate::staging::{Staged, StagingPool};
use crate::{Error, ErrorKind, Result};
use kvfs_proto::store::{TENANT_PREFIX, valid_tenant};

/// How a put places and protects its objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Replicas on distinct nodes (best effort: at least one).
    pub replicas: u8,
    pub persistence: Persistence,
    pub pin: Pin,
    pub strategy: Strategy,
    /// Replace an existing object instead of keeping the first value.
    pub upsert: bool,
    /// Nodes to place on first, by Transfer Engine segment name.
    pub preferred_endpoints: Vec<String>,
    /// Compute a blake3 checksum of the bytes and record it with the object.
    pub checksum: bool,
    /// The memory tier of the replicas: `Dram`, or `Hbm` on nodes that contribute GPU memory.
    pub tier: Tier,
}

impl Default for PutOptions {
    fn default() -> Self {
        PutOptions {
            replicas: 1,
            persistence: Persistence::None,
            pin: Pin::None,
            strategy: Strategy::Random,
            upsert: false,
            preferred_endpoints: Vec::new(),
            checksum: false,
            tier: Tier::Dram,
        }
    }
}

/// A node in the client's own process (see [`Client::connect_local`]): a writer whose replica
/// lies in its segment records the commit there itself.
pub trait LocalNode: Send + Sync {
    /// Records a complete object at `c.addr` of the node's DRAM segment; the node's id when it
    /// did (`None`: the node has stopped, or the range is not in its segment).
    fn commit(&self, c: &LocalCommit<'_>) -> Option<u64>;
    /// Takes back a commit whose `PutEnd` failed (only that version at that range).
    fn undo(&self, c: &LocalCommit<'_>);
}

/// An object a client wrote into its own process's node.
pub struct LocalCommit<'a> {
    pub key: &'a str,
    /// Engine address of the replica (inside the node's DRAM segment).
    pub addr: u64,
    pub size: u64,
    pub version: u64,
    pub checksum: Option<[u8; 32]>,
    pub pin: Pin,
}

/// Configuration of a client.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Master address, `host:port`.
    pub master: String,
    pub engine: EngineConfig,
    /// One master call fails after this long.
    pub rpc_timeout_ms: u64,
    /// How long a put keeps retrying keys that another writer is putting (or while the master
    /// recovers) before it reports `PutInProgress` / `Recovering`.
    pub retry_budget_ms: u64,
    /// Staging buffers kept for reuse by the bytes API.
    pub staging_cached_bytes_max: usize,
    /// Bytes the bytes API may stage at once (the reference system's `local_buffer_size`);
    /// a put or get that does not fit fails instead of growing the staging memory.
    pub staging_bytes_max: usize,
    /// The tenant this client works for (the reference's `tenant_id`): its keys live in the
    /// namespace `tenants/TENANT/`, which this client adds to every key it sends and strips
    /// from every key it lists, and the master holds the tenant to its quotas. `None`: the
    /// whole key space (an administrator sees tenants' objects under `tenants/`).
    pub tenant: Option<String>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            master: "127.0.0.1:50051".into(),
            engine: EngineConfig::default(),
            rpc_timeout_ms: 5_000,
            retry_budget_ms: 15_000,
            staging_cached_bytes_max: 256 << 20,
            staging_bytes_max: usize::MAX,
            tenant: None,
        }
    }
}

/// One object of a zero-copy put: `len` bytes at `addr`, in memory registered with the engine.
#[derive(Debug, Clone, Copy)]
pub struct PutFrom<'a> {
    pub key: &'a str,
    pub addr: u64,
    pub len: u64,
}

/// Where the bytes of a put's items live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Memory {
    /// Registered with the engine (the zero-copy calls): anything else is refused.
    Registered,
    /// The caller's own slices, alive for the call ([`Client::put_batch_lent`]): written
    /// straight into this process's own segment, staged for any other replica unless they
    /// happen to be registered.
    Borrowed,
}

/// One object of a zero-copy get: into at most `cap` bytes at `addr` (registered memory).
#[derive(Debug, Clone, Copy)]
pub struct GetInto<'a> {
    pub key: &'a str,
    pub addr: u64,
    pub cap: u64,
}

/// What the master knows of an object.
pub type ObjectInfo = ObjectView;

/// Values and objects at least this large move straight between the engine and memory a
/// caller lends ([`Client::put_batch_lent`], [`Client::get_batch_lent`]); smaller ones are
/// staged, where a copy costs less than registering memory for one call.
pub const LEND_BYTES_MIN: u64 = 256 << 10;

/// Keeps lent memory valid while transfers use it.
pub type Keeper = Arc<dyn std::any::Any + Send + Sync>;

/// Where a get left an object's bytes: a staging buffer on loan, or the caller's own
/// allocation ([`Client::get_batch_lent`]) with the object's length. Every transfer into the
/// allocation has finished; other references to it are only keep-alives about to be dropped.
pub enum Fetched<T> {
    Staged(StagedBytes),
    Lent(Arc<T>, usize),
}

/// Caller memory registered with the engine for one call; unregistered when dropped (the
/// transfers that used it hold its keeper until they have finished).
struct Lent {
    engine: Engine,
    addr: u64,
}

impl Lent {
    /// Registers `[addr, addr+len)` kept valid by `keeper`; `None` when the engine refuses
    /// (for example memory overlapping a registered region), and the caller stages instead.
    fn register(engine: &Engine, addr: u64, len: u64, keeper: Keeper) -> Option<Lent> {
        // SAFETY: the callers' contract (`put_batch_lent`, `get_batch_lent`): `keeper` keeps
        // the memory valid, and the engine holds it for every transfer using the region.
        unsafe { engine.register_memory_owned(addr, len, keeper) }.ok()?;
        Some(Lent { engine: engine.clone(), addr })
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let _ = self.engine.unregister(self.addr);
    }
}

/// Lends slices the caller only borrowed to the engine for one call (a Rust `put` of `&[u8]`):
/// the keeper it hands out is held by every transfer reading the slices, and dropping the
/// `Borrowed` waits until none is left. A call that finishes has no transfer left by then; a
/// call whose future is dropped midway (a timeout around it) blocks its thread (off the
/// runtime's worker, see [`may_borrow`]) until the transfers it started let go, which the
/// engine bounds by their deadline, so the borrow never ends while a transfer still reads the
/// caller's memory.
struct Borrowed {
    keeper: Arc<()>,
    /// How long the transfers can hold on (their deadline); past it the wait logs, once.
    bound: Duration,
}

/// How long dropping a [`Borrowed`] polls before it moves off the runtime's worker to wait.
const BORROW_SPIN: Duration = Duration::from_micros(50);

impl Borrowed {
    fn new(op_timeout: Duration) -> Borrowed {
        Borrowed { keeper: Arc::new(()), bound: op_timeout + Duration::from_secs(1) }
    }

    fn keeper(&self) -> Keeper {
        self.keeper.clone()
    }

    fn lent(&self) -> bool {
        Arc::strong_count(&self.keeper) > 1
    }

    /// Sleeps until no transfer holds the keeper.
    fn wait(&self) {
        let start = Instant::now();
        let mut warned = false;
        while self.lent() {
            if !warned && start.elapsed() > self.bound {
                tracing::error!(
                    waited = ?start.elapsed(),
                    "a transfer still reads a borrowed put value past its deadline"
                );
                warned = true;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // A finished call's last transfer may still be dropping its hold on another thread.
        let start = Instant::now();
        while self.lent() && start.elapsed() < BORROW_SPIN {
            std::thread::yield_now();
        }
        if !self.lent() {
            return;
        }
        if may_borrow() {
            // Off the worker: its other tasks (the transfers this waits for) move on meanwhile.
            tokio::task::block_in_place(|| self.wait());
        } else {
            self.wait();
        }
    }
}

/// Whether a call may lend borrowed slices ([`Borrowed`]): only on tokio's multi-thread
/// runtime, where a dropped call's wait can hand its worker's other tasks (the engine's socket
/// writers among them) to another thread; on a current-thread runtime the wait would stop the
/// very tasks it waits for, so values are staged there.
fn may_borrow() -> bool {
    use tokio::runtime::{Handle, RuntimeFlavor};
    Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread)
}

/// Where a get reads one object: the master's view, or a location this client cached under a
/// live lease (a view with that one replica, read with a guard its node checks).
struct Source {
    view: ObjectView,
    cached: bool,
}

impl Source {
    fn cached(l: Location) -> Source {
        let replica = ReplicaDesc {
            tier: Tier::Dram,
            node: None,
            endpoint: l.endpoint,
            host: String::new(),
            segment: 0,
            addr: l.addr,
            len: l.size,
        };
        let view = ObjectView {
            size: l.size,
            checksum: None,
            version: l.version,
            replicas: vec![replica],
            persistence: Persistence::None,
            pin: Pin::None,
            lease_end_ms: 0,
            lease_left_ms: 0,
        };
        Source { view, cached: true }
    }
}

/// An object's bytes in a staging buffer on loan from the client ([`Client::get_batch_staged`]);
/// derefs to the bytes, and the buffer goes back to the pool when this is dropped.
pub struct StagedBytes {
    staged: Staged,
    len: usize,
}

impl StagedBytes {
    /// The bytes as a new vector (asking for huge pages before the first touch: see
    /// `staging::vec_from`).
    pub fn to_vec_huge(&self) -> Vec<u8> {
        crate::staging::vec_from(self.staged.buffer(), self.len)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for StagedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the buffer is registered local-only (peers cannot address it), the transfer
        // that filled it has finished, and the loan is exclusive until `self` is dropped; `len`
        // is the object size, which fit the buffer when it was taken.
        unsafe { &self.staged.buffer().as_slice()[..self.len] }
    }
}

struct Inner {
    cfg: ClientConfig,
    engine: Engine,
    master: MasterLink,
    staging: Arc<StagingPool>,
    host: String,
    /// Bytes this client has in flight per node endpoint (replica choice).
    inflight: Mutex<HashMap<String, u64>>,
    rotate: AtomicUsize,
    /// Replica locations held under live leases (gets in one round trip).
    locations: Locations,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    /// The node in this process whose engine this client shares, if any: puts into its
    /// segment record their commit there themselves (one master round trip fewer).
    embedded: Option<Arc<dyn LocalNode>>,
    /// `tenants/TENANT/` for a tenant's client (see `ClientConfig::tenant`).
    prefix: Option<String>,
}

/// A connection to a kvfs cluster. Cheap to clone; all clones share one engine and one master
/// connection.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Starts the client's Transfer Engine and connects to the master.
    pub async fn connect(cfg: ClientConfig) -> Result<Client> {
        let engine = Engine::start(cfg.engine.clone())
            .await
            .map_err(|e| Error::from_transfer("start engine", &e))?;
        Client::connect_with_engine(cfg, engine).await
    }

    /// Connects to the master with an engine that is already running (`cfg.engine` is then
    /// unused). A process that embeds a [`crate::Node`] passes the node's engine, so its own
    /// reads and writes of the node's segment are plain memcpys and one segment name (the
    /// reference system's `get_hostname()`) identifies both.
    pub async fn connect_with_engine(cfg: ClientConfig, engine: Engine) -> Result<Client> {
        Client::connect_inner(cfg, engine, None).await
    }

    /// Connects with `engine`, the engine of a node running in this process, and records the
    /// commits of the objects it writes into that node's segment in the node itself (`node`)
    /// before their `PutEnd`, so such a put costs two master round trips instead of three (the
    /// master then sends the node no commit record). `kvfs_node::Node::client` calls this.
    pub async fn connect_local(
        cfg: ClientConfig,
        engine: Engine,
        node: Arc<dyn LocalNode>,
    ) -> Result<Client> {
        Client::connect_inner(cfg, engine, Some(node)).await
    }

    async fn connect_inner(
        cfg: ClientConfig,
        engine: Engine,
        embedded: Option<Arc<dyn LocalNode>>,
    ) -> Result<Client> {
        let host = kvfs_transfer::host_id().to_string();
        let timeout = Duration::from_millis(cfg.rpc_timeout_ms);
        crate::master::check_addr(&cfg.master)?;
        let prefix = match &cfg.tenant {
            Some(t) if !valid_tenant(t) => {
                let detail = format!("tenant {t:?}: a tenant is 1 to 64 of A-Z a-z 0-9 . _ -");
                return Err(Error::new(ErrorKind::InvalidArgument, "connect", detail));
            }
            Some(t) => Some(format!("{TENANT_PREFIX}{t}/")),
            None => None,
        };
        let master = MasterLink::new(
            cfg.master.clone(),
            Role::Client,
            host.clone(),
            kvfs_rpc::no_handler(),
            timeout,
            engine.config().cluster_secret,
        );
        master.conn().await?;
        let staging =
            StagingPool::new(engine.clone(), cfg.staging_cached_bytes_max, cfg.staging_bytes_max);
        Ok(Client {
            inner: Arc::new(Inner {
                cfg,
                engine,
                master,
                staging,
                host,
                inflight: Mutex::new(HashMap::new()),
                rotate: AtomicUsize::new(0),
                locations: Locations::default(),
                cache_hits: AtomicU64::new(0),
                cache_misses: AtomicU64::new(0),
                embedded,
                prefix,
            }),
        })
    }

    /// The client's Transfer Engine: register buffers here for the zero-copy calls.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    pub fn master_addr(&self) -> &str {
        self.inner.master.addr()
    }

    /// Host identity used for same-host-first replica choice.
    pub fn host(&self) -> &str {
        &self.inner.host
    }

    pub async fn close(&self) {
        self.inner.master.close().await;
    }

    async fn call(&self, op: &'static str, req: &MasterRequest) -> Result<MasterResponse> {
        self.inner.master.call(op, req).await
    }

    // ----- puts ----------------------------------------------------------------------------

    /// Zero-copy put of one object.
    pub async fn put_from(&self, key: &str, addr: u64, len: u64, opts: &PutOptions) -> Result<()> {
        let mut r = self.put_from_batch(&[PutFrom { key, addr, len }], opts).await;
        r.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "put", "no result")))
    }

    /// Zero-copy put of many objects: one master round trip to start, one transfer batch,
    /// one to end. Results are per item, in order.
    pub async fn put_from_batch(
        &self,
        items: &[PutFrom<'_>],
        opts: &PutOptions,
    ) -> Vec<Result<()>> {
        self.put_from_memory(items, opts, Memory::Registered).await
    }

    async fn put_from_memory(
        &self,
        items: &[PutFrom<'_>],
        opts: &PutOptions,
        mem: Memory,
    ) -> Vec<Result<()>> {
        // Keys are copied into the tenant's namespace only for a tenant's client: the common
        // put path allocates nothing more.
        let names: Vec<String>;
        let scoped: Vec<PutFrom>;
        let items = match &self.inner.prefix {
            None => items,
            Some(p) => {
                names = items.iter().map(|i| format!("{p}{}", i.key)).collect();
                scoped = items
                    .iter()
                    .zip(&names)
                    .map(|(i, k)| PutFrom { key: k, addr: i.addr, len: i.len })
                    .collect();
                &scoped[..]
            }
        };
        let chunks = chunks_within(items.iter().map(|i| i.len), PUT_CHUNK_ITEMS_MAX);
        if chunks.len() > 1 {
            let runs = chunks.iter().map(|r| self.put_from_chunk(&items[r.clone()], opts, mem));
            return futures_util::future::join_all(runs).await.into_iter().flatten().collect();
        }
        self.put_from_chunk(items, opts, mem).await
    }

    async fn put_from_chunk(
        &self,
        items: &[PutFrom<'_>],
        opts: &PutOptions,
        mem: Memory,
    ) -> Vec<Result<()>> {
        let mut out: Vec<Option<Result<()>>> = vec![None; items.len()];
        let deadline = Instant::now() + Duration::from_millis(self.inner.cfg.retry_budget_ms);
        let mut todo: Vec<usize> = (0..items.len()).collect();
        let mut backoff = Duration::from_millis(5);
        let mut replacements_left = PUT_REPLACEMENTS_MAX;
        while !todo.is_empty() {
            let replace = replacements_left > 0;
            let (retry, replaced) =
                self.put_round(items, &todo, opts, replace, mem, &mut out).await;
            replacements_left -= u32::from(replaced);
            if retry.is_empty() {
                break;
            }
            if Instant::now() + backoff > deadline {
                for (i, e) in retry {
                    out[i] = Some(Err(e.with_key(items[i].key)));
                }
                break;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(200));
            todo = retry.into_iter().map(|(i, _)| i).collect();
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "put", "no result"))))
            .collect()
    }

    /// One round of puts for the items `todo`; returns the items to retry (another writer's put
    /// in progress, master recovering, and with `replace` a replica on a segment that turned
    /// out dead) with the error to report if the budget runs out, and whether any item is
    /// retried for a dead segment.
    async fn put_round(
        &self,
        items: &[PutFrom<'_>],
        todo: &[usize],
        opts: &PutOptions,
        replace: bool,
        mem: Memory,
        out: &mut [Option<Result<()>>],
    ) -> (Vec<(usize, Error)>, bool) {
        let starts: Vec<PutStartItem> = todo
            .iter()
            .map(|&i| PutStartItem {
                key: items[i].key.to_string(),
                size: items[i].len,
                replicas: opts.replicas,
                persistence: opts.persistence,
                pin: opts.pin,
                strategy: opts.strategy,
                preferred_endpoints: opts.preferred_endpoints.clone(),
                tier: opts.tier,
                upsert: opts.upsert,
            })
            .collect();
        let req = MasterRequest::PutStart { client_host: self.inner.host.clone(), items: starts };
        let grants = match self.call("put", &req).await {
            Ok(MasterResponse::PutStart(g)) if g.len() == todo.len() => g,
            Ok(other) => return (fail_all(todo, out, unexpected("put", &other)), false),
            Err(e) => return (fail_all(todo, out, e), false),
        };
        let mut retry = Vec::new();
        let mut granted = Vec::new();
        for (&i, g) in todo.iter().zip(grants) {
            match g {
                Ok(g) => granted.push((i, g)),
                Err(e) => {
                    let err = Error::from_wire("put", &e).with_key(items[i].key);
                    match err.kind() {
                        ErrorKind::AlreadyExists => out[i] = Some(Ok(())),
                        ErrorKind::PutInProgress | ErrorKind::Recovering => retry.push((i, err)),
                        _ => out[i] = Some(Err(err)),
                    }
                }
            }
        }
        if granted.is_empty() {
            return (retry, false);
        }
        let written = self.write_replicas(items, &granted, opts, mem).await;
        let mut ends = Vec::new();
        let mut revokes = Vec::new();
        let mut replaced = false;
        for ((i, g), w) in granted.iter().zip(written) {
            match w {
                Ok(noted) => ends.push((*i, g, noted)),
                Err(Failed { error, dead_segment }) => {
                    // A replica on a dead segment: the master stops placing there as soon as
                    // the owner's connection closes, so the same put placed again lands on a
                    // live node.
                    let error = error.with_key(items[*i].key);
                    if replace && dead_segment {
                        replaced = true;
                        retry.push((*i, error));
                    } else {
                        out[*i] = Some(Err(error));
                    }
                    revokes.push(items[*i].key.to_string());
                }
            }
        }
        if !revokes.is_empty() {
            // Best effort: an unrevoked put expires on the master after put_timeout_ms.
            let _ = self.call("put", &MasterRequest::PutRevoke(revokes)).await;
        }
        if !ends.is_empty() {
            self.put_end(items, &ends, opts, out).await;
        }
        (retry, replaced)
    }

    /// Completes the written puts `ends` (item, grant, and the nodes that recorded the commit
    /// from the write's note).
    async fn put_end(
        &self,
        items: &[PutFrom<'_>],
        ends: &[(usize, &PutGrant, Vec<u64>)],
        opts: &PutOptions,
        out: &mut [Option<Result<()>>],
    ) {
        // An upsert gives the key a new version: a location of the old one would only be
        // refused by its node.
        for &(i, _, _) in ends {
            self.inner.locations.forget(items[i].key);
        }
        let mut local = Vec::new();
        let req = MasterRequest::PutEnd(
            ends.iter()
                .map(|(i, g, noted)| {
                    let (i, it) = (*i, &items[*i]);
                    let checksum = opts.checksum.then(|| registered_blake3(it.addr, it.len));
                    let mut committed_on = noted.clone();
                    if let Some((node, c)) = self.commit_locally(it, g, checksum, opts.pin) {
                        local.push((i, c));
                        committed_on.push(node);
                    }
                    PutEndItem {
                        key: it.key.to_string(),
                        checksum,
                        version: Some(g.version),
                        committed_on,
                    }
                })
                .collect(),
        );
        match self.call("put", &req).await {
            Ok(MasterResponse::PutEnd(r)) if r.len() == ends.len() => {
                for (&(i, _, _), r) in ends.iter().zip(r) {
                    out[i] =
                        Some(r.map_err(|e| Error::from_wire("put", &e).with_key(items[i].key)));
                }
            }
            Ok(other) => {
                let e = unexpected("put", &other);
                ends.iter().for_each(|&(i, _, _)| out[i] = Some(Err(e.clone())));
            }
            Err(e) => ends.iter().for_each(|&(i, _, _)| out[i] = Some(Err(e.clone()))),
        }
        // A put that failed (or whose answer was lost) takes its local commit back: the node
        // must not keep a name the master may never have completed.
        let Some(node) = &self.inner.embedded else { return };
        for (i, c) in local {
            if matches!(out[i], Some(Err(_))) {
                node.undo(&c);
            }
        }
    }

    /// Records the commit of `g`'s replica in this process's node, when it has one there and
    /// the object has no persistence: the node's id and the commit, for the `PutEnd`.
    fn commit_locally<'k>(
        &self,
        it: &PutFrom<'k>,
        g: &PutGrant,
        checksum: Option<[u8; 32]>,
        pin: Pin,
    ) -> Option<(u64, LocalCommit<'k>)> {
        let node = self.inner.embedded.as_ref()?;
        if g.persistence != Persistence::None {
            return None;
        }
        let own = self.inner.engine.name();
        let r = g.replicas.iter().find(|r| r.endpoint == own && r.tier == Tier::Dram)?;
        let c = LocalCommit {
            key: it.key,
            addr: r.addr,
            size: it.len,
            version: g.version,
            checksum,
            pin,
        };
        node.commit(&c).map(|id| (id, c))
    }

    /// Writes every replica of every granted object; per grant, `Ok` when all of its replicas
    /// were written, with the nodes that recorded the commit from the write itself (a lone
    /// put's noted writes, see [`Client::write_noted`]). A small object's replica in this
    /// process's own segment is one copy on this task ([`Engine::write_own`]); the others go
    /// in one transfer batch, from registered memory: borrowed bytes that are not registered
    /// are staged first.
    async fn write_replicas(
        &self,
        items: &[PutFrom<'_>],
        granted: &[(usize, PutGrant)],
        opts: &PutOptions,
        mem: Memory,
    ) -> Vec<Result<Vec<u64>, Failed>> {
        let engine = &self.inner.engine;
        let own = engine.name();
        let copy_max = engine.config().shm_parallel_bytes_min;
        let own_copy =
            |r: &ReplicaDesc, len: u64| r.endpoint == own && r.tier == Tier::Dram && len < copy_max;
        let mut status: Vec<Result<Vec<u64>, Failed>> = vec![Ok(Vec::new()); granted.len()];
        // Per object: the address its engine transfers read from (the engine refuses it when
        // not registered), and whether its own-segment replicas may be copied from `it.addr`
        // (borrowed bytes always; zero-copy memory only when registered, as the engine would
        // check). The staging buffers are held until the transfers are done.
        let mut srcs = Vec::with_capacity(granted.len());
        let mut staged = Vec::new();
        for (gi, (i, g)) in granted.iter().enumerate() {
            let it = &items[*i];
            let to_own = g.replicas.iter().any(|r| own_copy(r, it.len));
            let to_engine = g.replicas.iter().any(|r| !own_copy(r, it.len));
            let src = match mem {
                Memory::Registered => (it.addr, to_own && engine.is_registered(it.addr, it.len)),
                Memory::Borrowed if !to_engine || engine.is_registered(it.addr, it.len) => {
                    (it.addr, true)
                }
                Memory::Borrowed => {
                    // SAFETY: borrowed memory is the caller's live slice of `len` bytes.
                    let data = unsafe {
                        std::slice::from_raw_parts(it.addr as *const u8, it.len as usize)
                    };
                    match self.stage(data) {
                        Ok(s) => {
                            let addr = s.buffer().addr();
                            staged.push(s);
                            (addr, true)
                        }
                        Err(error) => {
                            status[gi] = Err(Failed { error, dead_segment: false });
                            (it.addr, false)
                        }
                    }
                }
            };
            srcs.push(src);
        }
        if let [(i, g)] = granted
            && status[0].is_ok()
            && let Some(done) =
                self.write_noted(&PutFrom { addr: srcs[0].0, ..items[*i] }, g, opts).await
        {
            return vec![done];
        }
        let mut reqs = Vec::with_capacity(granted.len());
        let mut owner = Vec::with_capacity(granted.len());
        // Copies into this process's own segment, `(replica address, bytes)`, and their grants.
        let (mut own_copies, mut own_grants): (Vec<(u64, &[u8])>, Vec<usize>) = Default::default();
        for (gi, (i, g)) in granted.iter().enumerate() {
            if status[gi].is_err() {
                continue;
            }
            let (it, (src, own_ok)) = (&items[*i], srcs[gi]);
            for r in &g.replicas {
                if own_ok && own_copy(r, it.len) {
                    // SAFETY: `it.addr` holds `len` live bytes: the caller's borrowed slice, or
                    // a registered range (checked above, as the engine checks it).
                    let data = unsafe {
                        std::slice::from_raw_parts(it.addr as *const u8, it.len as usize)
                    };
                    own_copies.push((r.addr, data));
                    own_grants.push(gi);
                    continue;
                }
                match self.writable_segment(r).await {
                    Ok(seg) => {
                        reqs.push(TransferRequest {
                            op: TransferOp::Write,
                            segment: seg,
                            local_addr: src,
                            remote_addr: r.addr,
                            len: it.len,
                        });
                        owner.push((gi, r.endpoint.as_str()));
                    }
                    Err(e) => status[gi] = Err(e),
                }
            }
        }
        for (gi, r) in own_grants.into_iter().zip(engine.write_own_batch(&own_copies)) {
            if let Err(e) = r {
                let error = Error::from_transfer("put", &e);
                status[gi] = Err(Failed { error, dead_segment: false });
            }
        }
        let results = if reqs.is_empty() { Vec::new() } else { self.transfer(reqs).await };
        drop(staged);
        for ((gi, endpoint), r) in owner.into_iter().zip(results) {
            let Err(e) = r else { continue };
            let dead_segment = self.forget_if_dead(endpoint, &e).await;
            if status[gi].is_ok() {
                status[gi] = Err(Failed { error: Error::from_transfer("put", &e), dead_segment });
            }
        }
        status
    }

    /// A lone put's replicas written with noted writes: each write carries the object's
    /// commit record ([`CommitNote`]), which its node records once the bytes are in place and
    /// before it answers, so the `PutEnd` names those nodes and the master answers it without
    /// a record round trip to them: a small put takes three round trips (master, node,
    /// master), not four. `None` (write the usual way) unless the object has no persistence
    /// and no checksum, is at most [`NOTED_BYTES_MAX`] (above that the round trip is noise
    /// next to the bytes, and writes are striped), and every replica is a remote DRAM range
    /// the owner sees written (tcp; shared memory and rdma writes are one-sided). A node that
    /// refuses the note (an older node, a range it does not own) still got the bytes: the
    /// master records the commit there as usual.
    async fn write_noted(
        &self,
        it: &PutFrom<'_>,
        g: &PutGrant,
        opts: &PutOptions,
    ) -> Option<Result<Vec<u64>, Failed>> {
        if g.persistence != Persistence::None
            || opts.checksum
            || it.len == 0
            || it.len > NOTED_BYTES_MAX
        {
            return None;
        }
        let engine = &self.inner.engine;
        let own = engine.name();
        let mut targets = Vec::with_capacity(g.replicas.len());
        for r in &g.replicas {
            let node = r.node?;
            if r.tier != Tier::Dram || r.endpoint == own {
                return None;
            }
            let seg = match self.writable_segment(r).await {
                Ok(seg) => seg,
                Err(f) => return Some(Err(f)),
            };
            if !engine.guarded_is_direct(&seg, r.addr, it.len) {
                return None;
            }
            targets.push((node, r, seg));
        }
        let note: Arc<[u8]> =
            CommitNote { key: it.key.to_string(), version: g.version, pin: opts.pin }
                .encode()
                .into();
        let writes = targets.iter().map(|(node, r, seg)| {
            let note = note.clone();
            async move {
                let w = engine.write_noted(seg, it.addr, r.addr, it.len, note).await;
                (*node, r.endpoint.as_str(), w)
            }
        });
        let mut noted = Vec::with_capacity(targets.len());
        for (node, endpoint, w) in futures_util::future::join_all(writes).await {
            match w {
                Ok(true) => noted.push(node),
                Ok(false) => {}
                Err(e) => {
                    let dead_segment = self.forget_if_dead(endpoint, &e).await;
                    return Some(Err(Failed {
                        error: Error::from_transfer("put", &e),
                        dead_segment,
                    }));
                }
            }
        }
        Some(Ok(noted))
    }

    /// After a failed transfer with `endpoint`: whether the failure says the segment's owner is
    /// gone (or unreachable) rather than the request being bad, in which case the opened
    /// segment is forgotten so the next use handshakes afresh (a restarted owner on the same
    /// address is a new segment).
    async fn forget_if_dead(&self, endpoint: &str, e: &kvfs_transfer::Error) -> bool {
        use kvfs_transfer::ErrorKind as T;
        let dead =
            matches!(e.kind(), T::PeerGone | T::UnknownSegment | T::Refused | T::Timeout | T::Io);
        if dead {
            self.inner.engine.close_segment(endpoint).await;
        }
        dead
    }

    async fn writable_segment(&self, r: &ReplicaDesc) -> Result<SegmentHandle, Failed> {
        if !matches!(r.tier, Tier::Dram | Tier::Hbm) {
            let detail = format!("cannot write a {:?} replica directly", r.tier);
            let error = Error::new(ErrorKind::Internal, "put", detail);
            return Err(Failed { error, dead_segment: false });
        }
        match self.inner.engine.open_segment(&r.endpoint).await {
            Ok(seg) => Ok(seg),
            Err(e) => {
                let dead_segment = self.forget_if_dead(&r.endpoint, &e).await;
                Err(Failed { error: Error::from_transfer("put", &e), dead_segment })
            }
        }
    }

    /// Runs transfer requests in engine-sized batches; one result per request, in order.
    async fn transfer(&self, reqs: Vec<TransferRequest>) -> Vec<kvfs_transfer::Result<()>> {
        if let [one] = reqs.as_slice() {
            // One request runs on this task: no batch task to spawn and wake.
            return vec![self.inner.engine.transfer_one(one).await];
        }
        let max = self.inner.engine.config().batch_items_max;
        let mut results = Vec::with_capacity(reqs.len());
        let mut reqs = reqs.into_iter().peekable();
        while reqs.peek().is_some() {
            let chunk: Vec<_> = reqs.by_ref().take(max).collect();
            let n = chunk.len();
            match self.inner.engine.transfer(chunk).await {
                Ok(r) => results.extend(r),
                Err(e) => results.extend(std::iter::repeat_n(Err(e), n)),
            }
        }
        results
    }

    /// Puts bytes (see [`Client::put_batch`]).
    pub async fn put(&self, key: &str, data: &[u8], opts: &PutOptions) -> Result<()> {
        let mut r = self.put_batch(&[(key, data)], opts).await;
        r.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "put", "no result")))
    }

    /// Puts the concatenation of `parts` as one object (e.g. a small header and a KV block).
    pub async fn put_parts(&self, key: &str, parts: &[&[u8]], opts: &PutOptions) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let staged = self.inner.staging.take(len)?;
        let mut off = 0;
        for p in parts {
            staged.buffer().write_at(off, p).map_err(|e| Error::from_transfer("put", &e))?;
            off += p.len();
        }
        self.put_from(key, staged.buffer().addr(), len as u64, opts).await
    }

    /// Puts many byte values; those of at least [`LEND_BYTES_MIN`] are written straight from
    /// the caller's slices (see [`Borrowed`]); smaller ones are copied from them into this
    /// process's own segment, and staged for replicas elsewhere.
    pub async fn put_batch(&self, items: &[(&str, &[u8])], opts: &PutOptions) -> Vec<Result<()>> {
        let lend = items.iter().any(|(_, d)| d.len() as u64 >= LEND_BYTES_MIN);
        if !lend || !may_borrow() {
            return self.put_batch_lent(items, opts, |_| None).await;
        }
        let borrowed = Borrowed::new(self.inner.cfg.engine.op_timeout());
        let keeper = borrowed.keeper();
        self.put_batch_lent(items, opts, |_| Some(keeper.clone())).await
    }

    /// [`Client::put_batch`] that writes values of at least [`LEND_BYTES_MIN`] straight from
    /// the caller's memory when `keeper(i)` lends something that keeps value `i`'s memory
    /// valid (a binding's reference to the object holding it): the memory is registered with
    /// the engine for the call (every transfer holds the keeper until it has finished with
    /// the bytes), so no staging copy is made. Other values are staged.
    pub async fn put_batch_lent(
        &self,
        items: &[(&str, &[u8])],
        opts: &PutOptions,
        keeper: impl Fn(usize) -> Option<Keeper>,
    ) -> Vec<Result<()>> {
        let engine = &self.inner.engine;
        // Large values are registered for the call where their keeper allows; the others are
        // written from the slices themselves (staged only for replicas outside this process).
        let lent: Vec<Option<Lent>> = items
            .iter()
            .enumerate()
            .map(|(i, (_, data))| {
                let (addr, len) = (data.as_ptr() as u64, data.len() as u64);
                if len < LEND_BYTES_MIN || engine.is_registered(addr, len) {
                    return None;
                }
                Lent::register(engine, addr, len, keeper(i)?)
            })
            .collect();
        let froms: Vec<PutFrom> = items
            .iter()
            .map(|(key, data)| PutFrom { key, addr: data.as_ptr() as u64, len: data.len() as u64 })
            .collect();
        let done = self.put_from_memory(&froms, opts, Memory::Borrowed).await;
        drop(lent);
        done
    }

    /// A staging buffer holding a copy of `data`.
    fn stage(&self, data: &[u8]) -> Result<Staged> {
        let s = self.inner.staging.take(data.len())?;
        s.buffer().write_at(0, data).map_err(|e| Error::from_transfer("put", &e))?;
        Ok(s)
    }

    // ----- gets ----------------------------------------------------------------------------

    /// Zero-copy get of one object; returns its size.
    pub async fn get_into(&self, key: &str, addr: u64, cap: u64) -> Result<u64> {
        let mut r = self.get_into_batch(&[GetInto { key, addr, cap }]).await;
        r.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no result")))
    }

    /// [`Client::get_into`] that also returns the version of the object it read, for callers
    /// that opened an older version and must not mix it up with a newer one.
    pub async fn get_into_version(&self, key: &str, addr: u64, cap: u64) -> Result<(u64, u64)> {
        let r = self.get_items(&[key], |_, _| Ok(((addr, cap), ()))).await.pop();
        let r = r.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no result")));
        r.map(|(size, version, ())| (size, version))
    }

    /// Zero-copy get of many objects: one master round trip, one transfer batch (plus one per
    /// replica fallback round); objects whose location this client cached under a live lease
    /// are read straight from their node instead (see `locations`). Returns each object's size.
    pub async fn get_into_batch(&self, items: &[GetInto<'_>]) -> Vec<Result<u64>> {
        let chunks = pipeline_chunks(items.iter().map(|i| i.cap));
        if chunks.len() > 1 {
            let runs = chunks.iter().map(|r| self.get_into_chunk(&items[r.clone()]));
            return futures_util::future::join_all(runs).await.into_iter().flatten().collect();
        }
        self.get_into_chunk(items).await
    }

    async fn get_into_chunk(&self, items: &[GetInto<'_>]) -> Vec<Result<u64>> {
        let keys: Vec<&str> = items.iter().map(|g| g.key).collect();
        let dst = |i: usize, _: &ObjectView| Ok(((items[i].addr, items[i].cap), ()));
        self.get_items(&keys, dst).await.into_iter().map(|r| r.map(|(size, _, ())| size)).collect()
    }

    /// Gets an object's bytes: a small one whose location is cached straight into its new
    /// vector where the engine can ([`Client::get_small_cached`]), else as [`Client::get_batch`]
    /// does.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>> {
        if let Some(done) = self.get_small_cached(key).await {
            return done;
        }
        let mut r = self.get_batch(&[key]).await;
        r.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no result")))
    }

    /// A get of an object under [`LEND_BYTES_MIN`] whose location is cached, received by this
    /// task straight into the vector it returns (`Engine::read_guarded_into`): no staging
    /// buffer taken and given back, no copy out of it (a 4 KiB get over tcp spent about a
    /// microsecond of its 10 on them). `None`: not cached, larger, or the engine cannot read
    /// into unregistered memory now (busy direct connection, shm or rdma only); a location its
    /// node refused or that failed is forgotten, as [`Client::get_one_cached`] does, and the
    /// caller takes the general path, which asks the master.
    async fn get_small_cached(&self, key: &str) -> Option<Result<Vec<u8>>> {
        let key = self.scoped_one(key);
        let key = key.as_ref();
        let loc = self.inner.locations.get(key, Instant::now())?;
        if loc.size >= LEND_BYTES_MIN {
            return None;
        }
        let engine = &self.inner.engine;
        let guard = crate::read_guard::encode(key, loc.version);
        let mut v = vec![0u8; loc.size as usize];
        let read = match engine.open_segment(&loc.endpoint).await {
            Ok(seg) => engine.read_guarded_into(&seg, &mut v, loc.addr, &guard).await?,
            Err(e) => Err(e),
        };
        match read {
            Ok(()) => {
                self.inner.cache_hits.fetch_add(1, Ordering::Relaxed);
                Some(Ok(v))
            }
            Err(e) => {
                self.cached_read_failed(key, &loc.endpoint, &e).await;
                None
            }
        }
    }

    /// A read through `key`'s cached location failed or its node refused it: the location is
    /// forgotten (and the node's segment too, if it is gone) and counted as a miss.
    async fn cached_read_failed(&self, key: &str, endpoint: &str, e: &kvfs_transfer::Error) {
        self.forget_if_dead(endpoint, e).await;
        self.inner.locations.forget(key);
        self.inner.cache_misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Gets many objects' bytes. Objects of [`LEND_BYTES_MIN`] and more are read straight into
    /// their new vectors (faulted in with huge pages first, registered for the call); smaller
    /// ones are staged and copied once, which costs less than a registration.
    pub async fn get_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<Vec<u8>>> {
        let alloc = |size: u64| {
            let mut v = Vec::<u8>::with_capacity(size as usize);
            let addr = v.as_mut_ptr() as usize;
            crate::staging::advise_huge_pages(addr, size as usize);
            crate::staging::prefault(addr, size as usize);
            Some((addr as u64, v))
        };
        let fetched = self.get_batch_lent(keys, alloc).await;
        fetched
            .into_iter()
            .map(|r| {
                r.map(|f| match f {
                    Fetched::Staged(s) => s.to_vec_huge(),
                    Fetched::Lent(v, len) => filled(v, len),
                })
            })
            .collect()
    }

    /// Gets an object into a staging buffer and lends it out (see [`Client::get_batch_staged`]).
    pub async fn get_staged(&self, key: &str) -> Result<StagedBytes> {
        let mut r = self.get_batch_staged(&[key]).await;
        r.pop().unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no result")))
    }

    /// Gets many objects into staging buffers and lends them out: a binding copies each once,
    /// straight into its own object, instead of through an intermediate `Vec`. Each buffer
    /// goes back to the pool (and its bytes count against `staging_bytes_max`) until dropped.
    /// Objects without a staging buffer are not read (their error is reported instead).
    pub async fn get_batch_staged<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<StagedBytes>> {
        let keys: Vec<&str> = keys.iter().map(|k| k.as_ref()).collect();
        let staging = &self.inner.staging;
        let dst = |_: usize, v: &ObjectView| {
            let s = staging.take(v.size as usize)?;
            Ok(((s.buffer().addr(), v.size), s))
        };
        self.get_items(&keys, dst)
            .await
            .into_iter()
            .map(|r| r.map(|(len, _, staged)| StagedBytes { staged, len: len as usize }))
            .collect()
    }

    /// [`Client::get_batch_staged`] that reads objects of at least [`LEND_BYTES_MIN`] straight
    /// into memory the caller allocates: `alloc(size)` gives the address of `size` writable
    /// bytes and what keeps them valid (a binding's new, not yet shared object), or `None` to
    /// stage that object. The memory is registered with the engine for the call, so the
    /// bytes land in the caller's object with no copy after the transfer.
    pub async fn get_batch_lent<K, T, A>(&self, keys: &[K], mut alloc: A) -> Vec<Result<Fetched<T>>>
    where
        K: AsRef<str>,
        T: Send + Sync + 'static,
        A: FnMut(u64) -> Option<(u64, T)>,
    {
        enum Dst<T> {
            Staged(Staged),
            Lent(Arc<T>, Lent),
        }
        let keys: Vec<&str> = keys.iter().map(|k| k.as_ref()).collect();
        let (staging, engine) = (&self.inner.staging, &self.inner.engine);
        let dst = |_: usize, v: &ObjectView| {
            if v.size >= LEND_BYTES_MIN
                && let Some((addr, t)) = alloc(v.size)
            {
                let keep = Arc::new(t);
                if let Some(l) = Lent::register(engine, addr, v.size, keep.clone()) {
                    return Ok(((addr, v.size), Dst::Lent(keep, l)));
                }
            }
            let s = staging.take(v.size as usize)?;
            Ok(((s.buffer().addr(), v.size), Dst::Staged(s)))
        };
        self.get_items(&keys, dst)
            .await
            .into_iter()
            .map(|r| {
                let (len, _, d) = r?;
                match d {
                    Dst::Staged(staged) => {
                        Ok(Fetched::Staged(StagedBytes { staged, len: len as usize }))
                    }
                    Dst::Lent(keep, lent) => {
                        drop(lent);
                        Ok(Fetched::Lent(keep, len as usize))
                    }
                }
            })
            .collect()
    }

    /// Every get: where each object is (a location cached under a live lease, else the
    /// master's `Get`), a destination per object from `dst` (called once per object and
    /// attempt, in item order), the reads. An object read through a cached location that its
    /// node no longer vouches for (or that failed) is asked of the master and read again,
    /// once. Returns each object's size and version, and what `dst` gave with its destination.
    async fn get_items<T, F>(&self, keys: &[&str], mut dst: F) -> Vec<Result<(u64, u64, T)>>
    where
        F: FnMut(usize, &ObjectView) -> Result<((u64, u64), T)>,
    {
        // As in `put_from_batch`: a copy of the keys only for a tenant's client.
        let names: Vec<String>;
        let scoped: Vec<&str>;
        let keys = match &self.inner.prefix {
            None => keys,
            Some(p) => {
                names = keys.iter().map(|k| format!("{p}{k}")).collect();
                scoped = names.iter().map(String::as_str).collect();
                &scoped[..]
            }
        };
        if let [key] = keys
            && let Some(done) = self.get_one_cached(key, &mut dst).await
        {
            return vec![done];
        }
        let n = keys.len();
        let mut out: Vec<Option<Result<(u64, u64, T)>>> = (0..n).map(|_| None).collect();
        let mut todo: Vec<usize> = (0..n).collect();
        for attempt in 0..2 {
            let ks: Vec<&str> = todo.iter().map(|&i| keys[i]).collect();
            let (sources, sent) = self.sources(&ks, attempt == 0).await;
            let mut retry = Vec::new();
            let mut plain = Vec::new();
            let mut cached = Vec::new();
            for (&i, src) in todo.iter().zip(sources) {
                let src = match src {
                    Ok(s) => s,
                    Err(e) => {
                        out[i] = Some(Err(e.with_key(keys[i])));
                        continue;
                    }
                };
                match dst(i, &src.view) {
                    Ok((d, t)) if src.cached && src.view.size > d.1 => {
                        // The cached size may be a replaced version's: ask the master.
                        drop(t);
                        self.inner.locations.forget(keys[i]);
                        retry.push(i);
                    }
                    Ok((d, t)) if src.view.size > d.1 => {
                        drop(t);
                        let detail =
                            format!("object is {} bytes, the buffer {}", src.view.size, d.1);
                        out[i] =
                            Some(Err(Error::new(ErrorKind::BufferTooSmall, "get", detail)
                                .with_key(keys[i])));
                    }
                    Ok((d, t)) if src.cached => cached.push((i, src.view, d, t)),
                    Ok((d, t)) => plain.push((i, src.view, d, t)),
                    Err(e) => out[i] = Some(Err(e.with_key(keys[i]))),
                }
            }
            let guarded: Vec<(&str, &ObjectView, u64)> =
                cached.iter().map(|(i, v, d, _)| (keys[*i], v, d.0)).collect();
            let remember: Vec<(usize, ObjectView)> =
                plain.iter().map(|(i, v, _, _)| (*i, v.clone())).collect();
            let dsts: Vec<(u64, u64)> = plain.iter().map(|(_, _, d, _)| *d).collect();
            let views: Vec<Result<ObjectView>> =
                plain.iter().map(|(_, v, _, _)| Ok(v.clone())).collect();
            let (guarded, read) = futures_util::future::join(
                self.read_cached(&guarded),
                self.read_views(views, &dsts),
            )
            .await;
            for ((i, v, _, t), r) in cached.into_iter().zip(guarded) {
                match r {
                    Ok(()) => out[i] = Some(Ok((v.size, v.version, t))),
                    Err(_) => {
                        self.inner.locations.forget(keys[i]);
                        self.inner.cache_misses.fetch_add(1, Ordering::Relaxed);
                        retry.push(i);
                    }
                }
            }
            for (((i, v, _, t), r), (_, view)) in plain.into_iter().zip(read).zip(remember) {
                match r {
                    Ok(size) => {
                        self.remember(keys[i], &view, sent);
                        out[i] = Some(Ok((size, v.version, t)));
                    }
                    Err(e) => out[i] = Some(Err(e.with_key(keys[i]))),
                }
            }
            if retry.is_empty() {
                break;
            }
            todo = retry;
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no result"))))
            .collect()
    }

    /// [`Client::get_items`] for one object whose location is cached, with none of a batch's
    /// bookkeeping (a 4 KiB get's own work is a fifth of its time). `None`: no live location,
    /// or the cached one no longer serves (forgotten here, as the batch path forgets it); the
    /// caller then asks the master, as for any miss.
    async fn get_one_cached<T, F>(&self, key: &str, dst: &mut F) -> Option<Result<(u64, u64, T)>>
    where
        F: FnMut(usize, &ObjectView) -> Result<((u64, u64), T)>,
    {
        let view = Source::cached(self.inner.locations.get(key, Instant::now())?).view;
        let (d, t) = match dst(0, &view) {
            Ok(got) => got,
            Err(e) => return Some(Err(e.with_key(key))),
        };
        if view.size > d.1 {
            // The cached size may be a replaced version's: ask the master.
            drop(t);
            self.inner.locations.forget(key);
            return None;
        }
        let (engine, replica) = (&self.inner.engine, &view.replicas[0]);
        let endpoint = replica.endpoint.as_str();
        let guard = crate::read_guard::encode(key, view.version);
        let read = match engine.open_segment(endpoint).await {
            Ok(seg) => engine.read_guarded(&seg, d.0, replica.addr, view.size, guard).await,
            Err(e) => Err(e),
        };
        match read {
            Ok(()) => {
                self.inner.cache_hits.fetch_add(1, Ordering::Relaxed);
                Some(Ok((view.size, view.version, t)))
            }
            Err(e) => {
                drop(t);
                self.cached_read_failed(key, endpoint, &e).await;
                None
            }
        }
    }

    /// Where to read each key: its cached location (when `cached` and live), else what the
    /// master's `Get` says; and when that request was sent (the start of its leases).
    async fn sources(&self, keys: &[&str], cached: bool) -> (Vec<Result<Source>>, Instant) {
        let now = Instant::now();
        let mut out: Vec<Option<Result<Source>>> = Vec::with_capacity(keys.len());
        let mut ask = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let hit = if cached { self.inner.locations.get(k, now) } else { None };
            match hit {
                Some(l) => out.push(Some(Ok(Source::cached(l)))),
                None => {
                    out.push(None);
                    ask.push(i);
                }
            }
        }
        if ask.is_empty() {
            return (out.into_iter().flatten().collect(), now);
        }
        let sent = Instant::now();
        let views = self.views("get", ask.iter().map(|&i| keys[i])).await;
        for (i, v) in ask.into_iter().zip(views) {
            out[i] = Some(v.map(|view| Source { view, cached: false }));
        }
        let out = out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "get", "no view"))))
            .collect();
        (out, sent)
    }

    /// Guarded reads of cached locations straight from their nodes, `(key, view, local
    /// address)` each, one `Engine::read_guarded_batch` per node (a lone object is one
    /// request, many go as packs). One result per item, in order.
    async fn read_cached(&self, items: &[(&str, &ObjectView, u64)]) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = Vec::with_capacity(items.len());
        // Per node, in first-seen order: item indices and their reads.
        type Reads = (Vec<usize>, Vec<kvfs_transfer::GuardedRead>);
        let mut nodes: Vec<(&str, Reads)> = Vec::new();
        for (k, (key, v, local)) in items.iter().enumerate() {
            let Some(r) = v.replicas.first() else {
                out.push(Err(Error::new(ErrorKind::Internal, "get", "no replica")));
                continue;
            };
            out.push(Ok(()));
            let read = (*local, r.addr, v.size, crate::read_guard::encode(key, v.version));
            match nodes.iter_mut().find(|(e, _)| *e == r.endpoint) {
                Some((_, (ks, reads))) => {
                    ks.push(k);
                    reads.push(read);
                }
                None => nodes.push((r.endpoint.as_str(), (vec![k], vec![read]))),
            }
        }
        let engine = &self.inner.engine;
        let per_node = nodes.into_iter().map(|(endpoint, (ks, reads))| async move {
            let done = match engine.open_segment(endpoint).await {
                Ok(seg) => engine.read_guarded_batch(&seg, &reads).await,
                Err(e) => vec![Err(e); ks.len()],
            };
            let mut forgotten = false;
            let mut res = Vec::with_capacity(ks.len());
            for (k, r) in ks.into_iter().zip(done) {
                match r {
                    Ok(()) => {
                        self.inner.cache_hits.fetch_add(1, Ordering::Relaxed);
                        res.push((k, Ok(())));
                    }
                    Err(e) => {
                        if !forgotten {
                            forgotten = self.forget_if_dead(endpoint, &e).await;
                        }
                        res.push((k, Err(Error::from_transfer("get", &e))));
                    }
                }
            }
            res
        });
        for (k, r) in futures_util::future::join_all(per_node).await.into_iter().flatten() {
            out[k] = r;
        }
        out
    }

    /// Caches the location of an object just read through the master's answer, when a
    /// guarded read of it would go straight to its owner (see `locations`).
    fn remember(&self, key: &str, v: &ObjectView, sent: Instant) {
        if v.lease_left_ms == 0 || v.size > locations::CACHED_BYTES_MAX {
            return;
        }
        let Some(r) = self.order_replicas(v.replicas.clone()).into_iter().next() else { return };
        let Some(seg) = self.inner.engine.opened_segment(&r.endpoint) else { return };
        if !self.inner.engine.guarded_is_direct(&seg, r.addr, v.size) {
            return;
        }
        let loc = Location {
            version: v.version,
            size: v.size,
            endpoint: r.endpoint,
            addr: r.addr,
            until: sent,
        };
        self.inner.locations.insert(key, loc, sent, v.lease_left_ms);
    }

    /// Reads through cached locations, and cached locations found stale (asked of the master
    /// again), since the client started.
    pub fn location_cache_stats(&self) -> (u64, u64) {
        (
            self.inner.cache_hits.load(Ordering::Relaxed),
            self.inner.cache_misses.load(Ordering::Relaxed),
        )
    }

    async fn views<'k>(
        &self,
        op: &'static str,
        keys: impl Iterator<Item = &'k str>,
    ) -> Vec<Result<ObjectView>> {
        let keys: Vec<String> = keys.map(String::from).collect();
        let n = keys.len();
        match self.call(op, &MasterRequest::Get(keys)).await {
            Ok(MasterResponse::Get(v)) if v.len() == n => {
                v.into_iter().map(|r| r.map_err(|e| Error::from_wire(op, &e))).collect()
            }
            Ok(other) => vec![Err(unexpected(op, &other)); n],
            Err(e) => vec![Err(e); n],
        }
    }

    /// Reads each viewed object into its destination, replica by replica until one works.
    async fn read_views(
        &self,
        views: Vec<Result<ObjectView>>,
        dsts: &[(u64, u64)],
    ) -> Vec<Result<u64>> {
        struct Pending {
            item: usize,
            size: u64,
            replicas: Vec<ReplicaDesc>,
            next: usize,
        }
        let mut out: Vec<Result<u64>> = Vec::with_capacity(views.len());
        let mut pending = Vec::new();
        for (item, v) in views.into_iter().enumerate() {
            match v {
                Ok(v) if v.size > dsts[item].1 => out.push(Err(Error::new(
                    ErrorKind::BufferTooSmall,
                    "get",
                    format!("object is {} bytes, the buffer {}", v.size, dsts[item].1),
                ))),
                Ok(v) => {
                    out.push(Err(Error::new(ErrorKind::Transfer, "get", "no readable replica")));
                    pending.push(Pending {
                        item,
                        size: v.size,
                        replicas: self.order_replicas(v.replicas),
                        next: 0,
                    });
                }
                Err(e) => out.push(Err(e)),
            }
        }
        while !pending.is_empty() {
            let mut reqs = Vec::new();
            let mut owners = Vec::new();
            let mut again = Vec::new();
            for mut p in pending {
                let Some(r) = p.replicas.get(p.next).cloned() else { continue };
                p.next += 1;
                match self.inner.engine.open_segment(&r.endpoint).await {
                    Ok(seg) => {
                        let (addr, size) = (dsts[p.item].0, p.size);
                        reqs.push(TransferRequest {
                            op: TransferOp::Read,
                            segment: seg,
                            local_addr: addr,
                            remote_addr: r.addr,
                            len: size,
                        });
                        owners.push((p, r.endpoint));
                    }
                    Err(e) => {
                        self.forget_if_dead(&r.endpoint, &e).await;
                        out[p.item] = Err(Error::from_transfer("get", &e));
                        again.push(p);
                    }
                }
            }
            let load: Vec<(String, u64)> =
                owners.iter().map(|(p, ep)| (ep.clone(), p.size)).collect();
            self.track(&load, true);
            let results = self.transfer(reqs).await;
            self.track(&load, false);
            for ((p, endpoint), r) in owners.into_iter().zip(results) {
                match r {
                    Ok(()) => out[p.item] = Ok(p.size),
                    Err(e) => {
                        self.forget_if_dead(&endpoint, &e).await;
                        // A bad local range fails the same way on every replica.
                        let local = matches!(
                            e.kind(),
                            kvfs_transfer::ErrorKind::NotRegistered
                                | kvfs_transfer::ErrorKind::InvalidArgument
                        );
                        out[p.item] = Err(Error::from_transfer("get", &e));
                        if !local {
                            again.push(p);
                        }
                    }
                }
            }
            pending = again;
        }
        out
    }

    /// Same host first, then the endpoints this client has the fewest bytes in flight to;
    /// ties rotate so repeated reads spread over replicas. Only memory replicas are readable
    /// through the engine.
    fn order_replicas(&self, mut replicas: Vec<ReplicaDesc>) -> Vec<ReplicaDesc> {
        replicas.retain(|r| matches!(r.tier, Tier::Dram | Tier::Hbm) && !r.endpoint.is_empty());
        if replicas.len() > 1 {
            let k = self.inner.rotate.fetch_add(1, Ordering::Relaxed) % replicas.len();
            replicas.rotate_left(k);
            let load = self.inner.inflight.lock().unwrap_or_else(|e| e.into_inner());
            replicas.sort_by_key(|r| {
                (r.host != self.inner.host, load.get(&r.endpoint).copied().unwrap_or(0))
            });
        }
        replicas
    }

    fn track(&self, owners: &[(String, u64)], start: bool) {
        let mut load = self.inner.inflight.lock().unwrap_or_else(|e| e.into_inner());
        for (ep, size) in owners {
            let v = load.entry(ep.clone()).or_insert(0);
            *v = if start { v.saturating_add(*size) } else { v.saturating_sub(*size) };
        }
    }

    // ----- metadata ------------------------------------------------------------------------

    pub async fn exists(&self, key: &str) -> Result<bool> {
        self.exists_batch(&[key])
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "exists", "no result")))
    }

    /// Existence of many keys in one round trip (grants read leases to those that exist).
    pub async fn exists_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<bool>> {
        let scoped = self.scoped(keys);
        let keys = &scoped[..];
        let req = MasterRequest::Exists(keys.iter().map(|k| k.as_ref().to_string()).collect());
        match self.call("exists", &req).await {
            Ok(MasterResponse::Exists(v)) if v.len() == keys.len() => {
                v.into_iter().map(|r| r.map_err(|e| Error::from_wire("exists", &e))).collect()
            }
            Ok(other) => vec![Err(unexpected("exists", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Size, checksum, replicas, persistence, pin and lease of an object (grants no lease).
    pub async fn stat(&self, key: &str) -> Result<ObjectInfo> {
        self.stat_batch(&[key])
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "stat", "no result")))
    }

    pub async fn stat_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<ObjectInfo>> {
        let scoped = self.scoped(keys);
        let keys = &scoped[..];
        let req = MasterRequest::Stat(keys.iter().map(|k| k.as_ref().to_string()).collect());
        match self.call("stat", &req).await {
            Ok(MasterResponse::Stat(v)) if v.len() == keys.len() => v
                .into_iter()
                .zip(keys)
                .map(|(r, k)| r.map_err(|e| Error::from_wire("stat", &e).with_key(k.as_ref())))
                .collect(),
            Ok(other) => vec![Err(unexpected("stat", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Removes an object; a live read lease refuses it (`Leased`) unless `force`.
    pub async fn remove(&self, key: &str, force: bool) -> Result<()> {
        self.remove_batch(&[key], force)
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "remove", "no result")))
    }

    pub async fn remove_batch<K: AsRef<str>>(&self, keys: &[K], force: bool) -> Vec<Result<()>> {
        let scoped = self.scoped(keys);
        let keys = &scoped[..];
        keys.iter().for_each(|k| self.inner.locations.forget(k.as_ref()));
        let req = MasterRequest::Remove {
            keys: keys.iter().map(|k| k.as_ref().to_string()).collect(),
            force,
        };
        match self.call("remove", &req).await {
            Ok(MasterResponse::Remove(v)) if v.len() == keys.len() => v
                .into_iter()
                .zip(keys)
                .map(|(r, k)| r.map_err(|e| Error::from_wire("remove", &e).with_key(k.as_ref())))
                .collect(),
            Ok(other) => vec![Err(unexpected("remove", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Gives the object `from` the name `to` (a metadata operation: the bytes stay where they
    /// are) and returns its new version. With `RenameMode::Replace` an object under `to` is
    /// replaced (its readers keep their bytes until their lease ends); with `NoReplace` it is
    /// `AlreadyExists`. `NotFound` when `from` does not exist; `PutInProgress` (retryable)
    /// while either name is being put.
    pub async fn rename(&self, from: &str, to: &str, mode: RenameMode) -> Result<u64> {
        let item = RenameItem { from: from.to_string(), to: to.to_string(), mode };
        self.rename_batch(vec![item]).await.pop().unwrap_or_else(|| {
            Err(Error::new(ErrorKind::Internal, "rename", "no result").with_key(from))
        })
    }

    /// Several renames in one call, applied in order; one result per item.
    pub async fn rename_batch(&self, mut items: Vec<RenameItem>) -> Vec<Result<u64>> {
        if let Some(p) = &self.inner.prefix {
            for i in &mut items {
                i.from.insert_str(0, p);
                i.to.insert_str(0, p);
            }
        }
        for i in &items {
            self.inner.locations.forget(&i.from);
            self.inner.locations.forget(&i.to);
        }
        let keys: Vec<String> = items.iter().map(|i| i.from.clone()).collect();
        match self.call("rename", &MasterRequest::Rename(items)).await {
            Ok(MasterResponse::Rename(v)) if v.len() == keys.len() => v
                .into_iter()
                .zip(&keys)
                .map(|(r, k)| r.map_err(|e| Error::from_wire("rename", &e).with_key(k)))
                .collect(),
            Ok(other) => vec![Err(unexpected("rename", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Removes objects as POSIX unlink does: the name goes at once, even while a read lease
    /// protects the object (readers holding it keep their bytes until the lease ends).
    /// `Pinned` for a hard-pinned object (only a forced `remove` takes it).
    pub async fn unlink_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<()>> {
        let scoped = self.scoped(keys);
        let keys = &scoped[..];
        keys.iter().for_each(|k| self.inner.locations.forget(k.as_ref()));
        let req = MasterRequest::Unlink(keys.iter().map(|k| k.as_ref().to_string()).collect());
        match self.call("unlink", &req).await {
            Ok(MasterResponse::Remove(v)) if v.len() == keys.len() => v
                .into_iter()
                .zip(keys)
                .map(|(r, k)| r.map_err(|e| Error::from_wire("unlink", &e).with_key(k.as_ref())))
                .collect(),
            Ok(other) => vec![Err(unexpected("unlink", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    pub async fn unlink(&self, key: &str) -> Result<()> {
        self.unlink_batch(&[key])
            .await
            .pop()
            .unwrap_or_else(|| Err(Error::new(ErrorKind::Internal, "unlink", "no result")))
    }

    /// Drops each key's replicas on the node whose transfer endpoint is `endpoint` (every
    /// replica with `None`; the object goes with its last copy) once its read lease has ended:
    /// per key whether something was dropped, or `Leased` / `Pinned` / `NotFound`.
    pub async fn clear_replicas<K: AsRef<str>>(
        &self,
        keys: &[K],
        endpoint: Option<&str>,
    ) -> Vec<Result<bool>> {
        let scoped = self.scoped(keys);
        let keys = &scoped[..];
        let req = MasterRequest::ClearReplicas {
            keys: keys.iter().map(|k| k.as_ref().to_string()).collect(),
            endpoint: endpoint.map(str::to_string),
        };
        match self.call("clear replicas", &req).await {
            Ok(MasterResponse::ClearReplicas(v)) if v.len() == keys.len() => v
                .into_iter()
                .zip(keys)
                .map(|(r, k)| {
                    r.map_err(|e| Error::from_wire("clear replicas", &e).with_key(k.as_ref()))
                })
                .collect(),
            Ok(other) => vec![Err(unexpected("clear replicas", &other)); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Removes every object whose key matches `pattern` (unanchored regex); counts what was
    /// removed and what leases or pins protected.
    pub async fn remove_regex(&self, pattern: &str, force: bool) -> Result<RemoveCounts> {
        if self.inner.prefix.is_some() {
            let re = regex::Regex::new(pattern).map_err(|e| {
                Error::new(ErrorKind::InvalidArgument, "remove", format!("bad regex: {e}"))
            })?;
            return self.remove_listed(|k| re.is_match(k), force).await;
        }
        self.remove_counted(MasterRequest::RemoveRegex { pattern: pattern.to_string(), force })
            .await
    }

    /// Removes every object (leased and hard-pinned ones only with `force`); a tenant's
    /// client removes its tenant's objects only.
    pub async fn remove_all(&self, force: bool) -> Result<RemoveCounts> {
        if self.inner.prefix.is_some() {
            return self.remove_listed(|_| true, force).await;
        }
        self.remove_counted(MasterRequest::RemoveAll { force }).await
    }

    /// A tenant's removal by pattern: its keys page by page, the matching ones removed.
    async fn remove_listed(
        &self,
        matches: impl Fn(&str) -> bool,
        force: bool,
    ) -> Result<RemoveCounts> {
        let mut counts = RemoveCounts::default();
        let mut after: Option<String> = None;
        loop {
            let page = self.list("", after.as_deref(), 1024).await?;
            let keys: Vec<&str> =
                page.entries.iter().map(|e| e.key.as_str()).filter(|k| matches(k)).collect();
            for r in self.remove_batch(&keys, force).await {
                match r.as_ref().map_err(|e| e.kind()) {
                    Ok(()) => counts.removed += 1,
                    Err(ErrorKind::Leased) => counts.skipped_leased += 1,
                    Err(ErrorKind::Pinned) => counts.skipped_pinned += 1,
                    Err(ErrorKind::NotFound) => {}
                    Err(_) => return r.map(|()| counts),
                }
            }
            match page.next_start_after {
                Some(next) => after = Some(next),
                None => return Ok(counts),
            }
        }
    }

    /// Keys in this client's namespace (see `ClientConfig::tenant`).
    fn scoped<'a, K: AsRef<str>>(&self, keys: &'a [K]) -> Vec<Cow<'a, str>> {
        keys.iter().map(|k| self.scoped_one(k.as_ref())).collect()
    }

    /// A key in this client's namespace.
    fn scoped_one<'a>(&self, key: &'a str) -> Cow<'a, str> {
        match &self.inner.prefix {
            None => Cow::Borrowed(key),
            Some(p) => Cow::Owned(format!("{p}{key}")),
        }
    }

    /// A key the master named, as this client names it.
    fn unscoped(&self, key: String) -> String {
        match &self.inner.prefix {
            Some(p) => key.strip_prefix(p.as_str()).map(str::to_string).unwrap_or(key),
            None => key,
        }
    }

    async fn remove_counted(&self, req: MasterRequest) -> Result<RemoveCounts> {
        self.inner.locations.clear();
        match self.call("remove", &req).await? {
            MasterResponse::RemoveCount(r) => r.map_err(|e| Error::from_wire("remove", &e)),
            other => Err(unexpected("remove", &other)),
        }
    }

    /// One page of keys under `prefix`, in order.
    pub async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<ListPage> {
        let scope = |k: &str| self.scoped(&[k]).remove(0).into_owned();
        let req = MasterRequest::List {
            prefix: scope(prefix),
            start_after: start_after.map(scope),
            limit,
        };
        match self.call("list", &req).await? {
            MasterResponse::List(r) => {
                let mut page = r.map_err(|e| Error::from_wire("list", &e))?;
                if self.inner.prefix.is_some() {
                    for e in &mut page.entries {
                        e.key = self.unscoped(std::mem::take(&mut e.key));
                    }
                    page.next_start_after = page.next_start_after.map(|k| self.unscoped(k));
                }
                Ok(page)
            }
            other => Err(unexpected("list", &other)),
        }
    }

    /// One page of the immediate children of a `/`-separated prefix (objects and directories).
    pub async fn list_dir(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<DirPage> {
        let req = MasterRequest::ListDir {
            prefix: self.scoped(&[prefix]).remove(0).into_owned(),
            start_after: start_after.map(String::from),
            limit,
        };
        match self.call("list", &req).await? {
            MasterResponse::ListDir(r) => r.map_err(|e| Error::from_wire("list", &e)),
            other => Err(unexpected("list", &other)),
        }
    }

    /// Cluster figures from the master.
    pub async fn stats(&self) -> Result<MasterStats> {
        match self.call("stats", &MasterRequest::Stats).await? {
            MasterResponse::Stats(s) => Ok(s),
            other => Err(unexpected("stats", &other)),
        }
    }

    /// Starts a job the master owns (offload a prefix to the object store, restore one into
    /// the pool); the prefix is this client's (a tenant's keys). Returns its first status.
    pub async fn job_start(&self, mut spec: JobSpec) -> Result<JobStatus> {
        spec.prefix = self.scoped(&[spec.prefix.as_str()]).remove(0).into_owned();
        self.job_call("job_start", MasterRequest::JobStart(spec)).await
    }

    /// A job's status (`NotFound` for another tenant's job).
    pub async fn job(&self, id: u64) -> Result<JobStatus> {
        self.job_call("job_get", MasterRequest::JobGet(id)).await
    }

    /// Stops a running job after the objects in flight.
    pub async fn job_cancel(&self, id: u64) -> Result<JobStatus> {
        // Another tenant's job is not this client's to cancel.
        self.job(id).await?;
        self.job_call("job_cancel", MasterRequest::JobCancel(id)).await
    }

    /// Every job the master knows of this client's keys (a tenant's), running ones first.
    pub async fn jobs(&self) -> Result<Vec<JobStatus>> {
        match self.call("job_list", &MasterRequest::JobList).await? {
            MasterResponse::Jobs(v) => Ok(v.into_iter().filter_map(|s| self.own_job(s)).collect()),
            other => Err(unexpected("job_list", &other)),
        }
    }

    async fn job_call(&self, op: &'static str, req: MasterRequest) -> Result<JobStatus> {
        let id = match &req {
            MasterRequest::JobGet(id) | MasterRequest::JobCancel(id) => *id,
            _ => 0,
        };
        match self.call(op, &req).await? {
            MasterResponse::Job(Ok(s)) => self.own_job(s).ok_or_else(|| {
                Error::from_wire(op, &WireError::new(ErrorCode::NotFound, format!("no job {id}")))
            }),
            MasterResponse::Job(Err(e)) => Err(Error::from_wire(op, &e)),
            other => Err(unexpected(op, &other)),
        }
    }

    /// A job as this client sees it: its prefix in this client's namespace; `None` for a job
    /// over keys outside it (another tenant's).
    fn own_job(&self, mut s: JobStatus) -> Option<JobStatus> {
        if let Some(p) = &self.inner.prefix {
            s.spec.prefix = s.spec.prefix.strip_prefix(p.as_str())?.to_string();
        }
        Some(s)
    }
}

/// Most objects, and most bytes, in one chunk of a pipelined batch.
/// Rounds in which a put whose replica sat on a dead segment is placed again (each round
/// re-places every such item of the chunk at once).
const PUT_REPLACEMENTS_MAX: u32 = 3;

/// A replica write that failed, and whether its segment's owner is gone.
#[derive(Clone)]
struct Failed {
    error: Error,
    dead_segment: bool,
}

/// Largest lone put whose replicas are written with the commit in the same request
/// ([`Client::write_noted`]).
const NOTED_BYTES_MAX: u64 = 1 << 20;

const CHUNK_ITEMS_MAX: usize = 64;
const CHUNK_BYTES_MAX: u64 = 8 << 20;

/// Most items in one chunk of a put (see [`pipeline_chunks`]). Each chunk costs two master
/// round trips whatever its size: a put of 1024 x 4 KiB into the caller's own node took
/// 3.9-4.3 ms of CPU (client and master together) in 64-item chunks, 2.95-3.2 ms in 256-item
/// ones and 2.8 ms in one chunk, and its wall time was lowest at 256 (1.85 against 2.2-2.4 ms: two
/// chunks still overlap on two cores). Over tcp 64 and 1024 measured alike. A chunk is also
/// one hold of the master's directory, so it is not made larger than this.
const PUT_CHUNK_ITEMS_MAX: usize = 256;

/// Cuts a large batch into chunks that run concurrently, so the master's work for one chunk
/// (allocating, committing) overlaps the transfers of another instead of adding to them; the
/// Python Transfer Engine cuts its calls the same way (its packs then spread over the
/// connections). At most 64 items or 8 MiB per chunk; one range, possibly empty, at least.
pub fn pipeline_chunks(lens: impl Iterator<Item = u64>) -> Vec<std::ops::Range<usize>> {
    chunks_within(lens, CHUNK_ITEMS_MAX)
}

/// [`pipeline_chunks`] with at most `items_max` items a chunk.
fn chunks_within(lens: impl Iterator<Item = u64>, items_max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut end) = (0usize, 0u64, 0usize);
    for (i, len) in lens.enumerate() {
        if i > start && (i - start >= items_max || bytes + len > CHUNK_BYTES_MAX) {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += len;
        end = i + 1;
    }
    if end > start || out.is_empty() {
        out.push(start..end);
    }
    out
}

fn fail_all(todo: &[usize], out: &mut [Option<Result<()>>], e: Error) -> Vec<(usize, Error)> {
    for &i in todo {
        out[i] = Some(Err(e.clone()));
    }
    Vec::new()
}

fn unexpected(op: &'static str, resp: &MasterResponse) -> Error {
    Error::new(ErrorKind::Internal, op, format!("unexpected answer from the master: {resp:?}"))
}

/// The vector a lent get filled with `len` bytes (its capacity, from the transfer).
fn filled(v: Arc<Vec<u8>>, len: usize) -> Vec<u8> {
    match Arc::try_unwrap(v) {
        Ok(mut v) => {
            // SAFETY: the transfer wrote `len` bytes (the object's size, the vector's
            // capacity) and has finished.
            unsafe { v.set_len(len) };
            v
        }
        // A transfer's keep-alive not dropped yet: the bytes are final, copy them out.
        // SAFETY: as above; the memory stays valid while `shared` lives.
        Err(shared) => unsafe { std::slice::from_raw_parts(shared.as_ptr(), len) }.to_vec(),
    }
}

/// blake3 of `len` bytes of registered memory at `addr`.
fn registered_blake3(addr: u64, len: u64) -> [u8; 32] {
    // SAFETY: the caller registered [addr, addr+len) with the engine (the transfer that just
    // read it succeeded), and promised it stays valid while the put runs.
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
    *blake3::hash(bytes).as_bytes()
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn chunks_cover_every_item_once_within_bounds() {
        assert_eq!(pipeline_chunks(std::iter::empty()), vec![0..0]);
        assert_eq!(pipeline_chunks([5u64].into_iter()), vec![0..1]);
        let small = pipeline_chunks(std::iter::repeat_n(64 << 10, 300));
        assert_eq!(small, vec![0..64, 64..128, 128..192, 192..256, 256..300]);
        let big = pipeline_chunks(std::iter::repeat_n(64 << 20, 3));
        assert_eq!(big, vec![0..1, 1..2, 2..3]);
        let mixed = pipeline_chunks([5u64 << 20, 5 << 20, 1].into_iter());
        assert_eq!(mixed, vec![0..1, 1..3]);
        // Puts: up to 256 items a chunk, and still at most 8 MiB.
        let puts = chunks_within(std::iter::repeat_n(4096, 600), PUT_CHUNK_ITEMS_MAX);
        assert_eq!(puts, vec![0..256, 256..512, 512..600]);
        let puts = chunks_within(std::iter::repeat_n(64 << 10, 300), PUT_CHUNK_ITEMS_MAX);
        assert_eq!(puts, vec![0..128, 128..256, 256..300]);
    }
}
