//! Wire types of kvfs: every message that crosses a process boundary is defined here, and
//! nothing outside this crate derives serialization for the wire.
//!
//! Two encodings are used, each where it pays:
//! - control messages (handshakes, master RPC) are `postcard` bodies inside length-prefixed
//!   frames ([`frame`]); they are small and their shape evolves, so a schema'd encoding with a
//!   version field in every handshake is worth its few hundred nanoseconds;
//! - the Transfer Engine's data headers ([`transfer::DataHeader`], [`transfer::DataReply`]) are
//!   fixed-size little-endian records, because they sit in front of every slice of bulk data
//!   and must be decodable without allocation.
//!
//! Every decoder validates lengths and magic numbers and returns an error rather than
//! panicking: bytes from the network are never trusted.
#![forbid(unsafe_code)]

pub mod auth;
pub mod frame;
pub mod plain;
pub mod sock;
pub mod store;
pub mod transfer;

pub use frame::{
    FrameError, decode_body, encode_frame, read_frame, read_msg, write_frame, write_msg,
};
