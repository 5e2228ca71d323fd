//! Conversions between the directory's types and the wire types of `kvfs_proto::store`.
//! Kept in one place so the directory stays free of serialization and the wire free of logic.

use kvfs_proto::store as w;

use crate::{
    Directory, Error, ErrorKind, HeldObject, Location, NodeId, NodeRegistration, ObjectView,
    Persistence, Pin, Replica, SegmentSpec, Strategy, Tier,
};

pub fn tier(t: Tier) -> w::Tier {
    match t {
        Tier::Hbm => w::Tier::Hbm,
        Tier::Dram => w::Tier::Dram,
        Tier::Nvme => w::Tier::Nvme,
        Tier::ObjectStore => w::Tier::ObjectStore,
    }
}

pub fn tier_in(t: w::Tier) -> Tier {
    match t {
        w::Tier::Hbm => Tier::Hbm,
        w::Tier::Dram => Tier::Dram,
        w::Tier::Nvme => Tier::Nvme,
        w::Tier::ObjectStore => Tier::ObjectStore,
    }
}

pub fn persistence(p: Persistence) -> w::Persistence {
    match p {
        Persistence::None => w::Persistence::None,
        Persistence::Lazy => w::Persistence::Lazy,
        Persistence::Eager => w::Persistence::Eager,
    }
}

pub fn persistence_in(p: w::Persistence) -> Persistence {
    match p {
        w::Persistence::None => Persistence::None,
        w::Persistence::Lazy => Persistence::Lazy,
        w::Persistence::Eager => Persistence::Eager,
    }
}

pub fn pin(p: Pin) -> w::Pin {
    match p {
        Pin::None => w::Pin::None,
        Pin::Soft => w::Pin::Soft,
        Pin::Hard => w::Pin::Hard,
    }
}

pub fn pin_in(p: w::Pin) -> Pin {
    match p {
        w::Pin::None => Pin::None,
        w::Pin::Soft => Pin::Soft,
        w::Pin::Hard => Pin::Hard,
    }
}

pub fn strategy_in(s: w::Strategy) -> Strategy {
    match s {
        w::Strategy::Random => Strategy::Random,
        w::Strategy::FreeRatioFirst => Strategy::FreeRatioFirst,
        w::Strategy::LocalFirst => Strategy::LocalFirst,
    }
}

pub fn code(kind: ErrorKind) -> w::ErrorCode {
    match kind {
        ErrorKind::NotFound => w::ErrorCode::NotFound,
        ErrorKind::AlreadyExists => w::ErrorCode::AlreadyExists,
        ErrorKind::PutInProgress => w::ErrorCode::PutInProgress,
        ErrorKind::NoSpace => w::ErrorCode::NoSpace,
        ErrorKind::Leased => w::ErrorCode::Leased,
        ErrorKind::Pinned => w::ErrorCode::Pinned,
        ErrorKind::InvalidKey => w::ErrorCode::InvalidKey,
        ErrorKind::InvalidArgument => w::ErrorCode::InvalidArgument,
        ErrorKind::TooLarge => w::ErrorCode::TooLarge,
        ErrorKind::NodeUnknown => w::ErrorCode::NodeUnknown,
        ErrorKind::Conflict => w::ErrorCode::Conflict,
        ErrorKind::QuotaExceeded => w::ErrorCode::QuotaExceeded,
    }
}

pub fn error(e: &Error) -> w::WireError {
    w::WireError::new(code(e.kind()), e.to_string())
}

pub fn replica(dir: &Directory, r: &Replica) -> w::ReplicaDesc {
    match r.location {
        Location::Node(n) => {
            let (host, endpoint) = dir.node_endpoint(n.node).unwrap_or(("", ""));
            w::ReplicaDesc {
                tier: tier(n.tier),
                node: Some(n.node.0),
                endpoint: endpoint.to_string(),
                host: host.to_string(),
                segment: n.segment,
                addr: n.addr,
                len: r.len,
            }
        }
        Location::ObjectStore => w::ReplicaDesc {
            tier: w::Tier::ObjectStore,
            node: None,
            endpoint: String::new(),
            host: String::new(),
            segment: 0,
            addr: 0,
            len: r.len,
        },
    }
}

pub fn view(dir: &Directory, v: &ObjectView) -> w::ObjectView {
    w::ObjectView {
        size: v.size,
        checksum: v.checksum,
        version: v.version,
        replicas: v.replicas.iter().map(|r| replica(dir, r)).collect(),
        persistence: persistence(v.persistence),
        pin: pin(v.pin),
        lease_end_ms: v.lease_end_ms,
        lease_left_ms: v.lease_end_ms.saturating_sub(super::now_ms()),
    }
}

/// Takes the wire registration apart (its keys move: half a million of them are worth not
/// copying).
pub fn registration(r: w::NodeRegistration) -> NodeRegistration {
    NodeRegistration {
        node: NodeId(r.node),
        host: r.host,
        endpoint: r.endpoint,
        segments: r
            .segments
            .iter()
            .map(|s| SegmentSpec {
                index: s.index,
                tier: tier_in(s.tier),
                base_addr: s.base_addr,
                capacity: s.capacity,
            })
            .collect(),
        held: r
            .held
            .into_iter()
            .map(|h| HeldObject {
                key: h.key,
                size: h.size,
                checksum: h.checksum,
                version: h.version,
                segment: h.segment,
                offset: h.offset,
                tier: tier_in(h.tier),
                persistence: persistence_in(h.persistence),
                pin: pin_in(h.pin),
                persisted: h.persisted,
                renamed_from: h.renamed_from,
            })
            .collect(),
    }
}

pub fn rename_mode_in(m: w::RenameMode) -> crate::RenameMode {
    match m {
        w::RenameMode::Replace => crate::RenameMode::Replace,
        w::RenameMode::NoReplace => crate::RenameMode::NoReplace,
    }
}
