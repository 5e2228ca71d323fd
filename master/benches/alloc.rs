//! Allocator micro-benchmarks: steady-state alloc + free on a fragmented segment.
//!
//! `cargo bench -p kvfs-master --bench alloc`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvfs_master::alloc::Allocator;

/// A 64 GiB segment holding ~50 000 KV objects of 64 KiB..4 MiB with holes between them.
fn fragmented() -> (Allocator, Vec<(u64, u64)>) {
    let mut a = Allocator::new(64 << 30, 4096);
    let mut live = Vec::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..60_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (64 << 10) * (1 + x % 64);
        if let Some(off) = a.alloc(len) {
            live.push((off, len));
        }
    }
    for i in (0..live.len()).rev().step_by(5) {
        let (off, len) = live.swap_remove(i);
        a.free(off, len).unwrap();
    }
    (a, live)
}

fn bench(c: &mut Criterion) {
    let (mut a, live) = fragmented();
    eprintln!(
        "free blocks: {}, used {:.1} %",
        a.free_blocks(),
        100.0 * a.used_bytes() as f64 / a.capacity() as f64
    );
    let mut i = 0u64;
    c.bench_function("alloc+free 64KiB..4MiB, fragmented 64 GiB segment", |b| {
        b.iter(|| {
            i = i.wrapping_add(0x9E37_79B9);
            let len = (64 << 10) * (1 + i % 64);
            let off = a.alloc(black_box(len)).expect("space");
            a.free(off, len).unwrap();
        })
    });
    let mut a = Allocator::new(64 << 30, 4096);
    c.bench_function("alloc+free 1 MiB, empty segment", |b| {
        b.iter(|| {
            let off = a.alloc(black_box(1 << 20)).expect("space");
            a.free(off, 1 << 20).unwrap();
        })
    });
    drop(live);
}

criterion_group!(benches, bench);
criterion_main!(benches);
