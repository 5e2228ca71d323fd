//! Reshards between real processes: each participant a `kvfs-reshard-rank` with its own
//! Transfer Engine, a kvfs-pg group for the bindings and the commit, and a coordinator here.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvfs_pg::{Coordinator, CoordinatorConfig};

struct Rank {
    child: Child,
    lines: mpsc::Receiver<String>,
    slot: u32,
}

impl Rank {
    fn spawn(
        coord: &str,
        slot: u32,
        world: u32,
        from: &str,
        to: &str,
        settings: &[String],
    ) -> Rank {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfs-reshard-rank"))
            .args([coord, &slot.to_string(), &world.to_string(), from, to])
            .args(settings)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start kvfs-reshard-rank");
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
        Rank { child, lines, slot }
    }

    /// The next line starting with `prefix`, within `secs`.
    fn wait_for(&self, prefix: &str, secs: u64) -> String {
        let end = std::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => continue,
                Err(_) => panic!("slot {} printed no {prefix:?} within {secs} s", self.slot),
            }
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn coordinator(world: u32) -> (tokio::runtime::Runtime, Coordinator) {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut cfg = CoordinatorConfig::new("default", world);
    cfg.heartbeat_ms = 100;
    cfg.failure_timeout_ms = 1000;
    let c = rt.block_on(Coordinator::start(cfg)).expect("coordinator");
    (rt, c)
}

fn reshard(
    from: &str,
    to: &str,
    world: u32,
    settings: &[(u32, &str)],
) -> (Vec<Rank>, tokio::runtime::Runtime, Coordinator) {
    let (rt, c) = coordinator(world);
    let ranks = (0..world)
        .map(|s| {
            let mine: Vec<String> = settings
                .iter()
                .filter(|(w, _)| *w == s || *w == u32::MAX)
                .map(|(_, kv)| kv.to_string())
                .collect();
            Rank::spawn(&c.addr(), s, world, from, to, &mine)
        })
        .collect();
    (ranks, rt, c)
}

#[test]
fn tp2_to_tp4_across_processes_is_exact_and_committed() {
    let (ranks, _rt, _c) = reshard("tp2", "tp4", 4, &[]);
    for r in &ranks {
        let done = r.wait_for("done", 90);
        assert!(
            done.contains("committed=true state=Some(Active) verified=true"),
            "slot {}: {done}",
            r.slot
        );
    }
}

/// Over tcp alone the targets read in lanes, the header checks riding the data's connections.
#[test]
fn tp2_to_tp4_over_tcp_alone_is_exact_and_committed() {
    let (ranks, _rt, _c) =
        reshard("tp2", "tp4", 6, &[(u32::MAX, "tcp_only=1"), (u32::MAX, "dst_offset=2")]);
    for r in &ranks {
        let done = r.wait_for("done", 90);
        assert!(done.contains("committed=true"), "slot {}: {done}", r.slot);
        if r.slot >= 2 {
            assert!(done.contains("state=Some(Active) verified=true"), "slot {}: {done}", r.slot);
        }
    }
}

/// Over tcp alone too (lanes), a source moved to another allocation after binding is refused
/// by the targets that read it, and nothing commits.
#[test]
fn a_source_in_another_allocation_over_tcp_alone_is_not_read() {
    let all = [(u32::MAX, "tcp_only=1"), (u32::MAX, "dst_offset=2"), (1, "stale=source")];
    let (ranks, _rt, _c) = reshard("tp2", "tp4", 6, &all);
    let mut refused = 0;
    for r in &ranks {
        let done = r.wait_for("done", 90);
        assert!(done.contains("committed=false"), "slot {}: {done}", r.slot);
        if r.slot >= 2 {
            assert!(done.contains("state=Some(Inactive)"), "slot {}: {done}", r.slot);
            refused += usize::from(done.contains("err=StaleGeneration"));
        }
    }
    assert!(refused >= 2, "{refused} targets refused participant 1's regions");
}

#[test]
fn pp2_ep2_tp2_to_tp4_dp2_across_processes() {
    // Sources on 8 processes, targets on 8: the experts leave their EP ranks, layers leave
    // their stages, every target DP replica gets a whole copy.
    let (ranks, _rt, _c) = reshard("pp2/ep2/tp2", "tp4/dp2", 8, &[]);
    for r in &ranks {
        let done = r.wait_for("done", 120);
        assert!(
            done.contains("committed=true") && done.contains("verified=true"),
            "slot {}: {done}",
            r.slot
        );
    }
}

#[test]
fn a_stale_target_generation_is_refused_and_nothing_commits() {
    let (ranks, _rt, _c) = reshard("tp2", "tp2/dp2", 4, &[(3, "stale=target")]);
    for r in &ranks {
        let done = r.wait_for("done", 90);
        assert!(done.contains("committed=false"), "slot {}: {done}", r.slot);
        assert!(done.contains("state=Some(Inactive)"), "slot {}: {done}", r.slot);
        if r.slot == 3 {
            assert!(done.contains("err=StaleGeneration"), "{done}");
        }
    }
}

#[test]
fn a_source_in_another_allocation_is_not_read_and_nothing_commits() {
    // Slot 1 holds source participant 1: it moves its weights into new buffers after binding.
    let (ranks, _rt, _c) = reshard("tp2", "tp4", 4, &[(1, "stale=source")]);
    let mut refused = Vec::new();
    for r in &ranks {
        let done = r.wait_for("done", 90);
        assert!(done.contains("committed=false state=Some(Inactive)"), "slot {}: {done}", r.slot);
        if done.contains("err=StaleGeneration") {
            refused.push(r.slot);
        }
    }
    // The targets that read from participant 1 refuse its regions: tp4 ranks 2 and 3 (its
    // rows) and 1 (its own copy of the replicated norms, read locally); rank 0 reads only
    // participant 0 and fails in the vote alone.
    assert_eq!(refused, vec![1, 2, 3]);
}

#[test]
fn a_participant_killed_mid_execution_leaves_the_target_generation_inactive() {
    let (mut ranks, _rt, _c) = reshard("tp4", "tp2/dp2", 4, &[(2, "hold_ms=60000")]);
    ranks[2].wait_for("executing", 90);
    std::thread::sleep(Duration::from_millis(200));
    let _ = ranks[2].child.kill();
    let _ = ranks[2].child.wait();
    for r in ranks.iter().filter(|r| r.slot != 2) {
        let done = r.wait_for("done", 90);
        assert!(done.contains("committed=false state=Some(Inactive)"), "slot {}: {done}", r.slot);
    }
}
