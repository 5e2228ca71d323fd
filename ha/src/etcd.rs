//! A small client of etcd's JSON gateway: leases, a create-if-absent transaction, reads,
//! conditional deletes and watches. Keys and values travel base64-encoded and 64-bit numbers
//! as strings, as the gateway's JSON mapping of etcd's protobuf messages has it.
//!
//! Every call but a watch is bounded by the client's timeout; a call that cannot reach one
//! endpoint tries the next (each at most once per call).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use crate::{Error, Result};

/// A key as etcd holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: u64,
    pub mod_revision: u64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// One change a watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(Kv),
    Delete { key: String, mod_revision: u64 },
}

/// A handle on an etcd cluster (cheap to clone).
#[derive(Clone)]
pub struct Etcd {
    http: reqwest::Client,
    endpoints: Arc<Vec<String>>,
    next: Arc<AtomicUsize>,
    timeout: Duration,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd").field("endpoints", &self.endpoints).finish()
    }
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

fn unb64(call: &'static str, v: &Value) -> Result<Vec<u8>> {
    match v.as_str() {
        None => Ok(Vec::new()),
        Some(s) => B64
            .decode(s)
            .map_err(|e| Error::Protocol { call, detail: format!("bad base64 {s:?}: {e}") }),
    }
}

/// A 64-bit number of the gateway's JSON: a string, a number, or absent (zero).
fn num(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn kv(call: &'static str, v: &Value) -> Result<Kv> {
    Ok(Kv {
        key: String::from_utf8_lossy(&unb64(call, &v["key"])?).into_owned(),
        value: unb64(call, &v["value"])?,
        create_revision: num(&v["create_revision"]).max(0) as u64,
        mod_revision: num(&v["mod_revision"]).max(0) as u64,
        lease: num(&v["lease"]),
    })
}

impl Etcd {
    /// `endpoints` as `http://HOST:PORT`; `timeout` bounds every call but a watch.
    pub fn new(endpoints: Vec<String>, timeout: Duration) -> Result<Etcd> {
        if endpoints.is_empty() {
            return Err(Error::Invalid("no etcd endpoint given".into()));
        }
        // The reqwest of this build carries rustls (the object store's S3 client): building a
        // client needs a process-wide crypto provider even for plain http.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| Error::Invalid(format!("http client: {e}")))?;
        Ok(Etcd { http, endpoints: Arc::new(endpoints), next: Arc::default(), timeout })
    }

    /// One client per endpoint, each with a connection pool of its own: for a call that asks
    /// several members at once rather than one after another, and for use on another runtime
    /// (a connection pool belongs to the runtime that made its connections).
    pub fn per_member(&self) -> Result<Vec<Etcd>> {
        self.endpoints.iter().map(|e| Etcd::new(vec![e.clone()], self.timeout)).collect()
    }

    fn unreachable(&self, detail: String) -> Error {
        Error::Unreachable { endpoints: self.endpoints.join(","), detail }
    }

    /// Sends one request, to each endpoint in turn until one answers; returns the endpoint's
    /// response (its status and body are checked by the caller).
    async fn send(
        &self,
        call: &'static str,
        path: &str,
        body: &Value,
        timeout: Option<Duration>,
    ) -> Result<reqwest::Response> {
        let n = self.endpoints.len();
        let first = self.next.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            let url = format!("{}{path}", self.endpoints[at]);
            let mut req = self.http.post(&url).body(body.to_string());
            if let Some(t) = timeout {
                req = req.timeout(t);
            }
            match req.send().await {
                Ok(r) => {
                    self.next.store(at, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(e) => {
                    tracing::debug!(%url, error = %e, call, "etcd endpoint failed");
                    last = format!("{url}: {e}");
                }
            }
        }
        self.next.store((first + 1) % n, Ordering::Relaxed);
        Err(self.unreachable(last))
    }

    /// One unary call: the answer's JSON, or etcd's error.
    async fn call(&self, call: &'static str, path: &str, body: Value) -> Result<Value> {
        let resp = self.send(call, path, &body, Some(self.timeout)).await?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| self.unreachable(format!("{call}: {e}")))?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| Error::Protocol {
            call,
            detail: format!("HTTP {status}: {e}: {}", String::from_utf8_lossy(&bytes)),
        })?;
        // The gateway answers errors as {"error": ..., "code": N, "message": ...}.
        if let Some(m) = v.get("message").or_else(|| v.get("error")) {
            return Err(Error::Refused { call, message: m.as_str().unwrap_or("").to_string() });
        }
        if !status.is_success() {
            return Err(Error::Protocol { call, detail: format!("HTTP {status}: {v}") });
        }
        Ok(v)
    }

    /// Grants a lease of `ttl_s` seconds; returns its id.
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<i64> {
        let v = self.call("lease grant", "/v3/lease/grant", json!({"TTL": ttl_s})).await?;
        match num(&v["ID"]) {
            0 => Err(Error::Protocol { call: "lease grant", detail: v.to_string() }),
            id => Ok(id),
        }
    }

    /// Renews a lease once; returns the TTL etcd granted (0 or less: the lease is gone).
    pub async fn lease_keepalive(&self, id: i64) -> Result<i64> {
        let v = self
            .call("lease keepalive", "/v3/lease/keepalive", json!({"ID": id.to_string()}))
            .await?;
        Ok(num(&v["result"]["TTL"]))
    }

    /// Whether the member this client asks leads etcd's raft group: its own member id against
    /// the raft leader's it reports (maintenance status). Ask one member: a client of several
    /// answers for whichever of them answered.
    pub async fn leads_raft(&self) -> Result<bool> {
        let v = self.call("status", "/v3/maintenance/status", json!({})).await?;
        let id = v["header"]["member_id"].as_str().unwrap_or("");
        Ok(!id.is_empty() && v["leader"].as_str() == Some(id))
    }

    /// Revokes a lease, deleting every key attached to it; a lease already gone is fine.
    pub async fn lease_revoke(&self, id: i64) -> Result<()> {
        match self.call("lease revoke", "/v3/lease/revoke", json!({"ID": id.to_string()})).await {
            Ok(_) => Ok(()),
            Err(Error::Refused { message, .. }) if message.contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Creates `key` only if it does not exist, attached to `lease`. `Ok(Ok(revision))`: created
    /// at that revision; `Ok(Err(kv))`: it exists, as `kv`.
    pub async fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<std::result::Result<u64, Kv>> {
        let k = b64(key.as_bytes());
        let body = json!({
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": b64(value), "lease": lease.to_string()}}],
            "failure": [{"request_range": {"key": k}}],
        });
        let v = self.call("create", "/v3/kv/txn", body).await?;
        if v["succeeded"].as_bool() == Some(true) {
            return Ok(Ok(num(&v["header"]["revision"]).max(0) as u64));
        }
        let kvs = &v["responses"][0]["response_range"]["kvs"];
        match kvs.get(0) {
            Some(existing) => Ok(Err(kv("create", existing)?)),
            // Deleted between the compare and the read: cannot happen in one transaction.
            None => Err(Error::Protocol { call: "create", detail: v.to_string() }),
        }
    }

    /// Reads `key`: the store's revision and the key if it exists.
    pub async fn get(&self, key: &str) -> Result<(u64, Option<Kv>)> {
        let v = self.call("get", "/v3/kv/range", json!({"key": b64(key.as_bytes())})).await?;
        let rev = num(&v["header"]["revision"]).max(0) as u64;
        match v["kvs"].get(0) {
            Some(k) => Ok((rev, Some(kv("get", k)?))),
            None => Ok((rev, None)),
        }
    }

    /// Every key under `prefix`, in key order.
    pub async fn get_prefix(&self, prefix: &str) -> Result<Vec<Kv>> {
        let mut end = prefix.as_bytes().to_vec();
        match end.last_mut() {
            Some(b) if *b < 0xff => *b += 1,
            _ => return Err(Error::Invalid(format!("prefix {prefix:?} has no end"))),
        }
        let body = json!({"key": b64(prefix.as_bytes()), "range_end": b64(&end)});
        let v = self.call("get", "/v3/kv/range", body).await?;
        match v["kvs"].as_array() {
            Some(kvs) => kvs.iter().map(|k| kv("get", k)).collect(),
            None => Ok(Vec::new()),
        }
    }

    /// Deletes `key` if it is still the one created at `create_revision`; true if deleted.
    pub async fn delete_if_created(&self, key: &str, create_revision: u64) -> Result<bool> {
        self.delete_if_guarded(key, create_revision, key).await
    }

    /// Deletes `key` only while `guard_key` is still the one created at `create_revision`;
    /// true if the guard held.
    pub async fn delete_if_guarded(
        &self,
        guard_key: &str,
        create_revision: u64,
        key: &str,
    ) -> Result<bool> {
        let op = json!({"request_delete_range": {"key": b64(key.as_bytes())}});
        self.guarded("delete", guard_key, create_revision, op).await
    }

    /// Writes `key` = `value` only while `guard_key` is still the one created at
    /// `create_revision` (a leader's write that must not land once it is deposed); true if
    /// written.
    pub async fn put_if_guarded(
        &self,
        guard_key: &str,
        create_revision: u64,
        key: &str,
        value: &[u8],
    ) -> Result<bool> {
        let op = json!({"request_put": {"key": b64(key.as_bytes()), "value": b64(value)}});
        self.guarded("put", guard_key, create_revision, op).await
    }

    /// One transaction: `op` if `guard_key` is still the one created at `create_revision`.
    async fn guarded(
        &self,
        call: &'static str,
        guard_key: &str,
        create_revision: u64,
        op: Value,
    ) -> Result<bool> {
        let body = json!({
            "compare": [{"key": b64(guard_key.as_bytes()), "target": "CREATE", "result": "EQUAL",
                         "create_revision": create_revision.to_string()}],
            "success": [op],
        });
        let v = self.call(call, "/v3/kv/txn", body).await?;
        Ok(v["succeeded"].as_bool() == Some(true))
    }

    /// Watches `key` from `start_revision` on.
    pub async fn watch(&self, key: &str, start_revision: u64) -> Result<WatchStream> {
        let body = json!({"create_request": {
            "key": b64(key.as_bytes()),
            "start_revision": start_revision.to_string(),
        }});
        let resp = self.send("watch", "/v3/watch", &body, None).await?;
        if !resp.status().is_success() {
            return Err(Error::Protocol {
                call: "watch",
                detail: format!("HTTP {}", resp.status()),
            });
        }
        Ok(WatchStream { resp, buf: Vec::new(), created: false })
    }
}

/// A watch's stream of events.
pub struct WatchStream {
    resp: reqwest::Response,
    buf: Vec<u8>,
    created: bool,
}

impl WatchStream {
    /// The next batch of events (never empty), or an error when the stream ended or failed:
    /// the caller reads the key again and starts a new watch.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>> {
        loop {
            // The gateway writes one JSON object per message; take every complete one.
            let mut msgs = Vec::new();
            let mut used = 0;
            {
                let mut de = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
                loop {
                    match de.next() {
                        Some(Ok(v)) => {
                            used = de.byte_offset();
                            msgs.push(v);
                        }
                        Some(Err(e)) if e.is_eof() => break,
                        Some(Err(e)) => {
                            return Err(Error::Protocol { call: "watch", detail: e.to_string() });
                        }
                        None => break,
                    }
                }
            }
            let mut events = Vec::new();
            for v in msgs {
                events.extend(self.events(v)?);
            }
            self.buf.drain(..used);
            if !events.is_empty() {
                return Ok(events);
            }
            if self.buf.len() > 16 << 20 {
                return Err(Error::Protocol {
                    call: "watch",
                    detail: "message over 16 MiB".into(),
                });
            }
            match self.resp.chunk().await {
                Ok(Some(c)) => self.buf.extend_from_slice(&c),
                Ok(None) => {
                    return Err(Error::Unreachable {
                        endpoints: self.resp.url().to_string(),
                        detail: "the watch stream ended".into(),
                    });
                }
                Err(e) => {
                    return Err(Error::Unreachable {
                        endpoints: self.resp.url().to_string(),
                        detail: format!("watch: {e}"),
                    });
                }
            }
        }
    }

    fn events(&mut self, v: Value) -> Result<Vec<WatchEvent>> {
        if let Some(m) = v.get("error") {
            return Err(Error::Refused { call: "watch", message: m.to_string() });
        }
        let r = &v["result"];
        if r["created"].as_bool() == Some(true) {
            self.created = true;
        }
        if r["canceled"].as_bool() == Some(true) {
            let why = r["cancel_reason"].as_str().unwrap_or("canceled by etcd").to_string();
            return Err(Error::Refused { call: "watch", message: why });
        }
        let mut out = Vec::new();
        for e in r["events"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let k = &e["kv"];
            out.push(match e["type"].as_str() {
                Some("DELETE") => WatchEvent::Delete {
                    key: String::from_utf8_lossy(&unb64("watch", &k["key"])?).into_owned(),
                    mod_revision: num(&k["mod_revision"]).max(0) as u64,
                },
                _ => WatchEvent::Put(kv("watch", k)?),
            });
        }
        Ok(out)
    }
}
