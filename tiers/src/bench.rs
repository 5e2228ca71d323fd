//! Measurements for `kvfs bench tiers`: each figure comes with the machine's own limit measured
//! in the same run, and the ratio between them (DESIGN.md section 11).
//!
//! - [`disk`]: raw O_DIRECT sequential write and read of a file (io_uring, the same chunk size
//!   and queue depth as the NVMe medium, no hashing) against the NVMe medium's `put` and
//!   `get_into` of the same object size, rounds interleaved so drift hits both alike. Writes
//!   include an fsync per object on both sides (the medium's put is durable when it returns).
//!   Two write limits: overwriting one preallocated file (the disk), and writing each object to
//!   a new file (the disk plus the file system's allocation and journal commit per file).
//! - [`blake3_gbps`]: checksum cost, one thread and rayon.
//! - [`writeback`]: lazy write-back throughput DRAM -> object store against direct puts to the
//!   same object store.
//!
//! Absolute numbers on a shared 2-core VM are noise; the ratios are the figures. Nothing here
//! asserts on time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::dram::DramMedium;
use crate::error::{Error, ErrorKind, Result};
use crate::medium::{Medium, PutOptions};
use crate::nvme::{NvmeConfig, NvmeMedium};
use crate::uring::{AlignedBuf, Dir, IoPool, RingConfig, SendPtr};
use crate::writeback::{WritebackConfig, WritebackEvent, WritebackQueue};

/// One line of bench output (the fields of DESIGN.md section 11).
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    pub case: String,
    pub mode: String,
    pub op: &'static str,
    pub size_bytes: u64,
    pub gbps: f64,
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub limit: Option<&'static str>,
    pub limit_gbps: Option<f64>,
    pub ratio: Option<f64>,
}

impl Figure {
    fn from_samples(
        case: &str,
        mode: &str,
        op: &'static str,
        size_bytes: u64,
        samples_us: &mut [f64],
    ) -> Figure {
        samples_us.sort_by(|a, b| a.total_cmp(b));
        let total_s: f64 = samples_us.iter().sum::<f64>() / 1e6;
        let n = samples_us.len().max(1) as f64;
        let pct = |p: f64| {
            samples_us
                .get(((samples_us.len() as f64 - 1.0) * p).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        Figure {
            case: case.into(),
            mode: mode.into(),
            op,
            size_bytes,
            gbps: if total_s > 0.0 { size_bytes as f64 * n / total_s / 1e9 } else { 0.0 },
            ops_per_s: if total_s > 0.0 { n / total_s } else { 0.0 },
            p50_us: pct(0.5),
            p99_us: pct(0.99),
            limit: None,
            limit_gbps: None,
            ratio: None,
        }
    }

    /// Set the limit this figure is measured against.
    pub fn against(mut self, limit: &'static str, limit_gbps: f64) -> Figure {
        self.limit = Some(limit);
        self.limit_gbps = Some(limit_gbps);
        self.ratio = (limit_gbps > 0.0).then(|| self.gbps / limit_gbps);
        self
    }

    /// One JSON object, one line.
    pub fn to_json(&self) -> String {
        let opt = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.4}"));
        let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        format!(
            "{{\"bench\":\"tiers\",\"case\":\"{}\",\"mode\":\"{}\",\"op\":\"{}\",\"size_bytes\":{},\"gbps\":{:.4},\"ops_per_s\":{:.2},\"p50_us\":{:.1},\"p99_us\":{:.1},\"limit\":{},\"limit_gbps\":{},\"ratio\":{}}}",
            esc(&self.case),
            esc(&self.mode),
            self.op,
            self.size_bytes,
            self.gbps,
            self.ops_per_s,
            self.p50_us,
            self.p99_us,
            self.limit.map_or("null".to_string(), |l| format!("\"{l}\"")),
            opt(self.limit_gbps),
            opt(self.ratio),
        )
    }

    /// One row of the readable table.
    pub fn to_row(&self) -> String {
        format!(
            "{:<28} {:<6} {:>10} {:>8.3} {:>10.1} {:>10.1} {:>10} {:>8}",
            format!("{} ({})", self.case, self.mode),
            self.op,
            self.size_bytes,
            self.gbps,
            self.p50_us,
            self.p99_us,
            self.limit_gbps.map_or("-".into(), |g| format!("{g:.3}")),
            self.ratio.map_or("-".into(), |r| format!("{r:.3}")),
        )
    }

    pub fn header() -> String {
        format!(
            "{:<28} {:<6} {:>10} {:>8} {:>10} {:>10} {:>10} {:>8}",
            "case", "op", "bytes", "GB/s", "p50 us", "p99 us", "limit GB/s", "ratio"
        )
    }
}

/// Shape of the disk benchmark.
#[derive(Debug, Clone)]
pub struct DiskBenchConfig {
    /// A directory on the disk to measure (a temp dir is made inside).
    pub dir: PathBuf,
    pub object_bytes: usize,
    pub objects: usize,
    /// Interleaved rounds of raw and medium passes.
    pub rounds: usize,
    pub ring: RingConfig,
}

impl DiskBenchConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DiskBenchConfig {
            dir: dir.into(),
            object_bytes: 64 << 20,
            objects: 8,
            rounds: 3,
            ring: RingConfig::default(),
        }
    }
}

fn us_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

/// Raw O_DIRECT write/read vs the NVMe medium's put/get_into, in the same run.
/// Returns `[raw write, raw write to a new file, raw read, medium put (vs raw write), medium
/// put (vs new-file write), medium get (vs raw read)]`.
pub async fn disk(cfg: &DiskBenchConfig) -> Result<Vec<Figure>> {
    let tmp = tempdir_in(&cfg.dir)?;
    let size = cfg.object_bytes;
    let pool = IoPool::new(RingConfig { io_threads: 1, ..cfg.ring }, "bench")?;
    let raw_path = tmp.join("raw.bin");
    let raw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags_direct()
        .open(&raw_path)
        .map_err(|e| Error::io(format!("open {}", raw_path.display()), e))?;
    let raw = Arc::new(raw);
    let ncfg = NvmeConfig {
        ring: cfg.ring,
        ..NvmeConfig::new(
            tmp.join("nvme"),
            (cfg.objects as u64 + 1) * (size as u64 + (1 << 20)) * 2,
        )
    };
    let (medium, _) = NvmeMedium::open(ncfg)?;
    let mut src = AlignedBuf::new(size);
    fill(&mut src, 1);
    let mut dst = AlignedBuf::new(size);
    let (mut rw, mut rr, mut mw, mut mr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut rn = Vec::new();
    for round in 0..cfg.rounds.max(1) {
        for i in 0..cfg.objects {
            let off = (i * size) as u64;
            let (f, p) = (raw.clone(), SendPtr(src.as_mut_ptr()));
            let t = Instant::now();
            pool.run(move |ctx| {
                use std::os::fd::AsRawFd;
                // SAFETY: src outlives the job (IoPool::run blocks a cancelled future's drop).
                unsafe { ctx.pipeline(Dir::Write, f.as_raw_fd(), off, p.ptr(), size, None) }?;
                ctx.fsync(f.as_raw_fd())
            })
            .await?;
            rw.push(us_since(t));
            // The same write into a new, fallocated file (allocation and a journal commit per
            // object, as a file-per-object medium pays).
            let path = tmp.join(format!("new-{round}-{i}"));
            let (p, path2) = (SendPtr(src.as_mut_ptr()), path.clone());
            let t = Instant::now();
            pool.run(move |ctx| {
                use std::os::fd::AsRawFd;
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags_direct()
                    .open(&path)
                    .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
                // SAFETY: fallocate on our own descriptor (as the medium does).
                unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, size as libc::off_t) };
                // SAFETY: src outlives the job.
                unsafe { ctx.pipeline(Dir::Write, f.as_raw_fd(), 0, p.ptr(), size, None) }?;
                ctx.fsync(f.as_raw_fd())
            })
            .await?;
            rn.push(us_since(t));
            std::fs::remove_file(&path2).map_err(|e| Error::io("remove", e))?;
            let key = format!("bench/{round}/{i}");
            let t = Instant::now();
            medium.put(&key, &src, PutOptions::default()).await?;
            mw.push(us_since(t));
        }
        for i in 0..cfg.objects {
            let off = (i * size) as u64;
            let (f, p) = (raw.clone(), SendPtr(dst.as_mut_ptr()));
            let t = Instant::now();
            pool.run(move |ctx| {
                use std::os::fd::AsRawFd;
                // SAFETY: dst outlives the job.
                unsafe { ctx.pipeline(Dir::Read, f.as_raw_fd(), off, p.ptr(), size, None) }
            })
            .await?;
            rr.push(us_since(t));
            let key = format!("bench/{round}/{i}");
            let t = Instant::now();
            medium.get_into(&key, &mut dst).await?;
            mr.push(us_since(t));
            if dst[..] != src[..] {
                return Err(Error::new(ErrorKind::Corrupt, "bench: medium returned other bytes"));
            }
        }
        for i in 0..cfg.objects {
            medium.remove(&format!("bench/{round}/{i}")).await?;
        }
    }
    let mode = format!("qd{} chunk{}KiB", cfg.ring.queue_depth, cfg.ring.chunk_bytes >> 10);
    let raw_w = Figure::from_samples("raw O_DIRECT", &mode, "write", size as u64, &mut rw);
    let raw_r = Figure::from_samples("raw O_DIRECT", &mode, "read", size as u64, &mut rr);
    let raw_new =
        Figure::from_samples("raw O_DIRECT new file", &mode, "write", size as u64, &mut rn);
    let hash = if cfg.ring.hash_with_rayon {
        "nvme medium +blake3 rayon"
    } else {
        "nvme medium +blake3 1thr"
    };
    let med_w =
        Figure::from_samples(hash, &mode, "put", size as u64, &mut mw).against("disk", raw_w.gbps);
    let med_w_new = Figure { case: format!("{hash} vs new file"), ..med_w.clone() }
        .against("disk_new_file", raw_new.gbps);
    let med_r =
        Figure::from_samples(hash, &mode, "get", size as u64, &mut mr).against("disk", raw_r.gbps);
    drop(medium);
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(vec![raw_w, raw_new, raw_r, med_w, med_w_new, med_r])
}

trait DirectExt {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectExt for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
    }
}

fn tempdir_in(dir: &std::path::Path) -> Result<PathBuf> {
    let p = dir.join(format!("kvfs-bench-{}-{}", std::process::id(), crate::medium::now_unix_ms()));
    std::fs::create_dir_all(&p).map_err(|e| Error::io(format!("create {}", p.display()), e))?;
    Ok(p)
}

/// blake3 throughput over `bytes`: (one thread, rayon) in GB/s.
pub fn blake3_gbps(bytes: usize) -> (f64, f64) {
    let mut buf = vec![0u8; bytes];
    fill(&mut buf, 7);
    let time = |f: &dyn Fn() -> [u8; 32]| {
        let _ = f();
        let t = Instant::now();
        let reps = 3;
        for _ in 0..reps {
            std::hint::black_box(f());
        }
        (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let one = time(&|| *blake3::hash(&buf).as_bytes());
    let par = time(&|| *blake3::Hasher::new().update_rayon(&buf).finalize().as_bytes());
    (one, par)
}

/// Lazy write-back throughput (DRAM -> `target`) against direct puts to the same target.
pub async fn writeback(
    target: Arc<dyn Medium>,
    journal_dir: &std::path::Path,
    objects: usize,
    object_bytes: usize,
) -> Result<Figure> {
    let dram = Arc::new(DramMedium::new(((objects + 1) * (object_bytes + 4096)) as u64)?);
    let mut data = vec![0u8; object_bytes];
    fill(&mut data, 3);
    let mut sums = Vec::new();
    for i in 0..objects {
        sums.push(dram.put(&format!("wb/{i}"), &data, PutOptions::default()).await?.checksum);
    }
    let mut direct = Vec::new();
    for i in 0..objects {
        let t = Instant::now();
        target.put(&format!("direct/{i}"), &data, PutOptions::overwrite()).await?;
        direct.push(us_since(t));
    }
    let limit =
        Figure::from_samples("object put", "direct", "put", object_bytes as u64, &mut direct);
    let cfg = WritebackConfig::new(
        journal_dir.join(format!("bench-{}.journal", crate::medium::now_unix_ms())),
    );
    let (q, _, mut events) = WritebackQueue::open(cfg, dram, target.clone()).await?;
    let t = Instant::now();
    for (i, s) in sums.iter().enumerate() {
        q.enqueue(&format!("wb/{i}"), object_bytes as u64, *s).await?;
    }
    let mut per_op = Vec::new();
    for _ in 0..objects {
        match events.recv().await {
            Some(WritebackEvent::Persisted { .. }) => per_op.push(0.0),
            Some(WritebackEvent::Failed { error, .. }) => return Err(error),
            None => return Err(Error::new(ErrorKind::Closed, "write-back events closed")),
        }
    }
    let total_us = us_since(t);
    q.close().await;
    for i in 0..objects {
        let _ = target.remove(&format!("direct/{i}")).await;
        let _ = target.remove(&format!("wb/{i}")).await;
    }
    let mut f = Figure::from_samples(
        "lazy write-back",
        "dram->object",
        "persist",
        object_bytes as u64,
        &mut per_op,
    );
    f.gbps = (objects * object_bytes) as f64 / (total_us / 1e6) / 1e9;
    f.ops_per_s = objects as f64 / (total_us / 1e6);
    f.p50_us = f64::NAN;
    f.p99_us = f64::NAN;
    Ok(f.against("object_put", limit.gbps))
}
