//! An offset allocator over one contiguous region (DRAM segment, HBM buffer).
//!
//! Mechanism: free ranges in a `BTreeMap<offset, len>`; allocation is first fit over aligned
//! sizes, freeing coalesces with both neighbours. `reserve_at` takes a caller-chosen range (the
//! master allocates ranges of the Transfer Engine's segment and the node only records them).
//!
//! Invariants (checked by the property test): free ranges never overlap or touch (they are
//! coalesced), every allocation is aligned and inside the region, and free + allocated bytes
//! equal the region's length.
//!
//! Not handled: fragmentation-aware placement (size classes, buddy) and thread safety; the
//! owner wraps it in a mutex. Zero-length allocations take no space and sit at offset 0.

use std::collections::BTreeMap;

use crate::error::{Error, ErrorKind, Result};
use crate::header::round_up;

/// A first-fit, coalescing offset allocator.
#[derive(Debug)]
pub struct OffsetAllocator {
    region_bytes: u64,
    align_bytes: u64,
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl OffsetAllocator {
    /// An allocator over `[0, region_bytes)`; `align_bytes` must be a power of two.
    pub fn new(region_bytes: u64, align_bytes: u64) -> Self {
        assert!(align_bytes.is_power_of_two(), "align_bytes must be a power of two");
        let usable = region_bytes / align_bytes * align_bytes;
        let mut free = BTreeMap::new();
        if usable > 0 {
            free.insert(0, usable);
        }
        OffsetAllocator { region_bytes: usable, align_bytes, free, free_bytes: usable }
    }

    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes an allocation of `len` takes.
    pub fn footprint(&self, len: u64) -> u64 {
        round_up(len as usize, self.align_bytes as usize) as u64
    }

    /// Allocate `len` bytes; returns the offset. `NoSpace` when no free range fits.
    pub fn alloc(&mut self, len: u64) -> Result<u64> {
        let need = self.footprint(len);
        if need == 0 {
            return Ok(0);
        }
        let found = self.free.iter().find(|(_, l)| **l >= need).map(|(o, l)| (*o, *l));
        let Some((off, free_len)) = found else {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("no free range of {need} bytes ({} bytes free in total)", self.free_bytes),
            ));
        };
        self.free.remove(&off);
        if free_len > need {
            self.free.insert(off + need, free_len - need);
        }
        self.free_bytes -= need;
        Ok(off)
    }

    /// Take exactly `[offset, offset + len)`; it must be aligned and entirely free.
    pub fn reserve_at(&mut self, offset: u64, len: u64) -> Result<()> {
        let need = self.footprint(len);
        if need == 0 {
            return Ok(());
        }
        if !offset.is_multiple_of(self.align_bytes) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("offset {offset} is not aligned to {} bytes", self.align_bytes),
            ));
        }
        let end =
            offset.checked_add(need).filter(|e| *e <= self.region_bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("range {offset}+{len} outside the region"),
                )
            })?;
        let Some((&f_off, &f_len)) = self.free.range(..=offset).next_back() else {
            return Err(Error::new(ErrorKind::NoSpace, format!("range at {offset} is in use")));
        };
        if f_off + f_len < end {
            return Err(Error::new(ErrorKind::NoSpace, format!("range {offset}+{len} is in use")));
        }
        self.free.remove(&f_off);
        if f_off < offset {
            self.free.insert(f_off, offset - f_off);
        }
        if end < f_off + f_len {
            self.free.insert(end, f_off + f_len - end);
        }
        self.free_bytes -= need;
        Ok(())
    }

    /// Return a range previously allocated or reserved with the same `len`.
    pub fn free(&mut self, offset: u64, len: u64) {
        let mut off = offset;
        let mut size = self.footprint(len);
        if size == 0 {
            return;
        }
        self.free_bytes += size;
        if let Some((&p_off, &p_len)) = self.free.range(..off).next_back() {
            debug_assert!(p_off + p_len <= off, "double free at {off}");
            if p_off + p_len == off {
                self.free.remove(&p_off);
                off = p_off;
                size += p_len;
            }
        }
        if let Some(&n_len) = self.free.get(&(off + size)) {
            self.free.remove(&(off + size));
            size += n_len;
        }
        self.free.insert(off, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_fit_and_coalesce() {
        let mut a = OffsetAllocator::new(16 * 4096, 4096);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(4097).unwrap();
        assert_eq!((x, y), (0, 4096));
        assert_eq!(a.free_bytes(), 13 * 4096);
        a.free(x, 1);
        a.free(y, 4097);
        assert_eq!(a.free_bytes(), 16 * 4096);
        assert_eq!(a.alloc(16 * 4096).unwrap(), 0);
        assert_eq!(a.alloc(1).unwrap_err().kind(), ErrorKind::NoSpace);
    }

    #[test]
    fn reserve_at_checks_the_range() {
        let mut a = OffsetAllocator::new(8 * 4096, 4096);
        a.reserve_at(4096, 4096).unwrap();
        assert_eq!(a.reserve_at(4096, 1).unwrap_err().kind(), ErrorKind::NoSpace);
        assert_eq!(a.reserve_at(100, 1).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.reserve_at(7 * 4096, 8192).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(a.alloc(4096).unwrap(), 0);
        assert_eq!(a.alloc(4096).unwrap(), 2 * 4096);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Reserve(u64, u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..40_000).prop_map(Op::Alloc),
            (0u64..64, 0u64..20_000).prop_map(|(o, l)| Op::Reserve(o * 4096, l)),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn never_overlaps_and_accounts_every_byte(ops in prop::collection::vec(op(), 1..200)) {
            let region = 64 * 4096;
            let mut a = OffsetAllocator::new(region, 4096);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        if let Ok(off) = a.alloc(len) { live.push((off, len)); }
                    }
                    Op::Reserve(off, len) => {
                        if a.reserve_at(off, len).is_ok() { live.push((off, len)); }
                    }
                    Op::Free(i) => {
                        if !live.is_empty() {
                            let (off, len) = live.swap_remove(i % live.len());
                            a.free(off, len);
                        }
                    }
                }
                let mut spans: Vec<(u64, u64)> = live.iter()
                    .map(|&(o, l)| (o, a.footprint(l))).filter(|s| s.1 > 0).collect();
                spans.sort();
                for w in spans.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                for &(o, l) in &spans {
                    prop_assert!(o % 4096 == 0 && o + l <= region);
                }
                let used: u64 = spans.iter().map(|s| s.1).sum();
                prop_assert_eq!(used + a.free_bytes(), region);
                let mut prev_end = None;
                for (&o, &l) in &a.free {
                    if let Some(e) = prev_end { prop_assert!(o > e, "free ranges touch"); }
                    prev_end = Some(o + l);
                }
            }
        }
    }
}
