//! Benchmark figures: one type for every `kvfs bench` line, printed as a table for people and
//! as one JSON object per line (`--json`) for scripts, with the fields of DESIGN.md section 11.

use serde_json::{Value, json};

/// One measured figure. Fields that do not apply stay `None` (JSON null).
#[derive(Debug, Clone, Default)]
pub struct Figure {
    pub bench: &'static str,
    pub case: String,
    pub transport: Option<String>,
    pub mode: Option<String>,
    pub op: String,
    pub size_bytes: Option<u64>,
    pub gbps: Option<f64>,
    pub ops_per_s: Option<f64>,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub limit: Option<String>,
    pub limit_gbps: Option<f64>,
    /// p50 of a raw request/response round trip of the same size and direction between the
    /// same two processes (single calls over tcp), measured in the same run.
    pub rtt_p50_us: Option<f64>,
}

impl Figure {
    pub fn ratio(&self) -> Option<f64> {
        match (self.gbps, self.limit_gbps) {
            (Some(g), Some(l)) if l > 0.0 => Some(g / l),
            _ => None,
        }
    }

    /// The call's p50 latency over the raw round trip's.
    pub fn p50_over_rtt(&self) -> Option<f64> {
        match (self.p50_us, self.rtt_p50_us) {
            (Some(p), Some(r)) if r > 0.0 => Some(p / r),
            _ => None,
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "bench": self.bench,
            "case": self.case,
            "transport": self.transport,
            "mode": self.mode,
            "op": self.op,
            "size_bytes": self.size_bytes,
            "gbps": self.gbps.map(round3),
            "ops_per_s": self.ops_per_s.map(|v| v.round()),
            "p50_us": self.p50_us.map(round1),
            "p99_us": self.p99_us.map(round1),
            "limit": self.limit,
            "limit_gbps": self.limit_gbps.map(round3),
            "ratio": self.ratio().map(round3),
            "rtt_p50_us": self.rtt_p50_us.map(round1),
            "p50_over_rtt": self.p50_over_rtt().map(round3),
        })
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Prints figures as they are measured: JSON lines, or rows of a table under one header.
pub struct Reporter {
    json: bool,
    header_done: bool,
}

impl Reporter {
    pub fn new(json: bool) -> Reporter {
        Reporter { json, header_done: false }
    }

    pub fn emit(&mut self, f: &Figure) {
        if self.json {
            println!("{}", f.to_json());
            return;
        }
        if !self.header_done {
            println!(
                "{:<10} {:<15} {:<9} {:<16} {:>10} {:>9} {:>11} {:>9} {:>9} {:>9} {:>10} {:>6} {:>7} {:>5}",
                "transport",
                "mode",
                "op",
                "case",
                "size",
                "GB/s",
                "ops/s",
                "p50 us",
                "p99 us",
                "limit",
                "limit GB/s",
                "ratio",
                "rtt us",
                "x rtt"
            );
            self.header_done = true;
        }
        let opt = |v: Option<f64>, prec: usize| {
            v.map(|v| format!("{v:.prec$}")).unwrap_or_else(|| "-".into())
        };
        println!(
            "{:<10} {:<15} {:<9} {:<16} {:>10} {:>9} {:>11} {:>9} {:>9} {:>9} {:>10} {:>6} {:>7} {:>5}",
            f.transport.as_deref().unwrap_or("-"),
            f.mode.as_deref().unwrap_or("-"),
            f.op,
            f.case,
            f.size_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
            opt(f.gbps, 3),
            opt(f.ops_per_s, 0),
            opt(f.p50_us, 1),
            opt(f.p99_us, 1),
            f.limit.as_deref().unwrap_or("-"),
            opt(f.limit_gbps, 3),
            opt(f.ratio(), 2),
            opt(f.rtt_p50_us, 1),
            opt(f.p50_over_rtt(), 2),
        );
    }
}

/// `4 KiB`, `64 MiB`, `1.5 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 { format!("{v:.0} {}", UNITS[u]) } else { format!("{v:.1} {}", UNITS[u]) }
}

/// Parses `4096`, `4K`, `4KiB`, `64MiB`, `2GB`, `1.5G` (binary units: K = 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 4K, 64MiB, 2GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Latency samples of one case, and the throughput they imply.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    pub lat_us: Vec<f64>,
    pub bytes: u64,
    pub ops: u64,
    pub elapsed_s: f64,
}

impl Samples {
    pub fn percentile(&mut self, p: f64) -> Option<f64> {
        if self.lat_us.is_empty() {
            return None;
        }
        self.lat_us.sort_by(|a, b| a.total_cmp(b));
        let idx = ((self.lat_us.len() as f64 - 1.0) * p).round() as usize;
        Some(self.lat_us[idx])
    }

    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed_s / 1e9
    }

    /// Adds another run of the same case.
    pub fn merge(&mut self, other: Samples) {
        self.lat_us.extend(other.lat_us);
        self.bytes += other.bytes;
        self.ops += other.ops;
        self.elapsed_s += other.elapsed_s;
    }

    pub fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.elapsed_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("4K").unwrap(), 4096);
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("2 GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("").is_err());
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn merged_samples_add_up() {
        let mut a = Samples { lat_us: vec![1.0], bytes: 10, ops: 1, elapsed_s: 1.0 };
        a.merge(Samples { lat_us: vec![3.0, 5.0], bytes: 30, ops: 2, elapsed_s: 4.0 });
        assert_eq!((a.lat_us.len(), a.bytes, a.ops, a.elapsed_s), (3, 40, 3, 5.0));
        assert_eq!(a.percentile(0.5), Some(3.0));
        assert!((a.gbps() - 8e-9).abs() < 1e-15);
    }

    #[test]
    fn percentiles_and_ratio() {
        let mut s = Samples {
            lat_us: (1..=100).map(f64::from).collect(),
            bytes: 2_000_000_000,
            ops: 100,
            elapsed_s: 1.0,
        };
        assert_eq!(s.percentile(0.5), Some(51.0));
        assert_eq!(s.percentile(0.99), Some(99.0));
        assert_eq!(s.gbps(), 2.0);
        let f = Figure { gbps: Some(1.5), limit_gbps: Some(2.0), ..Default::default() };
        assert_eq!(f.ratio(), Some(0.75));
        assert_eq!(f.to_json()["ratio"], 0.75);
        assert!(f.to_json()["p50_us"].is_null());
    }
}
