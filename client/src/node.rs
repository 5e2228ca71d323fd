//! The node: contributes a DRAM segment to the pool, serves transfers into and out of it, and
//! keeps the master informed.
//!
//! Mechanism. A node runs a Transfer Engine with one registered, shareable DRAM buffer (its
//! segment). The master allocates ranges in it; writers and readers move bytes directly with
//! the node's engine, which serves them without the node's code being involved. The node keeps
//! one connection to the master: it registers (with every object it holds), heartbeats, and
//! answers the master's `Commit` and `Drop` records, which keep its index of held objects
//! exact. When the connection breaks (master restart, network), the node reconnects with
//! backoff and registers again with its index: the master rebuilds its directory from that,
//! so a master restart loses nothing that nodes hold.
//!
//! Invariants: the index holds exactly the objects the master committed to this node and has
//! not dropped; a `Drop` for a range that now holds another object (a newer commit) is ignored.
//!
//! Not handled here: NVMe and object-store tiers (the tier manager adds them), HBM segments.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_proto::store::{
    CommitItem, DropItem, ErrorCode, HeldObject, MasterRequest, MasterResponse, NodeRegistration,
    NodeRequest, NodeResponse, Persistence, Pin, Role, SegmentSpec, Tier,
};
use kvfs_rpc::{RpcConn, handler_fn};
use kvfs_transfer::{Buffer, BufferOptions, Engine, EngineConfig};
use tokio::task::JoinHandle;

use crate::master::MasterLink;
use crate::{Error, ErrorKind, Result};

/// Configuration of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub master: String,
    pub engine: EngineConfig,
    /// Bytes of DRAM contributed to the pool.
    pub dram_bytes: u64,
    /// Stable identity; random when not given (a restarted node is then a new node).
    pub node_id: Option<u64>,
    /// Fault every page of the segment in at start (first writes then pay no page faults).
    pub populate: bool,
    pub rpc_timeout_ms: u64,
    /// Upper bound of the reconnect backoff.
    pub reconnect_backoff_max_ms: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            master: "127.0.0.1:50051".into(),
            engine: EngineConfig::default(),
            dram_bytes: 1 << 30,
            node_id: None,
            populate: true,
            rpc_timeout_ms: 5_000,
            reconnect_backoff_max_ms: 2_000,
        }
    }
}

#[derive(Debug, Clone)]
struct Held {
    segment: u32,
    offset: u64,
    size: u64,
    checksum: Option<[u8; 32]>,
    version: u64,
    persistence: Persistence,
    pin: Pin,
}

struct Inner {
    id: u64,
    cfg: NodeConfig,
    engine: Engine,
    dram: Arc<Buffer>,
    index: Mutex<HashMap<String, Held>>,
    registered_once: AtomicBool,
    registered: tokio::sync::watch::Sender<bool>,
}

/// A running node. Dropping it stops it (without telling the master, which then expires it);
/// [`Node::shutdown`] leaves cleanly.
pub struct Node {
    inner: Arc<Inner>,
    link: Arc<MasterLink>,
    task: JoinHandle<()>,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Node {
    /// Starts the engine, allocates the segment and begins registering with the master (in the
    /// background: a node started before its master keeps trying).
    pub async fn start(cfg: NodeConfig) -> Result<Node> {
        if cfg.dram_bytes == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "node",
                "dram_bytes must be positive",
            ));
        }
        let engine = Engine::start(cfg.engine.clone())
            .await
            .map_err(|e| Error::from_transfer("node", &e))?;
        let opts = BufferOptions {
            populate: cfg.populate,
            name: "kvfs-dram-segment".into(),
            ..Default::default()
        };
        let dram = engine
            .alloc_buffer(cfg.dram_bytes as usize, &opts)
            .map_err(|e| Error::from_transfer("node", &e))?;
        let id = cfg.node_id.unwrap_or_else(rand::random);
        let (registered, _) = tokio::sync::watch::channel(false);
        let inner = Arc::new(Inner {
            id,
            cfg,
            engine,
            dram,
            index: Mutex::new(HashMap::new()),
            registered_once: AtomicBool::new(false),
            registered,
        });
        let handler = {
            let inner = Arc::downgrade(&inner);
            handler_fn(move |_conn: RpcConn, req: NodeRequest| {
                let inner = inner.upgrade();
                async move {
                    match inner {
                        Some(inner) => inner.apply(req),
                        None => NodeResponse::Refused(kvfs_proto::store::WireError::new(
                            ErrorCode::Internal,
                            "node stopping",
                        )),
                    }
                }
            })
        };
        let timeout = Duration::from_millis(inner.cfg.rpc_timeout_ms);
        let link = Arc::new(MasterLink::new(
            inner.cfg.master.clone(),
            Role::Node,
            kvfs_transfer::host_id().to_string(),
            handler,
            timeout,
        ));
        let task = tokio::spawn(run(inner.clone(), link.clone()));
        tracing::info!(node = id, segment = %inner.engine.name(), bytes = inner.cfg.dram_bytes, "node started");
        Ok(Node { inner, link, task })
    }

    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The node's Transfer Engine segment name.
    pub fn endpoint(&self) -> &str {
        self.inner.engine.name()
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// Objects this node holds.
    pub fn held_objects(&self) -> usize {
        self.inner.index.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Waits until the node is registered with the master (at most `timeout`).
    pub async fn wait_registered(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.inner.registered.subscribe();
        let wait = rx.wait_for(|r| *r);
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(Error::new(
                ErrorKind::Unavailable,
                "node",
                format!("not registered within {timeout:?}"),
            )),
        }
    }

    /// Leaves the cluster: tells the master (its objects here are then gone) and stops.
    pub async fn shutdown(self) {
        self.task.abort();
        let _ = self
            .link
            .call("unregister", &MasterRequest::UnregisterNode { node: self.inner.id })
            .await;
        self.link.close().await;
    }
}

impl Inner {
    fn apply(&self, req: NodeRequest) -> NodeResponse {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        match req {
            NodeRequest::Commit(items) => {
                for CommitItem {
                    key,
                    segment,
                    offset,
                    size,
                    checksum,
                    version,
                    persistence,
                    pin,
                } in items
                {
                    index.insert(
                        key,
                        Held { segment, offset, size, checksum, version, persistence, pin },
                    );
                }
            }
            NodeRequest::Drop(items) => {
                for DropItem { key, segment, offset, .. } in items {
                    if index.get(&key).is_some_and(|h| h.segment == segment && h.offset == offset) {
                        index.remove(&key);
                    }
                }
            }
        }
        NodeResponse::Done
    }

    fn registration(&self) -> NodeRegistration {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let held = index
            .iter()
            .map(|(key, h)| HeldObject {
                key: key.clone(),
                size: h.size,
                checksum: h.checksum,
                version: h.version,
                segment: h.segment,
                offset: h.offset,
                tier: Tier::Dram,
                persistence: h.persistence,
                pin: h.pin,
                persisted: false,
            })
            .collect();
        NodeRegistration {
            node: self.id,
            host: kvfs_transfer::host_id().to_string(),
            endpoint: self.engine.name().to_string(),
            segments: vec![SegmentSpec {
                index: 0,
                tier: Tier::Dram,
                base_addr: self.dram.addr(),
                capacity: self.dram.len() as u64,
            }],
            held,
            reconnect: self.registered_once.load(Ordering::Acquire),
        }
    }
}

/// Register, heartbeat, and start over whenever the master goes away.
async fn run(inner: Arc<Inner>, link: Arc<MasterLink>) {
    let mut backoff = Duration::from_millis(50);
    let backoff_max = Duration::from_millis(inner.cfg.reconnect_backoff_max_ms.max(50));
    loop {
        match register(&inner, &link).await {
            Ok(heartbeat) => {
                backoff = Duration::from_millis(50);
                inner.registered.send_replace(true);
                heartbeat_until_lost(&inner, &link, heartbeat).await;
                inner.registered.send_replace(false);
            }
            Err(e) => {
                tracing::debug!(node = inner.id, error = %e, "registration failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(backoff_max);
            }
        }
    }
}

async fn register(inner: &Inner, link: &MasterLink) -> Result<Duration> {
    let reg = inner.registration();
    let held = reg.held.len();
    match link.call("register", &MasterRequest::RegisterNode(reg)).await? {
        MasterResponse::Registered(Ok(ack)) => {
            inner.registered_once.store(true, Ordering::Release);
            tracing::info!(
                node = inner.id,
                held,
                adopted = ack.adopted,
                conflicts = ack.conflicts,
                "registered with the master"
            );
            Ok(Duration::from_millis(ack.heartbeat_ms.max(10)))
        }
        MasterResponse::Registered(Err(e)) => Err(Error::from_wire("register", &e)),
        other => {
            Err(Error::new(ErrorKind::Internal, "register", format!("unexpected answer {other:?}")))
        }
    }
}

/// Heartbeats until the master forgets the node or the connection fails.
async fn heartbeat_until_lost(inner: &Inner, link: &MasterLink, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        match link.call("heartbeat", &MasterRequest::Heartbeat { node: inner.id }).await {
            Ok(MasterResponse::Heartbeat(Ok(()))) => {}
            Ok(MasterResponse::Heartbeat(Err(e))) if e.code == ErrorCode::NodeUnknown => {
                tracing::warn!(
                    node = inner.id,
                    "the master does not know this node; registering again"
                );
                return;
            }
            Ok(other) => {
                tracing::warn!(node = inner.id, answer = ?other, "unexpected heartbeat answer");
                return;
            }
            Err(e) => {
                tracing::warn!(node = inner.id, error = %e, "lost the master; reconnecting");
                return;
            }
        }
    }
}
