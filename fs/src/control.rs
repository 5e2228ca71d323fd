//! `/.kvfs/`: the fast path's control file, read-only JSON status files, and the master's jobs.
//!
//! - `control`: the ioctl target (reading it says which ABI it speaks);
//! - `status.json`: this mount: mount point, master, limits, counters, staging in use;
//! - `cluster.json`: the master's figures (objects, nodes, tiers);
//! - `buffers.json`: buffers registered on the fast path (id, pid, bytes);
//! - `jobs/ID.json`: one file per offload/restore job the master knows (`kvfs jobs`): its
//!   status as the master reports it (`JobStatus`: spec, state, counters, first errors), plus
//!   `kind` and `state_name` as `kvfs jobs` prints them and `percent` (objects done). The mtime
//!   is the job's last update.
//!
//! Files are rendered when opened and read with direct I/O, so they report size 0 (as /proc
//! files do) and each open sees fresh figures. Everything here is read-only: creating,
//! writing, removing or renaming anything under `/.kvfs/` is `EPERM`.
//!
//! Jobs: listing `jobs/` asks the master for every job it keeps (it bounds them: the running
//! ones and the most recent ended ones; older ones are forgotten, and their files with them),
//! once per opendir; looking up or opening `ID.json` asks for that job, so a job started since
//! the listing is there at once. A job the master does not know is `ENOENT`; a master that
//! cannot answer gives its errno (`ENOTCONN`, `EAGAIN` while it reads its job records after a
//! restart, `EIO`). Only the canonical name (`ID` in decimal, no leading zeros) names a job.
//! Starting and cancelling jobs is not done through the mount (`kvfs offload`, `kvfs jobs
//! cancel`, or the client API).

use std::sync::atomic::Ordering;

use kvfs_client::{JobState, JobStatus};
use serde_json::json;

use crate::errno;
use crate::state::{Errno, Inner, lock};

/// What reading the control file returns.
pub fn control_text() -> Vec<u8> {
    format!(
        "kvfs fast path, ABI {}: ioctl KVFS_IOC_INFO/REGISTER/UNREGISTER/SUBMIT on this file (see kvfs.h)\n",
        kvfs_fs_abi::ABI_VERSION
    )
    .into_bytes()
}

/// The text of status file `which` (an index into `STATUS_FILES`).
pub async fn render(inner: &Inner, which: usize) -> Vec<u8> {
    let v = match which {
        0 => {
            let cfg = &inner.cfg;
            json!({
                "mountpoint": cfg.mountpoint.display().to_string(),
                "master": inner.client.master_addr(),
                "abi_version": kvfs_fs_abi::ABI_VERSION,
                "passthrough": cfg.passthrough.is_some(),
                "staging_bytes": inner.staging.used(),
                "staging_bytes_max": cfg.staging_bytes_max,
                "staging_file_bytes_max": cfg.staging_file_bytes_max,
                "fetch_bytes_max": cfg.fetch_bytes_max,
                "pending_writes": lock(&inner.pending).len(),
                "open_handles": lock(&inner.handles).len(),
                "inodes": lock(&inner.table).len(),
                "passthrough_inodes": lock(&inner.backings).len(),
                "counters": inner.counters.to_json(),
                "uptime_s": inner.started.elapsed().map(|d| d.as_secs()).unwrap_or(0),
            })
        }
        1 => match inner.client.stats().await {
            Ok(s) => serde_json::to_value(&s).unwrap_or_default(),
            Err(e) => json!({ "error": e.to_string() }),
        },
        _ => {
            let bufs: Vec<_> = inner
                .fastpath
                .buffers()
                .into_iter()
                .map(|(id, pid, bytes)| json!({ "id": id, "pid": pid, "bytes": bytes }))
                .collect();
            json!({
                "buffers": bufs,
                "registrations": inner.counters.fastpath_registrations.load(Ordering::Relaxed),
            })
        }
    };
    let mut text = serde_json::to_vec_pretty(&v).unwrap_or_default();
    text.push(b'\n');
    text
}

/// The file name of job `id` under `/.kvfs/jobs/`.
pub fn job_name(id: u64) -> String {
    format!("{id}.json")
}

/// The job a file name under `/.kvfs/jobs/` names, if it is the canonical spelling.
pub fn job_id(name: &[u8]) -> Option<u64> {
    let digits = std::str::from_utf8(name.strip_suffix(b".json")?).ok()?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id: u64 = digits.parse().ok()?;
    (id.to_string() == digits).then_some(id)
}

/// Job `id` as the master reports it (`ENOENT` when it does not know it).
pub async fn job(inner: &Inner, id: u64) -> Result<JobStatus, Errno> {
    inner.client.job(id).await.map_err(|e| errno::of(&e))
}

/// The ids of the jobs the master keeps, running ones first.
pub async fn job_ids(inner: &Inner) -> Result<Vec<u64>, Errno> {
    let jobs = inner.client.jobs().await.map_err(|e| errno::of(&e))?;
    Ok(jobs.into_iter().map(|s| s.id).collect())
}

/// The text of a job file: the status as JSON, with its kind and state by name and the
/// share of its objects done.
pub fn render_job(s: &JobStatus) -> Vec<u8> {
    let percent = if s.objects_total > 0 {
        (s.objects_done as f64 * 100.0 / s.objects_total as f64).min(100.0)
    } else if s.state == JobState::Running {
        0.0
    } else {
        100.0
    };
    let mut v = serde_json::to_value(s).unwrap_or_default();
    if let Some(m) = v.as_object_mut() {
        m.insert("kind".into(), s.spec.kind.name().into());
        m.insert("state_name".into(), s.state.name().into());
        m.insert("percent".into(), ((percent * 10.0).round() / 10.0).into());
    }
    let mut text = serde_json::to_vec_pretty(&v).unwrap_or_default();
    text.push(b'\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfs_client::{JobKind, JobSpec};

    #[test]
    fn only_canonical_names_are_jobs() {
        assert_eq!(job_id(b"1700000000123.json"), Some(1_700_000_000_123));
        assert_eq!(job_id(b"0.json"), Some(0));
        assert_eq!(job_id(job_name(42).as_bytes()), Some(42));
        for bad in [
            &b"042.json"[..],
            b"+42.json",
            b"42",
            b".json",
            b"42.json.json",
            b"4 2.json",
            b"18446744073709551616.json",
            b"42.JSON",
        ] {
            assert_eq!(job_id(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_job_file_is_its_status_and_derived_fields() {
        let s = JobStatus {
            id: 7,
            spec: JobSpec {
                kind: JobKind::Offload { evict: true },
                prefix: "p/".into(),
                concurrency: 4,
                rate_bytes_per_s: 0,
            },
            state: JobState::Running,
            started_ms: 1,
            updated_ms: 2,
            finished_ms: 0,
            objects_total: 3,
            bytes_total: 300,
            objects_done: 1,
            bytes_done: 100,
            moved: 1,
            already: 0,
            gone: 0,
            evicted: 1,
            kept: 0,
            failed: 0,
            resumed: 0,
            errors: vec![],
        };
        let v: serde_json::Value = serde_json::from_slice(&render_job(&s)).unwrap();
        assert_eq!(v["id"], 7);
        assert_eq!(v["state"], "Running");
        assert_eq!(v["state_name"], "running");
        assert_eq!(v["kind"], "offload --move");
        assert_eq!(v["spec"]["prefix"], "p/");
        assert_eq!(v["percent"], 33.3);
        let back: JobStatus = serde_json::from_value(v).unwrap();
        assert_eq!(back, s, "the derived fields do not hide the status");
        let empty = JobStatus { objects_total: 0, objects_done: 0, state: JobState::Done, ..s };
        let v: serde_json::Value = serde_json::from_slice(&render_job(&empty)).unwrap();
        assert_eq!(v["percent"], 100.0);
    }
}
