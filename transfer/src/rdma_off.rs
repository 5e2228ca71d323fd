//! The rdma transport when the crate is built without the `rdma` feature: the same names as
//! `rdma.rs`, with types that have no values, so the engine's code paths type-check in both
//! builds without `cfg` at every call site and the compiler removes them here.
//!
//! Policy: an engine built without the feature never opens a device, never advertises rdma in
//! its handshake, and refuses rdma control connections (see `tcp::serve_conn`); peers reach it
//! over shm and tcp. `Transports::rdma` is accepted and ignored (logged at debug level).

use std::net::SocketAddr;
use std::sync::Arc;

use kvfs_proto::transfer::Hello;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::config::EngineConfig;
use crate::engine::{RdmaStatus, Shared, TransferRequest};
use crate::memory::Region;
use crate::tcp::PeerInfo;
use crate::{Error, Result};

/// An opened RDMA device; none exist in this build.
#[derive(Debug, Clone)]
pub(crate) enum Nic {}

/// A region registered with the NIC; none exist in this build.
#[derive(Debug)]
pub(crate) enum Mr {}

/// The rdma side of a remote segment; none exist in this build.
pub(crate) enum RdmaPeer {}

/// What the rdma path did with a request.
#[allow(dead_code)] // constructed only by rdma.rs; here no request reaches the rdma path
pub(crate) enum Outcome {
    /// Finished (successfully or not); no other transport should try it.
    Done(Result<()>),
    /// Not carried; another transport may try within the deadline.
    Fallback(Error),
}

impl Nic {
    pub fn open(cfg: &EngineConfig) -> Result<Option<Nic>> {
        if cfg.transports.rdma {
            tracing::debug!("kvfs-transfer built without the rdma feature; rdma not used");
        }
        Ok(None)
    }

    pub fn device_name(&self) -> &str {
        match *self {}
    }

    /// # Safety
    /// As `rdma::Nic::register`.
    pub unsafe fn register(&self, _addr: u64, _len: u64) -> Option<Arc<Mr>> {
        match *self {}
    }
}

impl RdmaPeer {
    pub async fn open(_shared: &Arc<Shared>, _addr: SocketAddr, _info: &PeerInfo) -> Option<Self> {
        None
    }

    pub fn covers(&self, _remote: u64, _len: u64) -> bool {
        match *self {}
    }

    pub fn status(&self) -> RdmaStatus {
        match *self {}
    }

    pub async fn request(&self, _req: &TransferRequest, _local: &Region, _: Instant) -> Outcome {
        match *self {}
    }
}

/// Never called: `tcp::serve_conn` dispatches here only when the engine has a `Nic`.
pub(crate) async fn serve_control(_stream: TcpStream, shared: Arc<Shared>, _hello: Hello) {
    if let Some(nic) = &shared.rdma {
        match *nic {}
    }
}
