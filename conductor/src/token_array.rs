//! A msgpack query's `token_ids` int array rewritten as the one little-endian binary the rest
//! of the query reads.
//!
//! The reference conductor takes a prompt's token ids as a msgpack int array or as one LE int32
//! binary, and a router written in Python sends the array (`msgpack.packb({"token_ids": ids})`).
//! Decoded through serde, each of a 128k-token prompt's ids costs about 10 ns (1.2-1.5 ms a
//! query, more than hashing the whole chain); read here, about 2.8 ns (0.35-0.37 ms, the
//! rewrite included). The request is rewritten with the ids as one binary (a copy of the other
//! fields and 4 bytes an id), so the rest of the query takes the binary's path: read in place,
//! fingerprinted as bytes by the memo, shared with the helper encoding ahead. Anything else (a
//! key or value of another shape, an id that is no u32, a truncated body) leaves the body as it
//! was, for serde to decode or to refuse with its own message.

/// How deep a value skipped on the way to `token_ids` may nest (a query's values are flat).
const DEPTH_MAX: u32 = 32;

/// `body` with its top-level `token_ids` int array replaced by one bin32 of the ids as LE
/// u32s; `None` when the body is not a map with such an array of ids that are all u32 (or is
/// malformed before or inside it).
pub(crate) fn as_binary(body: &[u8]) -> Option<Vec<u8>> {
    let mut at = 0;
    let entries = container_len(body, &mut at, Container::Map)?;
    for _ in 0..entries {
        let is_tokens = key_is(body, &mut at, b"token_ids")?;
        if !is_tokens {
            skip(body, &mut at, 0)?;
            continue;
        }
        let start = at;
        let n = container_len(body, &mut at, Container::Array)?;
        // Every id is at least one byte, so a count past the body's end is malformed.
        if n > body.len() - at {
            return None;
        }
        let bytes = u32::try_from(n.checked_mul(4)?).ok()?;
        // At most this long (the ids' own bytes are counted in `body.len()` too).
        let mut out = Vec::with_capacity(body.len() - (at - start) + 5 + 4 * n);
        out.extend_from_slice(&body[..start]);
        out.push(0xc6);
        out.extend_from_slice(&bytes.to_be_bytes());
        let from = out.len();
        out.resize(from + 4 * n, 0);
        ids(body, &mut at, &mut out[from..])?;
        out.extend_from_slice(&body[at..]);
        return Some(out);
    }
    None
}

/// `n` bytes at `*at` as a big-endian unsigned integer, moving past them.
fn be(b: &[u8], at: &mut usize, n: usize) -> Option<u64> {
    let v = b.get(*at..at.checked_add(n)?)?;
    *at += n;
    Some(v.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
}

/// Moves past `n` bytes, if the body has them.
fn advance(b: &[u8], at: &mut usize, n: u64) -> Option<()> {
    let to = at.checked_add(usize::try_from(n).ok()?)?;
    (to <= b.len()).then(|| *at = to)
}

/// A map's or an array's header.
#[derive(Clone, Copy)]
enum Container {
    Map,
    Array,
}

/// Reads the header of a `kind` container: its count of entries (or items).
fn container_len(b: &[u8], at: &mut usize, kind: Container) -> Option<usize> {
    // Its fix form's high nibble and its 16-bit form's marker (the 32-bit form's is one more).
    let (fix, wide) = match kind {
        Container::Map => (0x80, 0xde),
        Container::Array => (0x90, 0xdc),
    };
    let m = *b.get(*at)?;
    *at += 1;
    let n = if m & 0xf0 == fix {
        u64::from(m & 0x0f)
    } else if m == wide {
        be(b, at, 2)?
    } else if m == wide + 1 {
        be(b, at, 4)?
    } else {
        return None;
    };
    usize::try_from(n).ok()
}

/// Reads a map key: whether it is the string `name` (a key of another type is skipped).
fn key_is(b: &[u8], at: &mut usize, name: &[u8]) -> Option<bool> {
    let m = *b.get(*at)?;
    let len = match m {
        0xa0..=0xbf => {
            *at += 1;
            u64::from(m & 0x1f)
        }
        0xd9 => {
            *at += 1;
            be(b, at, 1)?
        }
        0xda => {
            *at += 1;
            be(b, at, 2)?
        }
        0xdb => {
            *at += 1;
            be(b, at, 4)?
        }
        _ => {
            skip(b, at, 0)?;
            return Some(false);
        }
    };
    let from = *at;
    advance(b, at, len)?;
    Some(&b[from..*at] == name)
}

/// Per marker, the bound (exclusive) on a token id's value as read: 2^32 for a fixint and
/// the unsigned widths, the sign bit for the signed ones (no negative id), 0 for the rest.
const ID_LIMIT: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = 1 << 32;
        m += 1;
    }
    t[0xcc] = 1 << 32;
    t[0xcd] = 1 << 32;
    t[0xce] = 1 << 32;
    t[0xcf] = 1 << 32;
    t[0xd0] = 1 << 7;
    t[0xd1] = 1 << 15;
    t[0xd2] = 1 << 31;
    t[0xd3] = 1 << 32;
    t
};

/// `out.len() / 4` token ids from `*at` into `out` as LE u32s. The marker decides the width
/// through its bits and a table rather than a branch per width: a prompt's ids mix one-, three-
/// and five-byte forms unpredictably (a branch per id cost about 6 ns of mispredictions, 0.8
/// ms for a 128k-token prompt). An id is read as its marker and the 8 bytes after it (of which
/// its width takes the first 0-8); near the body's end those come zero-padded, and an id
/// whose width runs past the end is refused.
fn ids(b: &[u8], at: &mut usize, out: &mut [u8]) -> Option<()> {
    let mut ok = true;
    for slot in out.chunks_exact_mut(4) {
        let (v, len, fits) = match b.get(*at..*at + 9) {
            Some(w) => id(w),
            None => {
                let rest = b.get(*at..).filter(|r| !r.is_empty())?;
                let mut w = [0u8; 9];
                w[..rest.len()].copy_from_slice(rest);
                id(&w)
            }
        };
        ok &= fits;
        *at += len;
        slot.copy_from_slice(&v.to_le_bytes());
    }
    (ok && *at <= b.len()).then_some(())
}

/// The token id whose marker starts `w` (at least 9 bytes: the marker and the 8 after it, of
/// which its width takes the first 0-8): its value, its length in bytes, and whether it is an
/// id at all (a non-negative integer of at most 32 bits' value).
#[inline(always)]
fn id(w: &[u8]) -> (u32, usize, bool) {
    let m = usize::from(w[0]);
    let after = u64::from_be_bytes([w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]]);
    // cc/d0: 1 byte, cd/d1: 2, ce/d2: 4, cf/d3: 8, from the marker's low bits (no table load
    // on the chain from one id's marker to the next id's); what this makes of a marker that
    // is no id, `ID_LIMIT` refuses.
    let payload = u32::from(m >= 0xcc) << (m & 3);
    // A fixint is its marker; a wider id the top `payload` bytes after it.
    let fix = if m < 0x80 { m as u64 } else { 0 };
    let v = (u128::from(after) >> (64 - 8 * payload)) as u64 | fix;
    (v as u32, 1 + payload as usize, v < ID_LIMIT[m])
}

/// Moves past one msgpack value of any type.
fn skip(b: &[u8], at: &mut usize, depth: u32) -> Option<()> {
    if depth > DEPTH_MAX {
        return None;
    }
    let m = *b.get(*at)?;
    *at += 1;
    let items = |b: &[u8], at: &mut usize, n: u64| -> Option<()> {
        for _ in 0..n {
            skip(b, at, depth + 1)?;
        }
        Some(())
    };
    match m {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Some(()),
        0x80..=0x8f => items(b, at, 2 * u64::from(m & 0x0f)),
        0x90..=0x9f => items(b, at, u64::from(m & 0x0f)),
        0xa0..=0xbf => advance(b, at, u64::from(m & 0x1f)),
        0xc4 | 0xd9 => {
            let n = be(b, at, 1)?;
            advance(b, at, n)
        }
        0xc5 | 0xda => {
            let n = be(b, at, 2)?;
            advance(b, at, n)
        }
        0xc6 | 0xdb => {
            let n = be(b, at, 4)?;
            advance(b, at, n)
        }
        // ext 8/16/32: a length, a type byte, the data.
        0xc7 => {
            let n = be(b, at, 1)?;
            advance(b, at, n + 1)
        }
        0xc8 => {
            let n = be(b, at, 2)?;
            advance(b, at, n + 1)
        }
        0xc9 => {
            let n = be(b, at, 4)?;
            advance(b, at, n + 1)
        }
        0xca => advance(b, at, 4),
        0xcb => advance(b, at, 8),
        0xcc | 0xd0 => advance(b, at, 1),
        0xcd | 0xd1 => advance(b, at, 2),
        0xce | 0xd2 => advance(b, at, 4),
        0xcf | 0xd3 => advance(b, at, 8),
        // fixext 1/2/4/8/16: a type byte and the data.
        0xd4 => advance(b, at, 2),
        0xd5 => advance(b, at, 3),
        0xd6 => advance(b, at, 5),
        0xd7 => advance(b, at, 9),
        0xd8 => advance(b, at, 17),
        0xdc => {
            let n = be(b, at, 2)?;
            items(b, at, n)
        }
        0xdd => {
            let n = be(b, at, 4)?;
            items(b, at, n)
        }
        0xde => {
            let n = be(b, at, 2)?;
            items(b, at, 2 * n)
        }
        0xdf => {
            let n = be(b, at, 4)?;
            items(b, at, 2 * n)
        }
        // 0xc1 is never used.
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rmpv::Value;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn le(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    /// A query map whose `token_ids` is `ids` (as `Value`s), among fields of every msgpack type.
    fn query(ids: Value) -> Value {
        Value::Map(vec![
            ("model".into(), "m".into()),
            (Value::from(7), Value::from(-3)),
            (
                "nested".into(),
                Value::Map(vec![("a".into(), Value::Array(vec![1.5.into(), Value::Nil]))]),
            ),
            ("blob".into(), Value::Binary(vec![9; 300])),
            ("ext".into(), Value::Ext(5, vec![1, 2, 3, 4])),
            ("token_ids".into(), ids),
            ("block_size".into(), 4.into()),
            ("cache_salt".into(), "s".repeat(70_000).into()),
        ])
    }

    #[test]
    fn every_integer_width_becomes_the_same_little_endian_bytes() {
        let ids = [0u32, 1, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
        // rmpv writes each id in its smallest unsigned width; signed and wider forms by hand.
        let mut forms: Vec<Value> = ids.iter().map(|&t| Value::from(t)).collect();
        forms.push(Value::from(5i64)); // still a fixint
        let body = encode(&query(Value::Array(forms)));
        let out = as_binary(&body).expect("rewritten");
        let v = rmpv::decode::read_value(&mut &out[..]).unwrap();
        let mut want = ids.to_vec();
        want.push(5);
        assert_eq!(v, query(Value::Binary(le(&want))));
        // int8..int64 and uint64 markers, non-negative, as other encoders write them.
        let mut hand = vec![0x81, 0xa9];
        hand.extend_from_slice(b"token_ids");
        hand.push(0x98);
        hand.extend_from_slice(&[
            0xd0, 5, 0xd1, 0, 6, 0xd2, 0, 0, 0, 7, 0xd3, 0, 0, 0, 0, 0, 0, 0, 8,
        ]);
        hand.extend_from_slice(&[
            0xcf, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xcc, 9, 0xcd, 0, 10, 0xce, 0, 0, 0, 11,
        ]);
        let out = as_binary(&hand).expect("rewritten");
        let v = rmpv::decode::read_value(&mut &out[..]).unwrap();
        let want = Value::Map(vec![(
            "token_ids".into(),
            Value::Binary(le(&[5, 6, 7, 8, u32::MAX, 9, 10, 11])),
        )]);
        assert_eq!(v, want);
    }

    #[test]
    fn anything_but_an_array_of_u32_ids_is_left_to_serde() {
        let leave = |ids: Value| as_binary(&encode(&query(ids)));
        assert!(leave(Value::Array(vec![1.into(), (-1).into()])).is_none(), "negative");
        assert!(
            leave(Value::Array(vec![Value::from(u64::from(u32::MAX) + 1)])).is_none(),
            "too big"
        );
        assert!(leave(Value::Array(vec![1.0.into()])).is_none(), "a float");
        assert!(leave(Value::Array(vec!["1".into()])).is_none(), "a string");
        assert!(leave(Value::Binary(le(&[1, 2]))).is_none(), "already binary");
        assert!(as_binary(&encode(&Value::Array(vec![]))).is_none(), "not a map");
        let no_ids = Value::Map(vec![("model".into(), "m".into())]);
        assert!(as_binary(&encode(&no_ids)).is_none());
        // Cut anywhere up to the array's last id, a body is never read past its end nor
        // rewritten.
        let ids = Value::Array((0..40u32).map(|t| Value::from(t * 1000)).collect());
        let Value::Map(mut fields) = query(ids) else { unreachable!() };
        fields.truncate(6); // token_ids last
        let body = encode(&Value::Map(fields));
        for cut in 0..body.len() {
            assert!(as_binary(&body[..cut]).is_none(), "cut at {cut} rewritten");
        }
        assert!(as_binary(&body).is_some());
        // A count larger than the body, and nesting past the bound.
        let mut huge = vec![0x81, 0xa9];
        huge.extend_from_slice(b"token_ids");
        huge.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 1]);
        assert!(as_binary(&huge).is_none());
        let mut deep = vec![0x82, 0xa1, b'x'];
        deep.extend(std::iter::repeat_n(0x91, 100));
        deep.push(0xc0);
        deep.extend_from_slice(&[0xa9]);
        deep.extend_from_slice(b"token_ids");
        deep.extend_from_slice(&[0x91, 1]);
        assert!(as_binary(&deep).is_none());
    }

    proptest! {
        /// Whatever widths the ids come in, the rewritten body holds exactly their LE bytes,
        /// and every other field unchanged.
        #[test]
        fn rewritten_bodies_hold_the_ids_and_the_rest(
            ids in proptest::collection::vec(any::<u32>(), 0..300),
        ) {
            let array = Value::Array(ids.iter().map(|&t| Value::from(t)).collect());
            let body = encode(&query(array));
            let out = as_binary(&body).expect("rewritten");
            let v = rmpv::decode::read_value(&mut &out[..]).unwrap();
            prop_assert_eq!(v, query(Value::Binary(le(&ids))));
        }
    }
}
