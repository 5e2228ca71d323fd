//! Oracle data for tests and benchmarks: a fragment filled with each element's global linear
//! index (little-endian, truncated to the itemsize), computed independently of the planner.

use crate::placement::{Fragment, TensorDesc};

/// The bytes `frag` of `desc` holds when every element is its global linear index.
pub fn linear_fragment(desc: &TensorDesc, frag: &Fragment) -> Vec<u8> {
    let item = desc.itemsize as usize;
    let n = desc.shape.len();
    let mut out = Vec::with_capacity(frag.elements() as usize * item);
    let mut idx = vec![0u64; n];
    if frag.elements() == 0 {
        return out;
    }
    loop {
        let mut lin = 0u64;
        for (d, x) in idx.iter().enumerate() {
            lin = lin * desc.shape[d] + frag.offset[d] + x;
        }
        out.extend_from_slice(&lin.to_le_bytes()[..item]);
        let mut d = n;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < frag.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}
