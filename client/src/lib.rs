//! kvfs-client: the embeddable store client, and the node that contributes memory (and its
//! NVMe and object-store tiers) to the pool.
//!
//! A [`Client`] talks to the master for metadata (where objects are, leases, listings) and
//! moves bytes itself with its own Transfer Engine, directly between its memory and the nodes'
//! segments: the master is never on the data path. A [`Node`] contributes a DRAM segment,
//! serves transfers and keeps the master's directory rebuildable from what it holds.
//! The CLI, the FUSE daemon and the Python package all use this crate.

mod client;
mod error;
mod locations;
mod master;
pub mod node;
mod staging;

pub use client::{
    Client, ClientConfig, Fetched, GetInto, Keeper, LEND_BYTES_MIN, ObjectInfo, PutFrom,
    PutOptions, StagedBytes, pipeline_chunks,
};
pub use error::{Error, ErrorKind, Result};
pub use kvfs_proto::store::{
    DirEntry, DirPage, ListEntry, ListPage, MasterStats, Persistence, Pin, RemoveCounts,
    RenameItem, RenameMode, ReplicaDesc, Strategy, Tier,
};
pub use node::{Node, NodeConfig, NodeStats, TierConfig};
pub use staging::{advise_huge_pages, keep_freed_buffers, prefault};
