//! [`RdmaContext`]: one opened RDMA device port, its protection domain and its chosen GID.
//!
//! Mechanism: `sideway` (through `rdma-mummy-sys`) loads `libibverbs.so.1` with `dlopen` when
//! the process starts; the binary itself does not link rdma-core. Opening a context asks for the
//! device list, picks a device and an active port, picks a source GID, reads the device limits
//! and allocates one protection domain. Every memory region and endpoint made from the context
//! lives in that PD, so any registered buffer can be used on any of the context's endpoints.
//!
//! Policy, in order:
//! - rdma-core missing, kernel without RDMA support, no device, or no active port: not an error
//!   but [`Opened::Unavailable`] with a reason for the logs (the `kvfs` binary is built with RDMA
//!   and runs everywhere; it falls back to other transports).
//! - a device named in the options that does not exist while others do: [`ErrorKind::NotFound`]
//!   (a misconfiguration should be loud, not a silent fallback to TCP).
//! - port: the one in the options, else the first ACTIVE port.
//! - GID (RoCE): the index in the options, else an IPv4-mapped RoCE v2 GID (`::ffff:a.b.c.d`;
//!   on rxe over lo it is index 1, `::ffff:127.0.0.1`), else a global RoCE v2 IPv6 GID, else any
//!   RoCE v2 GID, else RoCE v1, else index 0. InfiniBand: index 0, and LIDs address the peer.
//!
//! Invariants: the context's device, PD and port never change; an `RdmaContext` is a cheap
//! clone of a shared handle and the device closes when the last clone, endpoint and memory
//! region are gone.
//!
//! Not handled: several ports or devices bonded into one context (open one context per NIC),
//! GID table changes after open (re-open), rdma_cm address resolution.

use std::fmt;
use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::error::{Error, ErrorKind, Result};
use crate::info::{LinkLayer, PathMtu};
use crate::mr::MemoryRegion;

const IBV_PORT_ACTIVE: u32 = 4;
const IBV_LINK_LAYER_INFINIBAND: u8 = 1;

/// How to open a context. `Default` picks everything automatically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextOptions {
    /// Device name (`mlx5_0`, `rxe0`); `None` takes the first device with an active port.
    pub device: Option<String>,
    /// Port number (from 1); `None` takes the first active port.
    pub port: Option<u8>,
    /// GID table index; `None` chooses one (see the module notes).
    pub gid_index: Option<u32>,
}

/// Why there is no RDMA on this machine. Not an error: callers log it and use another transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable {
    /// Which case.
    pub cause: UnavailableCause,
    /// A sentence for the logs.
    pub reason: String,
}

/// The cases of [`Unavailable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnavailableCause {
    /// `libibverbs.so.1` could not be loaded.
    LibraryMissing,
    /// rdma-core is there but the kernel has no RDMA (uverbs) support.
    NoKernelSupport,
    /// No RDMA device.
    NoDevice,
    /// Devices exist but no port is ACTIVE (or the chosen one is not).
    NoActivePort,
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The result of [`RdmaContext::open_with`].
#[derive(Debug)]
pub enum Opened {
    /// A usable context.
    Ready(RdmaContext),
    /// No RDMA here, and why.
    Unavailable(Unavailable),
}

/// Device limits that endpoint options are clamped to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest send queue (`max_qp_wr`).
    pub max_qp_wr: u32,
    /// Most RDMA READs a QP may have outstanding as initiator (`max_qp_init_rd_atom`).
    pub max_qp_init_rd_atom: u8,
    /// Most RDMA READs a QP serves at once as responder (`max_qp_rd_atom`).
    pub max_qp_rd_atom: u8,
    /// Largest completion queue (`max_cqe`).
    pub max_cqe: u32,
    /// Largest message (one work request) on the port (`max_msg_sz`).
    pub max_msg_bytes: u32,
    /// Largest memory registration (`max_mr_size`).
    pub max_mr_bytes: u64,
}

pub(crate) struct ContextInner {
    // Field order is drop order: the PD before the device context.
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) ctx: Arc<DeviceContext>,
    pub(crate) device: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
    pub(crate) gid: [u8; 16],
    pub(crate) lid: u16,
    pub(crate) link_layer: LinkLayer,
    pub(crate) active_mtu: PathMtu,
    pub(crate) limits: DeviceLimits,
}

/// An opened RDMA device port with its protection domain. Cheap to clone.
#[derive(Clone)]
pub struct RdmaContext {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for RdmaContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("RdmaContext")
            .field("device", &i.device)
            .field("port", &i.port)
            .field("gid_index", &i.gid_index)
            .field("gid", &std::net::Ipv6Addr::from(i.gid))
            .field("link_layer", &i.link_layer)
            .field("active_mtu", &i.active_mtu)
            .finish()
    }
}

impl RdmaContext {
    /// Opens `device` (or the first usable one) with automatic port and GID choice.
    /// `Ok(None)` when this machine has no usable RDMA; the reason is logged at info level (use
    /// [`RdmaContext::open_with`] to get it as a value).
    pub fn open(device: Option<&str>) -> Result<Option<RdmaContext>> {
        let opts = ContextOptions { device: device.map(str::to_owned), ..Default::default() };
        match RdmaContext::open_with(&opts)? {
            Opened::Ready(ctx) => Ok(Some(ctx)),
            Opened::Unavailable(why) => {
                tracing::info!(reason = %why.reason, "RDMA unavailable");
                Ok(None)
            }
        }
    }

    /// Opens a context as `opts` say.
    pub fn open_with(opts: &ContextOptions) -> Result<Opened> {
        let list = match DeviceList::new() {
            Ok(list) => list,
            Err(e) => return unavailable_or_error(e),
        };
        if list.is_empty() {
            return Ok(unavailable(UnavailableCause::NoDevice, "no RDMA device".into()));
        }
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        let candidates: Vec<usize> = match &opts.device {
            Some(want) => match names.iter().position(|n| n == want) {
                Some(i) => vec![i],
                None => {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        "open",
                        format!("RDMA device {want:?} not found; devices: {}", names.join(", ")),
                    ));
                }
            },
            None => (0..names.len()).collect(),
        };
        let mut why_not = Vec::new();
        for i in candidates {
            let Some(dev) = list.get(i) else { continue };
            let ctx = dev
                .open()
                .map_err(|e| Error::os("open", format!("device {}", names[i]), io_error(&e)))?;
            match open_port(ctx, &names[i], opts)? {
                Ok(inner) => return Ok(Opened::Ready(RdmaContext { inner: Arc::new(inner) })),
                Err(reason) => why_not.push(reason),
            }
        }
        Ok(unavailable(UnavailableCause::NoActivePort, why_not.join("; ")))
    }

    /// Device name, e.g. `rxe0`.
    pub fn device_name(&self) -> &str {
        &self.inner.device
    }

    /// Port number in use.
    pub fn port(&self) -> u8 {
        self.inner.port
    }

    /// Source GID index in use.
    pub fn gid_index(&self) -> u32 {
        self.inner.gid_index
    }

    /// Source GID in use.
    pub fn gid(&self) -> [u8; 16] {
        self.inner.gid
    }

    /// The port's link layer.
    pub fn link_layer(&self) -> LinkLayer {
        self.inner.link_layer
    }

    /// The port's active MTU.
    pub fn active_mtu(&self) -> PathMtu {
        self.inner.active_mtu
    }

    /// The device limits endpoint options are clamped to.
    pub fn limits(&self) -> DeviceLimits {
        self.inner.limits
    }

    /// Registers `len` bytes at `ptr` for local and remote READ and WRITE.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must be memory this process owns, allocated and not moved until the
    /// returned region drops, and the caller must not hold Rust references into bytes that an
    /// outstanding op (a local READ, or a peer's WRITE) may change: the device writes them
    /// without the compiler knowing.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<MemoryRegion> {
        if ptr.is_null() || len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "register",
                format!("{len} bytes at {ptr:p}"),
            ));
        }
        if len as u64 > self.inner.limits.max_mr_bytes {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "register",
                format!("{len} bytes > device max_mr_size {}", self.inner.limits.max_mr_bytes),
            ));
        }
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: the caller guarantees `ptr..ptr+len` is owned, live memory for the region's
        // lifetime (this function's contract); ibv_reg_mr only pins and maps it.
        let mr = unsafe { self.inner.pd.reg_mr(ptr as usize, len, access) }
            .map_err(|e| Error::os("register", format!("{len} bytes at {ptr:p}"), io_error(&e)))?;
        Ok(MemoryRegion::new(mr, ptr as u64, len))
    }
}

fn unavailable(cause: UnavailableCause, reason: String) -> Opened {
    Opened::Unavailable(Unavailable { cause, reason })
}

/// `ibv_get_device_list` failed: rdma-core missing (rdma-mummy-sys reports EOPNOTSUPP when it
/// could not dlopen libibverbs) or no kernel support (ENOSYS) are "unavailable"; the rest errors.
fn unavailable_or_error(e: sideway::ibverbs::device::GetDeviceListError) -> Result<Opened> {
    let io = io_error(&e);
    Ok(match io.raw_os_error() {
        Some(libc::EOPNOTSUPP) => unavailable(
            UnavailableCause::LibraryMissing,
            "rdma-core is not installed (libibverbs.so.1 could not be loaded)".into(),
        ),
        Some(libc::ENOSYS) => unavailable(
            UnavailableCause::NoKernelSupport,
            format!("the kernel has no RDMA support (ibv_get_device_list: {io})"),
        ),
        _ => return Err(Error::os("open", "ibv_get_device_list", io)),
    })
}

/// Digs the OS error out of one of sideway's error wrappers. Their `*ErrorKind` enums are
/// `#[error(transparent)]`, which hides the `io::Error` from `source()`, so the known kinds are
/// matched by type while walking the chain.
pub(crate) fn io_error(e: &(dyn std::error::Error + 'static)) -> std::io::Error {
    use sideway::ibverbs::completion::{
        CreateCompletionChannelErrorKind as Ch, CreateCompletionQueueErrorKind as Cq,
    };
    use sideway::ibverbs::device::{GetDeviceListErrorKind as List, OpenDeviceErrorKind as Open};
    use sideway::ibverbs::device_context::{
        AllocateProtectionDomainErrorKind as Pd, QueryDeviceErrorKind as Dev,
        QueryGidErrorKind as Gid, QueryGidTableErrorKind as Table, QueryPortErrorKind as Port,
    };
    use sideway::ibverbs::memory_region::RegisterMemoryRegionErrorKind as Mr;
    use sideway::ibverbs::queue_pair::{
        CreateQueuePairErrorKind as Qp, ModifyQueuePairErrorKind as Modify,
        QueryQueuePairErrorKind as Query,
    };
    fn copy(io: &std::io::Error) -> std::io::Error {
        match io.raw_os_error() {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(io.kind(), io.to_string()),
        }
    }
    macro_rules! try_kinds {
        ($err:expr; $($kind:ty => $variant:path),* $(,)?) => {$(
            if let Some($variant(io)) = $err.downcast_ref::<$kind>() {
                return copy(io);
            }
        )*};
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return copy(io);
        }
        try_kinds!(err;
            List => List::Ibverbs, Open => Open::Ibverbs, Dev => Dev::Ibverbs,
            Port => Port::Ibverbs, Gid => Gid::Ibverbs, Table => Table::Ibverbs,
            Pd => Pd::Ibverbs, Mr => Mr::Ibverbs, Ch => Ch::Ibverbs, Cq => Cq::Ibverbs,
            Qp => Qp::Ibverbs, Modify => Modify::Ibverbs, Query => Query::Ibverbs,
        );
        cur = err.source();
    }
    std::io::Error::other(e.to_string())
}

/// Picks port and GID on an opened device. `Ok(Err(reason))` when it has no usable port.
fn open_port(
    ctx: Arc<DeviceContext>,
    name: &str,
    opts: &ContextOptions,
) -> Result<Result<ContextInner, String>> {
    let dev = ctx.query_device().map_err(|e| Error::os("open", name.to_owned(), io_error(&e)))?;
    let ports = dev.phys_port_cnt();
    let port_numbers: Vec<u8> = match opts.port {
        Some(p) if p == 0 || p > ports => {
            return Err(Error::new(
                ErrorKind::NotFound,
                "open",
                format!("{name} has ports 1..={ports}, not {p}"),
            ));
        }
        Some(p) => vec![p],
        None => (1..=ports).collect(),
    };
    let mut active = None;
    for p in port_numbers {
        let attr = ctx
            .query_port(p)
            .map_err(|e| Error::os("open", format!("{name} port {p}"), io_error(&e)))?
            .attr;
        if attr.state == IBV_PORT_ACTIVE {
            active = Some((p, attr));
            break;
        }
    }
    let Some((port, attr)) = active else {
        return Ok(Err(format!("{name}: no ACTIVE port")));
    };
    let link_layer = if attr.link_layer == IBV_LINK_LAYER_INFINIBAND {
        LinkLayer::InfiniBand
    } else {
        LinkLayer::Ethernet
    };
    let Some(active_mtu) = PathMtu::from_code(attr.active_mtu) else {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "open",
            format!("{name} port {port}: active MTU code {}", attr.active_mtu),
        ));
    };
    let gid_index = match opts.gid_index {
        Some(i) => i,
        None if link_layer == LinkLayer::InfiniBand => 0,
        None => {
            let table = ctx
                .query_gid_table()
                .map_err(|e| Error::os("open", format!("{name} GID table"), io_error(&e)))?;
            let candidates: Vec<GidCandidate> = table
                .iter()
                .filter(|e| e.port_num() == port as u32)
                .map(|e| GidCandidate {
                    index: e.gid_index(),
                    gid: e.gid().raw,
                    roce_v2: e.gid_type() == GidType::RoceV2,
                })
                .collect();
            match choose_gid(&candidates) {
                Some(i) => i,
                None => return Ok(Err(format!("{name} port {port}: empty GID table"))),
            }
        }
    };
    let gid = ctx
        .query_gid(port, gid_index)
        .map_err(|e| Error::os("open", format!("{name} GID index {gid_index}"), io_error(&e)))?
        .raw;
    if gid == [0u8; 16] && link_layer == LinkLayer::Ethernet {
        return Err(Error::new(
            ErrorKind::NotFound,
            "open",
            format!("{name} port {port}: GID index {gid_index} is empty"),
        ));
    }
    let clamp_u8 = |v: i32| v.clamp(0, u8::MAX as i32) as u8;
    let limits = DeviceLimits {
        max_qp_wr: dev.max_qp_wr().max(0) as u32,
        max_qp_init_rd_atom: clamp_u8(dev.max_qp_init_rd_atom()),
        max_qp_rd_atom: clamp_u8(dev.max_qp_rd_atom()),
        max_cqe: dev.max_cqe().max(0) as u32,
        max_msg_bytes: attr.max_msg_sz,
        max_mr_bytes: dev.max_mr_size(),
    };
    let pd = ctx.alloc_pd().map_err(|e| Error::os("open", format!("{name} PD"), io_error(&e)))?;
    tracing::debug!(device = name, port, gid_index, ?link_layer, ?active_mtu, "RDMA context open");
    Ok(Ok(ContextInner {
        pd,
        ctx,
        device: name.to_owned(),
        port,
        gid_index,
        gid,
        lid: attr.lid,
        link_layer,
        active_mtu,
        limits,
    }))
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct GidCandidate {
    pub index: u32,
    pub gid: [u8; 16],
    pub roce_v2: bool,
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10] == [0; 10] && gid[10] == 0xff && gid[11] == 0xff
}

fn is_link_local(gid: &[u8; 16]) -> bool {
    gid[0] == 0xfe && gid[1] & 0xc0 == 0x80
}

/// The RoCE GID preference order of the module notes.
pub(crate) fn choose_gid(table: &[GidCandidate]) -> Option<u32> {
    let usable = || table.iter().filter(|c| c.gid != [0u8; 16]);
    let rank = |c: &GidCandidate| match (c.roce_v2, is_ipv4_mapped(&c.gid), is_link_local(&c.gid)) {
        (true, true, _) => 0,
        (true, false, false) => 1,
        (true, false, true) => 2,
        (false, _, _) => 3,
    };
    usable().min_by_key(|c| (rank(c), c.index)).map(|c| c.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }

    /// A real check of the no-device path: on a machine without RDMA devices (this project's
    /// build machines), opening reports why instead of failing.
    #[test]
    fn open_without_a_device_is_unavailable_with_a_reason() {
        let has_device = std::fs::read_dir("/sys/class/infiniband")
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        if has_device {
            eprintln!("this machine has RDMA devices; the no-device path cannot be checked");
            return;
        }
        match RdmaContext::open_with(&ContextOptions::default()).unwrap() {
            Opened::Ready(ctx) => panic!("opened {ctx:?} on a machine without devices"),
            Opened::Unavailable(why) => {
                assert!(!why.reason.is_empty());
                eprintln!("unavailable ({:?}): {}", why.cause, why.reason);
            }
        }
        assert!(RdmaContext::open(None).unwrap().is_none());
        // Naming a device does not turn "no RDMA here" into an error either.
        assert!(RdmaContext::open(Some("mlx5_0")).unwrap().is_none());
    }

    #[test]
    fn picks_the_ipv4_mapped_roce_v2_gid_of_rxe_on_lo() {
        // The table rxe0 shows over lo in the softroce guest.
        let table = [
            GidCandidate { index: 0, gid: gid("fe80::200:ff:fe00:0"), roce_v2: true },
            GidCandidate { index: 1, gid: gid("::ffff:127.0.0.1"), roce_v2: true },
            GidCandidate { index: 2, gid: gid("::1"), roce_v2: true },
        ];
        assert_eq!(choose_gid(&table), Some(1));
    }

    #[test]
    fn gid_preference_order() {
        let v1_v4 = GidCandidate { index: 0, gid: gid("::ffff:10.0.0.1"), roce_v2: false };
        let v2_ll = GidCandidate { index: 1, gid: gid("fe80::1"), roce_v2: true };
        let v2_v6 = GidCandidate { index: 2, gid: gid("2001:db8::1"), roce_v2: true };
        let v2_v4 = GidCandidate { index: 3, gid: gid("::ffff:10.0.0.1"), roce_v2: true };
        let empty = GidCandidate { index: 4, gid: [0; 16], roce_v2: true };
        assert_eq!(choose_gid(&[v1_v4, v2_ll, v2_v6, v2_v4, empty]), Some(3));
        assert_eq!(choose_gid(&[v1_v4, v2_ll, v2_v6]), Some(2));
        assert_eq!(choose_gid(&[v1_v4, v2_ll]), Some(1));
        assert_eq!(choose_gid(&[v1_v4]), Some(0));
        assert_eq!(choose_gid(&[empty]), None);
        assert_eq!(choose_gid(&[]), None);
    }
}
