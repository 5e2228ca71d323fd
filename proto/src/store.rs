//! Store wire types: the master's RPC (clients and nodes call it) and the calls the master
//! makes on nodes over the nodes' own connections.
//!
//! Every per-key call is a batch: a single call is a batch of one, so the batch path is the
//! only path and is exercised by everything. Each item of a batch has its own result.
//! Connections begin with [`MasterRequest::Hello`], which carries the protocol version.
//!
//! Tiers (protocol 2): nodes report the copies their tier manager made or dropped
//! ([`MasterRequest::ReportReplicas`]), ask for promotions ([`MasterRequest::Promote`]) and
//! send their counters with heartbeats (answered with the reads the master saw of their
//! objects, the access signal of their tier policy); the master asks nodes to write an eager
//! object to the object store before it completes ([`NodeRequest::Persist`]) and to copy an
//! object from NVMe or the object store into a DRAM range it allocated
//! ([`NodeRequest::Load`]) when a get finds no memory replica.
//!
//! Protocol 5: a writer whose replica lies in a node of its own process records the commit in
//! that node itself ([`PutEndItem::committed_on`]; the grant says the object's effective
//! persistence, [`PutGrant::persistence`]), and drops name the version of the copy they mean
//! ([`DropItem::version`]), so a drop that arrives after a newer commit of the same range is
//! ignored whoever recorded that commit.
//!
//! Protocol 6: a writer records the commit in a remote node too, in the same request as the
//! bytes (the Transfer Engine's noted write carrying a [`CommitNote`]), and names every node
//! that recorded it in [`PutEndItem::committed_on`]; the master then answers the `PutEnd`
//! without a record round trip to those nodes, and sends a drop for the ranges of every
//! pending put it abandons (revoked, timed out, first writer lost), which a writer may have
//! committed on its nodes already.
//!
//! Protocol 9: a put names the memory tier it wants ([`PutStartItem::tier`]: DRAM, or HBM on
//! nodes that contribute GPU memory).
//!
//! Protocol 10: jobs the master owns ([`MasterRequest::JobStart`], `JobGet`, `JobCancel`,
//! `JobList`): offloading a prefix to the object store and restoring one into the pool; a
//! `Persist` may name the NVMe segment (the node reads its NVMe copy).
//!
//! Protocol 11: a node's tier manager moves objects between its own memory tiers
//! ([`MasterRequest::Move`]: HBM -> DRAM when GPU memory fills, DRAM -> HBM when an object put
//! into HBM is hot again); the master allocates the range and sends a `Load` whose source is
//! the node's other memory copy.
//!
//! Protocol 12: a node's heartbeat stats carry the requests its Transfer Engine served over
//! tcp, by op ([`NodeStats::te_requests`]).
//!
//! Protocol 7: high availability. [`MasterResponse::Hello`] carries the master's leadership
//! term; a standby master or a leader whose lease lapsed refuses every request with
//! [`ErrorCode::NotLeader`].

use serde::{Deserialize, Serialize};

/// Version of the store protocol; a master refuses a client or node that speaks another one.
pub const STORE_PROTOCOL_VERSION: u32 = 12;

/// Storage medium of a segment or replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    Hbm,
    Dram,
    Nvme,
    ObjectStore,
}

/// When an object reaches object storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Persistence {
    #[default]
    None,
    Lazy,
    Eager,
}

/// Eviction protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Pin {
    #[default]
    None,
    Soft,
    Hard,
}

impl Pin {
    /// The one-byte code object headers store (0 none, 1 soft, 2 hard).
    pub fn code(self) -> u8 {
        match self {
            Pin::None => 0,
            Pin::Soft => 1,
            Pin::Hard => 2,
        }
    }

    /// The pin of a stored code; unknown codes read as `None` (never more protection than
    /// was asked for).
    pub fn from_code(c: u8) -> Pin {
        match c {
            1 => Pin::Soft,
            2 => Pin::Hard,
            _ => Pin::None,
        }
    }
}

/// Placement strategy for a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Strategy {
    #[default]
    Random,
    FreeRatioFirst,
    LocalFirst,
}

/// Domain outcome of a failed item, as clients branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    NotFound,
    AlreadyExists,
    /// Another writer's put of the key is pending; retry later.
    PutInProgress,
    NoSpace,
    /// A read lease protects the object.
    Leased,
    /// A hard pin protects the object.
    Pinned,
    InvalidKey,
    InvalidArgument,
    TooLarge,
    /// The node is not (or no longer) registered: re-register.
    NodeUnknown,
    Conflict,
    /// The master is rebuilding its directory after a restart; puts resume shortly.
    Recovering,
    /// The peer speaks another protocol version.
    Version,
    Internal,
    /// Stored bytes failed their checksum (every copy that was tried).
    Corrupt,
    /// A tier or service the request needs is down or missing (object store, node).
    Unavailable,
    /// This master does not lead its cluster (a standby, or a leader whose lease lapsed):
    /// find the leader through etcd and call it.
    NotLeader,
    /// The put would take its tenant over its byte quota, even after evicting the tenant's
    /// own objects (version 8).
    QuotaExceeded,
}

/// Where tenants' keys live: a tenant's client names its keys inside `tenants/TENANT/` and the
/// master holds that namespace to the tenant's quotas.
pub const TENANT_PREFIX: &str = "tenants/";

/// Whether `name` may name a tenant: 1 to 64 of `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn valid_tenant(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A failed item: its code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError { code, message: message.into() }
    }
}

pub type ItemResult<T> = Result<T, WireError>;

/// Who is on the other end of a master connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Client,
    Node,
}

/// One replica as clients see it: where to read or write the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaDesc {
    pub tier: Tier,
    /// The holding node; `None` for the object store.
    pub node: Option<u64>,
    /// Transfer Engine segment name of the node (empty for the object store).
    pub endpoint: String,
    /// Host identity of the node, for same-host-first choices.
    pub host: String,
    pub segment: u32,
    /// Address in the node's segment (Transfer Engine address); 0 for non-memory tiers.
    pub addr: u64,
    pub len: u64,
}

/// One item of a put.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStartItem {
    pub key: String,
    pub size: u64,
    pub replicas: u8,
    pub persistence: Persistence,
    pub pin: Pin,
    pub strategy: Strategy,
    /// Ordered preference of nodes, by Transfer Engine segment name (Mooncake's
    /// `preferred_segments`, e.g. the writer's own `host:port` for local-first placement).
    pub preferred_endpoints: Vec<String>,
    pub upsert: bool,
    /// The memory tier the replicas go to: `Dram` (the default), or `Hbm` (GPU memory of the
    /// nodes that contribute some). Other tiers are refused: objects reach NVMe and the object
    /// store through the tier manager and persistence.
    pub tier: Tier,
}

/// Where to write an object; `version` must come back in [`PutEndItem`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutGrant {
    pub version: u64,
    pub replicas: Vec<ReplicaDesc>,
    /// The object's persistence after the master's per-prefix defaults.
    pub persistence: Persistence,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutEndItem {
    pub key: String,
    pub checksum: Option<[u8; 32]>,
    pub version: Option<u64>,
    /// The nodes that already recorded the commit of this object's replica in them: a node
    /// in the writer's own process, or one the writer's noted write reached with a
    /// [`CommitNote`] (the master sends them no commit record).
    pub committed_on: Vec<u64>,
}

/// The note of a writer's noted write into a node's DRAM segment: the commit record of the
/// object whose bytes the write carries, recorded by the node once they are in place (only for
/// objects without persistence, and without a checksum: a writer that asks for one computes it
/// after the write and leaves the record to the master). Postcard-encoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitNote {
    pub key: String,
    pub version: u64,
    pub pin: Pin,
}

impl CommitNote {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("a commit note always encodes")
    }

    /// `None` for bytes that are not exactly one note.
    pub fn decode(bytes: &[u8]) -> Option<CommitNote> {
        match postcard::take_from_bytes(bytes) {
            Ok((note, [])) => Some(note),
            _ => None,
        }
    }
}

/// What the directory knows of a complete object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectView {
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub replicas: Vec<ReplicaDesc>,
    pub persistence: Persistence,
    pub pin: Pin,
    /// End of the read lease, in ms since the Unix epoch (0 when none).
    pub lease_end_ms: u64,
    /// What was left of the read lease when the master answered, in ms (0 when none): how
    /// long a reader may rely on the replicas' ranges by its own clock, whatever the skew
    /// between its clock and the master's.
    pub lease_left_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListEntry {
    pub key: String,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListPage {
    pub entries: Vec<ListEntry>,
    /// Pass as `start_after` to get the next page; `None` when this was the last.
    pub next_start_after: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DirEntry {
    Object {
        name: String,
        size: u64,
    },
    /// A name ending in `/`.
    Dir {
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirPage {
    pub entries: Vec<DirEntry>,
    pub next_start_after: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RemoveCounts {
    pub removed: u64,
    pub skipped_leased: u64,
    pub skipped_pinned: u64,
}

/// One segment a node contributes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSpec {
    pub index: u32,
    pub tier: Tier,
    pub base_addr: u64,
    pub capacity: u64,
}

/// An object a node holds, re-reported when it (re-)registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldObject {
    pub key: String,
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub segment: u32,
    pub offset: u64,
    pub tier: Tier,
    pub persistence: Persistence,
    pub pin: Pin,
    pub persisted: bool,
    /// The name and version this object had before its last rename, while the node still
    /// remembers it: a master rebuilding its directory drops a copy of that old name and
    /// version, so a rename the master died in the middle of leaves one name.
    pub renamed_from: Option<(String, u64)>,
}

/// What a rename does when the new name exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum RenameMode {
    /// Replace the object under the new name (POSIX rename): readers holding a lease on it
    /// keep its bytes until the lease ends.
    #[default]
    Replace,
    /// Fail with `AlreadyExists` (`RENAME_NOREPLACE`).
    NoReplace,
}

/// One rename.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenameItem {
    pub from: String,
    pub to: String,
    pub mode: RenameMode,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRegistration {
    pub node: u64,
    pub host: String,
    /// Transfer Engine segment name of the node.
    pub endpoint: String,
    pub segments: Vec<SegmentSpec>,
    pub held: Vec<HeldObject>,
    /// The node registered with a master before (this is a reconnection, maybe to a restarted
    /// master): writers may still be finishing transfers into its segments.
    pub reconnect: bool,
}

/// The master's answer to a registration, with the timing the node must keep.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistrationAck {
    pub adopted: u64,
    pub conflicts: u64,
    pub lost: u64,
    pub heartbeat_ms: u64,
    pub node_ttl_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierStats {
    pub tier: Tier,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub replicas: u64,
}

/// Master status, for `kvfs stat` and health pages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MasterStats {
    pub objects: u64,
    pub pending: u64,
    pub nodes: u64,
    pub tiers: Vec<TierStats>,
    pub metadata_bytes: u64,
    pub evicted_replicas: u64,
    pub recovering: bool,
    /// The master is still adopting the objects it found in the object store at start.
    pub scanning_object_store: bool,
}

/// Requests to the master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MasterRequest {
    Hello {
        version: u32,
        role: Role,
        host: String,
    },
    PutStart {
        client_host: String,
        items: Vec<PutStartItem>,
    },
    PutEnd(Vec<PutEndItem>),
    PutRevoke(Vec<String>),
    /// Replicas of each key; grants read leases.
    Get(Vec<String>),
    /// Whether each key exists; grants read leases to those that do.
    Exists(Vec<String>),
    /// Like `Get` without a lease.
    Stat(Vec<String>),
    Remove {
        keys: Vec<String>,
        force: bool,
    },
    RemoveRegex {
        pattern: String,
        force: bool,
    },
    RemoveAll {
        force: bool,
    },
    List {
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    },
    ListDir {
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    },
    Stats,
    RegisterNode(NodeRegistration),
    Heartbeat {
        node: u64,
        stats: NodeStats,
    },
    UnregisterNode {
        node: u64,
    },
    /// Copies a node's tier manager made or dropped.
    ReportReplicas {
        node: u64,
        items: Vec<ReplicaReport>,
    },
    /// A node asks for DRAM copies of objects it holds on NVMe (hot ones).
    Promote {
        node: u64,
        keys: Vec<String>,
    },
    /// A node asks for a copy of objects it holds in one memory tier (`MoveItem::from`) in
    /// its other (`to`: HBM -> DRAM, DRAM -> HBM). The master allocates the range on that node
    /// (making room by eviction as loads do), sends a `Load` naming `from` as the source, and
    /// attaches the new copy; the node then reports the release of the source copy.
    /// Answered with `Move`.
    Move {
        node: u64,
        items: Vec<MoveItem>,
    },
    /// Drop the replicas of each key on the node whose transfer endpoint is `endpoint` (every
    /// replica with `None`), when its read lease has ended; `true` per key that was cleared.
    ClearReplicas {
        keys: Vec<String>,
        endpoint: Option<String>,
    },
    /// Give objects new names (a metadata operation: the bytes stay where they are); each
    /// renamed object gets a new version, answered per item.
    Rename(Vec<RenameItem>),
    /// Remove objects the way POSIX unlink does: the name goes at once, even under a read
    /// lease; readers holding a lease keep the bytes until it ends. Hard-pinned objects are
    /// refused (`Pinned`). Answered with `Remove`.
    Unlink(Vec<String>),
    /// A standby master subscribes to the leader's grants (HA): the leader answers with its
    /// session, then calls the standby on this connection with [`MirrorRequest`]s, first the
    /// ranges outstanding now, then each new grant before the client that asked for it is
    /// answered. `standby` names the standby (its advertised address) for the leader's
    /// drop marker in etcd.
    Mirror {
        standby: String,
    },
    /// Start a job the master owns (offload a prefix to the object store, restore one into
    /// the pool); answered with `Job` (its id and first status).
    JobStart(JobSpec),
    /// A job's status, answered with `Job`.
    JobGet(u64),
    /// Stop a running job after the objects in flight; answered with `Job`.
    JobCancel(u64),
    /// Every job the master knows (running first, then the most recent), answered with `Jobs`.
    JobList,
}

/// Answers of the master, one variant per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MasterResponse {
    Hello {
        version: u32,
        master: String,
        /// The master's leadership term (the etcd create revision of its leader key); 0 for a
        /// master without HA. Followers refuse a master whose term is older than one they saw.
        term: u64,
    },
    PutStart(Vec<ItemResult<PutGrant>>),
    PutEnd(Vec<ItemResult<()>>),
    PutRevoke(Vec<ItemResult<()>>),
    Get(Vec<ItemResult<ObjectView>>),
    Exists(Vec<ItemResult<bool>>),
    Stat(Vec<ItemResult<ObjectView>>),
    Remove(Vec<ItemResult<()>>),
    RemoveCount(ItemResult<RemoveCounts>),
    List(ItemResult<ListPage>),
    ListDir(ItemResult<DirPage>),
    Stats(MasterStats),
    Registered(ItemResult<RegistrationAck>),
    Heartbeat(ItemResult<HeartbeatAck>),
    Unregistered(ItemResult<()>),
    ReportReplicas(Vec<ItemResult<ReportOutcome>>),
    Promote(Vec<ItemResult<()>>),
    Move(Vec<ItemResult<()>>),
    /// The request as a whole was refused (version, role, malformed).
    Refused(WireError),
    ClearReplicas(Vec<ItemResult<bool>>),
    /// Per item of a `Rename`: the renamed object's new version.
    Rename(Vec<ItemResult<u64>>),
    /// The leader's answer to `Mirror`.
    Mirror(ItemResult<MirrorSession>),
    Job(ItemResult<JobStatus>),
    Jobs(Vec<JobStatus>),
}

/// What a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobKind {
    /// Persist every object under the prefix to the object store; with `evict`, then drop its
    /// pool copies (DRAM, HBM, NVMe), freeing the pool (`kvfs offload --move`).
    Offload { evict: bool },
    /// Bring every object under the prefix that no memory replica holds back into DRAM.
    Restore,
}

impl JobKind {
    pub fn name(&self) -> &'static str {
        match self {
            JobKind::Offload { evict: false } => "offload",
            JobKind::Offload { evict: true } => "offload --move",
            JobKind::Restore => "restore",
        }
    }
}

/// A job as asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub kind: JobKind,
    /// Keys starting with this (the empty prefix is every key).
    pub prefix: String,
    /// Objects in flight at once (1..=256).
    pub concurrency: u32,
    /// Bytes per second the job may move (0: no limit).
    pub rate_bytes_per_s: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobState {
    Running,
    Done,
    Cancelled,
    Failed,
}

impl JobState {
    pub fn name(&self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }
}

/// A job's progress and outcome. A job covers the objects under its prefix that existed when
/// it started (versions up to the directory's version then); objects written later are not in
/// it. `objects_done` counts every object of the job that has its outcome, whichever it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStatus {
    pub id: u64,
    pub spec: JobSpec,
    pub state: JobState,
    pub started_ms: u64,
    pub updated_ms: u64,
    /// When it ended (0 while running).
    pub finished_ms: u64,
    /// Objects (and their bytes) in the job, counted when it started.
    pub objects_total: u64,
    pub bytes_total: u64,
    pub objects_done: u64,
    pub bytes_done: u64,
    /// Offload: written to the object store by this job. Restore: loaded into DRAM.
    pub moved: u64,
    /// Already where the job takes them (in the object store; in memory).
    pub already: u64,
    /// Removed or replaced while the job ran (their new versions are not in it).
    pub gone: u64,
    /// `--move`: objects whose pool copies were dropped.
    pub evicted: u64,
    /// `--move`: objects whose pool copies were kept (hard-pinned, or leased until the end).
    pub kept: u64,
    pub failed: u64,
    /// Times a master resumed it (after a restart or a takeover).
    pub resumed: u32,
    /// The first failures (at most 16), `key: error`.
    pub errors: Vec<String>,
}

/// A standby's subscription to its leader's grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorSession {
    pub term: u64,
    pub session: u64,
}

/// A range the leader handed to a writer (a put's replica, a load's DRAM copy): whoever
/// follows it as leader must not hand it out again before `ttl_ms` has passed, unless a node
/// reports an object there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorGrant {
    pub key: String,
    pub version: u64,
    pub node: u64,
    pub segment: u32,
    pub offset: u64,
    pub len: u64,
    /// Until the writer's deadline, from when the leader sent it.
    pub ttl_ms: u64,
}

/// Calls of a leader to a subscribed standby.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MirrorRequest {
    Grants {
        term: u64,
        session: u64,
        /// The first call of a session: every range outstanding when it began.
        snapshot: bool,
        grants: Vec<MirrorGrant>,
        /// Puts that ended (key, version): their ranges are objects or free again.
        released: Vec<(String, u64)>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MirrorResponse {
    Ack,
    Refused(WireError),
}

/// An object the node now holds (sent after the put completed on the master).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitItem {
    pub key: String,
    pub segment: u32,
    pub offset: u64,
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub persistence: Persistence,
    pub pin: Pin,
}

/// An object the node no longer holds (removed, evicted, replaced).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropItem {
    pub key: String,
    pub segment: u32,
    pub offset: u64,
    pub len: u64,
    /// The version of the copy meant; a node holding a newer version of the key keeps it.
    pub version: u64,
}

/// An object the node holds under `from` is now `to`, with a new version (sent after the
/// master renamed it; the node moves its DRAM and NVMe copies to the new name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenameRecord {
    pub from: String,
    pub to: String,
    /// The version of the node's copy under `from`.
    pub from_version: u64,
    /// Its version under `to`.
    pub version: u64,
}

/// Where a copy a node reports lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReplicaLoc {
    /// In one of the reporting node's segments.
    Node {
        tier: Tier,
        segment: u32,
        offset: u64,
    },
    ObjectStore,
}

/// One object of a [`MasterRequest::Move`]: copy the node's `from` copy of `key` at `version`
/// into a new range of its `to` tier (both memory tiers: `Dram` or `Hbm`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveItem {
    pub key: String,
    pub version: u64,
    pub from: Tier,
    pub to: Tier,
}

/// A change to a node's copies of one object: add first, then remove.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    pub key: String,
    /// The version of the node's copy; a report about another version is refused (`Conflict`).
    pub version: u64,
    /// The blake3 the node computed when the copy crossed into NVMe or the object store;
    /// recorded when the master has none.
    pub checksum: Option<[u8; 32]>,
    /// A new copy (a demotion's NVMe copy, a write-back's object-store copy).
    pub add: Option<ReplicaLoc>,
    /// A copy to forget (a demotion's DRAM copy, an NVMe copy dropped). Kept, and reported as
    /// not removed, while a read lease protects a memory copy or when it is the last copy.
    pub remove: Option<ReplicaLoc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReportOutcome {
    pub added: bool,
    pub removed: bool,
    /// When the remove was refused: how long until asking again can succeed (the read
    /// lease's end; longer for a last copy).
    pub retry_after_ms: u64,
}

/// A node's counters, sent with every heartbeat (the master shows them per node in /metrics).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeStats {
    pub dram_capacity_bytes: u64,
    pub dram_used_bytes: u64,
    pub nvme_capacity_bytes: u64,
    pub nvme_used_bytes: u64,
    pub nvme_objects: u64,
    pub demotions: u64,
    pub demoted_bytes: u64,
    pub promotions: u64,
    pub promoted_bytes: u64,
    pub nvme_drops: u64,
    /// Tier moves the policy wanted but the rate limit held back (rounds).
    pub rate_limited_rounds: u64,
    /// Reads that failed verification, per tier.
    pub corrupt_reads_nvme: u64,
    pub corrupt_reads_object_store: u64,
    pub writeback_queued: u64,
    pub writeback_persisted: u64,
    pub writeback_failed: u64,
    pub eager_persisted: u64,
    /// Commits writers recorded on this node themselves (noted writes, puts from the node's
    /// own process), for which the master sent no record.
    pub writer_commits: u64,
    /// Whether the node found a CUDA driver (the HBM tier can exist only then).
    pub hbm_available: bool,
    /// GPU memory the node contributes (its HBM segment; 0 without one).
    pub hbm_capacity_bytes: u64,
    /// HBM bytes of objects the node holds.
    pub hbm_used_bytes: u64,
    /// Objects the tier manager moved HBM -> DRAM and DRAM -> HBM.
    pub hbm_demotions: u64,
    pub hbm_promotions: u64,
    /// Requests the node's Transfer Engine served over tcp, by op.
    pub te_requests: crate::transfer::ServedRequests,
    /// Times the node's async runtime ran no task for a second or more (a deadlock, or every
    /// worker blocked): it answered nothing and sent no heartbeat meanwhile.
    pub runtime_stalls: u64,
}

/// The master's answer to a heartbeat: reads it granted of objects this node holds since the
/// last heartbeat (at most `access_report_keys_max` keys; the tier policy's access signal,
/// since clients read node memory without the node's code seeing it).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HeartbeatAck {
    pub accessed: Vec<(String, u32)>,
}

/// Write an object of a pending eager put from the node's DRAM range to the object store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistItem {
    pub key: String,
    pub segment: u32,
    pub offset: u64,
    pub size: u64,
    /// The writer's blake3, if it sent one: the node checks its bytes against it.
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub pin: Pin,
}

/// Copy an object into a memory range the master allocated on this node (its DRAM segment,
/// or its HBM segment for a move up), from this node's NVMe copy, from the object store, or
/// from this node's copy in its other memory tier (a [`MasterRequest::Move`]); the node
/// verifies the bytes it read from a medium that hashes them, answers the object's blake3,
/// and then holds the new copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadItem {
    pub key: String,
    pub segment: u32,
    pub offset: u64,
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub persistence: Persistence,
    pub pin: Pin,
    /// `Nvme` or `ObjectStore` (into DRAM), or `Hbm` / `Dram`: the node's copy in that memory
    /// tier (a move; the range is in the other one).
    pub source: Tier,
}

/// Calls the master makes on a node, over the node's connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeRequest {
    Commit(Vec<CommitItem>),
    Drop(Vec<DropItem>),
    Persist(Vec<PersistItem>),
    Load(Vec<LoadItem>),
    Rename(Vec<RenameRecord>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeResponse {
    Done,
    Refused(WireError),
    /// Per item of a `Persist`: the blake3 of what is now in the object store.
    Persisted(Vec<ItemResult<[u8; 32]>>),
    /// Per item of a `Load`: the blake3 of what is now in the DRAM range.
    Loaded(Vec<ItemResult<[u8; 32]>>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let req = MasterRequest::PutStart {
            client_host: "h".into(),
            items: vec![PutStartItem {
                key: "model/L0/abc".into(),
                size: 5 << 20,
                replicas: 2,
                persistence: Persistence::Lazy,
                pin: Pin::Soft,
                strategy: Strategy::LocalFirst,
                preferred_endpoints: vec!["10.0.0.7:15000".into()],
                upsert: false,
                tier: Tier::Dram,
            }],
        };
        let frame = crate::encode_frame(&req).unwrap();
        let back: MasterRequest = crate::decode_body(&frame[4..]).unwrap();
        assert_eq!(back, req);
        let resp =
            MasterResponse::Get(vec![Err(WireError::new(ErrorCode::NotFound, "no such key"))]);
        let frame = crate::encode_frame(&resp).unwrap();
        let back: MasterResponse = crate::decode_body(&frame[4..]).unwrap();
        assert_eq!(back, resp);
    }

    #[test]
    fn commit_notes_round_trip_and_refuse_anything_else() {
        let note = CommitNote { key: "model/L0/abc".into(), version: 42, pin: Pin::Soft };
        let bytes = note.encode();
        assert_eq!(CommitNote::decode(&bytes), Some(note));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(CommitNote::decode(&longer), None, "trailing bytes");
        assert_eq!(CommitNote::decode(&bytes[..bytes.len() - 1]), None, "cut short");
        assert_eq!(CommitNote::decode(&[]), None);
    }
}
