//! Seeded simulation of a whole cluster against the directory: 200 nodes, 10 000 random
//! operations per seed (puts, upserts, abandoned puts, gets, exists, removes, evictions, node
//! deaths, node restarts that lose some of what they held, master restarts rebuilt from node
//! reports), with `Directory::verify` and the engine-visible rules checked after every step.
//!
//! Nodes are modelled by what they would store: each applies the `Commit` and `Drop` effects
//! addressed to it, and re-registers with exactly that.
//!
//! `SIM_SEEDS=N` runs N seeds (default 4); `SIM_SEED=S` runs only seed S (to replay a failure).

use std::collections::{BTreeMap, BTreeSet};

use kvfs_master::*;

const NODES: u64 = 200;
const OPS: usize = 10_000;
const KEYS: u64 = 10_000;
const KIB: u64 = 1024;

/// SplitMix64: the test's own randomness, independent of the directory's.
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

struct SimNode {
    alive: bool,
    /// What the node stores, by (segment, offset).
    held: BTreeMap<(u32, u64), HeldObject>,
}

struct Sim {
    rand: Rand,
    dir: Directory,
    cfg: Config,
    now: u64,
    nodes: BTreeMap<NodeId, SimNode>,
    /// Puts started and not ended: key -> (version, pin).
    pending: BTreeMap<String, (u64, Pin)>,
    /// Puts the simulation gave up on without telling the directory.
    abandoned: BTreeSet<String>,
    /// Every put granted and not completed, by (key, version): the directory drops the ranges
    /// of those it abandons (a writer may have committed there with a noted write).
    unfinished: BTreeSet<(String, u64)>,
    /// Keys the simulation pinned hard (pins are immutable per version; upserts keep the pin).
    hard: BTreeSet<String>,
    /// Latest lease end the simulation saw per key.
    leases: BTreeMap<String, u64>,
    ops: BTreeMap<&'static str, u64>,
}

fn key(i: u64) -> String {
    let prefix = if i.is_multiple_of(3) { "llama-70b/tp0/" } else { "qwen-8b/tp1/" };
    format!("{prefix}{:064x}", i.wrapping_mul(0x2545_F491_4F6C_DD1D))
}

fn registration(node: NodeId, held: Vec<HeldObject>) -> NodeRegistration {
    let host = format!("host{}", node.0 / 4);
    let mut segments = vec![SegmentSpec {
        index: 0,
        tier: Tier::Dram,
        base_addr: node.0 << 40,
        capacity: 2 * 1024 * KIB,
    }];
    if node.0.is_multiple_of(4) {
        segments.push(SegmentSpec {
            index: 1,
            tier: Tier::Nvme,
            base_addr: (node.0 << 40) + (1 << 39),
            capacity: 64 * 1024 * KIB,
        });
    }
    NodeRegistration { node, host, endpoint: format!("ep{}", node.0), segments, held }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let cfg = Config {
            seed,
            put_timeout_ms: 2_000,
            lease_ttl_ms: 500,
            node_ttl_ms: 1_000,
            evict_round_objects_max: 64,
            ..Config::default()
        };
        let mut sim = Sim {
            rand: Rand(seed ^ 0xA5A5),
            dir: Directory::new(cfg.clone()).unwrap(),
            cfg,
            now: 1_000,
            nodes: BTreeMap::new(),
            pending: BTreeMap::new(),
            abandoned: BTreeSet::new(),
            unfinished: BTreeSet::new(),
            hard: BTreeSet::new(),
            leases: BTreeMap::new(),
            ops: BTreeMap::new(),
        };
        for n in 1..=NODES {
            sim.nodes.insert(NodeId(n), SimNode { alive: true, held: BTreeMap::new() });
            sim.register(NodeId(n));
        }
        sim
    }

    fn register(&mut self, node: NodeId) {
        let held: Vec<HeldObject> = self.nodes[&node].held.values().cloned().collect();
        let mut fx = Vec::new();
        let out = self.dir.register_node(&registration(node, held), self.now, &mut fx).unwrap();
        assert!(out.adopted as usize <= self.nodes[&node].held.len());
        self.forget(&out.lost_keys);
        self.apply(fx);
    }

    /// Deliver effects to the modelled nodes.
    fn apply(&mut self, fx: Vec<NodeEffect>) {
        for e in fx {
            let node = self.nodes.get_mut(&e.node()).expect("effect for a known node");
            if !node.alive {
                continue; // undeliverable; the node comes back empty
            }
            match e {
                NodeEffect::Commit {
                    key,
                    segment,
                    offset,
                    size,
                    checksum,
                    version,
                    persistence,
                    pin,
                    ..
                } => {
                    let tier = if segment == 0 { Tier::Dram } else { Tier::Nvme };
                    let h = HeldObject {
                        key: key.to_string(),
                        size,
                        checksum,
                        version,
                        segment,
                        offset,
                        tier,
                        persistence,
                        pin,
                        persisted: false,
                        renamed_from: None,
                    };
                    node.held.insert((segment, offset), h);
                }
                NodeEffect::Drop { key, segment, offset, version, .. } => {
                    match node.held.remove(&(segment, offset)) {
                        Some(h) => assert_eq!(h.key, *key, "drop of what the node holds"),
                        None => assert!(
                            self.unfinished.contains(&(key.to_string(), version)),
                            "a drop of an empty range is of a put that never completed"
                        ),
                    }
                }
                NodeEffect::Rename { from, to, from_version, version, .. } => {
                    for h in node.held.values_mut() {
                        if *h.key == *from && h.version == from_version {
                            h.key = to.to_string();
                            h.version = version;
                            h.renamed_from = Some((from.to_string(), from_version));
                        }
                    }
                }
            }
        }
    }

    /// Objects that are gone: a later object under the key starts without lease.
    fn forget(&mut self, keys: &[std::sync::Arc<str>]) {
        for k in keys {
            self.leases.remove(&**k);
        }
    }

    /// Effects of eviction must never touch a leased or hard-pinned object.
    fn check_evictions(&mut self, fx: &[NodeEffect]) {
        for e in fx {
            if let NodeEffect::Drop { key, .. } = e {
                *self.ops.entry("evicted-replicas").or_default() += 1;
                assert!(!self.hard.contains(&**key), "hard-pinned {key} evicted");
                let lease = self.leases.get(&**key).copied().unwrap_or(0);
                assert!(
                    lease <= self.now,
                    "{key} evicted while leased until {lease} (now {})",
                    self.now
                );
            }
        }
    }

    fn step(&mut self) {
        self.now += self.rand.below(40);
        let op = self.rand.below(1000);
        let name = match op {
            0..=379 => self.op_put(),
            380..=559 => self.op_get(),
            560..=619 => self.op_exists(),
            620..=639 => self.op_remove(),
            640..=649 => self.op_rename(),
            650..=869 => self.op_end_or_revoke(),
            870..=919 => self.op_time(),
            920..=924 => self.op_node_death(),
            925..=929 => self.op_node_restart(),
            930..=949 => self.op_persist(),
            950..=969 => self.op_list(),
            970..=998 => self.op_heartbeats(),
            _ => self.op_master_restart(),
        };
        *self.ops.entry(name).or_default() += 1;
        if let Err(e) = self.dir.verify() {
            panic!("invariant broken after {name} at {}: {e}", self.now);
        }
    }

    fn op_put(&mut self) -> &'static str {
        let k = key(self.rand.below(KEYS));
        let mut req = PutStart::new(&k, 64 * KIB * (1 + self.rand.below(16)));
        req.replicas = 1 + self.rand.below(3) as u8;
        req.upsert = self.rand.chance(10);
        req.strategy = [Strategy::Random, Strategy::FreeRatioFirst, Strategy::LocalFirst]
            [self.rand.below(3) as usize];
        req.client_host = Some(format!("host{}", self.rand.below(NODES / 4)));
        req.tier = if self.rand.chance(10) { Tier::Nvme } else { Tier::Dram };
        req.pin = match self.rand.below(20) {
            0 => Pin::Hard,
            1..=3 => Pin::Soft,
            _ => Pin::None,
        };
        if self.hard.contains(&k) {
            req.pin = Pin::Hard; // keep the sim's pin bookkeeping simple
        }
        let before = self.dir.stat(&k).ok();
        let mut fx = Vec::new();
        match self.dir.put_start(&req, self.now, &mut fx) {
            Ok(grant) => {
                let mut nodes: Vec<NodeId> =
                    grant.replicas.iter().filter_map(Replica::node).collect();
                nodes.sort();
                nodes.dedup();
                assert_eq!(nodes.len(), grant.replicas.len(), "replicas on distinct nodes");
                assert!(
                    !grant.replicas.is_empty() && grant.replicas.len() <= usize::from(req.replicas)
                );
                assert!(grant.replicas.iter().all(|r| r.tier() == req.tier));
                // the pending put is invisible: readers still see the old state
                assert_eq!(self.dir.stat(&k).ok().map(|v| v.version), before.map(|v| v.version));
                self.pending.insert(k.clone(), (grant.version, req.pin));
                self.unfinished.insert((k.clone(), grant.version));
            }
            Err(e) => match e.kind() {
                ErrorKind::AlreadyExists => assert!(!req.upsert && before.is_some()),
                ErrorKind::PutInProgress => {
                    assert!(self.pending.contains_key(&k) || self.abandoned.contains(&k))
                }
                ErrorKind::Leased => assert!(req.upsert && before.is_some()),
                ErrorKind::NoSpace => *self.ops.entry("put-nospace").or_default() += 1,
                other => panic!("put_start: unexpected {other:?}: {e}"),
            },
        }
        self.check_evictions(&fx);
        self.apply(fx);
        "put"
    }

    fn op_end_or_revoke(&mut self) -> &'static str {
        let Some(k) = self.pick_pending() else { return "end-none" };
        let (version, pin) = self.pending.remove(&k).unwrap();
        let mut fx = Vec::new();
        if self.rand.chance(15) {
            let _ = self.dir.put_revoke(&k, &mut fx);
            self.apply(fx);
            return "revoke";
        }
        if self.rand.chance(10) {
            self.abandoned.insert(k);
            return "abandon"; // never ended: tick must reclaim it
        }
        let end =
            PutEnd { key: k.clone(), checksum: Some([version as u8; 32]), version: Some(version) };
        match self.dir.put_end(&end, self.now, &mut fx) {
            Ok(()) => {
                self.unfinished.remove(&(k.clone(), version));
                let view = self.dir.stat(&k).unwrap();
                assert_eq!(view.version, version);
                self.leases.remove(&k); // a new object: no lease yet
                if pin == Pin::Hard {
                    self.hard.insert(k.clone());
                }
                let commits = fx.iter().filter(|e| matches!(e, NodeEffect::Commit { .. })).count();
                assert_eq!(commits, view.replicas.iter().filter(|r| r.node().is_some()).count());
            }
            Err(e) => {
                assert!(matches!(e.kind(), ErrorKind::NotFound | ErrorKind::AlreadyExists), "{e}")
            }
        }
        self.apply(fx);
        "end"
    }

    fn pick_pending(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let i = self.rand.below(self.pending.len() as u64) as usize;
        self.pending.keys().nth(i).cloned()
    }

    fn op_get(&mut self) -> &'static str {
        let keys: Vec<String> =
            (0..1 + self.rand.below(8)).map(|_| key(self.rand.below(KEYS))).collect();
        for (k, r) in keys.iter().zip(self.dir.get_batch(&keys, self.now)) {
            match r {
                Ok(view) => {
                    assert!(!view.replicas.is_empty());
                    assert!(view.lease_end_ms >= self.now + self.cfg.lease_ttl_ms);
                    self.leases.insert(k.clone(), view.lease_end_ms);
                }
                Err(e) => assert_eq!(e.kind(), ErrorKind::NotFound),
            }
        }
        "get"
    }

    fn op_exists(&mut self) -> &'static str {
        let keys: Vec<String> =
            (0..1 + self.rand.below(16)).map(|_| key(self.rand.below(KEYS))).collect();
        for (k, r) in keys.iter().zip(self.dir.exists_batch(&keys, self.now)) {
            if r.unwrap() {
                self.leases.insert(k.clone(), self.now + self.cfg.lease_ttl_ms);
            }
        }
        "exists"
    }

    fn op_remove(&mut self) -> &'static str {
        let k = key(self.rand.below(KEYS));
        let force = self.rand.chance(20);
        let mut fx = Vec::new();
        match self.dir.remove(&k, force, self.now, &mut fx) {
            Ok(()) => {
                assert!(force || self.leases.get(&k).copied().unwrap_or(0) <= self.now);
                assert!(force || !self.hard.contains(&k));
                self.hard.remove(&k);
            }
            Err(e) => assert!(matches!(
                e.kind(),
                ErrorKind::NotFound | ErrorKind::Leased | ErrorKind::Pinned
            )),
        }
        self.apply(fx);
        "remove"
    }

    fn op_rename(&mut self) -> &'static str {
        let from = key(self.rand.below(KEYS));
        let to = key(self.rand.below(KEYS));
        let mode = if self.rand.chance(20) { RenameMode::NoReplace } else { RenameMode::Replace };
        let mut fx = Vec::new();
        match self.dir.rename(&from, &to, mode, self.now, &mut fx) {
            Ok(_) if from == to => {}
            Ok(r) => {
                assert!(r.version > r.from_version);
                // The object keeps its lease and pin under the new name.
                let lease = self.leases.remove(&from);
                self.leases.remove(&to);
                if let Some(l) = lease {
                    self.leases.insert(to.clone(), l);
                }
                let hard = self.hard.remove(&from);
                self.hard.remove(&to);
                if hard {
                    self.hard.insert(to.clone());
                }
                assert!(self.dir.stat(&from).is_err());
                assert!(self.dir.stat(&to).is_ok());
            }
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    ErrorKind::NotFound | ErrorKind::AlreadyExists | ErrorKind::PutInProgress
                ),
                "rename: {e}"
            ),
        }
        self.apply(fx);
        "rename"
    }

    fn op_time(&mut self) -> &'static str {
        self.now += self.rand.below(600);
        let mut fx = Vec::new();
        self.dir.tick(self.now, &mut fx);
        self.apply(fx);
        let mut fx = Vec::new();
        let ev = self.dir.evict(self.now, &mut fx);
        self.check_evictions(&fx);
        self.apply(fx);
        self.forget(&ev.removed_keys);
        "time"
    }

    fn op_heartbeats(&mut self) -> &'static str {
        let alive: Vec<NodeId> =
            self.nodes.iter().filter(|(_, n)| n.alive).map(|(&id, _)| id).collect();
        for id in alive {
            if self.dir.heartbeat(id, self.now).is_err() {
                self.register(id); // expired or master restarted: re-register with what it holds
            }
        }
        let loss = self.dir.expire(self.now);
        self.forget(&loss.lost_keys);
        for id in &loss.nodes {
            assert!(!self.nodes[id].alive || self.dir.heartbeat(*id, self.now).is_err());
        }
        "heartbeats"
    }

    fn op_node_death(&mut self) -> &'static str {
        let id = NodeId(1 + self.rand.below(NODES));
        let node = self.nodes.get_mut(&id).unwrap();
        if node.alive {
            node.alive = false; // stops heartbeating; its memory is gone when it comes back
            node.held.clear();
            return "node-death";
        }
        node.alive = true;
        self.register(id);
        "node-return"
    }

    fn op_node_restart(&mut self) -> &'static str {
        let id = NodeId(1 + self.rand.below(NODES));
        if !self.nodes[&id].alive {
            return "restart-dead";
        }
        // DRAM contents survive with 50 % chance each (say, a daemon restart with shm kept)
        let mut keep = Vec::new();
        for (&slot, h) in &self.nodes[&id].held {
            if h.tier == Tier::Nvme || self.rand.chance(50) {
                keep.push(slot);
            }
        }
        let node = self.nodes.get_mut(&id).unwrap();
        node.held.retain(|slot, _| keep.contains(slot));
        self.register(id);
        "node-restart"
    }

    fn op_persist(&mut self) -> &'static str {
        let k = key(self.rand.below(KEYS));
        let _ = self.dir.add_replica(&k, &Location::ObjectStore);
        "persist"
    }

    fn op_list(&mut self) -> &'static str {
        let page = self.dir.list_dir("qwen-8b/tp1/", None, 50).unwrap();
        assert!(page.entries.len() <= 50);
        let names: Vec<&str> = page.entries.iter().map(DirEntry::name).collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted");
        "list"
    }

    /// The master loses everything; alive nodes re-register with what they hold.
    fn op_master_restart(&mut self) -> &'static str {
        let old = self.dir.stats();
        self.dir = Directory::new(self.cfg.clone()).unwrap();
        self.pending.clear();
        self.leases.clear();
        let alive: Vec<NodeId> =
            self.nodes.iter().filter(|(_, n)| n.alive).map(|(&id, _)| id).collect();
        for id in alive {
            self.register(id);
        }
        let new = self.dir.stats();
        // every object with a DRAM/NVMe replica on a live node is back
        assert!(new.objects <= old.objects + 1);
        "master-restart"
    }
}

fn run(seed: u64) -> (Stats, BTreeMap<&'static str, u64>) {
    let mut sim = Sim::new(seed);
    for _ in 0..OPS {
        sim.step();
    }
    (sim.dir.stats(), sim.ops)
}

#[test]
fn simulation_keeps_invariants() {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIM_SEED is a number")],
        Err(_) => {
            let n = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(4);
            (1..=n).collect()
        }
    };
    for seed in seeds {
        let (stats, ops) = run(seed);
        let dram = stats.tiers[Tier::Dram.index()];
        eprintln!(
            "seed {seed}: {} objects, {} evicted replicas since the last master restart, {} pending, \
             DRAM {}% used; ops {ops:?}",
            stats.objects,
            stats.evicted_replicas,
            stats.pending_puts,
            dram.used_bytes * 100 / dram.capacity_bytes.max(1)
        );
        assert!(stats.objects > 0);
    }
}

#[test]
fn simulation_replays_exactly_from_its_seed() {
    let a = run(42);
    let b = run(42);
    assert_eq!(a, b);
}
