//! Following the leader: the current leader's address and term, kept current by a watch on
//! the leader key and, in case a watch hangs on a stuck etcd member, a read every few seconds.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::etcd::{Etcd, Kv, WatchEvent};
use crate::{EtcdTarget, Result, leader_key};

/// A leader as followers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// Its RPC address.
    pub addr: String,
    /// Its term (the leader key's create revision).
    pub term: u64,
}

impl LeaderInfo {
    fn of(kv: &Kv) -> LeaderInfo {
        LeaderInfo {
            addr: String::from_utf8_lossy(&kv.value).into_owned(),
            term: kv.create_revision,
        }
    }
}

/// How often the key is read again even while a watch is open.
const REREAD: Duration = Duration::from_secs(2);

/// The leader of one cluster, followed in the background. Dropping it stops the follower.
pub struct LeaderWatch {
    rx: watch::Receiver<Option<LeaderInfo>>,
    task: JoinHandle<()>,
}

impl Drop for LeaderWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LeaderWatch {
    /// Starts following on the current runtime; `timeout` bounds each call to etcd.
    pub fn start(target: &EtcdTarget, timeout: Duration) -> Result<LeaderWatch> {
        let etcd = Etcd::new(target.endpoints.clone(), timeout)?;
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(follow(etcd, leader_key(&target.cluster), tx));
        Ok(LeaderWatch { rx, task })
    }

    /// The leader as last seen (None: no leader, or not read yet).
    pub fn current(&self) -> Option<LeaderInfo> {
        self.rx.borrow().clone()
    }

    /// The leader, waiting up to `within` for one with a term of at least `min_term`.
    pub async fn leader(&self, min_term: u64, within: Duration) -> Option<LeaderInfo> {
        let mut rx = self.rx.clone();
        let wait = rx.wait_for(|l| l.as_ref().is_some_and(|l| l.term >= min_term));
        match tokio::time::timeout(within, wait).await {
            Ok(Ok(l)) => l.clone(),
            _ => None,
        }
    }

    /// Resolves once the leader is no longer `term` (gone, or another one).
    pub async fn changed_from(&self, term: u64) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|l| l.as_ref().is_none_or(|l| l.term != term)).await;
    }
}

async fn follow(etcd: Etcd, key: String, tx: watch::Sender<Option<LeaderInfo>>) {
    let set = |l: Option<LeaderInfo>| {
        tx.send_if_modified(|cur| {
            if *cur == l {
                return false;
            }
            tracing::info!(leader = ?l, "master leader changed");
            *cur = l;
            true
        });
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        let rev = match etcd.get(&key).await {
            Ok((rev, kv)) => {
                set(kv.as_ref().map(LeaderInfo::of));
                rev
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the leader key; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let mut w = match etcd.watch(&key, rev + 1).await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the leader key; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        let mut reread = tokio::time::interval_at(tokio::time::Instant::now() + REREAD, REREAD);
        loop {
            tokio::select! {
                ev = w.next() => match ev {
                    Ok(events) => {
                        for e in events {
                            match e {
                                WatchEvent::Put(kv) => set(Some(LeaderInfo::of(&kv))),
                                WatchEvent::Delete { .. } => set(None),
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "leader watch ended; reading again");
                        break;
                    }
                },
                _ = reread.tick() => match etcd.get(&key).await {
                    // The watch would have said so: it is stuck (an etcd member that hangs).
                    Ok((_, kv)) if kv.as_ref().map(LeaderInfo::of) != *tx.borrow() => break,
                    _ => {}
                },
            }
        }
    }
}
