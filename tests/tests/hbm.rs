//! HBM as a pool segment: nodes started with `--hbm` contribute GPU memory, puts that ask for
//! it (`PutOptions::tier`, `kvfs put --tier hbm`) are placed there, and clients in other
//! processes write and read it through the Transfer Engine (tcp, staged through host memory).
//!
//! Without a CUDA driver (CI) the refusals are what can be checked: a node asked for HBM exits
//! with a clear error, and a put asking for HBM in a cluster without any fails with one. With a
//! driver (`scripts/test-gpu` on a GPU machine) the whole path runs, byte for byte, and so do
//! the tier manager's moves (cold HBM objects down to DRAM above the HBM watermark, a hot one
//! back up).

use std::time::Duration;

use kvfs_client::{ErrorKind, GetInto, PutFrom, PutOptions, Tier};
use kvfs_proto::store::{self as w, ErrorCode, MasterRequest, MasterResponse, MoveItem, Role};
use kvfs_rpc::{RpcConn, RpcOptions, no_handler};
use kvfs_tests::{Cluster, ClusterOpts, content, kvfs_bin};
use kvfs_transfer::BufferOptions;

fn hbm(replicas: u8) -> PutOptions {
    PutOptions { tier: Tier::Hbm, replicas, ..PutOptions::default() }
}

fn driver() -> bool {
    kvfs_tiers::hbm::driver_present()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_driver_hbm_is_refused_with_a_clear_error() {
    if driver() {
        eprintln!("a CUDA driver is present: the no-driver refusals are not reachable here");
        return;
    }
    // A node asked for HBM exits at once, saying why.
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(kvfs_bin())
            .args(["node", "--master", "127.0.0.1:9", "--dram", "16MiB", "--hbm", "64MiB"])
            .output(),
    )
    .await
    .expect("the node must exit, not wait for its master")
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA driver found"), "stderr: {err}");
    // A put for HBM in a cluster without HBM fails clearly, and nothing is left behind.
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    let e = c.put("gpu/a", b"bytes", &hbm(1)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(e.to_string().contains("no node contributes a Hbm segment"), "{e}");
    assert_eq!(c.get("gpu/a").await.unwrap_err().kind(), ErrorKind::NotFound);
    c.put("gpu/a", b"bytes", &PutOptions::default()).await.unwrap();
    assert_eq!(c.get("gpu/a").await.unwrap(), b"bytes");
}

/// The tier manager's `Move` over the real RPC, where no node has HBM: each bad request is
/// refused with its reason, and the object stays where it was, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_a_node_cannot_make_are_refused_and_lose_nothing() {
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let c = cluster.client().await;
    c.put("move/a", b"dram bytes", &PutOptions::default()).await.unwrap();
    let rpc = RpcConn::connect(&cluster.master_addr, no_handler(), RpcOptions::default())
        .await
        .expect("the master answers");
    let call = |req: MasterRequest| {
        let rpc = &rpc;
        async move {
            let r: MasterResponse = rpc.call(&req, Duration::from_secs(10)).await.unwrap();
            r
        }
    };
    let version = w::STORE_PROTOCOL_VERSION;
    let hello = MasterRequest::Hello { version, role: Role::Client, host: "mover".into() };
    assert!(matches!(call(hello).await, MasterResponse::Hello { .. }));
    let MasterResponse::Stat(mut views) = call(MasterRequest::Stat(vec!["move/a".into()])).await
    else {
        panic!("no stat answer")
    };
    let view = views.pop().unwrap().unwrap();
    let node = view.replicas[0].node.expect("a node replica");
    let item = |key: &str, v: u64, from: w::Tier, to: w::Tier| MoveItem {
        key: key.into(),
        version: v,
        from,
        to,
    };
    let (dram, hbm, nvme) = (w::Tier::Dram, w::Tier::Hbm, w::Tier::Nvme);
    let items = vec![
        item("move/a", view.version, dram, hbm),
        item("move/a", view.version + 1, dram, hbm),
        item("move/a", view.version, nvme, dram),
        item("move/a", view.version, hbm, dram),
        item("move/none", 1, hbm, dram),
    ];
    let MasterResponse::Move(out) = call(MasterRequest::Move { node, items }).await else {
        panic!("no move answer")
    };
    let codes: Vec<Option<ErrorCode>> =
        out.iter().map(|r| r.as_ref().err().map(|e| e.code)).collect();
    use ErrorCode::*;
    // A move down into DRAM where the node holds a DRAM copy already has nothing to do.
    let want = [Some(NoSpace), Some(Conflict), Some(InvalidArgument), None, Some(NotFound)];
    assert_eq!(codes, want, "{out:?}");
    let msg = &out[0].as_ref().unwrap_err().message;
    assert!(msg.contains("no Hbm range on node"), "{msg}");
    assert_eq!(c.get("move/a").await.unwrap(), b"dram bytes");
    let after = c.stat("move/a").await.unwrap();
    assert_eq!(after.replicas.len(), 1);
    assert_eq!(after.replicas[0].tier, Tier::Dram);
}

/// Sizes across the engine's 2 MiB staging pieces: inside one, across several, not aligned.
const SIZES: [usize; 6] = [1, 4096, (1 << 20) + 3, (5 << 20) + 7, 16 << 20, 64 << 20];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbm_objects_live_in_gpu_memory_and_read_back_byte_exact() {
    if !driver() {
        // scripts/test-gpu sets this: there a skip would hide a machine that lost its driver.
        assert!(std::env::var_os("KVFS_REQUIRE_GPU").is_none(), "KVFS_REQUIRE_GPU: no driver");
        eprintln!("no CUDA driver: run scripts/test-gpu on a GPU machine for this test");
        return;
    }
    let mut opts = ClusterOpts { nodes: 2, ..ClusterOpts::default() };
    opts.node_args.extend(["--hbm".to_string(), "512MiB".to_string()]);
    let cluster = Cluster::start(opts).await;
    let c = cluster.client().await;
    // Bytes API, two replicas (one in each node's GPU), then a get of each.
    for (i, &size) in SIZES.iter().enumerate() {
        let key = format!("gpu/bytes/{size}");
        let v = content(i as u64, size);
        c.put(&key, &v, &hbm(2)).await.unwrap();
        let info = c.stat(&key).await.unwrap();
        assert_eq!(info.replicas.len(), 2, "{key}");
        assert!(info.replicas.iter().all(|r| r.tier == Tier::Hbm), "{key}: {:?}", info.replicas);
        let got = c.get(&key).await.unwrap();
        assert!(got == v, "{key}: bytes differ");
    }
    // Zero-copy API in a batch, from and into registered host buffers.
    let src = c.engine().alloc_buffer(96 << 20, &BufferOptions::default()).unwrap();
    let dst = c.engine().alloc_buffer(96 << 20, &BufferOptions::default()).unwrap();
    let keys: Vec<String> = SIZES.iter().map(|s| format!("gpu/zero/{s}")).collect();
    let mut off = 0u64;
    let mut puts = Vec::new();
    for (i, &size) in SIZES.iter().enumerate() {
        src.write_at(off as usize, &content(100 + i as u64, size)).unwrap();
        puts.push(PutFrom { key: &keys[i], addr: src.addr() + off, len: size as u64 });
        off += size as u64;
    }
    assert!(c.put_from_batch(&puts, &hbm(1)).await.iter().all(|r| r.is_ok()));
    let gets: Vec<GetInto> = puts
        .iter()
        .map(|p| GetInto { key: p.key, addr: dst.addr() + (p.addr - src.addr()), cap: p.len })
        .collect();
    for (p, r) in puts.iter().zip(c.get_into_batch(&gets).await) {
        assert_eq!(r.unwrap(), p.len);
    }
    let mut a = vec![0u8; off as usize];
    let mut b = vec![0u8; off as usize];
    src.read_at(0, &mut a).unwrap();
    dst.read_at(0, &mut b).unwrap();
    assert!(a == b, "zero-copy batch: bytes differ");
    // Many small objects in one batch (packed requests), DRAM and HBM side by side.
    let small: Vec<(String, Vec<u8>)> =
        (0..64).map(|i| (format!("gpu/small/{i}"), content(500 + i, 3000 + i as usize))).collect();
    let items: Vec<(&str, &[u8])> = small.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    assert!(c.put_batch(&items, &hbm(1)).await.iter().all(|r| r.is_ok()));
    c.put("gpu/in-dram", b"dram bytes", &PutOptions::default()).await.unwrap();
    let keys: Vec<String> = small.iter().map(|(k, _)| k.clone()).collect();
    for (r, (_, v)) in c.get_batch(&keys).await.into_iter().zip(&small) {
        assert_eq!(&r.unwrap(), v);
    }
    assert_eq!(c.stat("gpu/in-dram").await.unwrap().replicas[0].tier, Tier::Dram);
    // Removal frees the range: the same key fits again, and reads the new bytes.
    // (forced: the get above holds a read lease on it for a while)
    c.remove("gpu/bytes/67108864", true).await.unwrap();
    assert_eq!(c.get("gpu/bytes/67108864").await.unwrap_err().kind(), ErrorKind::NotFound);
    let v = content(999, 64 << 20);
    c.put("gpu/bytes/67108864", &v, &hbm(2)).await.unwrap();
    assert!(c.get("gpu/bytes/67108864").await.unwrap() == v);
}

/// The tier manager's HBM rung: with GPU memory above its high watermark, the coldest HBM
/// objects move down to DRAM (the master allocates the range, the node copies device -> host)
/// until it is under the low one; an object put into HBM and read often moves back up. Every
/// object reads back byte for byte throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_hbm_objects_move_down_to_dram_and_a_hot_one_comes_back() {
    if !driver() {
        assert!(std::env::var_os("KVFS_REQUIRE_GPU").is_none(), "KVFS_REQUIRE_GPU: no driver");
        eprintln!("no CUDA driver: run scripts/test-gpu on a GPU machine for this test");
        return;
    }
    const MIB: usize = 1 << 20;
    let mut opts = ClusterOpts { nodes: 1, ..ClusterOpts::default() };
    let args = ["--hbm", "64MiB", "--hbm-high-watermark", "0.5", "--hbm-low-watermark", "0.25"];
    opts.node_args.extend(args.map(String::from));
    opts.node_args.extend(["--tier-tick-ms", "20", "--promote-min-reads", "2"].map(String::from));
    let cluster = Cluster::start(opts).await;
    let c = cluster.client().await;
    // 12 objects of about 4 MiB: 48 of the 64 MiB, over the 32 MiB high watermark.
    let objs: Vec<(String, Vec<u8>)> = (0..12)
        .map(|i| (format!("gpu/tier/{i}"), content(700 + i, 4 * MIB - 100 + i as usize)))
        .collect();
    for (k, v) in &objs {
        c.put(k, v, &hbm(1)).await.unwrap();
    }
    let tiers_of = |key: String| {
        let c = &c;
        async move {
            let mut t: Vec<Tier> =
                c.stat(&key).await.unwrap().replicas.iter().map(|r| r.tier).collect();
            t.sort_by_key(|t| format!("{t:?}"));
            t
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let demoted = loop {
        let mut hbm_bytes = 0;
        let mut demoted = Vec::new();
        for (k, v) in &objs {
            let t = tiers_of(k.clone()).await;
            if t.contains(&Tier::Hbm) {
                hbm_bytes += v.len();
            } else {
                assert_eq!(t, [Tier::Dram], "{k}: demoted HBM copies land in DRAM");
                demoted.push(k.clone());
            }
        }
        if hbm_bytes <= 32 * MIB {
            break demoted;
        }
        assert!(tokio::time::Instant::now() < deadline, "HBM still holds {hbm_bytes} bytes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(demoted.len() >= 4, "demoted: {demoted:?}");
    for (k, v) in &objs {
        assert!(c.get(k).await.unwrap() == *v, "{k}: bytes differ after the demotions");
    }
    // A demoted object read often goes back into HBM (there is room under the watermark).
    let hot = &demoted[0];
    let v = &objs.iter().find(|(k, _)| k == hot).unwrap().1;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(c.get(hot).await.unwrap() == *v, "{hot}: bytes differ while it moves");
        if tiers_of(hot.clone()).await.contains(&Tier::Hbm) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{hot} never came back to HBM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (k, v) in &objs {
        assert!(c.get(k).await.unwrap() == *v, "{k}: bytes differ after the promotion");
    }
}
