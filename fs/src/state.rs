//! The daemon's shared state and the namespace operations that need no open handle: resolving
//! names to nodes, attributes, extended attributes, directories made with mkdir, unlink.
//!
//! Every operation is an `async fn` returning `Result<_, i32>` (an errno); [`crate::fuse`]
//! runs them on the runtime and replies. Locks are plain mutexes held only between awaits,
//! never across one.
//!
//! Directories exist because keys continue under them; a directory made with `mkdir` that no
//! key is under yet lives only in this daemon (it is gone after a restart, like any empty
//! directory of the store would be).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{FileAttr, FileType, INodeNo};
use kvfs_client::{Client, ObjectInfo, Persistence, Pin, Tier};

use crate::fastpath::FastPath;
use crate::inode::{self, DirNode, Kind, ObjAttr, Table};
use crate::mount::MountConfig;
use crate::names::{self, Piece};
use crate::passthrough::Backings;
use crate::read::{FetchPool, Fetched, ReadHandle};
use crate::staging::Budget;
use crate::write::Writer;
use crate::{dir::DirStream, errno};

/// The status files under `/.kvfs/`, by index.
pub const STATUS_FILES: [&str; 3] = ["status.json", "cluster.json", "buffers.json"];
/// The directory of the master's jobs under `/.kvfs/`.
pub const JOBS_DIR: &str = "jobs";
/// xattrs every object has.
pub const XATTRS: [&str; 7] = [
    "user.kvfs.key",
    "user.kvfs.tier",
    "user.kvfs.replicas",
    "user.kvfs.checksum",
    "user.kvfs.persistence",
    "user.kvfs.lease",
    "user.kvfs.pin",
];

pub type Errno = i32;

/// Lock a mutex, shrugging off poisoning (the data is plain bookkeeping).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An open file or directory.
pub enum Handle {
    Dir(Arc<tokio::sync::Mutex<DirStream>>),
    Read(Arc<ReadHandle>),
    Passthrough {
        ino: u64,
    },
    Write(Arc<tokio::sync::Mutex<Writer>>),
    /// A status file, a job file or the control file: the text read returns (rendered at
    /// open).
    Text {
        ino: u64,
        text: Arc<Vec<u8>>,
    },
    /// `/.kvfs/jobs/` opened: the ids of the jobs the master reported then.
    Jobs(Arc<Vec<u64>>),
}

/// A file this mount is writing (created, not yet committed).
#[derive(Debug, Clone)]
pub struct Pending {
    pub ino: u64,
    pub size: Arc<AtomicU64>,
    pub writer: Weak<tokio::sync::Mutex<Writer>>,
}

/// What a name resolves to (`Job`: a job the master knows, with when its status last changed,
/// the file's mtime).
#[derive(Debug, Clone)]
pub enum Found {
    Dir(DirNode),
    Object { key: String, attr: ObjAttr, pending: bool },
    ControlDir,
    Control,
    Status(usize),
    JobsDir,
    Job { id: u64, updated_ms: u64 },
}

impl Found {
    pub fn kind(&self) -> Kind {
        match self {
            Found::Dir(d) => Kind::Dir(d.clone()),
            Found::Object { key, .. } => Kind::Object { key: key.clone() },
            Found::ControlDir => Kind::ControlDir,
            Found::Control => Kind::Control,
            Found::Status(i) => Kind::Status(*i),
            Found::JobsDir => Kind::JobsDir,
            Found::Job { id, .. } => Kind::Job(*id),
        }
    }
}

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Figures of this mount, shown in `/.kvfs/status.json`.
        #[derive(Debug, Default)]
        pub struct Counters { $(pub $name: AtomicU64,)* }
        impl Counters {
            pub fn to_json(&self) -> serde_json::Value {
                let mut m = serde_json::Map::new();
                $( m.insert(stringify!($name).into(), self.$name.load(Ordering::Relaxed).into()); )*
                serde_json::Value::Object(m)
            }
        }
    };
}
counters!(
    lookups,
    opens,
    passthrough_opens,
    reads,
    read_bytes,
    fetches,
    fetch_bytes,
    writes,
    write_bytes,
    commits,
    commit_failures,
    aborted_writes,
    unlinks,
    renames,
    replaces,
    fastpath_registrations,
    fastpath_submits,
    fastpath_items_ok,
    fastpath_items_failed,
    fastpath_bytes,
);

pub fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub struct Inner {
    pub cfg: MountConfig,
    pub client: Client,
    pub table: Mutex<Table>,
    pub handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// Directories made with mkdir: `DirNode::prefix` to `DirNode::chain`.
    pub local_dirs: Mutex<BTreeMap<String, Vec<String>>>,
    pub pending: Mutex<HashMap<String, Pending>>,
    pub staging: Arc<Budget>,
    pub fetch_budget: Arc<tokio::sync::Semaphore>,
    pub fetched: Mutex<HashMap<u64, Weak<Fetched>>>,
    pub fetch_pool: Arc<FetchPool>,
    pub backings: Mutex<Backings>,
    /// Open non-passthrough read handles per inode (passthrough must not start on them).
    pub cached_opens: Mutex<HashMap<u64, u32>>,
    pub fastpath: FastPath,
    pub counters: Counters,
    pub notifier: OnceLock<fuser::Notifier>,
    /// Whether the kernel accepts passthrough backing files (cleared after a refusal).
    pub passthrough_works: std::sync::atomic::AtomicBool,
    pub started: SystemTime,
    /// Staging keys of replacements are `STAGING_PREFIX` + this + a counter.
    pub staging_nonce: u64,
    pub next_staging: AtomicU64,
    uid: u32,
    gid: u32,
}

/// Bytes per permit of the fetch budget.
pub const FETCH_UNIT: u64 = 64 << 10;

impl Inner {
    pub fn new(cfg: MountConfig, client: Client) -> Inner {
        let permits =
            (cfg.fetch_bytes_max / FETCH_UNIT).clamp(1, tokio::sync::Semaphore::MAX_PERMITS as u64);
        Inner {
            staging: Budget::new(cfg.staging_bytes_max),
            fetch_budget: Arc::new(tokio::sync::Semaphore::new(permits as usize)),
            fastpath: FastPath::new(cfg.fastpath.clone(), client.engine().clone()),
            fetch_pool: FetchPool::new(client.engine().clone(), cfg.fetch_cache_bytes_max),
            cfg,
            client,
            table: Mutex::new(Table::new(STATUS_FILES.len())),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            local_dirs: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(HashMap::new()),
            fetched: Mutex::new(HashMap::new()),
            backings: Mutex::new(Backings::default()),
            cached_opens: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            notifier: OnceLock::new(),
            passthrough_works: std::sync::atomic::AtomicBool::new(true),
            started: SystemTime::now(),
            staging_nonce: rand_nonce(),
            next_staging: AtomicU64::new(0),
            // SAFETY: getuid/getgid cannot fail and have no preconditions.
            uid: unsafe { libc::getuid() },
            // SAFETY: as above.
            gid: unsafe { libc::getgid() },
        }
    }

    pub fn entry_ttl(&self) -> Duration {
        Duration::from_millis(self.cfg.entry_ttl_ms)
    }

    pub fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, h);
        fh
    }

    pub fn kind_of(&self, ino: u64) -> Result<Kind, Errno> {
        lock(&self.table).get(ino).map(|n| n.kind.clone()).ok_or(libc::ENOENT)
    }

    // ----- attributes ------------------------------------------------------------------------

    fn attr(&self, ino: u64, kind: FileType, size: u64, perm: u16, mtime: SystemTime) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            // Tools size their I/O by this: 1 MiB is what one FUSE request carries.
            blksize: 1 << 20,
            flags: 0,
        }
    }

    pub fn dir_attr(&self, ino: u64) -> FileAttr {
        self.attr(ino, FileType::Directory, 0, 0o755, self.started)
    }

    /// An object: 0444, its size, and its put time as mtime (the version's high bits are the
    /// master's clock in ms when the put started). A file being written is 0644.
    pub fn obj_attr(&self, ino: u64, a: ObjAttr, pending: bool) -> FileAttr {
        let mtime = if pending {
            SystemTime::now()
        } else {
            UNIX_EPOCH + Duration::from_millis(a.version >> 20)
        };
        self.attr(ino, FileType::RegularFile, a.size, if pending { 0o644 } else { 0o444 }, mtime)
    }

    pub fn found_attr(&self, ino: u64, f: &Found) -> FileAttr {
        match f {
            Found::Dir(_) | Found::ControlDir | Found::JobsDir => self.dir_attr(ino),
            Found::Object { attr, pending, .. } => self.obj_attr(ino, *attr, *pending),
            // Rendered at open and read with direct I/O, like /proc: size 0.
            Found::Control | Found::Status(_) => {
                self.attr(ino, FileType::RegularFile, 0, 0o444, self.started)
            }
            Found::Job { updated_ms, .. } => {
                let mtime = UNIX_EPOCH + Duration::from_millis(*updated_ms);
                self.attr(ino, FileType::RegularFile, 0, 0o444, mtime)
            }
        }
    }

    /// Records a kernel lookup of `f` and returns its number and attributes.
    pub fn remember(&self, f: &Found) -> (u64, FileAttr) {
        let attr = match f {
            Found::Object { attr, .. } => Some(*attr),
            _ => None,
        };
        let ino = lock(&self.table).remember(f.kind(), attr);
        (ino, self.found_attr(ino, f))
    }

    // ----- names -----------------------------------------------------------------------------

    /// What `name` in directory `parent` is.
    pub async fn resolve(&self, parent: u64, name: &OsStr) -> Result<Found, Errno> {
        bump(&self.counters.lookups, 1);
        let dir = match self.kind_of(parent)? {
            Kind::Dir(d) => d,
            Kind::ControlDir => {
                return match name.as_bytes() {
                    b"control" => Ok(Found::Control),
                    n if n == JOBS_DIR.as_bytes() => Ok(Found::JobsDir),
                    n => STATUS_FILES
                        .iter()
                        .position(|s| s.as_bytes() == n)
                        .map(Found::Status)
                        .ok_or(libc::ENOENT),
                };
            }
            Kind::JobsDir => {
                let id = crate::control::job_id(name.as_bytes()).ok_or(libc::ENOENT)?;
                let s = crate::control::job(self, id).await?;
                return Ok(Found::Job { id, updated_ms: s.updated_ms });
            }
            _ => return Err(libc::ENOTDIR),
        };
        if parent == inode::ROOT && name.as_bytes() == names::CONTROL_DIR.as_bytes() {
            return Ok(Found::ControlDir);
        }
        match names::decode_piece(name.as_bytes()).ok_or(libc::ENOENT)? {
            Piece::Chunk(raw) => {
                let sub = chunk_child(&dir, name, &raw);
                if lock(&self.local_dirs).contains_key(&sub.prefix)
                    || self.chunk_exists(&sub).await?
                {
                    Ok(Found::Dir(sub))
                } else {
                    Err(libc::ENOENT)
                }
            }
            Piece::Last { raw, file_mark } => {
                let key = self.key_of(&dir, name, &raw, file_mark).ok_or(libc::ENOENT)?;
                self.resolve_key(key, !file_mark).await
            }
        }
    }

    /// The key a final name in `dir` stands for, if the name is its canonical spelling.
    pub fn key_of(
        &self,
        dir: &DirNode,
        name: &OsStr,
        raw: &str,
        file_mark: bool,
    ) -> Option<String> {
        let name = name.to_str()?;
        let c = names::complete_component(
            dir.partial(),
            &dir.chain,
            name,
            raw,
            dir.first(),
            file_mark,
        )?;
        Some(format!("{}{c}", dir.base()))
    }

    /// `key` as an object, or (when `dir_too`) as the directory `key/` if keys continue there.
    async fn resolve_key(&self, key: String, dir_too: bool) -> Result<Found, Errno> {
        if let Some(p) = lock(&self.pending).get(&key) {
            let attr = ObjAttr { size: p.size.load(Ordering::Acquire), version: 0 };
            return Ok(Found::Object { key, attr, pending: true });
        }
        let sub = format!("{key}/");
        let (is_dir, stat) = if dir_too {
            tokio::join!(self.dir_exists(&sub), self.client.stat(&key))
        } else {
            (Ok(false), self.client.stat(&key).await)
        };
        if is_dir? {
            return Ok(Found::Dir(DirNode::dir(sub)));
        }
        match stat {
            Ok(v) => Ok(Found::Object {
                key,
                attr: ObjAttr { size: v.size, version: v.version },
                pending: false,
            }),
            Err(e) => Err(errno::of(&e)),
        }
    }

    /// Whether the directory `prefix` (ending in `/`) exists: made here, or keys under it.
    pub async fn dir_exists(&self, prefix: &str) -> Result<bool, Errno> {
        if lock(&self.local_dirs).contains_key(prefix) {
            return Ok(true);
        }
        self.dir_has_keys(prefix).await
    }

    /// Whether any key (committed, or being written here) lies under `prefix`.
    pub async fn dir_has_keys(&self, prefix: &str) -> Result<bool, Errno> {
        if lock(&self.pending).keys().any(|k| k.starts_with(prefix)) {
            return Ok(true);
        }
        let page = self.client.list_dir(prefix, None, 1).await.map_err(|e| errno::of(&e))?;
        Ok(!page.entries.is_empty())
    }

    /// Whether some key's component runs through the chunk directory `sub`.
    async fn chunk_exists(&self, sub: &DirNode) -> Result<bool, Errno> {
        let (base, partial) = (sub.base().to_string(), sub.partial().to_string());
        let mut after = Some(partial.clone());
        loop {
            let page = self
                .client
                .list_dir(&base, after.as_deref(), self.cfg.list_page_entries)
                .await
                .map_err(|e| errno::of(&e))?;
            for e in &page.entries {
                let (name, is_dir) = crate::dir::entry_name(e);
                let component = name.strip_suffix('/').unwrap_or(name);
                if !component.starts_with(&partial) {
                    return Ok(false);
                }
                let k = sub.chain.len();
                let runs = |mark: bool| {
                    let enc = names::encode_component(component, sub.first(), mark);
                    enc.len() > k && enc[..k] == sub.chain[..]
                };
                if runs(false) || (!is_dir && runs(true)) {
                    return Ok(true);
                }
            }
            match page.next_start_after {
                Some(n) => after = Some(n),
                None => return Ok(false),
            }
        }
    }

    /// Fresh attributes of a node.
    pub async fn getattr(&self, ino: u64) -> Result<FileAttr, Errno> {
        match self.kind_of(ino)? {
            Kind::Dir(_) | Kind::ControlDir | Kind::JobsDir => Ok(self.dir_attr(ino)),
            Kind::Control => Ok(self.found_attr(ino, &Found::Control)),
            Kind::Status(i) => Ok(self.found_attr(ino, &Found::Status(i))),
            // Asked anew: the mtime follows the job's progress; a job the master no longer
            // keeps is ENOENT.
            Kind::Job(id) => {
                let s = crate::control::job(self, id).await?;
                Ok(self.found_attr(ino, &Found::Job { id, updated_ms: s.updated_ms }))
            }
            Kind::Unlinked(a) => Ok(self.obj_attr(ino, a, false)),
            Kind::Object { key } => {
                if let Some(p) = lock(&self.pending).get(&key) {
                    let a = ObjAttr { size: p.size.load(Ordering::Acquire), version: 0 };
                    return Ok(self.obj_attr(ino, a, true));
                }
                let v = self.client.stat(&key).await.map_err(|e| errno::of(&e))?;
                let mut a = ObjAttr { size: v.size, version: v.version };
                if let Some(n) = lock(&self.table).get_mut(ino) {
                    match n.attr {
                        // This inode is an older object of the name: it keeps its size (the
                        // name's lookup gives the new object its own inode).
                        Some(p) if p.version != 0 && p.version != a.version => a = p,
                        _ => n.attr = Some(a),
                    }
                }
                Ok(self.obj_attr(ino, a, false))
            }
        }
    }

    // ----- xattrs ----------------------------------------------------------------------------

    /// The names of a node's extended attributes, NUL-separated.
    pub fn xattr_names(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        match self.kind_of(ino)? {
            Kind::Object { key } if !lock(&self.pending).contains_key(&key) => {
                Ok(XATTRS.iter().flat_map(|n| n.bytes().chain([0])).collect())
            }
            _ => Ok(Vec::new()),
        }
    }

    pub async fn getxattr(&self, ino: u64, name: &OsStr) -> Result<Vec<u8>, Errno> {
        let Kind::Object { key } = self.kind_of(ino)? else { return Err(libc::ENODATA) };
        let Some(which) = XATTRS.iter().position(|n| n.as_bytes() == name.as_bytes()) else {
            return Err(libc::ENODATA);
        };
        if lock(&self.pending).contains_key(&key) {
            return Err(libc::ENODATA);
        }
        if which == 0 {
            return Ok(key.into_bytes());
        }
        let v = self.client.stat(&key).await.map_err(|e| errno::of(&e))?;
        Ok(xattr_value(which, &v).into_bytes())
    }

    // ----- directories and unlink ------------------------------------------------------------

    /// mkdir: a directory that lives in this daemon until keys are under it.
    pub async fn mkdir(&self, parent: u64, name: &OsStr) -> Result<Found, Errno> {
        let Kind::Dir(dir) = self.kind_of(parent)? else { return Err(libc::EPERM) };
        let sub = match names::decode_piece(name.as_bytes()).ok_or(libc::EINVAL)? {
            Piece::Chunk(raw) => chunk_child(&dir, name, &raw),
            Piece::Last { file_mark: true, .. } => return Err(libc::EINVAL),
            Piece::Last { raw, .. } => {
                let key = self.key_of(&dir, name, &raw, false).ok_or(libc::EINVAL)?;
                DirNode::dir(format!("{key}/"))
            }
        };
        match self.resolve(parent, name).await {
            Ok(_) => return Err(libc::EEXIST),
            Err(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
        if sub.prefix.len() > self.cfg.key_bytes_max {
            return Err(libc::ENAMETOOLONG);
        }
        lock(&self.local_dirs).insert(sub.prefix.clone(), sub.chain.clone());
        Ok(Found::Dir(sub))
    }

    /// rmdir: only a directory no key is under (one made with mkdir).
    pub async fn rmdir(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        let d = match self.resolve(parent, name).await? {
            Found::Dir(d) => d,
            Found::ControlDir | Found::JobsDir => return Err(libc::EPERM),
            _ => return Err(libc::ENOTDIR),
        };
        let has_keys = if d.chain.is_empty() {
            self.dir_has_keys(&d.prefix).await?
        } else {
            self.chunk_exists(&d).await?
        };
        let mut local = lock(&self.local_dirs);
        let has_local_children = local
            .range(d.prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&d.prefix))
            .any(|(p, _)| *p != d.prefix);
        if has_keys || has_local_children {
            return Err(libc::ENOTEMPTY);
        }
        local.remove(&d.prefix);
        Ok(())
    }

    /// Tells the kernel to forget the name of `key` in every directory inode it holds for the
    /// key's parent, and waits until it did (after a replacement: the name has a new inode).
    pub async fn forget_name(&self, key: &str) {
        let Some(n) = self.notifier.get().cloned() else { return };
        let (prefix, last) = match key.rfind('/') {
            Some(i) => (&key[..=i], &key[i + 1..]),
            None => ("", key),
        };
        let name = names::encode_component(last, prefix.is_empty(), false);
        if name.len() != 1 {
            return; // a component cut into a chain: its entry lives deeper; the TTL ends it
        }
        let parents = lock(&self.table).inos_of(&Kind::Dir(DirNode::dir(prefix.to_string())));
        let name = std::ffi::OsString::from(&name[0]);
        let _ = tokio::task::spawn_blocking(move || {
            for p in parents {
                let _ = n.inval_entry(INodeNo(p), &name);
            }
        })
        .await;
    }

    /// Tells the kernel to forget a name (after a failed commit), off the request path.
    pub fn invalidate(&self, parent: u64, name: std::ffi::OsString) {
        if let Some(n) = self.notifier.get().cloned() {
            std::thread::spawn(move || {
                let _ = n.inval_entry(INodeNo(parent), &name);
            });
        }
    }
}

/// A number no other mount's staging keys share (time and pid mixed through blake3).
fn rand_nonce() -> u64 {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let seed = format!("{t}/{}", std::process::id());
    let h = blake3::hash(seed.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

/// The chunk directory named `name` (decoded to `raw`) inside `dir`.
pub fn chunk_child(dir: &DirNode, name: &OsStr, raw: &str) -> DirNode {
    let mut chain = dir.chain.clone();
    chain.push(name.to_string_lossy().into_owned());
    DirNode { prefix: format!("{}{raw}", dir.prefix), chain }
}

fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::Hbm => "hbm",
        Tier::Dram => "dram",
        Tier::Nvme => "nvme",
        Tier::ObjectStore => "object-store",
    }
}

/// The text of xattr `XATTRS[which]` for an object.
pub fn xattr_value(which: usize, v: &ObjectInfo) -> String {
    match which {
        1 => {
            let mut tiers: Vec<&str> = v.replicas.iter().map(|r| tier_name(r.tier)).collect();
            tiers.dedup();
            tiers.join(",")
        }
        2 => v.replicas.len().to_string(),
        3 => match &v.checksum {
            Some(c) => {
                format!("blake3:{}", c.iter().map(|b| format!("{b:02x}")).collect::<String>())
            }
            None => "none".into(),
        },
        4 => match v.persistence {
            Persistence::None => "none",
            Persistence::Lazy => "lazy",
            Persistence::Eager => "eager",
        }
        .into(),
        5 => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            if v.lease_end_ms > now {
                format!("until {} ms", v.lease_end_ms)
            } else {
                "none".into()
            }
        }
        6 => match v.pin {
            Pin::None => "none",
            Pin::Soft => "soft",
            Pin::Hard => "hard",
        }
        .into(),
        _ => String::new(),
    }
}
