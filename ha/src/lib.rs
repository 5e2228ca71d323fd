//! High availability for kvfs: one leader master per cluster, elected through etcd, and the
//! discovery every client and node uses to follow it.
//!
//! Mechanism. [`Etcd`] talks to etcd's JSON gateway (`/v3/...`, etcd 3.4 and later) over plain
//! HTTP. A candidate master ([`Candidate`]) grants itself a lease and creates the cluster's
//! leader key (`/kvfs/CLUSTER/leader`, value: its RPC address) only if the key is absent, in
//! one transaction. The winner's *term* is the key's create revision: etcd revisions only
//! grow, so every later leader has a larger term. The leader keeps its lease alive and holds
//! a [`LeaseGuard`] that turns invalid once the lease may have expired in etcd (it counts from
//! when each keep-alive was *sent*, less a margin, so it lapses before etcd can let anyone
//! else win). Standbys watch the key; when it goes they try again.
//!
//! A standby also probes the leader's RPC address: a refused connection means no process
//! listens there any more (the leader died), and the standby revokes the dead leader's lease
//! at once instead of waiting out its TTL. A leader that is stopped or cut off still has a
//! socket open, so it is never revoked early: its lease runs out and its guard with it.
//!
//! Followers ([`LeaderWatch`]) read and watch the leader key and hand out the current
//! leader's address and term; a client or node moves to the new leader when it changes and
//! refuses a master whose term is older than one it has seen.
//!
//! Addresses: `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]` (`;` also separates endpoints, as in
//! the reference's `master_server_addr`); without a cluster the reference's default,
//! `mooncake_cluster`, or `$KVFS_CLUSTER`.

mod addr;
mod election;
mod etcd;
mod follow;
pub mod testing;

pub use addr::{
    DEFAULT_CLUSTER, EtcdTarget, leader_key, mirror_dropped_key, tenant_quotas_prefix, term_key,
};
pub use election::{Campaign, Candidate, Leadership, LeaseGuard};
pub use etcd::{Etcd, Kv, WatchEvent, WatchStream};
pub use follow::{LeaderInfo, LeaderWatch};

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No endpoint answered (connection refused, timed out, or the request failed).
    #[error("etcd unreachable at {endpoints}: {detail}")]
    Unreachable { endpoints: String, detail: String },
    /// etcd answered with an error.
    #[error("etcd refused {call}: {message}")]
    Refused { call: &'static str, message: String },
    /// The answer was not what etcd's gateway sends.
    #[error("unexpected answer from etcd to {call}: {detail}")]
    Protocol { call: &'static str, detail: String },
    /// A malformed `etcd://` address or option.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
