//! The shm transport: engines on one host share memfd-backed buffers, and a transfer is one
//! memcpy between the caller's memory and the peer's mapped buffer.
//!
//! Mechanism. Every engine with shm enabled listens on an abstract Unix socket (named in its
//! handshake [`Welcome`](kvfs_proto::transfer::Welcome)). A peer on the same host connects,
//! asks for the shareable buffers in chunks, receives one memfd per buffer with SCM_RIGHTS,
//! checks that each is sealed against shrinking and long enough, and maps it. The first
//! connection then stays open as a liveness watch: the kernel closes it when the owner dies,
//! and from then on every transfer to that segment fails with `PeerGone` instead of writing
//! into orphaned memory. A request whose remote range is not mapped triggers one refresh (the
//! owner may have registered new buffers); ranges that still do not map fall back to tcp
//! (the owner may have registered raw memory, which cannot be shared).
//!
//! With a cluster secret configured, every connection to the socket proves it before its
//! first request (`kvfs_proto::auth`): a local process without it never receives a memfd.
//!
//! Not handled: buffers the owner unregisters while peers still have them mapped keep their
//! pages alive (the mapping holds them); the owner must stop addressing them, as with memory
//! deregistered from an RDMA NIC.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvfs_proto::auth::ClusterSecret;
use kvfs_proto::transfer::{SHM_FDS_PER_MESSAGE_MAX, ShmBufferDesc, ShmBuffers, ShmRequest};
use tokio::io::{AsyncReadExt, Interest};
use tokio::task::JoinSet;

use crate::engine::Shared;
use crate::memory::Buffer;
use crate::{Error, ErrorKind, Result};

const REQUEST_FRAME_MAX: usize = 4096;
const REPLY_FRAME_MAX: usize = 1 << 20;

/// Binds this engine's abstract socket; returns it with its name.
pub(crate) fn bind(instance: u64) -> Result<(tokio::net::UnixListener, String)> {
    let name = format!("kvfs-te/{}/{instance:016x}", std::process::id());
    let addr =
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| Error::io("shm bind", e))?;
    let listener = UnixListener::bind_addr(&addr).map_err(|e| Error::io("shm bind", e))?;
    listener.set_nonblocking(true).map_err(|e| Error::io("shm bind", e))?;
    let listener =
        tokio::net::UnixListener::from_std(listener).map_err(|e| Error::io("shm bind", e))?;
    Ok((listener, name))
}

/// Accepts same-host peers until the task is aborted (which aborts their connections too).
pub(crate) async fn serve(listener: tokio::net::UnixListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => { conns.spawn(serve_conn(stream, shared.clone())); }
                Err(e) => {
                    tracing::warn!(error = %e, "shm accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve_conn(mut stream: tokio::net::UnixStream, shared: Arc<Shared>) {
    if let Some(secret) = &shared.cfg.cluster_secret {
        let timeout = shared.cfg.connect_timeout();
        match tokio::time::timeout(timeout, kvfs_proto::auth::accept(&mut stream, secret)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return tracing::warn!(error = %e, "shm connection refused"),
            Err(_) => return tracing::warn!("shm connection refused: no secret handshake in time"),
        }
    }
    loop {
        let req = match kvfs_proto::read_msg::<_, ShmRequest>(&mut stream, REQUEST_FRAME_MAX).await
        {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => return tracing::debug!(error = %e, "bad shm request"),
        };
        let ShmRequest::Buffers { start } = req;
        if let Err(e) = send_buffers(&stream, &shared, start as usize).await {
            return tracing::debug!(error = %e, "shm reply failed");
        }
    }
}

async fn send_buffers(
    stream: &tokio::net::UnixStream,
    shared: &Shared,
    start: usize,
) -> std::io::Result<()> {
    let all = shared.registry.shareable();
    let chunk: Vec<_> = all.iter().skip(start).take(SHM_FDS_PER_MESSAGE_MAX).cloned().collect();
    let msg = ShmBuffers {
        buffers: chunk
            .iter()
            .map(|b| ShmBufferDesc { addr: b.addr(), len: b.len() as u64 })
            .collect(),
        more: start + chunk.len() < all.len(),
    };
    let frame = kvfs_proto::encode_frame(&msg).map_err(std::io::Error::other)?;
    // `shareable()` only lists buffers that have a memfd.
    let fds: Vec<RawFd> = chunk.iter().filter_map(|b| b.fd()).map(|f| f.as_raw_fd()).collect();
    let raw = stream.as_raw_fd();
    let mut sent = stream.async_io(Interest::WRITABLE, || sendmsg_fds(raw, &frame, &fds)).await?;
    while sent < frame.len() {
        sent +=
            stream.async_io(Interest::WRITABLE, || sendmsg_fds(raw, &frame[sent..], &[])).await?;
    }
    // `chunk` (and so every fd) stays alive until the message is sent.
    drop(chunk);
    Ok(())
}

fn sendmsg_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr is a valid "empty" value; fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer is large enough (CMSG_SPACE) and 8-byte aligned; the first
        // header is written within it and the fds are copied into its data area.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes,
            );
        }
    }
    // SAFETY: msg points at live iovec and control buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Receives up to `buf.len()` bytes and any descriptors that came with them.
fn recvmsg_fds(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let fd_bytes = 253 * std::mem::size_of::<RawFd>();
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr, then pointed at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg points at live buffers for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: walking the control messages the kernel wrote into cbuf, bounded by controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let count =
                    ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("descriptors truncated"));
    }
    Ok(n as usize)
}

/// Fetches every shareable buffer of the engine at `socket` (blocking; run off the runtime).
/// Returns the stream, kept open by the caller as the liveness watch.
fn fetch_buffers(
    socket: &str,
    timeout: Duration,
    secret: Option<ClusterSecret>,
) -> Result<(UnixStream, Vec<(ShmBufferDesc, OwnedFd)>)> {
    let io = |e| Error::io("shm fetch", e);
    let addr = SocketAddr::from_abstract_name(socket.as_bytes()).map_err(io)?;
    let mut s = UnixStream::connect_addr(&addr).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    if let Some(secret) = &secret {
        kvfs_proto::auth::connect_blocking(&mut s, secret)
            .map_err(|e| crate::tcp::auth_error(e, "shm fetch"))?;
    }
    let mut out = Vec::new();
    loop {
        let frame = kvfs_proto::encode_frame(&ShmRequest::Buffers { start: out.len() as u32 })
            .map_err(|e| Error::new(ErrorKind::Io, "shm fetch", e.to_string()))?;
        s.write_all(&frame).map_err(io)?;
        let (reply, fds) = read_reply(&mut s)?;
        if fds.len() != reply.buffers.len() {
            return Err(Error::new(
                ErrorKind::Io,
                "shm fetch",
                "descriptor count does not match buffer list",
            ));
        }
        let got = reply.buffers.len();
        out.extend(reply.buffers.into_iter().zip(fds));
        if !reply.more || got == 0 {
            return Ok((s, out));
        }
    }
}

fn read_reply(s: &mut UnixStream) -> Result<(ShmBuffers, Vec<OwnedFd>)> {
    let io = |e| Error::io("shm fetch", e);
    let mut buf = vec![0u8; 64 << 10];
    let mut fds = Vec::new();
    let mut have = 0;
    while have < 4 {
        let n = recvmsg_fds(s.as_raw_fd(), &mut buf[have..], &mut fds).map_err(io)?;
        if n == 0 {
            return Err(Error::new(ErrorKind::PeerGone, "shm fetch", "peer closed the socket"));
        }
        have += n;
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > REPLY_FRAME_MAX {
        return Err(Error::new(
            ErrorKind::Io,
            "shm fetch",
            format!("reply of {len} bytes is too large"),
        ));
    }
    if buf.len() < 4 + len {
        buf.resize(4 + len, 0);
    }
    if have < 4 + len {
        s.read_exact(&mut buf[have..4 + len]).map_err(io)?;
    }
    let reply = kvfs_proto::decode_body(&buf[4..4 + len])
        .map_err(|e| Error::new(ErrorKind::Io, "shm fetch", e.to_string()))?;
    Ok((reply, fds))
}

/// The shm side of one remote segment: the peer's buffers mapped into this process.
pub(crate) struct ShmPeer {
    socket: String,
    timeout: Duration,
    secret: Option<ClusterSecret>,
    maps: RwLock<BTreeMap<u64, Arc<Buffer>>>,
    dead: Arc<AtomicBool>,
    /// Held while refreshing; holds when the last refresh finished.
    refresh: tokio::sync::Mutex<Option<std::time::Instant>>,
}

/// A range that is in none of a peer's shared buffers fetches its buffer list again at most
/// this often: memory the peer registered by address (never shareable) then goes over tcp
/// without one round trip per item, and a buffer the peer shares later is seen within it.
const REFRESH_INTERVAL: Duration = Duration::from_millis(200);

impl ShmPeer {
    pub async fn open(
        socket: String,
        timeout: Duration,
        secret: Option<ClusterSecret>,
    ) -> Result<ShmPeer> {
        let name = socket.clone();
        let (watch, bufs) =
            tokio::task::spawn_blocking(move || fetch_buffers(&name, timeout, secret))
                .await
                .map_err(|e| Error::new(ErrorKind::Io, "shm open", e.to_string()))??;
        let peer = ShmPeer {
            socket,
            timeout,
            secret,
            maps: RwLock::new(BTreeMap::new()),
            dead: Arc::new(AtomicBool::new(false)),
            refresh: tokio::sync::Mutex::new(None),
        };
        peer.install(bufs)?;
        watch.set_read_timeout(None).map_err(|e| Error::io("shm open", e))?;
        watch.set_nonblocking(true).map_err(|e| Error::io("shm open", e))?;
        let mut watch =
            tokio::net::UnixStream::from_std(watch).map_err(|e| Error::io("shm open", e))?;
        let dead = peer.dead.clone();
        tokio::spawn(async move {
            // The owner never writes on this connection; any return means it is gone.
            let _ = watch.read(&mut [0u8; 1]).await;
            dead.store(true, Ordering::Release);
        });
        Ok(peer)
    }

    fn install(&self, bufs: Vec<(ShmBufferDesc, OwnedFd)>) -> Result<()> {
        let mut maps = self.maps.write().unwrap_or_else(|e| e.into_inner());
        for (desc, fd) in bufs {
            let known = maps.get(&desc.addr).is_some_and(|m| m.len() as u64 == desc.len);
            if known {
                continue;
            }
            let mapping = Buffer::map_peer_fd(fd, desc.len as usize)?;
            maps.insert(desc.addr, Arc::new(mapping));
        }
        Ok(())
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// The local mapping holding the whole remote range, and the range's offset in it.
    pub fn translate(&self, remote: u64, len: u64) -> Option<(Arc<Buffer>, usize)> {
        let maps = self.maps.read().unwrap_or_else(|e| e.into_inner());
        let (&base, m) = maps.range(..=remote).next_back()?;
        let end = remote.checked_add(len)?;
        (end <= base + m.len() as u64).then(|| (m.clone(), (remote - base) as usize))
    }

    /// Fetches the peer's buffer list again and maps any new ones, unless that happened less
    /// than [`REFRESH_INTERVAL`] ago (concurrent callers wait for one fetch).
    pub async fn refresh(&self) -> Result<()> {
        let mut last = self.refresh.lock().await;
        if last.is_some_and(|t| t.elapsed() < REFRESH_INTERVAL) {
            return Ok(());
        }
        let (name, timeout, secret) = (self.socket.clone(), self.timeout, self.secret);
        let (_stream, bufs) =
            tokio::task::spawn_blocking(move || fetch_buffers(&name, timeout, secret))
                .await
                .map_err(|e| Error::new(ErrorKind::Io, "shm refresh", e.to_string()))??;
        let installed = self.install(bufs);
        *last = Some(std::time::Instant::now());
        installed
    }

    pub fn mapped_buffers(&self) -> usize {
        self.maps.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}
