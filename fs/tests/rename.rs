//! rename(2), renameat2 and unlink through a real FUSE mount of a real cluster (master and node
//! in this process): atomic publication under concurrent readers (threads here and a reader in
//! another process), replacement of existing, leased, pinned and persisted objects, renames of
//! files still being written, the flags and directories, and POSIX lifetimes of open files.

mod common;

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::{BufRead, Read, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvfs_client::{ErrorKind, Persistence, Pin, PutOptions, Tier};
use kvfs_fs::MountConfig;

/// Versions a writer publishes in the concurrent-reader tests.
const VERSIONS: u64 = 24;
/// In-process reader threads.
const READERS: usize = 3;
/// How long a version may take to reach every reader (a stalled reader fails the test).
const SEEN_WAIT: Duration = Duration::from_secs(15);

/// Version `n` of the published file: a header naming the version and the length, then a
/// pattern seeded by the version. Lengths differ between versions, so a read that mixed two
/// versions or stopped short fails the checks.
fn version_bytes(n: u64) -> Vec<u8> {
    let len = 20_000 + (n as usize * 37_337) % 400_000;
    let header = format!("kvfs-version {n:06} bytes {len:010}\n");
    let mut v = header.into_bytes();
    v.extend(pattern(len - v.len(), 1000 + n));
    assert_eq!(v.len(), len);
    v
}

/// The version a read returned, if it is exactly one whole version.
fn whole_version(data: &[u8], versions: &[Vec<u8>]) -> Result<u64, String> {
    let head = std::str::from_utf8(data.get(..36).ok_or("shorter than a header")?)
        .map_err(|_| "no header")?;
    let n: u64 = head
        .strip_prefix("kvfs-version ")
        .and_then(|r| r.get(..6))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad header {head:?}"))?;
    let want = versions.get(n as usize).ok_or_else(|| format!("version {n} never written"))?;
    if data.len() != want.len() {
        return Err(format!("version {n}: read {} bytes of {}", data.len(), want.len()));
    }
    if data != want.as_slice() {
        return Err(format!("version {n}: bytes differ from what was written"));
    }
    Ok(n)
}

/// Writes `data` to a new (or O_TRUNC-replaced) file and closes it, failing when the close
/// fails (the commit happens at close; `File`'s drop would hide its error).
fn write_and_close(path: &Path, data: &[u8], truncate: bool) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(!truncate)
        .truncate(truncate)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    close_checked(f).unwrap_or_else(|e| panic!("close {}: {e}", path.display()));
}

fn close_checked(f: std::fs::File) -> std::io::Result<()> {
    let fd = f.into_raw_fd();
    // SAFETY: `fd` was just taken from the File, which no longer owns it.
    if unsafe { libc::close(fd) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn renameat2(from: &Path, to: &Path, flags: u32) -> i32 {
    let a = CString::new(from.as_os_str().as_bytes()).unwrap();
    let b = CString::new(to.as_os_str().as_bytes()).unwrap();
    // SAFETY: two valid NUL-terminated paths.
    let r =
        unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), flags) };
    if r == 0 { 0 } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(-1) }
}

/// What one reader saw.
#[derive(Default)]
struct Seen {
    reads: u64,
    estale: u64,
    versions: BTreeSet<u64>,
}

/// A reader in another process: opens and reads the file whole in a loop until `stop` exists,
/// printing `v N` whenever the version it reads changes, then one line of totals.
const PY_READER: &str = r#"
import errno, hashlib, os, sys
path, stop = sys.argv[1], sys.argv[2]
reads = estale = 0
last = None
while not os.path.exists(stop):
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        if e.errno == errno.ESTALE:
            estale += 1
            continue
        print('error', e.errno, flush=True)
        sys.exit(1)
    reads += 1
    n = int(data[13:19])
    if n != last:
        print('v', n, len(data), hashlib.sha256(data).hexdigest(), flush=True)
        last = n
print('done', reads, estale, flush=True)
"#;

/// Publishes `VERSIONS` versions of `dir/final` with `publish` while reader threads and a
/// reader process read it whole in a loop; every read must be exactly one whole version, no
/// reader may see the name missing or go back to an older version, and every reader sees
/// every version (the writer waits for that before publishing the next one, so readers and
/// publications overlap all along).
fn publish_under_readers(publish: impl Fn(&MountGuard, u64, &[u8])) {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    std::fs::create_dir(m.p("dir")).unwrap();
    let versions: Arc<Vec<Vec<u8>>> = Arc::new((0..VERSIONS).map(version_bytes).collect());
    let path = m.p("dir/final");
    // The first version is written plainly: from here on the name must always be there.
    write_and_close(&path, &versions[0], false);

    let stop = Arc::new(AtomicBool::new(false));
    let latest: Arc<Vec<AtomicI64>> = Arc::new((0..READERS).map(|_| AtomicI64::new(-1)).collect());
    let mut readers = Vec::new();
    for r in 0..READERS {
        let (stop, latest, versions, path) =
            (stop.clone(), latest.clone(), versions.clone(), path.clone());
        readers.push(std::thread::spawn(move || -> Result<Seen, String> {
            let mut seen = Seen::default();
            while !stop.load(Ordering::Acquire) {
                let data = match std::fs::read(&path) {
                    Ok(d) => d,
                    Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {
                        seen.estale += 1;
                        continue;
                    }
                    Err(e) => return Err(format!("reader {r}: {e}")),
                };
                seen.reads += 1;
                let n = whole_version(&data, &versions).map_err(|e| format!("reader {r}: {e}"))?;
                let last = latest[r].load(Ordering::Acquire);
                if (n as i64) < last {
                    return Err(format!("reader {r} read version {n} after {last}"));
                }
                latest[r].store(n as i64, Ordering::Release);
                seen.versions.insert(n);
            }
            Ok(seen)
        }));
    }

    let stop_file = tempfile::tempdir().unwrap();
    let stop_path = stop_file.path().join("stop");
    let mut py = std::process::Command::new("python3")
        .args(["-c", PY_READER])
        .arg(&path)
        .arg(&stop_path)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let py_pid = py.id() as i32;
    let watchdog = Arc::new(AtomicBool::new(false));
    {
        // Nothing may hang the suite: the reader process is killed after 120 s.
        let watchdog = watchdog.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !watchdog.load(Ordering::Acquire) {
                if Instant::now() > deadline {
                    // SAFETY: kill(2) of the test's own child.
                    unsafe { libc::kill(py_pid, libc::SIGKILL) };
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
    }
    let py_latest = Arc::new(AtomicI64::new(-1));
    let py_lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let py_out = {
        let (py_latest, py_lines) = (py_latest.clone(), py_lines.clone());
        let out = std::io::BufReader::new(py.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if let Some(v) = line.strip_prefix("v ") {
                    let n: i64 = v.split(' ').next().unwrap().parse().unwrap();
                    py_latest.store(n, Ordering::Release);
                }
                py_lines.lock().unwrap().push(line);
            }
        })
    };

    let mut wait_all_saw = |n: u64| {
        let deadline = Instant::now() + SEEN_WAIT;
        loop {
            let here = latest.iter().all(|l| l.load(Ordering::Acquire) >= n as i64);
            if here && py_latest.load(Ordering::Acquire) >= n as i64 {
                return;
            }
            if let Some(i) = readers.iter().position(|r| r.is_finished()) {
                let r = readers.remove(i).join().unwrap();
                panic!("a reader stopped while waiting for version {n}: {:?}", r.err());
            }
            let lines = py_lines.lock().unwrap().clone();
            assert!(
                Instant::now() < deadline,
                "version {n} did not reach every reader (threads at {:?}, process said {lines:?})",
                latest.iter().map(|l| l.load(Ordering::Acquire)).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    wait_all_saw(0);
    for n in 1..VERSIONS {
        publish(&m, n, &versions[n as usize]);
        wait_all_saw(n);
    }
    stop.store(true, Ordering::Release);
    std::fs::write(&stop_path, b"").unwrap();
    let status = py.wait().unwrap();
    watchdog.store(true, Ordering::Release);
    py_out.join().unwrap();

    let mut total = Seen::default();
    for r in readers {
        let s = r.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.versions.len() as u64, VERSIONS, "a reader missed versions");
        total.reads += s.reads;
        total.estale += s.estale;
    }
    let lines = py_lines.lock().unwrap().clone();
    assert!(status.success(), "the reader process failed: {lines:?}");
    let mut py_seen = BTreeSet::new();
    let mut py_last = -1i64;
    for l in &lines {
        let f: Vec<&str> = l.split(' ').collect();
        match f[0] {
            "v" => {
                let n: u64 = f[1].parse().unwrap();
                assert!(n as i64 > py_last, "the reader process went back to version {n}");
                py_last = n as i64;
                let want = &versions[n as usize];
                assert_eq!(f[2].parse::<usize>().unwrap(), want.len(), "process read of v{n}");
                assert_eq!(f[3], sha256_hex(want), "process read of v{n}: bytes differ");
                py_seen.insert(n);
            }
            "done" => {
                total.reads += f[1].parse::<u64>().unwrap();
                total.estale += f[2].parse::<u64>().unwrap();
            }
            other => panic!("reader process said {other}: {lines:?}"),
        }
    }
    assert_eq!(py_seen.len() as u64, VERSIONS, "the reader process missed versions: {lines:?}");
    assert!(lines.last().is_some_and(|l| l.starts_with("done")), "{lines:?}");
    eprintln!("{} whole reads, {} ESTALE retries", total.reads, total.estale);
    // ESTALE is only for an open that raced a publication before its first read: rare.
    assert!(
        total.estale * 20 <= total.reads,
        "{} ESTALE in {} reads: readers that open and read at once should almost never see it",
        total.estale,
        total.reads
    );
    // The last version is what stays, for the client too.
    assert_eq!(c.get("dir/final").unwrap(), versions[VERSIONS as usize - 1]);
    let names = sh_ok(&format!("ls -a {}", m.s("dir")));
    assert_eq!(names.lines().collect::<Vec<_>>(), [".", "..", "final"], "temp files left");
}

#[test]
fn write_temp_then_rename_publishes_whole_versions_to_concurrent_readers() {
    publish_under_readers(|m, n, data| {
        let tmp = m.p(&format!("dir/.final.{n}.tmp"));
        write_and_close(&tmp, data, false);
        std::fs::rename(&tmp, m.p("dir/final")).unwrap();
    });
}

#[test]
#[ignore = "known gap (about one run in five): the next rewrite's writer shares the inode readers of the current object hold, the kernel grows its size with the writer's direct writes, and a reader of the old object reads its bytes then zeros up to the writer's progress; other mounts and the store API see old or new whole (issue 17 closing note)"]
fn truncating_rewrites_publish_whole_versions_to_concurrent_readers() {
    publish_under_readers(|m, _, data| write_and_close(&m.p("dir/final"), data, true));
}

fn put_with(c: &Cluster, key: &str, data: &[u8], opts: PutOptions) {
    c.rt.block_on(c.client.put(key, data, &PutOptions { checksum: true, ..opts })).unwrap();
}

#[test]
fn rename_replaces_existing_leased_and_pinned_objects() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    let (a, b) = (pattern(70_000, 1), pattern(130_000, 2));

    // Over an existing object: the new name has the renamed bytes, the old name is gone.
    c.put("r/src1", &a);
    c.put("r/dst1", &b);
    std::fs::rename(m.p("r/src1"), m.p("r/dst1")).unwrap();
    assert_eq!(std::fs::read(m.p("r/dst1")).unwrap(), a);
    assert_eq!(std::fs::metadata(m.p("r/src1")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    assert_eq!(c.get("r/dst1").unwrap(), a);
    assert!(!c.exists("r/src1"));

    // Over a leased object: the rename does not wait for the lease.
    c.put("r/src2", &a);
    c.put("r/dst2", &b);
    c.get("r/dst2").unwrap();
    std::fs::rename(m.p("r/src2"), m.p("r/dst2")).unwrap();
    assert_eq!(std::fs::read(m.p("r/dst2")).unwrap(), a);
    assert_eq!(c.get("r/dst2").unwrap(), a);
    assert!(!c.exists("r/src2"));

    // Over a hard-pinned object (the caller names it, as an upsert does).
    c.put("r/src3", &a);
    put_with(&c, "r/dst3", &b, PutOptions { pin: Pin::Hard, ..PutOptions::default() });
    std::fs::rename(m.p("r/src3"), m.p("r/dst3")).unwrap();
    assert_eq!(c.get("r/dst3").unwrap(), a);
    assert!(!c.exists("r/src3"));

    // Of a hard-pinned object: the pin goes with it (so unlink still refuses it).
    put_with(&c, "r/src4", &b, PutOptions { pin: Pin::Hard, ..PutOptions::default() });
    std::fs::rename(m.p("r/src4"), m.p("r/dst4")).unwrap();
    assert_eq!(c.get("r/dst4").unwrap(), b);
    assert!(!c.exists("r/src4"));
    let pin = sh_ok(&format!("getfattr -n user.kvfs.pin --only-values {}", m.s("r/dst4")));
    assert_eq!(pin, "hard");
    assert_eq!(errno_of(&format!("os.unlink('{}')", m.s("r/dst4"))), libc::EPERM);
    assert!(c.exists("r/dst4"));
    // Renaming a name onto itself changes nothing.
    std::fs::rename(m.p("r/dst4"), m.p("r/dst4")).unwrap();
    assert_eq!(c.get("r/dst4").unwrap(), b);
}

/// A file open on an object that a rename then replaces reads the replaced bytes, whole
/// (POSIX: the open file is the old object).
#[test]
fn an_open_file_of_a_renamed_over_object_reads_the_old_bytes_whole() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    let (a, b) = (pattern(70_000, 1), pattern(130_000, 2));
    c.put("o/src", &a);
    c.put("o/dst", &b);
    let mut open = std::fs::File::open(m.p("o/dst")).unwrap();
    std::fs::rename(m.p("o/src"), m.p("o/dst")).unwrap();
    let mut old = Vec::new();
    open.read_to_end(&mut old).unwrap();
    assert!(
        old == b,
        "the open file read {} bytes, not its {} (equal to the first {} bytes of the old object: {})",
        old.len(),
        b.len(),
        old.len(),
        b.starts_with(&old)
    );
    assert_eq!(std::fs::read(m.p("o/dst")).unwrap(), a);
}

/// The object store's objects: key -> previous name.
fn store_listing(root: &Path) -> std::collections::BTreeMap<String, Option<(String, u64)>> {
    let store = kvfs_tiers::ObjectStoreMedium::open(kvfs_tiers::ObjectStoreConfig::Fs {
        root: root.to_path_buf(),
    })
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(store.list_detailed()).unwrap().into_iter().map(|o| (o.key, o.previous)).collect()
}

fn persisted(c: &Cluster, key: &str) -> bool {
    let v = c.rt.block_on(c.client.stat(key)).unwrap();
    v.replicas.iter().any(|r| r.tier == Tier::ObjectStore)
}

#[test]
fn renamed_persisted_objects_move_in_the_object_store() {
    let store = tempfile::tempdir().unwrap();
    let root: PathBuf = store.path().join("objects");
    let opts = || ClusterOpts { object_store: Some(root.clone()), ..ClusterOpts::default() };
    let eager = PutOptions { persistence: Persistence::Eager, ..PutOptions::default() };
    let (kept, victim, over) = (pattern(300_000, 3), pattern(5_000, 4), pattern(9_000, 5));
    {
        let c = Cluster::start(opts());
        put_with(&c, "p/old", &kept, eager.clone());
        put_with(&c, "p/victim", &victim, eager.clone());
        c.put("p/over", &over);
        assert!(persisted(&c, "p/old") && persisted(&c, "p/victim"));
        let m = c.mount(MountConfig::default());
        // Of a persisted object, and of a memory-only one over a persisted one.
        std::fs::rename(m.p("p/old"), m.p("p/new")).unwrap();
        std::fs::rename(m.p("p/over"), m.p("p/victim")).unwrap();
        assert_eq!(std::fs::read(m.p("p/new")).unwrap(), kept);
        assert_eq!(std::fs::read(m.p("p/victim")).unwrap(), over);
        assert!(persisted(&c, "p/new"), "the renamed object is still persisted");
        assert!(!persisted(&c, "p/victim"), "the replacing object was never persisted");

        // In the bucket: the copy is under the new name, naming the old one; the replaced
        // object's copy is deleted (in the background: bounded wait).
        let deadline = Instant::now() + Duration::from_secs(15);
        let listed = loop {
            let l = store_listing(&root);
            if !l.contains_key("p/victim") || Instant::now() > deadline {
                break l;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let keys: Vec<&str> = listed.keys().map(String::as_str).collect();
        assert_eq!(keys, ["p/new"], "the object store holds exactly the renamed copy");
        let prev = listed["p/new"].as_ref().expect("the renamed copy names its previous name");
        assert_eq!(prev.0, "p/old");
    }
    // Everything gone but the object store: a new master scans it, a new node starts empty.
    let c = Cluster::start(opts());
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.rt.block_on(c.client.stats()).unwrap().scanning_object_store {
        assert!(Instant::now() < deadline, "the object store scan did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.get("p/new").unwrap(), kept);
    for gone in ["p/old", "p/victim", "p/over"] {
        assert_eq!(c.get(gone).unwrap_err().kind(), ErrorKind::NotFound, "{gone} came back");
    }
    let m = c.mount(MountConfig::default());
    assert_eq!(std::fs::read(m.p("p/new")).unwrap(), kept);
    assert_eq!(sh_ok(&format!("ls {}", m.s("p"))).trim(), "new");
}

#[test]
fn renames_of_files_being_written_and_the_flags() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    std::fs::create_dir(m.p("w")).unwrap();
    let data = pattern(200_000, 6);

    // Bytes written, renamed before close: committed, under the new name only; the
    // descriptor is then read-only (the rename was the commit).
    let mut f = std::fs::File::create(m.p("w/part")).unwrap();
    f.write_all(&data).unwrap();
    std::fs::rename(m.p("w/part"), m.p("w/whole")).unwrap();
    assert_eq!(f.write(b"more").unwrap_err().raw_os_error(), Some(libc::EPERM));
    close_checked(f).unwrap();
    assert_eq!(c.get("w/whole").unwrap(), data);
    assert!(!c.exists("w/part"));
    assert_eq!(std::fs::read(m.p("w/whole")).unwrap(), data);

    // Renamed before any byte was written: the bytes commit under the new name at close,
    // replacing the object there.
    c.put("w/target", b"to be replaced");
    let mut f = std::fs::File::create(m.p("w/empty")).unwrap();
    std::fs::rename(m.p("w/empty"), m.p("w/target")).unwrap();
    f.write_all(&data[..1000]).unwrap();
    close_checked(f).unwrap();
    assert_eq!(c.get("w/target").unwrap(), &data[..1000]);
    assert!(!c.exists("w/empty"));

    // RENAME_NOREPLACE: EEXIST over an object, both untouched; works onto a free name.
    c.put("w/x", b"x");
    c.put("w/y", b"y");
    assert_eq!(renameat2(&m.p("w/x"), &m.p("w/y"), libc::RENAME_NOREPLACE), libc::EEXIST);
    assert_eq!(c.get("w/x").unwrap(), b"x");
    assert_eq!(c.get("w/y").unwrap(), b"y");
    assert_eq!(renameat2(&m.p("w/x"), &m.p("w/z"), libc::RENAME_NOREPLACE), 0);
    assert_eq!(c.get("w/z").unwrap(), b"x");
    assert!(!c.exists("w/x"));
    // RENAME_EXCHANGE is not offered.
    assert_eq!(renameat2(&m.p("w/y"), &m.p("w/z"), libc::RENAME_EXCHANGE), libc::EINVAL);
    assert_eq!(c.get("w/y").unwrap(), b"y");
    assert_eq!(c.get("w/z").unwrap(), b"x");

    // Directories: an empty one made with mkdir is renamed; one with keys under it is EXDEV.
    std::fs::create_dir(m.p("w/made")).unwrap();
    std::fs::rename(m.p("w/made"), m.p("w/moved")).unwrap();
    assert!(std::fs::metadata(m.p("w/moved")).unwrap().is_dir());
    assert_eq!(std::fs::metadata(m.p("w/made")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    write_and_close(&m.p("w/moved/inside"), b"inside", false);
    assert_eq!(c.get("w/moved/inside").unwrap(), b"inside");
    c.put("w/full/k", b"k");
    let e = std::fs::rename(m.p("w/full"), m.p("w/full2")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
    assert_eq!(c.get("w/full/k").unwrap(), b"k");
}

#[test]
fn unlink_keeps_open_files_whole_and_ignores_leases() {
    let c = Cluster::start(ClusterOpts::default());
    let m = c.mount(MountConfig::default());
    let big = pattern(1_500_000, 7);
    c.put("u/open", &big);
    // One reader opened and has not read yet, one read a little.
    let mut fresh = std::fs::File::open(m.p("u/open")).unwrap();
    let mut started = std::fs::File::open(m.p("u/open")).unwrap();
    let mut head = vec![0u8; 4096];
    started.read_exact(&mut head).unwrap();
    std::fs::remove_file(m.p("u/open")).unwrap();
    assert!(!c.exists("u/open"));
    assert_eq!(std::fs::metadata(m.p("u/open")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    let mut all = Vec::new();
    fresh.read_to_end(&mut all).unwrap();
    assert_eq!(all, big, "an unlinked open file reads whole");
    started.read_to_end(&mut head).unwrap();
    assert_eq!(head, big, "an unlinked file being read reads on to the end");

    // A read lease (any get takes one) does not hold unlink back.
    c.put("u/leased", b"leased");
    c.get("u/leased").unwrap();
    std::fs::remove_file(m.p("u/leased")).unwrap();
    assert!(!c.exists("u/leased"));
    // The name is free again at once.
    write_and_close(&m.p("u/leased"), b"again", false);
    assert_eq!(c.get("u/leased").unwrap(), b"again");
}
