//! The client's (and node's) link to the master: one RPC connection, made on first use and
//! re-made after it breaks, with the protocol version checked on every new connection.
//!
//! A client's link (the master never calls a client) also keeps a *direct* connection
//! ([`kvfs_rpc::DirectConn`]): a call that finds it free writes its request and reads the
//! answer itself, polling the socket for up to [`DIRECT_SPIN`] first, so a lone call's answer
//! wakes no other thread; a call that finds it in use takes the shared connection, where calls
//! pipeline. A direct connection that fails, times out or is cancelled mid-call is dropped
//! and made again on a later call (not before [`DIRECT_RETRY_AFTER`] when making it failed).
//!
//! Policy: a call that finds the connection closed reconnects once and retries when the
//! request is idempotent (reads, lists, stats, put_end, revoke, remove); a put_start that may
//! or may not have reached the master is not retried here (its orphaned pending put expires on
//! the master after `put_timeout_ms`) and fails with `Unavailable` for the caller to decide.
//!
//! HA: with an `etcd://` address the link follows the cluster's leader ([`LeaderWatch`]). A
//! connection is made to the current leader and used while that leader's term holds; when the
//! leader changes, the next call closes it and connects to the new one (a node's heartbeat
//! loop also wakes on the change, so the old leader loses its channel to the node at once). A
//! call refused with `NotLeader` did nothing on that master, so it is retried, whatever the
//! request, on the next leader within the call's timeout. A master whose term is older than
//! one the link has seen is refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_ha::{EtcdTarget, LeaderWatch};
use kvfs_proto::store::{
    ErrorCode, MasterRequest, MasterResponse, Role, STORE_PROTOCOL_VERSION, WireError,
};
use kvfs_rpc::{DirectConn, Handler, RpcConn, RpcError, RpcOptions};

use crate::{Error, ErrorKind, Result};

pub struct MasterLink {
    addr: String,
    role: Role,
    host: String,
    handler: Arc<dyn Handler>,
    timeout: Duration,
    opts: RpcOptions,
    /// The shared connection and the term of the master it reached.
    conn: tokio::sync::Mutex<Option<(RpcConn, u64)>>,
    /// The direct connection of a client's link (see the module notes).
    direct: Mutex<Direct>,
    /// Set for an `etcd://` address: where the leader is found.
    leader: Option<Leader>,
    /// The largest term a master answered with.
    term_seen: AtomicU64,
    /// The largest term the link tried to connect to.
    term_tried: AtomicU64,
}

struct Leader {
    target: EtcdTarget,
    watch: tokio::sync::OnceCell<LeaderWatch>,
}

/// How long a direct call polls for the master's answer before it parks: an answer from the
/// master's memory arrives within tens of microseconds on one host or rack, and parking then
/// being woken costs about as much again. A `PutEnd` answered after nodes' records (any object
/// not committed by the writer in its own process's node) parks at once.
pub(crate) const DIRECT_SPIN: Duration = Duration::from_micros(50);

/// After making the direct connection failed, calls take the shared one for this long.
pub(crate) const DIRECT_RETRY_AFTER: Duration = Duration::from_secs(1);

enum Direct {
    /// None yet, or dropped after a failure; made again from `retry_at`.
    Closed {
        retry_at: Option<Instant>,
    },
    /// With the term of the master it reached.
    Idle(DirectConn, u64),
    InUse,
    /// Not a client's link: the master calls nodes on their connection, so they keep one.
    Off,
}

/// Why a call to one master failed.
enum Refusal {
    /// That master does not lead: nothing was done there.
    NotLeader(WireError),
    /// No master was reached (no leader known, or its address did not answer): the request
    /// was not sent.
    Unreached(Error),
    Other(Error),
}

impl Refusal {
    fn wire(op: &'static str, e: WireError) -> Refusal {
        match e.code {
            ErrorCode::NotLeader => Refusal::NotLeader(e),
            _ => Refusal::Other(Error::from_wire(op, &e)),
        }
    }

    fn into_error(self, op: &'static str) -> Error {
        match self {
            Refusal::NotLeader(e) => Error::from_wire(op, &e),
            Refusal::Unreached(e) | Refusal::Other(e) => e,
        }
    }
}

/// What a direct call came to.
enum DirectOutcome {
    Answered(std::result::Result<MasterResponse, RpcError>),
    /// In use or not made: take the shared connection.
    Unavailable,
}

/// The direct slot while a call uses it; puts the connection back only if the call finished
/// cleanly (`back`), else marks it closed (a failed or dropped call may leave it mid-frame).
struct DirectLease<'a> {
    slot: &'a Mutex<Direct>,
    back: Option<(DirectConn, u64)>,
    retry_at: Option<Instant>,
}

impl Drop for DirectLease<'_> {
    fn drop(&mut self) {
        let next = match self.back.take() {
            Some((c, term)) => Direct::Idle(c, term),
            None => Direct::Closed { retry_at: self.retry_at },
        };
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = next;
    }
}

/// Checks a master address: `HOST:PORT`, or `etcd://...` well formed.
pub fn check_addr(addr: &str) -> Result<()> {
    match EtcdTarget::parse_master_addr(addr) {
        Some(Err(e)) => {
            Err(Error::new(ErrorKind::InvalidArgument, "master address", e.to_string()))
        }
        _ => Ok(()),
    }
}

impl MasterLink {
    pub fn new(
        addr: String,
        role: Role,
        host: String,
        handler: Arc<dyn Handler>,
        timeout: Duration,
        secret: Option<kvfs_rpc::ClusterSecret>,
    ) -> MasterLink {
        let opts = RpcOptions { connect_timeout: timeout, secret, ..RpcOptions::default() };
        let direct = Mutex::new(if role == Role::Client {
            Direct::Closed { retry_at: None }
        } else {
            Direct::Off
        });
        let conn = tokio::sync::Mutex::new(None);
        let leader = match EtcdTarget::parse_master_addr(&addr) {
            Some(Ok(target)) => Some(Leader { target, watch: tokio::sync::OnceCell::new() }),
            // Reported by `check_addr` before a link is made; a link to it finds no master.
            Some(Err(_)) | None => None,
        };
        MasterLink {
            addr,
            role,
            host,
            handler,
            timeout,
            opts,
            conn,
            direct,
            leader,
            term_seen: AtomicU64::new(0),
            term_tried: AtomicU64::new(0),
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The bound of each call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The address to connect to and the leader's term (0 for a fixed address).
    async fn resolve(&self) -> Result<(String, u64)> {
        let Some(l) = &self.leader else { return Ok((self.addr.clone(), 0)) };
        let watch = l
            .watch
            .get_or_try_init(|| async { LeaderWatch::start(&l.target, self.timeout) })
            .await
            .map_err(|e| {
                Error::new(ErrorKind::InvalidArgument, "find the master", e.to_string())
            })?;
        let min = self.term_seen.load(Ordering::Acquire);
        match watch.leader(min, self.timeout).await {
            Some(info) => Ok((info.addr, info.term)),
            None => Err(Error::new(
                ErrorKind::Unavailable,
                "find the master",
                format!(
                    "no leader of cluster {:?} in etcd ({}) within {:?}",
                    l.target.cluster,
                    l.target.endpoints.join(","),
                    self.timeout
                ),
            )),
        }
    }

    /// The term the link's connections were made to, when still the leader's (always true for
    /// a fixed address).
    fn current(&self, term: u64) -> bool {
        let Some(l) = &self.leader else { return true };
        l.watch.get().and_then(|w| w.current()).is_some_and(|c| c.term == term)
    }

    /// Resolves when the leader is no longer the one the link is connected to (never for a
    /// fixed address). A node's heartbeat loop waits on it to move at once.
    pub async fn leader_changed(&self) {
        // Read under the lock and let it go: the waits below must not hold it.
        let term = self.conn.lock().await.as_ref().map(|(_, t)| *t);
        let Some(term) = term else { return std::future::pending().await };
        match self.leader.as_ref().and_then(|l| l.watch.get()) {
            Some(w) => w.changed_from(term).await,
            None => std::future::pending().await,
        }
    }

    /// Checks a master's hello: its version and that its term is not older than one seen.
    fn check_hello(&self, resp: MasterResponse) -> std::result::Result<u64, Refusal> {
        match resp {
            MasterResponse::Hello { term, .. } => {
                let seen = self.term_seen.fetch_max(term, Ordering::AcqRel);
                if term < seen {
                    // A deposed leader: as good as a refusal, so the call goes to the next.
                    return Err(Refusal::NotLeader(WireError::new(
                        ErrorCode::NotLeader,
                        format!("the master at term {term} is older than term {seen}, seen before"),
                    )));
                }
                Ok(term)
            }
            MasterResponse::Refused(e) => Err(Refusal::wire("connect to master", e)),
            other => Err(Refusal::Other(Error::new(
                ErrorKind::Version,
                "connect to master",
                format!("unexpected answer {other:?}"),
            ))),
        }
    }

    /// The live connection, connecting (and saying hello) if there is none. Through etcd, a
    /// master that is not (or no longer, or not yet) serving as the leader, or a leader that
    /// cannot be reached, is waited past as a call does: within the link's timeout, for the
    /// next leader. (Without it a client that connected while a leader was being elected, or
    /// while a dead leader's key was still in etcd, failed at once: "this master is a standby:
    /// no leader is elected yet" from the winner's standby answerer, which answers until the
    /// winner starts serving.)
    pub async fn conn(&self) -> Result<RpcConn> {
        let started = Instant::now();
        loop {
            match self.conn_term().await {
                Ok((c, _)) => return Ok(c),
                Err(r) => self.again_after(r, started, "connect to master").await?,
            }
        }
    }

    async fn conn_term(&self) -> std::result::Result<(RpcConn, u64), Refusal> {
        let mut slot = self.conn.lock().await;
        if let Some((c, t)) = slot.as_ref() {
            if !c.is_closed() && self.current(*t) {
                return Ok((c.clone(), *t));
            }
            // The leader changed: the old master keeps no channel to this process.
            c.close();
        }
        *slot = None;
        let (addr, term) = self.resolve().await.map_err(Refusal::Unreached)?;
        self.term_tried.fetch_max(term, Ordering::AcqRel);
        let conn = RpcConn::connect(&addr, self.handler.clone(), self.opts.clone()).await.map_err(
            |e| match e {
                // Another try would be refused the same way: say so at once.
                RpcError::Refused { .. } => Refusal::Other(Error::from_rpc("connect to master", e)),
                e => Refusal::Unreached(Error::from_rpc("connect to master", e)),
            },
        )?;
        let term = match conn.call::<_, MasterResponse>(&self.hello(), self.timeout).await {
            Ok(resp) => match self.check_hello(resp) {
                Ok(t) => t,
                Err(e) => {
                    conn.close();
                    return Err(e);
                }
            },
            Err(e) => {
                conn.close();
                return Err(Refusal::Other(Error::from_rpc("connect to master", e)));
            }
        };
        *slot = Some((conn.clone(), term));
        Ok((conn, term))
    }

    fn hello(&self) -> MasterRequest {
        MasterRequest::Hello {
            version: STORE_PROTOCOL_VERSION,
            role: self.role,
            host: self.host.clone(),
        }
    }

    /// One call on the direct connection, making it (and saying hello) if there is none.
    async fn direct_call(&self, req: &MasterRequest) -> DirectOutcome {
        let idle = {
            let mut slot = self.direct.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *slot, Direct::InUse) {
                // Made to a master that no longer leads: dropped, made again below.
                Direct::Idle(c, term) if self.current(term) => Some((c, term)),
                Direct::Idle(..) => None,
                Direct::Closed { retry_at } if retry_at.is_none_or(|t| Instant::now() >= t) => None,
                other => {
                    *slot = other;
                    return DirectOutcome::Unavailable;
                }
            }
        };
        let mut lease = DirectLease { slot: &self.direct, back: None, retry_at: None };
        let (mut conn, term) = match idle {
            Some(c) => c,
            None => match self.direct_connect().await {
                Some(c) => c,
                None => {
                    lease.retry_at = Some(Instant::now() + DIRECT_RETRY_AFTER);
                    return DirectOutcome::Unavailable;
                }
            },
        };
        // A put's end waits for its nodes to record the object: its answer takes longer than
        // a spin, and on a small machine the spinning caller would take a CPU from the node
        // it waits for. Not when the writer committed every object on its nodes itself (its own
        // process's node, or noted writes): then the
        // master answers from memory.
        let spin = match req {
            MasterRequest::PutEnd(items) if items.iter().any(|i| i.committed_on.is_empty()) => {
                Duration::ZERO
            }
            _ => DIRECT_SPIN,
        };
        match tokio::time::timeout(self.timeout, conn.call(req, spin)).await {
            Ok(Ok(resp)) => {
                lease.back = Some((conn, term));
                DirectOutcome::Answered(Ok(resp))
            }
            Ok(Err(e)) => DirectOutcome::Answered(Err(e)),
            Err(_) => DirectOutcome::Answered(Err(RpcError::Timeout {
                peer: self.addr.clone(),
                timeout_ms: self.timeout.as_millis() as u64,
            })),
        }
    }

    async fn direct_connect(&self) -> Option<(DirectConn, u64)> {
        let hello = async {
            let (addr, term) = self.resolve().await.ok()?;
            self.term_tried.fetch_max(term, Ordering::AcqRel);
            let mut c = DirectConn::connect(&addr, self.opts.clone()).await.ok()?;
            let resp = c.call::<_, MasterResponse>(&self.hello(), DIRECT_SPIN).await.ok()?;
            let term = self.check_hello(resp).ok()?;
            Some((c, term))
        };
        tokio::time::timeout(self.timeout, hello).await.ok().flatten()
    }

    /// Drops both connections (the next call connects to whoever leads then).
    async fn forget(&self) {
        {
            let mut slot = self.direct.lock().unwrap_or_else(|e| e.into_inner());
            if let Direct::Idle(..) = &*slot {
                *slot = Direct::Closed { retry_at: None };
            }
        }
        if let Some((c, _)) = self.conn.lock().await.take() {
            c.close();
        }
    }

    /// After a `NotLeader` refusal or an unreachable leader: forgets the connections and waits
    /// (within the call's timeout, at most a quarter second at a time) for a leader newer than
    /// the one that failed. False for a fixed address, or when the call's time is up.
    async fn next_leader(&self, started: Instant) -> bool {
        let Some(l) = &self.leader else { return false };
        // The term of the master that failed: the connections' (whichever the call used) or
        // the one the link last tried to reach.
        let direct_term = match &*self.direct.lock().unwrap_or_else(|e| e.into_inner()) {
            Direct::Idle(_, t) => *t,
            _ => 0,
        };
        let shared_term = self.conn.lock().await.as_ref().map_or(0, |(_, t)| *t);
        let failed_term = direct_term.max(shared_term).max(self.term_tried.load(Ordering::Acquire));
        self.forget().await;
        let Some(w) = l.watch.get() else { return false };
        let left = self.timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return false;
        }
        // No newer leader within the wait: try again anyway (a leader that was briefly
        // unreachable, a standby's refusal while the key is about to change), paced by it.
        let _ = w.leader(failed_term + 1, left.min(Duration::from_millis(250))).await;
        true
    }

    /// Calls the master; see the module notes for the retry policy.
    pub async fn call(&self, op: &'static str, req: &MasterRequest) -> Result<MasterResponse> {
        self.call_within(op, req, self.timeout).await
    }

    /// [`call`](Self::call) with the master's answer awaited up to `timeout` (a registration
    /// carrying a million objects takes the master seconds to adopt).
    pub async fn call_within(
        &self,
        op: &'static str,
        req: &MasterRequest,
        timeout: Duration,
    ) -> Result<MasterResponse> {
        let started = Instant::now();
        // A job started twice would run twice.
        let idempotent = !matches!(
            req,
            MasterRequest::PutStart { .. }
                | MasterRequest::RegisterNode(_)
                | MasterRequest::JobStart(_)
        );
        loop {
            // A leader that is deposed while it holds the call (stopped, cut off) would keep
            // it until the timeout: a change of leader ends the wait. What it did is unknown,
            // so only a call that may be repeated goes to the new leader.
            let watch = self.leader.as_ref().and_then(|l| l.watch.get());
            let term = watch.and_then(|w| w.current()).map(|c| c.term);
            let r = match (watch, term) {
                (Some(w), Some(t)) => tokio::select! {
                    r = self.call_once(op, req, timeout) => r,
                    _ = w.changed_from(t) => {
                        let e = Error::new(
                            ErrorKind::Unavailable,
                            op,
                            format!("the master's leader changed (term {t}) during the call"),
                        );
                        Err(if idempotent { Refusal::Unreached(e) } else { Refusal::Other(e) })
                    }
                },
                _ => self.call_once(op, req, timeout).await,
            };
            match r {
                Ok(resp) => return Ok(resp),
                Err(r) => self.again_after(r, started, op).await?,
            }
        }
    }

    /// After a refusal of `op` begun at `started`: `Ok` to try again once a next leader may
    /// answer (`NotLeader` or an unreachable leader, within the link's timeout, through etcd);
    /// else the refusal as `op`'s error.
    async fn again_after(&self, r: Refusal, started: Instant, op: &'static str) -> Result<()> {
        match r {
            Refusal::NotLeader(_) | Refusal::Unreached(_) if self.next_leader(started).await => {
                tracing::debug!(op, "no leader answered; trying the leader again");
                Ok(())
            }
            r => Err(r.into_error(op)),
        }
    }

    async fn call_once(
        &self,
        op: &'static str,
        req: &MasterRequest,
        timeout: Duration,
    ) -> std::result::Result<MasterResponse, Refusal> {
        let refused = |e: WireError| Refusal::wire(op, e);
        let idempotent = !matches!(
            req,
            MasterRequest::PutStart { .. }
                | MasterRequest::RegisterNode(_)
                | MasterRequest::JobStart(_)
        );
        if let DirectOutcome::Answered(r) = self.direct_call(req).await {
            match r {
                Ok(MasterResponse::Refused(e)) => return Err(refused(e)),
                Ok(resp) => return Ok(resp),
                // The direct connection broke: the shared one retries what may be retried.
                Err(RpcError::Closed(_) | RpcError::Decode(_)) if idempotent => {}
                Err(e) => return Err(Refusal::Other(Error::from_rpc(op, e))),
            }
        }
        let mut reconnected = false;
        loop {
            let (conn, _) = self.conn_term().await?;
            match conn.call::<_, MasterResponse>(req, timeout).await {
                Ok(MasterResponse::Refused(e)) => return Err(refused(e)),
                Ok(resp) => return Ok(resp),
                Err(RpcError::Closed(_)) if idempotent && !reconnected => reconnected = true,
                Err(e) => return Err(Refusal::Other(Error::from_rpc(op, e))),
            }
        }
    }

    pub async fn close(&self) {
        self.forget().await;
    }
}
