//! `kvfs reshard`: model weights between parallel placements, through the pool.
//!
//! A model is a JSON spec of its tensors and how each is laid out (`kvfs_reshard::ModelSpec`);
//! a layout is `tp4/pp2/ep8/dp2`. `plan` prints what a reshard moves; `store` puts a model's
//! fragment files (`DIR/p<participant>/<tensor>.bin`, raw row-major bytes) into the pool once,
//! under one layout; `load` writes any other layout's fragment files from the pool; `show`
//! prints a stored model.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use kvfs_reshard::{Limits, ModelSpec, Placement, pool};

use super::objects::connect;
use crate::bench::report::human_bytes;

#[derive(Subcommand)]
pub enum ReshardCmd {
    /// Print the regions a reshard from one layout to another moves (no cluster needed).
    Plan(PlanArgs),
    /// Store a model's weights in the pool under one layout (one DP replica goes in).
    Store(StoreArgs),
    /// Write a layout's fragment files from a model stored in the pool.
    Load(LoadArgs),
    /// Show a stored model: its layout's tensors and fragments.
    Show(ShowArgs),
}

#[derive(Args)]
pub struct PlanArgs {
    /// Model spec (JSON: {"tensors": [{"name", "shape", "dtype", "itemsize", "tp_dim", "ep_dim", "layer"}]}).
    #[arg(long)]
    pub spec: PathBuf,
    /// Source layout, like tp2/pp2.
    #[arg(long)]
    pub from: String,
    /// Target layout, like tp4.
    #[arg(long)]
    pub to: String,
    /// Print the plan's regions as JSON lines too.
    #[arg(long)]
    pub regions: bool,
}

#[derive(Args)]
pub struct StoreArgs {
    /// Name the model is stored under.
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub spec: PathBuf,
    /// The layout the files in --dir are in.
    #[arg(long)]
    pub layout: String,
    /// Holds p<participant>/<tensor>.bin for every participant of the layout.
    #[arg(long)]
    pub dir: PathBuf,
}

#[derive(Args)]
pub struct LoadArgs {
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub spec: PathBuf,
    /// The layout to write.
    #[arg(long)]
    pub layout: String,
    /// Participants to write (comma separated); all of the layout's by default.
    #[arg(long, value_delimiter = ',')]
    pub participants: Vec<u32>,
    /// Where p<participant>/<tensor>.bin go.
    #[arg(long)]
    pub dir: PathBuf,
}

#[derive(Args)]
pub struct ShowArgs {
    #[arg(long)]
    pub model: String,
}

fn placement(spec: &Path, layout: &str) -> anyhow::Result<Placement> {
    let s = std::fs::read_to_string(spec).with_context(|| format!("reading {}", spec.display()))?;
    let m = ModelSpec::from_json(&s).with_context(|| format!("model spec {}", spec.display()))?;
    m.placement(layout).with_context(|| format!("layout {layout}"))
}

fn fragment_path(dir: &Path, participant: u32, tensor: &str) -> PathBuf {
    dir.join(format!("p{participant}")).join(format!("{tensor}.bin"))
}

pub async fn run(master: &str, cmd: ReshardCmd) -> anyhow::Result<()> {
    match cmd {
        ReshardCmd::Plan(a) => plan(a),
        ReshardCmd::Store(a) => store(master, a).await,
        ReshardCmd::Load(a) => load(master, a).await,
        ReshardCmd::Show(a) => show(master, a).await,
    }
}

fn plan(a: PlanArgs) -> anyhow::Result<()> {
    let src = placement(&a.spec, &a.from)?;
    let dst = placement(&a.spec, &a.to)?;
    let t = Instant::now();
    let p = kvfs_reshard::plan(&src, &dst, &Limits::default())?;
    let took = t.elapsed();
    println!(
        "{} -> {}: {} tensors, {} -> {} participants",
        a.from,
        a.to,
        dst.tensors.len(),
        src.participants,
        dst.participants
    );
    println!(
        "{} regions, {} contiguous segments, {} moved ({} between participants), planned in {:.1} ms",
        p.regions.len(),
        p.segments(),
        human_bytes(p.bytes()),
        human_bytes(p.remote_bytes()),
        took.as_secs_f64() * 1e3
    );
    println!("{:>11} {:>12} {:>12} {:>8}", "participant", "holds", "receives", "regions");
    for q in 0..dst.participants {
        let rs: Vec<_> = p.regions.iter().filter(|r| r.dst_participant == q).collect();
        let recv: u64 = rs.iter().filter(|r| r.src_participant != q).map(|r| r.bytes()).sum();
        println!(
            "{q:>11} {:>12} {:>12} {:>8}",
            human_bytes(dst.bytes_of(q)),
            human_bytes(recv),
            rs.len()
        );
    }
    if a.regions {
        for r in &p.regions {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    Ok(())
}

async fn store(master: &str, a: StoreArgs) -> anyhow::Result<()> {
    let src = placement(&a.spec, &a.layout)?;
    let client = connect(master).await?;
    let (mut stored, mut bytes) = (0, 0u64);
    let t = Instant::now();
    for p in 0..src.participants {
        let mut bufs = Vec::new();
        for (ti, t) in src.tensors.iter().enumerate() {
            for (fi, _) in t.fragments.iter().enumerate().filter(|(_, f)| f.participant == p) {
                let path = fragment_path(&a.dir, p, &t.desc.name);
                let b =
                    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
                bufs.push((ti as u32, fi as u32, b));
            }
        }
        let items: Vec<(u32, u32, &[u8])> =
            bufs.iter().map(|(t, f, b)| (*t, *f, b.as_slice())).collect();
        let n = pool::store(&client, &a.model, &src, &items)
            .await
            .with_context(|| format!("storing participant {p}"))?;
        stored += n;
        bytes += bufs.iter().map(|b| b.2.len() as u64).sum::<u64>();
        eprintln!("participant {}/{}: {n} fragments stored", p + 1, src.participants);
    }
    pool::store_manifest(&client, &a.model, &src).await?;
    println!(
        "{}: {stored} fragments of {} tensors stored under {} ({} read, {:.1} s)",
        a.model,
        src.tensors.len(),
        a.layout,
        human_bytes(bytes),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn load(master: &str, a: LoadArgs) -> anyhow::Result<()> {
    let dst = placement(&a.spec, &a.layout)?;
    let client = connect(master).await?;
    let who: Vec<u32> =
        if a.participants.is_empty() { (0..dst.participants).collect() } else { a.participants };
    if let Some(p) = who.iter().find(|&&p| p >= dst.participants) {
        bail!("participant {p}: layout {} has {}", a.layout, dst.participants);
    }
    let t = Instant::now();
    let mut bytes = 0u64;
    for (i, &p) in who.iter().enumerate() {
        let frags = pool::load(&client, &a.model, &dst, p)
            .await
            .with_context(|| format!("loading participant {p} of {}", a.layout))?;
        for (ti, _, b) in frags {
            let path = fragment_path(&a.dir, p, &dst.tensors[ti as usize].desc.name);
            std::fs::create_dir_all(path.parent().expect("a parent"))?;
            std::fs::write(&path, &b).with_context(|| format!("writing {}", path.display()))?;
            bytes += b.len() as u64;
        }
        eprintln!("participant {p} ({}/{}) written", i + 1, who.len());
    }
    println!(
        "{}: {} participants of {} written to {} ({}, {:.1} s)",
        a.model,
        who.len(),
        a.layout,
        a.dir.display(),
        human_bytes(bytes),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn show(master: &str, a: ShowArgs) -> anyhow::Result<()> {
    let client = connect(master).await?;
    let p = pool::manifest(&client, &a.model).await?;
    println!(
        "{}: {} tensors over {} participants, placement {}",
        a.model,
        p.tensors.len(),
        p.participants,
        &p.digest()[..16]
    );
    for t in &p.tensors {
        println!(
            "  {} {:?} {} ({} fragments, {})",
            t.desc.name,
            t.desc.shape,
            t.desc.dtype,
            t.fragments.len(),
            human_bytes(t.desc.bytes())
        );
    }
    Ok(())
}
