//! Election and following against a real etcd.

use std::time::{Duration, Instant};

use kvfs_ha::testing::EtcdServer;
use kvfs_ha::{Campaign, Candidate, Etcd, EtcdTarget, LeaderWatch};

const TTL: Duration = Duration::from_secs(2);

fn etcd(s: &EtcdServer) -> Etcd {
    Etcd::new(vec![s.client_url.clone()], Duration::from_secs(2)).unwrap()
}

/// An address nobody listens on.
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_each_term_is_larger() {
    let s = EtcdServer::start();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a_addr = listener.local_addr().unwrap().to_string();
    let a = Candidate::new(etcd(&s), "c1", &a_addr, TTL).unwrap();
    let b = Candidate::new(etcd(&s), "c1", "127.0.0.1:1", TTL).unwrap();
    let Campaign::Won(lead_a) = a.try_lead().await.unwrap() else { panic!("a should win") };
    let Campaign::Lost(seen) = b.try_lead().await.unwrap() else { panic!("b should lose") };
    assert_eq!(seen.value, a_addr.as_bytes());
    assert_eq!(seen.create_revision, lead_a.term());
    assert!(lead_a.guard().is_valid());
    // Another cluster has its own leader.
    let other = Candidate::new(etcd(&s), "c2", "127.0.0.1:2", TTL).unwrap();
    assert!(matches!(other.try_lead().await.unwrap(), Campaign::Won(_)));

    let target = EtcdTarget::new(&s.endpoint(), "c1").unwrap();
    let follower = LeaderWatch::start(&target, Duration::from_secs(2)).unwrap();
    let l = follower.leader(0, Duration::from_secs(5)).await.expect("a leader");
    assert_eq!((l.addr.as_str(), l.term), (a_addr.as_str(), lead_a.term()));

    // a lives (its address accepts connections): b waits while a keeps its lease, well past
    // one TTL.
    let waited = tokio::time::timeout(TTL * 2, b.wait_vacant(&seen, Duration::from_millis(100)));
    assert!(waited.await.is_err(), "b must not see a vacancy while a leads");
    assert!(lead_a.guard().is_valid());

    // a resigns: b takes over with a larger term, and the follower moves.
    let term_a = lead_a.term();
    lead_a.resign().await;
    let started = Instant::now();
    b.wait_vacant(&seen, Duration::from_millis(100)).await.unwrap();
    let Campaign::Won(lead_b) = b.try_lead().await.unwrap() else { panic!("b should win") };
    assert!(lead_b.term() > term_a);
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    let l = follower.leader(term_a + 1, Duration::from_secs(5)).await.expect("the new leader");
    assert_eq!((l.addr.as_str(), l.term), ("127.0.0.1:1", lead_b.term()));
    drop(listener);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_leaders_lease_is_revoked_before_its_ttl() {
    let s = EtcdServer::start();
    let long = Duration::from_secs(30);
    // The leader "dies": it holds the key but nothing listens at its address, and it stops
    // renewing (its keep-alive task goes with the dropped leadership... which would invalidate
    // nothing in etcd: the key stays under a 30 s lease).
    let a = Candidate::new(etcd(&s), "c", &dead_addr(), long).unwrap();
    let Campaign::Won(lead_a) = a.try_lead().await.unwrap() else { panic!() };
    std::mem::forget(lead_a);
    let b = Candidate::new(etcd(&s), "c", "127.0.0.1:9", long).unwrap();
    let Campaign::Lost(seen) = b.try_lead().await.unwrap() else { panic!() };
    let started = Instant::now();
    b.wait_vacant(&seen, Duration::from_millis(100)).await.unwrap();
    assert!(matches!(b.try_lead().await.unwrap(), Campaign::Won(_)));
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_from_etcd_stops_within_its_ttl_and_a_standby_takes_over() {
    let s = EtcdServer::start();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a =
        Candidate::new(etcd(&s), "c", &listener.local_addr().unwrap().to_string(), TTL).unwrap();
    let Campaign::Won(mut lead_a) = a.try_lead().await.unwrap() else { panic!() };
    let guard = lead_a.guard();
    // Stop etcd: the leader can no longer renew.
    let pid = s.pid() as i32;
    // SAFETY: signalling a child process of this test.
    unsafe { kill(pid, 19) };
    let started = Instant::now();
    while guard.is_valid() {
        assert!(started.elapsed() < TTL * 3, "the guard never lapsed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Before etcd could let anyone else lead: the lease runs a full TTL from its last renewal.
    assert!(started.elapsed() < TTL, "guard lapsed after {:?} (ttl {TTL:?})", started.elapsed());
    let why = tokio::time::timeout(TTL * 3, lead_a.lost()).await.expect("leadership lost");
    assert!(why.contains("renew") || why.contains("expired"), "{why}");
    // SAFETY: as above.
    unsafe { kill(pid, 18) };
    // After etcd resumes, the lease expires there too (or already has) and a standby wins.
    let b = Candidate::new(etcd(&s), "c", "127.0.0.1:9", TTL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match b.try_lead().await.unwrap() {
            Campaign::Won(l) => {
                assert!(l.term() > guard.term());
                break;
            }
            Campaign::Lost(kv) => {
                assert!(Instant::now() < deadline, "the old lease never expired");
                let _ = tokio::time::timeout(
                    Duration::from_secs(3),
                    b.wait_vacant(&kv, Duration::from_millis(100)),
                )
                .await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_and_bad_addresses_are_clear_errors() {
    let e = Etcd::new(vec![format!("http://{}", dead_addr())], Duration::from_millis(500)).unwrap();
    let err = e.lease_grant(2).await.unwrap_err().to_string();
    assert!(err.contains("unreachable"), "{err}");
    let err = Candidate::new(e, "c", "a:1", Duration::from_millis(500)).err().unwrap();
    assert!(err.to_string().contains("TTL"), "{err}");
}

unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
