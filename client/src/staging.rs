//! Staging buffers for the bytes API: registered memfd buffers, reused by size class.
//!
//! `put(key, &[u8])` and `get(key) -> Vec<u8>` hand the engine memory it did not register, so
//! the bytes are staged through a registered buffer (one memcpy, the same cost as the reference
//! system's local buffer). Buffers come in power-of-two size classes from 64 KiB; released
//! buffers are kept for reuse up to `cached_bytes_max` in total, the rest are unregistered and
//! freed. The zero-copy API (`put_from`, `get_into`) never stages.
//!
//! Policy: the bytes staged at once (the sum of the lengths on loan) never exceed
//! `loaned_bytes_max`, the equivalent of the reference system's `local_buffer_size`. A request
//! longer than the whole bound is `InvalidArgument`; one that does not fit next to the loans in
//! flight is `NoSpace` at once (no waiting: the caller sees the back-pressure). Size classes
//! round up, so the memory behind the loans can reach twice the bound.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvfs_transfer::{Buffer, BufferOptions, Engine};

use crate::{Error, ErrorKind, Result};

const CLASS_MIN: usize = 64 << 10;

/// Released buffers by size class, and their total size.
#[derive(Default)]
struct FreeList {
    by_class: BTreeMap<usize, Vec<Arc<Buffer>>>,
    bytes: usize,
}

pub(crate) struct StagingPool {
    engine: Engine,
    cached_bytes_max: usize,
    loaned_bytes_max: usize,
    loaned: AtomicUsize,
    free: Mutex<FreeList>,
}

/// A staging buffer on loan; it goes back to the pool when dropped.
pub(crate) struct Staged {
    pool: Arc<StagingPool>,
    buf: Option<Arc<Buffer>>,
    len: usize,
}

impl Staged {
    pub fn buffer(&self) -> &Buffer {
        self.buf.as_ref().expect("staged buffer present until drop")
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.pool.loaned.fetch_sub(self.len, Ordering::AcqRel);
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf);
        }
    }
}

impl StagingPool {
    pub fn new(
        engine: Engine,
        cached_bytes_max: usize,
        loaned_bytes_max: usize,
    ) -> Arc<StagingPool> {
        Arc::new(StagingPool {
            engine,
            cached_bytes_max,
            loaned_bytes_max,
            loaned: AtomicUsize::new(0),
            free: Mutex::new(FreeList::default()),
        })
    }

    pub fn take(self: &Arc<Self>, len: usize) -> Result<Staged> {
        self.reserve(len)?;
        // From here on `Staged` owns the reservation: every early return releases it.
        let mut staged = Staged { pool: self.clone(), buf: None, len };
        let class = len.max(1).next_power_of_two().max(CLASS_MIN);
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            let buf = free.by_class.get_mut(&class).and_then(Vec::pop);
            if buf.is_some() {
                free.bytes -= class;
            }
            buf
        };
        let buf = match reused {
            Some(b) => b,
            None => {
                let opts =
                    BufferOptions { name: "kvfs-staging".into(), ..BufferOptions::default() };
                let b = Arc::new(
                    Buffer::new(class, &opts).map_err(|e| Error::from_transfer("staging", &e))?,
                );
                self.engine
                    .register_buffer(b.clone(), false)
                    .map_err(|e| Error::from_transfer("staging", &e))?;
                b
            }
        };
        staged.buf = Some(buf);
        Ok(staged)
    }

    /// Counts `len` bytes against the loan bound, or says why it cannot.
    fn reserve(&self, len: usize) -> Result<()> {
        if len > self.loaned_bytes_max {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "staging",
                format!(
                    "{len} bytes exceed the staging bound of {} bytes (local buffer size)",
                    self.loaned_bytes_max
                ),
            ));
        }
        let mut cur = self.loaned.load(Ordering::Acquire);
        loop {
            if cur + len > self.loaned_bytes_max {
                return Err(Error::new(
                    ErrorKind::NoSpace,
                    "staging",
                    format!(
                        "{len} bytes do not fit next to {cur} bytes already staged (bound {})",
                        self.loaned_bytes_max
                    ),
                ));
            }
            match self.loaned.compare_exchange_weak(
                cur,
                cur + len,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Keeps a released buffer for reuse. When the cache is full, buffers of the class holding
    /// the most bytes (other than this one's) make room: a workload that moves on to a new
    /// object size gets its buffers cached instead of a fresh, unfaulted memfd per call.
    fn give_back(&self, buf: Arc<Buffer>) {
        let class = buf.len();
        let mut evicted = Vec::new();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while class <= self.cached_bytes_max && free.bytes + class > self.cached_bytes_max {
            let Some(victim) = free
                .by_class
                .iter()
                .filter(|(c, v)| **c != class && !v.is_empty())
                .max_by_key(|(c, v)| **c * v.len())
                .map(|(c, _)| *c)
            else {
                break;
            };
            if let Some(b) = free.by_class.get_mut(&victim).and_then(Vec::pop) {
                free.bytes -= victim;
                evicted.push(b);
            }
        }
        if free.bytes + class <= self.cached_bytes_max {
            free.bytes += class;
            free.by_class.entry(class).or_default().push(buf);
        } else {
            evicted.push(buf);
        }
        drop(free);
        for b in evicted {
            let _ = self.engine.unregister(b.addr());
        }
    }
}

/// Asks for transparent huge pages on the whole 2 MiB pages inside `[addr, addr + len)`, before
/// fresh memory is first touched (harmless if refused; nothing for ranges under 2 MiB).
pub fn advise_huge_pages(addr: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    let start = addr.next_multiple_of(HUGE);
    let end = addr.saturating_add(len) & !(HUGE - 1);
    if end > start {
        // SAFETY: advice only, on pages inside the caller's own allocation.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Faults in `[addr, addr+len)` for writing in one call (`MADV_POPULATE_WRITE`, Linux 5.14),
/// after [`advise_huge_pages`]: a destination that a transfer is about to fill then takes no
/// page fault per page while the bytes arrive (in a VM a fault costs more than the copy, and
/// several connections faulting one region in parallel contend on it). Advice only: an older
/// kernel leaves the pages to be faulted on first touch.
pub fn prefault(addr: usize, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let page = 4096;
    let start = addr.next_multiple_of(page);
    let end = addr.saturating_add(len) & !(page - 1);
    if end > start {
        // SAFETY: advice only, on pages inside the caller's own writable allocation.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, MADV_POPULATE_WRITE) };
    }
}

/// A vector of `len` bytes copied from `src`, with transparent huge pages requested before the
/// first touch: returning fresh memory costs a page fault per 4 KiB page otherwise, which in a
/// VM is slower than the copy itself.
pub(crate) fn vec_from(src: &Buffer, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(len);
    advise_huge_pages(v.as_ptr() as usize, len);
    assert!(len <= src.len(), "staging buffer smaller than the object");
    // SAFETY: `len` bytes are readable in `src` (checked) and writable in the capacity of `v`;
    // the ranges are distinct allocations. After the copy the first `len` bytes are initialised.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), v.as_mut_ptr(), len);
        v.set_len(len);
    }
    v
}

/// Largest allocation glibc serves from the heap instead of an `mmap` of its own once
/// [`keep_freed_buffers`] ran; twice this much freed memory stays mapped at the heap's top.
const HEAP_BUFFER_BYTES_MAX: i32 = 256 << 20;

/// Keeps large freed buffers in the process heap for reuse (glibc `mallopt`). With glibc's
/// defaults a buffer above 32 MiB (a `Vec` from [`crate::Client::get`], a Python `bytes`) is
/// an `mmap` of its own: every get of a large object faults in fresh pages (16384 faults for 64 MiB, which in a VM take longer than the
/// transfer) and every free unmaps them again. Allocations up to [`HEAP_BUFFER_BYTES_MAX`] come
/// from the heap instead and up to twice that of freed memory stays mapped, so the next get's
/// bytes land on pages already faulted in (side by side, a 64 MiB `get` over tcp goes from
/// about 1.1 to 3.5 GB/s). The cost: the process keeps up to 512 MiB of freed memory mapped.
/// `KVFS_MALLOC_TUNING=0` leaves glibc's defaults. Process-wide: the Python package calls it
/// at import, `kvfs bench store` at start; a Rust program that gets large objects again and
/// again should call it once too.
pub fn keep_freed_buffers() {
    if std::env::var("KVFS_MALLOC_TUNING").is_ok_and(|v| v == "0") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_BUFFER_BYTES_MAX);
        libc::mallopt(libc::M_TRIM_THRESHOLD, HEAP_BUFFER_BYTES_MAX * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn loans_are_bounded_and_released() {
        let engine = Engine::start(kvfs_transfer::EngineConfig::default()).await.unwrap();
        let pool = StagingPool::new(engine, 1 << 20, 256 << 10);
        assert_eq!(pool.take(300 << 10).err().map(|e| e.kind()), Some(ErrorKind::InvalidArgument));
        let a = pool.take(200 << 10).unwrap();
        assert_eq!(pool.take(100 << 10).err().map(|e| e.kind()), Some(ErrorKind::NoSpace));
        let b = pool.take(56 << 10).unwrap();
        drop(a);
        let c = pool.take(200 << 10).unwrap();
        drop((b, c));
        assert_eq!(pool.loaned.load(Ordering::Acquire), 0);
        let zero = StagingPool::new(pool.engine.clone(), 0, 0);
        assert!(zero.take(1).is_err());
    }

    #[tokio::test]
    async fn a_new_size_class_evicts_the_biggest_other_one_when_the_cache_is_full() {
        let engine = Engine::start(kvfs_transfer::EngineConfig::default()).await.unwrap();
        let pool = StagingPool::new(engine, 1 << 20, 4 << 20);
        let small: Vec<_> = (0..4).map(|_| pool.take(200 << 10).unwrap()).collect();
        drop(small); // four 256 KiB buffers: the cache (1 MiB) is full
        let big = pool.take(1 << 20).unwrap();
        let addr = big.buffer().addr();
        drop(big);
        let again = pool.take(1 << 20).unwrap();
        assert_eq!(again.buffer().addr(), addr, "the 1 MiB buffer was kept and reused");
        let free = pool.free.lock().unwrap();
        assert_eq!(free.bytes, 0);
    }
}
