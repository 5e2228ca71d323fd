//! Ordered, paged listings over the sorted key set: flat (`ls`, admin) and one directory level
//! (FUSE `readdir`, where `/` in keys makes directories).
//!
//! Mechanism: `order` holds object ids in key order (see `order.rs`); a page is one range seek
//! plus at most `limit` steps, each reading the object's slot and its key in the arena. `list_dir` seeks past a whole sub-directory in one step: every key under `p/d/`
//! sorts below `p/d0` (`'0'` is the byte after `'/'`), so a directory with a million entries
//! below it costs one seek, not a million steps. Pending puts are not in `order`: listings
//! only show complete objects.
//!
//! Policy: pages hold at most `min(limit, list_limit_max)` entries; `next_start_after` is
//! `Some` iff more entries follow. For `list_dir`, a prefix that is not empty and does not
//! end with `/` gets one appended. An object and a directory can share a name (`a` and `a/`).
//!
//! Not handled: consistency across pages under concurrent writes (a page reflects the moment
//! it was taken; resuming from `start_after` never repeats or skips a key that stayed put).

use std::ops::Bound;

use super::{Directory, key_reader, key_str};
use crate::error::{Error, ErrorKind, Result};
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
        for id in self.order.range(lower, key_reader(&self.objects, &self.keys)) {
            let o = &self.objects[id];
            let key = self.keys.get(o.key_pos());
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
            for id in self.order.range(from, key_reader(&self.objects, &self.keys)) {
                let o = &self.objects[id];
                let key = key_str(self.keys.get(o.key_pos()));
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
