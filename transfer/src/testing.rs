//! Support for tests and benchmarks that run engines in separate processes: a deterministic,
//! position-addressable byte pattern, so that two processes can agree on what any range of a
//! buffer must hold without sending it.

/// The pattern byte at absolute position `pos` for `seed`.
fn word(seed: u64, index: u64) -> u64 {
    // splitmix64 of (seed, index): cheap and well mixed.
    let mut z = seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `dst` with the pattern of `seed` as it stands at absolute positions
/// `start..start+dst.len()`.
pub fn fill_pattern(dst: &mut [u8], seed: u64, start: u64) {
    let mut pos = start;
    let mut i = 0;
    while i < dst.len() {
        if pos.is_multiple_of(8) && dst.len() - i >= 8 {
            dst[i..i + 8].copy_from_slice(&word(seed, pos / 8).to_le_bytes());
            i += 8;
            pos += 8;
        } else {
            dst[i] = word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize];
            i += 1;
            pos += 1;
        }
    }
}

/// The pattern of `seed` at `start..start+len`.
pub fn pattern(seed: u64, start: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, seed, start);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_position_addressable() {
        let whole = pattern(7, 0, 100);
        assert_eq!(pattern(7, 13, 50), whole[13..63]);
        assert_ne!(pattern(8, 0, 100), whole);
    }
}
