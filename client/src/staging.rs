//! Staging buffers for the bytes API: registered memfd buffers, reused by size class.
//!
//! `put(key, &[u8])` and `get(key) -> Vec<u8>` hand the engine memory it did not register, so
//! the bytes are staged through a registered buffer (one memcpy, the same cost as the reference
//! system's local buffer). Buffers come in power-of-two size classes from 64 KiB; released
//! buffers are kept for reuse up to `cached_bytes_max` in total, the rest are unregistered and
//! freed. The zero-copy API (`put_from`, `get_into`) never stages.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvfs_transfer::{Buffer, BufferOptions, Engine};

use crate::{Error, Result};

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
    free: Mutex<FreeList>,
}

/// A staging buffer on loan; it goes back to the pool when dropped.
pub(crate) struct Staged {
    pool: Arc<StagingPool>,
    buf: Option<Arc<Buffer>>,
}

impl Staged {
    pub fn buffer(&self) -> &Buffer {
        self.buf.as_ref().expect("staged buffer present until drop")
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf);
        }
    }
}

impl StagingPool {
    pub fn new(engine: Engine, cached_bytes_max: usize) -> Arc<StagingPool> {
        Arc::new(StagingPool { engine, cached_bytes_max, free: Mutex::new(FreeList::default()) })
    }

    pub fn take(self: &Arc<Self>, len: usize) -> Result<Staged> {
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
        Ok(Staged { pool: self.clone(), buf: Some(buf) })
    }

    fn give_back(&self, buf: Arc<Buffer>) {
        let class = buf.len();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.bytes + class <= self.cached_bytes_max {
            free.bytes += class;
            free.by_class.entry(class).or_default().push(buf);
        } else {
            drop(free);
            let _ = self.engine.unregister(buf.addr());
        }
    }
}

/// A vector of `len` bytes copied from `src`, with transparent huge pages requested before the
/// first touch: returning fresh memory costs a page fault per 4 KiB page otherwise, which in a
/// VM is slower than the copy itself.
pub(crate) fn vec_from(src: &Buffer, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(len);
    const HUGE: usize = 2 << 20;
    let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (v.as_ptr() as usize + len) & !(HUGE - 1);
    if end > start {
        // SAFETY: advice on whole huge pages inside the vector's own allocation; harmless if
        // refused.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    assert!(len <= src.len(), "staging buffer smaller than the object");
    // SAFETY: `len` bytes are readable in `src` (checked) and writable in the capacity of `v`;
    // the ranges are distinct allocations. After the copy the first `len` bytes are initialised.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), v.as_mut_ptr(), len);
        v.set_len(len);
    }
    v
}
