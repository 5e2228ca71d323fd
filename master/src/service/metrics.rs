//! The master's metrics, rendered in the Prometheus text format (0.0.4) by hand: a few atomic
//! counters and fixed-bucket latency histograms need no metrics framework.
//!
//! Names follow Prometheus conventions (`_total` counters, `_seconds` histograms, base units);
//! labels are small closed sets (operation, error code, tier), so cardinality is bounded.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::Stats;

/// Operations the master counts, one label value each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Hello,
    PutStart,
    PutEnd,
    PutRevoke,
    Get,
    Exists,
    Stat,
    Remove,
    RemoveRegex,
    RemoveAll,
    List,
    ListDir,
    Stats,
    RegisterNode,
    Heartbeat,
    UnregisterNode,
    ReportReplicas,
    Promote,
    Move,
    Rename,
    Job,
}

/// Number of [`Op`]s.
const OPS: usize = 21;

impl Op {
    const ALL: [Op; OPS] = [
        Op::Hello,
        Op::PutStart,
        Op::PutEnd,
        Op::PutRevoke,
        Op::Get,
        Op::Exists,
        Op::Stat,
        Op::Remove,
        Op::RemoveRegex,
        Op::RemoveAll,
        Op::List,
        Op::ListDir,
        Op::Stats,
        Op::RegisterNode,
        Op::Heartbeat,
        Op::UnregisterNode,
        Op::ReportReplicas,
        Op::Promote,
        Op::Move,
        Op::Rename,
        Op::Job,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::PutStart => "put_start",
            Op::PutEnd => "put_end",
            Op::PutRevoke => "put_revoke",
            Op::Get => "get",
            Op::Exists => "exists",
            Op::Stat => "stat",
            Op::Remove => "remove",
            Op::RemoveRegex => "remove_regex",
            Op::RemoveAll => "remove_all",
            Op::List => "list",
            Op::ListDir => "list_dir",
            Op::Stats => "stats",
            Op::RegisterNode => "register_node",
            Op::Heartbeat => "heartbeat",
            Op::UnregisterNode => "unregister_node",
            Op::ReportReplicas => "report_replicas",
            Op::Promote => "promote",
            Op::Move => "move",
            Op::Rename => "rename",
            Op::Job => "job",
        }
    }
}

const CODES: [&str; 18] = [
    "not_found",
    "already_exists",
    "put_in_progress",
    "no_space",
    "leased",
    "pinned",
    "invalid_key",
    "invalid_argument",
    "too_large",
    "node_unknown",
    "conflict",
    "recovering",
    "version",
    "internal",
    "corrupt",
    "unavailable",
    "not_leader",
    "quota_exceeded",
];

fn code_index(code: kvfs_proto::store::ErrorCode) -> usize {
    use kvfs_proto::store::ErrorCode as C;
    match code {
        C::NotFound => 0,
        C::AlreadyExists => 1,
        C::PutInProgress => 2,
        C::NoSpace => 3,
        C::Leased => 4,
        C::Pinned => 5,
        C::InvalidKey => 6,
        C::InvalidArgument => 7,
        C::TooLarge => 8,
        C::NodeUnknown => 9,
        C::Conflict => 10,
        C::Recovering => 11,
        C::Version => 12,
        C::Internal => 13,
        C::Corrupt => 14,
        C::Unavailable => 15,
        C::NotLeader => 16,
        C::QuotaExceeded => 17,
    }
}

/// Upper bounds of the latency buckets, in microseconds.
const BUCKETS_US: [u64; 14] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000, 10_000_000,
];

#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        if let Some(i) = BUCKETS_US.iter().position(|&b| us <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }
}

/// Every counter the master keeps.
#[derive(Default)]
pub struct Metrics {
    requests: [AtomicU64; OPS],
    items: [AtomicU64; OPS],
    latency: [Histogram; OPS],
    item_errors: [AtomicU64; CODES.len()],
    pub lost_objects: AtomicU64,
    pub expired_nodes: AtomicU64,
    pub expired_puts: AtomicU64,
    pub node_call_failures: AtomicU64,
    pub recovery_conflicts: AtomicU64,
}

impl Metrics {
    pub fn request(&self, op: Op, items: usize, took: Duration) {
        let i = op as usize;
        self.requests[i].fetch_add(1, Ordering::Relaxed);
        self.items[i].fetch_add(items as u64, Ordering::Relaxed);
        self.latency[i].observe(took);
    }

    pub fn item_error(&self, code: kvfs_proto::store::ErrorCode) {
        self.item_errors[code_index(code)].fetch_add(1, Ordering::Relaxed);
    }

    /// Renders everything, with the directory's figures as gauges.
    pub fn render(&self, stats: &Stats, recovering: bool) -> String {
        let mut o = String::with_capacity(16 << 10);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        header(
            &mut o,
            "kvfs_master_requests_total",
            "counter",
            "RPC requests handled, by operation.",
        );
        for op in Op::ALL {
            let _ = writeln!(
                o,
                "kvfs_master_requests_total{{op=\"{}\"}} {}",
                op.name(),
                load(&self.requests[op as usize])
            );
        }
        header(
            &mut o,
            "kvfs_master_request_items_total",
            "counter",
            "Keys carried by requests (batches count each key).",
        );
        for op in Op::ALL {
            let _ = writeln!(
                o,
                "kvfs_master_request_items_total{{op=\"{}\"}} {}",
                op.name(),
                load(&self.items[op as usize])
            );
        }
        header(
            &mut o,
            "kvfs_master_item_errors_total",
            "counter",
            "Items answered with an error, by error code.",
        );
        for (i, code) in CODES.iter().enumerate() {
            let _ = writeln!(
                o,
                "kvfs_master_item_errors_total{{code=\"{code}\"}} {}",
                load(&self.item_errors[i])
            );
        }
        header(
            &mut o,
            "kvfs_master_request_duration_seconds",
            "histogram",
            "Time to handle a request, by operation.",
        );
        for op in Op::ALL {
            let h = &self.latency[op as usize];
            let mut cum = 0;
            for (i, b) in BUCKETS_US.iter().enumerate() {
                cum += load(&h.buckets[i]);
                let le = *b as f64 / 1e6;
                let _ = writeln!(
                    o,
                    "kvfs_master_request_duration_seconds_bucket{{op=\"{}\",le=\"{le}\"}} {cum}",
                    op.name()
                );
            }
            let n = load(&h.count);
            let _ = writeln!(
                o,
                "kvfs_master_request_duration_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {n}",
                op.name()
            );
            let _ = writeln!(
                o,
                "kvfs_master_request_duration_seconds_sum{{op=\"{}\"}} {}",
                op.name(),
                load(&h.sum_us) as f64 / 1e6
            );
            let _ = writeln!(
                o,
                "kvfs_master_request_duration_seconds_count{{op=\"{}\"}} {n}",
                op.name()
            );
        }
        let counters = [
            (
                "kvfs_master_lost_objects_total",
                "Objects lost because every replica's node went away.",
                load(&self.lost_objects),
            ),
            (
                "kvfs_master_expired_nodes_total",
                "Nodes removed after missing heartbeats past their TTL.",
                load(&self.expired_nodes),
            ),
            (
                "kvfs_master_expired_puts_total",
                "Pending puts revoked because they were never ended.",
                load(&self.expired_puts),
            ),
            (
                "kvfs_master_node_call_failures_total",
                "Commit/drop calls to nodes that failed or timed out.",
                load(&self.node_call_failures),
            ),
            (
                "kvfs_master_recovery_conflicts_total",
                "Replicas refused while adopting what nodes reported.",
                load(&self.recovery_conflicts),
            ),
            (
                "kvfs_master_evicted_objects_total",
                "Objects evicted (all replicas dropped).",
                stats.evicted_objects,
            ),
            ("kvfs_master_evicted_replicas_total", "Replicas evicted.", stats.evicted_replicas),
            ("kvfs_master_evicted_bytes_total", "Bytes of evicted replicas.", stats.evicted_bytes),
        ];
        for (name, help, v) in counters {
            header(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {v}");
        }
        let gauges = [
            ("kvfs_master_objects", "Complete objects in the directory.", stats.objects as f64),
            (
                "kvfs_master_pending_puts",
                "Puts started and not yet ended.",
                stats.pending_puts as f64,
            ),
            ("kvfs_master_nodes", "Registered nodes.", stats.nodes as f64),
            ("kvfs_master_segments", "Registered segments.", stats.segments as f64),
            (
                "kvfs_master_metadata_bytes",
                "Estimated heap bytes of the directory.",
                stats.metadata_bytes as f64,
            ),
            (
                "kvfs_master_metadata_bytes_per_object",
                "Estimated directory bytes per object.",
                stats.metadata_bytes_per_object,
            ),
            (
                "kvfs_master_recovering",
                "1 while puts wait for the recovery grace after a restart.",
                u8::from(recovering) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            header(&mut o, name, "gauge", help);
            let _ = writeln!(o, "{name} {v}");
        }
        let tiers = ["hbm", "dram", "nvme", "object_store"];
        type Field = fn(&crate::TierStats) -> u64;
        let per_tier: [(&str, &str, Field); 4] = [
            ("kvfs_master_tier_capacity_bytes", "Capacity registered per tier.", |t| {
                t.capacity_bytes
            }),
            (
                "kvfs_master_tier_used_bytes",
                "Allocated bytes per tier (pending puts included).",
                |t| t.used_bytes,
            ),
            ("kvfs_master_tier_object_bytes", "Bytes of complete replicas per tier.", |t| t.bytes),
            ("kvfs_master_tier_replicas", "Replicas of complete objects per tier.", |t| t.replicas),
        ];
        for (name, help, f) in per_tier {
            header(&mut o, name, "gauge", help);
            for (i, t) in tiers.iter().enumerate() {
                let _ = writeln!(o, "{name}{{tier=\"{t}\"}} {}", f(&stats.tiers[i]));
            }
        }
        o
    }
}

pub(super) fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}
