//! `kvfs bench trace --replay` runs a trace through a real master, node and conductor: on a
//! small trace whose blocks all fit in the pool, the hit rate found in the pool is exactly the
//! unbounded cache's (every block written is there when a later request asks), and the
//! conductor's prediction never claims more than the pool had.

use std::io::Write;
use std::process::Command;

#[test]
fn a_replay_finds_what_an_unbounded_cache_would() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    // Three conversations whose turns extend their own prefix, interleaved.
    for turn in 0..10u64 {
        for conv in 0..3u64 {
            let blocks = turn + 2;
            let ids: Vec<u64> = (0..blocks).map(|b| conv * 1000 + b).collect();
            writeln!(
                f,
                r#"{{"timestamp": {}, "input_length": {}, "output_length": 10, "hash_ids": {ids:?}}}"#,
                turn * 100 + conv,
                blocks * 512
            )
            .unwrap();
        }
    }
    drop(f);
    let out = Command::new(env!("CARGO_BIN_EXE_kvfs"))
        .args(["bench", "trace", "--trace"])
        .arg(&path)
        .args(["--capacities", "unbounded", "--no-simulate", "--replay", "--json"])
        .args(["--block-bytes", "4K", "--pool-bytes", "64M", "--replay-requests", "30"])
        .env("KVFS_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let fig: serde_json::Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["bench"] == "trace_replay")
        .unwrap_or_else(|| panic!("no trace_replay figure in:\n{stdout}"));
    assert_eq!(fig["requests"], 30, "{fig}");
    let (found, model) = (
        fig["token_hit_rate"].as_f64().unwrap(),
        fig["lru_model_token_hit_rate"].as_f64().unwrap(),
    );
    // Every turn after the first reuses its previous turn: 162 of 195 blocks, as the model says.
    assert!((found - 162.0 / 195.0).abs() < 1e-12 && (found - model).abs() < 1e-12, "{fig}");
    assert_eq!(fig["requests_predicted_over"], 0, "{fig}");
    assert_eq!(fig["evicted_replicas"], 0, "{fig}");
}
