//! Renames and POSIX-style unlink.
//!
//! Mechanism. A rename re-keys the object in place: the `Obj` record, its replicas and their
//! ranges stay where they are (no byte moves), the index and the ordered set swap the key, and
//! the object takes a new version, so every reader that checks versions (the mount's open,
//! recovery) sees a new object under the new name. Nodes learn it from `Rename` effects (one
//! per node holding copies), which the service awaits before answering, like commits.
//!
//! Crash safety without a log. The master keeps no state of its own, so a rename it died in
//! the middle of may leave some nodes (or the object store) with the object under the new name
//! and others under the old one. Every renamed copy therefore carries its previous name and
//! version (`renamed_from`), and the directory keeps the last `RENAMED_MAX` names it renamed
//! away (key -> version it had). When a copy arrives (node registration, object-store scan):
//! - a copy naming `(from, v)` as its previous name removes the object `from` if it still has
//!   version `v`, and remembers `from@v` as renamed away;
//! - a copy of `from` at a version that was renamed away is refused (`Superseded`).
//!
//! Either order of arrival ends with the object under exactly one name, the new one as soon as
//! any copy of it survived. A rename applied by no node before the crash leaves the old name.
//!
//! Unlink: the name goes at once even under a read lease (new lookups miss); a leased object's
//! ranges are kept, as an upsert's are, until the lease ends, so readers that already hold
//! replica locations read whole bytes (POSIX unlink of an open file).
//!
//! Not handled: a node that missed two consecutive renames of one object while the master
//! restarted in between (its copy is two names old, and only the newest previous name is
//! kept); objects whose load into DRAM is running are refused (`PutInProgress`, retryable).

use std::collections::VecDeque;
use std::sync::Arc;

use super::{Directory, NodeEffect};
use crate::error::{Error, ErrorKind, Result};
use crate::types::{NodeId, Pin, RenameMode, Renamed};

/// Names renamed away that the directory remembers (for recovery's duplicate check).
pub(super) const RENAMED_MAX: usize = 1 << 16;

/// The names renamed away: key -> the version it had, oldest first for eviction.
#[derive(Debug, Default)]
pub(super) struct RenamedAway {
    map: hashbrown::HashMap<Arc<str>, u64>,
    order: VecDeque<Arc<str>>,
}

impl RenamedAway {
    pub(super) fn insert(&mut self, key: Arc<str>, version: u64) {
        if self.map.insert(key.clone(), version).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > RENAMED_MAX {
            if let Some(k) = self.order.pop_front() {
                self.map.remove(&k);
            }
        }
    }

    /// Whether `key@version` was renamed away.
    pub(super) fn contains(&self, key: &str, version: u64) -> bool {
        self.map.get(key) == Some(&version)
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }
}

impl Directory {
    /// Give the complete object `from` the name `to` and a new version; `Rename` effects go to
    /// `fx` (one per node holding copies), and with `RenameMode::Replace` the `Drop` effects of
    /// the object that had the name `to` (deferred by `tick` while a read lease protects it).
    ///
    /// - `from` missing: `NotFound`; being put or loaded: `PutInProgress` (retryable);
    /// - `to` being put: `PutInProgress`; existing with `NoReplace`: `AlreadyExists`; an
    ///   existing object is replaced even when pinned (the caller names it, as an upsert does);
    /// - `from == to`: nothing changes (POSIX), the current version is returned.
    ///
    /// Leases, pins, persistence and the checksum stay with the object; the object store copy
    /// (`Renamed::persisted`) is the service's to move.
    pub fn rename(
        &mut self,
        from: &str,
        to: &str,
        mode: RenameMode,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Result<Renamed> {
        const OP: &str = "rename";
        self.check_key(to, OP)?;
        let busy = |key: &str, why: &str| {
            Err(Error::new(ErrorKind::PutInProgress, OP).with_key(key).with_detail(why))
        };
        if self.pending.get(from).is_some_and(|p| p.deadline_ms > now_ms) {
            return busy(from, "the object is still being put");
        }
        let id = self.find(from, OP)?;
        if from == to {
            let o = &self.objects[id];
            return Ok(Renamed {
                from_version: o.version,
                version: o.version,
                persisted: o.flags().persisted,
            });
        }
        if self.loading.contains_key(from) {
            return busy(from, "a load of the object into memory is running");
        }
        if self.pending.get(to).is_some_and(|p| p.deadline_ms > now_ms) {
            return busy(to, "another put of the new name is running");
        }
        if let Some(old) = self.lookup(to) {
            if mode == RenameMode::NoReplace {
                return Err(Error::new(ErrorKind::AlreadyExists, OP).with_key(to));
            }
            if self.loading.contains_key(to) {
                return busy(to, "a load of the object under the new name is running");
            }
            self.replace_old(old, now_ms, fx);
        }
        // A timed-out put of the new name would otherwise complete over the renamed object.
        if self.pending.contains_key(to) {
            self.revoke_pending(to, fx);
        }
        let from_key = self.key_arc(id);
        let from_version = self.objects[id].version;
        let version = self.next_version(now_ms);
        let to_key: Arc<str> = Arc::from(to);
        self.rekey(id, to);
        self.objects[id].version = version;
        self.renamed_away.insert(from_key.clone(), from_version);
        let mut nodes: Vec<NodeId> = Vec::new();
        for (_, seg, _) in self.replicas(id) {
            let node = self.segment(seg).node;
            if !nodes.contains(&node) {
                nodes.push(node);
            }
        }
        for node in nodes {
            fx.push(NodeEffect::Rename {
                node,
                from: from_key.clone(),
                to: to_key.clone(),
                from_version,
                version,
            });
        }
        Ok(Renamed { from_version, version, persisted: self.objects[id].flags().persisted })
    }

    /// Remove the complete object `key` as POSIX unlink does: the name goes now even under a
    /// read lease; a leased object's ranges are released when the lease ends (`tick`), so
    /// readers holding its locations read whole bytes. `Pinned` for a hard-pinned object.
    pub fn unlink(&mut self, key: &str, now_ms: u64, fx: &mut Vec<NodeEffect>) -> Result<()> {
        const OP: &str = "unlink";
        let id = self.find(key, OP)?;
        if self.objects[id].flags().pin == Pin::Hard {
            return Err(Error::new(ErrorKind::Pinned, OP).with_key(key));
        }
        if self.loading.contains_key(key) {
            let detail = "a load of the object into memory is running";
            return Err(Error::new(ErrorKind::PutInProgress, OP).with_key(key).with_detail(detail));
        }
        self.replace_old(id, now_ms, fx);
        Ok(())
    }

    pub fn unlink_batch<K: AsRef<str>>(
        &mut self,
        keys: &[K],
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
    ) -> Vec<Result<()>> {
        keys.iter().map(|k| self.unlink(k.as_ref(), now_ms, fx)).collect()
    }

    /// Names renamed away that the directory remembers.
    pub fn renamed_away_len(&self) -> usize {
        self.renamed_away.len()
    }

    /// A copy arrives naming `prev` as the name it had before a rename: the object still
    /// under that name and version is stale; it goes (its `Drop` effects to `fx`) and the
    /// name is remembered as renamed away.
    pub(super) fn settle_renamed_from(
        &mut self,
        prev: Option<&(String, u64)>,
        fx: &mut Vec<NodeEffect>,
    ) {
        let Some((key, version)) = prev else { return };
        if let Some(id) = self.lookup(key)
            && self.objects[id].version == *version
        {
            self.remove_object(id, Some(fx));
        }
        self.renamed_away.insert(Arc::from(key.as_str()), *version);
    }

    /// The object store copy `key@version` must go (a rename could not move it).
    pub fn forget_persisted_copy(&mut self, key: &str, version: u64) {
        self.note_unpersisted(Arc::from(key), version);
    }

    /// Whether a copy of `key@version` is stale: that name was renamed away at that version.
    pub(super) fn was_renamed_away(&self, key: &str, version: u64) -> bool {
        self.renamed_away.contains(key, version)
    }

    /// Swap an object's key in the arena, the index and the ordered set; its replicas stay.
    fn rekey(&mut self, id: u32, key: &str) {
        // The pool's events name keys: the old name goes, the new one comes, on one medium.
        let medium = self.medium_before(id).flatten();
        if medium.is_some() {
            let from = self.key_arc(id);
            self.record_transition(&from, medium, None);
            self.record_transition(&Arc::from(key), None, medium);
        }
        self.unindex_key(id);
        let at = self.keys.push(key.as_bytes());
        self.objects[id].set_key_at(at);
        self.index_key(id);
        self.settle_keys();
    }
}
