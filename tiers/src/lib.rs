//! `kvfs-tiers`: the storage media of a kvfs node and the tier policy core.
//!
//! - [`Medium`]: one async trait for a store of whole objects by key, implemented by
//!   [`DramMedium`] (memfd or caller region + offset allocator), [`NvmeMedium`] (io_uring,
//!   O_DIRECT, one file per object), [`ObjectStoreMedium`] (opendal: `fs`, `s3`, any scheme) and
//!   [`HbmMedium`] (cudarc; `Unavailable` where no CUDA driver is found), plus
//!   [`FaultyMedium`] that injects failures around any of them. Renames keep the bytes and
//!   record the previous name in the copy, so a crash mid-rename is resolved by whoever lists
//!   the copies ([`stale_after_rename`]).
//! - [`nvmeof`]: a remote NVMe namespace reached over nvme-tcp (the kernel's fabrics interface),
//!   its ext4 file system mounted where an [`NvmeMedium`] keeps its files.
//! - [`policy`]: a sans-IO state machine that decides demotions, promotions and drops.
//! - [`writeback`]: the bounded, crash-safe lazy-persistence queue.
//! - [`bench`]: measurements against raw O_DIRECT in the same run.
//!
//! The crate depends on nothing else in kvfs; the node daemon embeds it.

pub mod alloc;
pub mod bench;
pub mod dram;
pub mod error;
pub mod fault;
pub mod hbm;
pub mod header;
pub mod medium;
pub mod nvme;
pub mod nvmeof;
pub mod object;
pub mod policy;
pub mod uring;
pub mod writeback;

pub use fault::{Fault, FaultyMedium, Op};
pub use hbm::{HbmBlock, HbmMedium, PinnedHost};
pub use object::{ListedObject, ObjectStoreConfig, ObjectStoreLimits, ObjectStoreMedium};

pub use dram::{DramMedium, DramView};
pub use error::{Error, ErrorKind, Result};
pub use medium::{
    Capabilities, KEY_BYTES_MAX, Medium, ObjectMeta, Persistence, PutMode, PutOptions,
    RenameOptions, checksum, stale_after_rename,
};
pub use nvme::{NvmeConfig, NvmeMedium, NvmeStats, OpenReport};
pub use nvmeof::{Attachment as NvmeofAttachment, NvmeofSpec};
pub use uring::RingConfig;
