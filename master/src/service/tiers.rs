//! The master's side of the tiers: eager persistence at put end, loads (DRAM copies of objects
//! that only NVMe or the object store hold) for gets and node promotions, nodes' replica
//! reports, the access signal sent back with heartbeats, and the object-store scan that
//! rebuilds persisted objects after a restart.
//!
//! Flows:
//! - **Eager put**: before the directory completes a pending put with `Eager` persistence, the
//!   master asks a node that holds one of its ranges to write the bytes to the object store
//!   (`NodeRequest::Persist`, bounded by `persist_timeout_ms`, then the next range's node). Only
//!   when one answers with the blake3 of what it stored does the put complete, with an
//!   object-store replica; otherwise the put is revoked and the writer gets the error, so a put
//!   acknowledged as eager is in the object store.
//! - **Get of an object without a memory replica**: the Transfer Engine only reads memory, so
//!   the master plans a load (`Directory::begin_load`: the NVMe copy's node, else any node from
//!   the object store), asks the node to fill the DRAM range (`NodeRequest::Load`, verified by
//!   the node), attaches the new DRAM replica and answers the get with it. Loads of one key are
//!   deduplicated. A `Corrupt` answer from an NVMe copy drops that copy (the node deletes it)
//!   and falls back to the object store; from the object store it is the get's error. Both are
//!   counted in `kvfs_master_corrupt_copies_total`. An NVMe copy whose node does not answer
//!   falls back to the object store too, when the object is there.
//! - **Reports**: `ReportReplicas` applies a node's demotions, write-backs and drops through
//!   `Directory::report_replica`.
//! - **Access signal**: reads granted by gets are counted per node holding a copy (at most
//!   `access_report_keys_max` keys per node between heartbeats; more are dropped and counted)
//!   and handed to the node with its next heartbeat answer.
//! - **Scan**: with an object store configured, the master lists it at start (in the
//!   background; `scanning_object_store` in stats) and adopts every object with its
//!   object-store replica, so after every node and the master restarted empty, persisted
//!   objects are readable again (through loads).
//!
//! - **Namespace defaults**: `persistence_defaults` raises a put's persistence to its longest
//!   matching prefix's (a floor: `none` cannot be told from "not given" on the wire).
//! - **Removal**: persisted objects that are removed or replaced have that version deleted from
//!   the object store (by the timer, in the background), so a restart does not bring them
//!   back.
//!
//! Not handled: batching loads of many keys into one node call (each key is its own call, run
//! concurrently), rescans after start, an atomic delete-if-version on the object store (the
//! check and the delete are two requests: a newer write landing between them is lost; the
//! window is one round trip and needs a re-put of a just-removed key).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_proto::store::{self as w, ErrorCode, NodeRequest, NodeResponse, WireError};
use kvfs_tiers::{Medium, ObjectStoreMedium};
use tokio::sync::watch;

use super::{State, convert, deliver, now_ms, wire_view};
use crate::{Location, NodeEffect, NodeId, NodeLocation, PersistedObject, Tier};

/// Counters of the tier flows.
#[derive(Default)]
pub(crate) struct TierMetrics {
    loads_nvme: AtomicU64,
    loads_object_store: AtomicU64,
    load_failures: AtomicU64,
    moves_down: AtomicU64,
    moves_up: AtomicU64,
    move_failures: AtomicU64,
    corrupt_nvme: AtomicU64,
    corrupt_object_store: AtomicU64,
    eager_persisted: AtomicU64,
    persist_failures: AtomicU64,
    reports: AtomicU64,
    adopted: AtomicU64,
    access_dropped: AtomicU64,
    store_deletes: AtomicU64,
    store_delete_failures: AtomicU64,
}

/// The tier state of the master service.
pub(crate) struct TierState {
    pub object_store: Option<Arc<ObjectStoreMedium>>,
    loads: Mutex<HashMap<String, watch::Receiver<bool>>>,
    access: Mutex<HashMap<u64, HashMap<String, u32>>>,
    node_stats: Mutex<BTreeMap<u64, w::NodeStats>>,
    pub scanning: AtomicBool,
    pub metrics: TierMetrics,
}

impl TierState {
    pub fn new(object_store: Option<Arc<ObjectStoreMedium>>) -> TierState {
        TierState {
            scanning: AtomicBool::new(object_store.is_some()),
            object_store,
            loads: Mutex::default(),
            access: Mutex::default(),
            node_stats: Mutex::default(),
            metrics: TierMetrics::default(),
        }
    }

    /// Forget what was kept for nodes that left.
    pub fn forget_nodes(&self, nodes: &[NodeId]) {
        let mut stats = lock(&self.node_stats);
        let mut access = lock(&self.access);
        for n in nodes {
            stats.remove(&n.0);
            access.remove(&n.0);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn wire_err(code: ErrorCode, msg: impl Into<String>) -> WireError {
    WireError::new(code, msg)
}

/// Calls a node over its connection.
pub(super) async fn call_node(
    state: &State,
    node: NodeId,
    req: &NodeRequest,
    timeout_ms: u64,
) -> Result<NodeResponse, WireError> {
    // The node applies the drops queued for it first: a load may land in a range it still
    // names under an object the master dropped.
    super::send_records(state, node.0, super::Records::default()).await;
    let conn = lock(&state.nodes).get(&node.0).cloned();
    let Some(conn) = conn else {
        return Err(wire_err(ErrorCode::Unavailable, format!("no connection to node {}", node.0)));
    };
    match conn.call::<_, NodeResponse>(req, Duration::from_millis(timeout_ms)).await {
        Ok(NodeResponse::Refused(e)) => Err(e),
        Ok(r) => Ok(r),
        Err(e) => {
            state.metrics.node_call_failures.fetch_add(1, Ordering::Relaxed);
            Err(wire_err(ErrorCode::Unavailable, format!("node {}: {e}", node.0)))
        }
    }
}

/// The one result of a single-item node call.
pub(super) fn single(resp: NodeResponse, what: &str) -> Result<[u8; 32], WireError> {
    match resp {
        NodeResponse::Persisted(mut v) | NodeResponse::Loaded(mut v) if v.len() == 1 => {
            v.pop().expect("one item")
        }
        other => Err(wire_err(ErrorCode::Internal, format!("{what}: unexpected answer {other:?}"))),
    }
}

// ----- eager persistence --------------------------------------------------------------------

fn rank(p: w::Persistence) -> u8 {
    match p {
        w::Persistence::None => 0,
        w::Persistence::Lazy => 1,
        w::Persistence::Eager => 2,
    }
}

/// The persistence a put of `key` gets: what it asked for, raised to its namespace's default
/// (the longest matching prefix). A namespace default is a floor, because the wire cannot tell
/// an explicit `None` from an unspecified one.
pub fn persistence_for(
    defaults: &[(String, w::Persistence)],
    key: &str,
    asked: w::Persistence,
) -> w::Persistence {
    let floor = defaults
        .iter()
        .filter(|(prefix, _)| key.starts_with(prefix.as_str()))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, p)| *p)
        .unwrap_or(w::Persistence::None);
    if rank(floor) > rank(asked) { floor } else { asked }
}

/// Writes every eager object among `items` to the object store through a node holding one of
/// its ranges. Returns, per item, the error that must fail it (its pending put is revoked);
/// on success the item's checksum is what the node stored.
pub(crate) async fn persist_eager(
    state: &Arc<State>,
    items: &mut [w::PutEndItem],
) -> Vec<Option<WireError>> {
    let plans: Vec<Option<crate::PendingView>> = {
        let dir = state.lock();
        items
            .iter()
            .map(|it| {
                dir.pending_view(&it.key).filter(|p| {
                    p.persistence == crate::Persistence::Eager
                        && it.version.is_none_or(|v| v == p.version)
                })
            })
            .collect()
    };
    let mut set = tokio::task::JoinSet::new();
    for (i, (it, plan)) in items.iter().zip(&plans).enumerate() {
        let Some(plan) = plan.clone() else { continue };
        let (st, key, sum) = (state.clone(), it.key.clone(), it.checksum);
        set.spawn(async move { (i, persist_one(&st, &key, sum, &plan).await) });
    }
    let mut failed = vec![None; items.len()];
    while let Some(r) = set.join_next().await {
        let Ok((i, r)) = r else { continue };
        match r {
            Ok(sum) => {
                items[i].checksum = Some(sum);
                state.tiers.metrics.eager_persisted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                state.tiers.metrics.persist_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %items[i].key, error = %e.message, "eager persistence failed; put revoked");
                let mut fx = Vec::new();
                let _ = state.lock().put_revoke(&items[i].key, &mut fx);
                super::deliver(state, fx, false).await;
                failed[i] = Some(WireError::new(
                    e.code,
                    format!("eager persistence failed, the put was revoked: {}", e.message),
                ));
            }
        }
    }
    failed
}

async fn persist_one(
    state: &State,
    key: &str,
    checksum: Option<[u8; 32]>,
    plan: &crate::PendingView,
) -> Result<[u8; 32], WireError> {
    let mut last = wire_err(ErrorCode::Unavailable, "no node holds a range of the put");
    for r in &plan.ranges {
        let req = NodeRequest::Persist(vec![w::PersistItem {
            key: key.to_string(),
            segment: r.segment,
            offset: r.offset,
            size: plan.size,
            checksum,
            version: plan.version,
            pin: convert::pin(plan.pin),
        }]);
        match call_node(state, r.node, &req, state.cfg.persist_timeout_ms).await {
            Ok(resp) => match single(resp, "persist") {
                Ok(sum) => return Ok(sum),
                // The writer's checksum does not match the bytes: no other range will help.
                Err(e) if e.code == ErrorCode::Corrupt => return Err(e),
                Err(e) => last = e,
            },
            Err(e) => last = e,
        }
    }
    Err(last)
}

// ----- gets and loads -----------------------------------------------------------------------

fn has_memory_replica(v: &crate::ObjectView) -> bool {
    v.replicas.iter().any(|r| matches!(r.tier(), Tier::Dram | Tier::Hbm))
}

/// `Get`: views with read leases; objects without a memory replica are loaded into DRAM first.
pub(crate) async fn get(state: &Arc<State>, keys: Vec<String>, now: u64) -> w::MasterResponse {
    let (mut out, need) = {
        let dir = &mut *state.lock();
        let views = dir.get_batch(&keys, now);
        let mut need = Vec::new();
        for (i, v) in views.iter().enumerate() {
            if let Ok(v) = v {
                if !has_memory_replica(v) {
                    need.push(i);
                }
                record_access(state, &keys[i], v);
            }
        }
        let out: Vec<_> = views.into_iter().map(|r| wire_view(dir, r)).collect();
        (out, need)
    };
    if need.is_empty() {
        return w::MasterResponse::Get(out);
    }
    let results = load_many(state, need.iter().map(|&i| keys[i].clone()).collect()).await;
    let dir = &mut *state.lock();
    for (&i, r) in need.iter().zip(results) {
        out[i] = match r {
            Ok(()) => {
                let v = dir.get(&keys[i], now_ms());
                wire_view(dir, v)
            }
            Err(e) => Err(e),
        };
    }
    w::MasterResponse::Get(out)
}

/// `Promote` from a node: load the keys into DRAM (they need a memory replica).
pub(crate) async fn promote(state: &Arc<State>, keys: Vec<String>) -> w::MasterResponse {
    w::MasterResponse::Promote(load_many(state, keys).await)
}

fn record_access(state: &State, key: &str, v: &crate::ObjectView) {
    let max = state.cfg.access_report_keys_max;
    let mut access = lock(&state.tiers.access);
    for r in &v.replicas {
        let Some(node) = r.node() else { continue };
        let per = access.entry(node.0).or_default();
        if let Some(n) = per.get_mut(key) {
            *n = n.saturating_add(1);
        } else if per.len() < max {
            per.insert(key.to_string(), 1);
        } else {
            state.tiers.metrics.access_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn load_many(state: &Arc<State>, keys: Vec<String>) -> Vec<Result<(), WireError>> {
    let mut set = tokio::task::JoinSet::new();
    for (i, key) in keys.into_iter().enumerate() {
        let st = state.clone();
        set.spawn(async move { (i, load_dedup(&st, &key).await) });
    }
    let mut out = vec![Err(wire_err(ErrorCode::Internal, "load task failed")); set.len()];
    while let Some(r) = set.join_next().await {
        if let Ok((i, r)) = r {
            out[i] = r;
        }
    }
    out
}

/// One load of `key` at a time: later callers wait for the running one, then look again.
pub(super) async fn load_dedup(state: &Arc<State>, key: &str) -> Result<(), WireError> {
    for _ in 0..3 {
        let waiter = {
            let mut loads = lock(&state.tiers.loads);
            match loads.get(key) {
                Some(rx) => Err(rx.clone()),
                None => {
                    let (tx, rx) = watch::channel(false);
                    loads.insert(key.to_string(), rx);
                    Ok(tx)
                }
            }
        };
        match waiter {
            Ok(tx) => {
                let r = load(state, key).await;
                lock(&state.tiers.loads).remove(key);
                let _ = tx.send(true);
                return r;
            }
            Err(mut rx) => {
                let _ = rx.wait_for(|done| *done).await;
            }
        }
    }
    Err(wire_err(ErrorCode::PutInProgress, format!("load of {key:?} kept racing other loads")))
}

/// Plan, run and finish a load, falling back from a corrupt NVMe copy to the object store.
async fn load(state: &Arc<State>, key: &str) -> Result<(), WireError> {
    let mut object_store_only = false;
    for _ in 0..3 {
        let mut fx = Vec::new();
        let plan = state.lock().begin_load_from(key, object_store_only, now_ms(), &mut fx);
        deliver(state, fx, false).await;
        let plan = match plan {
            Ok(None) => return Ok(()),
            Ok(Some(p)) => p,
            Err(e) => return Err(convert::error(&e)),
        };
        mirror_load(state, &plan).await?;
        let source = match plan.source {
            Location::ObjectStore => w::Tier::ObjectStore,
            Location::Node(_) => w::Tier::Nvme,
        };
        let r =
            call_node(state, plan.node, &load_request(&plan, source), state.cfg.load_timeout_ms)
                .await
                .and_then(|resp| single(resp, "load"));
        let m = &state.tiers.metrics;
        let mut fx = Vec::new();
        match r {
            Ok(sum) => {
                let attached = state.lock().end_load(&plan, Some(sum), now_ms(), &mut fx);
                deliver(state, fx, false).await;
                match plan.source {
                    Location::ObjectStore => m.loads_object_store.fetch_add(1, Ordering::Relaxed),
                    Location::Node(_) => m.loads_nvme.fetch_add(1, Ordering::Relaxed),
                };
                if attached {
                    return Ok(());
                }
            }
            Err(e) => {
                state.lock().end_load(&plan, None, now_ms(), &mut fx);
                m.load_failures.fetch_add(1, Ordering::Relaxed);
                let persisted = plan.persistence != crate::Persistence::None
                    && state
                        .lock()
                        .stat(key)
                        .is_ok_and(|v| v.replicas.iter().any(|r| r.tier() == Tier::ObjectStore));
                if e.code == ErrorCode::Unavailable
                    && matches!(plan.source, Location::Node(_))
                    && persisted
                    && !object_store_only
                {
                    // The NVMe copy's node did not answer: read the object store instead.
                    object_store_only = true;
                    continue;
                }
                if e.code != ErrorCode::Corrupt {
                    return Err(e);
                }
                let Location::Node(nvme) = plan.source else {
                    m.corrupt_object_store.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                };
                m.corrupt_nvme.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key, node = nvme.node.0, error = %e.message, "corrupt NVMe copy dropped");
                let gone = drop_corrupt_copy(state, key, plan.version, nvme, plan.size).await;
                if gone {
                    return Err(e);
                }
            }
        }
    }
    Err(wire_err(ErrorCode::Internal, format!("load of {key:?}: the object kept changing")))
}

/// Tell the standbys of the range a load's node is about to write (they must know it before
/// the node is asked); a refusal ends the load unfilled.
async fn mirror_load(state: &Arc<State>, plan: &crate::LoadPlan) -> Result<(), WireError> {
    let grant = w::MirrorGrant {
        key: plan.key.to_string(),
        version: plan.version,
        node: plan.node.0,
        segment: plan.segment,
        offset: plan.offset,
        len: plan.size,
        ttl_ms: state.cfg.load_timeout_ms,
    };
    let r = super::mirror::replicate(state, &[grant]).await;
    if r.is_err() {
        let mut fx = Vec::new();
        state.lock().end_load(plan, None, now_ms(), &mut fx);
        deliver(state, fx, false).await;
    }
    r
}

/// The node call that fills a planned load's range from `source`.
fn load_request(plan: &crate::LoadPlan, source: w::Tier) -> NodeRequest {
    NodeRequest::Load(vec![w::LoadItem {
        key: plan.key.to_string(),
        segment: plan.segment,
        offset: plan.offset,
        size: plan.size,
        checksum: plan.checksum,
        version: plan.version,
        persistence: convert::persistence(plan.persistence),
        pin: convert::pin(plan.pin),
        source,
    }])
}

/// `Move` from a node: copy objects between its own memory tiers (HBM -> DRAM, DRAM -> HBM),
/// one after another; the node releases each source copy afterwards with a report.
pub(crate) async fn relocate(
    state: &Arc<State>,
    node: u64,
    items: Vec<w::MoveItem>,
) -> w::MasterResponse {
    let mut out = Vec::with_capacity(items.len());
    for it in items {
        let r = move_one(state, NodeId(node), &it).await;
        let m = &state.tiers.metrics;
        match (&r, it.to) {
            (Err(_), _) => m.move_failures.fetch_add(1, Ordering::Relaxed),
            (Ok(()), w::Tier::Hbm) => m.moves_up.fetch_add(1, Ordering::Relaxed),
            (Ok(()), _) => m.moves_down.fetch_add(1, Ordering::Relaxed),
        };
        out.push(r);
    }
    w::MasterResponse::Move(out)
}

async fn move_one(state: &Arc<State>, node: NodeId, it: &w::MoveItem) -> Result<(), WireError> {
    let tiers = (convert::tier_in(it.from), convert::tier_in(it.to));
    let mut fx = Vec::new();
    let plan = state.lock().begin_move(&it.key, it.version, node, tiers, now_ms(), &mut fx);
    deliver(state, fx, false).await;
    let plan = match plan {
        Ok(None) => return Ok(()),
        Ok(Some(p)) => p,
        Err(e) => return Err(convert::error(&e)),
    };
    mirror_load(state, &plan).await?;
    let req = load_request(&plan, it.from);
    let r = call_node(state, plan.node, &req, state.cfg.load_timeout_ms)
        .await
        .and_then(|resp| single(resp, "move"));
    let mut fx = Vec::new();
    let attached = state.lock().end_load(&plan, r.as_ref().ok().copied(), now_ms(), &mut fx);
    deliver(state, fx, false).await;
    r?;
    if !attached {
        let detail = "the object or its source copy changed while it moved";
        return Err(wire_err(ErrorCode::Conflict, format!("move of {:?}: {detail}", it.key)));
    }
    Ok(())
}

/// Forget a copy that failed verification and tell its node to delete it. Returns whether the
/// object is gone (that was its last copy).
async fn drop_corrupt_copy(
    state: &Arc<State>,
    key: &str,
    version: u64,
    at: NodeLocation,
    size: u64,
) -> bool {
    let gone = {
        let mut dir = state.lock();
        if dir.stat(key).is_ok_and(|v| v.version == version) {
            dir.remove_replica(key, &Location::Node(at)).unwrap_or(false)
        } else {
            false
        }
    };
    let fx = vec![NodeEffect::Drop {
        node: at.node,
        key: Arc::from(key),
        segment: at.segment,
        offset: at.offset,
        len: size,
        version,
        readers_until_ms: 0,
    }];
    deliver(state, fx, false).await;
    gone
}

// ----- reports and heartbeats ---------------------------------------------------------------

fn location(node: u64, loc: &w::ReplicaLoc) -> Location {
    match *loc {
        w::ReplicaLoc::ObjectStore => Location::ObjectStore,
        w::ReplicaLoc::Node { tier, segment, offset } => Location::Node(NodeLocation {
            node: NodeId(node),
            segment,
            tier: convert::tier_in(tier),
            addr: 0,
            offset,
        }),
    }
}

/// `ReportReplicas` from a node.
pub(crate) fn report(
    state: &State,
    node: u64,
    items: Vec<w::ReplicaReport>,
    now: u64,
) -> w::MasterResponse {
    state.tiers.metrics.reports.fetch_add(items.len() as u64, Ordering::Relaxed);
    let mut dir = state.lock();
    let out = items
        .iter()
        .map(|it| {
            let add = it.add.as_ref().map(|l| location(node, l));
            let remove = it.remove.as_ref().map(|l| location(node, l));
            dir.report_replica(&it.key, it.version, it.checksum, add.as_ref(), remove.as_ref(), now)
                .map(|o| w::ReportOutcome {
                    added: o.added,
                    removed: o.removed,
                    retry_after_ms: o.retry_after_ms,
                })
                .map_err(|e| convert::error(&e))
        })
        .collect();
    w::MasterResponse::ReportReplicas(out)
}

/// `Heartbeat`: keep the node's counters, answer with the reads of its objects since the last.
pub(crate) fn heartbeat(
    state: &State,
    node: u64,
    stats: w::NodeStats,
    now: u64,
) -> w::MasterResponse {
    if let Err(e) = state.lock().heartbeat(NodeId(node), now) {
        return w::MasterResponse::Heartbeat(Err(convert::error(&e)));
    }
    lock(&state.tiers.node_stats).insert(node, stats);
    let accessed = lock(&state.tiers.access).remove(&node).unwrap_or_default();
    w::MasterResponse::Heartbeat(Ok(w::HeartbeatAck { accessed: accessed.into_iter().collect() }))
}

// ----- object-store scan --------------------------------------------------------------------

/// Adopt every object of the object store (run once, in the background, at start).
pub(crate) async fn scan(state: Arc<State>) {
    let Some(store) = state.tiers.object_store.clone() else { return };
    let started = std::time::Instant::now();
    let listed = match store.list_detailed().await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "object store scan failed; persisted objects are not adopted");
            state.tiers.scanning.store(false, Ordering::Release);
            return;
        }
    };
    let (mut adopted, mut refused) = (0u64, 0u64);
    for chunk in listed.chunks(1024) {
        let mut fx = Vec::new();
        {
            let mut dir = state.lock();
            for kvfs_tiers::ListedObject { key, meta, previous } in chunk {
                // A copy a crash left under its old name next to the renamed one is dropped
                // by the directory (see `Directory::rename`).
                let p = PersistedObject {
                    key: key.clone(),
                    size: meta.size_bytes,
                    checksum: meta.checksum,
                    version: meta.version,
                    persistence: match meta.persistence {
                        kvfs_tiers::Persistence::Eager => crate::Persistence::Eager,
                        kvfs_tiers::Persistence::Lazy => crate::Persistence::Lazy,
                        kvfs_tiers::Persistence::None => crate::Persistence::None,
                    },
                    pin: convert::pin_in(w::Pin::from_code(meta.pin)),
                    renamed_from: previous.clone(),
                };
                match dir.adopt_persisted(&p, &mut fx) {
                    Ok(true) => adopted += 1,
                    Ok(false) => {}
                    Err(e) => {
                        refused += 1;
                        tracing::warn!(key, error = %e, "object store object not adopted");
                    }
                }
            }
        }
        deliver(&state, fx, false).await;
        tokio::task::yield_now().await;
    }
    state.tiers.metrics.adopted.fetch_add(adopted, Ordering::Relaxed);
    state.tiers.scanning.store(false, Ordering::Release);
    tracing::info!(
        listed = listed.len(),
        adopted,
        refused,
        took_ms = started.elapsed().as_millis() as u64,
        "object store scanned"
    );
}

/// Deletes from the object store the versions of removed or replaced persisted objects
/// (called by the timer). A copy of another version (a newer write) is left alone; the check
/// and the delete are two requests, so a newer write landing between them can be lost (see the
/// module notes).
/// Moves the object store copy of a renamed object to its new name (`from` -> `to`, at the
/// renamed version, naming `from` as its previous name so a scan after a crash in the middle
/// keeps one name). When that fails the object keeps its node copies but is no longer
/// persisted, and the old copy is deleted (it must not come back under the old name).
pub(crate) async fn move_persisted(
    state: &Arc<State>,
    from: &str,
    to: &str,
    done: crate::Renamed,
) -> w::ItemResult<u64> {
    let Some(store) = state.tiers.object_store.clone() else { return Ok(done.version) };
    let opts =
        kvfs_tiers::RenameOptions { version: done.version, mode: kvfs_tiers::PutMode::Overwrite };
    match store.rename(from, to, opts).await {
        Ok(_) => Ok(done.version),
        Err(e) => {
            tracing::warn!(from, to, error = %e, "object store copy of a renamed object not moved");
            let mut dir = state.lock();
            let gone = dir.remove_replica(to, &crate::Location::ObjectStore).unwrap_or(false);
            dir.forget_persisted_copy(from, done.from_version);
            if gone {
                let detail = format!("the object store copy could not be moved: {e}");
                return Err(WireError::new(ErrorCode::Internal, detail));
            }
            Ok(done.version)
        }
    }
}

pub(crate) async fn delete_unpersisted(state: &Arc<State>) {
    let gone = state.lock().take_unpersisted();
    let Some(store) = state.tiers.object_store.clone() else { return };
    if gone.is_empty() {
        return;
    }
    let st = state.clone();
    tokio::spawn(async move {
        let m = &st.tiers.metrics;
        for chunk in gone.chunks(16) {
            let mut set = tokio::task::JoinSet::new();
            for (key, version) in chunk.iter().cloned() {
                let store = store.clone();
                set.spawn(async move {
                    match store.stat(&key).await {
                        Ok(meta) if meta.version == version => store.remove(&key).await,
                        Ok(_) => Ok(()),
                        Err(e) if e.kind() == kvfs_tiers::ErrorKind::NotFound => Ok(()),
                        Err(e) => Err(e),
                    }
                });
            }
            while let Some(r) = set.join_next().await {
                match r {
                    Ok(Ok(())) => m.store_deletes.fetch_add(1, Ordering::Relaxed),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "object store delete failed");
                        m.store_delete_failures.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => m.store_delete_failures.fetch_add(1, Ordering::Relaxed),
                };
            }
        }
    });
}

// ----- metrics ------------------------------------------------------------------------------

/// Appends the tier counters and every node's reported counters.
pub(crate) fn render(state: &State, o: &mut String) {
    let m = &state.tiers.metrics;
    let dropped = state.lock().unpersisted_dropped();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, v) in rows {
            let _ = writeln!(o, "{name}{labels} {v}");
        }
    };
    counter(
        "kvfs_master_loads_total",
        "DRAM copies made for gets and promotions, by source tier.",
        &[
            ("{source=\"nvme\"}", load(&m.loads_nvme)),
            ("{source=\"object_store\"}", load(&m.loads_object_store)),
        ],
    );
    counter(
        "kvfs_master_load_failures_total",
        "Loads that failed.",
        &[("", load(&m.load_failures))],
    );
    counter(
        "kvfs_master_moves_total",
        "Copies made between a node's memory tiers for its tier manager, by direction.",
        &[
            ("{direction=\"hbm_to_dram\"}", load(&m.moves_down)),
            ("{direction=\"dram_to_hbm\"}", load(&m.moves_up)),
        ],
    );
    counter(
        "kvfs_master_move_failures_total",
        "Moves between a node's memory tiers that failed or were refused.",
        &[("", load(&m.move_failures))],
    );
    counter(
        "kvfs_master_corrupt_copies_total",
        "Copies whose bytes failed their checksum when read, by tier.",
        &[
            ("{tier=\"nvme\"}", load(&m.corrupt_nvme)),
            ("{tier=\"object_store\"}", load(&m.corrupt_object_store)),
        ],
    );
    counter(
        "kvfs_master_eager_persisted_total",
        "Eager puts written to the object store before completing.",
        &[("", load(&m.eager_persisted))],
    );
    counter(
        "kvfs_master_persist_failures_total",
        "Eager puts revoked because no node could write them to the object store.",
        &[("", load(&m.persist_failures))],
    );
    counter(
        "kvfs_master_replica_reports_total",
        "Replica reports from tier managers.",
        &[("", load(&m.reports))],
    );
    counter(
        "kvfs_master_object_store_adopted_total",
        "Objects adopted from the object store scan.",
        &[("", load(&m.adopted))],
    );
    counter(
        "kvfs_master_object_store_deletes_total",
        "Object-store copies of removed or replaced persisted objects deleted (or already gone).",
        &[("", load(&m.store_deletes))],
    );
    counter(
        "kvfs_master_object_store_delete_failures_total",
        "Object-store deletions that failed (the copy may come back after a restart).",
        &[("", load(&m.store_delete_failures)), ("{reason=\"list_full\"}", dropped)],
    );
    counter(
        "kvfs_master_access_keys_dropped_total",
        "Reads not passed to nodes because a node's access report was full.",
        &[("", load(&m.access_dropped))],
    );
    let scanning = u8::from(state.tiers.scanning.load(Ordering::Acquire));
    let _ = writeln!(
        o,
        "# HELP kvfs_master_object_store_scanning 1 while the start-up object store scan runs.\n# TYPE kvfs_master_object_store_scanning gauge\nkvfs_master_object_store_scanning {scanning}"
    );
    let stats = lock(&state.tiers.node_stats).clone();
    type Field = fn(&w::NodeStats) -> u64;
    let fields: [(&str, &str, &str, Field); 22] = [
        ("kvfs_node_dram_capacity_bytes", "gauge", "DRAM the node contributes.", |s| {
            s.dram_capacity_bytes
        }),
        ("kvfs_node_dram_used_bytes", "gauge", "DRAM bytes of objects the node holds.", |s| {
            s.dram_used_bytes
        }),
        ("kvfs_node_nvme_capacity_bytes", "gauge", "NVMe tier capacity.", |s| {
            s.nvme_capacity_bytes
        }),
        ("kvfs_node_nvme_used_bytes", "gauge", "NVMe tier bytes in use.", |s| s.nvme_used_bytes),
        ("kvfs_node_nvme_objects", "gauge", "Objects on the NVMe tier.", |s| s.nvme_objects),
        ("kvfs_node_demotions_total", "counter", "Objects demoted DRAM -> NVMe.", |s| s.demotions),
        ("kvfs_node_demoted_bytes_total", "counter", "Bytes demoted DRAM -> NVMe.", |s| {
            s.demoted_bytes
        }),
        (
            "kvfs_node_promotions_total",
            "counter",
            "Objects copied NVMe/object store -> DRAM.",
            |s| s.promotions,
        ),
        (
            "kvfs_node_promoted_bytes_total",
            "counter",
            "Bytes copied into DRAM by promotions.",
            |s| s.promoted_bytes,
        ),
        (
            "kvfs_node_nvme_drops_total",
            "counter",
            "NVMe copies dropped (persisted or replicated elsewhere).",
            |s| s.nvme_drops,
        ),
        (
            "kvfs_node_rate_limited_rounds_total",
            "counter",
            "Policy rounds held back by the tier rate limit.",
            |s| s.rate_limited_rounds,
        ),
        ("kvfs_node_writeback_queued", "gauge", "Objects in the lazy write-back queue.", |s| {
            s.writeback_queued
        }),
        (
            "kvfs_node_writeback_persisted_total",
            "counter",
            "Objects written back to the object store.",
            |s| s.writeback_persisted,
        ),
        ("kvfs_node_writeback_failed_total", "counter", "Write-backs given up on.", |s| {
            s.writeback_failed
        }),
        (
            "kvfs_node_eager_persisted_total",
            "counter",
            "Eager objects this node wrote to the object store.",
            |s| s.eager_persisted,
        ),
        (
            "kvfs_node_writer_commits_total",
            "counter",
            "Commits writers recorded on the node themselves (noted writes, same-process puts).",
            |s| s.writer_commits,
        ),
        ("kvfs_node_hbm_available", "gauge", "1 when the node found a CUDA driver.", |s| {
            u64::from(s.hbm_available)
        }),
        ("kvfs_node_hbm_capacity_bytes", "gauge", "GPU memory the node contributes.", |s| {
            s.hbm_capacity_bytes
        }),
        ("kvfs_node_hbm_used_bytes", "gauge", "HBM bytes of objects the node holds.", |s| {
            s.hbm_used_bytes
        }),
        ("kvfs_node_hbm_demotions_total", "counter", "Objects moved HBM -> DRAM.", |s| {
            s.hbm_demotions
        }),
        ("kvfs_node_hbm_promotions_total", "counter", "Objects moved DRAM -> HBM.", |s| {
            s.hbm_promotions
        }),
        (
            "kvfs_node_runtime_stalls_total",
            "counter",
            "Times the node's async runtime ran no task for a second or more (it answered nothing and sent no heartbeat meanwhile).",
            |s| s.runtime_stalls,
        ),
    ];
    for (name, kind, help, f) in fields {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (node, s) in &stats {
            let _ = writeln!(o, "{name}{{node=\"{node}\"}} {}", f(s));
        }
    }
    let name = "kvfs_node_te_requests_total";
    let _ = writeln!(
        o,
        "# HELP {name} Requests the node's Transfer Engine served over tcp, by op.\n# TYPE {name} counter"
    );
    for (node, s) in &stats {
        for op in kvfs_proto::transfer::DataOp::ALL {
            let (label, n) = (op.label(), s.te_requests.get(op));
            let _ = writeln!(o, "{name}{{node=\"{node}\",op=\"{label}\"}} {n}");
        }
    }
    let name = "kvfs_node_corrupt_reads_total";
    let _ = writeln!(
        o,
        "# HELP {name} Reads on the node that failed verification, by tier.\n# TYPE {name} counter"
    );
    for (node, s) in &stats {
        let _ = writeln!(o, "{name}{{node=\"{node}\",tier=\"nvme\"}} {}", s.corrupt_reads_nvme);
        let _ = writeln!(
            o,
            "{name}{{node=\"{node}\",tier=\"object_store\"}} {}",
            s.corrupt_reads_object_store
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_defaults_are_a_floor_by_longest_prefix() {
        use w::Persistence::*;
        let d = vec![("models/".to_string(), Lazy), ("models/pinned/".to_string(), Eager)];
        assert_eq!(persistence_for(&d, "models/a", None), Lazy);
        assert_eq!(persistence_for(&d, "models/a", Eager), Eager);
        assert_eq!(persistence_for(&d, "models/pinned/x", None), Eager);
        assert_eq!(persistence_for(&d, "other", None), None);
        assert_eq!(persistence_for(&[], "models/a", Lazy), Lazy);
    }
}
