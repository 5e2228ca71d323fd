//! Host tests of the rdma feature (`cargo test -p kvfs-transfer --features rdma`): they need no
//! RDMA device. An engine with rdma enabled starts where there is no device (or no rdma-core),
//! and reaches peers over tcp with every byte checked; rdma-enabled and plain engines shake
//! hands in both directions. Where a device does exist (a guest with Soft-RoCE), the same tests
//! expect rdma instead, so they still check what a user would see.
#![cfg(feature = "rdma")]

use std::sync::Arc;

use kvfs_transfer::testing::{fill_pattern, pattern};
use kvfs_transfer::{
    Buffer, BufferOptions, Engine, EngineConfig, TransferOp, TransferRequest, TransportKind,
    Transports,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BUF: usize = 8 << 20;

fn transports(rdma: bool) -> Transports {
    Transports { shm: false, rdma, tcp: true }
}

async fn engine(rdma: bool, seed: u64) -> (Engine, Arc<Buffer>) {
    let cfg = EngineConfig { transports: transports(rdma), ..EngineConfig::default() };
    let engine = Engine::start(cfg).await.expect("engine starts with or without an RDMA device");
    let buf = engine.alloc_buffer(BUF, &BufferOptions::default()).unwrap();
    fill(&buf, seed);
    (engine, buf)
}

fn fill(buf: &Buffer, seed: u64) {
    // SAFETY: callers fill only while no transfer runs.
    fill_pattern(unsafe { buf.as_mut_slice() }, seed, 0);
}

/// Random reads and writes from `a` to `b`, checked against a model of both buffers.
async fn exchange(a: &Engine, la: &Buffer, b: &Engine, rb: &Buffer, seed: u64) -> TransportKind {
    let seg = a.open_segment(b.name()).await.unwrap();
    let both_rdma = a.rdma_device().is_some() && b.rdma_device().is_some();
    let expect = if both_rdma { TransportKind::Rdma } else { TransportKind::Tcp };
    let kind = seg.transport_for(rb.addr(), 1).unwrap();
    assert_eq!(kind, expect, "rdma devices: {:?} {:?}", a.rdma_device(), b.rdma_device());
    assert_eq!(seg.status().rdma.is_some(), both_rdma, "{:?}", seg.status());
    fill(la, 1);
    fill(rb, 2);
    let mut local_model = pattern(1, 0, BUF);
    let mut remote_model = pattern(2, 0, BUF);
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..3 {
        // Disjoint ranges: each item owns one 512 KiB stripe of both buffers.
        let stripes = BUF / (512 << 10);
        let mut reqs = Vec::new();
        let mut moves = Vec::new();
        for s in 0..stripes {
            let len = rng.random_range(1..=256 << 10);
            let (lo, ro) = (s * (512 << 10), s * (512 << 10) + rng.random_range(0..=256 << 10));
            let op = if rng.random_bool(0.5) { TransferOp::Read } else { TransferOp::Write };
            reqs.push(TransferRequest {
                op,
                segment: seg.clone(),
                local_addr: la.addr() + lo as u64,
                remote_addr: rb.addr() + ro as u64,
                len: len as u64,
            });
            moves.push((op, lo, ro, len));
        }
        let results = a.transfer(reqs).await.unwrap();
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        for (op, lo, ro, len) in moves {
            match op {
                TransferOp::Read => {
                    local_model[lo..lo + len].copy_from_slice(&remote_model[ro..ro + len])
                }
                TransferOp::Write => {
                    remote_model[ro..ro + len].copy_from_slice(&local_model[lo..lo + len])
                }
            }
        }
        // SAFETY: the batch has completed; nothing writes either buffer now.
        let (got_l, got_r) = unsafe { (la.as_slice(), rb.as_slice()) };
        assert_eq!(blake3::hash(got_l), blake3::hash(&local_model), "local bytes");
        assert_eq!(blake3::hash(got_r), blake3::hash(&remote_model), "remote bytes");
    }
    kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_enabled_engines_start_without_a_device_and_use_tcp() {
    let (a, la) = engine(true, 1).await;
    let (b, rb) = engine(true, 2).await;
    let kind = exchange(&a, &la, &b, &rb, 7).await;
    if a.rdma_device().is_none() {
        assert_eq!(kind, TransportKind::Tcp);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_enabled_and_plain_engines_shake_hands_both_ways() {
    let (rdma, l_rdma) = engine(true, 1).await;
    let (plain, l_plain) = engine(false, 2).await;
    assert_eq!(plain.rdma_device(), None);
    assert_eq!(exchange(&rdma, &l_rdma, &plain, &l_plain, 8).await, TransportKind::Tcp);
    assert_eq!(exchange(&plain, &l_plain, &rdma, &l_rdma, 9).await, TransportKind::Tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_memory_registers_and_moves_with_rdma_enabled() {
    let (a, _la) = engine(true, 1).await;
    let (b, rb) = engine(true, 2).await;
    let mut raw = vec![0u8; 1 << 20];
    // SAFETY: `raw` outlives the registration (unregistered below) and no Rust reference to it
    // is used while a transfer runs.
    unsafe { a.register_memory(raw.as_mut_ptr() as u64, raw.len() as u64, false).unwrap() };
    let seg = a.open_segment(b.name()).await.unwrap();
    let req = TransferRequest {
        op: TransferOp::Read,
        segment: seg,
        local_addr: raw.as_ptr() as u64,
        remote_addr: rb.addr() + 4096,
        len: raw.len() as u64,
    };
    a.transfer_one(&req).await.unwrap();
    a.unregister(raw.as_ptr() as u64).unwrap();
    assert!(raw == pattern(2, 4096, 1 << 20), "raw memory got the peer's bytes");
}
