//! DRAM medium: objects in one page-aligned memory region with an offset allocator and an index.
//!
//! Mechanism: the region is either an `mmap` of a `memfd` (so the node can pass the fd to an
//! engine or to the Transfer Engine's `shm` transport and share the bytes) or a region the
//! caller owns (the Transfer Engine's registered segment, whose ranges the master allocates:
//! [`DramMedium::put_at`] and [`DramMedium::adopt`] record an object at a given offset).
//! Objects are copied in and out with `memcpy`; [`DramMedium::view`] hands out the bytes in
//! place for zero-copy reads.
//!
//! Policy: allocations are aligned to `align_bytes` (4 KiB by default, so a DRAM object can be
//! written to NVMe with O_DIRECT without a bounce buffer). The checksum is computed at put
//! unless the caller passes one (trusted: see [`crate::PutOptions::checksum`]); reads do not
//! re-hash (DRAM is not a medium that rots silently, and hashing is 3-4x slower than memcpy).
//!
//! Invariants: a range is returned to the allocator only when the index no longer names it and
//! no reader or [`DramView`] still holds it (an `Arc` per stored object; its `Drop` frees), so
//! an overwrite or remove never tears a concurrent read. Distinct live objects never share a
//! byte (allocator invariant), which is what makes the unsynchronised copies sound.
//!
//! Rename: re-keys the index under its lock (the range, and so the bytes, stay where they
//! are; no copy). The entry takes the new version and its previous name; a [`DramView`] taken
//! before keeps the meta it was taken with. Nothing survives a crash, so there are no crash
//! states to resolve.
//!
//! Not handled: huge pages (`MFD_HUGETLB` needs a reserved pool; left to the node's config),
//! NUMA placement, persistence across restarts (DRAM is lost with the process).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::alloc::OffsetAllocator;
use crate::error::{Error, ErrorKind, Result};
use crate::medium::{
    Capabilities, Medium, ObjectMeta, PutMode, PutOptions, RenameOptions, check_dst, checksum,
    now_unix_ms, usize_from, validate_key, validate_rename,
};

/// Default alignment of DRAM allocations in bytes.
pub const DRAM_ALIGN_BYTES: u64 = 4096;

struct Region {
    ptr: *mut u8,
    len: usize,
    /// Present when this medium created the mapping (memfd); then Drop unmaps it.
    memfd: Option<OwnedFd>,
}

// SAFETY: the region is plain memory; concurrent access is confined to disjoint ranges handed
// out by the allocator (see the module invariants), so sharing the pointer across threads is
// sound.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        if self.memfd.is_some() && self.len > 0 {
            // SAFETY: ptr/len are exactly the mapping created in `Region::memfd`, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

impl Region {
    fn memfd(name: &str, len: usize) -> Result<Region> {
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::new(ErrorKind::InvalidArgument, "memfd name contains NUL"))?;
        // SAFETY: FFI call with a valid NUL-terminated name; the fd is checked below.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own fd.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(Error::io("ftruncate memfd", std::io::Error::last_os_error()));
        }
        if len == 0 {
            return Ok(Region {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len,
                memfd: Some(memfd),
            });
        }
        // SAFETY: mapping `len` bytes of our memfd; the result is checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io("mmap memfd", std::io::Error::last_os_error()));
        }
        Ok(Region { ptr: ptr.cast(), len, memfd: Some(memfd) })
    }
}

/// A range holding one object's bytes; freed when the last holder drops it.
struct Slot {
    offset: u64,
    len: u64,
    alloc: Arc<Mutex<OffsetAllocator>>,
}

/// What the index holds per key: the bytes' range and the copy's meta (which a rename changes
/// without touching the range).
#[derive(Clone)]
struct Held {
    slot: Arc<Slot>,
    meta: ObjectMeta,
    previous: Option<Arc<(String, u64)>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.alloc).free(self.offset, self.len);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves consistent data (single-step updates).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Objects in a page-aligned memory region.
pub struct DramMedium {
    region: Arc<Region>,
    alloc: Arc<Mutex<OffsetAllocator>>,
    index: Mutex<HashMap<String, Held>>,
}

/// A stored object's bytes in place; keeps the range alive (not reused) while held.
pub struct DramView {
    slot: Arc<Slot>,
    meta: ObjectMeta,
    region: Arc<Region>,
}

impl DramView {
    pub fn meta(&self) -> ObjectMeta {
        self.meta
    }

    /// Offset of the object in the region (what the Transfer Engine names).
    pub fn offset(&self) -> u64 {
        self.slot.offset
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.slot.len == 0 {
            return &[];
        }
        // SAFETY: the slot's range lies inside the region (allocator invariant), the region
        // outlives this view (Arc), and no writer touches a range that is stored and live.
        unsafe {
            std::slice::from_raw_parts(
                self.region.ptr.add(self.slot.offset as usize),
                self.slot.len as usize,
            )
        }
    }
}

impl DramMedium {
    /// A new region of `capacity_bytes` (rounded up to pages) in a fresh memfd.
    pub fn new(capacity_bytes: u64) -> Result<Self> {
        let len = crate::header::round_up(usize_from(capacity_bytes)?, page_bytes());
        let region = Region::memfd("kvfs-dram", len)?;
        Ok(Self::over(region, DRAM_ALIGN_BYTES))
    }

    /// A medium over a region the caller owns (e.g. a registered Transfer Engine segment).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for the medium's whole life and must
    /// not be written by anyone else in ranges the medium holds objects in.
    pub unsafe fn from_raw_region(ptr: *mut u8, len: usize, align_bytes: u64) -> Self {
        Self::over(Region { ptr, len, memfd: None }, align_bytes)
    }

    fn over(region: Region, align_bytes: u64) -> Self {
        let alloc = OffsetAllocator::new(region.len as u64, align_bytes);
        DramMedium {
            region: Arc::new(region),
            alloc: Arc::new(Mutex::new(alloc)),
            index: Mutex::new(HashMap::new()),
        }
    }

    /// The memfd behind the region, if this medium created it (to share it with a peer).
    pub fn memfd(&self) -> Option<RawFd> {
        self.region.memfd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Base pointer and length of the region.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.region.ptr, self.region.len)
    }

    /// The object's bytes in place, without a copy.
    pub fn view(&self, key: &str) -> Result<DramView> {
        let held = self.lookup(key)?;
        Ok(DramView { slot: held.slot, meta: held.meta, region: self.region.clone() })
    }

    /// Copy `data` to `[offset, offset + len)` (a range the caller, i.e. the master, chose) and
    /// record it under `key`.
    pub fn put_at(
        &self,
        key: &str,
        offset: u64,
        data: &[u8],
        opts: PutOptions,
    ) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.check_create(key, opts.mode)?;
        let slot_range = self.reserve(Some(offset), data.len() as u64)?;
        self.fill_and_insert(key, slot_range, Some(data), opts)
    }

    /// Record bytes already written at `[offset, offset + len)` (by the Transfer Engine) as
    /// object `key`. The checksum is computed in place unless `opts.checksum` is given.
    pub fn adopt(&self, key: &str, offset: u64, len: u64, opts: PutOptions) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.check_create(key, opts.mode)?;
        let slot_range = self.reserve(Some(offset), len)?;
        self.fill_and_insert(key, slot_range, None, opts)
    }

    fn lookup(&self, key: &str) -> Result<Held> {
        lock(&self.index)
            .get(key)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("dram: {key:?}")))
    }

    fn check_create(&self, key: &str, mode: PutMode) -> Result<()> {
        if mode == PutMode::CreateNew && lock(&self.index).contains_key(key) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("dram: {key:?}")));
        }
        Ok(())
    }

    /// Take a range; returned as (offset, len) not yet owned by a slot.
    fn reserve(&self, at: Option<u64>, len: u64) -> Result<(u64, u64)> {
        let mut a = lock(&self.alloc);
        let offset = match at {
            Some(off) => {
                a.reserve_at(off, len)?;
                off
            }
            None => a.alloc(len)?,
        };
        Ok((offset, len))
    }

    fn fill_and_insert(
        &self,
        key: &str,
        (offset, len): (u64, u64),
        data: Option<&[u8]>,
        opts: PutOptions,
    ) -> Result<ObjectMeta> {
        // From here the range is owned by a slot, so every early return frees it.
        let slot = Slot { offset, len, alloc: self.alloc.clone() };
        let mut meta = ObjectMeta {
            size_bytes: len,
            checksum: [0; 32],
            persistence: opts.persistence,
            stored_at_unix_ms: now_unix_ms(),
            version: opts.version,
            pin: opts.pin,
        };
        let dst = if len == 0 {
            &mut [][..]
        } else {
            // SAFETY: the range was just reserved for this slot, lies inside the region and no
            // other object or reader can name it until the slot is inserted.
            unsafe {
                std::slice::from_raw_parts_mut(self.region.ptr.add(offset as usize), len as usize)
            }
        };
        if let Some(data) = data {
            dst.copy_from_slice(data);
        }
        meta.checksum = opts.checksum.unwrap_or_else(|| checksum(dst));
        let mut index = lock(&self.index);
        if opts.mode == PutMode::CreateNew && index.contains_key(key) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("dram: {key:?}")));
        }
        let replaced =
            index.insert(key.to_owned(), Held { slot: Arc::new(slot), meta, previous: None });
        drop(index);
        // Freed (when no reader holds it) outside the index lock.
        drop(replaced);
        Ok(meta)
    }
}

/// The system page size in bytes.
pub fn page_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 { v as usize } else { 4096 }
}

#[async_trait]
impl Medium for DramMedium {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            kind: "dram",
            survives_restart: false,
            durable_across_nodes: false,
            verifies_reads: false,
            zero_copy_read: true,
            bounded_capacity: true,
        }
    }

    async fn put(&self, key: &str, data: &[u8], opts: PutOptions) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.check_create(key, opts.mode)?;
        let range = self.reserve(None, data.len() as u64)?;
        self.fill_and_insert(key, range, Some(data), opts)
    }

    async fn put_with_previous(
        &self,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        previous: Option<(&str, u64)>,
    ) -> Result<ObjectMeta> {
        let Some(previous) = previous else { return self.put(key, data, opts).await };
        validate_key(previous.0)?;
        let meta = self.put(key, data, opts).await?;
        if let Some(held) = lock(&self.index).get_mut(key).filter(|h| h.meta == meta) {
            held.previous = Some(Arc::new((previous.0.to_owned(), previous.1)));
        }
        Ok(meta)
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta> {
        validate_key(key)?;
        let view = self.view(key)?;
        let size = check_dst(key, dst.len(), view.slot.len)?;
        dst[..size].copy_from_slice(view.as_slice());
        Ok(view.meta())
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        validate_key(key)?;
        Ok(self.view(key)?.as_slice().to_vec())
    }

    async fn stat(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        Ok(self.lookup(key)?.meta)
    }

    async fn remove(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let removed = lock(&self.index).remove(key);
        removed.map(drop).ok_or_else(|| Error::new(ErrorKind::NotFound, format!("dram: {key:?}")))
    }

    async fn rename(&self, from: &str, to: &str, opts: RenameOptions) -> Result<ObjectMeta> {
        validate_rename(from, to)?;
        let mut index = lock(&self.index);
        if opts.mode == PutMode::CreateNew && index.contains_key(to) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("dram: {to:?}")));
        }
        let Some(mut held) = index.remove(from) else {
            return Err(Error::new(ErrorKind::NotFound, format!("dram: {from:?}")));
        };
        held.previous = Some(Arc::new((from.to_owned(), held.meta.version)));
        held.meta.version = opts.version;
        let meta = held.meta;
        let replaced = index.insert(to.to_owned(), held);
        drop(index);
        drop(replaced);
        Ok(meta)
    }

    async fn previous_name(&self, key: &str) -> Result<Option<(String, u64)>> {
        validate_key(key)?;
        Ok(self.lookup(key)?.previous.map(|p| (*p).clone()))
    }

    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>> {
        Ok(lock(&self.index).iter().map(|(k, h)| (k.clone(), h.meta)).collect())
    }

    fn capacity_bytes(&self) -> Option<u64> {
        Some(lock(&self.alloc).region_bytes())
    }

    fn used_bytes(&self) -> u64 {
        let a = lock(&self.alloc);
        a.region_bytes() - a.free_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn views_keep_ranges_alive_across_remove() {
        let m = DramMedium::new(4 * 4096).unwrap();
        m.put("a", &[1u8; 4096], PutOptions::default()).await.unwrap();
        let v = m.view("a").unwrap();
        m.remove("a").await.unwrap();
        // The range is still held by the view: a new 4-page object does not fit.
        let err = m.put("b", &[2u8; 4 * 4096], PutOptions::default()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        assert_eq!(v.as_slice(), &[1u8; 4096][..]);
        drop(v);
        m.put("b", &[2u8; 4 * 4096], PutOptions::default()).await.unwrap();
    }

    #[tokio::test]
    async fn put_at_and_adopt_use_the_callers_range() {
        let m = DramMedium::new(8 * 4096).unwrap();
        m.put_at("x", 4096, b"hello", PutOptions::default()).unwrap();
        assert_eq!(m.view("x").unwrap().offset(), 4096);
        let err = m.put_at("y", 4096, b"again", PutOptions::default()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        let (ptr, _) = m.region();
        // SAFETY: test writes into a free range of the region it owns.
        unsafe { std::ptr::copy_nonoverlapping(b"engine".as_ptr(), ptr.add(3 * 4096), 6) };
        let meta = m.adopt("z", 3 * 4096, 6, PutOptions::default()).unwrap();
        assert_eq!(meta.checksum, *blake3::hash(b"engine").as_bytes());
        assert_eq!(m.get("z").await.unwrap(), b"engine");
        assert!(m.memfd().is_some());
    }
}
