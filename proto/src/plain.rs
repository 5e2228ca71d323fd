//! A TCP stream its owner reads and writes itself, registered with the tokio runtime only
//! while it has to wait.
//!
//! The latency paths (`kvfs_rpc::DirectConn`, the Transfer Engine's direct connection) write a
//! request and poll the socket for the answer on the calling thread. A socket registered with
//! the runtime's reactor (edge-triggered epoll) reports every readiness edge to it: the answer
//! arriving, the request's acknowledgement freeing send space. Each such edge woke the
//! runtime's thread parked in `epoll_wait`, though no task waited on the socket: two wake-ups
//! per call, and on a 2-core machine they took the CPU from the very peer the call waited for
//! (`cargo run --release -p kvfs-rpc --example rpc_latency`, direct: 19.8-22.8 us p50
//! registered, 8.9 us with this stream). Here the socket is a plain non-blocking one; a read
//! or write that finds nothing to do registers it for the rest of that operation only (two
//! `epoll_ctl` calls) and takes it off again.
//!
//! The serving sides use it too ([`PlainStream::split`]: a reader and a writer over one
//! connection, each registering on its own): the Transfer Engine's acceptor and every `rpc`
//! connection. Registered, each request arriving woke the serving process's parked thread
//! while the serving task was polling for that very request, and the caller's send paid for
//! the wake-up (a 4 KiB get's send took 4.7 us of its 14.8; `kvfs bench store`).
//!
//! A serving side that parks until its next request comes ([`ServeSpin`], when its caller is
//! not prompt) keeps the socket registered from one such wait to the next, and takes it off
//! only when it goes back to polling: registering and unregistering around every parked wait
//! cost two `epoll_ctl` calls (about 2 us a pair on a 2-core VM) on each request of a put's
//! master and node round trips.
//!
//! A wait that is dropped midway (a timeout) takes the socket with it: every later use fails
//! with `NotConnected`, as the owner must drop a connection left in the middle of a message
//! anyway.
//!
//! [`Inbound`] is the same small read-ahead buffer over a tokio read half, for a reader that
//! stays registered (the Transfer Engine's pooled connections' reply reader).

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::time::Duration;

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::tcp::OwnedReadHalf;

/// Bytes received ahead of what the reader asked for: a fixed buffer and its unread part.
struct ReadAhead {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// A yield of a serving side's polling loop that took at least this long gave the CPU to
/// another thread that was ready on it (an empty one takes well under a microsecond).
const CROWDED_YIELD: Duration = Duration::from_micros(2);
/// Polled waits in a row that gave the CPU away before the serving thread moves.
const CROWDED_WAITS: u32 = 2;
/// Polled waits after a move before the next one may happen, at least, and at most where
/// moving does not end the crowding (the gap doubles after each such move).
const MOVE_GAP_MIN: u32 = 16;
const MOVE_GAP_MAX: u32 = 1024;

/// Whether a serving side's polling shares its CPU with the very thread it waits for, and when
/// to move off that CPU to end it.
///
/// A parked thread woken by a socket's data is put on the waker's CPU when the waker is alone
/// there (a socket wake-up is a "sync" one: the kernel expects the waker to sleep next). A
/// caller polling for its answer does not sleep: the server woken by its request lands on the
/// caller's CPU and the two then take turns at every yield, a round trip costing both their
/// turns and the switches between them: a 4 KiB get over loopback tcp took 15-18 us for tens
/// of milliseconds at a time, 9 us once the load balancer moved one of them (per-round figures
/// of `kvfs bench store`, after each limit measurement parked the node's serving thread; with
/// the two processes pinned to different CPUs the slow state never came). Parking does not
/// end it (the next wake-up is placed the same way), and the load balancer leaves two threads
/// that run every few microseconds where they are. A yield that gave the CPU away tells: after
/// [`CROWDED_WAITS`] such waits in a row the serving thread moves itself to another CPU it may
/// run on (narrowing its affinity for a moment and restoring it), where the caller's next
/// request finds it polling. Only the serving side moves, so the two do not chase each other
/// around; where moving does not help (every CPU busy, one CPU for both) the moves thin out.
#[derive(Debug, Default)]
struct Crowding {
    /// Polled waits in a row whose yields gave the CPU away.
    streak: u32,
    /// The last wait ended with a move.
    moved: bool,
    /// Waits between moves while moving does not help (0: it helped).
    gap: u32,
    /// Waits left before the next move.
    skip: u32,
}

impl Crowding {
    /// A polled wait ended; `gave_away`: one of its yields gave the CPU to another thread.
    /// Whether to move off this CPU now.
    fn polled(&mut self, gave_away: bool) -> bool {
        self.skip = self.skip.saturating_sub(1);
        let moved = std::mem::take(&mut self.moved);
        if !gave_away {
            self.streak = 0;
            if moved {
                self.gap = 0;
            }
            return false;
        }
        self.streak += 1;
        if moved {
            self.gap = (self.gap * 2).clamp(MOVE_GAP_MIN, MOVE_GAP_MAX);
            self.skip = self.gap;
        }
        if self.streak < CROWDED_WAITS || self.skip > 0 {
            return false;
        }
        self.streak = 0;
        self.moved = true;
        self.skip = MOVE_GAP_MIN;
        true
    }
}

/// Moves the calling thread off the CPU it runs on, to another one its affinity allows,
/// leaving its affinity as it was. `false` where it cannot (one CPU allowed, or a refusal).
fn move_off_this_cpu() -> bool {
    use rustix::thread::{sched_getaffinity, sched_getcpu, sched_setaffinity};
    let Ok(allowed) = sched_getaffinity(None) else {
        return false;
    };
    let cpu = sched_getcpu();
    if allowed.count() < 2 || !allowed.is_set(cpu) {
        return false;
    }
    let mut others = allowed;
    others.unset(cpu);
    // Leaving the current CPU out moves the thread now; putting it back leaves it where it
    // went.
    sched_setaffinity(None, &others).is_ok() && sched_setaffinity(None, &allowed).is_ok()
}

impl ReadAhead {
    fn new(bytes: usize) -> ReadAhead {
        ReadAhead { buf: vec![0u8; bytes].into_boxed_slice(), start: 0, end: 0 }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The whole buffer, to receive into while it is empty; then [`filled`](Self::filled).
    fn room(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    fn filled(&mut self, n: usize) {
        (self.start, self.end) = (0, n);
    }

    /// Polls `recv` into the (empty) buffer without parking, for up to `spin`, until bytes
    /// arrive, the stream ends or fails (the next read reports it), or `spin` has passed;
    /// between two empty polls, the CPU is given away (see [`PlainStream::spin_for_bytes`]).
    /// With `watch`, returns whether one of those yields gave the CPU to another thread (it
    /// took [`CROWDED_YIELD`] or more; see [`Crowding`]); else `false`, with no timing.
    fn spin_fill(
        &mut self,
        spin: Duration,
        watch: bool,
        mut recv: impl FnMut(&mut [u8]) -> std::io::Result<usize>,
    ) -> bool {
        if !self.is_empty() || spin.is_zero() {
            return false;
        }
        let started = std::time::Instant::now();
        let mut gave_away = false;
        loop {
            match recv(&mut self.buf) {
                Ok(n) => {
                    self.filled(n);
                    return gave_away;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return gave_away,
            }
            let now = std::time::Instant::now();
            if now.duration_since(started) >= spin {
                return gave_away;
            }
            std::thread::yield_now();
            gave_away |= watch && now.elapsed() >= CROWDED_YIELD;
        }
    }

    /// Copies what is buffered into `dst`; returns how much.
    fn take(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.end - self.start);
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Copies what is buffered into `bufs` in order; returns how much.
    fn take_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> usize {
        let mut taken = 0;
        for b in bufs.iter_mut() {
            let n = self.take(b);
            taken += n;
            if n < b.len() {
                break;
            }
        }
        taken
    }
}

/// Bytes read ahead at most (a small message comes in with one system call).
const BUFFER_BYTES: usize = 16 << 10;

/// The socket: off the runtime, or registered with it between parked waits for the next
/// message ([`PlainStream::wait_readable`]).
enum Sock {
    Plain(std::net::TcpStream),
    Parked(tokio::net::TcpStream),
}

impl Sock {
    fn fd(&self) -> socket2::SockRef<'_> {
        match self {
            Sock::Plain(s) => socket2::SockRef::from(s),
            Sock::Parked(s) => socket2::SockRef::from(s),
        }
    }

    /// Registered with the runtime (as it was, when parked).
    fn registered(self) -> std::io::Result<tokio::net::TcpStream> {
        match self {
            Sock::Plain(s) => tokio::net::TcpStream::from_std(s),
            Sock::Parked(s) => Ok(s),
        }
    }
}

/// Runs `attempt` (one system call on the socket; `Ok(true)` once the whole operation is
/// done) until it is done. While attempts make progress the socket stays off the reactor; at
/// the first `WouldBlock` it is registered, and stays so for the rest of this operation only:
/// a payload larger than the socket's buffers waits many times and registers once, not two
/// `epoll_ctl` calls a wait. A parked socket (already registered) stays registered.
async fn drive(
    slot: &mut Option<Sock>,
    interest: Interest,
    mut attempt: impl FnMut(&socket2::Socket) -> std::io::Result<bool>,
) -> std::io::Result<()> {
    let sock = slot.as_ref().ok_or_else(gone)?;
    loop {
        match attempt(&sock.fd()) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let sock = slot.take().ok_or_else(gone)?;
    let parked = matches!(sock, Sock::Parked(_));
    let registered = sock.registered()?;
    let done = attempt_when_ready(&registered, interest, attempt).await;
    *slot =
        Some(if parked { Sock::Parked(registered) } else { Sock::Plain(registered.into_std()?) });
    done
}

/// Waits until `registered` is ready for `interest` and runs `attempt` on it, again and again,
/// until the attempt is done.
async fn attempt_when_ready(
    registered: &tokio::net::TcpStream,
    interest: Interest,
    mut attempt: impl FnMut(&socket2::Socket) -> std::io::Result<bool>,
) -> std::io::Result<()> {
    loop {
        registered.ready(interest).await?;
        // `try_io` clears the readiness an attempt finds stale (`WouldBlock`).
        match registered.try_io(interest, || attempt(&socket2::SockRef::from(registered))) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

pub struct PlainStream {
    sock: Option<Sock>,
    ahead: ReadAhead,
}

fn gone() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::NotConnected, "an earlier wait on it was dropped")
}

impl PlainStream {
    /// Takes `stream` off the runtime (it stays non-blocking).
    pub fn new(stream: tokio::net::TcpStream) -> std::io::Result<PlainStream> {
        PlainStream::from_std(stream.into_std()?)
    }

    /// A stream over `sock`, made non-blocking, which must not be registered with a runtime.
    pub fn from_std(sock: std::net::TcpStream) -> std::io::Result<PlainStream> {
        sock.set_nonblocking(true)?;
        Ok(PlainStream { sock: Some(Sock::Plain(sock)), ahead: ReadAhead::new(BUFFER_BYTES) })
    }

    /// Two streams over one connection, `stream` taken off the runtime (the second a
    /// duplicate of the socket), each registering on its own when it waits: a reader and a
    /// writer that wait independently. The second reads nothing ahead.
    pub fn split(stream: tokio::net::TcpStream) -> std::io::Result<(PlainStream, PlainStream)> {
        let sock = stream.into_std()?;
        let other = sock.try_clone()?;
        let rd = PlainStream::from_std(sock)?;
        let mut wr = PlainStream::from_std(other)?;
        wr.ahead = ReadAhead::new(0);
        Ok((rd, wr))
    }

    /// A stream with no socket: every read and write fails with `NotConnected`.
    pub fn closed() -> PlainStream {
        PlainStream { sock: None, ahead: ReadAhead::new(0) }
    }

    /// Shuts the connection down for writing: the peer reads the end of the stream.
    pub fn shutdown_write(&self) -> std::io::Result<()> {
        self.sock.as_ref().ok_or_else(gone)?.fd().shutdown(std::net::Shutdown::Write)
    }

    pub fn has_buffered(&self) -> bool {
        !self.ahead.is_empty()
    }

    /// Copies what is buffered into `dst`; returns how much.
    pub fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        self.ahead.take(dst)
    }

    /// Parks until the socket has something to read (or has ended: the next read reports
    /// it), receiving what came into the read-ahead buffer. The socket stays registered with
    /// the runtime afterwards, for the next such wait, until [`unpark`](Self::unpark).
    pub async fn wait_readable(&mut self) -> std::io::Result<()> {
        if self.has_buffered() {
            return Ok(());
        }
        let registered = self.sock.take().ok_or_else(gone)?.registered()?;
        let ahead = &mut self.ahead;
        // Receiving (not only waiting for readiness) clears a readiness left over from an
        // earlier message, which would end this wait at once with nothing there. (A stream
        // with no read-ahead room, a writer's, receives nothing: its wait ends once readable.)
        let got = attempt_when_ready(&registered, Interest::READABLE, |mut s| {
            let n = s.read(ahead.room())?;
            ahead.filled(n);
            Ok(true)
        })
        .await;
        self.sock = Some(Sock::Parked(registered));
        got
    }

    /// Takes the socket off the runtime if a parked wait left it registered (before polling
    /// it: registered, each message arriving wakes the runtime's parked thread).
    pub fn unpark(&mut self) -> std::io::Result<()> {
        self.sock = match self.sock.take() {
            Some(Sock::Parked(r)) => Some(Sock::Plain(r.into_std()?)),
            other => other,
        };
        Ok(())
    }

    /// Fills every byte of `bufs`: what is buffered first, the rest straight from the socket.
    pub async fn read_exact_vectored(
        &mut self,
        mut bufs: &mut [IoSliceMut<'_>],
    ) -> std::io::Result<()> {
        let taken = self.ahead.take_vectored(bufs);
        IoSliceMut::advance_slices(&mut bufs, taken);
        if bufs.is_empty() {
            return Ok(());
        }
        drive(&mut self.sock, Interest::READABLE, |mut s| {
            let n = s.read_vectored(bufs)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            IoSliceMut::advance_slices(&mut bufs, n);
            Ok(bufs.is_empty())
        })
        .await
    }

    /// Writes every byte of `bufs`.
    pub async fn write_all_vectored(
        &mut self,
        mut bufs: &mut [IoSlice<'_>],
    ) -> std::io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        if bufs.is_empty() {
            return Ok(());
        }
        drive(&mut self.sock, Interest::WRITABLE, |mut s| {
            let n = s.write_vectored(bufs)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut bufs, n);
            Ok(bufs.is_empty())
        })
        .await
    }

    pub async fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.write_all_vectored(&mut [IoSlice::new(data)]).await
    }

    /// One receive into `dst`, without waiting: `Ok(0)` at the end of the stream,
    /// `WouldBlock` when nothing is there.
    fn recv(sock: &Option<Sock>, dst: &mut [u8]) -> std::io::Result<usize> {
        let sock = sock.as_ref().ok_or_else(gone)?.fd();
        loop {
            match (&*sock).read(dst) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                other => return other,
            }
        }
    }

    /// Polls the socket without parking, for up to `spin`, until some bytes are buffered, the
    /// stream ends or fails (the next read reports it), or `spin` has passed.
    ///
    /// Each empty poll yields the CPU: a thread woken on this CPU may be the very peer the
    /// caller waits for. Where the caller and the serving process share one CPU (a container
    /// with one core, or the scheduler putting both there), a poll that kept the CPU held the
    /// peer off it until the spin ran out: a 4 KiB get over loopback tcp took 115 us with both
    /// processes on one CPU of a 2-core VM, and 8 us yielding (10-12 us on the two CPUs
    /// either way; `kvfs bench store` under `taskset -c 0`).
    pub fn spin_for_bytes(&mut self, spin: Duration) {
        self.ahead.spin_fill(spin, false, |b| Self::recv(&self.sock, b));
    }

    /// [`spin_for_bytes`](Self::spin_for_bytes) that also says whether a yield gave the CPU
    /// to another thread (a serving side's [`Crowding`] judges by it).
    fn spin_watching(&mut self, spin: Duration) -> bool {
        self.ahead.spin_fill(spin, true, |b| Self::recv(&self.sock, b))
    }

    /// Fills every byte of `dst`: the buffered bytes first, then from the socket (payloads
    /// at least the buffer's size straight into `dst`), waiting when nothing is there.
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let mut got = self.ahead.take(dst);
        if got == dst.len() {
            return Ok(());
        }
        let ahead = &mut self.ahead;
        drive(&mut self.sock, Interest::READABLE, |mut s| {
            let n = if dst.len() - got >= ahead.buf.len() {
                let n = s.read(&mut dst[got..])?;
                got += n;
                n
            } else {
                let n = s.read(ahead.room())?;
                ahead.filled(n);
                got += ahead.take(&mut dst[got..]);
                n
            };
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(got == dst.len())
        })
        .await
    }
}

/// A registered read half with a small read-ahead buffer (see the module notes): one system
/// call brings in a message's header and whatever is queued behind it; payloads larger than
/// the buffer go straight into their destination.
pub struct Inbound {
    rd: OwnedReadHalf,
    ahead: ReadAhead,
}

impl Inbound {
    /// Reads `rd` ahead by up to `bytes`.
    pub fn new(rd: OwnedReadHalf, bytes: usize) -> Inbound {
        Inbound { rd, ahead: ReadAhead::new(bytes) }
    }

    /// Fills every byte of `bufs`: what is buffered first, the rest straight from the socket.
    pub async fn read_exact_vectored(
        &mut self,
        mut bufs: &mut [IoSliceMut<'_>],
    ) -> std::io::Result<()> {
        let taken = self.ahead.take_vectored(bufs);
        IoSliceMut::advance_slices(&mut bufs, taken);
        while !bufs.is_empty() {
            self.rd.readable().await?;
            match self.rd.try_read_vectored(bufs) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fills every byte of `dst`: the buffered bytes first, then from the socket.
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let mut got = self.ahead.take(dst);
        while got < dst.len() {
            if dst.len() - got >= self.ahead.buf.len() {
                self.rd.read_exact(&mut dst[got..]).await?;
                return Ok(());
            }
            let n = self.rd.read(self.ahead.room()).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.ahead.filled(n);
            got += self.ahead.take(&mut dst[got..]);
        }
        Ok(())
    }
}

/// Whether a server polls a connection for its next request before it parks: after a lone
/// request it answered (the pattern of a client making one call after another), and only while
/// the requests after such answers have come within `max` (the next request of such a caller
/// is then read without waking a parked thread: in a VM that wake is most of a small call's
/// time). The first late request stops the polling, so a connection with spread-out calls (a
/// node's heartbeats, a put's write between two master round trips) costs no core time; the
/// first prompt one resumes it. The rpc acceptor and the Transfer Engine's acceptor both judge
/// by it.
///
/// Promptness is the caller's own account where its request gives one ([`heard`]), and this
/// side's clock otherwise. This side's clock, once it has parked, also counts its own wake-up:
/// where that takes about `max` or more (a parked thread woken on a halted vCPU took 50-60 us
/// on a 2-core VM), every request of a prompt caller looked late, so polling never resumed and
/// each call paid the wake-up (a 4 KiB get's p50 at 51-67 us in about one `kvfs bench store`
/// run in five, against 11 us).
///
/// [`heard`]: ServeSpin::heard
pub struct ServeSpin {
    max: Duration,
    /// The request just answered was a lone one.
    pub lone: bool,
    /// The last request after a lone one came within `max`.
    paid: bool,
    /// Whether its polling shares a CPU with the caller it waits for.
    crowding: Crowding,
}

impl ServeSpin {
    /// Polls for up to `max` (zero: never).
    pub fn new(max: Duration) -> ServeSpin {
        ServeSpin { max, lone: false, paid: true, crowding: Crowding::default() }
    }

    /// Before reading the next request from `rd` when nothing of it is buffered: after a lone
    /// answer, polls (while the last such wait paid) and then parks until the socket has
    /// something, and judges how long that took. `Err`: waiting on the socket failed.
    pub async fn next_request(&mut self, rd: &mut PlainStream) -> std::io::Result<()> {
        if !self.lone || self.max.is_zero() || rd.has_buffered() {
            return Ok(());
        }
        let idle = std::time::Instant::now();
        if self.paid {
            rd.unpark()?;
            if self.crowding.polled(rd.spin_watching(self.max)) {
                move_off_this_cpu();
            }
        }
        if !rd.has_buffered() {
            rd.wait_readable().await?;
        }
        self.waited(idle.elapsed());
        Ok(())
    }

    /// The request that followed a lone one came `waited` after the answer, by this side's
    /// clock.
    fn waited(&mut self, waited: Duration) {
        self.paid = waited < self.max;
    }

    /// The caller's account of its idle time before the request just read, which decides
    /// over this side's clock: it leaves out the wire and this side's wake-up. `None` (the
    /// request does not say) leaves this side's clock in charge.
    pub fn heard(&mut self, idle_us: Option<u32>) {
        if let (true, Some(us)) = (self.lone, idle_us) {
            self.paid = Duration::from_micros(u64::from(us)) < self.max;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_serving_side_moves_after_crowded_waits_and_less_often_where_moving_does_not_help() {
        let mut c = Crowding::default();
        // Uncrowded waits never move; one crowded wait alone does not either.
        assert!((0..100).all(|_| !c.polled(false)));
        assert!(!c.polled(true));
        assert!(!c.polled(false));
        assert!(!c.polled(true));
        assert!(c.polled(true), "the second crowded wait in a row moves");
        // The move helped (the next wait is free): the next crowding moves at the minimum
        // gap after it.
        let waits_to_move = |c: &mut Crowding| (1..=5000).find(|_| c.polled(true)).unwrap();
        assert!(!c.polled(false));
        assert_eq!(1 + waits_to_move(&mut c), MOVE_GAP_MIN, "{c:?}");
        // Moving does not help (every wait stays crowded): the gap doubles up to its maximum.
        let gaps: Vec<u32> = (0..9).map(|_| waits_to_move(&mut c)).collect();
        assert_eq!(gaps[0], MOVE_GAP_MIN + 1, "{gaps:?}");
        assert!(gaps.windows(2).all(|w| w[1] >= w[0]), "{gaps:?}");
        assert_eq!(*gaps.last().unwrap(), MOVE_GAP_MAX + 1, "{gaps:?}");
        // A move that helps resets it.
        assert!(!c.polled(false));
        assert_eq!(1 + waits_to_move(&mut c), MOVE_GAP_MIN, "{c:?}");
    }

    #[test]
    fn moving_off_this_cpu_leaves_the_thread_allowed_where_it_was() {
        use rustix::thread::sched_getaffinity;
        let before = sched_getaffinity(None).unwrap();
        let moved = move_off_this_cpu();
        let after = sched_getaffinity(None).unwrap();
        let cpus = rustix::thread::CpuSet::MAX_CPU;
        assert!((0..cpus).all(|i| before.is_set(i) == after.is_set(i)), "affinity restored");
        assert_eq!(moved, before.count() >= 2, "moves wherever another CPU is allowed");
    }

    #[test]
    fn a_prompt_caller_resumes_the_polling_however_slow_this_side_woke() {
        let us = Duration::from_micros;
        let mut spin = ServeSpin::new(us(50));
        spin.lone = true;
        // A late request (the caller paused) stops the polling.
        spin.waited(us(400));
        assert!(!spin.paid);
        // Parked, this side then measures the caller's next prompt request past its own
        // wake-up: by that clock alone the polling would never resume.
        spin.waited(us(60));
        assert!(!spin.paid);
        // The caller says it came back within 3 us: that decides.
        spin.heard(Some(3));
        assert!(spin.paid);
        // And a caller that says it was away longer than `max` stops it again.
        spin.heard(Some(80));
        assert!(!spin.paid);
        // A request that does not say leaves this side's clock in charge.
        spin.waited(us(10));
        spin.heard(None);
        assert!(spin.paid);
        // After a request that was not lone (a pack, a striped slice), nothing is judged.
        spin.lone = false;
        spin.heard(Some(500));
        assert!(spin.paid);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_reader_stays_registered_and_waits_for_each_new_message() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(1);
        let peer = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            while let Some(m) = rx.recv().await {
                tokio::time::sleep(Duration::from_millis(20)).await;
                s.write_all(&m).await.unwrap();
            }
            // Then the end of the stream.
        });
        let mut p = PlainStream::new(tokio::net::TcpStream::connect(addr).await.unwrap()).unwrap();
        // Messages of one byte, of a few, and one larger than the read-ahead buffer, each
        // sent 20 ms after it is asked for: every wait must last until it is there, however
        // the previous one left the socket's readiness.
        for (i, len) in [1usize, 9, 40_000, 3].into_iter().enumerate() {
            let msg: Vec<u8> = (0..len).map(|b| (b + i) as u8).collect();
            tx.send(msg.clone()).await.unwrap();
            p.wait_readable().await.unwrap();
            assert!(p.has_buffered(), "message {i}: the wait ended with nothing to read");
            assert!(matches!(p.sock, Some(Sock::Parked(_))), "message {i}: not kept registered");
            let mut got = vec![0u8; len];
            p.read_exact(&mut got).await.unwrap();
            assert_eq!(got, msg, "message {i}");
            if i == 2 {
                // Back to polling: off the runtime, and polling still reads what comes.
                p.unpark().unwrap();
                assert!(matches!(p.sock, Some(Sock::Plain(_))));
            }
        }
        drop(tx);
        peer.await.unwrap();
        // The end of the stream after a parked wait: the wait ends and the read reports it.
        p.wait_readable().await.unwrap();
        let mut one = [0u8; 1];
        let e = p.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_and_writes_whole_messages_and_waits_when_it_must() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let peer = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = vec![0u8; 100_000];
            s.read_exact(&mut req).await.unwrap();
            assert!(req.iter().enumerate().all(|(i, &b)| b == i as u8));
            // An answer that comes late (the reader waits) and in pieces, one larger than
            // the read-ahead buffer.
            tokio::time::sleep(Duration::from_millis(50)).await;
            s.write_all(b"head").await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            s.write_all(&vec![7u8; 40_000]).await.unwrap();
            // Then the end of the stream.
        });
        let mut p = PlainStream::new(tokio::net::TcpStream::connect(addr).await.unwrap()).unwrap();
        let req: Vec<u8> = (0..100_000).map(|i| i as u8).collect();
        p.write_all(&req).await.unwrap();
        p.spin_for_bytes(Duration::from_micros(100));
        let mut head = [0u8; 4];
        p.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"head");
        let mut body = vec![0u8; 40_000];
        p.read_exact(&mut body).await.unwrap();
        assert!(body.iter().all(|&b| b == 7));
        peer.await.unwrap();
        let mut more = [0u8; 1];
        let e = p.read_exact(&mut more).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_it_unusable_with_a_clear_error() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _held = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let mut p = PlainStream::new(tokio::net::TcpStream::connect(addr).await.unwrap()).unwrap();
        let mut b = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(20), p.read_exact(&mut b)).await;
        assert!(waited.is_err(), "nothing was sent: the read must still be waiting");
        let e = p.read_exact(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotConnected);
        assert_eq!(p.write_all(b"x").await.unwrap_err().kind(), std::io::ErrorKind::NotConnected);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_split_pair_moves_more_than_the_socket_holds_both_ways_at_once() {
        // 32 MiB each way, far past loopback's socket buffers: both halves must wait many
        // times (registered for the rest of each operation), each on its own registration,
        // while the other half waits too.
        const N: usize = 32 << 20;
        let pattern = |i: usize, salt: usize| (i.wrapping_mul(31) ^ salt) as u8;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let peer = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let (mut rd, mut wr) = PlainStream::split(s).unwrap();
            let writer = tokio::spawn(async move {
                let out: Vec<u8> = (0..N).map(|i| pattern(i, 5)).collect();
                wr.write_all(&out).await.unwrap();
                wr.shutdown_write().unwrap();
            });
            let mut got = vec![0u8; N];
            let (a, b) = got.split_at_mut(N / 2);
            let mut bufs = [IoSliceMut::new(a), IoSliceMut::new(b)];
            rd.read_exact_vectored(&mut bufs).await.unwrap();
            assert!(got.iter().enumerate().all(|(i, &v)| v == pattern(i, 9)));
            writer.await.unwrap();
        });
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut rd, mut wr) = PlainStream::split(s).unwrap();
        let writer = tokio::spawn(async move {
            let out: Vec<u8> = (0..N).map(|i| pattern(i, 9)).collect();
            wr.write_all_vectored(&mut [IoSlice::new(&out[..7]), IoSlice::new(&out[7..])])
                .await
                .unwrap();
            wr
        });
        let mut got = vec![0u8; N];
        rd.read_exact(&mut got[..3]).await.unwrap();
        rd.read_exact(&mut got[3..]).await.unwrap();
        assert!(got.iter().enumerate().all(|(i, &v)| v == pattern(i, 5)));
        let _wr = writer.await.unwrap();
        peer.await.unwrap();
        // The peer shut its side down: the end of the stream, after every byte.
        let e = rd.read_exact(&mut [0u8; 1]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
