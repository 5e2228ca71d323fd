//! Tiers in the directory: loads (copies into DRAM for readers), replica reports from the
//! nodes' tier managers, objects adopted from the object store, and the facts the RPC layer
//! needs about pending puts for eager persistence.
//!
//! Mechanism:
//! - A *load* puts a DRAM copy of an object that has none (only NVMe or object-store copies),
//!   because readers move bytes with the Transfer Engine, which reads memory segments only.
//!   [`Directory::begin_load`] picks the source (an NVMe copy first: the node that holds it
//!   copies it locally; else the object store, onto any node by placement) and allocates the
//!   destination range, making room by evicting that segment's LRU replicas if needed. The
//!   range is tracked in `loading` (so it is neither reused nor lost) until
//!   [`Directory::end_load`] attaches it as a replica or frees it.
//! - Reports: [`Directory::report_replica`] applies a node's "add this copy, then drop that
//!   one" (a demotion, a write-back, an NVMe drop), refusing to drop a memory copy under a live
//!   read lease (a reader may be moving its bytes) or the last copy of an object. When both
//!   are given the dropped copy is the source of the added one, and it must still be a
//!   replica: a copy made from a range the master dropped (and may have reused) is refused.
//! - [`Directory::adopt_persisted`] takes an object found in the object store after a restart,
//!   with only its object-store replica; the higher version wins against what nodes reported.
//! - A persisted object that is removed or replaced (upsert, a newer copy adopted) leaves its
//!   key and version in a list the RPC layer drains ([`Directory::take_unpersisted`]) to delete
//!   that version from the object store; otherwise a restart would bring it back. The list is
//!   bounded (`UNPERSISTED_MAX`; past it, entries are dropped and counted).
//!
//! Invariants: a key has at most one load in flight; a loading range is allocated in its
//! segment and in no replica, and it disappears with its segment when the node goes away;
//! `verify` counts loading ranges as allocated.
//!
//! - A *move* ([`Directory::begin_move`]) is a load whose source is the node's copy in its
//!   other memory tier: a node's tier manager moving an object from HBM down to DRAM (GPU memory
//!   above its watermark) or back up. The destination range is allocated on the same node and
//!   tracked in `loading` like any load; [`Directory::end_load`] then also requires the source
//!   copy to be a replica still (a copy read from a range the master dropped, and may have
//!   reused, is never attached), and the node releases the source with a report.
//!
//! Not handled: loading into another node than the NVMe copy's (bytes would have to cross
//! nodes twice); moves between nodes.

use std::num::NonZeroU32;
use std::sync::Arc;

use super::evict::{Budget, Goal};
use super::{Directory, DroppedCopy, Flags, Obj};
use crate::error::{Error, ErrorKind, Result};
use crate::types::*;

/// A DRAM range being filled by a load.
#[derive(Debug, Clone)]
pub(super) struct Loading {
    pub(super) seg: NonZeroU32,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) version: u64,
    /// A move's source: the node's copy in its other memory tier, which must still be a
    /// replica when the load ends.
    pub(super) source: Option<Location>,
}

/// A planned load: the node fills `[offset, offset + size)` of its DRAM segment `segment` with
/// the object from `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    pub key: Arc<str>,
    pub node: NodeId,
    pub segment: u32,
    pub offset: u64,
    pub addr: u64,
    pub size: u64,
    pub version: u64,
    pub checksum: Option<[u8; 32]>,
    pub persistence: Persistence,
    pub pin: Pin,
    /// `Location::Node` of the NVMe copy, or `Location::ObjectStore`; for a move, the node's
    /// copy in its other memory tier.
    pub source: Location,
}

/// A pending put, as eager persistence needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingView {
    pub version: u64,
    pub size: u64,
    pub persistence: Persistence,
    pub pin: Pin,
    pub ranges: Vec<NodeLocation>,
}

/// An object found in the object store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistedObject {
    pub key: String,
    pub size: u64,
    pub checksum: [u8; 32],
    pub version: u64,
    pub persistence: Persistence,
    pub pin: Pin,
    /// The name and version it had before a rename (from its header), if any.
    pub renamed_from: Option<(String, u64)>,
}

/// What a replica report did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReportOutcome {
    pub added: bool,
    pub removed: bool,
    /// A refused remove: milliseconds until the read lease ends, or `LAST_COPY_RETRY_MS` for
    /// a last copy.
    pub retry_after_ms: u64,
}

/// How long a node should wait before asking again to drop an object's last copy.
pub const LAST_COPY_RETRY_MS: u64 = 60_000;

/// Removed persisted objects waiting for their object-store copy to be deleted, at most.
pub const UNPERSISTED_MAX: usize = 1 << 20;

impl Directory {
    /// Plan a DRAM copy of `key` if it has no memory replica (`None` when it has one). `Drop`
    /// effects of make-room eviction go to `fx`. `PutInProgress` while another load of the key
    /// runs; `NoSpace` when no DRAM range can be had.
    pub fn begin_load(
        &mut self,
        key: &str,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<Option<LoadPlan>> {
        self.begin_load_from(key, false, now_ms, fx)
    }

    /// [`begin_load`](Self::begin_load), skipping NVMe copies when `object_store_only` (their
    /// node did not answer): `NoSpace` / `NotFound`-like refusals as there, and
    /// `InvalidArgument` when the object is not persisted.
    pub fn begin_load_from(
        &mut self,
        key: &str,
        object_store_only: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<Option<LoadPlan>> {
        const OP: &str = "load";
        let id = self.find(key, OP)?;
        if self.loading.contains_key(key) {
            return Err(Error::new(ErrorKind::PutInProgress, OP)
                .with_key(key)
                .with_detail("another load of the key is in flight"));
        }
        let view = self.view(id);
        if view.replicas.iter().any(|r| matches!(r.tier(), Tier::Dram | Tier::Hbm)) {
            return Ok(None);
        }
        let size = view.size;
        let nvme =
            view.replicas.iter().find(|r| r.tier() == Tier::Nvme && !object_store_only).copied();
        if object_store_only && !self.objects[id].flags().persisted {
            return Err(Error::new(ErrorKind::InvalidArgument, OP)
                .with_key(key)
                .with_detail("not in the object store"));
        }
        let mut placed = None;
        if let Some(r) = &nvme {
            let node = r.node().expect("an NVMe replica is on a node");
            placed = self.alloc_dram_on(node, size, now_ms, fx).map(|p| (p, r.location));
        }
        if placed.is_none() && self.objects[id].flags().persisted {
            let mut req = PutStart::new(key, size);
            req.strategy = Strategy::FreeRatioFirst;
            let mut evicted = Vec::new();
            placed = self
                .place(&req, now_ms, fx, &mut evicted)
                .first()
                .map(|&(seg, off)| ((seg, off), Location::ObjectStore));
        }
        let Some(((seg, offset), source)) = placed else {
            let detail = match nvme {
                Some(_) => "no DRAM range on the node holding the NVMe copy",
                None => "no DRAM range for a copy from the object store",
            };
            return Err(Error::new(ErrorKind::NoSpace, OP).with_key(key).with_detail(detail));
        };
        // Eviction may have dropped objects, never this one: it has no memory replica.
        let id = self.lookup(key).expect("the loaded object is still there");
        let version = self.objects[id].version;
        let key = self.key_arc(id);
        self.loading.insert(key.clone(), Loading { seg, offset, size, version, source: None });
        Ok(Some(self.load_plan(key, seg, offset, source)))
    }

    fn load_plan(&self, key: Arc<str>, seg: NonZeroU32, offset: u64, source: Location) -> LoadPlan {
        let id = self.lookup(&key).expect("a planned object exists");
        let o = &self.objects[id];
        let (version, checksum, persistence, pin) =
            (o.version, o.checksum(), o.flags().persistence, o.flags().pin);
        let s = self.segment(seg);
        LoadPlan {
            key,
            node: s.node,
            segment: s.index,
            offset,
            addr: s.base_addr + offset,
            size: o.size,
            version,
            checksum,
            persistence,
            pin,
            source,
        }
    }

    /// Plan a move of `key` at `version` on `node` from its copy in memory tier `from` into a
    /// new range of its segment of memory tier `to` (HBM -> DRAM or DRAM -> HBM), making room
    /// there by evicting that segment's LRU replicas if needed. `None` when the node already
    /// holds a `to` copy. Errors: `Conflict` for another version, `NotFound` when the node
    /// holds no `from` copy, `InvalidArgument` for tiers that are not two different memory
    /// tiers, `PutInProgress` while a load of the key runs, `NoSpace` when the node has no
    /// `to` segment or no range in it.
    pub fn begin_move(
        &mut self,
        key: &str,
        version: u64,
        node: NodeId,
        (from, to): (Tier, Tier),
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<Option<LoadPlan>> {
        const OP: &str = "move";
        let memory = |t: Tier| matches!(t, Tier::Dram | Tier::Hbm);
        if !memory(from) || !memory(to) || from == to {
            let detail = format!("a move goes between DRAM and HBM, not {from:?} -> {to:?}");
            return Err(Error::new(ErrorKind::InvalidArgument, OP)
                .with_key(key)
                .with_detail(detail));
        }
        let id = self.find(key, OP)?;
        if self.objects[id].version != version {
            let detail =
                format!("the object is at version {}, not {version}", self.objects[id].version);
            return Err(Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(detail));
        }
        if self.loading.contains_key(key) {
            return Err(Error::new(ErrorKind::PutInProgress, OP)
                .with_key(key)
                .with_detail("another load of the key is in flight"));
        }
        if self.replica_on(id, node, to).is_some() {
            return Ok(None);
        }
        let view = self.view(id);
        let Some(src) =
            view.replicas.iter().find(|r| r.node() == Some(node) && r.tier() == from).copied()
        else {
            let detail = format!("node {} holds no {from:?} copy", node.0);
            return Err(Error::new(ErrorKind::NotFound, OP).with_key(key).with_detail(detail));
        };
        let Some((seg, offset)) = self.alloc_on(node, to, view.size, now_ms, fx) else {
            let detail = format!("no {to:?} range on node {}", node.0);
            return Err(Error::new(ErrorKind::NoSpace, OP).with_key(key).with_detail(detail));
        };
        // Eviction in the `to` segment never drops this object: it has no replica there.
        let id = self.lookup(key).expect("the moved object is still there");
        let key = self.key_arc(id);
        let source = Some(src.location);
        let loading = Loading { seg, offset, size: view.size, version, source };
        self.loading.insert(key.clone(), loading);
        Ok(Some(self.load_plan(key, seg, offset, src.location)))
    }

    /// A range of `size` bytes in one of `node`'s DRAM segments, evicting that segment's LRU
    /// replicas (one bounded round) when no hole is big enough.
    fn alloc_dram_on(
        &mut self,
        node: NodeId,
        size: u64,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Option<(NonZeroU32, u64)> {
        self.alloc_on(node, Tier::Dram, size, now_ms, fx)
    }

    /// [`alloc_dram_on`](Self::alloc_dram_on) in `node`'s segments of `tier`.
    fn alloc_on(
        &mut self,
        node: NodeId,
        tier: Tier,
        size: u64,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Option<(NonZeroU32, u64)> {
        let segs: Vec<NonZeroU32> = self.nodes.get(&node)?.segs.clone();
        let dram: Vec<NonZeroU32> =
            segs.into_iter().filter(|&s| self.segment(s).tier == tier).collect();
        for &seg in &dram {
            if let Some(off) = self.segment_mut(seg).alloc.alloc(size) {
                return Some((seg, off));
            }
        }
        let need = self.segment_footprint(size);
        for &seg in &dram {
            let mut budget = Budget::new(&self.cfg);
            let mut out = Eviction::default();
            self.shed_segment(
                seg,
                Goal::LargestFreeAtLeast(need),
                now_ms,
                &mut budget,
                fx,
                &mut out,
            );
            if let Some(off) = self.segment_mut(seg).alloc.alloc(size) {
                return Some((seg, off));
            }
        }
        None
    }

    /// Finish a load. With `filled` (the blake3 the node computed), the range becomes a
    /// replica of the object, leased like a get, if the object is still the version loaded
    /// (and, for a move, its source copy is still a replica); otherwise the range is freed (with a `Drop` effect when the node filled it). Returns
    /// whether the replica was attached.
    pub fn end_load(
        &mut self,
        plan: &LoadPlan,
        filled: Option<[u8; 32]>,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> bool {
        let Some(l) = self.loading.get(&*plan.key) else { return false };
        if l.version != plan.version || l.offset != plan.offset {
            return false;
        }
        let l = self.loading.remove(&*plan.key).expect("looked up above");
        let Some(sum) = filled else {
            self.free_range(l.seg, l.offset, l.size);
            return false;
        };
        let (node, tier) = (self.segment(l.seg).node, self.segment(l.seg).tier);
        let id = self.lookup(&plan.key).filter(|&id| {
            self.objects[id].version == l.version
                && self.replica_on(id, node, tier).is_none()
                && l.source.is_none_or(|src| self.has_replica(id, &src))
        });
        let Some(id) = id else {
            let at = DroppedCopy { seg: l.seg, offset: l.offset, len: l.size, version: l.version };
            fx.push(self.drop_effect(&plan.key, at));
            self.free_range(l.seg, l.offset, l.size);
            return false;
        };
        self.attach_replica(id, l.seg, l.offset);
        if l.source.is_none() {
            // A reader waits for this copy. A move has none: a lease would only hold off the
            // release of its source copy, and a demoted object is not recently used.
            self.lease(id, now_ms);
            self.touch(id);
        }
        self.record_checksum(id, sum);
        true
    }

    /// Whether a load of `key` is in flight.
    pub fn is_loading(&self, key: &str) -> bool {
        self.loading.contains_key(key)
    }

    /// A node's change to its copies of `key`, at `version`: `add` first, then `remove` (see
    /// the module notes for when a remove is refused). `NotFound` when the object is gone,
    /// `Conflict` when it has another version or the added range is taken.
    pub fn report_replica(
        &mut self,
        key: &str,
        version: u64,
        checksum: Option<[u8; 32]>,
        add: Option<&Location>,
        remove: Option<&Location>,
        now_ms: u64,
    ) -> Result<ReportOutcome> {
        const OP: &str = "report_replica";
        let id = self.find(key, OP)?;
        if self.objects[id].version != version {
            let detail =
                format!("the object is at version {}, not {version}", self.objects[id].version);
            return Err(Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(detail));
        }
        if let (Some(_), Some(src)) = (add, remove)
            && !self.has_replica(id, src)
        {
            // The copy was made from a replica the master has since dropped (and may have
            // reused): its bytes cannot be trusted.
            return Err(Error::new(ErrorKind::Conflict, OP)
                .with_key(key)
                .with_detail("the source copy is no longer a replica"));
        }
        if let Some(sum) = checksum {
            self.record_checksum(id, sum);
        }
        let mut out = ReportOutcome::default();
        if let Some(loc) = add {
            if !self.has_replica(id, loc) {
                if let Location::Node(n) = loc {
                    self.check_tenant_copy(key, n.tier, self.objects[id].size)?;
                }
                self.add_replica(key, loc)?;
            }
            out.added = true;
        }
        if let Some(loc) = remove {
            let id = self.lookup(key).expect("still there");
            let memory =
                matches!(loc, Location::Node(n) if matches!(n.tier, Tier::Dram | Tier::Hbm));
            let leased = self.objects[id].lease_end_ms > now_ms;
            let copies = self.view(id).replicas.len();
            if !self.has_replica(id, loc) {
                out.removed = true;
            } else if copies <= 1 {
                out.retry_after_ms = LAST_COPY_RETRY_MS;
            } else if memory && leased {
                out.retry_after_ms = self.objects[id].lease_end_ms - now_ms;
            } else {
                self.remove_replica(key, loc)?;
                out.removed = true;
            }
        }
        Ok(out)
    }

    /// Drop every pool copy (DRAM, HBM, NVMe) of a persisted object at `version`, leaving its
    /// object-store replica (an offload job's `--move`); `Drop` effects go to `fx`. Returns the
    /// copies dropped. `NotFound` when the object is gone, `Conflict` when it has another
    /// version or is not in the object store, `Leased` while a read lease is live (a reader may
    /// be moving the bytes), `Pinned` when hard-pinned.
    pub fn release_to_object_store(
        &mut self,
        key: &str,
        version: u64,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<usize> {
        const OP: &str = "release_to_object_store";
        let id = self.find(key, OP)?;
        let o = &self.objects[id];
        if o.version != version {
            let detail = format!("the object is at version {}, not {version}", o.version);
            return Err(Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(detail));
        }
        if !o.flags().persisted {
            let detail = "the object is not in the object store";
            return Err(Error::new(ErrorKind::Conflict, OP).with_key(key).with_detail(detail));
        }
        self.removable(id, now_ms).map_err(|kind| Error::new(kind, OP).with_key(key))?;
        let reps: Vec<(u32, NonZeroU32, u64)> = self.replicas(id).collect();
        let key = self.key_arc(id);
        for &(rep, seg, offset) in &reps {
            fx.push(self.drop_effect_of(id, &key, seg, offset));
            self.detach_replica(rep);
            self.free_range(seg, offset, self.objects[id].size);
        }
        Ok(reps.len())
    }

    fn has_replica(&self, id: u32, loc: &Location) -> bool {
        match loc {
            Location::ObjectStore => self.objects[id].flags().persisted,
            Location::Node(n) => self.replicas(id).any(|(_, seg, offset)| {
                let s = self.segment(seg);
                s.node == n.node && s.index == n.segment && offset == n.offset
            }),
        }
    }

    /// Record the checksum of an object that has none (a node computed it when the object
    /// crossed into NVMe or the object store).
    fn record_checksum(&mut self, id: u32, sum: [u8; 32]) {
        let o = &mut self.objects[id];
        if !o.flags().has_checksum {
            o.set_flags(Flags { has_checksum: true, ..o.flags() });
            o.checksum = sum;
        }
    }

    /// Adopt an object found in the object store (after a restart) with its object-store
    /// replica. Against a complete object of the same key: the same version gains the
    /// object-store replica; a higher version replaces it (`Drop` effects go to `fx`); a lower
    /// one is ignored. Returns whether anything changed.
    pub fn adopt_persisted(
        &mut self,
        p: &PersistedObject,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<bool> {
        const OP: &str = "adopt_persisted";
        self.check_key(&p.key, OP)?;
        if p.size == 0 || p.size > self.cfg.object_size_max {
            let detail = format!("size {} (max {})", p.size, self.cfg.object_size_max);
            return Err(Error::new(ErrorKind::InvalidArgument, OP)
                .with_key(&p.key)
                .with_detail(detail));
        }
        if self.was_renamed_away(&p.key, p.version) {
            // A copy a rename left behind: it must go from the object store too.
            self.note_unpersisted(Arc::from(p.key.as_str()), p.version);
            return Ok(false);
        }
        self.settle_renamed_from(p.renamed_from.as_ref(), fx);
        if let Some(id) = self.lookup(&p.key) {
            let v = self.objects[id].version;
            if v == p.version {
                let changed = !self.objects[id].flags().persisted;
                self.set_persisted(id, true);
                return Ok(changed);
            }
            if v > p.version || self.loading.contains_key(p.key.as_str()) {
                return Ok(false);
            }
            self.remove_object(id, Some(fx));
        }
        let flags =
            Flags { has_checksum: true, persisted: true, pin: p.pin, persistence: p.persistence };
        let paused = self.events_pause();
        let id = self.insert_object(&p.key, Obj::new(p.size, p.version, Some(p.checksum), flags));
        self.events_resume(paused, id, None);
        self.last_version = self.last_version.max(p.version);
        Ok(true)
    }

    /// Keys and versions of persisted objects removed or replaced since the last call: their
    /// object-store copies (of exactly that version) must be deleted.
    pub fn take_unpersisted(&mut self) -> Vec<(Arc<str>, u64)> {
        std::mem::take(&mut self.unpersisted)
    }

    /// Object-store deletions dropped because the list was full.
    pub fn unpersisted_dropped(&self) -> u64 {
        self.counters.unpersisted_dropped
    }

    pub(super) fn note_unpersisted(&mut self, key: Arc<str>, version: u64) {
        if self.unpersisted.len() < UNPERSISTED_MAX {
            self.unpersisted.push((key, version));
        } else {
            self.counters.unpersisted_dropped += 1;
        }
    }

    /// A pending put's version, persistence and ranges (for eager persistence at its end).
    pub fn pending_view(&self, key: &str) -> Option<PendingView> {
        let p = self.pending.get(key)?;
        let ranges = p
            .ranges
            .iter()
            .map(|&(seg, offset)| {
                let s = self.segment(seg);
                NodeLocation {
                    node: s.node,
                    segment: s.index,
                    tier: s.tier,
                    addr: s.base_addr + offset,
                    offset,
                }
            })
            .collect();
        Some(PendingView {
            version: p.version,
            size: p.size,
            persistence: p.persistence,
            pin: p.pin,
            ranges,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    const MIB: u64 = 1 << 20;

    /// Nodes 1 and 2, each with DRAM (segment 0, `dram` bytes) and NVMe (segment 1).
    fn cluster(dram: u64) -> Directory {
        let mut d = Directory::new(Config { seed: 3, ..Config::default() }).unwrap();
        for n in 1..=2u64 {
            let r = NodeRegistration {
                node: NodeId(n),
                host: format!("host{n}"),
                endpoint: format!("10.0.0.{n}:7000"),
                segments: vec![
                    SegmentSpec { index: 0, tier: Tier::Dram, base_addr: 1 << 30, capacity: dram },
                    SegmentSpec { index: 1, tier: Tier::Nvme, base_addr: 0, capacity: 64 * MIB },
                ],
                held: Vec::new(),
            };
            d.register_node(&r, 0, &mut Vec::new()).unwrap();
        }
        d
    }

    fn put(d: &mut Directory, key: &str, persistence: Persistence, now: u64) -> NodeLocation {
        let mut fx = Vec::new();
        let mut req = PutStart::new(key, MIB);
        req.persistence = persistence;
        let g = d.put_start(&req, now, &mut fx).unwrap();
        d.put_end(&PutEnd::new(key, None), now, &mut fx).unwrap();
        match g.replicas[0].location {
            Location::Node(n) => n,
            Location::ObjectStore => unreachable!(),
        }
    }

    fn nvme_at(node: NodeId, offset: u64) -> Location {
        Location::Node(NodeLocation { node, segment: 1, tier: Tier::Nvme, addr: 0, offset })
    }

    fn tiers_of(d: &Directory, key: &str) -> Vec<Tier> {
        let mut t: Vec<Tier> = d.stat(key).unwrap().replicas.iter().map(|r| r.tier()).collect();
        t.sort();
        t
    }

    /// Demote (report add NVMe + remove DRAM), then a load brings a DRAM copy back on the
    /// node that holds the NVMe copy; invariants hold at every step.
    #[test]
    fn demotion_then_load_round_trip() {
        let mut d = cluster(8 * MIB);
        let dram = put(&mut d, "k", Persistence::None, 0);
        let o = d
            .report_replica(
                "k",
                d.stat("k").unwrap().version,
                Some([9; 32]),
                Some(&nvme_at(dram.node, 0)),
                Some(&Location::Node(dram)),
                1,
            )
            .unwrap();
        assert_eq!(o, ReportOutcome { added: true, removed: true, retry_after_ms: 0 });
        assert_eq!(tiers_of(&d, "k"), [Tier::Nvme]);
        assert_eq!(d.stat("k").unwrap().checksum, Some([9; 32]), "the node's checksum is kept");
        d.verify().unwrap();
        let mut fx = Vec::new();
        let plan = d.begin_load("k", 2, &mut fx).unwrap().expect("a load is needed");
        assert_eq!(plan.node, dram.node, "loaded where the NVMe copy is");
        assert_eq!(plan.source, nvme_at(dram.node, 0));
        assert_eq!(kind(d.begin_load("k", 2, &mut fx)), ErrorKind::PutInProgress);
        d.verify().unwrap();
        assert!(d.end_load(&plan, Some([9; 32]), 3, &mut fx));
        assert_eq!(tiers_of(&d, "k"), [Tier::Dram, Tier::Nvme]);
        assert!(d.stat("k").unwrap().lease_end_ms > 3, "the loaded copy is leased");
        assert!(d.begin_load("k", 4, &mut fx).unwrap().is_none(), "a memory replica exists");
        d.verify().unwrap();
        let e = d.begin_load_from("k", true, 5, &mut fx);
        assert!(matches!(e, Ok(None)), "a memory replica exists: {e:?}");
    }

    fn kind<T: std::fmt::Debug>(r: Result<T>) -> ErrorKind {
        r.expect_err("expected an error").kind()
    }

    #[test]
    fn a_failed_or_stale_load_frees_its_range() {
        let mut d = cluster(8 * MIB);
        let dram = put(&mut d, "k", Persistence::Eager, 0);
        let v = d.stat("k").unwrap().version;
        d.report_replica("k", v, None, None, Some(&Location::Node(dram)), 1).unwrap();
        assert_eq!(tiers_of(&d, "k"), [Tier::ObjectStore]);
        let used = d.stats().tiers[Tier::Dram.index()].used_bytes;
        let mut fx = Vec::new();
        let plan = d.begin_load_from("k", true, 2, &mut fx).unwrap().unwrap();
        assert_eq!(plan.source, Location::ObjectStore);
        assert!(!d.end_load(&plan, None, 3, &mut fx));
        assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, used);
        // A load that finishes after the object was replaced is undone on the node too.
        let plan = d.begin_load("k", 4, &mut fx).unwrap().unwrap();
        d.remove("k", true, 5, &mut fx).unwrap();
        fx.clear();
        assert!(!d.end_load(&plan, Some([1; 32]), 6, &mut fx));
        assert!(matches!(&fx[..], [NodeEffect::Drop { offset, .. }] if *offset == plan.offset));
        assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, used);
        d.verify().unwrap();
    }

    #[test]
    fn loads_vanish_with_their_node() {
        let mut d = cluster(8 * MIB);
        put(&mut d, "k", Persistence::Eager, 0);
        let v = d.stat("k").unwrap().version;
        let at = d.stat("k").unwrap().replicas[0].location;
        d.report_replica("k", v, None, None, Some(&at), 1).unwrap();
        let mut fx = Vec::new();
        let plan = d.begin_load("k", 2, &mut fx).unwrap().unwrap();
        d.unregister_node(plan.node).unwrap();
        d.verify().unwrap();
        assert!(!d.end_load(&plan, Some([1; 32]), 3, &mut fx), "the range went with the node");
        assert_eq!(tiers_of(&d, "k"), [Tier::ObjectStore]);
        d.verify().unwrap();
    }

    #[test]
    fn reports_keep_leased_and_last_copies_and_refuse_gone_sources() {
        let mut d = cluster(8 * MIB);
        let dram = put(&mut d, "k", Persistence::None, 0);
        let v = d.stat("k").unwrap().version;
        let lease_end = d.get("k", 100).unwrap().lease_end_ms;
        let o = d
            .report_replica(
                "k",
                v,
                None,
                Some(&nvme_at(dram.node, 0)),
                Some(&Location::Node(dram)),
                200,
            )
            .unwrap();
        assert_eq!(
            o,
            ReportOutcome { added: true, removed: false, retry_after_ms: lease_end - 200 }
        );
        // The same report again is idempotent for the add.
        let o = d.report_replica("k", v, None, Some(&nvme_at(dram.node, 0)), None, 200).unwrap();
        assert!(o.added);
        // Dropping the NVMe copy now leaves the DRAM one; dropping that too is refused.
        let o = d.report_replica("k", v, None, None, Some(&nvme_at(dram.node, 0)), 200).unwrap();
        assert!(o.removed);
        let o = d
            .report_replica("k", v, None, None, Some(&Location::Node(dram)), lease_end + 1)
            .unwrap();
        assert_eq!(
            o,
            ReportOutcome { added: false, removed: false, retry_after_ms: LAST_COPY_RETRY_MS }
        );
        assert_eq!(kind(d.report_replica("k", v + 1, None, None, None, 0)), ErrorKind::Conflict);
        // A copy made from a range the master no longer counts is refused.
        let mut fx = Vec::new();
        d.remove("k", true, lease_end + 2, &mut fx).unwrap();
        let dram = put(&mut d, "k2", Persistence::Eager, lease_end + 3);
        let v = d.stat("k2").unwrap().version;
        d.report_replica("k2", v, None, None, Some(&Location::Node(dram)), lease_end + 4).unwrap();
        let e = d.report_replica(
            "k2",
            v,
            None,
            Some(&nvme_at(dram.node, 0)),
            Some(&Location::Node(dram)),
            lease_end + 5,
        );
        assert_eq!(kind(e), ErrorKind::Conflict);
        assert_eq!(tiers_of(&d, "k2"), [Tier::ObjectStore]);
        d.verify().unwrap();
    }

    #[test]
    fn adoption_from_the_object_store_follows_versions() {
        let mut d = cluster(8 * MIB);
        let p = |key: &str, version| PersistedObject {
            key: key.into(),
            size: MIB,
            checksum: [5; 32],
            version,
            persistence: Persistence::Lazy,
            pin: Pin::Soft,
            renamed_from: None,
        };
        let mut fx = Vec::new();
        assert!(d.adopt_persisted(&p("a", 10), &mut fx).unwrap());
        assert!(!d.adopt_persisted(&p("a", 10), &mut fx).unwrap(), "idempotent");
        assert_eq!(tiers_of(&d, "a"), [Tier::ObjectStore]);
        assert_eq!(d.stat("a").unwrap().pin, Pin::Soft);
        put(&mut d, "b", Persistence::None, 0);
        let vb = d.stat("b").unwrap().version;
        assert!(!d.adopt_persisted(&p("b", vb - 1), &mut fx).unwrap(), "an older copy loses");
        assert!(
            d.adopt_persisted(&p("b", vb), &mut fx).unwrap(),
            "the same version gains a replica"
        );
        assert_eq!(tiers_of(&d, "b"), [Tier::Dram, Tier::ObjectStore]);
        assert!(d.adopt_persisted(&p("b", vb + 1), &mut fx).unwrap(), "a newer copy wins");
        assert_eq!(tiers_of(&d, "b"), [Tier::ObjectStore]);
        assert_eq!(fx.len(), 1, "the replaced object's DRAM copy is dropped");
        assert_eq!(
            kind(d.adopt_persisted(&PersistedObject { size: 0, ..p("c", 1) }, &mut fx)),
            ErrorKind::InvalidArgument
        );
        d.verify().unwrap();
    }

    #[test]
    fn a_load_makes_room_on_the_nvme_node() {
        let mut d = cluster(3 * MIB);
        let a = put(&mut d, "a", Persistence::None, 0);
        let v = d.stat("a").unwrap().version;
        d.report_replica("a", v, None, Some(&nvme_at(a.node, 0)), Some(&Location::Node(a)), 1)
            .unwrap();
        // Fill that node's DRAM with other objects.
        let mut n = 0;
        while d.stats().tiers[Tier::Dram.index()].used_bytes < 6 * MIB {
            let mut req = PutStart::new(format!("f{n}"), MIB);
            req.preferred_segments = vec![SegmentRef { node: a.node, index: 0 }];
            let mut fx = Vec::new();
            d.put_start(&req, 2, &mut fx).unwrap();
            d.put_end(&PutEnd::new(format!("f{n}"), None), 2, &mut fx).unwrap();
            n += 1;
        }
        let mut fx = Vec::new();
        let plan = d.begin_load("a", 3, &mut fx).unwrap().unwrap();
        assert_eq!(plan.node, a.node);
        assert!(fx.iter().any(|e| matches!(e, NodeEffect::Drop { .. })), "eviction made room");
        assert!(d.end_load(&plan, Some([0; 32]), 4, &mut fx));
        d.verify().unwrap();
    }

    /// Nodes 1 and 2 with DRAM (segment 0) and HBM (segment 2, `hbm` bytes), and node 3 with
    /// DRAM only.
    fn hbm_cluster(hbm: u64) -> Directory {
        let mut d = Directory::new(Config { seed: 5, ..Config::default() }).unwrap();
        for n in 1..=3u64 {
            let mut segments = vec![SegmentSpec {
                index: 0,
                tier: Tier::Dram,
                base_addr: 1 << 30,
                capacity: 8 * MIB,
            }];
            if n < 3 {
                segments.push(SegmentSpec {
                    index: 2,
                    tier: Tier::Hbm,
                    base_addr: 1 << 40,
                    capacity: hbm,
                });
            }
            let r = NodeRegistration {
                node: NodeId(n),
                host: format!("host{n}"),
                endpoint: format!("10.0.0.{n}:7000"),
                segments,
                held: Vec::new(),
            };
            d.register_node(&r, 0, &mut Vec::new()).unwrap();
        }
        d
    }

    /// An object put into HBM on `replicas` nodes; its version.
    fn put_hbm(d: &mut Directory, key: &str, replicas: u8) -> u64 {
        let mut fx = Vec::new();
        let mut req = PutStart::new(key, MIB);
        req.tier = Tier::Hbm;
        req.replicas = replicas;
        d.put_start(&req, 0, &mut fx).unwrap();
        d.put_end(&PutEnd::new(key, None), 0, &mut fx).unwrap();
        d.stat(key).unwrap().version
    }

    fn hbm_on(d: &Directory, key: &str, node: NodeId) -> Location {
        let v = d.stat(key).unwrap();
        v.replicas
            .iter()
            .find(|r| r.node() == Some(node) && r.tier() == Tier::Hbm)
            .unwrap()
            .location
    }

    /// HBM -> DRAM on the same node: the DRAM copy is attached without a lease, the node's
    /// report then releases the HBM copy; and back up again.
    #[test]
    fn a_move_down_and_back_up_keeps_one_copy_per_tier() {
        let mut d = hbm_cluster(4 * MIB);
        let v = put_hbm(&mut d, "k", 1);
        let node = d.stat("k").unwrap().replicas[0].node().unwrap();
        let hbm = hbm_on(&d, "k", node);
        let mut fx = Vec::new();
        let plan = d.begin_move("k", v, node, (Tier::Hbm, Tier::Dram), 1, &mut fx).unwrap();
        let plan = plan.expect("the node has no DRAM copy yet");
        assert_eq!((plan.node, plan.segment, plan.source), (node, 0, hbm));
        let again = d.begin_move("k", v, node, (Tier::Hbm, Tier::Dram), 1, &mut fx);
        assert_eq!(kind(again), ErrorKind::PutInProgress);
        d.verify().unwrap();
        assert!(d.end_load(&plan, Some([7; 32]), 2, &mut fx));
        assert_eq!(tiers_of(&d, "k"), [Tier::Hbm, Tier::Dram]);
        assert!(d.stat("k").unwrap().lease_end_ms <= 2, "a move leases nothing");
        let o = d.report_replica("k", v, None, None, Some(&hbm), 3).unwrap();
        assert!(o.removed, "the source copy is released: {o:?}");
        assert_eq!(tiers_of(&d, "k"), [Tier::Dram]);
        d.verify().unwrap();
        let up = d.begin_move("k", v, node, (Tier::Dram, Tier::Hbm), 4, &mut fx).unwrap();
        let up = up.expect("the node has no HBM copy any more");
        assert_eq!((up.node, up.segment), (node, 2));
        assert!(d.end_load(&up, Some([7; 32]), 5, &mut fx));
        assert_eq!(tiers_of(&d, "k"), [Tier::Hbm, Tier::Dram]);
        let none = d.begin_move("k", v, node, (Tier::Dram, Tier::Hbm), 6, &mut fx).unwrap();
        assert!(none.is_none(), "an HBM copy is there already");
        d.verify().unwrap();
    }

    /// A copy read from a source the master dropped in the meantime (its range may hold
    /// another object's bytes by now) is never attached; its range is freed and dropped.
    #[test]
    fn a_move_whose_source_was_dropped_is_not_attached() {
        let mut d = hbm_cluster(4 * MIB);
        let v = put_hbm(&mut d, "k", 2);
        assert_eq!(tiers_of(&d, "k"), [Tier::Hbm, Tier::Hbm]);
        let node = d.stat("k").unwrap().replicas[0].node().unwrap();
        let mut fx = Vec::new();
        let plan = d.begin_move("k", v, node, (Tier::Hbm, Tier::Dram), 1, &mut fx).unwrap();
        let plan = plan.unwrap();
        assert!(!d.remove_replica("k", &hbm_on(&d, "k", node)).unwrap());
        let mut fx = Vec::new();
        assert!(!d.end_load(&plan, Some([7; 32]), 2, &mut fx));
        assert!(
            fx.iter()
                .any(|e| matches!(e, NodeEffect::Drop { node: n, segment: 0, .. } if *n == node)),
            "the filled range is dropped on the node: {fx:?}"
        );
        assert_eq!(tiers_of(&d, "k"), [Tier::Hbm]);
        d.verify().unwrap();
    }

    #[test]
    fn bad_moves_are_refused_with_their_reason() {
        let mut d = hbm_cluster(4 * MIB);
        let v = put_hbm(&mut d, "k", 1);
        let node = d.stat("k").unwrap().replicas[0].node().unwrap();
        let other = NodeId(if node.0 == 1 { 2 } else { 1 });
        let mut fx = Vec::new();
        let mut mv = |d: &mut Directory, key: &str, v: u64, n: NodeId, t: (Tier, Tier)| {
            d.begin_move(key, v, n, t, 1, &mut fx)
        };
        let (down, up) = ((Tier::Hbm, Tier::Dram), (Tier::Dram, Tier::Hbm));
        assert_eq!(kind(mv(&mut d, "k", v + 1, node, down)), ErrorKind::Conflict);
        assert_eq!(kind(mv(&mut d, "nope", v, node, down)), ErrorKind::NotFound);
        assert_eq!(kind(mv(&mut d, "k", v, other, down)), ErrorKind::NotFound, "no copy there");
        assert_eq!(kind(mv(&mut d, "k", v, other, up)), ErrorKind::NotFound, "no DRAM copy");
        assert!(mv(&mut d, "k", v, node, up).unwrap().is_none(), "an HBM copy is there already");
        for t in [(Tier::Hbm, Tier::Hbm), (Tier::Hbm, Tier::Nvme), (Tier::Nvme, Tier::Dram)] {
            assert_eq!(kind(mv(&mut d, "k", v, node, t)), ErrorKind::InvalidArgument, "{t:?}");
        }
        // Node 3 contributes no HBM: a DRAM object there cannot move up.
        let mut fx2 = Vec::new();
        let mut placed = None;
        for i in 0..8 {
            let key = format!("d{i}");
            let g = d.put_start(&PutStart::new(key.as_str(), MIB), 0, &mut fx2).unwrap();
            d.put_end(&PutEnd::new(key.as_str(), None), 0, &mut fx2).unwrap();
            if g.replicas[0].node() == Some(NodeId(3)) {
                placed = Some(key);
                break;
            }
        }
        let key = placed.expect("some DRAM put lands on node 3");
        let v3 = d.stat(&key).unwrap().version;
        assert_eq!(kind(mv(&mut d, &key, v3, NodeId(3), up)), ErrorKind::NoSpace);
        d.verify().unwrap();
    }
}
