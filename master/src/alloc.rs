//! Offset allocator for one segment: hands out byte ranges of `[0, capacity)`.
//!
//! Mechanism: exact best fit over two ordered indexes of the free blocks, `by_offset`
//! (offset -> len, for coalescing and `reserve`) and `by_size` ((len, offset), for best fit).
//! Every operation is O(log F) where F is the number of free blocks, which is bounded by the
//! number of live allocations + 1, because neighbouring free blocks are always merged.
//!
//! Why best fit and not a bin allocator (Mooncake uses sebbbi's O(1) `OffsetAllocator`): KV
//! objects range from 64 KiB to ~100 MiB. Float-bin allocators round every request up to its
//! bin (up to 1/8 = 12.5 % waste with 3 mantissa bits) and cannot carve an arbitrary range out
//! of the middle of a block, which `reserve` needs when the directory is rebuilt from what nodes
//! report after a master restart. Best fit wastes nothing beyond alignment and keeps big holes
//! intact for big objects; O(log F) on a few thousand blocks is ~100 ns, far below an RPC.
//!
//! Policy: the managed capacity is rounded down to the alignment (a segment loses < `align`
//! bytes at its end). Every range is widened to its *extent*, `[floor(offset, align),
//! ceil(offset + len, align))`. `alloc`, `free` and `reserve` all use the same extent, so a
//! caller only needs to remember `(offset, len)` of what it stored and frees exactly what it
//! took. `alloc` always returns an aligned offset.
//!
//! Invariants (checked by [`Allocator::check`] in tests):
//! - free blocks are non-empty, disjoint, never adjacent (always coalesced), inside capacity;
//! - `by_offset` and `by_size` describe the same set; `free_bytes` is their sum;
//! - `used_bytes() + free_bytes() == capacity`.
//!
//! Not handled: the allocator does not remember allocated ranges, so it cannot tell a free of a
//! range it never handed out from a legitimate one; it only refuses frees that overlap free
//! space (double frees) or leave the segment. The directory owns the record of what is stored.

use std::collections::{BTreeMap, BTreeSet};

/// Why a `free` or `reserve` was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// A zero-length range.
    #[error("zero-length range")]
    ZeroLength,
    /// The range ends past the segment's capacity.
    #[error("range ends past the segment capacity")]
    OutOfRange,
    /// The range overlaps a block that is already allocated (`reserve`) or already free (`free`).
    #[error("range overlaps a range in the wrong state")]
    Overlap,
}

/// Best-fit offset allocator over `[0, capacity)`.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    align: u64,
    free_bytes: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl Allocator {
    /// A fully free segment of `capacity` rounded down to `align`, which must be a power of two
    /// (1 means no alignment).
    ///
    /// # Panics
    /// If `align` is not a power of two: this is a configuration bug the caller validates.
    pub fn new(capacity: u64, align: u64) -> Self {
        assert!(align.is_power_of_two(), "alignment must be a power of two, got {align}");
        let capacity = capacity & !(align - 1);
        let mut a = Allocator {
            capacity,
            align,
            free_bytes: 0,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn align(&self) -> u64 {
        self.align
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// Number of free blocks (a fragmentation figure, and the allocator's memory driver).
    pub fn free_blocks(&self) -> usize {
        self.by_offset.len()
    }

    /// Length of the largest free block. An allocation of `len` succeeds if
    /// `align_up(len) <= largest_free()` and the block start is aligned (it always is unless
    /// unaligned ranges were reserved).
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Bytes an allocation of `len` takes: `len` rounded up to the alignment.
    pub fn footprint(&self, len: u64) -> u64 {
        len.div_ceil(self.align).saturating_mul(self.align)
    }

    /// Allocate `len` bytes at an aligned offset in the smallest free block that holds them.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let need = self.footprint(len);
        // Best fit: the first block (in size order) whose aligned start still leaves `need`.
        // With aligned blocks the first candidate fits; unaligned blocks only come from
        // `reserve` of foreign ranges and cost a few extra steps.
        let (block_off, block_len, start) = self
            .by_size
            .range((need, 0)..)
            .map(|&(block_len, block_off)| (block_off, block_len, self.align_up(block_off)))
            .find(|&(block_off, block_len, start)| start - block_off + need <= block_len)?;
        self.remove_free(block_off, block_len);
        if start > block_off {
            self.insert_free(block_off, start - block_off);
        }
        let end = start + need;
        if end < block_off + block_len {
            self.insert_free(end, block_off + block_len - end);
        }
        Some(start)
    }

    /// Return the extent of `(offset, len)` to the free space, merging with free neighbours.
    pub fn free(&mut self, offset: u64, len: u64) -> Result<(), AllocError> {
        let (start, end) = self.extent(offset, len)?;
        let prev = self.by_offset.range(..end).next_back().map(|(&o, &l)| (o, l));
        if let Some((o, l)) = prev
            && o + l > start
        {
            return Err(AllocError::Overlap);
        }
        let (mut new_start, mut new_end) = (start, end);
        if let Some((o, l)) = prev
            && o + l == start
        {
            self.remove_free(o, l);
            new_start = o;
        }
        if let Some(l) = self.by_offset.get(&end).copied() {
            self.remove_free(end, l);
            new_end = end + l;
        }
        self.insert_free(new_start, new_end - new_start);
        Ok(())
    }

    /// Mark the extent of `(offset, len)` as used; it must lie entirely inside one free block.
    /// Used to rebuild the allocator from what nodes report they hold.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Result<(), AllocError> {
        let (start, end) = self.extent(offset, len)?;
        let (block_off, block_len) = self
            .by_offset
            .range(..=start)
            .next_back()
            .map(|(&o, &l)| (o, l))
            .filter(|&(o, l)| o + l >= end)
            .ok_or(AllocError::Overlap)?;
        self.remove_free(block_off, block_len);
        if start > block_off {
            self.insert_free(block_off, start - block_off);
        }
        if block_off + block_len > end {
            self.insert_free(end, block_off + block_len - end);
        }
        Ok(())
    }

    /// Whether the extent of `(offset, len)` is entirely allocated (no byte of it is free).
    pub fn is_used(&self, offset: u64, len: u64) -> bool {
        let Ok((start, end)) = self.extent(offset, len) else {
            return false;
        };
        match self.by_offset.range(..end).next_back() {
            Some((&o, &l)) => o + l <= start,
            None => true,
        }
    }

    /// Verify every invariant listed in the module notes; for tests and debug checks.
    pub fn check(&self) -> Result<(), String> {
        let mut sum = 0u64;
        let mut last_end: Option<u64> = None;
        for (&o, &l) in &self.by_offset {
            if l == 0 || o + l > self.capacity {
                return Err(format!("bad free block {o}+{l} (capacity {})", self.capacity));
            }
            if let Some(e) = last_end
                && o <= e
            {
                return Err(format!("free block {o}+{l} overlaps or touches the previous one"));
            }
            if !self.by_size.contains(&(l, o)) {
                return Err(format!("free block {o}+{l} missing from the size index"));
            }
            sum += l;
            last_end = Some(o + l);
        }
        if self.by_size.len() != self.by_offset.len() {
            return Err("size index and offset index differ in length".into());
        }
        if sum != self.free_bytes {
            return Err(format!("free_bytes {} but blocks sum to {sum}", self.free_bytes));
        }
        Ok(())
    }

    fn extent(&self, offset: u64, len: u64) -> Result<(u64, u64), AllocError> {
        if len == 0 {
            return Err(AllocError::ZeroLength);
        }
        let end = offset.checked_add(len).ok_or(AllocError::OutOfRange)?;
        if end > self.capacity {
            return Err(AllocError::OutOfRange);
        }
        let start = offset & !(self.align - 1);
        // `capacity` is aligned, so rounding up never leaves it.
        let end = end.next_multiple_of(self.align);
        Ok((start, end))
    }

    fn align_up(&self, offset: u64) -> u64 {
        offset.checked_next_multiple_of(self.align).unwrap_or(u64::MAX)
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        debug_assert!(len > 0);
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_is_aligned_and_best_fit() {
        let mut a = Allocator::new(1 << 20, 4096);
        let x = a.alloc(100).unwrap();
        let y = a.alloc(5000).unwrap();
        let z = a.alloc(4096).unwrap();
        assert_eq!((x, y, z), (0, 4096, 12288));
        assert_eq!(a.used_bytes(), 4096 + 8192 + 4096);
        a.free(y, 5000).unwrap();
        // the 8 KiB hole is the best fit for 8 KiB, not the big tail
        assert_eq!(a.alloc(8000), Some(4096));
        a.check().unwrap();
    }

    #[test]
    fn free_coalesces_both_neighbours() {
        let mut a = Allocator::new(3 * 4096, 4096);
        let offs: Vec<u64> = (0..3).map(|_| a.alloc(4096).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        a.free(offs[0], 4096).unwrap();
        a.free(offs[2], 4096).unwrap();
        assert_eq!(a.free_blocks(), 2);
        a.free(offs[1], 4096).unwrap();
        assert_eq!(a.free_blocks(), 1);
        assert_eq!(a.largest_free(), 3 * 4096);
    }

    #[test]
    fn double_free_and_bad_ranges_are_refused() {
        let mut a = Allocator::new(8192, 4096);
        let x = a.alloc(10).unwrap();
        a.free(x, 10).unwrap();
        assert_eq!(a.free(x, 10), Err(AllocError::Overlap));
        assert_eq!(a.free(8000, 500), Err(AllocError::OutOfRange));
        assert_eq!(a.free(0, 0), Err(AllocError::ZeroLength));
        assert_eq!(a.reserve(u64::MAX, 2), Err(AllocError::OutOfRange));
    }

    #[test]
    fn reserve_refuses_overlap_and_splits_blocks() {
        let mut a = Allocator::new(1 << 20, 4096);
        a.reserve(8192, 4096).unwrap();
        assert_eq!(a.reserve(8192 + 100, 10), Err(AllocError::Overlap));
        assert_eq!(a.reserve(4096, 8192), Err(AllocError::Overlap));
        assert!(a.is_used(8192, 4096));
        assert_eq!(a.alloc(8192), Some(0)); // the hole before the reserved range
        a.check().unwrap();
    }

    #[test]
    fn unaligned_capacity_tail_is_not_managed() {
        let mut a = Allocator::new(4096 + 100, 4096);
        assert_eq!(a.capacity(), 4096);
        assert_eq!(a.alloc(4096), Some(0));
        assert_eq!(a.alloc(50), None);
        assert_eq!(a.reserve(4096, 50), Err(AllocError::OutOfRange));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        Reserve(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..40_000).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
            1 => (0u64..300_000, 1u64..20_000).prop_map(|(o, l)| Op::Reserve(o, l)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No two live ranges overlap, used + free == capacity, and freeing everything that was
        /// taken (by alloc or reserve) gives back one block of the full capacity.
        #[test]
        fn invariants_hold(align_log in 0u32..13, capacity in 1u64..300_000,
                           ops in proptest::collection::vec(op(), 1..200)) {
            let align = 1u64 << align_log;
            let mut a = Allocator::new(capacity, align);
            let capacity = a.capacity();
            let mut live: Vec<(u64, u64)> = Vec::new(); // extents
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        if let Some(off) = a.alloc(len) {
                            prop_assert_eq!(off % align, 0);
                            let ext = (off, off + a.footprint(len));
                            prop_assert!(ext.1 <= capacity);
                            prop_assert!(live.iter().all(|&(s, e)| e <= ext.0 || ext.1 <= s));
                            live.push(ext);
                        } else {
                            prop_assert!(a.footprint(len) > a.largest_free());
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (s, e) = live.swap_remove(i % live.len());
                        prop_assert_eq!(a.free(s, e - s), Ok(()));
                        prop_assert_eq!(a.free(s, e - s), Err(AllocError::Overlap));
                    }
                    Op::Free(_) => {}
                    Op::Reserve(off, len) => {
                        let s = off & !(align - 1);
                        let e = (off + len).next_multiple_of(align);
                        let fits = off + len <= capacity;
                        let clash = live.iter().any(|&(ls, le)| s < le && ls < e);
                        let r = a.reserve(off, len);
                        prop_assert_eq!(r.is_ok(), fits && !clash, "{:?}", r);
                        if r.is_ok() { live.push((s, e)); }
                    }
                }
                a.check().map_err(TestCaseError::fail)?;
                let used: u64 = live.iter().map(|&(s, e)| e - s).sum();
                prop_assert_eq!(a.used_bytes(), used);
                prop_assert_eq!(a.used_bytes() + a.free_bytes(), capacity);
                for &(s, e) in &live { prop_assert!(a.is_used(s, e - s)); }
            }
            for (s, e) in live.drain(..) { a.free(s, e - s).unwrap(); }
            prop_assert_eq!(a.free_bytes(), capacity);
            prop_assert_eq!(a.free_blocks(), usize::from(capacity > 0));
            prop_assert_eq!(a.largest_free(), capacity);
        }
    }
}
