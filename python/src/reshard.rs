//! `kvfs.reshard`'s native half: planning between layouts, and weights through the pool on a
//! `kvfs.Client`'s session.

use kvfs_reshard::{ErrorKind, Limits, ModelSpec, Placement, pool};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::client::PyClient;
use crate::memory::View;

fn kind_name(k: ErrorKind) -> &'static str {
    match k {
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::CoverageGap => "coverage_gap",
        ErrorKind::Overlap => "overlap",
        ErrorKind::Mismatch => "mismatch",
        ErrorKind::Limit => "limit",
        ErrorKind::StaleGeneration => "stale_generation",
        ErrorKind::PeerFailed => "peer_failed",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Transfer => "transfer",
        ErrorKind::Store => "store",
        ErrorKind::NotFound => "not_found",
        _ => "internal",
    }
}

fn to_pyerr(py: Python<'_>, e: &kvfs_reshard::Error) -> PyErr {
    let made = py
        .import("kvfs.reshard")
        .and_then(|m| m.getattr("_error")?.call1((kind_name(e.kind()), e.to_string())));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

fn placement(py: Python<'_>, spec: &str, layout: &str) -> PyResult<Placement> {
    ModelSpec::from_json(spec).and_then(|m| m.placement(layout)).map_err(|e| to_pyerr(py, &e))
}

/// (tensor, offset, shape) of a fragment.
type FragmentBox = (String, Vec<u64>, Vec<u64>);

/// `[(tensor, offset, shape)]` of `participant`'s fragments under `layout`.
#[pyfunction]
pub fn reshard_fragments(
    py: Python<'_>,
    spec: &str,
    layout: &str,
    participant: u32,
) -> PyResult<Vec<FragmentBox>> {
    let p = placement(py, spec, layout)?;
    if participant >= p.participants {
        let e = kvfs_reshard::Error::new(
            ErrorKind::InvalidArgument,
            "fragments",
            format!("participant {participant} of {}", p.participants),
        );
        return Err(to_pyerr(py, &e));
    }
    Ok(p.tensors
        .iter()
        .flat_map(|t| {
            t.fragments
                .iter()
                .filter(|f| f.participant == participant)
                .map(|f| (t.desc.name.clone(), f.offset.clone(), f.shape.clone()))
        })
        .collect())
}

/// A summary of the plan `src` -> `dst`: regions, segments, bytes, bytes between
/// participants, participants on either side.
#[pyfunction]
pub fn reshard_plan<'py>(
    py: Python<'py>,
    spec: &str,
    src: &str,
    dst: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let (a, b) = (placement(py, spec, src)?, placement(py, spec, dst)?);
    let p = kvfs_reshard::plan(&a, &b, &Limits::default()).map_err(|e| to_pyerr(py, &e))?;
    let d = PyDict::new(py);
    d.set_item("regions", p.regions.len())?;
    d.set_item("segments", p.segments())?;
    d.set_item("bytes", p.bytes())?;
    d.set_item("remote_bytes", p.remote_bytes())?;
    d.set_item("src_participants", a.participants)?;
    d.set_item("dst_participants", b.participants)?;
    Ok(d)
}

/// Stores `participant`'s fragments (`{tensor: buffer}`, each exactly its fragment's bytes)
/// of `model` under `layout`; returns how many went in (one DP replica is stored).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn reshard_store(
    py: Python<'_>,
    client: &PyClient,
    model: &str,
    spec: &str,
    layout: &str,
    participant: u32,
    tensors: &Bound<'_, PyDict>,
) -> PyResult<usize> {
    let p = placement(py, spec, layout)?;
    let mut views = Vec::new();
    for (ti, t) in p.tensors.iter().enumerate() {
        for (fi, _) in t.fragments.iter().enumerate().filter(|(_, f)| f.participant == participant)
        {
            let Some(obj) = tensors.get_item(&t.desc.name)? else {
                let e = kvfs_reshard::Error::new(
                    ErrorKind::InvalidArgument,
                    "store",
                    format!("participant {participant} holds {} but it was not given", t.desc.name),
                );
                return Err(to_pyerr(py, &e));
            };
            views.push((ti as u32, fi as u32, View::new(&obj, false)?));
        }
    }
    let session = client.session(py)?;
    let items: Vec<(u32, u32, &[u8])> = views.iter().map(|(t, f, v)| (*t, *f, v.bytes())).collect();
    let rt = crate::runtime::runtime().map_err(|f| f.to_pyerr(py))?;
    let r = py.detach(|| rt.block_on(pool::store(&session.client, model, &p, &items)));
    r.map_err(|e| to_pyerr(py, &e))
}

/// Records `model`'s layout once every participant stored its fragments.
#[pyfunction]
pub fn reshard_commit(
    py: Python<'_>,
    client: &PyClient,
    model: &str,
    spec: &str,
    layout: &str,
) -> PyResult<()> {
    let p = placement(py, spec, layout)?;
    let session = client.session(py)?;
    let rt = crate::runtime::runtime().map_err(|f| f.to_pyerr(py))?;
    let r = py.detach(|| rt.block_on(pool::store_manifest(&session.client, model, &p)));
    r.map_err(|e| to_pyerr(py, &e))
}

/// `{tensor: bytes}` of `participant`'s fragments under `layout`, from `model` in the pool.
#[pyfunction]
pub fn reshard_load<'py>(
    py: Python<'py>,
    client: &PyClient,
    model: &str,
    spec: &str,
    layout: &str,
    participant: u32,
) -> PyResult<Bound<'py, PyDict>> {
    let p = placement(py, spec, layout)?;
    let session = client.session(py)?;
    let rt = crate::runtime::runtime().map_err(|f| f.to_pyerr(py))?;
    let r = py.detach(|| rt.block_on(pool::load(&session.client, model, &p, participant)));
    let frags = r.map_err(|e| to_pyerr(py, &e))?;
    let d = PyDict::new(py);
    for (ti, _, b) in frags {
        d.set_item(&p.tensors[ti as usize].desc.name, PyBytes::new(py, &b))?;
    }
    Ok(d)
}
