//! The directory's memory per object, measured two ways against its own estimate
//! (`Stats::metadata_bytes`): a counting global allocator (bytes requested from malloc) and the
//! process's resident set growth.
//!
//! The default test uses 50 000 objects; the ignored ones 1 000 000 and 10 000 000 and print
//! the figures: `cargo test --release -p kvfs-master --test memory -- --ignored --nocapture`.
//! RSS growth is only honest in a fresh process (memory a previous test freed may be reused
//! without growing RSS), so run one ignored test per command, e.g. `... -- --ignored
//! --nocapture --exact ten_million_objects_fit_in_2_gib`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

#[path = "support/filled.rs"]
mod filled;

struct Counting;

static ALLOCATED: AtomicI64 = AtomicI64::new(0);
/// The counter is process-wide: tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

// SAFETY: every call forwards to the system allocator with the caller's arguments unchanged;
// the counter is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATED.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// Per-object figures, in bytes.
struct Figures {
    estimate: f64,
    counted: f64,
    rss: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Fill a 4-node directory with `n` single-replica objects whose keys are 64..100 bytes.
fn measure(n: u64) -> Figures {
    let mut dir = filled::with_nodes(4);
    let (count0, rss0) = (ALLOCATED.load(Ordering::Relaxed), rss_bytes());
    filled::fill(&mut dir, 0..n);
    let counted = (ALLOCATED.load(Ordering::Relaxed) - count0) as f64 / n as f64;
    let rss = rss_bytes().saturating_sub(rss0) as f64 / n as f64;
    let stats = dir.stats();
    assert_eq!(stats.objects, n);
    Figures { estimate: stats.metadata_bytes_per_object, counted, rss }
}

#[test]
fn estimate_matches_counted_allocations() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = measure(50_000);
    eprintln!("50k objects: estimate {:.0} B, allocated {:.0} B per object", f.estimate, f.counted);
    // the estimate adds malloc chunk overhead the counter does not see: a bit above, not far
    assert!(
        f.estimate >= f.counted * 0.95 && f.estimate <= f.counted * 1.35,
        "{:.0} vs {:.0}",
        f.estimate,
        f.counted
    );
    assert!(f.estimate < 300.0);
}

#[test]
#[ignore = "1 M objects: run with --release --ignored --nocapture"]
fn one_million_objects_fit_in_300_bytes_each() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let f = measure(1_000_000);
    eprintln!(
        "1M objects: estimate {:.0} B, allocated {:.0} B, RSS growth {:.0} B per object",
        f.estimate, f.counted, f.rss
    );
    assert!(f.estimate < 300.0 && f.counted < 300.0 && f.rss < 300.0);
}

#[test]
#[ignore = "10 M objects (several GB of RAM): run with --release --ignored --nocapture"]
fn ten_million_objects_fit_in_2_gib() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = 10_000_000;
    let f = measure(n);
    let (counted, rss) = (f.counted * n as f64 / GIB, f.rss * n as f64 / GIB);
    eprintln!(
        "10M objects: RSS growth {rss:.3} GiB ({:.0} B per object), allocated {counted:.3} GiB \
         ({:.0} B per object), estimate {:.0} B per object",
        f.rss, f.counted, f.estimate
    );
    assert!(rss < 2.0 && counted < 2.0, "RSS {rss:.3} GiB, allocated {counted:.3} GiB");
}
