//! One errno per store outcome, at the FUSE and ioctl boundary (the table is in the crate
//! docs and the README). Every error the mount returns goes through here or is one of the
//! mount's own constants, so the table stays the truth.

use kvfs_client::ErrorKind;

/// The errno of a store error.
pub fn of_kind(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::NotFound => libc::ENOENT,
        ErrorKind::AlreadyExists => libc::EEXIST,
        ErrorKind::NoSpace => libc::ENOSPC,
        ErrorKind::Leased => libc::EBUSY,
        ErrorKind::Pinned => libc::EPERM,
        ErrorKind::InvalidKey | ErrorKind::InvalidArgument => libc::EINVAL,
        ErrorKind::TooLarge => libc::EFBIG,
        ErrorKind::BufferTooSmall => libc::EOVERFLOW,
        ErrorKind::NotRegistered => libc::EFAULT,
        ErrorKind::PutInProgress | ErrorKind::Recovering => libc::EAGAIN,
        ErrorKind::Unavailable => libc::ENOTCONN,
        ErrorKind::Transfer => libc::EIO,
        ErrorKind::Corrupt => libc::EBADMSG,
        ErrorKind::Version => libc::EPROTO,
        _ => libc::EIO,
    }
}

/// The errno of a store error, logged at debug level with its detail (the caller handles it).
pub fn of(e: &kvfs_client::Error) -> i32 {
    tracing::debug!(error = %e, "store error");
    of_kind(e.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_distinct_meaning() {
        assert_eq!(of_kind(ErrorKind::Leased), libc::EBUSY);
        assert_eq!(of_kind(ErrorKind::NotFound), libc::ENOENT);
        assert_eq!(of_kind(ErrorKind::Corrupt), libc::EBADMSG);
        assert_eq!(of_kind(ErrorKind::Unavailable), libc::ENOTCONN);
        assert_eq!(of_kind(ErrorKind::BufferTooSmall), libc::EOVERFLOW);
    }
}
