//! Limits and knobs of the directory, with units in their names. Every request is checked
//! against them and a violation is a typed error, never a panic.

use crate::error::{Error, ErrorKind, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Seed of the directory's RNG (random placement): the same seed and the same calls give
    /// the same decisions.
    pub seed: u64,
    pub key_len_max: usize,
    pub object_size_max: u64,
    pub replicas_max: u8,
    /// Complete + pending objects.
    pub objects_max: u64,
    /// A put not ended within this is revoked by `tick` (or by the next `put_start` of its key).
    pub put_timeout_ms: u64,
    /// Read lease granted by `get` and `exists`.
    pub lease_ttl_ms: u64,
    /// A node silent for longer is removed by `expire`.
    pub node_ttl_ms: u64,
    /// A node whose control connection closed gets no new replicas at once and is removed
    /// after this grace unless it registers again (a live node reconnects within its backoff).
    pub disconnect_grace_ms: u64,
    /// Replicas dropped at most per eviction pass (`evict`, or one make-room round of a put).
    pub evict_round_objects_max: usize,
    /// Replicas looked at (skipping leased ones) at most per eviction pass.
    pub evict_round_scan_max: usize,
    /// Make-room eviction rounds a `put_start` runs before answering `NoSpace`.
    pub put_evict_rounds_max: u32,
    /// Eviction starts when a tier's used bytes exceed this fraction of its capacity...
    pub evict_high_watermark: f64,
    /// ...and brings each segment it sheds from back to this fraction.
    pub evict_low_watermark: f64,
    /// Alignment of every range in every segment (4096 suits O_DIRECT on NVMe and pages).
    pub segment_align_bytes: u64,
    /// Largest page `list` / `list_dir` return.
    pub list_limit_max: usize,
    /// Segments per node.
    pub segments_per_node_max: usize,
    pub nodes_max: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            seed: 0,
            key_len_max: 4096,
            object_size_max: 4 << 30,
            replicas_max: 8,
            objects_max: 100_000_000,
            put_timeout_ms: 30_000,
            lease_ttl_ms: 10_000,
            node_ttl_ms: 10_000,
            disconnect_grace_ms: 2_000,
            evict_round_objects_max: 1024,
            evict_round_scan_max: 8192,
            put_evict_rounds_max: 3,
            evict_high_watermark: 0.95,
            evict_low_watermark: 0.90,
            segment_align_bytes: 4096,
            list_limit_max: 10_000,
            segments_per_node_max: 64,
            nodes_max: 65_536,
        }
    }
}

impl Config {
    pub fn validate(&self) -> Result<()> {
        let bad =
            |what: &str| Err(Error::new(ErrorKind::InvalidArgument, "config").with_detail(what));
        if !self.segment_align_bytes.is_power_of_two() {
            return bad("segment_align_bytes must be a power of two");
        }
        if !(0.0 < self.evict_low_watermark
            && self.evict_low_watermark <= self.evict_high_watermark
            && self.evict_high_watermark <= 1.0)
        {
            return bad("need 0 < evict_low_watermark <= evict_high_watermark <= 1");
        }
        if self.key_len_max == 0 || self.replicas_max == 0 || self.objects_max == 0 {
            return bad("key_len_max, replicas_max and objects_max must be > 0");
        }
        if self.objects_max >= 1 << 31 {
            return bad("objects_max must be < 2^31 (object ids are 31 bits)");
        }
        if self.evict_round_objects_max == 0
            || self.evict_round_scan_max == 0
            || self.list_limit_max == 0
        {
            return bad(
                "evict_round_objects_max, evict_round_scan_max, list_limit_max must be > 0",
            );
        }
        Ok(())
    }
}
