//! `kvfs bench trace`: request traces replayed through a simulated prefix cache, hit rate
//! against capacity for plain LRU and for kvfs's policy (leaf-first LRFU with a TinyLFU-style
//! admission filter switched by set dueling: `kvfs_conductor::trace`).
//!
//! Every figure is computed in the run: each trace is loaded, then replayed once per capacity
//! and policy (the unbounded capacity once: no policy evicts there). One table per trace, or
//! one JSON object per figure with `--json`; `--plot` draws hit rate against capacity (log x
//! axis), one line per policy and trace (LRU dashed, kvfs solid, the unbounded ceiling
//! dotted). Text on the plot needs a TrueType font read at run time (DejaVu or Liberation Sans
//! under /usr/share/fonts, or `KVFS_PLOT_FONT`); without one the plot is drawn without text
//! and a note says so.
//!
//! Then (unless `--no-simulate`) each trace is replayed through a simulated disaggregated
//! cluster (`kvfs_conductor::sim`): `--prefill` prefill instances with local prefix caches,
//! `--decode` decode instances and the pool, arrivals sped up by `--speed`, routed by each
//! policy of `kvfs_conductor::route` with and without early rejection; one row per policy and
//! rejection setting (TTFT and TBT p50/p99, SLO attainment over all requests, rejections,
//! wasted prefills, prefill compute saved by cache hits), or one JSON object per row.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use kvfs_conductor::route::Policy as RoutePolicy;
use kvfs_conductor::sim::{SimConfig, SimStats, simulate, speed_for_load};
use kvfs_conductor::trace::{Capacity, Policy, ReplayStats, Trace, replay};
use serde_json::json;

/// Arguments of `kvfs bench trace`.
#[derive(Args)]
pub struct TraceArgs {
    /// A trace of JSON lines (`timestamp`, `input_length`, `output_length`, `hash_ids`);
    /// repeat for several traces.
    #[arg(long = "trace", required = true)]
    pub traces: Vec<PathBuf>,
    /// Cache capacities in tokens (comma separated; 1e6 and 2M are accepted, `unbounded` is
    /// the trace's ceiling).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1e5,2e5,5e5,1e6,2e6,5e6,1e7,unbounded",
        value_parser = parse_capacity
    )]
    pub capacities: Vec<Capacity>,
    /// Print one JSON object per figure instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Draw hit rate against capacity into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Skip the cluster simulation (routing policies).
    #[arg(long)]
    pub no_simulate: bool,
    /// Only the cluster simulation (skip the hit-rate sweep).
    #[arg(long, conflicts_with = "no_simulate")]
    pub simulate_only: bool,
    /// Simulated prefill instances (one 8-GPU node each).
    #[arg(long, default_value_t = SimConfig::DEFAULT.prefill_instances)]
    pub prefill: usize,
    /// Simulated decode instances.
    #[arg(long, default_value_t = SimConfig::DEFAULT.decode_instances)]
    pub decode: usize,
    /// Arrival times are divided by this (2: twice the trace's request rate); overrides
    /// `--load`.
    #[arg(long)]
    pub speed: Option<f64>,
    /// Without `--speed`, each trace is sped up so that its prefill work with no cache would
    /// keep the prefill instances busy this share of the time (1.5: half again what they can
    /// compute, so what the caches save decides whether the cluster keeps up).
    #[arg(long, default_value_t = 1.5)]
    pub load: f64,
    #[arg(long, default_value_t = SimConfig::DEFAULT.ttft_slo_ms)]
    pub ttft_slo_ms: f64,
    #[arg(long, default_value_t = SimConfig::DEFAULT.tbt_slo_ms)]
    pub tbt_slo_ms: f64,
    /// Each prefill instance's own prefix cache, in tokens.
    #[arg(long, default_value_t = SimConfig::DEFAULT.local_cache_tokens)]
    pub local_cache_tokens: u64,
    /// The shared pool's cache, in tokens.
    #[arg(long, default_value_t = SimConfig::DEFAULT.pool_cache_tokens)]
    pub pool_cache_tokens: u64,
    /// Seed of the random policy.
    #[arg(long, default_value_t = SimConfig::DEFAULT.seed)]
    pub seed: u64,
    /// Then replay each trace for real: through a master, a node and the conductor started
    /// in this process, each 512-token block a pool object of `--block-bytes` (see
    /// `--pool-bytes`, `--replay-requests`).
    #[arg(long)]
    pub replay: bool,
    /// `--replay`: bytes of one block's object (a real model's 512-token block is megabytes;
    /// scaled to this machine).
    #[arg(long, value_parser = super::report::parse_bytes, default_value = "64K")]
    pub block_bytes: u64,
    /// `--replay`: DRAM the node gives the pool.
    #[arg(long, value_parser = super::report::parse_bytes, default_value = "512M")]
    pub pool_bytes: u64,
    /// `--replay`: the trace's first requests replayed.
    #[arg(long, default_value_t = 3000)]
    pub replay_requests: usize,
}

/// `100000`, `1e5`, `500K`, `2M` (decimal units: tokens), `unbounded`.
fn parse_capacity(s: &str) -> Result<Capacity, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "unbounded" || t == "inf" {
        return Ok(Capacity::Unbounded);
    }
    let (num, mult) = match t.strip_suffix('k').or_else(|| t.strip_suffix('m')) {
        Some(n) if t.ends_with('k') => (n, 1e3),
        Some(n) => (n, 1e6),
        None => (t.as_str(), 1.0),
    };
    let v: f64 =
        num.parse().map_err(|_| format!("{s:?} is not a capacity (try 1e6, 2M, unbounded)"))?;
    let tokens = v * mult;
    if !tokens.is_finite() || tokens < 0.0 || tokens > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Capacity::Tokens(tokens as u64))
}

/// One trace's figures at one capacity.
struct Row {
    capacity: Capacity,
    lru: ReplayStats,
    kvfs: ReplayStats,
}

struct TraceResult {
    name: String,
    requests: usize,
    rows: Vec<Row>,
}

pub async fn run(a: TraceArgs) -> anyhow::Result<()> {
    let mut results = Vec::new();
    for path in &a.traces {
        let start = Instant::now();
        let trace = Trace::load(path).with_context(|| format!("loading {}", path.display()))?;
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let mut rows = Vec::new();
        let progress = std::io::stderr().is_terminal();
        let capacities = if a.simulate_only { &[][..] } else { &a.capacities[..] };
        for (i, &capacity) in capacities.iter().enumerate() {
            if progress {
                eprint!("\r{name}: capacity {}/{} ", i + 1, a.capacities.len());
            }
            let lru = replay(&trace.requests, Policy::Lru, capacity);
            let kvfs = if capacity == Capacity::Unbounded {
                lru
            } else {
                replay(&trace.requests, Policy::Kvfs, capacity)
            };
            rows.push(Row { capacity, lru, kvfs });
        }
        eprintln!(
            "{}{name}: {} requests, {} capacities replayed in {:.1} s",
            if progress { "\r" } else { "" },
            trace.requests.len(),
            a.capacities.len(),
            start.elapsed().as_secs_f64()
        );
        let result = TraceResult { name, requests: trace.requests.len(), rows };
        if !a.simulate_only {
            if a.json {
                print_json(&result);
            } else {
                print_table(&result);
            }
        }
        if !a.no_simulate {
            run_simulation(&a, &result.name, &trace);
        }
        if a.replay {
            let o = super::replay::ReplayOpts {
                block_bytes: a.block_bytes,
                pool_bytes: a.pool_bytes,
                requests: a.replay_requests,
                json: a.json,
            };
            super::replay::run(&result.name, &trace.requests, &o).await?;
        }
        results.push(result);
    }
    if let Some(png) = a.plot.as_ref().filter(|_| !a.simulate_only) {
        plot(png, &results).with_context(|| format!("drawing {}", png.display()))?;
        eprintln!("plot: {}", png.display());
    }
    Ok(())
}

/// One trace through the simulated cluster: every routing policy, with and without early
/// rejection.
fn run_simulation(a: &TraceArgs, name: &str, trace: &Trace) {
    let mut cfg = SimConfig {
        prefill_instances: a.prefill.max(1),
        decode_instances: a.decode.max(1),
        ttft_slo_ms: a.ttft_slo_ms,
        tbt_slo_ms: a.tbt_slo_ms,
        local_cache_tokens: a.local_cache_tokens,
        pool_cache_tokens: a.pool_cache_tokens,
        seed: a.seed,
        ..SimConfig::DEFAULT
    };
    cfg.speed = a.speed.unwrap_or_else(|| speed_for_load(&trace.requests, &cfg, a.load));
    let start = Instant::now();
    let rows: Vec<(RoutePolicy, bool, SimStats)> = RoutePolicy::ALL
        .into_iter()
        .flat_map(|p| [false, true].map(|er| (p, er)))
        .map(|(p, er)| (p, er, simulate(&trace.requests, p, er, &cfg)))
        .collect();
    eprintln!("{name}: simulated {} runs in {:.1} s", rows.len(), start.elapsed().as_secs_f64());
    if a.json {
        for (p, er, s) in &rows {
            println!(
                "{}",
                json!({
                    "bench": "trace-sim",
                    "case": name,
                    "policy": p.name(),
                    "early_rejection": er,
                    "prefill_instances": cfg.prefill_instances,
                    "decode_instances": cfg.decode_instances,
                    "speed": round5(cfg.speed),
                    "ttft_slo_ms": cfg.ttft_slo_ms,
                    "tbt_slo_ms": cfg.tbt_slo_ms,
                    "local_cache_tokens": cfg.local_cache_tokens,
                    "pool_cache_tokens": cfg.pool_cache_tokens,
                    "requests": s.requests,
                    "slo_attainment": round5(s.slo_attainment()),
                    "slo_met": s.slo_met,
                    "rejected": s.rejected,
                    "wasted_prefills": s.wasted_prefills,
                    "ttft_p50_ms": s.ttft_p50_ms.round(),
                    "ttft_p99_ms": s.ttft_p99_ms.round(),
                    "tbt_p50_ms": round5(s.tbt_p50_ms),
                    "tbt_p99_ms": round5(s.tbt_p99_ms),
                    "tbt_underpredicted": s.tbt_underpredicted,
                    "prefill_saved": round5(s.prefill_saved()),
                    "prefill_saved_gpu_s": ((s.prefill_uncached_ms - s.prefill_ms) / 1e3).round(),
                    "reused_tokens": s.reused_tokens,
                    "transfer_tokens": s.transfer_tokens,
                    "fetches": s.fetches,
                    "replicate_hints": s.replicate_hints,
                })
            );
        }
        return;
    }
    println!(
        "\n{name}: {} prefill + {} decode instances, speed x{:.3}, SLOs TTFT {} ms TBT {} ms, \
         caches {} tokens per prefill instance + {} in the pool",
        cfg.prefill_instances,
        cfg.decode_instances,
        cfg.speed,
        cfg.ttft_slo_ms,
        cfg.tbt_slo_ms,
        cfg.local_cache_tokens,
        cfg.pool_cache_tokens
    );
    println!(
        "{:>19} {:>6} {:>8} {:>8} {:>8} {:>6} {:>6} {:>7} {:>7} {:>7} {:>8}",
        "policy",
        "reject",
        "SLO met",
        "TTFT p50",
        "TTFT p99",
        "TBT50",
        "TBT99",
        "reject",
        "wasted",
        "saved",
        "fetches"
    );
    for (p, er, s) in &rows {
        println!(
            "{:>19} {:>6} {:>7.2}% {:>7.0}ms {:>7.0}ms {:>6.1} {:>6.1} {:>7} {:>7} {:>6.1}% {:>8}",
            p.name(),
            if *er { "early" } else { "none" },
            s.slo_attainment() * 100.0,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.tbt_p50_ms,
            s.tbt_p99_ms,
            s.rejected,
            s.wasted_prefills,
            s.prefill_saved() * 100.0,
            s.fetches
        );
    }
}

fn capacity_label(c: Capacity) -> String {
    match c {
        Capacity::Tokens(t) => format!("{t}"),
        Capacity::Unbounded => "unbounded".into(),
    }
}

fn print_table(r: &TraceResult) {
    println!("\n{} ({} requests)", r.name, r.requests);
    println!(
        "{:>12} {:>10} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "capacity", "blocks", "lru", "kvfs", "diff", "lru req", "kvfs req"
    );
    for row in &r.rows {
        let blocks = match row.capacity {
            Capacity::Tokens(_) => row.capacity.blocks().to_string(),
            Capacity::Unbounded => "-".into(),
        };
        let (l, k) = (row.lru.token_hit_rate(), row.kvfs.token_hit_rate());
        println!(
            "{:>12} {:>10} {:>8.2}% {:>8.2}% {:>+8.2}pp {:>10.2}% {:>10.2}%",
            capacity_label(row.capacity),
            blocks,
            l * 100.0,
            k * 100.0,
            (k - l) * 100.0,
            row.lru.request_hit_rate() * 100.0,
            row.kvfs.request_hit_rate() * 100.0,
        );
    }
}

fn print_json(r: &TraceResult) {
    for row in &r.rows {
        for (policy, s) in [("lru", &row.lru), ("kvfs", &row.kvfs)] {
            let capacity_tokens = match row.capacity {
                Capacity::Tokens(t) => Some(t),
                Capacity::Unbounded => None,
            };
            println!(
                "{}",
                json!({
                    "bench": "trace",
                    "case": r.name,
                    "policy": policy,
                    "capacity_tokens": capacity_tokens,
                    "unbounded": row.capacity == Capacity::Unbounded,
                    "token_hit_rate": round5(s.token_hit_rate()),
                    "request_hit_rate": round5(s.request_hit_rate()),
                    "hit_tokens": s.hit_tokens,
                    "input_tokens": s.input_tokens,
                    "requests": s.requests,
                    "hit_requests": s.hit_requests,
                    "evictions": s.evictions,
                    "vs_lru": round5(s.token_hit_rate() - row.lru.token_hit_rate()),
                })
            );
        }
    }
}

fn round5(v: f64) -> f64 {
    (v * 1e5).round() / 1e5
}

/// Registers a TrueType font for plotters' ab_glyph text, if one can be found.
fn register_font() -> bool {
    let mut candidates: Vec<PathBuf> =
        std::env::var_os("KVFS_PLOT_FONT").map(PathBuf::from).into_iter().collect();
    candidates.extend(
        [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        ]
        .map(PathBuf::from),
    );
    for p in candidates {
        let Ok(bytes) = std::fs::read(&p) else { continue };
        // plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
            .is_ok()
        {
            return true;
        }
    }
    false
}

fn plot(png: &Path, results: &[TraceResult]) -> anyhow::Result<()> {
    use plotters::prelude::*;

    let has_text = register_font();
    if !has_text {
        eprintln!("note: no TrueType font found (set KVFS_PLOT_FONT): plot drawn without text");
    }
    // Bounded capacities only: unbounded has no place on a log axis (it is in the tables).
    let points = |r: &TraceResult, kvfs: bool| -> Vec<(f64, f64)> {
        r.rows
            .iter()
            .filter_map(|row| match row.capacity {
                Capacity::Tokens(t) if t > 0 => {
                    let s = if kvfs { &row.kvfs } else { &row.lru };
                    Some((t as f64, s.token_hit_rate() * 100.0))
                }
                _ => None,
            })
            .collect()
    };
    let xs: Vec<f64> = results.iter().flat_map(|r| points(r, false)).map(|(x, _)| x).collect();
    anyhow::ensure!(!xs.is_empty(), "no bounded capacity to plot");
    let x_min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let x_max = xs.iter().copied().fold(0.0, f64::max).max(x_min * 10.0);
    // The unbounded ceiling of each trace, when it was replayed.
    let ceiling = |r: &TraceResult| {
        r.rows
            .iter()
            .find(|row| row.capacity == Capacity::Unbounded)
            .map(|row| row.lru.token_hit_rate() * 100.0)
    };
    let y_max = results
        .iter()
        .flat_map(|r| points(r, false).into_iter().chain(points(r, true)))
        .map(|(_, y)| y)
        .chain(results.iter().filter_map(ceiling))
        .fold(0.0, f64::max);
    let y_max = ((y_max / 10.0).ceil() * 10.0).clamp(10.0, 100.0);

    let root = BitMapBackend::new(png, (1000, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if has_text {
        builder
            .caption("Prefix-cache token hit rate vs capacity", ("sans-serif", 24))
            .x_label_area_size(50)
            .y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d((x_min..x_max).log_scale(), 0.0..y_max)?;
    let mut mesh = chart.configure_mesh();
    if has_text {
        mesh.x_desc("capacity (tokens, log scale)")
            .y_desc("token hit rate (%)")
            .x_label_formatter(&|x| format!("{x:.0e}"));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;

    let colours = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, r) in results.iter().enumerate() {
        let colour = colours[i % colours.len()];
        if let Some(c) = ceiling(r) {
            let style = colour.mix(0.6).stroke_width(1);
            let series =
                chart.draw_series(DashedLineSeries::new([(x_min, c), (x_max, c)], 2, 6, style))?;
            if has_text {
                series
                    .label(format!("{} ceiling (unbounded)", r.name))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            }
        }
        for kvfs in [false, true] {
            let style = if kvfs { colour.stroke_width(3) } else { colour.stroke_width(2) };
            let label = format!("{} {}", r.name, if kvfs { "kvfs" } else { "lru" });
            let pts = points(r, kvfs);
            let series = if kvfs {
                chart.draw_series(LineSeries::new(pts.clone(), style))?
            } else {
                chart.draw_series(DashedLineSeries::new(pts.clone(), 10, 6, style))?
            };
            if has_text {
                // The legend draws each curve's own line and marks: lru's dashes and crosses,
                // kvfs's line and dots (a plain line for both told them apart by width only).
                let series = series.label(label);
                if kvfs {
                    series.legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (20, 0)], style)
                            + Circle::new((10, 0), 4, colour.filled())
                    });
                } else {
                    series.legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (6, 0)], style)
                            + PathElement::new(vec![(14, 0), (20, 0)], style)
                            + Cross::new((10, 0), 4, colour)
                    });
                }
            }
            if kvfs {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
            } else {
                chart.draw_series(pts.iter().map(|&p| Cross::new(p, 4, colour)))?;
            }
        }
    }
    if has_text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse() {
        assert_eq!(parse_capacity("1e5"), Ok(Capacity::Tokens(100_000)));
        assert_eq!(parse_capacity("2M"), Ok(Capacity::Tokens(2_000_000)));
        assert_eq!(parse_capacity("500k"), Ok(Capacity::Tokens(500_000)));
        assert_eq!(parse_capacity("4096"), Ok(Capacity::Tokens(4096)));
        assert_eq!(parse_capacity("unbounded"), Ok(Capacity::Unbounded));
        assert!(parse_capacity("lots").is_err());
        assert!(parse_capacity("-1").is_err());
    }
}
