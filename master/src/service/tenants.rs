//! Tenants on the admin endpoint: their quotas (the reference's
//! `GET/PUT/DELETE /api/v1/tenant_quotas?tenant_id=NAME`) and their per-tenant metrics.
//!
//! `PUT` takes `{"requested_quota_bytes": N}` (the reference's memory quota) or
//! `{"memory_bytes": N, "nvme_bytes": N}` (either may be `null`: unlimited); `DELETE` lifts a
//! tenant's quotas; `GET` without `tenant_id` lists every tenant. With a cluster secret, `PUT`
//! and `DELETE` need `Authorization: Bearer <the secret>`. An HA leader records each change in
//! etcd (`record`) and a new leader applies what is recorded (`stored`), so quotas set here
//! survive a failover.

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

/// Answers one request to `/api/v1/tenant_quotas`: the status and a JSON body, and the
/// quota that changed (a lifted one is the default), for [`record`].
pub(super) fn handle(
    state: &State,
    method: &str,
    tenant: Option<String>,
    auth: Option<&str>,
    body: &[u8],
) -> (u16, Value, Option<(String, Quota)>) {
    let err = |code: u16, msg: String| (code, json!({ "error": msg }), None);
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
            let all: Vec<Value> = all.iter().map(|(n, u)| view(n, u)).collect();
            (200, json!({ "tenants": all }), None)
        }
        ("GET", Some(t)) => match state.lock().tenant(&t) {
            Some(u) => (200, view(&t, &u), None),
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
                    (200, view(&t, &u), Some((t, quota)))
                }
                Err(e) => err(400, e.to_string()),
            }
        }
        ("DELETE", Some(t)) => match state.lock().set_quota(&t, Quota::default()) {
            Ok(()) => (
                200,
                json!({ "tenant_id": t.clone(), "deleted": true }),
                Some((t, Quota::default())),
            ),
            Err(e) => err(400, e.to_string()),
        },
        (_, None) => err(400, "missing ?tenant_id=".into()),
        (m, _) => err(405, format!("{m} is not served here (GET, PUT, DELETE)")),
    }
}

/// Records a quota changed through the admin API in etcd (HA), while this master leads, so
/// the next leader applies it (`stored`); a lifted quota's key goes. Nothing without HA.
pub(super) async fn record(state: &State, tenant: &str, quota: Quota) -> Result<(), String> {
    let Some(m) = &state.cfg.mirror else { return Ok(()) };
    let leader = kvfs_ha::leader_key(&m.cluster);
    let key = format!("{}{tenant}", kvfs_ha::tenant_quotas_prefix(&m.cluster));
    let r = if quota == Quota::default() {
        m.etcd.delete_if_guarded(&leader, state.term(), &key).await
    } else {
        let v = json!({ "memory_bytes": quota.memory_bytes, "nvme_bytes": quota.nvme_bytes });
        m.etcd.put_if_guarded(&leader, state.term(), &key, v.to_string().as_bytes()).await
    };
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err("this master no longer leads its cluster".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The quotas the admin API set under earlier leaders (HA), to apply at a takeover.
pub(super) async fn stored(
    etcd: &kvfs_ha::Etcd,
    cluster: &str,
) -> kvfs_ha::Result<Vec<(String, Quota)>> {
    let prefix = kvfs_ha::tenant_quotas_prefix(cluster);
    let mut out = Vec::new();
    for kv in etcd.get_prefix(&prefix).await? {
        let Some(tenant) = kv.key.strip_prefix(&prefix) else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&kv.value) else {
            tracing::warn!(key = %kv.key, "a stored tenant quota is not JSON: ignored");
            continue;
        };
        let quota = Quota {
            memory_bytes: v["memory_bytes"].as_u64(),
            nvme_bytes: v["nvme_bytes"].as_u64(),
        };
        out.push((tenant.to_string(), quota));
    }
    Ok(out)
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
