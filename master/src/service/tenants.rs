//! Tenants on the admin endpoint: their quotas (the reference's
//! `GET/PUT/DELETE /api/v1/tenant_quotas?tenant_id=NAME`) and their per-tenant metrics.
//!
//! `PUT` takes `{"requested_quota_bytes": N}` (the reference's memory quota) or
//! `{"memory_bytes": N, "nvme_bytes": N}` (either may be `null`: unlimited); `DELETE` lifts a
//! tenant's quotas; `GET` without `tenant_id` lists every tenant. With a cluster secret, `PUT`
//! and `DELETE` need `Authorization: Bearer <the secret>`.

use std::fmt::Write;

use serde_json::{Value, json};

use super::State;
use super::metrics::header;
use crate::{Quota, TenantUsage};

fn view(name: &str, u: &TenantUsage) -> Value {
    json!({
        "tenant_id": name,
        "quota_bytes": u.quota.memory_bytes,
        "requested_quota_bytes": u.quota.memory_bytes,
        "used_bytes": u.memory_bytes + u.pending_memory_bytes,
        "memory_bytes": u.memory_bytes,
        "pending_memory_bytes": u.pending_memory_bytes,
        "nvme_quota_bytes": u.quota.nvme_bytes,
        "nvme_bytes": u.nvme_bytes,
        "pending_nvme_bytes": u.pending_nvme_bytes,
        "quota_evicted_bytes": u.quota_evicted_bytes,
        "refused_puts": u.refused_puts,
    })
}

/// Answers one request to `/api/v1/tenant_quotas`: the status and a JSON body.
pub(super) fn handle(
    state: &State,
    method: &str,
    tenant: Option<String>,
    auth: Option<&str>,
    body: &[u8],
) -> (u16, Value) {
    let err = |code: u16, msg: String| (code, json!({ "error": msg }));
    if method != "GET"
        && let Some(secret) = &state.cfg.rpc.secret
    {
        let given = auth.and_then(|a| a.strip_prefix("Bearer "));
        let ok = given.and_then(|g| kvfs_rpc::ClusterSecret::from_bytes(g.as_bytes()).ok());
        if ok.as_ref() != Some(secret) {
            return err(401, "changing quotas needs Authorization: Bearer <cluster secret>".into());
        }
    }
    match (method, tenant) {
        ("GET", None) => {
            let all = state.lock().tenants();
            (200, json!({ "tenants": all.iter().map(|(n, u)| view(n, u)).collect::<Vec<_>>() }))
        }
        ("GET", Some(t)) => match state.lock().tenant(&t) {
            Some(u) => (200, view(&t, &u)),
            None => err(404, format!("tenant {t:?} has no quota and stores nothing")),
        },
        ("PUT", Some(t)) => {
            let v: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return err(400, format!("body is not JSON: {e}")),
            };
            let field = |name: &str| -> Result<Option<u64>, String> {
                match v.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(x) => x.as_u64().map(Some).ok_or(format!("{name} must be a byte count")),
                }
            };
            let memory = match (field("requested_quota_bytes"), field("memory_bytes")) {
                (Ok(a), Ok(b)) => a.or(b),
                (Err(e), _) | (_, Err(e)) => return err(400, e),
            };
            let nvme = match field("nvme_bytes") {
                Ok(n) => n,
                Err(e) => return err(400, e),
            };
            let quota = Quota { memory_bytes: memory, nvme_bytes: nvme };
            let mut dir = state.lock();
            match dir.set_quota(&t, quota) {
                Ok(()) => {
                    let u = dir.tenant(&t).unwrap_or_default();
                    tracing::info!(tenant = %t, ?quota, "tenant quota set");
                    (200, view(&t, &u))
                }
                Err(e) => err(400, e.to_string()),
            }
        }
        ("DELETE", Some(t)) => match state.lock().set_quota(&t, Quota::default()) {
            Ok(()) => (200, json!({ "tenant_id": t, "deleted": true })),
            Err(e) => err(400, e.to_string()),
        },
        (_, None) => err(400, "missing ?tenant_id=".into()),
        (m, _) => err(405, format!("{m} is not served here (GET, PUT, DELETE)")),
    }
}

/// A metric's name, type, help and value for one tenant (`None`: no sample).
type Series = (&'static str, &'static str, &'static str, fn(&TenantUsage) -> Option<u64>);

/// Per-tenant figures for `/metrics`.
pub(super) fn render(state: &State, o: &mut String) {
    let all = state.lock().tenants();
    if all.is_empty() {
        return;
    }
    let series: [Series; 7] = [
        (
            "kvfs_tenant_memory_bytes",
            "gauge",
            "Bytes of a tenant's complete replicas in HBM and DRAM.",
            |u| Some(u.memory_bytes),
        ),
        (
            "kvfs_tenant_pending_bytes",
            "gauge",
            "Bytes a tenant's pending puts reserve, in memory.",
            |u| Some(u.pending_memory_bytes),
        ),
        ("kvfs_tenant_nvme_bytes", "gauge", "Bytes of a tenant's replicas on NVMe.", |u| {
            Some(u.nvme_bytes)
        }),
        (
            "kvfs_tenant_memory_quota_bytes",
            "gauge",
            "A tenant's memory quota (absent: unlimited).",
            |u| u.quota.memory_bytes,
        ),
        (
            "kvfs_tenant_nvme_quota_bytes",
            "gauge",
            "A tenant's NVMe quota (absent: unlimited).",
            |u| u.quota.nvme_bytes,
        ),
        (
            "kvfs_tenant_quota_evicted_bytes_total",
            "counter",
            "Bytes of a tenant's replicas evicted to keep it within its quota.",
            |u| Some(u.quota_evicted_bytes),
        ),
        (
            "kvfs_tenant_refused_puts_total",
            "counter",
            "A tenant's puts refused as over its quota.",
            |u| Some(u.refused_puts),
        ),
    ];
    for (name, kind, help, get) in series {
        header(o, name, kind, help);
        for (t, u) in &all {
            if let Some(v) = get(u) {
                let _ = writeln!(o, "{name}{{tenant=\"{t}\"}} {v}");
            }
        }
    }
}
