//! Block-hash chains of the inference engines, recomputed from token ids.
//!
//! The conductor answers "how many prefix tokens of this prompt does each instance hold" by
//! hashing the prompt the way the engine does and looking the hashes up in the index fed by the
//! engines' KV events. Everything here is pure computation: no IO, no async, no global state.
//!
//! # vLLM (v1, as of 0.33)
//!
//! The mechanism, transcribed from `vllm/v1/core/kv_cache_utils.py` and `vllm/utils/hashing.py`:
//!
//! - **Root.** `NONE_HASH = hash_fn(seed)` where `seed` is the *string* `PYTHONHASHSEED` if that
//!   variable is set. When it is unset, the cryptographic algorithms (`sha256`, `sha256_cbor`)
//!   use the fixed string `"vllm-none-hash"`, while the non-cryptographic ones (`xxhash`,
//!   `xxhash_cbor`) use 32 random bytes per process: their chains cannot be reproduced, so
//!   [`BlockHasher::new`] refuses them without a seed ([`HashError::SeedRequired`]).
//! - **Chain.** Block `i` covers tokens `[i*B, (i+1)*B)`; only full blocks are hashed (a partial
//!   trailing block has no hash). `hash[i] = hash_fn((parent, tuple(tokens), extra_keys))` with
//!   `parent = hash[i-1]`, or `NONE_HASH` for the first block.
//! - **Extra keys.** `None` when empty, else a tuple of tagged tuples in this order:
//!   `("lora", lora_name, lora_path)` on every block of a LoRA request, then (multimodal keys,
//!   not supported here), then `("cache_salt", salt)` on the first block only and only if the
//!   salt is non-empty (Python truthiness), then prompt-embeds keys (not supported here).
//! - **Serialisation.** `sha256`/`xxhash` hash `pickle.dumps(obj, protocol=5)`, `sha256_cbor`/
//!   `xxhash_cbor` hash `cbor2.dumps(obj, canonical=True)`. The digest is SHA-256 (32 bytes) or
//!   XXH3-128 with seed 0 in canonical big-endian form (`xxhash.xxh3_128_digest`, 16 bytes).
//! - **Events.** With `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (the default) `BlockStored` carries
//!   `int.from_bytes(digest, "big") & (2**64 - 1)`: the last 8 bytes, big-endian
//!   ([`project_low64_be`]); with `0` it carries the full digest ([`event_hash_to_u64`]).
//!   When a KV-cache group's block size is a multiple `k` of the hash block size, the engine
//!   hashes at the hash block size and publishes every `k`-th hash (the last one inside each
//!   group block): use `iter.skip(k - 1).step_by(k)`.
//!
//! The pickle bytes are encoded by hand for exactly these shapes (bytes, str, non-negative ints
//! below 2^32, `None`, tuples), including protocol-5 framing (a frame is committed at the start
//! of the next `save` once it holds 64 KiB; a bytes/str payload of 64 KiB or more is written
//! outside any frame) and the memo. CPython pickles a second reference to the same object as a
//! memo lookup (`BINGET`); the only repeated objects these shapes can hold are CPython's cached
//! one-character Latin-1 strings and the empty string (e.g. a LoRA name equal to its path
//! `"a"`), which are memoized by value here. Longer equal strings are assumed to be distinct
//! objects, as they are when vLLM decodes a request. The integration test
//! `tests/vllm_hash.rs` checks all of this byte for byte against Python and, where it is
//! installed, against vLLM's own functions.
//!
//! Not handled: multimodal and prompt-embeds extra keys, the speculative-decoding lookahead
//! (`num_hash_lookahead_tokens > 0` changes the extra keys), negative or >= 2^32 token ids, and
//! the mooncake/RFC rolling XXH3-64 scheme (no reference implementation was at hand to pin its
//! byte layout down, and an unverified transcription would be worse than none).
//!
//! # SGLang (as of 0.5.23)
//!
//! SGLang's published hashes are deterministic, not Python's salted `hash()`: the radix cache
//! (`sglang/srt/mem_cache/utils.py`, `cpp_utils/hash_binding.cpp`) chains
//! `SHA-256(parent_digest || u32-LE tokens of the page)` per page (a wide-token variant with a
//! `0xff` tag exists for ids >= 2^32), *including a partial trailing page*, seeds the chain with
//! `SHA-256("sglang-cache-salt-v1\0" || salt)` hex when a cache salt is set, publishes the first
//! 8 bytes of each digest as a signed int64, and then, when a LoRA extra key (or, in the
//! "dynamo" event format, a salt) is present, re-hashes each published id with a namespace
//! seed (`namespaced_block_hash`). It is therefore reproducible in principle, but the
//! namespace depends on engine-side LoRA registration and the event format, and this module
//! does not implement it yet: for SGLang instances the conductor indexes by the published
//! hashes only (and matches a prompt through the token ids carried in `BlockStored`).
//!
//! # Invariants
//!
//! - No function panics on any input; bad parameters are [`HashError`]s.
//! - A digest is 32 bytes (SHA-256) or 16 bytes (XXH3-128); the chain of a prompt is a pure
//!   function of (algorithm, seed, block size, tokens, extra keys).

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// The seed vLLM derives `NONE_HASH` from when `PYTHONHASHSEED` is unset and the algorithm is
/// cryptographic (`DEFAULT_NONE_HASH_SEED`).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Errors of this module.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HashError {
    /// The algorithm name is not one of vLLM's `prefix_caching_hash_algo` values.
    #[error(
        "unknown block-hash algorithm {0:?} (expected sha256, sha256_cbor, xxhash or xxhash_cbor)"
    )]
    UnknownAlgorithm(String),
    /// A block size of zero tokens.
    #[error("block size must be at least one token")]
    ZeroBlockSize,
    /// The algorithm draws a random per-process root when `PYTHONHASHSEED` is unset, so its
    /// chain cannot be reproduced without the seed.
    #[error("algorithm {0} uses a random per-process root unless PYTHONHASHSEED is set")]
    SeedRequired(Algorithm),
    /// An event's hash given as bytes is shorter than 8 bytes.
    #[error("event block hash has {len} bytes, at least 8 expected")]
    ShortDigest {
        /// The length found.
        len: usize,
    },
}

/// vLLM's `prefix_caching_hash_algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// SHA-256 of the pickle (protocol 5) of the block tuple; vLLM's default.
    Sha256,
    /// SHA-256 of the canonical CBOR of the block tuple.
    Sha256Cbor,
    /// XXH3-128 of the pickle of the block tuple.
    Xxhash,
    /// XXH3-128 of the canonical CBOR of the block tuple.
    XxhashCbor,
}

impl Algorithm {
    /// vLLM's name for the algorithm.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha256Cbor => "sha256_cbor",
            Algorithm::Xxhash => "xxhash",
            Algorithm::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Whether vLLM treats it as collision resistant (and so roots it at a fixed seed when
    /// `PYTHONHASHSEED` is unset).
    pub fn is_cryptographic(self) -> bool {
        matches!(self, Algorithm::Sha256 | Algorithm::Sha256Cbor)
    }

    /// Length of the digests in bytes.
    pub fn digest_len(self) -> usize {
        if self.is_cryptographic() { 32 } else { 16 }
    }

    fn hash(self, value: &Value<'_>) -> BlockDigest {
        let bytes = match self {
            Algorithm::Sha256 | Algorithm::Xxhash => pickle(value),
            Algorithm::Sha256Cbor | Algorithm::XxhashCbor => cbor(value),
        };
        self.digest(&bytes)
    }

    /// The digest of serialised bytes.
    fn digest(self, bytes: &[u8]) -> BlockDigest {
        if self.is_cryptographic() {
            BlockDigest::new(&Sha256::digest(bytes))
        } else {
            BlockDigest::new(&xxhash_rust::xxh3::xxh3_128(bytes).to_be_bytes())
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256" => Ok(Algorithm::Sha256),
            "sha256_cbor" => Ok(Algorithm::Sha256Cbor),
            "xxhash" => Ok(Algorithm::Xxhash),
            "xxhash_cbor" => Ok(Algorithm::XxhashCbor),
            other => Err(HashError::UnknownAlgorithm(other.to_owned())),
        }
    }
}

/// How an engine deployment hashes: what the conductor must know to reproduce its chains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashProfile {
    /// `--prefix-caching-hash-algo`.
    pub algorithm: Algorithm,
    /// The engine's `PYTHONHASHSEED`, exactly as the string in its environment; `None` if unset.
    pub python_hash_seed: Option<String>,
}

/// A LoRA adapter as it enters vLLM's block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraKey {
    /// `LoRARequest.lora_name`.
    pub name: String,
    /// `LoRARequest.lora_path`.
    pub path: String,
}

/// Per-request keys that vLLM mixes into block hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extra {
    /// The request's LoRA adapter; keys every block.
    pub lora: Option<LoraKey>,
    /// `cache_salt`; keys the first block only, and an empty salt counts as none.
    pub cache_salt: Option<String>,
}

/// A full block digest (32 bytes for SHA-256, 16 for XXH3-128), held inline: a chain makes one
/// per block (a 128k-token chain at block size 16: 1,285-1,298 us with a `Vec` per digest,
/// 1,157-1,168 inline).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    bytes: [u8; 32],
    len: u8,
}

impl BlockDigest {
    /// The digest `d`. Panics when `d` is longer than 32 bytes (no algorithm makes one).
    pub fn new(d: &[u8]) -> BlockDigest {
        let mut bytes = [0u8; 32];
        bytes[..d.len()].copy_from_slice(d);
        BlockDigest { bytes, len: d.len() as u8 }
    }
}

impl std::ops::Deref for BlockDigest {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.iter() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A profile made ready to hash: the algorithm and its root (`NONE_HASH`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHasher {
    algorithm: Algorithm,
    root: BlockDigest,
}

impl BlockHasher {
    /// Derives the root as vLLM's `init_none_hash` does.
    pub fn new(profile: &HashProfile) -> Result<Self, HashError> {
        let algorithm = profile.algorithm;
        let seed = match (&profile.python_hash_seed, algorithm.is_cryptographic()) {
            (Some(seed), _) => seed.as_str(),
            (None, true) => DEFAULT_NONE_HASH_SEED,
            (None, false) => return Err(HashError::SeedRequired(algorithm)),
        };
        let root = algorithm.hash(&Value::Str(seed));
        Ok(Self { algorithm, root })
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// vLLM's `NONE_HASH`: the parent of the first block.
    pub fn root(&self) -> &[u8] {
        &self.root
    }

    /// One step of the chain (`hash_block_tokens`): the digest of a full block given its
    /// parent's digest (`None` for the first block) and its keys. `first_block` decides whether
    /// the cache salt applies.
    pub fn hash_block(
        &self,
        parent: Option<&[u8]>,
        tokens: &[u32],
        extra: &Extra,
        first_block: bool,
    ) -> BlockDigest {
        self.hash_block_in(&mut ChainScratch::default(), parent, tokens, extra, first_block)
    }

    /// [`BlockHasher::hash_block`] serialising into `scratch` (its contents are replaced), so
    /// that a chain reuses one buffer.
    pub(crate) fn hash_block_in(
        &self,
        scratch: &mut ChainScratch,
        parent: Option<&[u8]>,
        tokens: &[u32],
        extra: &Extra,
        first_block: bool,
    ) -> BlockDigest {
        let parent = self.parent_or_root(parent);
        let keys = self.keys(extra, first_block);
        match self.algorithm {
            // Serialised into the chain's one buffer (a 128k-token prompt is half a megabyte of
            // CBOR per query), as `cbor_walk` writes the tuple `(parent, tokens, keys)` but with
            // no tuple built (with it and a fresh parent per block, a 128k-token chain at block
            // size 16 took 1,490-1,530 us; without both, 1,275-1,290), written by index into
            // room kept from block to block, and SHA-256 run on the padded message in place
            // (through `Digest`, with the buffer grown and cut per block, the chain took
            // 1,500-1,870 us at block size 16 and 847-873 at 512 on one VM, where this takes
            // 1,117-1,130 and 580-584, and the 16,384 dependent compressions alone 770).
            // The usual shape (no LoRA, no salt or not the first block, a 32-byte parent):
            // the message's heads written once for the chain (`CborChain`).
            Algorithm::Sha256Cbor if matches!(keys, Value::None) && parent.len() == 32 => {
                scratch.cbor.step(parent, tokens)
            }
            Algorithm::Sha256Cbor | Algorithm::XxhashCbor => {
                let scratch = &mut scratch.general;
                let mut tail = Vec::new();
                let tail: &[u8] = match &keys {
                    Value::None => &[0xf6],
                    k => {
                        cbor_walk(&mut tail, k);
                        &tail
                    }
                };
                let room = 1 + 9 + parent.len() + 9 + 5 * tokens.len() + tail.len() + 72;
                if scratch.len() < room {
                    scratch.resize(room, 0);
                }
                let mut p = put_head(scratch, 0, 4, 3);
                p = put_head(scratch, p, 2, parent.len() as u64);
                scratch[p..p + parent.len()].copy_from_slice(parent);
                p = put_tokens(scratch, p + parent.len(), tokens);
                scratch[p..p + tail.len()].copy_from_slice(tail);
                let len = p + tail.len();
                match self.algorithm {
                    Algorithm::Sha256Cbor => sha256_padded(&mut scratch[..room], len),
                    _ => self.algorithm.digest(&scratch[..len]),
                }
            }
            Algorithm::Sha256 | Algorithm::Xxhash => {
                let block = Value::Tuple(vec![Value::Bytes(parent), Value::Tokens(tokens), keys]);
                self.algorithm.hash(&block)
            }
        }
    }

    /// Whether [`BlockHasher::hash_block_encoded`] hashes the blocks of a chain with these
    /// extra keys (every block but a salted first one): `sha256_cbor` with no LoRA.
    pub(crate) fn takes_encoded(&self, extra: &Extra) -> bool {
        self.algorithm == Algorithm::Sha256Cbor && extra.lora.is_none()
    }

    /// [`BlockHasher::hash_block_in`] for a block whose tokens are already CBOR items (`items`,
    /// `tokens` of them; see [`crate::ahead`]), for chains where
    /// [`BlockHasher::takes_encoded`] holds, on blocks with no extra keys (not a first block
    /// with a cache salt).
    pub(crate) fn hash_block_encoded(
        &self,
        scratch: &mut ChainScratch,
        parent: Option<&[u8]>,
        tokens: usize,
        items: &[u8],
    ) -> BlockDigest {
        debug_assert_eq!(self.algorithm, Algorithm::Sha256Cbor);
        scratch.cbor.step_items(self.parent_or_root(parent), tokens, items)
    }

    /// vLLM replaces a falsy parent (None or b"") by `NONE_HASH`.
    fn parent_or_root<'p>(&'p self, parent: Option<&'p [u8]>) -> &'p [u8] {
        match parent {
            Some(p) if !p.is_empty() => p,
            _ => &self.root,
        }
    }

    /// A block's extra keys: `None`, or the tuple of its tagged keys.
    fn keys<'a>(&self, extra: &'a Extra, first_block: bool) -> Value<'a> {
        let mut keys = Vec::new();
        if let Some(lora) = &extra.lora {
            keys.push(Value::Tuple(vec![
                Value::Str("lora"),
                Value::Str(&lora.name),
                Value::Str(&lora.path),
            ]));
        }
        if let Some(salt) = extra.cache_salt.as_deref().filter(|s| first_block && !s.is_empty()) {
            keys.push(Value::Tuple(vec![Value::Str("cache_salt"), Value::Str(salt)]));
        }
        if keys.is_empty() { Value::None } else { Value::Tuple(keys) }
    }

    /// A lazy iterator over the digests of the full blocks of `tokens`, so that a lookup can
    /// stop at the first miss.
    pub fn iter<'a>(
        &'a self,
        tokens: &'a [u32],
        block_size: usize,
        extra: &'a Extra,
    ) -> Result<BlockHashIter<'a>, HashError> {
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        Ok(BlockHashIter {
            hasher: self,
            blocks: tokens.chunks_exact(block_size),
            extra,
            parent: None,
            scratch: ChainScratch::default(),
        })
    }

    /// The digests of all full blocks of `tokens`.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        extra: &Extra,
    ) -> Result<Vec<BlockDigest>, HashError> {
        Ok(self.iter(tokens, block_size, extra)?.collect())
    }
}

/// The digests of all full blocks of `tokens` under `profile` (one-shot form of
/// [`BlockHasher::block_hashes`]; build a [`BlockHasher`] once to hash many prompts).
pub fn block_hashes(
    profile: &HashProfile,
    tokens: &[u32],
    block_size: usize,
    extra: &Extra,
) -> Result<Vec<BlockDigest>, HashError> {
    BlockHasher::new(profile)?.block_hashes(tokens, block_size, extra)
}

/// Iterator over the digests of a prompt's full blocks, in order; see [`BlockHasher::iter`].
#[derive(Debug, Clone)]
pub struct BlockHashIter<'a> {
    hasher: &'a BlockHasher,
    blocks: std::slice::ChunksExact<'a, u32>,
    extra: &'a Extra,
    parent: Option<BlockDigest>,
    scratch: ChainScratch,
}

impl Iterator for BlockHashIter<'_> {
    type Item = BlockDigest;

    fn next(&mut self) -> Option<BlockDigest> {
        let block = self.blocks.next()?;
        let first = self.parent.is_none();
        let digest = self.hasher.hash_block_in(
            &mut self.scratch,
            self.parent.as_deref(),
            block,
            self.extra,
            first,
        );
        self.parent = Some(digest);
        Some(digest)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for BlockHashIter<'_> {}

/// The u64 vLLM publishes for a digest when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`:
/// `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last 8 bytes read big-endian.
/// A digest shorter than 8 bytes is zero-padded on the left, as that Python expression does
/// (vLLM's digests are 16 or 32 bytes, so this never happens for them).
pub fn project_low64_be(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// A block hash as a KV event carries it (msgpack int or bin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventHash<'a> {
    /// A non-negative msgpack int (vLLM's default int hashes).
    Unsigned(u64),
    /// A negative (or signed-typed) msgpack int (SGLang publishes signed int64).
    Signed(i64),
    /// A full digest (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(&'a [u8]),
}

/// Normalises an event's block hash to the u64 the index is keyed by: an unsigned int as is,
/// a signed int by its two's-complement bits (so `-1` and `u64::MAX` are the same block, as
/// they are the same 8 bytes), and bytes by their last 8 bytes big-endian, which equals
/// [`project_low64_be`] of the digest and so the int vLLM would have published for it. Bytes
/// shorter than 8 are rejected ([`HashError::ShortDigest`]): no engine publishes them, so they
/// mean a corrupt event.
pub fn event_hash_to_u64(hash: EventHash<'_>) -> Result<u64, HashError> {
    match hash {
        EventHash::Unsigned(v) => Ok(v),
        EventHash::Signed(v) => Ok(u64::from_ne_bytes(v.to_ne_bytes())),
        EventHash::Bytes(b) if b.len() < 8 => Err(HashError::ShortDigest { len: b.len() }),
        EventHash::Bytes(b) => Ok(project_low64_be(b)),
    }
}

/// The Python objects vLLM hashes, in the shapes it uses.
enum Value<'a> {
    None,
    Bytes(&'a [u8]),
    Str(&'a str),
    /// A tuple of ints.
    Tokens(&'a [u32]),
    Tuple(Vec<Value<'a>>),
}

/// Canonical CBOR as `cbor2.dumps(value, canonical=True)` writes these shapes.
fn cbor(value: &Value<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    cbor_walk(&mut out, value);
    out
}

/// A CBOR head: major type and argument, in the shortest form.
fn cbor_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let mut b = [0u8; 9];
    let len = put_head(&mut b, 0, major, n);
    out.extend_from_slice(&b[..len]);
}

/// Writes a CBOR head at `buf[p..]` (room for 9 bytes); returns where it ends.
fn put_head(buf: &mut [u8], p: usize, major: u8, n: u64) -> usize {
    let m = major << 5;
    match n {
        0..=23 => {
            buf[p] = m | n as u8;
            p + 1
        }
        24..=0xff => {
            buf[p..p + 2].copy_from_slice(&[m | 24, n as u8]);
            p + 2
        }
        0x100..=0xffff => {
            buf[p] = m | 25;
            buf[p + 1..p + 3].copy_from_slice(&(n as u16).to_be_bytes());
            p + 3
        }
        0x1_0000..=0xffff_ffff => {
            buf[p] = m | 26;
            buf[p + 1..p + 5].copy_from_slice(&(n as u32).to_be_bytes());
            p + 5
        }
        _ => {
            buf[p] = m | 27;
            buf[p + 1..p + 9].copy_from_slice(&n.to_be_bytes());
            p + 9
        }
    }
}

fn cbor_walk(out: &mut Vec<u8>, value: &Value<'_>) {
    match value {
        Value::None => out.push(0xf6),
        Value::Bytes(b) => {
            cbor_head(out, 2, b.len() as u64);
            out.extend_from_slice(b);
        }
        Value::Str(s) => {
            cbor_head(out, 3, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        Value::Tokens(t) => cbor_tokens(out, t),
        Value::Tuple(items) => {
            cbor_head(out, 4, items.len() as u64);
            for item in items {
                cbor_walk(out, item);
            }
        }
    }
}

/// A tuple of token ids: the bulk of every block, unsigned ints of at most 5 bytes each.
fn cbor_tokens(out: &mut Vec<u8>, t: &[u32]) {
    let start = out.len();
    out.resize(start + 9 + t.len() * 5, 0);
    let end = put_tokens(out, start, t);
    out.truncate(end);
}

/// Writes the tuple `t` at `buf[p..]` (room for 9 + 5 bytes a token, so no check per byte);
/// returns where it ends. (A branchless form, five bytes stored per token and 1, 2, 3 or 5
/// kept, measured slower: the chain of a 128k-token prompt took 595-609 us against 508-515.)
fn put_tokens(buf: &mut [u8], p: usize, t: &[u32]) -> usize {
    let p = put_head(buf, p, 4, t.len() as u64);
    put_token_values(buf, p, t)
}

/// The items of [`put_tokens`]'s array, without its head.
fn put_token_values(buf: &mut [u8], p: usize, t: &[u32]) -> usize {
    let mut p = p;
    for &tok in t {
        let w = &mut buf[p..p + 5];
        match tok {
            0..=23 => {
                w[0] = tok as u8;
                p += 1;
            }
            24..=0xff => {
                w[0] = 24;
                w[1] = tok as u8;
                p += 2;
            }
            0x100..=0xffff => {
                w[0] = 25;
                w[1..3].copy_from_slice(&(tok as u16).to_be_bytes());
                p += 3;
            }
            _ => {
                w[0] = 26;
                w[1..5].copy_from_slice(&tok.to_be_bytes());
                p += 5;
            }
        }
    }
    p
}

/// [`put_token_values`] for token ids given as little-endian 32-bit bytes (`le.len()` a
/// multiple of 4; room for 5 bytes a token at `buf[p..]`).
pub(crate) fn put_le_token_values(buf: &mut [u8], p: usize, le: &[u8]) -> usize {
    let mut ints = [0u32; 256];
    let mut p = p;
    for part in le.chunks(4 * ints.len()) {
        let n = part.len() / 4;
        for (t, c) in ints.iter_mut().zip(part.chunks_exact(4)) {
            *t = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        p = put_token_values(buf, p, &ints[..n]);
    }
    p
}

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// Room a chain's hashing reuses from block to block.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChainScratch {
    /// The CBOR of a block of any shape.
    general: Vec<u8>,
    cbor: CborChain,
}

/// The message of a `sha256_cbor` block with no extra keys, `[parent, tokens, None]`, kept
/// from block to block: the array's and the parent's heads (and the tokens' head while the
/// block size stays) are written once, so a block writes its parent, its tokens and the
/// padding. The chain of a 128k-token prompt at block size 16 took 1,020-1,039 us so against
/// 1,087-1,089 with every head written per block (`kvfs bench conductor`, alternated). It
/// stays a path of its own beside the general one: one kept message for every shape (any
/// parent length, keys written after the tokens) measured 1,059-1,102 us against 1,015-1,038.
#[derive(Debug, Clone, Default)]
struct CborChain {
    msg: Vec<u8>,
    /// Tokens per block the tokens' head was written for (`None`: no head written yet).
    tokens: Option<usize>,
    /// Where the tokens' items start.
    items_at: usize,
}

impl CborChain {
    /// SHA-256 of the CBOR of `(parent, tokens, None)`; `parent` is 32 bytes.
    fn step(&mut self, parent: &[u8], tokens: &[u32]) -> BlockDigest {
        self.start(parent, tokens.len());
        let p = put_token_values(&mut self.msg, self.items_at, tokens);
        self.finish(p)
    }

    /// [`CborChain::step`] for a block of `tokens` tokens whose CBOR items are `items`.
    fn step_items(&mut self, parent: &[u8], tokens: usize, items: &[u8]) -> BlockDigest {
        self.start(parent, tokens);
        let p = self.items_at + items.len();
        self.msg[self.items_at..p].copy_from_slice(items);
        self.finish(p)
    }

    /// The message's heads (written again only when the block size changes) and `parent`.
    fn start(&mut self, parent: &[u8], tokens: usize) {
        if self.tokens != Some(tokens) {
            self.msg.clear();
            self.msg.resize(3 + 32 + 9 + 5 * tokens + 1 + 72, 0);
            let p = put_head(&mut self.msg, 0, 4, 3);
            let p = put_head(&mut self.msg, p, 2, 32);
            debug_assert_eq!(p, 3);
            self.items_at = put_head(&mut self.msg, 35, 4, tokens as u64);
            self.tokens = Some(tokens);
        }
        self.msg[3..35].copy_from_slice(parent);
    }

    /// The keys (`None`) after the items ending at `p`, and the digest.
    fn finish(&mut self, p: usize) -> BlockDigest {
        self.msg[p] = 0xf6;
        sha256_padded(&mut self.msg, p + 1)
    }
}

/// SHA-256 of `buf[..len]`, padded in place: `buf` holds at least `len + 72` bytes, and the
/// bytes after `len` are overwritten.
fn sha256_padded(buf: &mut [u8], len: usize) -> BlockDigest {
    let total = (len + 9).div_ceil(64) * 64;
    buf[len] = 0x80;
    buf[len + 1..total - 8].fill(0);
    buf[total - 8..total].copy_from_slice(&(len as u64 * 8).to_be_bytes());
    let (blocks, _) = buf[..total].as_chunks::<64>();
    let mut state = SHA256_IV;
    sha2::block_api::compress256(&mut state, blocks);
    let mut d = [0u8; 32];
    for (b, w) in d.chunks_exact_mut(4).zip(state) {
        b.copy_from_slice(&w.to_be_bytes());
    }
    BlockDigest::new(&d)
}

/// `pickle.dumps(value, protocol=5)` as CPython's `_pickle` writes these shapes.
fn pickle(value: &Value<'_>) -> Vec<u8> {
    let mut p =
        Pickler { out: vec![0x80, 5], frame_start: None, memo_len: 0, memo_chars: Vec::new() };
    p.save(value);
    p.write(b".");
    p.commit_frame();
    p.out
}

const FRAME_HEADER_LEN: usize = 9;
const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;

struct Pickler {
    out: Vec<u8>,
    /// Offset of the open frame's 9-byte header placeholder.
    frame_start: Option<usize>,
    memo_len: u32,
    /// Memo ids of CPython's shared strings seen so far, keyed by their only char (None for "").
    memo_chars: Vec<(Option<char>, u32)>,
}

impl Pickler {
    fn write(&mut self, bytes: &[u8]) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend([0; FRAME_HEADER_LEN]);
        }
        self.out.extend_from_slice(bytes);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else { return };
        let len = self.out.len() - start - FRAME_HEADER_LEN;
        if len >= FRAME_SIZE_MIN {
            let mut header = [0u8; FRAME_HEADER_LEN];
            header[0] = 0x95;
            header[1..].copy_from_slice(&(len as u64).to_le_bytes());
            self.out[start..start + FRAME_HEADER_LEN].copy_from_slice(&header);
        } else {
            self.out.drain(start..start + FRAME_HEADER_LEN);
        }
    }

    /// A bytes/str opcode: payloads of 64 KiB or more bypass framing.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
        } else {
            self.write(header);
            self.write(data);
        }
    }

    fn memoize(&mut self) -> u32 {
        self.write(&[0x94]);
        self.memo_len += 1;
        self.memo_len - 1
    }

    /// CPython commits a frame holding 64 KiB or more when `save` starts on the next object.
    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start
            && self.out.len() - start - FRAME_HEADER_LEN >= FRAME_SIZE_TARGET
        {
            self.commit_frame();
        }
    }

    fn save(&mut self, value: &Value<'_>) {
        self.opcode_boundary();
        match value {
            Value::None => self.write(b"N"),
            Value::Bytes(b) => {
                let header = sized_header(b.len(), 0x43, 0x42, 0x8e);
                self.write_payload(&header, b);
                self.memoize();
            }
            Value::Str(s) => self.save_str(s),
            Value::Tokens(tokens) => {
                self.save_tuple(tokens.len(), |p, i| p.save_int(tokens[i]));
            }
            Value::Tuple(items) => self.save_tuple(items.len(), |p, i| p.save(&items[i])),
        }
    }

    fn save_int(&mut self, v: u32) {
        self.opcode_boundary();
        let b = v.to_le_bytes();
        match v {
            0..=0xff => self.write(&[0x4b, b[0]]),
            0x100..=0xffff => self.write(&[0x4d, b[0], b[1]]),
            0x1_0000..=0x7fff_ffff => self.write(&[0x4a, b[0], b[1], b[2], b[3]]),
            // LONG1: 5 little-endian bytes, the last a zero sign byte.
            _ => self.write(&[0x8a, 5, b[0], b[1], b[2], b[3], 0]),
        }
    }

    fn save_str(&mut self, s: &str) {
        let mut chars = s.chars();
        let shared = match (chars.next(), chars.next()) {
            (None, _) => Some(None),
            (Some(c), None) if u32::from(c) < 0x100 => Some(Some(c)),
            _ => None,
        };
        if let Some(key) = shared
            && let Some(&(_, id)) = self.memo_chars.iter().find(|(k, _)| *k == key)
        {
            match u8::try_from(id) {
                Ok(id) => self.write(&[0x68, id]),
                Err(_) => {
                    let mut op = vec![0x6a];
                    op.extend(id.to_le_bytes());
                    self.write(&op);
                }
            }
            return;
        }
        let header = sized_header(s.len(), 0x8c, 0x58, 0x8d);
        self.write_payload(&header, s.as_bytes());
        let id = self.memoize();
        if let Some(key) = shared {
            self.memo_chars.push((key, id));
        }
    }

    /// Protocol >= 2 tuples: `EMPTY_TUPLE`, `TUPLE1..3` or `MARK ... TUPLE`, then `MEMOIZE`.
    fn save_tuple(&mut self, len: usize, mut item: impl FnMut(&mut Self, usize)) {
        if len == 0 {
            self.write(b")");
            return;
        }
        if len > 3 {
            self.write(b"(");
        }
        for i in 0..len {
            item(self, i);
        }
        match len {
            1 => self.write(&[0x85]),
            2 => self.write(&[0x86]),
            3 => self.write(&[0x87]),
            _ => self.write(b"t"),
        }
        self.memoize();
    }
}

/// The opcode and length of a bytes/str payload: 1-byte, 4-byte or 8-byte length form.
fn sized_header(len: usize, short: u8, medium: u8, long: u8) -> Vec<u8> {
    if let Ok(n) = u8::try_from(len) {
        vec![short, n]
    } else if let Ok(n) = u32::try_from(len) {
        let mut h = vec![medium];
        h.extend(n.to_le_bytes());
        h
    } else {
        let mut h = vec![long];
        h.extend((len as u64).to_le_bytes());
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(algorithm: Algorithm, seed: Option<&str>) -> BlockHasher {
        let profile = HashProfile { algorithm, python_hash_seed: seed.map(str::to_owned) };
        BlockHasher::new(&profile).expect("valid profile")
    }

    #[test]
    fn pickle_matches_python_for_known_shapes() {
        // pickle.dumps("a", 5)
        assert_eq!(
            pickle(&Value::Str("a")),
            b"\x80\x05\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01a\x94."
        );
        // pickle.dumps((b"x"*32, (5,), None), 5)
        let parent = [b'x'; 32];
        let mut expected = b"\x80\x05\x95+\x00\x00\x00\x00\x00\x00\x00C ".to_vec();
        expected.extend(parent);
        expected.extend(b"\x94K\x05\x85\x94N\x87\x94.");
        let v = Value::Tuple(vec![Value::Bytes(&parent), Value::Tokens(&[5]), Value::None]);
        assert_eq!(pickle(&v), expected);
    }

    #[test]
    fn cbor_matches_cbor2_for_known_shapes() {
        // cbor2.dumps((b"x", (1, 24, 256, 70000, 2**32-1), (("lora", "a", "b"),)), canonical=True)
        let v = Value::Tuple(vec![
            Value::Bytes(b"x"),
            Value::Tokens(&[1, 24, 256, 70000, u32::MAX]),
            Value::Tuple(vec![Value::Tuple(vec![
                Value::Str("lora"),
                Value::Str("a"),
                Value::Str("b"),
            ])]),
        ]);
        let hex: String = cbor(&v).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "834178850118181901001a000111701affffffff8183646c6f726161616162");
    }

    /// Token tuples are what the general head writer gives each token, at every width boundary
    /// and for random ids.
    #[test]
    fn cbor_tokens_match_the_head_writer() {
        let mut ids: Vec<u32> = [0u32, 23, 24, 255, 256, 65_535, 65_536, u32::MAX - 1, u32::MAX]
            .into_iter()
            .chain((0..32).flat_map(|b| [(1u32 << b) - 1, 1 << b, (1 << b) + 1]))
            .collect();
        let mut x = 0x9e37_79b9u32;
        ids.extend((0..1000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x >> (x % 32)
        }));
        let mut want = Vec::new();
        cbor_head(&mut want, 4, ids.len() as u64);
        for &t in &ids {
            cbor_head(&mut want, 0, u64::from(t));
        }
        let mut got = vec![0xaa];
        cbor_tokens(&mut got, &ids);
        assert_eq!(got[0], 0xaa, "what came before is kept");
        assert_eq!(&got[1..], &want[..]);
    }

    /// SHA-256 padded in place equals the digest crate's at every length around the block
    /// and padding boundaries, whatever the buffer held after the message.
    #[test]
    fn sha256_padded_in_place_matches_sha256() {
        for len in 0..300usize {
            let msg: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut buf = msg.clone();
            buf.resize(len + 72, 0xa5);
            let want = Sha256::digest(&msg);
            assert_eq!(&sha256_padded(&mut buf, len)[..], &want[..], "length {len}");
            assert_eq!(&buf[..len], &msg[..], "the message is kept");
        }
    }

    #[test]
    fn the_kept_cbor_message_hashes_as_the_whole_encoding() {
        let mut chain = CborChain::default();
        let mut parent = [7u8; 32];
        // Block sizes change between steps (the tokens' head is rewritten), token values of
        // every CBOR width.
        for (i, len) in [16usize, 3, 16, 0, 40, 1, 16, 16].into_iter().enumerate() {
            let tokens: Vec<u32> = (0..len as u32)
                .map(|t| [5, 200, 40_000, 3_000_000][(t as usize + i) % 4])
                .collect();
            let mut whole = Vec::new();
            cbor_walk(
                &mut whole,
                &Value::Tuple(vec![Value::Bytes(&parent), Value::Tokens(&tokens), Value::None]),
            );
            let got = chain.step(&parent, &tokens);
            assert_eq!(&got[..], &Sha256::digest(&whole)[..], "step {i}, {len} tokens");
            parent.copy_from_slice(&got);
        }
    }

    #[test]
    fn zero_block_size_is_an_error() {
        let h = hasher(Algorithm::Sha256, None);
        assert_eq!(h.block_hashes(&[1, 2, 3], 0, &Extra::default()), Err(HashError::ZeroBlockSize));
        assert!(h.iter(&[], 0, &Extra::default()).is_err());
    }

    #[test]
    fn empty_and_partial_blocks_have_no_hash() {
        let h = hasher(Algorithm::Sha256Cbor, Some("0"));
        assert!(h.block_hashes(&[], 4, &Extra::default()).expect("ok").is_empty());
        assert!(h.block_hashes(&[1, 2, 3], 4, &Extra::default()).expect("ok").is_empty());
        let five = h.block_hashes(&[1, 2, 3, 4, 5], 4, &Extra::default()).expect("ok");
        let four = h.block_hashes(&[1, 2, 3, 4], 4, &Extra::default()).expect("ok");
        assert_eq!(five, four);
        assert_eq!(five.len(), 1);
        assert_eq!(h.iter(&[0; 9], 4, &Extra::default()).expect("ok").len(), 2);
    }

    #[test]
    fn chain_is_prefix_stable_and_salt_only_keys_the_first_block() {
        let h = hasher(Algorithm::Sha256, None);
        let tokens: Vec<u32> = (0..64).collect();
        let plain = h.block_hashes(&tokens, 16, &Extra::default()).expect("ok");
        let short = h.block_hashes(&tokens[..32], 16, &Extra::default()).expect("ok");
        assert_eq!(&plain[..2], &short[..]);
        let salted = Extra { cache_salt: Some("s".into()), ..Extra::default() };
        let s = h.block_hashes(&tokens, 16, &salted).expect("ok");
        assert_ne!(s[0], plain[0]);
        // Later blocks differ only through their parent.
        assert_eq!(h.hash_block(Some(&s[0]), &tokens[16..32], &salted, false), s[1]);
        assert_eq!(h.hash_block(Some(&s[0]), &tokens[16..32], &Extra::default(), false), s[1]);
        // An empty salt is no salt.
        let empty = Extra { cache_salt: Some(String::new()), ..Extra::default() };
        assert_eq!(h.block_hashes(&tokens, 16, &empty).expect("ok"), plain);
    }

    #[test]
    fn seeds_and_algorithms() {
        assert_eq!(
            BlockHasher::new(&HashProfile { algorithm: Algorithm::Xxhash, python_hash_seed: None }),
            Err(HashError::SeedRequired(Algorithm::Xxhash))
        );
        assert_eq!(hasher(Algorithm::XxhashCbor, Some("1")).root().len(), 16);
        assert_eq!(
            hasher(Algorithm::Sha256, None).root(),
            hasher(Algorithm::Sha256, Some(DEFAULT_NONE_HASH_SEED)).root()
        );
        assert_ne!(
            hasher(Algorithm::Sha256, None).root(),
            hasher(Algorithm::Sha256, Some("0")).root()
        );
        for name in ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] {
            assert_eq!(name.parse::<Algorithm>().expect("known").name(), name);
        }
        assert_eq!("md5".parse::<Algorithm>(), Err(HashError::UnknownAlgorithm("md5".into())));
    }

    #[test]
    fn projections() {
        let digest: Vec<u8> = (1..=32).collect();
        assert_eq!(project_low64_be(&digest), 0x191a_1b1c_1d1e_1f20);
        assert_eq!(project_low64_be(&[1, 2]), 0x0102);
        assert_eq!(project_low64_be(&[]), 0);
        assert_eq!(event_hash_to_u64(EventHash::Bytes(&digest)), Ok(0x191a_1b1c_1d1e_1f20));
        assert_eq!(
            event_hash_to_u64(EventHash::Bytes(&[1; 7])),
            Err(HashError::ShortDigest { len: 7 })
        );
        assert_eq!(event_hash_to_u64(EventHash::Signed(-1)), Ok(u64::MAX));
        assert_eq!(event_hash_to_u64(EventHash::Unsigned(7)), Ok(7));
    }
}
