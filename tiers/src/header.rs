//! The object header: one self-describing record per stored object, so that a directory or a
//! bucket alone is enough to rebuild the index (key, size, checksum, persistence, the master's
//! version and pin, and the name the object had before a rename) after a restart. On object
//! storage it precedes the data in the same object (unpadded); on NVMe it is a sidecar file that
//! names the data file by its generation, so the data file holds the object's bytes from offset
//! 0 (see [`crate::nvme`]).
//!
//! Layout, little-endian, offsets in bytes:
//!
//! | off | len | field |
//! |----:|----:|-------|
//! | 0   | 8   | magic `KVFSOBJ1` |
//! | 8   | 2   | version (3; 2 is still read) |
//! | 10  | 1   | persistence (0 none, 1 lazy, 2 eager) |
//! | 11  | 1   | pin code (opaque here: the store's 0 none, 1 soft, 2 hard) |
//! | 12  | 4   | header_bytes: length of the whole header, data starts there |
//! | 16  | 4   | key_bytes |
//! | 20  | 4   | previous_key_bytes: 0 when the copy was never renamed (reserved, 0, in version 2) |
//! | 24  | 8   | size of the data in bytes |
//! | 32  | 8   | stored_at_unix_ms |
//! | 40  | 8   | object version (the master's; opaque here, 0 when none) |
//! | 48  | 8   | generation: names the NVMe data file (0 on object storage) |
//! | 56  | 32  | blake3 of the data |
//! | 88  | 32  | blake3 of the header_bytes with this field zeroed |
//! | 120 | key_bytes | the key, UTF-8 |
//! | ... | 8   | version 3 with a previous name only: the previous name's object version |
//! | ... | previous_key_bytes | version 3 with a previous name only: the previous key, UTF-8 |
//! | ... | | zero padding up to header_bytes |
//!
//! The previous name is what makes a rename crash-safe on media that cannot rename atomically:
//! a renamed copy `to@v2` says it used to be `(from, v1)`, so whoever finds both copies after a
//! crash drops `from@v1` (see [`crate::medium::stale_after_rename`]).
//!
//! Invariants: a header decodes only if magic, version, lengths and its own checksum agree;
//! anything else is `Corrupt` (never a panic, never an out-of-bounds slice). Version 2 headers
//! decode with no previous name; new headers are always written as version 3.
//!
//! Not handled: version 1 (no version, pin or generation fields) is refused; headers are never
//! rewritten in place to the new version (a copy gets a version 3 header when it is next
//! written or renamed).

use crate::error::{Error, ErrorKind, Result};
use crate::medium::{KEY_BYTES_MAX, ObjectMeta, Persistence, usize_from};

pub const MAGIC: &[u8; 8] = b"KVFSOBJ1";
pub const VERSION: u16 = 3;
/// The older version still decoded (it has no previous name).
pub const VERSION_2: u16 = 2;
/// Bytes of the fixed part before the key.
pub const FIXED_BYTES: usize = 120;
/// The largest header any valid object can have (a 4096-byte key and a 4096-byte previous key,
/// 4 KiB alignment).
pub const HEADER_BYTES_MAX: usize = 12288;
/// Bytes of the previous name's version field.
const PREVIOUS_VERSION_BYTES: usize = 8;
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
    /// The key and object version this copy had before a rename (`None` when never renamed).
    pub previous: Option<(String, u64)>,
}

/// Round `v` up to a multiple of `align` (a power of two or 1).
pub fn round_up(v: usize, align: usize) -> usize {
    v.div_ceil(align) * align
}

/// Length of the header of `key` (with `previous_key`, if any) before padding.
pub fn unpadded_len(key: &str, previous_key: Option<&str>) -> usize {
    FIXED_BYTES + key.len() + previous_key.map_or(0, |p| PREVIOUS_VERSION_BYTES + p.len())
}

/// Encode a header padded to a multiple of `align_bytes` (1 for none, 4096 for O_DIRECT).
/// `previous` is the name and version the copy had before a rename.
pub fn encode(
    key: &str,
    meta: &ObjectMeta,
    generation: u64,
    previous: Option<(&str, u64)>,
    align_bytes: usize,
) -> Vec<u8> {
    let header_bytes = round_up(unpadded_len(key, previous.map(|(k, _)| k)), align_bytes.max(1));
    let mut h = vec![0u8; header_bytes];
    h[0..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[10] = meta.persistence.to_u8();
    h[11] = meta.pin;
    h[12..16].copy_from_slice(&(header_bytes as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(key.len() as u32).to_le_bytes());
    if let Some((pk, _)) = previous {
        h[20..24].copy_from_slice(&(pk.len() as u32).to_le_bytes());
    }
    h[24..32].copy_from_slice(&meta.size_bytes.to_le_bytes());
    h[32..40].copy_from_slice(&meta.stored_at_unix_ms.to_le_bytes());
    h[40..48].copy_from_slice(&meta.version.to_le_bytes());
    h[48..56].copy_from_slice(&generation.to_le_bytes());
    h[DATA_SUM_AT..DATA_SUM_AT + 32].copy_from_slice(&meta.checksum);
    h[FIXED_BYTES..FIXED_BYTES + key.len()].copy_from_slice(key.as_bytes());
    if let Some((pk, pv)) = previous {
        let at = FIXED_BYTES + key.len();
        h[at..at + PREVIOUS_VERSION_BYTES].copy_from_slice(&pv.to_le_bytes());
        let at = at + PREVIOUS_VERSION_BYTES;
        h[at..at + pk.len()].copy_from_slice(pk.as_bytes());
    }
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
    let header_bytes = u32_at(prefix, 12) as usize;
    let key_bytes = u32_at(prefix, 16) as usize;
    if key_bytes == 0 || key_bytes > KEY_BYTES_MAX {
        return Err(corrupt(&format!("key length {key_bytes} out of range")));
    }
    let previous_key_bytes = previous_key_bytes(prefix)?;
    if previous_key_bytes > KEY_BYTES_MAX {
        return Err(corrupt(&format!("previous key length {previous_key_bytes} out of range")));
    }
    let previous_bytes =
        if previous_key_bytes > 0 { PREVIOUS_VERSION_BYTES + previous_key_bytes } else { 0 };
    if header_bytes < FIXED_BYTES + key_bytes + previous_bytes || header_bytes > HEADER_BYTES_MAX {
        return Err(corrupt(&format!("header length {header_bytes} out of range")));
    }
    Ok(header_bytes)
}

/// The previous key's length of a header whose fixed part is in `prefix` (0 for version 2).
fn previous_key_bytes(prefix: &[u8]) -> Result<usize> {
    match u16::from_le_bytes([prefix[8], prefix[9]]) {
        VERSION => Ok(u32_at(prefix, 20) as usize),
        VERSION_2 => Ok(0),
        version => Err(corrupt(&format!("unsupported version {version}"))),
    }
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
    // header_len checked that the previous name fits inside header_bytes.
    let previous = match previous_key_bytes(h)? {
        0 => None,
        n => {
            let at = FIXED_BYTES + key_bytes;
            let version = u64_at(h, at);
            let at = at + PREVIOUS_VERSION_BYTES;
            let pk = std::str::from_utf8(&h[at..at + n])
                .map_err(|_| corrupt("previous key is not UTF-8"))?;
            Some((pk.to_owned(), version))
        }
    };
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
    Ok(Header { key, meta, header_bytes, generation: u64_at(h, 48), previous })
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

    /// A version 2 header as the previous format wrote it: a version 3 header without a
    /// previous name differs only in the version field (and so the checksum).
    fn encode_v2(key: &str, m: &ObjectMeta, generation: u64, align: usize) -> Vec<u8> {
        let mut h = encode(key, m, generation, None, align);
        h[8..10].copy_from_slice(&VERSION_2.to_le_bytes());
        reseal(&mut h);
        h
    }

    /// Recompute the header checksum after an edit, so decode checks what lies behind it.
    fn reseal(h: &mut [u8]) {
        h[HEADER_SUM_AT..HEADER_SUM_AT + 32].fill(0);
        let sum = blake3::hash(h);
        h[HEADER_SUM_AT..HEADER_SUM_AT + 32].copy_from_slice(sum.as_bytes());
    }

    #[test]
    fn long_keys_take_two_pages() {
        assert_eq!(encode("k", &meta(1), 0, None, 4096).len(), 4096);
        assert_eq!(encode(&"k".repeat(3976), &meta(1), 0, None, 4096).len(), 4096);
        assert_eq!(encode(&"k".repeat(3977), &meta(1), 0, None, 4096).len(), 8192);
        assert_eq!(encode(&"k".repeat(4096), &meta(1), 0, None, 4096).len(), 8192);
        assert_eq!(encode("abc", &meta(1), 0, None, 1).len(), FIXED_BYTES + 3);
        assert_eq!(encode("abc", &meta(1), 0, Some(("xy", 4)), 1).len(), FIXED_BYTES + 3 + 8 + 2);
        let longest = "k".repeat(KEY_BYTES_MAX);
        let h = encode(&longest, &meta(1), 0, Some((&longest, 9)), 4096);
        assert_eq!(h.len(), HEADER_BYTES_MAX);
        assert_eq!(decode(&h).unwrap().previous, Some((longest, 9)));
    }

    #[test]
    fn version_2_headers_still_decode_without_a_previous_name() {
        let h = encode_v2("model/r0/abc", &meta(99), 5, 1);
        assert_eq!(u16::from_le_bytes([h[8], h[9]]), 2);
        let d = decode(&h).unwrap();
        assert_eq!(
            (d.key.as_str(), d.meta, d.generation, d.previous),
            ("model/r0/abc", meta(99), 5, None)
        );
        // Version 2 had the previous-key field reserved: a value there means nothing.
        let mut odd = h.clone();
        odd[20] = 7;
        reseal(&mut odd);
        assert_eq!(decode(&odd).unwrap().previous, None);
        // Version 1 and unknown versions are refused.
        for v in [1u16, 4, 0xffff] {
            let mut bad = h.clone();
            bad[8..10].copy_from_slice(&v.to_le_bytes());
            reseal(&mut bad);
            assert_eq!(decode(&bad).unwrap_err().kind(), ErrorKind::Corrupt, "version {v}");
        }
    }

    #[test]
    fn previous_names_that_do_not_fit_are_refused() {
        let mut h = encode("abc", &meta(1), 0, Some(("prev", 3)), 1);
        for (n, ok) in [(4u32, true), (5, false), (0, true), (KEY_BYTES_MAX as u32 + 1, false)] {
            h[20..24].copy_from_slice(&n.to_le_bytes());
            reseal(&mut h);
            assert_eq!(decode(&h).is_ok(), ok, "previous_key_bytes {n}");
        }
        let mut h = encode("abc", &meta(1), 0, Some(("\u{e9}", 3)), 1);
        let last = h.len() - 1;
        h[last] = 0xff; // the second byte of the previous key: no longer UTF-8
        reseal(&mut h);
        assert_eq!(decode(&h).unwrap_err().kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn every_single_byte_flip_is_caught() {
        for previous in [None, Some(("model/r0/old", 41))] {
            let h = encode("model/r0/abc", &meta(99), 5, previous, 1);
            for i in 0..h.len() {
                let mut bad = h.clone();
                bad[i] ^= 0x40;
                assert!(decode(&bad).is_err(), "flip at {i} decoded ({previous:?})");
            }
            assert!(decode(&h[..h.len() - 1]).is_err());
        }
        let h = encode_v2("model/r0/abc", &meta(99), 5, 1);
        for i in 0..h.len() {
            let mut bad = h.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad).is_err(), "v2 flip at {i} decoded");
        }
    }

    proptest! {
        #[test]
        fn round_trip(
            key in "\\PC{1,300}",
            previous in prop::option::of(("\\PC{1,300}", any::<u64>())),
            size in any::<u32>(),
            generation in any::<u64>(),
            align in prop::sample::select(vec![1usize, 4096]),
        ) {
            let m = meta(size as u64);
            let h = encode(&key, &m, generation, previous.as_ref().map(|(k, v)| (k.as_str(), *v)), align);
            let d = decode(&h).unwrap();
            prop_assert_eq!(d.key, key);
            prop_assert_eq!(d.meta, m);
            prop_assert_eq!(d.header_bytes, h.len());
            prop_assert_eq!(d.generation, generation);
            prop_assert_eq!(d.previous, previous);
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        /// Edits behind a valid checksum reach every length check: none may panic, and a
        /// header that still decodes keeps its key and previous name inside its header_bytes.
        #[test]
        fn resealed_edits_never_panic(
            key in "\\PC{1,40}",
            previous in prop::option::of("\\PC{1,40}"),
            edits in prop::collection::vec((0usize..256, any::<u8>()), 1..8),
            v2 in any::<bool>(),
        ) {
            let m = meta(10);
            let mut h = if v2 {
                encode_v2(&key, &m, 1, 1)
            } else {
                encode(&key, &m, 1, previous.as_deref().map(|p| (p, 3)), 1)
            };
            for (at, b) in edits {
                let at = at % h.len();
                if !(HEADER_SUM_AT..HEADER_SUM_AT + 32).contains(&at) {
                    h[at] = b;
                }
            }
            reseal(&mut h);
            if let Ok(d) = decode(&h) {
                let prev_len = d.previous.as_ref().map_or(0, |(p, _)| 8 + p.len());
                prop_assert!(FIXED_BYTES + d.key.len() + prev_len <= d.header_bytes);
                prop_assert!(d.header_bytes <= h.len());
            }
        }
    }
}
