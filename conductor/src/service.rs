//! The conductor's HTTP service: registrations of event sources, prefix queries, the global
//! view, and Prometheus metrics.
//!
//! Endpoints (the reference conductor's paths and shapes, so its example router works
//! unchanged; bodies are JSON, or msgpack when the request's `Content-Type` is
//! `application/msgpack`, answered in the same encoding):
//! - `POST /register` `{endpoint, replay_endpoint?, type, modelname, lora_name?, tenant_id?,
//!   instance_id, block_size, dp_rank?, hash_algorithm?, python_hash_seed?}` starts
//!   subscribing (a registration with the same instance, tenant and rank replaces the old);
//!   `type` is `vLLM`, `SGLang` (engine-local blocks) or `kvfs`/`Mooncake` (a shared pool).
//! - `POST /unregister` `{instance_id, tenant_id?, dp_rank?}` stops it and forgets its blocks.
//! - `POST /query` `{model, lora_name?, lora_path?, token_ids, tenant_id?, instance_id?,
//!   block_size, cache_salt?}`: the token ids (integers, or in msgpack one binary of
//!   little-endian u32) are hashed as the context's engines hash them;
//!   `POST /query_by_hash` takes `seq_hashes` (or `block_hash`) instead. Both answer
//!   `{instances: {id: {longest_matched, gpu, cpu, disk, dp: {rank: gpu}, rank_matches:
//!   {rank: {gpu, cpu, disk}}}}}` in tokens (cumulative, `gpu <= cpu <= disk`).
//! - `GET /global_view`, `GET /services`, `GET /metrics`, `GET /health`.
//!
//! Errors are JSON `{"error": ...}` with 400 (bad input), 404, 405 or 415.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use crate::hash::{Algorithm, BlockHasher, Extra, HashProfile, LoraKey, project_low64_be};
use crate::index::{ContextKey, Index, OwnerKey};

/// One event source, as registered.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Registration {
    pub endpoint: String,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(rename = "type", default = "default_type")]
    pub kind: String,
    pub modelname: String,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default = "default_tenant")]
    pub tenant_id: String,
    pub instance_id: String,
    pub block_size: u32,
    #[serde(default)]
    pub dp_rank: u32,
    /// vLLM's `--prefix-caching-hash-algo` for token queries of this context.
    #[serde(default)]
    pub hash_algorithm: Option<String>,
    /// The engines' `PYTHONHASHSEED`.
    #[serde(default)]
    pub python_hash_seed: Option<String>,
}

fn default_type() -> String {
    "vLLM".into()
}

fn default_tenant() -> String {
    "default".into()
}

impl Registration {
    /// A shared pool (its blocks serve every instance) rather than one engine's cache.
    pub fn shared(&self) -> bool {
        matches!(self.kind.to_ascii_lowercase().as_str(), "kvfs" | "mooncake")
    }

    fn validate(&self) -> Result<(), String> {
        if !matches!(
            self.kind.to_ascii_lowercase().as_str(),
            "vllm" | "sglang" | "kvfs" | "mooncake"
        ) {
            return Err(format!("unknown type {:?} (vLLM, SGLang, kvfs, Mooncake)", self.kind));
        }
        if !self.endpoint.starts_with("tcp://") {
            return Err(format!("endpoint {:?}: only tcp:// endpoints", self.endpoint));
        }
        if let Some(r) = &self.replay_endpoint
            && !r.starts_with("tcp://")
        {
            return Err(format!("replay_endpoint {r:?}: only tcp:// endpoints"));
        }
        if self.block_size == 0 {
            return Err("block_size must be positive".into());
        }
        if self.instance_id.is_empty() || self.modelname.is_empty() {
            return Err("instance_id and modelname must be set".into());
        }
        if let Some(a) = &self.hash_algorithm {
            a.parse::<Algorithm>().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub connects: AtomicU64,
    pub reconnects: AtomicU64,
    pub batches: AtomicU64,
    pub events: AtomicU64,
    pub skipped: AtomicU64,
    pub malformed: AtomicU64,
    pub duplicates: AtomicU64,
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub replayed: AtomicU64,
    pub lost: AtomicU64,
    pub restarts: AtomicU64,
    /// Sources whose blocks expired because their publisher stayed unreachable.
    pub expired: AtomicU64,
    pub queries: AtomicU64,
    pub query_errors: AtomicU64,
    /// Query latency histogram: counts at or below each bound of `LATENCY_BOUNDS_US`.
    pub query_us: [AtomicU64; LATENCY_BOUNDS_US.len()],
    pub query_us_sum: AtomicU64,
}

const LATENCY_BOUNDS_US: [u64; 10] = [50, 100, 250, 500, 1000, 2500, 5000, 10_000, 50_000, 250_000];

impl Metrics {
    fn observe_query(&self, us: u64) {
        self.queries.fetch_add(1, Ordering::Relaxed);
        self.query_us_sum.fetch_add(us, Ordering::Relaxed);
        for (i, b) in LATENCY_BOUNDS_US.iter().enumerate() {
            if us <= *b {
                self.query_us[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

struct SourceHandle {
    reg: Arc<Registration>,
    stop: tokio::sync::watch::Sender<bool>,
}

/// State shared by the HTTP handlers and the source tasks.
pub struct Shared {
    pub index: Mutex<Index>,
    pub metrics: Metrics,
    sources: Mutex<BTreeMap<(String, String, u32), SourceHandle>>,
    /// Hash profile per context (tenant, model, block size), from registrations.
    profiles: Mutex<HashMap<(String, String, u32), Arc<BlockHasher>>>,
    default_profile: HashProfile,
    /// The default profile made ready once (its root hash), or why it cannot hash (an xxhash
    /// profile without a seed), answered to every token query that needs it.
    default_hasher: Result<Arc<BlockHasher>, String>,
    /// A publisher unreachable this long has its blocks cleared.
    pub source_ttl: std::time::Duration,
}

/// Settings of a conductor.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most block entries the index keeps.
    pub entries_max: usize,
    /// How token queries hash when a registration does not say.
    pub default_profile: HashProfile,
    /// A publisher unreachable this long (its engine is gone) has its blocks cleared.
    pub source_ttl: std::time::Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            entries_max: 10_000_000,
            default_profile: HashProfile {
                algorithm: Algorithm::Sha256Cbor,
                python_hash_seed: None,
            },
            source_ttl: std::time::Duration::from_secs(30),
        }
    }
}

impl Shared {
    pub fn new(cfg: &Config) -> Arc<Shared> {
        Arc::new(Shared {
            index: Mutex::new(Index::new(cfg.entries_max)),
            metrics: Metrics::default(),
            sources: Mutex::new(BTreeMap::new()),
            profiles: Mutex::new(HashMap::new()),
            default_profile: cfg.default_profile.clone(),
            default_hasher: BlockHasher::new(&cfg.default_profile)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
            source_ttl: cfg.source_ttl,
        })
    }

    /// Starts (or replaces) a source; must run inside a tokio runtime.
    pub fn register(self: &Arc<Self>, reg: Registration) -> Result<(), String> {
        reg.validate()?;
        let profile = HashProfile {
            algorithm: match &reg.hash_algorithm {
                Some(a) => a.parse().map_err(|e: crate::hash::HashError| e.to_string())?,
                None => self.default_profile.algorithm,
            },
            python_hash_seed: reg
                .python_hash_seed
                .clone()
                .or_else(|| self.default_profile.python_hash_seed.clone()),
        };
        let hasher = BlockHasher::new(&profile).map_err(|e| e.to_string())?;
        self.profiles.lock().unwrap_or_else(|e| e.into_inner()).insert(
            (reg.tenant_id.clone(), reg.modelname.clone(), reg.block_size),
            Arc::new(hasher),
        );
        {
            let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
            let id = ix.owner(
                &OwnerKey { instance: reg.instance_id.clone(), dp_rank: reg.dp_rank },
                reg.shared(),
            );
            ix.join(
                id,
                &ContextKey {
                    tenant: reg.tenant_id.clone(),
                    model: reg.modelname.clone(),
                    lora: reg.lora_name.clone().unwrap_or_default(),
                    block_size: reg.block_size,
                },
            );
        }
        let key = (reg.instance_id.clone(), reg.tenant_id.clone(), reg.dp_rank);
        let (stop, rx) = tokio::sync::watch::channel(false);
        let reg = Arc::new(reg);
        tokio::spawn(crate::source::run(reg.clone(), self.clone(), rx));
        let old = self
            .sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, SourceHandle { reg, stop });
        if let Some(old) = old {
            let _ = old.stop.send(true);
        }
        Ok(())
    }

    /// Stops a source and forgets its blocks; returns the keys removed.
    pub fn unregister(&self, instance: &str, tenant: &str, dp_rank: Option<u32>) -> Vec<String> {
        let mut removed = Vec::new();
        let mut sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<_> = sources
            .keys()
            .filter(|(i, t, r)| i == instance && t == tenant && dp_rank.is_none_or(|d| d == *r))
            .cloned()
            .collect();
        for k in keys {
            if let Some(h) = sources.remove(&k) {
                let _ = h.stop.send(true);
                let mut ix = self.index.lock().unwrap_or_else(|e| e.into_inner());
                let id = ix.owner(&OwnerKey { instance: k.0.clone(), dp_rank: k.2 }, false);
                ix.remove_owner(id);
                removed.push(format!("{}|{}|{}", k.0, k.1, k.2));
            }
        }
        removed
    }

    fn hasher(
        &self,
        tenant: &str,
        model: &str,
        block_size: u32,
    ) -> Result<Arc<BlockHasher>, String> {
        let key = (tenant.to_string(), model.to_string(), block_size);
        if let Some(h) = self.profiles.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(h.clone());
        }
        self.default_hasher.clone()
    }
}

/// The router of the service.
pub fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/global_view", get(global_view))
        .route("/services", get(services))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(shared)
}

/// Largest request body (a 128k-token prompt as JSON is about 1 MB).
const BODY_BYTES_MAX: usize = 16 << 20;

/// Serves until the listener fails.
pub async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) -> std::io::Result<()> {
    axum::serve(listener, router(shared)).await
}

#[derive(Clone, Copy, PartialEq)]
enum Enc {
    Json,
    Msgpack,
}

fn encoding(h: &HeaderMap) -> Enc {
    let ct = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct.contains("msgpack") { Enc::Msgpack } else { Enc::Json }
}

/// The request body, or the 400 answer naming what is wrong with it.
fn decode<T: serde::de::DeserializeOwned>(enc: Enc, body: &[u8]) -> Result<T, Box<Response>> {
    let r = match enc {
        Enc::Json => serde_json::from_slice(body).map_err(|e| e.to_string()),
        Enc::Msgpack => rmp_serde::from_slice(body).map_err(|e| e.to_string()),
    };
    r.map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, &format!("bad request body: {e}"))))
}

fn reply<T: Serialize>(enc: Enc, v: &T) -> Response {
    match enc {
        Enc::Json => axum::Json(v).into_response(),
        Enc::Msgpack => match rmp_serde::to_vec_named(v) {
            Ok(b) => ([(header::CONTENT_TYPE, "application/msgpack")], b).into_response(),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        },
    }
}

fn error(code: StatusCode, msg: &str) -> Response {
    (code, axum::Json(serde_json::json!({ "error": msg }))).into_response()
}

async fn register(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    let enc = encoding(&h);
    let reg: Registration = match decode(enc, &body) {
        Ok(r) => r,
        Err(e) => return *e,
    };
    let id = reg.instance_id.clone();
    match s.register(reg) {
        Ok(()) => {
            reply(enc, &serde_json::json!({"status": "registered successfully", "instance_id": id}))
        }
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

#[derive(Deserialize)]
struct Unregister {
    instance_id: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    #[serde(default)]
    dp_rank: Option<u32>,
}

async fn unregister(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    let enc = encoding(&h);
    let u: Unregister = match decode(enc, &body) {
        Ok(u) => u,
        Err(e) => return *e,
    };
    let removed = s.unregister(&u.instance_id, &u.tenant_id, u.dp_rank);
    if removed.is_empty() {
        return error(StatusCode::NOT_FOUND, "no such registration");
    }
    reply(
        enc,
        &serde_json::json!({"status": "unregistered successfully", "removed_instances": removed}),
    )
}

#[derive(Deserialize)]
struct Query {
    model: String,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    lora_path: Option<String>,
    #[serde(default)]
    token_ids: TokenIds,
    #[serde(default, alias = "block_hash")]
    seq_hashes: Vec<u64>,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    #[serde(default)]
    instance_id: Option<String>,
    block_size: u32,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Token ids as an array of integers, or (msgpack) as one binary of little-endian 32-bit
/// integers, as the reference conductor takes them: a 128k-token prompt is then one 512 KiB
/// copy to decode instead of 128k integers.
#[derive(Default)]
struct TokenIds(Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of token ids or little-endian 32-bit token ids as bytes")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<TokenIds, A::Error> {
                let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(t) = a.next_element::<u32>()? {
                    v.push(t);
                }
                Ok(TokenIds(v))
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<TokenIds, E> {
                if !b.len().is_multiple_of(4) {
                    return Err(E::custom(format!(
                        "{} bytes of token ids: not a multiple of 4",
                        b.len()
                    )));
                }
                Ok(TokenIds(
                    b.chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, b: Vec<u8>) -> Result<TokenIds, E> {
                self.visit_bytes(&b)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Serialize, Default)]
struct InstanceMatch {
    longest_matched: u64,
    gpu: u64,
    cpu: u64,
    disk: u64,
    dp: BTreeMap<String, u64>,
    rank_matches: BTreeMap<String, RankMatch>,
}

#[derive(Serialize)]
struct RankMatch {
    gpu: u64,
    cpu: u64,
    disk: u64,
}

#[derive(Serialize)]
struct QueryReply {
    instances: BTreeMap<String, InstanceMatch>,
}

async fn query(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    run_query(&s, &h, &body, false)
}

async fn query_by_hash(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    run_query(&s, &h, &body, true)
}

fn run_query(s: &Shared, h: &HeaderMap, body: &[u8], by_hash: bool) -> Response {
    let t = Instant::now();
    let enc = encoding(h);
    let q: Query = match decode(enc, body) {
        Ok(q) => q,
        Err(e) => {
            s.metrics.query_errors.fetch_add(1, Ordering::Relaxed);
            return *e;
        }
    };
    if q.block_size == 0 {
        s.metrics.query_errors.fetch_add(1, Ordering::Relaxed);
        return error(StatusCode::BAD_REQUEST, "block_size must be positive");
    }
    let ctx = ContextKey {
        tenant: q.tenant_id.clone(),
        model: q.model.clone(),
        lora: q.lora_name.clone().unwrap_or_default(),
        block_size: q.block_size,
    };
    let hashes: Vec<u64> = if by_hash {
        q.seq_hashes.clone()
    } else {
        let hasher = match s.hasher(&q.tenant_id, &q.model, q.block_size) {
            Ok(h) => h,
            Err(e) => return error(StatusCode::BAD_REQUEST, &e),
        };
        let extra = Extra {
            lora: q
                .lora_name
                .clone()
                .map(|name| LoraKey { name, path: q.lora_path.clone().unwrap_or_default() }),
            cache_salt: q.cache_salt.clone(),
        };
        match hasher.iter(&q.token_ids.0, q.block_size as usize, &extra) {
            Ok(it) => it.map(|d| project_low64_be(&d)).collect(),
            Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
        }
    };
    let matches = s.index.lock().unwrap_or_else(|e| e.into_inner()).query(&ctx, &hashes);
    let bs = u64::from(q.block_size);
    let mut out = QueryReply { instances: BTreeMap::new() };
    for m in matches {
        if q.instance_id.as_ref().is_some_and(|i| *i != m.owner.instance) {
            continue;
        }
        let e = out.instances.entry(m.owner.instance.clone()).or_default();
        let (g, c, d) = (m.gpu as u64 * bs, m.cpu as u64 * bs, m.disk as u64 * bs);
        e.gpu = e.gpu.max(g);
        e.cpu = e.cpu.max(c);
        e.disk = e.disk.max(d);
        e.longest_matched = e.longest_matched.max(d);
        e.dp.insert(m.owner.dp_rank.to_string(), g);
        e.rank_matches.insert(m.owner.dp_rank.to_string(), RankMatch { gpu: g, cpu: c, disk: d });
    }
    s.metrics.observe_query(t.elapsed().as_micros() as u64);
    reply(enc, &out)
}

async fn global_view(State(s): State<Arc<Shared>>, h: HeaderMap) -> Response {
    let contexts = s.index.lock().unwrap_or_else(|e| e.into_inner()).contexts();
    let list: Vec<serde_json::Value> = contexts
        .into_iter()
        .map(|(k, blocks, owners)| {
            let mut instances: BTreeMap<String, Vec<u32>> = BTreeMap::new();
            for o in owners {
                instances.entry(o.instance).or_default().push(o.dp_rank);
            }
            serde_json::json!({
                "model_name": k.model, "lora_name": k.lora, "block_size": k.block_size,
                "tenant_id": k.tenant, "prefix_count": blocks, "instances": instances,
            })
        })
        .collect();
    reply(encoding(&h), &serde_json::json!({"context_count": list.len(), "contexts": list}))
}

async fn services(State(s): State<Arc<Shared>>, h: HeaderMap) -> Response {
    let list: Vec<Registration> = s
        .sources
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .map(|h| (*h.reg).clone())
        .collect();
    reply(encoding(&h), &serde_json::json!({"count": list.len(), "services": list}))
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let m = &s.metrics;
    let st = s.index.lock().unwrap_or_else(|e| e.into_inner()).stats();
    let sources = s.sources.lock().unwrap_or_else(|e| e.into_inner()).len();
    let mut out = String::new();
    let mut counter = |name: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP kvfs_conductor_{name} {help}\n# TYPE kvfs_conductor_{name} counter\nkvfs_conductor_{name} {v}\n"
        ));
    };
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    counter("connects_total", "Connections made to event publishers.", l(&m.connects));
    counter("reconnects_total", "Publisher connections lost and retried.", l(&m.reconnects));
    counter("batches_total", "Event batches applied.", l(&m.batches));
    counter("events_total", "Events applied.", l(&m.events));
    counter("events_skipped_total", "Events of unknown types skipped.", l(&m.skipped));
    counter("malformed_total", "Messages or batches refused as malformed.", l(&m.malformed));
    counter("duplicates_total", "Batches already applied, skipped.", l(&m.duplicates));
    counter("gaps_total", "Sequence gaps seen on live streams.", l(&m.gaps));
    counter("replays_total", "Replay requests sent to publishers.", l(&m.replays));
    counter("replayed_batches_total", "Batches received by replay.", l(&m.replayed));
    counter("lost_batches_total", "Batches no replay could recover.", l(&m.lost));
    counter("publisher_restarts_total", "Publisher restarts detected.", l(&m.restarts));
    counter("sources_expired_total", "Sources whose publisher stayed unreachable.", l(&m.expired));
    counter("queries_total", "Prefix queries answered.", l(&m.queries));
    counter("query_errors_total", "Prefix queries refused.", l(&m.query_errors));
    counter("index_evicted_total", "Index entries dropped by the memory bound.", st.evicted);
    let mut gauge = |name: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP kvfs_conductor_{name} {help}\n# TYPE kvfs_conductor_{name} gauge\nkvfs_conductor_{name} {v}\n"
        ));
    };
    gauge("index_entries", "Block entries in the index.", st.entries as u64);
    gauge("index_contexts", "Contexts (tenant, model, LoRA, block size).", st.contexts as u64);
    gauge("index_owners", "Owners (instance, DP rank, pools).", st.owners as u64);
    gauge("sources", "Registered event sources.", sources as u64);
    out.push_str(
        "# HELP kvfs_conductor_query_seconds Prefix query latency.\n# TYPE kvfs_conductor_query_seconds histogram\n",
    );
    for (i, b) in LATENCY_BOUNDS_US.iter().enumerate() {
        out.push_str(&format!(
            "kvfs_conductor_query_seconds_bucket{{le=\"{}\"}} {}\n",
            *b as f64 / 1e6,
            l(&m.query_us[i])
        ));
    }
    out.push_str(&format!(
        "kvfs_conductor_query_seconds_bucket{{le=\"+Inf\"}} {q}\nkvfs_conductor_query_seconds_sum {}\nkvfs_conductor_query_seconds_count {q}\n",
        l(&m.query_us_sum) as f64 / 1e6,
        q = l(&m.queries)
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
