//! Measurements for `kvfs bench tiers`: each figure comes with the machine's own limit measured
//! in the same run, and the ratio between them (DESIGN.md section 11).
//!
//! - [`disk`]: raw O_DIRECT sequential write and read of a file (io_uring, the same chunk size
//!   and queue depth as the NVMe medium, no hashing) against the NVMe medium's `put` and
//!   `get_into` of the same object size, rounds interleaved so drift hits both alike. Writes
//!   include an fsync per object on both sides (the medium's put is durable when it returns).
//!   Two write limits: overwriting one preallocated file (the disk), and writing each object to
//!   a new file (the disk plus the file system's allocation and journal commit per file).
//!   With [`DiskBenchConfig::raw_device`] (the block device under `dir`, e.g. an NVMe-oF
//!   namespace) a third read limit: the same blocks read straight from the device, O_DIRECT,
//!   found with `FIEMAP` on the raw file and checked to hold the bytes written there.
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
    /// The block device `dir` is on: also read the raw file's blocks straight from it.
    pub raw_device: Option<PathBuf>,
}

impl DiskBenchConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DiskBenchConfig {
            dir: dir.into(),
            object_bytes: 64 << 20,
            objects: 8,
            rounds: 3,
            ring: RingConfig::default(),
            raw_device: None,
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
/// put (vs new-file write), medium get (vs raw read)]`, then, with a `raw_device`, `[raw
/// device read, medium get (vs raw device read)]`.
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
    let mut rd = Vec::new();
    let device = match &cfg.raw_device {
        Some(d) => Some(Arc::new(open_device_under(d, &raw_path)?)),
        None => None,
    };
    let mut extents = Vec::new();
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
        if device.is_some() {
            extents = fiemap(&raw, &raw_path)?;
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
            if let Some(dev) = &device {
                let pieces = physical_pieces(&extents, off, size as u64, &raw_path)?;
                dst.fill(0);
                let (f, p) = (dev.clone(), SendPtr(dst.as_mut_ptr()));
                let t = Instant::now();
                pool.run(move |ctx| {
                    use std::os::fd::AsRawFd;
                    for (at, phys, len) in pieces {
                        // SAFETY: dst outlives the job; `at + len` is within its `size` bytes.
                        unsafe {
                            ctx.pipeline(Dir::Read, f.as_raw_fd(), phys, p.ptr().add(at), len, None)
                        }?;
                    }
                    Ok(())
                })
                .await?;
                rd.push(us_since(t));
                if dst[..] != src[..] {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        "bench: the raw device's blocks of the raw file hold other bytes",
                    ));
                }
            }
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
    let mut out = vec![raw_w, raw_new, raw_r, med_w, med_w_new, med_r.clone()];
    if device.is_some() {
        let raw_dev =
            Figure::from_samples("raw O_DIRECT device", &mode, "read", size as u64, &mut rd);
        out.push(med_r.against("device", raw_dev.gbps));
        out.insert(out.len() - 1, raw_dev);
    }
    Ok(out)
}

/// Open `device` for O_DIRECT reads after checking that `file` lives on it.
fn open_device_under(device: &std::path::Path, file: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let md = std::fs::metadata(device)
        .map_err(|e| Error::io(format!("bench: raw device {}", device.display()), e))?;
    let fmd =
        std::fs::metadata(file).map_err(|e| Error::io(format!("stat {}", file.display()), e))?;
    if !md.file_type().is_block_device() || md.rdev() != fmd.dev() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "bench: {} is not the block device {} is on",
                device.display(),
                file.parent().unwrap_or(file).display()
            ),
        ));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_direct()
        .open(device)
        .map_err(|e| Error::io(format!("open {}", device.display()), e))
}

/// One extent of a file: (logical offset, physical offset, length), in bytes.
type Extent = (u64, u64, u64);

/// The file's extents (`FS_IOC_FIEMAP`, synced first), refusing any the device cannot be read
/// at directly (unknown, delayed, encoded, inline, unaligned, unwritten).
fn fiemap(f: &std::fs::File, path: &std::path::Path) -> Result<Vec<Extent>> {
    use std::os::fd::AsRawFd;
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const FLAG_SYNC: u32 = 1;
    const LAST: u32 = 0x1;
    const UNREADABLE: u32 = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800;
    const EXTENTS_MAX: usize = 512;
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct FiemapExtent {
        logical: u64,
        physical: u64,
        length: u64,
        reserved64: [u64; 2],
        flags: u32,
        reserved: [u32; 3],
    }
    #[repr(C)]
    struct Fiemap {
        start: u64,
        length: u64,
        flags: u32,
        mapped_extents: u32,
        extent_count: u32,
        reserved: u32,
        extents: [FiemapExtent; EXTENTS_MAX],
    }
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut m = Box::new(Fiemap {
            start,
            length: u64::MAX - start,
            flags: FLAG_SYNC,
            mapped_extents: 0,
            extent_count: EXTENTS_MAX as u32,
            reserved: 0,
            extents: [FiemapExtent::default(); EXTENTS_MAX],
        });
        // SAFETY: FS_IOC_FIEMAP fills at most `extent_count` extents of the struct we own.
        if unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FIEMAP, &mut *m as *mut Fiemap) } != 0 {
            return Err(Error::io(
                format!("bench: FIEMAP {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        let n = (m.mapped_extents as usize).min(EXTENTS_MAX);
        for e in &m.extents[..n] {
            if e.flags & UNREADABLE != 0 {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "bench: {} has an extent the raw device cannot be read at (flags {:#x})",
                        path.display(),
                        e.flags
                    ),
                ));
            }
            out.push((e.logical, e.physical, e.length));
        }
        match m.extents[..n].last() {
            Some(e) if e.flags & LAST == 0 => start = e.logical + e.length,
            _ => return Ok(out),
        }
    }
}

/// The device ranges holding the file's bytes `[off, off + len)`: (offset in the range,
/// physical offset, length), each a whole number of O_DIRECT blocks.
fn physical_pieces(
    extents: &[Extent],
    off: u64,
    len: u64,
    path: &std::path::Path,
) -> Result<Vec<(usize, u64, usize)>> {
    let block = crate::uring::BLOCK_BYTES as u64;
    let mut pieces = Vec::new();
    let mut covered = 0;
    for &(logical, physical, length) in extents {
        let (a, b) = (off.max(logical), (off + len).min(logical + length));
        if a >= b {
            continue;
        }
        let phys = physical + (a - logical);
        if phys % block != 0 || (b - a) % block != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("bench: {} has an extent not aligned to {block} bytes", path.display()),
            ));
        }
        pieces.push(((a - off) as usize, phys, (b - a) as usize));
        covered += b - a;
    }
    if covered != len {
        return Err(Error::new(
            ErrorKind::Io,
            format!("bench: {} maps {covered} of bytes {off}..{}", path.display(), off + len),
        ));
    }
    Ok(pieces)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn physical_pieces_cover_the_range_in_device_blocks() {
        let p = std::path::Path::new("f");
        // Two extents: file [0, 8K) at 1M, file [8K, 16K) at 64K.
        let ext = [(0, 1 << 20, 8192), (8192, 65536, 8192)];
        assert_eq!(
            physical_pieces(&ext, 4096, 8192, p).unwrap(),
            vec![(0, (1 << 20) + 4096, 4096), (4096, 65536, 4096)]
        );
        assert_eq!(physical_pieces(&ext, 0, 16384, p).unwrap().len(), 2);
        let e = physical_pieces(&ext, 8192, 16384, p).unwrap_err();
        assert!(e.to_string().contains("maps 8192 of bytes 8192..24576"), "{e}");
        let odd = [(0, 512, 8192)];
        assert_eq!(
            physical_pieces(&odd, 0, 4096, p).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    /// The block device under the temp dir, where it is a plain one (`/dev/NAME`).
    fn device_of(dir: &std::path::Path) -> Option<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(dir).ok()?.dev();
        let uevent = std::fs::read_to_string(format!(
            "/sys/dev/block/{}:{}/uevent",
            libc::major(dev),
            libc::minor(dev)
        ))
        .ok()?;
        let name = uevent.lines().find_map(|l| l.strip_prefix("DEVNAME="))?;
        let path = PathBuf::from("/dev").join(name);
        std::fs::OpenOptions::new().read(true).open(&path).ok().map(|_| path)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_raw_device_read_reads_the_raw_files_own_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let Some(device) = device_of(dir.path()) else {
            eprintln!("skipped: {} is not on a readable block device", dir.path().display());
            return;
        };
        let cfg = DiskBenchConfig {
            object_bytes: 1 << 20,
            objects: 2,
            rounds: 1,
            raw_device: Some(device.clone()),
            ..DiskBenchConfig::new(dir.path())
        };
        // disk() compares the device's blocks with the bytes written (Corrupt otherwise).
        let figs = disk(&cfg).await.unwrap();
        let dev = figs.iter().find(|f| f.case == "raw O_DIRECT device").expect("device figure");
        assert!(dev.gbps > 0.0);
        let vs = figs.last().unwrap();
        assert_eq!((vs.op, vs.limit), ("get", Some("device")));
        // A device the directory is not on is refused.
        let other = DiskBenchConfig { raw_device: Some("/dev/null".into()), ..cfg };
        let e = disk(&other).await.unwrap_err();
        assert!(e.to_string().contains("is not the block device"), "{e}");
    }
}
