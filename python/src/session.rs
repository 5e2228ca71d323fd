//! A connection to a kvfs cluster from Python: a kvfs client, and optionally an embedded node
//! that contributes this process's DRAM to the pool (the reference's embedded mode,
//! `global_segment_size > 0`).
//!
//! Mechanism. [`Session::open`] starts one Transfer Engine, listening on the caller's host and,
//! when asked (the reference's `setup`), on a port drawn from a range (12300..14300 there);
//! its segment name is `host:port`, which is what `get_hostname()` returns. With a segment the
//! engine belongs to an embedded [`Node`] and the client shares it, so this process reads and
//! writes its own segment by memcpy and other processes reach it like any node. The client
//! connects to the master before the node is awaited, so an unreachable master fails `setup`
//! quickly.
//!
//! Closing shuts the node down cleanly (the master forgets its segment, and the objects stored
//! only there disappear, as the reference's `close` unmounts) and drops the client.
//!
//! A session dropped without `close` (a garbage-collected store, an interpreter exiting) still
//! leaves: its `Drop` unregisters the embedded node within [`LEAVE_TIMEOUT`] on the process's
//! runtime (waiting for it where the dropping thread may block, in the background where it is
//! itself inside the runtime), so the master stops placing on the segment at once instead of
//! after the node TTL, as the reference's destructor and atexit handler unmount it. Past the
//! limit the node is dropped anyway and expires on the master. A session inherited across
//! `fork()` never talks to the master from the child (its connections are the parent's): the
//! child forgets its node instead.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use kvfs_client::{Client, ClientConfig};
use kvfs_node::{Node, NodeConfig};
use kvfs_transfer::{Engine, EngineConfig, Transports};
use rand::Rng;

use crate::errors::Failure;

/// How to open a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub master: String,
    /// `host` or `host:port` this process's engine listens on and names its segment after;
    /// `None` listens on 127.0.0.1 with a port from the kernel and keeps the default name.
    pub local_hostname: Option<String>,
    /// Ports to draw from when `local_hostname` names no port.
    pub port_range: Option<(u16, u16)>,
    /// DRAM this process contributes to the pool (0: a pure client).
    pub segment_bytes: u64,
    /// Fault the segment's pages in at start.
    pub populate: bool,
    /// GPU memory (device 0) the embedded node also contributes as an HBM segment (0: none;
    /// needs a DRAM segment and a CUDA driver).
    pub hbm_bytes: u64,
    /// Bytes the bytes API may stage at once.
    pub staging_bytes_max: usize,
    pub tcp_only: bool,
    pub rpc_timeout_ms: u64,
    /// Deadline of every Python call.
    pub call_timeout_ms: u64,
    /// How long setup waits for the embedded node to register with the master.
    pub register_timeout_ms: u64,
    /// The tenant whose namespace and quota this process works in (`tenant_id`).
    pub tenant: Option<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            master: "127.0.0.1:50051".into(),
            local_hostname: None,
            port_range: None,
            segment_bytes: 0,
            populate: false,
            hbm_bytes: 0,
            staging_bytes_max: usize::MAX,
            tcp_only: false,
            rpc_timeout_ms: 5_000,
            call_timeout_ms: 60_000,
            register_timeout_ms: 10_000,
            tenant: None,
        }
    }
}

pub struct Session {
    pub client: Client,
    node: Option<Node>,
    pub endpoint: String,
    pub call_timeout: Duration,
    /// The bytes API may put (`staging_bytes_max > 0`; see `store::bytes_puts`).
    pub put_buffer: bool,
    /// The process that opened the session (a forked child must not use it).
    pid: u32,
}

/// Ports tried before giving up on a range.
const PORT_TRIES: usize = 32;

/// How long a dropped session's node may take to leave the master.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long `close` waits for other threads' calls in flight to let go of the session.
const CLOSE_WAIT_CALLS: Duration = Duration::from_secs(2);

impl Session {
    pub async fn open(opts: SessionOptions) -> Result<Session, Failure> {
        let (engine, node) = start_engine(&opts).await?;
        let ccfg = ClientConfig {
            master: opts.master.clone(),
            rpc_timeout_ms: opts.rpc_timeout_ms,
            staging_bytes_max: opts.staging_bytes_max,
            staging_cached_bytes_max: opts.staging_bytes_max.min(256 << 20),
            tenant: opts.tenant.clone(),
            ..ClientConfig::default()
        };
        // A node in this process: the client records its puts' commits there itself.
        let client = match &node {
            Some(n) => n.client(ccfg).await,
            None => Client::connect_with_engine(ccfg, engine.clone()).await,
        };
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                if let Some(n) = node {
                    n.shutdown().await;
                }
                return Err(e.into());
            }
        };
        if let Some(n) = &node {
            let wait = Duration::from_millis(opts.register_timeout_ms);
            if let Err(e) = n.wait_registered(wait).await {
                client.close().await;
                if let Some(n) = node {
                    n.shutdown().await;
                }
                return Err(e.into());
            }
        }
        Ok(Session {
            client,
            node,
            endpoint: engine.name().to_string(),
            call_timeout: Duration::from_millis(opts.call_timeout_ms),
            put_buffer: opts.staging_bytes_max > 0,
            pid: std::process::id(),
        })
    }

    pub fn has_segment(&self) -> bool {
        self.node.is_some()
    }

    /// Whether this session was opened by another process (inherited across `fork()`).
    pub fn is_inherited(&self) -> bool {
        self.pid != std::process::id()
    }

    /// Leaves the cluster: the node's objects are gone from the pool afterwards.
    pub async fn close(mut self) {
        if self.is_inherited() {
            std::mem::forget(self.node.take());
            return;
        }
        self.client.close().await;
        if let Some(n) = self.node.take() {
            n.shutdown().await;
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let Some(node) = self.node.take() else { return };
        if self.is_inherited() {
            // The parent's node: its tasks and connection live in the parent.
            std::mem::forget(node);
            return;
        }
        let Ok(rt) = crate::runtime::runtime() else { return };
        let client = self.client.clone();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        rt.spawn(async move {
            let leave = async {
                client.close().await;
                node.shutdown().await;
            };
            if tokio::time::timeout(LEAVE_TIMEOUT, leave).await.is_err() {
                tracing::warn!("a dropped session's node did not leave the master in time");
            }
            let _ = done_tx.send(());
        });
        // A thread inside the runtime (a future held the last reference) must not block on it.
        if tokio::runtime::Handle::try_current().is_err() {
            let mut wait = Some(move || {
                let _ = done_rx.recv_timeout(LEAVE_TIMEOUT + Duration::from_millis(500));
            });
            // A Python thread that drops the last reference (a call that outlived a `close` on
            // another thread) holds the GIL: other threads run while the node leaves.
            // SAFETY: PyGILState_Check only reads this thread's state; callable at any time.
            if unsafe { pyo3::ffi::PyGILState_Check() } == 1 {
                let _ = pyo3::Python::try_attach(|py| {
                    py.detach(|| wait.take().map(|w| w()));
                });
            }
            if let Some(w) = wait {
                w();
            }
        }
    }
}

/// Closes a session others may still hold (calls in flight on other threads), within `limit`:
/// waits briefly for them to let go, then closes it; if they do not, closes the client and
/// leaves the node to the last holder's drop. Past `limit` whatever is still open is dropped.
pub async fn close_shared(s: Arc<Session>, limit: Duration) {
    if s.is_inherited() {
        // Never drop it here either: dropping the last reference would run `Drop` (which
        // forgets the node) and the client's teardown, which is the parent's business.
        std::mem::forget(s);
        return;
    }
    let closing = async move {
        let waited = tokio::time::Instant::now();
        let mut s = s;
        loop {
            match Arc::try_unwrap(s) {
                Ok(owned) => return owned.close().await,
                Err(shared) => s = shared,
            }
            if waited.elapsed() >= CLOSE_WAIT_CALLS.min(limit) {
                return s.client.close().await;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(limit, closing).await.is_err() {
        tracing::warn!(limit_ms = limit.as_millis() as u64, "close did not finish in time");
    }
}

/// Starts the engine (inside an embedded node when there is a segment), drawing ports from the
/// range until one binds.
async fn start_engine(opts: &SessionOptions) -> Result<(Engine, Option<Node>), Failure> {
    if opts.hbm_bytes > 0 && opts.segment_bytes == 0 {
        return Err(Failure::invalid(
            "an HBM segment is contributed beside a DRAM one: set global_segment_size too",
        ));
    }
    let (host, fixed_port) = split_host(opts.local_hostname.as_deref())?;
    let ports: Vec<u16> = match (fixed_port, opts.port_range) {
        (Some(p), _) => vec![p],
        (None, Some((lo, hi))) if lo <= hi => {
            let mut rng = rand::rng();
            (0..PORT_TRIES).map(|_| rng.random_range(lo..=hi)).collect()
        }
        _ => vec![0],
    };
    let secret = kvfs_transfer::ClusterSecret::from_env().map_err(Failure::invalid)?;
    let mut last = Failure::internal("no port to try");
    for port in ports {
        let listen = resolve(&host, port)?;
        let mut ecfg = EngineConfig { listen, cluster_secret: secret, ..EngineConfig::default() };
        if opts.local_hostname.is_some() && port != 0 {
            ecfg.name = Some(format!("{host}:{port}"));
        }
        if opts.tcp_only {
            ecfg.transports = Transports::tcp_only();
        }
        tune_from_env(&mut ecfg);
        let started = if opts.segment_bytes > 0 {
            let mut ncfg = NodeConfig {
                master: opts.master.clone(),
                engine: ecfg,
                dram_bytes: opts.segment_bytes,
                populate: opts.populate,
                rpc_timeout_ms: opts.rpc_timeout_ms,
                ..NodeConfig::default()
            };
            ncfg.tiers.hbm_bytes = opts.hbm_bytes;
            Node::start(ncfg).await.map(|n| (n.engine().clone(), Some(n))).map_err(Failure::from)
        } else {
            Engine::start(ecfg)
                .await
                .map(|e| (e, None))
                .map_err(|e| Failure::internal(format!("starting the transfer engine: {e}")))
        };
        match started {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Engine knobs a deployment may set without code: `KVFS_TCP_CONNS_PER_PEER`,
/// `KVFS_TCP_SLICE_BYTES`, `KVFS_OP_TIMEOUT_MS` (invalid values are ignored with a warning).
pub(crate) fn tune_from_env(cfg: &mut EngineConfig) {
    fn var(name: &str) -> Option<u64> {
        let v = std::env::var(name).ok()?;
        match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                tracing::warn!(name, value = %v, "ignoring: not a positive integer");
                None
            }
        }
    }
    if let Some(n) = var("KVFS_TCP_CONNS_PER_PEER") {
        cfg.tcp_conns_per_peer = n.min(64) as usize;
    }
    if let Some(n) = var("KVFS_TCP_SLICE_BYTES") {
        cfg.slice_bytes = n;
    }
    if let Some(n) = var("KVFS_OP_TIMEOUT_MS") {
        cfg.op_timeout_ms = n;
    }
}

/// `host` or `host:port` (bracketed IPv6 allowed); `None` is 127.0.0.1.
fn split_host(s: Option<&str>) -> Result<(String, Option<u16>), Failure> {
    let Some(s) = s.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(("127.0.0.1".into(), None));
    };
    if let Some((h, p)) = s.rsplit_once(':')
        && !h.is_empty()
        && (!h.contains(':') || h.starts_with('['))
    {
        let port = p
            .parse::<u16>()
            .map_err(|_| Failure::invalid(format!("local_hostname {s:?}: bad port {p:?}")))?;
        return Ok((h.to_string(), Some(port)));
    }
    Ok((s.to_string(), None))
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, Failure> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    (bare, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| {
            a.find(|a| a.is_ipv4()).or_else(|| (bare, port).to_socket_addrs().ok()?.next())
        })
        .ok_or_else(|| Failure::invalid(format!("local_hostname {host:?} does not resolve")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_split() {
        assert_eq!(split_host(None).unwrap(), ("127.0.0.1".into(), None));
        assert_eq!(split_host(Some("localhost")).unwrap(), ("localhost".into(), None));
        assert_eq!(split_host(Some("localhost:12345")).unwrap(), ("localhost".into(), Some(12345)));
        assert_eq!(split_host(Some("[::1]:80")).unwrap(), ("[::1]".into(), Some(80)));
        assert!(split_host(Some("localhost:x")).is_err());
        assert_eq!(resolve("localhost", 5).unwrap().port(), 5);
    }
}
