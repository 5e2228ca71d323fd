//! The cluster secret: engines that hold it move bytes over tcp and shm as before; an engine
//! without it, or with another one, is refused at the handshake with a clear error; and a
//! local process that finds an engine's shm socket (they are listed in /proc/net/unix) gets
//! no memory from it without the secret.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use kvfs_proto::auth::{ClusterSecret, MAGIC};
use kvfs_proto::transfer::ShmRequest;
use kvfs_transfer::{
    BufferOptions, Engine, EngineConfig, ErrorKind, TransferOp, TransferRequest, TransportKind,
    Transports,
};

fn secret(s: &str) -> Option<ClusterSecret> {
    Some(ClusterSecret::from_bytes(s.as_bytes()).unwrap())
}

async fn engine(secret: Option<ClusterSecret>, transports: Transports) -> Engine {
    let cfg = EngineConfig { cluster_secret: secret, transports, ..EngineConfig::default() };
    Engine::start(cfg).await.unwrap()
}

/// Writes a pattern from `a` into `b`'s buffer and reads it back; returns the transport used.
async fn round_trip(a: &Engine, b: &Engine) -> kvfs_transfer::Result<TransportKind> {
    let la = a.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let rb = b.alloc_buffer(1 << 20, &BufferOptions::default()).unwrap();
    let seg = a.open_segment(b.name()).await?;
    let data: Vec<u8> =
        (0..1 << 20).map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    la.write_at(0, &data).unwrap();
    let req = |op, local_addr| TransferRequest {
        op,
        segment: seg.clone(),
        local_addr,
        remote_addr: rb.addr(),
        len: 1 << 20,
    };
    a.transfer_one(&req(TransferOp::Write, la.addr())).await?;
    let mut got = vec![0u8; 1 << 20];
    rb.read_at(0, &mut got).unwrap();
    assert!(got == data, "the peer holds exactly what was written");
    la.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    a.transfer_one(&req(TransferOp::Read, la.addr())).await?;
    la.read_at(0, &mut got).unwrap();
    assert!(got == data, "the read brought back exactly what was written");
    Ok(seg.transport_for(rb.addr(), 1 << 20).expect("a transport was chosen"))
}

/// Every shm socket of this process, by name (without the leading NUL).
fn shm_sockets() -> Vec<String> {
    let prefix = format!("@kvfs-te/{}/", std::process::id());
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let mut names: Vec<String> = table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|p| p.starts_with(&prefix))
        .map(|p| p[1..].to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_holders_of_the_secret_connect() {
    let k = secret("the cluster's own secret, 32 bytes");
    let a = engine(k, Transports::tcp_only()).await;
    let b = engine(k, Transports::default()).await;
    assert_eq!(round_trip(&a, &b).await.unwrap(), TransportKind::Tcp);
    let a2 = engine(k, Transports::default()).await;
    assert_eq!(round_trip(&a2, &b).await.unwrap(), TransportKind::Shm);

    // A stranger on this host asks every shm socket for memory: no descriptor, no buffer list.
    let socks = shm_sockets();
    assert!(!socks.is_empty(), "the engines with shm listen on abstract sockets");
    for name in socks {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let frame = kvfs_proto::encode_frame(&ShmRequest::Buffers { start: 0 }).unwrap();
        s.write_all(&frame).unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).unwrap();
        assert!(answer.starts_with(&MAGIC), "{name}: refused with the handshake's magic");
        assert!(
            String::from_utf8_lossy(&answer).contains("requires the cluster secret"),
            "{name}: says why"
        );
    }

    // An engine without the secret, and one with another secret, are refused at the handshake.
    let plain = engine(None, Transports::tcp_only()).await;
    let e = round_trip(&plain, &b).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(e.to_string().contains("no cluster secret"), "{e}");
    let other = engine(secret("somebody else's cluster secret"), Transports::default()).await;
    let e = round_trip(&other, &b).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(e.to_string().contains("another cluster secret"), "{e}");
    // The other way round: an engine with a secret does not talk to one without.
    let e = round_trip(&a, &plain).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
    assert!(e.to_string().contains("without a cluster secret"), "{e}");

    // The holders still work after all those refusals.
    assert_eq!(round_trip(&a, &b).await.unwrap(), TransportKind::Tcp);
}
