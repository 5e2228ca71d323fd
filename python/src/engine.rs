//! `kvfs._native.TransferEngine`: the reference's `mooncake.engine.TransferEngine` on the kvfs
//! Transfer Engine, so prefill and decode processes that move KV blocks between registered
//! buffers with the reference's calls move them through kvfs unchanged.
//!
//! Mechanism. `initialize` starts one kvfs [`Engine`] for the object. Its segment name is what
//! peers pass as `target_hostname`: with `P2PHANDSHAKE`, `host:<rpc port>` (the port drawn from
//! `MC_MIN_RPC_PORT..=MC_MAX_RPC_PORT`, 15000..=17000, as the reference); with a metadata server
//! and a `host:port` name, the engine listens on that port and the name is kept as given, so
//! peers reach it without any metadata service (kvfs engines always handshake peer to peer).
//! Remote addresses are raw virtual addresses in the peer, checked by the peer against what it
//! registered before a byte moves. Managed buffers are sealed memfds, so same-host peers move
//! them by memcpy over shm; memory registered by address is reached over tcp (or rdma).
//!
//! Policy (the reference's return conventions): sync calls return 0 or -1; async calls return
//! a batch id or 0; `transfer_check_status` returns 1 done, 0 pending, -1 failed, -2 timed
//! out; registration returns 0 or a negative TE code (-1 invalid, -3 not registered, -7
//! overlap). Nothing raises for a transfer outcome; the reason is logged (`KVFS_LOG=debug`).
//! Every call releases the GIL and ends within its deadline (`MC_TRANSFER_TIMEOUT` seconds, 30
//! by default, at least 5; each item is also bounded by the engine's own `op_timeout_ms`).
//!
//! Deliberate departures: the byte helpers (`write_bytes_to_buffer`, `read_bytes_from_buffer`)
//! only touch memory registered with this engine (the reference dereferences any address);
//! unknown batch ids answer -1 instead of reading freed memory; at most
//! [`BATCHES_IN_FLIGHT_MAX`] async batches are tracked at once (a submit past it returns 0).
//! Not handled: CUDA/HIP stream calls, EFA warm-up (a no-op returning 0), topology discovery
//! (`get_local_topology` answers `{}`).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_transfer::{
    Buffer, BufferOptions, Engine, EngineConfig, ErrorKind, SegmentHandle, TransferOp,
    TransferRequest, Transports,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rand::Rng;
use tokio::sync::watch;

use crate::errors::Failure;
use crate::runtime;

/// Async batches tracked at once; a submit beyond it is refused (returns 0).
pub const BATCHES_IN_FLIGHT_MAX: usize = 65_536;
/// Ports tried when drawing the rpc port from its range.
const PORT_TRIES: usize = 32;

const OK: i64 = 0;
const FAIL: i64 = -1;
const ERR_ADDRESS_NOT_REGISTERED: i64 = -3;
const ERR_ADDRESS_OVERLAPPED: i64 = -7;
const ERR_METADATA: i64 = -200;

/// The reference's `TransferNotify`: a name and a message delivered after a transfer.
#[pyclass(module = "kvfs._native", name = "TransferNotify", get_all, set_all)]
#[derive(Clone)]
pub struct TransferNotify {
    pub name: String,
    pub msg: String,
}

#[pymethods]
impl TransferNotify {
    #[new]
    #[pyo3(signature = (name = String::new(), msg = String::new()))]
    fn new(name: String, msg: String) -> Self {
        TransferNotify { name, msg }
    }

    fn __repr__(&self) -> String {
        format!("TransferNotify(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// Outcome of an async batch, once known.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Done {
    Ok,
    Failed,
    TimedOut,
}

struct Te {
    engine: Engine,
    rpc_port: u16,
    timeout: Duration,
    /// Managed buffers by address (they stay mapped while listed here).
    managed: Mutex<HashMap<u64, Arc<Buffer>>>,
    batches: Mutex<HashMap<u64, watch::Receiver<Option<Done>>>>,
    next_batch: AtomicU64,
}

/// One item: local address, remote address, length.
type Item = (u64, u64, u64);

impl Te {
    fn limit(&self, items: &[Item]) -> Duration {
        let bytes: u64 = items.iter().map(|i| i.2).sum();
        self.timeout + Duration::from_nanos(bytes)
    }

    /// Opens `target` and runs `items`, then delivers `notify`; `Err` names the first failure.
    async fn run(
        &self,
        target: &str,
        op: TransferOp,
        items: &[Item],
        notify: Option<&TransferNotify>,
    ) -> Result<(), String> {
        let seg = self.open(target).await?;
        let batches = chunks(items).into_iter().map(|(first, chunk)| {
            let reqs: Vec<TransferRequest> = chunk
                .iter()
                .map(|&(local_addr, remote_addr, len)| TransferRequest {
                    op,
                    segment: seg.clone(),
                    local_addr,
                    remote_addr,
                    len,
                })
                .collect();
            async move { (first, self.engine.transfer(reqs).await) }
        });
        for (first, done) in futures_util::future::join_all(batches).await {
            let results = done.map_err(|e| e.to_string())?;
            if let Some((i, e)) =
                results.iter().enumerate().find_map(|(i, r)| Some((i, r.as_ref().err()?)))
            {
                if matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::UnknownSegment) {
                    self.engine.close_segment(target).await;
                }
                return Err(format!("item {}: {e}", first + i));
            }
        }
        if let Some(n) = notify {
            let msg = encode_notify(n);
            self.engine.notify(&seg, &msg).await.map_err(|e| format!("notify: {e}"))?;
        }
        Ok(())
    }

    async fn open(&self, target: &str) -> Result<SegmentHandle, String> {
        self.engine.open_segment(target).await.map_err(|e| format!("open segment {target:?}: {e}"))
    }
}

/// `items` cut as the store client cuts its batches ([`kvfs_client::pipeline_chunks`]: at most
/// 64 items or 8 MiB a run, a larger item alone), each run with the index of its first item, so
/// a call's runs go out as concurrent engine batches and their packs spread over the
/// connections.
fn chunks(items: &[Item]) -> Vec<(usize, &[Item])> {
    kvfs_client::pipeline_chunks(items.iter().map(|it| it.2))
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| (r.start, &items[r]))
        .collect()
}

/// `[u32 LE name length][name][message]`, carried as one engine notification.
fn encode_notify(n: &TransferNotify) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + n.name.len() + n.msg.len());
    out.extend_from_slice(&(n.name.len() as u32).to_le_bytes());
    out.extend_from_slice(n.name.as_bytes());
    out.extend_from_slice(n.msg.as_bytes());
    out
}

fn decode_notify(from: &str, raw: &[u8]) -> TransferNotify {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let split = raw.get(..4).map(|h| u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize);
    match split.filter(|&n| 4 + n <= raw.len()) {
        Some(n) => TransferNotify { name: text(&raw[4..4 + n]), msg: text(&raw[4 + n..]) },
        // Not from a TransferEngine: the sender's segment and the raw message.
        None => TransferNotify { name: from.to_string(), msg: text(raw) },
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "True" | "yes"))
}

/// `host` or `host:port` (bracketed IPv6 allowed).
fn split_host(s: &str) -> (String, Option<u16>) {
    let s = s.trim().trim_start_matches('/');
    if let Some((h, p)) = s.rsplit_once(':')
        && !h.is_empty()
        && (!h.contains(':') || h.starts_with('['))
        && let Ok(port) = p.parse::<u16>()
    {
        return (h.to_string(), Some(port));
    }
    (s.to_string(), None)
}

fn resolve(host: &str, port: u16) -> Option<SocketAddr> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (bare, port).to_socket_addrs().ok()?.collect();
    addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()).copied()
}

/// The reference's `mooncake.engine.TransferEngine` (see the module notes).
#[pyclass(module = "kvfs._native", name = "TransferEngine", subclass, frozen)]
pub struct TransferEngine {
    te: Mutex<Option<Arc<Te>>>,
}

impl TransferEngine {
    fn te(&self) -> Option<Arc<Te>> {
        self.te.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn sync(
        &self,
        py: Python<'_>,
        op: &'static str,
        target: &str,
        dir: TransferOp,
        items: Vec<Item>,
        notify: Option<TransferNotify>,
    ) -> i64 {
        let Some(te) = self.te() else {
            tracing::warn!(op, "TransferEngine is not initialized");
            return FAIL;
        };
        let limit = te.limit(&items);
        let run =
            async { te.run(target, dir, &items, notify.as_ref()).await.map_err(Failure::internal) };
        match runtime::call(py, op, limit, run) {
            Ok(()) => OK,
            Err(f) => {
                tracing::warn!(op, target, error = %f.message, "transfer failed");
                FAIL
            }
        }
    }

    fn submit(&self, op: &'static str, target: &str, dir: TransferOp, items: Vec<Item>) -> u64 {
        let Some(te) = self.te() else {
            tracing::warn!(op, "TransferEngine is not initialized");
            return 0;
        };
        let rt = match runtime::runtime() {
            Ok(rt) => rt,
            Err(f) => {
                tracing::warn!(op, error = %f.message, "no runtime");
                return 0;
            }
        };
        // An unknown or unreachable target fails the submit itself, as the reference's open.
        let open = rt.block_on(async {
            tokio::time::timeout(te.timeout, te.open(target))
                .await
                .map_err(|_| String::from("timed out"))?
        });
        if let Err(e) = open {
            tracing::warn!(op, target, error = %e, "submit refused");
            return 0;
        }
        let (tx, rx) = watch::channel(None);
        let id = {
            let mut batches = te.batches.lock().unwrap_or_else(|e| e.into_inner());
            if batches.len() >= BATCHES_IN_FLIGHT_MAX {
                tracing::warn!(op, max = BATCHES_IN_FLIGHT_MAX, "too many async batches in flight");
                return 0;
            }
            let id = te.next_batch.fetch_add(1, Ordering::Relaxed);
            batches.insert(id, rx);
            id
        };
        let target = target.to_string();
        let limit = te.limit(&items);
        let worker = te.clone();
        rt.spawn(async move {
            let run = worker.run(&target, dir, &items, None);
            let done = match tokio::time::timeout(limit, run).await {
                Ok(Ok(())) => Done::Ok,
                Ok(Err(e)) => {
                    tracing::warn!(op, target, error = %e, "async transfer failed");
                    Done::Failed
                }
                Err(_) => Done::TimedOut,
            };
            let _ = tx.send(Some(done));
        });
        id
    }

    fn take_batch(&self, id: u64) -> Option<watch::Receiver<Option<Done>>> {
        let te = self.te()?;
        te.batches.lock().unwrap_or_else(|e| e.into_inner()).remove(&id)
    }
}

fn items(buffers: Vec<u64>, peers: Vec<u64>, lengths: Vec<u64>) -> Option<Vec<Item>> {
    if buffers.len() != peers.len() || buffers.len() != lengths.len() {
        tracing::warn!("buffers, peer_buffer_addresses and lengths differ in length");
        return None;
    }
    Some(buffers.into_iter().zip(peers).zip(lengths).map(|((b, p), l)| (b, p, l)).collect())
}

fn opcode(op: i64) -> Option<TransferOp> {
    match op {
        0 => Some(TransferOp::Read),
        1 => Some(TransferOp::Write),
        _ => None,
    }
}

#[pymethods]
impl TransferEngine {
    #[new]
    fn new() -> Self {
        TransferEngine { te: Mutex::new(None) }
    }

    /// Starts the engine; 0, or -1 (bad hostname, no free port, already initialized).
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i64 {
        self.initialize_ext(py, local_hostname, metadata_server, protocol, device_name, "")
    }

    /// Same as `initialize`; `metadata_type` is accepted and not needed.
    #[allow(clippy::too_many_arguments)]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i64 {
        let _ = (device_name, metadata_type);
        if protocol == "xgmi" {
            tracing::warn!("protocol xgmi is not supported");
            return FAIL;
        }
        if self.te().is_some() {
            tracing::warn!("TransferEngine is already initialized");
            return FAIL;
        }
        let (host, port) = split_host(local_hostname);
        if host.is_empty() {
            tracing::warn!(local_hostname, "empty local_hostname");
            return FAIL;
        }
        let p2p = metadata_server.trim() == "P2PHANDSHAKE";
        let ports: Vec<u16> = match port {
            Some(p) if !p2p || env_flag("MC_LEGACY_RPC_PORT_BINDING") => vec![p],
            _ => {
                let lo = env_u64("MC_MIN_RPC_PORT").unwrap_or(15_000).clamp(1, 65_535) as u16;
                let hi = env_u64("MC_MAX_RPC_PORT").unwrap_or(17_000).clamp(1, 65_535) as u16;
                let mut rng = rand::rng();
                (0..PORT_TRIES).map(|_| rng.random_range(lo.min(hi)..=hi.max(lo))).collect()
            }
        };
        let tcp_only = env_flag("MC_FORCE_TCP")
            || std::env::var("KVFS_TRANSPORT").is_ok_and(|v| v.trim() == "tcp");
        let timeout_s = env_u64("MC_TRANSFER_TIMEOUT").unwrap_or(30).max(5);
        let keep_name = !p2p && port.is_some();
        let start = async {
            let secret = kvfs_transfer::ClusterSecret::from_env().map_err(Failure::invalid)?;
            let mut last = String::from("no port to try");
            for p in ports {
                let Some(listen) = resolve(&host, p) else {
                    return Err(Failure::invalid(format!("{host:?} does not resolve")));
                };
                let mut cfg =
                    EngineConfig { listen, cluster_secret: secret, ..EngineConfig::default() };
                cfg.name = Some(if keep_name {
                    local_hostname.trim().trim_start_matches('/').to_string()
                } else {
                    format!("{host}:{p}")
                });
                if tcp_only {
                    cfg.transports = Transports::tcp_only();
                }
                crate::session::tune_from_env(&mut cfg);
                match Engine::start(cfg).await {
                    Ok(e) => return Ok((e, p)),
                    Err(e) => last = e.to_string(),
                }
            }
            Err(Failure::internal(format!("starting the transfer engine: {last}")))
        };
        match runtime::call(py, "initialize", Duration::from_secs(30), start) {
            Ok((engine, rpc_port)) => {
                let te = Te {
                    engine,
                    rpc_port,
                    timeout: Duration::from_secs(timeout_s),
                    managed: Mutex::new(HashMap::new()),
                    batches: Mutex::new(HashMap::new()),
                    next_batch: AtomicU64::new(1),
                };
                *self.te.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(te));
                OK
            }
            Err(f) => {
                tracing::warn!(local_hostname, error = %f.message, "initialize failed");
                FAIL
            }
        }
    }

    /// The port peers reach this engine on (0 before `initialize`).
    fn get_rpc_port(&self) -> u16 {
        self.te().map_or(0, |te| te.rpc_port)
    }

    /// This engine's segment name, what peers pass as `target_hostname` (kvfs addition).
    fn get_session_id(&self) -> String {
        self.te().map(|te| te.engine.name().to_string()).unwrap_or_default()
    }

    /// A registered buffer of `length` bytes (shared memory: same-host peers copy it directly);
    /// its address, or 0.
    fn allocate_managed_buffer(&self, length: u64) -> u64 {
        let Some(te) = self.te() else { return 0 };
        let opts = BufferOptions { name: "kvfs-te-managed".into(), ..BufferOptions::default() };
        match usize::try_from(length)
            .map_err(|e| e.to_string())
            .and_then(|len| te.engine.alloc_buffer(len, &opts).map_err(|e| e.to_string()))
        {
            Ok(buf) => {
                let addr = buf.addr();
                te.managed.lock().unwrap_or_else(|e| e.into_inner()).insert(addr, buf);
                addr
            }
            Err(e) => {
                tracing::warn!(length, error = %e, "allocate_managed_buffer failed");
                0
            }
        }
    }

    /// Frees a managed buffer; 0 (as the reference, whatever the address).
    fn free_managed_buffer(&self, buffer_addr: u64, length: u64) -> i64 {
        let _ = length;
        if let Some(te) = self.te() {
            let buf = te.managed.lock().unwrap_or_else(|e| e.into_inner()).remove(&buffer_addr);
            if buf.is_some() {
                let _ = te.engine.unregister(buffer_addr);
            }
        }
        OK
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let items = vec![(buffer, peer_buffer_address, length)];
        self.sync(py, "transfer_sync_write", target_hostname, TransferOp::Write, items, None)
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let items = vec![(buffer, peer_buffer_address, length)];
        self.sync(py, "transfer_sync_read", target_hostname, TransferOp::Read, items, None)
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: i64,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(dir) = self::opcode(opcode) else { return FAIL };
        let items = vec![(buffer, peer_buffer_address, length)];
        self.sync(py, "transfer_sync", target_hostname, dir, items, notify.map(|n| n.clone()))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return FAIL };
        self.sync(py, "batch_transfer_sync_write", target_hostname, TransferOp::Write, items, None)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return FAIL };
        self.sync(py, "batch_transfer_sync_read", target_hostname, TransferOp::Read, items, None)
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: i64,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> i64 {
        let _ = transport_hint;
        let Some(dir) = self::opcode(opcode) else { return FAIL };
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return FAIL };
        self.sync(py, "batch_transfer_sync", target_hostname, dir, items, notify.map(|n| n.clone()))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return 0 };
        py.detach(|| {
            self.submit("batch_transfer_async_write", target_hostname, TransferOp::Write, items)
        })
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return 0 };
        py.detach(|| {
            self.submit("batch_transfer_async_read", target_hostname, TransferOp::Read, items)
        })
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<u64>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: i64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let Some(dir) = self::opcode(opcode) else { return 0 };
        let Some(items) = items(buffers, peer_buffer_addresses, lengths) else { return 0 };
        py.detach(|| self.submit("batch_transfer_async", target_hostname, dir, items))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let items = vec![(buffer, peer_buffer_address, length)];
        py.detach(|| {
            self.submit("transfer_submit_write", target_hostname, TransferOp::Write, items)
        })
    }

    /// Waits for every batch; 0 when all completed, -1 when any failed, timed out or is unknown.
    /// The ids are forgotten either way.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i64 {
        let mut rxs = Vec::with_capacity(batch_ids.len());
        let mut code = OK;
        for id in batch_ids {
            match self.take_batch(id) {
                Some(rx) => rxs.push(rx),
                None => {
                    tracing::warn!(batch = id, "unknown batch id");
                    code = FAIL;
                }
            }
        }
        let Some(te) = self.te() else { return FAIL };
        // Each batch ends by its own deadline; this one only guards against a lost task.
        let limit = te.timeout * 2 + Duration::from_secs(1);
        let wait = async move {
            let mut all = OK;
            for mut rx in rxs {
                let done = rx.wait_for(Option::is_some).await.map(|v| *v);
                if !matches!(done, Ok(Some(Done::Ok))) {
                    all = FAIL;
                }
            }
            Ok(all)
        };
        match runtime::call(py, "get_batch_transfer_status", limit, wait) {
            Ok(c) if code == OK => c,
            _ => FAIL,
        }
    }

    /// 1 completed, 0 pending, -1 failed (or unknown id), -2 timed out; a finished id is
    /// forgotten.
    fn transfer_check_status(&self, batch_id: u64) -> i64 {
        let Some(te) = self.te() else { return FAIL };
        let mut batches = te.batches.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rx) = batches.get(&batch_id) else { return FAIL };
        let state = *rx.borrow();
        match state {
            None => 0,
            Some(done) => {
                batches.remove(&batch_id);
                match done {
                    Done::Ok => 1,
                    Done::Failed => FAIL,
                    Done::TimedOut => -2,
                }
            }
        }
    }

    /// Copies `length` bytes of `src` to `dest_address`, which must lie in memory registered
    /// with this engine; 0, or -1.
    fn write_bytes_to_buffer(&self, dest_address: u64, src: &[u8], length: u64) -> i64 {
        let Some(te) = self.te() else { return FAIL };
        let n = length.min(src.len() as u64);
        if n == 0 {
            return OK;
        }
        if !te.engine.is_registered(dest_address, n) {
            tracing::warn!(dest_address, length, "write_bytes_to_buffer: not registered memory");
            return FAIL;
        }
        // SAFETY: `[dest, dest+n)` lies in a region registered with this engine, which its
        // registrant keeps valid and writable until unregistered; `src` holds at least n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dest_address as *mut u8, n as usize);
        }
        OK
    }

    /// `length` bytes from `source_address` (memory registered with this engine) as bytes.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let te =
            self.te().ok_or_else(|| PyValueError::new_err("TransferEngine is not initialized"))?;
        if length > 0 && !te.engine.is_registered(source_address, length) {
            return Err(PyValueError::new_err(format!(
                "read_bytes_from_buffer: {source_address:#x}+{length} is not registered memory"
            )));
        }
        let n = usize::try_from(length).map_err(|e| PyValueError::new_err(e.to_string()))?;
        PyBytes::new_with(py, n, |out| {
            if n > 0 {
                // SAFETY: the range lies in a region registered with this engine (checked
                // above), valid and readable until unregistered; `out` holds n bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(source_address as *const u8, out.as_mut_ptr(), n)
                };
            }
            Ok(())
        })
    }

    /// Registers memory peers may read and write; 0, -1 (empty or invalid), -7 (overlaps).
    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(&self, buffer_addr: u64, capacity: u64, location: &str) -> i64 {
        let _ = location;
        let Some(te) = self.te() else { return FAIL };
        if buffer_addr == 0 || capacity == 0 {
            return FAIL;
        }
        // SAFETY: the caller vouches for the memory until `unregister_memory`, as with the
        // reference's registration (the same contract as an RDMA memory registration).
        match unsafe { te.engine.register_memory(buffer_addr, capacity, true) } {
            Ok(()) => OK,
            Err(e) => {
                tracing::warn!(buffer_addr, capacity, error = %e, "register_memory failed");
                if e.kind() == ErrorKind::InvalidArgument { ERR_ADDRESS_OVERLAPPED } else { FAIL }
            }
        }
    }

    /// Unregisters memory registered at `buffer_addr`; 0, or -3 when nothing is registered there.
    fn unregister_memory(&self, buffer_addr: u64) -> i64 {
        let Some(te) = self.te() else { return FAIL };
        match te.engine.unregister(buffer_addr) {
            Ok(()) => OK,
            Err(_) => ERR_ADDRESS_NOT_REGISTERED,
        }
    }

    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        buffer_addresses: Vec<u64>,
        capacities: Vec<u64>,
        location: &str,
    ) -> i64 {
        if buffer_addresses.len() != capacities.len() {
            return FAIL;
        }
        for (i, (&a, &c)) in buffer_addresses.iter().zip(&capacities).enumerate() {
            let rc = self.register_memory(a, c, location);
            if rc != OK {
                // All or nothing, as the reference rolls back a partial registration.
                for &done in &buffer_addresses[..i] {
                    self.unregister_memory(done);
                }
                return rc;
            }
        }
        OK
    }

    fn batch_unregister_memory(&self, buffer_addresses: Vec<u64>) -> i64 {
        let mut rc = OK;
        for a in buffer_addresses {
            let r = self.unregister_memory(a);
            if r != OK {
                rc = r;
            }
        }
        rc
    }

    /// The lowest remotely accessible buffer of a segment (a fresh handshake for a peer), or 0.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        let Some(te) = self.te() else { return 0 };
        let name = segment_name.to_string();
        let look = async move {
            if name != te.engine.name() {
                te.engine.close_segment(&name).await;
            }
            let seg = te.open(&name).await.map_err(Failure::internal)?;
            Ok(seg.first_buffer_addr(&te.engine))
        };
        match runtime::call(py, "get_first_buffer_address", Duration::from_secs(10), look) {
            Ok(addr) => addr,
            Err(f) => {
                tracing::warn!(segment_name, error = %f.message, "get_first_buffer_address failed");
                0
            }
        }
    }

    /// Drains the notifications received so far, oldest first.
    fn get_notifies(&self) -> Vec<TransferNotify> {
        let Some(te) = self.te() else { return Vec::new() };
        let mut out = Vec::new();
        while let Some(n) = te.engine.try_recv_notification() {
            out.push(decode_notify(&n.from, &n.msg));
        }
        out
    }

    /// 0 when the peer answers, -200 when it cannot be reached, -1 before `initialize`.
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i64 {
        let Some(te) = self.te() else { return FAIL };
        let name = peer_server_name.to_string();
        let probe = async move {
            let seg = te.open(&name).await.map_err(Failure::internal)?;
            te.engine.ping(&seg).await.map_err(|e| Failure::internal(e.to_string()))
        };
        match runtime::call(py, "send_probe", Duration::from_secs(10), probe) {
            Ok(()) => OK,
            Err(f) => {
                tracing::debug!(peer_server_name, error = %f.message, "probe failed");
                ERR_METADATA
            }
        }
    }

    #[pyo3(signature = (device_name = None))]
    fn get_local_topology(&self, device_name: Option<&str>) -> String {
        let _ = device_name;
        "{}".to_string()
    }

    fn warmup_efa_segment(&self, segment_name: &str) -> i64 {
        let _ = segment_name;
        OK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_round_trip_and_foreign_ones_keep_their_sender() {
        let n = TransferNotify { name: "decode-0".into(), msg: "req-17 done".into() };
        let back = decode_notify("x:1", &encode_notify(&n));
        assert_eq!((back.name.as_str(), back.msg.as_str()), ("decode-0", "req-17 done"));
        let raw = decode_notify("10.0.0.1:15001", b"\x09\0\0\0ab");
        assert_eq!((raw.name.as_str(), raw.msg.as_str()), ("10.0.0.1:15001", "\t\0\0\0ab"));
    }

    #[test]
    fn calls_are_cut_into_bounded_chunks() {
        let items: Vec<Item> = (0..100).map(|i| (i, i, 1 << 20)).collect();
        let c = chunks(&items);
        assert_eq!((c[0].0, c[0].1.len(), c[1].0, c[1].1.len()), (0, 8, 8, 8));
        assert_eq!(c.iter().map(|(_, ch)| ch.len()).sum::<usize>(), 100);
        let big: Vec<Item> = vec![(0, 0, 64 << 20), (1, 1, 1), (2, 2, 64 << 20)];
        assert_eq!(chunks(&big).iter().map(|(f, _)| *f).collect::<Vec<_>>(), [0, 1, 2]);
        let small: Vec<Item> = (0..200).map(|i| (i, i, 16)).collect();
        let lens: Vec<usize> = chunks(&small).iter().map(|(_, ch)| ch.len()).collect();
        assert_eq!(lens, [64, 64, 64, 8]);
        assert!(chunks(&[]).is_empty());
    }

    #[test]
    fn hostnames_split() {
        assert_eq!(split_host("127.0.0.1:12345"), ("127.0.0.1".into(), Some(12345)));
        assert_eq!(split_host("localhost"), ("localhost".into(), None));
        assert_eq!(split_host("[::1]:80"), ("[::1]".into(), Some(80)));
        assert_eq!(split_host("::1"), ("::1".into(), None));
        assert_eq!(split_host("/node-a"), ("node-a".into(), None));
    }
}
