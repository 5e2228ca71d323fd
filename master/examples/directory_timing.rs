//! Lookup and listing times of a filled directory, for before/after comparisons of its layout
//! (run two builds alternately on the same machine; absolute times on a shared machine are
//! noise, the ratio between builds is the figure). Not a test: nothing here asserts a time.
//!
//! `cargo run --release -p kvfs-master --example directory_timing -- [objects] [rounds]`
//! (default 1 000 000 objects, 5 rounds). Keys are `tests/memory.rs`'s (64..100 bytes). Per
//! round: `exists_batch` of 10 000-key batches over hits and over misses, `get` and `stat` one
//! by one over hits, `stat` over misses, `list` of the first 100 000 keys under a prefix (pages
//! of 10 000) and `list_dir` of a directory of ~8 % of the keys. Prints the fastest and the
//! median round in ns per key (on a busy machine the fastest is the steadier figure).

use std::hint::black_box;
use std::time::Instant;

use kvfs_master::*;

const LOOKUPS: u64 = 200_000;
const BATCH: usize = 10_000;
const LISTED: usize = 100_000;
const LIST_PREFIX: &str = "model/tp0/rank1/layer-group-7/pp3";
const LIST_DIR: &str = "model/tp0/rank1/layer-group-7/pp3/";

#[path = "../tests/support/filled.rs"]
mod filled;
use filled::key;

fn directory(n: u64) -> Directory {
    let mut dir = filled::with_nodes(4);
    filled::fill(&mut dir, 0..n);
    dir
}

/// The keys of `ids`, concatenated, with their ends.
fn keys(ids: impl Iterator<Item = u64>) -> (String, Vec<usize>) {
    let mut buf = String::new();
    let mut ends = Vec::new();
    for i in ids {
        buf.push_str(&key(i));
        ends.push(buf.len());
    }
    (buf, ends)
}

fn slices((buf, ends): &(String, Vec<usize>)) -> Vec<&str> {
    let starts = std::iter::once(0).chain(ends.iter().copied());
    starts.zip(ends).map(|(a, &b)| &buf[a..b]).collect()
}

/// Nanoseconds per item of `f`, which handles `items` items.
fn time(items: usize, f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_nanos() as f64 / items as f64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let t = Instant::now();
    let mut dir = directory(n);
    let build_ns = t.elapsed().as_nanos() as f64 / n as f64;
    // spread over the whole key space, in an order unrelated to insertion
    let pick = |j: u64| (j.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) % n;
    // the keys looked up sit in one buffer: where the allocator puts 200 000 small strings
    // after the build depends on what the build freed, which differs between layouts
    let (hit_keys, miss_keys) =
        (keys((0..LOOKUPS).map(pick)), keys((0..LOOKUPS).map(|j| n + pick(j))));
    let (hits, misses) = (slices(&hit_keys), slices(&miss_keys));
    let names = ["exists_batch hit", "exists_batch miss", "get hit", "stat hit", "stat miss"];
    let names = names.iter().chain(&["list 100k", "list_dir"]);
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 7];
    let mut now_ms = 1_000;
    for _ in 0..rounds {
        now_ms += 100_000; // past every lease of the previous round
        let r = &mut samples;
        r[0].push(time(hits.len(), || {
            for b in hits.chunks(BATCH) {
                black_box(dir.exists_batch(b, now_ms));
            }
        }));
        r[1].push(time(misses.len(), || {
            for b in misses.chunks(BATCH) {
                black_box(dir.exists_batch(b, now_ms));
            }
        }));
        r[2].push(time(hits.len(), || {
            for k in &hits {
                black_box(dir.get(k, now_ms).ok());
            }
        }));
        r[3].push(time(hits.len(), || {
            for k in &hits {
                black_box(dir.stat(k).ok());
            }
        }));
        r[4].push(time(misses.len(), || {
            for k in &misses {
                black_box(dir.stat(k).ok());
            }
        }));
        let mut listed = 0;
        r[5].push(time(LISTED, || {
            let mut after: Option<String> = None;
            while listed < LISTED {
                let page = dir.list(LIST_PREFIX, after.as_deref(), BATCH).expect("list");
                listed += page.entries.len();
                after = page.next_start_after;
                black_box(page.entries);
                if after.is_none() {
                    break;
                }
            }
        }));
        let mut entries = 0;
        let t = Instant::now();
        let mut after: Option<String> = None;
        loop {
            let page = dir.list_dir(LIST_DIR, after.as_deref(), BATCH).expect("list_dir");
            entries += page.entries.len();
            after = page.next_start_after;
            black_box(page.entries);
            if after.is_none() {
                break;
            }
        }
        r[6].push(t.elapsed().as_nanos() as f64 / entries.max(1) as f64);
        assert!(listed >= LISTED.min(n as usize / 10), "listed {listed}");
    }
    println!("{n} objects, build {build_ns:.0} ns/object; ns per key over {rounds} rounds:");
    println!("  {:<18} {:>8} {:>8}", "", "min", "median");
    for (name, s) in names.zip(&mut samples) {
        s.sort_by(f64::total_cmp);
        println!("  {name:<18} {:8.1} {:8.1}", s[0], s[s.len() / 2]);
    }
}
