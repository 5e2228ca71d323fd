//! Node membership: registration (and re-registration with what a node holds), heartbeats,
//! expiry and departure.
//!
//! Mechanism: a node registers its segments and the objects it holds. Registering a node the
//! directory already knows (it restarted, or the master did and the node was told
//! `NodeUnknown`) first detaches everything of its previous incarnation, then adopts the new
//! report; objects re-reported keep their metadata (lease, LRU position of other replicas),
//! objects that had replicas only there and were not re-reported are gone (`lost_keys`).
//!
//! Policy for held objects (nodes are the source of truth after a master restart):
//! - adopted as complete, with the reported version, pin and persistence; the range is
//!   reserved in the segment's allocator; `objects_max` is not applied (the bytes exist);
//! - a report the directory cannot accept (bad key or size, unknown segment, wrong tier,
//!   overlapping range, second replica on the same node and tier) is a [`Conflict`], and a
//!   `Drop` effect tells the node to free it;
//! - the same key with different contents: the higher `(version, size, checksum)` wins,
//!   whatever the order nodes register in; every replica of the loser gets a `Drop` effect
//!   and a `Superseded` conflict. Versions grow with wall-clock time (see `next_version`), so
//!   the newest write wins.
//!
//! Expiry: a node silent for more than `node_ttl_ms` loses its segments; replicas there are
//! dropped (no effects: the node is gone); objects left without any replica are gone; pending
//! puts lose their ranges there (and are revoked if none are left). A node whose control
//! connection closed is no longer placed on at once and goes the same way after
//! `disconnect_grace_ms`, unless it registers again first: a process killed with SIGKILL costs
//! writers at most the one batch that was already placed there.
//!
//! Not handled: graceful drain (moving replicas off a leaving node); adopting objects that
//! only the object store holds (the tier manager re-adds them with `add_replica` on a live
//! object; a listing-based rebuild is future work).

use std::num::NonZeroU32;
use std::sync::Arc;

use super::{Directory, Flags, NIL, Node, Obj, Retired, Segment};
use crate::alloc::Allocator;
use crate::error::{Error, ErrorKind, Result};
use crate::slab::List;
use crate::types::*;

impl Node {
    fn new(reg: &NodeRegistration, segs: Vec<NonZeroU32>, now_ms: u64, adopting: bool) -> Node {
        Node {
            host: reg.host.clone(),
            endpoint: reg.endpoint.clone(),
            segs,
            last_seen_ms: now_ms,
            disconnected_ms: None,
            adopting,
        }
    }
}

impl Directory {
    /// Register a node, or re-register it with what it holds. See the module notes.
    pub fn register_node(
        &mut self,
        reg: &NodeRegistration,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<Registration> {
        self.check_registration(reg)?;
        let mut out = Registration::default();
        let mut touched = Vec::new();
        if self.nodes.contains_key(&reg.node) {
            self.detach_node(reg.node, &mut touched);
        }
        let segs = reg.segments.iter().map(|spec| self.add_segment(reg.node, spec)).collect();
        self.nodes.insert(reg.node, Node::new(reg, segs, now_ms, false));
        // A master rebuilding from its nodes (a restart, a takeover) adopts mostly new keys.
        if reg.held.len() > self.index.len() {
            self.reserve_index(reg.held.len());
        }
        for held in &reg.held {
            self.adopt(reg.node, held, fx, &mut out);
        }
        self.reserve_inherited_of(reg.node, now_ms, &mut out);
        out.lost_keys = self.sweep_orphans(touched);
        Ok(out)
    }

    /// Whether the node is registered (or registering).
    pub fn knows_node(&self, node: NodeId) -> bool {
        self.nodes.contains_key(&node)
    }

    /// Registers a node this directory does not know yet (a restart, a takeover) whose
    /// objects are then adopted a chunk at a time with [`Directory::adopt_held`], so other
    /// calls run between chunks, and which [`Directory::register_node_end`] completes.
    /// `extents` (segment index, start, end: aligned, disjoint) cover every range the node
    /// holds objects in: they are reserved at once, with the inherited grants on the node
    /// (those that do not overlap them), so the node takes new replicas from the start, in
    /// the space nobody holds. `held` counts the objects to come. A node it knows must
    /// re-register whole ([`Directory::register_node`]): its objects' replicas there would be
    /// missing between chunks. Answers how many inherited grants were reserved.
    pub fn register_node_begin(
        &mut self,
        reg: &NodeRegistration,
        held: usize,
        extents: &[(u32, u64, u64)],
        now_ms: u64,
    ) -> Result<u64> {
        self.check_registration(reg)?;
        if self.nodes.contains_key(&reg.node) {
            return Err(Error::new(ErrorKind::InvalidArgument, "register_node")
                .with_detail(format!("node {} is known: it re-registers whole", reg.node.0)));
        }
        let segs: Vec<NonZeroU32> =
            reg.segments.iter().map(|spec| self.add_segment(reg.node, spec)).collect();
        for &(index, start, end) in extents {
            let Some(&seg) = segs.iter().find(|&&s| self.segment(s).index == index) else {
                continue;
            };
            if end > start {
                // An extent the segment cannot hold reserves nothing; its objects conflict.
                let _ = self.segment_mut(seg).alloc.reserve(start, end - start);
            }
        }
        self.nodes.insert(reg.node, Node::new(reg, segs, now_ms, true));
        self.reserve_index(held);
        let mut out = Registration::default();
        self.reserve_inherited_of(reg.node, now_ms, &mut out);
        Ok(out.reserved)
    }

    /// Adopts a chunk of a registering node's objects (see `register_node_begin`). With
    /// `reserved`, each object's range is one `register_node_begin` reserved: it is released
    /// and taken again by the object, under this one hold, or stays free if the object is
    /// refused. `NodeUnknown` if the node went meanwhile (expired, unregistered).
    pub fn adopt_held(
        &mut self,
        node: NodeId,
        held: &[HeldObject],
        reserved: bool,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
        out: &mut Registration,
    ) -> Result<()> {
        let segs = match self.nodes.get_mut(&node) {
            // Still alive: it waits for this registration's answer, not heartbeating.
            Some(n) if n.adopting => {
                n.last_seen_ms = n.last_seen_ms.max(now_ms);
                n.segs.clone()
            }
            _ => {
                return Err(Error::new(ErrorKind::NodeUnknown, "register_node")
                    .with_detail(format!("node {} is no longer registering", node.0)));
            }
        };
        for h in held {
            if reserved
                && let Some(&seg) = segs.iter().find(|&&s| self.segment(s).index == h.segment)
                && h.size > 0
            {
                let _ = self.segment_mut(seg).alloc.free(h.offset, h.size);
            }
            self.adopt(node, h, fx, out);
        }
        Ok(())
    }

    /// Completes a chunked registration.
    pub fn register_node_end(&mut self, node: NodeId, now_ms: u64) -> Result<()> {
        match self.nodes.get_mut(&node) {
            Some(n) if n.adopting => {
                n.adopting = false;
                n.last_seen_ms = n.last_seen_ms.max(now_ms);
                Ok(())
            }
            _ => Err(Error::new(ErrorKind::NodeUnknown, "register_node")
                .with_detail(format!("node {} is no longer registering", node.0))),
        }
    }

    /// After the node's objects: a range it reports an object in is that object's (the writer
    /// of an inherited grant finished it there); the rest stays reserved.
    fn reserve_inherited_of(&mut self, node: NodeId, now_ms: u64, out: &mut Registration) {
        let inherited = self.inherited.get(&node).cloned().unwrap_or_default();
        for g in inherited.iter().filter(|g| g.deadline_ms > now_ms) {
            out.reserved += u64::from(self.reserve_inherited(node, g));
        }
    }

    /// A new leader takes over what its predecessor had handed out: `grants` (the ranges its
    /// writers may still be writing, from the standby's mirror of the old leader) are kept
    /// from new placements until their deadlines, reserved as each node registers; and every
    /// object adopted before `adopted_lease_until_ms` is read-leased until then, since the old
    /// leader's readers may hold leases this directory never saw. Together they replace the
    /// recovery grace (no put waits) when the mirror was complete.
    pub fn inherit(&mut self, grants: Vec<crate::GrantedRange>, adopted_lease_until_ms: u64) {
        for g in grants {
            self.inherited.entry(g.node).or_default().push(g);
        }
        self.adopted_lease_until_ms = adopted_lease_until_ms;
    }

    /// Every range handed to a writer that has not settled: pending puts' replicas (until
    /// their deadlines) and loads in flight (until `load_deadline_ms`). What a standby must
    /// know to take over without a grace.
    pub fn outstanding_grants(&self, load_deadline_ms: u64) -> Vec<crate::GrantedRange> {
        let mut out = Vec::with_capacity(self.pending.len() + self.loading.len());
        for (key, p) in &self.pending {
            for &(seg, offset) in &p.ranges {
                let s = self.segment(seg);
                out.push(crate::GrantedRange {
                    key: key.clone(),
                    version: p.version,
                    node: s.node,
                    segment: s.index,
                    offset,
                    len: p.size,
                    deadline_ms: p.deadline_ms,
                });
            }
        }
        for (key, l) in &self.loading {
            let s = self.segment(l.seg);
            out.push(crate::GrantedRange {
                key: key.clone(),
                version: l.version,
                node: s.node,
                segment: s.index,
                offset: l.offset,
                len: l.size,
                deadline_ms: load_deadline_ms,
            });
        }
        out
    }

    /// Reserves an inherited grant's range on `node` if all of it is free (a node object in
    /// any of it means the writer finished: ranges the old leader handed out were disjoint
    /// from its objects). True if reserved.
    fn reserve_inherited(&mut self, node: NodeId, g: &crate::GrantedRange) -> bool {
        let Some(seg) =
            self.nodes[&node].segs.iter().copied().find(|&s| self.segment(s).index == g.segment)
        else {
            return false;
        };
        if self.segment_mut(seg).alloc.reserve(g.offset, g.len).is_err() {
            return false;
        }
        self.retired.push(Retired {
            release_at_ms: g.deadline_ms,
            seg,
            offset: g.offset,
            len: g.len,
            key: None,
            version: g.version,
        });
        true
    }

    /// Refresh a node's liveness. `NodeUnknown` (retryable) tells it to re-register with what
    /// it holds: it expired, or the master restarted.
    pub fn heartbeat(&mut self, node: NodeId, now_ms: u64) -> Result<()> {
        match self.nodes.get_mut(&node) {
            Some(n) => {
                n.last_seen_ms = n.last_seen_ms.max(now_ms);
                Ok(())
            }
            None => Err(Error::new(ErrorKind::NodeUnknown, "heartbeat")
                .with_detail(format!("node {} must re-register", node.0))),
        }
    }

    /// Remove every node silent for more than `node_ttl_ms`, and every node whose control
    /// connection closed more than `disconnect_grace_ms` ago, in node id order.
    pub fn expire(&mut self, now_ms: u64) -> NodeLoss {
        let ttl = self.cfg.node_ttl_ms;
        let grace = self.cfg.disconnect_grace_ms.min(ttl);
        let dead: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| {
                now_ms.saturating_sub(n.last_seen_ms) > ttl
                    || n.disconnected_ms.is_some_and(|t| now_ms.saturating_sub(t) > grace)
            })
            .map(|(&id, _)| id)
            .collect();
        self.remove_nodes(dead)
    }

    /// The node's control connection closed: from now on no replica is placed on it, and it
    /// is removed after `disconnect_grace_ms` unless it registers again (which clears this).
    /// Its complete objects stay readable meanwhile (a node that lives reconnects and reports
    /// them; readers of a dead one fall back to other replicas). Unknown nodes are ignored.
    pub fn node_disconnected(&mut self, node: NodeId, now_ms: u64) {
        if let Some(n) = self.nodes.get_mut(&node) {
            n.disconnected_ms.get_or_insert(now_ms);
        }
    }

    /// Whether new replicas may be placed on the node.
    pub(super) fn placeable(&self, node: NodeId) -> bool {
        self.nodes.get(&node).is_some_and(|n| n.disconnected_ms.is_none())
    }

    /// A node leaves on purpose; same consequences as expiry.
    pub fn unregister_node(&mut self, node: NodeId) -> Result<NodeLoss> {
        if !self.nodes.contains_key(&node) {
            return Err(Error::new(ErrorKind::NodeUnknown, "unregister_node")
                .with_detail(format!("node {}", node.0)));
        }
        Ok(self.remove_nodes(vec![node]))
    }

    /// Host and transfer endpoint of a node, for the RPC layer to attach to replica views.
    pub fn node_endpoint(&self, node: NodeId) -> Option<(&str, &str)> {
        self.nodes.get(&node).map(|n| (n.host.as_str(), n.endpoint.as_str()))
    }

    /// Registered nodes, in id order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.keys().copied()
    }

    fn remove_nodes(&mut self, nodes: Vec<NodeId>) -> NodeLoss {
        let mut touched = Vec::new();
        let pending_before = self.pending.len();
        for &node in &nodes {
            self.detach_node(node, &mut touched);
            self.nodes.remove(&node);
        }
        let revoked_puts = (pending_before - self.pending.len()) as u64;
        NodeLoss { lost_keys: self.sweep_orphans(touched), nodes, revoked_puts }
    }

    fn check_registration(&self, reg: &NodeRegistration) -> Result<()> {
        const OP: &str = "register_node";
        let invalid = |d: String| Err(Error::new(ErrorKind::InvalidArgument, OP).with_detail(d));
        if !self.nodes.contains_key(&reg.node) && self.nodes.len() >= self.cfg.nodes_max {
            return invalid(format!("nodes_max {} reached", self.cfg.nodes_max));
        }
        if reg.segments.len() > self.cfg.segments_per_node_max {
            return invalid(format!(
                "segments_per_node_max {} exceeded",
                self.cfg.segments_per_node_max
            ));
        }
        for (i, s) in reg.segments.iter().enumerate() {
            if s.tier == Tier::ObjectStore || s.capacity < self.cfg.segment_align_bytes {
                return invalid(format!(
                    "segment {}: tier {:?}, capacity {}",
                    s.index, s.tier, s.capacity
                ));
            }
            if s.base_addr.checked_add(s.capacity).is_none() {
                return invalid(format!("segment {}: base_addr + capacity overflows", s.index));
            }
            if reg.segments[..i].iter().any(|o| o.index == s.index) {
                return invalid(format!("segment index {} registered twice", s.index));
            }
        }
        Ok(())
    }

    fn add_segment(&mut self, node: NodeId, spec: &SegmentSpec) -> NonZeroU32 {
        let seg = Segment {
            node,
            index: spec.index,
            tier: spec.tier,
            base_addr: spec.base_addr,
            alloc: Allocator::new(spec.capacity, self.cfg.segment_align_bytes),
            lru: [List::default(); 3],
        };
        let id = match self.free_seg_ids.pop() {
            Some(id) => {
                self.segments[id.get() as usize] = Some(seg);
                id
            }
            None => {
                self.segments.push(Some(seg));
                NonZeroU32::new((self.segments.len() - 1) as u32).expect("slot 0 is reserved")
            }
        };
        self.tier_segs[spec.tier.index()].push(id);
        id
    }

    /// Drop the node's segments and every replica, pending range and retired range on them.
    /// Objects that lost replicas are pushed to `touched`; the node entry itself stays.
    fn detach_node(&mut self, node: NodeId, touched: &mut Vec<u32>) {
        let segs =
            self.nodes.get_mut(&node).map(|n| std::mem::take(&mut n.segs)).unwrap_or_default();
        for &seg in &segs {
            for list in 0..3 {
                while self.segment(seg).lru[list].head != NIL {
                    let rep = self.segment(seg).lru[list].head;
                    touched.push(self.replica(rep).0);
                    self.detach_replica(rep);
                }
            }
            let tier = self.segment(seg).tier.index();
            self.tier_segs[tier].retain(|&s| s != seg);
            self.segments[seg.get() as usize] = None;
            self.free_seg_ids.push(seg);
        }
        let mut lost_ranges = Vec::new();
        self.pending.retain(|key, p| {
            let before = p.ranges.len();
            p.ranges.retain(|(s, _)| !segs.contains(s));
            if p.ranges.len() < before {
                lost_ranges.push((key.clone(), p.tier, p.size * (before - p.ranges.len()) as u64));
            }
            !p.ranges.is_empty()
        });
        for (key, tier, bytes) in lost_ranges {
            self.tenant_pending(&key, tier, bytes, false);
        }
        self.retired.retain(|r| !segs.contains(&r.seg));
        self.loading.retain(|_, l| !segs.contains(&l.seg));
    }

    /// Remove the objects among `ids` left without any replica; returns their keys.
    fn sweep_orphans(&mut self, mut ids: Vec<u32>) -> Vec<Arc<str>> {
        ids.sort_unstable();
        ids.dedup();
        let mut lost = Vec::new();
        for id in ids {
            if self.objects.get(id).is_some() && self.is_orphan(id) {
                lost.push(self.key_arc(id));
                self.forget_object(id);
            }
        }
        lost
    }

    /// Adopt one held object of a registering node, or report why not.
    fn adopt(
        &mut self,
        node: NodeId,
        h: &HeldObject,
        fx: &mut Vec<NodeEffect>,
        out: &mut Registration,
    ) {
        if let Err(reason) = self.try_adopt(node, h, fx, out) {
            let key: Arc<str> = Arc::from(h.key.as_str());
            fx.push(NodeEffect::Drop {
                node,
                key,
                segment: h.segment,
                offset: h.offset,
                len: h.size,
                version: h.version,
                readers_until_ms: 0,
            });
            let c =
                Conflict { key: h.key.clone(), node, segment: h.segment, offset: h.offset, reason };
            out.conflicts.push(c);
        }
    }

    fn try_adopt(
        &mut self,
        node: NodeId,
        h: &HeldObject,
        fx: &mut Vec<NodeEffect>,
        out: &mut Registration,
    ) -> Result<(), ConflictReason> {
        if h.key.is_empty() || h.key.len() > self.cfg.key_len_max {
            return Err(ConflictReason::Invalid);
        }
        if h.size == 0 || h.size > self.cfg.object_size_max {
            return Err(ConflictReason::Invalid);
        }
        let segs = &self.nodes[&node].segs;
        let seg = segs
            .iter()
            .copied()
            .find(|&s| self.segment(s).index == h.segment)
            .ok_or(ConflictReason::UnknownSegment)?;
        if self.segment(seg).tier != h.tier {
            return Err(ConflictReason::TierMismatch);
        }
        if self.was_renamed_away(&h.key, h.version) {
            return Err(ConflictReason::Superseded);
        }
        self.settle_renamed_from(h.renamed_from.as_ref(), fx);
        let existing = self.lookup(&h.key);
        if let Some(id) = existing {
            let o = &self.objects[id];
            let theirs = (o.version, o.size, o.checksum());
            let ours = (h.version, h.size, h.checksum);
            if ours < theirs {
                return Err(ConflictReason::Superseded);
            }
            if ours == theirs && self.replica_on(id, node, h.tier).is_some() {
                return Err(ConflictReason::Duplicate);
            }
        }
        self.segment_mut(seg)
            .alloc
            .reserve(h.offset, h.size)
            .map_err(|_| ConflictReason::Overlap)?;
        let (id, paused) = match existing {
            Some(id)
                if self.objects[id].version == h.version
                    && self.objects[id].size == h.size
                    && self.objects[id].checksum() == h.checksum =>
            {
                (id, None)
            }
            Some(id) => {
                self.supersede(id, fx, out);
                let paused = self.events_pause();
                (self.insert_held(h), Some(paused))
            }
            None => {
                let paused = self.events_pause();
                (self.insert_held(h), Some(paused))
            }
        };
        if h.persisted {
            self.set_persisted(id, true);
        }
        self.attach_replica(id, seg, h.offset);
        let o = &mut self.objects[id];
        o.lease_end_ms = o.lease_end_ms.max(self.adopted_lease_until_ms);
        if let Some(paused) = paused {
            self.events_resume(paused, id, None);
        }
        self.last_version = self.last_version.max(h.version);
        out.adopted += 1;
        Ok(())
    }

    /// Remove an object that lost to a newer report: `Drop` and a conflict for each replica.
    fn supersede(&mut self, id: u32, fx: &mut Vec<NodeEffect>, out: &mut Registration) {
        let first = fx.len();
        self.remove_object(id, Some(fx));
        for effect in &fx[first..] {
            if let NodeEffect::Drop { node, key, segment, offset, .. } = effect {
                out.conflicts.push(Conflict {
                    key: key.to_string(),
                    node: *node,
                    segment: *segment,
                    offset: *offset,
                    reason: ConflictReason::Superseded,
                });
            }
        }
    }

    fn insert_held(&mut self, h: &HeldObject) -> u32 {
        let flags = Flags {
            has_checksum: h.checksum.is_some(),
            persisted: h.persisted,
            pin: h.pin,
            persistence: h.persistence,
        };
        self.insert_object(&h.key, Obj::new(h.size, h.version, h.checksum, flags))
    }
}
