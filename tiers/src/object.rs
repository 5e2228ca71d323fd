//! Object-storage medium through opendal: `fs` (a local directory, the embedded default), `s3`
//! (any S3-compatible endpoint, path-style) and any other opendal scheme by a map of options.
//!
//! On the bucket: `objects/<d0d1>/<digest>` under the configured root, where `digest` is the
//! 64-hex blake3 of the key (S3 keys are limited to 1024 bytes, kvfs keys to 4096). Each object
//! is the [`crate::header`] record, unpadded, followed by the data. The header carries the key,
//! size, blake3 and persistence, so [`Medium::list`] rebuilds everything from the bucket alone
//! and objects survive the loss of every node.
//!
//! Policy: every read verifies the header and the data's blake3 (`Corrupt` otherwise, counted).
//! `CreateNew` puts are serialised per key inside this process (a create racing one in progress
//! gets `AlreadyExists`), then `stat`, then use the service's conditional write
//! (`If-None-Match: *`) where opendal says the service has it. Across processes on a service
//! without a real conditional write (opendal `fs` checks then renames), two racing creators may
//! both succeed and the later one wins. Transient service errors are retried by opendal's
//! `RetryLayer` (`retries_max` times) and bounded by a `TimeoutLayer`.
//!
//! Rename: the header sits in front of the data in one object and the renamed copy needs a new
//! header (key, version, previous name), so a server-side copy (opendal `copy`, S3
//! `CopyObject`) cannot make it, and S3's ranged `UploadPartCopy` needs parts of at least
//! 5 MiB, which a header is not. `rename(from, to)` therefore streams: it reads `from`'s header,
//! writes `to` through one opendal writer (the new header, then `from`'s data read in ranges of
//! `rename_chunk_bytes`, re-hashed on the way and refused with `Corrupt` on a mismatch; memory
//! is bounded by about two chunks, and S3 turns more than one chunk into a multipart upload),
//! closes it (the commit point for `to`; `CreateNew` is conditional like a put), then deletes
//! `from` if it still holds the copy that was read (same version and checksum; a put that
//! replaced `from` meanwhile is kept).
//!
//! Crash (or cancel) states: before the close, `from` only (an unfinished multipart upload or
//! an `fs` temp file, never a visible `to`; the bucket's lifecycle rule for incomplete uploads
//! collects the former); after the close and before the delete, both objects, `to`'s header
//! naming `(from, v)`. A lister resolves that: [`ObjectStoreMedium::list_detailed`] returns each
//! object's previous name with no extra request (the header is read anyway), and
//! [`crate::medium::stale_after_rename`] over that list names the stale copies;
//! [`ObjectStoreMedium::remove_stale_renames`] deletes them (the master's bucket scan calls it, or
//! does the same itself, before it reports what the bucket holds).
//!
//! Start-up: S3 over HTTPS needs a rustls crypto provider and opendal's default HTTP transport;
//! [`ObjectStoreMedium::open`] installs both (idempotent), so no caller has to remember.
//!
//! Not handled: multipart uploads tuned for 100 MiB objects (opendal's single PUT is used),
//! a cached index (`stat` and `list` ask the bucket), `used_bytes` of objects written by other
//! nodes (it counts what this handle wrote and removed; `list` gives the bucket's truth).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use opendal::Operator;
use opendal::layers::{RetryLayer, TimeoutLayer};

use crate::error::{Error, ErrorKind, Result};
use crate::header;
use crate::medium::{
    Capabilities, Medium, ObjectMeta, PutMode, PutOptions, RenameOptions, check_dst, checksum,
    key_digest_hex, now_unix_ms, stale_after_rename, validate_key, validate_rename,
};

/// Which object store, and how to reach it.
#[derive(Debug, Clone)]
pub enum ObjectStoreConfig {
    /// A local directory (no extra service).
    Fs { root: PathBuf },
    /// An S3-compatible service, path-style addressing.
    S3 {
        endpoint: String,
        bucket: String,
        region: String,
        access_key_id: String,
        secret_access_key: String,
        /// Prefix inside the bucket, e.g. `/kvfs/cluster-a`.
        root: String,
    },
    /// Any opendal scheme with its options (`root`, `bucket`, `endpoint`, ...).
    Scheme { scheme: String, options: HashMap<String, String> },
}

/// Bounds of the object-store client.
#[derive(Debug, Clone, Copy)]
pub struct ObjectStoreLimits {
    /// Retries of a transient service error inside one operation.
    pub retries_max: usize,
    /// Bound on one operation, in milliseconds.
    pub op_timeout_ms: u64,
    /// Headers read at once by `list`.
    pub list_concurrency_max: usize,
    /// Bytes `rename` reads and writes at a time (its memory bound is about twice this). On
    /// S3 every chunk but the last is a multipart part, which must be at least 5 MiB.
    pub rename_chunk_bytes: usize,
}

impl Default for ObjectStoreLimits {
    fn default() -> Self {
        ObjectStoreLimits {
            retries_max: 3,
            op_timeout_ms: 60_000,
            list_concurrency_max: 16,
            rename_chunk_bytes: 8 << 20,
        }
    }
}

/// One object found by [`ObjectStoreMedium::list_detailed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedObject {
    pub key: String,
    pub meta: ObjectMeta,
    /// The key and version it had before a rename, from its header.
    pub previous: Option<(String, u64)>,
}

/// Objects in object storage, each with its header, verified on every read.
pub struct ObjectStoreMedium {
    op: Operator,
    limits: ObjectStoreLimits,
    used_bytes: AtomicU64,
    corrupt_reads: AtomicU64,
    /// Keys with a create-new put in progress in this process.
    creating: std::sync::Mutex<HashSet<String>>,
}

/// Releases a create-new reservation.
struct Creating<'a>(&'a ObjectStoreMedium, Option<String>);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.1.take() {
            self.0.creating.lock().unwrap_or_else(|p| p.into_inner()).remove(&k);
        }
    }
}

/// Install what S3 over opendal needs process-wide (rustls ring provider, HTTP transport).
pub fn install_http_defaults() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
        opendal_http_transport_reqwest::install_default();
        opendal::init_default_registry();
    });
}

fn map_err(context: String, e: opendal::Error) -> Error {
    use opendal::ErrorKind as K;
    let kind = match e.kind() {
        K::NotFound => ErrorKind::NotFound,
        K::AlreadyExists | K::ConditionNotMatch => ErrorKind::AlreadyExists,
        K::RateLimited => ErrorKind::Busy,
        K::ConfigInvalid | K::Unsupported => ErrorKind::InvalidArgument,
        K::PermissionDenied => ErrorKind::Unavailable,
        _ if e.is_temporary() => ErrorKind::Unavailable,
        _ => ErrorKind::Io,
    };
    Error::new(kind, context).with_source(e)
}

/// The bucket path of a key.
pub fn object_path(key: &str) -> String {
    let d = key_digest_hex(key);
    format!("objects/{}/{d}", &d[..2])
}

/// Split a stored object into its verified header and data.
fn split_verified(key: &str, raw: &[u8]) -> Result<(header::Header, usize)> {
    let h = header::decode(raw)?;
    if h.key != key {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("object holds key {:?}, not {key:?}", h.key),
        ));
    }
    let data_len = raw.len() - h.header_bytes;
    if data_len as u64 != h.meta.size_bytes {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("object {key:?} has {data_len} data bytes, header says {}", h.meta.size_bytes),
        ));
    }
    if checksum(&raw[h.header_bytes..]) != h.meta.checksum {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!("object {key:?}: data checksum mismatch"),
        ));
    }
    Ok((h, data_len))
}

impl ObjectStoreMedium {
    /// Build the opendal operator for `cfg` with default limits.
    pub fn open(cfg: ObjectStoreConfig) -> Result<Self> {
        Self::open_with(cfg, ObjectStoreLimits::default())
    }

    pub fn open_with(cfg: ObjectStoreConfig, limits: ObjectStoreLimits) -> Result<Self> {
        install_http_defaults();
        let (scheme, options): (String, Vec<(String, String)>) = match cfg {
            ObjectStoreConfig::Fs { root } => {
                let tmp = root.join(".kvfs-tmp");
                std::fs::create_dir_all(&tmp)
                    .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
                let s = |p: PathBuf| p.to_string_lossy().into_owned();
                ("fs".into(), vec![("root".into(), s(root)), ("atomic_write_dir".into(), s(tmp))])
            }
            ObjectStoreConfig::S3 {
                endpoint,
                bucket,
                region,
                access_key_id,
                secret_access_key,
                root,
            } => (
                "s3".into(),
                vec![
                    ("endpoint".into(), endpoint),
                    ("bucket".into(), bucket),
                    ("region".into(), region),
                    ("access_key_id".into(), access_key_id),
                    ("secret_access_key".into(), secret_access_key),
                    ("root".into(), root),
                    ("disable_config_load".into(), "true".into()),
                    ("enable_virtual_host_style".into(), "false".into()),
                ],
            ),
            ObjectStoreConfig::Scheme { scheme, options } => {
                (scheme, options.into_iter().collect())
            }
        };
        let op = Operator::via_iter(&scheme, options)
            .map_err(|e| map_err(format!("configure object store {scheme:?}"), e))?
            .layer(TimeoutLayer::new().with_timeout(Duration::from_millis(limits.op_timeout_ms)))
            .layer(RetryLayer::new().with_max_times(limits.retries_max));
        Ok(ObjectStoreMedium {
            op,
            limits,
            used_bytes: AtomicU64::new(0),
            corrupt_reads: AtomicU64::new(0),
            creating: Default::default(),
        })
    }

    /// The raw backend, for tools and tests (e.g. to damage a stored object on purpose).
    pub fn operator(&self) -> &Operator {
        &self.op
    }

    /// Reads that failed verification since open.
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads.load(Ordering::Relaxed)
    }

    async fn read_raw(&self, key: &str) -> Result<Bytes> {
        let path = object_path(key);
        let buf =
            self.op.read(&path).await.map_err(|e| map_err(format!("object get {key:?}"), e))?;
        Ok(buf.to_bytes())
    }

    fn counted<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r
            && e.kind() == ErrorKind::Corrupt
        {
            self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// With `CreateNew`, reserve `key` in this process and check that the bucket lacks it.
    async fn begin_create(&self, key: &str, path: &str, mode: PutMode) -> Result<Creating<'_>> {
        let mut creating = Creating(self, None);
        if mode == PutMode::CreateNew {
            if !self.creating.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned()) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("object: {key:?} (being created)"),
                ));
            }
            creating.1 = Some(key.to_owned());
            match self.op.stat(path).await {
                Ok(_) => {
                    return Err(Error::new(ErrorKind::AlreadyExists, format!("object: {key:?}")));
                }
                Err(e) if e.kind() == opendal::ErrorKind::NotFound => {}
                Err(e) => return Err(map_err(format!("object create {key:?}"), e)),
            }
        }
        Ok(creating)
    }

    /// The header of `key`'s object, checked to name `key`.
    async fn header_of(&self, key: &str) -> Result<header::Header> {
        let h = self.counted(Self::read_header(&self.op, &object_path(key)).await)?;
        if h.key != key {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("object holds key {:?}, not {key:?}", h.key),
            ));
        }
        Ok(h)
    }

    /// Write `to`'s object: `hdr`, then `from`'s data (as `h` describes it) in bounded ranges,
    /// verified against `h`'s checksum before the writer closes.
    async fn copy_data(
        &self,
        from: &str,
        to: &str,
        h: &header::Header,
        hdr: Bytes,
        create_new: bool,
    ) -> Result<()> {
        let (from_path, to_path) = (object_path(from), object_path(to));
        let chunk = self.limits.rename_chunk_bytes.max(1);
        let ctx = || format!("object rename {from:?} to {to:?}");
        let mut w = self
            .op
            .writer_with(&to_path)
            .chunk(chunk)
            .if_not_exists(create_new && self.op.info().capability().write_with_if_not_exists)
            .await
            .map_err(|e| map_err(ctx(), e))?;
        let copied = async {
            w.write(hdr).await.map_err(|e| map_err(ctx(), e))?;
            let mut hasher = blake3::Hasher::new();
            let mut at = h.header_bytes as u64;
            let end = at + h.meta.size_bytes;
            while at < end {
                let n = (end - at).min(chunk as u64);
                let buf = self
                    .op
                    .read_with(&from_path)
                    .range(at..at + n)
                    .await
                    .map_err(|e| map_err(ctx(), e))?;
                if buf.len() as u64 != n {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("{}: {} bytes at {at}, wanted {n}", ctx(), buf.len()),
                    ));
                }
                for part in buf.clone() {
                    hasher.update(&part);
                }
                w.write(buf).await.map_err(|e| map_err(ctx(), e))?;
                at += n;
            }
            if hasher.finalize().as_bytes() != &h.meta.checksum {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("{}: data checksum mismatch", ctx()),
                ));
            }
            Ok(())
        }
        .await;
        if let Err(e) = copied {
            let _ = w.abort().await;
            return self.counted(Err(e));
        }
        w.close().await.map_err(|e| map_err(ctx(), e))?;
        Ok(())
    }

    /// Every object in the bucket with its previous name (the headers `list` reads anyway).
    /// After a crashed rename both names are listed; see the module notes.
    pub async fn list_detailed(&self) -> Result<Vec<ListedObject>> {
        let entries = self
            .op
            .list_with("objects/")
            .recursive(true)
            .await
            .map_err(|e| map_err("object list".into(), e))?;
        let paths: Vec<String> = entries
            .into_iter()
            .filter(|e| e.metadata().is_file())
            .map(|e| e.path().to_owned())
            .collect();
        let mut out = Vec::with_capacity(paths.len());
        for window in paths.chunks(self.limits.list_concurrency_max.max(1)) {
            let mut set = tokio::task::JoinSet::new();
            for p in window {
                let (op, p) = (self.op.clone(), p.clone());
                set.spawn(async move { (Self::read_header(&op, &p).await, p) });
            }
            while let Some(r) = set.join_next().await {
                let (h, p) = r.map_err(|e| Error::new(ErrorKind::Io, format!("list task: {e}")))?;
                match h {
                    Ok(h) if object_path(&h.key) == p => {
                        out.push(ListedObject { key: h.key, meta: h.meta, previous: h.previous })
                    }
                    Ok(h) => {
                        tracing::warn!(path = %p, key = %h.key, "object path is not its key's digest; skipped")
                    }
                    // Vanished between list and read (a concurrent remove).
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => {
                        if e.kind() == ErrorKind::Corrupt {
                            self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                        }
                        tracing::warn!(path = %p, error = %e, "unreadable object header; skipped");
                    }
                }
            }
        }
        Ok(out)
    }

    /// Delete the old names that crashed renames left in `listed` (from
    /// [`ObjectStoreMedium::list_detailed`]), each only if it still holds the listed copy (a put
    /// since the list is kept). Returns the keys deleted.
    pub async fn remove_stale_renames(&self, listed: &[ListedObject]) -> Result<Vec<String>> {
        let stale = stale_after_rename(listed.iter().map(|o| {
            (o.key.as_str(), &o.meta, o.previous.as_ref().map(|(k, v)| (k.as_str(), *v)))
        }));
        let mut removed = Vec::new();
        for o in listed.iter().filter(|o| stale.contains(o.key.as_str())) {
            if self.remove_if_same(&o.key, &o.meta).await? {
                tracing::info!(key = %o.key, version = o.meta.version, "deleted the old name of a renamed object");
                removed.push(o.key.clone());
            }
        }
        Ok(removed)
    }

    /// `put`, with the previous name (key, version) written into the header when given.
    async fn put_object(
        &self,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        previous: Option<(&str, u64)>,
    ) -> Result<ObjectMeta> {
        validate_key(key)?;
        let sum = checksum(data);
        if let Some(want) = opts.checksum
            && want != sum
        {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("object put {key:?}: data does not match the writer's checksum"),
            ));
        }
        let path = object_path(key);
        let meta = ObjectMeta {
            size_bytes: data.len() as u64,
            checksum: sum,
            persistence: opts.persistence,
            stored_at_unix_ms: now_unix_ms(),
            version: opts.version,
            pin: opts.pin,
        };
        let conditional = self.op.info().capability().write_with_if_not_exists;
        let _creating = self.begin_create(key, &path, opts.mode).await?;
        let hdr = Bytes::from(header::encode(key, &meta, 0, previous, 1));
        let total = hdr.len() as u64 + meta.size_bytes;
        let body = opendal::Buffer::from(vec![hdr, Bytes::copy_from_slice(data)]);
        let w = self
            .op
            .write_with(&path, body)
            .if_not_exists(opts.mode == PutMode::CreateNew && conditional);
        w.await.map_err(|e| map_err(format!("object put {key:?}"), e))?;
        self.used_bytes.fetch_add(total, Ordering::Relaxed);
        Ok(meta)
    }

    /// Delete `key` if its object is still the copy `meta` describes; false if it is gone or
    /// another copy.
    async fn remove_if_same(&self, key: &str, meta: &ObjectMeta) -> Result<bool> {
        match self.header_of(key).await {
            Ok(cur) if cur.meta == *meta => {}
            Ok(_) => return Ok(false),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        }
        match self.remove(key).await {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Read the header of the object at `path` (two requests: size, then a ranged read).
    async fn read_header(op: &Operator, path: &str) -> Result<header::Header> {
        let ctx = || format!("object stat {path}");
        let len = op.stat(path).await.map_err(|e| map_err(ctx(), e))?.content_length();
        let want = len.min(header::HEADER_BYTES_MAX as u64);
        let buf = op.read_with(path).range(0..want).await.map_err(|e| map_err(ctx(), e))?;
        let h = header::decode(&buf.to_bytes()).map_err(|e| e.context(ctx()))?;
        if len != h.header_bytes as u64 + h.meta.size_bytes {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "{path}: {len} bytes stored, header says {}",
                    h.header_bytes as u64 + h.meta.size_bytes
                ),
            ));
        }
        Ok(h)
    }
}

#[async_trait]
impl Medium for ObjectStoreMedium {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            kind: "object",
            survives_restart: true,
            durable_across_nodes: true,
            verifies_reads: true,
            zero_copy_read: false,
            bounded_capacity: false,
        }
    }

    async fn put(&self, key: &str, data: &[u8], opts: PutOptions) -> Result<ObjectMeta> {
        self.put_object(key, data, opts, None).await
    }

    async fn put_with_previous(
        &self,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        previous: Option<(&str, u64)>,
    ) -> Result<ObjectMeta> {
        if let Some((k, _)) = previous {
            validate_key(k)?;
        }
        self.put_object(key, data, opts, previous).await
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta> {
        validate_key(key)?;
        let raw = self.read_raw(key).await?;
        let (h, len) = self.counted(split_verified(key, &raw))?;
        check_dst(key, dst.len(), h.meta.size_bytes)?;
        dst[..len].copy_from_slice(&raw[h.header_bytes..]);
        Ok(h.meta)
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        validate_key(key)?;
        let raw = self.read_raw(key).await?;
        let (h, _) = self.counted(split_verified(key, &raw))?;
        Ok(raw[h.header_bytes..].to_vec())
    }

    async fn stat(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        Ok(self.header_of(key).await?.meta)
    }

    async fn remove(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let path = object_path(key);
        let len = self
            .op
            .stat(&path)
            .await
            .map_err(|e| map_err(format!("object remove {key:?}"), e))?
            .content_length();
        self.op.delete(&path).await.map_err(|e| map_err(format!("object remove {key:?}"), e))?;
        let _ = self
            .used_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(len)));
        Ok(())
    }

    async fn rename(&self, from: &str, to: &str, opts: RenameOptions) -> Result<ObjectMeta> {
        validate_rename(from, to)?;
        let h = self.header_of(from).await?;
        let _creating = self.begin_create(to, &object_path(to), opts.mode).await?;
        let meta = ObjectMeta { version: opts.version, ..h.meta };
        let hdr = Bytes::from(header::encode(to, &meta, 0, Some((from, h.meta.version)), 1));
        let total = hdr.len() as u64 + meta.size_bytes;
        self.copy_data(from, to, &h, hdr, opts.mode == PutMode::CreateNew).await?;
        self.used_bytes.fetch_add(total, Ordering::Relaxed);
        // `to` is committed; both names exist until this delete (see the module notes), and
        // if it fails they stay for the caller's retry of the remove or the next scan.
        self.remove_if_same(from, &h.meta)
            .await
            .map_err(|e| e.context(format!("renamed {from:?} to {to:?}, old name kept")))?;
        Ok(meta)
    }

    async fn previous_name(&self, key: &str) -> Result<Option<(String, u64)>> {
        validate_key(key)?;
        Ok(self.header_of(key).await?.previous)
    }

    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>> {
        Ok(self.list_detailed().await?.into_iter().map(|o| (o.key, o.meta)).collect())
    }

    fn capacity_bytes(&self) -> Option<u64> {
        None
    }

    fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }
}
