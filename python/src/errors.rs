//! Failures of the extension, their Python exceptions and their reference (Mooncake) codes.
//!
//! Every kvfs client [`ErrorKind`] has exactly one numeric code of the reference store's
//! `ErrorCode` (REFERENCE.md 1.14), returned by the `MooncakeDistributedStore` calls, and one
//! exception class of the native API (`kvfs.NotFoundError`, ...), built by the pure-Python
//! module `kvfs._errors` so the classes can inherit from `KeyError`, `ValueError` and the
//! builtin `TimeoutError`. The table is documented in docs/mooncake-compat.md; a test keeps the
//! two in step.

use std::time::Duration;

use kvfs_client::ErrorKind;
use pyo3::prelude::*;

/// The reference store's error codes that kvfs returns.
pub mod code {
    pub const OK: i64 = 0;
    pub const INTERNAL_ERROR: i64 = -1;
    pub const NO_AVAILABLE_HANDLE: i64 = -200;
    pub const INVALID_VERSION: i64 = -300;
    pub const INVALID_KEY: i64 = -400;
    pub const INVALID_PARAMS: i64 = -600;
    pub const REPLICA_IS_NOT_READY: i64 = -703;
    pub const OBJECT_NOT_FOUND: i64 = -704;
    pub const OBJECT_ALREADY_EXISTS: i64 = -705;
    pub const OBJECT_HAS_LEASE: i64 = -706;
    pub const OBJECT_REPLICA_BUSY: i64 = -714;
    pub const TRANSFER_FAIL: i64 = -800;
    pub const CHECKSUM_MISMATCH: i64 = -801;
    pub const RPC_FAIL: i64 = -900;
    pub const RPC_TIMEOUT: i64 = -901;
    pub const UNAVAILABLE_IN_CURRENT_STATUS: i64 = -1010;
    pub const NOT_SUPPORTED: i64 = -1012;
    pub const TENANT_QUOTA_EXCEEDED: i64 = -1700;

    /// Every code above with its reference name (exported to Python as `kvfs.ErrorCode`).
    pub const ALL: &[(&str, i64)] = &[
        ("OK", OK),
        ("INTERNAL_ERROR", INTERNAL_ERROR),
        ("NO_AVAILABLE_HANDLE", NO_AVAILABLE_HANDLE),
        ("INVALID_VERSION", INVALID_VERSION),
        ("INVALID_KEY", INVALID_KEY),
        ("INVALID_PARAMS", INVALID_PARAMS),
        ("REPLICA_IS_NOT_READY", REPLICA_IS_NOT_READY),
        ("OBJECT_NOT_FOUND", OBJECT_NOT_FOUND),
        ("OBJECT_ALREADY_EXISTS", OBJECT_ALREADY_EXISTS),
        ("OBJECT_HAS_LEASE", OBJECT_HAS_LEASE),
        ("OBJECT_REPLICA_BUSY", OBJECT_REPLICA_BUSY),
        ("TRANSFER_FAIL", TRANSFER_FAIL),
        ("CHECKSUM_MISMATCH", CHECKSUM_MISMATCH),
        ("RPC_FAIL", RPC_FAIL),
        ("RPC_TIMEOUT", RPC_TIMEOUT),
        ("UNAVAILABLE_IN_CURRENT_STATUS", UNAVAILABLE_IN_CURRENT_STATUS),
        ("NOT_SUPPORTED", NOT_SUPPORTED),
        ("TENANT_QUOTA_EXCEEDED", TENANT_QUOTA_EXCEEDED),
    ];
}

/// The kvfs client error kinds with their Python names (exported as `kvfs.ERROR_KINDS`).
pub const KINDS: &[ErrorKind] = &[
    ErrorKind::NotFound,
    ErrorKind::AlreadyExists,
    ErrorKind::NoSpace,
    ErrorKind::Leased,
    ErrorKind::Pinned,
    ErrorKind::InvalidKey,
    ErrorKind::InvalidArgument,
    ErrorKind::TooLarge,
    ErrorKind::BufferTooSmall,
    ErrorKind::NotRegistered,
    ErrorKind::PutInProgress,
    ErrorKind::Recovering,
    ErrorKind::Unavailable,
    ErrorKind::Transfer,
    ErrorKind::Corrupt,
    ErrorKind::Version,
    ErrorKind::QuotaExceeded,
    ErrorKind::Internal,
];

/// The one reference code of each client error kind.
pub fn kind_code(kind: ErrorKind) -> i64 {
    match kind {
        ErrorKind::NotFound => code::OBJECT_NOT_FOUND,
        ErrorKind::AlreadyExists => code::OBJECT_ALREADY_EXISTS,
        ErrorKind::NoSpace => code::NO_AVAILABLE_HANDLE,
        // The reference has no pins that refuse a remove; both protections answer like a lease.
        ErrorKind::Leased | ErrorKind::Pinned => code::OBJECT_HAS_LEASE,
        ErrorKind::InvalidKey => code::INVALID_KEY,
        ErrorKind::InvalidArgument
        | ErrorKind::TooLarge
        | ErrorKind::BufferTooSmall
        | ErrorKind::NotRegistered => code::INVALID_PARAMS,
        ErrorKind::PutInProgress => code::REPLICA_IS_NOT_READY,
        ErrorKind::Recovering => code::UNAVAILABLE_IN_CURRENT_STATUS,
        ErrorKind::Unavailable => code::RPC_FAIL,
        ErrorKind::Transfer => code::TRANSFER_FAIL,
        ErrorKind::Corrupt => code::CHECKSUM_MISMATCH,
        ErrorKind::Version => code::INVALID_VERSION,
        ErrorKind::QuotaExceeded => code::TENANT_QUOTA_EXCEEDED,
        _ => code::INTERNAL_ERROR,
    }
}

/// The Python-facing name of a kind (`kvfs.KvfsError.kind`).
pub fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotFound => "not_found",
        ErrorKind::AlreadyExists => "already_exists",
        ErrorKind::NoSpace => "no_space",
        ErrorKind::Leased => "leased",
        ErrorKind::Pinned => "pinned",
        ErrorKind::InvalidKey => "invalid_key",
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::TooLarge => "too_large",
        ErrorKind::BufferTooSmall => "buffer_too_small",
        ErrorKind::NotRegistered => "not_registered",
        ErrorKind::PutInProgress => "put_in_progress",
        ErrorKind::Recovering => "recovering",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Transfer => "transfer",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Version => "version",
        ErrorKind::QuotaExceeded => "quota_exceeded",
        _ => "internal",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Client(ErrorKind),
    /// The whole call outlived its deadline.
    Timeout,
    /// The store was never set up, or was closed.
    NotConnected,
}

/// Why a call failed: a kind and a message naming the operation (and key, when one).
#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
}

impl Failure {
    pub fn internal(message: impl Into<String>) -> Failure {
        Failure { kind: Kind::Client(ErrorKind::Internal), message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure { kind: Kind::Client(ErrorKind::InvalidArgument), message: message.into() }
    }

    pub fn timeout(op: &str, limit: Duration) -> Failure {
        Failure { kind: Kind::Timeout, message: format!("{op}: no answer within {limit:?}") }
    }

    pub fn not_connected() -> Failure {
        Failure {
            kind: Kind::NotConnected,
            message: "not connected: call setup() first (or the store was closed)".into(),
        }
    }

    pub fn code(&self) -> i64 {
        match self.kind {
            Kind::Client(k) => kind_code(k),
            Kind::Timeout => code::RPC_TIMEOUT,
            Kind::NotConnected => code::INVALID_PARAMS,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            Kind::Client(k) => kind_name(k),
            Kind::Timeout => "timeout",
            Kind::NotConnected => "not_connected",
        }
    }

    pub fn retryable(&self) -> bool {
        match self.kind {
            Kind::Client(k) => k.retryable(),
            Kind::Timeout => true,
            Kind::NotConnected => false,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.kind == Kind::Client(ErrorKind::NotFound)
    }

    /// The exception instance (built by `kvfs._errors.make`).
    pub fn to_pyerr(&self, py: Python<'_>) -> PyErr {
        let made = py.import("kvfs._errors").and_then(|m| {
            m.getattr("make")?.call1((
                self.kind_name(),
                self.message.as_str(),
                self.code(),
                self.retryable(),
            ))
        });
        match made {
            Ok(exc) => PyErr::from_value(exc),
            Err(e) => e,
        }
    }

    /// The exception instance as a value (for per-item batch results).
    pub fn to_pyobject(&self, py: Python<'_>) -> Py<PyAny> {
        self.to_pyerr(py).into_value(py).into_any()
    }
}

impl From<kvfs_client::Error> for Failure {
    fn from(e: kvfs_client::Error) -> Failure {
        Failure { kind: Kind::Client(e.kind()), message: e.to_string() }
    }
}

/// Logs a failure the reference API reports only as a code (set `KVFS_LOG=debug` to see them).
pub fn log_code(op: &str, f: &Failure) -> i64 {
    tracing::debug!(op, code = f.code(), error = %f.message, "call failed");
    f.code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_reference_code_and_a_name() {
        for &k in KINDS {
            let c = kind_code(k);
            assert!(c < 0, "{k:?}");
            assert!(code::ALL.iter().any(|&(_, v)| v == c), "{k:?} maps to an unlisted code {c}");
            if k != ErrorKind::Internal {
                assert_ne!(kind_name(k), "internal", "{k:?} has no name of its own");
            }
        }
        assert_eq!(kind_code(ErrorKind::Leased), -706);
        assert_eq!(kind_code(ErrorKind::NotFound), -704);
        assert_eq!(kind_code(ErrorKind::NoSpace), -200);
        assert_eq!(Failure::timeout("get", Duration::from_millis(1)).code(), -901);
    }
}
