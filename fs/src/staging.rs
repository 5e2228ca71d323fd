//! Write staging: the bytes of files being created, held in the daemon until close commits
//! them as one put.
//!
//! Mechanism. A staged file is a sparse array of 1 MiB blocks (holes read as zeros), so writes
//! in any order never reallocate what is there. Every block is charged to a daemon-wide
//! [`Budget`] when allocated and refunded when the file is committed or dropped.
//!
//! Limits (the errno a writer sees): a file may not grow past `staging_file_bytes_max`
//! (`EFBIG`); all files together may not hold more than `staging_bytes_max` (`ENOSPC`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub const BLOCK: usize = 1 << 20;

/// Bytes of staging all open writers hold, against a maximum.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    max: u64,
}

impl Budget {
    pub fn new(max: u64) -> Arc<Budget> {
        Arc::new(Budget { used: AtomicU64::new(0), max })
    }

    fn take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= self.max)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// One staged file.
#[derive(Debug)]
pub struct Staged {
    blocks: Vec<Option<Box<[u8]>>>,
    len: u64,
    file_max: u64,
    budget: Arc<Budget>,
}

impl Staged {
    pub fn new(budget: Arc<Budget>, file_max: u64) -> Staged {
        Staged { blocks: Vec::new(), len: 0, file_max, budget }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// Writes `data` at `offset`; errno `EFBIG` past the file limit, `ENOSPC` past the budget.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), i32> {
        let end = offset.checked_add(data.len() as u64).ok_or(libc::EFBIG)?;
        if end > self.file_max {
            return Err(libc::EFBIG);
        }
        let mut pos = offset as usize;
        let mut src = data;
        while !src.is_empty() {
            let (b, off) = (pos / BLOCK, pos % BLOCK);
            let n = src.len().min(BLOCK - off);
            let block = self.block_mut(b)?;
            block[off..off + n].copy_from_slice(&src[..n]);
            src = &src[n..];
            pos += n;
        }
        self.len = self.len.max(end);
        Ok(())
    }

    fn block_mut(&mut self, b: usize) -> Result<&mut [u8], i32> {
        if self.blocks.len() <= b {
            self.blocks.resize_with(b + 1, || None);
        }
        if self.blocks[b].is_none() {
            if !self.budget.take(BLOCK as u64) {
                return Err(libc::ENOSPC);
            }
            self.blocks[b] = Some(vec![0u8; BLOCK].into_boxed_slice());
        }
        Ok(self.blocks[b].as_deref_mut().unwrap_or_default())
    }

    /// Sets the length (truncate or extend with zeros).
    pub fn set_len(&mut self, len: u64) -> Result<(), i32> {
        if len > self.file_max {
            return Err(libc::EFBIG);
        }
        let keep = (len as usize).div_ceil(BLOCK);
        while self.blocks.len() > keep {
            if self.blocks.pop().flatten().is_some() {
                self.budget.give(BLOCK as u64);
            }
        }
        // Zero the tail of the last kept block so a later extension reads zeros.
        if let Some(Some(last)) = self.blocks.get_mut(keep.wrapping_sub(1)) {
            let off = len as usize - (keep - 1) * BLOCK;
            last[off..].fill(0);
        }
        self.len = len;
        Ok(())
    }

    /// Copies `[offset, offset+out.len())` out (zeros for holes and past the end).
    pub fn read(&self, offset: u64, out: &mut [u8]) {
        out.fill(0);
        let mut pos = offset as usize;
        let mut done = 0;
        while done < out.len() && (pos as u64) < self.len {
            let (b, off) = (pos / BLOCK, pos % BLOCK);
            let n = (out.len() - done).min(BLOCK - off).min((self.len - pos as u64) as usize);
            if let Some(Some(block)) = self.blocks.get(b) {
                out[done..done + n].copy_from_slice(&block[off..off + n]);
            }
            done += n;
            pos += n;
        }
    }

    /// Calls `f(offset, bytes)` for every allocated block, clipped to the length (holes are
    /// skipped: they read as zeros).
    pub fn for_each_block(&self, mut f: impl FnMut(u64, &[u8])) {
        for (i, b) in self.blocks.iter().enumerate() {
            let off = (i * BLOCK) as u64;
            if off >= self.len {
                break;
            }
            if let Some(b) = b {
                f(off, &b[..((self.len - off) as usize).min(BLOCK)]);
            }
        }
    }

    /// Frees the blocks (refunding the budget); the file is empty afterwards.
    pub fn clear(&mut self) {
        let held = self.blocks.drain(..).filter(Option::is_some).count() as u64;
        self.budget.give(held * BLOCK as u64);
        self.len = 0;
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_writes_read_back_with_zero_holes() {
        let budget = Budget::new(8 * BLOCK as u64);
        let mut s = Staged::new(budget.clone(), 16 * BLOCK as u64);
        s.write(3 * BLOCK as u64 - 2, b"abcd").unwrap();
        s.write(0, b"xy").unwrap();
        assert_eq!(s.len(), 3 * BLOCK as u64 + 2);
        assert_eq!(budget.used(), 3 * BLOCK as u64, "blocks 0, 2 and 3; block 1 is a hole");
        let mut out = vec![9u8; 6];
        s.read(3 * BLOCK as u64 - 3, &mut out);
        assert_eq!(&out, &[0, b'a', b'b', b'c', b'd', 0]);
        s.set_len(1).unwrap();
        assert_eq!(budget.used(), BLOCK as u64);
        s.set_len(4).unwrap();
        let mut out = [7u8; 4];
        s.read(0, &mut out);
        assert_eq!(&out, b"x\0\0\0", "a truncated tail reads as zeros when extended again");
        drop(s);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn limits_give_their_errno() {
        let budget = Budget::new(2 * BLOCK as u64);
        let mut a = Staged::new(budget.clone(), 4 * BLOCK as u64);
        assert_eq!(a.write(4 * BLOCK as u64, b"x"), Err(libc::EFBIG));
        assert_eq!(a.write(u64::MAX, b"x"), Err(libc::EFBIG));
        a.write(0, &vec![1u8; 2 * BLOCK]).unwrap();
        let mut b = Staged::new(budget.clone(), 4 * BLOCK as u64);
        assert_eq!(b.write(0, b"y"), Err(libc::ENOSPC));
        drop(a);
        b.write(0, b"y").unwrap();
    }
}
