//! `kvfs bench fs`: reading objects through the mount against the machine's memcpy, all in the
//! same run: FUSE cold (neither the page cache nor the daemon holds the object), FUSE warm
//! (page cache), the ioctl fast path from Rust (one batch of one get into a registered buffer),
//! the same from Python (`kvfs.fastpath` in a child process), and a plain memcpy of the same
//! size.
//!
//! The bench runs a one-machine cluster in this process (master, node, mount at a temporary
//! directory, as `kvfs up --mount` does), puts one object per size, and measures each mode for
//! at least `min_ms`. A cold read opens the file, drops its page cache
//! (`posix_fadvise(DONTNEED)`), reads it whole and closes it; between cold reads the bench waits
//! for the daemon to see the close, so every cold read fetches the object from the node again.
//! Throughput is bytes over the time spent inside the measured operations. Figures are held
//! against single-thread memcpy of `limit_bytes` (1 GiB), and the fast paths also against FUSE
//! cold (limit `fuse-cold`); the Python fast path also against the Rust one, whose reads are
//! taken half right before and half right after the Python ones (limit `fastpath`, the ratio
//! python/rust). Needs root and /dev/fuse.
//!
//! The Python figure runs `python/bench/bench_fastpath.py` (embedded in the binary) with the
//! interpreter `python` names, once per size, timed from Python around each call. Where that
//! interpreter cannot `import kvfs.fastpath`, the bench prints a note and goes on without the
//! Python figures; a Python run that fails after the import worked fails the bench.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_fs::abi::{self, sys};
use kvfs_fs::{Mount, MountConfig, MountProbe};
use kvfs_master::service::{MasterService, ServiceConfig};
use kvfs_node::{Node, NodeConfig};

use super::limits::memcpy_gbps;
use super::report::{Figure, Reporter, Samples};

/// Options of `kvfs bench fs`.
#[derive(Debug, Clone)]
pub struct FsBench {
    pub sizes: Vec<u64>,
    pub min_ms: u64,
    pub json: bool,
    pub limit_bytes: usize,
    /// The Python interpreter of the `fastpath-python` figure.
    pub python: String,
}

/// The Python half of the bench (reads through `kvfs.fastpath`), run as `python -c`.
const PYTHON_BENCH: &str = include_str!("../../../python/bench/bench_fastpath.py");
/// Fill byte of the bench's objects (the Python bench checks it once).
const FILL: u8 = 0xa5;

const KEY_OFF: usize = 4096;
const DATA_OFF: usize = 1 << 20;

pub async fn run(opts: FsBench) -> anyhow::Result<()> {
    if opts.sizes.is_empty() || opts.sizes.contains(&0) {
        bail!("sizes must be positive");
    }
    let largest = *opts.sizes.iter().max().unwrap_or(&1);
    let total: u64 = opts.sizes.iter().sum();
    let mut cfg = ServiceConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: None,
        ..ServiceConfig::default()
    };
    cfg.directory.object_size_max = largest.max(cfg.directory.object_size_max);
    // Apart from the node's runtime, as `kvfs up` runs it (see `OwnRuntime`).
    let master_rt = crate::cmd::OwnRuntime::new("kvfs-master")?;
    let master = master_rt.run(MasterService::start(cfg)).await?.context("starting the master")?;
    let addr = master.rpc_addr().to_string();
    let node = Node::start(NodeConfig {
        master: addr.clone(),
        dram_bytes: total + (64 << 20),
        ..NodeConfig::default()
    })
    .await
    .context("starting the node")?;
    node.wait_registered(Duration::from_secs(10)).await?;
    let client =
        Client::connect(ClientConfig { master: addr.clone(), ..ClientConfig::default() }).await?;
    for &size in &opts.sizes {
        let data = vec![FILL; size as usize];
        client.put(&key_of(size), &data, &PutOptions::default()).await?;
    }
    let dir = std::env::temp_dir().join(format!("kvfs-bench-fs-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mount_client =
        Client::connect(ClientConfig { master: addr, ..ClientConfig::default() }).await?;
    let (mcfg, rt) = (
        MountConfig { mountpoint: dir.clone(), ..MountConfig::default() },
        tokio::runtime::Handle::current(),
    );
    let mount = tokio::task::spawn_blocking(move || Mount::start(mcfg, mount_client, rt))
        .await?
        .context("mounting (the fs bench needs root and /dev/fuse)")?;
    let result = measure(&opts, &mount, &dir, largest).await;
    // Let the daemon see the last closes before unmounting.
    let probe = mount.probe();
    for _ in 0..200 {
        if probe.open_handles() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = tokio::task::spawn_blocking(move || mount.unmount()).await;
    let _ = std::fs::remove_dir(&dir);
    node.shutdown().await;
    drop(master);
    result
}

fn key_of(size: u64) -> String {
    format!("bench/obj-{size}")
}

async fn measure(opts: &FsBench, mount: &Mount, dir: &Path, largest: u64) -> anyhow::Result<()> {
    let mut rep = Reporter::new(opts.json);
    let limit_bytes = opts.limit_bytes;
    let memcpy = tokio::task::spawn_blocking(move || memcpy_gbps(limit_bytes)).await?;
    rep.emit(&Figure {
        bench: "fs",
        case: "limit 1 thread".into(),
        mode: Some("memcpy".into()),
        op: "memcpy".into(),
        size_bytes: Some(limit_bytes as u64),
        gbps: Some(memcpy),
        limit: Some("memcpy".into()),
        ..Default::default()
    });
    let fast = FastPath::open(dir, largest as usize)?;
    let python = python_usable(&opts.python);
    let min = Duration::from_millis(opts.min_ms);
    for &size in &opts.sizes {
        let path = dir.join(kvfs_fs::names::key_to_path(&key_of(size)));
        let cold = blocking({
            let path = path.clone();
            let probe = mount.probe();
            move || cold_reads(&path, size, min, probe)
        })
        .await?;
        let warm = blocking({
            let path = path.clone();
            move || warm_reads(&path, size, min)
        })
        .await?;
        // With the Python figure, the Rust one is taken half before and half after it, so a
        // change in the machine's load during the pair weighs on both alike.
        let rust_min = if python.is_some() { min / 2 } else { min };
        let rust_gets = || {
            let fast = fast.clone();
            blocking(move || fast.gets(&key_of(size), size, rust_min))
        };
        let mut fp = rust_gets().await?;
        let py = match &python {
            Some(p) => {
                let py = python_gets(p, mount, dir, size, opts.min_ms).await?;
                fp.merge(rust_gets().await?);
                Some(py)
            }
            None => None,
        };
        let mc = blocking(move || memcpy_samples(size, min)).await?;
        // One figure: `mode`'s samples as case `case`, against `limit` measured at `limit_gbps`.
        let mut against = |case: &str, mode: &str, mut s: Samples, limit: &str, limit_gbps: f64| {
            rep.emit(&Figure {
                bench: "fs",
                case: case.into(),
                mode: Some(mode.into()),
                op: "read".into(),
                size_bytes: Some(size),
                gbps: Some(s.gbps()),
                ops_per_s: Some(s.ops_per_s()),
                p50_us: s.percentile(0.5),
                p99_us: s.percentile(0.99),
                limit: Some(limit.into()),
                limit_gbps: Some(limit_gbps),
                ..Default::default()
            })
        };
        let (cold_gbps, fp_gbps) = (cold.gbps(), fp.gbps());
        against("fuse-cold", "fuse-cold", cold, "memcpy", memcpy);
        against("fuse-warm", "fuse-warm", warm, "memcpy", memcpy);
        against("fastpath", "fastpath", fp.clone(), "memcpy", memcpy);
        if let Some(py) = &py {
            against("fastpath-python", "fastpath-python", py.clone(), "memcpy", memcpy);
        }
        against("memcpy", "memcpy", mc, "memcpy", memcpy);
        against("fastpath vs cold", "fastpath", fp, "fuse-cold", cold_gbps);
        if let Some(py) = py {
            against("python vs rust", "fastpath-python", py.clone(), "fastpath", fp_gbps);
            against("python vs cold", "fastpath-python", py, "fuse-cold", cold_gbps);
        }
    }
    Ok(())
}

/// `python` if it imports `kvfs.fastpath`; otherwise a note says the Python figure is skipped.
fn python_usable(python: &str) -> Option<String> {
    let out = std::process::Command::new(python).args(["-c", "import kvfs.fastpath"]).output();
    let why = match out {
        Ok(o) if o.status.success() => return Some(python.to_string()),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            err.lines().last().unwrap_or("it exited with an error").trim().to_string()
        }
        Err(e) => format!("cannot run it: {e}"),
    };
    eprintln!(
        "note: the fastpath-python figure is skipped: `{python} -c 'import kvfs.fastpath'` \
         failed ({why}); install the kvfs package (pip install ./python) into that Python, or \
         pass --python PATH (or set KVFS_PYTHON)"
    );
    None
}

/// Runs the Python fast-path bench against the mount for one object; its samples.
async fn python_gets(
    python: &str,
    mount: &Mount,
    dir: &Path,
    size: u64,
    min_ms: u64,
) -> anyhow::Result<Samples> {
    let probe = mount.probe();
    let before = probe.open_handles();
    let out = tokio::process::Command::new(python)
        .args(["-c", PYTHON_BENCH, "--mount"])
        .arg(dir)
        .args(["--key", &key_of(size), "--size", &size.to_string()])
        .args(["--min-ms", &min_ms.to_string(), "--fill", &FILL.to_string()])
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {python} for the fastpath-python figure"))?;
    if !out.status.success() {
        bail!(
            "the Python fast-path bench ({python}) failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("the Python fast-path bench printed {line:?}"))?;
    let lat_us: Vec<f64> = v["lat_us"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    let s = Samples {
        bytes: v["bytes"].as_u64().unwrap_or(0),
        ops: v["ops"].as_u64().unwrap_or(0),
        elapsed_s: v["elapsed_s"].as_f64().unwrap_or(0.0),
        lat_us,
    };
    if s.ops == 0 || s.elapsed_s <= 0.0 || s.lat_us.len() as u64 != s.ops {
        bail!("the Python fast-path bench printed no samples: {line:?}");
    }
    // The child's control file must be released before the next cold read counts handles.
    let deadline = Instant::now() + Duration::from_secs(5);
    while probe.open_handles() > before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(s)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

/// Runs `op` until `min` has passed (at least 5 times); time inside `op` only.
fn repeat(
    size: u64,
    min: Duration,
    mut op: impl FnMut() -> anyhow::Result<Duration>,
) -> anyhow::Result<Samples> {
    let mut s = Samples::default();
    let start = Instant::now();
    let mut inside = Duration::ZERO;
    while s.ops < 5 || start.elapsed() < min {
        let t = op()?;
        inside += t;
        s.lat_us.push(t.as_secs_f64() * 1e6);
        s.ops += 1;
        s.bytes += size;
    }
    s.elapsed_s = inside.as_secs_f64();
    Ok(s)
}

fn read_whole(f: &mut std::fs::File, buf: &mut [u8]) -> anyhow::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = f.read(&mut buf[got..])?;
        if n == 0 {
            bail!("short read: {got} of {} bytes", buf.len());
        }
        got += n;
    }
    Ok(())
}

fn cold_reads(path: &Path, size: u64, min: Duration, probe: MountProbe) -> anyhow::Result<Samples> {
    let mut buf = vec![1u8; size as usize];
    // Handles open before the loop (the fast path's control file) stay open throughout.
    let baseline = probe.open_handles();
    let fetches = || probe.counters()["fetches"].as_u64().unwrap_or(0);
    let before = fetches();
    let s = repeat(size, min, || {
        // The daemon must have seen the last close, or it would still hold the bytes.
        let deadline = Instant::now() + Duration::from_secs(5);
        while probe.open_handles() > baseline && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        let t = Instant::now();
        let mut f = std::fs::File::open(path)?;
        // SAFETY: fadvise on our own open descriptor.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        read_whole(&mut f, &mut buf)?;
        drop(f);
        Ok(t.elapsed())
    })?;
    // Every cold read must have fetched the object from the node again.
    let fetched = fetches() - before;
    if fetched < s.ops {
        bail!("only {fetched} of {} cold reads fetched the object: not cold", s.ops);
    }
    Ok(s)
}

fn warm_reads(path: &Path, size: u64, min: Duration) -> anyhow::Result<Samples> {
    let mut buf = vec![1u8; size as usize];
    read_whole(&mut std::fs::File::open(path)?, &mut buf)?;
    repeat(size, min, || {
        let t = Instant::now();
        read_whole(&mut std::fs::File::open(path)?, &mut buf)?;
        Ok(t.elapsed())
    })
}

fn memcpy_samples(size: u64, min: Duration) -> anyhow::Result<Samples> {
    let src = vec![0x5au8; size as usize];
    let mut dst = vec![1u8; size as usize];
    repeat(size, min, || {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        Ok(t.elapsed())
    })
}

/// A registered buffer on the mount's control file.
#[derive(Clone)]
struct FastPath {
    ctl: std::sync::Arc<sys::Control>,
    buf: std::sync::Arc<sys::SealedMemfd>,
    id: u64,
}

impl FastPath {
    fn open(dir: &Path, largest: usize) -> anyhow::Result<FastPath> {
        let ctl = sys::Control::open(&PathBuf::from(dir)).context("opening /.kvfs/control")?;
        let buf = sys::SealedMemfd::new("kvfs-bench-fs", DATA_OFF + largest)?;
        let id = ctl.register(buf.fd(), buf.len() as u64).context("registering the buffer")?;
        Ok(FastPath { ctl: ctl.into(), buf: buf.into(), id })
    }

    fn gets(&self, key: &str, size: u64, min: Duration) -> anyhow::Result<Samples> {
        self.buf.write_at(KEY_OFF, key.as_bytes());
        let item = abi::Item {
            key_offset: KEY_OFF as u64,
            key_len: key.len() as u32,
            data_offset: DATA_OFF as u64,
            data_len: size,
            ..Default::default()
        };
        let once = || -> anyhow::Result<Duration> {
            self.buf.write_at(0, &item.to_bytes());
            let mut s = abi::Submit {
                abi_version: abi::ABI_VERSION,
                op: abi::OP_GET,
                buffer_id: self.id,
                count: 1,
                ..Default::default()
            };
            let t = Instant::now();
            self.ctl.submit(&mut s)?;
            let took = t.elapsed();
            let mut back = [0u8; abi::Item::SIZE];
            self.buf.read_at(0, &mut back);
            let got = abi::Item::from_bytes(&back).context("item")?;
            if s.ok != 1 || got.status != 0 || got.size != size {
                bail!("fast path get of {key}: status {} size {}", got.status, got.size);
            }
            Ok(took)
        };
        once()?; // warm-up: the node's segment gets mapped in the daemon
        repeat(size, min, once)
    }
}
