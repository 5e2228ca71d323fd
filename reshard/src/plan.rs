//! The planner: the strided regions that turn one placement into another.
//!
//! For every target fragment the planner picks one complete source replica (round-robin over
//! the source's replicas by the target's replica, so DP copies share the load; a replica with a
//! fragment on the target's own participant is preferred, which makes the copy local) and
//! intersects the fragment with that replica's fragments. Each non-empty intersection is one
//! [`Region`]: a box copied from one source fragment into one target fragment. A replica covers
//! the tensor exactly once, so every target element is written by exactly one region, and no
//! two regions share a (source fragment, target fragment) pair: the set is minimal for
//! fragment-granular buffers.
//!
//! A region is lowered to bytes once, when planned: `inner_bytes` contiguous in both fragments
//! (the trailing dimensions both hold whole, plus the first they do not), repeated over the
//! outer dimensions with their byte strides on either side (dimensions of extent one dropped,
//! neighbours that stay contiguous merged). [`Limits`] bound the regions and the contiguous
//! segments a plan may expand to, so a plan never turns into an unbounded number of transfers.
//!
//! Copy-only: no dtype, quantisation or layout conversion; a tensor whose dtype, itemsize,
//! layout or shape differs between the placements is a [`ErrorKind::Mismatch`].

use serde::{Deserialize, Serialize};

use crate::placement::{Fragment, Placement, TensorPlacement};
use crate::{Error, ErrorKind, Result};

/// Bounds on a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub regions_max: usize,
    /// Contiguous segments all regions expand to.
    pub segments_max: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { regions_max: 1 << 20, segments_max: 1 << 26 }
    }
}

/// One box copied from a source fragment into a target fragment, lowered to bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Index of the tensor in the target placement.
    pub tensor: u32,
    /// Index of the same tensor in the source placement.
    pub src_tensor: u32,
    /// Index of the fragment in the source tensor's fragments.
    pub src_fragment: u32,
    /// Index of the fragment in the target tensor's fragments.
    pub dst_fragment: u32,
    pub src_participant: u32,
    pub dst_participant: u32,
    /// The box in global element coordinates.
    pub offset: Vec<u64>,
    pub shape: Vec<u64>,
    /// Byte offset of the box's first element inside the source and target fragments.
    pub src_offset: u64,
    pub dst_offset: u64,
    /// Bytes contiguous on both sides.
    pub inner_bytes: u64,
    /// Outer loop extents (outermost first) and their byte strides on either side.
    pub counts: Vec<u64>,
    pub src_strides: Vec<u64>,
    pub dst_strides: Vec<u64>,
}

impl Region {
    pub fn segments(&self) -> u64 {
        self.counts.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.segments() * self.inner_bytes
    }

    /// Calls `f(src_offset, dst_offset, len)` for each contiguous segment, in order.
    pub fn for_each_segment(&self, mut f: impl FnMut(u64, u64, u64)) {
        let n = self.counts.len();
        let mut idx = vec![0u64; n];
        loop {
            let (mut s, mut d) = (self.src_offset, self.dst_offset);
            for (i, x) in idx.iter().enumerate() {
                s += x * self.src_strides[i];
                d += x * self.dst_strides[i];
            }
            f(s, d, self.inner_bytes);
            let mut i = n;
            loop {
                if i == 0 {
                    return;
                }
                i -= 1;
                idx[i] += 1;
                if idx[i] < self.counts[i] {
                    break;
                }
                idx[i] = 0;
            }
        }
    }
}

/// The regions from a source placement to a target placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub src_digest: String,
    pub dst_digest: String,
    pub regions: Vec<Region>,
}

impl Plan {
    pub fn bytes(&self) -> u64 {
        self.regions.iter().map(Region::bytes).sum()
    }

    pub fn segments(&self) -> u64 {
        self.regions.iter().map(Region::segments).sum()
    }

    /// Bytes whose source and target participants differ.
    pub fn remote_bytes(&self) -> u64 {
        self.regions
            .iter()
            .filter(|r| r.src_participant != r.dst_participant)
            .map(Region::bytes)
            .sum()
    }
}

fn mismatch(d: String) -> Error {
    Error::new(ErrorKind::Mismatch, "plan", d)
}

/// Plans `src` -> `dst` (every target tensor must be in the source; source tensors the target
/// does not hold are left out).
pub fn plan(src: &Placement, dst: &Placement, limits: &Limits) -> Result<Plan> {
    src.validate()?;
    dst.validate()?;
    let mut regions = Vec::new();
    let mut segments = 0u64;
    let by_name: std::collections::HashMap<&str, usize> =
        src.tensors.iter().enumerate().map(|(i, t)| (t.desc.name.as_str(), i)).collect();
    for (ti, t) in dst.tensors.iter().enumerate() {
        let Some(&si) = by_name.get(t.desc.name.as_str()) else {
            return Err(mismatch(format!("{} is not in the source placement", t.desc.name)));
        };
        let s = &src.tensors[si];
        let (a, b) = (&s.desc, &t.desc);
        if a.shape != b.shape
            || a.dtype != b.dtype
            || a.itemsize != b.itemsize
            || a.layout != b.layout
        {
            return Err(mismatch(format!(
                "{}: source {:?} {} ({} bytes, {}), target {:?} {} ({} bytes, {})",
                b.name,
                a.shape,
                a.dtype,
                a.itemsize,
                a.layout,
                b.shape,
                b.dtype,
                b.itemsize,
                b.layout
            )));
        }
        plan_tensor((ti as u32, si as u32), s, t, &mut |r| {
            segments += r.segments();
            regions.push(r);
            if regions.len() > limits.regions_max || segments > limits.segments_max {
                return Err(Error::new(
                    ErrorKind::Limit,
                    "plan",
                    format!(
                        "more than {} regions or {} segments (at tensor {})",
                        limits.regions_max, limits.segments_max, b.name
                    ),
                ));
            }
            Ok(())
        })?;
    }
    Ok(Plan { src_digest: src.digest(), dst_digest: dst.digest(), regions })
}

fn plan_tensor(
    (ti, sti): (u32, u32),
    s: &TensorPlacement,
    t: &TensorPlacement,
    emit: &mut dyn FnMut(Region) -> Result<()>,
) -> Result<()> {
    let mut replicas: Vec<u32> = s.fragments.iter().map(|f| f.replica).collect();
    replicas.sort_unstable();
    replicas.dedup();
    let item = t.desc.itemsize as u64;
    for (di, d) in t.fragments.iter().enumerate() {
        let local = replicas.iter().copied().find(|&r| {
            s.fragments.iter().any(|f| f.replica == r && f.participant == d.participant)
        });
        let replica = local.unwrap_or(replicas[d.replica as usize % replicas.len()]);
        for (si, f) in s.fragments.iter().enumerate().filter(|(_, f)| f.replica == replica) {
            if let Some((offset, shape)) = f.intersect(d) {
                emit(lower((ti, sti), si as u32, di as u32, f, d, offset, shape, item))?;
            }
        }
    }
    Ok(())
}

fn row_strides(shape: &[u64], item: u64) -> Vec<u64> {
    let mut st = vec![item; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1];
    }
    st
}

#[allow(clippy::too_many_arguments)]
fn lower(
    (tensor, src_tensor): (u32, u32),
    src_fragment: u32,
    dst_fragment: u32,
    s: &Fragment,
    d: &Fragment,
    offset: Vec<u64>,
    shape: Vec<u64>,
    item: u64,
) -> Region {
    let n = shape.len();
    let (ss, ds) = (row_strides(&s.shape, item), row_strides(&d.shape, item));
    let src_offset = (0..n).map(|i| (offset[i] - s.offset[i]) * ss[i]).sum();
    let dst_offset = (0..n).map(|i| (offset[i] - d.offset[i]) * ds[i]).sum();
    // The innermost dimension and every outer one both fragments and the box hold whole fold
    // into one contiguous run.
    let mut k = n - 1;
    while k > 0 && shape[k] == s.shape[k] && shape[k] == d.shape[k] {
        k -= 1;
    }
    let inner_bytes = shape[k..].iter().product::<u64>() * item;
    let (mut counts, mut src_strides, mut dst_strides) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..k {
        if shape[i] == 1 {
            continue;
        }
        counts.push(shape[i]);
        src_strides.push(ss[i]);
        dst_strides.push(ds[i]);
    }
    // Merge an outer dimension into the one inside it where both sides stay evenly strided.
    let mut i = counts.len();
    while i > 1 {
        i -= 1;
        if src_strides[i - 1] == src_strides[i] * counts[i]
            && dst_strides[i - 1] == dst_strides[i] * counts[i]
        {
            counts[i - 1] *= counts[i];
            src_strides[i - 1] = src_strides[i];
            dst_strides[i - 1] = dst_strides[i];
            counts.remove(i);
            src_strides.remove(i);
            dst_strides.remove(i);
        }
    }
    Region {
        tensor,
        src_tensor,
        src_fragment,
        dst_fragment,
        src_participant: s.participant,
        dst_participant: d.participant,
        offset,
        shape,
        src_offset,
        dst_offset,
        inner_bytes,
        counts,
        src_strides,
        dst_strides,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::placement::{Parallel, Rule, TensorDesc};
    use crate::testing::linear_fragment;

    /// Runs `plan` in memory from linear-filled sources; checks every target fragment equals
    /// its independently computed slice and every target byte is written exactly once.
    fn check(src: &Placement, dst: &Placement, p: &Plan) {
        let srcs: Vec<Vec<Vec<u8>>> = src
            .tensors
            .iter()
            .map(|t| t.fragments.iter().map(|f| linear_fragment(&t.desc, f)).collect())
            .collect();
        for (ti, t) in dst.tensors.iter().enumerate() {
            let si = src.tensors.iter().position(|s| s.desc.name == t.desc.name).unwrap();
            for (fi, f) in t.fragments.iter().enumerate() {
                let len = (f.elements() * t.desc.itemsize as u64) as usize;
                let mut got = vec![0u8; len];
                let mut writes = vec![0u8; len];
                for r in p
                    .regions
                    .iter()
                    .filter(|r| r.tensor == ti as u32 && r.dst_fragment == fi as u32)
                {
                    assert_eq!(r.dst_participant, f.participant);
                    let s = &srcs[si][r.src_fragment as usize];
                    r.for_each_segment(|so, d, l| {
                        let (so, d, l) = (so as usize, d as usize, l as usize);
                        got[d..d + l].copy_from_slice(&s[so..so + l]);
                        writes[d..d + l].iter_mut().for_each(|w| *w += 1);
                    });
                }
                assert!(
                    writes.iter().all(|&w| w == 1),
                    "{} fragment {fi}: bytes not written exactly once",
                    t.desc.name
                );
                assert_eq!(got, linear_fragment(&t.desc, f), "{} fragment {fi}", t.desc.name);
            }
        }
    }

    fn desc(name: &str, shape: &[u64], item: u32) -> TensorDesc {
        TensorDesc::new(name, shape, "u", item)
    }

    #[test]
    fn tp2_to_tp4_and_back_on_either_dimension() {
        for dim in 0..2 {
            let w = desc("w", &[12, 20], 4);
            let rule = Rule { tp_dim: Some(dim), ..Rule::default() };
            let a = Parallel::parse("tp2").unwrap().placement(&[(w.clone(), rule)]).unwrap();
            let b = Parallel::parse("tp4").unwrap().placement(&[(w, rule)]).unwrap();
            let ab = plan(&a, &b, &Limits::default()).unwrap();
            check(&a, &b, &ab);
            let ba = plan(&b, &a, &Limits::default()).unwrap();
            check(&b, &a, &ba);
            // One region per overlapping pair: TP2 -> TP4 splits each source in two.
            assert_eq!(ab.regions.len(), 4);
            assert_eq!(ba.regions.len(), 4);
            if dim == 0 {
                // Whole rows: one contiguous segment per region.
                assert!(ab.regions.iter().all(|r| r.segments() == 1));
            } else {
                assert!(ab.regions.iter().all(|r| r.segments() == 12 && r.inner_bytes == 5 * 4));
            }
        }
    }

    #[test]
    fn pp2_ep8_tp4_dp2_to_pp4_ep2_tp8_dp4() {
        let layers = 4u32;
        let mut tensors = Vec::new();
        for l in 0..layers {
            // Experts [E, H, F]: EP on the expert dimension, TP on F.
            tensors.push((
                desc(&format!("l{l}.experts"), &[16, 8, 32], 2),
                Rule { tp_dim: Some(2), ep_dim: Some(0), layer: Some((l, layers)) },
            ));
            // Attention [H, 3H]: TP on the output dimension, replicated over EP.
            tensors.push((
                desc(&format!("l{l}.qkv"), &[8, 24], 4),
                Rule { tp_dim: Some(1), ep_dim: None, layer: Some((l, layers)) },
            ));
            tensors.push((
                desc(&format!("l{l}.norm"), &[8], 4),
                Rule { layer: Some((l, layers)), ..Rule::default() },
            ));
        }
        tensors.push((desc("embed", &[64, 8], 8), Rule { tp_dim: Some(0), ..Rule::default() }));
        let a = Parallel::parse("pp2/ep8/tp4/dp2").unwrap().placement(&tensors).unwrap();
        let b = Parallel::parse("pp4/ep2/tp8/dp4").unwrap().placement(&tensors).unwrap();
        assert_eq!((a.participants, b.participants), (128, 256));
        let p = plan(&a, &b, &Limits::default()).unwrap();
        check(&a, &b, &p);
        // DP replicas of the target read from both source replicas.
        let reps: std::collections::HashSet<u32> =
            p.regions.iter().map(|r| r.src_participant / 64).collect();
        assert_eq!(reps.len(), 2);
    }

    #[test]
    fn mismatches_and_limits_fail_closed() {
        let w = desc("w", &[8, 8], 4);
        let r = Rule { tp_dim: Some(1), ..Rule::default() };
        let a = Parallel::parse("tp2").unwrap().placement(&[(w.clone(), r)]).unwrap();
        let b = Parallel::parse("tp4").unwrap().placement(&[(w, r)]).unwrap();
        let e = plan(&a, &b, &Limits { regions_max: 3, segments_max: 1 << 20 }).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Limit);
        let e = plan(&a, &b, &Limits { regions_max: 100, segments_max: 10 }).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Limit);
        for change in 0..3 {
            let mut c = b.clone();
            match change {
                0 => c.tensors[0].desc.dtype = "other".into(),
                1 => c.tensors[0].desc.name = "v".into(),
                _ => {
                    c.tensors[0].desc.shape = vec![8, 12];
                    c.tensors[0].fragments[3].shape[1] = 6;
                }
            }
            assert_eq!(
                plan(&a, &c, &Limits::default()).unwrap_err().kind(),
                ErrorKind::Mismatch,
                "change {change}"
            );
        }
    }

    /// A random grid placement of `shape`: per dimension random cut points, each cell to a
    /// random participant, `replicas` copies.
    fn grid(
        shape: &[u64],
        cuts: &[Vec<u64>],
        owners: &[u32],
        replicas: u32,
        participants: u32,
    ) -> TensorPlacement {
        let bounds: Vec<Vec<u64>> = shape
            .iter()
            .zip(cuts)
            .map(|(&n, c)| {
                let mut b: Vec<u64> = c.iter().map(|x| x % n).filter(|&x| x > 0).collect();
                b.push(0);
                b.push(n);
                b.sort_unstable();
                b.dedup();
                b
            })
            .collect();
        let mut fragments = Vec::new();
        let mut k = 0usize;
        for rep in 0..replicas {
            let mut idx = vec![0usize; shape.len()];
            'cells: loop {
                let offset: Vec<u64> = (0..shape.len()).map(|d| bounds[d][idx[d]]).collect();
                let fshape: Vec<u64> =
                    (0..shape.len()).map(|d| bounds[d][idx[d] + 1] - bounds[d][idx[d]]).collect();
                fragments.push(Fragment {
                    participant: owners[k % owners.len()] % participants,
                    replica: rep,
                    offset,
                    shape: fshape,
                });
                k += 1;
                let mut d = shape.len();
                loop {
                    if d == 0 {
                        break 'cells;
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] + 1 < bounds[d].len() {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        }
        TensorPlacement { desc: desc("t", shape, 2), fragments }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_placements_write_every_target_byte_once(
            shape in prop::collection::vec(1u64..9, 1..4),
            cuts_a in prop::collection::vec(prop::collection::vec(0u64..9, 0..3), 3),
            cuts_b in prop::collection::vec(prop::collection::vec(0u64..9, 0..3), 3),
            owners_a in prop::collection::vec(0u32..8, 1..6),
            owners_b in prop::collection::vec(0u32..8, 1..6),
            reps_a in 1u32..3,
            reps_b in 1u32..3,
        ) {
            let a = Placement { participants: 8, tensors: vec![grid(&shape, &cuts_a, &owners_a, reps_a, 8)] };
            let b = Placement { participants: 8, tensors: vec![grid(&shape, &cuts_b, &owners_b, reps_b, 8)] };
            let p = plan(&a, &b, &Limits::default()).unwrap();
            check(&a, &b, &p);
        }
    }
}
