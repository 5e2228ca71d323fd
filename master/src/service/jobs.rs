//! Jobs the master owns: `offload` (persist every object under a prefix to the object store;
//! with `--move`, then drop its pool copies) and `restore` (load every object under a prefix
//! that no memory replica holds back into DRAM).
//!
//! A job is the master's, not its caller's: the CLI that started it may go, and the job runs
//! on; a master that restarts (or takes over, HA) resumes every job that was running.
//!
//! Mechanism:
//! - **Membership.** A job covers the objects under its prefix whose version is at most the
//!   directory's version when it started (`bound`; versions grow with the wall clock, across
//!   restarts too). An object written or replaced later has a higher version and is not in the
//!   job; one removed or replaced meanwhile counts as `gone`. So an object is in the job or
//!   not, never half.
//! - **Walk.** The job lists its prefix in key order, a page of `PAGE` objects at a time, and
//!   runs each page's objects with at most `concurrency` in flight, paced to
//!   `rate_bytes_per_s`. When a page is done its last key becomes the cursor, and the cursor
//!   with the counters up to it is the *checkpoint*, written to the object store
//!   (`jobs/ID.json`, beside the objects) at most every `CHECKPOINT_MS` and at the end.
//! - **Offload of one object.** Under one directory lock: the object is looked up, its version
//!   checked, and a read lease taken (its ranges are not reused while the node reads them).
//!   If the object store already holds that version (the directory says so, or the bucket
//!   does: a write a killed master never heard of) it is recorded and counted `already`.
//!   Otherwise a node holding a copy (memory first, then NVMe) writes it to the object store
//!   (`NodeRequest::Persist`, checked against the object's blake3 where known), and the copy
//!   is recorded with `report_replica` (refused if the object changed meanwhile: the stale
//!   copy is deleted). A node that fails is followed by the next copy's node; after every copy
//!   failed, the object is tried again (at most `ATTEMPTS` times, `RETRY_MS` apart: a killed
//!   node's copies leave the directory after its disconnect grace).
//! - **`--move`.** A persisted object's pool copies are dropped
//!   (`Directory::release_to_object_store`), refused while a read lease is live (the job's own
//!   lease too): such objects wait in a queue retried every `RETRY_MS` until their lease ends
//!   (the queue is part of the checkpoint, so a resumed job still drops them); hard-pinned
//!   objects (and any still leased `MOVE_WAIT_MS` past the lease TTL after the walk) are `kept`.
//! - **Restore of one object.** An object without a memory replica is loaded into DRAM the way
//!   a get loads it (`tiers::load_dedup`: its NVMe copy first, then the object store).
//! - **Resumption.** At start the master reads the job records and runs every job that was
//!   running, once its object-store scan is over and the recovery grace has passed (nodes
//!   report what they hold; a new job waits only for a recovery under way, as puts do),
//!   from its checkpoint. The objects between the checkpoint and the crash are visited again:
//!   persisted ones are found in the object store (`already`: never written twice), and the
//!   counters are the checkpoint's, so every object is counted once.
//!
//! Limits: at most `RUNNING_MAX` jobs run at once; `KEEP_MAX` ended jobs are kept (older
//! records are deleted); `concurrency` is 1..=256; the first 16 errors are kept.
//!
//! Not handled: jobs without an object store (refused); a job's progress between checkpoints
//! is redone after a master crash (at most `CHECKPOINT_MS` of work plus one page).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_proto::store::{
    self as w, ErrorCode, JobKind, JobSpec, JobState, JobStatus, NodeRequest, WireError,
};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::{State, convert, deliver, now_ms, tiers};
use crate::{ErrorKind, Location, Tier};

/// Objects per page of the walk (the unit of a checkpoint).
const PAGE: usize = 256;
/// A checkpoint is written at most this often while a job runs.
const CHECKPOINT_MS: u64 = 1_000;
/// Tries of one object before it counts as failed.
const ATTEMPTS: u32 = 5;
/// Pause between two tries of an object, and between two passes over the `--move` queue.
const RETRY_MS: u64 = 500;
/// The job's own lease on an object a node is reading, renewed every half of it.
const HOLD_MS: u64 = 2_000;
/// After the walk, `--move` waits at most this long (past the lease TTL) for leases to end.
const MOVE_WAIT_MS: u64 = 5_000;
/// A paced job looks for a cancel this often.
const CANCEL_POLL_MS: u64 = 100;
const RUNNING_MAX: usize = 16;
const KEEP_MAX: usize = 64;
const ERRORS_MAX: usize = 16;
const CONCURRENCY_MAX: u32 = 256;
const RECORDS: &str = "jobs/";

/// What the object store keeps of a job: its status at the checkpoint, the cursor, the bound.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    status: JobStatus,
    /// The last key of the walk whose page is done (`None`: from the start).
    cursor: Option<String>,
    /// Versions up to this are in the job.
    bound: u64,
    /// The walk is over (`--move` may still be draining its queue).
    walked: bool,
    /// `--move`: objects before the cursor, persisted, whose pool copies are still to drop
    /// (leased when the checkpoint was written); a resumed job drops them.
    #[serde(default)]
    evict: Vec<(String, u64)>,
}

struct Job {
    /// The live status (counters move between checkpoints).
    live: Mutex<JobStatus>,
    /// The last checkpoint.
    record: Mutex<Record>,
    cancel: AtomicBool,
}

#[derive(Default)]
pub(crate) struct JobMetrics {
    started: AtomicU64,
    resumed: AtomicU64,
    moved_offload: AtomicU64,
    moved_restore: AtomicU64,
    bytes_offload: AtomicU64,
    bytes_restore: AtomicU64,
    failed: AtomicU64,
    evicted: AtomicU64,
}

/// The jobs of a master.
#[derive(Default)]
pub(crate) struct Jobs {
    map: Mutex<BTreeMap<u64, Arc<Job>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    last_id: AtomicU64,
    /// Jobs were read from the object store (or there is none): new ones may start.
    loaded: AtomicBool,
    metrics: JobMetrics,
}

impl Jobs {
    /// Stops every running job's task (the service is going; a successor resumes them).
    pub fn abort_all(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    fn next_id(&self) -> u64 {
        let now = now_ms();
        let mut cur = self.last_id.load(Ordering::Relaxed);
        loop {
            let id = now.max(cur + 1);
            match self.last_id.compare_exchange(cur, id, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return id,
                Err(c) => cur = c,
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn err(code: ErrorCode, msg: impl Into<String>) -> WireError {
    WireError::new(code, msg)
}

fn record_path(id: u64) -> String {
    format!("{RECORDS}{id}.json")
}

// ----- requests -----------------------------------------------------------------------------

pub(crate) async fn start(state: &Arc<State>, spec: JobSpec) -> w::MasterResponse {
    w::MasterResponse::Job(start_job(state, spec).await)
}

async fn start_job(state: &Arc<State>, spec: JobSpec) -> Result<JobStatus, WireError> {
    if state.tiers.object_store.is_none() {
        return Err(err(
            ErrorCode::Unavailable,
            "this master has no object store (start it with --object-store)",
        ));
    }
    if spec.concurrency == 0 || spec.concurrency > CONCURRENCY_MAX {
        return Err(err(
            ErrorCode::InvalidArgument,
            format!("concurrency {} is outside 1..={CONCURRENCY_MAX}", spec.concurrency),
        ));
    }
    if spec.prefix.len() > 4096 {
        return Err(err(ErrorCode::InvalidKey, "the prefix is longer than a key may be"));
    }
    loaded(state)?;
    let running =
        lock(&state.jobs.map).values().filter(|j| lock(&j.live).state == JobState::Running).count();
    if running >= RUNNING_MAX {
        return Err(err(ErrorCode::NoSpace, format!("{RUNNING_MAX} jobs are running already")));
    }
    let now = now_ms();
    let status = JobStatus {
        id: state.jobs.next_id(),
        spec,
        state: JobState::Running,
        started_ms: now,
        updated_ms: now,
        finished_ms: 0,
        objects_total: 0,
        bytes_total: 0,
        objects_done: 0,
        bytes_done: 0,
        moved: 0,
        already: 0,
        gone: 0,
        evicted: 0,
        kept: 0,
        failed: 0,
        resumed: 0,
        errors: Vec::new(),
    };
    // Every version the directory has handed out so far is in the job.
    let bound = state.lock().version_bound(now);
    let record =
        Record { status: status.clone(), cursor: None, bound, walked: false, evict: Vec::new() };
    // The record is written before the answer: a job the caller was told of survives a crash.
    write_record(state, &record).await?;
    state.jobs.metrics.started.fetch_add(1, Ordering::Relaxed);
    tracing::info!(id = status.id, kind = status.spec.kind.name(), prefix = %status.spec.prefix, "job started");
    spawn(state, record);
    Ok(status)
}

pub(crate) fn get(state: &State, id: u64) -> w::MasterResponse {
    w::MasterResponse::Job(find(state, id).map(|j| lock(&j.live).clone()))
}

pub(crate) fn cancel(state: &State, id: u64) -> w::MasterResponse {
    w::MasterResponse::Job(find(state, id).map(|j| {
        j.cancel.store(true, Ordering::Release);
        lock(&j.live).clone()
    }))
}

pub(crate) fn list(state: &State) -> w::MasterResponse {
    if let Err(e) = loaded(state) {
        return w::MasterResponse::Refused(e);
    }
    let mut v: Vec<JobStatus> =
        lock(&state.jobs.map).values().map(|j| lock(&j.live).clone()).collect();
    v.sort_by_key(|s| (s.state != JobState::Running, std::cmp::Reverse(s.id)));
    w::MasterResponse::Jobs(v)
}

/// Until the records are read, an unknown id may be a job about to be resumed.
fn loaded(state: &State) -> Result<(), WireError> {
    if state.jobs.loaded.load(Ordering::Acquire) {
        return Ok(());
    }
    Err(err(ErrorCode::Recovering, "the master is still reading its jobs from the object store"))
}

fn find(state: &State, id: u64) -> Result<Arc<Job>, WireError> {
    loaded(state)?;
    lock(&state.jobs.map)
        .get(&id)
        .cloned()
        .ok_or_else(|| err(ErrorCode::NotFound, format!("no job {id}")))
}

// ----- records ------------------------------------------------------------------------------

async fn write_record(state: &State, r: &Record) -> Result<(), WireError> {
    if let Some(e) = state.fenced() {
        return Err(e);
    }
    let Some(store) = &state.tiers.object_store else {
        return Err(err(ErrorCode::Unavailable, "no object store"));
    };
    let bytes = serde_json::to_vec(r).map_err(|e| err(ErrorCode::Internal, e.to_string()))?;
    store
        .operator()
        .write(&record_path(r.status.id), bytes)
        .await
        .map(|_| ())
        .map_err(|e| err(ErrorCode::Unavailable, format!("job record: {e}")))
}

/// At start: wait until the directory is rebuilt (object-store scan, recovery grace), read
/// the job records and resume the running ones.
pub(crate) async fn resume_all(state: Arc<State>) {
    let Some(store) = state.tiers.object_store.clone() else {
        state.jobs.loaded.store(true, Ordering::Release);
        return;
    };
    let op = store.operator().clone();
    let entries = match op.list(RECORDS).await {
        Ok(e) => e,
        Err(e) if e.kind() == opendal::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            tracing::error!(error = %e, "job records unreadable; running jobs are not resumed");
            state.jobs.loaded.store(true, Ordering::Release);
            return;
        }
    };
    let mut records = Vec::new();
    for e in entries.into_iter().filter(|e| e.metadata().is_file()) {
        match op.read(e.path()).await.map(|b| serde_json::from_slice::<Record>(&b.to_vec())) {
            Ok(Ok(r)) => records.push(r),
            Ok(Err(err)) => {
                tracing::warn!(path = e.path(), error = %err, "bad job record; skipped")
            }
            Err(err) => tracing::warn!(path = e.path(), error = %err, "job record unreadable"),
        }
    }
    records.sort_by_key(|r| r.status.id);
    let mut resume = Vec::new();
    {
        let mut map = lock(&state.jobs.map);
        for r in records {
            let id = r.status.id;
            state.jobs.last_id.fetch_max(id, Ordering::Relaxed);
            if r.status.state == JobState::Running {
                resume.push(r);
            } else {
                let job = Job {
                    live: Mutex::new(r.status.clone()),
                    record: Mutex::new(r),
                    cancel: AtomicBool::new(false),
                };
                map.insert(id, Arc::new(job));
            }
        }
    }
    state.jobs.loaded.store(true, Ordering::Release);
    for mut r in resume {
        r.status.resumed += 1;
        state.jobs.metrics.resumed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(id = r.status.id, kind = r.status.spec.kind.name(), "job resumed");
        spawn(&state, r);
    }
    prune(&state).await;
}

/// Keeps the `KEEP_MAX` most recent ended jobs.
async fn prune(state: &State) {
    let old: Vec<u64> = {
        let mut map = lock(&state.jobs.map);
        let ended: Vec<u64> = map
            .iter()
            .filter(|(_, j)| lock(&j.live).state != JobState::Running)
            .map(|(&id, _)| id)
            .collect();
        let n = ended.len().saturating_sub(KEEP_MAX);
        for id in &ended[..n] {
            map.remove(id);
        }
        ended[..n].to_vec()
    };
    let Some(store) = &state.tiers.object_store else { return };
    for id in old {
        if let Err(e) = store.operator().delete(&record_path(id)).await {
            tracing::warn!(id, error = %e, "old job record not deleted");
        }
    }
}

// ----- running ------------------------------------------------------------------------------

fn spawn(state: &Arc<State>, record: Record) {
    let id = record.status.id;
    let job = Arc::new(Job {
        live: Mutex::new(record.status.clone()),
        record: Mutex::new(record),
        cancel: AtomicBool::new(false),
    });
    lock(&state.jobs.map).insert(id, job.clone());
    let st = state.clone();
    let t = tokio::spawn(async move {
        run(&st, &job).await;
        prune(&st).await;
    });
    let mut tasks = lock(&state.jobs.tasks);
    tasks.retain(|t| !t.is_finished());
    tasks.push(t);
}

/// What happened to one object.
enum Outcome {
    Moved(u64),
    Already,
    Gone,
    Failed(String),
}

async fn run(state: &Arc<State>, job: &Arc<Job>) {
    let (spec, mut rec) = {
        let r = lock(&job.record).clone();
        (r.status.spec.clone(), r)
    };
    wait_rebuilt(state, rec.status.resumed > 0).await;
    if rec.status.objects_total == 0 && rec.cursor.is_none() && !rec.walked {
        let (n, bytes) = count(state, &spec.prefix, rec.bound);
        rec.status.objects_total = n;
        rec.status.bytes_total = bytes;
        *lock(&job.live) = rec.status.clone();
    }
    let evict = matches!(spec.kind, JobKind::Offload { evict: true });
    let mut queue: VecDeque<(String, u64)> = std::mem::take(&mut rec.evict).into();
    let mut pace = Pace::new(spec.rate_bytes_per_s);
    let mut last_write = Instant::now();
    while !rec.walked {
        if job.cancel.load(Ordering::Acquire) {
            break;
        }
        // A leader whose lease lapsed stops: the next leader resumes the job from the last
        // checkpoint, and this one writes nothing more.
        if let Some(e) = state.fenced() {
            tracing::warn!(id = rec.status.id, why = %e.message, "job stopped: not the leader");
            return;
        }
        let listed = state.lock().list(&spec.prefix, rec.cursor.as_deref(), PAGE);
        let page = match listed {
            Ok(p) => p,
            Err(e) => {
                fail(state, job, &mut rec, format!("listing {:?}: {e}", spec.prefix)).await;
                return;
            }
        };
        let items: Vec<(String, u64, u64)> = page
            .entries
            .iter()
            .filter(|e| e.version <= rec.bound)
            .map(|e| (e.key.to_string(), e.version, e.size))
            .collect();
        let mut set = tokio::task::JoinSet::new();
        let mut page_status = rec.status.clone();
        let mut done = |r: Result<Done, tokio::task::JoinError>| {
            if let Ok(d) = r {
                account(state, job, &spec, &mut page_status, &mut queue, d);
            }
        };
        'items: for (key, version, size) in items {
            while set.len() >= spec.concurrency as usize {
                done(set.join_next().await.expect("not empty"));
            }
            // Paced: completions are counted and a cancel is seen while the job waits.
            let due = pace.due(size);
            loop {
                if job.cancel.load(Ordering::Acquire) {
                    break 'items;
                }
                let now = tokio::time::Instant::now();
                if now >= due {
                    break;
                }
                let step = due.min(now + Duration::from_millis(CANCEL_POLL_MS));
                tokio::select! {
                    Some(r) = set.join_next(), if !set.is_empty() => done(r),
                    _ = tokio::time::sleep_until(step) => {}
                }
            }
            let (st, kind) = (state.clone(), spec.kind);
            set.spawn(async move {
                let out = match kind {
                    JobKind::Offload { .. } => offload_one(&st, &key, version).await,
                    JobKind::Restore => restore_one(&st, &key, version).await,
                };
                Done { key, version, size, out }
            });
        }
        while let Some(r) = set.join_next().await {
            done(r);
        }
        if job.cancel.load(Ordering::Acquire) {
            // The page may be half done: the checkpoint stays where it was.
            break;
        }
        // `--move` drains what it can before the checkpoint: evictions are counted in it.
        if evict {
            drain(state, job, &mut queue, false).await;
        }
        rec.status = lock(&job.live).clone();
        rec.cursor = page.next_start_after.clone().or(rec.cursor.take());
        rec.walked = page.next_start_after.is_none();
        rec.evict = queue.iter().cloned().collect();
        if rec.walked || last_write.elapsed() >= Duration::from_millis(CHECKPOINT_MS) {
            *lock(&job.record) = rec.clone();
            if let Err(e) = write_record(state, &rec).await {
                tracing::warn!(id = rec.status.id, error = %e.message, "job checkpoint not written");
            }
            last_write = Instant::now();
        }
    }
    if evict && !job.cancel.load(Ordering::Acquire) {
        drain(state, job, &mut queue, true).await;
    }
    let mut status = lock(&job.live).clone();
    status.state = if job.cancel.load(Ordering::Acquire) {
        JobState::Cancelled
    } else if status.failed > 0 {
        JobState::Failed
    } else {
        JobState::Done
    };
    // Objects of the job that vanished from the listing (a node gone with its only copy).
    if status.state != JobState::Cancelled && status.objects_done < status.objects_total {
        status.gone += status.objects_total - status.objects_done;
        status.objects_done = status.objects_total;
    }
    status.finished_ms = now_ms();
    status.updated_ms = status.finished_ms;
    *lock(&job.live) = status.clone();
    rec.status = status;
    rec.evict.clear();
    *lock(&job.record) = rec.clone();
    if let Err(e) = write_record(state, &rec).await {
        tracing::warn!(id = rec.status.id, error = %e.message, "job record not written");
    }
    let s = &rec.status;
    tracing::info!(
        id = s.id,
        state = s.state.name(),
        moved = s.moved,
        already = s.already,
        gone = s.gone,
        failed = s.failed,
        evicted = s.evicted,
        "job ended"
    );
}

/// One object's end, as the task running it reports it.
struct Done {
    key: String,
    version: u64,
    size: u64,
    out: Outcome,
}

/// Counts an object's outcome in the page's status and the live one; queues it for `--move`.
fn account(
    state: &State,
    job: &Job,
    spec: &JobSpec,
    page_status: &mut JobStatus,
    queue: &mut VecDeque<(String, u64)>,
    d: Done,
) {
    let m = &state.jobs.metrics;
    match &d.out {
        Outcome::Moved(b) => {
            page_status.moved += 1;
            let (n, by) = match spec.kind {
                JobKind::Restore => (&m.moved_restore, &m.bytes_restore),
                JobKind::Offload { .. } => (&m.moved_offload, &m.bytes_offload),
            };
            n.fetch_add(1, Ordering::Relaxed);
            by.fetch_add(*b, Ordering::Relaxed);
        }
        Outcome::Already => page_status.already += 1,
        Outcome::Gone => page_status.gone += 1,
        Outcome::Failed(e) => {
            page_status.failed += 1;
            m.failed.fetch_add(1, Ordering::Relaxed);
            if page_status.errors.len() < ERRORS_MAX {
                page_status.errors.push(format!("{}: {e}", d.key));
            }
        }
    }
    if matches!(spec.kind, JobKind::Offload { evict: true })
        && matches!(d.out, Outcome::Moved(_) | Outcome::Already)
    {
        queue.push_back((d.key, d.version));
    }
    page_status.objects_done += 1;
    page_status.bytes_done += d.size;
    let mut live = lock(&job.live);
    let (evicted, kept) = (live.evicted, live.kept);
    *live = page_status.clone();
    live.evicted = evicted;
    live.kept = kept;
    live.updated_ms = now_ms();
}

async fn fail(state: &State, job: &Job, rec: &mut Record, why: String) {
    let mut s = lock(&job.live).clone();
    s.state = JobState::Failed;
    s.errors.truncate(ERRORS_MAX - 1);
    s.errors.push(why);
    s.finished_ms = now_ms();
    *lock(&job.live) = s.clone();
    rec.status = s;
    let _ = write_record(state, rec).await;
}

/// Waits until the directory holds what the pool holds: the object-store scan is over, and
/// nodes had the recovery grace to report their objects (a resumed job waits out the whole
/// grace after the master's start, since its nodes are coming back; a new one only a recovery
/// under way, as puts do).
async fn wait_rebuilt(state: &State, resumed: bool) {
    let until = state.started_ms + state.cfg.recovery_grace_ms;
    loop {
        let now = now_ms();
        let grace = if resumed { now < until } else { state.recovering(now) };
        if !grace && !state.tiers.scanning.load(Ordering::Acquire) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Objects (and bytes) under `prefix` with a version up to `bound`.
fn count(state: &State, prefix: &str, bound: u64) -> (u64, u64) {
    let (mut n, mut bytes, mut after) = (0, 0, None::<String>);
    loop {
        let page = match state.lock().list(prefix, after.as_deref(), 4096) {
            Ok(p) => p,
            Err(_) => return (n, bytes),
        };
        for e in page.entries.iter().filter(|e| e.version <= bound) {
            n += 1;
            bytes += e.size;
        }
        match page.next_start_after {
            Some(k) => after = Some(k),
            None => return (n, bytes),
        }
    }
}

/// Paces a job to its byte rate (an average since the job's start in this process).
struct Pace {
    rate: u64,
    start: tokio::time::Instant,
    sent: u64,
}

impl Pace {
    fn new(rate: u64) -> Pace {
        Pace { rate, start: tokio::time::Instant::now(), sent: 0 }
    }

    /// When the next `bytes` may start.
    fn due(&mut self, bytes: u64) -> tokio::time::Instant {
        if self.rate == 0 {
            return self.start;
        }
        let due = self.start + Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
        self.sent += bytes;
        due
    }
}

// ----- offload ------------------------------------------------------------------------------

/// One try at an object: its outcome, or why this try failed (the object is tried again).
type Try = Result<Outcome, String>;

/// Runs `attempt` until it gives an outcome, at most `ATTEMPTS` times `RETRY_MS` apart; the
/// last try's reason is the failure.
async fn retrying<F: Future<Output = Try>>(mut attempt: impl FnMut() -> F) -> Outcome {
    let mut last = String::new();
    for n in 0..ATTEMPTS {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(RETRY_MS)).await;
        }
        match attempt().await {
            Ok(o) => return o,
            Err(why) => last = why,
        }
    }
    Outcome::Failed(last)
}

async fn offload_one(state: &Arc<State>, key: &str, version: u64) -> Outcome {
    retrying(|| offload_try(state, key, version)).await
}

async fn offload_try(state: &Arc<State>, key: &str, version: u64) -> Try {
    let view = match checked_view(state, key, version, false) {
        Ok(v) => v,
        Err(o) => return Ok(o),
    };
    if view.replicas.iter().any(|r| r.tier() == Tier::ObjectStore) {
        return Ok(Outcome::Already);
    }
    // A write that a killed master asked for and never heard the end of.
    if let Some(store) = &state.tiers.object_store
        && let Ok(meta) = kvfs_tiers::Medium::stat(store.as_ref(), key).await
        && meta.version == version
        && view.checksum.is_none_or(|c| c == meta.checksum)
    {
        return Ok(record_persisted(state, key, version, meta.checksum)
            .map_or_else(|o| o, |()| Outcome::Already));
    }
    // Look up, check and lease under one lock: the ranges stay the object's while leased
    // (a short lease, renewed while the node works, so `--move` need not wait out a
    // reader's whole TTL after it).
    let view = match checked_view(state, key, version, true) {
        Ok(v) => v,
        Err(o) => return Ok(o),
    };
    let mut sources: Vec<_> = view
        .replicas
        .iter()
        .filter_map(|r| match r.location {
            Location::Node(n) => Some(n),
            Location::ObjectStore => None,
        })
        .collect();
    // Memory copies first (a memcpy on the node), then NVMe.
    sources.sort_by_key(|n| (n.tier == Tier::Nvme, n.node.0));
    let mut last = None;
    for n in sources {
        let req = NodeRequest::Persist(vec![w::PersistItem {
            key: key.to_string(),
            segment: n.segment,
            offset: n.offset,
            size: view.size,
            checksum: view.checksum,
            version,
            pin: convert::pin(view.pin),
        }]);
        let call = tiers::call_node(state, n.node, &req, state.cfg.persist_timeout_ms);
        let r =
            held(state, key, version, call).await.and_then(|resp| tiers::single(resp, "persist"));
        match r {
            Ok(sum) => {
                return Ok(match record_persisted(state, key, version, sum) {
                    Ok(()) => Outcome::Moved(view.size),
                    Err(o) => {
                        delete_stale(state, key, version).await;
                        o
                    }
                });
            }
            Err(e) if e.code == ErrorCode::Corrupt => return Ok(Outcome::Failed(e.message)),
            Err(e) => last = Some(format!("node {}: {}", n.node.0, e.message)),
        }
    }
    Err(last.unwrap_or_else(|| "no node holds a copy".into()))
}

/// The object's view if it is still at `version` (else the outcome to count); with `lease`,
/// leased in the same hold of the lock, so its ranges stay its own while a node reads them.
fn checked_view(
    state: &State,
    key: &str,
    version: u64,
    lease: bool,
) -> Result<crate::ObjectView, Outcome> {
    let mut dir = state.lock();
    match dir.stat(key) {
        Ok(v) if v.version == version => {
            if lease {
                dir.hold(key, version, now_ms() + HOLD_MS);
            }
            Ok(v)
        }
        Ok(_) => Err(Outcome::Gone),
        Err(e) if e.kind() == ErrorKind::NotFound => Err(Outcome::Gone),
        Err(e) => Err(Outcome::Failed(e.to_string())),
    }
}

/// Runs `fut` while renewing the job's lease on `key` every `HOLD_MS / 2`.
async fn held<T>(state: &State, key: &str, version: u64, fut: impl Future<Output = T>) -> T {
    let mut fut = std::pin::pin!(fut);
    let mut tick = tokio::time::interval(Duration::from_millis(HOLD_MS / 2));
    tick.tick().await;
    loop {
        tokio::select! {
            r = &mut fut => return r,
            _ = tick.tick() => {
                state.lock().hold(key, version, now_ms() + HOLD_MS);
            }
        }
    }
}

/// Records the object-store copy of `key` at `version`; the outcome to count if the object
/// changed meanwhile.
fn record_persisted(state: &State, key: &str, version: u64, sum: [u8; 32]) -> Result<(), Outcome> {
    let mut dir = state.lock();
    match dir.report_replica(key, version, Some(sum), Some(&Location::ObjectStore), None, now_ms())
    {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Conflict) => {
            Err(Outcome::Gone)
        }
        Err(e) => Err(Outcome::Failed(e.to_string())),
    }
}

/// Deletes the object-store copy of a version that was removed or replaced while it was
/// written (a restart would otherwise bring it back).
async fn delete_stale(state: &State, key: &str, version: u64) {
    let Some(store) = &state.tiers.object_store else { return };
    if let Ok(meta) = kvfs_tiers::Medium::stat(store.as_ref(), key).await
        && meta.version == version
        && let Err(e) = kvfs_tiers::Medium::remove(store.as_ref(), key).await
    {
        tracing::warn!(key, error = %e, "stale object-store copy not deleted");
    }
}

/// `--move`: drops the pool copies of the queued objects; leased ones wait. With `last`,
/// waits (bounded) until every lease ended; what is left then is `kept`.
async fn drain(state: &Arc<State>, job: &Job, queue: &mut VecDeque<(String, u64)>, last: bool) {
    let deadline = now_ms() + state.cfg.directory.lease_ttl_ms + MOVE_WAIT_MS;
    loop {
        let (mut evicted, mut kept) = (0, 0);
        let mut fx = Vec::new();
        {
            let mut dir = state.lock();
            let now = now_ms();
            for _ in 0..queue.len() {
                let (key, version) = queue.pop_front().expect("counted");
                match dir.release_to_object_store(&key, version, now, &mut fx) {
                    Ok(_) => evicted += 1,
                    Err(e) if e.kind() == ErrorKind::Leased => queue.push_back((key, version)),
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(_) => kept += 1,
                }
            }
        }
        deliver(state, fx, false).await;
        state.jobs.metrics.evicted.fetch_add(evicted, Ordering::Relaxed);
        {
            let mut live = lock(&job.live);
            live.evicted += evicted;
            live.kept += kept;
        }
        if !last || queue.is_empty() {
            return;
        }
        if now_ms() >= deadline || job.cancel.load(Ordering::Acquire) {
            let n = queue.len() as u64;
            queue.clear();
            lock(&job.live).kept += n;
            return;
        }
        tokio::time::sleep(Duration::from_millis(RETRY_MS)).await;
    }
}

// ----- restore ------------------------------------------------------------------------------

async fn restore_one(state: &Arc<State>, key: &str, version: u64) -> Outcome {
    retrying(|| async {
        let view = match checked_view(state, key, version, false) {
            Ok(v) => v,
            Err(o) => return Ok(o),
        };
        if view.replicas.iter().any(|r| matches!(r.tier(), Tier::Dram | Tier::Hbm)) {
            return Ok(Outcome::Already);
        }
        match tiers::load_dedup(state, key).await {
            Ok(()) => Ok(Outcome::Moved(view.size)),
            Err(e) if e.code == ErrorCode::NotFound => Ok(Outcome::Gone),
            Err(e) if e.code == ErrorCode::Corrupt => Ok(Outcome::Failed(e.message)),
            Err(e) => Err(e.message),
        }
    })
    .await
}

// ----- metrics ------------------------------------------------------------------------------

pub(crate) fn render(state: &State, o: &mut String) {
    let m = &state.jobs.metrics;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut by_state = [0u64; 4];
    for j in lock(&state.jobs.map).values() {
        by_state[lock(&j.live).state as usize] += 1;
    }
    let _ = writeln!(o, "# HELP kvfs_master_jobs Jobs the master knows, by state.");
    let _ = writeln!(o, "# TYPE kvfs_master_jobs gauge");
    for s in [JobState::Running, JobState::Done, JobState::Cancelled, JobState::Failed] {
        let _ = writeln!(o, "kvfs_master_jobs{{state=\"{}\"}} {}", s.name(), by_state[s as usize]);
    }
    let mut counter = |name: &str, help: &str, rows: &[(&str, u64)]| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, v) in rows {
            let _ = writeln!(o, "{name}{labels} {v}");
        }
    };
    counter(
        "kvfs_master_jobs_started_total",
        "Jobs started, and resumed by this master after a restart or a takeover.",
        &[("{how=\"started\"}", load(&m.started)), ("{how=\"resumed\"}", load(&m.resumed))],
    );
    counter(
        "kvfs_master_job_objects_total",
        "Objects jobs moved (offload: into the object store; restore: into DRAM).",
        &[
            ("{kind=\"offload\"}", load(&m.moved_offload)),
            ("{kind=\"restore\"}", load(&m.moved_restore)),
        ],
    );
    counter(
        "kvfs_master_job_bytes_total",
        "Bytes jobs moved.",
        &[
            ("{kind=\"offload\"}", load(&m.bytes_offload)),
            ("{kind=\"restore\"}", load(&m.bytes_restore)),
        ],
    );
    counter(
        "kvfs_master_job_failures_total",
        "Objects a job gave up on.",
        &[("", load(&m.failed))],
    );
    counter(
        "kvfs_master_job_evictions_total",
        "Objects whose pool copies an offload --move dropped.",
        &[("", load(&m.evicted))],
    );
}
