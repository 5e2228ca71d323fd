//! `kvfs master`, `kvfs node` and `kvfs up`: the daemons, and the embedded one-machine cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfs_client::{Node, NodeConfig};
use kvfs_master::service::{MasterService, MetadataHttpConfig, ServiceConfig};
use kvfs_transfer::{EngineConfig, Transports};

use crate::bench::report::{human_bytes, parse_bytes};
use crate::cmd::mooncake_flags::{parse_bool, parse_duration_ms};

/// Options of `kvfs master` (and the master half of `kvfs up`).
#[derive(Args, Debug, Clone)]
pub struct MasterArgs {
    /// Address the master serves clients and nodes on.
    #[arg(long, default_value = "127.0.0.1:50051", env = "KVFS_LISTEN")]
    pub listen: SocketAddr,
    /// Admin HTTP address (/metrics, /health, /get_all_segments); "off" disables it.
    #[arg(long, default_value = "127.0.0.1:9003")]
    pub admin: String,
    /// Read lease granted by get/exists; a leased object is neither evicted nor removed
    /// without force.
    #[arg(long, default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
    /// A node silent for longer loses its segments (objects only there are gone).
    #[arg(long, default_value_t = 10_000)]
    pub node_ttl_ms: u64,
    /// Heartbeat period nodes are asked to keep.
    #[arg(long, default_value_t = 1_000)]
    pub heartbeat_ms: u64,
    /// A put not ended within this is revoked and its space reclaimed.
    #[arg(long, default_value_t = 30_000)]
    pub put_timeout_ms: u64,
    /// Eviction starts above this fraction of a tier's capacity...
    #[arg(long, default_value_t = 0.95)]
    pub eviction_high_watermark: f64,
    /// ...and stops at this one.
    #[arg(long, default_value_t = 0.90)]
    pub eviction_low_watermark: f64,
    /// After a restart, puts wait this long when nodes come back with objects (writers of the
    /// previous master may still be finishing).
    #[arg(long, default_value_t = 10_000)]
    pub recovery_grace_ms: u64,
    /// Longest key, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub key_len_max: usize,
    /// Largest object.
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub object_size_max: u64,
    /// Seed of random placement (the same seed gives the same placement decisions).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub reference: ReferenceMasterArgs,
}

/// The reference (Mooncake) master's flags that take effect in kvfs, in its spelling; each
/// overrides the kvfs option it maps to (docs/mooncake-compat.md). Flags of the reference that
/// kvfs does not implement are accepted with a warning (see `mooncake_flags`).
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Reference (Mooncake) master flags")]
pub struct ReferenceMasterArgs {
    /// RPC port (`--port` is the reference's deprecated spelling); with it, the master binds
    /// --rpc_address (default 0.0.0.0, as the reference).
    #[arg(long = "rpc_port", alias = "port", value_name = "PORT")]
    pub rpc_port: Option<u16>,
    /// RPC bind address (host or IP).
    #[arg(long = "rpc_address", value_name = "ADDR")]
    pub rpc_address: Option<String>,
    /// Read lease: milliseconds, or with a unit (500, 60s, 5m). Sets --lease-ttl-ms.
    #[arg(long = "default_kv_lease_ttl", value_name = "TTL", value_parser = parse_duration_ms)]
    pub default_kv_lease_ttl: Option<u64>,
    /// Eviction starts above this fraction of capacity. Sets --eviction-high-watermark.
    #[arg(long = "eviction_high_watermark_ratio", value_name = "RATIO")]
    pub eviction_high_watermark_ratio: Option<f64>,
    /// Fraction of capacity one eviction round frees: kvfs evicts down to the high watermark
    /// minus this. Sets --eviction-low-watermark.
    #[arg(long = "eviction_ratio", value_name = "RATIO")]
    pub eviction_ratio: Option<f64>,
    /// Admin HTTP port (/metrics, /health, /get_all_segments); binds --metrics_host.
    #[arg(long = "metrics_port", value_name = "PORT")]
    pub metrics_port: Option<u16>,
    /// Admin HTTP bind address (default 0.0.0.0 with --metrics_port, as the reference).
    #[arg(long = "metrics_host", value_name = "ADDR")]
    pub metrics_host: Option<String>,
    /// Seconds a silent segment owner (node, embedded client) stays alive. Sets --node-ttl-ms.
    #[arg(long = "client_ttl", alias = "client_live_ttl_sec", value_name = "SECONDS")]
    pub client_ttl: Option<u64>,
    /// Seconds before an unfinished put is revoked. Sets --put-timeout-ms.
    #[arg(long = "put_start_discard_timeout_sec", value_name = "SECONDS")]
    pub put_start_discard_timeout_sec: Option<u64>,
    /// Serve the reference's HTTP metadata store (GET/PUT/DELETE /metadata?key=K).
    #[arg(long = "enable_http_metadata_server", value_name = "BOOL", num_args = 0..=1,
        default_missing_value = "true", value_parser = parse_bool)]
    pub enable_http_metadata_server: Option<bool>,
    /// Port of the HTTP metadata server.
    #[arg(long = "http_metadata_server_port", value_name = "PORT", default_value_t = 8080)]
    pub http_metadata_server_port: u16,
    /// Bind address of the HTTP metadata server.
    #[arg(long = "http_metadata_server_host", value_name = "ADDR", default_value = "0.0.0.0")]
    pub http_metadata_server_host: String,
}

fn socket_addr(host: &str, port: u16, what: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    (bare, port)
        .to_socket_addrs()
        .with_context(|| format!("{what} {host:?} does not resolve"))?
        .next()
        .with_context(|| format!("{what} {host:?} resolves to no address"))
}

impl MasterArgs {
    pub fn service_config(&self) -> anyhow::Result<ServiceConfig> {
        let r = &self.reference;
        let mut admin_listen = match self.admin.as_str() {
            "off" | "none" | "" => None,
            a => Some(
                a.parse().with_context(|| format!("--admin {a:?} is not host:port or \"off\""))?,
            ),
        };
        if let Some(port) = r.metrics_port {
            let host = r.metrics_host.as_deref().unwrap_or("0.0.0.0");
            admin_listen = Some(socket_addr(host, port, "--metrics_host")?);
        }
        let mut listen = self.listen;
        if r.rpc_port.is_some() || r.rpc_address.is_some() {
            let host = r.rpc_address.as_deref().unwrap_or("0.0.0.0");
            listen = socket_addr(host, r.rpc_port.unwrap_or(self.listen.port()), "--rpc_address")?;
        }
        let metadata_http = match r.enable_http_metadata_server {
            Some(true) => Some(MetadataHttpConfig::new(socket_addr(
                &r.http_metadata_server_host,
                r.http_metadata_server_port,
                "--http_metadata_server_host",
            )?)),
            _ => None,
        };
        let mut cfg = ServiceConfig {
            listen,
            admin_listen,
            metadata_http,
            heartbeat_ms: self.heartbeat_ms,
            recovery_grace_ms: self.recovery_grace_ms,
            ..ServiceConfig::default()
        };
        let d = &mut cfg.directory;
        d.lease_ttl_ms = self.lease_ttl_ms;
        d.node_ttl_ms = self.node_ttl_ms;
        d.put_timeout_ms = self.put_timeout_ms;
        d.evict_high_watermark = self.eviction_high_watermark;
        d.evict_low_watermark = self.eviction_low_watermark;
        d.key_len_max = self.key_len_max;
        d.object_size_max = self.object_size_max;
        d.seed = self.seed;
        if let Some(ttl) = r.default_kv_lease_ttl {
            d.lease_ttl_ms = ttl;
        }
        if let Some(s) = r.client_ttl {
            d.node_ttl_ms = s.saturating_mul(1000);
        }
        if let Some(s) = r.put_start_discard_timeout_sec {
            d.put_timeout_ms = s.saturating_mul(1000);
        }
        if let Some(high) = r.eviction_high_watermark_ratio {
            anyhow::ensure!(
                high > 0.0 && high <= 1.0,
                "--eviction_high_watermark_ratio {high} must be in (0, 1]"
            );
            d.evict_high_watermark = high;
            d.evict_low_watermark = d.evict_low_watermark.min(high);
        }
        if let Some(ratio) = r.eviction_ratio {
            anyhow::ensure!(
                ratio > 0.0 && ratio <= 1.0,
                "--eviction_ratio {ratio} must be in (0, 1]"
            );
            // The reference frees `ratio` of the objects per round; kvfs frees down to a low
            // watermark, so the same step below the high one. Never 0: the directory needs a
            // positive low watermark.
            d.evict_low_watermark = (d.evict_high_watermark - ratio).max(0.01);
        }
        Ok(cfg)
    }
}

/// Options of `kvfs node` (and the node half of `kvfs up`).
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// DRAM contributed to the pool (e.g. 512MiB, 2GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub dram: u64,
    /// Address of the node's Transfer Engine (peers read and write its segment there).
    #[arg(long = "engine-listen", default_value = "127.0.0.1:0")]
    pub engine_listen: SocketAddr,
    /// Stable node identity (random by default: a restarted node is then a new node).
    #[arg(long)]
    pub node_id: Option<u64>,
    /// Do not fault the segment's pages in at start (faster start, slower first writes).
    #[arg(long)]
    pub no_populate: bool,
    /// Serve peers over tcp only (no shared memory with same-host clients).
    #[arg(long)]
    pub tcp_only: bool,
}

impl NodeArgs {
    pub fn node_config(&self, master: &str) -> NodeConfig {
        let mut engine = EngineConfig { listen: self.engine_listen, ..EngineConfig::default() };
        if self.tcp_only {
            engine.transports = Transports::tcp_only();
        }
        NodeConfig {
            master: master.to_string(),
            engine,
            dram_bytes: self.dram,
            node_id: self.node_id,
            populate: !self.no_populate,
            ..NodeConfig::default()
        }
    }
}

pub(crate) async fn wait_for_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

pub async fn master(args: MasterArgs) -> anyhow::Result<()> {
    let svc = MasterService::start(args.service_config()?)
        .await
        .with_context(|| format!("starting the master on {}", args.listen))?;
    match svc.admin_addr() {
        Some(a) => {
            println!("kvfs master listening on {} (admin http://{a}/metrics)", svc.rpc_addr())
        }
        None => println!("kvfs master listening on {}", svc.rpc_addr()),
    }
    if let Some(m) = svc.metadata_addr() {
        println!("  HTTP metadata server http://{m}/metadata");
    }
    wait_for_signal().await;
    Ok(())
}

pub async fn node(master: &str, args: NodeArgs) -> anyhow::Result<()> {
    let node = Node::start(args.node_config(master)).await.context("starting the node")?;
    println!(
        "kvfs node {} serving {} of DRAM at {} (master {master})",
        node.id(),
        human_bytes(args.dram),
        node.endpoint()
    );
    if node.wait_registered(Duration::from_secs(5)).await.is_err() {
        eprintln!("kvfs node: the master at {master} does not answer yet; still trying");
    }
    wait_for_signal().await;
    node.shutdown().await;
    Ok(())
}

/// Options of `kvfs up`.
#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    /// Where kvfs keeps its data (NVMe tier, local object store); created if missing.
    #[arg(long, default_value = "/var/tmp/kvfs")]
    pub data: PathBuf,
    #[command(flatten)]
    pub master: MasterArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Also mount the pool here (master, node and mount in this one process).
    #[arg(long)]
    pub mount: Option<PathBuf>,
}

pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data)
        .with_context(|| format!("creating {}", args.data.display()))?;
    let svc = MasterService::start(args.master.service_config()?)
        .await
        .with_context(|| format!("starting the master on {}", args.master.listen))?;
    let master = svc.rpc_addr().to_string();
    let node = Node::start(args.node.node_config(&master)).await.context("starting the node")?;
    node.wait_registered(Duration::from_secs(10)).await.context("the node did not register")?;
    println!("kvfs is up: master {master}");
    println!(
        "  node {} with {} of DRAM at {}",
        node.id(),
        human_bytes(args.node.dram),
        node.endpoint()
    );
    if let Some(a) = svc.admin_addr() {
        println!("  metrics http://{a}/metrics   health http://{a}/health");
    }
    println!("  data {}", args.data.display());
    // TODO(lead): with the node in this process, give the mount the node's local object files
    // for passthrough (see the TODO in kvfs_fs::Mount::start).
    let mounted = match &args.mount {
        Some(dir) => {
            let m = super::mount::start(
                &master,
                dir.clone(),
                &super::mount::MountArgs::default_for_up(),
            )
            .await?;
            println!("  mounted at {}", dir.display());
            Some(m)
        }
        None => None,
    };
    println!(
        "try: kvfs put --master {master} hello ./README.md && kvfs get --master {master} hello -"
    );
    wait_for_signal().await;
    if let Some(m) = mounted {
        super::mount::stop(m).await;
    }
    node.shutdown().await;
    drop(svc);
    Ok(())
}
