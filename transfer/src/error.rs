//! The Transfer Engine's one error type.
//!
//! Every failure carries a [`ErrorKind`] (the domain outcome callers branch on), the operation
//! that failed and a human-readable detail. Errors are `Clone` because one connection failure
//! fans out to every slice that was in flight on it.

use std::fmt;

/// What went wrong, as callers branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A malformed request: zero length, overflow, bad configuration.
    InvalidArgument,
    /// The local range of a request is not inside one registered buffer.
    NotRegistered,
    /// The remote range is not inside one buffer the peer registered as remotely accessible.
    OutOfRange,
    /// The segment was never opened, or its address does not answer as a kvfs engine.
    UnknownSegment,
    /// More items in one batch than `batch_items_max`.
    BatchTooLarge,
    /// No answer within the configured timeout (a silent peer).
    Timeout,
    /// The peer closed the connection, died, or restarted as a different instance.
    PeerGone,
    /// The peer refused the handshake (protocol version, overload).
    Refused,
    /// A bounded queue is full (back-pressure).
    Busy,
    /// An operating-system call failed.
    Io,
    /// The requested transport is not available here (e.g. rdma without a device).
    Unsupported,
    /// A guarded read the peer refused: the range no longer holds what the guard names.
    Stale,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NotRegistered => "local range not registered",
            ErrorKind::OutOfRange => "remote range out of range",
            ErrorKind::UnknownSegment => "unknown segment",
            ErrorKind::BatchTooLarge => "batch too large",
            ErrorKind::Timeout => "timed out",
            ErrorKind::PeerGone => "peer gone",
            ErrorKind::Refused => "refused",
            ErrorKind::Busy => "busy",
            ErrorKind::Io => "i/o error",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Stale => "stale",
        }
    }
}

/// A Transfer Engine error: kind, operation and detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    op: &'static str,
    detail: String,
}

impl Error {
    pub fn new(kind: ErrorKind, op: &'static str, detail: impl Into<String>) -> Error {
        Error { kind, op, detail: detail.into() }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn op(&self) -> &'static str {
        self.op
    }

    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Whether the same request may succeed if tried again (on another connection, later).
    pub fn retryable(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Timeout | ErrorKind::PeerGone | ErrorKind::Busy | ErrorKind::Io
        )
    }

    pub(crate) fn io(op: &'static str, e: std::io::Error) -> Error {
        let kind = match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::NotConnected
            | std::io::ErrorKind::UnexpectedEof => ErrorKind::PeerGone,
            _ => ErrorKind::Io,
        };
        Error::new(kind, op, e.to_string())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.kind.as_str())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;
