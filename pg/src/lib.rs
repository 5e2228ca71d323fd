//! kvfs-pg: process groups on the Transfer Engine.
//!
//! A group is a set of processes addressed by stable *slots*: a failed slot leaves a hole
//! that is never renumbered, and a replacement process takes the same slot back. A
//! [`Coordinator`] decides the group's *view* (its active slots and an epoch); every
//! [`Group`] member runs collectives and point-to-point calls over the active slots of its
//! current view, with a deadline and a typed [`Error`] on every call.
//!
//! - `dtype`: element types and deterministic reductions.
//! - `wire`: the notifications members and the coordinator exchange.
//! - `coord`: the coordinator (a sans-IO `Membership` and its driver).
//! - `group`: a member: engine, staging, mailbox, reconciliation after failures.
//! - `ops`: the algorithms.

mod coord;
mod dtype;
mod error;
mod group;
mod ops;
pub mod testing;
mod wire;

pub use coord::{Coordinator, CoordinatorConfig, GROUP_SIZE_LIMIT, Membership};
pub use dtype::{DType, ReduceOp, reduce};
pub use error::{Error, ErrorKind, Result};
pub use group::{Counters, Group, PgConfig};
pub use wire::{MemberInfo, Resume, View};
