//! One event source: a publisher's ZeroMQ PUB stream (and its ROUTER replay endpoint), kept in
//! sequence and applied to the index.
//!
//! The wire (vLLM's and SGLang's `ZmqEventPublisher`, the reference store's publisher): PUB
//! multipart `[topic, seq as 8-byte big-endian, msgpack batch]`, `seq` counting from 0 per
//! publisher process. The replay endpoint is a ROUTER: a DEALER sends `[b"", start_seq]` and
//! gets `[b"", topic, seq, batch]` for every buffered batch from `start_seq` on, then
//! `[b"", b"", -1 as 8 bytes, b""]`.
//!
//! [`Sequencer`] (sans-IO) decides, batch by batch: apply it, skip a duplicate, replay a gap
//! (from the first missing sequence), or start over after a publisher restart (a live
//! sequence at or below the last live one: the engine's cache is gone with it, so its blocks
//! are cleared before the new stream applies). On first contact with a replay endpoint it
//! replays from 0, so a conductor that restarts rebuilds what the publishers still buffer. A
//! gap that the replay cannot fill (the publisher's buffer moved on, or no replay endpoint)
//! is counted as lost and the stream goes on: the index keeps what it knew (stale entries
//! only cost a routing hint; clearing would forget blocks the engine will never announce
//! again).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::event::decode_batch;
use crate::index::{ContextKey, OwnerKey};
use crate::service::{Registration, Shared};

/// What to do with a batch or a replay step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Apply the batch.
    Apply,
    /// Already applied: skip.
    Skip,
    /// Replay from this sequence, then hand the batch to [`Sequencer::replayed`] (a replay
    /// normally includes it, and it is then skipped).
    Replay(u64),
    /// The publisher restarted: clear its blocks, then handle the batch as a first contact
    /// (another step follows from [`Sequencer::live`]).
    Restarted,
}

#[derive(Debug, Default)]
pub struct Sequencer {
    /// The next sequence to apply (`None` before the first batch).
    next: Option<u64>,
    last_live: Option<u64>,
    can_replay: bool,
    /// Batches known lost (gaps nothing could fill).
    pub lost: u64,
    /// The last batch applied: its sequence and a digest of its bytes, to tell after a
    /// reconnect whether the publisher is the same process (its replay buffer still holds that
    /// exact batch) or a new one.
    pub last: Option<(u64, u64)>,
}

impl Sequencer {
    pub fn new(can_replay: bool) -> Sequencer {
        Sequencer { can_replay, ..Sequencer::default() }
    }

    /// A batch from the live stream. After `Restarted`, call again with the same batch.
    pub fn live(&mut self, seq: u64) -> Step {
        if self.last_live.is_some_and(|l| seq <= l) {
            self.last_live = None;
            self.next = None;
            return Step::Restarted;
        }
        self.last_live = Some(seq);
        match self.next {
            None if self.can_replay && seq > 0 => Step::Replay(0),
            None => {
                self.next = Some(seq + 1);
                Step::Apply
            }
            Some(n) if seq == n => {
                self.next = Some(n + 1);
                Step::Apply
            }
            Some(n) if seq < n => Step::Skip,
            Some(n) if self.can_replay => Step::Replay(n),
            Some(n) => {
                self.lost += seq - n;
                self.next = Some(seq + 1);
                Step::Apply
            }
        }
    }

    /// A batch from a replay.
    pub fn replayed(&mut self, seq: u64) -> Step {
        let n = self.next.unwrap_or(0);
        if seq < n {
            return Step::Skip;
        }
        self.lost += seq - n;
        self.next = Some(seq + 1);
        Step::Apply
    }

    /// Records that the batch `seq` with these bytes was applied.
    pub fn applied(&mut self, seq: u64, payload: &[u8]) {
        self.last = Some((seq, digest(payload)));
    }

    /// Forgets the stream (the publisher restarted): the next batch is a first contact.
    pub fn restart(&mut self) {
        let (can_replay, lost) = (self.can_replay, self.lost);
        *self = Sequencer { can_replay, lost, ..Sequencer::default() };
    }
}

/// A digest of a batch's bytes (FNV-1a; a batch carries its timestamp, so a new process's
/// batch under an old sequence number differs).
fn digest(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100000001b3))
}

/// A stream silent this long is reconnected (and, with a replay endpoint, resynchronised): a
/// subscriber cannot otherwise tell a quiet publisher from a vanished one.
const IDLE_RECONNECT: Duration = Duration::from_secs(3);

/// Runs one registration until `stop` fires: connect, subscribe, apply, reconnect when the
/// publisher goes away (bounded backoff).
pub async fn run(
    reg: Arc<Registration>,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut seq = Sequencer::new(reg.replay_endpoint.is_some());
    let mut backoff = Duration::from_millis(50);
    // Since when the publisher cannot be reached, and whether its blocks already expired.
    let mut unreachable: Option<tokio::time::Instant> = None;
    let mut expired = false;
    loop {
        if *stop.borrow() {
            return;
        }
        let session = tokio::spawn(session(reg.clone(), shared.clone(), std::mem::take(&mut seq)));
        let abort = session.abort_handle();
        tokio::select! {
            r = session => {
                let reached = match r {
                    Ok(Ok(s)) => { seq = s; true }
                    Ok(Err((s, e))) => {
                        seq = s;
                        tracing::debug!(endpoint = %reg.endpoint, error = %e, "kv event source");
                        false
                    }
                    // A panic inside the ZeroMQ library: start over with a fresh socket (the
                    // first batch then replays from 0; applying twice changes nothing).
                    Err(e) => {
                        seq = Sequencer::new(reg.replay_endpoint.is_some());
                        tracing::warn!(endpoint = %reg.endpoint, error = %e, "kv event source failed");
                        false
                    }
                };
                if reached {
                    backoff = Duration::from_millis(50);
                    (unreachable, expired) = (None, false);
                } else {
                    shared.metrics.reconnects.fetch_add(1, Ordering::Relaxed);
                    let since = *unreachable.get_or_insert_with(tokio::time::Instant::now);
                    if !expired && since.elapsed() >= shared.source_ttl {
                        // A publisher gone this long took its engine's cache with it.
                        tracing::warn!(endpoint = %reg.endpoint, "kv event source unreachable: its blocks expire");
                        clear(&reg, &shared);
                        shared.metrics.expired.fetch_add(1, Ordering::Relaxed);
                        expired = true;
                    }
                }
            }
            _ = stop.changed() => { abort.abort(); return; }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

type SessionResult = Result<Sequencer, (Sequencer, String)>;

/// One connection's life: returns the sequencer (so sequence state survives a reconnect) when
/// the publisher disconnects.
async fn session(reg: Arc<Registration>, shared: Arc<Shared>, mut seq: Sequencer) -> SessionResult {
    let mut sub = zeromq::SubSocket::new();
    let mut monitor = sub.monitor();
    let connect = tokio::time::timeout(Duration::from_secs(2), sub.connect(&reg.endpoint)).await;
    match connect {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err((seq, format!("connect: {e}"))),
        Err(_) => return Err((seq, "connect timed out".into())),
    }
    if let Err(e) = sub.subscribe("").await {
        return Err((seq, format!("subscribe: {e}")));
    }
    shared.metrics.connects.fetch_add(1, Ordering::Relaxed);
    resync(&reg, &shared, &mut seq).await;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(IDLE_RECONNECT) => return Ok(seq),
            m = sub.recv() => {
                let m = match m {
                    Ok(m) => m,
                    Err(e) => return Err((seq, format!("receive: {e}"))),
                };
                let Some((s, payload)) = frames(&m) else {
                    shared.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                live(&reg, &shared, &mut seq, s, payload).await;
            }
            ev = monitor.recv() => {
                match ev {
                    Ok(zeromq::SocketEvent::Disconnected(_)) | Err(_) => return Ok(seq),
                    Ok(_) => {}
                }
            }
        }
    }
}

/// `[topic, seq, payload]` of a PUB message.
fn frames(m: &ZmqMessage) -> Option<(u64, &[u8])> {
    if m.len() != 3 {
        return None;
    }
    let s: [u8; 8] = m.get(1)?.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(s), m.get(2)?.as_ref()))
}

async fn live(reg: &Registration, shared: &Shared, seq: &mut Sequencer, s: u64, payload: &[u8]) {
    let mut step = seq.live(s);
    if step == Step::Restarted {
        shared.metrics.restarts.fetch_add(1, Ordering::Relaxed);
        clear(reg, shared);
        step = seq.live(s);
    }
    match step {
        Step::Apply => {
            apply(reg, shared, payload);
            seq.applied(s, payload);
        }
        Step::Skip => {
            shared.metrics.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        Step::Replay(from) => {
            if from > 0 {
                shared.metrics.gaps.fetch_add(1, Ordering::Relaxed);
            }
            replay(reg, shared, seq, from).await;
            // The batch that showed the gap, in case the replay did not bring it.
            feed(reg, shared, seq, [(s, payload)]);
        }
        Step::Restarted => {}
    }
}

/// After a (re)connect: asks the publisher for its batches from the last one applied (from 0
/// when none was: ZeroMQ drops what a PUB sends before a SUB has taken hold). The same process
/// answers with that exact batch first, and the rest follow as a replay; anything else means
/// a new process: its predecessor's blocks are cleared and its stream replayed from 0.
async fn resync(reg: &Registration, shared: &Shared, seq: &mut Sequencer) {
    let Some((last, dig)) = seq.last else {
        return replay(reg, shared, seq, 0).await;
    };
    let Some(batches) = fetch_replay(reg, shared, last).await else { return };
    let same = batches.first().is_some_and(|(s, p)| *s == last && digest(p) == dig);
    if same {
        return feed(reg, shared, seq, batches.iter().map(|(s, p)| (*s, p.as_slice())));
    }
    shared.metrics.restarts.fetch_add(1, Ordering::Relaxed);
    clear(reg, shared);
    seq.restart();
    replay(reg, shared, seq, 0).await;
}

/// Applies replayed batches in order through the sequencer, counting the batches it finds lost.
fn feed<'a>(
    reg: &Registration,
    shared: &Shared,
    seq: &mut Sequencer,
    batches: impl IntoIterator<Item = (u64, &'a [u8])>,
) {
    let lost = seq.lost;
    for (s, p) in batches {
        if seq.replayed(s) == Step::Apply {
            apply(reg, shared, p);
            seq.applied(s, p);
        }
    }
    shared.metrics.lost.fetch_add(seq.lost - lost, Ordering::Relaxed);
}

/// Fetches and applies the publisher's buffered batches from `from` on.
async fn replay(reg: &Registration, shared: &Shared, seq: &mut Sequencer, from: u64) {
    if let Some(batches) = fetch_replay(reg, shared, from).await {
        feed(reg, shared, seq, batches.iter().map(|(s, p)| (*s, p.as_slice())));
    }
}

/// Most batches one replay takes (a publisher buffers 10,000 by default).
const REPLAY_BATCHES_MAX: usize = 100_000;

/// The publisher's buffered batches from `from` on, within 5 s; `None` when there is no
/// replay endpoint or it did not answer whole.
async fn fetch_replay(
    reg: &Registration,
    shared: &Shared,
    from: u64,
) -> Option<Vec<(u64, Vec<u8>)>> {
    let ep = reg.replay_endpoint.as_deref()?;
    shared.metrics.replays.fetch_add(1, Ordering::Relaxed);
    let mut dealer = zeromq::DealerSocket::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    if !matches!(tokio::time::timeout_at(deadline, dealer.connect(ep)).await, Ok(Ok(()))) {
        tracing::warn!(endpoint = ep, "kv event replay: cannot connect");
        return None;
    }
    let req: Vec<bytes::Bytes> =
        vec![bytes::Bytes::new(), bytes::Bytes::copy_from_slice(&from.to_be_bytes())];
    let req = ZmqMessage::try_from(req).ok()?;
    if !matches!(tokio::time::timeout_at(deadline, dealer.send(req)).await, Ok(Ok(()))) {
        return None;
    }
    let mut out = Vec::new();
    loop {
        let m = match tokio::time::timeout_at(deadline, dealer.recv()).await {
            Ok(Ok(m)) => m,
            _ => {
                tracing::warn!(endpoint = ep, "kv event replay ended without its end marker");
                return None;
            }
        };
        // [b"", topic, seq, payload]; the end marker has seq -1.
        let s = m.get(2).and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok());
        let (Some(s), Some(p), 4) = (s, m.get(3), m.len()) else {
            shared.metrics.malformed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if s == (-1i64).to_be_bytes() {
            return Some(out);
        }
        if out.len() >= REPLAY_BATCHES_MAX {
            return Some(out);
        }
        shared.metrics.replayed.fetch_add(1, Ordering::Relaxed);
        out.push((u64::from_be_bytes(s), p.to_vec()));
    }
}

fn owner_key(reg: &Registration, dp_rank: Option<u32>) -> OwnerKey {
    OwnerKey { instance: reg.instance_id.clone(), dp_rank: dp_rank.unwrap_or(reg.dp_rank) }
}

fn clear(reg: &Registration, shared: &Shared) {
    let mut ix = shared.index.lock().unwrap_or_else(|e| e.into_inner());
    let key = owner_key(reg, None);
    let id = ix.owner(&key, reg.shared());
    ix.clear_owner(id);
}

fn apply(reg: &Registration, shared: &Shared, payload: &[u8]) {
    let batch = match decode_batch(payload) {
        Ok(b) => b,
        Err(e) => {
            shared.metrics.malformed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(instance = %reg.instance_id, error = %e, "kv event batch refused");
            return;
        }
    };
    let m = &shared.metrics;
    m.batches.fetch_add(1, Ordering::Relaxed);
    m.events.fetch_add(batch.events.len() as u64, Ordering::Relaxed);
    m.skipped.fetch_add(batch.skipped as u64, Ordering::Relaxed);
    let mut ix = shared.index.lock().unwrap_or_else(|e| e.into_inner());
    let key = owner_key(reg, batch.dp_rank);
    let id = ix.owner(&key, reg.shared());
    let mut learn = Vec::new();
    for ev in &batch.events {
        let (bs, lora) = match ev {
            crate::event::Event::Stored { block_size, lora_name, .. } => {
                (block_size.unwrap_or(reg.block_size), lora_name.clone())
            }
            _ => (reg.block_size, None),
        };
        let ctx = ContextKey {
            tenant: reg.tenant_id.clone(),
            model: reg.modelname.clone(),
            lora: lora.or_else(|| reg.lora_name.clone()).unwrap_or_default(),
            block_size: bs,
        };
        ix.apply(id, &ctx, ev);
        if matches!(ev, crate::event::Event::Stored { token_ids, .. } if !token_ids.is_empty()) {
            learn.push((ctx, ev));
        }
    }
    drop(ix);
    // The blocks' tokens teach token queries their chain steps (outside the index's lock).
    for (ctx, ev) in learn {
        shared.learn_steps(&ctx, ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_batches_apply_and_gaps_replay() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.live(0), Step::Apply);
        assert_eq!(s.live(1), Step::Apply);
        assert_eq!(s.live(4), Step::Replay(2));
        assert_eq!(s.replayed(2), Step::Apply);
        assert_eq!(s.replayed(3), Step::Apply);
        assert_eq!(s.replayed(4), Step::Apply);
        assert_eq!(s.replayed(4), Step::Skip);
        assert_eq!(s.live(5), Step::Apply);
        assert_eq!(s.lost, 0);
    }

    #[test]
    fn a_late_joiner_replays_from_zero_and_a_restart_starts_over() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.live(7), Step::Replay(0));
        // The publisher's buffer starts at 5: 0..5 are lost.
        assert_eq!(s.replayed(5), Step::Apply);
        assert_eq!(s.lost, 5);
        assert_eq!(s.replayed(6), Step::Apply);
        assert_eq!(s.replayed(7), Step::Apply);
        assert_eq!(s.live(0), Step::Restarted);
        assert_eq!(s.live(0), Step::Apply);
        assert_eq!(s.live(1), Step::Apply);
    }

    #[test]
    fn without_replay_gaps_are_counted_lost() {
        let mut s = Sequencer::new(false);
        assert_eq!(s.live(3), Step::Apply);
        assert_eq!(s.live(6), Step::Apply);
        assert_eq!(s.lost, 2);
    }
}
