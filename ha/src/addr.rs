//! `etcd://` master addresses.

use crate::{Error, Result};

/// The reference's default `--cluster_id`.
pub const DEFAULT_CLUSTER: &str = "mooncake_cluster";

/// Where a cluster's leader is found: etcd endpoints (`http://HOST:PORT`) and a cluster name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTarget {
    pub endpoints: Vec<String>,
    pub cluster: String,
}

/// The key a cluster's leader holds.
pub fn leader_key(cluster: &str) -> String {
    format!("/kvfs/{cluster}/leader")
}

/// The term of the last leader that began serving (each leader writes it before it serves).
pub fn term_key(cluster: &str) -> String {
    format!("/kvfs/{cluster}/term")
}

/// Where the quotas set through a leader's admin API live, one key per tenant (JSON), so the
/// next leader applies them too.
pub fn tenant_quotas_prefix(cluster: &str) -> String {
    format!("/kvfs/{cluster}/tenant-quotas/")
}

/// Where a leader records that it stopped mirroring its grants to `standby` (the session it
/// dropped), so that standby knows its copy is incomplete should it take over.
pub fn mirror_dropped_key(cluster: &str, standby: &str) -> String {
    format!("/kvfs/{cluster}/mirror-dropped/{standby}")
}

impl EtcdTarget {
    /// Parses `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`; `None` when `addr` is not an etcd
    /// address at all (a plain `HOST:PORT` master).
    pub fn parse_master_addr(addr: &str) -> Option<Result<EtcdTarget>> {
        let rest = addr.strip_prefix("etcd://")?;
        let (hosts, cluster) = match rest.split_once('/') {
            Some((h, c)) => (h, c.trim_end_matches('/')),
            None => (rest, ""),
        };
        let cluster = match cluster {
            "" => std::env::var("KVFS_CLUSTER")
                .ok()
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| DEFAULT_CLUSTER.to_string()),
            c => c.to_string(),
        };
        Some(Self::new(hosts, &cluster).map_err(|e| Error::Invalid(format!("{addr:?}: {e}"))))
    }

    /// Endpoints as `HOST:PORT` or `http://HOST:PORT`, separated by `,` or `;`.
    pub fn new(endpoints: &str, cluster: &str) -> Result<EtcdTarget> {
        let endpoints: Vec<String> = endpoints
            .split([',', ';'])
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                if e.starts_with("https://") {
                    return Err(Error::Invalid(format!(
                        "etcd endpoint {e:?}: TLS is not supported (use http://)"
                    )));
                }
                let bare = e.strip_prefix("http://").unwrap_or(e).trim_end_matches('/');
                if bare.is_empty() || !bare.contains(':') || bare.contains('/') {
                    return Err(Error::Invalid(format!("etcd endpoint {e:?} is not HOST:PORT")));
                }
                Ok(format!("http://{bare}"))
            })
            .collect::<Result<_>>()?;
        if endpoints.is_empty() {
            return Err(Error::Invalid("no etcd endpoint given".into()));
        }
        if cluster.is_empty()
            || !cluster.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(Error::Invalid(format!(
                "cluster name {cluster:?}: use letters, digits, '-', '_' and '.'"
            )));
        }
        Ok(EtcdTarget { endpoints, cluster: cluster.to_string() })
    }

    /// The address clients and nodes are given: `etcd://h:p,h:p/CLUSTER`.
    pub fn master_addr(&self) -> String {
        let hosts: Vec<&str> =
            self.endpoints.iter().map(|e| e.strip_prefix("http://").unwrap_or(e)).collect();
        format!("etcd://{}/{}", hosts.join(","), self.cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_addresses_parse_in_both_spellings() {
        assert!(EtcdTarget::parse_master_addr("127.0.0.1:50051").is_none());
        let t = EtcdTarget::parse_master_addr("etcd://a:2379,b:2379/prod").unwrap().unwrap();
        assert_eq!(t.endpoints, vec!["http://a:2379", "http://b:2379"]);
        assert_eq!(t.cluster, "prod");
        assert_eq!(t.master_addr(), "etcd://a:2379,b:2379/prod");
        let t = EtcdTarget::parse_master_addr("etcd://a:2379;b:2379").unwrap().unwrap();
        assert_eq!(t.endpoints.len(), 2);
        assert!(!t.cluster.is_empty());
        let t = EtcdTarget::parse_master_addr("etcd://http://a:1/").unwrap();
        assert!(t.is_err(), "a scheme inside an etcd:// address");
        for bad in ["etcd://", "etcd://a/x", "etcd://a:1/bad name", "etcd://https://a:1/x"] {
            let r = EtcdTarget::parse_master_addr(bad).unwrap();
            assert!(r.is_err(), "{bad}: {r:?}");
        }
        assert_eq!(EtcdTarget::new("http://h:1", "c").unwrap().endpoints, vec!["http://h:1"]);
    }
}
