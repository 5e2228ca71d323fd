//! The ioctl fast path (DESIGN.md section 6): engines register shared buffers with the daemon
//! and ring a doorbell for batches of gets and puts laid out in them; the daemon moves bytes
//! straight between the pool and the buffer with the client's zero-copy calls. The ABI is in
//! `kvfs-fs-abi` and `fs/abi/include/kvfs.h`.
//!
//! Registration. The caller names a descriptor in its own fd table; the daemon resolves the
//! calling thread to its process, takes its own reference to that descriptor (so only a process
//! that holds it can register it), checks that it is a shared-memory file sealed against
//! shrinking (so the daemon can never be made to fault on it) and at least `len` long, maps it
//! with every page faulted in and registers the mapping with the client's Transfer Engine.
//!
//! Ownership. A buffer id belongs to the registering process (pid and start time, so a recycled
//! pid is not the owner) and lives until it is unregistered or the control file handle that
//! registered it is released (which the kernel does when the process closes it or dies).
//! Another process using the id gets `EPERM`; an unknown id `EBADF`.
//!
//! Submission. The items are copied out of shared memory before they are checked (the caller
//! may change them concurrently), every field is validated (a bad field fails that item with a
//! negative errno, never the daemon), the valid items go to the pool as one batch, and each
//! item's `status` and `size` are written back. A registration is held by every batch that
//! uses it; when it goes, it is unregistered from the engine at once and unmapped after the
//! engine's operation timeout, so a transfer the client gave up on can never touch unmapped
//! memory.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_client::{Client, ErrorKind, GetInto, PutFrom, PutOptions};
use kvfs_fs_abi as abi;
use kvfs_transfer::Engine;

use crate::errno;
use crate::procfs::{self, ProcId};
use crate::state::{Counters, Errno, bump, lock};

/// Limits of the fast path.
#[derive(Debug, Clone)]
pub struct FastPathConfig {
    pub batch_items_max: u32,
    pub buffers_per_process_max: u32,
    pub buffer_bytes_max: u64,
    pub key_bytes_max: u32,
    /// A batch fails with `ETIMEDOUT` after this long.
    pub op_timeout_ms: u64,
    /// How long an unregistered buffer stays mapped (transfers the client abandoned).
    pub unmap_grace_ms: u64,
}

impl Default for FastPathConfig {
    fn default() -> Self {
        FastPathConfig {
            batch_items_max: 4096,
            buffers_per_process_max: 64,
            buffer_bytes_max: 1 << 40,
            key_bytes_max: 4096,
            // Below the mount's operation timeout, so items report -ETIMEDOUT themselves.
            op_timeout_ms: 25_000,
            unmap_grace_ms: 15_000,
        }
    }
}

/// A mapping of a caller's buffer.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    _fd: OwnedFd,
}

// SAFETY: a shared mapping owned by this struct; all access goes through raw copies.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl Mapping {
    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Copies `[off, off+out.len())` out; the caller checked the range.
    fn read(&self, off: u64, out: &mut [u8]) {
        debug_assert!(off as usize + out.len() <= self.len);
        // SAFETY: the range lies inside the mapping (checked by the caller against `len`);
        // the source is shared memory another process may write, copied bytewise.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(off as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    fn write(&self, off: u64, data: &[u8]) {
        debug_assert!(off as usize + data.len() <= self.len);
        // SAFETY: as in `read`; the destination is inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(off as usize),
                data.len(),
            )
        }
    }
}

struct Registration {
    id: u64,
    owner: ProcId,
    fh: u64,
    map: Option<Mapping>,
    engine: Engine,
    grace: Duration,
}

impl Registration {
    fn map(&self) -> &Mapping {
        self.map.as_ref().expect("mapped until drop")
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else { return };
        let _ = self.engine.unregister(map.addr());
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let grace = self.grace;
                rt.spawn(async move {
                    tokio::time::sleep(grace).await;
                    drop(map);
                });
            }
            Err(_) => drop(map),
        }
    }
}

pub struct FastPath {
    cfg: FastPathConfig,
    engine: Engine,
    regs: Mutex<HashMap<u64, Arc<Registration>>>,
    next_id: AtomicU64,
}

/// `(bytes out, ioctl result)` or an errno.
pub type IoctlResult = Result<Vec<u8>, Errno>;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

impl FastPath {
    pub fn new(cfg: FastPathConfig, engine: Engine) -> FastPath {
        FastPath { cfg, engine, regs: Mutex::new(HashMap::new()), next_id: AtomicU64::new(1) }
    }

    pub fn config(&self) -> &FastPathConfig {
        &self.cfg
    }

    /// Buffers registered now: `(id, pid, bytes)`.
    pub fn buffers(&self) -> Vec<(u64, u32, u64)> {
        let mut v: Vec<_> =
            lock(&self.regs).values().map(|r| (r.id, r.owner.tgid, r.map().len as u64)).collect();
        v.sort();
        v
    }

    /// The control file handle `fh` was released: its registrations go.
    pub fn release_fh(&self, fh: u64) {
        let gone: Vec<Arc<Registration>> = {
            let mut regs = lock(&self.regs);
            let ids: Vec<u64> = regs.values().filter(|r| r.fh == fh).map(|r| r.id).collect();
            ids.iter().filter_map(|id| regs.remove(id)).collect()
        };
        drop(gone);
    }

    pub fn info(&self) -> abi::Info {
        abi::Info {
            abi_version: abi::ABI_VERSION,
            batch_items_max: self.cfg.batch_items_max,
            key_bytes_max: self.cfg.key_bytes_max,
            buffers_max: self.cfg.buffers_per_process_max,
            buffer_bytes_max: self.cfg.buffer_bytes_max,
            item_size: abi::Item::SIZE as u64,
            reserved: [0; 4],
        }
    }

    /// KVFS_IOC_REGISTER from thread `tid` through control handle `fh`.
    pub fn register(&self, tid: u32, fh: u64, input: &[u8], counters: &Counters) -> IoctlResult {
        let mut r = abi::Register::from_bytes(input).ok_or(libc::EINVAL)?;
        if r.abi_version != abi::ABI_VERSION {
            return Err(libc::EPROTO);
        }
        if r.flags != 0 || r.reserved != [0; 2] || r.len == 0 {
            return Err(libc::EINVAL);
        }
        if r.len > self.cfg.buffer_bytes_max || r.len > isize::MAX as u64 {
            return Err(libc::EFBIG);
        }
        let owner = procfs::caller(tid).map_err(|_| libc::ESRCH)?;
        let held = lock(&self.regs).values().filter(|x| x.owner == owner).count();
        if held >= self.cfg.buffers_per_process_max as usize {
            return Err(libc::EMFILE);
        }
        let fd = procfs::take_fd(owner.tgid, r.fd)
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EBADF))?;
        let map = map_shared(fd, r.len)?;
        // SAFETY: the mapping lives in the registration, which unregisters it from the engine
        // before unmapping it (and unmaps only after the grace period, when no transfer the
        // engine started on it can still run).
        unsafe { self.engine.register_memory(map.addr(), map.len as u64, false) }
            .map_err(|_| libc::EIO)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let grace = Duration::from_millis(self.cfg.unmap_grace_ms);
        let reg =
            Registration { id, owner, fh, map: Some(map), engine: self.engine.clone(), grace };
        lock(&self.regs).insert(id, Arc::new(reg));
        bump(&counters.fastpath_registrations, 1);
        r.buffer_id = id;
        Ok(r.to_bytes().to_vec())
    }

    /// The registration `id`, if `tid`'s process owns it.
    fn owned(&self, tid: u32, id: u64) -> Result<Arc<Registration>, Errno> {
        let reg = lock(&self.regs).get(&id).cloned().ok_or(libc::EBADF)?;
        let caller = procfs::caller(tid).map_err(|_| libc::ESRCH)?;
        if caller != reg.owner {
            return Err(libc::EPERM);
        }
        Ok(reg)
    }

    pub fn unregister(&self, tid: u32, input: &[u8]) -> IoctlResult {
        let u = abi::Unregister::from_bytes(input).ok_or(libc::EINVAL)?;
        if u.abi_version != abi::ABI_VERSION {
            return Err(libc::EPROTO);
        }
        if u.reserved != 0 {
            return Err(libc::EINVAL);
        }
        let reg = self.owned(tid, u.buffer_id)?;
        lock(&self.regs).remove(&reg.id);
        Ok(Vec::new())
    }

    /// KVFS_IOC_SUBMIT.
    pub async fn submit(
        &self,
        tid: u32,
        input: &[u8],
        client: &Client,
        put: &PutOptions,
        counters: &Counters,
    ) -> IoctlResult {
        let mut s = abi::Submit::from_bytes(input).ok_or(libc::EINVAL)?;
        if s.abi_version != abi::ABI_VERSION {
            return Err(libc::EPROTO);
        }
        if s.flags != 0 || s.reserved != [0; 2] || s.count == 0 || s.items_offset % 8 != 0 {
            return Err(libc::EINVAL);
        }
        if s.op != abi::OP_GET && s.op != abi::OP_PUT {
            return Err(libc::EINVAL);
        }
        if s.count > self.cfg.batch_items_max {
            return Err(libc::E2BIG);
        }
        let reg = self.owned(tid, s.buffer_id)?;
        let map = reg.map();
        let table_len = s.count as u64 * abi::Item::SIZE as u64;
        if !in_range(s.items_offset, table_len, map.len as u64) {
            return Err(libc::ERANGE);
        }
        let mut raw = vec![0u8; table_len as usize];
        map.read(s.items_offset, &mut raw);
        let mut items: Vec<abi::Item> =
            raw.chunks_exact(abi::Item::SIZE).filter_map(abi::Item::from_bytes).collect();
        let keys: Vec<Result<String, Errno>> =
            items.iter().map(|it| self.check_item(it, s.op, map)).collect();
        bump(&counters.fastpath_submits, 1);
        let timeout = Duration::from_millis(self.cfg.op_timeout_ms);
        let run = async {
            if s.op == abi::OP_GET {
                get_batch(client, map, &mut items, &keys).await
            } else {
                put_batch(client, map, &mut items, &keys, put).await
            }
        };
        if tokio::time::timeout(timeout, run).await.is_err() {
            for it in &mut items {
                it.status = -libc::ETIMEDOUT;
            }
        }
        let (mut ok, mut failed, mut bytes) = (0u32, 0u32, 0u64);
        for (i, it) in items.iter().enumerate() {
            let at = s.items_offset + (i * abi::Item::SIZE) as u64;
            map.write(at + abi::Item::SIZE_OFFSET as u64, &it.size.to_ne_bytes());
            map.write(at + abi::Item::STATUS_OFFSET as u64, &it.status.to_ne_bytes());
            if it.status == 0 {
                ok += 1;
                bytes += it.size;
            } else {
                failed += 1;
            }
        }
        bump(&counters.fastpath_items_ok, ok as u64);
        bump(&counters.fastpath_items_failed, failed as u64);
        bump(&counters.fastpath_bytes, bytes);
        s.ok = ok;
        s.failed = failed;
        Ok(s.to_bytes().to_vec())
    }

    /// The item's key, if every field is valid.
    fn check_item(&self, it: &abi::Item, op: u32, map: &Mapping) -> Result<String, Errno> {
        if it.flags != 0 || it.reserved != 0 || it.key_len == 0 {
            return Err(libc::EINVAL);
        }
        if it.key_len > self.cfg.key_bytes_max {
            return Err(libc::ENAMETOOLONG);
        }
        let len = map.len as u64;
        if !in_range(it.key_offset, it.key_len as u64, len)
            || !in_range(it.data_offset, it.data_len, len)
        {
            return Err(libc::ERANGE);
        }
        if op == abi::OP_PUT && it.data_len == 0 {
            return Err(libc::EINVAL);
        }
        let mut key = vec![0u8; it.key_len as usize];
        map.read(it.key_offset, &mut key);
        String::from_utf8(key).map_err(|_| libc::EINVAL)
    }
}

fn in_range(offset: u64, len: u64, total: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= total)
}

/// Maps `[0, len)` of a caller's shared-memory file, after the checks in the module notes.
fn map_shared(fd: OwnedFd, len: u64) -> Result<Mapping, Errno> {
    let raw = fd.as_raw_fd();
    // SAFETY: fstat/fstatfs/fcntl on a descriptor we own, into zeroed local structs.
    let (st, sfs, seals) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        let mut sfs: libc::statfs = std::mem::zeroed();
        if libc::fstat(raw, &mut st) != 0 || libc::fstatfs(raw, &mut sfs) != 0 {
            return Err(libc::EBADF);
        }
        (st, sfs, libc::fcntl(raw, libc::F_GET_SEALS))
    };
    // f_type is i64 here but another integer type on other targets.
    #[allow(clippy::unnecessary_cast)]
    let shm = sfs.f_type as i64 == TMPFS_MAGIC || sfs.f_type as i64 == HUGETLBFS_MAGIC;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || !shm {
        return Err(libc::ENODEV);
    }
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(libc::EPERM);
    }
    if (st.st_size as u64) < len {
        return Err(libc::ERANGE);
    }
    // SAFETY: a new shared mapping of a file we hold; the kernel picks the address. The file
    // cannot shrink (sealed), so the mapping can never fault.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            raw,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        return Err(if e == libc::EPERM { libc::EACCES } else { e });
    }
    let ptr = NonNull::new(p.cast()).ok_or(libc::ENOMEM)?;
    Ok(Mapping { ptr, len: len as usize, _fd: fd })
}

async fn get_batch(
    client: &Client,
    map: &Mapping,
    items: &mut [abi::Item],
    keys: &[Result<String, Errno>],
) {
    let mut idx = Vec::new();
    let mut gets = Vec::new();
    for (i, (it, k)) in items.iter_mut().zip(keys).enumerate() {
        match k {
            Ok(key) => {
                idx.push(i);
                gets.push(GetInto { key, addr: map.addr() + it.data_offset, cap: it.data_len });
            }
            Err(e) => {
                it.status = -e;
                it.size = 0;
            }
        }
    }
    if gets.is_empty() {
        return;
    }
    let results = client.get_into_batch(&gets).await;
    let mut too_small = Vec::new();
    for (&i, r) in idx.iter().zip(results) {
        let it = &mut items[i];
        match r {
            Ok(size) => {
                it.status = 0;
                it.size = size;
            }
            Err(e) => {
                it.status = -errno::of_kind(e.kind());
                it.size = 0;
                if e.kind() == ErrorKind::BufferTooSmall {
                    too_small.push(i);
                }
            }
        }
    }
    if !too_small.is_empty() {
        // Tell the caller how much room the objects need.
        let names: Vec<&str> = too_small.iter().filter_map(|&i| keys[i].as_deref().ok()).collect();
        for (&i, v) in too_small.iter().zip(client.stat_batch(&names).await) {
            items[i].size = v.map(|v| v.size).unwrap_or(0);
        }
    }
}

async fn put_batch(
    client: &Client,
    map: &Mapping,
    items: &mut [abi::Item],
    keys: &[Result<String, Errno>],
    opts: &PutOptions,
) {
    let mut idx = Vec::new();
    let mut puts = Vec::new();
    for (i, (it, k)) in items.iter_mut().zip(keys).enumerate() {
        match k {
            Ok(key) => {
                idx.push(i);
                puts.push(PutFrom { key, addr: map.addr() + it.data_offset, len: it.data_len });
            }
            Err(e) => {
                it.status = -e;
                it.size = 0;
            }
        }
    }
    if puts.is_empty() {
        return;
    }
    let results = client.put_from_batch(&puts, opts).await;
    for (&i, r) in idx.iter().zip(results) {
        let it = &mut items[i];
        match r {
            Ok(()) => {
                it.status = 0;
                it.size = it.data_len;
            }
            Err(e) => {
                it.status = -errno::of_kind(e.kind());
                it.size = 0;
            }
        }
    }
}
