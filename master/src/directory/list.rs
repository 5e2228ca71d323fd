//! Ordered, paged listings over the sorted key set: flat (`ls`, admin) and one directory level
//! (FUSE `readdir`, where `/` in keys makes directories).
//!
//! Mechanism: `order` holds object ids in key order (see `order.rs`); a page is one range seek plus
//! at most `limit` steps, each reading the object's slot and its key in the arena. Steps are taken
//! in groups (`OrderedKeys`): the slots of a group are read, then their keys, so the cache misses
//! of a group overlap instead of costing two in a row per entry. `list_dir` seeks past a whole
//! sub-directory in one step: every key under `p/d/` sorts below `p/d0` (`'0'` is the byte after
//! `'/'`), so a directory with a million entries below it costs one seek, not a million steps.
//! Pending puts are not in `order`: listings only show complete objects.
//!
//! Policy: pages hold at most `min(limit, list_limit_max)` entries; `next_start_after` is
//! `Some` iff more entries follow. For `list_dir`, a prefix that is not empty and does not
//! end with `/` gets one appended. An object and a directory can share a name (`a` and `a/`).
//!
//! Not handled: consistency across pages under concurrent writes (a page reflects the moment
//! it was taken; resuming from `start_after` never repeats or skips a key that stayed put).

use std::ops::Bound;

use super::keys::{KeyArena, KeyAt};
use super::{Directory, LOOKUP_GROUP, Obj, key_reader, key_str};
use crate::error::{Error, ErrorKind, Result};
use crate::slab::{NIL, Slab};
use crate::types::{DirEntry, DirPage, ListEntry, ListPage};

impl Directory {
    /// Complete objects whose key starts with `prefix`, in key order, after `start_after`.
    pub fn list(&self, prefix: &str, start_after: Option<&str>, limit: usize) -> Result<ListPage> {
        let limit = self.page_limit(limit, "list")?;
        let lower = match start_after {
            Some(after) if after >= prefix => Bound::Excluded(after.as_bytes()),
            _ => Bound::Included(prefix.as_bytes()),
        };
        let mut entries = Vec::with_capacity(limit.min(1024));
        let mut more = false;
        for (id, key) in self.ordered(lower) {
            let o = &self.objects[id];
            if !key.starts_with(prefix.as_bytes()) {
                break;
            }
            if entries.len() == limit {
                more = true;
                break;
            }
            entries.push(ListEntry { key: key_str(key).into(), size: o.size, version: o.version });
        }
        let next_start_after = more.then(|| entries.last().map(|e| e.key.to_string())).flatten();
        Ok(ListPage { entries, next_start_after })
    }

    /// Immediate children of the `/`-separated `prefix`: objects and sub-directories (names
    /// end with `/`), in name order, after the child named `start_after`.
    pub fn list_dir(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<DirPage> {
        let limit = self.page_limit(limit, "list_dir")?;
        let mut dir = prefix.to_string();
        if !dir.is_empty() && !dir.ends_with('/') {
            dir.push('/');
        }
        let mut seek = match start_after {
            Some(name) => past_child(&dir, name),
            None => Bound::Included(dir.clone()),
        };
        let mut entries = Vec::new();
        let mut more = false;
        loop {
            let mut next_seek = None;
            let from = seek.as_ref().map(String::as_bytes);
            for (id, key) in self.ordered(from) {
                let o = &self.objects[id];
                let key = key_str(key);
                let Some(rest) = key.strip_prefix(dir.as_str()) else { break };
                if entries.len() == limit {
                    more = true;
                    break;
                }
                if let Some(slash) = rest.find('/') {
                    let name = &rest[..=slash];
                    entries.push(DirEntry::Dir { name: name.to_string() });
                    next_seek = Some(past_child(&dir, name));
                    break;
                }
                entries.push(DirEntry::Object {
                    name: rest.to_string(),
                    size: o.size,
                    version: o.version,
                });
            }
            match next_seek {
                Some(bound) => seek = bound,
                None => break,
            }
        }
        let next_start_after = more.then(|| entries.last().map(|e| e.name().to_string())).flatten();
        Ok(DirPage { entries, next_start_after })
    }

    /// Object ids with their keys, in key order from `from`.
    fn ordered<'a>(&'a self, from: Bound<&[u8]>) -> impl Iterator<Item = (u32, &'a [u8])> {
        OrderedKeys {
            objects: &self.objects,
            keys: &self.keys,
            ids: self.order.range(from, key_reader(&self.objects, &self.keys)),
            buf: [(NIL, b""); LOOKUP_GROUP],
            at: 0,
            len: 0,
            group: 4,
        }
    }

    fn page_limit(&self, limit: usize, op: &'static str) -> Result<usize> {
        if limit == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, op).with_detail("limit 0"));
        }
        Ok(limit.min(self.cfg.list_limit_max))
    }
}

/// The first key bound after the child `name` of `dir` and, for a sub-directory, everything
/// below it.
fn past_child(dir: &str, name: &str) -> Bound<String> {
    match name.strip_suffix('/') {
        Some(sub) => Bound::Included(format!("{dir}{sub}0")),
        None => Bound::Excluded(format!("{dir}{name}")),
    }
}

/// Ordered ids with their keys, read in groups that double from 4 to `LOOKUP_GROUP` (a page
/// that stops early, or `list_dir` seeking past a sub-directory, reads few entries ahead).
struct OrderedKeys<'a, I> {
    objects: &'a Slab<Obj>,
    keys: &'a KeyArena,
    ids: I,
    buf: [(u32, &'a [u8]); LOOKUP_GROUP],
    at: usize,
    len: usize,
    group: usize,
}

impl<'a, I: Iterator<Item = u32>> Iterator for OrderedKeys<'a, I> {
    type Item = (u32, &'a [u8]);

    fn next(&mut self) -> Option<(u32, &'a [u8])> {
        if self.at == self.len {
            self.len = 0;
            for id in self.ids.by_ref().take(self.group) {
                self.buf[self.len].0 = id;
                self.len += 1;
            }
            let mut at = [KeyAt::default(); LOOKUP_GROUP];
            for (a, &(id, _)) in at.iter_mut().zip(&self.buf[..self.len]) {
                *a = self.objects[id].key_at();
            }
            // load the keys now, together, rather than one by one as the caller reads them
            let mut touched = 0;
            for (entry, &a) in self.buf[..self.len].iter_mut().zip(&at) {
                touched ^= self.keys.touch(a);
                entry.1 = self.keys.get(a);
            }
            std::hint::black_box(touched);
            self.at = 0;
            self.group = (self.group * 2).min(LOOKUP_GROUP);
        }
        let entry = self.buf.get(self.at).filter(|_| self.at < self.len)?;
        self.at += 1;
        Some(*entry)
    }
}
