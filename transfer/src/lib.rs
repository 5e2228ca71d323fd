//! The kvfs Transfer Engine.
//!
//! Everything in kvfs moves bytes through this crate: a store client writing a KV block into a
//! node's DRAM segment, a node serving a read, the FUSE daemon filling an engine's registered
//! buffer. The model is the one inference engines already know from RDMA and from Mooncake's
//! engine:
//!
//! - a **segment** is a named, remotely accessible address space: one per [`Engine`];
//! - **buffers** are registered into it: owned, page-aligned, memfd-backed [`Buffer`]s that
//!   same-host peers can map, or raw memory the application promises to keep valid;
//! - a **batch** of reads and writes between local registered memory and remote segment
//!   addresses is submitted asynchronously, and every item reports its own status;
//! - **transports** are chosen per request: a memcpy for the engine's own segment, `shm` for a
//!   peer on the same host, `rdma` (one-sided READ/WRITE on an RC queue pair per peer; cargo
//!   feature `rdma`) when both engines have a device, `tcp` (several connections, striped
//!   slices, received straight into the destination) otherwise and as the fallback;
//! - **notifications** are small messages on the same connections (prefill/decode handshakes).
//!
//! Endpoint metadata is exchanged peer to peer when a segment is opened; no service is needed.
//! No call hangs: every item completes within `op_timeout_ms`, a dead peer is an error, and a
//! broken connection is replaced and the slice retried within a bound.

mod config;
mod engine;
mod error;
mod hostid;
mod limits;
mod memory;
#[cfg(feature = "rdma")]
mod rdma;
#[cfg(not(feature = "rdma"))]
#[path = "rdma_off.rs"]
mod rdma;
mod shm;
mod tcp;
pub mod testing;

pub use config::{EngineConfig, Transports};
pub use engine::{
    Batch, BatchOptions, Engine, GuardedRead, ItemStatus, Notification, RdmaStatus, ReadGuard,
    SegmentHandle, SegmentStatus, TransferOp, TransferRequest, TransportKind, WriteNote,
};
pub use error::{Error, ErrorKind, Result};
pub use hostid::host_id;
pub use kvfs_proto::auth::ClusterSecret;
pub use kvfs_proto::transfer::{DataOp, ServedRequests};
pub use limits::raise_open_files_limit;
pub use memory::{Buffer, BufferOptions, DEVICE_CHUNK_BYTES, DeviceMemory, PageKind};
