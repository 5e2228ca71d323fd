//! `kvfs offload`, `kvfs restore`, `kvfs jobs`: jobs the master owns.
//!
//! The CLI starts a job and follows it with a progress bar (objects, bytes, rate, ETA; a line a
//! second when standard error is not a terminal), then prints the report. The job is the
//! master's: interrupting the CLI (Ctrl-C, a kill) leaves it running, `kvfs jobs wait ID`
//! follows it again, and a master that restarts resumes it. While the master cannot be
//! reached the CLI retries for `--master-wait` seconds.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Subcommand};
use kvfs_client::{Client, ErrorKind, JobKind, JobSpec, JobState, JobStatus};

use super::objects::connect;
use crate::bench::report::{human_bytes, parse_bytes};

#[derive(Args, Debug)]
pub struct JobOpts {
    /// Objects in flight at once (1-256).
    #[arg(long, default_value_t = 8)]
    pub concurrency: u32,
    /// Bytes per second the job may move (K/M/G binary units; 0: no limit).
    #[arg(long, value_parser = parse_bytes, default_value = "0")]
    pub rate: u64,
    /// Print the job's id and return at once (follow it with `kvfs jobs wait ID`).
    #[arg(long)]
    pub detach: bool,
    /// Seconds to keep retrying while the master cannot be reached (it may be restarting).
    #[arg(long, default_value_t = 120)]
    pub master_wait: u64,
}

#[derive(Args, Debug)]
pub struct OffloadArgs {
    /// Keys starting with this ("" for every key).
    pub prefix: String,
    /// Then drop the objects' pool copies (DRAM, HBM, NVMe): only the object store keeps them.
    #[arg(long = "move")]
    pub evict: bool,
    #[command(flatten)]
    pub opts: JobOpts,
}

#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// Keys starting with this ("" for every key).
    pub prefix: String,
    #[command(flatten)]
    pub opts: JobOpts,
}

#[derive(Subcommand, Debug)]
pub enum JobsCmd {
    /// Every job the master knows, running ones first (the default).
    List,
    /// One job's status and report.
    Show { id: u64 },
    /// Follow a job with a progress bar until it ends; exits 1 unless it is done.
    Wait {
        id: u64,
        #[arg(long, default_value_t = 120)]
        master_wait: u64,
    },
    /// Stop a running job after the objects in flight.
    Cancel { id: u64 },
}

pub async fn offload(master: &str, a: OffloadArgs) -> anyhow::Result<()> {
    start(master, JobKind::Offload { evict: a.evict }, a.prefix, a.opts).await
}

pub async fn restore(master: &str, a: RestoreArgs) -> anyhow::Result<()> {
    start(master, JobKind::Restore, a.prefix, a.opts).await
}

async fn start(master: &str, kind: JobKind, prefix: String, o: JobOpts) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let spec = JobSpec { kind, prefix, concurrency: o.concurrency, rate_bytes_per_s: o.rate };
    let s = client.job_start(spec).await?;
    eprintln!("job {} started: {} {:?}", s.id, s.spec.kind.name(), s.spec.prefix);
    if o.detach {
        println!("{}", s.id);
        return Ok(());
    }
    follow(&client, s.id, o.master_wait).await
}

pub async fn jobs(master: &str, cmd: Option<JobsCmd>) -> anyhow::Result<()> {
    let client = connect(master).await?;
    match cmd.unwrap_or(JobsCmd::List) {
        JobsCmd::List => {
            let v = client.jobs().await?;
            if v.is_empty() {
                println!("no jobs");
            }
            println!(
                "{:<14} {:<15} {:<10} {:>15} {:>21}  prefix",
                "id", "kind", "state", "objects", "bytes"
            );
            for s in v {
                println!(
                    "{:<14} {:<15} {:<10} {:>15} {:>21}  {:?}",
                    s.id,
                    s.spec.kind.name(),
                    s.state.name(),
                    format!("{}/{}", s.objects_done, s.objects_total),
                    format!("{}/{}", human_bytes(s.bytes_done), human_bytes(s.bytes_total)),
                    s.spec.prefix
                );
            }
            Ok(())
        }
        JobsCmd::Show { id } => {
            let s = client.job(id).await?;
            print!("{}", report(&s));
            Ok(())
        }
        JobsCmd::Wait { id, master_wait } => follow(&client, id, master_wait).await,
        JobsCmd::Cancel { id } => {
            let s = client.job_cancel(id).await?;
            if s.state == JobState::Running {
                eprintln!("job {id}: cancelling after the objects in flight");
            } else {
                eprintln!("job {id} is {} already", s.state.name());
            }
            Ok(())
        }
    }
}

/// Polls the job until it ends, drawing the progress, then prints the report. Exits with an
/// error unless the job is done.
async fn follow(client: &Client, id: u64, master_wait: u64) -> anyhow::Result<()> {
    let tty = std::io::stderr().is_terminal();
    let mut bar = Bar::new(tty);
    let mut unreachable_since: Option<Instant> = None;
    let s = loop {
        match client.job(id).await {
            Ok(s) => {
                if unreachable_since.take().is_some() {
                    bar.note("master reachable again; following the job");
                }
                bar.draw(&s);
                if s.state != JobState::Running {
                    break s;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::InvalidArgument) => {
                return Err(e.into());
            }
            Err(e) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(master_wait) {
                    bail!(
                        "job {id}: the master is unreachable for {master_wait} s ({e}); the job \
                         runs on there: `kvfs jobs wait {id}` follows it again"
                    );
                }
                bar.note(&format!("master unreachable ({e}); retrying"));
            }
        }
        tokio::time::sleep(Duration::from_millis(if tty { 200 } else { 500 })).await;
    };
    bar.finish();
    print!("{}", report(&s));
    match s.state {
        JobState::Done => Ok(()),
        other => bail!("job {id} {}", other.name()),
    }
}

/// The final report of a job.
fn report(s: &JobStatus) -> String {
    let end = if s.finished_ms > 0 { s.finished_ms } else { s.updated_ms };
    let secs = end.saturating_sub(s.started_ms) as f64 / 1e3;
    let (verb, already) = match s.spec.kind {
        JobKind::Restore => ("loaded into memory", "in memory already"),
        JobKind::Offload { .. } => ("written to the object store", "in the object store already"),
    };
    let mut o = format!(
        "job {} {} {:?}: {}\n  objects   {} of {} ({} of {}) in {secs:.1} s, {}/s\n  {verb:<28} {}\n  {already:<28} {}\n  {:<28} {}\n",
        s.id,
        s.spec.kind.name(),
        s.spec.prefix,
        s.state.name(),
        s.objects_done,
        s.objects_total,
        human_bytes(s.bytes_done),
        human_bytes(s.bytes_total),
        human_bytes((s.bytes_done as f64 / secs.max(1e-3)) as u64),
        s.moved,
        s.already,
        "removed or replaced meanwhile",
        s.gone,
    );
    if let JobKind::Offload { evict: true } = s.spec.kind {
        o += &format!("  {:<28} {}\n", "pool copies dropped", s.evicted);
        o += &format!("  {:<28} {}\n", "kept (pinned or leased)", s.kept);
    }
    o += &format!("  {:<28} {}\n", "failed", s.failed);
    if s.resumed > 0 {
        o += &format!("  resumed {} time(s) by a restarted master\n", s.resumed);
    }
    for e in &s.errors {
        o += &format!("  error: {e}\n");
    }
    o
}

/// The progress bar: redrawn in place on a terminal, a line a second otherwise.
struct Bar {
    tty: bool,
    last_line: Instant,
    /// (when, bytes done) seen a few seconds back, for the rate.
    window: std::collections::VecDeque<(Instant, u64)>,
    drawn: bool,
}

impl Bar {
    fn new(tty: bool) -> Bar {
        Bar {
            tty,
            last_line: Instant::now() - Duration::from_secs(10),
            window: Default::default(),
            drawn: false,
        }
    }

    fn draw(&mut self, s: &JobStatus) {
        let now = Instant::now();
        self.window.push_back((now, s.bytes_done));
        while self.window.len() > 2 && now.duration_since(self.window[0].0) > Duration::from_secs(5)
        {
            self.window.pop_front();
        }
        let (t0, b0) = self.window[0];
        let dt = now.duration_since(t0).as_secs_f64();
        let rate = if dt > 0.2 { (s.bytes_done.saturating_sub(b0)) as f64 / dt } else { 0.0 };
        let left = s.bytes_total.saturating_sub(s.bytes_done) as f64;
        let eta = if s.state != JobState::Running {
            "0s".to_string()
        } else if rate > 0.0 {
            format!("{:.0}s", left / rate)
        } else {
            "?".to_string()
        };
        let frac = if s.objects_total > 0 {
            (s.objects_done as f64 / s.objects_total as f64).min(1.0)
        } else if s.state == JobState::Running {
            0.0
        } else {
            1.0
        };
        let width = 30;
        let filled = (frac * width as f64).round() as usize;
        let line = format!(
            "[{}{}] {:>3.0}% {}/{} objects, {}/{}, {}/s, ETA {eta}",
            "#".repeat(filled),
            "-".repeat(width - filled),
            frac * 100.0,
            s.objects_done,
            s.objects_total,
            human_bytes(s.bytes_done),
            human_bytes(s.bytes_total),
            human_bytes(rate as u64),
        );
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
            let _ = err.flush();
            self.drawn = true;
        } else if now.duration_since(self.last_line) >= Duration::from_secs(1)
            || s.state != JobState::Running
        {
            let _ = writeln!(err, "{line}");
            self.last_line = now;
        }
    }

    fn note(&mut self, msg: &str) {
        self.finish();
        eprintln!("{msg}");
    }

    fn finish(&mut self) {
        if self.tty && self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}
