//! kvfs-fs-abi: the fast-path ABI between inference engines and the kvfs mount daemon.
//!
//! This crate mirrors `include/kvfs.h` field for field (a test compiles the header with gcc
//! and compares every size, offset and ioctl number). It has no dependency on the daemon: an
//! engine links it (or includes the header) and talks to `<mountpoint>/.kvfs/control`.
//!
//! Mechanism. FUSE hands ioctls on regular files to the daemon in *restricted* mode: the
//! command's direction and size field (at most 16383 bytes) say how much the kernel copies in
//! and out. So the ioctl carries fixed-size descriptors and never object bytes:
//! - [`Register`]: the caller names a sealed memfd in its own fd table; the daemon takes its
//!   own reference (so only a process that holds the descriptor can register it), maps it and
//!   returns a buffer id that only the registering process may use;
//! - [`Submit`]: the doorbell for a batch of [`Item`]s laid out in the registered buffer; the
//!   daemon copies the items out before validating them (the caller may scribble on shared
//!   memory concurrently), moves bytes straight between the pool and the buffer, and writes
//!   each item's status and size back;
//! - [`Info`]: the daemon's ABI version and limits.
//!
//! Structures are encoded field by field in native byte order ([`Register::to_bytes`],
//! [`Item::from_bytes`], ...), so neither side needs `unsafe` to read them. [`sys`] wraps the
//! ioctls themselves for Rust callers.
//!
//! Versioning: every request carries `abi_version`; a daemon answers a version it does not
//! speak with `EPROTO`. New fields only ever take `reserved` space (which must be 0 today),
//! and a new layout is a new version.

pub mod sys;

/// The ABI version this crate speaks.
pub const ABI_VERSION: u32 = 1;
/// The ioctl type byte.
pub const IOC_MAGIC: u8 = b'K';
/// The control file, relative to the mount point.
pub const CONTROL_PATH: &str = ".kvfs/control";

pub const OP_GET: u32 = 1;
pub const OP_PUT: u32 = 2;

/// Largest argument a restricted FUSE ioctl carries (the 14-bit size field).
pub const IOCTL_ARG_BYTES_MAX: usize = (1 << 14) - 1;

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// Linux `_IOC(dir, type, nr, size)`.
pub const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((ty as u32) << 8) | nr as u32
}

pub const IOC_INFO: u32 = ioc(IOC_READ, IOC_MAGIC, 0x00, Info::SIZE);
pub const IOC_REGISTER: u32 = ioc(IOC_READ | IOC_WRITE, IOC_MAGIC, 0x01, Register::SIZE);
pub const IOC_UNREGISTER: u32 = ioc(IOC_WRITE, IOC_MAGIC, 0x02, Unregister::SIZE);
pub const IOC_SUBMIT: u32 = ioc(IOC_READ | IOC_WRITE, IOC_MAGIC, 0x03, Submit::SIZE);

/// Field-by-field codec in native byte order over a fixed-size byte array.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn u32(&mut self) -> u32 {
        let v = u32::from_ne_bytes(self.b[self.at..self.at + 4].try_into().unwrap_or([0; 4]));
        self.at += 4;
        v
    }
    fn i32(&mut self) -> i32 {
        self.u32() as i32
    }
    fn u64(&mut self) -> u64 {
        let v = u64::from_ne_bytes(self.b[self.at..self.at + 8].try_into().unwrap_or([0; 8]));
        self.at += 8;
        v
    }
}

struct Writer<'a> {
    b: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn u32(&mut self, v: u32) {
        self.b[self.at..self.at + 4].copy_from_slice(&v.to_ne_bytes());
        self.at += 4;
    }
    fn i32(&mut self, v: i32) {
        self.u32(v as u32)
    }
    fn u64(&mut self, v: u64) {
        self.b[self.at..self.at + 8].copy_from_slice(&v.to_ne_bytes());
        self.at += 8;
    }
}

macro_rules! codec {
    ($t:ident, $size:expr, [$($field:ident : $kind:ident),* $(,)?]) => {
        impl $t {
            /// Size of the C structure, in bytes.
            pub const SIZE: usize = $size;

            /// Decodes the structure from at least `SIZE` bytes; `None` when shorter.
            pub fn from_bytes(b: &[u8]) -> Option<$t> {
                if b.len() < Self::SIZE {
                    return None;
                }
                let mut r = Reader { b, at: 0 };
                let mut v = $t::default();
                $( codec!(@get r, v.$field, $kind); )*
                debug_assert_eq!(r.at, Self::SIZE);
                Some(v)
            }

            /// Encodes the structure as its C layout.
            pub fn to_bytes(&self) -> [u8; $size] {
                let mut b = [0u8; $size];
                let mut w = Writer { b: &mut b, at: 0 };
                $( codec!(@put w, self.$field, $kind); )*
                debug_assert_eq!(w.at, Self::SIZE);
                b
            }
        }
    };
    (@get $r:ident, $f:expr, u32) => { $f = $r.u32(); };
    (@get $r:ident, $f:expr, i32) => { $f = $r.i32(); };
    (@get $r:ident, $f:expr, u64) => { $f = $r.u64(); };
    (@get $r:ident, $f:expr, u64x2) => { $f = [$r.u64(), $r.u64()]; };
    (@get $r:ident, $f:expr, u64x4) => { $f = [$r.u64(), $r.u64(), $r.u64(), $r.u64()]; };
    (@put $w:ident, $f:expr, u32) => { $w.u32($f); };
    (@put $w:ident, $f:expr, i32) => { $w.i32($f); };
    (@put $w:ident, $f:expr, u64) => { $w.u64($f); };
    (@put $w:ident, $f:expr, u64x2) => { for x in $f { $w.u64(x); } };
    (@put $w:ident, $f:expr, u64x4) => { for x in $f { $w.u64(x); } };
}

/// `struct kvfs_info`: the daemon's version and limits (all out).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Info {
    pub abi_version: u32,
    pub batch_items_max: u32,
    pub key_bytes_max: u32,
    /// Buffers one process may have registered.
    pub buffers_max: u32,
    /// Largest buffer.
    pub buffer_bytes_max: u64,
    /// `sizeof(struct kvfs_item)`.
    pub item_size: u64,
    pub reserved: [u64; 4],
}
codec!(Info, 64, [abi_version: u32, batch_items_max: u32, key_bytes_max: u32, buffers_max: u32,
    buffer_bytes_max: u64, item_size: u64, reserved: u64x4]);

/// `struct kvfs_register`: register `[0, len)` of the caller's sealed memfd `fd`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Register {
    pub abi_version: u32,
    pub fd: i32,
    pub len: u64,
    /// Must be 0.
    pub flags: u64,
    /// Out: the buffer id.
    pub buffer_id: u64,
    /// Must be 0.
    pub reserved: [u64; 2],
}
codec!(Register, 48, [abi_version: u32, fd: i32, len: u64, flags: u64, buffer_id: u64,
    reserved: u64x2]);

/// `struct kvfs_unregister`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unregister {
    pub abi_version: u32,
    /// Must be 0.
    pub reserved: u32,
    pub buffer_id: u64,
}
codec!(Unregister, 16, [abi_version: u32, reserved: u32, buffer_id: u64]);

/// `struct kvfs_submit`: run `count` items laid out at `items_offset` in the buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Submit {
    pub abi_version: u32,
    /// [`OP_GET`] or [`OP_PUT`].
    pub op: u32,
    pub buffer_id: u64,
    /// Offset of the [`Item`] array; 8-byte aligned.
    pub items_offset: u64,
    pub count: u32,
    /// Must be 0.
    pub flags: u32,
    /// Out: items with status 0.
    pub ok: u32,
    /// Out: items with a negative status.
    pub failed: u32,
    /// Must be 0.
    pub reserved: [u64; 2],
}
codec!(Submit, 56, [abi_version: u32, op: u32, buffer_id: u64, items_offset: u64, count: u32,
    flags: u32, ok: u32, failed: u32, reserved: u64x2]);

/// `struct kvfs_item`: one get or put, in the registered buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Item {
    /// The key's UTF-8 bytes (no terminator) in the buffer.
    pub key_offset: u64,
    pub key_len: u32,
    /// Must be 0.
    pub flags: u32,
    pub data_offset: u64,
    /// Get: capacity; put: the object's size.
    pub data_len: u64,
    /// Out: get: the object's size (also with `-EOVERFLOW`); put: bytes stored.
    pub size: u64,
    /// Out: 0 or a negative errno.
    pub status: i32,
    /// Must be 0.
    pub reserved: u32,
}
codec!(Item, 48, [key_offset: u64, key_len: u32, flags: u32, data_offset: u64, data_len: u64,
    size: u64, status: i32, reserved: u32]);

impl Item {
    /// Offset of `size` within the item (the daemon writes `size` and `status` back).
    pub const SIZE_OFFSET: usize = 32;
    /// Offset of `status` within the item.
    pub const STATUS_OFFSET: usize = 40;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_round_trip_and_fit_a_restricted_ioctl() {
        let s = Submit {
            abi_version: ABI_VERSION,
            op: OP_PUT,
            buffer_id: 7,
            items_offset: 4096,
            count: 3,
            flags: 0,
            ok: 2,
            failed: 1,
            reserved: [0, 9],
        };
        assert_eq!(Submit::from_bytes(&s.to_bytes()), Some(s));
        let i = Item {
            key_offset: 1,
            key_len: 2,
            data_offset: 3,
            data_len: 4,
            size: 5,
            status: -2,
            ..Default::default()
        };
        let b = i.to_bytes();
        assert_eq!(Item::from_bytes(&b), Some(i));
        assert_eq!(i32::from_ne_bytes(b[Item::STATUS_OFFSET..][..4].try_into().unwrap()), -2);
        assert_eq!(u64::from_ne_bytes(b[Item::SIZE_OFFSET..][..8].try_into().unwrap()), 5);
        assert!(Register::from_bytes(&[0u8; 47]).is_none());
        for size in [Info::SIZE, Register::SIZE, Unregister::SIZE, Submit::SIZE] {
            assert!(size <= IOCTL_ARG_BYTES_MAX);
        }
        // The size field of each command is the structure's size.
        assert_eq!((IOC_SUBMIT >> 16) & 0x3fff, Submit::SIZE as u32);
        assert_eq!(IOC_SUBMIT >> 30, 3);
        assert_eq!(IOC_UNREGISTER >> 30, 1);
        assert_eq!(IOC_INFO >> 30, 2);
    }
}
