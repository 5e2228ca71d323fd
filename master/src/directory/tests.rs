//! Unit tests: one per semantic engines rely on.

use super::*;

const MIB: u64 = 1 << 20;

fn cfg() -> Config {
    Config { seed: 1, ..Config::default() }
}

fn seg(index: u32, tier: Tier, capacity: u64) -> SegmentSpec {
    SegmentSpec { index, tier, base_addr: 0x1000_0000 * u64::from(index + 1), capacity }
}

fn reg(node: u64, host: &str, segments: Vec<SegmentSpec>) -> NodeRegistration {
    NodeRegistration {
        node: NodeId(node),
        host: host.to_string(),
        endpoint: format!("10.0.0.{node}:7000"),
        segments,
        held: Vec::new(),
    }
}

/// `nodes` nodes on distinct hosts, one DRAM segment of `capacity` each.
fn cluster_with(cfg: Config, nodes: u64, capacity: u64) -> Directory {
    let mut d = Directory::new(cfg).unwrap();
    for n in 1..=nodes {
        let r = reg(n, &format!("host{n}"), vec![seg(0, Tier::Dram, capacity)]);
        d.register_node(&r, 0, &mut Vec::new()).unwrap();
    }
    d
}

fn cluster(nodes: u64, capacity: u64) -> Directory {
    cluster_with(cfg(), nodes, capacity)
}

fn key(i: u64) -> String {
    format!("model-x/rank0/{:064x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn put_with(d: &mut Directory, req: &PutStart, now: u64) -> Result<Vec<NodeEffect>> {
    let mut fx = Vec::new();
    d.put_start(req, now, &mut fx)?;
    d.put_end(&PutEnd::new(req.key.clone(), Some([7; 32])), now, &mut fx)?;
    Ok(fx)
}

fn put(d: &mut Directory, key: &str, size: u64, now: u64) -> Vec<NodeEffect> {
    put_with(d, &PutStart::new(key, size), now).unwrap()
}

fn kind<T: std::fmt::Debug>(r: Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

fn drops(fx: &[NodeEffect]) -> Vec<String> {
    let mut keys: Vec<String> = fx
        .iter()
        .filter_map(|e| match e {
            NodeEffect::Drop { key, .. } => Some(key.to_string()),
            NodeEffect::Commit { .. } | NodeEffect::Rename { .. } => None,
        })
        .collect();
    keys.sort();
    keys
}

/// The drops that name a live read lease: a name gone while readers hold it, which nodes must
/// forget before the call is answered (key, end of the lease).
fn leased_drops(fx: &[NodeEffect]) -> Vec<(String, u64)> {
    fx.iter()
        .filter_map(|e| match e {
            NodeEffect::Drop { key, readers_until_ms, .. } if *readers_until_ms > 0 => {
                Some((key.to_string(), *readers_until_ms))
            }
            _ => None,
        })
        .collect()
}

fn nodes_of(view: &ObjectView) -> Vec<NodeId> {
    view.replicas.iter().filter_map(Replica::node).collect()
}

#[test]
fn directory_can_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Directory>(); // the RPC layer keeps it behind a lock shared by tasks
}

#[test]
fn record_sizes_stay_compact() {
    assert_eq!(Slab::<Obj>::slot_size(), 88);
    assert_eq!(Slab::<Rep>::slot_size(), 28);
}

#[test]
fn replicas_are_listed_newest_first_whether_inline_or_not() {
    let mut d = cluster(4, 64 * MIB);
    let mut fx = Vec::new();
    let mut req = PutStart::new("k", MIB);
    req.replicas = 3;
    let g = d.put_start(&req, 0, &mut fx).unwrap();
    d.put_end(&PutEnd::new("k", None), 0, &mut fx).unwrap();
    let placed: Vec<Location> = g.replicas.iter().map(|r| r.location).collect();
    let listed = |d: &Directory| -> Vec<Location> {
        d.stat("k").unwrap().replicas.iter().map(|r| r.location).collect()
    };
    assert_eq!(listed(&d), placed.iter().rev().copied().collect::<Vec<_>>());
    // the oldest (inline) one goes; a new one on the fourth node comes first, the rest keep
    // their order
    assert!(!d.remove_replica("k", &placed[0]).unwrap());
    let used: Vec<NodeId> =
        placed.iter().filter_map(|l| Replica { location: *l, len: 0 }.node()).collect();
    let free = (1..=4).map(NodeId).find(|n| !used.contains(n)).unwrap();
    let loc =
        NodeLocation { node: free, segment: 0, tier: Tier::Dram, addr: 0x1000_0000, offset: 0 };
    let loc = Location::Node(loc);
    d.add_replica("k", &loc).unwrap();
    assert_eq!(listed(&d), vec![loc, placed[2], placed[1]]);
    d.verify().unwrap();
    // down to none but the newest, then one more: the order still follows attachment
    assert!(!d.remove_replica("k", &placed[1]).unwrap());
    assert!(!d.remove_replica("k", &placed[2]).unwrap());
    d.add_replica("k", &placed[0]).unwrap();
    assert_eq!(listed(&d), vec![placed[0], loc]);
    d.get("k", 1).unwrap();
    d.verify().unwrap();
    assert!(!d.remove_replica("k", &loc).unwrap());
    assert!(d.remove_replica("k", &placed[0]).unwrap(), "the last replica: the object is gone");
    d.verify().unwrap();
}

#[test]
fn keys_stay_right_while_the_key_arena_compacts() {
    // unit tests use 1 KiB arena chunks: removals and renames here compact many of them
    let mut d = cluster(2, 1 << 40);
    let mut fx = Vec::new();
    for i in 0..3000 {
        put(&mut d, &key(i), 4096, 1);
    }
    let arena_full = d.keys.heap_bytes();
    let mut live: Vec<String> = Vec::new();
    for i in 0..3000 {
        match i % 4 {
            0 => live.push(key(i)),
            1 => {
                let to = format!("renamed/{i:05}");
                d.rename(&key(i), &to, RenameMode::Replace, 2, &mut fx).unwrap();
                live.push(to);
            }
            _ => d.remove(&key(i), false, 2, &mut fx).unwrap(),
        }
    }
    d.verify().unwrap();
    assert!(d.keys.heap_bytes() < arena_full * 3 / 4, "{} of {arena_full}", d.keys.heap_bytes());
    for k in &live {
        assert!(d.stat(k).is_ok(), "{k}");
    }
    for i in (0..3000).filter(|i| i % 4 > 1) {
        assert_eq!(kind(d.stat(&key(i))), ErrorKind::NotFound);
    }
    live.sort();
    let listed: Vec<String> =
        d.list("", None, 10_000).unwrap().entries.iter().map(|e| e.key.to_string()).collect();
    assert_eq!(listed, live);
}

#[test]
fn pending_put_is_invisible_until_put_end() {
    let mut d = cluster(3, 64 * MIB);
    let mut fx = Vec::new();
    let k = key(1);
    let grant = d.put_start(&PutStart::new(&k, MIB), 10, &mut fx).unwrap();
    assert_eq!(grant.replicas.len(), 1);
    assert_eq!(kind(d.get(&k, 10)), ErrorKind::NotFound);
    assert!(!d.exists(&k, 10).unwrap());
    assert_eq!(kind(d.stat(&k)), ErrorKind::NotFound);
    assert!(d.list("", None, 10).unwrap().entries.is_empty());
    assert_eq!(d.stats().pending_puts, 1);
    assert!(fx.is_empty());

    d.put_end(&PutEnd::new(&k, Some([1; 32])), 11, &mut fx).unwrap();
    let view = d.get(&k, 12).unwrap();
    assert_eq!((view.size, view.checksum, view.version), (MIB, Some([1; 32]), grant.version));
    assert_eq!(view.replicas, grant.replicas);
    let Location::Node(loc) = grant.replicas[0].location else { panic!() };
    assert_eq!(loc.addr, 0x1000_0000 + loc.offset);
    assert_eq!(
        fx,
        vec![NodeEffect::Commit {
            node: loc.node,
            key: Arc::from(k.as_str()),
            segment: 0,
            offset: loc.offset,
            size: MIB,
            checksum: Some([1; 32]),
            version: grant.version,
            persistence: Persistence::None,
            pin: Pin::None,
        }]
    );
    d.verify().unwrap();
}

#[test]
fn replicas_go_to_distinct_nodes_best_effort() {
    let mut d = cluster(3, 64 * MIB);
    let mut fx = Vec::new();
    let mut req = PutStart::new(key(1), MIB);
    req.replicas = 3;
    let g = d.put_start(&req, 0, &mut fx).unwrap();
    let mut nodes: Vec<NodeId> = g.replicas.iter().filter_map(Replica::node).collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3);

    req.key = key(2);
    req.replicas = 5; // only 3 nodes: best effort
    assert_eq!(d.put_start(&req, 0, &mut fx).unwrap().replicas.len(), 3);

    // two segments on one node still count as one node
    let mut d = Directory::new(cfg()).unwrap();
    let r = reg(1, "h", vec![seg(0, Tier::Dram, 8 * MIB), seg(1, Tier::Dram, 8 * MIB)]);
    d.register_node(&r, 0, &mut fx).unwrap();
    req.replicas = 2;
    assert_eq!(d.put_start(&req, 0, &mut fx).unwrap().replicas.len(), 1);

    let mut empty = Directory::new(cfg()).unwrap();
    assert_eq!(kind(empty.put_start(&req, 0, &mut fx)), ErrorKind::NoSpace);
}

#[test]
fn first_writer_wins_and_concurrent_writer_is_told_to_retry() {
    let mut d = cluster(2, 64 * MIB);
    let mut fx = Vec::new();
    let k = key(1);
    d.put_start(&PutStart::new(&k, MIB), 0, &mut fx).unwrap();
    let busy = d.put_start(&PutStart::new(&k, 2 * MIB), 1, &mut fx).unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::PutInProgress);
    assert!(busy.retryable());
    d.put_end(&PutEnd::new(&k, None), 2, &mut fx).unwrap();
    let exists = d.put_start(&PutStart::new(&k, 2 * MIB), 3, &mut fx).unwrap_err();
    assert_eq!(exists.kind(), ErrorKind::AlreadyExists);
    assert!(!exists.retryable());
    assert_eq!(d.stat(&k).unwrap().size, MIB, "the first value is kept");
}

#[test]
fn upsert_replaces_and_frees_the_old_ranges() {
    let mut d = cluster(2, 64 * MIB);
    let k = key(1);
    put(&mut d, &k, MIB, 0);
    let old = d.stat(&k).unwrap();
    let mut req = PutStart::new(&k, 2 * MIB);
    req.upsert = true;
    let mut fx = Vec::new();
    d.put_start(&req, 1, &mut fx).unwrap();
    assert_eq!(d.stat(&k).unwrap(), old, "readers see the old value while the new one is written");
    d.put_end(&PutEnd::new(&k, None), 2, &mut fx).unwrap();
    let new = d.stat(&k).unwrap();
    assert_eq!(new.size, 2 * MIB);
    assert!(new.version > old.version);
    assert_eq!(drops(&fx), vec![k.clone()]);
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, 2 * MIB);
    d.verify().unwrap();
}

#[test]
fn upsert_is_refused_while_leased_and_defers_frees_for_late_readers() {
    let mut d = cluster(1, 64 * MIB);
    let k = key(1);
    put(&mut d, &k, MIB, 0);
    let mut req = PutStart::new(&k, MIB);
    req.upsert = true;
    let mut fx = Vec::new();
    d.get(&k, 100).unwrap(); // lease until 10_100
    let e = d.put_start(&req, 200, &mut fx).unwrap_err();
    assert_eq!((e.kind(), e.retryable()), (ErrorKind::Leased, true));

    // lease over: the upsert starts; a reader leases the old value during the write
    d.put_start(&req, 10_100, &mut fx).unwrap();
    d.get(&k, 10_200).unwrap(); // lease until 20_200
    d.put_end(&PutEnd::new(&k, None), 10_300, &mut fx).unwrap();
    // The node forgets the old version's name now; its range stays until the lease ends.
    assert_eq!(leased_drops(&fx), vec![(k.clone(), 20_200)]);
    fx.clear();
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, 2 * MIB);
    d.verify().unwrap();
    assert_eq!(d.tick(20_199, &mut fx).released_ranges, 0);
    assert_eq!(d.tick(20_200, &mut fx).released_ranges, 1);
    assert_eq!(drops(&fx), vec![k.clone()]);
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, MIB);
    d.verify().unwrap();
}

#[test]
fn pending_puts_time_out_and_free_their_space() {
    let mut d = cluster_with(Config { put_timeout_ms: 1000, ..cfg() }, 1, 4 * MIB);
    let mut fx = Vec::new();
    let k = key(1);
    let g = d.put_start(&PutStart::new(&k, 4 * MIB), 0, &mut fx).unwrap();
    assert_eq!(kind(d.put_start(&PutStart::new(key(2), MIB), 0, &mut fx)), ErrorKind::NoSpace);
    assert_eq!(d.tick(999, &mut fx).expired_puts, 0);
    assert!(drops(&fx).is_empty());
    assert_eq!(d.tick(1000, &mut fx).expired_puts, 1);
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, 0);
    // The writer may have committed its replica on the node itself (a noted write): the node
    // is told to forget exactly that version there.
    assert_eq!(drops(&fx), vec![k.clone()]);
    let Location::Node(at) = g.replicas[0].location else { panic!("a node replica") };
    assert!(fx.iter().any(|e| matches!(e,
        NodeEffect::Drop { version, offset, .. }
            if *version == g.version && *offset == at.offset)));
    assert_eq!(kind(d.put_end(&PutEnd::new(&k, None), 1001, &mut fx)), ErrorKind::NotFound);

    // without a tick, a late put_end is refused and the next put_start takes over
    d.put_start(&PutStart::new(&k, MIB), 2000, &mut fx).unwrap();
    assert_eq!(kind(d.put_end(&PutEnd::new(&k, None), 3000, &mut fx)), ErrorKind::NotFound);
    d.put_start(&PutStart::new(&k, MIB), 3500, &mut fx).unwrap();
    assert_eq!(kind(d.put_start(&PutStart::new(&k, MIB), 3600, &mut fx)), ErrorKind::PutInProgress);
    d.verify().unwrap();
}

#[test]
fn stale_put_end_cannot_complete_another_writers_put() {
    let mut d = cluster_with(Config { put_timeout_ms: 1000, ..cfg() }, 1, 64 * MIB);
    let mut fx = Vec::new();
    let k = key(1);
    let first = d.put_start(&PutStart::new(&k, MIB), 0, &mut fx).unwrap();
    let second = d.put_start(&PutStart::new(&k, MIB), 1500, &mut fx).unwrap();
    assert_ne!(first.version, second.version);
    let stale = PutEnd { key: k.clone(), checksum: None, version: Some(first.version) };
    assert_eq!(kind(d.put_end(&stale, 1600, &mut fx)), ErrorKind::NotFound);
    let fresh = PutEnd { key: k.clone(), checksum: None, version: Some(second.version) };
    d.put_end(&fresh, 1600, &mut fx).unwrap();
    assert_eq!(d.stat(&k).unwrap().version, second.version);
}

#[test]
fn put_revoke_frees_the_space() {
    let mut d = cluster(1, 4 * MIB);
    let mut fx = Vec::new();
    d.put_start(&PutStart::new(key(1), 4 * MIB), 0, &mut fx).unwrap();
    d.put_revoke(&key(1), &mut fx).unwrap();
    assert_eq!(drops(&fx), vec![key(1)]);
    assert_eq!(kind(d.put_revoke(&key(1), &mut fx)), ErrorKind::NotFound);
    d.put_start(&PutStart::new(key(2), 4 * MIB), 0, &mut fx).unwrap();
    d.verify().unwrap();
}

#[test]
fn leases_come_from_get_and_exists_not_stat() {
    let mut d = cluster(1, 64 * MIB);
    let mut fx = Vec::new();
    for i in 0..3 {
        put(&mut d, &key(i), MIB, 0);
    }
    assert_eq!(d.get(&key(0), 100).unwrap().lease_end_ms, 10_100);
    assert!(d.exists(&key(1), 100).unwrap());
    assert_eq!(d.stat(&key(2)).unwrap().lease_end_ms, 0);
    for i in 0..2 {
        let e = d.remove(&key(i), false, 10_099, &mut fx).unwrap_err();
        assert_eq!((e.kind(), e.retryable()), (ErrorKind::Leased, true));
    }
    d.remove(&key(2), false, 200, &mut fx).unwrap();
    d.remove(&key(0), false, 10_100, &mut fx).unwrap();
    d.remove(&key(1), true, 200, &mut fx).unwrap();
    assert_eq!(drops(&fx), {
        let mut v = vec![key(0), key(1), key(2)];
        v.sort();
        v
    });
    assert_eq!(kind(d.remove(&key(1), true, 200, &mut fx)), ErrorKind::NotFound);
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, 0);
}

#[test]
fn batch_calls_answer_per_key() {
    let mut d = cluster(2, 64 * MIB);
    let mut fx = Vec::new();
    let reqs: Vec<PutStart> = (0..4).map(|i| PutStart::new(key(i), MIB)).collect();
    assert!(d.put_start_batch(&reqs, 0, &mut fx).iter().all(Result::is_ok));
    let ends: Vec<PutEnd> = (0..3).map(|i| PutEnd::new(key(i), None)).collect();
    assert!(d.put_end_batch(&ends, 0, &mut fx).iter().all(Result::is_ok));
    assert!(d.put_revoke_batch(&[key(3)], &mut fx)[0].is_ok());
    let keys = vec![key(0), key(3), String::new()];
    let got: Vec<Option<bool>> = d.exists_batch(&keys, 5).into_iter().map(Result::ok).collect();
    assert_eq!(got, vec![Some(true), Some(false), None]);
    let kinds: Vec<_> = d
        .get_batch(&keys, 5)
        .into_iter()
        .map(|r| r.map(|v| v.size).map_err(|e| e.kind()))
        .collect();
    assert_eq!(kinds, vec![Ok(MIB), Err(ErrorKind::NotFound), Err(ErrorKind::InvalidKey)]);
    assert_eq!(d.stat_batch(&[key(1)])[0].as_ref().unwrap().lease_end_ms, 0);
    let removed = d.remove_batch(&[key(0), key(1)], false, 5, &mut fx);
    assert_eq!(removed[0].as_ref().unwrap_err().kind(), ErrorKind::Leased);
    assert!(removed[1].is_ok());
}

#[test]
fn hard_pins_need_force_and_bulk_removal_skips_protected_objects() {
    let mut d = cluster(1, 64 * MIB);
    let mut fx = Vec::new();
    let mut pinned = PutStart::new("pin/a", MIB);
    pinned.pin = Pin::Hard;
    put_with(&mut d, &pinned, 0).unwrap();
    put(&mut d, "leased/a", MIB, 0);
    put(&mut d, "plain/a", MIB, 0);
    put(&mut d, "plain/b", MIB, 0);
    d.get("leased/a", 0).unwrap();
    assert_eq!(kind(d.remove("pin/a", false, 0, &mut fx)), ErrorKind::Pinned);

    let counts = d.remove_regex("^plain/a$", false, 1, &mut fx).unwrap();
    assert_eq!(counts, RemoveCounts { removed: 1, skipped_leased: 0, skipped_pinned: 0 });
    assert_eq!(kind(d.remove_regex("(", false, 1, &mut fx)), ErrorKind::InvalidArgument);
    let counts = d.remove_all(false, 1, &mut fx);
    assert_eq!(counts, RemoveCounts { removed: 1, skipped_leased: 1, skipped_pinned: 1 });
    let counts = d.remove_regex("a", true, 1, &mut fx).unwrap();
    assert_eq!(counts.removed, 2);
    assert!(d.is_empty());
    d.verify().unwrap();
}

#[test]
fn list_is_ordered_paged_and_prefixed() {
    let mut d = cluster(1, 64 * MIB);
    for k in ["b/2", "a/1", "b/1", "c", "b/3"] {
        put(&mut d, k, 4096, 0);
    }
    let p1 = d.list("b/", None, 2).unwrap();
    let names: Vec<&str> = p1.entries.iter().map(|e| &*e.key).collect();
    assert_eq!(names, vec!["b/1", "b/2"]);
    assert_eq!(p1.next_start_after.as_deref(), Some("b/2"));
    let p2 = d.list("b/", p1.next_start_after.as_deref(), 2).unwrap();
    assert_eq!(p2.entries.len(), 1);
    assert_eq!(p2.next_start_after, None);
    assert_eq!(d.list("", None, 100).unwrap().entries.len(), 5);
    assert_eq!(kind(d.list("", None, 0)), ErrorKind::InvalidArgument);
}

#[test]
fn list_dir_shows_children_and_skips_subtrees() {
    let mut d = cluster(1, 256 * MIB);
    let keys = ["m/a", "m/a.b", "m/a/x", "m/a/y/z", "m/b/1", "m/c", "n/1", "top"];
    for k in keys {
        put(&mut d, k, 4096, 0);
    }
    for i in 0..200 {
        put(&mut d, &format!("m/big/{i:04}"), 4096, 0);
    }
    let names = |p: &DirPage| p.entries.iter().map(|e| e.name().to_string()).collect::<Vec<_>>();
    let all = d.list_dir("m", None, 100).unwrap();
    assert_eq!(names(&all), vec!["a", "a.b", "a/", "b/", "big/", "c"]);
    assert!(matches!(all.entries[0], DirEntry::Object { size: 4096, .. }));
    assert_eq!(all.next_start_after, None);
    assert_eq!(names(&d.list_dir("", None, 100).unwrap()), vec!["m/", "n/", "top"]);

    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = d.list_dir("m/", after.as_deref(), 2).unwrap();
        seen.extend(names(&page));
        match page.next_start_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, names(&all));
    assert_eq!(names(&d.list_dir("m/a/", None, 10).unwrap()), vec!["x", "y/"]);
}

#[test]
fn eviction_is_lru_and_respects_leases_and_pins() {
    // one 10 MiB segment, 1 MiB objects; high 0.95, low 0.5
    let c = Config { evict_low_watermark: 0.5, ..cfg() };
    let mut d = cluster_with(c, 1, 10 * MIB);
    let mut fx = Vec::new();
    let mut hard = PutStart::new("hard", MIB);
    hard.pin = Pin::Hard;
    put_with(&mut d, &hard, 0).unwrap();
    let mut soft = PutStart::new("soft", MIB);
    soft.pin = Pin::Soft;
    put_with(&mut d, &soft, 0).unwrap();
    for i in 0..7 {
        put(&mut d, &format!("k{i}"), MIB, i);
    }
    assert_eq!(d.evict(100, &mut fx), Eviction::default(), "90 % is under the high watermark");
    put(&mut d, "k7", MIB, 100);
    d.get("k0", 100).unwrap(); // k0 becomes most recent and leased until 10_100
    let ev = d.evict(200, &mut fx);
    // used 10 MiB -> at most 5 MiB: drop 5 unpinned in LRU order, k0 (leased) skipped
    let mut removed: Vec<String> = ev.removed_keys.iter().map(|k| k.to_string()).collect();
    removed.sort();
    assert_eq!(removed, vec!["k1", "k2", "k3", "k4", "k5"]);
    assert_eq!(drops(&fx), removed);
    assert_eq!(d.stats().evicted_objects, 5);

    // fill again, make everything unpinned leased: soft goes before anything leased, hard never
    fx.clear();
    for i in 10..15 {
        put(&mut d, &format!("k{i}"), MIB, 300);
    }
    for k in ["k0", "k6", "k7", "k10", "k11", "k12", "k13", "k14"] {
        d.get(k, 300).unwrap();
    }
    let ev = d.evict(400, &mut fx);
    assert_eq!(ev.removed_keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(), vec!["soft"]);
    assert!(d.stat("hard").is_ok());
    d.verify().unwrap();
}

#[test]
fn eviction_rounds_are_bounded() {
    let c = Config { evict_round_objects_max: 3, evict_low_watermark: 0.1, ..cfg() };
    let mut d = cluster_with(c, 1, 10 * MIB);
    let mut fx = Vec::new();
    for i in 0..10 {
        put(&mut d, &key(i), MIB, 0);
    }
    assert_eq!(d.evict(1, &mut fx).replicas, 3);
    assert_eq!(fx.len(), 3);
    assert_eq!(d.len(), 7);
}

#[test]
fn full_put_evicts_to_make_room() {
    let mut d = cluster(1, 4 * MIB);
    let mut fx = Vec::new();
    for i in 0..4 {
        put(&mut d, &key(i), MIB, i);
    }
    d.get(&key(0), 10).unwrap(); // leased and recent
    let g = d.put_start(&PutStart::new(key(9), 2 * MIB), 20, &mut fx).unwrap();
    assert_eq!(g.replicas.len(), 1);
    let mut want = vec![key(1), key(2)];
    want.sort();
    assert_eq!(drops(&fx), want, "the two least recently used, unleased objects");
    let mut evicted: Vec<String> = g.evicted.iter().map(|k| k.to_string()).collect();
    evicted.sort();
    assert_eq!(evicted, want, "reported for KV removed events");
    assert!(d.stat(&key(0)).is_ok());

    // everything leased: NoSpace, nothing evicted
    for i in [0, 3] {
        d.get(&key(i), 30).unwrap();
    }
    fx.clear();
    let e = d.put_start(&PutStart::new(key(10), MIB), 40, &mut fx).unwrap_err();
    assert_eq!((e.kind(), e.retryable()), (ErrorKind::NoSpace, true));
    assert!(fx.is_empty());
    d.verify().unwrap();
}

#[test]
fn limits_are_typed_errors() {
    let c = Config {
        key_len_max: 100,
        object_size_max: 8 * MIB,
        replicas_max: 2,
        objects_max: 2,
        ..cfg()
    };
    let mut d = cluster_with(c, 3, 64 * MIB);
    let mut fx = Vec::new();
    let mut start = |req: PutStart| d.put_start(&req, 0, &mut fx).map(|_| ()).map_err(|e| e.kind());
    assert_eq!(start(PutStart::new("", 1)), Err(ErrorKind::InvalidKey));
    assert_eq!(start(PutStart::new("k".repeat(101), 1)), Err(ErrorKind::InvalidKey));
    assert_eq!(start(PutStart::new("k", 0)), Err(ErrorKind::InvalidArgument));
    assert_eq!(start(PutStart::new("k", 8 * MIB + 1)), Err(ErrorKind::TooLarge));
    assert_eq!(start(PutStart { replicas: 3, ..PutStart::new("k", 1) }), Err(ErrorKind::TooLarge));
    assert_eq!(
        start(PutStart { replicas: 0, ..PutStart::new("k", 1) }),
        Err(ErrorKind::InvalidArgument)
    );
    assert_eq!(
        start(PutStart { tier: Tier::ObjectStore, ..PutStart::new("k", 1) }),
        Err(ErrorKind::InvalidArgument)
    );
    assert_eq!(start(PutStart::new("k1", 1)), Ok(()));
    assert_eq!(start(PutStart::new("k2", 1)), Ok(()));
    assert_eq!(start(PutStart::new("k3", 1)), Err(ErrorKind::NoSpace), "objects_max");
    assert_eq!(kind(d.get(&"k".repeat(101), 0)), ErrorKind::InvalidKey);
    let bad = Config { evict_low_watermark: 0.99, ..Config::default() };
    assert_eq!(Directory::new(bad).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn placement_strategies() {
    let mut d = Directory::new(cfg()).unwrap();
    let mut fx = Vec::new();
    // hosts: node 1,2 on "a", node 3 on "b"; node 3 is much emptier (bigger)
    d.register_node(&reg(1, "a", vec![seg(0, Tier::Dram, 16 * MIB)]), 0, &mut fx).unwrap();
    d.register_node(&reg(2, "a", vec![seg(0, Tier::Dram, 16 * MIB)]), 0, &mut fx).unwrap();
    d.register_node(&reg(3, "b", vec![seg(0, Tier::Dram, 1024 * MIB)]), 0, &mut fx).unwrap();
    put(&mut d, "fill1", 8 * MIB, 0);
    let mut local = PutStart::new("local", MIB);
    local.strategy = Strategy::LocalFirst;
    local.client_host = Some("a".into());
    local.replicas = 2;
    put_with(&mut d, &local, 0).unwrap();
    let mut on = nodes_of(&d.stat("local").unwrap());
    on.sort();
    assert_eq!(on, vec![NodeId(1), NodeId(2)]);

    let mut free = PutStart::new("free", MIB);
    free.strategy = Strategy::FreeRatioFirst;
    put_with(&mut d, &free, 0).unwrap();
    assert_eq!(nodes_of(&d.stat("free").unwrap()), vec![NodeId(3)]);

    let mut pref = PutStart::new("pref", MIB);
    pref.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &pref, 0).unwrap();
    assert_eq!(nodes_of(&d.stat("pref").unwrap()), vec![NodeId(2)]);

    // random placement is a function of the seed
    let placements = |seed| {
        let mut d = cluster_with(Config { seed, ..cfg() }, 20, 64 * MIB);
        let mut on = Vec::new();
        for i in 0..20 {
            put(&mut d, &key(i), MIB, 0);
            on.push(nodes_of(&d.stat(&key(i)).unwrap())[0]);
        }
        on
    };
    assert_eq!(placements(5), placements(5));
    assert_ne!(placements(5), placements(6));
}

#[test]
fn eager_persistence_and_tier_reports() {
    let mut d = Directory::new(cfg()).unwrap();
    let mut fx = Vec::new();
    let r = reg(1, "h", vec![seg(0, Tier::Dram, 64 * MIB), seg(1, Tier::Nvme, 64 * MIB)]);
    d.register_node(&r, 0, &mut fx).unwrap();
    let mut eager = PutStart::new("e", MIB);
    eager.persistence = Persistence::Eager;
    put_with(&mut d, &eager, 0).unwrap();
    let tiers: Vec<Tier> = d.stat("e").unwrap().replicas.iter().map(Replica::tier).collect();
    assert_eq!(tiers, vec![Tier::Dram, Tier::ObjectStore]);

    // demotion DRAM -> NVMe reported by the node's tier manager
    put(&mut d, "k", MIB, 0);
    let Location::Node(dram) = d.stat("k").unwrap().replicas[0].location else { panic!() };
    let nvme = NodeLocation { node: NodeId(1), segment: 1, tier: Tier::Nvme, addr: 0, offset: 0 };
    d.add_replica("k", &Location::Node(nvme)).unwrap();
    assert_eq!(kind(d.add_replica("k", &Location::Node(nvme))), ErrorKind::Conflict);
    let wrong = NodeLocation { tier: Tier::Dram, ..nvme };
    assert_eq!(kind(d.add_replica("k", &Location::Node(wrong))), ErrorKind::InvalidArgument);
    assert!(!d.remove_replica("k", &Location::Node(dram)).unwrap());
    let view = d.stat("k").unwrap();
    assert_eq!(view.replicas.len(), 1);
    assert_eq!(view.replicas[0].tier(), Tier::Nvme);
    assert_eq!(d.stats().tiers[Tier::Nvme.index()].bytes, MIB);
    // persisted, then the last node replica goes: still readable from object storage
    d.add_replica("k", &Location::ObjectStore).unwrap();
    assert!(!d.remove_replica("k", &Location::Node(nvme)).unwrap());
    assert!(d.remove_replica("k", &Location::ObjectStore).unwrap(), "last replica: object gone");
    assert_eq!(kind(d.stat("k")), ErrorKind::NotFound);
    d.verify().unwrap();
}

#[test]
fn heartbeat_expiry_and_lost_objects() {
    let c = Config { node_ttl_ms: 1000, ..cfg() };
    let mut d = cluster_with(c, 2, 64 * MIB);
    let mut fx = Vec::new();
    let mut two = PutStart::new("two", MIB);
    two.replicas = 2;
    put_with(&mut d, &two, 0).unwrap();
    let mut persisted = PutStart::new("persisted", MIB);
    persisted.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &persisted, 0).unwrap();
    d.add_replica("persisted", &Location::ObjectStore).unwrap();
    let mut only2 = PutStart::new("only2", MIB);
    only2.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &only2, 0).unwrap();
    let mut pending = PutStart::new("pending", MIB);
    pending.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    d.put_start(&pending, 0, &mut fx).unwrap();

    d.heartbeat(NodeId(1), 900).unwrap();
    assert_eq!(d.expire(1000).nodes, vec![], "exactly at the ttl is still alive");
    let loss = d.expire(1001);
    assert_eq!(loss.nodes, vec![NodeId(2)]);
    assert_eq!(loss.lost_keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(), vec!["only2"]);
    assert_eq!(loss.revoked_puts, 1);
    assert_eq!(nodes_of(&d.stat("two").unwrap()), vec![NodeId(1)]);
    let p = d.stat("persisted").unwrap();
    assert_eq!(p.replicas, vec![Replica { location: Location::ObjectStore, len: MIB }]);
    let e = d.heartbeat(NodeId(2), 1002).unwrap_err();
    assert_eq!((e.kind(), e.retryable()), (ErrorKind::NodeUnknown, true));
    assert_eq!(kind(d.unregister_node(NodeId(2))), ErrorKind::NodeUnknown);
    let loss = d.unregister_node(NodeId(1)).unwrap();
    assert_eq!(loss.lost_keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(), vec!["two"]);
    d.verify().unwrap();
}

/// What node `n` reports it holds, from the Commit effects it was sent.
fn held_from(fx: &[NodeEffect], n: NodeId) -> Vec<HeldObject> {
    fx.iter()
        .filter_map(|e| match e {
            NodeEffect::Commit {
                node,
                key,
                segment,
                offset,
                size,
                checksum,
                version,
                persistence,
                pin,
            } if *node == n => Some(HeldObject {
                key: key.to_string(),
                size: *size,
                checksum: *checksum,
                version: *version,
                segment: *segment,
                offset: *offset,
                tier: Tier::Dram,
                persistence: *persistence,
                pin: *pin,
                persisted: false,
                renamed_from: None,
            }),
            _ => None,
        })
        .collect()
}

#[test]
fn master_restart_rebuilds_from_node_reports() {
    let mut d = cluster(2, 64 * MIB);
    let mut commits = Vec::new();
    for i in 0..50 {
        let mut req = PutStart::new(key(i), MIB);
        req.replicas = 2;
        commits.extend(put_with(&mut d, &req, 1000 + i).unwrap());
    }
    let before = d.list("", None, 1000).unwrap();

    let mut fresh = Directory::new(cfg()).unwrap();
    let mut fx = Vec::new();
    for n in 1..=2 {
        let mut r = reg(n, &format!("host{n}"), vec![seg(0, Tier::Dram, 64 * MIB)]);
        r.held = held_from(&commits, NodeId(n));
        let out = fresh.register_node(&r, 5000, &mut fx).unwrap();
        assert_eq!((out.adopted, out.conflicts.len()), (50, 0));
    }
    assert!(fx.is_empty());
    assert_eq!(fresh.list("", None, 1000).unwrap(), before);
    assert_eq!(nodes_of(&fresh.stat(&key(3)).unwrap()).len(), 2);
    // reserved ranges are not handed out again, and new versions are higher
    let g = fresh.put_start(&PutStart::new("new", 14 * MIB), 6000, &mut fx).unwrap();
    assert!(g.version > d.stat(&key(49)).unwrap().version);
    fresh.verify().unwrap();
}

#[test]
fn a_takeover_keeps_the_previous_leaders_grants_until_their_deadlines() {
    // The old leader: two objects done, two puts granted and not ended.
    let c = Config { put_timeout_ms: 30_000, lease_ttl_ms: 10_000, ..cfg() };
    let mut old = cluster_with(c.clone(), 1, 8 * MIB);
    let mut commits = put(&mut old, "done-a", MIB, 0);
    commits.extend(put(&mut old, "done-b", MIB, 0));
    let mut fx = Vec::new();
    let in_flight = old.put_start(&PutStart::new("in-flight", 2 * MIB), 100, &mut fx).unwrap();
    let finished = old.put_start(&PutStart::new("finished", MIB), 100, &mut fx).unwrap();
    let grants = old.outstanding_grants(0);
    assert_eq!(grants.len(), 2);
    let g = grants.iter().find(|g| &*g.key == "in-flight").unwrap();
    assert_eq!((g.version, g.len, g.deadline_ms), (in_flight.version, 2 * MIB, 30_100));
    // "finished" was committed on the node by a noted write: the node reports it.
    let done = PutEnd::new("finished".to_string(), Some([7; 32]));
    commits.extend({
        let mut fx = Vec::new();
        old.put_end(&done, 150, &mut fx).unwrap();
        fx
    });
    assert_eq!(finished.replicas.len(), 1);

    // The new leader inherits both grants; the node registers with three objects.
    let mut new = Directory::new(c).unwrap();
    new.inherit(grants, 1_000 + 10_000);
    let mut r = reg(1, "host1", vec![seg(0, Tier::Dram, 8 * MIB)]);
    r.held = held_from(&commits, NodeId(1));
    let out = new.register_node(&r, 1_000, &mut fx).unwrap();
    assert_eq!((out.adopted, out.conflicts.len(), out.reserved), (3, 0, 1), "{out:?}");
    new.verify().unwrap();
    // 8 MiB less 3 MiB of objects less the 2 MiB in flight: 3 MiB fit, 4 do not.
    let mut fx = Vec::new();
    assert_eq!(
        kind(new.put_start(&PutStart::new("big", 4 * MIB), 1_100, &mut fx)),
        ErrorKind::NoSpace
    );
    new.put_start(&PutStart::new("fits", 3 * MIB), 1_100, &mut fx).unwrap();
    new.put_revoke("fits", &mut fx).unwrap();
    // Adopted objects are leased until the old leader's leases must have ended.
    assert_eq!(kind(new.remove("done-a", false, 5_000, &mut fx)), ErrorKind::Leased);
    new.remove("done-a", false, 11_001, &mut fx).unwrap();
    // After the writer's deadline the range is free again (no drop: no object of ours there).
    let mut fx = Vec::new();
    let tick = new.tick(30_100, &mut fx);
    assert_eq!(tick.released_ranges, 1);
    assert!(drops(&fx).is_empty(), "{fx:?}");
    new.put_start(&PutStart::new("big", 4 * MIB), 30_200, &mut fx).unwrap();
    new.verify().unwrap();
}

#[test]
fn a_node_registered_in_chunks_takes_puts_at_once_around_what_it_holds() {
    let mut old = cluster(1, 64 * MIB);
    let mut commits = Vec::new();
    for i in 0..10 {
        commits.extend(put(&mut old, &key(i), MIB, 0));
    }
    let mut held = held_from(&commits, NodeId(1));
    held.sort_by_key(|h| h.offset);
    let extents: Vec<(u32, u64, u64)> =
        held.iter().map(|h| (0, h.offset, h.offset + MIB)).collect();
    // A restarted master: node 1 registers in chunks.
    let mut d = Directory::new(cfg()).unwrap();
    let r1 = reg(1, "host1", vec![seg(0, Tier::Dram, 64 * MIB)]);
    assert_eq!(d.register_node_begin(&r1, held.len(), &extents, 10).unwrap(), 0);
    assert!(d.knows_node(NodeId(1)));
    let (mut fx, mut out) = (Vec::new(), Registration::default());
    d.adopt_held(NodeId(1), &held[..4], true, 10, &mut fx, &mut out).unwrap();
    assert_eq!(nodes_of(&d.stat(&held[0].key).unwrap()), vec![NodeId(1)]);
    assert_eq!(kind(d.stat(&held[9].key)), ErrorKind::NotFound, "not adopted yet");
    // Between chunks the node takes puts, in the space none of its objects holds: all of it.
    for i in 100..154 {
        put(&mut d, &key(i), MIB, 20);
    }
    assert!(d.stats().evicted_objects == 0, "the 54 MiB nobody held was enough");
    // An object refused at adoption leaves its range free.
    let mut stale = held[9].clone();
    stale.tier = Tier::Nvme;
    d.adopt_held(NodeId(1), &held[4..9], true, 30, &mut fx, &mut out).unwrap();
    d.adopt_held(NodeId(1), &[stale], true, 30, &mut fx, &mut out).unwrap();
    d.register_node_end(NodeId(1), 40).unwrap();
    assert_eq!((out.adopted, out.conflicts.len()), (9, 1), "{out:?}");
    d.verify().unwrap();
    put(&mut d, "in-the-refused-range", MIB, 50);
    d.verify().unwrap();
    // A known node re-registers whole; chunks of a node that is not registering are refused.
    assert_eq!(kind(d.register_node_begin(&r1, 1, &[], 60)), ErrorKind::InvalidArgument);
    assert_eq!(
        kind(d.adopt_held(NodeId(1), &held, true, 60, &mut fx, &mut out)),
        ErrorKind::NodeUnknown
    );
}

#[test]
fn recovery_conflicts_resolve_the_same_way_in_any_order() {
    let held = |key: &str, version: u64, offset: u64, segment: u32| HeldObject {
        key: key.to_string(),
        size: MIB,
        checksum: Some([version as u8; 32]),
        version,
        segment,
        offset,
        tier: Tier::Dram,
        persistence: Persistence::None,
        pin: Pin::None,
        persisted: false,
        renamed_from: None,
    };
    let node1 = || {
        let mut r = reg(1, "h1", vec![seg(0, Tier::Dram, 64 * MIB)]);
        r.held = vec![
            held("k", 5, 0, 0),
            held("k2", 1, 8 * MIB, 0),
            held("overlap", 1, 8 * MIB + 4096, 0), // overlaps "k2"
            held("badseg", 1, 0, 9),
        ];
        r
    };
    let node2 = || {
        let mut r = reg(2, "h2", vec![seg(0, Tier::Dram, 64 * MIB)]);
        r.held = vec![held("k", 7, 0, 0)];
        r
    };
    let mut outcomes = Vec::new();
    for order in [[node1(), node2()], [node2(), node1()]] {
        let mut d = Directory::new(cfg()).unwrap();
        let mut fx = Vec::new();
        let mut conflicts = Vec::new();
        for r in &order {
            conflicts.extend(d.register_node(r, 0, &mut fx).unwrap().conflicts);
        }
        conflicts.sort_by(|a, b| a.key.cmp(&b.key));
        let reasons: Vec<(String, ConflictReason)> =
            conflicts.iter().map(|c| (c.key.clone(), c.reason)).collect();
        assert_eq!(
            reasons,
            vec![
                ("badseg".into(), ConflictReason::UnknownSegment),
                ("k".into(), ConflictReason::Superseded),
                ("overlap".into(), ConflictReason::Overlap),
            ]
        );
        assert_eq!(fx.len(), 3, "each refused replica gets a Drop");
        assert!(d.stat("k2").is_ok());
        let view = d.stat("k").unwrap();
        assert_eq!((view.version, nodes_of(&view)), (7, vec![NodeId(2)]));
        d.verify().unwrap();
        outcomes.push(d.list("", None, 10).unwrap());
    }
    assert_eq!(outcomes[0], outcomes[1]);
}

#[test]
fn node_restart_keeps_what_it_reports_and_loses_the_rest() {
    let mut d = cluster(1, 64 * MIB);
    let mut commits = Vec::new();
    for i in 0..4 {
        commits.extend(put(&mut d, &key(i), MIB, 0));
    }
    d.get(&key(0), 100).unwrap();
    let mut r = reg(1, "host1", vec![seg(0, Tier::Dram, 64 * MIB)]);
    r.held = held_from(&commits, NodeId(1));
    r.held.truncate(2); // DRAM lost except two objects
    let mut fx = Vec::new();
    let out = d.register_node(&r, 200, &mut fx).unwrap();
    assert_eq!(out.adopted, 2);
    let mut lost: Vec<String> = out.lost_keys.iter().map(|k| k.to_string()).collect();
    lost.sort();
    let mut want = vec![key(2), key(3)];
    want.sort();
    assert_eq!(lost, want);
    assert_eq!(
        d.stat(&key(0)).unwrap().lease_end_ms,
        10_100,
        "re-reported objects keep their lease"
    );
    d.verify().unwrap();
}

#[test]
fn a_put_racing_with_recovery_loses_to_the_adopted_object() {
    let mut d = cluster(1, 64 * MIB);
    let mut fx = Vec::new();
    d.put_start(&PutStart::new("k", MIB), 0, &mut fx).unwrap();
    let mut r = reg(2, "h2", vec![seg(0, Tier::Dram, 64 * MIB)]);
    r.held = vec![HeldObject {
        key: "k".into(),
        size: 2 * MIB,
        checksum: None,
        version: 1,
        segment: 0,
        offset: 0,
        tier: Tier::Dram,
        persistence: Persistence::None,
        pin: Pin::None,
        persisted: false,
        renamed_from: None,
    }];
    d.register_node(&r, 1, &mut fx).unwrap();
    assert_eq!(kind(d.put_end(&PutEnd::new("k", None), 2, &mut fx)), ErrorKind::AlreadyExists);
    assert_eq!(d.stat("k").unwrap().size, 2 * MIB);
    d.verify().unwrap();
}

#[test]
fn stats_count_tiers_and_metadata_per_object() {
    let mut d = cluster(2, 1 << 40);
    let mut fx = Vec::new();
    let n = 20_000;
    for i in 0..n {
        let k = format!("{}{:064x}", "r".repeat((i % 37) as usize), i);
        put(&mut d, &k, 64 << 10, 0);
    }
    d.put_start(&PutStart::new("p", 1), 0, &mut fx).unwrap();
    let s = d.stats();
    assert_eq!((s.objects, s.pending_puts, s.nodes, s.segments), (n, 1, 2, 2));
    let dram = s.tiers[Tier::Dram.index()];
    assert_eq!((dram.replicas, dram.bytes), (n, n * (64 << 10)));
    assert_eq!(dram.capacity_bytes, 2 << 40);
    assert_eq!(dram.used_bytes, n * (64 << 10) + 4096);
    assert!(s.metadata_bytes_per_object < 300.0, "{} bytes/object", s.metadata_bytes_per_object);
    assert!(s.metadata_bytes_per_object > 150.0, "{} bytes/object", s.metadata_bytes_per_object);
}

#[test]
fn a_disconnected_node_gets_no_replicas_and_goes_after_its_grace() {
    let c = Config { node_ttl_ms: 10_000, disconnect_grace_ms: 2_000, ..cfg() };
    let mut d = cluster_with(c, 2, 64 * MIB);
    let mut on2 = PutStart::new("on2", MIB);
    on2.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &on2, 0).unwrap();
    d.node_disconnected(NodeId(2), 100);
    d.node_disconnected(NodeId(99), 100); // unknown: ignored
    for i in 0..200 {
        let mut req = PutStart::new(key(i), MIB / 4);
        req.replicas = 2;
        if i % 2 == 0 {
            req.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
        }
        put_with(&mut d, &req, 100 + i).unwrap();
        assert_eq!(nodes_of(&d.stat(&key(i)).unwrap()), vec![NodeId(1)], "never on node 2");
    }
    assert_eq!(nodes_of(&d.stat("on2").unwrap()), vec![NodeId(2)], "still readable in the grace");
    assert_eq!(d.expire(2_100).nodes, vec![], "exactly at the grace");
    let loss = d.expire(2_101);
    assert_eq!(loss.nodes, vec![NodeId(2)]);
    assert_eq!(loss.lost_keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(), vec!["on2"]);

    // A node that registers again within its grace is placed on again and is not removed.
    let mut d = cluster_with(Config { disconnect_grace_ms: 2_000, ..cfg() }, 2, 64 * MIB);
    d.node_disconnected(NodeId(2), 0);
    let r = reg(2, "host2", vec![seg(0, Tier::Dram, 64 * MIB)]);
    d.register_node(&r, 500, &mut Vec::new()).unwrap();
    assert_eq!(d.expire(5_000).nodes, vec![]);
    let mut req = PutStart::new("back", MIB);
    req.preferred_segments = vec![SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &req, 5_000).unwrap();
    assert_eq!(nodes_of(&d.stat("back").unwrap()), vec![NodeId(2)]);
    d.verify().unwrap();
}

#[test]
fn clear_replicas_drops_one_nodes_copies_or_the_whole_object() {
    let mut d = cluster(3, 64 * MIB);
    let ttl = cfg().lease_ttl_ms;
    put(&mut d, "fresh", MIB, 0);
    assert_eq!(kind(d.clear_replicas("fresh", None, ttl - 1, &mut Vec::new())), ErrorKind::Leased);
    let mut two = PutStart::new("two", MIB);
    two.replicas = 2;
    two.preferred_segments =
        vec![SegmentRef { node: NodeId(1), index: 0 }, SegmentRef { node: NodeId(2), index: 0 }];
    put_with(&mut d, &two, 0).unwrap();
    let mut fx = Vec::new();
    d.get("two", ttl).unwrap(); // a read lease until 2 * lease_ttl_ms
    assert_eq!(kind(d.clear_replicas("two", Some(NodeId(1)), ttl + 1, &mut fx)), ErrorKind::Leased);
    let later = 2 * ttl + 1;
    assert!(!d.clear_replicas("two", Some(NodeId(3)), later, &mut fx).unwrap(), "none there");
    assert!(d.clear_replicas("two", Some(NodeId(1)), later, &mut fx).unwrap());
    assert_eq!(drops(&fx), vec!["two"]);
    assert_eq!(nodes_of(&d.stat("two").unwrap()), vec![NodeId(2)], "the other copy stays");
    assert!(d.clear_replicas("two", Some(NodeId(2)), later, &mut fx).unwrap());
    assert_eq!(kind(d.stat("two")), ErrorKind::NotFound, "the last copy takes the object");
    assert!(d.clear_replicas("fresh", None, later, &mut fx).unwrap());
    assert_eq!(kind(d.stat("fresh")), ErrorKind::NotFound);
    assert_eq!(kind(d.clear_replicas("fresh", None, later, &mut fx)), ErrorKind::NotFound);
    d.verify().unwrap();
}

// ----- rename and unlink ---------------------------------------------------------------------

fn renames(fx: &[NodeEffect]) -> Vec<(NodeId, String, String)> {
    let mut v: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            NodeEffect::Rename { node, from, to, .. } => {
                Some((*node, from.to_string(), to.to_string()))
            }
            _ => None,
        })
        .collect();
    v.sort();
    v
}

#[test]
fn rename_moves_the_name_not_the_bytes() {
    let mut d = cluster(2, 64 * MIB);
    let mut req = PutStart::new("a", MIB);
    req.replicas = 2;
    put_with(&mut d, &req, 100).unwrap();
    let before = d.stat("a").unwrap();
    let mut fx = Vec::new();
    let r = d.rename("a", "b", RenameMode::Replace, 200, &mut fx).unwrap();
    assert_eq!(r.from_version, before.version);
    assert!(r.version > before.version, "a renamed object is a new version");
    assert_eq!(kind(d.stat("a")), ErrorKind::NotFound);
    let after = d.stat("b").unwrap();
    assert_eq!(
        (after.replicas.clone(), after.size, after.checksum),
        (before.replicas, MIB, Some([7; 32]))
    );
    assert_eq!(
        renames(&fx),
        vec![(NodeId(1), "a".into(), "b".into()), (NodeId(2), "a".into(), "b".into())]
    );
    assert!(drops(&fx).is_empty(), "no byte moves and nothing is freed");
    assert_eq!(d.list("", None, 10).unwrap().entries.len(), 1);
    // renaming onto itself changes nothing; a missing source is NotFound
    let same = d.rename("b", "b", RenameMode::Replace, 300, &mut fx).unwrap();
    assert_eq!(same.version, r.version);
    assert_eq!(kind(d.rename("a", "c", RenameMode::Replace, 300, &mut fx)), ErrorKind::NotFound);
    d.verify().unwrap();
}

#[test]
fn rename_over_a_leased_object_keeps_its_ranges_for_the_readers() {
    let mut d = cluster(1, 64 * MIB);
    put(&mut d, "tmp", MIB, 0);
    put(&mut d, "final", MIB, 0);
    let mut fx = Vec::new();
    assert_eq!(
        kind(d.rename("tmp", "final", RenameMode::NoReplace, 50, &mut fx)),
        ErrorKind::AlreadyExists
    );
    d.get("final", 100).unwrap(); // lease until 10_100
    d.rename("tmp", "final", RenameMode::Replace, 200, &mut fx).unwrap();
    // The replaced object's name goes now (its node forgets it); its range stays while leased.
    assert_eq!(leased_drops(&fx), vec![("final".to_string(), 10_100)]);
    fx.retain(|e| !matches!(e, NodeEffect::Drop { .. }));
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, 2 * MIB);
    assert_eq!(d.len(), 1);
    d.verify().unwrap();
    assert_eq!(d.tick(10_100, &mut fx).released_ranges, 1);
    assert_eq!(drops(&fx), vec!["final".to_string()]);
    assert_eq!(d.stats().tiers[Tier::Dram.index()].used_bytes, MIB);
    // a hard-pinned object is replaced too (the caller names it, as an upsert does)
    let mut req = PutStart::new("pinned", MIB);
    req.pin = Pin::Hard;
    put_with(&mut d, &req, 20_000).unwrap();
    d.rename("final", "pinned", RenameMode::Replace, 20_001, &mut fx).unwrap();
    assert_eq!(d.stat("pinned").unwrap().pin, Pin::None, "the renamed object keeps its own pin");
    // a name being put is busy
    put(&mut d, "final", MIB, 20_002);
    d.put_start(&PutStart::new("busy", MIB), 20_002, &mut fx).unwrap();
    assert_eq!(
        kind(d.rename("final", "busy", RenameMode::Replace, 20_003, &mut fx)),
        ErrorKind::PutInProgress
    );
    assert_eq!(
        kind(d.rename("busy", "x", RenameMode::Replace, 20_003, &mut fx)),
        ErrorKind::PutInProgress
    );
    d.verify().unwrap();
}

#[test]
fn unlink_takes_the_name_at_once_and_the_bytes_when_the_lease_ends() {
    let mut d = cluster(1, 64 * MIB);
    put(&mut d, "k", MIB, 0);
    let mut fx = Vec::new();
    d.get("k", 100).unwrap(); // lease until 10_100
    assert_eq!(kind(d.remove("k", false, 200, &mut fx)), ErrorKind::Leased);
    d.unlink("k", 200, &mut fx).unwrap();
    assert_eq!(kind(d.stat("k")), ErrorKind::NotFound);
    assert_eq!(leased_drops(&fx), vec![("k".to_string(), 10_100)], "the node forgets it now");
    fx.clear();
    // the name is free again at once
    put(&mut d, "k", MIB, 300);
    d.verify().unwrap();
    d.tick(10_100, &mut fx);
    assert_eq!(drops(&fx), vec!["k".to_string()]);
    assert_eq!(d.stat("k").unwrap().size, MIB, "the new object is untouched");
    let mut req = PutStart::new("hard", MIB);
    req.pin = Pin::Hard;
    put_with(&mut d, &req, 20_000).unwrap();
    assert_eq!(kind(d.unlink("hard", 20_001, &mut fx)), ErrorKind::Pinned);
    d.verify().unwrap();
}

/// What node `n` holds after applying the Commit effects and, if `renamed`, the Rename ones.
fn held_after(fx: &[NodeEffect], n: NodeId, renamed: bool) -> Vec<HeldObject> {
    let mut held = held_from(fx, n);
    if renamed {
        for e in fx {
            if let NodeEffect::Rename { node, from, to, from_version, version } = e
                && *node == n
            {
                for h in held.iter_mut().filter(|h| *h.key == **from && h.version == *from_version)
                {
                    h.key = to.to_string();
                    h.version = *version;
                    h.renamed_from = Some((from.to_string(), *from_version));
                }
            }
        }
    }
    held
}

#[test]
fn a_rename_the_master_died_in_leaves_one_name_whatever_the_order_of_reports() {
    let mut d = cluster(2, 64 * MIB);
    let mut fx = Vec::new();
    let mut req = PutStart::new("tmp", MIB);
    req.replicas = 2;
    fx.extend(put_with(&mut d, &req, 100).unwrap());
    fx.extend(put(&mut d, "other", MIB, 100));
    d.rename("tmp", "final", RenameMode::Replace, 200, &mut fx).unwrap();
    // node 1 applied the rename before the master died, node 2 did not
    for order in [[1u64, 2], [2, 1]] {
        let mut fresh = Directory::new(cfg()).unwrap();
        let mut out_fx = Vec::new();
        for n in order {
            let mut r = reg(n, &format!("host{n}"), vec![seg(0, Tier::Dram, 64 * MIB)]);
            r.held = held_after(&fx, NodeId(n), n == 1);
            fresh.register_node(&r, 5000, &mut out_fx).unwrap();
        }
        assert_eq!(kind(fresh.stat("tmp")), ErrorKind::NotFound, "order {order:?}");
        let v = fresh.stat("final").unwrap();
        assert_eq!(nodes_of(&v), vec![NodeId(1)], "order {order:?}");
        // node 2's stale copy under the old name is dropped there
        let stale: Vec<_> = out_fx
            .iter()
            .filter(|e| matches!(e, NodeEffect::Drop { node, key, .. } if *node == NodeId(2) && &**key == "tmp"))
            .collect();
        assert_eq!(stale.len(), 1, "order {order:?}");
        assert!(fresh.stat("other").is_ok());
        fresh.verify().unwrap();
    }
    // no node applied it: the old name stays
    let mut fresh = Directory::new(cfg()).unwrap();
    for n in [1u64, 2] {
        let mut r = reg(n, &format!("host{n}"), vec![seg(0, Tier::Dram, 64 * MIB)]);
        r.held = held_after(&fx, NodeId(n), false);
        fresh.register_node(&r, 5000, &mut Vec::new()).unwrap();
    }
    assert_eq!(nodes_of(&fresh.stat("tmp").unwrap()).len(), 2);
    assert_eq!(kind(fresh.stat("final")), ErrorKind::NotFound);
    fresh.verify().unwrap();
}

#[test]
fn a_node_that_missed_a_rename_cannot_bring_the_old_name_back() {
    let mut d = cluster(2, 64 * MIB);
    let mut fx = Vec::new();
    let mut req = PutStart::new("tmp", MIB);
    req.replicas = 2;
    fx.extend(put_with(&mut d, &req, 100).unwrap());
    d.rename("tmp", "final", RenameMode::Replace, 200, &mut fx).unwrap();
    // node 2 re-registers with what it had before the rename reached it
    let mut r = reg(2, "host2", vec![seg(0, Tier::Dram, 64 * MIB)]);
    r.held = held_after(&fx, NodeId(2), false);
    let out = d.register_node(&r, 300, &mut Vec::new()).unwrap();
    assert_eq!(out.conflicts.len(), 1);
    assert_eq!(kind(d.stat("tmp")), ErrorKind::NotFound);
    assert!(d.stat("final").is_ok());
    d.verify().unwrap();
}

#[test]
fn a_tenant_over_its_quota_loses_its_own_oldest_objects_and_no_one_elses() {
    let mut d = cluster(2, 64 * MIB);
    d.set_quota("acme", Quota { memory_bytes: Some(4 * MIB), nvme_bytes: None }).unwrap();
    for i in 0..4 {
        put(&mut d, &format!("tenants/other/{i}"), MIB, 0);
        put(&mut d, &format!("plain/{i}"), MIB, 0);
    }
    // Two replicas each: 2 MiB per put, so the quota holds two objects.
    let two = |k: &str| PutStart { replicas: 2, ..PutStart::new(k, MIB) };
    for i in 0..6 {
        let fx = put_with(&mut d, &two(&format!("tenants/acme/{i}")), 1 + i).unwrap();
        let dropped = drops(&fx);
        assert!(dropped.iter().all(|k| k.starts_with("tenants/acme/")), "{dropped:?}");
        d.verify().unwrap();
    }
    let u = d.tenant("acme").unwrap();
    assert_eq!((u.memory_bytes, u.pending_memory_bytes), (4 * MIB, 0), "{u:?}");
    assert_eq!(u.quota_evicted_bytes, 8 * MIB);
    assert_eq!(kind(d.stat("tenants/acme/0")), ErrorKind::NotFound, "the oldest went");
    d.stat("tenants/acme/5").unwrap();
    assert_eq!(d.tenant("other").unwrap().memory_bytes, 4 * MIB, "other tenants keep theirs");
    for i in 0..4 {
        d.stat(&format!("tenants/other/{i}")).unwrap();
        d.stat(&format!("plain/{i}")).unwrap();
    }

    // Pending puts count: a second put while one is in flight must evict for both.
    let mut fx = Vec::new();
    d.put_start(&two("tenants/acme/p1"), 100, &mut fx).unwrap();
    assert_eq!(d.tenant("acme").unwrap().pending_memory_bytes, 2 * MIB);
    d.verify().unwrap();
    // Everything of acme's is leased or pending now: the next put is refused.
    d.get("tenants/acme/4", 100).unwrap();
    d.get("tenants/acme/5", 100).unwrap();
    let r = d.put_start(&two("tenants/acme/p2"), 100, &mut fx);
    assert_eq!(kind(r), ErrorKind::QuotaExceeded);
    assert_eq!(d.tenant("acme").unwrap().refused_puts, 1);
    // Larger than the quota on its own.
    let r = d.put_start(&PutStart::new("tenants/acme/big", 5 * MIB), 100, &mut fx);
    assert_eq!(kind(r), ErrorKind::QuotaExceeded);
    d.put_revoke("tenants/acme/p1", &mut fx).unwrap();
    assert_eq!(d.tenant("acme").unwrap().pending_memory_bytes, 0);
    d.verify().unwrap();
    // Lifting the quota lets the tenant grow; bad names are refused.
    d.set_quota("acme", Quota::default()).unwrap();
    put_with(&mut d, &PutStart::new("tenants/acme/big", 5 * MIB), 200).unwrap();
    assert_eq!(kind(d.set_quota("a/b", Quota::default())), ErrorKind::InvalidArgument);
    d.verify().unwrap();
}

#[test]
fn a_demotion_over_the_tenants_nvme_quota_is_refused_and_changes_nothing() {
    let mut d = Directory::new(cfg()).unwrap();
    let r = reg(1, "h", vec![seg(0, Tier::Dram, 64 * MIB), seg(1, Tier::Nvme, 64 * MIB)]);
    d.register_node(&r, 0, &mut Vec::new()).unwrap();
    d.set_quota("acme", Quota { memory_bytes: None, nvme_bytes: Some(MIB) }).unwrap();
    put(&mut d, "tenants/acme/a", MIB, 0);
    put(&mut d, "tenants/acme/b", MIB, 0);
    let dram = |d: &Directory, k: &str| match d.stat(k).unwrap().replicas[0].location {
        Location::Node(n) => n,
        _ => panic!("a node replica"),
    };
    let nvme =
        |offset| NodeLocation { node: NodeId(1), segment: 1, tier: Tier::Nvme, addr: 0, offset };
    let (a, b) = (dram(&d, "tenants/acme/a"), dram(&d, "tenants/acme/b"));
    let va = d.stat("tenants/acme/a").unwrap().version;
    let vb = d.stat("tenants/acme/b").unwrap().version;
    let out = d
        .report_replica(
            "tenants/acme/a",
            va,
            None,
            Some(&Location::Node(nvme(0))),
            Some(&Location::Node(a)),
            0,
        )
        .unwrap();
    assert!(out.added && out.removed);
    let r = d.report_replica(
        "tenants/acme/b",
        vb,
        None,
        Some(&Location::Node(nvme(MIB))),
        Some(&Location::Node(b)),
        0,
    );
    assert_eq!(kind(r), ErrorKind::QuotaExceeded);
    let view = d.stat("tenants/acme/b").unwrap();
    assert_eq!(view.replicas.len(), 1);
    assert_eq!(view.replicas[0].tier(), Tier::Dram, "the refused demotion left b in DRAM");
    let u = d.tenant("acme").unwrap();
    assert_eq!((u.nvme_bytes, u.memory_bytes), (MIB, MIB));
    d.verify().unwrap();
}
