//! `verify`: an O(everything) check of the directory's invariants, run after every step of the
//! simulation test and available to the RPC layer for a debug endpoint. Never on a hot path.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use super::{Directory, NIL, key_reader, list_of, lru_links};
use crate::types::{NodeId, Tier};

impl Directory {
    /// Check every invariant; the first violation found is returned as text.
    pub fn verify(&self) -> Result<(), String> {
        self.verify_indexes()?;
        let extents = self.verify_objects()?;
        self.verify_segments(extents)
    }

    fn verify_indexes(&self) -> Result<(), String> {
        let n = self.objects.len();
        if self.index.len() != n || self.order.len() != n {
            return Err(format!(
                "{n} objects, {} indexed, {} ordered",
                self.index.len(),
                self.order.len()
            ));
        }
        for id in self.order.iter() {
            if self.objects.get(id).is_none() {
                return Err(format!("ordered id {id} is no object"));
            }
            let key = String::from_utf8_lossy(self.key(id));
            if self.lookup(&key) != Some(id) {
                return Err(format!("ordered key {key:?} is not indexed as object {id}"));
            }
        }
        self.order.check(key_reader(&self.objects, &self.keys))
    }

    /// Per object: >= 1 replica, back-pointers, one replica per (node, tier), tier counters.
    /// Returns every allocated extent per segment: replicas, pending, retired and loading ranges.
    fn verify_objects(&self) -> Result<BTreeMap<NonZeroU32, Vec<(u64, u64)>>, String> {
        let mut extents: BTreeMap<NonZeroU32, Vec<(u64, u64)>> = BTreeMap::new();
        let (mut replicas, mut bytes) = ([0u64; 4], [0u64; 4]);
        let mut reps_seen = 0;
        // Per tenant: memory, NVMe, pending memory, pending NVMe bytes.
        let mut tenants: BTreeMap<Vec<u8>, [u64; 4]> = BTreeMap::new();
        for (id, o) in self.objects.iter() {
            let tenant = super::tenant_of(self.key(id)).map(<[u8]>::to_vec);
            let key = String::from_utf8_lossy(self.key(id));
            if self.is_orphan(id) {
                return Err(format!("object {key:?} has no replica"));
            }
            let mut placed: Vec<(NodeId, Tier)> = Vec::new();
            let mut chain: Vec<(NonZeroU32, u64)> = Vec::new();
            let mut at = o.more;
            while at != NIL {
                let r = self.reps.get(at).ok_or_else(|| format!("{key:?}: dangling replica"))?;
                if r.obj != id {
                    return Err(format!("{key:?}: replica points at object {}", r.obj));
                }
                if chain.len() >= self.reps.len() {
                    return Err(format!("{key:?}: replica chain loops"));
                }
                chain.push((r.seg, r.offset()));
                at = r.obj_next;
            }
            reps_seen += chain.len();
            chain.extend(o.rep_seg.map(|seg| (seg, o.rep_offset)));
            for (seg, offset) in chain {
                let s = self.segments.get(seg.get() as usize).and_then(Option::as_ref);
                let s = s.ok_or_else(|| format!("{key:?}: replica on a removed segment"))?;
                if placed.contains(&(s.node, s.tier)) {
                    return Err(format!(
                        "{key:?}: two replicas on node {} in {:?}",
                        s.node.0, s.tier
                    ));
                }
                placed.push((s.node, s.tier));
                replicas[s.tier.index()] += 1;
                bytes[s.tier.index()] += o.size;
                extents.entry(seg).or_default().push((offset, o.size));
                if let Some(t) = &tenant {
                    let i = if matches!(s.tier, Tier::Nvme) { 1 } else { 0 };
                    tenants.entry(t.clone()).or_default()[i] += o.size;
                }
            }
            if o.flags().persisted {
                replicas[Tier::ObjectStore.index()] += 1;
                bytes[Tier::ObjectStore.index()] += o.size;
            }
        }
        if reps_seen != self.reps.len() {
            return Err(format!("{} replica slots, {reps_seen} reachable", self.reps.len()));
        }
        if replicas != self.tier_replicas || bytes != self.tier_bytes {
            return Err(format!(
                "tier counters {:?}/{:?}, counted {replicas:?}/{bytes:?}",
                self.tier_replicas, self.tier_bytes
            ));
        }
        for (key, p) in &self.pending {
            for &(seg, offset) in &p.ranges {
                extents.entry(seg).or_default().push((offset, p.size));
            }
            if let Some(t) = super::tenant_of(key.as_bytes()) {
                let i = if matches!(p.tier, Tier::Nvme) { 3 } else { 2 };
                tenants.entry(t.to_vec()).or_default()[i] += p.size * p.ranges.len() as u64;
            }
        }
        for (name, u) in &self.tenants {
            let kept = [u.memory_bytes, u.nvme_bytes, u.pending_memory_bytes, u.pending_nvme_bytes];
            let counted = tenants.remove(name.as_bytes()).unwrap_or_default();
            if kept != counted {
                return Err(format!("tenant {name}: usage {kept:?}, counted {counted:?}"));
            }
        }
        if let Some((name, _)) = tenants.into_iter().next() {
            return Err(format!(
                "tenant {:?} holds bytes but is not counted",
                String::from_utf8_lossy(&name)
            ));
        }
        for r in &self.retired {
            extents.entry(r.seg).or_default().push((r.offset, r.len));
        }
        for l in self.loading.values() {
            extents.entry(l.seg).or_default().push((l.offset, l.size));
        }
        Ok(extents)
    }

    /// Per segment: lists hold exactly its replicas with the right pin, extents do not overlap,
    /// and the allocator's used bytes are exactly the extents.
    fn verify_segments(
        &self,
        mut extents: BTreeMap<NonZeroU32, Vec<(u64, u64)>>,
    ) -> Result<(), String> {
        for (i, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let seg = NonZeroU32::new(i as u32).ok_or("segment in slot 0")?;
            s.alloc.check().map_err(|e| format!("segment {seg}: {e}"))?;
            for (list, lru) in s.lru.iter().enumerate() {
                let (mut at, mut len) = (lru.head, 0);
                while at != NIL {
                    let (obj, rep_seg, _) = self.replica(at);
                    if rep_seg != seg || list_of(self.objects[obj].flags().pin) != list {
                        return Err(format!("segment {seg}: replica {at} on the wrong list"));
                    }
                    len += 1;
                    at = lru_links(&self.objects, &self.reps, at).1;
                }
                if len != lru.len {
                    return Err(format!(
                        "segment {seg} list {list}: len {} but {len} linked",
                        lru.len
                    ));
                }
            }
            let mut ext = extents.remove(&seg).unwrap_or_default();
            ext.sort_unstable();
            let align = s.alloc.align();
            let mut used = 0;
            let mut end = 0;
            for &(offset, len) in &ext {
                let start = offset & !(align - 1);
                if start < end {
                    return Err(format!(
                        "segment {seg}: range at {offset} overlaps the previous one"
                    ));
                }
                end = (offset + len).next_multiple_of(align);
                used += end - start;
            }
            if used != s.alloc.used_bytes() {
                return Err(format!(
                    "segment {seg}: allocator uses {} but ranges take {used}",
                    s.alloc.used_bytes()
                ));
            }
        }
        match extents.keys().next() {
            Some(seg) => Err(format!("ranges on unknown segment {seg}")),
            None => Ok(()),
        }
    }
}
