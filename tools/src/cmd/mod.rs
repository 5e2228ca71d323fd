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
