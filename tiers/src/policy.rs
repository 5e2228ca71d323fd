//! The tier policy core: a sans-IO state machine that decides what moves between HBM, DRAM and
//! NVMe and what NVMe may drop. No clock, no I/O: the node feeds it events (`on_stored`,
//! `on_access`, `on_removed`, durability changes, action completions) and tier usage, each with
//! `now_ms`, and executes the [`Action`]s that [`TierPolicy::decide`] returns.
//!
//! Tiers, fastest first: HBM (GPU memory), DRAM, NVMe. An object's tier is the highest one
//! holding a copy on this node. Moves go one tier at a time; a tier the node lacks (capacity 0)
//! is in no action.
//!
//! Policy, in the order one `decide` takes it:
//! - Drop from NVMe, when NVMe is above `nvme_high_watermark`, of the coldest objects that are
//!   persisted to object storage or have a replica elsewhere (never the last copy, never a
//!   pinned object), down to `nvme_low_watermark`. Drops move no bytes.
//! - Demotion DRAM -> NVMe when DRAM (projected: plus moves into it in flight, minus moves out
//!   of it) is above `dram_high_watermark`, down to `dram_low_watermark`. DRAM copies of HBM
//!   objects (left by a promotion whose DRAM release a read lease refused) are released first:
//!   they free DRAM without moving a byte or leaving the fast tiers. Then objects of tier DRAM,
//!   coldest first, only while NVMe stays under its high watermark. Coldness orders by the
//!   admission sketch's frequency estimate, then by last access (LFU with LRU tie-break, the
//!   TinyLFU shape).
//! - Demotion HBM -> DRAM when HBM is above `hbm_high_watermark`, down to `hbm_low_watermark`,
//!   coldest first, only while DRAM stays under its high watermark (an HBM demotion never
//!   pushes DRAM into demoting).
//! - Promotion NVMe -> DRAM for objects whose windowed access count reaches
//!   `promote_min_accesses` and that were read within the window, hottest first, only while
//!   DRAM stays under its high watermark (a promotion never forces a demotion). One-off reads
//!   never promote: counts come from a count-min sketch that is halved every `window_ms`.
//! - Promotion DRAM -> HBM by the same test, of objects whose writer put them into HBM
//!   (`hbm_home`) only, only while HBM stays under its high watermark. A put that did not ask
//!   for HBM never lands there: HBM belongs to the engine that asked for it.
//! - A token bucket per direction caps the bytes moved per second: `demote_bytes_per_s` and
//!   `promote_bytes_per_s` for the disk's directions, `hbm_move_bytes_per_s` for each of the
//!   two HBM directions (those cross PCIe and do not spend the disk's budget); bursts of
//!   `*_burst_bytes`. Tier traffic stays a bounded share of each link and never costs more
//!   than the recompute it saves. An object larger than the burst may start when the bucket
//!   is full and leaves it in debt. Releases and drops move no bytes and spend no tokens.
//!
//! Invariants: an object has at most one action in flight, and its state remembers which (the
//! move and its bytes), so an overwrite or removal during a move releases exactly that move's
//! share of the projections; `decide` never emits an action for a moving, deferred (see
//! [`TierPolicy::defer`]), pinned (for drops) or unknown object; bytes emitted per direction
//! over any span `T` are at most `rate * T + burst + largest object`. Tests drive it with
//! synthetic traces.
//!
//! Not handled: object storage as a tier of the state machine (the node treats it as
//! persistence), copies held in two tiers at once beyond the DRAM copy of an HBM object (an
//! object's tier is where its primary copy is), eviction of last copies (the master's job).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Object keys are hashed on every put and drop a node records: foldhash, not SipHash (keys
/// come from the cluster's own writers; the policy needs speed, not DoS resistance).
type KeyMap<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// Tiers the policy moves objects between, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Hbm,
    Dram,
    Nvme,
}

/// What the node should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Copy one tier down, then drop the upper copy: `from: Tier::Hbm` is HBM -> DRAM,
    /// `from: Tier::Dram` is DRAM -> NVMe. For an object whose tier is Hbm and that also holds a
    /// DRAM copy (`Held::dram_copy`), `Demote { from: Dram }` means: release that DRAM copy (no
    /// bytes move), and `Demote { from: Hbm }` needs no copy (the DRAM copy is there already).
    Demote {
        key: String,
        size_bytes: u64,
        from: Tier,
    },
    /// Copy one tier up: `to: Tier::Dram` is NVMe -> DRAM, `to: Tier::Hbm` is DRAM -> HBM.
    Promote {
        key: String,
        size_bytes: u64,
        to: Tier,
    },
    Drop {
        key: String,
        size_bytes: u64,
    },
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

/// Usage of the node's three tiers; a tier the node lacks has capacity 0 (then no action
/// involves it).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub hbm: TierUsage,
    pub dram: TierUsage,
    pub nvme: TierUsage,
}

/// Knobs of the policy.
#[derive(Debug, Clone, Copy)]
pub struct PolicyConfig {
    pub hbm_high_watermark: f64,
    pub hbm_low_watermark: f64,
    pub dram_high_watermark: f64,
    pub dram_low_watermark: f64,
    pub nvme_high_watermark: f64,
    pub nvme_low_watermark: f64,
    /// Windowed reads an object needs before it is promoted (>= 2 keeps one-offs out).
    pub promote_min_accesses: u32,
    /// Length of the admission window; sketch counters halve once per window.
    pub window_ms: u64,
    pub demote_bytes_per_s: u64,
    pub demote_burst_bytes: u64,
    pub promote_bytes_per_s: u64,
    pub promote_burst_bytes: u64,
    /// Rate of each HBM direction (HBM -> DRAM, DRAM -> HBM), each with its own bucket.
    pub hbm_move_bytes_per_s: u64,
    pub hbm_move_burst_bytes: u64,
    /// Actions one `decide` returns at most.
    pub actions_per_round_max: usize,
    /// Counters per sketch row (rounded up to a power of two).
    pub sketch_width: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            hbm_high_watermark: 0.90,
            hbm_low_watermark: 0.80,
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
            hbm_move_bytes_per_s: 4_000_000_000,
            hbm_move_burst_bytes: 1 << 30,
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
    /// The highest tier holding a copy on this node (Hbm > Dram > Nvme).
    pub tier: Tier,
    pub size_bytes: u64,
    /// In object storage.
    pub persisted: bool,
    /// Replicas of the object on other nodes.
    pub replicas_elsewhere: u32,
    pub pinned: bool,
    /// The writer put it into HBM: it may be promoted back into HBM.
    pub hbm_home: bool,
    /// Tier Hbm only: a DRAM copy is held too (left from a promotion whose DRAM release a read
    /// lease refused).
    pub dram_copy: bool,
}

/// The moves an object can be in; one per action the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// HBM -> DRAM. `onto_copy`: the object holds a DRAM copy already, so DRAM does not grow
    /// and no bytes cross.
    HbmToDram {
        onto_copy: bool,
    },
    DramToNvme,
    /// Release of the DRAM copy of an object whose tier is HBM.
    ReleaseDramCopy,
    NvmeToDram,
    DramToHbm,
    Drop,
}

/// An action in flight as its object's state remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flight {
    mv: Move,
    size_bytes: u64,
}

/// Bytes that actions in flight will add to (`*_in`) and free from (`*_out`) each tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct InFlight {
    hbm_in: u64,
    hbm_out: u64,
    dram_in: u64,
    dram_out: u64,
    nvme_in: u64,
    nvme_out: u64,
}

impl InFlight {
    fn add(&mut self, f: InFlight) {
        self.hbm_in += f.hbm_in;
        self.hbm_out += f.hbm_out;
        self.dram_in += f.dram_in;
        self.dram_out += f.dram_out;
        self.nvme_in += f.nvme_in;
        self.nvme_out += f.nvme_out;
    }

    /// Takes back what `add` put in; the bookkeeping is exact, so nothing saturates.
    fn sub(&mut self, f: InFlight) {
        let fields = [
            (&mut self.hbm_in, f.hbm_in),
            (&mut self.hbm_out, f.hbm_out),
            (&mut self.dram_in, f.dram_in),
            (&mut self.dram_out, f.dram_out),
            (&mut self.nvme_in, f.nvme_in),
            (&mut self.nvme_out, f.nvme_out),
        ];
        for (total, part) in fields {
            debug_assert!(*total >= part, "in-flight bytes released twice");
            *total = total.saturating_sub(part);
        }
    }
}

impl Flight {
    fn effect(self) -> InFlight {
        let s = self.size_bytes;
        let mut e = InFlight::default();
        match self.mv {
            Move::HbmToDram { onto_copy } => {
                e.hbm_out = s;
                e.dram_in = if onto_copy { 0 } else { s };
            }
            Move::DramToNvme => (e.dram_out, e.nvme_in) = (s, s),
            Move::ReleaseDramCopy => e.dram_out = s,
            Move::NvmeToDram => (e.dram_in, e.nvme_out) = (s, s),
            Move::DramToHbm => e.hbm_in = s,
            Move::Drop => e.nvme_out = s,
        }
        e
    }

    /// Bytes the move copies across a link (what its bucket is charged).
    fn moved_bytes(self) -> u64 {
        match self.mv {
            Move::HbmToDram { onto_copy: true } | Move::ReleaseDramCopy | Move::Drop => 0,
            _ => self.size_bytes,
        }
    }

    fn action(self, key: String) -> Action {
        let size_bytes = self.size_bytes;
        match self.mv {
            Move::HbmToDram { .. } => Action::Demote { key, size_bytes, from: Tier::Hbm },
            Move::DramToNvme | Move::ReleaseDramCopy => {
                Action::Demote { key, size_bytes, from: Tier::Dram }
            }
            Move::NvmeToDram => Action::Promote { key, size_bytes, to: Tier::Dram },
            Move::DramToHbm => Action::Promote { key, size_bytes, to: Tier::Hbm },
            Move::Drop => Action::Drop { key, size_bytes },
        }
    }

    /// Whether `action` is this flight's (a completion of another action is ignored).
    fn is(self, action: &Action) -> bool {
        match action {
            Action::Demote { from, size_bytes, .. } => {
                let mv = matches!(
                    (self.mv, from),
                    (Move::HbmToDram { .. }, Tier::Hbm)
                        | (Move::DramToNvme | Move::ReleaseDramCopy, Tier::Dram)
                );
                mv && *size_bytes == self.size_bytes
            }
            Action::Promote { to, size_bytes, .. } => {
                let mv = matches!(
                    (self.mv, to),
                    (Move::NvmeToDram, Tier::Dram) | (Move::DramToHbm, Tier::Hbm)
                );
                mv && *size_bytes == self.size_bytes
            }
            Action::Drop { size_bytes, .. } => {
                self.mv == Move::Drop && *size_bytes == self.size_bytes
            }
        }
    }
}

#[derive(Debug, Clone)]
struct ObjState {
    tier: Tier,
    size_bytes: u64,
    last_access_ms: u64,
    persisted: bool,
    replicas_elsewhere: u32,
    pinned: bool,
    hbm_home: bool,
    /// Tier Hbm only: a DRAM copy is held too.
    dram_copy: bool,
    moving: Option<Flight>,
    /// Not a candidate for any action before this (the node was told to wait, e.g. a read
    /// lease protects the copy it wanted to drop).
    not_before_ms: u64,
}

/// Counters for logs and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyStats {
    /// DRAM -> NVMe, releases of DRAM copies included.
    pub demotions: u64,
    /// NVMe -> DRAM.
    pub promotions: u64,
    pub drops: u64,
    /// HBM -> DRAM.
    pub hbm_demotions: u64,
    /// DRAM -> HBM.
    pub hbm_promotions: u64,
    /// Rounds where a wanted move waited for the rate limit.
    pub rate_limited_rounds: u64,
    /// Rounds where NVMe stayed above its watermark with nothing droppable.
    pub nvme_pressure_unresolved: u64,
}

/// A candidate for a move: (frequency estimate, last access, key, size).
type Candidate = (u32, u64, String, u64);

fn frac(cap: u64, f: f64) -> u64 {
    (cap as f64 * f) as u64
}

/// Usage once the actions in flight are done.
fn project(used_bytes: u64, in_bytes: u64, out_bytes: u64) -> u64 {
    used_bytes.saturating_add(in_bytes).saturating_sub(out_bytes)
}

/// The tier policy state machine.
pub struct TierPolicy {
    cfg: PolicyConfig,
    objects: KeyMap<ObjState>,
    sketch: CountMinSketch,
    last_aging_ms: u64,
    demote_bucket: Bucket,
    promote_bucket: Bucket,
    hbm_demote_bucket: Bucket,
    hbm_promote_bucket: Bucket,
    inflight: InFlight,
    stats: PolicyStats,
}

impl TierPolicy {
    pub fn new(cfg: PolicyConfig) -> Self {
        TierPolicy {
            sketch: CountMinSketch::new(cfg.sketch_width),
            demote_bucket: Bucket::new(cfg.demote_bytes_per_s, cfg.demote_burst_bytes),
            promote_bucket: Bucket::new(cfg.promote_bytes_per_s, cfg.promote_burst_bytes),
            hbm_demote_bucket: Bucket::new(cfg.hbm_move_bytes_per_s, cfg.hbm_move_burst_bytes),
            hbm_promote_bucket: Bucket::new(cfg.hbm_move_bytes_per_s, cfg.hbm_move_burst_bytes),
            cfg,
            objects: KeyMap::default(),
            last_aging_ms: 0,
            inflight: InFlight::default(),
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

    /// An object landed in `tier` (a put, or a re-report after restart). A put into HBM makes
    /// HBM the object's home; a put into another tier does not, and overwrites an earlier home.
    pub fn on_stored(&mut self, key: &str, tier: Tier, size_bytes: u64, now_ms: u64) {
        let held = Held {
            tier,
            size_bytes,
            persisted: false,
            replicas_elsewhere: 0,
            pinned: false,
            hbm_home: tier == Tier::Hbm,
            dram_copy: false,
        };
        self.store(key.to_owned(), held, now_ms);
    }

    /// What a node knows of a copy it holds, in one call and (when the tier is unchanged) one
    /// lookup: `on_stored` when `key` is new to the policy or changed tier, then
    /// `set_durability` and `set_pinned`; `hbm_home` and `dram_copy` are taken as reported
    /// (an object in HBM has its home there). The node calls this for every object it records.
    pub fn sync_held(&mut self, key: &str, held: Held, now_ms: u64) {
        if let Some(o) = self.objects.get_mut(key)
            && o.tier == held.tier
        {
            o.persisted = held.persisted;
            o.replicas_elsewhere = held.replicas_elsewhere;
            o.pinned = held.pinned;
            o.hbm_home = held.hbm_home || held.tier == Tier::Hbm;
            o.dram_copy = held.dram_copy && held.tier == Tier::Hbm;
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
                hbm_home: held.hbm_home || held.tier == Tier::Hbm,
                dram_copy: held.dram_copy && held.tier == Tier::Hbm,
                moving: None,
                not_before_ms: 0,
            },
        );
        // An overwrite during a move: the move's completion will be ignored.
        if let Some(f) = prev.and_then(|p| p.moving) {
            self.inflight.sub(f.effect());
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
        if let Some(f) = self.objects.remove(key).and_then(|o| o.moving) {
            self.inflight.sub(f.effect());
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

    /// The node finished (or failed) an action that `decide` returned. An action that is not
    /// the one its object has in flight (another move or size: the object was overwritten
    /// since) is ignored; actions carry no id, so a stale one equal to the one in flight is
    /// taken for it.
    pub fn on_action_done(&mut self, action: &Action, ok: bool) {
        let Some(o) = self.objects.get_mut(action.key()) else { return };
        let Some(f) = o.moving.filter(|f| f.is(action)) else { return };
        o.moving = None;
        self.inflight.sub(f.effect());
        if !ok {
            return;
        }
        match f.mv {
            Move::HbmToDram { .. } => (o.tier, o.dram_copy) = (Tier::Dram, false),
            Move::DramToNvme => o.tier = Tier::Nvme,
            Move::ReleaseDramCopy => o.dram_copy = false,
            Move::NvmeToDram => o.tier = Tier::Dram,
            // A DRAM copy a read lease kept comes back with the node's next `sync_held`.
            Move::DramToHbm => o.tier = Tier::Hbm,
            Move::Drop => {
                self.objects.remove(action.key());
            }
        }
    }

    /// Objects `pred` accepts that are free to act on, coldest first: (frequency estimate, last
    /// access, key) ascending.
    fn candidates(&self, now_ms: u64, pred: impl Fn(&ObjState) -> bool) -> Vec<Candidate> {
        let mut v: Vec<_> = self
            .objects
            .iter()
            .filter(|(_, o)| o.moving.is_none() && o.not_before_ms <= now_ms && pred(o))
            .map(|(k, o)| (self.sketch.estimate(k), o.last_access_ms, k.clone(), o.size_bytes))
            .collect();
        v.sort_unstable();
        v
    }

    /// Objects `pred` accepts that are hot (read often enough within the window), hottest first.
    fn hot(&self, now_ms: u64, pred: impl Fn(&ObjState) -> bool) -> Vec<Candidate> {
        let window_start = now_ms.saturating_sub(self.cfg.window_ms);
        let min = self.cfg.promote_min_accesses.max(1);
        let mut v = self.candidates(now_ms, |o| o.last_access_ms >= window_start && pred(o));
        v.retain(|c| c.0 >= min);
        v.reverse();
        v
    }

    fn start(&mut self, key: String, flight: Flight, out: &mut Vec<Action>) {
        if let Some(o) = self.objects.get_mut(&key) {
            o.moving = Some(flight);
        }
        self.inflight.add(flight.effect());
        let n = match flight.mv {
            Move::HbmToDram { .. } => &mut self.stats.hbm_demotions,
            Move::DramToNvme | Move::ReleaseDramCopy => &mut self.stats.demotions,
            Move::NvmeToDram => &mut self.stats.promotions,
            Move::DramToHbm => &mut self.stats.hbm_promotions,
            Move::Drop => &mut self.stats.drops,
        };
        *n += 1;
        out.push(flight.action(key));
    }

    fn hbm_proj(&self, u: &Usage) -> u64 {
        project(u.hbm.used_bytes, self.inflight.hbm_in, self.inflight.hbm_out)
    }

    fn dram_proj(&self, u: &Usage) -> u64 {
        project(u.dram.used_bytes, self.inflight.dram_in, self.inflight.dram_out)
    }

    fn nvme_proj(&self, u: &Usage) -> u64 {
        project(u.nvme.used_bytes, self.inflight.nvme_in, self.inflight.nvme_out)
    }

    /// Decide the next round of actions given current usage.
    pub fn decide(&mut self, now_ms: u64, usage: Usage) -> Vec<Action> {
        self.age_to(now_ms);
        for b in [
            &mut self.demote_bucket,
            &mut self.promote_bucket,
            &mut self.hbm_demote_bucket,
            &mut self.hbm_promote_bucket,
        ] {
            b.refill(now_ms);
        }
        let (hbm, dram, nvme) = (
            usage.hbm.capacity_bytes > 0,
            usage.dram.capacity_bytes > 0,
            usage.nvme.capacity_bytes > 0,
        );
        let mut out = Vec::new();
        // Drops first: they free NVMe room for demotions and move no bytes.
        if nvme {
            self.drop_from_nvme(now_ms, &usage, &mut out);
        }
        // Demotions before promotions, each from the lower tier up, so each frees the room the
        // next one needs.
        if dram {
            self.demote_from_dram(now_ms, &usage, &mut out);
        }
        if hbm && dram {
            self.demote_from_hbm(now_ms, &usage, &mut out);
        }
        if dram && nvme {
            self.promote(now_ms, &usage, Move::NvmeToDram, &mut out);
        }
        if hbm && dram {
            self.promote(now_ms, &usage, Move::DramToHbm, &mut out);
        }
        out
    }

    fn drop_from_nvme(&mut self, now_ms: u64, u: &Usage, out: &mut Vec<Action>) {
        let high = frac(u.nvme.capacity_bytes, self.cfg.nvme_high_watermark);
        if self.nvme_proj(u) <= high {
            return;
        }
        let target = frac(u.nvme.capacity_bytes, self.cfg.nvme_low_watermark);
        let picks = self.candidates(now_ms, |o| {
            o.tier == Tier::Nvme && !o.pinned && (o.persisted || o.replicas_elsewhere > 0)
        });
        for (_, _, key, size_bytes) in picks {
            if self.nvme_proj(u) <= target || out.len() >= self.cfg.actions_per_round_max {
                break;
            }
            self.start(key, Flight { mv: Move::Drop, size_bytes }, out);
        }
        if self.nvme_proj(u) > high {
            self.stats.nvme_pressure_unresolved += 1;
        }
    }

    /// Releases of DRAM copies of HBM objects first (no bytes move), then demotions of DRAM
    /// objects to NVMe, coldest first.
    fn demote_from_dram(&mut self, now_ms: u64, u: &Usage, out: &mut Vec<Action>) {
        if self.dram_proj(u) <= frac(u.dram.capacity_bytes, self.cfg.dram_high_watermark) {
            return;
        }
        let target = frac(u.dram.capacity_bytes, self.cfg.dram_low_watermark);
        let releases = self.candidates(now_ms, |o| o.tier == Tier::Hbm && o.dram_copy);
        for (_, _, key, size_bytes) in releases {
            if self.dram_proj(u) <= target || out.len() >= self.cfg.actions_per_round_max {
                return;
            }
            self.start(key, Flight { mv: Move::ReleaseDramCopy, size_bytes }, out);
        }
        if u.nvme.capacity_bytes == 0 {
            return;
        }
        let nvme_limit = frac(u.nvme.capacity_bytes, self.cfg.nvme_high_watermark);
        for (_, _, key, size_bytes) in self.candidates(now_ms, |o| o.tier == Tier::Dram) {
            if self.dram_proj(u) <= target || out.len() >= self.cfg.actions_per_round_max {
                break;
            }
            if self.nvme_proj(u) + size_bytes > nvme_limit {
                continue;
            }
            if !self.demote_bucket.take(size_bytes) {
                self.stats.rate_limited_rounds += 1;
                break;
            }
            self.start(key, Flight { mv: Move::DramToNvme, size_bytes }, out);
        }
    }

    /// HBM -> DRAM, coldest first, never past DRAM's high watermark.
    fn demote_from_hbm(&mut self, now_ms: u64, u: &Usage, out: &mut Vec<Action>) {
        if self.hbm_proj(u) <= frac(u.hbm.capacity_bytes, self.cfg.hbm_high_watermark) {
            return;
        }
        let target = frac(u.hbm.capacity_bytes, self.cfg.hbm_low_watermark);
        let dram_limit = frac(u.dram.capacity_bytes, self.cfg.dram_high_watermark);
        for (_, _, key, size_bytes) in self.candidates(now_ms, |o| o.tier == Tier::Hbm) {
            if self.hbm_proj(u) <= target || out.len() >= self.cfg.actions_per_round_max {
                break;
            }
            let onto_copy = self.objects.get(&key).is_some_and(|o| o.dram_copy);
            let flight = Flight { mv: Move::HbmToDram { onto_copy }, size_bytes };
            if self.dram_proj(u) + flight.effect().dram_in > dram_limit {
                continue;
            }
            if flight.moved_bytes() > 0 && !self.hbm_demote_bucket.take(flight.moved_bytes()) {
                self.stats.rate_limited_rounds += 1;
                break;
            }
            self.start(key, flight, out);
        }
    }

    /// Promotions hottest first, only into room under the upper tier's high watermark:
    /// `NvmeToDram`, or `DramToHbm` of objects whose home is HBM.
    fn promote(&mut self, now_ms: u64, u: &Usage, mv: Move, out: &mut Vec<Action>) {
        let hbm = mv == Move::DramToHbm;
        let (capacity, high) = if hbm {
            (u.hbm.capacity_bytes, self.cfg.hbm_high_watermark)
        } else {
            (u.dram.capacity_bytes, self.cfg.dram_high_watermark)
        };
        let limit = frac(capacity, high);
        let hot = if hbm {
            self.hot(now_ms, |o| o.tier == Tier::Dram && o.hbm_home)
        } else {
            self.hot(now_ms, |o| o.tier == Tier::Nvme)
        };
        for (_, _, key, size_bytes) in hot {
            if out.len() >= self.cfg.actions_per_round_max {
                break;
            }
            let projected = if hbm { self.hbm_proj(u) } else { self.dram_proj(u) };
            if projected + size_bytes > limit {
                continue;
            }
            let bucket = if hbm { &mut self.hbm_promote_bucket } else { &mut self.promote_bucket };
            if !bucket.take(size_bytes) {
                self.stats.rate_limited_rounds += 1;
                break;
            }
            self.start(key, Flight { mv, size_bytes }, out);
        }
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
            hbm_move_bytes_per_s: 100 * MB,
            hbm_move_burst_bytes: 100 * MB,
            window_ms: 10_000,
            promote_min_accesses: 3,
            sketch_width: 4096,
            ..Default::default()
        }
    }

    /// What a node would report for `tier` if its copies were where the policy believes (a
    /// DRAM copy of an HBM object counts in DRAM).
    fn usage(p: &TierPolicy, tier: Tier, capacity_bytes: u64) -> TierUsage {
        let used_bytes = p
            .objects
            .values()
            .filter(|o| o.tier == tier || (tier == Tier::Dram && o.dram_copy))
            .map(|o| o.size_bytes)
            .sum();
        TierUsage { used_bytes, capacity_bytes }
    }

    fn usage3(p: &TierPolicy, hbm_cap: u64, dram_cap: u64, nvme_cap: u64) -> Usage {
        Usage {
            hbm: usage(p, Tier::Hbm, hbm_cap),
            dram: usage(p, Tier::Dram, dram_cap),
            nvme: usage(p, Tier::Nvme, nvme_cap),
        }
    }

    /// A node without HBM.
    fn no_hbm(dram: TierUsage, nvme: TierUsage) -> Usage {
        Usage { hbm: TierUsage::default(), dram, nvme }
    }

    fn held(tier: Tier, size_bytes: u64) -> Held {
        Held {
            tier,
            size_bytes,
            persisted: false,
            replicas_elsewhere: 0,
            pinned: false,
            hbm_home: false,
            dram_copy: false,
        }
    }

    fn demote(key: &str, size_bytes: u64, from: Tier) -> Action {
        Action::Demote { key: key.into(), size_bytes, from }
    }

    fn promote(key: &str, size_bytes: u64, to: Tier) -> Action {
        Action::Promote { key: key.into(), size_bytes, to }
    }

    fn reads(p: &mut TierPolicy, key: &str, n: u64, from_ms: u64) {
        for t in 0..n {
            p.on_access(key, from_ms + t);
        }
    }

    /// Apply every action as if it succeeded.
    fn complete(p: &mut TierPolicy, actions: &[Action]) {
        for a in actions {
            p.on_action_done(a, true);
        }
    }

    #[test]
    fn sync_held_matches_stored_then_durability_then_pin() {
        let held = |tier, persisted, pinned| Held { persisted, pinned, ..held(tier, MB) };
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
        // HBM: its home is HBM either way.
        a.sync_held("h", held(Tier::Hbm, false, false), 12);
        b.on_stored("h", Tier::Hbm, MB, 12);
        for key in ["k", "j", "h"] {
            let (x, y) = (&a.objects[key], &b.objects[key]);
            assert_eq!(
                (x.tier, x.last_access_ms, x.persisted, x.pinned, x.size_bytes, x.hbm_home),
                (y.tier, y.last_access_ms, y.persisted, y.pinned, y.size_bytes, y.hbm_home),
                "{key}"
            );
        }
        assert_eq!(a.objects["k"].last_access_ms, 7);
        assert!(a.objects["h"].hbm_home);
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
            no_hbm(
                TierUsage { used_bytes: 0, capacity_bytes: 10_000 * MB },
                usage(&p, Tier::Nvme, 10_000 * MB),
            ),
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
        let a = p.decide(200, no_hbm(dram, usage(&p, Tier::Nvme, 100 * MB)));
        assert_eq!(a, vec![promote("hot", MB, Tier::Dram)]);
        assert!(
            p.decide(300, no_hbm(dram, usage(&p, Tier::Nvme, 100 * MB))).is_empty(),
            "in flight: not re-emitted"
        );
        complete(&mut p, &a);
        assert_eq!(p.tier_of("hot"), Some(Tier::Dram));
        // Two windows later the warm object's two reads have faded: a third read is not enough.
        p.on_access("warm", 25_000);
        assert!(p.access_estimate("warm") < 3);
        assert!(p.decide(25_001, no_hbm(dram, usage(&p, Tier::Nvme, 100 * MB))).is_empty());
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
            no_hbm(
                usage(&p, Tier::Dram, 100 * MB),
                TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB },
            ),
        );
        let keys: Vec<&str> = a.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k1", "k2"], "90 -> 80 MB with 10 MB objects; k0 is hot");
        assert!(a.iter().all(|a| matches!(a, Action::Demote { from: Tier::Dram, .. })));
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
        let a = p.decide(100, no_hbm(dram, usage(&p, Tier::Nvme, 100 * MB)));
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
        let a = p.decide(1, no_hbm(usage(&p, Tier::Dram, 100 * MB), big));
        assert_eq!(a.len(), 1);
        p.on_action_done(&a[0], false);
        assert_eq!(p.tier_of("a"), Some(Tier::Dram));
        let again = p.decide(2_000, no_hbm(usage(&p, Tier::Dram, 100 * MB), big));
        assert_eq!(again, a, "retried after a failure");
    }

    #[test]
    fn deferred_objects_wait_and_others_go_first() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Dram, 10 * MB, i);
        }
        let big = TierUsage { used_bytes: 0, capacity_bytes: 1000 * MB };
        let a = p.decide(100, no_hbm(usage(&p, Tier::Dram, 100 * MB), big));
        let keys: Vec<&str> = a.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k0", "k1"]);
        for x in &a {
            p.on_action_done(x, false);
            p.defer(x.key(), 5_000);
        }
        let b = p.decide(200, no_hbm(usage(&p, Tier::Dram, 100 * MB), big));
        let keys: Vec<&str> = b.iter().map(|a| a.key()).collect();
        assert_eq!(keys, ["k2", "k3"], "the deferred coldest objects are skipped");
        for x in &b {
            p.on_action_done(x, false);
        }
        let c = p.decide(6_000, no_hbm(usage(&p, Tier::Dram, 100 * MB), big));
        assert_eq!(c.first().map(|a| a.key()), Some("k0"), "deferral ends");
    }

    #[test]
    fn hbm_above_its_high_watermark_demotes_coldest_first_down_to_the_low_watermark() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Hbm, 10 * MB, i);
        }
        reads(&mut p, "k0", 5, 20);
        let a = p.decide(100, usage3(&p, 100 * MB, 1000 * MB, 1000 * MB));
        let want = [demote("k1", 10 * MB, Tier::Hbm), demote("k2", 10 * MB, Tier::Hbm)];
        assert_eq!(a, want, "100 -> 80 MB with 10 MB objects; k0 is hot");
        complete(&mut p, &a);
        assert_eq!(p.tier_of("k1"), Some(Tier::Dram));
        assert_eq!((p.stats().hbm_demotions, p.stats().demotions), (2, 0));
        let b = p.decide(200, usage3(&p, 100 * MB, 1000 * MB, 1000 * MB));
        assert!(b.is_empty(), "HBM at its low watermark: {b:?}");
    }

    #[test]
    fn no_hbm_demotion_pushes_dram_over_its_high_watermark() {
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Hbm, 10 * MB, i);
        }
        p.on_stored("d", Tier::Dram, 75 * MB, 50);
        // DRAM 75 of 100 MB: one 10 MB object fits under 90 MB, a second does not.
        let a = p.decide(100, usage3(&p, 100 * MB, 100 * MB, 1000 * MB));
        assert_eq!(a, [demote("k0", 10 * MB, Tier::Hbm)]);
        // A DRAM copy already there takes no room: that object still goes.
        p.sync_held("c", Held { dram_copy: true, ..held(Tier::Hbm, 5 * MB) }, 0);
        let b = p.decide(200, usage3(&p, 100 * MB, 100 * MB, 1000 * MB));
        assert_eq!(b, [demote("c", 5 * MB, Tier::Hbm)]);
        complete(&mut p, &b);
        assert_eq!((p.tier_of("c"), p.objects["c"].dram_copy), (Some(Tier::Dram), false));
    }

    #[test]
    fn hbm_moves_spend_their_own_buckets_not_the_disks() {
        let setup = |cfg| {
            let mut p = TierPolicy::new(cfg);
            for i in 0..10 {
                p.on_stored(&format!("h{i}"), Tier::Hbm, 10 * MB, i);
                p.on_stored(&format!("d{i}"), Tier::Dram, 10 * MB, i);
            }
            p
        };
        let no_disk = PolicyConfig {
            demote_bytes_per_s: 0,
            demote_burst_bytes: 0,
            promote_bytes_per_s: 0,
            promote_burst_bytes: 0,
            ..cfg()
        };
        // DRAM has room: HBM demotes although the disk's buckets are empty.
        let mut p = setup(no_disk);
        let a = p.decide(100, usage3(&p, 100 * MB, 1000 * MB, 1000 * MB));
        assert_eq!(a, [demote("h0", 10 * MB, Tier::Hbm), demote("h1", 10 * MB, Tier::Hbm)]);
        // DRAM is full too: the disk demotes although HBM's buckets are empty, and HBM waits.
        let no_pcie = PolicyConfig { hbm_move_bytes_per_s: 0, hbm_move_burst_bytes: 0, ..cfg() };
        let mut p = setup(no_pcie);
        let a = p.decide(100, usage3(&p, 100 * MB, 100 * MB, 1000 * MB));
        assert!(!a.is_empty());
        assert!(a.iter().all(|a| matches!(a, Action::Demote { from: Tier::Dram, .. })), "{a:?}");
    }

    #[test]
    fn only_objects_whose_home_is_hbm_are_promoted_into_hbm() {
        let mut p = TierPolicy::new(cfg());
        p.on_stored("plain", Tier::Dram, MB, 0);
        p.sync_held("home", Held { hbm_home: true, ..held(Tier::Dram, MB) }, 0);
        reads(&mut p, "plain", 50, 10);
        reads(&mut p, "home", 40, 10);
        let a = p.decide(100, usage3(&p, 100 * MB, 100 * MB, 100 * MB));
        assert_eq!(a, [promote("home", MB, Tier::Hbm)], "the hotter object stays in DRAM");
        complete(&mut p, &a);
        assert_eq!(p.tier_of("home"), Some(Tier::Hbm));
        assert_eq!(p.stats().hbm_promotions, 1);
        for r in 1..20 {
            reads(&mut p, "plain", 10, 100 * r);
            let a = p.decide(100 * r + 50, usage3(&p, 100 * MB, 100 * MB, 100 * MB));
            assert!(a.is_empty(), "{a:?}");
        }
    }

    /// A put that did not ask for HBM replaces the object, home included, whatever an earlier
    /// version asked for.
    #[test]
    fn an_overwrite_that_did_not_ask_for_hbm_never_lands_there() {
        let mut p = TierPolicy::new(cfg());
        p.on_stored("a", Tier::Hbm, MB, 0);
        p.on_stored("a", Tier::Dram, MB, 1);
        p.sync_held("b", Held { hbm_home: true, ..held(Tier::Dram, MB) }, 0);
        p.sync_held("b", held(Tier::Dram, MB), 1);
        reads(&mut p, "a", 10, 10);
        reads(&mut p, "b", 10, 10);
        let a = p.decide(100, usage3(&p, 100 * MB, 100 * MB, 100 * MB));
        assert!(a.is_empty(), "{a:?}");
    }

    #[test]
    fn hot_home_objects_promote_into_hbm_only_into_room_and_one_offs_never() {
        let mut p = TierPolicy::new(cfg());
        p.on_stored("resident", Tier::Hbm, 80 * MB, 0);
        for k in ["a", "b", "c"] {
            p.sync_held(k, Held { hbm_home: true, ..held(Tier::Dram, 10 * MB) }, 0);
        }
        reads(&mut p, "a", 5, 10);
        reads(&mut p, "b", 4, 10);
        reads(&mut p, "c", 1, 10);
        // HBM 80 of 100 MB: a (the hottest) fills it to its 90 MB watermark; b waits.
        let a = p.decide(100, usage3(&p, 100 * MB, 1000 * MB, 1000 * MB));
        assert_eq!(a, [promote("a", 10 * MB, Tier::Hbm)]);
        complete(&mut p, &a);
        p.on_removed("resident");
        let b = p.decide(200, usage3(&p, 100 * MB, 1000 * MB, 1000 * MB));
        assert_eq!(b, [promote("b", 10 * MB, Tier::Hbm)], "c was read once");
    }

    #[test]
    fn a_dram_copy_of_an_hbm_object_is_released_first_under_dram_pressure() {
        let mut p = TierPolicy::new(cfg());
        p.sync_held("g", Held { dram_copy: true, ..held(Tier::Hbm, 20 * MB) }, 0);
        reads(&mut p, "g", 10, 1);
        for i in 0..8 {
            p.on_stored(&format!("d{i}"), Tier::Dram, 10 * MB, 20 + i);
        }
        let u = usage3(&p, 1000 * MB, 100 * MB, 1000 * MB);
        assert_eq!(u.dram.used_bytes, 100 * MB);
        let a = p.decide(100, u);
        assert_eq!(a, [demote("g", 20 * MB, Tier::Dram)], "releasing the copy moves no bytes");
        complete(&mut p, &a);
        assert_eq!((p.tier_of("g"), p.objects["g"].dram_copy), (Some(Tier::Hbm), false));
        assert_eq!(p.stats().demotions, 1);
        assert!(p.decide(200, usage3(&p, 1000 * MB, 100 * MB, 1000 * MB)).is_empty());
    }

    #[test]
    fn a_node_without_hbm_gets_no_hbm_action() {
        let mut p = TierPolicy::new(cfg());
        // An empty object fits in any room, even none.
        p.sync_held("empty", Held { hbm_home: true, ..held(Tier::Dram, 0) }, 0);
        p.sync_held("d", Held { hbm_home: true, ..held(Tier::Dram, MB) }, 0);
        reads(&mut p, "empty", 10, 1);
        reads(&mut p, "d", 10, 1);
        let a = p.decide(100, usage3(&p, 0, 100 * MB, 100 * MB));
        assert!(a.is_empty(), "{a:?}");
        // Bytes reported in an HBM of capacity 0 are not over any watermark to demote from.
        p.on_stored("h", Tier::Hbm, 10 * MB, 150);
        let b = p.decide(200, usage3(&p, 0, 100 * MB, 100 * MB));
        assert!(b.is_empty(), "{b:?}");
    }

    #[test]
    fn a_removal_or_overwrite_mid_move_releases_exactly_that_moves_bytes() {
        // A removed HBM promotion frees the room it held.
        let mut p = TierPolicy::new(cfg());
        p.on_stored("resident", Tier::Hbm, 80 * MB, 0);
        for k in ["a", "b"] {
            p.sync_held(k, Held { hbm_home: true, ..held(Tier::Dram, 10 * MB) }, 0);
        }
        reads(&mut p, "a", 5, 10);
        reads(&mut p, "b", 4, 10);
        let u = usage3(&p, 100 * MB, 1000 * MB, 1000 * MB);
        assert_eq!(p.decide(100, u), [promote("a", 10 * MB, Tier::Hbm)]);
        assert!(p.decide(200, u).is_empty(), "a's promotion holds the room");
        p.on_removed("a");
        assert_eq!(p.decide(300, u), [promote("b", 10 * MB, Tier::Hbm)]);

        // Overwritten HBM demotions no longer count: the next round demotes again.
        let mut p = TierPolicy::new(cfg());
        for i in 0..10 {
            p.on_stored(&format!("k{i}"), Tier::Hbm, 10 * MB, i);
        }
        let u = usage3(&p, 100 * MB, 1000 * MB, 1000 * MB);
        let a = p.decide(100, u);
        assert_eq!(a.len(), 2);
        assert!(p.decide(200, u).is_empty());
        for x in &a {
            p.on_stored(x.key(), Tier::Hbm, 10 * MB, 300);
        }
        let keys: Vec<String> = p.decide(400, u).iter().map(|a| a.key().to_owned()).collect();
        assert_eq!(keys, ["k2", "k3"]);
        complete(&mut p, &a);
        assert_eq!(p.tier_of("k0"), Some(Tier::Hbm), "a stale completion is ignored");

        // An overwritten NVMe drop releases the drop, not the promotion beside it.
        let mut p = TierPolicy::new(cfg());
        p.on_stored("d", Tier::Dram, 75 * MB, 0);
        p.on_stored("x", Tier::Nvme, 10 * MB, 0);
        p.on_stored("z", Tier::Nvme, 10 * MB, 0);
        p.on_stored("y", Tier::Nvme, 80 * MB, 0);
        p.set_durability("y", true, 0);
        reads(&mut p, "x", 5, 10);
        reads(&mut p, "z", 4, 10);
        let u = usage3(&p, 0, 100 * MB, 100 * MB);
        let a = p.decide(100, u);
        assert_eq!(
            a,
            [Action::Drop { key: "y".into(), size_bytes: 80 * MB }, {
                promote("x", 10 * MB, Tier::Dram)
            }]
        );
        p.on_stored("y", Tier::Nvme, 80 * MB, 150);
        let b = p.decide(200, u);
        assert!(b.is_empty(), "z still does not fit beside x's promotion: {b:?}");
    }

    /// Bytes each bucket was charged: a release, a demotion onto a DRAM copy and a drop move
    /// none. Read before the actions complete.
    fn charged(p: &TierPolicy, actions: &[Action]) -> [u64; 4] {
        let mut by_dir = [0u64; 4];
        for a in actions {
            let f = p.objects[a.key()].moving.expect("an emitted action is in flight");
            let dir = match a {
                Action::Demote { from: Tier::Dram, .. } => 0,
                Action::Promote { to: Tier::Dram, .. } => 1,
                Action::Demote { from: Tier::Hbm, .. } => 2,
                Action::Promote { to: Tier::Hbm, .. } => 3,
                _ => continue,
            };
            by_dir[dir] += f.moved_bytes();
        }
        by_dir
    }

    /// Every direction's bound: rate * elapsed + burst + one object (20 MB at most here), for
    /// a configuration whose bursts are a second of its rates.
    fn bound_bytes(rate_bytes_per_s: u64, now_ms: u64) -> u64 {
        rate_bytes_per_s * now_ms / 1000 + rate_bytes_per_s + 20 * MB
    }

    /// Every bucket at `rate_bytes_per_s`, bursts of a second.
    fn cfg_at(rate_bytes_per_s: u64) -> PolicyConfig {
        let r = rate_bytes_per_s;
        PolicyConfig {
            demote_bytes_per_s: r,
            demote_burst_bytes: r,
            promote_bytes_per_s: r,
            promote_burst_bytes: r,
            hbm_move_bytes_per_s: r,
            hbm_move_burst_bytes: r,
            ..cfg()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put { key: u8, tier: u8, size: u64 },
        Sync { key: u8, tier: u8, size: u64, home: bool, copy: bool, durable: bool },
        Read { key: u8 },
        Remove { key: u8 },
        Defer { key: u8, ms: u64 },
        Decide { dt: u64, caps: u8 },
        Done { pick: usize, ok: bool },
    }

    fn op() -> impl Strategy<Value = Op> {
        let key = 0u8..40;
        prop_oneof![
            1 => (key.clone(), 0u8..3, 1u64..20)
                .prop_map(|(key, tier, size)| Op::Put { key, tier, size }),
            1 => (key.clone(), 0u8..3, 1u64..20, any::<[bool; 3]>()).prop_map(
                |(key, tier, size, [home, copy, durable])| Op::Sync {
                    key,
                    tier,
                    size,
                    home,
                    copy,
                    durable,
                }
            ),
            3 => key.clone().prop_map(|key| Op::Read { key }),
            1 => key.clone().prop_map(|key| Op::Remove { key }),
            1 => (key, 1u64..3000).prop_map(|(key, ms)| Op::Defer { key, ms }),
            2 => (1u64..400, 0u8..8).prop_map(|(dt, caps)| Op::Decide { dt, caps }),
            2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, ok)| Op::Done { pick, ok }),
        ]
    }

    /// The projections' bookkeeping equals the sum of what each object's state remembers.
    fn inflight_of_objects(p: &TierPolicy) -> InFlight {
        let mut sum = InFlight::default();
        for f in p.objects.values().filter_map(|o| o.moving) {
            sum.add(f.effect());
        }
        sum
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
                let a = p.decide(now, no_hbm(usage(&p, Tier::Dram, dram_cap), nvme));
                moved += charged(&p, &a)[0];
                complete(&mut p, &a);
                let bound = bound_bytes(100 * MB, now);
                prop_assert!(moved <= bound, "moved {moved} > bound {bound} at {now} ms");
            }
        }

        /// HBM full of objects that are read often: they go down cold and come back hot, and
        /// neither direction moves more than its bucket allows.
        #[test]
        fn hbm_moves_respect_their_rate_limits(
            sizes in prop::collection::vec(1u64..20, 50..300),
            steps in prop::collection::vec((1u64..500, 0usize..300), 1..60),
        ) {
            let mut p = TierPolicy::new(cfg());
            for (i, s) in sizes.iter().enumerate() {
                p.on_stored(&format!("k{i}"), Tier::Hbm, s * MB, 0);
            }
            let hbm_cap = sizes.iter().sum::<u64>() * MB / 2;
            let (mut now, mut moved) = (0u64, [0u64; 4]);
            for (dt, hot) in steps {
                now += dt;
                for i in 0..sizes.len().min(hot) {
                    reads(&mut p, &format!("k{i}"), 3, now);
                }
                let a = p.decide(now + 3, usage3(&p, hbm_cap, u64::MAX / 4, u64::MAX / 4));
                for (m, c) in moved.iter_mut().zip(charged(&p, &a)) {
                    *m += c;
                }
                complete(&mut p, &a);
                let bound = bound_bytes(100 * MB, now + 3);
                prop_assert!(moved[2] <= bound, "HBM demoted {} > {bound}", moved[2]);
                prop_assert!(moved[3] <= bound, "HBM promoted {} > {bound}", moved[3]);
            }
        }

        /// Hot objects whose home is HBM, all in DRAM, and an empty HBM: promotions wait for
        /// their bucket.
        #[test]
        fn hbm_promotion_respects_its_rate_limit(
            sizes in prop::collection::vec(1u64..20, 50..300),
            steps in prop::collection::vec(1u64..500, 1..60),
        ) {
            let mut p = TierPolicy::new(cfg());
            for (i, s) in sizes.iter().enumerate() {
                let k = format!("k{i}");
                p.sync_held(&k, Held { hbm_home: true, ..held(Tier::Dram, s * MB) }, 0);
                reads(&mut p, &k, 3, 0);
            }
            let (mut now, mut moved) = (0u64, 0u64);
            for dt in steps {
                now += dt;
                let a = p.decide(now, usage3(&p, u64::MAX / 4, u64::MAX / 4, u64::MAX / 4));
                moved += charged(&p, &a)[3];
                complete(&mut p, &a);
                let bound = bound_bytes(100 * MB, now);
                prop_assert!(moved <= bound, "moved {moved} > bound {bound} at {now} ms");
            }
        }

        /// Random three-tier traces of puts, reports, reads, removals, deferrals, rounds and
        /// completions (in any order, some failing, some stale): one action per object, none for
        /// an unknown object or a tier the node lacks, HBM only for objects whose home it is,
        /// every direction within its rate, and in-flight bytes that add up exactly.
        #[test]
        fn random_three_tier_traces_keep_the_invariants(
            ops in prop::collection::vec(op(), 1..400),
        ) {
            let tiers = [Tier::Hbm, Tier::Dram, Tier::Nvme];
            // Slow buckets (objects up to twice the burst) so the rate limits bite.
            let slow = PolicyConfig { promote_min_accesses: 2, ..cfg_at(10 * MB) };
            let mut p = TierPolicy::new(slow);
            let mut home: HashMap<String, bool> = HashMap::new();
            let mut live: HashMap<String, Action> = HashMap::new();
            let mut stale: Vec<Action> = Vec::new();
            let (mut now, mut moved) = (0u64, [0u64; 4]);
            for op in ops {
                match op {
                    Op::Put { key, tier, size } => {
                        let k = format!("k{key}");
                        p.on_stored(&k, tiers[tier as usize], size * MB, now);
                        home.insert(k.clone(), tier == 0);
                        stale.extend(live.remove(&k));
                    }
                    Op::Sync { key, tier, size, home: h, copy, durable } => {
                        let k = format!("k{key}");
                        let held = Held {
                            persisted: durable,
                            hbm_home: h,
                            dram_copy: copy,
                            ..held(tiers[tier as usize], size * MB)
                        };
                        if p.tier_of(&k) != Some(held.tier) {
                            stale.extend(live.remove(&k));
                        }
                        p.sync_held(&k, held, now);
                        home.insert(k, h || tier == 0);
                    }
                    Op::Read { key } => p.on_access(&format!("k{key}"), now),
                    Op::Remove { key } => {
                        let k = format!("k{key}");
                        p.on_removed(&k);
                        home.remove(&k);
                        stale.extend(live.remove(&k));
                    }
                    Op::Defer { key, ms } => p.defer(&format!("k{key}"), now + ms),
                    Op::Decide { dt, caps } => {
                        now += dt;
                        let hbm_cap = [0, 30 * MB, 200 * MB][caps as usize % 3];
                        let nvme_cap = if caps & 4 == 0 { 0 } else { 150 * MB };
                        let u = usage3(&p, hbm_cap, 100 * MB, nvme_cap);
                        let a = p.decide(now, u);
                        for (m, c) in moved.iter_mut().zip(charged(&p, &a)) {
                            *m += c;
                        }
                        for x in a {
                            let k = x.key().to_owned();
                            prop_assert!(home.contains_key(&k), "unknown {x:?}");
                            prop_assert!(!live.contains_key(&k), "second action {x:?}");
                            let hbm = matches!(
                                x,
                                Action::Demote { from: Tier::Hbm, .. }
                                    | Action::Promote { to: Tier::Hbm, .. }
                            );
                            let nvme = matches!(
                                x,
                                Action::Drop { .. } | Action::Promote { to: Tier::Dram, .. }
                            ) || (matches!(x, Action::Demote { from: Tier::Dram, .. })
                                && p.tier_of(&k) == Some(Tier::Dram));
                            prop_assert!(!hbm || hbm_cap > 0, "no HBM, yet {x:?}");
                            prop_assert!(!nvme || nvme_cap > 0, "no NVMe, yet {x:?}");
                            if matches!(x, Action::Promote { to: Tier::Hbm, .. }) {
                                prop_assert!(home[&k], "not at home in HBM: {x:?}");
                            }
                            live.insert(k, x);
                        }
                        for (dir, m) in moved.iter().enumerate() {
                            let bound = bound_bytes(10 * MB, now);
                            prop_assert!(*m <= bound, "direction {dir} moved {m} > {bound}");
                        }
                    }
                    Op::Done { pick, ok } => {
                        let n = live.len() + stale.len();
                        if n > 0 {
                            let i = pick % n;
                            let (a, was_live) = if i < stale.len() {
                                // Actions carry no id: a stale one equal to the live one of
                                // its key is taken for it, and the live one goes stale.
                                let a = stale.swap_remove(i);
                                let taken = live.get(a.key()) == Some(&a);
                                if taken {
                                    stale.push(a.clone());
                                    live.remove(a.key());
                                }
                                (a, taken)
                            } else {
                                let k = live.keys().nth(i - stale.len()).cloned();
                                (live.remove(&k.unwrap_or_default()).unwrap(), true)
                            };
                            p.on_action_done(&a, ok);
                            if ok && was_live && matches!(a, Action::Drop { .. }) {
                                home.remove(a.key());
                            }
                        }
                    }
                }
                prop_assert_eq!(p.inflight, inflight_of_objects(&p));
            }
            for a in live.into_values().chain(stale) {
                p.on_action_done(&a, false);
            }
            prop_assert_eq!(p.inflight, InFlight::default(), "bytes left in flight");
        }
    }
}
