//! `kvfs reshard` as users run it: a model's fragment files stored under one layout, written
//! back under another, byte for byte, against a master and a node.

use std::process::Command;
use std::time::Duration;

use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig};
use kvfs_reshard::ModelSpec;
use kvfs_reshard::testing::linear_fragment;

const SPEC: &str = r#"{"tensors": [
  {"name": "embed", "shape": [500, 64], "dtype": "float32", "itemsize": 4, "tp_dim": 0},
  {"name": "l0.qkv", "shape": [64, 192], "dtype": "bfloat16", "itemsize": 2, "tp_dim": 1, "layer": [0, 2]},
  {"name": "l1.qkv", "shape": [64, 192], "dtype": "bfloat16", "itemsize": 2, "tp_dim": 1, "layer": [1, 2]},
  {"name": "l1.experts", "shape": [8, 64, 32], "dtype": "bfloat16", "itemsize": 2, "tp_dim": 2, "ep_dim": 0, "layer": [1, 2]}
]}"#;

fn kvfs(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfs")).args(args).output().expect("run kvfs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_model_stored_under_one_layout_loads_under_another() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let _in_rt = rt.enter();
    let (master, _node, addr) = rt.block_on(async {
        let master = MasterService::start(ServiceConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_listen: None,
            ..ServiceConfig::default()
        })
        .await
        .unwrap();
        let addr = master.rpc_addr().to_string();
        let node = Node::start(NodeConfig {
            master: addr.clone(),
            dram_bytes: 64 << 20,
            populate: false,
            ..NodeConfig::default()
        })
        .await
        .unwrap();
        node.wait_registered(Duration::from_secs(10)).await.unwrap();
        (master, node, addr)
    });
    let dir = tempfile::tempdir().unwrap();
    let spec_path = dir.path().join("model.json");
    std::fs::write(&spec_path, SPEC).unwrap();
    let spec = spec_path.to_str().unwrap();
    let model = ModelSpec::from_json(SPEC).unwrap();
    // The source layout's fragment files, as a training job would write them.
    let src = model.placement("pp2/ep2/tp2").unwrap();
    let src_dir = dir.path().join("src");
    for t in &src.tensors {
        for f in &t.fragments {
            let p = src_dir.join(format!("p{}", f.participant));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join(format!("{}.bin", t.desc.name)), linear_fragment(&t.desc, f))
                .unwrap();
        }
    }
    let (ok, out, err) =
        kvfs(&["reshard", "plan", "--spec", spec, "--from", "pp2/ep2/tp2", "--to", "tp4"]);
    assert!(ok, "{err}");
    assert!(out.contains("pp2/ep2/tp2 -> tp4: 4 tensors, 8 -> 4 participants"), "{out}");
    let (ok, out, err) = kvfs(&[
        "--master",
        &addr,
        "reshard",
        "store",
        "--model",
        "m",
        "--spec",
        spec,
        "--layout",
        "pp2/ep2/tp2",
        "--dir",
        src_dir.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("stored under pp2/ep2/tp2"), "{out}");
    let (ok, out, _) = kvfs(&["--master", &addr, "reshard", "show", "--model", "m"]);
    assert!(ok && out.contains("l1.experts [8, 64, 32] bfloat16"), "{out}");
    for layout in ["tp4", "ep4/dp2"] {
        let out_dir = dir.path().join(layout.replace('/', "_"));
        let (ok, _, err) = kvfs(&[
            "--master",
            &addr,
            "reshard",
            "load",
            "--model",
            "m",
            "--spec",
            spec,
            "--layout",
            layout,
            "--dir",
            out_dir.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        let dst = model.placement(layout).unwrap();
        for t in &dst.tensors {
            for f in &t.fragments {
                let p = out_dir
                    .join(format!("p{}", f.participant))
                    .join(format!("{}.bin", t.desc.name));
                let got = std::fs::read(&p).unwrap();
                assert!(got == linear_fragment(&t.desc, f), "{layout}: {} differs", p.display());
            }
        }
    }
    // Bad input: a missing model, a layout that does not parse, a missing fragment file.
    let (ok, _, err) = kvfs(&["--master", &addr, "reshard", "show", "--model", "nope"]);
    assert!(!ok && err.contains("not found"), "{err}");
    let (ok, _, err) = kvfs(&["reshard", "plan", "--spec", spec, "--from", "tq2", "--to", "tp4"]);
    assert!(!ok && err.contains("tq2"), "{err}");
    std::fs::remove_file(src_dir.join("p0/embed.bin")).unwrap();
    let (ok, _, err) = kvfs(&[
        "--master",
        &addr,
        "reshard",
        "store",
        "--model",
        "m2",
        "--spec",
        spec,
        "--layout",
        "pp2/ep2/tp2",
        "--dir",
        src_dir.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("embed.bin"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    drop(master);
}
