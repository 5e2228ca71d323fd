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
//!
//! Invariants: a key has at most one load in flight; a loading range is allocated in its
//! segment and in no replica, and it disappears with its segment when the node goes away;
//! `verify` counts loading ranges as allocated.
//!
//! Not handled: loading into another node than the NVMe copy's (bytes would have to cross
//! nodes twice); loads into HBM.

use std::num::NonZeroU32;
use std::sync::Arc;

use super::evict::{Budget, Goal};
use super::{Directory, Flags, NIL, Obj};
use crate::error::{Error, ErrorKind, Result};
use crate::types::*;

/// A DRAM range being filled by a load.
#[derive(Debug, Clone)]
pub(super) struct Loading {
    pub(super) seg: NonZeroU32,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) version: u64,
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
    /// `Location::Node` of the NVMe copy, or `Location::ObjectStore`.
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
        let nvme = view.replicas.iter().find(|r| r.tier() == Tier::Nvme).copied();
        let mut placed = None;
        if let Some(r) = &nvme {
            let node = r.node().expect("an NVMe replica is on a node");
            placed = self.alloc_dram_on(node, size, now_ms, fx).map(|p| (p, r.location));
        }
        if placed.is_none() && self.objects[id].flags.persisted {
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
        let o = &self.objects[id];
        let (version, checksum, persistence, pin) =
            (o.version, o.checksum(), o.flags.persistence, o.flags.pin);
        self.loading.insert(o.key.clone(), Loading { seg, offset, size, version });
        let s = self.segment(seg);
        Ok(Some(LoadPlan {
            key: o.key.clone(),
            node: s.node,
            segment: s.index,
            offset,
            addr: s.base_addr + offset,
            size,
            version,
            checksum,
            persistence,
            pin,
            source,
        }))
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
        let segs: Vec<NonZeroU32> = self.nodes.get(&node)?.segs.clone();
        let dram: Vec<NonZeroU32> =
            segs.into_iter().filter(|&s| self.segment(s).tier == Tier::Dram).collect();
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

    /// Finish a load. With `filled` (the blake3 the node computed), the range becomes a DRAM
    /// replica of the object, leased like a get, if the object is still the version loaded;
    /// otherwise the range is freed (with a `Drop` effect when the node filled it). Returns
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
        let node = self.segment(l.seg).node;
        let id = self.lookup(&plan.key).filter(|&id| {
            self.objects[id].version == l.version && self.replica_on(id, node, Tier::Dram).is_none()
        });
        let Some(id) = id else {
            fx.push(self.drop_effect(&plan.key, l.seg, l.offset, l.size));
            self.free_range(l.seg, l.offset, l.size);
            return false;
        };
        self.attach_replica(id, l.seg, l.offset);
        self.lease(id, now_ms);
        self.touch(id);
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

    fn has_replica(&self, id: u32, loc: &Location) -> bool {
        match loc {
            Location::ObjectStore => self.objects[id].flags.persisted,
            Location::Node(n) => {
                let mut rep = self.objects[id].first_rep;
                while rep != NIL {
                    let r = &self.reps[rep];
                    let s = self.segment(r.seg);
                    if s.node == n.node && s.index == n.segment && r.offset == n.offset {
                        return true;
                    }
                    rep = r.obj_next;
                }
                false
            }
        }
    }

    /// Record the checksum of an object that has none (a node computed it when the object
    /// crossed into NVMe or the object store).
    fn record_checksum(&mut self, id: u32, sum: [u8; 32]) {
        let o = &mut self.objects[id];
        if !o.flags.has_checksum {
            o.flags.has_checksum = true;
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
        if let Some(id) = self.lookup(&p.key) {
            let v = self.objects[id].version;
            if v == p.version {
                let changed = !self.objects[id].flags.persisted;
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
        self.insert_object(Obj {
            key: Arc::from(p.key.as_str()),
            size: p.size,
            version: p.version,
            lease_end_ms: 0,
            checksum: p.checksum,
            first_rep: NIL,
            flags,
        });
        self.last_version = self.last_version.max(p.version);
        Ok(true)
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
