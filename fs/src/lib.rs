//! kvfs-fs: the pool as a filesystem of immutable files, and the ioctl fast path that lets
//! engines bypass FUSE.
//!
//! [`Mount::start`] serves the pool a [`kvfs_client::Client`] reaches at a mount point:
//!
//! - **Names.** Keys are paths; `/` makes directories. Names the kernel cannot hold are escaped
//!   by the reversible rule in [`names`] (`%25`, `%00`, `%` for an empty component, `%2E`,
//!   `name%+/` chains for components over 255 bytes, `name%=` for an object whose name is also
//!   a directory's). Directories are listed from the master a page at a time ([`dir`]).
//! - **Objects** are read-only files (0444) with their size, their put time as mtime, and the
//!   xattrs `user.kvfs.{key,tier,replicas,checksum,persistence,lease,pin}`. The page cache is
//!   kept across opens; reads that reach the daemon are served from one zero-copy get
//!   ([`read`]); objects in local files are read by the kernel itself through passthrough
//!   ([`passthrough`]).
//! - **Writes.** create + write + close (or fsync) is one put, committed atomically
//!   ([`write`]); a failed commit fails close/fsync and leaves nothing. `O_TRUNC` of an
//!   existing object is an atomic replacement committed at close.
//! - **Renames and unlink** ([`rename`]): rename is a metadata operation in the master (the
//!   object takes the new key and a new version; the bytes stay); unlink and replacement keep
//!   the bytes for handles already open, as POSIX does.
//! - **`/.kvfs/`** holds `control` (the fast path's ioctl target), JSON status files
//!   (`status.json`, `cluster.json`, `buffers.json`) and `jobs/`, one JSON file `ID.json` per
//!   offload/restore job the master keeps ([`control`]); all read-only, rendered at open.
//! - **Fast path** ([`fastpath`], ABI in `kvfs-fs-abi` and `fs/abi/include/kvfs.h`): shared
//!   buffers registered by ioctl, batches of gets and puts whose bytes move straight between
//!   the pool and the engine's memory.
//!
//! # Errno table
//!
//! | errno | when |
//! |---|---|
//! | `ENOENT` | no such key or directory; a name that is not the canonical spelling of a key; a job under `/.kvfs/jobs/` the master does not know (or no longer keeps) |
//! | `EPERM` | open of an object for writing without `O_TRUNC` (no in-place changes; `O_APPEND` too); chmod/chown/utime/truncate of a committed object (a file still being written accepts them: mode and times are not kept); unlink of a hard-pinned object; link, symlink, mknod; create, write, unlink, rename, mkdir, rmdir under `/.kvfs/`, and unlink, rename, rmdir of `/.kvfs/` or `/.kvfs/jobs/` themselves; setting `user.kvfs.*`; writing again after the commit |
//! | `EBUSY` | open, unlink or rename onto a file another handle of this mount is still writing; rename while a put of either name runs |
//! | `EEXIST` | create `O_EXCL` of an existing key; `RENAME_NOREPLACE` onto an existing name; mkdir of an existing name; close of a new file when another writer's put of the key completed first |
//! | `EXDEV` | rename of a directory keys are under (the store has no atomic move of a prefix; `mv` then copies and removes file by file) |
//! | `ESTALE` | the first read of a file whose name got a new object after this descriptor was opened (replaced from another mount or the store API); reopen it |
//! | `EOPNOTSUPP` | `O_TMPFILE` (the kernel's FUSE has no tmpfile call; Python's `tempfile` falls back to a named file); xattrs outside `user.kvfs.` |
//! | `EINVAL` | create or mkdir of a non-canonical name; close of a new file (or of an `O_TRUNC` replacement) before any byte was written (the store holds no empty objects; the file stays open and the old object stays); `RENAME_EXCHANGE`, `RENAME_WHITEOUT`; renaming a directory into itself |
//! | `ENAMETOOLONG` | create/mkdir of a key longer than `key_bytes_max` (4096) |
//! | `EISDIR` / `ENOTDIR` | a file operation on a directory, or the reverse |
//! | `ENOTEMPTY` | rmdir of a directory keys are under |
//! | `EFBIG` | writing past `staging_file_bytes_max` (1 GiB); reading through FUSE an object larger than `fetch_bytes_max`; a put larger than the pool's largest object |
//! | `ENOSPC` | the daemon's write staging (`staging_bytes_max`, 4 GiB) is full; the pool has no room at close |
//! | `ENOMEM` | no room to hold fetched bytes within the operation timeout |
//! | `EAGAIN` | close while another writer is putting the key, or while the master recovers (for `/.kvfs/jobs/`: while it reads its job records after a restart) |
//! | `ENOTCONN` | the master cannot be reached |
//! | `EIO` | moving the bytes failed on every replica |
//! | `EBADMSG` | bytes read do not match the object's checksum |
//! | `ETIMEDOUT` | an operation ran past `op_timeout_ms` (30 s) |
//! | `ENODATA` | an xattr an object does not have |
//! | `ERANGE` | an xattr buffer too small |
//! | `ENOTTY` | an ioctl on anything but `/.kvfs/control`, or an unknown command |
//!
//! The fast path's own errnos are in [`fastpath`] and the header.

pub mod control;
mod dir;
pub mod errno;
pub mod fastpath;
mod fuse;
mod inode;
mod mount;
pub mod names;
pub mod passthrough;
pub mod procfs;
mod read;
mod rename;
mod staging;
mod state;
mod write;

pub use fastpath::FastPathConfig;
pub use kvfs_fs_abi as abi;
pub use mount::{Mount, MountConfig, MountProbe, lazy_unmount};
pub use passthrough::{DirSource, PassthroughSource};
