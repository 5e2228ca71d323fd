//! What the daemon learns about the processes that call it, from `/proc` and pidfds.
//!
//! - FUSE reports the calling *thread* id; [`caller`] resolves it to the thread group (the
//!   process) and the process's start time, so a recycled pid is never taken for the process
//!   that registered a buffer.
//! - [`killed_by_signal`]: whether a thread is exiting because a signal killed it. A close
//!   that the kernel performs while tearing down a killed writer must not commit a put.
//! - [`take_fd`]: the daemon's own reference to a descriptor in a caller's table
//!   (`pidfd_getfd`, or `/proc/PID/fd/N` where pidfds are refused), so only a process holding a
//!   descriptor can have the daemon map it.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// A process, robust against pid reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcId {
    pub tgid: u32,
    /// Start time in clock ticks after boot (`/proc/PID/stat` field 22).
    pub start: u64,
}

/// Fields of `/proc/PID/stat` after the command name, so `fields[0]` is field 3 (`state`).
fn stat_fields(pid: u32) -> io::Result<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after =
        text.rfind(')').map(|i| &text[i + 1..]).ok_or_else(|| io::Error::other("bad stat"))?;
    Ok(after.split_whitespace().map(String::from).collect())
}

fn stat_field(fields: &[String], field: usize) -> Option<u64> {
    fields.get(field.checked_sub(3)?)?.parse().ok()
}

/// The process a thread belongs to.
pub fn caller(tid: u32) -> io::Result<ProcId> {
    if tid == 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let status = std::fs::read_to_string(format!("/proc/{tid}/status"))?;
    let tgid = status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no Tgid in status"))?;
    let start =
        stat_field(&stat_fields(tgid)?, 22).ok_or_else(|| io::Error::other("no starttime"))?;
    Ok(ProcId { tgid, start })
}

/// Whether the process is still the one identified (alive, same start time).
pub fn alive(p: ProcId) -> bool {
    stat_fields(p.tgid).ok().and_then(|f| stat_field(&f, 22)) == Some(p.start)
}

const PF_EXITING: u64 = 0x4;

/// Whether thread `tid` is exiting because a signal killed it (its exit code carries a signal
/// number). A thread that exits normally, or that is not exiting, is not.
pub fn killed_by_signal(tid: u32) -> bool {
    let Ok(f) = stat_fields(tid) else { return false };
    let exiting = stat_field(&f, 9).is_some_and(|flags| flags & PF_EXITING != 0);
    let exit_code = stat_field(&f, 52).unwrap_or(0);
    exiting && exit_code & 0x7f != 0
}

/// The daemon's own descriptor for descriptor `fd` of process `tgid`.
pub fn take_fd(tgid: u32, fd: i32) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: plain syscalls with integer arguments; a returned descriptor is ours to own.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, tgid as libc::pid_t, 0) };
    if pidfd >= 0 {
        // SAFETY: pidfd was just returned to us.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
        let raw = {
            use std::os::fd::AsRawFd;
            // SAFETY: as above.
            unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) }
        };
        if raw >= 0 {
            // SAFETY: a new descriptor in our table, owned by nobody else.
            return Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EPERM) && e.raw_os_error() != Some(libc::ENOSYS) {
            return Err(e);
        }
    }
    // Fallback: reopen through /proc (same file, a new open file description).
    let path = format!("/proc/{tgid}/fd/{fd}");
    match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => Ok(f.into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(io::Error::from_raw_os_error(libc::EBADF))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_its_own_caller_and_not_killed() {
        let me = std::process::id();
        let p = caller(me).unwrap();
        assert_eq!(p.tgid, me);
        assert!(alive(p));
        assert!(!alive(ProcId { tgid: me, start: p.start + 1 }));
        assert!(!killed_by_signal(me));
        // A thread resolves to the process.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_eq!(caller(tid).unwrap().tgid, me);
        done_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(caller(0).is_err());
    }

    #[test]
    fn take_fd_finds_our_descriptors_and_refuses_others() {
        let f = tempfile::tempfile().unwrap();
        use std::os::fd::AsRawFd;
        let mine = take_fd(std::process::id(), f.as_raw_fd()).unwrap();
        assert!(mine.as_raw_fd() >= 0);
        let e = take_fd(std::process::id(), 987_654).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
        assert_eq!(take_fd(std::process::id(), -1).unwrap_err().raw_os_error(), Some(libc::EBADF));
    }
}
