//! `kvfs mount`: serve a cluster's pool as files at a mount point (and `kvfs up --mount`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use kvfs_client::{Client, ClientConfig, PutOptions};
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

/// Mounts the pool of the cluster at `master` until SIGINT/SIGTERM.
pub async fn start(master: &str, mountpoint: PathBuf, args: &MountArgs) -> anyhow::Result<Mount> {
    let client =
        Client::connect(ClientConfig { master: master.to_string(), ..ClientConfig::default() })
            .await
            .with_context(|| format!("connecting to the master at {master}"))?;
    let cfg = args.config(mountpoint.clone());
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
    /// Where to mount (an existing directory).
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
