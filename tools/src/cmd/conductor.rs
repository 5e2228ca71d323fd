//! `kvfs conductor`: the prefix-cache index and its HTTP API, fed by the engines' KV events.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use kvfs_conductor::hash::{Algorithm, HashProfile};
use kvfs_conductor::route::{CostModel, Policy};
use kvfs_conductor::service::{Config, Registration, RouteConfig, Shared};

#[derive(clap::Args, Debug)]
pub struct ConductorArgs {
    /// HTTP address of the API (`/register`, `/query`, `/query_by_hash`, `/route`,
    /// `/global_view`, `/services`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:13333", env = "KVFS_CONDUCTOR_LISTEN")]
    pub listen: SocketAddr,
    /// Static registrations, the reference conductor's `conductor_config.json`:
    /// `{"http_server_port": P, "kvevent_instance": {"<id>": {endpoint, replay_endpoint, type,
    /// modelname, block_size, dp_rank, ...}}}` (`http_server_port` is used when `--listen` is
    /// not given).
    #[arg(long, env = "CONDUCTOR_CONFIG_PATH")]
    pub config: Option<PathBuf>,
    /// Most block entries the index keeps (least recently used ones go first past it).
    #[arg(long, default_value_t = 10_000_000)]
    pub entries_max: usize,
    /// Most memory the index takes (4GiB, 512MiB, ...): its block tables, the owner sets of
    /// every block and its LRU queue, as allocated; least recently used entries go first
    /// past it (`kvfs_conductor_index_bytes` on /metrics). The hash memo is bounded apart
    /// (`--hash-memo-entries`). At least 1MiB.
    #[arg(long, default_value = "4GiB", value_parser = crate::bench::report::parse_bytes)]
    pub index_bytes_max: u64,
    /// How token queries hash prompts when a registration does not say: vLLM's
    /// `--prefix-caching-hash-algo` (sha256, sha256_cbor, xxhash, xxhash_cbor).
    #[arg(long, default_value = "sha256_cbor")]
    pub hash_algorithm: String,
    /// The engines' PYTHONHASHSEED (vLLM derives its root hash from it).
    #[arg(long, env = "KVFS_CONDUCTOR_PYTHON_HASH_SEED")]
    pub python_hash_seed: Option<String>,
    /// Seconds a publisher may stay unreachable before its blocks are forgotten (its engine,
    /// and so its cache, is gone).
    #[arg(long, default_value_t = 30)]
    pub source_ttl_s: u64,
    /// How `/route` picks the prefill instance: global-cache-aware (the FAST'25 paper's
    /// Algorithm 1: its own GPU prefix, or a longer one fetched from the pool or another
    /// instance, whichever gives the lowest predicted TTFT), local-cache-aware, load-balance
    /// or random.
    #[arg(long, default_value = "global-cache-aware")]
    pub route_policy: String,
    /// Accept every request `/route` is asked about, even when its SLOs are predicted to be
    /// missed (by default such a request gets 429 before any prefill is spent on it).
    #[arg(long)]
    pub no_early_rejection: bool,
    /// An instance fetches a longer prefix only when it is more than this many times its own.
    #[arg(long, default_value_t = 1.2)]
    pub balancing_threshold: f64,
    /// The cost model `/route` predicts with, a JSON object of the fields of
    /// `kvfs_conductor::route::CostModel` (prefill_base_ms, prefill_ms_per_token,
    /// prefill_ms_per_token_ctx, kv_bytes_per_token, pool_cpu_bytes_per_ms,
    /// pool_disk_bytes_per_ms, remote_gpu_bytes_per_ms, decode_base_ms, decode_ms_per_request,
    /// decode_ms_per_kv_token, decode_kv_tokens_max); missing fields keep the default, a
    /// 70B-class model on 8 GPUs per instance. Fit them to your engines' measured times.
    #[arg(long)]
    pub cost_model: Option<PathBuf>,
    /// Most hash-chain steps of token queries kept (0 turns the memo off): a prompt whose
    /// prefix was queried or routed before, or whose blocks an engine published with their
    /// tokens (vLLM and SGLang do), is hashed only past that prefix. A full memo takes about
    /// 220 bytes a step with its runs of 64 steps and the learned blocks' positions (RSS growth
    /// filling the default 512 Ki steps from events: 111 MiB).
    #[arg(long, default_value_t = 1 << 19)]
    pub hash_memo_entries: usize,
    /// Hash each token query on its own thread only. By default a long chain (16k tokens and
    /// more still to hash in blocks of 64 tokens or more, vLLM's sha256_cbor without LoRA) has
    /// its CBOR encoded ahead by a kept helper thread on another core while the query's thread
    /// runs SHA-256 (helpers: one fewer than the cores, shared by all queries).
    #[arg(long)]
    pub no_encode_ahead: bool,
}

pub async fn run(a: ConductorArgs, listen_given: bool) -> anyhow::Result<()> {
    // A 128k-token query moves a few megabytes of short-lived buffers (the tokens, their CBOR,
    // the answer): kept mapped, they cost no page faults on the next query (a third of its time
    // otherwise).
    kvfs_client::keep_freed_buffers();
    let algorithm: Algorithm = a.hash_algorithm.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let cost: CostModel = match &a.cost_model {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?
        }
        None => CostModel::DEFAULT,
    };
    cost.validate().map_err(|e| anyhow::anyhow!(e))?;
    anyhow::ensure!(
        a.balancing_threshold.is_finite() && a.balancing_threshold >= 1.0,
        "--balancing-threshold must be at least 1"
    );
    anyhow::ensure!(a.index_bytes_max >= 1 << 20, "--index-bytes-max must be at least 1MiB");
    let cfg = Config {
        entries_max: a.entries_max,
        index_bytes_max: usize::try_from(a.index_bytes_max).unwrap_or(usize::MAX),
        default_profile: HashProfile { algorithm, python_hash_seed: a.python_hash_seed.clone() },
        source_ttl: std::time::Duration::from_secs(a.source_ttl_s),
        route: RouteConfig {
            policy: a.route_policy.parse::<Policy>().map_err(|e| anyhow::anyhow!(e))?,
            early_rejection: !a.no_early_rejection,
            balancing_threshold: a.balancing_threshold,
            cost,
        },
        hash_memo_entries: a.hash_memo_entries,
        encode_ahead: !a.no_encode_ahead,
    };
    let shared = Shared::new(&cfg);
    let mut listen = a.listen;
    if let Some(path) = &a.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let sc: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if let (Some(p), false) = (sc["http_server_port"].as_u64(), listen_given) {
            listen.set_port(u16::try_from(p).context("http_server_port out of range")?);
        }
        let instances = sc["kvevent_instance"].as_object().cloned().unwrap_or_default();
        for (id, mut v) in instances {
            if let Some(o) = v.as_object_mut() {
                o.entry("instance_id").or_insert(serde_json::Value::String(id.clone()));
            }
            let reg: Registration = serde_json::from_value(v)
                .with_context(|| format!("{}: instance {id}", path.display()))?;
            shared.register(reg).map_err(|e| anyhow::anyhow!("instance {id}: {e}"))?;
        }
    }
    let listener =
        tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    eprintln!("kvfs conductor: serving http://{}", listener.local_addr()?);
    tokio::select! {
        r = kvfs_conductor::service::serve(listener, shared) => r.context("http server")?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
