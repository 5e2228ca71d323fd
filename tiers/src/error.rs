//! The one error type of `kvfs-tiers`.
//!
//! Mechanism: an [`Error`] is a [`ErrorKind`] (the domain outcome a caller branches on), a
//! human-readable context (operation, key, path, medium) and an optional source error.
//!
//! Policy: each kind says whether retrying the same operation can help ([`Error::retryable`]).
//! `NotFound`, `AlreadyExists`, `InvalidArgument` and `Corrupt` never heal by themselves;
//! `Unavailable`, `Timeout`, `Busy` and transient `Io` may. `NoSpace` is not retryable on the
//! same medium (the caller must evict or pick another tier first).
//!
//! Invariant: bytes from disk, the network or device memory never reach an `unwrap`; every
//! malformed header, short read or checksum mismatch becomes an `Error` of kind `Corrupt` or
//! `Io`.
//!
//! Not handled here: mapping kinds to errnos or Python codes; the FUSE/ioctl layer and the
//! Python binding own those tables.

use std::fmt;

/// What went wrong, as a caller branches on it.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The key is not held by this medium (or is still being written).
    NotFound,
    /// A create-only put met an existing object.
    AlreadyExists,
    /// The medium (or a bounded queue's byte budget) has no room for the object.
    NoSpace,
    /// Stored bytes or a stored header failed verification (checksum, magic, length).
    Corrupt,
    /// The medium cannot be used at all right now (no CUDA driver, server down, ...).
    Unavailable,
    /// The caller passed something out of range (empty key, key too long, short buffer, ...).
    InvalidArgument,
    /// An operating-system or backend I/O error.
    Io,
    /// An operation did not finish within its bound.
    Timeout,
    /// A bounded queue is full; back-pressure the caller can see.
    Busy,
    /// The component was closed or shut down.
    Closed,
}

impl ErrorKind {
    /// Whether retrying the same operation may succeed.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorKind::Unavailable | ErrorKind::Io | ErrorKind::Timeout | ErrorKind::Busy
        )
    }

    /// Stable lower-case name, for logs and bench output.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Io => "io",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Busy => "busy",
            ErrorKind::Closed => "closed",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error of every fallible function in this crate.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {context}{}", source.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
pub struct Error {
    kind: ErrorKind,
    context: String,
    #[source]
    source: Option<Source>,
}

impl Error {
    /// A new error of `kind` with `context` (operation, key, path...).
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Error { kind, context: context.into(), source: None }
    }

    /// Attach the underlying cause.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Prefix more context (the outer operation) to the message.
    pub fn context(mut self, outer: impl fmt::Display) -> Self {
        self.context = format!("{outer}: {}", self.context);
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn context_str(&self) -> &str {
        &self.context
    }

    /// Whether retrying the same operation may succeed.
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    /// An `io::Error` with context; `ENOSPC` becomes `NoSpace`, `ENOENT` `NotFound`.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        let kind = match err.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
            std::io::ErrorKind::StorageFull => ErrorKind::NoSpace,
            std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
            std::io::ErrorKind::InvalidInput => ErrorKind::InvalidArgument,
            _ => ErrorKind::Io,
        };
        Error::new(kind, context).with_source(err)
    }

    /// An errno (as returned negated in an io_uring CQE) with context.
    pub fn errno(context: impl Into<String>, errno: i32) -> Self {
        Error::io(context, std::io::Error::from_raw_os_error(errno))
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_follows_kind() {
        assert!(Error::new(ErrorKind::Timeout, "x").retryable());
        assert!(Error::new(ErrorKind::Busy, "x").retryable());
        assert!(!Error::new(ErrorKind::Corrupt, "x").retryable());
        assert!(!Error::new(ErrorKind::NotFound, "x").retryable());
    }

    #[test]
    fn io_errors_map_to_kinds() {
        let e = Error::errno("write", libc::ENOSPC);
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        let e = Error::errno("open", libc::ENOENT);
        assert_eq!(e.kind(), ErrorKind::NotFound);
        let msg = Error::errno("read /x", libc::EIO).context("nvme get k").to_string();
        assert!(msg.starts_with("io: nvme get k: read /x"), "{msg}");
    }
}
