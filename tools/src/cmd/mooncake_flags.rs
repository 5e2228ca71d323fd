//! The reference master's command line (`mooncake_master`, gflags style), read by `kvfs
//! master`, so a deployment script written for the reference starts kvfs instead.
//!
//! Mechanism. [`translate`] rewrites the argument list before clap sees it:
//! - invoked as `mooncake_master` (a symlink to `kvfs`), the `master` subcommand is implied;
//! - `--config_path=FILE` (JSON, or the reference's flat YAML) becomes `--key=value` arguments
//!   placed before the command line's own, so explicit flags win, as in the reference;
//! - gflags spellings become clap's: `-flag=v` -> `--flag=v`, `--noflag` -> `--flag=false`;
//! - reference flags kvfs does not implement ([`IGNORED`]) are dropped with a warning that says
//!   why (a value given as the next argument is dropped with them); anything else unknown
//!   reaches clap and is refused, so a typo is never silently ignored.
//!
//! The flags that take effect (`--rpc_port`, `--rpc_address`, `--default_kv_lease_ttl`, the
//! eviction ratios, `--metrics_port`, `--client_ttl`, the HTTP metadata server, ...) are clap
//! arguments of [`super::cluster::MasterArgs`]; docs/mooncake-compat.md maps each one.

use std::ffi::OsString;
use std::path::Path;

/// Reference flags that take effect in kvfs (clap arguments of `MasterArgs`), with whether
/// each is a boolean (gflags booleans take no separate value: `--flag` or `--flag=false`).
pub const SUPPORTED: &[(&str, bool)] = &[
    ("rpc_port", false),
    ("port", false),
    ("rpc_address", false),
    ("default_kv_lease_ttl", false),
    ("eviction_ratio", false),
    ("eviction_high_watermark_ratio", false),
    ("metrics_port", false),
    ("metrics_host", false),
    ("client_ttl", false),
    ("client_live_ttl_sec", false),
    ("put_start_discard_timeout_sec", false),
    ("enable_http_metadata_server", true),
    ("http_metadata_server_port", false),
    ("http_metadata_server_host", false),
    ("enable_kv_events", true),
    ("kv_events_bind_endpoint", false),
    ("kv_events_model_name", false),
    ("kv_events_backend_id", false),
    ("kv_events_tenant_id", false),
    ("kv_events_lora_name", false),
    ("kv_events_block_size", false),
    ("kv_events_dp_rank", false),
    ("kv_events_emit_legacy_compat", true),
    ("kv_events_emit_object_key", true),
    ("kv_events_queue_capacity", false),
    ("etcd_endpoints", false),
    ("ha_backend_connstring", false),
    ("cluster_id", false),
];

/// Reference flags accepted and ignored, with the reason printed in the warning.
pub const IGNORED: &[(&str, bool, &str)] = &[
    ("max_threads", false, "kvfs sizes its runtime itself"),
    ("rpc_thread_num", false, "kvfs sizes its runtime itself"),
    ("rpc_interface", false, "kvfs binds --rpc_address"),
    ("rpc_conn_timeout_seconds", false, "kvfs bounds every call itself"),
    ("rpc_enable_tcp_no_delay", true, "kvfs always sets TCP_NODELAY"),
    ("enable_metric_reporting", true, "kvfs reports on /metrics of the admin port"),
    ("default_kv_soft_pin_ttl", false, "kvfs soft pins have no lifetime"),
    ("max_kv_soft_pin_ttl", false, "kvfs soft pins have no lifetime"),
    ("allow_evict_soft_pinned_objects", true, "kvfs evicts soft pins last, never hard pins"),
    ("nof_eviction_ratio", false, "kvfs has no NVMe-oF pool"),
    ("nof_eviction_high_watermark_ratio", false, "kvfs has no NVMe-oF pool"),
    ("nof_heartbeat_interval_sec", false, "kvfs has no NVMe-oF pool"),
    ("nof_heartbeat_probe_timeout_ms", false, "kvfs has no NVMe-oF pool"),
    ("nof_heartbeat_failures_threshold", false, "kvfs has no NVMe-oF pool"),
    ("enable_ha", true, "kvfs runs HA whenever --etcd_endpoints/--ha_backend_connstring is given"),
    ("ha_backend_type", false, "kvfs elects its leader through etcd"),
    ("enable_oplog", true, "a new kvfs leader rebuilds its directory from the nodes' reports"),
    ("oplog_poll_interval_ms", false, "kvfs keeps no oplog"),
    ("oplog_batch_max_entries", false, "kvfs keeps no oplog"),
    ("batch_oplog_retry_timeout_sec", false, "kvfs keeps no oplog"),
    ("pod_name", false, "kvfs elects its leader through etcd, not Kubernetes leases"),
    ("pod_namespace", false, "kvfs elects its leader through etcd, not Kubernetes leases"),
    ("enable_offload", true, "persistence is per object in kvfs (nodes write back)"),
    ("offload_on_evict", true, "persistence is per object in kvfs (nodes write back)"),
    ("offload_force_evict", true, "persistence is per object in kvfs"),
    ("offloading_queue_limit", false, "kvfs nodes bound their write-back queue"),
    ("offload_cap_ratio", false, "kvfs nodes bound their write-back queue"),
    ("promotion_on_hit", true, "kvfs nodes promote by their tier policy"),
    ("promotion_admission_threshold", false, "kvfs nodes promote by their tier policy"),
    ("promotion_queue_limit", false, "kvfs nodes promote by their tier policy"),
    ("promotion_max_per_heartbeat", false, "kvfs nodes promote by their tier policy"),
    ("dynamic_replication_mode", false, "kvfs replicates at put time only"),
    ("dynamic_replication_heat_window_seconds", false, "kvfs replicates at put time only"),
    ("dynamic_replication_admission_qps_threshold", false, "kvfs replicates at put time only"),
    ("dynamic_replication_max_memory_replicas", false, "kvfs replicates at put time only"),
    ("kv_events_additional_salt", false, "kvfs publishes keys unsalted"),
    ("root_fs_dir", false, "kvfs persists to object storage from the nodes"),
    ("global_file_segment_size", false, "kvfs persists to object storage from the nodes"),
    ("memory_allocator", false, "kvfs has one allocator"),
    ("allocation_strategy", false, "kvfs places per put (ReplicateConfig)"),
    ("enable_metadata_cleanup_on_timeout", true, "kvfs engines do not use HTTP metadata"),
    ("put_start_release_timeout_sec", false, "kvfs frees a revoked put's space at once"),
    ("enable_disk_eviction", true, "kvfs nodes evict their own disks"),
    ("quota_bytes", false, "kvfs nodes bound their own disks"),
    ("enable_multi_tenants", true, "kvfs has one namespace"),
    ("tenant_quota_connector_type", false, "kvfs has one namespace"),
    ("tenant_quota_connector_uri", false, "kvfs has one namespace"),
    ("snapshot_backup_dir", false, "kvfs nodes are the source of truth, no snapshots"),
    ("enable_snapshot_restore", true, "kvfs nodes are the source of truth, no snapshots"),
    ("enable_snapshot", true, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_interval_seconds", false, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_child_timeout_seconds", false, "kvfs nodes are the source of truth"),
    ("snapshot_retention_count", false, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_object_store_type", false, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_payload_store_type", false, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_payload_backend_type", false, "kvfs nodes are the source of truth"),
    ("snapshot_catalog_store_type", false, "kvfs nodes are the source of truth, no snapshots"),
    ("snapshot_catalog_backend_type", false, "kvfs nodes are the source of truth"),
    ("snapshot_catalog_store_connstring", false, "kvfs nodes are the source of truth"),
    ("snapshot_catalog_backend_connstring", false, "kvfs nodes are the source of truth"),
    ("max_total_finished_tasks", false, "kvfs has no replica tasks"),
    ("max_total_pending_tasks", false, "kvfs has no replica tasks"),
    ("max_total_processing_tasks", false, "kvfs has no replica tasks"),
    ("pending_task_timeout_sec", false, "kvfs has no replica tasks"),
    ("processing_task_timeout_sec", false, "kvfs has no replica tasks"),
    ("max_retry_attempts", false, "kvfs has no replica tasks"),
    ("cxl_path", false, "kvfs has no CXL tier"),
    ("cxl_size", false, "kvfs has no CXL tier"),
    ("enable_cxl", true, "kvfs has no CXL tier"),
    // glog's flags, which every reference binary takes.
    ("v", false, "use KVFS_LOG=debug for kvfs's logs"),
    ("minloglevel", false, "use KVFS_LOG for kvfs's logs"),
    ("logtostderr", true, "kvfs logs to stderr"),
    ("alsologtostderr", true, "kvfs logs to stderr"),
    ("stderrthreshold", false, "use KVFS_LOG for kvfs's logs"),
    ("log_dir", false, "kvfs logs to stderr"),
];

/// Rewrites `args` (argv, program name first) as described in the module notes; warnings go
/// to stderr. Errors are unreadable config files.
pub fn translate(args: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let mut args: Vec<String> = match args.into_iter().map(OsString::into_string).collect() {
        Ok(a) => a,
        Err(_) => anyhow::bail!("arguments must be UTF-8"),
    };
    if args.is_empty() {
        return Ok(Vec::new());
    }
    let program = Path::new(&args[0]).file_name().and_then(|n| n.to_str()).unwrap_or("");
    if program.starts_with("mooncake_master") {
        args.insert(1, "master".to_string());
    }
    let Some(sub) = subcommand_index(&args) else {
        return Ok(args.into_iter().map(OsString::from).collect());
    };
    if args[sub] != "master" {
        return Ok(args.into_iter().map(OsString::from).collect());
    }
    let rest = args.split_off(sub + 1);
    let rest = expand_config(rest)?;
    args.extend(rewrite(rest));
    Ok(args.into_iter().map(OsString::from).collect())
}

/// Index of the subcommand: the first argument that is neither an option nor the value of
/// the global `--master` option.
fn subcommand_index(args: &[String]) -> Option<usize> {
    let mut i = 1;
    while i < args.len() {
        let a = &args[i];
        if a == "--master" {
            i += 2;
            continue;
        }
        if !a.starts_with('-') {
            return Some(i);
        }
        i += 1;
    }
    None
}

fn name_of(arg: &str) -> Option<(&str, Option<&str>)> {
    let body = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    })
}

fn supported(name: &str) -> Option<bool> {
    SUPPORTED.iter().find(|(n, _)| *n == name).map(|&(_, b)| b)
}

fn ignored(name: &str) -> Option<(bool, &'static str)> {
    IGNORED.iter().find(|(n, _, _)| *n == name).map(|&(_, b, why)| (b, why))
}

fn rewrite(args: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    while let Some(arg) = it.next() {
        let Some((name, value)) = name_of(&arg) else {
            out.push(arg);
            continue;
        };
        let (name, value) = (name.to_string(), value.map(str::to_string));
        // --noflag is gflags' false for a boolean.
        if let Some(base) = name.strip_prefix("no")
            && value.is_none()
            && (supported(base) == Some(true) || ignored(base).is_some_and(|(b, _)| b))
        {
            if let Some((_, why)) = ignored(base) {
                eprintln!("kvfs master: ignoring --{name} ({why})");
            } else {
                out.push(format!("--{base}=false"));
            }
            continue;
        }
        if let Some((is_bool, why)) = ignored(&name) {
            let shown = match &value {
                Some(v) => format!("--{name}={v}"),
                None if !is_bool && it.peek().is_some_and(|n| !n.starts_with('-')) => {
                    format!("--{name} {}", it.next().unwrap_or_default())
                }
                None => format!("--{name}"),
            };
            eprintln!("kvfs master: ignoring reference flag {shown} ({why})");
            continue;
        }
        if supported(&name).is_some() && !arg.starts_with("--") {
            // gflags' single-dash spelling.
            out.push(match value {
                Some(v) => format!("--{name}={v}"),
                None => format!("--{name}"),
            });
            continue;
        }
        out.push(arg);
    }
    out
}

/// Replaces `--config_path FILE` with the file's settings as flags, placed first.
fn expand_config(args: Vec<String>) -> anyhow::Result<Vec<String>> {
    let mut path = None;
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match name_of(&a) {
            Some(("config_path", Some(v))) => path = Some(v.to_string()),
            Some(("config_path", None)) => {
                path = Some(it.next().ok_or_else(|| anyhow::anyhow!("--config_path needs a file"))?)
            }
            _ => rest.push(a),
        }
    }
    let Some(path) = path.filter(|p| !p.is_empty()) else { return Ok(rest) };
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("--config_path {path}: {e}"))?;
    let mut flags =
        config_flags(&text).map_err(|e| anyhow::anyhow!("--config_path {path}: {e}"))?;
    flags.extend(rest);
    Ok(flags)
}

/// The settings of a reference config file (a flat JSON object or flat YAML `key: value`
/// lines) as `--key=value` flags.
pub fn config_flags(text: &str) -> anyhow::Result<Vec<String>> {
    let pairs: Vec<(String, String)> = if text.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let obj = v.as_object().ok_or_else(|| anyhow::anyhow!("not a JSON object"))?;
        obj.iter()
            .map(|(k, v)| {
                let s = match v {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Null => String::new(),
                    other => other.to_string(),
                };
                (k.clone(), s)
            })
            .collect()
    } else {
        let mut pairs = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split(" #").next().unwrap_or("").trim_end();
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            if line.starts_with([' ', '\t', '-']) {
                anyhow::bail!("line {}: only flat `key: value` settings are read", n + 1);
            }
            let (k, v) = line
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("line {}: expected `key: value`", n + 1))?;
            let v = v.trim().trim_matches('"').trim_matches('\'');
            pairs.push((k.trim().to_string(), v.to_string()));
        }
        pairs
    };
    Ok(pairs.into_iter().map(|(k, v)| format!("--{k}={v}")).collect())
}

/// gflags' boolean spellings.
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "t" => Ok(true),
        "false" | "0" | "no" | "n" | "f" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean (true/false)")),
    }
}

/// The reference's durations: plain milliseconds ("500") or with a unit ("60s", "5m", "1h",
/// "250ms").
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration (500, 60s, 5m)"))?;
    let scale = match unit.trim() {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        u => return Err(format!("{s:?}: unknown unit {u:?} (ms, s, m, h)")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("{s:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(args: &[&str]) -> Vec<String> {
        translate(args.iter().map(OsString::from).collect())
            .unwrap()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn gflags_spellings_become_clap_ones() {
        assert_eq!(
            tr(&["kvfs", "master", "-rpc_port=1", "--noenable_http_metadata_server"]),
            ["kvfs", "master", "--rpc_port=1", "--enable_http_metadata_server=false"]
        );
        assert_eq!(
            tr(&["/usr/bin/mooncake_master", "--rpc_port", "5"]),
            ["/usr/bin/mooncake_master", "master", "--rpc_port", "5"]
        );
    }

    #[test]
    fn ignored_flags_are_dropped_with_their_values() {
        assert_eq!(
            tr(&[
                "kvfs",
                "--master",
                "master",
                "master",
                "--rpc_thread_num",
                "8",
                "--enable_ha",
                "--enable_oplog=true",
                "--v=1",
                "--lease-ttl-ms",
                "5"
            ]),
            ["kvfs", "--master", "master", "master", "--lease-ttl-ms", "5"]
        );
        // Other subcommands are left alone.
        assert_eq!(tr(&["kvfs", "node", "--v=1"]), ["kvfs", "node", "--v=1"]);
        // Unknown flags reach clap (and are refused there).
        assert_eq!(tr(&["kvfs", "master", "--bogus=1"]), ["kvfs", "master", "--bogus=1"]);
    }

    #[test]
    fn config_files_read_as_flags() {
        let json = r#"{"rpc_port": 50052, "enable_ha": false, "rpc_address": "0.0.0.0"}"#;
        let f = config_flags(json).unwrap();
        assert!(f.contains(&"--rpc_port=50052".to_string()));
        assert!(f.contains(&"--rpc_address=0.0.0.0".to_string()));
        let yaml =
            "# c\nrpc_port: 50053\nrpc_address: \"0.0.0.0\"  # bind\n\neviction_ratio: 0.1\n";
        assert_eq!(
            config_flags(yaml).unwrap(),
            ["--rpc_port=50053", "--rpc_address=0.0.0.0", "--eviction_ratio=0.1"]
        );
        assert!(config_flags("a:\n  - b\n").is_err());
    }

    #[test]
    fn durations_and_booleans() {
        assert_eq!(parse_duration_ms("500"), Ok(500));
        assert_eq!(parse_duration_ms("60s"), Ok(60_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert!(parse_duration_ms("5 parsecs").is_err());
        assert_eq!(parse_bool("TRUE"), Ok(true));
        assert!(parse_bool("maybe").is_err());
    }
}
