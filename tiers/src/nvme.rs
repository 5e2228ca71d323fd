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
//! Rename (no data copy; crash-safe): `rename(from, to)` (1) hard-links `from`'s data file
//! under a fresh name of `to`'s digest, `objects/<to d0d1>/<to digest>.<new gen>`, and fsyncs
//! that directory (the link must be durable before a header names it); (2) writes `to`'s header
//! (the new version, the same size, checksum, persistence, pin and stored-at time, and the
//! previous name `(from, old version)`) to `tmp/` and fsyncs it; (3) under the index lock,
//! checks that `from` is still the copy it linked (else it undoes its files and starts over,
//! a bounded number of times, then `Busy`), renames the header into place (the commit point
//! for `to`; with `CreateNew`, `AlreadyExists` first if `to` appeared) and re-keys the index;
//! (4) fsyncs the directory, then removes `from`'s header (under the lock, and only if no put
//! has given `from` a new copy meanwhile) and `from`'s data-file name, and the data file of the
//! replaced `to` if any. Unlinking `from`'s name never loses the bytes: `to`'s name is another
//! link to the same inode. A rename makes no `await`, so a dropped rename future has either
//! not started or finished; it blocks its thread for two directory fsyncs and one file fsync.
//!
//! Crash states of a rename, and what `open` makes of them:
//! - before (3): `from`'s header only, plus `to`'s linked data file and a temp header: the temp
//!   file and the unreferenced link are deleted (counted in `temp_files_removed`); only `from`.
//! - after (3), before `from`'s header is gone (or a power loss that undid its unlink): both
//!   headers, `to`'s naming `(from, v)`. `open` applies [`crate::medium::stale_after_rename`]
//!   to every header it read: `from` at version `v` with the same size and checksum is stale,
//!   its header and data-file name are deleted (counted in `renamed_stale_removed`); only `to`.
//!   A `from` put again since (another version or other bytes) is kept. A claim counts only
//!   from a header whose own data file checks out, so a damaged `to` never costs `from`.
//! - after `from`'s header went, before its data-file name: that name is unreferenced and
//!   deleted like any orphan; only `to`.
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
//! plus reservations of puts and renames in progress. A renamed object's data blocks are
//! counted once (the index holds one entry for the inode); a rename reserves only `to`'s
//! header blocks and, at its commit, releases `from`'s header blocks.
//!
//! Not handled: file systems without hard links (a rename fails with `Io` there), renames
//! across media or directories, data-corruption scanning at `open` (headers and lengths only; data is verified
//! on every read and on the first [`NvmeMedium::local_file`] of each copy), durability of
//! `remove` (a removed object may reappear after a crash; it is still a valid, verified
//! object), quotas per namespace.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::error::{Error, ErrorKind, Result};
use crate::header::{self, round_up};
use crate::medium::{
    Capabilities, Medium, ObjectMeta, PutMode, PutOptions, RenameOptions, check_dst,
    key_digest_hex, now_unix_ms, stale_after_rename, usize_from, validate_key, validate_rename,
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
    /// Old names left by a rename that crashed after its commit (another header named them
    /// as its previous name): header and data-file name deleted.
    pub renamed_stale_removed: usize,
}

/// Counters of an NVMe medium.
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmeStats {
    pub objects: usize,
    pub used_bytes: u64,
    /// Reads that failed verification (data checksum, truncation).
    pub corrupt_reads: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    meta: ObjectMeta,
    generation: u64,
    file_bytes: u64,
    /// The data file was read back, hashed and matched by `local_file`.
    verified: bool,
    /// The name and version this copy had before a rename (kept in its header).
    previous: Option<Arc<(String, u64)>>,
}

impl Entry {
    fn of(h: &header::Header) -> Entry {
        Entry {
            meta: h.meta,
            generation: h.generation,
            file_bytes: file_bytes(
                &h.key,
                h.previous.as_ref().map(|p| p.0.as_str()),
                h.meta.size_bytes,
            ),
            verified: false,
            previous: h.previous.clone().map(Arc::new),
        }
    }
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
    /// `index.ready.len()`, kept beside it: the stats a node's heartbeat carries read this
    /// rather than wait for the index lock, which a commit, rename or removal holds across
    /// file-system calls.
    objects: AtomicUsize,
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

/// Bytes the files of an object take (data and header, each in whole 4 KiB blocks);
/// `previous_key` is the name it had before a rename (its header holds it).
pub fn file_bytes(key: &str, previous_key: Option<&str>, size_bytes: u64) -> u64 {
    header_file_bytes(key, previous_key) + round_up(size_bytes as usize, BLOCK_BYTES) as u64
}

/// Bytes of an object's header file, in whole 4 KiB blocks.
fn header_file_bytes(key: &str, previous_key: Option<&str>) -> u64 {
    round_up(header::unpadded_len(key, previous_key), BLOCK_BYTES) as u64
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
    write_header_file(&tmp.header, &header::encode(key, &meta, generation, None, 1))?;
    Ok(meta)
}

/// Write a new header file and fsync it.
fn write_header_file(path: &Path, encoded: &[u8]) -> Result<()> {
    let mut h = OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    h.write_all(encoded)
        .and_then(|_| h.sync_all())
        .map_err(|e| Error::io(format!("write {}", path.display()), e))
}

/// Remove a file that may already be gone.
fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
    }
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
            objects: AtomicUsize::new(report.objects),
            index: Mutex::new(index),
        };
        tracing::info!(objects = report.objects, bytes = report.bytes, temp_removed = report.temp_files_removed,
            quarantined = report.quarantined, renamed_stale_removed = report.renamed_stale_removed,
            dir = %inner.dir.display(), "nvme medium opened");
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
            .cloned()
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
            objects: self.inner.objects.load(Ordering::Relaxed),
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
            self.inner.objects.store(idx.ready.len(), Ordering::Relaxed);
            if let Some(old) = &old {
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

/// Outcome of one rename attempt.
enum Attempt {
    Done(ObjectMeta),
    /// `from` changed (replaced or removed) while the attempt linked its data: look again.
    FromChanged,
}

impl NvmeMedium {
    /// One attempt of a rename of `from` (as `old`) to `to`; see the module notes for the
    /// steps. The caller holds `to`'s create reservation (`CreateNew`) and `to`'s header
    /// bytes in `guard`, which also removes this attempt's files unless they were committed.
    fn rename_once(
        &self,
        from: &str,
        to: &str,
        old: &Entry,
        opts: RenameOptions,
        guard: &mut PutGuard<'_>,
    ) -> Result<Attempt> {
        let inner = &self.inner;
        let generation = inner.next_generation();
        let linked = inner.data_path(to, generation);
        let to_header = inner.header_path(to);
        let parent = to_header.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&parent)
            .map_err(|e| Error::io(format!("create {}", parent.display()), e))?;
        let tmp_header =
            inner.dir.join("tmp").join(format!("{}.{generation}.hdr", key_digest_hex(to)));
        let src = inner.data_path(from, old.generation);
        match fs::hard_link(&src, &linked) {
            Ok(()) => {}
            // Replaced or removed since the lookup.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Attempt::FromChanged),
            Err(e) => {
                return Err(Error::io(
                    format!("nvme rename: link {} to {}", src.display(), linked.display()),
                    e,
                ));
            }
        }
        guard.tmp = Some(TempFiles { data: linked.clone(), header: tmp_header.clone() });
        // The link must be durable before a header names it.
        fsync_dir(&parent)?;
        let meta = ObjectMeta { version: opts.version, ..old.meta };
        let previous = (from.to_owned(), old.meta.version);
        let encoded = header::encode(to, &meta, generation, Some((from, previous.1)), 1);
        write_header_file(&tmp_header, &encoded)?;
        let data_bytes =
            old.file_bytes - header_file_bytes(from, old.previous.as_ref().map(|p| p.0.as_str()));
        let entry = Entry {
            meta,
            generation,
            file_bytes: guard.bytes + data_bytes,
            // The same inode: what local_file verified holds for the new name too.
            verified: old.verified,
            previous: Some(Arc::new(previous)),
        };
        let replaced = {
            let mut idx = lock(&inner.index);
            if idx.ready.get(from).is_none_or(|cur| cur.generation != old.generation) {
                return Ok(Attempt::FromChanged);
            }
            if opts.mode == PutMode::CreateNew && idx.ready.contains_key(to) {
                return Err(Error::new(ErrorKind::AlreadyExists, format!("nvme: {to:?}")));
            }
            fs::rename(&tmp_header, &to_header)
                .map_err(|e| Error::io(format!("rename to {}", to_header.display()), e))?;
            // Committed: `to` is the object now, its files are no longer the guard's.
            guard.tmp = None;
            guard.bytes = 0;
            idx.ready.remove(from);
            // `from`'s header blocks go; its data blocks are `to`'s now.
            inner.release(old.file_bytes - data_bytes);
            let replaced = idx.ready.insert(to.to_owned(), entry);
            inner.objects.store(idx.ready.len(), Ordering::Relaxed);
            if let Some(r) = &replaced {
                inner.release(r.file_bytes);
            }
            replaced
        };
        // Until `to`'s header is durable, `from`'s must stay: a power loss now leaves both,
        // which `open` resolves; if this fsync fails `from`'s files stay for `open` too.
        fsync_dir(&parent)?;
        // The rename has happened: a failure to delete an old file is logged, not returned
        // (the index is right, and `open` deletes what is left).
        let cleanup = |r: Result<()>| {
            if let Err(e) = r {
                tracing::warn!(from, to, error = %e, "nvme rename: old file left for open");
            }
        };
        {
            let idx = lock(&inner.index);
            // A put that gave `from` a new copy meanwhile renamed its header over the old one.
            if !idx.ready.contains_key(from) {
                cleanup(remove_if_present(&inner.header_path(from)));
            }
        }
        // Another link to `to`'s bytes: unlinking it frees nothing `to` needs.
        cleanup(remove_if_present(&src));
        if let Some(r) = replaced {
            let _ = fs::remove_file(inner.data_path(to, r.generation));
        }
        Ok(Attempt::Done(meta))
    }
}

/// A header file found at `open`.
struct Found {
    path: PathBuf,
    header: header::Header,
    /// Whether its data file exists with the header's length.
    data: Result<()>,
}

/// Index every committed object under `dir/objects`; delete the old names of renames that
/// crashed after their commit; quarantine bad headers; delete data files no header names.
/// Returns the highest generation seen.
fn scan_objects(dir: &Path, index: &mut Index, report: &mut OpenReport) -> Result<u64> {
    let objects = dir.join("objects");
    let rd = |p: &Path| fs::read_dir(p).map_err(|e| Error::io(format!("read {}", p.display()), e));
    let mut last_generation = 0;
    let mut found = Vec::new();
    let mut data_files = Vec::new();
    for sub in rd(&objects)? {
        let sub = sub.map_err(|e| Error::io("read objects", e))?.path();
        if !sub.is_dir() {
            continue;
        }
        for f in rd(&sub)? {
            let path = f.map_err(|e| Error::io("read objects", e))?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            match name.as_deref().and_then(|n| n.split_once('.')) {
                Some((_, g)) => data_files.push((path.clone(), g.parse::<u64>().ok())),
                None => match read_header_file(&path) {
                    Ok(header) => {
                        let data = check_data_file(&path, &header);
                        found.push(Found { path, header, data });
                    }
                    Err(e) => quarantine(dir, &path, &e, report)?,
                },
            }
        }
    }
    // Only a copy whose data checks out may claim an old name; any decoded copy may be one.
    let stale: HashSet<String> = stale_after_rename(found.iter().map(|f| {
        let previous = f.header.previous.as_ref().filter(|_| f.data.is_ok());
        (f.header.key.as_str(), &f.header.meta, previous.map(|(k, v)| (k.as_str(), *v)))
    }))
    .into_iter()
    .map(str::to_owned)
    .collect();
    // Data-file names that stay (referenced) or were dealt with here (a stale copy's).
    let mut keep = HashSet::new();
    for f in found {
        let h = f.header;
        let data_name = format!("{}.{}", key_digest_hex(&h.key), h.generation);
        last_generation = last_generation.max(h.generation);
        if stale.contains(&h.key) {
            tracing::info!(key = %h.key, version = h.meta.version, "deleting the old name of a renamed object");
            remove_if_present(&f.path)?;
            remove_if_present(&f.path.with_file_name(&data_name))?;
            keep.insert(data_name);
            report.renamed_stale_removed += 1;
            continue;
        }
        if let Err(e) = f.data {
            quarantine(dir, &f.path, &e, report)?;
            continue;
        }
        keep.insert(data_name);
        let entry = Entry::of(&h);
        report.bytes += entry.file_bytes;
        index.ready.insert(h.key, entry);
    }
    for (path, generation) in data_files {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| keep.contains(&n)) {
            continue;
        }
        last_generation = last_generation.max(generation.unwrap_or(0));
        fs::remove_file(&path).map_err(|e| Error::io(format!("remove {}", path.display()), e))?;
        report.temp_files_removed += 1;
    }
    Ok(last_generation)
}

/// Move a header file that does not verify to `quarantine/`.
fn quarantine(dir: &Path, path: &Path, e: &Error, report: &mut OpenReport) -> Result<()> {
    tracing::warn!(path = %path.display(), error = %e, "quarantining object header");
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let to = dir.join("quarantine").join(format!("{name}.{}", now_unix_ms()));
    fs::rename(path, &to).map_err(|e| Error::io(format!("quarantine {}", path.display()), e))?;
    report.quarantined += 1;
    Ok(())
}

/// Read and verify a header file and its name (not its data file).
fn read_header_file(path: &Path) -> Result<header::Header> {
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
    usize_from(h.meta.size_bytes)?;
    Ok(h)
}

/// Check that the data file a header names exists with the header's length (not the data).
fn check_data_file(header_path: &Path, h: &header::Header) -> Result<()> {
    let name = key_digest_hex(&h.key);
    let data = header_path.with_file_name(format!("{name}.{}", h.generation));
    let len = fs::metadata(&data)
        .map_err(|e| Error::io(format!("data file {}", data.display()), e))?
        .len();
    if len != h.meta.size_bytes {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("data file has {len} bytes, header says {}", h.meta.size_bytes),
        ));
    }
    Ok(())
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
        let fbytes = file_bytes(key, None, data.len() as u64);
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
        let entry = Entry { meta, generation, file_bytes: fbytes, verified: false, previous: None };
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
            let Some(e) = lock(&self.inner.index).ready.get(key).cloned() else {
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
        self.inner.objects.store(idx.ready.len(), Ordering::Relaxed);
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

    async fn rename(&self, from: &str, to: &str, opts: RenameOptions) -> Result<ObjectMeta> {
        validate_rename(from, to)?;
        let inner = &self.inner;
        let mut guard = PutGuard { inner, key: to, bytes: 0, creating: false, tmp: None };
        {
            let mut idx = lock(&inner.index);
            if !idx.ready.contains_key(from) {
                return Err(Error::new(ErrorKind::NotFound, format!("nvme: {from:?}")));
            }
            if opts.mode == PutMode::CreateNew {
                if idx.ready.contains_key(to) || idx.creating.contains(to) {
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("nvme: {to:?}")));
                }
                idx.creating.insert(to.to_owned());
                guard.creating = true;
            }
        }
        let hbytes = header_file_bytes(to, Some(from));
        inner.reserve(hbytes, to)?;
        guard.bytes = hbytes;
        // Bounded: each retry means another writer replaced `from` meanwhile.
        for _ in 0..4 {
            let Some(old) = lock(&inner.index).ready.get(from).cloned() else {
                return Err(Error::new(ErrorKind::NotFound, format!("nvme: {from:?}")));
            };
            match self.rename_once(from, to, &old, opts, &mut guard)? {
                Attempt::Done(meta) => return Ok(meta),
                Attempt::FromChanged => {
                    if let Some(t) = guard.tmp.take() {
                        let _ = fs::remove_file(&t.data);
                        let _ = fs::remove_file(&t.header);
                    }
                }
            }
        }
        Err(Error::new(ErrorKind::Busy, format!("nvme rename {from:?}: object kept changing")))
    }

    async fn previous_name(&self, key: &str) -> Result<Option<(String, u64)>> {
        validate_key(key)?;
        lock(&self.inner.index)
            .ready
            .get(key)
            .map(|e| e.previous.as_ref().map(|p| (**p).clone()))
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("nvme: {key:?}")))
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
