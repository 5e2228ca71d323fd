//! Memory the engine moves bytes into and out of: owned buffers and the registry of regions.
//!
//! Mechanism: a [`Buffer`] is a page-aligned `MAP_SHARED` mapping of a memfd, so another
//! process on the host can map the same pages (the shm transport) and the kernel can back it
//! with huge pages: `MFD_HUGETLB` when the system has reserved huge pages, otherwise
//! transparent huge pages requested with `madvise(MADV_HUGEPAGE)`. The [`Registry`] records
//! every region registered with an engine: owned buffers (shareable) and raw memory the
//! application promises to keep valid (not shareable, still reachable over tcp/rdma).
//!
//! Invariants: registered regions never overlap; a lookup returns the region only when the
//! whole requested range lies inside it; an owned buffer stays mapped while any transfer that
//! found it in the registry still runs (the lookup hands out an `Arc`).
//!
//! With the `rdma` feature and a device, every region (owned or raw, remote or local-only) is
//! also registered with the NIC when it is registered with the engine; the [`Region`] keeps the
//! memory region, so it is deregistered when the last user of the region lets go.
//!
//! Device memory (HBM) is a region too ([`crate::Engine::register_device_memory`]): the CPU
//! cannot address it, so the engine never makes a slice of it; every transport that reaches it
//! moves its bytes through host memory in chunks with the owner's [`DeviceMemory`] calls (tcp
//! serving and the engine's own copies). It is never shareable over shm nor registered with an
//! RDMA NIC (GPUDirect is a later step), so peers on the same host and rdma peers reach it over
//! tcp.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, RwLock};

use crate::{Error, ErrorKind, Result};

const PAGE: usize = 4096;
const HUGE_PAGE: usize = 2 << 20;

/// Copies of at least this many bytes between host memories (a process's own segment, a
/// peer's over shm) take [`copy_streaming`]: at this size the bytes would push the copying
/// core's L2 out anyway, and whoever reads them next (a GPU's DMA, another process, the tier
/// mover) is rarely this core right away.
pub(crate) const STREAM_BYTES_MIN: usize = 256 << 10;

/// Copies `len` bytes from `src` to `dst` with non-temporal stores on x86_64 (SSE2, on every
/// such CPU): the destination's cache lines are written whole, never read first, and do not
/// evict the caches. A 128 MiB stream of copies measured on this project's VM (AMD EPYC, one
/// thread, a C probe): 12.8-15.4 GB/s against glibc's `memcpy` at 8.3-9.5 GB/s, for items of
/// 64 KiB to 16 MiB. The last store is fenced (`sfence`) before this returns, so whatever
/// signals the copy's end (a socket message, a release store) is seen after its bytes.
/// Elsewhere a plain copy.
///
/// # Safety
/// `src..src+len` readable, `dst..dst+len` writable, the two not overlapping.
pub(crate) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's ranges (above); every load and store below stays inside them: the
    // head up to `dst`'s next 64-byte boundary, whole 64-byte lines (the stores 16-byte
    // aligned, as `_mm_stream_si128` needs), then the tail.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = ((dst as usize).wrapping_neg() & 63).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let body = (len - head) & !63;
        let (s, d) = (src.add(head), dst.add(head));
        let mut i = 0;
        while i < body {
            let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
            _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
            _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(s.add(body), d.add(body), len - head - body);
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's ranges (above).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

/// How a [`Buffer`] is allocated.
#[derive(Debug, Clone)]
pub struct BufferOptions {
    /// Ask for huge pages (hugetlbfs when reserved, transparent huge pages otherwise).
    pub huge_pages: bool,
    /// Fault every page in at allocation, so the first transfer does not pay for it.
    pub populate: bool,
    /// Name shown in /proc/PID/maps for the memfd.
    pub name: String,
    /// Back the buffer with a memfd that same-host peers can map (the shm transport). A buffer
    /// only ever used as the local side of transfers can be private anonymous memory instead,
    /// which gets transparent huge pages where shared memory does not (first-touch page
    /// faults cost about 4 us per 4 KiB page in a VM).
    pub shareable: bool,
}

impl Default for BufferOptions {
    fn default() -> Self {
        BufferOptions {
            huge_pages: true,
            populate: false,
            name: "kvfs-buffer".to_string(),
            shareable: true,
        }
    }
}

/// Which page size actually backs a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// hugetlbfs pages (MFD_HUGETLB).
    HugeTlb,
    /// Private anonymous memory with transparent huge pages requested (not shareable).
    TransparentHuge,
    /// Regular pages.
    Regular,
}

/// A page-aligned, memfd-backed memory buffer that can be shared with same-host peers.
///
/// The contents are plain memory that peers may read and write through the engine at any time
/// while the buffer is registered; access it through the copy methods, or through the raw
/// pointer under the same rules as memory registered with an RDMA NIC.
#[derive(Debug)]
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    /// The memfd behind a shareable buffer; `None` for private anonymous memory.
    fd: Option<OwnedFd>,
    pages: PageKind,
}

// SAFETY: the buffer is a plain shared mapping; concurrent access is the documented contract of
// registered memory (as with RDMA), and the mapping itself lives until drop.
unsafe impl Send for Buffer {}
// SAFETY: as above; all methods take `&self` and copy through raw pointers.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Allocates a buffer of at least `len` bytes (rounded up to the page size).
    pub fn new(len: usize, opts: &BufferOptions) -> Result<Buffer> {
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "alloc buffer", "zero length"));
        }
        if !opts.shareable {
            return Buffer::anonymous(len, opts);
        }
        if opts.huge_pages {
            let huge_len = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
            if let Ok(fd) = memfd(&opts.name, libc::MFD_HUGETLB)
                && let Ok(buf) = Buffer::map_new(fd, huge_len, PageKind::HugeTlb, opts.populate)
            {
                return Ok(buf);
            }
        }
        let fd = memfd(&opts.name, 0)?;
        let len = len.div_ceil(PAGE) * PAGE;
        Buffer::map_new(fd, len, PageKind::Regular, opts.populate)
    }

    fn anonymous(len: usize, opts: &BufferOptions) -> Result<Buffer> {
        let (len, pages) = if opts.huge_pages {
            (len.div_ceil(HUGE_PAGE) * HUGE_PAGE, PageKind::TransparentHuge)
        } else {
            (len.div_ceil(PAGE) * PAGE, PageKind::Regular)
        };
        // SAFETY: a fresh private anonymous mapping; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::io("alloc buffer", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Io, "alloc buffer", "mmap returned null"))?;
        let buf = Buffer { ptr, len, fd: None, pages };
        if pages == PageKind::TransparentHuge {
            // SAFETY: advice on exactly our mapping; failure only means small pages.
            unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        }
        if opts.populate {
            buf.touch_pages();
        }
        Ok(buf)
    }

    fn touch_pages(&self) {
        for off in (0..self.len).step_by(PAGE) {
            // SAFETY: off < len, inside the mapping.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
        }
    }

    fn map_new(fd: OwnedFd, len: usize, pages: PageKind, populate: bool) -> Result<Buffer> {
        // SAFETY: fd is a fresh memfd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::io("alloc buffer", std::io::Error::last_os_error()));
        }
        // Seal the size: a peer that maps this memfd can then never be made to fault (SIGBUS) by
        // the file shrinking under its mapping.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::io("seal buffer", std::io::Error::last_os_error()));
        }
        let buf = Buffer::map_fd(fd, len, pages)?;
        // Shared memory gets huge pages only where the kernel allows it for shmem; ask anyway.
        // SAFETY: the range is exactly our mapping; advice failures are harmless.
        unsafe { libc::madvise(buf.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        if populate {
            buf.touch_pages();
        }
        Ok(buf)
    }

    /// Maps `len` bytes of a memfd received from a peer (shm transport), after checking that
    /// the file is at least that long and sealed against shrinking.
    pub(crate) fn map_peer_fd(fd: OwnedFd, len: usize) -> Result<Buffer> {
        // SAFETY: fcntl/fstat on an fd we own, into a local stat struct.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let stat_ok = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0;
        if seals < 0
            || seals & libc::F_SEAL_SHRINK == 0
            || !stat_ok
            || (st.st_size as u64) < len as u64
        {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "map peer buffer",
                "peer sent a descriptor that is not a sealed memfd of the announced size",
            ));
        }
        Buffer::map_fd(fd, len, PageKind::Regular)
    }

    fn map_fd(fd: OwnedFd, len: usize, pages: PageKind) -> Result<Buffer> {
        // SAFETY: a fresh shared mapping of an fd we own; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::io("map buffer", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Io, "map buffer", "mmap returned null"))?;
        Ok(Buffer { ptr, len, fd: Some(fd), pages })
    }

    /// Address of the first byte: what peers name in remote requests.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn page_kind(&self) -> PageKind {
        self.pages
    }

    /// The memfd of a shareable buffer.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len(), "buffer write")?;
        // SAFETY: range checked against the mapping; source is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies `out.len()` bytes from the buffer at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len(), "buffer read")?;
        // SAFETY: range checked against the mapping; destination is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Views the whole buffer as a byte slice.
    ///
    /// # Safety
    /// No peer or other thread may write the viewed bytes while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for len bytes; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Views the whole buffer as a mutable byte slice.
    ///
    /// # Safety
    /// Nothing else may read or write the buffer while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the mapping is valid for len bytes; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn check(&self, offset: usize, len: usize, op: &'static str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::new(
                ErrorKind::InvalidArgument,
                op,
                format!("range {offset}+{len} outside buffer of {} bytes", self.len),
            )),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in map_fd; nothing refers to it any more
        // (every user holds an Arc<Buffer>).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn memfd(name: &str, extra_flags: libc::c_uint) -> Result<OwnedFd> {
    let cname = CString::new(name.replace('\0', "_"))
        .map_err(|e| Error::new(ErrorKind::InvalidArgument, "memfd", e.to_string()))?;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | extra_flags;
    // SAFETY: valid NUL-terminated name; flags are plain bits.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned to us and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One registered region.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub addr: u64,
    pub len: u64,
    /// Peers may read and write it.
    pub remote: bool,
    /// The region's registration with the NIC (rdma feature, device present, registration
    /// succeeded). Declared before `buffer` so that it is deregistered before the buffer unmaps.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub mr: Option<Arc<crate::rdma::Mr>>,
    /// The owned buffer behind the region, when the engine can share it (memfd).
    pub buffer: Option<Arc<Buffer>>,
    /// Whatever keeps raw memory registered with [`crate::Engine::register_memory_owned`]
    /// alive: every transfer using the region holds a clone until it has finished.
    pub owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Device memory: its bytes move only through these calls, never through a slice.
    pub device: Option<Arc<dyn DeviceMemory>>,
    /// Whether a device page-locked this host region ([`DeviceMemory::pin_host`]; unpinned by
    /// it when the region is unregistered), refused to, or was not asked yet.
    pub pin: HostPin,
}

/// A host region's page-locking by a device: asked once, at its first copy with one.
#[derive(Debug, Clone, Default)]
pub(crate) enum HostPin {
    #[default]
    Untried,
    /// The device said no (a memlock limit, say): not asked again.
    Refused,
    By(Arc<dyn DeviceMemory>),
}

impl std::fmt::Debug for dyn DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceMemory")
    }
}

impl Region {
    /// What a transfer through this region holds until it has finished with the memory.
    pub fn hold(&self) -> crate::tcp::Hold {
        use crate::tcp::Hold;
        match (&self.buffer, &self.owner) {
            (Some(b), _) => Hold::Buffer(b.clone()),
            (None, Some(o)) => Hold::Owner(o.clone()),
            (None, None) => Hold::None,
        }
    }

    /// Memory registered for one call ([`crate::Engine::register_memory_owned`]): never pinned,
    /// since pinning costs far more than such a call.
    pub fn per_call(&self) -> bool {
        self.buffer.is_none() && self.owner.is_some() && self.device.is_none()
    }

    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// Memory the CPU cannot address directly (a GPU's memory), registered with
/// [`crate::Engine::register_device_memory`]. The engine moves its bytes through host memory
/// with these two calls (the tcp transport in pieces of at most [`DEVICE_CHUNK_BYTES`] through
/// its staging buffers; the engine's own copies whole ranges, straight from and into the
/// caller's registered memory); offsets count from the start of the registered range. Both block the calling thread until the copy is complete
/// (the engine calls them from threads that may block), and both must be safe to call from
/// several threads at once on disjoint or overlapping ranges (the bytes of overlapping
/// concurrent writes are then unspecified, as with host memory).
pub trait DeviceMemory: Send + Sync + 'static {
    /// Copies `dst.len()` bytes from `offset` into `dst`.
    fn read(&self, offset: u64, dst: &mut [u8]) -> std::result::Result<(), String>;
    /// Copies `src` to `offset`.
    fn write(&self, offset: u64, src: &[u8]) -> std::result::Result<(), String>;
    /// Asks the device to page-lock long-lived host memory registered with the same engine
    /// (owned buffers and `register_memory` ranges, never per-call registrations), so copies
    /// between it and the device run at the copy engine's speed. The engine asks at the first
    /// copy between such a region and device memory, once per region. `true` if it did: the
    /// engine calls [`DeviceMemory::unpin_host`] when the range is unregistered.
    fn pin_host(&self, _addr: u64, _len: u64) -> bool {
        false
    }
    /// Undoes a successful [`DeviceMemory::pin_host`] of the range starting at `addr`.
    fn unpin_host(&self, _addr: u64) {}
}

/// The largest piece of device memory the tcp transport moves through its host staging in one
/// call: big enough to keep a copy engine at speed, small enough that one piece is on the wire
/// while the next is copied.
pub const DEVICE_CHUNK_BYTES: usize = 2 << 20;

/// The regions registered with one engine, indexed by start address.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: RwLock<BTreeMap<u64, Region>>,
}

impl Registry {
    pub fn insert(&self, region: Region) -> Result<()> {
        if region.len == 0 || region.addr.checked_add(region.len).is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "register",
                "empty or wrapping range",
            ));
        }
        let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
        let end = region.addr + region.len;
        let before = map.range(..end).next_back();
        if let Some((_, r)) = before
            && r.addr + r.len > region.addr
        {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "register",
                format!(
                    "range {:#x}+{} overlaps registered {:#x}+{}",
                    region.addr, region.len, r.addr, r.len
                ),
            ));
        }
        map.insert(region.addr, region);
        Ok(())
    }

    /// Records how the pin of the host region starting at `addr` went (`Some(dev)`: `dev`
    /// pinned it; `None`: refused); `false` (a pinning caller then unpins) when the region is
    /// gone or its pin was already recorded.
    pub fn record_pin(&self, addr: u64, by: Option<&Arc<dyn DeviceMemory>>) -> bool {
        let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(&addr) {
            Some(r) if matches!(r.pin, HostPin::Untried) && r.device.is_none() => {
                r.pin = by.map_or(HostPin::Refused, |d| HostPin::By(d.clone()));
                true
            }
            _ => false,
        }
    }

    pub fn remove(&self, addr: u64) -> Result<Region> {
        let mut map = self.regions.write().unwrap_or_else(|e| e.into_inner());
        map.remove(&addr).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                "unregister",
                format!("no region starts at {addr:#x}"),
            )
        })
    }

    /// The region holding the whole of `[addr, addr+len)`, if any.
    pub fn find(&self, addr: u64, len: u64) -> Option<Region> {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (_, r) = map.range(..=addr).next_back()?;
        r.contains(addr, len).then(|| r.clone())
    }

    /// Up to `max` remotely accessible regions from the `start`-th on (in address order), and
    /// whether more follow.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub fn remote_regions(&self, start: usize, max: usize) -> (Vec<Region>, bool) {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let mut it = map.values().filter(|r| r.remote).skip(start);
        let chunk: Vec<Region> = it.by_ref().take(max).cloned().collect();
        (chunk, it.next().is_some())
    }

    /// Start of the lowest remotely accessible region (0: none).
    pub fn first_remote_addr(&self) -> u64 {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        map.values().find(|r| r.remote).map_or(0, |r| r.addr)
    }

    /// Every remotely accessible region backed by a shareable buffer.
    pub fn shareable(&self) -> Vec<Arc<Buffer>> {
        let map = self.regions.read().unwrap_or_else(|e| e.into_inner());
        map.values()
            .filter(|r| r.remote)
            .filter_map(|r| r.buffer.clone())
            .filter(|b| b.fd().is_some())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_move_exactly_their_bytes_at_any_alignment() {
        let src: Vec<u8> = (0..(1usize << 20) + 200).map(|i| (i * 31 + i / 251) as u8).collect();
        let mut dst = vec![0u8; src.len() + 200];
        for (s_off, d_off, len) in [
            (0, 0, 0),
            (0, 0, 63),
            (1, 0, 64),
            (0, 7, 65),
            (3, 61, 1000),
            (5, 17, 256 << 10),
            (64, 64, 1 << 20),
            (13, 130, (1 << 20) + 37),
        ] {
            dst.fill(0xee);
            // SAFETY: both ranges lie inside their vectors, which do not overlap.
            unsafe { copy_streaming(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len) };
            assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "{s_off} {d_off} {len}");
            assert!(dst[..d_off].iter().all(|&b| b == 0xee), "wrote before the range");
            assert!(dst[d_off + len..].iter().all(|&b| b == 0xee), "wrote past the range");
        }
    }

    #[test]
    fn buffer_round_trip_and_bounds() {
        let b = Buffer::new(10_000, &BufferOptions::default()).unwrap();
        assert!(b.len() >= 10_000);
        assert_eq!(b.addr() % PAGE as u64, 0);
        b.write_at(100, b"kvfs").unwrap();
        let mut out = [0u8; 4];
        b.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"kvfs");
        assert_eq!(b.write_at(b.len() - 1, b"xy").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(b.read_at(usize::MAX, &mut out).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert!(Buffer::new(0, &BufferOptions::default()).is_err());
    }

    #[test]
    fn registry_refuses_overlap_and_finds_whole_ranges() {
        let r = Registry::default();
        let region = |addr, len| Region {
            addr,
            len,
            remote: true,
            mr: None,
            buffer: None,
            owner: None,
            device: None,
            pin: HostPin::Untried,
        };
        r.insert(region(1000, 100)).unwrap();
        r.insert(region(1100, 100)).unwrap();
        assert!(r.insert(region(1050, 10)).is_err());
        assert!(r.insert(region(900, 101)).is_err());
        assert!(r.insert(region(u64::MAX - 5, 10)).is_err());
        assert_eq!(r.find(1000, 100).unwrap().addr, 1000);
        assert_eq!(r.find(1150, 50).unwrap().addr, 1100);
        assert!(r.find(1050, 100).is_none(), "a range spanning two regions is not one region");
        assert!(r.find(999, 1).is_none());
        assert!(r.find(1199, 2).is_none());
        let (first, more) = r.remote_regions(0, 1);
        assert_eq!((first[0].addr, more), (1000, true));
        let (rest, more) = r.remote_regions(1, 10);
        assert_eq!((rest.len(), rest[0].addr, more), (1, 1100, false));
        r.remove(1000).unwrap();
        assert!(r.find(1000, 1).is_none());
        assert_eq!(r.remove(1000).unwrap_err().kind(), ErrorKind::NotRegistered);
    }
}
