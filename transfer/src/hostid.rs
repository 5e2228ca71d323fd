//! Host identity: which engines share a machine (and so can share memory).
//!
//! Two engines may use the shm transport only when they run on the same kernel and in the same
//! network namespace (the shm side channel is an abstract Unix socket, which is scoped to the
//! network namespace). The identity is the kernel's boot id plus the network namespace inode;
//! processes in separate namespaces made by tests therefore look like separate hosts, which is
//! what those tests want.

use std::sync::OnceLock;

/// This process's host identity, computed once.
pub fn host_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown-boot".to_string());
        let netns = std::fs::read_link("/proc/self/ns/net")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown-netns".to_string());
        format!("{boot}/{netns}")
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_id_is_stable_and_specific() {
        let a = super::host_id();
        assert_eq!(a, super::host_id());
        assert!(a.contains("net:["), "{a}");
    }
}
