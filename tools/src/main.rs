//! `kvfs`: the one command line of kvfs. It parses arguments and wires the libraries together;
//! the work happens in the crates.

mod bench;

use clap::{Args, Parser, Subcommand};
use kvfs_transfer::TransportKind;

use bench::report::parse_bytes;

#[derive(Parser)]
#[command(
    name = "kvfs",
    version,
    about = "kvfs: a tiered, distributed KV-cache store for LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure kvfs against the machine's own limits (memcpy, loopback TCP, raw disk).
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Transfer Engine reads and writes between two processes, per transport and block size.
    ///
    /// Starts a peer process, measures single-thread memcpy of 1 GiB and raw loopback TCP with
    /// plain sockets, then GB/s and p50/p99 for one request at a time (qd1) and for batches,
    /// each as a ratio of its limit (tcp against raw TCP, shm against memcpy).
    Transfer(TransferArgs),
    /// (internal) The peer process of `kvfs bench transfer`.
    #[command(hide = true)]
    TransferPeer {
        #[arg(long, default_value_t = 64 << 20)]
        buffer_bytes: usize,
    },
}

#[derive(Args)]
struct TransferArgs {
    /// Block sizes to measure (comma separated; K/M/G are binary units).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M,64M", value_parser = parse_bytes)]
    sizes: Vec<u64>,
    /// Transports to measure: tcp, shm.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm", value_parser = parse_transport)]
    transports: Vec<TransportKind>,
    /// Minimum time per case, in milliseconds.
    #[arg(long, default_value_t = 400)]
    min_ms: u64,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 4)]
    conns: usize,
    /// TCP slice size: larger requests are striped across connections in slices of this size.
    #[arg(long, default_value = "1M", value_parser = parse_bytes)]
    slice: u64,
    /// Bytes moved when measuring the limits (memcpy, raw TCP).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    limit_bytes: u64,
}

fn parse_transport(s: &str) -> Result<TransportKind, String> {
    match s {
        "tcp" => Ok(TransportKind::Tcp),
        "shm" => Ok(TransportKind::Shm),
        other => Err(format!("unknown transport {other:?} (tcp, shm)")),
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Bench(BenchCmd::Transfer(a)) => {
                bench::transfer::run(bench::transfer::TransferBench {
                    sizes: a.sizes,
                    transports: a.transports,
                    min_ms: a.min_ms,
                    json: a.json,
                    conns_per_peer: a.conns,
                    slice_bytes: a.slice,
                    limit_bytes: a.limit_bytes as usize,
                })
                .await
            }
            Cmd::Bench(BenchCmd::TransferPeer { buffer_bytes }) => {
                bench::transfer::serve_peer(buffer_bytes).await
            }
        }
    })
}
