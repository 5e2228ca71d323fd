//! The key arena: the bytes of every complete object's key, stored once, packed in chunks.
//!
//! Mechanism: a key is appended to the tail chunk (`CHUNK_BYTES`) as a LEB128 length and its
//! bytes, with no per-key allocation or header beyond that (1 byte for keys under 128 bytes);
//! objects hold a [`KeyAt`]: its position (`chunk << CHUNK_SHIFT | offset`, below 2^48) and,
//! for keys under 511 bytes, its length, so that a lookup can slice the key and compare it in
//! one step instead of reading the length first. A key longer than a chunk gets a chunk of
//! its own. Removing a key only counts its bytes as dead in its chunk:
//! a chunk whose keys are all dead is released (its number reused), and one more than half
//! dead (other than the tail) is to be compacted, which the caller does with
//! [`KeyArena::take_chunk`] (moving the live keys to the tail and updating their objects; the
//! arena does not know which object owns a key, the directory finds it through its index).
//!
//! So the arena holds at most twice its live bytes plus one chunk, and costs no allocation per
//! key. Positions change only by compaction. Not handled: anything but `str` keys of complete
//! objects (pending puts, loads and effects keep their own `Arc<str>`).

/// 64 KiB chunks: compacting one moves at most 32 KiB of keys. Unit tests use 1 KiB chunks so
/// that the directory's own tests compact too.
#[cfg(not(test))]
const CHUNK_SHIFT: u32 = 16;
#[cfg(test)]
const CHUNK_SHIFT: u32 = 10;
const CHUNK_BYTES: usize = 1 << CHUNK_SHIFT;

/// Where a key is: its position (bits 0..48) and its length if under 511 bytes (bits 48..57;
/// 511: read it from the arena). Fits in [`KeyAt::BITS`] bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct KeyAt(u64);

impl KeyAt {
    pub(super) const BITS: u32 = 57;
    const LEN_UNKNOWN: u64 = 511;

    fn new(pos: u64, len: usize) -> KeyAt {
        assert!(pos < 1 << 48, "key arena past 2^48 bytes");
        KeyAt(pos | (len as u64).min(Self::LEN_UNKNOWN) << 48)
    }

    pub(super) fn from_bits(bits: u64) -> KeyAt {
        KeyAt(bits & ((1 << Self::BITS) - 1))
    }

    pub(super) fn bits(self) -> u64 {
        self.0
    }

    fn pos(self) -> u64 {
        self.0 & ((1 << 48) - 1)
    }

    /// Whether the key may be `len` bytes long (without reading it).
    #[inline]
    pub(super) fn len_is(self, len: usize) -> bool {
        self.len().is_none_or(|l| l == len)
    }

    fn len(self) -> Option<usize> {
        let len = self.0 >> 48;
        (len < Self::LEN_UNKNOWN).then_some(len as usize)
    }
}

/// How much of a chunk is used, and by removed keys.
#[derive(Debug, Default, Clone, Copy)]
struct Fill {
    used: usize,
    dead: usize,
}

#[derive(Debug, Default)]
pub(super) struct KeyArena {
    /// The chunks' bytes (empty for a released chunk), apart from their fill so that reading
    /// a key reads 16 bytes of this table.
    data: Vec<Box<[u8]>>,
    fill: Vec<Fill>,
    /// Released chunk numbers, reused first.
    free: Vec<u32>,
    /// The chunk keys are appended to (`None` before the first key).
    tail: Option<u32>,
    /// Chunks more than half dead, for [`KeyArena::next_compaction`].
    to_compact: Vec<u32>,
    /// Sum of the chunks' sizes.
    chunk_bytes: u64,
}

impl KeyArena {
    /// Store a key; returns where it is.
    pub(super) fn push(&mut self, key: &[u8]) -> KeyAt {
        let need = varint_len(key.len()) + key.len();
        let chunk = match self.tail {
            _ if need > CHUNK_BYTES => self.new_chunk(need),
            Some(t) if self.fill[t as usize].used + need <= CHUNK_BYTES => t,
            old => {
                let t = self.new_chunk(CHUNK_BYTES);
                self.tail = Some(t);
                if let Some(old) = old {
                    self.settle(old);
                }
                t
            }
        };
        let offset = self.fill[chunk as usize].used;
        let bytes = &mut self.data[chunk as usize][offset..offset + need];
        let mut len = key.len();
        let mut at = 0;
        while len >= 0x80 {
            bytes[at] = len as u8 | 0x80;
            len >>= 7;
            at += 1;
        }
        bytes[at] = len as u8;
        bytes[at + 1..].copy_from_slice(key);
        self.fill[chunk as usize].used += need;
        KeyAt::new(position(chunk, offset), key.len())
    }

    /// The key at `at`.
    #[inline]
    pub(super) fn get(&self, at: KeyAt) -> &[u8] {
        let pos = at.pos();
        let chunk = &self.data[(pos >> CHUNK_SHIFT) as usize];
        let offset = (pos & (CHUNK_BYTES as u64 - 1)) as usize;
        match at.len() {
            Some(len) => {
                // `KeyAt` knows lengths under 511: a one or two byte header
                let start = offset + 1 + usize::from(len >= 0x80);
                &chunk[start..start + len]
            }
            None => entry(chunk, offset).0,
        }
    }

    /// Read the bytes at `at` and 64 bytes on, if any: the cache lines of its first 127 bytes.
    /// Lookups touch the keys they will compare this way in one loop, so that the misses
    /// overlap (see `Directory::find_group`).
    #[inline]
    pub(super) fn touch(&self, at: KeyAt) -> u8 {
        let pos = at.pos();
        let chunk = &self.data[(pos >> CHUNK_SHIFT) as usize];
        let offset = (pos & (CHUNK_BYTES as u64 - 1)) as usize;
        chunk.get(offset).copied().unwrap_or(0) ^ chunk.get(offset + 64).copied().unwrap_or(0)
    }

    /// Forget the key at `at`. Its chunk is released when nothing in it is live, and queued
    /// for compaction (`next_compaction`) when more than half of it is dead.
    pub(super) fn remove(&mut self, at: KeyAt) {
        let pos = at.pos();
        let n = (pos >> CHUNK_SHIFT) as u32;
        let offset = (pos & (CHUNK_BYTES as u64 - 1)) as usize;
        self.fill[n as usize].dead += entry(&self.data[n as usize], offset).1 - offset;
        if Some(n) != self.tail {
            self.settle(n);
        }
    }

    /// A chunk to compact with [`KeyArena::compact`], if any.
    pub(super) fn next_compaction(&mut self) -> Option<u32> {
        while let Some(n) = self.to_compact.pop() {
            let f = self.fill[n as usize];
            if Some(n) != self.tail && f.dead * 2 > f.used {
                return Some(n);
            }
        }
        None
    }

    /// Move chunk `n`'s live keys to the tail and release it. `owner` names the owner of a key
    /// (`None`: a dead key); returns every owner with its key's new place.
    pub(super) fn compact(
        &mut self,
        n: u32,
        mut owner: impl FnMut(KeyAt, &[u8]) -> Option<u32>,
    ) -> Vec<(u32, KeyAt)> {
        debug_assert_ne!(Some(n), self.tail, "the tail is never compacted");
        // `n` stays off the free list until the end, so no key moves into it meanwhile and
        // `owner` sees only old positions there
        let bytes = std::mem::take(&mut self.data[n as usize]);
        let used = std::mem::take(&mut self.fill[n as usize]).used;
        let mut moved = Vec::new();
        let mut at = 0;
        while at < used {
            let (key, next) = entry(&bytes, at);
            if let Some(id) = owner(KeyAt::new(position(n, at), key.len()), key) {
                moved.push((id, self.push(key)));
            }
            at = next;
        }
        self.chunk_bytes -= bytes.len() as u64;
        self.free.push(n);
        moved
    }

    /// Heap bytes: the chunks and the chunk tables.
    pub(super) fn heap_bytes(&self) -> u64 {
        let table = std::mem::size_of::<Box<[u8]>>() + std::mem::size_of::<Fill>();
        self.chunk_bytes
            + (self.data.capacity() * table) as u64
            + ((self.free.capacity() + self.to_compact.capacity()) * 4) as u64
    }

    /// Release a chunk (not the tail) with nothing live, or queue it when it is more than
    /// half dead.
    fn settle(&mut self, n: u32) {
        let f = self.fill[n as usize];
        if f.dead == f.used {
            self.chunk_bytes -= self.data[n as usize].len() as u64;
            self.data[n as usize] = Box::default();
            self.fill[n as usize] = Fill::default();
            self.free.push(n);
        } else if f.dead * 2 > f.used {
            self.to_compact.push(n);
        }
    }

    fn new_chunk(&mut self, size: usize) -> u32 {
        self.chunk_bytes += size as u64;
        let bytes = vec![0; size].into_boxed_slice();
        match self.free.pop() {
            Some(n) => {
                self.data[n as usize] = bytes;
                n
            }
            None => {
                self.data.push(bytes);
                self.fill.push(Fill::default());
                (self.data.len() - 1) as u32
            }
        }
    }
}

fn position(chunk: u32, offset: usize) -> u64 {
    (chunk as u64) << CHUNK_SHIFT | offset as u64
}

fn varint_len(mut len: usize) -> usize {
    let mut n = 1;
    while len >= 0x80 {
        len >>= 7;
        n += 1;
    }
    n
}

/// The key at `offset` of a chunk and the offset of the next entry.
#[inline]
fn entry(chunk: &[u8], offset: usize) -> (&[u8], usize) {
    let first = chunk[offset];
    if first < 0x80 {
        let end = offset + 1 + usize::from(first);
        return (&chunk[offset + 1..end], end);
    }
    let (mut len, mut shift, mut at) = (0usize, 0, offset);
    loop {
        let b = chunk[at];
        at += 1;
        len |= usize::from(b & 0x7f) << shift;
        if b < 0x80 {
            break;
        }
        shift += 7;
    }
    (&chunk[at..at + len], at + len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Compaction as the directory does it: owners found by position, positions updated.
    fn settle(arena: &mut KeyArena, live: &mut [(KeyAt, Vec<u8>)]) {
        while let Some(n) = arena.next_compaction() {
            let moved = arena.compact(n, |pos, key| {
                let i = live.iter().position(|(p, _)| *p == pos)?;
                assert_eq!(key, &live[i].1[..]);
                Some(i as u32)
            });
            for (i, pos) in moved {
                live[i as usize].0 = pos;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn keys_survive_removal_and_compaction(
            ops in prop::collection::vec((0u8..3, 1usize..400, any::<u8>()), 1..3000)
        ) {
            let mut arena = KeyArena::default();
            let mut live: Vec<(KeyAt, Vec<u8>)> = Vec::new();
            for (i, (op, len, byte)) in ops.into_iter().enumerate() {
                if op < 2 || live.is_empty() {
                    // now and then a key longer than a chunk
                    let len = if i % 500 == 7 { CHUNK_BYTES + len } else { len };
                    let key = vec![byte; len];
                    live.push((arena.push(&key), key));
                } else {
                    let (pos, _) = live.swap_remove(i % live.len());
                    arena.remove(pos);
                }
                settle(&mut arena, &mut live);
                if i % 64 == 0 {
                    for (pos, key) in &live {
                        prop_assert_eq!(arena.get(*pos), &key[..]);
                    }
                }
            }
            for (pos, key) in &live {
                prop_assert_eq!(arena.get(*pos), &key[..]);
            }
            // every chunk but the tail is at least half live (its unused end is shorter than
            // a key)
            let live_bytes: usize = live.iter().map(|(_, k)| k.len() + 2).sum();
            let chunks = arena.data.iter().filter(|c| !c.is_empty()).count();
            prop_assert!(
                arena.chunk_bytes as usize <= 2 * (live_bytes + chunks * 402) + CHUNK_BYTES,
                "{} bytes held for {live_bytes} live", arena.chunk_bytes
            );
            while let Some((pos, _)) = live.pop() {
                arena.remove(pos);
                settle(&mut arena, &mut live);
            }
            prop_assert!(arena.chunk_bytes as usize <= CHUNK_BYTES);
        }
    }

    #[test]
    fn lengths_are_leb128() {
        let mut arena = KeyArena::default();
        let long = vec![b'x'; 300];
        let a = arena.push(b"");
        let b = arena.push(&long);
        let c = arena.push(b"k");
        assert_eq!((arena.get(a), arena.get(b), arena.get(c)), (&b""[..], &long[..], &b"k"[..]));
        assert_eq!(c.pos() - b.pos(), 2 + 300);
        assert_eq!((a.len(), b.len(), c.len()), (Some(0), Some(300), Some(1)));
        let huge = vec![b'y'; 600];
        let d = arena.push(&huge);
        assert_eq!((d.len(), arena.get(d)), (None, &huge[..]));
    }
}
