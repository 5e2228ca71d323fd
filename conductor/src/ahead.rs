//! A long token chain's CBOR encoded ahead of its hashing, on a second core.
//!
//! Why: a `sha256_cbor` chain step is the CBOR of `(parent, tokens, None)` and SHA-256 over it.
//! SHA-256 is serial along the chain (each block's message starts with its parent's digest),
//! but the CBOR of a block's tokens depends on the tokens alone. On the project's VM a cold
//! 128k-token query at block size 512 spends about 340 us in SHA-256 and 185-220 us encoding
//! CBOR, one after the other on one core. Here a helper thread encodes blocks ahead while the
//! query's thread hashes, so the chain costs about what its SHA-256 does.
//!
//! Mechanism: the blocks are grouped in chunks of about [`CHUNK_TOKENS`] tokens, each behind
//! its own mutex. The helper walks the chunks from the one after the chain's, encodes each it
//! can lock that is not encoded yet, and skips one that is locked (the chain is on it). The
//! chain locks the chunk of the block it hashes, encodes it itself if the helper has not, and
//! hashes the block's items from there; where the helper holds that chunk (encoding it), the
//! chain encodes the block alone as without a helper. So the chain never waits for the helper
//! (a helper that lost its core mid-chunk would otherwise stall it for a scheduler slice): at
//! worst it does what it did alone, plus a lock per block. The helper stops at the last chunk
//! or when told to ([`Ahead::stop`]); its wasted work is bounded by the prompt (a chain that
//! stops early, at the first block the index lacks, leaves the rest).
//!
//! Helpers are kept threads ([`Crew`]): a query hands its [`Ahead`] (which owns what it reads:
//! the prompt's bytes, shared with the request's buffer) to a parked one, and never waits for
//! it: at the chain's end it only tells it to stop. Starting a thread per query put its start
//! on the chain's path, 16-20 us p50 and 38-58 us p99 on the project's VM, and a scoped thread
//! had to be joined before the query could answer. At most one fewer helpers than the machine
//! has cores exist; a query that finds them all busy hashes alone.
//!
//! Not used: for chains that are short or of small blocks (the hand-off or the locks would cost
//! more than they save, see [`worth_it`]), for shapes other than `sha256_cbor` without extra
//! keys, and on a machine of one core.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};

use bytes::Bytes;

/// Tokens per chunk: large enough that a lock is rare against the encoding (a few
/// microseconds of work), small enough that the helper gets ahead of the chain at once.
const CHUNK_TOKENS: usize = 2048;

/// Fewest tokens still to hash for which a helper pays (waking one and setting up the chunks
/// costs a few microseconds; encoding is about 1.5 ns a token).
const MIN_TOKENS: usize = 16_384;

/// Fewest tokens a block for which a helper pays: a small block's encoding is too short
/// against its SHA-256 (two compressions at 16 tokens) for the chunk's lock and the copy of its
/// items to be worth it. A cold 128k-token `/query` (`kvfs bench conductor`, p50 with against
/// without, one VM): 1,459 against 1,491 us at 16 tokens a block, 953 / 1,103 at 64, 835 / 976
/// at 128, 760 / 870 at 256, 752 / 857 at 512.
const MIN_BLOCK_TOKENS: usize = 64;

/// Whether a chain with `tokens` still to hash in blocks of `block_tokens` is worth a helper,
/// `sure` of them sure to be hashed (up to the next check against the index, where the chain
/// may stop): at least two chunks, else the next miss asks again.
pub(crate) fn worth_it(tokens: usize, sure: usize, block_tokens: usize) -> bool {
    tokens >= MIN_TOKENS && sure >= 2 * CHUNK_TOKENS && block_tokens >= MIN_BLOCK_TOKENS
}

/// One chunk's encoded items: every block's CBOR token values back to back.
#[derive(Default)]
struct Chunk {
    encoded: bool,
    items: Vec<u8>,
    /// Where each block's items end in `items`.
    ends: Vec<usize>,
}

/// The blocks of a chain (little-endian 32-bit token ids each), encoded ahead.
pub(crate) struct Ahead {
    /// The blocks' bytes, back to back (whole blocks only).
    tokens: Bytes,
    block_bytes: usize,
    per_chunk: usize,
    chunks: Vec<Mutex<Chunk>>,
    /// The chunk the chain is on.
    at: AtomicUsize,
    stop: AtomicBool,
}

impl Ahead {
    /// For the blocks of `block_tokens` tokens (at least one) that `tokens` holds (a partial
    /// block at the end is left out).
    pub(crate) fn new(tokens: Bytes, block_tokens: usize) -> Self {
        let block_bytes = 4 * block_tokens.max(1);
        let blocks = tokens.len() / block_bytes;
        let per_chunk = (CHUNK_TOKENS / block_tokens.max(1)).max(1);
        let chunks = (0..blocks.div_ceil(per_chunk)).map(|_| Mutex::default()).collect();
        Ahead {
            tokens,
            block_bytes,
            per_chunk,
            chunks,
            at: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }

    fn blocks(&self) -> usize {
        self.tokens.len() / self.block_bytes
    }

    /// The helper's work: encode the chunks ahead of the chain until the last or a stop.
    pub(crate) fn run(&self) {
        let mut c = 1;
        while !self.stop.load(Ordering::Relaxed) {
            c = c.max(self.at.load(Ordering::Relaxed) + 1);
            let Some(m) = self.chunks.get(c) else { break };
            if let Ok(mut chunk) = m.try_lock()
                && !chunk.encoded
            {
                self.encode(c, &mut chunk);
            }
            c += 1;
        }
    }

    /// Tells the helper to stop after the chunk it is on.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Block `i`'s tokens as CBOR items (no array head), encoding its chunk here if the
    /// helper has not; `None` while the helper is encoding it (the caller encodes the block
    /// itself rather than wait on a thread that may have lost its core).
    pub(crate) fn items(&self, i: usize) -> Option<Items<'_>> {
        let c = i / self.per_chunk;
        self.at.store(c, Ordering::Relaxed);
        let mut chunk = match self.chunks[c].try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        if !chunk.encoded {
            self.encode(c, &mut chunk);
        }
        let k = i % self.per_chunk;
        let start = if k == 0 { 0 } else { chunk.ends[k - 1] };
        let end = chunk.ends[k];
        Some(Items { chunk, start, end })
    }

    fn encode(&self, c: usize, chunk: &mut Chunk) {
        let first = c * self.per_chunk;
        let last = (first + self.per_chunk).min(self.blocks());
        let bytes = &self.tokens[first * self.block_bytes..last * self.block_bytes];
        chunk.items.resize(5 * bytes.len() / 4, 0);
        chunk.ends.clear();
        let mut p = 0;
        for b in bytes.chunks_exact(self.block_bytes) {
            p = crate::hash::put_le_token_values(&mut chunk.items, p, b);
            chunk.ends.push(p);
        }
        chunk.encoded = true;
    }
}

/// A block's encoded items, its chunk held (the helper skips it meanwhile).
pub(crate) struct Items<'c> {
    chunk: MutexGuard<'c, Chunk>,
    start: usize,
    end: usize,
}

impl std::ops::Deref for Items<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.chunk.items[self.start..self.end]
    }
}

/// The kept helper threads, at most one fewer than the machine's cores (none when off).
#[derive(Debug)]
pub(crate) struct Crew(Arc<CrewState>);

#[derive(Debug)]
struct CrewState {
    /// Each parked helper's hand-off (a helper is here only while it waits for work).
    idle: Mutex<Vec<SyncSender<Job>>>,
    /// Helper threads alive.
    started: AtomicUsize,
    max: AtomicUsize,
}

/// A chain to encode ahead, and the way back to the idle list for the helper that takes it.
struct Job {
    ahead: Arc<Ahead>,
    back: SyncSender<Job>,
}

impl Crew {
    /// One fewer helpers than the machine's cores (none on one core) if `on`, else none.
    pub(crate) fn for_this_machine(on: bool) -> Self {
        let c = Crew(Arc::new(CrewState {
            idle: Mutex::new(Vec::new()),
            started: AtomicUsize::new(0),
            max: AtomicUsize::new(0),
        }));
        c.set(on);
        c
    }

    /// Allows helpers (one fewer than the cores) or none from now on; helpers already parked
    /// stay parked.
    pub(crate) fn set(&self, on: bool) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.0.max.store(if on { cores - 1 } else { 0 }, Ordering::Relaxed);
    }

    /// Hands the chain `make` builds to a parked helper, or to a new one while fewer than the
    /// bound exist, and gives it back to the chain. `None`: every helper is busy, helpers are
    /// off, or no thread could be started (the chain then hashes alone; `make` runs only when
    /// a helper is there to take its chain).
    pub(crate) fn start(&self, make: impl FnOnce() -> Ahead) -> Option<Arc<Ahead>> {
        let mut tx = self.helper()?;
        let ahead = Arc::new(make());
        loop {
            // Never blocks: a parked helper's hand-off is empty (it holds one job at most).
            match tx.try_send(Job { ahead: ahead.clone(), back: tx.clone() }) {
                Ok(()) => return Some(ahead),
                // That helper's thread ended: the next one.
                Err(_) => tx = self.helper()?,
            }
        }
    }

    /// A parked helper's hand-off, or a new helper's while fewer than the bound exist.
    fn helper(&self) -> Option<SyncSender<Job>> {
        let max = self.0.max.load(Ordering::Relaxed);
        if max == 0 {
            return None;
        }
        if let Some(tx) = self.0.idle.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Some(tx);
        }
        let started = &self.0.started;
        let room = |n: usize| (n < max).then_some(n + 1);
        started.fetch_update(Ordering::AcqRel, Ordering::Acquire, room).ok()?;
        let (tx, rx) = sync_channel::<Job>(1);
        let crew = Arc::downgrade(&self.0);
        let spawned = std::thread::Builder::new()
            .name("kvfs-chain-ahead".into())
            .spawn(move || helper_life(rx, crew));
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::debug!("no thread to encode ahead: {e}");
                started.fetch_sub(1, Ordering::AcqRel);
                None
            }
        }
    }
}

#[cfg(test)]
impl Crew {
    /// Waits (up to 10 s) until every helper is parked.
    pub(crate) fn settle(&self) {
        let t = std::time::Instant::now();
        while self.0.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
            < self.0.started.load(Ordering::Acquire)
        {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "a helper never parked");
            std::thread::yield_now();
        }
    }
}

/// A helper's life: each chain handed over is encoded ahead (until its end or its stop), then
/// the helper parks again in the idle list; it ends when its crew is gone, and leaves room
/// for another in the bound however it ends.
fn helper_life(rx: std::sync::mpsc::Receiver<Job>, crew: Weak<CrewState>) {
    struct Leaving(Weak<CrewState>);
    impl Drop for Leaving {
        fn drop(&mut self) {
            if let Some(c) = self.0.upgrade() {
                c.started.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
    let leaving = Leaving(crew);
    while let Ok(Job { ahead, back }) = rx.recv() {
        ahead.run();
        drop(ahead);
        let Some(c) = leaving.0.upgrade() else { return };
        c.idle.lock().unwrap_or_else(|e| e.into_inner()).push(back);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn a_chain_hashed_from_items_encoded_ahead_is_the_engines_chain() {
        use crate::hash::{Algorithm, BlockHasher, ChainScratch, Extra, HashProfile};
        let hasher = BlockHasher::new(&HashProfile {
            algorithm: Algorithm::Sha256Cbor,
            python_hash_seed: None,
        })
        .expect("sha256_cbor needs no seed");
        let extra = Extra::default();
        assert!(hasher.takes_encoded(&extra));
        // Token ids of every CBOR width (1, 2, 3 and 5 bytes).
        let tokens: Vec<u32> =
            (0..40_000u32).map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32)).collect();
        let bytes = le(&tokens);
        for bs in [16, 512, 3000] {
            let want = hasher.block_hashes(&tokens, bs, &extra).expect("block size");
            let blocks = bytes.len() / (4 * bs);
            // Alone (no helper), with a helper from the start, and with a helper told to stop
            // half way.
            for helper in [None, Some(false), Some(true)] {
                let ahead = Ahead::new(Bytes::from(bytes.clone()), bs);
                let mut scratch = ChainScratch::default();
                let mut parent: Option<crate::hash::BlockDigest> = None;
                std::thread::scope(|s| {
                    if helper.is_some() {
                        s.spawn(|| ahead.run());
                    }
                    for (i, w) in want.iter().enumerate() {
                        if helper == Some(true) && i == blocks / 2 {
                            ahead.stop();
                        }
                        // The helper may hold the chunk for a moment: wait for it here.
                        let items = loop {
                            if let Some(items) = ahead.items(i) {
                                break items;
                            }
                            std::hint::spin_loop();
                        };
                        let d =
                            hasher.hash_block_encoded(&mut scratch, parent.as_deref(), bs, &items);
                        assert_eq!(d, *w, "block {i} of {bs} tokens, helper {helper:?}");
                        parent = Some(d);
                    }
                    ahead.stop();
                });
            }
        }
    }

    fn crew(max: usize) -> Crew {
        let c = Crew::for_this_machine(false);
        c.0.max.store(max, Ordering::Relaxed);
        c
    }

    /// Waits (bounded) until `ahead` is let go by its helper and the helper is parked.
    fn parked(c: &Crew, ahead: &Arc<Ahead>) {
        let t = std::time::Instant::now();
        while Arc::strong_count(ahead) > 1 || c.0.idle.lock().unwrap().is_empty() {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the helper never parked");
            std::thread::yield_now();
        }
    }

    #[test]
    fn helpers_are_kept_bounded_and_end_with_their_crew() {
        let bytes = le(&(0..8 * CHUNK_TOKENS as u32).collect::<Vec<_>>());
        let job = || Ahead::new(Bytes::from(bytes.clone()), 512);
        // Off: nothing starts.
        assert!(crew(0).start(job).is_none());
        // A helper encodes every chunk ahead of a chain that has not begun, then parks.
        let c = crew(1);
        let a = c.start(job).expect("a helper");
        parked(&c, &a);
        assert!(a.chunks[1..].iter().all(|m| m.lock().unwrap().encoded), "chunks left");
        assert!(!a.chunks[0].lock().unwrap().encoded, "the chain's own chunk taken");
        // The parked helper takes the next chain: no second thread.
        let b = c.start(job).expect("the parked helper");
        parked(&c, &b);
        assert_eq!(c.0.started.load(Ordering::Relaxed), 1);
        // At the bound with none parked, a chain hashes alone.
        let taken = c.0.idle.lock().unwrap().pop().expect("parked");
        assert!(c.start(job).is_none());
        c.0.idle.lock().unwrap().push(taken);
        // Turned off, parked helpers stay parked and take nothing.
        c.set(false);
        assert!(c.start(job).is_none());
        assert_eq!(c.0.idle.lock().unwrap().len(), 1);
    }
}
