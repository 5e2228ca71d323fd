//! NVMe medium: one data file per object in a directory on a local disk, read and written
//! through io_uring with O_DIRECT and registered staging buffers, plus a small header file.
//!
//! On disk (under the medium's `dir`):
//! - `objects/<d0d1>/<digest>.<gen>`: the object's bytes, **from offset 0, exactly `size` bytes
//!   long**; `digest` is the 64-hex blake3 of the key, `d0d1` its first two characters (256
//!   sub-directories keep directories small), `gen` a number unique to this write. Because the
//!   file is nothing but the object, FUSE passthrough (which maps file offsets 1:1 and ends
//!   reads at the backing file's end) can serve it, see [`NvmeMedium::local_file`].
//! - `objects/<d0d1>/<digest>`: the object's [`crate::header`] (key, size, blake3, persistence,
//!   version, pin, and `gen`: which data file is current). The header file is the commit record.
//! - `tmp/`: files being written; whatever is there at `open` is a crash leftover and is deleted.
//! - `LOCK`: held with `flock` while a medium has the directory open (a second open fails with
//!   `Unavailable`; the kernel drops the lock when the process dies).
//! - `quarantine/`: header files found at `open` that do not verify or whose data file is
//!   missing or of the wrong length, moved aside for an operator (never deleted, never served;
//!   their data files, no longer named by any header, are deleted like any orphan).
//!
//! Why a sidecar rather than a header in front of the data (the format before) or a trailer:
//! passthrough reads go straight to the backing file, so any byte of it that is not the object
//! (a header at 0, padding or a trailer at the end) would reach readers; the data file must be
//! the object and nothing else.
//!
//! Write (crash-safe): reserve capacity; write the data to `tmp/` at `queue_depth` chunks in
//! flight while hashing them (the tail block zero-padded, then the file truncated to `size`),
//! fsync; write the header to `tmp/`, fsync; rename the data file to its final, unique name
//! and fsync the directory; then, under the index lock, rename the header over the old one
//! (the commit point) and fsync the directory; finally unlink the replaced data file. A crash
//! at any point leaves the old object or the new one; an unreferenced data file (renamed but
//! not committed, or replaced but not yet unlinked) is deleted by the next `open`.
//!
//! Read: look the object up in the index (its meta came from the header), open its data file
//! (the open descriptor keeps the bytes even if an overwrite or remove unlinks the file
//! meanwhile), read it at `queue_depth` chunks in flight straight into the destination when it
//! is 4 KiB aligned (through a staging slot otherwise), hashing each chunk while the next ones
//! are in flight. A checksum mismatch is `Corrupt` and counted in [`NvmeStats`].
//!
//! Invariants: the in-memory index holds exactly the objects whose header rename has
//! happened; header renames, unlinks and index updates happen under one lock, so the index and
//! the directory agree even with concurrent overwrites and removes of the same key.
//! `used_bytes` counts the file bytes (4 KiB blocks of data and header) of indexed objects
//! plus reservations of puts in progress.
//!
//! Not handled: data-corruption scanning at `open` (headers and lengths only; data is verified
//! on every read and on the first [`NvmeMedium::local_file`] of each copy), durability of
//! `remove` (a removed object may reappear after a crash; it is still a valid, verified
//! object), quotas per namespace.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
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
use crate::uring::{BLOCK_BYTES, Dir, IoPool, RingConfig, RingCtx, SendPtr};

/// Configuration of an NVMe medium.
#[derive(Debug, Clone)]
pub struct NvmeConfig {
    /// The directory (created if missing).
    pub dir: PathBuf,
    /// The most file bytes (data and header blocks) the medium may hold.
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
    /// Half-written temp files and unreferenced data files deleted.
    pub temp_files_removed: usize,
    /// Header files that did not verify (or whose data file did not match), moved to
    /// `quarantine/`.
    pub quarantined: usize,
}

/// Counters of an NVMe medium.
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmeStats {
    pub objects: usize,
    pub used_bytes: u64,
    /// Reads that failed verification (data checksum, truncation).
    pub corrupt_reads: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    meta: ObjectMeta,
    generation: u64,
    file_bytes: u64,
    /// The data file was read back, hashed and matched by `local_file`.
    verified: bool,
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
    last_generation: AtomicU64,
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

/// Bytes the files of an object take (data and header, each in whole 4 KiB blocks).
pub fn file_bytes(key: &str, size_bytes: u64) -> u64 {
    (round_up(header::FIXED_BYTES + key.len(), BLOCK_BYTES)
        + round_up(size_bytes as usize, BLOCK_BYTES)) as u64
}

impl Inner {
    fn header_path(&self, key: &str) -> PathBuf {
        let d = key_digest_hex(key);
        self.dir.join("objects").join(&d[..2]).join(d)
    }

    fn data_path(&self, key: &str, generation: u64) -> PathBuf {
        let d = key_digest_hex(key);
        self.dir.join("objects").join(&d[..2]).join(format!("{d}.{generation}"))
    }

    /// A generation number never used before by this directory: wall-clock based (so it keeps
    /// rising across restarts), strictly increasing within the process.
    fn next_generation(&self) -> u64 {
        let floor = now_unix_ms().saturating_mul(1 << 16);
        let mut cur = self.last_generation.load(Ordering::Acquire);
        loop {
            let next = (cur + 1).max(floor);
            match self.last_generation.compare_exchange(
                cur,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return next,
                Err(v) => cur = v,
            }
        }
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

/// Paths of one put's temp files.
struct TempFiles {
    data: PathBuf,
    header: PathBuf,
}

/// Write one object's data and header to new temp files; returns its meta. Runs on a ring
/// thread.
fn write_object(
    ctx: &mut RingCtx,
    tmp: &TempFiles,
    key: &str,
    data: SendPtr,
    size: usize,
    opts: PutOptions,
    generation: u64,
) -> Result<ObjectMeta> {
    let f = open_direct(&tmp.data, true)?;
    let fd = f.as_raw_fd();
    let padded = round_up(size, BLOCK_BYTES) as libc::off_t;
    if padded > 0 {
        // One extent up front instead of block allocation chunk by chunk.
        // SAFETY: fallocate on a descriptor we own.
        let r = unsafe { libc::fallocate(fd, 0, 0, padded) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(Error::io(format!("fallocate {}", tmp.data.display()), e));
            }
        }
    }
    let mut hasher = blake3::Hasher::new();
    // SAFETY: `data` points at the caller's `size` bytes, kept alive by IoPool::run.
    unsafe { ctx.pipeline(Dir::Write, fd, 0, data.0, size, Some(&mut hasher)) }?;
    if size as libc::off_t != padded {
        // The last block was written whole; the file is exactly the object.
        f.set_len(size as u64)
            .map_err(|e| Error::io(format!("truncate {}", tmp.data.display()), e))?;
    }
    let sum = *hasher.finalize().as_bytes();
    if let Some(want) = opts.checksum
        && want != sum
    {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("nvme put {key:?}: data does not match the writer's checksum"),
        ));
    }
    ctx.fsync(fd)?;
    let meta = ObjectMeta {
        size_bytes: size as u64,
        checksum: sum,
        persistence: opts.persistence,
        stored_at_unix_ms: now_unix_ms(),
        version: opts.version,
        pin: opts.pin,
    };
    let encoded = header::encode(key, &meta, generation, None, 1);
    let mut h = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp.header)
        .map_err(|e| Error::io(format!("open {}", tmp.header.display()), e))?;
    h.write_all(&encoded)
        .and_then(|_| h.sync_all())
        .map_err(|e| Error::io(format!("write {}", tmp.header.display()), e))?;
    Ok(meta)
}

/// Read one object's data file into `dst`, verified against `meta`. Runs on a ring thread.
fn read_object(
    ctx: &mut RingCtx,
    path: &Path,
    key: &str,
    meta: &ObjectMeta,
    dst: SendPtr,
    dst_len: usize,
) -> Result<()> {
    let f = open_direct(path, false)?;
    let size = check_dst(key, dst_len, meta.size_bytes)?;
    let len = f.metadata().map_err(|e| Error::io("fstat", e))?.len();
    if len != meta.size_bytes {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("{}: {len} bytes, the header says {}", path.display(), meta.size_bytes),
        ));
    }
    let mut hasher = blake3::Hasher::new();
    // SAFETY: dst is the caller's buffer of dst_len >= size bytes, kept alive by IoPool::run.
    unsafe { ctx.pipeline(Dir::Read, f.as_raw_fd(), 0, dst.0, size, Some(&mut hasher)) }?;
    if hasher.finalize().as_bytes() != &meta.checksum {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("nvme get {key:?}: data checksum mismatch ({})", path.display()),
        ));
    }
    Ok(())
}

/// blake3 of a whole file through the page cache (buffered reads).
fn hash_file(f: &mut File) -> std::io::Result<[u8; 32]> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(*h.finalize().as_bytes()),
            Ok(n) => {
                h.update(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

impl NvmeMedium {
    /// Open (or create) the directory and rebuild the index from the header files.
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
        let last_generation = scan_objects(&cfg.dir, &mut index, &mut report)?;
        report.objects = index.ready.len();
        let inner = Inner {
            _lock: lock_file,
            dir: cfg.dir,
            capacity_bytes: cfg.capacity_bytes,
            used_bytes: AtomicU64::new(report.bytes),
            corrupt_reads: AtomicU64::new(0),
            last_generation: AtomicU64::new(last_generation),
            index: Mutex::new(index),
        };
        tracing::info!(objects = report.objects, bytes = report.bytes, temp_removed = report.temp_files_removed,
            quarantined = report.quarantined, dir = %inner.dir.display(), "nvme medium opened");
        Ok((NvmeMedium { inner: Arc::new(inner), pool }, report))
    }

    /// The header file of `key` (whether or not it exists), for tools and tests.
    pub fn header_path(&self, key: &str) -> PathBuf {
        self.inner.header_path(key)
    }

    /// The current data file of `key`, if the medium holds it (for tools and tests).
    pub fn data_path(&self, key: &str) -> Option<PathBuf> {
        let g = lock(&self.inner.index).ready.get(key).map(|e| e.generation)?;
        Some(self.inner.data_path(key, g))
    }

    /// The object's data file, opened read-only (no O_DIRECT, so reads go through the page
    /// cache), and its meta: for same-process users that serve reads straight from the file,
    /// such as FUSE passthrough. The file holds exactly the object's bytes from offset 0, and
    /// the descriptor keeps them readable even if the object is removed or replaced later.
    ///
    /// The first call per object (per write, and again after every open of the medium)
    /// hashes the whole file through the page cache and refuses a mismatch with `Corrupt`
    /// (counted); that read also warms the page cache the passthrough reads then hit. Later
    /// calls do not re-hash, so bit rot after that first check is not detected on this path
    /// (every `get_into` still verifies). Blocking: it may read the whole file; call it from a
    /// blocking thread (FUSE request threads are).
    pub fn local_file(&self, key: &str) -> Result<(File, ObjectMeta)> {
        validate_key(key)?;
        let e = lock(&self.inner.index)
            .ready
            .get(key)
            .copied()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")))?;
        let path = self.inner.data_path(key, e.generation);
        let mut f =
            OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(&path).map_err(
                |err| match err.kind() {
                    // Replaced or removed since the lookup.
                    std::io::ErrorKind::NotFound => {
                        Error::new(ErrorKind::NotFound, format!("nvme: {key:?}"))
                    }
                    _ => Error::io(format!("open {}", path.display()), err),
                },
            )?;
        if !e.verified {
            let len = f.metadata().map_err(|err| Error::io("fstat", err))?.len();
            let sum = hash_file(&mut f)
                .map_err(|err| Error::io(format!("read {}", path.display()), err))?;
            if len != e.meta.size_bytes || sum != e.meta.checksum {
                self.inner.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("nvme local file {key:?}: data checksum mismatch ({})", path.display()),
                ));
            }
            let mut idx = lock(&self.inner.index);
            if let Some(cur) = idx.ready.get_mut(key).filter(|c| c.generation == e.generation) {
                cur.verified = true;
            }
            drop(idx);
            use std::io::Seek;
            f.rewind().map_err(|err| Error::io("seek", err))?;
        }
        Ok((f, e.meta))
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

    /// Put the finished temp files in place, index the object and unlink the data file it
    /// replaced.
    fn commit(&self, key: &str, tmp: &TempFiles, entry: Entry, mode: PutMode) -> Result<()> {
        let data = self.inner.data_path(key, entry.generation);
        let header = self.inner.header_path(key);
        let parent = header.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&parent)
            .map_err(|e| Error::io(format!("create {}", parent.display()), e))?;
        // The data file's name is new: it can go in place before the commit, and must be
        // durable before the header that names it.
        fs::rename(&tmp.data, &data)
            .map_err(|e| Error::io(format!("rename to {}", data.display()), e))?;
        let unlink_data = |r: Result<()>| {
            if r.is_err() {
                let _ = fs::remove_file(&data);
            }
            r
        };
        unlink_data(fsync_dir(&parent))?;
        let replaced = {
            let mut idx = lock(&self.inner.index);
            if mode == PutMode::CreateNew && idx.ready.contains_key(key) {
                drop(idx);
                return unlink_data(Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("nvme: {key:?}"),
                )));
            }
            unlink_data(
                fs::rename(&tmp.header, &header)
                    .map_err(|e| Error::io(format!("rename to {}", header.display()), e)),
            )?;
            let old = idx.ready.insert(key.to_owned(), entry);
            if let Some(old) = old {
                self.inner.release(old.file_bytes);
            }
            old
        };
        fsync_dir(&parent)?;
        if let Some(old) = replaced {
            let _ = fs::remove_file(self.inner.data_path(key, old.generation));
        }
        Ok(())
    }
}

/// Index every committed object under `dir/objects`; quarantine bad headers, delete data files
/// no header names. Returns the highest generation seen.
fn scan_objects(dir: &Path, index: &mut Index, report: &mut OpenReport) -> Result<u64> {
    let objects = dir.join("objects");
    let rd = |p: &Path| fs::read_dir(p).map_err(|e| Error::io(format!("read {}", p.display()), e));
    let mut last_generation = 0;
    for sub in rd(&objects)? {
        let sub = sub.map_err(|e| Error::io("read objects", e))?.path();
        if !sub.is_dir() {
            continue;
        }
        let mut headers = Vec::new();
        let mut data_files = Vec::new();
        for f in rd(&sub)? {
            let path = f.map_err(|e| Error::io("read objects", e))?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            match name.as_deref().and_then(|n| n.split_once('.')) {
                Some((_, g)) => data_files.push((path.clone(), g.parse::<u64>().ok())),
                None => headers.push(path),
            }
        }
        let mut referenced = HashSet::new();
        for path in headers {
            match check_header(&path) {
                Ok((key, entry)) => {
                    referenced.insert(key_digest_hex(&key) + "." + &entry.generation.to_string());
                    last_generation = last_generation.max(entry.generation);
                    report.bytes += entry.file_bytes;
                    index.ready.insert(key, entry);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "quarantining object header");
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
        for (path, generation) in data_files {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            if name.is_some_and(|n| referenced.contains(&n)) {
                continue;
            }
            last_generation = last_generation.max(generation.unwrap_or(0));
            fs::remove_file(&path)
                .map_err(|e| Error::io(format!("remove {}", path.display()), e))?;
            report.temp_files_removed += 1;
        }
    }
    Ok(last_generation)
}

/// Verify a header file, its name and its data file's length (not the data).
fn check_header(path: &Path) -> Result<(String, Entry)> {
    let mut f = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let mut buf = Vec::with_capacity(header::FIXED_BYTES + 256);
    Read::by_ref(&mut f)
        .take(header::HEADER_BYTES_MAX as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let h = header::decode(&buf)?;
    if buf.len() != h.header_bytes {
        return Err(Error::new(ErrorKind::Corrupt, "header file has trailing bytes"));
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if key_digest_hex(&h.key) != name {
        return Err(Error::new(ErrorKind::Corrupt, "file name is not the digest of its key"));
    }
    let data = path.with_file_name(format!("{name}.{}", h.generation));
    let len = fs::metadata(&data)
        .map_err(|e| Error::io(format!("data file {}", data.display()), e))?
        .len();
    if len != h.meta.size_bytes {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("data file has {len} bytes, header says {}", h.meta.size_bytes),
        ));
    }
    usize_from(h.meta.size_bytes)?;
    let entry = Entry {
        meta: h.meta,
        generation: h.generation,
        file_bytes: file_bytes(&h.key, h.meta.size_bytes),
        verified: false,
    };
    Ok((h.key, entry))
}

/// Undoes a put's reservations unless disarmed.
struct PutGuard<'a> {
    inner: &'a Inner,
    key: &'a str,
    bytes: u64,
    creating: bool,
    tmp: Option<TempFiles>,
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
            let _ = fs::remove_file(&t.data);
            let _ = fs::remove_file(&t.header);
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
        let generation = inner.next_generation();
        let stem = format!("{}.{generation}", key_digest_hex(key));
        let tmp = TempFiles {
            data: inner.dir.join("tmp").join(format!("{stem}.data")),
            header: inner.dir.join("tmp").join(format!("{stem}.hdr")),
        };
        let (k, ptr, len) = (key.to_owned(), SendPtr(data.as_ptr().cast_mut()), data.len());
        let paths = TempFiles { data: tmp.data.clone(), header: tmp.header.clone() };
        guard.tmp = Some(tmp);
        let meta = self
            .pool
            .run(move |ctx| write_object(ctx, &paths, &k, ptr, len, opts, generation))
            .await?;
        // Hashed on the way out of memory, not read back from disk: the first hand-out of the
        // file still verifies it.
        let entry = Entry { meta, generation, file_bytes: fbytes, verified: false };
        self.commit(key, guard.tmp.as_ref().expect("set above"), entry, opts.mode)?;
        guard.tmp = None;
        guard.bytes = 0;
        Ok(meta)
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta> {
        validate_key(key)?;
        // A concurrent overwrite may unlink the data file between the lookup and the open;
        // look again then (bounded: each retry means another writer committed meanwhile).
        for _ in 0..4 {
            let Some(e) = lock(&self.inner.index).ready.get(key).copied() else {
                return Err(Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")));
            };
            let path = self.inner.data_path(key, e.generation);
            let (k, ptr, len, meta) =
                (key.to_owned(), SendPtr(dst.as_mut_ptr()), dst.len(), e.meta);
            let r = self.pool.run(move |ctx| read_object(ctx, &path, &k, &meta, ptr, len)).await;
            match r {
                Ok(()) => return Ok(e.meta),
                Err(err) if err.kind() == ErrorKind::NotFound => continue,
                Err(err) => return Err(self.inner.corrupt(err)),
            }
        }
        Err(Error::new(ErrorKind::Busy, format!("nvme get {key:?}: object kept changing")))
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
        let header = self.inner.header_path(key);
        let mut idx = lock(&self.inner.index);
        let Some(e) = idx.ready.remove(key) else {
            return Err(Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")));
        };
        self.inner.release(e.file_bytes);
        // The header goes first: without it the data file is an orphan the next open deletes.
        let r = match fs::remove_file(&header) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(Error::io(format!("remove {}", header.display()), err)),
        };
        drop(idx);
        let _ = fs::remove_file(self.inner.data_path(key, e.generation));
        r
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
