//! Placements: where the fragments of each weight tensor live.
//!
//! A [`Placement`] lists, for every tensor, its [`Fragment`]s: an N-dimensional box of the
//! global tensor (offset and shape, row-major, dense) held by one participant, and the
//! *replica* it belongs to. Each replica must hold every element of the tensor exactly once;
//! different replicas are complete copies (DP, or a tensor every TP rank keeps whole). The
//! usual placements come from [`Parallel::place`]: TP and EP split a dimension, PP gives a
//! tensor to the stage that owns its layer, DP and the axes a tensor does not split replicate
//! it. Anything else (uneven or irregular splits) is written out fragment by fragment.
//!
//! Validation fails closed: a gap or an overlap inside a replica, a fragment out of bounds or
//! of the wrong rank, a duplicated tensor, an unknown participant are errors, never repaired.
//! The placement's `digest` (blake3 of its canonical JSON) names it in bindings and in the
//! pool, so a plan made against one placement is never run against another.

use serde::{Deserialize, Serialize};

use crate::{Error, ErrorKind, Result};

/// Most dimensions a tensor may have.
pub const DIMS_MAX: usize = 8;

/// A weight tensor: name, global shape and element type. Layout is row-major throughout
/// (`layout` names it so a placement written for another layout is refused, not misread).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: String,
    pub itemsize: u32,
    #[serde(default = "row_major")]
    pub layout: String,
}

fn row_major() -> String {
    "row-major".to_string()
}

impl TensorDesc {
    pub fn new(name: &str, shape: &[u64], dtype: &str, itemsize: u32) -> TensorDesc {
        TensorDesc {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: dtype.to_string(),
            itemsize,
            layout: row_major(),
        }
    }

    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.elements() * self.itemsize as u64
    }
}

/// One participant's box of a tensor: `offset` and `shape` in elements, per dimension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fragment {
    pub participant: u32,
    pub replica: u32,
    pub offset: Vec<u64>,
    pub shape: Vec<u64>,
}

impl Fragment {
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The box both fragments hold, if any: (offset, shape).
    pub fn intersect(&self, other: &Fragment) -> Option<(Vec<u64>, Vec<u64>)> {
        let mut off = Vec::with_capacity(self.offset.len());
        let mut shape = Vec::with_capacity(self.offset.len());
        for d in 0..self.offset.len() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            off.push(lo);
            shape.push(hi - lo);
        }
        Some((off, shape))
    }
}

/// A tensor and its fragments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlacement {
    pub desc: TensorDesc,
    pub fragments: Vec<Fragment>,
}

/// Every tensor of a model generation, over `participants` participants (0..participants).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub participants: u32,
    pub tensors: Vec<TensorPlacement>,
}

impl Placement {
    /// Checks every tensor (see the module notes); `Ok` means every replica of every tensor
    /// covers it exactly once.
    pub fn validate(&self) -> Result<()> {
        let mut names = std::collections::HashSet::new();
        for t in &self.tensors {
            if !names.insert(t.desc.name.as_str()) {
                return Err(invalid(format!("tensor {} is listed twice", t.desc.name)));
            }
            validate_tensor(t, self.participants)?;
        }
        Ok(())
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorPlacement> {
        self.tensors.iter().find(|t| t.desc.name == name)
    }

    /// The canonical JSON the digest is taken over.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a placement serialises")
    }

    pub fn from_json(s: &str) -> Result<Placement> {
        let p: Placement = serde_json::from_str(s)
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, "placement", e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// blake3 of the canonical JSON, hex: the placement's identity.
    pub fn digest(&self) -> String {
        blake3::hash(self.to_json().as_bytes()).to_hex().to_string()
    }

    /// Bytes participant `p` holds.
    pub fn bytes_of(&self, p: u32) -> u64 {
        self.tensors
            .iter()
            .flat_map(|t| {
                t.fragments
                    .iter()
                    .filter(move |f| f.participant == p)
                    .map(move |f| f.elements() * t.desc.itemsize as u64)
            })
            .sum()
    }
}

fn invalid(d: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, "placement", d)
}

fn validate_tensor(t: &TensorPlacement, participants: u32) -> Result<()> {
    let d = &t.desc;
    let n = d.shape.len();
    if n == 0 || n > DIMS_MAX {
        return Err(invalid(format!("{}: {n} dimensions (1..={DIMS_MAX})", d.name)));
    }
    if d.shape.contains(&0) || ![1, 2, 4, 8].contains(&d.itemsize) {
        return Err(invalid(format!(
            "{}: shape {:?} of itemsize {} (dimensions positive, itemsize 1, 2, 4 or 8)",
            d.name, d.shape, d.itemsize
        )));
    }
    if d.shape.iter().try_fold(d.itemsize as u64, |a, &x| a.checked_mul(x)).is_none() {
        return Err(invalid(format!("{}: {:?} overflows", d.name, d.shape)));
    }
    if d.layout != "row-major" {
        return Err(Error::new(
            ErrorKind::Mismatch,
            "placement",
            format!("{}: layout {} (only row-major)", d.name, d.layout),
        ));
    }
    let mut replicas: std::collections::BTreeMap<u32, Vec<&Fragment>> = Default::default();
    for f in &t.fragments {
        if f.offset.len() != n || f.shape.len() != n {
            return Err(invalid(format!(
                "{}: a fragment of rank {} in a tensor of rank {n}",
                d.name,
                f.shape.len()
            )));
        }
        if f.participant >= participants {
            return Err(invalid(format!(
                "{}: participant {} of {participants}",
                d.name, f.participant
            )));
        }
        let inside = (0..n).all(|i| f.shape[i] > 0 && f.offset[i] + f.shape[i] <= d.shape[i]);
        if !inside {
            return Err(invalid(format!(
                "{}: fragment at {:?} of shape {:?} is empty or outside {:?}",
                d.name, f.offset, f.shape, d.shape
            )));
        }
        replicas.entry(f.replica).or_default().push(f);
    }
    if replicas.is_empty() {
        return Err(Error::new(
            ErrorKind::CoverageGap,
            "placement",
            format!("{}: no fragments", d.name),
        ));
    }
    for (r, frags) in &replicas {
        for (i, a) in frags.iter().enumerate() {
            if let Some(b) = frags[i + 1..].iter().find(|b| a.intersect(b).is_some()) {
                return Err(Error::new(
                    ErrorKind::Overlap,
                    "placement",
                    format!(
                        "{} replica {r}: participants {} and {} both hold elements at {:?}",
                        d.name,
                        a.participant,
                        b.participant,
                        a.intersect(b).map(|x| x.0).unwrap_or_default()
                    ),
                ));
            }
        }
        let held: u64 = frags.iter().map(|f| f.elements()).sum();
        if held != d.elements() {
            return Err(Error::new(
                ErrorKind::CoverageGap,
                "placement",
                format!(
                    "{} replica {r}: fragments hold {held} of {} elements",
                    d.name,
                    d.elements()
                ),
            ));
        }
    }
    Ok(())
}

/// A parallel layout: participant `((d*pp + p)*ep + e)*tp + t` is TP rank `t`, EP rank `e`,
/// PP stage `p` of DP replica `d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallel {
    pub tp: u32,
    pub pp: u32,
    pub ep: u32,
    pub dp: u32,
}

/// How one tensor is laid out over a [`Parallel`] layout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// The dimension TP splits (`None`: every TP rank holds the whole extent).
    pub tp_dim: Option<usize>,
    /// The dimension EP splits, usually the expert dimension (split before TP when both name
    /// the same one).
    pub ep_dim: Option<usize>,
    /// The layer this tensor belongs to; PP stage `layer * pp / layers` owns it. `None`: every
    /// stage holds it (embeddings tied across stages).
    pub layer: Option<(u32, u32)>,
}

impl Parallel {
    pub fn parse(s: &str) -> Result<Parallel> {
        let mut p = Parallel { tp: 1, pp: 1, ep: 1, dp: 1 };
        for part in s.split(['/', ',', ' ']).filter(|x| !x.is_empty()) {
            let part = part.to_ascii_lowercase();
            let (k, v) = part.split_at(2.min(part.len()));
            let v: u32 =
                v.parse().map_err(|_| invalid(format!("{s}: {part} (like tp4/pp2/ep8/dp2)")))?;
            match k {
                "tp" => p.tp = v,
                "pp" => p.pp = v,
                "ep" => p.ep = v,
                "dp" => p.dp = v,
                _ => return Err(invalid(format!("{s}: {part} (like tp4/pp2/ep8/dp2)"))),
            }
        }
        if [p.tp, p.pp, p.ep, p.dp].contains(&0) {
            return Err(invalid(format!("{s}: every size must be positive")));
        }
        Ok(p)
    }

    pub fn world(&self) -> u32 {
        self.tp * self.pp * self.ep * self.dp
    }

    pub fn participant(&self, d: u32, p: u32, e: u32, t: u32) -> u32 {
        ((d * self.pp + p) * self.ep + e) * self.tp + t
    }

    /// The fragments of `desc` under `rule`.
    pub fn place(&self, desc: &TensorDesc, rule: Rule) -> Result<TensorPlacement> {
        let n = desc.shape.len();
        for dim in [rule.tp_dim, rule.ep_dim].into_iter().flatten() {
            if dim >= n {
                return Err(invalid(format!("{}: split dimension {dim} of {n}", desc.name)));
            }
        }
        let stage = match rule.layer {
            Some((l, layers)) if l < layers => Some(l as u64 * self.pp as u64 / layers as u64),
            Some((l, layers)) => {
                return Err(invalid(format!("{}: layer {l} of {layers}", desc.name)));
            }
            None => None,
        };
        let mut fragments = Vec::new();
        for d in 0..self.dp {
            for p in 0..self.pp {
                if stage.is_some_and(|s| s != p as u64) {
                    continue;
                }
                for e in 0..self.ep {
                    for t in 0..self.tp {
                        let mut offset = vec![0u64; n];
                        let mut shape = desc.shape.clone();
                        if let Some(dim) = rule.ep_dim {
                            split(&mut offset[dim], &mut shape[dim], e, self.ep);
                        }
                        if let Some(dim) = rule.tp_dim {
                            split(&mut offset[dim], &mut shape[dim], t, self.tp);
                        }
                        if shape.contains(&0) {
                            continue;
                        }
                        // Replica: the index over the axes that do not split this tensor.
                        let mut replica = d as u64;
                        if stage.is_none() {
                            replica = replica * self.pp as u64 + p as u64;
                        }
                        if rule.ep_dim.is_none() {
                            replica = replica * self.ep as u64 + e as u64;
                        }
                        if rule.tp_dim.is_none() {
                            replica = replica * self.tp as u64 + t as u64;
                        }
                        fragments.push(Fragment {
                            participant: self.participant(d, p, e, t),
                            replica: replica as u32,
                            offset,
                            shape,
                        });
                    }
                }
            }
        }
        Ok(TensorPlacement { desc: desc.clone(), fragments })
    }

    /// A whole placement: every tensor under its rule.
    pub fn placement(&self, tensors: &[(TensorDesc, Rule)]) -> Result<Placement> {
        let tensors = tensors.iter().map(|(d, r)| self.place(d, *r)).collect::<Result<Vec<_>>>()?;
        let p = Placement { participants: self.world(), tensors };
        p.validate()?;
        Ok(p)
    }
}

/// Narrows `[off, off+len)` to part `i` of `k` (sizes differ by at most one).
fn split(off: &mut u64, len: &mut u64, i: u32, k: u32) {
    let (i, k) = (i as u64, k as u64);
    let lo = *len * i / k;
    let hi = *len * (i + 1) / k;
    *off += lo;
    *len = hi - lo;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(shape: &[u64]) -> TensorDesc {
        TensorDesc::new("w", shape, "bfloat16", 2)
    }

    #[test]
    fn tp_splits_and_replicates() {
        let p = Parallel::parse("tp2/dp2").unwrap();
        let t = p.place(&w(&[4, 6]), Rule { tp_dim: Some(1), ..Rule::default() }).unwrap();
        assert_eq!(t.fragments.len(), 4);
        assert_eq!(t.fragments[1].offset, vec![0, 3]);
        assert_eq!(t.fragments[1].shape, vec![4, 3]);
        assert_eq!(t.fragments[3].replica, 1);
        assert_eq!(t.fragments[3].participant, 3);
        let pl = Placement { participants: 4, tensors: vec![t] };
        pl.validate().unwrap();
    }

    #[test]
    fn pp_gives_a_layer_to_one_stage() {
        let p = Parallel::parse("pp4").unwrap();
        let t = p.place(&w(&[8]), Rule { layer: Some((5, 8)), ..Rule::default() }).unwrap();
        assert_eq!(t.fragments.len(), 1);
        assert_eq!(t.fragments[0].participant, 2);
    }

    #[test]
    fn gaps_and_overlaps_fail_closed() {
        let p = Parallel::parse("tp2").unwrap();
        let mut pl =
            p.placement(&[(w(&[4, 6]), Rule { tp_dim: Some(0), ..Rule::default() })]).unwrap();
        pl.tensors[0].fragments[1].offset[0] = 1;
        pl.tensors[0].fragments[1].shape[0] = 2;
        let e = pl.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Overlap, "{e}");
        pl.tensors[0].fragments[1].offset[0] = 3;
        pl.tensors[0].fragments[1].shape[0] = 1;
        let e = pl.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::CoverageGap, "{e}");
        pl.tensors[0].fragments[1].shape[0] = 2;
        assert_eq!(pl.validate().unwrap_err().kind(), ErrorKind::InvalidArgument);
        pl.tensors[0].desc.layout = "column-major".into();
        assert_eq!(pl.validate().unwrap_err().kind(), ErrorKind::Mismatch);
        assert_eq!(Parallel::parse("tp0").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(Parallel::parse("xx2").unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}

/// A model as `kvfs reshard` reads it: its tensors and how each is laid out.
///
/// ```json
/// {"tensors": [{"name": "l0.qkv", "shape": [4096, 12288], "dtype": "bfloat16", "itemsize": 2,
///               "tp_dim": 1, "layer": [0, 32]}]}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub tensors: Vec<TensorSpec>,
}

/// One tensor of a [`ModelSpec`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: String,
    pub itemsize: u32,
    #[serde(default)]
    pub tp_dim: Option<usize>,
    #[serde(default)]
    pub ep_dim: Option<usize>,
    /// (layer, layers): the PP stage owning the layer holds it.
    #[serde(default)]
    pub layer: Option<(u32, u32)>,
}

impl ModelSpec {
    pub fn from_json(s: &str) -> Result<ModelSpec> {
        let m: ModelSpec = serde_json::from_str(s)
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, "model spec", e.to_string()))?;
        for t in &m.tensors {
            if t.name.is_empty() || t.name.contains(['/', '\0']) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "model spec",
                    format!("tensor name {:?} (non-empty, no '/')", t.name),
                ));
            }
        }
        Ok(m)
    }

    pub fn rules(&self) -> Vec<(TensorDesc, Rule)> {
        self.tensors
            .iter()
            .map(|t| {
                (
                    TensorDesc::new(&t.name, &t.shape, &t.dtype, t.itemsize),
                    Rule { tp_dim: t.tp_dim, ep_dim: t.ep_dim, layer: t.layer },
                )
            })
            .collect()
    }

    /// The placement of this model under `layout` (`tp4/pp2`).
    pub fn placement(&self, layout: &str) -> Result<Placement> {
        Parallel::parse(layout)?.placement(&self.rules())
    }
}
