//! `kvfs bench ep`: kvfs-ep's dispatch and combine against the all-gather fallback (every
//! rank's tokens to every rank, then an all-reduce of the result) in the same processes and
//! the same run: step latency p50/p99 and the bytes each rank sends.
//!
//! The measurement is `python/bench/bench_ep.py` (embedded), run with `--python`, which needs
//! numpy and the kvfs package (`pip install ./python`).

const SCRIPT: &str = include_str!("../../../python/bench/bench_ep.py");

pub struct EpBench {
    pub python: String,
    pub procs: String,
    pub tokens: String,
    pub iters: u32,
}

pub fn run(b: EpBench) -> anyhow::Result<()> {
    let iters = b.iters.to_string();
    let args = ["--procs", &b.procs, "--tokens", &b.tokens, "--iters", &iters];
    super::pg::run_script(&b.python, "ep", SCRIPT, "numpy, kvfs.ep", &args)
}
