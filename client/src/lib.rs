//! kvfs-client: the embeddable store client.
//!
//! A [`Client`] talks to the master for metadata (where objects are, leases, listings) and
//! moves bytes itself with its own Transfer Engine, directly between its memory and the nodes'
//! segments: the master is never on the data path. The CLI, the FUSE daemon and the Python
//! package all use this crate; the node daemon (`kvfs-node`) uses its master link
//! ([`master::MasterLink`]) and the read guard format ([`read_guard`]), and plugs into a client
//! of its own process as a [`LocalNode`].

mod client;
mod error;
mod locations;
pub mod master;
pub mod read_guard;
mod staging;

pub use client::{
    Client, ClientConfig, Fetched, GetInto, Keeper, LEND_BYTES_MIN, LocalCommit, LocalNode,
    ObjectInfo, PutFrom, PutOptions, StagedBytes, pipeline_chunks,
};
pub use error::{Error, ErrorKind, Result};
pub use kvfs_proto::store::{
    DirEntry, DirPage, JobKind, JobSpec, JobState, JobStatus, ListEntry, ListPage, MasterStats,
    Persistence, Pin, RemoveCounts, RenameItem, RenameMode, ReplicaDesc, Strategy, Tier,
};
pub use staging::{advise_huge_pages, keep_freed_buffers, prefault};
