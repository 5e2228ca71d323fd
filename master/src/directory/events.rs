//! The pool's KV events: which objects became visible in the pool, on which medium, and which
//! went away, journalled for a publisher (the service's `kv_events`) to drain.
//!
//! Mechanism. When enabled ([`Directory::enable_pool_events`]), the directory records a
//! [`PoolEvent`] wherever an object's *pool medium* changes: `Cpu` while it has a DRAM (or
//! HBM) replica, else `Disk` while it has an NVMe or object-store one, else none (gone or not
//! yet complete). The primitives that change replicas (`attach_replica`, `detach_replica`,
//! `set_persisted`, `forget_object`, `rekey`) each compare the medium before and after and
//! record `Removed(old)` then `Stored(new)` for a change, so every path (put end, the noted
//! and embedded commit paths, which end in the same `put_end`, removal, eviction, node loss,
//! loads, demotion reports, recovery, renames) is covered without hooks of its own. Compound
//! steps that pass through intermediate media (an insert followed by its replicas, a removal
//! detaching replicas one by one) set the journal aside and record one transition at the end
//! (`events_pause` / `events_resume`), so a put is one `Stored` and a removal one `Removed`.
//!
//! Policy. The journal is bounded (`queue_max`): past it the oldest event is dropped and
//! counted, so a stalled publisher never grows the master's memory; a consumer that missed
//! events only holds stale prefix hints. Disabled (the default), the hooks cost one branch.
//!
//! Not handled here: encoding, sequence numbers and delivery (the service's `kv_events`).

use std::collections::VecDeque;
use std::sync::Arc;

use super::Directory;
use crate::types::Tier;

/// What happened to an object in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolEventKind {
    Stored,
    Removed,
}

/// The pool's medium for an object: `Cpu` with any memory replica, else `Disk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolMedium {
    Cpu,
    Disk,
}

impl PoolMedium {
    /// The reference store's (and the conductor's) name of the medium.
    pub fn name(self) -> &'static str {
        match self {
            PoolMedium::Cpu => "cpu",
            PoolMedium::Disk => "disk",
        }
    }
}

/// One journalled change of an object's presence in the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolEvent {
    pub kind: PoolEventKind,
    pub key: Arc<str>,
    pub medium: PoolMedium,
}

/// Counters of the journal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolEventStats {
    /// Events recorded since the journal was enabled.
    pub recorded: u64,
    /// Events dropped (oldest first) because the journal was full.
    pub dropped: u64,
    /// Events waiting to be drained.
    pub queued: u64,
}

/// The bounded queue of events.
#[derive(Debug)]
pub(super) struct Journal {
    queue: VecDeque<PoolEvent>,
    queue_max: usize,
    recorded: u64,
    dropped: u64,
}

impl Journal {
    fn push(&mut self, e: PoolEvent) {
        if self.queue.len() >= self.queue_max && self.queue.pop_front().is_some() {
            self.dropped += 1;
        }
        self.queue.push_back(e);
        self.recorded += 1;
    }
}

/// The journal set aside by [`Directory::events_pause`].
pub(super) struct Paused(Option<Journal>);

impl Directory {
    /// Start journalling pool events, keeping at most `queue_max` (at least 1) undrained.
    pub fn enable_pool_events(&mut self, queue_max: usize) {
        self.events = Some(Journal {
            queue: VecDeque::new(),
            queue_max: queue_max.max(1),
            recorded: 0,
            dropped: 0,
        });
    }

    /// Take up to `max` journalled events, oldest first.
    pub fn drain_pool_events(&mut self, max: usize) -> Vec<PoolEvent> {
        let Some(j) = self.events.as_mut() else { return Vec::new() };
        let n = max.min(j.queue.len());
        j.queue.drain(..n).collect()
    }

    pub fn pool_event_stats(&self) -> PoolEventStats {
        self.events.as_ref().map_or_else(PoolEventStats::default, |j| PoolEventStats {
            recorded: j.recorded,
            dropped: j.dropped,
            queued: j.queue.len() as u64,
        })
    }

    /// The object's pool medium now.
    pub(super) fn pool_medium(&self, id: u32) -> Option<PoolMedium> {
        let mut any = self.objects[id].flags().persisted;
        for (_, seg, _) in self.replicas(id) {
            if matches!(self.segment(seg).tier, Tier::Dram | Tier::Hbm) {
                return Some(PoolMedium::Cpu);
            }
            any = true;
        }
        any.then_some(PoolMedium::Disk)
    }

    /// The object's medium before a change, when journalling (`None`: not journalling).
    pub(super) fn medium_before(&self, id: u32) -> Option<Option<PoolMedium>> {
        self.events.as_ref().map(|_| self.pool_medium(id))
    }

    /// Record the change of object `id`'s medium from `before` (see `medium_before`).
    pub(super) fn medium_changed(&mut self, id: u32, before: Option<Option<PoolMedium>>) {
        let Some(before) = before else { return };
        let after = self.pool_medium(id);
        if before != after {
            let key = self.key_arc(id);
            self.record_transition(&key, before, after);
        }
    }

    /// `Removed(before)` then `Stored(after)`, for the media present.
    pub(super) fn record_transition(
        &mut self,
        key: &Arc<str>,
        before: Option<PoolMedium>,
        after: Option<PoolMedium>,
    ) {
        let Some(j) = self.events.as_mut() else { return };
        if let Some(medium) = before {
            j.push(PoolEvent { kind: PoolEventKind::Removed, key: key.clone(), medium });
        }
        if let Some(medium) = after {
            j.push(PoolEvent { kind: PoolEventKind::Stored, key: key.clone(), medium });
        }
    }

    /// Set the journal aside for a compound step (see the module notes).
    pub(super) fn events_pause(&mut self) -> Paused {
        Paused(self.events.take())
    }

    /// Put the journal back and record object `id`'s change from `before` (not yet visible:
    /// `None`) to its medium now.
    pub(super) fn events_resume(&mut self, paused: Paused, id: u32, before: Option<PoolMedium>) {
        self.events_restore(paused);
        if self.events.is_some() {
            self.medium_changed(id, Some(before));
        }
    }

    /// Put the journal back (the object it was about may be gone; record by key).
    pub(super) fn events_restore(&mut self, paused: Paused) {
        if let Paused(Some(j)) = paused {
            self.events = Some(j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::types::*;

    const MIB: u64 = 1 << 20;

    /// One node with a DRAM segment of `dram` bytes and an NVMe segment, journalling.
    fn dir(dram: u64, queue_max: usize) -> Directory {
        let mut d = Directory::new(Config { seed: 1, ..Config::default() }).unwrap();
        let segments = vec![
            SegmentSpec { index: 0, tier: Tier::Dram, base_addr: 1 << 30, capacity: dram },
            SegmentSpec { index: 1, tier: Tier::Nvme, base_addr: 0, capacity: 64 * MIB },
        ];
        let reg = NodeRegistration {
            node: NodeId(1),
            host: "h".into(),
            endpoint: "10.0.0.1:7000".into(),
            segments,
            held: Vec::new(),
        };
        d.register_node(&reg, 0, &mut Vec::new()).unwrap();
        d.enable_pool_events(queue_max);
        d
    }

    fn put(d: &mut Directory, key: &str, now: u64) {
        let mut fx = Vec::new();
        d.put_start(&PutStart::new(key, MIB), now, &mut fx).unwrap();
        d.put_end(&PutEnd::new(key, None), now, &mut fx).unwrap();
    }

    fn drain(d: &mut Directory) -> Vec<(PoolEventKind, String, &'static str)> {
        let events = d.drain_pool_events(usize::MAX);
        events.into_iter().map(|e| (e.kind, e.key.to_string(), e.medium.name())).collect()
    }

    use PoolEventKind::{Removed, Stored};

    #[test]
    fn puts_and_removals_are_one_event_each() {
        let mut d = dir(16 * MIB, 100);
        put(&mut d, "12345", 1);
        put(&mut d, "0x2a", 1);
        let mut fx = Vec::new();
        d.remove("12345", false, 2, &mut fx).unwrap();
        assert_eq!(
            drain(&mut d),
            [
                (Stored, "12345".into(), "cpu"),
                (Stored, "0x2a".into(), "cpu"),
                (Removed, "12345".into(), "cpu")
            ]
        );
        put(&mut d, "a/1", 3);
        put(&mut d, "a/2", 3);
        put(&mut d, "b/1", 3);
        drain(&mut d);
        assert_eq!(d.remove_regex("^a/", false, 4, &mut fx).unwrap().removed, 2);
        assert_eq!(drain(&mut d), [(Removed, "a/1".into(), "cpu"), (Removed, "a/2".into(), "cpu")]);
        d.remove_all(false, 4, &mut fx);
        assert_eq!(
            drain(&mut d),
            [(Removed, "0x2a".into(), "cpu"), (Removed, "b/1".into(), "cpu")]
        );
        // A revoked put was never visible: nothing to say.
        d.put_start(&PutStart::new("k", MIB), 5, &mut fx).unwrap();
        d.put_revoke("k", &mut fx).unwrap();
        assert_eq!(drain(&mut d), []);
    }

    #[test]
    fn the_journal_is_bounded_and_drops_the_oldest() {
        let mut d = dir(16 * MIB, 3);
        for i in 0..5 {
            put(&mut d, &i.to_string(), 1);
        }
        let s = d.pool_event_stats();
        assert_eq!((s.recorded, s.dropped, s.queued), (5, 2, 3));
        let keys: Vec<String> = drain(&mut d).into_iter().map(|e| e.1).collect();
        assert_eq!(keys, ["2", "3", "4"]);
        assert_eq!(d.pool_event_stats().queued, 0);
        // Drained in pieces, in order.
        put(&mut d, "5", 1);
        put(&mut d, "6", 1);
        assert_eq!(&*d.drain_pool_events(1)[0].key, "5");
        assert_eq!(&*d.drain_pool_events(1)[0].key, "6");
    }

    #[test]
    fn eviction_removes_and_a_new_put_stores() {
        // Room for 4 objects: the fifth put evicts the least recently used.
        let mut d = dir(4 * MIB, 100);
        for i in 0..4 {
            put(&mut d, &format!("{i}"), 1 + i);
        }
        drain(&mut d);
        put(&mut d, "4", 10);
        let events = drain(&mut d);
        assert!(events.contains(&(Removed, "0".into(), "cpu")), "{events:?}");
        assert_eq!(events.last(), Some(&(Stored, "4".into(), "cpu")));
        assert_eq!(events.iter().filter(|e| e.0 == Removed).count(), 1, "{events:?}");
    }

    #[test]
    fn tier_changes_move_the_medium() {
        let mut d = dir(16 * MIB, 100);
        put(&mut d, "7", 1);
        let dram = d.stat("7").unwrap().replicas[0].location;
        let nvme = Location::Node(NodeLocation {
            node: NodeId(1),
            segment: 1,
            tier: Tier::Nvme,
            addr: 0,
            offset: 0,
        });
        d.add_replica("7", &nvme).unwrap();
        d.add_replica("7", &Location::ObjectStore).unwrap();
        assert_eq!(drain(&mut d), [(Stored, "7".into(), "cpu")]);
        // Demoted: the memory copy goes, the NVMe one stays.
        assert!(!d.remove_replica("7", &dram).unwrap());
        assert_eq!(drain(&mut d), [(Removed, "7".into(), "cpu"), (Stored, "7".into(), "disk")]);
        // Only the object store left: still on disk; then gone.
        assert!(!d.remove_replica("7", &nvme).unwrap());
        assert_eq!(drain(&mut d), []);
        assert!(d.remove_replica("7", &Location::ObjectStore).unwrap());
        assert_eq!(drain(&mut d), [(Removed, "7".into(), "disk")]);
    }

    #[test]
    fn upserts_and_renames_name_the_keys() {
        let mut d = dir(16 * MIB, 100);
        put(&mut d, "1", 1);
        let mut fx = Vec::new();
        let req = PutStart { upsert: true, ..PutStart::new("1", MIB) };
        d.put_start(&req, 2, &mut fx).unwrap();
        d.put_end(&PutEnd::new("1", None), 2, &mut fx).unwrap();
        d.rename("1", "2", RenameMode::Replace, 3, &mut fx).unwrap();
        assert_eq!(
            drain(&mut d),
            [
                (Stored, "1".into(), "cpu"),
                (Removed, "1".into(), "cpu"),
                (Stored, "1".into(), "cpu"),
                (Removed, "1".into(), "cpu"),
                (Stored, "2".into(), "cpu"),
            ]
        );
    }

    #[test]
    fn disabled_journals_nothing() {
        let mut d = Directory::new(Config::default()).unwrap();
        assert_eq!(d.drain_pool_events(10), []);
        assert_eq!(d.pool_event_stats(), PoolEventStats::default());
    }
}
