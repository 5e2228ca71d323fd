//! The FAST'25 (Mooncake) request traces, and a prefix cache replayed over them.
//!
//! # Traces
//! One JSON object per line: `{"timestamp": ms, "input_length": tokens, "output_length":
//! tokens, "hash_ids": [...]}`. Each id stands for a block of [`BLOCK_TOKENS`] tokens *together
//! with every block before it* (prefix-chained), so `len(hash_ids) == ceil(input_length /
//! 512)`. [`Trace::parse`] checks that and every field, and names the line of any fault; it
//! orders the requests by timestamp (stably: ties keep file order).
//!
//! # The simulator
//! [`Cache`] is a sans-IO state machine: a capacity in blocks (tokens / 512, rounded down) or
//! unbounded, and a [`Policy`]. For each request, in timestamp order, the hit is the longest
//! prefix of its blocks that are all cached (the first miss stops it: a block after a miss is
//! useless even if cached, since its KV depends on the missing one); then every block of the
//! request is inserted or touched. A hit block counts 512 tokens, the last one capped so that
//! the hit tokens never exceed `input_length`. [`replay`] folds that over a trace into
//! [`ReplayStats`]. Unbounded capacity gives the trace's ceiling: every block seen before hits.
//!
//! # Policies
//! - [`Policy::Lru`]: plain LRU over blocks, touched in request order (the first block of a
//!   request becomes the least recent of its blocks). The baseline.
//! - [`Policy::Kvfs`]: kvfs's policy ([`KvfsConfig::DEFAULT`]), three ideas, each measured
//!   on both traces and kept because together they are never worse than LRU at any capacity
//!   of the sweep (the `kvfs bench trace` table; they are not proven to be on every trace):
//!   1. *Leaf first.* A block is worthless without its parent, so a parent must never leave
//!      before its children. Every request that touches a block also touches all its
//!      ancestors, so it is enough to rank the blocks of a request deepest-first and to keep
//!      each block's rank at least that of the child ranked before it (enforced, not only
//!      implied): the lowest-ranked block never has a cached child, the cache stays
//!      prefix-closed (no orphan ever takes space; a missing block means its whole subtree is
//!      missing) and a request longer than the cache keeps its head, not its useless tail.
//!      Plain LRU does the opposite. Alone this gains 0 to 0.6 points.
//!   2. *Frequency with aging (LRFU).* The rank is the combined recency-frequency `CRF = sum
//!      over the block's past requests of 2^(-(now - t_i) / 10 requests)`, kept in log domain
//!      against a moving origin (`log2(CRF) + now / half_life`, never rescaled). Since a
//!      parent's requests are a superset of its children's, CRF ranks parents at or above
//!      them. A short half-life: longer ones (100 to 1000 requests) won up to 1.2 points on the
//!      conversation trace but lost up to 3.6 on the synthetic one.
//!   3. *Admission filter, switched by set dueling.* When the cache is full, a new block enters
//!      only if it was requested more often than the block it would evict (TinyLFU's rule,
//!      counts halving every 10 x capacity block accesses; ties refused; the first refusal
//!      stops the rest of the request's tail, which keeps the cache prefix-closed). On the
//!      conversation trace, where blocks come back after longer than a small cache holds them,
//!      it keeps a stable set instead of churning: +3.5 to +6 points between 0.5M and 2M
//!      tokens. But it loses up to 9 points at 10M, where LRU already keeps what comes back.
//!      So two shadow caches of block ids (metadata only, as ARC's ghost lists), one with the
//!      filter and one without, score the hit tokens each would have had (decaying with a
//!      half-life of 1000 requests), and the filter applies only while its shadow leads by 5%.
//!
//!   Each block access costs O(log n) (ordered map of ranks, hash maps of blocks and counts),
//!   three times over with the shadows: a whole trace replays in a fraction of a second per
//!   capacity in a release build. The counts here are exact per block (a hash map that keeps
//!   every block seen); a real cache would use a count-min sketch of the same aging.
//!
//! # Not handled
//! Output tokens are not cached (the traces give no hashes for them), blocks do not expire by
//! time, and there is one cache (no instances or routing): this is the capacity question only.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use hashbrown::HashMap;
use serde::Deserialize;

/// Tokens in one KV block of the traces.
pub const BLOCK_TOKENS: u64 = 512;

/// A fault while reading a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The trace could not be read.
    #[error("reading {what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// A line is not a valid request (1-based line number).
    #[error("line {line}: {msg}")]
    Malformed { line: usize, msg: String },
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub timestamp_ms: u64,
    pub input_len: u64,
    pub output_len: u64,
    /// Prefix-chained block ids: `blocks[i]` names blocks `0..=i`.
    pub blocks: Vec<u64>,
}

impl Request {
    /// Tokens of the first `hit_blocks` blocks, capped at the input length.
    pub fn hit_tokens(&self, hit_blocks: usize) -> u64 {
        (hit_blocks as u64 * BLOCK_TOKENS).min(self.input_len)
    }
}

#[derive(Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// A whole trace, in timestamp order.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub requests: Vec<Request>,
}

impl Trace {
    /// Reads a trace file.
    pub fn load(path: &Path) -> Result<Trace, TraceError> {
        let io = |source| TraceError::Io { what: path.display().to_string(), source };
        let f = std::fs::File::open(path).map_err(io)?;
        Trace::parse(std::io::BufReader::new(f)).map_err(|e| match e {
            TraceError::Io { source, .. } => io(source),
            e => e,
        })
    }

    /// Parses JSON lines (blank lines are skipped) and orders them by timestamp.
    pub fn parse(reader: impl BufRead) -> Result<Trace, TraceError> {
        let mut requests = Vec::new();
        for (i, line) in reader.lines().enumerate() {
            let line = line.map_err(|source| TraceError::Io { what: "trace".into(), source })?;
            if line.trim().is_empty() {
                continue;
            }
            requests
                .push(parse_line(&line).map_err(|msg| TraceError::Malformed { line: i + 1, msg })?);
        }
        requests.sort_by_key(|r| r.timestamp_ms);
        Ok(Trace { requests })
    }

    /// Input tokens of all requests.
    pub fn input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_len).sum()
    }
}

fn parse_line(line: &str) -> Result<Request, String> {
    let l: Line = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let expected = l.input_length.div_ceil(BLOCK_TOKENS);
    if l.hash_ids.len() as u64 != expected {
        return Err(format!(
            "{} hash_ids for input_length {} (expected ceil({}/{BLOCK_TOKENS}) = {expected})",
            l.hash_ids.len(),
            l.input_length,
            l.input_length
        ));
    }
    Ok(Request {
        timestamp_ms: l.timestamp,
        input_len: l.input_length,
        output_len: l.output_length,
        blocks: l.hash_ids,
    })
}

/// How much the cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// Tokens; the cache holds `tokens / 512` whole blocks.
    Tokens(u64),
    /// Never evicts: the trace's ceiling.
    Unbounded,
}

impl Capacity {
    pub fn blocks(self) -> u64 {
        match self {
            Capacity::Tokens(t) => t / BLOCK_TOKENS,
            Capacity::Unbounded => u64::MAX,
        }
    }
}

/// Which block leaves when the cache is full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Plain LRU over blocks, touched in request order.
    Lru,
    /// kvfs's policy with its defaults ([`KvfsConfig::DEFAULT`]; see the module notes).
    Kvfs,
    /// kvfs's policy with other settings (for tuning).
    KvfsWith(KvfsConfig),
}

/// Settings of kvfs's policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvfsConfig {
    /// Half-life of an access in a block's LRFU rank, in requests (near 0: leaf-first LRU).
    pub half_life_requests: f64,
    /// Admission filter: when the cache is full, a new block enters only if it was requested
    /// more often than the block it would evict, counts halving every `admission_window_factor
    /// x capacity` block accesses. 0: admit everything.
    pub admission_window_factor: f64,
    /// Whether a new block that ties with the victim enters.
    pub admit_ties: bool,
    /// Set dueling: two shadow caches of block ids, one with the filter and one without,
    /// score the hit tokens each would have had (decaying with this half-life, in requests),
    /// and the filter applies only while its shadow leads. 0: the filter always applies.
    pub duel_half_life_requests: f64,
    /// The filter's shadow must lead by this fraction of the other's score.
    pub duel_margin: f64,
}

impl KvfsConfig {
    pub const DEFAULT: KvfsConfig = KvfsConfig {
        half_life_requests: 10.0,
        admission_window_factor: 10.0,
        admit_ties: false,
        duel_half_life_requests: 1000.0,
        duel_margin: 0.05,
    };
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Kvfs | Policy::KvfsWith(_) => "kvfs",
        }
    }
}

/// Rank of a cached block: the lowest leaves first. `(primary, seq)`: `primary` is the
/// bits of a non-negative f64 (so integer order is float order), `seq` a unique tiebreak.
type Rank = (u64, u64);

#[derive(Debug, Clone, Copy)]
struct Entry {
    rank: Rank,
}

/// A prefix cache of blocks under one policy (sans-IO; deterministic).
#[derive(Debug, Clone)]
pub struct Cache {
    policy: Policy,
    capacity_blocks: u64,
    blocks: HashMap<u64, Entry>,
    by_rank: BTreeMap<Rank, u64>,
    /// Requests seen: the clock of the LRFU ranks.
    now: u64,
    /// Unique tiebreak of ranks, increasing in the order blocks are ranked.
    seq: u64,
    evictions: u64,
    /// Aged request counts of every block seen (admission filter only): (count, epoch).
    freq: HashMap<u64, (u32, u64)>,
    block_accesses: u64,
    rejections: u64,
    duel: Option<Box<Duel>>,
}

/// The shadow caches of set dueling (see [`KvfsConfig::duel_half_life_requests`]).
#[derive(Debug, Clone)]
struct Duel {
    with_filter: Cache,
    without: Cache,
    /// Decayed hit tokens of each.
    score_with: f64,
    score_without: f64,
}

/// What one request found in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    pub hit_blocks: usize,
    pub hit_tokens: u64,
}

impl Cache {
    pub fn new(policy: Policy, capacity: Capacity) -> Cache {
        Cache {
            policy,
            capacity_blocks: capacity.blocks(),
            blocks: HashMap::new(),
            by_rank: BTreeMap::new(),
            now: 0,
            seq: 0,
            evictions: 0,
            freq: HashMap::new(),
            block_accesses: 0,
            rejections: 0,
            duel: None,
        }
        .with_duel()
    }

    fn with_duel(mut self) -> Cache {
        let cfg = match self.policy {
            Policy::Kvfs => KvfsConfig::DEFAULT,
            Policy::KvfsWith(cfg) => cfg,
            Policy::Lru => return self,
        };
        if cfg.duel_half_life_requests > 0.0 && cfg.admission_window_factor > 0.0 {
            let shadow = |cfg| Cache::new(Policy::KvfsWith(cfg), Capacity::Tokens(0));
            let mut d = Duel {
                with_filter: shadow(KvfsConfig { duel_half_life_requests: 0.0, ..cfg }),
                without: shadow(KvfsConfig {
                    duel_half_life_requests: 0.0,
                    admission_window_factor: 0.0,
                    ..cfg
                }),
                score_with: 0.0,
                score_without: 0.0,
            };
            d.with_filter.capacity_blocks = self.capacity_blocks;
            d.without.capacity_blocks = self.capacity_blocks;
            self.duel = Some(Box::new(d));
        }
        self
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn contains(&self, block: u64) -> bool {
        self.blocks.contains_key(&block)
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// New blocks the admission filter kept out so far.
    pub fn rejections(&self) -> u64 {
        self.rejections
    }

    /// Cached blocks from the next to leave to the last.
    pub fn eviction_order(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_rank.values().copied()
    }

    /// Serves one request: its hit, then every block of it inserted or touched.
    pub fn access(&mut self, req: &Request) -> Access {
        let hit_blocks = req.blocks.iter().take_while(|b| self.blocks.contains_key(*b)).count();
        self.now += 1;
        match self.policy {
            Policy::Lru => {
                for &b in &req.blocks {
                    self.seq += 1;
                    self.place(b, (0, self.seq));
                }
            }
            Policy::Kvfs => self.access_kvfs(req, hit_blocks, KvfsConfig::DEFAULT),
            Policy::KvfsWith(cfg) => self.access_kvfs(req, hit_blocks, cfg),
        }
        Access { hit_blocks, hit_tokens: req.hit_tokens(hit_blocks) }
    }

    /// The cache is prefix-closed, so `blocks[..hit]` are cached and the rest are not: admit
    /// the missing tail head first while the filter lets it, then rank the cached chain
    /// deepest first, each block at least as high as its child.
    fn access_kvfs(&mut self, req: &Request, hit: usize, cfg: KvfsConfig) {
        let blocks = &req.blocks[..];
        let now = self.now as f64 / cfg.half_life_requests;
        let counting = cfg.admission_window_factor > 0.0 && self.capacity_blocks != u64::MAX;
        let mut filter = counting;
        if let Some(d) = &mut self.duel {
            let decay = (-1.0 / cfg.duel_half_life_requests).exp2();
            d.score_with = d.score_with * decay + d.with_filter.access(req).hit_tokens as f64;
            d.score_without = d.score_without * decay + d.without.access(req).hit_tokens as f64;
            filter = counting && d.score_with > d.score_without * (1.0 + cfg.duel_margin);
        }
        if counting {
            let window = self.admission_window(cfg);
            for &b in blocks {
                self.block_accesses += 1;
                let epoch = self.block_accesses / window;
                let e = self.freq.entry(b).or_insert((0, epoch));
                e.0 = (e.0 >> (epoch - e.1).min(31)).saturating_add(1);
                e.1 = epoch;
            }
        }
        let first_new_seq = self.seq + 1;
        let mut cached = hit;
        for &b in &blocks[hit..] {
            if self.capacity_blocks == 0 {
                break;
            }
            if self.blocks.len() as u64 >= self.capacity_blocks {
                let (&rank, &victim) = self.by_rank.first_key_value().expect("full, not empty");
                // Never evict this request's own chain (its head is worth more than its tail).
                if rank.1 >= first_new_seq || (hit > 0 && victim == blocks[hit - 1]) {
                    break;
                }
                if filter {
                    let (new, old) = (self.aged_count(b, cfg), self.aged_count(victim, cfg));
                    if new < old || (new == old && !cfg.admit_ties) {
                        self.rejections += 1;
                        break;
                    }
                }
                self.by_rank.pop_first();
                self.blocks.remove(&victim);
                self.evictions += 1;
            }
            self.seq += 1;
            let rank = (now.to_bits(), self.seq);
            self.blocks.insert(b, Entry { rank });
            self.by_rank.insert(rank, b);
            cached += 1;
        }
        let mut floor = 0.0f64;
        for (i, &b) in blocks[..cached].iter().enumerate().rev() {
            let crf_log = if i < hit {
                let old = f64::from_bits(self.blocks[&b].rank.0);
                // log2(2^(old - now) + 1) + now: the old CRF decayed to now, plus this access.
                (old - now).exp2().ln_1p() / std::f64::consts::LN_2 + now
            } else {
                now
            };
            let primary = crf_log.max(floor);
            floor = primary;
            self.seq += 1;
            self.place(b, (primary.to_bits(), self.seq));
        }
    }

    fn aged_count(&self, block: u64, cfg: KvfsConfig) -> u32 {
        self.freq.get(&block).map_or(0, |&(c, e)| {
            let epoch = self.block_accesses / self.admission_window(cfg);
            c >> (epoch - e).min(31)
        })
    }

    /// Block accesses between two halvings of the counts.
    fn admission_window(&self, cfg: KvfsConfig) -> u64 {
        ((cfg.admission_window_factor * self.capacity_blocks as f64) as u64).max(1)
    }

    fn place(&mut self, block: u64, rank: Rank) {
        if let Some(e) = self.blocks.get_mut(&block) {
            self.by_rank.remove(&e.rank);
            e.rank = rank;
            self.by_rank.insert(rank, block);
            return;
        }
        if self.capacity_blocks == 0 {
            return;
        }
        if self.blocks.len() as u64 >= self.capacity_blocks {
            let (_, victim) = self.by_rank.pop_first().expect("a full cache has blocks");
            self.blocks.remove(&victim);
            self.evictions += 1;
        }
        self.blocks.insert(block, Entry { rank });
        self.by_rank.insert(rank, block);
    }
}

/// Figures of one replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub requests: u64,
    /// Requests that reused at least one block.
    pub hit_requests: u64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub blocks: u64,
    pub hit_blocks: u64,
    pub evictions: u64,
    /// New blocks the admission filter kept out.
    pub rejections: u64,
    /// Blocks cached at the end.
    pub cached_blocks: u64,
}

impl ReplayStats {
    /// Hit tokens over input tokens (0 for an empty trace).
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.hit_tokens, self.input_tokens)
    }

    /// Requests with a hit over requests.
    pub fn request_hit_rate(&self) -> f64 {
        ratio(self.hit_requests, self.requests)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Replays requests (already in timestamp order, as [`Trace::parse`] leaves them).
pub fn replay(requests: &[Request], policy: Policy, capacity: Capacity) -> ReplayStats {
    let mut cache = Cache::new(policy, capacity);
    let mut s = ReplayStats::default();
    for r in requests {
        let a = cache.access(r);
        s.requests += 1;
        s.hit_requests += u64::from(a.hit_blocks > 0);
        s.input_tokens += r.input_len;
        s.hit_tokens += a.hit_tokens;
        s.blocks += r.blocks.len() as u64;
        s.hit_blocks += a.hit_blocks as u64;
    }
    s.evictions = cache.evictions();
    s.rejections = cache.rejections();
    s.cached_blocks = cache.len() as u64;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input_len: u64, blocks: &[u64]) -> Request {
        Request { timestamp_ms: 0, input_len, output_len: 1, blocks: blocks.to_vec() }
    }

    /// `len(blocks) * 512` tokens each.
    fn full(blocks: &[u64]) -> Request {
        req(blocks.len() as u64 * BLOCK_TOKENS, blocks)
    }

    #[test]
    fn the_hit_stops_at_the_first_miss() {
        let mut c = Cache::new(Policy::Lru, Capacity::Unbounded);
        assert_eq!(c.access(&full(&[1, 2, 3])).hit_blocks, 0);
        // 1 and 3 are cached but 9 is not: 3 does not count.
        let a = c.access(&full(&[1, 9, 3]));
        assert_eq!((a.hit_blocks, a.hit_tokens), (1, BLOCK_TOKENS));
        let a = c.access(&req(1200, &[1, 2, 3]));
        // The last block holds 1200 - 1024 = 176 tokens.
        assert_eq!((a.hit_blocks, a.hit_tokens), (3, 1200));
    }

    #[test]
    fn lru_evicts_the_least_recent_block_in_request_order() {
        let mut c = Cache::new(Policy::Lru, Capacity::Tokens(3 * BLOCK_TOKENS + 100));
        c.access(&full(&[1, 2]));
        c.access(&full(&[3]));
        c.access(&full(&[1])); // 1 is now the most recent
        assert_eq!(c.eviction_order().collect::<Vec<_>>(), [2, 3, 1]);
        c.access(&full(&[4]));
        assert!(!c.contains(2) && c.contains(1) && c.contains(3) && c.contains(4));
        // A request longer than the cache leaves its tail, useless without its head.
        c.access(&full(&[10, 11, 12, 13, 14]));
        assert_eq!(c.eviction_order().collect::<Vec<_>>(), [12, 13, 14]);
        assert_eq!(c.access(&full(&[10, 11, 12])).hit_blocks, 0);
        assert_eq!(c.evictions(), 9);
    }

    #[test]
    fn kvfs_evicts_leaves_first() {
        let mut c = Cache::new(Policy::Kvfs, Capacity::Tokens(5 * BLOCK_TOKENS));
        c.access(&full(&[1, 2, 3]));
        c.access(&full(&[1, 4, 5]));
        // The oldest chain leaves deepest first; its shared root, touched last, stays.
        assert_eq!(c.eviction_order().collect::<Vec<_>>(), [3, 2, 5, 4, 1]);
        c.access(&full(&[6]));
        assert!(!c.contains(3) && c.contains(2));
        // A request longer than the cache keeps its head.
        c.access(&full(&[10, 11, 12, 13, 14, 15, 16]));
        assert_eq!(c.access(&full(&[10, 11, 12, 13, 14, 20])).hit_blocks, 4);
    }

    #[test]
    fn the_admission_filter_keeps_reused_blocks_from_one_hit_blocks() {
        let filter_always = KvfsConfig { duel_half_life_requests: 0.0, ..KvfsConfig::DEFAULT };
        let mut c = Cache::new(Policy::KvfsWith(filter_always), Capacity::Tokens(2 * BLOCK_TOKENS));
        c.access(&full(&[1, 2]));
        c.access(&full(&[1, 2]));
        // Full of blocks asked for twice: a new chain is refused at its first block.
        assert_eq!(c.access(&full(&[7, 8])).hit_blocks, 0);
        assert_eq!((c.rejections(), c.evictions()), (1, 0));
        assert!(c.contains(1) && c.contains(2) && !c.contains(7));
        // Asked for as often as the victim now, and then more: block 7 replaces the leaf 2.
        c.access(&full(&[7]));
        assert!(!c.contains(7));
        c.access(&full(&[7]));
        assert!(c.contains(7) && c.contains(1) && !c.contains(2));
        // Without the filter the same requests churn.
        let mut lru = Cache::new(Policy::Lru, Capacity::Tokens(2 * BLOCK_TOKENS));
        for r in [&[1, 2][..], &[1, 2], &[7, 8]] {
            lru.access(&full(r));
        }
        assert!(!lru.contains(1) && !lru.contains(2));
    }

    /// Every cached block's parent is cached and ranked after it (never an orphan).
    fn assert_prefix_closed(c: &Cache, parent: &HashMap<u64, Option<u64>>) {
        let pos: HashMap<u64, usize> =
            c.eviction_order().enumerate().map(|(i, b)| (b, i)).collect();
        for (&b, &i) in &pos {
            if let Some(p) = parent[&b] {
                assert!(pos.get(&p).is_some_and(|&j| j > i), "block {b} outranks its parent {p}");
            }
        }
    }

    /// Requests over a small random prefix tree: each extends a previous request's prefix.
    fn arb_requests() -> impl proptest::strategy::Strategy<Value = Vec<Request>> {
        use proptest::prelude::*;
        prop::collection::vec((0usize..8, 0usize..6, 1u64..=BLOCK_TOKENS), 1..60).prop_map(
            |steps| {
                let mut next_id = 0u64;
                let mut reqs: Vec<Request> = Vec::new();
                for (i, (base, keep_extra, last_tokens)) in steps.into_iter().enumerate() {
                    let mut blocks = match reqs.get(base % (i.max(1))) {
                        Some(r) => r.blocks[..r.blocks.len().min(keep_extra)].to_vec(),
                        None => Vec::new(),
                    };
                    for _ in 0..(1 + (base + keep_extra) % 4) {
                        blocks.push(next_id);
                        next_id += 1;
                    }
                    let input_len = (blocks.len() as u64 - 1) * BLOCK_TOKENS + last_tokens;
                    reqs.push(Request { timestamp_ms: i as u64, input_len, output_len: 0, blocks });
                }
                reqs
            },
        )
    }

    proptest::proptest! {
        #[test]
        fn unbounded_matches_a_set_and_hits_never_exceed_input(reqs in arb_requests(), cap in 0u64..12) {
            let mut seen = std::collections::HashSet::new();
            let mut hit_tokens = 0;
            for r in &reqs {
                let n = r.blocks.iter().take_while(|b| seen.contains(*b)).count();
                hit_tokens += (n as u64 * BLOCK_TOKENS).min(r.input_len);
                seen.extend(r.blocks.iter().copied());
            }
            for policy in [Policy::Lru, Policy::Kvfs] {
                let s = replay(&reqs, policy, Capacity::Unbounded);
                proptest::prop_assert_eq!(s.hit_tokens, hit_tokens);
                proptest::prop_assert_eq!(s.cached_blocks, seen.len() as u64);
                let bounded = replay(&reqs, policy, Capacity::Tokens(cap * BLOCK_TOKENS));
                proptest::prop_assert!(bounded.hit_tokens <= s.hit_tokens);
                proptest::prop_assert!(bounded.cached_blocks <= cap);
            }
            let mut parent = HashMap::new();
            for r in &reqs {
                for (i, &b) in r.blocks.iter().enumerate() {
                    parent.insert(b, i.checked_sub(1).map(|j| r.blocks[j]));
                }
            }
            let filter_always = KvfsConfig { duel_half_life_requests: 0.0, ..KvfsConfig::DEFAULT };
            for policy in [Policy::Kvfs, Policy::KvfsWith(filter_always)] {
                let mut c = Cache::new(policy, Capacity::Tokens(cap * BLOCK_TOKENS));
                for r in &reqs {
                    let a = c.access(r);
                    proptest::prop_assert!(a.hit_tokens <= r.input_len);
                    assert_prefix_closed(&c, &parent);
                }
            }
        }
    }

    #[test]
    fn malformed_lines_are_named() {
        let ok = r#"{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [1, 2]}"#;
        let early = r#"{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#;
        let t = Trace::parse(format!("{ok}\n\n{early}\n").as_bytes()).unwrap();
        assert_eq!(t.requests.iter().map(|r| r.timestamp_ms).collect::<Vec<_>>(), [1, 5]);
        assert_eq!(t.input_tokens(), 514);
        let short =
            r#"{"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}"#;
        let e = Trace::parse(format!("{ok}\n{short}\n").as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("line 2: 2 hash_ids for input_length 1025"), "{e}");
        let e = Trace::parse(format!("{ok}\n{ok}\n{{\"timestamp\": 1}}\n").as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("line 3: missing field"), "{e}");
        let e = Trace::load(Path::new("/nonexistent/trace.jsonl")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/trace.jsonl"), "{e}");
    }

    #[test]
    fn kvfs_beats_lru_on_the_head_of_the_conversation_trace() {
        // The first 500 lines of the real trace, kept in the repository (tests/data/README.md).
        let head =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/conversation_trace_head.jsonl");
        let t = Trace::load(&head).unwrap();
        assert_eq!(t.requests.len(), 500);
        let ceiling = replay(&t.requests, Policy::Lru, Capacity::Unbounded).token_hit_rate();
        for cap in [10_000u64, 50_000, 100_000, 200_000, 500_000] {
            let lru = replay(&t.requests, Policy::Lru, Capacity::Tokens(cap)).token_hit_rate();
            let kvfs = replay(&t.requests, Policy::Kvfs, Capacity::Tokens(cap)).token_hit_rate();
            println!("{cap:>7} tokens: lru {lru:.4} kvfs {kvfs:.4} ceiling {ceiling:.4}");
            assert!(kvfs >= lru, "at {cap} tokens kvfs {kvfs} < lru {lru}");
            assert!(kvfs <= ceiling);
        }
    }
}
