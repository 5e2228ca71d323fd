//! The object directory: which complete objects exist, where their replicas are, who may read
//! them (leases), what may be evicted, and which puts are in flight.
//!
//! Mechanism (memory layout, chosen for ~10^7 objects, see `memory.rs` for the figures):
//! - objects live in a paged [`Slab`] of compact `Obj` records (88 bytes, their first node
//!   replica inline) addressed by `u32`;
//! - key bytes are stored once, in `keys` (`keys.rs`: packed chunks, no allocation per key);
//!   an object holds its key's position, in one word with its flags;
//! - `index`, a `hashbrown::HashTable<u32>`, maps a key to its object id, comparing keys
//!   through the arena (a lookup reads the object's slot, then its key);
//! - `order` (`order.rs`) keeps object ids sorted by key for paged `list` / `list_dir`: no
//!   second copy of the keys;
//! - effects and answers carry keys as `Arc<str>`, made from the arena when needed;
//! - further replicas live in their own slab (28 bytes each), chained from their object; every
//!   node replica, inline or not, is threaded on one of three intrusive LRU lists of its
//!   segment: unpinned, soft-pinned, hard-pinned (a `u32` names either kind, see [`MORE`]);
//! - pending puts live apart, in `pending`, keyed by key: they are invisible by construction,
//!   since every read path only looks at `index`.
//!
//! Policy summary (details on each method):
//! - first writer wins: `put_start` of a complete key is `AlreadyExists`, of a pending one is
//!   `PutInProgress` (retryable); `upsert` replaces, refused while a read lease is live;
//! - `get` / `exists` grant or extend a read lease of `lease_ttl_ms`; `get` and `put_end` count
//!   as use for LRU, `exists` and `stat` do not;
//! - a leased object cannot be removed without force, and is never evicted; a hard-pinned one
//!   is never evicted and only removed with force;
//! - time only enters as `now_ms` arguments; randomness only from the seeded RNG; iteration
//!   orders are deterministic (fixed-seed hashing, ordered maps), so a seed and a call sequence
//!   replay exactly.
//!
//! Effects: calls that need nodes to act append [`NodeEffect`]s to a caller-supplied
//! `fx: &mut Vec<NodeEffect>` (several paths produce them implicitly: eviction inside a put,
//! the end of an upsert, lease-deferred releases in `tick`), so single calls and batches share
//! one sink and the RPC layer delivers them after the call.
//!
//! Invariants (checked by [`Directory::verify`], run after every step of the simulation test):
//! every complete object has >= 1 replica (a node replica or the object-store one); at most one
//! replica per (node, tier) and put placement on distinct nodes; every replica and pending
//! range is allocated in its segment's allocator and nothing else is; no two ranges overlap.
//!
//! Not handled here: networking, persistence of the directory itself (nodes re-report what they
//! hold, see `register_node`), soft-pin TTLs, object groups. Tenants
//! and their quotas: `tenants.rs`.

mod check;
mod events;
mod evict;
mod keys;
mod list;
mod memory;
mod nodes;
mod order;
mod placement;
mod rename;
mod tenants;
#[cfg(test)]
mod tests;
mod tiers;

pub use events::{PoolEvent, PoolEventKind, PoolEventStats, PoolMedium};
pub use tenants::{Quota, TENANT_PREFIX, TenantUsage, tenant_of, valid_tenant};
pub use tiers::{LoadPlan, PendingView, PersistedObject, ReportOutcome};

use std::collections::{BTreeMap, HashMap};
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;

use foldhash::fast::FixedState;
use hashbrown::HashTable;
use std::hash::BuildHasher;

use crate::alloc::Allocator;
use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::rng::Rng;
use crate::slab::{Links, List, NIL, Slab};
use crate::types::*;
use keys::KeyAt;

/// Which of a segment's LRU lists a replica is on; follows the object's (immutable) pin.
const LIST_PLAIN: usize = 0;
const LIST_SOFT: usize = 1;
const LIST_HARD: usize = 2;

/// Keys looked up together by the batch read paths.
const LOOKUP_GROUP: usize = 32;

fn list_of(pin: Pin) -> usize {
    match pin {
        Pin::None => LIST_PLAIN,
        Pin::Soft => LIST_SOFT,
        Pin::Hard => LIST_HARD,
    }
}

/// A complete object, with its first node replica inline (most objects have one). 88 bytes.
///
/// Its node replicas, newest first: the chain from `more` (`Rep`s linked by `Rep::obj_next`),
/// then the inline one. The inline slot is only filled when the object has no replica, so it
/// is always the oldest, and the order is the order of attachment, reversed.
///
/// Fields in this order (`repr(C)`): a lookup reads `head` and `exists` then `lease_end_ms`,
/// so they share 16 bytes (one cache line for 7 slots in 8; the slots are 88 bytes apart);
/// the checksum, read only by views, comes last.
#[derive(Debug)]
#[repr(C)]
struct Obj {
    /// Where its key is in `Directory::keys`, and its flags.
    head: Head,
    lease_end_ms: u64,
    size: u64,
    version: u64,
    /// The inline replica: its offset, segment (`None`: no inline replica) and LRU links.
    rep_offset: u64,
    rep_seg: Option<NonZeroU32>,
    rep_prev: u32,
    rep_next: u32,
    /// First of the object's other node replicas, or `NIL`.
    more: u32,
    checksum: [u8; 32],
}

/// A node replica, as the LRU lists and the directory name it: an object id (`< MORE`) is
/// that object's inline replica, `MORE | i` is `reps[i]`. Object ids are below 2^31
/// (`Config::objects_max`) and so are `Rep` ids (asserted).
const MORE: u32 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flags {
    has_checksum: bool,
    persisted: bool,
    pin: Pin,
    persistence: Persistence,
}

impl Flags {
    fn bits(self) -> u8 {
        let pin = match self.pin {
            Pin::None => 0,
            Pin::Soft => 1,
            Pin::Hard => 2,
        };
        let persistence = match self.persistence {
            Persistence::None => 0,
            Persistence::Lazy => 1,
            Persistence::Eager => 2,
        };
        u8::from(self.has_checksum) | u8::from(self.persisted) << 1 | pin << 2 | persistence << 4
    }

    fn from_bits(bits: u8) -> Flags {
        let pin = match bits >> 2 & 3 {
            0 => Pin::None,
            1 => Pin::Soft,
            _ => Pin::Hard,
        };
        let persistence = match bits >> 4 & 3 {
            0 => Persistence::None,
            1 => Persistence::Lazy,
            _ => Persistence::Eager,
        };
        Flags { has_checksum: bits & 1 != 0, persisted: bits & 2 != 0, pin, persistence }
    }
}

/// Where an object's key is in the key arena (a [`KeyAt`], bits 0..57) and its flags (bits
/// 57..63) in one word, never zero (bit 63 is set), so that a `Slab` slot needs no tag of its
/// own.
#[derive(Debug, Clone, Copy)]
struct Head(NonZeroU64);

impl Head {
    fn new(key: KeyAt, flags: Flags) -> Head {
        debug_assert!(flags.bits() < 1 << 6);
        let word = 1 << 63 | u64::from(flags.bits()) << KeyAt::BITS | key.bits();
        Head(NonZeroU64::new(word).expect("bit 63 is set"))
    }

    fn key(self) -> KeyAt {
        KeyAt::from_bits(self.0.get())
    }

    fn flags(self) -> Flags {
        Flags::from_bits((self.0.get() >> KeyAt::BITS) as u8 & 0x3f)
    }
}

impl Obj {
    /// A record with its key not stored yet (`insert_object` does).
    fn new(size: u64, version: u64, checksum: Option<[u8; 32]>, flags: Flags) -> Obj {
        let flags = Flags { has_checksum: checksum.is_some(), ..flags };
        Obj {
            head: Head::new(KeyAt::from_bits(0), flags),
            size,
            version,
            lease_end_ms: 0,
            checksum: checksum.unwrap_or_default(),
            rep_seg: None,
            rep_offset: 0,
            rep_prev: NIL,
            rep_next: NIL,
            more: NIL,
        }
    }

    fn has_replicas(&self) -> bool {
        self.rep_seg.is_some() || self.more != NIL
    }

    fn flags(&self) -> Flags {
        self.head.flags()
    }

    fn set_flags(&mut self, flags: Flags) {
        self.head = Head::new(self.head.key(), flags);
    }

    fn key_at(&self) -> KeyAt {
        self.head.key()
    }

    fn set_key_at(&mut self, at: KeyAt) {
        self.head = Head::new(at, self.head.flags());
    }

    fn checksum(&self) -> Option<[u8; 32]> {
        self.flags().has_checksum.then_some(self.checksum)
    }
}

/// The key of object `id`, read through the arena (for [`order::KeyOrder`]'s `key_of`).
fn key_reader<'a>(objects: &'a Slab<Obj>, keys: &'a keys::KeyArena) -> impl Fn(u32) -> &'a [u8] {
    move |id| keys.get(objects[id].key_at())
}

/// The index's hash of a key: its bytes and a terminator, as `str` hashes (one foldhash round
/// fewer than a byte slice, which starts with its length).
fn key_hash(hasher: &FixedState, key: &[u8]) -> u64 {
    struct Bytes<'a>(&'a [u8]);
    impl std::hash::Hash for Bytes<'_> {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            state.write(self.0);
            state.write_u8(0xff);
        }
    }
    hasher.hash_one(Bytes(key))
}

/// A key the directory stored: it was a `str` when stored.
fn key_str(key: &[u8]) -> &str {
    std::str::from_utf8(key).expect("stored keys are str")
}

/// A node replica of a complete object beyond its inline one. 28 bytes (the offset in two
/// halves, so that the record needs no 8-byte alignment).
#[derive(Debug)]
struct Rep {
    obj: u32,
    seg: NonZeroU32,
    offset: [u32; 2],
    prev: u32,
    next: u32,
    /// The object's next (older) replica in `reps`, or `NIL`.
    obj_next: u32,
}

impl Rep {
    fn offset(&self) -> u64 {
        u64::from(self.offset[1]) << 32 | u64::from(self.offset[0])
    }
}

/// The LRU links of every node replica, inline or not (see [`MORE`]).
struct RepLinks<'a> {
    objects: &'a mut Slab<Obj>,
    reps: &'a mut Slab<Rep>,
}

/// A replica's `(prev, next)` on its LRU list.
fn lru_links(objects: &Slab<Obj>, reps: &Slab<Rep>, r: u32) -> (u32, u32) {
    if r & MORE == 0 {
        let o = &objects[r];
        (o.rep_prev, o.rep_next)
    } else {
        let p = &reps[r & !MORE];
        (p.prev, p.next)
    }
}

impl Links for RepLinks<'_> {
    fn links(&self, r: u32) -> (u32, u32) {
        lru_links(self.objects, self.reps, r)
    }

    fn set_links(&mut self, r: u32, prev: u32, next: u32) {
        if r & MORE == 0 {
            let o = &mut self.objects[r];
            (o.rep_prev, o.rep_next) = (prev, next);
        } else {
            let p = &mut self.reps[r & !MORE];
            (p.prev, p.next) = (prev, next);
        }
    }
}

#[derive(Debug)]
struct Segment {
    node: NodeId,
    index: u32,
    tier: Tier,
    base_addr: u64,
    alloc: Allocator,
    lru: [List; 3],
}

#[derive(Debug)]
struct Node {
    host: String,
    endpoint: String,
    /// Segment ids, in registration order.
    segs: Vec<NonZeroU32>,
    last_seen_ms: u64,
    /// When its control connection closed; such a node gets no new replicas.
    disconnected_ms: Option<u64>,
    /// Its registration's objects are still being adopted (`adopt_held`); their ranges are
    /// reserved meanwhile (`register_node_begin`).
    adopting: bool,
}

#[derive(Debug)]
struct Pending {
    version: u64,
    size: u64,
    deadline_ms: u64,
    persistence: Persistence,
    pin: Pin,
    upsert: bool,
    /// The tier of every range.
    tier: Tier,
    ranges: Vec<(NonZeroU32, u64)>,
}

/// Where a dropped copy lay, and its version (for [`NodeEffect::Drop`]).
#[derive(Debug, Clone, Copy)]
struct DroppedCopy {
    seg: NonZeroU32,
    offset: u64,
    len: u64,
    version: u64,
}

/// A range kept allocated until `release_at_ms`: a replaced object's, until its readers'
/// lease ends (`key` names it, for the node's drop), or one a previous leader granted, until
/// its writer's deadline (`key` is `None`: no object of ours lies there).
#[derive(Debug)]
struct Retired {
    release_at_ms: u64,
    seg: NonZeroU32,
    offset: u64,
    len: u64,
    key: Option<Arc<str>>,
    version: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    evicted_objects: u64,
    evicted_replicas: u64,
    evicted_bytes: u64,
    /// Object-store deletions dropped because the list was full (see `tiers`).
    unpersisted_dropped: u64,
}

/// The master's object directory. See the module notes.
#[derive(Debug)]
pub struct Directory {
    cfg: Config,
    rng: Rng,
    hasher: FixedState,
    objects: Slab<Obj>,
    reps: Slab<Rep>,
    /// Key bytes of the complete objects, once each.
    keys: keys::KeyArena,
    /// Maps the hash of a key to its object id; keys are compared through `keys`.
    index: HashTable<u32>,
    /// Object ids in key order, for listings.
    order: order::KeyOrder,
    pending: hashbrown::HashMap<Arc<str>, Pending, FixedState>,
    retired: Vec<Retired>,
    /// Ranges the previous leader granted, per node, reserved when the node registers (see
    /// [`Directory::inherit`]); pruned at their deadlines.
    inherited: HashMap<NodeId, Vec<crate::GrantedRange>>,
    /// Objects adopted before this time get a read lease until it (see `inherit`).
    adopted_lease_until_ms: u64,
    /// DRAM ranges being filled by loads (see `tiers`), keyed by object key.
    loading: hashbrown::HashMap<Arc<str>, tiers::Loading, FixedState>,
    /// Persisted objects removed or replaced, whose object-store copy must go (see `tiers`).
    unpersisted: Vec<(Arc<str>, u64)>,
    /// Names renamed away, for recovery's duplicate check (see `rename`).
    renamed_away: rename::RenamedAway,
    nodes: BTreeMap<NodeId, Node>,
    /// Indexed by segment id; slot 0 is never used so that ids are `NonZeroU32`.
    segments: Vec<Option<Segment>>,
    free_seg_ids: Vec<NonZeroU32>,
    /// Segment ids of each tier, for placement.
    tier_segs: [Vec<NonZeroU32>; 4],
    /// Replicas and logical bytes of complete objects per tier.
    tier_replicas: [u64; 4],
    tier_bytes: [u64; 4],
    last_version: u64,
    counters: Counters,
    /// Pool events for the kv event publisher, when enabled (see `events`).
    events: Option<events::Journal>,
    /// Usage and quotas of every tenant seen (see `tenants`).
    tenants: hashbrown::HashMap<Box<str>, TenantUsage, FixedState>,
}

impl Directory {
    /// A directory with no nodes. Fails only on an invalid configuration.
    pub fn new(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        let hasher = FixedState::with_seed(cfg.seed);
        Ok(Directory {
            rng: Rng::new(cfg.seed),
            hasher,
            objects: Slab::default(),
            reps: Slab::default(),
            keys: keys::KeyArena::default(),
            index: HashTable::new(),
            order: order::KeyOrder::default(),
            pending: hashbrown::HashMap::with_hasher(FixedState::with_seed(cfg.seed)),
            tenants: hashbrown::HashMap::with_hasher(FixedState::with_seed(cfg.seed)),
            retired: Vec::new(),
            inherited: HashMap::new(),
            adopted_lease_until_ms: 0,
            loading: hashbrown::HashMap::with_hasher(FixedState::with_seed(cfg.seed)),
            unpersisted: Vec::new(),
            renamed_away: rename::RenamedAway::default(),
            nodes: BTreeMap::new(),
            segments: vec![None],
            free_seg_ids: Vec::new(),
            tier_segs: Default::default(),
            tier_replicas: [0; 4],
            tier_bytes: [0; 4],
            last_version: 0,
            counters: Counters::default(),
            events: None,
            cfg,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Number of complete objects.
    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    // ----- two-phase put -------------------------------------------------------------------

    /// Allocate one range per replica on distinct nodes and record a pending put.
    ///
    /// - a pending put of the key that has not timed out: `PutInProgress` (retryable); one that
    ///   timed out is revoked first and this put proceeds;
    /// - a complete object: `AlreadyExists` (first writer wins), unless `upsert`, which is
    ///   refused with `Leased` while a read lease is live (Mooncake: `OBJECT_REPLICA_BUSY`);
    ///   an upsert may replace a hard-pinned object (the writer names the key explicitly; the
    ///   new value carries the pin of its own request);
    /// - fewer usable nodes than `replicas` gives as many replicas as there are nodes; when
    ///   space is short, bounded make-room eviction rounds run first (their `Drop` effects go
    ///   to `fx`); no range at all is `NoSpace`.
    pub fn put_start(
        &mut self,
        req: &PutStart,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<PutGrant> {
        const OP: &str = "put_start";
        self.check_put(req).map_err(|e| e.with_key(&req.key))?;
        let key = req.key.as_str();
        if let Some(p) = self.pending.get(key) {
            if p.deadline_ms > now_ms {
                let detail = format!("another put ends by {} ms", p.deadline_ms);
                return Err(Error::new(ErrorKind::PutInProgress, OP)
                    .with_key(key)
                    .with_detail(detail));
            }
            self.revoke_pending(key, fx);
        }
        if let Some(id) = self.lookup(key) {
            if !req.upsert {
                return Err(Error::new(ErrorKind::AlreadyExists, OP).with_key(key));
            }
            let lease_end = self.objects[id].lease_end_ms;
            if lease_end > now_ms {
                let detail = format!("upsert refused: read lease until {lease_end} ms");
                return Err(Error::new(ErrorKind::Leased, OP).with_key(key).with_detail(detail));
            }
        }
        if (self.objects.len() + self.pending.len()) as u64 >= self.cfg.objects_max {
            let detail = format!("objects_max {} reached", self.cfg.objects_max);
            return Err(Error::new(ErrorKind::NoSpace, OP).with_key(key).with_detail(detail));
        }
        let mut evicted = Vec::new();
        self.check_quota(req, now_ms, fx, &mut evicted)?;
        let ranges = self.place(req, now_ms, fx, &mut evicted);
        if ranges.is_empty() {
            let detail = if self.tier_segs[req.tier.index()].is_empty() {
                format!("no node contributes a {:?} segment", req.tier)
            } else {
                format!("no {:?} segment has {} free bytes", req.tier, req.size)
            };
            return Err(Error::new(ErrorKind::NoSpace, OP).with_key(key).with_detail(detail));
        }
        let version = self.next_version(now_ms);
        let replicas = ranges.iter().map(|&(seg, offset)| self.replica_view(seg, offset, req.size));
        let grant = PutGrant { version, replicas: replicas.collect(), evicted };
        let pending = Pending {
            version,
            size: req.size,
            deadline_ms: now_ms.saturating_add(self.cfg.put_timeout_ms),
            persistence: req.persistence,
            pin: req.pin,
            upsert: req.upsert,
            tier: req.tier,
            ranges,
        };
        self.tenant_pending(key, req.tier, req.size * pending.ranges.len() as u64, true);
        self.pending.insert(Arc::from(key), pending);
        Ok(grant)
    }

    /// Make a pending put complete and visible; `Commit` effects go to `fx` for every replica
    /// (and `Drop` effects for the replaced object of an upsert, deferred by `tick` until its
    /// read lease ends if readers took one while the new value was written).
    ///
    /// Refused with `NotFound` when no pending put matches (never started, revoked, timed out,
    /// every allocated segment lost, or `version` names another writer's put), and with
    /// `AlreadyExists` when a non-upsert put finds that a complete object appeared meanwhile
    /// (adopted from a re-registering node): first writer wins, the ranges are freed.
    pub fn put_end(&mut self, end: &PutEnd, now_ms: u64, fx: &mut Vec<NodeEffect>) -> Result<()> {
        const OP: &str = "put_end";
        let key = end.key.as_str();
        let not_found = |detail: &str| {
            Err(Error::new(ErrorKind::NotFound, OP).with_key(key).with_detail(detail))
        };
        let Some((key_arc, p)) = self.pending.get_key_value(key) else {
            return not_found("no pending put");
        };
        if end.version.is_some_and(|v| v != p.version) {
            return not_found("the pending put has another version (this put was revoked)");
        }
        if p.deadline_ms <= now_ms {
            self.revoke_pending(key, fx);
            return not_found("put timed out");
        }
        let key_arc = key_arc.clone();
        let p = self.pending.remove(key).expect("looked up above");
        self.tenant_pending(key, p.tier, p.size * p.ranges.len() as u64, false);
        if p.ranges.is_empty() {
            return not_found("every allocated segment was lost");
        }
        if let Some(old) = self.lookup(key) {
            if !p.upsert {
                self.abandon_ranges(&key_arc, &p, fx);
                return Err(Error::new(ErrorKind::AlreadyExists, OP).with_key(key));
            }
            self.replace_old(old, now_ms, fx);
        }
        let flags = Flags {
            has_checksum: end.checksum.is_some(),
            persisted: p.persistence == Persistence::Eager,
            pin: p.pin,
            persistence: p.persistence,
        };
        let paused = self.events_pause();
        let id = self.insert_object(key, Obj::new(p.size, p.version, end.checksum, flags));
        for &(seg, offset) in &p.ranges {
            self.attach_replica(id, seg, offset);
            fx.push(self.commit_effect(&key_arc, id, seg, offset));
        }
        self.events_resume(paused, id, None);
        Ok(())
    }

    /// Abandon a pending put and free its ranges. `NotFound` if there is none.
    pub fn put_revoke(&mut self, key: &str, fx: &mut Vec<NodeEffect>) -> Result<()> {
        if self.revoke_pending(key, fx) {
            Ok(())
        } else {
            Err(Error::new(ErrorKind::NotFound, "put_revoke")
                .with_key(key)
                .with_detail("no pending put"))
        }
    }

    pub fn put_start_batch(
        &mut self,
        reqs: &[PutStart],
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Vec<Result<PutGrant>> {
        reqs.iter().map(|r| self.put_start(r, now_ms, fx)).collect()
    }

    pub fn put_end_batch(
        &mut self,
        ends: &[PutEnd],
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Vec<Result<()>> {
        ends.iter().map(|e| self.put_end(e, now_ms, fx)).collect()
    }

    pub fn put_revoke_batch<K: AsRef<str>>(
        &mut self,
        keys: &[K],
        fx: &mut Vec<NodeEffect>,
    ) -> Vec<Result<()>> {
        keys.iter().map(|k| self.put_revoke(k.as_ref(), fx)).collect()
    }

    // ----- reads ---------------------------------------------------------------------------

    /// The object's view; grants (or extends) a read lease to `now_ms + lease_ttl_ms` and
    /// counts as a use for LRU.
    pub fn get(&mut self, key: &str, now_ms: u64) -> Result<ObjectView> {
        let id = self.find(key, "get")?;
        self.lease(id, now_ms);
        self.touch(id);
        Ok(self.view(id))
    }

    /// Like `get` without a lease and without counting as a use.
    pub fn stat(&self, key: &str) -> Result<ObjectView> {
        self.find(key, "stat").map(|id| self.view(id))
    }

    /// Whether a complete object exists; grants a lease like Mooncake's `ExistKey`. Not a use
    /// for LRU.
    pub fn exists(&mut self, key: &str, now_ms: u64) -> Result<bool> {
        self.check_key(key, "exists")?;
        Ok(self.lookup(key).map(|id| self.lease(id, now_ms)).is_some())
    }

    /// Batch `get`: same answers as calling `get` per key, looked up in groups.
    pub fn get_batch<K: AsRef<str>>(&mut self, keys: &[K], now_ms: u64) -> Vec<Result<ObjectView>> {
        let mut out = Vec::with_capacity(keys.len());
        let mut ids = [NIL; LOOKUP_GROUP];
        for group in keys.chunks(LOOKUP_GROUP) {
            self.find_group(group, &mut ids);
            for (key, &id) in group.iter().zip(&ids) {
                let key = key.as_ref();
                out.push(match self.check_key(key, "get") {
                    Err(e) => Err(e),
                    Ok(()) if id == NIL => {
                        Err(Error::new(ErrorKind::NotFound, "get").with_key(key))
                    }
                    Ok(()) => {
                        self.lease(id, now_ms);
                        self.touch(id);
                        Ok(self.view(id))
                    }
                });
            }
        }
        out
    }

    pub fn stat_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Result<ObjectView>> {
        keys.iter().map(|k| self.stat(k.as_ref())).collect()
    }

    /// Batch `exists`: same answers as calling `exists` per key, looked up in groups whose
    /// memory accesses overlap (see `find_group`).
    pub fn exists_batch<K: AsRef<str>>(&mut self, keys: &[K], now_ms: u64) -> Vec<Result<bool>> {
        let mut out = Vec::with_capacity(keys.len());
        let mut ids = [NIL; LOOKUP_GROUP];
        for group in keys.chunks(LOOKUP_GROUP) {
            self.find_group(group, &mut ids);
            for (key, &id) in group.iter().zip(&ids) {
                let key = key.as_ref();
                out.push(match self.check_key(key, "exists") {
                    Err(e) => Err(e),
                    Ok(()) if id == NIL => Ok(false),
                    Ok(()) => {
                        self.lease(id, now_ms);
                        Ok(true)
                    }
                });
            }
        }
        out
    }

    /// Look up up to `LOOKUP_GROUP` keys (invalid ones give `NIL`) in phases: hash all, probe all,
    /// load all object slots, load all stored keys, compare all keys. Each phase's loads are
    /// independent across keys, so the CPU overlaps their cache misses instead of paying three
    /// dependent misses per key in a row: this is what makes a 10 000-key batch fast on a 10^7-key
    /// directory.
    fn find_group<K: AsRef<str>>(&self, keys: &[K], ids: &mut [u32; LOOKUP_GROUP]) {
        let mut hashes = [0u64; LOOKUP_GROUP];
        for (h, key) in hashes.iter_mut().zip(keys) {
            *h = self.hash(key.as_ref().as_bytes());
        }
        // the keys found, by their place in `keys`: the next phases skip misses
        let mut found = [0u8; LOOKUP_GROUP];
        let mut n = 0;
        for (i, key) in keys.iter().enumerate() {
            ids[i] = if self.key_ok(key.as_ref()) {
                self.index.iter_hash(hashes[i]).next().copied().unwrap_or(NIL)
            } else {
                NIL
            };
            found[n] = i as u8;
            n += usize::from(ids[i] != NIL);
        }
        let found = &found[..n];
        let mut at = [KeyAt::default(); LOOKUP_GROUP];
        for (a, &i) in at.iter_mut().zip(found) {
            let o = &self.objects[ids[usize::from(i)]];
            *a = o.key_at();
            // the callers lease what they find: load that cache line now too
            std::hint::black_box(o.lease_end_ms);
        }
        // keys of the right length only (the length comes with the position): load their
        // cache lines, all keys in one loop so that the misses overlap
        let mut touched = 0;
        for (&a, &i) in at.iter().zip(found) {
            if a.len_is(keys[usize::from(i)].as_ref().len()) {
                touched ^= self.keys.touch(a);
            }
        }
        std::hint::black_box(touched);
        for (&a, &i) in at.iter().zip(found) {
            let key = keys[usize::from(i)].as_ref();
            if self.keys.get(a) != key.as_bytes() {
                // a 7-bit tag collision: rare, take the full path
                ids[usize::from(i)] = self.lookup(key).unwrap_or(NIL);
            }
        }
    }

    // ----- removal -------------------------------------------------------------------------

    /// Remove a complete object; `Drop` effects for its replicas go to `fx`. Without `force`,
    /// a live lease gives `Leased` and a hard pin `Pinned`. Pending puts are invisible here
    /// (`NotFound`).
    pub fn remove(
        &mut self,
        key: &str,
        force: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<()> {
        const OP: &str = "remove";
        let id = self.find(key, OP)?;
        if !force {
            self.removable(id, now_ms).map_err(|kind| Error::new(kind, OP).with_key(key))?;
        }
        self.remove_object(id, Some(fx));
        Ok(())
    }

    pub fn remove_batch<K: AsRef<str>>(
        &mut self,
        keys: &[K],
        force: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Vec<Result<()>> {
        keys.iter().map(|k| self.remove(k.as_ref(), force, now_ms, fx)).collect()
    }

    /// Remove every complete object whose key matches `pattern` (Rust `regex` syntax,
    /// unanchored like Mooncake's `std::regex_search`). Without `force`, leased and
    /// hard-pinned objects are skipped and counted. Scans every key: an admin call.
    pub fn remove_regex(
        &mut self,
        pattern: &str,
        force: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<RemoveCounts> {
        let re = regex::RegexBuilder::new(pattern).size_limit(1 << 20).build().map_err(|e| {
            Error::new(ErrorKind::InvalidArgument, "remove_regex").with_detail(e.to_string())
        })?;
        let ids: Vec<u32> =
            self.order.iter().filter(|&id| re.is_match(key_str(self.key(id)))).collect();
        Ok(self.remove_ids(&ids, force, now_ms, fx))
    }

    /// Remove every complete object (pending puts are left alone), with the same skipping
    /// rules as `remove_regex`.
    pub fn remove_all(
        &mut self,
        force: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> RemoveCounts {
        let ids: Vec<u32> = self.objects.iter().map(|(id, _)| id).collect();
        self.remove_ids(&ids, force, now_ms, fx)
    }

    fn remove_ids(
        &mut self,
        ids: &[u32],
        force: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> RemoveCounts {
        let mut counts = RemoveCounts::default();
        for &id in ids {
            match if force { Ok(()) } else { self.removable(id, now_ms) } {
                Ok(()) => {
                    self.remove_object(id, Some(&mut *fx));
                    counts.removed += 1;
                }
                Err(ErrorKind::Leased) => counts.skipped_leased += 1,
                Err(_) => counts.skipped_pinned += 1,
            }
        }
        counts
    }

    /// Clear an object whose read lease has ended and that was not written within the lease
    /// TTL either (the reference's `batch_replica_clear`, whose puts grant a lease):
    /// every replica with `node` None, else only the node replicas on `node` (the object goes
    /// when nothing is left). `Ok(false)` when the object has no replica on `node`; `Leased`
    /// or `Pinned` (hard) when it may not be touched; `NotFound` when it does not exist.
    pub fn clear_replicas(
        &mut self,
        key: &str,
        node: Option<NodeId>,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<bool> {
        const OP: &str = "clear_replicas";
        let id = self.find(key, OP)?;
        self.removable(id, now_ms).map_err(|kind| Error::new(kind, OP).with_key(key))?;
        // The reference leases an object at its put: one written within the lease TTL is kept.
        let put_ms = self.objects[id].version >> 20;
        if put_ms.saturating_add(self.cfg.lease_ttl_ms) > now_ms {
            let detail = "written within the lease TTL";
            return Err(Error::new(ErrorKind::Leased, OP).with_key(key).with_detail(detail));
        }
        let Some(node) = node else {
            self.remove_object(id, Some(fx));
            return Ok(true);
        };
        let on_node: Vec<u32> = self
            .replicas(id)
            .filter(|&(_, seg, _)| self.segment(seg).node == node)
            .map(|(rep, _, _)| rep)
            .collect();
        if on_node.is_empty() {
            return Ok(false);
        }
        let (size, version) = (self.objects[id].size, self.objects[id].version);
        let key = self.key_arc(id);
        for rep in on_node {
            let (seg, offset) = self.detach_replica(rep);
            fx.push(self.drop_effect(&key, DroppedCopy { seg, offset, len: size, version }));
            self.free_range(seg, offset, size);
        }
        if self.is_orphan(id) {
            self.remove_object(id, None);
        }
        Ok(true)
    }

    fn removable(&self, id: u32, now_ms: u64) -> Result<(), ErrorKind> {
        let o = &self.objects[id];
        if o.flags().pin == Pin::Hard {
            return Err(ErrorKind::Pinned);
        }
        if o.lease_end_ms > now_ms {
            return Err(ErrorKind::Leased);
        }
        Ok(())
    }

    // ----- replica reports (tiers) ---------------------------------------------------------

    /// Record a new replica of a complete object: a node moved or copied it to another tier
    /// (its range is reserved in that segment's allocator) or persisted it
    /// (`Location::ObjectStore`). `Conflict` when the range is not free or the node already
    /// has a replica in that tier; `NodeUnknown` / `InvalidArgument` for a bad location.
    pub fn add_replica(&mut self, key: &str, location: &Location) -> Result<()> {
        const OP: &str = "add_replica";
        let id = self.find(key, OP)?;
        let Location::Node(loc) = location else {
            self.set_persisted(id, true);
            return Ok(());
        };
        let seg = self.locate(loc, OP).map_err(|e| e.with_key(key))?;
        let size = self.objects[id].size;
        if self.replica_on(id, loc.node, loc.tier).is_some() {
            let detail = format!("node {} already has a {:?} replica", loc.node.0, loc.tier);
            return Err(Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(detail));
        }
        self.segment_mut(seg).alloc.reserve(loc.offset, size).map_err(|e| {
            Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(e.to_string())
        })?;
        self.attach_replica(id, seg, loc.offset);
        Ok(())
    }

    /// Forget a replica a node dropped by itself (demotion done, object-store copy deleted).
    /// No effect is produced: the reporter already acted. Returns whether the object is now
    /// gone (that was its last replica).
    pub fn remove_replica(&mut self, key: &str, location: &Location) -> Result<bool> {
        const OP: &str = "remove_replica";
        let id = self.find(key, OP)?;
        match location {
            Location::ObjectStore => self.set_persisted(id, false),
            Location::Node(loc) => {
                let seg = self.locate(loc, OP).map_err(|e| e.with_key(key))?;
                let rep = self.replica_at(id, seg, loc.offset).ok_or_else(|| {
                    Error::new(ErrorKind::NotFound, OP).with_key(key).with_detail("no such replica")
                })?;
                let size = self.objects[id].size;
                self.detach_replica(rep);
                self.free_range(seg, loc.offset, size);
            }
        }
        let gone = self.is_orphan(id);
        if gone {
            self.remove_object(id, None);
        }
        Ok(gone)
    }

    // ----- time ----------------------------------------------------------------------------

    /// Revoke pending puts past their deadline and release the ranges of replaced objects
    /// whose readers' lease has ended (their `Drop` effects go to `fx`). O(pending + retired).
    pub fn tick(&mut self, now_ms: u64, fx: &mut Vec<NodeEffect>) -> Tick {
        let mut tick = Tick::default();
        let expired: Vec<Arc<str>> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline_ms <= now_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            self.revoke_pending(&key, fx);
            tick.expired_puts += 1;
        }
        let (due, keep) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition::<Vec<_>, _>(|r| r.release_at_ms <= now_ms);
        self.retired = keep;
        for r in due {
            let seg = self.segment(r.seg);
            let (node, index) = (seg.node, seg.index);
            if let Some(key) = r.key {
                fx.push(NodeEffect::Drop {
                    node,
                    key,
                    segment: index,
                    offset: r.offset,
                    len: r.len,
                    version: r.version,
                    readers_until_ms: 0,
                });
            }
            self.free_range(r.seg, r.offset, r.len);
            tick.released_ranges += 1;
        }
        self.inherited.retain(|_, v| {
            v.retain(|g| g.deadline_ms > now_ms);
            !v.is_empty()
        });
        tick
    }

    // ----- internals: objects ----------------------------------------------------------------

    fn key_ok(&self, key: &str) -> bool {
        !key.is_empty() && key.len() <= self.cfg.key_len_max
    }

    fn check_key(&self, key: &str, op: &'static str) -> Result<()> {
        if !self.key_ok(key) {
            let detail = format!("length {} not in 1..={}", key.len(), self.cfg.key_len_max);
            return Err(Error::new(ErrorKind::InvalidKey, op).with_key(key).with_detail(detail));
        }
        Ok(())
    }

    fn check_put(&self, req: &PutStart) -> Result<()> {
        const OP: &str = "put_start";
        self.check_key(&req.key, OP)?;
        let invalid = |d: &str| Err(Error::new(ErrorKind::InvalidArgument, OP).with_detail(d));
        if req.size == 0 {
            return invalid("size 0");
        }
        if req.replicas == 0 {
            return invalid("replicas 0");
        }
        if req.tier == Tier::ObjectStore {
            return invalid("puts go to a node tier; object storage is reached by persistence");
        }
        if req.size > self.cfg.object_size_max || req.replicas > self.cfg.replicas_max {
            let detail = format!(
                "size {} (max {}), replicas {} (max {})",
                req.size, self.cfg.object_size_max, req.replicas, self.cfg.replicas_max
            );
            return Err(Error::new(ErrorKind::TooLarge, OP).with_detail(detail));
        }
        Ok(())
    }

    fn hash(&self, key: &[u8]) -> u64 {
        key_hash(&self.hasher, key)
    }

    fn lookup(&self, key: &str) -> Option<u32> {
        let key_of = key_reader(&self.objects, &self.keys);
        self.index.find(self.hash(key.as_bytes()), |&id| key_of(id) == key.as_bytes()).copied()
    }

    /// The stored key of a complete object.
    fn key(&self, id: u32) -> &[u8] {
        self.keys.get(self.objects[id].key_at())
    }

    /// The key of a complete object, as effects and answers carry it.
    fn key_arc(&self, id: u32) -> Arc<str> {
        Arc::from(key_str(self.key(id)))
    }

    /// The complete object of a valid key, or `InvalidKey` / `NotFound`.
    fn find(&self, key: &str, op: &'static str) -> Result<u32> {
        self.check_key(key, op)?;
        self.lookup(key).ok_or_else(|| Error::new(ErrorKind::NotFound, op).with_key(key))
    }

    /// Extends the read lease of `key` at `version` to at least `until_ms` (a short lease a
    /// job renews while a node reads the object's ranges); `false` when the object is gone or
    /// has another version. Not a use.
    pub fn hold(&mut self, key: &str, version: u64, until_ms: u64) -> bool {
        let Some(id) = self.lookup(key) else { return false };
        let o = &mut self.objects[id];
        if o.version != version {
            return false;
        }
        o.lease_end_ms = o.lease_end_ms.max(until_ms);
        true
    }

    fn lease(&mut self, id: u32, now_ms: u64) {
        let o = &mut self.objects[id];
        o.lease_end_ms = o.lease_end_ms.max(now_ms.saturating_add(self.cfg.lease_ttl_ms));
    }

    /// Move every replica of the object to the most-recently-used end of its segment list.
    fn touch(&mut self, id: u32) {
        let list = list_of(self.objects[id].flags().pin);
        let mut at = self.first_replica(id);
        while let Some(rep) = at {
            let (_, seg, _) = self.replica(rep);
            self.lru_to_back(seg, list, rep);
            at = self.next_replica(rep);
        }
    }

    /// Move a replica to the most-recently-used end of one of its segment's lists.
    fn lru_to_back(&mut self, seg: NonZeroU32, list: usize, rep: u32) {
        let lru = &mut self.segments[seg.get() as usize].as_mut().expect("live segment").lru[list];
        let links = &mut RepLinks { objects: &mut self.objects, reps: &mut self.reps };
        lru.unlink(links, rep);
        lru.push_back(links, rep);
    }

    fn view(&self, id: u32) -> ObjectView {
        let o = &self.objects[id];
        let mut replicas = Vec::with_capacity(2);
        for (_, seg, offset) in self.replicas(id) {
            replicas.push(self.replica_view(seg, offset, o.size));
        }
        if o.flags().persisted {
            replicas.push(Replica { location: Location::ObjectStore, len: o.size });
        }
        ObjectView {
            size: o.size,
            checksum: o.checksum(),
            version: o.version,
            replicas,
            persistence: o.flags().persistence,
            pin: o.flags().pin,
            lease_end_ms: o.lease_end_ms,
        }
    }

    fn replica_view(&self, seg: NonZeroU32, offset: u64, len: u64) -> Replica {
        let s = self.segment(seg);
        let loc = NodeLocation {
            node: s.node,
            segment: s.index,
            tier: s.tier,
            addr: s.base_addr + offset,
            offset,
        };
        Replica { location: Location::Node(loc), len }
    }

    fn commit_effect(&self, key: &Arc<str>, id: u32, seg: NonZeroU32, offset: u64) -> NodeEffect {
        let o = &self.objects[id];
        let s = self.segment(seg);
        NodeEffect::Commit {
            node: s.node,
            key: key.clone(),
            segment: s.index,
            offset,
            size: o.size,
            checksum: o.checksum(),
            version: o.version,
            persistence: o.flags().persistence,
            pin: o.flags().pin,
        }
    }

    /// Versions are `max(last + 1, now_ms << 20)`: monotonic within a master, and, with a
    /// wall-clock `now_ms`, higher after a restart than anything written before it, so that
    /// recovery's "higher version wins" picks the newest write.
    /// The highest version handed out so far, raised to the clock: every version handed out
    /// later is higher (an offload job's membership bound).
    pub fn version_bound(&mut self, now_ms: u64) -> u64 {
        self.last_version = self.last_version.max(now_ms.saturating_mul(1 << 20));
        self.last_version
    }

    fn next_version(&mut self, now_ms: u64) -> u64 {
        self.last_version = (self.last_version + 1).max(now_ms.saturating_mul(1 << 20));
        self.last_version
    }

    fn insert_object(&mut self, key: &str, mut obj: Obj) -> u32 {
        if obj.flags().persisted {
            self.count_persisted(obj.size, true);
        }
        obj.set_key_at(self.keys.push(key.as_bytes()));
        let id = self.objects.insert(obj);
        assert!(id < MORE, "object ids are 31 bits");
        self.index_key(id);
        self.settle_keys();
        id
    }

    /// Makes room in the index for `more` keys at once (a node re-registering a million
    /// objects with a new master would otherwise grow the table many times over).
    pub(super) fn reserve_index(&mut self, more: usize) {
        let key_of = key_reader(&self.objects, &self.keys);
        let hasher = &self.hasher;
        self.index.reserve(more, |&i| key_hash(hasher, key_of(i)));
    }

    /// Enter a stored object's key in the index and the ordered set.
    fn index_key(&mut self, id: u32) {
        let key_of = key_reader(&self.objects, &self.keys);
        let key = key_of(id);
        let hasher = &self.hasher;
        let hash = key_hash(hasher, key);
        self.index.insert_unique(hash, id, |&i| key_hash(hasher, key_of(i)));
        self.order.insert(id, key, key_of);
    }

    /// Take an object's key out of the index and the ordered set, and out of the arena.
    fn unindex_key(&mut self, id: u32) {
        let key_of = key_reader(&self.objects, &self.keys);
        let key = key_of(id);
        let hash = key_hash(&self.hasher, key);
        self.index.find_entry(hash, |&i| i == id).expect("indexed object").remove();
        self.order.remove(id, key, key_of);
        self.keys.remove(self.objects[id].key_at());
    }

    /// Compact the key arena's chunks that removals left more than half dead: their live keys
    /// move (owners found through the index, by position), dead ones are dropped.
    fn settle_keys(&mut self) {
        while let Some(chunk) = self.keys.next_compaction() {
            let (index, objects, hasher) = (&self.index, &self.objects, &self.hasher);
            let moved = self.keys.compact(chunk, |at, key| {
                index.find(key_hash(hasher, key), |&id| objects[id].key_at() == at).copied()
            });
            for (id, at) in moved {
                self.objects[id].set_key_at(at);
            }
        }
    }

    /// Remove an object and all its node replicas, freeing their ranges; with `fx`, a `Drop`
    /// effect per replica.
    fn remove_object(&mut self, id: u32, mut fx: Option<&mut Vec<NodeEffect>>) {
        let before = self.medium_before(id).flatten();
        let gone = before.map(|_| self.key_arc(id));
        let paused = self.events_pause();
        let size = self.objects[id].size;
        let key = (fx.is_some() && self.objects[id].has_replicas()).then(|| self.key_arc(id));
        while let Some(rep) = self.first_replica(id) {
            let (seg, offset) = self.detach_replica(rep);
            if let (Some(fx), Some(key)) = (fx.as_deref_mut(), &key) {
                fx.push(self.drop_effect_of(id, key, seg, offset));
            }
            self.free_range(seg, offset, size);
        }
        self.forget_object(id);
        self.events_restore(paused);
        if let Some(key) = gone {
            self.record_transition(&key, before, None);
        }
    }

    /// Drop an object's metadata; its replicas must already be detached.
    fn forget_object(&mut self, id: u32) {
        debug_assert!(!self.objects[id].has_replicas());
        let before = self.medium_before(id).flatten();
        if before.is_some() {
            let key = self.key_arc(id);
            self.record_transition(&key, before, None);
        }
        let unpersisted = self.objects[id].flags().persisted.then(|| self.key_arc(id));
        self.unindex_key(id);
        let obj = self.objects.remove(id);
        self.settle_keys();
        if let Some(key) = unpersisted {
            self.count_persisted(obj.size, false);
            self.note_unpersisted(key, obj.version);
        }
    }

    fn set_persisted(&mut self, id: u32, persisted: bool) {
        let before = self.medium_before(id);
        let o = &mut self.objects[id];
        if o.flags().persisted != persisted {
            o.set_flags(Flags { persisted, ..o.flags() });
            let size = o.size;
            self.count_persisted(size, persisted);
            self.medium_changed(id, before);
        }
    }

    fn count_persisted(&mut self, size: u64, add: bool) {
        let t = Tier::ObjectStore.index();
        if add {
            self.tier_replicas[t] += 1;
            self.tier_bytes[t] += size;
        } else {
            self.tier_replicas[t] -= 1;
            self.tier_bytes[t] -= size;
        }
    }

    /// Upsert completion: the old object's metadata goes now; its ranges are freed now, or,
    /// if readers hold a lease, when it ends (`tick`).
    fn replace_old(&mut self, old: u32, now_ms: u64, fx: &mut Vec<NodeEffect>) {
        let lease_end = self.objects[old].lease_end_ms;
        if lease_end <= now_ms {
            self.remove_object(old, Some(fx));
            return;
        }
        let before = self.medium_before(old).flatten();
        let gone = before.map(|_| self.key_arc(old));
        let paused = self.events_pause();
        let (size, version, key) =
            (self.objects[old].size, self.objects[old].version, self.key_arc(old));
        while let Some(rep) = self.first_replica(old) {
            let (seg, offset) = self.detach_replica(rep);
            // The name goes now: a node holding it in memory forgets it now (so no reader
            // reaches the old bytes through it); the range is freed when the lease ends (a
            // second, harmless drop).
            if matches!(self.segment(seg).tier, Tier::Dram | Tier::Hbm) {
                fx.push(self.drop_effect_of(old, &key, seg, offset));
            }
            self.retired.push(Retired {
                release_at_ms: lease_end,
                seg,
                offset,
                len: size,
                key: Some(key.clone()),
                version,
            });
        }
        self.forget_object(old);
        self.events_restore(paused);
        if let Some(key) = gone {
            self.record_transition(&key, before, None);
        }
    }

    fn is_orphan(&self, id: u32) -> bool {
        let o = &self.objects[id];
        !o.has_replicas() && !o.flags().persisted
    }

    // ----- internals: replicas and segments --------------------------------------------------

    fn segment(&self, seg: NonZeroU32) -> &Segment {
        self.segments[seg.get() as usize].as_ref().expect("live segment")
    }

    fn segment_mut(&mut self, seg: NonZeroU32) -> &mut Segment {
        self.segments[seg.get() as usize].as_mut().expect("live segment")
    }

    fn drop_effect(&self, key: &Arc<str>, at: DroppedCopy) -> NodeEffect {
        let s = self.segment(at.seg);
        let (node, segment) = (s.node, s.index);
        let DroppedCopy { offset, len, version, .. } = at;
        NodeEffect::Drop {
            node,
            key: key.clone(),
            segment,
            offset,
            len,
            version,
            readers_until_ms: 0,
        }
    }

    /// [`Directory::drop_effect`] for a replica of object `id`, carrying its read lease.
    fn drop_effect_of(&self, id: u32, key: &Arc<str>, seg: NonZeroU32, offset: u64) -> NodeEffect {
        let o = &self.objects[id];
        let at = DroppedCopy { seg, offset, len: o.size, version: o.version };
        let mut e = self.drop_effect(key, at);
        if let NodeEffect::Drop { readers_until_ms, .. } = &mut e {
            *readers_until_ms = o.lease_end_ms;
        }
        e
    }

    /// The object's newest node replica (see [`Obj`] for the order).
    fn first_replica(&self, id: u32) -> Option<u32> {
        let o = &self.objects[id];
        if o.more != NIL { Some(MORE | o.more) } else { o.rep_seg.map(|_| id) }
    }

    /// The replica after `rep` in its object's order.
    fn next_replica(&self, rep: u32) -> Option<u32> {
        if rep & MORE == 0 {
            return None;
        }
        let r = &self.reps[rep & !MORE];
        if r.obj_next != NIL {
            Some(MORE | r.obj_next)
        } else {
            self.objects[r.obj].rep_seg.map(|_| r.obj)
        }
    }

    /// The object's node replicas as `(replica, segment, offset)`, newest first.
    fn replicas(&self, id: u32) -> impl Iterator<Item = (u32, NonZeroU32, u64)> + '_ {
        std::iter::successors(self.first_replica(id), |&r| self.next_replica(r)).map(|r| {
            let (_, seg, offset) = self.replica(r);
            (r, seg, offset)
        })
    }

    /// A replica's object, segment and offset.
    fn replica(&self, rep: u32) -> (u32, NonZeroU32, u64) {
        if rep & MORE == 0 {
            let o = &self.objects[rep];
            (rep, o.rep_seg.expect("an inline replica"), o.rep_offset)
        } else {
            let r = &self.reps[rep & !MORE];
            (r.obj, r.seg, r.offset())
        }
    }

    fn attach_replica(&mut self, id: u32, seg: NonZeroU32, offset: u64) {
        let before = self.medium_before(id);
        let o = &mut self.objects[id];
        let (size, list) = (o.size, list_of(o.flags().pin));
        let rep = if o.has_replicas() {
            let more = o.more;
            let (lo, hi) = (offset as u32, (offset >> 32) as u32);
            let rep = Rep { obj: id, seg, offset: [lo, hi], prev: NIL, next: NIL, obj_next: more };
            let i = self.reps.insert(rep);
            assert!(i < MORE - 1, "replica ids are 31 bits");
            self.objects[id].more = i;
            MORE | i
        } else {
            (o.rep_seg, o.rep_offset) = (Some(seg), offset);
            id
        };
        let s = self.segments[seg.get() as usize].as_mut().expect("live segment");
        let links = &mut RepLinks { objects: &mut self.objects, reps: &mut self.reps };
        s.lru[list].push_back(links, rep);
        let tier = s.tier;
        self.tier_replicas[tier.index()] += 1;
        self.tier_bytes[tier.index()] += size;
        self.tenant_replica(id, tier, size, true);
        self.medium_changed(id, before);
    }

    /// Unlink a replica from its object and its segment list; the range stays allocated.
    fn detach_replica(&mut self, rep: u32) -> (NonZeroU32, u64) {
        let id = self.replica(rep).0;
        let before = self.medium_before(id);
        let at = self.detach_replica_quiet(rep);
        self.medium_changed(id, before);
        at
    }

    fn detach_replica_quiet(&mut self, rep: u32) -> (NonZeroU32, u64) {
        let (id, seg, offset) = self.replica(rep);
        let o = &self.objects[id];
        let (size, list) = (o.size, list_of(o.flags().pin));
        let s = self.segments[seg.get() as usize].as_mut().expect("live segment");
        let links = &mut RepLinks { objects: &mut self.objects, reps: &mut self.reps };
        s.lru[list].unlink(links, rep);
        let tier = s.tier;
        self.tier_replicas[tier.index()] -= 1;
        self.tier_bytes[tier.index()] -= size;
        self.tenant_replica(id, tier, size, false);
        if rep & MORE == 0 {
            self.objects[id].rep_seg = None;
            return (seg, offset);
        }
        let i = rep & !MORE;
        let obj_next = self.reps[i].obj_next;
        if self.objects[id].more == i {
            self.objects[id].more = obj_next;
        } else {
            let mut at = self.objects[id].more;
            while self.reps[at].obj_next != i {
                at = self.reps[at].obj_next;
            }
            self.reps[at].obj_next = obj_next;
        }
        self.reps.remove(i);
        (seg, offset)
    }

    fn free_range(&mut self, seg: NonZeroU32, offset: u64, len: u64) {
        let r = self.segment_mut(seg).alloc.free(offset, len);
        debug_assert!(r.is_ok(), "free of {offset}+{len} in segment {seg}: {r:?}");
    }

    fn free_ranges(&mut self, ranges: &[(NonZeroU32, u64)], len: u64) {
        for &(seg, offset) in ranges {
            self.free_range(seg, offset, len);
        }
    }

    /// Abandons a pending put: its ranges are freed, and each node gets a drop of them (a
    /// writer may have committed its replica there itself with a noted write before the
    /// `PutEnd` that will never complete it; a node that holds nothing of it ignores it).
    fn revoke_pending(&mut self, key: &str, fx: &mut Vec<NodeEffect>) -> bool {
        let Some((key, p)) = self.pending.remove_entry(key) else { return false };
        self.tenant_pending(&key, p.tier, p.size * p.ranges.len() as u64, false);
        self.abandon_ranges(&key, &p, fx);
        true
    }

    fn abandon_ranges(&mut self, key: &Arc<str>, p: &Pending, fx: &mut Vec<NodeEffect>) {
        for &(seg, offset) in &p.ranges {
            let s = self.segment(seg);
            fx.push(NodeEffect::Drop {
                node: s.node,
                key: key.clone(),
                segment: s.index,
                offset,
                len: p.size,
                version: p.version,
                readers_until_ms: 0,
            });
        }
        self.free_ranges(&p.ranges, p.size);
    }

    /// The object's replica on `node` in `tier`, if any.
    fn replica_on(&self, id: u32, node: NodeId, tier: Tier) -> Option<u32> {
        self.replicas(id).find_map(|(rep, seg, _)| {
            let s = self.segment(seg);
            (s.node == node && s.tier == tier).then_some(rep)
        })
    }

    fn replica_at(&self, id: u32, seg: NonZeroU32, offset: u64) -> Option<u32> {
        self.replicas(id).find_map(|(rep, s, o)| (s == seg && o == offset).then_some(rep))
    }

    /// The segment id a node location names, checking the node, the segment and the tier.
    fn locate(&self, loc: &NodeLocation, op: &'static str) -> Result<NonZeroU32> {
        let node = self.nodes.get(&loc.node).ok_or_else(|| {
            Error::new(ErrorKind::NodeUnknown, op).with_detail(format!("node {}", loc.node.0))
        })?;
        let seg = node.segs.iter().copied().find(|&s| self.segment(s).index == loc.segment);
        let seg = seg.ok_or_else(|| {
            let detail = format!("node {} has no segment {}", loc.node.0, loc.segment);
            Error::new(ErrorKind::InvalidArgument, op).with_detail(detail)
        })?;
        if self.segment(seg).tier != loc.tier {
            let detail = format!("segment {} is not {:?}", loc.segment, loc.tier);
            return Err(Error::new(ErrorKind::InvalidArgument, op).with_detail(detail));
        }
        Ok(seg)
    }
}
