//! Subcommands other than benchmarks: cluster daemons and object commands.

pub mod cluster;
pub mod conductor;
pub mod mooncake_flags;
pub mod mount;
pub mod objects;
pub mod pg;
pub mod reshard;
