//! `kvfs bench failover`: the leader master SIGKILLed under load.
//!
//! Starts a throwaway etcd (or uses `--etcd`), two candidate masters and `--nodes` nodes as
//! processes of this binary, fills the directory with `--objects` objects through a client that
//! follows the leader (`etcd://`), then runs `--workers` loops that each put a new object and
//! get a random old one, back to back. After `--warm-s` seconds it SIGKILLs the leader, keeps
//! the loops going for `--after-s` seconds, and reports: when etcd named the new leader, the
//! first get and the first put that succeeded after the kill (a standby that mirrored the
//! leader's grants takes over without a grace; one that did not makes puts wait out
//! `--recovery-grace-ms`), call latency around the failover (p50/p99/max of
//! calls that started within a second before the kill and until the end), failed calls, and
//! then reads back every object it was told was stored (the loaded ones and every acknowledged
//! put of the loops): objects lost must be 0.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvfs_client::{Client, ClientConfig, PutOptions};
use kvfs_ha::testing::EtcdServer;
use kvfs_ha::{Etcd, EtcdTarget, leader_key};

use crate::bench::report::{human_bytes, parse_bytes};

/// Arguments of `kvfs bench failover`.
#[derive(Args, Debug, Clone)]
pub struct FailoverArgs {
    /// Objects in the directory when the leader is killed.
    #[arg(long, default_value_t = 1_000_000)]
    pub objects: u64,
    /// Size of each object.
    #[arg(long, default_value = "256", value_parser = parse_bytes)]
    pub object_size: u64,
    /// Node processes (the objects are spread over them).
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// DRAM of each node (each object takes at least one 4 KiB range).
    #[arg(long, default_value = "3GiB", value_parser = parse_bytes)]
    pub node_dram: u64,
    /// Concurrent loops during the failover (half put, half get; at least one of each).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Seconds of load before the kill.
    #[arg(long, default_value_t = 2)]
    pub warm_s: u64,
    /// Seconds of load after the kill.
    #[arg(long, default_value_t = 8)]
    pub after_s: u64,
    /// The masters' leader lease (seconds).
    #[arg(long, default_value_t = 2)]
    pub lease_ttl_s: u64,
    /// The masters' recovery grace: how long a new leader without a complete mirror of the
    /// old one's grants refuses puts after nodes came back with objects (writers of the old
    /// leader may still be writing).
    #[arg(long, default_value_t = 10_000)]
    pub recovery_grace_ms: u64,
    /// Use this etcd (HOST:PORT,...) instead of starting one (`etcd` must be on PATH then).
    #[arg(long)]
    pub etcd: Option<String>,
}

struct Kids(Vec<(String, Child)>);

impl Drop for Kids {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_addr() -> anyhow::Result<String> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string())
}

fn spawn(args: &[String]) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("locating the kvfs binary")?;
    Command::new(exe)
        .args(args)
        .env("KVFS_LOG", std::env::var("KVFS_LOG").unwrap_or_else(|_| "error".into()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting kvfs {args:?}"))
}

fn value(key: u64, size: u64) -> Vec<u8> {
    kvfs_transfer::testing::pattern(key, 0, size as usize)
}

/// One call of a loop: when it started (relative to the kill, negative before), how long it
/// took, whether it succeeded, and what it was.
struct Call {
    at_s: f64,
    us: f64,
    ok: bool,
    put: bool,
}

pub async fn run(a: FailoverArgs) -> anyhow::Result<()> {
    if a.objects == 0 || a.object_size == 0 || a.nodes == 0 || a.workers == 0 {
        anyhow::bail!("--objects, --object-size, --nodes and --workers must be positive");
    }
    let _etcd_server;
    let endpoints = match &a.etcd {
        Some(e) => e.clone(),
        None => {
            let s = std::thread::spawn(EtcdServer::start)
                .join()
                .map_err(|_| anyhow::anyhow!("starting etcd failed (is etcd-server installed?)"))?;
            let ep = s.endpoint();
            _etcd_server = s;
            ep
        }
    };
    let cluster = format!("bench-{}", std::process::id());
    let target = EtcdTarget::new(&endpoints, &cluster)?;
    let etcd = Etcd::new(target.endpoints.clone(), Duration::from_secs(2))?;
    let master_addr = target.master_addr();
    let mut kids = Kids(Vec::new());
    let mut masters = Vec::new();
    for _ in 0..2 {
        let addr = free_addr()?;
        let args: Vec<String> = [
            "master",
            "--listen",
            &addr,
            "--admin",
            "off",
            "--etcd",
            &endpoints,
            "--cluster",
            &cluster,
            "--lease-ttl-s",
            &a.lease_ttl_s.to_string(),
            "--recovery-grace-ms",
            &a.recovery_grace_ms.to_string(),
            "--heartbeat-ms",
            "500",
            "--object-size-max",
            "64MiB",
        ]
        .map(String::from)
        .to_vec();
        kids.0.push((addr.clone(), spawn(&args)?));
        masters.push(addr);
        // The first one leads: wait for it, so the second stands by.
        if masters.len() == 1 {
            wait_leader(&etcd, &cluster, 0).await?;
        }
    }
    for _ in 0..a.nodes {
        let args: Vec<String> =
            ["node", "--master", &master_addr, "--dram", &a.node_dram.to_string(), "--no-populate"]
                .map(String::from)
                .to_vec();
        kids.0.push(("node".into(), spawn(&args)?));
    }
    let cfg = ClientConfig { master: master_addr.clone(), ..ClientConfig::default() };
    let client = Arc::new(Client::connect(cfg).await.context("connecting through etcd")?);
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.stats().await.map(|s| s.nodes as usize).unwrap_or(0) < a.nodes {
        anyhow::ensure!(Instant::now() < deadline, "the nodes did not register within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "kvfs bench failover: etcd {endpoints}, 2 masters, {} nodes x {}; loading {} objects of {}",
        a.nodes,
        human_bytes(a.node_dram),
        a.objects,
        human_bytes(a.object_size)
    );
    let loaded = Instant::now();
    let batch = 1000u64;
    let mut i = 0;
    while i < a.objects {
        let n = batch.min(a.objects - i);
        let keys: Vec<String> = (i..i + n).map(|k| format!("f/{k}")).collect();
        let vals: Vec<Vec<u8>> = (i..i + n).map(|k| value(k, a.object_size)).collect();
        let items: Vec<(&str, &[u8])> =
            keys.iter().map(String::as_str).zip(vals.iter().map(Vec::as_slice)).collect();
        for (k, r) in keys.iter().zip(client.put_batch(&items, &PutOptions::default()).await) {
            r.with_context(|| format!("loading {k}"))?;
        }
        i += n;
    }
    let objects = client.stats().await?.objects;
    println!(
        "  loaded in {:.1} s; the leader's directory holds {objects} objects",
        loaded.elapsed().as_secs_f64()
    );

    // The loops: put a new key, get a random loaded one.
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut loops = Vec::new();
    // Half the loops put new objects, half get random loaded ones (at least one of each), so
    // a put waiting out the recovery grace does not hide when gets came back.
    for w in 0..a.workers.max(2) as u64 {
        let (c, stop) = (client.clone(), stop.clone());
        let (size, objects) = (a.object_size, a.objects);
        let putter = w % 2 == 0;
        loops.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            let mut acked = Vec::new();
            let mut n = 0u64;
            let mut rng = w.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let ok = if putter {
                    let key = (w + 1) << 40 | n;
                    n += 1;
                    let v = value(key, size);
                    let ok = c.put(&format!("f/{key}"), &v, &PutOptions::default()).await.is_ok();
                    if ok {
                        acked.push(key);
                    }
                    ok
                } else {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let old = rng % objects;
                    c.get(&format!("f/{old}")).await.is_ok_and(|v| v == value(old, size))
                };
                calls.push((t, t.elapsed(), ok, putter));
                if !ok {
                    // A failing call may return at once: do not spin on it.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            (calls, acked)
        }));
    }
    tokio::time::sleep(Duration::from_secs(a.warm_s)).await;
    let (leader, term) = wait_leader(&etcd, &cluster, 0).await?;
    let Some(pos) = kids.0.iter().position(|(addr, _)| *addr == leader) else {
        anyhow::bail!("the leader {leader} is not one of the masters started");
    };
    let killed = Instant::now();
    let (_, mut child) = kids.0.remove(pos);
    child.kill().context("killing the leader")?;
    let _ = child.wait();
    let (new_leader, new_term) = wait_leader(&etcd, &cluster, term).await?;
    let elected = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(a.after_s).saturating_sub(killed.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    let mut calls = Vec::new();
    let mut acked = Vec::new();
    for l in loops {
        let (c, k) = l.await?;
        calls.extend(c.into_iter().map(|(t, d, ok, put)| Call {
            at_s: if t >= killed {
                t.duration_since(killed).as_secs_f64()
            } else {
                -killed.duration_since(t).as_secs_f64()
            },
            us: d.as_secs_f64() * 1e6,
            ok,
            put,
        }));
        acked.extend(k);
    }
    calls.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    let first_after = |put: bool| {
        calls.iter().find(|c| c.at_s >= 0.0 && c.ok && c.put == put).map(|c| c.at_s + c.us / 1e6)
    };
    let (first_get, first_put) = (first_after(false), first_after(true));
    let mut window: Vec<f64> = calls.iter().filter(|c| c.at_s >= -1.0).map(|c| c.us).collect();
    window.sort_by(f64::total_cmp);
    let pct = |p: f64| window.get(((window.len() as f64 - 1.0) * p).round() as usize).copied();
    let failed =
        |put: bool| calls.iter().filter(|c| c.at_s >= -1.0 && !c.ok && c.put == put).count();
    let before = calls.iter().filter(|c| c.at_s < 0.0).count();

    // Everything acknowledged, read back.
    let verify = Instant::now();
    let mut lost = 0u64;
    let mut wrong = 0u64;
    let all: Vec<u64> = (0..a.objects).chain(acked.iter().copied()).collect();
    for chunk in all.chunks(1000) {
        let keys: Vec<String> = chunk.iter().map(|k| format!("f/{k}")).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = client.get_batch(&keys).await;
            let retry = got.iter().any(|r| r.as_ref().is_err_and(|e| e.retryable()));
            if retry && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            for (k, r) in chunk.iter().zip(got) {
                match r {
                    Ok(v) if v == value(*k, a.object_size) => {}
                    Ok(_) => wrong += 1,
                    Err(_) => lost += 1,
                }
            }
            break;
        }
    }
    let ms = |s: Option<f64>| s.map_or("never".to_string(), |s| format!("{:.0} ms", s * 1e3));
    let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1} ms", v / 1e3));
    println!(
        "  leader {leader} (term {term}) SIGKILLed after {:.1} s of load ({before} calls)",
        killed.duration_since(start).as_secs_f64()
    );
    println!(
        "  new leader {new_leader} (term {new_term}) elected {:.0} ms after the kill",
        elected.as_secs_f64() * 1e3
    );
    println!("  first get after the kill  {}", ms(first_get));
    println!(
        "  first put after the kill  {}  (recovery grace {} ms, waived after a mirrored takeover)",
        ms(first_put),
        a.recovery_grace_ms
    );
    println!(
        "  calls from 1 s before the kill on: {} (failed: {} gets, {} puts), p50 {}, p99 {}, max {}",
        window.len(),
        failed(false),
        failed(true),
        us(pct(0.5)),
        us(pct(0.99)),
        us(window.last().copied())
    );
    println!(
        "  objects lost: {lost} (of {}: {} loaded, {} acknowledged during the run); wrong bytes: {wrong}; verified in {:.1} s",
        all.len(),
        a.objects,
        acked.len(),
        verify.elapsed().as_secs_f64()
    );
    if lost > 0 || wrong > 0 {
        anyhow::bail!("{lost} acknowledged objects lost, {wrong} read back wrong");
    }
    Ok(())
}

async fn wait_leader(etcd: &Etcd, cluster: &str, newer_than: u64) -> anyhow::Result<(String, u64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((_, Some(kv))) = etcd.get(&leader_key(cluster)).await
            && kv.create_revision > newer_than
        {
            return Ok((String::from_utf8_lossy(&kv.value).into_owned(), kv.create_revision));
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no leader newer than term {newer_than} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
