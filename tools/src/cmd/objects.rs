//! `kvfs put`, `get`, `ls`, `stat`, `rm`: object commands against any cluster.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use kvfs_client::{Client, DirEntry, ErrorKind, Persistence, Pin, PutOptions, RenameMode};

use crate::bench::report::human_bytes;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PinArg {
    None,
    Soft,
    Hard,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PersistenceArg {
    None,
    Lazy,
    Eager,
}

/// The memory tier a put places its replicas in.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum TierArg {
    /// The nodes' DRAM segments.
    Dram,
    /// GPU memory of the nodes started with `--hbm` (HBM segments).
    Hbm,
}

#[derive(Args, Debug)]
pub struct PutArgs {
    /// Object key (a `/` in it shows as a directory under the mount).
    pub key: String,
    /// File to store; `-` reads standard input.
    pub file: PathBuf,
    /// Replicas on distinct nodes.
    #[arg(long, default_value_t = 1)]
    pub replicas: u8,
    /// Replace the object if the key exists (by default the first value is kept).
    #[arg(long)]
    pub upsert: bool,
    #[arg(long, value_enum, default_value = "none")]
    pub pin: PinArg,
    #[arg(long, value_enum, default_value = "none")]
    pub persistence: PersistenceArg,
    /// Where the replicas go: DRAM, or the GPU memory of nodes started with `--hbm`.
    #[arg(long, value_enum, default_value = "dram")]
    pub tier: TierArg,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    pub key: String,
    /// Where to write the object; `-` writes standard output.
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only keys starting with this.
    #[arg(default_value = "")]
    pub prefix: String,
    /// One level only, `/`-separated, like a directory listing.
    #[arg(short = 'd', long)]
    pub dirs: bool,
    /// Sizes too.
    #[arg(short = 'l', long)]
    pub long: bool,
    /// Stop after this many entries.
    #[arg(long)]
    pub limit: Option<u64>,
}

#[derive(Args, Debug)]
pub struct StatArgs {
    /// Object key; without one, cluster figures.
    pub key: Option<String>,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Keys to remove.
    pub keys: Vec<String>,
    /// Remove even objects under a read lease or a hard pin.
    #[arg(long)]
    pub force: bool,
    /// Remove every key matching this regular expression (unanchored).
    #[arg(long, conflicts_with = "all")]
    pub regex: Option<String>,
    /// Remove every object.
    #[arg(long)]
    pub all: bool,
}

#[derive(Args, Debug)]
pub struct MvArgs {
    /// The object's key.
    pub from: String,
    /// Its new key. An object there is replaced (its readers keep their bytes until their
    /// lease ends), unless --no-clobber.
    pub to: String,
    /// Fail if an object already has the new key.
    #[arg(short = 'n', long)]
    pub no_clobber: bool,
}

pub async fn mv(master: &str, a: MvArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let mode = if a.no_clobber { RenameMode::NoReplace } else { RenameMode::Replace };
    match client.rename(&a.from, &a.to, mode).await {
        Ok(version) => {
            println!("{:?} -> {:?} (version {version})", a.from, a.to);
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            bail!("mv {:?}: {:?} exists (drop --no-clobber to replace it)", a.from, a.to)
        }
        Err(e) if e.kind() == ErrorKind::PutInProgress => {
            bail!("mv {:?}: one of the keys is being written; retry when its put ends", a.from)
        }
        Err(e) => Err(e).with_context(|| format!("mv {:?} {:?}", a.from, a.to)),
    }
}

pub async fn connect(master: &str) -> anyhow::Result<Client> {
    let cfg = super::client_config(master);
    Client::connect(cfg).await.with_context(|| format!("connecting to the master at {master}"))
}

pub async fn put(master: &str, a: PutArgs) -> anyhow::Result<()> {
    let data = if a.file.as_os_str() == "-" {
        let mut v = Vec::new();
        std::io::stdin().read_to_end(&mut v).context("reading standard input")?;
        v
    } else {
        std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?
    };
    let client = connect(master).await?;
    let opts = PutOptions {
        replicas: a.replicas,
        upsert: a.upsert,
        pin: match a.pin {
            PinArg::None => Pin::None,
            PinArg::Soft => Pin::Soft,
            PinArg::Hard => Pin::Hard,
        },
        persistence: match a.persistence {
            PersistenceArg::None => Persistence::None,
            PersistenceArg::Lazy => Persistence::Lazy,
            PersistenceArg::Eager => Persistence::Eager,
        },
        checksum: true,
        tier: match a.tier {
            TierArg::Dram => kvfs_client::Tier::Dram,
            TierArg::Hbm => kvfs_client::Tier::Hbm,
        },
        ..PutOptions::default()
    };
    client.put(&a.key, &data, &opts).await.with_context(|| format!("put {:?}", a.key))?;
    eprintln!("stored {:?} ({})", a.key, human_bytes(data.len() as u64));
    Ok(())
}

pub async fn get(master: &str, a: GetArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let info = client.stat(&a.key).await.with_context(|| format!("get {:?}", a.key))?;
    let data = client.get(&a.key).await.with_context(|| format!("get {:?}", a.key))?;
    if let Some(sum) = info.checksum
        && *blake3::hash(&data).as_bytes() != sum
    {
        bail!("get {:?}: the bytes read do not match the object's blake3 checksum", a.key);
    }
    if a.out.as_os_str() == "-" {
        std::io::stdout().write_all(&data)?;
        std::io::stdout().flush()?;
    } else {
        std::fs::write(&a.out, &data).with_context(|| format!("writing {}", a.out.display()))?;
        eprintln!("wrote {} to {}", human_bytes(data.len() as u64), a.out.display());
    }
    Ok(())
}

pub async fn ls(master: &str, a: LsArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let mut after: Option<String> = None;
    let mut shown = 0u64;
    let limit = a.limit.unwrap_or(u64::MAX);
    let mut out = std::io::stdout().lock();
    loop {
        let page_limit = (limit - shown).min(1000) as u32;
        if page_limit == 0 {
            break;
        }
        let next = if a.dirs {
            let page = client.list_dir(&a.prefix, after.as_deref(), page_limit).await?;
            for e in &page.entries {
                match e {
                    DirEntry::Object { name, size } if a.long => {
                        writeln!(out, "{size:>14}  {}{name}", a.prefix)?
                    }
                    DirEntry::Object { name, .. } => writeln!(out, "{}{name}", a.prefix)?,
                    DirEntry::Dir { name } if a.long => {
                        writeln!(out, "{:>14}  {}{name}", "-", a.prefix)?
                    }
                    DirEntry::Dir { name } => writeln!(out, "{}{name}", a.prefix)?,
                }
            }
            shown += page.entries.len() as u64;
            page.next_start_after
        } else {
            let page = client.list(&a.prefix, after.as_deref(), page_limit).await?;
            for e in &page.entries {
                if a.long {
                    writeln!(out, "{:>14}  {}", e.size, e.key)?;
                } else {
                    writeln!(out, "{}", e.key)?;
                }
            }
            shown += page.entries.len() as u64;
            page.next_start_after
        };
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    Ok(())
}

pub async fn stat(master: &str, a: StatArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let Some(key) = a.key else {
        let s = client.stats().await?;
        println!(
            "objects {}  pending puts {}  nodes {}  metadata {} ({} per object)",
            s.objects,
            s.pending,
            s.nodes,
            human_bytes(s.metadata_bytes),
            s.metadata_bytes.checked_div(s.objects).map(human_bytes).unwrap_or_else(|| "-".into())
        );
        for t in s.tiers.iter().filter(|t| t.capacity_bytes > 0 || t.replicas > 0) {
            println!(
                "  {:<12} {:>12} used of {:>12}  {} replicas",
                format!("{:?}", t.tier),
                human_bytes(t.used_bytes),
                human_bytes(t.capacity_bytes),
                t.replicas
            );
        }
        if s.recovering {
            println!("  recovering: puts wait until nodes have reported their objects");
        }
        return Ok(());
    };
    let v = client.stat(&key).await.with_context(|| format!("stat {key:?}"))?;
    println!("key          {key}");
    println!("size         {} ({})", v.size, human_bytes(v.size));
    println!("version      {}", v.version);
    println!("checksum     {}", v.checksum.map(hex).unwrap_or_else(|| "-".into()));
    println!("persistence  {:?}", v.persistence);
    println!("pin          {:?}", v.pin);
    println!(
        "lease until  {}",
        if v.lease_end_ms == 0 {
            "-".to_string()
        } else {
            format!("{} ms since epoch", v.lease_end_ms)
        }
    );
    for r in &v.replicas {
        println!(
            "replica      {:?} on {} (node {}) at {:#x}",
            r.tier,
            if r.endpoint.is_empty() { "object store" } else { &r.endpoint },
            r.node.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            r.addr
        );
    }
    Ok(())
}

pub async fn rm(master: &str, a: RmArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    if let Some(re) = &a.regex {
        let c = client.remove_regex(re, a.force).await?;
        println!(
            "removed {} (skipped: {} leased, {} pinned)",
            c.removed, c.skipped_leased, c.skipped_pinned
        );
        return Ok(());
    }
    if a.all {
        let c = client.remove_all(a.force).await?;
        println!(
            "removed {} (skipped: {} leased, {} pinned)",
            c.removed, c.skipped_leased, c.skipped_pinned
        );
        return Ok(());
    }
    if a.keys.is_empty() {
        bail!("nothing to remove: name keys, or use --regex or --all");
    }
    let mut failed = 0;
    for (key, r) in a.keys.iter().zip(client.remove_batch(&a.keys, a.force).await) {
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Leased => {
                failed += 1;
                eprintln!(
                    "rm {key:?}: a read lease protects it (retry after the lease ends, or --force)"
                );
            }
            Err(e) => {
                failed += 1;
                eprintln!("rm {key:?}: {e}");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} keys not removed", a.keys.len());
    }
    Ok(())
}

fn hex(b: [u8; 32]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
