//! `kvfs-rdma`: a small, safe RDMA verbs layer for the kvfs Transfer Engine's `rdma` transport.
//!
//! Mechanism: one [`RdmaContext`] per NIC port (device, port, GID, one protection domain);
//! buffers registered once as [`MemoryRegion`]s; one [`Endpoint`] (an RC queue pair with its own
//! completion queue) per peer. Peers swap [`EndpointInfo`] bytes and their regions'
//! `(addr, len, rkey)` ([`RemoteRegion`]) over the engine's TCP handshake, `connect`, then post
//! one-sided READs and WRITEs ([`Op`]) and `poll` their [`Completion`]s with a timeout.
//!
//! ```text
//! engine A                                    engine B
//! ctx = RdmaContext::open(None)?              ctx = RdmaContext::open(None)?
//! mr  = unsafe { ctx.register(p, n) }?        mr  = unsafe { ctx.register(p, n) }?
//! ep  = Endpoint::new(&ctx, &opts)?           ep  = Endpoint::new(&ctx, &opts)?
//!        ---- ep.local_info().to_bytes(), mr.remote() over TCP ---->
//!        <--- ep.local_info().to_bytes(), mr.remote() over TCP -----
//! ep.connect(&EndpointInfo::from_bytes(b)?)?  ep.connect(&EndpointInfo::from_bytes(b)?)?
//! ep.submit(&[Op { .. }])?; ep.poll(timeout)?
//! ```
//!
//! The binding is `sideway`, which loads rdma-core (`libibverbs.so.1`) at run time: a binary
//! built with this crate starts on machines without rdma-core, and [`RdmaContext::open`] returns
//! `Ok(None)` there with the reason logged.
//!
//! Invariants that hold across modules: every wait has a deadline; a failed op breaks its
//! endpoint and is reported, never retried silently; all `unsafe` is in memory registration
//! (the caller's promise about buffer lifetime) and in `ffi.rs`.
//!
//! Not handled: SEND/RECV, atomics, rdma_cm, ODP, GPU memory, multi-port striping (the engine
//! opens one context per NIC and spreads its endpoints).

mod context;
mod endpoint;
mod error;
mod ffi;
mod info;
mod mr;
mod op;

pub use context::{
    ContextOptions, DeviceLimits, Opened, RdmaContext, Unavailable, UnavailableCause,
};
pub use endpoint::{Endpoint, EndpointOptions, EndpointState};
pub use error::{Error, ErrorKind, Result, WcStatus};
pub use info::{ENDPOINT_INFO_LEN, EndpointInfo, LinkLayer, PathMtu};
pub use mr::{LocalSlice, MemoryRegion, RemoteAddr, RemoteRegion};
pub use op::{Completion, Op, OpKind, WindowStats};
