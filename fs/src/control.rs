//! `/.kvfs/`: the fast path's control file and read-only JSON status files.
//!
//! - `control`: the ioctl target (reading it says which ABI it speaks);
//! - `status.json`: this mount: mount point, master, limits, counters, staging in use;
//! - `cluster.json`: the master's figures (objects, nodes, tiers);
//! - `buffers.json`: buffers registered on the fast path (id, pid, bytes).
//!
//! Files are rendered when opened and read with direct I/O, so they report size 0 (as /proc
//! files do) and each open sees fresh figures.

use std::sync::atomic::Ordering;

use serde_json::json;

use crate::state::{Inner, lock};

/// What reading the control file returns.
pub fn control_text() -> Vec<u8> {
    format!(
        "kvfs fast path, ABI {}: ioctl KVFS_IOC_INFO/REGISTER/UNREGISTER/SUBMIT on this file (see kvfs.h)\n",
        kvfs_fs_abi::ABI_VERSION
    )
    .into_bytes()
}

/// The text of status file `which` (an index into `STATUS_FILES`).
pub async fn render(inner: &Inner, which: usize) -> Vec<u8> {
    let v = match which {
        0 => {
            let cfg = &inner.cfg;
            json!({
                "mountpoint": cfg.mountpoint.display().to_string(),
                "master": inner.client.master_addr(),
                "abi_version": kvfs_fs_abi::ABI_VERSION,
                "passthrough": cfg.passthrough.is_some(),
                "staging_bytes": inner.staging.used(),
                "staging_bytes_max": cfg.staging_bytes_max,
                "staging_file_bytes_max": cfg.staging_file_bytes_max,
                "fetch_bytes_max": cfg.fetch_bytes_max,
                "pending_writes": lock(&inner.pending).len(),
                "open_handles": lock(&inner.handles).len(),
                "inodes": lock(&inner.table).len(),
                "passthrough_inodes": lock(&inner.backings).len(),
                "counters": inner.counters.to_json(),
                "uptime_s": inner.started.elapsed().map(|d| d.as_secs()).unwrap_or(0),
            })
        }
        1 => match inner.client.stats().await {
            Ok(s) => serde_json::to_value(&s).unwrap_or_default(),
            Err(e) => json!({ "error": e.to_string() }),
        },
        _ => {
            let bufs: Vec<_> = inner
                .fastpath
                .buffers()
                .into_iter()
                .map(|(id, pid, bytes)| json!({ "id": id, "pid": pid, "bytes": bytes }))
                .collect();
            json!({
                "buffers": bufs,
                "registrations": inner.counters.fastpath_registrations.load(Ordering::Relaxed),
            })
        }
    };
    let mut text = serde_json::to_vec_pretty(&v).unwrap_or_default();
    text.push(b'\n');
    text
}
