//! Registered memory ([`MemoryRegion`]) and the addresses ops use ([`LocalSlice`],
//! [`RemoteRegion`], [`RemoteAddr`]).
//!
//! Mechanism: `RdmaContext::register` pins a caller-owned byte range with `ibv_reg_mr` in the
//! context's protection domain, with local write, remote read and remote write access. The
//! region is deregistered when the [`MemoryRegion`] drops. Every endpoint of the same context can
//! use it (one PD per context). The peer learns `(addr, len, rkey)` as a [`RemoteRegion`] through
//! the engine's handshake.
//!
//! Invariants:
//! - The registered bytes stay allocated and are not moved until the `MemoryRegion` drops; this
//!   is the caller's promise when calling the `unsafe` `register`.
//! - A `MemoryRegion` outlives every op that uses it. Dropping it while ops are in flight is not
//!   memory-unsafe (after `ibv_dereg_mr` returns the device no longer touches the pages, and the
//!   in-flight ops fail with a local or remote access error), but it turns those ops into errors.
//! - While an op that writes into a range is outstanding (a local READ destination, or a range a
//!   peer may WRITE), Rust code must not hold references into that range: the device writes it
//!   behind the compiler's back. The engine hands out bytes only after the op's completion.
//! - Bounds are checked twice: by [`MemoryRegion::slice`] / [`RemoteRegion::at`] before posting,
//!   and by the device against the key's registered range when the op executes.
//!
//! Not handled: on-demand paging, memory windows, device (GPU) memory and dma-buf registration;
//! per-region access restrictions (every region is remotely readable and writable by any peer
//! that has its rkey).

use std::fmt;
use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion as VerbsMr;

use crate::error::{Error, ErrorKind, Result};

/// A registered, pinned memory range. Deregistered on drop.
pub struct MemoryRegion {
    // Holds the protection domain (and so the device context) alive.
    pub(crate) mr: Arc<VerbsMr>,
    addr: u64,
    len: usize,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

impl MemoryRegion {
    pub(crate) fn new(mr: Arc<VerbsMr>, addr: u64, len: usize) -> MemoryRegion {
        MemoryRegion { mr, addr, len }
    }

    /// Local key: names this region in local scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key: what a peer needs to READ or WRITE this region.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Start address of the registered range.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Registered length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `offset` of this region, as the local side of an op.
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice> {
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|end| end > self.len) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "slice",
                format!("{len} bytes at offset {offset} of a {}-byte region", self.len),
            ));
        }
        Ok(LocalSlice { addr: self.addr + offset as u64, len: len as u64, lkey: self.lkey() })
    }

    /// What a peer needs to address this region: send it in the handshake.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr, len: self.len as u64, rkey: self.rkey() }
    }
}

/// The local side of an op: a range inside a region registered on the same context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalSlice {
    /// Start address (virtual address in this process).
    pub addr: u64,
    /// Length in bytes, > 0.
    pub len: u64,
    /// Local key of the region that contains the range.
    pub lkey: u32,
}

/// A peer's registered region, as its handshake described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The peer's remote key for it.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The remote side of an op of `len` bytes at `offset`, checked against the region's bounds.
    pub fn at(&self, offset: u64, len: u64) -> Result<RemoteAddr> {
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|end| end > self.len) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "remote slice",
                format!("{len} bytes at offset {offset} of a {}-byte remote region", self.len),
            ));
        }
        Ok(RemoteAddr { addr: self.addr + offset, rkey: self.rkey })
    }
}

/// The remote side of an op: where in the peer's address space, under which rkey. The length is
/// the local side's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Address in the peer's address space.
    pub addr: u64,
    /// The peer's remote key for the region that contains it.
    pub rkey: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_slices_are_bounds_checked() {
        let r = RemoteRegion { addr: 0x1000, len: 100, rkey: 7 };
        assert_eq!(r.at(0, 100).unwrap(), RemoteAddr { addr: 0x1000, rkey: 7 });
        assert_eq!(r.at(99, 1).unwrap().addr, 0x1000 + 99);
        for (off, len) in [(0, 0), (0, 101), (100, 1), (u64::MAX, 2)] {
            let e = r.at(off, len).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{off} {len}");
        }
    }
}
