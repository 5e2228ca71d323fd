//! The prefix-cache index: which owner holds which block of which context, on which medium,
//! and how long a prefix of a prompt's blocks each owner can serve.
//!
//! Model. A *context* is (tenant, model, LoRA, block size): block hashes are only comparable
//! within one. An *owner* is one engine instance's data-parallel rank (its GPU cache and its
//! own offload media), or a *shared* holder (the kvfs pool, a reference store), whose blocks
//! every instance can load. Each block entry keeps, per medium, the sorted ids of the local
//! owners holding it and of the shared holders holding it.
//!
//! Query (the reference conductor's semantics, made exact): for each owner, walk the prompt's
//! blocks in order; the GPU cursor extends while the block is in that owner's GPU; from there
//! the CPU cursor extends while the block is in the owner's own CPU or in any shared holder's
//! CPU; the disk cursor extends likewise with disk (or faster) media. The first miss stops each cursor, so `gpu <= cpu <= disk` (cumulative
//! block counts). One walk over the blocks serves every owner. The blocks' entries are looked
//! up first, in a loop of independent lookups the processor overlaps (a walk's cost at small
//! blocks is mostly these cache misses; the fields a walk reads lead each entry). Then
//! the GPU phase keeps the set of owners still matching (a bitset) and, at each block, takes
//! out the owners its predecessor holds and it does not. Those are memoised per block (a
//! `DropMemo`, valid while both blocks' GPU owner sets are unchanged, which version numbers
//! tell), so a repeated walk costs O(blocks + owners dropped) and reads no owner set; a block
//! without a valid memo (or where more than `DROPS_MAX` owners drop) intersects the bitset with
//! its GPU owners eight words at a time, only over the words where owners still match. The
//! later phases use run lengths of the shared media (kept per entry); only an owner
//! with its own CPU or disk blocks in the context walks those phases alone.
//!
//! Bounds. At most `entries_max` block entries and `bytes_max` bytes of the index's own memory
//! ([`Index::bytes`]: the block tables' allocations, the owner sets' and spilled memos'
//! capacity, the LRU queue's); past either the least recently used entries (by store and
//! query) are dropped, which only makes later answers shorter, never wrong about a block that
//! is there. The count is kept as the memory changes (a set's capacity before and after each
//! insert and removal), so checking the bound costs nothing per event. A context's blocks are
//! in 16 tables by hash ([`Blocks`]); a table past half full is counted at twice its
//! allocation, since hashbrown may double it at the next insert, and the largest of those is
//! counted once more, for the old allocation a doubling holds until its entries have moved
//! ([`table_charge`]; one table doubles at a time, and in shards that is a sixteenth of the
//! index). A store that would take a table past half evicts first where that does not fit: a
//! table is never doubled past the bound and then emptied to get back under it. Events are
//! idempotent (storing a held block or removing a missing one
//! changes nothing), so a replayed batch applied twice leaves the index as applied once.

use std::cell::Cell;
use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::event::{Event, Medium};

/// Block hashes are already uniformly distributed; hashing them again is wasted work.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    /// The chain memo's 128-bit fingerprints: their low 64 bits.
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

type BlockMap = HashMap<u64, Entry, std::hash::BuildHasherDefault<IdHasher>>;

/// The key of a context.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct ContextKey {
    pub tenant: String,
    pub model: String,
    /// Empty without LoRA.
    pub lora: String,
    pub block_size: u32,
}

/// Who holds blocks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct OwnerKey {
    pub instance: String,
    pub dp_rank: u32,
}

pub type OwnerId = u32;
type CtxId = u32;

/// What a walk reads of every block comes first, so a repeated walk loads the start of each
/// entry and, where owners drop or memos are stale, its GPU owners.
#[repr(C)]
struct Entry {
    stamp: Cell<u64>,
    /// Names the content of `local[GPU]`: a fresh value of the index's counter on every
    /// change (0: never held on GPU by a local owner, so empty).
    gpu_version: u64,
    /// The GPU owners that the block before it in the last query held and it does not (see
    /// [`DropMemo`]), read with the entry's first line.
    drops: Cell<DropMemo>,
    /// The fastest medium a shared holder has the block on (3: none), kept with `shared`;
    /// read by the walk with the lines above.
    shared_best: u8,
    /// The owners of a [`DropMemo`] of more than [`DROPS_INLINE`] (a query takes them out and
    /// puts them back). Boxed, as the shared sets: an entry is a slot of its table, which is
    /// counted at up to twice its size (see [`table_charge`]), and both are rare.
    #[allow(clippy::box_collection, reason = "8 bytes of the slot, not the Vec's 24")]
    spilled: Cell<Option<Box<Vec<OwnerId>>>>,
    /// Sorted ids of the local owners holding the block, per medium.
    local: [OwnerSet; 3],
    /// Sorted ids of the shared holders holding the block, per medium (`None`: none).
    shared: Option<Box<[OwnerSet; 3]>>,
    /// The stamp of the entry's one live record in the LRU queue (older records of the same
    /// hash are stale).
    queued: u64,
}

/// What the GPU phase of a walk learned at one block: which local GPU owners of the block
/// before it (`before`, at `before_version`) are not owners of this one (at `version`). While
/// both versions stand, the next query through the same two blocks drops these owners and
/// reads neither set: a chain that owners hold as prefixes of different lengths changes by an
/// owner or two a block, where the sets themselves are thousands of bits.
///
/// Kept in the entry itself (a walk reads it with the entry's first line, which the lookup
/// brought in, and not through a pointer to another cache miss, which took a fifth of a walk
/// of 8,192 blocks): the usual one or two owners inline, more in `Entry::spilled`. A fresh
/// entry's memo (versions 0, nothing drops) is true of two blocks that never had GPU owners.
#[derive(Clone, Copy, Default)]
struct DropMemo {
    before_version: u64,
    version: u64,
    /// How many owners drop: up to [`DROPS_INLINE`], listed in `owners`; up to [`DROPS_MAX`],
    /// listed in `Entry::spilled`; [`DROPS_MANY`]: more, the walk intersects the sets.
    count: u32,
    owners: [OwnerId; DROPS_INLINE],
}

/// Owners a [`DropMemo`] lists in the entry.
const DROPS_INLINE: usize = 2;

/// The most owners a [`DropMemo`] lists (bounds its memory at a few hundred bytes a block).
const DROPS_MAX: usize = 64;

/// [`DropMemo::count`] of a block where more than [`DROPS_MAX`] owners drop.
const DROPS_MANY: u32 = u32::MAX;

impl Entry {
    fn new(queued: u64) -> Entry {
        Entry {
            stamp: Cell::new(0),
            gpu_version: 0,
            drops: Cell::new(DropMemo::default()),
            shared_best: 3,
            spilled: Cell::new(None),
            local: Default::default(),
            shared: None,
            queued,
        }
    }

    fn is_empty(&self) -> bool {
        self.local.iter().all(OwnerSet::is_empty) && self.shared.is_none()
    }

    fn shared_sets(&self) -> &[OwnerSet] {
        self.shared.as_deref().map_or(&[], |s| &s[..])
    }

    /// The set of `shared` or local holders on medium `m`; `None`: no shared holder at all.
    fn holders_mut(&mut self, shared: bool, m: usize) -> Option<&mut OwnerSet> {
        if shared { self.shared.as_mut().map(|s| &mut s[m]) } else { Some(&mut self.local[m]) }
    }

    /// The heap memory the entry owns: its owner sets and its spilled drop memo.
    fn heap_bytes(&self) -> usize {
        let spilled = self.spilled.take();
        let memo = spill_bytes(&spilled);
        self.spilled.set(spilled);
        let shared = self.shared.as_ref().map_or(0, |_| size_of::<[OwnerSet; 3]>());
        self.local.iter().chain(self.shared_sets()).map(OwnerSet::heap_bytes).sum::<usize>()
            + shared
            + memo
    }

    /// Sets `shared_best` from `shared` (after a change to it); drops the shared sets once
    /// they are all empty.
    fn shared_changed(&mut self) {
        self.shared_best = (0..3)
            .find(|&m| self.shared_sets().get(m).is_some_and(|s| !s.is_empty()))
            .unwrap_or(3) as u8;
        if self.shared_best == 3 {
            self.shared = None;
        }
    }
}

/// The heap memory of a spilled memo.
#[allow(clippy::box_collection, reason = "as `Entry::spilled`")]
fn spill_bytes(spill: &Option<Box<Vec<OwnerId>>>) -> usize {
    spill.as_ref().map_or(0, |v| size_of::<Vec<OwnerId>>() + v.capacity() * size_of::<OwnerId>())
}

struct Context {
    key: ContextKey,
    blocks: Blocks,
    /// Owners that joined this context.
    owners: Members,
}

/// Shards of a context's block table.
const SHARDS: usize = 16;

/// A context's block entries by hash, in [`SHARDS`] tables: a table that doubles holds its old
/// allocation and the new one until its entries have moved, and in shards that is one
/// sixteenth of the index, not all of it (see [`Index::bytes`]).
#[derive(Default)]
struct Blocks {
    maps: [BlockMap; SHARDS],
    /// What each shard was last counted at ([`table_charge`]).
    counted: [Charge; SHARDS],
}

/// A block table's memory as [`Index::bytes`] counts it.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
struct Charge {
    /// What the table holds, or will once it doubles.
    bytes: usize,
    /// The allocation a doubling would hold besides (0: the table cannot double at its next
    /// store).
    doubling: usize,
}

/// The shard of block `h`: a mix of all its bits, apart from the low bits hashbrown takes
/// buckets from and the top seven it takes tags from.
fn shard_of(h: u64) -> usize {
    (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize % SHARDS
}

impl Blocks {
    fn map(&self, h: u64) -> &BlockMap {
        &self.maps[shard_of(h)]
    }

    fn map_mut(&mut self, h: u64) -> &mut BlockMap {
        &mut self.maps[shard_of(h)]
    }

    fn get(&self, h: &u64) -> Option<&Entry> {
        self.map(*h).get(h)
    }

    fn get_mut(&mut self, h: &u64) -> Option<&mut Entry> {
        self.map_mut(*h).get_mut(h)
    }

    fn contains_key(&self, h: &u64) -> bool {
        self.map(*h).contains_key(h)
    }

    fn remove(&mut self, h: &u64) -> Option<Entry> {
        self.map_mut(*h).remove(h)
    }

    fn len(&self) -> usize {
        self.maps.iter().map(BlockMap::len).sum()
    }

    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &Entry> {
        self.maps.iter().flat_map(BlockMap::values)
    }
}

/// A context's owners, sorted by id, with what a query reports of each: its last phase reads
/// this one array, not a map and then the owner table (at 8,000 owners that took half of a
/// 256-block walk).
#[derive(Default)]
struct Members(Vec<Member>);

#[derive(Clone, Copy)]
struct Member {
    owner: OwnerId,
    instance: u32,
    dp_rank: u32,
    shared: bool,
    /// The owner's local non-GPU blocks in the context.
    cold: u64,
}

impl Members {
    fn find(&self, owner: OwnerId) -> Result<usize, usize> {
        self.0.binary_search_by_key(&owner, |m| m.owner)
    }

    /// `member`'s block count, made 0 if it was not a member.
    fn join(&mut self, member: Member) -> &mut u64 {
        let at = match self.find(member.owner) {
            Ok(at) => at,
            Err(at) => {
                self.0.insert(at, member);
                at
            }
        };
        &mut self.0[at].cold
    }

    fn get_mut(&mut self, owner: &OwnerId) -> Option<&mut u64> {
        let at = self.find(*owner).ok()?;
        Some(&mut self.0[at].cold)
    }

    fn remove(&mut self, owner: &OwnerId) {
        if let Ok(at) = self.find(*owner) {
            self.0.remove(at);
        }
    }

    fn keys(&self) -> impl Iterator<Item = &OwnerId> {
        self.0.iter().map(|m| &m.owner)
    }
}

struct Owner {
    key: OwnerKey,
    /// The number of `key.instance` (see [`Index::instance_name`]).
    instance: u32,
    shared: bool,
    /// Contexts the owner stored in.
    contexts: Vec<CtxId>,
}

/// How far one owner can serve a prompt, in blocks (cumulative: `gpu <= cpu <= disk`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OwnerMatch {
    pub owner: OwnerKey,
    pub gpu: usize,
    pub cpu: usize,
    pub disk: usize,
}

/// [`OwnerMatch`] by ids, as [`Index::query_raw`] answers without allocating per owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawMatch {
    pub owner: OwnerId,
    /// The owner's instance number ([`Index::instance_name`]).
    pub instance: u32,
    pub dp_rank: u32,
    pub gpu: u32,
    pub cpu: u32,
    pub disk: u32,
}

/// Figures for `/metrics` and `/global_view`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IndexStats {
    pub contexts: usize,
    pub owners: usize,
    pub entries: usize,
    pub evicted: u64,
    /// [`Index::bytes`].
    pub bytes: usize,
    /// [`Bounds::bytes_max`].
    pub bytes_max: usize,
}

/// How much an [`Index`] may hold; past either bound the least recently used entries go.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub entries_max: usize,
    /// The index's own memory: its block tables, the entries' owner sets and memos, and the
    /// LRU queue (see [`Index::bytes`]).
    pub bytes_max: usize,
}

impl Bounds {
    /// At most `entries_max` entries, in any amount of memory.
    pub fn entries(entries_max: usize) -> Bounds {
        Bounds { entries_max, bytes_max: usize::MAX }
    }
}

pub struct Index {
    bounds: Bounds,
    contexts: Vec<Context>,
    context_ids: HashMap<ContextKey, CtxId>,
    owners: Vec<Option<Owner>>,
    owner_ids: HashMap<OwnerKey, OwnerId>,
    /// Instance names by number (every name an owner ever had; never shrinks).
    instance_names: Vec<String>,
    instance_ids: HashMap<String, u32>,
    entries: usize,
    /// The block tables' memory as counted ([`table_charge`]), summed over contexts' shards.
    tables_bytes: usize,
    /// The allocations of the tables that may double at their next store, with how many there
    /// are of each: the largest is what a doubling holds besides ([`Index::bytes`]).
    doubling: std::collections::BTreeMap<usize, u32>,
    /// The entries' heap memory ([`Entry::heap_bytes`]), summed.
    heap_bytes: usize,
    clock: u64,
    /// (stamp, context, hash), one live record per entry, in the order they were made or last
    /// requeued (see `bound`); a record is stale when its entry's `queued` moved on.
    lru: VecDeque<LruRecord>,
    evicted: u64,
    /// The last [`Entry::gpu_version`] handed out.
    versions: u64,
}

/// A block table's buckets (a power of two; 0 before its first insert).
fn table_buckets(blocks: &BlockMap) -> usize {
    // buckets x (slot + control byte) + a group of control bytes and alignment (< a slot).
    blocks.allocation_size() / (size_of::<(u64, Entry)>() + 1)
}

/// How many entries hashbrown keeps in `buckets` (7/8 of them; all but one under 8).
fn full_capacity(buckets: usize) -> usize {
    if buckets < 8 { buckets.saturating_sub(1) } else { buckets / 8 * 7 }
}

/// The memory a block table holding `len` entries is counted at: its allocation, or, once the
/// next new entry could double it, twice that and its allocation again while it doubles.
/// hashbrown doubles a table whose free slots are used up when the entry would take it past
/// half its capacity (below that it rehashes in place), and under churn removals leave
/// markers that use slots up long before the table is full; doubling, it holds the old table
/// and the new one until the entries have moved (and the allocator keeps the freed one
/// mapped). Only one table doubles at a time, so [`Index::bytes`] adds the largest `doubling`.
fn table_charge(blocks: &BlockMap, len: usize) -> Charge {
    let a = blocks.allocation_size();
    if a > 0 && len + 1 > full_capacity(table_buckets(blocks)) / 2 {
        Charge { bytes: 2 * a, doubling: a }
    } else {
        Charge { bytes: a, doubling: 0 }
    }
}

/// (stamp, context, hash): see `Index::lru`.
type LruRecord = (u64, CtxId, u64);

/// The owners holding one block on one medium: a sorted list while few, a bitset over owner
/// ids once the list would take more memory than the bitset (so a block every instance holds
/// costs one bit per owner, and a query intersects 64 owners per instruction).
#[derive(Debug, Clone)]
enum OwnerSet {
    Few(Vec<OwnerId>),
    Many { words: Vec<u64>, len: usize },
}

impl Default for OwnerSet {
    fn default() -> Self {
        OwnerSet::Few(Vec::new())
    }
}

impl OwnerSet {
    fn len(&self) -> usize {
        match self {
            OwnerSet::Few(v) => v.len(),
            OwnerSet::Many { len, .. } => *len,
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn heap_bytes(&self) -> usize {
        match self {
            OwnerSet::Few(v) => v.capacity() * size_of::<OwnerId>(),
            OwnerSet::Many { words, .. } => words.capacity() * size_of::<u64>(),
        }
    }

    fn contains(&self, id: OwnerId) -> bool {
        match self {
            OwnerSet::Few(v) => v.binary_search(&id).is_ok(),
            OwnerSet::Many { words, .. } => {
                words.get(id as usize / 64).is_some_and(|w| w >> (id % 64) & 1 == 1)
            }
        }
    }

    /// Adds `id`; false if it was there.
    fn insert(&mut self, id: OwnerId) -> bool {
        match self {
            OwnerSet::Few(v) => {
                let Err(at) = v.binary_search(&id) else { return false };
                v.insert(at, id);
                // A bitset up to the largest id takes (max/64 + 1) words of 8 bytes.
                let words = v.last().map_or(0, |&m| m as usize / 64 + 1);
                if v.len() > 16 && v.len() * 4 > words * 8 {
                    let mut bits = vec![0u64; words];
                    for &o in v.iter() {
                        bits[o as usize / 64] |= 1 << (o % 64);
                    }
                    *self = OwnerSet::Many { len: v.len(), words: bits };
                }
                true
            }
            OwnerSet::Many { words, len } => {
                let w = id as usize / 64;
                if w >= words.len() {
                    // Grown a cache line at a time, not doubled: owners mostly join in id
                    // order, and a doubled bitset of thousands of owners is a third empty.
                    words.reserve_exact((w + 1).next_multiple_of(8) - words.len());
                    words.resize(w + 1, 0);
                }
                let bit = 1u64 << (id % 64);
                if words[w] & bit != 0 {
                    return false;
                }
                words[w] |= bit;
                *len += 1;
                true
            }
        }
    }

    /// Removes `id`; false if it was not there.
    fn remove(&mut self, id: OwnerId) -> bool {
        match self {
            OwnerSet::Few(v) => match v.binary_search(&id) {
                Ok(at) => {
                    v.remove(at);
                    true
                }
                Err(_) => false,
            },
            OwnerSet::Many { words, len } => {
                let w = id as usize / 64;
                let bit = 1u64 << (id % 64);
                if words.get(w).is_none_or(|x| x & bit == 0) {
                    return false;
                }
                words[w] &= !bit;
                *len -= 1;
                // Back to a list well below the switch point (hysteresis).
                if *len * 4 * 4 < words.len() * 8 {
                    *self = OwnerSet::Few(self.iter().collect());
                }
                true
            }
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = OwnerId> + '_> {
        match self {
            OwnerSet::Few(v) => Box::new(v.iter().copied()),
            OwnerSet::Many { words, .. } => Box::new(bits(words)),
        }
    }

    /// ORs the set into `dst` (a bitset at least as long as the largest id needs).
    fn or_into(&self, dst: &mut [u64]) {
        match self {
            OwnerSet::Few(v) => {
                for &o in v {
                    if let Some(w) = dst.get_mut(o as usize / 64) {
                        *w |= 1 << (o % 64);
                    }
                }
            }
            OwnerSet::Many { words, .. } => {
                for (d, w) in dst.iter_mut().zip(words) {
                    *d |= w;
                }
            }
        }
    }
}

/// The ids of the set bits of `words`, in order.
fn bits(words: &[u64]) -> impl Iterator<Item = OwnerId> + '_ {
    words.iter().enumerate().flat_map(|(i, &w)| {
        let mut w = w;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let b = w.trailing_zeros();
            w &= w - 1;
            Some(i as OwnerId * 64 + b)
        })
    })
}

/// A fresh [`Entry::gpu_version`] from the index's counter.
fn next_version(versions: &mut u64) -> u64 {
    *versions += 1;
    *versions
}

/// The owners in `before` and not in `here`, into `reuse`'s room; `None` past [`DROPS_MAX`].
fn drops_between(
    before: &OwnerSet,
    here: &OwnerSet,
    reuse: Option<Vec<OwnerId>>,
) -> Option<Vec<OwnerId>> {
    let mut out = reuse.unwrap_or_default();
    out.clear();
    let mut add = |o: OwnerId| {
        if out.len() == DROPS_MAX {
            return false;
        }
        out.push(o);
        true
    };
    match (before, here) {
        (OwnerSet::Many { words: b, .. }, OwnerSet::Many { words: h, .. }) => {
            for (w, &bw) in b.iter().enumerate() {
                let mut gone = bw & !h.get(w).copied().unwrap_or(0);
                while gone != 0 {
                    if !add(w as OwnerId * 64 + gone.trailing_zeros()) {
                        return None;
                    }
                    gone &= gone - 1;
                }
            }
        }
        _ => {
            for o in before.iter() {
                if !here.contains(o) && !add(o) {
                    return None;
                }
            }
        }
    }
    Some(out)
}

/// `alive &= set` over the words `lo..hi` (outside them `alive` is zero), recording in `gpu`
/// that every owner whose bit drops matched `i` blocks. `next` is scratch of `alive`'s length.
fn intersect(
    alive: &mut [u64],
    next: &mut [u64],
    lo: usize,
    hi: usize,
    set: &OwnerSet,
    i: usize,
    gpu: &mut [u32],
) {
    let mut drop = |w: usize, gone: u64| {
        for o in bits(std::slice::from_ref(&gone)) {
            gpu[w * 64 + o as usize] = i as u32;
        }
    };
    match set {
        OwnerSet::Many { words: set, .. } => {
            // Owners past the end of the set's words hold nothing here.
            let end = hi.min(set.len()).max(lo);
            for (w, a) in alive.iter_mut().enumerate().take(hi).skip(end) {
                if *a != 0 {
                    drop(w, *a);
                    *a = 0;
                }
            }
            // Eight words at a time: whether any owner drops is one OR of and-nots the
            // compiler vectorises; the words are visited one by one only where one does.
            let chunks = alive[lo..end].chunks_mut(8).zip(set[lo..end].chunks(8));
            for (c, (a8, s8)) in chunks.enumerate() {
                let gone = a8.iter().zip(s8).fold(0, |g, (a, s)| g | (a & !s));
                if gone == 0 {
                    continue;
                }
                for (k, (a, s)) in a8.iter_mut().zip(s8).enumerate() {
                    if *a & !s != 0 {
                        drop(lo + c * 8 + k, *a & !s);
                        *a &= s;
                    }
                }
            }
        }
        OwnerSet::Few(list) => {
            next[lo..hi].fill(0);
            for &o in list {
                let w = o as usize / 64;
                if (lo..hi).contains(&w) {
                    next[w] |= alive[w] & (1 << (o % 64));
                }
            }
            for w in lo..hi {
                if next[w] != alive[w] {
                    drop(w, alive[w] & !next[w]);
                    alive[w] = next[w];
                }
            }
        }
    }
}

/// The GPU phase of a query's walk: the owners still matching (a bitset, zero outside the
/// words `lo..hi`) and, per owner, the block count it matched once it dropped.
struct GpuWalk {
    alive: Vec<u64>,
    next: Vec<u64>,
    lo: usize,
    hi: usize,
    gpu: Vec<u32>,
    /// Capacity of the spilled memos the walk dropped and made, in bytes (for
    /// [`Index::bytes`]).
    spills_freed: usize,
    spills_made: usize,
}

impl GpuWalk {
    fn new(owners: usize) -> GpuWalk {
        let words = owners.div_ceil(64);
        GpuWalk {
            alive: vec![0; words],
            next: vec![0; words],
            lo: 0,
            hi: 0,
            gpu: vec![0; owners],
            spills_freed: 0,
            spills_made: 0,
        }
    }

    /// The first block: its GPU owners are the ones matching.
    fn start(&mut self, set: &OwnerSet) {
        set.or_into(&mut self.alive);
        self.hi = self.alive.len();
        self.shrink();
    }

    /// Block `i` of `found`, whose memo read in the lookups was `memo` and GPU versions
    /// (this block's and the one before) `versions`: the owners that drop are the ones the
    /// memo lists (see [`DropMemo`]), else the bitset is ANDed with the block's GPU owners.
    fn step(&mut self, found: &[&Entry], i: usize, memo: DropMemo, versions: (u64, u64)) {
        if self.lo >= self.hi {
            return;
        }
        let (before_version, version) = versions;
        let here = found[i];
        let memo = if memo.before_version == before_version && memo.version == version {
            memo
        } else {
            let spill = here.spilled.take();
            self.spills_freed += spill_bytes(&spill);
            let mut m = DropMemo { before_version, version, ..DropMemo::default() };
            match drops_between(&found[i - 1].local[0], &here.local[0], spill.map(|b| *b)) {
                Some(owners) if owners.len() <= DROPS_INLINE => {
                    m.count = owners.len() as u32;
                    m.owners[..owners.len()].copy_from_slice(&owners);
                }
                Some(owners) => {
                    m.count = owners.len() as u32;
                    let owners = Some(Box::new(owners));
                    self.spills_made += spill_bytes(&owners);
                    here.spilled.set(owners);
                }
                None => m.count = DROPS_MANY,
            }
            here.drops.set(m);
            m
        };
        match memo.count as usize {
            n if n <= DROPS_INLINE => self.drop_owners(&memo.owners[..n], i),
            n if n <= DROPS_MAX => {
                let owners = here.spilled.take();
                self.drop_owners(owners.as_deref().map_or(&[], |v| &v[..]), i);
                here.spilled.set(owners);
            }
            _ => intersect(
                &mut self.alive,
                &mut self.next,
                self.lo,
                self.hi,
                &here.local[0],
                i,
                &mut self.gpu,
            ),
        }
        self.shrink();
    }

    /// `alive` is within the owners of the block before, so taking out the ones that drop at
    /// block `i` is intersecting it with this block's owners.
    fn drop_owners(&mut self, owners: &[OwnerId], i: usize) {
        for &o in owners {
            let (w, bit) = (o as usize / 64, 1u64 << (o % 64));
            if self.alive[w] & bit != 0 {
                self.alive[w] &= !bit;
                self.gpu[o as usize] = i as u32;
            }
        }
    }

    fn shrink(&mut self) {
        while self.lo < self.hi && self.alive[self.lo] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.alive[self.hi - 1] == 0 {
            self.hi -= 1;
        }
    }

    /// The owners still matching after all `n` blocks matched them all; each owner's count.
    fn finish(mut self, n: usize) -> Vec<u32> {
        for o in bits(&self.alive[self.lo..self.hi]) {
            self.gpu[self.lo * 64 + o as usize] = n as u32;
        }
        self.gpu
    }
}

impl Index {
    pub fn new(bounds: Bounds) -> Index {
        Index {
            bounds: Bounds { entries_max: bounds.entries_max.max(1), ..bounds },
            contexts: Vec::new(),
            context_ids: HashMap::new(),
            owners: Vec::new(),
            owner_ids: HashMap::new(),
            instance_names: Vec::new(),
            instance_ids: HashMap::new(),
            entries: 0,
            tables_bytes: 0,
            doubling: Default::default(),
            heap_bytes: 0,
            clock: 0,
            lru: VecDeque::new(),
            evicted: 0,
            versions: 0,
        }
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            contexts: self.contexts.len(),
            owners: self.owner_ids.len(),
            entries: self.entries,
            evicted: self.evicted,
            bytes: self.bytes(),
            bytes_max: self.bounds.bytes_max,
        }
    }

    /// The id of an owner, made on first use. `shared` marks a pool (every instance can load
    /// its blocks); it is fixed when the owner is first made.
    pub fn owner(&mut self, key: &OwnerKey, shared: bool) -> OwnerId {
        if let Some(&id) = self.owner_ids.get(key) {
            return id;
        }
        let id = self.owners.len() as OwnerId;
        let instance = match self.instance_ids.get(&key.instance) {
            Some(&n) => n,
            None => {
                let n = self.instance_names.len() as u32;
                self.instance_names.push(key.instance.clone());
                self.instance_ids.insert(key.instance.clone(), n);
                n
            }
        };
        self.owners.push(Some(Owner { key: key.clone(), instance, shared, contexts: Vec::new() }));
        self.owner_ids.insert(key.clone(), id);
        id
    }

    fn context(&mut self, key: &ContextKey) -> CtxId {
        if let Some(&id) = self.context_ids.get(key) {
            return id;
        }
        let id = self.contexts.len() as CtxId;
        self.contexts.push(Context {
            key: key.clone(),
            blocks: Blocks::default(),
            owners: Members::default(),
        });
        self.context_ids.insert(key.clone(), id);
        id
    }

    /// Makes `owner` a member of `ctx` (a registration names its model and block size before
    /// any event), so a query reports what the shared holders give it even before it stored.
    pub fn join(&mut self, owner: OwnerId, ctx: &ContextKey) -> CtxId {
        let c = self.context(ctx);
        if let Some(o) = self.owners.get_mut(owner as usize).and_then(Option::as_mut) {
            if !o.contexts.contains(&c) {
                o.contexts.push(c);
            }
            self.contexts[c as usize].owners.join(Member {
                owner,
                instance: o.instance,
                dp_rank: o.key.dp_rank,
                shared: o.shared,
                cold: 0,
            });
        }
        c
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Applies one event of `owner` whose blocks belong to `ctx` (for stores; removals and
    /// clears apply to every context the owner stored in).
    pub fn apply(&mut self, owner: OwnerId, ctx: &ContextKey, event: &Event) {
        let now = self.tick();
        let Some(shared) =
            self.owners.get(owner as usize).and_then(Option::as_ref).map(|o| o.shared)
        else {
            return;
        };
        // A pool has no GPU: what it calls GPU memory serves others as host memory.
        let held_on = |m: Medium| if shared && m == Medium::Gpu { Medium::Cpu } else { m };
        match event {
            Event::Stored { hashes, medium, .. } => {
                let medium = held_on(*medium);
                let c = self.join(owner, ctx);
                // Found once (eviction changes members' counts, never their places).
                let member = self.contexts[c as usize].owners.find(owner).ok();
                for &h in hashes {
                    self.room_for(c, h);
                    let cx = &mut self.contexts[c as usize];
                    let mut made = false;
                    let e = cx.blocks.map_mut(h).entry(h).or_insert_with(|| {
                        made = true;
                        self.entries += 1;
                        self.lru.push_back((now, c, h));
                        Entry::new(now)
                    });
                    if shared {
                        let before = e.heap_bytes();
                        let sets = e.shared.get_or_insert_with(Default::default);
                        if sets[medium.index()].insert(owner) {
                            e.shared_changed();
                        }
                        self.heap_bytes = self.heap_bytes + e.heap_bytes() - before;
                    } else {
                        let set = &mut e.local[medium.index()];
                        let before = set.heap_bytes();
                        if set.insert(owner) {
                            self.heap_bytes = self.heap_bytes + set.heap_bytes() - before;
                            if medium == Medium::Gpu {
                                e.gpu_version = next_version(&mut self.versions);
                            } else if let Some(at) = member {
                                cx.owners.0[at].cold += 1;
                            }
                        }
                    }
                    e.stamp.set(now);
                    if made {
                        self.recount(c, shard_of(h));
                    }
                }
                self.bound();
            }
            Event::Removed { hashes, medium } => {
                let medium = held_on(*medium);
                let ctxs = self.owners[owner as usize]
                    .as_ref()
                    .map(|o| o.contexts.clone())
                    .unwrap_or_default();
                for c in ctxs {
                    for &h in hashes {
                        self.drop_holding(c, h, owner, shared, Some(medium));
                    }
                }
            }
            Event::Cleared => self.clear_owner(owner),
        }
    }

    /// Removes `owner`'s holding of block `h` in context `c` (on `medium`, or every medium).
    fn drop_holding(
        &mut self,
        c: CtxId,
        h: u64,
        owner: OwnerId,
        shared: bool,
        medium: Option<Medium>,
    ) {
        let cx = &mut self.contexts[c as usize];
        let Some(e) = cx.blocks.get_mut(&h) else { return };
        let before = e.heap_bytes();
        for m in Medium::ALL {
            if medium.is_some_and(|x| x != m) {
                continue;
            }
            if !e.holders_mut(shared, m.index()).is_some_and(|l| l.remove(owner)) {
                continue;
            }
            if shared {
                e.shared_changed();
                continue;
            }
            if m == Medium::Gpu {
                e.gpu_version = next_version(&mut self.versions);
            } else if let Some(n) = cx.owners.get_mut(&owner) {
                *n = n.saturating_sub(1);
            }
        }
        if e.is_empty() {
            cx.blocks.remove(&h);
            self.entries -= 1;
            self.heap_bytes -= before;
            self.shrink_table(c, shard_of(h));
        } else {
            self.heap_bytes = self.heap_bytes + e.heap_bytes() - before;
        }
    }

    /// Forgets every block of `owner` (its engine restarted, cleared its cache, or lost events
    /// that cannot be replayed).
    pub fn clear_owner(&mut self, owner: OwnerId) {
        let Some(o) = self.owners.get(owner as usize).and_then(Option::as_ref) else { return };
        let (shared, ctxs) = (o.shared, o.contexts.clone());
        for c in ctxs {
            let cx = &mut self.contexts[c as usize];
            let before = cx.blocks.len();
            let versions = &mut self.versions;
            let heap = &mut self.heap_bytes;
            let mut retain = |_: &u64, e: &mut Entry| {
                *heap -= e.heap_bytes();
                for m in 0..3 {
                    let removed = e.holders_mut(shared, m).is_some_and(|l| l.remove(owner));
                    if removed && !shared && m == 0 {
                        e.gpu_version = next_version(versions);
                    }
                }
                if shared {
                    e.shared_changed();
                }
                if e.is_empty() {
                    return false;
                }
                *heap += e.heap_bytes();
                true
            };
            for map in &mut cx.blocks.maps {
                map.retain(&mut retain);
            }
            self.entries -= before - cx.blocks.len();
            if let Some(n) = cx.owners.get_mut(&owner) {
                *n = 0;
            }
            for s in 0..SHARDS {
                self.shrink_table(c, s);
            }
        }
    }

    /// Forgets `owner` entirely (unregistered or expired).
    pub fn remove_owner(&mut self, owner: OwnerId) {
        self.clear_owner(owner);
        if let Some(o) = self.owners.get_mut(owner as usize).and_then(Option::take) {
            for c in &o.contexts {
                self.contexts[*c as usize].owners.remove(&owner);
            }
            self.owner_ids.remove(&o.key);
        }
    }

    /// The memory the index counts against [`Bounds::bytes_max`]: its block tables (their
    /// allocations, slots and control bytes, at whatever load they are; a table that may
    /// double at twice its size, and the largest of those once more, see [`table_charge`]),
    /// the entries' owner sets and spilled memos (their capacity), and the LRU queue's
    /// capacity. Not counted:
    /// the owner and context tables (a few hundred bytes per owner and context, which
    /// registrations and not events create) and the allocator's own overhead.
    pub fn bytes(&self) -> usize {
        self.tables_bytes
            + self.doubling_max()
            + self.heap_bytes
            + self.lru.capacity() * size_of::<LruRecord>()
    }

    /// The largest allocation a doubling may hold besides its new one (0: none).
    fn doubling_max(&self) -> usize {
        self.doubling.last_key_value().map_or(0, |(&a, _)| a)
    }

    fn over(&self) -> bool {
        self.entries > self.bounds.entries_max || self.bytes() > self.bounds.bytes_max
    }

    /// Counts shard `s` of context `c` again after it changed.
    fn recount(&mut self, c: CtxId, s: usize) {
        let blocks = &mut self.contexts[c as usize].blocks;
        let now = table_charge(&blocks.maps[s], blocks.maps[s].len());
        let was = std::mem::replace(&mut blocks.counted[s], now);
        if now == was {
            return;
        }
        self.tables_bytes = self.tables_bytes + now.bytes - was.bytes;
        if was.doubling > 0
            && let Some(n) = self.doubling.get_mut(&was.doubling)
        {
            *n -= 1;
            if *n == 0 {
                self.doubling.remove(&was.doubling);
            }
        }
        if now.doubling > 0 {
            *self.doubling.entry(now.doubling).or_default() += 1;
        }
    }

    /// Gives back a shard's memory once it is under a quarter full (an engine cleared its
    /// cache, or eviction took most of a context): shrunk to fit, it is at least 7/16 full,
    /// so growing and shrinking cannot alternate.
    fn shrink_table(&mut self, c: CtxId, s: usize) {
        let map = &mut self.contexts[c as usize].blocks.maps[s];
        let buckets = table_buckets(map);
        if buckets > 64 && map.len() < full_capacity(buckets) / 4 {
            map.shrink_to_fit();
        }
        self.recount(c, s);
    }

    /// Before block `h` goes into context `c`: where the store would let the table double
    /// (see [`table_charge`]) past the byte bound, evicts least recently used entries until
    /// it would not or the bound takes the doubled table. Evicting after the store could not
    /// undo a doubling: the table keeps its buckets, so only emptying it to a quarter (and
    /// shrinking it) would meet the bound again.
    fn room_for(&mut self, c: CtxId, h: u64) {
        if self.bounds.bytes_max == usize::MAX {
            return;
        }
        let (s, mut held) = (shard_of(h), None);
        loop {
            let blocks = &self.contexts[c as usize].blocks;
            let (map, was) = (&blocks.maps[s], blocks.counted[s]);
            let grown = table_charge(map, map.len() + 1);
            // The same count as now: fine while the index is within its bound (a store can
            // double a table counted so already; after that, until evictions, it is over).
            if grown == was && self.bytes() <= self.bounds.bytes_max {
                return;
            }
            let doubling = self.doubling_max();
            if self.bytes() - was.bytes + grown.bytes - doubling + doubling.max(grown.doubling)
                <= self.bounds.bytes_max
                || *held.get_or_insert_with(|| map.contains_key(&h))
                || !self.evict_one()
            {
                return;
            }
        }
    }

    /// Drops the least recently used entries while over the bound.
    fn bound(&mut self) {
        while self.over() {
            if !self.evict_one() {
                // Nothing left to evict: what is over is the queue's own room.
                self.lru.shrink_to_fit();
                break;
            }
        }
        // Records of removed entries pile up under churn: past twice the live, drop them.
        if self.lru.len() > 2 * self.entries + 1024 {
            let contexts = &self.contexts;
            self.lru.retain(|&(stamp, c, h)| {
                contexts[c as usize].blocks.get(&h).is_some_and(|e| e.queued == stamp)
            });
            if self.lru.capacity() > 4 * self.lru.len() + 1024 {
                self.lru.shrink_to(2 * self.lru.len() + 1024);
            }
        }
    }

    /// Evicts the least recently used entry (a used one gets a second chance); false when the
    /// queue is empty.
    fn evict_one(&mut self) -> bool {
        loop {
            let Some((stamp, c, h)) = self.lru.pop_front() else { return false };
            let cx = &mut self.contexts[c as usize];
            let Some(e) = cx.blocks.get_mut(&h) else { continue };
            if e.queued != stamp {
                continue;
            }
            // Used since it was queued: a second chance at the back (CLOCK), so a query
            // stamps the entries it reads and queues nothing.
            if e.stamp.get() > stamp {
                e.queued = e.stamp.get();
                self.lru.push_back((e.queued, c, h));
                continue;
            }
            if let Some(e) = cx.blocks.remove(&h) {
                for m in 1..3 {
                    for o in e.local[m].iter() {
                        if let Some(n) = cx.owners.get_mut(&o) {
                            *n = n.saturating_sub(1);
                        }
                    }
                }
                self.entries -= 1;
                self.evicted += 1;
                self.heap_bytes -= e.heap_bytes();
                self.shrink_table(c, shard_of(h));
            }
            return true;
        }
    }

    /// The contexts known, with their owners (for `/global_view`).
    pub fn contexts(&self) -> Vec<(ContextKey, usize, Vec<OwnerKey>)> {
        self.contexts
            .iter()
            .map(|cx| {
                let mut owners: Vec<OwnerKey> = cx
                    .owners
                    .keys()
                    .filter_map(|&o| self.owners.get(o as usize)?.as_ref().map(|o| o.key.clone()))
                    .collect();
                owners.sort();
                (cx.key.clone(), cx.blocks.len(), owners)
            })
            .collect()
    }

    /// The name of instance number `n` (of [`RawMatch::instance`]).
    pub fn instance_name(&self, n: u32) -> &str {
        &self.instance_names[n as usize]
    }

    /// How many instance numbers there are (all below this).
    pub fn instance_count(&self) -> usize {
        self.instance_names.len()
    }

    /// How far each owner of `ctx` can serve the blocks `hashes` (in chain order), sorted by
    /// owner; owners with nothing to offer are left out. Marks the matched entries as
    /// recently used.
    pub fn query(&mut self, ctx: &ContextKey, hashes: &[u64]) -> Vec<OwnerMatch> {
        let mut raw = Vec::new();
        self.query_raw(ctx, hashes, &mut raw);
        let mut out: Vec<OwnerMatch> = raw
            .iter()
            .filter_map(|m| {
                let o = self.owners.get(m.owner as usize)?.as_ref()?;
                Some(OwnerMatch {
                    owner: o.key.clone(),
                    gpu: m.gpu as usize,
                    cpu: m.cpu as usize,
                    disk: m.disk as usize,
                })
            })
            .collect();
        out.sort_by(|a, b| a.owner.cmp(&b.owner));
        out
    }

    /// Whether the context holds the block `hash` (any owner, any medium). A token query
    /// hashes its prompt in runs and stops after a run whose last block nobody holds: the
    /// walk cannot reach past it.
    pub fn holds(&self, ctx: &ContextKey, hash: u64) -> bool {
        self.context_ids
            .get(ctx)
            .is_some_and(|&c| self.contexts[c as usize].blocks.contains_key(&hash))
    }

    /// [`Index::query`] into `out` (cleared first), by ids and in no particular order: the
    /// hot path of `/query`, with no allocation per owner.
    pub fn query_raw(&mut self, ctx: &ContextKey, hashes: &[u64], out: &mut Vec<RawMatch>) {
        out.clear();
        let Some(&c) = self.context_ids.get(ctx) else { return };
        let now = self.tick();
        let cx = &self.contexts[c as usize];
        // The lookups first, alone in their loop so they overlap (with the walk's work
        // between them they measured 15% slower at 8,192 blocks, and with the memo inline
        // still 311-318 us against 220-224); then the GPU phase, a walk over a bitset of the
        // owners still matching (an owner whose bit drops at block i matched i blocks; see
        // `GpuWalk`). What the walk reads of each entry is copied out in the lookups, from the
        // line they brought in, so the walk reads entries again only where owners drop beyond
        // a memo's inline room or memos are stale.
        let mut found: Vec<&Entry> = Vec::with_capacity(hashes.len());
        let mut best: Vec<u8> = Vec::with_capacity(hashes.len());
        let mut memos: Vec<(DropMemo, u64)> = Vec::with_capacity(hashes.len());
        let mut walk = GpuWalk::new(self.owners.len());
        for h in hashes {
            let Some(e) = cx.blocks.get(h) else { break };
            e.stamp.set(now);
            best.push(e.shared_best);
            memos.push((e.drops.get(), e.gpu_version));
            found.push(e);
        }
        for (i, e) in found.iter().enumerate() {
            match i {
                0 => walk.start(&e.local[0]),
                _ => walk.step(&found, i, memos[i].0, (memos[i - 1].1, memos[i].1)),
            }
        }
        let n = found.len();
        let spills = (walk.spills_made, walk.spills_freed);
        let gpu = walk.finish(n);
        // run[m][i]: the first block at or after i that no shared holder has on medium m or
        // faster (m = 1 cpu, 2 disk).
        let mut run = [vec![n; n + 1], vec![n; n + 1]];
        for i in (0..n).rev() {
            for (k, m) in [(0usize, 1u8), (1, 2)] {
                run[k][i] = if best[i] <= m { run[k][i + 1] } else { i };
            }
        }
        for &Member { owner: o, instance, dp_rank, shared, cold } in &cx.owners.0 {
            if shared {
                continue;
            }
            let g = gpu.get(o as usize).copied().unwrap_or(0) as usize;
            let (cpu, disk) = if cold == 0 {
                let cpu = run[0][g];
                (cpu, run[1][cpu])
            } else {
                // The owner's own CPU/disk blocks count too: walk its later phases alone.
                let has = |i: usize, m: usize| {
                    best[i] as usize <= m || (1..=m).any(|k| found[i].local[k].contains(o))
                };
                let mut cpu = g;
                while cpu < n && has(cpu, 1) {
                    cpu += 1;
                }
                let mut disk = cpu;
                while disk < n && has(disk, 2) {
                    disk += 1;
                }
                (cpu, disk)
            };
            if disk > 0 {
                out.push(RawMatch {
                    owner: o,
                    instance,
                    dp_rank,
                    gpu: g as u32,
                    cpu: cpu as u32,
                    disk: disk as u32,
                });
            }
        }
        if spills != (0, 0) {
            self.heap_bytes = self.heap_bytes + spills.0 - spills.1;
            self.bound();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn ctx() -> ContextKey {
        ContextKey { tenant: "t".into(), model: "m".into(), lora: String::new(), block_size: 16 }
    }

    fn stored(hashes: &[u64], medium: Medium) -> Event {
        Event::Stored {
            token_ids: Vec::new(),
            hashes: hashes.to_vec(),
            parent: None,
            block_size: Some(16),
            medium,
            lora_name: None,
        }
    }

    fn key(i: &str, r: u32) -> OwnerKey {
        OwnerKey { instance: i.into(), dp_rank: r }
    }

    #[test]
    fn cursors_follow_gpu_then_pool_media() {
        let mut ix = Index::new(Bounds::entries(1000));
        let a = ix.owner(&key("a", 0), false);
        let b = ix.owner(&key("b", 1), false);
        let pool = ix.owner(&key("pool", 0), true);
        ix.apply(a, &ctx(), &stored(&[1, 2, 3], Medium::Gpu));
        ix.apply(b, &ctx(), &stored(&[1], Medium::Gpu));
        ix.apply(pool, &ctx(), &stored(&[1, 2, 3, 4], Medium::Cpu));
        ix.apply(pool, &ctx(), &stored(&[5], Medium::Disk));
        let r = ix.query(&ctx(), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(
            r,
            vec![
                OwnerMatch { owner: key("a", 0), gpu: 3, cpu: 4, disk: 5 },
                OwnerMatch { owner: key("b", 1), gpu: 1, cpu: 4, disk: 5 },
            ]
        );
        ix.apply(pool, &ctx(), &Event::Removed { hashes: vec![4], medium: Medium::Cpu });
        let r = ix.query(&ctx(), &[1, 2, 3, 4, 5]);
        assert_eq!(r[0], OwnerMatch { owner: key("a", 0), gpu: 3, cpu: 3, disk: 3 });
        ix.apply(a, &ctx(), &Event::Cleared);
        let r = ix.query(&ctx(), &[1, 2, 3]);
        assert_eq!(r[0], OwnerMatch { owner: key("a", 0), gpu: 0, cpu: 3, disk: 3 });
    }

    #[test]
    fn the_bound_drops_least_recently_used_entries() {
        let mut ix = Index::new(Bounds::entries(4));
        let a = ix.owner(&key("a", 0), false);
        ix.apply(a, &ctx(), &stored(&[1, 2, 3, 4], Medium::Gpu));
        ix.query(&ctx(), &[1, 2]);
        ix.apply(a, &ctx(), &stored(&[9, 10], Medium::Gpu));
        assert_eq!(ix.stats().entries, 4);
        assert_eq!(ix.stats().evicted, 2);
        assert_eq!(ix.query(&ctx(), &[1, 2, 3])[0].gpu, 2);
        assert_eq!(ix.query(&ctx(), &[9, 10])[0].gpu, 2);
    }

    /// [`Index::bytes`] counted from scratch: every table's allocation, every entry's heap.
    fn recount(ix: &Index) -> usize {
        let charges: Vec<Charge> = ix
            .contexts
            .iter()
            .flat_map(|cx| cx.blocks.maps.iter().map(|m| table_charge(m, m.len())))
            .collect();
        let tables = charges.iter().map(|c| c.bytes).sum::<usize>()
            + charges.iter().map(|c| c.doubling).max().unwrap_or(0);
        let heap: usize =
            ix.contexts.iter().flat_map(|cx| cx.blocks.values()).map(Entry::heap_bytes).sum();
        tables + heap + ix.lru.capacity() * size_of::<LruRecord>()
    }

    /// Stores, removals, clears and queries (with spilled memos: many owners dropping at one
    /// block) in two contexts, owner sets growing past the list-to-bitset switch and back.
    fn churn(ix: &mut Index, seed: u64, mut check: impl FnMut(&Index)) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let ctxs = [ctx(), ContextKey { block_size: 32, ..ctx() }];
        let owners: Vec<OwnerId> =
            (0..200).map(|i| ix.owner(&key(&format!("e{i}"), i % 4), i == 0)).collect();
        for step in 0..3000 {
            let o = owners[rng.random_range(0..owners.len())];
            let cx = &ctxs[rng.random_range(0..2)];
            let start = rng.random_range(0..2000u64);
            let hashes: Vec<u64> = (start..start + rng.random_range(1..64)).collect();
            match rng.random_range(0..10) {
                0..6 => {
                    let m = [Medium::Gpu, Medium::Cpu, Medium::Disk][rng.random_range(0..3)];
                    ix.apply(o, cx, &stored(&hashes, m));
                }
                6 | 7 => ix.apply(o, cx, &Event::Removed { hashes, medium: Medium::Gpu }),
                8 if step % 50 == 0 => ix.apply(o, cx, &Event::Cleared),
                8 => {
                    // Several owners whose prefixes end at one block: the query's memo of
                    // those that drop there spills out of the entry.
                    for k in 0..rng.random_range(3..12) {
                        ix.apply(owners[1 + (step + k) % 199], cx, &stored(&hashes, Medium::Gpu));
                    }
                    ix.query(cx, &(start..start + 100).collect::<Vec<u64>>());
                }
                _ => {
                    let from = rng.random_range(0..2000);
                    ix.query(cx, &(from..from + rng.random_range(1..2000)).collect::<Vec<u64>>());
                }
            }
            check(ix);
        }
    }

    #[test]
    fn the_byte_count_is_what_the_tables_and_entries_hold() {
        let mut ix = Index::new(Bounds::entries(1 << 20));
        churn(&mut ix, 7, |ix| assert_eq!(ix.bytes(), recount(ix)));
        assert!(ix.stats().entries > 1000, "the churn left {} entries", ix.stats().entries);
        assert_eq!(ix.stats().evicted, 0);
    }

    #[test]
    fn the_byte_bound_holds_after_every_event_and_query() {
        let bytes_max = 256 << 10;
        let mut ix = Index::new(Bounds { entries_max: 1 << 20, bytes_max });
        let mut peak = 0;
        churn(&mut ix, 11, |ix| {
            assert_eq!(ix.bytes(), recount(ix));
            assert!(ix.bytes() <= bytes_max, "{} bytes over a bound of {bytes_max}", ix.bytes());
            peak = peak.max(ix.bytes());
        });
        // The bound was what limited the index, and it did not empty it to get there.
        assert!(ix.stats().evicted > 0);
        assert!(peak > bytes_max / 2, "peak {peak} of {bytes_max}");
        assert!(ix.stats().entries > 100, "{} entries left", ix.stats().entries);
    }

    #[test]
    fn the_byte_bound_keeps_what_was_used_lately() {
        let mut ix = Index::new(Bounds { entries_max: 1 << 20, bytes_max: 128 << 10 });
        let a = ix.owner(&key("a", 0), false);
        ix.apply(a, &ctx(), &stored(&[1, 2, 3, 4], Medium::Gpu));
        for chunk in 0..400u64 {
            ix.apply(a, &ctx(), &stored(&[1000 + chunk * 4, 1001 + chunk * 4], Medium::Gpu));
            // Queried all along: the second chance keeps the prompt's blocks.
            ix.query(&ctx(), &[1, 2, 3, 4]);
        }
        assert!(ix.stats().evicted > 0, "the bound never bit");
        assert_eq!(ix.query(&ctx(), &[1, 2, 3, 4])[0].gpu, 4);
        assert_eq!(ix.query(&ctx(), &[1000, 1001]), vec![]);
    }

    #[test]
    fn a_table_at_the_byte_bound_evicts_rather_than_doubles() {
        // One owner, one small set a block: the table is most of the memory. The bound takes
        // 256 buckets doubling to 512 (both at once, 768), not 512 doubling to 1,024: the
        // table grows to 512 and stays there, as full as it can be without a store that
        // could double it (half of 448 entries, less one; 224 fill 256 buckets).
        let slot = size_of::<(u64, Entry)>() + 1;
        let bytes_max = 768 * slot + (64 << 10);
        let mut ix = Index::new(Bounds { entries_max: 1 << 20, bytes_max });
        let a = ix.owner(&key("a", 0), false);
        // Blocks of one shard: one table.
        let hashes: Vec<u64> = (0..).filter(|&h| shard_of(h) == 3).take(5000).collect();
        for (n, &h) in hashes.iter().enumerate() {
            ix.apply(a, &ctx(), &stored(&[h], Medium::Gpu));
            assert!(ix.bytes() <= bytes_max);
            assert_eq!(ix.bytes(), recount(&ix));
            let buckets = table_buckets(&ix.contexts[0].blocks.maps[3]);
            assert!(buckets.is_power_of_two() && buckets <= 512, "{buckets} buckets");
            if n >= 224 {
                assert_eq!(ix.stats().entries, 223, "after block {n}");
            }
        }
        assert_eq!(ix.query(&ctx(), &hashes[5000 - 223..])[0].gpu, 223);
    }

    /// Brute force: per owner, walk the blocks with set lookups.
    fn brute(
        held: &std::collections::BTreeMap<(u32, u64, usize), ()>,
        owners: &[(u32, bool)],
        q: &[u64],
    ) -> Vec<(u32, usize, usize, usize)> {
        let has = |o: u32, h: u64, m: usize| held.contains_key(&(o, h, m));
        let shared_at =
            |h: u64, m: usize| owners.iter().any(|&(o, s)| s && (0..=m).any(|k| has(o, h, k)));
        let mut out = Vec::new();
        for &(o, s) in owners {
            if s {
                continue;
            }
            let mut g = 0;
            while g < q.len() && has(o, q[g], 0) {
                g += 1;
            }
            let ok = |i: usize, m: usize| shared_at(q[i], m) || (1..=m).any(|k| has(o, q[i], k));
            let mut c = g;
            while c < q.len() && ok(c, 1) {
                c += 1;
            }
            let mut d = c;
            while d < q.len() && ok(d, 2) {
                d += 1;
            }
            if d > 0 {
                out.push((o, g, c, d));
            }
        }
        out
    }

    proptest! {
        #[test]
        fn owner_sets_behave_as_sets_in_both_forms(
            ops in proptest::collection::vec((any::<bool>(), 0u32..300), 1..800),
        ) {
            let mut set = OwnerSet::default();
            let mut model = std::collections::BTreeSet::new();
            let mut was_many = false;
            for (add, id) in ops {
                let changed = if add { set.insert(id) } else { set.remove(id) };
                let want = if add { model.insert(id) } else { model.remove(&id) };
                prop_assert_eq!(changed, want);
                was_many |= matches!(set, OwnerSet::Many { .. });
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                prop_assert!(model.iter().all(|&o| set.contains(o)));
            }
            let _ = was_many;
        }

        #[test]
        fn queries_with_many_owners_match_a_brute_force_walk(
            holds in proptest::collection::vec((0u32..1100, 0usize..12, 0usize..12), 1..1500),
            drops in proptest::collection::vec((0u32..1100, 0u64..12), 0..300),
        ) {
            // 1100 owners (18 words of bits: the walk's eight-word chunks, whole and partial)
            // each storing a random slice of one 12-block chain (so block sets are bitsets),
            // some blocks dropped again.
            let mut ix = Index::new(Bounds::entries(1 << 20));
            let ids: Vec<OwnerId> = (0..1100).map(|o| ix.owner(&key(&format!("i{o}"), 0), false)).collect();
            for &id in &ids {
                ix.join(id, &ctx());
            }
            let mut held = BTreeMap::new();
            for (o, a, b) in holds {
                let (a, b) = (a.min(b) as u64, a.max(b) as u64 + 1);
                let hs: Vec<u64> = (a..b).collect();
                for &h in &hs { held.insert((o, h, 0usize), ()); }
                ix.apply(ids[o as usize], &ctx(), &stored(&hs, Medium::Gpu));
            }
            let owners: Vec<(u32, bool)> = (0..1100).map(|o| (o, false)).collect();
            let q: Vec<u64> = (0..12).collect();
            let check = |ix: &mut Index, held: &BTreeMap<(u32, u64, usize), ()>| {
                let mut got: Vec<(u32, usize, usize, usize)> = ix.query(&ctx(), &q).into_iter()
                    .map(|m| (m.owner.instance[1..].parse().unwrap(), m.gpu, m.cpu, m.disk)).collect();
                got.sort();
                let mut want = brute(held, &owners, &q);
                // The index stops every cursor at the first block nobody holds.
                let stop = (0..q.len()).find(|&i| !held.keys().any(|&(_, h, _)| h == q[i])).unwrap_or(q.len());
                want.retain_mut(|w| { w.1 = w.1.min(stop); w.2 = w.2.min(stop); w.3 = w.3.min(stop); w.3 > 0 });
                want.sort();
                (got, want)
            };
            // Queried before the drops too, so the later queries meet the walk's memos of
            // sets that changed since (and of sets that did not).
            let (got, want) = check(&mut ix, &held);
            prop_assert_eq!(got, want);
            for part in drops.chunks(40) {
                for &(o, h) in part {
                    held.remove(&(o, h, 0usize));
                    ix.apply(ids[o as usize], &ctx(), &Event::Removed { hashes: vec![h], medium: Medium::Gpu });
                }
                let (got, want) = check(&mut ix, &held);
                prop_assert_eq!(got, want);
            }
        }

        #[test]
        fn queries_match_a_brute_force_walk(
            ops in proptest::collection::vec((0u32..5, 0u8..3, 0usize..3, proptest::collection::vec(0u64..12, 1..6)), 1..60),
            q in proptest::collection::vec(0u64..12, 0..10),
        ) {
            let mut ix = Index::new(Bounds::entries(1 << 20));
            let owners: Vec<(u32, bool)> = (0..5).map(|o| (o, o == 4)).collect();
            let ids: Vec<OwnerId> = owners.iter().map(|&(o, s)| ix.owner(&key(&format!("i{o}"), 0), s)).collect();
            for &id in &ids {
                ix.join(id, &ctx());
            }
            let mut held = BTreeMap::new();
            for (o, kind, m, hs) in ops {
                let medium = Medium::ALL[m];
                let shared = owners[o as usize].1;
                let eff = if shared && m == 0 { 1 } else { m };
                let ev = match kind {
                    0 | 1 => { for &h in &hs { held.insert((o, h, eff), ()); } stored(&hs, medium) }
                    _ => { for &h in &hs { held.remove(&(o, h, eff)); } Event::Removed { hashes: hs.clone(), medium } }
                };
                ix.apply(ids[o as usize], &ctx(), &ev);
                // After every event, so each query meets the memos the last one left. The
                // index stops at the first block nobody holds at all; so does the brute force
                // (every cursor stops there).
                let got: Vec<(u32, usize, usize, usize)> = ix.query(&ctx(), &q).into_iter()
                    .map(|m| (m.owner.instance[1..].parse().unwrap(), m.gpu, m.cpu, m.disk)).collect();
                let mut want = brute(&held, &owners, &q);
                want.sort();
                prop_assert_eq!(got, want);
            }
        }
    }
}
