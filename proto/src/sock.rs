//! Socket options shared by kvfs's TCP connections.

use std::os::fd::AsFd;

/// Keeps a connection between two processes of this host off a paced congestion control.
///
/// Such a connection crosses loopback. A paced congestion control (BBR, the default of some
/// hosts) sends from its pacing timer in softirq, on whichever CPU the timer fires, while the
/// writer sends from its own CPU; the two CPUs' backlogs then deliver the connection's segments
/// out of order, and the receiver's duplicate acknowledgements trigger spurious fast
/// retransmits. Measured on a 2-core host with BBR as its default: one raw stream moved 64 MiB
/// in 24-27 ms with BBR and in 10-11 ms with reno or cubic, and a bench run counted 9,000
/// retransmitted and 20,000 reordered segments with BBR against 4 out-of-order with cubic.
///
/// Such a connection switches to reno (which every user may choose; loopback loses nothing, so
/// it never slows reno down). A connection to another host, or one already on a congestion
/// control that does not pace, keeps the host's choice. Failures change nothing: the
/// connection works as before.
pub fn unpace_same_host<S: AsFd>(stream: &S) {
    let s = socket2::SockRef::from(stream);
    let ip = |a: std::io::Result<socket2::SockAddr>| {
        a.ok().and_then(|a| a.as_socket()).map(|a| a.ip().to_canonical())
    };
    let same_host = match (ip(s.local_addr()), ip(s.peer_addr())) {
        (Some(l), Some(p)) => p.is_loopback() || p == l,
        _ => false,
    };
    if same_host && s.tcp_congestion().is_ok_and(|name| name.starts_with(b"bbr")) {
        let _ = s.set_tcp_congestion(b"reno");
    }
}

/// The options of every kvfs TCP connection (the Transfer Engine's and the control plane's):
/// no Nagle delay, [`unpace_same_host`], keepalive that finds a peer that vanished while the
/// connection sat idle (probes after 10 s, every 5 s, 3 of them), and, when `buffer_bytes` is
/// not 0, send and receive buffers of that size (0: the kernel's autotuning). Failures leave
/// the connection as it was.
pub fn tune<S: AsFd>(stream: &S, buffer_bytes: usize) {
    let s = socket2::SockRef::from(stream);
    let _ = s.set_tcp_nodelay(true);
    unpace_same_host(stream);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(10))
        .with_interval(std::time::Duration::from_secs(5))
        .with_retries(3);
    let _ = s.set_tcp_keepalive(&keepalive);
    if buffer_bytes > 0 {
        let _ = s.set_send_buffer_size(buffer_bytes);
        let _ = s.set_recv_buffer_size(buffer_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of a loopback connection leave BBR, when the host offers it; a connection's
    /// congestion control is otherwise left alone.
    #[test]
    fn loopback_connections_leave_bbr() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        let name = |s: &std::net::TcpStream| socket2::SockRef::from(s).tcp_congestion().unwrap();
        let before = name(&c);
        // Where BBR is available, put the client on it first, as a BBR host default would.
        let bbr = socket2::SockRef::from(&c).set_tcp_congestion(b"bbr").is_ok();
        unpace_same_host(&c);
        unpace_same_host(&a);
        for s in [&c, &a] {
            let now = name(s);
            assert!(!now.starts_with(b"bbr"), "{:?}", String::from_utf8_lossy(&now));
        }
        if !bbr && !before.starts_with(b"bbr") {
            assert_eq!(name(&c), before, "a non-paced choice is kept");
        }
        if bbr {
            assert!(name(&c).starts_with(b"reno"));
        }
    }

    /// `tune` sets what it says, read back from the socket.
    #[test]
    fn tune_sets_nodelay_keepalive_and_buffers() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        tune(&c, 1 << 20);
        let s = socket2::SockRef::from(&c);
        assert!(s.tcp_nodelay().unwrap());
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), std::time::Duration::from_secs(10));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), std::time::Duration::from_secs(5));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 3);
        // Fixed at what was asked for (no autotuning): the kernel caps it at
        // `net.core.{w,r}mem_max` and reports it doubled.
        let max = |f: &str| -> usize {
            std::fs::read_to_string(format!("/proc/sys/net/core/{f}"))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        assert_eq!(s.send_buffer_size().unwrap(), 2 * max("wmem_max").min(1 << 20));
        assert_eq!(s.recv_buffer_size().unwrap(), 2 * max("rmem_max").min(1 << 20));
    }
}
