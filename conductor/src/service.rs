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
//! - `POST /route`: the query's fields (token ids or hashes) plus `input_len?`, `output_len`,
//!   `ttft_slo_ms`, `tbt_slo_ms`, `prefill_instances?`, `decode_instances?` (default: the
//!   instances registered for the model, by their `role`: `prefill`, `decode` or `both`).
//!   The scheduler of [`crate::route`] (the FAST'25 paper's Algorithm 1 by default) picks the
//!   prefill instance with the lowest predicted TTFT, reusing its own GPU prefix or fetching a
//!   longer one from the pool or another instance's GPU, and the decode instance with the
//!   least KV load when that prefill ends. Answers `{prefill: {instance_id, dp_rank},
//!   decode: {instance_id}, predicted_ttft_ms, predicted_tbt_ms, prefix_tokens,
//!   transfer_tokens, fetch_from, replicate_hint}`; 429 `{error, reason: "ttft"|"tbt",
//!   predicted_ttft_ms, predicted_tbt_ms}` when an SLO is predicted to be missed (early
//!   rejection: no prefill is spent on it); 503 with reason `no_instance`. The scheduler's
//!   queues are its own predictions (a prefill instance is busy until its last accepted
//!   prefill is predicted to end), so requests the engines take from elsewhere are invisible
//!   to it.
//! - `GET /global_view`, `GET /services`, `GET /metrics`, `GET /health`.
//!
//! Errors are JSON `{"error": ...}` with 400 (bad input), 404, 405, 415, 429 or 503.

use std::borrow::Cow;
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

use crate::ahead::{Ahead, Crew};
use crate::hash::{
    Algorithm, BlockDigest, BlockHasher, Extra, HashProfile, LoraKey, project_low64_be,
};
use crate::index::{Bounds, ContextKey, Index, OwnerKey, RawMatch};
use crate::memo::{ChainMemo, Hit, Parent, RUN};
use crate::route::{
    CostModel, Decision, FetchFrom, Policy, PrefixMatch, RejectReason, RouteRequest, Scheduler,
    SchedulerConfig,
};

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
    /// What `/route` may send the instance: `prefill`, `decode` or `both` (the default; an
    /// instance that prefills and decodes its own requests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
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
        if let Some(r) = &self.role
            && !matches!(r.as_str(), "prefill" | "decode" | "both")
        {
            return Err(format!("role {r:?}: prefill, decode or both"));
        }
        Ok(())
    }

    /// Whether `/route` may send it prefills (`prefill`) or decodes.
    fn serves(&self, prefill: bool) -> bool {
        !self.shared()
            && match self.role.as_deref() {
                Some("prefill") => prefill,
                Some("decode") => !prefill,
                _ => true,
            }
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
    pub query_errors: AtomicU64,
    /// Token chains whose CBOR a helper thread encoded ahead of their hashing.
    pub chains_ahead: AtomicU64,
    /// Latency of answered prefix queries (decoding, hashing, the index walk, the answer).
    pub query: Histogram,
    pub route_errors: AtomicU64,
    /// `/route` decisions: accepted, rejected on TTFT, on TBT, for want of an instance.
    pub routes_accepted: AtomicU64,
    pub routes_rejected_ttft: AtomicU64,
    pub routes_rejected_tbt: AtomicU64,
    pub routes_no_instance: AtomicU64,
    /// Accepted routes that fetch a prefix from another instance's GPU (the pool lacks it).
    pub replicate_hints: AtomicU64,
    pub route: Histogram,
}

const LATENCY_BOUNDS_US: [u64; 10] = [50, 100, 250, 500, 1000, 2500, 5000, 10_000, 50_000, 250_000];

/// A latency histogram in Prometheus's shape (cumulative buckets, sum, count).
#[derive(Default)]
pub struct Histogram {
    /// Counts at or below each bound of `LATENCY_BOUNDS_US`.
    buckets: [AtomicU64; LATENCY_BOUNDS_US.len()],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, us: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        for (i, b) in LATENCY_BOUNDS_US.iter().enumerate() {
            if us <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.push_str(&format!(
            "# HELP kvfs_conductor_{name} {help}\n# TYPE kvfs_conductor_{name} histogram\n"
        ));
        for (i, b) in LATENCY_BOUNDS_US.iter().enumerate() {
            out.push_str(&format!(
                "kvfs_conductor_{name}_bucket{{le=\"{}\"}} {}\n",
                *b as f64 / 1e6,
                l(&self.buckets[i])
            ));
        }
        out.push_str(&format!(
            "kvfs_conductor_{name}_bucket{{le=\"+Inf\"}} {q}\nkvfs_conductor_{name}_sum {}\nkvfs_conductor_{name}_count {q}\n",
            l(&self.sum_us) as f64 / 1e6,
            q = l(&self.count)
        ));
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
    router: Mutex<Live>,
    /// Chain steps of token queries computed lately (see [`crate::memo`]).
    pub memo: Mutex<ChainMemo>,
    /// Helpers encoding long token chains ahead of their hashing (see [`crate::ahead`]).
    ahead_crew: Crew,
}

/// The scheduler of `/route` and the names of its instances.
struct Live {
    sched: Scheduler,
    /// The scheduler's clock starts here.
    start: Instant,
    prefill: Names,
    decode: Names,
}

/// Instance names and their indices in the scheduler, in order of first use.
#[derive(Default)]
struct Names {
    names: Vec<String>,
    index: HashMap<String, usize>,
}

impl Names {
    /// The index of `name`, calling `add` (which returns the new index) on first use.
    fn get_or_add(&mut self, name: &str, add: impl FnOnce() -> usize) -> usize {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        let i = add();
        debug_assert_eq!(i, self.names.len());
        self.names.push(name.to_string());
        self.index.insert(name.to_string(), i);
        i
    }
}

/// How `/route` decides.
#[derive(Debug, Clone, Copy)]
pub struct RouteConfig {
    pub policy: Policy,
    /// Answer 429 when the predicted TTFT or TBT misses the request's SLO.
    pub early_rejection: bool,
    /// Algorithm 1's threshold: an instance fetches a longer prefix only when it is more than
    /// this many times its own.
    pub balancing_threshold: f64,
    pub cost: CostModel,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            policy: Policy::GlobalCacheAware,
            early_rejection: true,
            balancing_threshold: 1.2,
            cost: CostModel::DEFAULT,
        }
    }
}

/// Settings of a conductor.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most block entries the index keeps.
    pub entries_max: usize,
    /// Most memory the index takes ([`Index::bytes`]).
    pub index_bytes_max: usize,
    /// How token queries hash when a registration does not say.
    pub default_profile: HashProfile,
    /// A publisher unreachable this long (its engine is gone) has its blocks cleared.
    pub source_ttl: std::time::Duration,
    pub route: RouteConfig,
    /// Most chain steps the memo of token queries keeps (0: none; about 220 bytes each).
    pub hash_memo_entries: usize,
    /// Whether a long token chain's CBOR is encoded ahead of its hashing on another core
    /// (see [`crate::ahead`]).
    pub encode_ahead: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            entries_max: 10_000_000,
            index_bytes_max: 4 << 30,
            default_profile: HashProfile {
                algorithm: Algorithm::Sha256Cbor,
                python_hash_seed: None,
            },
            source_ttl: std::time::Duration::from_secs(30),
            route: RouteConfig::default(),
            hash_memo_entries: 1 << 19,
            encode_ahead: true,
        }
    }
}

impl Shared {
    pub fn new(cfg: &Config) -> Arc<Shared> {
        Arc::new(Shared {
            index: Mutex::new(Index::new(Bounds {
                entries_max: cfg.entries_max,
                bytes_max: cfg.index_bytes_max,
            })),
            metrics: Metrics::default(),
            sources: Mutex::new(BTreeMap::new()),
            profiles: Mutex::new(HashMap::new()),
            default_profile: cfg.default_profile.clone(),
            default_hasher: BlockHasher::new(&cfg.default_profile)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
            source_ttl: cfg.source_ttl,
            router: Mutex::new(Live {
                sched: Scheduler::new(SchedulerConfig {
                    prefill_instances: 0,
                    decode_instances: 0,
                    policy: cfg.route.policy,
                    early_rejection: cfg.route.early_rejection,
                    balancing_threshold: cfg.route.balancing_threshold,
                    seed: 1,
                    cost: cfg.route.cost,
                }),
                start: Instant::now(),
                prefill: Names::default(),
                decode: Names::default(),
            }),
            memo: Mutex::new(ChainMemo::new(cfg.hash_memo_entries)),
            ahead_crew: Crew::for_this_machine(cfg.encode_ahead),
        })
    }

    /// Turns [`Config::encode_ahead`] on or off for the queries that start from now on (so a
    /// bench can time both in one run).
    pub fn set_encode_ahead(&self, on: bool) {
        self.ahead_crew.set(on);
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

/// The router of the service. Event sources registered over HTTP run on `sources`, a runtime
/// that outlives any one connection's event loop.
pub fn router(shared: Arc<Shared>, sources: tokio::runtime::Handle) -> axum::Router {
    axum::Router::new()
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/route", post(route))
        .route("/global_view", get(global_view))
        .route("/services", get(services))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_BYTES_MAX))
        .layer(axum::Extension(sources))
        .with_state(shared)
}

/// Largest request body (a 128k-token prompt as JSON is about 1 MB).
const BODY_BYTES_MAX: usize = 16 << 20;

/// Most bytes a connection's read buffer grows to: a whole 128k-token query (half a megabyte
/// in msgpack, a megabyte in JSON) arrives in one read and one body chunk, not in the 400 KiB
/// pieces of hyper's default, each a wake-up of the connection's task.
const READ_BUFFER_MAX: usize = 2 << 20;

/// Most connections served at once, over all threads; more wait in the listen backlog.
const CONNECTIONS_MAX: usize = 4096;

/// Most threads serving HTTP (one per CPU below this).
const THREADS_MAX: usize = 16;

/// A 128k-token query is half a megabyte in and a third of one out: with the default buffers
/// (128 KiB to receive, 16 KiB to send, grown by autotuning) it crosses loopback in many
/// window-sized steps, each a wake-up of the other side.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// Serves until the listener fails or this future is dropped.
///
/// Each CPU's thread runs an event loop of its own (a current-thread runtime) that accepts
/// connections and serves them to the end: a query's request, its answer and every wake-up of
/// its connection's task stay on one thread. On a work-stealing runtime, hyper hands each body
/// chunk to the handler by waking its own task, and a sibling worker woken to steal it moved
/// the query to another CPU mid-request (two thread wake-ups, about 100 us each on a loaded
/// 2-core machine). Event sources registered over HTTP run on the caller's runtime. A
/// connection that sends no complete request head for 30 s (hyper's header timeout, which also
/// runs while a keep-alive connection waits for its next request) is closed, so idle
/// connections do not keep their slots of `CONNECTIONS_MAX`.
pub async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) -> std::io::Result<()> {
    if let Err(e) = socket2::SockRef::from(&listener).set_recv_buffer_size(SOCKET_BUFFER_BYTES) {
        tracing::debug!(error = %e, "SO_RCVBUF");
    }
    let listener = listener.into_std()?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(THREADS_MAX);
    let app = router(shared, tokio::runtime::Handle::current());
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    // Dropped with this future: every thread's loop ends and drops its connections.
    let (_stop, stopped) = tokio::sync::watch::channel(());
    let (ended_tx, mut ended) = tokio::sync::mpsc::channel(threads);
    for i in 0..threads {
        let (l, app, slots, mut stopped, ended_tx) =
            (listener.try_clone()?, app.clone(), slots.clone(), stopped.clone(), ended_tx.clone());
        std::thread::Builder::new().name(format!("conductor-http-{i}")).spawn(move || {
            let r =
                tokio::runtime::Builder::new_current_thread().enable_all().build().and_then(|rt| {
                    rt.block_on(async {
                        let l = tokio::net::TcpListener::from_std(l)?;
                        tokio::select! {
                            r = accept_loop(l, app, slots) => r,
                            _ = stopped.changed() => Ok(()),
                        }
                    })
                });
            let _ = ended_tx.blocking_send(r);
        })?;
    }
    drop(ended_tx);
    ended.recv().await.unwrap_or(Ok(()))
}

/// Accepts connections on this thread and serves each in a task of this thread's loop.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    slots: Arc<tokio::sync::Semaphore>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return Ok(()) };
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            // The peer gave up before its connection was taken: nothing to serve.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            // Out of descriptors or memory: the listener is fine, the machine is full.
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection; retrying in 100 ms");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        // Answers are written whole: no Nagle wait on their last segment.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        if let Err(e) = socket2::SockRef::from(&tcp).set_send_buffer_size(SOCKET_BUFFER_BYTES) {
            tracing::debug!(error = %e, "SO_SNDBUF");
        }
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .max_buf_size(READ_BUFFER_MAX)
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "HTTP connection");
            }
            drop(slot);
        });
    }
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
fn decode<'a, T: Deserialize<'a>>(enc: Enc, body: &'a [u8]) -> Result<T, Box<Response>> {
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

async fn register(
    State(s): State<Arc<Shared>>,
    axum::Extension(sources): axum::Extension<tokio::runtime::Handle>,
    h: HeaderMap,
    body: Bytes,
) -> Response {
    let _sources = sources.enter();
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
struct Query<'a> {
    model: String,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    lora_path: Option<String>,
    #[serde(default, borrow)]
    token_ids: TokenIds<'a>,
    #[serde(default, alias = "block_hash")]
    seq_hashes: Vec<u64>,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    #[serde(default)]
    instance_id: Option<String>,
    block_size: u32,
    #[serde(default)]
    cache_salt: Option<String>,
    // `/route` only.
    /// Prompt tokens (default: the token ids given, or the hashes times the block size).
    #[serde(default)]
    input_len: Option<u64>,
    /// Expected output tokens.
    #[serde(default)]
    output_len: Option<u64>,
    #[serde(default)]
    ttft_slo_ms: Option<f64>,
    #[serde(default)]
    tbt_slo_ms: Option<f64>,
    /// The instances it may go to (default: those registered for its model, by role).
    #[serde(default)]
    prefill_instances: Option<Vec<String>>,
    #[serde(default)]
    decode_instances: Option<Vec<String>>,
}

impl Query<'_> {
    fn context(&self) -> ContextKey {
        ContextKey {
            tenant: self.tenant_id.clone(),
            model: self.model.clone(),
            lora: self.lora_name.clone().unwrap_or_default(),
            block_size: self.block_size,
        }
    }

    /// The prompt's block hashes: the ones given (`by_hash`), or its tokens hashed as the
    /// context's engines hash them, up to the first block the index does not hold (the
    /// walk stops there).
    fn hashes(&self, s: &Shared, by_hash: bool, body: &Bytes) -> Result<Vec<u64>, String> {
        if self.block_size == 0 {
            return Err("block_size must be positive".into());
        }
        if by_hash {
            return Ok(self.seq_hashes.clone());
        }
        let hasher = s.hasher(&self.tenant_id, &self.model, self.block_size)?;
        let extra = Extra {
            lora: self
                .lora_name
                .clone()
                .map(|name| LoraKey { name, path: self.lora_path.clone().unwrap_or_default() }),
            cache_salt: self.cache_salt.clone(),
        };
        Ok(self.chain(s, &hasher, &extra, body))
    }

    /// Bytes `range` of the token ids as a buffer of their own: a part of `body` where they
    /// lie in it (no copy), else a copy.
    fn token_bytes(&self, body: &Bytes, range: std::ops::Range<usize>) -> Bytes {
        let part = &self.token_ids.0[range];
        let (base, at) = (body.as_ptr() as usize, part.as_ptr() as usize);
        if at >= base && at + part.len() <= base + body.len() {
            body.slice_ref(part)
        } else {
            Bytes::copy_from_slice(part)
        }
    }

    /// The token chain, block by block: a step the memo holds is looked up, a miss is
    /// computed (after hashing forward from the last full digest known, since steps learned
    /// from events carry projections only), and every few blocks (runs of 4 doubling to 64) the last
    /// block is checked against the index, so hashing stops where the walk will (the
    /// reference conductor also hashes only as far as a match can reach).
    fn chain(&self, s: &Shared, hasher: &BlockHasher, extra: &Extra, body: &Bytes) -> Vec<u64> {
        let bs = self.block_size as usize;
        // Little-endian bytes, as the memo fingerprints them; as ints only where hashed.
        let blocks: Vec<&[u8]> = self.token_ids.0.chunks_exact(4 * bs).collect();
        let mut ints = Vec::with_capacity(bs);
        let ctx = self.context();
        let (keys, enabled) = {
            let memo = s.memo.lock().unwrap_or_else(|e| e.into_inner());
            (memo.keys(), memo.enabled())
        };
        let scope = enabled.then(|| {
            let lora_path = extra.lora.as_ref().map_or("", |l| l.path.as_str());
            keys.scope(hasher, &chain_scope(&ctx, lora_path, &self.block_size.to_le_bytes()))
        });
        let salt = extra.cache_salt.as_deref().unwrap_or("");
        let mut out: Vec<u64> = Vec::with_capacity(blocks.len());
        // The last block whose full digest is known, and where it is.
        let mut known: Option<(usize, Known)> = None;
        let mut computed = Vec::new();
        // Runs looked up and missed (their first block, their key, and the full digest of
        // their last block once known), so the runs this query completes are remembered.
        let mut missed_runs: Vec<(usize, u128, Option<Vec<u8>>)> = Vec::new();
        let mut scratch = crate::hash::ChainScratch::default();
        let (mut step, mut next_check): (usize, usize) = (4, 4);
        // Held across a run of hits; let go to hash a miss and to ask the index.
        let mut memo = None;
        // Blocks encoded ahead on another core, from the block given (see `crate::ahead`).
        let mut ahead: Option<(usize, Arc<Ahead>)> = None;
        let encodable = hasher.takes_encoded(extra);
        // Block `at`'s digest given its parent's; a long stretch to hash, past the first check
        // against the index (`out_len` blocks known), hands the blocks from `at` on to a
        // helper that encodes them ahead on another core.
        let mut hash_at = |at: usize, full: Option<&[u8]>, out_len: usize, next_check: usize| {
            if ahead.is_none()
                && out_len >= 4
                && encodable
                && crate::ahead::worth_it(
                    (blocks.len() - at) * bs,
                    next_check.saturating_sub(at) * bs,
                    bs,
                )
                && let Some(a) = s.ahead_crew.start(|| {
                    Ahead::new(self.token_bytes(body, at * 4 * bs..blocks.len() * 4 * bs), bs)
                })
            {
                s.metrics.chains_ahead.fetch_add(1, Ordering::Relaxed);
                ahead = Some((at, a));
            }
            let items = match &ahead {
                Some((from, a)) if at >= *from && (at > 0 || salt.is_empty()) => a.items(at - from),
                _ => None,
            };
            match items {
                Some(items) => hasher.hash_block_encoded(&mut scratch, full, bs, &items),
                // No helper, or it holds this block's chunk.
                None => {
                    le_ints(blocks[at], &mut ints);
                    hasher.hash_block_in(&mut scratch, full, &ints, extra, at == 0)
                }
            }
        };
        let mut i = 0;
        while i < blocks.len() {
            let parent = match out.last() {
                None => Parent::First { salt },
                Some(&p) => Parent::Block(p),
            };
            let run = scope.filter(|_| i.is_multiple_of(RUN) && i + RUN <= blocks.len());
            let mut ran = false;
            if let Some(sc) = run {
                let all = &self.token_ids.0[i * 4 * bs..(i + RUN) * 4 * bs];
                let key = keys.run_key(sc, parent, all);
                let m =
                    memo.get_or_insert_with(|| s.memo.lock().unwrap_or_else(|e| e.into_inner()));
                match m.get_run(key) {
                    Some(hit) => {
                        out.extend_from_slice(hit.projections());
                        if let Some(d) = hit.digest() {
                            known = Some((i + RUN - 1, Known::Computed(BlockDigest::new(d))));
                        }
                        i += RUN;
                        ran = true;
                    }
                    None => missed_runs.push((i, key, None)),
                }
            }
            if !ran {
                let b = blocks[i];
                let key = scope.map(|sc| keys.key(sc, parent, b));
                let hit = key.and_then(|k| {
                    memo.get_or_insert_with(|| s.memo.lock().unwrap_or_else(|e| e.into_inner()))
                        .get(k)
                });
                match hit {
                    Some(h) => {
                        out.push(h.projection());
                        if h.digest().is_some() {
                            known = Some((i, Known::Held(h)));
                        }
                    }
                    None => {
                        memo = None;
                        // The parent's full digest: hashed forward from the last block whose
                        // digest is known (blocks learned from events hold none), so no block
                        // of a query is hashed twice.
                        let (mut at, mut full) = match known.take() {
                            Some((k, Known::Computed(d))) => (k + 1, Some(d)),
                            Some((k, Known::Held(h))) => (k + 1, h.digest().map(BlockDigest::new)),
                            None => (0, None),
                        };
                        let d = loop {
                            let d = hash_at(at, full.as_deref(), out.len(), next_check);
                            if at == i {
                                break d;
                            }
                            full = Some(d);
                            at += 1;
                        };
                        let projection = project_low64_be(&d);
                        if let Some(k) = key {
                            computed.push((k, projection, d));
                        }
                        out.push(projection);
                        known = Some((i, Known::Computed(d)));
                    }
                }
                // The last block of a missed run: keep its digest for the run, if known.
                if let (Some((at, _, end)), Some((k, known))) = (missed_runs.last_mut(), &known)
                    && *at + RUN == i + 1
                    && *k == i
                {
                    *end = known.digest().map(<[u8]>::to_vec);
                }
                i += 1;
            }
            if out.len() >= next_check && out.len() < blocks.len() {
                memo = None;
                let last = out[out.len() - 1];
                let reaches = s.index.lock().unwrap_or_else(|e| e.into_inner()).holds(&ctx, last);
                if !reaches {
                    break;
                }
                step = (step * 2).min(RUN);
                next_check = out.len() + step;
            }
        }
        // The helper may still be encoding: it stops after its chunk and lets go of its copy.
        if let Some((_, a)) = &ahead {
            a.stop();
        }
        drop(memo);
        missed_runs.retain(|(at, ..)| at + RUN <= out.len());
        if !computed.is_empty() || !missed_runs.is_empty() {
            let mut memo = s.memo.lock().unwrap_or_else(|e| e.into_inner());
            for (k, projection, d) in computed {
                memo.insert(k, projection, &d);
            }
            for (at, key, digest) in missed_runs {
                memo.insert_run(key, &out[at..at + RUN], digest.as_deref());
            }
        }
        out
    }
}

/// Where a token chain's last known full digest is: computed by the query, or held by a memo
/// hit (copied out only when a miss needs it).
enum Known {
    Computed(BlockDigest),
    Held(Hit),
}

impl Known {
    fn digest(&self) -> Option<&[u8]> {
        match self {
            Known::Computed(d) => Some(d),
            Known::Held(h) => h.digest(),
        }
    }
}

/// The memo scope of a context's chains: tenant, model, LoRA name and path, block size.
fn chain_scope<'a>(ctx: &'a ContextKey, lora_path: &'a str, bs: &'a [u8; 4]) -> [&'a [u8]; 5] {
    [ctx.tenant.as_bytes(), ctx.model.as_bytes(), ctx.lora.as_bytes(), lora_path.as_bytes(), bs]
}

impl Shared {
    /// Learn the chain steps of an engine's `BlockStored` event (its blocks' tokens, hashes
    /// and parent) for token queries of `ctx`. First blocks are not learned (a cache salt
    /// changes them and events do not carry it), nor blocks of LoRA contexts (their keys
    /// include the adapter's path, which events do not carry).
    pub fn learn_steps(&self, ctx: &ContextKey, event: &crate::event::Event) {
        let crate::event::Event::Stored { hashes, parent, token_ids, .. } = event else {
            return;
        };
        let bs = ctx.block_size as usize;
        if bs == 0 || !ctx.lora.is_empty() || token_ids.len() != hashes.len() * bs {
            return;
        }
        let Ok(hasher) = self.hasher(&ctx.tenant, &ctx.model, ctx.block_size) else { return };
        let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
        if !memo.enabled() {
            return;
        }
        let keys = memo.keys();
        let scope = keys.scope(&hasher, &chain_scope(ctx, "", &ctx.block_size.to_le_bytes()));
        let parents = std::iter::once(*parent).chain(hashes.iter().map(|&h| Some(h)));
        for ((&h, p), b) in hashes.iter().zip(parents).zip(token_ids.chunks_exact(bs)) {
            if let Some(p) = p {
                memo.learn(keys.key(scope, Parent::Block(p), &crate::memo::le_bytes(b)), h);
            }
        }
        // Where the event's blocks lie in their prompt: the first block of a chain, or after
        // a parent whose place is known.
        let base = match parent {
            None => Some(0),
            Some(p) => memo.position(keys.position_key(scope, *p)).map(|at| at + 1),
        };
        if let Some(base) = base {
            for (k, &h) in hashes.iter().enumerate() {
                memo.set_position(keys.position_key(scope, h), base.saturating_add(k as u32));
            }
        }
        // Runs on a query's grid (see `memo::RUN`; the event's own offsets where its place is
        // unknown), where their parent is known.
        let first = base.map_or(0, |b| (RUN - b as usize % RUN) % RUN);
        for k in (first..hashes.len()).step_by(RUN) {
            let p = if k == 0 { *parent } else { Some(hashes[k - 1]) };
            if let Some(p) = p
                && k + RUN <= hashes.len()
            {
                let tokens = crate::memo::le_bytes(&token_ids[k * bs..(k + RUN) * bs]);
                let key = keys.run_key(scope, Parent::Block(p), &tokens);
                memo.insert_run(key, &hashes[k..k + RUN], None);
            }
        }
    }
}

/// `b`'s little-endian 32-bit ints into `out` (its contents replaced).
fn le_ints(b: &[u8], out: &mut Vec<u32>) {
    out.clear();
    out.extend(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
}

/// Token ids as an array of integers, or (msgpack) as one binary of little-endian 32-bit
/// integers, as the reference conductor takes them, held as little-endian bytes: a 128k-token
/// prompt in a binary is then read where it lies in the request (the memo fingerprints those
/// bytes; only blocks that must be hashed are read as ints).
#[derive(Default)]
struct TokenIds<'a>(Cow<'a, [u8]>);

impl TokenIds<'_> {
    fn len(&self) -> usize {
        self.0.len() / 4
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for TokenIds<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        fn whole<E: serde::de::Error>(b: &[u8]) -> Result<(), E> {
            if b.len().is_multiple_of(4) {
                Ok(())
            } else {
                Err(E::custom(format!("{} bytes of token ids: not a multiple of 4", b.len())))
            }
        }
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TokenIds<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of token ids or little-endian 32-bit token ids as bytes")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<TokenIds<'de>, A::Error> {
                let mut v = Vec::with_capacity(4 * a.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(t) = a.next_element::<u32>()? {
                    v.extend_from_slice(&t.to_le_bytes());
                }
                Ok(TokenIds(Cow::Owned(v)))
            }
            fn visit_borrowed_bytes<E: serde::de::Error>(
                self,
                b: &'de [u8],
            ) -> Result<TokenIds<'de>, E> {
                whole(b)?;
                Ok(TokenIds(Cow::Borrowed(b)))
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<TokenIds<'de>, E> {
                whole(b)?;
                Ok(TokenIds(Cow::Owned(b.to_vec())))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, b: Vec<u8>) -> Result<TokenIds<'de>, E> {
                whole(&b)?;
                Ok(TokenIds(Cow::Owned(b)))
            }
        }
        d.deserialize_any(V)
    }
}

async fn query(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    run_query(&s, &h, &body, false)
}

async fn query_by_hash(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    run_query(&s, &h, &body, true)
}

fn run_query(s: &Shared, h: &HeaderMap, body: &Bytes, by_hash: bool) -> Response {
    let t = Instant::now();
    let enc = encoding(h);
    match answer_query(s, enc == Enc::Msgpack, body, by_hash) {
        Ok(body) => {
            let ct = match enc {
                Enc::Json => "application/json",
                Enc::Msgpack => "application/msgpack",
            };
            let r = ([(header::CONTENT_TYPE, ct)], body).into_response();
            s.metrics.query.observe(t.elapsed().as_micros() as u64);
            r
        }
        Err(e) => {
            s.metrics.query_errors.fetch_add(1, Ordering::Relaxed);
            error(StatusCode::BAD_REQUEST, &e)
        }
    }
}

/// A msgpack query with its `token_ids` int array rewritten as one LE binary
/// ([`crate::token_array`]: read by hand, not id by id through serde), else `body` itself.
fn tokens_as_binary(enc: Enc, body: &Bytes) -> Bytes {
    match enc {
        Enc::Msgpack => {
            crate::token_array::as_binary(body).map_or_else(|| body.clone(), Bytes::from)
        }
        Enc::Json => body.clone(),
    }
}

/// The answer to a `/query` (`by_hash`: `/query_by_hash`) body, JSON or msgpack, as the HTTP
/// handler sends it; `Err` says what is wrong with the request (public so that `kvfs bench
/// conductor` can time the service apart from HTTP).
pub fn answer_query(
    s: &Shared,
    msgpack: bool,
    body: &Bytes,
    by_hash: bool,
) -> Result<Vec<u8>, String> {
    let enc = if msgpack { Enc::Msgpack } else { Enc::Json };
    // A query by hash reads no token ids: its body is taken as it is.
    let body = &if by_hash { body.clone() } else { tokens_as_binary(enc, body) };
    let q: Query = match enc {
        Enc::Json => serde_json::from_slice(body).map_err(|e| format!("bad request body: {e}"))?,
        Enc::Msgpack => {
            rmp_serde::from_slice(body).map_err(|e| format!("bad request body: {e}"))?
        }
    };
    let hashes = q.hashes(s, by_hash, body)?;
    let ctx = q.context();
    let mut ix = s.index.lock().unwrap_or_else(|e| e.into_inner());
    let mut raw = Vec::new();
    ix.query_raw(&ctx, &hashes, &mut raw);
    Ok(encode_matches(enc, &ix, &raw, u64::from(q.block_size), q.instance_id.as_deref()))
}

/// The answer to a prefix query, `{instances: {id: {longest_matched, gpu, cpu, disk, dp:
/// {rank: gpu}, rank_matches: {rank: {gpu, cpu, disk}}}}}` in tokens, written in one pass
/// (an answer for 1,000 instances x 8 ranks is half a megabyte of JSON: building it as maps
/// of strings first cost more than the index walk).
fn encode_matches(enc: Enc, ix: &Index, raw: &[RawMatch], bs: u64, only: Option<&str>) -> Vec<u8> {
    // Each instance's matches as one run of `raw`. `raw` is sorted by owner, and an instance's
    // owners are mostly numbered together (its ranks register one after another), so they
    // usually lie in one run already, in rank order, and are written where they lie; where an
    // instance's owners are scattered, a copy of `raw` is sorted by instance (in order of first
    // appearance) and rank.
    let runs_of = |raw: &[RawMatch]| {
        let mut runs: Vec<(u32, usize, usize)> = Vec::new();
        for (k, m) in raw.iter().enumerate() {
            match runs.last_mut() {
                Some((i, _, end)) if *i == m.instance => *end = k + 1,
                _ => runs.push((m.instance, k, k + 1)),
            }
        }
        runs
    };
    let mut runs = runs_of(raw);
    let mut first_run = vec![u32::MAX; ix.instance_count()];
    let mut scattered = false;
    for (n, &(i, ..)) in runs.iter().enumerate() {
        let f = &mut first_run[i as usize];
        if *f == u32::MAX {
            *f = n as u32;
        } else {
            scattered = true;
        }
    }
    let sorted;
    let raw = if scattered {
        let mut v = raw.to_vec();
        v.sort_by_key(|m| (first_run[m.instance as usize], m.dp_rank));
        sorted = v;
        runs = runs_of(&sorted);
        &sorted[..]
    } else {
        raw
    };
    if let Some(only) = only {
        runs.retain(|&(i, ..)| ix.instance_name(i) == only);
    }
    let mut out = Vec::with_capacity(64 + runs.len() * 96 + raw.len() * 64);
    let mut unsorted: Vec<RawMatch> = Vec::new();
    let mut num = itoa::Buffer::new();
    let mut room = [0u8; CHUNK];
    let mut chunk = Chunk { buf: &mut room, len: 0 };
    match enc {
        Enc::Json => out.extend_from_slice(b"{\"instances\":{"),
        Enc::Msgpack => {
            let _ = rmp::encode::write_map_len(&mut out, 1);
            let _ = rmp::encode::write_str(&mut out, "instances");
            let _ = rmp::encode::write_map_len(&mut out, runs.len() as u32);
        }
    }
    for (n, &(inst, start, end)) in runs.iter().enumerate() {
        let mut ranks = &raw[start..end];
        if !ranks.is_sorted_by_key(|m| m.dp_rank) {
            unsorted.clear();
            unsorted.extend_from_slice(ranks);
            unsorted.sort_unstable_by_key(|m| m.dp_rank);
            ranks = &unsorted;
        }
        let max = |f: fn(&RawMatch) -> u32| u64::from(ranks.iter().map(f).max().unwrap_or(0)) * bs;
        let (g, c, d) = (max(|m| m.gpu), max(|m| m.cpu), max(|m| m.disk));
        let name = ix.instance_name(inst);
        match enc {
            Enc::Json => {
                if n > 0 {
                    out.push(b',');
                }
                let _ = serde_json::to_writer(&mut out, name);
                let fields = [
                    (":{\"longest_matched\":", d),
                    (",\"gpu\":", g),
                    (",\"cpu\":", c),
                    (",\"disk\":", d),
                ];
                for (key, v) in fields {
                    out.extend_from_slice(key.as_bytes());
                    out.extend_from_slice(num.format(v).as_bytes());
                }
                out.extend_from_slice(b",\"dp\":{");
                for (j, m) in ranks.iter().enumerate() {
                    if j > 0 {
                        out.push(b',');
                    }
                    out.push(b'"');
                    out.extend_from_slice(num.format(m.dp_rank).as_bytes());
                    out.extend_from_slice(b"\":");
                    out.extend_from_slice(num.format(u64::from(m.gpu) * bs).as_bytes());
                }
                out.extend_from_slice(b"},\"rank_matches\":{");
                for (j, m) in ranks.iter().enumerate() {
                    if j > 0 {
                        out.push(b',');
                    }
                    out.push(b'"');
                    out.extend_from_slice(num.format(m.dp_rank).as_bytes());
                    out.extend_from_slice(b"\":{\"gpu\":");
                    out.extend_from_slice(num.format(u64::from(m.gpu) * bs).as_bytes());
                    out.extend_from_slice(b",\"cpu\":");
                    out.extend_from_slice(num.format(u64::from(m.cpu) * bs).as_bytes());
                    out.extend_from_slice(b",\"disk\":");
                    out.extend_from_slice(num.format(u64::from(m.disk) * bs).as_bytes());
                    out.push(b'}');
                }
                out.extend_from_slice(b"}}");
            }
            Enc::Msgpack => {
                mp_str(&mut out, name);
                chunk.put(b"\x86"); // a map of 6
                chunk.put(b"\xaflongest_matched");
                chunk.tokens(d);
                chunk.put(b"\xa3gpu");
                chunk.tokens(g);
                chunk.put(b"\xa3cpu");
                chunk.tokens(c);
                chunk.put(b"\xa4disk");
                chunk.tokens(d);
                chunk.put(b"\xa2dp");
                chunk.map_len(ranks.len());
                for m in ranks {
                    chunk.room(&mut out);
                    chunk.rank_key(m.dp_rank);
                    chunk.tokens(u64::from(m.gpu) * bs);
                }
                chunk.room(&mut out);
                chunk.put(b"\xacrank_matches");
                chunk.map_len(ranks.len());
                for m in ranks {
                    chunk.room(&mut out);
                    chunk.rank_key(m.dp_rank);
                    chunk.put(b"\x83\xa3gpu");
                    chunk.tokens(u64::from(m.gpu) * bs);
                    chunk.put(b"\xa3cpu");
                    chunk.tokens(u64::from(m.cpu) * bs);
                    chunk.put(b"\xa4disk");
                    chunk.tokens(u64::from(m.disk) * bs);
                }
                chunk.flush(&mut out);
            }
        }
    }
    if enc == Enc::Json {
        out.extend_from_slice(b"}}");
    }
    out
}

/// Room on the stack where an answer's msgpack pieces are written before they join the answer
/// in one copy: the pieces are a few bytes each, and appending each to the answer directly cost
/// a call to `memcpy` apiece (about 20,000 per 1,000 x 8 answer, a third of the writing time).
struct Chunk<'a> {
    /// Borrowed rather than owned, so that the compiler keeps `len` in a register.
    buf: &'a mut [u8; CHUNK],
    len: usize,
}

/// A [`Chunk`]'s room in bytes.
const CHUNK: usize = 1024;

impl Chunk<'_> {
    /// The most one rank's entry in `rank_matches` takes (a key of up to 11 bytes and three
    /// fields of up to 14).
    const ENTRY: usize = 64;

    /// Moves what is written to `out` when less than one entry's room is left.
    #[inline(always)]
    fn room(&mut self, out: &mut Vec<u8>) {
        if self.len > CHUNK - Chunk::ENTRY {
            self.flush(out);
        }
    }

    fn flush(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.buf[..self.len]);
        self.len = 0;
    }

    #[inline(always)]
    fn put<const N: usize>(&mut self, b: &[u8; N]) {
        self.buf[self.len..self.len + N].copy_from_slice(b);
        self.len += N;
    }

    /// A token count as a msgpack uint 32 (`0xce` and four bytes; uint 64 past `u32::MAX`)
    /// whatever its size. Any width is valid msgpack and every reader takes it; one width for
    /// every count spares the branch on each count's size, which an answer's GPU prefix
    /// lengths (spread over two or three shortest widths) mispredict about half the time.
    #[inline(always)]
    fn tokens(&mut self, v: u64) {
        match u32::try_from(v) {
            Ok(v) => {
                let [a, b, c, d] = v.to_be_bytes();
                self.put(&[0xce, a, b, c, d]);
            }
            Err(_) => {
                self.put(&[0xcf]);
                self.put(&v.to_be_bytes());
            }
        }
    }

    /// A msgpack map header (as `rmp::encode::write_map_len` writes it).
    #[inline(always)]
    fn map_len(&mut self, n: usize) {
        match n {
            0..=15 => self.put(&[0x80 | n as u8]),
            16..=0xffff => {
                let [a, b] = (n as u16).to_be_bytes();
                self.put(&[0xde, a, b]);
            }
            _ => {
                let [a, b, c, d] = (n as u32).to_be_bytes();
                self.put(&[0xdf, a, b, c, d]);
            }
        }
    }

    /// A DP rank as a msgpack string key (`"7"`, `"12"`).
    #[inline(always)]
    fn rank_key(&mut self, r: u32) {
        if r < 10 {
            self.put(&[0xa1, b'0' + r as u8]);
        } else {
            let mut num = itoa::Buffer::new();
            let s = num.format(r).as_bytes();
            self.put(&[0xa0 | s.len() as u8]);
            for &b in s {
                self.put(&[b]);
            }
        }
    }
}

/// A msgpack string (as `rmp::encode::write_str` writes it).
fn mp_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else {
        let _ = rmp::encode::write_str_len(out, n as u32);
    }
    out.extend_from_slice(s.as_bytes());
}

/// `/route`'s answer when it accepts.
#[derive(Serialize)]
struct RouteReply {
    /// The prefill instance, and its DP rank holding the longest GPU prefix.
    prefill: RouteTarget,
    decode: RouteTarget,
    predicted_ttft_ms: f64,
    predicted_tbt_ms: f64,
    /// Prompt tokens reused: the prefill instance's own GPU prefix plus what it fetches.
    prefix_tokens: u64,
    /// Tokens to fetch before the prefill, and from where (`pool_cpu`, `pool_disk`, or
    /// `instance:<id>` for another instance's GPU).
    transfer_tokens: u64,
    fetch_from: Option<String>,
    /// The prefix is fetched from another instance's GPU because the pool lacks it: worth
    /// storing in the pool.
    replicate_hint: bool,
}

#[derive(Serialize)]
struct RouteTarget {
    instance_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    dp_rank: Option<u32>,
}

async fn route(State(s): State<Arc<Shared>>, h: HeaderMap, body: Bytes) -> Response {
    let t = Instant::now();
    let enc = encoding(&h);
    let r = run_route(&s, enc, &body);
    if r.status() == StatusCode::BAD_REQUEST {
        s.metrics.route_errors.fetch_add(1, Ordering::Relaxed);
    }
    s.metrics.route.observe(t.elapsed().as_micros() as u64);
    r
}

fn run_route(s: &Shared, enc: Enc, body: &Bytes) -> Response {
    let body = &tokens_as_binary(enc, body);
    let q: Query = match decode(enc, body) {
        Ok(q) => q,
        Err(e) => return *e,
    };
    // The cheap checks first: hashing a long prompt is the costly step.
    let (Some(output_len), Some(ttft), Some(tbt)) = (q.output_len, q.ttft_slo_ms, q.tbt_slo_ms)
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "output_len, ttft_slo_ms and tbt_slo_ms must be set",
        );
    };
    if !(ttft.is_finite() && ttft > 0.0 && tbt.is_finite() && tbt > 0.0) {
        return error(StatusCode::BAD_REQUEST, "ttft_slo_ms and tbt_slo_ms must be positive");
    }
    let by_hash = q.token_ids.is_empty();
    let hashes = match q.hashes(s, by_hash, body) {
        Ok(h) => h,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let bs = u64::from(q.block_size);
    let input_len = q.input_len.unwrap_or(if by_hash {
        hashes.len() as u64 * bs
    } else {
        q.token_ids.len() as u64
    });
    if input_len == 0 {
        return error(
            StatusCode::BAD_REQUEST,
            "an empty prompt (give token_ids, seq_hashes or input_len)",
        );
    }
    let ctx = q.context();
    // The candidates: as named, or the instances registered for the model, by role.
    let registered = |prefill: bool| -> Vec<String> {
        let sources = s.sources.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = sources
            .values()
            .filter(|h| {
                let r = &h.reg;
                r.serves(prefill)
                    && r.tenant_id == ctx.tenant
                    && r.modelname == ctx.model
                    && r.block_size == ctx.block_size
            })
            .map(|h| h.reg.instance_id.clone())
            .collect();
        v.dedup();
        v
    };
    let prefill_names = q.prefill_instances.clone().unwrap_or_else(|| registered(true));
    let decode_names = q.decode_instances.clone().unwrap_or_else(|| registered(false));
    // What each instance holds: its best DP rank's match (in tokens).
    let mut owned = Vec::new();
    let names = {
        let mut ix = s.index.lock().unwrap_or_else(|e| e.into_inner());
        ix.query_raw(&ctx, &hashes, &mut owned);
        let mut names: HashMap<u32, String> = HashMap::new();
        for m in &owned {
            names.entry(m.instance).or_insert_with(|| ix.instance_name(m.instance).to_string());
        }
        names
    };
    let mut live = s.router.lock().unwrap_or_else(|e| e.into_inner());
    let live = &mut *live;
    let mut matches = vec![PrefixMatch::default(); live.sched.config().prefill_instances];
    let mut best_rank: HashMap<usize, (u64, u32)> = HashMap::new();
    for m in &owned {
        let i = live.prefill.get_or_add(&names[&m.instance], || live.sched.add_prefill_instance());
        matches.resize(live.sched.config().prefill_instances, PrefixMatch::default());
        let (g, c, d) = (m.gpu as u64 * bs, m.cpu as u64 * bs, m.disk as u64 * bs);
        let x = &mut matches[i];
        (x.gpu, x.cpu, x.disk) = (x.gpu.max(g), x.cpu.max(c), x.disk.max(d));
        let b = best_rank.entry(i).or_insert((g, m.dp_rank));
        if g > b.0 || (g == b.0 && m.dp_rank < b.1) {
            *b = (g, m.dp_rank);
        }
    }
    let mut req = RouteRequest::new(input_len, output_len, ttft, tbt, Vec::new());
    for n in &prefill_names {
        req.prefill_candidates
            .push(live.prefill.get_or_add(n, || live.sched.add_prefill_instance()));
    }
    for n in &decode_names {
        req.decode_candidates.push(live.decode.get_or_add(n, || live.sched.add_decode_instance()));
    }
    matches.resize(live.sched.config().prefill_instances, PrefixMatch::default());
    req.matches = matches;
    let now_ms = live.start.elapsed().as_secs_f64() * 1e3;
    let m = &s.metrics;
    // An empty candidate list means "every instance" to the scheduler; here it means none.
    let decision = if prefill_names.is_empty() || decode_names.is_empty() {
        Decision::Reject {
            reason: RejectReason::NoInstance,
            predicted_ttft_ms: f64::INFINITY,
            predicted_tbt_ms: f64::INFINITY,
        }
    } else {
        live.sched.route(now_ms, &req)
    };
    match decision {
        Decision::Accept {
            prefill,
            decode,
            predicted_ttft_ms,
            predicted_tbt_ms,
            prefix_tokens,
            transfer_tokens,
            fetch_from,
            replicate_hint,
            ..
        } => {
            m.routes_accepted.fetch_add(1, Ordering::Relaxed);
            m.replicate_hints.fetch_add(u64::from(replicate_hint), Ordering::Relaxed);
            let fetch_from = fetch_from.map(|f| match f {
                FetchFrom::PoolCpu => "pool_cpu".to_string(),
                FetchFrom::PoolDisk => "pool_disk".to_string(),
                FetchFrom::Instance(i) => format!("instance:{}", live.prefill.names[i]),
            });
            reply(
                enc,
                &RouteReply {
                    prefill: RouteTarget {
                        instance_id: live.prefill.names[prefill].clone(),
                        dp_rank: best_rank.get(&prefill).map(|b| b.1),
                    },
                    decode: RouteTarget {
                        instance_id: live.decode.names[decode].clone(),
                        dp_rank: None,
                    },
                    predicted_ttft_ms,
                    predicted_tbt_ms,
                    prefix_tokens,
                    transfer_tokens,
                    fetch_from,
                    replicate_hint,
                },
            )
        }
        Decision::Reject { reason, predicted_ttft_ms, predicted_tbt_ms } => {
            let (code, counter, why, msg) = match reason {
                RejectReason::NoInstance => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    &m.routes_no_instance,
                    "no_instance",
                    format!(
                        "no {} instance for model {:?} (tenant {:?}, block size {}): register one with its role, or name them in prefill_instances and decode_instances",
                        if prefill_names.is_empty() { "prefill" } else { "decode" },
                        ctx.model,
                        ctx.tenant,
                        ctx.block_size
                    ),
                ),
                RejectReason::Ttft => (
                    StatusCode::TOO_MANY_REQUESTS,
                    &m.routes_rejected_ttft,
                    "ttft",
                    format!(
                        "predicted TTFT {predicted_ttft_ms:.1} ms is over the SLO of {ttft} ms"
                    ),
                ),
                RejectReason::Tbt => (
                    StatusCode::TOO_MANY_REQUESTS,
                    &m.routes_rejected_tbt,
                    "tbt",
                    format!(
                        "predicted TBT {predicted_tbt_ms:.1} ms at the prefill's end is over the SLO of {tbt} ms"
                    ),
                ),
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let body = serde_json::json!({
                "error": msg, "reason": why,
                "predicted_ttft_ms": if predicted_ttft_ms.is_finite() { Some(predicted_ttft_ms) } else { None },
                "predicted_tbt_ms": if predicted_tbt_ms.is_finite() { Some(predicted_tbt_ms) } else { None },
            });
            let mut r = reply(enc, &body);
            *r.status_mut() = code;
            r
        }
    }
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
    counter("queries_total", "Prefix queries answered.", m.query.count());
    counter("query_errors_total", "Prefix queries refused.", l(&m.query_errors));
    counter(
        "chains_encoded_ahead_total",
        "Token chains whose CBOR a second thread encoded while the query hashed.",
        l(&m.chains_ahead),
    );
    counter("routes_accepted_total", "Requests routed.", l(&m.routes_accepted));
    counter(
        "routes_rejected_ttft_total",
        "Requests rejected early: predicted TTFT over the SLO.",
        l(&m.routes_rejected_ttft),
    );
    counter(
        "routes_rejected_tbt_total",
        "Requests rejected early: predicted TBT over the SLO.",
        l(&m.routes_rejected_tbt),
    );
    counter(
        "routes_no_instance_total",
        "Route requests with no instance to go to.",
        l(&m.routes_no_instance),
    );
    counter("route_errors_total", "Route requests refused as malformed.", l(&m.route_errors));
    counter(
        "replicate_hints_total",
        "Routes fetching a prefix from another instance's GPU (missing in the pool).",
        l(&m.replicate_hints),
    );
    counter(
        "index_evicted_total",
        "Index entries dropped by its bounds (entries, bytes), least recently used first.",
        st.evicted,
    );
    let (memo_hits, memo_misses, memo_len, memo_runs, memo_run_hits) = {
        let memo = s.memo.lock().unwrap_or_else(|e| e.into_inner());
        (memo.hits, memo.misses, memo.len(), memo.runs(), memo.run_hits)
    };
    counter(
        "hash_memo_hits_total",
        "Blocks of token queries whose chain step the memo held (no hashing).",
        memo_hits,
    );
    counter(
        "hash_memo_run_hits_total",
        "Runs of 64 blocks of token queries the memo answered in one lookup.",
        memo_run_hits,
    );
    counter(
        "hash_memo_misses_total",
        "Memo lookups missed (the chain computed from there on).",
        memo_misses,
    );
    let mut gauge = |name: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP kvfs_conductor_{name} {help}\n# TYPE kvfs_conductor_{name} gauge\nkvfs_conductor_{name} {v}\n"
        ));
    };
    gauge("index_entries", "Block entries in the index.", st.entries as u64);
    gauge("index_bytes", "Memory the index counts against its bound.", st.bytes as u64);
    gauge("index_bytes_max", "The index's memory bound.", st.bytes_max as u64);
    gauge("index_contexts", "Contexts (tenant, model, LoRA, block size).", st.contexts as u64);
    gauge("index_owners", "Owners (instance, DP rank, pools).", st.owners as u64);
    gauge("sources", "Registered event sources.", sources as u64);
    gauge("hash_memo_entries", "Chain steps in the memo of token queries.", memo_len as u64);
    gauge(
        "hash_memo_runs",
        "Runs of 64 chain steps in the memo (one lookup each answers 64 blocks).",
        memo_runs as u64,
    );
    m.query.render(&mut out, "query_seconds", "Prefix query latency.");
    m.route.render(&mut out, "route_seconds", "Route decision latency.");
    {
        let live = s.router.lock().unwrap_or_else(|e| e.into_inner());
        let now_ms = live.start.elapsed().as_secs_f64() * 1e3;
        out.push_str(
            "# HELP kvfs_conductor_prefill_queue_seconds Predicted wait before a new prefill could start, per instance.\n# TYPE kvfs_conductor_prefill_queue_seconds gauge\n",
        );
        for (i, n) in live.prefill.names.iter().enumerate() {
            out.push_str(&format!(
                "kvfs_conductor_prefill_queue_seconds{{instance=\"{}\"}} {}\n",
                n.replace('\\', "\\\\").replace('"', "\\\""),
                live.sched.queue_ms(now_ms, i) / 1e3
            ));
        }
        out.push_str(
            "# HELP kvfs_conductor_decode_requests Requests predicted decoding now, per instance.\n# TYPE kvfs_conductor_decode_requests gauge\n",
        );
        for (i, n) in live.decode.names.iter().enumerate() {
            out.push_str(&format!(
                "kvfs_conductor_decode_requests{{instance=\"{}\"}} {}\n",
                n.replace('\\', "\\\\").replace('"', "\\\""),
                live.sched.decode_load_at(i, now_ms).0
            ));
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, Medium};
    use rand::{Rng, SeedableRng};

    /// The hand-written msgpack pieces are byte for byte what rmp writes (token counts, written
    /// at one width, read back as the numbers they are).
    #[test]
    fn msgpack_pieces_match_rmp() {
        for n in [0usize, 1, 15, 16, 255, 65_535, 65_536] {
            let s = "x".repeat(n.min(70_000));
            let (mut a, mut b) = (Vec::new(), Vec::new());
            mp_str(&mut a, &s);
            rmp::encode::write_str(&mut b, &s).unwrap();
            assert_eq!(a, b, "str of {n}");
        }
        // The stack writer's pieces.
        let chunk = |f: &dyn Fn(&mut Chunk)| {
            let mut room = [0u8; CHUNK];
            let mut c = Chunk { buf: &mut room, len: 0 };
            f(&mut c);
            c.buf[..c.len].to_vec()
        };
        // Token counts: one width up to u32::MAX, read back as the same number.
        for v in
            [0u64, 1, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, 0xffff_ffff, 1 << 32, u64::MAX]
        {
            let b = chunk(&|c| c.tokens(v));
            assert_eq!(b.len(), if v <= u64::from(u32::MAX) { 5 } else { 9 }, "{v}");
            assert_eq!(rmp::decode::read_int::<u64, _>(&mut &b[..]).unwrap(), v, "{v}");
            assert_eq!(rmpv::decode::read_value(&mut &b[..]).unwrap().as_u64(), Some(v), "{v}");
        }
        for n in [0usize, 15, 16, 65_535, 65_536] {
            let mut b = Vec::new();
            rmp::encode::write_map_len(&mut b, n as u32).unwrap();
            assert_eq!(chunk(&|c| c.map_len(n)), b, "chunk map {n}");
        }
        for r in [0u32, 9, 10, 99, 12_345, u32::MAX] {
            let mut b = Vec::new();
            rmp::encode::write_str(&mut b, &r.to_string()).unwrap();
            assert_eq!(chunk(&|c| c.rank_key(r)), b, "chunk rank {r}");
        }
    }

    /// The answer written in one pass has the reference's shape, in JSON and in msgpack.
    #[test]
    fn query_answers_in_both_encodings() {
        let mut ix = Index::new(Bounds::entries(100));
        let ctx = ContextKey {
            tenant: "t".into(),
            model: "m".into(),
            lora: String::new(),
            block_size: 16,
        };
        let stored = |h: &[u64], medium| Event::Stored {
            token_ids: Vec::new(),
            hashes: h.to_vec(),
            parent: None,
            block_size: Some(16),
            medium,
            lora_name: None,
        };
        for (inst, rank, n) in [("a\"x", 1, 2), ("a\"x", 10, 3), ("b", 100, 1)] {
            let o = ix.owner(&OwnerKey { instance: inst.into(), dp_rank: rank }, false);
            ix.join(o, &ctx);
            ix.apply(o, &ctx, &stored(&[1, 2, 3][..n], Medium::Gpu));
        }
        let pool = ix.owner(&OwnerKey { instance: "pool".into(), dp_rank: 0 }, true);
        ix.apply(pool, &ctx, &stored(&[1, 2, 3, 4], Medium::Cpu));
        let mut raw = Vec::new();
        ix.query_raw(&ctx, &[1, 2, 3, 4, 5], &mut raw);
        let want = serde_json::json!({"instances": {
            "a\"x": {"longest_matched": 64, "gpu": 48, "cpu": 64, "disk": 64,
                "dp": {"1": 32, "10": 48},
                "rank_matches": {"1": {"gpu": 32, "cpu": 64, "disk": 64},
                                 "10": {"gpu": 48, "cpu": 64, "disk": 64}}},
            "b": {"longest_matched": 64, "gpu": 16, "cpu": 64, "disk": 64, "dp": {"100": 16},
                "rank_matches": {"100": {"gpu": 16, "cpu": 64, "disk": 64}}}}});
        let json = encode_matches(Enc::Json, &ix, &raw, 16, None);
        assert_eq!(serde_json::from_slice::<serde_json::Value>(&json).unwrap(), want);
        let mp = encode_matches(Enc::Msgpack, &ix, &raw, 16, None);
        assert_eq!(rmp_serde::from_slice::<serde_json::Value>(&mp).unwrap(), want);
        let only = encode_matches(Enc::Json, &ix, &raw, 16, Some("b"));
        let v: serde_json::Value = serde_json::from_slice(&only).unwrap();
        assert_eq!(v["instances"], serde_json::json!({"b": want["instances"]["b"]}));
        let none = encode_matches(Enc::Msgpack, &ix, &[], 16, None);
        assert_eq!(
            rmp_serde::from_slice::<serde_json::Value>(&none).unwrap(),
            serde_json::json!({"instances": {}})
        );
    }

    /// Token ids as a msgpack binary are read where they lie in the request; as an array (JSON
    /// or msgpack) they are the same little-endian bytes; a binary not a multiple of 4 is refused.
    #[test]
    fn token_ids_decode_to_little_endian_bytes() {
        let ids = [1u32, 70_000, u32::MAX];
        let le: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let bin = rmpv::Value::Map(vec![
            ("model".into(), "m".into()),
            ("block_size".into(), 4.into()),
            ("token_ids".into(), rmpv::Value::Binary(le.clone())),
        ]);
        let mut body = Vec::new();
        rmpv::encode::write_value(&mut body, &bin).unwrap();
        let q: Query = rmp_serde::from_slice(&body).unwrap();
        assert!(matches!(q.token_ids.0, Cow::Borrowed(_)), "copied");
        assert_eq!((&q.token_ids.0[..], q.token_ids.len()), (&le[..], 3));
        let arr = serde_json::json!({"model": "m", "block_size": 4, "token_ids": ids});
        let json = serde_json::to_vec(&arr).unwrap();
        let q: Query = serde_json::from_slice(&json).unwrap();
        assert_eq!(&q.token_ids.0[..], &le[..]);
        let mp = rmp_serde::to_vec_named(&arr).unwrap();
        let q: Query = rmp_serde::from_slice(&mp).unwrap();
        assert_eq!(&q.token_ids.0[..], &le[..]);
        let mut odd = Vec::new();
        let bad = rmpv::Value::Map(vec![
            ("model".into(), "m".into()),
            ("block_size".into(), 4.into()),
            ("token_ids".into(), rmpv::Value::Binary(vec![1, 2, 3])),
        ]);
        rmpv::encode::write_value(&mut odd, &bad).unwrap();
        let e = rmp_serde::from_slice::<Query>(&odd).err().unwrap().to_string();
        assert!(e.contains("not a multiple of 4"), "{e}");
    }

    /// An answer bigger than the msgpack writer's stack room (instances of up to 70 ranks out of
    /// order, rank numbers of one to ten digits, counts in every msgpack width, then some
    /// instances' owners scattered among others') lists every owner's match under its instance,
    /// and reads back in msgpack as the JSON answer does.
    #[test]
    fn big_answers_read_the_same_in_both_encodings() {
        let mut ix = Index::new(Bounds::entries(10_000));
        let bs = 1u32 << 20;
        let ctx = ContextKey {
            tenant: "t".into(),
            model: "m".into(),
            lora: String::new(),
            block_size: bs,
        };
        let hashes: Vec<u64> = (1..=300).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for i in 0..40u32 {
            for r in 0..rng.random_range(1..70u32) {
                let rank = [r, r * 1_000 + 10, u32::MAX - r][(r % 3) as usize];
                let o = ix.owner(&OwnerKey { instance: format!("i{i}"), dp_rank: rank }, false);
                ix.join(o, &ctx);
                let n = rng.random_range(0..=hashes.len());
                ix.apply(
                    o,
                    &ctx,
                    &Event::Stored {
                        token_ids: Vec::new(),
                        hashes: hashes[..n].to_vec(),
                        parent: None,
                        block_size: Some(bs),
                        medium: Medium::Gpu,
                        lora_name: None,
                    },
                );
            }
        }
        let mut raw = Vec::new();
        ix.query_raw(&ctx, &hashes, &mut raw);
        assert!(raw.len() > 1_000, "{} matches", raw.len());
        let bs = u64::from(bs);
        // Each instance's ranks, gathered independently of the writer's grouping.
        let oracle = |ix: &Index, raw: &[RawMatch]| {
            let mut want = serde_json::Map::new();
            for m in raw {
                let e = want
                    .entry(ix.instance_name(m.instance).to_string())
                    .or_insert_with(|| serde_json::json!({}));
                e[m.dp_rank.to_string()] = serde_json::json!({"gpu": u64::from(m.gpu) * bs,
                    "cpu": u64::from(m.cpu) * bs, "disk": u64::from(m.disk) * bs});
            }
            want
        };
        let check = |ix: &Index, raw: &[RawMatch]| {
            let json = encode_matches(Enc::Json, ix, raw, bs, None);
            let got = serde_json::from_slice::<serde_json::Value>(&json).unwrap();
            let by_rank: serde_json::Map<String, serde_json::Value> = got["instances"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v["rank_matches"].clone()))
                .collect();
            assert_eq!(by_rank, oracle(ix, raw));
            let mp = encode_matches(Enc::Msgpack, ix, raw, bs, None);
            assert_eq!(rmp_serde::from_slice::<serde_json::Value>(&mp).unwrap(), got);
        };
        check(&ix, &raw);
        // Owners of one instance scattered among others' (ranks that joined later).
        for i in (0..40u32).step_by(7) {
            let o =
                ix.owner(&OwnerKey { instance: format!("i{i}"), dp_rank: 5_000_000 + i }, false);
            ix.join(o, &ctx);
            ix.apply(
                o,
                &ctx,
                &Event::Stored {
                    token_ids: Vec::new(),
                    hashes: hashes[..3].to_vec(),
                    parent: None,
                    block_size: Some(bs as u32),
                    medium: Medium::Gpu,
                    lora_name: None,
                },
            );
        }
        ix.query_raw(&ctx, &hashes, &mut raw);
        check(&ix, &raw);
    }

    /// One step of [`token_queries_with_the_memo_answer_as_hashing_every_block`].
    #[derive(Debug, Clone)]
    enum Step {
        /// An owner stores blocks `from..to` of a prompt's chain (salted or not); `tokens`:
        /// its event carries their tokens (the memo learns the steps).
        Store {
            owner: usize,
            prompt: usize,
            from: usize,
            to: usize,
            gpu: bool,
            tokens: bool,
            salted: bool,
        },
        /// A token query of a prompt, with or without a cache salt.
        Query { prompt: usize, salted: bool },
    }

    /// Steps over prompts of up to `blocks` blocks; a third of the stores start at block 0 and
    /// (where `blocks` passes a memo run) another third on the grid of runs.
    fn step(blocks: usize) -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (
                0..4usize,
                0..6usize,
                0..blocks,
                0..blocks,
                any::<bool>(),
                any::<bool>(),
                any::<bool>()
            )
                .prop_map(move |(owner, prompt, a, b, gpu, tokens, salted)| {
                    let (from, to) = match a % 3 {
                        0 => (0, b),
                        1 if blocks > RUN => (a / RUN * RUN, (a / RUN * RUN).max(b)),
                        _ => (a.min(b), a.max(b)),
                    };
                    Step::Store { owner, prompt, from, to, gpu, tokens, salted }
                }),
            (0..6usize, any::<bool>()).prop_map(|(prompt, salted)| Step::Query { prompt, salted }),
        ]
    }

    proptest::proptest! {
        /// Prompts sharing prefixes, an index that grows between queries from events that
        /// carry their blocks' tokens or not: a token query answers the same with the memo
        /// (small, so its generations turn over), without it, and as the whole chain hashed
        /// up front and walked would.
        #[test]
        fn token_queries_with_the_memo_answer_as_hashing_every_block(
            base in proptest::collection::vec(0u32..200_000, 48),
            cuts in proptest::collection::vec((0usize..48, proptest::collection::vec(0u32..200_000, 0..16)), 6),
            steps in proptest::collection::vec(step(12), 1..40),
        ) {
            memo_agrees(4, 24, &base, &cuts, steps)?;
        }

        /// The same with prompts of up to 150 blocks (runs of 64 looked up, stored by queries
        /// and learned from events on and off the queries' grid) and a memo of five runs.
        #[test]
        fn token_queries_with_memo_runs_answer_as_hashing_every_block(
            base in proptest::collection::vec(0u32..200_000, 300),
            cuts in proptest::collection::vec((0usize..300, proptest::collection::vec(0u32..200_000, 0..40)), 6),
            steps in proptest::collection::vec(step(150), 1..24),
        ) {
            memo_agrees(2, 5 * RUN, &base, &cuts, steps)?;
        }
    }

    /// Prompts sharing prefixes (`base` cut, then a tail each), an index that grows between
    /// queries from events that carry their blocks' tokens or not: a token query answers the
    /// same with a memo of `entries` steps, without one, and as the whole chain hashed up front
    /// and walked would.
    fn memo_agrees(
        block_size: u32,
        entries: usize,
        base: &[u32],
        cuts: &[(usize, Vec<u32>)],
        steps: Vec<Step>,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let prompts: Vec<Vec<u32>> = cuts
            .iter()
            .map(|(cut, tail)| base[..*cut].iter().chain(tail).copied().collect())
            .collect();
        let hasher = BlockHasher::new(&Config::default().default_profile).unwrap();
        let chain = |p: &[u32], salt: Option<&str>| -> Vec<u64> {
            let extra = Extra { lora: None, cache_salt: salt.map(String::from) };
            hasher
                .iter(p, block_size as usize, &extra)
                .unwrap()
                .map(|d| project_low64_be(&d))
                .collect()
        };
        let memo = Shared::new(&Config { hash_memo_entries: entries, ..Config::default() });
        let plain = Shared::new(&Config { hash_memo_entries: 0, ..Config::default() });
        let ctx =
            ContextKey { tenant: "t".into(), model: "m".into(), lora: String::new(), block_size };
        for s in [&memo, &plain] {
            let mut ix = s.index.lock().unwrap();
            for o in 0..4u32 {
                let id = ix.owner(&OwnerKey { instance: format!("i{o}"), dp_rank: o % 2 }, false);
                ix.join(id, &ctx);
            }
        }
        for st in steps {
            match st {
                Step::Store { owner, prompt, from, to, gpu, tokens, salted } => {
                    let h = chain(&prompts[prompt], salted.then_some("s"));
                    let (from, to) = (from.min(h.len()), to.min(h.len()));
                    let bs = block_size as usize;
                    let ev = Event::Stored {
                        hashes: h[from..to].to_vec(),
                        parent: from.checked_sub(1).map(|p| h[p]),
                        token_ids: if tokens {
                            prompts[prompt][from * bs..to * bs].to_vec()
                        } else {
                            Vec::new()
                        },
                        block_size: Some(block_size),
                        medium: if gpu { Medium::Gpu } else { Medium::Cpu },
                        lora_name: None,
                    };
                    memo.learn_steps(&ctx, &ev);
                    for s in [&memo, &plain] {
                        let mut ix = s.index.lock().unwrap();
                        let id = ix.owner(
                            &OwnerKey { instance: format!("i{owner}"), dp_rank: owner as u32 % 2 },
                            false,
                        );
                        ix.apply(id, &ctx, &ev);
                    }
                }
                Step::Query { prompt, salted } => {
                    let salt = salted.then_some("s");
                    let body = serde_json::to_vec(&serde_json::json!({
                        "model": "m", "tenant_id": "t", "block_size": block_size,
                        "token_ids": prompts[prompt], "cache_salt": salt,
                    }))
                    .unwrap();
                    let body = Bytes::from(body);
                    let with_memo = answer_query(&memo, false, &body, false).unwrap();
                    let without = answer_query(&plain, false, &body, false).unwrap();
                    let mut ix = plain.index.lock().unwrap();
                    let mut raw = Vec::new();
                    ix.query_raw(&ctx, &chain(&prompts[prompt], salt), &mut raw);
                    let want = encode_matches(Enc::Json, &ix, &raw, u64::from(block_size), None);
                    let v = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap();
                    proptest::prop_assert_eq!(v(&with_memo), v(&want));
                    proptest::prop_assert_eq!(v(&without), v(&want));
                }
            }
        }
        let m = memo.memo.lock().unwrap();
        proptest::prop_assert!(m.len() <= entries && m.runs() <= entries / RUN);
        proptest::prop_assert!(plain.memo.lock().unwrap().is_empty());
        Ok(())
    }

    #[test]
    fn long_chains_encoded_ahead_answer_as_hashed_alone() {
        // Prompts long enough for a helper (16k tokens and more past the first check) at two
        // block sizes, an owner holding prefixes that end before the first check, inside the
        // chain and at its end; salted or not; with the memo and without.
        let tokens: Vec<u32> =
            (0..40_000u32).map(|i| i.wrapping_mul(2_654_435_761) % 200_000).collect();
        let hasher = BlockHasher::new(&Config::default().default_profile).unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for bs in [64usize, 512] {
            let blocks = tokens.len() / bs;
            for salt in [None, Some("s")] {
                let extra = Extra { lora: None, cache_salt: salt.map(String::from) };
                let chain: Vec<u64> = hasher
                    .iter(&tokens, bs, &extra)
                    .unwrap()
                    .map(|d| project_low64_be(&d))
                    .collect();
                for held in [2, 5, blocks / 2, blocks] {
                    let ctx = ContextKey {
                        tenant: "t".into(),
                        model: "m".into(),
                        lora: String::new(),
                        block_size: bs as u32,
                    };
                    let event = Event::Stored {
                        hashes: chain[..held].to_vec(),
                        parent: None,
                        token_ids: Vec::new(),
                        block_size: Some(bs as u32),
                        medium: Medium::Gpu,
                        lora_name: None,
                    };
                    // As JSON (the tokens copied out of the request for the helper), as
                    // one msgpack binary (the helper reads them in the request's buffer)
                    let json = Bytes::from(
                        serde_json::to_vec(&serde_json::json!({
                            "model": "m", "tenant_id": "t", "block_size": bs,
                            "token_ids": tokens, "cache_salt": salt,
                        }))
                        .unwrap(),
                    );
                    let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
                    let mut bin = Vec::new();
                    let map = rmpv::Value::Map(vec![
                        ("model".into(), "m".into()),
                        ("tenant_id".into(), "t".into()),
                        ("block_size".into(), (bs as u64).into()),
                        ("token_ids".into(), rmpv::Value::Binary(le)),
                        ("cache_salt".into(), salt.map_or(rmpv::Value::Nil, |s| s.into())),
                    ]);
                    rmpv::encode::write_value(&mut bin, &map).unwrap();
                    let bin = Bytes::from(bin);
                    // And as a msgpack int array (rewritten as a binary before it is read).
                    let ints = Bytes::from(
                        rmp_serde::to_vec_named(&serde_json::json!({
                            "model": "m", "tenant_id": "t", "block_size": bs,
                            "token_ids": tokens, "cache_salt": salt,
                        }))
                        .unwrap(),
                    );
                    let v = |msgpack: bool, b: &[u8]| -> serde_json::Value {
                        if msgpack {
                            rmp_serde::from_slice(b).unwrap()
                        } else {
                            serde_json::from_slice(b).unwrap()
                        }
                    };
                    let mut answers = Vec::new();
                    for (ahead, memo) in [(false, 0), (true, 0), (true, 1 << 16)] {
                        let s = holding(&ctx, &event);
                        *s.memo.lock().unwrap() = ChainMemo::new(memo);
                        s.set_encode_ahead(ahead);
                        // One query per body: the later ones meet the memo's steps, if any.
                        // Each waits for the last one's helper to park (it may still be
                        // stopping).
                        for (msgpack, body) in [(false, &json), (true, &bin), (true, &ints)] {
                            s.ahead_crew.settle();
                            let a = answer_query(&s, msgpack, body, false).unwrap();
                            answers.push(v(msgpack, &a));
                        }
                        // A helper runs with a core to spare, from a miss past the first check
                        // (4 blocks) with 4,096 tokens or more to the next (at block 64 the checks
                        // come after 4, 12, 28 and 60 blocks, so a chain stopping at block 12
                        // gets none), and (the memo holding the chain) for the first query
                        // alone.
                        let used = s.metrics.chains_ahead.load(Ordering::Relaxed);
                        let queries = if memo == 0 { 3 } else { 1 };
                        let long = held >= 4 && !(bs == 64 && held < 12);
                        let expect = if ahead && long && cores > 1 { queries } else { 0 };
                        assert_eq!(
                            used, expect,
                            "bs {bs}, held {held}, ahead {ahead}, memo {memo}"
                        );
                    }
                    let want = &answers[0];
                    assert_eq!(
                        want["instances"]["a"]["longest_matched"],
                        serde_json::json!(held * bs),
                        "bs {bs}, held {held}"
                    );
                    for a in &answers {
                        assert_eq!(a, want, "bs {bs}, salt {salt:?}, held {held}");
                    }
                }
            }
        }
    }

    /// A conductor where one owner ("a", rank 0) of `ctx` stored `event`'s blocks.
    fn holding(ctx: &ContextKey, event: &Event) -> Arc<Shared> {
        let s = Shared::new(&Config::default());
        let mut ix = s.index.lock().unwrap();
        let o = ix.owner(&OwnerKey { instance: "a".into(), dp_rank: 0 }, false);
        ix.join(o, ctx);
        ix.apply(o, ctx, event);
        drop(ix);
        s
    }

    /// A JSON `/query` body for `tokens` in model "m" of tenant "t".
    fn token_query(block_size: u32, tokens: &[u32]) -> Bytes {
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({
                "model": "m", "tenant_id": "t", "block_size": block_size, "token_ids": tokens,
            }))
            .unwrap(),
        )
    }

    #[test]
    fn prompts_seen_before_are_looked_up_a_run_at_a_time() {
        let ctx = ContextKey {
            tenant: "t".into(),
            model: "m".into(),
            lora: String::new(),
            block_size: 1,
        };
        let n = 3 * RUN + 2;
        let tokens: Vec<u32> = (0..n as u32).collect();
        let hasher = BlockHasher::new(&Config::default().default_profile).unwrap();
        let hashes: Vec<u64> = hasher
            .iter(&tokens, 1, &Extra::default())
            .unwrap()
            .map(|d| project_low64_be(&d))
            .collect();
        // The engine's events for blocks `from..to`, with their tokens.
        let event = |from: usize, to: usize| Event::Stored {
            token_ids: tokens[from..to].to_vec(),
            hashes: hashes[from..to].to_vec(),
            parent: from.checked_sub(1).map(|p| hashes[p]),
            block_size: Some(1),
            medium: Medium::Gpu,
            lora_name: None,
        };
        let shared = || holding(&ctx, &event(0, n));
        let body = token_query(1, &tokens);
        // (blocks answered, step lookups missed, runs held, runs found)
        let count = |s: &Shared| {
            let m = s.memo.lock().unwrap();
            (m.hits, m.misses, m.runs(), m.run_hits)
        };
        let n64 = n as u64;
        let s = shared();
        let first = answer_query(&s, false, &body, false).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&first).unwrap();
        assert_eq!(v["instances"]["a"]["gpu"], n);
        assert_eq!(count(&s), (0, n64, 3, 0), "every block hashed, the three whole runs kept");
        assert_eq!(answer_query(&s, false, &body, false).unwrap(), first);
        assert_eq!(count(&s), (n64, n64, 3, 3), "three run lookups, then two steps");

        // Learned from one event: steps past the first block, and the runs from blocks 64 and
        // 128 (the one from block 0 would need the salt). The query hashes block 0 alone and
        // keeps the run from block 0 it completed.
        let s = shared();
        s.learn_steps(&ctx, &event(0, n));
        assert_eq!(count(&s), (0, 0, 2, 0));
        assert_eq!(answer_query(&s, false, &body, false).unwrap(), first);
        assert_eq!(count(&s), (n64 - 1, 1, 3, 2));

        // Learned from two events split mid-run (a prefill in chunks): the second starts at
        // block 100, which the memo knows from the first, so it learns the run from block 128
        // (on the query's grid), not one from block 100.
        let s = shared();
        s.learn_steps(&ctx, &event(0, 100));
        s.learn_steps(&ctx, &event(100, n));
        assert_eq!(count(&s), (0, 0, 1, 0));
        assert_eq!(answer_query(&s, false, &body, false).unwrap(), first);
        assert_eq!(count(&s), (n64 - 1, 1, 3, 1), "blocks 128-191 in one lookup");
    }

    #[test]
    fn token_queries_use_steps_computed_before_and_steps_learned_from_events() {
        let ctx = ContextKey {
            tenant: "t".into(),
            model: "m".into(),
            lora: String::new(),
            block_size: 4,
        };
        let tokens: Vec<u32> = (0..160).collect();
        let hasher = BlockHasher::new(&Config::default().default_profile).unwrap();
        let hashes: Vec<u64> = hasher
            .iter(&tokens, 4, &Extra::default())
            .unwrap()
            .map(|d| project_low64_be(&d))
            .collect();
        // The engine's event for the first 6 of the prompt's 40 blocks, with their tokens.
        let event = Event::Stored {
            token_ids: tokens[..24].to_vec(),
            hashes: hashes[..6].to_vec(),
            parent: None,
            block_size: Some(4),
            medium: Medium::Gpu,
            lora_name: None,
        };
        let shared = || holding(&ctx, &event);
        let body = token_query(4, &tokens);
        let count = |s: &Shared| {
            let m = s.memo.lock().unwrap();
            (m.hits, m.misses, m.len())
        };
        let s = shared();
        let first = answer_query(&s, false, &body, false).unwrap();
        // Blocks are checked against the index after 4, then 8 more: the run that passes the
        // 6 held blocks is the last hashed (the walk stops at the seventh).
        assert_eq!(count(&s), (0, 12, 12));
        let second = answer_query(&s, false, &body, false).unwrap();
        assert_eq!(second, first);
        assert_eq!(count(&s), (12, 12, 12), "the second query hashes nothing");
        let v: serde_json::Value = serde_json::from_slice(&first).unwrap();
        assert_eq!(v["instances"]["a"]["gpu"], 24);

        // Learned from the event: blocks 2-6 (the first block is not learned: a salt would
        // change it). The query hashes block 1, looks up 2-6, recomputes their full digests
        // for block 7 and hashes 7-12.
        let s = shared();
        s.learn_steps(&ctx, &event);
        assert_eq!(count(&s), (0, 0, 5));
        assert_eq!(answer_query(&s, false, &body, false).unwrap(), first);
        assert_eq!(count(&s), (5, 7, 12));
        // An event without tokens, or whose tokens do not cover its blocks, teaches nothing.
        let s = shared();
        for token_ids in [Vec::new(), tokens[..23].to_vec()] {
            let Event::Stored { hashes, parent, block_size, medium, lora_name, .. } = event.clone()
            else {
                unreachable!()
            };
            s.learn_steps(
                &ctx,
                &Event::Stored { hashes, parent, token_ids, block_size, medium, lora_name },
            );
        }
        assert_eq!(count(&s), (0, 0, 0));
    }
}
