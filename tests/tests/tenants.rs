//! Tenants with quotas across real processes: a master started with `--tenant-quota`, nodes,
//! and one client per tenant putting concurrently. Each tenant's keys are its own namespace;
//! a tenant over its memory quota has its own cold objects evicted (never another tenant's),
//! a put that cannot fit is refused with `QuotaExceeded`, and the admin API and metrics show
//! and change the quotas.

use std::io::{Read, Write};
use std::net::TcpStream;

use kvfs_client::{Client, ClientConfig, ErrorKind, PutOptions};
use kvfs_tests::{Cluster, ClusterOpts, content, free_port};

const MIB: usize = 1 << 20;

/// One HTTP/1.1 request to the master's admin endpoint; the status and the body.
fn http(admin: &str, method: &str, target: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).unwrap();
    let req = format!(
        "{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, out.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default())
}

fn usage(admin: &str, tenant: &str) -> serde_json::Value {
    let (code, body) = http(admin, "GET", &format!("/api/v1/tenant_quotas?tenant_id={tenant}"), "");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn tenant_client(cluster: &Cluster, tenant: Option<&str>) -> Client {
    let cfg = ClientConfig { tenant: tenant.map(String::from), ..cluster.client_config() };
    Client::connect(cfg).await.unwrap()
}

/// `n` objects of 1 MiB, in order, four at a time: every put must succeed.
async fn fill(c: Client, seed: u64, n: usize) {
    for round in 0..n / 4 {
        let puts = (0..4).map(|j| {
            let i = round * 4 + j;
            let c = c.clone();
            async move {
                let key = format!("obj-{i:03}");
                c.put(&key, &content(seed + i as u64, MIB), &PutOptions::default()).await
            }
        });
        for r in futures_util::future::join_all(puts).await {
            r.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_under_concurrent_puts_of_several_tenants() {
    let admin = format!("127.0.0.1:{}", free_port());
    let mut o = ClusterOpts { nodes: 2, ..ClusterOpts::default() };
    o.admin = admin.clone();
    o.master_args.extend(
        ["--tenant-quota", "acme=8MiB", "--tenant-quota", "beta=16MiB", "--lease-ttl-ms", "10000"]
            .map(String::from),
    );
    let cluster = Cluster::start(o).await;
    let acme = tenant_client(&cluster, Some("acme")).await;
    let beta = tenant_client(&cluster, Some("beta")).await;
    let gamma = tenant_client(&cluster, Some("gamma")).await;
    let root = tenant_client(&cluster, None).await;

    // 40 MiB each, at the same time: acme and beta keep to their quotas by evicting their
    // own oldest objects; gamma has no quota and keeps everything.
    tokio::join!(
        fill(acme.clone(), 1000, 40),
        fill(beta.clone(), 2000, 40),
        fill(gamma.clone(), 3000, 40)
    );
    for (tenant, quota) in [("acme", 8 * MIB), ("beta", 16 * MIB)] {
        let u = usage(&admin, tenant);
        let used = u["memory_bytes"].as_u64().unwrap() as usize;
        assert!(used <= quota, "{tenant} holds {used} bytes, quota {quota}: {u}");
        assert!(used >= quota - 4 * MIB, "{tenant} keeps close to its quota: {u}");
        assert!(u["quota_evicted_bytes"].as_u64().unwrap() as usize >= 40 * MIB - quota, "{u}");
        assert_eq!(u["pending_memory_bytes"], 0, "{u}");
    }
    let g = usage(&admin, "gamma");
    assert_eq!(g["memory_bytes"].as_u64().unwrap() as usize, 40 * MIB, "{g}");
    assert_eq!(g["quota_evicted_bytes"], 0, "{g}");

    // Namespaces: the same key is three objects; the newest ones are there, byte for byte.
    assert!(acme.get("obj-039").await.unwrap() == content(1039, MIB));
    assert!(beta.get("obj-039").await.unwrap() == content(2039, MIB));
    assert!(gamma.get("obj-000").await.unwrap() == content(3000, MIB), "nothing of gamma's went");
    assert_eq!(acme.get("obj-000").await.unwrap_err().kind(), ErrorKind::NotFound);
    let mine = acme.list("", None, 1000).await.unwrap();
    assert!(!mine.entries.is_empty() && mine.entries.iter().all(|e| e.key.starts_with("obj-")));
    let all = root.list("tenants/", None, 1000).await.unwrap();
    let gammas = all.entries.iter().filter(|e| e.key.starts_with("tenants/gamma/obj-")).count();
    assert_eq!(gammas, 40, "an administrator sees every tenant under tenants/");
    assert!(root.get("tenants/acme/obj-039").await.unwrap() == content(1039, MIB));

    // Larger than the quota: refused, saying why.
    let e = acme.put("huge", &content(7, 9 * MIB), &PutOptions::default()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QuotaExceeded, "{e}");
    assert!(e.to_string().contains("quota"), "{e}");
    // Every object of acme's read (so leased): nothing of its own may go, the put is refused.
    let keys: Vec<String> =
        acme.list("", None, 1000).await.unwrap().entries.into_iter().map(|e| e.key).collect();
    for k in &keys {
        acme.get(k).await.unwrap();
    }
    let free = 8 * MIB - usage(&admin, "acme")["memory_bytes"].as_u64().unwrap() as usize;
    let e =
        acme.put("one-more", &content(8, free + MIB), &PutOptions::default()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QuotaExceeded, "{e}");
    assert!(usage(&admin, "acme")["refused_puts"].as_u64().unwrap() >= 2);

    // The admin API raises the quota; the put then fits.
    let (code, body) = http(
        &admin,
        "PUT",
        "/api/v1/tenant_quotas?tenant_id=acme",
        r#"{"requested_quota_bytes": 33554432}"#,
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(usage(&admin, "acme")["quota_bytes"], 32 * MIB as u64);
    acme.put("one-more", &content(8, free + MIB), &PutOptions::default()).await.unwrap();
    let (code, _) = http(&admin, "PUT", "/api/v1/tenant_quotas?tenant_id=no%20such", "{}");
    assert_eq!(code, 400, "a bad tenant name is refused");
    let (code, _) = http(&admin, "PUT", "/api/v1/tenant_quotas?tenant_id=acme", "not json");
    assert_eq!(code, 400);
    let (code, body) = http(&admin, "GET", "/metrics", "");
    assert_eq!(code, 200);
    assert!(body.contains("kvfs_tenant_memory_bytes{tenant=\"beta\"}"), "per-tenant metrics");
    assert!(body.contains("kvfs_tenant_refused_puts_total{tenant=\"acme\"}"));
    let (code, _) = http(&admin, "DELETE", "/api/v1/tenant_quotas?tenant_id=beta", "");
    assert_eq!(code, 200);
    assert_eq!(usage(&admin, "beta")["quota_bytes"], serde_json::Value::Null);

    // A bad tenant name is refused when the client is set up.
    let bad = ClientConfig { tenant: Some("a/b".into()), ..cluster.client_config() };
    let e = Client::connect(bad).await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}
