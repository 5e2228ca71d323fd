//! Transfer Engine wire types: the peer-to-peer handshake and the fixed-size data headers.
//!
//! Handshake: the connecting engine sends [`Hello`] as a frame; the accepting engine answers
//! with [`Welcome`]. Both carry the engine's name and host identity so each side can pick the
//! best transport (shm when the host matches). No metadata service is involved.
//!
//! RDMA: a `Welcome` says whether the acceptor serves RDMA (`rdma`). A connector that has RDMA
//! too then opens one more TCP connection, the *rdma control connection*, whose `Hello` carries
//! [`RdmaHello`] (the 40-byte `EndpointInfo` of a queue pair created for this peer); the
//! acceptor creates its own queue pair, connects it, and answers with [`RdmaWelcome`] (its
//! `EndpointInfo` and the first chunk of its region table). The connection then carries only
//! [`RdmaRequest`] / [`RdmaRegions`] frames (table refreshes) and lives exactly as long as the
//! queue pair pair: either side closing it tears the pair down.
//!
//! Versions: postcard is not self-describing and decoders refuse trailing bytes, so any layout
//! change bumps [`TE_PROTOCOL_VERSION`]; engines of different versions fail the handshake.
//!
//! Data: after the handshake the connection carries [`DataHeader`] records from the initiator,
//! each optionally followed by `len` payload bytes (writes, notifications), and [`DataReply`]
//! records from the acceptor, each optionally followed by `len` payload bytes (successful
//! reads). Replies come back in request order on each connection.

use serde::{Deserialize, Serialize};

/// Version of the Transfer Engine protocol; peers with a different version are refused.
/// Version 2 added the rdma fields of [`Hello`] and [`Welcome`]; version 6 `WriteNoted`;
/// version 7 `ReadGuardedV`.
pub const TE_PROTOCOL_VERSION: u32 = 7;

/// Largest handshake frame accepted.
pub const HANDSHAKE_FRAME_MAX: usize = 1 << 20;

/// First frame on every engine-to-engine TCP connection, sent by the connecting side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    /// Segment name of the connecting engine.
    pub name: String,
    /// Identity of the connecting engine's host (see `kvfs_transfer::host_id`).
    pub host_id: String,
    /// Set only on an rdma control connection (see the module notes).
    pub rdma: Option<RdmaHello>,
}

/// Answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub version: u32,
    /// Segment name of the accepting engine.
    pub name: String,
    pub host_id: String,
    /// Random number drawn when the engine started: a peer that restarted at the same address
    /// is a different segment, and transfers opened against the old one must fail.
    pub instance: u64,
    /// Abstract Unix socket name (without the leading NUL) where the engine shares its
    /// memfd-backed buffers with engines on the same host; `None` when it does not.
    pub shm_socket: Option<String>,
    /// Set when the engine refuses the connection (version mismatch, overload).
    pub refused: Option<String>,
    /// The engine has an RDMA device and accepts rdma control connections.
    pub rdma: bool,
    /// The answer to a [`Hello`] carrying [`RdmaHello`] (unless refused).
    pub rdma_endpoint: Option<RdmaWelcome>,
    /// Start of the lowest remotely accessible region the engine had registered when it
    /// answered (0: none), the reference's `get_first_buffer_address`.
    pub first_buffer_addr: u64,
}

/// Length of an encoded `kvfs_rdma::EndpointInfo` (version 1).
pub const RDMA_ENDPOINT_INFO_LEN: usize = 40;

/// Most regions in one [`RdmaRegions`] message (about 26 bytes each, well under
/// [`HANDSHAKE_FRAME_MAX`]).
pub const RDMA_REGIONS_PER_MESSAGE_MAX: usize = 16_384;

/// The connector's half of an rdma control connection handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaHello {
    /// `EndpointInfo::to_bytes()` of the queue pair the connector created for this peer
    /// ([`RDMA_ENDPOINT_INFO_LEN`] bytes; validated by `EndpointInfo::from_bytes`).
    pub endpoint: Vec<u8>,
}

/// The acceptor's half of an rdma control connection handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaWelcome {
    /// `EndpointInfo::to_bytes()` of the acceptor's queue pair, already connected to the
    /// connector's.
    pub endpoint: Vec<u8>,
    /// The first chunk of the acceptor's remotely accessible regions.
    pub regions: RdmaRegions,
}

/// One remotely accessible region as RDMA sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegion {
    /// Start address in the owner's address space (what requests name).
    pub addr: u64,
    pub len: u64,
    /// The region's remote key; `None` when the owner could not register it with its NIC
    /// (requests for it go over tcp).
    pub rkey: Option<u32>,
}

/// Request on an rdma control connection after its handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RdmaRequest {
    /// Ask for the remotely accessible regions from index `start` on (answered by
    /// [`RdmaRegions`], at most [`RDMA_REGIONS_PER_MESSAGE_MAX`] of them).
    Regions { start: u32 },
}

/// A chunk of an engine's region table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegions {
    pub regions: Vec<RdmaRegion>,
    /// More regions exist past this chunk: ask again with `start` advanced.
    pub more: bool,
}

/// Request on the shm side channel (a Unix socket between engines of one host).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShmRequest {
    /// Ask for the shareable buffers from index `start` on; the answer ([`ShmBuffers`]) carries
    /// one fd per buffer (SCM_RIGHTS), at most [`SHM_FDS_PER_MESSAGE_MAX`] of them.
    Buffers { start: u32 },
}

/// One shareable buffer, in the order of the file descriptors that travel with the message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmBufferDesc {
    /// Address of the buffer in the owner's address space (what remote requests name).
    pub addr: u64,
    pub len: u64,
}

/// Answer to [`ShmRequest::Buffers`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmBuffers {
    pub buffers: Vec<ShmBufferDesc>,
    /// More buffers exist past this chunk: ask again with `start` advanced.
    pub more: bool,
}

/// Most file descriptors passed in one message (the kernel's SCM_MAX_FD is 253).
pub const SHM_FDS_PER_MESSAGE_MAX: usize = 200;

/// Operation of a data request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DataOp {
    /// Payload of `len` bytes follows; store it at `addr` in the acceptor's memory.
    Write = 1,
    /// Send back `len` bytes from `addr` in the acceptor's memory.
    Read = 2,
    /// Payload of `len` bytes follows; deliver it as a notification.
    Notify = 3,
    /// No payload; answered at once (liveness probe).
    Ping = 4,
    /// Several reads in one request: a table of `ranges` (addr, len) entries follows the
    /// header; the reply carries one status byte per range, then the bytes of every range
    /// whose status is `Ok`, in table order.
    ReadV = 5,
    /// Several writes in one request: the range table, then the payload of every range in
    /// table order; the reply carries one status byte per range.
    WriteV = 6,
    /// A read the acceptor first checks: a guard of `ranges` bytes follows the header, and
    /// the acceptor's owner says whether `[addr, addr+len)` still holds what the guard names;
    /// if not the reply is `Stale` with no payload. The engine never interprets the guard (the
    /// store passes an object's key and version).
    ReadGuarded = 7,
    /// A write the acceptor's owner is told of: a note of `ranges` bytes follows the header,
    /// then `len` payload bytes stored at `addr`; once they are in place the acceptor hands
    /// the range and the note to its owner before it answers, and answers `Stale` if the owner
    /// refuses the note (the bytes are written either way). The engine never interprets the
    /// note (the store passes the commit record of the object written, so a put needs no
    /// separate commit round trip).
    WriteNoted = 8,
    /// Several guarded reads in one request: the range table of `ranges` entries, then one
    /// guard per range in table order (a u16 little-endian length, then that many bytes, at
    /// most [`GUARD_BYTES_MAX`]); the reply is a `ReadV`'s, with `Stale` for every range whose
    /// guard the acceptor's owner no longer vouches for (a batch get of many objects whose
    /// locations the reader cached goes as one request per pack instead of one per object).
    ReadGuardedV = 9,
}

/// Largest guard a `ReadGuarded` request, or note a `WriteNoted` request, may carry.
pub const GUARD_BYTES_MAX: u32 = 4096;

/// Encodes the guard table of a `ReadGuardedV` request; `None` when a guard is longer than
/// [`GUARD_BYTES_MAX`].
pub fn encode_guards<'a>(guards: impl Iterator<Item = &'a [u8]>) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for g in guards {
        if g.len() > GUARD_BYTES_MAX as usize {
            return None;
        }
        out.extend_from_slice(&(g.len() as u16).to_le_bytes());
        out.extend_from_slice(g);
    }
    Some(out)
}

/// Bytes of one entry of a ReadV/WriteV range table: `addr` u64 and `len` u64, little endian.
pub const RANGE_ENTRY_BYTES: usize = 16;

/// Most ranges one ReadV/WriteV request may carry.
pub const RANGES_PER_REQUEST_MAX: u32 = 1024;

/// Encodes a range table.
pub fn encode_ranges(ranges: impl Iterator<Item = (u64, u64)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (addr, len) in ranges {
        out.extend_from_slice(&addr.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
    }
    out
}

/// Decodes a range table of exactly `bytes.len() / RANGE_ENTRY_BYTES` entries.
pub fn decode_ranges(bytes: &[u8]) -> Result<Vec<(u64, u64)>, WireError> {
    if !bytes.len().is_multiple_of(RANGE_ENTRY_BYTES) {
        return Err(WireError::BadRanges);
    }
    Ok(bytes
        .chunks_exact(RANGE_ENTRY_BYTES)
        .map(|c| (u64::from_le_bytes(take8(c, 0)), u64::from_le_bytes(take8(c, 8))))
        .collect())
}

impl DataOp {
    /// Whether the header is followed by a range table ([`DataHeader::ranges`] entries).
    pub fn is_pack(self) -> bool {
        matches!(self, DataOp::ReadV | DataOp::WriteV | DataOp::ReadGuardedV)
    }

    /// Whether the header is followed by opaque owner bytes (a guard or a note) counted in
    /// [`DataHeader::ranges`].
    pub fn carries_note(self) -> bool {
        matches!(self, DataOp::ReadGuarded | DataOp::WriteNoted)
    }

    /// How many ops there are.
    pub const COUNT: usize = 9;

    /// Every op, in wire-code order.
    pub const ALL: [DataOp; DataOp::COUNT] = [
        DataOp::Write,
        DataOp::Read,
        DataOp::Notify,
        DataOp::Ping,
        DataOp::ReadV,
        DataOp::WriteV,
        DataOp::ReadGuarded,
        DataOp::WriteNoted,
        DataOp::ReadGuardedV,
    ];

    /// The op's place in [`DataOp::ALL`] (its wire code - 1), for tables kept per op.
    pub fn index(self) -> usize {
        self as usize - 1
    }

    /// The op's name in metrics labels (`read_guarded_v`).
    pub fn label(self) -> &'static str {
        match self {
            DataOp::Write => "write",
            DataOp::Read => "read",
            DataOp::Notify => "notify",
            DataOp::Ping => "ping",
            DataOp::ReadV => "read_v",
            DataOp::WriteV => "write_v",
            DataOp::ReadGuarded => "read_guarded",
            DataOp::WriteNoted => "write_noted",
            DataOp::ReadGuardedV => "read_guarded_v",
        }
    }

    fn from_u8(v: u8) -> Option<DataOp> {
        // Wire codes run from 1 in the order of `ALL`.
        DataOp::ALL.get(usize::from(v).checked_sub(1)?).copied()
    }
}

/// Requests a Transfer Engine served over tcp since it started, by op: what an operator
/// reads to see how peers use a node (a batch get of cached objects arrives as a few
/// `read_guarded_v` packs, not one `read_guarded` per object). Reads and writes over shm and
/// rdma reach the memory without a request and are not counted. A node sends them with its
/// heartbeats; the master shows them in /metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ServedRequests {
    /// Indexed by [`DataOp::index`].
    by_op: [u64; DataOp::COUNT],
}

impl ServedRequests {
    pub fn new(by_op: [u64; DataOp::COUNT]) -> ServedRequests {
        ServedRequests { by_op }
    }

    pub fn get(&self, op: DataOp) -> u64 {
        self.by_op[op.index()]
    }
}

const DATA_MAGIC: u32 = 0x4b56_5445; // "KVTE"
const REPLY_MAGIC: u32 = 0x4b56_5452; // "KVTR"

/// Fixed 40-byte request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub op: DataOp,
    pub id: u64,
    pub addr: u64,
    /// Payload bytes that follow (writes, notifications) or are asked for (reads); for
    /// ReadV/WriteV/ReadGuardedV the sum of the ranges' lengths.
    pub len: u64,
    /// Entries in the range table that follows a ReadV/WriteV/ReadGuardedV header, bytes of the guard or
    /// note that follows a ReadGuarded or WriteNoted header (0 otherwise).
    pub ranges: u32,
    /// How long the caller sat idle between the reply to its last request on this connection
    /// and this request, in microseconds (saturating), where it knows: the serving side polls
    /// for the next request only for a caller that comes back promptly, and this is that
    /// promptness as the caller saw it, without the serving side's own wake-up in it. `None`
    /// (a first request, or a sender that does not say) leaves the serving side to its own
    /// clock.
    pub idle_us: Option<u32>,
}

/// Flag bit of a request header's byte 5: `idle_us` is given (in bytes 36..40).
const HEADER_IDLE_GIVEN: u8 = 1;

impl DataHeader {
    pub const SIZE: usize = 40;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&DATA_MAGIC.to_le_bytes());
        b[4] = self.op as u8;
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.ranges.to_le_bytes());
        if let Some(us) = self.idle_us {
            b[5] |= HEADER_IDLE_GIVEN;
            b[36..40].copy_from_slice(&us.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<DataHeader, WireError> {
        let magic = u32::from_le_bytes(take4(b, 0));
        if magic != DATA_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let op = DataOp::from_u8(b[4]).ok_or(WireError::BadOp(b[4]))?;
        Ok(DataHeader {
            op,
            id: u64::from_le_bytes(take8(b, 8)),
            addr: u64::from_le_bytes(take8(b, 16)),
            len: u64::from_le_bytes(take8(b, 24)),
            ranges: u32::from_le_bytes(take4(b, 32)),
            idle_us: (b[5] & HEADER_IDLE_GIVEN != 0).then(|| u32::from_le_bytes(take4(b, 36))),
        })
    }
}

/// Outcome code of a data request, as the acceptor reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum DataStatus {
    Ok = 0,
    /// The range is not inside one buffer the acceptor registered as remotely accessible.
    OutOfRange = 1,
    InvalidArgument = 2,
    /// The acceptor's bounded notification queue is full.
    Busy = 3,
    TooLarge = 4,
    /// A guarded read whose guard the acceptor's owner no longer vouches for, or a noted
    /// write whose note it refused.
    Stale = 5,
}

impl DataStatus {
    /// The status with this code (also the one-byte per-range codes of a pack reply).
    pub fn from_code(v: u16) -> Option<DataStatus> {
        DataStatus::from_u16(v)
    }

    fn from_u16(v: u16) -> Option<DataStatus> {
        Some(match v {
            0 => DataStatus::Ok,
            1 => DataStatus::OutOfRange,
            2 => DataStatus::InvalidArgument,
            3 => DataStatus::Busy,
            4 => DataStatus::TooLarge,
            5 => DataStatus::Stale,
            _ => return None,
        })
    }
}

/// Fixed 24-byte reply header; a successful read is followed by `len` payload bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataReply {
    pub status: DataStatus,
    pub id: u64,
    pub len: u64,
}

impl DataReply {
    pub const SIZE: usize = 24;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<DataReply, WireError> {
        let magic = u32::from_le_bytes(take4(b, 0));
        if magic != REPLY_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let code = u16::from_le_bytes([b[4], b[5]]);
        let status = DataStatus::from_u16(code).ok_or(WireError::BadStatus(code))?;
        Ok(DataReply {
            status,
            id: u64::from_le_bytes(take8(b, 8)),
            len: u64::from_le_bytes(take8(b, 16)),
        })
    }
}

/// A data header that cannot be decoded: the stream is out of sync and must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic number {0:#x}")]
    BadMagic(u32),
    #[error("unknown data operation {0}")]
    BadOp(u8),
    #[error("unknown status code {0}")]
    BadStatus(u16),
    #[error("malformed range table")]
    BadRanges,
}

fn take4(b: &[u8], at: usize) -> [u8; 4] {
    let mut out = [0u8; 4];
    out.copy_from_slice(&b[at..at + 4]);
    out
}

fn take8(b: &[u8], at: usize) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&b[at..at + 8]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = DataHeader {
            op: DataOp::ReadV,
            id: 42,
            addr: 0xdead_beef_0000,
            len: 1 << 26,
            ranges: 7,
            idle_us: None,
        };
        assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        for idle in [Some(0), Some(37), Some(u32::MAX)] {
            let h = DataHeader { idle_us: idle, ..h };
            assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        }
        // A header from a sender that does not say (bytes 5 and 36..40 zero) gives none.
        let mut b = DataHeader { idle_us: Some(5), ..h }.encode();
        b[5] = 0;
        assert_eq!(DataHeader::decode(&b).unwrap().idle_us, None);
        let r = DataReply { status: DataStatus::OutOfRange, id: 9, len: 0 };
        assert_eq!(DataReply::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn ops_decode_from_their_wire_codes_only() {
        for (i, op) in DataOp::ALL.into_iter().enumerate() {
            assert_eq!((op as usize, op.index()), (i + 1, i));
            assert_eq!(DataOp::from_u8(op as u8), Some(op));
        }
        assert_eq!(DataOp::from_u8(0), None);
        assert_eq!(DataOp::from_u8(DataOp::COUNT as u8 + 1), None);
    }

    #[test]
    fn guard_tables_are_length_prefixed_and_bounded() {
        let t = encode_guards([&b"ab"[..], &b""[..], &b"xyz"[..]].into_iter()).unwrap();
        assert_eq!(t, [2, 0, b'a', b'b', 0, 0, 3, 0, b'x', b'y', b'z']);
        let big = vec![7u8; GUARD_BYTES_MAX as usize];
        assert_eq!(encode_guards(std::iter::once(&big[..])).unwrap().len(), big.len() + 2);
        let huge = vec![7u8; GUARD_BYTES_MAX as usize + 1];
        assert!(encode_guards([&b"ok"[..], &huge[..]].into_iter()).is_none());
        let h = DataHeader {
            op: DataOp::ReadGuardedV,
            id: 1,
            addr: 0,
            len: 9,
            ranges: 3,
            idle_us: None,
        };
        assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        assert!(h.op.is_pack() && !h.op.carries_note());
    }

    #[test]
    fn range_tables_round_trip_and_reject_ragged_bytes() {
        let ranges = vec![(0x1000, 7), (u64::MAX - 1, 1), (42, 1 << 20)];
        let bytes = encode_ranges(ranges.iter().copied());
        assert_eq!(bytes.len(), 3 * RANGE_ENTRY_BYTES);
        assert_eq!(decode_ranges(&bytes).unwrap(), ranges);
        assert_eq!(decode_ranges(&bytes[..20]), Err(WireError::BadRanges));
    }

    fn round_trip<T>(msg: &T) -> T
    where
        T: Serialize + serde::de::DeserializeOwned,
    {
        let frame = crate::encode_frame(msg).unwrap();
        crate::decode_body(&frame[4..]).unwrap()
    }

    #[test]
    fn handshakes_round_trip_with_and_without_rdma() {
        let mut hello = Hello {
            version: TE_PROTOCOL_VERSION,
            name: "a:1".into(),
            host_id: "h".into(),
            rdma: None,
        };
        assert_eq!(round_trip(&hello), hello);
        hello.rdma = Some(RdmaHello { endpoint: (0..40).collect() });
        assert_eq!(round_trip(&hello), hello);
        let regions = RdmaRegions {
            regions: vec![
                RdmaRegion { addr: 0x7f00_0000_0000, len: 64 << 20, rkey: Some(0x1234) },
                RdmaRegion { addr: u64::MAX - 1, len: 1, rkey: None },
            ],
            more: true,
        };
        let mut welcome = Welcome {
            version: TE_PROTOCOL_VERSION,
            name: "b:2".into(),
            host_id: "h".into(),
            instance: 7,
            shm_socket: None,
            refused: None,
            rdma: true,
            rdma_endpoint: None,
            first_buffer_addr: 0x7f00_0000_0000,
        };
        assert_eq!(round_trip(&welcome), welcome);
        welcome.rdma_endpoint =
            Some(RdmaWelcome { endpoint: vec![9; 40], regions: regions.clone() });
        assert_eq!(round_trip(&welcome), welcome);
        assert_eq!(
            round_trip(&RdmaRequest::Regions { start: 16_384 }),
            RdmaRequest::Regions { start: 16_384 }
        );
        assert_eq!(round_trip(&regions), regions);
    }

    #[test]
    fn a_full_region_chunk_fits_a_handshake_frame() {
        let worst = RdmaRegion { addr: u64::MAX, len: u64::MAX, rkey: Some(u32::MAX) };
        let chunk = RdmaRegions { regions: vec![worst; RDMA_REGIONS_PER_MESSAGE_MAX], more: true };
        let welcome = Welcome {
            version: TE_PROTOCOL_VERSION,
            name: "n".repeat(255),
            host_id: "h".repeat(255),
            instance: u64::MAX,
            shm_socket: Some("s".repeat(255)),
            refused: None,
            rdma: true,
            rdma_endpoint: Some(RdmaWelcome { endpoint: vec![0xff; 40], regions: chunk }),
            first_buffer_addr: u64::MAX,
        };
        let frame = crate::encode_frame(&welcome).unwrap();
        assert!(frame.len() - 4 <= HANDSHAKE_FRAME_MAX, "{} bytes", frame.len());
    }

    #[test]
    fn a_hello_of_another_layout_is_not_misread() {
        // A version-1 Hello (no rdma field) must not decode as this version's Hello.
        let v1 = crate::encode_frame(&(1u32, "a:1".to_string(), "h".to_string())).unwrap();
        assert!(crate::decode_body::<Hello>(&v1[4..]).is_err());
    }

    #[test]
    fn corrupt_headers_are_rejected() {
        let mut b =
            DataHeader { op: DataOp::Write, id: 1, addr: 2, len: 3, ranges: 0, idle_us: None }
                .encode();
        b[4] = 99;
        assert_eq!(DataHeader::decode(&b), Err(WireError::BadOp(99)));
        b[0] = 0;
        assert!(matches!(DataHeader::decode(&b), Err(WireError::BadMagic(_))));
        let mut r = DataReply { status: DataStatus::Ok, id: 1, len: 3 }.encode();
        r[4] = 77;
        assert_eq!(DataReply::decode(&r), Err(WireError::BadStatus(77)));
    }
}
