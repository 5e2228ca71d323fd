//! Two-process tests of the Transfer Engine: this test process runs one engine, and a
//! `kvfs-te-peer` child process runs the other. Bytes cross real sockets (tcp) or real shared
//! mappings (shm); every byte is checked against a model with blake3.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfs_transfer::testing::{fill_pattern, pattern};
use kvfs_transfer::{
    BatchOptions, Buffer, BufferOptions, Engine, EngineConfig, ErrorKind, SegmentHandle,
    TransferOp, TransferRequest, TransportKind, Transports,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BUF: usize = 64 << 20;
const REMOTE_SEED: u64 = 0xfeed;
const LOCAL_SEED: u64 = 0xbeef;

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    name: String,
    addr: u64,
    len: usize,
}

impl Peer {
    fn start(args: &[&str]) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfs-te-peer"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn kvfs-te-peer");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(w.first(), Some(&"READY"), "peer said {line:?}");
        let (name, addr, len) = (w[1].to_string(), w[2].parse().unwrap(), w[3].parse().unwrap());
        Peer { child, stdin, stdout, name, addr, len }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn fill(&mut self, seed: u64) {
        assert_eq!(self.ask(&format!("fill {seed}")), "OK");
    }

    fn hash(&mut self, off: usize, len: usize) -> String {
        self.ask(&format!("hash {off} {len}"))
    }

    fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child process.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Waits (at most 5 s) until the kernel reports the peer stopped: SIGSTOP is delivered
    /// asynchronously, and a peer still running could answer one more request.
    fn wait_stopped(&self) {
        let tasks = format!("/proc/{}/task", self.child.id());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            // Every thread: one that has not run since the signal may still answer.
            let dir = std::fs::read_dir(&tasks);
            if dir.is_ok_and(|d| {
                d.flatten().all(|t| {
                    let s = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    // Field 3 (after the parenthesised command name) is the state; T means stopped.
                    s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
                })
            }) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the peer did not stop within 5 s");
    }

    fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(transports: Transports, op_timeout_ms: u64) -> EngineConfig {
    EngineConfig { transports, op_timeout_ms, ..EngineConfig::default() }
}

fn peer_args(transports: Transports) -> Vec<&'static str> {
    if transports.shm { vec![] } else { vec!["--tcp-only"] }
}

async fn local_engine(transports: Transports, op_timeout_ms: u64) -> (Engine, Arc<Buffer>) {
    let engine = Engine::start(config(transports, op_timeout_ms)).await.unwrap();
    let buf =
        engine.alloc_buffer(BUF, &BufferOptions { populate: true, ..Default::default() }).unwrap();
    // SAFETY: no transfer runs yet.
    fill_pattern(unsafe { buf.as_mut_slice() }, LOCAL_SEED, 0);
    (engine, buf)
}

/// A batch item over disjoint ranges, with what it does to the models.
struct Item {
    op: TransferOp,
    local: usize,
    remote: usize,
    len: usize,
}

/// Random items whose local ranges are disjoint, and whose remote ranges are disjoint, inside
/// `[lo, lo+span)` of both buffers.
fn random_items(rng: &mut StdRng, lo: usize, span: usize, count: usize) -> Vec<Item> {
    let mut lens = Vec::new();
    let mut total = 0;
    for _ in 0..count {
        let len = match rng.random_range(0..3) {
            0 => rng.random_range(1..=4096),
            1 => rng.random_range(4096..=256 << 10),
            _ => rng.random_range(256 << 10..=4 << 20),
        };
        if total + len + 65536 > span {
            break;
        }
        total += len + 65536;
        lens.push(len);
    }
    let place = |rng: &mut StdRng, lens: &[usize]| {
        let mut order: Vec<usize> = (0..lens.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let slack = span - lens.iter().sum::<usize>();
        let mut pos = vec![0; lens.len()];
        let mut at = lo;
        for &i in &order {
            at += rng.random_range(0..=slack / lens.len().max(1));
            pos[i] = at;
            at += lens[i];
        }
        pos
    };
    let locals = place(rng, &lens);
    let remotes = place(rng, &lens);
    (0..lens.len())
        .map(|i| Item {
            op: if rng.random_bool(0.5) { TransferOp::Read } else { TransferOp::Write },
            local: locals[i],
            remote: remotes[i],
            len: lens[i],
        })
        .collect()
}

fn apply(items: &[Item], local_model: &mut [u8], remote_model: &mut [u8]) {
    for it in items {
        match it.op {
            TransferOp::Write => remote_model[it.remote..it.remote + it.len]
                .copy_from_slice(&local_model[it.local..it.local + it.len]),
            TransferOp::Read => local_model[it.local..it.local + it.len]
                .copy_from_slice(&remote_model[it.remote..it.remote + it.len]),
        }
    }
}

fn requests(
    items: &[Item],
    seg: &SegmentHandle,
    local: &Buffer,
    peer_addr: u64,
) -> Vec<TransferRequest> {
    items
        .iter()
        .map(|it| TransferRequest {
            op: it.op,
            segment: seg.clone(),
            local_addr: local.addr() + it.local as u64,
            remote_addr: peer_addr + it.remote as u64,
            len: it.len as u64,
        })
        .collect()
}

fn assert_models(local: &Buffer, local_model: &[u8], peer: &mut Peer, remote_model: &[u8]) {
    // SAFETY: every batch has completed; nothing writes the buffer now.
    let got = blake3::hash(unsafe { &local.as_slice()[..local_model.len()] });
    assert_eq!(got, blake3::hash(local_model), "local buffer differs from the model");
    let remote = peer.hash(0, remote_model.len());
    assert_eq!(remote, blake3::hash(remote_model).to_hex().to_string(), "remote buffer differs");
}

async fn random_batches(transports: Transports, expect: TransportKind, seed: u64) {
    let mut peer = Peer::start(&peer_args(transports));
    assert_eq!(peer.len, BUF);
    peer.fill(REMOTE_SEED);
    let (engine, local) = local_engine(transports, 20_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    assert_eq!(seg.transport_for(peer.addr, 1), Some(expect));
    let mut local_model = pattern(LOCAL_SEED, 0, BUF);
    let mut remote_model = pattern(REMOTE_SEED, 0, BUF);
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..4 {
        let items = random_items(&mut rng, 0, BUF, 64);
        let results = engine.transfer(requests(&items, &seg, &local, peer.addr)).await.unwrap();
        for (i, r) in results.iter().enumerate() {
            assert!(r.is_ok(), "round {round} item {i}: {r:?}");
        }
        apply(&items, &mut local_model, &mut remote_model);
        assert_models(&local, &local_model, &mut peer, &remote_model);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_over_tcp_are_byte_exact() {
    random_batches(Transports::tcp_only(), TransportKind::Tcp, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_over_shm_are_byte_exact() {
    random_batches(Transports::default(), TransportKind::Shm, 2).await;
}

async fn concurrent_batches(transports: Transports) {
    let mut peer = Peer::start(&peer_args(transports));
    peer.fill(REMOTE_SEED);
    let (engine, local) = local_engine(transports, 20_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let tasks = 4;
    let span = BUF / tasks;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (engine, seg, local, peer_addr) =
            (engine.clone(), seg.clone(), local.clone(), peer.addr);
        handles.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(100 + t as u64);
            let mut done = Vec::new();
            for _ in 0..3 {
                let items = random_items(&mut rng, t * span, span, 24);
                let results =
                    engine.transfer(requests(&items, &seg, &local, peer_addr)).await.unwrap();
                assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
                done.push(items);
            }
            done
        }));
    }
    let mut local_model = pattern(LOCAL_SEED, 0, BUF);
    let mut remote_model = pattern(REMOTE_SEED, 0, BUF);
    for h in handles {
        // Tasks own disjoint quarters, so their batches commute; within a task, order matters.
        for items in h.await.unwrap() {
            apply(&items, &mut local_model, &mut remote_model);
        }
    }
    assert_models(&local, &local_model, &mut peer, &remote_model);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_from_several_tasks_tcp() {
    concurrent_batches(Transports::tcp_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_from_several_tasks_shm() {
    concurrent_batches(Transports::default()).await;
}

/// Keeps submitting 16 MiB writes while the peer is SIGKILLed; every item must finish, the
/// ones after the kill with a peer-gone or timeout error, well within the operation timeout.
async fn peer_killed_mid_batch(transports: Transports) {
    let timeout_ms = 3_000;
    let mut peer = Peer::start(&peer_args(transports));
    let (engine, local) = local_engine(transports, timeout_ms).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let reqs: Vec<TransferRequest> = (0..4)
        .map(|i| TransferRequest {
            op: TransferOp::Write,
            segment: seg.clone(),
            local_addr: local.addr() + (i << 24),
            remote_addr: peer.addr + (i << 24),
            len: 16 << 20,
        })
        .collect();
    let first = engine.transfer(reqs.clone()).await.unwrap();
    assert!(first.iter().all(|r| r.is_ok()), "{first:?}");
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        peer.kill();
        Instant::now()
    });
    let mut failures = Vec::new();
    let outer = Duration::from_millis(3 * timeout_ms);
    let run = async {
        loop {
            let results = engine.transfer(reqs.clone()).await.unwrap();
            failures.extend(results.into_iter().filter_map(|r| r.err()));
            if !failures.is_empty() {
                return;
            }
        }
    };
    tokio::time::timeout(outer + Duration::from_secs(5), run)
        .await
        .expect("batches hung after the peer died");
    let killed_at = killer.join().unwrap();
    assert!(killed_at.elapsed() < outer, "errors took longer than the timeout bound");
    for e in &failures {
        assert!(
            matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Timeout),
            "unexpected error {e}"
        );
    }
    // And the dead segment keeps answering with errors, not hangs.
    let again = tokio::time::timeout(outer, engine.transfer(reqs)).await.expect("hang").unwrap();
    assert!(again.iter().all(|r| r.is_err()), "transfers to a dead peer succeeded: {again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_batch_gives_errors_not_a_hang_tcp() {
    peer_killed_mid_batch(Transports::tcp_only()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_batch_gives_errors_not_a_hang_shm() {
    peer_killed_mid_batch(Transports::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_peer_times_out() {
    let timeout_ms = 1_500;
    let peer = Peer::start(&["--tcp-only"]);
    let (engine, local) = local_engine(Transports::tcp_only(), timeout_ms).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let req = TransferRequest {
        op: TransferOp::Read,
        segment: seg,
        local_addr: local.addr(),
        remote_addr: peer.addr,
        len: 8 << 20,
    };
    engine.transfer_one(&req).await.unwrap();
    peer.signal(libc::SIGSTOP);
    peer.wait_stopped();
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(20), engine.transfer_one(&req))
        .await
        .expect("hang");
    let waited = t0.elapsed();
    peer.signal(libc::SIGCONT);
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
    assert!(waited >= Duration::from_millis(timeout_ms), "failed before the timeout: {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_transfer_after_30s_idle_succeeds() {
    let mut peer = Peer::start(&["--tcp-only"]);
    peer.fill(REMOTE_SEED);
    let (engine, local) = local_engine(Transports::tcp_only(), 10_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let req = |len: u64| TransferRequest {
        op: TransferOp::Read,
        segment: seg.clone(),
        local_addr: local.addr(),
        remote_addr: peer.addr,
        len,
    };
    engine.transfer_one(&req(4 << 20)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    engine.transfer_one(&req(1 << 20)).await.expect("first transfer after the idle gap");
    let mut got = vec![0u8; 1 << 20];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(REMOTE_SEED, 0, 1 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_peer_is_a_new_segment() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let mut peer = Peer::start(&["--tcp-only", "--listen", &listen]);
    let (engine, local) = local_engine(Transports::tcp_only(), 5_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let req = TransferRequest {
        op: TransferOp::Write,
        segment: seg,
        local_addr: local.addr(),
        remote_addr: peer.addr,
        len: 4096,
    };
    engine.transfer_one(&req).await.unwrap();
    peer.kill();
    let _peer2 = Peer::start(&["--tcp-only", "--listen", &listen]);
    let err = engine.transfer_one(&req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
}

/// A batch held to fewer connections than the peer has stripes its large reads over that many
/// (each item over its own window of them) and still moves every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_held_to_fewer_connections_uses_only_those() {
    let mut peer = Peer::start(&["--tcp-only"]);
    peer.fill(REMOTE_SEED);
    let (engine, local) = local_engine(Transports::tcp_only(), 20_000).await;
    assert!(engine.config().tcp_conns_per_peer >= 4);
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let len = 8usize << 20;
    let read = |at: usize| TransferRequest {
        op: TransferOp::Read,
        segment: seg.clone(),
        local_addr: local.addr() + at as u64,
        remote_addr: peer.addr + at as u64,
        len: len as u64,
    };
    let one = BatchOptions { tcp_conns_max: 1 };
    for r in engine.transfer_with(vec![read(0)], one).await.unwrap() {
        r.unwrap();
    }
    assert_eq!(seg.status().tcp_connections, Some(1), "eight slices on one connection");
    // Two items of two connections each: two windows, four connections.
    let two = BatchOptions { tcp_conns_max: 2 };
    for r in engine.transfer_with(vec![read(len), read(2 * len)], two).await.unwrap() {
        r.unwrap();
    }
    assert_eq!(seg.status().tcp_connections, Some(4));
    // SAFETY: every transfer has completed; nothing writes the buffer now.
    let got = blake3::hash(unsafe { &local.as_slice()[..3 * len] });
    assert_eq!(got, blake3::hash(&pattern(REMOTE_SEED, 0, 3 * len)));
}

/// Reads in order on one lane see the peer's memory in order: while the peer rewrites a region
/// under a seqlock, a reader that brackets the data (one large read in slices, or many small
/// ones in packs) with a header read before and after on the same lane never finds a torn
/// region behind an unchanged, even epoch. Reads issued apart
/// (striped, or over other connections) give no such guarantee.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_order_see_a_seqlock_whole() {
    let mut peer = Peer::start(&["--tcp-only"]);
    let (engine, local) = local_engine(Transports::tcp_only(), 20_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    assert!(engine.ordered_reads(&seg));
    // Three slices at the default 1 MiB, all on the lane's one connection.
    let len = 3usize << 20;
    assert_eq!(peer.ask(&format!("seqlock {len} 400")), "OK");
    let (l, r) = (local.addr(), peer.addr);
    // The data as one read (sliced), and as 48 reads of 64 KiB (packed).
    let one = vec![(l, r, 8), (l + 64, r + 64, len as u64), (l + 8, r, 8)];
    let mut many = vec![(l, r, 8)];
    let piece = 64u64 << 10;
    many.extend((0..len as u64 / piece).map(|k| (l + 64 + k * piece, r + 64 + k * piece, piece)));
    many.push((l + 8, r, 8));
    let (mut whole, mut moved) = (0u32, 0u32);
    let mut epochs = std::collections::HashSet::new();
    let mut data = vec![0u8; len];
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) && (whole < 200 || moved < 20) {
        let items = if (whole + moved) % 2 == 0 { &one } else { &many };
        for res in engine.read_in_order(&seg, items, 0).await.unwrap() {
            res.unwrap();
        }
        let mut e = [0u8; 16];
        local.read_at(0, &mut e).unwrap();
        let before = u64::from_le_bytes(e[..8].try_into().unwrap());
        let after = u64::from_le_bytes(e[8..].try_into().unwrap());
        if before != after || before % 2 == 1 {
            moved += 1;
            continue;
        }
        if before == 0 {
            continue; // not written yet
        }
        local.read_at(64, &mut data).unwrap();
        let want = (before / 2).to_le_bytes();
        let torn = data.chunks_exact(8).position(|w| w != want);
        assert_eq!(torn, None, "epoch {before} unchanged, yet the data is torn at word {torn:?}");
        whole += 1;
        epochs.insert(before);
    }
    let stopped = peer.ask("seqlock-stop");
    assert!(stopped.starts_with("OK "), "{stopped}");
    assert!(whole >= 200 && moved >= 20, "{whole} whole reads, {moved} overlapped a write");
    assert!(epochs.len() > 10, "the reads saw {} epochs", epochs.len());
    assert_eq!(seg.status().tcp_connections, Some(1), "one lane, one connection");
}

/// A lane's items fail one by one (an unregistered local range, a range outside the peer's
/// regions) while the rest are read; a segment reached over shm has no lanes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_in_order_fail_item_by_item() {
    let mut peer = Peer::start(&["--tcp-only"]);
    peer.fill(REMOTE_SEED);
    let (engine, local) = local_engine(Transports::tcp_only(), 5_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    let (l, r) = (local.addr(), peer.addr);
    let items = [
        (l, r, 4096),
        (0x1000, r, 4096),
        (l + 4096, r + BUF as u64, 4096),
        (l + 8192, r + 8192, 0),
        (l + 8192, r + 8192, 4096),
    ];
    let got = engine.read_in_order(&seg, &items, 0).await.unwrap();
    let kinds: Vec<Option<ErrorKind>> =
        got.iter().map(|r| r.as_ref().err().map(|e| e.kind())).collect();
    assert_eq!(
        kinds,
        [
            None,
            Some(ErrorKind::NotRegistered),
            Some(ErrorKind::OutOfRange),
            Some(ErrorKind::InvalidArgument),
            None
        ]
    );
    let mut b = vec![0u8; 4096];
    local.read_at(8192, &mut b).unwrap();
    assert_eq!(b, pattern(REMOTE_SEED, 8192, 4096));
    local.read_at(0, &mut b).unwrap();
    assert_eq!(b, pattern(REMOTE_SEED, 0, 4096));

    let shm_peer = Peer::start(&[]);
    let (shm_engine, shm_local) = local_engine(Transports::default(), 5_000).await;
    let shm_seg = shm_engine.open_segment(&shm_peer.name).await.unwrap();
    assert!(!shm_engine.ordered_reads(&shm_seg));
    let one = [(shm_local.addr(), shm_peer.addr, 4096)];
    let e = shm_engine.read_in_order(&shm_seg, &one, 0).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_reach_the_peer() {
    let mut peer = Peer::start(&["--tcp-only"]);
    let (engine, _local) = local_engine(Transports::tcp_only(), 5_000).await;
    let seg = engine.open_segment(&peer.name).await.unwrap();
    engine.notify(&seg, b"prefill-done:req-1").await.unwrap();
    engine.notify(&seg, b"prefill-done:req-2").await.unwrap();
    assert_eq!(peer.ask("notes"), "NOTES 2 prefill-done:req-1,prefill-done:req-2");
    let big = vec![b'x'; engine.config().notify_bytes_max + 1];
    assert_eq!(engine.notify(&seg, &big).await.unwrap_err().kind(), ErrorKind::InvalidArgument);
}
