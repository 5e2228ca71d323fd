//! The node's index of the objects it holds, per copy: a DRAM range of its segment, an NVMe
//! file (with an offset in the NVMe segment the master accounts), and whether the object store
//! holds it.
//!
//! Mechanism: one `HashMap` (foldhash: every put and drop hashes its key here) under a mutex;
//! every change happens under it and no I/O is done while it is held. The NVMe "offsets" are the node's own: the master accounts NVMe capacity
//! with a segment like DRAM's, and the node, the only writer of its NVMe tier, allocates
//! ranges of that segment for its files ([`Index::nvme_alloc`]). After a restart they are
//! allocated afresh when the files are re-reported.
//!
//! Invariants: an entry exists while it names at least one copy on this node; its `dram`
//! offset is the one the master committed (or loaded) and has not dropped; its `nvme` offset is
//! allocated in `nvme_alloc` exactly while the entry names it; `busy` marks a tier move in
//! progress (moves of one key never overlap).

use std::collections::HashMap;

use kvfs_proto::store::{HeldObject, Persistence, Pin, Tier};
use kvfs_tiers::alloc::OffsetAllocator;

/// Index of the DRAM segment, of the NVMe segment and of the HBM segment in the node's
/// registration.
pub const DRAM_SEGMENT: u32 = 0;
pub const NVME_SEGMENT: u32 = 1;
pub const HBM_SEGMENT: u32 = 2;

/// One object this node holds.
#[derive(Debug, Clone)]
pub struct Held {
    pub size: u64,
    pub checksum: Option<[u8; 32]>,
    pub version: u64,
    pub persistence: Persistence,
    pub pin: Pin,
    /// Offset of the DRAM copy in the segment.
    pub dram: Option<u64>,
    /// Offset of the NVMe copy in the NVMe segment.
    pub nvme: Option<u64>,
    /// Offset of the HBM copy in the HBM segment (GPU memory).
    pub hbm: Option<u64>,
    /// A writer put it into HBM: the tier manager may move it back up after demoting it.
    pub hbm_home: bool,
    /// The object store holds this version (eager, or written back).
    pub persisted: bool,
    /// In the write-back queue.
    pub queued: bool,
    /// A tier move of this key is running.
    pub busy: bool,
    /// The key and version before the last rename (reported to a master rebuilding its
    /// directory, which then drops a copy left under the old name).
    pub renamed_from: Option<(String, u64)>,
}

impl Held {
    pub fn new(size: u64, version: u64, persistence: Persistence, pin: Pin) -> Held {
        Held {
            size,
            checksum: None,
            version,
            persistence,
            pin,
            dram: None,
            nvme: None,
            hbm: None,
            hbm_home: false,
            persisted: false,
            queued: false,
            busy: false,
            renamed_from: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.dram.is_none() && self.nvme.is_none() && self.hbm.is_none()
    }
}

/// The node's objects and its NVMe segment allocator.
pub struct Index {
    pub objects: HashMap<String, Held, foldhash::fast::RandomState>,
    pub nvme_alloc: OffsetAllocator,
    /// Bytes of DRAM copies.
    pub dram_bytes: u64,
    /// Bytes of HBM copies.
    pub hbm_bytes: u64,
}

impl Index {
    pub fn new(nvme_region_bytes: u64) -> Index {
        Index {
            objects: HashMap::default(),
            nvme_alloc: OffsetAllocator::new(nvme_region_bytes, 4096),
            dram_bytes: 0,
            hbm_bytes: 0,
        }
    }

    pub fn set_dram(&mut self, key: &str, offset: Option<u64>) {
        if let Some(h) = self.objects.get_mut(key) {
            match (h.dram, offset) {
                (None, Some(_)) => self.dram_bytes += h.size,
                (Some(_), None) => self.dram_bytes -= h.size,
                _ => {}
            }
            h.dram = offset;
        }
    }

    /// Forget the NVMe copy's offset (the caller deletes the file).
    pub fn clear_nvme(&mut self, key: &str) -> Option<u64> {
        let h = self.objects.get_mut(key)?;
        let off = h.nvme.take()?;
        self.nvme_alloc.free(off, h.size);
        Some(off)
    }

    /// Remove the entry if it names no copy any more.
    pub fn remove_if_empty(&mut self, key: &str) -> bool {
        if self.objects.get(key).is_some_and(|h| h.is_empty() && !h.busy) {
            self.objects.remove(key);
            return true;
        }
        false
    }

    /// Record (or forget) the HBM copy's offset.
    pub fn set_hbm(&mut self, key: &str, offset: Option<u64>) {
        if let Some(h) = self.objects.get_mut(key) {
            match (h.hbm, offset) {
                (None, Some(_)) => self.hbm_bytes += h.size,
                (Some(_), None) => self.hbm_bytes -= h.size,
                _ => {}
            }
            h.hbm = offset;
        }
    }

    /// Remove an entry whatever it holds; returns it (the caller frees its NVMe file).
    pub fn remove(&mut self, key: &str) -> Option<Held> {
        self.set_dram(key, None);
        self.set_hbm(key, None);
        self.clear_nvme(key);
        self.objects.remove(key)
    }

    /// Whether `[offset, offset+len)` of the memory segment `segment` (DRAM or HBM) lies
    /// inside that copy of `key` at `version` (a guarded read's check, see [`read_guard`]).
    pub fn vouches(&self, key: &str, version: u64, segment: u32, offset: u64, len: u64) -> bool {
        self.objects.get(key).is_some_and(|h| {
            let copy = if segment == HBM_SEGMENT { h.hbm } else { h.dram };
            h.version == version
                && copy.is_some_and(|d| {
                    offset >= d && offset.checked_add(len).is_some_and(|e| e <= d + h.size)
                })
        })
    }

    /// Every copy, as the master's registration wants them.
    pub fn held_objects(&self) -> Vec<HeldObject> {
        let mut out = Vec::with_capacity(self.objects.len());
        for (key, h) in &self.objects {
            let copies = [
                (h.dram, DRAM_SEGMENT, Tier::Dram),
                (h.nvme, NVME_SEGMENT, Tier::Nvme),
                (h.hbm, HBM_SEGMENT, Tier::Hbm),
            ];
            for (off, segment, tier) in copies {
                let Some(offset) = off else { continue };
                out.push(HeldObject {
                    key: key.clone(),
                    size: h.size,
                    checksum: h.checksum,
                    version: h.version,
                    segment,
                    offset,
                    tier,
                    persistence: h.persistence,
                    pin: h.pin,
                    persisted: h.persisted,
                    renamed_from: h.renamed_from.clone(),
                });
            }
        }
        out
    }
}
