//! `kvfs._native.MooncakeCore`: the calls of the reference's `MooncakeDistributedStore`, with
//! its return conventions, over a kvfs [`Session`].
//!
//! Policy (the reference's, REFERENCE.md 1.2): nothing raises for a store outcome; calls return
//! `0`, a count, a size, `1`/`0`, or a negative reference error code (see `errors`); `get`
//! returns `b""` on a miss or any failure; `put` of an existing key is `0` and keeps the first
//! value (first writer wins), `upsert` replaces it. Argument errors a Python caller could not
//! have meant (a non-buffer value) still raise `TypeError`, as the reference's bindings do.
//!
//! The Python class `kvfs.mooncake.MooncakeDistributedStore` wraps this one: it parses
//! `setup`'s two forms, sizes like "16MB", and `ReplicateConfig`, then calls here with plain
//! values (`cfg` is `(replicas, pin, persistence, strategy, preferred_endpoints, tier)` or
//! `None`).
//! The tensor calls live there too (the reference's on-store tensor format is plain bytes: a
//! header and the payload), over `put_parts_batch` and the bytes calls here.
//!
//! Ranged reads (`get_into_ranges`): one existence check for the distinct keys (it grants the
//! read leases the reference's query grants), one stat for where their replicas are, then one
//! Transfer Engine batch of every fragment straight from a memory replica (same host first)
//! into the caller's registered memory, the next replica for a fragment whose read failed.
//! Objects that only NVMe or the object store hold are loaded into DRAM first by a get.
//!
//! Lifetime: a store dropped without `close` releases its segment in `Drop` (bounded, without
//! the GIL where the interpreter allows it; see `session`); `close(timeout_ms)` bounds an
//! explicit close, which the Python atexit hook uses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use kvfs_client::{GetInto, ObjectInfo, Persistence, Pin, PutFrom, PutOptions, Strategy, Tier};
use kvfs_transfer::{TransferOp, TransferRequest};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::client::{bytes_of_got, get_bytes, keepers, live, only};
use crate::errors::{Failure, code, log_code};
use crate::memory::{self, BufferHandle, View};
use crate::runtime;
use crate::session::{self, Session, SessionOptions};

/// The reference's ReplicateConfig, reduced to what kvfs places by.
type Cfg = (u8, String, String, String, Vec<String>, String);

fn options(cfg: Option<Cfg>, upsert: bool) -> Result<PutOptions, Failure> {
    let Some((replicas, pin, persistence, strategy, preferred, tier)) = cfg else {
        return Ok(PutOptions { upsert, ..PutOptions::default() });
    };
    if replicas == 0 {
        return Err(Failure::invalid("replica_num must be at least 1"));
    }
    let pin = match pin.as_str() {
        "hard" => Pin::Hard,
        "soft" => Pin::Soft,
        _ => Pin::None,
    };
    let persistence = match persistence.as_str() {
        "eager" => Persistence::Eager,
        "lazy" => Persistence::Lazy,
        _ => Persistence::None,
    };
    let strategy = match strategy.as_str() {
        "local_first" => Strategy::LocalFirst,
        "free_ratio_first" => Strategy::FreeRatioFirst,
        _ => Strategy::Random,
    };
    let tier = match tier.as_str() {
        "hbm" => Tier::Hbm,
        "dram" | "" => Tier::Dram,
        other => return Err(Failure::invalid(format!("tier {other:?}: dram or hbm"))),
    };
    Ok(PutOptions {
        replicas,
        pin,
        persistence,
        strategy,
        upsert,
        preferred_endpoints: preferred,
        checksum: false,
        tier,
    })
}

/// The reference puts bytes through its local buffer, so with `local_buffer_size` 0 every
/// bytes put fails (INVALID_PARAMS, its own test says so). kvfs needs no buffer for a put into
/// its own segment, but keeps the refusal: the caller said there is no buffer to put from.
fn bytes_puts(s: &Session) -> Result<(), Failure> {
    if s.put_buffer {
        return Ok(());
    }
    Err(Failure::invalid(
        "local_buffer_size is 0: the bytes API has no buffer to put from (put_from puts from \
         registered memory)",
    ))
}

fn rc(op: &str, r: Result<(), Failure>) -> i64 {
    match r {
        Ok(()) => code::OK,
        Err(f) => log_code(op, &f),
    }
}

/// An upsert refused because readers hold the object: the reference answers that case (its
/// readers' reference count) with OBJECT_REPLICA_BUSY, which its callers already handle.
fn upsert_rc(upsert: bool, code: i64) -> i64 {
    if upsert && code == code::OBJECT_HAS_LEASE { code::OBJECT_REPLICA_BUSY } else { code }
}

/// The native half of `MooncakeDistributedStore` (see the module notes).
#[pyclass(module = "kvfs._native", name = "MooncakeCore", frozen)]
pub struct MooncakeCore {
    slot: Mutex<Option<Arc<Session>>>,
}

/// Concurrent single-key puts of the large objects of a multi-part batch.
const PARTS_PUTS_CONCURRENT: usize = 16;

/// Objects of a multi-part batch up to this size are joined (one extra copy) and put in one
/// batch; larger ones are staged once each by their own put.
const JOIN_BYTES_MAX: usize = 256 << 10;

/// One fragment of `get_into_ranges`: where it lands in the results, the object (index into
/// the distinct keys), the destination address and the source range.
struct Fragment {
    at: (usize, usize, usize),
    key: usize,
    dst: Option<u64>,
    src: u64,
    len: u64,
}

/// A replica tuple for Python: `(tier, endpoint, host, node, addr, len)`.
type ReplicaTuple = (String, String, String, Option<u64>, u64, u64);

/// A stat for Python: `(code, size, lease_end_ms, replicas)`.
type StatTuple = (i64, u64, u64, Vec<ReplicaTuple>);

fn tier_name(t: Tier) -> String {
    format!("{t:?}").to_lowercase()
}

fn is_memory(r: &kvfs_client::ReplicaDesc) -> bool {
    matches!(r.tier, Tier::Dram | Tier::Hbm) && !r.endpoint.is_empty()
}

/// The reference's result shape for `get_into_ranges`, every entry INVALID_PARAMS until read.
fn ranges_skeleton(n: usize, keys: &[Vec<String>], dst: &[Vec<Vec<u64>>]) -> Vec<Vec<Vec<i64>>> {
    (0..n)
        .map(|i| {
            let nkeys = keys.get(i).map_or(1, Vec::len);
            (0..nkeys)
                .map(|j| {
                    let nfrags = dst.get(i).and_then(|d| d.get(j)).map_or(1, Vec::len);
                    vec![code::INVALID_PARAMS; nfrags]
                })
                .collect()
        })
        .collect()
}

/// The code of a failed fragment read: a bad local range is the caller's (no retry helps).
fn transfer_code(e: &kvfs_transfer::Error) -> (i64, bool) {
    match e.kind() {
        kvfs_transfer::ErrorKind::NotRegistered | kvfs_transfer::ErrorKind::InvalidArgument => {
            (code::INVALID_PARAMS, false)
        }
        _ => (code::TRANSFER_FAIL, true),
    }
}

/// Reads every fragment (see the module notes); one code per fragment: its length or negative.
async fn read_ranges(s: &Session, keys: &[&str], frags: &[Fragment]) -> Vec<i64> {
    let mut views = object_views(s, keys).await;
    let cold: Vec<usize> = (0..keys.len())
        .filter(|&k| views[k].as_ref().is_ok_and(|v| !v.replicas.iter().any(is_memory)))
        .collect();
    if !cold.is_empty() {
        // A get loads them into DRAM (the bytes it stages are dropped), then look again.
        let cold_keys: Vec<&str> = cold.iter().map(|&k| keys[k]).collect();
        drop(s.client.get_batch_staged(&cold_keys).await);
        for (&k, v) in cold.iter().zip(object_views(s, &cold_keys).await) {
            views[k] = v;
        }
    }
    let host = s.client.host().to_string();
    let ordered: Vec<Vec<kvfs_client::ReplicaDesc>> = views
        .iter()
        .map(|v| {
            let mut reps: Vec<_> = v.as_ref().map_or_else(
                |_| Vec::new(),
                |v| v.replicas.iter().filter(|r| is_memory(r)).cloned().collect(),
            );
            reps.sort_by_key(|r| r.host != host);
            reps
        })
        .collect();
    let mut codes = vec![code::INVALID_PARAMS; frags.len()];
    // (fragment, next replica to try)
    let mut pending: Vec<(usize, usize)> = Vec::new();
    for (f, frag) in frags.iter().enumerate() {
        match &views[frag.key] {
            Err(c) => codes[f] = *c,
            Ok(v) => {
                let fits = frag.src.checked_add(frag.len).is_some_and(|end| end <= v.size);
                match frag.dst {
                    Some(_) if fits && frag.len == 0 => codes[f] = 0,
                    Some(_) if fits => {
                        codes[f] = code::TRANSFER_FAIL;
                        pending.push((f, 0));
                    }
                    _ => {}
                }
            }
        }
    }
    let engine = s.client.engine();
    let batch_max = engine.config().batch_items_max.max(1);
    while !pending.is_empty() {
        let mut reqs = Vec::new();
        let mut owners = Vec::new();
        let mut again = Vec::new();
        for (f, next) in pending {
            let frag = &frags[f];
            let Some(r) = ordered[frag.key].get(next) else { continue };
            match engine.open_segment(&r.endpoint).await {
                Ok(segment) => {
                    reqs.push(TransferRequest {
                        op: TransferOp::Read,
                        segment,
                        local_addr: frag.dst.unwrap_or(0),
                        remote_addr: r.addr.saturating_add(frag.src),
                        len: frag.len,
                    });
                    owners.push((f, next));
                }
                Err(e) => {
                    codes[f] = transfer_code(&e).0;
                    again.push((f, next + 1));
                }
            }
        }
        let mut results = Vec::with_capacity(reqs.len());
        let mut reqs = reqs.into_iter().peekable();
        while reqs.peek().is_some() {
            let chunk: Vec<_> = reqs.by_ref().take(batch_max).collect();
            let n = chunk.len();
            match engine.transfer(chunk).await {
                Ok(r) => results.extend(r),
                Err(e) => results.extend(std::iter::repeat_n(Err(e), n)),
            }
        }
        for ((f, next), r) in owners.into_iter().zip(results) {
            match r {
                Ok(()) => codes[f] = i64::try_from(frags[f].len).unwrap_or(i64::MAX),
                Err(e) => {
                    let (c, retry) = transfer_code(&e);
                    codes[f] = c;
                    if retry {
                        again.push((f, next + 1));
                    }
                }
            }
        }
        pending = again;
    }
    codes
}

/// Each key's object as the master knows it, after a lease-granting existence check.
async fn object_views(s: &Session, keys: &[&str]) -> Vec<Result<ObjectInfo, i64>> {
    let exists = s.client.exists_batch(keys).await;
    let stats = s.client.stat_batch(keys).await;
    exists
        .into_iter()
        .zip(stats)
        .map(|(e, v)| match (e, v) {
            (Ok(true), Ok(v)) => Ok(v),
            (Ok(false), _) => Err(code::OBJECT_NOT_FOUND),
            (Err(e), _) | (_, Err(e)) => Err(log_code("get_into_ranges", &Failure::from(e))),
        })
        .collect()
}

impl MooncakeCore {
    fn session(&self) -> Result<Arc<Session>, Failure> {
        live(&self.slot)
    }

    /// Closes the session within `limit` (its call deadline when `None`).
    fn close_within(&self, py: Python<'_>, limit: Option<Duration>) {
        let taken = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = taken {
            let limit = limit.unwrap_or(s.call_timeout);
            py.detach(|| runtime::block_on_detached(session::close_shared(s, limit)));
        }
    }

    /// Runs a call that answers one code.
    fn code_call<F, Fut>(&self, py: Python<'_>, op: &'static str, f: F) -> i64
    where
        F: FnOnce(Arc<Session>) -> Fut,
        Fut: std::future::Future<Output = Result<(), Failure>> + Send,
    {
        let r = self.session().and_then(|s| {
            let limit = s.call_timeout;
            runtime::call(py, op, limit, f(s))
        });
        rc(op, r)
    }

    fn put_parts_inner(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &[&[u8]],
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> i64 {
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return log_code("put", &f),
        };
        let c = self.code_call(py, "put", move |s: Arc<Session>| async move {
            bytes_puts(&s)?;
            s.client.put_parts(key, parts, &opts).await.map_err(Failure::from)
        });
        upsert_rc(upsert, c)
    }

    fn batch_put_from_inner(
        &self,
        py: Python<'_>,
        keys: &[String],
        ptrs: &[u64],
        sizes: &[u64],
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> Vec<i64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return vec![code::INVALID_PARAMS; keys.len()];
        }
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return vec![log_code("put", &f); keys.len()],
        };
        let items: Vec<PutFrom> = keys
            .iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(k, (&addr, &len))| PutFrom { key: k, addr, len })
            .collect();
        let r = self.session().and_then(|s| {
            runtime::call(py, "put", s.call_timeout, async {
                Ok(s.client.put_from_batch(&items, &opts).await)
            })
        });
        match r {
            Ok(v) => v
                .into_iter()
                .map(|r| upsert_rc(upsert, rc("put", r.map_err(Failure::from))))
                .collect(),
            Err(f) => vec![log_code("put", &f); keys.len()],
        }
    }
}

fn views(values: &Bound<'_, PyAny>) -> PyResult<Vec<View>> {
    values.try_iter()?.map(|v| View::new(&v?, false)).collect()
}

#[pymethods]
impl MooncakeCore {
    #[new]
    fn new() -> MooncakeCore {
        MooncakeCore { slot: Mutex::new(None) }
    }

    /// Connects (and with `global_segment_size > 0` contributes a segment); returns a code.
    #[pyo3(signature = (local_hostname, master, global_segment_size, local_buffer_size,
        tcp_only=false, port_min=12300, port_max=14300, timeout_ms=60_000, rpc_timeout_ms=5_000,
        populate=false, tenant=None, hbm_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn setup(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        master: &str,
        global_segment_size: u64,
        local_buffer_size: u64,
        tcp_only: bool,
        port_min: u16,
        port_max: u16,
        timeout_ms: u64,
        rpc_timeout_ms: u64,
        populate: bool,
        tenant: Option<String>,
        hbm_bytes: u64,
    ) -> i64 {
        if self.session().is_ok() {
            // The reference re-runs setup over a live client; kvfs closes the old one first.
            self.close_within(py, None);
        }
        let opts = SessionOptions {
            master: master.to_string(),
            local_hostname: Some(local_hostname.to_string()),
            port_range: Some((port_min, port_max)),
            segment_bytes: global_segment_size,
            hbm_bytes,
            staging_bytes_max: usize::try_from(local_buffer_size).unwrap_or(usize::MAX),
            tcp_only,
            populate,
            rpc_timeout_ms,
            call_timeout_ms: timeout_ms,
            tenant,
            ..SessionOptions::default()
        };
        let limit = Duration::from_millis(timeout_ms.max(rpc_timeout_ms) + 10_000);
        match runtime::call(py, "setup", limit, Session::open(opts)) {
            Ok(s) => {
                let old = self.slot.lock().unwrap_or_else(|e| e.into_inner()).replace(Arc::new(s));
                // Outside the slot's lock: a replaced session's drop waits for its node to
                // leave the master.
                drop(old);
                code::OK
            }
            Err(f) => {
                tracing::warn!(error = %f.message, "setup failed");
                f.code()
            }
        }
    }

    /// Leaves the cluster; returns 0 (also when not set up). `timeout_ms` bounds the wait
    /// (default: the call deadline); past it the segment expires on the master instead.
    #[pyo3(signature = (timeout_ms=None))]
    fn close(&self, py: Python<'_>, timeout_ms: Option<u64>) -> i64 {
        self.close_within(py, timeout_ms.map(Duration::from_millis));
        code::OK
    }

    /// 0 healthy, 1 not set up or closed, 2 master unreachable (the reference's convention).
    fn health_check(&self, py: Python<'_>) -> i64 {
        let Ok(s) = self.session() else { return 1 };
        match runtime::call(py, "health", s.call_timeout, async {
            s.client.stats().await.map_err(Failure::from)
        }) {
            Ok(_) => 0,
            Err(_) => 2,
        }
    }

    fn get_hostname(&self) -> String {
        self.session().map(|s| s.endpoint.clone()).unwrap_or_default()
    }

    /// Whether this process contributes a segment (embedded node).
    fn has_segment(&self) -> bool {
        self.session().is_ok_and(|s| s.has_segment())
    }

    #[pyo3(signature = (key, value, cfg=None, upsert=false))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> PyResult<i64> {
        let views = [Arc::new(View::new(value, false)?)];
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return Ok(log_code("put", &f)),
        };
        let items = [(key, views[0].bytes())];
        let views = &views;
        let c = self.code_call(py, "put", move |s: Arc<Session>| async move {
            bytes_puts(&s)?;
            let r = s.client.put_batch_lent(&items, &opts, keepers(views)).await;
            r.into_iter().find_map(Result::err).map_or(Ok(()), |e| Err(Failure::from(e)))
        });
        Ok(upsert_rc(upsert, c))
    }

    #[pyo3(signature = (key, parts, cfg=None, upsert=false))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyAny>,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> PyResult<i64> {
        let vs = views(parts)?;
        let slices: Vec<&[u8]> = vs.iter().map(View::bytes).collect();
        Ok(self.put_parts_inner(py, key, &slices, cfg, upsert))
    }

    /// One code for the whole batch: 0, or the first item's failure.
    #[pyo3(signature = (keys, values, cfg=None, upsert=false))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> PyResult<i64> {
        let vs: Vec<Arc<View>> = views(values)?.into_iter().map(Arc::new).collect();
        if vs.len() != keys.len() {
            return Ok(code::INVALID_PARAMS);
        }
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return Ok(log_code("put", &f)),
        };
        let items: Vec<(&str, &[u8])> =
            keys.iter().map(String::as_str).zip(vs.iter().map(|v| v.bytes())).collect();
        let vs = &vs;
        let c = self.code_call(py, "put", move |s: Arc<Session>| async move {
            bytes_puts(&s)?;
            let r = s.client.put_batch_lent(&items, &opts, keepers(vs)).await;
            r.into_iter().find_map(Result::err).map_or(Ok(()), |e| Err(Failure::from(e)))
        });
        Ok(upsert_rc(upsert, c))
    }

    /// One code per key for objects given as lists of parts (each object the concatenation of
    /// its parts): the tensor calls' `[header][payload]` objects. Small objects go in one
    /// batched put, large ones in their own (`JOIN_BYTES_MAX`, `PARTS_PUTS_CONCURRENT`);
    /// mismatched lengths give -600 for every key.
    #[pyo3(signature = (keys, values, cfg=None, upsert=false))]
    fn put_parts_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> PyResult<Vec<i64>> {
        let parts: Vec<Vec<View>> =
            values.try_iter()?.map(|v| views(&v?)).collect::<PyResult<_>>()?;
        if parts.len() != keys.len() {
            return Ok(vec![code::INVALID_PARAMS; keys.len()]);
        }
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return Ok(vec![log_code("put", &f); keys.len()]),
        };
        let slices: Vec<Vec<&[u8]>> =
            parts.iter().map(|p| p.iter().map(View::bytes).collect()).collect();
        let small = |p: &Vec<&[u8]>| p.iter().map(|b| b.len()).sum::<usize>() <= JOIN_BYTES_MAX;
        let (joined, single): (Vec<usize>, Vec<usize>) =
            (0..keys.len()).partition(|&i| small(&slices[i]));
        let r = self.session().and_then(|s| {
            bytes_puts(&s)?;
            runtime::call(py, "put", s.call_timeout, async {
                // Small objects: joined here, then one batched put (one master round trip).
                let bodies: Vec<Vec<u8>> = joined.iter().map(|&i| slices[i].concat()).collect();
                let items: Vec<(&str, &[u8])> =
                    joined.iter().zip(&bodies).map(|(&i, b)| (keys[i].as_str(), &b[..])).collect();
                // Large ones: each staged once by its own put, a few at a time.
                let puts: Vec<_> = single
                    .iter()
                    .map(|&i| s.client.put_parts(&keys[i], &slices[i], &opts))
                    .collect();
                let large = futures_util::stream::iter(puts)
                    .buffered(PARTS_PUTS_CONCURRENT)
                    .collect::<Vec<_>>();
                let batched = async {
                    if items.is_empty() {
                        Vec::new()
                    } else {
                        s.client.put_batch(&items, &opts).await
                    }
                };
                let (a, b) = tokio::join!(batched, large);
                let mut out: Vec<Option<Result<(), kvfs_client::Error>>> =
                    (0..keys.len()).map(|_| None).collect();
                for (i, r) in joined.iter().zip(a).chain(single.iter().zip(b)) {
                    out[*i] = Some(r);
                }
                Ok(out)
            })
        });
        Ok(match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Some(r) => upsert_rc(upsert, rc("put", r.map_err(Failure::from))),
                    None => code::INTERNAL_ERROR,
                })
                .collect(),
            Err(f) => vec![log_code("put", &f); keys.len()],
        })
    }

    /// Bytes, or `b""` on a miss or failure.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let r = self.session().and_then(|s| {
            runtime::call(py, "get", s.call_timeout, async {
                only("get", get_bytes(&s.client, &[key]).await)
            })
        });
        match r {
            Ok(b) => bytes_of_got(py, b),
            Err(f) => {
                log_code("get", &f);
                PyBytes::new(py, b"")
            }
        }
    }

    /// Bytes per key, `b""` for a miss or failure (`[b""]` when not set up, as the reference).
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyList>> {
        let Ok(s) = self.session() else {
            return PyList::new(py, [PyBytes::new(py, b"")]);
        };
        let r = runtime::call(py, "get", s.call_timeout, async {
            Ok(get_bytes(&s.client, &keys).await)
        });
        let items: Vec<Bound<'py, PyBytes>> = match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(b) => bytes_of_got(py, b),
                    Err(e) => {
                        log_code("get", &Failure::from(e));
                        PyBytes::new(py, b"")
                    }
                })
                .collect(),
            Err(f) => {
                log_code("get", &f);
                keys.iter().map(|_| PyBytes::new(py, b"")).collect()
            }
        };
        PyList::new(py, items)
    }

    /// A `BufferHandle` over the object's bytes (no extra copy), or `None`.
    fn get_buffer(&self, py: Python<'_>, key: &str) -> Option<BufferHandle> {
        self.batch_get_buffer(py, vec![key.to_string()]).pop().flatten()
    }

    fn batch_get_buffer(&self, py: Python<'_>, keys: Vec<String>) -> Vec<Option<BufferHandle>> {
        let r = self.session().and_then(|s| {
            runtime::call(py, "get", s.call_timeout, async {
                Ok(s.client.get_batch_staged(&keys).await)
            })
        });
        match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(b) => Some(BufferHandle::new(b)),
                    Err(e) => {
                        log_code("get", &Failure::from(e));
                        None
                    }
                })
                .collect(),
            Err(f) => {
                log_code("get", &f);
                keys.iter().map(|_| None).collect()
            }
        }
    }

    #[pyo3(signature = (key, ptr, size, cfg=None, upsert=false))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &str,
        ptr: u64,
        size: u64,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> i64 {
        let keys = [key.to_string()];
        self.batch_put_from_inner(py, &keys, &[ptr], &[size], cfg, upsert)
            .pop()
            .unwrap_or(code::INTERNAL_ERROR)
    }

    #[pyo3(signature = (keys, ptrs, sizes, cfg=None, upsert=false))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
        cfg: Option<Cfg>,
        upsert: bool,
    ) -> Vec<i64> {
        self.batch_put_from_inner(py, &keys, &ptrs, &sizes, cfg, upsert)
    }

    /// Bytes read, or a negative code (`size` must hold the whole object).
    fn get_into(&self, py: Python<'_>, key: &str, ptr: u64, size: u64) -> i64 {
        self.batch_get_into(py, vec![key.to_string()], vec![ptr], vec![size])
            .pop()
            .unwrap_or(code::INTERNAL_ERROR)
    }

    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<u64>,
        sizes: Vec<u64>,
    ) -> Vec<i64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return vec![code::INVALID_PARAMS; keys.len()];
        }
        let items: Vec<GetInto> = keys
            .iter()
            .zip(ptrs.iter().zip(&sizes))
            .map(|(k, (&addr, &cap))| GetInto { key: k, addr, cap })
            .collect();
        let r = self.session().and_then(|s| {
            runtime::call(py, "get", s.call_timeout, async {
                Ok(s.client.get_into_batch(&items).await)
            })
        });
        match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
                    Err(e) => log_code("get", &Failure::from(e)),
                })
                .collect(),
            Err(f) => vec![log_code("get", &f); keys.len()],
        }
    }

    /// Byte ranges of objects into registered memory, buffer-major as the reference nests
    /// them: `results[i][j][k]` is the length read for fragment `k` of key `all_keys[i][j]`
    /// into `buffer_ptrs[i] + all_dst_offsets[i][j][k]`, or a negative code (-600 for a bad
    /// shape, a source range past the object or a destination outside registered memory).
    #[allow(clippy::too_many_arguments)]
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<u64>,
        all_keys: Vec<Vec<String>>,
        all_dst_offsets: Vec<Vec<Vec<u64>>>,
        all_src_offsets: Vec<Vec<Vec<u64>>>,
        all_sizes: Vec<Vec<Vec<u64>>>,
    ) -> Vec<Vec<Vec<i64>>> {
        let n = buffer_ptrs.len();
        let mut out = ranges_skeleton(n, &all_keys, &all_dst_offsets);
        if [all_keys.len(), all_dst_offsets.len(), all_src_offsets.len(), all_sizes.len()]
            .iter()
            .any(|&l| l != n)
        {
            return out;
        }
        let Ok(s) = self.session() else { return out };
        let mut keys: Vec<&str> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut frags = Vec::new();
        for i in 0..n {
            let (ks, dst, src, len) =
                (&all_keys[i], &all_dst_offsets[i], &all_src_offsets[i], &all_sizes[i]);
            if buffer_ptrs[i] == 0 || dst.len() != ks.len() || src.len() != ks.len() {
                continue;
            }
            if len.len() != ks.len() {
                continue;
            }
            for (j, key) in ks.iter().enumerate() {
                if dst[j].len() != src[j].len() || dst[j].len() != len[j].len() {
                    continue;
                }
                let k = *index.entry(key.as_str()).or_insert_with(|| {
                    keys.push(key);
                    keys.len() - 1
                });
                for f in 0..dst[j].len() {
                    frags.push(Fragment {
                        at: (i, j, f),
                        key: k,
                        dst: buffer_ptrs[i].checked_add(dst[j][f]),
                        src: src[j][f],
                        len: len[j][f],
                    });
                }
            }
        }
        if frags.is_empty() {
            return out;
        }
        let r = runtime::call(py, "get", s.call_timeout, async {
            Ok(read_ranges(&s, &keys, &frags).await)
        });
        let codes = match r {
            Ok(c) => c,
            Err(f) => vec![log_code("get_into_ranges", &f); frags.len()],
        };
        for (frag, c) in frags.iter().zip(codes) {
            let (i, j, f) = frag.at;
            out[i][j][f] = c;
        }
        out
    }

    /// What the master knows of each key, granting no lease (see `StatTuple`).
    fn stat_batch(&self, py: Python<'_>, keys: Vec<String>) -> Vec<StatTuple> {
        let miss = |c: i64| (c, 0, 0, Vec::new());
        if keys.is_empty() {
            return Vec::new();
        }
        let r = self.session().and_then(|s| {
            runtime::call(py, "stat", s.call_timeout, async {
                Ok(s.client.stat_batch(&keys).await)
            })
        });
        match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(v) => {
                        let reps = v
                            .replicas
                            .iter()
                            .map(|r| {
                                let tier = tier_name(r.tier);
                                (tier, r.endpoint.clone(), r.host.clone(), r.node, r.addr, r.len)
                            })
                            .collect();
                        (code::OK, v.size, v.lease_end_ms, reps)
                    }
                    Err(e) => miss(log_code("stat", &Failure::from(e))),
                })
                .collect(),
            Err(f) => vec![miss(log_code("stat", &f)); keys.len()],
        }
    }

    /// `MooncakeHostMemAllocator.alloc`: shared host memory's address (`RuntimeError` if the
    /// system refuses it).
    #[staticmethod]
    fn host_alloc(py: Python<'_>, size: u64) -> PyResult<u64> {
        py.detach(|| memory::host_alloc(size)).map_err(PyRuntimeError::new_err)
    }

    /// `MooncakeHostMemAllocator.free`: 0, or -1 for an address `host_alloc` did not return.
    #[staticmethod]
    fn host_free(py: Python<'_>, ptr: u64) -> i64 {
        py.detach(|| memory::host_free(ptr))
    }

    /// Registers `[ptr, ptr+size)` with this process's engine; the caller keeps it valid.
    fn register_buffer(&self, ptr: u64, size: u64) -> i64 {
        let s = match self.session() {
            Ok(s) => s,
            Err(f) => return log_code("register_buffer", &f),
        };
        if ptr == 0 || size == 0 {
            return code::INVALID_PARAMS;
        }
        // SAFETY: the reference API's contract: the caller keeps the memory valid until it
        // unregisters it (Python wrappers holding objects keep them alive themselves).
        match unsafe { s.client.engine().register_memory(ptr, size, false) } {
            Ok(()) => code::OK,
            Err(e) => log_code("register_buffer", &Failure::invalid(e.to_string())),
        }
    }

    fn unregister_buffer(&self, ptr: u64) -> i64 {
        let s = match self.session() {
            Ok(s) => s,
            Err(f) => return log_code("unregister_buffer", &f),
        };
        match s.client.engine().unregister(ptr) {
            Ok(()) => code::OK,
            Err(e) => log_code("unregister_buffer", &Failure::invalid(e.to_string())),
        }
    }

    /// 1 exists, 0 missing, negative on failure; grants a read lease when it exists.
    fn is_exist(&self, py: Python<'_>, key: &str) -> i64 {
        self.batch_is_exist(py, vec![key.to_string()]).pop().unwrap_or(code::INTERNAL_ERROR)
    }

    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        if keys.is_empty() {
            return Vec::new();
        }
        let r = self.session().and_then(|s| {
            runtime::call(py, "exists", s.call_timeout, async {
                Ok(s.client.exists_batch(&keys).await)
            })
        });
        match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(b) => i64::from(b),
                    Err(e) => log_code("is_exist", &Failure::from(e)),
                })
                .collect(),
            Err(f) => vec![log_code("is_exist", &f); keys.len()],
        }
    }

    /// Size in bytes, or a negative code.
    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        let r = self.session().and_then(|s| {
            runtime::call(py, "get_size", s.call_timeout, async {
                s.client.stat(key).await.map_err(Failure::from)
            })
        });
        match r {
            Ok(v) => i64::try_from(v.size).unwrap_or(i64::MAX),
            Err(f) => log_code("get_size", &f),
        }
    }

    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> i64 {
        self.code_call(py, "remove", move |s: Arc<Session>| async move {
            s.client.remove(key, force).await.map_err(Failure::from)
        })
    }

    /// A kvfs extension (the reference has no rename): 0, -704 when `src` is missing, -705
    /// when `dst` exists and `replace` is false.
    #[pyo3(signature = (src, dst, replace=true))]
    fn rename(&self, py: Python<'_>, src: &str, dst: &str, replace: bool) -> i64 {
        let mode = if replace {
            kvfs_client::RenameMode::Replace
        } else {
            kvfs_client::RenameMode::NoReplace
        };
        self.code_call(py, "rename", move |s: Arc<Session>| async move {
            s.client.rename(src, dst, mode).await.map(|_| ()).map_err(Failure::from)
        })
    }

    #[pyo3(signature = (keys, force=false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        let r = self.session().and_then(|s| {
            runtime::call(py, "remove", s.call_timeout, async {
                Ok(s.client.remove_batch(&keys, force).await)
            })
        });
        match r {
            Ok(v) => v.into_iter().map(|r| rc("remove", r.map_err(Failure::from))).collect(),
            Err(f) => vec![log_code("remove", &f); keys.len()],
        }
    }

    /// The keys whose replicas on `segment_name` (every replica when empty) were dropped once
    /// their read lease had ended (the reference's `batch_replica_clear`).
    #[pyo3(signature = (keys, segment_name=""))]
    fn batch_replica_clear(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        segment_name: &str,
    ) -> Vec<String> {
        let endpoint = (!segment_name.is_empty()).then_some(segment_name);
        let r = self.session().and_then(|s| {
            runtime::call(py, "batch_replica_clear", s.call_timeout, async {
                Ok(s.client.clear_replicas(&keys, endpoint).await)
            })
        });
        match r {
            Ok(v) => keys
                .into_iter()
                .zip(v)
                .filter(|(_, r)| matches!(r, Ok(true)))
                .map(|(k, _)| k)
                .collect(),
            Err(f) => {
                log_code("batch_replica_clear", &f);
                Vec::new()
            }
        }
    }

    /// Objects removed, or a negative code.
    #[pyo3(signature = (pattern, force=false))]
    fn remove_by_regex(&self, py: Python<'_>, pattern: &str, force: bool) -> i64 {
        let r = self.session().and_then(|s| {
            runtime::call(py, "remove", s.call_timeout, async {
                s.client.remove_regex(pattern, force).await.map_err(Failure::from)
            })
        });
        match r {
            Ok(c) => i64::try_from(c.removed).unwrap_or(i64::MAX),
            Err(f) => log_code("remove_by_regex", &f),
        }
    }

    /// Objects removed (leased ones stay unless `force`), or a negative code.
    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        let r = self.session().and_then(|s| {
            runtime::call(py, "remove", s.call_timeout, async {
                s.client.remove_all(force).await.map_err(Failure::from)
            })
        });
        match r {
            Ok(c) => i64::try_from(c.removed).unwrap_or(i64::MAX),
            Err(f) => log_code("remove_all", &f),
        }
    }
}
