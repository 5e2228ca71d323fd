//! kvfs-python: the extension module `kvfs._native` behind the `kvfs` Python package.
//!
//! Two faces over one mechanism. `Client` is the native, Pythonic API (exceptions, keyword
//! options, buffer-protocol objects); `MooncakeCore` answers the reference store's calls with
//! its return codes and is wrapped by the pure-Python `kvfs.mooncake.MooncakeDistributedStore`
//! (and re-exported as `mooncake.store`). Both hold a [`session::Session`]: a kvfs client and,
//! when asked, an embedded node contributing this process's DRAM.
//!
//! Invariants: every call that does I/O releases the GIL and runs on the process's one tokio
//! runtime under a deadline ([`runtime::call`]); no call can hang past its deadline. Python
//! memory reaches the engine only through buffer exports held for the call or registration
//! ([`memory`]) or through raw addresses the caller vouches for, as in the reference API.
//!
//! A third face, `TransferEngine` (`engine`), is the reference's `mooncake.engine` on the
//! kvfs Transfer Engine: raw reads and writes between processes' registered memory.
//!
//! Tensor calls are pure Python over `MooncakeCore` (`py/kvfs/_tensor.py`, the reference's
//! 304-byte tensor header). Not handled here: the reference's session, replica-task and
//! segment management calls (docs/mooncake-compat.md lists them), and CUDA memory.

mod client;
mod engine;
mod ep;
mod errors;
mod fastpath;
mod memory;
mod pg;
mod reshard;
mod runtime;
mod session;
mod store;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Routes the extension's `tracing` output to stderr, filtered by `KVFS_LOG` (default `warn`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // A host application may have installed its own subscriber: keep it.
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    kvfs_client::keep_freed_buffers();
    // An embedded node serves connections with two descriptors each (see the crate's note).
    let _ = kvfs_transfer::raise_open_files_limit();
    m.add_class::<client::PyClient>()?;
    m.add_class::<store::MooncakeCore>()?;
    m.add_class::<memory::BufferHandle>()?;
    m.add_class::<engine::TransferEngine>()?;
    m.add_class::<engine::TransferNotify>()?;
    m.add_class::<fastpath::FastPath>()?;
    m.add_class::<pg::PgGroup>()?;
    m.add_class::<pg::PgCoordinator>()?;
    m.add_class::<ep::EpHandle>()?;
    m.add_function(wrap_pyfunction!(ep::ep_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(ep::ep_combine, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard_fragments, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard_plan, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard_store, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard_commit, m)?)?;
    m.add_function(wrap_pyfunction!(reshard::reshard_load, m)?)?;
    m.add_class::<fastpath::FastPathBuffer>()?;
    m.add_function(wrap_pyfunction!(fastpath::fastpath_error, m)?)?;
    let py = m.py();
    let codes = PyDict::new(py);
    for &(name, value) in errors::code::ALL {
        codes.set_item(name, value)?;
    }
    m.add("ERROR_CODES", codes)?;
    let kinds = PyDict::new(py);
    for &k in errors::KINDS {
        kinds.set_item(errors::kind_name(k), errors::kind_code(k))?;
    }
    kinds.set_item("timeout", errors::code::RPC_TIMEOUT)?;
    kinds.set_item("not_connected", errors::code::INVALID_PARAMS)?;
    m.add("KIND_CODES", kinds)?;
    m.add("FASTPATH_KEY_AREA_BYTES_DEFAULT", fastpath::KEY_AREA_BYTES_DEFAULT)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Benchmarks print it: figures taken through a debug build are not kvfs's.
    m.add("BUILD_PROFILE", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    Ok(())
}
