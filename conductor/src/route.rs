//! Where to send a request: the FAST'25 Mooncake Conductor's cache- and load-aware scheduling
//! (its Algorithm 1) with early rejection, as a sans-IO state machine.
//!
//! # Mechanism
//! The caller tells [`Scheduler::route`] the time, the request's lengths and SLOs, and per
//! prefill instance how many prompt tokens it can serve from its own GPU cache and, continuing
//! from there, from the pool's CPU and disk tiers ([`PrefixMatch`]: cumulative, exactly what
//! [`crate::index::Index::query`] answers per owner, times the block size). The scheduler keeps
//! per prefill instance the time its queue drains (`busy_until`, FIFO) and per decode instance
//! the requests routed to it with their predicted decode start and end and KV tokens. It picks
//! a prefill instance by the policy, predicts TTFT = T_transfer + T_queue + T_prefill, picks
//! the decode instance with the least KV load *at the time the prefill ends*, predicts its TBT
//! for that load, and either rejects (early rejection: a predicted SLO miss) or accepts and
//! reserves: the prefill instance's queue grows by transfer + prefill, and the request joins
//! the decode instance from its prefill end to its predicted decode end.
//!
//! # Policies ([`Policy`])
//! - `Random`: a seeded uniform choice of both instances; the engine still reuses the chosen
//!   instance's own GPU prefix.
//! - `LoadBalance`: the prefill instance whose queue drains first (ties: lowest index); the
//!   cache is ignored for the choice (its own GPU prefix is still reused).
//! - `LocalCacheAware`: the instance minimising queue + prefill given its own GPU prefix; no
//!   transfers, no pool.
//! - `GlobalCacheAware` (Algorithm 1): `best_len` = the longest prefix any instance holds in
//!   GPU or the pool offers. For each instance: when `best_len / own_gpu_len >
//!   balancing_threshold` it may fetch instead (from the pool's CPU or disk tier, or from the
//!   GPU of the instance holding `best_len`, whichever option gives the lowest TTFT); the
//!   instance minimising TTFT wins. A fetch from another instance's GPU is a
//!   `replicate_hint`: a hot prefix whose holder is busier than a fetch costs.
//!
//! # Early rejection
//! Decode load is predicted at the chosen instance's prefill end: requests already routed
//! whose decode will have started by then and not yet ended, not the load now. Without early
//! rejection every request is accepted (and may miss its SLOs: a wasted prefill).
//!
//! # Not handled
//! The prediction trusts the cost model (no feedback from measured times); transfers occupy
//! the prefill instance before its prefill (no overlap with the queue or layer-wise
//! pipelining); a request's decode TBT is the load when it starts, later joiners are not
//! charged to it; chunked prefill and prefill/decode colocation are not modelled.

/// How long things take: a 70B-class dense model (80 layers, GQA with 8 KV heads of 128,
/// fp16 KV) on one 8-GPU node per instance, tensor parallel.
///
/// - Prefill of `u` uncached tokens after `p` cached ones (`n = p + u`):
///   `prefill_base_ms + prefill_ms_per_token * u + prefill_ms_per_token_ctx * u * (p + n) / 2`
///   (linear layers, plus causal attention over the mean context). At least one token is
///   always computed (the last one's logits).
/// - Transfer of `t` tokens: `t * kv_bytes_per_token / bandwidth`, the bandwidth of the
///   source: the pool's CPU DRAM over RDMA, its disk tier, or another instance's GPU.
/// - Decode TBT with `r` running requests holding `k` KV tokens:
///   `(decode_base_ms + decode_ms_per_request * r + decode_ms_per_kv_token * k) * max(1, k /
///   decode_kv_tokens_max)`: weight reads, per-request compute, KV reads, and past the KV
///   capacity a slowdown proportional to the overflow (preemption and swapping).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostModel {
    pub prefill_base_ms: f64,
    pub prefill_ms_per_token: f64,
    pub prefill_ms_per_token_ctx: f64,
    pub kv_bytes_per_token: f64,
    pub pool_cpu_bytes_per_ms: f64,
    pub pool_disk_bytes_per_ms: f64,
    pub remote_gpu_bytes_per_ms: f64,
    pub decode_base_ms: f64,
    pub decode_ms_per_request: f64,
    pub decode_ms_per_kv_token: f64,
    pub decode_kv_tokens_max: f64,
}

impl CostModel {
    /// 20k tokens/s of linear prefill (140 GFLOP/token at ~40% MFU of 8 H100s); attention
    /// 2.6 MFLOP per token and context token (0.8 ns); 320 KiB of KV per token (80 x 8 x 128
    /// x 2 x 2 bytes); 40 GB/s from the pool's DRAM, 8 GB/s from its NVMe, 100 GB/s between
    /// GPUs (8 x 200 Gb/s RDMA at about half); decode 12 ms per step for the weights, 0.05 ms
    /// per request, 20 us per 1000 KV tokens, 1M KV tokens of HBM (~330 GB).
    pub const DEFAULT: CostModel = CostModel {
        prefill_base_ms: 20.0,
        prefill_ms_per_token: 0.05,
        prefill_ms_per_token_ctx: 8e-7,
        kv_bytes_per_token: 327_680.0,
        pool_cpu_bytes_per_ms: 40e6,
        pool_disk_bytes_per_ms: 8e6,
        remote_gpu_bytes_per_ms: 100e6,
        decode_base_ms: 12.0,
        decode_ms_per_request: 0.05,
        decode_ms_per_kv_token: 2e-5,
        decode_kv_tokens_max: 1_000_000.0,
    };

    /// Checks that every figure is finite, bandwidths positive and the rest not negative.
    pub fn validate(&self) -> Result<(), String> {
        let rates = [
            ("pool_cpu_bytes_per_ms", self.pool_cpu_bytes_per_ms),
            ("pool_disk_bytes_per_ms", self.pool_disk_bytes_per_ms),
            ("remote_gpu_bytes_per_ms", self.remote_gpu_bytes_per_ms),
            ("decode_kv_tokens_max", self.decode_kv_tokens_max),
        ];
        for (name, v) in rates {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("cost model: {name} must be positive, not {v}"));
            }
        }
        let others = [
            ("prefill_base_ms", self.prefill_base_ms),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("prefill_ms_per_token_ctx", self.prefill_ms_per_token_ctx),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("decode_base_ms", self.decode_base_ms),
            ("decode_ms_per_request", self.decode_ms_per_request),
            ("decode_ms_per_kv_token", self.decode_ms_per_kv_token),
        ];
        for (name, v) in others {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "cost model: {name} must be a finite non-negative number, not {v}"
                ));
            }
        }
        Ok(())
    }

    /// Prefill of `input` tokens of which the first `cached` are in the instance's GPU.
    pub fn prefill_ms(&self, input: u64, cached: u64) -> f64 {
        let u = input.saturating_sub(cached).max(1) as f64;
        let p = input.saturating_sub(u as u64) as f64;
        self.prefill_base_ms
            + self.prefill_ms_per_token * u
            + self.prefill_ms_per_token_ctx * u * (p + p + u) / 2.0
    }

    /// Moving `tokens` of KV from `from`.
    pub fn transfer_ms(&self, tokens: u64, from: FetchFrom) -> f64 {
        let bw = match from {
            FetchFrom::PoolCpu => self.pool_cpu_bytes_per_ms,
            FetchFrom::PoolDisk => self.pool_disk_bytes_per_ms,
            FetchFrom::Instance(_) => self.remote_gpu_bytes_per_ms,
        };
        tokens as f64 * self.kv_bytes_per_token / bw
    }

    /// Time between tokens of a decode batch of `requests` holding `kv_tokens`.
    pub fn tbt_ms(&self, requests: usize, kv_tokens: u64) -> f64 {
        let k = kv_tokens as f64;
        let step = self.decode_base_ms
            + self.decode_ms_per_request * requests as f64
            + self.decode_ms_per_kv_token * k;
        step * (k / self.decode_kv_tokens_max).max(1.0)
    }
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::DEFAULT
    }
}

/// How many prompt tokens one prefill instance can reuse (cumulative: `gpu <= cpu <= disk`):
/// its own GPU prefix, then continuing through the pool's CPU tier, then its disk tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
}

/// One request to place.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRequest {
    pub input_len: u64,
    /// Expected output tokens (decode length).
    pub output_len: u64,
    pub ttft_slo_ms: f64,
    pub tbt_slo_ms: f64,
    /// Per prefill instance, in instance order; missing trailing entries mean no match.
    pub matches: Vec<PrefixMatch>,
    /// The prefill instances it may go to (those serving its model); empty: every one.
    pub prefill_candidates: Vec<usize>,
    /// The decode instances it may go to; empty: every one.
    pub decode_candidates: Vec<usize>,
}

impl RouteRequest {
    /// A request any instance may take.
    pub fn new(
        input_len: u64,
        output_len: u64,
        ttft_slo_ms: f64,
        tbt_slo_ms: f64,
        matches: Vec<PrefixMatch>,
    ) -> RouteRequest {
        RouteRequest {
            input_len,
            output_len,
            ttft_slo_ms,
            tbt_slo_ms,
            matches,
            prefill_candidates: Vec::new(),
            decode_candidates: Vec::new(),
        }
    }
}

/// Where a fetched prefix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchFrom {
    PoolCpu,
    PoolDisk,
    /// The GPU of this prefill instance.
    Instance(usize),
}

/// How the prefill instance is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Random,
    LoadBalance,
    LocalCacheAware,
    GlobalCacheAware,
}

impl Policy {
    pub const ALL: [Policy; 4] =
        [Policy::Random, Policy::LoadBalance, Policy::LocalCacheAware, Policy::GlobalCacheAware];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Random => "random",
            Policy::LoadBalance => "load-balance",
            Policy::LocalCacheAware => "local-cache-aware",
            Policy::GlobalCacheAware => "global-cache-aware",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        Policy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<_> = Policy::ALL.iter().map(|p| p.name()).collect();
            format!("unknown routing policy {s:?} ({})", names.join(", "))
        })
    }
}

/// Why a request was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Predicted TTFT over its SLO (checked first).
    Ttft,
    /// Predicted TBT at the prefill's end over its SLO.
    Tbt,
    /// No prefill or no decode instance to send it to (none known, or none among its
    /// candidates).
    NoInstance,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Accept {
        /// Identifies the request to [`Scheduler::start_decode`].
        ticket: u64,
        prefill: usize,
        decode: usize,
        predicted_ttft_ms: f64,
        predicted_tbt_ms: f64,
        /// Prompt tokens reused (local GPU plus fetched).
        prefix_tokens: u64,
        /// Tokens fetched into the prefill instance before its prefill.
        transfer_tokens: u64,
        fetch_from: Option<FetchFrom>,
        replicate_hint: bool,
        /// When the prefill (and so the first token) ends.
        prefill_end_ms: f64,
    },
    Reject {
        reason: RejectReason,
        predicted_ttft_ms: f64,
        predicted_tbt_ms: f64,
    },
}

/// Settings of a [`Scheduler`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    pub prefill_instances: usize,
    pub decode_instances: usize,
    pub policy: Policy,
    pub early_rejection: bool,
    /// Algorithm 1's `kvcache_balancing_threshold`: an instance considers fetching a longer
    /// prefix only when it is more than this many times its own.
    pub balancing_threshold: f64,
    /// Seed of `Policy::Random`.
    pub seed: u64,
    pub cost: CostModel,
}

impl SchedulerConfig {
    pub fn new(prefill_instances: usize, decode_instances: usize, policy: Policy) -> Self {
        SchedulerConfig {
            prefill_instances,
            decode_instances,
            policy,
            early_rejection: true,
            balancing_threshold: 1.2,
            seed: 1,
            cost: CostModel::DEFAULT,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Decoding {
    ticket: u64,
    start_ms: f64,
    end_ms: f64,
    kv_tokens: u64,
    output_len: u64,
}

/// The prefill choice for one instance.
#[derive(Debug, Clone, Copy)]
struct Plan {
    instance: usize,
    prefix: u64,
    transfer: u64,
    from: Option<FetchFrom>,
    transfer_ms: f64,
    queue_ms: f64,
    prefill_ms: f64,
}

impl Plan {
    fn ttft_ms(&self) -> f64 {
        self.transfer_ms + self.queue_ms + self.prefill_ms
    }
}

/// The scheduler's state (sans-IO, deterministic for a seed).
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    busy_until_ms: Vec<f64>,
    decoding: Vec<Vec<Decoding>>,
    next_ticket: u64,
    rng: u64,
}

impl Scheduler {
    /// A scheduler of `cfg`'s instances (there may be none yet: see
    /// [`Scheduler::add_prefill_instance`]).
    pub fn new(cfg: SchedulerConfig) -> Scheduler {
        Scheduler {
            busy_until_ms: vec![0.0; cfg.prefill_instances],
            decoding: vec![Vec::new(); cfg.decode_instances],
            next_ticket: 0,
            rng: cfg.seed,
            cfg,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// A new prefill instance, idle; returns its index.
    pub fn add_prefill_instance(&mut self) -> usize {
        self.busy_until_ms.push(0.0);
        self.cfg.prefill_instances += 1;
        self.cfg.prefill_instances - 1
    }

    /// A new decode instance, idle; returns its index.
    pub fn add_decode_instance(&mut self) -> usize {
        self.decoding.push(Vec::new());
        self.cfg.decode_instances += 1;
        self.cfg.decode_instances - 1
    }

    /// Predicted wait before a new request could start on prefill instance `i`.
    pub fn queue_ms(&self, now_ms: f64, i: usize) -> f64 {
        (self.busy_until_ms[i] - now_ms).max(0.0)
    }

    /// Requests and KV tokens decoding on instance `d` at time `t_ms`, as predicted now
    /// (started by then, not yet ended).
    pub fn decode_load_at(&self, d: usize, t_ms: f64) -> (usize, u64) {
        self.decoding[d]
            .iter()
            .filter(|r| r.start_ms <= t_ms && t_ms < r.end_ms)
            .fold((0, 0), |(n, k), r| (n + 1, k + r.kv_tokens))
    }

    /// Decides where `req` goes and, when accepted, reserves its prefill and decode.
    pub fn route(&mut self, now_ms: f64, req: &RouteRequest) -> Decision {
        self.retire(now_ms);
        let prefills = candidates(&req.prefill_candidates, self.cfg.prefill_instances);
        let decodes = candidates(&req.decode_candidates, self.cfg.decode_instances);
        if prefills.is_empty() || decodes.is_empty() {
            return Decision::Reject {
                reason: RejectReason::NoInstance,
                predicted_ttft_ms: f64::INFINITY,
                predicted_tbt_ms: f64::INFINITY,
            };
        }
        let plan = self.plan_prefill(now_ms, req, &prefills);
        let ttft = plan.ttft_ms();
        let prefill_end = now_ms + ttft;
        let decode = match self.cfg.policy {
            Policy::Random => decodes[self.next_random(decodes.len())],
            _ => *decodes
                .iter()
                .min_by_key(|&&d| self.decode_load_at(d, prefill_end).1)
                .expect("candidates are not empty"),
        };
        let (n, kv) = self.decode_load_at(decode, prefill_end);
        let kv_own = req.input_len + req.output_len;
        let tbt = self.cfg.cost.tbt_ms(n + 1, kv + kv_own);
        if self.cfg.early_rejection {
            let reason = if ttft > req.ttft_slo_ms {
                Some(RejectReason::Ttft)
            } else if tbt > req.tbt_slo_ms {
                Some(RejectReason::Tbt)
            } else {
                None
            };
            if let Some(reason) = reason {
                return Decision::Reject { reason, predicted_ttft_ms: ttft, predicted_tbt_ms: tbt };
            }
        }
        self.busy_until_ms[plan.instance] = prefill_end;
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.decoding[decode].push(Decoding {
            ticket,
            start_ms: prefill_end,
            end_ms: prefill_end + tbt * req.output_len as f64,
            kv_tokens: kv_own,
            output_len: req.output_len,
        });
        Decision::Accept {
            ticket,
            prefill: plan.instance,
            decode,
            predicted_ttft_ms: ttft,
            predicted_tbt_ms: tbt,
            prefix_tokens: plan.prefix,
            transfer_tokens: plan.transfer,
            fetch_from: plan.from,
            replicate_hint: matches!(plan.from, Some(FetchFrom::Instance(_))),
            prefill_end_ms: prefill_end,
        }
    }

    /// The request's decode starts now on instance `decode`: its TBT for the load there now
    /// (every request routed so far that is decoding now, itself included), and its end
    /// moved accordingly. `None` for an unknown or retired ticket.
    pub fn start_decode(&mut self, now_ms: f64, decode: usize, ticket: u64) -> Option<f64> {
        let (n, kv) = self.decode_load_at(decode, now_ms);
        let r = self.decoding[decode].iter_mut().find(|r| r.ticket == ticket)?;
        // The request itself is counted by decode_load_at once its start is now or earlier.
        let (n, kv) = if r.start_ms <= now_ms && now_ms < r.end_ms {
            (n, kv)
        } else {
            (n + 1, kv + r.kv_tokens)
        };
        let tbt = self.cfg.cost.tbt_ms(n, kv);
        r.start_ms = now_ms;
        r.end_ms = now_ms + tbt * r.output_len as f64;
        Some(tbt)
    }

    /// Forgets decodes that ended by `now_ms`.
    pub fn retire(&mut self, now_ms: f64) {
        for d in &mut self.decoding {
            d.retain(|r| r.end_ms > now_ms);
        }
    }

    fn plan_prefill(&mut self, now_ms: f64, req: &RouteRequest, cands: &[usize]) -> Plan {
        let m = |i: usize| req.matches.get(i).copied().unwrap_or_default();
        let local = |s: &Scheduler, i: usize| {
            let gpu = m(i).gpu.min(req.input_len);
            Plan {
                instance: i,
                prefix: gpu,
                transfer: 0,
                from: None,
                transfer_ms: 0.0,
                queue_ms: s.queue_ms(now_ms, i),
                prefill_ms: s.cfg.cost.prefill_ms(req.input_len, gpu),
            }
        };
        let by_ttft = |a: &Plan, b: &Plan| a.ttft_ms().total_cmp(&b.ttft_ms());
        let none = "candidates are not empty";
        match self.cfg.policy {
            Policy::Random => {
                let i = cands[self.next_random(cands.len())];
                local(self, i)
            }
            Policy::LoadBalance => {
                let i = *cands
                    .iter()
                    .min_by(|&&a, &&b| self.busy_until_ms[a].total_cmp(&self.busy_until_ms[b]))
                    .expect(none);
                local(self, i)
            }
            Policy::LocalCacheAware => {
                cands.iter().map(|&i| local(self, i)).min_by(by_ttft).expect(none)
            }
            Policy::GlobalCacheAware => cands
                .iter()
                .map(|&i| self.global_plan(now_ms, req, i, local(self, i)))
                .min_by(by_ttft)
                .expect(none),
        }
    }

    /// Algorithm 1 for instance `i`: its own GPU prefix, or, when the best prefix reachable
    /// is more than `balancing_threshold` times longer, the cheapest fetch of a longer one.
    fn global_plan(&self, now_ms: f64, req: &RouteRequest, i: usize, own: Plan) -> Plan {
        let cost = &self.cfg.cost;
        let m = req.matches.get(i).copied().unwrap_or_default();
        let (holder, holder_gpu) = req
            .matches
            .iter()
            .enumerate()
            .take(self.cfg.prefill_instances)
            .map(|(j, x)| (j, x.gpu.min(req.input_len)))
            .max_by_key(|&(j, g)| (g, std::cmp::Reverse(j)))
            .unwrap_or((i, 0));
        let mut options = vec![
            (m.cpu.min(req.input_len), FetchFrom::PoolCpu),
            (m.disk.min(req.input_len), FetchFrom::PoolDisk),
        ];
        if holder != i {
            options.push((holder_gpu, FetchFrom::Instance(holder)));
        }
        let best_len = options.iter().map(|o| o.0).max().unwrap_or(0);
        if (best_len as f64) <= self.cfg.balancing_threshold * own.prefix as f64 {
            return own;
        }
        let mut best = own;
        for (len, from) in options {
            if len <= own.prefix {
                continue;
            }
            // The pool's disk prefix continues through its CPU tier: the CPU part comes at
            // CPU speed, the rest at disk speed.
            let transfer_ms = match from {
                FetchFrom::PoolDisk => {
                    let cpu = m.cpu.min(len).max(own.prefix);
                    cost.transfer_ms(cpu - own.prefix, FetchFrom::PoolCpu)
                        + cost.transfer_ms(len - cpu, FetchFrom::PoolDisk)
                }
                _ => cost.transfer_ms(len - own.prefix, from),
            };
            let p = Plan {
                instance: i,
                prefix: len,
                transfer: len - own.prefix,
                from: Some(from),
                transfer_ms,
                queue_ms: self.queue_ms(now_ms, i),
                prefill_ms: cost.prefill_ms(req.input_len, len),
            };
            if p.ttft_ms() < best.ttft_ms() {
                best = p;
            }
        }
        best
    }

    /// splitmix64, uniform enough below `n` for a baseline.
    fn next_random(&mut self, n: usize) -> usize {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z % n as u64) as usize
    }
}

/// The instances below `n` of `given`, or all of them when `given` is empty.
fn candidates(given: &[usize], n: usize) -> Vec<usize> {
    if given.is_empty() {
        (0..n).collect()
    } else {
        given.iter().copied().filter(|&i| i < n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input_len: u64, matches: Vec<PrefixMatch>) -> RouteRequest {
        RouteRequest::new(input_len, 100, 1e9, 1e9, matches)
    }

    fn gpu(t: u64) -> PrefixMatch {
        PrefixMatch { gpu: t, cpu: t, disk: t }
    }

    fn accept(d: &Decision) -> (usize, usize, f64, f64, u64, Option<FetchFrom>) {
        match *d {
            Decision::Accept {
                prefill,
                decode,
                predicted_ttft_ms,
                predicted_tbt_ms,
                transfer_tokens,
                fetch_from,
                ..
            } => {
                (prefill, decode, predicted_ttft_ms, predicted_tbt_ms, transfer_tokens, fetch_from)
            }
            ref r => panic!("rejected: {r:?}"),
        }
    }

    #[test]
    fn the_cost_model_is_as_documented() {
        let c = CostModel::DEFAULT;
        // 10k uncached tokens: 20 + 500 + 0.8e-6 * 1e4 * 1e4 / 2 = 560 ms.
        assert!((c.prefill_ms(10_000, 0) - 560.0).abs() < 1e-9);
        // A full hit still computes one token.
        assert!(c.prefill_ms(10_000, 10_000) < 30.0);
        // 10k tokens from the pool's DRAM: 3.2768 GB at 40 GB/s.
        assert!((c.transfer_ms(10_000, FetchFrom::PoolCpu) - 81.92).abs() < 1e-9);
        assert!((c.tbt_ms(10, 500_000) - (12.0 + 0.5 + 10.0)).abs() < 1e-9);
        assert!((c.tbt_ms(10, 2_000_000) - (12.0 + 0.5 + 40.0) * 2.0).abs() < 1e-9);
    }

    #[test]
    fn equal_queues_go_to_the_cached_prefix() {
        for policy in [Policy::LocalCacheAware, Policy::GlobalCacheAware] {
            let mut s = Scheduler::new(SchedulerConfig::new(3, 1, policy));
            let d = s.route(0.0, &req(8192, vec![gpu(0), gpu(4096), gpu(1024)]));
            let (prefill, _, ttft, _, transfer, _) = accept(&d);
            assert_eq!((prefill, transfer), (1, 0), "{policy:?}");
            assert!((ttft - CostModel::DEFAULT.prefill_ms(8192, 4096)).abs() < 1e-9);
        }
        // Load balancing ignores the cache.
        let mut s = Scheduler::new(SchedulerConfig::new(3, 1, Policy::LoadBalance));
        assert_eq!(accept(&s.route(0.0, &req(8192, vec![gpu(0), gpu(4096)]))).0, 0);
    }

    #[test]
    fn a_long_queue_outweighs_the_cached_prefix() {
        let mut s = Scheduler::new(SchedulerConfig::new(2, 1, Policy::LocalCacheAware));
        // Fill instance 1 with 3 s of work (no cache anywhere: it goes to 0 first, then 1).
        for _ in 0..2 {
            s.route(0.0, &req(50_000, vec![]));
        }
        assert!(s.queue_ms(0.0, 0) > 2000.0 && s.queue_ms(0.0, 1) > 2000.0);
        let mut s = Scheduler::new(SchedulerConfig::new(2, 1, Policy::LocalCacheAware));
        assert_eq!(accept(&s.route(0.0, &req(50_000, vec![gpu(0), gpu(0)]))).0, 0);
        // Instance 0 has half the prompt cached but a queue longer than the prefill saved.
        let (i, ..) = accept(&s.route(0.0, &req(8192, vec![gpu(4096), gpu(0)])));
        assert_eq!(i, 1);
        // A short queue does not: the same request a while later goes to the cache.
        let mut s2 = Scheduler::new(SchedulerConfig::new(2, 1, Policy::LocalCacheAware));
        s2.route(0.0, &req(1000, vec![]));
        assert_eq!(accept(&s2.route(0.0, &req(8192, vec![gpu(4096), gpu(0)]))).0, 0);
    }

    #[test]
    fn global_fetches_the_best_prefix_when_its_holder_is_busy() {
        let mut s = Scheduler::new(SchedulerConfig::new(2, 1, Policy::GlobalCacheAware));
        s.route(0.0, &req(60_000, vec![])); // instance 0 busy for seconds
        let d = s.route(0.0, &req(20_000, vec![gpu(16_384), gpu(0)]));
        let (i, _, ttft, _, transfer, from) = accept(&d);
        assert_eq!((i, transfer, from), (1, 16_384, Some(FetchFrom::Instance(0))));
        let c = CostModel::DEFAULT;
        let expect = c.transfer_ms(16_384, FetchFrom::Instance(0)) + c.prefill_ms(20_000, 16_384);
        assert!((ttft - expect).abs() < 1e-9);
        assert!(matches!(d, Decision::Accept { replicate_hint: true, .. }));
        // The pool's DRAM prefix counts too, for any instance.
        let mut s = Scheduler::new(SchedulerConfig::new(2, 1, Policy::GlobalCacheAware));
        let pool = PrefixMatch { gpu: 0, cpu: 16_384, disk: 16_384 };
        let (_, _, _, _, transfer, from) = accept(&s.route(0.0, &req(20_000, vec![pool, pool])));
        assert_eq!((transfer, from), (16_384, Some(FetchFrom::PoolCpu)));
        // Below the balancing threshold an instance keeps its own prefix.
        let mut s = Scheduler::new(SchedulerConfig::new(1, 1, Policy::GlobalCacheAware));
        let near = PrefixMatch { gpu: 10_000, cpu: 11_000, disk: 11_000 };
        assert_eq!(accept(&s.route(0.0, &req(20_000, vec![near]))).4, 0);
    }

    #[test]
    fn rejects_when_ttft_cannot_be_met() {
        let mut cfg = SchedulerConfig::new(1, 1, Policy::GlobalCacheAware);
        let mut s = Scheduler::new(cfg);
        let mut r = req(20_000, vec![]);
        r.ttft_slo_ms = 1500.0;
        assert!(matches!(s.route(0.0, &r), Decision::Accept { .. }));
        // The second waits behind the first: over its SLO.
        let d = s.route(0.0, &r);
        assert!(matches!(d, Decision::Reject { reason: RejectReason::Ttft, predicted_ttft_ms, .. }
            if predicted_ttft_ms > 1500.0));
        // A rejection reserved nothing; without early rejection it is accepted.
        assert!(s.queue_ms(0.0, 0) < 1500.0);
        cfg.early_rejection = false;
        let mut s = Scheduler::new(cfg);
        s.route(0.0, &r);
        assert!(accept(&s.route(0.0, &r)).2 > 1500.0);
    }

    /// Three requests that decode 1.2M KV tokens for ever, starting 20-40 ms after `at_ms`.
    fn fill_decode(s: &mut Scheduler, at_ms: f64) {
        let mut r = req(400_000, vec![gpu(400_000), gpu(400_000)]);
        r.output_len = 1_000_000;
        for _ in 0..3 {
            let d = s.route(at_ms, &r);
            assert!(matches!(d, Decision::Accept { .. }));
        }
    }

    #[test]
    fn early_rejection_uses_the_decode_load_when_the_prefill_ends() {
        let cost = CostModel::DEFAULT;
        let mut r = req(40_000, vec![]);
        r.tbt_slo_ms = 40.0;
        assert!(cost.tbt_ms(1, 40_100) < 40.0, "alone it meets the SLO");
        assert!(cost.tbt_ms(4, 1_240_100) > 40.0, "with the three it does not");
        // Current load is nil, but three routed requests will be decoding before the 40k-token
        // prefill ends: rejected on TBT though the decode instance is idle now.
        let mut s = Scheduler::new(SchedulerConfig::new(2, 1, Policy::LoadBalance));
        fill_decode(&mut s, 0.0);
        assert_eq!(s.decode_load_at(0, 0.0), (0, 0));
        match s.route(0.0, &r) {
            Decision::Reject { reason: RejectReason::Tbt, predicted_tbt_ms, .. } => {
                assert!(predicted_tbt_ms > 40.0)
            }
            d => panic!("{d:?}"),
        }
        // Vice versa: the decode instance is full now, but those requests end before the
        // prefill does.
        let mut s = Scheduler::new(SchedulerConfig::new(1, 1, Policy::LoadBalance));
        let mut short = req(400_000, vec![gpu(400_000)]);
        short.output_len = 10;
        for _ in 0..3 {
            assert!(matches!(s.route(0.0, &short), Decision::Accept { .. }));
        }
        let now = s.decoding[0].iter().map(|d| d.start_ms).fold(0.0, f64::max);
        assert_eq!(s.decode_load_at(0, now), (3, 1_200_030));
        let (.., tbt, _, _) = accept(&s.route(now, &r));
        assert!((tbt - cost.tbt_ms(1, 40_100)).abs() < 1e-9, "{tbt}");
    }

    #[test]
    fn start_decode_charges_the_load_then() {
        let mut s = Scheduler::new(SchedulerConfig::new(1, 1, Policy::LoadBalance));
        let Decision::Accept { ticket, prefill_end_ms, predicted_tbt_ms, .. } =
            s.route(0.0, &req(1000, vec![]))
        else {
            panic!()
        };
        let tbt = s.start_decode(prefill_end_ms, 0, ticket).unwrap();
        assert!((tbt - predicted_tbt_ms).abs() < 1e-9);
        s.retire(1e12);
        assert_eq!(s.start_decode(1e12, 0, ticket), None);
    }

    #[test]
    fn candidates_limit_the_choice_and_instances_can_join() {
        let mut s = Scheduler::new(SchedulerConfig::new(0, 0, Policy::GlobalCacheAware));
        let r = req(8192, vec![]);
        assert!(matches!(
            s.route(0.0, &r),
            Decision::Reject { reason: RejectReason::NoInstance, .. }
        ));
        for _ in 0..3 {
            s.add_prefill_instance();
        }
        assert_eq!(s.add_decode_instance(), 0);
        assert_eq!(s.add_decode_instance(), 1);
        // Instance 1 holds the prompt, but only 0 and 2 serve this request's model; the GPU
        // prefix of 1 may still be fetched.
        let mut r = req(8192, vec![gpu(0), gpu(8192), gpu(0)]);
        r.prefill_candidates = vec![2, 0];
        r.decode_candidates = vec![1];
        let (p, d, _, _, transfer, from) = accept(&s.route(0.0, &r));
        assert!(p == 0 || p == 2);
        assert_eq!((d, transfer, from), (1, 8192, Some(FetchFrom::Instance(1))));
        // Unknown candidates are no candidates.
        r.decode_candidates = vec![7];
        assert!(matches!(
            s.route(0.0, &r),
            Decision::Reject { reason: RejectReason::NoInstance, .. }
        ));
    }

    #[test]
    fn the_same_seed_routes_the_same_way() {
        let run = |seed| {
            let mut cfg = SchedulerConfig::new(4, 3, Policy::Random);
            cfg.seed = seed;
            let mut s = Scheduler::new(cfg);
            (0..200)
                .map(|i| {
                    let d = s.route(i as f64 * 100.0, &req(5000 + i * 37, vec![gpu(i % 5 * 512)]));
                    let (p, d, ..) = accept(&d);
                    (p, d)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let spread: std::collections::HashSet<_> = run(7).iter().map(|x| x.0).collect();
        assert_eq!(spread.len(), 4);
    }
}
