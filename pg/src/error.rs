//! The PG's one error type: a kind callers branch on, the operation, and a detail.

use std::fmt;

/// What went wrong, as callers branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A malformed call: a bad length, dtype, op, root or count.
    InvalidArgument,
    /// The ranks disagree about the operation (sizes, dtypes, ops or roots differ).
    Mismatch,
    /// A slot outside the group, or not active in the current view.
    UnknownSlot,
    /// A member failed during the operation and the view moved on without it; the operation
    /// did not complete here (the survivors' next operation runs over the new view).
    PeerFailed,
    /// A frame or request from an older epoch than the receiver's.
    StaleEpoch,
    /// No progress within the operation's deadline.
    Timeout,
    /// The coordinator refused a join (slot taken, group full, group name differs).
    Refused,
    /// The group is closed, or the coordinator is gone.
    Closed,
    /// A bounded queue is full.
    Busy,
    /// The Transfer Engine failed (its error is in the detail).
    Transfer,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Mismatch => "mismatch across ranks",
            ErrorKind::UnknownSlot => "unknown slot",
            ErrorKind::PeerFailed => "peer failed",
            ErrorKind::StaleEpoch => "stale epoch",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Refused => "refused",
            ErrorKind::Closed => "closed",
            ErrorKind::Busy => "busy",
            ErrorKind::Transfer => "transfer failed",
        }
    }

    /// Whether trying the same call again may succeed (after a view change or a wait).
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::PeerFailed | ErrorKind::StaleEpoch | ErrorKind::Busy)
    }
}

/// A PG error: kind, operation and detail.
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

    pub(crate) fn transfer(op: &'static str, e: kvfs_transfer::Error) -> Error {
        let kind = match e.kind() {
            kvfs_transfer::ErrorKind::Timeout => ErrorKind::Timeout,
            kvfs_transfer::ErrorKind::Busy => ErrorKind::Busy,
            _ => ErrorKind::Transfer,
        };
        Error::new(kind, op, e.to_string())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.op, self.kind.as_str(), self.detail)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
