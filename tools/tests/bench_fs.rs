//! `kvfs bench fs` end to end, briefly: every mode is measured and reported as a JSON line with
//! the fields of DESIGN.md section 11.

use std::process::Command;

#[test]
fn bench_fs_reports_every_mode_as_json_lines() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfs"))
        .args([
            "bench",
            "fs",
            "--json",
            "--sizes",
            "1M,4M",
            "--min-ms",
            "50",
            "--limit-bytes",
            "64M",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    for size in [1u64 << 20, 4 << 20] {
        for (mode, limit) in [
            ("fuse-cold", "memcpy"),
            ("fuse-warm", "memcpy"),
            ("fastpath", "memcpy"),
            ("memcpy", "memcpy"),
            ("fastpath", "fuse-cold"),
        ] {
            let f = lines
                .iter()
                .find(|f| f["mode"] == mode && f["limit"] == limit && f["size_bytes"] == size)
                .unwrap_or_else(|| panic!("no {mode} line against {limit} for {size}"));
            assert_eq!(f["bench"], "fs");
            assert_eq!(f["op"], "read");
            for field in ["gbps", "ops_per_s", "p50_us", "p99_us", "limit_gbps", "ratio"] {
                assert!(
                    f[field].as_f64().is_some_and(|v| v > 0.0),
                    "{mode} {size}: {field} in {f}"
                );
            }
        }
    }
}
