//! A master that is one of several candidates for its cluster's leadership (etcd).
//!
//! Mechanism. [`run`] binds the RPC address once and loops: as a *standby* it answers every
//! call on that address with `NotLeader` naming the leader (so a client given a standby's
//! address learns where to go), subscribes to the leader's grant mirror (see `mirror`), tries
//! to lead, and otherwise waits for the leader key to go (probing the leader, see
//! `kvfs_ha::Candidate::wait_vacant`); once elected it records its term in etcd (the term key:
//! the last leader that served) and starts a [`MasterService`] on the same listener under the
//! leadership's guard; when the leadership is lost it drops the service (its node connections
//! close, its open client connections answer `NotLeader`) and becomes a standby again with an
//! empty directory.
//!
//! Takeover. The new leader starts empty and the nodes, which follow the leader key, register
//! with it and report every object they hold; its directory is rebuilt from those reports as
//! after a restart (version-ordered). Ranges a writer may still be writing into are what a
//! node cannot report: if this standby's mirror of the previous leader is complete (it holds
//! the snapshot of a session with the leader whose term the term key names, and etcd has no
//! drop marker for that session), the new leader reserves exactly those ranges until their
//! deadlines and puts do not wait; otherwise puts wait out `recovery_grace_ms` when nodes came
//! back with objects. Gets are served as soon as the holding node has registered.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_ha::{Campaign, Candidate, Etcd, EtcdTarget};
use kvfs_proto::store::{
    ErrorCode, MasterRequest, MasterResponse, MirrorRequest, MirrorResponse, WireError,
};
use kvfs_rpc::{RpcConn, RpcOptions, handler_fn};
use tokio::net::TcpListener;

use super::{MasterService, MirrorConfig, ServiceConfig, now_ms};
use crate::{GrantedRange, NodeId};

/// How a master takes part in its cluster's election.
#[derive(Debug, Clone)]
pub struct HaConfig {
    pub target: EtcdTarget,
    /// The RPC address written into the leader key: what clients and nodes connect to.
    pub advertise: String,
    /// The leader's lease in etcd: a leader that stops renewing it (dead, stopped, cut off)
    /// is replaced after this; a dead one (its address refuses connections) sooner.
    pub lease_ttl: Duration,
    /// Bound of each call to etcd.
    pub etcd_timeout: Duration,
    /// How often a standby probes the leader's address.
    pub probe: Duration,
    /// A standby that does not acknowledge a grant within this is dropped from the mirror
    /// (and would take over with the recovery grace).
    pub mirror_timeout: Duration,
}

impl HaConfig {
    pub fn new(target: EtcdTarget, advertise: String) -> HaConfig {
        HaConfig {
            target,
            advertise,
            lease_ttl: Duration::from_secs(2),
            etcd_timeout: Duration::from_secs(1),
            probe: Duration::from_millis(100),
            mirror_timeout: Duration::from_millis(500),
        }
    }
}

/// What [`run`] tells its caller as it goes (for the CLI's messages).
#[derive(Debug, Clone)]
pub enum HaEvent {
    Standby { leader: String, term: u64 },
    Leading { term: u64, rpc: std::net::SocketAddr, admin: Option<std::net::SocketAddr> },
    Lost { term: u64, why: String },
}

/// Runs a candidate master until `shutdown` resolves (then a leader resigns, so a standby
/// takes over at once). Fails only if the RPC address cannot be bound or the service cannot
/// start; etcd being unreachable is retried.
pub async fn run(
    cfg: ServiceConfig,
    ha: HaConfig,
    events: impl Fn(HaEvent) + Send,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let etcd = Etcd::new(ha.target.endpoints.clone(), ha.etcd_timeout)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let candidate =
        Candidate::new(etcd.clone(), &ha.target.cluster, &ha.advertise, ha.lease_ttl)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let mut listener = TcpListener::bind(cfg.listen).await?;
    let copy = Arc::new(Mutex::new(MirrorCopy::default()));
    tokio::pin!(shutdown);
    loop {
        let standby = Standby::start(listener, cfg.rpc.clone());
        let mut follower = Follower::new(copy.clone(), ha.advertise.clone(), cfg.rpc.clone());
        let campaign = async {
            let mut last_leader = None;
            loop {
                match candidate.try_lead().await {
                    Ok(Campaign::Won(l)) => return l,
                    Ok(Campaign::Lost(kv)) => {
                        let leader = String::from_utf8_lossy(&kv.value).into_owned();
                        standby.set_leader(&leader, kv.create_revision);
                        follower.follow(&leader, kv.create_revision);
                        if last_leader != Some(kv.create_revision) {
                            events(HaEvent::Standby { leader, term: kv.create_revision });
                            last_leader = Some(kv.create_revision);
                        }
                        if let Err(e) = candidate.wait_vacant(&kv, ha.probe).await {
                            tracing::warn!(error = %e, "standby: watching the leader failed");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "standby: cannot campaign; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        };
        let mut lead = tokio::select! {
            l = campaign => l,
            _ = &mut shutdown => return Ok(()),
        };
        follower.stop();
        let l = standby.stop().await;
        let term = lead.term();
        let cluster = &ha.target.cluster;
        let inherited = inherited(&etcd, cluster, &ha.advertise, &copy).await;
        if let Err(e) = record_term(&etcd, cluster, term).await {
            tracing::error!(term, error = %e, "cannot record this leader's term in etcd: resigning");
            lead.resign().await;
            listener = l;
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        }
        // Quotas the admin API set under earlier leaders win over the command line's.
        let mut tenant_quotas = cfg.tenant_quotas.clone();
        match super::tenants::stored(&etcd, cluster).await {
            Ok(q) => tenant_quotas.extend(q),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the stored tenant quotas: only --tenant-quota applies")
            }
        }
        let svc_cfg = ServiceConfig {
            leadership: Some(lead.guard()),
            tenant_quotas,
            mirror: Some(MirrorConfig {
                etcd: etcd.clone(),
                cluster: cluster.clone(),
                timeout: ha.mirror_timeout,
            }),
            inherited,
            ..cfg.clone()
        };
        let svc = match MasterService::start_on(svc_cfg, l).await {
            Ok(s) => s,
            Err(e) => {
                lead.resign().await;
                return Err(e);
            }
        };
        events(HaEvent::Leading { term, rpc: svc.rpc_addr(), admin: svc.admin_addr() });
        tokio::select! {
            why = lead.lost() => {
                tracing::error!(term, %why, "leadership lost: serving no more, standing by");
                events(HaEvent::Lost { term, why });
                drop(svc);
                drop(lead);
                listener = rebind(cfg.listen).await?;
            }
            _ = &mut shutdown => {
                drop(svc);
                lead.resign().await;
                return Ok(());
            }
        }
    }
}

/// Writes this leader's term as the last one that served, while it leads (a few tries).
async fn record_term(etcd: &Etcd, cluster: &str, term: u64) -> kvfs_ha::Result<()> {
    let (leader, key) = (kvfs_ha::leader_key(cluster), kvfs_ha::term_key(cluster));
    let mut tries = 0;
    loop {
        match etcd.put_if_guarded(&leader, term, &key, term.to_string().as_bytes()).await {
            Ok(true) => return Ok(()),
            Ok(false) => {
                return Err(kvfs_ha::Error::Invalid(format!("term {term} no longer leads")));
            }
            Err(e) if tries >= 3 => return Err(e),
            Err(_) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The previous leader's outstanding grants, if this standby's copy of them is complete (see
/// the module notes); `None` sends the new leader through the recovery grace.
async fn inherited(
    etcd: &Etcd,
    cluster: &str,
    standby: &str,
    copy: &Mutex<MirrorCopy>,
) -> Option<Vec<GrantedRange>> {
    let session = {
        let mut c = lock(copy);
        c.epoch += 1; // a late call of the old connection is refused from now on
        c.building = None;
        c.current.take()
    };
    let Some(s) = session else {
        tracing::info!(
            "takeover without a mirror of the previous leader: puts wait out the recovery grace"
        );
        return None;
    };
    let served = match etcd.get(&kvfs_ha::term_key(cluster)).await {
        Ok((_, kv)) => kv.and_then(|kv| String::from_utf8_lossy(&kv.value).parse::<u64>().ok()),
        Err(e) => {
            tracing::warn!(error = %e, "takeover: cannot read the last term: recovery grace");
            return None;
        }
    };
    if served != Some(s.term) {
        tracing::info!(mirrored = s.term, served = ?served, "takeover: the mirror is of another leader: recovery grace");
        return None;
    }
    match etcd.get(&kvfs_ha::mirror_dropped_key(cluster, standby)).await {
        Ok((_, Some(kv))) if String::from_utf8_lossy(&kv.value) == s.session.to_string() => {
            tracing::info!(
                session = s.session,
                "takeover: the previous leader dropped this mirror: recovery grace"
            );
            return None;
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %e, "takeover: cannot read the mirror's drop marker: recovery grace");
            return None;
        }
    }
    let now = now_ms();
    let grants: Vec<GrantedRange> =
        s.grants.into_values().flatten().filter(|g| g.deadline_ms > now).collect();
    tracing::info!(
        term = s.term,
        grants = grants.len(),
        "takeover with a complete mirror of the previous leader"
    );
    Some(grants)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A standby's copy of its leader's outstanding grants.
#[derive(Default)]
struct MirrorCopy {
    /// The connection whose calls are taken now (a new one per subscription).
    epoch: u64,
    /// The newest session whose snapshot arrived.
    current: Option<MirrorState>,
    /// A session of the connection `epoch` still waiting for its snapshot.
    building: Option<MirrorState>,
}

struct MirrorState {
    epoch: u64,
    term: u64,
    session: u64,
    /// By key, every version's ranges.
    grants: HashMap<String, Vec<GrantedRange>>,
    calls: u64,
}

impl MirrorCopy {
    fn apply(&mut self, epoch: u64, req: MirrorRequest) -> MirrorResponse {
        let MirrorRequest::Grants { term, session, snapshot, grants, released } = req;
        let state = if self.current.as_ref().is_some_and(|s| s.epoch == epoch) {
            self.current.as_mut()
        } else if self.epoch == epoch {
            Some(self.building.get_or_insert_with(|| MirrorState {
                epoch,
                term,
                session,
                grants: HashMap::new(),
                calls: 0,
            }))
        } else {
            None
        };
        let Some(st) = state.filter(|st| st.term == term && st.session == session) else {
            return MirrorResponse::Refused(WireError::new(
                ErrorCode::Conflict,
                "this standby no longer mirrors that session",
            ));
        };
        let now = now_ms();
        for g in grants {
            let r = GrantedRange {
                key: Arc::from(g.key.as_str()),
                version: g.version,
                node: NodeId(g.node),
                segment: g.segment,
                offset: g.offset,
                len: g.len,
                deadline_ms: now.saturating_add(g.ttl_ms),
            };
            st.grants.entry(g.key).or_default().push(r);
        }
        for (key, version) in released {
            if let Some(v) = st.grants.get_mut(&key) {
                v.retain(|g| g.version > version);
                if v.is_empty() {
                    st.grants.remove(&key);
                }
            }
        }
        st.calls += 1;
        if st.calls % 1024 == 0 {
            st.grants.retain(|_, v| {
                v.retain(|g| g.deadline_ms > now);
                !v.is_empty()
            });
        }
        if snapshot && self.building.as_ref().is_some_and(|b| b.epoch == epoch) {
            self.current = self.building.take();
        }
        MirrorResponse::Ack
    }
}

/// A standby's subscription to the leader's grant mirror: one connection at a time, made
/// again (a new session) if it closes while the same leader leads.
struct Follower {
    copy: Arc<Mutex<MirrorCopy>>,
    standby: String,
    opts: RpcOptions,
    leader: Option<(String, u64)>,
    task: Option<tokio::task::JoinHandle<()>>,
    conn: Arc<Mutex<Option<RpcConn>>>,
}

impl Follower {
    fn new(copy: Arc<Mutex<MirrorCopy>>, standby: String, opts: RpcOptions) -> Follower {
        Follower { copy, standby, opts, leader: None, task: None, conn: Arc::new(Mutex::new(None)) }
    }

    fn follow(&mut self, addr: &str, term: u64) {
        if self.leader.as_ref().is_some_and(|(a, t)| a == addr && *t == term) {
            return;
        }
        self.stop();
        self.leader = Some((addr.to_string(), term));
        let (copy, conn, opts) = (self.copy.clone(), self.conn.clone(), self.opts.clone());
        let (addr, standby) = (addr.to_string(), self.standby.clone());
        self.task = Some(tokio::spawn(subscribe(addr, standby, copy, conn, opts)));
    }

    fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        if let Some(c) = lock(&self.conn).take() {
            c.close();
        }
        self.leader = None;
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn subscribe(
    addr: String,
    standby: String,
    copy: Arc<Mutex<MirrorCopy>>,
    slot: Arc<Mutex<Option<RpcConn>>>,
    opts: RpcOptions,
) {
    loop {
        let epoch = {
            let mut c = lock(&copy);
            c.epoch += 1;
            c.building = None;
            c.epoch
        };
        let apply = copy.clone();
        let handler = handler_fn(move |_conn: RpcConn, req: MirrorRequest| {
            let r = lock(&apply).apply(epoch, req);
            async move { r }
        });
        if let Ok(conn) = RpcConn::connect(&addr, handler, opts.clone()).await {
            *lock(&slot) = Some(conn.clone());
            let req = MasterRequest::Mirror { standby: standby.clone() };
            match conn.call::<_, MasterResponse>(&req, Duration::from_secs(5)).await {
                Ok(MasterResponse::Mirror(Ok(s))) => {
                    tracing::info!(leader = %addr, term = s.term, session = s.session, "mirroring the leader's grants");
                    conn.closed().await;
                    tracing::info!(leader = %addr, "the grant mirror's connection closed");
                }
                Ok(other) => {
                    tracing::debug!(leader = %addr, answer = ?other, "the leader does not mirror its grants")
                }
                Err(e) => {
                    tracing::debug!(leader = %addr, error = %e, "cannot subscribe to the grant mirror")
                }
            }
            conn.close();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Binds the RPC address again once the dropped service has released it.
async fn rebind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 100 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A standby's answer on the RPC address: `NotLeader`, naming the leader when known.
struct Standby {
    listener: Arc<TcpListener>,
    leader: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Standby {
    fn start(listener: TcpListener, opts: kvfs_rpc::RpcOptions) -> Standby {
        let listener = Arc::new(listener);
        let leader = Arc::new(Mutex::new(String::from("no leader is elected yet")));
        let (l, who) = (listener.clone(), leader.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = l.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let who = who.clone();
                let handler = handler_fn(move |_conn: RpcConn, _req: MasterRequest| {
                    let who = who.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    async move {
                        MasterResponse::Refused(WireError::new(
                            ErrorCode::NotLeader,
                            format!("this master is a standby: {who}"),
                        ))
                    }
                });
                RpcConn::accepted(stream, handler, opts.clone());
            }
        });
        Standby { listener, leader, task }
    }

    fn set_leader(&self, addr: &str, term: u64) {
        *self.leader.lock().unwrap_or_else(|e| e.into_inner()) =
            format!("the leader is at {addr} (term {term})");
    }

    /// Stops answering and hands the listener back.
    async fn stop(self) -> TcpListener {
        self.task.abort();
        let _ = self.task.await;
        match Arc::try_unwrap(self.listener) {
            Ok(l) => l,
            Err(_) => unreachable!("the accept task held the only other reference"),
        }
    }
}
