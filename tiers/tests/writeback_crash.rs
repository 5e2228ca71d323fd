//! Crash safety of the write-back queue under a real SIGKILL.
//!
//! The parent test re-executes this test binary as a child (running only the ignored
//! `crash_child` test, told what to do by an environment variable). The child stores objects on
//! an NVMe medium, enqueues them (printing a line per acknowledged enqueue) while the workers
//! upload, and prints a line per `Persisted` acknowledgement. The
//! parent kills it with SIGKILL after a few acknowledgements, then reopens everything and
//! checks: every acknowledged object is in the bucket and verifies, every other entry comes
//! back as pending and is uploaded after the restart.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kvfs_tiers::writeback::{WritebackConfig, WritebackEvent, WritebackQueue};
use kvfs_tiers::{
    Medium, NvmeConfig, NvmeMedium, ObjectStoreConfig, ObjectStoreMedium, PutOptions,
};

const CHILD_ENV: &str = "KVFS_WRITEBACK_CRASH_DIR";
const OBJECTS: usize = 200;
const KILL_AFTER_ACKS: usize = 8;

fn key(i: usize) -> String {
    format!("model/rank0/{i:064x}")
}

fn data(i: usize) -> Vec<u8> {
    (0..100_000 + i * 7).map(|j| (j as u8) ^ (i as u8)).collect()
}

fn media(dir: &Path) -> Result<(Arc<NvmeMedium>, Arc<ObjectStoreMedium>)> {
    let (nvme, _) = NvmeMedium::open(NvmeConfig::new(dir.join("nvme"), 1 << 30))?;
    let bucket = ObjectStoreMedium::open(ObjectStoreConfig::Fs { root: dir.join("bucket") })?;
    Ok((Arc::new(nvme), Arc::new(bucket)))
}

fn wb_config(dir: &Path) -> WritebackConfig {
    WritebackConfig { workers: 1, ..WritebackConfig::new(dir.join("writeback.journal")) }
}

/// The child: only does something when run by the parent.
#[tokio::test]
#[ignore = "child process of writeback_survives_sigkill"]
async fn crash_child() -> Result<()> {
    let dir = std::env::var(CHILD_ENV).context("run by writeback_survives_sigkill only")?;
    let dir = Path::new(&dir);
    let (nvme, bucket) = media(dir)?;
    let mut sums = Vec::new();
    for i in 0..OBJECTS {
        sums.push(nvme.put(&key(i), &data(i), PutOptions::default()).await?.checksum);
    }
    let (q, _, mut events) = WritebackQueue::open(wb_config(dir), nvme.clone(), bucket).await?;
    for (i, sum) in sums.iter().enumerate() {
        q.enqueue(&key(i), data(i).len() as u64, *sum).await?;
        println!("ENQUEUED {}", key(i));
    }
    while let Some(ev) = events.recv().await {
        if let WritebackEvent::Persisted { key, .. } = ev {
            println!("PERSISTED {key}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writeback_survives_sigkill() -> Result<()> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut acked = HashSet::new();
    let mut enqueued = HashSet::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(k) = line.strip_prefix("ENQUEUED ") {
            enqueued.insert(k.to_owned());
        } else if let Some(k) = line.strip_prefix("PERSISTED ") {
            acked.insert(k.to_owned());
            if acked.len() == KILL_AFTER_ACKS {
                child.kill()?; // SIGKILL
                break;
            }
        }
    }
    let status = child.wait()?;
    ensure!(!enqueued.is_empty(), "child enqueued nothing ({status})");
    ensure!(acked.len() == KILL_AFTER_ACKS, "child ended before the kill: {status}");
    use std::os::unix::process::ExitStatusExt;
    ensure!(status.signal() == Some(libc::SIGKILL), "child was killed by SIGKILL: {status}");

    // Every acknowledged object is in the bucket, verified.
    let (nvme, bucket) = media(dir.path())?;
    for k in &acked {
        let i = usize::from_str_radix(k.rsplit('/').next().unwrap_or(""), 16)?;
        ensure!(bucket.get(k).await? == data(i), "acknowledged {k} is in the bucket");
    }

    // Reopen: nothing acknowledged is pending, everything else is.
    let (q, rec, mut events) =
        WritebackQueue::open(wb_config(dir.path()), nvme, bucket.clone()).await?;
    let pending: HashSet<String> = rec.pending.iter().map(|e| e.key.clone()).collect();
    ensure!(!pending.is_empty(), "the kill left entries to retry");
    ensure!(pending.is_disjoint(&acked), "an acknowledged entry came back as pending");
    // Every acknowledged enqueue is accounted for (persisted before the kill, or pending);
    // an enqueue the child did not get to print may be there too.
    let known = rec.persisted + pending.len();
    ensure!(
        known >= enqueued.len() && known <= OBJECTS,
        "persisted {} + pending {} vs {} enqueued",
        rec.persisted,
        pending.len(),
        enqueued.len()
    );
    let mut done = 0;
    while done < pending.len() {
        match tokio::time::timeout(Duration::from_secs(120), events.recv()).await? {
            Some(WritebackEvent::Persisted { key, .. }) => {
                ensure!(pending.contains(&key), "unexpected upload of {key}");
                done += 1;
            }
            Some(WritebackEvent::Failed { key, error, .. }) => {
                anyhow::bail!("{key} failed after restart: {error}")
            }
            None => anyhow::bail!("event channel closed"),
        }
    }
    q.close().await;
    let listed = bucket.list().await?;
    ensure!(listed.len() == known, "bucket holds {} objects, journal knew {known}", listed.len());
    for k in &enqueued {
        let i = usize::from_str_radix(k.rsplit('/').next().unwrap_or(""), 16)?;
        ensure!(bucket.get(k).await? == data(i), "enqueued {k} is in the bucket after recovery");
    }
    Ok(())
}
