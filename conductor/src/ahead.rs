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
//! Not used: for chains that are short or of small blocks (the thread or the locks would cost
//! more than they save, see [`worth_it`]), for shapes other than `sha256_cbor` without extra
//! keys, and on a machine of one core. How many helpers run at once is bounded by the caller
//! ([`Permits`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// Tokens per chunk: large enough that a lock is rare against the encoding (a few
/// microseconds of work), small enough that the helper gets ahead of the chain at once.
const CHUNK_TOKENS: usize = 2048;

/// Fewest tokens still to hash for which a helper pays (a thread start is tens of
/// microseconds; encoding is about 1.5 ns a token).
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
pub(crate) struct Ahead<'a> {
    blocks: &'a [&'a [u8]],
    per_chunk: usize,
    chunks: Vec<Mutex<Chunk>>,
    /// The chunk the chain is on.
    at: AtomicUsize,
    stop: AtomicBool,
}

impl<'a> Ahead<'a> {
    /// For `blocks`, all of one size.
    pub(crate) fn new(blocks: &'a [&'a [u8]]) -> Self {
        let block_tokens = blocks.first().map_or(1, |b| b.len() / 4).max(1);
        let per_chunk = (CHUNK_TOKENS / block_tokens).max(1);
        let chunks = (0..blocks.len().div_ceil(per_chunk)).map(|_| Mutex::default()).collect();
        Ahead { blocks, per_chunk, chunks, at: AtomicUsize::new(0), stop: AtomicBool::new(false) }
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
        let blocks = &self.blocks[first..(first + self.per_chunk).min(self.blocks.len())];
        let tokens: usize = blocks.iter().map(|b| b.len() / 4).sum();
        chunk.items.resize(5 * tokens, 0);
        chunk.ends.clear();
        let mut p = 0;
        for b in blocks {
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

/// A bound on helpers running at once, across queries.
#[derive(Debug)]
pub(crate) struct Permits {
    running: AtomicUsize,
    max: AtomicUsize,
}

impl Permits {
    /// One fewer than the machine's cores (none on one core) if `on`, else none.
    pub(crate) fn for_this_machine(on: bool) -> Self {
        let p = Permits { running: AtomicUsize::new(0), max: AtomicUsize::new(0) };
        p.set(on);
        p
    }

    /// Allows helpers (one fewer than the cores) or none from now on.
    pub(crate) fn set(&self, on: bool) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let max = if on { cores - 1 } else { 0 };
        self.max.store(max, Ordering::Relaxed);
    }

    /// A permit, if fewer than the bound are out.
    pub(crate) fn take(&self) -> Option<Permit<'_>> {
        let max = self.max.load(Ordering::Relaxed);
        self.running
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| Permit(self))
    }
}

/// Held while a helper runs.
pub(crate) struct Permit<'p>(&'p Permits);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
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
            let blocks: Vec<&[u8]> = bytes.chunks_exact(4 * bs).collect();
            // Alone (no helper), with a helper from the start, and with a helper told to stop
            // half way.
            for helper in [None, Some(false), Some(true)] {
                let ahead = Ahead::new(&blocks);
                let mut scratch = ChainScratch::default();
                let mut parent: Option<crate::hash::BlockDigest> = None;
                std::thread::scope(|s| {
                    if helper.is_some() {
                        s.spawn(|| ahead.run());
                    }
                    for (i, w) in want.iter().enumerate() {
                        if helper == Some(true) && i == blocks.len() / 2 {
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

    #[test]
    fn permits_are_bounded_and_returned() {
        let p = Permits { running: AtomicUsize::new(0), max: AtomicUsize::new(2) };
        let a = p.take().expect("first");
        let b = p.take().expect("second");
        assert!(p.take().is_none(), "a third beyond the bound");
        drop(a);
        let c = p.take().expect("one returned");
        drop((b, c));
        assert_eq!(p.running.load(Ordering::Relaxed), 0);
        p.max.store(0, Ordering::Relaxed);
        assert!(p.take().is_none(), "a permit while turned off");
    }
}
