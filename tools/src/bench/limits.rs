//! The machine's own limits, measured in the same run as the figures held against them.
//!
//! - memcpy: one thread copying 1 GiB between two pre-faulted buffers (best of three);
//! - raw loopback TCP: plain blocking sockets between this process and the peer process, with
//!   4 MiB reads and writes, one stream and several streams in parallel; the limit is the best
//!   of them, so a transport that stripes over several connections is held against what
//!   several plain connections reach, not against one. Each side of each stream reads and
//!   writes its pieces at successive offsets of a [`FOOTPRINT`] buffer, so the bytes move
//!   between memory and memory as an object's do (the memcpy limit copies 1 GiB for the same
//!   reason). Re-sending one 4 MiB buffer per side keeps one stream's bytes in this VM's
//!   32 MiB L3: one stream measured 4.8-4.9 GB/s that way against 4.0-4.2 from memory, a rate
//!   no transfer of 16 MiB objects can reach (with four streams the buffers no longer fit,
//!   and the two ways differ by 0-10%). [`raw_tcp`] with `resident` still measures the cached
//!   way, printed by `kvfs bench transfer` for comparison; round-trip latencies
//!   ([`raw_rtt_p50_us`]) use small resident buffers, as a 4 KiB request does, and are the
//!   lower of two ways of waiting: blocking in the kernel, and both sides polling the socket
//!   (in a VM a vCPU that blocked can take tens of microseconds to wake, or none: polling is
//!   the steady limit, blocking sometimes the faster one);
//!   [`raw_exchange_us`] times a request and an answer of given sizes to a thread of the same
//!   process (the floor under `kvfs bench conductor`'s HTTP figures).
//!
//! The raw TCP server runs in the bench's peer process (`serve_raw_tcp`), so the bytes cross
//! between two processes exactly as the engine's do.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Instant;

const CHUNK: usize = 4 << 20;
const OP_SINK: u8 = 1;
const OP_SOURCE: u8 = 2;
/// Set on a request's op: the server uses one cache-resident `CHUNK` buffer for it.
const OP_RESIDENT: u8 = 0x80;
/// Set on a request's op: the server polls the socket for the request's bytes and for the
/// next request's header (as a spinning transport does) instead of blocking in the kernel.
const OP_POLL: u8 = 0x40;
/// How long a polling side spins without a byte before it blocks (so a polling server whose
/// client went quiet gives its CPU back).
const POLL_SPIN_MAX: std::time::Duration = std::time::Duration::from_millis(50);

/// Memory each side of a raw TCP stream cycles through: twice this machine's L3 (32 MiB), so
/// no piece is still in a cache when it is sent or received again.
pub const FOOTPRINT: usize = 64 << 20;

/// Footprint buffers kept for reuse (pre-faulted; faulting 64 MiB in costs tens of ms in a VM).
static SPARE: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// Spare buffers kept at most (8 x 64 MiB).
const SPARE_MAX: usize = 8;

/// A [`FOOTPRINT`] buffer read and written in `CHUNK` pieces at successive offsets.
struct Cycling {
    buf: Vec<u8>,
    off: usize,
}

impl Cycling {
    fn take() -> Cycling {
        let spare = SPARE.lock().unwrap_or_else(|e| e.into_inner()).pop();
        Cycling { buf: spare.unwrap_or_else(|| vec![0x33u8; FOOTPRINT]), off: 0 }
    }

    /// The next `n <= CHUNK` bytes.
    fn next(&mut self, n: usize) -> &mut [u8] {
        if self.off + n > self.buf.len() {
            self.off = 0;
        }
        let at = self.off;
        self.off += n;
        &mut self.buf[at..at + n]
    }
}

impl Drop for Cycling {
    fn drop(&mut self) {
        let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < SPARE_MAX {
            spare.push(std::mem::take(&mut self.buf));
        }
    }
}

/// Single-thread memcpy of `bytes` between pre-faulted buffers, in GB/s (best of three).
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.fill(1);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(&dst);
        best = best.max(bytes as f64 / s / 1e9);
    }
    best
}

/// Serves raw TCP sink/source requests until the process exits (runs in the peer process).
pub fn serve_raw_tcp(listener: TcpListener) {
    for stream in listener.incoming().flatten() {
        std::thread::spawn(move || {
            let _ = serve_one(stream);
        });
    }
}

fn serve_one(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    // As the engine's own connections (a paced congestion control reorders loopback).
    kvfs_proto::sock::unpace_same_host(&s);
    let mut buf = vec![0x33u8; CHUNK];
    let mut memory: Option<Cycling> = None;
    let mut hdr = [0u8; 9];
    let mut polling = false;
    loop {
        if read_exact_maybe_polling(&mut s, &mut hdr, polling).is_err() {
            return Ok(());
        }
        let len = u64::from_le_bytes(hdr[1..9].try_into().unwrap_or([0; 8])) as usize;
        let resident = hdr[0] & OP_RESIDENT != 0;
        polling = hdr[0] & OP_POLL != 0;
        let op = hdr[0] & !(OP_RESIDENT | OP_POLL);
        if op != OP_SINK && op != OP_SOURCE {
            return Ok(());
        }
        let mut left = len;
        while left > 0 {
            let n = left.min(CHUNK);
            let piece = if resident {
                &mut buf[..n]
            } else {
                memory.get_or_insert_with(Cycling::take).next(n)
            };
            if op == OP_SINK {
                read_exact_maybe_polling(&mut s, piece, polling)?;
            } else {
                s.write_all(piece)?;
            }
            left -= n;
        }
        if op == OP_SINK {
            s.write_all(&[1])?;
        }
    }
}

/// Answers raw TCP timings on stdin/stdout (`kvfs bench raw-tcp`): for each line
/// `send|receive|both BYTES COUNT`, a line `TIMES` with COUNT durations in seconds, each the
/// fastest of one stream and `streams` streams moving BYTES that way (`both`: either way),
/// measured as `kvfs bench store` measures its limit ([`raw_tcp_gbps`]: connections made and
/// warmed for each measurement, so none starts from a window that idled); `ERROR why` for a
/// line it cannot serve. Ends at the end of stdin.
pub fn serve_raw_tcp_times(addr: SocketAddr, streams: usize) -> anyhow::Result<()> {
    use std::io::BufRead;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let answer = raw_tcp_times(addr, streams.max(1), &line)
            .map(|t| {
                let t: Vec<String> = t.iter().map(|s| format!("{s:.9}")).collect();
                format!("TIMES {}", t.join(" "))
            })
            .unwrap_or_else(|e| format!("ERROR {e:#}"));
        let mut out = stdout.lock();
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}

/// Bytes one `raw-tcp` request may ask for (per transfer), and transfers per request.
const RAW_TIMES_BYTES_MAX: usize = 4 << 30;
const RAW_TIMES_COUNT_MAX: usize = 1024;

fn raw_tcp_times(addr: SocketAddr, streams: usize, line: &str) -> anyhow::Result<Vec<f64>> {
    let w: Vec<&str> = line.split_whitespace().collect();
    let [dir, bytes, count] = w[..] else {
        anyhow::bail!("expected `send|receive|both BYTES COUNT`, got {line:?}");
    };
    let dir = match dir {
        "send" => Some(Direction::Send),
        "receive" => Some(Direction::Receive),
        "both" => None,
        other => anyhow::bail!("direction {other:?}: expected send, receive or both"),
    };
    let bytes: usize = bytes.parse()?;
    let count: usize = count.parse()?;
    anyhow::ensure!(
        (1..=RAW_TIMES_BYTES_MAX).contains(&bytes) && (1..=RAW_TIMES_COUNT_MAX).contains(&count),
        "BYTES must be 1..={RAW_TIMES_BYTES_MAX} and COUNT 1..={RAW_TIMES_COUNT_MAX}"
    );
    // The same measurement as `kvfs bench store`'s limit: the best of one stream and
    // `streams`, in `dir` or both ways.
    let limit = Limit::Tcp { addr, bytes, streams, dir };
    (0..count).map(|_| Ok(bytes as f64 / limit.measure_blocking()? / 1e9)).collect()
}

/// Direction of a raw TCP measurement, seen from the bench process.
#[derive(Debug, Clone, Copy)]
pub enum Direction {
    /// We send (like an engine write).
    Send,
    /// We receive (like an engine read).
    Receive,
}

/// Moves `bytes` in total over `streams` plain connections in parallel, each side of each
/// stream cycling through [`FOOTPRINT`] bytes of memory; returns GB/s.
pub fn raw_tcp_gbps(
    addr: SocketAddr,
    bytes: usize,
    streams: usize,
    dir: Direction,
) -> std::io::Result<f64> {
    raw_tcp(addr, bytes, streams, dir, false)
}

/// [`raw_tcp_gbps`], or with `resident` one cache-resident 4 MiB buffer on each side of each
/// stream (what this limit measured before: faster than any transfer of real objects can go).
fn raw_tcp(
    addr: SocketAddr,
    bytes: usize,
    streams: usize,
    dir: Direction,
    resident: bool,
) -> std::io::Result<f64> {
    let per = bytes / streams;
    let mut conns = Vec::new();
    for _ in 0..streams {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        kvfs_proto::sock::unpace_same_host(&s);
        conns.push((s, Cycling::take()));
    }
    // Warm the connections (slow start, buffer auto-tuning) before timing.
    for (s, mem) in &mut conns {
        stream_transfer(s, 16 << 20, dir, mem, resident)?;
    }
    let start = std::sync::Barrier::new(streams + 1);
    let t = std::thread::scope(|scope| {
        let handles: Vec<_> = conns
            .iter_mut()
            .map(|(s, mem)| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    stream_transfer(s, per, dir, mem, resident)
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        for h in handles {
            h.join().map_err(|_| std::io::Error::other("raw tcp thread panicked"))??;
        }
        Ok::<_, std::io::Error>(t.elapsed())
    })?;
    Ok((per * streams) as f64 / t.as_secs_f64() / 1e9)
}

/// One request of `len` bytes on a throughput stream: the pieces come from (or land in) `mem`
/// at successive offsets, or all from its first `CHUNK` bytes when `resident`.
fn stream_transfer(
    s: &mut TcpStream,
    len: usize,
    dir: Direction,
    mem: &mut Cycling,
    resident: bool,
) -> std::io::Result<()> {
    let op = match dir {
        Direction::Send => OP_SINK,
        Direction::Receive => OP_SOURCE,
    };
    let mut hdr = [0u8; 9];
    hdr[0] = if resident { op | OP_RESIDENT } else { op };
    hdr[1..9].copy_from_slice(&(len as u64).to_le_bytes());
    s.write_all(&hdr)?;
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK);
        let piece = if resident { &mut mem.buf[..n] } else { mem.next(n) };
        match dir {
            Direction::Send => s.write_all(piece)?,
            Direction::Receive => s.read_exact(piece)?,
        }
        left -= n;
    }
    if let Direction::Send = dir {
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
    }
    Ok(())
}

/// `read_exact`, or with `polling` the same by non-blocking receives in a spin (blocking once
/// [`POLL_SPIN_MAX`] passed without a byte).
fn read_exact_maybe_polling(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    polling: bool,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if !polling {
        return s.read_exact(buf);
    }
    let mut idle_since = Instant::now();
    while !buf.is_empty() {
        // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
        let n = unsafe {
            libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
        };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => {
                buf = &mut buf[n as usize..];
                idle_since = Instant::now();
            }
            _ => {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::WouldBlock if idle_since.elapsed() < POLL_SPIN_MAX => {
                        std::hint::spin_loop()
                    }
                    std::io::ErrorKind::WouldBlock => return s.read_exact(buf),
                    std::io::ErrorKind::Interrupted => {}
                    _ => return Err(e),
                }
            }
        }
    }
    Ok(())
}

/// One small request on a latency connection: the header travels with the first piece, and the
/// server answers from its cache-resident buffer; with `polling` both sides poll for the bytes
/// they wait for.
fn one_transfer(
    s: &mut TcpStream,
    len: usize,
    dir: Direction,
    polling: bool,
) -> std::io::Result<()> {
    let op = match dir {
        Direction::Send => OP_SINK,
        Direction::Receive => OP_SOURCE,
    };
    let mut hdr = [0u8; 9];
    hdr[0] = op | OP_RESIDENT | if polling { OP_POLL } else { 0 };
    hdr[1..9].copy_from_slice(&(len as u64).to_le_bytes());
    // The header travels with the first chunk in one write, as a transport sends a request.
    let mut buf = vec![0x44u8; hdr.len() + len.min(CHUNK)];
    buf[..hdr.len()].copy_from_slice(&hdr);
    let mut left = len;
    match dir {
        Direction::Send => {
            let mut first = hdr.len();
            loop {
                let n = left.min(CHUNK);
                s.write_all(&buf[hdr.len() - first..hdr.len() + n])?;
                first = 0;
                left -= n;
                if left == 0 {
                    break;
                }
            }
            read_exact_maybe_polling(s, &mut buf[..1], polling)?;
        }
        Direction::Receive => {
            s.write_all(&hdr)?;
            while left > 0 {
                let n = left.min(CHUNK);
                read_exact_maybe_polling(s, &mut buf[..n], polling)?;
                left -= n;
            }
        }
    }
    Ok(())
}

/// Round trips of one `len`-byte request/response over one plain connection to the peer's raw
/// server: a 9-byte request answered with `len` bytes (`Receive`, like a get), or a request
/// carrying `len` bytes answered with one byte (`Send`, like a put). Timed `iters` times each
/// way of waiting, after a warm-up: both sides polling the socket, then both blocking in the
/// kernel (last, so the server ends blocking). Returns the lower of the two p50s, in
/// microseconds: the machine's limit is the faster way.
pub fn raw_rtt_p50_us(
    addr: SocketAddr,
    len: usize,
    dir: Direction,
    iters: usize,
) -> std::io::Result<f64> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    kvfs_proto::sock::unpace_same_host(&s);
    let mut best = f64::INFINITY;
    for polling in [true, false] {
        for _ in 0..iters.min(200) {
            one_transfer(&mut s, len, dir, polling)?;
        }
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            let t = Instant::now();
            one_transfer(&mut s, len, dir, polling)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(|a, b| a.total_cmp(b));
        best = best.min(lat[lat.len() / 2]);
    }
    Ok(best)
}

/// Round trips of `up` bytes out and `down` bytes back over a raw loopback TCP connection to a
/// thread that answers once the whole request is in (as an HTTP server does), each in us after
/// five untimed: the floor under a request/answer API's latency for those sizes.
pub fn raw_exchange_us(up: usize, down: usize, n: usize) -> anyhow::Result<Vec<f64>> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
        let mut req = vec![0u8; up];
        let reply = vec![1u8; down];
        loop {
            match s.read_exact(&mut req) {
                Ok(()) => s.write_all(&reply)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let req = vec![2u8; up];
    let mut answer = vec![0u8; down];
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 5 {
        let t = Instant::now();
        c.write_all(&req)?;
        c.read_exact(&mut answer)?;
        if i >= 5 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    server.join().map_err(|_| anyhow::anyhow!("the raw tcp server panicked"))??;
    Ok(lat)
}

/// Loopback TCP limits measured against the peer's raw server.
#[derive(Debug, Clone, Copy)]
pub struct TcpLimits {
    pub send_1: f64,
    pub receive_1: f64,
    pub send_n: f64,
    pub receive_n: f64,
    pub streams: usize,
    /// `streams` streams with cache-resident buffers (for comparison only).
    pub resident_send_n: f64,
    pub resident_receive_n: f64,
}

impl TcpLimits {
    pub fn measure(addr: SocketAddr, bytes: usize, streams: usize) -> std::io::Result<TcpLimits> {
        Ok(TcpLimits {
            send_1: raw_tcp_gbps(addr, bytes, 1, Direction::Send)?,
            receive_1: raw_tcp_gbps(addr, bytes, 1, Direction::Receive)?,
            send_n: raw_tcp_gbps(addr, bytes, streams, Direction::Send)?,
            receive_n: raw_tcp_gbps(addr, bytes, streams, Direction::Receive)?,
            streams,
            resident_send_n: raw_tcp(addr, bytes, streams, Direction::Send, true)?,
            resident_receive_n: raw_tcp(addr, bytes, streams, Direction::Receive, true)?,
        })
    }
}

/// What a figure is held against, measured on demand (so it can be measured next to the
/// figure, round by round).
#[derive(Debug, Clone)]
pub enum Limit {
    /// Single-thread memcpy of `bytes`.
    Memcpy { bytes: usize },
    /// Plain loopback TCP to the peer's raw server: the best of one stream and `streams`
    /// streams, in `dir` (both directions when `None`).
    Tcp { addr: SocketAddr, bytes: usize, streams: usize, dir: Option<Direction> },
}

impl Limit {
    pub fn name(&self) -> &'static str {
        match self {
            Limit::Memcpy { .. } => "memcpy",
            Limit::Tcp { .. } => "tcp",
        }
    }

    /// Measures the limit once, in GB/s (on a blocking thread).
    pub async fn measure(&self) -> anyhow::Result<f64> {
        let me = self.clone();
        Ok(tokio::task::spawn_blocking(move || me.measure_blocking()).await??)
    }

    fn measure_blocking(&self) -> std::io::Result<f64> {
        match *self {
            Limit::Memcpy { bytes } => Ok(memcpy_gbps(bytes)),
            Limit::Tcp { addr, bytes, streams, dir } => {
                let dirs: &[Direction] = match dir {
                    Some(Direction::Send) => &[Direction::Send],
                    Some(Direction::Receive) => &[Direction::Receive],
                    None => &[Direction::Send, Direction::Receive],
                };
                let mut best = 0.0f64;
                for &d in dirs {
                    for n in [1, streams] {
                        best = best.max(raw_tcp_gbps(addr, bytes, n, d)?);
                    }
                }
                Ok(best)
            }
        }
    }
}

/// One timed call of a case: how long the timed part took and what it moved.
pub struct Timed {
    pub took: std::time::Duration,
    pub bytes: u64,
    pub ops: u64,
}

/// Runs `rounds` rounds of (measure the limit, run the case for `per_round`), and a last limit
/// measurement after them; returns the median limit and the case's samples over all rounds.
/// Interleaving keeps a busy neighbour from moving the figure without moving its limit.
pub async fn interleaved<F, Fut>(
    limit: &Limit,
    rounds: usize,
    per_round: std::time::Duration,
    one: F,
) -> anyhow::Result<(f64, super::report::Samples)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Timed>>,
{
    interleaved_with(|| limit.measure(), rounds, per_round, one).await
}

/// [`interleaved`] with the limit measured by `measure` (which may also take other limits of
/// its own round).
pub async fn interleaved_with<M, MFut, F, Fut>(
    mut measure: M,
    rounds: usize,
    per_round: std::time::Duration,
    mut one: F,
) -> anyhow::Result<(f64, super::report::Samples)>
where
    M: FnMut() -> MFut,
    MFut: std::future::Future<Output = anyhow::Result<f64>>,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Timed>>,
{
    let mut limits = Vec::with_capacity(rounds + 1);
    let mut s = super::report::Samples::default();
    for _ in 0..rounds.max(1) {
        limits.push(measure().await?);
        let start = Instant::now();
        let mut calls = 0;
        while calls < 3 || start.elapsed() < per_round {
            let t = one().await?;
            s.lat_us.push(t.took.as_secs_f64() * 1e6);
            s.bytes += t.bytes;
            s.ops += t.ops;
            s.elapsed_s += t.took.as_secs_f64();
            calls += 1;
        }
    }
    limits.push(measure().await?);
    limits.sort_by(|a, b| a.total_cmp(b));
    Ok((limits[limits.len() / 2], s))
}
