//! The leader's side of the grant mirror: standbys that know every range it handed out.
//!
//! Why. A new leader rebuilds its directory from the nodes, but a node reports only the
//! objects it holds, not the ranges writers were granted and may still be writing into (a put
//! in flight, a load). Without knowing those, a new leader must not place anything for as long
//! as such a writer may live (`recovery_grace_ms`). A standby that mirrors the grants can take
//! over without that wait: it reserves exactly those ranges until their deadlines.
//!
//! Mechanism. A standby connects to the leader and sends `Mirror`; the leader adds it to its
//! subscribers under the directory lock and sends it, on that connection, every outstanding
//! grant at that moment (the snapshot). From then on a `PutStart` (or a load) that grants
//! ranges sends them to every subscriber and waits for each acknowledgement *before* the
//! writer is answered, so a range a writer knows of is known to every subscribed standby. Ends
//! of puts are sent as releases, in batches, from the timer (a lost release only keeps a range
//! reserved until its deadline). A subscriber that fails or is slower than `mirror_timeout_ms`
//! is dropped, and the leader records the dropped session in etcd (a transaction that holds
//! only while it still leads) before it answers the writer; if it cannot, the writer gets
//! `NotLeader` and its grants are revoked.
//!
//! The standby's rule (see `ha`): its copy is complete, and it may take over without the
//! grace, if it holds the snapshot of a session with the leader whose term is the last one that
//! served (etcd's term key) and etcd has no drop marker for that session.
//!
//! Cost: one loopback round trip per `PutStart` call while a standby is subscribed; nothing
//! without standbys.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvfs_proto::store::{
    ErrorCode, MasterResponse, MirrorGrant, MirrorRequest, MirrorResponse, MirrorSession, WireError,
};
use kvfs_rpc::RpcConn;

use super::{State, now_ms};
use crate::GrantedRange;

/// Releases queued before the timer sends them; beyond this they are dropped (the standby
/// then keeps those ranges until their deadlines: safe, only less free space after a takeover).
const RELEASES_QUEUED_MAX: usize = 1 << 20;

/// What a leader needs to mirror its grants: etcd, for the drop markers.
#[derive(Debug, Clone)]
pub struct MirrorConfig {
    pub etcd: kvfs_ha::Etcd,
    pub cluster: String,
    /// A subscriber that has not acknowledged a grant within this is dropped.
    pub timeout: Duration,
}

#[derive(Clone)]
struct Sub {
    standby: String,
    session: u64,
    conn: RpcConn,
}

#[derive(Default)]
pub(crate) struct Mirrors {
    subs: Mutex<Vec<Sub>>,
    released: Mutex<Vec<(String, u64)>>,
    next_session: AtomicU64,
    /// Grants sent to standbys (metric).
    pub(crate) sent: AtomicU64,
    /// Subscribers dropped (metric).
    pub(crate) dropped: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mirrors {
    pub(crate) fn subscribers(&self) -> usize {
        lock(&self.subs).len()
    }

    /// Ends every subscription (the service stops leading).
    pub(crate) fn close_all(&self) {
        for s in lock(&self.subs).drain(..) {
            s.conn.close();
        }
    }

    fn active(&self) -> Vec<Sub> {
        lock(&self.subs).clone()
    }
}

pub(crate) fn wire(g: &GrantedRange, now: u64) -> MirrorGrant {
    MirrorGrant {
        key: g.key.to_string(),
        version: g.version,
        node: g.node.0,
        segment: g.segment,
        offset: g.offset,
        len: g.len,
        ttl_ms: g.deadline_ms.saturating_sub(now),
    }
}

/// `Mirror` from a standby: subscribe it and send it the snapshot.
pub(crate) async fn subscribe(
    state: &std::sync::Arc<State>,
    conn: &RpcConn,
    standby: String,
) -> MasterResponse {
    let Some(cfg) = &state.cfg.mirror else {
        return MasterResponse::Mirror(Err(WireError::new(
            ErrorCode::InvalidArgument,
            "this master does not lead through etcd: there are no grants to mirror",
        )));
    };
    let m = &state.mirrors;
    let session = (now_ms() << 20)
        ^ u64::from(std::process::id())
        ^ m.next_session.fetch_add(1, Ordering::Relaxed);
    let term = state.term();
    let now = now_ms();
    let grants = {
        // Under the directory lock: a grant made before this is in the snapshot, one made
        // after it goes to this subscriber too.
        let dir = state.lock();
        let g = dir.outstanding_grants(now + state.cfg.load_timeout_ms);
        lock(&m.subs).push(Sub { standby: standby.clone(), session, conn: conn.clone() });
        g
    };
    let grants: Vec<MirrorGrant> = grants.iter().map(|g| wire(g, now)).collect();
    tracing::info!(%standby, session, grants = grants.len(), "standby subscribed to the grant mirror");
    let st = state.clone();
    let timeout = cfg.timeout.max(Duration::from_secs(5));
    let sub = Sub { standby, session, conn: conn.clone() };
    tokio::spawn(async move {
        let req =
            MirrorRequest::Grants { term, session, snapshot: true, grants, released: Vec::new() };
        if let Err(why) = send(&sub, &req, timeout).await {
            let _ = drop_sub(&st, &sub, &why).await;
        }
    });
    MasterResponse::Mirror(Ok(MirrorSession { term, session }))
}

async fn send(sub: &Sub, req: &MirrorRequest, timeout: Duration) -> Result<(), String> {
    match sub.conn.call::<_, MirrorResponse>(req, timeout).await {
        Ok(MirrorResponse::Ack) => Ok(()),
        Ok(MirrorResponse::Refused(e)) => Err(format!("refused: {:?}: {}", e.code, e.message)),
        Err(e) => Err(e.to_string()),
    }
}

/// Sends `grants` to every subscriber and waits for their acknowledgements; a subscriber that
/// fails is dropped (recorded in etcd). `Err` only when a drop could not be recorded: the
/// caller must not hand out these grants.
pub(crate) async fn replicate(state: &State, grants: &[MirrorGrant]) -> Result<(), WireError> {
    let Some(cfg) = &state.cfg.mirror else { return Ok(()) };
    if grants.is_empty() {
        return Ok(());
    }
    let subs = state.mirrors.active();
    if subs.is_empty() {
        return Ok(());
    }
    let term = state.term();
    state.mirrors.sent.fetch_add(grants.len() as u64, Ordering::Relaxed);
    // Releases queued so far ride along (the timer sends them otherwise).
    let released = std::mem::take(&mut *lock(&state.mirrors.released));
    let calls = subs.iter().map(|s| {
        let req = MirrorRequest::Grants {
            term,
            session: s.session,
            snapshot: false,
            grants: grants.to_vec(),
            released: released.clone(),
        };
        async move { send(s, &req, cfg.timeout).await }
    });
    let results = futures_util::future::join_all(calls).await;
    for (s, r) in subs.iter().zip(results) {
        if let Err(why) = r {
            drop_sub(state, s, &why).await?;
        }
    }
    Ok(())
}

/// Puts that ended (key, version): their grants are released on the standbys at the next
/// flush. One look at the subscribers per call, none without HA.
pub(crate) fn release<'a>(state: &State, ended: impl Iterator<Item = (&'a str, u64)>) {
    if state.cfg.mirror.is_none() || state.mirrors.subscribers() == 0 {
        return;
    }
    let mut r = lock(&state.mirrors.released);
    for (key, version) in ended.take(RELEASES_QUEUED_MAX.saturating_sub(r.len())) {
        r.push((key.to_string(), version));
    }
}

/// Sends the queued releases (from the timer).
pub(crate) async fn flush(state: &State) {
    let Some(cfg) = &state.cfg.mirror else { return };
    let released = std::mem::take(&mut *lock(&state.mirrors.released));
    if released.is_empty() {
        return;
    }
    let term = state.term();
    for s in state.mirrors.active() {
        let req = MirrorRequest::Grants {
            term,
            session: s.session,
            snapshot: false,
            grants: Vec::new(),
            released: released.clone(),
        };
        if let Err(why) = send(&s, &req, cfg.timeout.max(Duration::from_secs(1))).await {
            let _ = drop_sub(state, &s, &why).await;
        }
    }
}

/// Stops mirroring to `sub` and records it in etcd while this master still leads.
async fn drop_sub(state: &State, sub: &Sub, why: &str) -> Result<(), WireError> {
    let Some(cfg) = &state.cfg.mirror else { return Ok(()) };
    let was_there = {
        let mut subs = lock(&state.mirrors.subs);
        let before = subs.len();
        subs.retain(|s| s.session != sub.session);
        before != subs.len()
    };
    sub.conn.close();
    if was_there {
        state.mirrors.dropped.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(standby = %sub.standby, session = sub.session, %why, "standby dropped from the grant mirror");
    }
    let leader = kvfs_ha::leader_key(&cfg.cluster);
    let marker = kvfs_ha::mirror_dropped_key(&cfg.cluster, &sub.standby);
    let value = sub.session.to_string();
    match cfg.etcd.put_if_guarded(&leader, state.term(), &marker, value.as_bytes()).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(WireError::new(
            ErrorCode::NotLeader,
            format!("{} no longer leads its cluster (term {})", state.name, state.term()),
        )),
        Err(e) => Err(WireError::new(
            ErrorCode::Unavailable,
            format!("cannot record in etcd that standby {} stopped mirroring: {e}", sub.standby),
        )),
    }
}

/// The mirror's metrics, for a leader that mirrors (HA).
pub(crate) fn render(state: &State, o: &mut String) {
    use std::fmt::Write;
    if state.cfg.mirror.is_none() {
        return;
    }
    let m = &state.mirrors;
    let rows = [
        (
            "kvfs_master_mirror_standbys",
            "gauge",
            "Standbys mirroring this leader's grants.",
            m.subscribers() as u64,
        ),
        (
            "kvfs_master_mirror_grants_total",
            "counter",
            "Grants sent to standbys before their writers were answered.",
            m.sent.load(Ordering::Relaxed),
        ),
        (
            "kvfs_master_mirror_dropped_total",
            "counter",
            "Standbys dropped from the mirror (they would take over with the recovery grace).",
            m.dropped.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, v) in rows {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
    }
    let Some(inherited) = state.cfg.inherited.as_ref().map(|g| g.len()) else { return };
    let _ = writeln!(
        o,
        "# HELP kvfs_master_inherited_grants Ranges the previous leader had granted, reserved at this takeover (absent: not taken over from a complete mirror).\n# TYPE kvfs_master_inherited_grants gauge\nkvfs_master_inherited_grants {inherited}"
    );
}
