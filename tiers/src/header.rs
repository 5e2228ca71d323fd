//! The object header: one self-describing record per stored object, so that a directory or a
//! bucket alone is enough to rebuild the index (key, size, checksum, persistence, the master's
//! version and pin) after a restart. On object storage it precedes the data in the same object
//! (unpadded); on NVMe it is a sidecar file that names the data file by its generation, so the
//! data file holds the object's bytes from offset 0 (see [`crate::nvme`]).
//!
//! Layout, little-endian, offsets in bytes:
//!
//! | off | len | field |
//! |----:|----:|-------|
//! | 0   | 8   | magic `KVFSOBJ1` |
//! | 8   | 2   | version (2) |
//! | 10  | 1   | persistence (0 none, 1 lazy, 2 eager) |
//! | 11  | 1   | pin code (opaque here: the store's 0 none, 1 soft, 2 hard) |
//! | 12  | 4   | header_bytes: length of the whole header, data starts there |
//! | 16  | 4   | key_bytes |
//! | 20  | 4   | reserved, 0 |
//! | 24  | 8   | size of the data in bytes |
//! | 32  | 8   | stored_at_unix_ms |
//! | 40  | 8   | object version (the master's; opaque here, 0 when none) |
//! | 48  | 8   | generation: names the NVMe data file (0 on object storage) |
//! | 56  | 32  | blake3 of the data |
//! | 88  | 32  | blake3 of the header_bytes with this field zeroed |
//! | 120 | key_bytes | the key, UTF-8 |
//! | ... | | zero padding up to header_bytes |
//!
//! Invariants: a header decodes only if magic, version, lengths and its own checksum agree;
//! anything else is `Corrupt` (never a panic, never an out-of-bounds slice).
//!
//! Not handled: format migration (version 2 is the only one; version 1 had no version, pin or
//! generation fields and is refused).

use crate::error::{Error, ErrorKind, Result};
use crate::medium::{KEY_BYTES_MAX, ObjectMeta, Persistence, usize_from};

pub const MAGIC: &[u8; 8] = b"KVFSOBJ1";
pub const VERSION: u16 = 2;
/// Bytes of the fixed part before the key.
pub const FIXED_BYTES: usize = 120;
/// The largest header any valid object can have (4096-byte key, 4 KiB alignment).
pub const HEADER_BYTES_MAX: usize = 8192;
const DATA_SUM_AT: usize = 56;
const HEADER_SUM_AT: usize = 88;

/// A decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub key: String,
    pub meta: ObjectMeta,
    /// Where the data starts.
    pub header_bytes: usize,
    /// Generation of the NVMe data file (0 elsewhere).
    pub generation: u64,
}

/// Round `v` up to a multiple of `align` (a power of two or 1).
pub fn round_up(v: usize, align: usize) -> usize {
    v.div_ceil(align) * align
}

/// Encode a header padded to a multiple of `align_bytes` (1 for none, 4096 for O_DIRECT).
pub fn encode(key: &str, meta: &ObjectMeta, generation: u64, align_bytes: usize) -> Vec<u8> {
    let header_bytes = round_up(FIXED_BYTES + key.len(), align_bytes.max(1));
    let mut h = vec![0u8; header_bytes];
    h[0..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[10] = meta.persistence.to_u8();
    h[11] = meta.pin;
    h[12..16].copy_from_slice(&(header_bytes as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(key.len() as u32).to_le_bytes());
    h[24..32].copy_from_slice(&meta.size_bytes.to_le_bytes());
    h[32..40].copy_from_slice(&meta.stored_at_unix_ms.to_le_bytes());
    h[40..48].copy_from_slice(&meta.version.to_le_bytes());
    h[48..56].copy_from_slice(&generation.to_le_bytes());
    h[DATA_SUM_AT..DATA_SUM_AT + 32].copy_from_slice(&meta.checksum);
    h[FIXED_BYTES..FIXED_BYTES + key.len()].copy_from_slice(key.as_bytes());
    let sum = blake3::hash(&h);
    h[HEADER_SUM_AT..HEADER_SUM_AT + 32].copy_from_slice(sum.as_bytes());
    h
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn corrupt(what: &str) -> Error {
    Error::new(ErrorKind::Corrupt, format!("object header: {what}"))
}

/// From the first bytes of an object, the full header length (to read the rest if needed).
pub fn header_len(prefix: &[u8]) -> Result<usize> {
    if prefix.len() < FIXED_BYTES {
        return Err(corrupt(&format!("only {} bytes, need {FIXED_BYTES}", prefix.len())));
    }
    if &prefix[0..8] != MAGIC {
        return Err(corrupt("bad magic"));
    }
    let version = u16::from_le_bytes([prefix[8], prefix[9]]);
    if version != VERSION {
        return Err(corrupt(&format!("unsupported version {version}")));
    }
    let header_bytes = u32_at(prefix, 12) as usize;
    let key_bytes = u32_at(prefix, 16) as usize;
    if key_bytes == 0 || key_bytes > KEY_BYTES_MAX {
        return Err(corrupt(&format!("key length {key_bytes} out of range")));
    }
    if header_bytes < FIXED_BYTES + key_bytes || header_bytes > HEADER_BYTES_MAX {
        return Err(corrupt(&format!("header length {header_bytes} out of range")));
    }
    Ok(header_bytes)
}

/// Decode and verify a header; `buf` must hold at least the whole header.
pub fn decode(buf: &[u8]) -> Result<Header> {
    let header_bytes = header_len(buf)?;
    if buf.len() < header_bytes {
        return Err(corrupt(&format!("truncated: {} of {header_bytes} bytes", buf.len())));
    }
    let h = &buf[..header_bytes];
    let mut zeroed = h.to_vec();
    zeroed[HEADER_SUM_AT..HEADER_SUM_AT + 32].fill(0);
    if blake3::hash(&zeroed).as_bytes() != &h[HEADER_SUM_AT..HEADER_SUM_AT + 32] {
        return Err(corrupt("header checksum mismatch"));
    }
    let key_bytes = u32_at(h, 16) as usize;
    let key = std::str::from_utf8(&h[FIXED_BYTES..FIXED_BYTES + key_bytes])
        .map_err(|_| corrupt("key is not UTF-8"))?
        .to_owned();
    let size_bytes = u64_at(h, 24);
    usize_from(size_bytes)?;
    let mut checksum = [0u8; 32];
    checksum.copy_from_slice(&h[DATA_SUM_AT..DATA_SUM_AT + 32]);
    let meta = ObjectMeta {
        size_bytes,
        checksum,
        persistence: Persistence::from_u8(h[10])?,
        stored_at_unix_ms: u64_at(h, 32),
        version: u64_at(h, 40),
        pin: h[11],
    };
    Ok(Header { key, meta, header_bytes, generation: u64_at(h, 48) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(size: u64) -> ObjectMeta {
        ObjectMeta {
            size_bytes: size,
            checksum: [7; 32],
            persistence: Persistence::Lazy,
            stored_at_unix_ms: 1234,
            version: 77 << 20,
            pin: 2,
        }
    }

    #[test]
    fn long_keys_take_two_pages() {
        assert_eq!(encode("k", &meta(1), 0, 4096).len(), 4096);
        assert_eq!(encode(&"k".repeat(3976), &meta(1), 0, 4096).len(), 4096);
        assert_eq!(encode(&"k".repeat(3977), &meta(1), 0, 4096).len(), 8192);
        assert_eq!(encode(&"k".repeat(4096), &meta(1), 0, 4096).len(), 8192);
        assert_eq!(encode("abc", &meta(1), 0, 1).len(), FIXED_BYTES + 3);
    }

    #[test]
    fn every_single_byte_flip_is_caught() {
        let h = encode("model/r0/abc", &meta(99), 5, 1);
        for i in 0..h.len() {
            let mut bad = h.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad).is_err(), "flip at {i} decoded");
        }
        assert!(decode(&h[..h.len() - 1]).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(key in "\\PC{1,300}", size in any::<u32>(), generation in any::<u64>(), align in prop::sample::select(vec![1usize, 4096])) {
            let m = meta(size as u64);
            let h = encode(&key, &m, generation, align);
            let d = decode(&h).unwrap();
            prop_assert_eq!(d.key, key);
            prop_assert_eq!(d.meta, m);
            prop_assert_eq!(d.header_bytes, h.len());
            prop_assert_eq!(d.generation, generation);
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }
    }
}
