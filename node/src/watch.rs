//! A watch on the node's own async runtime, from a thread outside it.
//!
//! A node whose runtime stops running tasks (two of them deadlocked on each other's locks,
//! every worker stuck in a blocking call) goes silent while its process looks alive: it
//! answers no transfer or master request and sends no heartbeat, and the master expires it
//! with everything it holds. The watch says so in the node's log, with how long, again when the
//! runtime runs once more, and counts it (`NodeStats::runtime_stalls`, shown by the master as
//! `kvfs_node_runtime_stalls_total`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a task on the runtime marks that it ran.
const BEAT: Duration = Duration::from_millis(100);
/// How often the watching thread looks.
const LOOK: Duration = Duration::from_millis(250);
/// How long the runtime may go without running the beat before it counts as stalled.
const STALL: Duration = Duration::from_secs(1);

/// Stops its thread and its task when dropped.
pub(crate) struct RuntimeWatch {
    stalls: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    beat: tokio::task::JoinHandle<()>,
}

impl RuntimeWatch {
    /// Starts the beat on the current runtime and the watching thread.
    pub(crate) fn start(node: u64) -> std::io::Result<RuntimeWatch> {
        let epoch = Instant::now();
        let last = Arc::new(AtomicU64::new(0));
        let beat = {
            let last = last.clone();
            tokio::spawn(async move {
                loop {
                    last.store(ms_since(epoch), Ordering::Relaxed);
                    tokio::time::sleep(BEAT).await;
                }
            })
        };
        let stalls = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (stalls.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("kvfs-node-watch".into())
            .spawn(move || watch(node, epoch, &last, &s, &st));
        if let Err(e) = spawned {
            beat.abort();
            return Err(e);
        }
        Ok(RuntimeWatch { stalls, stop, beat })
    }

    /// Stalls seen so far.
    pub(crate) fn stalls(&self) -> u64 {
        self.stalls.load(Ordering::Relaxed)
    }
}

impl Drop for RuntimeWatch {
    fn drop(&mut self) {
        // The thread sees it within one look and ends; nobody waits for it.
        self.stop.store(true, Ordering::Relaxed);
        self.beat.abort();
    }
}

fn ms_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

fn watch(node: u64, epoch: Instant, last: &AtomicU64, stalls: &AtomicU64, stop: &AtomicBool) {
    let stall_ms = STALL.as_millis() as u64;
    // The beat last seen when a stall was reported.
    let mut stalled_at: Option<u64> = None;
    let mut woke = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(LOOK);
        let now = Instant::now();
        // This thread itself did not run for a stall's length (the process was stopped, the
        // machine paused): the runtime had no chance either, so no verdict this time.
        let overslept = now.duration_since(woke) > LOOK + STALL;
        woke = now;
        let beat = last.load(Ordering::Relaxed);
        let quiet_ms = ms_since(epoch).saturating_sub(beat);
        match stalled_at {
            None if !overslept && quiet_ms >= stall_ms => {
                stalls.fetch_add(1, Ordering::Relaxed);
                stalled_at = Some(beat);
                tracing::error!(
                    node,
                    quiet_ms,
                    "node runtime stalled: no task has run for {quiet_ms} ms, so the node \
                     answers nothing and sends no heartbeat (the master expires a node silent \
                     past its TTL); a deadlock or every runtime worker blocked"
                );
            }
            Some(at) if beat != at => {
                stalled_at = None;
                tracing::warn!(
                    node,
                    stalled_ms = beat.saturating_sub(at),
                    "node runtime running again"
                );
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's only worker blocked (as a deadlock would leave it): one stall is counted
    /// and the watch sees the runtime run again after.
    #[test]
    fn a_blocked_runtime_is_reported_once_per_stall() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let watch = rt.block_on(async { RuntimeWatch::start(7) }).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(watch.stalls(), 0, "a runtime that runs is not stalled");
        rt.block_on(async {
            tokio::spawn(async { std::thread::sleep(STALL * 2) }).await.unwrap();
        });
        // Running again: no second stall for the same one.
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(watch.stalls(), 1);
        drop(watch);
    }
}
