//! Tenants: key namespaces with byte quotas, enforced at put.
//!
//! Mechanism. A tenant is the namespace `tenants/NAME/` of the key space: a client set up
//! with a tenant names its keys inside it (the client adds and strips the prefix), and an
//! administrator without one sees every tenant's objects under `tenants/` (the mount shows
//! them as directories). The directory keeps, per tenant it has seen, the bytes of its
//! complete replicas in memory (HBM and DRAM) and on NVMe, and the bytes its pending puts
//! reserve, updated where replicas are attached and detached and pending puts come and go, so
//! usage is exact at every instant and is rebuilt from the nodes' registrations after a
//! restart (the tenant is in every key).
//!
//! Policy. A put into a tenant with a quota for the put's medium first checks that the
//! tenant's usage (complete and pending) plus the put's bytes (size times the copies it can
//! get) fits. If not, the tenant's own replicas on that medium are evicted, least recently
//! used first per segment (never leased or hard-pinned ones, soft-pinned only after plain
//! ones), within one eviction budget; if that does not make room the put is refused with
//! `QuotaExceeded`, saying how much is in use. Other tenants' objects are never evicted for
//! a tenant's quota (cluster-wide eviction for capacity still applies to everyone).
//!
//! A node's NVMe copy of a tenant's object (the tier manager's demotion) that would take the
//! tenant over its NVMe quota is refused, and the node keeps the object in memory (where the
//! memory quota and eviction govern it).
//!
//! Not handled: quotas on the object store tier; quotas persisted across a master restart
//! (they are configuration: `--tenant-quota`, or set again through the admin API).

use std::sync::Arc;

use super::evict::Budget;
use super::{Directory, LIST_PLAIN, LIST_SOFT, lru_links};
use crate::error::{Error, ErrorKind, Result};
use crate::slab::NIL;
use crate::types::{Eviction, NodeEffect, PutStart, Tier};

pub use kvfs_proto::store::{TENANT_PREFIX, valid_tenant};

/// The tenant a key belongs to: the `NAME` of `tenants/NAME/...` (non-empty).
pub fn tenant_of(key: &[u8]) -> Option<&[u8]> {
    let rest = key.strip_prefix(TENANT_PREFIX.as_bytes())?;
    let end = rest.iter().position(|&b| b == b'/')?;
    (end > 0).then(|| &rest[..end])
}

/// A tenant's byte quotas; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    pub memory_bytes: Option<u64>,
    pub nvme_bytes: Option<u64>,
}

/// What a tenant holds and has been refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub quota: Quota,
    /// Bytes of complete replicas in HBM and DRAM.
    pub memory_bytes: u64,
    pub nvme_bytes: u64,
    /// Bytes reserved by pending puts, in memory and on NVMe.
    pub pending_memory_bytes: u64,
    pub pending_nvme_bytes: u64,
    /// Bytes of the tenant's replicas evicted to keep it under its quota.
    pub quota_evicted_bytes: u64,
    /// Puts refused with `QuotaExceeded`.
    pub refused_puts: u64,
}

fn is_memory(tier: Tier) -> bool {
    matches!(tier, Tier::Hbm | Tier::Dram)
}

impl TenantUsage {
    fn used(&self, memory: bool) -> u64 {
        if memory {
            self.memory_bytes + self.pending_memory_bytes
        } else {
            self.nvme_bytes + self.pending_nvme_bytes
        }
    }

    fn quota_of(&self, memory: bool) -> Option<u64> {
        if memory { self.quota.memory_bytes } else { self.quota.nvme_bytes }
    }
}

impl Directory {
    /// Sets (or with `Quota::default()`, lifts) a tenant's quotas.
    pub fn set_quota(&mut self, tenant: &str, quota: Quota) -> Result<()> {
        if !valid_tenant(tenant) {
            return Err(Error::new(ErrorKind::InvalidArgument, "set_quota").with_detail(format!(
                "{tenant:?} is not a tenant name (1-64 of A-Z a-z 0-9 . _ -)"
            )));
        }
        self.tenant_mut(tenant.as_bytes()).quota = quota;
        Ok(())
    }

    /// Every tenant with a quota or anything stored, by name.
    pub fn tenants(&self) -> Vec<(String, TenantUsage)> {
        let mut v: Vec<_> = self.tenants.iter().map(|(k, u)| (k.to_string(), u.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    pub fn tenant(&self, tenant: &str) -> Option<TenantUsage> {
        self.tenants.get(tenant).cloned()
    }

    fn tenant_mut(&mut self, name: &[u8]) -> &mut TenantUsage {
        let name = std::str::from_utf8(name).expect("keys are str");
        if !self.tenants.contains_key(name) {
            self.tenants.insert(name.into(), TenantUsage::default());
        }
        self.tenants.get_mut(name).expect("inserted above")
    }

    /// Counts `bytes` of a complete replica of object `id` in `tier` in or out of its tenant.
    pub(super) fn tenant_replica(&mut self, id: u32, tier: Tier, bytes: u64, added: bool) {
        let key = self.keys.get(self.objects[id].key_at());
        let Some(name) = tenant_of(key) else { return };
        let name = name.to_vec();
        let u = self.tenant_mut(&name);
        let field = match tier {
            Tier::Hbm | Tier::Dram => &mut u.memory_bytes,
            Tier::Nvme => &mut u.nvme_bytes,
            Tier::ObjectStore => return,
        };
        if added {
            *field += bytes;
        } else {
            *field -= bytes;
        }
    }

    /// Counts the ranges of a pending put of `key` in `tier` in or out of its tenant.
    pub(super) fn tenant_pending(&mut self, key: &str, tier: Tier, bytes: u64, added: bool) {
        let Some(name) = tenant_of(key.as_bytes()) else { return };
        let u = self.tenant_mut(name);
        let field =
            if is_memory(tier) { &mut u.pending_memory_bytes } else { &mut u.pending_nvme_bytes };
        if added {
            *field += bytes;
        } else {
            *field -= bytes;
        }
    }

    /// Makes room for `req` inside its tenant's quota, evicting the tenant's own replicas if
    /// need be, or refuses it with `QuotaExceeded`. Keys outside tenants, and tenants without
    /// a quota for the put's medium, pass at once.
    pub(super) fn check_quota(
        &mut self,
        req: &PutStart,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
        evicted: &mut Vec<Arc<str>>,
    ) -> Result<()> {
        const OP: &str = "put_start";
        let Some(name) = tenant_of(req.key.as_bytes()) else { return Ok(()) };
        let memory = is_memory(req.tier);
        let Some(quota) = self
            .tenants
            .get(std::str::from_utf8(name).expect("str"))
            .and_then(|u| u.quota_of(memory))
        else {
            return Ok(());
        };
        let name = std::str::from_utf8(name).expect("keys are str").to_string();
        let copies = usize::from(req.replicas).min(self.usable_nodes(req, &[])).max(1) as u64;
        let need = req.size.saturating_mul(copies);
        let medium = if memory { "memory" } else { "NVMe" };
        let refuse = |d: &mut Directory, detail: String| {
            d.tenant_mut(name.as_bytes()).refused_puts += 1;
            Err(Error::new(ErrorKind::QuotaExceeded, OP).with_key(&req.key).with_detail(detail))
        };
        if need > quota {
            let detail = format!(
                "tenant {name}: {need} bytes ({copies} copies) exceed its {medium} quota of {quota} bytes"
            );
            return refuse(self, detail);
        }
        let used = self.tenants[name.as_str()].used(memory);
        if used + need > quota {
            self.shed_tenant(&name, memory, used + need - quota, now_ms, fx, evicted);
        }
        let used = self.tenants[name.as_str()].used(memory);
        if used + need > quota {
            let detail = format!(
                "tenant {name}: {used} bytes of its {medium} quota of {quota} are in use or being \
                 written, and its other objects are leased or pinned: no room for {need} more"
            );
            return refuse(self, detail);
        }
        Ok(())
    }

    /// Refuses a node's new NVMe copy of `key` (a demotion) that would take its tenant over
    /// its NVMe quota; the node then keeps the object where it is.
    pub(super) fn check_tenant_copy(&self, key: &str, tier: Tier, size: u64) -> Result<()> {
        if tier != Tier::Nvme {
            return Ok(());
        }
        let Some(name) = tenant_of(key.as_bytes()) else { return Ok(()) };
        let name = std::str::from_utf8(name).expect("keys are str");
        let Some(u) = self.tenants.get(name) else { return Ok(()) };
        let Some(quota) = u.quota.nvme_bytes else { return Ok(()) };
        let used = u.used(false);
        if used + size <= quota {
            return Ok(());
        }
        let detail = format!(
            "tenant {name}: {used} bytes of its NVMe quota of {quota} are in use: no room for a \
             copy of {size} bytes"
        );
        Err(Error::new(ErrorKind::QuotaExceeded, "report_replica")
            .with_key(key)
            .with_detail(detail))
    }

    /// Evicts the tenant's least recently used replicas on one medium until `bytes` are freed
    /// or one eviction budget is spent.
    fn shed_tenant(
        &mut self,
        name: &str,
        memory: bool,
        bytes: u64,
        now_ms: u64,
        fx: &mut Vec<NodeEffect>,
        evicted: &mut Vec<Arc<str>>,
    ) {
        let tiers: &[Tier] = if memory { &[Tier::Dram, Tier::Hbm] } else { &[Tier::Nvme] };
        let mut budget = Budget::new(&self.cfg);
        let mut out = Eviction::default();
        'tiers: for &tier in tiers {
            for seg in self.tier_segs[tier.index()].clone() {
                for list in [LIST_PLAIN, LIST_SOFT] {
                    let mut rep = self.segment(seg).lru[list].head;
                    while rep != NIL {
                        if out.bytes >= bytes || budget.exhausted() {
                            break 'tiers;
                        }
                        budget.scan();
                        let next = lru_links(&self.objects, &self.reps, rep).1;
                        let (id, _, _) = self.replica(rep);
                        let o = &self.objects[id];
                        let mine = tenant_of(self.keys.get(o.key_at())) == Some(name.as_bytes());
                        if mine && o.lease_end_ms <= now_ms {
                            budget.spend();
                            self.evict_replica(rep, fx, &mut out);
                        }
                        rep = next;
                    }
                }
            }
        }
        self.tenant_mut(name.as_bytes()).quota_evicted_bytes += out.bytes;
        evicted.extend(out.removed_keys);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_the_first_component_under_tenants() {
        assert_eq!(tenant_of(b"tenants/acme/k"), Some(&b"acme"[..]));
        assert_eq!(tenant_of(b"tenants/acme/a/b"), Some(&b"acme"[..]));
        assert_eq!(tenant_of(b"tenants/acme"), None);
        assert_eq!(tenant_of(b"tenants//k"), None);
        assert_eq!(tenant_of(b"other/acme/k"), None);
        assert!(valid_tenant("team-1.prod_a"));
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(65)] {
            assert!(!valid_tenant(bad), "{bad:?}");
        }
    }
}
