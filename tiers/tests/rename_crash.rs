//! Crash states of a rename, left on disk (or in the bucket) the way a crash between two of its
//! steps leaves them, then a real reopen (NVMe) or a real listing (object storage, `fs` and a
//! moto S3 server): exactly one name remains, with the object's bytes.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use kvfs_tiers::nvme::file_bytes;
use kvfs_tiers::object::object_path;
use kvfs_tiers::{
    ErrorKind, Medium, NvmeConfig, NvmeMedium, ObjectStoreConfig, ObjectStoreMedium, OpenReport,
    PutMode, PutOptions, RenameOptions, stale_after_rename,
};

const CAPACITY_BYTES: u64 = 64 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 11) as u8).collect()
}

fn kind<T: std::fmt::Debug>(r: kvfs_tiers::Result<T>) -> ErrorKind {
    r.expect_err("expected an error").kind()
}

fn v(version: u64) -> PutOptions {
    PutOptions { version, ..Default::default() }
}

fn rename_to(version: u64) -> RenameOptions {
    RenameOptions { version, mode: PutMode::CreateNew }
}

struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Result<Self> {
        Ok(Dir { dir: tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))? })
    }
    fn cfg(&self) -> NvmeConfig {
        NvmeConfig::new(self.dir.path(), CAPACITY_BYTES)
    }
    fn open(&self) -> Result<(NvmeMedium, OpenReport)> {
        Ok(NvmeMedium::open(self.cfg())?)
    }
}

fn nlink(p: &Path) -> Result<u64> {
    Ok(std::fs::metadata(p).with_context(|| format!("stat {}", p.display()))?.nlink())
}

/// A data-file name of `key` at generation `g`, next to its header.
fn data_name(m: &NvmeMedium, key: &str, g: u64) -> PathBuf {
    let h = m.header_path(key);
    let name = h.file_name().unwrap().to_string_lossy().into_owned();
    h.with_file_name(format!("{name}.{g}"))
}

/// After a reopen that resolved a crash: exactly `key` holds `data` (verified by a get and by
/// `local_file`), `gone` is absent, and the accounting is exact.
async fn only(
    m: &NvmeMedium,
    key: &str,
    previous: Option<&str>,
    gone: &str,
    data: &[u8],
) -> Result<()> {
    use std::io::Read;
    ensure!(m.get(key).await? == data, "bytes of {key:?}");
    let (mut f, _) = m.local_file(key)?;
    let mut got = Vec::new();
    f.read_to_end(&mut got)?;
    ensure!(got == data, "local_file of {key:?}");
    ensure!(kind(m.stat(gone).await) == ErrorKind::NotFound, "{gone:?} is gone");
    let listed = m.list().await?;
    ensure!(listed.len() == 1 && listed[0].0 == key, "one name listed: {listed:?}");
    let want = file_bytes(key, previous, data.len() as u64);
    ensure!(m.used_bytes() == want, "used {} != {want}", m.used_bytes());
    ensure!(nlink(&m.data_path(key).context("data file")?)? == 1, "one link to the bytes");
    Ok(())
}

#[tokio::test]
async fn nvme_crash_after_the_link_before_the_commit_keeps_the_old_name() -> Result<()> {
    let d = Dir::new()?;
    let data = pattern(1 << 20, 1);
    let (m, _) = d.open()?;
    m.put("a", &data, v(1)).await?;
    let a_data = m.data_path("a").context("data file")?;
    let b_link = data_name(&m, "b", 99);
    drop(m);
    // Step 1 done (the data linked under b's digest), step 2 half done (a temp header).
    std::fs::create_dir_all(b_link.parent().unwrap())?;
    std::fs::hard_link(&a_data, &b_link)?;
    std::fs::write(d.dir.path().join("tmp").join("b.99.hdr"), b"half a header")?;
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1 && report.temp_files_removed == 2 && report.renamed_stale_removed == 0,
        "{report:?}"
    );
    ensure!(!b_link.exists(), "the unreferenced link is deleted");
    only(&m, "a", None, "b", &data).await?;
    ensure!(m.previous_name("a").await?.is_none());
    Ok(())
}

/// The state between the commit of `to`'s header and the removal of `from`'s files: a rename
/// run to the end, then `from`'s header and data-file name put back as they were.
async fn both_names_left(d: &Dir, data: &[u8], restore_data_name: bool) -> Result<PathBuf> {
    let (m, _) = d.open()?;
    m.put("a", data, v(1)).await?;
    let a_header = m.header_path("a");
    let a_data = m.data_path("a").context("data file")?;
    let saved = std::fs::read(&a_header)?;
    m.rename("a", "b", rename_to(2)).await?;
    let b_data = m.data_path("b").context("data file")?;
    ensure!(!a_header.exists() && !a_data.exists(), "a finished rename leaves no old files");
    drop(m);
    std::fs::write(&a_header, saved)?;
    if restore_data_name {
        std::fs::hard_link(&b_data, &a_data)?;
        ensure!(nlink(&b_data)? == 2);
    }
    Ok(b_data)
}

#[tokio::test]
async fn nvme_crash_after_the_commit_keeps_only_the_new_name() -> Result<()> {
    let d = Dir::new()?;
    let data = pattern(3 * 4096 + 7, 2);
    both_names_left(&d, &data, true).await?;
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1
            && report.renamed_stale_removed == 1
            && report.temp_files_removed == 0
            && report.quarantined == 0,
        "{report:?}"
    );
    ensure!(report.bytes == file_bytes("b", Some("a"), data.len() as u64), "{report:?}");
    only(&m, "b", Some("a"), "a", &data).await?;
    ensure!(m.previous_name("b").await? == Some(("a".into(), 1)));
    ensure!(!m.header_path("a").exists(), "the stale header is deleted");
    drop(m);
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1 && report.renamed_stale_removed == 0 && report.temp_files_removed == 0,
        "a second reopen finds nothing to resolve: {report:?}"
    );
    only(&m, "b", Some("a"), "a", &data).await
}

/// A power loss can keep `from`'s header unlink undone while its data-file unlink persisted:
/// the stale header has no data file, and is deleted, not quarantined.
#[tokio::test]
async fn nvme_stale_header_without_its_data_file_is_deleted_not_quarantined() -> Result<()> {
    let d = Dir::new()?;
    let data = pattern(10_000, 3);
    both_names_left(&d, &data, false).await?;
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1 && report.renamed_stale_removed == 1 && report.quarantined == 0,
        "{report:?}"
    );
    only(&m, "b", Some("a"), "a", &data).await
}

#[tokio::test]
async fn nvme_crash_after_the_old_header_went_deletes_the_old_data_name() -> Result<()> {
    let d = Dir::new()?;
    let data = pattern(70_000, 4);
    let (m, _) = d.open()?;
    m.put("a", &data, v(1)).await?;
    let a_data = m.data_path("a").context("data file")?;
    m.rename("a", "b", rename_to(2)).await?;
    let b_data = m.data_path("b").context("data file")?;
    drop(m);
    std::fs::hard_link(&b_data, &a_data)?;
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1 && report.temp_files_removed == 1 && report.renamed_stale_removed == 0,
        "{report:?}"
    );
    ensure!(!a_data.exists());
    only(&m, "b", Some("a"), "a", &data).await
}

/// A claim counts only from a copy whose data file checks out: if `to`'s data file is lost,
/// `to` is quarantined and `from` (the same bytes) is kept.
#[tokio::test]
async fn nvme_a_damaged_new_name_does_not_cost_the_old_one() -> Result<()> {
    let d = Dir::new()?;
    let data = pattern(50_000, 5);
    let b_data = both_names_left(&d, &data, true).await?;
    std::fs::remove_file(&b_data)?;
    let (m, report) = d.open()?;
    ensure!(
        report.objects == 1 && report.quarantined == 1 && report.renamed_stale_removed == 0,
        "{report:?}"
    );
    only(&m, "a", None, "b", &data).await
}

/// `from` put again after the rename (a new version): both names are live objects.
#[tokio::test]
async fn nvme_a_new_copy_under_the_old_name_is_kept() -> Result<()> {
    let d = Dir::new()?;
    let (m, _) = d.open()?;
    m.put("a", &pattern(5000, 6), v(1)).await?;
    m.rename("a", "b", rename_to(2)).await?;
    m.put("a", &pattern(6000, 7), v(3)).await?;
    drop(m);
    let (m, report) = d.open()?;
    ensure!(report.objects == 2 && report.renamed_stale_removed == 0, "{report:?}");
    ensure!(m.get("a").await? == pattern(6000, 7) && m.get("b").await? == pattern(5000, 6));
    Ok(())
}

/// A live rename: no data copy (the same inode), exact accounting, `local_file` under the new
/// key, and a descriptor opened before the rename still reads the bytes.
#[tokio::test]
async fn nvme_rename_relinks_the_data_file() -> Result<()> {
    use std::io::Read;
    let d = Dir::new()?;
    let (m, _) = d.open()?;
    let data = pattern(2 << 20, 8);
    m.put("a", &data, v(1)).await?;
    let ino = std::fs::metadata(m.data_path("a").context("data file")?)?.ino();
    let (mut before, _) = m.local_file("a")?;
    m.put("b", &pattern(9000, 1), v(1)).await?;
    m.rename("a", "b", RenameOptions { version: 2, mode: PutMode::Overwrite }).await?;
    let b_data = m.data_path("b").context("data file")?;
    ensure!(std::fs::metadata(&b_data)?.ino() == ino, "the bytes were not copied");
    ensure!(nlink(&b_data)? == 1);
    ensure!(m.used_bytes() == file_bytes("b", Some("a"), data.len() as u64), "accounting");
    ensure!(m.stats().objects == 1);
    ensure!(kind(m.local_file("a")) == ErrorKind::NotFound);
    let (mut f, meta) = m.local_file("b")?;
    let mut got = Vec::new();
    f.read_to_end(&mut got)?;
    ensure!(got == data && meta.version == 2, "local_file of the new key");
    let mut got = Vec::new();
    before.read_to_end(&mut got)?;
    ensure!(got == data, "a descriptor from before the rename");
    let leftovers: Vec<_> = std::fs::read_dir(d.dir.path().join("tmp"))?.collect();
    ensure!(leftovers.is_empty(), "temp files left: {leftovers:?}");
    // Files on disk: exactly b's header and data file.
    let mut files = 0;
    for sub in std::fs::read_dir(d.dir.path().join("objects"))? {
        files += std::fs::read_dir(sub?.path())?.count();
    }
    ensure!(files == 2, "{files} files under objects/");
    drop((f, before));
    m.remove("b").await?;
    ensure!(m.used_bytes() == 0);
    Ok(())
}

/// Racing renames of one key to different names: exactly one wins; the bytes are under one
/// name and the accounting stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_racing_renames_of_one_key_leave_one_name() -> Result<()> {
    let d = Dir::new()?;
    let (m, _) = d.open()?;
    let m = std::sync::Arc::new(m);
    let data = pattern(200_000, 9);
    m.put("src", &data, v(1)).await?;
    let mut tasks = Vec::new();
    for t in 0..6u64 {
        let m = m.clone();
        tasks.push(tokio::spawn(async move {
            (t, m.rename("src", &format!("dst/{t}"), rename_to(2 + t)).await)
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        let (t, r) = t.await?;
        match r {
            Ok(_) => winners.push(t),
            Err(e) => ensure!(e.kind() == ErrorKind::NotFound, "racer {t}: {e}"),
        }
    }
    ensure!(winners.len() == 1, "winners {winners:?}");
    let key = format!("dst/{}", winners[0]);
    only(&m, &key, Some("src"), "src", &data).await?;
    drop(m);
    let (m, report) = d.open()?;
    ensure!(report.objects == 1 && report.temp_files_removed == 0, "{report:?}");
    only(&m, &key, Some("src"), "src", &data).await
}

// ---------------------------------------------------------------- object storage

/// Copy then delete: a crash between them leaves both objects; the listing names the old one
/// as the new one's previous name, and `remove_stale_renames` keeps one.
async fn object_both_names_are_listed_and_resolved(m: &ObjectStoreMedium) -> Result<()> {
    let data = pattern((9 << 20) + 3, 10);
    m.put("a", &data, v(1)).await?;
    m.put("other", b"unrelated", v(4)).await?;
    let raw = m.operator().read(&object_path("a")).await?.to_vec();
    m.rename("a", "b", rename_to(2)).await?;
    ensure!(kind(m.stat("a").await) == ErrorKind::NotFound);
    // Put `a` back byte for byte: the state after the copy's close, before the delete.
    m.operator().write(&object_path("a"), raw).await?;
    let listed = m.list_detailed().await?;
    let find = |k: &str| listed.iter().find(|o| o.key == k).cloned();
    let a = find("a").context("a listed")?;
    let b = find("b").context("b listed")?;
    ensure!(a.previous.is_none() && a.meta.version == 1, "{a:?}");
    ensure!(b.previous == Some(("a".into(), 1)) && b.meta.version == 2, "{b:?}");
    ensure!(b.meta.checksum == a.meta.checksum && listed.len() == 3);
    let stale =
        stale_after_rename(listed.iter().map(|o| {
            (o.key.as_str(), &o.meta, o.previous.as_ref().map(|(k, v)| (k.as_str(), *v)))
        }));
    ensure!(stale.len() == 1 && stale.contains("a"), "{stale:?}");
    ensure!(m.remove_stale_renames(&listed).await? == ["a"]);
    ensure!(kind(m.stat("a").await) == ErrorKind::NotFound);
    ensure!(m.get("b").await? == data && m.get("other").await? == b"unrelated");
    ensure!(m.list().await?.len() == 2);
    // A listing older than a put of the old name does not delete the new copy.
    m.put("a", b"newer", v(7)).await?;
    ensure!(m.remove_stale_renames(&listed).await?.is_empty());
    ensure!(m.get("a").await? == b"newer");
    // A lazy write-back that uploads under the old name after the rename, and the one under
    // the new name that carries the old name: the old name is the stale one.
    m.put("w", &data[..1000], v(3)).await?;
    m.put_with_previous("W", &data[..1000], v(4), Some(("w", 3))).await?;
    ensure!(m.previous_name("W").await? == Some(("w".into(), 3)));
    ensure!(m.remove_stale_renames(&m.list_detailed().await?).await? == ["w"]);
    ensure!(m.get("W").await? == data[..1000] && kind(m.stat("w").await) == ErrorKind::NotFound);
    m.remove("W").await?;
    for k in ["a", "b", "other"] {
        m.remove(k).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_fs_rename_crash_state_is_listed_and_resolved() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let m = ObjectStoreMedium::open(ObjectStoreConfig::Fs { root: dir.path().to_owned() })?;
    object_both_names_are_listed_and_resolved(&m).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_s3_rename_crash_state_is_listed_and_resolved_on_moto() -> Result<()> {
    let moto = common::Moto::start();
    moto.create_bucket("kvfs-rename");
    let m = ObjectStoreMedium::open(moto.s3_config("kvfs-rename", "/rename"))?;
    object_both_names_are_listed_and_resolved(&m).await
}
