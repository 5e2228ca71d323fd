//! The conductor fed by real publishers: Python processes publishing over ZeroMQ exactly as
//! vLLM's and SGLang's `ZmqEventPublisher` do (tests/publisher.py), the conductor's HTTP API
//! on a real socket. Covers both vLLM formats and SGLang's, a dropped batch replayed, a
//! publisher restart, the pool as a shared medium, token queries hashed as vLLM hashes,
//! unregistering, and a vanished publisher's blocks expiring.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvfs_conductor::service::{Config, Shared};
use serde_json::{Value, json};

fn python() -> String {
    let venv = std::env::var("KVFS_VENV").unwrap_or_else(|_| "/opt/kvfs-venv".into());
    format!("{venv}/bin/python")
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: String,
    replay: String,
}

impl Publisher {
    fn start(format: &str, dp_rank: u32, ports: Option<(&str, &str)>) -> Publisher {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/publisher.py");
        let mut cmd = Command::new(python());
        cmd.arg(script).args(["--format", format, "--dp-rank", &dp_rank.to_string()]);
        if let Some((p, r)) = ports {
            let port = |e: &str| e.rsplit(':').next().unwrap().to_string();
            cmd.args(["--pub-port", &port(p), "--replay-port", &port(r)]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {} (set KVFS_VENV): {e}", python()));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            parts.first(),
            Some(&"ready"),
            "publisher did not start: {line:?} (needs pyzmq, msgpack, cbor2, xxhash in {})",
            python()
        );
        Publisher {
            endpoint: parts[1].to_string(),
            replay: parts[2].to_string(),
            child,
            stdin,
            stdout,
        }
    }

    fn send(&mut self, events: Value, live: bool) -> u64 {
        let line = json!({"events": events, "live": live}).to_string();
        writeln!(self.stdin, "{line}").unwrap();
        let mut out = String::new();
        self.stdout.read_line(&mut out).unwrap();
        out.trim().strip_prefix("ok ").expect("publisher answer").parse().unwrap()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request on a fresh connection; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn query(addr: &str, hashes: &[u64]) -> Value {
    let (code, body) = http(
        addr,
        "POST",
        "/query_by_hash",
        Some(&json!({"model": "m", "block_size": 16, "seq_hashes": hashes})),
    );
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls until `f` holds (events cross a real socket and a subscriber's connect).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn gpu(v: &Value, instance: &str) -> u64 {
    v["instances"][instance]["gpu"].as_u64().unwrap_or(0)
}

fn register(addr: &str, p: &Publisher, instance: &str, kind: &str, dp_rank: u32) {
    let (code, body) = http(
        addr,
        "POST",
        "/register",
        Some(&json!({"endpoint": p.endpoint, "replay_endpoint": p.replay, "type": kind,
            "modelname": "m", "instance_id": instance, "block_size": 16, "dp_rank": dp_rank})),
    );
    assert_eq!(code, 200, "{body}");
}

fn metric(addr: &str, name: &str) -> u64 {
    let (_, body) = http(addr, "GET", "/metrics", None);
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("kvfs_conductor_{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

#[test]
fn engines_events_feed_the_index() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = Config { source_ttl: Duration::from_secs(2), ..Config::default() };
    let shared = Shared::new(&cfg);
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    rt.spawn(kvfs_conductor::service::serve(listener, shared.clone()));
    let addr = addr.as_str();

    // Newer vLLM: tagged maps. Batches sent before the subscriber connects are recovered by
    // the replay it asks for on first contact.
    let mut a = Publisher::start("tagged", 0, None);
    a.send(json!([{"type": "stored", "hashes": [1, 2], "medium": "GPU"}]), true);
    register(addr, &a, "a", "vLLM", 0);
    a.send(json!([{"type": "stored", "hashes": [3]}]), true);
    eventually("a's blocks", || gpu(&query(addr, &[1, 2, 3, 4]), "a") == 48);

    // A batch the subscriber never sees live is replayed when the next one shows the gap.
    a.send(json!([{"type": "stored", "hashes": [4]}]), false);
    a.send(json!([{"type": "stored", "hashes": [5]}]), true);
    eventually("the replayed block", || gpu(&query(addr, &[1, 2, 3, 4, 5]), "a") == 80);
    assert!(metric(addr, "gaps_total") >= 1);
    assert!(metric(addr, "replayed_batches_total") >= 2);
    // The index's memory and its bound, as an operator watches them.
    let bytes = metric(addr, "index_bytes");
    assert!(bytes > 0 && bytes < metric(addr, "index_bytes_max"), "{bytes} bytes");

    // Older vLLM / SGLang: positional arrays, DP rank 1 carried in the batch.
    let mut b = Publisher::start("array", 1, None);
    register(addr, &b, "b", "vLLM", 1);
    b.send(json!([{"type": "stored", "hashes": [1, 2]}]), true);
    eventually("b's blocks", || gpu(&query(addr, &[1, 2, 3]), "b") == 32);
    let v = query(addr, &[1, 2, 3]);
    assert_eq!(v["instances"]["b"]["dp"]["1"], 32);
    b.send(json!([{"type": "removed", "hashes": [2]}]), true);
    eventually("b's removal", || gpu(&query(addr, &[1, 2, 3]), "b") == 16);

    // SGLang's tagged events with its own medium names, and a shared pool: every instance
    // can continue its prefix from the pool's CPU copy.
    let mut pool = Publisher::start("sglang", 0, None);
    register(addr, &pool, "pool", "kvfs", 0);
    pool.send(
        json!([{"type": "stored", "hashes": [1, 2, 3, 4, 5, 6], "medium": "CPU_PINNED"}]),
        true,
    );
    eventually("the pool's blocks", || {
        let v = query(addr, &[1, 2, 3, 4, 5, 6, 7]);
        v["instances"]["b"]["cpu"] == 96 && v["instances"]["a"]["cpu"] == 96
    });
    let v = query(addr, &[1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(v["instances"]["a"]["gpu"], 80);
    assert_eq!(v["instances"]["a"]["longest_matched"], 96);
    assert!(v["instances"].get("pool").is_none(), "{v}");

    // A publisher restart: same endpoints, sequence back to 0; the old process's blocks go.
    let (ep, rp) = (a.endpoint.clone(), a.replay.clone());
    drop(a);
    let mut a2 = Publisher::start("tagged", 0, Some((&ep, &rp)));
    a2.send(json!([{"type": "stored", "hashes": [9]}]), true);
    a2.send(json!([{"type": "stored", "hashes": [10]}]), true);
    eventually("the restarted publisher's blocks", || {
        gpu(&query(addr, &[9, 10]), "a") == 32 && gpu(&query(addr, &[1, 2]), "a") == 0
    });
    assert!(metric(addr, "publisher_restarts_total") >= 1);

    // Token queries hash as vLLM does (sha256_cbor, default root) and find the same blocks;
    // the event carried the blocks' tokens, so the query looks the second block's chain step
    // up instead of hashing it (the first block is always hashed: a salt may change it).
    let tokens: Vec<u32> = (0..40).map(|i| i * 7 + 1).collect();
    let hasher = kvfs_conductor::hash::BlockHasher::new(&Config::default().default_profile)
        .expect("the default profile");
    let hashes: Vec<u64> = hasher
        .iter(&tokens, 16, &Default::default())
        .unwrap()
        .map(|d| kvfs_conductor::hash::project_low64_be(&d))
        .collect();
    a2.send(
        json!([{"type": "stored_tokens", "tokens": tokens, "block_size": 16,
                "algorithm": "sha256_cbor", "seed": null}]),
        true,
    );
    eventually("blocks stored by token hash", || gpu(&query(addr, &hashes), "a") == 32);
    let hits = metric(addr, "hash_memo_hits_total");
    let (code, body) = http(
        addr,
        "POST",
        "/query",
        Some(&json!({"model": "m", "block_size": 16, "token_ids": tokens})),
    );
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(gpu(&v, "a"), 32, "{v}");
    assert_eq!(metric(addr, "hash_memo_hits_total"), hits + 1, "the learned step was used");

    // Views and bad input.
    let (code, body) = http(addr, "GET", "/global_view", None);
    assert_eq!(code, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["context_count"], 1, "{v}");
    let (_, body) = http(addr, "GET", "/services", None);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["count"], 3);
    let (code, _) = http(addr, "POST", "/register", Some(&json!({"endpoint": "x"})));
    assert_eq!(code, 400);
    let (code, body) = http(
        addr,
        "POST",
        "/register",
        Some(&json!({"endpoint": "tcp://127.0.0.1:1", "type": "Nope", "modelname": "m",
            "instance_id": "z", "block_size": 16})),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("unknown type"), "{body}");
    let (code, _) = http(addr, "POST", "/query", Some(&json!({"model": "m", "block_size": 0})));
    assert_eq!(code, 400);
    let (code, _) = http(addr, "GET", "/query", None);
    assert_eq!(code, 405);

    // Unregistering forgets the instance.
    let (code, body) =
        http(addr, "POST", "/unregister", Some(&json!({"instance_id": "b", "dp_rank": 1})));
    assert_eq!(code, 200, "{body}");
    assert!(query(addr, &[1]).get("instances").unwrap().get("b").is_none());
    let (code, _) = http(addr, "POST", "/unregister", Some(&json!({"instance_id": "b"})));
    assert_eq!(code, 404);

    // A publisher that stays unreachable past the source TTL takes its blocks with it.
    assert_eq!(query(addr, &[1, 2, 3, 4, 5, 6])["instances"]["a"]["cpu"], 96);
    drop(pool);
    eventually("the vanished pool's blocks to expire", || {
        query(addr, &[1, 2, 3, 4, 5, 6]).get("instances").unwrap().get("a").is_none()
    });
    assert!(metric(addr, "sources_expired_total") >= 1);
    drop((b, a2));
}

fn route(addr: &str, body: Value) -> (u16, Value) {
    let (code, body) = http(addr, "POST", "/route", Some(&body));
    (code, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

/// `/route` over instances that publish real events: prefill instances by role, the
/// cheapest prefix (own GPU or fetched from another instance), early rejection, and errors.
#[test]
fn routes_requests_by_cache_and_load() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let shared = Shared::new(&Config::default());
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    rt.spawn(kvfs_conductor::service::serve(listener, shared.clone()));
    let addr = addr.as_str();

    let mut pubs = Vec::new();
    for (id, role) in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")] {
        let p = Publisher::start("tagged", 0, None);
        let (code, body) = http(
            addr,
            "POST",
            "/register",
            Some(&json!({"endpoint": p.endpoint, "replay_endpoint": p.replay, "type": "vLLM",
                "modelname": "m", "instance_id": id, "block_size": 16, "role": role})),
        );
        assert_eq!(code, 200, "{body}");
        pubs.push(p);
    }
    let hashes: Vec<u64> = (1..=8).collect();
    pubs[0].send(json!([{"type": "stored", "hashes": hashes, "medium": "GPU"}]), true);
    eventually("p1's blocks", || gpu(&query(addr, &hashes), "p1") == 128);

    let req = |input_len: u64, ttft: f64| {
        json!({"model": "m", "block_size": 16, "seq_hashes": hashes, "input_len": input_len,
            "output_len": 100, "ttft_slo_ms": ttft, "tbt_slo_ms": 100.0})
    };
    // Both idle: the one holding the prefix, decoded on the decode instance.
    let (code, v) = route(addr, req(200, 10_000.0));
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (v["prefill"]["instance_id"].as_str(), v["prefill"]["dp_rank"].as_u64()),
        (Some("p1"), Some(0))
    );
    assert_eq!(v["decode"]["instance_id"], "d1");
    assert_eq!((v["prefix_tokens"].as_u64(), v["transfer_tokens"].as_u64()), (Some(128), Some(0)));

    // A long uncached prompt sent to p1 keeps it busy for seconds...
    let (code, v) = route(
        addr,
        json!({"model": "m", "block_size": 16, "seq_hashes": [999], "input_len": 60_000,
            "output_len": 10, "ttft_slo_ms": 60_000.0, "tbt_slo_ms": 100.0,
            "prefill_instances": ["p1"]}),
    );
    assert_eq!((code, v["prefill"]["instance_id"].as_str()), (200, Some("p1")), "{v}");
    assert!(v["predicted_ttft_ms"].as_f64().unwrap() > 2000.0, "{v}");
    // ...so the cached request now goes to p2, which fetches the prefix from p1's GPU (the
    // pool does not have it: a replication hint).
    let (code, v) = route(addr, req(200, 10_000.0));
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["prefill"]["instance_id"], "p2", "{v}");
    assert_eq!(v["fetch_from"], "instance:p1");
    assert_eq!(
        (v["transfer_tokens"].as_u64(), v["replicate_hint"].as_bool()),
        (Some(128), Some(true))
    );

    // Early rejection: a TTFT no instance can meet is refused before any prefill runs.
    let (code, v) = route(addr, req(60_000, 500.0));
    assert_eq!((code, v["reason"].as_str()), (429, Some("ttft")), "{v}");
    assert!(v["predicted_ttft_ms"].as_f64().unwrap() > 500.0);
    // Named candidates override the registered ones: p1 despite its queue.
    let mut r = req(200, 10_000.0);
    r["prefill_instances"] = json!(["p1"]);
    let (code, v) = route(addr, r);
    assert_eq!((code, v["prefill"]["instance_id"].as_str()), (200, Some("p1")), "{v}");
    assert!(v["predicted_ttft_ms"].as_f64().unwrap() > 2000.0, "{v}");

    // No instance for the model; malformed requests.
    let mut r = req(200, 10_000.0);
    r["model"] = json!("other");
    let (code, v) = route(addr, r);
    assert_eq!((code, v["reason"].as_str()), (503, Some("no_instance")), "{v}");
    let (code, v) = route(addr, json!({"model": "m", "block_size": 16, "seq_hashes": [1]}));
    assert_eq!(code, 400, "{v}");
    let mut r = req(200, 10_000.0);
    r["tbt_slo_ms"] = json!(-1.0);
    assert_eq!(route(addr, r).0, 400);
    let (code, _) = http(
        addr,
        "POST",
        "/register",
        Some(&json!({"endpoint": "tcp://127.0.0.1:1", "modelname": "m", "instance_id": "z",
            "block_size": 16, "role": "janitor"})),
    );
    assert_eq!(code, 400);

    assert_eq!(metric(addr, "routes_accepted_total"), 4);
    assert_eq!(metric(addr, "routes_rejected_ttft_total"), 1);
    assert_eq!(metric(addr, "routes_no_instance_total"), 1);
    assert_eq!(metric(addr, "replicate_hints_total"), 1);
    let (_, body) = http(addr, "GET", "/metrics", None);
    assert!(body.contains("kvfs_conductor_prefill_queue_seconds{instance=\"p1\"}"), "{body}");
}

/// The HTTP service's threads serve keep-alive connections each to the end, several at once,
/// and stop with the `serve` future: afterwards nothing accepts on the address.
#[test]
fn the_http_threads_serve_many_connections_and_stop_with_serve() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let shared = Shared::new(&Config::default());
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = rt.spawn(kvfs_conductor::service::serve(listener, shared));
    // Eight keep-alive connections, each asking twice, interleaved.
    let mut conns: Vec<_> = (0..8)
        .map(|_| {
            let s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            (BufReader::new(s.try_clone().unwrap()), s)
        })
        .collect();
    for _ in 0..2 {
        for (rd, wr) in &mut conns {
            wr.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut head = String::new();
            loop {
                let mut line = String::new();
                assert!(rd.read_line(&mut line).unwrap() > 0, "the connection closed");
                if line == "\r\n" {
                    break;
                }
                head.push_str(&line);
            }
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            let mut body = [0u8; 3];
            rd.read_exact(&mut body).unwrap();
            assert_eq!(&body, b"ok\n");
        }
    }
    serving.abort();
    let start = Instant::now();
    loop {
        match std::net::TcpStream::connect(addr) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            _ if start.elapsed() > Duration::from_secs(5) => {
                panic!("{addr} still accepts 5 s after serve was dropped")
            }
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    // Connections open at the stop are closed, not left hanging.
    let (rd, _) = &mut conns[0];
    let mut rest = Vec::new();
    assert_eq!(rd.read_to_end(&mut rest).unwrap(), 0);
}
