//! Replica locations a client may read without asking the master: a get in one round trip.
//!
//! Mechanism. A `Get` answer grants a read lease and says how much of it is left
//! (`ObjectView::lease_left_ms`). Until that lease ends by this process's own clock (three
//! quarters of what was left when the request was sent, so clock rates and the answer's time
//! on the wire only shorten it), the master will not reuse the replica's range (it frees a
//! leased object's ranges only when the lease ends, except for a forced removal) and the
//! client keeps the location here. A later get of the key reads it straight from the node with
//! a *guarded* read (`kvfs_transfer::Engine::read_guarded`): the request carries the key and
//! version, and the node serves it only while its index still holds that version of that key
//! in DRAM around the range. The master delivers the `Drop` of a leased object's name to its
//! nodes before it answers the call that removed or replaced it, so once that call returns, no
//! guarded read of the old version succeeds: a removed or replaced object is never read, and
//! its bytes are protected by the lease the location was cached under. The node counts each
//! guarded read as an access for its tier policy; the master sees the key's accesses once per
//! lease, when the location expires and a get asks it again.
//!
//! Only memory replicas reachable over tcp or in this process are cached (a guarded read needs
//! its owner to check it, which one-sided shared memory or rdma reads do not do; those reads
//! are one master round trip plus a memcpy anyway), and only objects up to
//! [`CACHED_BYTES_MAX`]: past that the master's round trip is noise next to the transfer.
//!
//! Bounds: at most [`LOCATIONS_MAX`] entries; a full cache first drops expired entries, then
//! everything.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Entries kept at most.
pub const LOCATIONS_MAX: usize = 65_536;
/// Largest object read through a cached location.
pub const CACHED_BYTES_MAX: u64 = 1 << 20;
/// Shortest lease worth caching a location under.
const LEASE_MIN: Duration = Duration::from_millis(100);

/// Where one version of an object lives, and until when this client may rely on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub version: u64,
    pub size: u64,
    /// Transfer Engine segment name of the node.
    pub endpoint: String,
    /// Address of the replica in the node's segment.
    pub addr: u64,
    pub until: Instant,
}

/// The cache; every call takes its lock once, briefly.
#[derive(Default)]
pub struct Locations {
    map: Mutex<HashMap<String, Location, foldhash::fast::RandomState>>,
}

impl Locations {
    /// The live location of `key`, if this client holds one.
    pub fn get(&self, key: &str, now: Instant) -> Option<Location> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key).filter(|l| l.until > now).cloned()
    }

    /// Remembers a location read under a lease of `lease_left_ms` granted to a request sent
    /// at `sent`.
    pub fn insert(&self, key: &str, mut loc: Location, sent: Instant, lease_left_ms: u64) {
        let lease = Duration::from_millis(lease_left_ms.saturating_mul(3) / 4);
        if lease < LEASE_MIN || loc.size > CACHED_BYTES_MAX || loc.size == 0 {
            return;
        }
        loc.until = sent + lease;
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= LOCATIONS_MAX && !map.contains_key(key) {
            let now = Instant::now();
            map.retain(|_, l| l.until > now);
            if map.len() >= LOCATIONS_MAX {
                map.clear();
            }
        }
        map.insert(key.to_string(), loc);
    }

    /// Forgets `key` (this client changed or removed it, or its node refused the location).
    pub fn forget(&self, key: &str) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if !map.is_empty() {
            map.remove(key);
        }
    }

    /// Forgets everything (this client removed objects by pattern).
    pub fn clear(&self) {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(size: u64) -> Location {
        Location { version: 7, size, endpoint: "n".into(), addr: 4096, until: Instant::now() }
    }

    #[test]
    fn entries_live_for_three_quarters_of_the_lease_left() {
        let c = Locations::default();
        let sent = Instant::now();
        c.insert("k", loc(10), sent, 10_000);
        assert_eq!(c.get("k", sent).map(|l| l.version), Some(7));
        assert!(c.get("k", sent + Duration::from_millis(7_400)).is_some());
        assert!(c.get("k", sent + Duration::from_millis(7_600)).is_none());
        c.forget("k");
        assert!(c.get("k", sent).is_none());
    }

    #[test]
    fn short_leases_large_and_empty_objects_are_not_cached() {
        let c = Locations::default();
        let now = Instant::now();
        c.insert("short", loc(10), now, 100);
        c.insert("large", loc(CACHED_BYTES_MAX + 1), now, 10_000);
        c.insert("empty", loc(0), now, 10_000);
        assert!(c.is_empty());
    }

    #[test]
    fn a_full_cache_makes_room() {
        let c = Locations::default();
        let long_ago = Instant::now() - Duration::from_secs(60);
        for i in 0..LOCATIONS_MAX {
            c.insert(&format!("old{i}"), loc(1), long_ago, 10_000);
        }
        assert_eq!(c.len(), LOCATIONS_MAX);
        c.insert("new", loc(1), Instant::now(), 10_000);
        assert_eq!(c.len(), 1, "expired entries made room");
        assert!(c.get("new", Instant::now()).is_some());
    }
}
