//! Puts into a node of the writer's own process (`Node::client`, as the Python
//! package runs a store that contributes a segment): the writer records the commit in its node
//! before `PutEnd`, the master sends that node no record, and the node's index still ends up
//! exactly what the master completed, so a master restart loses nothing. The master's drops
//! name the version they mean: a drop of a range's previous object that reaches the node after
//! the writer's newer commit of the same key in the same range leaves the new one alone.

use std::time::Duration;

use kvfs_client::{Client, ErrorKind, PutOptions};
use kvfs_node::{Node, NodeConfig};
use kvfs_tests::{Cluster, ClusterOpts, content};
use kvfs_transfer::{EngineConfig, Transports};

async fn embedded(cluster: &Cluster) -> (Node, Client) {
    let node = Node::start(NodeConfig {
        master: cluster.master_addr.clone(),
        dram_bytes: 64 << 20,
        populate: false,
        ..NodeConfig::default()
    })
    .await
    .expect("node starts");
    node.wait_registered(Duration::from_secs(30)).await.expect("node registers");
    let client = node.client(cluster.client_config()).await.expect("connects");
    (node, client)
}

/// A reader in another engine, over tcp (it reads the embedded node's segment remotely).
async fn tcp_reader(cluster: &Cluster) -> Client {
    let engine = EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() };
    Client::connect(kvfs_client::ClientConfig { engine, ..cluster.client_config() })
        .await
        .expect("reader connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_process_commits_survive_late_drops_and_a_master_restart() {
    let mut cluster = Cluster::start(ClusterOpts { nodes: 0, ..ClusterOpts::default() }).await;
    let (node, c) = embedded(&cluster).await;
    let opts = PutOptions {
        preferred_endpoints: vec![node.endpoint().to_string()],
        ..PutOptions::default()
    };

    // Put, force-remove (its drop is queued on the master for a few milliseconds) and put the
    // same key and size again at once: the allocator hands the same range back, so the old
    // object's drop reaches the node after the writer committed the new version there.
    let rounds = 40u64;
    for r in 0..rounds {
        c.put("same", &content(r, 8192), &opts).await.unwrap();
        let got = node_replica_endpoint(&c, "same").await;
        assert_eq!(got, node.endpoint(), "round {r}: placed in the writer's own node");
        if r + 1 < rounds {
            c.remove("same", true).await.unwrap();
        }
    }
    // Distinct keys too, some of them removed.
    for i in 0..50u64 {
        c.put(&format!("k/{i}"), &content(1000 + i, 4096 + i as usize), &opts).await.unwrap();
    }
    for i in (0..50u64).step_by(5) {
        c.remove(&format!("k/{i}"), true).await.unwrap();
    }
    // Every queued drop delivered, the node holds exactly what the master completed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(node.held_objects(), 1 + 40, "the node's index is what the master completed");

    // A reader in another process's engine reads them through the node (a guarded read of a
    // cached location the second time, which the node serves only while its index holds it).
    let reader = tcp_reader(&cluster).await;
    for _ in 0..2 {
        assert_eq!(reader.get("same").await.unwrap(), content(rounds - 1, 8192));
    }
    assert_eq!(reader.location_cache_stats(), (1, 0), "the node vouched for the new version");

    // The master restarts empty and rebuilds its directory from the node's index.
    cluster.kill_master();
    cluster.start_master();
    cluster.wait_nodes(1).await;
    let fresh = tcp_reader(&cluster).await;
    assert_eq!(fresh.get("same").await.unwrap(), content(rounds - 1, 8192));
    for i in 0..50u64 {
        let r = fresh.get(&format!("k/{i}")).await;
        if i % 5 == 0 {
            assert_eq!(r.unwrap_err().kind(), ErrorKind::NotFound, "k/{i} was removed");
        } else {
            assert_eq!(r.unwrap(), content(1000 + i, 4096 + i as usize), "k/{i}");
        }
    }
    // Puts resume after the recovery grace, still committed in the writer's own node (the
    // writer's first call after the restart is a read: a put start that met the old master's
    // closed connection is not retried by the client).
    assert!(c.exists("same").await.unwrap());
    c.put("after", &content(9, 10_000), &opts).await.unwrap();
    assert_eq!(fresh.get("after").await.unwrap(), content(9, 10_000));
    node.shutdown().await;
}

async fn node_replica_endpoint(c: &Client, key: &str) -> String {
    let info = c.stat(key).await.unwrap();
    assert_eq!(info.replicas.len(), 1);
    info.replicas[0].endpoint.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_puts_from_the_own_process_still_reach_every_node() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let (node, c) = embedded(&cluster).await;
    // Two replicas: one in the writer's node (committed there), one in the other node (by the
    // master's record). Both serve reads.
    let two = PutOptions {
        replicas: 2,
        preferred_endpoints: vec![node.endpoint().to_string()],
        ..PutOptions::default()
    };
    for i in 0..20u64 {
        c.put(&format!("two/{i}"), &content(i, 30_000), &two).await.unwrap();
    }
    assert_eq!(node.held_objects(), 20);
    let reader = tcp_reader(&cluster).await;
    for i in 0..20u64 {
        let info = reader.stat(&format!("two/{i}")).await.unwrap();
        assert_eq!(info.replicas.len(), 2);
        assert_eq!(reader.get(&format!("two/{i}")).await.unwrap(), content(i, 30_000));
    }
    node.shutdown().await;
    // The other node still holds every object, with the writer's node gone.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..20u64 {
        assert_eq!(reader.get(&format!("two/{i}")).await.unwrap(), content(i, 30_000));
    }
}

/// Small values put from the writer's own process land in its node by a plain copy, straight
/// from the caller's bytes (no staging, no transfer batch); readers in other engines read them
/// byte for byte. The zero-copy call still refuses memory that is not registered, even when the
/// replica is the writer's own: the plain copy is not a way around registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_batches_into_the_own_node_read_back_and_unregistered_memory_is_still_refused() {
    let cluster = Cluster::start(ClusterOpts { nodes: 0, ..ClusterOpts::default() }).await;
    let (node, c) = embedded(&cluster).await;
    let values: Vec<Vec<u8>> =
        (0..300u64).map(|i| content(i, 1 + (i as usize * 97) % 9000)).collect();
    let keys: Vec<String> = (0..300).map(|i| format!("small/{i}")).collect();
    let items: Vec<(&str, &[u8])> =
        keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in c.put_batch(&items, &PutOptions::default()).await {
        r.unwrap();
    }
    assert_eq!(node.held_objects(), 300);
    let reader = tcp_reader(&cluster).await;
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(node_replica_endpoint(&reader, k).await, node.endpoint());
        assert_eq!(&reader.get(k).await.unwrap(), v, "{k}");
    }
    let unregistered = content(7, 4096);
    let items = [kvfs_client::PutFrom {
        key: "unregistered",
        addr: unregistered.as_ptr() as u64,
        len: unregistered.len() as u64,
    }];
    let r = c.put_from_batch(&items, &PutOptions::default()).await.pop().unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::NotRegistered);
    assert_eq!(reader.get("unregistered").await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(node.held_objects(), 300);
    node.shutdown().await;
}
