//! Transfer Engine configuration: every queue, timeout and size has a bound here.

use std::net::SocketAddr;
use std::time::Duration;

/// Which transports the engine may choose from. Selection is automatic among the enabled ones:
/// the local segment is a memcpy, same-host peers use shm, others rdma (when built with the
/// `rdma` feature, both sides have a device, and the range is registered with the NIC) or tcp.
/// `Transports { shm: false, rdma: true, tcp: true }` makes same-host peers use rdma (tests,
/// and NIC loopback measurements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transports {
    pub shm: bool,
    pub tcp: bool,
    pub rdma: bool,
}

impl Default for Transports {
    fn default() -> Self {
        Transports { shm: true, tcp: true, rdma: true }
    }
}

impl Transports {
    /// Only TCP (benchmarks and tests that must cross a socket even on one host).
    pub fn tcp_only() -> Self {
        Transports { shm: false, tcp: true, rdma: false }
    }
}

/// Configuration of one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Segment name other engines open this one by; defaults to the listen address.
    pub name: Option<String>,
    /// Where the engine accepts connections from peers.
    pub listen: SocketAddr,
    pub transports: Transports,
    /// TCP connections opened to each peer; large requests are striped across them.
    pub tcp_conns_per_peer: usize,
    /// Size of one TCP slice: requests above it are split and spread over the connections.
    pub slice_bytes: u64,
    /// A request not answered within this time fails with `Timeout` (the connection is reset).
    pub op_timeout_ms: u64,
    /// Connect plus handshake must finish within this time.
    pub connect_timeout_ms: u64,
    /// How many times a slice that failed on a broken connection is tried again, on another
    /// connection or a fresh one, before the item fails (always within `op_timeout_ms`).
    pub retries_max: u32,
    /// Most items in one batch.
    pub batch_items_max: usize,
    /// Most slices queued on one connection; more wait, then fail with `Busy`.
    pub queue_depth_max: usize,
    /// Largest notification message.
    pub notify_bytes_max: usize,
    /// Most received notifications held until the application takes them.
    pub notify_queue_max: usize,
    /// A refused write's payload up to this size is drained to keep the connection; a larger
    /// one closes it.
    pub write_drain_bytes_max: u64,
    /// The cluster secret every tcp, rdma control and shm connection proves before its
    /// handshake, both ways (none: no proof asked or given; see `kvfs_proto::auth`).
    pub cluster_secret: Option<kvfs_proto::auth::ClusterSecret>,
    /// Shm copies from this size up are spread over several threads (smaller ones run inline
    /// on the calling task).
    pub shm_parallel_bytes_min: u64,
    /// Most threads one shm copy is spread over (also capped by the CPUs available).
    pub shm_copy_threads_max: usize,
    /// TCP socket buffer size to request (0 keeps the kernel's auto-tuning).
    pub socket_buffer_bytes: usize,
    /// How long a request on a peer's direct connection (a lone small request, sent and
    /// received by its caller's own task) polls the socket for its reply before it parks until
    /// the reply comes (yielding the CPU between polls): a loopback or same-rack reply arrives
    /// within tens of microseconds, and parking then waking costs about as much again. 0 parks
    /// at once. At most 1000.
    pub tcp_direct_spin_us: u64,
    /// How long the serving side of a connection polls it for the next request after
    /// answering a lone small request (the pattern of a peer's direct connection) before it
    /// parks until one comes: the next request of a caller making one call after another
    /// then wakes no task here. 0 parks at once. At most 1000.
    pub tcp_serve_spin_us: u64,
    /// RDMA device to open (`mlx5_0`, `rxe0`); `None` takes the first with an active port. A
    /// named device that does not exist while others do fails `Engine::start` (a machine with
    /// none runs without rdma). Ignored without the `rdma` feature.
    pub rdma_device: Option<String>,
    /// GID table index of the RDMA port; `None` chooses one (RoCE v2 IPv4-mapped first).
    pub rdma_gid_index: Option<u32>,
    /// Most rdma ops waiting in the queue to one peer's worker, which keeps at most as many
    /// again submitted to the endpoint; more wait, then fail with `Busy` at their deadline.
    pub rdma_queue_depth_max: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            transports: Transports::default(),
            tcp_conns_per_peer: 4,
            slice_bytes: 1 << 20,
            op_timeout_ms: 10_000,
            connect_timeout_ms: 3_000,
            retries_max: 3,
            batch_items_max: 65_536,
            queue_depth_max: 1024,
            notify_bytes_max: 64 << 10,
            notify_queue_max: 1024,
            write_drain_bytes_max: 64 << 20,
            cluster_secret: None,
            shm_parallel_bytes_min: 2 << 20,
            shm_copy_threads_max: 4,
            socket_buffer_bytes: 0,
            tcp_direct_spin_us: 50,
            tcp_serve_spin_us: 50,
            rdma_device: None,
            rdma_gid_index: None,
            rdma_queue_depth_max: 1024,
        }
    }
}

impl EngineConfig {
    pub fn op_timeout(&self) -> Duration {
        Duration::from_millis(self.op_timeout_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        use crate::{Error, ErrorKind::InvalidArgument};
        let bad = |what: &str| Err(Error::new(InvalidArgument, "engine config", what.to_string()));
        if self.tcp_conns_per_peer == 0 || self.tcp_conns_per_peer > 64 {
            return bad("tcp_conns_per_peer must be 1..=64");
        }
        if self.slice_bytes < 4096 {
            return bad("slice_bytes must be at least 4096");
        }
        if self.op_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return bad("timeouts must be positive");
        }
        if self.batch_items_max == 0
            || self.queue_depth_max == 0
            || self.notify_queue_max == 0
            || self.rdma_queue_depth_max == 0
        {
            return bad("queue bounds must be positive");
        }
        if self.tcp_direct_spin_us > 1000 || self.tcp_serve_spin_us > 1000 {
            return bad("tcp_direct_spin_us and tcp_serve_spin_us must be at most 1000");
        }
        if !(self.transports.tcp || self.transports.shm || self.transports.rdma) {
            return bad("at least one transport must be enabled");
        }
        Ok(())
    }
}
