//! `kvfs mount`: serve a cluster's pool as files at a mount point (and `kvfs up --mount`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvfs_client::{Client, PutOptions};
use kvfs_fs::{DirSource, Mount, MountConfig};

use crate::bench::report::parse_bytes;

/// Options of `kvfs mount` (the mount half of `kvfs up --mount`).
#[derive(Args, Debug, Clone)]
pub struct MountArgs {
    /// Let other users than the mounting one use the mount (FUSE allow_other).
    #[arg(long)]
    pub allow_other: bool,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Bytes all files being written through the mount may hold in the daemon (ENOSPC past it).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub staging_bytes_max: u64,
    /// Largest file that can be written through the mount (EFBIG past it).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub staging_file_bytes_max: u64,
    /// Object bytes held for FUSE reads of open files.
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub fetch_bytes_max: u64,
    /// Replicas of objects written through the mount or the fast path.
    #[arg(long, default_value_t = 1)]
    pub replicas: u8,
    /// Read objects found as files under this directory (named like their mount paths)
    /// through FUSE passthrough.
    #[arg(long)]
    pub passthrough_dir: Option<PathBuf>,
}

impl MountArgs {
    /// The defaults `kvfs up --mount` uses.
    pub fn default_for_up() -> MountArgs {
        MountArgs {
            allow_other: false,
            threads: 2,
            staging_bytes_max: 4 << 30,
            staging_file_bytes_max: 1 << 30,
            fetch_bytes_max: 4 << 30,
            replicas: 1,
            passthrough_dir: None,
        }
    }

    pub fn config(&self, mountpoint: PathBuf) -> MountConfig {
        MountConfig {
            mountpoint,
            allow_other: self.allow_other,
            threads: self.threads,
            staging_bytes_max: self.staging_bytes_max,
            staging_file_bytes_max: self.staging_file_bytes_max,
            fetch_bytes_max: self.fetch_bytes_max,
            put: PutOptions { replicas: self.replicas, ..PutOptions::default() },
            passthrough: self.passthrough_dir.clone().map(|d| {
                std::sync::Arc::new(DirSource::new(d))
                    as std::sync::Arc<dyn kvfs_fs::PassthroughSource>
            }),
            ..MountConfig::default()
        }
    }
}

/// The NVMe objects of a node in this process, for FUSE passthrough: each is a file holding
/// exactly the object's bytes from offset 0.
pub struct NodeSource(pub kvfs_node::NodeFiles);

impl kvfs_fs::PassthroughSource for NodeSource {
    fn object_file(&self, key: &str) -> Option<(std::os::fd::OwnedFd, u64)> {
        self.0.local_object_file(key).map(|(f, size)| (f.into(), size))
    }
}

/// Mounts the pool of the cluster at `master`.
pub async fn start(master: &str, mountpoint: PathBuf, args: &MountArgs) -> anyhow::Result<Mount> {
    start_with(master, mountpoint, args, None).await
}

/// Mounts the pool, serving reads of the objects `source` has in local files with FUSE
/// passthrough (when `--passthrough-dir` is not given).
pub async fn start_with(
    master: &str,
    mountpoint: PathBuf,
    args: &MountArgs,
    source: Option<std::sync::Arc<dyn kvfs_fs::PassthroughSource>>,
) -> anyhow::Result<Mount> {
    let client = Client::connect(super::client_config(master))
        .await
        .with_context(|| format!("connecting to the master at {master}"))?;
    // A missing mountpoint is made (a dead mount left by a killed daemon is still there, and
    // the mount clears it).
    if let Err(e) = std::fs::symlink_metadata(&mountpoint)
        && e.kind() == std::io::ErrorKind::NotFound
    {
        std::fs::create_dir_all(&mountpoint)
            .with_context(|| format!("creating the mountpoint {}", mountpoint.display()))?;
    }
    let mut cfg = args.config(mountpoint.clone());
    if cfg.passthrough.is_none() {
        cfg.passthrough = source;
    }
    let rt = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || Mount::start(cfg, client, rt))
        .await?
        .with_context(|| format!("mounting at {}", mountpoint.display()))
}

/// Unmounts (lazily if busy) off the async workers.
pub async fn stop(m: Mount) {
    let _ = tokio::task::spawn_blocking(move || m.unmount()).await;
}

#[derive(Args, Debug)]
pub struct MountCmd {
    /// Where to mount (a directory; made if missing).
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub opts: MountArgs,
}

pub async fn mount(master: &str, a: MountCmd) -> anyhow::Result<()> {
    let m = start(master, a.mountpoint.clone(), &a.opts).await?;
    println!("kvfs mounted at {} (master {master})", a.mountpoint.display());
    super::cluster::wait_for_signal().await;
    stop(m).await;
    Ok(())
}
