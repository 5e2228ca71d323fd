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
    let same_host = match (s.local_addr(), s.peer_addr()) {
        (Ok(l), Ok(p)) => match (l.as_socket(), p.as_socket()) {
            (Some(l), Some(p)) => {
                let (l, p) = (l.ip().to_canonical(), p.ip().to_canonical());
                p.is_loopback() || p == l
            }
            _ => false,
        },
        _ => false,
    };
    if !same_host {
        return;
    }
    if s.tcp_congestion().is_ok_and(|name| name.starts_with(b"bbr")) {
        let _ = s.set_tcp_congestion(b"reno");
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
}
