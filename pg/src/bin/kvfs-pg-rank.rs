//! One member of a process group in its own process, driven by commands on stdin (one per
//! line, one answer line each on stdout). The multi-process tests and `kvfs bench pg` use it;
//! it is also a way to poke a running group by hand.
//!
//! Usage: kvfs-pg-rank COORDINATOR SLOT WORLD [KEY=VALUE...]
//! Settings: staging_bytes, inline_bytes_max, op_timeout_ms, suspect_after_ms, tcp_only=1.
//! Commands (data comes from `kvfs_pg::testing::data(seed, slot, dtype, count)`):
//!   allreduce DTYPE OP COUNT SEED          -> ok HASH | err KIND DETAIL
//!   reduce DTYPE OP COUNT SEED ROOT        -> ok HASH (root) / ok - (others)
//!   reduce_scatter DTYPE OP COUNT SEED     (COUNT elements per rank block)
//!   broadcast BYTES SEED ROOT              allgather BYTES SEED
//!   gather BYTES SEED ROOT                 scatter BYTES SEED ROOT (BYTES per rank)
//!   alltoall BYTES SEED (per rank block)   alltoallv SEED (block j of rank i: (i+2j)%5*1000+7 bytes)
//!   send DST TAG BYTES SEED                recv SRC TAG BYTES
//!   frame_at_epoch SLOT EPOCH (an empty frame stamped with EPOCH, for the stale-frame test)
//!   barrier | view | counters | change ACTIVATE DEACTIVATE (comma lists, - for none) | close
//!   time N CMD...                          (runs CMD N times, answers `ok P50_US P99_US`)
//! HASH is the blake3 of the result bytes, hex.

use std::io::{BufRead, Write};
use std::time::Instant;

use kvfs_pg::testing::data;
use kvfs_pg::{DType, Group, PgConfig, ReduceOp};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 || args.iter().any(|a| a == "--help" || a == "-h") {
        eprintln!(
            "usage: kvfs-pg-rank COORDINATOR SLOT WORLD [KEY=VALUE...] (commands on stdin; see the source's notes)"
        );
        std::process::exit(if args.iter().any(|a| a == "--help") { 0 } else { 2 });
    }
    let slot: u32 = args[2].parse().expect("SLOT is a number");
    let world: u32 = args[3].parse().expect("WORLD is a number");
    let mut cfg = PgConfig::default();
    for kv in &args[4..] {
        let (k, v) = kv.split_once('=').expect("settings are KEY=VALUE");
        let n = || v.parse::<u64>().expect("a number");
        match k {
            "staging_bytes" => cfg.staging_bytes = n() as usize,
            "inline_bytes_max" => cfg.inline_bytes_max = n() as usize,
            "op_timeout_ms" => cfg.op_timeout_ms = n(),
            "suspect_after_ms" => cfg.suspect_after_ms = n(),
            "tcp_only" => cfg.transports = kvfs_transfer::Transports::tcp_only(),
            other => panic!("unknown setting {other}"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let group = match rt.block_on(Group::join(&args[1], slot, world, cfg)) {
        Ok(g) => g,
        Err(e) => {
            println!("err {:?} {e}", e.kind());
            std::process::exit(1);
        }
    };
    println!("joined {} epoch {}", slot, group.epoch());
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        if words[0] == "exit" {
            break;
        }
        let answer = if words[0] == "time" {
            let n: usize = words[1].parse().expect("N");
            let mut lat = Vec::with_capacity(n);
            let mut last = String::new();
            for _ in 0..n {
                let t = Instant::now();
                last = rt.block_on(run(&group, &words[2..]));
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                if last.starts_with("err") {
                    break;
                }
            }
            lat.sort_by(f64::total_cmp);
            if last.starts_with("err") {
                last
            } else {
                let p = |q: f64| lat[((lat.len() as f64 - 1.0) * q).round() as usize];
                format!("ok {:.1} {:.1}", p(0.5), p(0.99))
            }
        } else {
            rt.block_on(run(&group, &words))
        };
        println!("{answer}");
        let _ = std::io::stdout().flush();
    }
    // Peers may still be reading this process's staging for the last operation.
    rt.block_on(group.close());
}

fn hash(b: &[u8]) -> String {
    blake3::hash(b).to_hex().to_string()
}

fn answer(r: kvfs_pg::Result<String>) -> String {
    match r {
        Ok(s) => format!("ok {s}"),
        Err(e) => format!("err {:?} {e}", e.kind()),
    }
}

async fn run(g: &Group, w: &[&str]) -> String {
    let num =
        |i: usize| -> u64 { w.get(i).and_then(|s| s.parse().ok()).expect("a numeric argument") };
    let slot = g.slot();
    let n = g.active().len();
    let me = g.active().iter().position(|&s| s == slot).unwrap_or(0);
    match w[0] {
        "allreduce" | "reduce" | "reduce_scatter" => {
            let dt = match DType::parse(w[1]) {
                Ok(d) => d,
                Err(e) => return answer(Err(e)),
            };
            let op = match ReduceOp::parse(w[2]) {
                Ok(o) => o,
                Err(e) => return answer(Err(e)),
            };
            let (count, seed) = (num(3) as usize, num(4));
            match w[0] {
                "allreduce" => {
                    let mut d = data(seed, slot, dt, count);
                    answer(g.allreduce(&mut d, dt, op).await.map(|()| hash(&d)))
                }
                "reduce" => {
                    let root = num(5) as u32;
                    let mut d = data(seed, slot, dt, count);
                    answer(
                        g.reduce(&mut d, dt, op, root)
                            .await
                            .map(|()| if root == slot { hash(&d) } else { "-".into() }),
                    )
                }
                _ => {
                    let input = data(seed, slot, dt, count * n);
                    let mut out = vec![0u8; count * dt.size()];
                    answer(g.reduce_scatter(&input, &mut out, dt, op).await.map(|()| hash(&out)))
                }
            }
        }
        "broadcast" => {
            let (bytes, seed, root) = (num(1) as usize, num(2), num(3) as u32);
            let mut d =
                if slot == root { data(seed, slot, DType::U8, bytes) } else { vec![0; bytes] };
            answer(g.broadcast(&mut d, root).await.map(|()| hash(&d)))
        }
        "allgather" => {
            let (bytes, seed) = (num(1) as usize, num(2));
            let d = data(seed, slot, DType::U8, bytes);
            let mut out = vec![0; bytes * n];
            answer(g.allgather(&d, &mut out).await.map(|()| hash(&out)))
        }
        "gather" => {
            let (bytes, seed, root) = (num(1) as usize, num(2), num(3) as u32);
            let d = data(seed, slot, DType::U8, bytes);
            let mut out = vec![0; bytes * n];
            let is_root = slot == root;
            let r = g.gather(&d, if is_root { Some(&mut out) } else { None }, root).await;
            answer(r.map(|()| if is_root { hash(&out) } else { "-".into() }))
        }
        "scatter" => {
            let (bytes, seed, root) = (num(1) as usize, num(2), num(3) as u32);
            let input = data(seed, slot, DType::U8, bytes * n);
            let mut out = vec![0; bytes];
            let r = g.scatter(if slot == root { Some(&input) } else { None }, &mut out, root).await;
            answer(r.map(|()| hash(&out)))
        }
        "alltoall" => {
            let (bytes, seed) = (num(1) as usize, num(2));
            let input = data(seed, slot, DType::U8, bytes * n);
            let mut out = vec![0; bytes * n];
            answer(g.alltoall(&input, &mut out).await.map(|()| hash(&out)))
        }
        "alltoallv" => {
            let seed = num(1);
            let size = |i: usize, j: usize| ((i + 2 * j) % 5 * 1000 + 7) as u64;
            let send: Vec<u64> = (0..n).map(|j| size(me, j)).collect();
            let recv: Vec<u64> = (0..n).map(|i| size(i, me)).collect();
            let input = data(seed, slot, DType::U8, send.iter().sum::<u64>() as usize);
            let mut out = vec![0; recv.iter().sum::<u64>() as usize];
            answer(g.alltoallv(&input, &send, &mut out, &recv).await.map(|()| hash(&out)))
        }
        "send" => {
            let (dst, tag, bytes, seed) = (num(1) as u32, num(2) as u32, num(3) as usize, num(4));
            let d = data(seed, slot, DType::U8, bytes);
            answer(g.send(&d, dst, tag).await.map(|()| "-".into()))
        }
        "recv" => {
            let (src, tag, bytes) = (num(1) as u32, num(2) as u32, num(3) as usize);
            let mut out = vec![0; bytes];
            answer(g.recv(&mut out, src, tag).await.map(|()| hash(&out)))
        }
        "barrier" => answer(g.barrier().await.map(|()| "-".into())),
        "view" => {
            let v = g.view();
            format!(
                "ok {} {}",
                v.epoch,
                v.slots().iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            )
        }
        "counters" => {
            let c = g.counters();
            format!(
                "ok stale_refused={} restarted={} suspects={}",
                c.stale_refused, c.restarted, c.suspects_reported
            )
        }
        "change" => {
            let list = |s: &str| -> Vec<u32> {
                if s == "-" {
                    vec![]
                } else {
                    s.split(',').map(|x| x.parse().expect("slot")).collect()
                }
            };
            answer(
                g.change(&list(w[1]), &list(w[2]))
                    .await
                    .map(|v| format!("{} {:?}", v.epoch, v.slots())),
            )
        }
        "frame_at_epoch" => {
            answer(g.send_frame_at_epoch(num(1) as u32, num(2)).await.map(|()| "-".into()))
        }
        "close" => {
            g.close().await;
            "ok -".into()
        }
        other => format!("err InvalidArgument unknown command {other}"),
    }
}
