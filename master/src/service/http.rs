//! The master's admin HTTP endpoint: Prometheus `/metrics`, `/health`, and the read-only
//! queries operators and integrations poll (`/get_all_segments`, which SGLang polls to wait
//! for the store; `/query_key?key=K`), and tenants' quotas (`/api/v1/tenant_quotas`, see
//! `tenants`).
//!
//! A deliberately small HTTP/1.1 server: GET (PUT and DELETE for quotas), one request per
//! connection (`Connection: close`), request head bounded to 8 KiB, a body to 64 KiB, both
//! read within 5 s. It never touches object bytes and holds the directory lock only to copy
//! figures out or set a quota.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::State;

const HEAD_BYTES_MAX: usize = 8 << 10;
const BODY_BYTES_MAX: usize = 64 << 10;

pub async fn serve(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), handle(stream, state)).await;
        });
    }
}

async fn handle(mut stream: TcpStream, state: Arc<State>) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > HEAD_BYTES_MAX {
            return respond(&mut stream, 431, "text/plain", "request head too large\n").await;
        }
    }
    let end = head.windows(4).position(|w| w == b"\r\n\r\n").expect("found above") + 4;
    let mut body = head.split_off(end);
    let text = String::from_utf8_lossy(&head);
    let mut parts = text.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let header = |name: &str| {
        text.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if path == "/api/v1/tenant_quotas" {
        let len = header("content-length").and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
        if len > BODY_BYTES_MAX {
            return respond(&mut stream, 413, "text/plain", "body too large\n").await;
        }
        while body.len() < len {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&buf[..n]);
        }
        body.truncate(len);
        let tenant = query_param(query, "tenant_id");
        let auth = header("authorization");
        let (mut code, mut v, changed) =
            super::tenants::handle(&state, method, tenant, auth.as_deref(), &body);
        if let Some((tenant, quota)) = changed
            && let Err(e) = super::tenants::record(&state, &tenant, quota).await
        {
            code = 503;
            v = json!({ "error": format!(
                "the quota of {tenant:?} holds on this leader but is not recorded in etcd, so the next leader would not apply it: {e}"
            )});
        }
        return respond(&mut stream, code, "application/json", &format!("{v}\n")).await;
    }
    if method != "GET" {
        return respond(&mut stream, 405, "text/plain", "only GET is served here\n").await;
    }
    match path {
        "/metrics" => {
            let body = state.render_metrics();
            respond(&mut stream, 200, "text/plain; version=0.0.4", &body).await
        }
        "/health" => {
            let s = state.stats();
            let body = json!({
                "status": "ok",
                "role": "leader",
                "ready": !s.recovering,
                "recovering": s.recovering,
                "objects": s.objects,
                "nodes": s.nodes,
            });
            respond(&mut stream, 200, "application/json", &format!("{body}\n")).await
        }
        "/get_all_segments" => {
            let segs = state.segment_names();
            respond(&mut stream, 200, "application/json", &format!("{}\n", json!(segs))).await
        }
        "/query_key" => match query_param(query, "key") {
            Some(key) => match state.describe_key(&key) {
                Some(v) => respond(&mut stream, 200, "application/json", &format!("{v}\n")).await,
                None => respond(&mut stream, 404, "text/plain", "no such object\n").await,
            },
            None => respond(&mut stream, 400, "text/plain", "missing ?key=\n").await,
        },
        _ => {
            let body = "kvfs master: /metrics /health /get_all_segments /query_key?key=K \
                        /api/v1/tenant_quotas[?tenant_id=T]\n";
            respond(&mut stream, 404, "text/plain", body).await
        }
    }
}

async fn respond(
    stream: &mut TcpStream,
    code: u16,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        _ => "Request Header Fields Too Large",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// The percent-decoded value of `name` in a query string.
pub(super) fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_decode() {
        assert_eq!(query_param("key=a%2Fb%20c&x=1", "key").as_deref(), Some("a/b c"));
        assert_eq!(query_param("x=1", "key"), None);
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
