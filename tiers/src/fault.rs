//! A fault-injecting wrapper around any [`Medium`], so error paths run in tests.
//!
//! Mechanism: per operation kind ([`Op`]), a FIFO of armed [`Fault`]s; each call of that kind
//! takes the next one (if any) and applies it. [`FaultyMedium::inject`] arms a fault for the next
//! `times` calls.
//!
//! Faults: `Fail(kind)` returns an error without touching the medium; `FailAfter(kind)` lets the
//! operation happen and then reports an error (a lost acknowledgement: the caller must be
//! idempotent); `CorruptRead` flips one byte of what a get returned (a medium that does not
//! verify, or corruption after the medium, e.g. in a copy).
//!
//! `rename` is its own kind ([`Op::Rename`]: a `FailAfter` rename has happened, the caller must
//! learn the outcome from `stat`/`previous_name`); `previous_name` counts as a [`Op::Stat`].
//!
//! Not handled: delays (no timing in tests), faults keyed by object key.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use crate::error::{Error, ErrorKind, Result};
use crate::medium::{Capabilities, Medium, ObjectMeta, PutOptions, RenameOptions};

/// Operation kinds a fault can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Put,
    Get,
    Stat,
    Remove,
    List,
    Rename,
}

/// What happens to a targeted call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail with this kind; the medium is not called.
    Fail(ErrorKind),
    /// Call the medium, then fail with this kind.
    FailAfter(ErrorKind),
    /// (gets only) flip a byte of the returned data.
    CorruptRead,
}

/// Wraps a medium and injects armed faults.
pub struct FaultyMedium<M> {
    inner: M,
    armed: Mutex<HashMap<Op, VecDeque<Fault>>>,
    injected: AtomicU64,
}

impl<M: Medium> FaultyMedium<M> {
    pub fn new(inner: M) -> Self {
        FaultyMedium { inner, armed: Mutex::new(HashMap::new()), injected: AtomicU64::new(0) }
    }

    /// Arm `fault` for the next `times` calls of `op`.
    pub fn inject(&self, op: Op, fault: Fault, times: usize) {
        let mut a = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        a.entry(op).or_default().extend(std::iter::repeat_n(fault, times));
    }

    /// Disarm everything.
    pub fn clear(&self) {
        self.armed.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Faults applied so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    pub fn inner(&self) -> &M {
        &self.inner
    }

    fn take(&self, op: Op) -> Option<Fault> {
        let f = self.armed.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&op)?.pop_front();
        if f.is_some() {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        f
    }

    async fn apply<T, F>(&self, op: Op, call: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        let err = |k: ErrorKind, when: &str| Error::new(k, format!("injected fault {when} {op:?}"));
        match self.take(op) {
            Some(Fault::Fail(k)) => Err(err(k, "before")),
            Some(Fault::FailAfter(k)) => {
                let _ = call.await;
                Err(err(k, "after"))
            }
            Some(Fault::CorruptRead) | None => call.await,
        }
    }
}

fn flip(bytes: &mut [u8]) {
    if let Some(b) = bytes.get_mut(bytes.len() / 2) {
        *b ^= 0x01;
    }
}

#[async_trait]
impl<M: Medium> Medium for FaultyMedium<M> {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn put(&self, key: &str, data: &[u8], opts: PutOptions) -> Result<ObjectMeta> {
        self.apply(Op::Put, self.inner.put(key, data, opts)).await
    }

    async fn put_with_previous(
        &self,
        key: &str,
        data: &[u8],
        opts: PutOptions,
        previous: Option<(&str, u64)>,
    ) -> Result<ObjectMeta> {
        self.apply(Op::Put, self.inner.put_with_previous(key, data, opts, previous)).await
    }

    async fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<ObjectMeta> {
        match self.take(Op::Get) {
            Some(Fault::Fail(k)) => Err(Error::new(k, "injected fault before Get")),
            Some(Fault::FailAfter(k)) => {
                let _ = self.inner.get_into(key, dst).await;
                Err(Error::new(k, "injected fault after Get"))
            }
            Some(Fault::CorruptRead) => {
                let meta = self.inner.get_into(key, dst).await?;
                flip(&mut dst[..meta.size_bytes as usize]);
                Ok(meta)
            }
            None => self.inner.get_into(key, dst).await,
        }
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        match self.take(Op::Get) {
            Some(Fault::Fail(k)) => Err(Error::new(k, "injected fault before Get")),
            Some(Fault::FailAfter(k)) => {
                let _ = self.inner.get(key).await;
                Err(Error::new(k, "injected fault after Get"))
            }
            Some(Fault::CorruptRead) => {
                let mut v = self.inner.get(key).await?;
                flip(&mut v);
                Ok(v)
            }
            None => self.inner.get(key).await,
        }
    }

    async fn stat(&self, key: &str) -> Result<ObjectMeta> {
        self.apply(Op::Stat, self.inner.stat(key)).await
    }

    async fn remove(&self, key: &str) -> Result<()> {
        self.apply(Op::Remove, self.inner.remove(key)).await
    }

    async fn rename(&self, from: &str, to: &str, opts: RenameOptions) -> Result<ObjectMeta> {
        self.apply(Op::Rename, self.inner.rename(from, to, opts)).await
    }

    async fn previous_name(&self, key: &str) -> Result<Option<(String, u64)>> {
        self.apply(Op::Stat, self.inner.previous_name(key)).await
    }

    async fn list(&self) -> Result<Vec<(String, ObjectMeta)>> {
        self.apply(Op::List, self.inner.list()).await
    }

    fn capacity_bytes(&self) -> Option<u64> {
        self.inner.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dram::DramMedium;

    #[tokio::test]
    async fn faults_fire_the_armed_number_of_times() {
        let m = FaultyMedium::new(DramMedium::new(1 << 20).unwrap());
        m.inject(Op::Put, Fault::Fail(ErrorKind::Io), 2);
        for _ in 0..2 {
            let e = m.put("k", b"v", PutOptions::default()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io);
        }
        m.put("k", b"v", PutOptions::default()).await.unwrap();
        m.inject(Op::Get, Fault::CorruptRead, 1);
        assert_ne!(m.get("k").await.unwrap(), b"v");
        assert_eq!(m.get("k").await.unwrap(), b"v");
        m.inject(Op::Remove, Fault::FailAfter(ErrorKind::Timeout), 1);
        assert_eq!(m.remove("k").await.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(
            m.stat("k").await.unwrap_err().kind(),
            ErrorKind::NotFound,
            "FailAfter ran the op"
        );
        assert_eq!(m.injected(), 4);
    }

    #[tokio::test]
    async fn rename_faults_fail_before_or_after_the_rename() {
        let m = FaultyMedium::new(DramMedium::new(1 << 20).unwrap());
        m.put("a", b"v", PutOptions::default()).await.unwrap();
        let opts = RenameOptions { version: 2, ..Default::default() };
        m.inject(Op::Rename, Fault::Fail(ErrorKind::Io), 1);
        assert_eq!(m.rename("a", "b", opts).await.unwrap_err().kind(), ErrorKind::Io);
        assert_eq!(m.get("a").await.unwrap(), b"v", "Fail left the medium alone");
        m.inject(Op::Rename, Fault::FailAfter(ErrorKind::Timeout), 1);
        assert_eq!(m.rename("a", "b", opts).await.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(m.get("b").await.unwrap(), b"v", "FailAfter ran the rename");
        m.inject(Op::Stat, Fault::Fail(ErrorKind::Unavailable), 1);
        assert_eq!(m.previous_name("b").await.unwrap_err().kind(), ErrorKind::Unavailable);
        assert_eq!(m.previous_name("b").await.unwrap(), Some(("a".to_owned(), 0)));
    }
}
