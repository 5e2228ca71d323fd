//! A member of a process group: its engine, its view of the group, its mailbox, and the
//! machinery every operation runs in (ops.rs holds the algorithms).
//!
//! Mechanism. Each member runs one Transfer Engine with two *staging halves* (registered,
//! shareable buffers that peers read from) and a *landing* buffer (where it reads peers' data
//! into). Operation `seq` of an epoch uses staging half `seq % 2`. Small operations carry their
//! data inline in notifications; large ones copy the caller's data into staging, announce it
//! with a notification, and the peers pull it with Transfer Engine reads (a memcpy from the
//! shared memfd on one host, tcp or rdma across hosts). A dispatcher task takes every
//! notification and files it: frames in the mailbox under (epoch, seq, phase, sender), views
//! and freezes into the state; waiting operations are woken.
//!
//! Staging reuse. A member writes half `h` for operation `k` only after operation `k-1`
//! completed, which (for operations that need every member's data) needs every peer's first
//! frame of `k-1`, sent only after that peer completed `k-2`, the last user of `h`. Operations
//! where some member needs no one's data (broadcast's root, gather's senders, scatter's root)
//! wait for the readers' `Done` frames before they complete.
//!
//! Reconciliation. When a member fails, the coordinator freezes the survivors (`Freeze`): from
//! then on no operation of the old epoch completes, and each survivor reports how many
//! operations it finished in the old epoch, whether it is inside one, and whether that one has
//! already written any output (*dirty*). Every operation that needs all members' data can
//! complete somewhere only if every member started it, so the survivors' counts differ by at
//! most one. With `M` the largest count: survivors interrupted in operation `M` run it again in
//! the new epoch over the survivors (all of them do, unless one was dirty: then all of them fail
//! it with `PeerFailed`); survivors interrupted one behind fail theirs with `PeerFailed` (the
//! others completed it without them). Either way every survivor's next call pairs with every
//! other's, and it runs over the survivors only. Frames from older epochs are refused with a
//! `Stale` answer, which fails a removed member's operations with `StaleEpoch`.
//!
//! Not handled: a failure during a rooted operation (broadcast, gather, scatter, reduce) can
//! leave members one operation apart when some completed it without needing everyone; those
//! calls fail with `PeerFailed` on the members that did not complete them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvfs_transfer::{
    Buffer, BufferOptions, Engine, EngineConfig, SegmentHandle, TransferOp, TransferRequest,
    Transports,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::wire::{self, MemberInfo, Msg, P2pKind, PROTOCOL, Resume, View};
use crate::{Error, ErrorKind, Result};

/// Settings of one member.
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// Where this member's engine listens (peers on other hosts need a reachable address).
    pub listen: SocketAddr,
    pub group: String,
    pub transports: Transports,
    /// Bytes of each of the two staging halves; larger operations run in segments of this.
    pub staging_bytes: usize,
    /// Operations whose per-member data is at most this travel inside notifications.
    pub inline_bytes_max: usize,
    /// Every operation ends within this, with `Timeout` at worst.
    pub op_timeout_ms: u64,
    /// A peer whose frame is this late is reported to the coordinator as suspect.
    pub suspect_after_ms: u64,
    /// How long `join` waits for the group to form or for activation.
    pub join_timeout_ms: u64,
    /// Most frames held for operations this member has not reached yet.
    pub mailbox_frames_max: usize,
    /// How long the engine polls a connection for a small request's reply (and for the next
    /// request after serving one) before parking. Members of a group wait on each other in
    /// every round, and on a host with fewer cores than members a polling member takes the
    /// core the peer it waits for needs, so the default is 0 (park at once); hosts with a
    /// core per member gain a little latency from 20-50. `KVFS_PG_SPIN_US` sets the default.
    pub spin_us: u64,
}

impl Default for PgConfig {
    fn default() -> Self {
        PgConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            group: "default".to_string(),
            transports: Transports::default(),
            staging_bytes: 16 << 20,
            inline_bytes_max: 32 << 10,
            op_timeout_ms: 30_000,
            suspect_after_ms: 1_000,
            join_timeout_ms: 60_000,
            mailbox_frames_max: 65_536,
            spin_us: std::env::var("KVFS_PG_SPIN_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
                .min(1000),
        }
    }
}

impl PgConfig {
    fn validate(&self) -> Result<()> {
        let bad = |d: &str| Err(Error::new(ErrorKind::InvalidArgument, "pg config", d.to_string()));
        if self.staging_bytes < 64 << 10 || self.staging_bytes > 4 << 30 {
            return bad("staging_bytes must be between 64 KiB and 4 GiB");
        }
        if self.inline_bytes_max > 48 << 10 {
            return bad("inline_bytes_max must be at most 48 KiB (a notification holds 64 KiB)");
        }
        if self.op_timeout_ms == 0 || self.join_timeout_ms == 0 || self.suspect_after_ms == 0 {
            return bad("timeouts must be positive");
        }
        Ok(())
    }
}

/// Why an operation's step stopped.
pub(crate) enum Stop {
    /// The view is changing: settle by the reconciliation rule.
    Interrupted,
    Fail(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Stop {
        Stop::Fail(e)
    }
}

pub(crate) type StepResult<T> = std::result::Result<T, Stop>;

/// The phase of the frame that says "I have finished reading your staging" (see `close`).
pub(crate) const READ_DONE_PHASE: u32 = u32::MAX;
/// How long `close` waits for peers still reading this member's staging.
const CLOSE_DRAIN_MS: u64 = 5_000;

/// What an operation sees of the group while it runs.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub epoch: u64,
    pub seq: u64,
    /// Staging steps before this operation (segment `s` uses half `(step0 + s) % 2`).
    pub step0: u64,
    /// Active members in slot order; indices into this are the operation's ranks.
    pub members: Vec<MemberInfo>,
    pub me: usize,
    pub deadline: Instant,
}

impl Ctx {
    pub fn n(&self) -> usize {
        self.members.len()
    }

    pub fn half(&self, segment: u64) -> usize {
        ((self.step0 + segment) % 2) as usize
    }

    pub fn others(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.n()).filter(move |&i| i != self.me)
    }

    /// Rank of `slot` in this operation, or `UnknownSlot`.
    pub fn rank_of(&self, slot: u32, op: &'static str) -> Result<usize> {
        self.members.iter().position(|m| m.slot == slot).ok_or_else(|| {
            Error::new(
                ErrorKind::UnknownSlot,
                op,
                format!(
                    "slot {slot} is not active at epoch {} (active: {:?})",
                    self.epoch,
                    self.slots()
                ),
            )
        })
    }

    pub fn slots(&self) -> Vec<u32> {
        self.members.iter().map(|m| m.slot).collect()
    }

    /// The smallest staging half of the members: every rank segments the same way even when
    /// their settings differ.
    pub fn staging_min(&self) -> usize {
        self.members.iter().map(|m| m.staging_bytes).min().unwrap_or(0) as usize
    }

    /// What every member's landing buffer holds at least (it is 1 MiB over its staging).
    pub fn landing_min(&self) -> usize {
        self.staging_min() + (1 << 20)
    }

    pub fn inbox_min(&self) -> usize {
        self.members.iter().map(|m| m.inbox_bytes).min().unwrap_or(0) as usize
    }
}

type FrameKey = (u64, u64, u32, u32);

#[derive(Default)]
struct State {
    view: Option<View>,
    pending: bool,
    refused: Option<String>,
    change_refused: Option<(u64, String)>,
    /// Operations finished (completed or failed) in the current epoch.
    finished: u64,
    /// Staging steps (segments) completed in the current epoch: step `t` uses half `t % 2`.
    steps: u64,
    in_op: bool,
    dirty: bool,
    frozen: Option<u64>,
    finished_at_freeze: Option<u64>,
    /// The newest epoch a peer or the coordinator said our messages were older than.
    stale_seen: u64,
    mailbox: HashMap<FrameKey, (u64, Vec<u8>)>,
    /// Point-to-point state is per peer *process* (its segment), not per epoch: messages
    /// between two members that both survive a view change stay valid across it.
    p2p_in: HashMap<(String, u32, u64), VecDeque<P2pKind>>,
    p2p_done: HashSet<(String, u32, u64, u32)>,
    p2p_send_seq: HashMap<(String, u32), u64>,
    p2p_recv_seq: HashMap<(String, u32), u64>,
    /// When the last `Check` the coordinator confirmed was sent (the lease runs from there).
    lease_from: Option<Instant>,
    /// Checks sent and not answered yet, by nonce (bounded: a few per lease).
    checks: HashMap<u64, Instant>,
    /// The coordinator could not be reached at all: no view can change, no lease is needed.
    coordinator_gone: bool,
    /// Views waiting to take effect, in epoch order (a graceful leave's view waits until
    /// `finished` reaches its `switch_at` in the epoch before it).
    deferred: VecDeque<View>,
    /// Members that left, by slot: messages they sent before leaving stay receivable.
    departed: HashMap<u32, MemberInfo>,
    /// A late joiner running alone until `wait_active` (views that arrive meanwhile wait in
    /// `held`).
    solo: bool,
    held: Option<View>,
    /// Answers to `Pending` queries, by nonce.
    pending_answers: HashMap<u64, Vec<u32>>,
    /// The last staged operation whose staging peers may still read: (epoch, seq, slots).
    last_exposed: Option<(u64, u64, Vec<u32>)>,
    /// The large send whose last part may still be pulled from the p2p staging.
    p2p_outstanding: Option<(String, u32, u64, u32)>,
    closed: bool,
    counters: Counters,
}

/// What a member counts (for tests and operators).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Frames from older epochs this member refused.
    pub stale_refused: u64,
    /// Operations run again in a new epoch after a failure interrupted them.
    pub restarted: u64,
    /// Frames dropped because the mailbox was full.
    pub dropped: u64,
    /// Suspect reports sent to the coordinator.
    pub suspects_reported: u64,
}

pub(crate) struct Inner {
    pub engine: Engine,
    pub cfg: PgConfig,
    pub slot: u32,
    pub incarnation: u64,
    coord: SegmentHandle,
    pub staging: [Arc<Buffer>; 2],
    pub landing: Arc<Buffer>,
    /// Where peers write their blocks for this member's share of an allreduce (two halves).
    pub inbox: [Arc<Buffer>; 2],
    /// Local (unshared) memory for a caller's buffer that cannot be registered.
    pub bounce: Arc<Buffer>,
    pub p2p_staging: Arc<Buffer>,
    /// Where point-to-point receives land (never the collectives' landing).
    pub p2p_landing: Arc<Buffer>,
    state: Mutex<State>,
    changed: Notify,
    pub op_lock: tokio::sync::Mutex<()>,
    pub send_lock: tokio::sync::Mutex<()>,
    peers: Mutex<HashMap<u32, (String, SegmentHandle)>>,
}

/// One member of a process group. Cheap to clone; operations are serialized per member.
#[derive(Clone)]
pub struct Group {
    pub(crate) inner: Arc<Inner>,
    _task: Arc<TaskGuard>,
}

struct TaskGuard(Vec<tokio::task::JoinHandle<()>>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Renews the member's lease every third of it, while the member lives.
async fn renew_lease(inner: std::sync::Weak<Inner>) {
    loop {
        let wait = {
            let Some(i) = inner.upgrade() else { return };
            let st = i.state.lock().unwrap_or_else(|e| e.into_inner());
            st.view.as_ref().map(|v| v.lease_ms / 3).unwrap_or(50).max(10)
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let Some(i) = inner.upgrade() else { return };
        let g = Group { inner: i, _task: Arc::new(TaskGuard(Vec::new())) };
        if g.lock().view.is_some() {
            g.check().await;
        }
    }
}

impl Group {
    /// Joins the group run by the coordinator at `coordinator`, in `slot`. During formation
    /// this returns once all `world` slots have joined; a later join (a replacement for a
    /// failed slot, or a new slot) returns once the active members activate it.
    pub async fn join(coordinator: &str, slot: u32, world: u32, cfg: PgConfig) -> Result<Group> {
        Self::join_with(coordinator, slot, world, cfg, true).await
    }

    /// As [`Group::join`]; with `wait_active` false, a late joiner returns as soon as the
    /// coordinator has recorded it: until it is activated its operations run over itself
    /// alone (a group of one, epoch 0), and [`Group::wait_active`] waits for the activation.
    pub async fn join_with(
        coordinator: &str,
        slot: u32,
        world: u32,
        cfg: PgConfig,
        wait_active: bool,
    ) -> Result<Group> {
        cfg.validate()?;
        let ecfg = EngineConfig {
            listen: cfg.listen,
            transports: cfg.transports,
            op_timeout_ms: cfg.op_timeout_ms.min(10_000),
            notify_queue_max: 16_384,
            tcp_direct_spin_us: cfg.spin_us,
            tcp_serve_spin_us: cfg.spin_us,
            ..EngineConfig::default()
        };
        let engine = Engine::start(ecfg).await.map_err(|e| Error::transfer("join", e))?;
        let opts = |name: &str| BufferOptions {
            populate: true,
            name: name.to_string(),
            ..BufferOptions::default()
        };
        let alloc = |len: usize, name: &str| {
            engine.alloc_buffer(len, &opts(name)).map_err(|e| Error::transfer("join", e))
        };
        let staging = [
            alloc(cfg.staging_bytes, "kvfs-pg-staging0")?,
            alloc(cfg.staging_bytes, "kvfs-pg-staging1")?,
        ];
        let landing = alloc(cfg.staging_bytes + (1 << 20), "kvfs-pg-landing")?;
        let inbox_len = cfg.staging_bytes + (1 << 20);
        let inbox = [alloc(inbox_len, "kvfs-pg-inbox0")?, alloc(inbox_len, "kvfs-pg-inbox1")?];
        let p2p_staging = alloc(cfg.staging_bytes, "kvfs-pg-p2p")?;
        let local = BufferOptions { shareable: false, ..opts("kvfs-pg-local") };
        let local_buf = |len: usize| -> Result<Arc<Buffer>> {
            let b = Arc::new(Buffer::new(len, &local).map_err(|e| Error::transfer("join", e))?);
            engine.register_buffer(b.clone(), false).map_err(|e| Error::transfer("join", e))?;
            Ok(b)
        };
        let bounce = local_buf(cfg.staging_bytes + (1 << 20))?;
        let p2p_landing = local_buf(cfg.staging_bytes)?;
        let coord = engine.open_segment(coordinator).await.map_err(|e| {
            Error::new(ErrorKind::Closed, "join", format!("coordinator {coordinator}: {e}"))
        })?;
        let incarnation = rand_u64();
        let inner = Arc::new(Inner {
            engine: engine.clone(),
            cfg: cfg.clone(),
            slot,
            incarnation,
            coord,
            staging,
            landing,
            inbox,
            bounce,
            p2p_staging,
            p2p_landing,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            op_lock: tokio::sync::Mutex::new(()),
            send_lock: tokio::sync::Mutex::new(()),
            peers: Mutex::new(HashMap::new()),
        });
        let task = tokio::spawn(dispatch(Arc::downgrade(&inner), engine.clone()));
        let renew = tokio::spawn(renew_lease(Arc::downgrade(&inner)));
        let group = Group { inner, _task: Arc::new(TaskGuard(vec![task, renew])) };
        let me = group.member_info();
        let join = Msg::Join { protocol: PROTOCOL, group: cfg.group.clone(), world, member: me };
        group.to_coordinator(&join).await?;
        let deadline = Instant::now() + Duration::from_millis(cfg.join_timeout_ms);
        // A slot whose holder is still a member is refused until its failure is detected:
        // ask again every so often, up to the deadline.
        loop {
            let r = group
                .wait(deadline, "join", |st| {
                    if let Some(r) = &st.refused {
                        if r.starts_with(crate::coord::SLOT_ACTIVE) {
                            return Some(Ok(false));
                        }
                        return Some(Err(Error::new(ErrorKind::Refused, "join", r.clone())));
                    }
                    if st.view.as_ref().is_some_and(|v| v.member(slot).is_some()) {
                        return Some(Ok(true));
                    }
                    (st.pending && !wait_active).then_some(Ok(true))
                })
                .await;
            match r {
                Ok(true) => break,
                Ok(false) => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let last = group.lock().refused.take();
                    if Instant::now() >= deadline {
                        let reason = last.unwrap_or_default();
                        return Err(Error::new(ErrorKind::Refused, "join", reason));
                    }
                    group.to_coordinator(&join).await?;
                }
                Err(e) => return Err(e),
            }
        }
        let solo = {
            let mut st = group.lock();
            if st.view.is_none() {
                st.view = Some(View {
                    group: cfg.group.clone(),
                    epoch: 0,
                    world,
                    members: vec![group.member_info()],
                    removed: Vec::new(),
                    resume: None,
                    switch_at: None,
                    lease_ms: 1,
                });
                st.solo = true;
                true
            } else {
                false
            }
        };
        if solo {
            tracing::info!(
                slot,
                "pg: joined pending activation; operations run locally until then"
            );
        }
        Ok(group)
    }

    /// Whether this member is a late joiner that has not taken its activation yet (its
    /// operations run over itself alone).
    pub fn is_pending(&self) -> bool {
        self.lock().solo
    }

    /// Waits until the active members have activated this late joiner.
    pub async fn wait_active(&self, timeout: Duration) -> Result<View> {
        let slot = self.inner.slot;
        let _op = self.inner.op_lock.lock().await;
        self.wait(Instant::now() + timeout, "join", |st| {
            if st.solo
                && let Some(v) = st.held.take()
            {
                st.solo = false;
                install(st, v);
            }
            st.view
                .as_ref()
                .filter(|v| v.epoch > 0 && v.member(slot).is_some())
                .map(|v| Ok(v.clone()))
        })
        .await
    }

    fn member_info(&self) -> MemberInfo {
        let i = &self.inner;
        MemberInfo {
            slot: i.slot,
            segment: i.engine.name().to_string(),
            staging: [i.staging[0].addr(), i.staging[1].addr()],
            staging_bytes: i.cfg.staging_bytes as u64,
            inbox: [i.inbox[0].addr(), i.inbox[1].addr()],
            inbox_bytes: i.inbox[0].len() as u64,
            incarnation: i.incarnation,
        }
    }

    pub fn slot(&self) -> u32 {
        self.inner.slot
    }

    /// The current view (active members, epoch, world size).
    pub fn view(&self) -> View {
        self.lock().view.clone().expect("a joined group has a view")
    }

    pub fn epoch(&self) -> u64 {
        self.view().epoch
    }

    /// Active slots, in order.
    pub fn active(&self) -> Vec<u32> {
        self.view().slots()
    }

    pub fn counters(&self) -> Counters {
        self.lock().counters
    }

    /// The last process that held `slot` before it left the view.
    pub(crate) fn departed(&self, slot: u32) -> Option<MemberInfo> {
        self.lock().departed.get(&slot).cloned()
    }

    /// Whether this member is still in the group (false once a newer view left it out).
    pub fn is_member(&self) -> bool {
        let st = self.lock();
        st.view.as_ref().is_some_and(|v| v.member(self.inner.slot).is_some())
    }

    /// Asks, together with every other active member, for `activate` (pending joiners) to
    /// enter and `deactivate` to leave the group; returns the new view once it is in force.
    /// Every active member must make the same call between the same two operations.
    pub async fn change(&self, activate: &[u32], deactivate: &[u32]) -> Result<View> {
        let _op = self.inner.op_lock.lock().await;
        let epoch = self.epoch();
        {
            self.lock().change_refused = None;
        }
        self.to_coordinator(&Msg::Change {
            epoch,
            activate: activate.to_vec(),
            deactivate: deactivate.to_vec(),
        })
        .await?;
        let deadline = Instant::now() + Duration::from_millis(self.inner.cfg.op_timeout_ms);
        self.wait(deadline, "change", |st| {
            if let Some((e, r)) = &st.change_refused
                && *e == epoch
            {
                return Some(Err(Error::new(ErrorKind::Refused, "change", r.clone())));
            }
            let v = st.view.as_ref()?;
            (v.epoch > epoch).then(|| Ok(v.clone()))
        })
        .await
    }

    /// Slots with a process waiting at the coordinator for activation (a replacement or a
    /// newcomer): what the active members pass to [`Group::change`].
    pub async fn pending(&self) -> Result<Vec<u32>> {
        let nonce = rand_u64();
        self.to_coordinator(&Msg::Pending { nonce }).await?;
        let deadline =
            Instant::now() + Duration::from_millis(self.inner.cfg.suspect_after_ms.max(1000));
        self.wait(deadline, "pending", |st| st.pending_answers.remove(&nonce).map(Ok)).await
    }

    /// Leaves the group: the coordinator removes this slot (the survivors' next operation runs
    /// without it). The member can no longer take part.
    pub async fn close(&self) {
        // Peers may still be reading this member's staging for the last operation: wait
        // (bounded) for their word before the memory goes away with the process.
        let last = self.lock().last_exposed.clone();
        if let Some((epoch, seq, slots)) = last {
            let deadline = Instant::now() + Duration::from_millis(CLOSE_DRAIN_MS);
            let _ = self
                .wait(deadline, "close", |st| {
                    let done = slots
                        .iter()
                        .all(|&s| st.mailbox.contains_key(&(epoch, seq, READ_DONE_PHASE, s)));
                    let moved = st.view.as_ref().is_none_or(|v| v.epoch != epoch);
                    (done || moved).then_some(Ok(()))
                })
                .await;
        }
        // And the receiver of the last large send may not have pulled it yet.
        let drain = Instant::now() + Duration::from_millis(CLOSE_DRAIN_MS);
        let _ = self.wait_p2p_staging(drain).await;
        let (epoch, finished) = {
            let st = self.lock();
            (st.view.as_ref().map(|v| v.epoch).unwrap_or(0), st.finished)
        };
        let _ = self.to_coordinator(&Msg::Leave { epoch, finished }).await;
        self.lock().closed = true;
        self.inner.changed.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn to_coordinator(&self, msg: &Msg) -> Result<()> {
        self.inner
            .engine
            .notify(&self.inner.coord, &wire::encode(msg))
            .await
            .map_err(|e| Error::new(ErrorKind::Closed, "coordinator", e.to_string()))
    }

    /// Waits until `f` says done, re-checking whenever the state changes.
    async fn wait<T>(
        &self,
        deadline: Instant,
        op: &'static str,
        mut f: impl FnMut(&mut State) -> Option<Result<T>>,
    ) -> Result<T> {
        loop {
            let notified = self.inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if st.closed {
                    return Err(Error::new(ErrorKind::Closed, op, "the group is closed"));
                }
                if let Some(r) = f(&mut st) {
                    return r;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::new(ErrorKind::Timeout, op, "no progress before the deadline"));
            }
        }
    }

    /// Settles one attempt of an operation: `Ok(true)` when it is over (done), `Ok(false)` when
    /// it must run again in the new epoch (module notes, "Reconciliation"), or its error.
    pub(crate) async fn end_step(
        &self,
        op: &'static str,
        ctx: &Ctx,
        outcome: StepResult<u64>,
        deadline: Instant,
    ) -> Result<bool> {
        let outcome = match outcome {
            Ok(steps) => self.leased(ctx).await.map(|()| steps),
            Err(e) => Err(e),
        };
        let stop = match outcome {
            Ok(steps) => {
                let mut st = self.lock();
                if st.frozen.is_none() && st.view.as_ref().is_some_and(|v| v.epoch == ctx.epoch) {
                    st.finished += 1;
                    st.steps += steps;
                    st.in_op = false;
                    advance(&mut st);
                    return Ok(true);
                }
                Stop::Interrupted
            }
            Err(s) => s,
        };
        match stop {
            Stop::Fail(e) => {
                let mut st = self.lock();
                if st.view.as_ref().is_some_and(|v| v.epoch == ctx.epoch) && st.frozen.is_none() {
                    st.finished += 1;
                    st.steps += 2;
                    advance(&mut st);
                }
                st.in_op = false;
                Err(e)
            }
            Stop::Interrupted => match self.settle(op, ctx, deadline).await {
                Ok(true) => {
                    self.lock().counters.restarted += 1;
                    Ok(false)
                }
                Ok(false) => {
                    let v = self.view();
                    self.lock().in_op = false;
                    Err(Error::new(
                        ErrorKind::PeerFailed,
                        op,
                        format!(
                            "the group moved to epoch {} (removed: {:?}) while this operation ran; it did not complete here",
                            v.epoch, v.removed
                        ),
                    ))
                }
                Err(e) => {
                    self.lock().in_op = false;
                    Err(e)
                }
            },
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + Duration::from_millis(self.inner.cfg.op_timeout_ms)
    }

    pub(crate) async fn begin(&self, op: &'static str, deadline: Instant) -> Result<Ctx> {
        let slot = self.inner.slot;
        self.wait(deadline, op, |st| {
            let v = st.view.as_ref()?;
            if st.frozen.is_some() {
                return None;
            }
            let Some(me) = v.members.iter().position(|m| m.slot == slot) else {
                return Some(Err(Error::new(
                    ErrorKind::StaleEpoch,
                    op,
                    format!("slot {slot} is not in the group's view at epoch {}", v.epoch),
                )));
            };
            if removed(st) {
                return Some(Err(stale_error(st, op)));
            }
            st.in_op = true;
            st.finished_at_freeze = None;
            st.dirty = false;
            let seq = st.finished;
            let step0 = st.steps;
            // Frames of operations that already ended (a failed one's late frames).
            let epoch = v.epoch;
            st.mailbox.retain(|k, _| k.0 > epoch || (k.0 == epoch && k.1 >= seq));
            Some(Ok(Ctx { epoch, seq, step0, members: v.members.clone(), me, deadline }))
        })
        .await
    }

    /// After an interruption: waits for the new view and says whether to run the operation
    /// again (true) or fail it (false).
    async fn settle(&self, op: &'static str, ctx: &Ctx, deadline: Instant) -> Result<bool> {
        let slot = self.inner.slot;
        let r = self
            .wait(deadline, op, |st| {
                if removed(st) {
                    return Some(Err(stale_error(st, op)));
                }
                let v = st.view.as_ref()?;
                (v.epoch > ctx.epoch && st.frozen.is_none_or(|f| f <= v.epoch))
                    .then(|| Ok((v.member(slot).is_some(), v.resume, st.finished_at_freeze)))
            })
            .await;
        let (still_member, resume, at_freeze) = r?;
        if !still_member {
            return Err(Error::new(
                ErrorKind::StaleEpoch,
                op,
                "the group's new view does not include this member",
            ));
        }
        let mine = at_freeze.unwrap_or(ctx.seq);
        Ok(match resume {
            None => true,
            Some(Resume { finished, restart }) => mine == finished && restart,
        })
    }

    /// Marks the operation as about to write the caller's output: after this it is no
    /// longer run again if a failure interrupts it. Fails if the view is already changing.
    pub(crate) async fn commit(&self, ctx: &Ctx) -> StepResult<()> {
        self.leased(ctx).await?;
        let mut st = self.lock();
        if st.frozen.is_some() || st.view.as_ref().is_none_or(|v| v.epoch != ctx.epoch) {
            return Err(Stop::Interrupted);
        }
        st.dirty = true;
        Ok(())
    }

    /// Makes sure this member's lease is current before an operation completes: a member that
    /// was stopped or cut off longer than the lease asks the coordinator first, so a member
    /// the group moved on without learns it (`StaleEpoch`) instead of completing an operation
    /// with frames from an attempt the survivors abandoned.
    pub(crate) async fn leased(&self, ctx: &Ctx) -> StepResult<()> {
        let lease = |st: &State| {
            Duration::from_millis(st.view.as_ref().map(|v| v.lease_ms).unwrap_or(0).max(1))
        };
        {
            let st = self.lock();
            if st.coordinator_gone || st.lease_from.is_some_and(|t| t.elapsed() < lease(&st)) {
                return Ok(());
            }
        }
        let sent = Instant::now();
        self.check().await;
        let deadline =
            (sent + Duration::from_millis(self.inner.cfg.suspect_after_ms)).min(ctx.deadline);
        let op = "lease";
        let r = self
            .wait(deadline, op, |st| {
                if removed(st) {
                    return Some(Err(stale_error(st, op)));
                }
                (st.coordinator_gone || st.lease_from.is_some_and(|t| t >= sent)).then_some(Ok(()))
            })
            .await;
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::Timeout => Err(Stop::Fail(Error::new(
                ErrorKind::Timeout,
                "lease",
                "the coordinator did not confirm this member's place in the group",
            ))),
            Err(e) => Err(Stop::Fail(e)),
        }
    }

    /// Sends a `Check` to the coordinator (its answer renews the lease).
    pub(crate) async fn check(&self) {
        let nonce = rand_u64();
        let epoch = {
            let mut st = self.lock();
            if st.checks.len() >= 64 {
                st.checks.clear();
            }
            st.checks.insert(nonce, Instant::now());
            st.view.as_ref().map(|v| v.epoch).unwrap_or(0)
        };
        let r = self
            .inner
            .engine
            .notify(&self.inner.coord, &wire::encode(&Msg::Check { epoch, nonce }))
            .await;
        if let Err(e) = r
            && matches!(
                e.kind(),
                kvfs_transfer::ErrorKind::PeerGone
                    | kvfs_transfer::ErrorKind::UnknownSegment
                    | kvfs_transfer::ErrorKind::Refused
            )
        {
            tracing::warn!(error = %e, "pg: the coordinator is gone; the view can no longer change");
            self.lock().coordinator_gone = true;
            self.inner.changed.notify_waiters();
        }
    }

    pub(crate) async fn segment(&self, m: &MemberInfo) -> StepResult<SegmentHandle> {
        if let Some((name, seg)) =
            self.inner.peers.lock().unwrap_or_else(|e| e.into_inner()).get(&m.slot)
            && *name == m.segment
            && !seg.is_dead()
        {
            return Ok(seg.clone());
        }
        let e = &self.inner.engine;
        if e.opened_segment(&m.segment).is_some_and(|s| s.is_dead()) {
            e.close_segment(&m.segment).await;
        }
        match e.open_segment(&m.segment).await {
            Ok(seg) => {
                self.inner
                    .peers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(m.slot, (m.segment.clone(), seg.clone()));
                Ok(seg)
            }
            Err(e) => Err(self.suspect(m.slot, format!("cannot reach slot {}: {e}", m.slot)).await),
        }
    }

    /// Reports `slot` to the coordinator and says to wait for the view change (the coordinator
    /// checks the report; if the peer is alive the operation runs into its deadline).
    pub(crate) async fn suspect(&self, slot: u32, evidence: String) -> Stop {
        let epoch = {
            let mut st = self.lock();
            st.counters.suspects_reported += 1;
            st.view.as_ref().map(|v| v.epoch).unwrap_or(0)
        };
        tracing::info!(slot, %evidence, "pg: reporting a suspect peer");
        let _ = self.to_coordinator(&Msg::Suspect { epoch, slot, evidence }).await;
        Stop::Interrupted
    }

    /// Sends an empty frame stamped with `epoch` to `slot` (tests: the receiver must refuse
    /// one from an older epoch than its own and count it in `Counters::stale_refused`).
    #[doc(hidden)]
    pub async fn send_frame_at_epoch(&self, slot: u32, epoch: u64) -> Result<()> {
        let m = self.view().member(slot).cloned().ok_or_else(|| {
            Error::new(ErrorKind::UnknownSlot, "frame", format!("slot {slot} is not active"))
        })?;
        let seg = self
            .inner
            .engine
            .open_segment(&m.segment)
            .await
            .map_err(|e| Error::transfer("frame", e))?;
        let msg =
            Msg::Data { epoch, seq: 0, phase: 0, from: self.inner.slot, sig: 0, body: Vec::new() };
        self.inner
            .engine
            .notify(&seg, &wire::encode(&msg))
            .await
            .map_err(|e| Error::transfer("frame", e))
    }

    /// Tells every peer of a staged operation that this member has finished reading its
    /// staging (without waiting: it is off the operation's path), and records that peers may
    /// still be reading this member's, for `close`.
    pub(crate) fn reads_done(&self, ctx: &Ctx) {
        let others: Vec<usize> = ctx.others().collect();
        self.lock().last_exposed =
            Some((ctx.epoch, ctx.seq, others.iter().map(|&r| ctx.members[r].slot).collect()));
        let msg = wire::encode(&Msg::Data {
            epoch: ctx.epoch,
            seq: ctx.seq,
            phase: READ_DONE_PHASE,
            from: self.inner.slot,
            sig: 0,
            body: Vec::new(),
        });
        for r in others {
            let Some((_, seg)) = self
                .inner
                .peers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&ctx.members[r].slot)
                .cloned()
            else {
                continue;
            };
            let (engine, msg) = (self.inner.engine.clone(), msg.clone());
            tokio::spawn(async move {
                let _ = engine.notify(&seg, &msg).await;
            });
        }
    }

    /// Sends one frame of operation `ctx` to rank `to`.
    pub(crate) async fn frame(
        &self,
        ctx: &Ctx,
        to: usize,
        phase: u32,
        sig: u64,
        body: Vec<u8>,
    ) -> StepResult<()> {
        let m = &ctx.members[to];
        let seg = self.segment(m).await?;
        let msg =
            Msg::Data { epoch: ctx.epoch, seq: ctx.seq, phase, from: self.inner.slot, sig, body };
        match self
            .unless_interrupted(ctx, self.inner.engine.notify(&seg, &wire::encode(&msg)))
            .await?
        {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == kvfs_transfer::ErrorKind::Busy => {
                Err(Stop::Fail(Error::transfer("send", e)))
            }
            Err(e) => {
                Err(self.suspect(m.slot, format!("sending to slot {} failed: {e}", m.slot)).await)
            }
        }
    }

    /// Sends the same frame to every rank in `to`, concurrently.
    pub(crate) async fn send_many(
        &self,
        ctx: &Ctx,
        to: impl Iterator<Item = usize>,
        phase: u32,
        sig: u64,
        body: &[u8],
    ) -> StepResult<()> {
        let sends: Vec<_> = to.map(|r| self.frame(ctx, r, phase, sig, body.to_vec())).collect();
        for r in self.unless_interrupted(ctx, futures_util::future::join_all(sends)).await? {
            r?;
        }
        Ok(())
    }

    /// Runs `fut` unless the view starts changing first (a send or read to a stopped peer
    /// would otherwise hold the operation until the engine's timeout).
    pub(crate) async fn unless_interrupted<T>(
        &self,
        ctx: &Ctx,
        fut: impl std::future::Future<Output = T>,
    ) -> StepResult<T> {
        let interrupted = async {
            loop {
                let notified = self.inner.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let st = self.lock();
                    if st.closed
                        || st.frozen.is_some()
                        || st.view.as_ref().is_none_or(|v| v.epoch != ctx.epoch)
                        || st.stale_seen > ctx.epoch
                    {
                        return;
                    }
                }
                notified.await;
            }
        };
        tokio::select! {
            r = fut => Ok(r),
            () = interrupted => Err(Stop::Interrupted),
        }
    }

    /// Waits for phase `phase` frames from every rank in `from`; returns their bodies by rank.
    pub(crate) async fn recv_many(
        &self,
        ctx: &Ctx,
        from: &[usize],
        phase: u32,
        sig: u64,
        op: &'static str,
    ) -> StepResult<Vec<Vec<u8>>> {
        let mut got: Vec<Option<Vec<u8>>> = vec![None; from.len()];
        let suspect_at = Instant::now() + Duration::from_millis(self.inner.cfg.suspect_after_ms);
        let mut reported = false;
        loop {
            let notified = self.inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if st.closed {
                    return Err(Error::new(ErrorKind::Closed, op, "the group is closed").into());
                }
                if st.frozen.is_some()
                    || st.view.as_ref().is_none_or(|v| v.epoch != ctx.epoch)
                    || st.stale_seen > ctx.epoch
                {
                    return Err(Stop::Interrupted);
                }
                for (i, &r) in from.iter().enumerate() {
                    if got[i].is_some() {
                        continue;
                    }
                    let key = (ctx.epoch, ctx.seq, phase, ctx.members[r].slot);
                    if let Some((their_sig, body)) = st.mailbox.remove(&key) {
                        if their_sig != sig {
                            return Err(Error::new(
                                ErrorKind::Mismatch,
                                op,
                                format!(
                                    "slot {} called it with different arguments (sizes, dtype, op or root differ)",
                                    ctx.members[r].slot
                                ),
                            )
                            .into());
                        }
                        got[i] = Some(body);
                    }
                }
                if got.iter().all(Option::is_some) {
                    return Ok(got.into_iter().map(|b| b.expect("checked")).collect());
                }
            }
            let wake = if reported { ctx.deadline } else { suspect_at.min(ctx.deadline) };
            if tokio::time::timeout_at(wake, notified).await.is_err() {
                if Instant::now() >= ctx.deadline {
                    let missing: Vec<u32> = from
                        .iter()
                        .zip(&got)
                        .filter(|(_, g)| g.is_none())
                        .map(|(&r, _)| ctx.members[r].slot)
                        .collect();
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        op,
                        format!("no frame from slots {missing:?} before the deadline"),
                    )
                    .into());
                }
                if !reported {
                    reported = true;
                    for (&r, g) in from.iter().zip(&got) {
                        if g.is_none() {
                            let slot = ctx.members[r].slot;
                            let _ = self
                                .suspect(
                                    slot,
                                    format!(
                                        "no frame for operation {} phase {phase} after {} ms",
                                        ctx.seq, self.inner.cfg.suspect_after_ms
                                    ),
                                )
                                .await;
                        }
                    }
                }
            }
        }
    }

    /// Reads, concurrently, `(rank, remote offset in its staging half, len, landing offset)`
    /// ranges into the landing buffer (given up if the view starts changing: the landing is
    /// this member's own memory).
    pub(crate) async fn pull(
        &self,
        ctx: &Ctx,
        half: usize,
        items: &[(usize, u64, u64, u64)],
    ) -> StepResult<()> {
        let mut moves = Vec::with_capacity(items.len());
        for &(r, off, len, at) in items {
            let m = &ctx.members[r];
            if off + len > m.staging_bytes || at + len > self.inner.landing.len() as u64 {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    "pull",
                    format!(
                        "slot {} stages {} bytes, {} needed",
                        m.slot,
                        m.staging_bytes,
                        off + len
                    ),
                )
                .into());
            }
            moves.push((r, self.inner.landing.addr() + at, m.staging[half] + off, len, false));
        }
        self.transfer_items(ctx, &moves, true).await
    }

    /// Moves `(rank, local address, remote address, len, write)` items as one batch, to its
    /// end: the local side may be the caller's own memory (registered for the operation), so
    /// an item is never abandoned while it may still touch it.
    pub(crate) async fn move_items(
        &self,
        ctx: &Ctx,
        items: &[(usize, u64, u64, u64, bool)],
    ) -> StepResult<()> {
        self.transfer_items(ctx, items, false).await
    }

    /// One batch of items; `abandonable`: given up when the view starts changing (only when
    /// the local side is this member's own memory). A failed item reports its peer.
    async fn transfer_items(
        &self,
        ctx: &Ctx,
        items: &[(usize, u64, u64, u64, bool)],
        abandonable: bool,
    ) -> StepResult<()> {
        let mut reqs = Vec::with_capacity(items.len());
        let mut ranks = Vec::with_capacity(items.len());
        for &(r, local, remote, len, write) in items {
            if len == 0 {
                continue;
            }
            reqs.push(TransferRequest {
                op: if write { TransferOp::Write } else { TransferOp::Read },
                segment: self.segment(&ctx.members[r]).await?,
                local_addr: local,
                remote_addr: remote,
                len,
            });
            ranks.push(r);
        }
        if reqs.is_empty() {
            return Ok(());
        }
        let batch = self.inner.engine.transfer(reqs);
        let results =
            if abandonable { self.unless_interrupted(ctx, batch).await? } else { batch.await };
        let results = results.map_err(|e| Error::transfer("transfer", e))?;
        for (r, res) in ranks.into_iter().zip(results) {
            if let Err(e) = res {
                let slot = ctx.members[r].slot;
                return Err(self
                    .suspect(slot, format!("moving data with slot {slot} failed: {e}"))
                    .await);
            }
        }
        Ok(())
    }

    /// Registers the caller's memory `[addr, addr+len)` for this engine's own transfers until
    /// the guard drops; `None` when it cannot be (then the caller bounces through `bounce`).
    ///
    /// # Safety
    /// The memory must stay valid until the guard drops, and every transfer that uses it must
    /// have finished by then (`move_items` never abandons one).
    pub(crate) unsafe fn register_user(&self, addr: u64, len: u64) -> Option<UserMemory<'_>> {
        if len == 0 {
            return None;
        }
        // SAFETY: this function's contract.
        match unsafe { self.inner.engine.register_memory(addr, len, false) } {
            Ok(()) => Some(UserMemory { engine: &self.inner.engine, addr }),
            Err(_) => None,
        }
    }

    /// Sends a point-to-point message.
    pub(crate) async fn p2p_notify(
        &self,
        to: &MemberInfo,
        epoch: u64,
        tag: u32,
        pseq: u64,
        kind: P2pKind,
    ) -> Result<()> {
        let seg = match self.segment(to).await {
            Ok(s) => s,
            Err(_) => {
                let detail = format!("slot {} is unreachable", to.slot);
                return Err(self.p2p_failed(to.slot, epoch, detail).await);
            }
        };
        let msg = Msg::P2p { epoch, from: self.inner.slot, tag, pseq, kind };
        match self.inner.engine.notify(&seg, &wire::encode(&msg)).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.p2p_failed(to.slot, epoch, format!("slot {}: {e}", to.slot)).await),
        }
    }

    /// A point-to-point call failed on `slot`: report it and wait (bounded) for the view that
    /// follows, so the caller sees the group without it when the call returns.
    pub(crate) async fn p2p_failed(&self, slot: u32, epoch: u64, detail: String) -> Error {
        let _ = self.suspect(slot, detail.clone()).await;
        let deadline = Instant::now() + Duration::from_millis(self.inner.cfg.suspect_after_ms * 3);
        let _ = self
            .wait(deadline, "p2p", |st| {
                st.view.as_ref().is_some_and(|v| v.epoch > epoch).then_some(Ok(()))
            })
            .await;
        Error::new(ErrorKind::PeerFailed, "p2p", detail)
    }

    pub(crate) fn next_send_seq(&self, to: &MemberInfo, tag: u32) -> u64 {
        let mut st = self.lock();
        let s = st.p2p_send_seq.entry((to.segment.clone(), tag)).or_insert(0);
        *s += 1;
        *s - 1
    }

    pub(crate) fn next_recv_seq(&self, from: &MemberInfo, tag: u32) -> u64 {
        let mut st = self.lock();
        let s = st.p2p_recv_seq.entry((from.segment.clone(), tag)).or_insert(0);
        *s += 1;
        *s - 1
    }

    /// Waits for the next part of point-to-point message `(from, tag, pseq)`.
    pub(crate) async fn p2p_wait(
        &self,
        from: &MemberInfo,
        tag: u32,
        pseq: u64,
        deadline: Instant,
    ) -> Result<P2pKind> {
        let key = (from.segment.clone(), tag, pseq);
        self.wait(deadline, "recv", |st| {
            if let Some(q) = st.p2p_in.get_mut(&key)
                && let Some(k) = q.pop_front()
            {
                if q.is_empty() {
                    st.p2p_in.remove(&key);
                }
                return Some(Ok(k));
            }
            if removed(st) {
                return Some(Err(stale_error(st, "recv")));
            }
            if !st
                .view
                .as_ref()
                .is_some_and(|v| v.members.iter().any(|m| m.segment == from.segment))
            {
                return Some(Err(Error::new(
                    ErrorKind::PeerFailed,
                    "recv",
                    format!("slot {} left the group before its message came", from.slot),
                )));
            }
            None
        })
        .await
    }

    pub(crate) fn set_p2p_outstanding(&self, to: &MemberInfo, tag: u32, pseq: u64, part: u32) {
        self.lock().p2p_outstanding = Some((to.segment.clone(), tag, pseq, part));
    }

    /// Waits until the receiver of the last large send has pulled its last part (or left the
    /// group, which ends that send's use of the staging).
    pub(crate) async fn wait_p2p_staging(&self, deadline: Instant) -> Result<()> {
        self.wait(deadline, "send", |st| {
            let Some(key) = st.p2p_outstanding.clone() else { return Some(Ok(())) };
            let present =
                st.view.as_ref().is_some_and(|v| v.members.iter().any(|m| m.segment == key.0));
            if !present || st.p2p_done.remove(&key) {
                st.p2p_outstanding = None;
                return Some(Ok(()));
            }
            None
        })
        .await
    }

    /// Pulls `len` bytes at `addr` of `from`'s p2p staging into the landing buffer.
    pub(crate) async fn p2p_pull(
        &self,
        from: &MemberInfo,
        epoch: u64,
        addr: u64,
        len: u64,
    ) -> Result<()> {
        if len > self.inner.p2p_landing.len() as u64 {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "recv",
                "a part larger than the landing buffer",
            ));
        }
        let seg = match self.segment(from).await {
            Ok(s) => s,
            Err(_) => {
                let detail = format!("slot {} is unreachable", from.slot);
                return Err(self.p2p_failed(from.slot, epoch, detail).await);
            }
        };
        let req = TransferRequest {
            op: TransferOp::Read,
            segment: seg,
            local_addr: self.inner.p2p_landing.addr(),
            remote_addr: addr,
            len,
        };
        match self.inner.engine.transfer_one(&req).await {
            Ok(()) => Ok(()),
            Err(e) => {
                Err(self.p2p_failed(from.slot, epoch, format!("slot {}: {e}", from.slot)).await)
            }
        }
    }
}

/// The caller's memory registered for one operation (unregistered on drop).
pub(crate) struct UserMemory<'a> {
    engine: &'a Engine,
    pub addr: u64,
}

impl Drop for UserMemory<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister(self.addr);
    }
}

/// True when a peer or the coordinator said the group moved past this member's current view
/// while this member is not frozen. A survivor is frozen before any peer can hold the epoch
/// that follows (module notes), and once it installs that epoch a late `Stale` answer to a
/// frame it sent in the old one names an epoch it already holds; so only a removed member
/// hears of a newer epoch unfrozen. Compared with the current view, never with the epoch an
/// operation began in: that one is older than the view a survivor just installed.
fn removed(st: &State) -> bool {
    st.frozen.is_none() && st.stale_seen > st.view.as_ref().map_or(0, |v| v.epoch)
}

fn stale_error(st: &State, op: &'static str) -> Error {
    let epoch = st.view.as_ref().map(|v| v.epoch).unwrap_or(0);
    Error::new(
        ErrorKind::StaleEpoch,
        op,
        format!(
            "this member is at epoch {epoch} and the group at {} or later: it was removed (join again)",
            st.stale_seen
        ),
    )
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Files every notification; ends when the member is dropped.
async fn dispatch(inner: std::sync::Weak<Inner>, engine: Engine) {
    while let Some(n) = engine.recv_notification().await {
        let Some(inner) = inner.upgrade() else { return };
        let Some(msg) = wire::decode(&n.msg) else {
            tracing::warn!(from = %n.from, "pg: undecodable notification");
            continue;
        };
        let reply = file(&inner, &n.from, msg);
        inner.changed.notify_waiters();
        if let Some((to_coord, msg)) = reply {
            let engine = engine.clone();
            let target =
                if to_coord { Some(inner.coord.clone()) } else { engine.opened_segment(&n.from) };
            if let Some(seg) = target {
                tokio::spawn(async move {
                    let _ = engine.notify(&seg, &wire::encode(&msg)).await;
                });
            }
        }
    }
}

/// Puts queued views in force: one without `switch_at` (a failure's or a change's) at once,
/// with everything queued before it; a graceful leave's once this member is in the epoch
/// before it and has finished `switch_at` operations there.
fn advance(st: &mut State) {
    if let Some(i) = st.deferred.iter().rposition(|d| d.switch_at.is_none()) {
        let v = st.deferred.drain(..=i).next_back().expect("non-empty");
        install(st, v);
    }
    while let Some(head) = st.deferred.front() {
        let epoch = st.view.as_ref().map(|v| v.epoch).unwrap_or(0);
        if head.epoch <= epoch {
            st.deferred.pop_front();
            continue;
        }
        let ready = head.epoch == epoch + 1 && head.switch_at.is_some_and(|f| st.finished >= f);
        if !ready {
            break;
        }
        let v = st.deferred.pop_front().expect("front");
        install(st, v);
    }
}

/// Puts a newer view in force.
fn install(st: &mut State, v: View) {
    if let Some(old) = st.view.as_ref() {
        let gone: Vec<MemberInfo> = old
            .members
            .iter()
            .filter(|m| v.member(m.slot).is_none_or(|n| n.segment != m.segment))
            .cloned()
            .collect();
        for m in gone {
            st.departed.insert(m.slot, m);
        }
    }
    if st.frozen.is_none() {
        st.finished_at_freeze = Some(st.finished);
    }
    if st.frozen.is_some_and(|f| f <= v.epoch) {
        st.frozen = None;
    }
    st.finished = 0;
    st.steps = 0;
    st.pending = false;
    let e = v.epoch;
    st.mailbox.retain(|k, _| k.0 >= e);
    let alive: HashSet<String> = v.members.iter().map(|m| m.segment.clone()).collect();
    st.p2p_done.retain(|k| alive.contains(&k.0));
    st.p2p_send_seq.retain(|k, _| alive.contains(&k.0));
    st.view = Some(v);
}

/// Applies one message to the state; returns a reply (to the coordinator when `.0`).
fn file(inner: &Inner, from: &str, msg: Msg) -> Option<(bool, Msg)> {
    let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
    let epoch = st.view.as_ref().map(|v| v.epoch).unwrap_or(0);
    match msg {
        Msg::View(v) => {
            if v.epoch > epoch && v.group == inner.cfg.group {
                if st.solo {
                    // A late joiner runs alone until `wait_active` takes the activation.
                    if st.held.as_ref().is_none_or(|h| h.epoch < v.epoch) {
                        st.held = Some(v);
                    }
                } else {
                    // A graceful leave's view waits until this member finished the operations
                    // the leaver took part in (`advance`).
                    if !st.deferred.iter().any(|d| d.epoch == v.epoch) {
                        let at = st.deferred.iter().position(|d| d.epoch > v.epoch);
                        let at = at.unwrap_or(st.deferred.len());
                        st.deferred.insert(at, v);
                    }
                    advance(&mut st);
                }
            }
            None
        }
        Msg::JoinPending { .. } => {
            st.pending = true;
            None
        }
        Msg::JoinRefused { reason } => {
            st.refused = Some(reason);
            None
        }
        Msg::ChangeRefused { epoch, reason } => {
            st.change_refused = Some((epoch, reason));
            None
        }
        Msg::Freeze { epoch: next, .. } => {
            if next <= epoch || st.frozen.is_some_and(|f| f > next) {
                return None;
            }
            if st.frozen.is_none() {
                st.finished_at_freeze = Some(st.finished);
            }
            st.frozen = Some(next);
            let finished = st.finished_at_freeze.unwrap_or(st.finished);
            Some((true, Msg::Progress { epoch: next, finished, in_op: st.in_op, dirty: st.dirty }))
        }
        Msg::PendingSlots { nonce, slots } => {
            if st.pending_answers.len() < 64 {
                st.pending_answers.insert(nonce, slots);
            }
            None
        }
        Msg::Checked { nonce, .. } => {
            if let Some(sent) = st.checks.remove(&nonce) {
                st.lease_from = Some(st.lease_from.map_or(sent, |t| t.max(sent)));
            }
            None
        }
        Msg::Stale { current, .. } => {
            st.stale_seen = st.stale_seen.max(current);
            None
        }
        Msg::Data { epoch: e, seq, phase, from: slot, sig, body } => {
            if e < epoch {
                st.counters.stale_refused += 1;
                return Some((false, Msg::Stale { sent: e, current: epoch }));
            }
            if st.mailbox.len() >= inner.cfg.mailbox_frames_max {
                st.counters.dropped += 1;
                tracing::warn!(slot, "pg: mailbox full, frame dropped");
                return None;
            }
            st.mailbox.insert((e, seq, phase, slot), (sig, body));
            None
        }
        Msg::P2p { epoch: e, from: _, tag, pseq, kind } => {
            let known =
                st.view.as_ref().is_some_and(|v| v.members.iter().any(|m| m.segment == from));
            if e < epoch && !known {
                // A process the group moved on without.
                st.counters.stale_refused += 1;
                return Some((false, Msg::Stale { sent: e, current: epoch }));
            }
            match kind {
                P2pKind::Done { part } => {
                    st.p2p_done.insert((from.to_string(), tag, pseq, part));
                }
                k => {
                    if st.p2p_in.len() >= inner.cfg.mailbox_frames_max {
                        st.counters.dropped += 1;
                        return None;
                    }
                    st.p2p_in.entry((from.to_string(), tag, pseq)).or_default().push_back(k);
                }
            }
            None
        }
        other => {
            tracing::debug!(%from, ?other, "pg: unexpected message");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(epoch: u64) -> View {
        View {
            group: "g".into(),
            epoch,
            world: 3,
            members: Vec::new(),
            removed: Vec::new(),
            resume: None,
            switch_at: None,
            lease_ms: 1000,
        }
    }

    /// The race CI hit: a survivor frozen in epoch 1 installs epoch 2, and only then a peer's
    /// late `Stale` answer to a frame it sent in epoch 1 arrives, naming epoch 2. The survivor
    /// holds epoch 2 already, so it was not removed.
    #[test]
    fn a_late_stale_answer_naming_the_epoch_a_survivor_holds_does_not_remove_it() {
        let mut st = State::default();
        install(&mut st, view(1));
        st.frozen = Some(2);
        st.stale_seen = 2;
        assert!(!removed(&st), "frozen: waiting for the new view");
        install(&mut st, view(2));
        assert!(st.frozen.is_none());
        assert!(!removed(&st));
        st.stale_seen = 2;
        assert!(!removed(&st), "a Stale answer arriving after the install");
        st.stale_seen = 3;
        assert!(removed(&st), "the group moved past the view this member holds");
    }

    #[test]
    fn a_member_the_group_moved_on_without_learns_it_from_a_stale_answer() {
        let mut st = State::default();
        install(&mut st, view(1));
        assert!(!removed(&st));
        st.stale_seen = 2;
        assert!(removed(&st));
        assert_eq!(stale_error(&st, "allreduce").kind(), ErrorKind::StaleEpoch);
    }
}
