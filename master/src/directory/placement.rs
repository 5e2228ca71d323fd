//! Placement: which segments get the replicas of a new object.
//!
//! Mechanism: candidates are tried in order, each on a node not already chosen, and taken if
//! its allocator hands out a range (best fit inside the segment):
//! 1. the request's `preferred_segments`, in order (other tiers' segments skipped);
//! 2. `LocalFirst`: the segments on nodes whose host is `client_host`, most free first;
//! 3. `FreeRatioFirst` and `LocalFirst`: a window of `max(8, 4 * replicas)` consecutive
//!    segments from a random start, most free (by ratio) first: power-of-d-choices, O(d) per
//!    put instead of a sort of every segment;
//! 4. every strategy: a cyclic scan of the tier's segments from a seeded random start
//!    (Mooncake's `random` strategy), so a put fails only when no segment has room.
//!
//! Policy: replicas always on distinct nodes, never on a node whose control connection closed
//! (`node_disconnected`); best effort (fewer nodes than replicas gives
//! fewer replicas). When fewer were placed than there are usable nodes, up to
//! `put_evict_rounds_max` make-room rounds evict LRU replicas from the segments with the most
//! free bytes (those closest to holding the object) and placement is retried.
//!
//! Not handled: topology beyond hosts (racks, NUMA, NIC affinity); quotas.

use std::num::NonZeroU32;
use std::sync::Arc;

use super::Directory;
use super::evict::{Budget, Goal};
use crate::types::{Eviction, NodeEffect, NodeId, PutStart, Strategy};

impl Directory {
    /// Ranges for `req.replicas` replicas (possibly fewer, possibly none).
    /// Objects removed by make-room eviction are appended to `evicted`.
    pub(super) fn place(
        &mut self,
        req: &PutStart,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
        evicted: &mut Vec<Arc<str>>,
    ) -> Vec<(NonZeroU32, u64)> {
        let want = usize::from(req.replicas);
        let mut chosen = Vec::with_capacity(want);
        for round in 0..=self.cfg.put_evict_rounds_max {
            self.place_once(req, want, &mut chosen);
            if chosen.len() >= want || round == self.cfg.put_evict_rounds_max {
                break;
            }
            let missing = want.min(self.usable_nodes(req, &chosen)) - chosen.len().min(want);
            if missing == 0 || !self.make_room(req, missing, &chosen, now_ms, fx, evicted) {
                break;
            }
        }
        chosen
    }

    fn place_once(&mut self, req: &PutStart, want: usize, chosen: &mut Vec<(NonZeroU32, u64)>) {
        let tier = req.tier.index();
        for seg_ref in &req.preferred_segments {
            // The named segment, or else the node's segment of the request's tier (a caller
            // naming a node means that node, whichever memory the put asks for).
            let seg = self.nodes.get(&seg_ref.node).and_then(|n| {
                let of_tier = |s: &NonZeroU32| self.segment(*s).tier == req.tier;
                let named =
                    n.segs.iter().copied().find(|&s| self.segment(s).index == seg_ref.index);
                named.filter(of_tier).or_else(|| n.segs.iter().copied().find(of_tier))
            });
            if let Some(seg) = seg {
                self.try_segment(seg, req.size, want, chosen);
            }
        }
        if req.strategy == Strategy::LocalFirst
            && let Some(host) = &req.client_host
        {
            let mut local: Vec<NonZeroU32> = self.tier_segs[tier]
                .iter()
                .copied()
                .filter(|&s| self.nodes[&self.segment(s).node].host == *host)
                .collect();
            self.sort_by_free_ratio(&mut local);
            for seg in local {
                self.try_segment(seg, req.size, want, chosen);
            }
        }
        let n = self.tier_segs[tier].len();
        if n == 0 || chosen.len() >= want {
            return;
        }
        let start = self.rng.below(n as u64) as usize;
        if req.strategy != Strategy::Random {
            let window = n.min(8.max(4 * want));
            let mut sample: Vec<NonZeroU32> =
                (0..window).map(|i| self.tier_segs[tier][(start + i) % n]).collect();
            self.sort_by_free_ratio(&mut sample);
            for seg in sample {
                self.try_segment(seg, req.size, want, chosen);
            }
        }
        for i in 0..n {
            if chosen.len() >= want {
                break;
            }
            let seg = self.tier_segs[tier][(start + i) % n];
            self.try_segment(seg, req.size, want, chosen);
        }
    }

    fn try_segment(
        &mut self,
        seg: NonZeroU32,
        size: u64,
        want: usize,
        chosen: &mut Vec<(NonZeroU32, u64)>,
    ) {
        if chosen.len() >= want {
            return;
        }
        let node = self.segment(seg).node;
        if !self.placeable(node) || chosen.iter().any(|&(s, _)| self.segment(s).node == node) {
            return;
        }
        let alloc = &mut self.segment_mut(seg).alloc;
        if alloc.footprint(size) > alloc.largest_free() {
            return;
        }
        if let Some(offset) = alloc.alloc(size) {
            chosen.push((seg, offset));
        }
    }

    /// Most free first; ties by segment id, so the order is deterministic.
    fn sort_by_free_ratio(&self, segs: &mut [NonZeroU32]) {
        let ratio = |s: NonZeroU32| {
            let a = &self.segment(s).alloc;
            a.free_bytes() as f64 / a.capacity().max(1) as f64
        };
        segs.sort_by(|&a, &b| ratio(b).total_cmp(&ratio(a)).then(a.cmp(&b)));
    }

    /// Distinct nodes with a segment in the request's tier, counting those already chosen.
    pub(super) fn usable_nodes(&self, req: &PutStart, chosen: &[(NonZeroU32, u64)]) -> usize {
        let mut nodes: Vec<NodeId> = self.tier_segs[req.tier.index()]
            .iter()
            .map(|&s| self.segment(s).node)
            .filter(|&n| self.placeable(n))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len().max(chosen.len())
    }

    /// One make-room round: evict from up to `missing` segments on nodes not yet chosen, most
    /// free first, until each has a hole for the object. Returns whether anything was evicted.
    fn make_room(
        &mut self,
        req: &PutStart,
        missing: usize,
        chosen: &[(NonZeroU32, u64)],
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
        evicted: &mut Vec<Arc<str>>,
    ) -> bool {
        let taken: Vec<NodeId> = chosen.iter().map(|&(s, _)| self.segment(s).node).collect();
        let mut segs: Vec<NonZeroU32> = self.tier_segs[req.tier.index()]
            .iter()
            .copied()
            .filter(|&s| {
                !taken.contains(&self.segment(s).node) && self.placeable(self.segment(s).node)
            })
            .collect();
        segs.sort_by_key(|&s| (std::cmp::Reverse(self.segment(s).alloc.free_bytes()), s));
        let mut budget = Budget::new(&self.cfg);
        let mut out = Eviction::default();
        let need = self.segment_footprint(req.size);
        let mut helped = 0;
        let mut nodes_helped: Vec<NodeId> = Vec::new();
        for seg in segs {
            let node = self.segment(seg).node;
            if helped >= missing || budget.exhausted() || nodes_helped.contains(&node) {
                continue;
            }
            self.shed_segment(
                seg,
                Goal::LargestFreeAtLeast(need),
                now_ms,
                &mut budget,
                fx,
                &mut out,
            );
            if self.segment(seg).alloc.largest_free() >= need {
                helped += 1;
                nodes_helped.push(node);
            }
        }
        evicted.append(&mut out.removed_keys);
        out.replicas > 0
    }

    pub(super) fn segment_footprint(&self, size: u64) -> u64 {
        size.div_ceil(self.cfg.segment_align_bytes) * self.cfg.segment_align_bytes
    }
}
