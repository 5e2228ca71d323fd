//! Lone small puts into a remote node over tcp: the write carries the object's commit record
//! (the Transfer Engine's noted write), the node records it once the bytes are in place, and
//! the `PutEnd` names that node, so the master answers without a record round trip (three
//! round trips per put, not four). The node's index must still end up exactly what the master
//! completed: late drops of a range's previous object leave the new commit alone, a master
//! restart finds every object on the node, and a put the writer abandons after its noted write
//! (never ended, or revoked) is dropped from the node again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfs_client::{Client, PutOptions};
use kvfs_node::{Node, NodeConfig};
use kvfs_proto::store::{
    CommitNote, MasterRequest, MasterResponse, Persistence, Pin, PutStartItem, Role, Strategy,
};
use kvfs_rpc::{RpcConn, RpcOptions, no_handler};
use kvfs_tests::{Cluster, ClusterOpts, content};
use kvfs_transfer::{BufferOptions, Engine, EngineConfig, Transports};

fn tcp_engine() -> EngineConfig {
    EngineConfig { transports: Transports::tcp_only(), ..EngineConfig::default() }
}

/// A node in this test's process (so its index can be inspected), reached over tcp.
async fn node(cluster: &Cluster) -> Node {
    let node = Node::start(NodeConfig {
        master: cluster.master_addr.clone(),
        dram_bytes: 64 << 20,
        populate: false,
        engine: tcp_engine(),
        ..NodeConfig::default()
    })
    .await
    .expect("node starts");
    node.wait_registered(Duration::from_secs(30)).await.expect("node registers");
    node
}

/// A client with its own engine that reaches the node over tcp only.
async fn tcp_client(cluster: &Cluster) -> Client {
    Client::connect(kvfs_client::ClientConfig { engine: tcp_engine(), ..cluster.client_config() })
        .await
        .expect("client connects")
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_puts_commit_in_their_write_and_survive_late_drops_and_a_master_restart() {
    let mut cluster = Cluster::start(ClusterOpts { nodes: 0, ..ClusterOpts::default() }).await;
    let node = node(&cluster).await;
    let c = tcp_client(&cluster).await;
    let opts = PutOptions::default();

    // Put, force-remove (its drop is queued on the master for a few milliseconds) and put the
    // same key and size again at once: the allocator hands the same range back, so the old
    // object's drop may reach the node after the writer's noted commit of the new version.
    let rounds = 40u64;
    for r in 0..rounds {
        c.put("same", &content(r, 8192), &opts).await.unwrap();
        if r + 1 < rounds {
            c.remove("same", true).await.unwrap();
        }
    }
    for i in 0..50u64 {
        c.put(&format!("k/{i}"), &content(1000 + i, 4096 + i as usize), &opts).await.unwrap();
    }
    for i in (0..50u64).step_by(5) {
        c.remove(&format!("k/{i}"), true).await.unwrap();
    }
    assert_eq!(node.stats().writer_commits, rounds + 50, "every lone put committed in its write");
    wait_for("the node's index is what the master completed", || node.held_objects() == 41).await;

    // Not noted: a put above the noted size (its round trip is noise next to its bytes), a
    // batch, and a put that asks for a checksum; the master records those as before.
    let big = content(7, 3 << 20);
    c.put("big", &big, &opts).await.unwrap();
    let batch: Vec<(String, Vec<u8>)> =
        (0..4u64).map(|i| (format!("b/{i}"), content(2000 + i, 1000))).collect();
    let refs: Vec<(&str, &[u8])> = batch.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    assert!(c.put_batch(&refs, &opts).await.iter().all(Result::is_ok));
    let summed = PutOptions { checksum: true, ..PutOptions::default() };
    c.put("summed", &content(9, 4096), &summed).await.unwrap();
    assert_eq!(node.stats().writer_commits, rounds + 50);
    assert_eq!(node.held_objects(), 41 + 6);

    // A reader in another engine: the second get of a key reads its cached location with a
    // guarded read, which the node serves only because its index holds the noted commit.
    let reader = tcp_client(&cluster).await;
    for _ in 0..2 {
        assert_eq!(reader.get("same").await.unwrap(), content(rounds - 1, 8192));
        assert_eq!(reader.get("k/1").await.unwrap(), content(1001, 4097));
    }
    assert_eq!(reader.location_cache_stats(), (2, 0), "the node vouched for its noted commits");

    // The master restarts empty and rebuilds its directory from the node's index.
    cluster.kill_master();
    cluster.start_master();
    cluster.wait_nodes(1).await;
    let fresh = tcp_client(&cluster).await;
    assert_eq!(fresh.get("same").await.unwrap(), content(rounds - 1, 8192));
    for i in 0..50u64 {
        let got = fresh.get(&format!("k/{i}")).await;
        if i % 5 == 0 {
            assert!(got.is_err(), "k/{i} was removed");
        } else {
            assert_eq!(got.unwrap(), content(1000 + i, 4096 + i as usize), "k/{i}");
        }
    }
    assert_eq!(fresh.get("big").await.unwrap(), big);
    assert_eq!(fresh.get("summed").await.unwrap(), content(9, 4096));
}

/// A writer driven by hand: `PutStart` on the master, then a noted write to the node, and no
/// `PutEnd`.
struct Abandoner {
    rpc: RpcConn,
    engine: Engine,
}

impl Abandoner {
    async fn connect(cluster: &Cluster) -> Abandoner {
        let rpc = RpcConn::connect(&cluster.master_addr, no_handler(), RpcOptions::default())
            .await
            .expect("master answers");
        let hello = MasterRequest::Hello {
            version: kvfs_proto::store::STORE_PROTOCOL_VERSION,
            role: Role::Client,
            host: "abandoner".into(),
        };
        let r: MasterResponse = rpc.call(&hello, Duration::from_secs(5)).await.unwrap();
        assert!(matches!(r, MasterResponse::Hello { .. }), "{r:?}");
        let engine = Engine::start(tcp_engine()).await.expect("engine starts");
        Abandoner { rpc, engine }
    }

    async fn call(&self, req: MasterRequest) -> MasterResponse {
        self.rpc.call(&req, Duration::from_secs(5)).await.expect("master answers")
    }

    /// Starts a put of `key` and writes `bytes` with its commit note; the node recorded it.
    async fn write_without_end(&self, key: &str, bytes: &[u8]) {
        let start = MasterRequest::PutStart {
            client_host: "abandoner".into(),
            items: vec![PutStartItem {
                key: key.into(),
                size: bytes.len() as u64,
                replicas: 1,
                persistence: Persistence::None,
                pin: Pin::None,
                strategy: Strategy::default(),
                preferred_endpoints: Vec::new(),
                upsert: false,
                tier: kvfs_proto::store::Tier::Dram,
            }],
        };
        let MasterResponse::PutStart(mut grants) = self.call(start).await else {
            panic!("no grant")
        };
        let grant = grants.pop().unwrap().expect("granted");
        let r = &grant.replicas[0];
        let buf = self.engine.alloc_buffer(bytes.len(), &BufferOptions::default()).unwrap();
        buf.write_at(0, bytes).unwrap();
        let seg = self.engine.open_segment(&r.endpoint).await.unwrap();
        let note = CommitNote { key: key.into(), version: grant.version, pin: Pin::None };
        let note: Arc<[u8]> = note.encode().into();
        let accepted = self
            .engine
            .write_noted(&seg, buf.addr(), r.addr, bytes.len() as u64, note)
            .await
            .expect("written");
        assert!(accepted, "the node recorded the commit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_abandoned_after_its_noted_write_is_dropped_from_the_node() {
    let mut opts = ClusterOpts { nodes: 0, ..ClusterOpts::default() };
    let timeouts = ["--put-timeout-ms", "1500", "--persist-timeout-ms", "1000"];
    opts.master_args.extend(timeouts.map(String::from));
    let mut cluster = Cluster::start(opts).await;
    let node = node(&cluster).await;
    let w = Abandoner::connect(&cluster).await;

    // Never ended: the master's timer revokes the put and drops it from the node.
    w.write_without_end("never-ended", &content(1, 4096)).await;
    assert_eq!(node.held_objects(), 1, "recorded when the bytes landed");
    wait_for("the expired put dropped from the node", || node.held_objects() == 0).await;

    // Revoked by the writer: dropped as well.
    w.write_without_end("revoked", &content(2, 4096)).await;
    assert_eq!(node.held_objects(), 1);
    let r = w.call(MasterRequest::PutRevoke(vec!["revoked".into()])).await;
    assert!(matches!(&r, MasterResponse::PutRevoke(v) if v[0].is_ok()), "{r:?}");
    wait_for("the revoked put dropped from the node", || node.held_objects() == 0).await;

    // Neither comes back with a master restart; new puts of both keys are whole.
    let c = tcp_client(&cluster).await;
    assert!(c.get("never-ended").await.is_err());
    c.put("never-ended", &content(3, 5000), &PutOptions::default()).await.unwrap();
    cluster.kill_master();
    cluster.start_master();
    cluster.wait_nodes(1).await;
    let fresh = tcp_client(&cluster).await;
    assert_eq!(fresh.get("never-ended").await.unwrap(), content(3, 5000));
    assert!(fresh.get("revoked").await.is_err(), "a revoked put is not resurrected");
    assert_eq!(node.held_objects(), 1);
}
