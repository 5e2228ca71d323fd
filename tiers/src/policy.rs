//! The tier policy core: a sans-IO state machine that decides what moves between DRAM and NVMe
//! and what NVMe may drop. No clock, no I/O: the node feeds it events (`on_stored`,
//! `on_access`, `on_removed`, durability changes, action completions) and tier usage, each with
//! `now_ms`, and executes the [`Action`]s that [`TierPolicy::decide`] returns.
//!
//! Policy:
//! - Demotion DRAM -> NVMe when DRAM (projected: minus demotions in flight, plus promotions in
//!   flight) is above `dram_high_watermark`, down to `dram_low_watermark`, coldest first.
//!   Coldness orders by the admission sketch's frequency estimate, then by last access (LFU
//!   with LRU tie-break, the TinyLFU shape). Only while NVMe stays under its high watermark.
//! - Promotion NVMe -> DRAM for objects whose windowed access count reaches
//!   `promote_min_accesses` and that were read within the window, hottest first, only while DRAM
//!   stays under its high watermark (a promotion never forces a demotion). One-off reads never
//!   promote: counts come from a count-min sketch that is halved every `window_ms`.
//! - Drop from NVMe, when NVMe is above `nvme_high_watermark`, of the coldest objects that are
//!   persisted to object storage or have a replica elsewhere (never the last copy, never a
//!   pinned object), down to `nvme_low_watermark`. Drops move no bytes.
//! - A token bucket per direction caps the bytes moved per second (`demote_bytes_per_s`,
//!   `promote_bytes_per_s`, bursts of `*_burst_bytes`), so tier traffic stays a bounded share
//!   of the disk and never costs more than the recompute it saves. An object larger than the
//!   burst may start when the bucket is full and leaves it in debt.
//!
//! Invariants: an object has at most one action in flight; `decide` never emits an action for
//! a moving, deferred (see [`TierPolicy::defer`]), pinned (for drops) or unknown object; bytes emitted per direction over any span
//! `T` are at most `rate * T + burst + largest object`. Tests drive it with synthetic traces.
//!
//! Not handled: HBM and object storage as tiers of the state machine (the node treats HBM as
//! the engine's and object storage as persistence), copies held in two tiers at once (an
//! object's tier is where its primary copy is), eviction of last copies (the master's job).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Object keys are hashed on every put and drop a node records: foldhash, not SipHash (keys
/// come from the cluster's own writers; the policy needs speed, not DoS resistance).
type KeyMap<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// Tiers the policy moves objects between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Dram,
    Nvme,
}

/// What the node should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Demote { key: String, size_bytes: u64 },
    Promote { key: String, size_bytes: u64 },
    Drop { key: String, size_bytes: u64 },
}

impl Action {
    pub fn key(&self) -> &str {
        match self {
            Action::Demote { key, .. } | Action::Promote { key, .. } | Action::Drop { key, .. } => {
                key
            }
        }
    }
}

/// Usage of one tier as the medium reports it.
#[derive(Debug, Clone, Copy, Default)]
pub struct TierUsage {
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

/// Knobs of the policy.
#[derive(Debug, Clone, Copy)]
pub struct PolicyConfig {
    pub dram_high_watermark: f64,
    pub dram_low_watermark: f64,
    pub nvme_high_watermark: f64,
    pub nvme_low_watermark: f64,
    /// Windowed reads an NVMe object needs before it is promoted (>= 2 keeps one-offs out).
    pub promote_min_accesses: u32,
    /// Length of the admission window; sketch counters halve once per window.
    pub window_ms: u64,
    pub demote_bytes_per_s: u64,
    pub demote_burst_bytes: u64,
    pub promote_bytes_per_s: u64,
    pub promote_burst_bytes: u64,
    /// Actions one `decide` returns at most.
    pub actions_per_round_max: usize,
    /// Counters per sketch row (rounded up to a power of two).
    pub sketch_width: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            dram_high_watermark: 0.90,
            dram_low_watermark: 0.80,
            nvme_high_watermark: 0.90,
            nvme_low_watermark: 0.80,
            promote_min_accesses: 3,
            window_ms: 60_000,
            demote_bytes_per_s: 500_000_000,
            demote_burst_bytes: 256 << 20,
            promote_bytes_per_s: 500_000_000,
            promote_burst_bytes: 256 << 20,
            actions_per_round_max: 256,
            sketch_width: 1 << 16,
        }
    }
}

const SKETCH_DEPTH: usize = 4;

/// A count-min sketch with 4 rows of saturating u16 counters, halved on aging.
#[derive(Debug, Clone)]
pub struct CountMinSketch {
    rows: Vec<u16>,
    mask: usize,
    hasher: std::collections::hash_map::RandomState,
}

impl CountMinSketch {
    pub fn new(width: usize) -> Self {
        let w = width.max(16).next_power_of_two();
        CountMinSketch { rows: vec![0; w * SKETCH_DEPTH], mask: w - 1, hasher: Default::default() }
    }

    fn slots(&self, key: &str) -> [usize; SKETCH_DEPTH] {
        let mut h = self.hasher.build_hasher();
        h.write(key.as_bytes());
        let x = h.finish();
        let (h1, h2) = (x as usize, ((x >> 32) as usize) | 1);
        let w = self.mask + 1;
        std::array::from_fn(|i| i * w + (h1.wrapping_add(i.wrapping_mul(h2)) & self.mask))
    }

    pub fn increment(&mut self, key: &str) {
        for s in self.slots(key) {
            self.rows[s] = self.rows[s].saturating_add(1);
        }
    }

    /// An estimate that is never below the true count since the last aging.
    pub fn estimate(&self, key: &str) -> u32 {
        self.slots(key).iter().map(|&s| self.rows[s] as u32).min().unwrap_or(0)
    }

    /// Halve every counter (old accesses fade).
    pub fn age(&mut self) {
        for c in &mut self.rows {
            *c >>= 1;
        }
    }
}

/// A token bucket in bytes; may go into debt by one object.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    rate_per_ms: f64,
    burst: f64,
    last_ms: u64,
}

impl Bucket {
    fn new(rate_per_s: u64, burst: u64) -> Self {
        Bucket {
            tokens: burst as f64,
            rate_per_ms: rate_per_s as f64 / 1000.0,
            burst: burst as f64,
            last_ms: 0,
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.last_ms) as f64;
        self.tokens = (self.tokens + dt * self.rate_per_ms).min(self.burst);
        self.last_ms = self.last_ms.max(now_ms);
    }

    fn take(&mut self, bytes: u64) -> bool {
        let need = (bytes as f64).min(self.burst);
        if self.tokens >= need && self.tokens > 0.0 {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }
}

/// A copy as its holder reports it to [`TierPolicy::sync_held`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub tier: Tier,
    pub size_bytes: u64,
    /// In object storage.
    pub persisted: bool,
    /// Replicas of the object on other nodes.
    pub replicas_elsewhere: u32,
    pub pinned: bool,
}

#[derive(Debug, Clone)]
struct ObjState {
    tier: Tier,
    size_bytes: u64,
    last_access_ms: u64,
    persisted: bool,
    replicas_elsewhere: u32,
    pinned: bool,
    moving: bool,
    /// Not a candidate for any action before this (the node was told to wait, e.g. a read
    /// lease protects the copy it wanted to drop).
    not_before_ms: u64,
}

/// Counters for logs and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyStats {
    pub demotions: u64,
    pub promotions: u64,
    pub drops: u64,
    /// Rounds where a wanted move waited for the rate limit.
    pub rate_limited_rounds: u64,
    /// Rounds where NVMe stayed above its watermark with nothing droppable.
    pub nvme_pressure_unresolved: u64,
}

/// The tier policy state machine.
pub struct TierPolicy {
    cfg: PolicyConfig,
    objects: KeyMap<ObjState>,
    sketch: CountMinSketch,
    last_aging_ms: u64,
    demote_bucket: Bucket,
    promote_bucket: Bucket,
    inflight_demote_bytes: u64,
    inflight_promote_bytes: u64,
    inflight_drop_bytes: u64,
    stats: PolicyStats,
}

impl TierPolicy {
    pub fn new(cfg: PolicyConfig) -> Self {
        TierPolicy {
            sketch: CountMinSketch::new(cfg.sketch_width),
            demote_bucket: Bucket::new(cfg.demote_bytes_per_s, cfg.demote_burst_bytes),
            promote_bucket: Bucket::new(cfg.promote_bytes_per_s, cfg.promote_burst_bytes),
            cfg,
            objects: KeyMap::default(),
            last_aging_ms: 0,
            inflight_demote_bytes: 0,
            inflight_promote_bytes: 0,
            inflight_drop_bytes: 0,
            stats: PolicyStats::default(),
        }
    }

    pub fn stats(&self) -> PolicyStats {
        self.stats
    }

    /// The tier the policy believes holds `key`.
    pub fn tier_of(&self, key: &str) -> Option<Tier> {
        self.objects.get(key).map(|o| o.tier)
    }

    /// Windowed access estimate of `key`.
    pub fn access_estimate(&self, key: &str) -> u32 {
        self.sketch.estimate(key)
    }

    fn age_to(&mut self, now_ms: u64) {
        let w = self.cfg.window_ms.max(1);
        let mut halvings = 0;
        while now_ms >= self.last_aging_ms + w && halvings < 17 {
            self.sketch.age();
            self.last_aging_ms += w;
            halvings += 1;
        }
        if now_ms >= self.last_aging_ms + w {
            self.last_aging_ms = now_ms - (now_ms - self.last_aging_ms) % w;
        }
    }

    /// An object landed in `tier` (a put, or a re-report after restart).
    pub fn on_stored(&mut self, key: &str, tier: Tier, size_bytes: u64, now_ms: u64) {
        let held =
            Held { tier, size_bytes, persisted: false, replicas_elsewhere: 0, pinned: false };
        self.store(key.to_owned(), held, now_ms);
    }

    /// What a node knows of a copy it holds, in one call and (when the tier is unchanged) one
    /// lookup: `on_stored` when `key` is new to the policy or changed tier, then
    /// `set_durability` and `set_pinned`. The node calls this for every object it records.
    pub fn sync_held(&mut self, key: &str, held: Held, now_ms: u64) {
        if let Some(o) = self.objects.get_mut(key)
            && o.tier == held.tier
        {
            o.persisted = held.persisted;
            o.replicas_elsewhere = held.replicas_elsewhere;
            o.pinned = held.pinned;
            return;
        }
        self.store(key.to_owned(), held, now_ms);
    }

    fn store(&mut self, key: String, held: Held, now_ms: u64) {
        self.age_to(now_ms);
        let prev = self.objects.insert(
            key,
            ObjState {
                tier: held.tier,
                size_bytes: held.size_bytes,
                last_access_ms: now_ms,
                persisted: held.persisted,
                replicas_elsewhere: held.replicas_elsewhere,
                pinned: held.pinned,
                moving: false,
                not_before_ms: 0,
            },
        );
        if let Some(p) = prev
            && p.moving
        {
            // An overwrite during a move: the move's completion will be ignored.
            self.forget_inflight(&p);
        }
    }

    /// A read of `key`.
    pub fn on_access(&mut self, key: &str, now_ms: u64) {
        self.age_to(now_ms);
        self.sketch.increment(key);
        if let Some(o) = self.objects.get_mut(key) {
            o.last_access_ms = o.last_access_ms.max(now_ms);
        }
    }

    pub fn on_removed(&mut self, key: &str) {
        if let Some(o) = self.objects.remove(key)
            && o.moving
        {
            self.forget_inflight(&o);
        }
    }

    /// Whether the object is in object storage, and how many replicas exist on other nodes.
    pub fn set_durability(&mut self, key: &str, persisted: bool, replicas_elsewhere: u32) {
        if let Some(o) = self.objects.get_mut(key) {
            o.persisted = persisted;
            o.replicas_elsewhere = replicas_elsewhere;
        }
    }

    /// Keep `key` out of every action until `until_ms` (the node learned that asking earlier
    /// cannot succeed: a read lease, a last copy).
    pub fn defer(&mut self, key: &str, until_ms: u64) {
        if let Some(o) = self.objects.get_mut(key) {
            o.not_before_ms = o.not_before_ms.max(until_ms);
        }
    }

    pub fn set_pinned(&mut self, key: &str, pinned: bool) {
        if let Some(o) = self.objects.get_mut(key) {
            o.pinned = pinned;
        }
    }

    fn forget_inflight(&mut self, o: &ObjState) {
        match o.tier {
            Tier::Dram => {
                self.inflight_demote_bytes = self.inflight_demote_bytes.saturating_sub(o.size_bytes)
            }
            Tier::Nvme => {
                // A moving NVMe object is being promoted or dropped; we do not know which here,
                // so release from both (saturating) conservatively.
                self.inflight_promote_bytes =
                    self.inflight_promote_bytes.saturating_sub(o.size_bytes);
                self.inflight_drop_bytes = self.inflight_drop_bytes.saturating_sub(o.size_bytes);
            }
        }
    }

    /// The node finished (or failed) an action that `decide` returned.
    pub fn on_action_done(&mut self, action: &Action, ok: bool) {
        let Some(o) = self.objects.get_mut(action.key()) else { return };
        if !o.moving {
            return;
        }
        o.moving = false;
        match action {
            Action::Demote { size_bytes, .. } => {
                self.inflight_demote_bytes = self.inflight_demote_bytes.saturating_sub(*size_bytes);
                if ok {
                    o.tier = Tier::Nvme;
                }
            }
            Action::Promote { size_bytes, .. } => {
                self.inflight_promote_bytes =
                    self.inflight_promote_bytes.saturating_sub(*size_bytes);
                if ok {
                    o.tier = Tier::Dram;
                }
            }
            Action::Drop { key, size_bytes } => {
                self.inflight_drop_bytes = self.inflight_drop_bytes.saturating_sub(*size_bytes);
                if ok {
                    let k = key.clone();
                    self.objects.remove(&k);
                }
            }
        }
    }

    /// Coldest first: (frequency estimate, last access, key) ascending.
    fn candidates(
        &self,
        tier: Tier,
        now_ms: u64,
        pred: impl Fn(&ObjState) -> bool,
    ) -> Vec<(u32, u64, &str, u64)> {
        let mut v: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, o)| o.tier == tier && !o.moving && o.not_before_ms <= now_ms && pred(o))
            .map(|(k, o)| (self.sketch.estimate(k), o.last_access_ms, k.as_str(), o.size_bytes))
            .collect();
        v.sort_unstable();
        v
    }

    fn start(&mut self, action: Action, out: &mut Vec<Action>) {
        if let Some(o) = self.objects.get_mut(action.key()) {
            o.moving = true;
        }
        match &action {
            Action::Demote { size_bytes, .. } => {
                self.inflight_demote_bytes += size_bytes;
                self.stats.demotions += 1;
            }
            Action::Promote { size_bytes, .. } => {
                self.inflight_promote_bytes += size_bytes;
                self.stats.promotions += 1;
            }
            Action::Drop { size_bytes, .. } => {
                self.inflight_drop_bytes += size_bytes;
                self.stats.drops += 1;
            }
        }
        out.push(action);
    }

    /// Decide the next round of actions given current usage.
    pub fn decide(&mut self, now_ms: u64, dram: TierUsage, nvme: TierUsage) -> Vec<Action> {
        self.age_to(now_ms);
        self.demote_bucket.refill(now_ms);
        self.promote_bucket.refill(now_ms);
        let max = self.cfg.actions_per_round_max;
        let mut out = Vec::new();
        let frac = |cap: u64, f: f64| (cap as f64 * f) as u64;
        let dram_proj = |p: &Self| {
            (dram.used_bytes + p.inflight_promote_bytes).saturating_sub(p.inflight_demote_bytes)
        };
        let nvme_proj = |p: &Self| {
            (nvme.used_bytes + p.inflight_demote_bytes)
                .saturating_sub(p.inflight_promote_bytes + p.inflight_drop_bytes)
        };

        // Drops first: they free NVMe room for demotions and move no bytes.
        if nvme_proj(self) > frac(nvme.capacity_bytes, self.cfg.nvme_high_watermark) {
            let target = frac(nvme.capacity_bytes, self.cfg.nvme_low_watermark);
            let picks: Vec<(String, u64)> = self
                .candidates(Tier::Nvme, now_ms, |o| {
                    !o.pinned && (o.persisted || o.replicas_elsewhere > 0)
                })
                .into_iter()
                .map(|(_, _, k, s)| (k.to_owned(), s))
                .collect();
            for (key, size_bytes) in picks {
                if nvme_proj(self) <= target || out.len() >= max {
                    break;
                }
                self.start(Action::Drop { key, size_bytes }, &mut out);
            }
            if nvme_proj(self) > frac(nvme.capacity_bytes, self.cfg.nvme_high_watermark) {
                self.stats.nvme_pressure_unresolved += 1;
            }
        }

        // Demotions, coldest first.
        if dram_proj(self) > frac(dram.capacity_bytes, self.cfg.dram_high_watermark) {
            let target = frac(dram.capacity_bytes, self.cfg.dram_low_watermark);
            let nvme_limit = frac(nvme.capacity_bytes, self.cfg.nvme_high_watermark);
            let picks: Vec<(String, u64)> = self
                .candidates(Tier::Dram, now_ms, |_| true)
                .into_iter()
                .map(|(_, _, k, s)| (k.to_owned(), s))
                .collect();
            for (key, size_bytes) in picks {
                if dram_proj(self) <= target || out.len() >= max {
                    break;
                }
                if nvme_proj(self) + size_bytes > nvme_limit {
                    continue;
                }
                if !self.demote_bucket.take(size_bytes) {
                    self.stats.rate_limited_rounds += 1;
                    break;
                }
                self.start(Action::Demote { key, size_bytes }, &mut out);
            }
        }

        // Promotions, hottest first, only into room under the DRAM high watermark.
        let window_start = now_ms.saturating_sub(self.cfg.window_ms);
        let min = self.cfg.promote_min_accesses.max(1);
        let mut hot: Vec<(u32, u64, String, u64)> = self
            .candidates(Tier::Nvme, now_ms, |o| o.last_access_ms >= window_start)
            .into_iter()
            .filter(|c| c.0 >= min)
            .map(|(f, t, k, s)| (f, t, k.to_owned(), s))
            .collect();
        hot.reverse();
        let dram_limit = frac(dram.capacity_bytes, self.cfg.dram_high_watermark);
        for (_, _, key, size_bytes) in hot {
            if out.len() >= max {
                break;
            }
            if dram_proj(self) + size_bytes > dram_limit {
                continue;
            }
            if !self.promote_bucket.take(size_bytes) {
                self.stats.rate_limited_rounds += 1;
                break;
            }
            self.start(Action::Promote { key, size_bytes }, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MB: u64 = 1_000_000;

    fn cfg() -> PolicyConfig {
        PolicyConfig {
            demote_bytes_per_s: 100 * MB,
            demote_burst_bytes: 100 * MB,
            promote_bytes_per_s: 100 * MB,
            promote_burst_bytes: 100 * MB,
            window_ms: 10_000,
            promote_min_accesses: 3,
            sketch_width: 4096,
            ..Default::default()
        }
    }

    fn usage(p: &TierPolicy, tier: Tier, capacity_bytes: u64) -> TierUsage {
        let used_bytes = p.objects.values().filter(|o| o.tier == tier).map(|o| o.size_bytes).sum();
        TierUsage { used_bytes, capacity_bytes }
    }

    /// Apply every action as if it succeeded.
    fn complete(p: &mut TierPolicy, actions: &[Action]) {
        for a in actions {
            p.on_action_done(a, true);
        }
    }

    #[test]
    fn sync_held_matches_stored_then_durability_then_pin() {
        let held = |tier, persisted, pinned| Held {
            tier,
            size_bytes: MB,
            persisted,
            replicas_elsewhere: 0,
            pinned,
        };
        let mut a = TierPolicy::new(cfg());
        let mut b = TierPolicy::new(cfg());
        // New key: stored with its flags.
        a.sync_held("k", held(Tier::Dram, true, true), 5);
        b.on_stored("k", Tier::Dram, MB, 5);
        b.set_durability("k", true, 0);
        b.set_pinned("k", true);
        // Same tier: flags change, the object's access history does not.
        a.on_access("k", 7);
        b.on_access("k", 7);
        a.sync_held("k", held(Tier::Dram, false, false), 9);
        b.set_durability("k", false, 0);
        b.set_pinned("k", false);
        // Another tier: stored afresh.
        a.sync_held("j", held(Tier::Dram, false, false), 10);
        b.on_stored("j", Tier::Dram, MB, 10);
        a.sync_held("j", held(Tier::Nvme, true, false), 11);
        b.on_stored("j", Tier::Nvme, MB, 11);
        b.set_durability("j", true, 0);
        for key in ["k", "j"] {
            let (x, y) = (&a.objects[key], &b.objects[key]);
            assert_eq!(
                (x.tier, x.last_access_ms, x.persisted, x.pinned, x.size_bytes),
                (y.tier, y.last_access_ms, y.persisted, y.pinned, y.size_bytes),
                "{key}"
            );
        }
        assert_eq!(a.objects["k"].last_access_ms, 7);
    }

    #[test]
    fn one_off_reads_never_promote() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..1000 {
            p.on_stored(&format!("k{i}"), Tier::Nvme, MB, 0);
        }
        for i in 0..1000 {
            p.on_access(&format!("k{i}"), 1 + i as u64);
        }
        let a = p.decide(
            2000,
            TierUsage { used_bytes: 0, capacity_bytes: 10_000 * MB },
            usage(&p, Tier::Nvme, 10_000 * MB),
        );
        assert!(a.is_empty(), "{a:?}");
    }

    #[test]
    fn hot_objects_promote_and_fade_after_the_window() {
        let mut p = TierPolicy::new(cfg());
        p.on_stored("hot", Tier::Nvme, MB, 0);
        p.on_stored("warm", Tier::Nvme, MB, 0);
        for t in 0..3 {
            p.on_access("hot", 100 + t);
        }
        p.on_access("warm", 100);
        p.on_access("warm", 101);
        let dram = TierUsage { used_bytes: 0, capacity_bytes: 100 * MB };
        let a = p.decide(200, dram, usage(&p, Tier::Nvme, 100 * MB));
        assert_eq!(a, vec![Action::Promote { key: "hot".into(), size_bytes: MB }]);
        assert!(
            p.decide(300, dram, usage(&p, Tier::Nvme, 100 * MB)).is_empty(),
            "in flight: not re-emitted"
        );
        complete(&mut p, &a);
        assert_eq!(p.tier_of("hot"), Some(Tier::Dram));
        // Two windows later the warm object's two reads have faded: a third read is not enough.
        p.on_access("warm", 25_000);
        assert!(p.access_estimate("warm") < 3);
        assert!(p.decide(25_001, dram, usage(&p, Tier::Nvme, 100 * MB)).is_empty());
    }

    #[test]
    fn demotes_coldest_first_down_to_the_low_watermark() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Dram, 10 * MB, i);
        }
        // k0..k2 are the oldest; make k0 frequently read so it is not cold.
        for t in 0..5 {
            p.on_access("k0", 20 + t);
        }
        let a = p.decide(
            100,
            usage(&p, Tier::Dram, 100 * MB),
            TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB },
        );
        let keys: Vec<&str> = a.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k1", "k2"], "90 -> 80 MB with 10 MB objects; k0 is hot");
        assert!(a.iter().all(|a| matches!(a, Action::Demote { .. })));
        complete(&mut p, &a);
        assert_eq!(p.tier_of("k1"), Some(Tier::Nvme));
    }

    #[test]
    fn drops_only_what_exists_elsewhere_and_never_pinned() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Nvme, 10 * MB, i);
        }
        p.set_durability("k5", true, 0);
        p.set_durability("k6", false, 2);
        p.set_durability("k7", true, 0);
        p.set_pinned("k7", true);
        let dram = TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB };
        let a = p.decide(100, dram, usage(&p, Tier::Nvme, 100 * MB));
        let mut keys: Vec<&str> = a.iter().map(|a| a.key()).collect();
        keys.sort();
        assert_eq!(keys, ["k5", "k6"]);
        assert!(a.iter().all(|a| matches!(a, Action::Drop { .. })));
        assert_eq!(p.stats().nvme_pressure_unresolved, 0, "80 MB is under the high watermark");
        complete(&mut p, &a);
        assert_eq!(p.tier_of("k5"), None);
    }

    #[test]
    fn failed_actions_leave_the_object_where_it_was() {
        let mut p = TierPolicy::new(cfg());
        p.on_stored("a", Tier::Dram, 95 * MB, 0);
        let big = TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB };
        let a = p.decide(1, usage(&p, Tier::Dram, 100 * MB), big);
        assert_eq!(a.len(), 1);
        p.on_action_done(&a[0], false);
        assert_eq!(p.tier_of("a"), Some(Tier::Dram));
        let again = p.decide(2_000, usage(&p, Tier::Dram, 100 * MB), big);
        assert_eq!(again, a, "retried after a failure");
    }

    #[test]
    fn deferred_objects_wait_and_others_go_first() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Dram, 10 * MB, i);
        }
        let big = TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB };
        let a = p.decide(100, usage(&p, Tier::Dram, 100 * MB), big);
        let keys: Vec<&str> = a.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k0", "k1"]);
        for x in &a {
            p.on_action_done(x, false);
            p.defer(x.key(), 5_000);
        }
        let b = p.decide(200, usage(&p, Tier::Dram, 100 * MB), big);
        let keys: Vec<&str> = b.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k2", "k3"], "the deferred coldest objects are skipped");
        for x in &b {
            p.on_action_done(x, false);
        }
        let c = p.decide(6_000, usage(&p, Tier::Dram, 100 * MB), big);
        assert_eq!(c.first().map(|a| a.key()), Some("k0"), "deferral ends");
    }

    proptest! {
        #[test]
        fn sketch_never_underestimates(keys in prop::collection::vec(0u16..300, 1..2000)) {
            let mut s = CountMinSketch::new(256);
            let mut truth: HashMap<u16, u32> = HashMap::new();
            for k in &keys {
                s.increment(&format!("key-{k}"));
                *truth.entry(*k).or_default() += 1;
            }
            for (k, n) in truth {
                let est = s.estimate(&format!("key-{}", k));
                prop_assert!(est >= n, "estimate {} below true count {}", est, n);
            }
        }

        /// Over any trace, demoted bytes never exceed rate * elapsed + burst + one object.
        #[test]
        fn demotion_respects_the_rate_limit(
            sizes in prop::collection::vec(1u64..20, 50..300),
            steps in prop::collection::vec(1u64..500, 1..60),
        ) {
            let mut p = TierPolicy::new(cfg());
            for (i, s) in sizes.iter().enumerate() {
                p.on_stored(&format!("k{i}"), Tier::Dram, s * MB, 0);
            }
            let dram_cap = sizes.iter().sum::<u64>() * MB / 2; // far above the watermark
            let nvme = TierUsage { used_bytes: 0, capacity_bytes: u64::MAX / 4 };
            let (mut now, mut moved) = (0u64, 0u64);
            for dt in steps {
                now += dt;
                let a = p.decide(now, usage(&p, Tier::Dram, dram_cap), nvme);
                moved += a.iter().map(|a| match a { Action::Demote { size_bytes, .. } => *size_bytes, _ => 0 }).sum::<u64>();
                complete(&mut p, &a);
                let bound = 100 * MB * now / 1000 + 100 * MB + 20 * MB;
                prop_assert!(moved <= bound, "moved {moved} > bound {bound} at {now} ms");
            }
        }
    }
}
