//! What members and the coordinator say to each other: Transfer Engine notifications whose
//! bodies are postcard-encoded [`Msg`]s. Bulk data never travels here except for small
//! operations (inline bodies up to `PgConfig::inline_bytes_max`); large data moves by
//! Transfer Engine reads from the exposing rank's staging buffer.

use serde::{Deserialize, Serialize};

/// Version of these messages; a join from another version is refused.
pub const PROTOCOL: u16 = 1;

/// Where a member is and what it exposes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub slot: u32,
    /// Transfer Engine segment name of the member's engine.
    pub segment: String,
    /// Addresses of its two staging halves, each `staging_bytes` long.
    pub staging: [u64; 2],
    pub staging_bytes: u64,
    /// Addresses of its two inbox halves (allreduce's reduce-scatter writes land there),
    /// each `inbox_bytes` long.
    pub inbox: [u64; 2],
    pub inbox_bytes: u64,
    /// Random per process: a replacement in the same slot is a different incarnation.
    pub incarnation: u64,
}

/// How survivors settle an operation a failure interrupted (see `group.rs`, "Reconciliation").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    /// The most operations any survivor finished in the old epoch.
    pub finished: u64,
    /// Whether survivors interrupted in operation `finished` run it again in the new epoch
    /// (false when one of them had already written part of its output: then all fail it).
    pub restart: bool,
}

/// The group as the coordinator last decided it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub group: String,
    pub epoch: u64,
    /// Number of slots the group addresses (the world size ranks see); slots not in
    /// `members` are inactive holes, never renumbered.
    pub world: u32,
    /// Active members, sorted by slot.
    pub members: Vec<MemberInfo>,
    /// Slots that failed or left since the previous epoch, with the evidence.
    pub removed: Vec<(u32, String)>,
    /// Set when this epoch follows a failure that may have interrupted an operation.
    pub resume: Option<Resume>,
    /// Set when a member left gracefully after finishing this many operations of the previous
    /// epoch: members run operations before that index in the previous epoch (the leaver took
    /// part in them) and the view takes effect from that operation on.
    pub switch_at: Option<u64>,
    /// How long a member may complete operations after its last confirmed `Check` was sent
    /// (below the coordinator's failure timeout, so a member the coordinator has given up on
    /// has stopped completing operations by then).
    pub lease_ms: u64,
}

impl View {
    pub fn slots(&self) -> Vec<u32> {
        self.members.iter().map(|m| m.slot).collect()
    }

    pub fn member(&self, slot: u32) -> Option<&MemberInfo> {
        self.members.iter().find(|m| m.slot == slot)
    }
}

/// One notification body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// Member to coordinator: take me into `slot` (the initial formation of `world` slots, or
    /// a replacement or newcomer waiting for an `activate`).
    Join { protocol: u16, group: String, world: u32, member: MemberInfo },
    /// Coordinator to a joiner: refused, with the reason.
    JoinRefused { reason: String },
    /// Coordinator to a joiner: recorded, waiting for the active members to activate the slot.
    JoinPending { epoch: u64 },
    /// Coordinator to members: the group's new view.
    View(View),
    /// Member to coordinator: `slot` looks dead (a failed transfer, or silence past the
    /// suspicion time), with the evidence. The coordinator checks before it acts.
    Suspect { epoch: u64, slot: u32, evidence: String },
    /// Coordinator to survivors: stop finishing operations of older epochs and say how far
    /// you got; `epoch` is the epoch that will follow.
    Freeze { epoch: u64, removed: Vec<(u32, String)> },
    /// Survivor to coordinator, answering `Freeze`.
    Progress { epoch: u64, finished: u64, in_op: bool, dirty: bool },
    /// Member to coordinator: the active members' collective request to change the view
    /// (every active member sends the same one; the change happens when all have).
    Change { epoch: u64, activate: Vec<u32>, deactivate: Vec<u32> },
    /// Coordinator to members: the change request failed (the detail says why).
    ChangeRefused { epoch: u64, reason: String },
    /// Member to coordinator: am I still a member? (`nonce` pairs the answer.)
    Check { epoch: u64, nonce: u64 },
    /// Coordinator to member: yes, at `epoch`.
    Checked { epoch: u64, nonce: u64 },
    /// Member to coordinator: which slots have a process waiting for activation?
    Pending { nonce: u64 },
    /// Coordinator to member: these.
    PendingSlots { nonce: u64, slots: Vec<u32> },
    /// Member to coordinator: I am closing, having finished `finished` operations of `epoch`
    /// (so a survivor still inside one of them fails it rather than running it again alone).
    Leave { epoch: u64, finished: u64 },
    /// Member to member: one step of a collective.
    Data { epoch: u64, seq: u64, phase: u32, from: u32, sig: u64, body: Vec<u8> },
    /// Member to member: point-to-point traffic.
    P2p { epoch: u64, from: u32, tag: u32, pseq: u64, kind: P2pKind },
    /// Anyone to a sender: your message was from epoch `sent`, older than mine (`current`).
    Stale { sent: u64, current: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum P2pKind {
    /// A whole small message.
    Inline(Vec<u8>),
    /// Part `part` of a large message (`total` bytes) waits in the sender's p2p staging at
    /// `addr`, `len` bytes.
    Ready { total: u64, part: u32, addr: u64, len: u64 },
    /// Receiver to sender: part `part` was read; the staging may be reused.
    Done { part: u32 },
}

pub fn encode(msg: &Msg) -> Vec<u8> {
    postcard::to_stdvec(msg).expect("messages always encode")
}

pub fn decode(bytes: &[u8]) -> Option<Msg> {
    postcard::from_bytes(bytes).ok()
}
