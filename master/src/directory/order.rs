//! The ordered set of complete objects for listings: object ids sorted by key, without a
//! second copy of any key.
//!
//! Mechanism: a B+tree of two levels over `u32` ids. Leaves are sorted `Vec<u32>`s of at most
//! `LEAF_MAX` ids whose keys are read through the caller's `key_of` (the key arena); std's
//! `BTreeMap` indexes the leaves by a lower bound, a short byte string: every key of a leaf is
//! `>=` its bound and `<` the next leaf's bound, and the first leaf's bound is empty. A split
//! bounds the new right leaf by the shortest prefix of its first key that sorts above the
//! left leaf's last key (a few bytes past their common prefix); removals never invalidate a
//! bound, so bounds are never rewritten. A leaf under `LEAF_MAX / 4` ids merges into a
//! neighbour when both fit in one leaf; an insert at the end of a full leaf starts a new leaf
//! instead of halving it, so ascending inserts fill leaves completely.
//!
//! Cost: ~4 bytes per id at the leaves' fill (~70 % under random inserts) plus, per leaf, its
//! map entry and bound: ~8 bytes per key, against ~24 for a `BTreeSet<Arc<str>>` (which also
//! needs the key's shared allocation). A seek compares short bounds in the map, then binary
//! searches one leaf through `key_of`; iteration is a walk over leaves, no key is read.
//!
//! Invariants (checked by `check`): ids strictly increasing by key; each leaf within its
//! bounds; no empty leaf but the only one; `len` is the number of ids.

use std::collections::BTreeMap;
use std::ops::Bound;

const LEAF_MAX: usize = 64;
/// Heap bytes of one entry of std's `BTreeMap<Box<[u8]>, Vec<u32>>` (40-byte entries in
/// 456-byte nodes, ~70 % full, plus internal nodes and malloc's chunk header).
const MAP_BYTES_PER_LEAF: u64 = 72;

#[derive(Debug, Default)]
pub(super) struct KeyOrder {
    leaves: BTreeMap<Box<[u8]>, Vec<u32>>,
    len: usize,
    /// Heap bytes of the bounds (malloc chunks), for the memory estimate.
    bound_heap_bytes: u64,
}

impl KeyOrder {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Add `id`, whose key is `key`; `key_of` gives the key of every id already in the set.
    pub(super) fn insert<'k>(&mut self, id: u32, key: &[u8], key_of: impl Fn(u32) -> &'k [u8]) {
        if self.leaves.is_empty() {
            self.leaves.insert(Box::default(), Vec::with_capacity(LEAF_MAX));
        }
        self.len += 1;
        let leaf = self.leaf_mut(key);
        let pos = leaf.binary_search_by(|&i| key_of(i).cmp(key)).expect_err("keys are unique");
        if leaf.len() < LEAF_MAX {
            leaf.insert(pos, id);
            return;
        }
        let mut right = Vec::with_capacity(LEAF_MAX);
        if pos == leaf.len() {
            right.push(id);
        } else {
            right.extend(leaf.drain(LEAF_MAX / 2..));
            if pos <= LEAF_MAX / 2 {
                leaf.insert(pos, id);
            } else {
                right.insert(pos - LEAF_MAX / 2, id);
            }
        }
        let last = *leaf.last().expect("a split leaf keeps half");
        let bound = separator(key_of(last), key_of(right[0]));
        self.bound_heap_bytes += bound_heap_bytes(bound.len());
        self.leaves.insert(bound, right);
    }

    /// Remove `id`, whose key is `key`.
    pub(super) fn remove<'k>(&mut self, id: u32, key: &[u8], key_of: impl Fn(u32) -> &'k [u8]) {
        let leaf = self.leaf_mut(key);
        let pos = leaf.binary_search_by(|&i| key_of(i).cmp(key)).expect("an ordered key");
        debug_assert_eq!(leaf[pos], id);
        leaf.remove(pos);
        let len = leaf.len();
        self.len -= 1;
        if len >= LEAF_MAX / 4 {
            return;
        }
        if self.len == 0 {
            *self = KeyOrder::default();
            return;
        }
        // merge the next leaf into this one, or this one into the previous
        let next = self.leaves.range::<[u8], _>((Bound::Excluded(key), Bound::Unbounded)).next();
        if let Some((bound, ids)) = next
            && len + ids.len() <= LEAF_MAX
        {
            let bound = bound.clone();
            let ids = self.leaves.remove(&bound).expect("looked up above");
            self.bound_heap_bytes -= bound_heap_bytes(bound.len());
            self.leaf_mut(key).extend(ids);
            return;
        }
        let mut before =
            self.leaves.range::<[u8], _>((Bound::Unbounded, Bound::Included(key))).rev();
        let this = before.next().map(|(bound, _)| bound.clone()).expect("the leaf of the key");
        if let Some((_, ids)) = before.next()
            && len + ids.len() <= LEAF_MAX
        {
            let ids = self.leaves.remove(&this).expect("looked up above");
            self.bound_heap_bytes -= bound_heap_bytes(this.len());
            self.leaf_mut(key).extend(ids);
        }
    }

    /// Ids in key order from `from` on (`key_of` reads keys to place the start only).
    pub(super) fn range<'k>(
        &self,
        from: Bound<&[u8]>,
        key_of: impl Fn(u32) -> &'k [u8],
    ) -> impl Iterator<Item = u32> + '_ {
        let start = match from {
            Bound::Unbounded => None,
            Bound::Included(k) | Bound::Excluded(k) => self
                .leaves
                .range::<[u8], _>((Bound::Unbounded, Bound::Included(k)))
                .next_back()
                .map(|(bound, leaf)| {
                    let skip = leaf.partition_point(|&i| match from {
                        Bound::Included(_) => key_of(i) < k,
                        _ => key_of(i) <= k,
                    });
                    (bound, skip)
                }),
        };
        let (leaves, skip) = match start {
            Some((bound, skip)) => {
                (self.leaves.range::<[u8], _>((Bound::Included(&**bound), Bound::Unbounded)), skip)
            }
            None => (self.leaves.range::<[u8], _>(..), 0),
        };
        leaves
            .enumerate()
            .flat_map(move |(i, (_, leaf))| leaf[if i == 0 { skip } else { 0 }..].iter().copied())
    }

    /// Every id in key order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.leaves.values().flat_map(|leaf| leaf.iter().copied())
    }

    /// Heap bytes, estimated: leaves are exact, the map's nodes are not exposed by std.
    pub(super) fn heap_bytes(&self) -> u64 {
        let leaf = ((LEAF_MAX * 4 + 8 + 15) & !15) as u64;
        self.leaves.len() as u64 * (leaf + MAP_BYTES_PER_LEAF) + self.bound_heap_bytes
    }

    /// Check the invariants of the module notes.
    pub(super) fn check<'k>(&self, key_of: impl Fn(u32) -> &'k [u8]) -> Result<(), String> {
        let mut count = 0;
        let mut prev: Option<&[u8]> = None;
        let mut bounds = self.leaves.keys().skip(1).map(|b| &**b);
        for (bound, leaf) in &self.leaves {
            if leaf.is_empty() && self.leaves.len() > 1 {
                return Err(format!("empty leaf at {bound:?}"));
            }
            let upper = bounds.next();
            for &id in leaf {
                let key = key_of(id);
                if prev.is_some_and(|p| p >= key)
                    || key < &**bound
                    || upper.is_some_and(|u| key >= u)
                {
                    return Err(format!("id {id} out of order in the leaf at {bound:?}"));
                }
                prev = Some(key);
                count += 1;
            }
        }
        if count != self.len {
            return Err(format!("{count} ordered ids, len {}", self.len));
        }
        Ok(())
    }

    fn leaf_mut(&mut self, key: &[u8]) -> &mut Vec<u32> {
        let leaf =
            self.leaves.range_mut::<[u8], _>((Bound::Unbounded, Bound::Included(key))).next_back();
        leaf.expect("the first leaf's bound is empty").1
    }
}

/// The shortest prefix of `hi` that sorts above `lo` (`lo < hi`).
fn separator(lo: &[u8], hi: &[u8]) -> Box<[u8]> {
    debug_assert!(lo < hi);
    let common = lo.iter().zip(hi).take_while(|(a, b)| a == b).count();
    Box::from(&hi[..=common])
}

/// glibc chunk of a boxed slice of `len` bytes (none when empty).
fn bound_heap_bytes(len: usize) -> u64 {
    if len == 0 { 0 } else { ((len as u64 + 8 + 15) & !15).max(32) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn keys(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("k{:05}", (i * 7919) % n).into_bytes()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn matches_a_btreeset(ops in prop::collection::vec((0u8..3, 0usize..600), 1..4000)) {
            let keys = keys(600);
            let key_of = |id: u32| &keys[id as usize][..];
            let mut order = KeyOrder::default();
            let mut model = BTreeSet::new();
            for (op, id) in ops {
                let key = &keys[id][..];
                if op < 2 {
                    if model.insert(key) {
                        order.insert(id as u32, key, key_of);
                    }
                } else if model.remove(key) {
                    order.remove(id as u32, key, key_of);
                }
                let from = &keys[(id * 31) % 600][..];
                let got: Vec<&[u8]> = order
                    .range(Bound::Excluded(from), key_of)
                    .take(70)
                    .map(key_of)
                    .collect();
                let want: Vec<&[u8]> = model
                    .range::<[u8], _>((Bound::Excluded(from), Bound::Unbounded))
                    .take(70)
                    .copied()
                    .collect();
                prop_assert_eq!(got, want);
            }
            order.check(key_of).map_err(TestCaseError::fail)?;
            prop_assert_eq!(order.len(), model.len());
            let all: Vec<&[u8]> = order.iter().map(key_of).collect();
            prop_assert_eq!(all, model.iter().copied().collect::<Vec<_>>());
        }
    }

    #[test]
    fn ascending_inserts_fill_leaves_and_removals_merge_them() {
        let keys: Vec<Vec<u8>> = (0..10_000).map(|i| format!("{i:08}").into_bytes()).collect();
        let key_of = |id: u32| &keys[id as usize][..];
        let mut order = KeyOrder::default();
        for (id, key) in keys.iter().enumerate() {
            order.insert(id as u32, key, key_of);
        }
        assert_eq!(order.leaves.len(), 10_000usize.div_ceil(LEAF_MAX));
        let from = b"00004999".as_slice();
        let next: Vec<u32> = order.range(Bound::Included(from), key_of).take(2).collect();
        assert_eq!(next, [4999, 5000]);
        for (id, key) in keys.iter().enumerate().filter(|(id, _)| id % 10 != 0) {
            order.remove(id as u32, key, key_of);
        }
        order.check(key_of).unwrap();
        assert!(order.leaves.len() <= 1000 / (LEAF_MAX / 4), "{} leaves", order.leaves.len());
        for (id, key) in keys.iter().enumerate().filter(|(id, _)| id % 10 == 0) {
            order.remove(id as u32, key, key_of);
        }
        assert_eq!((order.len(), order.leaves.len(), order.heap_bytes()), (0, 0, 0));
    }
}
