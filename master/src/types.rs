//! The directory's vocabulary: identities, requests, views of objects and the effects nodes
//! must apply. These are plain Rust types; wire types that mirror them live in the proto crate
//! (no serde here, by design: the RPC layer chooses its own encoding and versioning).

use std::sync::Arc;

/// A storage node, identified by an id it chooses and keeps across its restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u64);

/// A segment: the `index`-th segment a node registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentRef {
    pub node: NodeId,
    pub index: u32,
}

/// Storage medium of a segment or replica, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Hbm,
    Dram,
    Nvme,
    /// Durable object storage (S3 and friends): no node, no segment, never evicted by the master.
    ObjectStore,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Hbm, Tier::Dram, Tier::Nvme, Tier::ObjectStore];

    pub fn index(self) -> usize {
        self as usize
    }
}

/// When the object reaches object storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Persistence {
    #[default]
    None,
    /// Written back in the background; the tier manager reports it with `add_replica`.
    Lazy,
    /// The writer put it in object storage before `put_end`: the object has an object-store
    /// replica from the moment it completes.
    Eager,
}

/// Eviction protection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Pin {
    #[default]
    None,
    /// Evicted only when its segment has nothing else evictable.
    Soft,
    /// Never evicted; only a forced remove takes it.
    Hard,
}

/// Placement strategy for a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// Seeded random start, then a cyclic scan of the tier's segments.
    #[default]
    Random,
    /// Sample a few segments (power of d choices), take the most free by ratio first.
    FreeRatioFirst,
    /// Segments on the writer's host (`client_host`) first, then `FreeRatioFirst`.
    LocalFirst,
}

/// One segment a node contributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSpec {
    pub index: u32,
    pub tier: Tier,
    /// Address of byte 0 of the segment in the transfer engine's address space.
    pub base_addr: u64,
    pub capacity: u64,
}

/// An object a (re-)registering node holds; nodes are the source of truth after a master
/// restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldObject {
    pub key: String,
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    /// The version the master gave in `NodeEffect::Commit`; decides conflicts (higher wins).
    pub version: u64,
    pub segment: u32,
    pub offset: u64,
    pub tier: Tier,
    pub persistence: Persistence,
    pub pin: Pin,
    /// The node's tier manager knows this object is also in object storage.
    pub persisted: bool,
    /// The key and version the object had before its last rename, if the node remembers it:
    /// a copy still under that old name and version is stale (see `Directory::rename`).
    pub renamed_from: Option<(String, u64)>,
}

/// What `Directory::rename` does when the new name exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RenameMode {
    /// Replace the object there (POSIX rename): its ranges stay allocated until readers'
    /// lease ends, like an upsert's.
    #[default]
    Replace,
    /// `AlreadyExists`.
    NoReplace,
}

/// What a rename did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renamed {
    /// The renamed object's version before and after.
    pub from_version: u64,
    pub version: u64,
    /// The object store holds a copy (under the old name until the service moves it).
    pub persisted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRegistration {
    pub node: NodeId,
    /// Host identity, for same-host-first placement (several nodes may share a host).
    pub host: String,
    /// Transfer engine address of the node; opaque to the master.
    pub endpoint: String,
    pub segments: Vec<SegmentSpec>,
    pub held: Vec<HeldObject>,
}

/// Where a replica lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    Node(NodeLocation),
    ObjectStore,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeLocation {
    pub node: NodeId,
    pub segment: u32,
    pub tier: Tier,
    /// `base_addr + offset`: the address the transfer engine uses.
    pub addr: u64,
    pub offset: u64,
}

/// One copy of an object's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Replica {
    pub location: Location,
    pub len: u64,
}

impl Replica {
    pub fn tier(&self) -> Tier {
        match self.location {
            Location::Node(n) => n.tier,
            Location::ObjectStore => Tier::ObjectStore,
        }
    }

    pub fn node(&self) -> Option<NodeId> {
        match self.location {
            Location::Node(n) => Some(n.node),
            Location::ObjectStore => None,
        }
    }
}

/// Start of a two-phase put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutStart {
    pub key: String,
    pub size: u64,
    /// Wanted replicas, on distinct nodes; best effort (at least one).
    pub replicas: u8,
    /// Tier to place in (`Dram` by default; `ObjectStore` is refused).
    pub tier: Tier,
    pub persistence: Persistence,
    pub pin: Pin,
    pub strategy: Strategy,
    pub client_host: Option<String>,
    /// Segments to try first, in order (other tiers' segments are skipped).
    pub preferred_segments: Vec<SegmentRef>,
    /// Replace a complete object instead of answering `AlreadyExists`.
    pub upsert: bool,
}

impl PutStart {
    /// One DRAM replica, no persistence, no pin, random placement.
    pub fn new(key: impl Into<String>, size: u64) -> Self {
        PutStart {
            key: key.into(),
            size,
            replicas: 1,
            tier: Tier::Dram,
            persistence: Persistence::None,
            pin: Pin::None,
            strategy: Strategy::Random,
            client_host: None,
            preferred_segments: Vec::new(),
            upsert: false,
        }
    }
}

/// What `put_start` granted: where to write, and the version the object will carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutGrant {
    pub version: u64,
    pub replicas: Vec<Replica>,
    /// Objects that make-room eviction removed to fit this put (their `Drop` effects are in
    /// the call's effects): for the master's "removed" KV events, not for the writer. On
    /// `NoSpace`, objects evicted by the failed attempt are only visible as `Drop` effects.
    pub evicted: Vec<Arc<str>>,
}

/// End of a two-phase put.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutEnd {
    pub key: String,
    pub checksum: Option<[u8; 32]>,
    /// The version from the grant. When given, a put_end that does not match the pending put
    /// (its own put expired and another writer started) is refused with `NotFound` instead of
    /// completing the other writer's half-written object. Mooncake-compatible callers that do
    /// not know it pass `None`.
    pub version: Option<u64>,
}

impl PutEnd {
    pub fn new(key: impl Into<String>, checksum: Option<[u8; 32]>) -> Self {
        PutEnd { key: key.into(), checksum, version: None }
    }
}

/// A complete object as readers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectView {
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub replicas: Vec<Replica>,
    pub persistence: Persistence,
    pub pin: Pin,
    /// End of the read lease (0 if never leased). Readers must finish before it.
    pub lease_end_ms: u64,
}

/// What a node must do, delivered by the RPC layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEffect {
    /// Record that this range now holds a complete object (and report it when re-registering).
    Commit {
        node: NodeId,
        key: Arc<str>,
        segment: u32,
        offset: u64,
        size: u64,
        checksum: Option<[u8; 32]>,
        version: u64,
        persistence: Persistence,
        pin: Pin,
    },
    /// Forget the object stored in this range; the master already reuses the range (or, for
    /// a name removed under a read lease, will when the lease ends). `readers_until_ms` is the
    /// end of the object's read lease (0: never read): readers may still read a location they
    /// cached until then, through the node, so while it lies ahead the drop is delivered
    /// before the call that caused it is answered.
    /// `version` is the dropped copy's (a node that holds a newer version of the key there,
    /// committed by a writer in its own process, keeps it).
    Drop {
        node: NodeId,
        key: Arc<str>,
        segment: u32,
        offset: u64,
        len: u64,
        version: u64,
        readers_until_ms: u64,
    },
    /// The object the node holds under `from` (at `from_version`) is now `to` at `version`;
    /// one per node, covering all its copies.
    Rename { node: NodeId, from: Arc<str>, to: Arc<str>, from_version: u64, version: u64 },
}

impl NodeEffect {
    pub fn node(&self) -> NodeId {
        match self {
            NodeEffect::Commit { node, .. }
            | NodeEffect::Drop { node, .. }
            | NodeEffect::Rename { node, .. } => *node,
        }
    }
}

/// One entry of a flat listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub key: Arc<str>,
    pub size: u64,
    pub version: u64,
}

/// A page of `list`: `next_start_after` is `Some` when more entries may follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage {
    pub entries: Vec<ListEntry>,
    pub next_start_after: Option<String>,
}

/// One immediate child of a `/`-separated prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirEntry {
    /// An object; `name` is the key without the prefix.
    Object { name: String, size: u64, version: u64 },
    /// A sub-directory; `name` ends with `/`.
    Dir { name: String },
}

impl DirEntry {
    pub fn name(&self) -> &str {
        match self {
            DirEntry::Object { name, .. } | DirEntry::Dir { name } => name,
        }
    }
}

/// A page of `list_dir`; resume with `start_after = next_start_after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirPage {
    pub entries: Vec<DirEntry>,
    pub next_start_after: Option<String>,
}

/// Outcome of `remove_regex` / `remove_all`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoveCounts {
    pub removed: u64,
    /// Skipped because a read lease was live (only without force).
    pub skipped_leased: u64,
    /// Skipped because hard-pinned (only without force).
    pub skipped_pinned: u64,
}

/// Outcome of an eviction pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Replicas dropped (each also produced a `NodeEffect::Drop`).
    pub replicas: u64,
    pub bytes: u64,
    /// Objects that lost their last replica and are gone (for KV "removed" events).
    pub removed_keys: Vec<Arc<str>>,
}

/// Why a held object or a replica report was not adopted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictReason {
    /// Bad key, zero or too large size.
    Invalid,
    UnknownSegment,
    /// The tier named in the report is not the segment's tier.
    TierMismatch,
    /// The range leaves the segment or overlaps another replica.
    Overlap,
    /// The node already holds a replica of this object in this tier.
    Duplicate,
    /// Another copy under the same key has a higher version (or, at equal versions, the greater
    /// `(size, checksum)`) and won.
    Superseded,
}

/// A replica that was refused or dropped while adopting reports; a `Drop` effect was produced
/// for it so that its node frees the space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub key: String,
    pub node: NodeId,
    pub segment: u32,
    pub offset: u64,
    pub reason: ConflictReason,
}

/// Outcome of `register_node`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registration {
    /// Held objects adopted as replicas.
    pub adopted: u64,
    pub conflicts: Vec<Conflict>,
    /// Objects that had replicas only on this node's previous incarnation and were not
    /// reported again: they are gone.
    pub lost_keys: Vec<Arc<str>>,
    /// Ranges a previous leader granted on this node, kept from new placements until their
    /// writers' deadlines (see [`crate::Directory::inherit`]).
    pub reserved: u64,
}

/// A range handed to a writer that has not settled yet: a pending put's replica or a load's
/// DRAM copy (see [`crate::Directory::outstanding_grants`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantedRange {
    pub key: Arc<str>,
    pub version: u64,
    pub node: NodeId,
    /// The segment's index on its node.
    pub segment: u32,
    pub offset: u64,
    pub len: u64,
    /// Wall-clock ms after which the writer can no longer complete.
    pub deadline_ms: u64,
}

/// Outcome of `expire` / `unregister_node`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLoss {
    pub nodes: Vec<NodeId>,
    /// Objects left without any replica: gone. Persisted objects keep their object-store
    /// replica and are not listed.
    pub lost_keys: Vec<Arc<str>>,
    /// Pending puts that lost every allocated range and were revoked.
    pub revoked_puts: u64,
}

/// Outcome of `tick`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tick {
    /// Pending puts that passed `put_timeout_ms` and were revoked.
    pub expired_puts: u64,
    /// Ranges of replaced (upserted) objects released after their readers' lease ended.
    pub released_ranges: u64,
}

/// Per-tier figures of `stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Replicas of complete objects in this tier.
    pub replicas: u64,
    /// Logical bytes of those replicas.
    pub bytes: u64,
    /// Allocator view: capacity and used bytes (includes pending puts and alignment).
    pub capacity_bytes: u64,
    pub used_bytes: u64,
}

/// A snapshot of the directory's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub objects: u64,
    pub pending_puts: u64,
    pub nodes: u64,
    pub segments: u64,
    /// Indexed by `Tier::index()`.
    pub tiers: [TierStats; 4],
    pub evicted_objects: u64,
    pub evicted_replicas: u64,
    pub evicted_bytes: u64,
    /// Estimated heap bytes of the directory's metadata (see `directory::memory`).
    pub metadata_bytes: u64,
    pub metadata_bytes_per_object: f64,
}
