//! The crate's one error type.
//!
//! Mechanism: every fallible call returns [`Error`], which carries a [`ErrorKind`] (the domain
//! outcome a caller branches on), the operation that failed (`"open"`, `"register"`,
//! `"connect"`, `"post"`, ...), free-form context for logs, and the OS error where a verbs call
//! reported one. Work-completion failures also keep the raw `ibv_wc_status` and vendor syndrome,
//! because those are what a vendor's support asks for.
//!
//! Policy: [`Error::retryable`] answers "can trying again help?", where "again" may mean on a
//! fresh endpoint (a QP that went to the error state never recovers; see `endpoint.rs`). A
//! caller that gets a retryable error on an op should re-issue the op, possibly on another path;
//! a non-retryable one (bad rkey, bad address, malformed handshake) will fail the same way.
//!
//! Not handled here: mapping to errnos or Python codes; that is the boundary crates' job.

use std::fmt;
use std::io;

/// What went wrong, as a caller needs to branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is out of range: zero-length op, slice outside its region, bad option.
    InvalidArgument,
    /// Bytes from the peer (an [`crate::EndpointInfo`]) failed validation.
    Malformed,
    /// A named device, port or GID index does not exist.
    NotFound,
    /// The device or peer cannot do what is asked (e.g. link layers differ).
    Unsupported,
    /// A verbs call (create, modify, query, register) failed; `source` has the errno.
    Device,
    /// Back-pressure: the endpoint's bounded submission queue is full.
    QueueFull,
    /// The endpoint is not connected yet (or already connected, for `connect`).
    NotConnected,
    /// A wait passed its deadline. Outstanding ops stay outstanding.
    Timeout,
    /// The local side of an op was refused: bad lkey, range outside the region, length error.
    LocalAccess,
    /// The peer refused the op: bad rkey, address outside its region, or no permission.
    RemoteAccess,
    /// The peer failed to execute a valid request (remote operation / invalid request).
    RemoteOperation,
    /// Transport retries ran out: the peer is unreachable, dead or not responding.
    RetryExceeded,
    /// The op never ran: its QP entered the error state because of an earlier failure.
    Flushed,
    /// The endpoint's QP is in the error state; only a new endpoint can carry more ops.
    Broken,
    /// Any other completion failure (bad response, fatal, general error).
    Transport,
}

impl ErrorKind {
    /// Whether trying again (on a fresh endpoint if this one is broken) can succeed.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::QueueFull
                | ErrorKind::Timeout
                | ErrorKind::RetryExceeded
                | ErrorKind::Flushed
                | ErrorKind::Broken
                | ErrorKind::Transport
        )
    }

    fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Malformed => "malformed peer data",
            ErrorKind::NotFound => "not found",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Device => "device error",
            ErrorKind::QueueFull => "submission queue full",
            ErrorKind::NotConnected => "endpoint not connected",
            ErrorKind::Timeout => "timed out",
            ErrorKind::LocalAccess => "local access error",
            ErrorKind::RemoteAccess => "remote access error",
            ErrorKind::RemoteOperation => "remote operation error",
            ErrorKind::RetryExceeded => "transport retries exceeded",
            ErrorKind::Flushed => "flushed by an earlier failure",
            ErrorKind::Broken => "endpoint broken",
            ErrorKind::Transport => "transport error",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The raw completion status of a failed work request, for logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WcStatus {
    /// `ibv_wc_status` value.
    pub status: u32,
    /// Vendor syndrome (`vendor_err`).
    pub vendor_err: u32,
}

/// The error type of `kvfs-rdma`.
#[derive(Debug, thiserror::Error)]
pub struct Error {
    kind: ErrorKind,
    op: &'static str,
    context: String,
    wc: Option<WcStatus>,
    #[source]
    source: Option<io::Error>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rdma {}: {}", self.op, self.kind)?;
        if !self.context.is_empty() {
            write!(f, ": {}", self.context)?;
        }
        if let Some(wc) = self.wc {
            write!(
                f,
                " (wc status {} {}, vendor_err {:#x})",
                wc.status,
                wc_status_name(wc.status),
                wc.vendor_err
            )?;
        }
        if let Some(src) = &self.source {
            write!(f, ": {src}")?;
        }
        Ok(())
    }
}

impl Error {
    /// A new error of `kind` raised by operation `op`.
    pub fn new(kind: ErrorKind, op: &'static str, context: impl Into<String>) -> Error {
        Error { kind, op, context: context.into(), wc: None, source: None }
    }

    /// A verbs call failure with its OS error.
    pub(crate) fn os(op: &'static str, context: impl Into<String>, source: io::Error) -> Error {
        let kind = match source.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENODEV) => ErrorKind::NotFound,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => ErrorKind::Unsupported,
            _ => ErrorKind::Device,
        };
        Error { kind, op, context: context.into(), wc: None, source: Some(source) }
    }

    /// A failed work completion.
    pub(crate) fn completion(kind: ErrorKind, wc: WcStatus, context: impl Into<String>) -> Error {
        Error { kind, op: "completion", context: context.into(), wc: Some(wc), source: None }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The operation that failed.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Free-form context (device, qpn, op id, ...).
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The raw completion status, for errors that came from a work completion.
    pub fn wc_status(&self) -> Option<WcStatus> {
        self.wc
    }

    /// Whether trying again (on a fresh endpoint if this one is broken) can succeed.
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Maps a failed `ibv_wc_status` to its kind.
pub(crate) fn kind_of_wc_status(status: u32) -> ErrorKind {
    use rdma_mummy_sys::ibv_wc_status as s;
    match status {
        s::IBV_WC_LOC_LEN_ERR | s::IBV_WC_LOC_PROT_ERR | s::IBV_WC_LOC_ACCESS_ERR => {
            ErrorKind::LocalAccess
        }
        s::IBV_WC_REM_ACCESS_ERR => ErrorKind::RemoteAccess,
        s::IBV_WC_REM_INV_REQ_ERR | s::IBV_WC_REM_OP_ERR | s::IBV_WC_REM_INV_RD_REQ_ERR => {
            ErrorKind::RemoteOperation
        }
        s::IBV_WC_RETRY_EXC_ERR | s::IBV_WC_RNR_RETRY_EXC_ERR | s::IBV_WC_RESP_TIMEOUT_ERR => {
            ErrorKind::RetryExceeded
        }
        s::IBV_WC_WR_FLUSH_ERR => ErrorKind::Flushed,
        _ => ErrorKind::Transport,
    }
}

/// The verbs name of a completion status, without calling into rdma-core.
pub(crate) fn wc_status_name(status: u32) -> &'static str {
    use rdma_mummy_sys::ibv_wc_status as s;
    match status {
        s::IBV_WC_SUCCESS => "SUCCESS",
        s::IBV_WC_LOC_LEN_ERR => "LOC_LEN_ERR",
        s::IBV_WC_LOC_QP_OP_ERR => "LOC_QP_OP_ERR",
        s::IBV_WC_LOC_EEC_OP_ERR => "LOC_EEC_OP_ERR",
        s::IBV_WC_LOC_PROT_ERR => "LOC_PROT_ERR",
        s::IBV_WC_WR_FLUSH_ERR => "WR_FLUSH_ERR",
        s::IBV_WC_MW_BIND_ERR => "MW_BIND_ERR",
        s::IBV_WC_BAD_RESP_ERR => "BAD_RESP_ERR",
        s::IBV_WC_LOC_ACCESS_ERR => "LOC_ACCESS_ERR",
        s::IBV_WC_REM_INV_REQ_ERR => "REM_INV_REQ_ERR",
        s::IBV_WC_REM_ACCESS_ERR => "REM_ACCESS_ERR",
        s::IBV_WC_REM_OP_ERR => "REM_OP_ERR",
        s::IBV_WC_RETRY_EXC_ERR => "RETRY_EXC_ERR",
        s::IBV_WC_RNR_RETRY_EXC_ERR => "RNR_RETRY_EXC_ERR",
        s::IBV_WC_REM_INV_RD_REQ_ERR => "REM_INV_RD_REQ_ERR",
        s::IBV_WC_REM_ABORT_ERR => "REM_ABORT_ERR",
        s::IBV_WC_FATAL_ERR => "FATAL_ERR",
        s::IBV_WC_RESP_TIMEOUT_ERR => "RESP_TIMEOUT_ERR",
        s::IBV_WC_GENERAL_ERR => "GENERAL_ERR",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_statuses_map_to_the_kinds_callers_branch_on() {
        use rdma_mummy_sys::ibv_wc_status as s;
        assert_eq!(kind_of_wc_status(s::IBV_WC_REM_ACCESS_ERR), ErrorKind::RemoteAccess);
        assert_eq!(kind_of_wc_status(s::IBV_WC_RETRY_EXC_ERR), ErrorKind::RetryExceeded);
        assert_eq!(kind_of_wc_status(s::IBV_WC_WR_FLUSH_ERR), ErrorKind::Flushed);
        assert_eq!(kind_of_wc_status(s::IBV_WC_LOC_PROT_ERR), ErrorKind::LocalAccess);
        assert_eq!(kind_of_wc_status(9999), ErrorKind::Transport);
        assert!(!ErrorKind::RemoteAccess.retryable());
        assert!(ErrorKind::RetryExceeded.retryable());
    }

    #[test]
    fn display_names_the_op_kind_and_status() {
        let e = Error::completion(
            ErrorKind::RemoteAccess,
            WcStatus { status: 10, vendor_err: 0x88 },
            "op 7",
        );
        let s = e.to_string();
        assert!(s.contains("remote access error") && s.contains("REM_ACCESS_ERR"), "{s}");
        assert!(s.contains("op 7") && s.contains("0x88"), "{s}");
    }
}
