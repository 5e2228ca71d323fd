//! Leader election: a candidate creates the leader key under its own lease if the key is
//! absent; the winner keeps the lease alive and holds a [`LeaseGuard`]; the others wait for
//! the key to go (and speed that up when the leader's process is gone).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::etcd::{Etcd, Kv, WatchEvent};
use crate::{Error, Result, leader_key};

/// Whether this process may still act as the leader of term `term`.
///
/// Valid until the moment the lease may have expired in etcd, counted from when the last
/// successful keep-alive was *sent* (etcd extends the lease when it receives it, later), less
/// a tenth of the TTL for clock-rate differences. Monotonic time keeps running while a process
/// is stopped, so a leader resumed after SIGSTOP finds its guard lapsed before it can act.
#[derive(Clone, Debug)]
pub struct LeaseGuard {
    inner: Arc<GuardInner>,
}

#[derive(Debug)]
struct GuardInner {
    term: u64,
    base: Instant,
    until_us: AtomicU64,
}

impl LeaseGuard {
    fn new(term: u64, until: Instant) -> LeaseGuard {
        let base = Instant::now();
        let g =
            LeaseGuard { inner: Arc::new(GuardInner { term, base, until_us: AtomicU64::new(0) }) };
        g.extend(until);
        g
    }

    /// The leadership's term: the leader key's create revision in etcd.
    pub fn term(&self) -> u64 {
        self.inner.term
    }

    pub fn is_valid(&self) -> bool {
        (self.inner.base.elapsed().as_micros() as u64) < self.inner.until_us.load(Ordering::Acquire)
    }

    /// When the guard lapses unless it is extended first.
    fn expires(&self) -> Instant {
        self.inner.base + Duration::from_micros(self.inner.until_us.load(Ordering::Acquire))
    }

    fn extend(&self, until: Instant) {
        let us = until.saturating_duration_since(self.inner.base).as_micros() as u64;
        self.inner.until_us.fetch_max(us, Ordering::AcqRel);
    }

    fn invalidate(&self) {
        self.inner.until_us.store(0, Ordering::Release);
    }
}

/// A master that wants to lead its cluster.
pub struct Candidate {
    etcd: Etcd,
    key: String,
    addr: String,
    ttl: Duration,
}

/// How an attempt to lead ended.
pub enum Campaign {
    Won(Leadership),
    /// Another master leads: its key (value: its RPC address; create revision: its term).
    Lost(Kv),
}

impl Candidate {
    /// `addr` is what clients and nodes connect to; `ttl` (whole seconds, at least one) is how
    /// long a leader that stopped renewing keeps the key.
    pub fn new(etcd: Etcd, cluster: &str, addr: &str, ttl: Duration) -> Result<Candidate> {
        if ttl < Duration::from_secs(1) {
            return Err(Error::Invalid(format!("lease TTL {ttl:?} is under etcd's 1 s unit")));
        }
        let ttl = Duration::from_secs(ttl.as_secs());
        Ok(Candidate { etcd, key: leader_key(cluster), addr: addr.to_string(), ttl })
    }

    /// One attempt: leads if nobody does.
    pub async fn try_lead(&self) -> Result<Campaign> {
        let sent = Instant::now();
        let lease = self.etcd.lease_grant(self.ttl.as_secs() as i64).await?;
        match self.etcd.create(&self.key, self.addr.as_bytes(), lease).await {
            Ok(Ok(term)) => {
                let guard = LeaseGuard::new(term, sent + self.ttl.mul_f64(0.9));
                let (tx, lost) = watch::channel(None);
                let task = match KeepAlive::start(&self.etcd, lease, self.ttl, guard.clone(), tx) {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = self.etcd.delete_if_created(&self.key, term).await;
                        let _ = self.etcd.lease_revoke(lease).await;
                        return Err(e);
                    }
                };
                tracing::info!(key = %self.key, term, lease, addr = %self.addr, "elected leader");
                Ok(Campaign::Won(Leadership {
                    etcd: self.etcd.clone(),
                    key: self.key.clone(),
                    term,
                    lease,
                    guard,
                    lost,
                    task,
                }))
            }
            Ok(Err(current)) => {
                let _ = self.etcd.lease_revoke(lease).await;
                Ok(Campaign::Lost(current))
            }
            Err(e) => {
                let _ = self.etcd.lease_revoke(lease).await;
                Err(e)
            }
        }
    }

    /// Waits until the leader `current` is gone: its key deleted or replaced. Meanwhile it
    /// probes the leader's address every `probe`: two refused connections in a row mean no
    /// process listens there, and the dead leader's lease is revoked rather than waited out.
    /// Returns early (Ok) when the watch breaks, so the caller reads the key again.
    pub async fn wait_vacant(&self, current: &Kv, probe: Duration) -> Result<()> {
        let mut watch = self.etcd.watch(&self.key, current.mod_revision + 1).await?;
        let addr = String::from_utf8_lossy(&current.value).into_owned();
        let mut tick = tokio::time::interval(probe);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refused = 0u32;
        loop {
            tokio::select! {
                ev = watch.next() => {
                    let Ok(events) = ev else { return Ok(()) };
                    for e in events {
                        match e {
                            WatchEvent::Delete { .. } => return Ok(()),
                            WatchEvent::Put(kv) if kv.create_revision != current.create_revision => return Ok(()),
                            WatchEvent::Put(_) => {}
                        }
                    }
                }
                _ = tick.tick() => {
                    let c = tokio::time::timeout(probe, tokio::net::TcpStream::connect(&addr)).await;
                    match c {
                        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                            refused += 1;
                            if refused >= 2 {
                                tracing::warn!(leader = %addr, term = current.create_revision,
                                    "the leader's address refuses connections: revoking its lease");
                                self.etcd.lease_revoke(current.lease).await?;
                                refused = 0;
                            }
                        }
                        _ => refused = 0,
                    }
                }
            }
        }
    }
}

/// This process leads its cluster until [`Leadership::lost`] says otherwise.
pub struct Leadership {
    etcd: Etcd,
    key: String,
    term: u64,
    lease: i64,
    guard: LeaseGuard,
    lost: watch::Receiver<Option<String>>,
    task: KeepAlive,
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.task.stop();
        self.guard.invalidate();
    }
}

impl Leadership {
    pub fn term(&self) -> u64 {
        self.term
    }

    pub fn guard(&self) -> LeaseGuard {
        self.guard.clone()
    }

    /// Resolves when the leadership is over (the lease expired, was revoked, or could not be
    /// renewed within its life), with the reason.
    pub async fn lost(&mut self) -> String {
        loop {
            if let Some(why) = self.lost.borrow_and_update().clone() {
                return why;
            }
            if self.lost.changed().await.is_err() {
                return "the keep-alive task ended".into();
            }
        }
    }

    /// Steps down: stops renewing and deletes the key, so a standby takes over at once.
    pub async fn resign(self) {
        self.task.stop();
        self.guard.invalidate();
        let _ = self.etcd.delete_if_created(&self.key, self.term).await;
        let _ = self.etcd.lease_revoke(self.lease).await;
    }
}

/// The leader's renewals, on a thread and runtime of their own: a master busy rebuilding its
/// directory (a million objects reported by its nodes) or otherwise starving its runtime's
/// workers must not miss its renewals and lose the lead it is busy taking up.
struct KeepAlive {
    stop: Arc<tokio::sync::Notify>,
    stopped: std::sync::atomic::AtomicBool,
}

impl KeepAlive {
    fn start(
        etcd: &Etcd,
        lease: i64,
        ttl: Duration,
        guard: LeaseGuard,
        lost: watch::Sender<Option<String>>,
    ) -> Result<KeepAlive> {
        let members = etcd.per_member()?;
        let stop = Arc::new(tokio::sync::Notify::new());
        let s = stop.clone();
        std::thread::Builder::new()
            .name("kvfs-lease".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        guard.invalidate();
                        let _ =
                            lost.send(Some(format!("no runtime for the lease's renewals: {e}")));
                        return;
                    }
                };
                rt.block_on(async move {
                    tokio::select! {
                        _ = keep_alive(members, lease, ttl, guard, lost) => {}
                        // `notify_one` stores a permit: a stop before this wait still ends it.
                        _ = s.notified() => {}
                    }
                });
            })
            .map_err(|e| Error::Invalid(format!("cannot start the lease thread: {e}")))?;
        Ok(KeepAlive { stop, stopped: std::sync::atomic::AtomicBool::new(false) })
    }

    fn stop(&self) {
        if !self.stopped.swap(true, Ordering::AcqRel) {
            self.stop.notify_one();
        }
    }
}

async fn keep_alive(
    members: Vec<Etcd>,
    lease: i64,
    ttl: Duration,
    guard: LeaseGuard,
    lost: watch::Sender<Option<String>>,
) {
    // Renewed every eighth of the TTL: when a member is lost just after a renewal, what is left
    // of the guard (0.9 TTL from the last request) must still cover etcd's re-election (up to
    // twice its election timeout) and the asks that follow it.
    let period = (ttl / 8).max(Duration::from_millis(50));
    let mut preferred = 0;
    loop {
        tokio::time::sleep(period).await;
        match renew(&members, preferred, lease, ttl, period, &guard).await {
            Renewal::Renewed { member } => preferred = member,
            Renewal::Gone => {
                guard.invalidate();
                let _ = lost.send(Some("the leader's lease expired or was revoked in etcd".into()));
                return;
            }
            Renewal::Lapsed(why) => {
                guard.invalidate();
                let _ = lost.send(Some(format!(
                    "could not renew the leader's lease within its life ({why})"
                )));
                return;
            }
        }
    }
}

enum Renewal {
    /// `member` renewed the lease (and the guard is extended).
    Renewed { member: usize },
    /// etcd answered that the lease is gone.
    Gone,
    /// The guard lapsed before any member renewed the lease; why the last one asked failed.
    Lapsed(String),
}

/// One renewal of the lease. It asks the member that answered last; each `period` without an
/// answer (each `period / 5` once less than half the TTL is left of the guard), and soon after a
/// member fails, it asks the next one as well, leaving the earlier requests running: a member
/// cut off from us, or one waiting for its peers to elect a raft leader after theirs was cut
/// off, must not cost the lease while another can renew it. The first member to answer
/// decides; it gives up when the guard lapses.
async fn renew(
    members: &[Etcd],
    preferred: usize,
    lease: i64,
    ttl: Duration,
    period: Duration,
    guard: &LeaseGuard,
) -> Renewal {
    let n = members.len();
    let mut asks = tokio::task::JoinSet::new();
    let mut busy = vec![false; n];
    // Members are asked in turn from the preferred one: `next` is the first to try.
    let mut next = preferred;
    let mut last_error = String::from("no member answered");
    let pause = (period / 5).max(Duration::from_millis(10));
    let mut next_ask = tokio::time::Instant::now();
    let lapse = tokio::time::Instant::from_std(guard.expires());
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next_ask) => {
                if let Some(m) = (0..n).map(|j| (next + j) % n).find(|&m| !busy[m]) {
                    busy[m] = true;
                    next = m + 1;
                    let etcd = members[m].clone();
                    asks.spawn(async move {
                        let sent = Instant::now();
                        (m, sent, etcd.lease_keepalive(lease).await)
                    });
                }
                let now = tokio::time::Instant::now();
                let urgent = lapse.saturating_duration_since(now) < ttl / 2;
                next_ask = now + if urgent { pause } else { period };
            }
            Some(done) = asks.join_next(), if !asks.is_empty() => match done {
                Ok((m, sent, Ok(t))) if t > 0 => {
                    guard.extend(sent + ttl.mul_f64(0.9));
                    return Renewal::Renewed { member: m };
                }
                Ok((_, _, Ok(_))) => return Renewal::Gone,
                Ok((m, _, Err(e))) => {
                    busy[m] = false;
                    last_error = e.to_string();
                    next_ask = next_ask.min(tokio::time::Instant::now() + pause);
                }
                Err(e) => last_error = format!("a keep-alive request failed: {e}"),
            },
            _ = tokio::time::sleep_until(lapse) => return Renewal::Lapsed(last_error),
        }
    }
}
