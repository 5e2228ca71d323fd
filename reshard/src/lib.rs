//! kvfs-reshard: moving model weights between parallel placements.
//!
//! - `placement`: tensors, fragments and placements (TP/EP splits, PP ownership, DP and
//!   unsplit-axis replicas), validated closed; built from a `Parallel` layout or listed.
//! - `plan`: the planner, source placement -> target placement, as strided byte regions
//!   within limits.
//! - `exec`: holders of registered buffers with generations, bindings, and the executor that
//!   runs a bound plan as Transfer Engine reads and commits it over a kvfs-pg group.
//! - `pool`: weights stored once in the kvfs pool and loaded into any placement.
//! - `rank`: one participant of a multi-process reshard (tests and `kvfs bench reshard`).

#![forbid(unsafe_code)]

mod error;
pub mod exec;
pub mod placement;
pub mod plan;
pub mod pool;
pub mod rank;
pub mod testing;

pub use error::{Error, ErrorKind, Result};
pub use exec::{Binding, BoundPlan, Holder, Report, State, commit, execute};
pub use placement::{
    DIMS_MAX, Fragment, ModelSpec, Parallel, Placement, Rule, TensorDesc, TensorPlacement,
    TensorSpec,
};
pub use plan::{Limits, Plan, Region, plan};
