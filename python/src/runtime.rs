//! One tokio runtime per process, and the one way Python calls reach it.
//!
//! Mechanism. Every I/O call of the extension runs [`call`]: the GIL is released
//! (`Python::detach`), the calling thread blocks on the shared runtime, and the future runs
//! under a deadline. Many Python threads may block at once; the runtime's workers do the I/O.
//!
//! Policy. The runtime has a small fixed number of workers (the machine's parallelism, at most
//! four): the bytes are moved by the Transfer Engine's own tasks and blocking threads, so more
//! workers only add contention with the Python threads.
//!
//! Fork. A tokio runtime does not survive `fork()`: a child that inherits one would block
//! forever on workers that do not exist. The runtime remembers the pid that built it; a call
//! from another pid builds a fresh runtime and leaks the inherited one (dropping it would
//! try to join threads the child does not have). Clients made before the fork are not usable
//! in the child (their connections belong to the parent); make new ones there, or start
//! children with `spawn`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::Python;
use tokio::runtime::Runtime;

use crate::errors::Failure;

struct Shared {
    pid: u32,
    rt: Arc<Runtime>,
}

static RUNTIME: Mutex<Option<Shared>> = Mutex::new(None);

/// The process's runtime, built on first use (and again in a forked child).
pub fn runtime() -> Result<Arc<Runtime>, Failure> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = slot.as_ref().filter(|s| s.pid == pid) {
        return Ok(s.rt.clone());
    }
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 4);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("kvfs-py")
        .enable_all()
        .build()
        .map_err(|e| Failure::internal(format!("cannot start the tokio runtime: {e}")))?;
    let rt = Arc::new(rt);
    if let Some(old) = slot.replace(Shared { pid, rt: rt.clone() }) {
        // Inherited across fork: its threads are gone, so it must never be dropped.
        std::mem::forget(old);
    }
    Ok(rt)
}

/// Runs `fut` on the runtime with the GIL released, failing with a timeout after `limit`.
pub fn call<T, F>(py: Python<'_>, op: &'static str, limit: Duration, fut: F) -> Result<T, Failure>
where
    F: Future<Output = Result<T, Failure>> + Send,
    T: Send,
{
    let rt = runtime()?;
    py.detach(|| {
        rt.block_on(async {
            match tokio::time::timeout(limit, fut).await {
                Ok(r) => r,
                Err(_) => Err(Failure::timeout(op, limit)),
            }
        })
    })
}

/// Runs `fut` on the runtime without a Python thread state (teardown paths, drops).
pub fn block_on_detached<T, F: Future<Output = T>>(fut: F) -> Option<T> {
    runtime().ok().map(|rt| rt.block_on(fut))
}
