//! A real FUSE mount of a real cluster (master and node in this process), driven by the tools
//! people use: what they show must agree with what was put through the client, and what they
//! write must come back through the client byte for byte.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use kvfs_fs::MountConfig;
use kvfs_fs::names::{key_to_path, path_to_key};

fn tree() -> BTreeMap<String, Vec<u8>> {
    let mut t = BTreeMap::new();
    t.insert("tree/a.bin".to_string(), pattern(100_000, 1));
    t.insert("tree/sub/b.bin".to_string(), pattern(1_500_000, 2));
    t.insert("tree/sub/deeper/c.txt".to_string(), b"hello kvfs\n".to_vec());
    t.insert("tree/50%\0odd".to_string(), pattern(10, 3));
    t.insert("tree/..".to_string(), pattern(20, 4));
    t.insert("tree//empty-component".to_string(), pattern(30, 5));
    t.insert(format!("tree/long/{}", "k".repeat(600)), pattern(4096, 6));
    t.insert("tree/both".to_string(), pattern(40, 7));
    t.insert("tree/both/inner".to_string(), pattern(50, 8));
    t
}

#[test]
fn posix_tools_agree_with_the_client() {
    let c = Cluster::start(ClusterOpts::default());
    let objects = tree();
    for (k, v) in &objects {
        c.put(k, v);
    }
    let m = c.mount(MountConfig::default());
    let root = m.s("");

    // ls -R shows every name, escaped; the object that shares its name with a directory is
    // "both%=" next to the directory "both".
    let ls = sh_ok(&format!("cd {root} && ls -R tree"));
    for name in [
        "a.bin",
        "sub:",
        "deeper",
        "c.txt",
        "50%25%00odd",
        "%2E%2E",
        "%",
        "both",
        "both%=",
        "inner",
    ] {
        assert!(
            ls.lines().any(|l| l == name || l.ends_with(&format!("/{name}"))),
            "ls -R lacks {name:?}:\n{ls}"
        );
    }

    // find: every file maps back to exactly the keys put.
    let found = sh_ok(&format!("cd {root} && find tree -type f"));
    let mut keys: Vec<String> = found
        .lines()
        .map(|p| path_to_key(p).unwrap_or_else(|| panic!("{p:?} is no key")))
        .collect();
    keys.sort();
    assert_eq!(keys, objects.keys().cloned().collect::<Vec<_>>());

    // stat: size and mode.
    for (k, v) in &objects {
        let path = if k == "tree/both" { "tree/both%=".to_string() } else { key_to_path(k) };
        let st = sh_ok(&format!("cd {root} && stat -c '%s %a %F' '{path}'"));
        assert_eq!(st.trim(), format!("{} 444 regular file", v.len()), "{k}");
    }

    // du: the apparent sizes add up.
    let du = sh_ok(&format!("du -sb {root}/tree"));
    let total: usize = objects.values().map(Vec::len).sum();
    assert_eq!(du.split_whitespace().next().unwrap().parse::<usize>().unwrap(), total);

    // cat and sha256sum give the bytes that were put.
    let cat = sh_ok(&format!("cat {root}/tree/sub/deeper/c.txt"));
    assert_eq!(cat, "hello kvfs\n");
    let sums = sh_ok(&format!("cd {root} && find tree -type f -print0 | xargs -0 sha256sum"));
    for line in sums.lines() {
        let (sum, path) = line.split_once("  ").unwrap();
        let key = path_to_key(path).unwrap();
        assert_eq!(sum, sha256_hex(&objects[&key]), "{key}");
    }

    // cp -r out of the mount copies every byte.
    let out = tempfile::tempdir().unwrap();
    sh_ok(&format!("cp -r {root}/tree {}/", out.path().display()));
    for (k, v) in &objects {
        let path = if k == "tree/both" { "tree/both%=".to_string() } else { key_to_path(k) };
        assert_eq!(&std::fs::read(out.path().join(&path)).unwrap(), v, "{k}");
    }

    // getfattr -d: the object's metadata.
    let xa = sh_ok(&format!("getfattr -d --absolute-names {root}/tree/a.bin"));
    let checksum = format!("blake3:{}", blake3::hash(&objects["tree/a.bin"]).to_hex());
    for want in [
        "user.kvfs.key=\"tree/a.bin\"".to_string(),
        "user.kvfs.tier=\"dram\"".into(),
        "user.kvfs.replicas=\"1\"".into(),
        format!("user.kvfs.checksum=\"{checksum}\""),
        "user.kvfs.persistence=\"none\"".into(),
        "user.kvfs.pin=\"none\"".into(),
        "user.kvfs.lease=".into(),
    ] {
        assert!(xa.contains(&want), "getfattr lacks {want}:\n{xa}");
    }
    // Status files are JSON.
    let status = sh_ok(&format!("cat {root}/.kvfs/status.json"));
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert!(v["counters"]["lookups"].as_u64().unwrap() > 0);
    let cluster: serde_json::Value =
        serde_json::from_str(&sh_ok(&format!("cat {root}/.kvfs/cluster.json"))).unwrap();
    assert_eq!(cluster["objects"].as_u64(), Some(objects.len() as u64));
}

#[test]
fn files_copied_in_become_objects() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    let root = m.s("");
    let src = tempfile::tempdir().unwrap();
    let big = pattern(3_000_000, 11);
    std::fs::write(src.path().join("big.bin"), &big).unwrap();
    std::fs::create_dir_all(src.path().join("dir/sub")).unwrap();
    std::fs::write(src.path().join("dir/one"), b"one").unwrap();
    std::fs::write(src.path().join("dir/sub/two"), pattern(70_000, 12)).unwrap();

    sh_ok(&format!(
        "mkdir -p {root}/in/deep && cp {}/big.bin {root}/in/deep/big.bin",
        src.path().display()
    ));
    assert_eq!(c.get("in/deep/big.bin").unwrap(), big);
    sh_ok(&format!("cp -r {}/dir {root}/in/", src.path().display()));
    assert_eq!(c.get("in/dir/one").unwrap(), b"one");
    assert_eq!(c.get("in/dir/sub/two").unwrap(), pattern(70_000, 12));
    sh_ok(&format!("echo -n shell > {root}/in/echoed && printf '%s' '50%' > '{root}/in/a%25b'"));
    assert_eq!(c.get("in/echoed").unwrap(), b"shell");
    assert_eq!(c.get("in/a%b").unwrap(), b"50%");
    // What was written reads back through the mount, with the object's metadata.
    assert_eq!(sh_ok(&format!("cat {root}/in/echoed")), "shell");
    let sum = sh_ok(&format!("sha256sum {root}/in/deep/big.bin"));
    assert!(sum.starts_with(&sha256_hex(&big)));
    let xa = sh_ok(&format!("getfattr -n user.kvfs.checksum --only-values {root}/in/deep/big.bin"));
    assert_eq!(xa, format!("blake3:{}", blake3::hash(&big).to_hex()));
    assert_eq!(sh_ok(&format!("stat -c %a {root}/in/echoed")).trim(), "444");
}

#[test]
fn the_documented_errnos() {
    let c = Cluster::start(ClusterOpts { lease_ttl_ms: 2_000, ..ClusterOpts::default() });
    c.put("e/obj", b"immutable");
    c.put("e/dir/x", b"x");
    let m = c.mount(MountConfig::default());
    let p = |rel: &str| m.s(rel);
    let obj = p("e/obj");

    assert_eq!(
        errno_of(&format!("fd = os.open('{obj}', os.O_WRONLY)\n    os.write(fd, b'x')")),
        libc::EPERM,
        "write to an object without O_TRUNC"
    );
    assert_eq!(errno_of(&format!("os.open('{obj}', os.O_WRONLY | os.O_APPEND)")), libc::EPERM);
    assert_eq!(errno_of(&format!("os.open('{obj}', os.O_RDWR)")), libc::EPERM);
    assert_eq!(
        errno_of(&format!("os.open('{obj}', os.O_WRONLY | os.O_CREAT | os.O_EXCL)")),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(&format!("os.rename('{obj}', '{}')", p("e/dir"))),
        libc::EISDIR,
        "rename over a directory"
    );
    assert_eq!(
        errno_of(&format!("os.rename('{}', '{}')", p("e/dir"), p("e/moved"))),
        libc::EXDEV,
        "rename of a directory keys are under"
    );
    assert_eq!(errno_of(&format!("os.chmod('{obj}', 0o644)")), libc::EPERM);
    assert_eq!(errno_of(&format!("os.truncate('{obj}', 1)")), libc::EPERM);
    assert_eq!(errno_of(&format!("os.setxattr('{obj}', 'user.kvfs.pin', b'hard')")), libc::EPERM);
    assert_eq!(errno_of(&format!("os.symlink('{obj}', '{}')", p("e/link"))), libc::EPERM);
    assert_eq!(errno_of(&format!("os.link('{obj}', '{}')", p("e/hard"))), libc::EPERM);
    assert_eq!(errno_of(&format!("os.open('{}', os.O_RDONLY)", p("e/missing"))), libc::ENOENT);
    assert_eq!(
        errno_of(&format!("os.open('{}', os.O_RDONLY)", p("e/%41"))),
        libc::ENOENT,
        "non-canonical"
    );
    assert_eq!(
        errno_of(&format!("os.open('{}', os.O_WRONLY | os.O_CREAT)", p("e/%41"))),
        libc::EINVAL
    );
    assert_eq!(
        errno_of(&format!("os.open('{}', os.O_WRONLY | os.O_CREAT)", p("e/50%"))),
        libc::EINVAL
    );
    assert_eq!(errno_of(&format!("os.mkdir('{}')", p("e/dir"))), libc::EEXIST);
    assert_eq!(errno_of(&format!("os.rmdir('{}')", p("e/dir"))), libc::ENOTEMPTY);
    assert_eq!(errno_of(&format!("os.unlink('{}')", p("e/dir"))), libc::EISDIR);
    assert_eq!(
        errno_of(&format!("os.open('{}', os.O_WRONLY)", p(".kvfs/status.json"))),
        libc::EPERM
    );
    assert_eq!(
        errno_of(&format!("os.open('{}', os.O_WRONLY | os.O_CREAT)", p(".kvfs/new"))),
        libc::EPERM
    );
    let long = "k".repeat(250);
    let too_long = format!(
        "{}/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/{long}%+/tail",
        p("e")
    );
    assert_eq!(errno_of(&format!("os.makedirs('{}')", too_long)), libc::ENAMETOOLONG);
    // An empty file cannot be an object: close says so, and nothing is left.
    assert_eq!(
        errno_of(&format!("os.close(os.open('{}', os.O_WRONLY | os.O_CREAT))", p("e/empty"))),
        libc::EINVAL
    );
    assert!(!c.exists("e/empty"));
    assert_eq!(errno_of(&format!("os.stat('{}')", p("e/empty"))), libc::ENOENT);

    // A read lease (taken by any get) does not stop unlink: the name goes at once (POSIX).
    c.get("e/obj").unwrap();
    assert_eq!(errno_of(&format!("os.unlink('{obj}')")), 0, "unlink a leased object");
    assert!(!c.exists("e/obj"));
    assert_eq!(errno_of(&format!("os.stat('{obj}')")), libc::ENOENT);

    // mkdir/rmdir of a directory no key is under lives in the daemon.
    assert_eq!(errno_of(&format!("os.mkdir('{}')", p("e/made"))), 0);
    assert_eq!(errno_of(&format!("os.rmdir('{}')", p("e/made"))), 0);
    assert_eq!(errno_of(&format!("os.rmdir('{}')", p("e/made"))), libc::ENOENT);
}

#[test]
fn a_failed_commit_fails_close_and_leaves_nothing() {
    // The node holds 32 MiB: a 40 MiB file cannot be stored.
    let c = Cluster::start(ClusterOpts { dram_bytes: 32 << 20, ..ClusterOpts::default() });
    let m = c.mount(MountConfig { staging_file_bytes_max: 64 << 20, ..MountConfig::default() });
    let f = m.s("big");
    let e = errno_of(&format!(
        "fd = os.open('{f}', os.O_WRONLY | os.O_CREAT)\n    os.write(fd, bytes(40 << 20))\n    os.close(fd)"
    ));
    assert_eq!(e, libc::ENOSPC);
    assert!(!c.exists("big"));
    assert_eq!(errno_of(&format!("os.stat('{f}')")), libc::ENOENT);
    assert!(!sh_ok(&format!("ls {}", m.s(""))).contains("big"));

    // A file larger than the staging limit fails at write (a larger write is cut short at
    // the limit; the next one fails).
    let m2 = c.mount(MountConfig { staging_file_bytes_max: 1 << 20, ..MountConfig::default() });
    let e = errno_of(&format!(
        "fd = os.open('{}', os.O_WRONLY | os.O_CREAT)\n    for _ in range(3):\n        os.write(fd, bytes(1 << 20))",
        m2.s("huge")
    ));
    assert_eq!(e, libc::EFBIG);
    // First writer wins: if another put of the key completes first, close says EEXIST.
    let race = m2.s("race");
    let script = format!(
        "import os, sys\nfd = os.open('{race}', os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'mine')\nprint('written', flush=True)\nsys.stdin.readline()\ntry:\n    os.close(fd)\n    print(0)\nexcept OSError as e:\n    print(e.errno)\n"
    );
    let mut child = std::process::Command::new("python3")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Nothing may hang the suite: the writer is killed after 60 s whatever happens.
    let pid = child.id() as i32;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            // SAFETY: kill(2) of the test's own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "written");
    c.put("race", b"theirs");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    child.wait().unwrap();
    let _ = done_tx.send(());
    assert_eq!(line.trim(), libc::EEXIST.to_string());
    assert_eq!(c.get("race").unwrap(), b"theirs");
}

#[test]
fn a_writer_killed_before_close_leaves_no_object() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    sh_ok(&format!("mkdir {}", m.s("k")));
    // The writer opens the file, writes, and is killed: the kernel closes the file for it.
    let e = errno_of(&format!(
        "fd = os.open('{}', os.O_WRONLY | os.O_CREAT)\n    os.write(fd, b'partial')\n    os.kill(os.getpid(), 9)",
        m.s("k/victim")
    ));
    assert_eq!(e, -libc::SIGKILL);
    assert!(!c.exists("k/victim"));
    assert_eq!(errno_of(&format!("os.stat('{}')", m.s("k/victim"))), libc::ENOENT);
    // A writer that exits normally without closing (its stdout) still commits.
    sh_ok(&format!("printf whole > {}", m.s("k/ok")));
    sh_ok(&format!("bash -c 'printf exited; exit 0' > {}", m.s("k/exited")));
    assert_eq!(c.get("k/ok").unwrap(), b"whole");
    assert_eq!(c.get("k/exited").unwrap(), b"exited");
    let status: serde_json::Value =
        serde_json::from_str(&sh_ok(&format!("cat {}", m.s(".kvfs/status.json")))).unwrap();
    assert_eq!(status["counters"]["aborted_writes"], 1);
    assert_eq!(status["pending_writes"], 0);
}

#[test]
fn directory_listings_are_paged_and_complete() {
    let c = Cluster::start(ClusterOpts::default());
    for i in 0..40 {
        c.put(&format!("p/f{i:02}"), &pattern(10, i));
    }
    for i in 0..5 {
        c.put(&format!("p/d{i}/x"), b"x");
    }
    // "m" is an object and a directory; "m-0".."m-9" sort between them, so with pages of 7
    // the directory comes pages after the object.
    c.put("p/m", b"object m");
    for i in 0..10 {
        c.put(&format!("p/m-{i}"), b"-");
    }
    c.put("p/m/inside", b"in");
    // A long name (a chain of %+ directories) among them.
    let long = format!("p/{}", "z".repeat(700));
    c.put(&long, b"long");
    let m = c.mount(MountConfig { list_page_entries: 7, ..MountConfig::default() });
    let ls = sh_ok(&format!("ls -a {}", m.s("p")));
    let names: Vec<&str> = ls.lines().collect();
    assert_eq!(names.len(), 2 + 40 + 5 + 2 + 10 + 1, "{ls}");
    assert!(names.contains(&"m") && names.contains(&"m%="));
    assert_eq!(sh_ok(&format!("cat '{}'", m.s("p/m%="))), "object m");
    assert_eq!(sh_ok(&format!("cat {}", m.s("p/m/inside"))), "in");
    let found = sh_ok(&format!("cd {} && find p -type f | wc -l", m.s("")));
    assert_eq!(found.trim(), (40 + 5 + 1 + 10 + 1 + 1).to_string());
    let long_path = key_to_path(&long);
    assert_eq!(sh_ok(&format!("cat {}", m.s(&long_path))), "long");
    assert_eq!(sh_ok(&format!("cd {} && find p -type f -name 'z*'", m.s(""))).trim(), long_path);
}
