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
//!   ([`write`]); a failed commit fails close/fsync and leaves nothing.
//! - **`/.kvfs/`** holds `control` (the fast path's ioctl target) and JSON status files
//!   ([`control`]).
//! - **Fast path** ([`fastpath`], ABI in `kvfs-fs-abi` and `fs/abi/include/kvfs.h`): shared
//!   buffers registered by ioctl, batches of gets and puts whose bytes move straight between
//!   the pool and the engine's memory.
//!
//! # Errno table
//!
//! | errno | when |
//! |---|---|
//! | `ENOENT` | no such key or directory; a name that is not the canonical spelling of a key |
//! | `EPERM` | opening an object for writing (or with `O_TRUNC`); changing an object's size, mode, owner or times; unlink of a hard-pinned object; link, symlink, mknod; anything written under `/.kvfs/`; `user.kvfs.*` xattr writes |
//! | `EBUSY` | unlink of an object under a read lease (reading an object takes one, default 10 s); opening or unlinking a file another handle is still writing |
//! | `EEXIST` | create with `O_EXCL` of an existing key; mkdir of an existing name; close of a new file when another writer's put of the same key completed first |
//! | `EOPNOTSUPP` | rename (keys are identities; the store has no atomic move); xattrs outside `user.kvfs.` |
//! | `EINVAL` | create/mkdir of a name that is not canonical (e.g. `%41`, a lone `%`) or of a `%+` name as a file; close of a new file before any byte was written (the store holds no empty objects; the file stays open, as shells close duplicates before writing) |
//! | `ENAMETOOLONG` | create/mkdir of a key longer than `key_bytes_max` (4096) |
//! | `EISDIR` / `ENOTDIR` | a file operation on a directory, or the reverse |
//! | `ENOTEMPTY` | rmdir of a directory keys are under |
//! | `EFBIG` | writing past `staging_file_bytes_max` (1 GiB); reading through FUSE an object larger than `fetch_bytes_max`; a put larger than the pool's largest object |
//! | `ENOSPC` | the daemon's write staging (`staging_bytes_max`, 4 GiB) is full; the pool has no room at close |
//! | `ENOMEM` | no room to hold fetched bytes within the operation timeout |
//! | `EAGAIN` | close while another writer is putting the key, or while the master recovers |
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
