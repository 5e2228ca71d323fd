//! Paged slab: stable `u32` ids for the directory's objects and replicas, and intrusive
//! doubly-linked lists threaded through entries (the per-segment LRU lists; their links live in
//! whatever store implements [`Links`], one slab or several).
//!
//! Mechanism: entries live in pages of `PAGE` slots, so growth never copies or doubles the whole
//! table (a `Vec` of 10 M 80-byte slots would briefly need 2.4 GB to grow); freed ids go to a LIFO
//! free list and are reused. Ids are `u32` (the directory keeps them under 2^31: its replica
//! references use the top bit), far past `objects_max`. Memory is `pages * PAGE *
//! size_of::<Slot<T>>()`, reported exactly by [`Slab::heap_bytes`].
//!
//! Invariants: an id handed out by `insert` stays valid until `remove`; `NIL` is never an id.
//! Not handled: generation counters (a stale id after removal is a caller bug; the directory
//! never keeps ids across removal).

pub const NIL: u32 = u32::MAX;
const PAGE_SHIFT: u32 = 12;
const PAGE: usize = 1 << PAGE_SHIFT;

#[derive(Debug, Clone)]
enum Slot<T> {
    Used(T),
    Free(u32),
}

#[derive(Debug, Clone)]
pub struct Slab<T> {
    pages: Vec<Vec<Slot<T>>>,
    free_head: u32,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { pages: Vec::new(), free_head: NIL, len: 0 }
    }
}

impl<T> Slab<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn insert(&mut self, value: T) -> u32 {
        self.len += 1;
        if self.free_head != NIL {
            let id = self.free_head;
            let slot = self.slot_mut(id);
            let Slot::Free(next) = *slot else { unreachable!("free list points at a used slot") };
            *slot = Slot::Used(value);
            self.free_head = next;
            return id;
        }
        if self.pages.last().is_none_or(|p| p.len() == PAGE) {
            self.pages.push(Vec::with_capacity(PAGE));
        }
        let page_index = self.pages.len() - 1;
        let page = &mut self.pages[page_index];
        page.push(Slot::Used(value));
        let id = (page_index << PAGE_SHIFT | (page.len() - 1)) as u32;
        assert!(id != NIL, "slab full");
        id
    }

    pub fn remove(&mut self, id: u32) -> T {
        let free_head = self.free_head;
        let slot = std::mem::replace(self.slot_mut(id), Slot::Free(free_head));
        let Slot::Used(value) = slot else { panic!("slab: remove of free id {id}") };
        self.free_head = id;
        self.len -= 1;
        value
    }

    pub fn get(&self, id: u32) -> Option<&T> {
        match self.pages.get((id >> PAGE_SHIFT) as usize)?.get(id as usize & (PAGE - 1))? {
            Slot::Used(v) => Some(v),
            Slot::Free(_) => None,
        }
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        match self.pages.get_mut((id >> PAGE_SHIFT) as usize)?.get_mut(id as usize & (PAGE - 1))? {
            Slot::Used(v) => Some(v),
            Slot::Free(_) => None,
        }
    }

    /// Every live entry with its id, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.pages.iter().enumerate().flat_map(|(p, page)| {
            page.iter().enumerate().filter_map(move |(i, slot)| match slot {
                Slot::Used(v) => Some(((p << PAGE_SHIFT | i) as u32, v)),
                Slot::Free(_) => None,
            })
        })
    }

    /// Bytes of heap the slab itself holds (not what `T` points to).
    pub fn heap_bytes(&self) -> usize {
        self.pages.len() * PAGE * std::mem::size_of::<Slot<T>>()
            + self.pages.capacity() * std::mem::size_of::<Vec<Slot<T>>>()
    }

    #[cfg(test)]
    pub fn slot_size() -> usize {
        std::mem::size_of::<Slot<T>>()
    }

    fn slot_mut(&mut self, id: u32) -> &mut Slot<T> {
        &mut self.pages[(id >> PAGE_SHIFT) as usize][id as usize & (PAGE - 1)]
    }
}

impl<T> std::ops::Index<u32> for Slab<T> {
    type Output = T;
    fn index(&self, id: u32) -> &T {
        self.get(id).unwrap_or_else(|| panic!("slab: no entry {id}"))
    }
}

impl<T> std::ops::IndexMut<u32> for Slab<T> {
    fn index_mut(&mut self, id: u32) -> &mut T {
        self.get_mut(id).unwrap_or_else(|| panic!("slab: no entry {id}"))
    }
}

/// The entries a [`List`] threads through, by id: `(prev, next)` of each.
pub trait Links {
    fn links(&self, id: u32) -> (u32, u32);
    fn set_links(&mut self, id: u32, prev: u32, next: u32);
}

/// Head, tail and length of an intrusive list over a [`Slab`]; oldest at the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct List {
    pub head: u32,
    pub tail: u32,
    pub len: u32,
}

impl Default for List {
    fn default() -> Self {
        List { head: NIL, tail: NIL, len: 0 }
    }
}

impl List {
    pub fn push_back(&mut self, store: &mut impl Links, id: u32) {
        store.set_links(id, self.tail, NIL);
        if self.tail == NIL {
            self.head = id;
        } else {
            let (prev, _) = store.links(self.tail);
            store.set_links(self.tail, prev, id);
        }
        self.tail = id;
        self.len += 1;
    }

    pub fn unlink(&mut self, store: &mut impl Links, id: u32) {
        let (prev, next) = store.links(id);
        if prev == NIL {
            self.head = next;
        } else {
            let (pp, _) = store.links(prev);
            store.set_links(prev, pp, next);
        }
        if next == NIL {
            self.tail = prev;
        } else {
            let (_, nn) = store.links(next);
            store.set_links(next, prev, nn);
        }
        store.set_links(id, NIL, NIL);
        self.len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct E(u32, u32, u32);
    impl Links for Slab<E> {
        fn links(&self, id: u32) -> (u32, u32) {
            (self[id].1, self[id].2)
        }
        fn set_links(&mut self, id: u32, prev: u32, next: u32) {
            self[id].1 = prev;
            self[id].2 = next;
        }
    }

    fn order(list: &List, slab: &Slab<E>) -> Vec<u32> {
        let mut out = vec![];
        let mut at = list.head;
        while at != NIL {
            out.push(slab[at].0);
            at = slab.links(at).1;
        }
        out
    }

    #[test]
    fn ids_are_reused_and_lists_keep_order() {
        let mut slab = Slab::default();
        let ids: Vec<u32> = (0..5000).map(|i| slab.insert(E(i, NIL, NIL))).collect();
        assert_eq!(slab.len(), 5000);
        let mut list = List::default();
        for &id in &ids[..4] {
            list.push_back(&mut slab, id);
        }
        list.unlink(&mut slab, ids[1]);
        list.push_back(&mut slab, ids[1]);
        list.unlink(&mut slab, ids[0]);
        assert_eq!(order(&list, &slab), vec![2, 3, 1]);
        assert_eq!(list.len, 3);
        assert_eq!(slab.remove(ids[4999]).0, 4999);
        assert_eq!(slab.insert(E(9, NIL, NIL)), ids[4999]);
        assert_eq!(slab.iter().count(), 5000);
        assert!(slab.get(ids[4999] + 1).is_none());
    }
}
