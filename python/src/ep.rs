//! `kvfs.ep`'s native half: kvfs-ep's dispatch and combine on a `PgGroup`, taking
//! buffer-protocol objects (numpy arrays; torch CPU tensors through `.numpy()`).

use kvfs_ep::{EpConfig, Handle};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::memory::View;
use crate::pg::{PgGroup, dtype, run};

#[pyclass(module = "kvfs._native", name = "EpHandle", frozen)]
pub struct EpHandle {
    h: Handle,
}

#[pymethods]
impl EpHandle {
    /// The PG epoch the dispatch ran at.
    #[getter]
    fn epoch(&self) -> u64 {
        self.h.epoch
    }

    /// The active slots the dispatch exchanged with.
    #[getter]
    fn slots(&self) -> Vec<u32> {
        self.h.slots.clone()
    }

    /// Tokens this rank dispatched.
    #[getter]
    fn tokens(&self) -> usize {
        self.h.tokens
    }

    /// Per local expert, the (source slot, source token) of each filled row.
    #[getter]
    fn layout(&self) -> Vec<Vec<(u32, u32)>> {
        self.h.layout.clone()
    }

    /// Bytes this rank put on the wire for the dispatch and its combine.
    fn wire_bytes(&self, me: u32) -> u64 {
        kvfs_ep::wire_bytes(&self.h, me)
    }
}

/// A dispatch's counts per local expert, handle and updated mask.
type Dispatched = (Vec<u32>, EpHandle, Vec<bool>);

fn i64s(v: &View) -> PyResult<Vec<i64>> {
    if !v.len().is_multiple_of(8) {
        return Err(pyo3::exceptions::PyValueError::new_err("topk_idx must be int64"));
    }
    Ok(v.bytes().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect())
}

/// Dispatches `x` (`[T, H]` rows of `dtype_name`) to the experts `topk_idx` (`[T, K]`
/// int64, -1 masks) chooses, into `out` (the `[E_local, R*M, H]` rows, zeroed, writable).
/// Returns (counts per local expert, the handle, the updated active mask).
#[pyfunction]
#[pyo3(signature = (group, x, topk_idx, dtype_name, num_experts, num_ranks, hidden, topk, max_tokens, active, out, weights=None))]
#[allow(clippy::too_many_arguments)]
pub fn ep_dispatch<'py>(
    py: Python<'py>,
    group: &PgGroup,
    x: &Bound<'_, PyAny>,
    topk_idx: &Bound<'_, PyAny>,
    dtype_name: &str,
    num_experts: u32,
    num_ranks: u32,
    hidden: usize,
    topk: usize,
    max_tokens: usize,
    mut active: Vec<bool>,
    out: &Bound<'_, PyAny>,
    weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<Dispatched> {
    let cfg = EpConfig {
        num_experts,
        num_ranks,
        hidden,
        topk,
        max_tokens,
        dtype: dtype(py, dtype_name)?,
    };
    let xv = View::new(x, false)?;
    let idx = i64s(&View::new(topk_idx, false)?)?;
    let w = weights.map(|w| f32s(&View::new(w, false)?)).transpose()?;
    let g = group.g.clone();
    let ov = View::new(out, true)?;
    let dst = crate::pg::bytes_mut(&ov);
    let (counts, h) = run(py, async {
        kvfs_ep::dispatch_into(&g, &cfg, xv.bytes(), &idx, w.as_deref(), &mut active, dst).await
    })?;
    Ok((counts, EpHandle { h }, active))
}

fn f32s(v: &View) -> PyResult<Vec<f32>> {
    if !v.len().is_multiple_of(4) {
        return Err(pyo3::exceptions::PyValueError::new_err("topk_weights must be float32"));
    }
    Ok(v.bytes().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect())
}

/// Combines the experts' outputs `y` (the dispatch's layout) with `weights` (`[T, K]`
/// float32; `None` when the dispatch carried them) into this rank's `[T, H]` rows (bytes of
/// the dispatch's dtype); returns them and the updated active mask.
#[pyfunction]
#[pyo3(signature = (group, y, weights, handle, active))]
pub fn ep_combine<'py>(
    py: Python<'py>,
    group: &PgGroup,
    y: &Bound<'_, PyAny>,
    weights: Option<&Bound<'_, PyAny>>,
    handle: &EpHandle,
    mut active: Vec<bool>,
) -> PyResult<(Bound<'py, PyBytes>, Vec<bool>)> {
    let yv = View::new(y, false)?;
    let w = weights.map(|w| f32s(&View::new(w, false)?)).transpose()?;
    let g = group.g.clone();
    let h = &handle.h;
    let out =
        run(py, async { kvfs_ep::combine(&g, yv.bytes(), w.as_deref(), &mut active, h).await })?;
    Ok((PyBytes::new(py, &out), active))
}
