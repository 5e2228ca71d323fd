//! Directory listings: the master's `list_dir` pages, turned into path names by the escaping
//! rule, streamed to the kernel one page at a time.
//!
//! Mechanism. An open directory holds a window of at most one page of entries (plus `.`, `..`,
//! `/.kvfs` at the root, and this daemon's own entries: directories made with mkdir and files
//! being written). Entry `i` carries offset `i + 1`; a readdir at an offset past the window
//! fetches the next page, one before it restarts the listing and skips forward. Memory per open
//! directory is bounded by `list_page_entries`, whatever the directory holds.
//!
//! A chunk directory (a piece of a long component, `name%+`) lists the parent directory's
//! entries whose component runs through it, starting at its raw prefix and stopping at the
//! first entry that does not start with it. Consecutive components that share a piece show it
//! once.
//!
//! An object that shares its name with a directory is listed as `name%=`: a directory in the
//! same page is seen directly, and one that could sort after the page's end is probed with a
//! one-entry `list_dir`.

use std::collections::HashSet;
use std::ffi::OsString;

use fuser::FileType;
use kvfs_client::DirEntry;

use crate::errno;
use crate::inode::{self, DirNode, Kind};
use crate::names;
use crate::state::{Errno, Inner, lock};

/// One listed name.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: OsString,
    pub kind: FileType,
    pub ino: u64,
}

/// The name of a listing entry (directories end in `/`) and whether it is a directory.
pub fn entry_name(e: &DirEntry) -> (&str, bool) {
    match e {
        DirEntry::Object { name, .. } => (name, false),
        DirEntry::Dir { name } => (name, true),
    }
}

pub struct DirStream {
    node: DirNode,
    ino: u64,
    window: Vec<Entry>,
    /// Index of `window[0]` in the whole listing.
    base: u64,
    next: Option<String>,
    started: bool,
    done: bool,
    last_piece: Option<String>,
    local: HashSet<OsString>,
}

impl DirStream {
    pub fn open(inner: &Inner, ino: u64, node: DirNode) -> DirStream {
        let mut s = DirStream {
            node,
            ino,
            window: Vec::new(),
            base: 0,
            next: None,
            started: false,
            done: false,
            last_piece: None,
            local: HashSet::new(),
        };
        s.start(inner);
        s
    }

    fn start(&mut self, inner: &Inner) {
        let mut w = vec![
            Entry { name: ".".into(), kind: FileType::Directory, ino: self.ino },
            Entry { name: "..".into(), kind: FileType::Directory, ino: inode::ROOT },
        ];
        if self.ino == inode::ROOT {
            w.push(Entry {
                name: names::CONTROL_DIR.into(),
                kind: FileType::Directory,
                ino: inode::CONTROL_DIR,
            });
        }
        self.local.clear();
        for e in self.local_entries(inner) {
            if self.local.insert(e.name.clone()) {
                w.push(e);
            }
        }
        self.window = w;
        self.base = 0;
        self.next = None;
        self.started = false;
        self.done = false;
        self.last_piece = None;
    }

    /// Directories made with mkdir and files being written, directly in this directory.
    fn local_entries(&self, inner: &Inner) -> Vec<Entry> {
        let (base, k) = (self.node.base(), self.node.chain.len());
        let mut out = Vec::new();
        let dirs: Vec<(String, Vec<String>)> = lock(&inner.local_dirs)
            .iter()
            .filter(|(p, _)| p.starts_with(&self.node.prefix) && **p != self.node.prefix)
            .map(|(p, c)| (p.clone(), c.clone()))
            .collect();
        for (prefix, chain) in dirs {
            if !chain.is_empty() {
                // A chunk directory made here: a child when its chain extends ours by one.
                if prefix.starts_with(base)
                    && chain.len() == k + 1
                    && chain[..k] == self.node.chain[..]
                {
                    out.push(Entry {
                        name: chain[k].clone().into(),
                        kind: FileType::Directory,
                        ino: 0,
                    });
                }
                continue;
            }
            let Some(component) = prefix.strip_prefix(base).and_then(|r| r.strip_suffix('/'))
            else {
                continue;
            };
            if component.contains('/') {
                continue;
            }
            if let Some(e) = self.place(component, true, false) {
                out.push(e);
            }
        }
        let pending: Vec<String> = lock(&inner.pending).keys().cloned().collect();
        for key in pending {
            let Some(component) = key.strip_prefix(base) else { continue };
            if !component.contains('/')
                && let Some(e) = self.place(component, false, false)
            {
                out.push(e);
            }
        }
        for e in &mut out {
            e.ino = lock(&inner.table).ino_of(&self.kind_of(e));
        }
        out
    }

    /// Where `component` (of a directory entry when `is_dir`) shows here, if it does.
    fn place(&self, component: &str, is_dir: bool, file_mark: bool) -> Option<Entry> {
        let (piece, more) =
            names::child_piece(component, self.node.first(), file_mark, &self.node.chain)?;
        let kind = if more || is_dir { FileType::Directory } else { FileType::RegularFile };
        Some(Entry { name: piece.into(), kind, ino: 0 })
    }

    /// The node an entry of this directory stands for (for its inode number).
    fn kind_of(&self, e: &Entry) -> Kind {
        let name = e.name.to_string_lossy();
        match names::decode_piece(name.as_bytes()) {
            Some(names::Piece::Chunk(raw)) => {
                let mut chain = self.node.chain.clone();
                chain.push(name.into_owned());
                Kind::Dir(DirNode { prefix: format!("{}{raw}", self.node.prefix), chain })
            }
            Some(names::Piece::Last { raw, .. }) => {
                let key = format!("{}{raw}", self.node.prefix);
                if e.kind == FileType::Directory {
                    Kind::Dir(DirNode::dir(format!("{key}/")))
                } else {
                    Kind::Object { key }
                }
            }
            None => Kind::ControlDir,
        }
    }

    /// Entries from index `offset` on, fetching pages as needed; empty at the end.
    pub async fn from(&mut self, inner: &Inner, offset: u64) -> Result<&[Entry], Errno> {
        if offset < self.base {
            self.start(inner);
        }
        loop {
            let end = self.base + self.window.len() as u64;
            if offset < end {
                return Ok(&self.window[(offset - self.base) as usize..]);
            }
            if self.done {
                return Ok(&[]);
            }
            let page = self.next_page(inner).await?;
            self.base = end;
            self.window = page;
        }
    }

    async fn next_page(&mut self, inner: &Inner) -> Result<Vec<Entry>, Errno> {
        let base = self.node.base().to_string();
        let partial = self.node.partial().to_string();
        let after = if self.started {
            self.next.clone()
        } else {
            (!partial.is_empty()).then(|| partial.clone())
        };
        let page = inner
            .client
            .list_dir(&base, after.as_deref(), inner.cfg.list_page_entries)
            .await
            .map_err(|e| errno::of(&e))?;
        self.started = true;
        self.next = page.next_start_after.clone();
        self.done = self.next.is_none();
        let dirs: HashSet<&str> = page
            .entries
            .iter()
            .filter_map(|e| match e {
                DirEntry::Dir { name } => name.strip_suffix('/'),
                _ => None,
            })
            .collect();
        let last = page.entries.last().map(|e| entry_name(e).0.to_string()).unwrap_or_default();
        let mut out = Vec::new();
        for e in &page.entries {
            let (name, is_dir) = entry_name(e);
            let component = name.strip_suffix('/').unwrap_or(name);
            // Replacements being committed (`write::STAGING_PREFIX`) are nobody's files.
            if base.is_empty() && is_dir && crate::write::STAGING_PREFIX.starts_with(name) {
                continue;
            }
            if !component.starts_with(&partial) {
                self.done = true;
                break;
            }
            let mark = !is_dir && {
                let sub = format!("{base}{component}/");
                dirs.contains(component)
                    || lock(&inner.local_dirs).contains_key(&sub)
                    || (!self.done
                        && format!("{component}/") > last
                        && inner.dir_exists(&sub).await?)
            };
            let Some(entry) = self.place(component, is_dir, mark) else { continue };
            let piece = entry.name.to_string_lossy().into_owned();
            if self.last_piece.as_deref() == Some(piece.as_str())
                || self.local.contains(&entry.name)
            {
                continue;
            }
            self.last_piece = Some(piece);
            out.push(entry);
        }
        for e in &mut out {
            e.ino = lock(&inner.table).ino_of(&self.kind_of(e));
        }
        Ok(out)
    }
}
