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
    let args =
        ["--procs", &b.procs, "--sizes", &b.sizes, "--ops", &b.ops, "--backends", &b.backends];
    run_script(&b.python, "pg", SCRIPT, "torch, numpy, kvfs.pg", &args)
}

/// Runs an embedded bench script `bench_<name>.py` with `python`, after checking that it
/// imports `imports`.
pub fn run_script(
    python: &str,
    name: &str,
    script: &str,
    imports: &str,
    args: &[&str],
) -> anyhow::Result<()> {
    let check = Command::new(python)
        .args(["-c", &format!("import {imports}")])
        .output()
        .with_context(|| format!("cannot run {python}"))?;
    if !check.status.success() {
        bail!(
            "{python} cannot import {imports} (install what is missing; the kvfs package with `pip install ./python`): {}",
            String::from_utf8_lossy(&check.stderr).lines().last().unwrap_or("")
        );
    }
    let dir = std::env::temp_dir().join(format!("kvfs-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("bench_{name}.py"));
    std::fs::write(&path, script)?;
    let status = Command::new(python)
        .arg(&path)
        .args(args)
        .env("KVFS_LOG", std::env::var("KVFS_LOG").unwrap_or_else(|_| "error".into()))
        .status()
        .with_context(|| format!("cannot run {python}"));
    let _ = std::fs::remove_dir_all(&dir);
    if !status?.success() {
        bail!("the {name} bench failed");
    }
    Ok(())
}
