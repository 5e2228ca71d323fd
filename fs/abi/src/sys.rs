//! The ioctls for Rust callers: [`Control`] opens `<mountpoint>/.kvfs/control` and issues the
//! four commands; [`SealedMemfd`] makes a buffer the daemon accepts (a memfd sealed against
//! shrinking, mapped read-write in this process).
//!
//! Errors are the ioctl's `errno` as `std::io::Error` (see the crate docs and the header for
//! what each one means). Nothing here retries.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::ptr::NonNull;

use crate::{
    ABI_VERSION, CONTROL_PATH, IOC_INFO, IOC_REGISTER, IOC_SUBMIT, IOC_UNREGISTER, Info, Register,
    Submit, Unregister,
};

/// An open control file.
#[derive(Debug)]
pub struct Control {
    file: File,
}

impl Control {
    /// Opens `<mountpoint>/.kvfs/control`.
    pub fn open(mountpoint: &Path) -> io::Result<Control> {
        Ok(Control { file: File::open(mountpoint.join(CONTROL_PATH))? })
    }

    /// Issues a raw command with `arg` as the in/out argument (for tests of bad input).
    pub fn ioctl_raw(&self, cmd: u32, arg: &mut [u8]) -> io::Result<i32> {
        let size = ((cmd >> 16) & 0x3fff) as usize;
        if arg.len() < size {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `arg` is a live, writable buffer of at least the size the command encodes,
        // which is all the kernel copies in or out.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), cmd as _, arg.as_mut_ptr()) };
        if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
    }

    pub fn info(&self) -> io::Result<Info> {
        let mut b = Info::default().to_bytes();
        self.ioctl_raw(IOC_INFO, &mut b)?;
        Info::from_bytes(&b).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))
    }

    /// Registers `[0, len)` of `fd` (a sealed memfd of this process); returns the buffer id.
    pub fn register(&self, fd: RawFd, len: u64) -> io::Result<u64> {
        let mut r = Register { abi_version: ABI_VERSION, fd, len, ..Default::default() };
        self.register_raw(&mut r)?;
        Ok(r.buffer_id)
    }

    pub fn register_raw(&self, r: &mut Register) -> io::Result<()> {
        let mut b = r.to_bytes();
        self.ioctl_raw(IOC_REGISTER, &mut b)?;
        *r = Register::from_bytes(&b).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
        Ok(())
    }

    pub fn unregister(&self, buffer_id: u64) -> io::Result<()> {
        let mut b = Unregister { abi_version: ABI_VERSION, reserved: 0, buffer_id }.to_bytes();
        self.ioctl_raw(IOC_UNREGISTER, &mut b).map(|_| ())
    }

    /// Rings the doorbell for a batch; `s.ok` and `s.failed` come back filled in.
    pub fn submit(&self, s: &mut Submit) -> io::Result<()> {
        let mut b = s.to_bytes();
        self.ioctl_raw(IOC_SUBMIT, &mut b)?;
        *s = Submit::from_bytes(&b).ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
        Ok(())
    }
}

/// A memfd sealed against shrinking and growing, mapped read-write: what the daemon accepts.
#[derive(Debug)]
pub struct SealedMemfd {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain shared mapping; concurrent access is the caller's contract, as with any
// memory shared with another process.
unsafe impl Send for SealedMemfd {}
// SAFETY: as above.
unsafe impl Sync for SealedMemfd {}

impl SealedMemfd {
    /// Creates, sizes, seals and maps (with every page faulted in) a buffer of `len` bytes.
    pub fn new(name: &str, len: usize) -> io::Result<SealedMemfd> {
        let cname =
            std::ffi::CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: valid NUL-terminated name, plain flags.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate/fcntl on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of our own descriptor; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast()).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(SealedMemfd { fd, ptr, len })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `data` in at `offset` (panics when out of range: a caller bug).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        assert!(offset.checked_add(data.len()).is_some_and(|e| e <= self.len), "out of range");
        // SAFETY: range checked against the mapping; the source is a distinct slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }

    /// Copies `out.len()` bytes out from `offset` (panics when out of range).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|e| e <= self.len), "out of range");
        // SAFETY: range checked against the mapping; the destination is a distinct slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }
}

impl Drop for SealedMemfd {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
