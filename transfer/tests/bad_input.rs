//! Bad inputs get typed errors, and a refused request leaves the connection usable.

use kvfs_transfer::{
    Buffer, BufferOptions, DataOp, Engine, EngineConfig, ErrorKind, TransferOp, TransferRequest,
    Transports,
};

async fn pair(transports: Transports) -> (Engine, Engine) {
    pair_sized(transports, 16).await
}

async fn pair_sized(transports: Transports, batch_items_max: usize) -> (Engine, Engine) {
    let cfg = EngineConfig { transports, batch_items_max, ..EngineConfig::default() };
    (Engine::start(cfg.clone()).await.unwrap(), Engine::start(cfg).await.unwrap())
}

async fn bad_inputs(transports: Transports) {
    let (a, b) = pair(transports).await;
    let la = a.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let req = |op, local_addr, remote_addr, len| TransferRequest {
        op,
        segment: seg.clone(),
        local_addr,
        remote_addr,
        len,
    };
    let kind = |r: kvfs_transfer::Result<()>| r.unwrap_err().kind();

    // Remote range past the end of the peer's buffer, for both directions.
    let past = rb.addr() + rb.len() as u64 - 10;
    assert_eq!(
        kind(a.transfer_one(&req(TransferOp::Write, la.addr(), past, 100)).await),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        kind(a.transfer_one(&req(TransferOp::Read, la.addr(), past, 100)).await),
        ErrorKind::OutOfRange
    );
    // An address the peer never registered, and one that wraps around.
    assert_eq!(
        kind(a.transfer_one(&req(TransferOp::Read, la.addr(), 4096, 100)).await),
        ErrorKind::OutOfRange
    );
    assert_eq!(
        kind(a.transfer_one(&req(TransferOp::Read, la.addr(), u64::MAX - 5, 100)).await),
        ErrorKind::OutOfRange
    );
    // Zero length.
    assert_eq!(
        kind(a.transfer_one(&req(TransferOp::Read, la.addr(), rb.addr(), 0)).await),
        ErrorKind::InvalidArgument
    );
    // Local memory that is not registered.
    let stray = vec![0u8; 4096];
    let r = a.transfer_one(&req(TransferOp::Read, stray.as_ptr() as u64, rb.addr(), 4096)).await;
    assert_eq!(kind(r), ErrorKind::NotRegistered);
    // A peer buffer registered for local use only is not remotely accessible.
    let private =
        std::sync::Arc::new(kvfs_transfer::Buffer::new(4096, &BufferOptions::default()).unwrap());
    b.register_buffer(private.clone(), false).unwrap();
    let r = a.transfer_one(&req(TransferOp::Write, la.addr(), private.addr(), 4096)).await;
    assert_eq!(kind(r), ErrorKind::OutOfRange);
    // Oversized batch.
    let many = vec![req(TransferOp::Read, la.addr(), rb.addr(), 1); 17];
    assert_eq!(a.submit(many).err().map(|e| e.kind()), Some(ErrorKind::BatchTooLarge));
    // After all that, the same segment still works, and per-item statuses are independent.
    rb.write_at(0, b"still alive").unwrap();
    let mixed = vec![
        req(TransferOp::Read, la.addr(), rb.addr(), 11),
        req(TransferOp::Read, la.addr() + 100, past, 100),
    ];
    let results = a.transfer(mixed).await.unwrap();
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::OutOfRange);
    let mut got = [0u8; 11];
    la.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"still alive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_give_typed_errors_tcp() {
    bad_inputs(Transports::tcp_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_give_typed_errors_shm() {
    bad_inputs(Transports::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_segments_give_typed_errors() {
    let (a, _b) = pair(Transports::default()).await;
    let free_port =
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let err = a.open_segment(&format!("127.0.0.1:{free_port}")).await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::UnknownSegment, "{err}");
    let err = a.open_segment("not an address").await.err().unwrap();
    assert_eq!(err.kind(), ErrorKind::UnknownSegment, "{err}");
    // Something that listens but is not an engine: the handshake fails, not hangs.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    let err = a.open_segment(&addr.to_string()).await.err().unwrap();
    assert!(matches!(err.kind(), ErrorKind::UnknownSegment | ErrorKind::Timeout), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_segment_and_registration_rules() {
    let (a, _) = pair(Transports::default()).await;
    let buf = a.alloc_buffer(8192, &BufferOptions::default()).unwrap();
    // Overlapping registration is refused.
    // SAFETY: the region is never used for a transfer (the registration fails).
    let r = unsafe { a.register_memory(buf.addr() + 4096, 4096, true) };
    assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidArgument);
    // Transfers within the engine's own segment are memcpys.
    let own = a.open_segment(a.name()).await.unwrap();
    buf.write_at(0, b"abc").unwrap();
    let req = TransferRequest {
        op: TransferOp::Write,
        segment: own,
        local_addr: buf.addr(),
        remote_addr: buf.addr() + 4096,
        len: 3,
    };
    a.transfer_one(&req).await.unwrap();
    let mut got = [0u8; 3];
    buf.read_at(4096, &mut got).unwrap();
    assert_eq!(&got, b"abc");
    a.unregister(buf.addr()).unwrap();
    assert_eq!(a.transfer_one(&req).await.unwrap_err().kind(), ErrorKind::NotRegistered);
}

/// `write_own` copies into the engine's own remotely accessible memory only: a range outside
/// one such region, a local-only region, no bytes, or an unregistered region are typed errors
/// that write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_into_the_own_memory_are_checked_copies() {
    let (a, _) = pair(Transports::default()).await;
    let buf = a.alloc_buffer(8192, &BufferOptions::default()).unwrap();
    let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    a.write_own(buf.addr() + 100, &data).unwrap();
    let mut got = vec![0u8; data.len()];
    buf.read_at(100, &mut got).unwrap();
    assert_eq!(got, data);
    let kind = |r: kvfs_transfer::Result<()>| r.unwrap_err().kind();
    // Past the end, straddling it, and below the region.
    assert_eq!(kind(a.write_own(buf.addr() + 8192, b"x")), ErrorKind::OutOfRange);
    assert_eq!(kind(a.write_own(buf.addr() + 8000, &data)), ErrorKind::OutOfRange);
    assert_eq!(kind(a.write_own(buf.addr().wrapping_sub(4096), b"x")), ErrorKind::OutOfRange);
    assert_eq!(kind(a.write_own(buf.addr(), b"")), ErrorKind::InvalidArgument);
    // A region registered for local use only is not a place peers (or this call) write to.
    let local = Buffer::new(4096, &BufferOptions::default()).unwrap();
    // SAFETY: `local` outlives its registration (unregistered below).
    unsafe { a.register_memory(local.addr(), 4096, false) }.unwrap();
    assert_eq!(kind(a.write_own(local.addr(), b"x")), ErrorKind::OutOfRange);
    a.unregister(local.addr()).unwrap();
    let mut untouched = [7u8; 1];
    local.read_at(0, &mut untouched).unwrap();
    assert_eq!(untouched, [0], "a refused write leaves the memory alone");
    a.unregister(buf.addr()).unwrap();
    assert_eq!(kind(a.write_own(buf.addr(), b"x")), ErrorKind::OutOfRange);
}

/// A batch of copies into the engine's own memory, small (on the calling thread) and large in
/// all (split over the copy threads): every byte lands, each bad item is its own typed error
/// in its place, and the others are written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_own_copies_land_whole_and_fail_item_by_item() {
    let (a, _) = pair(Transports::default()).await;
    let buf = a.alloc_buffer(16 << 20, &BufferOptions::default()).unwrap();
    for (n, len) in [(3usize, 1000usize), (12, 1 << 20), (5, 3 << 20)] {
        let data: Vec<Vec<u8>> =
            (0..n).map(|i| (0..len).map(|j| (i * 13 + j * 7 + len) as u8).collect()).collect();
        let mut items: Vec<(u64, &[u8])> = Vec::new();
        for (i, d) in data.iter().enumerate() {
            items.push((buf.addr() + (i * len) as u64, d));
        }
        // Past the end, and empty, in the middle of the batch.
        items.insert(1, (buf.addr() + (16 << 20), &data[0][..]));
        items.insert(2, (buf.addr(), &[]));
        let r = a.write_own_batch(&items);
        assert_eq!(r.len(), n + 2);
        assert_eq!(r[1].as_ref().unwrap_err().kind(), ErrorKind::OutOfRange);
        assert_eq!(r[2].as_ref().unwrap_err().kind(), ErrorKind::InvalidArgument);
        for (k, res) in r.iter().enumerate().filter(|(k, _)| *k != 1 && *k != 2) {
            assert!(res.is_ok(), "{n} x {len}: item {k}: {res:?}");
        }
        for (i, d) in data.iter().enumerate() {
            let mut got = vec![0u8; len];
            buf.read_at(i * len, &mut got).unwrap();
            assert!(got == *d, "{n} x {len}: object {i}");
        }
    }
}

/// Large transfers within the engine's own memory are spread over the copy threads; every byte
/// lands, in both directions, and overlapping ranges still copy as one memmove.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_own_segment_copies_are_exact() {
    let (a, _) = pair(Transports::default()).await;
    let len = (16 << 20) + 12_345; // not a multiple of the parts' 64 KiB alignment
    let src = a.alloc_buffer(len, &BufferOptions::default()).unwrap();
    let dst = a.alloc_buffer(len, &BufferOptions::default()).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i % 253) as u8 ^ (i >> 16) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let own = a.open_segment(a.name()).await.unwrap();
    let req = |op, local: &Buffer, remote: &Buffer, len| TransferRequest {
        op,
        segment: own.clone(),
        local_addr: local.addr(),
        remote_addr: remote.addr(),
        len,
    };
    a.transfer_one(&req(TransferOp::Write, &src, &dst, len as u64)).await.unwrap();
    let mut got = vec![0u8; len];
    dst.read_at(0, &mut got).unwrap();
    assert!(got == pattern, "write within the engine");
    src.write_at(0, &vec![0u8; len]).unwrap();
    a.transfer_one(&req(TransferOp::Read, &src, &dst, len as u64)).await.unwrap();
    src.read_at(0, &mut got).unwrap();
    assert!(got == pattern, "read within the engine");
    // Overlapping ranges of one buffer: shift the first 8 MiB up by 4 KiB.
    let shift = 4096u64;
    let n = 8 << 20;
    let overlap = TransferRequest {
        op: TransferOp::Write,
        segment: own.clone(),
        local_addr: src.addr(),
        remote_addr: src.addr() + shift,
        len: n,
    };
    a.transfer_one(&overlap).await.unwrap();
    let mut moved = vec![0u8; n as usize];
    src.read_at(shift as usize, &mut moved).unwrap();
    assert!(moved[..] == pattern[..n as usize], "overlapping copy is a memmove");
}

/// Small items of one batch travel together in one tcp request; each keeps its own status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_small_items_keep_their_own_status() {
    let (a, b) = pair_sized(Transports::tcp_only(), 1024).await;
    let la = a.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let pattern: Vec<u8> = (0..(4 << 20)).map(|i| (i % 251) as u8).collect();
    rb.write_at(0, &pattern).unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let past = rb.addr() + rb.len() as u64;
    // 200 reads of 1..=9000 bytes at distinct offsets, every 7th out of range; then writes back.
    let mut reqs = Vec::new();
    let mut expect = Vec::new();
    for i in 0..200u64 {
        let len = 1 + (i * 4447) % 9000;
        let off = i * 16384;
        let bad = i % 7 == 3;
        reqs.push(TransferRequest {
            op: TransferOp::Read,
            segment: seg.clone(),
            local_addr: la.addr() + off,
            remote_addr: if bad { past + off } else { rb.addr() + off },
            len,
        });
        expect.push((off as usize, len as usize, bad));
    }
    let results = a.transfer(reqs).await.unwrap();
    for ((off, len, bad), r) in expect.iter().zip(&results) {
        if *bad {
            assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::OutOfRange);
        } else {
            assert!(r.is_ok(), "{r:?}");
            let mut got = vec![0u8; *len];
            la.read_at(*off, &mut got).unwrap();
            assert_eq!(got, pattern[*off..*off + *len]);
        }
    }
    // Writes: a fresh pattern from a's buffer into b at shifted offsets.
    let fresh: Vec<u8> = (0..(4 << 20)).map(|i| (i % 241) as u8 ^ 0x5a).collect();
    la.write_at(0, &fresh).unwrap();
    let writes: Vec<TransferRequest> = expect
        .iter()
        .map(|&(off, len, bad)| TransferRequest {
            op: TransferOp::Write,
            segment: seg.clone(),
            local_addr: la.addr() + off as u64,
            remote_addr: if bad { past + off as u64 } else { rb.addr() + off as u64 + 1 },
            len: len as u64,
        })
        .collect();
    let results = a.transfer(writes).await.unwrap();
    for ((off, len, bad), r) in expect.iter().zip(&results) {
        if *bad {
            assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::OutOfRange);
        } else {
            assert!(r.is_ok(), "{r:?}");
            let mut got = vec![0u8; *len];
            rb.read_at(*off + 1, &mut got).unwrap();
            assert_eq!(got, fresh[*off..*off + *len]);
        }
    }
}

/// Guarded reads: served only while the owner's check vouches for the guard, over tcp and on
/// the engine's own memory; refused (`Stale`) without a check installed; an oversized guard is
/// a typed error, and the connection stays usable after every refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_reads_are_served_only_while_the_owner_vouches() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let (a, b) = pair(Transports::tcp_only()).await;
    let la = a.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    // SAFETY: no transfer touches the buffer while it is filled.
    unsafe { rb.as_mut_slice()[..8192].fill(0x5a) };
    let seg = a.open_segment(b.name()).await.unwrap();
    let guard = |v: &[u8]| -> Arc<[u8]> { Arc::from(v) };
    let kind = |r: kvfs_transfer::Result<()>| r.unwrap_err().kind();

    // No check installed: refused.
    let r = a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(b"v1")).await;
    assert_eq!(kind(r), ErrorKind::Stale);

    // The owner vouches for guard "v<current>" on the first 8 KiB only.
    let current = Arc::new(AtomicU64::new(1));
    let (cur, base) = (current.clone(), rb.addr());
    b.set_read_guard(Box::new(move |addr, len, g| {
        let want = format!("v{}", cur.load(Ordering::SeqCst));
        g == want.as_bytes() && addr >= base && addr + len <= base + 8192
    }))
    .unwrap();
    assert!(b.set_read_guard(Box::new(|_, _, _| true)).is_err(), "installed once");
    a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(b"v1")).await.unwrap();
    // SAFETY: the read above has completed.
    assert!(unsafe { la.as_slice() }[..4096].iter().all(|&x| x == 0x5a));
    let r = a.read_guarded(&seg, la.addr(), rb.addr() + 4096, 8192, guard(b"v1")).await;
    assert_eq!(kind(r), ErrorKind::Stale, "outside the vouched range");
    current.store(2, Ordering::SeqCst);
    let r = a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(b"v1")).await;
    assert_eq!(kind(r), ErrorKind::Stale, "the owner moved on");
    a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(b"v2")).await.unwrap();

    // Bad input: oversized guard, zero length, unregistered local memory.
    let huge = vec![b'x'; 5000];
    let r = a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(&huge)).await;
    assert_eq!(kind(r), ErrorKind::InvalidArgument);
    let r = a.read_guarded(&seg, la.addr(), rb.addr(), 0, guard(b"v2")).await;
    assert_eq!(kind(r), ErrorKind::InvalidArgument);
    let stray = vec![0u8; 4096];
    let r = a.read_guarded(&seg, stray.as_ptr() as u64, rb.addr(), 4096, guard(b"v2")).await;
    assert_eq!(kind(r), ErrorKind::NotRegistered);
    a.read_guarded(&seg, la.addr(), rb.addr(), 4096, guard(b"v2")).await.unwrap();

    // The engine's own memory: the same check, then a memcpy.
    let own = b.open_segment(b.name()).await.unwrap();
    let lb = b.alloc_buffer(4096, &BufferOptions::default()).unwrap();
    b.read_guarded(&own, lb.addr(), rb.addr(), 4096, guard(b"v2")).await.unwrap();
    let r = b.read_guarded(&own, lb.addr(), rb.addr(), 4096, guard(b"v1")).await;
    assert_eq!(kind(r), ErrorKind::Stale);
    assert!(b.guarded_is_direct(&own, rb.addr(), 4096));
    assert!(a.guarded_is_direct(&seg, rb.addr(), 4096));
}

/// Guarded reads into borrowed (unregistered) memory: the same owner's check over the tcp
/// peer's direct connection and on the engine's own memory, the bytes landing in the caller's
/// vector; what it cannot do without registered memory (too large for the direct connection,
/// an empty or wrapping range) is `None`, leaving the caller to the registered path; the
/// connection stays usable after each refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_reads_into_borrowed_memory_check_the_owner_the_same_way() {
    let (a, b) = pair(Transports::tcp_only()).await;
    let rb = b.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let pattern: Vec<u8> = (0..8192).map(|i| (i * 13 + 5) as u8).collect();
    // SAFETY: no transfer touches the buffer while it is filled.
    unsafe { rb.as_mut_slice()[..8192].copy_from_slice(&pattern) };
    let base = rb.addr();
    b.set_read_guard(Box::new(move |addr, len, g| {
        g == b"v1" && addr >= base && addr + len <= base + (2 << 20) + 8
    }))
    .unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let own = b.open_segment(b.name()).await.unwrap();
    for (engine, seg) in [(&a, &seg), (&b, &own)] {
        for _ in 0..3 {
            let mut v = vec![0u8; 4096];
            engine.read_guarded_into(seg, &mut v, base + 100, b"v1").await.unwrap().unwrap();
            assert_eq!(v, pattern[100..4196]);
            let r = engine.read_guarded_into(seg, &mut v, base, b"v0").await.unwrap();
            assert_eq!(r.unwrap_err().kind(), ErrorKind::Stale, "the owner refuses the guard");
            let r = engine.read_guarded_into(seg, &mut v, base + (2 << 20), b"v1").await;
            assert_eq!(r.unwrap().unwrap_err().kind(), ErrorKind::Stale, "outside the vouched");
        }
        assert!(engine.read_guarded_into(seg, &mut [], base, b"v1").await.is_none());
        let mut v = vec![0u8; 16];
        assert!(engine.read_guarded_into(seg, &mut v, u64::MAX - 4, b"v1").await.is_none());
    }
    // Over the direct connection's size: the registered path's job.
    let mut big = vec![0u8; (1 << 20) + 1];
    assert!(a.read_guarded_into(&seg, &mut big, base, b"v1").await.is_none());
    // Outside any of the peer's regions: its answer, not a broken connection.
    let mut v = vec![0u8; 4096];
    let r = a.read_guarded_into(&seg, &mut v, 0x10, b"v1").await.unwrap();
    assert!(r.is_err());
    a.read_guarded_into(&seg, &mut v, base, b"v1").await.unwrap().unwrap();
    assert_eq!(v, pattern[..4096]);
}

/// Guarded batch reads (`ReadGuardedV` packs): each range checked on its own guard, the
/// vouched ones read byte for byte, the others `Stale`, malformed items their own typed
/// error; more ranges than a pack holds and ranges too large for one go in several requests;
/// the connection stays usable afterwards, and the engine's own memory answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_batch_reads_check_every_range_on_its_own_guard() {
    use std::sync::Arc;
    let (a, b) = pair(Transports::tcp_only()).await;
    const N: usize = 600; // more than one pack's items
    const ITEM: usize = 4096;
    let la = a.alloc_buffer(8 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(8 << 20, &BufferOptions::default()).unwrap();
    let pattern = |i: usize| (0..ITEM).map(|j| (i * 31 + j * 7) as u8).collect::<Vec<u8>>();
    // SAFETY: no transfer touches the buffer while it is filled.
    let remote = unsafe { rb.as_mut_slice() };
    for i in 0..N {
        remote[i * ITEM..(i + 1) * ITEM].copy_from_slice(&pattern(i));
    }
    remote[N * ITEM..N * ITEM + (3 << 20)].fill(0xc3);
    // The owner vouches for "ok:<offset>" at that offset only.
    let base = rb.addr();
    b.set_read_guard(Box::new(move |addr, _len, g| g == format!("ok:{}", addr - base).as_bytes()))
        .unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let guard = |s: String| -> Arc<[u8]> { Arc::from(s.as_bytes()) };
    let mut items: Vec<(u64, u64, u64, Arc<[u8]>)> = (0..N)
        .map(|i| {
            let off = (i * ITEM) as u64;
            // Every seventh guard names the wrong offset: refused.
            let g = if i % 7 == 3 { format!("ok:{}", off + 1) } else { format!("ok:{off}") };
            (la.addr() + off, base + off, ITEM as u64, guard(g))
        })
        .collect();
    // One range larger than a pack item (goes alone), vouched.
    let big_off = (N * ITEM) as u64;
    items.push((la.addr() + big_off, base + big_off, 3 << 20, guard(format!("ok:{big_off}"))));
    // Malformed: zero length, unregistered local memory, outside the peer's memory, a guard
    // over the limit.
    let stray = vec![0u8; 4096];
    items.push((la.addr(), base, 0, guard("ok:0".into())));
    items.push((stray.as_ptr() as u64, base, 4096, guard("ok:0".into())));
    items.push((la.addr(), base + (16 << 20), 4096, guard(format!("ok:{}", 16 << 20))));
    let results = a.read_guarded_batch(&seg, &items).await;
    assert_eq!(results.len(), N + 4);
    // SAFETY: every read above has completed.
    let local = unsafe { la.as_slice() };
    for (i, r) in results[..N].iter().enumerate() {
        if i % 7 == 3 {
            assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Stale, "item {i}");
        } else {
            assert!(r.is_ok(), "item {i}: {r:?}");
            assert_eq!(local[i * ITEM..(i + 1) * ITEM], pattern(i)[..], "item {i}");
        }
    }
    assert!(results[N].is_ok(), "{:?}", results[N]);
    assert!(local[N * ITEM..N * ITEM + (3 << 20)].iter().all(|&x| x == 0xc3));
    let kinds: Vec<ErrorKind> =
        results[N + 1..].iter().map(|r| r.as_ref().unwrap_err().kind()).collect();
    assert_eq!(
        kinds,
        [ErrorKind::InvalidArgument, ErrorKind::NotRegistered, ErrorKind::OutOfRange]
    );
    // The owner served the 600 small ranges (and the out-of-range one) as three packs, and
    // the 3 MiB range alone.
    let served = b.requests_served();
    let (packs, lone) = (served.get(DataOp::ReadGuardedV), served.get(DataOp::ReadGuarded));
    assert_eq!((packs, lone), (3, 1), "{served:?}");
    let huge = guard("x".repeat(5000));
    let two = [
        (la.addr(), base, ITEM as u64, guard("ok:0".into())),
        (la.addr() + 4096, base + 4096, ITEM as u64, huge),
    ];
    for r in a.read_guarded_batch(&seg, &two).await {
        assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
    // The connections still serve.
    a.read_guarded(&seg, la.addr(), base, 4096, guard("ok:0".into())).await.unwrap();
    // The engine's own memory: the same checks, then a memcpy each.
    let own = b.open_segment(b.name()).await.unwrap();
    let lb = b.alloc_buffer(2 * ITEM, &BufferOptions::default()).unwrap();
    let mine = [
        (lb.addr(), base + ITEM as u64, ITEM as u64, guard(format!("ok:{ITEM}"))),
        (lb.addr() + ITEM as u64, base, ITEM as u64, guard("ok:1".into())),
    ];
    let r = b.read_guarded_batch(&own, &mine).await;
    assert!(r[0].is_ok(), "{:?}", r[0]);
    assert_eq!(r[1].as_ref().unwrap_err().kind(), ErrorKind::Stale);
    // SAFETY: the reads above have completed.
    assert_eq!(unsafe { lb.as_slice() }[..ITEM], pattern(1)[..]);
    // Many items, megabytes in all: split over the copy threads, each still checked.
    let lb = b.alloc_buffer(N * ITEM, &BufferOptions::default()).unwrap();
    let mine: Vec<(u64, u64, u64, Arc<[u8]>)> = (0..N)
        .map(|i| {
            let off = (i * ITEM) as u64;
            let g = if i % 5 == 2 { format!("ok:{}", off + 1) } else { format!("ok:{off}") };
            (lb.addr() + off, base + off, ITEM as u64, guard(g))
        })
        .collect();
    let r = b.read_guarded_batch(&own, &mine).await;
    // SAFETY: the reads above have completed.
    let got = unsafe { lb.as_slice() };
    for (i, r) in r.iter().enumerate() {
        if i % 5 == 2 {
            assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Stale, "own item {i}");
        } else {
            assert!(r.is_ok(), "own item {i}: {r:?}");
            assert_eq!(got[i * ITEM..(i + 1) * ITEM], pattern(i)[..], "own item {i}");
        }
    }
}

/// Lone small requests go over the peer's direct connection, sent and received by the caller's
/// own task: one cancelled at any point (here by a timeout too short for the round trip) must
/// leave the next request exact, and concurrent ones (which find it in use and take the pooled
/// connections) must each get their own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_and_concurrent_lone_requests_stay_exact() {
    use std::time::Duration;
    let (a, b) = pair(Transports::tcp_only()).await;
    let la = a.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let pattern = |i: usize| (i * 31 % 251) as u8;
    // SAFETY: no transfer touches the buffer while it is filled.
    unsafe { rb.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = pattern(i)) };
    let req = |op, at: u64, len: u64| TransferRequest {
        op,
        segment: seg.clone(),
        local_addr: la.addr() + at,
        remote_addr: rb.addr() + at,
        len,
    };
    let exact = |at: usize, len: usize| {
        // SAFETY: the transfers into this range have completed.
        let got = unsafe { &la.as_slice()[at..at + len] };
        got.iter().enumerate().all(|(i, &x)| x == pattern(at + i))
    };
    for round in 0..200u64 {
        let at = (round % 64) * 8192;
        let len = 512 + (round % 7) * 1000;
        // Cancelled somewhere between sending and receiving (or before sending).
        let cut = Duration::from_micros(round % 40);
        let _ = tokio::time::timeout(cut, a.transfer_one(&req(TransferOp::Read, at, len))).await;
        let at = at + 4096;
        // SAFETY: no transfer touches this range now.
        unsafe { la.as_mut_slice()[at as usize..(at + len) as usize].fill(0) };
        a.transfer_one(&req(TransferOp::Read, at, len)).await.unwrap();
        assert!(exact(at as usize, len as usize), "round {round}: read after a cancelled one");
    }
    // Concurrent lone reads of distinct ranges, each checked.
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let (a, seg, la, rb) = (a.clone(), seg.clone(), la.clone(), rb.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..100u64 {
                let at = (1 << 20) + t * 262_144 + (i % 32) * 8192;
                let r = TransferRequest {
                    op: TransferOp::Read,
                    segment: seg.clone(),
                    local_addr: la.addr() + at,
                    remote_addr: rb.addr() + at,
                    len: 4096,
                };
                a.transfer_one(&r).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for t in 0..8usize {
        for i in 0..32usize {
            assert!(exact((1 << 20) + t * 262_144 + i * 8192, 4096), "task {t}, read {i}");
        }
    }
    // A refused request keeps the direct connection usable.
    let mut past = req(TransferOp::Read, 0, 100);
    past.remote_addr = rb.addr() + (4 << 20) - 10;
    assert_eq!(a.transfer_one(&past).await.unwrap_err().kind(), ErrorKind::OutOfRange);
    // A write, then the read that sees it.
    // SAFETY: no transfer touches this range now.
    unsafe { la.as_mut_slice()[..4096].fill(0xa5) };
    a.transfer_one(&req(TransferOp::Write, 0, 4096)).await.unwrap();
    // SAFETY: the write has completed.
    assert!(unsafe { rb.as_slice() }[..4096].iter().all(|&x| x == 0xa5));
}

/// Noted writes: the owner's hook sees the range and the note once the bytes are in place and
/// before the writer is answered (lone small writes on the direct connection, larger ones on
/// the pooled connections, and on the engine's own memory); a refused note still wrote the
/// bytes; no hook refuses every note; bad input is a typed error and never reaches the hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noted_writes_reach_the_owner_after_their_bytes() {
    use std::sync::{Arc, Mutex};
    let (a, b) = pair(Transports::tcp_only()).await;
    let la = a.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(4 << 20, &BufferOptions::default()).unwrap();
    let seg = a.open_segment(b.name()).await.unwrap();
    let note = |v: &[u8]| -> Arc<[u8]> { Arc::from(v) };
    let fill = |v: u8, len: usize| {
        // SAFETY: no transfer touches the local buffer between writes.
        unsafe { la.as_mut_slice()[..len].fill(v) };
    };
    let remote = |at: usize, len: usize| {
        // SAFETY: the writes into this range have completed.
        unsafe { rb.as_slice()[at..at + len].to_vec() }
    };

    // No hook: the bytes land, the note is refused.
    fill(1, 4096);
    assert!(!a.write_noted(&seg, la.addr(), rb.addr(), 4096, note(b"k@1")).await.unwrap());
    assert!(remote(0, 4096).iter().all(|&x| x == 1));

    // The hook records what it was told and what the range held when it was called.
    type Seen = (u64, u64, Vec<u8>, bool);
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let log = seen.clone();
    b.set_write_note(Box::new(move |addr, len, n| {
        // SAFETY: the range is inside the registered buffer (checked before the hook runs).
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        let landed = bytes.iter().all(|&x| x == bytes[0]) && bytes[0] != 0;
        log.lock().unwrap().push((addr, len, n.to_vec(), landed));
        n != b"refuse"
    }))
    .unwrap();
    assert!(b.set_write_note(Box::new(|_, _, _| true)).is_err(), "installed once");
    let take = || std::mem::take(&mut *seen.lock().unwrap());

    fill(2, 4096);
    assert!(a.write_noted(&seg, la.addr(), rb.addr() + 8192, 4096, note(b"k@2")).await.unwrap());
    assert_eq!(take(), vec![(rb.addr() + 8192, 4096, b"k@2".to_vec(), true)]);
    assert!(remote(8192, 4096).iter().all(|&x| x == 2));

    fill(3, 4096);
    let refused = a.write_noted(&seg, la.addr(), rb.addr(), 4096, note(b"refuse")).await;
    assert!(!refused.unwrap(), "refused note");
    assert!(remote(0, 4096).iter().all(|&x| x == 3), "a refused note still wrote the bytes");
    assert_eq!(take().len(), 1);

    // Larger than a direct request: one request on a pooled connection, one call of the hook
    // for the whole range.
    fill(4, 3 << 20);
    assert!(a.write_noted(&seg, la.addr(), rb.addr(), 3 << 20, note(b"big")).await.unwrap());
    assert_eq!(take(), vec![(rb.addr(), 3 << 20, b"big".to_vec(), true)]);

    // Bad input never reaches the hook; the connection stays usable.
    let kind = |r: kvfs_transfer::Result<bool>| r.unwrap_err().kind();
    let r = a.write_noted(&seg, la.addr(), rb.addr() + (4 << 20) - 100, 4096, note(b"x")).await;
    assert_eq!(kind(r), ErrorKind::OutOfRange);
    let r = a.write_noted(&seg, la.addr(), rb.addr(), 4096, note(&[b'x'; 5000])).await;
    assert_eq!(kind(r), ErrorKind::InvalidArgument);
    let r = a.write_noted(&seg, la.addr(), rb.addr(), 0, note(b"x")).await;
    assert_eq!(kind(r), ErrorKind::InvalidArgument);
    let stray = vec![0u8; 4096];
    let r = a.write_noted(&seg, stray.as_ptr() as u64, rb.addr(), 4096, note(b"x")).await;
    assert_eq!(kind(r), ErrorKind::NotRegistered);
    assert!(take().is_empty());
    fill(5, 4096);
    assert!(a.write_noted(&seg, la.addr(), rb.addr(), 4096, note(b"k@5")).await.unwrap());
    assert_eq!(take().len(), 1);

    // The engine's own memory: a memcpy, then the hook.
    let own = b.open_segment(b.name()).await.unwrap();
    let lb = b.alloc_buffer(4096, &BufferOptions::default()).unwrap();
    // SAFETY: no transfer touches the buffer while it is filled.
    unsafe { lb.as_mut_slice().fill(6) };
    assert!(b.write_noted(&own, lb.addr(), rb.addr() + 4096, 4096, note(b"own")).await.unwrap());
    assert_eq!(take(), vec![(rb.addr() + 4096, 4096, b"own".to_vec(), true)]);
}
