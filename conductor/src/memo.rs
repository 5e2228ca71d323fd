//! The chain memo: the digest of each block-hash chain step this conductor computed lately.
//!
//! Why: a token query pays the engines' hash chain before the index can be walked. For vLLM's
//! default (`sha256_cbor`) that is CBOR plus SHA-256 over every block, about half a millisecond
//! for a 128k-token prompt on this project's machines, half of a `/query`. The prompts a router
//! sees repeat their prefixes: a chat's next turn carries the previous turn, agents and RAG
//! share system prompts, and a prompt an engine has cached was usually routed (hashed here)
//! before the engine computed it.
//!
//! Mechanism: a chain step is a function of (hash profile, extra keys, parent, block tokens).
//! [`StepKeys::key`] fingerprints those inputs with XXH3-128 under a secret drawn when
//! the memo is made, the parent as its 64-bit projection (the index already knows blocks by it);
//! the memo maps fingerprints to the block's projection and, where this conductor computed it,
//! its full digest (the next SHA-256 step needs the parent's full digest). Steps come from two
//! places: token queries (with full digests), and the engines' `BlockStored` events, which carry
//! each block's tokens, its hash and its parent's (projections only; first blocks are not
//! learned, because a cache salt changes them and events do not carry it). A query looks each
//! block up, computes a miss (recomputing the full digests of a learned prefix first) and goes
//! on looking up. A fingerprint is one XXH3 pass over the block's tokens where they lie, and
//! one over 33 bytes, about 30 times cheaper than the SHA-256 step it saves.
//!
//! Runs: at 16-token blocks a 128k-token prompt is 8,192 steps, each a fingerprint and a lookup
//! that waits for the one before (its parent is the last step's answer). So the memo also keeps
//! runs of [`RUN`] consecutive steps under one fingerprint over their parent and all their
//! tokens: a query on a grid of `RUN` blocks from the prompt's start looks a run up first, and
//! one hit answers 64 steps. Queries store the runs they completed; events store the runs on
//! that grid: the memo remembers where each learned block lies in its prompt (an event's first
//! block follows its parent), so an event that starts mid-prompt, as a prefill chunk or a
//! prompt past a cached prefix does, learns the runs a query will look up (where its parent's
//! place is unknown, the runs from its own first block).
//!
//! Policy: bounded by `entries_max` in two generations (a simple, scan-resistant LRU
//! approximation): steps go into the young generation; when it holds half the bound it becomes
//! the old one and the previous old one is dropped; a hit in the old generation moves the step
//! to the young one. Runs are kept the same way, at most `entries_max / RUN` of them, and so
//! are learned blocks' positions. Filled from events, a memo of 512 Ki steps grew the process
//! by 111 MiB, about 220 bytes a step: tables of 64-byte step slots at half load after a
//! doubling, and the positions' and runs' own. `entries_max = 0` turns the memo off.
//!
//! Invariants: a hit is the digest computed for an input with the same fingerprint, and the
//! scope of the fingerprint (tenant, model, LoRA, block size, algorithm and root, cache salt)
//! keeps contexts apart. The fingerprint is not a cryptographic hash: two inputs with one
//! fingerprint would give the second the first's digest. By chance that is 2^-128 a pair; made
//! on purpose it needs colliding XXH3 inputs under a secret the sender never sees, and it
//! could only mislead the routing of the sender's own context (an answer is token counts,
//! never bytes of a cache).
//! Learned steps trust the publisher as the index already does: one that publishes wrong
//! hashes for its blocks misleads routing in its context with or without the memo.
//!
//! Not handled: persistence (a restarted conductor relearns from the publishers' replay
//! buffers and from queries), learned first blocks (salt) and LoRA contexts (the adapter's
//! path is part of every step and events do not carry it).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use xxhash_rust::xxh3::{xxh3_64_with_secret, xxh3_128_with_secret};

use crate::hash::BlockHasher;
use crate::index::IdHasher;

/// A block's projection and, when known, its full digest (up to 32 bytes: SHA-256; XXH3-128
/// uses 16; `len` 0: learned from an event, projection only).
#[derive(Clone, Copy)]
struct Step {
    projection: u64,
    digest: [u8; 32],
    len: u8,
}

/// Blocks in a run: [`ChainMemo::get_run`] answers this many steps in one lookup.
pub const RUN: usize = 64;

/// `RUN` consecutive steps: their projections and, when known, the last one's full digest.
struct Run {
    projections: [u64; RUN],
    digest: [u8; 32],
    len: u8,
}

/// A run the memo held.
pub struct RunHit<'a>(&'a Run);

impl RunHit<'_> {
    /// The projections of the run's blocks, in chain order.
    pub fn projections(&self) -> &[u64] {
        &self.0.projections
    }

    /// The full digest of the run's last block, when known (`None`: learned from an event).
    pub fn digest(&self) -> Option<&[u8]> {
        (self.0.len > 0).then(|| &self.0.digest[..self.0.len as usize])
    }
}

/// A step the memo held: the block's projection and, when this conductor computed it, its
/// full digest.
#[derive(Clone, Copy)]
pub struct Hit(Step);

impl Hit {
    pub fn projection(&self) -> u64 {
        self.0.projection
    }

    /// The full digest, when known (`None`: learned from an event).
    pub fn digest(&self) -> Option<&[u8]> {
        (self.0.len > 0).then(|| &self.0.digest[..self.0.len as usize])
    }
}

/// What comes before a block in its chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent<'a> {
    /// The first block, with the query's cache salt ("" for none).
    First { salt: &'a str },
    /// The projection of the parent block's digest.
    Block(u64),
}

/// What one chain step is keyed by besides its parent and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope(u64);

/// Fingerprints of chain steps under one memo's secret (no `Debug`: the secret stays in).
#[derive(Clone, Copy)]
pub struct StepKeys {
    /// XXH3's secret, random per memo: fingerprints cannot be precomputed from outside.
    secret: [u8; 192],
}

impl StepKeys {
    fn new() -> StepKeys {
        use std::hash::BuildHasher;
        let random = std::collections::hash_map::RandomState::new();
        let mut secret = [0u8; 192];
        for (i, c) in secret.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&random.hash_one(i as u64).to_le_bytes());
        }
        StepKeys { secret }
    }

    /// The scope of a chain: the hasher's algorithm and root (so its seed), and `parts`
    /// (tenant, model, LoRA, block size: whatever else the digests depend on or the index
    /// keeps apart). Parts are length-prefixed, so no two lists share a scope.
    pub fn scope(&self, hasher: &BlockHasher, parts: &[&[u8]]) -> Scope {
        let mut buf = Vec::new();
        let fixed = [hasher.algorithm().name().as_bytes(), hasher.root()];
        for p in fixed.iter().chain(parts) {
            buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
            buf.extend_from_slice(p);
        }
        Scope(xxh3_64_with_secret(&buf, &self.secret))
    }

    /// The fingerprint of one step: its scope, its parent's projection, or for the first
    /// block (`First`) the cache salt, and its tokens as little-endian 32-bit ints
    /// ([`le_bytes`]; a query's msgpack binary as it came). The tokens are hashed where they
    /// lie (XXH3-128 under the secret), and that with the rest in a second pass of 33 bytes:
    /// copying 2 KiB of tokens per block behind the rest cost as much as hashing them.
    pub fn key(&self, scope: Scope, parent: Parent<'_>, tokens: &[u8]) -> u128 {
        self.fingerprint(scope, parent, tokens, 0)
    }

    /// The fingerprint of a run: [`RUN`] steps from `parent`, `tokens` being their blocks'
    /// tokens end to end (as [`StepKeys::key`] takes one block's), apart from any step's.
    pub fn run_key(&self, scope: Scope, parent: Parent<'_>, tokens: &[u8]) -> u128 {
        self.fingerprint(scope, parent, tokens, 2)
    }

    /// The key of a block's position in its prompt: its scope and projection.
    pub fn position_key(&self, scope: Scope, projection: u64) -> u64 {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&scope.0.to_le_bytes());
        b[8..].copy_from_slice(&projection.to_le_bytes());
        xxh3_64_with_secret(&b, &self.secret)
    }

    fn fingerprint(&self, scope: Scope, parent: Parent<'_>, tokens: &[u8], kind: u8) -> u128 {
        let (tag, word) = match parent {
            Parent::Block(p) => (1, p),
            Parent::First { salt } => (0, xxh3_64_with_secret(salt.as_bytes(), &self.secret)),
        };
        let t = xxh3_128_with_secret(tokens, &self.secret);
        let mut head = [0u8; 33];
        head[..8].copy_from_slice(&scope.0.to_le_bytes());
        head[8] = tag | kind;
        head[9..17].copy_from_slice(&word.to_le_bytes());
        head[17..].copy_from_slice(&t.to_le_bytes());
        xxh3_128_with_secret(&head, &self.secret)
    }
}

/// Token ids as little-endian 32-bit ints, as [`StepKeys::key`] takes them (borrowed where the
/// machine is little-endian).
pub fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
    } else {
        std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

/// The memo; see the module notes.
pub struct ChainMemo {
    keys: StepKeys,
    /// Steps, runs (at most `entries_max / RUN`) and, for blocks learned from events, where
    /// they lie in their prompts (block index), so an event that starts mid-prompt (a prefill
    /// chunk, a prompt past a cached prefix) learns runs on a query's grid.
    steps: Generations<u128, Step>,
    runs: Generations<u128, Box<Run>>,
    positions: Generations<u64, u32>,
    /// Runs looked up and found, since start.
    pub run_hits: u64,
    /// Blocks answered (a run's count as its blocks), and step lookups missed, since start.
    pub hits: u64,
    pub misses: u64,
}

impl ChainMemo {
    /// A memo of at most `entries_max` steps (0: off), with a fresh secret.
    pub fn new(entries_max: usize) -> ChainMemo {
        ChainMemo {
            keys: StepKeys::new(),
            steps: Generations::new(entries_max),
            runs: Generations::new(entries_max / RUN),
            positions: Generations::new(entries_max),
            run_hits: 0,
            hits: 0,
            misses: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.steps.max > 0
    }

    /// Steps held (runs apart: [`ChainMemo::runs`]).
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Runs held: at most `entries_max / RUN` (a run's 64 projections take 512 bytes, as
    /// many steps' slots 4 KiB).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fingerprinting half of the memo, usable without holding it.
    pub fn keys(&self) -> StepKeys {
        self.keys
    }

    /// The step `key`, if held.
    pub fn get(&mut self, key: u128) -> Option<Hit> {
        let Some(&step) = self.steps.get(&key) else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        Some(Hit(step))
    }

    /// Remember a step this conductor computed (digests longer than 32 bytes are not kept).
    pub fn insert(&mut self, key: u128, projection: u64, digest: &[u8]) {
        if digest.len() > 32 {
            return;
        }
        let mut step = Step { projection, digest: [0; 32], len: digest.len() as u8 };
        step.digest[..digest.len()].copy_from_slice(digest);
        self.steps.insert(key, step);
    }

    /// Remember a step an engine published (its projection only); a step held with its full
    /// digest is kept as it is.
    pub fn learn(&mut self, key: u128, projection: u64) {
        if !self.steps.contains(&key) {
            self.steps.insert(key, Step { projection, digest: [0; 32], len: 0 });
        }
    }

    /// The run `key`, if held. A hit counts as its [`RUN`] blocks in `hits`; a miss is not
    /// counted (the run's blocks are then looked up one by one, and counted there).
    pub fn get_run(&mut self, key: u128) -> Option<RunHit<'_>> {
        let run = self.runs.get(&key)?;
        self.hits += RUN as u64;
        self.run_hits += 1;
        Some(RunHit(run))
    }

    /// Remember a run: `projections` ([`RUN`] of them, else nothing is kept) and the last
    /// block's full digest when known (`None`: learned from an event, which does not replace
    /// a run held with its digest).
    pub fn insert_run(&mut self, key: u128, projections: &[u64], digest: Option<&[u8]>) {
        if projections.len() != RUN
            || digest.is_some_and(|d| d.len() > 32)
            || (digest.is_none() && self.runs.contains(&key))
        {
            return;
        }
        let mut run = Box::new(Run { projections: [0; RUN], digest: [0; 32], len: 0 });
        run.projections.copy_from_slice(projections);
        if let Some(d) = digest {
            run.digest[..d.len()].copy_from_slice(d);
            run.len = d.len() as u8;
        }
        self.runs.insert(key, run);
    }

    /// The position of the block `key` ([`StepKeys::position_key`]) in its prompt, if known.
    pub fn position(&mut self, key: u64) -> Option<u32> {
        self.positions.get(&key).copied()
    }

    /// Remember where the block `key` lies in its prompt.
    pub fn set_position(&mut self, key: u64, position: u32) {
        self.positions.insert(key, position);
    }
}

/// At most `max` entries in two generations (a simple, scan-resistant LRU approximation):
/// entries go into the young generation; when it holds half of `max` it becomes the old one
/// and the previous old one is dropped; a hit in the old generation moves the entry to the
/// young one. `max = 0` keeps nothing.
struct Generations<K, V> {
    max: usize,
    young: HashMap<K, V, BuildHasherDefault<IdHasher>>,
    old: HashMap<K, V, BuildHasherDefault<IdHasher>>,
}

impl<K: std::hash::Hash + Eq + Copy, V> Generations<K, V> {
    fn new(max: usize) -> Self {
        Generations { max, young: HashMap::default(), old: HashMap::default() }
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    fn contains(&self, k: &K) -> bool {
        self.young.contains_key(k) || self.old.contains_key(k)
    }

    fn get(&mut self, k: &K) -> Option<&V> {
        if !self.young.contains_key(k) {
            let v = self.old.remove(k)?;
            self.insert(*k, v);
        }
        self.young.get(k)
    }

    fn insert(&mut self, k: K, v: V) {
        if self.max == 0 {
            return;
        }
        // Each generation holds at most half of `max` (rounded down), so both together never
        // pass it; with `max` 1 there is no old generation at all. (Half rounded up let an odd
        // `max` be passed by one: 3 + 3 entries under a bound of 5.)
        let half = self.max / 2;
        if self.young.len() >= half.max(1) {
            self.old = if half == 0 { HashMap::default() } else { std::mem::take(&mut self.young) };
            self.young.clear();
        }
        self.young.insert(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{Algorithm, HashProfile};

    fn hasher(algorithm: Algorithm, seed: Option<&str>) -> BlockHasher {
        BlockHasher::new(&HashProfile { algorithm, python_hash_seed: seed.map(String::from) })
            .expect("profile")
    }

    fn got(h: Option<Hit>) -> Option<(u64, Option<Vec<u8>>)> {
        h.map(|h| (h.projection(), h.digest().map(<[u8]>::to_vec)))
    }

    #[test]
    fn bounded_and_recent_steps_survive() {
        let mut m = ChainMemo::new(100);
        let h = hasher(Algorithm::Sha256Cbor, None);
        let s = m.keys().scope(&h, &[b"t"]);
        let first = Parent::First { salt: "" };
        let keys: Vec<u128> =
            (0..1000u32).map(|i| m.keys().key(s, first, &i.to_le_bytes())).collect();
        for (i, &k) in keys.iter().enumerate() {
            m.insert(k, i as u64, &[i as u8; 32]);
            // A step looked up at every insert stays: hits move it to the young generation.
            assert_eq!(got(m.get(keys[0])), Some((0, Some(vec![0u8; 32]))));
            assert!(m.len() <= 100, "{} steps held", m.len());
        }
        assert!(m.get(keys[1]).is_none(), "an old step not used again is dropped");
        assert_eq!(got(m.get(keys[999])), Some((999, Some(vec![231u8; 32]))));
        // A learned step has no digest and does not replace a computed one.
        m.learn(keys[999], 5);
        assert_eq!(got(m.get(keys[999])), Some((999, Some(vec![231u8; 32]))));
        let k = m.keys().key(s, Parent::Block(7), &le_bytes(&[1]));
        m.learn(k, 8);
        assert_eq!(got(m.get(k)), Some((8, None)));
        let mut off = ChainMemo::new(0);
        off.insert(keys[0], 0, &[0; 32]);
        off.learn(keys[1], 1);
        assert!(off.is_empty() && off.get(keys[0]).is_none());
    }

    #[test]
    fn generations_never_hold_more_than_their_bound() {
        for max in 0..9usize {
            let mut g = Generations::new(max);
            for k in 0..100u64 {
                g.insert(k, ());
                assert!(g.len() <= max, "{} entries under a bound of {max}", g.len());
                if k % 3 == 0 {
                    let _ = g.get(&(k / 2));
                    assert!(g.len() <= max, "{} entries under a bound of {max}", g.len());
                }
            }
            assert!(max < 2 || g.contains(&99), "the newest entry is kept");
        }
    }

    #[test]
    fn runs_are_bounded_and_learned_ones_keep_a_computed_digest() {
        let mut m = ChainMemo::new(4 * RUN);
        let h = hasher(Algorithm::Sha256Cbor, None);
        let s = m.keys().scope(&h, &[b"t"]);
        let first = Parent::First { salt: "" };
        let tokens: Vec<u8> = (0..RUN as u32 * 16).flat_map(|t| t.to_le_bytes()).collect();
        let keys = m.keys();
        let key = |p: u64| keys.run_key(s, Parent::Block(p), &tokens);
        // A run and a step over the same bytes are different fingerprints.
        assert_ne!(keys.run_key(s, first, &tokens), keys.key(s, first, &tokens));
        let projections: Vec<u64> = (0..RUN as u64).collect();
        m.insert_run(key(0), &projections, Some(&[9; 32]));
        // Learned (no digest) does not replace it; a wrong length is not kept.
        m.insert_run(key(0), &projections[..], None);
        m.insert_run(key(1), &projections[1..], None);
        let hit = m.get_run(key(0)).expect("held");
        assert_eq!((hit.projections(), hit.digest()), (&projections[..], Some(&[9u8; 32][..])));
        assert!(m.get_run(key(1)).is_none());
        assert_eq!((m.hits, m.misses), (RUN as u64, 0), "a hit counts its blocks");
        // Four runs at most (two generations of two); a run used at every insert stays.
        for p in 2..40 {
            m.insert_run(key(p), &projections, None);
            assert!(m.get_run(key(0)).is_some());
            assert!(m.runs() <= 4, "{} runs held", m.runs());
        }
        assert!(m.get_run(key(2)).is_none(), "an old run not used again is dropped");
        assert_eq!(m.get_run(key(39)).map(|r| r.digest().is_none()), Some(true));
        assert_eq!(m.len(), 0, "runs are not steps");
        let mut off = ChainMemo::new(RUN - 1);
        off.insert_run(key(0), &projections, None);
        assert_eq!(off.runs(), 0, "a memo smaller than a run keeps none");
    }

    #[test]
    fn positions_are_bounded_and_kept_per_scope() {
        let mut m = ChainMemo::new(100);
        let h = hasher(Algorithm::Sha256Cbor, None);
        let (a, b) = (m.keys().scope(&h, &[b"a"]), m.keys().scope(&h, &[b"b"]));
        let keys = m.keys();
        m.set_position(keys.position_key(a, 7), 3);
        assert_eq!(m.position(keys.position_key(a, 7)), Some(3));
        assert_eq!(m.position(keys.position_key(b, 7)), None, "another scope");
        for p in 0..1000u64 {
            m.set_position(keys.position_key(b, p), p as u32);
            assert_eq!(m.position(keys.position_key(a, 7)), Some(3), "used, so kept");
            assert!(m.positions.len() <= 100);
        }
        assert_eq!(m.position(keys.position_key(b, 0)), None, "old and unused: dropped");
        assert_eq!(m.position(keys.position_key(b, 999)), Some(999));
        let mut off = ChainMemo::new(0);
        off.set_position(keys.position_key(a, 7), 3);
        assert_eq!(off.position(keys.position_key(a, 7)), None);
    }

    #[test]
    fn keys_separate_scopes_parents_and_tokens() {
        let m = ChainMemo::new(10).keys();
        let sha = hasher(Algorithm::Sha256Cbor, None);
        let seeded = hasher(Algorithm::Sha256Cbor, Some("7"));
        let a = m.scope(&sha, &[b"tenant", b"model"]);
        let distinct = [
            a,
            m.scope(&seeded, &[b"tenant", b"model"]),
            m.scope(&hasher(Algorithm::Sha256, None), &[b"tenant", b"model"]),
            m.scope(&sha, &[b"tenantm", b"odel"]),
            m.scope(&sha, &[b"tenant", b"model", b""]),
        ];
        for i in 0..distinct.len() {
            for j in 0..i {
                assert_ne!(distinct[i], distinct[j], "scopes {i} and {j}");
            }
        }
        let none = Parent::First { salt: "" };
        let steps = [
            m.key(a, none, &le_bytes(&[1, 2])),
            m.key(a, Parent::First { salt: "s" }, &le_bytes(&[1, 2])),
            m.key(a, Parent::Block(0), &le_bytes(&[1, 2])),
            m.key(a, Parent::Block(1), &le_bytes(&[1, 2])),
            m.key(a, none, &le_bytes(&[1, 2, 0])),
            m.key(a, none, &le_bytes(&[2, 1])),
            m.key(distinct[1], none, &le_bytes(&[1, 2])),
        ];
        for i in 0..steps.len() {
            for j in 0..i {
                assert_ne!(steps[i], steps[j], "steps {i} and {j}");
            }
        }
        // Another memo has another secret.
        assert_ne!(ChainMemo::new(10).keys().key(a, none, &le_bytes(&[1, 2])), steps[0]);
    }
}
