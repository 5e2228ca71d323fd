//! Hosts for multi-host tests on one machine: network namespaces joined by veth pairs to a
//! bridge in the test's own namespace, made by the test and torn down when dropped (needs
//! root, as CI runs). Each host has its own address, loopback and TCP stack; the test process
//! reaches every host through the bridge. Links are cut and healed with `ip link` (a host
//! cut off from everyone) or a blackhole route inside a host (one host cut from some
//! addresses, in both directions, since no reply can leave).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Runs `ip ARGS` (or `ip netns exec NS ip ARGS`), panicking with its stderr on failure.
fn ip(ns: Option<&str>, args: &[&str]) {
    let mut cmd = Command::new("ip");
    if let Some(ns) = ns {
        cmd.args(["netns", "exec", ns, "ip"]);
    }
    let out = cmd.args(args).output().expect("ip (iproute2) runs");
    assert!(
        out.status.success(),
        "ip {args:?} in {ns:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One namespace on the bridge.
pub struct Host {
    pub ns: String,
    /// Its address on the bridge's subnet.
    pub ip: String,
    /// The root-side end of its veth pair (on the bridge).
    link: String,
}

/// A bridge and its hosts; everything is deleted on drop.
pub struct Net {
    bridge: String,
    pub hosts: Vec<Host>,
    /// The test process's own address on the bridge.
    pub gateway: String,
}

impl Net {
    /// `n` hosts (at most 200) on a /24 of their own in 198.18.0.0/15, the range set aside
    /// for network tests (RFC 2544), so no real network's routes are shadowed.
    pub fn new(n: usize) -> Net {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Interface names have at most 15 bytes: "kb" + 5 digits of the pid + 2 + 3.
        let tag = format!("{:05}{:02}", pid % 100_000, seq % 100);
        let block = (pid.wrapping_mul(7).wrapping_add(seq)) % 512;
        let subnet = format!("198.{}.{}", 18 + block / 256, block % 256);
        let bridge = format!("kb{tag}");
        let _ = Command::new("ip").args(["link", "del", &bridge]).output();
        ip(None, &["link", "add", &bridge, "type", "bridge"]);
        let gateway = format!("{subnet}.1");
        let mut net = Net { bridge: bridge.clone(), hosts: Vec::new(), gateway: gateway.clone() };
        ip(None, &["addr", "add", &format!("{gateway}/24"), "dev", &bridge]);
        ip(None, &["link", "set", &bridge, "up"]);
        for i in 0..n {
            let ns = format!("kvfs-{tag}-{i}");
            let link = format!("kv{tag}{i:03}");
            let peer = format!("kp{tag}{i:03}");
            let host_ip = format!("{subnet}.{}", 10 + i);
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            ip(None, &["netns", "add", &ns]);
            net.hosts.push(Host { ns: ns.clone(), ip: host_ip.clone(), link: link.clone() });
            ip(None, &["link", "add", &link, "type", "veth", "peer", "name", &peer]);
            ip(None, &["link", "set", &peer, "netns", &ns]);
            ip(None, &["link", "set", &link, "master", &bridge]);
            ip(None, &["link", "set", &link, "up"]);
            ip(Some(&ns), &["link", "set", "lo", "up"]);
            ip(Some(&ns), &["addr", "add", &format!("{host_ip}/24"), "dev", &peer]);
            ip(Some(&ns), &["link", "set", &peer, "up"]);
        }
        net
    }

    /// `program` to run in host `i`'s namespace.
    pub fn command(&self, i: usize, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.hosts[i].ns, program]);
        cmd
    }

    /// Cuts host `i` off from every other host and from the test process.
    pub fn cut(&self, i: usize) {
        ip(None, &["link", "set", &self.hosts[i].link, "down"]);
    }

    /// Undoes [`Net::cut`].
    pub fn heal(&self, i: usize) {
        ip(None, &["link", "set", &self.hosts[i].link, "up"]);
    }

    /// Host `i` can no longer exchange packets with `addr` (another host, or the gateway).
    pub fn block(&self, i: usize, addr: &str) {
        ip(Some(&self.hosts[i].ns), &["route", "add", "blackhole", &format!("{addr}/32")]);
    }

    /// The test process can no longer exchange packets with `addr`.
    pub fn block_here(&self, addr: &str) {
        ip(None, &["route", "add", "blackhole", &format!("{addr}/32")]);
    }

    /// Undoes [`Net::block_here`].
    pub fn unblock_here(&self, addr: &str) {
        ip(None, &["route", "del", "blackhole", &format!("{addr}/32")]);
    }

    /// Undoes [`Net::block`].
    pub fn unblock(&self, i: usize, addr: &str) {
        ip(Some(&self.hosts[i].ns), &["route", "del", "blackhole", &format!("{addr}/32")]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", &h.ns]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).output();
    }
}
