//! The filled directories that the memory test, the directory bench and the `directory_timing`
//! example measure: nodes with one DRAM segment each, and 64 KiB objects under keys of 64..100
//! bytes. Included with `#[path]` (a test, a bench and an example cannot share a module any
//! other way); each includer uses what it needs.
#![allow(dead_code)]

use kvfs_master::*;

/// The key of object `i`: a prefix of 0..37 bytes of a model path, then 64 hex digits.
pub fn key(i: u64) -> String {
    let prefix = &"model/tp0/rank1/layer-group-7/pp3/xyz"[..(i % 37) as usize];
    format!("{prefix}{:064x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// An empty directory with nodes `1..=nodes`, each with one DRAM segment of 2^46 bytes.
pub fn with_nodes(nodes: u64) -> Directory {
    let mut dir = Directory::new(Config::default()).expect("default config");
    let mut fx = Vec::new();
    for node in 1..=nodes {
        let reg = NodeRegistration {
            node: NodeId(node),
            host: format!("h{node}"),
            endpoint: String::new(),
            segments: vec![SegmentSpec {
                index: 0,
                tier: Tier::Dram,
                base_addr: 0,
                capacity: 1 << 46,
            }],
            held: Vec::new(),
        };
        dir.register_node(&reg, 0, &mut fx).expect("register");
    }
    dir
}

/// Puts and completes objects `ids` (64 KiB each, with a checksum) under [`key`].
pub fn fill(dir: &mut Directory, ids: std::ops::Range<u64>) {
    let mut fx = Vec::new();
    for i in ids {
        let key = key(i);
        dir.put_start(&PutStart::new(key.as_str(), 64 << 10), 0, &mut fx).expect("put_start");
        dir.put_end(&PutEnd::new(key, Some([1; 32])), 0, &mut fx).expect("put_end");
        fx.clear();
    }
}
