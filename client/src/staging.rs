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
