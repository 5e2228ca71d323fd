//! `kvfs master`, `kvfs node` and `kvfs up`: the daemons, and the embedded one-machine cluster.
//!
//! Tiers: a node with a data directory (`kvfs node --data DIR`; `kvfs up` uses `--data`,
//! default /var/tmp/kvfs) keeps its id there and runs an NVMe tier under `DIR/nvme`. The object
//! store is chosen by `--object-store` (`fs:PATH`, `s3://BUCKET/ROOT` with the `--s3-*` flags,
//! or `none`), the same on the master (which scans it at start) and on the nodes; `kvfs up`
//! defaults to `fs:DATA/objects`, a local directory, so no extra service is needed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfs_master::service::{KvEventsConfig, MasterService, MetadataHttpConfig, ServiceConfig};
use kvfs_node::{Node, NodeConfig, TierConfig};
use kvfs_tiers::NvmeofSpec;
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
    /// A node whose control connection closed (its process died, or the network broke) gets
    /// no new replicas at once, and loses its segments after this unless it reconnects.
    #[arg(long, default_value_t = 2_000)]
    pub disconnect_grace_ms: u64,
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
    /// An eager put fails (and is revoked) if no node has written it to the object store
    /// within this; keep it under --put-timeout-ms.
    #[arg(long, default_value_t = 20_000)]
    pub persist_timeout_ms: u64,
    /// A get that must first copy an object from NVMe or the object store into memory fails
    /// after this.
    #[arg(long, default_value_t = 30_000)]
    pub load_timeout_ms: u64,
    /// Default persistence of a namespace, PREFIX=none|lazy|eager (repeatable): puts of keys
    /// under the longest matching prefix get at least that persistence.
    #[arg(long = "persistence", value_parser = parse_persistence_default)]
    pub persistence_defaults: Vec<(String, kvfs_client::Persistence)>,
    /// A tenant's byte quota, TENANT=MEMORY[:NVME] (repeatable; sizes like 8GiB): its keys
    /// (under tenants/TENANT/, what clients with --tenant or tenant_id write) may hold that
    /// much DRAM (and NVMe); a put over it evicts the tenant's own cold objects first, then is
    /// refused. Read and change quotas at run time through the admin endpoint:
    /// GET/PUT/DELETE /api/v1/tenant_quotas?tenant_id=TENANT.
    #[arg(long = "tenant-quota", value_name = "TENANT=MEMORY[:NVME]", value_parser = parse_tenant_quota)]
    pub tenant_quotas: Vec<(String, kvfs_master::Quota)>,
    #[command(flatten)]
    pub kv_events: KvEventsArgs,
    #[command(flatten)]
    pub reference: ReferenceMasterArgs,
}

/// The pool's KV events (what the DRAM, NVMe and object store tiers hold, per key), published
/// over ZeroMQ for the conductor (`kvfs conductor`, or the reference's). Each flag also takes
/// the reference's spelling (`--kv_events_model_name`, ...).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Pool KV events")]
pub struct KvEventsArgs {
    /// Publish on this ZeroMQ PUB endpoint (e.g. tcp://0.0.0.0:5557); off without it.
    #[arg(long = "kv-events-endpoint", alias = "kv_events_bind_endpoint", value_name = "EP")]
    pub endpoint: Option<String>,
    /// ROUTER endpoint answering replay requests; default: the PUB endpoint's port plus one;
    /// "off" disables replay.
    #[arg(
        long = "kv-events-replay-endpoint",
        alias = "kv_events_replay_endpoint",
        value_name = "EP"
    )]
    pub replay_endpoint: Option<String>,
    /// Events queued at most before publishing; the oldest are dropped (and counted) past it.
    #[arg(
        long = "kv-events-queue-capacity",
        alias = "kv_events_queue_capacity",
        default_value_t = 65_536
    )]
    pub queue_capacity: usize,
    /// Batches kept for replay.
    #[arg(long = "kv-events-replay-batches", default_value_t = 10_000)]
    pub replay_batches: usize,
    /// `backend_id` of every event.
    #[arg(long = "kv-events-backend-id", alias = "kv_events_backend_id", value_name = "ID")]
    pub backend_id: Option<String>,
    /// `model_name` of every event.
    #[arg(long = "kv-events-model-name", alias = "kv_events_model_name", value_name = "NAME")]
    pub model_name: Option<String>,
    /// `tenant_id` of every event.
    #[arg(long = "kv-events-tenant-id", alias = "kv_events_tenant_id", value_name = "ID")]
    pub tenant_id: Option<String>,
    /// `block_size` of every event (tokens per block; 0: left out).
    #[arg(long = "kv-events-block-size", alias = "kv_events_block_size", default_value_t = 0)]
    pub block_size: u32,
    /// `lora_name` of every event.
    #[arg(long = "kv-events-lora-name", alias = "kv_events_lora_name", value_name = "NAME")]
    pub lora_name: Option<String>,
    /// The data-parallel rank in every batch.
    #[arg(long = "kv-events-dp-rank", alias = "kv_events_dp_rank", default_value_t = 0)]
    pub dp_rank: u32,
    /// Name the object key in every event (it is always named when not a number).
    #[arg(long = "kv-events-emit-object-key", alias = "kv_events_emit_object_key",
        value_name = "BOOL", num_args = 0..=1, default_value = "true",
        default_missing_value = "true", value_parser = parse_bool)]
    pub emit_object_key: bool,
    /// Also carry the engines' field names (`type`, `block_hashes`) that older consumers read.
    #[arg(long = "kv-events-emit-legacy-compat", alias = "kv_events_emit_legacy_compat",
        value_name = "BOOL", num_args = 0..=1, default_value = "true",
        default_missing_value = "true", value_parser = parse_bool)]
    pub emit_legacy_compat: bool,
}

/// The reference's default PUB endpoint (`--enable_kv_events` without a bind endpoint).
const REFERENCE_KV_EVENTS_ENDPOINT: &str = "tcp://0.0.0.0:5557";

impl KvEventsArgs {
    /// The publisher's settings; `None` when neither an endpoint nor `enable` is given.
    pub fn config(&self, enable: Option<bool>) -> anyhow::Result<Option<KvEventsConfig>> {
        let endpoint = match (enable, &self.endpoint) {
            (Some(false), _) => return Ok(None),
            (_, Some(e)) => e.clone(),
            (Some(true), None) => REFERENCE_KV_EVENTS_ENDPOINT.to_string(),
            (None, None) => return Ok(None),
        };
        anyhow::ensure!(
            endpoint.starts_with("tcp://"),
            "--kv-events-endpoint {endpoint:?}: only tcp:// endpoints"
        );
        anyhow::ensure!(self.queue_capacity > 0, "--kv-events-queue-capacity must be positive");
        let mut c = KvEventsConfig::new(endpoint.clone());
        c.replay_endpoint = match self.replay_endpoint.as_deref() {
            Some("off" | "none" | "") => None,
            Some(r) => Some(r.to_string()),
            None => KvEventsConfig::default_replay_endpoint(&endpoint),
        };
        c.queue_max = self.queue_capacity;
        c.replay_batches_max = self.replay_batches.max(1);
        c.backend_id = self.backend_id.clone();
        c.model_name = self.model_name.clone();
        c.tenant_id = self.tenant_id.clone();
        c.block_size = (self.block_size > 0).then_some(self.block_size);
        c.lora_name = self.lora_name.clone();
        c.dp_rank = self.dp_rank;
        c.emit_object_key = self.emit_object_key;
        c.emit_legacy_compat = self.emit_legacy_compat;
        Ok(Some(c))
    }
}

pub(crate) fn parse_nvmeof(s: &str) -> Result<NvmeofSpec, String> {
    NvmeofSpec::parse(s).map_err(|e| e.context_str().to_string())
}

fn parse_tenant_quota(s: &str) -> Result<(String, kvfs_master::Quota), String> {
    let (tenant, sizes) =
        s.split_once('=').ok_or_else(|| format!("{s:?} is not TENANT=MEMORY[:NVME]"))?;
    if !kvfs_master::valid_tenant(tenant) {
        return Err(format!("{tenant:?} is not a tenant name (1-64 of A-Z a-z 0-9 . _ -)"));
    }
    let (memory, nvme) = match sizes.split_once(':') {
        Some((m, n)) => (m, Some(n)),
        None => (sizes, None),
    };
    let size = |v: &str| parse_bytes(v).map_err(|e| format!("{v:?}: {e}"));
    let quota = kvfs_master::Quota {
        memory_bytes: Some(size(memory)?),
        nvme_bytes: nvme.map(size).transpose()?,
    };
    Ok((tenant.to_string(), quota))
}

fn parse_persistence_default(s: &str) -> Result<(String, kvfs_client::Persistence), String> {
    let (prefix, mode) =
        s.rsplit_once('=').ok_or_else(|| format!("{s:?} is not PREFIX=none|lazy|eager"))?;
    let p = match mode {
        "none" => kvfs_client::Persistence::None,
        "lazy" => kvfs_client::Persistence::Lazy,
        "eager" => kvfs_client::Persistence::Eager,
        other => return Err(format!("persistence {other:?} is not none, lazy or eager")),
    };
    Ok((prefix.to_string(), p))
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
    /// Publish the pool's KV events (on --kv_events_bind_endpoint, default
    /// tcp://0.0.0.0:5557); the other `--kv_events_*` flags are spellings of `--kv-events-*`.
    #[arg(long = "enable_kv_events", value_name = "BOOL", num_args = 0..=1,
        default_missing_value = "true", value_parser = parse_bool)]
    pub enable_kv_events: Option<bool>,
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
            persist_timeout_ms: self.persist_timeout_ms,
            load_timeout_ms: self.load_timeout_ms,
            persistence_defaults: self.persistence_defaults.clone(),
            kv_events: self.kv_events.config(r.enable_kv_events)?,
            tenant_quotas: self.tenant_quotas.clone(),
            ..ServiceConfig::default()
        };
        cfg.rpc.secret = super::cluster_secret();
        if self.persist_timeout_ms >= self.put_timeout_ms {
            anyhow::bail!(
                "--persist-timeout-ms {} must be below --put-timeout-ms {} (an eager put's range must outlive its upload)",
                self.persist_timeout_ms,
                self.put_timeout_ms
            );
        }
        let d = &mut cfg.directory;
        d.lease_ttl_ms = self.lease_ttl_ms;
        d.node_ttl_ms = self.node_ttl_ms;
        d.disconnect_grace_ms = self.disconnect_grace_ms;
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
    /// Capacity of the NVMe tier (files under DATA/nvme, io_uring and O_DIRECT); 0 disables
    /// it. Needs a data directory. [default: 4GiB with a data directory]
    #[arg(long, value_parser = parse_bytes)]
    pub nvme: Option<u64>,
    /// Keep the NVMe tier on a remote NVMe namespace reached over NVMe/TCP instead of the
    /// local disk: SPEC is transport=tcp,traddr=IP,trsvcid=PORT,nqn=NQN[,nsid=N][,format]
    /// (plus the kernel's hostnqn, nr_io_queues, ctrl_loss_tmo, ...). The node connects it
    /// through /dev/nvme-fabrics (root, nvme-tcp module), mounts its ext4 file system at
    /// DATA/nvme and disconnects at exit; `format` makes that file system on a blank namespace
    /// (never on one holding data). --nvme then defaults to most of the file system.
    #[arg(long, value_name = "SPEC", value_parser = parse_nvmeof)]
    pub nvmeof: Option<NvmeofSpec>,
    /// GPU memory (device 0) this node contributes as an HBM segment: puts with `--tier hbm`
    /// are placed there and peers reach it over tcp. Fails clearly where no CUDA driver is
    /// found; 0 only probes for a driver and reports it.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub hbm: u64,
    /// Period of the tier manager (demotions, drops, promotions, write-back retries).
    #[arg(long, default_value_t = 100)]
    pub tier_tick_ms: u64,
    /// Demote cold objects DRAM -> NVMe when DRAM use is above this fraction...
    #[arg(long, default_value_t = 0.90)]
    pub demote_high_watermark: f64,
    /// ...down to this one.
    #[arg(long, default_value_t = 0.80)]
    pub demote_low_watermark: f64,
    /// Drop NVMe copies of persisted objects when NVMe use is above this fraction...
    #[arg(long, default_value_t = 0.90)]
    pub nvme_high_watermark: f64,
    /// ...down to this one.
    #[arg(long, default_value_t = 0.80)]
    pub nvme_low_watermark: f64,
    /// Demote cold objects HBM -> DRAM when the HBM segment's use is above this fraction...
    #[arg(long, default_value_t = 0.90)]
    pub hbm_high_watermark: f64,
    /// ...down to this one. Objects put into HBM come back when hot (--promote-min-reads) and
    /// they fit under the high watermark.
    #[arg(long, default_value_t = 0.80)]
    pub hbm_low_watermark: f64,
    /// Reads within the policy window an object needs before it is promoted (NVMe -> DRAM,
    /// and DRAM -> HBM for objects put into HBM).
    #[arg(long, default_value_t = 3)]
    pub promote_min_reads: u32,
    /// Bytes per second each of demotion and promotion may move (the rate limit).
    #[arg(long, default_value = "500MB", value_parser = parse_bytes)]
    pub tier_rate: u64,
    /// Objects the lazy write-back queue holds at most (then puts are not queued until it
    /// drains; they are retried each tier round).
    #[arg(long, default_value_t = 65_536)]
    pub writeback_queue_max: usize,
}

impl NodeArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        let ok = |lo: f64, hi: f64| 0.0 < lo && lo <= hi && hi <= 1.0;
        if !ok(self.demote_low_watermark, self.demote_high_watermark) {
            anyhow::bail!("need 0 < --demote-low-watermark <= --demote-high-watermark <= 1");
        }
        if !ok(self.nvme_low_watermark, self.nvme_high_watermark) {
            anyhow::bail!("need 0 < --nvme-low-watermark <= --nvme-high-watermark <= 1");
        }
        if !ok(self.hbm_low_watermark, self.hbm_high_watermark) {
            anyhow::bail!("need 0 < --hbm-low-watermark <= --hbm-high-watermark <= 1");
        }
        if self.writeback_queue_max == 0 || self.tier_rate == 0 {
            anyhow::bail!("--writeback-queue-max and --tier-rate must be positive");
        }
        if self.nvmeof.is_some() && self.nvme == Some(0) {
            anyhow::bail!("--nvmeof puts the NVMe tier on a remote namespace: drop --nvme 0");
        }
        Ok(())
    }

    fn tier_config(&self, object_store: Option<kvfs_tiers::ObjectStoreConfig>) -> TierConfig {
        let mut t = TierConfig {
            // With --nvmeof, 0 is "most of the namespace's file system" (the node sizes it).
            nvme_bytes: self.nvme.unwrap_or(if self.nvmeof.is_some() { 0 } else { 4 << 30 }),
            nvmeof: self.nvmeof.clone(),
            object_store,
            tick_ms: self.tier_tick_ms,
            writeback_entries_max: self.writeback_queue_max,
            hbm_bytes: self.hbm,
            ..TierConfig::default()
        };
        let p = &mut t.policy;
        p.dram_high_watermark = self.demote_high_watermark;
        p.dram_low_watermark = self.demote_low_watermark;
        p.nvme_high_watermark = self.nvme_high_watermark;
        p.nvme_low_watermark = self.nvme_low_watermark;
        p.hbm_high_watermark = self.hbm_high_watermark;
        p.hbm_low_watermark = self.hbm_low_watermark;
        p.promote_min_accesses = self.promote_min_reads;
        p.demote_bytes_per_s = self.tier_rate;
        p.promote_bytes_per_s = self.tier_rate;
        t
    }

    pub fn node_config(&self, master: &str) -> NodeConfig {
        let mut engine = EngineConfig {
            listen: self.engine_listen,
            cluster_secret: super::cluster_secret(),
            ..EngineConfig::default()
        };
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

/// Where persisted objects go: the same on the master and every node.
#[derive(Args, Debug, Clone)]
pub struct ObjectStoreArgs {
    /// The object store: `fs:PATH` (a local directory), `s3://BUCKET[/ROOT]` (with the
    /// --s3-* flags), or `none`.
    #[arg(long)]
    pub object_store: Option<String>,
    /// S3 endpoint (e.g. http://127.0.0.1:9000); AWS's regional endpoint when absent.
    #[arg(long, env = "KVFS_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    #[arg(long, env = "AWS_ACCESS_KEY_ID", default_value = "", hide_env_values = true)]
    pub s3_access_key_id: String,
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", default_value = "", hide_env_values = true)]
    pub s3_secret_access_key: String,
}

impl ObjectStoreArgs {
    /// The configured store; `default` when `--object-store` was not given.
    pub fn config(
        &self,
        default: Option<&str>,
    ) -> anyhow::Result<Option<kvfs_tiers::ObjectStoreConfig>> {
        let Some(spec) = self.object_store.as_deref().or(default) else { return Ok(None) };
        if spec == "none" {
            return Ok(None);
        }
        if let Some(path) = spec.strip_prefix("fs:") {
            if path.is_empty() {
                anyhow::bail!("--object-store fs: needs a path (fs:/var/tmp/kvfs/objects)");
            }
            return Ok(Some(kvfs_tiers::ObjectStoreConfig::Fs { root: PathBuf::from(path) }));
        }
        if let Some(rest) = spec.strip_prefix("s3://") {
            let (bucket, root) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                anyhow::bail!("--object-store {spec:?} names no bucket (s3://BUCKET/ROOT)");
            }
            let endpoint = self
                .s3_endpoint
                .clone()
                .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", self.s3_region));
            return Ok(Some(kvfs_tiers::ObjectStoreConfig::S3 {
                endpoint,
                bucket: bucket.to_string(),
                region: self.s3_region.clone(),
                access_key_id: self.s3_access_key_id.clone(),
                secret_access_key: self.s3_secret_access_key.clone(),
                root: format!("/{root}"),
            }));
        }
        anyhow::bail!("--object-store {spec:?}: expected fs:PATH, s3://BUCKET/ROOT or none")
    }
}

/// Options of `kvfs master`.
#[derive(Args, Debug, Clone)]
pub struct MasterCmdArgs {
    #[command(flatten)]
    pub master: MasterArgs,
    #[command(flatten)]
    pub ha: HaArgs,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
}

/// Several masters, one leader elected through etcd (`kvfs master --etcd`).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "High availability")]
pub struct HaArgs {
    /// etcd endpoints (HOST:PORT, separated by ',' or ';'): run as one of the cluster's
    /// candidate masters. One leads; the others stand by and take over when it dies or loses
    /// etcd. Clients, nodes and mounts then take etcd://ENDPOINTS/CLUSTER as the master
    /// address. Also spelled --etcd_endpoints and --ha_backend_connstring (the reference's).
    #[arg(long, value_name = "ENDPOINTS", aliases = ["etcd_endpoints", "ha_backend_connstring"])]
    pub etcd: Option<String>,
    /// Name of the cluster: masters of one cluster elect one leader (--cluster_id).
    #[arg(long, alias = "cluster_id", default_value = kvfs_ha::DEFAULT_CLUSTER)]
    pub cluster: String,
    /// The RPC address this master publishes in etcd when it leads (default: --listen, which
    /// then must not be a wildcard address).
    #[arg(long, value_name = "HOST:PORT")]
    pub advertise: Option<String>,
    /// Seconds a leader that stopped renewing (stopped, cut off from etcd) keeps the lead;
    /// one whose address refuses connections (dead) is replaced within a second. To keep the
    /// lead while etcd loses the member leading raft, the TTL must outlast etcd electing a new
    /// one (up to twice its --election-timeout): with etcd's default of 1 s, use 3 or more.
    #[arg(long, default_value_t = 2)]
    pub lease_ttl_s: u64,
}

/// Options of `kvfs node`.
#[derive(Args, Debug, Clone)]
pub struct NodeCmdArgs {
    /// Data directory: node id, NVMe tier, write-back journal (none: a DRAM-only node with a
    /// new id at every start).
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
}

pub(crate) async fn wait_for_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

pub async fn master(args: MasterCmdArgs) -> anyhow::Result<()> {
    let mut cfg = args.master.service_config()?;
    cfg.object_store = args.store.config(None)?;
    if let Some(endpoints) = &args.ha.etcd {
        return master_ha(cfg, &args.ha, endpoints).await;
    }
    let svc = MasterService::start(cfg)
        .await
        .with_context(|| format!("starting the master on {}", args.master.listen))?;
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

async fn master_ha(cfg: ServiceConfig, a: &HaArgs, endpoints: &str) -> anyhow::Result<()> {
    use kvfs_master::service::ha::{self, HaConfig, HaEvent};
    let target = kvfs_ha::EtcdTarget::new(endpoints, &a.cluster)
        .with_context(|| format!("--etcd {endpoints:?} --cluster {:?}", a.cluster))?;
    let advertise = match &a.advertise {
        Some(x) => x.clone(),
        None if cfg.listen.ip().is_unspecified() => anyhow::bail!(
            "--listen {} is a wildcard address: give --advertise HOST:PORT, the address clients and nodes reach this master at",
            cfg.listen
        ),
        None => cfg.listen.to_string(),
    };
    if a.lease_ttl_s == 0 {
        anyhow::bail!("--lease-ttl-s must be at least 1");
    }
    let mut h = HaConfig::new(target.clone(), advertise.clone());
    h.lease_ttl = Duration::from_secs(a.lease_ttl_s);
    println!(
        "kvfs master: candidate for cluster {:?} in etcd {} as {advertise}; clients and nodes use --master {}",
        target.cluster,
        target.endpoints.join(","),
        target.master_addr()
    );
    let events = |e: HaEvent| match e {
        HaEvent::Standby { leader, term } => {
            println!("kvfs master: standing by (the leader is {leader}, term {term})")
        }
        HaEvent::Leading { term, rpc, admin } => match admin {
            Some(a) => println!(
                "kvfs master: leading term {term}, listening on {rpc} (admin http://{a}/metrics)"
            ),
            None => println!("kvfs master: leading term {term}, listening on {rpc}"),
        },
        HaEvent::Lost { term, why } => {
            println!("kvfs master: lost the leadership of term {term} ({why}); standing by")
        }
    };
    let listen = cfg.listen;
    ha::run(cfg, h, events, wait_for_signal())
        .await
        .with_context(|| format!("running the master on {listen}"))
}

pub async fn node(master: &str, args: NodeCmdArgs) -> anyhow::Result<()> {
    args.node.validate()?;
    let mut cfg = args.node.node_config(master);
    cfg.tiers = args.node.tier_config(args.store.config(None)?);
    if args.data.is_none() {
        if args.node.nvmeof.is_some() {
            anyhow::bail!("--nvmeof needs --data DIR (the namespace is mounted at DIR/nvme)");
        }
        if args.node.nvme.is_some_and(|n| n > 0) {
            anyhow::bail!("--nvme needs --data DIR (the NVMe tier lives in DIR/nvme)");
        }
        cfg.tiers.nvme_bytes = 0;
    }
    cfg.data_dir = args.data.clone();
    let node = Node::start(cfg).await.context("starting the node")?;
    println!(
        "kvfs node {} serving {} of DRAM at {} (master {master})",
        node.id(),
        human_bytes(args.node.dram),
        node.endpoint()
    );
    print_tiers(&node, args.data.as_deref(), args.node.nvmeof.as_ref());
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
    /// Also mount the pool here, a directory made if missing (master, node and mount in this
    /// one process).
    #[arg(long)]
    pub mount: Option<PathBuf>,
    /// Also run the conductor (prefix-cache index and router, `kvfs conductor`) with its HTTP
    /// API on this address, e.g. 127.0.0.1:13333. With --kv-events-endpoint,
    /// --kv-events-model-name and --kv-events-block-size the pool is registered with it, so
    /// its answers include what the pool holds; engines register themselves.
    #[arg(long, value_name = "ADDR")]
    pub conductor: Option<std::net::SocketAddr>,
    /// Run the master as a candidate of a highly available cluster: start a local etcd member
    /// (Debian's etcd-server; data under DATA/etcd, log in DATA/etcd.log) at --etcd-listen,
    /// and make the node and the mount follow the leader through etcd://. More candidates
    /// join from any machine with `kvfs master --etcd HOST:PORT --listen ADDR` and take over
    /// when this one dies.
    #[arg(long)]
    pub ha: bool,
    /// Client address of the etcd member --ha starts (its peer port is the next one).
    #[arg(long, default_value = "127.0.0.1:2379", requires = "ha")]
    pub etcd_listen: SocketAddr,
    #[command(flatten)]
    pub store: ObjectStoreArgs,
}

/// The etcd member `kvfs up --ha` runs: killed when dropped.
struct LocalEtcd(std::process::Child);

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a one-member etcd under `data` and waits (at most 20 s) until it answers.
async fn start_etcd(data: &std::path::Path, listen: SocketAddr) -> anyhow::Result<LocalEtcd> {
    let dir = data.join("etcd");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let client = format!("http://{listen}");
    let peer = format!("http://{}:{}", listen.ip(), listen.port().wrapping_add(1));
    let log_path = data.join("etcd.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = std::process::Command::new("etcd");
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent. The member dies
    // with this process however it dies (it was spawned from a runtime worker, which lives as
    // long as the process).
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .args(["--name", "kvfs-up", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("kvfs-up={peer}")])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting etcd for --ha: install Debian's etcd-server (scripts/setup)")?;
    let mut etcd = LocalEtcd(child);
    let probe = kvfs_ha::Etcd::new(vec![client.clone()], Duration::from_secs(1))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = etcd.0.try_wait()? {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            anyhow::bail!("etcd at {listen} exited with {status}: {}", tail.join(" | "));
        }
        if probe.get("/kvfs/up-probe").await.is_ok() {
            return Ok(etcd);
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "etcd at {listen} did not answer within 20 s (see {})",
                log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `kvfs up --ha`'s master: a candidate in its own task, leading once this returns.
struct HaMaster {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    admin: Option<SocketAddr>,
}

async fn start_ha_master(
    cfg: ServiceConfig,
    etcd: SocketAddr,
) -> anyhow::Result<(HaMaster, String)> {
    use kvfs_master::service::ha::{self, HaConfig, HaEvent};
    let target = kvfs_ha::EtcdTarget::new(&etcd.to_string(), kvfs_ha::DEFAULT_CLUSTER)?;
    if cfg.listen.ip().is_unspecified() {
        anyhow::bail!(
            "--listen {} is a wildcard address; give the address others reach",
            cfg.listen
        );
    }
    let h = HaConfig::new(target.clone(), cfg.listen.to_string());
    let (lead_tx, lead_rx) = tokio::sync::oneshot::channel();
    let lead_tx = std::sync::Mutex::new(Some(lead_tx));
    let events = move |e: HaEvent| match e {
        HaEvent::Leading { admin, .. } => {
            if let Some(tx) = lead_tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = tx.send(admin);
            }
        }
        HaEvent::Standby { leader, term } => {
            println!("kvfs master: standing by (the leader is {leader}, term {term})")
        }
        HaEvent::Lost { term, why } => {
            println!("kvfs master: lost the leadership of term {term} ({why}); standing by")
        }
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(ha::run(cfg, h, events, async move {
        let _ = stopped.await;
    }));
    let admin = match tokio::time::timeout(Duration::from_secs(20), lead_rx).await {
        Ok(Ok(admin)) => admin,
        _ => {
            task.abort();
            anyhow::bail!("the master did not become the leader within 20 s (another leads?)");
        }
    };
    Ok((HaMaster { stop, task, admin }, target.master_addr()))
}

fn print_tiers(node: &Node, data: Option<&std::path::Path>, nvmeof: Option<&NvmeofSpec>) {
    let s = node.stats();
    let remote = nvmeof.map(|n| format!(", on {n} over NVMe/TCP")).unwrap_or_default();
    match data {
        Some(d) if s.nvme_capacity_bytes > 0 => println!(
            "  nvme {} under {}{remote} ({} objects from a previous run)",
            human_bytes(s.nvme_capacity_bytes),
            d.join("nvme").display(),
            s.nvme_objects
        ),
        _ => println!("  nvme off (no data directory or --nvme 0)"),
    }
    if s.hbm_available {
        println!("  hbm: CUDA driver found");
    } else {
        println!("  hbm: off, no CUDA driver (libcuda.so) found on this machine");
    }
}

pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data)
        .with_context(|| format!("creating {}", args.data.display()))?;
    args.node.validate()?;
    let default_store = format!("fs:{}", args.data.join("objects").display());
    let store = args.store.config(Some(&default_store))?;
    let mut mcfg = args.master.service_config()?;
    mcfg.object_store = store.clone();
    // The master runs on a runtime of its own, apart from the node's (see `OwnRuntime`).
    let master_rt = super::OwnRuntime::new("kvfs-master")?;
    let (etcd, ha, svc, master) = if args.ha {
        let etcd = start_etcd(&args.data, args.etcd_listen).await?;
        let etcd_listen = args.etcd_listen;
        let (ha, master) = master_rt.run(start_ha_master(mcfg, etcd_listen)).await??;
        (Some(etcd), Some(ha), None, master)
    } else {
        let svc = master_rt
            .run(MasterService::start(mcfg))
            .await?
            .with_context(|| format!("starting the master on {}", args.master.listen))?;
        let master = svc.rpc_addr().to_string();
        (None, None, Some(svc), master)
    };
    let mut ncfg = args.node.node_config(&master);
    ncfg.tiers = args.node.tier_config(store.clone());
    ncfg.data_dir = Some(args.data.clone());
    let node = Node::start(ncfg).await.context("starting the node")?;
    node.wait_registered(Duration::from_secs(10)).await.context("the node did not register")?;
    println!("kvfs is up: master {master}");
    println!(
        "  node {} with {} of DRAM at {}",
        node.id(),
        human_bytes(args.node.dram),
        node.endpoint()
    );
    if let Some(a) = svc.as_ref().and_then(|s| s.admin_addr()).or(ha.as_ref().and_then(|h| h.admin))
    {
        println!("  metrics http://{a}/metrics   health http://{a}/health");
    }
    if ha.is_some() {
        println!(
            "  leading through etcd at {} (data {}); add a standby: kvfs master --etcd {} --listen HOST:PORT",
            args.etcd_listen,
            args.data.join("etcd").display(),
            args.etcd_listen
        );
    }
    println!("  data {}", args.data.display());
    // The node runs in this process: the mount serves its NVMe objects with FUSE passthrough.
    let mounted = match &args.mount {
        Some(dir) => {
            let files = super::mount::NodeSource(node.object_files());
            let m = super::mount::start_with(
                &master,
                dir.clone(),
                &super::mount::MountArgs::default_for_up(),
                Some(std::sync::Arc::new(files)),
            )
            .await?;
            println!("  mounted at {}", dir.display());
            Some(m)
        }
        None => None,
    };
    let conductor = match args.conductor {
        Some(addr) => Some(
            start_conductor(addr, &args.master.kv_events, args.master.reference.enable_kv_events)
                .await?,
        ),
        None => None,
    };
    print_tiers(&node, Some(&args.data), args.node.nvmeof.as_ref());
    match &store {
        Some(kvfs_tiers::ObjectStoreConfig::Fs { root }) => {
            println!("  object store {}", root.display())
        }
        Some(kvfs_tiers::ObjectStoreConfig::S3 { endpoint, bucket, .. }) => {
            println!("  object store s3://{bucket} at {endpoint}")
        }
        _ => println!("  object store off"),
    }
    println!(
        "try: kvfs put --master {master} hello ./README.md && kvfs get --master {master} hello -"
    );
    wait_for_signal().await;
    if let Some(c) = conductor {
        c.abort();
    }
    if let Some(m) = mounted {
        super::mount::stop(m).await;
    }
    node.shutdown().await;
    drop(svc);
    if let Some(h) = ha {
        let _ = h.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), h.task).await;
    }
    drop(master_rt);
    drop(etcd);
    Ok(())
}

/// `kvfs up --conductor`: the conductor's HTTP API in this process, and the pool registered
/// with it when the master publishes its events for one model and block size.
async fn start_conductor(
    addr: std::net::SocketAddr,
    events: &KvEventsArgs,
    enable: Option<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    use kvfs_conductor::service::{Config, Registration, Shared};
    // As `kvfs conductor` does (process-wide: the node in this process keeps its freed
    // buffers mapped too, as the Python package's embedded node does). Without it a 128k-token
    // query's short-lived megabytes are mapped, faulted in and unmapped on every query: an
    // axum server doing no work answered 512 KiB in and 368 KB out in 540-600 us p50 without
    // it and 150-160 us with it.
    kvfs_client::keep_freed_buffers();
    let shared = Shared::new(&Config::default());
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the conductor on {addr}"))?;
    let at = listener.local_addr()?;
    let task = tokio::spawn({
        let shared = shared.clone();
        async move {
            if let Err(e) = kvfs_conductor::service::serve(listener, shared).await {
                eprintln!("kvfs conductor: {e}");
            }
        }
    });
    println!("  conductor http://{at} (/register, /query, /route, /metrics)");
    let local =
        |ep: &str| ep.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:");
    match (events.config(enable)?, &events.model_name, events.block_size) {
        (Some(c), Some(model), bs) if bs > 0 => {
            let reg = Registration {
                endpoint: local(&c.endpoint),
                replay_endpoint: c.replay_endpoint.as_deref().map(local),
                kind: "kvfs".into(),
                modelname: model.clone(),
                lora_name: events.lora_name.clone(),
                tenant_id: events.tenant_id.clone().unwrap_or_else(|| "default".into()),
                instance_id: events.backend_id.clone().unwrap_or_else(|| "kvfs-pool".into()),
                block_size: bs,
                dp_rank: events.dp_rank,
                hash_algorithm: None,
                python_hash_seed: None,
                role: None,
            };
            shared.register(reg).map_err(|e| anyhow::anyhow!("registering the pool: {e}"))?;
            println!("  the pool's events ({model}, {bs}-token blocks) feed the conductor");
        }
        (Some(_), _, _) => println!(
            "  the pool is not indexed: give --kv-events-model-name and --kv-events-block-size"
        ),
        (None, _, _) => {
            println!("  the pool is not indexed (publish its events with --kv-events-endpoint)")
        }
    }
    Ok(task)
}
