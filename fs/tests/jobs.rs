//! `/.kvfs/jobs/`: the master's offload/restore jobs as read-only JSON files, in a real FUSE
//! mount of a real cluster (master and node in this process, sharing a local-directory object
//! store), read with the tools people use.

mod common;

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::*;
use kvfs_client::{JobKind, JobSpec, JobState, JobStatus};
use kvfs_fs::MountConfig;
use serde_json::Value;

fn offload(prefix: &str, concurrency: u32, rate_bytes_per_s: u64) -> JobSpec {
    JobSpec {
        kind: JobKind::Offload { evict: false },
        prefix: prefix.into(),
        concurrency,
        rate_bytes_per_s,
    }
}

/// Polls job `id` through the client until `done` says so (60 s at most).
fn wait_job(c: &Cluster, id: u64, done: impl Fn(&JobStatus) -> bool) -> JobStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = c.rt.block_on(c.client.job(id)).unwrap();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "job {id} stuck: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The status a job file holds, without the fields the mount derives.
fn status_of(mut v: Value) -> Value {
    let m = v.as_object_mut().unwrap();
    for derived in ["kind", "state_name", "percent"] {
        assert!(m.remove(derived).is_some(), "no {derived} in {m:?}");
    }
    v
}

#[test]
fn jobs_are_read_only_json_files_under_dot_kvfs() {
    let store = tempfile::tempdir().unwrap();
    let c = Cluster::start(ClusterOpts {
        object_store: Some(store.path().join("objects")),
        recovery_grace_ms: 0,
        ..ClusterOpts::default()
    });
    let sizes = [100_000usize, 250_000, 7, 4096, 1];
    for (i, &n) in sizes.iter().enumerate() {
        c.put(&format!("j/obj{i}"), &pattern(n, i as u64));
    }
    let m = c.mount(MountConfig::default());
    let jobs = m.p(".kvfs/jobs");

    // The directory sits next to the status files, empty before any job.
    let ls = sh_ok(&format!("ls {}", m.s(".kvfs")));
    assert_eq!(
        ls.lines().collect::<Vec<_>>(),
        ["buffers.json", "cluster.json", "control", "jobs", "status.json"]
    );
    assert_eq!(sh_ok(&format!("stat -c '%a %F' {}", jobs.display())).trim(), "755 directory");
    assert_eq!(sh_ok(&format!("ls -A {}", jobs.display())), "");

    let id = c.rt.block_on(c.client.job_start(offload("j/", 4, 0))).unwrap().id;
    let done = wait_job(&c, id, |s| s.state != JobState::Running);
    assert_eq!(done.state, JobState::Done, "{done:?}");
    let name = format!("{id}.json");
    assert_eq!(sh_ok(&format!("ls {}", jobs.display())).trim(), name);

    // The file is the job's status as the master reports it, with readable names.
    let file = jobs.join(&name);
    let v = read_json(&file);
    assert_eq!(v["id"], id);
    assert_eq!(v["state"], "Done");
    assert_eq!(v["state_name"], "done");
    assert_eq!(v["kind"], "offload");
    assert_eq!(v["spec"]["prefix"], "j/");
    assert_eq!(v["objects_total"], sizes.len());
    assert_eq!(v["objects_done"], sizes.len());
    assert_eq!(v["moved"], sizes.len());
    assert_eq!(v["bytes_total"], sizes.iter().sum::<usize>());
    assert_eq!(v["failed"], 0);
    assert_eq!(v["percent"], 100.0);
    let master = c.rt.block_on(c.client.job(id)).unwrap();
    assert_eq!(status_of(v), serde_json::to_value(&master).unwrap());
    // cat (what people use) gives the same bytes; the mtime is the job's last update.
    let cat: Value = serde_json::from_str(&sh_ok(&format!("cat {}", file.display()))).unwrap();
    assert_eq!(cat["id"], id);
    let md = std::fs::metadata(&file).unwrap();
    assert!(md.is_file());
    assert_eq!(md.mode() & 0o777, 0o444);
    assert_eq!(md.mtime(), (master.updated_ms / 1000) as i64);

    // Names that are no job.
    let p = |rel: &str| jobs.join(rel).display().to_string();
    for missing in [format!("{}.json", id + 1), format!("0{id}.json"), id.to_string(), "x".into()] {
        assert_eq!(errno_of(&format!("open('{}')", p(&missing))), libc::ENOENT, "{missing}");
    }

    // Read-only, all of it.
    let eperm = [
        format!("os.open('{}', os.O_WRONLY)", p(&name)),
        format!("os.open('{}', os.O_RDWR)", p(&name)),
        format!("os.open('{}', os.O_WRONLY | os.O_TRUNC)", p(&name)),
        format!("os.truncate('{}', 0)", p(&name)),
        format!("os.open('{}', os.O_WRONLY | os.O_CREAT)", p("new.json")),
        format!("os.open('{}', os.O_WRONLY | os.O_CREAT)", p(&format!("{}.json", id + 1))),
        format!("os.unlink('{}')", p(&name)),
        format!("os.rename('{}', '{}')", p(&name), p("renamed.json")),
        format!("os.rename('{}', '{}')", p(&name), m.s("j/stolen")),
        format!("os.rename('{}', '{}')", m.s("j/obj0"), p("planted.json")),
        format!("os.mkdir('{}')", p("sub")),
        format!("os.rmdir('{}')", p("")),
        format!("os.rename('{}', '{}')", p(""), m.s(".kvfs/moved")),
    ];
    for op in &eperm {
        assert_eq!(errno_of(op), libc::EPERM, "{op}");
    }
    assert_eq!(sh_ok(&format!("ls {}", jobs.display())).trim(), name, "nothing changed");
    assert!(c.exists("j/obj0") && !c.exists("j/stolen"));

    // A running job: listed first, and each open reads its progress then. Two objects, one at
    // a time, at 3000 B/s: the first is done at once, the second waits ~22 s for its turn (the
    // job counts a completion while it waits only when no other object may start meanwhile,
    // hence one at a time).
    for i in 0..2 {
        c.put(&format!("slow/{i}"), &pattern(64 << 10, 10 + i));
    }
    let slow = c.rt.block_on(c.client.job_start(offload("slow/", 1, 3_000))).unwrap().id;
    let slow_file = jobs.join(format!("{slow}.json"));
    let deadline = Instant::now() + Duration::from_secs(15);
    let v = loop {
        let v = read_json(&slow_file);
        if v["objects_done"] == 1 {
            break v;
        }
        assert!(Instant::now() < deadline, "the first object never showed as done: {v}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(v["state"], "Running");
    assert_eq!(v["state_name"], "running");
    assert_eq!(v["objects_total"], 2);
    assert_eq!(v["percent"], 50.0);
    let listed =
        sh_ok(&format!("python3 -c 'import os; print(*os.listdir(\"{}\"))'", jobs.display()));
    assert_eq!(listed.trim(), format!("{slow}.json {id}.json"), "running jobs first");
    c.rt.block_on(c.client.job_cancel(slow)).unwrap();
}
