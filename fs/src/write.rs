//! Creating objects through FUSE: create + write + close (or fsync) is one put.
//!
//! Mechanism. `create` checks that no object, directory or other writer has the name, and
//! registers the key as pending: the writer (and anyone listing) sees a 0644 file of the bytes
//! written so far, which nobody else may open. Writes go to [`Staged`] memory in the daemon
//! (direct I/O: no page cache, no writable shared mappings). The first close (flush) or fsync
//! commits: the bytes are copied once into a buffer registered with the client's engine,
//! put with a blake3 checksum, and the checksum the master then reports is compared with ours:
//! a different one means another writer's put of the key won, and the close fails with
//! `EEXIST`. Any failure makes close/fsync fail with the errno and leaves nothing visible (the
//! client revokes a put that did not complete; the name is dropped from the kernel's cache).
//!
//! "Close" is the kernel's flush, sent on every close(2) of a descriptor of the file, including
//! duplicates: the first flush after bytes were written commits (shells redirect by dup2 and
//! close, so a flush before any byte is written fails with `EINVAL` but keeps the file open).
//! After the commit the handle is immutable: further writes get `EPERM`.
//!
//! A writer killed by a signal still has its files closed by the kernel; the daemon sees that
//! the closing thread is exiting on a signal and discards the bytes instead of committing
//! them. A file released without a committing flush is discarded too.
//!
//! Replacing an object (`open` with `O_TRUNC` for writing, `creat` of an existing name, or a
//! pending file re-targeted by a rename): the name keeps showing the old object to everyone
//! until the commit, which puts the bytes under a staging key (`\0kvfs-staging/...`, hidden
//! from listings) and renames it over the name: readers see the old object or the new one,
//! whole. Without `O_TRUNC`, opening an object for writing stays `EPERM` (objects are
//! immutable; there is no in-place modification).

use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvfs_client::{ErrorKind, PutOptions};
use kvfs_transfer::{Buffer, BufferOptions};

use crate::errno;
use crate::inode::{Kind, ObjAttr};
use crate::names::{self, Piece};
use crate::staging::Staged;
use crate::state::{Errno, Found, Handle, Inner, Pending, bump, lock};

/// Keys of replacements being committed: hidden from listings (see `dir`).
pub const STAGING_PREFIX: &str = "\0kvfs-staging/";

pub struct Writer {
    pub key: String,
    pub ino: u64,
    parent: u64,
    name: OsString,
    staged: Staged,
    size: Arc<AtomicU64>,
    done: Option<Result<(), Errno>>,
    /// Commit by replacing whatever the name holds (staging key, then rename over it).
    replace: bool,
    /// For an open of an existing object: its attributes (what readers sharing the inode
    /// keep seeing until the commit), and whether it was truncated to 0 yet (writes before
    /// that would modify the object in place: `EPERM`).
    old: Option<ObjAttr>,
    truncated: bool,
    /// The name was unlinked while being written: the bytes go at close.
    discard: bool,
}

impl Writer {
    pub fn is_open(&self) -> bool {
        self.done.is_none()
    }

    pub fn staged_len(&self) -> u64 {
        self.staged.len()
    }

    /// A rename gave the file being written another name: it commits there, replacing.
    pub fn retarget(&mut self, key: String, parent: u64, name: OsString) {
        self.key = key;
        self.parent = parent;
        self.name = name;
        self.replace = true;
    }

    /// The object this writer replaces, while it has not committed.
    pub fn replacing(&self) -> Option<ObjAttr> {
        self.old.filter(|_| self.is_open())
    }

    /// The name was unlinked: the close succeeds and stores nothing.
    pub fn discard_at_close(&mut self) {
        self.discard = true;
    }
}

impl Inner {
    /// create: a new pending file and its write handle.
    pub async fn create(
        &self,
        parent: u64,
        name: &std::ffi::OsStr,
        flags: i32,
    ) -> Result<(Found, u64, u64), Errno> {
        let dir = match self.kind_of(parent)? {
            Kind::Dir(d) => d,
            Kind::ControlDir | Kind::JobsDir => return Err(libc::EPERM),
            _ => return Err(libc::ENOTDIR),
        };
        let (raw, file_mark) =
            match names::decode_piece(name.as_encoded_bytes()).ok_or(libc::EINVAL)? {
                Piece::Chunk(_) => return Err(libc::EINVAL),
                Piece::Last { raw, file_mark } => (raw, file_mark),
            };
        if parent == crate::inode::ROOT && name == names::CONTROL_DIR {
            return Err(libc::EEXIST);
        }
        let key = self.key_of(&dir, name, &raw, file_mark).ok_or(libc::EINVAL)?;
        if key.len() > self.cfg.key_bytes_max {
            return Err(libc::ENAMETOOLONG);
        }
        let excl = flags & libc::O_EXCL != 0;
        if lock(&self.pending).contains_key(&key) {
            return Err(if excl { libc::EEXIST } else { libc::EBUSY });
        }
        if !file_mark && self.dir_exists(&format!("{key}/")).await? {
            return Err(libc::EISDIR);
        }
        match self.client.stat(&key).await {
            Ok(_) if excl => return Err(libc::EEXIST),
            Ok(v) => {
                // creat(2) of an existing name truncates it: a replacement.
                let attr = ObjAttr { size: v.size, version: v.version };
                let found = Found::Object { key: key.clone(), attr, pending: false };
                let (ino, _) = self.remember(&found);
                lock(&self.table).open(ino);
                bump(&self.counters.replaces, 1);
                let w = Writer {
                    old: Some(attr),
                    ..self.new_writer(key.clone(), ino, parent, name.to_os_string(), true)
                };
                let fh = self.add_handle(Handle::Write(Arc::new(tokio::sync::Mutex::new(w))));
                // Readers may share the inode: it keeps the old object's size until the commit.
                return Ok((Found::Object { key, attr, pending: false }, ino, fh));
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(errno::of(&e)),
        }
        let found = Found::Object { key: key.clone(), attr: ObjAttr::default(), pending: true };
        let (ino, _) = self.remember(&found);
        let w = self.new_writer(key.clone(), ino, parent, name.to_os_string(), false);
        let size = w.size.clone();
        let w = Arc::new(tokio::sync::Mutex::new(w));
        {
            let mut pending = lock(&self.pending);
            if pending.contains_key(&key) {
                drop(pending);
                lock(&self.table).forget(ino, 1);
                return Err(libc::EEXIST);
            }
            pending.insert(key, Pending { ino, size, writer: Arc::downgrade(&w) });
        }
        lock(&self.table).open(ino);
        let fh = self.add_handle(Handle::Write(w));
        Ok((found, ino, fh))
    }

    fn new_writer(
        &self,
        key: String,
        ino: u64,
        parent: u64,
        name: OsString,
        replace: bool,
    ) -> Writer {
        Writer {
            key,
            ino,
            parent,
            name,
            staged: Staged::new(self.staging.clone(), self.cfg.staging_file_bytes_max),
            size: Arc::new(AtomicU64::new(0)),
            done: None,
            replace,
            old: None,
            truncated: true,
            discard: false,
        }
    }

    /// open with `O_TRUNC` for writing of an existing object: a writer that replaces it at
    /// its commit; until then everyone else still sees the old object.
    pub fn open_replace(
        &self,
        ino: u64,
        key: String,
        old: ObjAttr,
    ) -> Arc<tokio::sync::Mutex<Writer>> {
        bump(&self.counters.replaces, 1);
        // Name and parent matter only to drop the kernel's entry after a failed first commit
        // of a new file; a replacement's name keeps the old object then.
        let w = Writer {
            old: Some(old),
            truncated: false,
            ..self.new_writer(key, ino, 0, OsString::new(), true)
        };
        Arc::new(tokio::sync::Mutex::new(w))
    }

    /// A writer of an existing object opened on `ino` and not truncated yet (the kernel
    /// truncates after the open, without naming the handle).
    pub fn untruncated_writer(&self, ino: u64) -> Option<Arc<tokio::sync::Mutex<Writer>>> {
        lock(&self.handles).values().find_map(|h| match h {
            Handle::Write(w)
                if w.try_lock().is_ok_and(|g| {
                    g.ino == ino && g.old.is_some() && g.is_open() && !g.truncated
                }) =>
            {
                Some(w.clone())
            }
            _ => None,
        })
    }

    pub fn write(&self, w: &mut Writer, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        if !w.is_open() || !w.truncated {
            return Err(libc::EPERM);
        }
        w.staged.write(offset, data)?;
        w.size.store(w.staged.len(), Ordering::Release);
        bump(&self.counters.writes, 1);
        bump(&self.counters.write_bytes, data.len() as u64);
        Ok(data.len() as u32)
    }

    /// Reads back what the writer staged (a file created O_RDWR).
    pub fn read_staged(&self, w: &Writer, offset: u64, len: u32) -> Vec<u8> {
        let end = offset.saturating_add(len as u64).min(w.staged.len());
        let mut out = vec![0u8; end.saturating_sub(offset) as usize];
        w.staged.read(offset, &mut out);
        out
    }

    pub fn truncate_staged(&self, w: &mut Writer, len: u64) -> Result<(), Errno> {
        if !w.is_open() || (!w.truncated && len != 0) {
            return Err(libc::EPERM);
        }
        w.truncated = true;
        w.staged.set_len(len)?;
        w.size.store(len, Ordering::Release);
        Ok(())
    }

    /// close/fsync: commits once; later calls return the first outcome. A close before any
    /// byte was written fails with `EINVAL` (the store holds no empty objects) but leaves the
    /// file open: shells close a duplicate of the descriptor before writing through another.
    pub async fn commit(&self, w: &mut Writer) -> Result<(), Errno> {
        if let Some(r) = w.done {
            return r;
        }
        if w.discard {
            self.finish(w, Ok(()));
            return Ok(());
        }
        if !w.truncated {
            // Opened for writing, never truncated nor written: the object stays as it was.
            self.finish(w, Ok(()));
            return Ok(());
        }
        if w.staged.len() == 0 {
            return Err(libc::EINVAL);
        }
        let r = self.put_staged(w).await;
        self.finish(w, r);
        if r.is_ok() {
            bump(&self.counters.commits, 1);
        } else {
            bump(&self.counters.commit_failures, 1);
            tracing::info!(key = %w.key, errno = r.err(), "commit failed; nothing stored");
        }
        r
    }

    /// Discards the bytes (killed writer, release without a committing close).
    pub fn abort(&self, w: &mut Writer, why: Errno) {
        if w.is_open() {
            if w.staged.len() > 0 {
                bump(&self.counters.aborted_writes, 1);
                tracing::info!(key = %w.key, "write discarded: the writer did not close the file");
            }
            self.finish(w, Err(why));
        }
    }

    fn finish(&self, w: &mut Writer, r: Result<(), Errno>) {
        w.done = Some(r);
        w.staged.clear();
        {
            let mut pending = lock(&self.pending);
            if pending.get(&w.key).is_some_and(|p| p.ino == w.ino) {
                pending.remove(&w.key);
            }
        }
        if r.is_err() && !w.replace && w.parent != 0 {
            self.invalidate(w.parent, w.name.clone());
        }
    }

    async fn put_staged(&self, w: &Writer) -> Result<(), Errno> {
        let len = w.staged.len();
        let opts = BufferOptions { name: "kvfs-fuse-commit".into(), ..BufferOptions::default() };
        let buf = Arc::new(Buffer::new(len as usize, &opts).map_err(|_| libc::ENOMEM)?);
        w.staged.for_each_block(|off, bytes| {
            // In range: the buffer holds `len` bytes and blocks lie below `len`.
            let _ = buf.write_at(off as usize, bytes);
        });
        let engine = self.client.engine().clone();
        engine.register_buffer(buf.clone(), false).map_err(|_| libc::ENOMEM)?;
        let r = if w.replace {
            self.put_replacing(&w.key, &buf, len).await
        } else {
            self.put_and_check(&w.key, &buf, len).await
        };
        let _ = engine.unregister(buf.addr());
        let version = r?;
        // A new file's inode now shows the object; a replacement's inode keeps the old one's
        // attributes (it was detached: the name has a new inode).
        if let Some(n) = lock(&self.table).get_mut(w.ino)
            && !w.replace
        {
            n.attr = Some(ObjAttr { size: len, version });
        }
        Ok(())
    }

    /// Puts `len` bytes of `buf` under a staging key and renames it over `key`; the new
    /// object's version.
    async fn put_replacing(&self, key: &str, buf: &Arc<Buffer>, len: u64) -> Result<u64, Errno> {
        let n = self.next_staging.fetch_add(1, Ordering::Relaxed);
        let staging = format!("{}{:016x}/{n}", STAGING_PREFIX, self.staging_nonce);
        let opts = PutOptions { checksum: true, upsert: false, ..self.cfg.put.clone() };
        self.client.put_from(&staging, buf.addr(), len, &opts).await.map_err(|e| errno::of(&e))?;
        match self.client.rename(&staging, key, kvfs_client::RenameMode::Replace).await {
            Ok(version) => {
                // The inode the kernel holds for the name (the writer's, shared with readers
                // of the old object) keeps the old object; the name gets a new inode.
                lock(&self.table).detach(key);
                self.forget_name(key).await;
                Ok(version)
            }
            Err(e) => {
                let _ = self.client.remove(&staging, true).await;
                Err(match e.kind() {
                    ErrorKind::PutInProgress => libc::EBUSY,
                    _ => errno::of(&e),
                })
            }
        }
    }

    /// Puts `len` bytes of `buf` under `key`; `Ok(version)` when the stored object is ours.
    async fn put_and_check(&self, key: &str, buf: &Arc<Buffer>, len: u64) -> Result<u64, Errno> {
        let hashed = buf.clone();
        let ours = tokio::task::spawn_blocking(move || {
            // SAFETY: the buffer was filled above and no transfer writes it.
            *blake3::hash(&unsafe { hashed.as_slice() }[..len as usize]).as_bytes()
        })
        .await
        .map_err(|_| libc::EIO)?;
        let opts = PutOptions { checksum: true, upsert: false, ..self.cfg.put.clone() };
        self.client.put_from(key, buf.addr(), len, &opts).await.map_err(|e| errno::of(&e))?;
        let v = self.client.stat(key).await.map_err(|e| errno::of(&e))?;
        if v.checksum != Some(ours) || v.size != len {
            // First writer wins: another put of this key completed before ours.
            return Err(libc::EEXIST);
        }
        Ok(v.version)
    }
}
