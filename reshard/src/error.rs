//! The crate's one error type: a kind callers branch on, the operation, and a detail.

use std::fmt;

/// What went wrong, as callers branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A malformed placement, plan or call (bad shape, fragment out of bounds, bad JSON).
    InvalidArgument,
    /// Some element of a tensor is held by no fragment of a replica.
    CoverageGap,
    /// Two fragments of one replica hold the same element.
    Overlap,
    /// Source and target disagree about a tensor (missing, shape, dtype or layout differ), or
    /// a binding does not match the plan.
    Mismatch,
    /// The plan would exceed a planning limit (regions, segments).
    Limit,
    /// A binding or a peer's buffers are of another allocation generation than the plan.
    StaleGeneration,
    /// A participant failed or left during execution; the target generation stays inactive.
    PeerFailed,
    /// No progress within the deadline.
    Timeout,
    /// The Transfer Engine failed (its error is in the detail).
    Transfer,
    /// The kvfs pool failed (its error is in the detail).
    Store,
    /// Weights or a manifest not in the pool.
    NotFound,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::CoverageGap => "coverage gap",
            ErrorKind::Overlap => "overlapping fragments",
            ErrorKind::Mismatch => "mismatch",
            ErrorKind::Limit => "planning limit exceeded",
            ErrorKind::StaleGeneration => "stale generation",
            ErrorKind::PeerFailed => "peer failed",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Transfer => "transfer failed",
            ErrorKind::Store => "store failed",
            ErrorKind::NotFound => "not found",
        }
    }

    /// Whether trying the same call again may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Timeout | ErrorKind::Transfer | ErrorKind::PeerFailed)
    }
}

/// A reshard error: kind, operation and detail.
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

    pub(crate) fn with_detail(mut self, context: &str) -> Error {
        self.detail = format!("{context}: {}", self.detail);
        self
    }

    pub(crate) fn transfer(op: &'static str, e: kvfs_transfer::Error) -> Error {
        let kind = match e.kind() {
            kvfs_transfer::ErrorKind::Timeout => ErrorKind::Timeout,
            _ => ErrorKind::Transfer,
        };
        Error::new(kind, op, e.to_string())
    }

    pub(crate) fn pg(op: &'static str, e: kvfs_pg::Error) -> Error {
        let kind = match e.kind() {
            kvfs_pg::ErrorKind::Timeout => ErrorKind::Timeout,
            kvfs_pg::ErrorKind::InvalidArgument => ErrorKind::InvalidArgument,
            kvfs_pg::ErrorKind::Mismatch => ErrorKind::Mismatch,
            _ => ErrorKind::PeerFailed,
        };
        Error::new(kind, op, e.to_string())
    }

    pub(crate) fn store(op: &'static str, e: kvfs_client::Error) -> Error {
        let kind = if e.kind() == kvfs_client::ErrorKind::NotFound {
            ErrorKind::NotFound
        } else {
            ErrorKind::Store
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
