//! Subcommands other than benchmarks: cluster daemons and object commands.

pub mod cluster;
pub mod conductor;
pub mod jobs;
pub mod mooncake_flags;
pub mod mount;
pub mod nvmeof;
pub mod objects;
pub mod pg;
pub mod reshard;

use kvfs_transfer::ClusterSecret;

static CLUSTER_SECRET: std::sync::OnceLock<ClusterSecret> = std::sync::OnceLock::new();

/// Sets the cluster secret of every daemon and client this process runs (`--cluster-secret-file`).
pub fn set_cluster_secret(secret: ClusterSecret) {
    let _ = CLUSTER_SECRET.set(secret);
}

/// The cluster secret given on the command line, if any.
pub fn cluster_secret() -> Option<ClusterSecret> {
    CLUSTER_SECRET.get().copied()
}

static TENANT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Sets the tenant the object commands and the mount work for (`--tenant`).
pub fn set_tenant(tenant: Option<String>) {
    let _ = TENANT.set(tenant);
}

/// A client's configuration for the master at `master`, with this process's secret and
/// tenant.
pub fn client_config(master: &str) -> kvfs_client::ClientConfig {
    let mut cfg = kvfs_client::ClientConfig { master: master.to_string(), ..Default::default() };
    cfg.engine.cluster_secret = cluster_secret();
    cfg.tenant = TENANT.get().cloned().flatten();
    cfg
}

/// A tokio runtime of its own, with its own worker threads, for the master of a process that
/// also runs a node (`kvfs up`, `kvfs bench store-peer`). On one runtime the node's tasks and
/// the master's share the workers, and a master's answer waits behind the node's work: a 4 KiB
/// put from another process (two master round trips and a write to the node) took 157-163 us
/// p50 that way on this 2-core VM, and 68-70 us with the master on its own runtime, as with
/// the master and the node in processes of their own.
pub struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl OwnRuntime {
    /// A multi-threaded runtime whose workers are named `name`.
    pub fn new(name: &str) -> std::io::Result<OwnRuntime> {
        let rt =
            tokio::runtime::Builder::new_multi_thread().thread_name(name).enable_all().build()?;
        Ok(OwnRuntime(Some(rt)))
    }

    /// Runs `fut` on this runtime (what it spawns stays there) and waits for its output.
    pub async fn run<F>(&self, fut: F) -> anyhow::Result<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let rt = self.0.as_ref().ok_or_else(|| anyhow::anyhow!("the runtime is shut down"))?;
        rt.spawn(fut).await.map_err(|e| anyhow::anyhow!("a task on its own runtime failed: {e}"))
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        // Without waiting: dropping a runtime blocks, which an async caller may not do.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}
