//! A cluster started with a secret (`--cluster-secret-file`): master, nodes, clients and the
//! CLI that hold it work as before across real processes; a client, a CLI call, a node or a
//! bare Transfer Engine without it (or with another one) is refused at the handshake, with an
//! error that says why, and the cluster loses nothing to the attempts.

use std::process::Command;
use std::time::Duration;

use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_tests::{Cluster, ClusterOpts, Proc, content, kvfs_bin};
use kvfs_transfer::{
    BufferOptions, ClusterSecret, Engine, EngineConfig, ErrorKind, TransferOp, TransferRequest,
};

fn kvfs(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(kvfs_bin());
    cmd.args(args).env_remove("KVFS_CLUSTER_SECRET_FILE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("kvfs runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_secret_refuses_whoever_lacks_it() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, "a cluster secret nobody else has\n").unwrap();
    let other_file = dir.path().join("other");
    std::fs::write(&other_file, "the secret of another cluster\n").unwrap();
    let o = ClusterOpts { nodes: 2, secret_file: Some(secret_file.clone()), ..Default::default() };
    let mut cluster = Cluster::start(o).await;

    // Holders of the secret put and get across processes, byte for byte.
    let c = cluster.client().await;
    for (i, len) in [4096usize, 1 << 20, 8 << 20].into_iter().enumerate() {
        let key = format!("secret/{i}");
        c.put(&key, &content(i as u64, len), &PutOptions::default()).await.unwrap();
        assert!(c.get(&key).await.unwrap() == content(i as u64, len), "{key} reads back exact");
    }

    // A client without the secret, or with another one, is refused when it connects.
    let plain = ClientConfig { master: cluster.master_addr.clone(), ..ClientConfig::default() };
    let e = Client::connect(plain.clone()).await.err().expect("refused");
    assert!(e.to_string().contains("no cluster secret"), "{e}");
    let mut other = plain.clone();
    other.engine.cluster_secret = Some(ClusterSecret::from_file(&other_file).unwrap());
    let e = Client::connect(other).await.err().expect("refused");
    assert!(e.to_string().contains("another cluster secret"), "{e}");

    // A bare engine without the secret cannot reach a node's memory.
    let node_line = cluster.nodes[0].as_ref().unwrap().first_line.clone();
    let segment = node_line.split(" at ").nth(1).and_then(|s| s.split(' ').next()).unwrap();
    let stranger = Engine::start(EngineConfig::default()).await.unwrap();
    let e = stranger.open_segment(segment).await.err().expect("refused");
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(e.to_string().contains("no cluster secret"), "{e}");
    // Nor can one with the secret that addresses memory it may not (the usual checks hold).
    let holder = Engine::start(EngineConfig {
        cluster_secret: Some(ClusterSecret::from_file(&secret_file).unwrap()),
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let seg = holder.open_segment(segment).await.unwrap();
    let buf = holder.alloc_buffer(4096, &BufferOptions::default()).unwrap();
    let req = TransferRequest {
        op: TransferOp::Read,
        segment: seg,
        local_addr: buf.addr(),
        remote_addr: 4096,
        len: 4096,
    };
    assert_eq!(holder.transfer_one(&req).await.unwrap_err().kind(), ErrorKind::OutOfRange);

    // A node without the secret never joins.
    let rogue = Proc::start(&[
        "node".into(),
        "--master".into(),
        cluster.master_addr.clone(),
        "--dram".into(),
        "64MiB".into(),
        "--no-populate".into(),
    ]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.stats().await.unwrap().nodes, 2, "the node without the secret is not registered");
    rogue.kill();

    // The CLI: refused without the secret, served with the flag or the environment variable.
    let file = dir.path().join("object");
    std::fs::write(&file, content(9, 100_000)).unwrap();
    let master = cluster.master_addr.as_str();
    let f = file.to_str().unwrap();
    let out = kvfs(&["put", "--master", master, "cli/one", f], &[]);
    assert!(!out.status.success(), "a put without the secret fails");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cluster secret"), "the CLI says why: {err}");
    let s = secret_file.to_str().unwrap();
    let out = kvfs(&["put", "--master", master, "--cluster-secret-file", s, "cli/one", f], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = dir.path().join("got");
    let g = got.to_str().unwrap();
    let out = kvfs(&["get", "--master", master, "cli/one", g], &[("KVFS_CLUSTER_SECRET_FILE", s)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&got).unwrap() == content(9, 100_000));
    let short = dir.path().join("short");
    std::fs::write(&short, "too short").unwrap();
    let out = kvfs(&["get", "--cluster-secret-file", short.to_str().unwrap(), "cli/one", g], &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16 bytes"));

    // Nothing was lost to the refused attempts.
    for (i, len) in [4096usize, 1 << 20, 8 << 20].into_iter().enumerate() {
        assert!(c.get(&format!("secret/{i}")).await.unwrap() == content(i as u64, len));
    }
    cluster.kill_nodes();
}
