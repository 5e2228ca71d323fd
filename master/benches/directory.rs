//! Directory benchmarks on 1 M objects: batch `exists` (the hottest master call: engines ask
//! for every block of a prompt), batch `get`, and put_start + put_end.
//!
//! `cargo bench -p kvfs-master --bench directory`; keys are 64..100 bytes. The printed
//! `keys/s` line is the figure (criterion's time is per batch of 10 000 keys).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfs_master::*;

const OBJECTS: u64 = 1_000_000;
const BATCH: usize = 10_000;

#[path = "../tests/support/filled.rs"]
mod filled;
use filled::key;

fn directory() -> Directory {
    let mut dir = filled::with_nodes(16);
    filled::fill(&mut dir, 0..OBJECTS);
    dir
}

fn bench(c: &mut Criterion) {
    let mut dir = directory();
    // half hits, half misses, in random order
    let batches: Vec<Vec<String>> = (0..16u64)
        .map(|b| (0..BATCH as u64).map(|i| key((b * 7919 + i * 104_729) % (2 * OBJECTS))).collect())
        .collect();
    let mut g = c.benchmark_group("directory_1M");
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut n = 0usize;
    g.bench_function("exists_batch_10k", |b| {
        b.iter(|| {
            n += 1;
            dir.exists_batch(&batches[n % batches.len()], 1_000)
        })
    });
    g.bench_function("exists_10k_one_by_one", |b| {
        b.iter(|| {
            n += 1;
            let keys = &batches[n % batches.len()];
            keys.iter().filter(|k| dir.exists(k, 1_000).unwrap_or(false)).count()
        })
    });
    g.bench_function("get_batch_10k", |b| {
        b.iter(|| {
            n += 1;
            dir.get_batch(&batches[n % batches.len()], 1_000)
        })
    });
    let mut fx = Vec::new();
    let mut i = OBJECTS * 4;
    g.throughput(Throughput::Elements(1));
    g.bench_function("put_start+put_end", |b| {
        b.iter(|| {
            i += 1;
            dir.put_start(&PutStart::new(key(i), 64 << 10), 0, &mut fx).unwrap();
            dir.put_end(&PutEnd::new(key(i), None), 0, &mut fx).unwrap();
            fx.clear();
        })
    });
    g.finish();

    // a plain rate line, independent of criterion's report format
    let start = std::time::Instant::now();
    let mut found = 0;
    for r in 0..100 {
        found += dir
            .exists_batch(&batches[r % batches.len()], 2_000)
            .iter()
            .filter(|r| matches!(r, Ok(true)))
            .count();
    }
    let rate = (100 * BATCH) as f64 / start.elapsed().as_secs_f64();
    eprintln!(
        "exists_batch: {:.2} M keys/s on one core ({found} hits of {})",
        rate / 1e6,
        100 * BATCH
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
