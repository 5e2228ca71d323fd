//! Eviction: dropping replicas of cold objects to keep tiers under their watermark and to make
//! room for puts.
//!
//! Mechanism: every segment keeps its replicas on three intrusive lists, oldest use at the
//! head: unpinned, soft-pinned and hard-pinned (never evicted). `get` and `put_end` move an
//! object's replicas to the tail. Shedding a segment walks its unpinned list from the head,
//! dropping each replica whose object holds no live lease; a leased one is moved to the tail
//! (it was read within `lease_ttl_ms`, so it is recent). Soft-pinned replicas of a segment
//! are shed only after a full walk of its unpinned list found nothing more to drop.
//!
//! So the order is exact LRU *per segment*; across the segments of a tier it is approximated by
//! shedding the fullest segments first (watermark eviction) or the ones nearest to fitting the
//! new object (make-room eviction). Cost: 8 bytes per replica (the two list links), no
//! timestamps, O(1) per touch and per dropped replica.
//!
//! Evicting a replica frees its range and produces a `Drop` effect; an object that loses its
//! last node replica and is not persisted is gone (its key is reported). A persisted object
//! stays readable from object storage.
//!
//! Policy: `evict` runs when a tier's used bytes exceed `evict_high_watermark` of its
//! capacity and sheds segments above `evict_low_watermark`, fullest first, until the tier is
//! back under the low watermark. Each pass is bounded: at most `evict_round_objects_max`
//! replicas dropped and `evict_round_scan_max` replicas looked at; the caller repeats passes
//! (the RPC layer's timer). Pending puts are never in the lists, so never evicted.
//!
//! Not handled: demotion to a lower tier instead of dropping (the node's tier manager does that
//! before the master has to, and reports with `add_replica` / `remove_replica`); frequency
//! (LFU) signals.

use std::num::NonZeroU32;

use super::{Directory, DroppedCopy, LIST_PLAIN, LIST_SOFT};
use crate::config::Config;
use crate::slab::NIL;
use crate::types::{Eviction, NodeEffect, Tier};

/// What a shedding walk aims for in one segment.
#[derive(Debug, Clone, Copy)]
pub(super) enum Goal {
    UsedAtMost(u64),
    LargestFreeAtLeast(u64),
}

/// Work left in one eviction pass.
#[derive(Debug)]
pub(super) struct Budget {
    evict_left: usize,
    scan_left: usize,
}

impl Budget {
    pub(super) fn new(cfg: &Config) -> Self {
        Budget { evict_left: cfg.evict_round_objects_max, scan_left: cfg.evict_round_scan_max }
    }

    pub(super) fn exhausted(&self) -> bool {
        self.evict_left == 0 || self.scan_left == 0
    }

    /// One replica looked at (call only while not exhausted).
    pub(super) fn scan(&mut self) {
        self.scan_left -= 1;
    }

    /// One replica dropped (call only while not exhausted).
    pub(super) fn spend(&mut self) {
        self.evict_left -= 1;
    }
}

impl Directory {
    /// One bounded watermark pass over every node tier. `Drop` effects go to `fx`.
    pub fn evict(&mut self, now_ms: u64, fx: &mut Vec<NodeEffect>) -> Eviction {
        let mut out = Eviction::default();
        let mut budget = Budget::new(&self.cfg);
        for tier in [Tier::Hbm, Tier::Dram, Tier::Nvme] {
            if budget.exhausted() {
                break;
            }
            self.evict_tier(tier, now_ms, &mut budget, fx, &mut out);
        }
        out
    }

    fn evict_tier(
        &mut self,
        tier: Tier,
        now_ms: u64,
        budget: &mut Budget,
        fx: &mut Vec<NodeEffect>,
        out: &mut Eviction,
    ) {
        let segs = self.tier_segs[tier.index()].clone();
        let (capacity, used) = segs.iter().fold((0u64, 0u64), |(c, u), &s| {
            let a = &self.segment(s).alloc;
            (c + a.capacity(), u + a.used_bytes())
        });
        if used as f64 <= self.cfg.evict_high_watermark * capacity as f64 {
            return;
        }
        let target = (self.cfg.evict_low_watermark * capacity as f64) as u64;
        let ratio = |d: &Directory, s: NonZeroU32| {
            let a = &d.segment(s).alloc;
            a.used_bytes() as f64 / a.capacity().max(1) as f64
        };
        let mut by_fullness = segs;
        by_fullness.sort_by(|&a, &b| ratio(self, b).total_cmp(&ratio(self, a)).then(a.cmp(&b)));
        let mut tier_used = used;
        for seg in by_fullness {
            if tier_used <= target || budget.exhausted() {
                break;
            }
            let a = &self.segment(seg).alloc;
            let seg_goal = (self.cfg.evict_low_watermark * a.capacity() as f64) as u64;
            let before = a.used_bytes();
            self.shed_segment(seg, Goal::UsedAtMost(seg_goal), now_ms, budget, fx, out);
            tier_used -= before - self.segment(seg).alloc.used_bytes();
        }
    }

    /// Drop LRU replicas of one segment until `goal` holds or the budget is spent: unpinned
    /// first, soft-pinned only once the unpinned list has nothing evictable left.
    pub(super) fn shed_segment(
        &mut self,
        seg: NonZeroU32,
        goal: Goal,
        now_ms: u64,
        budget: &mut Budget,
        fx: &mut Vec<NodeEffect>,
        out: &mut Eviction,
    ) {
        for list in [LIST_PLAIN, LIST_SOFT] {
            let mut unseen = self.segment(seg).lru[list].len;
            while unseen > 0 && !self.goal_met(seg, goal) {
                if budget.exhausted() {
                    return;
                }
                budget.scan_left -= 1;
                unseen -= 1;
                let rep = self.segment(seg).lru[list].head;
                debug_assert_ne!(rep, NIL);
                let (id, _, _) = self.replica(rep);
                if self.objects[id].lease_end_ms > now_ms {
                    self.lru_to_back(seg, list, rep);
                    continue;
                }
                budget.evict_left -= 1;
                self.evict_replica(rep, fx, out);
            }
            if self.goal_met(seg, goal) {
                return;
            }
        }
    }

    fn goal_met(&self, seg: NonZeroU32, goal: Goal) -> bool {
        let a = &self.segment(seg).alloc;
        match goal {
            Goal::UsedAtMost(bytes) => a.used_bytes() <= bytes,
            Goal::LargestFreeAtLeast(bytes) => a.largest_free() >= bytes,
        }
    }

    pub(super) fn evict_replica(&mut self, rep: u32, fx: &mut Vec<NodeEffect>, out: &mut Eviction) {
        let (id, _, _) = self.replica(rep);
        let (size, version) = (self.objects[id].size, self.objects[id].version);
        let key = self.key_arc(id);
        let (seg, offset) = self.detach_replica(rep);
        fx.push(self.drop_effect(&key, DroppedCopy { seg, offset, len: size, version }));
        self.free_range(seg, offset, size);
        out.replicas += 1;
        out.bytes += size;
        self.counters.evicted_replicas += 1;
        self.counters.evicted_bytes += size;
        if self.is_orphan(id) {
            out.removed_keys.push(key);
            self.counters.evicted_objects += 1;
            self.forget_object(id);
        }
    }
}
