//! kvfs-ep: Mixture-of-Experts dispatch and combine over kvfs-pg.
//!
//! Layout. Experts `0..E` are split evenly over `R` rank slots: slot `r` holds experts
//! `r*E/R .. (r+1)*E/R`, its *local* experts. [`dispatch`] sends each token once to every slot
//! holding at least one of its top-k experts (one alltoallv on the PG, each message carrying
//! the tokens' rows and which of the destination's experts each one chose), and the receiver
//! places a row for each chosen local expert: expert `e`'s tokens from source slot `s` fill
//! rows `s*M ..` of its `[R*M, H]` block (`M`: the most tokens a rank may dispatch), in source
//! token order (the DeepEP low-latency layout). [`combine`] sends each source the weighted sum
//! of its token over the destination's chosen experts, one row per (token, destination), after
//! a small round that carries the weights there; the source adds the rows in slot order, in
//! f32, so results are the same bits on every run.
//!
//! Failures. Experts of slots the caller marks inactive, or that the PG's view no longer has,
//! are dropped from routing (their share of a token's weighted sum is left out). A slot that
//! fails during an exchange is removed by the PG's coordinator; the exchange runs again over
//! the survivors (at most [`ATTEMPTS`] times) and the caller's mask is updated. Every exchange
//! ends within the PG's operation deadline.

use half::bf16;
use kvfs_pg::{DType, Error, ErrorKind, Group, Result};

/// Exchanges tried before a failure is returned (each one after a view change).
pub const ATTEMPTS: usize = 4;

const MAGIC: u32 = 0x5045_564b; // "KVEP"
const HEADER: usize = 32;
/// Header flag: each token's top-k weights follow its choices.
const WITH_WEIGHTS: u32 = 1;

/// The shape of a dispatch, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpConfig {
    /// `E`: experts in the model.
    pub num_experts: u32,
    /// `R`: rank slots the experts are spread over (the PG's world).
    pub num_ranks: u32,
    /// `H`: elements per token row.
    pub hidden: usize,
    /// `K`: experts chosen per token.
    pub topk: usize,
    /// `M`: the most tokens one rank may dispatch in a call.
    pub max_tokens: usize,
    /// Element type of the rows: float32 or bfloat16.
    pub dtype: DType,
}

impl EpConfig {
    pub fn local_experts(&self) -> usize {
        (self.num_experts / self.num_ranks) as usize
    }

    fn row_bytes(&self) -> usize {
        self.hidden * self.dtype.size()
    }

    /// Bytes of a dispatch's output: `[E_local, R*M, H]`.
    pub fn recv_bytes(&self) -> usize {
        self.local_experts() * self.num_ranks as usize * self.max_tokens * self.row_bytes()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |d: String| Err(Error::new(ErrorKind::InvalidArgument, "ep", d));
        if self.num_ranks == 0
            || self.num_experts == 0
            || !self.num_experts.is_multiple_of(self.num_ranks)
        {
            return bad(format!(
                "num_experts {} must be a positive multiple of num_ranks {}",
                self.num_experts, self.num_ranks
            ));
        }
        if self.hidden == 0 || self.topk == 0 || self.max_tokens == 0 {
            return bad("hidden, topk and max_tokens must be positive".into());
        }
        if self.local_experts() > u16::MAX as usize || self.max_tokens > u32::MAX as usize / 2 {
            return bad("too many local experts or tokens".into());
        }
        if !matches!(self.dtype, DType::F32 | DType::BF16) {
            return bad(format!("dtype {} (float32 or bfloat16)", self.dtype.name()));
        }
        Ok(())
    }
}

/// What [`combine`] needs of a dispatch.
#[derive(Debug, Clone)]
pub struct Handle {
    cfg: EpConfig,
    /// The PG epoch and active slots the exchange ran over (the alltoallv's rank order).
    pub epoch: u64,
    pub slots: Vec<u32>,
    /// Tokens this rank dispatched.
    pub tokens: usize,
    /// Per local expert: (source slot, source token) of each filled row, in row order.
    pub layout: Vec<Vec<(u32, u32)>>,
    /// Per rank index of `slots`: the tokens sent there, with the top-k positions they chose
    /// there, in message order.
    sent: Vec<Vec<(u32, Vec<u8>)>>,
    /// Per rank index of `slots`: the tokens received from there: per token, (local expert,
    /// row, weight) of each choice, in the sender's top-k order (weights 0 when the dispatch
    /// carried none).
    recv: Vec<Vec<Vec<(u16, u32, f32)>>>,
    /// The `[T, K]` weights the dispatch carried, if it did: a combine with the same weights
    /// needs no round to carry them.
    weights: Option<Vec<f32>>,
    /// Whether every source of the exchange (this rank too) sent its weights.
    all_weighted: bool,
}

/// A dispatch's result.
pub struct Dispatched {
    /// `[E_local, R*M, H]` rows of the config's dtype; rows not filled are zero.
    pub x: Vec<u8>,
    /// Tokens received per local expert.
    pub counts: Vec<u32>,
    pub handle: Handle,
}

fn expert_slot(cfg: &EpConfig, e: i64) -> Option<(u32, u16)> {
    if e < 0 {
        return None;
    }
    let local = cfg.local_experts() as i64;
    Some(((e / local) as u32, (e % local) as u16))
}

/// Marks slots outside `slots` inactive; returns whether slot `r` takes part.
fn refresh_mask(active: &mut [bool], slots: &[u32]) {
    for (r, a) in active.iter_mut().enumerate() {
        if !slots.contains(&(r as u32)) {
            *a = false;
        }
    }
}

fn check_inputs(cfg: &EpConfig, x_len: usize, topk: &[i64], active: &[bool]) -> Result<usize> {
    cfg.validate()?;
    let bad = |d: String| Err(Error::new(ErrorKind::InvalidArgument, "dispatch", d));
    if !x_len.is_multiple_of(cfg.row_bytes()) {
        return bad(format!("x is {x_len} bytes, not a multiple of a row ({})", cfg.row_bytes()));
    }
    let t = x_len / cfg.row_bytes();
    if topk.len() != t * cfg.topk {
        return bad(format!(
            "topk_idx has {} entries for {t} tokens of top-{}",
            topk.len(),
            cfg.topk
        ));
    }
    if active.len() != cfg.num_ranks as usize {
        return bad(format!(
            "active_ranks has {} entries for {} ranks",
            active.len(),
            cfg.num_ranks
        ));
    }
    if let Some(e) = topk.iter().find(|&&e| e < -1 || e >= cfg.num_experts as i64) {
        return bad(format!("expert {e} is outside 0..{} (or -1 to mask)", cfg.num_experts));
    }
    Ok(t)
}

/// Routes this rank's tokens `x` (`[T, H]`) to the experts `topk` (`[T, K]`, -1 masks a
/// choice) names, over the group's active slots that `active` (`[R]`) allows; `active` is
/// updated with the slots the exchange could not include. `weights` (`[T, K]`, optional, as
/// DeepEP's normal dispatch takes them) travel with the tokens, 4 bytes a choice, so the
/// combine that uses the same weights skips the round that would carry them.
pub async fn dispatch(
    group: &Group,
    cfg: &EpConfig,
    x: &[u8],
    topk: &[i64],
    weights: Option<&[f32]>,
    active: &mut [bool],
) -> Result<Dispatched> {
    let mut out = vec![0u8; cfg.recv_bytes()];
    let (counts, handle) = dispatch_into(group, cfg, x, topk, weights, active, &mut out).await?;
    Ok(Dispatched { x: out, counts, handle })
}

/// As [`dispatch`], into `out` (`EpConfig::recv_bytes` long, zeroed by the caller: only the
/// rows received are written, so fresh zeroed memory is touched only where tokens land).
/// Returns the counts per local expert and the handle.
pub async fn dispatch_into(
    group: &Group,
    cfg: &EpConfig,
    x: &[u8],
    topk: &[i64],
    weights: Option<&[f32]>,
    active: &mut [bool],
    out: &mut [u8],
) -> Result<(Vec<u32>, Handle)> {
    let t = check_inputs(cfg, x.len(), topk, active)?;
    if let Some(w) = weights
        && w.len() != topk.len()
    {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "dispatch",
            format!("{} weights for {} top-k choices", w.len(), topk.len()),
        ));
    }
    let flags = if weights.is_some() { WITH_WEIGHTS } else { 0 };
    if out.len() != cfg.recv_bytes() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "dispatch",
            format!("the output holds {} bytes, {} needed", out.len(), cfg.recv_bytes()),
        ));
    }
    let (k, rb) = (cfg.topk, cfg.row_bytes());
    // Too many tokens: the exchange still runs (with the count alone), so the peers fail at
    // once with `Mismatch` instead of waiting for this rank into their deadline.
    let over = t > cfg.max_tokens;
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let before = group.epoch();
        refresh_mask(active, &group.active());
        let mask = active.to_vec();
        let build = |slots: &[u32]| -> (Vec<u8>, Vec<u64>) {
            let mut all = Vec::new();
            let mut lens = Vec::with_capacity(slots.len());
            for &dst in slots {
                let m = &mut all;
                let start = m.len();
                {
                    let mut chosen: Vec<(u32, Vec<i32>)> = Vec::new();
                    for tok in (0..t).filter(|_| !over) {
                        let mut here = vec![-1i32; k];
                        let mut any = false;
                        for (j, h) in here.iter_mut().enumerate() {
                            if let Some((s, le)) = expert_slot(cfg, topk[tok * k + j])
                                && s == dst
                                && mask.get(s as usize).copied().unwrap_or(false)
                            {
                                *h = le as i32;
                                any = true;
                            }
                        }
                        if any {
                            chosen.push((tok as u32, here));
                        }
                    }
                    let wb = if weights.is_some() { 4 * k } else { 0 };
                    m.reserve(HEADER + chosen.len() * (4 + 4 * k + wb + rb));
                    for v in [
                        MAGIC,
                        cfg.max_tokens as u32,
                        cfg.hidden as u32,
                        k as u32,
                        cfg.num_experts,
                        cfg.num_ranks,
                        if over { t as u32 } else { chosen.len() as u32 },
                        flags,
                    ] {
                        m.extend_from_slice(&v.to_le_bytes());
                    }
                    for (tok, here) in &chosen {
                        m.extend_from_slice(&tok.to_le_bytes());
                        for h in here {
                            m.extend_from_slice(&h.to_le_bytes());
                        }
                        if let Some(w) = weights {
                            let at = *tok as usize * k;
                            for v in &w[at..at + k] {
                                m.extend_from_slice(&v.to_le_bytes());
                            }
                        }
                    }
                    for (tok, _) in &chosen {
                        let a = *tok as usize * rb;
                        m.extend_from_slice(&x[a..a + rb]);
                    }
                }
                lens.push((all.len() - start) as u64);
            }
            (all, lens)
        };
        match group.alltoallv_with(build).await {
            Ok(_) if over => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "dispatch",
                    format!(
                        "{t} tokens exceed max_tokens {} (the receive buffers hold that many per rank)",
                        cfg.max_tokens
                    ),
                ));
            }
            Ok((slots, data, lens)) => {
                let got = split(&data, &lens);
                let sent = slots
                    .iter()
                    .map(|&dst| {
                        (0..t)
                            .filter_map(|tok| {
                                let ks: Vec<u8> = (0..k)
                                    .filter(|&j| {
                                        expert_slot(cfg, topk[tok * k + j]).is_some_and(|(s, _)| {
                                            s == dst
                                                && mask.get(s as usize).copied().unwrap_or(false)
                                        })
                                    })
                                    .map(|j| j as u8)
                                    .collect();
                                (!ks.is_empty()).then_some((tok as u32, ks))
                            })
                            .collect()
                    })
                    .collect();
                refresh_mask(active, &slots);
                let (counts, mut h) = place(cfg, group.epoch(), slots, got, sent, t, out)?;
                h.weights = weights.map(<[f32]>::to_vec);
                return Ok((counts, h));
            }
            Err(e) if group.epoch() != before && e.kind() != ErrorKind::InvalidArgument => {
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::PeerFailed, "dispatch", "no attempt ran")))
}

/// Consecutive messages of `lens` bytes.
fn split<'a>(data: &'a [u8], lens: &[u64]) -> Vec<&'a [u8]> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            let m = &data[at..at + l as usize];
            at += l as usize;
            m
        })
        .collect()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Places the received messages into the `[E_local, R*M, H]` output.
fn place(
    cfg: &EpConfig,
    epoch: u64,
    slots: Vec<u32>,
    got: Vec<&[u8]>,
    sent: Vec<Vec<(u32, Vec<u8>)>>,
    tokens: usize,
    x: &mut [u8],
) -> Result<(Vec<u32>, Handle)> {
    let (k, rb, el, m) = (cfg.topk, cfg.row_bytes(), cfg.local_experts(), cfg.max_tokens);
    let block = cfg.num_ranks as usize * m * rb;
    let mut counts = vec![0u32; el];
    let mut layout = vec![Vec::new(); el];
    let mut recv = Vec::with_capacity(slots.len());
    let mut all_weighted = true;
    for (&src, msg) in slots.iter().zip(&got) {
        let mismatch = |d: String| Error::new(ErrorKind::Mismatch, "dispatch", d);
        if msg.len() < HEADER || u32_at(msg, 0) != MAGIC {
            return Err(mismatch(format!(
                "slot {src} sent {} bytes that are not a dispatch",
                msg.len()
            )));
        }
        let theirs: Vec<u32> = (1..8).map(|i| u32_at(msg, 4 * i)).collect();
        let mine =
            [cfg.max_tokens as u32, cfg.hidden as u32, k as u32, cfg.num_experts, cfg.num_ranks];
        if theirs[..5] != mine {
            return Err(mismatch(format!(
                "slot {src} dispatches with (max_tokens, hidden, topk, experts, ranks) {:?}, this rank with {mine:?}",
                &theirs[..5]
            )));
        }
        let n = theirs[5] as usize;
        let with_weights = theirs[6] & WITH_WEIGHTS != 0;
        all_weighted &= with_weights;
        let meta = 4 + 4 * k + if with_weights { 4 * k } else { 0 };
        if n > m {
            return Err(mismatch(format!(
                "slot {src} dispatches {n} tokens, more than max_tokens {m}"
            )));
        }
        if msg.len() != HEADER + n * (meta + rb) {
            return Err(mismatch(format!("slot {src} sent a malformed dispatch ({n} tokens)")));
        }
        let mut from = Vec::with_capacity(n);
        let rows = HEADER + n * meta;
        let mut per_expert = vec![0u32; el];
        for i in 0..n {
            let at = HEADER + i * meta;
            let tok = u32_at(msg, at);
            let mut places = Vec::new();
            for j in 0..k {
                let le = u32_at(msg, at + 4 + 4 * j) as i32;
                let w = if with_weights {
                    f32::from_bits(u32_at(msg, at + 4 + 4 * k + 4 * j))
                } else {
                    0.0
                };
                if le < 0 {
                    continue;
                }
                let le = le as usize;
                if le >= el {
                    return Err(mismatch(format!("slot {src} chose local expert {le} of {el}")));
                }
                let row = src as usize * m + per_expert[le] as usize;
                per_expert[le] += 1;
                let dst = le * block + row * rb;
                x[dst..dst + rb].copy_from_slice(&msg[rows + i * rb..rows + (i + 1) * rb]);
                layout[le].push((src, tok));
                places.push((le as u16, row as u32, w));
            }
            from.push(places);
        }
        for (c, p) in counts.iter_mut().zip(&per_expert) {
            *c += p;
        }
        recv.push(from);
    }
    Ok((
        counts,
        Handle { cfg: *cfg, epoch, slots, tokens, layout, sent, recv, weights: None, all_weighted },
    ))
}

/// `acc[e] += w * row[e]` for a row of `dtype` (one match per row, a loop the compiler
/// vectorises).
fn axpy(dtype: DType, acc: &mut [f32], row: &[u8], w: f32) {
    match dtype {
        DType::BF16 => {
            for (a, c) in acc.iter_mut().zip(row.chunks_exact(2)) {
                *a += w * f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => {
            for (a, c) in acc.iter_mut().zip(row.chunks_exact(4)) {
                *a += w * f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Appends `acc` as a row of `dtype`.
fn store_row(dtype: DType, out: &mut Vec<u8>, acc: &[f32]) {
    let start = out.len();
    out.resize(start + acc.len() * dtype.size(), 0);
    let dst = &mut out[start..];
    match dtype {
        DType::BF16 => {
            for (c, &a) in dst.chunks_exact_mut(2).zip(acc) {
                c.copy_from_slice(&bf16::from_f32(a).to_le_bytes());
            }
        }
        _ => {
            for (c, &a) in dst.chunks_exact_mut(4).zip(acc) {
                c.copy_from_slice(&a.to_le_bytes());
            }
        }
    }
}

/// Weighs and sums the experts' outputs `y` (`[E_local, R*M, H]`, the dispatch's layout) back
/// into this rank's tokens: returns `[T, H]` where token `t` is the sum over its choices `k`
/// on slots still active of `weights[t, k] * y(expert, row)`. `weights` is `[T, K]` f32.
///
/// When every rank's dispatch carried its weights, the combine uses those and runs one round
/// instead of two; `weights` may then be `None`, and weights that differ from the dispatched
/// ones fail the call with `InvalidArgument` (after it took part, so the peers' results stand).
pub async fn combine(
    group: &Group,
    y: &[u8],
    weights: Option<&[f32]>,
    active: &mut [bool],
    handle: &Handle,
) -> Result<Vec<u8>> {
    let cfg = &handle.cfg;
    let (k, rb, h) = (cfg.topk, cfg.row_bytes(), cfg.hidden);
    let bad = |d: String| Err(Error::new(ErrorKind::InvalidArgument, "combine", d));
    if y.len() != cfg.recv_bytes() {
        return bad(format!(
            "y is {} bytes, the dispatch's layout is {}",
            y.len(),
            cfg.recv_bytes()
        ));
    }
    let carried = handle.all_weighted.then_some(handle.weights.as_deref()).flatten();
    let (weights, differ) = match (weights, carried) {
        (Some(w), _) if w.len() != handle.tokens * k => {
            return bad(format!("{} weights for {} tokens of top-{k}", w.len(), handle.tokens));
        }
        (Some(w), Some(d)) => (d, w.iter().zip(d).any(|(a, b)| a.to_bits() != b.to_bits())),
        (Some(w), None) => (w, false),
        (None, Some(d)) => (d, false),
        (None, None) => {
            return bad("no weights: pass them to combine, or to every rank's dispatch".into());
        }
    };
    if active.len() != cfg.num_ranks as usize {
        return bad(format!(
            "active_ranks has {} entries for {} ranks",
            active.len(),
            cfg.num_ranks
        ));
    }
    let index: std::collections::HashMap<u32, usize> =
        handle.slots.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let block = cfg.num_ranks as usize * cfg.max_tokens * rb;
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let before = group.epoch();
        // Round 1: the weights of the choices each destination holds, in dispatch order.
        let wbuild = |slots: &[u32]| -> (Vec<u8>, Vec<u64>) {
            let mut m = Vec::new();
            let mut lens = Vec::with_capacity(slots.len());
            for dst in slots {
                let start = m.len();
                if let Some(&j) = index.get(dst) {
                    for (tok, ks) in &handle.sent[j] {
                        for &kk in ks {
                            m.extend_from_slice(
                                &weights[*tok as usize * k + kk as usize].to_le_bytes(),
                            );
                        }
                    }
                }
                lens.push((m.len() - start) as u64);
            }
            (m, lens)
        };
        let exchanged = if carried.is_some() {
            // Every choice's weight came with its token.
            Ok((handle.slots.clone(), Vec::new(), vec![0; handle.slots.len()]))
        } else {
            group.alltoallv_with(wbuild).await
        };
        let (slots, ws) = match exchanged {
            Ok((slots, data, lens)) => {
                let ws: Vec<Vec<u8>> =
                    split(&data, &lens).into_iter().map(<[u8]>::to_vec).collect();
                (slots, ws)
            }
            Err(e) if group.epoch() != before && e.kind() != ErrorKind::InvalidArgument => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        // Round 2: one weighted row per received token, back to its source.
        let mut partial: Vec<Vec<u8>> = Vec::with_capacity(slots.len());
        for (src, w) in slots.iter().zip(&ws) {
            let mut m = Vec::new();
            if let Some(&j) = index.get(src) {
                let toks = &handle.recv[j];
                let choices: usize = toks.iter().map(Vec::len).sum();
                if carried.is_none() && w.len() != 4 * choices {
                    return Err(Error::new(
                        ErrorKind::Mismatch,
                        "combine",
                        format!("slot {src} sent {} weights for {choices} choices", w.len() / 4),
                    ));
                }
                let mut wi = 0;
                let mut acc = vec![0f32; h];
                for places in toks {
                    acc.iter_mut().for_each(|a| *a = 0.0);
                    for &(le, row, carried_wt) in places {
                        let wt = match carried {
                            Some(_) => carried_wt,
                            None => {
                                f32::from_le_bytes(w[4 * wi..4 * wi + 4].try_into().expect("4"))
                            }
                        };
                        wi += 1;
                        let at = le as usize * block + row as usize * rb;
                        axpy(cfg.dtype, &mut acc, &y[at..at + rb], wt);
                    }
                    store_row(cfg.dtype, &mut m, &acc);
                }
            }
            partial.push(m);
        }
        let expected = slots.clone();
        let pbuild = |now: &[u32]| -> (Vec<u8>, Vec<u64>) {
            let mut m = Vec::new();
            let mut lens = Vec::with_capacity(now.len());
            for s in now {
                let p =
                    expected.iter().position(|x| x == s).map(|i| &partial[i][..]).unwrap_or(&[]);
                m.extend_from_slice(p);
                lens.push(p.len() as u64);
            }
            (m, lens)
        };
        let (slots2, rows) = match group.alltoallv_with(pbuild).await {
            Ok((slots, data, lens)) => {
                let rows: Vec<Vec<u8>> =
                    split(&data, &lens).into_iter().map(<[u8]>::to_vec).collect();
                (slots, rows)
            }
            Err(e) if group.epoch() != before && e.kind() != ErrorKind::InvalidArgument => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        refresh_mask(active, &slots2);
        // Sum the partial rows in slot order.
        let mut acc = vec![0f32; handle.tokens * h];
        for (dst, body) in slots2.iter().zip(&rows) {
            let Some(&j) = index.get(dst) else { continue };
            if !active.get(*dst as usize).copied().unwrap_or(false) {
                continue;
            }
            let sent = &handle.sent[j];
            if body.len() != sent.len() * rb {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    "combine",
                    format!("slot {dst} sent {} bytes for {} tokens", body.len(), sent.len()),
                ));
            }
            for (i, (tok, _)) in sent.iter().enumerate() {
                let row = &body[i * rb..(i + 1) * rb];
                axpy(cfg.dtype, &mut acc[*tok as usize * h..(*tok as usize + 1) * h], row, 1.0);
            }
        }
        if differ {
            return bad("the weights differ from the ones the dispatch carried".into());
        }
        let mut out = Vec::with_capacity(handle.tokens * rb);
        store_row(cfg.dtype, &mut out, &acc);
        return Ok(out);
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::PeerFailed, "combine", "no attempt ran")))
}

/// Bytes this rank puts on the wire for a dispatch and the following combine (rows and their
/// routing, not counting the PG's own frames): what `kvfs bench ep` reports.
pub fn wire_bytes(handle: &Handle, me: u32) -> u64 {
    let cfg = &handle.cfg;
    let mut b = 0u64;
    for (j, &s) in handle.slots.iter().enumerate() {
        if s == me {
            continue;
        }
        let sent = &handle.sent[j];
        let choices: usize = sent.iter().map(|(_, ks)| ks.len()).sum();
        let carried = if handle.weights.is_some() { 4 * cfg.topk } else { 0 };
        let round = if handle.all_weighted { 0 } else { 4 * choices };
        b += (HEADER + sent.len() * (4 + 4 * cfg.topk + carried + cfg.row_bytes()) + round) as u64;
        b += (handle.recv[j].len() * cfg.row_bytes()) as u64;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EpConfig {
        EpConfig {
            num_experts: 8,
            num_ranks: 4,
            hidden: 3,
            topk: 2,
            max_tokens: 4,
            dtype: DType::F32,
        }
    }

    #[test]
    fn experts_map_to_slots_evenly() {
        let c = cfg();
        assert_eq!(expert_slot(&c, 0), Some((0, 0)));
        assert_eq!(expert_slot(&c, 5), Some((2, 1)));
        assert_eq!(expert_slot(&c, -1), None);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let c = cfg();
        let ok = vec![true; 4];
        assert!(check_inputs(&c, 12 * 2, &[0, 1, 2, 3], &ok).is_ok());
        assert!(check_inputs(&c, 12, &[0, 8], &ok).is_err());
        assert!(check_inputs(&c, 12, &[0, -2], &ok).is_err());
        assert!(check_inputs(&c, 11, &[0, 1], &ok).is_err());
        assert!(check_inputs(&c, 12, &[0, 1], &ok[..3]).is_err());
        let odd = EpConfig { num_experts: 7, ..c };
        assert!(odd.validate().is_err());
        let f16 = EpConfig { dtype: DType::F16, ..c };
        assert!(f16.validate().is_err());
    }
}
