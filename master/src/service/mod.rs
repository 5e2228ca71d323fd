//! The master as a network service: the sans-IO [`Directory`] behind an RPC endpoint, a timer,
//! node connections and an admin HTTP endpoint.
//!
//! Mechanism. Clients and nodes connect over [`kvfs_rpc`]; a node's connection is also how the
//! master calls it (commit and drop records). Every request takes the directory lock once,
//! computes its answer and the node effects, releases the lock, then delivers the effects:
//! `Commit` records are awaited before a `PutEnd` is answered (so what a client was told is
//! complete is what the nodes will re-report after a master restart; a writer whose replica
//! lies in a node of its own process records that commit there itself before its `PutEnd`,
//! which names the node, and that node gets no record), `Drop` records are queued
//! per node and sent in one call every few milliseconds, ahead of any other record or call to
//! that node so that the node sees them in order (a lost drop only leaves a stale entry that
//! the node's next registration resolves), except those of objects under a live read lease: a reader may read a location
//! it cached through the node (a guarded read the node checks against its index), so those
//! are delivered before the call that removed the name is answered. A timer revokes expired puts, expires silent nodes and runs eviction passes.
//!
//! Recovery. Nodes are the source of truth for the bytes they hold: after a restart the
//! directory is rebuilt from their registrations. A client may still be writing into a range
//! granted by the previous master; so when a node reconnects with objects during the first
//! `recovery_grace_ms` after start, new puts are refused with `Recovering` until that grace has
//! passed (gets are served throughout). A fresh cluster never waits.
//!
//! Tiers (see `tiers`): eager puts are written to the object store by a node before they
//! complete; gets of objects without a memory replica load one into DRAM first; nodes report
//! their demotions, write-backs and drops; with an object store configured the master adopts
//! everything it finds there at start, so a master and every node restarted empty still serve
//! persisted objects.
//!
//! KV events (see `kv_events`): with `kv_events` configured, the directory journals which
//! objects enter and leave the pool (and on which medium) and a publisher sends them over
//! ZeroMQ as the reference store's master does, with a replay endpoint, for the conductor.
//!
//! HA (see `ha`): with `leadership` set, the service is its cluster's leader for one term. It
//! refuses every request, and sends nodes no record, once the guard says the lease may have
//! lapsed in etcd, so a deposed leader (stopped, cut off) cannot act after a standby could
//! have taken over.
//!
//! Cluster secret: with `rpc.secret` set, every connection proves it before its first
//! request (`kvfs_rpc`), the standby's answers included.
//!
//! Not handled here: tenants.

mod convert;
pub mod ha;
mod http;
mod jobs;
mod kv_events;
mod metadata_http;
mod metrics;
mod mirror;
mod tenants;
mod tiers;

pub use kv_events::{KvEventsConfig, encode_batch as encode_kv_event_batch, key_hash};
pub use metadata_http::MetadataHttpConfig;
pub use mirror::MirrorConfig;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvfs_proto::store::{
    self as w, CommitItem, DropItem, ErrorCode, MasterRequest, MasterResponse, NodeRequest,
    NodeResponse, RenameRecord, WireError,
};
use kvfs_rpc::{RpcConn, RpcOptions, handler_fn};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::{Config, Directory, NodeEffect, NodeId, PutEnd, PutStart, SegmentRef, Stats};
use metrics::{Metrics, Op};

/// Configuration of a master service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub listen: SocketAddr,
    /// Admin HTTP (`/metrics`, `/health`); `None` disables it.
    pub admin_listen: Option<SocketAddr>,
    /// The reference's embedded HTTP metadata server (`/metadata?key=K`); `None` disables it.
    pub metadata_http: Option<MetadataHttpConfig>,
    pub directory: Config,
    /// Period of the timer that expires puts and nodes and runs eviction.
    pub tick_ms: u64,
    /// Heartbeat period the master asks nodes to keep (node TTL is in `directory`).
    pub heartbeat_ms: u64,
    /// How long after start puts wait when nodes come back with objects (see module notes).
    pub recovery_grace_ms: u64,
    /// A commit or drop call to a node fails after this long.
    pub node_call_timeout_ms: u64,
    pub rpc: RpcOptions,
    /// The object store persisted objects live in (the same one the nodes write to); scanned
    /// at start to adopt what it holds. `None`: no persistence tier.
    pub object_store: Option<kvfs_tiers::ObjectStoreConfig>,
    /// An eager put's write to the object store (by a node) fails after this long.
    pub persist_timeout_ms: u64,
    /// A load (a node copying an object into DRAM for a get) fails after this long.
    pub load_timeout_ms: u64,
    /// Keys per node whose reads the master remembers between two heartbeats (the nodes'
    /// access signal); reads of further keys are dropped and counted.
    pub access_report_keys_max: usize,
    /// Persistence by namespace: a put of a key under a prefix gets at least that prefix's
    /// persistence (the longest matching prefix; none < lazy < eager).
    pub persistence_defaults: Vec<(String, w::Persistence)>,
    /// Publish the pool's KV events over ZeroMQ (see `kv_events`); `None` disables them.
    pub kv_events: Option<KvEventsConfig>,
    /// The leadership this service runs under (HA, see `ha`); `None`: the only master.
    pub leadership: Option<kvfs_ha::LeaseGuard>,
    /// Tenants' quotas at start (see `tenants`); the admin API changes them at run time.
    pub tenant_quotas: Vec<(String, crate::Quota)>,
    /// A leader's grant mirror to its standbys (HA, see `mirror`); `None`: no standby learns
    /// the grants, and a takeover waits out the recovery grace.
    pub mirror: Option<MirrorConfig>,
    /// A takeover with a complete mirror of the previous leader: the ranges it had granted.
    /// They are reserved until their deadlines, objects adopted within `lease_ttl_ms` are
    /// leased until then, and puts do not wait out `recovery_grace_ms`.
    pub inherited: Option<Vec<crate::GrantedRange>>,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            admin_listen: None,
            metadata_http: None,
            directory: Config::default(),
            tick_ms: 100,
            heartbeat_ms: 1_000,
            recovery_grace_ms: 10_000,
            node_call_timeout_ms: 2_000,
            rpc: RpcOptions::default(),
            object_store: None,
            persist_timeout_ms: 60_000,
            load_timeout_ms: 30_000,
            access_report_keys_max: 4096,
            persistence_defaults: Vec::new(),
            kv_events: None,
            leadership: None,
            tenant_quotas: Vec::new(),
            mirror: None,
            inherited: None,
        }
    }
}

/// Wall-clock milliseconds since the Unix epoch (the directory's `now_ms`).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub(crate) struct State {
    cfg: ServiceConfig,
    name: String,
    dir: Mutex<Directory>,
    nodes: Mutex<HashMap<u64, RpcConn>>,
    metrics: Metrics,
    started_ms: u64,
    recovering_until_ms: AtomicU64,
    tiers: tiers::TierState,
    /// Drops no reader can be waiting for, per node, sent in batches (see `deliver`).
    queued_drops: Mutex<HashMap<u64, Vec<DropItem>>>,
    /// Held by whoever sends a node its records, so they reach it in the order they were
    /// made: queued drops first, then the records of the call that took them.
    record_locks: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>,
    /// The pool's KV event publisher, when enabled.
    kv_events: Option<Arc<kv_events::Publisher>>,
    /// Standbys that mirror this leader's grants (see `mirror`).
    mirrors: mirror::Mirrors,
    /// Held by a node's registration: one at a time.
    registering: tokio::sync::Mutex<()>,
    /// Offload and restore jobs (see `jobs`).
    jobs: jobs::Jobs,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Directory> {
        self.dir.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why this service may not act (a lapsed leadership), if so.
    fn fenced(&self) -> Option<WireError> {
        let g = self.cfg.leadership.as_ref()?;
        (!g.is_valid()).then(|| {
            WireError::new(
                ErrorCode::NotLeader,
                format!(
                    "{} no longer leads its cluster (term {}: its lease lapsed); find the leader through etcd",
                    self.name,
                    g.term()
                ),
            )
        })
    }

    fn term(&self) -> u64 {
        self.cfg.leadership.as_ref().map_or(0, |g| g.term())
    }

    fn recovering(&self, now: u64) -> bool {
        now < self.recovering_until_ms.load(Ordering::Acquire)
    }

    pub(crate) fn stats(&self) -> w::MasterStats {
        let s = self.lock().stats();
        let mut stats = wire_stats(&s, self.recovering(now_ms()));
        stats.scanning_object_store = self.tiers.scanning.load(Ordering::Acquire);
        stats
    }

    pub(crate) fn render_metrics(&self) -> String {
        let s = self.lock().stats();
        let mut o = self.metrics.render(&s, self.recovering(now_ms()));
        tiers::render(self, &mut o);
        kv_events::render(self, &mut o);
        tenants::render(self, &mut o);
        mirror::render(self, &mut o);
        jobs::render(self, &mut o);
        o
    }

    pub(crate) fn segment_names(&self) -> Vec<String> {
        let dir = self.lock();
        dir.node_ids().filter_map(|n| dir.node_endpoint(n).map(|(_, e)| e.to_string())).collect()
    }

    pub(crate) fn describe_key(&self, key: &str) -> Option<serde_json::Value> {
        let dir = self.lock();
        let v = dir.stat(key).ok()?;
        let v = convert::view(&dir, &v);
        let replicas: Vec<_> = v
            .replicas
            .iter()
            .map(|r| serde_json::json!({"tier": format!("{:?}", r.tier), "endpoint": r.endpoint, "addr": r.addr, "len": r.len}))
            .collect();
        Some(serde_json::json!({
            "key": key, "size": v.size, "version": v.version, "replicas": replicas,
            "persistence": format!("{:?}", v.persistence), "pin": format!("{:?}", v.pin),
            "lease_end_ms": v.lease_end_ms,
            "checksum": v.checksum.map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>()),
        }))
    }
}

fn wire_stats(s: &Stats, recovering: bool) -> w::MasterStats {
    let tiers = crate::Tier::ALL
        .iter()
        .map(|&t| {
            let ts = &s.tiers[t.index()];
            w::TierStats {
                tier: convert::tier(t),
                capacity_bytes: ts.capacity_bytes,
                used_bytes: ts.used_bytes,
                replicas: ts.replicas,
            }
        })
        .collect();
    w::MasterStats {
        objects: s.objects,
        pending: s.pending_puts,
        nodes: s.nodes,
        tiers,
        metadata_bytes: s.metadata_bytes,
        evicted_replicas: s.evicted_replicas,
        recovering,
        scanning_object_store: false,
    }
}

/// A running master. Dropping it stops every task.
pub struct MasterService {
    state: Arc<State>,
    rpc_addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    metadata_addr: Option<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for MasterService {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.state.jobs.abort_all();
        self.state.mirrors.close_all();
        for conn in self.state.nodes.lock().unwrap_or_else(|e| e.into_inner()).values() {
            conn.close();
        }
    }
}

impl MasterService {
    /// Binds the RPC and admin listeners and starts serving on the current runtime.
    pub async fn start(cfg: ServiceConfig) -> std::io::Result<MasterService> {
        let listener = TcpListener::bind(cfg.listen).await?;
        MasterService::start_on(cfg, listener).await
    }

    /// Starts serving RPC on `listener` (bound already: a standby's, see `ha`), binding the
    /// admin listeners from `cfg`.
    pub async fn start_on(
        cfg: ServiceConfig,
        listener: TcpListener,
    ) -> std::io::Result<MasterService> {
        let mut dir = Directory::new(cfg.directory.clone())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        if let Some(k) = &cfg.kv_events {
            dir.enable_pool_events(k.queue_max);
        }
        if let Some(grants) = &cfg.inherited {
            tracing::info!(
                grants = grants.len(),
                "taking over with the previous leader's grants: no recovery grace"
            );
            dir.inherit(grants.clone(), now_ms() + cfg.directory.lease_ttl_ms);
        }
        for (tenant, quota) in &cfg.tenant_quotas {
            dir.set_quota(tenant, *quota).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
            })?;
        }
        let kv_events = cfg.kv_events.clone().map(|k| Arc::new(kv_events::Publisher::new(k)));
        let rpc_addr = listener.local_addr()?;
        let admin = match cfg.admin_listen {
            Some(a) => Some(TcpListener::bind(a).await?),
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
        let metadata = match &cfg.metadata_http {
            Some(m) => Some((TcpListener::bind(m.listen).await?, m.clone())),
            None => None,
        };
        let metadata_addr = metadata.as_ref().map(|(l, _)| l.local_addr()).transpose()?;
        let object_store = match &cfg.object_store {
            Some(c) => {
                Some(Arc::new(kvfs_tiers::ObjectStoreMedium::open(c.clone()).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
                })?))
            }
            None => None,
        };
        let state = Arc::new(State {
            name: format!("kvfs-master@{rpc_addr}"),
            cfg,
            dir: Mutex::new(dir),
            nodes: Mutex::new(HashMap::new()),
            metrics: Metrics::default(),
            started_ms: now_ms(),
            recovering_until_ms: AtomicU64::new(0),
            tiers: tiers::TierState::new(object_store),
            queued_drops: Mutex::new(HashMap::new()),
            record_locks: Mutex::new(HashMap::new()),
            kv_events: kv_events.clone(),
            mirrors: mirror::Mirrors::default(),
            registering: tokio::sync::Mutex::new(()),
            jobs: jobs::Jobs::default(),
        });
        let mut tasks = vec![tokio::spawn(accept_loop(listener, state.clone()))];
        tasks.push(tokio::spawn(tiers::scan(state.clone())));
        tasks.push(tokio::spawn(jobs::resume_all(state.clone())));
        tasks.push(tokio::spawn(timer(state.clone())));
        tasks.push(tokio::spawn(flush_drops(state.clone())));
        if let Some(p) = kv_events {
            tasks.push(tokio::spawn(kv_events::pump(state.clone(), p.clone())));
            tasks.push(tokio::spawn(kv_events::supervise("pub", p.clone(), kv_events::publish)));
            tasks.push(tokio::spawn(kv_events::supervise("replay", p, kv_events::serve_replay)));
        }
        if let Some(l) = admin {
            tasks.push(tokio::spawn(http::serve(l, state.clone())));
        }
        if let Some((l, m)) = metadata {
            tasks.push(tokio::spawn(metadata_http::serve(l, m)));
        }
        let term = state.term();
        tracing::info!(rpc = %rpc_addr, admin = ?admin_addr, metadata = ?metadata_addr, term, "master started");
        Ok(MasterService { state, rpc_addr, admin_addr, metadata_addr, tasks })
    }

    /// Where the embedded HTTP metadata server listens, when enabled.
    pub fn metadata_addr(&self) -> Option<SocketAddr> {
        self.metadata_addr
    }

    pub fn rpc_addr(&self) -> SocketAddr {
        self.rpc_addr
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    pub fn stats(&self) -> w::MasterStats {
        self.state.stats()
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tracing::debug!(%peer, "connection");
        let st = state.clone();
        let handler = handler_fn(move |conn: RpcConn, req: MasterRequest| {
            let st = st.clone();
            async move { handle(st, conn, req).await }
        });
        RpcConn::accepted(stream, handler, state.cfg.rpc.clone());
    }
}

async fn timer(state: Arc<State>) {
    let mut every = tokio::time::interval(Duration::from_millis(state.cfg.tick_ms.max(10)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let now = now_ms();
        let mut fx = Vec::new();
        let (tick, loss) = {
            let mut dir = state.lock();
            let tick = dir.tick(now, &mut fx);
            let loss = dir.expire(now);
            dir.evict(now, &mut fx);
            (tick, loss)
        };
        let m = &state.metrics;
        m.expired_puts.fetch_add(tick.expired_puts, Ordering::Relaxed);
        if !loss.nodes.is_empty() {
            m.expired_nodes.fetch_add(loss.nodes.len() as u64, Ordering::Relaxed);
            m.lost_objects.fetch_add(loss.lost_keys.len() as u64, Ordering::Relaxed);
            tracing::warn!(nodes = ?loss.nodes, lost = loss.lost_keys.len(), "nodes expired");
            state.tiers.forget_nodes(&loss.nodes);
            let mut nodes = state.nodes.lock().unwrap_or_else(|e| e.into_inner());
            for n in &loss.nodes {
                if let Some(c) = nodes.remove(&n.0) {
                    c.close();
                }
            }
        }
        deliver(&state, fx, false).await;
        tiers::delete_unpersisted(&state).await;
        mirror::flush(&state).await;
    }
}

fn op_of(req: &MasterRequest) -> (Op, usize) {
    match req {
        MasterRequest::Hello { .. } => (Op::Hello, 0),
        MasterRequest::PutStart { items, .. } => (Op::PutStart, items.len()),
        MasterRequest::PutEnd(v) => (Op::PutEnd, v.len()),
        MasterRequest::PutRevoke(v) => (Op::PutRevoke, v.len()),
        MasterRequest::Get(v) => (Op::Get, v.len()),
        MasterRequest::Exists(v) => (Op::Exists, v.len()),
        MasterRequest::Stat(v) => (Op::Stat, v.len()),
        MasterRequest::Remove { keys, .. } => (Op::Remove, keys.len()),
        MasterRequest::RemoveRegex { .. } => (Op::RemoveRegex, 0),
        MasterRequest::RemoveAll { .. } => (Op::RemoveAll, 0),
        MasterRequest::List { .. } => (Op::List, 0),
        MasterRequest::ListDir { .. } => (Op::ListDir, 0),
        MasterRequest::Stats => (Op::Stats, 0),
        MasterRequest::RegisterNode(r) => (Op::RegisterNode, r.held.len()),
        MasterRequest::Heartbeat { .. } => (Op::Heartbeat, 0),
        MasterRequest::UnregisterNode { .. } => (Op::UnregisterNode, 0),
        MasterRequest::ReportReplicas { items, .. } => (Op::ReportReplicas, items.len()),
        MasterRequest::Promote { keys, .. } => (Op::Promote, keys.len()),
        MasterRequest::Move { items, .. } => (Op::Move, items.len()),
        MasterRequest::ClearReplicas { keys, .. } => (Op::Remove, keys.len()),
        MasterRequest::Rename(v) => (Op::Rename, v.len()),
        MasterRequest::Unlink(v) => (Op::Remove, v.len()),
        MasterRequest::Mirror { .. } => (Op::Hello, 0),
        MasterRequest::JobStart(_)
        | MasterRequest::JobGet(_)
        | MasterRequest::JobCancel(_)
        | MasterRequest::JobList => (Op::Job, 0),
    }
}

async fn handle(state: Arc<State>, conn: RpcConn, req: MasterRequest) -> MasterResponse {
    let started = Instant::now();
    let (op, items) = op_of(&req);
    let resp = match state.fenced() {
        Some(e) => MasterResponse::Refused(e),
        None => dispatch(&state, &conn, req).await,
    };
    count_errors(&state.metrics, &resp);
    state.metrics.request(op, items, started.elapsed());
    resp
}

fn count_errors(m: &Metrics, resp: &MasterResponse) {
    fn each<T>(m: &Metrics, v: &[w::ItemResult<T>]) {
        for e in v.iter().filter_map(|r| r.as_ref().err()) {
            m.item_error(e.code);
        }
    }
    match resp {
        MasterResponse::PutStart(v) => each(m, v),
        MasterResponse::PutEnd(v) | MasterResponse::PutRevoke(v) | MasterResponse::Remove(v) => {
            each(m, v)
        }
        MasterResponse::Get(v) | MasterResponse::Stat(v) => each(m, v),
        MasterResponse::Exists(v) => each(m, v),
        MasterResponse::ReportReplicas(v) => each(m, v),
        MasterResponse::Promote(v) | MasterResponse::Move(v) => each(m, v),
        MasterResponse::ClearReplicas(v) => each(m, v),
        MasterResponse::Refused(e) => m.item_error(e.code),
        _ => {}
    }
}

fn results<T, U>(v: Vec<crate::Result<T>>, f: impl Fn(T) -> U) -> Vec<w::ItemResult<U>> {
    v.into_iter().map(|r| r.map(&f).map_err(|e| convert::error(&e))).collect()
}

async fn dispatch(state: &Arc<State>, conn: &RpcConn, req: MasterRequest) -> MasterResponse {
    let now = now_ms();
    match req {
        MasterRequest::Hello { version, .. } if version != w::STORE_PROTOCOL_VERSION => {
            MasterResponse::Refused(WireError::new(
                ErrorCode::Version,
                format!("store protocol {version} is not {}", w::STORE_PROTOCOL_VERSION),
            ))
        }
        MasterRequest::Hello { .. } => MasterResponse::Hello {
            version: w::STORE_PROTOCOL_VERSION,
            master: state.name.clone(),
            term: state.term(),
        },
        MasterRequest::PutStart { client_host, items } => {
            put_start(state, client_host, items, now).await
        }
        MasterRequest::PutEnd(items) => put_end(state, items, now).await,
        MasterRequest::PutRevoke(keys) => {
            let mut fx = Vec::new();
            let r = state.lock().put_revoke_batch(&keys, &mut fx);
            let done = keys.iter().zip(&r).filter(|(_, r)| r.is_ok());
            mirror::release(state, done.map(|(k, _)| (k.as_str(), u64::MAX)));
            deliver(state, fx, false).await;
            MasterResponse::PutRevoke(results(r, |()| ()))
        }
        MasterRequest::Get(keys) => tiers::get(state, keys, now).await,
        MasterRequest::Stat(keys) => {
            let dir = &*state.lock();
            let views = dir.stat_batch(&keys);
            MasterResponse::Stat(views.into_iter().map(|r| wire_view(dir, r)).collect())
        }
        MasterRequest::Exists(keys) => {
            MasterResponse::Exists(results(state.lock().exists_batch(&keys, now), |b| b))
        }
        MasterRequest::Remove { keys, force } => {
            let mut fx = Vec::new();
            let r = state.lock().remove_batch(&keys, force, now, &mut fx);
            deliver(state, fx, false).await;
            MasterResponse::Remove(results(r, |()| ()))
        }
        MasterRequest::RemoveRegex { pattern, force } => {
            let mut fx = Vec::new();
            let r = state.lock().remove_regex(&pattern, force, now, &mut fx);
            deliver(state, fx, false).await;
            MasterResponse::RemoveCount(r.map(wire_counts).map_err(|e| convert::error(&e)))
        }
        MasterRequest::RemoveAll { force } => {
            let mut fx = Vec::new();
            let r = state.lock().remove_all(force, now, &mut fx);
            deliver(state, fx, false).await;
            MasterResponse::RemoveCount(Ok(wire_counts(r)))
        }
        MasterRequest::ClearReplicas { keys, endpoint } => {
            let mut fx = Vec::new();
            let r: Vec<crate::Result<bool>> = {
                let dir = &mut *state.lock();
                let node = endpoint.as_deref().map(|ep| {
                    dir.node_ids().find(|&n| dir.node_endpoint(n).is_some_and(|(_, e)| e == ep))
                });
                keys.iter()
                    .map(|k| match node {
                        // An endpoint no node has: nothing of any key lives there.
                        Some(None) => Ok(false),
                        Some(Some(n)) => dir.clear_replicas(k, Some(n), now, &mut fx),
                        None => dir.clear_replicas(k, None, now, &mut fx),
                    })
                    .collect()
            };
            deliver(state, fx, false).await;
            MasterResponse::ClearReplicas(results(r, |b| b))
        }
        MasterRequest::Rename(items) => rename(state, items, now).await,
        MasterRequest::Mirror { standby } => mirror::subscribe(state, conn, standby).await,
        MasterRequest::JobStart(spec) => jobs::start(state, spec).await,
        MasterRequest::JobGet(id) => jobs::get(state, id),
        MasterRequest::JobCancel(id) => jobs::cancel(state, id),
        MasterRequest::JobList => jobs::list(state),
        MasterRequest::Unlink(keys) => {
            let mut fx = Vec::new();
            let r = state.lock().unlink_batch(&keys, now, &mut fx);
            deliver(state, fx, false).await;
            tiers::delete_unpersisted(state).await;
            MasterResponse::Remove(results(r, |()| ()))
        }
        MasterRequest::List { prefix, start_after, limit } => {
            let r = state.lock().list(&prefix, start_after.as_deref(), limit as usize);
            MasterResponse::List(r.map(wire_list).map_err(|e| convert::error(&e)))
        }
        MasterRequest::ListDir { prefix, start_after, limit } => {
            let r = state.lock().list_dir(&prefix, start_after.as_deref(), limit as usize);
            MasterResponse::ListDir(r.map(wire_dir).map_err(|e| convert::error(&e)))
        }
        MasterRequest::Stats => MasterResponse::Stats(state.stats()),
        MasterRequest::RegisterNode(reg) => register(state, conn, reg, now).await,
        MasterRequest::Heartbeat { node, stats } => tiers::heartbeat(state, node, stats, now),
        MasterRequest::ReportReplicas { node, items } => tiers::report(state, node, items, now),
        MasterRequest::Promote { keys, .. } => tiers::promote(state, keys).await,
        MasterRequest::Move { node, items } => tiers::relocate(state, node, items).await,
        MasterRequest::UnregisterNode { node } => {
            state.tiers.forget_nodes(&[NodeId(node)]);
            let r = state.lock().unregister_node(NodeId(node));
            if let Some(c) = state.nodes.lock().unwrap_or_else(|e| e.into_inner()).remove(&node) {
                c.close();
            }
            MasterResponse::Unregistered(r.map(|_| ()).map_err(|e| convert::error(&e)))
        }
    }
}

fn wire_view(dir: &Directory, r: crate::Result<crate::ObjectView>) -> w::ItemResult<w::ObjectView> {
    r.map(|v| convert::view(dir, &v)).map_err(|e| convert::error(&e))
}

fn wire_counts(c: crate::RemoveCounts) -> w::RemoveCounts {
    w::RemoveCounts {
        removed: c.removed,
        skipped_leased: c.skipped_leased,
        skipped_pinned: c.skipped_pinned,
    }
}

fn wire_list(p: crate::ListPage) -> w::ListPage {
    w::ListPage {
        entries: p
            .entries
            .into_iter()
            .map(|e| w::ListEntry { key: e.key.to_string(), size: e.size })
            .collect(),
        next_start_after: p.next_start_after,
    }
}

fn wire_dir(p: crate::DirPage) -> w::DirPage {
    w::DirPage {
        entries: p
            .entries
            .into_iter()
            .map(|e| match e {
                crate::DirEntry::Object { name, size, .. } => w::DirEntry::Object { name, size },
                crate::DirEntry::Dir { name } => w::DirEntry::Dir { name },
            })
            .collect(),
        next_start_after: p.next_start_after,
    }
}

async fn put_start(
    state: &Arc<State>,
    client_host: String,
    items: Vec<w::PutStartItem>,
    now: u64,
) -> MasterResponse {
    if let Some(it) = items.iter().find(|it| !matches!(it.tier, w::Tier::Dram | w::Tier::Hbm)) {
        let e = WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "{:?}: puts go to a memory tier (DRAM or HBM), not {:?}; NVMe and the object \
                 store are reached through the tier manager and persistence",
                it.key, it.tier
            ),
        );
        return MasterResponse::PutStart(items.iter().map(|_| Err(e.clone())).collect());
    }
    if state.recovering(now) {
        let left = state.recovering_until_ms.load(Ordering::Acquire).saturating_sub(now);
        let e = WireError::new(
            ErrorCode::Recovering,
            format!(
                "the master restarted and nodes are reporting their objects; puts resume in {left} ms"
            ),
        );
        return MasterResponse::PutStart(items.iter().map(|_| Err(e.clone())).collect());
    }
    let mut fx = Vec::new();
    let mirrored = state.cfg.mirror.is_some() && state.mirrors.subscribers() > 0;
    let mut mirror = Vec::new();
    let out = {
        let dir = &mut *state.lock();
        // Only batches that name preferred nodes pay for the endpoint map.
        let by_endpoint: HashMap<String, NodeId> =
            if items.iter().any(|it| !it.preferred_endpoints.is_empty()) {
                dir.node_ids()
                    .filter_map(|n| dir.node_endpoint(n).map(|(_, e)| (e.to_string(), n)))
                    .collect()
            } else {
                HashMap::new()
            };
        let reqs: Vec<PutStart> = items
            .into_iter()
            .map(|it| PutStart {
                preferred_segments: it
                    .preferred_endpoints
                    .iter()
                    .filter_map(|e| by_endpoint.get(e))
                    .map(|&node| SegmentRef { node, index: 0 })
                    .collect(),
                size: it.size,
                replicas: it.replicas,
                tier: convert::tier_in(it.tier),
                persistence: convert::persistence_in(tiers::persistence_for(
                    &state.cfg.persistence_defaults,
                    &it.key,
                    it.persistence,
                )),
                key: it.key,
                pin: convert::pin_in(it.pin),
                strategy: convert::strategy_in(it.strategy),
                client_host: Some(client_host.clone()),
                upsert: it.upsert,
            })
            .collect();
        let grants = dir.put_start_batch(&reqs, now, &mut fx);
        if mirrored {
            let ttl = state.cfg.directory.put_timeout_ms;
            for (r, req) in grants.iter().zip(&reqs) {
                let Ok(g) = r else { continue };
                for rep in &g.replicas {
                    if let crate::Location::Node(n) = rep.location {
                        mirror.push(w::MirrorGrant {
                            key: req.key.clone(),
                            version: g.version,
                            node: n.node.0,
                            segment: n.segment,
                            offset: n.offset,
                            len: rep.len,
                            ttl_ms: ttl,
                        });
                    }
                }
            }
        }
        grants
            .into_iter()
            .zip(&reqs)
            .map(|(r, req)| {
                r.map(|g| w::PutGrant {
                    version: g.version,
                    replicas: g.replicas.iter().map(|rep| convert::replica(dir, rep)).collect(),
                    persistence: convert::persistence(req.persistence),
                })
                .map_err(|e| convert::error(&e))
            })
            .collect::<Vec<_>>()
    };
    deliver(state, fx, false).await;
    if !mirror.is_empty() {
        // Every standby knows these ranges before any writer does (see `mirror`); a
        // leader deposed meanwhile answers nothing it granted.
        let refused = match mirror::replicate(state, &mirror).await {
            Err(e) => Some(e),
            Ok(()) => state.fenced(),
        };
        if let Some(e) = refused {
            // The granted keys are the mirrored ones (every grant has a node replica).
            let mut keys: Vec<String> = mirror.into_iter().map(|g| g.key).collect();
            keys.dedup();
            let mut fx = Vec::new();
            let _ = state.lock().put_revoke_batch(&keys, &mut fx);
            deliver(state, fx, false).await;
            return MasterResponse::PutStart(out.iter().map(|_| Err(e.clone())).collect());
        }
    }
    MasterResponse::PutStart(out)
}

async fn put_end(state: &Arc<State>, mut items: Vec<w::PutEndItem>, now: u64) -> MasterResponse {
    // Eager objects reach the object store first; a failure revokes the put.
    let failed = tiers::persist_eager(state, &mut items).await;
    // Replicas the writer committed itself (in its own process's node, or with a noted
    // write) need no record.
    let committed: HashMap<String, Vec<u64>> = items
        .iter()
        .filter(|i| !i.committed_on.is_empty())
        .map(|i| (i.key.clone(), i.committed_on.clone()))
        .collect();
    let ends: Vec<PutEnd> = items
        .into_iter()
        .zip(&failed)
        .filter(|(_, f)| f.is_none())
        .map(|(i, _)| PutEnd { key: i.key, checksum: i.checksum, version: i.version })
        .collect();
    let mut fx = Vec::new();
    let r = state.lock().put_end_batch(&ends, now_ms().max(now), &mut fx);
    let done = ends.iter().zip(&r).filter(|(_, r)| r.is_ok());
    mirror::release(state, done.map(|(e, _)| (e.key.as_str(), e.version.unwrap_or(u64::MAX))));
    if !committed.is_empty() {
        fx.retain(|e| match e {
            // Only objects without persistence: a lazy one's write-back and an eager one's
            // persisted copy start from the master's record.
            NodeEffect::Commit { node, key, persistence: crate::Persistence::None, .. } => {
                !committed.get(&**key).is_some_and(|nodes| nodes.contains(&node.0))
            }
            _ => true,
        });
    }
    // Nodes must have recorded the objects before the writer hears they are complete.
    deliver(state, fx, true).await;
    let mut done = results(r, |()| ()).into_iter();
    let out = failed
        .into_iter()
        .map(|f| match f {
            Some(e) => Err(e),
            None => {
                done.next().unwrap_or_else(|| Err(WireError::new(ErrorCode::Internal, "no result")))
            }
        })
        .collect();
    MasterResponse::PutEnd(out)
}

/// Renames in the directory, then on the nodes (awaited, like commits: a node that answered
/// reports the new name after a master restart), then the object store copies.
async fn rename(state: &Arc<State>, items: Vec<w::RenameItem>, now: u64) -> MasterResponse {
    let mut fx = Vec::new();
    let r: Vec<crate::Result<crate::Renamed>> = {
        let dir = &mut *state.lock();
        let now = now_ms().max(now);
        items
            .iter()
            .map(|i| dir.rename(&i.from, &i.to, convert::rename_mode_in(i.mode), now, &mut fx))
            .collect()
    };
    deliver(state, fx, true).await;
    let mut out = Vec::with_capacity(r.len());
    for (item, r) in items.iter().zip(r) {
        out.push(match r {
            Ok(done) if done.persisted && done.version != done.from_version => {
                tiers::move_persisted(state, &item.from, &item.to, done).await
            }
            Ok(done) => Ok(done.version),
            Err(e) => Err(convert::error(&e)),
        });
    }
    tiers::delete_unpersisted(state).await;
    MasterResponse::Rename(out)
}

async fn register(
    state: &Arc<State>,
    conn: &RpcConn,
    reg: w::NodeRegistration,
    now: u64,
) -> MasterResponse {
    let node = reg.node;
    if reg.reconnect
        && !reg.held.is_empty()
        && state.cfg.inherited.is_none()
        && now < state.started_ms + state.cfg.recovery_grace_ms
    {
        state
            .recovering_until_ms
            .fetch_max(state.started_ms + state.cfg.recovery_grace_ms, Ordering::AcqRel);
    }
    // One registration at a time: each node's objects are adopted in one run, not
    // interleaved with another node's (a chunked node takes puts from its first hold on).
    let _one = state.registering.lock().await;
    let started = Instant::now();
    if !reg.held.is_empty() && !state.lock().knows_node(NodeId(node)) {
        return register_chunked(state, conn, reg, now).await;
    }
    let mut fx = Vec::new();
    // Converted before any lock is taken: half a million held objects take a while.
    let converted = convert::registration(reg);
    let convert_ms = started.elapsed().as_millis() as u64;
    // The directory and the connection map change under one hold of the nodes lock (taken
    // before the directory's, as in `watch_node`), so the close of a previous connection can
    // never mark this registration disconnected.
    let (r, previous, wait_ms) = {
        let mut nodes = state.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let mut dir = state.lock();
        let wait_ms = started.elapsed().as_millis() as u64 - convert_ms;
        let r = dir.register_node(&converted, now, &mut fx);
        drop(dir);
        let previous = if r.is_ok() { nodes.insert(node, conn.clone()) } else { None };
        (r, previous, wait_ms)
    };
    let adopt_ms = started.elapsed().as_millis() as u64 - convert_ms - wait_ms;
    drop(converted);
    let reg = match r {
        Ok(reg) => reg,
        Err(e) => return MasterResponse::Registered(Err(convert::error(&e))),
    };
    if let Some(prev) = previous.filter(|p| !p.is_closed() && p.peer() != conn.peer()) {
        prev.close();
    }
    watch_node(state, node, conn.clone());
    let m = &state.metrics;
    m.recovery_conflicts.fetch_add(reg.conflicts.len() as u64, Ordering::Relaxed);
    m.lost_objects.fetch_add(reg.lost_keys.len() as u64, Ordering::Relaxed);
    tracing::info!(node, endpoint = %conn.peer(), adopted = reg.adopted, conflicts = reg.conflicts.len(),
        reserved = reg.reserved, convert_ms, wait_ms, adopt_ms, ms = started.elapsed().as_millis() as u64,
        "node registered");
    deliver(state, fx, false).await;
    MasterResponse::Registered(Ok(w::RegistrationAck {
        adopted: reg.adopted,
        conflicts: reg.conflicts.len() as u64,
        lost: reg.lost_keys.len() as u64,
        heartbeat_ms: state.cfg.heartbeat_ms,
        node_ttl_ms: state.cfg.directory.node_ttl_ms,
    }))
}

/// Objects adopted per hold of the directory lock in a chunked registration.
const ADOPT_CHUNK: usize = 16_384;

/// Registers a node the directory does not know (after a restart or a takeover): the ranges
/// of everything it holds are reserved first, so it takes new replicas at once, then its
/// objects are adopted a chunk at a time, so puts and gets go on between chunks.
async fn register_chunked(
    state: &Arc<State>,
    conn: &RpcConn,
    reg: w::NodeRegistration,
    now: u64,
) -> MasterResponse {
    let node = reg.node;
    let started = Instant::now();
    let mut converted = convert::registration(reg);
    let held = std::mem::take(&mut converted.held);
    let count = held.len();
    let (held, overlapping, extents) =
        held_extents(held, &converted.segments, state.cfg.directory.segment_align_bytes);
    let begun = {
        let mut nodes = state.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let r = state.lock().register_node_begin(&converted, count, &extents, now);
        if r.is_ok()
            && let Some(prev) = nodes.insert(node, conn.clone())
            && !prev.is_closed()
            && prev.peer() != conn.peer()
        {
            prev.close();
        }
        r
    };
    let reserved = match begun {
        Ok(r) => r,
        Err(e) => return MasterResponse::Registered(Err(convert::error(&e))),
    };
    let placeable_ms = started.elapsed().as_millis() as u64;
    watch_node(state, node, conn.clone());
    let mut out = crate::Registration { reserved, ..Default::default() };
    let mut fx = Vec::new();
    let mut failed = None;
    let chunks = held.chunks(ADOPT_CHUNK).map(|c| (c, true));
    // Objects overlapping another of the node's own are refused (`Overlap`) like any other.
    for (chunk, reserved) in chunks.chain(std::iter::once((&overlapping[..], false))) {
        let r = state.lock().adopt_held(NodeId(node), chunk, reserved, now_ms(), &mut fx, &mut out);
        if let Err(e) = r {
            failed = Some(e);
            break;
        }
        tokio::task::yield_now().await;
    }
    let ended = match failed {
        Some(e) => Err(e),
        None => state.lock().register_node_end(NodeId(node), now_ms()),
    };
    drop(held);
    let m = &state.metrics;
    m.recovery_conflicts.fetch_add(out.conflicts.len() as u64, Ordering::Relaxed);
    deliver(state, fx, false).await;
    if let Err(e) = ended {
        tracing::warn!(node, error = %e, "node registration abandoned");
        return MasterResponse::Registered(Err(convert::error(&e)));
    }
    tracing::info!(node, endpoint = %conn.peer(), adopted = out.adopted, conflicts = out.conflicts.len(),
        reserved = out.reserved, extents = extents.len(), placeable_ms, chunks = count.div_ceil(ADOPT_CHUNK),
        ms = started.elapsed().as_millis() as u64, "node registered");
    MasterResponse::Registered(Ok(w::RegistrationAck {
        adopted: out.adopted,
        conflicts: out.conflicts.len() as u64,
        lost: 0,
        heartbeat_ms: state.cfg.heartbeat_ms,
        node_ttl_ms: state.cfg.directory.node_ttl_ms,
    }))
}

/// Segment index, start, end: an aligned run of a node's segment its objects cover.
type Extent = (u32, u64, u64);

/// A registering node's objects in (segment, offset) order, those whose aligned range overlaps
/// an earlier one's (refused later), and the merged aligned extents (segment index, start,
/// end) the others cover. Objects outside every segment cover nothing (they are refused too).
fn held_extents(
    mut held: Vec<crate::HeldObject>,
    segments: &[crate::SegmentSpec],
    align: u64,
) -> (Vec<crate::HeldObject>, Vec<crate::HeldObject>, Vec<Extent>) {
    held.sort_unstable_by_key(|h| (h.segment, h.offset));
    let mut kept = Vec::with_capacity(held.len());
    let mut overlapping = Vec::new();
    let mut extents: Vec<Extent> = Vec::new();
    for h in held {
        let cap = segments.iter().find(|s| s.index == h.segment).map(|s| s.capacity);
        let end =
            h.offset.checked_add(h.size).filter(|&e| h.size > 0 && cap.is_some_and(|c| e <= c));
        let Some(end) = end else {
            kept.push(h);
            continue;
        };
        let (start, end) = (h.offset & !(align - 1), end.next_multiple_of(align));
        match extents.last_mut() {
            Some((seg, _, last_end)) if *seg == h.segment && start < *last_end => {
                overlapping.push(h);
                continue;
            }
            Some((seg, _, last_end)) if *seg == h.segment && start == *last_end => *last_end = end,
            _ => extents.push((h.segment, start, end)),
        }
        kept.push(h);
    }
    (kept, overlapping, extents)
}

/// Forgets a node's connection when it closes and stops placing on the node at once (it is
/// removed after the disconnect grace unless it reconnects and registers again).
fn watch_node(state: &Arc<State>, node: u64, conn: RpcConn) {
    let state = Arc::downgrade(state);
    tokio::spawn(async move {
        conn.closed().await;
        let Some(state) = state.upgrade() else { return };
        let mut nodes = state.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if nodes.get(&node).is_some_and(|c| c.peer() == conn.peer()) {
            nodes.remove(&node);
            // Still under the nodes lock, so a registration on a new connection cannot slip
            // in between and be marked disconnected.
            state.lock().node_disconnected(NodeId(node), now_ms());
            tracing::info!(node, endpoint = %conn.peer(), "node connection closed; no new replicas there");
        }
    });
}

/// Sends node effects, grouped into one commit and one drop call per node.
/// Drops queued for one node at most before they are sent at once.
const DROPS_QUEUED_MAX: usize = 4096;
/// How often queued drops are sent.
const DROPS_FLUSH_MS: u64 = 5;

impl State {
    fn record_lock(&self, node: u64) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.record_locks.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(node).or_default().clone()
    }

    fn take_queued_drops(&self, node: u64) -> Vec<DropItem> {
        let mut q = self.queued_drops.lock().unwrap_or_else(|e| e.into_inner());
        q.remove(&node).unwrap_or_default()
    }
}

/// Sends the queued drops every few milliseconds, one call per node.
async fn flush_drops(state: Arc<State>) {
    let mut every = tokio::time::interval(Duration::from_millis(DROPS_FLUSH_MS));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let nodes: Vec<u64> = {
            let q = state.queued_drops.lock().unwrap_or_else(|e| e.into_inner());
            q.iter().filter(|(_, d)| !d.is_empty()).map(|(n, _)| *n).collect()
        };
        for node in nodes {
            // An empty delivery to the node: its call sends what is queued, in order.
            let st = state.clone();
            tokio::spawn(async move { send_records(&st, node, Records::default()).await });
        }
        let known: Vec<u64> =
            state.nodes.lock().unwrap_or_else(|e| e.into_inner()).keys().copied().collect();
        let mut q = state.queued_drops.lock().unwrap_or_else(|e| e.into_inner());
        // Drops for nodes that are gone have nobody to go to.
        q.retain(|n, d| !d.is_empty() && known.contains(n));
        drop(q);
        state
            .record_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|n, l| known.contains(n) || Arc::strong_count(l) > 1);
    }
}

/// Sends one node its records, after the drops queued for it, under its record lock.
pub(crate) async fn send_records(st: &State, node: u64, (commits, drops, renames): Records) {
    let timeout = Duration::from_millis(st.cfg.node_call_timeout_ms);
    if let Some(e) = st.fenced() {
        // A deposed leader's records could undo a newer leader's: the node hears none.
        st.metrics.node_call_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(node, error = %e.message, "records not sent");
        return;
    }
    let conn = st.nodes.lock().unwrap_or_else(|e| e.into_inner()).get(&node).cloned();
    let Some(conn) = conn else {
        st.metrics.node_call_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(node, "no connection to node for its commit/drop records");
        return;
    };
    let lock = st.record_lock(node);
    let _order = lock.lock().await;
    let queued = st.take_queued_drops(node);
    // Queued drops first (they are older than these records), then commits and drops: sent
    // back to back on the one connection, in this order, and applied by the node in the order
    // they arrive (its commit and drop handlers finish without waiting, so it answers each
    // before it reads the next), so their round trips overlap. Renames wait on the node's
    // disk, may finish out of order, and so go after the others have been answered.
    let call = |req: NodeRequest| {
        let conn = &conn;
        async move {
            match conn.call::<_, NodeResponse>(&req, timeout).await {
                Ok(NodeResponse::Done) => {}
                Ok(other @ (NodeResponse::Persisted(_) | NodeResponse::Loaded(_))) => {
                    tracing::warn!(node, answer = ?other, "unexpected answer to records");
                }
                Ok(NodeResponse::Refused(e)) => {
                    st.metrics.node_call_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node, error = %e.message, "node refused records");
                }
                Err(e) => {
                    st.metrics.node_call_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node, error = %e, "node call failed");
                }
            }
        }
    };
    let mut in_order = Vec::with_capacity(3);
    if !queued.is_empty() {
        in_order.push(NodeRequest::Drop(queued));
    }
    if !commits.is_empty() {
        in_order.push(NodeRequest::Commit(commits));
    }
    if !drops.is_empty() {
        in_order.push(NodeRequest::Drop(drops));
    }
    futures_util::future::join_all(in_order.into_iter().map(call)).await;
    if !renames.is_empty() {
        call(NodeRequest::Rename(renames)).await;
    }
}

/// The records one node is sent: commits, drops, renames (in that order).
pub(crate) type Records = (Vec<CommitItem>, Vec<DropItem>, Vec<RenameRecord>);

async fn deliver(state: &Arc<State>, fx: Vec<NodeEffect>, wait: bool) {
    if fx.is_empty() {
        return;
    }
    // A reader may still read a leased object through the node from a location it cached
    // (a guarded read): the node must have forgotten the name before the caller is told.
    let now = now_ms();
    let wait = wait
        || fx.iter().any(
            |e| matches!(e, NodeEffect::Drop { readers_until_ms, .. } if *readers_until_ms > now),
        );
    let mut per_node: HashMap<u64, Records> = HashMap::new();
    let queue = !wait;
    for e in fx {
        let slot = per_node.entry(e.node().0).or_default();
        match e {
            NodeEffect::Commit {
                key,
                segment,
                offset,
                size,
                checksum,
                version,
                persistence,
                pin,
                ..
            } => slot.0.push(CommitItem {
                key: key.to_string(),
                segment,
                offset,
                size,
                checksum,
                version,
                persistence: convert::persistence(persistence),
                pin: convert::pin(pin),
            }),
            NodeEffect::Drop { key, segment, offset, len, version, .. } => {
                slot.1.push(DropItem { key: key.to_string(), segment, offset, len, version })
            }
            NodeEffect::Rename { from, to, from_version, version, .. } => {
                slot.2.push(RenameRecord {
                    from: from.to_string(),
                    to: to.to_string(),
                    from_version,
                    version,
                })
            }
        }
    }
    if queue {
        // Drops alone that no reader waits for go out in the next batch to their node: a
        // removal costs the node nothing until then, and the caller no extra work.
        let mut q = state.queued_drops.lock().unwrap_or_else(|e| e.into_inner());
        per_node.retain(|node, (commits, drops, renames)| {
            if !commits.is_empty() || !renames.is_empty() {
                return true;
            }
            let slot = q.entry(*node).or_default();
            slot.append(drops);
            slot.len() >= DROPS_QUEUED_MAX
        });
    }
    let mut calls = Vec::new();
    for (node, records) in per_node {
        let st = state.clone();
        calls.push(async move { send_records(&st, node, records).await });
    }
    if !wait {
        for c in calls {
            tokio::spawn(c);
        }
        return;
    }
    // One node (the common case): its call runs on this task, no spawn and no extra wakeup
    // between the node's answer and the caller's.
    if calls.len() == 1 {
        for c in calls {
            c.await;
        }
        return;
    }
    let mut set = tokio::task::JoinSet::new();
    for c in calls {
        set.spawn(c);
    }
    while set.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::held_extents;
    use crate::{HeldObject, Persistence, Pin, SegmentSpec, Tier};

    fn held(segment: u32, offset: u64, size: u64) -> HeldObject {
        HeldObject {
            key: format!("k{segment}-{offset}"),
            size,
            checksum: None,
            version: 1,
            segment,
            offset,
            tier: Tier::Dram,
            persistence: Persistence::None,
            pin: Pin::None,
            persisted: false,
            renamed_from: None,
        }
    }

    #[test]
    fn held_extents_merge_runs_and_set_overlaps_and_strays_apart() {
        let seg = |index| SegmentSpec { index, tier: Tier::Dram, base_addr: 0, capacity: 1 << 20 };
        let objects = vec![
            held(0, 8192, 100),     // second of a run
            held(0, 0, 5000),       // first of the run: 0..8192 aligned
            held(0, 16384, 4096),   // a gap before it: a new run
            held(0, 8192, 4096),    // overlaps the run's second object
            held(1, 0, 4096),       // another segment
            held(0, 1 << 20, 4096), // outside the segment: no extent, kept (it conflicts)
            held(7, 0, 4096),       // unknown segment: no extent, kept
        ];
        let (kept, overlapping, extents) = held_extents(objects, &[seg(0), seg(1)], 4096);
        assert_eq!(extents, vec![(0, 0, 12288), (0, 16384, 20480), (1, 0, 4096)]);
        assert_eq!(overlapping.len(), 1);
        assert_eq!((overlapping[0].offset, overlapping[0].size), (8192, 4096));
        assert_eq!(kept.len(), 6);
        assert!(
            kept.windows(2).all(|w| (w[0].segment, w[0].offset) <= (w[1].segment, w[1].offset))
        );
    }
}
