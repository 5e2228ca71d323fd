//! Binding a plan to buffers, and running it on the Transfer Engine.
//!
//! A [`Holder`] owns one process's weight buffers for one participant of a placement, one
//! registered buffer per fragment, and a small *header* buffer peers can read: a magic, the
//! allocation *generation* and its state (inactive, filling, active). Every [`Holder::allocate`]
//! starts a new generation. A [`Binding`] is what a holder tells the others: its participant,
//! the placement digest, its engine segment, the header's address, the generation and each
//! fragment's address and length. [`BoundPlan::new`] checks bindings against a plan (digests,
//! every fragment present with exactly its size) and fails closed.
//!
//! [`execute`] runs the regions a target participant receives as Transfer Engine reads from
//! the sources' segments, after checking its own generation is the bound one and reading each
//! source's header (bound generation, active). Sources' headers are read again after the
//! copies: a source that moved to another generation meanwhile fails the regions it served
//! (their bytes may be torn). The report gives each region's status. [`commit`] then agrees
//! over a kvfs-pg group: the target generation becomes active on every member only if every
//! member's regions succeeded and the group lost nobody; otherwise it stays inactive (a
//! participant killed mid-execution leaves everyone's target generation inactive).
//!
//! Not handled: resharding in place (a target buffer that is also a source of the same plan);
//! target and source generations are always distinct allocations.

use std::collections::HashMap;
use std::sync::Arc;

use kvfs_transfer::{Buffer, BufferOptions, Engine, SegmentHandle, TransferOp, TransferRequest};
use serde::{Deserialize, Serialize};

use crate::placement::Placement;
use crate::plan::Plan;
use crate::{Error, ErrorKind, Result};

const MAGIC: u64 = 0x4452_4853_5346_564b; // "KVFSHRD"
const HEADER_BYTES: usize = 24;

/// State of a holder's current generation, in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// Allocated, not (or no longer) valid to read.
    Inactive = 0,
    /// A plan is writing into it.
    Filling = 1,
    /// Complete: readable by plans bound to this generation.
    Active = 2,
}

impl State {
    fn from_u64(v: u64) -> Option<State> {
        match v {
            0 => Some(State::Inactive),
            1 => Some(State::Filling),
            2 => Some(State::Active),
            _ => None,
        }
    }
}

/// One fragment's buffer in a binding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FragmentBuffer {
    pub tensor: u32,
    pub fragment: u32,
    pub addr: u64,
    pub len: u64,
}

/// A participant's buffers for one generation of a placement, as peers address them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    pub participant: u32,
    pub placement: String,
    pub segment: String,
    pub header_addr: u64,
    pub generation: u64,
    pub fragments: Vec<FragmentBuffer>,
}

impl Binding {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a binding serialises")
    }

    pub fn from_bytes(b: &[u8]) -> Result<Binding> {
        serde_json::from_slice(b)
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, "binding", e.to_string()))
    }

    fn find(&self, tensor: u32, fragment: u32) -> Option<&FragmentBuffer> {
        self.fragments.iter().find(|f| f.tensor == tensor && f.fragment == fragment)
    }
}

/// One process's buffers for one participant of a placement.
pub struct Holder {
    engine: Engine,
    header: Arc<Buffer>,
    placement: Placement,
    digest: String,
    participant: u32,
    generation: u64,
    /// (tensor, fragment) -> buffer of the current generation (page-rounded) and the
    /// fragment's bytes at its start.
    buffers: Vec<((u32, u32), Arc<Buffer>, u64)>,
}

fn transfer(op: &'static str) -> impl Fn(kvfs_transfer::Error) -> Error {
    move |e| Error::transfer(op, e)
}

impl Holder {
    /// A holder on `engine` for `participant` of `placement`, with no buffers yet (generation 0,
    /// inactive).
    pub fn new(engine: Engine, placement: &Placement, participant: u32) -> Result<Holder> {
        placement.validate()?;
        if participant >= placement.participants {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "holder",
                format!("participant {participant} of {}", placement.participants),
            ));
        }
        let opts = BufferOptions {
            huge_pages: false,
            name: "kvfs-reshard-header".into(),
            ..Default::default()
        };
        let header = engine.alloc_buffer(HEADER_BYTES, &opts).map_err(transfer("holder"))?;
        let h = Holder {
            engine,
            header,
            digest: placement.digest(),
            placement: placement.clone(),
            participant,
            generation: 0,
            buffers: Vec::new(),
        };
        h.write_header(State::Inactive)?;
        Ok(h)
    }

    fn write_header(&self, state: State) -> Result<()> {
        let mut b = [0u8; HEADER_BYTES];
        b[..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..].copy_from_slice(&(state as u64).to_le_bytes());
        self.header.write_at(0, &b).map_err(transfer("header"))
    }

    pub fn state(&self) -> State {
        let mut b = [0u8; HEADER_BYTES];
        if self.header.read_at(0, &mut b).is_err() {
            return State::Inactive;
        }
        State::from_u64(u64::from_le_bytes(b[16..].try_into().expect("8 bytes")))
            .unwrap_or(State::Inactive)
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn participant(&self) -> u32 {
        self.participant
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Drops the current buffers and allocates zeroed ones for every fragment of the
    /// participant: a new generation, inactive. Returns the generation.
    pub fn allocate(&mut self) -> Result<u64> {
        self.generation += 1;
        self.write_header(State::Inactive)?;
        for (_, b, _) in self.buffers.drain(..) {
            let _ = self.engine.unregister(b.addr());
        }
        for (ti, t) in self.placement.tensors.iter().enumerate() {
            for (fi, f) in t.fragments.iter().enumerate() {
                if f.participant != self.participant {
                    continue;
                }
                let len = (f.elements() * t.desc.itemsize as u64) as usize;
                // Faulted in now: the first execution into this generation would otherwise
                // pay about 4 us per 4 KiB page inside the copy (12 ms for 16 MiB here).
                let opts = BufferOptions {
                    name: format!("kvfs-reshard-{}", t.desc.name),
                    populate: true,
                    ..Default::default()
                };
                let b = self.engine.alloc_buffer(len, &opts).map_err(transfer("allocate"))?;
                self.buffers.push(((ti as u32, fi as u32), b, len as u64));
            }
        }
        Ok(self.generation)
    }

    /// Marks the current generation complete (the application filled it).
    pub fn activate(&self) -> Result<()> {
        self.write_header(State::Active)
    }

    pub fn deactivate(&self) -> Result<()> {
        self.write_header(State::Inactive)
    }

    /// The buffer of fragment `fragment` of tensor `tensor` (indices in the placement).
    pub fn buffer(&self, tensor: u32, fragment: u32) -> Option<&Arc<Buffer>> {
        self.buffers.iter().find(|(k, _, _)| *k == (tensor, fragment)).map(|(_, b, _)| b)
    }

    /// Every (tensor index, fragment index, buffer) of the current generation.
    pub fn buffers(&self) -> impl Iterator<Item = (u32, u32, &Arc<Buffer>)> {
        self.buffers.iter().map(|((t, f), b, _)| (*t, *f, b))
    }

    pub fn binding(&self) -> Binding {
        Binding {
            participant: self.participant,
            placement: self.digest.clone(),
            segment: self.engine.name().to_string(),
            header_addr: self.header.addr(),
            generation: self.generation,
            fragments: self
                .buffers
                .iter()
                .map(|((t, f), b, len)| FragmentBuffer {
                    tensor: *t,
                    fragment: *f,
                    addr: b.addr(),
                    len: *len,
                })
                .collect(),
        }
    }
}

/// A plan with every region's source and target buffer resolved.
#[derive(Debug, Clone)]
pub struct BoundPlan {
    pub plan: Plan,
    /// Per source participant and per target participant: its binding.
    pub src: HashMap<u32, Binding>,
    pub dst: HashMap<u32, Binding>,
    /// Per region: (source address, target address) of the box's first byte.
    bases: Vec<(u64, u64)>,
}

fn bind_err(d: String) -> Error {
    Error::new(ErrorKind::Mismatch, "bind", d)
}

impl BoundPlan {
    /// Checks `src` and `dst` bindings against `plan` (made from `src_placement` to
    /// `dst_placement`): every region's fragments are bound, with exactly their sizes, by
    /// bindings of the plan's placements.
    pub fn new(
        plan: Plan,
        src_placement: &Placement,
        dst_placement: &Placement,
        src: &[Binding],
        dst: &[Binding],
    ) -> Result<BoundPlan> {
        if src_placement.digest() != plan.src_digest || dst_placement.digest() != plan.dst_digest {
            return Err(bind_err("the placements are not the ones the plan was made for".into()));
        }
        let index = |bs: &[Binding], digest: &str, side: &str| -> Result<HashMap<u32, Binding>> {
            let mut m = HashMap::new();
            for b in bs {
                if b.placement != digest {
                    return Err(bind_err(format!(
                        "{side} participant {} is bound to placement {}, the plan's is {digest}",
                        b.participant, b.placement
                    )));
                }
                if m.insert(b.participant, b.clone()).is_some() {
                    return Err(bind_err(format!(
                        "{side} participant {} bound twice",
                        b.participant
                    )));
                }
            }
            Ok(m)
        };
        let (sm, dm) =
            (index(src, &plan.src_digest, "source")?, index(dst, &plan.dst_digest, "target")?);
        let mut bases = Vec::with_capacity(plan.regions.len());
        for r in &plan.regions {
            let dt = &dst_placement.tensors[r.tensor as usize];
            let (si, st) = (r.src_tensor, &src_placement.tensors[r.src_tensor as usize]);
            let item = dt.desc.itemsize as u64;
            let want = |side: &str,
                        m: &HashMap<u32, Binding>,
                        p: u32,
                        t: u32,
                        f: u32,
                        bytes: u64| {
                let b = m
                    .get(&p)
                    .ok_or_else(|| bind_err(format!("{side} participant {p} is not bound")))?;
                let fb = b.find(t, f).ok_or_else(|| {
                    bind_err(format!(
                        "{side} participant {p} has no buffer for {} fragment {f}",
                        dt.desc.name
                    ))
                })?;
                if fb.len != bytes {
                    return Err(bind_err(format!(
                        "{side} participant {p}: {} fragment {f} is {} bytes, the placement says {bytes}",
                        dt.desc.name, fb.len
                    )));
                }
                Ok(fb.addr)
            };
            let sbytes = st.fragments[r.src_fragment as usize].elements() * item;
            let dbytes = dt.fragments[r.dst_fragment as usize].elements() * item;
            let s = want("source", &sm, r.src_participant, si, r.src_fragment, sbytes)?;
            let d = want("target", &dm, r.dst_participant, r.tensor, r.dst_fragment, dbytes)?;
            bases.push((s + r.src_offset, d + r.dst_offset));
        }
        Ok(BoundPlan { plan, src: sm, dst: dm, bases })
    }
}

/// The outcome of [`execute`] on one target participant.
#[derive(Debug, Clone)]
pub struct Report {
    /// (region index, its outcome) for every region this participant received.
    pub regions: Vec<(usize, Result<()>)>,
    pub bytes: u64,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.regions.iter().all(|(_, r)| r.is_ok())
    }

    pub fn first_error(&self) -> Option<&Error> {
        self.regions.iter().find_map(|(_, r)| r.as_ref().err())
    }
}

struct Header {
    generation: u64,
    state: Option<State>,
}

async fn read_header(
    engine: &Engine,
    seg: &SegmentHandle,
    addr: u64,
    scratch: &Buffer,
) -> Result<Header> {
    let req = TransferRequest {
        op: TransferOp::Read,
        segment: seg.clone(),
        local_addr: scratch.addr(),
        remote_addr: addr,
        len: HEADER_BYTES as u64,
    };
    engine.transfer_one(&req).await.map_err(transfer("read header"))?;
    let mut b = [0u8; HEADER_BYTES];
    scratch.read_at(0, &mut b).map_err(transfer("read header"))?;
    let word = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    if word(0) != MAGIC {
        return Err(Error::new(
            ErrorKind::Mismatch,
            "read header",
            format!("no reshard header at {addr:#x} of {}", seg.name()),
        ));
    }
    Ok(Header { generation: word(1), state: State::from_u64(word(2)) })
}

/// Runs the regions `holder`'s participant receives. `holder` must hold the plan's target
/// placement at the bound generation. The holder is left filling; [`commit`] decides.
pub async fn execute(holder: &Holder, bound: &BoundPlan) -> Result<Report> {
    let me = holder.participant;
    let mine = bound
        .dst
        .get(&me)
        .ok_or_else(|| bind_err(format!("target participant {me} is not bound")))?;
    if holder.digest != bound.plan.dst_digest || mine.generation != holder.generation {
        return Err(Error::new(
            ErrorKind::StaleGeneration,
            "execute",
            format!(
                "the plan is bound to generation {} of placement {}, this holder has generation {} of {}",
                mine.generation, bound.plan.dst_digest, holder.generation, holder.digest
            ),
        ));
    }
    holder.write_header(State::Filling)?;
    let engine = &holder.engine;
    let regions: Vec<usize> = (0..bound.plan.regions.len())
        .filter(|&i| bound.plan.regions[i].dst_participant == me)
        .collect();
    let opts = BufferOptions { huge_pages: false, shareable: false, ..Default::default() };
    let scratch = Arc::new(Buffer::new(HEADER_BYTES, &opts).map_err(transfer("execute"))?);
    engine.register_buffer(scratch.clone(), false).map_err(transfer("execute"))?;
    let result = run(engine, bound, &regions, &scratch).await;
    let _ = engine.unregister(scratch.addr());
    result
}

async fn run(
    engine: &Engine,
    bound: &BoundPlan,
    regions: &[usize],
    scratch: &Buffer,
) -> Result<Report> {
    // Open and check every source this participant reads from.
    let mut segs: HashMap<u32, std::result::Result<SegmentHandle, Error>> = HashMap::new();
    for &i in regions {
        let p = bound.plan.regions[i].src_participant;
        if segs.contains_key(&p) {
            continue;
        }
        let b = &bound.src[&p];
        let seg = match engine.open_segment(&b.segment).await {
            Ok(s) => check_source(engine, &s, b, scratch).await.map(|_| s),
            Err(e) => Err(Error::transfer("open source", e)),
        };
        segs.insert(p, seg);
    }
    let mut outcome: HashMap<usize, Result<()>> = HashMap::new();
    let mut reqs = Vec::new();
    let mut owner = Vec::new();
    let mut bytes = 0;
    for &i in regions {
        let r = &bound.plan.regions[i];
        let seg = match &segs[&r.src_participant] {
            Ok(s) => s,
            Err(e) => {
                outcome.insert(i, Err(e.clone()));
                continue;
            }
        };
        let (sb, db) = bound.bases[i];
        let (s0, d0) = (r.src_offset, r.dst_offset);
        r.for_each_segment(|s, d, len| {
            reqs.push(TransferRequest {
                op: TransferOp::Read,
                segment: seg.clone(),
                local_addr: db + (d - d0),
                remote_addr: sb + (s - s0),
                len,
            });
            owner.push(i);
        });
        bytes += r.bytes();
        outcome.insert(i, Ok(()));
    }
    let max = engine.config().batch_items_max.max(1);
    let mut at = 0;
    while at < reqs.len() {
        let end = (at + max).min(reqs.len());
        let results = engine.transfer(reqs[at..end].to_vec()).await.map_err(transfer("execute"))?;
        for (k, res) in results.into_iter().enumerate() {
            if let Err(e) = res {
                let slot = outcome.get_mut(&owner[at + k]).expect("region");
                if slot.is_ok() {
                    *slot = Err(Error::transfer("execute", e));
                }
            }
        }
        at = end;
    }
    // A source that changed generation while we read it may have served torn bytes.
    for (p, seg) in &segs {
        let Ok(seg) = seg else { continue };
        if let Err(e) = check_source(engine, seg, &bound.src[p], scratch).await {
            for &i in regions {
                if bound.plan.regions[i].src_participant == *p {
                    outcome.insert(i, Err(e.clone()));
                }
            }
        }
    }
    let mut regions: Vec<(usize, Result<()>)> = outcome.into_iter().collect();
    regions.sort_by_key(|(i, _)| *i);
    Ok(Report { regions, bytes })
}

async fn check_source(
    engine: &Engine,
    seg: &SegmentHandle,
    b: &Binding,
    scratch: &Buffer,
) -> Result<()> {
    let h = read_header(engine, seg, b.header_addr, scratch).await?;
    if h.generation != b.generation || h.state != Some(State::Active) {
        return Err(Error::new(
            ErrorKind::StaleGeneration,
            "execute",
            format!(
                "source participant {} ({}) is at generation {} ({:?}), the plan is bound to {} (Active)",
                b.participant, b.segment, h.generation, h.state, b.generation
            ),
        ));
    }
    Ok(())
}

/// Agrees over `group` whether every member's execution succeeded (`ok`: this member's
/// regions all did, or it received none); activates `holder`'s generation only if every slot
/// in `members` (the plan's processes) voted yes, and leaves it inactive otherwise: a member
/// that died before or during the vote is missing from it. Every member calls it.
pub async fn commit(
    group: &kvfs_pg::Group,
    holder: Option<&Holder>,
    ok: bool,
    members: &[u32],
) -> Result<()> {
    let vote = [ok as u8];
    let agreed = group
        .alltoallv_with(|slots: &[u32]| (vec![vote[0]; slots.len()], vec![1; slots.len()]))
        .await;
    let outcome = match agreed {
        Err(e) => Err(Error::pg("commit", e)),
        Ok((slots, votes, _)) => {
            let missing: Vec<u32> =
                members.iter().copied().filter(|m| !slots.contains(m)).collect();
            let no: Vec<u32> =
                slots.iter().zip(&votes).filter(|(_, v)| **v == 0).map(|(s, _)| *s).collect();
            if !missing.is_empty() {
                Err(Error::new(
                    ErrorKind::PeerFailed,
                    "commit",
                    format!("participants {missing:?} left the group before voting"),
                ))
            } else if !no.is_empty() {
                Err(Error::new(
                    ErrorKind::PeerFailed,
                    "commit",
                    format!("the regions of participants {no:?} failed"),
                ))
            } else {
                Ok(())
            }
        }
    };
    if let Some(h) = holder {
        h.write_header(if outcome.is_ok() { State::Active } else { State::Inactive })?;
    }
    outcome
}
