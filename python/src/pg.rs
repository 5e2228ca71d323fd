//! `kvfs.pg`'s native half: a process-group member (`PgGroup`) and a coordinator
//! (`PgCoordinator`) from kvfs-pg, taking buffer-protocol objects (numpy arrays, torch CPU
//! tensors through `.numpy()`, bytearrays) with an explicit dtype name.
//!
//! Every call releases the GIL and runs on the process's runtime; kvfs-pg bounds each
//! operation by its own deadline. Errors become `kvfs.pg.PgError` with the kvfs-pg kind name.

use kvfs_pg::{Coordinator, CoordinatorConfig, DType, Group, PgConfig, ReduceOp};
use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::memory::View;
use crate::runtime;

fn kind_name(k: kvfs_pg::ErrorKind) -> &'static str {
    use kvfs_pg::ErrorKind as K;
    match k {
        K::InvalidArgument => "invalid_argument",
        K::Mismatch => "mismatch",
        K::UnknownSlot => "unknown_slot",
        K::PeerFailed => "peer_failed",
        K::StaleEpoch => "stale_epoch",
        K::Timeout => "timeout",
        K::Refused => "refused",
        K::Closed => "closed",
        K::Busy => "busy",
        _ => "transfer",
    }
}

pub(crate) fn to_pyerr(py: Python<'_>, e: &kvfs_pg::Error) -> PyErr {
    let made = py.import("kvfs.pg").and_then(|m| {
        m.getattr("_error")?.call1((kind_name(e.kind()), e.to_string(), e.kind().is_retryable()))
    });
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

/// Runs a kvfs-pg future with the GIL released.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    fut: impl std::future::Future<Output = kvfs_pg::Result<T>> + Send,
) -> PyResult<T> {
    let rt = runtime::runtime().map_err(|f| f.to_pyerr(py))?;
    let r = py.detach(|| rt.block_on(fut));
    r.map_err(|e| to_pyerr(py, &e))
}

pub(crate) fn dtype(py: Python<'_>, name: &str) -> PyResult<DType> {
    DType::parse(name).map_err(|e| to_pyerr(py, &e))
}

fn op(py: Python<'_>, name: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(name).map_err(|e| to_pyerr(py, &e))
}

/// The bytes of a writable export.
#[allow(clippy::mut_from_ref)] // the export, not the View, owns the memory (see SAFETY)
pub(crate) fn bytes_mut(v: &View) -> &mut [u8] {
    if v.len() == 0 {
        return &mut [];
    }
    // SAFETY: the export is writable (asked for with PyBUF_WRITABLE) and valid while `v` lives;
    // callers hold `v` on their stack for the whole call and never hand out a second slice of
    // the same export.
    unsafe { std::slice::from_raw_parts_mut(v.addr() as *mut u8, v.len()) }
}

fn overlaps(a: &View, b: &View) -> bool {
    let (a0, a1, b0, b1) =
        (a.addr(), a.addr() + a.len() as u64, b.addr(), b.addr() + b.len() as u64);
    a.len() > 0 && b.len() > 0 && a0 < b1 && b0 < a1
}

/// An input export's bytes, copied when they overlap the output (in-place calls).
fn input_of<'a>(inp: &'a View, out: Option<&View>) -> Cow<'a, [u8]> {
    if out.is_some_and(|o| overlaps(inp, o)) {
        Cow::Owned(inp.bytes().to_vec())
    } else {
        Cow::Borrowed(inp.bytes())
    }
}

#[pyclass(module = "kvfs._native", name = "PgCoordinator", frozen)]
pub struct PgCoordinator {
    c: Coordinator,
}

#[pymethods]
impl PgCoordinator {
    #[new]
    #[pyo3(signature = (world, group = "default".to_string(), listen = "127.0.0.1:0".to_string(), max_group_size = kvfs_pg::GROUP_SIZE_LIMIT, heartbeat_ms = 200, failure_timeout_ms = 3000))]
    fn new(
        py: Python<'_>,
        world: u32,
        group: String,
        listen: String,
        max_group_size: u32,
        heartbeat_ms: u64,
        failure_timeout_ms: u64,
    ) -> PyResult<Self> {
        let mut cfg = CoordinatorConfig::new(&group, world);
        cfg.listen = listen.parse().map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!("listen {listen}: {e}"))
        })?;
        cfg.max_group_size = max_group_size;
        cfg.heartbeat_ms = heartbeat_ms;
        cfg.failure_timeout_ms = failure_timeout_ms;
        cfg.reconcile_timeout_ms = failure_timeout_ms * 2;
        let c = run(py, Coordinator::start(cfg))?;
        Ok(PgCoordinator { c })
    }

    /// The address members join.
    #[getter]
    fn addr(&self) -> String {
        self.c.addr()
    }

    /// Active slots, epoch and world of the current view.
    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        view_dict(py, &self.c.view())
    }

    /// Slots with a process waiting for activation.
    fn pending(&self) -> Vec<u32> {
        self.c.pending()
    }
}

fn view_dict<'py>(py: Python<'py>, v: &kvfs_pg::View) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("epoch", v.epoch)?;
    d.set_item("world", v.world)?;
    d.set_item("active", v.slots())?;
    d.set_item("removed", v.removed.clone())?;
    Ok(d)
}

#[pyclass(module = "kvfs._native", name = "PgGroup", frozen)]
pub struct PgGroup {
    pub(crate) g: Group,
}

#[pymethods]
impl PgGroup {
    /// Joins the group at `coordinator` in `slot` (blocks until the group forms, or until the
    /// active members activate a late joiner).
    #[new]
    #[pyo3(signature = (coordinator, slot, world, group = "default".to_string(), listen = "127.0.0.1:0".to_string(), staging_bytes = 16 << 20, inline_bytes_max = 32 << 10, op_timeout_ms = 30_000, join_timeout_ms = 60_000, tcp_only = false, wait_active = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        coordinator: String,
        slot: u32,
        world: u32,
        group: String,
        listen: String,
        staging_bytes: usize,
        inline_bytes_max: usize,
        op_timeout_ms: u64,
        join_timeout_ms: u64,
        tcp_only: bool,
        wait_active: bool,
    ) -> PyResult<Self> {
        let mut cfg = PgConfig {
            group,
            staging_bytes,
            inline_bytes_max,
            op_timeout_ms,
            join_timeout_ms,
            ..PgConfig::default()
        };
        cfg.listen = listen.parse().map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!("listen {listen}: {e}"))
        })?;
        if tcp_only {
            cfg.transports = kvfs_transfer::Transports::tcp_only();
        }
        let g = run(py, Group::join_with(&coordinator, slot, world, cfg, wait_active))?;
        Ok(PgGroup { g })
    }

    #[getter]
    fn slot(&self) -> u32 {
        self.g.slot()
    }

    fn view<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        view_dict(py, &self.g.view())
    }

    fn is_pending(&self) -> bool {
        self.g.is_pending()
    }

    /// Waits until the active members activate this late joiner.
    fn wait_active<'py>(&self, py: Python<'py>, timeout_ms: u64) -> PyResult<Bound<'py, PyDict>> {
        let v = run(py, self.g.wait_active(std::time::Duration::from_millis(timeout_ms)))?;
        view_dict(py, &v)
    }

    fn is_member(&self) -> bool {
        self.g.is_member()
    }

    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.g.counters();
        let d = PyDict::new(py);
        d.set_item("stale_refused", c.stale_refused)?;
        d.set_item("restarted", c.restarted)?;
        d.set_item("dropped", c.dropped)?;
        d.set_item("suspects_reported", c.suspects_reported)?;
        Ok(d)
    }

    fn allreduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<()> {
        let (dt, o) = (dtype(py, dtype_name)?, op(py, op_name)?);
        let v = View::new(buf, true)?;
        run(py, self.g.allreduce(bytes_mut(&v), dt, o))
    }

    fn reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype_name: &str,
        op_name: &str,
        root: u32,
    ) -> PyResult<()> {
        let (dt, o) = (dtype(py, dtype_name)?, op(py, op_name)?);
        let v = View::new(buf, true)?;
        run(py, self.g.reduce(bytes_mut(&v), dt, o, root))
    }

    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: u32) -> PyResult<()> {
        let v = View::new(buf, true)?;
        run(py, self.g.broadcast(bytes_mut(&v), root))
    }

    fn allgather(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (i, o) = (View::new(inp, false)?, View::new(out, true)?);
        let input = input_of(&i, Some(&o));
        run(py, self.g.allgather(&input, bytes_mut(&o)))
    }

    fn reduce_scatter(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        dtype_name: &str,
        op_name: &str,
    ) -> PyResult<()> {
        let (dt, op_) = (dtype(py, dtype_name)?, op(py, op_name)?);
        let (i, o) = (View::new(inp, false)?, View::new(out, true)?);
        let input = input_of(&i, Some(&o));
        run(py, self.g.reduce_scatter(&input, bytes_mut(&o), dt, op_))
    }

    #[pyo3(signature = (inp, out, root))]
    fn gather(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        root: u32,
    ) -> PyResult<()> {
        let i = View::new(inp, false)?;
        let o = out.map(|o| View::new(o, true)).transpose()?;
        let input = input_of(&i, o.as_ref());
        run(py, self.g.gather(&input, o.as_ref().map(bytes_mut), root))
    }

    #[pyo3(signature = (inp, out, root))]
    fn scatter(
        &self,
        py: Python<'_>,
        inp: Option<&Bound<'_, PyAny>>,
        out: &Bound<'_, PyAny>,
        root: u32,
    ) -> PyResult<()> {
        let o = View::new(out, true)?;
        let i = inp.map(|i| View::new(i, false)).transpose()?;
        let input = i.as_ref().map(|i| input_of(i, Some(&o)));
        run(py, self.g.scatter(input.as_deref(), bytes_mut(&o), root))
    }

    fn alltoall(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (i, o) = (View::new(inp, false)?, View::new(out, true)?);
        let input = input_of(&i, Some(&o));
        run(py, self.g.alltoall(&input, bytes_mut(&o)))
    }

    /// Counts in bytes.
    fn alltoallv(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        send_counts: Vec<u64>,
        out: &Bound<'_, PyAny>,
        recv_counts: Vec<u64>,
    ) -> PyResult<()> {
        let (i, o) = (View::new(inp, false)?, View::new(out, true)?);
        let input = input_of(&i, Some(&o));
        run(py, self.g.alltoallv(&input, &send_counts, bytes_mut(&o), &recv_counts))
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        run(py, self.g.barrier())
    }

    #[pyo3(signature = (buf, dst, tag = 0))]
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dst: u32, tag: u32) -> PyResult<()> {
        let v = View::new(buf, false)?;
        run(py, self.g.send(v.bytes(), dst, tag))
    }

    #[pyo3(signature = (buf, src, tag = 0))]
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: u32, tag: u32) -> PyResult<()> {
        let v = View::new(buf, true)?;
        run(py, self.g.recv(bytes_mut(&v), src, tag))
    }

    /// Reserves the next message from `src` with `tag`; `recv_posted` takes it later.
    #[pyo3(signature = (src, tag = 0))]
    fn post_recv(&self, py: Python<'_>, src: u32, tag: u32) -> PyResult<u64> {
        self.g.post_recv(src, tag).map_err(|e| to_pyerr(py, &e))
    }

    fn recv_posted(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        src: u32,
        tag: u32,
        ticket: u64,
    ) -> PyResult<()> {
        let v = View::new(buf, true)?;
        run(py, self.g.recv_posted(bytes_mut(&v), src, tag, ticket))
    }

    /// With every other active member: activate pending slots, deactivate active ones.
    #[pyo3(signature = (activate = Vec::new(), deactivate = Vec::new()))]
    fn change<'py>(
        &self,
        py: Python<'py>,
        activate: Vec<u32>,
        deactivate: Vec<u32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let v = run(py, self.g.change(&activate, &deactivate))?;
        view_dict(py, &v)
    }

    /// Slots with a process waiting at the coordinator for activation.
    fn pending(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        run(py, self.g.pending())
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        run(py, async {
            self.g.close().await;
            Ok(())
        })
    }
}
