//! kvfs-conductor: which instance holds which prefix of a prompt's KV cache, fed by the
//! engines' and the pool's KV events, and where to send a request.

mod ahead;
pub mod event;
pub mod hash;
pub mod index;
pub mod memo;
pub mod route;
pub mod service;
pub mod sim;
pub mod source;
mod token_array;
pub mod trace;
