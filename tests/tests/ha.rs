//! High availability with real processes: a real etcd, two candidate masters (`kvfs master
//! --etcd`), nodes and a client that follow the leader through `etcd://` addresses. The
//! leader is SIGKILLed or SIGSTOPped; a standby takes over, every acknowledged object stays
//! readable byte for byte, and a deposed leader refuses to act.

use std::time::{Duration, Instant};

use kvfs_client::{Client, ClientConfig, ErrorKind, PutOptions};
use kvfs_ha::testing::{EtcdCluster, EtcdServer};
use kvfs_ha::{Etcd, leader_key};
use kvfs_proto::store::{
    MasterRequest, MasterResponse, Persistence, Pin, PutEndItem, PutStartItem, Role, Strategy,
};
use kvfs_rpc::{RpcConn, RpcOptions, no_handler};
use kvfs_tests::{Proc, content, free_port};

const CLUSTER: &str = "ha-test";

struct Ha {
    /// The etcd endpoints (`HOST:PORT,...`).
    endpoints: String,
    _etcd: Option<EtcdServer>,
    etcd_cluster: Option<EtcdCluster>,
    masters: Vec<(String, Option<Proc>)>,
    nodes: Vec<Proc>,
    /// Each master's admin HTTP address, by RPC address (only with `admin`).
    admins: Vec<(String, String)>,
    admin: bool,
    recovery_grace_ms: u64,
    /// Given to every master and node started (an object store, say).
    extra_args: Vec<String>,
}

impl Ha {
    fn master_addr(&self) -> String {
        format!("etcd://{}/{CLUSTER}", self.endpoints)
    }

    fn start_master(&mut self) {
        let addr = format!("127.0.0.1:{}", free_port());
        let admin = if self.admin { format!("127.0.0.1:{}", free_port()) } else { "off".into() };
        if self.admin {
            self.admins.push((addr.clone(), admin.clone()));
        }
        let p = Proc::start(
            &[
                "master".into(),
                "--listen".into(),
                addr.clone(),
                "--admin".into(),
                admin,
                "--etcd".into(),
                self.endpoints.clone(),
                "--cluster".into(),
                CLUSTER.into(),
                "--heartbeat-ms".into(),
                "200".into(),
                "--node-ttl-ms".into(),
                "3000".into(),
                "--recovery-grace-ms".into(),
                self.recovery_grace_ms.to_string(),
            ]
            .into_iter()
            .chain(self.extra_args.iter().cloned())
            .collect::<Vec<_>>(),
        );
        assert!(p.first_line.contains("candidate"), "{}", p.first_line);
        self.masters.push((addr, Some(p)));
    }

    fn start_node(&mut self) {
        let p = Proc::start(
            &[
                "node".into(),
                "--master".into(),
                self.master_addr(),
                "--dram".into(),
                "128MiB".into(),
                "--no-populate".into(),
            ]
            .into_iter()
            .chain(self.extra_args.iter().cloned())
            .collect::<Vec<_>>(),
        );
        self.nodes.push(p);
    }

    /// The leader's address and term as etcd has them.
    async fn leader(&self) -> Option<(String, u64)> {
        let urls = self.endpoints.split(',').map(|e| format!("http://{e}")).collect();
        let e = Etcd::new(urls, Duration::from_secs(2)).ok()?;
        let (_, kv) = e.get(&leader_key(CLUSTER)).await.ok()?;
        kv.map(|kv| (String::from_utf8_lossy(&kv.value).into_owned(), kv.create_revision))
    }

    async fn wait_leader(&self, newer_than: u64) -> (String, u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((a, t)) = self.leader().await
                && t > newer_than
            {
                return (a, t);
            }
            assert!(Instant::now() < deadline, "no leader newer than term {newer_than}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn master_proc(&mut self, addr: &str) -> &mut Option<Proc> {
        &mut self.masters.iter_mut().find(|(a, _)| a == addr).expect("a master at the address").1
    }

    async fn client(&self) -> Client {
        let cfg = ClientConfig { master: self.master_addr(), ..ClientConfig::default() };
        Client::connect(cfg).await.expect("client connects through etcd")
    }

    async fn wait_nodes(&self, c: &Client, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if c.stats().await.is_ok_and(|s| s.nodes == n) {
                return;
            }
            assert!(Instant::now() < deadline, "the leader never saw {n} nodes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn cluster(nodes: usize) -> Ha {
    let etcd = EtcdServer::start();
    let endpoints = etcd.endpoint();
    start(Ha::new(endpoints, Some(etcd), None), nodes).await
}

impl Ha {
    fn new(endpoints: String, etcd: Option<EtcdServer>, cluster: Option<EtcdCluster>) -> Ha {
        Ha {
            endpoints,
            _etcd: etcd,
            etcd_cluster: cluster,
            masters: vec![],
            nodes: vec![],
            admins: vec![],
            admin: false,
            recovery_grace_ms: 1500,
            extra_args: vec![],
        }
    }

    /// One HTTP call to the admin endpoint of the master at `addr`: status and body.
    fn admin(&self, addr: &str, method: &str, target: &str, body: &str) -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let admin = &self.admins.iter().find(|(a, _)| a == addr)?.1;
        let mut s = std::net::TcpStream::connect(admin).ok()?;
        let req = format!(
            "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.split_whitespace().nth(1)?.parse().ok()?;
        Some((code, out.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default()))
    }

    /// A metric's value on the master at `addr` (its admin endpoint).
    fn metric(&self, addr: &str, name: &str) -> Option<u64> {
        let (_, out) = self.admin(addr, "GET", "/metrics", "")?;
        out.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }
}

async fn start(mut ha: Ha, nodes: usize) -> Ha {
    ha.start_master();
    let (first, _) = ha.wait_leader(0).await;
    assert_eq!(first, ha.masters[0].0);
    ha.start_master();
    for _ in 0..nodes {
        ha.start_node();
    }
    ha
}

/// Puts with retries on the errors a failover may show (each call bounded by its deadline).
async fn put_retrying(c: &Client, key: &str, v: &[u8]) -> Duration {
    let started = Instant::now();
    loop {
        match c.put(key, v, &PutOptions::default()).await {
            Ok(()) => return started.elapsed(),
            Err(e) if e.kind().retryable() || e.kind() == ErrorKind::Recovering => {
                assert!(started.elapsed() < Duration::from_secs(30), "put {key}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("put {key}: {e}"),
        }
    }
}

async fn get_retrying(c: &Client, key: &str) -> Vec<u8> {
    let started = Instant::now();
    loop {
        match c.get(key).await {
            Ok(v) => return v,
            Err(e) if e.kind().retryable() || e.kind() == ErrorKind::NotFound => {
                assert!(started.elapsed() < Duration::from_secs(30), "get {key}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("get {key}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_and_every_acknowledged_object_survives() {
    let mut ha = cluster(2).await;
    let c = ha.client().await;
    ha.wait_nodes(&c, 2).await;
    let (old, old_term) = ha.leader().await.expect("a leader");
    let objects: Vec<(String, Vec<u8>)> = (0..200u64)
        .map(|i| (format!("ha/{i}"), content(i, [100, 4096, 70_000, 1 << 20][i as usize % 4])))
        .collect();
    for (k, v) in &objects {
        c.put(k, v, &PutOptions::default()).await.expect("put before the failover");
    }
    let killed = Instant::now();
    ha.master_proc(&old).take().expect("leader running").kill();
    let (new, new_term) = ha.wait_leader(old_term).await;
    let elected = killed.elapsed();
    assert_ne!(new, old);
    assert!(new_term > old_term);
    // Every acknowledged object, byte for byte, through the same client.
    for (k, v) in &objects {
        assert_eq!(&get_retrying(&c, k).await, v, "{k}");
    }
    put_retrying(&c, "ha/after", &content(999, 5000)).await;
    let first_put = killed.elapsed();
    assert_eq!(c.get("ha/after").await.expect("get"), content(999, 5000));
    eprintln!(
        "leader killed: new leader elected after {elected:?}, first put within {first_put:?}"
    );
    // Well inside the leader lease (2 s): the standby saw the dead address and revoked it.
    assert!(elected < Duration::from_secs(2), "election took {elected:?}");
    assert_eq!(c.stats().await.expect("stats").nodes, 2);
}

/// A client that connects while the leader is dead and its key still names it in etcd waits
/// for the next leader within its timeout, as its calls do, instead of failing on the dead
/// address (or on the winner's standby answerer, which answers until the winner serves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connecting_while_the_leader_is_dead_waits_for_the_next_one() {
    let mut ha = cluster(1).await;
    let (old, old_term) = ha.leader().await.expect("a leader");
    ha.master_proc(&old).take().expect("leader running").kill();
    let c = ha.client().await;
    put_retrying(&c, "dead/after", &content(7, 5000)).await;
    assert_eq!(get_retrying(&c, "dead/after").await, content(7, 5000));
    let (new, new_term) = ha.leader().await.expect("a leader");
    assert_ne!(new, old);
    assert!(new_term > old_term);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_leader_is_deposed_and_refuses_to_act_when_it_resumes() {
    let mut ha = cluster(1).await;
    let c = ha.client().await;
    ha.wait_nodes(&c, 1).await;
    let (old, old_term) = ha.leader().await.expect("a leader");
    for i in 0..20u64 {
        c.put(&format!("s/{i}"), &content(i, 10_000), &PutOptions::default()).await.expect("put");
    }
    let stopped = Instant::now();
    ha.master_proc(&old).as_ref().expect("leader running").stop();
    let (new, new_term) = ha.wait_leader(old_term).await;
    let elected = stopped.elapsed();
    assert_ne!(new, old);
    // A stopped process still holds its socket: only its lease's expiry deposes it.
    assert!(elected >= Duration::from_secs(1), "deposed after only {elected:?}");
    for i in 0..20u64 {
        assert_eq!(get_retrying(&c, &format!("s/{i}")).await, content(i, 10_000));
    }
    put_retrying(&c, "s/new", &content(77, 3000)).await;
    ha.master_proc(&old).as_ref().expect("old leader").signal(libc::SIGCONT);
    // The resumed master must not act: a client pointed at it directly is refused.
    let direct =
        ClientConfig { master: old.clone(), rpc_timeout_ms: 2000, ..ClientConfig::default() };
    match Client::connect(direct).await {
        Ok(d) => {
            let e = d
                .put("s/through-old", &content(5, 100), &PutOptions::default())
                .await
                .expect_err("deposed leader");
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        }
        Err(e) => {
            // Refused while it stands down (its service dropped, its address bound again as a
            // standby's: a connection still in the dropped listener's backlog is closed or
            // reset), then answered as a standby.
            let m = e.to_string();
            assert!(
                m.contains("no longer leads")
                    || m.contains("standby")
                    || m.contains("refused")
                    || m.contains("closed")
                    || m.contains("reset"),
                "{m}"
            );
        }
    }
    // The cluster carries on under the new leader, and the old one stood by.
    assert_eq!(get_retrying(&c, "s/new").await, content(77, 3000));
    assert!(c.exists("s/through-old").await.is_ok_and(|e| !e));
    assert_eq!(ha.leader().await.map(|l| l.1), Some(new_term));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_member_lost_leaves_the_cluster_serving_and_able_to_fail_over() {
    let etcd = EtcdCluster::start(3);
    let endpoints = etcd.endpoints();
    let mut ha = start(Ha::new(endpoints, None, Some(etcd)), 1).await;
    let c = ha.client().await;
    ha.wait_nodes(&c, 1).await;
    let (_, term) = ha.leader().await.expect("a leader");
    for i in 0..20u64 {
        c.put(&format!("m/{i}"), &content(i, 3000), &PutOptions::default()).await.expect("put");
    }
    // The first member is the one every client tries first.
    ha.etcd_cluster.as_mut().expect("etcd cluster").kill(0);
    // Serving goes on; the leader keeps its lease through the other two members (a raft
    // election among them, if the lost member led etcd, may cost one renewal).
    for i in 20..40u64 {
        put_retrying(&c, &format!("m/{i}"), &content(i, 3000)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for i in 20..40u64 {
        put_retrying(&c, &format!("m/{}", i + 100), &content(i, 3000)).await;
    }
    let (leader, now) = ha.leader().await.expect("a leader");
    assert_eq!(now, term, "the leader lost its lease with two of three etcd members up");
    // And a failover still works with two members.
    ha.master_proc(&leader).take().expect("leader").kill();
    let (_, new_term) = ha.wait_leader(term).await;
    assert!(new_term > term);
    for i in 0..40u64 {
        assert_eq!(get_retrying(&c, &format!("m/{i}")).await, content(i, 3000), "m/{i}");
    }
    put_retrying(&c, "m/after", &content(1, 10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvfs_up_ha_runs_its_etcd_and_leads_and_a_standby_joins() {
    let dir = tempfile::tempdir().unwrap();
    // The member's peer port is the client port + 1: find two free in a row.
    let etcd = loop {
        let p = free_port();
        if std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break p;
        }
    };
    let up = Proc::start(&[
        "up".into(),
        "--ha".into(),
        "--data".into(),
        dir.path().display().to_string(),
        "--etcd-listen".into(),
        format!("127.0.0.1:{etcd}"),
        "--listen".into(),
        format!("127.0.0.1:{}", free_port()),
        "--admin".into(),
        "off".into(),
        "--dram".into(),
        "64MiB".into(),
        "--no-populate".into(),
    ]);
    assert!(up.first_line.contains("kvfs is up: master etcd://"), "{}", up.first_line);
    let addr = format!("etcd://127.0.0.1:{etcd}/{}", kvfs_ha::DEFAULT_CLUSTER);
    let c =
        Client::connect(ClientConfig { master: addr, ..ClientConfig::default() }).await.unwrap();
    c.put("up-ha/1", &content(1, 100_000), &PutOptions::default()).await.unwrap();
    assert!(c.get("up-ha/1").await.unwrap() == content(1, 100_000));
    let standby = Proc::start(&[
        "master".into(),
        "--etcd".into(),
        format!("127.0.0.1:{etcd}"),
        "--listen".into(),
        format!("127.0.0.1:{}", free_port()),
        "--admin".into(),
        "off".into(),
    ]);
    assert!(standby.first_line.contains("candidate"), "{}", standby.first_line);
    // The etcd member goes with the process that started it.
    up.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", etcd)).is_ok() {
        assert!(Instant::now() < deadline, "etcd outlived kvfs up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    standby.kill();
}

/// A leader, a standby subscribed to its grant mirror, one node, admin endpoints, and a
/// recovery grace of a minute (so a takeover that waited it out would show): the cluster, a
/// client, the leader's address and term.
async fn mirrored() -> (Ha, Client, String, u64) {
    let etcd = EtcdServer::start();
    let mut ha = Ha::new(etcd.endpoint(), Some(etcd), None);
    ha.admin = true;
    ha.recovery_grace_ms = 60_000;
    let ha = start(ha, 1).await;
    let c = ha.client().await;
    ha.wait_nodes(&c, 1).await;
    let (old, old_term) = ha.leader().await.expect("a leader");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ha.metric(&old, "kvfs_master_mirror_standbys") != Some(1) {
        assert!(Instant::now() < deadline, "the standby never subscribed to the mirror");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (ha, c, old, old_term)
}

/// A standby that mirrors the leader's grants takes over without the recovery grace (set to a
/// minute here, so waiting it out would show), and the range a writer of the dead leader still
/// holds is not handed to anyone else: the new leader fills its node around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirroring_standby_takes_over_at_once_and_keeps_the_dead_leaders_grants() {
    let (mut ha, c, old, old_term) = mirrored().await;
    let objects: Vec<(String, Vec<u8>)> =
        (0..40u64).map(|i| (format!("mirror/{i}"), content(i, 100_000))).collect();
    for (k, v) in &objects {
        c.put(k, v, &PutOptions::default()).await.expect("put before the failover");
    }
    // A quota set through the leader's admin API outlives it.
    let q = r#"{"memory_bytes": 5000000, "nvme_bytes": null}"#;
    let (code, body) = ha.admin(&old, "PUT", "/api/v1/tenant_quotas?tenant_id=acme", q).unwrap();
    assert_eq!(code, 200, "{body}");
    // A writer takes an 8 MiB range from the leader and is still writing when it dies.
    let writer = RpcConn::connect(&old, no_handler(), RpcOptions::default()).await.unwrap();
    let call = |req: MasterRequest| {
        let w = writer.clone();
        async move { w.call::<_, MasterResponse>(&req, Duration::from_secs(5)).await }
    };
    let hello = MasterRequest::Hello {
        version: kvfs_proto::store::STORE_PROTOCOL_VERSION,
        role: Role::Client,
        host: "slow-writer".into(),
    };
    assert!(matches!(call(hello).await.unwrap(), MasterResponse::Hello { .. }));
    let start = MasterRequest::PutStart {
        client_host: "slow-writer".into(),
        items: vec![PutStartItem {
            key: "mirror/in-flight".into(),
            size: 8 << 20,
            replicas: 1,
            persistence: Persistence::None,
            pin: Pin::None,
            strategy: Strategy::default(),
            preferred_endpoints: Vec::new(),
            upsert: false,
            tier: kvfs_proto::store::Tier::Dram,
        }],
    };
    let MasterResponse::PutStart(mut grants) = call(start).await.unwrap() else { panic!("grant") };
    let grant = grants.pop().unwrap().expect("granted");
    let held = grant.replicas[0].clone();
    assert!(ha.metric(&old, "kvfs_master_mirror_grants_total").is_some_and(|n| n >= 1));

    ha.master_proc(&old).take().expect("leader running").kill();
    let (new, _) = ha.wait_leader(old_term).await;
    assert_ne!(new, old);
    ha.wait_nodes(&c, 1).await;
    // The writer's grant, and perhaps ends of puts whose release was not sent yet (their
    // ranges hold the objects the node reports, so they reserve nothing).
    assert!(ha.metric(&new, "kvfs_master_inherited_grants").is_some_and(|n| n >= 1));
    assert!(
        !c.stats().await.expect("stats").recovering,
        "no recovery grace after a mirrored takeover"
    );
    // Every acknowledged object, byte for byte.
    for (k, v) in &objects {
        assert_eq!(&get_retrying(&c, k).await, v, "{k}");
    }
    let (code, body) = ha.admin(&new, "GET", "/api/v1/tenant_quotas?tenant_id=acme", "").unwrap();
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["quota_bytes"], 5_000_000, "{body}");
    // Fill the node past its size (eviction makes room): puts succeed without waiting out the
    // grace, and none lands on the range the dead leader's writer holds.
    let mut placed = Vec::new();
    for i in 0..40u64 {
        let key = format!("mirror/after/{i}");
        match c.put(&key, &content(1000 + i, 4 << 20), &PutOptions::default()).await {
            Ok(()) => placed.push(key),
            Err(e) if e.kind() == ErrorKind::NoSpace => break,
            Err(e) => panic!("put {key} after the takeover: {e}"),
        }
    }
    assert!(placed.len() >= 10, "only {} puts fit", placed.len());
    let (lo, hi) = (held.addr, held.addr + held.len);
    for key in &placed {
        let Ok(info) = c.stat(key).await else { continue }; // evicted
        for r in info.replicas.iter().filter(|r| r.node == held.node && r.segment == held.segment) {
            assert!(
                r.addr + r.len <= lo || r.addr >= hi,
                "{key} at {:#x}+{} overlaps the writer's range {lo:#x}..{hi:#x}",
                r.addr,
                r.len
            );
        }
    }
    // The writer's late end is refused by the new leader; nothing of it appears.
    let end = MasterRequest::PutEnd(vec![PutEndItem {
        key: "mirror/in-flight".into(),
        checksum: None,
        version: Some(grant.version),
        committed_on: Vec::new(),
    }]);
    let late = c.exists("mirror/in-flight").await.expect("exists");
    assert!(!late);
    let direct = RpcConn::connect(&new, no_handler(), RpcOptions::default()).await.unwrap();
    let r: MasterResponse = direct.call(&end, Duration::from_secs(5)).await.unwrap();
    assert!(matches!(&r, MasterResponse::PutEnd(v) if v[0].is_err()), "{r:?}");
}

/// A standby the leader stopped waiting for (here: SIGSTOPped while a put needed its
/// acknowledgement) is marked in etcd before that put is answered; taking over later, it knows
/// its copy of the grants is incomplete and waits out the recovery grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_dropped_from_the_mirror_takes_over_with_the_grace() {
    let (mut ha, c, old, old_term) = mirrored().await;
    let standby = ha.masters.iter().find(|(a, _)| *a != old).expect("a standby").0.clone();
    ha.master_proc(&standby).as_ref().expect("standby").stop();
    // The put waits for the stopped standby's acknowledgement, drops it, and succeeds.
    c.put("dropped/a", &content(1, 1000), &PutOptions::default()).await.expect("put");
    assert_eq!(ha.metric(&old, "kvfs_master_mirror_dropped_total"), Some(1));
    assert_eq!(ha.metric(&old, "kvfs_master_mirror_standbys"), Some(0));
    ha.master_proc(&old).take().expect("leader running").kill();
    ha.master_proc(&standby).as_ref().expect("standby").signal(libc::SIGCONT);
    let (new, _) = ha.wait_leader(old_term).await;
    assert_eq!(new, standby);
    ha.wait_nodes(&c, 1).await;
    assert!(c.stats().await.expect("stats").recovering, "an incomplete mirror keeps the grace");
    assert_eq!(ha.metric(&new, "kvfs_master_inherited_grants"), None);
    let quick =
        ClientConfig { master: ha.master_addr(), retry_budget_ms: 500, ..ClientConfig::default() };
    let quick = Client::connect(quick).await.expect("client");
    let e =
        quick.put("dropped/b", &content(2, 1000), &PutOptions::default()).await.expect_err("grace");
    assert_eq!(e.kind(), ErrorKind::Recovering, "{e}");
    assert_eq!(get_retrying(&c, "dropped/a").await, content(1, 1000));
}

/// An offload job running on a leader that is SIGKILLed: the new leader reads the job's
/// checkpoint from the object store and runs it to the end; every object is in the bucket once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_running_on_a_killed_leader_is_resumed_by_the_new_one() {
    use kvfs_client::{JobKind, JobSpec, JobState};
    use kvfs_tiers::{Medium, ObjectStoreConfig, ObjectStoreMedium};
    let etcd = EtcdServer::start();
    let data = tempfile::tempdir().unwrap();
    let root = data.path().join("objects");
    let mut ha = Ha::new(etcd.endpoint(), Some(etcd), None);
    ha.extra_args = vec!["--object-store".into(), format!("fs:{}", root.display())];
    let mut ha = start(ha, 1).await;
    let c = ha.client().await;
    ha.wait_nodes(&c, 1).await;
    let n = 600u64;
    for i in 0..n {
        c.put(&format!("j/{i:04}"), &content(i, 16_000), &PutOptions::default()).await.unwrap();
    }
    let spec = JobSpec {
        kind: JobKind::Offload { evict: false },
        prefix: "j/".into(),
        concurrency: 4,
        rate_bytes_per_s: 2 << 20,
    };
    let id = c.job_start(spec).await.expect("job starts").id;
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.job(id).await.unwrap().objects_done < n / 4 {
        assert!(Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (old, old_term) = ha.leader().await.expect("a leader");
    ha.master_proc(&old).take().expect("leader running").kill();
    ha.wait_leader(old_term).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let s = loop {
        match c.job(id).await {
            Ok(s) if s.state != JobState::Running => break s,
            Ok(_) => {}
            Err(e) => assert!(e.kind().retryable() || e.kind() == ErrorKind::Recovering, "{e}"),
        }
        assert!(Instant::now() < deadline, "the job did not end on the new leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((s.state, s.resumed, s.failed, s.gone), (JobState::Done, 1, 0, 0), "{s:?}");
    assert_eq!((s.objects_done, s.moved + s.already), (n, n), "{s:?}");
    let store = ObjectStoreMedium::open(ObjectStoreConfig::Fs { root }).unwrap();
    let listed = store.list().await.unwrap();
    assert_eq!(listed.len() as u64, n);
    for (k, meta) in listed {
        let i: u64 = k.trim_start_matches("j/").parse().unwrap();
        let mut v = vec![0u8; meta.size_bytes as usize];
        store.get_into(&k, &mut v).await.unwrap();
        assert!(v == content(i, 16_000), "{k}");
    }
}
