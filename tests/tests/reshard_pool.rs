//! Model weights through the kvfs pool: stored once under one placement by a master and node
//! processes, loaded into other placements byte for byte.

use kvfs_reshard::testing::linear_fragment;
use kvfs_reshard::{ErrorKind, Parallel, Rule, TensorDesc, pool};
use kvfs_tests::{Cluster, ClusterOpts};

fn model() -> Vec<(TensorDesc, Rule)> {
    let layers = 4;
    let mut t = Vec::new();
    for l in 0..layers {
        t.push((
            TensorDesc::new(&format!("l{l}.experts"), &[8, 64, 96], "bfloat16", 2),
            Rule { tp_dim: Some(2), ep_dim: Some(0), layer: Some((l, layers)) },
        ));
        t.push((
            TensorDesc::new(&format!("l{l}.qkv"), &[64, 192], "float32", 4),
            Rule { tp_dim: Some(1), ep_dim: None, layer: Some((l, layers)) },
        ));
    }
    t.push((
        TensorDesc::new("embed", &[1000, 64], "float32", 4),
        Rule { tp_dim: Some(0), ..Rule::default() },
    ));
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_round_trip_through_the_pool_into_other_placements() {
    let cluster = Cluster::start(ClusterOpts { nodes: 2, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    let tensors = model();
    let src = Parallel::parse("pp2/ep2/tp2/dp2").unwrap().placement(&tensors).unwrap();
    // Every source participant stores its fragments; only one DP replica goes in.
    let mut stored = 0;
    for p in 0..src.participants {
        let bufs: Vec<(u32, u32, Vec<u8>)> = src
            .tensors
            .iter()
            .enumerate()
            .flat_map(|(ti, t)| {
                t.fragments
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| f.participant == p)
                    .map(move |(fi, f)| (ti as u32, fi as u32, linear_fragment(&t.desc, f)))
            })
            .collect();
        let items: Vec<(u32, u32, &[u8])> =
            bufs.iter().map(|(t, f, b)| (*t, *f, b.as_slice())).collect();
        stored += pool::store(&c, "m1", &src, &items).await.unwrap();
    }
    pool::store_manifest(&c, "m1", &src).await.unwrap();
    let one_replica: usize =
        pool::stored_placement(&src).tensors.iter().map(|t| t.fragments.len()).sum();
    assert_eq!(stored, one_replica);
    for layout in ["tp4", "pp4/tp2", "ep4/dp2", "tp1"] {
        let dst = Parallel::parse(layout).unwrap().placement(&tensors).unwrap();
        for p in 0..dst.participants {
            for (ti, fi, got) in pool::load(&c, "m1", &dst, p).await.unwrap() {
                let t = &dst.tensors[ti as usize];
                let want = linear_fragment(&t.desc, &t.fragments[fi as usize]);
                assert!(
                    got == want,
                    "{layout} participant {p}: {} fragment {fi} differs",
                    t.desc.name
                );
            }
        }
    }
    // The model is stored under one placement for good.
    let other = Parallel::parse("tp8").unwrap().placement(&tensors).unwrap();
    assert_eq!(
        pool::store_manifest(&c, "m1", &other).await.unwrap_err().kind(),
        ErrorKind::Mismatch
    );
    // A target that wants a tensor the model lacks, or another shape, fails closed.
    let mut bad = tensors.clone();
    bad[0].0.shape[1] = 65;
    let dst = Parallel::parse("tp2").unwrap().placement(&bad).unwrap();
    assert_eq!(pool::load(&c, "m1", &dst, 0).await.unwrap_err().kind(), ErrorKind::Mismatch);
    assert_eq!(pool::load(&c, "nope", &dst, 0).await.unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(
        pool::load(&c, "a/b", &dst, 0).await.unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}
