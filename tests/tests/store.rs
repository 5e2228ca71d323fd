//! The store with a master and three node processes on loopback: bytes, replicas, node and
//! master failures, first-writer-wins, leases, eviction and bad input.

use std::sync::Arc;
use std::time::Duration;

use kvfs_client::{Client, ErrorKind, GetInto, Pin, PutFrom, PutOptions};
use kvfs_tests::{Cluster, ClusterOpts, content};
use kvfs_transfer::{BufferOptions, EngineConfig, Transports};

fn opts() -> PutOptions {
    PutOptions::default()
}

fn replicas(n: u8) -> PutOptions {
    PutOptions { replicas: n, ..PutOptions::default() }
}

const SIZES: [usize; 9] =
    [1, 4095, 4096, 65_536, 1 << 20, (1 << 20) + 3, 16 << 20, 40 << 20, 64 << 20];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_and_gets_of_every_size_are_byte_exact() {
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client().await;
    // Bytes API, one object at a time and as a batch.
    for (i, &size) in SIZES.iter().enumerate() {
        let v = content(i as u64, size);
        c.put(&format!("bytes/{size}"), &v, &replicas(2)).await.unwrap();
        let got = c.get(&format!("bytes/{size}")).await.unwrap();
        assert_eq!(blake3::hash(&got), blake3::hash(&v), "size {size}");
        assert_eq!(c.stat(&format!("bytes/{size}")).await.unwrap().replicas.len(), 2);
    }
    let vals: Vec<Vec<u8>> = (0..16).map(|i| content(100 + i, 1000 * (i as usize + 1))).collect();
    let keys: Vec<String> = (0..16).map(|i| format!("batch/{i}")).collect();
    let items: Vec<(&str, &[u8])> =
        keys.iter().map(|k| k.as_str()).zip(vals.iter().map(|v| v.as_slice())).collect();
    assert!(c.put_batch(&items, &opts()).await.iter().all(|r| r.is_ok()));
    let got = c.get_batch(&keys).await;
    for (g, v) in got.iter().zip(&vals) {
        assert_eq!(g.as_ref().unwrap(), v);
    }
    // Zero-copy API from and into registered buffers, batched.
    let src = c.engine().alloc_buffer(160 << 20, &BufferOptions::default()).unwrap();
    let dst = c.engine().alloc_buffer(160 << 20, &BufferOptions::default()).unwrap();
    let mut off = 0u64;
    let mut puts = Vec::new();
    let zkeys: Vec<String> = SIZES.iter().map(|s| format!("zero/{s}")).collect();
    for (i, &size) in SIZES.iter().enumerate() {
        src.write_at(off as usize, &content(1000 + i as u64, size)).unwrap();
        puts.push(PutFrom { key: &zkeys[i], addr: src.addr() + off, len: size as u64 });
        off += size as u64;
    }
    assert!(c.put_from_batch(&puts, &opts()).await.iter().all(|r| r.is_ok()));
    let gets: Vec<GetInto> = puts
        .iter()
        .map(|p| GetInto { key: p.key, addr: dst.addr() + (p.addr - src.addr()), cap: p.len })
        .collect();
    let sizes = c.get_into_batch(&gets).await;
    for (p, s) in puts.iter().zip(&sizes) {
        assert_eq!(*s.as_ref().unwrap(), p.len);
    }
    // SAFETY: all transfers have completed.
    let (a, b) = unsafe { (&src.as_slice()[..off as usize], &dst.as_slice()[..off as usize]) };
    assert_eq!(blake3::hash(a), blake3::hash(b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_object_survives_a_killed_node_with_two_replicas() {
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client().await;
    let n = 60;
    for i in 0..n {
        c.put(&format!("r2/{i}"), &content(i, 200_000 + i as usize), &replicas(2)).await.unwrap();
    }
    cluster.kill_node(1);
    // Right away (the master still lists the dead replicas: reads fall back) and after the
    // node's TTL (the master dropped them).
    for round in 0..2 {
        for i in 0..n {
            let got = c
                .get(&format!("r2/{i}"))
                .await
                .unwrap_or_else(|e| panic!("round {round} r2/{i}: {e}"));
            assert_eq!(got, content(i, 200_000 + i as usize));
        }
        cluster.wait_nodes(2).await;
    }
    // New puts land on the live nodes.
    c.put("after-kill", b"still writable", &replicas(2)).await.unwrap();
    assert_eq!(c.stat("after-kill").await.unwrap().replicas.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_restart_loses_nothing_the_nodes_hold() {
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client().await;
    let n = 100;
    for i in 0..n {
        c.put(&format!("m/{i}"), &content(7 + i, 50_000), &opts()).await.unwrap();
    }
    cluster.kill_master();
    cluster.start_master();
    cluster.wait_nodes(3).await;
    // The same client reconnects by itself.
    for i in 0..n {
        let got = c.get(&format!("m/{i}")).await.unwrap_or_else(|e| panic!("m/{i}: {e}"));
        assert_eq!(got, content(7 + i, 50_000));
    }
    assert_eq!(c.stats().await.unwrap().objects, n);
    // Puts resume after the recovery grace (the client waits it out by itself).
    c.put("after-restart", b"x", &opts()).await.unwrap();
    // First writer still wins over the rebuilt directory.
    c.put("m/0", b"other value", &opts()).await.unwrap();
    assert_eq!(c.get("m/0").await.unwrap(), content(7, 50_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_of_one_key_have_exactly_one_winner() {
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let writers = 8;
    let size = 3 << 20;
    let mut clients = Vec::new();
    for _ in 0..writers {
        clients.push(cluster.client().await);
    }
    let candidates: Vec<blake3::Hash> =
        (0..writers).map(|w| blake3::hash(&content(w as u64, size))).collect();
    let reader = cluster.client().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let read_task = {
        let stop = stop.clone();
        let candidates = candidates.clone();
        tokio::spawn(async move {
            let mut seen = std::collections::HashSet::new();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match reader.get("contended").await {
                    Ok(v) => {
                        let h = blake3::hash(&v);
                        assert!(candidates.contains(&h), "a reader saw bytes no writer wrote");
                        seen.insert(h);
                    }
                    Err(e) => assert_eq!(e.kind(), ErrorKind::NotFound, "{e}"),
                }
            }
            seen
        })
    };
    let mut tasks = Vec::new();
    for (w, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            c.put("contended", &content(w as u64, size), &opts()).await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("every writer is told success (first writer wins)");
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    let seen = read_task.await.unwrap();
    assert!(seen.len() <= 1, "readers saw {} different values", seen.len());
    let c = cluster.client().await;
    let final_hash = blake3::hash(&c.get("contended").await.unwrap());
    assert!(candidates.contains(&final_hash));
    if let Some(h) = seen.iter().next() {
        assert_eq!(*h, final_hash, "the value readers saw is the one that stayed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_block_plain_remove_until_they_end() {
    let mut o = ClusterOpts { nodes: 1, ..ClusterOpts::default() };
    o.master_args.extend(["--lease-ttl-ms".to_string(), "1500".to_string()]);
    let cluster = Cluster::start(o).await;
    let c = cluster.client().await;
    c.put("leased", b"value", &opts()).await.unwrap();
    c.get("leased").await.unwrap();
    assert_eq!(c.remove("leased", false).await.unwrap_err().kind(), ErrorKind::Leased);
    assert!(c.exists("leased").await.unwrap());
    // exists() also grants a lease, so wait a whole TTL after the last one.
    tokio::time::sleep(Duration::from_millis(1700)).await;
    c.remove("leased", false).await.unwrap();
    assert!(!c.exists("leased").await.unwrap());
    // force ignores the lease.
    c.put("forced", b"value", &opts()).await.unwrap();
    c.get("forced").await.unwrap();
    c.remove("forced", true).await.unwrap();
    assert_eq!(c.get("forced").await.unwrap_err().kind(), ErrorKind::NotFound);
    // Hard pins refuse plain removal, and regex/all removals count what they skipped.
    c.put("pinned", b"v", &PutOptions { pin: Pin::Hard, ..opts() }).await.unwrap();
    assert_eq!(c.remove("pinned", false).await.unwrap_err().kind(), ErrorKind::Pinned);
    let counts = c.remove_all(false).await.unwrap();
    assert_eq!(counts.skipped_pinned, 1);
    c.remove("pinned", true).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_frees_space_but_never_takes_leased_or_hard_pinned_objects() {
    let mut o = ClusterOpts { nodes: 1, dram: "64MiB".into(), ..ClusterOpts::default() };
    o.master_args.extend(["--lease-ttl-ms".to_string(), "60000".to_string()]);
    let cluster = Cluster::start(o).await;
    let c = cluster.client().await;
    let mb = 1 << 20;
    c.put("hard", &content(1, mb), &PutOptions { pin: Pin::Hard, ..opts() }).await.unwrap();
    c.put("leased", &content(2, mb), &opts()).await.unwrap();
    c.get("leased").await.unwrap(); // lease for a minute
    // Three times the segment's capacity: every put must still succeed.
    for i in 0..192 {
        c.put(&format!("fill/{i}"), &content(100 + i, mb), &opts())
            .await
            .unwrap_or_else(|e| panic!("fill/{i}: {e}"));
    }
    assert_eq!(c.get("hard").await.unwrap(), content(1, mb));
    assert_eq!(c.get("leased").await.unwrap(), content(2, mb));
    let missing = c.exists_batch(&(0..192).map(|i| format!("fill/{i}")).collect::<Vec<_>>()).await;
    let evicted = missing.iter().filter(|r| !*r.as_ref().unwrap()).count();
    assert!(evicted >= 192 - 64, "only {evicted} objects were evicted from a 64 MiB segment");
    // Least recently used first: the oldest fills are gone, the newest are there.
    assert!(!c.exists("fill/0").await.unwrap());
    assert_eq!(c.get("fill/191").await.unwrap(), content(291, mb));
    let s = c.stats().await.unwrap();
    let dram = s.tiers.iter().find(|t| t.tier == kvfs_client::Tier::Dram).unwrap();
    assert!(dram.used_bytes <= dram.capacity_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_out_of_range_requests_get_typed_errors() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    let kind = |r: kvfs_client::Result<()>| r.unwrap_err().kind();
    assert_eq!(kind(c.put("", b"x", &opts()).await), ErrorKind::InvalidKey);
    assert_eq!(kind(c.put(&"k".repeat(5000), b"x", &opts()).await), ErrorKind::InvalidKey);
    assert_eq!(
        kind(c.put("zero-replicas", b"x", &PutOptions { replicas: 0, ..opts() }).await),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        kind(c.put("many-replicas", b"x", &PutOptions { replicas: 200, ..opts() }).await),
        ErrorKind::TooLarge
    );
    // Larger than the node can ever hold.
    let huge = c
        .engine()
        .alloc_buffer(300 << 20, &BufferOptions { huge_pages: false, ..Default::default() })
        .unwrap();
    assert_eq!(kind(c.put_from("huge", huge.addr(), 300 << 20, &opts()).await), ErrorKind::NoSpace);
    // Zero-copy misuse.
    c.put("small", &content(5, 10_000), &opts()).await.unwrap();
    let buf = c.engine().alloc_buffer(4096, &BufferOptions::default()).unwrap();
    assert_eq!(
        c.get_into("small", buf.addr(), 4096).await.unwrap_err().kind(),
        ErrorKind::BufferTooSmall
    );
    let stray = vec![0u8; 20_000];
    let r = c.get_into("small", stray.as_ptr() as u64, 20_000).await;
    assert_eq!(r.unwrap_err().kind(), ErrorKind::NotRegistered);
    assert_eq!(
        kind(c.put_from("unregistered", stray.as_ptr() as u64, 100, &opts()).await),
        ErrorKind::NotRegistered
    );
    assert_eq!(c.get("missing").await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(kind(c.remove("missing", false).await), ErrorKind::NotFound);
    assert_eq!(
        c.remove_regex("(unclosed", false).await.unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // Garbage on the master's port: the master closes that connection and keeps serving.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(&cluster.master_addr).await.unwrap();
    s.write_all(&[0xff; 64]).await.unwrap();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "the master kept a garbage connection open");
    let mut s = tokio::net::TcpStream::connect(&cluster.master_addr).await.unwrap();
    // A frame that claims 4 GiB: refused before any allocation.
    s.write_all(&[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0, 0, 0, 0, 0, 0]).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;
    assert!(closed.is_ok());
    assert_eq!(c.get("small").await.unwrap(), content(5, 10_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_pages_and_directories() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let c: Client = cluster.client().await;
    let keys: Vec<String> =
        (0..250).map(|i| format!("model/layer{:02}/block{i:03}", i % 10)).collect();
    let vals: Vec<Vec<u8>> = keys.iter().map(|_| b"v".to_vec()).collect();
    let items: Vec<(&str, &[u8])> =
        keys.iter().map(|k| k.as_str()).zip(vals.iter().map(|v| v.as_slice())).collect();
    assert!(c.put_batch(&items, &opts()).await.iter().all(|r| r.is_ok()));
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = c.list("model/", after.as_deref(), 64).await.unwrap();
        assert!(page.entries.len() <= 64);
        all.extend(page.entries.into_iter().map(|e| e.key));
        match page.next_start_after {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let mut expect = keys.clone();
    expect.sort();
    assert_eq!(all, expect);
    let top = c.list_dir("model/", None, 100).await.unwrap();
    assert_eq!(top.entries.len(), 10, "{:?}", top.entries);
    assert!(top.entries.iter().all(|e| matches!(e, kvfs_client::DirEntry::Dir { .. })));
    let exists = c.exists_batch(&keys).await;
    assert!(exists.iter().all(|r| *r.as_ref().unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_right_after_a_node_is_killed_all_land_on_live_nodes() {
    let mut cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client().await;
    // Warm connections to every node, so the client holds a handle of the one that dies.
    for i in 0..30 {
        c.put(&format!("warm/{i}"), &content(i, 4096), &opts()).await.unwrap();
    }
    cluster.kill_node(0);
    // At once, well inside the node TTL: no put may fail or be lost because of the dead
    // segment (the master stops placing there when the node's connection closes, and a put
    // that was already placed there is placed again).
    let vals: Vec<Vec<u8>> = (0..200).map(|i| content(500 + i, 10_000 + i as usize)).collect();
    let keys: Vec<String> = (0..200).map(|i| format!("after/{i}")).collect();
    let items: Vec<(&str, &[u8])> =
        keys.iter().map(|k| k.as_str()).zip(vals.iter().map(|v| v.as_slice())).collect();
    for (k, r) in keys.iter().zip(c.put_batch(&items, &opts()).await) {
        r.unwrap_or_else(|e| panic!("{k}: {e}"));
    }
    for i in 0..50 {
        c.put(&format!("single/{i}"), &content(i, 3000), &opts()).await.unwrap();
    }
    for (k, v) in keys.iter().zip(&vals) {
        assert_eq!(&c.get(k).await.unwrap(), v, "{k}");
        assert_eq!(c.stat(k).await.unwrap().replicas.len(), 1);
    }
    cluster.wait_nodes(2).await;
}

/// A Rust `put` of a large `&[u8]` writes straight from the caller's slice; a put whose future
/// is dropped midway (a timeout around it) must not return before every transfer it started
/// has let go of that slice, since the caller frees it right after (an unmapped source under a
/// shared-memory copy would crash the process, and under a socket write it would send garbage),
/// and its wait must not stall the runtime the transfers run on (several dropped at once, over
/// shared memory and over tcp). Whatever was committed reads back exact, and the clients keep
/// working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_dropped_midway_never_outlives_the_callers_bytes() {
    let cluster =
        Cluster::start(ClusterOpts { nodes: 1, dram: "2GiB".into(), ..ClusterOpts::default() })
            .await;
    let shm = cluster.client().await;
    let engine = EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() };
    let tcp = Client::connect(kvfs_client::ClientConfig { engine, ..cluster.client_config() })
        .await
        .unwrap();
    // Above glibc's largest mmap threshold (32 MiB), so a freed value is unmapped at once.
    let size = 40 << 20;
    let delays_us = [20u64, 100, 400, 1_500, 5_000];
    let seed = |c: usize, i: usize| 7_000 + (c * 100 + i) as u64;
    for (ci, c) in [&shm, &tcp].into_iter().enumerate() {
        for (i, &us) in delays_us.iter().enumerate() {
            // Two puts dropped at the same moment, on a runtime of two workers.
            let (a, b) = (content(seed(ci, i), size), content(seed(ci, i) + 50, size));
            let (ka, kb) = (format!("dropped/{ci}/{i}/a"), format!("dropped/{ci}/{i}/b"));
            let o = opts();
            let both = async { tokio::join!(c.put(&ka, &a, &o), c.put(&kb, &b, &o)) };
            let _ = tokio::time::timeout(Duration::from_micros(us), both).await;
            drop((a, b));
        }
    }
    for (ci, c) in [&shm, &tcp].into_iter().enumerate() {
        for i in 0..delays_us.len() {
            for (part, s) in [("a", seed(ci, i)), ("b", seed(ci, i) + 50)] {
                if let Ok(got) = c.get(&format!("dropped/{ci}/{i}/{part}")).await {
                    assert_eq!(blake3::hash(&got), blake3::hash(&content(s, size)));
                }
            }
        }
        let after = content(7_900 + ci as u64, size);
        let key = format!("dropped/after/{ci}");
        c.put(&key, &after, &opts()).await.unwrap();
        assert_eq!(blake3::hash(&c.get(&key).await.unwrap()), blake3::hash(&after));
    }
}

/// On a current-thread runtime the socket writers run on the caller's own thread, so a dropped
/// put could not wait for them there: large values are staged instead, and a put dropped midway
/// leaves the client working.
#[tokio::test(flavor = "current_thread")]
async fn a_put_dropped_midway_on_a_current_thread_runtime_does_not_stall_it() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let engine = EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() };
    let c = Client::connect(kvfs_client::ClientConfig { engine, ..cluster.client_config() })
        .await
        .unwrap();
    let size = 40 << 20;
    for (i, us) in [100u64, 1_000, 5_000].into_iter().enumerate() {
        let v = content(8_000 + i as u64, size);
        let _ =
            tokio::time::timeout(Duration::from_micros(us), c.put(&format!("ct/{i}"), &v, &opts()))
                .await;
    }
    let after = content(8_100, size);
    c.put("ct/after", &after, &opts()).await.unwrap();
    assert_eq!(blake3::hash(&c.get("ct/after").await.unwrap()), blake3::hash(&after));
}
