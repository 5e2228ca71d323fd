//! Device memory (a GPU's, registered with `Engine::register_device_memory`) reached by peers:
//! reads and writes over tcp staged through host memory in pieces, packs of small ranges,
//! the engine's own copies, a same-host peer that cannot map it, device failures, and device
//! memory refused as the local side.
//!
//! CI has no GPU, so the device here is `Cells`: memory the engine can only reach through the
//! `DeviceMemory` calls, as it reaches a GPU (`scripts/test-gpu` runs the same paths against a
//! real one through `kvfs_tiers::hbm`). Every call is counted, so the tests also check that the
//! engine never bypassed them.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use kvfs_transfer::testing::pattern;
use kvfs_transfer::{
    BufferOptions, DEVICE_CHUNK_BYTES, DeviceMemory, Engine, EngineConfig, ErrorKind, TransferOp,
    TransferRequest, Transports,
};

/// Where the device range is addressed: far from any host mapping the test makes.
const DEV_ADDR: u64 = 0x4000_0000_0000;
const DEV_LEN: usize = 12 << 20;

struct Cells {
    mem: Mutex<Vec<u8>>,
    calls: AtomicUsize,
    /// The largest piece one call moved.
    largest: AtomicUsize,
    /// Host regions the engine asked to pin, and unpinned again.
    pins: Mutex<Vec<(u64, u64)>>,
    unpins: Mutex<Vec<u64>>,
    /// Whether `pin_host` agrees.
    pin_ok: std::sync::atomic::AtomicBool,
    /// Offsets at or past this fail (u64::MAX: none).
    fail_from: AtomicU64,
}

impl Cells {
    fn new() -> Arc<Cells> {
        Arc::new(Cells {
            mem: Mutex::new(vec![0u8; DEV_LEN]),
            calls: AtomicUsize::new(0),
            largest: AtomicUsize::new(0),
            pins: Mutex::default(),
            unpins: Mutex::default(),
            pin_ok: std::sync::atomic::AtomicBool::new(true),
            fail_from: AtomicU64::new(u64::MAX),
        })
    }

    fn check(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.largest.fetch_max(len, Ordering::Relaxed);
        if offset + len as u64 > self.fail_from.load(Ordering::Relaxed) {
            return Err(format!("injected failure at {offset}"));
        }
        let start = usize::try_from(offset).map_err(|e| e.to_string())?;
        assert!(start + len <= DEV_LEN, "the engine asked past the device range");
        Ok(start..start + len)
    }

    fn snapshot(&self, offset: usize, len: usize) -> Vec<u8> {
        self.mem.lock().unwrap()[offset..offset + len].to_vec()
    }
}

impl DeviceMemory for Cells {
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        let r = self.check(offset, dst.len())?;
        dst.copy_from_slice(&self.mem.lock().unwrap()[r]);
        Ok(())
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), String> {
        let r = self.check(offset, src.len())?;
        self.mem.lock().unwrap()[r].copy_from_slice(src);
        Ok(())
    }

    fn pin_host(&self, addr: u64, len: u64) -> bool {
        self.pins.lock().unwrap().push((addr, len));
        self.pin_ok.load(Ordering::Relaxed)
    }

    fn unpin_host(&self, addr: u64) {
        self.unpins.lock().unwrap().push(addr);
    }
}

async fn engine(transports: Transports) -> Engine {
    Engine::start(EngineConfig { transports, ..EngineConfig::default() }).await.unwrap()
}

fn req(
    seg: &kvfs_transfer::SegmentHandle,
    op: TransferOp,
    local: u64,
    remote: u64,
    len: u64,
) -> TransferRequest {
    TransferRequest { op, segment: seg.clone(), local_addr: local, remote_addr: remote, len }
}

/// A peer writes and reads back ranges of every shape: inside one piece, across pieces, not
/// aligned, and a batch of small ones (packed into one request).
async fn round_trips(transports: Transports) {
    let owner = engine(transports).await;
    let cells = Cells::new();
    owner.register_device_memory(DEV_ADDR, DEV_LEN as u64, cells.clone()).unwrap();
    let peer = engine(transports).await;
    let buf = peer.alloc_buffer(DEV_LEN, &BufferOptions::default()).unwrap();
    let seg = peer.open_segment(owner.name()).await.unwrap();
    for (seed, offset, len) in [
        (1u64, 0usize, 4096usize),
        (2, 4097, 5 * DEVICE_CHUNK_BYTES / 2 + 123),
        (3, DEV_LEN - 7, 7),
    ] {
        let data = pattern(seed, 0, len);
        buf.write_at(0, &data).unwrap();
        let at = DEV_ADDR + offset as u64;
        peer.transfer_one(&req(&seg, TransferOp::Write, buf.addr(), at, len as u64)).await.unwrap();
        assert_eq!(cells.snapshot(offset, len), data, "device bytes after a write of {len}");
        buf.write_at(0, &vec![0u8; len]).unwrap();
        peer.transfer_one(&req(&seg, TransferOp::Read, buf.addr(), at, len as u64)).await.unwrap();
        let mut got = vec![0u8; len];
        buf.read_at(0, &mut got).unwrap();
        assert_eq!(got, data, "bytes read back ({len} at {offset})");
    }
    // 64 small writes in one batch, then reads of them into other places.
    let n = 64usize;
    let piece = 3000usize;
    let data = pattern(9, 0, n * piece);
    buf.write_at(0, &data).unwrap();
    let writes: Vec<_> = (0..n)
        .map(|i| {
            let off = (i * piece) as u64;
            req(&seg, TransferOp::Write, buf.addr() + off, DEV_ADDR + 2 * off, piece as u64)
        })
        .collect();
    for r in peer.transfer(writes).await.unwrap() {
        r.unwrap();
    }
    let reads: Vec<_> = (0..n)
        .map(|i| {
            let off = (i * piece) as u64;
            let local = buf.addr() + (n * piece) as u64 + off;
            req(&seg, TransferOp::Read, local, DEV_ADDR + 2 * off, piece as u64)
        })
        .collect();
    for r in peer.transfer(reads).await.unwrap() {
        r.unwrap();
    }
    let mut got = vec![0u8; n * piece];
    buf.read_at(n * piece, &mut got).unwrap();
    assert_eq!(got, data, "the batch read back what the batch wrote");
    for i in 0..n {
        assert_eq!(cells.snapshot(2 * i * piece, piece), data[i * piece..(i + 1) * piece]);
    }
    assert!(cells.calls.load(Ordering::Relaxed) > 0);
    let largest = cells.largest.load(Ordering::Relaxed);
    assert!(largest <= DEVICE_CHUNK_BYTES, "tcp moved a piece of {largest} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_reads_and_writes_device_memory_over_tcp() {
    round_trips(Transports::tcp_only()).await;
}

/// With shm enabled the peer is on the same host, but device memory cannot be mapped: the
/// engine must fall back to tcp rather than fail or touch the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_peer_reaches_device_memory_over_tcp() {
    round_trips(Transports::default()).await;
}

/// The engine's own transfers (a client in the owner's process) copy straight between its host
/// memory and the device through the same calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_copies_to_and_from_its_own_device_memory() {
    let e = engine(Transports::default()).await;
    let cells = Cells::new();
    e.register_device_memory(DEV_ADDR, DEV_LEN as u64, cells.clone()).unwrap();
    let buf = e.alloc_buffer(2 * DEV_LEN, &BufferOptions::default()).unwrap();
    let seg = e.open_segment(e.name()).await.unwrap();
    let len = 3 * DEVICE_CHUNK_BYTES + 17;
    let data = pattern(4, 0, len);
    buf.write_at(0, &data).unwrap();
    e.transfer_one(&req(&seg, TransferOp::Write, buf.addr(), DEV_ADDR + 5, len as u64))
        .await
        .unwrap();
    assert_eq!(cells.snapshot(5, len), data);
    // The first copy offered the host buffer to the device for pinning; later ones do not.
    assert_eq!(*cells.pins.lock().unwrap(), vec![(buf.addr(), buf.len() as u64)]);
    e.transfer_one(&req(&seg, TransferOp::Read, buf.addr() + len as u64, DEV_ADDR + 5, len as u64))
        .await
        .unwrap();
    let mut got = vec![0u8; len];
    buf.read_at(len, &mut got).unwrap();
    assert_eq!(got, data);
    // One call per copy, whole, and the pin undone with the registration.
    assert_eq!(cells.largest.load(Ordering::Relaxed), len);
    assert_eq!(cells.pins.lock().unwrap().len(), 1);
    e.unregister(buf.addr()).unwrap();
    assert_eq!(*cells.unpins.lock().unwrap(), vec![buf.addr()]);
}

/// Device memory cannot be the local side of a transfer, a range past the device region is
/// out of range, and a failing device fails the transfer without hanging; the segment keeps
/// working afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_errors_are_typed_and_leave_the_peer_usable() {
    let owner = engine(Transports::tcp_only()).await;
    let cells = Cells::new();
    owner.register_device_memory(DEV_ADDR, DEV_LEN as u64, cells.clone()).unwrap();
    let peer = engine(Transports::tcp_only()).await;
    let peer_dev = Cells::new();
    peer.register_device_memory(DEV_ADDR, DEV_LEN as u64, peer_dev.clone()).unwrap();
    let buf = peer.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let seg = peer.open_segment(owner.name()).await.unwrap();
    let kind = |r: kvfs_transfer::Result<()>| r.unwrap_err().kind();

    let r = peer.transfer_one(&req(&seg, TransferOp::Read, DEV_ADDR, DEV_ADDR, 4096)).await;
    assert_eq!(kind(r), ErrorKind::InvalidArgument, "device memory as the local side");
    assert_eq!(peer_dev.calls.load(Ordering::Relaxed), 0, "the refused transfer touched nothing");
    let past = DEV_ADDR + DEV_LEN as u64 - 10;
    let r = peer.transfer_one(&req(&seg, TransferOp::Write, buf.addr(), past, 100)).await;
    assert_eq!(kind(r), ErrorKind::OutOfRange);

    cells.fail_from.store(1 << 20, Ordering::Relaxed);
    let len = 3 << 20;
    for op in [TransferOp::Read, TransferOp::Write] {
        let big = peer.alloc_buffer(len, &BufferOptions::default()).unwrap();
        let r = peer.transfer_one(&req(&seg, op, big.addr(), DEV_ADDR, len as u64)).await;
        assert!(r.is_err(), "{op:?} over a failing device must fail");
    }
    cells.fail_from.store(u64::MAX, Ordering::Relaxed);
    buf.write_at(0, b"after the failure").unwrap();
    peer.transfer_one(&req(&seg, TransferOp::Write, buf.addr(), DEV_ADDR + 100, 17)).await.unwrap();
    assert_eq!(cells.snapshot(100, 17), b"after the failure");
}

/// A device that refuses to page-lock a host region is asked once, not at every copy (a
/// refused `cuMemHostRegister` costs a driver call each time), and nothing is unpinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_pin_is_asked_once() {
    let e = engine(Transports::default()).await;
    let cells = Cells::new();
    cells.pin_ok.store(false, Ordering::Relaxed);
    e.register_device_memory(DEV_ADDR, DEV_LEN as u64, cells.clone()).unwrap();
    let buf = e.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let seg = e.open_segment(e.name()).await.unwrap();
    buf.write_at(0, b"pinned or not").unwrap();
    for op in [TransferOp::Write, TransferOp::Read, TransferOp::Write] {
        e.transfer_one(&req(&seg, op, buf.addr(), DEV_ADDR, 13)).await.unwrap();
    }
    assert_eq!(cells.snapshot(0, 13), b"pinned or not");
    assert_eq!(cells.pins.lock().unwrap().len(), 1, "asked once");
    e.unregister(buf.addr()).unwrap();
    assert!(cells.unpins.lock().unwrap().is_empty(), "nothing was pinned");
}
