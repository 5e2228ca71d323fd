//! Python memory as the Transfer Engine sees it: buffer-protocol views, raw pointers, and the
//! `BufferHandle` that `get_buffer` returns.
//!
//! Mechanism. A [`View`] holds a `Py_buffer` export of any object that speaks the buffer
//! protocol (bytes, bytearray, memoryview, numpy arrays, mmap) asked for as one C-contiguous
//! run of bytes (`PyBUF_SIMPLE`), so its address and length can be handed to the engine. While
//! a view lives the exporter keeps the memory in place (a bytearray cannot be resized, a numpy
//! array cannot be freed). A zero-copy argument is either such an object or a raw address
//! (`int`) with a size, as the reference API takes them ([`Region::resolve`]).
//!
//! Invariants: a `View` is created and released with the GIL held (`Python::attach` on drop,
//! so dropping one anywhere is safe); its bytes are read or written with the GIL released only
//! while the `View` itself is alive on the calling thread's stack.
//!
//! Host memory for the caller ([`host_alloc`], the reference's `MooncakeHostMemAllocator`): a
//! memfd-backed shared mapping (huge pages with `MC_STORE_USE_HUGEPAGE`, as the reference),
//! faulted in at allocation, recorded in a process-wide table until [`host_free`]. The caller
//! registers it for the zero-copy calls like any other memory.
//!
//! Not handled: strided or non-contiguous arrays are refused (`BufferError` from the exporter);
//! device memory is not reachable (HBM is the tiers crate's business); freeing host memory that
//! is still registered is the caller's error, as with the reference.

use std::collections::HashMap;
use std::os::raw::c_int;
use std::sync::Mutex;

use kvfs_client::StagedBytes;
use kvfs_transfer::{Buffer, BufferOptions};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

/// A contiguous buffer-protocol export of a Python object.
pub struct View {
    raw: Box<ffi::Py_buffer>,
}

// SAFETY: the export is plain memory plus a reference to its owner; it is released under the
// GIL (see Drop), and the bytes are shared with the engine under the documented contract of
// registered memory (as with the reference's register_buffer).
unsafe impl Send for View {}
// SAFETY: as above; `&View` only hands out the address and length.
unsafe impl Sync for View {}

impl View {
    /// Exports `obj` as one contiguous run of bytes; `writable` asks for a writable export.
    pub fn new(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<View> {
        // SAFETY: an all-zero Py_buffer is the documented "empty" value PyObject_GetBuffer fills.
        let mut raw: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags =
            if writable { ffi::PyBUF_SIMPLE | ffi::PyBUF_WRITABLE } else { ffi::PyBUF_SIMPLE };
        // SAFETY: obj is a live object (we hold the GIL through `obj`), raw is writable storage.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags as c_int) };
        if rc != 0 {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                PyBufferError::new_err("object does not export a contiguous buffer")
            }));
        }
        Ok(View { raw })
    }

    pub fn addr(&self) -> u64 {
        self.raw.buf as u64
    }

    pub fn len(&self) -> usize {
        self.raw.len.max(0) as usize
    }

    /// The exported bytes.
    pub fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: the exporter guarantees buf..buf+len is valid while the export is held, which
        // is as long as `self`.
        unsafe { std::slice::from_raw_parts(self.raw.buf as *const u8, self.len()) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // An interpreter that is shutting down cannot be attached to: the export is then left
        // to the process's end (releasing it needs the interpreter).
        let _ = Python::try_attach(|_py| {
            // SAFETY: raw was filled by a successful PyObject_GetBuffer and is released once.
            unsafe { ffi::PyBuffer_Release(&mut *self.raw) }
        });
    }
}

/// A zero-copy argument: an address and a length, and the export that keeps them valid when the
/// caller passed an object instead of a raw pointer.
pub struct Region {
    pub addr: u64,
    pub len: u64,
    pub view: Option<View>,
}

impl Region {
    /// Reads `(obj, size)`: a buffer-protocol object (its whole length, or the first `size`
    /// bytes of it) or an `int` address with a required `size`.
    pub fn resolve(obj: &Bound<'_, PyAny>, size: Option<u64>, writable: bool) -> PyResult<Region> {
        if let Ok(addr) = obj.extract::<u64>() {
            let len =
                size.ok_or_else(|| PyTypeError::new_err("a raw address needs a size (ptr, size)"))?;
            if addr == 0 {
                return Err(PyValueError::new_err("null address"));
            }
            return Ok(Region { addr, len, view: None });
        }
        let view = View::new(obj, writable)?;
        let len = match size {
            Some(s) if s > view.len() as u64 => {
                return Err(PyValueError::new_err(format!(
                    "size {s} is larger than the buffer ({} bytes)",
                    view.len()
                )));
            }
            Some(s) => s,
            None => view.len() as u64,
        };
        Ok(Region { addr: view.addr(), len, view: Some(view) })
    }
}

/// An object's bytes fetched by `get_buffer`: they stay in the client's staging memory (no
/// extra copy) until the handle is dropped, and the handle exports them through the buffer
/// protocol (`memoryview(h)`, `np.asarray(h)`, `bytes(h)`), with `ptr()` and `size()` as the
/// reference's `BufferHandle` has.
#[pyclass(module = "kvfs._native", name = "BufferHandle", frozen)]
pub struct BufferHandle {
    bytes: StagedBytes,
}

impl BufferHandle {
    pub fn new(bytes: StagedBytes) -> BufferHandle {
        BufferHandle { bytes }
    }
}

#[pymethods]
impl BufferHandle {
    /// Address of the first byte.
    fn ptr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    /// Size in bytes.
    fn size(&self) -> usize {
        self.bytes.len()
    }

    fn __len__(&self) -> usize {
        self.bytes.len()
    }

    fn __repr__(&self) -> String {
        format!("BufferHandle(ptr={:#x}, size={})", self.ptr(), self.size())
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let me = slf.get();
            (me.bytes.as_ptr() as *mut std::ffi::c_void, me.bytes.len())
        };
        // SAFETY: the bytes stay valid while the handle lives.
        unsafe { export_buffer(slf.as_any(), view, ptr, len, true, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// Fills a buffer-protocol `view` of `len` bytes at `ptr` owned by `owner` (the export holds a
/// reference to it), for `__getbuffer__`.
///
/// # Safety
/// `view` is the interpreter's storage for the export, and `ptr..ptr+len` must stay valid while
/// `owner` lives.
pub unsafe fn export_buffer(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    ptr: *mut std::ffi::c_void,
    len: usize,
    readonly: bool,
    flags: c_int,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("null view"));
    }
    let len = ffi::Py_ssize_t::try_from(len).map_err(|_| PyBufferError::new_err("too large"))?;
    // SAFETY: per the contract above; the interpreter checks `flags` against `readonly`.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(view, owner.as_ptr(), ptr, len, c_int::from(readonly), flags)
    };
    if rc != 0 {
        return Err(PyErr::take(owner.py())
            .unwrap_or_else(|| PyBufferError::new_err("cannot export the buffer")));
    }
    Ok(())
}

/// Host memory handed out by [`host_alloc`], by address.
static HOST_MEMORY: Mutex<Option<HashMap<u64, Buffer>>> = Mutex::new(None);

/// Allocates `size` bytes of shared host memory (memfd, every page faulted in) and returns its
/// address; it stays mapped until [`host_free`].
pub fn host_alloc(size: u64) -> Result<u64, String> {
    let len = usize::try_from(size).map_err(|_| format!("cannot allocate {size} bytes"))?;
    if len == 0 {
        return Err("cannot allocate 0 bytes of shared memory".into());
    }
    let opts = BufferOptions {
        huge_pages: std::env::var_os("MC_STORE_USE_HUGEPAGE").is_some(),
        populate: true,
        name: "kvfs-host-mem".into(),
        shareable: true,
    };
    let buf = Buffer::new(len, &opts)
        .map_err(|e| format!("cannot allocate {size} bytes of shared memory: {e}"))?;
    let addr = buf.addr();
    HOST_MEMORY.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_default().insert(addr, buf);
    Ok(addr)
}

/// Unmaps memory from [`host_alloc`]: 0, or -1 for an address it did not hand out.
pub fn host_free(addr: u64) -> i64 {
    let taken = HOST_MEMORY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&addr));
    match taken {
        Some(buf) => {
            drop(buf);
            0
        }
        None => -1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_usable_until_freed_once() {
        let addr = host_alloc(10_000).unwrap();
        // SAFETY: host_alloc mapped at least 10 000 writable bytes at addr, freed below.
        let mem = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, 10_000) };
        assert!(mem.iter().all(|&b| b == 0));
        mem[9_999] = 7;
        assert_eq!(mem[9_999], 7);
        assert_eq!(host_free(addr), 0);
        assert_eq!(host_free(addr), -1);
        assert!(host_alloc(0).is_err());
    }
}
