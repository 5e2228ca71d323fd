//! The harness itself: a test process that dies (killed by its runner's timeout, say) takes
//! the kvfs processes it started with it, so a hung test never leaves a master or node running
//! into the next one.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvfs_tests::{Cluster, ClusterOpts};

const VICTIM: &str = "KVFS_TESTS_HARNESS_VICTIM";

/// Run as a child of `children_die_with_the_test_process`: start a master and a node, print
/// their pids, wait to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child of children_die_with_the_test_process, which runs it"]
async fn victim() {
    assert!(std::env::var_os(VICTIM).is_some(), "run by children_die_with_the_test_process");
    let cluster = Cluster::start(ClusterOpts { nodes: 1, ..ClusterOpts::default() }).await;
    let master = cluster.master.as_ref().expect("master").pid();
    let node = cluster.nodes[0].as_ref().expect("node").pid();
    println!("PIDS {master} {node}");
    tokio::time::sleep(Duration::from_secs(120)).await;
}

fn alive(pid: i32) -> bool {
    // A zombie still answers kill(0); /proc says whether it is one.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next());
    !stat.is_empty() && state != Some("Z")
}

#[test]
fn children_die_with_the_test_process() {
    let exe = std::env::current_exe().expect("current_exe");
    let mut victim = Command::new(exe)
        .args(["--exact", "victim", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(VICTIM, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the victim starts");
    let mut lines = BufReader::new(victim.stdout.take().expect("stdout")).lines();
    let pids: Vec<i32> = loop {
        let line = lines.next().expect("the victim printed its children's pids").unwrap();
        // libtest prints `test victim ... ` before the test's own output, on the same line.
        if let Some(at) = line.find("PIDS ") {
            break line[at + 5..].split_whitespace().map(|p| p.parse().unwrap()).collect();
        }
    };
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&p| alive(p)), "master and node run");
    victim.kill().expect("SIGKILL the victim");
    victim.wait().expect("reaped");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "kvfs processes outlived their test process: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
