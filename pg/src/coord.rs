//! The coordinator: the one place a group's view is decided.
//!
//! Mechanism. [`Membership`] is a plain state machine (messages and clock ticks in, messages
//! out); [`Coordinator`] runs it on a Transfer Engine of its own, exchanging notifications
//! with the members and pinging each active member every `heartbeat_ms`.
//!
//! Policy. The group forms when all `world` initial slots have joined (epoch 1). A member is
//! failed when it misses pings for `failure_timeout_ms`, when its engine is gone, when it
//! leaves, or when another incarnation joins its slot; a member's `Suspect` report makes the
//! coordinator ping the suspect at once rather than act on hearsay. A failure starts a
//! reconciliation: survivors are frozen (`Freeze`), report how many operations they finished
//! in the old epoch, and the new view carries the `Resume` rule that keeps them in step
//! (group.rs). A survivor that does not report within `reconcile_timeout_ms` is failed too.
//! Joins after formation wait, pending, until every active member asks for the slot's
//! activation (`Change`), so the change falls between two operations on every member. Slots
//! are never renumbered; at most `max_group_size` of them.
//!
//! The coordinator may run in rank 0's process (the default, as torch's store does) or as its
//! own process (`kvfs pg coordinator`), which then survives any rank. It holds no data.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfs_transfer::{Engine, EngineConfig, SegmentHandle, Transports};

use crate::wire::{self, MemberInfo, Msg, PROTOCOL, Resume, View};
use crate::{Error, ErrorKind, Result};

/// The refusal a joiner retries: its slot's holder is still a member.
pub(crate) const SLOT_ACTIVE: &str = "slot active";

/// Largest `max_group_size` accepted (slots are u32, views are notifications of at most 64 KiB).
pub const GROUP_SIZE_LIMIT: u32 = 1024;

/// Coordinator settings.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    pub listen: SocketAddr,
    /// Group name members must present.
    pub group: String,
    /// Slots of the initial group (0..world).
    pub world: u32,
    pub max_group_size: u32,
    pub heartbeat_ms: u64,
    pub failure_timeout_ms: u64,
    pub reconcile_timeout_ms: u64,
}

impl CoordinatorConfig {
    pub fn new(group: &str, world: u32) -> CoordinatorConfig {
        CoordinatorConfig {
            listen: "127.0.0.1:0".parse().expect("literal address"),
            group: group.to_string(),
            world,
            max_group_size: GROUP_SIZE_LIMIT,
            heartbeat_ms: 200,
            failure_timeout_ms: 1500,
            reconcile_timeout_ms: 3000,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |d: String| Err(Error::new(ErrorKind::InvalidArgument, "coordinator", d));
        if self.world == 0 || self.world > self.max_group_size {
            return bad(format!(
                "world {} must be between 1 and max_group_size {}",
                self.world, self.max_group_size
            ));
        }
        if self.max_group_size > GROUP_SIZE_LIMIT {
            return bad(format!(
                "max_group_size {} is above {GROUP_SIZE_LIMIT}",
                self.max_group_size
            ));
        }
        if self.heartbeat_ms == 0 || self.failure_timeout_ms < self.heartbeat_ms {
            return bad("heartbeat_ms must be positive and at most failure_timeout_ms".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Active,
    Pending,
}

#[derive(Debug, Clone)]
struct Member {
    info: MemberInfo,
    state: State,
}

#[derive(Debug)]
struct Reconcile {
    epoch: u64,
    removed: Vec<(u32, String)>,
    waiting: BTreeSet<u32>,
    reports: BTreeMap<u32, (u64, bool, bool)>,
    started: Instant,
}

#[derive(Debug)]
struct ChangeReq {
    activate: Vec<u32>,
    deactivate: Vec<u32>,
    from: BTreeSet<u32>,
}

/// What the state machine asks its driver to send: a message to a segment.
pub type Out = (String, Msg);

/// The coordinator's decisions, without I/O.
#[derive(Debug)]
pub struct Membership {
    group: String,
    world: u32,
    max_group_size: u32,
    reconcile_timeout: Duration,
    lease_ms: u64,
    epoch: u64,
    formed: bool,
    members: BTreeMap<u32, Member>,
    /// Segments of members that failed or left: their later messages are answered `Stale`.
    gone: BTreeMap<String, u64>,
    reconcile: Option<Reconcile>,
    change: Option<ChangeReq>,
    removed_total: u64,
    /// Members that left in the current epoch, with the operations they had finished.
    left: BTreeMap<u32, u64>,
    /// Views made by graceful leaves, by epoch, with their `switch_at` (a run of them since
    /// the last other view; see `leave`).
    graceful: BTreeMap<u64, u64>,
}

impl Membership {
    pub fn new(cfg: &CoordinatorConfig) -> Membership {
        Membership {
            group: cfg.group.clone(),
            world: cfg.world,
            max_group_size: cfg.max_group_size,
            reconcile_timeout: Duration::from_millis(cfg.reconcile_timeout_ms),
            lease_ms: cfg.failure_timeout_ms / 2,
            epoch: 0,
            formed: false,
            members: BTreeMap::new(),
            gone: BTreeMap::new(),
            reconcile: None,
            change: None,
            removed_total: 0,
            left: BTreeMap::new(),
            graceful: BTreeMap::new(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Slots of active members with their segments.
    pub fn active(&self) -> Vec<(u32, String)> {
        self.members
            .values()
            .filter(|m| m.state == State::Active)
            .map(|m| (m.info.slot, m.info.segment.clone()))
            .collect()
    }

    /// Slots with a process waiting for activation.
    pub fn pending(&self) -> Vec<u32> {
        self.members.values().filter(|m| m.state == State::Pending).map(|m| m.info.slot).collect()
    }

    pub fn view(&self) -> View {
        View {
            group: self.group.clone(),
            epoch: self.epoch,
            world: self.world,
            members: self
                .members
                .values()
                .filter(|m| m.state == State::Active)
                .map(|m| m.info.clone())
                .collect(),
            removed: Vec::new(),
            resume: None,
            switch_at: None,
            lease_ms: self.lease_ms,
        }
    }

    pub fn removed_total(&self) -> u64 {
        self.removed_total
    }

    fn slot_of(&self, segment: &str) -> Option<u32> {
        self.members.values().find(|m| m.info.segment == segment).map(|m| m.info.slot)
    }

    /// Handles one message from `from` (a segment name).
    pub fn on_msg(&mut self, from: &str, msg: Msg, now: Instant) -> Vec<Out> {
        if let Some(&epoch) = self.gone.get(from)
            && !matches!(msg, Msg::Join { .. })
        {
            return vec![(from.to_string(), Msg::Stale { sent: epoch, current: self.epoch })];
        }
        match msg {
            Msg::Join { protocol, group, world, member } => {
                self.join(from, protocol, group, world, member, now)
            }
            Msg::Suspect { .. } => Vec::new(), // the driver pings first, then calls `fail`
            Msg::Pending { nonce } => {
                vec![(from.to_string(), Msg::PendingSlots { nonce, slots: self.pending() })]
            }
            Msg::Check { nonce, epoch } => match self.slot_of(from) {
                Some(_) => vec![(from.to_string(), Msg::Checked { epoch: self.epoch, nonce })],
                None => vec![(from.to_string(), Msg::Stale { sent: epoch, current: self.epoch })],
            },
            Msg::Progress { epoch, finished, in_op, dirty } => {
                let Some(slot) = self.slot_of(from) else { return Vec::new() };
                match self.reconcile.as_mut() {
                    Some(r) if r.epoch == epoch && r.waiting.contains(&slot) => {
                        r.waiting.remove(&slot);
                        r.reports.insert(slot, (finished, in_op, dirty));
                        self.try_finish_reconcile()
                    }
                    _ => Vec::new(),
                }
            }
            Msg::Change { epoch, activate, deactivate } => {
                self.change(from, epoch, activate, deactivate)
            }
            Msg::Leave { epoch, finished } => match self.slot_of(from) {
                Some(slot) => self.leave(slot, epoch, finished, now),
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn join(
        &mut self,
        from: &str,
        protocol: u16,
        group: String,
        world: u32,
        member: MemberInfo,
        _now: Instant,
    ) -> Vec<Out> {
        let refuse = |reason: String| vec![(from.to_string(), Msg::JoinRefused { reason })];
        if protocol != PROTOCOL {
            return refuse(format!("protocol {protocol}, this coordinator speaks {PROTOCOL}"));
        }
        if group != self.group {
            return refuse(format!("group {group:?}, this coordinator runs {:?}", self.group));
        }
        if world != self.world && !self.formed {
            return refuse(format!("world size {world}, the group forms with {}", self.world));
        }
        if member.slot >= self.max_group_size {
            return refuse(format!(
                "slot {} is outside the group (max_group_size {})",
                member.slot, self.max_group_size
            ));
        }
        if member.segment != from {
            return refuse(format!("segment {} joined from {from}", member.segment));
        }
        let mut out = Vec::new();
        if let Some(old) = self.members.get(&member.slot) {
            if old.info.incarnation == member.incarnation {
                // A repeated join (its answer was lost): answer again.
                return match (self.formed, old.state) {
                    (true, State::Active) => vec![(from.to_string(), Msg::View(self.view()))],
                    (true, State::Pending) => {
                        vec![(from.to_string(), Msg::JoinPending { epoch: self.epoch })]
                    }
                    _ => Vec::new(),
                };
            }
            if !self.formed {
                return refuse(format!("slot {} is already taken", member.slot));
            }
            if old.state == State::Active {
                // Never evict a member on a joiner's word (two processes given the same rank
                // must not kill a healthy one): the joiner retries until the failure of the
                // slot's holder is detected.
                return refuse(format!(
                    "{SLOT_ACTIVE}: slot {} is held by a live member",
                    member.slot
                ));
            }
        }
        self.gone.remove(from);
        let slot = member.slot;
        if !self.formed {
            if slot >= self.world {
                return refuse(format!(
                    "slot {slot} is outside the forming group of {}",
                    self.world
                ));
            }
            self.members.insert(slot, Member { info: member, state: State::Active });
            if self.members.len() as u32 == self.world {
                self.formed = true;
                self.epoch = 1;
                out.extend(self.broadcast_view(None, Vec::new()));
            }
            return out;
        }
        self.members.insert(slot, Member { info: member, state: State::Pending });
        out.push((from.to_string(), Msg::JoinPending { epoch: self.epoch }));
        out
    }

    fn change(
        &mut self,
        from: &str,
        epoch: u64,
        activate: Vec<u32>,
        deactivate: Vec<u32>,
    ) -> Vec<Out> {
        let refused =
            |reason: String| vec![(from.to_string(), Msg::ChangeRefused { epoch, reason })];
        let Some(slot) = self.slot_of(from) else {
            return refused("not a member".into());
        };
        if self.members[&slot].state != State::Active
            || epoch != self.epoch
            || self.reconcile.is_some()
        {
            return refused(format!(
                "the group is at epoch {}, the request was for {epoch}",
                self.epoch
            ));
        }
        for s in &activate {
            match self.members.get(s) {
                Some(m) if m.state == State::Pending => {}
                Some(_) => {} // already active: nothing to do for it
                None => return refused(format!("slot {s} has no process waiting to join")),
            }
        }
        for s in &deactivate {
            if !self.members.get(s).is_some_and(|m| m.state == State::Active) {
                return refused(format!("slot {s} is not active"));
            }
        }
        let req = self.change.get_or_insert_with(|| ChangeReq {
            activate: activate.clone(),
            deactivate: deactivate.clone(),
            from: BTreeSet::new(),
        });
        if req.activate != activate || req.deactivate != deactivate {
            let reason = format!(
                "members asked for different changes: activate {:?} deactivate {:?} against activate {activate:?} deactivate {deactivate:?}",
                req.activate, req.deactivate
            );
            let mut out = Vec::new();
            for s in std::mem::take(&mut req.from) {
                out.push((
                    self.members[&s].info.segment.clone(),
                    Msg::ChangeRefused { epoch, reason: reason.clone() },
                ));
            }
            self.change = None;
            out.push((from.to_string(), Msg::ChangeRefused { epoch, reason }));
            return out;
        }
        req.from.insert(slot);
        let active: BTreeSet<u32> = self
            .members
            .values()
            .filter(|m| m.state == State::Active)
            .map(|m| m.info.slot)
            .collect();
        if req.from != active {
            return Vec::new();
        }
        let req = self.change.take().expect("checked above");
        let mut removed = Vec::new();
        let mut told = Vec::new();
        for s in &req.deactivate {
            if let Some(m) = self.members.remove(s) {
                self.gone.insert(m.info.segment.clone(), self.epoch);
                told.push(m.info.segment);
                removed.push((*s, "deactivated".to_string()));
            }
        }
        for s in &req.activate {
            if let Some(m) = self.members.get_mut(s) {
                m.state = State::Active;
                self.world = self.world.max(s + 1);
            }
        }
        self.epoch += 1;
        let mut out = self.broadcast_view(None, removed);
        // Deactivated members learn the view too: it tells them they are out of it.
        let view = out.first().map(|(_, m)| m.clone());
        if let Some(v) = view {
            out.extend(told.into_iter().map(|seg| (seg, v.clone())));
        }
        out
    }

    /// A member left after finishing `finished` operations of `epoch`: the others finish
    /// those too and switch to the view without it from the next one (no freeze: nothing of
    /// the leaver's is missing for the operations it finished). During a reconciliation, or
    /// for an older epoch, a leave is handled as a failure.
    fn leave(&mut self, slot: u32, epoch: u64, finished: u64, now: Instant) -> Vec<Out> {
        // A leaver that had not yet learned of other graceful leaves is still graceful when it
        // finished exactly the operations before each switch: in the newer epoch it has
        // finished none (two ranks that end their last call and exit together).
        let (mut epoch, mut finished) = (epoch, finished);
        while epoch < self.epoch && self.graceful.get(&(epoch + 1)) == Some(&finished) {
            epoch += 1;
            finished = 0;
        }
        let active = self.members.get(&slot).is_some_and(|m| m.state == State::Active);
        if !active || !self.formed || self.reconcile.is_some() || epoch != self.epoch {
            if epoch == self.epoch {
                self.left.insert(slot, finished);
            }
            return self.fail(slot, "left the group".into(), now);
        }
        let m = self.members.remove(&slot).expect("active");
        self.gone.insert(m.info.segment, self.epoch);
        self.removed_total += 1;
        self.change = None;
        self.epoch += 1;
        if self.graceful.len() >= 64 {
            self.graceful.pop_first();
        }
        self.graceful.insert(self.epoch, finished);
        tracing::info!(slot, finished, epoch = self.epoch, "pg member left");
        let mut view = self.view();
        view.removed = vec![(slot, "left the group".into())];
        view.switch_at = Some(finished);
        self.members
            .values()
            .filter(|m| m.state == State::Active)
            .map(|m| (m.info.segment.clone(), Msg::View(view.clone())))
            .collect()
    }

    /// Marks `slot` failed (dead, left, or replaced) and starts or extends a reconciliation.
    pub fn fail(&mut self, slot: u32, evidence: String, now: Instant) -> Vec<Out> {
        let Some(m) = self.members.get(&slot) else { return Vec::new() };
        let was_active = m.state == State::Active;
        let m = self.members.remove(&slot).expect("present");
        self.gone.insert(m.info.segment.clone(), self.epoch);
        self.removed_total += 1;
        tracing::warn!(slot, %evidence, epoch = self.epoch, "pg member failed");
        if !was_active || !self.formed {
            return Vec::new();
        }
        self.change = None;
        let survivors: BTreeSet<u32> = self
            .members
            .values()
            .filter(|m| m.state == State::Active)
            .map(|m| m.info.slot)
            .collect();
        let r = self.reconcile.get_or_insert_with(|| Reconcile {
            epoch: 0,
            removed: Vec::new(),
            waiting: BTreeSet::new(),
            reports: BTreeMap::new(),
            started: now,
        });
        // Each extension is a fresh round at a higher epoch: reports for the old round no
        // longer count, since a survivor may have moved on between them.
        r.epoch = r.epoch.max(self.epoch) + 1;
        r.removed.push((slot, evidence));
        r.waiting = survivors.clone();
        r.reports.clear();
        r.started = now;
        let freeze = Msg::Freeze { epoch: r.epoch, removed: r.removed.clone() };
        let mut out: Vec<Out> = survivors
            .iter()
            .map(|s| (self.members[s].info.segment.clone(), freeze.clone()))
            .collect();
        if survivors.is_empty() {
            out.extend(self.try_finish_reconcile());
        }
        out
    }

    fn try_finish_reconcile(&mut self) -> Vec<Out> {
        let Some(r) = self.reconcile.as_ref() else { return Vec::new() };
        if !r.waiting.is_empty() {
            return Vec::new();
        }
        let r = self.reconcile.take().expect("checked");
        let reported = r.reports.values().map(|&(f, _, _)| f).max().unwrap_or(0);
        let most = reported.max(self.left.values().copied().max().unwrap_or(0));
        self.left.clear();
        let restart = !r.reports.values().any(|&(f, in_op, dirty)| f == most && in_op && dirty);
        self.epoch = r.epoch;
        self.broadcast_view(Some(Resume { finished: most, restart }), r.removed)
    }

    /// Fails survivors that did not answer a reconciliation in time.
    pub fn on_tick(&mut self, now: Instant) -> Vec<Out> {
        let late: Vec<u32> = match &self.reconcile {
            Some(r) if now.duration_since(r.started) > self.reconcile_timeout => {
                r.waiting.iter().copied().collect()
            }
            _ => return Vec::new(),
        };
        let mut out = Vec::new();
        for s in late {
            out.extend(self.fail(s, "did not answer the reconciliation".into(), now));
        }
        out
    }

    fn broadcast_view(&mut self, resume: Option<Resume>, removed: Vec<(u32, String)>) -> Vec<Out> {
        self.graceful.clear();
        let mut view = self.view();
        view.resume = resume;
        view.removed = removed;
        self.members
            .values()
            .filter(|m| m.state == State::Active)
            .map(|m| (m.info.segment.clone(), Msg::View(view.clone())))
            .collect()
    }
}

/// A running coordinator.
pub struct Coordinator {
    engine: Engine,
    state: Arc<Mutex<Membership>>,
    task: tokio::task::JoinHandle<()>,
}

impl Coordinator {
    /// Starts a coordinator on the current tokio runtime.
    pub async fn start(cfg: CoordinatorConfig) -> Result<Coordinator> {
        cfg.validate()?;
        let ecfg = EngineConfig {
            listen: cfg.listen,
            transports: Transports::tcp_only(),
            tcp_conns_per_peer: 1,
            op_timeout_ms: cfg.failure_timeout_ms.max(200),
            notify_queue_max: 4 * GROUP_SIZE_LIMIT as usize,
            ..EngineConfig::default()
        };
        let engine = Engine::start(ecfg).await.map_err(|e| Error::transfer("coordinator", e))?;
        let state = Arc::new(Mutex::new(Membership::new(&cfg)));
        let task = tokio::spawn(serve(engine.clone(), state.clone(), cfg));
        Ok(Coordinator { engine, state, task })
    }

    /// The address members pass to `Group::join`.
    pub fn addr(&self) -> String {
        self.engine.name().to_string()
    }

    /// The current view.
    pub fn view(&self) -> View {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).view()
    }

    /// Slots with a process waiting for activation.
    pub fn pending(&self) -> Vec<u32> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).pending()
    }

    /// Members failed or removed so far.
    pub fn removed_total(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).removed_total()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn send_all(engine: &Engine, out: Vec<Out>) {
    for (to, msg) in out {
        let engine = engine.clone();
        tokio::spawn(async move {
            let seg = match engine.opened_segment(&to) {
                Some(s) => s,
                None => match engine.open_segment(&to).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(%to, error = %e, "pg coordinator: member unreachable");
                        return;
                    }
                },
            };
            if let Err(e) = engine.notify(&seg, &wire::encode(&msg)).await {
                tracing::debug!(%to, error = %e, "pg coordinator: send failed");
            }
        });
    }
}

async fn ping(engine: &Engine, segment: &str) -> std::result::Result<(), String> {
    let seg: SegmentHandle = match engine.opened_segment(segment) {
        Some(s) if !s.is_dead() => s,
        _ => {
            engine.close_segment(segment).await;
            engine.open_segment(segment).await.map_err(|e| e.to_string())?
        }
    };
    engine.ping(&seg).await.map_err(|e| e.to_string())
}

async fn serve(engine: Engine, state: Arc<Mutex<Membership>>, cfg: CoordinatorConfig) {
    let heartbeat = Duration::from_millis(cfg.heartbeat_ms);
    let failure_timeout = Duration::from_millis(cfg.failure_timeout_ms);
    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let last_seen: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
    loop {
        tokio::select! {
            n = engine.recv_notification() => {
                let Some(n) = n else { return };
                let Some(msg) = wire::decode(&n.msg) else {
                    tracing::warn!(from = %n.from, "pg coordinator: undecodable message");
                    continue;
                };
                last_seen.lock().unwrap_or_else(|e| e.into_inner()).insert(n.from.clone(), Instant::now());
                if let Msg::Suspect { slot, evidence, .. } = &msg {
                    let seg = state.lock().unwrap_or_else(|e| e.into_inner())
                        .active().into_iter().find(|(s, _)| s == slot).map(|(_, g)| g);
                    if let Some(seg) = seg {
                        let (engine, state, slot, evidence) = (engine.clone(), state.clone(), *slot, evidence.clone());
                        tokio::spawn(async move {
                            if let Err(e) = ping(&engine, &seg).await {
                                let out = state.lock().unwrap_or_else(|e| e.into_inner()).fail(
                                    slot, format!("{evidence}; the coordinator's ping failed too: {e}"), Instant::now());
                                send_all(&engine, out).await;
                            }
                        });
                    }
                }
                let out = state.lock().unwrap_or_else(|e| e.into_inner()).on_msg(&n.from, msg, Instant::now());
                send_all(&engine, out).await;
            }
            _ = tick.tick() => {
                let members = state.lock().unwrap_or_else(|e| e.into_inner()).active();
                for (slot, seg) in members {
                    let (engine, state, last_seen) = (engine.clone(), state.clone(), last_seen.clone());
                    tokio::spawn(async move {
                        let started = Instant::now();
                        match ping(&engine, &seg).await {
                            Ok(()) => { last_seen.lock().unwrap_or_else(|e| e.into_inner()).insert(seg, Instant::now()); }
                            Err(e) => {
                                let seen = last_seen.lock().unwrap_or_else(|e| e.into_inner()).get(&seg).copied();
                                let silent = seen.map(|t| started.duration_since(t)).unwrap_or(failure_timeout);
                                let gone = e.contains("peer gone") || e.contains("refused") || e.contains("unknown segment");
                                if gone || silent >= failure_timeout {
                                    let out = state.lock().unwrap_or_else(|e| e.into_inner()).fail(
                                        slot, format!("missed heartbeats ({} ms silent): {e}", silent.as_millis()), Instant::now());
                                    send_all(&engine, out).await;
                                }
                            }
                        }
                    });
                }
                let out = state.lock().unwrap_or_else(|e| e.into_inner()).on_tick(Instant::now());
                send_all(&engine, out).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(slot: u32) -> MemberInfo {
        MemberInfo {
            slot,
            segment: format!("127.0.0.1:{}", 1000 + slot),
            staging: [0, 0],
            staging_bytes: 1 << 16,
            inbox: [0, 0],
            inbox_bytes: 1 << 16,
            incarnation: slot as u64 + 1,
        }
    }

    fn formed(world: u32) -> (Membership, Instant) {
        let mut m = Membership::new(&CoordinatorConfig::new("g", world));
        let now = Instant::now();
        for s in 0..world {
            let info = member(s);
            let seg = info.segment.clone();
            m.on_msg(
                &seg,
                Msg::Join { protocol: PROTOCOL, group: "g".into(), world, member: info },
                now,
            );
        }
        assert_eq!(m.epoch(), 1);
        (m, now)
    }

    fn views(out: &[Out]) -> Vec<View> {
        out.iter()
            .filter_map(|(_, m)| if let Msg::View(v) = m { Some(v.clone()) } else { None })
            .collect()
    }

    #[test]
    fn ranks_leaving_together_after_their_last_call_leave_gracefully() {
        let (mut m, now) = formed(4);
        // Slot 2 leaves after one operation: epoch 2, switch after 1.
        let out = m.on_msg(&member(2).segment, Msg::Leave { epoch: 1, finished: 1 }, now);
        assert_eq!(views(&out)[0].switch_at, Some(1));
        // Slot 1 finished the same operation and leaves before it heard of epoch 2: still a
        // graceful leave (no freeze), switching at once in epoch 2.
        let out = m.on_msg(&member(1).segment, Msg::Leave { epoch: 1, finished: 1 }, now);
        assert!(out.iter().all(|(_, msg)| !matches!(msg, Msg::Freeze { .. })), "{out:?}");
        let v = views(&out);
        assert_eq!((v[0].epoch, v[0].switch_at), (3, Some(0)));
        assert_eq!(v[0].slots(), vec![0, 3]);
        // A leaver that had not finished what the others switch after is a failure.
        let out = m.on_msg(&member(3).segment, Msg::Leave { epoch: 1, finished: 0 }, now);
        assert!(out.iter().any(|(_, msg)| matches!(msg, Msg::Freeze { .. })), "{out:?}");
    }
}
