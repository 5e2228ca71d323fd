//! The storage-medium trait and the metadata every medium keeps per object.
//!
//! Mechanism: a [`Medium`] stores whole, immutable objects by key. Every object carries an
//! [`ObjectMeta`]: size, blake3 of the bytes, persistence mode and the time it was stored.
//! The medium computes (or, for memory tiers, may be told) the checksum at `put` and keeps it
//! next to the bytes; media that declare [`Capabilities::verifies_reads`] re-hash on every read
//! and return `Corrupt` on a mismatch.
//!
//! Policy decided here, for every medium:
//! - Keys are UTF-8, 1..=[`KEY_BYTES_MAX`] bytes, any characters (including `/` and NUL-free
//!   anything); media map them to safe names themselves (blake3 of the key), so no key is
//!   rejected for its characters.
//! - Zero-length objects are allowed. Mooncake refuses size 0, but the FUSE namespace must
//!   let `cp -r` copy empty files, and nothing in a tier needs a byte to exist.
//! - `put` with [`PutMode::CreateNew`] fails with `AlreadyExists` on an existing key and leaves
//!   the first value; [`PutMode::Overwrite`] replaces it atomically (readers see the old or the
//!   new object, never a mix). First-writer-wins at the store level is the master's job.
//!   A create racing another create of the same key in progress gets `AlreadyExists` at once
//!   (even if the first then fails): exactly one of N racing creators succeeds.
//! - `get_into` needs a destination at least as long as the object (`InvalidArgument`
//!   otherwise, naming the size) and fills its first `size` bytes.
//!
//! - `rename(from, to)` moves the bytes to a new key without changing them (size, checksum,
//!   persistence, pin and stored-at time are kept); the copy takes the master's new version and
//!   records its previous name `(from, old version)`, which [`Medium::previous_name`] reports.
//!   `CreateNew` fails with `AlreadyExists` when `to` is present (or being created),
//!   `Overwrite` replaces `to` atomically; renaming a key onto itself is `InvalidArgument`.
//!
//! Renames and crashes: memory media re-key their index (atomic, nothing survives a crash
//! anyway). NVMe links the data file under the new name and commits the new header before the
//! old name goes; object storage copies then deletes. A crash in between leaves both copies,
//! `from@v1` and `to@v2` naming `(from, v1)`: [`stale_after_rename`] is the one rule every
//! lister applies (NVMe's `open`, the master's scan of the bucket) to keep only `to`.
//!
//! Not handled: partial reads of an object, appends, leases and pins (master and node).

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;

use crate::error::{Error, ErrorKind, Result};

/// Longest key a medium accepts, in bytes.
pub const KEY_BYTES_MAX: usize = 4096;

/// Where the object must end up beyond this node (DESIGN.md section 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Persistence {
    /// Never written to object storage.
    #[default]
    None,
    /// Written back in the background from the crash-safe queue.
    Lazy,
    /// Written to object storage before the put completes.
    Eager,
}

impl Persistence {
    pub fn to_u8(self) -> u8 {
        match self {
            Persistence::None => 0,
            Persistence::Lazy => 1,
            Persistence::Eager => 2,
        }
    }

    pub fn from_u8(v: u8) -> Result<Self> {
        match v {
            0 => Ok(Persistence::None),
            1 => Ok(Persistence::Lazy),
            2 => Ok(Persistence::Eager),
            other => {
                Err(Error::new(ErrorKind::Corrupt, format!("unknown persistence code {other}")))
            }
        }
    }
}

/// What a medium knows about one stored object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Length of the object's bytes.
    pub size_bytes: u64,
    /// blake3 of the object's bytes.
    pub checksum: [u8; 32],
    pub persistence: Persistence,
    /// When the medium stored it, milliseconds since the Unix epoch (wall clock of the writer).
    pub stored_at_unix_ms: u64,
    /// The store's version of the object (the master's; opaque here), kept so that a restarted
    /// node or a rebuilt master can tell old copies from new ones. 0 when none was given.
    pub version: u64,
    /// The store's pin code (opaque here), kept for the same reason.
    pub pin: u8,
}

/// Whether a put may replace an existing object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PutMode {
    /// Fail with `AlreadyExists` if the key is present.
    #[default]
    CreateNew,
    /// Replace atomically (upsert).
    Overwrite,
}

/// Options of [`Medium::put`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    pub mode: PutMode,
    pub persistence: Persistence,
    /// The blake3 the writer computed. Verifying media (NVMe, object storage) hash anyway and
    /// refuse the put with `Corrupt` when it differs; memory media (DRAM, HBM) trust it and skip
    /// hashing, because hashing costs about 2 GB/s per core, far below a memcpy.
    pub checksum: Option<[u8; 32]>,
    /// Stored with the object and returned in its [`ObjectMeta`].
    pub version: u64,
    /// Stored with the object and returned in its [`ObjectMeta`].
    pub pin: u8,
}

impl PutOptions {
    pub fn overwrite() -> Self {
        PutOptions { mode: PutMode::Overwrite, ..Default::default() }
    }
}

/// Options of [`Medium::rename`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RenameOptions {
    /// The renamed copy's version (the master's new, higher version; opaque here).
    pub version: u64,
    /// `CreateNew`: `AlreadyExists` if `to` is present; `Overwrite`: replace `to` atomically.
    pub mode: PutMode,
}

/// What a medium can do; the behaviour suite and the tier manager select on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Short name of the medium kind: `hbm`, `dram`, `nvme`, `object`.
    pub kind: &'static str,
    /// Contents survive a restart of this process (reopen finds them).
    pub survives_restart: bool,
    /// Contents survive the loss of every node (object storage).
    pub durable_across_nodes: bool,
    /// Every read re-hashes the bytes and fails with `Corrupt` on a mismatch.
    pub verifies_reads: bool,
    /// Bytes can be handed out in place (a range of a registered region), see the medium's
    /// own `locate`.
    pub zero_copy_read: bool,
    /// The medium has a fixed capacity and reports `NoSpace`.
    pub bounded_capacity: bool,
}

/// A store of whole objects by key. All methods are cancel-safe: dropping a future never leaves
/// an I/O writing into freed memory, and a dropped put leaves either nothing or the whole
/// object.
#[async_trait]
pub trait Medium: Send + Sync {
    fn capabilities(&self) -> Capabilities;

    /// Store `data` under `key`.
    async fn put(&self, key: &str, data: &[u8], opts: PutOptions) -> Result<ObjectMeta>;

    /// [`put`](Self::put) of the copy of an object, naming `previous` (its key and version
    /// before a rename) when it was renamed, recorded as [`rename`](Self::rename) records it, so
    /// [`previous_name`](Self::previous_name) and [`stale_after_rename`] see it: the one call
    /// for a copy that may have been renamed (the lazy write-back, persistence). Media that
    /// keep no previous names for puts (HBM, NVMe: never write-back targets) store the copy
    /// without it.
    async fn put_with_previous(
        &self,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        previous: Option<(&str, u64)>,
    ) -> Result<ObjectMeta> {
        let _ = previous;
        self.put(key, data, opts).await
    }

    /// Read the object into `dst[..size]`, verified where the medium verifies.
    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta>;

    /// Read the whole object into a new vector.
    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        // A concurrent overwrite can change the size between stat and read; retry a few times.
        for _ in 0..4 {
            let meta = self.stat(key).await?;
            let mut buf = vec![0u8; usize_from(meta.size_bytes)?];
            match self.get_into(key, &mut buf).await {
                Ok(got) if got.size_bytes == meta.size_bytes => return Ok(buf),
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::InvalidArgument => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(ErrorKind::Busy, format!("get {key:?}: object kept changing size")))
    }

    async fn stat(&self, key: &str) -> Result<ObjectMeta>;

    async fn remove(&self, key: &str) -> Result<()>;

    /// Give the object at `from` the key `to` without changing its bytes; see the module notes.
    /// Returns the renamed copy's meta (`version` is `opts.version`). `NotFound` if `from` is
    /// absent, `InvalidArgument` if `from == to`.
    async fn rename(&self, from: &str, to: &str, opts: RenameOptions) -> Result<ObjectMeta>;

    /// The key and version the object had before its last rename (`None` if never renamed).
    /// `NotFound` if `key` is absent.
    async fn previous_name(&self, key: &str) -> Result<Option<(String, u64)>>;

    /// Every object the medium holds (for re-reporting to the master after a restart).
    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>>;

    /// Total bytes the medium may hold; `None` when unbounded (object storage).
    fn capacity_bytes(&self) -> Option<u64>;

    /// Bytes in use (including per-object overhead such as headers and padding).
    fn used_bytes(&self) -> u64;
}

/// Check a key against the rules every medium shares.
pub fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::new(ErrorKind::InvalidArgument, "empty key"));
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("key of {} bytes exceeds key_bytes_max {KEY_BYTES_MAX}", key.len()),
        ));
    }
    Ok(())
}

/// Check the keys of a rename.
pub fn validate_rename(from: &str, to: &str) -> Result<()> {
    validate_key(from)?;
    validate_key(to)?;
    if from == to {
        return Err(Error::new(ErrorKind::InvalidArgument, format!("rename {from:?} onto itself")));
    }
    Ok(())
}

/// The copies a crash in the middle of a rename left behind, among every copy one medium (or
/// bucket) holds: `from` is stale when another copy names `(from, v)` as its previous name,
/// `from`'s version is `v`, and both copies hold the same bytes (size and checksum; a rename
/// never changes them, so a later put of `from` that happened to reuse the version is kept).
/// Chains (`a` renamed to `b`, then `b` to `c`, with every copy left) mark every old name.
///
/// `copies` yields `(key, meta, previous name)`; the result holds the stale keys, which the
/// caller removes. Pure, so NVMe's `open` and the master's bucket scan apply the same rule.
pub fn stale_after_rename<'a, I>(copies: I) -> HashSet<&'a str>
where
    I: IntoIterator<Item = (&'a str, &'a ObjectMeta, Option<(&'a str, u64)>)>,
{
    let copies: Vec<_> = copies.into_iter().collect();
    // previous key -> (the version it had, the claimant's meta) for each claimant.
    let mut claims: HashMap<&str, Vec<(u64, &ObjectMeta)>> = HashMap::new();
    for &(key, meta, previous) in &copies {
        if let Some((pk, pv)) = previous
            && pk != key
        {
            claims.entry(pk).or_default().push((pv, meta));
        }
    }
    copies
        .iter()
        .filter(|(key, meta, _)| {
            claims.get(key).is_some_and(|c| {
                c.iter().any(|(v, by)| {
                    *v == meta.version
                        && by.size_bytes == meta.size_bytes
                        && by.checksum == meta.checksum
                })
            })
        })
        .map(|(key, _, _)| *key)
        .collect()
}

/// Check that `dst` can hold an object of `size` bytes.
pub fn check_dst(key: &str, dst_len: usize, size_bytes: u64) -> Result<usize> {
    let size = usize_from(size_bytes)?;
    if dst_len < size {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "get {key:?}: destination of {dst_len} bytes is shorter than the object ({size} bytes)"
            ),
        ));
    }
    Ok(size)
}

/// Convert a stored length to `usize`, refusing values this machine cannot address.
pub fn usize_from(v: u64) -> Result<usize> {
    usize::try_from(v)
        .map_err(|_| Error::new(ErrorKind::Corrupt, format!("length {v} exceeds usize")))
}

/// Milliseconds since the Unix epoch, from the system clock (media stamp objects with it).
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// blake3 of `data`, with rayon for large buffers.
pub fn checksum(data: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    if data.len() >= RAYON_HASH_BYTES_MIN {
        h.update_rayon(data);
    } else {
        h.update(data);
    }
    *h.finalize().as_bytes()
}

/// Below this, blake3's multithreaded update costs more than it saves.
pub const RAYON_HASH_BYTES_MIN: usize = 1 << 20;

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// The safe name of a key: hex blake3 of its bytes (64 characters).
pub fn key_digest_hex(key: &str) -> String {
    hex(blake3::hash(key.as_bytes()).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert_eq!(validate_key("").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert!(validate_key(&"k".repeat(KEY_BYTES_MAX)).is_ok());
        assert_eq!(
            validate_key(&"k".repeat(KEY_BYTES_MAX + 1)).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(validate_key("model/rank0/../..//\u{1F600}").is_ok());
    }

    fn meta(version: u64, sum: u8) -> ObjectMeta {
        ObjectMeta {
            size_bytes: 3,
            checksum: [sum; 32],
            persistence: Persistence::None,
            stored_at_unix_ms: 1,
            version,
            pin: 0,
        }
    }

    #[test]
    fn stale_copies_are_the_renamed_ones_only() {
        let (m1, m2, m3) = (meta(1, 7), meta(2, 7), meta(3, 7));
        // a@1 renamed to b@2, then b@2 to c@3, all three copies left by crashes.
        let chain = [("a", &m1, None), ("b", &m2, Some(("a", 1))), ("c", &m3, Some(("b", 2)))];
        let mut stale: Vec<_> = stale_after_rename(chain).into_iter().collect();
        stale.sort();
        assert_eq!(stale, ["a", "b"]);
        // a was put again after the rename (a newer version): both names are live.
        let m5 = meta(5, 7);
        assert!(stale_after_rename([("a", &m5, None), ("b", &m2, Some(("a", 1)))]).is_empty());
        // Same version reused but other bytes: kept.
        let other = meta(1, 9);
        assert!(stale_after_rename([("a", &other, None), ("b", &m2, Some(("a", 1)))]).is_empty());
        // A copy naming itself marks nothing.
        assert!(stale_after_rename([("a", &m1, Some(("a", 1)))]).is_empty());
        assert_eq!(validate_rename("x", "x").unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(validate_rename("", "x").unwrap_err().kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn hex_and_persistence_codes() {
        assert_eq!(hex(&[0, 15, 255]), "000fff");
        for p in [Persistence::None, Persistence::Lazy, Persistence::Eager] {
            assert_eq!(Persistence::from_u8(p.to_u8()).unwrap(), p);
        }
        assert_eq!(Persistence::from_u8(9).unwrap_err().kind(), ErrorKind::Corrupt);
    }
}
