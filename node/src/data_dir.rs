//! The node's data directory: its identity and the lock that keeps two nodes out of it.
//!
//! Layout (`DIR` is `NodeConfig::data_dir`):
//! - `DIR/LOCK`: held with `flock` for the node's life (the kernel drops it when the process
//!   dies, so a node killed with SIGKILL can be started again at once);
//! - `DIR/node-id`: the node's id in decimal, written once (temp file, fsync, rename): a
//!   restarted node is the same node, so the master matches the NVMe objects it re-reports
//!   with the node it knew;
//! - `DIR/nvme/`: the NVMe tier (see `kvfs_tiers::nvme`);
//! - `DIR/writeback.journal`: the lazy write-back queue's journal.
//!
//! Policy: an id given in the configuration must match the stored one (a clear error
//! otherwise: two nodes must never share a directory's objects under two ids).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use kvfs_client::{Error, ErrorKind, Result};

fn io_err(what: String, e: std::io::Error) -> Error {
    Error::new(ErrorKind::InvalidArgument, "node", format!("{what}: {e}"))
}

/// Lock `dir` (created if missing) for this process; `Unavailable` if another node holds it.
pub fn lock(dir: &Path) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(format!("create {}", dir.display()), e))?;
    let path = dir.join("LOCK");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io_err(format!("open {}", path.display()), e))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "node",
            format!("{} is in use by another node", dir.display()),
        ));
    }
    Ok(f)
}

/// The node id stored in `dir`, or `wanted` (or a random one) stored there now.
pub fn node_id(dir: &Path, wanted: Option<u64>) -> Result<u64> {
    let path = dir.join("node-id");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id: u64 = text.trim().parse().map_err(|_| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    "node",
                    format!("{} does not hold a node id: {text:?}", path.display()),
                )
            })?;
            if let Some(w) = wanted.filter(|w| *w != id) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "node",
                    format!(
                        "{} belongs to node {id}, but node id {w} was asked for",
                        dir.display()
                    ),
                ));
            }
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = wanted.unwrap_or_else(rand::random);
            let tmp = dir.join("node-id.tmp");
            let mut f =
                File::create(&tmp).map_err(|e| io_err(format!("create {}", tmp.display()), e))?;
            f.write_all(format!("{id}\n").as_bytes())
                .and_then(|_| f.sync_all())
                .map_err(|e| io_err(format!("write {}", tmp.display()), e))?;
            std::fs::rename(&tmp, &path)
                .and_then(|_| File::open(dir)?.sync_all())
                .map_err(|e| io_err(format!("rename to {}", path.display()), e))?;
            Ok(id)
        }
        Err(e) => Err(io_err(format!("read {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_kept_and_checked() {
        let dir = std::env::temp_dir().join(format!("kvfs-node-id-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let id = node_id(&dir, None).unwrap();
        assert_eq!(node_id(&dir, None).unwrap(), id);
        assert_eq!(node_id(&dir, Some(id)).unwrap(), id);
        let e = node_id(&dir, Some(id.wrapping_add(1))).unwrap_err();
        assert!(e.to_string().contains("belongs to node"), "{e}");
        let _l = lock(&dir).unwrap();
        assert_eq!(lock(&dir).unwrap_err().kind(), ErrorKind::Unavailable);
        std::fs::write(dir.join("node-id"), "garbage").unwrap();
        assert_eq!(node_id(&dir, None).unwrap_err().kind(), ErrorKind::InvalidArgument);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
