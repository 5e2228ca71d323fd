//! Element types and reductions.
//!
//! Mechanism: a reduction folds contributions into an accumulator element by element, in the
//! order the caller passes them. Collectives always pass contributions in slot order, so a
//! result is the same bits on every rank and on every run for a given group and size.
//!
//! Policy: integers wrap (as numpy's and torch's do); `f16` and `bf16` accumulate in `f32`
//! across all contributions and round once at the end; `Avg` divides the sum by the number of
//! contributions and exists for floating types only.

use half::{bf16, f16};

use crate::{Error, ErrorKind, Result};

/// Element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
}

impl DType {
    pub const ALL: [DType; 7] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }

    /// Parses numpy's and torch's names (`float32`, `f4`, `torch.float32`, `half`, ...).
    pub fn parse(s: &str) -> Result<DType> {
        let s = s.strip_prefix("torch.").unwrap_or(s);
        Ok(match s {
            "float32" | "f4" | "<f4" | "float" => DType::F32,
            "float64" | "f8" | "<f8" | "double" => DType::F64,
            "float16" | "f2" | "<f2" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "int32" | "i4" | "<i4" | "int" => DType::I32,
            "int64" | "i8" | "<i8" | "long" => DType::I64,
            "uint8" | "u1" | "|u1" => DType::U8,
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "dtype",
                    format!(
                        "{s}: not one of float32, float64, float16, bfloat16, int32, int64, uint8"
                    ),
                ));
            }
        })
    }

    fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

/// How contributions combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    Sum,
    Product,
    Min,
    Max,
    Avg,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    pub fn parse(s: &str) -> Result<ReduceOp> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "product" | "prod" => ReduceOp::Product,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "average" | "mean" => ReduceOp::Avg,
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "reduce op",
                    format!("{other}: not one of sum, product, min, max, avg"),
                ));
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

/// Checks a (dtype, op, byte length) triple before anything moves.
pub fn check(dtype: DType, op: ReduceOp, len: usize) -> Result<()> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "reduce",
            format!("avg needs a floating dtype, not {}", dtype.name()),
        ));
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "reduce",
            format!("{len} bytes is not a whole number of {} elements", dtype.name()),
        ));
    }
    Ok(())
}

/// Reduces `parts` (each `out.len()` bytes, in the order given) into `out`.
pub fn reduce(dtype: DType, op: ReduceOp, parts: &[&[u8]], out: &mut [u8]) {
    debug_assert!(parts.iter().all(|p| p.len() == out.len()));
    if parts.is_empty() {
        return;
    }
    let n = parts.len();
    match dtype {
        DType::F32 => fold::<f32, f32>(op, n, parts, out, |x| x, |x| x),
        DType::F64 => fold::<f64, f64>(op, n, parts, out, |x| x, |x| x),
        DType::F16 => fold::<f16, f32>(op, n, parts, out, f16::to_f32, f16::from_f32),
        DType::BF16 => fold::<bf16, f32>(op, n, parts, out, bf16::to_f32, bf16::from_f32),
        DType::I32 => fold::<i32, i32>(op, n, parts, out, |x| x, |x| x),
        DType::I64 => fold::<i64, i64>(op, n, parts, out, |x| x, |x| x),
        DType::U8 => fold::<u8, u8>(op, n, parts, out, |x| x, |x| x),
    }
}

/// Element types as stored on the wire (little-endian, any alignment).
trait Elem: Copy {
    const SIZE: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element-sized chunk"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
elem!(f32, f64, f16, bf16, i32, i64, u8);

/// The arithmetic of an accumulator type.
trait Acc: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! acc_float {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self + o }
            #[inline(always)] fn mul(self, o: Self) -> Self { self * o }
            // NaN wins, as in numpy's minimum/maximum and torch.
            #[inline(always)] fn min(self, o: Self) -> Self { if self.is_nan() || o.is_nan() { <$t>::NAN } else if o < self { o } else { self } }
            #[inline(always)] fn max(self, o: Self) -> Self { if self.is_nan() || o.is_nan() { <$t>::NAN } else if o > self { o } else { self } }
            #[inline(always)] fn div_n(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
acc_float!(f32, f64);

macro_rules! acc_int {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)] fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)] fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)] fn div_n(self, n: usize) -> Self { self / n as $t }
        }
    )*};
}
acc_int!(i32, i64, u8);

/// Folds the contributions element by element: `out[i] = parts[0][i] op parts[1][i] op ...`,
/// left to right, in accumulator type `A`, converted back once.
fn fold<E: Elem, A: Acc>(
    op: ReduceOp,
    n: usize,
    parts: &[&[u8]],
    out: &mut [u8],
    widen: fn(E) -> A,
    narrow: fn(A) -> E,
) {
    match op {
        ReduceOp::Sum => fold_with(parts, out, widen, narrow, A::add, None),
        ReduceOp::Avg => fold_with(parts, out, widen, narrow, A::add, Some(n)),
        ReduceOp::Product => fold_with(parts, out, widen, narrow, A::mul, None),
        ReduceOp::Min => fold_with(parts, out, widen, narrow, A::min, None),
        ReduceOp::Max => fold_with(parts, out, widen, narrow, A::max, None),
    }
}

#[inline(always)]
fn fold_with<E: Elem, A: Acc>(
    parts: &[&[u8]],
    out: &mut [u8],
    widen: fn(E) -> A,
    narrow: fn(A) -> E,
    f: impl Fn(A, A) -> A,
    avg: Option<usize>,
) {
    // Blocks of elements keep the accumulator in L1 while every part streams through once.
    const BLOCK: usize = 2048;
    let first = widen(E::load(&parts[0][..E::SIZE]));
    let mut acc = [first; BLOCK];
    let block_bytes = BLOCK * E::SIZE;
    for (b, o) in out.chunks_mut(block_bytes).enumerate() {
        let base = b * block_bytes;
        let m = o.len() / E::SIZE;
        let src = &parts[0][base..base + o.len()];
        for (a, c) in acc[..m].iter_mut().zip(src.chunks_exact(E::SIZE)) {
            *a = widen(E::load(c));
        }
        for p in &parts[1..] {
            let src = &p[base..base + o.len()];
            for (a, c) in acc[..m].iter_mut().zip(src.chunks_exact(E::SIZE)) {
                *a = f(*a, widen(E::load(c)));
            }
        }
        for (a, c) in acc[..m].iter().zip(o.chunks_exact_mut(E::SIZE)) {
            let v = match avg {
                Some(n) => a.div_n(n),
                None => *a,
            };
            narrow(v).store(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Elem>(v: &[T]) -> Vec<u8> {
        let mut out = vec![0; v.len() * T::SIZE];
        for (i, x) in v.iter().enumerate() {
            x.store(&mut out[i * T::SIZE..(i + 1) * T::SIZE]);
        }
        out
    }

    #[test]
    fn sums_in_the_order_given() {
        let a = bytes(&[1.0e8f32, 1.0]);
        let b = bytes(&[1.0f32, -1.0e8]);
        let c = bytes(&[-1.0e8f32, 1.0e8]);
        let mut out = vec![0; 8];
        reduce(DType::F32, ReduceOp::Sum, &[&a, &b, &c], &mut out);
        // ((1e8 + 1) - 1e8) = 0 in f32; ((1 - 1e8) + 1e8) = 0.
        assert_eq!(out, bytes(&[0.0f32, 0.0]));
    }

    #[test]
    fn integers_wrap_and_min_max_prod() {
        let a = bytes(&[200u8, 3, 7]);
        let b = bytes(&[100u8, 5, 2]);
        let mut out = vec![0; 3];
        reduce(DType::U8, ReduceOp::Sum, &[&a, &b], &mut out);
        assert_eq!(out, vec![44, 8, 9]);
        reduce(DType::U8, ReduceOp::Min, &[&a, &b], &mut out);
        assert_eq!(out, vec![100, 3, 2]);
        reduce(DType::U8, ReduceOp::Max, &[&a, &b], &mut out);
        assert_eq!(out, vec![200, 5, 7]);
        reduce(DType::U8, ReduceOp::Product, &[&a, &b], &mut out);
        assert_eq!(out, vec![(200u32 * 100 % 256) as u8, 15, 14]);
    }

    #[test]
    fn half_types_accumulate_in_f32() {
        let a = bytes(&[f16::from_f32(2048.0)]);
        let b = bytes(&[f16::from_f32(1.0)]);
        let mut out = vec![0; 2];
        // 2048 + 1 + 1 = 2050 exactly in f32; per-step f16 rounding would give 2048.
        reduce(DType::F16, ReduceOp::Sum, &[&a, &b, &b], &mut out);
        assert_eq!(f16::load(&out), f16::from_f32(2050.0));
        let a = bytes(&[bf16::from_f32(3.0)]);
        let mut out = vec![0; 2];
        reduce(
            DType::BF16,
            ReduceOp::Avg,
            &[&a, &b.iter().map(|_| 0).collect::<Vec<_>>()],
            &mut out,
        );
        assert_eq!(bf16::load(&out), bf16::from_f32(1.5));
    }

    #[test]
    fn avg_on_integers_and_ragged_lengths_are_refused() {
        assert_eq!(
            check(DType::I32, ReduceOp::Avg, 8).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            check(DType::F32, ReduceOp::Sum, 6).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(check(DType::F64, ReduceOp::Avg, 16).is_ok());
    }

    #[test]
    fn blocks_past_the_first_are_reduced() {
        let n = 3000;
        let a: Vec<i64> = (0..n).collect();
        let b: Vec<i64> = (0..n).map(|x| x * 10).collect();
        let mut out = vec![0; n as usize * 8];
        reduce(DType::I64, ReduceOp::Sum, &[&bytes(&a), &bytes(&b)], &mut out);
        let want: Vec<i64> = (0..n).map(|x| x * 11).collect();
        assert_eq!(out, bytes(&want));
    }
}
