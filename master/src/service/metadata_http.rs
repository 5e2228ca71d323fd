//! The embedded HTTP metadata server of the reference master
//! (`--enable_http_metadata_server`): a key-value store over HTTP that Transfer Engines use to
//! publish and look up segment descriptors (`GET/PUT/DELETE /metadata?key=K`).
//!
//! kvfs engines never need it (they handshake peer to peer), but deployments written for the
//! reference start the master with it and point other tools at it; so the master serves the
//! same protocol, with the same answers: 200 with the stored body, `metadata updated`,
//! `metadata deleted`; 404 `metadata not found`; 400 `metadata key is required` and
//! `Duplicate rpc_meta key not allowed` (a key containing `rpc_meta` cannot be overwritten);
//! 405 for other methods. `GET /health` answers `ok`.
//!
//! Limits: request head 8 KiB, body `body_bytes_max`, all values `store_bytes_max` together
//! (over it: 507), each request read within 5 s; one request per connection. Values live in
//! memory only: a master restart loses them, as the reference's does.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::http::query_param;

const HEAD_BYTES_MAX: usize = 8 << 10;

/// Limits of the metadata store.
#[derive(Debug, Clone)]
pub struct MetadataHttpConfig {
    pub listen: SocketAddr,
    pub body_bytes_max: usize,
    pub store_bytes_max: usize,
}

impl MetadataHttpConfig {
    pub fn new(listen: SocketAddr) -> MetadataHttpConfig {
        MetadataHttpConfig { listen, body_bytes_max: 16 << 20, store_bytes_max: 256 << 20 }
    }
}

#[derive(Default)]
struct Store {
    values: HashMap<String, Vec<u8>>,
    bytes: usize,
}

struct Reply {
    code: u16,
    body: Vec<u8>,
}

impl Reply {
    fn text(code: u16, s: &str) -> Reply {
        Reply { code, body: s.as_bytes().to_vec() }
    }
}

pub async fn serve(listener: TcpListener, cfg: MetadataHttpConfig) {
    let store = Arc::new(Mutex::new(Store::default()));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (store, cfg) = (store.clone(), cfg.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), handle(stream, store, cfg)).await;
        });
    }
}

async fn handle(
    mut stream: TcpStream,
    store: Arc<Mutex<Store>>,
    cfg: MetadataHttpConfig,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > HEAD_BYTES_MAX {
            return respond(&mut stream, Reply::text(431, "request head too large")).await;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.lines();
    let mut first = lines.next().unwrap_or("").split_whitespace();
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let length: usize = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    if length > cfg.body_bytes_max {
        return respond(&mut stream, Reply::text(413, "metadata value too large")).await;
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let reply = route(method, path, query, body, &store, &cfg);
    respond(&mut stream, reply).await
}

fn route(
    method: &str,
    path: &str,
    query: &str,
    body: Vec<u8>,
    store: &Mutex<Store>,
    cfg: &MetadataHttpConfig,
) -> Reply {
    if path == "/health" {
        return Reply::text(200, "ok");
    }
    if path != "/metadata" {
        return Reply::text(404, "not found: serves /metadata?key=K and /health");
    }
    let Some(key) =
        query_param(query, "key").map(|k| k.trim().to_string()).filter(|k| !k.is_empty())
    else {
        return Reply::text(400, "metadata key is required");
    };
    let mut st = store.lock().unwrap_or_else(|e| e.into_inner());
    match method {
        "GET" => match st.values.get(&key) {
            Some(v) => Reply { code: 200, body: v.clone() },
            None => Reply::text(404, "metadata not found"),
        },
        "PUT" => {
            if key.contains("rpc_meta") && st.values.contains_key(&key) {
                return Reply::text(400, "Duplicate rpc_meta key not allowed");
            }
            let old = st.values.get(&key).map_or(0, |v| v.len() + key.len());
            if st.bytes - old + body.len() + key.len() > cfg.store_bytes_max {
                return Reply::text(507, "metadata store full");
            }
            st.bytes = st.bytes - old + body.len() + key.len();
            st.values.insert(key, body);
            Reply::text(200, "metadata updated")
        }
        "DELETE" => match st.values.remove(&key) {
            Some(v) => {
                st.bytes -= v.len() + key.len();
                Reply::text(200, "metadata deleted")
            }
            None => Reply::text(404, "metadata not found"),
        },
        _ => Reply::text(405, "Method not allowed"),
    }
}

async fn respond(stream: &mut TcpStream, r: Reply) -> std::io::Result<()> {
    let reason = match r.code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        _ => "Insufficient Storage",
    };
    let head = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        r.code,
        r.body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&r.body).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(st: &Mutex<Store>, cfg: &MetadataHttpConfig, m: &str, q: &str, b: &[u8]) -> Reply {
        route(m, "/metadata", q, b.to_vec(), st, cfg)
    }

    #[test]
    fn same_answers_as_the_reference() {
        let st = Mutex::new(Store::default());
        let mut cfg = MetadataHttpConfig::new("127.0.0.1:0".parse().unwrap());
        assert_eq!(call(&st, &cfg, "GET", "", b"").code, 400);
        assert_eq!(call(&st, &cfg, "GET", "key=a", b"").code, 404);
        assert_eq!(call(&st, &cfg, "PUT", "key=a", b"{\"x\":1}").code, 200);
        let got = call(&st, &cfg, "GET", "key=a", b"");
        assert_eq!((got.code, got.body.as_slice()), (200, &b"{\"x\":1}"[..]));
        assert_eq!(call(&st, &cfg, "PUT", "key=mooncake%2Frpc_meta%2Fh", b"1").code, 200);
        assert_eq!(call(&st, &cfg, "PUT", "key=mooncake/rpc_meta/h", b"2").code, 400);
        assert_eq!(call(&st, &cfg, "DELETE", "key=a", b"").code, 200);
        assert_eq!(call(&st, &cfg, "DELETE", "key=a", b"").code, 404);
        assert_eq!(call(&st, &cfg, "POST", "key=a", b"").code, 405);
        cfg.store_bytes_max = 8;
        assert_eq!(call(&st, &cfg, "PUT", "key=b", b"0123456789").code, 507);
        let used = st.lock().unwrap().bytes;
        assert_eq!(used, "mooncake/rpc_meta/h".len() + 1);
    }
}
