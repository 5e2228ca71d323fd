//! `kvfs bench conductor`: prefix-query latency of the conductor's index with many owners and
//! a long prompt, in process and over its HTTP API.
//!
//! The index holds one context with `instances` x `dp` owners; the prompt's block hashes are
//! vLLM's (sha256_cbor chain over its tokens); a share `holders` of the owners holds a prefix
//! of it on GPU (lengths uniform over 1..=blocks, seeded), and the pool holds the whole prompt
//! on CPU, so every owner has a CPU match and the answer lists every instance (the heaviest
//! answer the API gives). Measured: the index walk alone (by hash), `/query_by_hash` and
//! `/query` (tokens, hashed by the conductor) over one keep-alive HTTP/1.1 connection from
//! another thread, JSON and msgpack (a prompt's token ids as an int array, and as one LE int32
//! binary: the reference takes both). Answers are checked (the instance count) before timing.
//! Token queries are timed cold (the chain memo off: every block hashed; also with the hashing
//! kept on the query's own thread, no CBOR encoded ahead on another core), learned (the memo
//! filled from an engine's event carrying the prompt's tokens, fresh before each query) and
//! warm (the prompt queried before). The last figure is the floor under the HTTP ones: the same
//! request and answer bytes over a raw loopback TCP connection, with no HTTP and no work.

use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant};

use kvfs_conductor::event::{Event, Medium};
use kvfs_conductor::hash::{BlockHasher, Extra, project_low64_be};
use kvfs_conductor::index::{ContextKey, OwnerKey};
use kvfs_conductor::memo::ChainMemo;
use kvfs_conductor::service::{Config, Shared};
use rand::{Rng, SeedableRng};

#[derive(clap::Args, Debug)]
pub struct ConductorBenchArgs {
    /// Engine instances in the index.
    #[arg(long, default_value_t = 1000)]
    pub instances: usize,
    /// Data-parallel ranks per instance (each an owner).
    #[arg(long, default_value_t = 8)]
    pub dp: u32,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 131_072)]
    pub tokens: usize,
    /// Block sizes to measure (tokens per block), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "16,512")]
    pub block_sizes: Vec<u32>,
    /// Percent of owners holding a prefix of the prompt on GPU.
    #[arg(long, value_delimiter = ',', default_value = "100,10")]
    pub holders_pct: Vec<u32>,
    /// Queries per case.
    #[arg(long, default_value_t = 300)]
    pub queries: usize,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What the chain memo holds before a token query (see `one`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prep {
    Cold,
    /// Cold, hashed on the query's thread alone (no CBOR encoded ahead on another core).
    ColdOneCore,
    Learned,
    Warm,
}

struct Figure {
    block_size: u32,
    holders_pct: u32,
    case: &'static str,
    p50_us: f64,
    p99_us: f64,
    reply_bytes: usize,
}

pub fn run(a: ConductorBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.instances > 0 && a.dp > 0 && a.queries > 0, "sizes must be positive");
    // As `kvfs conductor` runs.
    kvfs_client::keep_freed_buffers();
    let tokens: Vec<u32> =
        (0..a.tokens as u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect();
    let mut figures = Vec::new();
    let mut sizes = Vec::new();
    for &bs in &a.block_sizes {
        for &pct in &a.holders_pct {
            let (f, size) = one(&a, &tokens, bs, pct)?;
            figures.extend(f);
            sizes.push(size);
        }
    }
    if a.json {
        for z in &sizes {
            println!(
                "{}",
                serde_json::json!({"bench": "conductor", "instances": a.instances, "dp": a.dp,
                    "tokens": a.tokens, "block_size": z.block_size, "holders_pct": z.holders_pct,
                    "case": "index bytes", "entries": z.entries, "bytes": z.bytes})
            );
        }
        for f in &figures {
            println!(
                "{}",
                serde_json::json!({"bench": "conductor", "instances": a.instances, "dp": a.dp,
                    "tokens": a.tokens, "block_size": f.block_size, "holders_pct": f.holders_pct,
                    "case": f.case, "p50_us": f.p50_us, "p99_us": f.p99_us,
                    "reply_bytes": f.reply_bytes})
            );
        }
        return Ok(());
    }
    println!(
        "{} instances x {} DP ranks, {}-token prompt, {} queries per case",
        a.instances, a.dp, a.tokens, a.queries
    );
    println!(
        "{:>6} {:>8} {:<48} {:>10} {:>10} {:>12}",
        "block", "holders", "case", "p50 us", "p99 us", "reply bytes"
    );
    for f in &figures {
        println!(
            "{:>6} {:>7}% {:<48} {:>10.1} {:>10.1} {:>12}",
            f.block_size, f.holders_pct, f.case, f.p50_us, f.p99_us, f.reply_bytes
        );
    }
    println!("index memory, as --index-bytes-max counts it:");
    for z in &sizes {
        println!(
            "{:>6} {:>7}% {} entries, {} ({} bytes an entry)",
            z.block_size,
            z.holders_pct,
            z.entries,
            crate::bench::report::human_bytes(z.bytes as u64),
            z.bytes / z.entries.max(1)
        );
    }
    Ok(())
}

/// The index's size after a case's events.
struct IndexSize {
    block_size: u32,
    holders_pct: u32,
    entries: usize,
    bytes: usize,
}

impl Figure {
    /// The p50 and p99 of `lat` (microseconds) for one case.
    fn new(
        block_size: u32,
        holders_pct: u32,
        case: &'static str,
        lat: Vec<f64>,
        reply_bytes: usize,
    ) -> Figure {
        Figure {
            block_size,
            holders_pct,
            case,
            p50_us: pct(lat.clone(), 0.5),
            p99_us: pct(lat, 0.99),
            reply_bytes,
        }
    }
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn one(
    a: &ConductorBenchArgs,
    tokens: &[u32],
    bs: u32,
    holders: u32,
) -> anyhow::Result<(Vec<Figure>, IndexSize)> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let shared = Shared::new(&Config::default());
    let ctx = ContextKey {
        tenant: "default".into(),
        model: "bench".into(),
        lora: String::new(),
        block_size: bs,
    };
    let hasher =
        BlockHasher::new(&Config::default().default_profile).map_err(|e| anyhow::anyhow!("{e}"))?;
    let hashes: Vec<u64> = hasher
        .iter(tokens, bs as usize, &Extra::default())
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .map(|d| project_low64_be(&d))
        .collect();
    let n = hashes.len();
    anyhow::ensure!(n > 0, "the prompt is shorter than one block");
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    {
        let mut ix = shared.index.lock().unwrap_or_else(|e| e.into_inner());
        let pool = ix.owner(&OwnerKey { instance: "pool".into(), dp_rank: 0 }, true);
        ix.apply(pool, &ctx, &stored(&hashes, Medium::Cpu, bs));
        for i in 0..a.instances {
            for r in 0..a.dp {
                let o =
                    ix.owner(&OwnerKey { instance: format!("engine-{i:04}"), dp_rank: r }, false);
                ix.join(o, &ctx);
                if rng.random_range(0..100) < holders {
                    let len = rng.random_range(1..=n);
                    ix.apply(o, &ctx, &stored(&hashes[..len], Medium::Gpu, bs));
                }
            }
        }
    }
    let st = shared.index.lock().unwrap_or_else(|e| e.into_inner()).stats();
    let size =
        IndexSize { block_size: bs, holders_pct: holders, entries: st.entries, bytes: st.bytes };
    let mut out = Vec::new();
    // The prompt's hash chain alone (what /query adds to /query_by_hash).
    let mut lat = Vec::with_capacity(a.queries);
    for _ in 0..a.queries {
        let t = Instant::now();
        let h = hasher
            .iter(tokens, bs as usize, &Extra::default())
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .map(|d| project_low64_be(&d))
            .last();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(h == hashes.last().copied(), "the chain changed");
    }
    out.push(Figure::new(bs, holders, "hash chain (tokens)", lat, 0));
    // The index walk alone.
    let mut lat = Vec::with_capacity(a.queries);
    let mut r = Vec::new();
    for _ in 0..a.queries {
        let t = Instant::now();
        shared.index.lock().unwrap_or_else(|e| e.into_inner()).query_raw(&ctx, &hashes, &mut r);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(
            r.len() == a.instances * a.dp as usize,
            "index answered {} owners",
            r.len()
        );
    }
    out.push(Figure::new(bs, holders, "index walk (by hash)", lat, 0));
    // Over HTTP.
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    rt.spawn(kvfs_conductor::service::serve(listener, shared.clone()));
    let by_hash = serde_json::to_vec(
        &serde_json::json!({"model": "bench", "block_size": bs, "seq_hashes": hashes}),
    )?;
    let by_hash_mp = rmp_serde::to_vec_named(
        &serde_json::json!({"model": "bench", "block_size": bs, "seq_hashes": hashes}),
    )?;
    let by_tokens = serde_json::to_vec(
        &serde_json::json!({"model": "bench", "block_size": bs, "token_ids": tokens}),
    )?;
    // The reference's `/query` takes msgpack only, its token ids as an int array or one LE
    // int32 binary: both are measured.
    let by_tokens_mp_ints = rmp_serde::to_vec_named(
        &serde_json::json!({"model": "bench", "block_size": bs, "token_ids": tokens}),
    )?;
    let mut raw = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        raw.extend_from_slice(&t.to_le_bytes());
    }
    let by_tokens_mp = rmp_bin_query(bs, &raw);
    // Token queries three ways. Cold: the chain memo off, every block hashed. Learned: before
    // each query a fresh memo learns the prompt's steps from a `BlockStored` event carrying
    // its tokens, as the engines publish them (a prompt the conductor never hashed, cached by
    // an engine). Warm: the prompt was queried before (a chat's next turn, a shared system
    // prompt, a request routed here before its engine cached it).
    let event = Event::Stored {
        hashes: hashes.clone(),
        parent: None,
        token_ids: tokens[..n * bs as usize].to_vec(),
        block_size: Some(bs),
        medium: Medium::Cpu,
        lora_name: None,
    };
    let prep = |p: Prep| {
        let cold = matches!(p, Prep::Cold | Prep::ColdOneCore);
        let entries = if cold { 0 } else { 1 << 19 };
        shared.set_encode_ahead(p != Prep::ColdOneCore);
        *shared.memo.lock().unwrap_or_else(|e| e.into_inner()) = ChainMemo::new(entries);
        if p == Prep::Learned {
            shared.learn_steps(&ctx, &event);
        }
    };
    // The service without HTTP: decoding the request, hashing, the walk, the answer.
    for (name, body, msgpack, by_hash, p) in [
        ("service by hash (no http)", &by_hash[..], false, true, Prep::Cold),
        ("service tokens msgpack, cold (no http)", &by_tokens_mp[..], true, false, Prep::Cold),
        (
            "service tokens msgpack, cold, 1 core (no http)",
            &by_tokens_mp[..],
            true,
            false,
            Prep::ColdOneCore,
        ),
        (
            "service tokens msgpack, learned (no http)",
            &by_tokens_mp[..],
            true,
            false,
            Prep::Learned,
        ),
        ("service tokens msgpack, warm (no http)", &by_tokens_mp[..], true, false, Prep::Warm),
    ] {
        prep(p);
        // As the HTTP handler gets it: a shared buffer the tokens are read from in place.
        let body = &bytes::Bytes::copy_from_slice(body);
        if p == Prep::Warm {
            kvfs_conductor::service::answer_query(&shared, msgpack, body, by_hash)
                .map_err(|e| anyhow::anyhow!(e))?;
        }
        let mut lat = Vec::with_capacity(a.queries);
        let mut bytes = 0;
        for _ in 0..a.queries {
            if p == Prep::Learned {
                prep(p);
            }
            let t = Instant::now();
            let r = kvfs_conductor::service::answer_query(&shared, msgpack, body, by_hash)
                .map_err(|e| anyhow::anyhow!(e))?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            bytes = r.len();
        }
        out.push(Figure::new(bs, holders, name, lat, bytes));
    }
    let (json, mp) = ("application/json", "application/msgpack");
    let cases: [(&'static str, &str, &[u8], &str, Prep); 8] = [
        ("/query_by_hash json", "/query_by_hash", &by_hash, json, Prep::Cold),
        ("/query_by_hash msgpack", "/query_by_hash", &by_hash_mp, mp, Prep::Cold),
        ("/query tokens json, cold", "/query", &by_tokens, json, Prep::Cold),
        ("/query tokens msgpack ints, cold", "/query", &by_tokens_mp_ints, mp, Prep::Cold),
        ("/query tokens msgpack bin, cold", "/query", &by_tokens_mp, mp, Prep::Cold),
        ("/query tokens msgpack bin, cold, 1 core", "/query", &by_tokens_mp, mp, Prep::ColdOneCore),
        ("/query tokens msgpack bin, learned", "/query", &by_tokens_mp, mp, Prep::Learned),
        ("/query tokens msgpack bin, warm", "/query", &by_tokens_mp, mp, Prep::Warm),
    ];
    let mut conn = Conn::open(addr)?;
    for (name, path, body, ct, p) in cases {
        // Warm: the five untimed queries below fill the memo.
        prep(p);
        let mut lat = Vec::with_capacity(a.queries);
        let mut bytes = 0;
        for i in 0..a.queries + 5 {
            if p == Prep::Learned {
                prep(p);
            }
            let t = Instant::now();
            let reply = conn.post(path, ct, body)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if i == 0 {
                check(reply, ct, a.instances)?;
            }
            if i >= 5 {
                lat.push(us);
            }
            bytes = reply.len();
        }
        out.push(Figure::new(bs, holders, name, lat, bytes));
    }
    drop(conn);
    rt.shutdown_timeout(Duration::from_secs(1));
    // The machine's floor under the HTTP figures: the same bytes in and out with no HTTP and
    // no work.
    let down = out.last().map_or(0, |f| f.reply_bytes);
    let lat = crate::bench::limits::raw_exchange_us(by_tokens_mp.len(), down, a.queries)?;
    out.push(Figure::new(bs, holders, "raw tcp round trip, same bytes (limit)", lat, down));
    Ok((out, size))
}

fn stored(hashes: &[u64], medium: Medium, bs: u32) -> Event {
    Event::Stored {
        token_ids: Vec::new(),
        hashes: hashes.to_vec(),
        parent: None,
        block_size: Some(bs),
        medium,
        lora_name: None,
    }
}

/// `{"model": "bench", "block_size": bs, "token_ids": <bin>}` in msgpack.
fn rmp_bin_query(bs: u32, raw: &[u8]) -> Vec<u8> {
    use rmpv::Value;
    let v = Value::Map(vec![
        (Value::from("model"), Value::from("bench")),
        (Value::from("block_size"), Value::from(bs)),
        (Value::from("token_ids"), Value::Binary(raw.to_vec())),
    ]);
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

fn check(reply: &[u8], ct: &str, instances: usize) -> anyhow::Result<()> {
    let n = if ct.contains("msgpack") {
        let v: serde_json::Value = rmp_serde::from_slice(reply)?;
        v["instances"].as_object().map(|m| m.len())
    } else {
        let v: serde_json::Value = serde_json::from_slice(reply)?;
        v["instances"].as_object().map(|m| m.len())
    };
    anyhow::ensure!(n == Some(instances), "the answer lists {n:?} instances, not {instances}");
    Ok(())
}

/// One keep-alive HTTP/1.1 connection.
pub(crate) struct Conn {
    rd: BufReader<std::net::TcpStream>,
    wr: std::net::TcpStream,
    /// The last answer's body, its room reused (as an HTTP client library keeps its buffers).
    reply: Vec<u8>,
}

impl Conn {
    pub(crate) fn open(addr: std::net::SocketAddr) -> anyhow::Result<Conn> {
        let s = std::net::TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Conn { rd: BufReader::new(s.try_clone()?), wr: s, reply: Vec::new() })
    }

    pub(crate) fn post(&mut self, path: &str, ct: &str, body: &[u8]) -> anyhow::Result<&[u8]> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: {ct}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.wr.write_all(head.as_bytes())?;
        self.wr.write_all(body)?;
        let mut line = String::new();
        self.rd.read_line(&mut line)?;
        anyhow::ensure!(line.contains(" 200 "), "answer {line:?}");
        let mut len = 0usize;
        loop {
            line.clear();
            self.rd.read_line(&mut line)?;
            let l = line.trim();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse()?;
            }
        }
        self.reply.resize(len, 0);
        self.rd.read_exact(&mut self.reply)?;
        Ok(&self.reply)
    }
}
