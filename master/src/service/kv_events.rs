//! The pool's KV events on the network: the directory's journal (`directory/events.rs`)
//! published over ZeroMQ the way vLLM's `ZmqEventPublisher` and the reference store's master
//! publish theirs, so the conductor (or the reference's) indexes the pool as a shared holder.
//!
//! Wire. PUB, multipart `[topic, seq as 8-byte big-endian, msgpack batch]`, `seq` counting
//! from 0 per master process; the batch is `[timestamp (f64 seconds), [events], dp_rank]`.
//! Each event is a map: `type` (`BlockStored` / `BlockRemoved`, the engines' tags, with
//! `emit_legacy_compat`), `event_type` (`stored` / `removed`), `block_hashes` (with
//! `emit_legacy_compat`) and `seq_hashes`: both `[key as u64]` when the key is a decimal or
//! `0x` hexadecimal u64, else `[]`; `object_key` (the key, with `emit_object_key` or when it
//! is not numeric); `medium` (`cpu` / `disk`); then `backend_id`, `model_name`, `tenant_id`,
//! `block_size`, `lora_name` where configured. The replay endpoint is a ROUTER: a DEALER's
//! `[b"", start_seq]` is answered with `[b"", topic, seq, batch]` for every buffered batch
//! from `start_seq` on, then `[b"", b"", -1 as 8 bytes, b""]` (vLLM's protocol).
//!
//! Mechanism. A pump task wakes every `batch_interval_ms`, drains the journal under the
//! directory lock (bounded: `batch_events_max` events a batch, a few batches a wake), encodes
//! outside it, numbers the batches and appends them to the replay buffer (at most
//! `replay_batches_max`, oldest dropped). The PUB task sends from that buffer by sequence, so
//! a PUB socket restarted after a failure resumes where it was (or at the oldest buffered
//! batch). The `zeromq` crate panics (`todo!`) on some unexpected peer behaviour: each socket
//! runs in a task of its own that a supervisor restarts, so the master never goes down with it.
//!
//! Not handled here: subscriptions by topic (one empty topic), the `cleared` event (a master
//! restart starts the sequence at 0 again, which subscribers take as a publisher restart).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::State;
use crate::{PoolEvent, PoolEventKind};

/// Settings of the publisher (`kvfs master --kv-events-*`, the reference's `--kv_events_*`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// ZeroMQ PUB endpoint to bind (`tcp://0.0.0.0:5557`).
    pub endpoint: String,
    /// ROUTER endpoint answering replay requests; `None`: no replay.
    pub replay_endpoint: Option<String>,
    /// Journalled events at most, oldest dropped past it.
    pub queue_max: usize,
    /// Batches kept for replay.
    pub replay_batches_max: usize,
    /// Events per batch at most.
    pub batch_events_max: usize,
    /// How often the journal is drained.
    pub batch_interval_ms: u64,
    pub topic: String,
    pub backend_id: Option<String>,
    pub model_name: Option<String>,
    pub tenant_id: Option<String>,
    pub block_size: Option<u32>,
    pub lora_name: Option<String>,
    pub dp_rank: u32,
    /// Name the key in every event, not only in those of non-numeric keys.
    pub emit_object_key: bool,
    /// Also carry the engines' field names (`type`, `block_hashes`).
    pub emit_legacy_compat: bool,
}

impl KvEventsConfig {
    /// A publisher on `endpoint` with the reference's defaults.
    pub fn new(endpoint: impl Into<String>) -> Self {
        KvEventsConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            queue_max: 65_536,
            replay_batches_max: 10_000,
            batch_events_max: 256,
            batch_interval_ms: 10,
            topic: String::new(),
            backend_id: None,
            model_name: None,
            tenant_id: None,
            block_size: None,
            lora_name: None,
            dp_rank: 0,
            emit_object_key: true,
            emit_legacy_compat: true,
        }
    }

    /// The replay endpoint by default: the PUB endpoint's port plus one.
    pub fn default_replay_endpoint(endpoint: &str) -> Option<String> {
        let (head, port) = endpoint.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        Some(format!("{head}:{}", port.checked_add(1)?))
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub events: AtomicU64,
    pub batches: AtomicU64,
    pub sent: AtomicU64,
    pub replay_requests: AtomicU64,
    pub restarts: AtomicU64,
}

/// The publisher's shared state: the replay buffer and counters.
pub(crate) struct Publisher {
    cfg: KvEventsConfig,
    /// `(seq, payload)`, in sequence order.
    buffer: Mutex<VecDeque<(u64, Bytes)>>,
    next_seq: AtomicU64,
    wake: tokio::sync::Notify,
    pub counters: Counters,
}

impl Publisher {
    pub fn new(cfg: KvEventsConfig) -> Publisher {
        Publisher {
            cfg,
            buffer: Mutex::new(VecDeque::new()),
            next_seq: AtomicU64::new(0),
            wake: tokio::sync::Notify::new(),
            counters: Counters::default(),
        }
    }

    fn buffer(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, Bytes)>> {
        self.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Buffered batches from `from` on (at most `max`).
    fn since(&self, from: u64, max: usize) -> Vec<(u64, Bytes)> {
        let b = self.buffer();
        let start = b.partition_point(|(s, _)| *s < from);
        b.range(start..).take(max).cloned().collect()
    }

    /// Numbers and buffers one encoded batch.
    fn push(&self, payload: Bytes) {
        let mut b = self.buffer();
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        if b.len() >= self.cfg.replay_batches_max.max(1) {
            b.pop_front();
        }
        b.push_back((seq, payload));
    }
}

/// The 64-bit hash a key stands for: a decimal or `0x` hexadecimal u64.
pub fn key_hash(key: &str) -> Option<u64> {
    if let Some(hex) = key.strip_prefix("0x").or_else(|| key.strip_prefix("0X")) {
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        return u64::from_str_radix(hex, 16).ok();
    }
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    key.parse().ok()
}

fn encode_event(cfg: &KvEventsConfig, e: &PoolEvent) -> Value {
    let (tag, kind) = match e.kind {
        PoolEventKind::Stored => ("BlockStored", "stored"),
        PoolEventKind::Removed => ("BlockRemoved", "removed"),
    };
    let hash = key_hash(&e.key);
    let hashes = Value::Array(hash.map(Value::from).into_iter().collect());
    let mut m: Vec<(Value, Value)> = Vec::with_capacity(12);
    let mut field = |k: &str, v: Value| m.push((Value::from(k), v));
    if cfg.emit_legacy_compat {
        field("type", tag.into());
    }
    field("event_type", kind.into());
    if cfg.emit_legacy_compat {
        field("block_hashes", hashes.clone());
    }
    field("seq_hashes", hashes);
    if cfg.emit_object_key || hash.is_none() {
        field("object_key", Value::from(&*e.key));
    }
    field("medium", e.medium.name().into());
    let strings = [
        ("backend_id", &cfg.backend_id),
        ("model_name", &cfg.model_name),
        ("tenant_id", &cfg.tenant_id),
    ];
    for (k, v) in strings {
        if let Some(v) = v {
            field(k, Value::from(v.as_str()));
        }
    }
    if let Some(b) = cfg.block_size {
        field("block_size", b.into());
    }
    if let Some(l) = &cfg.lora_name {
        field("lora_name", Value::from(l.as_str()));
    }
    Value::Map(m)
}

/// One msgpack batch `[ts, [events], dp_rank]`.
pub fn encode_batch(cfg: &KvEventsConfig, ts: f64, events: &[PoolEvent]) -> Vec<u8> {
    let events = events.iter().map(|e| encode_event(cfg, e)).collect();
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events), cfg.dp_rank.into()]);
    let mut out = Vec::with_capacity(64);
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Batches drained per wake at most (the rest wait for the next one, 10 ms later).
const BATCHES_PER_WAKE_MAX: usize = 64;

/// Drains the journal into numbered batches.
pub(crate) async fn pump(state: Arc<State>, publisher: Arc<Publisher>) {
    let cfg = &publisher.cfg;
    let mut every = tokio::time::interval(Duration::from_millis(cfg.batch_interval_ms.max(1)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let per_batch = cfg.batch_events_max.max(1);
    loop {
        every.tick().await;
        for _ in 0..BATCHES_PER_WAKE_MAX {
            let events = state.lock().drain_pool_events(per_batch);
            if events.is_empty() {
                break;
            }
            let payload = encode_batch(cfg, now_s(), &events);
            let c = &publisher.counters;
            c.events.fetch_add(events.len() as u64, Ordering::Relaxed);
            c.batches.fetch_add(1, Ordering::Relaxed);
            publisher.push(Bytes::from(payload));
            publisher.wake.notify_one();
            if events.len() < per_batch {
                break;
            }
        }
    }
}

/// Runs `task` again whenever it ends or panics (the `zeromq` crate's `todo!`s), with a
/// bounded backoff; the task is aborted when this future is dropped.
pub(crate) async fn supervise<F, Fut>(what: &'static str, publisher: Arc<Publisher>, task: F)
where
    F: Fn(Arc<Publisher>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let mut backoff = Duration::from_millis(50);
    loop {
        let handle = tokio::spawn(task(publisher.clone()));
        let _guard = AbortOnDrop(handle.abort_handle());
        match handle.await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => tracing::warn!(socket = what, error = %e, "kv event publisher"),
            Err(e) => tracing::error!(socket = what, error = %e, "kv event publisher failed"),
        }
        publisher.counters.restarts.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn message(frames: Vec<Bytes>) -> Result<ZmqMessage, String> {
    ZmqMessage::try_from(frames).map_err(|e| format!("message: {e:?}"))
}

/// The PUB socket: sends every buffered batch in sequence.
pub(crate) async fn publish(publisher: Arc<Publisher>) -> Result<(), String> {
    let cfg = &publisher.cfg;
    let mut socket = zeromq::PubSocket::new();
    socket.bind(&cfg.endpoint).await.map_err(|e| format!("bind {}: {e}", cfg.endpoint))?;
    tracing::info!(endpoint = %cfg.endpoint, "kv event publisher bound");
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    // Resume after what is buffered: a restarted socket does not resend the past (subscribers
    // replay what they missed).
    let mut next = publisher.next_seq.load(Ordering::Relaxed);
    loop {
        let notified = publisher.wake.notified();
        let batches = publisher.since(next, 256);
        if batches.is_empty() {
            notified.await;
            continue;
        }
        for (seq, payload) in batches {
            let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
            socket.send(message(frames)?).await.map_err(|e| format!("send: {e}"))?;
            publisher.counters.sent.fetch_add(1, Ordering::Relaxed);
            next = seq + 1;
        }
    }
}

/// The ROUTER socket answering replay requests.
pub(crate) async fn serve_replay(publisher: Arc<Publisher>) -> Result<(), String> {
    let Some(ep) = publisher.cfg.replay_endpoint.clone() else { return Ok(()) };
    let mut socket = zeromq::RouterSocket::new();
    socket.bind(&ep).await.map_err(|e| format!("bind {ep}: {e}"))?;
    tracing::info!(endpoint = %ep, "kv event replay bound");
    let topic = Bytes::from(publisher.cfg.topic.clone().into_bytes());
    loop {
        let m = socket.recv().await.map_err(|e| format!("receive: {e}"))?;
        // [identity, b"", start_seq]
        let (Some(id), Some(start)) = (m.get(0).cloned(), m.get(m.len() - 1)) else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::debug!(frames = m.len(), "kv event replay: malformed request");
            continue;
        };
        publisher.counters.replay_requests.fetch_add(1, Ordering::Relaxed);
        let mut from = u64::from_be_bytes(start);
        'replay: loop {
            let batches = publisher.since(from, 256);
            let Some(last) = batches.last().map(|b| b.0) else { break };
            for (seq, payload) in batches {
                let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
                let frames = vec![id.clone(), Bytes::new(), topic.clone(), seq, payload];
                if let Err(e) = socket.send(message(frames)?).await {
                    tracing::debug!(error = %e, "kv event replay: peer gone");
                    break 'replay;
                }
            }
            from = last + 1;
        }
        let end = Bytes::copy_from_slice(&(-1i64).to_be_bytes());
        let frames = vec![id, Bytes::new(), Bytes::new(), end, Bytes::new()];
        if let Err(e) = socket.send(message(frames)?).await {
            tracing::debug!(error = %e, "kv event replay: peer gone");
        }
    }
}

/// The publisher's figures in Prometheus text (nothing when disabled).
pub(crate) fn render(state: &State, o: &mut String) {
    use std::fmt::Write;
    let Some(p) = &state.kv_events else { return };
    let journal = state.lock().pool_event_stats();
    let c = &p.counters;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let rows: [(&str, &str, &str, u64); 8] = [
        (
            "kvfs_master_kv_events_recorded_total",
            "counter",
            "Pool events journalled.",
            journal.recorded,
        ),
        (
            "kvfs_master_kv_events_dropped_total",
            "counter",
            "Pool events dropped, oldest first, because the queue was full.",
            journal.dropped,
        ),
        (
            "kvfs_master_kv_events_queued",
            "gauge",
            "Pool events waiting to be published.",
            journal.queued,
        ),
        (
            "kvfs_master_kv_events_published_total",
            "counter",
            "Pool events published in batches.",
            load(&c.events),
        ),
        (
            "kvfs_master_kv_events_batches_total",
            "counter",
            "Batches numbered and buffered for publishing.",
            load(&c.batches),
        ),
        (
            "kvfs_master_kv_events_sent_total",
            "counter",
            "Batches sent on the PUB socket.",
            load(&c.sent),
        ),
        (
            "kvfs_master_kv_events_replay_requests_total",
            "counter",
            "Replay requests answered.",
            load(&c.replay_requests),
        ),
        (
            "kvfs_master_kv_events_socket_restarts_total",
            "counter",
            "Publisher sockets restarted after a failure.",
            load(&c.restarts),
        ),
    ];
    for (name, kind, help, v) in rows {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolMedium;

    #[test]
    fn keys_parse_as_decimal_or_hex_u64() {
        assert_eq!(key_hash("12345"), Some(12345));
        assert_eq!(key_hash("0x2a"), Some(42));
        assert_eq!(key_hash("0XFF"), Some(255));
        assert_eq!(key_hash("18446744073709551615"), Some(u64::MAX));
        for bad in ["", "0x", "-1", "+1", "1e3", "18446744073709551616", "0x1g", "a/1", " 1"] {
            assert_eq!(key_hash(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn batches_encode_the_reference_shape() {
        let mut cfg = KvEventsConfig::new("tcp://127.0.0.1:1");
        cfg.emit_object_key = false;
        cfg.model_name = Some("m".into());
        cfg.block_size = Some(16);
        cfg.dp_rank = 2;
        let ev = |kind, key: &str, medium| PoolEvent { kind, key: key.into(), medium };
        let events = [
            ev(PoolEventKind::Stored, "0x2a", PoolMedium::Cpu),
            ev(PoolEventKind::Removed, "a/b", PoolMedium::Disk),
        ];
        let payload = encode_batch(&cfg, 1.5, &events);
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let items = v.as_array().unwrap();
        assert_eq!(items[0].as_f64(), Some(1.5));
        assert_eq!(items[2].as_u64(), Some(2));
        let get = |e: &Value, k: &str| -> Option<Value> {
            e.as_map()?.iter().find(|(n, _)| n.as_str() == Some(k)).map(|(_, v)| v.clone())
        };
        let evs = items[1].as_array().unwrap();
        assert_eq!(get(&evs[0], "type"), Some(Value::from("BlockStored")));
        assert_eq!(get(&evs[0], "event_type"), Some(Value::from("stored")));
        assert_eq!(get(&evs[0], "block_hashes"), Some(Value::Array(vec![42u64.into()])));
        assert_eq!(get(&evs[0], "seq_hashes"), Some(Value::Array(vec![42u64.into()])));
        assert_eq!(get(&evs[0], "object_key"), None);
        assert_eq!(get(&evs[0], "medium"), Some(Value::from("cpu")));
        assert_eq!(get(&evs[0], "model_name"), Some(Value::from("m")));
        assert_eq!(get(&evs[0], "block_size"), Some(Value::from(16u32)));
        assert_eq!(get(&evs[0], "tenant_id"), None);
        assert_eq!(get(&evs[1], "type"), Some(Value::from("BlockRemoved")));
        assert_eq!(get(&evs[1], "seq_hashes"), Some(Value::Array(vec![])));
        assert_eq!(get(&evs[1], "object_key"), Some(Value::from("a/b")));
        assert_eq!(get(&evs[1], "medium"), Some(Value::from("disk")));
    }

    #[test]
    fn the_replay_buffer_is_bounded_and_read_from_a_sequence() {
        let mut cfg = KvEventsConfig::new("tcp://127.0.0.1:1");
        cfg.replay_batches_max = 3;
        let p = Publisher::new(cfg);
        for i in 0..5u8 {
            p.push(Bytes::from(vec![i]));
        }
        let seqs = |v: Vec<(u64, Bytes)>| v.into_iter().map(|b| b.0).collect::<Vec<_>>();
        assert_eq!(seqs(p.since(0, 10)), [2, 3, 4]);
        assert_eq!(seqs(p.since(3, 10)), [3, 4]);
        assert_eq!(seqs(p.since(5, 10)), Vec::<u64>::new());
        assert_eq!(p.since(4, 10)[0].1, Bytes::from(vec![4u8]));
        assert_eq!(
            KvEventsConfig::default_replay_endpoint("tcp://0.0.0.0:5557").as_deref(),
            Some("tcp://0.0.0.0:5558")
        );
    }
}
