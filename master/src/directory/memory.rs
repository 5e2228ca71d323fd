//! `stats()` and the estimate of the directory's own memory.
//!
//! The estimate counts what is allocated per object, from the real sizes of the structures:
//! - the object slot (`Slab<Obj>`, 88 bytes with its first node replica inline) and a replica
//!   slot (`Slab<Rep>`, 28 bytes) per further node replica, counted exactly from the slab pages
//!   (pages of 4096 slots, no doubling);
//! - the key: its bytes and a 1-byte length in the key arena, counted exactly from the arena's
//!   chunks (64 KiB each, at least half live);
//! - the hash index: `buckets * 5` bytes (a `u32` id and a control byte per bucket), from the
//!   table's real capacity (load factor 7/8 right before growth, 7/16 right after);
//! - the ordered set: leaves of 64 `u32` ids counted exactly, ~70 % full under random inserts
//!   (~6 bytes per key), plus each leaf's entry in std's `BTreeMap` (an approximation: std
//!   does not expose its node count) and its short bound;
//! - allocator free blocks (~50 bytes each, two B-tree entries), pending puts and retired
//!   ranges.
//!
//! `tests/memory.rs` checks the estimate against a counting global allocator and prints RSS
//! growth for 1 M objects.

use super::Directory;
use crate::types::{Stats, Tier, TierStats};

/// Heap bytes of an `Arc<str>` of `len` bytes under glibc malloc (64-bit).
fn arc_str_heap_bytes(len: usize) -> u64 {
    let request = 16 + len as u64;
    ((request + 8 + 15) & !15).max(32)
}
/// Bytes per free block of an allocator (one entry in each of its two B-trees).
const ALLOC_BYTES_PER_FREE_BLOCK: u64 = 50;

impl Directory {
    /// A snapshot of the directory's figures (O(segments)).
    pub fn stats(&self) -> Stats {
        let mut tiers = [TierStats::default(); 4];
        for tier in Tier::ALL {
            let t = &mut tiers[tier.index()];
            t.replicas = self.tier_replicas[tier.index()];
            t.bytes = self.tier_bytes[tier.index()];
            for &seg in &self.tier_segs[tier.index()] {
                let a = &self.segment(seg).alloc;
                t.capacity_bytes += a.capacity();
                t.used_bytes += a.used_bytes();
            }
        }
        let metadata_bytes = self.metadata_bytes();
        Stats {
            objects: self.objects.len() as u64,
            pending_puts: self.pending.len() as u64,
            nodes: self.nodes.len() as u64,
            segments: self.tier_segs.iter().map(Vec::len).sum::<usize>() as u64,
            tiers,
            evicted_objects: self.counters.evicted_objects,
            evicted_replicas: self.counters.evicted_replicas,
            evicted_bytes: self.counters.evicted_bytes,
            metadata_bytes,
            metadata_bytes_per_object: metadata_bytes as f64 / self.objects.len().max(1) as f64,
        }
    }

    /// Estimated heap bytes of the directory's metadata; see the module notes.
    pub fn metadata_bytes(&self) -> u64 {
        let slabs = (self.objects.heap_bytes() + self.reps.heap_bytes()) as u64;
        let index = hash_buckets(self.index.capacity()) * 5 + 16;
        let order = self.order.heap_bytes();
        let pending: u64 = self
            .pending
            .iter()
            .map(|(k, p)| {
                let entry = (std::mem::size_of_val(p) + 16 + 1) as u64;
                entry + arc_str_heap_bytes(k.len()) + p.ranges.capacity() as u64 * 16
            })
            .sum();
        let retired = (self.retired.capacity() * std::mem::size_of::<super::Retired>()) as u64;
        let segments: u64 = self
            .segments
            .iter()
            .flatten()
            .map(|s| {
                std::mem::size_of_val(s) as u64
                    + s.alloc.free_blocks() as u64 * ALLOC_BYTES_PER_FREE_BLOCK
            })
            .sum();
        slabs + self.keys.heap_bytes() + index + order + pending + retired + segments
    }
}

/// Buckets of a hashbrown table with this capacity (inverse of its 7/8 load factor).
fn hash_buckets(capacity: usize) -> u64 {
    match capacity {
        0 => 0,
        1..=3 => 4,
        4..=7 => 8,
        c => (c as u64 * 8 / 7).next_power_of_two(),
    }
}
