//! FUSE passthrough with real files: a source backed by files in a temporary directory; reads
//! of those objects are served by the kernel from the files (the daemon sees no read), other
//! objects still come through the daemon.

mod common;

use std::sync::Arc;

use common::*;
use kvfs_fs::{DirSource, MountConfig};

#[test]
fn objects_in_local_files_are_read_through_passthrough() {
    let c = Cluster::start(ClusterOpts::default());
    let files = tempfile::tempdir().unwrap();
    let source = DirSource::new(files.path());
    let local = pattern(5 << 20, 21);
    c.put("pt/local.bin", &local);
    std::fs::create_dir_all(source.path_of("pt/local.bin").parent().unwrap()).unwrap();
    std::fs::write(source.path_of("pt/local.bin"), &local).unwrap();
    // A file of the wrong size is not used (passthrough would read to its end).
    let other = pattern(70_000, 22);
    c.put("pt/padded.bin", &other);
    let mut padded = other.clone();
    padded.extend_from_slice(&[0u8; 4096]);
    std::fs::write(source.path_of("pt/padded.bin"), &padded).unwrap();
    c.put("pt/remote.bin", &pattern(30_000, 23));

    let m = c.mount(MountConfig { passthrough: Some(Arc::new(source)), ..MountConfig::default() });
    let sum = sh_ok(&format!(
        "sha256sum {} {} {}",
        m.s("pt/local.bin"),
        m.s("pt/padded.bin"),
        m.s("pt/remote.bin")
    ));
    let sums: Vec<&str> = sum.lines().map(|l| l.split_whitespace().next().unwrap()).collect();
    assert_eq!(sums, [sha256_hex(&local), sha256_hex(&other), sha256_hex(&pattern(30_000, 23))]);
    // Read twice more, concurrently: the backing file is shared by the inode's handles.
    sh_ok(&format!("cat {0} > /dev/null & cat {0} > /dev/null; wait", m.s("pt/local.bin")));
    let status: serde_json::Value =
        serde_json::from_str(&sh_ok(&format!("cat {}", m.s(".kvfs/status.json")))).unwrap();
    let counters = &status["counters"];
    assert!(counters["passthrough_opens"].as_u64().unwrap() >= 1, "{status}");
    // Only the two objects not in (exact) local files were fetched by the daemon.
    assert_eq!(counters["fetches"], 2, "{status}");
    assert_eq!(counters["fetch_bytes"].as_u64().unwrap(), 70_000 + 30_000);
}
