//! The master publishes the pool's KV events: a real `kvfs master` with `--kv-events-endpoint`
//! (and the reference's `--kv_events_*` spellings) and a real node; puts of numeric keys (a
//! decimal and a `0x` one) and of a path-like key, and a remove, must reach (1) a ZeroMQ
//! subscriber as exactly the msgpack events the reference publishes, (2) the conductor, which
//! then tells an engine instance that the pool holds those blocks in memory, and (3) a
//! subscriber that comes late, through the replay endpoint.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvfs_client::PutOptions;
use kvfs_conductor::index::{ContextKey, OwnerKey};
use kvfs_conductor::service::{Config, Registration, Shared};
use kvfs_tests::{Cluster, ClusterOpts, admin_metrics, content, free_port, metric};
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

struct Endpoints {
    publish: String,
    replay: String,
    admin: String,
}

/// A master publishing pool events (reference spellings for the event fields) and one node.
async fn cluster() -> (Cluster, Endpoints) {
    let ep = Endpoints {
        publish: format!("tcp://127.0.0.1:{}", free_port()),
        replay: format!("tcp://127.0.0.1:{}", free_port()),
        admin: format!("127.0.0.1:{}", free_port()),
    };
    let mut opts = ClusterOpts { nodes: 1, ..ClusterOpts::default() };
    opts.master_args.extend(
        [
            "--kv-events-endpoint",
            &ep.publish,
            "--kv-events-replay-endpoint",
            &ep.replay,
            "--kv_events_model_name=m",
            "--kv_events_block_size=16",
            "--kv_events_emit_object_key=false",
            "--admin",
            &ep.admin,
        ]
        .map(String::from),
    );
    (Cluster::start(opts).await, ep)
}

fn s(v: &str) -> Value {
    Value::from(v)
}

/// The event the master publishes for a key, as a map in its field order.
fn event(stored: bool, key: &str, hash: Option<u64>) -> Value {
    let hashes = Value::Array(hash.map(Value::from).into_iter().collect());
    let mut m = vec![
        (s("type"), s(if stored { "BlockStored" } else { "BlockRemoved" })),
        (s("event_type"), s(if stored { "stored" } else { "removed" })),
        (s("block_hashes"), hashes.clone()),
        (s("seq_hashes"), hashes),
    ];
    if hash.is_none() {
        m.push((s("object_key"), s(key)));
    }
    m.push((s("medium"), s("cpu")));
    m.push((s("model_name"), s("m")));
    m.push((s("block_size"), Value::from(16u32)));
    Value::Map(m)
}

/// `(seq, events)` of one batch payload, checking its envelope.
fn decode(seq: &[u8], payload: &[u8]) -> (u64, Vec<Value>) {
    let seq = u64::from_be_bytes(seq.try_into().expect("8-byte sequence"));
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack batch");
    let items = v.as_array().expect("batch array");
    assert_eq!(items.len(), 3, "[ts, events, dp_rank]: {v}");
    assert!(items[0].as_f64().is_some_and(|t| t > 1.6e9), "timestamp in seconds: {v}");
    assert_eq!(items[2].as_u64(), Some(0), "dp rank: {v}");
    (seq, items[1].as_array().expect("events").clone())
}

async fn put_and_remove(cluster: &Cluster) {
    let c = cluster.client().await;
    let opts = PutOptions::default();
    for (i, key) in ["12345", "0x2a", "layer/0/block"].iter().enumerate() {
        c.put(key, &content(i as u64, 4096), &opts).await.unwrap();
    }
    c.remove("12345", true).await.unwrap();
}

fn expected() -> Vec<Value> {
    vec![
        event(true, "12345", Some(12345)),
        event(true, "0x2a", Some(42)),
        event(true, "layer/0/block", None),
        event(false, "12345", Some(12345)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_events_reach_a_subscriber_and_the_conductor() {
    let (cluster, ep) = cluster().await;

    // The conductor, in this process: the pool as a shared holder, and an engine instance of
    // the same context that has stored nothing itself.
    let shared = Shared::new(&Config::default());
    shared
        .register(Registration {
            endpoint: ep.publish.clone(),
            replay_endpoint: Some(ep.replay.clone()),
            kind: "kvfs".into(),
            modelname: "m".into(),
            lora_name: None,
            tenant_id: "default".into(),
            instance_id: "pool".into(),
            block_size: 16,
            dp_rank: 0,
            hash_algorithm: None,
            python_hash_seed: None,
            role: None,
        })
        .unwrap();
    let ctx = ContextKey {
        tenant: "default".into(),
        model: "m".into(),
        lora: String::new(),
        block_size: 16,
    };
    {
        let mut ix = shared.index.lock().unwrap();
        let engine = ix.owner(&OwnerKey { instance: "engine-a".into(), dp_rank: 0 }, false);
        ix.join(engine, &ctx);
    }

    let mut sub = zeromq::SubSocket::new();
    sub.connect(&ep.publish).await.expect("subscriber connects");
    sub.subscribe("").await.unwrap();
    // PUB drops what it sends before the subscription reaches it.
    tokio::time::sleep(Duration::from_millis(500)).await;

    put_and_remove(&cluster).await;

    let mut events = Vec::new();
    let mut seqs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while events.len() < 4 {
        let m = tokio::time::timeout_at(deadline.into(), sub.recv())
            .await
            .unwrap_or_else(|_| panic!("4 events not within 10 s; got {events:?}"))
            .unwrap();
        assert_eq!(m.len(), 3, "[topic, seq, batch]");
        assert!(m.get(0).unwrap().is_empty(), "empty topic");
        let (seq, evs) = decode(m.get(1).unwrap(), m.get(2).unwrap());
        seqs.push(seq);
        events.extend(evs);
    }
    assert_eq!(events, expected());
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "sequences from 0, in order");

    // The conductor: the pool holds block 42 in memory, for any instance of the context;
    // 12345 was removed, so a prompt starting with it matches nothing.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (found, removed) = {
            let mut ix = shared.index.lock().unwrap();
            (ix.query(&ctx, &[42, 7]), ix.query(&ctx, &[12345, 42]))
        };
        let a = found.iter().find(|m| m.owner.instance == "engine-a");
        let holds_42 = a.is_some_and(|a| (a.gpu, a.cpu, a.disk) == (0, 1, 1));
        let no_12345 = removed.iter().all(|m| m.cpu == 0 && m.disk == 0);
        if holds_42 && no_12345 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the conductor never saw the pool hold 42 and not 12345: {found:?} {removed:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let text = admin_metrics(&ep.admin);
    assert_eq!(metric(&text, "kvfs_master_kv_events_published_total"), Some(4), "{text}");
    assert_eq!(metric(&text, "kvfs_master_kv_events_dropped_total"), Some(0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_recovers_earlier_batches_by_replay() {
    let (cluster, ep) = cluster().await;
    put_and_remove(&cluster).await;
    // Published to nobody; wait until the master has numbered them all.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&admin_metrics(&ep.admin), "kvfs_master_kv_events_published_total") != Some(4) {
        assert!(Instant::now() < deadline, "the master never published 4 events");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&ep.replay).await.expect("dealer connects");
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())];
    dealer.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut events = Vec::new();
    let mut next = 0;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
            .await
            .expect("replay answers within 10 s")
            .unwrap();
        assert_eq!(m.len(), 4, "[b\"\", topic, seq, batch]");
        assert!(m.get(0).unwrap().is_empty() && m.get(1).unwrap().is_empty());
        if m.get(2).unwrap().as_ref() == (-1i64).to_be_bytes() {
            assert!(m.get(3).unwrap().is_empty(), "the end marker's payload is empty");
            break;
        }
        let (seq, evs) = decode(m.get(2).unwrap(), m.get(3).unwrap());
        assert_eq!(seq, next, "replayed in sequence from 0");
        next += 1;
        events.extend(evs);
    }
    assert_eq!(events, expected());
    let text = admin_metrics(&ep.admin);
    assert_eq!(metric(&text, "kvfs_master_kv_events_replay_requests_total"), Some(1), "{text}");

    // From the middle: only the batches from that sequence on.
    if next > 1 {
        let req = vec![Bytes::new(), Bytes::copy_from_slice(&(next - 1).to_be_bytes())];
        dealer.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
        let m = dealer.recv().await.unwrap();
        assert_eq!(m.get(2).unwrap().as_ref(), (next - 1).to_be_bytes());
        let end = dealer.recv().await.unwrap();
        assert_eq!(end.get(2).unwrap().as_ref(), (-1i64).to_be_bytes());
    }
}
