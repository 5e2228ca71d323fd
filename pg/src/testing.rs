//! Seeded data for multi-process tests and benchmarks: every process derives the same bytes
//! for a (seed, slot, dtype, count), so a test can compute the expected result on its own.

use half::{bf16, f16};

use crate::DType;

/// A splitmix64 stream.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// `count` elements of `dt` for `slot` under `seed`, little-endian. Floats are small signed
/// values with fractional parts (so sums and products stay finite and order matters).
pub fn data(seed: u64, slot: u32, dt: DType, count: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (slot as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut out = Vec::with_capacity(count * dt.size());
    for _ in 0..count {
        let r = rng.next_u64();
        let f = ((r % 2001) as f64 - 1000.0) / 64.0;
        match dt {
            DType::F32 => out.extend_from_slice(&(f as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(f / 3.0).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(f / 8.0).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(f).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(r as i32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(r as i64).to_le_bytes()),
            DType::U8 => out.push(r as u8),
        }
    }
    out
}
