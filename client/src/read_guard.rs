//! The guard of a store read (see `kvfs_transfer::Engine::read_guarded`): the object's version
//! (u64, little endian) then its key. A node vouches for it while its index holds that version
//! of that key in DRAM around the range read.

use std::sync::Arc;

pub fn encode(key: &str, version: u64) -> Arc<[u8]> {
    let mut g = Vec::with_capacity(8 + key.len());
    g.extend_from_slice(&version.to_le_bytes());
    g.extend_from_slice(key.as_bytes());
    g.into()
}

pub fn decode(g: &[u8]) -> Option<(u64, &str)> {
    let (v, key) = g.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*v), std::str::from_utf8(key).ok()?))
}
