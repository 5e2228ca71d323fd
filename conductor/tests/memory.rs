//! The index's byte bound against the memory the process really allocates: a counting global
//! allocator (this test binary's only allocator) measures the live heap while events from
//! many owners (stores, removals, clears, one big prefill of 20,000 blocks) and 8,192-block
//! queries go through an index, bounded and unbounded.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvfs_conductor::event::{Event, Medium};
use kvfs_conductor::index::{Bounds, ContextKey, Index, OwnerKey};
use rand::{Rng, SeedableRng};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: as the caller's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: as the caller's contract.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() {
            grew(new - l.size());
        } else {
            LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
        }
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn stored(hashes: Vec<u64>, medium: Medium) -> Event {
    Event::Stored {
        hashes,
        parent: None,
        token_ids: Vec::new(),
        block_size: Some(16),
        medium,
        lora_name: None,
    }
}

/// Runs the workload through an index of `bounds`; the heap's growth over the index made
/// empty with its owners: (peak, at the end).
fn workload(bounds: Bounds) -> (usize, usize) {
    let ctx =
        ContextKey { tenant: "t".into(), model: "m".into(), lora: String::new(), block_size: 16 };
    let mut ix = Index::new(bounds);
    let owners: Vec<u32> = (0..400)
        .map(|i| {
            ix.owner(&OwnerKey { instance: format!("engine-{}", i / 8), dp_rank: i % 8 }, i == 0)
        })
        .collect();
    for &o in &owners {
        ix.join(o, &ctx);
    }
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut next = 0u64;
    for step in 0..4000 {
        let o = owners[rng.random_range(0..owners.len())];
        match step % 20 {
            // A prefill of a long new prompt, in one event.
            0 if step % 1000 == 0 => {
                ix.apply(o, &ctx, &stored((next..next + 20_000).collect(), Medium::Gpu));
                next += 20_000;
            }
            // Prompts shared by many owners: a prefix of blocks already held, on any medium.
            0..12 => {
                let from = next.saturating_sub(rng.random_range(0..60_000));
                let m = [Medium::Gpu, Medium::Cpu, Medium::Disk][rng.random_range(0..3)];
                ix.apply(o, &ctx, &stored((from..from + rng.random_range(16..512)).collect(), m));
            }
            12..16 => {
                ix.apply(o, &ctx, &stored((next..next + 256).collect(), Medium::Gpu));
                next += 256;
            }
            16 | 17 => {
                let from = next.saturating_sub(rng.random_range(0..60_000));
                let hashes = (from..from + 256).collect();
                ix.apply(o, &ctx, &Event::Removed { hashes, medium: Medium::Gpu });
            }
            18 if step % 200 == 18 => ix.apply(o, &ctx, &Event::Cleared),
            _ => {
                let from = next.saturating_sub(rng.random_range(0..60_000));
                ix.query(&ctx, &(from..from + 8192).collect::<Vec<u64>>());
            }
        }
    }
    let peak = PEAK.load(Ordering::Relaxed) - base;
    let end = LIVE.load(Ordering::Relaxed) - base;
    if bounds.bytes_max != usize::MAX {
        assert!(ix.bytes() <= bounds.bytes_max, "{} counted over {}", ix.bytes(), bounds.bytes_max);
        assert!(ix.stats().evicted > 0);
    }
    eprintln!(
        "bound {:>20}: peak {:>10} bytes, end {:>10}, counted {:>10}, {} entries, {} evicted",
        bounds.bytes_max,
        peak,
        end,
        ix.bytes(),
        ix.stats().entries,
        ix.stats().evicted
    );
    (peak, end)
}

#[test]
fn the_byte_bound_holds_the_heap_the_index_allocates() {
    let bytes_max = 16 << 20;
    let (peak, end) = workload(Bounds { entries_max: usize::MAX, bytes_max });
    // Beyond what the bound counts: a query's scratch (its blocks' entries, memos and run
    // lengths: about 60 bytes a block of 8,192), an event's hashes, the owners' own tables.
    let scratch = 2 << 20;
    assert!(peak <= bytes_max + scratch, "peak {peak} over {bytes_max} + {scratch}");
    assert!(end <= bytes_max + scratch, "{end} at the end");
    // A doubling holds a table's old allocation and its new one (counted so, see
    // `table_charge`); in shards that is a sixteenth of the index, so most of the bound is
    // used.
    assert!(end > bytes_max * 2 / 3, "the workload left only {end} bytes: the bound never bit");
    // One event storing far more than the bound holds: the index makes room as it goes,
    // rather than growing its tables for the whole event and evicting afterwards.
    let ctx =
        ContextKey { tenant: "t".into(), model: "m".into(), lora: String::new(), block_size: 16 };
    let mut ix = Index::new(Bounds { entries_max: usize::MAX, bytes_max });
    let o = ix.owner(&OwnerKey { instance: "engine".into(), dp_rank: 0 }, false);
    let event = stored(
        (1..=400_000u64).map(|h| h.wrapping_mul(0x2545_f491_4f6c_dd1d)).collect(),
        Medium::Gpu,
    );
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    ix.apply(o, &ctx, &event);
    let peak = PEAK.load(Ordering::Relaxed) - base;
    eprintln!("one event of 400,000 blocks: peak {peak} bytes, {} entries", ix.stats().entries);
    assert!(peak <= bytes_max + scratch, "peak {peak} over {bytes_max} + {scratch}");
    assert!(ix.stats().entries > 10_000);
    drop(ix);
    // The same workload unbounded takes well past the bound, so the bound is what held it.
    let (peak, _) = workload(Bounds::entries(usize::MAX));
    assert!(peak > 3 * bytes_max, "unbounded, the workload peaked at {peak} bytes");
}
