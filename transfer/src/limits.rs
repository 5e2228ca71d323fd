//! Process limits a serving engine needs.

/// Raises this process's soft limit on open files to its hard limit, as Go's runtime does for
/// every program it starts, and returns the soft limit now in force (`None` if it cannot be
/// read). Every served connection holds two descriptors, a reader's and a writer's
/// (`kvfs_proto::plain::PlainStream::split`), so a daemon started under the common soft limit
/// of 1,024 would refuse connections at a few hundred peers where the hard limit allows far
/// more. Never lowers a limit.
pub fn raise_open_files_limit() -> Option<u64> {
    let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) } != 0 {
        return None;
    }
    if now.rlim_cur < now.rlim_max {
        let raised = libc::rlimit { rlim_cur: now.rlim_max, rlim_max: now.rlim_max };
        // SAFETY: setrlimit reads only the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Some(raised.rlim_cur);
        }
    }
    Some(now.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> libc::rlimit {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
        r
    }

    #[test]
    fn the_open_files_limit_rises_to_the_hard_limit_and_never_falls() {
        let before = limits();
        // A low soft limit, as a service manager's default gives (this test runs in a process
        // of its own under nextest).
        let low = libc::rlimit { rlim_cur: before.rlim_max.min(256), rlim_max: before.rlim_max };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        assert_eq!(raise_open_files_limit(), Some(before.rlim_max));
        let after = limits();
        assert_eq!((after.rlim_cur, after.rlim_max), (before.rlim_max, before.rlim_max));
        // Already at the hard limit: nothing changes.
        assert_eq!(raise_open_files_limit(), Some(before.rlim_max));
    }
}
