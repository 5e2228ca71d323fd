//! Every collective across real processes, checked against results computed here from the
//! same seeded data, at sizes inline and staged, not multiples of the staging segment.

mod common;

use common::{all, group, hash, reduced};
use kvfs_pg::testing::data;
use kvfs_pg::{DType, ReduceOp};

/// Small staging so the staged paths run in several segments of ragged sizes.
const SETTINGS: &[&str] = &["staging_bytes=65536", "inline_bytes_max=4096"];

#[test]
fn allreduce_every_dtype_and_op_matches_the_slot_ordered_fold() {
    let (_c, mut ranks) = group(3, SETTINGS);
    let slots = [0, 1, 2];
    let mut refs: Vec<&mut _> = ranks.iter_mut().collect();
    for (i, dt) in DType::ALL.into_iter().enumerate() {
        for op in ReduceOp::ALL {
            // 3 elements inline; 40_001 elements staged (several ragged segments).
            for count in [3usize, 40_001] {
                let seed = 100 + i as u64;
                let cmd = format!("allreduce {} {} {count} {seed}", dt.name(), op.name());
                let got = all(&mut refs, &cmd);
                if op == ReduceOp::Avg
                    && !matches!(dt, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
                {
                    for g in &got {
                        assert!(g.starts_with("err InvalidArgument"), "{cmd}: {g}");
                    }
                    continue;
                }
                let want = hash(&reduced(&slots, dt, op, count, seed));
                for (s, g) in got.iter().enumerate() {
                    assert_eq!(g, &want, "slot {s}: {cmd}");
                }
            }
        }
    }
}

#[test]
fn rooted_gathering_and_exchanging_collectives_match() {
    let (_c, mut ranks) = group(4, SETTINGS);
    let n = 4usize;
    let mut refs: Vec<&mut _> = ranks.iter_mut().collect();
    for bytes in [1usize, 1000, 150_001] {
        let seed = bytes as u64;
        // broadcast from slot 2
        let got = all(&mut refs, &format!("broadcast {bytes} {seed} 2"));
        let want = hash(&data(seed, 2, DType::U8, bytes));
        assert!(got.iter().all(|g| g == &want), "broadcast {bytes}: {got:?}");
        // allgather
        let got = all(&mut refs, &format!("allgather {bytes} {seed}"));
        let cat: Vec<u8> = (0..n as u32).flat_map(|s| data(seed, s, DType::U8, bytes)).collect();
        assert!(got.iter().all(|g| g == &hash(&cat)), "allgather {bytes}: {got:?}");
        // gather to slot 1
        let got = all(&mut refs, &format!("gather {bytes} {seed} 1"));
        assert_eq!(got[1], hash(&cat), "gather {bytes}");
        assert!(got.iter().enumerate().all(|(i, g)| i == 1 || g == "ok -"));
        // scatter from slot 3
        let got = all(&mut refs, &format!("scatter {bytes} {seed} 3"));
        let src = data(seed, 3, DType::U8, bytes * n);
        for (j, g) in got.iter().enumerate() {
            assert_eq!(g, &hash(&src[j * bytes..(j + 1) * bytes]), "scatter {bytes} to {j}");
        }
        // alltoall
        let got = all(&mut refs, &format!("alltoall {bytes} {seed}"));
        let inputs: Vec<Vec<u8>> =
            (0..n as u32).map(|s| data(seed, s, DType::U8, bytes * n)).collect();
        for (j, g) in got.iter().enumerate() {
            let want: Vec<u8> =
                (0..n).flat_map(|i| inputs[i][j * bytes..(j + 1) * bytes].to_vec()).collect();
            assert_eq!(g, &hash(&want), "alltoall {bytes} at {j}");
        }
    }
    // reduce and reduce_scatter on floats
    for count in [5usize, 30_003] {
        let got = all(&mut refs, &format!("reduce float32 sum {count} 9 0"));
        assert_eq!(got[0], hash(&reduced(&[0, 1, 2, 3], DType::F32, ReduceOp::Sum, count, 9)));
        let got = all(&mut refs, &format!("reduce_scatter float64 max {count} 11"));
        let parts: Vec<Vec<u8>> =
            (0..n as u32).map(|s| data(11, s, DType::F64, count * n)).collect();
        for (j, g) in got.iter().enumerate() {
            let blocks: Vec<&[u8]> =
                parts.iter().map(|p| &p[j * count * 8..(j + 1) * count * 8]).collect();
            let mut out = vec![0; count * 8];
            kvfs_pg::reduce(DType::F64, ReduceOp::Max, &blocks, &mut out);
            assert_eq!(g, &hash(&out), "reduce_scatter {count} at {j}");
        }
    }
    // alltoallv with uneven blocks
    let got = all(&mut refs, "alltoallv 5");
    let size = |i: usize, j: usize| (i + 2 * j) % 5 * 1000 + 7;
    let inputs: Vec<Vec<u8>> =
        (0..n).map(|i| data(5, i as u32, DType::U8, (0..n).map(|j| size(i, j)).sum())).collect();
    for (j, g) in got.iter().enumerate() {
        let mut want = Vec::new();
        for (i, input) in inputs.iter().enumerate() {
            let off: usize = (0..j).map(|k| size(i, k)).sum();
            want.extend_from_slice(&input[off..off + size(i, j)]);
        }
        assert_eq!(g, &hash(&want), "alltoallv at {j}");
    }
    assert!(all(&mut refs, "barrier").iter().all(|g| g == "ok -"));
}

#[test]
fn point_to_point_small_and_large_in_order() {
    let (_c, mut ranks) = group(2, SETTINGS);
    let (a, b) = ranks.split_at_mut(1);
    let (a, b) = (&mut a[0], &mut b[0]);
    for (i, bytes) in [10usize, 200_000, 5000, 0].into_iter().enumerate() {
        a.send(&format!("send 1 7 {bytes} {i}"));
        b.send(&format!("recv 0 7 {bytes}"));
        assert_eq!(a.answer(60), "ok -");
        assert_eq!(b.answer(60), hash(&data(i as u64, 0, DType::U8, bytes)));
    }
    // Both send first, then receive: a large send of one part (up to the staging size) does
    // not wait for its receiver.
    a.send("send 1 3 60000 1");
    b.send("send 0 3 60000 2");
    assert_eq!(a.answer(60), "ok -");
    assert_eq!(b.answer(60), "ok -");
    assert_eq!(a.ask("recv 1 3 60000"), hash(&data(2, 1, DType::U8, 60_000)));
    assert_eq!(b.ask("recv 0 3 60000"), hash(&data(1, 0, DType::U8, 60_000)));
}

#[test]
fn bad_input_gets_typed_errors() {
    let (_c, mut ranks) = group(2, SETTINGS);
    let mut refs: Vec<&mut _> = ranks.iter_mut().collect();
    // Sizes that differ across ranks: both sides see the mismatch.
    refs[0].send("allreduce float32 sum 10 1");
    refs[1].send("allreduce float32 sum 11 1");
    for r in refs.iter_mut() {
        let a = r.answer(60);
        assert!(a.starts_with("err Mismatch"), "{a}");
    }
    // Dtypes that differ.
    refs[0].send("allreduce float32 sum 10 1");
    refs[1].send("allreduce int32 sum 10 1");
    for r in refs.iter_mut() {
        let a = r.answer(60);
        assert!(a.starts_with("err Mismatch"), "{a}");
    }
    // An unknown slot as root, and a bad dtype.
    let got = all(&mut refs, "broadcast 10 1 7");
    assert!(got.iter().all(|g| g.starts_with("err UnknownSlot")), "{got:?}");
    assert!(refs[0].ask("allreduce complex64 sum 4 1").starts_with("err InvalidArgument"));
    assert!(refs[0].ask("send 9 1 10 1").starts_with("err UnknownSlot"));
    // The group still works afterwards.
    let got = all(&mut refs, "allreduce int64 sum 100 3");
    let want = hash(&reduced(&[0, 1], DType::I64, ReduceOp::Sum, 100, 3));
    assert!(got.iter().all(|g| g == &want), "{got:?}");
}
