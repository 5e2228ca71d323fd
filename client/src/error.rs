//! The client's one error type. Each kind is a domain outcome with one errno at the FUSE and
//! ioctl boundary and one code in the Python API.

use std::fmt;

use kvfs_proto::store::{ErrorCode, WireError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    NotFound,
    /// Only from `put` variants that were asked to report it (first writer wins otherwise).
    AlreadyExists,
    NoSpace,
    /// A read lease protects the object (remove without force).
    Leased,
    /// A hard pin protects the object.
    Pinned,
    InvalidKey,
    InvalidArgument,
    TooLarge,
    /// The destination buffer is smaller than the object.
    BufferTooSmall,
    /// Local memory named by a zero-copy call is not registered with the engine.
    NotRegistered,
    /// Another writer's put of the key did not finish within the retry budget.
    PutInProgress,
    /// The master is recovering after a restart and refused puts for longer than the budget.
    Recovering,
    /// The master cannot be reached or did not answer in time.
    Unavailable,
    /// Moving the bytes failed on every replica (or every replica of a put).
    Transfer,
    /// A checksum did not match the bytes read.
    Corrupt,
    /// The master or a peer speaks another protocol version.
    Version,
    /// The put would take the client's tenant over its byte quota, even after the master
    /// evicted the tenant's own cold objects.
    QuotaExceeded,
    Internal,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::NoSpace => "no space",
            ErrorKind::Leased => "leased",
            ErrorKind::Pinned => "pinned",
            ErrorKind::InvalidKey => "invalid key",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::TooLarge => "too large",
            ErrorKind::BufferTooSmall => "buffer too small",
            ErrorKind::NotRegistered => "buffer not registered",
            ErrorKind::PutInProgress => "put in progress",
            ErrorKind::Recovering => "master recovering",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Transfer => "transfer failed",
            ErrorKind::Corrupt => "checksum mismatch",
            ErrorKind::Version => "protocol version mismatch",
            ErrorKind::QuotaExceeded => "tenant quota exceeded",
            ErrorKind::Internal => "internal error",
        }
    }

    /// Whether the same call may succeed later unchanged.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::NoSpace
                | ErrorKind::Leased
                | ErrorKind::PutInProgress
                | ErrorKind::Recovering
                | ErrorKind::Unavailable
                | ErrorKind::Transfer
        )
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A client error: kind, operation, key (when one is concerned) and detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    op: &'static str,
    key: Option<String>,
    detail: String,
}

impl Error {
    pub fn new(kind: ErrorKind, op: &'static str, detail: impl Into<String>) -> Error {
        Error { kind, op, key: None, detail: detail.into() }
    }

    pub fn with_key(mut self, key: &str) -> Error {
        self.key = Some(key.to_string());
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn op(&self) -> &'static str {
        self.op
    }

    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    pub fn detail(&self) -> &str {
        &self.detail
    }

    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    pub fn from_wire(op: &'static str, e: &WireError) -> Error {
        let kind = match e.code {
            ErrorCode::NotFound => ErrorKind::NotFound,
            ErrorCode::AlreadyExists => ErrorKind::AlreadyExists,
            ErrorCode::PutInProgress => ErrorKind::PutInProgress,
            ErrorCode::NoSpace => ErrorKind::NoSpace,
            ErrorCode::Leased => ErrorKind::Leased,
            ErrorCode::Pinned => ErrorKind::Pinned,
            ErrorCode::InvalidKey => ErrorKind::InvalidKey,
            ErrorCode::InvalidArgument | ErrorCode::Conflict => ErrorKind::InvalidArgument,
            ErrorCode::TooLarge => ErrorKind::TooLarge,
            ErrorCode::Recovering => ErrorKind::Recovering,
            ErrorCode::Version => ErrorKind::Version,
            ErrorCode::NodeUnknown | ErrorCode::Internal => ErrorKind::Internal,
            ErrorCode::Corrupt => ErrorKind::Corrupt,
            ErrorCode::Unavailable | ErrorCode::NotLeader => ErrorKind::Unavailable,
            ErrorCode::QuotaExceeded => ErrorKind::QuotaExceeded,
        };
        Error::new(kind, op, e.message.clone())
    }

    pub fn from_rpc(op: &'static str, e: kvfs_rpc::RpcError) -> Error {
        Error::new(ErrorKind::Unavailable, op, e.to_string())
    }

    pub fn from_transfer(op: &'static str, e: &kvfs_transfer::Error) -> Error {
        let kind = match e.kind() {
            kvfs_transfer::ErrorKind::NotRegistered => ErrorKind::NotRegistered,
            kvfs_transfer::ErrorKind::InvalidArgument => ErrorKind::InvalidArgument,
            _ => ErrorKind::Transfer,
        };
        Error::new(kind, op, e.to_string())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        if let Some(k) = &self.key {
            write!(f, " {k:?}")?;
        }
        write!(f, ": {}", self.kind)?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;
