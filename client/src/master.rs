//! The client's (and node's) link to the master: one RPC connection, made on first use and
//! re-made after it breaks, with the protocol version checked on every new connection.
//!
//! Policy: a call that finds the connection closed reconnects once and retries when the
//! request is idempotent (reads, lists, stats, put_end, revoke, remove); a put_start that may
//! or may not have reached the master is not retried here (its orphaned pending put expires on
//! the master after `put_timeout_ms`) and fails with `Unavailable` for the caller to decide.

use std::sync::Arc;
use std::time::Duration;

use kvfs_proto::store::{MasterRequest, MasterResponse, Role, STORE_PROTOCOL_VERSION};
use kvfs_rpc::{Handler, RpcConn, RpcError, RpcOptions};

use crate::{Error, ErrorKind, Result};

pub(crate) struct MasterLink {
    addr: String,
    role: Role,
    host: String,
    handler: Arc<dyn Handler>,
    timeout: Duration,
    opts: RpcOptions,
    conn: tokio::sync::Mutex<Option<RpcConn>>,
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
        MasterLink { addr, role, host, handler, timeout, opts, conn: tokio::sync::Mutex::new(None) }
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
        let hello = MasterRequest::Hello {
            version: STORE_PROTOCOL_VERSION,
            role: self.role,
            host: self.host.clone(),
        };
        match conn.call::<_, MasterResponse>(&hello, self.timeout).await {
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

    /// Calls the master; see the module notes for the retry policy.
    pub async fn call(&self, op: &'static str, req: &MasterRequest) -> Result<MasterResponse> {
        let idempotent =
            !matches!(req, MasterRequest::PutStart { .. } | MasterRequest::RegisterNode(_));
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
        if let Some(c) = self.conn.lock().await.take() {
            c.close();
        }
    }
}
