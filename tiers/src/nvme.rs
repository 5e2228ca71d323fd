//! NVMe medium: one file per object in a directory on a local disk, through io_uring with
//! O_DIRECT and registered staging buffers.
//!
//! On disk (under the medium's `dir`):
//! - `objects/<d0d1>/<digest>`: one object; `digest` is the 64-hex blake3 of the key, `d0d1` its
//!   first two characters (256 sub-directories keep directories small). The file is the
//!   [`crate::header`] record padded to 4 KiB (8 KiB for keys over 3992 bytes), then the data,
//!   zero-padded to a multiple of 4 KiB. Its length is exactly header + padded data.
//! - `tmp/`: files being written; whatever is there at `open` is a crash leftover and is deleted.
//! - `LOCK`: held with `flock` while a medium has the directory open (a second open fails with
//!   `Unavailable`; the kernel drops the lock when the process dies).
//! - `quarantine/`: files found at `open` whose header does not verify, moved aside for an
//!   operator (never deleted, never served).
//!
//! Write (crash-safe): reserve capacity, write data chunks to `tmp/<digest>.<pid>.<n>` at
//! `queue_depth` in flight while hashing them, write the header (with the data's blake3) last,
//! fsync the file, rename it over `objects/..`, fsync the directory. A crash at any point leaves
//! either the old object, the new object, or a temp file that `open` removes.
//!
//! Read: open, read and verify the header (magic, version, header checksum, key, file length),
//! then read the data at `queue_depth` in flight straight into the destination when it is
//! 4 KiB aligned (through a staging slot otherwise), hashing each chunk while the next ones
//! are in flight. A checksum mismatch is `Corrupt` and counted in [`NvmeStats`].
//!
//! Invariants: the in-memory index holds exactly the objects whose rename has happened;
//! renames, unlinks and index updates happen under one lock, so the index and the directory
//! agree even with concurrent overwrites and removes of the same key. `used_bytes` counts file
//! bytes (header + padded data) of indexed objects plus reservations of puts in progress.
//!
//! Not handled: data-corruption scanning at `open` (headers only; data is verified on every
//! read), durability of `remove` (a removed object may reappear after a crash; it is still a
//! valid, verified object), quotas per namespace.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::error::{Error, ErrorKind, Result};
use crate::header::{self, round_up};
use crate::medium::{
    Capabilities, Medium, ObjectMeta, PutMode, PutOptions, check_dst, key_digest_hex, now_unix_ms,
    usize_from, validate_key,
};
use crate::uring::{AlignedBuf, BLOCK_BYTES, Dir, IoPool, RingConfig, RingCtx, SendPtr};

/// Configuration of an NVMe medium.
#[derive(Debug, Clone)]
pub struct NvmeConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// The most file bytes (headers and padding included) the medium may hold.
    pub capacity_bytes: u64,
    pub ring: RingConfig,
}

impl NvmeConfig {
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        NvmeConfig { dir: dir.into(), capacity_bytes, ring: RingConfig::default() }
    }
}

/// What `open` found in an existing directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub objects: usize,
    pub bytes: u64,
    /// Half-written temp files deleted.
    pub temp_files_removed: usize,
    /// Files whose header did not verify, moved to `quarantine/`.
    pub quarantined: usize,
}

/// Counters of an NVMe medium.
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmeStats {
    pub objects: usize,
    pub used_bytes: u64,
    /// Reads that failed verification (header or data checksum, truncation).
    pub corrupt_reads: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    meta: ObjectMeta,
    file_bytes: u64,
}

#[derive(Default)]
struct Index {
    ready: HashMap<String, Entry>,
    creating: HashSet<String>,
}

struct Inner {
    /// Holds an exclusive `flock` on `dir/LOCK` for the medium's life.
    _lock: File,
    dir: PathBuf,
    capacity_bytes: u64,
    used_bytes: AtomicU64,
    corrupt_reads: AtomicU64,
    tmp_seq: AtomicU64,
    index: Mutex<Index>,
}

/// Objects as files on a local disk, through io_uring and O_DIRECT.
pub struct NvmeMedium {
    inner: Arc<Inner>,
    pool: Arc<IoPool>,
}

fn lock(m: &Mutex<Index>) -> MutexGuard<'_, Index> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes a file of an object takes.
pub fn file_bytes(key: &str, size_bytes: u64) -> u64 {
    (round_up(header::FIXED_BYTES + key.len(), BLOCK_BYTES)
        + round_up(size_bytes as usize, BLOCK_BYTES)) as u64
}

impl Inner {
    fn object_path(&self, key: &str) -> PathBuf {
        let d = key_digest_hex(key);
        self.dir.join("objects").join(&d[..2]).join(d)
    }

    fn release(&self, bytes: u64) {
        self.used_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn reserve(&self, bytes: u64, key: &str) -> Result<()> {
        let cap = self.capacity_bytes;
        self.used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|n| *n <= cap)
            })
            .map(drop)
            .map_err(|u| {
                Error::new(
                    ErrorKind::NoSpace,
                    format!("nvme put {key:?}: {bytes} bytes do not fit ({u} of {cap} used)"),
                )
            })
    }

    fn corrupt(&self, e: Error) -> Error {
        if e.kind() == ErrorKind::Corrupt {
            self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        }
        e
    }
}

fn open_direct(path: &Path, write: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    if write {
        o.write(true).create_new(true);
    } else {
        o.read(true);
    }
    o.custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("open {}", path.display()), e))
}

/// Take the directory's lock so two processes never share one NVMe directory.
fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join("LOCK");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!("{} is in use by another medium", dir.display()),
        )
        .with_source(std::io::Error::last_os_error()));
    }
    Ok(f)
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(format!("fsync dir {}", dir.display()), e))
}

/// Read and verify the header of an open object file.
fn read_header(ctx: &mut RingCtx, f: &File, path: &Path) -> Result<header::Header> {
    let fd = f.as_raw_fd();
    let first = ctx.read_block(fd, 0, BLOCK_BYTES)?;
    let hlen = header::header_len(&first)?;
    let hdr = if hlen > BLOCK_BYTES {
        ctx.read_block(fd, 0, round_up(hlen, BLOCK_BYTES))?
    } else {
        first
    };
    let h = header::decode(&hdr).map_err(|e| e.context(path.display()))?;
    let file_len = f.metadata().map_err(|e| Error::io("fstat", e))?.len();
    let want = (h.header_bytes + round_up(usize_from(h.meta.size_bytes)?, BLOCK_BYTES)) as u64;
    if file_len < want {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("{}: file has {file_len} bytes, header says {want}", path.display()),
        ));
    }
    Ok(h)
}

/// Write one object to a new temp file; returns its meta. Runs on a ring thread.
fn write_object(
    ctx: &mut RingCtx,
    tmp: &Path,
    key: &str,
    data: SendPtr,
    size: usize,
    opts: PutOptions,
) -> Result<ObjectMeta> {
    let f = open_direct(tmp, true)?;
    let fd = f.as_raw_fd();
    let hlen = round_up(header::FIXED_BYTES + key.len(), BLOCK_BYTES);
    let total = (hlen + round_up(size, BLOCK_BYTES)) as libc::off_t;
    if total > 0 {
        // One extent up front instead of block allocation chunk by chunk.
        // SAFETY: fallocate on a descriptor we own.
        let r = unsafe { libc::fallocate(fd, 0, 0, total) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(Error::io(format!("fallocate {}", tmp.display()), e));
            }
        }
    }
    let mut hasher = blake3::Hasher::new();
    // SAFETY: `data` points at the caller's `size` bytes, kept alive by IoPool::run.
    unsafe { ctx.pipeline(Dir::Write, fd, hlen as u64, data.0, size, Some(&mut hasher)) }?;
    let sum = *hasher.finalize().as_bytes();
    if let Some(want) = opts.checksum
        && want != sum
    {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("nvme put {key:?}: data does not match the writer's checksum"),
        ));
    }
    let meta = ObjectMeta {
        size_bytes: size as u64,
        checksum: sum,
        persistence: opts.persistence,
        stored_at_unix_ms: now_unix_ms(),
    };
    let encoded = header::encode(key, &meta, BLOCK_BYTES);
    let mut hb = AlignedBuf::new(encoded.len());
    hb.copy_from_slice(&encoded);
    let p = hb.as_mut_ptr();
    // SAFETY: hb is an aligned buffer owned here.
    unsafe { ctx.pipeline(Dir::Write, fd, 0, p, encoded.len(), None) }?;
    ctx.fsync(fd)?;
    Ok(meta)
}

/// Read one object into `dst`, verified. Runs on a ring thread.
fn read_object(
    ctx: &mut RingCtx,
    path: &Path,
    key: &str,
    dst: SendPtr,
    dst_len: usize,
) -> Result<ObjectMeta> {
    let f = match open_direct(path, false) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")));
        }
        r => r?,
    };
    let h = read_header(ctx, &f, path)?;
    if h.key != key {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("{}: holds key {:?}, not {key:?}", path.display(), h.key),
        ));
    }
    let size = check_dst(key, dst_len, h.meta.size_bytes)?;
    let mut hasher = blake3::Hasher::new();
    // SAFETY: dst is the caller's buffer of dst_len >= size bytes, kept alive by IoPool::run.
    unsafe {
        ctx.pipeline(
            Dir::Read,
            f.as_raw_fd(),
            h.header_bytes as u64,
            dst.0,
            size,
            Some(&mut hasher),
        )
    }?;
    if hasher.finalize().as_bytes() != &h.meta.checksum {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("nvme get {key:?}: data checksum mismatch ({})", path.display()),
        ));
    }
    Ok(h.meta)
}

impl NvmeMedium {
    /// Open (or create) the directory and rebuild the index from the object headers.
    /// Blocking: it reads every header; call it at start-up or from `spawn_blocking`.
    pub fn open(cfg: NvmeConfig) -> Result<(Self, OpenReport)> {
        fs::create_dir_all(&cfg.dir)
            .map_err(|e| Error::io(format!("create {}", cfg.dir.display()), e))?;
        let lock_file = lock_dir(&cfg.dir)?;
        let pool = IoPool::new(cfg.ring, "nvme")?;
        for sub in ["objects", "tmp", "quarantine"] {
            let p = cfg.dir.join(sub);
            fs::create_dir_all(&p).map_err(|e| Error::io(format!("create {}", p.display()), e))?;
        }
        let mut report = OpenReport::default();
        let tmp = cfg.dir.join("tmp");
        for e in fs::read_dir(&tmp).map_err(|e| Error::io(format!("read {}", tmp.display()), e))? {
            let e = e.map_err(|e| Error::io("read tmp", e))?;
            fs::remove_file(e.path())
                .map_err(|err| Error::io(format!("remove {}", e.path().display()), err))?;
            report.temp_files_removed += 1;
        }
        let mut index = Index::default();
        scan_objects(&cfg.dir, &mut index, &mut report)?;
        report.objects = index.ready.len();
        let inner = Inner {
            _lock: lock_file,
            dir: cfg.dir,
            capacity_bytes: cfg.capacity_bytes,
            used_bytes: AtomicU64::new(report.bytes),
            corrupt_reads: AtomicU64::new(0),
            tmp_seq: AtomicU64::new(0),
            index: Mutex::new(index),
        };
        tracing::info!(objects = report.objects, bytes = report.bytes, temp_removed = report.temp_files_removed,
            quarantined = report.quarantined, dir = %inner.dir.display(), "nvme medium opened");
        Ok((NvmeMedium { inner: Arc::new(inner), pool }, report))
    }

    /// The file that holds `key` (whether or not it exists), for tools and tests.
    pub fn object_path(&self, key: &str) -> PathBuf {
        self.inner.object_path(key)
    }

    pub fn stats(&self) -> NvmeStats {
        NvmeStats {
            objects: lock(&self.inner.index).ready.len(),
            used_bytes: self.inner.used_bytes.load(Ordering::Acquire),
            corrupt_reads: self.inner.corrupt_reads.load(Ordering::Relaxed),
        }
    }

    pub fn ring_config(&self) -> RingConfig {
        self.pool.config()
    }

    /// Rename the finished temp file into place and index it (under the index lock).
    fn commit(
        &self,
        key: &str,
        tmp: &Path,
        meta: ObjectMeta,
        fbytes: u64,
        mode: PutMode,
    ) -> Result<()> {
        let path = self.inner.object_path(key);
        let mut idx = lock(&self.inner.index);
        if mode == PutMode::CreateNew && idx.ready.contains_key(key) {
            return Err(Error::new(ErrorKind::AlreadyExists, format!("nvme: {key:?}")));
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .map_err(|e| Error::io(format!("create {}", parent.display()), e))?;
        }
        fs::rename(tmp, &path)
            .map_err(|e| Error::io(format!("rename to {}", path.display()), e))?;
        if let Some(old) = idx.ready.insert(key.to_owned(), Entry { meta, file_bytes: fbytes }) {
            self.inner.release(old.file_bytes);
        }
        Ok(())
    }
}

fn scan_objects(dir: &Path, index: &mut Index, report: &mut OpenReport) -> Result<()> {
    let objects = dir.join("objects");
    let rd = |p: &Path| fs::read_dir(p).map_err(|e| Error::io(format!("read {}", p.display()), e));
    for sub in rd(&objects)? {
        let sub = sub.map_err(|e| Error::io("read objects", e))?.path();
        if !sub.is_dir() {
            continue;
        }
        for f in rd(&sub)? {
            let path = f.map_err(|e| Error::io("read objects", e))?.path();
            match check_file(&path) {
                Ok((key, entry)) => {
                    report.bytes += entry.file_bytes;
                    index.ready.insert(key, entry);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "quarantining object file");
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    let to = dir.join("quarantine").join(format!("{name}.{}", now_unix_ms()));
                    fs::rename(&path, &to)
                        .map_err(|e| Error::io(format!("quarantine {}", path.display()), e))?;
                    report.quarantined += 1;
                }
            }
        }
    }
    Ok(())
}

/// Verify an object file's header, name and length (not its data).
fn check_file(path: &Path) -> Result<(String, Entry)> {
    let mut f = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let mut buf = vec![0u8; header::HEADER_BYTES_MAX];
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
        }
    }
    let h = header::decode(&buf[..got])?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if key_digest_hex(&h.key) != name {
        return Err(Error::new(ErrorKind::Corrupt, "file name is not the digest of its key"));
    }
    let len = f.metadata().map_err(|e| Error::io("stat", e))?.len();
    let want = (h.header_bytes + round_up(usize_from(h.meta.size_bytes)?, BLOCK_BYTES)) as u64;
    if len != want {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("file has {len} bytes, header says {want}"),
        ));
    }
    Ok((h.key, Entry { meta: h.meta, file_bytes: len }))
}

/// Undoes a put's reservations unless disarmed.
struct PutGuard<'a> {
    inner: &'a Inner,
    key: &'a str,
    bytes: u64,
    creating: bool,
    tmp: Option<PathBuf>,
}

impl Drop for PutGuard<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.inner.release(self.bytes);
        }
        if self.creating {
            lock(&self.inner.index).creating.remove(self.key);
        }
        if let Some(t) = &self.tmp {
            let _ = fs::remove_file(t);
        }
    }
}

#[async_trait]
impl Medium for NvmeMedium {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            kind: "nvme",
            survives_restart: true,
            durable_across_nodes: false,
            verifies_reads: true,
            zero_copy_read: false,
            bounded_capacity: true,
        }
    }

    async fn put(&self, key: &str, data: &[u8], opts: PutOptions) -> Result<ObjectMeta> {
        validate_key(key)?;
        let inner = &self.inner;
        let mut guard = PutGuard { inner, key, bytes: 0, creating: false, tmp: None };
        if opts.mode == PutMode::CreateNew {
            let mut idx = lock(&inner.index);
            if idx.ready.contains_key(key) || idx.creating.contains(key) {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("nvme: {key:?}")));
            }
            idx.creating.insert(key.to_owned());
            guard.creating = true;
        }
        let fbytes = file_bytes(key, data.len() as u64);
        inner.reserve(fbytes, key)?;
        guard.bytes = fbytes;
        let seq = inner.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = inner.dir.join("tmp").join(format!(
            "{}.{}.{seq}",
            key_digest_hex(key),
            std::process::id()
        ));
        guard.tmp = Some(tmp.clone());
        let (k, ptr, len, t) =
            (key.to_owned(), SendPtr(data.as_ptr().cast_mut()), data.len(), tmp.clone());
        let meta = self.pool.run(move |ctx| write_object(ctx, &t, &k, ptr, len, opts)).await?;
        self.commit(key, &tmp, meta, fbytes, opts.mode)?;
        guard.tmp = None;
        guard.bytes = 0;
        drop(guard);
        let path = inner.object_path(key);
        if let Some(parent) = path.parent() {
            fsync_dir(parent)?;
        }
        Ok(meta)
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta> {
        validate_key(key)?;
        if !lock(&self.inner.index).ready.contains_key(key) {
            return Err(Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")));
        }
        let path = self.inner.object_path(key);
        let (k, ptr, len) = (key.to_owned(), SendPtr(dst.as_mut_ptr()), dst.len());
        let r = self.pool.run(move |ctx| read_object(ctx, &path, &k, ptr, len)).await;
        r.map_err(|e| self.inner.corrupt(e))
    }

    async fn stat(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        lock(&self.inner.index)
            .ready
            .get(key)
            .map(|e| e.meta)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")))
    }

    async fn remove(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let path = self.inner.object_path(key);
        let mut idx = lock(&self.inner.index);
        let Some(e) = idx.ready.remove(key) else {
            return Err(Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")));
        };
        self.inner.release(e.file_bytes);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(Error::io(format!("remove {}", path.display()), err)),
        }
    }

    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>> {
        Ok(lock(&self.inner.index).ready.iter().map(|(k, e)| (k.clone(), e.meta)).collect())
    }

    fn capacity_bytes(&self) -> Option<u64> {
        Some(self.inner.capacity_bytes)
    }

    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes.load(Ordering::Acquire)
    }
}
