//! The key arena: the bytes of every complete object's key, stored once, packed in chunks.
//!
//! Mechanism: a key is appended to the tail chunk (`CHUNK_BYTES`) as a LEB128 length and its
//! bytes, with no per-key allocation or header beyond that (1 byte for keys under 128 bytes);
//! objects hold its position (`chunk << CHUNK_SHIFT | offset`, below 2^48). A key longer than
//! a chunk gets a chunk of its own. Removing a key only counts its bytes as dead in its chunk:
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

#[derive(Debug, Default)]
struct Chunk {
    bytes: Vec<u8>,
    /// Bytes of removed keys.
    dead: usize,
}

#[derive(Debug, Default)]
pub(super) struct KeyArena {
    chunks: Vec<Chunk>,
    /// Released chunk numbers, reused first.
    free: Vec<u32>,
    /// The chunk keys are appended to (`None` before the first key).
    tail: Option<u32>,
    /// Chunks more than half dead, for [`KeyArena::next_compaction`].
    to_compact: Vec<u32>,
    /// Sum of the chunks' capacities.
    chunk_bytes: u64,
}

impl KeyArena {
    /// Store a key; returns its position.
    pub(super) fn push(&mut self, key: &[u8]) -> u64 {
        let need = varint_len(key.len()) + key.len();
        let chunk = match self.tail {
            _ if need > CHUNK_BYTES => self.new_chunk(need),
            Some(t) if self.chunks[t as usize].bytes.len() + need <= CHUNK_BYTES => t,
            old => {
                let t = self.new_chunk(CHUNK_BYTES);
                self.tail = Some(t);
                if let Some(old) = old {
                    self.settle(old);
                }
                t
            }
        };
        let bytes = &mut self.chunks[chunk as usize].bytes;
        let offset = bytes.len();
        let mut len = key.len();
        while len >= 0x80 {
            bytes.push(len as u8 | 0x80);
            len >>= 7;
        }
        bytes.push(len as u8);
        bytes.extend_from_slice(key);
        position(chunk, offset)
    }

    /// The key at `pos`.
    pub(super) fn get(&self, pos: u64) -> &[u8] {
        let chunk = &self.chunks[(pos >> CHUNK_SHIFT) as usize].bytes;
        entry(chunk, (pos & (CHUNK_BYTES as u64 - 1)) as usize).0
    }

    /// Forget the key at `pos`. Its chunk is released when nothing in it is live, and queued
    /// for compaction (`next_compaction`) when more than half of it is dead.
    pub(super) fn remove(&mut self, pos: u64) {
        let n = (pos >> CHUNK_SHIFT) as u32;
        let offset = (pos & (CHUNK_BYTES as u64 - 1)) as usize;
        let chunk = &mut self.chunks[n as usize];
        chunk.dead += entry(&chunk.bytes, offset).1 - offset;
        if Some(n) != self.tail {
            self.settle(n);
        }
    }

    /// A chunk to compact with [`KeyArena::compact`], if any.
    pub(super) fn next_compaction(&mut self) -> Option<u32> {
        while let Some(n) = self.to_compact.pop() {
            let c = &self.chunks[n as usize];
            if Some(n) != self.tail && c.dead * 2 > c.bytes.len() {
                return Some(n);
            }
        }
        None
    }

    /// Move chunk `n`'s live keys to the tail and release it. `owner` names the owner of the
    /// key at a position (`None`: a dead key); returns every owner with its key's new position.
    pub(super) fn compact(
        &mut self,
        n: u32,
        mut owner: impl FnMut(u64, &[u8]) -> Option<u32>,
    ) -> Vec<(u32, u64)> {
        debug_assert_ne!(Some(n), self.tail, "the tail is never compacted");
        // `n` stays off the free list until the end, so no key moves into it meanwhile and
        // `owner` sees only old positions there
        let bytes = std::mem::take(&mut self.chunks[n as usize].bytes);
        let mut moved = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let (key, next) = entry(&bytes, at);
            if let Some(id) = owner(position(n, at), key) {
                moved.push((id, self.push(key)));
            }
            at = next;
        }
        self.chunk_bytes -= bytes.capacity() as u64;
        self.chunks[n as usize].dead = 0;
        self.free.push(n);
        moved
    }

    /// Heap bytes: the chunks and the chunk table.
    pub(super) fn heap_bytes(&self) -> u64 {
        self.chunk_bytes
            + (self.chunks.capacity() * std::mem::size_of::<Chunk>()) as u64
            + ((self.free.capacity() + self.to_compact.capacity()) * 4) as u64
    }

    /// Release a chunk (not the tail) with nothing live, or queue it when it is more than
    /// half dead.
    fn settle(&mut self, n: u32) {
        let chunk = &mut self.chunks[n as usize];
        if chunk.dead == chunk.bytes.len() {
            self.chunk_bytes -= chunk.bytes.capacity() as u64;
            *chunk = Chunk::default();
            self.free.push(n);
        } else if chunk.dead * 2 > chunk.bytes.len() {
            self.to_compact.push(n);
        }
    }

    fn new_chunk(&mut self, capacity: usize) -> u32 {
        self.chunk_bytes += capacity as u64;
        let chunk = Chunk { bytes: Vec::with_capacity(capacity), dead: 0 };
        match self.free.pop() {
            Some(n) => {
                self.chunks[n as usize] = chunk;
                n
            }
            None => {
                self.chunks.push(chunk);
                (self.chunks.len() - 1) as u32
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
fn entry(chunk: &[u8], offset: usize) -> (&[u8], usize) {
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
    fn settle(arena: &mut KeyArena, live: &mut [(u64, Vec<u8>)]) {
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
            let mut live: Vec<(u64, Vec<u8>)> = Vec::new();
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
            let chunks = arena.chunks.iter().filter(|c| c.bytes.capacity() > 0).count();
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
        assert_eq!(c - b, 2 + 300);
    }
}
