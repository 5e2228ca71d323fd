//! `kvfs._native.FastPath` and `FastPathBuffer`: the mount's ioctl fast path from Python
//! (the ABI is `fs/abi/include/kvfs.h`, spoken here through `kvfs_fs_abi::sys`).
//!
//! Mechanism. `FastPath(mount)` opens `<mount>/.kvfs/control` and checks the daemon's ABI
//! version and item size (`KVFS_IOC_INFO`). `alloc(nbytes)` makes a memfd sealed against
//! shrinking and growing, maps it with every page faulted in and registers it
//! (`KVFS_IOC_REGISTER`). Every buffer is laid out as
//!
//! ```text
//!   [0, table)             item table: batch_items_max struct kvfs_item (48 bytes each)
//!   [table, head)          key area: the batch's keys, packed (key_area_bytes, 1 MiB default)
//!   [head, head + nbytes)  the data area: what Python sees (buffer protocol, numpy, torch)
//! ```
//!
//! with `table` and `head` multiples of the page size, so the data area is page aligned. The
//! daemon reads items, keys and data from the one buffer a submit names, so the head travels
//! with each buffer rather than in a second one. `get`/`put` take `(key, offset, length)`
//! items with offsets into the data area, lay the items and keys out in the head and ring
//! `KVFS_IOC_SUBMIT` with the GIL released; each item's `(status, size)` comes back (status 0
//! or a negative errno, as in kvfs.h). A batch whose keys overflow the key area is submitted
//! as several consecutive ioctls, each filling the area.
//!
//! Invariants. The head is written only under the buffer's lock, so batches on one buffer from
//! several threads run one after another (batches on different buffers run in parallel). The
//! control descriptor is used only under a read lock and closed under the write lock, so an
//! ioctl never reaches a descriptor number reused after `close`. A buffer's mapping lives as
//! long as the Python object (every export, memoryview, numpy array or tensor holds a reference
//! to it): `close` only unregisters it, so no view can outlive the memory it points at.
//! Registrations die with the control descriptor (the daemon's rule), which `FastPath.close`,
//! the context manager and garbage collection close.
//!
//! Checked here, before anything reaches the daemon: the batch size against `batch_items_max`
//! and every range against the data area (`ValueError`), keys longer than `key_bytes_max`
//! (`-ENAMETOOLONG` for that item, as the daemon would answer). Not handled: ids and buffers
//! do not survive `fork` (the child is another process: the daemon answers `EPERM`), and
//! there is no asynchronous submit (the ioctl is the doorbell and returns when the batch ends).

use std::os::raw::c_int;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kvfs_fs_abi::{self as abi, sys};
use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

/// Key area of a buffer when `alloc` is not told otherwise.
pub const KEY_AREA_BYTES_DEFAULT: usize = 1 << 20;
const PAGE_BYTES: usize = 4096;

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// The control descriptor and the daemon's limits, shared by a `FastPath` and its buffers.
struct Control {
    file: RwLock<Option<sys::Control>>,
    info: abi::Info,
    mount: PathBuf,
}

impl Control {
    fn close(&self) {
        let file = self.file.write().unwrap_or_else(|e| e.into_inner()).take();
        drop(file);
    }
}

/// One get or put of a batch, checked against the data area.
struct Req {
    key: String,
    offset: u64,
    len: u64,
}

/// A failure of a whole call (per-item outcomes are statuses, never this).
enum Fail {
    Closed(&'static str),
    Ioctl { what: String, err: std::io::Error },
}

impl Fail {
    fn into_py(self) -> PyErr {
        match self {
            Fail::Closed(what) => PyValueError::new_err(format!("{what} is closed")),
            Fail::Ioctl { what, err } => os_error(err, what),
        }
    }
}

fn os_error(err: std::io::Error, what: String) -> PyErr {
    match err.raw_os_error() {
        Some(e) => PyOSError::new_err((e, format!("{what}: {err}"))),
        None => PyOSError::new_err(format!("{what}: {err}")),
    }
}

/// A registered, sealed shared buffer (made by `FastPath.alloc`).
///
/// `len(buf)` is the data area's size; `memoryview(buf)`, `buf.numpy()` and `buf.tensor()`
/// are writable zero-copy views of it; `buf.id` is the daemon's buffer id.
#[pyclass(module = "kvfs._native", name = "FastPathBuffer", frozen)]
pub struct FastPathBuffer {
    ctl: Arc<Control>,
    mem: sys::SealedMemfd,
    id: u64,
    /// Bytes before the data area: the item table, then the key area.
    head_bytes: usize,
    table_bytes: usize,
    len: usize,
    /// Held while a batch uses the head, and while the buffer is unregistered.
    batch: Mutex<()>,
    /// Whether the daemon dropped it; set under `batch`, read without it (`closed` and `repr`
    /// run with the GIL held and must not wait for a batch).
    unregistered: AtomicBool,
}

impl FastPathBuffer {
    /// Unregisters (once); the mapping stays until the object is collected.
    fn unregister(&self) -> Result<(), Fail> {
        let _batch = self.batch.lock().unwrap_or_else(|e| e.into_inner());
        if self.unregistered.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let file = self.ctl.file.read().unwrap_or_else(|e| e.into_inner());
        // A closed control file already took every registration with it.
        let Some(ctl) = file.as_ref() else { return Ok(()) };
        ctl.unregister(self.id).map_err(|err| Fail::Ioctl {
            what: format!("kvfs fast path: unregistering buffer {}", self.id),
            err,
        })
    }

    /// Lays out and submits `reqs` (already checked), returning `(status, size)` per item.
    fn run(&self, op: u32, reqs: &[Req]) -> Result<Vec<(i32, u64)>, Fail> {
        let _batch = self.batch.lock().unwrap_or_else(|e| e.into_inner());
        if self.unregistered.load(Ordering::Acquire) {
            return Err(Fail::Closed("the buffer"));
        }
        let file = self.ctl.file.read().unwrap_or_else(|e| e.into_inner());
        let ctl = file.as_ref().ok_or(Fail::Closed("the fast path"))?;
        let info = &self.ctl.info;
        let mut out = vec![(0i32, 0u64); reqs.len()];
        let mut table =
            Vec::with_capacity(reqs.len().min(info.batch_items_max as usize) * abi::Item::SIZE);
        let mut sent = Vec::with_capacity(reqs.len().min(info.batch_items_max as usize));
        let mut next = 0;
        while next < reqs.len() {
            table.clear();
            sent.clear();
            let mut key_at = self.table_bytes;
            while next < reqs.len() && sent.len() < info.batch_items_max as usize {
                let r = &reqs[next];
                if r.key.len() > info.key_bytes_max as usize {
                    out[next] = (-libc::ENAMETOOLONG, 0);
                    next += 1;
                    continue;
                }
                if key_at + r.key.len() > self.head_bytes {
                    break; // the key area is full: submit what is laid out, then go on
                }
                self.mem.write_at(key_at, r.key.as_bytes());
                let item = abi::Item {
                    key_offset: key_at as u64,
                    key_len: r.key.len() as u32,
                    data_offset: (self.head_bytes as u64) + r.offset,
                    data_len: r.len,
                    ..Default::default()
                };
                table.extend_from_slice(&item.to_bytes());
                key_at += r.key.len();
                sent.push(next);
                next += 1;
            }
            if sent.is_empty() {
                if next < reqs.len() {
                    // Cannot happen (the area holds key_bytes_max), but never spin on it.
                    out[next] = (-libc::ENAMETOOLONG, 0);
                    next += 1;
                }
                continue;
            }
            self.mem.write_at(0, &table);
            let mut s = abi::Submit {
                abi_version: abi::ABI_VERSION,
                op,
                buffer_id: self.id,
                items_offset: 0,
                count: sent.len() as u32,
                ..Default::default()
            };
            ctl.submit(&mut s).map_err(|err| Fail::Ioctl {
                what: format!(
                    "kvfs fast path: submitting {} items on buffer {}",
                    sent.len(),
                    self.id
                ),
                err,
            })?;
            self.mem.read_at(0, &mut table);
            for (raw, &i) in table.chunks_exact(abi::Item::SIZE).zip(&sent) {
                let it = abi::Item::from_bytes(raw).unwrap_or_default();
                out[i] = (it.status, it.size);
            }
        }
        Ok(out)
    }
}

#[pymethods]
impl FastPathBuffer {
    /// The daemon's id of this buffer.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the data area (as `len(buf)`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Bytes reserved before the data area (item table and key area).
    #[getter]
    fn head_bytes(&self) -> usize {
        self.head_bytes
    }

    /// Whether `close` was called (or its `FastPath` closed).
    #[getter]
    fn closed(&self) -> bool {
        self.unregistered.load(Ordering::Acquire)
            || self.ctl.file.read().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// The data area as a writable numpy array (no copy), `dtype` uint8 unless given.
    #[pyo3(signature = (dtype = None))]
    fn numpy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let np = slf.py().import("numpy")?;
        let dtype = match dtype {
            Some(d) => d.clone(),
            None => np.getattr("uint8")?,
        };
        np.call_method1("frombuffer", (slf, dtype))
    }

    /// The data area as a writable torch tensor (no copy), `dtype` torch.uint8 unless given.
    /// Raises ImportError where torch does not import.
    #[pyo3(signature = (dtype = None))]
    fn tensor<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let torch = slf.py().import("torch")?;
        let dtype = match dtype {
            Some(d) => d.clone(),
            None => torch.getattr("uint8")?,
        };
        let kw = PyDict::new(slf.py());
        kw.set_item("dtype", dtype)?;
        torch.call_method("frombuffer", (slf,), Some(&kw))
    }

    /// Unregisters the buffer from the daemon (idempotent). The memory stays mapped, for the
    /// views still held, until the object is collected.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.unregister()).map_err(Fail::into_py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!(
            "FastPathBuffer(id={}, nbytes={}, closed={})",
            self.id,
            self.len,
            if self.unregistered.load(Ordering::Acquire) { "True" } else { "False" }
        )
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let me = slf.get();
            // SAFETY: head_bytes lies inside the mapping (it was made head_bytes + len long).
            let p = unsafe { me.mem.as_ptr().add(me.head_bytes) };
            (p.cast::<std::ffi::c_void>(), me.len)
        };
        // SAFETY: the mapping stays while the object lives.
        unsafe { crate::memory::export_buffer(slf.as_any(), view, ptr, len, false, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

impl Drop for FastPathBuffer {
    fn drop(&mut self) {
        // Collected without close: the daemon forgets it now rather than at the control
        // file's close. Nothing to report to from a destructor.
        let _ = self.unregister();
    }
}

/// An open `<mount>/.kvfs/control`: allocates registered buffers and runs batches on them.
#[pyclass(module = "kvfs._native", name = "FastPath", frozen)]
pub struct FastPath {
    ctl: Arc<Control>,
}

impl FastPath {
    fn open(mount: &Path) -> PyResult<FastPath> {
        let shown = mount.display();
        let path = mount.join(abi::CONTROL_PATH);
        let not_kvfs = |why: &str| {
            PyOSError::new_err((libc::ENOTTY, format!("{shown} is not a kvfs mount: {why}")))
        };
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_file() => {}
            Ok(_) => return Err(not_kvfs("its .kvfs/control is not a regular file")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(if mount.is_dir() {
                    PyOSError::new_err((
                        libc::ENOENT,
                        format!("{shown} is not a kvfs mount: it has no .kvfs/control"),
                    ))
                } else {
                    PyOSError::new_err((
                        libc::ENOENT,
                        format!("no kvfs mount at {shown}: no such directory"),
                    ))
                });
            }
            Err(e) => return Err(os_error(e, format!("opening {}", path.display()))),
        }
        let file = sys::Control::open(mount)
            .map_err(|e| os_error(e, format!("opening {}", path.display())))?;
        let info = match file.info() {
            Ok(i) => i,
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {
                return Err(not_kvfs("its .kvfs/control does not answer KVFS_IOC_INFO"));
            }
            Err(e) => return Err(os_error(e, format!("KVFS_IOC_INFO on {}", path.display()))),
        };
        if info.abi_version != abi::ABI_VERSION || info.item_size != abi::Item::SIZE as u64 {
            return Err(PyOSError::new_err((
                libc::EPROTO,
                format!(
                    "the kvfs mount at {shown} speaks fast-path ABI version {} (items of {} \
                     bytes); this kvfs speaks version {} ({} bytes)",
                    info.abi_version,
                    info.item_size,
                    abi::ABI_VERSION,
                    abi::Item::SIZE
                ),
            )));
        }
        if info.batch_items_max == 0 || info.key_bytes_max == 0 {
            return Err(not_kvfs("its limits are zero"));
        }
        let ctl = Control { file: RwLock::new(Some(file)), info, mount: mount.to_path_buf() };
        Ok(FastPath { ctl: Arc::new(ctl) })
    }

    /// The buffer, if it was allocated here.
    fn own<'a>(&self, buf: &'a Bound<'_, FastPathBuffer>) -> PyResult<&'a FastPathBuffer> {
        let b = buf.get();
        if !Arc::ptr_eq(&b.ctl, &self.ctl) {
            return Err(PyValueError::new_err("the buffer was allocated by another FastPath"));
        }
        Ok(b)
    }

    /// Reads a batch's `(key, offset, length)` items, checked against the data area.
    fn requests(&self, buf: &FastPathBuffer, items: &Bound<'_, PyAny>) -> PyResult<Vec<Req>> {
        if items.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("items must be a list of (key, offset, length)"));
        }
        let max = self.ctl.info.batch_items_max as usize;
        let mut reqs = Vec::with_capacity(items.len().unwrap_or(0).min(max));
        for (i, it) in items.try_iter()?.enumerate() {
            if i >= max {
                let n = items.len().map(|n| n.to_string()).unwrap_or_else(|_| "more".into());
                return Err(PyValueError::new_err(format!(
                    "a batch holds at most batch_items_max = {max} items ({n} given)"
                )));
            }
            let (key, offset, len): (Bound<'_, PyAny>, i128, i128) =
                it?.extract().map_err(|_| {
                    PyTypeError::new_err(format!("item {i}: expected (key: str, offset, length)"))
                })?;
            let key: String = key
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("item {i}: the key must be a str")))?;
            let (offset, len) = check_range(buf.len, offset, Some(len))
                .map_err(|e| PyValueError::new_err(format!("item {i} ({key:?}): {e}")))?;
            reqs.push(Req { key, offset, len });
        }
        Ok(reqs)
    }

    fn batch(
        &self,
        py: Python<'_>,
        op: u32,
        buf: &Bound<'_, FastPathBuffer>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(i32, u64)>> {
        let b = self.own(buf)?;
        let reqs = self.requests(b, items)?;
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        py.detach(|| b.run(op, &reqs)).map_err(Fail::into_py)
    }

    fn one(
        &self,
        py: Python<'_>,
        op: u32,
        buf: &Bound<'_, FastPathBuffer>,
        key: String,
        offset: i128,
        length: Option<i128>,
    ) -> PyResult<u64> {
        let b = self.own(buf)?;
        let (offset, len) =
            check_range(b.len, offset, length).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let req = [Req { key, offset, len }];
        let (status, size) = py.detach(|| b.run(op, &req)).map_err(Fail::into_py)?[0];
        if status != 0 {
            let [Req { key, .. }] = req;
            return Err(item_error(py, status, &key, size, len));
        }
        Ok(size)
    }
}

/// Checks `[offset, offset + length)` against a data area of `len` bytes; `length` None is the
/// rest of the area.
fn check_range(len: usize, offset: i128, length: Option<i128>) -> Result<(u64, u64), String> {
    let total = len as i128;
    let length = length.unwrap_or(total - offset);
    if offset < 0 || length < 0 {
        return Err(format!("offset {offset} and length {length} must not be negative"));
    }
    if offset + length > total {
        return Err(format!(
            "range [{offset}, {}) lies outside the {len}-byte buffer",
            offset + length
        ));
    }
    Ok((offset as u64, length as u64))
}

/// What an item's negative errno means on the fast path (kvfs.h's item table).
fn item_reason(errno: i32, size: u64, cap: u64) -> String {
    match errno {
        libc::ENOENT => "no such object".into(),
        libc::EOVERFLOW => {
            format!("the object is {size} bytes, larger than the {cap}-byte destination")
        }
        libc::EINVAL => "invalid item (an empty or non-UTF-8 key, or a put of 0 bytes)".into(),
        libc::ENAMETOOLONG => "the key is longer than key_bytes_max".into(),
        libc::ERANGE => "the key or data range lies outside the buffer".into(),
        libc::ENOSPC => "the pool has no room".into(),
        libc::EFBIG => "larger than the pool's largest object".into(),
        libc::EAGAIN => "another writer is putting the key, or the master is recovering".into(),
        libc::ENOTCONN => "the master cannot be reached".into(),
        libc::EIO => "moving the bytes failed on every replica".into(),
        libc::EBADMSG => "the bytes read do not match the object's checksum".into(),
        libc::ETIMEDOUT => "the batch timed out".into(),
        e => std::io::Error::from_raw_os_error(e).to_string(),
    }
}

/// The `OSError` of an item's status (errno `-status`, the key as its filename; `size` set).
fn item_error(py: Python<'_>, status: i32, key: &str, size: u64, cap: u64) -> PyErr {
    let errno = status.checked_neg().filter(|e| *e > 0).unwrap_or(libc::EIO);
    let err = PyOSError::new_err((errno, item_reason(errno, size, cap), key.to_string()));
    // The instance is made now so the size can ride along; a failure only loses the attribute.
    let _ = err.value(py).setattr("size", size);
    err
}

/// `kvfs.fastpath.error(status, key, size=0, length=0)`: the OSError for an item's status.
#[pyfunction]
#[pyo3(signature = (status, key, size = 0, length = 0))]
pub fn fastpath_error(py: Python<'_>, status: i32, key: &str, size: u64, length: u64) -> PyErr {
    item_error(py, status, key, size, length)
}

#[pymethods]
impl FastPath {
    /// Opens `<mount>/.kvfs/control` and checks the daemon's ABI version.
    #[new]
    fn new(py: Python<'_>, mount: PathBuf) -> PyResult<FastPath> {
        py.detach(|| FastPath::open(&mount))
    }

    /// The mount point.
    #[getter]
    fn mount(&self) -> PathBuf {
        self.ctl.mount.clone()
    }

    /// The daemon's ABI version and limits (`batch_items_max`, `key_bytes_max`,
    /// `buffers_max` per process, `buffer_bytes_max` per buffer).
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = &self.ctl.info;
        let d = PyDict::new(py);
        d.set_item("abi_version", i.abi_version)?;
        d.set_item("batch_items_max", i.batch_items_max)?;
        d.set_item("key_bytes_max", i.key_bytes_max)?;
        d.set_item("buffers_max", i.buffers_max)?;
        d.set_item("buffer_bytes_max", i.buffer_bytes_max)?;
        d.set_item("item_bytes", i.item_size)?;
        Ok(d)
    }

    /// Largest batch (`info["batch_items_max"]`).
    #[getter]
    fn batch_items_max(&self) -> u32 {
        self.ctl.info.batch_items_max
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.ctl.file.read().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// Allocates, seals, maps and registers a buffer with `nbytes` of data area (plus its head:
    /// the item table and `key_area_bytes` of keys, 1 MiB unless given).
    #[pyo3(signature = (nbytes, *, key_area_bytes = None))]
    fn alloc(
        &self,
        py: Python<'_>,
        nbytes: usize,
        key_area_bytes: Option<usize>,
    ) -> PyResult<FastPathBuffer> {
        let info = self.ctl.info;
        if nbytes == 0 {
            return Err(PyValueError::new_err("a buffer must hold at least one byte"));
        }
        let keys = key_area_bytes.unwrap_or(KEY_AREA_BYTES_DEFAULT);
        if keys < info.key_bytes_max as usize {
            return Err(PyValueError::new_err(format!(
                "key_area_bytes must hold the longest key (key_bytes_max = {})",
                info.key_bytes_max
            )));
        }
        let table_bytes = round_up(info.batch_items_max as usize * abi::Item::SIZE, PAGE_BYTES);
        let head_bytes = table_bytes + round_up(keys, PAGE_BYTES);
        let total = head_bytes.checked_add(nbytes).filter(|t| *t as u64 <= info.buffer_bytes_max);
        let Some(total) = total else {
            return Err(PyValueError::new_err(format!(
                "{nbytes} bytes and a head of {head_bytes} exceed buffer_bytes_max = {}",
                info.buffer_bytes_max
            )));
        };
        let ctl = self.ctl.clone();
        let made = py.detach(move || -> Result<FastPathBuffer, Fail> {
            let mem = sys::SealedMemfd::new("kvfs-fastpath", total).map_err(|err| Fail::Ioctl {
                what: format!("kvfs fast path: making a sealed memfd of {total} bytes"),
                err,
            })?;
            let id = {
                let file = ctl.file.read().unwrap_or_else(|e| e.into_inner());
                let c = file.as_ref().ok_or(Fail::Closed("the fast path"))?;
                c.register(mem.fd(), total as u64).map_err(|err| {
                    let why = match err.raw_os_error() {
                        Some(libc::EMFILE) => {
                            format!(" (at most buffers_max = {} per process)", info.buffers_max)
                        }
                        _ => String::new(),
                    };
                    Fail::Ioctl {
                        what: format!("kvfs fast path: registering a {total}-byte buffer{why}"),
                        err,
                    }
                })?
            };
            Ok(FastPathBuffer {
                ctl,
                mem,
                id,
                head_bytes,
                table_bytes,
                len: nbytes,
                batch: Mutex::new(()),
                unregistered: AtomicBool::new(false),
            })
        });
        made.map_err(Fail::into_py)
    }

    /// Reads objects into the buffer: `items` is a list of `(key, offset, length)` (offset and
    /// capacity in the data area); returns `(status, size)` per item: `(0, size)`, or
    /// `(-errno, 0)`, or `(-EOVERFLOW, size the object needs)`.
    fn get(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, FastPathBuffer>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(i32, u64)>> {
        self.batch(py, abi::OP_GET, buf, items)
    }

    /// Stores `length` bytes at `offset` of the buffer under each key (the first writer wins);
    /// returns `(status, size)` per item: `(0, bytes stored)` or `(-errno, 0)`.
    fn put(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, FastPathBuffer>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(i32, u64)>> {
        self.batch(py, abi::OP_PUT, buf, items)
    }

    /// Reads one object into `[offset, offset + length)` (the rest of the buffer by default);
    /// returns its size or raises OSError (errno, key as filename, `size` attribute).
    #[pyo3(signature = (buf, key, offset = 0, length = None))]
    fn get_one(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, FastPathBuffer>,
        key: String,
        offset: i128,
        length: Option<i128>,
    ) -> PyResult<u64> {
        self.one(py, abi::OP_GET, buf, key, offset, length)
    }

    /// Stores `[offset, offset + length)` (the rest of the buffer by default) under `key`;
    /// returns the bytes stored or raises OSError.
    #[pyo3(signature = (buf, key, offset = 0, length = None))]
    fn put_one(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, FastPathBuffer>,
        key: String,
        offset: i128,
        length: Option<i128>,
    ) -> PyResult<u64> {
        self.one(py, abi::OP_PUT, buf, key, offset, length)
    }

    /// Closes the control file: the daemon forgets every buffer registered through it
    /// (idempotent; buffers stay mapped for their views until collected).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.ctl.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "FastPath(mount={:?}, closed={})",
            self.ctl.mount,
            if self.closed() { "True" } else { "False" }
        )
    }
}

impl Drop for FastPath {
    fn drop(&mut self) {
        // Collected: the control file closes even while buffers (and their views) live on.
        self.ctl.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_against_the_data_area() {
        assert_eq!(check_range(100, 0, None), Ok((0, 100)));
        assert_eq!(check_range(100, 40, None), Ok((40, 60)));
        assert_eq!(check_range(100, 40, Some(60)), Ok((40, 60)));
        assert_eq!(check_range(100, 100, Some(0)), Ok((100, 0)));
        assert!(check_range(100, 40, Some(61)).is_err());
        assert!(check_range(100, -1, Some(1)).is_err());
        assert!(check_range(100, 0, Some(-1)).is_err());
        assert!(check_range(100, 101, None).is_err());
        assert!(check_range(100, i64::MAX as i128, Some(i64::MAX as i128)).is_err());
    }

    #[test]
    fn item_reasons_name_the_size_for_overflow() {
        assert!(item_reason(libc::EOVERFLOW, 4096, 100).contains("4096 bytes"));
        assert_eq!(item_reason(libc::ENOENT, 0, 0), "no such object");
        assert!(!item_reason(libc::EPIPE, 0, 0).is_empty());
    }
}
