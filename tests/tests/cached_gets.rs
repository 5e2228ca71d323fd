//! Gets in one round trip: a client reads a location it cached under a live lease straight
//! from the node process (a guarded read), and never reads an object that another client
//! removed, unlinked, renamed or replaced; a stale location costs one extra master round trip.

use std::time::Duration;

use kvfs_client::{Client, ErrorKind, GetInto, PutOptions, RenameMode};
use kvfs_tests::{Cluster, ClusterOpts, admin_metrics, content, free_port, metric_sum};
use kvfs_transfer::{BufferOptions, EngineConfig, Transports};

/// A client whose engine uses tcp only (a same-host client would read the node's segment over
/// shared memory, which guarded reads do not use).
async fn tcp_client(cluster: &Cluster) -> Client {
    let engine = EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() };
    Client::connect(kvfs_client::ClientConfig { engine, ..cluster.client_config() })
        .await
        .expect("client connects")
}

fn upsert() -> PutOptions {
    PutOptions { upsert: true, ..PutOptions::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_locations_serve_repeat_gets_and_never_outlive_the_name() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let reader = tcp_client(&cluster).await;
    let writer = tcp_client(&cluster).await;
    let v1 = content(1, 4096);
    writer.put("k", &v1, &PutOptions::default()).await.unwrap();

    // First get asks the master; the next ones read the cached location.
    assert_eq!(reader.get("k").await.unwrap(), v1);
    assert_eq!(reader.location_cache_stats(), (0, 0));
    for _ in 0..3 {
        assert_eq!(reader.get("k").await.unwrap(), v1);
    }
    assert_eq!(reader.location_cache_stats(), (3, 0));

    // Another client removes it (forced: the reader holds a lease): the reader's location is
    // refused by the node, and the master says it is gone.
    writer.remove("k", true).await.unwrap();
    assert_eq!(reader.get("k").await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(reader.location_cache_stats(), (3, 1));

    // Put again under the same key: the reader reads the new bytes, never the old ones.
    let v2 = content(2, 4096);
    writer.put("k", &v2, &PutOptions::default()).await.unwrap();
    assert_eq!(reader.get("k").await.unwrap(), v2);
    assert_eq!(reader.get("k").await.unwrap(), v2);

    // Unlink under the lease.
    writer.unlink("k").await.unwrap();
    assert_eq!(reader.get("k").await.unwrap_err().kind(), ErrorKind::NotFound);

    // Rename away, and rename another object over a cached name.
    writer.put("a", &v1, &PutOptions::default()).await.unwrap();
    writer.put("b", &v2, &PutOptions::default()).await.unwrap();
    assert_eq!(reader.get("a").await.unwrap(), v1);
    assert_eq!(reader.get("b").await.unwrap(), v2);
    writer.rename("a", "c", RenameMode::NoReplace).await.unwrap();
    assert_eq!(reader.get("a").await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(reader.get("c").await.unwrap(), v1);
    writer.rename("c", "b", RenameMode::Replace).await.unwrap();
    assert_eq!(reader.get("b").await.unwrap(), v1, "the replaced object is never read");

    // A batch mixing cached, uncached and missing keys, zero-copy, and a buffer too small.
    let v3 = content(3, 100_000);
    writer.put("d", &v3, &PutOptions::default()).await.unwrap();
    let buf = reader.engine().alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let items = [
        GetInto { key: "b", addr: buf.addr(), cap: 4096 },
        GetInto { key: "d", addr: buf.addr() + 4096, cap: 200_000 },
        GetInto { key: "missing", addr: buf.addr() + 300_000, cap: 4096 },
    ];
    for _ in 0..2 {
        let r = reader.get_into_batch(&items).await;
        assert_eq!(r[0].as_ref().unwrap(), &4096);
        assert_eq!(r[1].as_ref().unwrap(), &100_000);
        assert_eq!(r[2].as_ref().unwrap_err().kind(), ErrorKind::NotFound);
        // SAFETY: the reads above have completed; nothing else writes the buffer.
        let got = unsafe { buf.as_slice() };
        assert_eq!(&got[..4096], &v1[..]);
        assert_eq!(&got[4096..104_096], &v3[..]);
    }
    let small = reader.get_into("d", buf.addr(), 1000).await.unwrap_err();
    assert_eq!(small.kind(), ErrorKind::BufferTooSmall);
    // A replaced object that now fits a buffer its cached size did not: the master decides.
    assert_eq!(reader.get("d").await.unwrap(), v3);
    assert_eq!(reader.get("d").await.unwrap(), v3);
    writer.remove("d", true).await.unwrap();
    let v5 = content(5, 50_000);
    writer.put("d", &v5, &PutOptions::default()).await.unwrap();
    assert_eq!(reader.get_into("d", buf.addr(), 60_000).await.unwrap(), 50_000);
    // SAFETY: the read above has completed.
    assert_eq!(unsafe { &buf.as_slice()[..50_000] }, &v5[..]);
    writer.remove("d", true).await.unwrap();
    writer.put("d", &v3, &PutOptions::default()).await.unwrap();
    assert_eq!(reader.get("d").await.unwrap(), v3);

    // An upsert is refused while a read lease protects the object, as before.
    let v4 = content(4, 50_000);
    assert_eq!(writer.put("d", &v4, &upsert()).await.unwrap_err().kind(), ErrorKind::Leased);
    assert_eq!(reader.get("d").await.unwrap(), v3);
    let (hits, stale) = reader.location_cache_stats();
    assert!(hits >= 6, "cached reads were used: {hits}");
    assert!(stale >= 3, "stale locations were refused: {stale}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_fails_a_cached_get_within_the_timeout() {
    let mut o = ClusterOpts { nodes: 2, ..ClusterOpts::default() };
    o.master_args.extend(["--lease-ttl-ms".to_string(), "60000".to_string()]);
    let mut cluster = Cluster::start(o).await;
    let reader = tcp_client(&cluster).await;
    let v = content(5, 8192);
    let two = PutOptions { replicas: 2, ..PutOptions::default() };
    reader.put("k", &v, &two).await.unwrap();
    assert_eq!(reader.get("k").await.unwrap(), v);
    assert_eq!(reader.get("k").await.unwrap(), v);
    assert_eq!(reader.location_cache_stats().0, 1);
    // Kill both nodes: a cached get must not hang, and must not return bytes.
    cluster.kill_nodes();
    let r = tokio::time::timeout(Duration::from_secs(60), reader.get("k")).await;
    assert!(r.expect("no hang").is_err());
}

/// A batch of many cached objects on one node (more than one guarded pack holds): every
/// object read byte for byte from the cache, and after another client removes some and
/// replaces others, the next batch never returns a removed or replaced object's old bytes
/// (the node refuses those ranges one by one and the master is asked), while the untouched
/// ones still come from the cache. The cached round reaches the node as two guarded packs
/// (the node's request counters, through the master's /metrics; the packs' layout is tested
/// in `kvfs-transfer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_batches_read_from_the_node_and_refuse_what_changed() {
    let admin = format!("127.0.0.1:{}", free_port());
    let cluster =
        Cluster::start(ClusterOpts { nodes: 1, admin: admin.clone(), ..ClusterOpts::default() })
            .await;
    let reader = tcp_client(&cluster).await;
    let writer = tcp_client(&cluster).await;
    const N: usize = 300; // more than one pack holds
    let keys: Vec<String> = (0..N).map(|i| format!("batch/{i}")).collect();
    let values: Vec<Vec<u8>> = (0..N).map(|i| content(i as u64, 4096 + i * 16)).collect();
    let items: Vec<(&str, &[u8])> =
        keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in writer.put_batch(&items, &PutOptions::default()).await {
        r.unwrap();
    }
    // The first batch asks the master and caches every location; the second reads them all
    // from the node.
    for round in 0..2 {
        let got = reader.get_batch(&keys).await;
        for (i, r) in got.into_iter().enumerate() {
            assert_eq!(r.unwrap(), values[i], "round {round} item {i}");
        }
    }
    assert_eq!(reader.location_cache_stats(), (N as u64, 0));
    // The node served the cached round as two guarded packs (256 objects, then 44), not one
    // guarded read per object; its heartbeats bring the counts to the master's /metrics.
    let served = |op: &str| {
        let text = admin_metrics(&admin);
        metric_sum(&text, "kvfs_node_te_requests_total", &format!("op=\"{op}\""))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while served("read_guarded_v") < 2 {
        assert!(std::time::Instant::now() < deadline, "{}", admin_metrics(&admin));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(served("read_guarded_v"), 2);
    assert_eq!(served("read_guarded"), 0);

    // Remove every tenth object, replace every tenth-plus-five with new bytes.
    let mut expect: Vec<Option<Vec<u8>>> = values.iter().cloned().map(Some).collect();
    for i in (0..N).step_by(10) {
        writer.remove(&keys[i], true).await.unwrap();
        expect[i] = None;
    }
    for i in (5..N).step_by(10) {
        writer.remove(&keys[i], true).await.unwrap();
        let v = content(10_000 + i as u64, 4096 + i * 16);
        writer.put(&keys[i], &v, &PutOptions::default()).await.unwrap();
        expect[i] = Some(v);
    }
    let got = reader.get_batch(&keys).await;
    for (i, r) in got.into_iter().enumerate() {
        match &expect[i] {
            Some(v) => assert_eq!(&r.unwrap(), v, "item {i}"),
            None => assert_eq!(r.unwrap_err().kind(), ErrorKind::NotFound, "item {i}"),
        }
    }
    let (hits, stale) = reader.location_cache_stats();
    assert_eq!(stale, (N / 5) as u64, "removed and replaced ones refused by the node");
    assert_eq!(hits, (2 * N - N / 5) as u64, "the untouched ones read from the cache");
}
