//! Failures and replacements with real processes: SIGKILL between and during collectives,
//! a replacement taking its slot back, and a stopped member coming back to a group that moved
//! on without it.

mod common;

use std::time::{Duration, Instant};

use common::{Rank, all, group, hash, reduced};
use kvfs_pg::{DType, ReduceOp};

const SETTINGS: &[&str] = &["staging_bytes=65536", "inline_bytes_max=4096", "suspect_after_ms=300"];

fn survivors<'a>(ranks: &'a mut [Rank], dead: &[u32]) -> Vec<&'a mut Rank> {
    ranks.iter_mut().filter(|r| !dead.contains(&r.slot)).collect()
}

fn sum(slots: &[u32], count: usize, seed: u64) -> String {
    hash(&reduced(slots, DType::F32, ReduceOp::Sum, count, seed))
}

#[test]
fn survivors_of_a_rank_killed_between_collectives_reduce_over_themselves_and_a_replacement_rejoins()
{
    let (c, mut ranks) = group(4, SETTINGS);
    let everyone = [0, 1, 2, 3];
    for count in [100usize, 50_000] {
        let got = all(
            &mut ranks.iter_mut().collect::<Vec<_>>(),
            &format!("allreduce float32 sum {count} 1"),
        );
        assert!(got.iter().all(|g| g == &sum(&everyone, count, 1)), "{got:?}");
    }
    ranks[2].kill();
    let started = Instant::now();
    for count in [100usize, 50_000] {
        let got =
            all(&mut survivors(&mut ranks, &[2]), &format!("allreduce float32 sum {count} 2"));
        assert!(got.iter().all(|g| g == &sum(&[0, 1, 3], count, 2)), "{count}: {got:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(20), "survivors took {:?}", started.elapsed());
    assert_eq!(c.coord.view().slots(), vec![0, 1, 3]);
    let got = all(&mut survivors(&mut ranks, &[2]), "view");
    assert!(got.iter().all(|g| g.ends_with(" 0,1,3")), "{got:?}");

    // A replacement joins slot 2 and waits; the survivors activate it between two operations.
    ranks[2] = Rank::spawn(&c.coord.addr(), 2, 4, SETTINGS);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.coord.pending().contains(&2) {
        assert!(Instant::now() < deadline, "the replacement never reached the coordinator");
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = all(&mut survivors(&mut ranks, &[2]), "change 2 -");
    assert!(got.iter().all(|g| g.starts_with("ok ") && g.ends_with("[0, 1, 2, 3]")), "{got:?}");
    assert!(ranks[2].answer(30).starts_with("joined 2"));
    for count in [100usize, 50_000] {
        let got = all(
            &mut ranks.iter_mut().collect::<Vec<_>>(),
            &format!("allreduce float32 sum {count} 3"),
        );
        assert!(got.iter().all(|g| g == &sum(&everyone, count, 3)), "{count}: {got:?}");
    }
}

#[test]
fn a_rank_killed_during_a_collective_leaves_survivors_in_step() {
    let (_c, mut ranks) = group(4, SETTINGS);
    // About 300 staged segments: long enough to be cut in the middle.
    let count = 5_000_000usize;
    let cmd = format!("allreduce float32 sum {count} 4");
    for r in ranks.iter_mut() {
        r.send(&cmd);
    }
    std::thread::sleep(Duration::from_millis(150));
    ranks[1].kill();
    let full = sum(&[0, 1, 2, 3], count, 4);
    let part = sum(&[0, 2, 3], count, 4);
    for r in survivors(&mut ranks, &[1]) {
        let a = r.answer(60);
        eprintln!(
            "slot {}: {}",
            r.slot,
            if a == full {
                "full"
            } else if a == part {
                "survivors"
            } else {
                &a
            }
        );
        assert!(a == full || a == part || a.starts_with("err PeerFailed"), "slot {}: {a}", r.slot);
    }
    // Whatever the interrupted call returned, the next one runs over the survivors on all.
    let got = all(&mut survivors(&mut ranks, &[1]), "allreduce float32 sum 70000 5");
    assert!(got.iter().all(|g| g == &sum(&[0, 2, 3], 70_000, 5)), "{got:?}");
    let got = all(&mut survivors(&mut ranks, &[1]), "allreduce float32 sum 10 6");
    assert!(got.iter().all(|g| g == &sum(&[0, 2, 3], 10, 6)), "{got:?}");
}

#[test]
fn a_stopped_member_that_comes_back_is_refused_as_stale() {
    let (_c, mut ranks) = group(3, SETTINGS);
    let got = all(&mut ranks.iter_mut().collect::<Vec<_>>(), "allreduce float32 sum 10 1");
    assert!(got.iter().all(|g| g == &sum(&[0, 1, 2], 10, 1)));
    let pid = ranks[2].child.id() as i32;
    // SAFETY: signalling our own child process.
    unsafe { libc_kill(pid, 19) }; // SIGSTOP
    let got = all(&mut survivors(&mut ranks, &[2]), "allreduce float32 sum 10 2");
    assert!(got.iter().all(|g| g == &sum(&[0, 1], 10, 2)), "{got:?}");
    // SAFETY: as above.
    unsafe { libc_kill(pid, 18) }; // SIGCONT
    let a = ranks[2].ask("allreduce float32 sum 10 3");
    assert!(a.starts_with("err StaleEpoch"), "{a}");
    // A frame stamped with the old epoch is refused and counted.
    let refused = |r: &mut Rank| -> u64 {
        let c = r.ask("counters");
        c.split_whitespace()
            .find_map(|kv| kv.strip_prefix("stale_refused="))
            .and_then(|v| v.parse::<u64>().ok())
            .expect("a stale_refused counter")
    };
    let before = refused(&mut ranks[1]);
    let epoch: u64 = ranks[0].ask("view").split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(epoch >= 2, "the survivors' epoch moved on");
    assert_eq!(ranks[0].ask(&format!("frame_at_epoch 1 {}", epoch - 1)), "ok -");
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused(&mut ranks[1]) == before {
        assert!(Instant::now() < deadline, "the stale frame was not refused");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The survivors carry on.
    let got = all(&mut survivors(&mut ranks, &[2]), "allreduce int32 sum 100 4");
    assert!(got.iter().all(|g| g == &hash(&reduced(&[0, 1], DType::I32, ReduceOp::Sum, 100, 4))));
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}
