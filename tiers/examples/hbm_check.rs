//! HBM medium check for a GPU machine: put/get through `HbmMedium` with the bytes verified, and
//! GB/s of HBM put/get against raw cuMemcpy H2D/D2H of the same size measured in the same run
//! (page-locked host buffers on both sides).
//!
//!   cargo run --release -p kvfs-tiers --example hbm_check -- [DEVICE] [SIZE_MIB] [REPS]
//!
//! Exits 0 when the bytes verified, 1 on a mismatch or CUDA error, 2 when there is no GPU.

use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::{DevicePtr, result};
use kvfs_tiers::{HbmMedium, Medium, PutOptions, checksum};

fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn gbps(bytes: usize, reps: usize, secs: f64) -> f64 {
    (bytes * reps) as f64 / secs / 1e9
}

fn main() -> ExitCode {
    if !kvfs_tiers::hbm::driver_present() {
        eprintln!(
            "hbm_check: no CUDA driver found (libcuda.so not loadable); run this on a machine with an NVIDIA GPU and driver"
        );
        return ExitCode::from(2);
    }
    let (device, size_mib, reps) = (arg(1, 0), arg(2, 256), arg(3, 10).max(1));
    let size = size_mib << 20;
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hbm_check: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(device, size, reps)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) if e.kind() == kvfs_tiers::ErrorKind::Unavailable => {
            eprintln!("hbm_check: no usable GPU: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("hbm_check: {e}");
            ExitCode::from(1)
        }
    }
}

fn cuda(what: &str, e: result::DriverError) -> kvfs_tiers::Error {
    kvfs_tiers::Error::new(kvfs_tiers::ErrorKind::Io, format!("cuda {what}")).with_source(e)
}

async fn run(device: usize, size: usize, reps: usize) -> kvfs_tiers::Result<bool> {
    // Room for every rep's object plus slack.
    let medium = HbmMedium::open(device, ((reps + 1) * size) as u64)?;
    let ctx = medium.context().clone();
    let name = ctx.name().unwrap_or_else(|_| "?".into());
    println!("device {device}: {name}; object {} MiB x {reps} reps", size >> 20);

    // Page-locked host buffers (flags 0: cached, not write-combined, so the CPU can read them).
    // SAFETY: the buffers are filled before any read.
    let mut src = unsafe { ctx.alloc_pinned_with_flags::<u8>(size, 0) }
        .map_err(|e| cuda("pinned alloc", e))?;
    // SAFETY: as above; dst is only read after a copy fills it.
    let mut dst = unsafe { ctx.alloc_pinned_with_flags::<u8>(size, 0) }
        .map_err(|e| cuda("pinned alloc", e))?;
    {
        let s = src.as_mut_slice().map_err(|e| cuda("pinned slice", e))?;
        let mut x = 0x2545F4914F6CDD1Du64;
        for c in s.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
    }
    let src_s = src.as_slice().map_err(|e| cuda("pinned slice", e))?;
    let sum = checksum(src_s);

    // Raw limit: cuMemcpy H2D / D2H of the same size between the same host buffers.
    let stream = ctx.default_stream();
    // SAFETY: written by the H2D copy before it is read.
    let raw = unsafe { stream.alloc::<u8>(size) }.map_err(|e| cuda("device alloc", e))?;
    stream.synchronize().map_err(|e| cuda("sync", e))?;
    let raw_ptr = {
        let (p, _g) = raw.device_ptr(&stream);
        p
    };
    ctx.bind_to_thread().map_err(|e| cuda("bind", e))?;
    let dst_s = dst.as_mut_slice().map_err(|e| cuda("pinned slice", e))?;
    // Warm-up both directions once.
    // SAFETY: raw_ptr is a live device allocation of `size` bytes; host slices are `size` bytes.
    unsafe { result::memcpy_htod_sync(raw_ptr, src_s) }.map_err(|e| cuda("h2d", e))?;
    // SAFETY: as above.
    unsafe { result::memcpy_dtoh_sync(dst_s, raw_ptr) }.map_err(|e| cuda("d2h", e))?;
    let t = Instant::now();
    for _ in 0..reps {
        // SAFETY: as above.
        unsafe { result::memcpy_htod_sync(raw_ptr, src_s) }.map_err(|e| cuda("h2d", e))?;
    }
    ctx.synchronize().map_err(|e| cuda("sync", e))?;
    let raw_h2d = gbps(size, reps, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..reps {
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_sync(dst_s, raw_ptr) }.map_err(|e| cuda("d2h", e))?;
    }
    ctx.synchronize().map_err(|e| cuda("sync", e))?;
    let raw_d2h = gbps(size, reps, t.elapsed().as_secs_f64());

    // HBM medium: put with the writer's checksum (pure copy), then get_into, bytes verified.
    let trusted = PutOptions { checksum: Some(sum), ..Default::default() };
    let t = Instant::now();
    for i in 0..reps {
        medium.put(&format!("hbm-check/{i}"), src_s, trusted).await?;
    }
    ctx.synchronize().map_err(|e| cuda("sync", e))?;
    let put = gbps(size, reps, t.elapsed().as_secs_f64());
    let mut ok = true;
    let t = Instant::now();
    for i in 0..reps {
        dst_s.fill(0);
        let meta = medium.get_into(&format!("hbm-check/{i}"), dst_s).await?;
        ok &= meta.size_bytes == size as u64 && meta.checksum == sum;
    }
    ctx.synchronize().map_err(|e| cuda("sync", e))?;
    let get = gbps(size, reps, t.elapsed().as_secs_f64());
    // Verify the bytes of every stored object (outside the timed loop).
    for i in 0..reps {
        dst_s.fill(0);
        medium.get_into(&format!("hbm-check/{i}"), dst_s).await?;
        if checksum(dst_s) != sum || dst_s != src_s {
            eprintln!("hbm_check: object {i} came back with other bytes");
            ok = false;
        }
    }
    // A put that hashes on the host (no writer checksum): what checksumming costs.
    let t = Instant::now();
    medium.put("hbm-check/hashed", src_s, PutOptions::default()).await?;
    let put_hashed = gbps(size, 1, t.elapsed().as_secs_f64());
    ok &= medium.stat("hbm-check/hashed").await?.checksum == sum;

    println!("{:<34} {:>9} {:>11} {:>7}", "op", "GB/s", "limit GB/s", "ratio");
    println!("{:<34} {:>9.2} {:>11} {:>7}", "raw cuMemcpy H2D (pinned)", raw_h2d, "-", "-");
    println!("{:<34} {:>9.2} {:>11} {:>7}", "raw cuMemcpy D2H (pinned)", raw_d2h, "-", "-");
    println!(
        "{:<34} {:>9.2} {:>11.2} {:>7.3}",
        "hbm put (writer checksum)",
        put,
        raw_h2d,
        put / raw_h2d
    );
    println!("{:<34} {:>9.2} {:>11.2} {:>7.3}", "hbm get_into", get, raw_d2h, get / raw_d2h);
    println!(
        "{:<34} {:>9.2} {:>11.2} {:>7.3}",
        "hbm put (blake3 on host)",
        put_hashed,
        raw_h2d,
        put_hashed / raw_h2d
    );
    for (op, g, l) in [("put", put, raw_h2d), ("get", get, raw_d2h)] {
        println!(
            "{{\"bench\":\"tiers\",\"case\":\"hbm {name}\",\"mode\":\"pinned\",\"op\":\"{op}\",\"size_bytes\":{size},\"gbps\":{g:.3},\"limit\":\"cumemcpy\",\"limit_gbps\":{l:.3},\"ratio\":{:.4}}}",
            g / l
        );
    }
    println!("bytes verified: {}", if ok { "yes" } else { "NO" });
    drop(raw);
    Ok(ok)
}
