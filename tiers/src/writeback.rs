//! The lazy-persistence write-back queue: bounded, crash-safe, retried.
//!
//! Mechanism: [`WritebackQueue::enqueue`] appends an `enqueued` record (sequence number, key,
//! size, blake3) to an append-only journal file and fsyncs it before the entry is queued in
//! memory. Workers take entries, read the bytes from the source medium (DRAM/NVMe), check them
//! against the enqueued blake3, upload them to the target (object-store) medium as an
//! idempotent overwrite, then append and fsync a `persisted` record, and only then report
//! [`WritebackEvent::Persisted`]. An entry that cannot be uploaded after `retries_max` retries
//! (or whose source is gone or changed) gets a `failed` record and a
//! [`WritebackEvent::Failed`].
//!
//! Journal format: a sequence of records `[len: u32 LE][sum: 8 bytes][payload: len bytes]`,
//! `sum` = the first 8 bytes of blake3(payload). Payload: `kind: u8` (1 enqueued, 2 persisted,
//! 3 failed), `seq: u64 LE`, and for `enqueued`: `size: u64 LE`, `blake3: [u8; 32]`,
//! `persistence: u8`, `version: u64 LE`, `pin: u8`, `key_len: u32 LE`, `key` (version and pin
//! are the store's, carried into the object-store header so a rebuilt master can adopt the
//! object as it was). Kind 4 (enqueued after a rename) adds `previous_version: u64 LE`,
//! `previous_len: u32 LE`, `previous key`: the name and version the object had before it was
//! renamed, written into the uploaded copy's header. A write-back under the old name that
//! finished after the rename leaves a stale copy in the object store until the node deletes it;
//! if everything is killed first, a rebuilt master finds the new name's header claiming the old
//! name and deletes that copy instead of bringing the old name back.
//!
//! Recovery ([`WritebackQueue::open`]): the journal is replayed; a torn or damaged tail (a
//! SIGKILL or power cut mid-append) ends the replay and is cut off. Every `enqueued` entry
//! without a `persisted` or `failed` record is queued again and listed in [`Recovery`]. The
//! journal is then compacted (rewritten with the pending entries only: temp file, fsync,
//! rename, fsync dir). So after a crash, nothing acknowledged as persisted is lost (its upload
//! finished before its record was fsync'd, and the record before the acknowledgement), and
//! every entry not persisted is retried or reported.
//!
//! Limits: `queue_entries_max` and `queue_bytes_max` count entries from enqueue until persisted
//! or failed; past them `enqueue` fails with `Busy` (back-pressure the caller sees).
//!
//! Not handled: group commit (one fsync per record; fine at object sizes of 64 KiB and up),
//! compaction while running (only at open), several source media (the node passes one medium
//! that resolves DRAM then NVMe), ordering between entries (uploads run in parallel).

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

use crate::error::{Error, ErrorKind, Result};
use crate::medium::{Medium, ObjectMeta, Persistence, PutMode, PutOptions, checksum};

/// Configuration of a write-back queue.
#[derive(Debug, Clone)]
pub struct WritebackConfig {
    pub journal_path: PathBuf,
    pub queue_entries_max: usize,
    pub queue_bytes_max: u64,
    /// Concurrent uploads.
    pub workers: usize,
    /// Retries of a retryable upload error before the entry is reported failed.
    pub retries_max: u32,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
}

impl WritebackConfig {
    pub fn new(journal_path: impl Into<PathBuf>) -> Self {
        WritebackConfig {
            journal_path: journal_path.into(),
            queue_entries_max: 65_536,
            queue_bytes_max: 64 << 30,
            workers: 4,
            retries_max: 5,
            backoff_base_ms: 50,
            backoff_max_ms: 5_000,
        }
    }
}

/// One entry of the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritebackEntry {
    pub seq: u64,
    pub key: String,
    pub size_bytes: u64,
    pub checksum: [u8; 32],
    pub persistence: Persistence,
    /// The store's version and pin code, stored in the object-store header.
    pub version: u64,
    pub pin: u8,
    /// The name and version the object had before a rename, stored in the uploaded header.
    pub previous: Option<(String, u64)>,
}

/// What the workers report.
#[derive(Debug)]
pub enum WritebackEvent {
    /// The object is in the target and its `persisted` record is durable.
    Persisted { seq: u64, key: String, version: u64 },
    /// Given up on; the `failed` record is durable.
    Failed { seq: u64, key: String, version: u64, error: Error },
}

/// What `open` found in the journal.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Entries enqueued before the restart and not persisted: queued again.
    pub pending: Vec<WritebackEntry>,
    /// Entries whose `persisted` record was found.
    pub persisted: usize,
    /// Entries whose `failed` record was found (reported before the restart).
    pub failed: usize,
    /// Bytes of a torn or damaged tail that were cut off.
    pub torn_tail_bytes: u64,
}

const KIND_ENQUEUED: u8 = 1;
const KIND_PERSISTED: u8 = 2;
const KIND_FAILED: u8 = 3;
const KIND_ENQUEUED_RENAMED: u8 = 4;
/// The largest valid record payload (a 4096-byte key and a 4096-byte previous key plus the
/// fixed fields).
const RECORD_BYTES_MAX: usize = 80 + 2 * crate::medium::KEY_BYTES_MAX;

/// The record kind that enqueues `e`.
fn enqueued_kind(e: &WritebackEntry) -> u8 {
    if e.previous.is_some() { KIND_ENQUEUED_RENAMED } else { KIND_ENQUEUED }
}

fn encode_record(kind: u8, seq: u64, entry: Option<&WritebackEntry>) -> Vec<u8> {
    let mut p = vec![kind];
    p.extend_from_slice(&seq.to_le_bytes());
    if let Some(e) = entry {
        p.extend_from_slice(&e.size_bytes.to_le_bytes());
        p.extend_from_slice(&e.checksum);
        p.push(e.persistence.to_u8());
        p.extend_from_slice(&e.version.to_le_bytes());
        p.push(e.pin);
        p.extend_from_slice(&(e.key.len() as u32).to_le_bytes());
        p.extend_from_slice(e.key.as_bytes());
        if let Some((pk, pv)) = &e.previous {
            p.extend_from_slice(&pv.to_le_bytes());
            p.extend_from_slice(&(pk.len() as u32).to_le_bytes());
            p.extend_from_slice(pk.as_bytes());
        }
    }
    let mut r = Vec::with_capacity(12 + p.len());
    r.extend_from_slice(&(p.len() as u32).to_le_bytes());
    r.extend_from_slice(&blake3::hash(&p).as_bytes()[..8]);
    r.extend_from_slice(&p);
    r
}

enum Record {
    Enqueued(WritebackEntry),
    Persisted(u64),
    Failed(u64),
}

fn take<const N: usize>(b: &[u8], at: &mut usize) -> Option<[u8; N]> {
    let s = b.get(*at..*at + N)?;
    *at += N;
    s.try_into().ok()
}

fn decode_payload(p: &[u8]) -> Option<Record> {
    let mut at = 0;
    let [kind] = take::<1>(p, &mut at)?;
    let seq = u64::from_le_bytes(take::<8>(p, &mut at)?);
    match kind {
        KIND_PERSISTED if at == p.len() => Some(Record::Persisted(seq)),
        KIND_FAILED if at == p.len() => Some(Record::Failed(seq)),
        KIND_ENQUEUED | KIND_ENQUEUED_RENAMED => {
            let size_bytes = u64::from_le_bytes(take::<8>(p, &mut at)?);
            let checksum = take::<32>(p, &mut at)?;
            let [pers] = take::<1>(p, &mut at)?;
            let version = u64::from_le_bytes(take::<8>(p, &mut at)?);
            let [pin] = take::<1>(p, &mut at)?;
            let key_len = u32::from_le_bytes(take::<4>(p, &mut at)?) as usize;
            let key = std::str::from_utf8(p.get(at..at + key_len)?).ok()?.to_owned();
            at += key_len;
            let previous = if kind == KIND_ENQUEUED_RENAMED {
                let pv = u64::from_le_bytes(take::<8>(p, &mut at)?);
                let pk_len = u32::from_le_bytes(take::<4>(p, &mut at)?) as usize;
                let pk = std::str::from_utf8(p.get(at..at + pk_len)?).ok()?.to_owned();
                at += pk_len;
                Some((pk, pv))
            } else {
                None
            };
            if at != p.len() {
                return None;
            }
            let persistence = Persistence::from_u8(pers).ok()?;
            Some(Record::Enqueued(WritebackEntry {
                seq,
                key,
                size_bytes,
                checksum,
                persistence,
                version,
                pin,
                previous,
            }))
        }
        _ => None,
    }
}

/// Parse records; returns them and the length of the valid prefix.
fn replay(bytes: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let mut cur = at;
        let Some(len) = take::<4>(bytes, &mut cur).map(u32::from_le_bytes) else { break };
        let len = len as usize;
        if len > RECORD_BYTES_MAX {
            break;
        }
        let Some(sum) = take::<8>(bytes, &mut cur) else { break };
        let Some(payload) = bytes.get(cur..cur + len) else { break };
        if blake3::hash(payload).as_bytes()[..8] != sum {
            break;
        }
        let Some(rec) = decode_payload(payload) else { break };
        out.push(rec);
        at = cur + len;
    }
    (out, at)
}

struct Queue {
    ready: VecDeque<WritebackEntry>,
    next_seq: u64,
}

struct Shared {
    cfg: WritebackConfig,
    journal: Mutex<File>,
    queue: Mutex<Queue>,
    notify: Notify,
    closed: AtomicBool,
    /// Entries and bytes counted against the limits (queued or uploading). Raised only under
    /// the queue lock, after the limit check; [`WritebackQueue::depth`] (in every node
    /// heartbeat) reads them without it, since an enqueue holds it across its journal append
    /// and fsync.
    depth: (AtomicUsize, AtomicU64),
    source: Arc<dyn Medium>,
    target: Arc<dyn Medium>,
    events: mpsc::UnboundedSender<WritebackEvent>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn append(&self, record: &[u8]) -> Result<()> {
        let mut f = lock(&self.journal);
        f.write_all(record).and_then(|_| f.sync_data()).map_err(|e| {
            Error::io(format!("append to journal {}", self.cfg.journal_path.display()), e)
        })
    }

    fn finish(&self, entry: &WritebackEntry) {
        self.depth.0.fetch_sub(1, Ordering::Relaxed);
        self.depth.1.fetch_sub(entry.size_bytes, Ordering::Relaxed);
    }
}

/// The write-back queue; workers run on the tokio runtime that opened it.
pub struct WritebackQueue {
    shared: Arc<Shared>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

fn fsync_parent(path: &Path) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(format!("fsync {}", dir.display()), e))
}

/// Read, replay and compact the journal; returns the file open for appends.
fn recover(path: &Path) -> Result<(File, Recovery, u64)> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)
                .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("open {}", path.display()), e)),
    }
    let (records, valid) = replay(&bytes);
    let mut rec = Recovery { torn_tail_bytes: (bytes.len() - valid) as u64, ..Default::default() };
    let mut pending: BTreeMap<u64, WritebackEntry> = BTreeMap::new();
    let mut max_seq = 0;
    for r in records {
        match r {
            Record::Enqueued(e) => {
                max_seq = max_seq.max(e.seq);
                pending.insert(e.seq, e);
            }
            Record::Persisted(s) => {
                rec.persisted += usize::from(pending.remove(&s).is_some());
            }
            Record::Failed(s) => {
                rec.failed += usize::from(pending.remove(&s).is_some());
            }
        }
    }
    if rec.torn_tail_bytes > 0 {
        tracing::warn!(path = %path.display(), bytes = rec.torn_tail_bytes, "write-back journal: cut a torn tail");
    }
    rec.pending = pending.into_values().collect();
    let tmp = path.with_extension("compact");
    {
        let mut f =
            File::create(&tmp).map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
        let mut buf = Vec::new();
        for e in &rec.pending {
            buf.extend_from_slice(&encode_record(enqueued_kind(e), e.seq, Some(e)));
        }
        f.write_all(&buf)
            .and_then(|_| f.sync_all())
            .map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
    }
    std::fs::rename(&tmp, path)
        .map_err(|e| Error::io(format!("rename to {}", path.display()), e))?;
    fsync_parent(path)?;
    let f = OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    Ok((f, rec, max_seq + 1))
}

impl WritebackQueue {
    /// Open (or create) the journal, recover pending entries and start the workers.
    /// Must be called inside a tokio runtime.
    pub async fn open(
        cfg: WritebackConfig,
        source: Arc<dyn Medium>,
        target: Arc<dyn Medium>,
    ) -> Result<(Self, Recovery, mpsc::UnboundedReceiver<WritebackEvent>)> {
        if cfg.workers == 0 || cfg.queue_entries_max == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "workers and queue_entries_max must be >= 1",
            ));
        }
        let path = cfg.journal_path.clone();
        let (journal, recovery, next_seq) = tokio::task::spawn_blocking(move || recover(&path))
            .await
            .map_err(|e| Error::new(ErrorKind::Io, format!("journal recovery task: {e}")))??;
        let queue = Queue { ready: recovery.pending.iter().cloned().collect(), next_seq };
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            cfg,
            journal: Mutex::new(journal),
            depth: (
                AtomicUsize::new(recovery.pending.len()),
                AtomicU64::new(recovery.pending.iter().map(|e| e.size_bytes).sum()),
            ),
            queue: Mutex::new(queue),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
            source,
            target,
            events: tx,
        });
        let workers =
            (0..shared.cfg.workers).map(|_| tokio::spawn(worker(shared.clone()))).collect();
        Ok((WritebackQueue { shared, workers }, recovery, rx))
    }

    /// Queue `key` (already stored in the source medium with this size and blake3) for upload.
    /// Durable when it returns: a crash from here on retries or reports it. `Busy` when the
    /// queue is at `queue_entries_max` or `queue_bytes_max`.
    pub async fn enqueue(&self, key: &str, size_bytes: u64, checksum: [u8; 32]) -> Result<u64> {
        let meta = ObjectMeta {
            size_bytes,
            checksum,
            persistence: Persistence::Lazy,
            stored_at_unix_ms: 0,
            version: 0,
            pin: 0,
        };
        self.enqueue_meta(key, &meta, None).await
    }

    /// [`enqueue`](Self::enqueue) with the object's version and pin code (stored in the
    /// object-store header) and, for an object renamed since it was stored, the name and version
    /// it had before (stored there too); `meta.stored_at_unix_ms` is ignored.
    pub async fn enqueue_meta(
        &self,
        key: &str,
        meta: &ObjectMeta,
        previous: Option<(&str, u64)>,
    ) -> Result<u64> {
        crate::medium::validate_key(key)?;
        if let Some((pk, _)) = previous {
            crate::medium::validate_key(pk)?;
        }
        let previous = previous.map(|(k, v)| (k.to_owned(), v));
        let (size_bytes, checksum, version, pin) =
            (meta.size_bytes, meta.checksum, meta.version, meta.pin);
        let shared = self.shared.clone();
        let key = key.to_owned();
        // Journal append and queue insertion happen together on a blocking thread, so a
        // cancelled caller cannot leave a journaled entry out of the queue.
        tokio::task::spawn_blocking(move || {
            if shared.closed.load(Ordering::Acquire) {
                return Err(Error::new(ErrorKind::Closed, "write-back queue is closed"));
            }
            let mut q = lock(&shared.queue);
            let c = &shared.cfg;
            let (entries, bytes) =
                (shared.depth.0.load(Ordering::Relaxed), shared.depth.1.load(Ordering::Relaxed));
            if entries >= c.queue_entries_max || bytes + size_bytes > c.queue_bytes_max {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "write-back queue full: {} of {} entries, {} of {} bytes (queue_entries_max, queue_bytes_max)",
                        entries, c.queue_entries_max, bytes, c.queue_bytes_max
                    ),
                ));
            }
            let entry = WritebackEntry {
                seq: q.next_seq,
                key,
                size_bytes,
                checksum,
                persistence: Persistence::Lazy,
                version,
                pin,
                previous,
            };
            shared.append(&encode_record(enqueued_kind(&entry), entry.seq, Some(&entry)))?;
            q.next_seq += 1;
            shared.depth.0.fetch_add(1, Ordering::Relaxed);
            shared.depth.1.fetch_add(size_bytes, Ordering::Relaxed);
            let seq = entry.seq;
            q.ready.push_back(entry);
            drop(q);
            shared.notify.notify_one();
            Ok(seq)
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("enqueue task: {e}")))?
    }

    /// Entries and bytes counted against the limits right now.
    pub fn depth(&self) -> (usize, u64) {
        let (entries, bytes) = &self.shared.depth;
        (entries.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed))
    }

    /// Stop taking entries; wait for uploads in progress to finish. Entries still queued stay
    /// in the journal and are recovered by the next `open`.
    pub async fn close(mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.notify.notify_waiters();
        for w in self.workers.drain(..) {
            let _ = w.await;
        }
    }
}

impl Drop for WritebackQueue {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.notify.notify_waiters();
    }
}

async fn worker(shared: Arc<Shared>) {
    loop {
        let next = {
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            let e = lock(&shared.queue).ready.pop_front();
            match e {
                Some(e) => e,
                None => {
                    notified.await;
                    continue;
                }
            }
        };
        let outcome = upload(&shared, &next).await;
        let (kind, event) = match outcome {
            Ok(()) => {
                let (seq, key, version) = (next.seq, next.key.clone(), next.version);
                (KIND_PERSISTED, WritebackEvent::Persisted { seq, key, version })
            }
            Err(e) if e.kind() == ErrorKind::Closed => return,
            Err(error) => {
                tracing::warn!(key = %next.key, seq = next.seq, %error, "write-back gave up");
                (
                    KIND_FAILED,
                    WritebackEvent::Failed {
                        seq: next.seq,
                        key: next.key.clone(),
                        version: next.version,
                        error,
                    },
                )
            }
        };
        let record = encode_record(kind, next.seq, None);
        let s = shared.clone();
        let appended = tokio::task::spawn_blocking(move || s.append(&record)).await;
        match appended {
            Ok(Ok(())) => {
                shared.finish(&next);
                let _ = shared.events.send(event);
            }
            // Without a durable record the outcome cannot be acknowledged; the entry stays
            // counted and is recovered (and retried) by the next open.
            Ok(Err(e)) => {
                tracing::error!(key = %next.key, error = %e, "write-back journal append failed")
            }
            Err(e) => {
                tracing::error!(key = %next.key, error = %e, "write-back journal task failed")
            }
        }
    }
}

async fn upload(shared: &Shared, e: &WritebackEntry) -> Result<()> {
    let c = &shared.cfg;
    let mut attempt = 0u32;
    loop {
        let r = upload_once(shared, e).await;
        match r {
            Ok(()) => return Ok(()),
            Err(err) if err.retryable() && shared.closed.load(Ordering::Acquire) => {
                // Closing: leave the entry pending in the journal for the next open.
                return Err(Error::new(ErrorKind::Closed, "write-back closed during retries")
                    .with_source(err));
            }
            Err(err) if err.retryable() && attempt < c.retries_max => {
                let backoff =
                    c.backoff_base_ms.saturating_mul(1 << attempt.min(20)).min(c.backoff_max_ms);
                tracing::debug!(key = %e.key, attempt, backoff_ms = backoff, error = %err, "write-back retry");
                tokio::time::sleep(Duration::from_millis(backoff)).await;
                attempt += 1;
            }
            Err(err) => {
                return Err(err.context(format!(
                    "write-back {:?} after {} attempts",
                    e.key,
                    attempt + 1
                )));
            }
        }
    }
}

async fn upload_once(shared: &Shared, e: &WritebackEntry) -> Result<()> {
    let data = shared.source.get(&e.key).await?;
    if data.len() as u64 != e.size_bytes || checksum(&data) != e.checksum {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "source holds other bytes for {:?} than were enqueued (changed or damaged)",
                e.key
            ),
        ));
    }
    let opts = PutOptions {
        mode: PutMode::Overwrite,
        persistence: e.persistence,
        checksum: Some(e.checksum),
        version: e.version,
        pin: e.pin,
    };
    let previous = e.previous.as_ref().map(|(k, v)| (k.as_str(), *v));
    shared.target.put_with_previous(&e.key, &data, opts, previous).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dram::DramMedium;
    use crate::fault::{Fault, FaultyMedium, Op};

    fn cfg(dir: &Path) -> WritebackConfig {
        WritebackConfig {
            backoff_base_ms: 1,
            backoff_max_ms: 2,
            ..WritebackConfig::new(dir.join("journal"))
        }
    }

    async fn put(m: &DramMedium, key: &str, len: usize) -> [u8; 32] {
        m.put(key, &vec![key.len() as u8; len], PutOptions::default()).await.unwrap().checksum
    }

    #[tokio::test]
    async fn back_pressure_is_a_busy_error() {
        let dir = tempfile::tempdir().unwrap();
        let src = Arc::new(DramMedium::new(1 << 20).unwrap());
        let dst = Arc::new(FaultyMedium::new(DramMedium::new(1 << 20).unwrap()));
        dst.inject(Op::Put, Fault::Fail(ErrorKind::Unavailable), 1000);
        let c = WritebackConfig {
            queue_entries_max: 2,
            queue_bytes_max: 10_000,
            retries_max: 1000,
            ..cfg(dir.path())
        };
        let (q, _, _rx) = WritebackQueue::open(c, src.clone(), dst.clone()).await.unwrap();
        let s = put(&src, "a", 10).await;
        q.enqueue("a", 10, s).await.unwrap();
        q.enqueue("a", 10, s).await.unwrap();
        assert_eq!(q.enqueue("a", 10, s).await.unwrap_err().kind(), ErrorKind::Busy);
        assert_eq!(q.depth(), (2, 20));
    }

    #[tokio::test]
    async fn retries_then_persists_or_reports() {
        let dir = tempfile::tempdir().unwrap();
        let src = Arc::new(DramMedium::new(1 << 20).unwrap());
        let dst = Arc::new(FaultyMedium::new(DramMedium::new(1 << 20).unwrap()));
        let c = WritebackConfig { retries_max: 2, workers: 1, ..cfg(dir.path()) };
        let (q, _, mut rx) = WritebackQueue::open(c, src.clone(), dst.clone()).await.unwrap();
        let s = put(&src, "ok", 100).await;
        dst.inject(Op::Put, Fault::Fail(ErrorKind::Io), 2);
        q.enqueue("ok", 100, s).await.unwrap();
        assert!(
            matches!(rx.recv().await.unwrap(), WritebackEvent::Persisted { ref key, .. } if key == "ok")
        );
        assert_eq!(dst.inner().get("ok").await.unwrap(), vec![2u8; 100]);

        let s = put(&src, "bad", 100).await;
        dst.inject(Op::Put, Fault::Fail(ErrorKind::Io), 3);
        q.enqueue("bad", 100, s).await.unwrap();
        match rx.recv().await.unwrap() {
            WritebackEvent::Failed { key, error, .. } => {
                assert_eq!(key, "bad");
                assert_eq!(error.kind(), ErrorKind::Io);
            }
            other => panic!("{other:?}"),
        }
        q.enqueue("gone", 5, [0; 32]).await.unwrap();
        match rx.recv().await.unwrap() {
            WritebackEvent::Failed { error, .. } => assert_eq!(error.kind(), ErrorKind::NotFound),
            other => panic!("{other:?}"),
        }
        assert_eq!(q.depth(), (0, 0));
        q.close().await;
    }

    #[tokio::test]
    async fn torn_tail_is_cut_and_pending_entries_survive() {
        let dir = tempfile::tempdir().unwrap();
        let src = Arc::new(DramMedium::new(1 << 20).unwrap());
        let dst = Arc::new(FaultyMedium::new(DramMedium::new(1 << 20).unwrap()));
        dst.inject(Op::Put, Fault::Fail(ErrorKind::Unavailable), 10_000);
        let c = WritebackConfig { retries_max: 10_000, workers: 1, ..cfg(dir.path()) };
        let (q, _, _rx) = WritebackQueue::open(c.clone(), src.clone(), dst.clone()).await.unwrap();
        for k in ["x", "y"] {
            let s = put(&src, k, 64).await;
            q.enqueue(k, 64, s).await.unwrap();
        }
        q.close().await;
        // A record cut short by a crash.
        let partial = &encode_record(KIND_PERSISTED, 1, None)[..7];
        OpenOptions::new().append(true).open(&c.journal_path).unwrap().write_all(partial).unwrap();
        dst.clear();
        let (q, rec, mut rx) = WritebackQueue::open(c, src.clone(), dst.clone()).await.unwrap();
        assert_eq!(rec.torn_tail_bytes, 7);
        let keys: Vec<&str> = rec.pending.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["x", "y"]);
        for _ in 0..2 {
            assert!(matches!(rx.recv().await.unwrap(), WritebackEvent::Persisted { .. }));
        }
        assert_eq!(dst.inner().get("y").await.unwrap(), vec![1u8; 64]);
        let next = q.enqueue("x", 64, checksum(&[1u8; 64])).await.unwrap();
        assert!(
            next > rec.pending.iter().map(|e| e.seq).max().unwrap(),
            "sequence numbers keep rising"
        );
    }

    #[test]
    fn replay_stops_at_any_damage() {
        let e = WritebackEntry {
            seq: 7,
            key: "k/\u{e9}".into(),
            size_bytes: 9,
            checksum: [3; 32],
            persistence: Persistence::Lazy,
            version: 9 << 20,
            pin: 1,
            previous: None,
        };
        let renamed =
            WritebackEntry { seq: 8, previous: Some(("old/\u{e9}".into(), 5)), ..e.clone() };
        let mut j = encode_record(enqueued_kind(&e), 7, Some(&e));
        j.extend(encode_record(enqueued_kind(&renamed), 8, Some(&renamed)));
        j.extend(encode_record(KIND_PERSISTED, 7, None));
        let (recs, valid) = replay(&j);
        assert_eq!((recs.len(), valid), (3, j.len()));
        assert!(matches!(&recs[0], Record::Enqueued(x) if *x == e));
        assert!(matches!(&recs[1], Record::Enqueued(x) if *x == renamed));
        for i in 0..j.len() {
            let mut bad = j.clone();
            bad[i] ^= 0x20;
            let (recs, _) = replay(&bad);
            assert!(recs.len() < 3, "flip at {i} went unnoticed");
        }
    }

    #[tokio::test]
    async fn a_renamed_object_is_uploaded_with_its_previous_name_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let src = Arc::new(DramMedium::new(1 << 20).unwrap());
        let dst = Arc::new(FaultyMedium::new(DramMedium::new(1 << 20).unwrap()));
        let s = put(&src, "new", 64).await;
        let meta = src.stat("new").await.unwrap();
        // The first queue never uploads (its target is down); a reopen finds the entry.
        dst.inject(Op::Put, Fault::Fail(ErrorKind::Unavailable), 1000);
        let c = WritebackConfig { retries_max: 1000, workers: 1, ..cfg(dir.path()) };
        let (q, _, _rx) = WritebackQueue::open(c.clone(), src.clone(), dst.clone()).await.unwrap();
        let bad = q.enqueue_meta("new", &meta, Some(("", 1))).await.unwrap_err();
        assert_eq!(bad.kind(), ErrorKind::InvalidArgument);
        q.enqueue_meta("new", &meta, Some(("old", 3))).await.unwrap();
        drop(q);
        dst.clear();
        let (_q, rec, mut rx) = WritebackQueue::open(c, src.clone(), dst.clone()).await.unwrap();
        assert_eq!(rec.pending.len(), 1);
        assert_eq!(rec.pending[0].previous, Some(("old".to_owned(), 3)));
        assert!(matches!(rx.recv().await.unwrap(), WritebackEvent::Persisted { .. }));
        assert_eq!(dst.inner().stat("new").await.unwrap().checksum, s);
        assert_eq!(dst.previous_name("new").await.unwrap(), Some(("old".to_owned(), 3)));
    }
}
