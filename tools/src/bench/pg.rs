//! `kvfs bench pg`: kvfs-pg collectives against torch's gloo in the same process layout and
//! the same run, with memcpy and raw loopback TCP measured alongside.
//!
//! The measurement is `python/bench/bench_pg.py` (embedded in the binary), run with the
//! interpreter `--python` names: both backends are driven through `torch.distributed` from N
//! spawned processes, so they pay the same Python and tensor costs, and gloo needs torch
//! anyway. That interpreter needs torch and the kvfs package (`pip install ./python`).

use std::process::Command;

use anyhow::{Context, bail};

const SCRIPT: &str = include_str!("../../../python/bench/bench_pg.py");

pub struct PgBench {
    pub python: String,
    pub procs: String,
    pub sizes: String,
    pub ops: String,
    pub backends: String,
}

pub fn run(b: PgBench) -> anyhow::Result<()> {
    let check = Command::new(&b.python)
        .args(["-c", "import torch, numpy, kvfs.pg"])
        .output()
        .with_context(|| format!("cannot run {}", b.python))?;
    if !check.status.success() {
        bail!(
            "{} cannot import torch, numpy and kvfs.pg (install torch and `pip install ./python` into it): {}",
            b.python,
            String::from_utf8_lossy(&check.stderr).lines().last().unwrap_or("")
        );
    }
    let dir = std::env::temp_dir().join(format!("kvfs-bench-pg-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("bench_pg.py");
    std::fs::write(&script, SCRIPT)?;
    let status = Command::new(&b.python)
        .arg(&script)
        .args([
            "--procs",
            &b.procs,
            "--sizes",
            &b.sizes,
            "--ops",
            &b.ops,
            "--backends",
            &b.backends,
        ])
        .env("KVFS_LOG", std::env::var("KVFS_LOG").unwrap_or_else(|_| "error".into()))
        .status()
        .with_context(|| format!("cannot run {}", b.python))?;
    let _ = std::fs::remove_dir_all(&dir);
    if !status.success() {
        bail!("the pg bench failed ({status})");
    }
    Ok(())
}
