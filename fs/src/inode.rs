//! The inode table: which kernel inode number stands for which directory, object or control
//! file, and how many kernel lookups keep each alive.
//!
//! Mechanism. An inode number is derived from what the node *is* (blake3 of its identity: the
//! directory's key prefix, the object's key and version, or a job's id), so the same object has the same
//! number across lookups and remounts, and `du`/`find` see consistent identities. A name that
//! gets a new object (upsert, rename over it, replacement) gets a new inode: objects never
//! change, so the kernel never resizes an inode it holds, and descriptors open on the old one
//! keep its size and bytes. Inodes whose name went are `Kind::Unlinked`. Collisions (2^-62
//! per pair) are resolved by probing to the next free number. The kernel's lookup count is kept
//! exactly: every `entry`/`created` reply adds one, `forget` subtracts, and a node with no
//! lookups and no open handles is dropped, so the table is bounded by what the kernel caches.
//!
//! Not here: attributes that need the master (sizes, versions) are cached on the node only as
//! the last value seen; the daemon refreshes them on getattr/open.

use std::collections::HashMap;

pub const ROOT: u64 = 1;
pub const CONTROL_DIR: u64 = 2;
pub const CONTROL: u64 = 3;
/// Status files take `STATUS_FIRST + index` (up to `JOBS_DIR - 1`).
pub const STATUS_FIRST: u64 = 4;
/// `/.kvfs/jobs/`; the job files in it have derived numbers.
pub const JOBS_DIR: u64 = 15;
/// Numbers below this are the fixed nodes above.
const DERIVED_MIN: u64 = 16;

/// A directory node: a real directory (`prefix` is "" or ends with `/`), or one piece of a long
/// component cut into a chain of directories (`prefix` then also holds the raw text of the
/// pieces so far, and `chain` their names).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DirNode {
    pub prefix: String,
    pub chain: Vec<String>,
}

impl DirNode {
    pub fn root() -> DirNode {
        DirNode { prefix: String::new(), chain: Vec::new() }
    }

    /// The directory of the keys starting with `prefix` ("" or ending with `/`).
    pub fn dir(prefix: String) -> DirNode {
        debug_assert!(prefix.is_empty() || prefix.ends_with('/'));
        DirNode { prefix, chain: Vec::new() }
    }

    /// Raw text of the cut component so far ("" for a real directory).
    pub fn partial(&self) -> &str {
        if self.chain.is_empty() {
            return "";
        }
        match self.prefix.rfind('/') {
            Some(i) => &self.prefix[i + 1..],
            None => &self.prefix,
        }
    }

    /// The real directory the entries come from ("" or ending with `/`).
    pub fn base(&self) -> &str {
        &self.prefix[..self.prefix.len() - self.partial().len()]
    }

    /// Whether the component being named is the key's first.
    pub fn first(&self) -> bool {
        self.base().is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir(DirNode),
    /// An object, committed or being written by this mount.
    Object {
        key: String,
    },
    ControlDir,
    Control,
    Status(usize),
    /// `/.kvfs/jobs/`.
    JobsDir,
    /// `/.kvfs/jobs/ID.json`: a job of the master, by id.
    Job(u64),
    /// An object whose name went (unlinked, renamed over, replaced) while the kernel still
    /// held this inode: descriptors opened before keep reading its bytes and see these
    /// attributes; opening it again is `ESTALE`, which makes the kernel look the name up anew.
    Unlinked(ObjAttr),
}

impl Kind {
    fn identity(&self) -> Option<Vec<u8>> {
        match self {
            Kind::Dir(d) => Some([b"d\0", d.prefix.as_bytes()].concat()),
            Kind::Object { key } => Some([b"o\0", key.as_bytes()].concat()),
            Kind::Job(id) => Some([b"j\0".as_slice(), &id.to_le_bytes()].concat()),
            _ => None,
        }
    }
}

/// What the daemon last saw of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ObjAttr {
    pub size: u64,
    pub version: u64,
}

#[derive(Debug)]
pub struct Node {
    pub kind: Kind,
    pub lookups: u64,
    pub opens: u32,
    pub attr: Option<ObjAttr>,
    /// The version whose pages the kernel may cache for this inode (set by opens that keep
    /// or start a page cache); 0 when none.
    pub cached: u64,
}

#[derive(Debug, Default)]
pub struct Table {
    nodes: HashMap<u64, Node>,
}

impl Table {
    pub fn new(status_files: usize) -> Table {
        assert!(STATUS_FIRST + status_files as u64 <= JOBS_DIR, "too many status files");
        let mut t = Table::default();
        let fixed = [
            (ROOT, Kind::Dir(DirNode::root())),
            (CONTROL_DIR, Kind::ControlDir),
            (CONTROL, Kind::Control),
            (JOBS_DIR, Kind::JobsDir),
        ];
        for (ino, kind) in fixed
            .into_iter()
            .chain((0..status_files).map(|i| (STATUS_FIRST + i as u64, Kind::Status(i))))
        {
            t.nodes.insert(ino, Node { kind, lookups: 1, opens: 0, attr: None, cached: 0 });
        }
        t
    }

    pub fn get(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(&ino)
    }

    pub fn get_mut(&mut self, ino: u64) -> Option<&mut Node> {
        self.nodes.get_mut(&ino)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The number `kind` has (or would get), without remembering it.
    pub fn ino_of(&self, kind: &Kind) -> u64 {
        self.ino_of_version(kind, None)
    }

    /// The number of `kind` at an object version: each version of an object is its own inode
    /// (objects never change, so the kernel never has to resize an inode it already holds; a
    /// name that gets a new object gets a new inode, and the old one keeps its size for the
    /// descriptors open on it). `None`: whichever version the table holds first.
    pub fn ino_of_version(&self, kind: &Kind, version: Option<u64>) -> u64 {
        let Some(mut id) = kind.identity() else {
            return self.nodes.iter().find(|(_, n)| n.kind == *kind).map(|(i, _)| *i).unwrap_or(0);
        };
        if let (Kind::Object { .. }, Some(v)) = (kind, version) {
            id.extend_from_slice(&v.to_le_bytes());
        }
        let h = blake3::hash(&id);
        let mut ino = u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]));
        ino = ino % (1 << 62) + DERIVED_MIN;
        let same = |n: &Node| {
            n.kind == *kind && version.is_none_or(|v| n.attr.map_or(0, |a| a.version) == v)
        };
        loop {
            match self.nodes.get(&ino) {
                Some(n) if !same(n) => ino = ino.wrapping_add(1).max(DERIVED_MIN),
                _ => return ino,
            }
        }
    }

    /// The numbers of every node of `kind` (several after renames: the kernel keeps the
    /// number a renamed file had, and a fresh lookup of the new name derives another).
    pub fn inos_of(&self, kind: &Kind) -> Vec<u64> {
        self.nodes.iter().filter(|(_, n)| n.kind == *kind).map(|(&i, _)| i).collect()
    }

    /// A rename: the node keeps its number (the kernel moved its dentry) and stands for
    /// `kind` from now on.
    pub fn rekey(&mut self, ino: u64, kind: Kind) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.kind = kind;
        }
    }

    /// The name of these objects went: their inodes keep the attributes they last showed
    /// and stand for nothing by name any more.
    pub fn detach(&mut self, key: &str) -> Vec<u64> {
        let inos = self.inos_of(&Kind::Object { key: key.to_string() });
        for &ino in &inos {
            if let Some(n) = self.nodes.get_mut(&ino) {
                n.kind = Kind::Unlinked(n.attr.unwrap_or_default());
            }
        }
        inos
    }

    /// Records one kernel lookup of `kind` (an `entry` reply); returns its number.
    pub fn remember(&mut self, kind: Kind, attr: Option<ObjAttr>) -> u64 {
        let version = match kind {
            Kind::Object { .. } => Some(attr.map_or(0, |a| a.version)),
            _ => None,
        };
        let ino = self.ino_of_version(&kind, version);
        let node = self.nodes.entry(ino).or_insert(Node {
            kind,
            lookups: 0,
            opens: 0,
            attr: None,
            cached: 0,
        });
        node.lookups += 1;
        if attr.is_some() {
            node.attr = attr;
        }
        ino
    }

    /// The kernel dropped `n` lookups; the node goes when nothing holds it.
    pub fn forget(&mut self, ino: u64, n: u64) {
        if ino < DERIVED_MIN {
            return;
        }
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.lookups = node.lookups.saturating_sub(n);
            if node.lookups == 0 && node.opens == 0 {
                self.nodes.remove(&ino);
            }
        }
    }

    /// An open handle holds the node.
    pub fn open(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.opens += 1;
        }
    }

    pub fn close(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.opens = n.opens.saturating_sub(1);
            if ino >= DERIVED_MIN && n.lookups == 0 && n.opens == 0 {
                self.nodes.remove(&ino);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_stable_and_lookups_counted() {
        let mut t = Table::new(2);
        let obj = Kind::Object { key: "a/b".into() };
        let v1 = Some(ObjAttr { size: 3, version: 1 });
        let ino = t.ino_of_version(&obj, Some(1));
        assert!(ino >= DERIVED_MIN);
        assert_eq!(t.remember(obj.clone(), v1), ino);
        assert_eq!(t.remember(obj.clone(), v1), ino);
        let v2 = t.remember(obj.clone(), Some(ObjAttr { size: 5, version: 2 }));
        assert_ne!(v2, ino, "another version of the object is another inode");
        assert_eq!(t.get(v2).unwrap().attr.unwrap().size, 5);
        t.forget(v2, 1);
        assert_eq!(t.get(ino).unwrap().attr.unwrap().size, 3);
        let dir = Kind::Dir(DirNode::dir("a/".into()));
        assert_ne!(t.ino_of(&dir), ino, "a directory and an object never share a number");
        t.open(ino);
        t.forget(ino, 2);
        assert!(t.get(ino).is_some(), "an open handle keeps the node");
        t.close(ino);
        assert!(t.get(ino).is_none());
        t.forget(ROOT, 100);
        assert!(t.get(ROOT).is_some());
        assert_eq!(t.ino_of(&Kind::Status(1)), STATUS_FIRST + 1);
        assert_eq!(t.ino_of(&Kind::JobsDir), JOBS_DIR);
    }

    #[test]
    fn job_files_have_stable_derived_numbers() {
        let mut t = Table::new(3);
        let job = Kind::Job(1_700_000_000_123);
        let ino = t.ino_of(&job);
        assert!(ino >= DERIVED_MIN);
        assert_eq!(t.remember(job.clone(), None), ino);
        assert_eq!(t.remember(job.clone(), None), ino);
        assert_ne!(t.ino_of(&Kind::Job(1_700_000_000_124)), ino);
        t.forget(ino, 2);
        assert!(t.get(ino).is_none(), "a job file the kernel forgot goes");
        assert_eq!(Table::new(3).ino_of(&job), ino, "the same number in another mount");
    }

    #[test]
    fn collisions_probe_to_a_free_number() {
        let mut t = Table::new(0);
        let a = Kind::Object { key: "x".into() };
        let ino = t.ino_of_version(&a, Some(0));
        // Squat a's number with another node: a must move on, deterministically.
        t.nodes.insert(
            ino,
            Node {
                kind: Kind::Object { key: "y".into() },
                lookups: 1,
                opens: 0,
                attr: None,
                cached: 0,
            },
        );
        let moved = t.remember(a.clone(), None);
        assert_ne!(moved, ino);
        assert_eq!(t.ino_of_version(&a, Some(0)), moved);
    }

    #[test]
    fn chunk_directories_know_their_base() {
        let d = DirNode { prefix: "m/xxxx".into(), chain: vec!["xxxx%+".into()] };
        assert_eq!(d.partial(), "xxxx");
        assert_eq!(d.base(), "m/");
        assert!(!d.first());
        let r = DirNode { prefix: "yy".into(), chain: vec!["yy%+".into()] };
        assert_eq!(r.base(), "");
        assert!(r.first());
        assert!(DirNode::root().first());
    }
}
