//! FUSE passthrough: when an object's bytes sit in a local file whose offset 0 is the object's
//! first byte (the NVMe tier's data-first files, a file-backed DRAM segment), the kernel reads
//! that file directly and the daemon sees no read requests at all (kernel 6.9+, root).
//!
//! Mechanism. A [`PassthroughSource`] answers, per key, with a descriptor and the number of
//! object bytes it holds. At open the mount asks it (only for objects opened read-only, and only
//! when the size matches what the master says), registers the descriptor with the kernel as a
//! backing file and opens the file in passthrough mode. The kernel requires every open of one
//! inode to use the same backing file and forbids mixing passthrough and cached opens of an
//! inode, so the mount keeps one backing id per inode while any passthrough handle is open and
//! never starts passthrough on an inode that has cached opens (those fall back to normal reads).
//!
//! Policy. A source must hand out only files the daemon may read and that stay unchanged while
//! open (objects are immutable; a tier that moves an object must leave the old file readable
//! until it is closed, as unlinked files are).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

/// Where objects' bytes may sit in local files.
pub trait PassthroughSource: Send + Sync + 'static {
    /// A descriptor of a file whose offset 0 is the first byte of object `key`, and how many of
    /// the object's bytes it holds; `None` when the object is not in a local file.
    fn object_file(&self, key: &str) -> Option<(OwnedFd, u64)>;
}

/// A source backed by one file per key in a directory, named by [`crate::names::key_to_path`]
/// (`/` in keys become subdirectories). Used by tests and by deployments that export objects
/// as plain files.
#[derive(Debug, Clone)]
pub struct DirSource {
    root: PathBuf,
}

impl DirSource {
    pub fn new(root: impl Into<PathBuf>) -> DirSource {
        DirSource { root: root.into() }
    }

    /// Where `key`'s file lives.
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.root.join(crate::names::key_to_path(key))
    }
}

impl PassthroughSource for DirSource {
    fn object_file(&self, key: &str) -> Option<(OwnedFd, u64)> {
        let f = std::fs::File::open(self.path_of(key)).ok()?;
        let len = f.metadata().ok()?.len();
        Some((f.into(), len))
    }
}

/// The backing files the kernel holds for open passthrough inodes: one per inode, shared by
/// its handles, closed with the last one.
#[derive(Default)]
pub struct Backings {
    by_ino: HashMap<u64, (Arc<fuser::BackingId>, u32)>,
}

impl Backings {
    /// The backing of an inode with passthrough handles open, taking one more reference.
    pub fn reuse(&mut self, ino: u64) -> Option<Arc<fuser::BackingId>> {
        let (id, n) = self.by_ino.get_mut(&ino)?;
        *n += 1;
        Some(id.clone())
    }

    pub fn insert(&mut self, ino: u64, id: Arc<fuser::BackingId>) {
        self.by_ino.insert(ino, (id, 1));
    }

    /// A passthrough handle of `ino` closed.
    pub fn release(&mut self, ino: u64) {
        if let Some((_, n)) = self.by_ino.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                self.by_ino.remove(&ino);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.by_ino.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_ino.is_empty()
    }
}
