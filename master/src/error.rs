//! The crate's one error type: a domain [`ErrorKind`], whether a retry can help, and the
//! operation and key it happened on.
//!
//! Policy: every kind is a distinct outcome a caller reacts to differently; each will map to
//! exactly one errno at the FUSE boundary and one Mooncake `ErrorCode` (REFERENCE.md 1.14) in
//! the RPC layer. The suggested Mooncake mapping is on each variant. `Error` is boxed so that
//! `Result<bool, Error>` in a 10 000-key batch answer stays two words.

use std::fmt;

/// What went wrong, as a caller needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No complete object under this key (pending puts are invisible). `OBJECT_NOT_FOUND -704`.
    NotFound,
    /// A complete object holds the key: first writer wins, callers report success.
    /// `OBJECT_ALREADY_EXISTS -705`.
    AlreadyExists,
    /// Another writer's put of this key is in flight; retry, then expect `AlreadyExists`.
    /// Mooncake answers `OBJECT_ALREADY_EXISTS -705` here too; `REPLICA_IS_NOT_READY -703` is
    /// the closer code for a client that distinguishes.
    PutInProgress,
    /// No segment has room even after bounded eviction, or the object count limit is reached.
    /// `NO_AVAILABLE_HANDLE -200` (engines treat it as back-pressure).
    NoSpace,
    /// A live read lease protects the object (remove without force, upsert).
    /// `OBJECT_HAS_LEASE -706` (`OBJECT_REPLICA_BUSY -714` for upsert).
    Leased,
    /// The object is hard-pinned; only a forced remove takes it. `OBJECT_HAS_LEASE -706`.
    Pinned,
    /// Empty key or longer than `key_len_max`. `INVALID_KEY -400`.
    InvalidKey,
    /// A malformed request (zero size, zero replicas, bad regex, unknown segment, tier
    /// mismatch...). `INVALID_PARAMS -600`.
    InvalidArgument,
    /// Object larger than `object_size_max` or more replicas than `replicas_max`.
    /// `INVALID_PARAMS -600`.
    TooLarge,
    /// The node is not registered (never was, or expired): it must re-register with what it
    /// holds. `CLIENT_NOT_FOUND -103` / Ping's `NEED_REMOUNT`.
    NodeUnknown,
    /// A replica report names a range that overlaps another replica, or a segment the node
    /// did not register. `REPLICA_ALREADY_EXISTS -711`.
    Conflict,
    /// A tenant's put would take it over its byte quota and evicting its own objects did not
    /// make room (they are leased or pinned, or the object alone is larger than the quota).
    /// `TENANT_QUOTA_EXCEEDED -1700`.
    QuotaExceeded,
}

impl ErrorKind {
    /// Whether the same call can succeed later without the caller changing anything
    /// (after a wait, a lease expiry, an eviction or, for `NodeUnknown`, a re-registration).
    pub fn retryable(self) -> bool {
        matches!(self, Self::PutInProgress | Self::NoSpace | Self::Leased | Self::NodeUnknown)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotFound => "not found",
            Self::AlreadyExists => "already exists",
            Self::PutInProgress => "put in progress",
            Self::NoSpace => "no space",
            Self::Leased => "leased",
            Self::Pinned => "hard-pinned",
            Self::InvalidKey => "invalid key",
            Self::InvalidArgument => "invalid argument",
            Self::TooLarge => "too large",
            Self::NodeUnknown => "node unknown",
            Self::Conflict => "conflict",
            Self::QuotaExceeded => "tenant quota exceeded",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error of the master core: kind, operation, key and a detail line.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.0)]
pub struct Error(Box<Inner>);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Inner {
    kind: ErrorKind,
    op: &'static str,
    key: Option<Box<str>>,
    detail: Option<String>,
}

impl fmt::Display for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.kind)?;
        if let Some(key) = &self.key {
            // keys can be 4 KiB; an error line shows a prefix
            let shown: String = key.chars().take(128).collect();
            write!(f, " (key {shown:?})")?;
        }
        if let Some(detail) = &self.detail {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Error {
    pub fn new(kind: ErrorKind, op: &'static str) -> Self {
        Error(Box::new(Inner { kind, op, key: None, detail: None }))
    }

    pub fn with_key(mut self, key: &str) -> Self {
        self.0.key = Some(key.into());
        self
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.0.detail = Some(detail.into());
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.0.kind
    }

    pub fn op(&self) -> &'static str {
        self.0.op
    }

    pub fn key(&self) -> Option<&str> {
        self.0.key.as_deref()
    }

    pub fn detail(&self) -> Option<&str> {
        self.0.detail.as_deref()
    }

    pub fn retryable(&self) -> bool {
        self.0.kind.retryable()
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_has_op_kind_key_detail() {
        let e = Error::new(ErrorKind::Leased, "remove").with_key("k1").with_detail("until 5");
        assert_eq!(e.to_string(), "remove: leased (key \"k1\"): until 5");
        assert!(e.retryable());
        assert!(!Error::new(ErrorKind::AlreadyExists, "put_start").retryable());
        assert!(std::mem::size_of::<Result<bool>>() <= 16);
    }
}
