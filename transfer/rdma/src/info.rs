//! [`EndpointInfo`]: what one side of an RC connection tells the other, and its wire encoding.
//!
//! Mechanism: the engine's TCP handshake carries these bytes in both directions; each side then
//! calls `Endpoint::connect` with the peer's info. The encoding is fixed, little-endian and
//! versioned, so two kvfs builds of different ages can tell that they disagree instead of
//! misreading each other:
//!
//! ```text
//! offset size field
//!  0      4   magic  b"KVRQ"
//!  4      2   version (1)
//!  6      2   total length in bytes (40 for version 1)
//!  8      4   qpn                (24 bits used, not 0 or 1)
//! 12      4   psn                (24 bits used)
//! 16     16   gid                (network order, as the GID table shows it)
//! 32      2   lid                (0 on RoCE)
//! 34      1   active MTU         (ibv_mtu code: 1 = 256 ... 5 = 4096)
//! 35      1   link layer         (1 = InfiniBand, 2 = Ethernet/RoCE)
//! 36      1   responder resources (max RDMA READs this QP serves at once, >= 1)
//! 37      1   flags              (0 in version 1)
//! 38      2   reserved           (0)
//! ```
//!
//! Invariant: `from_bytes(to_bytes(x)) == x`, and `from_bytes` never panics: every field is
//! range-checked and unknown versions, flags or trailing bytes are rejected with
//! [`ErrorKind::Malformed`].
//!
//! Not handled here: authenticating the peer or checksumming (the handshake transport does
//! that), and the (addr, len, rkey) of registered buffers, which the engine sends itself.

use crate::error::{Error, ErrorKind, Result};

const MAGIC: [u8; 4] = *b"KVRQ";
const VERSION: u16 = 1;

/// Encoded size of an [`EndpointInfo`], version 1.
pub const ENDPOINT_INFO_LEN: usize = 40;

/// The path MTU of an RC connection (the RDMA payload per packet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathMtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl PathMtu {
    /// Payload bytes per packet.
    pub fn bytes(self) -> u32 {
        256 << (self.code() - 1)
    }

    /// The `ibv_mtu` code (1 ..= 5).
    pub fn code(self) -> u8 {
        match self {
            PathMtu::Mtu256 => 1,
            PathMtu::Mtu512 => 2,
            PathMtu::Mtu1024 => 3,
            PathMtu::Mtu2048 => 4,
            PathMtu::Mtu4096 => 5,
        }
    }

    /// From an `ibv_mtu` code; `None` outside 1 ..= 5.
    pub fn from_code(code: u32) -> Option<PathMtu> {
        Some(match code {
            1 => PathMtu::Mtu256,
            2 => PathMtu::Mtu512,
            3 => PathMtu::Mtu1024,
            4 => PathMtu::Mtu2048,
            5 => PathMtu::Mtu4096,
            _ => return None,
        })
    }
}

/// The link layer of a port. Two endpoints can only connect over the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID (GRH only across subnets).
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, always with a GRH.
    Ethernet,
}

impl LinkLayer {
    fn code(self) -> u8 {
        match self {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        }
    }

    fn from_code(code: u8) -> Option<LinkLayer> {
        match code {
            1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
}

/// Everything a peer needs to connect its RC QP to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EndpointInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number our send queue uses (24 bits).
    pub psn: u32,
    /// Our source GID (RoCE: the IPv4-mapped or IPv6 address of the netdev).
    pub gid: [u8; 16],
    /// Our port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Our port's active MTU; the connection uses the smaller of both sides'.
    pub mtu: PathMtu,
    /// Our port's link layer.
    pub link_layer: LinkLayer,
    /// How many RDMA READs our QP serves at once as a responder; the peer caps its
    /// outstanding reads at this.
    pub responder_resources: u8,
}

impl EndpointInfo {
    /// Encodes into the fixed version-1 layout.
    pub fn to_bytes(&self) -> [u8; ENDPOINT_INFO_LEN] {
        let mut b = [0u8; ENDPOINT_INFO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(ENDPOINT_INFO_LEN as u16).to_le_bytes());
        b[8..12].copy_from_slice(&self.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32..34].copy_from_slice(&self.lid.to_le_bytes());
        b[34] = self.mtu.code();
        b[35] = self.link_layer.code();
        b[36] = self.responder_resources;
        b
    }

    /// Decodes and validates bytes from a peer.
    pub fn from_bytes(b: &[u8]) -> Result<EndpointInfo> {
        let bad = |what: String| Error::new(ErrorKind::Malformed, "decode endpoint info", what);
        if b.len() < 8 {
            return Err(bad(format!("{} bytes, shorter than the header", b.len())));
        }
        if b[0..4] != MAGIC {
            return Err(bad(format!("bad magic {:02x?}", &b[0..4])));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(bad(format!("version {version}, this build speaks {VERSION}")));
        }
        let len = u16::from_le_bytes([b[6], b[7]]) as usize;
        if len != ENDPOINT_INFO_LEN || b.len() != ENDPOINT_INFO_LEN {
            return Err(bad(format!(
                "length field {len}, buffer {} bytes, version 1 is {ENDPOINT_INFO_LEN}",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let qpn = u32_at(8);
        if !(2..=0x00ff_ffff).contains(&qpn) {
            return Err(bad(format!("qpn {qpn:#x} is not a 24-bit RC QP number")));
        }
        let psn = u32_at(12);
        if psn > 0x00ff_ffff {
            return Err(bad(format!("psn {psn:#x} is wider than 24 bits")));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        let lid = u16::from_le_bytes([b[32], b[33]]);
        let mtu = PathMtu::from_code(b[34] as u32)
            .ok_or_else(|| bad(format!("mtu code {} outside 1..=5", b[34])))?;
        let link_layer = LinkLayer::from_code(b[35])
            .ok_or_else(|| bad(format!("link layer code {} unknown", b[35])))?;
        let responder_resources = b[36];
        if responder_resources == 0 {
            return Err(bad("responder resources 0: the peer could serve no RDMA READ".into()));
        }
        if b[37] != 0 || b[38] != 0 || b[39] != 0 {
            return Err(bad(format!("flags/reserved bytes {:02x?} are not zero", &b[37..40])));
        }
        if link_layer == LinkLayer::Ethernet && gid == [0u8; 16] {
            return Err(bad("RoCE endpoint with an all-zero GID".into()));
        }
        Ok(EndpointInfo { qpn, psn, gid, lid, mtu, link_layer, responder_resources })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> EndpointInfo {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[127, 0, 0, 1]);
        EndpointInfo {
            qpn: 0x11,
            psn: 0xabcdef,
            gid,
            lid: 0,
            mtu: PathMtu::Mtu4096,
            link_layer: LinkLayer::Ethernet,
            responder_resources: 16,
        }
    }

    #[test]
    fn round_trips() {
        let info = sample();
        let bytes = info.to_bytes();
        assert_eq!(&bytes[0..4], b"KVRQ");
        assert_eq!(EndpointInfo::from_bytes(&bytes).unwrap(), info);
    }

    #[test]
    fn layout_is_fixed_little_endian() {
        let b = sample().to_bytes();
        assert_eq!(b[4..8], [1, 0, 40, 0]);
        assert_eq!(b[8..12], [0x11, 0, 0, 0]);
        assert_eq!(b[12..16], [0xef, 0xcd, 0xab, 0]);
        assert_eq!(b[28..32], [127, 0, 0, 1]);
        assert_eq!(b[34..37], [5, 2, 16]);
    }

    #[test]
    fn rejects_malformed_bytes() {
        let good = sample().to_bytes();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("truncated", good[..39].to_vec()),
            ("trailing byte", [&good[..], &[0]].concat()),
            ("bad magic", {
                let mut b = good.to_vec();
                b[0] = b'X';
                b
            }),
            ("version 2", {
                let mut b = good.to_vec();
                b[4] = 2;
                b
            }),
            ("length field", {
                let mut b = good.to_vec();
                b[6] = 41;
                b
            }),
            ("qpn 0", {
                let mut b = good.to_vec();
                b[8..12].copy_from_slice(&[0; 4]);
                b
            }),
            ("qpn 25 bits", {
                let mut b = good.to_vec();
                b[11] = 1;
                b
            }),
            ("psn 25 bits", {
                let mut b = good.to_vec();
                b[15] = 1;
                b
            }),
            ("mtu 0", {
                let mut b = good.to_vec();
                b[34] = 0;
                b
            }),
            ("mtu 6", {
                let mut b = good.to_vec();
                b[34] = 6;
                b
            }),
            ("link layer 3", {
                let mut b = good.to_vec();
                b[35] = 3;
                b
            }),
            ("no responder resources", {
                let mut b = good.to_vec();
                b[36] = 0;
                b
            }),
            ("flags", {
                let mut b = good.to_vec();
                b[37] = 1;
                b
            }),
            ("reserved", {
                let mut b = good.to_vec();
                b[39] = 1;
                b
            }),
            ("zero RoCE gid", {
                let mut b = good.to_vec();
                b[16..32].fill(0);
                b
            }),
        ];
        for (what, bytes) in cases {
            let err = EndpointInfo::from_bytes(&bytes).expect_err(what);
            assert_eq!(err.kind(), ErrorKind::Malformed, "{what}: {err}");
        }
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(PathMtu::Mtu256.bytes(), 256);
        assert_eq!(PathMtu::Mtu4096.bytes(), 4096);
        for code in 1..=5 {
            assert_eq!(PathMtu::from_code(code).unwrap().code() as u32, code);
        }
        assert_eq!(PathMtu::from_code(0), None);
        assert!(PathMtu::Mtu1024 < PathMtu::Mtu4096);
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = EndpointInfo::from_bytes(&bytes);
        }

        #[test]
        fn decoding_a_corrupted_header_fails(pos in 0usize..8, flip in 1u8..=255) {
            let mut b = sample().to_bytes();
            b[pos] ^= flip;
            prop_assert!(EndpointInfo::from_bytes(&b).is_err());
        }

        #[test]
        fn every_valid_info_round_trips(
            qpn in 2u32..=0xff_ffff, psn in 0u32..=0xff_ffff, gid in any::<[u8; 16]>(),
            lid in any::<u16>(), mtu in 1u32..=5, ib in any::<bool>(), rr in 1u8..=255,
        ) {
            let info = EndpointInfo {
                qpn, psn, gid, lid, mtu: PathMtu::from_code(mtu).unwrap(),
                link_layer: if ib { LinkLayer::InfiniBand } else { LinkLayer::Ethernet },
                responder_resources: rr,
            };
            let decoded = EndpointInfo::from_bytes(&info.to_bytes());
            if !ib && gid == [0u8; 16] {
                prop_assert!(decoded.is_err());
            } else {
                prop_assert_eq!(decoded.unwrap(), info);
            }
        }
    }
}
