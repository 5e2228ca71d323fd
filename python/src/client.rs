//! `kvfs.Client`: the native Python API, a thin and Pythonic face of the Rust client.
//!
//! Policy. Failures raise `kvfs.KvfsError` subclasses (`NotFoundError` is also a `KeyError`,
//! `InvalidArgumentError` a `ValueError`, `TimeoutError` the builtin one); batch calls never
//! raise for one item and return per-item results instead: `None` for a put that worked, the
//! exception instance for one that did not, `None` for a missing key in `get_batch`. Every call
//! releases the GIL and ends within the client's `timeout_ms`.
//!
//! Zero-copy calls take buffer-protocol objects (numpy arrays, bytearray, memoryview) or raw
//! addresses with sizes; the memory must be registered first (`register`), as with the
//! reference's `register_buffer`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvfs_client::{
    GetInto, JobKind, JobSpec, JobStatus, Persistence, Pin, PutFrom, PutOptions, RenameMode,
    Strategy, Tier,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::Failure;
use crate::memory::{Region, View};
use crate::runtime;
use crate::session::{Session, SessionOptions};

type Shared = Mutex<Option<Arc<Session>>>;

/// `([(key, size), ...], next_start_after)`, as `Client.list` returns it.
type ListPage = (Vec<(String, u64)>, Option<String>);

/// Takes the live session, or fails as not connected.
pub fn live(slot: &Shared) -> Result<Arc<Session>, Failure> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(Failure::not_connected)
}

/// Closes the session in `slot` (idempotent).
pub fn close_slot(py: Python<'_>, slot: &Shared) {
    let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(s) = taken {
        py.detach(|| {
            runtime::block_on_detached(async move {
                // Other threads may still hold the session for a call in flight: wait for them
                // briefly, then close what is left.
                let mut s = s;
                for _ in 0..200 {
                    match Arc::try_unwrap(s) {
                        Ok(owned) => return owned.close().await,
                        Err(shared) => s = shared,
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                s.client.close().await;
            })
        });
    }
}

/// A connection to a kvfs cluster.
///
/// `Client(master="127.0.0.1:50051", *, segment_bytes=0, local_hostname=None, timeout_ms=60000,
/// rpc_timeout_ms=5000, staging_bytes_max=None, tcp_only=False, hbm_bytes=0)`;
/// `segment_bytes > 0` also contributes that much of this process's DRAM to the pool (an
/// embedded node), and `hbm_bytes > 0` that much GPU memory of device 0 beside it. Puts take
/// `tier="hbm"` to be placed in GPU memory.
#[pyclass(module = "kvfs._native", name = "Client", frozen)]
pub struct PyClient {
    slot: Shared,
    regs: Mutex<HashMap<u64, Option<View>>>,
}

#[allow(clippy::too_many_arguments)]
fn put_options(
    replicas: u8,
    pin: &str,
    persistence: &str,
    strategy: &str,
    preferred: Vec<String>,
    upsert: bool,
    checksum: bool,
    tier: &str,
) -> Result<PutOptions, Failure> {
    let pin = match pin {
        "none" => Pin::None,
        "soft" => Pin::Soft,
        "hard" => Pin::Hard,
        p => return Err(Failure::invalid(format!("pin {p:?}: one of none, soft, hard"))),
    };
    let persistence = match persistence {
        "none" => Persistence::None,
        "lazy" => Persistence::Lazy,
        "eager" => Persistence::Eager,
        p => return Err(Failure::invalid(format!("persistence {p:?}: one of none, lazy, eager"))),
    };
    let strategy = match strategy {
        "random" => Strategy::Random,
        "free_ratio_first" => Strategy::FreeRatioFirst,
        "local_first" => Strategy::LocalFirst,
        s => {
            return Err(Failure::invalid(format!(
                "strategy {s:?}: one of random, free_ratio_first, local_first"
            )));
        }
    };
    let tier = match tier {
        "dram" => Tier::Dram,
        "hbm" => Tier::Hbm,
        t => return Err(Failure::invalid(format!("tier {t:?}: dram or hbm"))),
    };
    if replicas == 0 {
        return Err(Failure::invalid("replicas must be at least 1"));
    }
    Ok(PutOptions {
        replicas,
        persistence,
        pin,
        strategy,
        upsert,
        preferred_endpoints: preferred,
        checksum,
        tier,
    })
}

impl PyClient {
    /// The live session, or the not-connected error.
    pub(crate) fn session(&self, py: Python<'_>) -> PyResult<Arc<Session>> {
        live(&self.slot).map_err(|f| f.to_pyerr(py))
    }
}

fn raise<T>(py: Python<'_>, r: Result<T, Failure>) -> PyResult<T> {
    r.map_err(|f| f.to_pyerr(py))
}

/// Per-item put results: `None` or the exception instance.
fn put_results(py: Python<'_>, r: Vec<Result<(), Failure>>) -> PyResult<Bound<'_, PyList>> {
    let items: Vec<Py<PyAny>> = r
        .into_iter()
        .map(|r| match r {
            Ok(()) => py.None(),
            Err(f) => f.to_pyobject(py),
        })
        .collect();
    PyList::new(py, items)
}

fn regions(
    objs: &Bound<'_, PyAny>,
    sizes: Option<Vec<u64>>,
    n: usize,
    writable: bool,
) -> PyResult<Vec<Region>> {
    let objs: Vec<Bound<'_, PyAny>> = objs.try_iter()?.collect::<PyResult<_>>()?;
    if objs.len() != n || sizes.as_ref().is_some_and(|s| s.len() != n) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "keys, buffers and sizes must have the same length",
        ));
    }
    objs.iter()
        .enumerate()
        .map(|(i, o)| Region::resolve(o, sizes.as_ref().map(|s| s[i]), writable))
        .collect()
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (master="127.0.0.1:50051", *, segment_bytes=0, local_hostname=None,
        timeout_ms=60_000, rpc_timeout_ms=5_000, staging_bytes_max=None, tcp_only=false,
        hbm_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        master: &str,
        segment_bytes: u64,
        local_hostname: Option<String>,
        timeout_ms: u64,
        rpc_timeout_ms: u64,
        staging_bytes_max: Option<usize>,
        tcp_only: bool,
        hbm_bytes: u64,
    ) -> PyResult<PyClient> {
        let opts = SessionOptions {
            master: master.to_string(),
            // A named host gets a port from the reference's range, so the segment name is
            // `host:port` like the reference's get_hostname().
            port_range: local_hostname.as_ref().map(|_| (12300, 14300)),
            local_hostname,
            segment_bytes,
            hbm_bytes,
            staging_bytes_max: staging_bytes_max.unwrap_or(usize::MAX),
            tcp_only,
            rpc_timeout_ms,
            call_timeout_ms: timeout_ms,
            ..SessionOptions::default()
        };
        let limit = std::time::Duration::from_millis(timeout_ms.max(rpc_timeout_ms) + 10_000);
        let s = raise(py, runtime::call(py, "connect", limit, Session::open(opts)))?;
        Ok(PyClient { slot: Mutex::new(Some(Arc::new(s))), regs: Mutex::new(HashMap::new()) })
    }

    /// This process's Transfer Engine segment name (`host:port`).
    #[getter]
    fn endpoint(&self, py: Python<'_>) -> PyResult<String> {
        Ok(raise(py, live(&self.slot))?.endpoint.clone())
    }

    /// The master address.
    #[getter]
    fn master(&self, py: Python<'_>) -> PyResult<String> {
        Ok(raise(py, live(&self.slot))?.client.master_addr().to_string())
    }

    /// Stores bytes (any buffer-protocol object); the first writer of a key wins unless
    /// `upsert`.
    #[pyo3(signature = (key, value, *, replicas=1, pin="none", persistence="none",
        strategy="random", preferred=Vec::new(), upsert=false, checksum=false, tier="dram"))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        replicas: u8,
        pin: &str,
        persistence: &str,
        strategy: &str,
        preferred: Vec<String>,
        upsert: bool,
        checksum: bool,
        tier: &str,
    ) -> PyResult<()> {
        let opts = raise(
            py,
            put_options(replicas, pin, persistence, strategy, preferred, upsert, checksum, tier),
        )?;
        let s = raise(py, live(&self.slot))?;
        let views = [Arc::new(View::new(value, false)?)];
        let items = [(key, views[0].bytes())];
        raise(
            py,
            runtime::call(py, "put", s.call_timeout, async {
                only("put", s.client.put_batch_lent(&items, &opts, keepers(&views)).await)
            }),
        )
    }

    /// Stores many values; returns one result per key (`None` or the exception).
    #[pyo3(signature = (keys, values, *, replicas=1, pin="none", persistence="none",
        strategy="random", preferred=Vec::new(), upsert=false, checksum=false, tier="dram"))]
    #[allow(clippy::too_many_arguments)]
    fn put_batch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        values: &Bound<'py, PyAny>,
        replicas: u8,
        pin: &str,
        persistence: &str,
        strategy: &str,
        preferred: Vec<String>,
        upsert: bool,
        checksum: bool,
        tier: &str,
    ) -> PyResult<Bound<'py, PyList>> {
        let opts = raise(
            py,
            put_options(replicas, pin, persistence, strategy, preferred, upsert, checksum, tier),
        )?;
        let s = raise(py, live(&self.slot))?;
        let views: Vec<Arc<View>> = values
            .try_iter()?
            .map(|v| View::new(&v?, false).map(Arc::new))
            .collect::<PyResult<_>>()?;
        if views.len() != keys.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "keys and values must have the same length",
            ));
        }
        let items: Vec<(&str, &[u8])> =
            keys.iter().map(String::as_str).zip(views.iter().map(|v| v.bytes())).collect();
        let r = runtime::call(py, "put", s.call_timeout, async {
            Ok(s.client.put_batch_lent(&items, &opts, keepers(&views)).await)
        });
        let r = match r {
            Ok(v) => v.into_iter().map(|r| r.map_err(Failure::from)).collect(),
            Err(f) => vec![Err(f); keys.len()],
        };
        put_results(py, r)
    }

    /// Stores the memory of a registered buffer (object, or address with `size`) without a copy.
    #[pyo3(signature = (key, src, size=None, *, replicas=1, pin="none", persistence="none",
        strategy="random", preferred=Vec::new(), upsert=false, checksum=false, tier="dram"))]
    #[allow(clippy::too_many_arguments)]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &str,
        src: &Bound<'_, PyAny>,
        size: Option<u64>,
        replicas: u8,
        pin: &str,
        persistence: &str,
        strategy: &str,
        preferred: Vec<String>,
        upsert: bool,
        checksum: bool,
        tier: &str,
    ) -> PyResult<()> {
        let opts = raise(
            py,
            put_options(replicas, pin, persistence, strategy, preferred, upsert, checksum, tier),
        )?;
        let s = raise(py, live(&self.slot))?;
        let r = Region::resolve(src, size, false)?;
        raise(
            py,
            runtime::call(py, "put", s.call_timeout, async {
                s.client.put_from(key, r.addr, r.len, &opts).await.map_err(Failure::from)
            }),
        )
    }

    /// Zero-copy puts of many objects; one result per key.
    #[pyo3(signature = (keys, srcs, sizes=None, *, replicas=1, pin="none", persistence="none",
        strategy="random", preferred=Vec::new(), upsert=false, checksum=false, tier="dram"))]
    #[allow(clippy::too_many_arguments)]
    fn put_from_batch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        srcs: &Bound<'py, PyAny>,
        sizes: Option<Vec<u64>>,
        replicas: u8,
        pin: &str,
        persistence: &str,
        strategy: &str,
        preferred: Vec<String>,
        upsert: bool,
        checksum: bool,
        tier: &str,
    ) -> PyResult<Bound<'py, PyList>> {
        let opts = raise(
            py,
            put_options(replicas, pin, persistence, strategy, preferred, upsert, checksum, tier),
        )?;
        let s = raise(py, live(&self.slot))?;
        let rs = regions(srcs, sizes, keys.len(), false)?;
        let items: Vec<PutFrom> = keys
            .iter()
            .zip(&rs)
            .map(|(k, r)| PutFrom { key: k, addr: r.addr, len: r.len })
            .collect();
        let r = runtime::call(py, "put", s.call_timeout, async {
            Ok(s.client.put_from_batch(&items, &opts).await)
        });
        let r = match r {
            Ok(v) => v.into_iter().map(|r| r.map_err(Failure::from)).collect(),
            Err(f) => vec![Err(f); keys.len()],
        };
        put_results(py, r)
    }

    /// An object's bytes; raises `NotFoundError` (a `KeyError`) when it is missing.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let s = raise(py, live(&self.slot))?;
        let got = raise(
            py,
            runtime::call(py, "get", s.call_timeout, async {
                only("get", get_bytes(&s.client, &[key]).await)
            }),
        )?;
        Ok(bytes_of_got(py, got))
    }

    /// Many objects' bytes: `bytes`, `None` for a missing key, or the exception instance.
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyList>> {
        let s = raise(py, live(&self.slot))?;
        let got = runtime::call(py, "get", s.call_timeout, async {
            Ok(get_bytes(&s.client, &keys).await)
        });
        let items: Vec<Py<PyAny>> = match got {
            Ok(v) => v
                .into_iter()
                .map(|r| match r.map_err(Failure::from) {
                    Ok(b) => bytes_of_got(py, b).into_any().unbind(),
                    Err(f) if f.is_not_found() => py.None(),
                    Err(f) => f.to_pyobject(py),
                })
                .collect(),
            Err(f) => keys.iter().map(|_| f.to_pyobject(py)).collect(),
        };
        PyList::new(py, items)
    }

    /// Reads an object into registered memory (object, or address with `size`); returns its size.
    #[pyo3(signature = (key, dst, size=None))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: &str,
        dst: &Bound<'_, PyAny>,
        size: Option<u64>,
    ) -> PyResult<u64> {
        let s = raise(py, live(&self.slot))?;
        let r = Region::resolve(dst, size, true)?;
        raise(
            py,
            runtime::call(py, "get", s.call_timeout, async {
                s.client.get_into(key, r.addr, r.len).await.map_err(Failure::from)
            }),
        )
    }

    /// Zero-copy reads of many objects: each item is the size read or the exception instance.
    #[pyo3(signature = (keys, dsts, sizes=None))]
    fn get_into_batch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        dsts: &Bound<'py, PyAny>,
        sizes: Option<Vec<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let s = raise(py, live(&self.slot))?;
        let rs = regions(dsts, sizes, keys.len(), true)?;
        let items: Vec<GetInto> = keys
            .iter()
            .zip(&rs)
            .map(|(k, r)| GetInto { key: k, addr: r.addr, cap: r.len })
            .collect();
        let got = runtime::call(py, "get", s.call_timeout, async {
            Ok(s.client.get_into_batch(&items).await)
        });
        let out: Vec<Py<PyAny>> = match got {
            Ok(v) => v
                .into_iter()
                .map(|r| match r {
                    Ok(n) => {
                        n.into_pyobject(py).map_or_else(|e| match e {}, |o| o.into_any().unbind())
                    }
                    Err(e) => Failure::from(e).to_pyobject(py),
                })
                .collect(),
            Err(f) => keys.iter().map(|_| f.to_pyobject(py)).collect(),
        };
        PyList::new(py, out)
    }

    /// Registers memory for the zero-copy calls: a buffer-protocol object (kept exported, so
    /// it cannot move, until `unregister`) or a raw address with `size` (the caller keeps it
    /// valid). Returns the address.
    #[pyo3(signature = (buf, size=None))]
    fn register(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, size: Option<u64>) -> PyResult<u64> {
        let s = raise(py, live(&self.slot))?;
        let r = Region::resolve(buf, size, true).or_else(|_| Region::resolve(buf, size, false))?;
        if r.len == 0 {
            return Err(Failure::invalid("cannot register an empty buffer").to_pyerr(py));
        }
        // SAFETY: an exported object's memory stays valid while `r.view` is kept in `regs`
        // (until unregister); a raw address is the caller's promise, as in the reference API.
        let done = unsafe { s.client.engine().register_memory(r.addr, r.len, false) };
        raise(py, done.map_err(|e| Failure::invalid(format!("register: {e}"))))?;
        self.regs.lock().unwrap_or_else(|e| e.into_inner()).insert(r.addr, r.view);
        Ok(r.addr)
    }

    /// Unregisters memory registered with `register` (by object or by address).
    fn unregister(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = raise(py, live(&self.slot))?;
        let addr = match buf.extract::<u64>() {
            Ok(a) => a,
            Err(_) => View::new(buf, false)?.addr(),
        };
        let done = s.client.engine().unregister(addr);
        raise(py, done.map_err(|e| Failure::invalid(format!("unregister: {e}"))))?;
        self.regs.lock().unwrap_or_else(|e| e.into_inner()).remove(&addr);
        Ok(())
    }

    /// Whether a key exists (grants a read lease when it does).
    fn exists(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let s = raise(py, live(&self.slot))?;
        raise(
            py,
            runtime::call(py, "exists", s.call_timeout, async {
                s.client.exists(key).await.map_err(Failure::from)
            }),
        )
    }

    fn exists_batch(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<bool>> {
        let s = raise(py, live(&self.slot))?;
        raise(
            py,
            runtime::call(py, "exists", s.call_timeout, async {
                s.client
                    .exists_batch(&keys)
                    .await
                    .into_iter()
                    .collect::<Result<Vec<bool>, _>>()
                    .map_err(Failure::from)
            }),
        )
    }

    /// Renames an object (a metadata operation: its bytes stay where they are) and returns
    /// its new version. With `replace` (the default, POSIX rename) an object under `dst` is
    /// replaced, even while readers hold it (they keep its bytes until their lease ends);
    /// without, an existing `dst` raises `AlreadyExistsError`.
    #[pyo3(signature = (src, dst, *, replace=true))]
    fn rename(&self, py: Python<'_>, src: &str, dst: &str, replace: bool) -> PyResult<u64> {
        let s = raise(py, live(&self.slot))?;
        let mode = if replace { RenameMode::Replace } else { RenameMode::NoReplace };
        raise(
            py,
            runtime::call(py, "rename", s.call_timeout, async {
                s.client.rename(src, dst, mode).await.map_err(Failure::from)
            }),
        )
    }

    /// Removes an object as POSIX unlink does: at once, even while a read lease protects it
    /// (readers keep its bytes until the lease ends); a hard-pinned object raises.
    fn unlink(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        let s = raise(py, live(&self.slot))?;
        raise(
            py,
            runtime::call(py, "unlink", s.call_timeout, async {
                s.client.unlink(key).await.map_err(Failure::from)
            }),
        )
    }

    /// Removes a key; a read lease or a hard pin refuses it unless `force`.
    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> PyResult<()> {
        let s = raise(py, live(&self.slot))?;
        raise(
            py,
            runtime::call(py, "remove", s.call_timeout, async {
                s.client.remove(key, force).await.map_err(Failure::from)
            }),
        )
    }

    #[pyo3(signature = (keys, force=false))]
    fn remove_batch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        force: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let s = raise(py, live(&self.slot))?;
        let r = runtime::call(py, "remove", s.call_timeout, async {
            Ok(s.client.remove_batch(&keys, force).await)
        });
        let r = match r {
            Ok(v) => v.into_iter().map(|r| r.map_err(Failure::from)).collect(),
            Err(f) => vec![Err(f); keys.len()],
        };
        put_results(py, r)
    }

    /// Removes every key matching a regular expression; returns the counts.
    #[pyo3(signature = (pattern, force=false))]
    fn remove_regex<'py>(
        &self,
        py: Python<'py>,
        pattern: &str,
        force: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = raise(py, live(&self.slot))?;
        let c = raise(
            py,
            runtime::call(py, "remove", s.call_timeout, async {
                s.client.remove_regex(pattern, force).await.map_err(Failure::from)
            }),
        )?;
        counts(py, c)
    }

    /// Removes every object (leased and hard-pinned ones only with `force`).
    #[pyo3(signature = (force=false))]
    fn remove_all<'py>(&self, py: Python<'py>, force: bool) -> PyResult<Bound<'py, PyDict>> {
        let s = raise(py, live(&self.slot))?;
        let c = raise(
            py,
            runtime::call(py, "remove", s.call_timeout, async {
                s.client.remove_all(force).await.map_err(Failure::from)
            }),
        )?;
        counts(py, c)
    }

    /// One page of keys under `prefix`: `([(key, size), ...], next_start_after or None)`.
    #[pyo3(signature = (prefix="", start_after=None, limit=1000))]
    fn list(
        &self,
        py: Python<'_>,
        prefix: &str,
        start_after: Option<String>,
        limit: u32,
    ) -> PyResult<ListPage> {
        let s = raise(py, live(&self.slot))?;
        let page = raise(
            py,
            runtime::call(py, "list", s.call_timeout, async {
                s.client.list(prefix, start_after.as_deref(), limit).await.map_err(Failure::from)
            }),
        )?;
        Ok((page.entries.into_iter().map(|e| (e.key, e.size)).collect(), page.next_start_after))
    }

    /// What the master knows of an object (no lease is granted).
    fn stat<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyDict>> {
        let s = raise(py, live(&self.slot))?;
        let v = raise(
            py,
            runtime::call(py, "stat", s.call_timeout, async {
                s.client.stat(key).await.map_err(Failure::from)
            }),
        )?;
        let d = PyDict::new(py);
        d.set_item("size", v.size)?;
        d.set_item("version", v.version)?;
        d.set_item("persistence", format!("{:?}", v.persistence).to_lowercase())?;
        d.set_item("pin", format!("{:?}", v.pin).to_lowercase())?;
        d.set_item("lease_end_ms", v.lease_end_ms)?;
        d.set_item(
            "checksum",
            v.checksum.map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>()),
        )?;
        let reps = PyList::empty(py);
        for r in &v.replicas {
            let rd = PyDict::new(py);
            rd.set_item("tier", format!("{:?}", r.tier).to_lowercase())?;
            rd.set_item("endpoint", &r.endpoint)?;
            rd.set_item("node", r.node)?;
            rd.set_item("len", r.len)?;
            reps.append(rd)?;
        }
        d.set_item("replicas", reps)?;
        Ok(d)
    }

    /// Starts a job the master owns that persists every object under `prefix` to the object
    /// store (`move`: then drops their pool copies, freeing the pool). Returns the job's id;
    /// the job runs on if this process goes (`job(id)` follows it, `kvfs jobs` too).
    #[pyo3(signature = (prefix, r#move=false, concurrency=8, rate=0))]
    fn offload(
        &self,
        py: Python<'_>,
        prefix: &str,
        r#move: bool,
        concurrency: u32,
        rate: u64,
    ) -> PyResult<u64> {
        self.start_job(py, JobKind::Offload { evict: r#move }, prefix, concurrency, rate)
    }

    /// Starts a job the master owns that loads every object under `prefix` that no memory
    /// replica holds back into DRAM (warming the pool). Returns the job's id.
    #[pyo3(signature = (prefix, concurrency=8, rate=0))]
    fn restore(&self, py: Python<'_>, prefix: &str, concurrency: u32, rate: u64) -> PyResult<u64> {
        self.start_job(py, JobKind::Restore, prefix, concurrency, rate)
    }

    /// A job's status: `{id, kind, prefix, state, objects_total, objects_done, bytes_total,
    /// bytes_done, moved, already, gone, evicted, kept, failed, resumed, errors, started_ms,
    /// updated_ms, finished_ms}`; `state` is `running`, `done`, `cancelled` or `failed`.
    fn job<'py>(&self, py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyAny>> {
        let s = raise(py, live(&self.slot))?;
        let st = raise(
            py,
            runtime::call(py, "job", s.call_timeout, async {
                s.client.job(id).await.map_err(Failure::from)
            }),
        )?;
        job_dict(py, &st)
    }

    /// Every job the master knows (of this client's tenant), running ones first.
    fn jobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let s = raise(py, live(&self.slot))?;
        let v = raise(
            py,
            runtime::call(py, "jobs", s.call_timeout, async {
                s.client.jobs().await.map_err(Failure::from)
            }),
        )?;
        let out = PyList::empty(py);
        for st in &v {
            out.append(job_dict(py, st)?)?;
        }
        Ok(out)
    }

    /// Stops a running job after the objects in flight; its status.
    fn cancel_job<'py>(&self, py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyAny>> {
        let s = raise(py, live(&self.slot))?;
        let st = raise(
            py,
            runtime::call(py, "cancel_job", s.call_timeout, async {
                s.client.job_cancel(id).await.map_err(Failure::from)
            }),
        )?;
        job_dict(py, &st)
    }

    /// Leaves the cluster (the embedded segment's objects are gone); idempotent.
    fn close(&self, py: Python<'_>) {
        self.regs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        close_slot(py, &self.slot);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }
}

impl Drop for PyClient {
    fn drop(&mut self) {
        drop_session(self.slot.get_mut().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// Drops a session that was never closed, inside the runtime's context and without talking to
/// the master (a garbage-collected client must not block): an embedded node then expires on
/// the master after its TTL instead of leaving at once.
pub fn drop_session(s: Option<Arc<Session>>) {
    if let Some(s) = s
        && let Ok(rt) = runtime::runtime()
    {
        let _in_runtime = rt.enter();
        drop(s);
    }
}

/// A new, uninitialised `bytes` object of `size` bytes for a get to fill in place (huge pages
/// asked for and pages faulted in before the transfer: PyO3's `new_with` would zero it first,
/// a second pass over memory that is all page faults when fresh), and its buffer's address;
/// `None` when CPython cannot allocate it (the get then stages). Called with the GIL released:
/// it attaches for the allocation only.
pub fn new_bytes_for(size: u64) -> Option<(u64, Py<PyBytes>)> {
    let len = pyo3::ffi::Py_ssize_t::try_from(size).ok()?;
    Python::attach(|py| {
        // SAFETY: a NULL source asks CPython for an uninitialised bytes object of `len` bytes;
        // it returns a new reference or NULL with an exception set.
        let raw = unsafe { pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
        if raw.is_null() {
            let _ = PyErr::take(py);
            return None;
        }
        // SAFETY: `raw` is a live bytes object we own; its buffer holds `len` bytes.
        let addr = unsafe { pyo3::ffi::PyBytes_AsString(raw) } as u64;
        // SAFETY: `raw` is a new reference; nobody else sees the object until the get returns
        // it, so the engine may fill its buffer.
        let b: Bound<'_, PyBytes> = unsafe { Bound::from_owned_ptr(py, raw).cast_into_unchecked() };
        Some((addr, b.unbind()))
    })
    .inspect(|&(addr, _)| {
        // Outside the GIL: faulting in tens of MiB takes milliseconds.
        kvfs_client::advise_huge_pages(addr as usize, size as usize);
        kvfs_client::prefault(addr as usize, size as usize);
    })
}

/// What a get of bytes gives: a staging buffer to copy once, or the filled bytes object.
pub type GotBytes = kvfs_client::Fetched<Py<PyBytes>>;

/// Gets objects as `bytes`: large ones are read straight into new bytes objects (no copy
/// after the transfer), small ones through staging.
pub async fn get_bytes<K: AsRef<str>>(
    client: &kvfs_client::Client,
    keys: &[K],
) -> Vec<kvfs_client::Result<GotBytes>> {
    client.get_batch_lent(keys, new_bytes_for).await
}

/// The one result of a one-item batch call.
pub fn only<T>(op: &'static str, mut v: Vec<kvfs_client::Result<T>>) -> Result<T, Failure> {
    let r = v.pop().unwrap_or_else(|| {
        Err(kvfs_client::Error::new(kvfs_client::ErrorKind::Internal, op, "no result"))
    });
    r.map_err(Failure::from)
}

/// The `bytes` of a get.
pub fn bytes_of_got<'py>(py: Python<'py>, got: GotBytes) -> Bound<'py, PyBytes> {
    match got {
        kvfs_client::Fetched::Staged(b) => bytes_of(py, &b),
        kvfs_client::Fetched::Lent(b, _) => b.clone_ref(py).into_bound(py),
    }
}

/// A keeper for each value of a put: the export that keeps its bytes valid while the engine
/// writes them straight from the caller's object (see `Client::put_batch_lent`).
pub fn keepers(views: &[Arc<View>]) -> impl Fn(usize) -> Option<kvfs_client::Keeper> + '_ {
    move |i| views.get(i).map(|v| v.clone() as kvfs_client::Keeper)
}

pub fn bytes_of<'py>(py: Python<'py>, b: &[u8]) -> Bound<'py, PyBytes> {
    let n = b.len();
    let Ok(len) = pyo3::ffi::Py_ssize_t::try_from(n) else { return PyBytes::new(py, b) };
    // SAFETY: a NULL source asks CPython for an uninitialised bytes object of `len` bytes; it
    // returns a new reference or NULL with an exception set.
    let raw = unsafe { pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
    if raw.is_null() {
        let _ = PyErr::take(py);
        return PyBytes::new(py, b);
    }
    // SAFETY: `raw` is a live bytes object we own; its buffer holds `n` bytes (plus a NUL).
    let dst = unsafe { pyo3::ffi::PyBytes_AsString(raw) } as usize;
    let fill = move || {
        kvfs_client::advise_huge_pages(dst, n);
        // SAFETY: `dst` has room for `n` bytes, distinct from `b`; nobody else sees the object
        // before this returns.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst as *mut u8, n) };
    };
    if n >= 1 << 20 {
        py.detach(fill)
    } else {
        fill()
    }
    // SAFETY: `raw` is a new, fully initialised bytes object; ownership moves to the Bound.
    unsafe { Bound::from_owned_ptr(py, raw).cast_into_unchecked() }
}

fn counts(py: Python<'_>, c: kvfs_client::RemoveCounts) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("removed", c.removed)?;
    d.set_item("skipped_leased", c.skipped_leased)?;
    d.set_item("skipped_pinned", c.skipped_pinned)?;
    Ok(d)
}

impl PyClient {
    fn start_job(
        &self,
        py: Python<'_>,
        kind: JobKind,
        prefix: &str,
        concurrency: u32,
        rate: u64,
    ) -> PyResult<u64> {
        let s = raise(py, live(&self.slot))?;
        let spec =
            JobSpec { kind, prefix: prefix.to_string(), concurrency, rate_bytes_per_s: rate };
        let st = raise(
            py,
            runtime::call(py, "job_start", s.call_timeout, async {
                s.client.job_start(spec).await.map_err(Failure::from)
            }),
        )?;
        Ok(st.id)
    }
}

/// A job's status as a Python dict.
fn job_dict<'py>(py: Python<'py>, s: &JobStatus) -> PyResult<Bound<'py, PyAny>> {
    let d = PyDict::new(py);
    d.set_item("id", s.id)?;
    d.set_item("kind", s.spec.kind.name())?;
    d.set_item("prefix", &s.spec.prefix)?;
    d.set_item("concurrency", s.spec.concurrency)?;
    d.set_item("rate", s.spec.rate_bytes_per_s)?;
    d.set_item("state", s.state.name())?;
    for (k, v) in [
        ("objects_total", s.objects_total),
        ("objects_done", s.objects_done),
        ("bytes_total", s.bytes_total),
        ("bytes_done", s.bytes_done),
        ("moved", s.moved),
        ("already", s.already),
        ("gone", s.gone),
        ("evicted", s.evicted),
        ("kept", s.kept),
        ("failed", s.failed),
        ("resumed", u64::from(s.resumed)),
        ("started_ms", s.started_ms),
        ("updated_ms", s.updated_ms),
        ("finished_ms", s.finished_ms),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("errors", PyList::new(py, &s.errors)?)?;
    Ok(d.into_any())
}
