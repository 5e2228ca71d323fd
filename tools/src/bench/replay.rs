//! `kvfs bench trace --replay`: a trace replayed through a running kvfs cluster and conductor,
//! each 512-token block a pool object.
//!
//! In this process: a master publishing the pool's KV events (ZeroMQ, as `kvfs master
//! --kv-events-*`), one node contributing `--pool-bytes` of DRAM, and the conductor (its HTTP
//! API), with the pool registered as a shared holder and one engine instance of the context
//! that holds nothing itself (the conductor answers per instance; the pool's blocks count for
//! each); every piece talks to the others over loopback sockets as separate daemons would.
//! Each request of the trace, in order and as
//! fast as the cluster answers:
//! 1. asks the conductor over HTTP how long a prefix of its blocks the pool holds
//!    (`/query_by_hash`, the trace's prefix-chained block ids as the hashes);
//! 2. reads its blocks from the pool in one `get_batch` (each block's bytes derived from its
//!    id and checked); the hit is the prefix that came back;
//! 3. writes the blocks after the hit (what an engine computed) in one `put_batch`.
//!
//! The pool evicts at its watermark (LRU per segment), and the master's events tell the
//! conductor what was stored and removed, so the conductor's answer lags the pool by the
//! events' batch interval. Reported: the pool's token hit rate (what the gets found) against
//! the hit rate an LRU cache of the same capacity in tokens gives on the same requests
//! (`kvfs_conductor::trace::replay`, computed in the run), the conductor's prediction against
//! what was found, requests per second, bytes read and written, and p50/p99 of each step.

use std::time::{Duration, Instant};

use anyhow::Context;
use kvfs_client::{Client, ClientConfig, ErrorKind, PutOptions};
use kvfs_conductor::index::{ContextKey, OwnerKey};
use kvfs_conductor::service::{Config, Registration, Shared};
use kvfs_conductor::trace::{BLOCK_TOKENS, Capacity, Policy, Request, replay};
use kvfs_master::service::{KvEventsConfig, MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig};
use serde_json::json;

use super::conductor::Conn;
use super::report::{Samples, human_bytes};

/// What `--replay` needs from the command line.
pub struct ReplayOpts {
    pub block_bytes: u64,
    pub pool_bytes: u64,
    pub requests: usize,
    pub json: bool,
}

/// The bytes of block `id` (its id in every 8 bytes, so a wrong block is seen).
fn block(id: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let word = id.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
    while v.len() < len {
        v.extend_from_slice(&word[..(len - v.len()).min(8)]);
    }
    v
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The `p` percentile of latencies in microseconds (0 for none).
fn pct(v: &[f64], p: f64) -> f64 {
    Samples { lat_us: v.to_vec(), ..Samples::default() }.percentile(p).unwrap_or(0.0)
}

pub async fn run(name: &str, requests: &[Request], o: &ReplayOpts) -> anyhow::Result<()> {
    anyhow::ensure!(o.block_bytes > 0, "--block-bytes must be positive");
    let requests = &requests[..requests.len().min(o.requests)];
    // The cluster: master with its KV events, a node, the conductor.
    let (pub_port, replay_port) = (free_port()?, free_port()?);
    let events = KvEventsConfig {
        replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
        model_name: Some("trace".into()),
        block_size: Some(BLOCK_TOKENS as u32),
        backend_id: Some("kvfs-pool".into()),
        ..KvEventsConfig::new(format!("tcp://127.0.0.1:{pub_port}"))
    };
    let mut cfg = ServiceConfig {
        listen: "127.0.0.1:0".parse()?,
        kv_events: Some(events.clone()),
        ..ServiceConfig::default()
    };
    cfg.directory.object_size_max = cfg.directory.object_size_max.max(o.block_bytes);
    // Apart from the node's runtime, as `kvfs up` runs it (see `OwnRuntime`).
    let master_rt = crate::cmd::OwnRuntime::new("kvfs-master")?;
    let master = master_rt.run(MasterService::start(cfg)).await?.context("starting the master")?;
    let addr = master.rpc_addr().to_string();
    let node = Node::start(NodeConfig {
        master: addr.clone(),
        dram_bytes: o.pool_bytes,
        ..NodeConfig::default()
    })
    .await
    .context("starting the node")?;
    node.wait_registered(Duration::from_secs(10)).await?;
    let shared = Shared::new(&Config::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let conductor = listener.local_addr()?;
    let serving = tokio::spawn(kvfs_conductor::service::serve(listener, shared.clone()));
    shared
        .register(Registration {
            endpoint: events.endpoint.clone(),
            replay_endpoint: events.replay_endpoint.clone(),
            kind: "kvfs".into(),
            modelname: "trace".into(),
            lora_name: None,
            tenant_id: "default".into(),
            instance_id: "kvfs-pool".into(),
            block_size: BLOCK_TOKENS as u32,
            dp_rank: 0,
            hash_algorithm: None,
            python_hash_seed: None,
            role: None,
        })
        .map_err(|e| anyhow::anyhow!("registering the pool with the conductor: {e}"))?;
    // An engine instance of the context that holds nothing itself: the conductor answers per
    // instance, and the pool's blocks count for every instance.
    {
        let ctx = ContextKey {
            tenant: "default".into(),
            model: "trace".into(),
            lora: String::new(),
            block_size: BLOCK_TOKENS as u32,
        };
        let mut ix = shared.index.lock().unwrap_or_else(|e| e.into_inner());
        let engine = ix.owner(&OwnerKey { instance: "engine".into(), dp_rank: 0 }, false);
        ix.join(engine, &ctx);
    }
    let client = Client::connect(ClientConfig { master: addr, ..ClientConfig::default() }).await?;
    let mut conn = tokio::task::block_in_place(|| Conn::open(conductor))?;
    // Capacity in tokens: the blocks the pool keeps below its eviction watermark.
    let high = ServiceConfig::default().directory.evict_high_watermark;
    let pool_blocks = (o.pool_bytes as f64 * high / o.block_bytes as f64) as u64;
    let lru = replay(requests, Policy::Lru, Capacity::Tokens(pool_blocks * BLOCK_TOKENS));

    let started = Instant::now();
    let (mut q_us, mut get_us, mut put_us, mut req_us) = (vec![], vec![], vec![], vec![]);
    let (mut input_tokens, mut hit_tokens, mut predicted_tokens) = (0u64, 0u64, 0u64);
    let (mut over, mut under) = (0u64, 0u64);
    let (mut read_bytes, mut written_bytes, mut put_refused) = (0u64, 0u64, 0u64);
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for (n, r) in requests.iter().enumerate() {
        let t0 = Instant::now();
        let body = serde_json::to_vec(
            &json!({"model": "trace", "block_size": BLOCK_TOKENS, "seq_hashes": r.blocks}),
        )?;
        let answer =
            tokio::task::block_in_place(|| conn.post("/query_by_hash", "application/json", &body))?;
        let v: serde_json::Value = serde_json::from_slice(answer)?;
        let predicted = v["instances"]["engine"]["longest_matched"].as_u64().unwrap_or(0);
        let t1 = Instant::now();
        let keys: Vec<String> = r.blocks.iter().map(|b| b.to_string()).collect();
        let got = client.get_batch(&keys).await;
        let mut hit = 0usize;
        for (i, g) in got.iter().enumerate() {
            match g {
                Ok(bytes) if hit == i => {
                    anyhow::ensure!(
                        *bytes == block(r.blocks[i], o.block_bytes as usize),
                        "block {} read back other bytes",
                        r.blocks[i]
                    );
                    read_bytes += bytes.len() as u64;
                    hit += 1;
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => anyhow::bail!("get of block {}: {e}", r.blocks[i]),
            }
        }
        let t2 = Instant::now();
        let vals: Vec<Vec<u8>> =
            r.blocks[hit..].iter().map(|&b| block(b, o.block_bytes as usize)).collect();
        let items: Vec<(&str, &[u8])> =
            keys[hit..].iter().zip(&vals).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        for (res, (_, v)) in
            client.put_batch(&items, &PutOptions::default()).await.iter().zip(&items)
        {
            match res {
                Ok(()) => written_bytes += v.len() as u64,
                // Held already (behind a block that was evicted), or no room at this moment.
                Err(_) => put_refused += 1,
            }
        }
        let t3 = Instant::now();
        let hit_t = r.hit_tokens(hit);
        let predicted_t = predicted.min(r.input_len);
        input_tokens += r.input_len;
        hit_tokens += hit_t;
        predicted_tokens += predicted_t;
        if predicted_t > hit_t {
            over += 1;
        } else if predicted_t < hit_t {
            under += 1;
        }
        q_us.push((t1 - t0).as_secs_f64() * 1e6);
        get_us.push((t2 - t1).as_secs_f64() * 1e6);
        put_us.push((t3 - t2).as_secs_f64() * 1e6);
        req_us.push((t3 - t0).as_secs_f64() * 1e6);
        if progress && n % 100 == 0 {
            eprint!("\r{name}: replayed {n}/{} requests", requests.len());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if progress {
        eprint!("\r");
    }
    let reqs = requests.len() as f64;
    let hit_rate = hit_tokens as f64 / input_tokens.max(1) as f64;
    let pred_rate = predicted_tokens as f64 / input_tokens.max(1) as f64;
    let stats = client.stats().await?;
    let figures = json!({
        "bench": "trace_replay",
        "trace": name,
        "requests": requests.len(),
        "block_bytes": o.block_bytes,
        "pool_bytes": o.pool_bytes,
        "pool_capacity_tokens": pool_blocks * BLOCK_TOKENS,
        "token_hit_rate": hit_rate,
        "lru_model_token_hit_rate": lru.token_hit_rate(),
        "hit_over_model": hit_rate / lru.token_hit_rate().max(1e-9),
        "conductor_predicted_token_hit_rate": pred_rate,
        "requests_predicted_over": over,
        "requests_predicted_under": under,
        "requests_per_s": reqs / secs,
        "read_gbps": read_bytes as f64 / secs / 1e9,
        "write_gbps": written_bytes as f64 / secs / 1e9,
        "puts_refused": put_refused,
        "evicted_replicas": stats.evicted_replicas,
        "query_p50_us": pct(&q_us, 0.5),
        "query_p99_us": pct(&q_us, 0.99),
        "get_p50_us": pct(&get_us, 0.5),
        "get_p99_us": pct(&get_us, 0.99),
        "put_p50_us": pct(&put_us, 0.5),
        "put_p99_us": pct(&put_us, 0.99),
        "request_p50_us": pct(&req_us, 0.5),
        "request_p99_us": pct(&req_us, 0.99),
        "seconds": secs,
    });
    if o.json {
        println!("{figures}");
    } else {
        let f = |k: &str| figures[k].as_f64().unwrap_or(0.0);
        println!(
            "\n{name}: real replay of {} requests through a master, a node ({} of DRAM, {} tokens \
             in {} blocks) and the conductor",
            requests.len(),
            human_bytes(o.pool_bytes),
            pool_blocks * BLOCK_TOKENS,
            human_bytes(o.block_bytes)
        );
        println!(
            "  token hit rate   {:.3} found in the pool, {:.3} an LRU cache of that capacity gives \
             ({:.2}x), {:.3} the conductor predicted ({over} requests over, {under} under)",
            hit_rate,
            lru.token_hit_rate(),
            f("hit_over_model"),
            pred_rate
        );
        println!(
            "  throughput       {:.0} requests/s, read {:.2} GB/s, written {:.2} GB/s \
             ({put_refused} puts refused, {} replicas evicted)",
            f("requests_per_s"),
            f("read_gbps"),
            f("write_gbps"),
            stats.evicted_replicas
        );
        println!(
            "  p50/p99 us       query {:.0}/{:.0}, get {:.0}/{:.0}, put {:.0}/{:.0}, whole request {:.0}/{:.0}",
            f("query_p50_us"),
            f("query_p99_us"),
            f("get_p50_us"),
            f("get_p99_us"),
            f("put_p50_us"),
            f("put_p99_us"),
            f("request_p50_us"),
            f("request_p99_us")
        );
    }
    serving.abort();
    drop(client);
    node.shutdown().await;
    drop(master);
    Ok(())
}
