//! The node's tier manager: what the node does with its NVMe tier, its object store and its
//! write-back queue, driven by the sans-IO `kvfs_tiers::policy`.
//!
//! Flows (each move is reported to the master before anything relies on it):
//! - **Demotion** (policy `Demote`, DRAM above its high watermark, coldest first): write the
//!   DRAM bytes to an NVMe file (verified against the known blake3, or hashed on the way), then
//!   report `{add: NVMe copy, remove: DRAM copy}`. The master refuses the add if the DRAM copy
//!   is no longer a replica (the bytes read may have been reused), and keeps the DRAM copy
//!   while a read lease is live; the node keeps what the answer says and undoes the rest.
//! - **Drop** (policy `Drop`, NVMe above its high watermark): report `{remove: NVMe copy}` of a
//!   persisted object; delete the file only once the master agreed.
//! - **Promotion** (policy `Promote`, an NVMe object read often in the window): ask the master,
//!   which allocates a DRAM range here and sends a `Load` (the same path as a get that finds
//!   no memory replica).
//! - **Load** (from the master): copy from NVMe or the object store into the DRAM range,
//!   verified by the medium (`Corrupt` is counted and answered; the master then drops the bad
//!   copy and falls back).
//! - **HBM moves** (a node with an HBM segment; policy `Demote { from: Hbm }` above the HBM
//!   watermark, `Promote { to: Hbm }` for a hot object a writer put into HBM): ask the master
//!   to `Move` the copy; it allocates the range in the other memory tier here and sends a
//!   `Load` naming the source tier, which this node answers by copying device -> host or host
//!   -> device (`HbmBlock`); the master attaches the new copy only if the source is still a
//!   replica. The node then reports the source copy's release, kept while a read lease
//!   protects it (an HBM copy is asked again later; a DRAM copy left beside an HBM one is
//!   released by the next DRAM demotion round that picks it, without moving bytes).
//! - **Eager persistence** (`Persist` from the master, before the put completes): copy the
//!   pending DRAM range and put it into the object store with the object's header.
//! - **Lazy persistence**: a committed `Lazy` object is enqueued (with its blake3, hashed now
//!   if the writer sent none) in the crash-safe write-back queue; its `Persisted` event is
//!   reported as an object-store copy (a report the master did not take is made again each
//!   round; the copy counts as persisted once it is taken). Objects a full queue (`Busy`)
//!   refused, or whose copy moved while it was hashed, wait in a backlog retried each round.
//!
//! The policy's access signal: the reads the master granted of this node's objects, handed
//! back with each heartbeat (clients read node memory without the node's code seeing it).
//!
//! Limits: one tier move at a time (the round runs actions in order, at most
//! `actions_per_round_max`), byte rates capped by the policy's token buckets, write-back queue
//! bounded in entries and bytes, write-back and report retries take at most 64 objects each a
//! round (the backlog and the unreported set are bounded by the objects the node holds).
//!
//! Not handled: moving objects between nodes; demoting HBM objects straight to NVMe (they go
//! through DRAM); demoting objects the policy never heard of (every commit and load tells it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use kvfs_proto::store::{
    CommitItem, DropItem, ErrorCode, ItemResult, LoadItem, MasterRequest, MasterResponse, MoveItem,
    NodeStats, PersistItem, Persistence, RenameRecord, ReplicaLoc, ReplicaReport, ReportOutcome,
    Tier, WireError,
};
use kvfs_tiers::policy::{Action, Held as PHeld, Tier as PTier, TierPolicy, TierUsage, Usage};
use kvfs_tiers::writeback::{WritebackConfig, WritebackEvent, WritebackQueue};
use kvfs_tiers::{Medium, NvmeMedium, ObjectMeta, ObjectStoreMedium, PutMode, PutOptions};
use kvfs_transfer::Buffer;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::held::{DRAM_SEGMENT, HBM_SEGMENT, Held, Index, NVME_SEGMENT};
use crate::{Inner, NodeConfig, tier_err};
use kvfs_client::master::MasterLink;
use kvfs_client::{Error, ErrorKind, Result};

/// A demotion its tenant's NVMe quota refused is not tried again for this long.
const QUOTA_RETRY_MS: u64 = 30_000;

/// A move between the memory tiers the master refused is not asked again for this long.
const MOVE_RETRY_MS: u64 = 1_000;

/// Counters of the tier flows.
#[derive(Default)]
struct Counters {
    demotions: AtomicU64,
    demoted_bytes: AtomicU64,
    promotions: AtomicU64,
    promoted_bytes: AtomicU64,
    nvme_drops: AtomicU64,
    hbm_demotions: AtomicU64,
    hbm_promotions: AtomicU64,
    writeback_persisted: AtomicU64,
    writeback_failed: AtomicU64,
    eager_persisted: AtomicU64,
    writer_commits: AtomicU64,
}

/// The node's tiers and tier manager state.
pub(super) struct Tiers {
    pub nvme: Option<Arc<NvmeMedium>>,
    object_store: Option<Arc<ObjectStoreMedium>>,
    writeback: Option<Arc<WritebackQueue>>,
    events: Mutex<Option<mpsc::UnboundedReceiver<WritebackEvent>>>,
    /// Lazy objects whose enqueue the full queue refused, retried each round.
    backlog: Mutex<BTreeSet<String>>,
    /// Write-backs done whose report the master did not take (unreachable, timed out, a
    /// standby answering): key -> version, reported again each round.
    unreported: Mutex<BTreeMap<String, u64>>,
    policy: Mutex<TierPolicy>,
    counters: Counters,
    hbm_available: bool,
}

/// What `Tiers::open` needs.
pub(super) struct TiersParts<'a> {
    pub cfg: &'a NodeConfig,
    pub index: Arc<Mutex<Index>>,
    pub dram: Arc<Buffer>,
    pub hbm: Option<Arc<kvfs_tiers::HbmBlock>>,
    pub nvme: Option<Arc<NvmeMedium>>,
    pub object_store: Option<Arc<ObjectStoreMedium>>,
    pub hbm_available: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn persistence_code(p: Persistence) -> kvfs_tiers::Persistence {
    match p {
        Persistence::None => kvfs_tiers::Persistence::None,
        Persistence::Lazy => kvfs_tiers::Persistence::Lazy,
        Persistence::Eager => kvfs_tiers::Persistence::Eager,
    }
}

fn persistence_of(p: kvfs_tiers::Persistence) -> Persistence {
    match p {
        kvfs_tiers::Persistence::None => Persistence::None,
        kvfs_tiers::Persistence::Lazy => Persistence::Lazy,
        kvfs_tiers::Persistence::Eager => Persistence::Eager,
    }
}

fn wire(e: &kvfs_tiers::Error) -> WireError {
    let code = match e.kind() {
        kvfs_tiers::ErrorKind::Corrupt => ErrorCode::Corrupt,
        kvfs_tiers::ErrorKind::NotFound => ErrorCode::NotFound,
        kvfs_tiers::ErrorKind::NoSpace => ErrorCode::NoSpace,
        kvfs_tiers::ErrorKind::InvalidArgument => ErrorCode::InvalidArgument,
        _ => ErrorCode::Unavailable,
    };
    WireError::new(code, e.to_string())
}

impl Tiers {
    pub async fn open(p: TiersParts<'_>) -> Result<Tiers> {
        let t = &p.cfg.tiers;
        let (writeback, events) = match (&p.cfg.data_dir, &p.object_store) {
            (Some(dir), Some(store)) => {
                let wcfg = WritebackConfig {
                    queue_entries_max: t.writeback_entries_max,
                    queue_bytes_max: t.writeback_bytes_max,
                    workers: t.writeback_workers,
                    ..WritebackConfig::new(dir.join("writeback.journal"))
                };
                let source = Arc::new(NodeSource {
                    index: p.index.clone(),
                    dram: p.dram.clone(),
                    hbm: p.hbm.clone(),
                    nvme: p.nvme.clone(),
                });
                let (q, recovery, rx) = WritebackQueue::open(wcfg, source, store.clone())
                    .await
                    .map_err(|e| tier_err("open the write-back queue", e))?;
                if !recovery.pending.is_empty() {
                    tracing::info!(
                        pending = recovery.pending.len(),
                        "write-back queue recovered entries"
                    );
                }
                (Some(Arc::new(q)), Some(rx))
            }
            _ => (None, None),
        };
        Ok(Tiers {
            nvme: p.nvme,
            object_store: p.object_store,
            writeback,
            events: Mutex::new(events),
            backlog: Mutex::default(),
            unreported: Mutex::default(),
            policy: Mutex::new(TierPolicy::new(t.policy)),
            counters: Counters::default(),
            hbm_available: p.hbm_available,
        })
    }

    /// The tier manager's round timer and the write-back event reader.
    pub fn start_tasks(&self, inner: &Arc<Inner>, link: &Arc<MasterLink>) -> Vec<JoinHandle<()>> {
        let mut tasks = vec![tokio::spawn(rounds(inner.clone(), link.clone()))];
        if let Some(rx) = lock(&self.events).take() {
            tasks.push(tokio::spawn(writeback_events(inner.clone(), link.clone(), rx)));
        }
        tasks
    }
}

/// The write-back queue's view of the node: an object's bytes from DRAM, else from NVMe.
struct NodeSource {
    index: Arc<Mutex<Index>>,
    dram: Arc<Buffer>,
    hbm: Option<Arc<kvfs_tiers::HbmBlock>>,
    nvme: Option<Arc<NvmeMedium>>,
}

fn unsupported(what: &str) -> kvfs_tiers::Error {
    kvfs_tiers::Error::new(
        kvfs_tiers::ErrorKind::InvalidArgument,
        format!("node source: no {what}"),
    )
}

#[async_trait]
impl Medium for NodeSource {
    fn capabilities(&self) -> kvfs_tiers::Capabilities {
        kvfs_tiers::Capabilities { kind: "node", ..Default::default() }
    }

    async fn put(&self, _: &str, _: &[u8], _: PutOptions) -> kvfs_tiers::Result<ObjectMeta> {
        Err(unsupported("put"))
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> kvfs_tiers::Result<ObjectMeta> {
        let held = lock(&self.index).objects.get(key).cloned();
        let not_found =
            || kvfs_tiers::Error::new(kvfs_tiers::ErrorKind::NotFound, format!("node: {key:?}"));
        let h = held.ok_or_else(not_found)?;
        let size = kvfs_tiers::medium::check_dst(key, dst.len(), h.size)?;
        let hbm = h.hbm.zip(self.hbm.as_ref());
        if h.dram.is_none() && hbm.is_none() {
            return match &self.nvme {
                Some(nvme) if h.nvme.is_some() => nvme.get_into(key, dst).await,
                _ => Err(not_found()),
            };
        }
        match (h.dram, hbm) {
            (Some(off), _) => self.dram.read_at(off as usize, &mut dst[..size]).map_err(|e| {
                kvfs_tiers::Error::new(kvfs_tiers::ErrorKind::Io, format!("dram read: {e}"))
            })?,
            (None, Some((off, block))) => block.read(off, &mut dst[..size])?,
            (None, None) => return Err(not_found()),
        }
        Ok(held_meta(&h))
    }

    async fn stat(&self, key: &str) -> kvfs_tiers::Result<ObjectMeta> {
        let h = lock(&self.index).objects.get(key).cloned().ok_or_else(|| {
            kvfs_tiers::Error::new(kvfs_tiers::ErrorKind::NotFound, format!("node: {key:?}"))
        })?;
        Ok(held_meta(&h))
    }

    async fn remove(&self, _: &str) -> kvfs_tiers::Result<()> {
        Err(unsupported("remove"))
    }

    async fn list(&self) -> kvfs_tiers::Result<Vec<(String, ObjectMeta)>> {
        Err(unsupported("list"))
    }

    async fn rename(
        &self,
        _: &str,
        _: &str,
        _: kvfs_tiers::RenameOptions,
    ) -> kvfs_tiers::Result<ObjectMeta> {
        Err(unsupported("rename"))
    }

    async fn previous_name(&self, _: &str) -> kvfs_tiers::Result<Option<(String, u64)>> {
        Err(unsupported("previous_name"))
    }

    fn capacity_bytes(&self) -> Option<u64> {
        None
    }

    fn used_bytes(&self) -> u64 {
        0
    }
}

/// The medium's view of a copy the index holds.
fn held_meta(h: &Held) -> ObjectMeta {
    ObjectMeta {
        size_bytes: h.size,
        checksum: h.checksum.unwrap_or_default(),
        persistence: persistence_code(h.persistence),
        stored_at_unix_ms: 0,
        version: h.version,
        pin: h.pin.code(),
    }
}

/// Whether a renamed copy must be queued for write-back under its new name: every lazy copy
/// not yet persisted, queued under the old name or not. The enqueue a commit spawns may not
/// have run when the rename arrives (then `queued` is still false, and that enqueue finds the
/// old name gone and skips it): re-queueing only queued copies lost those write-backs.
fn writeback_after_rename(h: &Held) -> bool {
    h.persistence == Persistence::Lazy && !h.persisted
}

/// Removes a key's NVMe file if it still holds `version` (a newer copy may have replaced it).
async fn remove_nvme_version(nvme: &NvmeMedium, key: &str, version: u64) {
    if nvme.stat(key).await.is_ok_and(|m| m.version == version)
        && let Err(e) = nvme.remove(key).await
    {
        tracing::warn!(key, error = %e, "could not remove an NVMe copy");
    }
}

/// What the policy should know of a copy the index holds; `None` when it names no copy.
fn policy_facts(h: &Held) -> Option<PHeld> {
    let tier = match (h.hbm, h.dram, h.nvme) {
        (Some(_), _, _) => PTier::Hbm,
        (None, Some(_), _) => PTier::Dram,
        (None, None, Some(_)) => PTier::Nvme,
        _ => return None,
    };
    Some(PHeld {
        tier,
        size_bytes: h.size,
        persisted: h.persisted,
        replicas_elsewhere: 0,
        pinned: h.pin == kvfs_proto::store::Pin::Hard,
        hbm_home: h.hbm_home,
        dram_copy: h.hbm.is_some() && h.dram.is_some(),
    })
}

/// Tell the policy where `key` is now (or that it is gone).
fn sync_policy(p: &mut TierPolicy, key: &str, h: Option<&Held>, now_ms: u64) {
    match h.and_then(policy_facts) {
        Some(facts) => p.sync_held(key, facts, now_ms),
        None => p.on_removed(key),
    }
}

impl Inner {
    /// Tell the policy where `key` is now (or that it is gone).
    fn policy_sync(&self, key: &str, h: Option<&Held>) {
        let now = self.now_ms();
        sync_policy(&mut lock(&self.tiers.policy), key, h, now);
    }

    /// Index the NVMe objects found at start (they are re-reported at registration).
    pub(super) async fn adopt_nvme_objects(&self) {
        let Some(nvme) = &self.tiers.nvme else { return };
        let listed = match nvme.list().await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "could not list the NVMe tier");
                return;
            }
        };
        let mut previous = std::collections::HashMap::new();
        for (key, _) in &listed {
            if let Ok(Some(p)) = nvme.previous_name(key).await {
                previous.insert(key.clone(), p);
            }
        }
        let mut dropped = Vec::new();
        let mut adopted = Vec::new();
        {
            let mut idx = lock(&self.index);
            for (key, meta) in listed {
                let Ok(off) = idx.nvme_alloc.alloc(meta.size_bytes) else {
                    dropped.push((key, meta.version));
                    continue;
                };
                let mut h = Held::new(
                    meta.size_bytes,
                    meta.version,
                    persistence_of(meta.persistence),
                    kvfs_proto::store::Pin::from_code(meta.pin),
                );
                h.checksum = Some(meta.checksum);
                h.nvme = Some(off);
                h.persisted = meta.persistence == kvfs_tiers::Persistence::Eager;
                h.renamed_from = previous.remove(&key);
                adopted.push((key.clone(), h.clone()));
                idx.objects.insert(key, h);
            }
        }
        for (key, h) in &adopted {
            self.policy_sync(key, Some(h));
        }
        for (key, version) in dropped {
            tracing::warn!(key, "NVMe object does not fit the configured NVMe capacity; removed");
            remove_nvme_version(nvme, &key, version).await;
        }
        if !adopted.is_empty() {
            tracing::info!(node = self.id, objects = adopted.len(), "NVMe objects to re-report");
        }
    }

    /// `Commit` records: the objects are complete on the master.
    ///
    /// The whole batch is recorded under one hold of the index lock and of the policy lock
    /// (lock order: index, then policy; nothing takes them the other way round), each key
    /// hashed a few times and copied at most once (for the policy, when new to it).
    pub(super) fn commit(self: &Arc<Self>, items: Vec<CommitItem>) {
        let mut lazy = Vec::new();
        let mut stale_nvme = Vec::new();
        let now = self.now_ms();
        {
            let mut idx = lock(&self.index);
            let mut policy = lock(&self.tiers.policy);
            for it in items {
                if idx.objects.get(&it.key).is_some_and(|h| h.version != it.version)
                    && let Some(old) = idx.remove(&it.key)
                    && old.nvme.is_some()
                {
                    stale_nvme.push((it.key.clone(), old.version));
                }
                let (key, mut h) = match idx.objects.remove_entry(&it.key) {
                    Some(entry) => entry,
                    None => (it.key, Held::new(it.size, it.version, it.persistence, it.pin)),
                };
                h.checksum = h.checksum.or(it.checksum);
                h.persisted |= it.persistence == Persistence::Eager;
                let needs_writeback =
                    it.persistence == Persistence::Lazy && !h.persisted && !h.queued;
                if it.segment == HBM_SEGMENT {
                    if h.hbm.is_none() {
                        idx.hbm_bytes += h.size;
                    }
                    h.hbm = Some(it.offset);
                    h.hbm_home = true;
                } else {
                    if h.dram.is_none() {
                        idx.dram_bytes += h.size;
                    }
                    h.dram = Some(it.offset);
                }
                sync_policy(&mut policy, &key, Some(&h), now);
                if needs_writeback && self.tiers.writeback.is_some() {
                    lazy.push(key.clone());
                }
                idx.objects.insert(key, h);
            }
        }
        if let Some(nvme) = self.tiers.nvme.clone().filter(|_| !stale_nvme.is_empty()) {
            tokio::spawn(async move {
                for (key, version) in stale_nvme {
                    remove_nvme_version(&nvme, &key, version).await;
                }
            });
        }
        if !lazy.is_empty() {
            let inner = self.clone();
            tokio::spawn(async move { inner.enqueue_writebacks(lazy).await });
        }
    }

    /// `Rename` records: the object held under `from` (at `from_version`) is now `to` at
    /// `version`. The DRAM copy is re-keyed in the index (its bytes stay); the NVMe copy is
    /// renamed on disk (its data file re-linked, a new header naming the old name); a queued
    /// write-back is queued again under the new name. A tier move of the key that is running
    /// is waited for (bounded), so its report cannot name the old key after the rename.
    pub(super) async fn rename(self: &Arc<Self>, items: Vec<RenameRecord>) {
        const MOVE_WAIT: Duration = Duration::from_secs(2);
        let mut lazy = Vec::new();
        for it in items {
            let waited = std::time::Instant::now();
            loop {
                let busy = lock(&self.index).objects.get(&it.from).is_some_and(|h| h.busy);
                if !busy || waited.elapsed() >= MOVE_WAIT {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let (nvme_copy, stale) = {
                let mut idx = lock(&self.index);
                let mut policy = lock(&self.tiers.policy);
                let now = self.now_ms();
                if idx.objects.get(&it.from).is_none_or(|h| h.version != it.from_version) {
                    continue;
                }
                // The master dropped what it had under the new name (drops come first);
                // anything left there is older than the renamed object.
                let stale = idx.remove(&it.to).filter(|o| o.nvme.is_some()).map(|o| o.version);
                sync_policy(&mut policy, &it.to, None, now);
                let Some(mut h) = idx.objects.remove(&it.from) else { continue };
                sync_policy(&mut policy, &it.from, None, now);
                h.version = it.version;
                h.renamed_from = Some((it.from.clone(), it.from_version));
                if writeback_after_rename(&h) {
                    h.queued = false;
                    lazy.push(it.to.clone());
                }
                let nvme_copy = h.nvme.is_some();
                sync_policy(&mut policy, &it.to, Some(&h), now);
                idx.objects.insert(it.to.clone(), h);
                (nvme_copy, stale)
            };
            let Some(nvme) = self.tiers.nvme.clone() else { continue };
            if let Some(version) = stale {
                remove_nvme_version(&nvme, &it.to, version).await;
            }
            if nvme_copy {
                let opts =
                    kvfs_tiers::RenameOptions { version: it.version, mode: PutMode::Overwrite };
                if let Err(e) = nvme.rename(&it.from, &it.to, opts).await {
                    // The index names a copy the disk does not have under the new name: drop
                    // it here; the master learns it when the copy is next moved or reported.
                    tracing::error!(from = %it.from, to = %it.to, error = %e, "NVMe copy not renamed; dropped");
                    lock(&self.index).clear_nvme(&it.to);
                    remove_nvme_version(&nvme, &it.from, it.from_version).await;
                }
            }
        }
        if !lazy.is_empty() && self.tiers.writeback.is_some() {
            let inner = self.clone();
            tokio::spawn(async move { inner.enqueue_writebacks(lazy).await });
        }
    }

    /// `Drop` records: the master no longer counts these copies. One hold of the index and
    /// policy locks for the batch, as in `commit`.
    /// Counts a commit a writer recorded here itself (the master sent no record for it).
    pub(super) fn count_writer_commit(&self) {
        self.tiers.counters.writer_commits.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn drop_copies(&self, items: Vec<DropItem>) {
        let mut nvme_files = Vec::new();
        let now = self.now_ms();
        {
            let mut idx = lock(&self.index);
            let mut policy = lock(&self.tiers.policy);
            for DropItem { key, segment, offset, version: dropped, .. } in items {
                let Some(h) = idx.objects.get(&key) else { continue };
                let version = h.version;
                if version > dropped {
                    // A newer commit of the key (recorded by a writer in this process before
                    // the master's older drop arrived): the drop meant the copy it replaced.
                    continue;
                }
                if segment == DRAM_SEGMENT && h.dram == Some(offset) {
                    idx.set_dram(&key, None);
                } else if segment == HBM_SEGMENT && h.hbm == Some(offset) {
                    idx.set_hbm(&key, None);
                } else if segment == NVME_SEGMENT && h.nvme == Some(offset) {
                    idx.clear_nvme(&key);
                    nvme_files.push((key.clone(), version));
                } else {
                    continue;
                }
                idx.remove_if_empty(&key);
                sync_policy(&mut policy, &key, idx.objects.get(&key), now);
            }
        }
        if let Some(nvme) = self.tiers.nvme.clone().filter(|_| !nvme_files.is_empty()) {
            tokio::spawn(async move {
                for (key, version) in nvme_files {
                    remove_nvme_version(&nvme, &key, version).await;
                }
            });
        }
    }

    /// A DRAM range of the segment, checked against its length.
    fn dram_range(&self, offset: u64, size: u64) -> std::result::Result<*mut u8, WireError> {
        let end = offset.checked_add(size).filter(|e| *e <= self.dram.len() as u64);
        if end.is_none() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("range {offset}+{size} is outside the {}-byte segment", self.dram.len()),
            ));
        }
        // The offset is inside the buffer (checked above).
        Ok(self.dram.as_ptr().wrapping_add(offset as usize))
    }

    /// `Persist`: write pending eager objects to the object store.
    pub(super) async fn persist(&self, items: Vec<PersistItem>) -> Vec<ItemResult<[u8; 32]>> {
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            out.push(self.persist_one(&it).await);
        }
        out
    }

    async fn persist_one(&self, it: &PersistItem) -> ItemResult<[u8; 32]> {
        let Some(store) = &self.tiers.object_store else {
            return Err(WireError::new(ErrorCode::Unavailable, "this node has no object store"));
        };
        let mut bytes = vec![0u8; it.size as usize];
        match (it.segment, &self.hbm) {
            (DRAM_SEGMENT, _) => {
                let p = self.dram_range(it.offset, it.size)?;
                // SAFETY: the range lies in the segment (checked); the master allocated it to
                // the put being ended, whose writer finished writing before asking to end it.
                bytes.copy_from_slice(unsafe { std::slice::from_raw_parts(p, it.size as usize) });
            }
            (HBM_SEGMENT, Some(block)) => {
                block.read(it.offset, &mut bytes).map_err(|e| wire(&e))?
            }
            // An offload job persisting an object only this node's NVMe tier holds.
            (NVME_SEGMENT, _) if self.tiers.nvme.is_some() => {
                let nvme = self.tiers.nvme.as_ref().expect("checked");
                let held = lock(&self.index).objects.get(&it.key).map(|h| (h.version, h.nvme));
                if held != Some((it.version, Some(it.offset))) {
                    return Err(WireError::new(
                        ErrorCode::NotFound,
                        "this node holds no NVMe copy of that version there",
                    ));
                }
                let meta = nvme.get_into(&it.key, &mut bytes).await.map_err(|e| wire(&e))?;
                if meta.version != it.version {
                    return Err(WireError::new(
                        ErrorCode::NotFound,
                        "the NVMe copy is another version",
                    ));
                }
            }
            _ => {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    "persist from a segment this node does not have",
                ));
            }
        }
        let opts = PutOptions {
            mode: PutMode::Overwrite,
            persistence: kvfs_tiers::Persistence::Eager,
            checksum: it.checksum,
            version: it.version,
            pin: it.pin.code(),
        };
        // A copy of a renamed object names its previous name, as a write-back's does, so a
        // late upload under the old name cannot come back after a crash.
        let previous = lock(&self.index)
            .objects
            .get(&it.key)
            .filter(|h| h.version == it.version)
            .and_then(|h| h.renamed_from.clone());
        let previous = previous.as_ref().map(|(k, v)| (k.as_str(), *v));
        let meta =
            store.put_with_previous(&it.key, &bytes, opts, previous).await.map_err(|e| wire(&e))?;
        self.tiers.counters.eager_persisted.fetch_add(1, Ordering::Relaxed);
        // A committed object (an offload job's, not a pending eager put): its tier policy may
        // now drop the NVMe copy, and write-back has nothing left to do.
        if let Some(h) = lock(&self.index).objects.get_mut(&it.key)
            && h.version == it.version
        {
            h.persisted = true;
            h.checksum.get_or_insert(meta.checksum);
        }
        Ok(meta.checksum)
    }

    /// `Load`: fill DRAM ranges from NVMe or the object store, verified.
    pub(super) async fn load(&self, items: Vec<LoadItem>) -> Vec<ItemResult<[u8; 32]>> {
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            out.push(self.load_one(&it).await);
        }
        out
    }

    async fn load_one(&self, it: &LoadItem) -> ItemResult<[u8; 32]> {
        if matches!(it.source, Tier::Hbm | Tier::Dram) {
            return self.move_in(it).await;
        }
        if it.segment != DRAM_SEGMENT {
            return Err(WireError::new(ErrorCode::InvalidArgument, "load into a non-DRAM segment"));
        }
        let p = self.dram_range(it.offset, it.size)?;
        // SAFETY: the range lies in the segment (checked); the master allocated it for this
        // load alone and attaches it as a replica only after we answer.
        let dst = unsafe { std::slice::from_raw_parts_mut(p, it.size as usize) };
        let unavailable =
            |what: &str| Err(WireError::new(ErrorCode::Unavailable, what.to_string()));
        let meta = match it.source {
            Tier::Nvme => {
                let Some(nvme) = &self.tiers.nvme else { return unavailable("no NVMe tier") };
                let m = nvme.stat(&it.key).await.map_err(|e| wire(&e))?;
                if m.version != it.version {
                    return Err(WireError::new(
                        ErrorCode::NotFound,
                        "the NVMe copy is another version",
                    ));
                }
                nvme.get_into(&it.key, dst).await.map_err(|e| wire(&e))?
            }
            Tier::ObjectStore => {
                let Some(store) = &self.tiers.object_store else {
                    return unavailable("no object store");
                };
                store.get_into(&it.key, dst).await.map_err(|e| wire(&e))?
            }
            other => {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!("load from {other:?}"),
                ));
            }
        };
        if meta.version != it.version || meta.size_bytes != it.size {
            return Err(WireError::new(ErrorCode::NotFound, "the stored copy is another version"));
        }
        if it.checksum.is_some_and(|c| c != meta.checksum) {
            return Err(WireError::new(ErrorCode::Corrupt, "the stored copy has another checksum"));
        }
        let h = {
            let mut idx = lock(&self.index);
            if idx.objects.get(&it.key).is_some_and(|h| h.version != it.version) {
                idx.remove(&it.key);
            }
            let h = idx
                .objects
                .entry(it.key.clone())
                .or_insert_with(|| Held::new(it.size, it.version, it.persistence, it.pin));
            h.checksum = Some(meta.checksum);
            h.persisted |= it.source == Tier::ObjectStore;
            idx.set_dram(&it.key, Some(it.offset));
            idx.objects.get(&it.key).cloned()
        };
        self.policy_sync(&it.key, h.as_ref());
        lock(&self.tiers.policy).on_access(&it.key, self.now_ms());
        let c = &self.tiers.counters;
        c.promotions.fetch_add(1, Ordering::Relaxed);
        c.promoted_bytes.fetch_add(it.size, Ordering::Relaxed);
        Ok(meta.checksum)
    }

    /// A move's copy (a `Load` whose source is this node's copy in one memory tier): copy it
    /// into the range the master allocated in the other (HBM -> DRAM, DRAM -> HBM) and hold
    /// it there; answers the object's blake3 (known, or hashed from the host-side bytes).
    ///
    /// The copy (and a hash, when the checksum is not known) runs on a blocking thread: a large
    /// object's copy across PCIe takes milliseconds that would stall a runtime worker.
    async fn move_in(&self, it: &LoadItem) -> ItemResult<[u8; 32]> {
        let err = |code, what: String| Err(WireError::new(code, what));
        let (from_seg, to_seg) = if it.source == Tier::Hbm {
            (HBM_SEGMENT, DRAM_SEGMENT)
        } else {
            (DRAM_SEGMENT, HBM_SEGMENT)
        };
        if it.segment != to_seg {
            let what =
                format!("a move from {:?} fills segment {to_seg}, not {}", it.source, it.segment);
            return err(ErrorCode::InvalidArgument, what);
        }
        let Some(block) = &self.hbm else {
            return err(ErrorCode::Unavailable, "this node has no HBM segment".into());
        };
        let held =
            lock(&self.index).objects.get(&it.key).filter(|h| h.version == it.version).and_then(
                |h| {
                    let from = if from_seg == HBM_SEGMENT { h.hbm } else { h.dram };
                    from.map(|off| (off, h.checksum))
                },
            );
        let Some((from, checksum)) = held else {
            let what = format!("this node holds no {:?} copy of that version", it.source);
            return err(ErrorCode::NotFound, what);
        };
        let size = it.size as usize;
        let host_off = if to_seg == DRAM_SEGMENT { it.offset } else { from };
        self.dram_range(host_off, it.size)?;
        let (block, dram, to) = (block.clone(), self.dram.clone(), it.offset);
        let copy = move || -> ItemResult<[u8; 32]> {
            // Inside the segment (checked above), which `dram` keeps alive.
            let host = dram.as_ptr().wrapping_add(host_off as usize);
            // The block checks its own side of the copy.
            if to_seg == DRAM_SEGMENT {
                // SAFETY: the range lies in the segment (checked); the master allocated it for
                // this move alone and attaches it only after we answer.
                let dst = unsafe { std::slice::from_raw_parts_mut(host, size) };
                block.read(from, dst).map_err(|e| wire(&e))?;
            } else {
                // SAFETY: our committed DRAM copy; if the master drops and reuses it meanwhile,
                // it refuses to attach what we copied (the source is no longer a replica).
                let src = unsafe { std::slice::from_raw_parts(host, size) };
                block.write(to, src).map_err(|e| wire(&e))?;
            }
            Ok(checksum.unwrap_or_else(|| {
                // SAFETY: as above: the host side of the copy, read only.
                kvfs_tiers::checksum(unsafe { std::slice::from_raw_parts(host, size) })
            }))
        };
        let sum = tokio::task::spawn_blocking(copy).await.map_err(|e| {
            WireError::new(ErrorCode::Internal, format!("the move's copy did not finish: {e}"))
        })??;
        let h = {
            let mut idx = lock(&self.index);
            if idx.objects.get(&it.key).is_some_and(|h| h.version == it.version) {
                if to_seg == DRAM_SEGMENT {
                    idx.set_dram(&it.key, Some(it.offset));
                } else {
                    idx.set_hbm(&it.key, Some(it.offset));
                }
            }
            idx.objects.get(&it.key).cloned()
        };
        self.policy_sync(&it.key, h.as_ref());
        let c = &self.tiers.counters;
        let n = if to_seg == DRAM_SEGMENT { &c.hbm_demotions } else { &c.hbm_promotions };
        n.fetch_add(1, Ordering::Relaxed);
        Ok(sum)
    }

    /// The reads the master saw of our objects: the policy's access signal.
    pub(super) fn on_accessed(&self, accessed: Vec<(String, u32)>) {
        let now = self.now_ms();
        let mut p = lock(&self.tiers.policy);
        for (key, n) in accessed {
            for _ in 0..n.min(16) {
                p.on_access(&key, now);
            }
        }
    }

    /// One read this node served itself (a guarded read): the same access signal.
    pub(super) fn on_served_read(&self, key: &str) {
        let now = self.now_ms();
        lock(&self.tiers.policy).on_access(key, now);
    }

    /// The node's counters. Each lock is taken and let go in its own statement: a guard made
    /// inside the struct expression below would live to its end, and one there held the
    /// policy lock while it waited for the index lock, the reverse of `commit`'s order (the
    /// heartbeat and a commit deadlocked the node, which the master then expired).
    pub(super) fn stats(&self) -> NodeStats {
        let (dram_used, hbm_used) = {
            let idx = lock(&self.index);
            (idx.dram_bytes, idx.hbm_bytes)
        };
        let rate_limited_rounds = lock(&self.tiers.policy).stats().rate_limited_rounds;
        let nvme_objects = self.tiers.nvme.as_ref().map(|n| n.stats().objects as u64).unwrap_or(0);
        let c = &self.tiers.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let nvme = self.tiers.nvme.as_ref();
        NodeStats {
            dram_capacity_bytes: self.dram.len() as u64,
            dram_used_bytes: dram_used,
            nvme_capacity_bytes: nvme.and_then(|n| n.capacity_bytes()).unwrap_or(0),
            nvme_used_bytes: nvme.map(|n| n.used_bytes()).unwrap_or(0),
            nvme_objects,
            demotions: load(&c.demotions),
            demoted_bytes: load(&c.demoted_bytes),
            promotions: load(&c.promotions),
            promoted_bytes: load(&c.promoted_bytes),
            nvme_drops: load(&c.nvme_drops),
            rate_limited_rounds,
            corrupt_reads_nvme: nvme.map(|n| n.stats().corrupt_reads).unwrap_or(0),
            corrupt_reads_object_store: self
                .tiers
                .object_store
                .as_ref()
                .map(|s| s.corrupt_reads())
                .unwrap_or(0),
            writeback_queued: self
                .tiers
                .writeback
                .as_ref()
                .map(|q| q.depth().0 as u64)
                .unwrap_or(0),
            writeback_persisted: load(&c.writeback_persisted),
            writeback_failed: load(&c.writeback_failed),
            eager_persisted: load(&c.eager_persisted),
            writer_commits: load(&c.writer_commits),
            hbm_available: self.tiers.hbm_available,
            hbm_capacity_bytes: self.hbm.as_ref().map_or(0, |b| b.len()),
            hbm_used_bytes: hbm_used,
            hbm_demotions: load(&c.hbm_demotions),
            hbm_promotions: load(&c.hbm_promotions),
            te_requests: self.engine.requests_served(),
            runtime_stalls: self.watch.as_ref().map_or(0, |w| w.stalls()),
        }
    }

    pub(super) fn local_object_file(&self, key: &str) -> Option<(std::fs::File, u64)> {
        let nvme = self.tiers.nvme.as_ref()?;
        let version = lock(&self.index).objects.get(key).filter(|h| h.nvme.is_some())?.version;
        match nvme.local_file(key) {
            Ok((f, meta)) if meta.version == version => Some((f, meta.size_bytes)),
            Ok(_) => None,
            Err(e) => {
                if e.kind() == kvfs_tiers::ErrorKind::Corrupt {
                    tracing::warn!(key, error = %e, "corrupt NVMe copy not handed out");
                }
                None
            }
        }
    }

    // ----- lazy persistence ---------------------------------------------------------------

    /// Enqueue lazy objects for write-back; a full queue leaves them for the next round.
    async fn enqueue_writebacks(&self, keys: Vec<String>) {
        let Some(q) = &self.tiers.writeback else { return };
        let mut rest = keys.into_iter();
        while let Some(key) = rest.next() {
            let Some(h) = lock(&self.index).objects.get(&key).cloned() else { continue };
            if h.persisted || h.queued {
                continue;
            }
            let checksum = match h.checksum {
                Some(c) => c,
                None => match self.hash_copy(&key, &h).await {
                    Some(c) => c,
                    // The copy moved while it was hashed (demoted: its NVMe copy has a
                    // checksum) or was replaced (the new version's commit enqueues it):
                    // the next round looks again.
                    None => {
                        lock(&self.tiers.backlog).insert(key);
                        continue;
                    }
                },
            };
            let meta = ObjectMeta {
                size_bytes: h.size,
                checksum,
                persistence: kvfs_tiers::Persistence::Lazy,
                stored_at_unix_ms: 0,
                version: h.version,
                pin: h.pin.code(),
            };
            {
                let mut idx = lock(&self.index);
                match idx.objects.get_mut(&key) {
                    Some(cur) if cur.version == h.version && !cur.queued => {
                        cur.queued = true;
                        cur.checksum = Some(checksum);
                    }
                    _ => continue,
                }
            }
            let previous = h.renamed_from.as_ref().map(|(k, v)| (k.as_str(), *v));
            if let Err(e) = q.enqueue_meta(&key, &meta, previous).await {
                if let Some(cur) = lock(&self.index).objects.get_mut(&key) {
                    cur.queued = false;
                }
                tracing::debug!(key, error = %e, "write-back enqueue refused; retried later");
                let mut backlog = lock(&self.tiers.backlog);
                backlog.insert(key);
                if e.kind() == kvfs_tiers::ErrorKind::Busy {
                    backlog.extend(rest);
                    return;
                }
            }
        }
    }

    /// blake3 of the object's DRAM copy (NVMe copies always have one).
    async fn hash_copy(&self, key: &str, h: &Held) -> Option<[u8; 32]> {
        let off = h.dram?;
        let mut bytes = vec![0u8; h.size as usize];
        self.dram.read_at(off as usize, &mut bytes).ok()?;
        let sum = tokio::task::spawn_blocking(move || kvfs_tiers::checksum(&bytes)).await.ok()?;
        // Still the same copy (not dropped and reused while we hashed)?
        let same = lock(&self.index)
            .objects
            .get(key)
            .is_some_and(|c| c.dram == Some(off) && c.version == h.version);
        same.then_some(sum)
    }

    /// Lazy objects whose enqueue was refused (the queue was full): at most 64 a round.
    async fn retry_writebacks(&self) {
        let keys: Vec<String> = {
            let mut backlog = lock(&self.tiers.backlog);
            std::iter::from_fn(|| backlog.pop_first()).take(64).collect()
        };
        if !keys.is_empty() {
            self.enqueue_writebacks(keys).await;
        }
    }

    /// Reports of finished write-backs the master did not take: at most 64 a round, in one
    /// call (a master still away costs the round one timeout), each while the node still holds
    /// that version (a newer version has its own write-back).
    async fn retry_reports(&self, link: &MasterLink) {
        let taken: Vec<(String, u64)> = {
            let mut pending = lock(&self.tiers.unreported);
            std::iter::from_fn(|| pending.pop_first()).take(64).collect()
        };
        let items: Vec<(String, u64)> = {
            let idx = lock(&self.index);
            taken
                .into_iter()
                .filter(|(k, v)| idx.objects.get(k).is_some_and(|h| h.version == *v))
                .collect()
        };
        if items.is_empty() {
            return;
        }
        let req = MasterRequest::ReportReplicas {
            node: self.id,
            items: items.iter().map(|(k, v)| persisted_report(k, *v)).collect(),
        };
        let answers = match link.call("report", &req).await {
            Ok(MasterResponse::ReportReplicas(v)) if v.len() == items.len() => v,
            other => {
                tracing::debug!(reports = items.len(), answer = ?other.err(), "write-back reports failed again");
                lock(&self.tiers.unreported).extend(items);
                return;
            }
        };
        for ((key, version), answer) in items.into_iter().zip(answers) {
            match answer {
                Ok(_) => drop(self.writeback_settled(&key, version, true)),
                Err(e) => {
                    tracing::debug!(key, error = %e.message, "write-back report refused on retry")
                }
            }
        }
    }

    /// A write-back of `key` at `version` is over (no longer queued), its copy persisted if
    /// the master took its report; the policy learns of it. Returns the entry now held.
    fn writeback_settled(&self, key: &str, version: u64, persisted: bool) -> Option<Held> {
        let h = {
            let mut idx = lock(&self.index);
            if let Some(h) = idx.objects.get_mut(key).filter(|h| h.version == version) {
                h.queued = false;
                h.persisted |= persisted;
            }
            idx.objects.get(key).cloned()
        };
        self.policy_sync(key, h.as_ref());
        h
    }

    // ----- tier moves ---------------------------------------------------------------------

    async fn report(&self, link: &MasterLink, item: ReplicaReport) -> Result<ReportOutcome> {
        let req = MasterRequest::ReportReplicas { node: self.id, items: vec![item] };
        match link.call("report", &req).await? {
            MasterResponse::ReportReplicas(mut v) if v.len() == 1 => {
                v.pop().expect("one").map_err(|e| Error::from_wire("report", &e))
            }
            other => Err(Error::new(
                ErrorKind::Internal,
                "report",
                format!("unexpected answer {other:?}"),
            )),
        }
    }

    /// Mark `key` busy for a move; returns its entry then.
    fn claim(&self, key: &str) -> Option<Held> {
        let mut idx = lock(&self.index);
        let h = idx.objects.get_mut(key).filter(|h| !h.busy)?;
        h.busy = true;
        Some(h.clone())
    }

    fn release(&self, key: &str, version: u64) {
        let h = {
            let mut idx = lock(&self.index);
            if let Some(h) = idx.objects.get_mut(key).filter(|h| h.version == version) {
                h.busy = false;
            }
            idx.remove_if_empty(key);
            idx.objects.get(key).cloned()
        };
        self.policy_sync(key, h.as_ref());
    }

    async fn demote(&self, link: &MasterLink, key: &str) -> bool {
        let Some(snap) = self.claim(key) else { return false };
        let ok = match (&self.tiers.nvme, snap.hbm) {
            // Moved up to HBM, its DRAM copy kept by a read lease then: only that copy goes.
            (_, Some(_)) => self.release_copy(link, key, &snap, Tier::Dram).await,
            (Some(nvme), None) => self.demote_claimed(link, nvme, key, &snap).await,
            (None, None) => false,
        };
        self.release(key, snap.version);
        ok
    }

    /// HBM -> DRAM: the master allocates the DRAM range and has us copy into it, then the
    /// HBM copy is released (kept while a read lease protects it; asked again later).
    async fn demote_hbm(&self, link: &MasterLink, key: &str) -> bool {
        let Some(snap) = self.claim(key) else { return false };
        let ok = snap.hbm.is_some()
            && (snap.dram.is_some()
                || self.move_copy(link, key, &snap, (Tier::Hbm, Tier::Dram)).await)
            && self.release_copy(link, key, &snap, Tier::Hbm).await;
        self.release(key, snap.version);
        ok
    }

    /// DRAM -> HBM (an object put into HBM, demoted, and hot again): the mirror image of
    /// [`demote_hbm`](Self::demote_hbm). A DRAM copy a read lease keeps is released later by
    /// the policy's DRAM demotions.
    async fn promote_hbm(&self, link: &MasterLink, key: &str) -> bool {
        let Some(snap) = self.claim(key) else { return false };
        let ok = snap.dram.is_some()
            && snap.hbm.is_none()
            && self.move_copy(link, key, &snap, (Tier::Dram, Tier::Hbm)).await;
        if ok {
            self.release_copy(link, key, &snap, Tier::Dram).await;
        }
        self.release(key, snap.version);
        ok
    }

    /// Ask the master to copy our `from` copy of `key` into our `to` tier (it allocates the
    /// range and sends the `Load` that [`move_in`](Self::move_in) answers).
    async fn move_copy(
        &self,
        link: &MasterLink,
        key: &str,
        snap: &Held,
        (from, to): (Tier, Tier),
    ) -> bool {
        let item = MoveItem { key: key.into(), version: snap.version, from, to };
        let req = MasterRequest::Move { node: self.id, items: vec![item] };
        let e = match link.call("move", &req).await {
            Ok(MasterResponse::Move(v)) => match v.into_iter().next() {
                Some(Ok(())) => return true,
                Some(Err(e)) => e.message,
                None => "an empty answer".into(),
            },
            Ok(other) => format!("unexpected answer {other:?}"),
            Err(e) => e.to_string(),
        };
        tracing::debug!(key, ?from, ?to, error = %e, "tier move refused");
        // Whatever refused it (no room in the other tier, the object changing), asking again
        // at once would only be refused again.
        lock(&self.tiers.policy).defer(key, self.now_ms() + MOVE_RETRY_MS);
        false
    }

    /// Report the release of our `tier` memory copy of `key` (another copy exists): forgotten
    /// here once the master agreed; a refusal (a read lease, a last copy) defers the key.
    async fn release_copy(&self, link: &MasterLink, key: &str, snap: &Held, tier: Tier) -> bool {
        let (segment, offset) = match tier {
            Tier::Hbm => (HBM_SEGMENT, snap.hbm),
            _ => (DRAM_SEGMENT, snap.dram),
        };
        let Some(offset) = offset else { return false };
        let remove = Some(ReplicaLoc::Node { tier, segment, offset });
        let item = ReplicaReport {
            key: key.into(),
            version: snap.version,
            checksum: None,
            add: None,
            remove,
        };
        let outcome = self.report(link, item).await;
        self.defer_refused(key, &outcome);
        let removed = matches!(outcome, Ok(o) if o.removed);
        if removed {
            self.forget_copy(key, snap.version, segment, offset);
        }
        removed
    }

    async fn demote_claimed(
        &self,
        link: &MasterLink,
        nvme: &NvmeMedium,
        key: &str,
        snap: &Held,
    ) -> bool {
        let Some(dram_off) = snap.dram else { return false };
        if snap.nvme.is_some() {
            // Already on NVMe (a promoted copy): only the DRAM copy goes.
            return self.release_copy(link, key, snap, Tier::Dram).await;
        }
        let remove =
            Some(ReplicaLoc::Node { tier: Tier::Dram, segment: DRAM_SEGMENT, offset: dram_off });
        let Ok(nvme_off) = lock(&self.index).nvme_alloc.alloc(snap.size) else { return false };
        let free_off = |inner: &Self| lock(&inner.index).nvme_alloc.free(nvme_off, snap.size);
        let Ok(p) = self.dram_range(dram_off, snap.size) else {
            free_off(self);
            return false;
        };
        // SAFETY: the range is the committed DRAM copy of `key`; the master reuses it only
        // after dropping the replica, and then refuses this demotion's report (the source is
        // no longer a replica), so bytes read after a reuse are never kept.
        let bytes = unsafe { std::slice::from_raw_parts(p, snap.size as usize) };
        let opts = PutOptions {
            mode: PutMode::Overwrite,
            persistence: persistence_code(snap.persistence),
            checksum: snap.checksum,
            version: snap.version,
            pin: snap.pin.code(),
        };
        let meta = match nvme.put(key, bytes, opts).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(key, error = %e, "demotion: NVMe write failed");
                free_off(self);
                return false;
            }
        };
        let item = ReplicaReport {
            key: key.into(),
            version: snap.version,
            checksum: snap.checksum.is_none().then_some(meta.checksum),
            add: Some(ReplicaLoc::Node {
                tier: Tier::Nvme,
                segment: NVME_SEGMENT,
                offset: nvme_off,
            }),
            remove,
        };
        let outcome = self.report(link, item).await;
        let kept = {
            let mut idx = lock(&self.index);
            match (&outcome, idx.objects.get_mut(key)) {
                (Ok(o), Some(h)) if o.added && h.version == snap.version && h.nvme.is_none() => {
                    h.nvme = Some(nvme_off);
                    h.checksum = Some(meta.checksum);
                    true
                }
                _ => false,
            }
        };
        if !kept {
            if let Err(e) = &outcome {
                tracing::debug!(key, error = %e, "demotion refused; NVMe copy removed");
                if e.kind() == ErrorKind::QuotaExceeded {
                    // Its tenant is at its NVMe quota: do not copy it again for a while.
                    lock(&self.tiers.policy).defer(key, self.now_ms() + QUOTA_RETRY_MS);
                }
            }
            free_off(self);
            remove_nvme_version(nvme, key, snap.version).await;
            return false;
        }
        let c = &self.tiers.counters;
        c.demotions.fetch_add(1, Ordering::Relaxed);
        c.demoted_bytes.fetch_add(snap.size, Ordering::Relaxed);
        self.defer_refused(key, &outcome);
        let removed = matches!(outcome, Ok(o) if o.removed);
        if removed {
            self.forget_copy(key, snap.version, DRAM_SEGMENT, dram_off);
        }
        removed
    }

    /// A refused remove says when to ask again: keep the key out of the policy until then.
    fn defer_refused(&self, key: &str, outcome: &Result<ReportOutcome>) {
        if let Ok(o) = outcome
            && !o.removed
            && o.retry_after_ms > 0
        {
            lock(&self.tiers.policy).defer(key, self.now_ms() + o.retry_after_ms);
        }
    }

    /// Forget our memory copy of `key` in `segment` (DRAM or HBM) at `offset`, if the index
    /// still names that copy of that version.
    fn forget_copy(&self, key: &str, version: u64, segment: u32, offset: u64) {
        let mut idx = lock(&self.index);
        let Some(h) = idx.objects.get(key).filter(|h| h.version == version) else { return };
        if segment == HBM_SEGMENT && h.hbm == Some(offset) {
            idx.set_hbm(key, None);
        } else if segment == DRAM_SEGMENT && h.dram == Some(offset) {
            idx.set_dram(key, None);
        }
    }

    async fn drop_nvme(&self, link: &MasterLink, key: &str) -> bool {
        let Some(nvme) = self.tiers.nvme.clone() else { return false };
        let Some(snap) = self.claim(key) else { return false };
        let ok = match snap.nvme {
            Some(off) => {
                let item = ReplicaReport {
                    key: key.into(),
                    version: snap.version,
                    checksum: None,
                    add: None,
                    remove: Some(ReplicaLoc::Node {
                        tier: Tier::Nvme,
                        segment: NVME_SEGMENT,
                        offset: off,
                    }),
                };
                let outcome = self.report(link, item).await;
                self.defer_refused(key, &outcome);
                let removed = matches!(outcome, Ok(o) if o.removed);
                if removed {
                    let cleared = {
                        let mut idx = lock(&self.index);
                        let ours = idx
                            .objects
                            .get(key)
                            .is_some_and(|h| h.version == snap.version && h.nvme == Some(off));
                        ours && idx.clear_nvme(key).is_some()
                    };
                    if cleared {
                        remove_nvme_version(&nvme, key, snap.version).await;
                    }
                    self.tiers.counters.nvme_drops.fetch_add(1, Ordering::Relaxed);
                }
                removed
            }
            None => false,
        };
        self.release(key, snap.version);
        ok
    }

    async fn promote(&self, link: &MasterLink, key: &str) -> bool {
        let req = MasterRequest::Promote { node: self.id, keys: vec![key.to_string()] };
        matches!(link.call("promote", &req).await, Ok(MasterResponse::Promote(v)) if v.first().is_some_and(|r| r.is_ok()))
    }

    /// One round of the tier manager.
    async fn round(&self, link: &MasterLink) {
        self.retry_writebacks().await;
        self.retry_reports(link).await;
        if self.tiers.nvme.is_none() && self.hbm.is_none() {
            return;
        }
        let (dram_used, hbm_used) = {
            let idx = lock(&self.index);
            (idx.dram_bytes, idx.hbm_bytes)
        };
        let usage = Usage {
            hbm: TierUsage {
                used_bytes: hbm_used,
                capacity_bytes: self.hbm.as_ref().map_or(0, |b| b.len()),
            },
            dram: TierUsage { used_bytes: dram_used, capacity_bytes: self.dram.len() as u64 },
            nvme: self.tiers.nvme.as_ref().map_or_else(TierUsage::default, |n| TierUsage {
                used_bytes: n.used_bytes(),
                capacity_bytes: n.capacity_bytes().unwrap_or(0),
            }),
        };
        let actions = lock(&self.tiers.policy).decide(self.now_ms(), usage);
        for a in actions {
            let ok = match &a {
                Action::Demote { key, from: PTier::Hbm, .. } => self.demote_hbm(link, key).await,
                Action::Demote { key, .. } => self.demote(link, key).await,
                Action::Drop { key, .. } => self.drop_nvme(link, key).await,
                Action::Promote { key, to: PTier::Hbm, .. } => self.promote_hbm(link, key).await,
                Action::Promote { key, .. } => self.promote(link, key).await,
            };
            lock(&self.tiers.policy).on_action_done(&a, ok);
            // The policy's view of where the object is now follows the index.
            let h = lock(&self.index).objects.get(a.key()).cloned();
            self.policy_sync(a.key(), h.as_ref());
        }
    }
}

/// The tier manager's timer: a round every `tick_ms` while registered.
async fn rounds(inner: Arc<Inner>, link: Arc<MasterLink>) {
    let mut every = tokio::time::interval(Duration::from_millis(inner.cfg.tiers.tick_ms.max(5)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if *inner.registered.borrow() {
            inner.round(&link).await;
        }
    }
}

/// The report of `key` at `version` written back to the object store.
fn persisted_report(key: &str, version: u64) -> ReplicaReport {
    ReplicaReport {
        key: key.to_owned(),
        version,
        checksum: None,
        add: Some(ReplicaLoc::ObjectStore),
        remove: None,
    }
}

/// Reports finished write-backs to the master.
async fn writeback_events(
    inner: Arc<Inner>,
    link: Arc<MasterLink>,
    mut rx: mpsc::UnboundedReceiver<WritebackEvent>,
) {
    while let Some(ev) = rx.recv().await {
        match ev {
            WritebackEvent::Persisted { key, version, .. } => {
                inner.tiers.counters.writeback_persisted.fetch_add(1, Ordering::Relaxed);
                // The copy counts as persisted here only once the master took the report: a
                // rename that arrives before must still find the object unpersisted, so it
                // queues a write-back under the new name (the master, not knowing the copy,
                // does not move it, and the report then fails as the old name is gone). A
                // report the master did not take (unreachable, timed out) is made again each
                // round (`retry_reports`): until then a live master would not know the object
                // is safe in the object store.
                let report = inner.report(&link, persisted_report(&key, version)).await;
                let refused = matches!(&report, Err(e) if e.kind() == ErrorKind::NotFound);
                let h = inner.writeback_settled(&key, version, report.is_ok());
                match report {
                    Err(_) if refused => {
                        // Removed or renamed while it was uploaded: the copy is nobody's, and
                        // a scan after a restart must not bring the old name back.
                        let ours = h.as_ref().is_some_and(|h| h.version == version);
                        if let Some(store) = inner.tiers.object_store.clone().filter(|_| !ours)
                            && store.stat(&key).await.is_ok_and(|m| m.version == version)
                            && let Err(e) = store.remove(&key).await
                        {
                            tracing::warn!(key, error = %e, "stale write-back not deleted");
                        }
                    }
                    // Unreachable, timed out, no leader: made again each round.
                    Err(e) if e.kind() == ErrorKind::Unavailable => {
                        tracing::warn!(key, error = %e, "write-back report not taken; retried");
                        lock(&inner.tiers.unreported).insert(key, version);
                    }
                    // Refused (another version now): the next version has its own write-back.
                    Err(e) => tracing::debug!(key, error = %e, "write-back report refused"),
                    Ok(_) => {}
                }
            }
            WritebackEvent::Failed { key, error, .. } => {
                inner.tiers.counters.writeback_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key, %error, "write-back failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unpersisted_lazy_copy_is_written_back_after_a_rename() {
        let lazy = |queued: bool, persisted: bool| {
            let mut h = Held::new(10, 1, Persistence::Lazy, kvfs_proto::store::Pin::None);
            (h.queued, h.persisted) = (queued, persisted);
            h
        };
        // Queued under the old name, and not queued yet (its enqueue still to run).
        assert!(writeback_after_rename(&lazy(true, false)));
        assert!(writeback_after_rename(&lazy(false, false)));
        // Already in the object store (the master moves that copy), or never to be.
        assert!(!writeback_after_rename(&lazy(false, true)));
        for p in [Persistence::None, Persistence::Eager] {
            let h = Held::new(10, 1, p, kvfs_proto::store::Pin::None);
            assert!(!writeback_after_rename(&h));
        }
    }
}
