//! One behaviour suite for every medium, selected by what each declares (OpenDAL style).
//! Real components: a memfd region, io_uring on a real directory, opendal `fs` on a real
//! directory, and a real moto S3 server on 127.0.0.1.
//!
//! The NVMe tests keep their directories under `KVFS_NVME_DIR` when it is set (the disk to
//! test: `scripts/test-nvmeof` points it at a namespace reached over nvme-tcp), else under
//! cargo's target tmp dir.

mod common;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use async_trait::async_trait;
use kvfs_tiers::uring::AlignedBuf;
use kvfs_tiers::{
    DramMedium, ErrorKind, Fault, FaultyMedium, KEY_BYTES_MAX, Medium, NvmeConfig, NvmeMedium,
    ObjectStoreConfig, ObjectStoreMedium, Op, Persistence, PutMode, PutOptions, RenameOptions,
    checksum,
};

const MIB: usize = 1 << 20;
const CAPACITY_BYTES: u64 = 96 << 20;

#[async_trait]
trait Fixture: Send {
    fn medium(&self) -> Arc<dyn Medium>;
    /// Flip a byte of the stored data behind the medium's back (media that verify reads).
    async fn corrupt(&self, key: &str) -> Result<()>;
    /// Drop the medium and open it again on the same storage (media that survive restarts).
    async fn reopen(&mut self) -> Result<()>;
    /// The medium's count of reads that failed verification, where it keeps one.
    fn corrupt_reads(&self) -> Option<u64> {
        None
    }
}

/// A fresh directory for an NVMe medium, under `KVFS_NVME_DIR` if set.
fn nvme_tempdir() -> std::io::Result<tempfile::TempDir> {
    match std::env::var_os("KVFS_NVME_DIR") {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

fn kind<T: std::fmt::Debug>(r: kvfs_tiers::Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

async fn round_trips(m: &dyn Medium) -> Result<()> {
    for (i, size) in [0, 1, 4096, MIB + 1, 16 * MIB].into_iter().enumerate() {
        let key = format!("rt/{i}/{}", "a".repeat(64));
        let data = pattern(size, i as u8);
        let meta = m
            .put(&key, &data, PutOptions::default())
            .await
            .with_context(|| format!("put {size}"))?;
        ensure!(
            meta.size_bytes == size as u64 && meta.checksum == checksum(&data),
            "put meta for {size}"
        );
        ensure!(m.get(&key).await? == data, "get {size} bytes");
        let st = m.stat(&key).await?;
        ensure!(st.size_bytes == size as u64 && st.checksum == meta.checksum, "stat {size}");
        let mut aligned = AlignedBuf::new(size + 4096);
        let got = m.get_into(&key, &mut aligned).await?;
        ensure!(
            got.size_bytes == size as u64 && aligned[..size] == data[..],
            "aligned get_into {size}"
        );
        let mut unaligned = vec![0u8; size + 7];
        m.get_into(&key, &mut unaligned[3..]).await?;
        ensure!(unaligned[3..3 + size] == data[..], "unaligned get_into {size}");
        if size > 0 {
            let mut short = vec![0u8; size - 1];
            ensure!(
                kind(m.get_into(&key, &mut short).await) == ErrorKind::InvalidArgument,
                "short dst"
            );
        }
        m.remove(&key).await?;
    }
    Ok(())
}

async fn overwrite_semantics(m: &dyn Medium) -> Result<()> {
    let key = "ow/key";
    m.put(key, b"first", PutOptions::default()).await?;
    ensure!(kind(m.put(key, b"second!", PutOptions::default()).await) == ErrorKind::AlreadyExists);
    ensure!(m.get(key).await? == b"first", "create-new kept the first value");
    m.put(key, b"second!", PutOptions { mode: PutMode::Overwrite, ..Default::default() }).await?;
    ensure!(
        m.get(key).await? == b"second!" && m.stat(key).await?.size_bytes == 7,
        "overwrite replaced"
    );
    let bad = PutOptions { checksum: Some([0; 32]), ..PutOptions::overwrite() };
    if m.capabilities().verifies_reads {
        ensure!(
            kind(m.put(key, b"third", bad).await) == ErrorKind::Corrupt,
            "writer checksum checked"
        );
        ensure!(m.get(key).await? == b"second!", "a refused put leaves the old value");
    }
    m.remove(key).await?;
    Ok(())
}

async fn remove_and_not_found(m: &dyn Medium) -> Result<()> {
    let key = "rm/key";
    m.put(key, &pattern(5000, 1), PutOptions::default()).await?;
    let used = m.used_bytes();
    m.remove(key).await?;
    ensure!(m.used_bytes() < used, "remove frees space");
    ensure!(kind(m.stat(key).await) == ErrorKind::NotFound);
    ensure!(kind(m.get(key).await) == ErrorKind::NotFound);
    ensure!(kind(m.get_into(key, &mut [0u8; 8]).await) == ErrorKind::NotFound);
    ensure!(kind(m.remove(key).await) == ErrorKind::NotFound);
    ensure!(kind(m.get("never/written").await) == ErrorKind::NotFound);
    ensure!(!m.list().await?.iter().any(|(k, _)| k == key), "removed key not listed");
    Ok(())
}

async fn keys(m: &dyn Medium) -> Result<()> {
    ensure!(kind(m.put("", b"x", PutOptions::default()).await) == ErrorKind::InvalidArgument);
    let too_long = "k".repeat(KEY_BYTES_MAX + 1);
    ensure!(
        kind(m.put(&too_long, b"x", PutOptions::default()).await) == ErrorKind::InvalidArgument
    );
    ensure!(kind(m.get(&too_long).await) == ErrorKind::InvalidArgument);
    let odd = [
        "k".repeat(KEY_BYTES_MAX),
        "model/llama-70b/rank3/".to_string() + &"f".repeat(64),
        "../../etc/passwd".into(),
        "sp ace/\u{1F600}/\\back".into(),
    ];
    for (i, k) in odd.iter().enumerate() {
        m.put(k, &pattern(100 + i, 9), PutOptions::default())
            .await
            .with_context(|| format!("put key #{i}"))?;
    }
    let listed = m.list().await?;
    for (i, k) in odd.iter().enumerate() {
        ensure!(m.get(k).await? == pattern(100 + i, 9), "key #{i} round trip");
        ensure!(
            listed.iter().any(|(l, meta)| l == k && meta.size_bytes == (100 + i) as u64),
            "key #{i} listed"
        );
        m.remove(k).await?;
    }
    Ok(())
}

async fn no_space(m: &dyn Medium) -> Result<()> {
    let Some(cap) = m.capacity_bytes() else { return Ok(()) };
    let big = vec![1u8; cap as usize + 4096];
    ensure!(kind(m.put("ns/big", &big, PutOptions::default()).await) == ErrorKind::NoSpace);
    ensure!(kind(m.stat("ns/big").await) == ErrorKind::NotFound, "failed put left nothing");
    Ok(())
}

async fn concurrency(m: Arc<dyn Medium>) -> Result<()> {
    let mut tasks = Vec::new();
    for t in 0..8u8 {
        let m = m.clone();
        tasks.push(tokio::spawn(async move {
            for j in 0..4usize {
                let key = format!("cc/{t}/{j}");
                let data = pattern(64 * 1024 + j * 4097, t);
                m.put(&key, &data, PutOptions::default()).await?;
                ensure!(m.get(&key).await? == data, "task {t} object {j}");
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    // Racing creators of one key: exactly one wins, the others see AlreadyExists.
    let mut racers = Vec::new();
    for t in 0..6u8 {
        let m = m.clone();
        racers.push(tokio::spawn(async move {
            (t, m.put("cc/race", &pattern(300_000, t), PutOptions::default()).await)
        }));
    }
    let mut winners = Vec::new();
    for r in racers {
        let (t, res) = r.await?;
        match res {
            Ok(_) => winners.push(t),
            Err(e) => ensure!(e.kind() == ErrorKind::AlreadyExists, "racer {t}: {e}"),
        }
    }
    ensure!(winners.len() == 1, "winners: {winners:?}");
    ensure!(m.get("cc/race").await? == pattern(300_000, winners[0]), "the winner's bytes");
    for (k, _) in m.list().await? {
        if k.starts_with("cc/") {
            m.remove(&k).await?;
        }
    }
    Ok(())
}

fn rename_to(version: u64, mode: PutMode) -> RenameOptions {
    RenameOptions { version, mode }
}

async fn rename_semantics(m: &dyn Medium) -> Result<()> {
    // More than two of the object store's rename chunks (8 MiB), not a multiple of 4 KiB.
    let data = pattern(17 * MIB + 5, 4);
    let v1 =
        PutOptions { version: 10, pin: 1, persistence: Persistence::Lazy, ..Default::default() };
    let put = m.put("mv/a", &data, v1).await?;
    ensure!(m.previous_name("mv/a").await?.is_none(), "a put copy has no previous name");
    let meta = m.rename("mv/a", "mv/b", rename_to(11, PutMode::CreateNew)).await?;
    ensure!(meta == put_with_version(put, 11), "renamed meta {meta:?} from {put:?}");
    ensure!(m.get("mv/b").await? == data, "bytes under the new key");
    let mut aligned = AlignedBuf::new(data.len() + 4096);
    ensure!(m.get_into("mv/b", &mut aligned).await? == meta && aligned[..data.len()] == data[..]);
    ensure!(m.stat("mv/b").await? == meta, "stat of the new key");
    ensure!(kind(m.stat("mv/a").await) == ErrorKind::NotFound, "old key gone");
    ensure!(kind(m.get("mv/a").await) == ErrorKind::NotFound);
    ensure!(kind(m.previous_name("mv/a").await) == ErrorKind::NotFound);
    ensure!(m.previous_name("mv/b").await? == Some(("mv/a".into(), 10)), "previous name");
    let listed = m.list().await?;
    ensure!(!listed.iter().any(|(k, _)| k == "mv/a"), "old key not listed");
    ensure!(listed.iter().any(|(k, l)| k == "mv/b" && *l == meta), "new key listed: {listed:?}");

    let opts = rename_to(20, PutMode::Overwrite);
    ensure!(kind(m.rename("mv/a", "mv/c", opts).await) == ErrorKind::NotFound, "absent from");
    ensure!(
        kind(m.rename("mv/b", "mv/b", opts).await) == ErrorKind::InvalidArgument,
        "onto itself"
    );
    ensure!(kind(m.rename("", "mv/c", opts).await) == ErrorKind::InvalidArgument, "empty key");
    ensure!(m.get("mv/b").await? == data, "refused renames left the object");

    m.put("mv/c", b"other", PutOptions { version: 3, ..Default::default() }).await?;
    let create = rename_to(12, PutMode::CreateNew);
    ensure!(kind(m.rename("mv/b", "mv/c", create).await) == ErrorKind::AlreadyExists);
    ensure!(m.get("mv/b").await? == data && m.get("mv/c").await? == b"other", "both kept");
    let used = m.used_bytes();
    let meta = m.rename("mv/b", "mv/c", rename_to(12, PutMode::Overwrite)).await?;
    ensure!(meta == put_with_version(put, 12), "overwrite meta");
    ensure!(m.get("mv/c").await? == data, "overwrite replaced the target");
    ensure!(kind(m.stat("mv/b").await) == ErrorKind::NotFound);
    ensure!(m.previous_name("mv/c").await? == Some(("mv/b".into(), 11)));
    if m.capabilities().bounded_capacity {
        ensure!(
            m.used_bytes() < used,
            "the replaced target was freed: {} -> {}",
            used,
            m.used_bytes()
        );
    }

    // Back to the first name: a chain of renames, each recording the one before.
    m.rename("mv/c", "mv/a", rename_to(13, PutMode::CreateNew)).await?;
    ensure!(m.previous_name("mv/a").await? == Some(("mv/c".into(), 12)));
    ensure!(m.get("mv/a").await? == data && m.stat("mv/a").await?.version == 13);
    // The old name is free for a new object.
    m.put("mv/c", b"new c", PutOptions::default()).await?;
    ensure!(m.previous_name("mv/c").await?.is_none());

    m.put("mv/empty", b"", PutOptions::default()).await?;
    let long = "l".repeat(KEY_BYTES_MAX);
    m.rename("mv/empty", &long, rename_to(1, PutMode::CreateNew)).await?;
    ensure!(m.get(&long).await?.is_empty(), "empty object renamed to the longest key");
    ensure!(m.previous_name(&long).await? == Some(("mv/empty".into(), 0)));
    for k in ["mv/a", "mv/c", long.as_str()] {
        m.remove(k).await?;
    }
    Ok(())
}

fn put_with_version(m: kvfs_tiers::ObjectMeta, version: u64) -> kvfs_tiers::ObjectMeta {
    kvfs_tiers::ObjectMeta { version, ..m }
}

/// A renamed copy's key, version and previous name survive a restart.
async fn rename_survives_restart(fx: &mut dyn Fixture) -> Result<()> {
    let data = pattern(300_001, 8);
    fx.medium().put("rr/a", &data, PutOptions { version: 5, ..Default::default() }).await?;
    fx.medium().rename("rr/a", "rr/b", rename_to(6, PutMode::CreateNew)).await?;
    fx.reopen().await?;
    let m = fx.medium();
    ensure!(m.get("rr/b").await? == data, "renamed bytes after reopen");
    ensure!(m.stat("rr/b").await?.version == 6);
    ensure!(m.previous_name("rr/b").await? == Some(("rr/a".into(), 5)));
    ensure!(kind(m.stat("rr/a").await) == ErrorKind::NotFound, "old name stays gone");
    m.remove("rr/b").await?;
    Ok(())
}

async fn corruption(fx: &dyn Fixture) -> Result<()> {
    let m = fx.medium();
    let data = pattern(MIB + 123, 5);
    m.put("co/key", &data, PutOptions::default()).await?;
    fx.corrupt("co/key").await?;
    let counted = fx.corrupt_reads();
    ensure!(kind(m.get("co/key").await) == ErrorKind::Corrupt, "get of a flipped byte");
    ensure!(kind(m.get_into("co/key", &mut vec![0u8; data.len()]).await) == ErrorKind::Corrupt);
    if let (Some(before), Some(after)) = (counted, fx.corrupt_reads()) {
        ensure!(after >= before + 2, "corrupt reads counted: {before} -> {after}");
    }
    m.remove("co/key").await?;
    Ok(())
}

async fn restart(fx: &mut dyn Fixture) -> Result<()> {
    let objects: Vec<(String, Vec<u8>)> = (0..5)
        .map(|i| (format!("rs/{i}/{}", "b".repeat(i * 900)), pattern(i * 300_001, i as u8)))
        .collect();
    for (k, v) in &objects {
        fx.medium()
            .put(
                k,
                v,
                PutOptions { persistence: kvfs_tiers::Persistence::Lazy, ..Default::default() },
            )
            .await?;
    }
    let before = fx.medium().list().await?;
    fx.reopen().await?;
    let m = fx.medium();
    let after = m.list().await?;
    for (k, v) in &objects {
        let b = before.iter().find(|(x, _)| x == k).context("listed before")?;
        let a = after
            .iter()
            .find(|(x, _)| x == k)
            .with_context(|| format!("{k:?} listed after reopen"))?;
        ensure!(a.1 == b.1, "meta survives reopen for {k:?}");
        ensure!(a.1.persistence == kvfs_tiers::Persistence::Lazy);
        ensure!(&m.get(k).await? == v, "bytes survive reopen for {k:?}");
        m.remove(k).await?;
    }
    Ok(())
}

async fn run_suite(fx: &mut dyn Fixture) -> Result<()> {
    let caps = fx.medium().capabilities();
    let m = fx.medium();
    round_trips(&*m).await.context("round_trips")?;
    overwrite_semantics(&*m).await.context("overwrite_semantics")?;
    remove_and_not_found(&*m).await.context("remove_and_not_found")?;
    keys(&*m).await.context("keys")?;
    if caps.bounded_capacity {
        no_space(&*m).await.context("no_space")?;
    }
    concurrency(m.clone()).await.context("concurrency")?;
    rename_semantics(&*m).await.context("rename_semantics")?;
    drop(m);
    if caps.verifies_reads {
        corruption(&*fx).await.context("corruption")?;
    }
    if caps.survives_restart {
        restart(fx).await.context("restart")?;
        rename_survives_restart(fx).await.context("rename_survives_restart")?;
    }
    ensure!(fx.medium().list().await?.is_empty(), "suite cleaned up after itself");
    Ok(())
}

// ---------------------------------------------------------------- fixtures

struct Dram(Arc<DramMedium>);

#[async_trait]
impl Fixture for Dram {
    fn medium(&self) -> Arc<dyn Medium> {
        self.0.clone()
    }
    async fn corrupt(&self, _: &str) -> Result<()> {
        anyhow::bail!("dram does not verify reads")
    }
    async fn reopen(&mut self) -> Result<()> {
        anyhow::bail!("dram does not survive restarts")
    }
}

struct Nvme {
    dir: tempfile::TempDir,
    m: Option<Arc<NvmeMedium>>,
}

impl Nvme {
    fn open(dir: tempfile::TempDir) -> Result<Self> {
        let (m, _) = NvmeMedium::open(NvmeConfig::new(dir.path(), CAPACITY_BYTES))?;
        Ok(Nvme { dir, m: Some(Arc::new(m)) })
    }
    fn nvme(&self) -> &NvmeMedium {
        self.m.as_ref().expect("open")
    }
}

#[async_trait]
impl Fixture for Nvme {
    fn medium(&self) -> Arc<dyn Medium> {
        self.m.clone().expect("open")
    }
    async fn corrupt(&self, key: &str) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let path = self.nvme().data_path(key).context("data file")?;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
        let at = 1000;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at)?;
        f.write_all_at(&[b[0] ^ 0x80], at)?;
        f.sync_all()?;
        Ok(())
    }
    async fn reopen(&mut self) -> Result<()> {
        let old = self.m.take().context("open")?;
        let objects =
            Arc::into_inner(old).context("a clone of the medium is still alive")?.stats().objects;
        let (m, report) = NvmeMedium::open(NvmeConfig::new(self.dir.path(), CAPACITY_BYTES))?;
        ensure!(report.objects == objects && report.quarantined == 0, "reopen report {report:?}");
        self.m = Some(Arc::new(m));
        Ok(())
    }
    fn corrupt_reads(&self) -> Option<u64> {
        Some(self.nvme().stats().corrupt_reads)
    }
}

struct Object {
    cfg: ObjectStoreConfig,
    m: Arc<ObjectStoreMedium>,
}

#[async_trait]
impl Fixture for Object {
    fn medium(&self) -> Arc<dyn Medium> {
        self.m.clone()
    }
    async fn corrupt(&self, key: &str) -> Result<()> {
        // Through the backend itself (the fs directory or an S3 PUT), not through the medium.
        let path = kvfs_tiers::object::object_path(key);
        let mut raw = self.m.operator().read(&path).await?.to_vec();
        let last = raw.len() - 1;
        raw[last] ^= 0x10;
        self.m.operator().write(&path, raw).await?;
        Ok(())
    }
    async fn reopen(&mut self) -> Result<()> {
        self.m = Arc::new(ObjectStoreMedium::open(self.cfg.clone())?);
        Ok(())
    }
    fn corrupt_reads(&self) -> Option<u64> {
        Some(self.m.corrupt_reads())
    }
}

// ---------------------------------------------------------------- one test per medium

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_medium() -> Result<()> {
    run_suite(&mut Dram(Arc::new(DramMedium::new(CAPACITY_BYTES)?))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_medium() -> Result<()> {
    let mut fx = Nvme::open(nvme_tempdir()?)?;
    run_suite(&mut fx).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_fs_medium() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = ObjectStoreConfig::Fs { root: dir.path().to_owned() };
    run_suite(&mut Object { m: Arc::new(ObjectStoreMedium::open(cfg.clone())?), cfg }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_s3_medium_on_moto() -> Result<()> {
    let moto = common::Moto::start();
    moto.create_bucket("kvfs-behaviour");
    let cfg = moto.s3_config("kvfs-behaviour", "/suite");
    run_suite(&mut Object { m: Arc::new(ObjectStoreMedium::open(cfg.clone())?), cfg }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulty_wrapper_passes_the_suite_when_disarmed_and_fails_when_armed() -> Result<()> {
    let m = Arc::new(FaultyMedium::new(DramMedium::new(CAPACITY_BYTES)?));
    struct F(Arc<FaultyMedium<DramMedium>>);
    #[async_trait]
    impl Fixture for F {
        fn medium(&self) -> Arc<dyn Medium> {
            self.0.clone()
        }
        async fn corrupt(&self, _: &str) -> Result<()> {
            anyhow::bail!("unused")
        }
        async fn reopen(&mut self) -> Result<()> {
            anyhow::bail!("unused")
        }
    }
    run_suite(&mut F(m.clone())).await?;
    m.inject(Op::Get, Fault::Fail(ErrorKind::Timeout), 1);
    m.put("f", b"x", PutOptions::default()).await?;
    ensure!(kind(m.get("f").await) == ErrorKind::Timeout);
    ensure!(m.get("f").await? == b"x");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_open_discards_temp_files_and_quarantines_bad_headers() -> Result<()> {
    let dir = nvme_tempdir()?;
    let cfg = NvmeConfig::new(dir.path(), CAPACITY_BYTES);
    let (m, _) = NvmeMedium::open(cfg.clone())?;
    m.put("good", &pattern(10_000, 1), PutOptions::default()).await?;
    m.put("bad", &pattern(10_000, 2), PutOptions::default()).await?;
    m.put("short", &pattern(10_000, 3), PutOptions::default()).await?;
    let bad_header = m.header_path("bad");
    let short_data = m.data_path("short").context("data file")?;
    let good_data = m.data_path("good").context("data file")?;
    ensure!(
        NvmeMedium::open(cfg.clone()).err().map(|e| e.kind()) == Some(ErrorKind::Unavailable),
        "second open of a locked dir"
    );
    drop(m);
    std::fs::write(dir.path().join("tmp").join("half-written.1.data"), b"partial")?;
    // A data file renamed into place by a put that crashed before its header commit.
    let orphan = good_data.with_file_name(format!(
        "{}.7",
        good_data.file_name().unwrap().to_string_lossy().split('.').next().unwrap()
    ));
    std::fs::write(&orphan, b"orphan")?;
    let mut raw = std::fs::read(&bad_header)?;
    raw[20] ^= 1; // inside the header
    std::fs::write(&bad_header, raw)?;
    std::fs::OpenOptions::new().write(true).open(&short_data)?.set_len(9_000)?;
    let (m, report) = NvmeMedium::open(cfg)?;
    ensure!(
        // the temp file, the orphan, and the data files of the two quarantined headers
        report.objects == 1 && report.temp_files_removed == 4 && report.quarantined == 2,
        "{report:?}"
    );
    ensure!(!orphan.exists(), "unreferenced data file deleted");
    ensure!(m.get("good").await? == pattern(10_000, 1));
    ensure!(kind(m.get("bad").await) == ErrorKind::NotFound);
    ensure!(kind(m.get("short").await) == ErrorKind::NotFound);
    ensure!(std::fs::read_dir(dir.path().join("quarantine"))?.count() == 2);
    Ok(())
}

/// FUSE passthrough maps file offsets 1:1 and stops at the backing file's end: the data file
/// must be the object's bytes and nothing else, at every size around the 4 KiB block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_data_files_are_exactly_the_object_for_passthrough() -> Result<()> {
    use std::io::Read;
    let dir = nvme_tempdir()?;
    let cfg = NvmeConfig::new(dir.path(), CAPACITY_BYTES);
    let (m, _) = NvmeMedium::open(cfg.clone())?;
    let sizes = [0usize, 1, 4095, 4096, 4097, MIB + 17];
    for (i, size) in sizes.iter().enumerate() {
        let data = pattern(*size, i as u8);
        m.put(&format!("pt/{i}"), &data, PutOptions::default()).await?;
        let on_disk = std::fs::read(m.data_path(&format!("pt/{i}")).context("data file")?)?;
        ensure!(on_disk == data, "data file of {size} bytes is the object");
        let (mut f, meta) = m.local_file(&format!("pt/{i}"))?;
        let mut got = Vec::new();
        f.read_to_end(&mut got)?;
        ensure!(got == data && meta.size_bytes == *size as u64, "local_file of {size} bytes");
    }
    drop(m);
    // After a reopen the first local_file verifies the whole file.
    let (m, _) = NvmeMedium::open(cfg.clone())?;
    let key = format!("pt/{}", sizes.len() - 1);
    let path = m.data_path(&key).context("data file")?;
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
        f.write_all_at(&[0xAA], 12_345)?;
    }
    ensure!(kind(m.local_file(&key)) == ErrorKind::Corrupt, "first hand-out verifies");
    ensure!(m.stats().corrupt_reads == 1);
    ensure!(kind(m.local_file("pt/none")) == ErrorKind::NotFound);
    let (mut f, _) = m.local_file("pt/3")?;
    m.remove("pt/3").await?;
    let mut got = Vec::new();
    f.read_to_end(&mut got)?;
    ensure!(got == pattern(4096, 3), "an open local file survives a remove");
    Ok(())
}

/// Poll `fut` once, then drop it (a cancelled caller).
async fn poll_once_then_drop<F: std::future::Future>(fut: F) {
    tokio::select! {
        biased;
        _ = fut => {}
        _ = std::future::ready(()) => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_cancelled_operations_leave_whole_objects_or_nothing() -> Result<()> {
    let dir = nvme_tempdir()?;
    let (m, _) = NvmeMedium::open(NvmeConfig::new(dir.path(), CAPACITY_BYTES))?;
    let data = pattern(8 * MIB + 5, 3);
    m.put("c/get", &data, PutOptions::default()).await?;
    for _ in 0..5 {
        let mut buf = vec![0u8; data.len()];
        poll_once_then_drop(m.get_into("c/get", &mut buf)).await;
        drop(buf); // only sound because the drop above waited for the in-flight reads
    }
    for i in 0..5 {
        let k = format!("c/put{i}");
        poll_once_then_drop(m.put(&k, &data, PutOptions::default())).await;
        match m.get(&k).await {
            Ok(v) => ensure!(v == data, "a cancelled put left a partial object"),
            Err(e) => ensure!(e.kind() == ErrorKind::NotFound, "{e}"),
        }
    }
    ensure!(std::fs::read_dir(dir.path().join("tmp"))?.count() == 0, "temp files left behind");
    ensure!(m.get("c/get").await? == data);
    let listed = m.list().await?;
    let want: u64 =
        listed.iter().map(|(k, meta)| kvfs_tiers::nvme::file_bytes(k, None, meta.size_bytes)).sum();
    ensure!(
        m.used_bytes() == want,
        "used {} != {want} for {} objects",
        m.used_bytes(),
        listed.len()
    );
    Ok(())
}
