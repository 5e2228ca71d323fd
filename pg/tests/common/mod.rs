//! Ranks of a test group, each `kvfs-pg-rank` in its own process, and the expected results
//! computed here from the same seeded data.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvfs_pg::testing::data;
use kvfs_pg::{Coordinator, CoordinatorConfig, DType, ReduceOp};

pub struct Rank {
    pub slot: u32,
    pub child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Rank {
    pub fn spawn(coord: &str, slot: u32, world: u32, settings: &[&str]) -> Rank {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfs-pg-rank"))
            .args([coord, &slot.to_string(), &world.to_string()])
            .args(settings)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start kvfs-pg-rank");
        let stdin = child.stdin.take().expect("stdin");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in out.lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Rank { slot, child, stdin, lines }
    }

    pub fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").expect("write a command");
        self.stdin.flush().expect("flush");
    }

    /// The next answer line, within `secs`.
    pub fn answer(&mut self, secs: u64) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(secs))
            .unwrap_or_else(|_| panic!("slot {} did not answer within {secs} s", self.slot))
    }

    pub fn ask(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.answer(60)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A coordinator on its own runtime, in the test process.
pub struct Coord {
    pub rt: tokio::runtime::Runtime,
    pub coord: Coordinator,
}

pub fn coordinator(world: u32) -> Coord {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut cfg = CoordinatorConfig::new("default", world);
    cfg.heartbeat_ms = 100;
    cfg.failure_timeout_ms = 1000;
    let coord = rt.block_on(Coordinator::start(cfg)).expect("coordinator");
    Coord { rt, coord }
}

/// Starts `world` ranks and waits until all joined.
pub fn group(world: u32, settings: &[&str]) -> (Coord, Vec<Rank>) {
    let c = coordinator(world);
    let addr = c.coord.addr();
    let mut ranks: Vec<Rank> = (0..world).map(|s| Rank::spawn(&addr, s, world, settings)).collect();
    for r in &mut ranks {
        let a = r.answer(60);
        assert!(a.starts_with("joined"), "slot {}: {a}", r.slot);
    }
    (c, ranks)
}

/// Sends `cmd` to every rank in `ranks`, then collects their answers in order.
pub fn all(ranks: &mut [&mut Rank], cmd: &str) -> Vec<String> {
    for r in ranks.iter_mut() {
        r.send(cmd);
    }
    ranks.iter_mut().map(|r| r.answer(90)).collect()
}

pub fn hash(b: &[u8]) -> String {
    format!("ok {}", blake3::hash(b).to_hex())
}

/// The expected allreduce result over `slots` (in slot order).
pub fn reduced(slots: &[u32], dt: DType, op: ReduceOp, count: usize, seed: u64) -> Vec<u8> {
    let parts: Vec<Vec<u8>> = slots.iter().map(|&s| data(seed, s, dt, count)).collect();
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let mut out = vec![0u8; count * dt.size()];
    kvfs_pg::reduce(dt, op, &refs, &mut out);
    out
}
