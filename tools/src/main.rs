//! `kvfs`: the one command line of kvfs. It parses arguments and wires the libraries together;
//! the work happens in the crates.

mod bench;
mod cmd;

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
    /// Master address for the commands that talk to a cluster.
    #[arg(long, global = true, env = "KVFS_MASTER", default_value = "127.0.0.1:50051")]
    master: String,
    /// The cluster secret: a file of at least 16 bytes that every master, node, client and
    /// mount of the cluster is given. Each connection (control RPC, Transfer Engine tcp and
    /// shm) proves it at its handshake, and one that does not is refused before it can read,
    /// write or register memory. Without it, nothing is asked or proven.
    #[arg(long, global = true, env = "KVFS_CLUSTER_SECRET_FILE", value_name = "FILE")]
    cluster_secret_file: Option<std::path::PathBuf>,
    /// The tenant the object commands and the mount work for: keys live under
    /// tenants/TENANT/ (the mount shows only those), and the master holds them to the
    /// tenant's quota (`kvfs master --tenant-quota`). Without it, the whole key space.
    #[arg(long, global = true, env = "KVFS_TENANT", value_name = "TENANT")]
    tenant: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a whole cluster on this machine: master and one node (prints the master address).
    Up(Box<cmd::cluster::UpArgs>),
    /// Run the master: object directory, placement, leases, eviction (never on the data path).
    ///
    /// Also takes the reference (Mooncake) master's flags, gflags style (`--rpc_port=50051`,
    /// `--default_kv_lease_ttl 5s`, `--config_path master.yaml`); invoked as `mooncake_master`
    /// (a symlink) it is this command.
    #[command(args_override_self = true)]
    Master(Box<cmd::cluster::MasterCmdArgs>),
    /// Run a node: contribute DRAM (and an NVMe tier) to the pool and serve transfers.
    Node(cmd::cluster::NodeCmdArgs),
    /// Serve the pool as files at a mount point (FUSE), with the ioctl fast path in /.kvfs/.
    Mount(cmd::mount::MountCmd),
    /// Store a file as an object.
    Put(cmd::objects::PutArgs),
    /// Read an object into a file.
    Get(cmd::objects::GetArgs),
    /// List keys.
    Ls(cmd::objects::LsArgs),
    /// Show an object's size, checksum, replicas and lease, or cluster figures.
    Stat(cmd::objects::StatArgs),
    /// Remove objects.
    Rm(cmd::objects::RmArgs),
    /// Rename an object (a metadata operation: the bytes stay where they are).
    Mv(cmd::objects::MvArgs),
    /// Persist every object under a prefix to the object store, as a job the master owns
    /// (`--move`: then free their pool memory).
    ///
    /// The master runs the job with bounded concurrency and rate; it goes on if this command
    /// is interrupted (`kvfs jobs wait ID` follows it again) and resumes after a master
    /// restart. Objects written after the job started are not in it. Prints a progress bar
    /// (objects, bytes, rate, ETA) and a report; exits 1 unless every object was handled.
    Offload(cmd::jobs::OffloadArgs),
    /// Warm the pool: load every object under a prefix that only NVMe or the object store
    /// holds back into DRAM, as a job the master owns (like `offload`).
    Restore(cmd::jobs::RestoreArgs),
    /// Offload and restore jobs: list (default), show, wait, cancel.
    Jobs {
        #[command(subcommand)]
        cmd: Option<cmd::jobs::JobsCmd>,
    },
    /// Measure kvfs against the machine's own limits (memcpy, loopback TCP, raw disk).
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Process groups (collectives on the Transfer Engine).
    #[command(subcommand)]
    Pg(PgCmd),
    /// Model weights between parallel layouts (TP/PP/EP/DP): plan, store once, load any.
    #[command(subcommand)]
    Reshard(cmd::reshard::ReshardCmd),
    /// A remote NVMe namespace over NVMe/TCP, attached (connected, its ext4 file system
    /// mounted) or detached by the code a node's --nvmeof tier uses.
    #[command(subcommand)]
    Nvmeof(cmd::nvmeof::NvmeofCmd),
    /// The prefix-cache index fed by the engines' KV events (vLLM, SGLang) and the pool, with
    /// the reference conductor's HTTP API.
    Conductor(cmd::conductor::ConductorArgs),
}

#[derive(Subcommand)]
enum PgCmd {
    /// Run a group's coordinator in its own process (prints the address members join).
    Coordinator(cmd::pg::CoordinatorArgs),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Transfer Engine reads and writes between two processes, per transport and block size.
    ///
    /// Starts a peer process, measures single-thread memcpy of 1 GiB and raw loopback TCP with
    /// plain sockets, then GB/s and p50/p99 for one request at a time (qd1) and for batches,
    /// each as a ratio of its limit (tcp against raw TCP, shm against memcpy).
    Transfer(TransferArgs),
    /// The store's client calls against a node in another process, over tcp and on one host.
    ///
    /// Starts a peer process with a master and a node, then measures put/get (bytes API),
    /// put_from/get_into (zero-copy) one at a time and in batches, per object size, plus exists
    /// and remove rates; each figure as a ratio of raw loopback TCP (tcp mode) or memcpy (shm
    /// mode) measured right before it.
    Store(StoreArgs),
    /// The NVMe tier against raw O_DIRECT on the same disk, object-store write-back, and the
    /// latency of gets that promote an object from NVMe into memory.
    ///
    /// Measures raw O_DIRECT writes and reads with the NVMe tier's ring shape, then the tier's
    /// put and get of the same objects (rounds interleaved), blake3's own cost, lazy
    /// write-back throughput against direct puts to the same object store, and p50/p99 of a
    /// get that finds its object only on NVMe (in a master and node started in this process)
    /// against raw reads of the same size.
    Tiers(TiersArgs),
    /// GPU memory (HBM) as kvfs moves it, against raw pinned cuMemcpy in the same run.
    ///
    /// Per size: raw synchronous host <-> device copies of page-locked memory (the limit), the
    /// HBM medium's put and get from pinned and from pageable memory, and the Transfer Engine
    /// reaching an HBM segment (a peer over loopback tcp, against raw loopback TCP; the
    /// owner's own copies, against the raw copies). Exits with status 2 where no CUDA driver
    /// is found.
    Hbm(bench::hbm::HbmArgs),
    /// Reads through the mount: FUSE cold and warm, the ioctl fast path from Rust and from
    /// Python, and memcpy.
    ///
    /// Runs master, node and mount in this process (needs root and /dev/fuse), puts one object
    /// per size, and prints GB/s and p50/p99 per mode, each as a ratio of single-thread memcpy
    /// measured in the same run; the fast paths also as a ratio of the FUSE cold read, and the
    /// Python one (`kvfs.fastpath` in a child process of `--python`) as a ratio of the Rust one.
    Fs(FsArgs),
    /// Collectives of kvfs-pg against torch's gloo, same process layout, same run.
    ///
    /// Runs allreduce, allgather, alltoall and broadcast through torch.distributed with the
    /// `kvfs` and `gloo` backends in N spawned processes each, and prints p50/p99, algbw and
    /// busbw (nccl-tests definitions), each as a ratio of raw loopback TCP and memcpy measured
    /// in the same run, and kvfs against gloo. Needs an interpreter with torch and kvfs.
    Pg(PgBenchArgs),
    /// MoE dispatch and combine of kvfs-ep against the all-gather fallback, same run.
    ///
    /// N spawned processes route T bfloat16 tokens (H 4096) each to top-4 of 32 experts,
    /// scale them per expert and combine them back, once with kvfs-ep and once the way the
    /// reference does without a device fast path (all-gather every token, all-reduce the
    /// result), and print the step's p50/p99 and the bytes each rank sent for both.
    Ep(EpBenchArgs),
    /// Weights moved between processes by kvfs-reshard, and the planner on a large model.
    ///
    /// Runs one process per participant (sources first, targets after, so every byte crosses
    /// processes) resharding one f32 matrix per size, tp1->tp1 and tp2->tp4, over shm and
    /// tcp: GB/s from the p50 of the slowest target's execution, as a ratio of memcpy (shm) or
    /// raw loopback TCP (tcp) measured in the same run; then the time to plan 1,000 tensors
    /// from 64 ranks to 64 others.
    Reshard(ReshardBenchArgs),
    /// Hit rate of a simulated prefix cache against its capacity, replaying request traces.
    ///
    /// Replays each trace (JSON lines of `timestamp`, `input_length`, `output_length` and
    /// prefix-chained 512-token block `hash_ids`, as the FAST'25 Mooncake traces) in timestamp
    /// order through a cache of each capacity, for plain LRU and for kvfs's policy (leaf-first
    /// eviction, LRFU ranks and an admission filter switched by set dueling; see
    /// `kvfs_conductor::trace`), and prints the token hit rate of both and their difference per
    /// capacity; `unbounded` is the trace's ceiling. `--plot` draws the curves.
    Trace(bench::trace::TraceArgs),
    /// Prefix-query latency of the conductor: its index walk and its HTTP API (`/query_by_hash`
    /// and `/query` with tokens, each in JSON and in msgpack; token queries cold, learned from
    /// events and warm) with many instances x DP ranks and a long prompt (default 1,000 x 8 and
    /// 128k tokens, block sizes 16 and 512), p50 and p99, and the floor under them: the same
    /// bytes over a raw loopback TCP round trip.
    Conductor(bench::conductor::ConductorBenchArgs),
    /// The leader master SIGKILLed under load (HA through etcd): a throwaway etcd, two masters
    /// and nodes as processes, a directory of 1 M objects by default; reports when the new
    /// leader was elected, the first get and put after the kill, call latency across the
    /// failover, and objects lost (must be 0).
    Failover(bench::failover::FailoverArgs),
    /// (internal) One participant of `kvfs bench reshard` (see `kvfs_reshard::rank`).
    #[command(hide = true)]
    ReshardRank {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// (internal) The peer process of `kvfs bench store`.
    #[command(hide = true)]
    StorePeer {
        #[arg(long, default_value_t = 2 << 30)]
        dram: u64,
    },
    /// (internal) Raw loopback TCP limits on demand, for a bench in another language
    /// (`python/bench/bench_side_by_side.py`): reads `send|receive BYTES COUNT` lines and
    /// answers `TIMES` and COUNT durations in seconds, each the faster of one plain stream and
    /// `--streams` streams moving BYTES to or from the raw server at `--addr` (a `kvfs bench
    /// store-peer`'s).
    #[command(hide = true)]
    RawTcp {
        #[arg(long)]
        addr: std::net::SocketAddr,
        #[arg(long, default_value_t = 4)]
        streams: usize,
    },
    /// (internal) The peer process of `kvfs bench transfer`.
    #[command(hide = true)]
    TransferPeer {
        #[arg(long, default_value_t = 64 << 20)]
        buffer_bytes: usize,
    },
}

#[derive(Args)]
struct PgBenchArgs {
    /// Python interpreter with torch, numpy and the kvfs package.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Process counts (comma separated).
    #[arg(long, default_value = "2,4,8")]
    procs: String,
    /// Message sizes (K/M/G binary units).
    #[arg(long, default_value = "4K,64K,1M,16M,64M,256M")]
    sizes: String,
    /// Collectives to run.
    #[arg(long, default_value = "allreduce,allgather,alltoall,broadcast")]
    ops: String,
    /// Backends to compare.
    #[arg(long, default_value = "kvfs,gloo")]
    backends: String,
}

#[derive(Args)]
struct EpBenchArgs {
    /// Python interpreter with numpy and the kvfs package.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Process counts (comma separated; each must divide the 32 experts).
    #[arg(long, default_value = "2,4,8")]
    procs: String,
    /// Tokens per rank (comma separated).
    #[arg(long, default_value = "128,512")]
    tokens: String,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 30)]
    iters: u32,
}

#[derive(Args)]
struct ReshardBenchArgs {
    /// Matrix sizes (comma separated; whole MiB).
    #[arg(long, value_delimiter = ',', default_value = "16M,64M,256M", value_parser = parse_bytes)]
    sizes: Vec<u64>,
    /// Transports: shm (same host), tcp (loopback sockets).
    #[arg(long, value_delimiter = ',', default_value = "shm,tcp")]
    transports: Vec<String>,
    /// Timed executions per case (the first one included: it is the cold one a one-shot
    /// reshard meets). Executions spread widely on a shared host (a 64 MiB one's p99 about 1.5x
    /// its p50): over 30, tp1->tp1 64 MiB's p50 ranged over 0.74-1.09 of the limit across
    /// runs; over 100, 0.86-1.01.
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
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

#[derive(Args)]
struct TiersArgs {
    /// A directory on the disk to measure (O_DIRECT: not tmpfs); a work directory is made
    /// inside and removed after.
    #[arg(long, default_value = "/var/tmp/kvfs-bench")]
    dir: std::path::PathBuf,
    /// The block device --dir is on (e.g. an NVMe-oF namespace, /dev/nvme0n1): also read the
    /// raw file's own blocks straight from it, O_DIRECT, as a second read limit.
    #[arg(long, value_name = "DEV")]
    raw_device: Option<std::path::PathBuf>,
    /// Object size of the NVMe tier vs raw O_DIRECT case.
    #[arg(long, default_value = "64M", value_parser = parse_bytes)]
    object_size: u64,
    /// Objects per round of that case.
    #[arg(long, default_value_t = 8)]
    objects: usize,
    /// Interleaved rounds (raw, tier, raw, tier...).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// io_uring queue depth (I/Os in flight per object).
    #[arg(long, default_value_t = 8)]
    queue_depth: usize,
    /// io_uring chunk size (bytes per I/O).
    #[arg(long, default_value = "1M", value_parser = parse_bytes)]
    chunk: u64,
    /// Objects written back through the lazy queue.
    #[arg(long, default_value_t = 32)]
    writeback_objects: usize,
    #[arg(long, default_value = "4M", value_parser = parse_bytes)]
    writeback_size: u64,
    /// Object size of the promotion case.
    #[arg(long, default_value = "4M", value_parser = parse_bytes)]
    promote_size: u64,
    /// Gets that promote (one per object).
    #[arg(long, default_value_t = 32)]
    promotes: usize,
    #[command(flatten)]
    store: cmd::cluster::ObjectStoreArgs,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct FsArgs {
    /// Object sizes to measure (comma separated; K/M/G are binary units).
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M", value_parser = parse_bytes)]
    sizes: Vec<u64>,
    /// Minimum time per mode and size, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    min_ms: u64,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
    /// Bytes copied when measuring the memcpy limit.
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    limit_bytes: u64,
    /// Python interpreter with the kvfs package, for the fastpath-python figure (skipped with
    /// a note when it cannot import kvfs.fastpath).
    #[arg(long, env = "KVFS_PYTHON", default_value = "python3")]
    python: String,
}

#[derive(Args)]
struct StoreArgs {
    /// Object sizes to measure (comma separated; K/M/G are binary units).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M,64M", value_parser = parse_bytes)]
    sizes: Vec<u64>,
    /// Modes: tcp (bytes cross loopback sockets), shm (same host, shared memory).
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    modes: Vec<String>,
    /// Minimum time per case, in milliseconds.
    #[arg(long, default_value_t = 300)]
    min_ms: u64,
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
    /// DRAM of the node holding the data.
    #[arg(long, default_value = "2G", value_parser = parse_bytes)]
    node_dram: u64,
    /// Bytes moved when measuring each limit.
    #[arg(long, default_value = "512M", value_parser = parse_bytes)]
    limit_bytes: u64,
    /// Calls to measure (comma separated; default all): put, get, put_from, get_into, their
    /// `_batch` forms, exists, exists_batch, remove_batch.
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
}

fn parse_transport(s: &str) -> Result<TransportKind, String> {
    match s {
        "tcp" => Ok(TransportKind::Tcp),
        "shm" => Ok(TransportKind::Shm),
        other => Err(format!("unknown transport {other:?} (tcp, shm)")),
    }
}

fn main() {
    if let Err(e) = run() {
        // The chain of causes, without a backtrace: these are user-facing errors.
        eprintln!("kvfs: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Served connections hold two descriptors each: room for many peers where the hard limit
    // allows it.
    if kvfs_transfer::raise_open_files_limit().is_none() {
        tracing::debug!("the open files limit could not be read");
    }
    let cli = Cli::parse_from(cmd::mooncake_flags::translate(std::env::args_os().collect())?);
    if let Cmd::Bench(BenchCmd::ReshardRank { args }) = &cli.cmd {
        // It runs its own runtime (two workers, as the test ranks do).
        std::process::exit(kvfs_reshard::rank::main(args));
    }
    if let Cmd::Bench(BenchCmd::Conductor(a)) = cli.cmd {
        // Its own runtime per case, with the client on this thread.
        return bench::conductor::run(a);
    }
    if let Cmd::Bench(BenchCmd::RawTcp { addr, streams }) = cli.cmd {
        // Plain blocking sockets and threads: no runtime.
        return bench::limits::serve_raw_tcp_times(addr, streams);
    }
    cmd::set_tenant(cli.tenant.clone());
    if let Some(path) = &cli.cluster_secret_file {
        cmd::set_cluster_secret(
            kvfs_transfer::ClusterSecret::from_file(path).map_err(anyhow::Error::msg)?,
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let master = cli.master;
        match cli.cmd {
            Cmd::Up(a) => cmd::cluster::up(*a).await,
            Cmd::Master(a) => cmd::cluster::master(*a).await,
            Cmd::Mount(a) => cmd::mount::mount(&master, a).await,
            Cmd::Node(a) => cmd::cluster::node(&master, a).await,
            Cmd::Put(a) => cmd::objects::put(&master, a).await,
            Cmd::Get(a) => cmd::objects::get(&master, a).await,
            Cmd::Ls(a) => cmd::objects::ls(&master, a).await,
            Cmd::Stat(a) => cmd::objects::stat(&master, a).await,
            Cmd::Rm(a) => cmd::objects::rm(&master, a).await,
            Cmd::Mv(a) => cmd::objects::mv(&master, a).await,
            Cmd::Offload(a) => cmd::jobs::offload(&master, a).await,
            Cmd::Restore(a) => cmd::jobs::restore(&master, a).await,
            Cmd::Jobs { cmd } => cmd::jobs::jobs(&master, cmd).await,
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
            Cmd::Bench(BenchCmd::Store(a)) => {
                bench::store::run(bench::store::StoreBench {
                    sizes: a.sizes,
                    modes: a.modes,
                    min_ms: a.min_ms,
                    json: a.json,
                    node_dram: a.node_dram,
                    limit_bytes: a.limit_bytes as usize,
                    ops: a.ops,
                })
                .await
            }
            Cmd::Pg(PgCmd::Coordinator(a)) => cmd::pg::coordinator(a).await,
            Cmd::Nvmeof(c) => cmd::nvmeof::run(c).await,
            Cmd::Reshard(c) => cmd::reshard::run(&master, c).await,
            Cmd::Conductor(a) => {
                let given = std::env::args().any(|x| x.starts_with("--listen"))
                    || std::env::var_os("KVFS_CONDUCTOR_LISTEN").is_some();
                cmd::conductor::run(a, given).await
            }
            Cmd::Bench(BenchCmd::Pg(a)) => bench::pg::run(bench::pg::PgBench {
                python: a.python,
                procs: a.procs,
                sizes: a.sizes,
                ops: a.ops,
                backends: a.backends,
            }),
            Cmd::Bench(BenchCmd::Ep(a)) => bench::ep::run(bench::ep::EpBench {
                python: a.python,
                procs: a.procs,
                tokens: a.tokens,
                iters: a.iters,
            }),
            Cmd::Bench(BenchCmd::Reshard(a)) => {
                bench::reshard::run(bench::reshard::ReshardBench {
                    sizes: a.sizes,
                    transports: a.transports,
                    iters: a.iters,
                    json: a.json,
                })
                .await
            }
            Cmd::Bench(BenchCmd::Trace(a)) => bench::trace::run(a).await,
            Cmd::Bench(BenchCmd::Hbm(a)) => bench::hbm::run(a).await,
            Cmd::Bench(BenchCmd::Failover(a)) => bench::failover::run(a).await,
            Cmd::Bench(BenchCmd::Conductor(_)) => unreachable!("handled before the runtime"),
            Cmd::Bench(BenchCmd::ReshardRank { .. }) => {
                unreachable!("run before the runtime starts")
            }
            Cmd::Bench(BenchCmd::StorePeer { dram }) => bench::store::serve_peer(dram).await,
            Cmd::Bench(BenchCmd::Tiers(a)) => {
                bench::tiers::run(bench::tiers::TiersBench {
                    object_store: a.store.config(None)?,
                    dir: a.dir,
                    raw_device: a.raw_device,
                    object_bytes: a.object_size as usize,
                    objects: a.objects,
                    rounds: a.rounds,
                    queue_depth: a.queue_depth,
                    chunk_bytes: a.chunk as usize,
                    writeback_objects: a.writeback_objects,
                    writeback_bytes: a.writeback_size as usize,
                    promote_bytes: a.promote_size as usize,
                    promotes: a.promotes,
                    json: a.json,
                })
                .await
            }
            Cmd::Bench(BenchCmd::Fs(a)) => {
                bench::fs::run(bench::fs::FsBench {
                    sizes: a.sizes,
                    min_ms: a.min_ms,
                    json: a.json,
                    limit_bytes: a.limit_bytes as usize,
                    python: a.python,
                })
                .await
            }
            Cmd::Bench(BenchCmd::RawTcp { .. }) => unreachable!("handled before the runtime"),
            Cmd::Bench(BenchCmd::TransferPeer { buffer_bytes }) => {
                bench::transfer::serve_peer(buffer_bytes).await
            }
        }
    })
}
