//! rename(2), renameat2 and unlink with POSIX lifetimes.
//!
//! Mechanism. Renaming an object is one `Rename` call to the master: the object keeps its bytes
//! and replicas, takes the new key and a new version, and the object that had the new name (if
//! any) is replaced. Readers see the old object or the renamed one under the new name, whole,
//! at every instant: the master swaps the name under one lock, and a file opened here is read
//! from bytes fetched whole (a version that changed between open and the first read is
//! `ESTALE`, never a mix). After the call the inode the kernel moved keeps its number and is
//! re-keyed in the table, so the renamed file stays reachable through descriptors and cached
//! dentries.
//!
//! POSIX lifetimes. Before a name goes (unlink, or replaced by a rename), every handle open on
//! this mount for that object gets its bytes fetched, and unlink/replace no longer wait for the
//! read lease: the master keeps a leased object's ranges until the lease ends. So a reader that
//! opened the file keeps reading the old bytes, as POSIX says of an unlinked open file.
//! Passthrough handles read the NVMe file, whose inode outlives the unlink anyway.
//!
//! Files still being written: renaming one commits what was written under the old name first
//! and then renames the object (a writer renaming before its close gets the atomic publish it
//! asked for; later writes on that descriptor fail with `EPERM`, as after any commit); one with
//! no bytes yet is re-targeted and commits under the new name at close, replacing what is
//! there. Unlinking one discards its bytes at close, as an unlinked file's are.
//!
//! Directories: one made with mkdir and holding no key is renamed here (it lives only in this
//! daemon); one with keys under it is `EXDEV` (the store has no atomic move of a prefix; `mv`
//! then copies and removes, object by object). `RENAME_EXCHANGE` and `RENAME_WHITEOUT` are
//! `EINVAL`.

use std::ffi::OsStr;
use std::sync::Arc;

use kvfs_client::{ErrorKind, RenameMode};

use crate::errno;
use crate::inode::{DirNode, Kind, ObjAttr};
use crate::names::{self, Piece};
use crate::state::{Errno, Found, Handle, Inner, bump, lock};

impl Inner {
    /// The key a name in `parent` would have as a file (for the target of a rename).
    fn file_key(&self, parent: u64, name: &OsStr) -> Result<(DirNode, String, bool), Errno> {
        let dir = match self.kind_of(parent)? {
            Kind::Dir(d) => d,
            Kind::ControlDir | Kind::JobsDir => return Err(libc::EPERM),
            _ => return Err(libc::ENOTDIR),
        };
        if parent == crate::inode::ROOT && name == names::CONTROL_DIR {
            return Err(libc::EPERM);
        }
        let (raw, file_mark) = match names::decode_piece(name.as_encoded_bytes()) {
            Some(Piece::Last { raw, file_mark }) => (raw, file_mark),
            Some(Piece::Chunk(_)) | None => return Err(libc::EINVAL),
        };
        let key = self.key_of(&dir, name, &raw, file_mark).ok_or(libc::EINVAL)?;
        if key.len() > self.cfg.key_bytes_max {
            return Err(libc::ENAMETOOLONG);
        }
        Ok((dir, key, file_mark))
    }

    /// rename / renameat2 (`flags`: `RENAME_NOREPLACE`; others are `EINVAL`).
    pub async fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<(), Errno> {
        if flags & !libc::RENAME_NOREPLACE != 0 {
            return Err(libc::EINVAL);
        }
        let mode = if flags != 0 { RenameMode::NoReplace } else { RenameMode::Replace };
        match self.resolve(parent, name).await? {
            Found::Object { key, pending, .. } => {
                let (_, to, file_mark) = self.file_key(newparent, newname)?;
                if to == key {
                    return Ok(());
                }
                match self.resolve(newparent, newname).await {
                    Ok(Found::Dir(_)) => return Err(libc::EISDIR),
                    Ok(Found::Object { pending: true, .. }) => return Err(libc::EBUSY),
                    Ok(Found::Object { .. }) if mode == RenameMode::NoReplace => {
                        return Err(libc::EEXIST);
                    }
                    Ok(Found::Object { .. }) | Err(libc::ENOENT) => {}
                    Ok(_) => return Err(libc::EPERM),
                    Err(e) => return Err(e),
                }
                if !file_mark && self.dir_exists(&format!("{to}/")).await? {
                    return Err(libc::EISDIR);
                }
                if pending && !self.commit_pending_for_rename(&key, &to, newparent, newname).await?
                {
                    return Ok(());
                }
                self.keep_open_bytes(&key).await;
                self.keep_open_bytes(&to).await;
                let version =
                    self.client.rename(&key, &to, mode).await.map_err(|e| match e.kind() {
                        ErrorKind::PutInProgress => libc::EBUSY,
                        _ => errno::of(&e),
                    })?;
                // The object that had the new name is gone by name: inodes the kernel still
                // holds for it keep its attributes (readers of open files see it whole).
                lock(&self.table).detach(&to);
                self.rekey_object(&key, &to, version);
                bump(&self.counters.renames, 1);
                Ok(())
            }
            Found::Dir(d) => self.rename_local_dir(d, newparent, newname, mode).await,
            _ => Err(libc::EPERM),
        }
    }

    /// A rename of a file this mount is still writing. With bytes written, they are committed
    /// under the old name first (`Ok(true)`: go on and rename the object). With none, the
    /// writer is re-targeted and will replace `to` at its close (`Ok(false)`: done).
    async fn commit_pending_for_rename(
        &self,
        key: &str,
        to: &str,
        newparent: u64,
        newname: &OsStr,
    ) -> Result<bool, Errno> {
        let Some(w) = self.writer_of(key) else { return Err(libc::EBUSY) };
        let mut w = w.lock().await;
        if w.key != key || !w.is_open() {
            return Err(libc::EBUSY);
        }
        if w.staged_len() > 0 {
            self.commit(&mut w).await?;
            return Ok(true);
        }
        let ino = w.ino;
        lock(&self.pending).remove(key);
        w.retarget(to.to_string(), newparent, newname.to_os_string());
        lock(&self.table).rekey(ino, Kind::Object { key: to.to_string() });
        Ok(false)
    }

    /// The write handle of a pending key.
    pub fn writer_of(&self, key: &str) -> Option<Arc<tokio::sync::Mutex<crate::write::Writer>>> {
        lock(&self.pending).get(key)?.writer.upgrade()
    }

    /// Fetches the bytes of every handle open here on `key` that has not read yet, so that
    /// they survive the name going away (POSIX: an open file keeps its contents).
    pub async fn keep_open_bytes(&self, key: &str) {
        let open: Vec<_> = lock(&self.handles)
            .values()
            .filter_map(|h| match h {
                Handle::Read(r) if r.key == key => Some(r.clone()),
                _ => None,
            })
            .collect();
        for h in open {
            let _ = self.bytes(&h).await;
        }
    }

    /// After a rename: the inodes named by `from` now stand for `to` at `version`.
    fn rekey_object(&self, from: &str, to: &str, version: u64) {
        let mut t = lock(&self.table);
        for ino in t.inos_of(&Kind::Object { key: from.to_string() }) {
            t.rekey(ino, Kind::Object { key: to.to_string() });
            if let Some(n) = t.get_mut(ino) {
                n.attr = n.attr.map(|a| ObjAttr { size: a.size, version });
            }
        }
    }

    async fn rename_local_dir(
        &self,
        d: DirNode,
        newparent: u64,
        newname: &OsStr,
        mode: RenameMode,
    ) -> Result<(), Errno> {
        if !d.chain.is_empty() || !lock(&self.local_dirs).contains_key(&d.prefix) {
            return Err(libc::EXDEV);
        }
        let (_, to, file_mark) = self.file_key(newparent, newname)?;
        if file_mark {
            return Err(libc::EINVAL);
        }
        let to = format!("{to}/");
        if to.starts_with(&d.prefix) {
            return Err(libc::EINVAL);
        }
        match self.resolve(newparent, newname).await {
            Ok(Found::Dir(t)) if mode == RenameMode::Replace => {
                let empty_local = lock(&self.local_dirs).contains_key(&t.prefix)
                    && !self.dir_has_keys(&t.prefix).await?;
                if !empty_local {
                    return Err(libc::ENOTEMPTY);
                }
            }
            Ok(Found::Dir(_)) => return Err(libc::EEXIST),
            Ok(Found::Object { .. }) => return Err(libc::ENOTDIR),
            Err(libc::ENOENT) => {}
            Ok(_) => return Err(libc::EPERM),
            Err(e) => return Err(e),
        }
        if self.dir_has_keys(&d.prefix).await? {
            return Err(libc::EXDEV);
        }
        let mut local = lock(&self.local_dirs);
        let inner: Vec<String> = local
            .range(d.prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&d.prefix))
            .map(|(p, _)| p.clone())
            .collect();
        for p in inner {
            local.remove(&p);
            local.insert(format!("{to}{}", &p[d.prefix.len()..]), Vec::new());
        }
        drop(local);
        let mut t = lock(&self.table);
        for ino in t.inos_of(&Kind::Dir(d.clone())) {
            t.rekey(ino, Kind::Dir(DirNode::dir(to.clone())));
        }
        Ok(())
    }

    /// unlink: the name goes at once, even while readers hold the object (they keep its
    /// bytes); a file being written here is discarded at its close. Hard-pinned objects are
    /// `EPERM`.
    pub async fn unlink(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        match self.resolve(parent, name).await? {
            Found::Object { pending: true, key, .. } => {
                let Some(w) = self.writer_of(&key) else { return Err(libc::EBUSY) };
                let mut w = w.lock().await;
                lock(&self.pending).remove(&key);
                w.discard_at_close();
                bump(&self.counters.unlinks, 1);
                Ok(())
            }
            Found::Object { key, .. } => {
                self.keep_open_bytes(&key).await;
                self.client.unlink(&key).await.map_err(|e| match e.kind() {
                    ErrorKind::NotFound => libc::ENOENT,
                    ErrorKind::PutInProgress => libc::EBUSY,
                    _ => errno::of(&e),
                })?;
                lock(&self.table).detach(&key);
                bump(&self.counters.unlinks, 1);
                Ok(())
            }
            Found::Dir(_) => Err(libc::EISDIR),
            _ => Err(libc::EPERM),
        }
    }
}
