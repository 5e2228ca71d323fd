//! Mounting and unmounting: [`MountConfig`] (every limit of the daemon) and [`Mount`], which
//! serves the pool at a mount point from FUSE worker threads and a tokio runtime.
//!
//! The kernel is asked for the largest requests it allows: `max_read` is left at the kernel's
//! maximum, `FUSE_MAX_PAGES` lets one request carry 1 MiB (the kernel's `fuse_max_pages_limit`
//! here), readahead is raised to the most the kernel offers, and objects keep their page cache
//! across opens. As root the mount is made with mount(2) directly (no fusermount).
//!
//! A mount point left behind by a killed daemon ("transport endpoint is not connected") is
//! lazily unmounted before mounting again. Dropping a [`Mount`] unmounts it; when the mount
//! point is busy the unmount is lazy (the kernel finishes it when the last user leaves).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvfs_client::{Client, PutOptions};

use crate::fastpath::FastPathConfig;
use crate::fuse::KvFs;
use crate::passthrough::PassthroughSource;
use crate::state::Inner;

/// Everything a mount can be told, with a limit on every resource.
#[derive(Clone)]
pub struct MountConfig {
    pub mountpoint: PathBuf,
    /// Source name shown in /proc/mounts.
    pub fs_name: String,
    /// Let other users than the mounting one in (FUSE `allow_other`).
    pub allow_other: bool,
    /// FUSE worker threads (each with its own /dev/fuse clone).
    pub threads: usize,
    /// How long the kernel may cache names and attributes of objects and directories.
    pub entry_ttl_ms: u64,
    /// Entries per `list_dir` page (an open directory holds at most one page).
    pub list_page_entries: u32,
    /// Largest file that can be created through the mount (`EFBIG` past it).
    pub staging_file_bytes_max: u64,
    /// Bytes all files being written may hold in the daemon together (`ENOSPC` past it).
    pub staging_bytes_max: u64,
    /// Object bytes held for FUSE reads of open files (reads wait for room, then `ENOMEM`).
    pub fetch_bytes_max: u64,
    /// Readahead of the mount's backing device (`/sys/class/bdi/0:N/read_ahead_kb`): the
    /// kernel offers FUSE only 128 KiB, so sequential reads would arrive in 128 KiB requests;
    /// the daemon raises it after mounting (best effort: needs root). 0 leaves it.
    pub readahead_bytes: u64,
    /// Idle fetch buffers kept registered for the next cold read.
    pub fetch_cache_bytes_max: u64,
    /// No operation of the daemon runs longer (`ETIMEDOUT`).
    pub op_timeout_ms: u64,
    /// Longest key a create or mkdir may make (`ENAMETOOLONG`); the master's `key_len_max`.
    pub key_bytes_max: usize,
    /// How puts through the mount place their objects (checksums are always recorded for
    /// files written through FUSE).
    pub put: PutOptions,
    pub fastpath: FastPathConfig,
    /// Where objects' bytes may sit in local files (FUSE passthrough); `None`: no passthrough.
    pub passthrough: Option<Arc<dyn PassthroughSource>>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            mountpoint: PathBuf::from("/mnt/kvfs"),
            fs_name: "kvfs".into(),
            allow_other: false,
            threads: 2,
            entry_ttl_ms: 1_000,
            list_page_entries: 1_000,
            staging_file_bytes_max: 1 << 30,
            staging_bytes_max: 4 << 30,
            fetch_bytes_max: 4 << 30,
            fetch_cache_bytes_max: 256 << 20,
            readahead_bytes: 4 << 20,
            op_timeout_ms: 30_000,
            key_bytes_max: 4096,
            put: PutOptions::default(),
            fastpath: FastPathConfig::default(),
            passthrough: None,
        }
    }
}

impl std::fmt::Debug for MountConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountConfig")
            .field("mountpoint", &self.mountpoint)
            .field("staging_bytes_max", &self.staging_bytes_max)
            .field("fetch_bytes_max", &self.fetch_bytes_max)
            .field("passthrough", &self.passthrough.is_some())
            .finish_non_exhaustive()
    }
}

/// A mounted pool. Dropping it unmounts.
pub struct Mount {
    session: Option<fuser::BackgroundSession>,
    inner: Arc<Inner>,
    mountpoint: PathBuf,
}

impl Mount {
    /// Mounts the pool that `client` reaches at `cfg.mountpoint`; requests run on `rt`.
    pub fn start(
        cfg: MountConfig,
        client: Client,
        rt: tokio::runtime::Handle,
    ) -> io::Result<Mount> {
        if cfg.threads == 0 || cfg.list_page_entries == 0 || cfg.op_timeout_ms == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "threads, list_page_entries and op_timeout_ms must be > 0",
            ));
        }
        let mountpoint = cfg.mountpoint.clone();
        clear_dead_mount(&mountpoint);
        let mut opts = fuser::Config::default();
        opts.mount_options = vec![
            fuser::MountOption::FSName(cfg.fs_name.clone()),
            fuser::MountOption::Subtype("kvfs".into()),
            fuser::MountOption::NoAtime,
            fuser::MountOption::NoDev,
            fuser::MountOption::NoSuid,
        ];
        opts.acl = if cfg.allow_other { fuser::SessionACL::All } else { fuser::SessionACL::Owner };
        opts.n_threads = Some(cfg.threads);
        opts.clone_fd = true;
        let readahead = cfg.readahead_bytes;
        let inner = Arc::new(Inner::new(cfg, client));
        let fs = KvFs { inner: inner.clone(), rt };
        let session = fuser::spawn_mount(fs, &mountpoint, &opts)?;
        let _ = inner.notifier.set(session.notifier());
        if readahead > 0 {
            raise_readahead(&mountpoint, readahead);
        }
        tracing::info!(mountpoint = %mountpoint.display(), "mounted");
        Ok(Mount { session: Some(session), inner, mountpoint })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// This mount's figures (what `/.kvfs/status.json` shows under `counters`).
    pub fn counters(&self) -> serde_json::Value {
        self.inner.counters.to_json()
    }

    /// A cheap, clonable view of this mount's figures, usable from any thread.
    pub fn probe(&self) -> MountProbe {
        MountProbe { inner: self.inner.clone() }
    }

    /// Unmounts, lazily if the mount point is busy.
    pub fn unmount(mut self) -> io::Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> io::Result<()> {
        let Some(session) = self.session.take() else { return Ok(()) };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, mountpoint = %self.mountpoint.display(), "unmount failed; detaching lazily");
                lazy_unmount(&self.mountpoint);
                Err(e)
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// See [`Mount::probe`].
#[derive(Clone)]
pub struct MountProbe {
    inner: Arc<Inner>,
}

impl MountProbe {
    /// Files and directories open on the mount now (closes reach the daemon asynchronously).
    pub fn open_handles(&self) -> usize {
        crate::state::lock(&self.inner.handles).len()
    }

    /// The mount's counters (as in `/.kvfs/status.json`).
    pub fn counters(&self) -> serde_json::Value {
        self.inner.counters.to_json()
    }
}

/// Detaches the mount at `path` (umount -l).
pub fn lazy_unmount(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return };
    // SAFETY: a valid NUL-terminated path; umount2 has no other preconditions.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

/// Sets the readahead of the mount's bdi so reads arrive in the largest requests (1 MiB).
fn raise_readahead(mountpoint: &Path, bytes: u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dev) = std::fs::metadata(mountpoint).map(|m| m.dev()) else { return };
    let path = format!("/sys/class/bdi/{}:{}/read_ahead_kb", libc::major(dev), libc::minor(dev));
    if let Err(e) = std::fs::write(&path, (bytes / 1024).to_string()) {
        tracing::debug!(error = %e, path, "could not raise the mount's readahead");
    }
}

/// A mount point whose daemon died answers ENOTCONN: detach it so it can be mounted again.
fn clear_dead_mount(path: &Path) {
    if let Err(e) = std::fs::metadata(path)
        && e.raw_os_error() == Some(libc::ENOTCONN)
    {
        tracing::info!(mountpoint = %path.display(), "detaching a mount whose daemon died");
        lazy_unmount(path);
    }
}
