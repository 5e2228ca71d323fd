//! `kvfs bench ...`: load generators that print figures as ratios of the machine's own limits
//! measured in the same run.

pub mod conductor;
pub mod ep;
pub mod failover;
pub mod fs;
pub mod hbm;
pub mod limits;
pub mod pg;
pub mod replay;
pub mod report;
pub mod reshard;
pub mod store;
pub mod tiers;
pub mod trace;
pub mod transfer;
