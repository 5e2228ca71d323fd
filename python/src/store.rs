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
//! values (`cfg` is `(replicas, pin, persistence, strategy, preferred_endpoints)` or `None`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_client::{GetInto, Persistence, Pin, PutFrom, PutOptions, Strategy};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::client::{bytes_of, close_slot, drop_session, live};
use crate::errors::{Failure, code, log_code};
use crate::memory::{BufferHandle, View};
use crate::runtime;
use crate::session::{Session, SessionOptions};

/// The reference's ReplicateConfig, reduced to what kvfs places by.
type Cfg = (u8, String, String, String, Vec<String>);

fn options(cfg: Option<Cfg>, upsert: bool) -> Result<PutOptions, Failure> {
    let Some((replicas, pin, persistence, strategy, preferred)) = cfg else {
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
    Ok(PutOptions {
        replicas,
        pin,
        persistence,
        strategy,
        upsert,
        preferred_endpoints: preferred,
        checksum: false,
    })
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

impl Drop for MooncakeCore {
    fn drop(&mut self) {
        drop_session(self.slot.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl MooncakeCore {
    fn session(&self) -> Result<Arc<Session>, Failure> {
        live(&self.slot)
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
        populate=false))]
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
    ) -> i64 {
        if self.session().is_ok() {
            // The reference re-runs setup over a live client; kvfs closes the old one first.
            close_slot(py, &self.slot);
        }
        let opts = SessionOptions {
            master: master.to_string(),
            local_hostname: Some(local_hostname.to_string()),
            port_range: Some((port_min, port_max)),
            segment_bytes: global_segment_size,
            staging_bytes_max: usize::try_from(local_buffer_size).unwrap_or(usize::MAX),
            tcp_only,
            populate,
            rpc_timeout_ms,
            call_timeout_ms: timeout_ms,
            ..SessionOptions::default()
        };
        let limit = Duration::from_millis(timeout_ms.max(rpc_timeout_ms) + 10_000);
        match runtime::call(py, "setup", limit, Session::open(opts)) {
            Ok(s) => {
                *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(s));
                code::OK
            }
            Err(f) => {
                tracing::warn!(error = %f.message, "setup failed");
                f.code()
            }
        }
    }

    /// Leaves the cluster; returns 0 (also when not set up).
    fn close(&self, py: Python<'_>) -> i64 {
        close_slot(py, &self.slot);
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
        let view = View::new(value, false)?;
        Ok(self.put_parts_inner(py, key, &[view.bytes()], cfg, upsert))
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
        let vs = views(values)?;
        if vs.len() != keys.len() {
            return Ok(code::INVALID_PARAMS);
        }
        let opts = match options(cfg, upsert) {
            Ok(o) => o,
            Err(f) => return Ok(log_code("put", &f)),
        };
        let items: Vec<(&str, &[u8])> =
            keys.iter().map(String::as_str).zip(vs.iter().map(View::bytes)).collect();
        let c = self.code_call(py, "put", move |s: Arc<Session>| async move {
            let r = s.client.put_batch(&items, &opts).await;
            r.into_iter().find_map(Result::err).map_or(Ok(()), |e| Err(Failure::from(e)))
        });
        Ok(upsert_rc(upsert, c))
    }

    /// Bytes, or `b""` on a miss or failure.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let r = self.session().and_then(|s| {
            runtime::call(py, "get", s.call_timeout, async {
                s.client.get_staged(key).await.map_err(Failure::from)
            })
        });
        match r {
            Ok(b) => bytes_of(py, &b),
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
            Ok(s.client.get_batch_staged(&keys).await)
        });
        let items: Vec<Bound<'py, PyBytes>> = match r {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(b) => bytes_of(py, &b),
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
