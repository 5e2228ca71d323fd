"""kvfs-ep dispatch/combine against the all-gather fallback, same processes, same run.

N processes (spawn) form one kvfs-pg group. Each MoE layer step is: route T tokens of H
bfloat16 elements per rank to top-K of E experts, every expert scales its rows, combine the
weighted rows back. Two ways, timed back to back on the same data:

- ep: kvfs.ep.dispatch + combine (each token crosses once per destination rank);
- fallback: what the reference does without a device fast path: all-gather every rank's
  tokens, choices and weights, run each local expert on the tokens (of every rank) that chose
  it, and all-reduce the [R*T, H] weighted sums (kvfs-pg's allgather and allreduce, so both
  sides run on the same transport).

Both sides keep their buffers from step to step, and both run each expert on exactly the
rows routed to it (ep on its contiguous row blocks, the fallback on the gathered tokens).

Rank 0 reports p50/p99 of the whole step and the bytes it sent: ep's from the handle (rows and
routing), the fallback's from its algorithm (allgather: its blocks to every peer; allreduce:
2(R-1)/R of the buffer). Both results are checked equal before timing.

    python python/bench/bench_ep.py --procs 2,4,8 --tokens 128,512
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

E, K, H = 32, 4, 4096


def to_bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def factors(r):
    return (np.arange(E, dtype=np.float32) + 1) / E


def worker(addr, rank, nprocs, tokens, iters, out):
    from kvfs import ep, pg

    g = pg.Group(addr, rank, nprocs)
    rng = np.random.default_rng(rank)
    el = E // nprocs
    f = factors(nprocs)
    res = {}
    for t in tokens:
        x = to_bf16(rng.standard_normal((t, H)).astype(np.float32))
        idx = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int64)
        w = rng.random((t, K)).astype(np.float32)

        # Both sides keep their buffers from step to step, as an engine does.
        recv_buf = np.zeros((el, nprocs * t, H), np.uint16)
        xs = np.empty((nprocs * t, H), np.uint16)
        ids = np.empty((nprocs * t, K), np.int64)
        ws = np.empty((nprocs * t, K), np.float32)

        def step_ep():
            # The router's weights travel with the tokens (DeepEP's normal dispatch takes them).
            recv, counts, h = ep.dispatch(g, x, idx, E, t, dtype="bfloat16", out=recv_buf,
                                          topk_weights=w)
            # Each expert works on the row blocks it received, as a real one's GEMM does.
            for le, blocks in enumerate(h.blocks(t)):
                for a, b in blocks:
                    blk = recv[le, a:b]
                    blk[:] = to_bf16(from_bf16(blk) * f[rank * el + le])
            return ep.combine(g, recv, None, h), h

        def step_fallback():
            g.allgather(x, xs)
            g.allgather(idx, ids)
            g.allgather(w, ws)
            # Each local expert runs on the tokens (of every rank) that chose it and adds its
            # weighted output to theirs; the all-reduce sums the experts of every rank.
            xf = from_bf16(xs)
            acc = np.zeros((nprocs * t, H), np.float32)
            for le in range(el):
                e = rank * el + le
                tok, kk = np.nonzero(ids == e)
                if len(tok):
                    acc[tok] += (ws[tok, kk] * f[e])[:, None] * xf[tok]
            part = to_bf16(acc)
            g.allreduce(part, "sum", dtype="bfloat16")
            return part[rank * t:(rank + 1) * t]

        a, h = step_ep()
        b = step_fallback()
        diff = float(np.abs(from_bf16(a) - from_bf16(b)).max())
        times = {"ep": [], "fallback": []}
        for _ in range(iters):
            for name, fn in (("ep", step_ep), ("fallback", step_fallback)):
                g.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        row_b = H * 2
        ag = (nprocs - 1) * t * (row_b + K * 8 + K * 4)
        ar = 2 * (nprocs - 1) / nprocs * nprocs * t * row_b
        res[t] = dict(ep=times["ep"], fallback=times["fallback"], diff=diff,
                      ep_bytes=h.wire_bytes(rank), fb_bytes=int(ag + ar))
    out.put((rank, res))
    g.barrier()
    g.close()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    import multiprocessing as mp

    from kvfs import pg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="2,4,8")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    procs = [int(p) for p in a.procs.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    import kvfs._native
    profile = getattr(kvfs._native, "BUILD_PROFILE", "unknown")
    print(f"kvfs bench ep: E={E} experts, top-{K}, H={H} bfloat16, {a.iters} steps each, "
          f"{os.cpu_count()} CPUs, kvfs wheel: {profile}")
    if profile != "release":
        print(f"warning: the kvfs wheel is not a release build ({profile}): its figures are "
              "not kvfs's "
              "(install a release wheel: pip install ./python)", file=sys.stderr)
    print(f"{'procs':>5} {'tokens':>6} | {'ep p50 ms':>9} {'p99':>7} {'KiB sent':>9} | "
          f"{'fallback p50':>12} {'p99':>7} {'KiB sent':>9} | {'speedup':>7} {'bytes 1/x':>9}")
    ctx = mp.get_context("spawn")
    for n in procs:
        if E % n:
            print(f"{n:>5} skipped: {E} experts do not split over {n} ranks")
            continue
        coord = pg.Coordinator(world=n)
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(coord.addr, r, n, tokens, a.iters, q), daemon=True)
              for r in range(n)]
        for p in ps:
            p.start()
        got = dict(q.get(timeout=600) for _ in ps)
        for p in ps:
            p.join(60)
        for t in tokens:
            r0 = got[0][t]
            worst = max(got[r][t]["diff"] for r in got)
            e50, e99 = pct(r0["ep"], 50) * 1e3, pct(r0["ep"], 99) * 1e3
            f50, f99 = pct(r0["fallback"], 50) * 1e3, pct(r0["fallback"], 99) * 1e3
            print(f"{n:>5} {t:>6} | {e50:>9.2f} {e99:>7.2f} {r0['ep_bytes'] / 1024:>9.0f} | "
                  f"{f50:>12.2f} {f99:>7.2f} {r0['fb_bytes'] / 1024:>9.0f} | "
                  f"{f50 / e50:>6.2f}x {r0['fb_bytes'] / max(r0['ep_bytes'], 1):>8.2f}x"
                  + ("" if worst < 0.5 else f"  (results differ by {worst})"))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
