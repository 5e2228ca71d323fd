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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_proto::store::{MasterRequest, MasterResponse, Role, STORE_PROTOCOL_VERSION};
use kvfs_rpc::{DirectConn, Handler, RpcConn, RpcError, RpcOptions};

use crate::{Error, ErrorKind, Result};

pub(crate) struct MasterLink {
    addr: String,
    role: Role,
    host: String,
    handler: Arc<dyn Handler>,
    timeout: Duration,
    opts: RpcOptions,
    conn: tokio::sync::Mutex<Option<RpcConn>>,
    /// The direct connection of a client's link (see the module notes).
    direct: Mutex<Direct>,
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
    Idle(DirectConn),
    InUse,
    /// Not a client's link: the master calls nodes on their connection, so they keep one.
    Off,
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
    back: Option<DirectConn>,
    retry_at: Option<Instant>,
}

impl Drop for DirectLease<'_> {
    fn drop(&mut self) {
        let next = match self.back.take() {
            Some(c) => Direct::Idle(c),
            None => Direct::Closed { retry_at: self.retry_at },
        };
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = next;
    }
}

impl MasterLink {
    pub fn new(
        addr: String,
        role: Role,
        host: String,
        handler: Arc<dyn Handler>,
        timeout: Duration,
    ) -> MasterLink {
        let opts = RpcOptions { connect_timeout: timeout, ..RpcOptions::default() };
        let direct = Mutex::new(if role == Role::Client {
            Direct::Closed { retry_at: None }
        } else {
            Direct::Off
        });
        let conn = tokio::sync::Mutex::new(None);
        MasterLink { addr, role, host, handler, timeout, opts, conn, direct }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The live connection, connecting (and saying hello) if there is none.
    pub async fn conn(&self) -> Result<RpcConn> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let conn = RpcConn::connect(&self.addr, self.handler.clone(), self.opts.clone())
            .await
            .map_err(|e| Error::from_rpc("connect to master", e))?;
        match conn.call::<_, MasterResponse>(&self.hello(), self.timeout).await {
            Ok(MasterResponse::Hello { .. }) => {}
            Ok(MasterResponse::Refused(e)) => {
                conn.close();
                return Err(Error::from_wire("connect to master", &e));
            }
            Ok(other) => {
                conn.close();
                return Err(Error::new(
                    ErrorKind::Version,
                    "connect to master",
                    format!("unexpected answer {other:?}"),
                ));
            }
            Err(e) => {
                conn.close();
                return Err(Error::from_rpc("connect to master", e));
            }
        }
        *slot = Some(conn.clone());
        Ok(conn)
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
                Direct::Idle(c) => Some(c),
                Direct::Closed { retry_at } if retry_at.is_none_or(|t| Instant::now() >= t) => None,
                other => {
                    *slot = other;
                    return DirectOutcome::Unavailable;
                }
            }
        };
        let mut lease = DirectLease { slot: &self.direct, back: None, retry_at: None };
        let mut conn = match idle {
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
                lease.back = Some(conn);
                DirectOutcome::Answered(Ok(resp))
            }
            Ok(Err(e)) => DirectOutcome::Answered(Err(e)),
            Err(_) => DirectOutcome::Answered(Err(RpcError::Timeout {
                peer: self.addr.clone(),
                timeout_ms: self.timeout.as_millis() as u64,
            })),
        }
    }

    async fn direct_connect(&self) -> Option<DirectConn> {
        let hello = async {
            let mut c = DirectConn::connect(&self.addr, self.opts.clone()).await.ok()?;
            match c.call::<_, MasterResponse>(&self.hello(), DIRECT_SPIN).await {
                Ok(MasterResponse::Hello { .. }) => Some(c),
                _ => None,
            }
        };
        tokio::time::timeout(self.timeout, hello).await.ok().flatten()
    }

    /// Calls the master; see the module notes for the retry policy.
    pub async fn call(&self, op: &'static str, req: &MasterRequest) -> Result<MasterResponse> {
        let idempotent =
            !matches!(req, MasterRequest::PutStart { .. } | MasterRequest::RegisterNode(_));
        if let DirectOutcome::Answered(r) = self.direct_call(req).await {
            match r {
                Ok(MasterResponse::Refused(e)) => return Err(Error::from_wire(op, &e)),
                Ok(resp) => return Ok(resp),
                // The direct connection broke: the shared one retries what may be retried.
                Err(RpcError::Closed(_) | RpcError::Decode(_)) if idempotent => {}
                Err(e) => return Err(Error::from_rpc(op, e)),
            }
        }
        let mut reconnected = false;
        loop {
            let conn = self.conn().await?;
            match conn.call::<_, MasterResponse>(req, self.timeout).await {
                Ok(MasterResponse::Refused(e)) => return Err(Error::from_wire(op, &e)),
                Ok(resp) => return Ok(resp),
                Err(RpcError::Closed(_)) if idempotent && !reconnected => reconnected = true,
                Err(e) => return Err(Error::from_rpc(op, e)),
            }
        }
    }

    pub async fn close(&self) {
        {
            let mut slot = self.direct.lock().unwrap_or_else(|e| e.into_inner());
            if let Direct::Idle(_) = &*slot {
                *slot = Direct::Closed { retry_at: None };
            }
        }
        if let Some(c) = self.conn.lock().await.take() {
            c.close();
        }
    }
}
