//! The engines' KV events, decoded from their msgpack batches into one shape.
//!
//! Formats (checked against the engines' sources: vLLM `vllm/distributed/kv_events.py`, SGLang
//! `sglang/srt/disaggregation/kv_events.py`, and the reference store's publisher):
//! - a batch is a positional array `[ts, events, dp_rank]` (the rank may be missing or nil);
//!   the reference store publishes the same envelope;
//! - an event is either a tagged map (`{"type": "BlockStored", "block_hashes": [...], ...}`,
//!   newer vLLM and SGLang: optional fields at their default are left out) or a positional
//!   array whose first element is the tag (`["BlockStored", hashes, parent, token_ids,
//!   block_size, lora_id, medium]`, older vLLM and SGLang);
//! - a block hash is an integer (signed or unsigned 64-bit: both name the same 64 bits) or
//!   bytes (vLLM's full digests: the last 8 bytes, big-endian, as the reference projects them);
//! - media: vLLM `GPU`/`CPU`/`STORAGE`, SGLang `GPU`/`CPU_PINNED`/`DISK`/`EXTERNAL`, the
//!   reference store `cpu`/`disk`; no medium means the engine's GPU.
//!
//! Unknown event types are skipped (counted by the caller), never fatal: an engine that adds a
//! new event must not stop the index. A batch that is not msgpack, or an event with a field of
//! the wrong type, is an error naming what was wrong.

use rmpv::Value;

/// Where a block lives, from fastest to slowest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Medium {
    /// The engine's accelerator memory.
    Gpu,
    /// Host memory: the engine's own offload, or the pool's DRAM.
    Cpu,
    /// NVMe, disk or object storage: the engine's own, or the pool's.
    Disk,
}

impl Medium {
    pub const ALL: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Disk];

    /// Parses the engines' medium names (case-insensitive); `None` for unknown names.
    pub fn parse(name: &str) -> Option<Medium> {
        match name.to_ascii_uppercase().as_str() {
            "GPU" | "HBM" | "DEVICE" => Some(Medium::Gpu),
            "CPU" | "CPU_PINNED" | "DRAM" | "MEMORY" => Some(Medium::Cpu),
            "DISK" | "STORAGE" | "SSD" | "NVME" | "EXTERNAL" | "OBJECT" | "LOCAL_DISK" => {
                Some(Medium::Disk)
            }
            _ => None,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored {
        /// Normalised block hashes, in chain order.
        hashes: Vec<u64>,
        parent: Option<u64>,
        /// The blocks' tokens, when the publisher sends them (vLLM and SGLang do): the
        /// conductor learns the chain steps of token queries from them.
        token_ids: Vec<u32>,
        block_size: Option<u32>,
        medium: Medium,
        lora_name: Option<String>,
    },
    Removed {
        hashes: Vec<u64>,
        medium: Medium,
    },
    /// Every block of the publisher (all media) is gone.
    Cleared,
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    /// Events of an unknown type, skipped.
    pub skipped: usize,
    pub dp_rank: Option<u32>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("bad kv event batch: {0}")]
pub struct DecodeError(pub String);

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError(msg.into())
}

/// The 64 bits a published block hash stands for: an integer as is (two's complement for
/// negative ones), bytes by their last 8 (big-endian; shorter ones zero-extended on the left).
pub fn hash_of(v: &Value) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| bad("block hash out of range")),
        Value::Binary(b) => Ok(bytes_hash(b)),
        other => Err(bad(format!("block hash of type {}", kind(other)))),
    }
}

/// The last 8 bytes of `b`, big-endian (shorter inputs zero-extended on the left).
pub fn bytes_hash(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "bool",
        Value::Integer(_) => "int",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(_) => "str",
        Value::Binary(_) => "bin",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

/// Decodes one msgpack batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| bad(format!("not msgpack: {e}")))?;
    if !rd.is_empty() {
        return Err(bad(format!("{} trailing bytes after the batch", rd.len())));
    }
    let Value::Array(items) = v else {
        return Err(bad(format!("batch is a {}, not an array", kind(&v))));
    };
    let ts = match items.first() {
        Some(Value::F64(x)) => *x,
        Some(Value::F32(x)) => f64::from(*x),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        Some(other) => return Err(bad(format!("batch timestamp of type {}", kind(other)))),
        None => return Err(bad("empty batch array")),
    };
    let events = match items.get(1) {
        Some(Value::Array(e)) => e,
        Some(other) => return Err(bad(format!("batch events of type {}", kind(other)))),
        None => return Err(bad("batch without events")),
    };
    let dp_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => Some(
            i.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| bad("dp rank out of range"))?,
        ),
        Some(other) => return Err(bad(format!("dp rank of type {}", kind(other)))),
    };
    let mut out = Batch { ts, events: Vec::with_capacity(events.len()), skipped: 0, dp_rank };
    for (i, e) in events.iter().enumerate() {
        match decode_event(e).map_err(|err| bad(format!("event {i}: {}", err.0)))? {
            Some(ev) => out.events.push(ev),
            None => out.skipped += 1,
        }
    }
    Ok(out)
}

/// The fields of one event, whichever shape it came in: by name in a map, by position in an
/// array.
enum Fields<'a> {
    Map(&'a [(Value, Value)]),
    Array(&'a [Value]),
}

impl<'a> Fields<'a> {
    fn new(v: &'a Value) -> Result<Fields<'a>, DecodeError> {
        match v {
            Value::Map(m) => Ok(Fields::Map(m)),
            Value::Array(a) => Ok(Fields::Array(a)),
            other => Err(bad(format!("event of type {}", kind(other)))),
        }
    }

    fn named(m: &'a [(Value, Value)], name: &str) -> Option<&'a Value> {
        m.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
    }

    /// The event's kind. The reference store's contract (RFC 1527) names it `event_type`
    /// (stored/removed/cleared); its legacy alias is the engines' `type`.
    fn tag(&self) -> Result<&'a str, DecodeError> {
        match self {
            Fields::Map(m) => match Self::named(m, "type").and_then(Value::as_str) {
                Some(t) => Ok(t),
                None => match Self::named(m, "event_type").and_then(Value::as_str) {
                    Some("stored") => Ok("BlockStored"),
                    Some("removed") => Ok("BlockRemoved"),
                    Some("cleared") => Ok("AllBlocksCleared"),
                    Some(other) => Ok(other),
                    None => Err(bad("event map without a \"type\" or \"event_type\"")),
                },
            },
            Fields::Array(a) => a
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| bad("event array without a tag string first")),
        }
    }

    /// The field `name` of a map, or the one at `pos` of an array (`seq_hashes`, the reference
    /// store's name, stands in for a missing `block_hashes`).
    fn get(&self, name: &str, pos: usize) -> Option<&'a Value> {
        match self {
            Fields::Map(m) => Self::named(m, name).or_else(|| {
                (name == "block_hashes").then(|| Self::named(m, "seq_hashes")).flatten()
            }),
            Fields::Array(a) => a.get(pos),
        }
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, DecodeError> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash_of).collect(),
        Some(other) => Err(bad(format!("block_hashes of type {}", kind(other)))),
        None => Err(bad("missing block_hashes")),
    }
}

fn token_ids(v: Option<&Value>) -> Result<Vec<u32>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad(format!("token id {t} is not a 32-bit unsigned int")))
            })
            .collect(),
        Some(other) => Err(bad(format!("token_ids of type {}", kind(other)))),
    }
}

fn medium(v: Option<&Value>) -> Result<Medium, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(Medium::Gpu),
        Some(Value::String(s)) => {
            let s = s.as_str().ok_or_else(|| bad("medium is not utf-8"))?;
            Medium::parse(s).ok_or_else(|| bad(format!("unknown medium {s:?}")))
        }
        Some(other) => Err(bad(format!("medium of type {}", kind(other)))),
    }
}

fn opt_str(v: Option<&Value>, what: &str) -> Result<Option<String>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => {
            Ok(Some(s.as_str().ok_or_else(|| bad(format!("{what} is not utf-8")))?.to_string()))
        }
        Some(other) => Err(bad(format!("{what} of type {}", kind(other)))),
    }
}

/// One event; `None` for an event type this index does not use.
fn decode_event(v: &Value) -> Result<Option<Event>, DecodeError> {
    let f = Fields::new(v)?;
    // Positions in the array form: [tag, block_hashes, parent, token_ids, block_size,
    // lora_id, medium, (lora_name)] for BlockStored, [tag, block_hashes, medium] for
    // BlockRemoved.
    match f.tag()? {
        "BlockStored" => {
            let parent = match f.get("parent_block_hash", 2) {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash_of(h)?),
            };
            let block_size = match f.get("block_size", 4) {
                None | Some(Value::Nil) => None,
                Some(Value::Integer(i)) => Some(
                    i.as_u64()
                        .and_then(|b| u32::try_from(b).ok())
                        .filter(|&b| b > 0)
                        .ok_or_else(|| bad("block_size out of range"))?,
                ),
                Some(other) => return Err(bad(format!("block_size of type {}", kind(other)))),
            };
            Ok(Some(Event::Stored {
                hashes: hashes(f.get("block_hashes", 1))?,
                parent,
                token_ids: token_ids(f.get("token_ids", 3))?,
                block_size,
                medium: medium(f.get("medium", 6))?,
                lora_name: opt_str(f.get("lora_name", 7), "lora_name")?,
            }))
        }
        "BlockRemoved" => Ok(Some(Event::Removed {
            hashes: hashes(f.get("block_hashes", 1))?,
            medium: medium(f.get("medium", 2))?,
        })),
        "AllBlocksCleared" => Ok(Some(Event::Cleared)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn tagged_maps_and_positional_arrays_decode_alike() {
        let map = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(1u64), Value::from(-2i64)])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![Value::from(5u64)])),
            (s("block_size"), Value::from(16u64)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
        ]);
        let arr = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(1u64), Value::from(-2i64)]),
            Value::Nil,
            Value::Array(vec![Value::from(5u64)]),
            Value::from(16u64),
            Value::Nil,
            s("GPU"),
        ]);
        for ev in [map, arr] {
            let b = decode_batch(&enc(&Value::Array(vec![
                Value::F64(1.5),
                Value::Array(vec![ev]),
                Value::from(3u64),
            ])))
            .unwrap();
            assert_eq!(b.dp_rank, Some(3));
            assert_eq!(
                b.events,
                vec![Event::Stored {
                    hashes: vec![1, (-2i64) as u64],
                    parent: None,
                    token_ids: vec![5],
                    block_size: Some(16),
                    medium: Medium::Gpu,
                    lora_name: None
                }]
            );
        }
    }

    #[test]
    fn the_reference_stores_contract_decodes() {
        let ev = Value::Map(vec![
            (s("event_type"), s("stored")),
            (s("seq_hashes"), Value::Array(vec![Value::from(42u64)])),
            (s("medium"), s("disk")),
            (s("object_key"), s("42")),
        ]);
        let b = decode_batch(&enc(&Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![ev, Value::Map(vec![(s("event_type"), s("cleared"))])]),
        ])))
        .unwrap();
        assert_eq!(
            b.events,
            vec![
                Event::Stored {
                    hashes: vec![42],
                    parent: None,
                    token_ids: Vec::new(),
                    block_size: None,
                    medium: Medium::Disk,
                    lora_name: None
                },
                Event::Cleared
            ]
        );
    }

    #[test]
    fn byte_hashes_project_to_their_last_eight_bytes() {
        let digest: Vec<u8> = (0u8..32).collect();
        assert_eq!(hash_of(&Value::Binary(digest)).unwrap(), 0x18191a1b1c1d1e1f);
        assert_eq!(bytes_hash(&[1, 2]), 0x0102);
    }

    #[test]
    fn bad_input_is_an_error_and_unknown_events_are_skipped() {
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&enc(&Value::from(1u64))).is_err());
        let unknown = Value::Map(vec![(s("type"), s("SomethingNew"))]);
        let b = decode_batch(&enc(&Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![unknown, Value::Array(vec![s("AllBlocksCleared")])]),
        ])))
        .unwrap();
        assert_eq!((b.skipped, b.events.clone(), b.dp_rank), (1, vec![Event::Cleared], None));
        let wrong = Value::Map(vec![(s("type"), s("BlockRemoved")), (s("block_hashes"), s("x"))]);
        let e = decode_batch(&enc(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![wrong])])))
            .unwrap_err();
        assert!(e.0.contains("block_hashes"), "{e}");
        let medium = Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![])),
            (s("medium"), s("TAPE")),
        ]);
        assert!(
            decode_batch(&enc(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![medium])])))
                .is_err()
        );
        for tokens in [Value::Array(vec![Value::from(-1i64)]), Value::from(1u64 << 32), s("x")] {
            let ev = Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), Value::Array(vec![Value::from(1u64)])),
                (s("token_ids"), Value::Array(vec![tokens])),
            ]);
            let e =
                decode_batch(&enc(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])])))
                    .unwrap_err();
            assert!(e.0.contains("token id"), "{e}");
        }
    }
}
