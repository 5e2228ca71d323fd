//! kvfs-master: the sans-IO core of the kvfs control plane.
//!
//! The master decides *where* objects go and never carries their bytes. This crate is its
//! state machine: the object [`Directory`] (two-phase puts, reads with leases, removal, pins,
//! eviction, placement, tiers, node membership and recovery from what nodes report) and the
//! per-segment offset [`Allocator`](alloc::Allocator).
//!
//! The [`service`] module puts that core on the network (RPC, timer, node connections, admin
//! HTTP); everything outside it is sans-IO. It is deliberately plain: no threads, no I/O, no clock (time comes in as `now_ms`), no
//! global randomness (a seeded RNG owned by the directory), no serialization derives (wire
//! types live in the proto crate). The RPC layer owns a `Directory`, feeds it requests and
//! timer ticks, and delivers the [`NodeEffect`]s it returns to nodes. The same seed and the
//! same calls give the same answers, which is what the simulation test relies on.

#![forbid(unsafe_code)]

pub mod alloc;
mod config;
mod directory;
mod error;
mod rng;
pub mod service;
mod slab;
mod types;

pub use config::Config;
pub use directory::{
    Directory, LoadPlan, PendingView, PersistedObject, PoolEvent, PoolEventKind, PoolEventStats,
    PoolMedium, Quota, ReportOutcome, TENANT_PREFIX, TenantUsage, tenant_of, valid_tenant,
};
pub use error::{Error, ErrorKind, Result};
pub use types::*;
