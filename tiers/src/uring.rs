//! io_uring plumbing shared by the NVMe medium and the disk benchmarks.
//!
//! Mechanism: an [`IoPool`] owns `io_threads` threads; each owns one `IoUring` and one staging
//! buffer of `queue_depth * chunk_bytes` bytes, 4 KiB aligned and registered with the ring
//! (`IORING_REGISTER_BUFFERS`, used through `ReadFixed`/`WriteFixed`). A whole object
//! operation (open, header, data, fsync, rename) runs as one job on one thread; inside it,
//! [`RingCtx::pipeline`] keeps up to `queue_depth` chunk reads or writes in flight and hashes
//! each chunk in order while the later ones are still in flight, so the blake3 cost overlaps
//! the disk.
//!
//! Policy: a chunk goes straight between the file and the caller's buffer (plain `Read`/`Write`)
//! when the buffer is 4 KiB aligned and the chunk is whole 4 KiB blocks; otherwise it bounces
//! through a registered staging slot. Short transfers are resubmitted for the rest; a read that
//! returns 0 bytes (end of file) before the chunk's bytes are in is `Corrupt` (the file is
//! shorter than its header says). A file may end inside its last 4 KiB block.
//!
//! Invariants: a job never returns while one of its I/Os is in flight (on error it drains the
//! ring first), so no completion can write into memory the caller has released. The async
//! bridge ([`IoPool::run`]) blocks in `Drop` until a cancelled job has finished, for the same
//! reason.
//!
//! Not handled: SQPOLL, registered files, several objects interleaved on one ring (concurrency
//! comes from `io_threads`), registering the caller's DRAM segment so direct reads could use
//! `ReadFixed` too.

use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, mpsc};

use io_uring::{IoUring, opcode, types};

use crate::error::{Error, ErrorKind, Result};

/// The O_DIRECT block: offsets, lengths and buffer addresses are multiples of it.
pub const BLOCK_BYTES: usize = 4096;
/// The largest staging buffer one ring thread may register.
pub const STAGING_BYTES_MAX: usize = 256 << 20;
/// The most I/Os one pipeline keeps in flight.
pub const QUEUE_DEPTH_MAX: usize = 64;

/// A zeroed heap buffer aligned to [`BLOCK_BYTES`].
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size; the result is checked for null.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(BLOCK_BYTES), BLOCK_BYTES)
            .unwrap_or_else(|_| panic!("aligned buffer of {len} bytes is too large"))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) };
    }
}

/// Shape of the rings of a pool.
#[derive(Debug, Clone, Copy)]
pub struct RingConfig {
    /// Bytes per I/O (a multiple of 4 KiB).
    pub chunk_bytes: usize,
    /// I/Os in flight per object operation.
    pub queue_depth: usize,
    /// Ring threads (object operations that run at the same time).
    pub io_threads: usize,
    /// Hash each chunk with blake3's rayon update (both cores) instead of on the ring thread.
    pub hash_with_rayon: bool,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig { chunk_bytes: 1 << 20, queue_depth: 8, io_threads: 2, hash_with_rayon: true }
    }
}

impl RingConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::new(ErrorKind::InvalidArgument, m));
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(BLOCK_BYTES) {
            return bad(format!(
                "chunk_bytes {} is not a positive multiple of 4096",
                self.chunk_bytes
            ));
        }
        if self.queue_depth == 0 || self.queue_depth > QUEUE_DEPTH_MAX {
            return bad(format!("queue_depth {} not in 1..={QUEUE_DEPTH_MAX}", self.queue_depth));
        }
        if self.chunk_bytes.saturating_mul(self.queue_depth) > STAGING_BYTES_MAX {
            return bad(format!(
                "staging of {} bytes exceeds staging_bytes_max {STAGING_BYTES_MAX}",
                self.chunk_bytes * self.queue_depth
            ));
        }
        if self.io_threads == 0 {
            return bad("io_threads must be at least 1".into());
        }
        Ok(())
    }
}

/// Direction of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// One ring with its registered staging buffer; lives on one pool thread.
pub struct RingCtx {
    ring: IoUring,
    staging: AlignedBuf,
    cfg: RingConfig,
    /// Whether the staging buffer is registered (fixed-buffer ops) or used with plain ops.
    registered: bool,
}

impl RingCtx {
    pub fn new(cfg: RingConfig) -> Result<Self> {
        cfg.validate()?;
        let entries = (cfg.queue_depth * 2).next_power_of_two() as u32;
        let ring = IoUring::new(entries).map_err(|e| Error::io("io_uring_setup", e))?;
        let mut staging = AlignedBuf::new(cfg.chunk_bytes * cfg.queue_depth);
        let iov = libc::iovec { iov_base: staging.as_mut_ptr().cast(), iov_len: staging.len() };
        // SAFETY: the staging buffer lives as long as the ring (both owned by self; the ring is
        // dropped first as it is declared first) and is only used through fixed-buffer ops.
        let registered = match unsafe { ring.submitter().register_buffers(&[iov]) } {
            Ok(()) => true,
            // Without CAP_IPC_LOCK the pinned pages count against RLIMIT_MEMLOCK; plain
            // reads and writes of the same staging buffer still work, a little slower.
            Err(e) => {
                tracing::warn!(error = %e, bytes = staging.len(), "io_uring buffer registration refused; using unregistered staging");
                false
            }
        };
        Ok(RingCtx { ring, staging, cfg, registered })
    }

    pub fn config(&self) -> RingConfig {
        self.cfg
    }

    /// Whether the staging buffer is registered with the ring.
    pub fn staging_registered(&self) -> bool {
        self.registered
    }

    /// Move `size` bytes between `buf` and the file at `file_off`, `queue_depth` chunks in
    /// flight, hashing the bytes in order into `hasher` if given. The file region is accessed in
    /// whole 4 KiB blocks: the tail is zero-padded on write (the caller truncates the file to
    /// its real length afterwards if it wants), and on read the file may end anywhere after
    /// `file_off + size` (a short read at end of file completes the last chunk).
    ///
    /// # Safety
    /// `buf` must be valid for `size` bytes (writable for `Dir::Read`) for the whole call and
    /// not accessed by anyone else meanwhile. `fd` must be open with the right access mode.
    pub unsafe fn pipeline(
        &mut self,
        dir: Dir,
        fd: RawFd,
        file_off: u64,
        buf: *mut u8,
        size: usize,
        mut hasher: Option<&mut blake3::Hasher>,
    ) -> Result<()> {
        let chunk = self.cfg.chunk_bytes;
        let qd = self.cfg.queue_depth;
        let n = size.div_ceil(chunk);
        let aligned = (buf as usize).is_multiple_of(BLOCK_BYTES);
        let mut done_bytes = vec![0usize; n];
        let mut complete = vec![false; n];
        let (mut next_submit, mut low, mut inflight) = (0usize, 0usize, 0usize);
        let mut err: Option<Error> = None;
        let len_of = |i: usize| chunk.min(size - i * chunk);
        let io_len_of = |i: usize| len_of(i).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let direct = |i: usize| aligned && len_of(i) == io_len_of(i);
        let staging = self.staging.as_mut_ptr();
        let slot = |i: usize| staging.wrapping_add((i % qd) * chunk);
        let rayon = self.cfg.hash_with_rayon;
        let hash = |h: &mut blake3::Hasher, bytes: &[u8]| {
            if rayon && bytes.len() >= crate::medium::RAYON_HASH_BYTES_MIN {
                h.update_rayon(bytes);
            } else {
                h.update(bytes);
            }
        };
        loop {
            while err.is_none() && next_submit < n && next_submit < low + qd {
                let i = next_submit;
                let (len, io_len) = (len_of(i), io_len_of(i));
                if dir == Dir::Write {
                    // SAFETY: caller guarantees buf is valid for size bytes.
                    let src = unsafe { std::slice::from_raw_parts(buf.add(i * chunk), len) };
                    if let Some(h) = hasher.as_deref_mut() {
                        hash(h, src);
                    }
                    if !direct(i) {
                        // SAFETY: slot(i) has chunk bytes of staging, not in flight (window).
                        let s = unsafe { std::slice::from_raw_parts_mut(slot(i), io_len) };
                        s[..len].copy_from_slice(src);
                        s[len..].fill(0);
                    }
                }
                // SAFETY: the buffer stays valid until the completion is reaped below.
                unsafe { self.push(dir, fd, file_off, buf, i, 0, direct(i), slot(i), io_len) }?;
                inflight += 1;
                next_submit += 1;
            }
            if inflight == 0 {
                break;
            }
            self.submit_wait()?;
            let cqes: Vec<(u64, i32)> =
                self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (idx, res) in cqes {
                let i = idx as usize;
                inflight -= 1;
                if res < 0 {
                    err.get_or_insert(Error::errno(
                        format!("{dir:?} at {}", file_off as usize + i * chunk),
                        -res,
                    ));
                    continue;
                }
                if res == 0 {
                    err.get_or_insert(Error::new(
                        match dir {
                            Dir::Read => ErrorKind::Corrupt,
                            Dir::Write => ErrorKind::Io,
                        },
                        format!(
                            "{dir:?} at {}: end of file / no progress",
                            file_off as usize + i * chunk
                        ),
                    ));
                    continue;
                }
                done_bytes[i] += res as usize;
                // A read may stop short at the end of a file whose last block is partial: the
                // chunk is complete once its `len` bytes are in. Writes need the whole block.
                let need = if dir == Dir::Read { len_of(i) } else { io_len_of(i) };
                if dir == Dir::Read
                    && done_bytes[i] < need
                    && !done_bytes[i].is_multiple_of(BLOCK_BYTES)
                {
                    // Ended inside a block before the chunk was in: the file is too short.
                    err.get_or_insert(Error::new(
                        ErrorKind::Corrupt,
                        format!(
                            "Read at {}: end of file after {} of {need} bytes",
                            file_off as usize + i * chunk,
                            done_bytes[i]
                        ),
                    ));
                    complete[i] = true;
                    continue;
                }
                if done_bytes[i] < need && err.is_none() {
                    // SAFETY: same buffer as the first submission, further in.
                    unsafe {
                        self.push(
                            dir,
                            fd,
                            file_off,
                            buf,
                            i,
                            done_bytes[i],
                            direct(i),
                            slot(i),
                            io_len_of(i),
                        )
                    }?;
                    inflight += 1;
                } else {
                    complete[i] = true;
                }
            }
            while low < next_submit && complete[low] {
                if dir == Dir::Read && err.is_none() {
                    let len = len_of(low);
                    // SAFETY: the chunk's I/O is complete; buf is valid for size bytes.
                    let dst = unsafe { std::slice::from_raw_parts_mut(buf.add(low * chunk), len) };
                    if !direct(low) {
                        // SAFETY: the slot holds this chunk's completed read.
                        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(slot(low), len) });
                    }
                    if let Some(h) = hasher.as_deref_mut() {
                        hash(h, dst);
                    }
                }
                low += 1;
            }
            if err.is_some() && inflight == 0 {
                break;
            }
        }
        err.map_or(Ok(()), Err)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn push(
        &mut self,
        dir: Dir,
        fd: RawFd,
        file_off: u64,
        buf: *mut u8,
        i: usize,
        done: usize,
        direct: bool,
        slot: *mut u8,
        io_len: usize,
    ) -> Result<()> {
        let off = file_off + (i * self.cfg.chunk_bytes + done) as u64;
        let len = (io_len - done) as u32;
        let fd = types::Fd(fd);
        let fixed = self.registered;
        let sqe = match (dir, direct || !fixed) {
            (Dir::Read, true) => {
                // SAFETY: caller keeps buf valid (direct) or p is in our staging buffer.
                let p = if direct {
                    unsafe { buf.add(i * self.cfg.chunk_bytes + done) }
                } else {
                    slot.wrapping_add(done)
                };
                opcode::Read::new(fd, p, len).offset(off).build()
            }
            (Dir::Write, true) => {
                // SAFETY: caller keeps buf valid (direct) or p is in our staging buffer.
                let p = if direct {
                    unsafe { buf.add(i * self.cfg.chunk_bytes + done) }
                } else {
                    slot.wrapping_add(done)
                };
                opcode::Write::new(fd, p, len).offset(off).build()
            }
            (Dir::Read, false) => {
                opcode::ReadFixed::new(fd, slot.wrapping_add(done), len, 0).offset(off).build()
            }
            (Dir::Write, false) => {
                opcode::WriteFixed::new(fd, slot.wrapping_add(done), len, 0).offset(off).build()
            }
        };
        let sqe = sqe.user_data(i as u64);
        // SAFETY: the entry's buffers stay valid until its completion is reaped (pipeline
        // drains every in-flight entry before returning).
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| Error::new(ErrorKind::Io, "io_uring submission queue full"))
    }

    fn submit_wait(&mut self) -> Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("io_uring_enter", e)),
            }
        }
    }

    /// fsync through the ring.
    pub fn fsync(&mut self, fd: RawFd) -> Result<()> {
        let sqe = opcode::Fsync::new(types::Fd(fd)).build().user_data(u64::MAX);
        // SAFETY: fsync references no memory.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| Error::new(ErrorKind::Io, "io_uring submission queue full"))?;
        self.submit_wait()?;
        let res = self.ring.completion().next().map(|c| c.result()).unwrap_or(-libc::EIO);
        if res < 0 {
            return Err(Error::errno("fsync", -res));
        }
        Ok(())
    }

    /// Read `len` bytes at `off` into a fresh aligned buffer (headers).
    pub fn read_block(&mut self, fd: RawFd, off: u64, len: usize) -> Result<AlignedBuf> {
        let mut b = AlignedBuf::new(len);
        let p = b.as_mut_ptr();
        // SAFETY: b is an aligned buffer of len bytes owned here for the whole call.
        unsafe { self.pipeline(Dir::Read, fd, off, p, len, None) }?;
        Ok(b)
    }
}

type Job = Box<dyn FnOnce(&mut RingCtx) + Send>;

/// A pool of ring threads that run whole object operations.
pub struct IoPool {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    cfg: RingConfig,
}

/// Set when a job has finished (or was dropped without running).
struct Done(Arc<(Mutex<bool>, Condvar)>);

impl Drop for Done {
    fn drop(&mut self) {
        let (m, cv) = &*self.0;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }
}

/// Waits in Drop until the job it watches is done, so borrowed buffers outlive the I/O.
struct WaitDone(Arc<(Mutex<bool>, Condvar)>);

impl Drop for WaitDone {
    fn drop(&mut self) {
        let (m, cv) = &*self.0;
        let mut done = m.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            done = cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A raw pointer that a job may carry to its ring thread.
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut u8);
// SAFETY: the pointee is kept alive and unaliased by `IoPool::run`'s WaitDone guard.
unsafe impl Send for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`, not its field).
    pub fn ptr(self) -> *mut u8 {
        self.0
    }
}

impl IoPool {
    pub fn new(cfg: RingConfig, name: &str) -> Result<Arc<Self>> {
        cfg.validate()?;
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        for t in 0..cfg.io_threads {
            let (init_tx, init_rx) = mpsc::channel();
            let rx = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-uring-{t}"))
                .spawn(move || {
                    let mut ctx = match RingCtx::new(cfg) {
                        Ok(c) => {
                            let _ = init_tx.send(Ok(()));
                            c
                        }
                        Err(e) => {
                            let _ = init_tx.send(Err(e));
                            return;
                        }
                    };
                    loop {
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(job) = job else { return };
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            job(&mut ctx)
                        }));
                    }
                })
                .map_err(|e| Error::io("spawn ring thread", e))?;
            threads.push(handle);
            init_rx
                .recv()
                .map_err(|_| Error::new(ErrorKind::Io, "ring thread died during setup"))??;
        }
        Ok(Arc::new(IoPool { tx: Mutex::new(Some(tx)), threads: Mutex::new(threads), cfg }))
    }

    pub fn config(&self) -> RingConfig {
        self.cfg
    }

    /// Run `f` on a ring thread. `f` may use raw pointers into memory borrowed by the caller of
    /// `run`: if the returned future is dropped before the job finishes, the drop blocks until
    /// it has finished.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RingCtx) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let flag = Arc::new((Mutex::new(false), Condvar::new()));
        let done = Done(flag.clone());
        let wait = WaitDone(flag);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |ctx| {
            let _done = done;
            let _ = tx.send(f(ctx));
        });
        let sent = match &*self.tx.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(s) => s.send(job).is_ok(),
            None => false,
        };
        if !sent {
            return Err(Error::new(ErrorKind::Closed, "io pool is shut down"));
        }
        let out = rx
            .await
            .unwrap_or_else(|_| Err(Error::new(ErrorKind::Io, "ring job panicked or was dropped")));
        drop(wait);
        out
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        for t in self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;

    fn direct_file(dir: &std::path::Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(dir.join("f"))
            .unwrap()
    }

    /// Round trip through the staging path (unaligned buffer, partial tail) with and without
    /// registered buffers, hashes agreeing on both sides; reading past the end is `Corrupt`.
    #[test]
    fn pipeline_round_trips_and_detects_short_files() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = RingConfig { chunk_bytes: 64 << 10, queue_depth: 3, ..Default::default() };
        for registered in [true, false] {
            let mut ctx = RingCtx::new(cfg).unwrap();
            assert!(ctx.staging_registered(), "root registers buffers here");
            ctx.registered = registered;
            let f = direct_file(dir.path());
            let size = 5 * (64 << 10) + 1234;
            let mut src: Vec<u8> = (0..size + 1).map(|i| (i * 7) as u8).collect();
            let (mut hw, mut hr) = (blake3::Hasher::new(), blake3::Hasher::new());
            // SAFETY: src[1..] is valid for size bytes (deliberately unaligned).
            unsafe {
                ctx.pipeline(
                    Dir::Write,
                    f.as_raw_fd(),
                    4096,
                    src.as_mut_ptr().add(1),
                    size,
                    Some(&mut hw),
                )
            }
            .unwrap();
            let mut dst = vec![0u8; size + 3];
            // SAFETY: dst[3..] is valid for size bytes.
            unsafe {
                ctx.pipeline(
                    Dir::Read,
                    f.as_raw_fd(),
                    4096,
                    dst.as_mut_ptr().add(3),
                    size,
                    Some(&mut hr),
                )
            }
            .unwrap();
            assert_eq!(dst[3..], src[1..]);
            assert_eq!(hw.finalize(), hr.finalize());
            assert_eq!(hr.finalize(), blake3::hash(&src[1..]));
            let mut big = AlignedBuf::new(size + (1 << 20));
            let p = big.as_mut_ptr();
            // SAFETY: big is valid for the requested length.
            let err =
                unsafe { ctx.pipeline(Dir::Read, f.as_raw_fd(), 4096, p, size + (1 << 20), None) }
                    .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        }
    }
}
