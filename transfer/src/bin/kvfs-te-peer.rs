//! `kvfs-te-peer`: a bare Transfer Engine in its own process, driven over stdin and stdout.
//!
//! It allocates one shareable buffer, prints `READY <segment> <buffer addr> <buffer len>` and
//! then answers one command per line:
//! - `fill SEED` fills the buffer with the deterministic test pattern of SEED, answers `OK`;
//! - `hash OFFSET LEN` answers the blake3 hex digest of that range of the buffer;
//! - `notes` answers `NOTES n msg1,msg2,...` with the notifications received so far (utf-8);
//! - `seqlock LEN PAUSE_US` starts a writer thread that rewrites the buffer as a seqlock, over
//!   and over, PAUSE_US apart: the 8-byte epoch at offset 0 goes odd, the LEN bytes from offset
//!   64 are filled with the epoch's half as little-endian u64 words, the epoch goes even;
//!   answers `OK`. `seqlock-stop` stops it and answers `OK <writes>`;
//! - `reregister` unregisters the buffer and registers it again (same address; with rdma, a new
//!   memory region and rkey, so peers holding the old one fail and must refresh), answers `OK`;
//! - `quit` (or end of input) exits.
//!
//! The two-process tests of kvfs-transfer use it as the peer; it is also a quick way to check
//! that two machines' engines can talk (`kvfs-te-peer --listen 0.0.0.0:7000`). Built with the
//! `rdma` feature it serves rdma too (`--no-shm` makes a same-host peer use it; `--no-rdma`
//! turns it off; `--rdma-device`, `--rdma-gid-index` pick the port).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvfs_transfer::{BufferOptions, Engine, EngineConfig, Transports};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const USAGE: &str = "usage: kvfs-te-peer [--listen ADDR] [--buffer-bytes N] [--tcp-only] \
     [--no-shm] [--no-rdma] [--rdma-device NAME] [--rdma-gid-index N] [--timeout-ms N]";

fn parse() -> Result<(EngineConfig, usize), String> {
    let mut cfg = EngineConfig::default();
    let mut buffer_bytes = 64 << 20;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().ok_or(format!("{name} needs a value\n{USAGE}"));
        match a.as_str() {
            "--listen" => {
                cfg.listen = val("--listen")?.parse::<SocketAddr>().map_err(|e| e.to_string())?
            }
            "--buffer-bytes" => {
                buffer_bytes = val("--buffer-bytes")?.parse().map_err(|e| format!("{e}"))?
            }
            "--timeout-ms" => {
                cfg.op_timeout_ms = val("--timeout-ms")?.parse().map_err(|e| format!("{e}"))?
            }
            "--tcp-only" => cfg.transports = Transports::tcp_only(),
            "--no-shm" => cfg.transports.shm = false,
            "--no-rdma" => cfg.transports.rdma = false,
            "--rdma-device" => cfg.rdma_device = Some(val("--rdma-device")?),
            "--rdma-gid-index" => {
                cfg.rdma_gid_index =
                    Some(val("--rdma-gid-index")?.parse().map_err(|e| format!("{e}"))?)
            }
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok((cfg, buffer_bytes))
}

#[tokio::main]
async fn main() {
    let (cfg, buffer_bytes) = match parse() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let engine = match Engine::start(cfg).await {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvfs-te-peer: {e}");
            std::process::exit(1);
        }
    };
    let opts = BufferOptions { populate: true, ..BufferOptions::default() };
    let buf = match engine.alloc_buffer(buffer_bytes, &opts) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kvfs-te-peer: {e}");
            std::process::exit(1);
        }
    };
    let mut out = tokio::io::stdout();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut notes: Vec<String> = Vec::new();
    let mut writer: Option<(Arc<AtomicBool>, std::thread::JoinHandle<u64>)> = None;
    let ready = format!("READY {} {} {}\n", engine.name(), buf.addr(), buf.len());
    let _ = out.write_all(ready.as_bytes()).await;
    let _ = out.flush().await;
    while let Ok(Some(line)) = lines.next_line().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["fill", seed] => match seed.parse::<u64>() {
                // SAFETY: no transfer touches the buffer while the test asks for a fill.
                Ok(seed) => {
                    kvfs_transfer::testing::fill_pattern(unsafe { buf.as_mut_slice() }, seed, 0);
                    "OK".to_string()
                }
                Err(e) => format!("ERR {e}"),
            },
            ["hash", off, len] => match (off.parse::<usize>(), len.parse::<usize>()) {
                (Ok(off), Ok(len)) if off.checked_add(len).is_some_and(|e| e <= buf.len()) => {
                    let mut v = vec![0u8; len];
                    let _ = buf.read_at(off, &mut v);
                    blake3::hash(&v).to_hex().to_string()
                }
                _ => "ERR bad range".to_string(),
            },
            ["notes"] => {
                while let Some(n) = engine.try_recv_notification() {
                    notes.push(String::from_utf8_lossy(&n.msg).into_owned());
                }
                format!("NOTES {} {}", notes.len(), notes.join(","))
            }
            ["reregister"] => {
                match engine
                    .unregister(buf.addr())
                    .and_then(|_| engine.register_buffer(buf.clone(), true))
                {
                    Ok(()) => "OK".to_string(),
                    Err(e) => format!("ERR {e}"),
                }
            }
            ["seqlock", len, pause] => match (len.parse::<usize>(), pause.parse::<u64>()) {
                (Ok(len), Ok(pause))
                    if writer.is_none() && len % 8 == 0 && 64 + len <= buf.len() =>
                {
                    let stop = Arc::new(AtomicBool::new(false));
                    let (b, st) = (buf.clone(), stop.clone());
                    let h = std::thread::spawn(move || seqlock_writer(&b, len, pause, &st));
                    writer = Some((stop, h));
                    "OK".to_string()
                }
                _ => "ERR bad seqlock arguments, or one running".to_string(),
            },
            ["seqlock-stop"] => match writer.take() {
                Some((stop, h)) => {
                    stop.store(true, Ordering::Relaxed);
                    format!("OK {}", h.join().unwrap_or(0))
                }
                None => "ERR no seqlock writer".to_string(),
            },
            ["quit"] => break,
            _ => format!("ERR unknown command: {line}"),
        };
        let _ = out.write_all(format!("{reply}\n").as_bytes()).await;
        let _ = out.flush().await;
    }
}

/// The `seqlock` command's writer: returns how many writes it completed.
fn seqlock_writer(
    buf: &kvfs_transfer::Buffer,
    len: usize,
    pause_us: u64,
    stop: &AtomicBool,
) -> u64 {
    let mut epoch = 0u64;
    let mut data = vec![0u8; len];
    while !stop.load(Ordering::Relaxed) {
        epoch += 1;
        let _ = buf.write_at(0, &epoch.to_le_bytes());
        // The odd epoch lands before the data, the data before the even epoch.
        std::sync::atomic::fence(Ordering::SeqCst);
        for w in data.chunks_exact_mut(8) {
            w.copy_from_slice(&(epoch / 2 + 1).to_le_bytes());
        }
        let _ = buf.write_at(64, &data);
        std::sync::atomic::fence(Ordering::SeqCst);
        epoch += 1;
        let _ = buf.write_at(0, &epoch.to_le_bytes());
        std::thread::sleep(std::time::Duration::from_micros(pause_us));
    }
    epoch / 2
}
