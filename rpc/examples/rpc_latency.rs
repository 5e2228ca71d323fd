//! Round-trip latency of one call at queue depth 1 against a trivial inline handler, over
//! loopback between two runtimes in one process: `RpcConn` from a task and from `block_on` (as
//! the Python binding calls), and `DirectConn` from `block_on`. Not a test: nothing is asserted
//! about time; it prints p50 and p99 per way, twice, interleaved.
//!
//! `cargo run --release -p kvfs-rpc --example rpc_latency`
use std::time::{Duration, Instant};

use kvfs_rpc::{DirectConn, RpcConn, RpcOptions, handler_fn, no_handler};

fn main() {
    let server_rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let l = server_rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    server_rt.spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let h = handler_fn(|_c, v: u64| async move { v + 1 });
            std::mem::forget(RpcConn::start(s, h, RpcOptions::default()));
        }
    });
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let c = rt.block_on(RpcConn::connect(&addr, no_handler(), RpcOptions::default())).unwrap();
    let mut d = rt.block_on(DirectConn::connect(&addr, RpcOptions::default())).unwrap();
    for mode in ["task", "block_on", "direct", "task", "block_on", "direct"] {
        let mut lat = Vec::new();
        for i in 0..20000u64 {
            let t = Instant::now();
            let r = if mode == "task" {
                let c = c.clone();
                rt.block_on(async move {
                    tokio::spawn(async move { c.call::<_, u64>(&i, Duration::from_secs(5)).await })
                        .await
                        .unwrap()
                })
            } else if mode == "block_on" {
                rt.block_on(c.call::<_, u64>(&i, Duration::from_secs(5)))
            } else {
                rt.block_on(d.call::<_, u64>(&i, Duration::from_micros(50)))
            };
            assert_eq!(r.unwrap(), i + 1);
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(f64::total_cmp);
        println!(
            "{mode}: p50 {:.1} us p99 {:.1} us",
            lat[lat.len() / 2],
            lat[lat.len() * 99 / 100]
        );
    }
}
