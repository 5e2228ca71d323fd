//! A master that is one of several candidates for its cluster's leadership (etcd).
//!
//! Mechanism. [`run`] binds the RPC address once and loops: as a *standby* it answers every
//! call on that address with `NotLeader` naming the leader (so a client given a standby's
//! address learns where to go), tries to lead, and otherwise waits for the leader key to go
//! (probing the leader, see `kvfs_ha::Candidate::wait_vacant`); once elected it starts a
//! [`MasterService`] on the same listener under the leadership's guard; when the leadership
//! is lost it drops the service (its node connections close, its open client connections
//! answer `NotLeader`) and becomes a standby again with an empty directory.
//!
//! Takeover. The new leader starts empty and the nodes, which follow the leader key, register
//! with it and report every object they hold; its directory is rebuilt from those reports as
//! after a restart (version-ordered), and puts wait out `recovery_grace_ms` when nodes came
//! back with objects, since a writer granted a range by the previous leader may still be
//! writing into it. Gets are served as soon as the holding node has registered.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfs_ha::{Campaign, Candidate, Etcd, EtcdTarget};
use kvfs_proto::store::{ErrorCode, MasterRequest, MasterResponse, WireError};
use kvfs_rpc::{RpcConn, handler_fn};
use tokio::net::TcpListener;

use super::{MasterService, ServiceConfig};

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
}

impl HaConfig {
    pub fn new(target: EtcdTarget, advertise: String) -> HaConfig {
        HaConfig {
            target,
            advertise,
            lease_ttl: Duration::from_secs(2),
            etcd_timeout: Duration::from_secs(1),
            probe: Duration::from_millis(200),
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
    let candidate = Candidate::new(etcd, &ha.target.cluster, &ha.advertise, ha.lease_ttl)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let mut listener = TcpListener::bind(cfg.listen).await?;
    tokio::pin!(shutdown);
    loop {
        let standby = Standby::start(listener, cfg.rpc.clone());
        let campaign = async {
            let mut last_leader = None;
            loop {
                match candidate.try_lead().await {
                    Ok(Campaign::Won(l)) => return l,
                    Ok(Campaign::Lost(kv)) => {
                        let leader = String::from_utf8_lossy(&kv.value).into_owned();
                        standby.set_leader(&leader, kv.create_revision);
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
        let l = standby.stop().await;
        let term = lead.term();
        let svc_cfg = ServiceConfig { leadership: Some(lead.guard()), ..cfg.clone() };
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
