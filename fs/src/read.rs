//! Opening and reading objects through FUSE.
//!
//! Mechanism. Open asks the master for the object's current version (one `stat`, no lease).
//! When it is the version this inode last showed, the open keeps the kernel's page cache
//! (`FOPEN_KEEP_CACHE`): objects never change, so a warm file is read without the daemon. A
//! new version (an upsert) drops the cache instead. The bytes are fetched on the first read that
//! reaches the daemon, whole, with one zero-copy get into a registered buffer (which takes a
//! read lease), and shared by every handle of the inode until the last one closes; reads are
//! slices of it. Fetch buffers are pooled (registered and faulted in) for the next fetch.
//! An object in a local file is opened in passthrough mode instead
//! ([`crate::passthrough`]), and the daemon never sees its reads.
//!
//! Limits: fetched bytes held by open files are bounded by `fetch_bytes_max` (a read waits for
//! room up to the operation timeout, then fails with `ENOMEM`); an object larger than the whole
//! budget cannot be read through FUSE (`EFBIG`) — the fast path has no such limit.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvfs_transfer::{Buffer, BufferOptions, Engine};

use crate::errno;
use crate::inode::{Kind, ObjAttr};
use crate::state::{Errno, FETCH_UNIT, Inner, bump, lock};

/// An object's bytes, fetched for FUSE reads.
pub struct Fetched {
    buf: Option<Arc<Buffer>>,
    pub size: u64,
    pub version: u64,
    pool: Arc<FetchPool>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Fetched {
    /// `[offset, offset+len)` clipped to the object.
    pub fn slice(&self, offset: u64, len: u32) -> &[u8] {
        let start = offset.min(self.size) as usize;
        let end = offset.saturating_add(len as u64).min(self.size) as usize;
        let Some(buf) = &self.buf else { return &[] };
        // SAFETY: the buffer is registered only with our own engine for the get that filled
        // it, which completed; nothing writes it until it goes back to the pool (when `self`
        // is dropped), and it lives as long as `self`.
        let all = unsafe { buf.as_slice() };
        &all[start..end]
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}

/// Registered buffers for fetches, kept (faulted in and registered) for the next cold read:
/// power-of-two size classes from 64 KiB, at most `cached_bytes_max` idle in total.
pub struct FetchPool {
    engine: Engine,
    cached_bytes_max: u64,
    free: std::sync::Mutex<FreeBuffers>,
}

/// Idle buffers by size class, and their total size.
type FreeBuffers = (std::collections::BTreeMap<usize, Vec<Arc<Buffer>>>, u64);

impl FetchPool {
    pub fn new(engine: Engine, cached_bytes_max: u64) -> Arc<FetchPool> {
        Arc::new(FetchPool { engine, cached_bytes_max, free: Default::default() })
    }

    fn take(&self, len: usize) -> Result<Arc<Buffer>, Errno> {
        let class = len.max(1).next_power_of_two().max(64 << 10);
        {
            let mut free = lock(&self.free);
            if let Some(b) = free.0.get_mut(&class).and_then(Vec::pop) {
                free.1 -= class as u64;
                return Ok(b);
            }
        }
        let opts = BufferOptions { name: "kvfs-fuse-read".into(), ..BufferOptions::default() };
        let buf = Arc::new(Buffer::new(class, &opts).map_err(|_| libc::ENOMEM)?);
        self.engine.register_buffer(buf.clone(), false).map_err(|_| libc::ENOMEM)?;
        Ok(buf)
    }

    fn give(&self, buf: Arc<Buffer>) {
        let class = buf.len();
        let mut free = lock(&self.free);
        if free.1 + class as u64 <= self.cached_bytes_max {
            free.1 += class as u64;
            free.0.entry(class).or_default().push(buf);
        } else {
            drop(free);
            let _ = self.engine.unregister(buf.addr());
        }
    }
}

/// An object opened for reading through the daemon.
pub struct ReadHandle {
    pub ino: u64,
    pub key: String,
    pub attr: ObjAttr,
    bytes: tokio::sync::OnceCell<Arc<Fetched>>,
}

impl ReadHandle {
    pub fn new(ino: u64, key: String, attr: ObjAttr) -> ReadHandle {
        ReadHandle { ino, key, attr, bytes: tokio::sync::OnceCell::new() }
    }
}

/// How an open will be answered.
pub enum OpenPlan {
    /// Control, status and job files: the text, read with direct I/O.
    Text(Arc<Vec<u8>>),
    /// Reads come to the daemon.
    Cached { handle: Arc<ReadHandle>, keep_cache: bool },
    /// The inode already has a backing file open.
    PassthroughReuse(Arc<fuser::BackingId>),
    /// Register this file with the kernel as the inode's backing file (or read `key` through
    /// the daemon if the kernel refuses).
    PassthroughNew { fd: OwnedFd, key: String, attr: ObjAttr },
    /// `O_TRUNC` for writing: a writer replacing the object at its commit.
    Replace(Arc<tokio::sync::Mutex<crate::write::Writer>>),
}

impl Inner {
    /// `replace`: a write-only open (not appending) of an existing object becomes a writer
    /// that replaces it once truncated to 0 (the kernel's setattr of an `O_TRUNC` open); any
    /// write before that is `EPERM`, as is every other write open of an object.
    pub async fn plan_open(&self, ino: u64, write: bool, replace: bool) -> Result<OpenPlan, Errno> {
        let kind = self.kind_of(ino)?;
        if write && matches!(kind, Kind::Control | Kind::Status(_) | Kind::Job(_)) {
            return Err(libc::EPERM);
        }
        let key = match kind {
            Kind::Control => return Ok(OpenPlan::Text(Arc::new(crate::control::control_text()))),
            Kind::Status(i) => {
                return Ok(OpenPlan::Text(Arc::new(crate::control::render(self, i).await)));
            }
            Kind::Job(id) => {
                let s = crate::control::job(self, id).await?;
                return Ok(OpenPlan::Text(Arc::new(crate::control::render_job(&s))));
            }
            Kind::Object { key } => key,
            Kind::Dir(_) | Kind::ControlDir | Kind::JobsDir => return Err(libc::EISDIR),
            // The kernel looks the name up again and opens what it names now.
            Kind::Unlinked(_) => return Err(libc::ESTALE),
        };
        if lock(&self.pending).contains_key(&key) {
            return Err(libc::EBUSY);
        }
        if write && !replace {
            return Err(libc::EPERM);
        }
        let v = self.client.stat(&key).await.map_err(|e| errno::of(&e))?;
        let attr = ObjAttr { size: v.size, version: v.version };
        if write {
            return Ok(OpenPlan::Replace(self.open_replace(ino, key, attr)));
        }
        let cached = {
            let mut t = lock(&self.table);
            let n = t.get_mut(ino).ok_or(libc::ENOENT)?;
            // Detached (unlinked, replaced) while the stat ran: the name has a new inode.
            if !matches!(&n.kind, Kind::Object { key: k } if *k == key) {
                return Err(libc::ESTALE);
            }
            // The kernel sized this inode for another object (the name was replaced or renamed
            // over since it last heard): reading the new one through it would be cut to the old
            // size. ESTALE makes it look the name up again (new attributes) and retry the open.
            if n.attr.is_some_and(|p| p.version != 0 && p.version != attr.version) {
                return Err(libc::ESTALE);
            }
            n.attr = Some(attr);
            std::mem::replace(&mut n.cached, attr.version)
        };
        bump(&self.counters.opens, 1);
        if let Some(plan) = self.plan_passthrough(ino, &key, attr).await {
            bump(&self.counters.passthrough_opens, 1);
            return Ok(plan);
        }
        *lock(&self.cached_opens).entry(ino).or_insert(0) += 1;
        let keep_cache = cached == attr.version;
        let handle = Arc::new(ReadHandle::new(ino, key, attr));
        Ok(OpenPlan::Cached { handle, keep_cache })
    }

    async fn plan_passthrough(&self, ino: u64, key: &str, attr: ObjAttr) -> Option<OpenPlan> {
        let source = self.cfg.passthrough.clone()?;
        if !self.passthrough_works.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(id) = lock(&self.backings).reuse(ino) {
            return Some(OpenPlan::PassthroughReuse(id));
        }
        // The kernel refuses passthrough on an inode with cached opens.
        if lock(&self.cached_opens).get(&ino).is_some_and(|&n| n > 0) {
            return None;
        }
        let k = key.to_string();
        let (fd, len) =
            tokio::task::spawn_blocking(move || source.object_file(&k)).await.ok()??;
        // Passthrough reads the backing file to its end: it must hold the object exactly.
        (len == attr.size).then(|| OpenPlan::PassthroughNew { fd, key: key.to_string(), attr })
    }

    /// A read handle closed.
    pub fn close_cached(&self, ino: u64) {
        let mut c = lock(&self.cached_opens);
        if let Some(n) = c.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                c.remove(&ino);
                lock(&self.fetched).remove(&ino);
            }
        }
    }

    /// The bytes of an open object, fetched on first use.
    pub async fn bytes(&self, h: &ReadHandle) -> Result<Arc<Fetched>, Errno> {
        h.bytes.get_or_try_init(|| self.fetch(h)).await.cloned()
    }

    async fn fetch(&self, h: &ReadHandle) -> Result<Arc<Fetched>, Errno> {
        if let Some(f) = lock(&self.fetched).get(&h.ino).and_then(|w| w.upgrade())
            && f.version == h.attr.version
        {
            return Ok(f);
        }
        let size = h.attr.size.max(1);
        if size > self.cfg.fetch_bytes_max {
            return Err(libc::EFBIG);
        }
        let units = size.div_ceil(FETCH_UNIT) as u32;
        let wait = Duration::from_millis(self.cfg.op_timeout_ms);
        let permit =
            tokio::time::timeout(wait, self.fetch_budget.clone().acquire_many_owned(units))
                .await
                .map_err(|_| libc::ENOMEM)?
                .map_err(|_| libc::ENOMEM)?;
        let buf = self.fetch_pool.take(size as usize)?;
        let got = self.client.get_into_version(&h.key, buf.addr(), buf.len() as u64).await;
        // A new object under the name since this file was opened (replaced, renamed over):
        // its bytes are not this file's, and mixing them with its size would show a partial
        // object.
        let got = match got {
            Ok((_, version)) if version != h.attr.version => Err(libc::ESTALE),
            Ok((size, _)) => Ok(size),
            // Larger than the object this file was opened on: a newer one has the name.
            Err(e) if e.kind() == kvfs_client::ErrorKind::BufferTooSmall => Err(libc::ESTALE),
            Err(e) => Err(errno::of(&e)),
        };
        let f = Arc::new(Fetched {
            size: *got.as_ref().unwrap_or(&0),
            buf: Some(buf),
            version: h.attr.version,
            pool: self.fetch_pool.clone(),
            _permit: permit,
        });
        let size = got?;
        bump(&self.counters.fetches, 1);
        bump(&self.counters.fetch_bytes, size);
        lock(&self.fetched).insert(h.ino, Arc::downgrade(&f));
        Ok(f)
    }
}
