//! A discrete-event replay of a request trace through a simulated disaggregated cluster,
//! routed by [`crate::route::Scheduler`] (`kvfs bench trace`'s simulation).
//!
//! # Model
//! `prefill_instances` prefill instances, each with a local prefix cache (GPU HBM) of
//! `local_cache_tokens`, `decode_instances` decode instances, and the pool: one shared
//! [`Cache`] of `pool_cache_tokens` (kvfs's DRAM tier across the cluster). Requests arrive at
//! the trace's timestamps divided by `speed`. At each arrival the simulator asks every cache
//! what it holds of the prompt, as the conductor's index would answer (per instance: its GPU
//! prefix, then continuing through the pool), and routes the request. An accepted request's
//! blocks enter its prefill instance's cache at once (queued requests run FIFO, so a later
//! request on that instance finds them) and the pool when its prefill ends (kvfs stores every
//! prefill's KV there). At the prefill's end its decode starts: its TBT is the cost model's for
//! the decode instance's load then ([`Scheduler::start_decode`]), which may differ from the
//! prediction made at routing (requests routed later may start decoding earlier).
//!
//! TTFT is measured from arrival to the prefill's end; an accepted request meets its SLOs when
//! both its TTFT and its TBT are within them; a rejected one never does. A *wasted prefill* is
//! an accepted request that misses either SLO: the prefill ran for nothing.
//!
//! # Not handled
//! The truth is the same cost model the scheduler predicts with (no noise), so predicted
//! TTFTs are exact and only TBTs can be mispredicted; output tokens are not cached; the pool
//! has one tier (DRAM).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::route::SchedulerConfig;
use crate::route::{CostModel, Decision, Policy, PrefixMatch, RouteRequest, Scheduler};
use crate::trace::{self, Cache, Capacity, Request};

/// The simulated cluster and its load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    pub prefill_instances: usize,
    pub decode_instances: usize,
    /// Arrival times are the trace's divided by this (2: twice the request rate).
    pub speed: f64,
    pub ttft_slo_ms: f64,
    pub tbt_slo_ms: f64,
    /// Each prefill instance's own prefix cache (GPU).
    pub local_cache_tokens: u64,
    /// The shared pool's cache.
    pub pool_cache_tokens: u64,
    pub cache_policy: trace::Policy,
    pub balancing_threshold: f64,
    pub seed: u64,
    pub cost: CostModel,
}

impl SimConfig {
    pub const DEFAULT: SimConfig = SimConfig {
        prefill_instances: 4,
        decode_instances: 2,
        speed: 1.0,
        ttft_slo_ms: 10_000.0,
        tbt_slo_ms: 50.0,
        local_cache_tokens: 500_000,
        pool_cache_tokens: 10_000_000,
        cache_policy: trace::Policy::Kvfs,
        balancing_threshold: 1.2,
        seed: 1,
        cost: CostModel::DEFAULT,
    };
}

/// The `speed` at which the requests' prefill work, all of it computed (no cache), would
/// keep `prefill_instances` busy `load` of the time over the trace's span: a load that means
/// the same on traces of different rates and lengths (0.9: 90% busy without a cache).
pub fn speed_for_load(requests: &[Request], cfg: &SimConfig, load: f64) -> f64 {
    let span_ms = match (requests.first(), requests.last()) {
        (Some(a), Some(b)) if b.timestamp_ms > a.timestamp_ms => {
            (b.timestamp_ms - a.timestamp_ms) as f64
        }
        _ => return 1.0,
    };
    let work_ms: f64 = requests.iter().map(|r| cfg.cost.prefill_ms(r.input_len, 0)).sum();
    load * cfg.prefill_instances as f64 * span_ms / work_ms
}

/// Figures of one simulated run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimStats {
    pub requests: u64,
    pub accepted: u64,
    pub rejected: u64,
    /// Accepted requests within both SLOs.
    pub slo_met: u64,
    /// Accepted requests that missed an SLO.
    pub wasted_prefills: u64,
    /// Over accepted requests.
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub tbt_p50_ms: f64,
    pub tbt_p99_ms: f64,
    /// Accepted requests whose actual TBT was over the prediction made at routing.
    pub tbt_underpredicted: u64,
    /// Prefill compute spent, and what it would have been with no cache (accepted requests).
    pub prefill_ms: f64,
    pub prefill_uncached_ms: f64,
    pub input_tokens: u64,
    /// Prompt tokens not recomputed (local or fetched).
    pub reused_tokens: u64,
    pub transfer_tokens: u64,
    pub fetches: u64,
    pub replicate_hints: u64,
}

impl SimStats {
    /// Requests served within both SLOs over all requests (rejected ones count as misses).
    pub fn slo_attainment(&self) -> f64 {
        ratio(self.slo_met as f64, self.requests as f64)
    }

    /// Share of the accepted requests' prefill compute avoided by cache hits.
    pub fn prefill_saved(&self) -> f64 {
        ratio(self.prefill_uncached_ms - self.prefill_ms, self.prefill_uncached_ms)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// Nearest-rank percentile of a sorted slice (0 when empty).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A prefill ending: the request's blocks enter the pool and its decode starts.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PrefillEnd {
    /// Bits of a non-negative f64 (ordered as the float), then arrival order.
    at: (u64, u64),
    request: usize,
    decode: usize,
    ticket: u64,
}

struct Served {
    ttft_ms: f64,
    predicted_tbt_ms: f64,
    tbt_ms: f64,
}

/// Replays `requests` (in timestamp order) under one routing policy.
pub fn simulate(
    requests: &[Request],
    policy: Policy,
    early_rejection: bool,
    cfg: &SimConfig,
) -> SimStats {
    let mut sched = Scheduler::new(SchedulerConfig {
        early_rejection,
        balancing_threshold: cfg.balancing_threshold,
        seed: cfg.seed,
        cost: cfg.cost,
        ..SchedulerConfig::new(cfg.prefill_instances, cfg.decode_instances, policy)
    });
    let local_capacity = Capacity::Tokens(cfg.local_cache_tokens);
    let mut local: Vec<Cache> =
        (0..cfg.prefill_instances).map(|_| Cache::new(cfg.cache_policy, local_capacity)).collect();
    let mut pool = Cache::new(cfg.cache_policy, Capacity::Tokens(cfg.pool_cache_tokens));
    let mut events: BinaryHeap<Reverse<PrefillEnd>> = BinaryHeap::new();
    let mut served: Vec<Option<Served>> = (0..requests.len()).map(|_| None).collect();
    let mut s = SimStats { requests: requests.len() as u64, ..SimStats::default() };
    let t0 = requests.first().map_or(0, |r| r.timestamp_ms);
    let mut matches = Vec::with_capacity(cfg.prefill_instances);

    for (i, r) in requests.iter().enumerate() {
        let now = (r.timestamp_ms - t0) as f64 / cfg.speed;
        while events.peek().is_some_and(|e| f64::from_bits(e.0.at.0) <= now) {
            let Reverse(e) = events.pop().expect("peeked");
            end_prefill(&e, requests, &mut pool, &mut sched, &mut served);
        }
        matches.clear();
        matches.extend(local.iter().map(|c| prefix_match(r, c, &pool)));
        let rr = RouteRequest::new(
            r.input_len,
            r.output_len,
            cfg.ttft_slo_ms,
            cfg.tbt_slo_ms,
            std::mem::take(&mut matches),
        );
        let d = sched.route(now, &rr);
        matches = rr.matches;
        let Decision::Accept {
            ticket,
            prefill,
            decode,
            predicted_ttft_ms,
            predicted_tbt_ms,
            prefix_tokens,
            transfer_tokens,
            fetch_from,
            replicate_hint,
            prefill_end_ms,
        } = d
        else {
            s.rejected += 1;
            continue;
        };
        local[prefill].access(r);
        s.accepted += 1;
        s.input_tokens += r.input_len;
        s.reused_tokens += prefix_tokens;
        s.transfer_tokens += transfer_tokens;
        s.fetches += u64::from(fetch_from.is_some());
        s.replicate_hints += u64::from(replicate_hint);
        s.prefill_ms += cfg.cost.prefill_ms(r.input_len, prefix_tokens);
        s.prefill_uncached_ms += cfg.cost.prefill_ms(r.input_len, 0);
        served[i] = Some(Served { ttft_ms: predicted_ttft_ms, predicted_tbt_ms, tbt_ms: 0.0 });
        let at = (prefill_end_ms.max(now).to_bits(), i as u64);
        events.push(Reverse(PrefillEnd { at, request: i, decode, ticket }));
    }
    while let Some(Reverse(e)) = events.pop() {
        end_prefill(&e, requests, &mut pool, &mut sched, &mut served);
    }

    let (mut ttft, mut tbt) = (Vec::new(), Vec::new());
    for x in served.iter().flatten() {
        ttft.push(x.ttft_ms);
        tbt.push(x.tbt_ms);
        if x.ttft_ms <= cfg.ttft_slo_ms && x.tbt_ms <= cfg.tbt_slo_ms {
            s.slo_met += 1;
        }
        s.tbt_underpredicted += u64::from(x.tbt_ms > x.predicted_tbt_ms + 1e-9);
    }
    s.wasted_prefills = s.accepted - s.slo_met;
    ttft.sort_by(f64::total_cmp);
    tbt.sort_by(f64::total_cmp);
    (s.ttft_p50_ms, s.ttft_p99_ms) = (percentile(&ttft, 50.0), percentile(&ttft, 99.0));
    (s.tbt_p50_ms, s.tbt_p99_ms) = (percentile(&tbt, 50.0), percentile(&tbt, 99.0));
    s
}

fn end_prefill(
    e: &PrefillEnd,
    requests: &[Request],
    pool: &mut Cache,
    sched: &mut Scheduler,
    served: &mut [Option<Served>],
) {
    let now = f64::from_bits(e.at.0);
    pool.access(&requests[e.request]);
    let tbt = sched.start_decode(now, e.decode, e.ticket).expect("a routed request decodes");
    if let Some(x) = &mut served[e.request] {
        x.tbt_ms = tbt;
    }
}

/// What the index would answer for one instance: its GPU prefix, then on through the pool.
fn prefix_match(r: &Request, gpu: &Cache, pool: &Cache) -> PrefixMatch {
    let g = r.blocks.iter().take_while(|b| gpu.contains(**b)).count();
    let c = g + r.blocks[g..].iter().take_while(|b| pool.contains(**b)).count();
    PrefixMatch { gpu: r.hit_tokens(g), cpu: r.hit_tokens(c), disk: r.hit_tokens(c) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::BLOCK_TOKENS;

    /// `n` requests every `gap_ms`: one of `prefixes` shared prompts of `prefix_blocks` blocks
    /// (prefix `k` with weight 1/(k+1), deterministic), then `suffix_blocks` unique blocks.
    fn synthetic(
        n: usize,
        gap_ms: u64,
        prefixes: u64,
        prefix_blocks: u64,
        suffix_blocks: u64,
    ) -> Vec<Request> {
        let mut x = 12345u64;
        let weights: Vec<f64> = (0..prefixes).map(|k| 1.0 / (k + 1) as f64).collect();
        let total: f64 = weights.iter().sum();
        (0..n)
            .map(|i| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut u = (x >> 11) as f64 / (1u64 << 53) as f64 * total;
                let k = weights
                    .iter()
                    .position(|w| {
                        u -= w;
                        u < 0.0
                    })
                    .unwrap_or(0) as u64;
                let mut blocks: Vec<u64> = (0..prefix_blocks).map(|b| k * 1000 + b).collect();
                blocks.extend((0..suffix_blocks).map(|b| 1_000_000 + i as u64 * 100 + b));
                Request {
                    timestamp_ms: i as u64 * gap_ms,
                    input_len: blocks.len() as u64 * BLOCK_TOKENS,
                    output_len: 100,
                    blocks,
                }
            })
            .collect()
    }

    fn small_cluster() -> SimConfig {
        SimConfig {
            prefill_instances: 4,
            decode_instances: 2,
            ttft_slo_ms: 3000.0,
            local_cache_tokens: 40 * BLOCK_TOKENS,
            ..SimConfig::DEFAULT
        }
    }

    #[test]
    fn global_cache_aware_beats_local_and_load_balance_on_a_shared_prefix_workload() {
        let reqs = synthetic(2000, 150, 8, 32, 4);
        let cfg = small_cluster();
        let mut att = Vec::new();
        for policy in Policy::ALL {
            for er in [false, true] {
                let s = simulate(&reqs, policy, er, &cfg);
                println!(
                    "{:>20} er={er:5} attainment {:.3} rejected {:>4} wasted {:>4} saved {:.3} ttft p99 {:.0}",
                    policy.name(),
                    s.slo_attainment(),
                    s.rejected,
                    s.wasted_prefills,
                    s.prefill_saved(),
                    s.ttft_p99_ms
                );
                assert_eq!(s.accepted + s.rejected, s.requests);
                assert!(er || s.rejected == 0);
                att.push((policy, er, s));
            }
        }
        let get = |p, er| &att.iter().find(|x| x.0 == p && x.1 == er).unwrap().2;
        for er in [false, true] {
            let g = get(Policy::GlobalCacheAware, er).slo_attainment();
            assert!(g > get(Policy::LocalCacheAware, er).slo_attainment(), "er={er}");
            assert!(g > get(Policy::LoadBalance, er).slo_attainment(), "er={er}");
        }
        for p in Policy::ALL {
            assert!(get(p, true).wasted_prefills <= get(p, false).wasted_prefills, "{p:?}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_figures() {
        let reqs = synthetic(500, 100, 5, 16, 4);
        let cfg = small_cluster();
        for policy in Policy::ALL {
            assert_eq!(simulate(&reqs, policy, true, &cfg), simulate(&reqs, policy, true, &cfg));
        }
        let other = SimConfig { seed: 99, ..cfg };
        assert_ne!(
            simulate(&reqs, Policy::Random, false, &cfg),
            simulate(&reqs, Policy::Random, false, &other)
        );
    }

    #[test]
    fn speed_for_load_scales_the_work_to_the_cluster() {
        let reqs = synthetic(101, 1000, 2, 8, 2); // 100 s, 101 x prefill_ms(5120, 0)
        let cfg = small_cluster();
        let work = 101.0 * cfg.cost.prefill_ms(10 * BLOCK_TOKENS, 0);
        let speed = speed_for_load(&reqs, &cfg, 0.5);
        assert!((speed - 0.5 * 4.0 * 100_000.0 / work).abs() < 1e-9, "{speed}");
    }

    #[test]
    fn an_idle_cluster_meets_every_slo() {
        let reqs = synthetic(50, 10_000, 2, 8, 2);
        for policy in Policy::ALL {
            let s = simulate(&reqs, policy, true, &small_cluster());
            assert_eq!((s.slo_met, s.rejected, s.wasted_prefills), (50, 0, 0), "{policy:?}");
            assert!((s.tbt_p99_ms - CostModel::DEFAULT.tbt_ms(1, 10 * 512 + 100)).abs() < 1e-9);
        }
        // The second request of a prefix reuses the first's KV under a cache-aware policy.
        let s = simulate(&reqs, Policy::GlobalCacheAware, true, &small_cluster());
        assert!(s.reused_tokens >= 48 * 8 * BLOCK_TOKENS, "{}", s.reused_tokens);
        assert!(s.prefill_saved() > 0.5);
    }
}
